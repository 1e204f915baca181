/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Cursor-style parsing shared by every program. Both families are described by one struct pkt,
 * addresses as struct ip6 (an IPv4 address in a[0], the rest zero), so that the decisions above
 * this layer are written once. The checks follow docs/datapath-semantics.md, "Parsing".
 *
 * At the end, the fast paths' parse: the common frame -- untagged IPv4 without options or IPv6
 * without extension headers, TCP or UDP, not a fragment, every length consistent -- read in
 * place, without the scratch or family-neutral copies. A frame it does not take whole goes to a
 * full path (CZ_SLOW), which decides it by the same semantics;
 * tests/datapath/test_differential.py holds both paths to the reference model.
 */
#ifndef COZYEBPF_PARSE_H
#define COZYEBPF_PARSE_H

#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/in.h>
#include <uapi/linux/in6.h>
#include <uapi/linux/icmp.h>
#include <uapi/linux/icmpv6.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include "types.h"

#define CZ_MAX_VLAN 2
#define CZ_MAX_EXT 6
#define CZ_IP_MF 0x2000
#define CZ_IP_OFFSET 0x1fff
#define CZ_ETH_P_8021AD 0x88A8
#define CZ_TCP_FIN 0x01
#define CZ_TCP_SYN 0x02
#define CZ_TCP_RST 0x04
#define CZ_TCP_ACK 0x10

#define CZ_OK 0
#define CZ_BAD -1 /* malformed: drop_malformed */
#define cz_unlikely(x) __builtin_expect(!!(x), 0)
#define cz_likely(x) __builtin_expect(!!(x), 1)

struct hdr_cursor {
	void *pos;
	void *start; /* the start of the frame */
};

struct cz_vlan {
	__be16 tci;
	__be16 proto;
};

struct cz_ext {
	__u8 nexthdr;
	__u8 hdrlen;
};

struct cz_frag6 {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off; /* offset << 3 | M */
	__be32 id;
};

/* A parsed packet (outer headers); ICMP errors add struct inner. */
struct pkt {
	void *l3;	 /* the IP header */
	void *l4;	 /* the L4 header (when has_l4), else the IP payload */
	__u32 l3_off;	 /* offsets from the start of the frame; lengths are computed on these */
	__u32 l4_off;	 /* scalars, never on pointers: a pointer whose range may exceed 64 KiB */
	__u32 end_off;	 /* (the IP end) gets no bounds from the verifier */
	struct ip6 src;	 /* source address */
	struct ip6 dst;	 /* destination address */
	__u32 frame_len; /* bytes in the frame, for the counters */
	__be32 frag_id;	 /* identification (IPv4: 16 bits) */
	__be16 sport;	 /* TCP/UDP/SCTP ports; ICMP echo: the identifier */
	__be16 dport;
	__u8 v6;	 /* 1: IPv6 */
	__u8 proto;	 /* L4 protocol (after IPv6 extension headers) */
	__u8 has_l4;	 /* the L4 header is in this packet and valid */
	__u8 first_frag; /* fragment offset 0 (also: not a fragment) */
	__u8 more_frags; /* IPv4 MF / IPv6 M */
	__u8 icmp_type;
	__u8 icmp_error; /* an ICMP/ICMPv6 error message */
	__u8 tcp_flags;	 /* egress, TCP: the flags byte (FIN, SYN, RST; egress.c reads it) */
};

/* The embedded packet of an ICMP error. */
struct inner {
	void *l3;
	void *l4;
	__u32 l4_off;
	__u32 l4_avail; /* bytes of the inner L4 header present */
	struct ip6 src;
	struct ip6 dst;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 icmp_type;
	__u8 rewrite; /* ingress: the inner source is the LB IP and becomes the pod IP */
	__u8 pad;
};

/*
 * Verifier state "laundering": values that differ between parse paths (how many VLAN tags,
 * which extension headers) are stored in this per-CPU scratch slot and read back. The verifier
 * does not track map memory, so every path continues with the same unknown-but-bounded values
 * and the paths merge: without this, each combination of tags and extension headers is
 * verified separately through all the code that follows, beyond the verifier's limit.
 */
/* What a full path decided about a packet, for the code at its end (account.h). */
struct cz_done {
	struct ip6 src; /* as received */
	struct ip6 dst;
	__u32 reason; /* enum cz_reason */
	__u32 slot;   /* the Service's svcstats slot */
	__u32 len;    /* frame length */
	__be16 sport;
	__be16 dport;
	__u8 v6;
	__u8 proto;
	__u8 flow;	/* egress: a flow the pod opens, to record (port filter, L4 header) */
	__u8 icmp_type; /* with flow: the ICMP type (only echo requests are recorded) */
	__u8 frag;	/* ingress: a first fragment's verdict to record (port filter) */
	__u8 tcp_flags; /* with flow: TCP flags (a FIN or RST marks the flow closing) */
	__u8 limited;	/* the address carries CZ_F_LIMIT: its Service's limits apply (limit.h) */
	__u8 pad;
	__be32 frag_id; /* with frag: its identification */
};

struct cz_scratch {
	__u32 off;	 /* a header offset from the start of the frame */
	__u32 end;	 /* the end of the IP packet, from the start of the frame */
	__be32 frag_id;	 /* IPv6 fragment identification */
	__u8 proto;	 /* the L4 protocol */
	__u8 first_frag; /* fragment offset 0 */
	__u8 more_frags; /* M flag */
	__u8 dry;	 /* this run is explain's dry run (dryrun.h) */
	struct cz_done done;
};

BPF_PERCPU_ARRAY(cz_scratch, struct cz_scratch, 1);

static __always_inline struct cz_scratch *cz_scratch_slot(void)
{
	__u32 zero = 0;

	return cz_scratch.lookup(&zero);
}

#define CZ_MAX_OFF 1024 /* headers we look at lie in the first 1 KiB of a frame */

/* Keep the compiler from recomputing a pointer: each `data + off` is a new pointer identity
 * for the verifier, and a bounds check on one does not cover another. */
#define cz_barrier_var(v) asm volatile("" : "+r"(v))
/* Keep the compiler from carrying values (packet pointers, loads from ctx) across this point. */
#define cz_barrier() asm volatile("" ::: "memory")

static __always_inline int cz_ip6_eq(const struct ip6 *a, const struct ip6 *b)
{
	return a->a[0] == b->a[0] && a->a[1] == b->a[1] && a->a[2] == b->a[2] && a->a[3] == b->a[3];
}

static __always_inline void cz_ip4_set(struct ip6 *a, __be32 v4)
{
	a->a[0] = v4;
	a->a[1] = 0;
	a->a[2] = 0;
	a->a[3] = 0;
}

/* Ethernet and up to two VLAN tags; the EtherType of the payload, or -1 (pass unchanged). */
static __always_inline int parse_eth(struct hdr_cursor *nh, void *data_end)
{
	struct ethhdr *eth = nh->pos;
	__be16 proto;
	int i;

	if ((void *)(eth + 1) > data_end)
		return -1;
	nh->pos = eth + 1;
	proto = eth->h_proto;
#pragma unroll
	for (i = 0; i < CZ_MAX_VLAN; i++) {
		struct cz_vlan *vh = nh->pos;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(CZ_ETH_P_8021AD))
			break;
		if ((void *)(vh + 1) > data_end)
			return -1;
		proto = vh->proto;
		nh->pos = vh + 1;
	}
	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(CZ_ETH_P_8021AD))
		return -1; /* a third tag */
	return proto;
}

/* nh->pos as an offset that the verifier sees as one bounded unknown (see cz_scratch). */
static __always_inline int launder_pos(struct hdr_cursor *nh, void *data, void *data_end)
{
	struct cz_scratch *s = cz_scratch_slot();
	__u32 off;

	if (!s)
		return -1;
	void *pos;

	s->off = nh->pos - data;
	off = s->off;
	if (off > CZ_MAX_OFF)
		return -1;
	pos = data + off;
	cz_barrier_var(pos);
	nh->pos = pos;
	return 0;
}

/* The addresses as received, for the end of a full path (account.h): stored while few ways
 * through the parser lead here, not at the end, which many reach. */
static __always_inline void cz_done_addrs(struct pkt *p)
{
	struct cz_scratch *s = cz_scratch_slot();

	if (s) {
		s->done.src = p->src;
		s->done.dst = p->dst;
		s->done.v6 = p->v6;
	}
}

/* A first fragment (port filter): its verdict is to be recorded at the end (account.h). */
static __always_inline void cz_done_frag(struct pkt *p)
{
	struct cz_scratch *s = cz_scratch_slot();

	if (s) {
		s->done.frag = 1;
		s->done.frag_id = p->frag_id;
	}
}

/* The addresses of an IPv4 header; -1 when the frame cannot hold 20 bytes of it. */
static __always_inline int peek_ip4(struct hdr_cursor *nh, void *data_end, struct pkt *p)
{
	struct iphdr *ip = nh->pos;

	if ((void *)(ip + 1) > data_end)
		return -1;
	p->l3 = ip;
	p->l3_off = nh->pos - nh->start;
	p->v6 = 0;
	cz_ip4_set(&p->src, ip->saddr);
	cz_ip4_set(&p->dst, ip->daddr);
	return 0;
}

static __always_inline int peek_ip6(struct hdr_cursor *nh, void *data_end, struct pkt *p)
{
	struct ipv6hdr *ip6 = nh->pos;

	if ((void *)(ip6 + 1) > data_end)
		return -1;
	p->l3 = ip6;
	p->l3_off = nh->pos - nh->start;
	p->v6 = 1;
	__builtin_memcpy(&p->src, &ip6->saddr, sizeof(p->src));
	__builtin_memcpy(&p->dst, &ip6->daddr, sizeof(p->dst));
	return 0;
}

/*
 * Ethernet, tags and the addresses of the IP header, for every program: 0, or -1 when the
 * frame is not IP (or too short to say): pass it unchanged.
 */
static __always_inline int parse_frame(struct hdr_cursor *nh, void *data, void *data_end,
				       struct pkt *p)
{
	int proto = parse_eth(nh, data_end);

	/* the offset after the tags laundered (cz_scratch): every number of tags, one state on */
	if (proto < 0 || launder_pos(nh, data, data_end) < 0)
		return -1;
	if (proto == bpf_htons(ETH_P_IP))
		return peek_ip4(nh, data_end, p);
	if (proto == bpf_htons(ETH_P_IPV6))
		return peek_ip6(nh, data_end, p);
	return -1;
}

static __always_inline int cz_icmp_is_error(__u8 v6, __u8 type)
{
	if (v6)
		return type >= 1 && type <= 4;
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED ||
	       type == ICMP_PARAMETERPROB;
}

/*
 * The TCP or UDP header at `l4`, `len` bytes of the IP packet from it (docs/datapath-semantics.md,
 * "Parsing", 5.): TCP 20 bytes, a data offset from 5 to `len`; UDP 8 bytes, a length from 8 to
 * `len`, or beyond `len` in a first fragment with more to come (`more`: it counts the whole
 * datagram). The one check of both, for the full paths (parse_l4) and the fast paths: CZ_OK with
 * the ports, the checksum field and TCP's flags byte (what a caller leaves unread is not loaded),
 * or CZ_BAD, also for any other protocol.
 */
static __always_inline int cz_tcpudp(__u8 proto, void *l4, void *data_end, __u32 len, int more,
				     __be16 *sport, __be16 *dport, __u16 **csum, __u8 *tcp_flags)
{
	if (proto == IPPROTO_UDP) {
		struct udphdr *uh = l4;
		__u32 ulen;

		if (cz_unlikely((void *)(uh + 1) > data_end || len < sizeof(*uh)))
			return CZ_BAD;
		ulen = bpf_ntohs(uh->len);
		if (cz_unlikely(ulen < sizeof(*uh) || (!more && ulen > len)))
			return CZ_BAD;
		*sport = uh->source;
		*dport = uh->dest;
		*csum = &uh->check;
		*tcp_flags = 0;
		return CZ_OK;
	}
	if (proto == IPPROTO_TCP) {
		struct tcphdr *th = l4;

		if (cz_unlikely((void *)(th + 1) > data_end))
			return CZ_BAD;
		/* (no cz_barrier_var on th: with one, every program took more to verify) */
		if (cz_unlikely(len < sizeof(*th) || th->doff < 5 || th->doff * 4 > len))
			return CZ_BAD;
		*sport = th->source;
		*dport = th->dest;
		*csum = &th->check;
		*tcp_flags = ((__u8 *)th)[13];
		return CZ_OK;
	}
	return CZ_BAD;
}

/* The L4 header of a packet that carries one (first fragment). CZ_OK or CZ_BAD. */
static __always_inline int parse_l4(struct pkt *p, void *data_end)
{
	void *l4 = p->l4;
	__u32 len = p->end_off - p->l4_off;

	p->has_l4 = 0;
	p->icmp_error = 0;
	if (!p->first_frag)
		return CZ_OK;
	switch (p->proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP: {
		__u16 *csum;
		__u8 tcp_flags;

		if (cz_tcpudp(p->proto, l4, data_end, len, p->more_frags, &p->sport, &p->dport,
			      &csum, &tcp_flags) < 0)
			return CZ_BAD;
		break;
	}
	case IPPROTO_SCTP: {
		__be16 *ports = l4;

		if (l4 + 12 > data_end || len < 12)
			return CZ_BAD;
		p->sport = ports[0];
		p->dport = ports[1];
		break;
	}
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6: {
		struct icmphdr *ih = l4;

		if ((p->proto == IPPROTO_ICMPV6) != p->v6)
			return CZ_OK; /* ICMP in IPv6 or ICMPv6 in IPv4: a protocol without ports */
		if ((void *)(ih + 1) > data_end || len < sizeof(*ih))
			return CZ_BAD;
		p->icmp_type = ih->type;
		p->icmp_error = cz_icmp_is_error(p->v6, ih->type);
		p->sport = ih->un.echo.id;
		p->dport = ih->un.echo.id;
		break;
	}
	default:
		return CZ_OK;
	}
	p->has_l4 = 1;
	return CZ_OK;
}

/* The rest of an IPv4 header whose address matched. CZ_OK or CZ_BAD. */
static __always_inline int check_ip4(struct pkt *p, void *data_end)
{
	struct iphdr *ip = p->l3;
	__u32 hl, tot;
	__u16 off;

	if ((void *)(ip + 1) > data_end)
		return CZ_BAD;
	if (ip->version != 4 || ip->ihl < 5)
		return CZ_BAD;
	hl = ip->ihl * 4;
	tot = bpf_ntohs(ip->tot_len);
	if (tot < hl || p->l3_off + tot > p->frame_len)
		return CZ_BAD;
	p->l4 = (void *)ip + hl;
	p->l4_off = p->l3_off + hl;
	p->end_off = p->l3_off + tot;
	p->proto = ip->protocol;
	off = bpf_ntohs(ip->frag_off);
	p->first_frag = (off & CZ_IP_OFFSET) == 0;
	p->more_frags = (off & CZ_IP_MF) != 0;
	p->frag_id = ip->id;
	return parse_l4(p, data_end);
}

static __always_inline int cz_ext_hdr(__u8 nexthdr)
{
	return nexthdr == IPPROTO_HOPOPTS || nexthdr == IPPROTO_ROUTING ||
	       nexthdr == IPPROTO_DSTOPTS || nexthdr == IPPROTO_FRAGMENT || nexthdr == IPPROTO_AH;
}

/*
 * The rest of an IPv6 packet whose address matched: extension headers, then L4. The walk keeps
 * its state in registers and hands the result over through cz_scratch.
 */
static __always_inline int check_ip6(struct pkt *p, void *data, void *data_end)
{
	struct ipv6hdr *ip6 = p->l3;
	struct cz_scratch *s = cz_scratch_slot();
	__u32 off, end, plen;
	__be32 frag_id = 0;
	__u8 nexthdr, first = 1, more = 0;
	int i;

	if (!s || (void *)(ip6 + 1) > data_end)
		return CZ_BAD;
	if (ip6->version != 6)
		return CZ_BAD;
	plen = bpf_ntohs(ip6->payload_len);
	off = p->l3_off + sizeof(*ip6);
	end = off + plen;
	if (plen == 0 || end > p->frame_len)
		return CZ_BAD;
	nexthdr = ip6->nexthdr;
#pragma unroll
	for (i = 0; i < CZ_MAX_EXT; i++) {
		struct cz_ext *eh;

		if (!cz_ext_hdr(nexthdr))
			break;
		if (off > CZ_MAX_OFF)
			return CZ_BAD;
		eh = data + off;
		if ((void *)eh + 8 > data_end || off + 8 > end)
			return CZ_BAD;
		if (nexthdr == IPPROTO_FRAGMENT) {
			struct cz_frag6 *fh = (void *)eh;
			__u16 fo = bpf_ntohs(fh->frag_off);

			first = (fo & 0xfff8) == 0;
			more = fo & 1;
			frag_id = fh->id;
			off += 8;
			if (!first) {
				/* after the fragment header of a later fragment comes data */
				nexthdr = fh->nexthdr;
				break;
			}
		} else if (nexthdr == IPPROTO_AH) {
			off += (eh->hdrlen + 2) * 4;
		} else {
			off += (eh->hdrlen + 1) * 8;
		}
		nexthdr = eh->nexthdr;
		if (off > end)
			return CZ_BAD;
	}
	if (first && cz_ext_hdr(nexthdr))
		return CZ_BAD; /* more extension headers than we walk */
	s->off = off;
	s->end = end;
	s->proto = nexthdr;
	s->first_frag = first;
	s->more_frags = more;
	s->frag_id = frag_id;
	/* read back: from here on, every walk is the same state */
	off = s->off;
	if (off > CZ_MAX_OFF)
		return CZ_BAD;
	p->l4 = data + off;
	p->l4_off = off;
	p->end_off = s->end;
	p->proto = s->proto;
	p->first_frag = s->first_frag;
	p->more_frags = s->more_frags;
	p->frag_id = s->frag_id;
	return parse_l4(p, data_end);
}

static __always_inline int check_ip(struct pkt *p, void *data, void *data_end)
{
	return p->v6 ? check_ip6(p, data, data_end) : check_ip4(p, data_end);
}

/*
 * The embedded packet of an ICMP error: an IP header of the same family that fits, then at
 * least 8 bytes of its L4 header; an inner ICMP error is refused. 0, or -1 (drop_icmp_inner).
 */
static __always_inline int parse_inner(struct pkt *p, void *data_end, struct inner *in)
{
	void *ip = p->l4 + 8;
	__u32 ip_off = p->l4_off + 8, l4_off;
	void *l4;

	if (p->v6) {
		struct ipv6hdr *i6 = ip;

		if ((void *)(i6 + 1) > data_end || ip_off + sizeof(*i6) > p->end_off ||
		    i6->version != 6)
			return -1;
		__builtin_memcpy(&in->src, &i6->saddr, sizeof(in->src));
		__builtin_memcpy(&in->dst, &i6->daddr, sizeof(in->dst));
		in->proto = i6->nexthdr;
		l4 = i6 + 1;
		l4_off = ip_off + sizeof(*i6);
	} else {
		struct iphdr *i4 = ip;

		if ((void *)(i4 + 1) > data_end || ip_off + sizeof(*i4) > p->end_off ||
		    i4->version != 4 || i4->ihl < 5)
			return -1;
		cz_ip4_set(&in->src, i4->saddr);
		cz_ip4_set(&in->dst, i4->daddr);
		in->proto = i4->protocol;
		l4 = ip + i4->ihl * 4;
		l4_off = ip_off + i4->ihl * 4;
	}
	if (l4 + 8 > data_end || l4_off + 8 > p->end_off)
		return -1;
	in->l3 = ip;
	in->l4 = l4;
	in->l4_off = l4_off;
	in->l4_avail = p->end_off - l4_off;
	in->sport = ((__be16 *)l4)[0];
	in->dport = ((__be16 *)l4)[1];
	in->icmp_type = 0;
	in->rewrite = 0;
	if (in->proto == (p->v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP)) {
		struct icmphdr *ih = l4;

		in->icmp_type = ih->type;
		if (cz_icmp_is_error(p->v6, ih->type))
			return -1; /* an error about an error */
		in->sport = ih->un.echo.id;
		in->dport = ih->un.echo.id;
	}
	return 0;
}

/* What the fast parse found; the L4 header is TCP or UDP and valid. */
struct cz_fast {
	void *l3;
	__u16 *csum;	/* the TCP or UDP checksum */
	__u32 csum_off; /* its offset in the frame (tc helpers) */
	__be16 sport;
	__be16 dport;
	__u32 slot; /* the Service's svcstats slot (ingress: in_slot) */
	__u8 proto;
	__u8 v6;
	__u8 rewrite;	/* ingress: the destination is an LB IP (CZ_K_LB) */
	__u8 tcp_flags; /* TCP: the flags byte */
};

/* An untagged IPv4 frame: the IP header, or NULL. */
static __always_inline struct iphdr *fast_ip4(void *data, void *data_end)
{
	struct iphdr *ip = data + sizeof(struct ethhdr);

	/* the EtherType as one load (struct ethhdr is packed: byte loads) */
	if ((void *)(ip + 1) > data_end || *(__be16 *)(data + 12) != bpf_htons(ETH_P_IP))
		return NULL;
	return ip;
}

static __always_inline struct ipv6hdr *fast_ip6(void *data, void *data_end)
{
	struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);

	if ((void *)(ip6 + 1) > data_end || *(__be16 *)(data + 12) != bpf_htons(ETH_P_IPV6))
		return NULL;
	return ip6;
}

/*
 * The rest of an untagged IPv4 header whose address matched -- no options, not a fragment, the
 * lengths consistent -- and its TCP or UDP header (cz_tcpudp): 0 with the ports, the checksum
 * field and TCP's flags byte, or -1 (the full path decides).
 */
static __always_inline int fast_hdrs4(struct iphdr *ip, void *data_end, __u32 frame_len,
				      __be16 *sport, __be16 *dport, __u16 **csum, __u8 *tcp_flags)
{
	__u32 tot;

	if (cz_unlikely(*(__u8 *)ip != 0x45 || (ip->frag_off & bpf_htons(CZ_IP_MF | CZ_IP_OFFSET))))
		return -1;
	tot = bpf_ntohs(ip->tot_len);
	if (cz_unlikely(tot < sizeof(*ip) || sizeof(struct ethhdr) + tot > frame_len))
		return -1;
	return cz_tcpudp(ip->protocol, ip + 1, data_end, tot - sizeof(*ip), 0, sport, dport, csum,
			 tcp_flags);
}

/* The rest of a managed IPv4 header (fast_hdrs4) into *f. 0 or -1. */
static __always_inline int fast_check4(struct cz_fast *f, struct iphdr *ip, void *data,
				       void *data_end, __u32 frame_len)
{
	if (fast_hdrs4(ip, data_end, frame_len, &f->sport, &f->dport, &f->csum, &f->tcp_flags) < 0)
		return -1;
	f->l3 = ip;
	f->v6 = 0;
	f->proto = ip->protocol;
	f->csum_off = (void *)f->csum - data;
	return 0;
}

/*
 * The bytes the GSO packet whose headers `f` holds (fast_check4/6) puts on the wire once it is
 * segmented, as the kernel's qdisc_pkt_len_init counts them: its headers (the frame's start to
 * its TCP or UDP payload) once per segment. For a hook that sees such a packet before the qdisc
 * layer sets its wire_len (tc ingress, where wire_len is the length: the pod-facing hook, whose
 * packets a pod's TSO made). One segment: the length. `len`: the skb's; `segs`: its gso_segs.
 */
static __always_inline __u32 fast_wire_len(const struct cz_fast *f, __u32 len, __u32 segs)
{
	__u32 hdr;

	if (segs <= 1)
		return len;
	if (f->proto == IPPROTO_TCP) /* the data offset: the byte 4 before the checksum's */
		hdr = f->csum_off - offsetof(struct tcphdr, check) +
		      (((__u8 *)f->csum)[-4] >> 4) * 4;
	else
		hdr = f->csum_off - offsetof(struct udphdr, check) + sizeof(struct udphdr);
	return len + (segs - 1) * hdr;
}

static __always_inline int fast_check6(struct cz_fast *f, struct ipv6hdr *ip6, void *data,
				       void *data_end, __u32 frame_len)
{
	__u32 plen;

	if ((*(__u8 *)ip6 >> 4) != 6)
		return -1;
	plen = bpf_ntohs(ip6->payload_len);
	if (plen == 0 || sizeof(struct ethhdr) + sizeof(*ip6) + plen > frame_len)
		return -1;
	if (cz_tcpudp(ip6->nexthdr, ip6 + 1, data_end, plen, 0, &f->sport, &f->dport, &f->csum,
		      &f->tcp_flags) < 0)
		return -1;
	f->l3 = ip6;
	f->v6 = 1;
	f->proto = ip6->nexthdr;
	f->csum_off = (void *)f->csum - data;
	return 0;
}

#endif
