// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress as a tc program, for devices without native XDP or when --ingress-hook tcx is
 * chosen: the same decision as the XDP program (lib/ingress.h), attached through
 * tcx before every other program, so Cilium's tc programs still only see pod IPs.
 * cz_ingress_tc decides the common frame; every other frame goes on to cz_ingress_tc_slow.
 */
#include <uapi/linux/bpf.h>
#include "lib/account.h"
#include "lib/ingress.h"
#include "lib/nat.h"
#include "lib/tail.h"
#include "lib/tc.h"

int cz_ingress_tc(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct cz_fast f = {};
	struct ip6 to;
	__u32 reason;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	reason = fast_ingress(data, data_end, skb->len, &f, &to);
	if (reason == CZ_SLOW) {
		if (fast_outside(data, data_end))
			cz_tail_tc.call(skb, CZ_OUTSIDE_INGRESS_TC);
		else
			cz_tail_tc.call(skb, CZ_SLOW_INGRESS_TC);
		return CZ_TC_NEXT; /* not reached: the loader fills the array before attaching */
	}
	if (reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	fast_monitor(skb, 0, 0, reason, f.slot, skb->len, f.v6, f.proto, f.l3, f.sport, f.dport);
	if (reason == CZ_DROP_PORT || reason == CZ_DROP_SOURCE) {
		fast_count(0, reason, f.slot, skb->len);
		return CZ_TC_DROP;
	}
	if (f.rewrite && fast_nat_skb(skb, &f, data_end, 1, &to) < 0) {
		fast_count(0, CZ_DROP_MALFORMED, f.slot, skb->len);
		return CZ_TC_DROP;
	}
	fast_count(0, reason, f.slot, skb->len);
	return CZ_TC_NEXT;
}

/* The full parse and decision; `outside` as in ingress.c. */
static __always_inline int ingress_tc_full(struct __sk_buff *skb, int outside)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct hdr_cursor nh = {.pos = data, .start = data};
	struct pkt p = {};
	struct inner in = {};
	struct ip6 pod = {};
	__u32 reason, slot = 0;
	int rewrite;

	cz_dry_begin(cz_dry_nonce_tc(skb));
	p.frame_len = skb->len; /* lengths count paged data too; accesses stay linear */
	if (parse_frame(&nh, data, data_end, &p) < 0) {
		slow_not_ours(skb, 0);
		return CZ_TC_NEXT;
	}
	reason = ingress(&p, data, data_end, &in, &pod, &rewrite, &slot, outside);
	if (reason == CZ_NOT_OURS) {
		slow_not_ours(skb, 0);
		return CZ_TC_NEXT;
	}
	if (!cz_is_drop(reason) && rewrite) {
		if (p.icmp_error && in.rewrite)
			nat_inner(&p, &in, data_end, 1, &pod);
		if (nat_skb(skb, &p, data, data_end, 1, &pod) < 0)
			reason = CZ_DROP_MALFORMED;
	}
	return slow_finish(skb, 0, 0, &p, reason, slot, skb->len, 0);
}

/* Every frame the fast path does not take. */
int cz_ingress_tc_slow(struct __sk_buff *skb)
{
	return ingress_tc_full(skb, 0);
}

/* A frame from outside the source ranges of a restricted pod. */
int cz_ingress_tc_outside(struct __sk_buff *skb)
{
	return ingress_tc_full(skb, 1);
}
