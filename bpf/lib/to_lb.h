/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The node's own packets to a managed LB IP whose pod sits behind a pod-facing device (uplink
 * egress, to_lb4): decided as ingress decides them and handed to that device, translated.
 */
#ifndef COZYEBPF_TO_LB_H
#define COZYEBPF_TO_LB_H

#include "account.h"
#include "fib.h"
#include "flow.h"
#include "frag_needed.h"
#include "ingress.h"
#include "nat.h"
#include "route.h"
#include "tc.h"

/*
 * Uplink egress, IPv4, a packet whose source is no managed pod IP. To a managed LB IP from a
 * client of this node -- its own address (a process of the node, or a pod the node masqueraded)
 * or a pod behind a pod-facing device -- whose pod sits behind a pod-facing device, it takes the
 * ingress decision here and, let in, is translated and handed to that device (TC_ACT_REDIRECT):
 * through the ToR it would come back with a local source, a martian, or its answer would go to
 * the client pod directly, never translated; across nodes the overlay carries it as it carries
 * the answer. Its connection is recorded as a flow of the pod, keyed as the pod's answer will
 * be, for pod_side4. A VM's packet (its source an LB IP: the FIB routes that by the uplink)
 * goes by the ToR to the node of the other LB IP, which holds the flows of that pod; every
 * other packet goes on too: CZ_TC_NEXT.
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
	int rc, too_big, drop;

	if (!c || !(c->flags & CZ_CFG_POD_DEVICES))
		return CZ_TC_NEXT;
	d = cz_addr4.lookup(&ip->daddr);
	if (!d || !(d->kind & CZ_K_LB))
		return CZ_TC_NEXT;
	pod.a[0] = d->pod_ip;
	client.a[0] = ip->saddr;
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
	reason = fast_ingress(data, data_end, skb->len, cz_tc_segs(skb), &f, &to);
	if (reason == CZ_SLOW || reason == CZ_NOT_OURS)
		return CZ_TC_NEXT;
	/* the filter's drops and the limit's (fast_ingress charged the Service's buckets) */
	drop = reason == CZ_DROP_PORT || reason == CZ_DROP_SOURCE || reason == CZ_DROP_LIMIT;
	/*
	 * Larger than the pod's device (Kube-OVN's ovn0 under a larger uplink; the device would
	 * drop it, the ToR bring it back as a martian): the node is told the path's MTU, as the
	 * stack tells it when a route's device is too small. Nothing is recorded, translated,
	 * counted or shown to a monitor (which shows a frame under the reason it is counted
	 * under); only a packet its limit let in is answered (its buckets were charged by the
	 * decision: the node's sender pays for what it sent). (No TTL here: the node sent it, or
	 * forwarded it already, and counted that hop then.)
	 */
	if (!drop && (too_big || cz_too_big(skb, skb->len - sizeof(struct ethhdr), fib.mtu_result)))
		return cz_frag_needed4(skb, ip->daddr, fib.mtu_result);
	/* only what the pod's filter and its Service's limit let in: the flow admits what the
	 * client sends as well (a refused packet recorded one: a tenant could write flow entries
	 * at any rate by flooding another's limited LB IP) */
	if (!drop)
		flow_record(0, &pod, &client, f.dport, f.sport, f.proto, 0, f.tcp_flags, 1);
	if (cz_fast_end_f(skb, 0, 0, reason, &f, skb->len, data_end, &to))
		return CZ_TC_DROP;
	nh.nh_family = CZ_AF_INET;
	nh.ipv4_nh = fib.ipv4_dst; /* the FIB's next hop for the pod IP */
	return cz_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
}

#endif
