/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Verdict and reason counters. Every packet for a managed address is counted once, under the
 * reason of its verdict; flow_new counts flow-table insertions. The names are mirrored in
 * cozyebpf/datapath/reasons.py (a test compares the two lists): append only.
 */
#ifndef COZYEBPF_STATS_H
#define COZYEBPF_STATS_H

enum cz_reason {
	CZ_NAT_INGRESS = 0,	  /* whole-IP: LB IP -> pod IP */
	CZ_NAT_EGRESS = 1,	  /* pod IP -> LB IP on a device */
	CZ_PASS_PORT = 2,	  /* port filter: allowed (pod, proto, port) */
	CZ_PASS_ICMP = 3,	  /* port filter: ICMP and allowICMP */
	CZ_PASS_REPLY = 4,	  /* port filter: reply to a flow the pod opened */
	CZ_PASS_FRAGMENT = 5,	  /* port filter: non-first fragment whose first fragment passed */
	CZ_DROP_PORT = 6,	  /* port filter: TCP/UDP/SCTP port not allowed */
	CZ_DROP_ICMP = 7,	  /* port filter: ICMP without allowICMP, not a reply */
	CZ_DROP_PROTO = 8,	  /* port filter: a protocol that has no ports (GRE, ESP, ...) */
	CZ_DROP_MALFORMED = 9,	  /* managed address, invalid or truncated header: not translated */
	CZ_FLOW_NEW = 10,	  /* egress: a flow entry was created */
	CZ_FLOW_ERROR = 11,	  /* egress: the flow entry could not be written */
	CZ_PASS_RELATED = 12,	  /* port filter: ICMP error about an allowed flow */
	CZ_DROP_FRAGMENT = 13,	  /* port filter: non-first fragment after a dropped first one */
	CZ_DROP_FRAG_ORPHAN = 14, /* port filter: non-first fragment, first one not seen (yet) */
	CZ_DROP_ICMP_INNER = 15,  /* ICMP error with a truncated, invalid or nested inner packet */
	CZ_DROP_SOURCE = 16,	  /* source ranges: a source outside them, not a reply */
	CZ_PASS_LEARN = 17,	  /* port filter: TCP that opens nothing, to a migrating pod */
	CZ_DROP_SPOOFED = 18, /* a managed pod IP as source, from a device it is not routed to */
	CZ_DROP_MISSED_TAIL_CALL = 19, /* the full path a frame was handed to is not there */
	CZ_DROP_LIMIT = 20,	       /* over its Service's limit (limit.h): ingress or egress */
	CZ_REASON_MAX
};

#define CZ_NOT_OURS 0xffffffff /* not for a managed address: passed untouched, not counted */
/*
 * Not decided by a fast path: the full path decides (tail.h). Neither a reason nor, as an int
 * (-2), an XDP or tc verdict, so that a fast path returns it in place of either.
 */
#define CZ_SLOW 0xfffffffe

BPF_TABLE_PINNED("percpu_array", __u32, struct stat_val, cz_stats, CZ_STATS_MAX,
		 CZ_PIN_DIR "/stats");

static __always_inline void cz_count(__u32 reason, __u64 bytes)
{
	struct stat_val *v = cz_stats.lookup(&reason);

	if (v) {
		v->packets++;
		v->bytes += bytes;
	}
}

static __always_inline int cz_is_drop(__u32 reason)
{
	switch (reason) {
	case CZ_DROP_PORT:
	case CZ_DROP_ICMP:
	case CZ_DROP_PROTO:
	case CZ_DROP_MALFORMED:
	case CZ_DROP_FRAGMENT:
	case CZ_DROP_FRAG_ORPHAN:
	case CZ_DROP_ICMP_INNER:
	case CZ_DROP_SOURCE:
	case CZ_DROP_SPOOFED:
	case CZ_DROP_MISSED_TAIL_CALL:
	case CZ_DROP_LIMIT:
		return 1;
	}
	return 0;
}

/*
 * Per Service (types.h, struct svc_stat): a packet accepted for the Service in `slot` (dir 0:
 * ingress, 1: egress), or dropped for it. CZ_NO_SVC_STATS compiles them out (the benchmark's
 * "without per-Service counters").
 */
static __always_inline void cz_svc_pass(__u32 slot, int dir, __u64 bytes)
{
#ifndef CZ_NO_SVC_STATS
	struct svc_stat *s = cz_svcstats.lookup(&slot);

	if (!s)
		return;
	if (dir) {
		s->out_packets++;
		s->out_bytes += bytes;
	} else {
		s->in_packets++;
		s->in_bytes += bytes;
	}
#endif
}

/*
 * drops[] of a drop reason, the drop reasons in the order of their values: drop_port..
 * drop_malformed 0-3, drop_fragment..drop_source 4-7, drop_spoofed 8, drop_missed_tail_call 9
 * (counted node-wide only: no Service is known where a tail call fails, tail.h), drop_limit 10
 */
static __always_inline __u32 cz_drop_index(__u32 reason)
{
	if (reason >= CZ_DROP_SPOOFED)
		return reason - CZ_DROP_SPOOFED + 8;
	return reason >= CZ_DROP_FRAGMENT ? reason - CZ_DROP_FRAGMENT + 4 : reason - CZ_DROP_PORT;
}

static __always_inline void cz_svc_drop(__u32 slot, __u32 reason)
{
#ifndef CZ_NO_SVC_STATS
	struct svc_stat *s = cz_svcstats.lookup(&slot);
	__u32 i = cz_drop_index(reason) & (CZ_SVC_DROPS - 1); /* a drop reason: 0-9 */

	if (s)
		s->drops[i]++;
#endif
}

/* Both: the reason decides. */
static __always_inline void cz_svc_count(__u32 slot, __u32 reason, int dir, __u64 bytes)
{
	if (cz_is_drop(reason))
		cz_svc_drop(slot, reason);
	else
		cz_svc_pass(slot, dir, bytes);
}

#endif
