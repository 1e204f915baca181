/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The pods' flows (types.h, flow4/flow6): the flow hint before any lookup, the key, whether a
 * flow still admits replies, the per-CPU seen slots that spare the fast paths most lookups
 * (seen4/seen6), and the record egress leaves of a flow the pod opens.
 */
#ifndef COZYEBPF_FLOW_H
#define COZYEBPF_FLOW_H

#include "maps.h"
#include "parse.h"
#include "stats.h"

#define CZ_FLOW_REFRESH_NS 1000000000ULL
#define CZ_SEEN_NS 100000000ULL /* how long a seen slot vouches for its flow (types.h) */
#define CZ_FLOWHINT_WORDS (CZ_FLOWHINT_MAX / 2) /* words of one half (types.h) */

/*
 * The flow hint: bit index of a flow, a multiplicative hash of its key (IPv6 addresses folded
 * to 32 bits) on the words as they lie in memory; cozyebpf/datapath/layout.py flow_hint_bit()
 * computes the same.
 */
static __always_inline __u32 cz_fold(int v6, const struct ip6 *a)
{
	return v6 ? a->a[0] ^ a->a[1] ^ a->a[2] ^ a->a[3] : a->a[0];
}

static __always_inline __u32 cz_flow_hash(int v6, const struct ip6 *pod, const struct ip6 *remote,
					  __be16 pod_port, __be16 remote_port, __u8 proto)
{
	__u32 x = cz_fold(v6, pod) ^ cz_fold(v6, remote) ^ ((__u32)pod_port << 16 | remote_port) ^
		  proto;

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

/* Are the `n` 32-bit words at a and b the same? */
static __always_inline int fast_words_eq(const void *a, const void *b, int n)
{
	const __u32 *x = a, *y = b;
	int i;

	for (i = 0; i < n; i++) {
		if (x[i] != y[i])
			return 0;
	}
	return 1;
}

/*
 * A flow of the fast paths and this CPU's seen slot for it (types.h, seen4/seen6): the key of
 * its family (the other is left unset), the slot, and whether the slot vouches for this flow
 * (holds it, looked up under CZ_SEEN_NS ago) with which time. Both families in one place, so
 * that egress (flow_record) and replies (flow_reply) read and fill the slots alike. Both keys,
 * not a union of them: with a union here the egress entry took up to 6,487 more to verify.
 */
struct fast_seen {
	struct flow4_key k4;
	struct flow6_key k6;
	struct flow4_seen *s4;
	struct flow6_seen *s6;
	__u64 time; /* the slot's: the entry's time when it was looked up */
	int holds;  /* the slot is this flow's, looked up under CZ_SEEN_NS ago */
};

/* Fill `fs` (its key built: flow_key) for the flow whose hint hash is `h`: 0, or -1 (never: the
 * index is masked). */
static __always_inline int fast_seen_get(struct fast_seen *fs, int v6, __u32 h, __u64 now)
{
	__u32 i = h & (CZ_SEEN_MAX - 1);

	if (v6) {
		fs->s6 = cz_seen6.lookup(&i);
		if (!fs->s6)
			return -1;
		fs->time = fs->s6->time;
		fs->holds = now - fs->s6->checked <= CZ_SEEN_NS &&
			    fast_words_eq(&fs->s6->key, &fs->k6, sizeof(fs->k6) / 4);
	} else {
		fs->s4 = cz_seen4.lookup(&i);
		if (!fs->s4)
			return -1;
		fs->time = fs->s4->time;
		fs->holds = now - fs->s4->checked <= CZ_SEEN_NS &&
			    fast_words_eq(&fs->s4->key, &fs->k4, sizeof(fs->k4) / 4);
	}
	return 0;
}

/* The flow's entry in the flow table, or NULL. */
static __always_inline struct flow4_val *fast_seen_entry(struct fast_seen *fs, int v6)
{
	return v6 ? cz_flow6.lookup(&fs->k6) : cz_flow4.lookup(&fs->k4);
}

/* The slot takes the flow, the time its entry holds (`last`, the mark dropped) and now. */
static __always_inline void fast_seen_put(struct fast_seen *fs, int v6, __u64 last, __u64 now)
{
	if (v6) {
		fs->s6->key = fs->k6;
		fs->s6->time = last & ~CZ_FLOW_CLOSING;
		fs->s6->checked = now;
	} else {
		fs->s4->key = fs->k4;
		fs->s4->time = last & ~CZ_FLOW_CLOSING;
		fs->s4->checked = now;
	}
}

/*
 * Does a flow of the pod admit this reply (flow_fresh)? Looked up only when the hint says it may
 * exist. `seen` (a constant; the ingress fast paths): first in this CPU's seen slot (types.h,
 * seen4/seen6): a slot that holds the flow, looked up under CZ_SEEN_NS ago, whose time is fresh
 * for the protocol whatever the closing mark (both timeouts), answers yes without a flow-table
 * lookup -- the entry's time is at least the slot's, so the entry is fresh too. Otherwise the
 * entry is looked up, and a fresh one leaves the flow, its time and now in the slot. The only
 * difference to a lookup per reply: an entry the LRU evicts from under a busy flow admits its
 * replies for at most CZ_SEEN_NS more. Without `seen` (the pod-facing hook, pod.h): the
 * entry, every time.
 */
static __always_inline int flow_reply(int v6, const struct ip6 *pod, const struct ip6 *remote,
				      __be16 pod_port, __be16 remote_port, __u8 proto, int seen)
{
	__u32 h = cz_flow_hash(v6, pod, remote, pod_port, remote_port, proto);
	struct fast_seen fs;
	struct flow4_val *v, t;
	__u64 now;

	if (!flow_hinted(h))
		return 0;
	now = bpf_ktime_get_coarse_ns();
	if (!seen)
		return flow_live(v6, pod, remote, pod_port, remote_port, proto, now);
	flow_key(v6, &fs.k4, &fs.k6, pod, remote, pod_port, remote_port, proto);
	if (fast_seen_get(&fs, v6, h, now) < 0)
		return 0;
	if (fs.holds) {
		t.last_seen_ns = fs.time;
		if (flow_fresh(&t, proto, now)) {
			t.last_seen_ns |= CZ_FLOW_CLOSING;
			if (flow_fresh(&t, proto, now))
				return 1;
		}
		/* fresh for one timeout only, or not at all: the entry says */
		v = fast_seen_entry(&fs, v6);
		return v && flow_fresh(v, proto, now);
	}
	v = fast_seen_entry(&fs, v6);
	if (!v || !flow_fresh(v, proto, now))
		return 0;
	fast_seen_put(&fs, v6, v->last_seen_ns, now);
	return 1;
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

/*
 * Egress: remember (refresh at most once a second, or when its closing mark changes) a flow the
 * pod opens: TCP, UDP, SCTP by ports, an ICMP or ICMPv6 echo request by its identifier
 * (pod_port; remote_port is then ignored); other ICMP types and protocols are not recorded.
 * flow_new counts a new entry, flow_error an insert that failed. The flow's bit in the flow hint
 * is set before the entry is added.
 *
 * `seen` (a constant; the fast paths, TCP and UDP only): without a flow-table lookup for most
 * packets. A packet without a TCP FIN, SYN or RST (which may change the mark) whose flow sits in
 * this CPU's seen slot (types.h, seen4/seen6), checked under CZ_SEEN_NS ago with a time under a
 * second old, would write nothing: the entry's time is at least the slot's, so flow_stale() is
 * false. Every other packet looks its entry up, refreshes or adds it, and leaves the flow, the
 * entry's time and now in the slot (an insert that failed leaves nothing). The only difference
 * to a lookup per packet: an entry the LRU evicts from under a busy flow is added again within
 * CZ_SEEN_NS, not at the flow's next packet.
 */
static __always_inline void flow_record(int v6, const struct ip6 *pod, const struct ip6 *remote,
					__be16 pod_port, __be16 remote_port, __u8 proto,
					__u8 icmp_type, __u8 tcp_flags, int seen)
{
	__u64 now = bpf_ktime_get_coarse_ns(), stamp;
	int marks = proto == IPPROTO_TCP && (tcp_flags & (CZ_TCP_FIN | CZ_TCP_SYN | CZ_TCP_RST));
	struct fast_seen fs;
	struct flow4_val *v, nv = {};
	int ret;

	/* (the fast paths take TCP and UDP only) */
	if (!seen && (proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6)) {
		if (icmp_type != (v6 ? ICMPV6_ECHO_REQUEST : ICMP_ECHO))
			return;
		remote_port = 0;
	} else if (!seen && proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP) {
		return;
	}
	flow_key(v6, &fs.k4, &fs.k6, pod, remote, pod_port, remote_port, proto);
	if (seen) {
		if (fast_seen_get(&fs, v6,
				  cz_flow_hash(v6, pod, remote, pod_port, remote_port, proto),
				  now) < 0)
			return;
		if (!marks && fs.holds && now - fs.time <= CZ_FLOW_REFRESH_NS)
			return;
	}
	v = fast_seen_entry(&fs, v6);
	if (v) {
		stamp = flow_stamp(now, v->last_seen_ns, proto, tcp_flags);
		if (flow_stale(stamp, v->last_seen_ns))
			v->last_seen_ns = stamp;
		else
			stamp = v->last_seen_ns;
	} else {
		stamp = flow_stamp(now, 0, proto, tcp_flags);
		nv.last_seen_ns = stamp;
		flow_hint_set(cz_flow_hash(v6, pod, remote, pod_port, remote_port, proto));
		ret = v6 ? cz_flow6.update(&fs.k6, &nv) : cz_flow4.update(&fs.k4, &nv);
		cz_count(ret == 0 ? CZ_FLOW_NEW : CZ_FLOW_ERROR, 0);
		if (ret != 0)
			return;
	}
	if (seen)
		fast_seen_put(&fs, v6, stamp, now);
}

#endif
