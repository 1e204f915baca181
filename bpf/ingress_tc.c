// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress as a tc program, for devices without native XDP or when --ingress-hook tcx is
 * chosen: the same decision as the XDP program (lib/ingress.h), attached through
 * tcx before every other program, so Cilium's tc programs still only see pod IPs.
 * cz_ingress_tc decides the common IPv4 frame, cz_ingress_tc6 the common IPv6 frame; every other
 * frame goes on to cz_ingress_tc_slow, and with host routing on what they let in to
 * cz_ingress_tc_route.
 */
#include <uapi/linux/bpf.h>
#include "lib/account.h"
#include "lib/ingress.h"
#include "lib/nat.h"
#include "lib/parse.h"
#include "lib/route.h"
#include "lib/tail.h"
#include "lib/tc.h"

/*
 * The end of a tc ingress decision (`reason`, of the frame whose headers `f` holds; `to` its
 * new destination): a frame the fast path does not take goes to the outside program or the
 * full path; one let in is counted and translated (cz_fast_end_f), then with host routing on
 * handed to cz_ingress_tc_route. A tc verdict.
 */
static __always_inline int tc_decided(struct __sk_buff *skb, void *data, void *data_end,
				      __u32 reason, struct cz_fast *f, struct ip6 *to)
{
	if (reason == CZ_SLOW) {
		if (fast_outside(data, data_end))
			cz_tail_tc.call(skb, CZ_OUTSIDE_INGRESS_TC);
		else
			cz_tail_tc.call(skb, CZ_SLOW_INGRESS_TC);
		return cz_tail_missed(skb, 0, 0); /* the loader fills the array before attaching */
	}
	if (reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	if (reason == CZ_DROP_PORT || reason == CZ_DROP_SOURCE || reason == CZ_DROP_LIMIT) {
		cz_fast_end_d(skb, 0, 0, reason, 1, f->slot, skb->len, f->v6, f->proto, f->l3,
			      f->sport, f->dport, f->csum, f->csum_off, f->rewrite, data_end, to,
			      to->a[0]);
		return CZ_TC_DROP;
	}
	if (cz_fast_end_d(skb, 0, 0, reason, 0, f->slot, skb->len, f->v6, f->proto, f->l3, f->sport,
			  f->dport, f->csum, f->csum_off, f->rewrite, data_end, to, to->a[0]))
		return CZ_TC_DROP;
	if (!cz_host_routing())
		return CZ_TC_NEXT;
	cz_tail_rare.call(skb, CZ_RARE_ROUTE_IN); /* cz_ingress_tc_route */
	return CZ_TC_NEXT; /* decided and translated: a missed tail call leaves it to the stack */
}

/* IPv4; every other frame goes on to cz_ingress_tc6. */
int cz_ingress_tc(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct cz_fast f = {};
	struct iphdr *ip;
	struct ip6 to;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = fast_ip4(data, data_end);
	if (!ip) {
		cz_tail_rare.call(skb, CZ_RARE_TC6); /* cz_ingress_tc6 */
		return cz_tail_missed(skb, 0, 0); /* the loader fills the array before attaching */
	}
	return tc_decided(skb, data, data_end,
			  fast_ingress4(data, data_end, skb->len, cz_tc_segs(skb), ip, &f, &to), &f,
			  &to);
}

/*
 * IPv6 at tc ingress, and what is neither family (the full path's): a program of its own, so
 * that the entry verifies its IPv4 alone (tc's generic fast path and its ending, verified for
 * both families in one program, made the entry twice the XDP entry, which has a path of its own
 * for IPv4).
 */
int cz_ingress_tc6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = fast_ip6(data, data_end);
	struct cz_fast f = {};
	struct ip6 to;

	if (!ip6)
		return tc_decided(skb, data, data_end, CZ_SLOW, &f, &to);
	return tc_decided(skb, data, data_end,
			  fast_ingress6(data, data_end, skb->len, cz_tc_segs(skb), ip6, &f, &to),
			  &f, &to);
}

/*
 * Host routing of what cz_ingress_tc and cz_ingress_tc6 let in (--host-routing on): a program of
 * its own, as behind XDP (cz_route_tc), so that the entries carry the decision alone (the FIB,
 * TTL, MTU and bpf_redirect_neigh verified in the entry were a third of its instructions on
 * 6.18). The frame is neither decided nor counted again: cz_route_in hands it on, or leaves it
 * to the stack.
 */
int cz_ingress_tc_route(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (data + sizeof(struct ethhdr) > data_end)
		return CZ_TC_NEXT;
	return cz_route_in(skb, *(__be16 *)(data + 12) == bpf_htons(ETH_P_IPV6));
}

/*
 * Host routing behind XDP (--host-routing on, ingress on XDP): tcx ingress of the uplink, after
 * cz_ingress. A frame XDP let through carries CZ_META_ROUTE in its metadata (cz_xdp_pass) and is
 * handed on (cz_route_in: the FIB, TTL, MTU, bpf_redirect_neigh, or the stack); it is neither
 * decided nor counted again. Every other frame goes on untouched.
 */
int cz_route_tc(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	void *meta = (void *)(long)skb->data_meta;

	if (meta + sizeof(__u32) > data || *(__u32 *)meta != CZ_META_ROUTE)
		return CZ_TC_NEXT;
	if (data + sizeof(struct ethhdr) > data_end)
		return CZ_TC_NEXT;
	return cz_route_in(skb, *(__be16 *)(data + 12) == bpf_htons(ETH_P_IPV6));
}

/* Every frame the fast path does not take. */
int cz_ingress_tc_slow(struct __sk_buff *skb)
{
	return ingress_full(skb, 0, 0);
}

/* A frame from outside the source ranges of a restricted pod. */
int cz_ingress_tc_outside(struct __sk_buff *skb)
{
	return ingress_full(skb, 0, 1);
}
