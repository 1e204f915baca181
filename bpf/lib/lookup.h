/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The maps seen through one family-neutral interface: each helper picks the IPv4 or the IPv6
 * map and converts keys and values, so that the decisions in filter.h and ingress.h are written
 * once for both families. The fast paths use the IPv4 and IPv6 values directly. Flows are in
 * flow.h.
 */
#ifndef COZYEBPF_LOOKUP_H
#define COZYEBPF_LOOKUP_H

#include "maps.h"
#include "parse.h"

#define CZ_FRAG_TIMEOUT_NS 30000000000ULL

#define CZ_HINT_POD 0 /* rolehint's half of the pod IPs */
#define CZ_HINT_LB 1  /* and of the LB IPs */

/*
 * May the IPv4 address `a` be a key of addr4 in the role `half` (CZ_HINT_POD, CZ_HINT_LB)? 0: it
 * is not (its bit in that half of rolehint is clear, types.h). The same hash as user space's
 * (layout.addr_hint_bit), on the address as it lies in memory; an array lookup, which the
 * verifier inlines.
 */
static __always_inline int cz_addr4_hinted(__be32 a, __u32 half)
{
	__u32 h = ((__u32)a * 0x9E3779B1u) >> (32 - CZ_ROLEHINT_LOG2);
	__u32 w = (h >> 6) + half * (CZ_ROLEHINT_MAX / 2);
	__u64 *v = cz_rolehint.lookup(&w);

	return v && ((*v >> (h & 63)) & 1);
}

/*
 * An addr entry, in both families: the other addresses and the flags. (The full path looks
 * allowed ports up in allow4/allow6, which hold them all; the inline ports are the fast
 * path's.)
 */
struct cz_entry {
	struct ip6 pod; /* CZ_K_LB: the pod IP */
	struct ip6 lb;	/* CZ_K_POD: the LB IP */
	__u32 in_slot;	/* ingress: the Service's svcstats slot */
	__u32 out_slot; /* egress: the Service's svcstats slot */
	__u32 dev;	/* CZ_K_POD: the device its IP is routed to, as last confirmed */
	__u8 kind;	/* CZ_K_* */
	__u8 flags;	/* ingress: CZ_F_* */
	__u8 pod_flags; /* egress: CZ_F_* */
};

/*
 * The same fields are copied twice on purpose: from addr6_val and from addr4_val, two value
 * types with other offsets (4- or 16-byte addresses before them), each read through its own
 * map's value pointer.
 */
static __always_inline int lookup_addr(int v6, const struct ip6 *addr, struct cz_entry *e)
{
	if (v6) {
		struct addr6_val *v = cz_addr6.lookup((struct ip6 *)addr);

		if (!v)
			return 0;
		e->pod = v->pod_ip;
		e->lb = v->lb_ip;
		e->in_slot = v->in_slot;
		e->out_slot = v->out_slot;
		e->dev = v->dev;
		e->kind = v->kind;
		e->flags = v->flags;
		e->pod_flags = v->pod_flags;
	} else {
		__be32 a = addr->a[0];
		struct addr4_val *v = cz_addr4.lookup(&a);

		if (!v)
			return 0;
		cz_ip4_set(&e->pod, v->pod_ip);
		cz_ip4_set(&e->lb, v->lb_ip);
		e->in_slot = v->in_slot;
		e->out_slot = v->out_slot;
		e->dev = v->dev;
		e->kind = v->kind;
		e->flags = v->flags;
		e->pod_flags = v->pod_flags;
	}
	return 1;
}

/* (proto, port) as the 32-bit word struct cz_port holds in memory. */
static __always_inline __u32 cz_port_word(__u8 proto, __be16 port)
{
	return proto | (__u32)port << 16;
}

/* Is (proto, port) allowed for `pod`? (allow4/allow6 hold every allowed port.) */
static __always_inline int is_allowed(int v6, const struct ip6 *pod, __u8 proto, __be16 port)
{
	if (v6) {
		struct allow6_key k = {};

		k.pod_ip = *pod;
		k.proto = proto;
		k.port = port;
		return cz_allow6.lookup(&k) != NULL;
	} else {
		struct allow4_key k = {};

		k.pod_ip = pod->a[0];
		k.proto = proto;
		k.port = port;
		return cz_allow4.lookup(&k) != NULL;
	}
}

/*
 * Is `src` in one of the source ranges of the restricted pod `pod` (CZ_F_RANGES)? One lookup
 * in the LPM trie, whose entries all cover the pod IP whole.
 */
static __always_inline int src_in_range(int v6, const struct ip6 *pod, const struct ip6 *src)
{
	if (v6) {
		struct range6_key k = {.prefixlen = 256};

		k.pod_ip = *pod;
		k.src = *src;
		return cz_range6.lookup(&k) != NULL;
	} else {
		struct range4_key k = {.prefixlen = 64};

		k.pod_ip = pod->a[0];
		k.src = src->a[0];
		return cz_range4.lookup(&k) != NULL;
	}
}

/* The verdict recorded for a fragmented datagram, or NULL. */
static __always_inline struct frag_val *frag_find(struct pkt *p, const struct ip6 *pod)
{
	if (p->v6) {
		struct frag6_key k = {};

		k.remote_ip = p->src;
		k.pod_ip = *pod;
		k.id = p->frag_id;
		k.proto = p->proto;
		return cz_frag6.lookup(&k);
	} else {
		struct frag4_key k = {};

		k.remote_ip = p->src.a[0];
		k.pod_ip = pod->a[0];
		k.id = (__be16)p->frag_id;
		k.proto = p->proto;
		return cz_frag4.lookup(&k);
	}
}

static __always_inline void frag_add(int v6, const struct ip6 *remote, const struct ip6 *pod,
				     __be32 id, __u8 proto, int passed)
{
	struct frag_val v = {};

	v.seen_ns = bpf_ktime_get_ns();
	v.passed = passed;
	if (v6) {
		struct frag6_key k = {};

		k.remote_ip = *remote;
		k.pod_ip = *pod;
		k.id = id;
		k.proto = proto;
		cz_frag6.update(&k, &v);
	} else {
		struct frag4_key k = {};

		k.remote_ip = remote->a[0];
		k.pod_ip = pod->a[0];
		k.id = (__be16)id;
		k.proto = proto;
		cz_frag4.update(&k, &v);
	}
}

#endif
