"""The Cilium 1.19 failure, reproduced: a TC program on the node's uplink drops packets to the
LB IP on ports the Service does not list (Cilium's wildcard <LB_IP>:0/ANY entry, DROP_NO_SERVICE).
nftables NAT in prerouting (cozy-proxy) runs after it and never sees those packets; cozyebpf's
XDP program runs before it, so Cilium only ever sees the pod IP."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from cozyebpf.datapath import bpfsys
from cozylab.cilium import LISTED, CiliumLike
from cozylab.k8s import Svc
from cozylab.netns import CLIENT_IP, CLIENT_MAC, UPLINK, UPLINK_MAC, cozy_proxy_ruleset
from cozylab.netns import DEFAULT_PODS as PODS
from tests.support.labtools import AgentLab, agent_lab
from tests.support.packets import LB_WHOLE

POD1 = PODS[0]
UNLISTED = 4444


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("c", tmp_path_factory.mktemp("cilium"), cozyebpf_cmd, PODS[:1]) as env:
        yield env


def syn(port: int, marker: int) -> bytes:
    return bytes(
        Ether(src=CLIENT_MAC, dst=UPLINK_MAC)
        / IP(src=CLIENT_IP, dst=LB_WHOLE, id=marker)
        / TCP(sport=45000, dport=port)
    )


def arrived(env: AgentLab, port: int, marker: int) -> bool:
    got = env.send_and_capture(
        syn(port, marker), POD1, lambda f: IP in Ether(f) and Ether(f)[IP].id == marker
    )
    return len(got) == 1 and Ether(got[0])[IP].dst == POD1.ip


def test_nftables_nat_loses_unlisted_ports_cozyebpf_does_not(env: AgentLab) -> None:
    lab = env.lab
    cilium = CiliumLike.on_uplink(lab, LB_WHOLE)
    try:
        # 1. cozy-proxy: nftables stateless NAT in prerouting
        lab.exec(lab.node, "nft", "-f", "-", input=cozy_proxy_ruleset([(LB_WHOLE, POD1.ip)]))
        assert arrived(env, LISTED, 1), "nftables NAT works for a listed port"
        assert not arrived(env, UNLISTED, 2), "the Cilium-like program drops unlisted ports"
        seen, dropped = cilium.to_lb()
        assert dropped >= 1 and seen >= 2
        lab.exec(lab.node, "nft", "delete", "table", "ip", "cozy_proxy")

        # 2. cozyebpf with the same Service (whole-IP, spec.ports = [22])
        env.manifest_path.write_text("")
        env.start_agent()
        env.set_services(Svc("vm", LB_WHOLE, POD1.ip, [("TCP", LISTED)], whole_ip="true"))
        before = cilium.to_lb()
        assert arrived(env, UNLISTED, 3), "cozyebpf delivers the unlisted port"
        assert arrived(env, LISTED, 4)
        assert cilium.to_lb() == before, "Cilium must never see a packet to the LB IP"

        # our egress program runs before the Cilium-like one in the tcx chain
        def order() -> list[str]:
            ids, _ = bpfsys.prog_query(socket.if_nametoindex(UPLINK), bpfsys.BPF_TCX_EGRESS)
            return [bpfsys.prog_info_by_id(i).name for i in ids]

        assert lab.in_ns(lab.node, order) == ["cz_egress", "cilium_like"]
    finally:
        cilium.close()
