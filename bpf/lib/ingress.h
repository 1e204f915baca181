/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The ingress decision shared by the XDP program and the tc ingress program: is the packet for
 * a managed address, is it well formed, does it pass the source ranges and the port filter,
 * where does it go. ingress() decides for the full paths; fast_outside() chooses the program
 * for a frame an entry program does not take; fast_ingress() is the fast path's decision of tc
 * ingress and of the node's connections to LB IPs (to_lb.h, to_lb4); XDP's IPv4 fast path is
 * in ingress.c.
 */
#ifndef COZYEBPF_INGRESS_H
#define COZYEBPF_INGRESS_H

#include "account.h"
#include "dryrun.h"
#include "filter.h"
#include "flow.h"
#include "limit.h"
#include "lookup.h"
#include "nat.h"
#include "parse.h"
#include "stats.h"
#include "tc.h"

/* Neighbour discovery to a pod IP passes untouched, whatever the filter. */
static __always_inline int cz_is_ndp(struct pkt *p)
{
	return p->v6 && p->proto == IPPROTO_ICMPV6 && p->has_l4 && p->icmp_type >= 133 &&
	       p->icmp_type <= 137;
}

/*
 * Returns CZ_NOT_OURS, or the cz_reason of the verdict. On a pass to an LB IP, *pod is the new
 * destination and *rewrite is 1; a pass to a pod IP sent directly has *rewrite 0. *slot is the
 * Service's svcstats slot. `outside` (a constant): the decision of the outside program, for a
 * packet from outside the source ranges of a restricted pod, which the entry program found
 * (fast_outside, below): only replies of the pod's flows and ICMP errors about them pass.
 * For ICMP errors, `in` describes the embedded packet; in->rewrite says
 * its source must change too. A first fragment's verdict in port-filter mode (or from outside
 * the source ranges) is noted for the end of the full path, which records it for the fragments
 * after it (account.h).
 */
static __always_inline __u32 ingress(struct pkt *p, void *data, void *data_end, struct inner *in,
				     struct ip6 *pod, int *rewrite, __u32 *slot, int *limited,
				     int outside)
{
	struct cz_entry e = {};
	__u32 reason;

	*rewrite = 0;
	if (!lookup_addr(p->v6, &p->dst, &e))
		return CZ_NOT_OURS;
	*slot = e.in_slot;
	*limited = e.flags & CZ_F_LIMIT; /* the end checks the limits (slow_end) */
	if (e.kind & CZ_K_LB) {
		*rewrite = 1;
		*pod = e.pod;
	} else {
		*pod = p->dst;
	}
	if (check_ip(p, data, data_end) != CZ_OK)
		return CZ_DROP_MALFORMED;
	if (cz_is_ndp(p))
		return CZ_NOT_OURS;
	if (p->icmp_error) {
		if (parse_inner(p, data_end, in) < 0)
			return CZ_DROP_ICMP_INNER;
		/* the pod's own packet left as the LB IP: it becomes the pod IP again */
		in->rewrite = *rewrite && cz_ip6_eq(&in->src, &p->dst);
	}
	if (outside) {
		reason = filter(p, in, pod, e.flags, 1);
	} else {
		if (!(e.flags & CZ_F_PORT_FILTER))
			return CZ_NAT_INGRESS;
		reason = filter(p, in, pod, e.flags, 0);
	}
	if (p->first_frag && p->more_frags)
		cz_done_frag(p); /* its verdict is recorded at the end (account.h) */
	return reason;
}

/*
 * The full path of ingress, XDP (is_xdp) or tc: parse, decide (ingress()), rewrite, and the end
 * (account.h). `outside` (a constant): the decision for a packet from outside the pod's source
 * ranges, which the entry program hands to a program of its own (fast_outside), so that neither
 * program's verification follows both decisions. Both constants: each program verifies only its
 * own hook's code.
 */
static __always_inline int ingress_full(void *ctx, int is_xdp, int outside)
{
	void *data = is_xdp ? (void *)(long)((struct xdp_md *)ctx)->data
			    : (void *)(long)((struct __sk_buff *)ctx)->data;
	void *data_end = is_xdp ? (void *)(long)((struct xdp_md *)ctx)->data_end
				: (void *)(long)((struct __sk_buff *)ctx)->data_end;
	struct hdr_cursor nh = {.pos = data, .start = data};
	struct pkt p = {};
	struct inner in = {};
	struct ip6 pod = {};
	__u32 reason, slot = 0;
	int rewrite, limited = 0;

	cz_dry_begin(cz_ctx_nonce(ctx, is_xdp));
	p.frame_len = cz_ctx_len(ctx, is_xdp, data, data_end);
	if (parse_frame(&nh, data, data_end, &p) < 0) {
		slow_not_ours(ctx, is_xdp);
		return is_xdp ? XDP_PASS : CZ_TC_NEXT;
	}
	reason = ingress(&p, data, data_end, &in, &pod, &rewrite, &slot, &limited, outside);
	if (reason == CZ_NOT_OURS) {
		slow_not_ours(ctx, is_xdp);
		return is_xdp ? XDP_PASS : CZ_TC_NEXT;
	}
	/* the verdict first: `rewrite && !drop` took XDP's full path 31,665 more to verify */
	if (!cz_is_drop(reason) && rewrite) {
		if (p.icmp_error && in.rewrite)
			nat_inner(&p, &in, data_end, 1, &pod);
		if (is_xdp)
			nat_xdp(&p, data_end, &pod);
		else if (nat_skb(ctx, &p, data, data_end, 1, &pod) < 0)
			reason = CZ_DROP_MALFORMED;
	}
	return slow_finish(ctx, is_xdp, 0, 0, &p, reason, slot,
			   cz_ctx_len(ctx, is_xdp, data, data_end), 0, limited);
}

/*
 * Before a frame goes on to a full path: is it for a restricted pod (CZ_F_RANGES) and from
 * outside the pod's source ranges? Then the outside program takes it (tail.h), which lets only
 * replies of the pod's flows and ICMP errors about them through; the full path never looks at
 * ranges. Deciding this here, on the addresses at their fixed offsets, costs the full path's
 * verification nothing (a branch there doubles it). The IP header is found after up to
 * CZ_MAX_VLAN tags, as parse_eth finds it; whatever the full parser then refuses, the outside
 * program's parser refuses alike.
 */
static __always_inline int fast_outside(void *data, void *data_end)
{
	struct ethhdr *eth = data;
	void *l3 = data + sizeof(*eth);
	__be16 proto;
	int i;

	if (l3 > data_end)
		return 0;
	proto = *(__be16 *)(data + 12);
#pragma unroll
	for (i = 0; i < CZ_MAX_VLAN; i++) {
		struct cz_vlan *vh = l3;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(CZ_ETH_P_8021AD))
			break;
		if ((void *)(vh + 1) > data_end)
			return 0;
		proto = vh->proto;
		l3 = vh + 1;
	}
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		struct addr4_val *v;
		__be32 pod;

		if ((void *)(ip + 1) > data_end)
			return 0;
		v = cz_addr4.lookup(&ip->daddr);
		if (cz_likely(!v || !(v->flags & CZ_F_RANGES)))
			return 0;
		pod = (v->kind & CZ_K_LB) ? v->pod_ip : ip->daddr;
		return !src_in_range(0, (struct ip6 *)&pod, (struct ip6 *)&ip->saddr);
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		struct addr6_val *v;
		struct ip6 pod, src;

		if ((void *)(ip6 + 1) > data_end)
			return 0;
		v = cz_addr6.lookup((struct ip6 *)&ip6->daddr);
		if (cz_likely(!v || !(v->flags & CZ_F_RANGES)))
			return 0;
		if (v->kind & CZ_K_LB)
			pod = v->pod_ip;
		else
			__builtin_memcpy(&pod, &ip6->daddr, sizeof(pod));
		__builtin_memcpy(&src, &ip6->saddr, sizeof(src));
		return !src_in_range(1, &pod, &src);
	}
	return 0;
}

/*
 * Ingress, IPv6: CZ_NOT_OURS, CZ_SLOW, or the cz_reason of the verdict. On a pass with
 * f->rewrite, *to is the new destination.
 */
static __always_inline __u32 fast_ingress6(void *data, void *data_end, __u32 frame_len, __u32 segs,
					   struct ipv6hdr *ip6, struct cz_fast *f, struct ip6 *to)
{
	struct addr6_val *v = cz_addr6.lookup((struct ip6 *)&ip6->daddr);
	struct ip6 remote;
	__u32 reason;

	if (!v)
		return CZ_NOT_OURS;
	if (fast_check6(f, ip6, data, data_end, frame_len) < 0)
		return CZ_SLOW;
	f->slot = v->in_slot;
	if (v->kind & CZ_K_LB)
		*to = v->pod_ip;
	else
		__builtin_memcpy(to, &ip6->daddr, sizeof(*to));
	if (!(v->flags & CZ_F_FLOWS)) {
		reason = cz_limit_in(v->flags, f->slot, fast_wire_len(f, frame_len, segs), segs,
				     CZ_NAT_INGRESS);
	} else {
		__builtin_memcpy(&remote, &ip6->saddr, sizeof(remote));
		reason = cz_limit_in(v->flags, f->slot, fast_wire_len(f, frame_len, segs), segs,
				     fast_filter(1, v->flags, v->ports, v->nports, to, &remote,
						 f->proto, f->sport, f->dport, f->tcp_flags));
	}
	/*
	 * Read again after the decision, not kept from the branch above: kept, it was a constant
	 * 0 on one way and 1 on the other through the whole filter, two states the verifier of
	 * Linux 6.1 does not prune as one (a spilled 0 is STACK_ZERO there), so it followed the
	 * filter twice.
	 */
	f->rewrite = v->kind & CZ_K_LB;
	return reason;
}

/*
 * Ingress, IPv4 (tc): CZ_NOT_OURS, CZ_SLOW, or the cz_reason of the verdict. On a pass with
 * f->rewrite, to->a[0] is the new destination.
 */
static __always_inline __u32 fast_ingress4(void *data, void *data_end, __u32 frame_len, __u32 segs,
					   struct iphdr *ip, struct cz_fast *f, struct ip6 *to)
{
	struct addr4_val *v = cz_addr4.lookup(&ip->daddr);
	__u32 reason;
	__be32 pod;

	if (!v)
		return CZ_NOT_OURS;
	if (fast_check4(f, ip, data, data_end, frame_len) < 0)
		return CZ_SLOW;
	f->slot = v->in_slot;
	pod = (v->kind & CZ_K_LB) ? v->pod_ip : ip->daddr;
	to->a[0] = pod;
	if (!(v->flags & CZ_F_FLOWS))
		reason = cz_limit_in(v->flags, f->slot, fast_wire_len(f, frame_len, segs), segs,
				     CZ_NAT_INGRESS);
	else
		reason = cz_limit_in(v->flags, f->slot, fast_wire_len(f, frame_len, segs), segs,
				     fast_filter(0, v->flags, v->ports, v->nports,
						 (struct ip6 *)&pod, (struct ip6 *)&ip->saddr,
						 f->proto, f->sport, f->dport, f->tcp_flags));
	f->rewrite = v->kind & CZ_K_LB; /* after the decision: see fast_ingress6 */
	return reason;
}

/*
 * Ingress (tc), either family: CZ_NOT_OURS, CZ_SLOW, or the cz_reason of the verdict. On a pass
 * with f->rewrite, *to is the new destination (IPv4: to->a[0]).
 */
static __always_inline __u32 fast_ingress(void *data, void *data_end, __u32 frame_len, __u32 segs,
					  struct cz_fast *f, struct ip6 *to)
{
	struct iphdr *ip = fast_ip4(data, data_end);
	struct ipv6hdr *ip6;

	if (ip)
		return fast_ingress4(data, data_end, frame_len, segs, ip, f, to);
	ip6 = fast_ip6(data, data_end);
	if (ip6)
		return fast_ingress6(data, data_end, frame_len, segs, ip6, f, to);
	return CZ_SLOW;
}

#endif
