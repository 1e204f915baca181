/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The pinned maps. User space creates and pins them (with the layout it checks) before these
 * programs are compiled, so BPF_TABLE_PINNED only opens them. CZ_PIN_DIR and the *_MAX sizes
 * come from the loader as -D flags, read from the pinned maps (cozyebpf/datapath/layout.py).
 */
#ifndef COZYEBPF_MAPS_H
#define COZYEBPF_MAPS_H

#include "types.h"

BPF_TABLE_PINNED("hash", __be32, struct addr4_val, cz_addr4, CZ_ADDR4_MAX, CZ_PIN_DIR "/addr4");
BPF_TABLE_PINNED("hash", struct allow4_key, __u8, cz_allow4, CZ_ALLOW4_MAX, CZ_PIN_DIR "/allow4");
BPF_TABLE_PINNED("lru_hash", struct flow4_key, struct flow4_val, cz_flow4, CZ_FLOW4_MAX,
		 CZ_PIN_DIR "/flow4");

BPF_TABLE_PINNED("hash", struct ip6, struct addr6_val, cz_addr6, CZ_ADDR6_MAX, CZ_PIN_DIR "/addr6");
BPF_TABLE_PINNED("hash", struct allow6_key, __u8, cz_allow6, CZ_ALLOW6_MAX, CZ_PIN_DIR "/allow6");
BPF_TABLE_PINNED("lru_hash", struct flow6_key, struct flow4_val, cz_flow6, CZ_FLOW6_MAX,
		 CZ_PIN_DIR "/flow6");
/* the fast paths' per-CPU cache of the flows they last looked up (types.h) */
BPF_TABLE_PINNED("percpu_array", __u32, struct flow4_seen, cz_seen4, CZ_SEEN_MAX,
		 CZ_PIN_DIR "/seen4");
BPF_TABLE_PINNED("percpu_array", __u32, struct flow6_seen, cz_seen6, CZ_SEEN_MAX,
		 CZ_PIN_DIR "/seen6");
/* source ranges (CZ_F_RANGES) and the flows' timeouts */
BPF_TABLE_PINNED("lpm_trie", struct range4_key, __u8, cz_range4, CZ_RANGE4_MAX,
		 CZ_PIN_DIR "/range4");
BPF_TABLE_PINNED("lpm_trie", struct range6_key, __u8, cz_range6, CZ_RANGE6_MAX,
		 CZ_PIN_DIR "/range6");
BPF_TABLE_PINNED("array", __u32, struct flow_cfg, cz_flowcfg, 1, CZ_PIN_DIR "/flowcfg");
BPF_TABLE_PINNED("lru_hash", struct frag4_key, struct frag_val, cz_frag4, CZ_FRAG4_MAX,
		 CZ_PIN_DIR "/frag4");
BPF_TABLE_PINNED("lru_hash", struct frag6_key, struct frag_val, cz_frag6, CZ_FRAG6_MAX,
		 CZ_PIN_DIR "/frag6");
/* CZ_FLOWHINT_MAX == 2 * CZ_FLOWHINT_WORDS; CZ_FLOWHINT_WORDS * 64 == 1 << CZ_FLOWHINT_LOG2 */
BPF_TABLE_PINNED("array", __u32, __u64, cz_flowhint, CZ_FLOWHINT_MAX, CZ_PIN_DIR "/flowhint");
/* CZ_ROLEHINT_MAX * 64 == 2 << CZ_ROLEHINT_LOG2 (types.h; addrhint is user space's, 0.3.0's) */
BPF_TABLE_PINNED("array", __u32, __u64, cz_rolehint, CZ_ROLEHINT_MAX, CZ_PIN_DIR "/rolehint");

/* per-Service counters (stats.h), the monitor (monitor.h) and explain's dry runs (dryrun.h) */
BPF_TABLE_PINNED("percpu_array", __u32, struct svc_stat, cz_svcstats, CZ_SVCSTATS_MAX,
		 CZ_PIN_DIR "/svcstats");
/* limits per Service (limit.h): what the control plane set, and the programs' buckets */
BPF_TABLE_PINNED("array", __u32, struct cz_limit, cz_limits, CZ_SVCSTATS_MAX, CZ_PIN_DIR "/limits");
BPF_TABLE_PINNED("array", __u32, struct cz_bucket, cz_buckets, CZ_SVCSTATS_MAX,
		 CZ_PIN_DIR "/buckets");
BPF_TABLE_PINNED("array", __u32, struct mon_ctl, cz_monctl, 1, CZ_PIN_DIR "/monctl");
BPF_TABLE_PINNED("percpu_array", __u32, struct mon_stat, cz_monstats, 1, CZ_PIN_DIR "/monstats");
BPF_TABLE_PINNED("percpu_array", __u32, struct dry_res, cz_dryrun, 1, CZ_PIN_DIR "/dryrun");

/* bcc's BPF_RINGBUF_OUTPUT, opening a pinned ring buffer (that user space created) */
#define CZ_RINGBUF_PINNED(_name, _size, _pinned)                                                   \
	struct _name##_table_t {                                                                   \
		int key;                                                                           \
		u32 leaf;                                                                          \
		int (*ringbuf_output)(void *, u64, u64);                                           \
		void *(*ringbuf_reserve)(u64);                                                     \
		void (*ringbuf_discard)(void *, u64);                                              \
		void (*ringbuf_submit)(void *, u64);                                               \
		u32 max_entries;                                                                   \
	};                                                                                         \
	__attribute__((section("maps/ringbuf:" _pinned))) struct _name##_table_t _name = {         \
		.max_entries = (_size)}

CZ_RINGBUF_PINNED(cz_events, CZ_EVENTS_SIZE, CZ_PIN_DIR "/events");

#include "stats.h"

#endif
