/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The end of a full path (ingress.c, ingress_tc.c, egress.c): a packet for a managed address is
 * counted under its reason and for its Service and shown to a running monitor, or, in
 * explain's dry run (dryrun.h), only its decision is recorded; then the verdict.
 *
 * Everything the end needs goes through the per-CPU scratch (parse.h, struct cz_done) and is
 * read back as values the verifier does not follow: the end is then verified once or twice,
 * not once for every way through the parser and the decision (which are many: without this the
 * tc ingress full path took half as many instructions again).
 *
 * At the end, the same for the fast paths (fast_count, fast_monitor): their values are few and
 * their programs small, so they count where they decide; cz_fast_end is the one ending they all
 * take.
 */
#ifndef COZYEBPF_ACCOUNT_H
#define COZYEBPF_ACCOUNT_H

#include "dryrun.h"
#include "flow.h"
#include "limit.h"
#include "lookup.h"
#include "monitor.h"
#include "nat.h"
#include "parse.h"
#include "stats.h"
#include "tc.h"

/* The context's device and dry-run nonce, for XDP (is_xdp, a constant) or tc programs. */
static __always_inline __u32 cz_ctx_ifindex(void *ctx, int is_xdp)
{
	return is_xdp ? ((struct xdp_md *)ctx)->ingress_ifindex
		      : ((struct __sk_buff *)ctx)->ifindex;
}

/* The frame's length: XDP's frame, a tc skb's whole length (paged data too; the programs' reads
 * stay in the linear part). */
static __always_inline __u32 cz_ctx_len(void *ctx, int is_xdp, void *data, void *data_end)
{
	return is_xdp ? data_end - data : ((struct __sk_buff *)ctx)->len;
}

static __always_inline __u64 cz_ctx_nonce(void *ctx, int is_xdp)
{
	return is_xdp ? cz_dry_nonce_xdp(ctx) : cz_dry_nonce_tc(ctx);
}

/* A frame the full path leaves alone: a dry run records that. */
static __always_inline void slow_not_ours(void *ctx, int is_xdp)
{
	if (cz_dry())
		cz_dry_record(cz_ctx_nonce(ctx, is_xdp), CZ_NOT_OURS, 0);
}

/* The verdict of a reason. */
static __always_inline int cz_verdict(int is_xdp, __u32 reason)
{
	if (cz_is_drop(reason))
		return is_xdp ? XDP_DROP : CZ_TC_DROP;
	return is_xdp ? XDP_PASS : CZ_TC_NEXT;
}

/* A first fragment's verdict, for the fragments after it (keyed by the pod IP: the
 * destination's, found again, or the destination itself). */
static __always_inline void done_frag(struct cz_done *d, int passed)
{
	struct cz_entry e = {};
	struct ip6 pod = d->dst;

	if (lookup_addr(d->v6, &d->dst, &e) && (e.kind & CZ_K_LB))
		pod = e.pod;
	frag_add(d->v6, &d->src, &pod, d->frag_id, d->proto, passed);
}

/* The end, on what the scratch holds. */
static __always_inline int slow_end(void *ctx, int is_xdp, int dir, int at_uplink,
				    struct cz_done *d)
{
	__u32 reason = d->reason, slot = d->slot, len = d->len;
	struct mon_ctl *mc;

	/*
	 * Over its Service's limits (limit.h): the full paths' one check, here where the verdict
	 * is known and nothing is recorded yet (inside the decision it cost XDP's full path 40 %
	 * more to verify). A dry run asks without charging. Egress is tc's (ctx an skb); tc
	 * ingress charges a GRO packet its segments, its bytes its length (the fast path counts
	 * the segments' headers: parse.h, fast_wire_len).
	 */
	if (d->limited && !cz_is_drop(reason) &&
	    (dir ? cz_egress_over(ctx, slot, cz_wire_len(ctx), at_uplink, cz_dry())
		 : cz_over_limit(0, slot, len, is_xdp ? 1 : cz_tc_segs(ctx), cz_dry())))
		reason = CZ_DROP_LIMIT;
	if (cz_dry()) {
		cz_dry_record(cz_ctx_nonce(ctx, is_xdp), reason, slot);
		return cz_verdict(is_xdp, reason);
	}
	if (dir && d->flow && !cz_is_drop(reason)) /* (not one the limit refused just now) */
		flow_record(d->v6, &d->src, &d->dst, d->sport, d->dport, d->proto, d->icmp_type,
			    d->tcp_flags, 0);
	if (!dir && d->frag)
		done_frag(d, !cz_is_drop(reason));
	cz_count(reason, len);
	cz_svc_count(slot, reason, dir, len);
	mc = cz_mon_ctl();
	if (mc && mc->mode != CZ_MON_OFF && cz_mon_wants(mc, reason))
		cz_mon_event(mc, cz_ctx_ifindex(ctx, is_xdp), dir, reason, slot, len, d->v6,
			     d->proto, &d->src, &d->dst, d->sport, d->dport);
	return cz_verdict(is_xdp, reason);
}

/*
 * A packet the full path decided (dir 0 ingress, 1 egress: in the uplink's egress if
 * `at_uplink`, a constant), of the Service in `slot`, after its rewrite: count, tell, return the
 * verdict. Its Service's limits apply if `limited`. Egress records the pod's flow first
 * (`flow`), ingress the verdict of a first fragment (cz_done_frag).
 */
static __always_inline int slow_finish(void *ctx, int is_xdp, int dir, int at_uplink, struct pkt *p,
				       __u32 reason, __u32 slot, __u32 len, int flow, int limited)
{
	struct cz_scratch *s = cz_scratch_slot();

	if (!s)
		return cz_verdict(is_xdp, reason);
	s->done.reason = reason;
	s->done.slot = slot;
	s->done.len = len;
	s->done.proto = p->proto;
	s->done.sport = p->sport;
	s->done.dport = p->dport;
	s->done.limited = limited;
	if (dir) { /* egress: src, dst, v6 were stored after the parse (cz_done_addrs) */
		s->done.flow = flow;
		s->done.icmp_type = p->icmp_type;
		s->done.tcp_flags = p->tcp_flags;
	} else { /* ingress: frag, frag_id, pod by cz_done_frag(), for a first fragment */
		s->done.v6 = p->v6;
		s->done.src = p->src;
		s->done.dst = p->dst;
	}
	cz_barrier(); /* read it all back from the map */
	return slow_end(ctx, is_xdp, dir, at_uplink, &s->done);
}

/*
 * A packet a fast path decided: counted under its reason and for its Service (slot; dir 0
 * ingress, 1 egress). The four drops a fast path gives are named here rather than asked of
 * cz_svc_count (cz_is_drop, eight reasons): that cost xdp/port-allowed 2 ns in BPF_PROG_RUN.
 */
static __always_inline void fast_count(int dir, __u32 reason, __u32 slot, __u32 len)
{
	cz_count(reason, len);
	if (reason == CZ_DROP_PORT || reason == CZ_DROP_MALFORMED || reason == CZ_DROP_SOURCE ||
	    reason == CZ_DROP_LIMIT)
		cz_svc_drop(slot, reason);
	else
		cz_svc_pass(slot, dir, len);
}

/*
 * And shown to a running monitor, with its addresses and ports as received (`l3`, before any
 * rewrite). Without a monitor that is one load of the switch.
 */
static __always_inline void fast_monitor(void *ctx, int is_xdp, int dir, __u32 reason, __u32 slot,
					 __u32 len, __u8 v6, __u8 proto, void *l3, __be16 sport,
					 __be16 dport)
{
	struct mon_ctl *mc = cz_mon_ctl();
	__u32 ifindex;

	if (cz_likely(!mc || mc->mode == CZ_MON_OFF) || !cz_mon_wants(mc, reason))
		return;
	ifindex = is_xdp ? ((struct xdp_md *)ctx)->ingress_ifindex
			 : ((struct __sk_buff *)ctx)->ifindex;
	if (v6) {
		struct ipv6hdr *ip6 = l3;

		cz_mon_event(mc, ifindex, dir, reason, slot, len, 1, proto,
			     (struct ip6 *)&ip6->saddr, (struct ip6 *)&ip6->daddr, sport, dport);
	} else {
		struct iphdr *ip = l3;

		cz_mon_event4(mc, ifindex, dir, reason, slot, len, proto, ip->saddr, ip->daddr,
			      sport, dport);
	}
}

/*
 * The fast paths' one ending (XDP and tc ingress, the uplinks' egress and the pod-facing hook,
 * to_lb4), for a frame of `len` bytes decided with `reason` (dir 0 ingress, 1 egress; `slot`,
 * the Service's; `drop`: the decision is a drop), its IP header at `l3` (v6), its protocol and
 * ports, its L4 checksum at `csum` (XDP) or `csum_off` (tc). Two rules order it:
 * - a running monitor sees the frame as received: its addresses and ports before the rewrite;
 * - the frame is counted once its verdict is known, for what happened to it: in XDP at once
 *   (a drop writes nothing, and nat_xdp4 and nat_xdp6 cannot fail); in tc after the monitor,
 *   and a pass after its rewrite (bpf_l4_csum_replace can fail, and then the frame is dropped
 *   and counted malformed instead).
 * XDP: count, monitor, drop, rewrite := *to (IPv4: `to4`). tc: monitor, drop and count, rewrite,
 * count. The order in XDP is also the one its verifier prunes best: monitor first there cost
 * XDP's entry program 2,400 verified instructions more on 6.18, and `is_xdp || drop` below,
 * where 1 would say the same, 1,157 (the compiler shapes the function before it inlines it
 * with is_xdp known; docs/design.md, *One MTU check, one fast ending*).
 * 0: the frame goes on (the caller's pass, host routing, redirect); 1: dropped (and counted).
 * Scalars rather than struct cz_fast: XDP's IPv4 fast path keeps nothing on its stack but map
 * keys (a struct cz_fast there cost its entry 2,700 verified instructions on 6.18).
 */
static __always_inline int cz_fast_end_d(void *ctx, int is_xdp, int dir, __u32 reason, int drop,
					 __u32 slot, __u32 len, __u8 v6, __u8 proto, void *l3,
					 __be16 sport, __be16 dport, __u16 *csum, __u32 csum_off,
					 int rewrite, void *data_end, const struct ip6 *to,
					 __be32 to4)
{
	if (is_xdp) {
		if (is_xdp || drop) /* the verdict is known */
			fast_count(dir, reason, slot, len);
		fast_monitor(ctx, is_xdp, dir, reason, slot, len, v6, proto, l3, sport, dport);
		if (drop)
			return 1;
		if (rewrite && (void *)(csum + 1) <= data_end) {
			if (v6)
				cz_l4_fix(csum, proto, nat_xdp6(l3, to));
			else
				cz_l4_fix(csum, proto,
					  nat_xdp4(l3, ((struct iphdr *)l3)->daddr, to4));
		}
		return 0;
	}
	fast_monitor(ctx, is_xdp, dir, reason, slot, len, v6, proto, l3, sport, dport);
	if (drop) {
		fast_count(dir, reason, slot, len);
		return 1;
	}
	if (rewrite && nat_skb_addr(ctx, l3, data_end, v6, 1, csum_off, proto, !dir, to) < 0) {
		fast_count(dir, CZ_DROP_MALFORMED, slot, len);
		return 1;
	}
	fast_count(dir, reason, slot, len);
	return 0;
}

/* The same, the drop told by the reason (a constant where the caller knows it: the verifier
 * follows the test otherwise) */
static __always_inline int cz_fast_end(void *ctx, int is_xdp, int dir, __u32 reason, __u32 slot,
				       __u32 len, __u8 v6, __u8 proto, void *l3, __be16 sport,
				       __be16 dport, __u16 *csum, __u32 csum_off, int rewrite,
				       void *data_end, const struct ip6 *to, __be32 to4)
{
	return cz_fast_end_d(
		ctx, is_xdp, dir, reason,
		reason == CZ_DROP_PORT || reason == CZ_DROP_SOURCE || reason == CZ_DROP_LIMIT, slot,
		len, v6, proto, l3, sport, dport, csum, csum_off, rewrite, data_end, to, to4);
}

/* The same, for what a fast parse found (struct cz_fast) */
static __always_inline int cz_fast_end_f(void *ctx, int is_xdp, int dir, __u32 reason,
					 struct cz_fast *f, __u32 len, void *data_end,
					 const struct ip6 *to)
{
	return cz_fast_end(ctx, is_xdp, dir, reason, f->slot, len, f->v6, f->proto, f->l3, f->sport,
			   f->dport, f->csum, f->csum_off, f->rewrite, data_end, to, to->a[0]);
}

#endif
