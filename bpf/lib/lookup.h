/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The maps seen through one family-neutral interface: each helper picks the IPv4 or the IPv6
 * map and converts keys and values, so that the decisions in filter.h and ingress.h are written
 * once for both families. The fast paths (fast.h) use the IPv4 and IPv6 values directly.
 */
#ifndef COZYEBPF_LOOKUP_H
#define COZYEBPF_LOOKUP_H

#include "maps.h"
#include "parse.h"

#define CZ_FLOW_REFRESH_NS 1000000000ULL
#define CZ_SEEN_NS 100000000ULL /* how long a seen slot vouches for its flow (types.h) */
#define CZ_FRAG_TIMEOUT_NS 30000000000ULL
#define CZ_FLOWHINT_WORDS (CZ_FLOWHINT_MAX / 2) /* words of one half (types.h) */

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
	__u8 kind;	/* CZ_K_* */
	__u8 flags;	/* ingress: CZ_F_* */
	__u8 pod_flags; /* egress: CZ_F_* */
};

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
 * The flow hint: bit index of a flow, a multiplicative hash of its key (IPv6 addresses folded
 * to 32 bits) on the words as they lie in memory; cozyebpf/datapath/layout.py flow_hint_bit()
 * computes the same.
 */
static __always_inline __u32 cz_fold(int v6, const struct ip6 *a)
{
	return v6 ? a->a[0] ^ a->a[1] ^ a->a[2] ^ a->a[3] : a->a[0];
}

static __always_inline __u32 cz_flow_hash(__u32 pod, __u32 remote, __be16 pod_port,
					  __be16 remote_port, __u8 proto)
{
	__u32 x = pod ^ remote ^ ((__u32)pod_port << 16 | remote_port) ^ proto;

	return (x * 0x9E3779B1u) >> (32 - CZ_FLOWHINT_LOG2);
}

/* May a flow with hint bit `h` exist? (Both halves; 0 means it does not.) */
static __always_inline int flow_hinted(__u32 h)
{
	__u32 w = (h >> 6) * 2, u = (h >> 6) * 2 + 1; /* one cache line */
	__u64 *a = cz_flowhint.lookup(&w);
	__u64 *b = cz_flowhint.lookup(&u);
	__u64 bits = (a ? *a : 0) | (b ? *b : 0);

	return (bits >> (h & 63)) & 1;
}

/* Set bit `h` in the programs' half (atomically: other CPUs set bits in the same word). */
static __always_inline void flow_hint_set(__u32 h)
{
	__u32 w = (h >> 6) * 2;
	__u64 *a = cz_flowhint.lookup(&w);

	if (a)
		__sync_fetch_and_or(a, 1ULL << (h & 63));
}

/*
 * The key of the pod's flow (pod IP, remote IP, pod port, remote port, proto) in its family's
 * layout: *k6 (v6), else *k4. The one key builder of every program.
 */
static __always_inline void flow_key(int v6, struct flow4_key *k4, struct flow6_key *k6,
				     const struct ip6 *pod, const struct ip6 *remote,
				     __be16 pod_port, __be16 remote_port, __u8 proto)
{
	if (v6) {
		__builtin_memset(k6, 0, sizeof(*k6));
		k6->pod_ip = *pod;
		k6->remote_ip = *remote;
		k6->pod_port = pod_port;
		k6->remote_port = remote_port;
		k6->proto = proto;
	} else {
		__builtin_memset(k4, 0, sizeof(*k4));
		k4->pod_ip = pod->a[0];
		k4->remote_ip = remote->a[0];
		k4->pod_port = pod_port;
		k4->remote_port = remote_port;
		k4->proto = proto;
	}
}

/* Where a flow's key is built when only one family's is needed. */
union cz_flow_key {
	struct flow4_key k4;
	struct flow6_key k6;
};

/* A flow of the pod: its entry, or NULL. */
static __always_inline struct flow4_val *flow_find(int v6, const struct ip6 *pod,
						   const struct ip6 *remote, __be16 pod_port,
						   __be16 remote_port, __u8 proto)
{
	union cz_flow_key k;

	flow_key(v6, &k.k4, &k.k6, pod, remote, pod_port, remote_port, proto);
	return v6 ? cz_flow6.lookup(&k.k6) : cz_flow4.lookup(&k.k4);
}

/* 1 if a == b, else 0, without a branch (a, b < 2^32): each branch the verifier follows on the
 * way to a verdict multiplies the states it explores. */
static __always_inline __u64 cz_eq(__u64 a, __u64 b)
{
	return ((a ^ b) - 1) >> 63;
}

/*
 * Does the flow still admit replies: idle for no longer than its protocol's timeout (flowcfg,
 * which user space fills before any program runs; "never" is a timeout of 2^62 ns)? The clock
 * is the one egress records with; a time ahead of it (another CPU, user space) counts as fresh.
 * Without a branch: the index by protocol (UDP 0, ICMP echo 1, TCP and SCTP 2, TCP closing 3)
 * and the comparison are arithmetic.
 */
static __always_inline int flow_fresh(const struct flow4_val *v, __u8 proto, __u64 now)
{
	__u32 zero = 0;
	struct flow_cfg *c = cz_flowcfg.lookup(&zero);
	__u64 last = v->last_seen_ns, tcp, udp, i;
	__s64 age;

	if (!c)
		return 1;
	udp = cz_eq(proto, IPPROTO_UDP);
	tcp = cz_eq(proto, IPPROTO_TCP) | cz_eq(proto, IPPROTO_SCTP);
	i = (1 - udp - tcp) * CZ_TO_ICMP + tcp * (CZ_TO_TCP + (last >> 63));
	age = now - (last & ~CZ_FLOW_CLOSING);
	return 1 ^ (((__u64)(c->timeout_ns[i & 3] - age)) >> 63);
}

/* A flow of the pod that admits replies (flow_fresh). */
static __always_inline int flow_live(int v6, const struct ip6 *pod, const struct ip6 *remote,
				     __be16 pod_port, __be16 remote_port, __u8 proto, __u64 now)
{
	struct flow4_val *v = flow_find(v6, pod, remote, pod_port, remote_port, proto);

	return v && flow_fresh(v, proto, now);
}

/* A reply's flow, looked up only when the hint says it may exist (the fast paths). */
static __always_inline int flow_exists(int v6, const struct ip6 *pod, const struct ip6 *remote,
				       __be16 pod_port, __be16 remote_port, __u8 proto)
{
	__u32 h = cz_flow_hash(cz_fold(v6, pod), cz_fold(v6, remote), pod_port, remote_port, proto);

	return flow_hinted(h) &&
	       flow_live(v6, pod, remote, pod_port, remote_port, proto, bpf_ktime_get_coarse_ns());
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

static __always_inline int src_in_range4(__be32 pod, __be32 src)
{
	struct range4_key k = {.prefixlen = 64, .pod_ip = pod, .src = src};

	return cz_range4.lookup(&k) != NULL;
}

#define CZ_TCP_FIN 0x01
#define CZ_TCP_SYN 0x02
#define CZ_TCP_RST 0x04
#define CZ_TCP_ACK 0x10

/*
 * A packet to a migrating pod (CZ_F_LEARN) that may belong to a flow recorded on another node:
 * TCP that opens no connection (a lone SYN does). It passes, unrecorded (types.h, CZ_F_LEARN).
 */
static __always_inline int cz_learns(__u8 flags, __u8 proto, __u8 tcp_flags)
{
	return (flags & CZ_F_LEARN) && proto == IPPROTO_TCP &&
	       (tcp_flags & (CZ_TCP_SYN | CZ_TCP_ACK)) != CZ_TCP_SYN;
}

/*
 * The value a pod's packet leaves in its flow's entry (`last`: the entry's, 0 for a new one):
 * the time, and the closing mark, which a FIN or RST sets and a SYN (a new connection on the
 * same ports) clears. The entry is written only when this differs from `last` by the mark or
 * by more than a second (CZ_FLOW_REFRESH_NS): flow_stale().
 */
static __always_inline __u64 flow_stamp(__u64 now, __u64 last, __u8 proto, __u8 tcp_flags)
{
	__u64 mark = last & CZ_FLOW_CLOSING;

	if (proto == IPPROTO_TCP) {
		if (tcp_flags & (CZ_TCP_FIN | CZ_TCP_RST))
			mark = CZ_FLOW_CLOSING;
		else if (tcp_flags & CZ_TCP_SYN)
			mark = 0;
	}
	return now | mark;
}

static __always_inline int flow_stale(__u64 stamp, __u64 last)
{
	return ((stamp ^ last) & CZ_FLOW_CLOSING) ||
	       (stamp & ~CZ_FLOW_CLOSING) - (last & ~CZ_FLOW_CLOSING) > CZ_FLOW_REFRESH_NS;
}

static __always_inline int flow_add(int v6, const struct ip6 *pod, const struct ip6 *remote,
				    __be16 pod_port, __be16 remote_port, __u8 proto, __u64 stamp)
{
	struct flow4_val v = {.last_seen_ns = stamp};
	union cz_flow_key k;

	flow_hint_set(
		cz_flow_hash(cz_fold(v6, pod), cz_fold(v6, remote), pod_port, remote_port, proto));
	flow_key(v6, &k.k4, &k.k6, pod, remote, pod_port, remote_port, proto);
	return v6 ? cz_flow6.update(&k.k6, &v) : cz_flow4.update(&k.k4, &v);
}

/*
 * Egress: remember (refresh at most once a second, or when its closing mark changes) a flow
 * the pod opens: TCP, UDP, SCTP by ports, an ICMP or ICMPv6 echo request by its identifier
 * (pod_port; remote_port is then ignored); other ICMP types and protocols are not recorded.
 * flow_new counts a new entry, flow_error an insert that failed.
 */
static __always_inline void flow_record(int v6, const struct ip6 *pod, const struct ip6 *remote,
					__be16 pod_port, __be16 remote_port, __u8 proto,
					__u8 icmp_type, __u8 tcp_flags)
{
	struct flow4_val *v;
	__u64 stamp;

	if (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6) {
		if (icmp_type != (v6 ? ICMPV6_ECHO_REQUEST : ICMP_ECHO))
			return;
		remote_port = 0;
	} else if (proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP) {
		return;
	}
	v = flow_find(v6, pod, remote, pod_port, remote_port, proto);
	if (v) {
		stamp = flow_stamp(bpf_ktime_get_coarse_ns(), v->last_seen_ns, proto, tcp_flags);
		if (flow_stale(stamp, v->last_seen_ns))
			v->last_seen_ns = stamp;
		return;
	}
	stamp = flow_stamp(bpf_ktime_get_coarse_ns(), 0, proto, tcp_flags);
	if (flow_add(v6, pod, remote, pod_port, remote_port, proto, stamp) == 0)
		cz_count(CZ_FLOW_NEW, 0);
	else
		cz_count(CZ_FLOW_ERROR, 0);
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
