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

#include "stats.h"

#endif
