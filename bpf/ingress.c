// SPDX-License-Identifier: GPL-2.0
/*
 * Ingress, XDP on each uplink device: a packet to a managed LB IP (IPv4 or IPv6) gets
 * destination := pod IP; an ICMP error about the pod's own traffic gets its embedded packet
 * translated too. In port-filter mode the packet must first pass the filter (also when sent to
 * the pod IP directly). Everything else passes untouched. docs/datapath-semantics.md.
 *
 * cz_ingress decides the common frame (fast_xdp4, ingress6); every other frame goes on to
 * cz_ingress_slow by a tail call (lib/tail.h).
 */
#include <uapi/linux/bpf.h>
#include "lib/account.h"
#include "lib/filter.h"
#include "lib/ingress.h"
#include "lib/limit.h"
#include "lib/nat.h"
#include "lib/parse.h"
#include "lib/route.h"
#include "lib/tail.h"

/*
 * XDP, IPv4: the whole fast path in one piece -- decision, counter and rewrite -- with nothing
 * on the stack but map keys, so that the code and data a packet touches stay few cache lines.
 * An XDP verdict, or CZ_SLOW.
 */
static __always_inline int fast_xdp4(struct xdp_md *ctx, void *data, void *data_end,
				     struct iphdr *ip)
{
	struct addr4_val *v = cz_addr4.lookup(&ip->daddr);
	__be16 sport, dport;
	__u32 reason;
	__be32 pod, from;
	__u16 *c;
	__u8 proto, tf = 0;

	if (!v)
		return XDP_PASS;
	if (cz_unlikely(fast_hdrs4(ip, data_end, data_end - data, &sport, &dport, &c, &tf) < 0))
		return CZ_SLOW;
	proto = ip->protocol;
	from = ip->daddr;
	pod = (v->kind & CZ_K_LB) ? v->pod_ip : from;
	reason = CZ_NAT_INGRESS;
	if (v->flags & CZ_F_FLOWS)
		reason = fast_filter(0, v->flags, v->ports, v->nports, (struct ip6 *)&pod,
				     (struct ip6 *)&ip->saddr, proto, sport, dport, tf);
	/* the flood's path: an ending of its own for each drop, every index a constant */
	if (reason == CZ_DROP_PORT) {
		cz_fast_end(ctx, 1, 0, CZ_DROP_PORT, v->in_slot, data_end - data, 0, proto, ip,
			    sport, dport, c, 0, 0, data_end, NULL, 0);
		return XDP_DROP;
	}
	if (reason == CZ_DROP_SOURCE) {
		cz_fast_end(ctx, 1, 0, CZ_DROP_SOURCE, v->in_slot, data_end - data, 0, proto, ip,
			    sport, dport, c, 0, 0, data_end, NULL, 0);
		return XDP_DROP;
	}
	if (cz_unlikely(v->flags & CZ_F_LIMIT) &&
	    cz_over_limit(0, v->in_slot, data_end - data, 1, 0)) {
		cz_fast_end(ctx, 1, 0, CZ_DROP_LIMIT, v->in_slot, data_end - data, 0, proto, ip,
			    sport, dport, c, 0, 0, data_end, NULL, 0);
		return XDP_DROP;
	}
	/* (not an LB IP: sent to the pod IP directly, passed as it is) */
	cz_fast_end_d(ctx, 1, 0, reason, 0, v->in_slot, data_end - data, 0, proto, ip, sport, dport,
		      c, 0, v->kind & CZ_K_LB, data_end, NULL, pod);
	return cz_xdp_pass(ctx);
}

/* A frame the fast path does not take: to the outside program or the full path. */
static __always_inline int ingress_slow(struct xdp_md *ctx, void *data, void *data_end)
{
	if (fast_outside(data, data_end))
		cz_tail_xdp.call(ctx, CZ_OUTSIDE_INGRESS);
	else
		cz_tail_xdp.call(ctx, CZ_SLOW_INGRESS);
	return cz_tail_missed(ctx, 1, 0); /* the loader fills the array before attaching */
}

/* IPv6 (and what is neither): the fast path through struct cz_fast, else the full path. */
static __always_inline int ingress6(struct xdp_md *ctx, void *data, void *data_end)
{
	struct ipv6hdr *ip6 = fast_ip6(data, data_end);
	struct cz_fast f = {};
	struct ip6 to;
	__u32 reason = CZ_SLOW;

	if (ip6)
		reason = fast_ingress6(data, data_end, data_end - data, 1, ip6, &f, &to);
	if (reason == CZ_SLOW)
		return ingress_slow(ctx, data, data_end);
	if (reason == CZ_NOT_OURS)
		return XDP_PASS;
	if (cz_fast_end_f(ctx, 1, 0, reason, &f, data_end - data, data_end, &to))
		return XDP_DROP;
	return cz_xdp_pass(ctx);
}

int cz_ingress(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct iphdr *ip = fast_ip4(data, data_end);
	int verdict;

	if (!ip)
		return ingress6(ctx, data, data_end);
	verdict = fast_xdp4(ctx, data, data_end, ip);
	if (cz_unlikely(verdict == CZ_SLOW))
		return ingress_slow(ctx, data, data_end);
	return verdict;
}

/* Every frame the fast path does not take. */
int cz_ingress_slow(struct xdp_md *ctx)
{
	return ingress_full(ctx, 1, 0);
}

/* A frame from outside the source ranges of a restricted pod. */
int cz_ingress_outside(struct xdp_md *ctx)
{
	return ingress_full(ctx, 1, 1);
}
