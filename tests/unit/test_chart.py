"""charts/cozyebpf: the Helm chart a Cozystack maintainer vendors in place of cozy-proxy's.

- `helm lint --strict`, with the default values and with ci/all-values.yaml, which sets every
  value (checked here);
- `helm template` of each value set, for Kubernetes 1.33, 1.34 and 1.35: every object passes
  kubernetes-validate's strict schema of that version (the PodMonitor, a CRD the schemas do not
  have, is checked by hand);
- the DaemonSet: a memory limit, not privileged, exactly the capabilities
  tests/datapath/test_capabilities.py proves sufficient, the bpffs mount, the node's name from
  spec.nodeName, probes on the health port; its args and COZYEBPF_* variables parsed by
  `cozyebpf run`'s own click parser and compared with the values, so a renamed or retyped
  option fails here, not on a node;
- values.schema.json rejects wrong types and values;
- deploy/ is what scripts/render-deploy.sh renders from the chart (no drift).

Needs helm (scripts/setup.sh puts it in .venv/bin): skipped without it, failed under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from cozyebpf.cli import main, run
from tests.support.contract import MINIMAL
from tests.support.prereqs import find_helm

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cozyebpf"
ALL_VALUES = CHART / "ci" / "all-values.yaml"
RELEASE, NAMESPACE = "cozyebpf", "cozy-system"
KUBE_VERSIONS = ("1.33", "1.34", "1.35")
#: kinds from CRDs, which kubernetes-validate has no schema for
CRD_KINDS = {"PodMonitor"}
#: what the fieldRefs of the rendered env resolve to on a made-up node
FIELDS = {"spec.nodeName": "node-a", "status.hostIP": "192.0.2.7"}

#: the value sets rendered: name -> helm arguments
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "all-values": ["-f", str(ALL_VALUES)],
    # what all-values cannot show: the switches off
    "off": [
        "--set",
        "rbac.create=false,metrics.enabled=false,daemonset.priorityClassName=,"
        "endpointSliceGuard.enabled=false",
    ],
}


@pytest.fixture(scope="module")
def helm() -> str:
    found = find_helm()
    assert found is not None, "checked at collection (tests/support/prereqs.py, FIXTURES)"
    return found


def helm_template(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def render(helm: str, *args: str) -> list[dict[str, Any]]:
    p = helm_template(helm, *args)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: str) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(helm, *VALUE_SETS[request.param])


def values_of(name: str) -> dict[str, Any]:
    """The values a set renders with: values.yaml, overridden as the set's arguments do."""
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    if name == "all-values":
        _merge(values, yaml.safe_load(ALL_VALUES.read_text()))
    elif name == "off":
        _merge(
            values,
            {
                "rbac": {"create": False},
                "metrics": {"enabled": False},
                "endpointSliceGuard": {"enabled": False},
            },
        )
        values["daemonset"]["priorityClassName"] = ""
    return values


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _leaves(d: Any, path: str = "") -> Iterator[str]:
    if isinstance(d, dict) and d:
        for k, v in d.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    else:
        yield path


def daemonset(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return ds


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = daemonset(objs)["spec"]["template"]["spec"]["containers"]
    return c


# -- lint ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["-f", str(ALL_VALUES)]], ids=["defaults", "all-values"])
def test_helm_lint_strict(helm: str, args: list[str]) -> None:
    p = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *args], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 chart(s) failed" in p.stdout, p.stdout


def test_all_values_sets_every_value() -> None:
    defaults = set(_leaves(yaml.safe_load((CHART / "values.yaml").read_text())))
    given = set(_leaves(yaml.safe_load(ALL_VALUES.read_text())))
    missing = {
        d for d in defaults if d not in given and not any(g.startswith(d + ".") for g in given)
    }
    assert missing == set(), "values that ci/all-values.yaml leaves out"


def test_the_charts_readme_names_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # a value with children of its own in the defaults is listed as a whole or leaf by leaf
    missing = [
        leaf
        for leaf in _leaves(values)
        if f"`{leaf}`" not in readme and not any(f"`{p}`" in readme for p in _prefixes(leaf))
    ]
    assert missing == [], "values charts/cozyebpf/README.md does not list"


def _prefixes(leaf: str) -> list[str]:
    parts = leaf.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def test_every_value_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def known(path: list[str], node: dict[str, Any]) -> bool:
        if not path:
            return True
        props = node.get("properties", {})
        if path[0] in props:
            return known(path[1:], props[path[0]])
        # free-form objects (labels, resources, affinity, ...) end the walk
        return node.get("additionalProperties", True) is not False

    for leaf in _leaves(yaml.safe_load(ALL_VALUES.read_text())):
        assert known(leaf.split("."), schema), f"{leaf} is not in values.schema.json"


# -- every object against the Kubernetes schemas ------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_every_object_passes_the_kubernetes_schema(helm: str, values: str, kube: str) -> None:
    objs = render(helm, "--kube-version", f"{kube}.0", *VALUE_SETS[values])
    kinds = {o["kind"] for o in objs}
    assert {"DaemonSet"} <= kinds
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            checked = kubernetes_validate.validate(obj, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} for {kube}: {e.message}")
        # kubernetes-validate falls back to an older schema silently: not here
        assert checked == kube, f"validated against {checked}, not {kube}"


# -- the DaemonSet -------------------------------------------------------------------------


def test_the_daemonset_is_what_the_node_needs(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objs = rendered
    values = values_of(name)
    ds = daemonset(objs)
    pod = ds["spec"]["template"]["spec"]
    c = container(objs)
    assert pod["hostNetwork"] is True
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert pod.get("priorityClassName", "") == values["daemonset"]["priorityClassName"]
    assert pod["tolerations"] == values["daemonset"]["tolerations"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels(ds).items()
    # a memory limit: the only thing that keeps Talos' OOM handler off a node DaemonSet; the
    # values' resources where set, else computed from maxServices and countedServices
    a = values["agent"]
    want = values["daemonset"]["resources"] or memory_for(a["maxServices"], a["countedServices"])
    assert c["resources"] == want
    assert c["resources"]["limits"]["memory"]
    # not privileged: exactly the capabilities the capability test proves sufficient
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(f"CAP_{a}" for a in sc["capabilities"]["add"]) == sorted(MINIMAL)
    assert all(
        "privileged" not in str(o.get("securityContext", "")) for o in pod.get("initContainers", [])
    )
    # the host's bpffs, where the pins live
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["bpffs"]["mountPath"] == "/sys/fs/bpf"
    assert volumes["bpffs"]["hostPath"]["path"] == "/sys/fs/bpf"
    env = {e["name"]: e for e in c["env"]}
    assert env["COZYEBPF_PIN_DIR"]["value"].startswith("/sys/fs/bpf/")
    assert env["COZYEBPF_RUN_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the probes ask the health server the agent is told to start
    health = env["COZYEBPF_RUN_HEALTH_ADDRESS"]["value"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert f"{get['host']}:{get['port']}" == health, probe
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == int(health.rpartition(":")[2])
    if values["metrics"]["enabled"]:
        assert env["COZYEBPF_RUN_METRICS_ADDRESS"]["value"].endswith(f":{ports['metrics']}")
    else:
        assert "COZYEBPF_RUN_METRICS_ADDRESS" not in env and "metrics" not in ports


def pod_labels(ds: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = ds["spec"]["template"]["metadata"]["labels"]
    return labels


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: fieldRefs resolved, $(VAR) of
    earlier variables expanded."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        else:
            env[e["name"]] = FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def run_envvars() -> set[str]:
    """Every environment variable `cozyebpf run` reads an option from."""
    names: set[str] = set()
    for p in run.params:
        if not isinstance(p, click.Option) or p.name is None:
            continue
        if p.envvar:
            names.update([p.envvar] if isinstance(p.envvar, str) else p.envvar)
        if p.allow_from_autoenv:
            names.add(f"COZYEBPF_RUN_{p.name.upper()}")
    return names


def parse_run(
    c: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, str]]:
    """The container's args and environment through `cozyebpf run`'s own parser (no run)."""
    env = container_env(c)
    args = c["args"]
    assert args[0] == "run"
    group_ctx = click.Context(main, auto_envvar_prefix="COZYEBPF")
    assert main.get_command(group_ctx, args[0]) is run
    for k in list(os.environ):
        if k.startswith("COZYEBPF_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ctx = run.make_context("run", list(args[1:]), parent=group_ctx)
    sources = {
        name: getattr(ctx.get_parameter_source(name), "name", "").lower() for name in ctx.params
    }
    return ctx.params, sources


def expected_params(values: dict[str, Any]) -> dict[str, Any]:
    a = values["agent"]
    m = values["metrics"]
    metrics = ""  # run's default: off
    if m["enabled"]:
        metrics = f"{m['host'] or FIELDS['status.hostIP']}:{m['port']}"
    tls = m["enabled"] and m["secure"] and m["certSecret"]
    cert_dir = "/etc/cozyebpf/metrics-tls" if tls else ""
    return {
        "devices": a["devices"],
        "pod_devices": a["podDevices"],
        "proxy_name": a["proxyName"],
        "trusted_endpoints": a["trustedEndpoints"],
        "max_services": a["maxServices"],
        "counted_services": a["countedServices"],
        "flow_timeout_udp": a["flowTimeouts"]["udp"],
        "flow_timeout_icmp": a["flowTimeouts"]["icmp"],
        "flow_timeout_tcp": a["flowTimeouts"]["tcp"],
        "flow_timeout_tcp_closing": a["flowTimeouts"]["tcpClosing"],
        "log_level": a["logLevel"],
        "resync_interval": a["resyncInterval"],
        "check_interval": a["checkInterval"],
        "ingress_hook": a["ingressHook"],
        "host_routing": a["hostRouting"],
        "xdp_mode": a["xdpMode"],
        "tc_mode": a["tcMode"],
        "on_foreign_xdp": a["onForeignXdp"],
        "remove_cozy_proxy_table": a["removeCozyProxyTable"],
        "pin_dir": a["pinDir"],
        "health_address": f"{values['health']['host']}:{values['health']['port']}",
        "metrics_address": metrics,
        "metrics_auth": "kubernetes" if m["secure"] else "none",
        "metrics_cert_dir": cert_dir,
        "node_name": FIELDS["spec.nodeName"],
        # not set by the chart: the in-cluster service account, no manifest file
        "kubeconfig": None,
        "manifests": None,
    }


def test_runs_own_parser_takes_the_rendered_args_and_env(
    rendered: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, objs = rendered
    c = container(objs)
    known = run_envvars()
    unknown = {e["name"] for e in c["env"] if e["name"].startswith("COZYEBPF_")} - known
    assert unknown == set(), "variables `cozyebpf run` does not read (a renamed option?)"
    params, sources = parse_run(c, monkeypatch)
    want = expected_params(values_of(name))
    assert {k: params[k] for k in want} == want
    # every value the chart sets reaches run from the environment (or the command line)
    for k, v in want.items():
        if v not in (None, ""):
            assert sources[k] in ("environment", "commandline"), (k, sources[k])
    if name == "all-values":  # agent.extraArgs
        assert params["poll_interval"] == 2.0 and sources["poll_interval"] == "commandline"


# -- the other objects ------------------------------------------------------------------------


def test_rbac_is_what_the_agent_reads_and_writes(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objs = rendered
    values = values_of(name)
    kinds = {o["kind"] for o in objs}
    if not values["rbac"]["create"]:
        assert not {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"} & kinds
        return
    pod = daemonset(objs)["spec"]["template"]["spec"]
    (sa,) = [
        o["metadata"]
        for o in objs
        if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == pod["serviceAccountName"]
    ]
    (binding,) = [
        o
        for o in objs
        if o["kind"] == "ClusterRoleBinding" and o["subjects"][0]["name"] == sa["name"]
    ]
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
    role = roles[binding["roleRef"]["name"]]
    secure = values["metrics"]["enabled"] and values["metrics"]["secure"]
    # every right is used (the kube-apiserver's audit log shows it: test_cluster_lab.py);
    # Services and EndpointSlices are listed and watched, never read one by one (no get)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        # the Nodes' addresses, which no LB IP may take (cozyebpf/sources/kube.py)
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
        # one pod at a time, for its port-security annotation (cozyebpf/kube/portsec.py)
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        # who may read the metrics (cozyebpf/kube/metricsauth.py)
        *(
            [
                {
                    "apiGroups": ["authentication.k8s.io"],
                    "resources": ["tokenreviews"],
                    "verbs": ["create"],
                },
                {
                    "apiGroups": ["authorization.k8s.io"],
                    "resources": ["subjectaccessreviews"],
                    "verbs": ["create"],
                },
            ]
            if secure
            else []
        ),
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}
    ]
    # the agent names that ClusterRole when a right is missing (all-values: cozy-proxy)
    env = container_env(container(objs))
    assert env["COZYEBPF_RUN_CLUSTER_ROLE"] == role["metadata"]["name"]
    # with secure metrics, a ClusterRole that allows reading them, and nothing else
    readers = [r for n, r in roles.items() if n != role["metadata"]["name"]]
    if secure:
        (reader,) = readers
        assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    else:
        assert readers == []


def test_the_monitoring_objects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objs = rendered
    values = values_of(name)
    kinds = [o["kind"] for o in objs]
    pms = [o for o in objs if o["kind"] == "PodMonitor"]
    cms = [o for o in objs if o["kind"] == "ConfigMap"]
    if not values["metrics"]["podMonitor"]["enabled"] or not values["metrics"]["enabled"]:
        assert pms == [], kinds
    else:
        (pm,) = pms
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        ds = daemonset(objs)
        assert pm["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
        assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (ep,) = pm["spec"]["podMetricsEndpoints"]
        assert ep["port"] == "metrics" and ep["path"] == "/metrics"
        if values["metrics"]["secure"]:
            # HTTPS with the token of a reader the chart brings, allowed to get /metrics
            assert ep["scheme"] == "https" and ep["tlsConfig"] == {"insecureSkipVerify": True}
            secret = ep["authorization"]["credentials"]
            assert ep["authorization"]["type"] == "Bearer" and secret["key"] == "token"
            (tok,) = [o for o in objs if o["kind"] == "Secret"]
            assert tok["metadata"]["name"] == secret["name"]
            assert tok["type"] == "kubernetes.io/service-account-token"
            reader = tok["metadata"]["annotations"]["kubernetes.io/service-account.name"]
            (bind,) = [
                o
                for o in objs
                if o["kind"] == "ClusterRoleBinding" and o["subjects"][0]["name"] == reader
            ]
            assert bind["roleRef"]["name"] == reader  # the reader ClusterRole (rbac.yaml)
        else:
            assert "scheme" not in ep and "authorization" not in ep
        assert pm["metadata"]["labels"].items() >= values["metrics"]["podMonitor"]["labels"].items()
    if not values["metrics"]["dashboard"]["enabled"]:
        assert cms == [], kinds
    else:
        (cm,) = cms
        d = values["metrics"]["dashboard"]
        assert cm["metadata"]["namespace"] == (d["namespace"] or NAMESPACE)
        assert cm["metadata"]["labels"].items() >= d["labels"].items()
        (text,) = cm["data"].values()
        assert json.loads(text) == json.loads((CHART / "files/grafana-dashboard.json").read_text())


def test_the_endpointslice_guard(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Only the writers the values name may write an EndpointSlice labelled as Kubernetes'
    controller's (the labs prove it against the real kube-apiserver: test_cluster_lab.py,
    section 13, a tenant's forged slice refused)."""
    name, objs = rendered
    values = values_of(name)["endpointSliceGuard"]
    policies = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    bindings = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    if not values["enabled"]:
        assert policies == [] and bindings == []
        return
    (policy,), (binding,) = policies, bindings
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["endpointslices"] and rule["apiGroups"] == ["discovery.k8s.io"]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    (cond,) = spec["matchConditions"]
    # the new and the old object: a tenant may neither label a slice nor change the label
    assert "[object, oldObject]" in cond["expression"]
    assert "'endpointslice-controller.k8s.io'" in cond["expression"]
    (check,) = spec["validations"]
    writers = json.loads(check["expression"].removeprefix("request.userInfo.username in "))
    assert writers == values["writers"]
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }


# -- the memory, computed ---------------------------------------------------------------------

HELPERS = CHART / "templates" / "_helpers.tpl"
BENCH_MEMORY = REPO / "bench" / "memory.json"
MiB = 1 << 20


def memory_constants() -> dict[str, int]:
    """The measured constants, from their one place (the chart's helper)."""
    text = HELPERS.read_text()
    body = text.partition('{{- define "cozyebpf.memoryConstants" -}}')[2].partition("{{- end")[0]
    assert body.strip(), "no cozyebpf.memoryConstants in _helpers.tpl"
    return {k: int(v) for k, v in yaml.safe_load(body).items()}


def memory_for(max_services: int, counted: int | None) -> dict[str, Any]:
    """What the chart must render, the helper's formula written out again."""
    c = memory_constants()
    counters = c["counterBudget"]
    if counted is not None:
        counters = counted * (c["counterPerSlot"] + c["counterPerSlotCpu"] * c["counterCpus"])
    kernel = c["mapsPerService"] * max_services + counters
    request = c["agentBase"] + c["agentPerService"] * max_services + kernel
    peak = c["agentBase"] + c["agentPeakPerService"] * max_services + c["compilerChild"] + kernel
    request_mi = -(-request // MiB)
    limit = max(peak, request_mi * MiB * 100 // c["warnPercent"])
    return {
        "requests": {"cpu": "100m", "memory": f"{request_mi}Mi"},
        "limits": {"memory": f"{-(-limit // MiB)}Mi"},
    }


@pytest.mark.parametrize(
    ("max_services", "counted"), [(1000, None), (10000, 500), (65536, None), (131072, 131072)]
)
def test_the_memory_follows_max_services(helm: str, max_services: int, counted: int | None) -> None:
    args = ["--set", f"agent.maxServices={max_services}"]
    if counted is not None:
        args += ["--set", f"agent.countedServices={counted}"]
    res = container(render(helm, *args))["resources"]
    assert res == memory_for(max_services, counted)
    # the steady state at maxServices is below the share the agent warns at (memlimit.py)
    request, limit = (int(res[k]["memory"].rstrip("Mi")) for k in ("requests", "limits"))
    assert request <= 0.8 * limit


def test_resources_set_by_hand_win(helm: str) -> None:
    args = ["--set", "daemonset.resources.limits.memory=3Gi", "--set", "agent.maxServices=9"]
    assert container(render(helm, *args))["resources"] == {"limits": {"memory": "3Gi"}}


def test_the_constants_are_the_benchs_figures() -> None:
    """bench/memory.json's latest run (python -m bench.memory --record): the agent's RSS and
    peak per Service at its largest size, its baseline, the maps' and counters' kernel memory
    per Service; each constant covers its figure, by at most a quarter more."""
    runs = json.loads(BENCH_MEMORY.read_text())
    results = list(runs.values())[-1]
    c = memory_constants()
    big = max(results, key=lambda r: r["n"])
    assert big["n"] >= 100000, "the constants are measured at 100,000 Services"

    def covers(constant: int, measured: float) -> None:
        assert measured <= constant <= 1.25 * measured, (constant, measured)

    covers(c["agentPerService"], big["per_service"])
    covers(c["agentPeakPerService"], (big["peak"] - big["rss_base"]) / big["n"])
    covers(c["agentBase"], max(r["rss_base"] for r in results))
    for r in results:
        covers(c["mapsPerService"], r["maps_bytes"] / r["capacity"])
        per_slot = r["counters_bytes"] / (r["capacity"] + 1)  # slot 0 is no Service's
        assert per_slot <= c["counterPerSlot"] + c["counterPerSlotCpu"] * r["cpus"]
    assert c["counterBudget"] == 64 * MiB  # layout.SVCSTATS_BUDGET
    assert c["warnPercent"] <= 100 * 0.80  # memlimit.RESOLVE_AT: a full node does not warn


# -- the schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (["--set", "agent.maxServices=many"], "/agent/maxServices"),
        (["--set-string", "agent.removeCozyProxyTable=true"], "/agent/removeCozyProxyTable"),
        (["--set", "agent.logLevel=verbose"], "/agent/logLevel"),
        (["--set", "agent.flowTimeouts.udp=-1"], "/agent/flowTimeouts/udp"),
        (["--set", "agent.pinDir=/var/run/cozyebpf"], "/agent/pinDir"),
        (["--set", "health.port=98100"], "/health/port"),
        (["--set", "daemonset.hostNetwork=false"], "/daemonset/hostNetwork"),
        (["--set", "daemonset.resources.limits.memory=null"], "/daemonset/resources/limits"),
        (["--set", "daemonset.resources.limits.memory=lots"], "/daemonset/resources/limits"),
        (["--set", "daemonset.resources.requests.memory=1Gi"], "/daemonset/resources"),
        (["--set", "agent.maxServices=0"], "/agent/maxServices"),
        (["--set", "agent.countedServices=-5"], "/agent/countedServices"),
        (["--set", "daemonset.tolerations=everything"], "/daemonset/tolerations"),
        (["--set", "agent.podDevice=ovn0"], "/agent"),  # a misspelt value name
    ],
    ids=lambda v: v if isinstance(v, str) else v[-1],
)
def test_the_schema_rejects(helm: str, args: list[str], where: str) -> None:
    p = helm_template(helm, *args)
    assert p.returncode != 0, f"{args} was accepted"
    assert where in p.stderr, p.stderr


# -- deploy/ ---------------------------------------------------------------------------------


def test_deploy_is_rendered_from_the_chart(helm: str, tmp_path: Path) -> None:
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "render-deploy.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HELM": helm},
    )
    assert p.returncode == 0, p.stderr
    rendered = sorted(f.relative_to(tmp_path) for f in tmp_path.rglob("*") if f.is_file())
    assert len(rendered) == 6
    for rel in rendered:
        assert (tmp_path / rel).read_text() == (REPO / "deploy" / rel).read_text(), (
            f"deploy/{rel} differs from the chart's rendering: run `make deploy`"
        )
