/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The port filter of the default mode. It keys on the pod IP (as cozy-proxy does), so traffic
 * sent to the pod IP directly is filtered like traffic sent to the LB IP. The verdict is taken
 * before any rewrite, so a dropped packet costs no checksum work.
 */
#ifndef COZYEBPF_FILTER_H
#define COZYEBPF_FILTER_H

#include "flow.h"
#include "maps.h"
#include "parse.h"
#include "stats.h"

/* Returns the cz_reason of the verdict: CZ_PASS_* or CZ_DROP_*. */
static __always_inline __u32 filter4(__be32 pod_ip, __be32 remote_ip, __u8 proto, __u8 flags,
				     struct l4_info *info)
{
	struct allow4_key ak = {};

	if (!info->first_frag)
		return CZ_PASS_FRAGMENT;
	switch (proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		ak.pod_ip = pod_ip;
		ak.proto = proto;
		ak.port = info->dport;
		if (cz_allow4.lookup(&ak))
			return CZ_PASS_PORT;
		if (flow4_is_reply(pod_ip, remote_ip, proto, info))
			return CZ_PASS_REPLY;
		return CZ_DROP_PORT;
	case IPPROTO_ICMP:
		if (flags & CZ_F_ALLOW_ICMP)
			return CZ_PASS_ICMP;
		if (flow4_is_reply(pod_ip, remote_ip, proto, info))
			return CZ_PASS_REPLY;
		return CZ_DROP_ICMP;
	default:
		return CZ_DROP_PROTO;
	}
}

static __always_inline int cz_is_drop(__u32 reason)
{
	switch (reason) {
	case CZ_DROP_PORT:
	case CZ_DROP_ICMP:
	case CZ_DROP_PROTO:
	case CZ_DROP_MALFORMED:
	case CZ_DROP_FRAGMENT:
	case CZ_DROP_FRAG_ORPHAN:
	case CZ_DROP_ICMP_INNER:
		return 1;
	}
	return 0;
}

#endif
