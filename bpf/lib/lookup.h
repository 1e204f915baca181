/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The maps seen through one family-neutral interface: each helper picks the IPv4 or the IPv6
 * map and converts keys and values, so that the decisions in filter.h and ingress.h are written
 * once for both families.
 */
#ifndef COZYEBPF_LOOKUP_H
#define COZYEBPF_LOOKUP_H

#include "maps.h"
#include "parse.h"

#define CZ_FLOW_REFRESH_NS 1000000000ULL
#define CZ_FRAG_TIMEOUT_NS 30000000000ULL

/* An svc or pod entry: the other address and the flags. */
struct cz_entry {
	struct ip6 ip;
	__u8 flags;
};

static __always_inline int lookup_svc(int v6, const struct ip6 *addr, struct cz_entry *e)
{
	if (v6) {
		struct svc6_val *s = cz_svc6.lookup((struct ip6 *)addr);

		if (!s)
			return 0;
		e->ip = s->pod_ip;
		e->flags = s->flags;
	} else {
		__be32 a = addr->a[0];
		struct svc4_val *s = cz_svc4.lookup(&a);

		if (!s)
			return 0;
		cz_ip4_set(&e->ip, s->pod_ip);
		e->flags = s->flags;
	}
	return 1;
}

static __always_inline int lookup_pod(int v6, const struct ip6 *addr, struct cz_entry *e)
{
	if (v6) {
		struct pod6_val *s = cz_pod6.lookup((struct ip6 *)addr);

		if (!s)
			return 0;
		e->ip = s->lb_ip;
		e->flags = s->flags;
	} else {
		__be32 a = addr->a[0];
		struct pod4_val *s = cz_pod4.lookup(&a);

		if (!s)
			return 0;
		cz_ip4_set(&e->ip, s->lb_ip);
		e->flags = s->flags;
	}
	return 1;
}

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

/* A flow of the pod: (pod IP, remote IP, pod port, remote port, proto). */
static __always_inline struct flow4_val *flow_find(int v6, const struct ip6 *pod,
						   const struct ip6 *remote, __be16 pod_port,
						   __be16 remote_port, __u8 proto)
{
	if (v6) {
		struct flow6_key k = {};

		k.pod_ip = *pod;
		k.remote_ip = *remote;
		k.pod_port = pod_port;
		k.remote_port = remote_port;
		k.proto = proto;
		return cz_flow6.lookup(&k);
	} else {
		struct flow4_key k = {};

		k.pod_ip = pod->a[0];
		k.remote_ip = remote->a[0];
		k.pod_port = pod_port;
		k.remote_port = remote_port;
		k.proto = proto;
		return cz_flow4.lookup(&k);
	}
}

static __always_inline int flow_add(int v6, const struct ip6 *pod, const struct ip6 *remote,
				    __be16 pod_port, __be16 remote_port, __u8 proto, __u64 now)
{
	struct flow4_val v = {.last_seen_ns = now};

	if (v6) {
		struct flow6_key k = {};

		k.pod_ip = *pod;
		k.remote_ip = *remote;
		k.pod_port = pod_port;
		k.remote_port = remote_port;
		k.proto = proto;
		return cz_flow6.update(&k, &v);
	} else {
		struct flow4_key k = {};

		k.pod_ip = pod->a[0];
		k.remote_ip = remote->a[0];
		k.pod_port = pod_port;
		k.remote_port = remote_port;
		k.proto = proto;
		return cz_flow4.update(&k, &v);
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

static __always_inline void frag_add(struct pkt *p, const struct ip6 *pod, int passed)
{
	struct frag_val v = {};

	v.seen_ns = bpf_ktime_get_ns();
	v.passed = passed;
	if (p->v6) {
		struct frag6_key k = {};

		k.remote_ip = p->src;
		k.pod_ip = *pod;
		k.id = p->frag_id;
		k.proto = p->proto;
		cz_frag6.update(&k, &v);
	} else {
		struct frag4_key k = {};

		k.remote_ip = p->src.a[0];
		k.pod_ip = pod->a[0];
		k.id = (__be16)p->frag_id;
		k.proto = p->proto;
		cz_frag4.update(&k, &v);
	}
}

#endif
