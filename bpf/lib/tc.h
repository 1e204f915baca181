/* SPDX-License-Identifier: GPL-2.0 */
/* What the tc programs share: return codes and making the headers linear. */
#ifndef COZYEBPF_TC_H
#define COZYEBPF_TC_H

#include <uapi/linux/if_ether.h>
#include <uapi/linux/pkt_cls.h>

#define CZ_TC_NEXT -1	/* TCX_NEXT; TC_ACT_UNSPEC for a legacy cls_bpf filter: the next runs */
#define CZ_TC_DROP 2	/* TCX_DROP == TC_ACT_SHOT */
#define CZ_TC_PASS 0	/* TCX_PASS == TC_ACT_OK: the programs after ours on this hook do not run */
#define CZ_PULL_LEN 256 /* tags, IP (+ extension headers), L4, an ICMP error's inner headers */

/* Headers in paged data (GRO, some drivers): make the first bytes linear. */
static __always_inline void cz_tc_pull(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (data + CZ_PULL_LEN > data_end && skb->len > data_end - data)
		bpf_skb_pull_data(skb, skb->len < CZ_PULL_LEN ? skb->len : CZ_PULL_LEN);
}

/* The packets an skb carries: a GSO (GRO) packet's segments, else 1. */
static __always_inline __u32 cz_tc_segs(struct __sk_buff *skb)
{
	return skb->gso_segs > 1 ? skb->gso_segs : 1;
}

#endif
