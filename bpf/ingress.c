// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress, XDP on each uplink device: a packet to a managed LB IP gets destination := pod IP.
 * In port-filter mode the packet must first pass filter4() (also when sent to the pod IP
 * directly). Everything else passes untouched.
 */
#include <uapi/linux/bpf.h>
#include "lib/ingress.h"
#include "lib/nat.h"

int cz_ingress(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = {.pos = data};
	struct l4_info info = {};
	struct ethhdr *eth;
	struct iphdr *ip;
	__be32 pod_ip = 0;
	int rewrite;
	__u32 reason;

	if (parse_ethhdr(&nh, data_end, &eth) != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	if (parse_iphdr(&nh, data_end, &ip) < 0)
		return XDP_PASS;
	reason = ingress4(&nh, data_end, ip, &info, &pod_ip, &rewrite);
	if (reason == CZ_NOT_OURS)
		return XDP_PASS;
	cz_count(reason, data_end - data);
	if (cz_is_drop(reason))
		return XDP_DROP;
	if (rewrite)
		nat4_xdp(ip, &info, data_end, 1, pod_ip);
	return XDP_PASS;
}
