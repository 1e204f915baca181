// SPDX-License-Identifier: GPL-2.0
/*
 * The benchmark's cz_egress that asks the FIB for every packet in the entry program (the other
 * way issue 21 named; bench/progrun.py's spoof_check "fib"): bpf/egress.c as shipped, with
 * spoof_unsure asking cz_routed_by (bpf/lib/source.h) for every packet from another device
 * instead of comparing it with the pod's cached one. bench/variant.py builds it: a function
 * defined again below replaces the product's of the same name, in its place.
 */
#include "../../../bpf/egress.c"

static __always_inline int spoof_unsure(struct __sk_buff *skb, __u32 dev, int v6, const void *src)
{
	__u32 in = skb->ingress_ifindex;

	return in && !cz_routed_by(skb, v6, src, in);
}
