/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A managed pod's packet gets source := LB IP: the fast translation (fast_snat), the drop of one
 * that may not be translated (egress_drop), and the full parse and translation (egress_full).
 * Two hooks use them: the uplinks' egress (egress.c) and the pod-facing hook (pod.c).
 */
#ifndef COZYEBPF_SNAT_H
#define COZYEBPF_SNAT_H

#include "account.h"
#include "dryrun.h"
#include "flow.h"
#include "limit.h"
#include "lookup.h"
#include "nat.h"
#include "parse.h"
#include "source.h"
#include "stats.h"
#include "tc.h"

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

#endif
