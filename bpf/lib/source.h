/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A pod speaks only for itself (docs/design.md): is a packet with a managed pod IP as its
 * source from the device the node routes that IP to?
 */
#ifndef COZYEBPF_SOURCE_H
#define COZYEBPF_SOURCE_H

#include "fib.h"
#include "maps.h"

/*
 * Source verification (docs/design.md, "A pod speaks only for itself"): may a packet whose source
 * is the managed pod IP `src` (v6: 16 bytes, else 4), entering the node by device `in`, speak for
 * that pod? Yes when `in` is the device the node routes that IP to -- the kernel's reverse path,
 * as strict rp_filter asks it: the FIB's route to the pod IP, looked up as from `in`, leaves by
 * `in` (cz_routed_by) -- and when `in` is 0 (tc egress of a packet the node itself sent). The
 * answer is cached in the pod's address value (`dev`): a packet from the cached device costs one
 * compare (cz_src_unsure); one from any other asks the FIB, and a confirmed device replaces the
 * cache (a VM that migrated here, a re-created veth). Behind a device that carries every pod
 * (Kube-OVN's ovn0) every pod passes: only the CNI can tell its pods apart there.
 */
static __always_inline int cz_routed_by(struct __sk_buff *skb, int v6, const void *src, __u32 in)
{
	struct bpf_fib_lookup fib;
	int rc;

	cz_fib_rev(&fib, v6, src, in);
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), CZ_FIB_SKIP_NEIGH);
	if (rc < 0) { /* a kernel before 6.5: without BPF_FIB_LOOKUP_SKIP_NEIGH */
		cz_fib_rev(&fib, v6, src, in);
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	}
	return cz_fib_forwards(rc) && fib.ifindex == in;
}

/* Not from the cached device, nor the node's own: the FIB must be asked. */
static __always_inline int cz_src_unsure(__u32 dev, __u32 in)
{
	return dev != in && in;
}

/* Cache `in` as the device of the pod IP `addr` (the full path, which holds a copy). */
static __always_inline void cz_dev_set(int v6, const struct ip6 *addr, __u32 in)
{
	if (v6) {
		struct addr6_val *v = cz_addr6.lookup((struct ip6 *)addr);

		if (v)
			v->dev = in;
	} else {
		__be32 a = addr->a[0];
		struct addr4_val *v = cz_addr4.lookup(&a);

		if (v)
			v->dev = in;
	}
}

/* The whole check where the value is at hand (the pod-facing hook): 1, spoofed. */
static __always_inline int cz_spoofed(struct __sk_buff *skb, __u32 *dev, int v6, const void *src,
				      __u32 in)
{
	if (cz_likely(!cz_src_unsure(*dev, in)))
		return 0;
	if (!cz_routed_by(skb, v6, src, in))
		return 1;
	*dev = in;
	return 0;
}

#endif
