/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The kernel's routes as the programs ask them (bpf_fib_lookup): the lookups of both families,
 * the FIB's answers cached per CPU with their lifetime (docs/design.md, "What the caches trust"),
 * the reverse path's question, the node's part of flowcfg (uplinks, flags).
 */
#ifndef COZYEBPF_FIB_H
#define COZYEBPF_FIB_H

#include "maps.h"
#include "types.h"

#define CZ_AF_INET 2		    /* AF_INET, for bpf_fib_lookup */
#define CZ_AF_INET6 10		    /* AF_INET6 */
#define CZ_FIB_SKIP_NEIGH (1U << 2) /* BPF_FIB_LOOKUP_SKIP_NEIGH (Linux 6.5) */

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
		/* the kernel's answer, not cz_too_big (route.h): the frame, its slack, any GSO */
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

#endif
