/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The ingress decision shared by the XDP program and the tc ingress program: is the packet
 * for a managed address, does it pass the port filter, and which pod IP does it go to.
 */
#ifndef COZYEBPF_INGRESS_H
#define COZYEBPF_INGRESS_H

#include "filter.h"
#include "maps.h"
#include "parse.h"
#include "stats.h"

#define CZ_NOT_OURS 0xffffffff

/*
 * Returns CZ_NOT_OURS, or the cz_reason of the verdict. On a pass to an LB IP, *pod_ip is the
 * new destination and *rewrite is 1; a pass to a pod IP sent directly has *rewrite 0.
 */
static __always_inline __u32 ingress4(struct hdr_cursor *nh, void *data_end, struct iphdr *ip,
				      struct l4_info *info, __be32 *pod_ip, int *rewrite)
{
	__be32 daddr = ip->daddr;
	struct svc4_val *svc = cz_svc4.lookup(&daddr);
	__u8 flags;

	*rewrite = 0;
	if (svc) {
		*pod_ip = svc->pod_ip;
		flags = svc->flags;
		*rewrite = 1;
	} else {
		struct pod4_val *pod = cz_pod4.lookup(&daddr);

		if (!pod)
			return CZ_NOT_OURS;
		*pod_ip = daddr;
		flags = pod->flags;
	}
	if (parse_l4(nh, data_end, ip, info) < 0)
		return CZ_DROP_MALFORMED;
	if (flags & CZ_F_PORT_FILTER)
		return filter4(*pod_ip, ip->saddr, ip->protocol, flags, info);
	return CZ_NAT_INGRESS;
}

#endif
