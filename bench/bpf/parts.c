// SPDX-License-Identifier: GPL-2.0
/*
 * The parts of a packet's cost in the datapath, one at a time, for the per-packet breakdown of
 * bench/progrun.py: each program does one thing on top of reading the IPv4 header of the frame
 * and returns XDP_PASS (compare with bench_pass in sink.c, the floor). The maps have the sizes
 * and key/value layouts of the product's (addr4, flow4, flowhint, stats).
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>

struct parts_addr {
	__u8 bytes[56]; /* struct addr4_val */
};

struct parts_flow_key {
	__be32 pod_ip, remote_ip;
	__be16 pod_port, remote_port;
	__u8 proto, reserved[3];
};

struct parts_stat {
	__u64 packets, bytes;
};

BPF_HASH(parts_addr4, __be32, struct parts_addr, 131072);
BPF_TABLE("lru_hash", struct parts_flow_key, __u64, parts_flow4, 262144);
BPF_ARRAY(parts_hints, __u64, 65536);
BPF_PERCPU_ARRAY(parts_stats, struct parts_stat, 64);

#define PARTS_IP                                                                                   \
	void *data = (void *)(long)ctx->data;                                                      \
	void *data_end = (void *)(long)ctx->data_end;                                              \
	struct iphdr *ip = data + sizeof(struct ethhdr);                                           \
	if ((void *)(ip + 1) + 4 > data_end)                                                       \
		return XDP_ABORTED;

/* one hash lookup of the destination that hits (the address lookup) */
int parts_addr_hit(struct xdp_md *ctx)
{
	PARTS_IP;
	return parts_addr4.lookup(&ip->daddr) ? XDP_PASS : XDP_DROP;
}

/* ... that misses (traffic that is not ours) */
int parts_addr_miss(struct xdp_md *ctx)
{
	PARTS_IP;
	return parts_addr4.lookup(&ip->saddr) ? XDP_DROP : XDP_PASS;
}

/* one LRU lookup of a 16-byte flow key that hits (a reply) */
int parts_flow_hit(struct xdp_md *ctx)
{
	struct parts_flow_key k = {};
	__be16 *ports;

	PARTS_IP;
	ports = (void *)(ip + 1);
	k.pod_ip = ip->daddr;
	k.remote_ip = ip->saddr;
	k.pod_port = ports[1];
	k.remote_port = ports[0];
	k.proto = ip->protocol;
	return parts_flow4.lookup(&k) ? XDP_PASS : XDP_DROP;
}

/* the flow hint: a multiplicative hash and two words of an array */
int parts_hint(struct xdp_md *ctx)
{
	__u32 h, w, u;
	__u64 *a, *b;

	PARTS_IP;
	h = ((ip->daddr ^ ip->saddr ^ ip->protocol) * 0x9E3779B1u) >> 11;
	w = (h >> 6) * 2;
	u = w + 1;
	a = parts_hints.lookup(&w);
	b = parts_hints.lookup(&u);
	if ((((a ? *a : 0) | (b ? *b : 0)) >> (h & 63)) & 1)
		return XDP_DROP;
	return XDP_PASS;
}

/* one per-CPU counter (packets and bytes) */
int parts_count(struct xdp_md *ctx)
{
	__u32 reason = 6;
	struct parts_stat *s;

	PARTS_IP;
	s = parts_stats.lookup(&reason);
	if (s) {
		s->packets++;
		s->bytes += data_end - data;
	}
	return XDP_PASS;
}

/* destination := another address, IPv4 header and UDP checksums updated */
int parts_rewrite(struct xdp_md *ctx)
{
	__be32 from, to;
	__u32 c;

	PARTS_IP;
	from = ip->daddr;
	to = from ^ 0x01000000;
	c = (__u16)~ip->check + (__u16) ~(from & 0xffff) + (__u16) ~(from >> 16) + (to & 0xffff) +
	    (to >> 16);
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	ip->daddr = to;
	ip->check = ~c;
	return XDP_PASS;
}

/*
 * The kernel's route to the source, as from the device the frame came in by (bpf_fib_lookup,
 * an ingress lookup without the neighbour): what a source check without the product's cache
 * (cz_spoofed) would ask of every packet. In this namespace's routing table, which is small.
 */
int parts_fib(struct xdp_md *ctx)
{
	struct bpf_fib_lookup fib = {};

	PARTS_IP;
	fib.family = 2; /* AF_INET */
	fib.ipv4_dst = ip->saddr;
	fib.ifindex = ctx->ingress_ifindex;
	bpf_fib_lookup(ctx, &fib, sizeof(fib), 1U << 2 /* BPF_FIB_LOOKUP_SKIP_NEIGH */);
	return fib.ifindex == ctx->ingress_ifindex ? XDP_PASS : XDP_PASS;
}
