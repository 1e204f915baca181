// SPDX-License-Identifier: GPL-2.0
/*
 * Egress, tcx (or clsact) egress on each uplink device: a packet from a managed pod IP gets
 * source := LB IP; in port-filter mode its flow is recorded first so that replies pass ingress.
 * Passes with TCX_NEXT (== TC_ACT_UNSPEC), so programs after us (Cilium's) still run.
 */
#include <uapi/linux/bpf.h>
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/nat.h"
#include "lib/flow.h"
#include "lib/tc.h"

int cz_egress(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct hdr_cursor nh;
	struct l4_info info = {};
	struct ethhdr *eth;
	struct iphdr *ip;
	struct pod4_val *pod;
	__be32 saddr, lb_ip;
	__u32 ip_off, l4_off;
	int proto;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	if (parse_ethhdr(&nh, data_end, &eth) != bpf_htons(ETH_P_IP))
		return CZ_TC_NEXT;
	proto = parse_iphdr(&nh, data_end, &ip);
	if (proto < 0)
		return CZ_TC_NEXT;
	saddr = ip->saddr;
	pod = cz_pod4.lookup(&saddr);
	if (!pod)
		return CZ_TC_NEXT;
	lb_ip = pod->lb_ip;
	if (parse_l4(&nh, data_end, ip, &info) < 0) {
		/* truncated L4 header from our own pod: translate the IP header only */
		info.has_l4 = 0;
	}
	if (pod->flags & CZ_F_PORT_FILTER)
		flow4_record(saddr, ip->daddr, proto, &info);

	ip_off = (void *)ip - data;
	l4_off = nh.pos - data;
	if (nat4_skb(skb, ip_off, l4_off, proto, info.has_l4, 0, saddr, lb_ip) < 0) {
		cz_count(CZ_DROP_MALFORMED, skb->len);
		return CZ_TC_DROP;
	}
	cz_count(CZ_NAT_EGRESS, skb->len);
	return CZ_TC_NEXT;
}
