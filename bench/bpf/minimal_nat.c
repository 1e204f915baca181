// SPDX-License-Identifier: GPL-2.0
/*
 * The reference "minimal XDP NAT with no extras" of the benchmark (not cozyebpf): IPv4 only,
 * one hash lookup of the destination, for port-filter entries one hash lookup of
 * (pod IP, proto, port), then daddr := pod IP with incremental IP and TCP/UDP checksums.
 * No pod-IP map, no flow table, no counters, no fragments, no ICMP. Its own unpinned maps.
 *
 * bench_min_snat is its egress half (tcx egress): one hash lookup of the source (pod IP ->
 * LB IP), then saddr := LB IP with the IP checksum written directly and the TCP/UDP checksum
 * through bpf_l4_csum_replace (right for CHECKSUM_PARTIAL skbs as for the others). No flow
 * record, no counters. TCX_NEXT either way.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/tcp.h>

struct min_svc {
	__be32 pod_ip;
	__u32 port_filter;
};

struct min_allow {
	__be32 pod_ip;
	__u8 proto;
	__u8 pad;
	__be16 port;
};

BPF_HASH(min_svc4, __be32, struct min_svc, 65536);
BPF_HASH(min_allow4, struct min_allow, __u8, 262144);
BPF_HASH(min_pod4, __be32, __be32, 65536); /* pod IP -> LB IP */

static __always_inline __u16 min_csum(__u16 sum, __be32 from, __be32 to)
{
	__u32 c = (__u16)~sum;

	c += (__u16) ~(from & 0xffff);
	c += (__u16) ~(from >> 16);
	c += to & 0xffff;
	c += to >> 16;
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	return (__u16)~c;
}

int bench_min_nat(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	struct min_svc *s;
	__be32 from, to;
	__be16 *ports;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5)
		return XDP_PASS;
	from = ip->daddr;
	s = min_svc4.lookup(&from);
	if (!s)
		return XDP_PASS;
	to = s->pod_ip;
	ports = (void *)(ip + 1);
	if (s->port_filter) {
		struct min_allow k = {};

		if ((void *)(ports + 2) > data_end)
			return XDP_DROP;
		k.pod_ip = to;
		k.proto = ip->protocol;
		k.port = ports[1];
		if (!min_allow4.lookup(&k))
			return XDP_DROP;
	}
	ip->daddr = to;
	ip->check = min_csum(ip->check, from, to);
	if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *uh = (void *)(ip + 1);

		if ((void *)(uh + 1) <= data_end && uh->check) {
			__u16 c = min_csum(uh->check, from, to);

			uh->check = c ? c : 0xffff;
		}
	} else if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *th = (void *)(ip + 1);

		if ((void *)(th + 1) <= data_end)
			th->check = min_csum(th->check, from, to);
	}
	return XDP_PASS;
}

#define MIN_TCX_NEXT -1

int bench_min_snat(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	__u64 flags = BPF_F_PSEUDO_HDR | 4;
	__be32 from, *to;
	__u32 off;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5)
		return MIN_TCX_NEXT;
	from = ip->saddr;
	to = min_pod4.lookup(&from);
	if (!to)
		return MIN_TCX_NEXT;
	if (ip->protocol == IPPROTO_UDP) {
		off = sizeof(*eth) + sizeof(*ip) + offsetof(struct udphdr, check);
		flags |= BPF_F_MARK_MANGLED_0;
	} else if (ip->protocol == IPPROTO_TCP) {
		off = sizeof(*eth) + sizeof(*ip) + offsetof(struct tcphdr, check);
	} else {
		return MIN_TCX_NEXT;
	}
	ip->saddr = *to;
	ip->check = min_csum(ip->check, from, *to);
	bpf_l4_csum_replace(skb, off, from, *to, flags);
	return MIN_TCX_NEXT;
}
