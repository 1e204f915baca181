/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The ingress decision shared by the XDP program and the tc ingress program: is the packet for
 * a managed address, is it well formed, does it pass the source ranges and the port filter,
 * where does it go.
 */
#ifndef COZYEBPF_INGRESS_H
#define COZYEBPF_INGRESS_H

#include "filter.h"
#include "lookup.h"
#include "parse.h"
#include "stats.h"

/* Neighbour discovery to a pod IP passes untouched, whatever the filter. */
static __always_inline int cz_is_ndp(struct pkt *p)
{
	return p->v6 && p->proto == IPPROTO_ICMPV6 && p->has_l4 && p->icmp_type >= 133 &&
	       p->icmp_type <= 137;
}

/*
 * Returns CZ_NOT_OURS, or the cz_reason of the verdict. On a pass to an LB IP, *pod is the new
 * destination and *rewrite is 1; a pass to a pod IP sent directly has *rewrite 0. *slot is the
 * Service's svcstats slot. `outside` (a constant): the decision of the outside program, for a
 * packet from outside the source ranges of a restricted pod, which the entry program found
 * (fast.h, fast_outside): only replies of the pod's flows and ICMP errors about them pass.
 * For ICMP errors, `in` describes the embedded packet; in->rewrite says
 * its source must change too. A first fragment's verdict in port-filter mode (or from outside
 * the source ranges) is noted for the end of the full path, which records it for the fragments
 * after it (account.h).
 */
static __always_inline __u32 ingress(struct pkt *p, void *data, void *data_end, struct inner *in,
				     struct ip6 *pod, int *rewrite, __u32 *slot, int outside)
{
	struct cz_entry e = {};
	__u32 reason;

	*rewrite = 0;
	if (!lookup_addr(p->v6, &p->dst, &e))
		return CZ_NOT_OURS;
	*slot = e.in_slot;
	if (e.kind & CZ_K_LB) {
		*rewrite = 1;
		*pod = e.pod;
	} else {
		*pod = p->dst;
	}
	if (check_ip(p, data, data_end) != CZ_OK)
		return CZ_DROP_MALFORMED;
	if (cz_is_ndp(p))
		return CZ_NOT_OURS;
	if (p->icmp_error) {
		if (parse_inner(p, data_end, in) < 0)
			return CZ_DROP_ICMP_INNER;
		/* the pod's own packet left as the LB IP: it becomes the pod IP again */
		in->rewrite = *rewrite && cz_ip6_eq(&in->src, &p->dst);
	}
	if (outside) {
		reason = filter(p, in, pod, e.flags, 1);
	} else {
		if (!(e.flags & CZ_F_PORT_FILTER))
			return CZ_NAT_INGRESS;
		reason = filter(p, in, pod, e.flags, 0);
	}
	if (p->first_frag && p->more_frags)
		cz_done_frag(p); /* its verdict is recorded at the end (account.h) */
	return reason;
}

#endif
