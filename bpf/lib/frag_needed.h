/* SPDX-License-Identifier: GPL-2.0 */
/*
 * ICMP fragmentation-needed, synthesised for a packet of this node too big for the device it
 * would be handed to (to_lb4).
 */
#ifndef COZYEBPF_FRAG_NEEDED_H
#define COZYEBPF_FRAG_NEEDED_H

#include "csum.h"
#include "fib.h"
#include "tc.h"

/*
 * ICMP fragmentation-needed (type 3, code 4) for the IPv4 packet in `skb`, which this node sent
 * and which is larger than `mtu`, the device it would be handed to: the packet becomes the
 * ICMP message (from `from`, to its own source, quoting its header and 8 bytes) and goes to the
 * uplink's ingress, where the node's stack takes it as any router's and lowers the path MTU of
 * the destination (the sender's next packet fits, or is fragmented there). A packet with IP
 * options is not answered (CZ_TC_DROP, as the device would have dropped it).
 */
struct cz_frag_needed {
	struct ethhdr eth;
	struct iphdr ip;
	struct icmphdr icmp;
	__u8 quote[sizeof(struct iphdr) + 8];
} __attribute__((packed));

static __always_inline int cz_frag_needed4(struct __sk_buff *skb, __be32 from, __u32 mtu)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	struct cz_frag_needed m = {};
	__s64 sum;

	if ((void *)(ip + 1) > data_end || ip->ihl != 5)
		return CZ_TC_DROP;
	__builtin_memcpy(m.eth.h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(m.eth.h_source, eth->h_dest, ETH_ALEN);
	m.eth.h_proto = bpf_htons(ETH_P_IP);
	m.ip.version = 4;
	m.ip.ihl = 5;
	m.ip.tos = 0xc0; /* internetwork control, as the kernel's ICMP */
	m.ip.tot_len = bpf_htons(sizeof(m) - sizeof(m.eth));
	m.ip.ttl = 64;
	m.ip.protocol = IPPROTO_ICMP;
	m.ip.saddr = from;
	m.ip.daddr = ip->saddr;
	m.icmp.type = 3; /* ICMP_DEST_UNREACH */
	m.icmp.code = 4; /* ICMP_FRAG_NEEDED */
	m.icmp.un.frag.mtu = bpf_htons(mtu);
	if (bpf_skb_load_bytes(skb, sizeof(*eth), m.quote, sizeof(m.quote)) < 0)
		return CZ_TC_DROP;
	sum = bpf_csum_diff(0, 0, (__be32 *)&m.ip, sizeof(m.ip), 0);
	if (sum < 0)
		return CZ_TC_DROP;
	m.ip.check = ~cz_csum_fold32((__u32)sum);
	sum = bpf_csum_diff(0, 0, (__be32 *)&m.icmp, sizeof(m.icmp) + sizeof(m.quote), 0);
	if (sum < 0)
		return CZ_TC_DROP;
	m.icmp.checksum = ~cz_csum_fold32((__u32)sum);
	if (bpf_skb_change_tail(skb, sizeof(m), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &m, sizeof(m), 0) < 0)
		return CZ_TC_DROP;
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
}

#endif
