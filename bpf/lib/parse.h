/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Cursor-style parsing shared by the XDP and TC programs: each parse_*() checks bounds against
 * data_end, moves the cursor past its header and returns the next protocol, or -1.
 */
#ifndef COZYEBPF_PARSE_H
#define COZYEBPF_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/icmp.h>

#define CZ_IP_OFFSET 0x1fff

struct hdr_cursor {
	void *pos;
};

/* Returns the EtherType in network byte order. */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end, struct ethhdr **eth)
{
	struct ethhdr *e = nh->pos;

	if ((void *)(e + 1) > data_end)
		return -1;
	nh->pos = e + 1;
	*eth = e;
	return e->h_proto;
}

/* Returns the IP protocol. Options are skipped; IHL < 5 or a header past data_end is -1. */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end, struct iphdr **iph)
{
	struct iphdr *ip = nh->pos;
	int hdrsize;

	if ((void *)(ip + 1) > data_end)
		return -1;
	hdrsize = ip->ihl * 4;
	if (hdrsize < (int)sizeof(*ip))
		return -1;
	if (nh->pos + hdrsize > data_end)
		return -1;
	nh->pos += hdrsize;
	*iph = ip;
	return ip->protocol;
}

/* What the filter and the flow table need of the transport header. */
struct l4_info {
	__u8 first_frag; /* 1: offset 0, so the L4 header is in this packet */
	__u8 has_l4;	 /* 1: ports (or ICMP type/id) below are valid */
	__u8 icmp_type;
	__u8 pad;
	__be16 sport; /* ICMP echo: identifier */
	__be16 dport; /* ICMP echo: identifier */
	void *l4;     /* start of the L4 header (valid when has_l4) */
};

/*
 * Fills *info for TCP, UDP, SCTP (ports are the first 4 bytes of each) and ICMP. Returns -1
 * when this is a first fragment whose L4 header is truncated, 0 otherwise.
 */
static __always_inline int parse_l4(struct hdr_cursor *nh, void *data_end, struct iphdr *ip,
				    struct l4_info *info)
{
	info->first_frag = (ip->frag_off & bpf_htons(CZ_IP_OFFSET)) == 0;
	info->has_l4 = 0;
	if (!info->first_frag)
		return 0;
	switch (ip->protocol) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP: {
		__be16 *ports = nh->pos;
		unsigned int need = ip->protocol == IPPROTO_TCP	  ? 20
				    : ip->protocol == IPPROTO_UDP ? 8
								  : 12;

		if (nh->pos + need > data_end)
			return -1;
		info->sport = ports[0];
		info->dport = ports[1];
		break;
	}
	case IPPROTO_ICMP: {
		struct icmphdr *icmp = nh->pos;

		if ((void *)(icmp + 1) > data_end)
			return -1;
		info->icmp_type = icmp->type;
		info->sport = icmp->un.echo.id;
		info->dport = icmp->un.echo.id;
		break;
	}
	default:
		return 0;
	}
	info->has_l4 = 1;
	info->l4 = nh->pos;
	return 0;
}

#endif
