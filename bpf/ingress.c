// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress, XDP on each uplink device: a packet to a managed LB IP gets destination := pod IP.
 * In port-filter mode the packet must first pass filter4() (also when sent to the pod IP
 * directly). Everything else passes untouched.
 */
#include <uapi/linux/bpf.h>
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/nat.h"
#include "lib/filter.h"

int cz_ingress(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 bytes = data_end - data;
	struct hdr_cursor nh = {.pos = data};
	struct l4_info info = {};
	struct ethhdr *eth;
	struct iphdr *ip;
	struct svc4_val *svc;
	__be32 daddr, pod_ip;
	__u32 reason;
	__u8 flags;
	int proto;

	if (parse_ethhdr(&nh, data_end, &eth) != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	proto = parse_iphdr(&nh, data_end, &ip);
	if (proto < 0)
		return XDP_PASS;

	daddr = ip->daddr;
	svc = cz_svc4.lookup(&daddr);
	if (svc) {
		pod_ip = svc->pod_ip;
		flags = svc->flags;
	} else {
		struct pod4_val *pod = cz_pod4.lookup(&daddr);

		if (!pod)
			return XDP_PASS;
		pod_ip = daddr;
		flags = pod->flags;
	}

	if (parse_l4(&nh, data_end, ip, &info) < 0) {
		cz_count(CZ_DROP_MALFORMED, bytes);
		return XDP_DROP;
	}
	reason = CZ_NAT_INGRESS;
	if (flags & CZ_F_PORT_FILTER) {
		reason = filter4(pod_ip, ip->saddr, proto, flags, &info);
		if (cz_is_drop(reason)) {
			cz_count(reason, bytes);
			return XDP_DROP;
		}
	}
	if (svc)
		nat4_xdp(ip, &info, data_end, 1, pod_ip);
	cz_count(reason, bytes);
	return XDP_PASS;
}
