// SPDX-License-Identifier: GPL-2.0
/*
 * Egress, tcx (or clsact) egress on each uplink device: a packet from a managed pod IP (IPv4 or
 * IPv6) gets source := LB IP; an ICMP error the pod sends about a packet it received gets its
 * embedded packet's destination translated too. In port-filter mode the flow is recorded first
 * so that replies pass ingress. Passes with TCX_NEXT (== TC_ACT_UNSPEC), so programs after us
 * (Cilium's) still run. docs/datapath-semantics.md, "Egress".
 *
 * cz_egress decides the common frame (lib/fast.h); every other frame goes on to cz_egress_slow
 * by a tail call (lib/tail.h).
 */
#include <uapi/linux/bpf.h>
#include "lib/fast.h"
#include "lib/lookup.h"
#include "lib/nat.h"
#include "lib/stats.h"
#include "lib/tail.h"
#include "lib/tc.h"

#define CZ_TC_SLOW 1 /* fast_egress: not decided, take the full path */

/* Remember (refresh at most once a second) a flow the pod opened. */
static __always_inline void flow_record(struct pkt *p)
{
	__u8 echo = p->v6 ? ICMPV6_ECHO_REQUEST : ICMP_ECHO;
	__be16 remote_port = p->dport;
	struct flow4_val *v;
	__u64 now;

	if (!p->has_l4)
		return;
	if (p->proto == IPPROTO_ICMP || p->proto == IPPROTO_ICMPV6) {
		if (p->icmp_type != echo)
			return;
		remote_port = 0;
	} else if (p->proto != IPPROTO_TCP && p->proto != IPPROTO_UDP && p->proto != IPPROTO_SCTP) {
		return;
	}
	now = bpf_ktime_get_coarse_ns();
	v = flow_find(p->v6, &p->src, &p->dst, p->sport, remote_port, p->proto);
	if (v) {
		if (now - v->last_seen_ns > CZ_FLOW_REFRESH_NS)
			v->last_seen_ns = now;
		return;
	}
	if (flow_add(p->v6, &p->src, &p->dst, p->sport, remote_port, p->proto, now) == 0)
		cz_count(CZ_FLOW_NEW, 0);
	else
		cz_count(CZ_FLOW_ERROR, 0);
}

/* The common frame (lib/fast.h): a verdict, or CZ_TC_SLOW. */
static __always_inline int fast_egress(struct __sk_buff *skb, void *data, void *data_end)
{
	struct cz_fast f = {};
	struct ip6 lb;
	__u8 pod_flags;
	struct iphdr *ip = fast_ip4(data, data_end);

	if (ip) {
		int verdict = fast_egress4(skb, data, data_end, ip);

		return verdict == CZ_FAST_SLOW ? CZ_TC_SLOW : verdict;
	} else {
		struct ipv6hdr *ip6 = fast_ip6(data, data_end);
		struct pkt p = {};
		struct addr6_val *v;

		if (!ip6)
			return CZ_TC_SLOW;
		v = cz_addr6.lookup((struct ip6 *)&ip6->saddr);
		if (!v || !(v->kind & CZ_K_POD))
			return CZ_TC_NEXT;
		if (fast_check6(&f, ip6, data, data_end, skb->len) < 0)
			return CZ_TC_SLOW;
		lb = v->lb_ip;
		if (v->pod_flags & CZ_F_PORT_FILTER) {
			p.v6 = 1;
			p.has_l4 = 1;
			p.proto = f.proto;
			p.sport = f.sport;
			p.dport = f.dport;
			__builtin_memcpy(&p.src, &ip6->saddr, sizeof(p.src));
			__builtin_memcpy(&p.dst, &ip6->daddr, sizeof(p.dst));
			flow_record(&p);
		}
	}
	if (fast_nat_skb(skb, &f, data_end, 0, &lb) < 0) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	cz_count(CZ_NAT_EGRESS, skb->len);
	return CZ_TC_NEXT;
}

int cz_egress(struct __sk_buff *skb)
{
	void *data, *data_end;
	int rc;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	rc = fast_egress(skb, data, data_end);
	if (rc != CZ_TC_SLOW)
		return rc;
	cz_tail_tc.call(skb, CZ_SLOW_EGRESS);
	return CZ_TC_NEXT; /* not reached: the loader fills the array before attaching */
}

/* Every frame the fast path does not take: the full parse and translation. */
int cz_egress_slow(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct hdr_cursor nh = {.pos = data, .start = data};
	struct pkt p = {};
	struct inner in = {};
	struct cz_entry e = {};

	p.frame_len = skb->len; /* lengths count paged data too; accesses stay linear */
	if (parse_frame(&nh, data, data_end, &p) < 0)
		return CZ_TC_NEXT;
	if (!lookup_addr(p.v6, &p.src, &e) || !(e.kind & CZ_K_POD))
		return CZ_TC_NEXT;
	if (check_ip(&p, data, data_end) != CZ_OK) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	if (e.pod_flags & CZ_F_PORT_FILTER)
		flow_record(&p);
	/* an error about a packet the pod received: its destination was the pod IP */
	if (p.icmp_error && parse_inner(&p, data_end, &in) == 0 && cz_ip6_eq(&in.dst, &p.src))
		nat_inner(&p, &in, data_end, 0, &e.lb);
	if (nat_skb(skb, &p, data, data_end, 0, &e.lb) < 0) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	cz_count(CZ_NAT_EGRESS, skb->len);
	return CZ_TC_NEXT;
}
