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

#define CZ_SLOW_INGRESS 0    /* cz_tail_xdp: cz_ingress_slow */
#define CZ_SLOW_INGRESS_TC 0 /* cz_tail_tc: cz_ingress_tc_slow */
#define CZ_SLOW_EGRESS 1     /* cz_tail_tc: cz_egress_slow */
#define CZ_SLOW_POD 3	     /* cz_tail_tc: cz_pod_ingress_slow */
/* a full path hands a packet from outside the pod's source ranges on (ingress.h, CZ_OUTSIDE) */
#define CZ_OUTSIDE_INGRESS 1	/* cz_tail_xdp: cz_ingress_outside */
#define CZ_OUTSIDE_INGRESS_TC 2 /* cz_tail_tc: cz_ingress_tc_outside */

/* a prog array holds programs of one type */
BPF_TABLE_PINNED("prog", __u32, __u32, cz_tail_xdp, 4, CZ_PIN_DIR "/tail_xdp");
BPF_TABLE_PINNED("prog", __u32, __u32, cz_tail_tc, 4, CZ_PIN_DIR "/tail_tc");

#endif
