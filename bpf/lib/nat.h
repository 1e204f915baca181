/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Address translation of both families, one rewrite per hook: XDP writes in place with
 * incremental checksums (nat_xdp4, nat_xdp6, cz_l4_fix); tc writes the address and the IPv4 header
 * checksum in place and leaves the L4 checksum to bpf_l4_csum_replace, so that CHECKSUM_PARTIAL
 * (offloaded TCP/UDP checksums from local veths) and CHECKSUM_COMPLETE skbs stay correct
 * (nat_skb_addr). Fixed: the IPv4 header checksum, the pseudo-header part of TCP, UDP and ICMPv6
 * checksums (a UDP checksum of 0 means "none" and stays 0; a result of 0 is written 0xffff);
 * ICMPv4 and SCTP checksums do not cover the IP header. The embedded packet of an ICMP error is
 * rewritten with direct writes in both program types: ICMP checksums are never offloaded. The
 * fast and the full paths call the same rewrites (the fast paths' in cz_fast_end, account.h).
 */
#ifndef COZYEBPF_NAT_H
#define COZYEBPF_NAT_H

#include "csum.h"
#include "parse.h"

/* Offset of the checksum an address change affects, or -1. */
static __always_inline int cz_l4_csum_off(__u8 proto, int v6)
{
	if (proto == IPPROTO_TCP)
		return 16;
	if (proto == IPPROTO_UDP)
		return 6;
	if (proto == IPPROTO_ICMPV6 && v6)
		return 2;
	return -1;
}

/*
 * The L4 checksum at `c` after the covered data changed by `delta` (cz_csum_delta32): UDP's 0
 * ("none") stays 0 (not written), and a UDP result of 0 is written 0xffff.
 */
static __always_inline void cz_l4_fix(__u16 *c, __u8 proto, __u32 delta)
{
	__u16 n;

	if (proto == IPPROTO_UDP && *c == 0)
		return;
	n = cz_csum_apply(*c, delta);
	if (proto == IPPROTO_UDP && n == 0)
		n = 0xffff;
	*c = n;
}

/*
 * XDP, IPv4: the destination (`from`) := `to` and the header checksum, incrementally; the
 * change, for the L4 checksum (cz_l4_fix). The one XDP rewrite of IPv4, for the fast and the full
 * path; `ip` is within the packet.
 */
static __always_inline __u32 nat_xdp4(struct iphdr *ip, __be32 from, __be32 to)
{
	__u32 delta = cz_csum_delta32(from, to);

	ip->daddr = to;
	ip->check = cz_csum_apply(ip->check, delta);
	return delta;
}

/* XDP, IPv6: the same (no header checksum). */
static __always_inline __u32 nat_xdp6(struct ipv6hdr *ip6, const struct ip6 *to)
{
	struct ip6 from;

	__builtin_memcpy(&from, &ip6->daddr, sizeof(from));
	__builtin_memcpy(&ip6->daddr, to, sizeof(*to));
	return cz_csum_delta_addr6(&from, to);
}

/*
 * tc: the destination (is_dst) or source of the IP header at `l3` := *to, the address and IPv4's
 * header checksum with direct writes (the IPv4 header checksum is never offloaded), the L4
 * checksum at `csum_off` in the frame (when `l4`: a constant in the fast paths, whose offset the
 * verifier does not know the sign of) through bpf_l4_csum_replace, which keeps CHECKSUM_PARTIAL
 * (egress offload: the field holds the pseudo-header sum) and CHECKSUM_COMPLETE (ingress) skbs
 * right; a UDP checksum of 0 stays 0 (BPF_F_MARK_MANGLED_0). IPv6 then takes the address change
 * back into a CHECKSUM_COMPLETE skb's sum (cz_csum_complete_addr6, csum.h). The one tc rewrite,
 * for the fast and the full paths; both families in one body, so that a path that holds either
 * (tc ingress) verifies one tail. 0, -1 when the header is beyond the packet, or a helper's error;
 * packet pointers are invalid afterwards.
 */
static __always_inline int nat_skb_addr(struct __sk_buff *skb, void *l3, void *data_end, int v6,
					int l4, __u32 csum_off, __u8 proto, int is_dst,
					const struct ip6 *to)
{
	__u64 flags = BPF_F_PSEUDO_HDR | 4;
	struct ip6 from;
	int i, ret;

	if (proto == IPPROTO_UDP)
		flags |= BPF_F_MARK_MANGLED_0;
	if (v6) {
		struct ipv6hdr *ip6 = l3;

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		if (is_dst) {
			__builtin_memcpy(&from, &ip6->daddr, sizeof(from));
			__builtin_memcpy(&ip6->daddr, to, sizeof(*to));
		} else {
			__builtin_memcpy(&from, &ip6->saddr, sizeof(from));
			__builtin_memcpy(&ip6->saddr, to, sizeof(*to));
		}
	} else {
		struct iphdr *ip = l3;

		if ((void *)(ip + 1) > data_end)
			return -1;
		if (is_dst) {
			from.a[0] = ip->daddr;
			ip->daddr = to->a[0];
		} else {
			from.a[0] = ip->saddr;
			ip->saddr = to->a[0];
		}
		ip->check = cz_csum_replace32(ip->check, from.a[0], to->a[0]);
	}
	if (l4) {
#pragma unroll
		for (i = 0; i < 4; i++) {
			if (i > 0 && !v6)
				break;
			ret = bpf_l4_csum_replace(skb, csum_off, from.a[i], to->a[i], flags);
			if (ret < 0)
				return ret;
		}
	}
	if (v6)
		cz_csum_complete_addr6(skb, &from, to);
	return 0;
}

/*
 * ICMP error: the inner source (is_src) or destination := *to, with the inner IPv4 header
 * checksum, the inner L4 checksum (when its field is present) and the outer ICMP checksum.
 */
static __always_inline void nat_inner(struct pkt *p, struct inner *in, void *data_end, int is_src,
				      const struct ip6 *to)
{
	struct icmphdr *icmp = p->l4;
	struct ip6 from = is_src ? in->src : in->dst;
	__u16 icsum;
	int off;

	if ((void *)(icmp + 1) > data_end)
		return;
	icsum = icmp->checksum;
	if (p->v6) {
		struct ipv6hdr *i6 = in->l3;

		if ((void *)(i6 + 1) > data_end)
			return;
		if (is_src)
			__builtin_memcpy(&i6->saddr, to, sizeof(*to));
		else
			__builtin_memcpy(&i6->daddr, to, sizeof(*to));
		icsum = cz_csum_replace_addr(icsum, &from, to, 1);
	} else {
		struct iphdr *i4 = in->l3;
		__u16 old;

		if ((void *)(i4 + 1) > data_end)
			return;
		old = i4->check;
		if (is_src)
			i4->saddr = to->a[0];
		else
			i4->daddr = to->a[0];
		i4->check = cz_csum_replace32(old, from.a[0], to->a[0]);
		icsum = cz_csum_replace32(icsum, from.a[0], to->a[0]);
		icsum = cz_csum_replace16(icsum, old, i4->check);
	}
	off = cz_l4_csum_off(in->proto, p->v6);
	if (off >= 0 && in->l4_avail >= (__u32)off + 2) {
		__u16 *c = in->l4 + off;

		if ((void *)(c + 1) <= data_end) {
			__u16 old = *c;

			cz_l4_fix(c, in->proto, cz_csum_delta_addr(&from, to, p->v6));
			icsum = cz_csum_replace16(icsum, old, *c);
		}
	}
	icmp->checksum = icsum;
}

/*
 * XDP, the full path: the outer destination := *to (nat_xdp4, nat_xdp6) and the checksum that
 * covers it (TCP, UDP, ICMPv6), when the packet carries its L4 header. The L4 checksum after the
 * address, on the change the rewrite returns: its pointer (or NULL) passed into the rewrite
 * doubled the states through it (7,000 instructions more).
 */
static __always_inline void nat_xdp(struct pkt *p, void *data_end, const struct ip6 *to)
{
	__u32 delta;
	int off;

	if (p->v6) {
		struct ipv6hdr *ip6 = p->l3;

		if ((void *)(ip6 + 1) > data_end)
			return;
		delta = nat_xdp6(ip6, to);
	} else {
		struct iphdr *ip = p->l3;

		if ((void *)(ip + 1) > data_end)
			return;
		delta = nat_xdp4(ip, p->dst.a[0], to->a[0]);
	}
	if (!p->has_l4)
		return;
	off = cz_l4_csum_off(p->proto, p->v6);
	if (off >= 0) {
		__u16 *c = p->l4 + off;

		if ((void *)(c + 1) <= data_end)
			cz_l4_fix(c, p->proto, delta);
	}
}

/*
 * tc, the full paths: the outer destination (is_dst) or source := *to (nat_skb_addr) and
 * the checksum that covers it (TCP, UDP, ICMPv6), when the packet carries its L4 header. The IP
 * header is found again from its offset (and a barrier), so that every way through the parser
 * reaches this code in one state (docs/design.md, "Keeping the verifier's work bounded"). 0 or a
 * negative error; packet pointers are invalid afterwards.
 */
static __always_inline int nat_skb(struct __sk_buff *skb, struct pkt *p, void *data, void *data_end,
				   int is_dst, const struct ip6 *to)
{
	int off = p->has_l4 ? cz_l4_csum_off(p->proto, p->v6) : -1;
	__u32 l3_off = p->l3_off;
	void *l3;

	if (l3_off > CZ_MAX_OFF)
		return -1;
	l3 = data + l3_off;
	cz_barrier_var(l3);
	/* v6 a constant in each call: the full paths verify each family's rewrite apart */
	if (p->v6)
		return nat_skb_addr(skb, l3, data_end, 1, off >= 0, p->l4_off + off, p->proto,
				    is_dst, to);
	return nat_skb_addr(skb, l3, data_end, 0, off >= 0, p->l4_off + off, p->proto, is_dst, to);
}

#endif
