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
