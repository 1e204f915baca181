/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Limits per Service (issue 38), enforced where the programs first see a packet: ingress in the
 * XDP entry (and tc ingress where XDP is not attached), before anything is translated; egress
 * where the pod's packet is translated (the pod-facing hook, else the uplink's egress), as a
 * policer. A Service whose LB IPs carry CZ_F_LIMIT (flags) has its limits in `limits` at its
 * slot; one whose pod IP carries it (pod_flags) has an egress limit there. The buckets are GCRA
 * on one 64-bit time each, in `buckets` at the same slot, shared by every CPU (a per-CPU bucket
 * would give a flow that one CPU takes 1/n of the rate): the arithmetic of
 * cozyebpf/datapath/buckets.py (Bucket.admit), which the differential test holds them to.
 *
 * A packet of `cost` bytes (or 1 packet) at `now` passes when max(tat, now) + cost * unit (in
 * whole ns, rounded down) is at most now + tol; the bucket's time then moves by its cost: an
 * atomic add where the bucket is busy (tat >= now), a compare-and-exchange that starts it at
 * `now` where it was idle (another CPU's start in between: its cost is added after that one).
 * The clock is the tick's: jiffies times the tick's length in ns (CZ_NS_PER_JIFFY, from the
 * kernel's CONFIG_HZ: the loader's -D flag), which the verifier inlines; bpf_ktime_get_coarse_ns
 * (the same resolution, the monitor's clock) is a helper call that cost a limited packet 15 ns
 * in BPF_PROG_RUN on a CPU with return-stack mitigations, and is the clock where the tick's
 * length is not known (0). The bursts are 250 ms of the rate or more (buckets.py), so a tick's
 * step (1 to 10 ms) only releases what the rate owes.
 */
#ifndef COZYEBPF_LIMIT_H
#define COZYEBPF_LIMIT_H

#include "maps.h"
#include "parse.h"

#ifndef CZ_NS_PER_JIFFY
#define CZ_NS_PER_JIFFY 0
#endif

/* Now, on the limits' clock (see above). */
static __always_inline __u64 cz_limit_now(void)
{
	if (CZ_NS_PER_JIFFY)
		return bpf_jiffies64() * CZ_NS_PER_JIFFY;
	return bpf_ktime_get_coarse_ns();
}

/* One bucket: the time it would reach if the packet passes (*end), and whether it may. */
static __always_inline int cz_gcra_admits(const struct cz_gcra *g, __u64 tat, __u64 now, __u64 cost,
					  __u64 *end)
{
	__u64 start = tat > now ? tat : now;

	*end = start + ((cost * g->unit) >> CZ_UNIT_SHIFT);
	return *end - now <= g->tol;
}

/* The packet passed: the bucket's time moves from `tat` (as read) to `end`. */
static __always_inline void cz_gcra_take(__u64 *time, __u64 tat, __u64 now, __u64 end)
{
	if (tat >= now) {
		__sync_fetch_and_add(time, end - tat);
		return;
	}
	if (__sync_val_compare_and_swap(time, tat, end) != tat)
		__sync_fetch_and_add(time, end - now);
}

/*
 * Is a frame of `bytes` (`pkts` packets: a GSO packet's segments) over the limits of the
 * Service in `slot`, ingress (dir 0: its bytes and its packets) or egress (dir 1: its bytes)?
 * 1: drop it, no bucket charged. 0: it passes and is charged, unless `peek` (explain's dry
 * run, which changes nothing).
 */
static __always_inline int cz_over_limit(int dir, __u32 slot, __u32 bytes, __u32 pkts, int peek)
{
	struct cz_limit *l = cz_limits.lookup(&slot);
	struct cz_bucket *b = cz_buckets.lookup(&slot);
	__u64 now, tb, tp, eb = 0, ep = 0;
	int byte_limit, pkt_limit;

	if (!l || !b)
		return 0;
	now = cz_limit_now();
	if (dir) {
		if (!l->out_bytes.unit)
			return 0;
		tb = b->out_bytes;
		if (!cz_gcra_admits(&l->out_bytes, tb, now, bytes, &eb))
			return 1;
		if (!peek)
			cz_gcra_take(&b->out_bytes, tb, now, eb);
		return 0;
	}
	byte_limit = l->in_bytes.unit != 0;
	pkt_limit = l->in_pkts.unit != 0;
	tb = b->in_bytes;
	tp = b->in_pkts;
	if (byte_limit && !cz_gcra_admits(&l->in_bytes, tb, now, bytes, &eb))
		return 1;
	if (pkt_limit && !cz_gcra_admits(&l->in_pkts, tp, now, pkts, &ep))
		return 1;
	if (peek)
		return 0;
	if (byte_limit)
		cz_gcra_take(&b->in_bytes, tb, now, eb);
	if (pkt_limit)
		cz_gcra_take(&b->in_pkts, tp, now, ep);
	return 0;
}

/* A pass decided for an address whose `flags` are as addr values carry them: CZ_DROP_LIMIT when
 * its Service's ingress limits refuse it, else the same reason. */
static __always_inline __u32 cz_limit_in(__u8 flags, __u32 slot, __u32 bytes, __u32 pkts,
					 __u32 reason)
{
	if (cz_unlikely(flags & CZ_F_LIMIT) && !cz_is_drop(reason) &&
	    cz_over_limit(0, slot, bytes, pkts, 0))
		return CZ_DROP_LIMIT;
	return reason;
}

#endif
