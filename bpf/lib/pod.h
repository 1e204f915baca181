/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The pod-facing hook's IPv4 decision (pod_side4) and its verdict for what it lets through
 * (pod_next4). On a node whose pods reach it through pod-facing devices (Kube-OVN's ovn0, per-pod
 * veths), a managed pod's packet that leaves by an uplink is translated at that device, so the
 * node's masquerade (Kube-OVN's natOutgoing) never sees the pod IP; and a managed pod's answer to
 * a connection that this node opened to its LB IP (to_lb.h), which the overlay brings back with
 * the pod IP as source (cozy-proxy PR #18), gets its LB IP back before conntrack looks at it.
 * Everything else -- pod to pod, a pod's own connection to a node -- is left as the CNI has it.
 * IPv4 only (Kube-OVN as Cozystack runs it has no IPv6); nothing of this runs unless flowcfg says
 * pod-facing hooks are attached.
 */
#ifndef COZYEBPF_POD_H
#define COZYEBPF_POD_H

#include "fib.h"
#include "flow.h"
#include "ingress.h"
#include "tc.h"

#define CZ_SIDE_NOT 0	 /* not for the pod-facing hook to translate */
#define CZ_SIDE_NAT 1	 /* to translate, then on to the stack */
#define CZ_SIDE_ROUTED 2 /* to translate, then cz_host_route with the FIB's answer */

/*
 * The pod-facing hook, IPv4: is this packet, whose source is a managed pod IP and which entered
 * from that pod's device (cz_spoofed), one to translate as egress does? Yes when it leaves the
 * node by an uplink (the pod's own traffic out of the cluster), or it answers a
 * connection that to_lb4 translated to the pod's LB IP on this node (a flow it recorded): one this
 * node opened, the answer then for this node, or one of a pod on another pod-facing device of this
 * node. CZ_SIDE_*: CZ_SIDE_ROUTED when host routing is on and the FIB gave the uplink as the
 * route (in *fib); one too big for the uplink (BPF_FIB_LKUP_RET_FRAG_NEEDED) is translated and left
 * to the stack, which answers it as for any forwarded packet.
 */
static __always_inline int pod_side4(struct __sk_buff *skb, void *data_end, struct iphdr *ip,
				     struct bpf_fib_lookup *fib)
{
	struct flow_cfg *c;
	__be16 sport, dport;
	__u16 *csum;
	__u8 tf = 0;
	int rc;

	c = cz_cfg();
	if (!c)
		return CZ_SIDE_NOT;
	rc = cz_fib4_cached(skb, fib, c, ip->saddr, ip->daddr, skb->ingress_ifindex);
	if ((cz_fib_forwards(rc) || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) &&
	    cz_is_uplink(c, fib->ifindex))
		return rc == BPF_FIB_LKUP_RET_SUCCESS && (c->flags & CZ_CFG_HOST_ROUTING)
			       ? CZ_SIDE_ROUTED
			       : CZ_SIDE_NAT;
	if (!cz_fib_forwards(rc) && rc != BPF_FIB_LKUP_RET_NOT_FWDED)
		return CZ_SIDE_NOT; /* unreachable, blackhole, forwarding off: the kernel decides */
	/* to this node, or to another pod-facing device (a pod on this node) */
	if (fast_hdrs4(ip, data_end, skb->len, &sport, &dport, &csum, &tf) < 0)
		return CZ_SIDE_NOT;
	return flow_reply(0, (struct ip6 *)&ip->saddr, (struct ip6 *)&ip->daddr, sport, dport,
			  ip->protocol, 0)
		       ? CZ_SIDE_NAT
		       : CZ_SIDE_NOT;
}

/*
 * The pod-facing hook's verdict for a packet it lets through: one to a managed LB IP ends the
 * device's tc chain (CZ_TC_PASS), so that the programs after ours there (Cilium's, whose
 * wildcard entry for an LB IP it handles drops unlisted ports) never see an LB IP. Such a packet
 * reaches its pod by the ToR or by to_lb4's redirect, translated, and those programs see the pod
 * IP on the way in. Everything else goes on to them (CZ_TC_NEXT).
 */
static __always_inline int pod_next4(struct iphdr *ip)
{
	struct addr4_val *d = cz_addr4.lookup(&ip->daddr);

	return d && (d->kind & CZ_K_LB) ? CZ_TC_PASS : CZ_TC_NEXT;
}

#endif
