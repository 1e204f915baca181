/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Dry runs for `cozyebpf explain` (types.h, struct dry_res): BPF_PROG_RUN of the attached
 * program on a frame with an 802.1Q tag, which the fast path never takes, so only the full path
 * has to know. It knows by a marker no real packet carries: 16 bytes of XDP metadata before the
 * frame (data_meta; nothing before our XDP program sets any), or skb->cb[0..3] for tc (only the
 * caller of BPF_PROG_RUN sets a context: the chance that a real skb's control block holds the
 * 64-bit magic is nil). The first 8 bytes are CZ_DRY_MAGIC, the next 8 a nonce that the decision
 * is recorded with. A dry run changes nothing else: no counter, flow, fragment entry or event.
 *
 * The full path notes at its start whether the frame is a dry run (in the per-CPU scratch, so
 * that the flag is not a value the verifier follows through the program); its side effects all
 * happen at its end (account.h), which asks cz_dry() first.
 */
#ifndef COZYEBPF_DRYRUN_H
#define COZYEBPF_DRYRUN_H

#include "maps.h"
#include "parse.h"

/* The nonce of an XDP dry run's marker, or 0 (not a dry run). */
static __always_inline __u64 cz_dry_nonce_xdp(struct xdp_md *ctx)
{
	void *meta = (void *)(long)ctx->data_meta;
	void *data = (void *)(long)ctx->data;
	__u64 *m = meta;

	if ((void *)(m + 2) > data || m[0] != CZ_DRY_MAGIC)
		return 0;
	return m[1] | 1; /* never 0 */
}

/* The nonce of a tc dry run's marker, or 0. */
static __always_inline __u64 cz_dry_nonce_tc(struct __sk_buff *skb)
{
	if (skb->cb[0] != (__u32)CZ_DRY_MAGIC || skb->cb[1] != (__u32)(CZ_DRY_MAGIC >> 32))
		return 0;
	return ((__u64)skb->cb[2] | (__u64)skb->cb[3] << 32) | 1;
}

/* Note whether this run is a dry run (at the start of a full path), and start its notes. */
static __always_inline void cz_dry_begin(__u64 nonce)
{
	struct cz_scratch *s = cz_scratch_slot();

	if (s) {
		s->dry = nonce != 0;
		s->done.frag = 0;
	}
}

/* Is this run a dry run? (Unknown to the verifier: a load from the scratch.) */
static __always_inline int cz_dry(void)
{
	struct cz_scratch *s = cz_scratch_slot();

	return s && s->dry;
}

/* Record the decision of a dry run for `cozyebpf explain`. */
static __always_inline void cz_dry_record(__u64 nonce, __u32 reason, __u32 slot)
{
	__u32 zero = 0;
	struct dry_res *r = cz_dryrun.lookup(&zero);

	if (r) {
		r->nonce = nonce;
		r->reason = reason;
		r->slot = slot;
	}
}

#endif
