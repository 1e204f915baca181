/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Limits per Service (issue 38), enforced where the programs first see a packet: ingress in the
 * XDP entry (and tc ingress where XDP is not attached), before anything is translated; egress
 * where the pod's packet is translated (the pod-facing hook, else the uplink's egress), as a
 * policer, or by the uplink's egress as a shaper where the uplinks have fq (cz_shape). A Service
 * whose LB IPs carry CZ_F_LIMIT (flags) has its limits in `limits` at its slot; one whose pod IP
 * carries it (pod_flags) has an egress limit there. The buckets are GCRA on one 64-bit time each,
 * in `buckets` at the same slot, shared by every CPU (a per-CPU bucket would give a flow that one
 * CPU takes 1/n of the rate): the arithmetic of cozyebpf/datapath/buckets.py (Bucket.admit), which
 * the differential test holds them to.
 *
 * A packet of `cost` bytes (or 1 packet) at `now` passes when max(tat, now) + cost * unit (in
 * whole ns, rounded down) is at most now + tol; the bucket's time then moves by its cost: an
 * atomic add where the bucket is busy (now < tat <= now + CZ_AHEAD_MAX_NS), a
 * compare-and-exchange that starts it at `now` where it was full (another CPU's start in
 * between: its cost is added after that one). A full bucket passes any one packet (below).
 * The clock is the tick's: jiffies times the tick's length in ns (CZ_NS_PER_JIFFY, from the
 * kernel's CONFIG_HZ: the loader's -D flag), which the verifier inlines; bpf_ktime_get_coarse_ns
 * (the same resolution, the monitor's clock) is a helper call that cost a limited packet 15 ns
 * in BPF_PROG_RUN on a CPU with return-stack mitigations, and is the clock where the tick's
 * length is not known (0). The bursts are 250 ms of the rate or more (buckets.py), so a tick's
 * step (1 to 10 ms) only releases what the rate owes.
 */
#ifndef COZYEBPF_LIMIT_H
#define COZYEBPF_LIMIT_H

#include "fib.h"
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

/*
 * How far ahead of the clock a bucket's time may lie and still be this clock's: 2^48 ns (3.3
 * days). The longest a bucket of the kubelet's lowest rate runs ahead is minutes (a 64 KiB
 * burst at 1 kbit/s: 524 s, and one packet's debt: below); the two clocks an agent may pick
 * (above) differ by 50 to 500 days (jiffies starts 2^32 - 300 * HZ ticks ahead of the boot). A
 * bucket further ahead was written on the other clock (the agent before this one picked it:
 * another version, a container that cannot read the kernel's tick rate): it is read as full,
 * as a bucket far behind the clock (written on a clock behind this one) already is. Without
 * this, such a bucket refused every packet for months. buckets.py, AHEAD_MAX_NS.
 */
#define CZ_AHEAD_MAX_NS (1ULL << 48)

/* Is the bucket's time `tat` ahead of `now` on this clock (busy; else full)? One unsigned
 * comparison: behind the clock, `tat - now` wraps to more than the bound. */
static __always_inline int cz_gcra_busy(__u64 tat, __u64 now)
{
	return tat - now - 1 < CZ_AHEAD_MAX_NS;
}

/*
 * One bucket: the time it would reach if the packet passes (*end), and whether it may. A full
 * bucket passes any one packet, whatever its cost, and goes into debt by what the cost exceeds
 * of the burst: a GSO packet's charge (a 64 KiB TSO packet, its headers once per segment: 68 KB;
 * BIG TCP's up to 512 KiB) or a GRO packet's segments can exceed the least burst (64 KiB, 64
 * packets), and such a packet was refused even from a full bucket, for ever. The debt holds
 * the rate: what follows waits until it is paid.
 */
static __always_inline int cz_gcra_admits(const struct cz_gcra *g, __u64 tat, __u64 now, __u64 cost,
					  __u64 *end)
{
	__u64 start = cz_gcra_busy(tat, now) ? tat : now;

	*end = start + ((cost * g->unit) >> CZ_UNIT_SHIFT);
	return start == now || *end - now <= g->tol; /* (start == now: full) */
}

/* The packet passed: the bucket's time moves from `tat` (as read) to `end`. */
static __always_inline void cz_gcra_take(__u64 *time, __u64 tat, __u64 now, __u64 end)
{
	if (cz_gcra_busy(tat, now)) {
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
 * its Service's ingress limits refuse it, else the same reason. A GRO packet at tc ingress is
 * charged its length (its headers once) and its segments (XDP, where attached, saw each). */
static __always_inline __u32 cz_limit_in(__u8 flags, __u32 slot, __u32 bytes, __u32 pkts,
					 __u32 reason)
{
	if (cz_unlikely(flags & CZ_F_LIMIT) && !cz_is_drop(reason) &&
	    cz_over_limit(0, slot, bytes, pkts, 0))
		return CZ_DROP_LIMIT;
	return reason;
}

/*
 * The bytes an skb on its way out puts on the wire: the qdisc layer's length (wire_len,
 * qdisc_pkt_len_init, which the kernel sets before the egress hook): a GSO packet's headers
 * once per segment -- a 64 KiB TCP packet is 45 segments, and its length alone 4.4 % fewer
 * bytes than the wire's. Never less than its length (BPF_PROG_RUN without one gives 0).
 */
static __always_inline __u32 cz_wire_len(struct __sk_buff *skb)
{
	__u32 wire = skb->wire_len, len = skb->len;

	return wire > len ? wire : len;
}

/*
 * fq's horizon: fq drops a packet whose skb->tstamp lies more than this ahead of its clock
 * (TCA_FQ_HORIZON, 10 s by default, horizon_drop). The shaper refuses such a packet itself
 * (drop_limit): below 52 kbit/s (64 KiB in more than 10 s) its burst's time is longer, and fq
 * dropped what it let through, counted in tc -s qdisc, not in drop_limit. buckets.py,
 * FQ_HORIZON_NS.
 */
#define CZ_FQ_HORIZON_NS 10000000000ULL

/*
 * Shaped egress (CZ_CFG_SHAPED: every uplink's root qdisc is fq, which holds a packet until its
 * skb->tstamp, as Cilium's bandwidth manager uses it): the Service's packets leave one after the
 * other at its rate from its next departure time (out_edt, the monotonic clock fq compares
 * with; a busy shaper's packet gets it as skb->tstamp, an idle one's leaves now). No burst: the
 * shaper paces from the first byte. The same GCRA as the policer's (its tol the burst's time):
 * a packet that would leave more than the burst's time ahead, or more than fq's horizon (the
 * horizon: what the queue holds), is dropped, nothing charged (1); an idle shaper lets any one
 * packet leave now. Where fq is not the root (a veth's noqueue, another qdisc), skb->tstamp
 * means nothing, and the policer is used.
 */
static __always_inline int cz_shape(struct __sk_buff *skb, __u32 slot, __u32 bytes, int peek)
{
	struct cz_limit *l = cz_limits.lookup(&slot);
	struct cz_bucket *b = cz_buckets.lookup(&slot);
	__u64 now, t, end;

	if (!l || !b || !l->out_bytes.unit)
		return 0;
	now = bpf_ktime_get_ns();
	t = b->out_edt;
	/* beyond fq's horizon: t - now > CZ_FQ_HORIZON_NS, and busy (cz_gcra_busy), in one
	 * unsigned comparison */
	if (!cz_gcra_admits(&l->out_bytes, t, now, bytes, &end) ||
	    t - now - 1 - CZ_FQ_HORIZON_NS < CZ_AHEAD_MAX_NS - CZ_FQ_HORIZON_NS)
		return 1;
	if (peek)
		return 0;
	cz_gcra_take(&b->out_edt, t, now, end);
	if (cz_gcra_busy(t, now))
		skb->tstamp = t;
	return 0;
}

/* Is egress shaped (the uplinks have fq: flowcfg's CZ_CFG_SHAPED)? */
static __always_inline int cz_shaped(void)
{
	struct flow_cfg *c = cz_cfg();

	return c && (c->flags & CZ_CFG_SHAPED);
}

/*
 * The egress limit of the Service in `slot` for a frame of `bytes` that its pod sent: policed,
 * or shaped where the node's uplinks have fq (flowcfg's CZ_CFG_SHAPED) -- by the uplink's egress
 * (`at_uplink`), the one hook in front of fq; the pod-facing hook leaves the frame to it (the
 * uplink's egress shapes what leaves from an LB IP: egress.c, shape_lb). 1: drop it.
 */
static __always_inline int cz_egress_over(struct __sk_buff *skb, __u32 slot, __u32 bytes,
					  int at_uplink, int peek)
{
	if (cz_shaped())
		return at_uplink ? cz_shape(skb, slot, bytes, peek) : 0;
	return cz_over_limit(1, slot, bytes, 1, peek);
}

#endif
