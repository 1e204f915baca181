// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for Cilium 1.19's north-south LB check (bpf_lxc/bpf_host, "wildcard service
 * entry" <LB_IP>:0/ANY): TCP/UDP to LB_IP on a port other than LISTED_PORT is dropped with
 * DROP_NO_SERVICE. Attached like Cilium does: tcx appended at the tail, or a legacy filter.
 * counts[0]: packets to LB_IP seen, [1]: dropped, [2]: passed (listed port or not TCP/UDP).
 */
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>

BPF_ARRAY(counts, __u64, 3);

static __always_inline void bump(__u32 k)
{
	__u64 *v = counts.lookup(&k);

	if (v)
		__sync_fetch_and_add(v, 1);
}

int cilium_like(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	__be16 *ports;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	if (ip->daddr != LB_IP)
		return TC_ACT_UNSPEC;
	bump(0);
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP) {
		bump(2);
		return TC_ACT_UNSPEC;
	}
	ports = (void *)ip + ip->ihl * 4;
	if ((void *)(ports + 2) > data_end)
		return TC_ACT_UNSPEC;
	if (ports[1] == bpf_htons(LISTED_PORT)) {
		bump(2);
		return TC_ACT_UNSPEC;
	}
	bump(1);
	return TC_ACT_SHOT; /* DROP_NO_SERVICE */
}
