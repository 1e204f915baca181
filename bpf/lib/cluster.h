/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A node of a cluster whose pods reach the node through pod-facing devices (Kube-OVN's ovn0;
 * per-pod veths), beyond what the uplinks' programs do (docs/design.md, "On a Cozystack
 * cluster", draws every path):
 *
 * - pod_side4() (the pod-facing hook, tcx ingress on --pod-devices, before netfilter): a managed
 *   pod's packet that leaves the node by an uplink is translated there, as egress does, so the
 *   node's masquerade (Kube-OVN's natOutgoing) never sees the pod IP; and the answer of a
 *   managed pod to a connection that this node opened to its LB IP, which the overlay brings
 *   back to this node with the pod IP as source (cozy-proxy PR #18), gets its LB IP back before
 *   conntrack looks at it. Everything else -- pod to pod, a pod's own connection to a node --
 *   is left as the CNI has it.
 * - to_lb4() (uplink egress): a packet from this node's own address to a managed LB IP whose pod
 *   sits behind a pod-facing device is decided as ingress decides it, translated and handed to
 *   that device at once (through the ToR it would come back with a local source, a martian); its
 *   connection is remembered as a flow of the pod, which is what pod_side4 finds.
 *
 * Both are IPv4 (Kube-OVN as Cozystack runs it has no IPv6) and TCP/UDP for what needs ports;
 * the programs do nothing of this unless flowcfg says pod-facing hooks are attached.
 */
#ifndef COZYEBPF_CLUSTER_H
#define COZYEBPF_CLUSTER_H

#include "account.h"
#include "flow.h"
#include "ingress.h"
#include "lookup.h"
#include "nat.h"
#include "tc.h"

#define CZ_AF_INET 2		    /* AF_INET, for bpf_fib_lookup */
#define CZ_AF_INET6 10		    /* AF_INET6 */
#define CZ_FIB_SKIP_NEIGH (1U << 2) /* BPF_FIB_LOOKUP_SKIP_NEIGH (Linux 6.5) */

/* bcc 0.26 declares bpf_redirect_neigh without its plen argument: the kernel's signature */
static long (*cz_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				 __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

static __always_inline struct flow_cfg *cz_cfg(void)
{
	__u32 zero = 0;

	return cz_flowcfg.lookup(&zero);
}

/* Is `ifindex` one of the uplinks (flowcfg; an ifindex is never 0, so unused slots never match)? */
static __always_inline int cz_is_uplink(const struct flow_cfg *c, __u32 ifindex)
{
	int i;

#pragma unroll
	for (i = 0; i < CZ_UPLINKS_MAX; i++)
		if (c->uplinks[i] == ifindex)
			return 1;
	return 0;
}

/*
 * The kernel's route for src -> dst as a packet arriving on `ifindex` takes it (bpf_fib_lookup;
 * BPF_FIB_LKUP_RET_*): the output device and the next hop (fib->ipv4_dst), never its MAC address
 * (bpf_redirect_neigh resolves that), except on a kernel before 6.5, which has no
 * BPF_FIB_LOOKUP_SKIP_NEIGH and is asked again without it.
 */
static __always_inline int cz_fib4(struct __sk_buff *skb, struct bpf_fib_lookup *fib, __be32 src,
				   __be32 dst, __u32 ifindex)
{
	int rc;

	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = CZ_AF_INET;
	fib->ipv4_src = src;
	fib->ipv4_dst = dst;
	fib->ifindex = ifindex;
	rc = bpf_fib_lookup(skb, fib, sizeof(*fib), CZ_FIB_SKIP_NEIGH);
	if (rc < 0) {
		fib->ipv4_dst = dst;
		fib->ifindex = ifindex;
		rc = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	}
	return rc;
}

/* cz_fib4's IPv6 twin: the route for src -> dst (16 bytes each) as a packet arriving on
 * `ifindex` takes it, the next hop in fib->ipv6_dst. */
static __always_inline int cz_fib6(struct __sk_buff *skb, struct bpf_fib_lookup *fib,
				   const void *src, const void *dst, __u32 ifindex)
{
	int rc;

	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = CZ_AF_INET6;
	__builtin_memcpy(fib->ipv6_src, src, 16);
	__builtin_memcpy(fib->ipv6_dst, dst, 16);
	fib->ifindex = ifindex;
	rc = bpf_fib_lookup(skb, fib, sizeof(*fib), CZ_FIB_SKIP_NEIGH);
	if (rc < 0) {
		__builtin_memcpy(fib->ipv6_dst, dst, 16);
		fib->ifindex = ifindex;
		rc = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	}
	return rc;
}

static __always_inline int cz_fib_forwards(int rc)
{
	return rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH;
}

/*
 * The FIB's answers, cached (IPv4; IPv6 asks the FIB each time): what a VM's packets ask for
 * every packet (bpf_fib_lookup is most of what the pod-facing hook and host routing cost a VM's
 * packet: docs/design.md, "Host routing"), asked at most once a second per (source,
 * destination, input device) on each CPU. A per-CPU array of CZ_FIBC4_SLOTS slots, direct-mapped
 * by a hash of the question (as the seen slots, types.h): a miss costs the FIB and one store
 * into this CPU's slot, no lock and no eviction, so a VM that talks to more addresses than the
 * slots hold pays what the lookup alone costs, never more (the LRU hash this replaced cost 2 to
 * 4 times the lookup there: docs/design.md). Not pinned: each loaded instance of the programs
 * begins cold, and a cache needs no layout.
 *
 * An answer is used only while both hold (docs/design.md, "What the caches trust"):
 * - it is under CZ_FIBC_NS old by the kernel's clock: a route or next hop that changes while no
 *   agent runs (an upgrade, a crash loop) is followed within that, as the node's own traffic
 *   follows it at once;
 * - flowcfg's fib_gen is the one it was asked under (read before asking, so an answer asked
 *   across a change is never taken as new): a running agent bumps it on every change of routes,
 *   rules and links (BpfDatapath._follow_routes), and the programs follow at once.
 * BPF_FIB_LKUP_RET_FRAG_NEEDED depends on the packet, not the route: it is cached as the route's
 * SUCCESS and derived again for each packet as the kernel derives it (is_skb_forwardable: the
 * device's MTU plus an Ethernet and a VLAN header, any GSO packet). NO_NEIGH (a kernel before
 * 6.5, asked without BPF_FIB_LOOKUP_SKIP_NEIGH) is never cached.
 */
#define CZ_FIBC4_SLOTS 4096	 /* per CPU, a power of two: 160 KiB per CPU */
#define CZ_FIBC_NS 1000000000ULL /* an answer's lifetime: a second */
#define CZ_FWD_SLACK (14 + 4)	 /* is_skb_forwardable: an Ethernet and a VLAN header */

struct cz_fibc_slot {
	__be32 src; /* the question: source, destination, */
	__be32 dst;
	__u32 ifindex; /* and the device the packet entered (or is routed as if it had) */
	__u32 gen;     /* flowcfg's fib_gen when asked */
	__u64 asked;   /* bpf_ktime_get_coarse_ns() when asked; 0: empty */
	__s32 rc;      /* BPF_FIB_LKUP_RET_*, FRAG_NEEDED cached as SUCCESS */
	__u32 oif;     /* the answer: fib->ifindex, */
	__be32 nh;     /* fib->ipv4_dst (the next hop), */
	__u32 mtu;     /* fib->mtu_result */
};

BPF_PERCPU_ARRAY(cz_fibc4, struct cz_fibc_slot, CZ_FIBC4_SLOTS);

/* The slot of a question: a multiplicative hash of the three, its high bits folded in. */
static __always_inline __u32 cz_fibc_index(__be32 src, __be32 dst, __u32 ifindex)
{
	__u32 h = (__u32)dst * 0x9E3779B1U ^ (__u32)src * 0x85EBCA6BU ^ ifindex;

	return (h ^ (h >> 16)) & (CZ_FIBC4_SLOTS - 1);
}

static __always_inline int cz_fib4_cached(struct __sk_buff *skb, struct bpf_fib_lookup *fib,
					  const struct flow_cfg *c, __be32 src, __be32 dst,
					  __u32 ifindex)
{
	__u32 i = cz_fibc_index(src, dst, ifindex);
	struct cz_fibc_slot *s = cz_fibc4.lookup(&i);
	__u32 gen = c->fib_gen; /* read before asking: a change after it invalidates the answer */
	__u64 now = bpf_ktime_get_coarse_ns();
	int rc;

	if (!s)
		return cz_fib4(skb, fib, src, dst, ifindex);
	if (s->asked && now - s->asked < CZ_FIBC_NS && s->gen == gen && s->dst == dst &&
	    s->src == src && s->ifindex == ifindex) {
		fib->ifindex = s->oif;
		fib->ipv4_dst = s->nh;
		fib->mtu_result = s->mtu;
		rc = s->rc;
		if (rc == BPF_FIB_LKUP_RET_SUCCESS && skb->len > s->mtu + CZ_FWD_SLACK &&
		    !skb->gso_size)
			rc = BPF_FIB_LKUP_RET_FRAG_NEEDED;
		return rc;
	}
	rc = cz_fib4(skb, fib, src, dst, ifindex);
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return rc;
	s->src = src;
	s->dst = dst;
	s->ifindex = ifindex;
	s->gen = gen;
	s->rc = rc == BPF_FIB_LKUP_RET_FRAG_NEEDED ? BPF_FIB_LKUP_RET_SUCCESS : rc;
	s->oif = fib->ifindex;
	s->nh = fib->ipv4_dst;
	s->mtu = fib->mtu_result;
	s->asked = now;
	return rc;
}

/* The reverse path's question for cz_spoofed: the route to `src`, as for a packet from `in`. */
static __always_inline void cz_fib_rev(struct bpf_fib_lookup *fib, int v6, const void *src,
				       __u32 in)
{
	__builtin_memset(fib, 0, sizeof(*fib));
	if (v6) {
		fib->family = CZ_AF_INET6;
		__builtin_memcpy(fib->ipv6_dst, src, 16);
	} else {
		fib->family = CZ_AF_INET;
		fib->ipv4_dst = *(const __be32 *)src;
	}
	fib->ifindex = in;
}

/*
 * Source verification (docs/design.md, "A pod speaks only for itself"): may a packet whose source
 * is the managed pod IP `src` (v6: 16 bytes, else 4), entering the node by device `in`, speak for
 * that pod? Yes when `in` is the device the node routes that IP to -- the kernel's reverse path,
 * as strict rp_filter asks it: the FIB's route to the pod IP, looked up as from `in`, leaves by
 * `in` (cz_routed_by) -- and when `in` is 0 (tc egress of a packet the node itself sent). The
 * answer is cached in the pod's address value (`dev`): a packet from the cached device costs one
 * compare (cz_src_unsure); one from any other asks the FIB, and a confirmed device replaces the
 * cache (a VM that migrated here, a re-created veth). Behind a device that carries every pod
 * (Kube-OVN's ovn0) every pod passes: only the CNI can tell its pods apart there.
 */
static __always_inline int cz_routed_by(struct __sk_buff *skb, int v6, const void *src, __u32 in)
{
	struct bpf_fib_lookup fib;
	int rc;

	cz_fib_rev(&fib, v6, src, in);
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), CZ_FIB_SKIP_NEIGH);
	if (rc < 0) { /* a kernel before 6.5: without BPF_FIB_LOOKUP_SKIP_NEIGH */
		cz_fib_rev(&fib, v6, src, in);
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	}
	return cz_fib_forwards(rc) && fib.ifindex == in;
}

/* Not from the cached device, nor the node's own: the FIB must be asked. */
static __always_inline int cz_src_unsure(__u32 dev, __u32 in)
{
	return dev != in && in;
}

/* Cache `in` as the device of the pod IP `addr` (the full path, which holds a copy). */
static __always_inline void cz_dev_set(int v6, const struct ip6 *addr, __u32 in)
{
	if (v6) {
		struct addr6_val *v = cz_addr6.lookup((struct ip6 *)addr);

		if (v)
			v->dev = in;
	} else {
		__be32 a = addr->a[0];
		struct addr4_val *v = cz_addr4.lookup(&a);

		if (v)
			v->dev = in;
	}
}

/* The whole check where the value is at hand (the pod-facing hook): 1, spoofed. */
static __always_inline int cz_spoofed(struct __sk_buff *skb, __u32 *dev, int v6, const void *src,
				      __u32 in)
{
	if (cz_likely(!cz_src_unsure(*dev, in)))
		return 0;
	if (!cz_routed_by(skb, v6, src, in))
		return 1;
	*dev = in;
	return 0;
}

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

/* Does the IPv6 packet `ip6` (of `skb`) fit a device of MTU `mtu`, with a hop to go? */
static __always_inline int cz_hr_fits6(struct __sk_buff *skb, struct ipv6hdr *ip6, __u32 mtu)
{
	__u32 len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);

	if (ip6->hop_limit <= 1)
		return 0;
	return skb->gso_size ? skb->gso_size + CZ_HR_GSO_HDRS <= mtu : len <= mtu;
}

static __always_inline int cz_host_route(struct __sk_buff *skb, int v6, struct bpf_fib_lookup *fib)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct bpf_redir_neigh nh = {};
	__u32 mtu = fib->mtu_result, len;

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
		len = bpf_ntohs(ip->tot_len);
		if (skb->gso_size ? skb->gso_size + CZ_HR_GSO_HDRS > mtu : len > mtu)
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
 * Host routing of tc ingress on an uplink (cz_ingress_tc's fast path), after a translation (or a
 * pass to a pod IP sent directly) that left the packet's header at its fixed offset: the route as
 * for a packet arriving on the uplink, and cz_host_route; CZ_TC_NEXT (the stack) when host routing
 * is off, the FIB does not forward it (local, unreachable, forwarding off, too big for the device)
 * or cz_host_route leaves it to the stack.
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
 * frame goes unmarked, and the stack routes it.
 */
static __always_inline int cz_xdp_pass(struct xdp_md *ctx)
{
	struct flow_cfg *c = cz_cfg();
	void *data, *meta;

	if (!c || !(c->flags & CZ_CFG_HOST_ROUTING))
		return XDP_PASS;
	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(__u32)))
		return XDP_PASS;
	data = (void *)(long)ctx->data;
	meta = (void *)(long)ctx->data_meta;
	if (meta + sizeof(__u32) > data)
		return XDP_PASS;
	*(__u32 *)meta = CZ_META_ROUTE;
	return XDP_PASS;
}

#define CZ_SIDE_NOT 0	 /* not for the pod-facing hook to translate */
#define CZ_SIDE_NAT 1	 /* to translate, then on to the stack */
#define CZ_SIDE_ROUTED 2 /* to translate, then cz_host_route with the FIB's answer */

/*
 * The pod-facing hook, IPv4: is this packet, whose source is a managed pod IP and which entered
 * from that pod's device (cz_spoofed), one to translate as egress does? Yes when it leaves the
 * node by an uplink (the pod's own traffic out of the cluster), or it answers a
 * connection that to_lb4 translated to the pod's LB IP on this node (a flow it recorded): one this
 * node opened, the answer then for this node, or one of a pod on another pod-facing device of this
 * node. CZ_SIDE_*: CZ_SIDE_ROUTED when host routing is on and the FIB gave the uplink as the
 * route (in *fib); one too big for the uplink (BPF_FIB_LKUP_RET_FRAG_NEEDED) is translated and left
 * to the stack, which answers it as for any forwarded packet.
 */
static __always_inline int pod_side4(struct __sk_buff *skb, void *data_end, struct iphdr *ip,
				     struct bpf_fib_lookup *fib)
{
	struct flow_cfg *c;
	__be16 sport, dport;
	__u16 *csum;
	__u8 tf = 0;
	int rc;

	c = cz_cfg();
	if (!c)
		return CZ_SIDE_NOT;
	rc = cz_fib4_cached(skb, fib, c, ip->saddr, ip->daddr, skb->ingress_ifindex);
	if ((cz_fib_forwards(rc) || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) &&
	    cz_is_uplink(c, fib->ifindex))
		return rc == BPF_FIB_LKUP_RET_SUCCESS && (c->flags & CZ_CFG_HOST_ROUTING)
			       ? CZ_SIDE_ROUTED
			       : CZ_SIDE_NAT;
	if (!cz_fib_forwards(rc) && rc != BPF_FIB_LKUP_RET_NOT_FWDED)
		return CZ_SIDE_NOT; /* unreachable, blackhole, forwarding off: the kernel decides */
	/* to this node, or to another pod-facing device (a pod on this node) */
	if (fast_hdrs4(ip, data_end, skb->len, &sport, &dport, &csum, &tf) < 0)
		return CZ_SIDE_NOT;
	return flow_reply(0, (struct ip6 *)&ip->saddr, (struct ip6 *)&ip->daddr, sport, dport,
			  ip->protocol, 0)
		       ? CZ_SIDE_NAT
		       : CZ_SIDE_NOT;
}

/*
 * The pod-facing hook's verdict for a packet it lets through: one to a managed LB IP ends the
 * device's tc chain (CZ_TC_PASS), so that the programs after ours there (Cilium's, whose
 * wildcard entry for an LB IP it handles drops unlisted ports) never see an LB IP. Such a packet
 * reaches its pod by the ToR or by to_lb4's redirect, translated, and those programs see the pod
 * IP on the way in. Everything else goes on to them (CZ_TC_NEXT).
 */
static __always_inline int pod_next4(struct iphdr *ip)
{
	struct addr4_val *d = cz_addr4.lookup(&ip->daddr);

	return d && (d->kind & CZ_K_LB) ? CZ_TC_PASS : CZ_TC_NEXT;
}

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

/*
 * Uplink egress, IPv4, a packet whose source is no managed pod IP. To a managed LB IP from a
 * client of this node -- its own address (a process of the node, or a pod the node masqueraded)
 * or a pod behind a pod-facing device -- whose pod sits behind a pod-facing device, it takes the
 * ingress decision here and, let in, is translated and handed to that device (TC_ACT_REDIRECT):
 * through the ToR it would come back with a local source, a martian, or its answer would go to
 * the client pod directly, never translated; across nodes the overlay carries it as it carries
 * the answer. Its connection is recorded as a flow of the pod, keyed as the pod's answer will
 * be, for pod_side4. A VM's packet (its source an LB IP) goes by the ToR to the node of the
 * other LB IP, which holds the flows of that pod; every other packet goes on too: CZ_TC_NEXT.
 */
static __always_inline int to_lb4(struct __sk_buff *skb, void *data, void *data_end,
				  struct iphdr *ip)
{
	struct flow_cfg *c = cz_cfg();
	struct bpf_fib_lookup fib;
	struct bpf_redir_neigh nh = {};
	struct addr4_val *d;
	struct cz_fast f = {};
	struct ip6 pod = {}, client = {}, to;
	__u32 reason;
	int rc, too_big;

	if (!c || !(c->flags & CZ_CFG_POD_DEVICES))
		return CZ_TC_NEXT;
	d = cz_addr4.lookup(&ip->daddr);
	if (!d || !(d->kind & CZ_K_LB))
		return CZ_TC_NEXT;
	pod.a[0] = d->pod_ip;
	client.a[0] = ip->saddr;
	/*
	 * (A VM's packet, its source an LB IP, does not come here: fast_egress sends it by the ToR,
	 * to the node of its LB IP, which holds that pod's flows.)
	 */
	/*
	 * Routes as for a packet that arrives on the uplink (an output lookup keeps to the uplink):
	 * the client is this node's own address, or a pod behind a pod-facing device
	 */
	rc = cz_fib4(skb, &fib, 0, client.a[0], skb->ifindex);
	if (rc != BPF_FIB_LKUP_RET_NOT_FWDED &&
	    (!cz_fib_forwards(rc) || cz_is_uplink(c, fib.ifindex)))
		return CZ_TC_NEXT;
	/* a pod behind an uplink: the node of its LB IP serves it */
	rc = cz_fib4(skb, &fib, client.a[0], pod.a[0], skb->ifindex);
	too_big = rc == BPF_FIB_LKUP_RET_FRAG_NEEDED;
	if ((!cz_fib_forwards(rc) && !too_big) || cz_is_uplink(c, fib.ifindex))
		return CZ_TC_NEXT;
	/* a frame the fast decision does not take goes by the ToR (a pod here: out of reach) */
	reason = fast_ingress(data, data_end, skb->len, &f, &to);
	if (reason == CZ_SLOW || reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	fast_monitor(skb, 0, 0, reason, f.slot, skb->len, 0, f.proto, f.l3, f.sport, f.dport);
	if (reason == CZ_DROP_PORT || reason == CZ_DROP_SOURCE) {
		fast_count(0, reason, f.slot, skb->len);
		return CZ_TC_DROP;
	}
	/*
	 * Larger than the pod's device (Kube-OVN's ovn0 under a larger uplink; the device would
	 * drop it, the ToR bring it back as a martian): the node is told the path's MTU, as the
	 * stack tells it when a route's device is too small. Nothing is recorded or translated.
	 * (No TTL here: the node sent it, or forwarded it already, and counted that hop then.)
	 */
	if (too_big || (skb->gso_size ? skb->gso_size + CZ_HR_GSO_HDRS > fib.mtu_result
				      : skb->len > fib.mtu_result + sizeof(struct ethhdr)))
		return cz_frag_needed4(skb, ip->daddr, fib.mtu_result);
	/* only what the pod's filter let in: the flow admits what the client sends as well */
	flow_record(0, &pod, &client, f.dport, f.sport, f.proto, 0, f.tcp_flags, 1);
	if (f.rewrite && fast_nat_skb(skb, &f, data_end, 1, &to) < 0) {
		fast_count(0, CZ_DROP_MALFORMED, f.slot, skb->len);
		return CZ_TC_DROP;
	}
	fast_count(0, reason, f.slot, skb->len);
	nh.nh_family = CZ_AF_INET;
	nh.ipv4_nh = fib.ipv4_dst; /* the FIB's next hop for the pod IP */
	return cz_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
}

#endif
