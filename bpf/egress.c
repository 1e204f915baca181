// SPDX-License-Identifier: GPL-2.0
/*
 * Egress, tcx (or clsact) egress on each uplink device (and, through cz_pod_ingress, ingress on
 * each pod-facing device): a packet from a managed pod IP (IPv4 or IPv6) gets source := LB IP; an
 * ICMP error the pod sends about a packet it received gets its embedded packet's destination
 * translated too. In port-filter mode, or with source ranges, the flow is recorded (before the
 * packet leaves) so that replies pass ingress. Passes with TCX_NEXT
 * (== TC_ACT_UNSPEC), so programs after us (Cilium's) still run. docs/datapath-semantics.md,
 * "Egress".
 *
 * cz_egress decides the common frame (fast_egress); every other frame goes on to cz_egress_slow
 * by a tail call (lib/tail.h).
 */
#include <uapi/linux/bpf.h>
#include "lib/account.h"
#include "lib/cluster.h"
#include "lib/flow.h"
#include "lib/limit.h"
#include "lib/lookup.h"
#include "lib/nat.h"
#include "lib/stats.h"
#include "lib/tail.h"
#include "lib/tc.h"

/*
 * Egress (tc): the whole fast path in one piece -- limit, flow record, then the fast ending
 * (cz_fast_end: monitor, rewrite, counter) -- for the pod whose entry's LB IP, slot and flags
 * are `lb`, `slot` and `pod_flags`, the IP header at `l3` (v6, a constant), in the uplink's
 * egress (`at_uplink`, a constant) or the pod-facing hook. A tc verdict, or CZ_SLOW.
 */
static __always_inline int fast_snat(struct __sk_buff *skb, void *data, void *data_end, void *l3,
				     int v6, const struct ip6 *lb, __u32 slot, __u8 pod_flags,
				     int at_uplink)
{
	__u32 src = v6 ? offsetof(struct ipv6hdr, saddr) : offsetof(struct iphdr, saddr);
	__u32 dst = v6 ? offsetof(struct ipv6hdr, daddr) : offsetof(struct iphdr, daddr);
	struct cz_fast f = {};
	int bad = v6 ? fast_check6(&f, l3, data, data_end, skb->len)
		     : fast_check4(&f, l3, data, data_end, skb->len);
	__u32 reason = CZ_NAT_EGRESS;

	if (cz_unlikely(bad < 0))
		return CZ_SLOW;
	/* over the Service's egress limit (limit.h): policed (or beyond the shaper's horizon),
	 * nothing recorded; a GSO packet charged its segments' bytes (the uplink's egress has them
	 * from the qdisc layer, the pod-facing hook counts them) */
	if (cz_unlikely(pod_flags & CZ_F_LIMIT) &&
	    cz_egress_over(skb, slot,
			   at_uplink ? cz_wire_len(skb)
				     : fast_wire_len(&f, skb->len, skb->gso_segs),
			   at_uplink, 0))
		reason = CZ_DROP_LIMIT;
	else if (pod_flags & CZ_F_FLOWS) /* (IPv4: a[0] of each address only) */
		flow_record(v6, l3 + src, l3 + dst, f.sport, f.dport, f.proto, 0, f.tcp_flags, 1);
	f.slot = slot;
	f.rewrite = 1;
	if (cz_fast_end_f(skb, 0, 1, reason, &f, skb->len, data_end, lb))
		return CZ_TC_DROP;
	return CZ_TC_NEXT;
}

/*
 * A packet dropped untranslated for `reason`, the IP header at `l3` (v6, a constant): one from
 * the managed pod IP that did not enter from that pod's device (cz_spoofed), dropped before
 * anything is recorded; one from an LB IP beyond its shaper's horizon (shape_lb). Counted
 * node-wide and for the Service of its address (`slot`), shown to a running monitor.
 */
static __always_inline int egress_drop(struct __sk_buff *skb, void *l3, int v6, __u32 slot,
				       __u32 reason)
{
	__u8 proto = v6 ? ((struct ipv6hdr *)l3)->nexthdr : ((struct iphdr *)l3)->protocol;

	fast_monitor(skb, 0, 1, reason, slot, skb->len, v6, proto, l3, 0, 0);
	cz_count(reason, skb->len);
	cz_svc_drop(slot, reason);
	return CZ_TC_DROP;
}

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

/*
 * A managed pod's IPv6 packet at the pod-facing hook (`v`: its source's entry). One the FIB sends
 * out of an uplink, with a hop to go and within the uplink's MTU, is translated here as the
 * uplinks' egress translates it (fast_snat, flow record included), before the node's masquerade
 * (Kube-OVN's natOutgoing, ip6tables) could take it on the way, and with host routing on handed
 * to the uplink (cz_host_route). The FIB is asked every time: IPv6 answers are not cached (as
 * cz_route_in's). Anything else goes on untouched (CZ_TC_NEXT): a packet too big or out of hops
 * gets the stack's answer at the pod's own address, and extension headers and ICMPv6 (fast_snat's
 * CZ_SLOW, before it writes anything) are translated by the uplinks' egress.
 */
static __always_inline int pod_route6(struct __sk_buff *skb, void *data, void *data_end,
				      struct ipv6hdr *ip6, struct addr6_val *v)
{
	struct flow_cfg *c = cz_cfg();
	struct bpf_fib_lookup fib;
	int rc;

	if (!c)
		return CZ_TC_NEXT;
	rc = cz_fib6(skb, &fib, &ip6->saddr, &ip6->daddr, skb->ingress_ifindex);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || !cz_is_uplink(c, fib.ifindex) ||
	    !cz_hr_fits6(skb, ip6, fib.mtu_result))
		return CZ_TC_NEXT;
	rc = fast_snat(skb, data, data_end, ip6, 1, &v->lb_ip, v->out_slot, v->pod_flags, 0);
	if (rc == CZ_SLOW)
		return CZ_TC_NEXT;
	if (rc == CZ_TC_NEXT && (c->flags & CZ_CFG_HOST_ROUTING))
		return cz_host_route(skb, 1, &fib);
	return rc;
}

/*
 * The pod-facing hook, IPv6: the source check (cz_spoofed), then what leaves by an uplink is
 * translated (and host-routed: pod_route6); the rest is translated by the uplinks' egress.
 */
static __always_inline int pod_check6(struct __sk_buff *skb, void *data, void *data_end)
{
	struct ipv6hdr *ip6 = fast_ip6(data, data_end);
	struct addr6_val *v;

	if (!ip6)
		return CZ_TC_NEXT;
	v = cz_addr6.lookup((struct ip6 *)&ip6->saddr);
	if (!v || !(v->kind & CZ_K_POD))
		return CZ_TC_NEXT;
	if (cz_unlikely(cz_spoofed(skb, &v->dev, 1, &ip6->saddr, skb->ingress_ifindex)))
		return egress_drop(skb, ip6, 1, v->out_slot, CZ_DROP_SPOOFED);
	return CZ_RARE; /* pod_route6, cz_pod_route6 */
}

/* A managed pod's IPv6 packet at the pod-facing hook, its source checked: pod_route6. */
int cz_pod_route6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = fast_ip6(data, data_end);
	struct addr6_val *v;

	if (!ip6)
		return CZ_TC_NEXT;
	v = cz_addr6.lookup((struct ip6 *)&ip6->saddr);
	if (!v || !(v->kind & CZ_K_POD))
		return CZ_TC_NEXT;
	return pod_route6(skb, data, data_end, ip6, v);
}

/*
 * The pod-facing hook: tcx ingress, first, on each --pod-devices device (Kube-OVN's ovn0), so it
 * runs before netfilter. A packet whose source is a managed pod IP and that did not enter from
 * that pod's device is dropped (cz_spoofed; both families). A managed pod's packet that leaves
 * the node by an uplink, or answers a connection this node opened to the pod's LB IP, is
 * translated as egress translates it, flow record included (lib/pod.h, pod_side4);
 * everything else passes untouched. A packet to a managed LB IP ends the device's tc chain here
 * (pod_next4). IPv6 is translated here when it leaves by an uplink and fits (pod_route6), else by
 * the uplinks' egress.
 */
int cz_pod_ingress(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct bpf_fib_lookup fib;
	struct addr4_val *v;
	struct iphdr *ip;
	int rc, next, side;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = fast_ip4(data, data_end);
	if (!ip) {
		rc = pod_check6(skb, data, data_end);
		if (rc != CZ_RARE)
			return rc;
		cz_tail_rare.call(skb, CZ_RARE_POD6);
		return cz_tail_missed(skb, 0, 1); /* the loader fills the arrays before attaching */
	}
	/* a plain pod's packet: two bits of rolehint (types.h), and it goes */
	next = cz_addr4_hinted(ip->daddr, CZ_HINT_LB) ? pod_next4(ip) : CZ_TC_NEXT;
	if (!cz_addr4_hinted(ip->saddr, CZ_HINT_POD))
		return next;
	v = cz_addr4.lookup(&ip->saddr);
	if (!v || !(v->kind & CZ_K_POD))
		return next;
	if (cz_unlikely(cz_spoofed(skb, &v->dev, 0, &ip->saddr, skb->ingress_ifindex)))
		return egress_drop(skb, ip, 0, v->out_slot, CZ_DROP_SPOOFED);
	side = pod_side4(skb, data_end, ip, &fib);
	if (side == CZ_SIDE_NOT)
		return next;
	rc = fast_snat(skb, data, data_end, ip, 0, (struct ip6 *)&v->lb_ip, v->out_slot,
		       v->pod_flags, 0);
	if (rc == CZ_TC_NEXT && side == CZ_SIDE_ROUTED)
		rc = cz_host_route(skb, 0, &fib); /* redirected, or on to the stack */
	if (rc == CZ_TC_NEXT)
		return next;
	if (rc != CZ_SLOW)
		return rc;
	cz_tail_tc.call(skb, CZ_SLOW_POD);
	return cz_tail_missed(skb, 0, 1); /* the loader fills the array before attaching */
}

/*
 * The full path's source check, for a packet not from the pod's cached device (`from`): does the
 * FIB route the pod IP `src` to `from`? Then that device is cached, but not by a dry run.
 */
static __always_inline int src_confirm(struct __sk_buff *skb, int v6, const struct ip6 *src,
				       __u32 from)
{
	if (!cz_routed_by(skb, v6, src, from))
		return 0;
	if (!cz_dry())
		cz_dev_set(v6, src, from);
	return 1;
}

/* The full parse and translation; `pod_side`: for cz_pod_ingress, whose verdict is pod_next4's */
static __always_inline int egress_full(struct __sk_buff *skb, int pod_side)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct hdr_cursor nh = {.pos = data, .start = data};
	struct pkt p = {};
	struct inner in = {};
	struct cz_entry e = {}, d;
	__u32 reason = CZ_NAT_EGRESS, from;
	int flow, rc;

	cz_dry_begin(cz_dry_nonce_tc(skb));
	p.frame_len = skb->len; /* lengths count paged data too; accesses stay linear */
	if (parse_frame(&nh, data, data_end, &p) < 0 || !lookup_addr(p.v6, &p.src, &e) ||
	    !(e.kind & CZ_K_POD)) {
		slow_not_ours(skb, 0);
		return CZ_TC_NEXT;
	}
	cz_done_addrs(&p); /* here, where the ways through the parser are few */
	from = skb->ingress_ifindex;
	if (check_ip(&p, data, data_end) != CZ_OK) {
		reason = CZ_DROP_MALFORMED;
	} else if (cz_src_unsure(e.dev, from) && !src_confirm(skb, p.v6, &p.src, from)) {
		reason = CZ_DROP_SPOOFED; /* after check_ip: counted with its protocol and ports */
	} else {
		/* an error about a packet the pod received: its destination was the pod IP */
		if (p.icmp_error && parse_inner(&p, data_end, &in) == 0 &&
		    cz_ip6_eq(&in.dst, &p.src))
			nat_inner(&p, &in, data_end, 0, &e.lb);
		if (nat_skb(skb, &p, data, data_end, 0, &e.lb) < 0)
			reason = CZ_DROP_MALFORMED;
	}
	/* with a port filter, the flow is recorded at the end (account.h) */
	flow = reason == CZ_NAT_EGRESS && (e.pod_flags & CZ_F_FLOWS) && p.has_l4;
	/* the flags byte here only: read in the shared parse, each full path verified 1-3 % more */
	if (flow && p.proto == IPPROTO_TCP)
		bpf_skb_load_bytes(skb, p.l4_off + 13, &p.tcp_flags, 1);
	/* its egress limit at the end (slow_end), before the flow is recorded */
	rc = slow_finish(skb, 0, 1, !pod_side, &p, reason, e.out_slot, skb->len, flow,
			 e.pod_flags & CZ_F_LIMIT);
	if (pod_side && rc == CZ_TC_NEXT && !p.v6 && lookup_addr(0, &p.dst, &d) &&
	    (d.kind & CZ_K_LB))
		return CZ_TC_PASS; /* to a managed LB IP: as pod_next4 */
	return rc;
}

/* Every frame the fast path does not take. */
int cz_egress_slow(struct __sk_buff *skb)
{
	return egress_full(skb, 0);
}

/* The same for the pod-facing hook. */
int cz_pod_ingress_slow(struct __sk_buff *skb)
{
	return egress_full(skb, 1);
}
