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
	CZ_REASON_MAX
};

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

#endif
