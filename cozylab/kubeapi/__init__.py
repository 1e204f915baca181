"""A test double of the Kubernetes API server: Services, EndpointSlices, Pods and core/v1 Events.

`FakeKubeAPI` serves HTTP/1.1 on 127.0.0.1 and follows the API conventions closely enough that
the official `kubernetes` client cannot tell it from a kube-apiserver for the calls it supports:
lists with label selectors and `limit`/`continue` pagination over a consistent snapshot,
chunked watches replayed from a history log (410 Expired once compacted), bookmarks, Events
create/patch/list, token and access reviews, and errors as `Status` objects. Tests drive the
state with `apply`/`delete` and inject faults with `fail_next`, `drop_watches`, `set_down`,
`compact` and `forbid` (RBAC's 403 for every request on a resource); `requests` records every
request the server read. `stop()` then `start()` is an apiserver restart: same port and
state, connections refused in between.

Since the labs run on the real control plane (issue 35, cozylab/kubecp/) the double serves
only what its users ask (the unit tests of the source, the Event recorder, port security and
the metrics' reviews; test_burst, test_metrics_flood, bench/control.py): discovery (kubectl's),
field selectors, generateName and injected latency went with issue 37.

Known deviations from a real kube-apiserver:
- HTTP only; no authentication, authorization, admission, validation of object contents,
  managedFields, metadata.generation, dryRun, fieldValidation, server-side apply, protobuf,
  Table output, legacy /watch/ paths, sendInitialEvents, discovery, field selectors or
  generateName.
- Services, EndpointSlices and Pods are read-only over HTTP (tests write them with `apply`); Events
  take POST and PATCH only (no PUT or DELETE).
- PATCH takes merge and strategic-merge patches, both applied as RFC 7386 JSON merge patches
  (no list merge keys, no $patch directives); json-patch and apply-patch answer 415.
- LIST ignores resourceVersion/resourceVersionMatch and always serves the current state.
- A watch from a resourceVersion newer than the current one sends only later changes instead
  of answering 'Too large resource version' after 3 s.
- Watches have no server-side default timeout; bookmarks are sent every `bookmark_interval`.
- `compact()` expires a resume from an older resourceVersion, as a watch served by etcd would
  be; `stop()` then `start()` keeps the history. The real kube-apiserver (issue 35, checked
  against 1.34.3) serves watches from its watch cache: a compaction alone expires none of them,
  and after a restart every resume from before it is 410 ("too old resource version"), since
  the cache's history starts at the restart.
- No RBAC: every request is allowed unless `forbid` says otherwise (the real server refused
  the Event recorder's `get` on events, which the chart's ClusterRole does not grant).
- Continue tokens are opaque random strings kept in memory; a malformed one is 410 (not 400),
  and the selectors of a continued list are those of its first page.
- Injected faults carry no Retry-After header (urllib3 would silently retry a 429/503 that has
  one).
- `apply()` keeps a uid the test gives on create (the real server always generates one).

The package: `objects` (kinds, errors, selectors, the store's records), `server`
(`FakeKubeAPI`: the state and the test's controls), `http` (the HTTP server and handler)."""

from cozylab.kubeapi.objects import RequestRecord
from cozylab.kubeapi.server import FakeKubeAPI

__all__ = ["FakeKubeAPI", "RequestRecord"]
