"""Counter reasons, mirroring `enum cz_reason` in bpf/lib/stats.h (a test compares them)."""

from __future__ import annotations

#: index == enum value; names are what `maps dump` prints
REASONS: tuple[str, ...] = (
    "nat_ingress",
    "nat_egress",
    "pass_port",
    "pass_icmp",
    "pass_reply",
    "pass_fragment",
    "drop_port",
    "drop_icmp",
    "drop_proto",
    "drop_malformed",
    "flow_new",
    "flow_error",
    "pass_related",
    "drop_fragment",
    "drop_frag_orphan",
    "drop_icmp_inner",
    "drop_source",
    "pass_learn",
    "drop_spoofed",
    "drop_missed_tail_call",
    "drop_limit",
)

DESCRIPTIONS: dict[str, str] = {
    "nat_ingress": "whole-IP packet translated LB IP -> pod IP",
    "nat_egress": "pod packet translated pod IP -> LB IP",
    "pass_port": "port filter: allowed (pod, protocol, port)",
    "pass_icmp": "port filter: ICMP with allowICMP",
    "pass_reply": "port filter: reply to a flow the pod opened",
    "pass_fragment": "port filter: non-first fragment whose first fragment passed",
    "drop_port": "port filter: TCP/UDP/SCTP port not in spec.ports",
    "drop_icmp": "port filter: ICMP without allowICMP",
    "drop_proto": "port filter: protocol without ports (GRE, ESP, ...)",
    "drop_malformed": "managed address, invalid or truncated header: not translated",
    "flow_new": "flow-table entry created (egress)",
    "flow_error": "flow-table entry could not be written",
    "pass_related": "port filter: ICMP error about an allowed flow",
    "drop_fragment": "port filter: non-first fragment after a dropped first one",
    "drop_frag_orphan": "port filter: non-first fragment whose first one was not seen",
    "drop_icmp_inner": "ICMP error with a truncated, invalid or nested inner packet",
    "drop_source": "source ranges: a source outside them, not a reply to the pod's flow",
    "pass_learn": "port filter: TCP that opens nothing, to a pod that is migrating",
    "drop_spoofed": "a managed pod IP as source, from a device the node does not route it to",
    "drop_missed_tail_call": "the full path a frame was handed to was not there: dropped whole",
    "drop_limit": "over its Service's limit: ingressBandwidth, ingressPacketRate (or the node's "
    "guard), egressBandwidth",
}

#: the drop reasons in the order of svc_stat.drops[] (cz_drop_index in bpf/lib/stats.h: the
#: drop reasons in the order of their values)
SVC_DROP_REASONS: tuple[str, ...] = tuple(r for r in REASONS if r.startswith("drop_"))


def drop_index(reason: int) -> int:
    """cz_drop_index(): where a drop reason (its enum value) counts in svc_stat.drops[]."""
    return SVC_DROP_REASONS.index(REASONS[reason])


#: reasons that are not packets but events (flow-table insertions): no Service counts them
EVENT_REASONS = ("flow_new", "flow_error")
