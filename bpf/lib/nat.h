/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Address translation. XDP rewrites in place with incremental checksums; TC uses the kernel's
 * helpers so that CHECKSUM_PARTIAL packets from local veths stay correct. Both fix the IPv4
 * header checksum and the pseudo-header part of TCP and UDP checksums (a UDP checksum of 0 means
 * "none" and stays 0; a result of 0 is written as 0xffff). ICMP and SCTP checksums do not cover
 * IP addresses; other protocols keep their payload untouched. Non-first fragments carry no L4
 * header, so only the IP header changes.
 */
#ifndef COZYEBPF_NAT_H
#define COZYEBPF_NAT_H

#include <linux/tcp.h>
#include <linux/udp.h>
#include "csum.h"
#include "parse.h"

/* XDP: iph->daddr (is_dst) or iph->saddr := to. */
static __always_inline void nat4_xdp(struct iphdr *ip, struct l4_info *info, void *data_end,
				     int is_dst, __be32 to)
{
	__be32 from = is_dst ? ip->daddr : ip->saddr;

	if (is_dst)
		ip->daddr = to;
	else
		ip->saddr = to;
	ip->check = cz_csum_replace32(ip->check, from, to);
	if (!info->has_l4)
		return;
	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *th = info->l4;

		if ((void *)(th + 1) > data_end)
			return;
		th->check = cz_csum_replace32(th->check, from, to);
	} else if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *uh = info->l4;
		__u16 c;

		if ((void *)(uh + 1) > data_end)
			return;
		if (uh->check == 0)
			return;
		c = cz_csum_replace32(uh->check, from, to);
		uh->check = c ? c : 0xffff;
	}
}

/*
 * TC: same rewrite through helpers. ip_off is the IP header's offset in the skb, l4_off the
 * L4 header's. Returns 0 or a negative error from a helper.
 */
static __always_inline int nat4_skb(struct __sk_buff *skb, __u32 ip_off, __u32 l4_off, __u8 proto,
				    int has_l4, int is_dst, __be32 from, __be32 to)
{
	__u32 addr_off =
		ip_off + (is_dst ? offsetof(struct iphdr, daddr) : offsetof(struct iphdr, saddr));
	int ret;

	if (has_l4 && proto == IPPROTO_TCP) {
		ret = bpf_l4_csum_replace(skb, l4_off + offsetof(struct tcphdr, check), from, to,
					  BPF_F_PSEUDO_HDR | sizeof(to));
		if (ret < 0)
			return ret;
	} else if (has_l4 && proto == IPPROTO_UDP) {
		ret = bpf_l4_csum_replace(skb, l4_off + offsetof(struct udphdr, check), from, to,
					  BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(to));
		if (ret < 0)
			return ret;
	}
	ret = bpf_l3_csum_replace(skb, ip_off + offsetof(struct iphdr, check), from, to,
				  sizeof(to));
	if (ret < 0)
		return ret;
	return bpf_skb_store_bytes(skb, addr_off, &to, sizeof(to), 0);
}

#endif
