"""One fact, one object (issue 48): where the agent keeps the same name or address in several
structures, they hold the same object, not equal copies (each copy was 37-60 bytes per Service
at 100,000 Services: bench/README.md, Memory per structure). What is equal is checked
elsewhere; these check identity, which no other test sees."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from ipaddress import ip_address

import pytest

from cozyebpf.datapath.codec import Mirror
from cozyebpf.datapath.slots import decode_name, encode_name
from cozyebpf.model import IncrementalModel, SliceRecord, read_objects
from cozyebpf.sources.kube import KubeSource
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry
from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from tests.support.labtools import wait_for

VM = Svc("vm1", "203.0.113.10", "198.51.100.10", [("TCP", 22)], namespace="tenant-a")


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as a:
        for o in objects(VM):
            a.apply(o)
        yield a


def test_the_informer_cache_keys_an_object_by_its_records_own_strings(api: FakeKubeAPI) -> None:
    """The cache's (namespace, name) and the record's ref are the same two strings; a slice's
    namespace, the Service it names and its pod's namespace are the Service's strings."""
    src = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5)
    src.start(lambda: None)
    try:
        wait_for(lambda: src.synced, 10, "the lists")
        caches = {i.resource.kind: i.cache for i in src.informers}
        ((svc_key, svc),) = caches["Service"].items()
        ((slice_key, sl),) = caches["EndpointSlice"].items()
        assert svc_key[0] is svc.ref.namespace and svc_key[1] is svc.ref.name
        assert slice_key[0] is sl.ref.namespace and slice_key[1] is sl.ref.name
        assert sl.ref.namespace is svc.ref.namespace and sl.service is svc.ref.name
        ns, pod, _node = sl.pods  # flat: one tuple for the slice's one pod
        assert ns is svc.ref.namespace and pod == "vm1-pod"
    finally:
        src.stop()


def test_a_name_read_back_from_svcnames_is_the_models_string() -> None:
    """decode_name interns: a full sync reads every Service's name from the maps, and the
    mirror and the counter slots keep what it read."""
    composed = sys.intern("tenant-a/" + "vm1")
    read = decode_name(bytes(encode_name(composed, True)))
    assert read.service == composed and read.service is composed


def _state() -> MapState:
    lb, lb2, pod = (ip_address(a) for a in ("203.0.113.10", "203.0.113.11", "198.51.100.10"))
    st = MapState()
    st.services[lb] = ServiceEntry(pod, True, False, "tenant-a/vm1")
    st.services[lb2] = ServiceEntry(pod, True, False, "tenant-a/vm1")
    st.pods[pod] = PodEntry(lb, True, False, "tenant-a/vm1")
    st.allowed = {AllowedPort(pod, Proto.TCP, 22), AllowedPort(pod, Proto.TCP, 80)}
    return st


def test_the_mirror_holds_an_address_as_one_bytes_object() -> None:
    """Linked first (as apply and read_state do), the LB roles' objects are those the pod's
    role, its ports and its LB IPs use."""
    m = Mirror.of(_state())
    (lb, lb2), (pod,) = sorted(m.svc), list(m.pod)
    assert m.svc[lb][0] is pod and m.svc[lb2][0] is pod
    assert m.pod[pod][0] is lb
    assert next(iter(m.ports)) is pod and next(iter(m.lbs_of)) is pod
    assert m.lbs(pod) == (lb, lb2) and m.lbs(pod)[0] is lb


def test_a_pod_set_before_its_lb_ip_keeps_what_it_was_given() -> None:
    """The other order is still right, only not shared (what the sharing leans on)."""
    m = Mirror()
    pod, lb = bytes([198, 51, 100, 10]), bytes([203, 0, 113, 10])
    m.set_pod(pod, lb, 0, "tenant-a/vm1")
    m.link(bytes(lb), bytes(pod), 0, "tenant-a/vm1")
    assert m.pod[pod][0] == lb and m.svc[lb][0] == pod and m.refs == {"tenant-a/vm1": 2}


def test_the_model_keys_a_services_output_as_its_evaluation() -> None:
    """An output, an evaluation: one (namespace, name) tuple; an EndpointSlice defined once is
    its bare record, its Service found through its namespace's names."""
    objs = read_objects(objects(VM))
    model = IncrementalModel()
    model.replace(objs)
    model.flush()
    (key_e,), (key_o,) = list(model._evals), list(model._outputs)
    assert key_o is key_e
    (sl,) = model.slices.values()
    assert isinstance(sl, SliceRecord)
    assert model.slice_records(("tenant-a", sl.ref.name)) == (sl,)
    assert model._slices_of == {"tenant-a": {"vm1": ("tenant-a", sl.ref.name)}}


def test_a_slice_defined_twice_comes_and_goes() -> None:
    """A manifest may define an EndpointSlice twice: the model keeps both records, and the
    index by namespace lets go of it once when it goes."""
    slice_obj = objects(VM)[1]
    objs = read_objects([objects(VM)[0], slice_obj, slice_obj])
    model = IncrementalModel()
    model.replace(objs)
    model.flush()
    (recs,) = model.slices.values()
    assert isinstance(recs, tuple) and len(recs) == 2
    model.replace(read_objects([objects(VM)[0]]))
    model.flush()
    assert model.slices == {} and model._slices_of == {}
