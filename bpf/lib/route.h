/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Host routing (docs/design.md, "Host routing"): a translated packet handed to the FIB's output
 * device with bpf_redirect_neigh, past the node's stack; the XDP mark for the tc program behind
 * XDP.
 */
#ifndef COZYEBPF_ROUTE_H
#define COZYEBPF_ROUTE_H

#include "fib.h"
#include "tc.h"

/* Is host routing on (--host-routing: flowcfg's CZ_CFG_HOST_ROUTING)? */
static __always_inline int cz_host_routing(void)
{
	struct flow_cfg *c = cz_cfg();

	return c && (c->flags & CZ_CFG_HOST_ROUTING);
}

/* bcc 0.26 declares bpf_redirect_neigh without its plen argument: the kernel's signature */
static long (*cz_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				 __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

/*
 * Host routing (--host-routing on: flowcfg's CZ_CFG_HOST_ROUTING; docs/design.md, "Host
 * routing"): a packet that a tc program of ours translated, and whose route the FIB gave in `fib`
 * (BPF_FIB_LKUP_RET_SUCCESS, asked with tot_len 0), is handed to the FIB's output device at once
 * with bpf_redirect_neigh, as a forwarding node would send it: TTL (hop limit) less one, the
 * neighbour resolved by the kernel (queued while it resolves: no neighbour is no loss), the
 * device's tc egress programs run (Cilium's included), the node's netfilter, conntrack and second
 * route lookup do not. What the forwarding path must answer -- TTL 1 or less (ICMP time
 * exceeded), a packet larger than the output device's MTU (fragmentation, ICMP
 * fragmentation-needed or packet-too-big) -- goes on to the stack as today: CZ_TC_NEXT. A GSO
 * packet takes the redirect when its segments fit: the largest IP and TCP headers (60 + 60
 * bytes) and gso_size within the MTU.
 */
#define CZ_HR_GSO_HDRS 120

/*
 * The one MTU check of the programs that hand a packet to a device themselves (host routing,
 * pod_route6, to_lb4): is the packet of `skb`, `ip_len` bytes from its IP header on, too big
 * for a device of MTU `mtu`? A GSO packet by its segments (gso_size and CZ_HR_GSO_HDRS), any
 * other by its length. (The FIB cache's FRAG_NEEDED, fib.h, is another question: the kernel's
 * own.)
 */
static __always_inline int cz_too_big(struct __sk_buff *skb, __u32 ip_len, __u32 mtu)
{
	return skb->gso_size ? skb->gso_size + CZ_HR_GSO_HDRS > mtu : ip_len > mtu;
}

/* Does the IPv6 packet `ip6` (of `skb`) fit a device of MTU `mtu`, with a hop to go? */
static __always_inline int cz_hr_fits6(struct __sk_buff *skb, struct ipv6hdr *ip6, __u32 mtu)
{
	__u32 len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);

	if (ip6->hop_limit <= 1)
		return 0;
	return !cz_too_big(skb, len, mtu);
}

static __always_inline int cz_host_route(struct __sk_buff *skb, int v6, struct bpf_fib_lookup *fib)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct bpf_redir_neigh nh = {};
	__u32 mtu = fib->mtu_result;

	if (v6) {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);

		if ((void *)(ip6 + 1) > data_end || !cz_hr_fits6(skb, ip6, mtu))
			return CZ_TC_NEXT;
		ip6->hop_limit--;
		nh.nh_family = CZ_AF_INET6;
		__builtin_memcpy(nh.ipv6_nh, fib->ipv6_dst, 16);
	} else {
		struct iphdr *ip = data + sizeof(struct ethhdr);
		__u32 check;

		if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
			return CZ_TC_NEXT;
		if (cz_too_big(skb, bpf_ntohs(ip->tot_len), mtu))
			return CZ_TC_NEXT;
		/* the kernel's ip_decrease_ttl: the checksum follows the TTL's byte */
		check = ip->check;
		check += bpf_htons(0x0100);
		ip->check = (__sum16)(check + (check >= 0xFFFF));
		ip->ttl--;
		nh.nh_family = CZ_AF_INET;
		nh.ipv4_nh = fib->ipv4_dst;
	}
	return cz_redirect_neigh(fib->ifindex, &nh, sizeof(nh), 0);
}

/*
 * Host routing of tc ingress on an uplink (cz_ingress_tc_route, cz_route_tc), after a translation
 * (or a pass to a pod IP sent directly) that left the packet's header at its fixed offset: the
 * route as for a packet arriving on the uplink, and cz_host_route; CZ_TC_NEXT (the stack) when host
 * routing is off, the FIB does not forward it (local, unreachable, forwarding off, too big for the
 * device) or cz_host_route leaves it to the stack.
 */
static __always_inline int cz_route_in(struct __sk_buff *skb, int v6)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct flow_cfg *c = cz_cfg();
	struct bpf_fib_lookup fib;
	int rc;

	if (!c || !(c->flags & CZ_CFG_HOST_ROUTING))
		return CZ_TC_NEXT;
	if (v6) {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);

		if ((void *)(ip6 + 1) > data_end)
			return CZ_TC_NEXT;
		rc = cz_fib6(skb, &fib, &ip6->saddr, &ip6->daddr, skb->ifindex);
	} else {
		struct iphdr *ip = data + sizeof(struct ethhdr);

		if ((void *)(ip + 1) > data_end)
			return CZ_TC_NEXT;
		rc = cz_fib4_cached(skb, &fib, c, ip->saddr, ip->daddr, skb->ifindex);
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return CZ_TC_NEXT;
	return cz_host_route(skb, v6, &fib);
}

/*
 * XDP ingress, a frame it let through (translated, or to a pod IP sent directly): with host
 * routing on, marked in the frame's metadata (CZ_META_ROUTE) for cz_route_tc, the tc program
 * behind it on the same device, which hands it on (cz_route_in) with the skb the redirect needs;
 * XDP keeps every decision and every drop. A driver without XDP metadata refuses the room: the
 * frame goes unmarked, and the stack routes it. CZ_NO_XDP_META (the loader sets it where the
 * kernel's verifier refuses the helper, kernel.xdp_meta) leaves every frame so.
 */
static __always_inline int cz_xdp_pass(struct xdp_md *ctx)
{
#ifdef CZ_NO_XDP_META
	return XDP_PASS;
#else
	void *data, *meta;

	if (!cz_host_routing())
		return XDP_PASS;
	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(__u32)))
		return XDP_PASS;
	data = (void *)(long)ctx->data;
	meta = (void *)(long)ctx->data_meta;
	if (meta + sizeof(__u32) > data)
		return XDP_PASS;
	*(__u32 *)meta = CZ_META_ROUTE;
	return XDP_PASS;
#endif
}

#endif
