"""Zero-downtime lifecycle: traffic keeps flowing, without a single lost packet, across agent
restarts, a kill -9 and a program upgrade; hooks are checked and repaired; tcx mode runs
before Cilium-like programs; a foreign XDP program is worked around when asked to."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.attach import current_xdp, link_pin
from cozyebpf.datapath.loader import bpf_dir
from cozylab.cilium import CiliumLike
from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, DEFAULT_PODS, UPLINK
from cozylab.traffic import TcpChat, UdpStream, flowing, line_echo
from tests.support.labtools import AgentLab, agent_lab, serve, tcp_talk, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80)])


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("z", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(WHOLE, FILT)) as env:
        yield env


def upgraded_bpf_dir(tmp: Path) -> Path:
    """A copy of bpf/ whose entry programs differ by one harmless helper call: a new
    version of the programs, as an upgrade would bring."""
    new = tmp / "bpf-v2"
    shutil.copytree(bpf_dir(), new)
    for name in ("ingress.c", "egress.c"):
        path = new / name
        text = path.read_text()
        text = text.replace("\n{\n", "\n{\n\tbpf_ktime_get_ns(); /* v2 */\n", 1)
        path.write_text(text)
    return new


def tags(env: AgentLab) -> dict[str, str]:
    def q() -> dict[str, str]:
        idx = socket.if_nametoindex(UPLINK)
        out = {}
        for hook, kind in (("ingress", bpfsys.BPF_TCX_INGRESS), ("egress", bpfsys.BPF_TCX_EGRESS)):
            ids, _ = bpfsys.prog_query(idx, kind)
            for i in ids:
                info = bpfsys.prog_info_by_id(i)
                out[f"{hook}:{info.name}"] = info.tag
        xdp = current_xdp(idx)
        if xdp:
            out["xdp"] = bpfsys.prog_info_by_id(xdp[0]).tag
        return out

    return env.lab.in_ns(env.lab.node, q)


def test_no_packet_lost_across_restarts_kill_and_upgrade(env: AgentLab, tmp_path: Path) -> None:
    lab = env.lab
    env.start_agent()
    env.set_services(WHOLE, FILT)
    inbound = UdpStream(lab, lab.client, (LB_WHOLE, 9100), (lab.pod_ns(POD1), 9100), 1000)
    outbound = UdpStream(lab, lab.pod_ns(POD1), (CLIENT_IP, 9101), (lab.client, 9101), 1000)
    with (
        serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 9102, line_echo),
        serve(lab, lab.client, socket.SOCK_STREAM, 9103, line_echo),
    ):
        chat_in = TcpChat(lab, lab.client, (LB_WHOLE, 9102))  # to the whole-IP VM
        chat_out = TcpChat(lab, lab.pod_ns(POD2), (CLIENT_IP, 9103))  # a filtered pod's own
        streams = (inbound, outbound, chat_in, chat_out)
        links = {name: link for name, (link, _) in env.links().items()}
        programs = [env.links()["xdp_uplink"][1]]
        for s in streams:
            s.start()
        # each phase lets every stream move on (600 datagrams, 20 rounds): six phases make
        # the totals asserted below, however long the agent takes to start
        flowing(streams, udp=600, tcp=20)
        for _ in range(3):
            assert env.stop_agent(signal.SIGTERM) == 0
            env.start_agent()
            programs.append(env.links()["xdp_uplink"][1])
            flowing(streams, udp=600, tcp=20)
        env.stop_agent(signal.SIGKILL)
        flowing(streams, udp=600, tcp=20)  # nobody runs the datapath's control plane now
        env.start_agent()
        programs.append(env.links()["xdp_uplink"][1])
        before = tags(env)
        assert env.stop_agent(signal.SIGTERM) == 0
        env.env["COZYEBPF_BPF_DIR"] = str(upgraded_bpf_dir(tmp_path))
        env.start_agent()  # the upgrade
        programs.append(env.links()["xdp_uplink"][1])
        after = tags(env)
        flowing(streams, udp=600, tcp=20)
        for s in streams:
            s.stop()
    assert (
        before["xdp"] != after["xdp"] and before["egress:cz_egress"] != after["egress:cz_egress"]
    ), "the upgrade must load changed programs"
    # every start replaced the programs in place: the same links throughout, 6 XDP programs
    assert {name: link for name, (link, _) in env.links().items()} == links
    assert len(set(programs)) == 6
    assert len(inbound.sent) > 3000 and len(outbound.sent) > 3000
    assert inbound.lost() == [] and outbound.lost() == []
    assert outbound.peers == {LB_WHOLE}  # translated all along
    for chat in (chat_in, chat_out):
        assert chat.error is None and chat.rounds > 100


def test_tcx_mode_runs_before_cilium_like_programs(env: AgentLab) -> None:
    lab = env.lab
    cilium = CiliumLike.on_uplink(lab, LB_WHOLE)
    try:
        env.start_agent("--ingress-hook", "tcx")
        env.set_services(WHOLE, FILT)
        assert set(env.links()) == {"tcx-ingress_uplink", "tcx-egress_uplink"}
        before = cilium.to_lb()
        with serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 4444, line_echo):
            assert tcp_talk(lab, lab.client, LB_WHOLE, 4444, b"hi\n") == b"hi\n"
        assert lab.exec(lab.client, "ping", "-c", "2", "-W", "1", LB_WHOLE).returncode == 0
        assert cilium.to_lb() == before, "Cilium-like programs never see the LB IP"

        def order() -> list[str]:
            idx = socket.if_nametoindex(UPLINK)
            ids, _ = bpfsys.prog_query(idx, bpfsys.BPF_TCX_INGRESS)
            return [bpfsys.prog_info_by_id(i).name for i in ids]

        assert lab.in_ns(lab.node, order) == ["cz_ingress_tc", "cilium_like"]
    finally:
        cilium.close()


def test_attachments_are_checked_and_repaired(env: AgentLab) -> None:
    lab = env.lab
    env.start_agent("--check-interval", "0.3")
    env.set_services(WHOLE)
    # someone puts a program in front of ours in the tcx egress chain
    from bcc import BPF

    b = BPF(text=b"int pusher(struct __sk_buff *skb) { return -1; }")
    fd = b.load_func(b"pusher", BPF.SCHED_CLS).fd

    def push() -> int:
        idx = socket.if_nametoindex(UPLINK)
        return bpfsys.link_create(fd, idx, bpfsys.BPF_TCX_EGRESS, flags=bpfsys.BPF_F_BEFORE)

    def order() -> list[str]:
        ids, _ = bpfsys.prog_query(socket.if_nametoindex(UPLINK), bpfsys.BPF_TCX_EGRESS)
        return [bpfsys.prog_info_by_id(i).name for i in ids]

    egress = env.links()["tcx-egress_uplink"]
    link = lab.in_ns(lab.node, push)
    try:
        # the repair attaches a new link in front, detaches the old one, then moves the pin to
        # the new one: both are awaited (the order alone holds a moment before the pin moves)
        wait_for(
            lambda: (
                lab.in_ns(lab.node, order) == ["cz_egress", "pusher"]
                and env.links()["tcx-egress_uplink"] != egress
            ),
            10,
            lambda: (
                f"ours first, attached again: {lab.in_ns(lab.node, order)}, pinned link "
                f"{env.links()['tcx-egress_uplink']} (was {egress}); log:\n{env.log()[-2000:]}"
            ),
        )
    finally:
        bpfsys.link_detach(link)
        os.close(link)
    # someone detaches our XDP link: it comes back
    xdp_link, _ = env.links()["xdp_uplink"]
    xdp_pin = link_pin(env.pin_dir, "xdp", UPLINK)
    pinned = bpfsys.obj_get(xdp_pin)
    bpfsys.link_detach(pinned)
    os.close(pinned)

    def xdp() -> str:
        cur = current_xdp(socket.if_nametoindex(UPLINK))
        return bpfsys.prog_info_by_id(cur[0]).name if cur else ""

    wait_for(
        lambda: (
            env.links()["xdp_uplink"][0] != xdp_link and lab.in_ns(lab.node, xdp) == "cz_ingress"
        ),
        10,
        "the XDP repair: a new link",
    )
    wait_for(
        lambda: (
            lab.exec(lab.client, "ping", "-c", "1", "-W", "1", LB_WHOLE, check=False).returncode
            == 0
        ),
        10,
        "traffic again",
    )


def test_switching_the_ingress_hook_keeps_one_program(env: AgentLab) -> None:
    env.start_agent()
    env.set_services(WHOLE)
    assert set(tags(env)) == {"xdp", "egress:cz_egress"}
    env.stop_agent()
    env.start_agent("--ingress-hook", "tcx")
    assert set(tags(env)) == {"ingress:cz_ingress_tc", "egress:cz_egress"}
    assert set(env.links()) == {"tcx-ingress_uplink", "tcx-egress_uplink"}, "no XDP link left"
    assert env.lab.exec(env.lab.client, "ping", "-c", "1", "-W", "2", LB_WHOLE).returncode == 0
    env.stop_agent()
    env.start_agent("--ingress-hook", "xdp")
    assert set(tags(env)) == {"xdp", "egress:cz_egress"}
    out = env.lab.exec(env.lab.node, *env.cmd, "detach", "--pin-dir", env.pin_dir).stdout
    assert "detached" in out and tags(env) == {}


def test_a_foreign_xdp_program_is_kept_and_worked_around(env: AgentLab) -> None:
    from bcc import BPF

    b = BPF(text=b"int foreign_xdp(struct xdp_md *ctx) { return XDP_PASS; }")
    fn = b.load_func(b"foreign_xdp", BPF.XDP)
    env.lab.in_ns(env.lab.node, lambda: b.attach_xdp(UPLINK.encode(), fn, 0))
    try:
        env.start_agent("--on-foreign-xdp", "tcx")
        env.set_services(WHOLE)
        t = tags(env)
        assert "ingress:cz_ingress_tc" in t and "xdp" in t

        def xdp_name() -> str:
            cur = current_xdp(socket.if_nametoindex(UPLINK))
            return bpfsys.prog_info_by_id(cur[0]).name if cur else ""

        assert env.lab.in_ns(env.lab.node, xdp_name) == "foreign_xdp"
        assert env.lab.exec(env.lab.client, "ping", "-c", "1", "-W", "2", LB_WHOLE).returncode == 0
    finally:
        env.lab.in_ns(env.lab.node, lambda: BPF.remove_xdp(UPLINK.encode(), 0))


def test_cozy_proxy_table_is_reported_or_removed(env: AgentLab) -> None:
    from cozylab.netns import cozy_proxy_ruleset

    lab = env.lab
    lab.exec(lab.node, "nft", "-f", "-", input=cozy_proxy_ruleset([(LB_WHOLE, POD1.ip)]))
    env.start_agent()
    assert "nftables table `ip cozy_proxy` (cozy-proxy) is present" in env.log()
    assert (
        lab.exec(lab.node, "nft", "list", "table", "ip", "cozy_proxy", check=False).returncode == 0
    )
    env.stop_agent()
    env.start_agent("--remove-cozy-proxy-table")
    assert (
        lab.exec(lab.node, "nft", "list", "table", "ip", "cozy_proxy", check=False).returncode != 0
    )
