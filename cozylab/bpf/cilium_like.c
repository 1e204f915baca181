// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for Cilium's tc programs (bpf_host on a node's uplink, bpf_lxc and bpf_overlay
 * on a Kube-OVN node's ovn0 and tunnel), the one cozylab/cilium.py loads for the cluster lab and
 * the datapath tests. Attached as Cilium attaches: tcx, appended at the tail, or a legacy clsact
 * filter.
 *
 * What it does with a packet to an LB IP (a key of `lbs`) while cfg[0] is 1: Cilium 1.19's
 * north-south check, its "wildcard service entry" <LB_IP>:0/ANY, drops it with
 * DROP_NO_SERVICE unless it is TCP or UDP to the port the LB IP's entry lists (its value; 0:
 * none). With cfg[0] 0 it only counts.
 *
 * counts, per point (an attachment or a group of them, one entry program each):
 * [0] packets to an LB IP, [1] packets from one, [2] dropped.
 *
 * One entry program per point: `cilium_like` is point 0; cozylab/cilium.py appends
 * `cilium_like_<i>` for the points after it and sets NPOINTS.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/in.h>
#include <uapi/linux/pkt_cls.h>

#ifndef NPOINTS
#define NPOINTS 1
#endif

BPF_HASH(lbs, __u32, __u16, 1024);     /* LB IP (network order) -> its listed port, 0: none */
BPF_ARRAY(cfg, __u32, 1);	       /* [0] = 1: drop (the wildcard entry), 0: count only */
BPF_ARRAY(counts, __u64, NPOINTS * 3); /* per point: to an LB IP, from one, dropped */

static __always_inline void bump(__u32 k)
{
	__u64 *v = counts.lookup(&k);

	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline int observe(struct __sk_buff *skb, __u32 point)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	__u32 saddr, daddr, zero = 0;
	__u16 *listed;
	__u32 *drop;
	__be16 *ports;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	saddr = ip->saddr;
	daddr = ip->daddr;
	if (lbs.lookup(&saddr))
		bump(point * 3 + 1);
	listed = lbs.lookup(&daddr);
	if (!listed)
		return TC_ACT_UNSPEC;
	bump(point * 3);
	drop = cfg.lookup(&zero);
	if (!drop || !*drop)
		return TC_ACT_UNSPEC;
	if (*listed && (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP)) {
		ports = (void *)ip + ip->ihl * 4;
		if ((void *)(ports + 2) > data_end)
			return TC_ACT_UNSPEC;
		if (ports[1] == bpf_htons(*listed))
			return TC_ACT_UNSPEC;
	}
	bump(point * 3 + 2);
	return TC_ACT_SHOT; /* DROP_NO_SERVICE */
}

int cilium_like(struct __sk_buff *skb)
{
	return observe(skb, 0);
}
