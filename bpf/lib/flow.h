/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The flow table of port-filter mode: egress records the connections a pod opens, ingress lets
 * their replies pass. Stateless apart from this LRU map: no TCP state machine, entries leave by
 * LRU eviction only.
 */
#ifndef COZYEBPF_FLOW_H
#define COZYEBPF_FLOW_H

#include "maps.h"
#include "parse.h"

#define CZ_FLOW_REFRESH_NS 1000000000ULL

/* Build the key; 0 on success, -1 when the packet has nothing to key a flow on. */
static __always_inline int flow4_key_of(struct flow4_key *k, __be32 pod_ip, __be32 remote_ip,
					__u8 proto, struct l4_info *info, int egress)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->pod_ip = pod_ip;
	k->remote_ip = remote_ip;
	k->proto = proto;
	if (!info->has_l4)
		return -1;
	if (proto == IPPROTO_ICMP) {
		/* echo request leaves, echo reply comes back */
		if (info->icmp_type != (egress ? ICMP_ECHO : ICMP_ECHOREPLY))
			return -1;
		k->pod_port = info->sport;
		return 0;
	}
	k->pod_port = egress ? info->sport : info->dport;
	k->remote_port = egress ? info->dport : info->sport;
	return 0;
}

/* Egress: remember (refresh at most once a second) a flow the pod opened. */
static __always_inline void flow4_record(__be32 pod_ip, __be32 remote_ip, __u8 proto,
					 struct l4_info *info)
{
	struct flow4_key k;
	struct flow4_val *v, nv;
	__u64 now;

	if (flow4_key_of(&k, pod_ip, remote_ip, proto, info, 1) < 0)
		return;
	now = bpf_ktime_get_ns();
	v = cz_flow4.lookup(&k);
	if (v) {
		if (now - v->last_seen_ns > CZ_FLOW_REFRESH_NS)
			v->last_seen_ns = now;
		return;
	}
	nv.last_seen_ns = now;
	if (cz_flow4.update(&k, &nv) == 0)
		cz_count(CZ_FLOW_NEW, 0);
	else
		cz_count(CZ_FLOW_ERROR, 0);
}

/* Ingress: is this (already translated) packet a reply to a flow the pod opened? */
static __always_inline int flow4_is_reply(__be32 pod_ip, __be32 remote_ip, __u8 proto,
					  struct l4_info *info)
{
	struct flow4_key k;

	if (flow4_key_of(&k, pod_ip, remote_ip, proto, info, 0) < 0)
		return 0;
	return cz_flow4.lookup(&k) != NULL;
}

#endif
