// SPDX-License-Identifier: GPL-2.0
/*
 * Egress, tcx (or clsact) egress on each uplink device: a packet from a managed pod IP (IPv4 or
 * IPv6) gets source := LB IP; an ICMP error the pod sends about a packet it received gets its
 * embedded packet's destination translated too. In port-filter mode the flow is recorded first
 * so that replies pass ingress. Passes with TCX_NEXT (== TC_ACT_UNSPEC), so programs after us
 * (Cilium's) still run. docs/datapath-semantics.md, "Egress".
 */
#include <uapi/linux/bpf.h>
#include "lib/lookup.h"
#include "lib/nat.h"
#include "lib/stats.h"
#include "lib/tc.h"

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
	now = bpf_ktime_get_ns();
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

int cz_egress(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct hdr_cursor nh;
	struct pkt p = {};
	struct inner in = {};
	struct cz_entry e = {};

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	nh.start = data;
	p.frame_len = skb->len; /* lengths count paged data too; accesses stay linear */
	if (parse_frame(&nh, data, data_end, &p) < 0)
		return CZ_TC_NEXT;
	if (!lookup_pod(p.v6, &p.src, &e))
		return CZ_TC_NEXT;
	if (check_ip(&p, data, data_end) != CZ_OK) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	if (e.flags & CZ_F_PORT_FILTER)
		flow_record(&p);
	/* an error about a packet the pod received: its destination was the pod IP */
	if (p.icmp_error && parse_inner(&p, data_end, &in) == 0 && cz_ip6_eq(&in.dst, &p.src))
		nat_inner(&p, &in, data_end, 0, &e.ip);
	if (nat_skb(skb, &p, data, 0, &e.ip) < 0) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	cz_count(CZ_NAT_EGRESS, skb->len);
	return CZ_TC_NEXT;
}
