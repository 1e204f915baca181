// SPDX-License-Identifier: GPL-2.0
/*
 * The benchmark's cz_egress without the source check (bench/progrun.py's nospoof/ rows and
 * spoof_check's "nocheck", bench/datapath.py's cz-xdp-nospoof): bpf/egress.c as shipped, with
 * cz_src_unsure (bpf/lib/source.h) answering "sure" for every packet, so no packet takes the
 * FIB's way. bench/variant.py builds it: a function defined again below replaces the product's
 * of the same name, in its place.
 */
#include "../../../bpf/egress.c"

static __always_inline int cz_src_unsure(__u32 dev, __u32 in)
{
	return 0;
}
