"""Source addresses behind a shared pod-facing device (issue 21).

The datapath verifies a managed pod's source address by the device its packets enter from.
Per-pod devices (`--pod-devices 'lxc*'`) tell the pods apart; a device that every pod's packets
cross (Kube-OVN's `ovn0`: a --pod-devices entry named exactly, not a pattern) does not, so
behind it only the CNI can enforce source addresses: OVN port security, which Kube-OVN sets on
a pod's logical switch port only when the pod has the annotation
`ovn.kubernetes.io/port_security: "true"` (KubeVirt copies a VM template's annotations to its
virt-launcher pod). So:

- `note_pod_devices`, at start: one warning naming such devices (none for patterns);
- `PortSecurity`, while such a device is in use: reads the backend pods of the managed Services
  that run on this node, one GET each on its own thread (never a watch of all pods; read again
  when their EndpointSlice or Service changes, and every `recheck` seconds while they lack the
  annotation), and makes one Problem (a warning: logged, and an Event on the Service) per
  Service and pod without the annotation. The agent merges its Problems with the model's; the
  model never sees the API.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from cozyebpf.datapath.attach import is_pattern
from cozyebpf.kube.client import KubeRest
from cozyebpf.model import Key, ObjectRef, Problem

log = logging.getLogger(__name__)

#: Kube-OVN sets port security on a pod's logical switch port when this is exactly "true"
ANN_PORT_SECURITY = "ovn.kubernetes.io/port_security"
RECHECK = 60.0  # seconds between reads of a pod that lacks port security (or could not be read)
CLUSTER_ROLE = "cozyebpf"  # the chart's and deploy/'s ClusterRole (the release's fullname)


def shared_devices(pod_devices: Sequence[str]) -> list[str]:
    """The --pod-devices entries (as resolved) that every pod's packets cross: the names, not
    the patterns (a pattern follows per-pod veths)."""
    return [d for d in pod_devices if not is_pattern(d)]


def unverified_message(devices: Sequence[str]) -> str:
    names = ", ".join(devices)
    one = len(devices) == 1
    return (
        f"source addresses behind {names} are not verified: every pod's packets enter the node "
        f"through {'it' if one else 'each'}, so cozyebpf cannot tell which pod sent one; only "
        f"the CNI can (Kube-OVN: port security, the pod annotation {ANN_PORT_SECURITY}: "
        '"true")'
    )


def note_pod_devices(pod_devices: Sequence[str]) -> list[str]:
    """Log, once at start, that sources behind the shared devices are not verified; return
    those devices (empty: every pod-facing device is per pod, or there is none)."""
    shared = shared_devices(pod_devices)
    if shared:
        log.warning("%s", unverified_message(shared))
    return shared


def checks(
    pod_devices: Sequence[str],
    api_client: Any,
    node: str | None,
    recheck: float = RECHECK,
    cluster_role: str = CLUSTER_ROLE,
) -> tuple[list[str], PortSecurity | None]:
    """At start: the shared pod-facing devices (logged once, `note_pod_devices`), and the
    check of the pods behind them when there are some and an API to read pods from (None
    otherwise: per-pod devices, no pod-facing device, or --manifests). `cluster_role` is the
    ClusterRole a 403 names (--cluster-role: the chart passes the one it made)."""
    shared = note_pod_devices(pod_devices)
    if not shared or api_client is None:
        return shared, None
    reader = kube_pod_reader(api_client)
    return shared, PortSecurity(reader, shared, node, recheck, cluster_role=cluster_role)


def has_port_security(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata")
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return isinstance(ann, Mapping) and ann.get(ANN_PORT_SECURITY) == "true"


def problem_message(pod: Key, devices: Sequence[str]) -> str:
    return (
        f"pod {pod[0]}/{pod[1]} (its backend) has no OVN port security: behind "
        f"{', '.join(devices)} cozyebpf cannot verify source addresses, so this VM can send "
        "as another Service's LB IP, and a pod without port security as this one's; set the "
        f'annotation {ANN_PORT_SECURITY}: "true" on the VM\'s template (KubeVirt passes it to '
        "the pod it starts next: restart or migrate the VM)"
    )


#: the Accept header that asks the API server for an object's metadata only (a
#: PartialObjectMetadata, as client-go's metadata client asks; every supported Kubernetes
#: serves it): a pod's spec and status (its environment, volumes, addresses) never reach us
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def kube_pod_reader(api_client: Any, timeout: float = 30.0) -> Callable[[str, str], Any]:
    """GET /api/v1/namespaces/NS/pods/NAME through the agent's API client, the pod's metadata
    only (`METADATA_ONLY`): the annotation is all the check reads."""
    rest = KubeRest(api_client)

    def read(namespace: str, name: str) -> Any:
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        return rest.json("GET", path, timeout=timeout, accept=METADATA_ONLY)

    return read


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status", None)
    return status if isinstance(status, int) else None


class PortSecurity:
    """The port security of the managed Services' pods behind a shared device (module
    docstring). The agent's loop calls `set_backends` and `take`; `read_due` runs on the
    thread `start` makes (tests call it directly)."""

    def __init__(
        self,
        read_pod: Callable[[str, str], Mapping[str, Any]],
        devices: Sequence[str],
        node: str | None = None,
        recheck: float = RECHECK,
        clock: Callable[[], float] = time.monotonic,
        cluster_role: str = CLUSTER_ROLE,
    ) -> None:
        self.read_pod = read_pod
        self.devices = list(devices)
        self.node = node  # only pods on this node (or of endpoints without a nodeName)
        self.recheck = recheck
        self.clock = clock
        self.cluster_role = cluster_role
        self.notify: Callable[[], None] = lambda: None  # wakes the agent: Problems changed
        self.reads = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backends: dict[Key, frozenset[Key]] = {}  # Service -> its pods
        self._users: dict[Key, set[Key]] = {}  # pod -> the Services it backs
        self._due: dict[Key, float] = {}  # pods to read, from when (on `clock`)
        self._unsecured: set[Key] = set()  # pods read without the annotation
        self._changed = False
        self._reported: frozenset[Problem] = frozenset()  # as of the last take()
        self._forbidden = False  # a 403 was logged (until a read succeeds)
        self._missing: set[Key] = set()  # pods whose 404 was logged
        self._last_error: str | None = None

    # -- the agent's side ----------------------------------------------------------------

    def services(self) -> set[Key]:
        with self._lock:
            return set(self._backends)

    def set_backends(self, service: Key, pods: Iterable[Key]) -> None:
        """The backend pods of the Service `service` (none: it has none, or is not managed),
        after its record or EndpointSlices changed; each is read (again)."""
        new = frozenset(pods)
        with self._lock:
            old = self._backends.pop(service, frozenset())
            if not old and not new:
                return
            for pod in old - new:
                users = self._users.get(pod, set())
                users.discard(service)
                if not users:
                    self._users.pop(pod, None)
                    self._due.pop(pod, None)
                    self._unsecured.discard(pod)
                    self._missing.discard(pod)
            now = self.clock()
            for pod in new:
                self._users.setdefault(pod, set()).add(service)
                self._due[pod] = now
            if new:
                self._backends[service] = new
            self._changed = True
        if new:
            self._wake.set()

    def take(self) -> tuple[list[Problem], list[Problem]]:
        """The Problems that appeared and went away since the last take."""
        with self._lock:
            if not self._changed:
                return [], []
            self._changed = False
            current = frozenset(
                Problem(
                    ObjectRef("Service", *service),
                    problem_message(pod, self.devices),
                    "warning",
                )
                for pod in self._unsecured
                for service in self._users.get(pod, ())
            )
        before, self._reported = self._reported, current
        return sorted(current - before), sorted(before - current)

    def problems(self) -> list[Problem]:
        """The Problems as of the last take (any thread)."""
        return sorted(self._reported)

    # -- the reader's side ---------------------------------------------------------------

    def next_due(self) -> float | None:
        with self._lock:
            return min(self._due.values(), default=None)

    def read_due(self) -> int:
        """Read every pod that is due, one GET each; how many reads were made."""
        now = self.clock()
        with self._lock:
            due = sorted(pod for pod, at in self._due.items() if at <= now)
        n = 0
        for pod in due:
            if self._stop.is_set():
                break
            n += 1
            self.reads += 1
            try:
                secured: bool | None = has_port_security(self.read_pod(*pod))
                error: BaseException | None = None
            except Exception as e:  # API or network failure: logged, read again later
                secured, error = None, e
            with self._lock:
                if pod not in self._users:
                    continue  # no longer a backend
                if self._due.get(pod, now) > now:
                    continue  # named again meanwhile: read again
                before = pod in self._unsecured
                if error is None:
                    self._succeeded()
                    if secured:
                        self._due.pop(pod, None)
                        self._unsecured.discard(pod)
                    else:
                        self._due[pod] = now + self.recheck
                        self._unsecured.add(pod)
                elif self._failed(pod, error, now):
                    break
                changed = before != (pod in self._unsecured)
                self._changed |= changed
            if changed:
                self.notify()
        return n

    def _succeeded(self) -> None:
        if self._forbidden:
            log.info("pods can be read again: port security is checked")
        self._forbidden = False
        self._last_error = None

    def _failed(self, pod: Key, e: BaseException, now: float) -> bool:
        """Log a failed read (each kind once); True: stop this round (403: no pod can be
        read). Called with the lock held."""
        status = _status(e)
        what = f"pod {pod[0]}/{pod[1]}"
        if status == 403:
            if not self._forbidden:
                log.warning(
                    "cannot read %s (HTTP 403 Forbidden): the ClusterRole %s lacks `get pods`, "
                    "so whether the VMs behind %s have OVN port security is not checked; add "
                    'the rule {apiGroups: [""], resources: ["pods"], verbs: ["get"]} to it '
                    "(the Helm chart and deploy/rbac.yaml have it)",
                    what,
                    self.cluster_role,
                    ", ".join(self.devices),
                )
                self._forbidden = True
            for p, at in self._due.items():
                self._due[p] = max(at, now + self.recheck)
            return True
        if status == 404:
            self._due.pop(pod, None)  # read again when its EndpointSlice names it again
            self._unsecured.discard(pod)
            if pod not in self._missing:
                log.warning(
                    "%s, named by the EndpointSlice of Service %s, was not found (HTTP 404), "
                    "so its port security is not checked",
                    what,
                    ", ".join(f"{ns}/{name}" for ns, name in sorted(self._users[pod])),
                )
                self._missing.add(pod)
            return False
        self._due[pod] = now + self.recheck
        desc = f"HTTP {status} {getattr(e, 'reason', '') or ''}".strip() if status else str(e)
        if desc != self._last_error:
            log.warning(
                "cannot read %s (%s), so its port security is not checked; trying again in %.0fs",
                what,
                desc,
                self.recheck,
            )
            self._last_error = desc
        return False

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.read_due()
            except Exception as e:  # never let the reader die
                log.error("checking port security failed: %s", e)
            due = self.next_due()
            wait = self.recheck if due is None else max(0.0, due - self.clock())
            self._wake.wait(min(wait, self.recheck))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="portsec", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
