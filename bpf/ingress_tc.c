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
	struct pkt p = {};
	struct inner in = {};
	struct ip6 pod = {};
	int rewrite;
	__u32 reason;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	nh.pos = data;
	nh.start = data;
	p.frame_len = skb->len; /* lengths count paged data too; accesses stay linear */
	if (parse_frame(&nh, data, data_end, &p) < 0)
		return CZ_TC_NEXT;
	reason = ingress(&p, data, data_end, &in, &pod, &rewrite);
	if (reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	cz_count(reason, skb->len);
	if (cz_is_drop(reason))
		return CZ_TC_DROP;
	if (rewrite) {
		if (p.icmp_error && in.rewrite)
			nat_inner(&p, &in, data_end, 1, &pod); /* direct writes first */
		if (nat_skb(skb, &p, data, 1, &pod) < 0) {
			cz_count(CZ_DROP_MALFORMED, skb->len);
			return CZ_TC_DROP;
		}
	}
	return CZ_TC_NEXT;
}
