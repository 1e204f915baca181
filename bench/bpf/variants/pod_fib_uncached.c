// SPDX-License-Identifier: GPL-2.0
/*
 * The benchmark's pod-facing hook without the FIB answers' cache (issue 37; bench/progrun.py's
 * fib_cache "uncached"): bpf/pod.c as shipped, with cz_fib4_cached (bpf/lib/fib.h)
 * asking the FIB for every packet. bench/variant.py builds it: a function defined again below
 * replaces the product's of the same name, in its place.
 */
#include "../../../bpf/pod.c"

static __always_inline int cz_fib4_cached(struct __sk_buff *skb, struct bpf_fib_lookup *fib,
					  const struct flow_cfg *c, __be32 src, __be32 dst,
					  __u32 ifindex)
{
	return cz_fib4(skb, fib, src, dst, ifindex);
}
