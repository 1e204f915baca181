/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Incremental Internet checksum update (RFC 1624, eqn. 3) for direct packet writes. Names are
 * cz_-prefixed: csum_fold/csum_replace4 exist in kernel headers. Values are taken as they lie
 * in memory; one's complement sums do not care about byte order as long as every word is
 * treated alike.
 */
#ifndef COZYEBPF_CSUM_H
#define COZYEBPF_CSUM_H

#include "types.h"

static __always_inline __u16 cz_csum_fold32(__u32 c)
{
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	return (__u16)c;
}

/* The change of a 32-bit word from `from` to `to`, as an unfolded one's complement sum. */
static __always_inline __u32 cz_csum_delta32(__u32 from, __u32 to)
{
	return (__u16) ~(from & 0xffff) + (__u16) ~(from >> 16) + (to & 0xffff) + (to >> 16);
}

/* The change of an IPv6 address, as an unfolded one's complement sum (under 2^20). */
static __always_inline __u32 cz_csum_delta_addr6(const struct ip6 *from, const struct ip6 *to)
{
	return cz_csum_delta32(from->a[0], to->a[0]) + cz_csum_delta32(from->a[1], to->a[1]) +
	       cz_csum_delta32(from->a[2], to->a[2]) + cz_csum_delta32(from->a[3], to->a[3]);
}

/*
 * tc, after an IPv6 address of the packet changed (direct write) and the L4 checksum followed
 * (bpf_l4_csum_replace with BPF_F_PSEUDO_HDR), or no L4 checksum did: a CHECKSUM_COMPLETE skb's
 * skb->csum (the sum of the packet) right again. The helper takes the address change out of
 * skb->csum, as if an IPv4 header checksum had absorbed it; IPv6 has none, and the address and
 * L4 checksum changes cancel in the packet's sum, so the change goes back in. Other skbs are
 * left alone (the helper fails for them; nothing to do). Kernels since 6.16 know BPF_F_IPV6,
 * but only for bpf_l4_csum_replace's diff form; this works on every kernel.
 */
static __always_inline void cz_csum_complete_addr6(struct __sk_buff *skb, const struct ip6 *from,
						   const struct ip6 *to)
{
	/* folded: bcc declares the helper's csum argument 16 bits wide (the same sum) */
	bpf_csum_update(skb, cz_csum_fold32(cz_csum_delta_addr6(from, to)));
}

/* The checksum `sum` after the covered data changed by `delta` (cz_csum_delta32). */
static __always_inline __u16 cz_csum_apply(__u16 sum, __u32 delta)
{
	return (__u16)~cz_csum_fold32((__u16)~sum + delta);
}

/* The checksum `sum` after a 32-bit word of the covered data changed from `from` to `to`. */
static __always_inline __u16 cz_csum_replace32(__u16 sum, __u32 from, __u32 to)
{
	return cz_csum_apply(sum, cz_csum_delta32(from, to));
}

/* ... after a 16-bit word changed. */
static __always_inline __u16 cz_csum_replace16(__u16 sum, __u16 from, __u16 to)
{
	__u32 c = (__u16)~sum;

	c += (__u16)~from;
	c += to;
	return (__u16)~cz_csum_fold32(c);
}

/* The change of an address of either family, as cz_csum_delta32. */
static __always_inline __u32 cz_csum_delta_addr(const struct ip6 *from, const struct ip6 *to,
						int v6)
{
	return v6 ? cz_csum_delta_addr6(from, to) : cz_csum_delta32(from->a[0], to->a[0]);
}

/* ... after an address changed (IPv4: only a[0] differs, the rest are zero in both). */
static __always_inline __u16 cz_csum_replace_addr(__u16 sum, const struct ip6 *from,
						  const struct ip6 *to, int v6)
{
	sum = cz_csum_replace32(sum, from->a[0], to->a[0]);
	if (v6) {
		sum = cz_csum_replace32(sum, from->a[1], to->a[1]);
		sum = cz_csum_replace32(sum, from->a[2], to->a[2]);
		sum = cz_csum_replace32(sum, from->a[3], to->a[3]);
	}
	return sum;
}

#endif
