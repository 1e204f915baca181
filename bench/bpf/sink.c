// SPDX-License-Identifier: GPL-2.0
/*
 * Bench helpers, native XDP on veths inside the bench namespaces only:
 *   bench_count  counts every frame (per CPU) and drops it: the "delivered" counter at the
 *                receiving end (pod or client side)
 *   bench_drop   a bare XDP_DROP: the floor for dropping on the node device
 *   bench_pass   a bare XDP_PASS (BPF_PROG_RUN floor for XDP programs)
 *   bench_tc_next a bare TCX_NEXT (BPF_PROG_RUN floor for tc programs)
 */
#include <uapi/linux/bpf.h>

BPF_PERCPU_ARRAY(sink_count, __u64, 1);

int bench_count(struct xdp_md *ctx)
{
	__u32 zero = 0;
	__u64 *v = sink_count.lookup(&zero);

	if (v)
		*v += 1;
	return XDP_DROP;
}

int bench_drop(struct xdp_md *ctx)
{
	return XDP_DROP;
}

int bench_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

int bench_tc_next(struct __sk_buff *skb)
{
	return -1;
}
