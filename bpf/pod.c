// SPDX-License-Identifier: GPL-2.0
/*
 * The pod-facing hook: tcx ingress, placed first, on each --pod-devices device (Kube-OVN's ovn0),
 * so it runs before netfilter: the source check for every managed pod's packet, and source :=
 * LB IP (lib/snat.h) for what leaves the node by an uplink or answers a connection this node
 * opened to the pod's LB IP (lib/pod.h), before the node's masquerade or conntrack see the pod
 * IP. docs/design.md, "On a Cozystack cluster", draws every path.
 *
 * cz_pod_ingress decides the common frame; every other frame goes on to cz_pod_ingress_slow,
 * and a managed pod's IPv6 packet to cz_pod_route6, by tail calls (lib/tail.h).
 */
#include <uapi/linux/bpf.h>
#include "lib/fib.h"
#include "lib/lookup.h"
#include "lib/parse.h"
#include "lib/pod.h"
#include "lib/route.h"
#include "lib/snat.h"
#include "lib/source.h"
#include "lib/tail.h"
#include "lib/tc.h"

/*
 * A managed pod's IPv6 packet at the pod-facing hook (`v`: its source's entry). One the FIB sends
 * out of an uplink, with a hop to go and within the uplink's MTU, is translated here as the
 * uplinks' egress translates it (fast_snat, flow record included), before the node's masquerade
 * (Kube-OVN's natOutgoing, ip6tables) could take it on the way, and with host routing on handed
 * to the uplink (cz_host_route). The FIB is asked every time: IPv6 answers are not cached (as
 * cz_route_in's). Anything else goes on untouched (CZ_TC_NEXT): a packet too big or out of hops
 * gets the stack's answer at the pod's own address, and extension headers and ICMPv6 (fast_snat's
 * CZ_SLOW, before it writes anything) are translated by the uplinks' egress.
 */
static __always_inline int pod_route6(struct __sk_buff *skb, void *data, void *data_end,
				      struct ipv6hdr *ip6, struct addr6_val *v)
{
	struct flow_cfg *c = cz_cfg();
	struct bpf_fib_lookup fib;
	int rc;

	if (!c)
		return CZ_TC_NEXT;
	rc = cz_fib6(skb, &fib, &ip6->saddr, &ip6->daddr, skb->ingress_ifindex);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || !cz_is_uplink(c, fib.ifindex) ||
	    !cz_hr_fits6(skb, ip6, fib.mtu_result))
		return CZ_TC_NEXT;
	rc = fast_snat(skb, data, data_end, ip6, 1, &v->lb_ip, v->out_slot, v->pod_flags, 0);
	if (rc == CZ_SLOW)
		return CZ_TC_NEXT;
	if (rc == CZ_TC_NEXT && (c->flags & CZ_CFG_HOST_ROUTING))
		return cz_host_route(skb, 1, &fib);
	return rc;
}

/* An untagged IPv6 frame from a managed pod: its source's entry (*ip6 its header), or NULL. */
static __always_inline struct addr6_val *pod_source6(void *data, void *data_end,
						     struct ipv6hdr **ip6)
{
	struct addr6_val *v;

	*ip6 = fast_ip6(data, data_end);
	if (!*ip6)
		return NULL;
	v = cz_addr6.lookup((struct ip6 *)&(*ip6)->saddr);
	return v && (v->kind & CZ_K_POD) ? v : NULL;
}

/*
 * The pod-facing hook, IPv6: the source check (cz_spoofed), then what leaves by an uplink is
 * translated (and host-routed: pod_route6); the rest is translated by the uplinks' egress.
 */
static __always_inline int pod_check6(struct __sk_buff *skb, void *data, void *data_end)
{
	struct ipv6hdr *ip6;
	struct addr6_val *v = pod_source6(data, data_end, &ip6);

	if (!v)
		return CZ_TC_NEXT;
	if (cz_unlikely(cz_spoofed(skb, &v->dev, 1, &ip6->saddr, skb->ingress_ifindex)))
		return egress_drop(skb, ip6, 1, v->out_slot, CZ_DROP_SPOOFED);
	return CZ_RARE; /* pod_route6, cz_pod_route6 */
}

/* A managed pod's IPv6 packet at the pod-facing hook, its source checked: pod_route6. */
int cz_pod_route6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6;
	struct addr6_val *v = pod_source6(data, data_end, &ip6);

	if (!v)
		return CZ_TC_NEXT;
	return pod_route6(skb, data, data_end, ip6, v);
}

/*
 * The pod-facing hook: tcx ingress, first, on each --pod-devices device (Kube-OVN's ovn0), so it
 * runs before netfilter. A packet whose source is a managed pod IP and that did not enter from
 * that pod's device is dropped (cz_spoofed; both families). A managed pod's packet that leaves
 * the node by an uplink, or answers a connection this node opened to the pod's LB IP, is
 * translated as egress translates it, flow record included (lib/pod.h, pod_side4);
 * everything else passes untouched. A packet to a managed LB IP ends the device's tc chain here
 * (pod_next4). IPv6 is translated here when it leaves by an uplink and fits (pod_route6), else by
 * the uplinks' egress.
 */
int cz_pod_ingress(struct __sk_buff *skb)
{
	void *data, *data_end;
	struct bpf_fib_lookup fib;
	struct addr4_val *v;
	struct iphdr *ip;
	int rc, next, side;

	cz_tc_pull(skb);
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = fast_ip4(data, data_end);
	if (!ip) {
		rc = pod_check6(skb, data, data_end);
		if (rc != CZ_RARE)
			return rc;
		cz_tail_rare.call(skb, CZ_RARE_POD6);
		return cz_tail_missed(skb, 0, 1); /* the loader fills the arrays before attaching */
	}
	/* a plain pod's packet: two bits of rolehint (types.h), and it goes */
	next = cz_addr4_hinted(ip->daddr, CZ_HINT_LB) ? pod_next4(ip) : CZ_TC_NEXT;
	if (!cz_addr4_hinted(ip->saddr, CZ_HINT_POD))
		return next;
	v = cz_addr4.lookup(&ip->saddr);
	if (!v || !(v->kind & CZ_K_POD))
		return next;
	if (cz_unlikely(cz_spoofed(skb, &v->dev, 0, &ip->saddr, skb->ingress_ifindex)))
		return egress_drop(skb, ip, 0, v->out_slot, CZ_DROP_SPOOFED);
	side = pod_side4(skb, data_end, ip, &fib);
	if (side == CZ_SIDE_NOT)
		return next;
	rc = fast_snat(skb, data, data_end, ip, 0, (struct ip6 *)&v->lb_ip, v->out_slot,
		       v->pod_flags, 0);
	if (rc == CZ_TC_NEXT && side == CZ_SIDE_ROUTED)
		rc = cz_host_route(skb, 0, &fib); /* redirected, or on to the stack */
	if (rc == CZ_TC_NEXT)
		return next;
	if (rc != CZ_SLOW)
		return rc;
	cz_tail_tc.call(skb, CZ_SLOW_POD);
	return cz_tail_missed(skb, 0, 1); /* the loader fills the array before attaching */
}

/* The same for the pod-facing hook. */
int cz_pod_ingress_slow(struct __sk_buff *skb)
{
	return egress_full(skb, 1);
}
