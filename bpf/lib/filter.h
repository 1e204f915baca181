/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The port filter of the default mode (docs/datapath-semantics.md, "Ingress"). It keys on the
 * pod IP, as cozy-proxy does, so traffic sent to the pod IP directly is filtered like traffic
 * sent to the LB IP. The verdict is taken before any rewrite, so a dropped packet costs no
 * checksum work. filter() decides for the full paths, fast_filter() for the fast paths on the
 * addr value in place.
 */
#ifndef COZYEBPF_FILTER_H
#define COZYEBPF_FILTER_H

#include "flow.h"
#include "lookup.h"
#include "stats.h"

/* Is this ICMP error about a flow of the pod that the filter allows? */
static __always_inline int is_related(struct pkt *p, struct inner *in, const struct ip6 *pod,
				      __u64 now)
{
	if (!in->rewrite && !cz_ip6_eq(&in->src, pod))
		return 0; /* not about a packet the pod sent */
	if (in->proto == (p->v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP)) {
		__u8 echo = p->v6 ? ICMPV6_ECHO_REQUEST : ICMP_ECHO;

		return in->icmp_type == echo &&
		       flow_live(p->v6, pod, &in->dst, in->sport, 0, in->proto, now);
	}
	if (in->proto != IPPROTO_TCP && in->proto != IPPROTO_UDP && in->proto != IPPROTO_SCTP)
		return 0;
	if (flow_live(p->v6, pod, &in->dst, in->sport, in->dport, in->proto, now))
		return 1;
	return is_allowed(p->v6, pod, in->proto, in->sport);
}

/*
 * The cz_reason of the verdict (a pass or a drop) for a packet to `pod` in port-filter mode;
 * `e` is the destination's entry (its flags).
 */
static __always_inline __u32 filter(struct pkt *p, struct inner *in, const struct ip6 *pod,
				    __u8 flags, int out)
{
	__u8 echo_reply = p->v6 ? ICMPV6_ECHO_REPLY : ICMP_ECHOREPLY;
	/* the clock once per decision, not per flow looked up: fewer states (design.md, "Reply
	 * flows expire in the datapath") */
	__u64 now = bpf_ktime_get_coarse_ns();

	if (!p->first_frag) {
		struct frag_val *f = frag_find(p, pod);

		if (!f || bpf_ktime_get_ns() - f->seen_ns > CZ_FRAG_TIMEOUT_NS)
			return CZ_DROP_FRAG_ORPHAN;
		return f->passed ? CZ_PASS_FRAGMENT : CZ_DROP_FRAGMENT;
	}
	switch (p->proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		/* allow4/allow6, not the inline ports: a branch per slot here multiplied the
		 * states (XDP: 734,000 instructions); fast_ports_have is the fast paths' */
		if (!out && is_allowed(p->v6, pod, p->proto, p->dport))
			return CZ_PASS_PORT;
		if (flow_live(p->v6, pod, &p->src, p->dport, p->sport, p->proto, now))
			return CZ_PASS_REPLY;
		/* no pass_learn here (types.h, CZ_F_LEARN): a third more to verify with it */
		return out ? CZ_DROP_SOURCE : CZ_DROP_PORT;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if (!p->has_l4)
			return out ? CZ_DROP_SOURCE
				   : CZ_DROP_PROTO; /* ICMP in IPv6 / ICMPv6 in IPv4 */
		if (p->icmp_error && is_related(p, in, pod, now))
			return CZ_PASS_RELATED;
		if (!out && (flags & CZ_F_ALLOW_ICMP))
			return CZ_PASS_ICMP;
		if (p->icmp_type == echo_reply &&
		    flow_live(p->v6, pod, &p->src, p->sport, 0, p->proto, now))
			return CZ_PASS_REPLY;
		return out ? CZ_DROP_SOURCE : CZ_DROP_ICMP;
	default:
		return out ? CZ_DROP_SOURCE : CZ_DROP_PROTO;
	}
}

/*
 * A packet to a migrating pod (CZ_F_LEARN) that may belong to a flow recorded on another node:
 * TCP that opens no connection (a lone SYN does). It passes, unrecorded (types.h, CZ_F_LEARN).
 */
static __always_inline int cz_learns(__u8 flags, __u8 proto, __u8 tcp_flags)
{
	return (flags & CZ_F_LEARN) && proto == IPPROTO_TCP &&
	       (tcp_flags & (CZ_TCP_SYN | CZ_TCP_ACK)) != CZ_TCP_SYN;
}

/*
 * Is `word` one of the first `nports` inline ports (all 8 when they spill)? Here, in a program
 * that is verified on its own and small, a branch per slot costs the verifier nothing, and the
 * common Service with few ports pays for those only.
 */
static __always_inline int fast_ports_have(const struct cz_port *ports, __u8 nports, __u32 word)
{
	const __u32 *w = (const __u32 *)ports;
	int i;

#pragma unroll
	for (i = 0; i < CZ_INLINE_PORTS; i++) {
		if (i >= nports)
			return 0;
		if (w[i] == word)
			return 1;
	}
	return 0;
}

/*
 * The fast paths' port filter and source ranges, both families (`flags`, `ports` and `nports`
 * of the address's value; flags has CZ_F_PORT_FILTER or CZ_F_RANGES): a source outside the ranges
 * gets replies only (else drop_source), never pass_learn: learning stands in for a reply of a
 * flow recorded on another node, and the ranges hold there as here (issue 28); then whole-IP
 * passes, the port filter an allowed port (inline, or in allow4/allow6 when they spill), else a
 * reply of a flow, else, for a migrating pod, TCP that opens nothing (pass_learn), else
 * drop_port.
 */
static __always_inline __u32 fast_filter(int v6, __u8 flags, const struct cz_port *ports,
					 __u8 nports, const struct ip6 *pod,
					 const struct ip6 *remote, __u8 proto, __be16 sport,
					 __be16 dport, __u8 tcp_flags)
{
	int out = (flags & CZ_F_RANGES) && !src_in_range(v6, pod, remote);

	if (!out) {
		if (!(flags & CZ_F_PORT_FILTER))
			return CZ_NAT_INGRESS;
		if (fast_ports_have(ports, nports, cz_port_word(proto, dport)))
			return CZ_PASS_PORT;
		if (nports == CZ_PORTS_SPILL && is_allowed(v6, pod, proto, dport))
			return CZ_PASS_PORT;
	}
	if (flow_reply(v6, pod, remote, dport, sport, proto, 1))
		return CZ_PASS_REPLY;
	if (cz_unlikely(!out && cz_learns(flags, proto, tcp_flags)))
		return CZ_PASS_LEARN;
	return out ? CZ_DROP_SOURCE : CZ_DROP_PORT;
}

#endif
