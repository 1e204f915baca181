/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The full paths as programs of their own: an entry program decides the common frame itself
 * (its fast path) and hands every other frame over with a tail call. Each program is verified on
 * its own, so the fast path adds nothing to the full path's verification and neither shapes the
 * other's code. The prog arrays are pinned (a prog array loses its programs when no file
 * descriptor or pin holds it); the loader puts a compilation's full paths in before it returns
 * its entry programs (cozyebpf/datapath/loader.py). Entry and full path of different builds of
 * one layout version may meet while programs are replaced: each decides a frame alone, by the
 * same semantics.
 */
#ifndef COZYEBPF_TAIL_H
#define COZYEBPF_TAIL_H

#include "account.h"

#define CZ_SLOW_INGRESS 0    /* cz_tail_xdp: cz_ingress_slow */
#define CZ_SLOW_INGRESS_TC 0 /* cz_tail_tc: cz_ingress_tc_slow */
#define CZ_SLOW_EGRESS 1     /* cz_tail_tc: cz_egress_slow */
#define CZ_SLOW_POD 3	     /* cz_tail_tc: cz_pod_ingress_slow */
/* a full path hands a packet from outside the pod's source ranges on (ingress.h, CZ_OUTSIDE) */
#define CZ_OUTSIDE_INGRESS 1	/* cz_tail_xdp: cz_ingress_outside */
#define CZ_OUTSIDE_INGRESS_TC 2 /* cz_tail_tc: cz_ingress_tc_outside */

/*
 * The rare paths of the tc entry programs (issue 37): frames an entry decides are not its common
 * frame, but not the full path's either, go on to a program of their own, so that the entry
 * carries its common frame only (docs/design.md, "Rare paths out of the entry programs").
 */
#define CZ_RARE_TO_LB 0 /* cz_tail_rare: cz_egress_to_lb, the node's own packet to an LB IP */
#define CZ_RARE_POD6 1	/* cz_tail_rare: cz_pod_route6, the pod-facing hook's IPv6 route */
/* cz_tail_rare: cz_ingress_tc_route, host routing of what cz_ingress_tc let in (not rare where
 * host routing is on, but a path of its own as behind XDP: cz_route_tc) */
#define CZ_RARE_ROUTE_IN 2
/* cz_tail_rare: cz_ingress_tc6, tc ingress of what is not IPv4 (IPv6's fast path; the rest on to
 * the full path) */
#define CZ_RARE_TC6 3
/* Neither a verdict nor CZ_SLOW: an entry's fast path hands the frame to a rare path */
#define CZ_RARE 0xfffffffd

/* a prog array holds programs of one type */
BPF_TABLE_PINNED("prog", __u32, __u32, cz_tail_xdp, 4, CZ_PIN_DIR "/tail_xdp");
BPF_TABLE_PINNED("prog", __u32, __u32, cz_tail_tc, 4, CZ_PIN_DIR "/tail_tc");
BPF_TABLE_PINNED("prog", __u32, __u32, cz_tail_rare, 4, CZ_PIN_DIR "/tail_rare");

/*
 * After a tail call that failed: the slot was empty (the loader fills every slot before it
 * returns an entry program, so only a prog array emptied by hand, or a bug, gets here). The
 * frame, which the entry program left to the full path undecided, is dropped, as Cilium drops
 * it (DROP_MISSED_TAIL_CALL), never let through untranslated: counted node-wide as
 * CZ_DROP_MISSED_TAIL_CALL (no Service is known here), shown to a running monitor (no addresses:
 * nothing was parsed); a dry run (explain) records it and changes nothing. `dir`: 0 ingress, 1
 * egress (the pod-facing hook too); the program's verdict.
 */
static __always_inline int cz_tail_missed(void *ctx, int is_xdp, int dir)
{
	__u64 nonce = cz_ctx_nonce(ctx, is_xdp);
	struct ip6 none = {};
	struct mon_ctl *mc;
	__u32 len;

	if (nonce) {
		cz_dry_record(nonce, CZ_DROP_MISSED_TAIL_CALL, 0);
		return is_xdp ? XDP_DROP : CZ_TC_DROP;
	}
	len = is_xdp ? ((struct xdp_md *)ctx)->data_end - ((struct xdp_md *)ctx)->data
		     : ((struct __sk_buff *)ctx)->len;
	cz_count(CZ_DROP_MISSED_TAIL_CALL, len);
	mc = cz_mon_ctl();
	if (mc && mc->mode != CZ_MON_OFF && cz_mon_wants(mc, CZ_DROP_MISSED_TAIL_CALL))
		cz_mon_event(mc, cz_ctx_ifindex(ctx, is_xdp), dir, CZ_DROP_MISSED_TAIL_CALL, 0, len,
			     0, 0, &none, &none, 0, 0);
	return is_xdp ? XDP_DROP : CZ_TC_DROP;
}

#endif
