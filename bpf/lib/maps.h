/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The pinned maps. User space creates and pins them (with the layout it checks) before these
 * programs are compiled, so BPF_TABLE_PINNED only opens them. CZ_PIN_DIR and the *_MAX sizes
 * come from the loader as -D flags (cozyebpf/datapath/layout.py).
 */
#ifndef COZYEBPF_MAPS_H
#define COZYEBPF_MAPS_H

#include "types.h"

BPF_TABLE_PINNED("hash", __be32, struct svc4_val, cz_svc4, CZ_SVC4_MAX, CZ_PIN_DIR "/svc4");
BPF_TABLE_PINNED("hash", __be32, struct pod4_val, cz_pod4, CZ_POD4_MAX, CZ_PIN_DIR "/pod4");
BPF_TABLE_PINNED("hash", struct allow4_key, __u8, cz_allow4, CZ_ALLOW4_MAX, CZ_PIN_DIR "/allow4");
BPF_TABLE_PINNED("lru_hash", struct flow4_key, struct flow4_val, cz_flow4, CZ_FLOW4_MAX,
		 CZ_PIN_DIR "/flow4");

BPF_TABLE_PINNED("hash", struct ip6, struct svc6_val, cz_svc6, CZ_SVC6_MAX, CZ_PIN_DIR "/svc6");
BPF_TABLE_PINNED("hash", struct ip6, struct pod6_val, cz_pod6, CZ_POD6_MAX, CZ_PIN_DIR "/pod6");
BPF_TABLE_PINNED("hash", struct allow6_key, __u8, cz_allow6, CZ_ALLOW6_MAX, CZ_PIN_DIR "/allow6");
BPF_TABLE_PINNED("lru_hash", struct flow6_key, struct flow4_val, cz_flow6, CZ_FLOW6_MAX,
		 CZ_PIN_DIR "/flow6");
BPF_TABLE_PINNED("lru_hash", struct frag4_key, struct frag_val, cz_frag4, CZ_FRAG4_MAX,
		 CZ_PIN_DIR "/frag4");
BPF_TABLE_PINNED("lru_hash", struct frag6_key, struct frag_val, cz_frag6, CZ_FRAG6_MAX,
		 CZ_PIN_DIR "/frag6");

#include "stats.h"

#endif
