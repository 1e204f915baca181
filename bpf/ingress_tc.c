// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress as a tc program, for devices without native XDP or when --ingress-hook tcx is
 * chosen: the same decision as the XDP program (lib/ingress.h), attached through tcx before
 * every other program, so Cilium's tc programs still only see pod IPs.
 */
#include <uapi/linux/bpf.h>
#include "lib/ingress.h"
#include "lib/nat.h"
#include "lib/tc.h"

int cz_ingress_tc(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct hdr_cursor nh;
	struct l4_info info = {};
	struct ethhdr *eth;
	struct iphdr *ip;
	__be32 pod_ip = 0, daddr;
	__u32 reason, ip_off, l4_off;
	int rewrite;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	if (parse_ethhdr(&nh, data_end, &eth) != bpf_htons(ETH_P_IP))
		return CZ_TC_NEXT;
	if (parse_iphdr(&nh, data_end, &ip) < 0)
		return CZ_TC_NEXT;
	daddr = ip->daddr;
	reason = ingress4(&nh, data_end, ip, &info, &pod_ip, &rewrite);
	if (reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	cz_count(reason, skb->len);
	if (cz_is_drop(reason))
		return CZ_TC_DROP;
	if (rewrite) {
		ip_off = (void *)ip - data;
		l4_off = nh.pos - data;
		if (nat4_skb(skb, ip_off, l4_off, ip->protocol, info.has_l4, 1, daddr, pod_ip) <
		    0) {
			cz_count(CZ_DROP_MALFORMED, skb->len);
			return CZ_TC_DROP;
		}
	}
	return CZ_TC_NEXT;
}
