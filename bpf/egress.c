// SPDX-License-Identifier: GPL-2.0
/*
 * Egress, tcx (or clsact) egress on each uplink device: a packet from a managed pod IP (IPv4 or
 * IPv6) gets source := LB IP (lib/snat.h); an ICMP error the pod sends about a packet it received
 * gets its embedded packet's destination translated too. In port-filter mode, or with source
 * ranges, the flow is recorded (before the packet leaves) so that replies pass ingress. Passes
 * with TCX_NEXT (== TC_ACT_UNSPEC), so programs after us (Cilium's) still run.
 * docs/datapath-semantics.md, "Egress". The pod-facing hook, which translates a pod's packet
 * before it reaches the node's stack, is pod.c.
 *
 * cz_egress decides the common frame (fast_egress); every other frame goes on to cz_egress_slow
 * by a tail call (lib/tail.h), and the node's own packet to an LB IP to cz_egress_to_lb.
 */
#include <uapi/linux/bpf.h>
#include "lib/fib.h"
#include "lib/limit.h"
#include "lib/lookup.h"
#include "lib/parse.h"
#include "lib/snat.h"
#include "lib/source.h"
#include "lib/tail.h"
#include "lib/tc.h"
#include "lib/to_lb.h"

/*
 * A packet leaving by an uplink from an address whose entry is `kind` and `slot` (of the IP
 * header at `l3`; v6, a constant): where egress is shaped (limit.h, cz_shape), one from an LB IP
 * -- a VM's packet the pod-facing hook translated, which leaves shaping to this hook, the one in
 * front of the uplink's fq -- gets its Service's departure time, or is dropped beyond the
 * shaper's horizon. A verdict. Policed egress does nothing here (the translation policed it).
 */
static __always_inline int shape_lb(struct __sk_buff *skb, void *l3, int v6, __u8 kind, __u32 slot)
{
	if (!(kind & CZ_K_LB) || !cz_shape(skb, slot, cz_wire_len(skb), 0))
		return CZ_TC_NEXT;
	return egress_drop(skb, l3, v6, slot, CZ_DROP_LIMIT);
}

/* Where egress is shaped, the entry of an IPv4 packet's source if the address hint says it may
 * be an LB IP (else, or not shaped, NULL: that costs the common packet the hint's second bit). */
static __always_inline struct addr4_val *shaped_src4(struct iphdr *ip)
{
	if (!cz_addr4_hinted(ip->saddr, CZ_HINT_LB) || !cz_shaped())
		return NULL;
	return cz_addr4.lookup(&ip->saddr);
}

/* An IPv4 packet of no pod IP to no LB IP (rolehint): shape_lb if it is from an LB IP and egress
 * is shaped; else nothing of ours. */
static __always_inline int shape_lb4(struct __sk_buff *skb, struct iphdr *ip)
{
	struct addr4_val *v = shaped_src4(ip);

	return v ? shape_lb(skb, ip, 0, v->kind, v->in_slot) : CZ_TC_NEXT;
}

/*
 * The fast path's half of the source check: a packet from the pod's cached device, or the node's
 * own, goes on; any other is left to the full path, which asks the FIB (the FIB's call in the
 * entry program cost whole-IP egress 10 ns in BPF_PROG_RUN: docs/design.md; the benchmark's
 * bench/bpf/variants/egress_fib_always.c asks it here for every packet).
 */
static __always_inline int spoof_unsure(struct __sk_buff *skb, __u32 dev, int v6, const void *src)
{
	__u32 in = skb->ingress_ifindex;

	return cz_src_unsure(dev, in);
}

/* The common frame: a verdict, or CZ_SLOW. */
static __always_inline int fast_egress(struct __sk_buff *skb, void *data, void *data_end)
{
	struct iphdr *ip = fast_ip4(data, data_end);
	struct ipv6hdr *ip6;
	struct addr6_val *v6;

	if (ip) {
		struct addr4_val *v = NULL;

		/* no pod IP as source, no LB IP as destination: nothing of ours (rolehint), unless
		 * from an LB IP where egress is shaped (shape_lb) */
		if (cz_addr4_hinted(ip->saddr, CZ_HINT_POD))
			v = cz_addr4.lookup(&ip->saddr);
		else if (!cz_addr4_hinted(ip->daddr, CZ_HINT_LB))
			return shape_lb4(skb, ip);
		if (!v)
			return CZ_RARE; /* to_lb4, cz_egress_to_lb */
		/* from an LB IP: a VM's packet, translated (by the pod-facing hook, or a node's) */
		if (!(v->kind & CZ_K_POD))
			return cz_shaped() ? shape_lb(skb, ip, 0, v->kind, v->in_slot) : CZ_TC_NEXT;
		if (cz_unlikely(spoof_unsure(skb, v->dev, 0, &ip->saddr)))
			return CZ_SLOW; /* the full path asks the FIB (egress_full) */
		return fast_snat(skb, data, data_end, ip, 0, (struct ip6 *)&v->lb_ip, v->out_slot,
				 v->pod_flags, 1);
	}
	ip6 = fast_ip6(data, data_end);
	if (!ip6)
		return CZ_SLOW;
	v6 = cz_addr6.lookup((struct ip6 *)&ip6->saddr);
	if (!v6)
		return CZ_TC_NEXT;
	if (!(v6->kind & CZ_K_POD))
		return cz_shaped() ? shape_lb(skb, ip6, 1, v6->kind, v6->in_slot) : CZ_TC_NEXT;
	if (cz_unlikely(spoof_unsure(skb, v6->dev, 1, &ip6->saddr)))
		return CZ_SLOW;
	return fast_snat(skb, data, data_end, ip6, 1, &v6->lb_ip, v6->out_slot, v6->pod_flags, 1);
}

int cz_egress(struct __sk_buff *skb)
{
	void *data, *data_end;
	int rc;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	rc = fast_egress(skb, data, data_end);
	if (rc == CZ_RARE)
		cz_tail_rare.call(skb, CZ_RARE_TO_LB);
	else if (rc != CZ_SLOW)
		return rc;
	else
		cz_tail_tc.call(skb, CZ_SLOW_EGRESS);
	return cz_tail_missed(skb, 0, 1); /* the loader fills the arrays before attaching */
}

/*
 * A packet of no managed pod IP to a managed LB IP, which cz_egress hands on (CZ_RARE): the
 * node's own (or a pod's it forwarded), to_lb4 decides it (lib/to_lb.h); a rare path of its
 * own keeps to_lb4's redirect and its ICMP synthesis out of the entry. A VM's packet to another
 * LB IP (its source an LB IP: the pod-facing hook translated it) goes by the ToR; where egress
 * is shaped it is shaped here as any other packet from an LB IP (shape_lb), else to_lb4 lets
 * it go.
 */
int cz_egress_to_lb(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = fast_ip4(data, data_end);
	struct addr4_val *v;

	if (!ip)
		return CZ_TC_NEXT;
	v = shaped_src4(ip);
	if (v && (v->kind & CZ_K_LB))
		return shape_lb(skb, ip, 0, v->kind, v->in_slot);
	return to_lb4(skb, data, data_end, ip);
}

/* Every frame the fast path does not take. */
int cz_egress_slow(struct __sk_buff *skb)
{
	return egress_full(skb, 0);
}
