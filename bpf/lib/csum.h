/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Incremental Internet checksum update (RFC 1624, eqn. 3) for direct packet access in XDP.
 * Names are cz_-prefixed: csum_fold/csum_replace4 exist in kernel headers. The TC program uses
 * bpf_l3/l4_csum_replace() instead, which also handle CHECKSUM_PARTIAL skbs.
 */
#ifndef COZYEBPF_CSUM_H
#define COZYEBPF_CSUM_H

static __always_inline __u16 cz_csum_fold32(__u32 c)
{
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	return (__u16)c;
}

/* The checksum `sum` after a 32-bit word of the covered data changed from `from` to `to`. */
static __always_inline __u16 cz_csum_replace32(__u16 sum, __u32 from, __u32 to)
{
	__u32 c = (__u16)~sum;

	c += (__u16) ~(from & 0xffff);
	c += (__u16) ~(from >> 16);
	c += to & 0xffff;
	c += to >> 16;
	return (__u16)~cz_csum_fold32(c);
}

#endif
