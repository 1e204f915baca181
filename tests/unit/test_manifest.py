"""The manifest source: parsing, error messages, and change detection; read whole or not at
all (issue 37): the race of a truncation between the watch's event batch and its snapshot,
made deterministic through the watch thread's seam; a real writer that truncates and stalls;
a read that removes most Services waits for a second read."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest

from cozyebpf.errors import SourceError, TemporaryError
from cozyebpf.model import ObjectSet, build_state
from cozyebpf.sources import ChangeSet
from cozyebpf.sources.manifest import ManifestSource
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry
from tests.support.clock import FakeClock

KEEP = "the previous state stays programmed"

SERVICE = """\
apiVersion: v1
kind: Service
metadata:
  name: vm1
  namespace: tenant-a
  labels:
    service.kubernetes.io/service-proxy-name: cozy-proxy
  annotations:
    networking.cozystack.io/wholeIP: "false"
    networking.cozystack.io/allowICMP: "true"
  creationTimestamp: 2024-01-02T03:04:05Z
spec:
  type: LoadBalancer
  ports:
  - name: ssh
    port: 22
  - name: dns
    port: 53
    protocol: UDP
status:
  loadBalancer:
    ingress:
    - ip: 192.0.2.10
"""

SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: vm1-x7k2p
  namespace: tenant-a
  labels:
    kubernetes.io/service-name: vm1
addressType: IPv4
endpoints:
- addresses: ["10.244.0.5"]
  conditions: {ready: true}
"""

SERVICE_OBJ: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {
        "name": "vm1",
        "namespace": "tenant-a",
        "labels": {"service.kubernetes.io/service-proxy-name": "cozy-proxy"},
        "annotations": {
            "networking.cozystack.io/wholeIP": "false",
            "networking.cozystack.io/allowICMP": "true",
        },
        "creationTimestamp": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    },
    "spec": {
        "type": "LoadBalancer",
        "ports": [{"name": "ssh", "port": 22}, {"name": "dns", "port": 53, "protocol": "UDP"}],
    },
    "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}},
}
SLICE_OBJ: dict[str, Any] = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {
        "name": "vm1-x7k2p",
        "namespace": "tenant-a",
        "labels": {"kubernetes.io/service-name": "vm1"},
    },
    "addressType": "IPv4",
    "endpoints": [{"addresses": ["10.244.0.5"], "conditions": {"ready": True}}],
}
#: the Service and its slice: what the file becomes in the tests of change detection (a change
#: that keeps the Service: one that removes most Services waits for a second read)
BOTH = SERVICE + "---\n" + SLICE
CONFIGMAP_OBJ = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}


def _indent(text: str) -> str:
    return "".join("  " + line + "\n" for line in text.splitlines())


LOAD_CASES: list[tuple[str, str, list[dict[str, Any]]]] = [
    ("empty-file", "", []),
    ("only-comments", "# nothing here\n---\n# still nothing\n", []),
    ("two-documents", SERVICE + "---\n" + SLICE, [SERVICE_OBJ, SLICE_OBJ]),
    (
        "empty-documents-and-separators",
        "---\n---\n" + SERVICE + "---\n\n---\n" + SLICE + "---\n",
        [SERVICE_OBJ, SLICE_OBJ],
    ),
    (
        "other-kinds-passed-through",
        "kind: ConfigMap\napiVersion: v1\nmetadata: {name: c}\n",
        [CONFIGMAP_OBJ],
    ),
    (
        "kind-list-flattened",
        "apiVersion: v1\nkind: List\nitems:\n- "
        + _indent(SERVICE).lstrip()
        + "- "
        + _indent(SLICE).lstrip()
        + "- null\n",
        [SERVICE_OBJ, SLICE_OBJ],
    ),
    ("kind-list-without-items", "apiVersion: v1\nkind: List\n", []),
    (
        "list-and-documents",
        "kind: List\nitems:\n- " + _indent(SLICE).lstrip() + "---\n" + SERVICE,
        [SLICE_OBJ, SERVICE_OBJ],
    ),
    ("utf8-bom", "\ufeff" + SLICE, [SLICE_OBJ]),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES]
)
def test_load(tmp_path: Path, text: str, expected: list[dict[str, Any]]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text, encoding="utf-8")
    assert ManifestSource(path).load() == expected


ERROR_CASES: list[tuple[str, bytes, str]] = [
    (
        "mapping-values",
        b"kind: Service\nmetadata:\n  name: a: b\n",
        f"m.yaml: line 3, column 10: mapping values are not allowed here; {KEEP}",
    ),
    (
        "bad-indentation",
        SLICE.encode() + b"  extra: 1\n bad: 2\n",
        "m.yaml: line 13, column 2: expected <block end>, but found '<block mapping start>' "
        f"(while parsing a block mapping that starts at line 1); {KEEP}",
    ),
    (
        "unclosed-flow-sequence",
        b"kind: Service\nspec:\n  ports: [1, 2\n",
        "m.yaml: line 4, column 1: expected ',' or ']', but got '<stream end>' "
        f"(while parsing a flow sequence that starts at line 3); {KEEP}",
    ),
    (
        "python-tag",
        b"kind: Service\nx: !!python/object:os.system ls\n",
        "m.yaml: line 2, column 4: could not determine a constructor for the tag "
        f"'tag:yaml.org,2002:python/object:os.system'; {KEEP}",
    ),
    (
        "top-level-list",
        b"- kind: Service\n",
        "m.yaml: document 1 (line 1) is a list, not a Kubernetes object; fix its indentation or "
        f"remove it; {KEEP}",
    ),
    (
        "scalar-document",
        SLICE.encode() + b"---\n\n\njust words\n",
        "m.yaml: document 2 (line 15) is a string, not a Kubernetes object; fix its indentation "
        f"or remove it; {KEEP}",
    ),
    (
        "list-items-not-a-list",
        b"kind: List\nitems: {a: 1}\n",
        "m.yaml: document 1 (line 1): items of a List must be a list but is a mapping; fix the "
        f"file; {KEEP}",
    ),
    (
        "list-item-not-a-mapping",
        b"---\nkind: List\nitems:\n- kind: Service\n- 42\n",
        "m.yaml: document 1 (line 2): items[1] is a number, not a Kubernetes object; fix or "
        f"remove it; {KEEP}",
    ),
    (
        "not-utf8",
        b"kind: Service\nmetadata: {name: \xff}\n",
        f"m.yaml: line 2, column 18: byte 0xff is not valid UTF-8; save the file as UTF-8; {KEEP}",
    ),
    (
        "control-character",
        b"kind: Service\nmetadata:\n  name: a\x00b\n",
        f"m.yaml: line 3, column 10: character #x0000 is not allowed in YAML; remove it; {KEEP}",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_load_errors_name_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("m.yaml").write_bytes(data)
    src = ManifestSource("m.yaml")
    with pytest.raises(SourceError) as info:
        src.load()
    assert str(info.value) == message
    assert isinstance(info.value, TemporaryError)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "examples" / "x.yaml"
    src = ManifestSource(str(path))
    for _ in range(2):  # reported again on every poll until the file appears
        assert src.changed()
        with pytest.raises(SourceError) as info:
            src.load()
        assert str(info.value) == f"{path}: no such file; {KEEP}"
    path.parent.mkdir()
    path.write_text(SLICE)
    assert src.changed()
    assert src.load() == [SLICE_OBJ]
    assert not src.changed()
    path.unlink()
    assert src.changed()


def test_unreadable_path_stays_changed(tmp_path: Path) -> None:
    src = ManifestSource(tmp_path)  # a directory: stat works, open does not
    with pytest.raises(SourceError) as info:
        src.load()
    assert str(info.value) == f"{tmp_path}: cannot be read: Is a directory; {KEEP}"
    assert src.changed()


def _set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def test_changed(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(SLICE)
    _set_mtime(path, 1_000_000_000_000_000_000)
    src = ManifestSource(path)
    assert src.changed(), "the first call is always True"
    assert src.changed(), "and stays True until load()"
    assert src.load() == [SLICE_OBJ]
    assert not src.changed()
    assert not src.changed()

    # in-place rewrite, same size, new mtime
    path.write_text(SLICE.replace("10.244.0.5", "10.244.0.6"))
    _set_mtime(path, 1_000_000_000_000_000_001)
    assert src.changed()
    assert src.load()[0]["endpoints"][0]["addresses"] == ["10.244.0.6"]
    assert not src.changed()

    # in-place rewrite, same mtime, new size
    path.write_text(SLICE + "# comment\n")
    _set_mtime(path, 1_000_000_000_000_000_001)
    assert src.changed()
    src.load()
    assert not src.changed()

    # an editor's atomic rename: same size and mtime, new inode
    tmp = tmp_path / ".m.yaml.swp"
    tmp.write_text(SLICE.replace("10.244.0.5", "10.244.0.7") + "# comment\n")
    _set_mtime(tmp, 1_000_000_000_000_000_001)
    os.replace(tmp, path)
    assert src.changed()
    assert src.load()[0]["endpoints"][0]["addresses"] == ["10.244.0.7"]
    assert not src.changed()


def test_bad_yaml_is_reported_once_until_fixed(tmp_path: Path) -> None:
    """A file that fails to parse is not re-read until it changes; then the fix is picked up."""
    path = tmp_path / "m.yaml"
    path.write_text("kind: Service\nmetadata:\n  name: a: b\n")
    src = ManifestSource(path)
    assert src.changed()
    with pytest.raises(SourceError):
        src.load()
    assert not src.changed()
    path.write_text(SERVICE)
    assert src.changed()
    assert src.load() == [SERVICE_OBJ]


def test_manifest_to_state(tmp_path: Path) -> None:
    """The YAML a user writes (unquoted IPs and timestamps) gives the expected state."""
    path = tmp_path / "m.yaml"
    path.write_text(SERVICE + "---\n" + SLICE)
    result = build_state(ManifestSource(path).load())
    pod, lb = IPv4Address("10.244.0.5"), IPv4Address("192.0.2.10")
    assert result.state == MapState(
        services={lb: ServiceEntry(pod, True, True)},
        pods={pod: PodEntry(lb, True, True)},
        allowed={AllowedPort(pod, Proto.TCP, 22), AllowedPort(pod, Proto.UDP, 53)},
    )
    assert result.problems == []


@pytest.mark.parametrize("how", ["in-place", "rename", "configmap"])
def test_changes_are_seen_through_inotify(tmp_path: Path, how: str) -> None:
    """With a poll interval of an hour, a change still wakes the agent at once: an in-place
    write, an editor's atomic rename, and a ConfigMap volume's `..data` symlink swap."""
    import threading

    woke = threading.Event()
    if how == "configmap":  # what the kubelet's atomic writer does
        (tmp_path / "..v1").mkdir()
        (tmp_path / "..v1" / "m.yaml").write_text(SERVICE)
        (tmp_path / "..data").symlink_to("..v1")
        (tmp_path / "m.yaml").symlink_to("..data/m.yaml")
    else:
        (tmp_path / "m.yaml").write_text(SERVICE)
    src = ManifestSource(tmp_path / "m.yaml", poll_interval=3600)
    assert src.take() is not None
    src.start(woke.set)
    try:
        assert src.inotify
        (tmp_path / "other.txt").write_text("not ours")  # another file: no wake-up
        time.sleep(0.2)
        assert not woke.is_set()
        if how == "in-place":
            (tmp_path / "m.yaml").write_text(BOTH)
        elif how == "rename":
            (tmp_path / ".m.yaml.tmp").write_text(BOTH)
            os.replace(tmp_path / ".m.yaml.tmp", tmp_path / "m.yaml")
        else:
            (tmp_path / "..v2").mkdir()
            (tmp_path / "..v2" / "m.yaml").write_text(BOTH)
            (tmp_path / "..data_tmp").symlink_to("..v2")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        assert woke.wait(10), "inotify did not report the change"
        changes = src.take()
        assert changes is not None and changes.whole is not None
        assert list(changes.whole.slices) == [("tenant-a", "vm1-x7k2p")]
    finally:
        src.stop()


class QuietInotify:
    """The watch's inotify when nothing more happened after a batch."""

    def names(self, timeout: float) -> None:
        return None


def test_a_batch_that_leaves_the_file_as_taken_wakes_nothing(tmp_path: Path) -> None:
    """The kubelet's atomic writer, one step per batch (as a loaded machine delivers them): its
    new `..v2` directory and the `..data_tmp` link say "whole" but leave the file as taken, so
    they wake nothing (the agent would find nothing to take: a full run of the suite once
    woke at `..v2`); the swap of `..data` hands the new file over."""
    from cozyebpf.sources.manifest import _IN_CREATE, _IN_MOVED_FROM, _IN_MOVED_TO

    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "m.yaml").write_text(SERVICE)
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "m.yaml").symlink_to("..data/m.yaml")
    src = ManifestSource(tmp_path / "m.yaml", poll_interval=3600)
    assert whole_services(src.take()) == VM1
    quiet = QuietInotify()
    (tmp_path / "..v2").mkdir()
    assert src._batch(quiet, [("..v2", _IN_CREATE)]) is False  # type: ignore[arg-type]
    (tmp_path / "..v2" / "m.yaml").write_text(BOTH)
    (tmp_path / "..data_tmp").symlink_to("..v2")
    assert src._batch(quiet, [("..data_tmp", _IN_CREATE)]) is False  # type: ignore[arg-type]
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    moved = [("..data_tmp", _IN_MOVED_FROM), ("..data", _IN_MOVED_TO)]
    assert src._batch(quiet, moved) is True  # type: ignore[arg-type]
    changes = src.take()
    assert changes is not None and changes.whole is not None
    assert list(changes.whole.slices) == [("tenant-a", "vm1-x7k2p")]


def test_a_file_being_written_is_read_once_it_is_whole(tmp_path: Path) -> None:
    """A writer that truncates the file and then writes it leaves it empty for a moment: read
    then, it would be a manifest without Services. take() reads a changed file only once its
    signature has stayed the same for half a poll interval (or inotify said its writer closed
    it: test_changes_are_seen_through_inotify)."""
    path = tmp_path / "m.yaml"
    path.write_text(SERVICE)
    clock = FakeClock()
    src = ManifestSource(path, poll_interval=0.2, clock=clock)
    first = src.take()
    assert first is not None and first.whole is not None and first.whole.services
    with open(path, "w") as f:  # truncated, not yet written
        changes = src.take()
        assert changes is not None and changes.whole is None  # not read: the state stays
        clock.advance(0.15)
        f.write(BOTH)
    changes = src.take()  # written, but just now: not yet
    assert changes is not None and changes.whole is None
    clock.advance(0.09)
    changes = src.take()  # unchanged for less than half the poll interval: not yet
    assert changes is not None and changes.whole is None
    clock.advance(0.02)
    changes = src.take()
    assert changes is not None and changes.whole is not None
    assert list(changes.whole.slices) == [("tenant-a", "vm1-x7k2p")]


def test_a_writer_seen_by_inotify_is_waited_for(tmp_path: Path) -> None:
    """A writer that stalls between its truncation and its write (a loaded node) would leave an
    empty file quiet for longer than half a poll interval: while inotify has seen the file
    modified and not closed, take() waits for the close, or for WRITER_GRACE of quiet (a writer
    that keeps the file open)."""
    import threading

    from cozyebpf.sources.manifest import WRITER_GRACE

    path = tmp_path / "m.yaml"
    path.write_text(SERVICE)
    clock = FakeClock()
    woke = threading.Event()
    src = ManifestSource(path, poll_interval=0.2, clock=clock)
    assert src.take() is not None
    src.start(woke.set)
    try:
        assert src.inotify
        for closes in (True, False):
            woke.clear()
            with open(path, "w") as f:  # truncated: inotify reports a modification, no close
                deadline = time.monotonic() + 10
                while not src._writing:
                    assert time.monotonic() < deadline, "inotify did not report the truncation"
                    time.sleep(0.01)
                changes = src.take()
                assert changes is not None and changes.whole is None
                clock.advance(0.5)  # quiet for longer than half a poll interval
                changes = src.take()
                assert changes is not None and changes.whole is None, "read while being written"
                f.write(BOTH)
                f.flush()
                time.sleep(0.2)  # the watch thread sees the write
                if closes:
                    f.close()  # the close hands the file over (a poll may wake the agent too)
                    wait(lambda: handed(src), "inotify did not report the close")
                else:
                    assert src.take().whole is None  # type: ignore[union-attr]
                    clock.advance(WRITER_GRACE)
                changes = src.take()
                assert changes is not None and changes.whole is not None
                assert list(changes.whole.slices) == [("tenant-a", "vm1-x7k2p")]
            path.write_text(SERVICE)  # back to the first content, read whole at its close
            # the agent's loop turns until it takes a whole read: SERVICE, never the empty
            # file its writer truncated first (which the watch may see, then hold)
            whole = first_whole(src)
            assert set(whole.services) == VM1 and not whole.slices
    finally:
        src.stop()


def test_a_write_in_progress_does_not_wake_the_agent(tmp_path: Path) -> None:
    """The watch thread notes a modification (the file is being written) without waking the
    agent, which would find it not whole; the writer's close wakes it, and the file is whole
    then (test_changes_are_seen_through_inotify reads at that wake-up)."""
    import threading

    path = tmp_path / "m.yaml"
    path.write_text(SERVICE)
    woke = threading.Event()
    src = ManifestSource(path, poll_interval=3600)  # no wake-up by the poll
    assert src.take() is not None
    src.start(woke.set)
    try:
        with open(path, "w") as f:
            f.write(BOTH)
            f.flush()
            deadline = time.monotonic() + 10
            while not src._writing:
                assert time.monotonic() < deadline, "inotify did not report the write"
                time.sleep(0.01)
            time.sleep(0.1)
            assert not woke.is_set(), "woken while the file is being written"
        assert woke.wait(10), "the close did not wake the agent"
        changes = src.take()
        assert changes is not None and changes.whole is not None
        assert list(changes.whole.slices) == [("tenant-a", "vm1-x7k2p")]
    finally:
        src.stop()


def test_unchanged_documents_are_not_parsed_again(tmp_path: Path) -> None:
    """A file read again after an edit gives exactly what a fresh read gives, and only the
    documents whose text changed are parsed (the others' records are reused)."""
    import yaml as y

    from cozyebpf.sources.manifest import split_documents
    from cozylab.k8s import Svc, objects

    docs = [
        o
        for i in range(50)
        for o in objects(Svc(f"vm{i}", f"192.0.2.{i + 1}", f"10.244.0.{i + 1}"))
    ]
    path = tmp_path / "m.yaml"
    path.write_text(y.safe_dump_all(docs))
    src = ManifestSource(path)
    first = src.read()
    assert len(first.services) == 50 and len(src._cache) == 100
    docs[21]["endpoints"][0]["addresses"] = ["10.244.9.9"]  # vm10's EndpointSlice
    path.write_text(y.safe_dump_all(docs))
    parsed: list[str] = []
    real = src._document_list
    src._document_list = lambda text, loader: parsed.append(text) or real(text, loader)  # type: ignore[method-assign]
    second = src.read()
    assert len(parsed) == 1 and "10.244.9.9" in parsed[0]
    assert second == ManifestSource(path).read() != first
    # what a piece cannot say alone goes through a whole read: directives, an alias, an error
    assert split_documents("%YAML 1.1\n---\na: 1\n") is None
    assert split_documents("a: 1\n...\n---\nb: 2\n") is None
    assert split_documents("a: 1\n---\nb: 2\n--- c\n") == ["a: 1\n", "---\nb: 2\n", "--- c\n"]
    path.write_text(
        y.safe_dump_all(docs) + "---\nkind: List\nitems:\n- &x {kind: ConfigMap}\n- *x\n"
    )
    assert ManifestSource(path).read() == second


# -- read whole or not at all (issue 37, item 5) --------------------------------------------


def svc(name: str, lb: str) -> str:
    return SERVICE.replace("name: vm1", f"name: {name}").replace("192.0.2.10", lb)


def services_file(n: int) -> str:
    return "---\n".join(svc(f"vm{i}", f"192.0.2.{10 + i}") for i in range(1, n + 1))


def whole_services(changes: ChangeSet | None) -> set[tuple[str, str]] | None:
    """The Services of a whole read, or None when `changes` is not one."""
    if changes is None or changes.whole is None:
        return None
    return set(changes.whole.services)


class Agent:
    """What the agent does with the source: take() at every wake-up, at once (the worst
    interleaving for a snapshot handed over too early), remembering every whole read."""

    def __init__(self, src: ManifestSource) -> None:
        self.src = src
        self.reads: list[set[tuple[str, str]]] = []
        self._lock = threading.Lock()

    def wake(self) -> None:
        self.take()

    def take(self) -> None:
        with self._lock:  # the agent's loop is one thread
            got = whole_services(self.src.take())
            if got is not None:
                self.reads.append(got)


def writing(src: ManifestSource) -> bool:
    with src._lock:
        return src._writing


def first_whole(src: ManifestSource) -> ObjectSet:
    """take() as the agent's loop does, until a whole read comes; that read."""
    deadline = time.monotonic() + 10  # a bound for a hang, not an expectation
    while True:
        changes = src.take()
        if changes is not None and changes.whole is not None:
            return changes.whole
        assert time.monotonic() < deadline, "no whole read"
        time.sleep(0.005)


def handed(src: ManifestSource) -> bool:
    """The watch thread handed a snapshot over (not taken yet)."""
    with src._lock:
        return src._snapshot is not None


def wait(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10  # a bound for a hang, not an expectation
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


VM1 = {("tenant-a", "vm1")}


@pytest.mark.parametrize("closes", [False, True], ids=["truncates-and-stalls", "truncate-close"])
def test_a_truncation_between_the_event_batch_and_the_snapshot_is_never_taken(
    tmp_path: Path, closes: bool
) -> None:
    """The race of issue 37, made deterministic by the watch thread's seam: a writer closes
    the file (the batch says whole), and right then, before the snapshot is read, the next
    writer truncates it, and either stalls with it open or closes it empty and writes in a
    second open. The agent takes at every wake-up: it never gets the empty file (before issue
    37 the watch thread stamped the truncated file whole and the agent removed every Service),
    and it gets the next writer's content once that writer closes."""
    path = tmp_path / "m.yaml"
    path.write_text(SERVICE)
    clock = FakeClock()
    src = ManifestSource(path, poll_interval=3600, clock=clock)
    agent = Agent(src)
    agent.take()
    assert agent.reads == [VM1]
    nxt: list[Any] = []

    def next_writer_truncates() -> None:  # in the watch thread, once
        if not nxt:
            nxt.append(open(path, "w"))  # noqa: SIM115 - the writer stalls with it open
            if closes:
                nxt[0].close()

    src.before_snapshot = next_writer_truncates
    src.start(agent.wake)
    try:
        path.write_text(BOTH)  # written and closed: the batch that says whole
        wait(lambda: bool(nxt), "a batch that says whole")
        if closes:  # the truncated file was closed: its snapshot is handed over, and held
            wait(lambda: src._held is not None, "the empty file held")
        else:
            wait(lambda: writing(src), "the truncation seen")
        for _ in range(3):  # the agent's loop turns meanwhile (less than CONFIRM_AFTER)
            agent.take()
            clock.advance(1)
        assert agent.reads == [VM1]
        with nxt[0] if not closes else open(path, "w") as f:  # the next writer's content
            f.write(BOTH)
        wait(lambda: len(agent.reads) > 1, "the close to wake the agent")
        assert agent.reads == [VM1, VM1], "an empty or cut file was taken"
        changes = src.take()
        assert changes is not None and changes.whole is None  # taken once
    finally:
        src.stop()
    with src._lock:
        assert src._loaded == src._signature()


def test_a_read_that_removes_most_services_waits_for_a_second_read(tmp_path: Path) -> None:
    """Without a watch (the poll's rule alone): a read that removes more than half of the
    Services is held, and taken when a read CONFIRM_AFTER later finds the same bytes; one that
    removes half is taken at once; a held read that the writer completes meanwhile is replaced
    by the complete one."""
    from cozyebpf.sources.manifest import CONFIRM_AFTER

    path = tmp_path / "m.yaml"
    path.write_text(services_file(4))
    clock = FakeClock()
    src = ManifestSource(path, poll_interval=1.0, clock=clock)
    assert whole_services(src.take()) == {("tenant-a", f"vm{i}") for i in range(1, 5)}

    def settle() -> ChangeSet | None:
        """take() once the file has stayed the same for half a poll interval."""
        assert src.take() is not None  # sees the new signature
        clock.advance(0.5)
        return src.take()

    path.write_text(services_file(2))  # half: at once
    assert whole_services(settle()) == {("tenant-a", "vm1"), ("tenant-a", "vm2")}
    path.write_text(services_file(4))
    assert len(whole_services(settle()) or ()) == 4
    path.write_text(services_file(1))  # three of four: held
    assert whole_services(settle()) is None
    clock.advance(CONFIRM_AFTER - 1)
    assert whole_services(src.take()) is None  # the same bytes, too soon
    path.write_text(services_file(3))  # the writer was not done: one of four removed
    assert whole_services(settle()) == {("tenant-a", f"vm{i}") for i in range(1, 4)}
    assert src._held is None
    path.write_text("")  # all of them: held, then confirmed
    assert whole_services(settle()) is None
    clock.advance(CONFIRM_AFTER)
    assert whole_services(src.take()) == set()


WRITER = """\
import sys
path, closes = sys.argv[1], sys.argv[2] == "closes"
f = open(path, "w")  # truncates
if closes:
    f.close()
print("truncated", flush=True)
data = sys.stdin.read()  # stalls until the test sends what to write
if closes:
    f = open(path, "w")
f.write(data)
f.close()
"""


@pytest.mark.parametrize("closes", [False, True], ids=["stalls-open", "closes-then-writes"])
def test_a_real_writer_that_truncates_and_stalls(tmp_path: Path, closes: bool) -> None:
    """A writer process truncates the manifest and stalls (with the file open, or closed empty
    before a second open writes it) while the agent's loop turns: the empty file is never
    taken, however long an open writer stalls (the agent's clock moved past WRITER_GRACE and
    CONFIRM_AFTER), or while a closed one stalls less than CONFIRM_AFTER; its content is taken
    once it is written."""
    from cozyebpf.sources.manifest import CONFIRM_AFTER, WRITER_GRACE

    path = tmp_path / "m.yaml"
    path.write_text(services_file(3))
    clock = FakeClock()
    src = ManifestSource(path, poll_interval=0.2, clock=clock)
    agent = Agent(src)
    agent.take()
    three = {("tenant-a", f"vm{i}") for i in range(1, 4)}
    assert agent.reads == [three]
    src.start(agent.wake)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), "closes" if closes else "stalls"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "truncated\n"
        if closes:
            wait(lambda: src._held is not None, "the empty file held")
            stall = CONFIRM_AFTER - 0.5
        else:
            wait(lambda: writing(src), "the truncation seen")
            stall = 2 * max(WRITER_GRACE, CONFIRM_AFTER)
        while stall > 0:  # the loop turns while the writer stalls
            agent.take()
            clock.advance(0.25)
            stall -= 0.25
        assert agent.reads == [three], "the truncated file was taken"
        writer.communicate(services_file(3) + "---\n" + SLICE, timeout=30)
        assert writer.returncode == 0
        wait(lambda: len(agent.reads) > 1, "the writer's close to wake the agent")
        assert agent.reads == [three, three]
    finally:
        src.stop()
        if writer.poll() is None:
            writer.kill()
            writer.wait()
