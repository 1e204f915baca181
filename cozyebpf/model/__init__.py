"""Kubernetes Service + EndpointSlice objects -> the desired MapState. Pure: no I/O, no clients.

Objects are plain dicts, as parsed from YAML or as the API server returns them (camelCase JSON).
The rules follow cozy-proxy:

- a Service is ours iff `metadata.labels[LABEL_PROXY_NAME] == proxy_name`;
- `annotations[ANN_WHOLE_IP] == "true"` (exactly) selects whole-IP mode, anything else the port
  filter; `annotations[ANN_ALLOW_ICMP] == "true"` (exactly) lets ICMP through the port filter;
- each `status.loadBalancer.ingress[].ip` is NATed 1:1 to the one ready pod found in the
  Service's EndpointSlices; the destination port is not rewritten, so the port filter matches
  `spec.ports[].port`.

IPv6 and dual-stack: each LB IP is translated to the pod IP *of its own family*, taken from the
EndpointSlices of that family (`addressType` IPv4 or IPv6; a dual-stack Service has one of
each), chosen per family by the same rules (ready, not terminating, the lowest address when
there are several). An LB IP whose family has no ready endpoint is reported and not programmed;
it is never translated to an address of the other family. The pod's egress leaves from the
first LB IP of the same family of the oldest Service behind it, and its allowed ports are set for
its pod IP of each programmed family. `spec.ipFamilies` and `spec.ipFamilyPolicy` are not
interpreted: the LB status and the EndpointSlices say which addresses exist, and they are what
the model reads.

Bad input never raises: each bad object or field becomes a `Problem` about that object only.

Three modules, in the order the data flows: `records` reads each object on its own into a small
record; `compose` makes the desired state of records (`build_state`: all of it at once);
`incremental` keeps that state up to date change by change (`IncrementalModel`). The names
used outside the package are re-exported here (`X as X`: explicitly, for mypy and ruff).
"""

from cozyebpf.model.compose import ModelResult as ModelResult
from cozyebpf.model.compose import Refusal as Refusal
from cozyebpf.model.compose import Reserved as Reserved
from cozyebpf.model.compose import ServiceView as ServiceView
from cozyebpf.model.compose import build_state as build_state
from cozyebpf.model.incremental import MIGRATION_HOLD as MIGRATION_HOLD
from cozyebpf.model.incremental import Delta as Delta
from cozyebpf.model.incremental import IncrementalModel as IncrementalModel
from cozyebpf.model.read import gather as gather
from cozyebpf.model.read import read_object as read_object
from cozyebpf.model.read import read_objects as read_objects
from cozyebpf.model.records import _CANONICAL_V4 as _CANONICAL_V4
from cozyebpf.model.records import ANN_ALLOW_ICMP as ANN_ALLOW_ICMP
from cozyebpf.model.records import ANN_SOURCE_RANGES as ANN_SOURCE_RANGES
from cozyebpf.model.records import ANN_WHOLE_IP as ANN_WHOLE_IP
from cozyebpf.model.records import DEFAULT_PROXY_NAME as DEFAULT_PROXY_NAME
from cozyebpf.model.records import LABEL_PROXY_NAME as LABEL_PROXY_NAME
from cozyebpf.model.records import LABEL_SERVICE_NAME as LABEL_SERVICE_NAME
from cozyebpf.model.records import ForeignRecord as ForeignRecord
from cozyebpf.model.records import Key as Key
from cozyebpf.model.records import NodeRecord as NodeRecord
from cozyebpf.model.records import ObjectRef as ObjectRef
from cozyebpf.model.records import ObjectSet as ObjectSet
from cozyebpf.model.records import PortSpec as PortSpec
from cozyebpf.model.records import Problem as Problem
from cozyebpf.model.records import Read as Read
from cozyebpf.model.records import ServiceRecord as ServiceRecord
from cozyebpf.model.records import SliceRecord as SliceRecord
