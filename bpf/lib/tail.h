/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The full paths as programs of their own: an entry program decides the common frame itself
 * (lib/fast.h) and hands every other frame over with a tail call. Each program is verified on
 * its own, so the fast path adds nothing to the full path's verification and neither shapes the
 * other's code. The arrays are the compilation's own (not pinned): the loader fills them before
 * it returns the entry program (cozyebpf/datapath/loader.py), and a program keeps its arrays,
 * so an entry program always reaches the full path it was compiled with.
 */
#ifndef COZYEBPF_TAIL_H
#define COZYEBPF_TAIL_H

#define CZ_SLOW_INGRESS 0    /* cz_slow_xdp: cz_ingress_slow */
#define CZ_SLOW_INGRESS_TC 0 /* cz_slow_tc: cz_ingress_tc_slow */
#define CZ_SLOW_EGRESS 1     /* cz_slow_tc: cz_egress_slow */

BPF_PROG_ARRAY(cz_slow_xdp, 1); /* a prog array holds programs of one type */
BPF_PROG_ARRAY(cz_slow_tc, 2);

#endif
