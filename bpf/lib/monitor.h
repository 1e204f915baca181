/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Events for `cozyebpf monitor`: one per counted packet that the monitor wants, through the
 * pinned ring buffer `events`. Every counted packet reads one switch (monctl.mode); with no
 * monitor running it is 0 and nothing else happens. A running monitor sets it and the rate: a
 * token bucket in BPF (GCRA on one timestamp, updated with a compare-and-exchange) limits the
 * events, and events refused by it or by a full ring buffer are counted in monstats.
 */
#ifndef COZYEBPF_MONITOR_H
#define COZYEBPF_MONITOR_H

#include "maps.h"
#include "parse.h"
#include "stats.h"

/* The switch; NULL, or a monctl whose mode is CZ_MON_OFF, means no monitor. */
static __always_inline struct mon_ctl *cz_mon_ctl(void)
{
	__u32 zero = 0;

	return cz_monctl.lookup(&zero);
}

/* Does the running monitor (c->mode != CZ_MON_OFF) want an event for `reason`? */
static __always_inline int cz_mon_wants(struct mon_ctl *c, __u32 reason)
{
	return c->mode == CZ_MON_ALL || (c->mode == CZ_MON_DROPS && cz_is_drop(reason));
}

/* A token of the bucket: 1, or 0 when the events are over the rate (or another CPU took the
 * last token at the same moment). The coarse clock (ticks of a few ms) keeps the refused events
 * cheap; the rate over time is exact. */
static __always_inline int cz_mon_token(struct mon_ctl *c)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	__u64 old = c->tat;
	__u64 tat = old > now ? old : now;

	if (tat - now > c->burst_ns)
		return 0;
	return __sync_val_compare_and_swap(&c->tat, old, tat + c->interval_ns) == old;
}

/* Counters of monstats, by their place in struct mon_stat */
#define CZ_MON_EVENTS 0
#define CZ_MON_LOST_LIMIT 1
#define CZ_MON_LOST_FULL 2

static __always_inline void cz_mon_count(__u32 counter)
{
	__u32 zero = 0;
	__u64 *st = (__u64 *)cz_monstats.lookup(&zero);

	if (st)
		st[counter & 3]++;
}

/* Does the bucket admit an event? One it refuses is counted. */
static __always_inline int cz_mon_admit(struct mon_ctl *c)
{
	if (cz_mon_token(c))
		return 1;
	cz_mon_count(CZ_MON_LOST_LIMIT);
	return 0;
}

/*
 * An event's record: cz_mon_event4 and cz_mon_event reserve it, test it once and count it only
 * after submitting it. A helper that returned the record after testing it to pick its counter
 * had clang test it twice, and Linux 6.1's verifier rejected the programs ("Unreleased
 * reference"): its reg_type_not_null() does not take ring buffer memory for non-NULL once
 * tested, so it followed the second test's NULL branch, where the record is never submitted
 * (6.12's verifier knows better). Counted after the submit, the record is no longer held
 * whatever clang makes of the counting.
 */
static __always_inline void cz_mon_fill(struct cz_event *e, __u32 ifindex, int dir, __u32 reason,
					__u32 slot, __u32 len, __u8 v6, __u8 proto, __be16 sport,
					__be16 dport)
{
	e->time_ns = bpf_ktime_get_ns();
	e->ifindex = ifindex;
	e->slot = slot;
	e->len = len;
	e->reason = reason;
	e->dir = dir;
	e->proto = proto;
	e->v6 = v6;
	e->sport = sport;
	e->dport = dport;
	e->reserved = 0;
}

/* An IPv4 event (the fast paths). */
static __always_inline void cz_mon_event4(struct mon_ctl *c, __u32 ifindex, int dir, __u32 reason,
					  __u32 slot, __u32 len, __u8 proto, __be32 src, __be32 dst,
					  __be16 sport, __be16 dport)
{
	struct cz_event *e;

	if (!cz_mon_admit(c))
		return;
	e = cz_events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		cz_mon_count(CZ_MON_LOST_FULL);
		return;
	}
	cz_mon_fill(e, ifindex, dir, reason, slot, len, 0, proto, sport, dport);
	cz_ip4_set(&e->src, src);
	cz_ip4_set(&e->dst, dst);
	cz_events.ringbuf_submit(e, 0);
	cz_mon_count(CZ_MON_EVENTS);
}

/* An event of either family, addresses as struct ip6. */
static __always_inline void cz_mon_event(struct mon_ctl *c, __u32 ifindex, int dir, __u32 reason,
					 __u32 slot, __u32 len, __u8 v6, __u8 proto,
					 const struct ip6 *src, const struct ip6 *dst, __be16 sport,
					 __be16 dport)
{
	struct cz_event *e;

	if (!cz_mon_admit(c))
		return;
	e = cz_events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		cz_mon_count(CZ_MON_LOST_FULL);
		return;
	}
	cz_mon_fill(e, ifindex, dir, reason, slot, len, v6, proto, sport, dport);
	e->src = *src;
	e->dst = *dst;
	cz_events.ringbuf_submit(e, 0);
	cz_mon_count(CZ_MON_EVENTS);
}

#endif
