"""An LB IP never takes an address the node already uses (issue 31), with the real datapath in
the single-node lab: a Service whose LB IP is the node's uplink address is refused, and a TCP
port the node itself listens on stays the node's (on a real node: SSH, the kubelet); an
address the node takes later wins over a Service already programmed with it, and gives it
back when it goes. `status`, `maps dump` and `explain` say why."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cozylab.k8s import Svc, manifest
from cozylab.netns import DEFAULT_PODS, NODE_UPLINK_IP, UPLINK
from tests.support.labtools import AgentLab, agent_lab, serve, tcp_talk, wait_for
from tests.support.packets import LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
PORT = 2222  # a port both the node and the pods listen on
HEALTH = "127.0.0.1:19820"
CLAIM = Svc("node-claim", NODE_UPLINK_IP, POD1.ip, whole_ip="true")
VM = Svc("vm2", LB_WHOLE, POD2.ip, whole_ip="true")


def answer_as(who: str) -> Callable[[socket.socket], None]:
    def handle(s: socket.socket) -> None:
        conn, _ = s.accept()
        with conn:
            conn.settimeout(2)
            conn.recv(1024)
            conn.sendall(who.encode())

    return handle


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("rsv", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2]) as env:
        lab = env.lab
        with (
            serve(lab, lab.node, socket.SOCK_STREAM, PORT, answer_as("node")),
            serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, PORT, answer_as("pod1")),
            serve(lab, lab.pod_ns(POD2), socket.SOCK_STREAM, PORT, answer_as("pod2")),
        ):
            yield env


def talk(env: AgentLab, addr: str) -> bytes:
    return tcp_talk(env.lab, env.lab.client, addr, PORT, b"hello")


def cli_json(env: AgentLab, *args: str) -> dict[str, object]:
    p = env.lab.exec(env.lab.node, *env.cmd, *args, "--pin-dir", env.pin_dir, "--json")
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def test_the_nodes_own_port_stays_the_nodes(env: AgentLab) -> None:
    env.manifest_path.write_text(manifest(CLAIM, VM))
    env.start_agent("--health-address", HEALTH)
    env.set_services(CLAIM, VM, expect=[VM])  # the claim is refused, vm2 programmed
    assert talk(env, NODE_UPLINK_IP) == b"node"
    assert talk(env, LB_WHOLE) == b"pod2"  # every other Service as always
    assert (
        f"Service default/node-claim: is not programmed: its LoadBalancer IP {NODE_UPLINK_IP} "
        f"is this node's address on {UPLINK}"
    ) in env.log()

    row = {
        "service": "Service default/node-claim",
        "lb_ip": NODE_UPLINK_IP,
        "kind": "node-address",
        "why": f"this node's address on {UPLINK}",
    }
    status = cli_json(env, "status", "--agent", HEALTH)
    assert status["agent"]["refused"] == [row]  # type: ignore[index]
    dump = cli_json(env, "maps", "dump", "--agent", HEALTH)
    assert dump["refused"] == [row]
    assert [s["lb_ip"] for s in dump["services"]] == [LB_WHOLE]  # type: ignore[attr-defined]
    text = env.lab.exec(
        env.lab.node, *env.cmd, "status", "--pin-dir", env.pin_dir, "--agent", HEALTH
    ).stdout
    assert f"default/node-claim: LB IP {NODE_UPLINK_IP} is this node's address" in text

    explained = cli_json(
        env,
        "explain",
        "--from",
        "198.51.100.2",
        "--to",
        f"{NODE_UPLINK_IP}:{PORT}",
        "--agent",
        HEALTH,
    )
    assert explained["verdict"] == "pass" and explained["reason"] is None
    assert explained["dst"] == NODE_UPLINK_IP  # untranslated
    hint = str(explained["hint"])
    assert hint.startswith(f"{NODE_UPLINK_IP} is not ours: Service default/node-claim asks")
    assert f"this node's address on {UPLINK}" in hint


def test_an_address_the_node_takes_later_wins_and_is_given_back(env: AgentLab) -> None:
    env.manifest_path.write_text(manifest(VM))
    env.start_agent()
    assert talk(env, LB_WHOLE) == b"pod2"
    env.lab.exec(env.lab.node, "ip", "addr", "add", f"{LB_WHOLE}/32", "dev", UPLINK)
    wait_for(lambda: not env.maps_state().services, 10, "vm2's entries to go")
    assert talk(env, LB_WHOLE) == b"node"  # the node's own address is the node's
    assert f"its LoadBalancer IP {LB_WHOLE} is this node's address on {UPLINK}" in env.log()
    env.lab.exec(env.lab.node, "ip", "addr", "del", f"{LB_WHOLE}/32", "dev", UPLINK)
    wait_for(lambda: env.maps_state().services, 10, "vm2 programmed again")
    assert talk(env, LB_WHOLE) == b"pod2"
