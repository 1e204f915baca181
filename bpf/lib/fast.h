/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The fast paths: the common frame -- untagged IPv4 without options or IPv6 without extension
 * headers, TCP or UDP, not a fragment, every length consistent -- decided in a straight line on
 * the map values in place: one address lookup, the inline allowed ports, the flow hint before
 * any flow lookup, no per-CPU scratch, no family-neutral copies. A frame the fast path does not
 * take whole gets CZ_SLOW and the full path (ingress.h, egress.c) decides it, with the same
 * semantics for every frame (docs/datapath-semantics.md); tests/datapath/test_differential.py holds
 * both paths to the reference model.
 */
#ifndef COZYEBPF_FAST_H
#define COZYEBPF_FAST_H

#include "csum.h"
#include "filter.h"
#include "tc.h"
#include "lookup.h"
#include "monitor.h"
#include "parse.h"
#include "stats.h"

#define CZ_SLOW 0xfffffffe /* not decided here: take the full path */
#define cz_unlikely(x) __builtin_expect(!!(x), 0)
#define cz_likely(x) __builtin_expect(!!(x), 1)

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

/* A packet a fast path decided: counted under its reason and for its Service (slot; dir 0
 * ingress, 1 egress). */
static __always_inline void fast_count(int dir, __u32 reason, __u32 slot, __u32 len)
{
	cz_count(reason, len);
	if (reason == CZ_DROP_PORT || reason == CZ_DROP_MALFORMED || reason == CZ_DROP_SOURCE)
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

/* The TCP or UDP header at `l4` with `len` bytes of IP payload: 0 when valid (the checks of
 * parse_l4 for a packet that is not a fragment), -1 otherwise (the full path decides). */
static __always_inline int fast_l4(struct cz_fast *f, __u8 proto, void *l4, void *data,
				   void *data_end, __u32 len)
{
	if (proto == IPPROTO_UDP) {
		struct udphdr *uh = l4;
		__u32 ulen;

		if ((void *)(uh + 1) > data_end || len < sizeof(*uh))
			return -1;
		ulen = bpf_ntohs(uh->len);
		if (ulen < sizeof(*uh) || ulen > len)
			return -1;
		f->sport = uh->source;
		f->dport = uh->dest;
		f->csum = &uh->check;
	} else if (proto == IPPROTO_TCP) {
		struct tcphdr *th = l4;

		if ((void *)(th + 1) > data_end || len < sizeof(*th))
			return -1;
		if (th->doff < 5 || th->doff * 4 > len)
			return -1;
		f->sport = th->source;
		f->dport = th->dest;
		f->csum = &th->check;
		f->tcp_flags = ((__u8 *)th)[13];
	} else {
		return -1;
	}
	f->proto = proto;
	f->csum_off = (void *)f->csum - data;
	return 0;
}

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

/* The rest of a managed IPv4 header: no options, not a fragment, TCP/UDP. 0 or -1. */
static __always_inline int fast_check4(struct cz_fast *f, struct iphdr *ip, void *data,
				       void *data_end, __u32 frame_len)
{
	__u32 tot;

	if (*(__u8 *)ip != 0x45 || (ip->frag_off & bpf_htons(CZ_IP_MF | CZ_IP_OFFSET)))
		return -1;
	tot = bpf_ntohs(ip->tot_len);
	if (tot < sizeof(*ip) || sizeof(struct ethhdr) + tot > frame_len)
		return -1;
	f->l3 = ip;
	f->v6 = 0;
	return fast_l4(f, ip->protocol, ip + 1, data, data_end, tot - sizeof(*ip));
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
	f->l3 = ip6;
	f->v6 = 1;
	return fast_l4(f, ip6->nexthdr, ip6 + 1, data, data_end, plen);
}

/*
 * Is `word` one of the first `nports` inline ports (all 8 when they spill)? Here, in a program
 * that is verified on its own and small, a branch per slot costs the verifier nothing, and the
 * common Service with few ports pays for those only.
 */
static __always_inline int fast_ports_have(const struct cz_port *ports, __u8 nports, __u32 word)
{
	const __u32 *w = (const __u32 *)ports;
	int i;

#pragma unroll
	for (i = 0; i < CZ_INLINE_PORTS; i++) {
		if (i >= nports)
			return 0;
		if (w[i] == word)
			return 1;
	}
	return 0;
}

/* Are the `n` 32-bit words at a and b the same? */
static __always_inline int fast_words_eq(const void *a, const void *b, int n)
{
	const __u32 *x = a, *y = b;
	int i;

#pragma unroll
	for (i = 0; i < n; i++) {
		if (x[i] != y[i])
			return 0;
	}
	return 1;
}

/*
 * A flow of the fast paths and this CPU's seen slot for it (types.h, seen4/seen6): the key of
 * its family (the other is left unset), the slot, and whether the slot vouches for this flow
 * (holds it, looked up under CZ_SEEN_NS ago) with which time. Both families in one place, so
 * that egress (fast_flow_record) and replies (fast_reply) read and fill the slots alike.
 */
struct fast_seen {
	struct flow4_key k4;
	struct flow6_key k6;
	struct flow4_seen *s4;
	struct flow6_seen *s6;
	__u64 time; /* the slot's: the entry's time when it was looked up */
	int holds;  /* the slot is this flow's, looked up under CZ_SEEN_NS ago */
};

/* Fill `fs` for the flow whose hint hash is `h`: 0, or -1 (never: the index is masked). */
static __always_inline int fast_seen_get(struct fast_seen *fs, int v6, const struct ip6 *pod,
					 const struct ip6 *remote, __be16 pod_port,
					 __be16 remote_port, __u8 proto, __u32 h, __u64 now)
{
	__u32 i = h & (CZ_SEEN_MAX - 1);

	if (v6) {
		__builtin_memset(&fs->k6, 0, sizeof(fs->k6));
		fs->k6.pod_ip = *pod;
		fs->k6.remote_ip = *remote;
		fs->k6.pod_port = pod_port;
		fs->k6.remote_port = remote_port;
		fs->k6.proto = proto;
		fs->s6 = cz_seen6.lookup(&i);
		if (!fs->s6)
			return -1;
		fs->time = fs->s6->time;
		fs->holds = now - fs->s6->checked <= CZ_SEEN_NS &&
			    fast_words_eq(&fs->s6->key, &fs->k6, sizeof(fs->k6) / 4);
	} else {
		__builtin_memset(&fs->k4, 0, sizeof(fs->k4));
		fs->k4.pod_ip = pod->a[0];
		fs->k4.remote_ip = remote->a[0];
		fs->k4.pod_port = pod_port;
		fs->k4.remote_port = remote_port;
		fs->k4.proto = proto;
		fs->s4 = cz_seen4.lookup(&i);
		if (!fs->s4)
			return -1;
		fs->time = fs->s4->time;
		fs->holds = now - fs->s4->checked <= CZ_SEEN_NS &&
			    fast_words_eq(&fs->s4->key, &fs->k4, sizeof(fs->k4) / 4);
	}
	return 0;
}

/* The flow's entry in the flow table, or NULL. */
static __always_inline struct flow4_val *fast_seen_entry(struct fast_seen *fs, int v6)
{
	return v6 ? cz_flow6.lookup(&fs->k6) : cz_flow4.lookup(&fs->k4);
}

/* The slot takes the flow, the time its entry holds (`last`, the mark dropped) and now. */
static __always_inline void fast_seen_put(struct fast_seen *fs, int v6, __u64 last, __u64 now)
{
	if (v6) {
		fs->s6->key = fs->k6;
		fs->s6->time = last & ~CZ_FLOW_CLOSING;
		fs->s6->checked = now;
	} else {
		fs->s4->key = fs->k4;
		fs->s4->time = last & ~CZ_FLOW_CLOSING;
		fs->s4->checked = now;
	}
}

/*
 * Ingress fast paths: does a flow of the pod admit this reply (flow_exists)? Looked up only when
 * the hint says it may exist; then first in this CPU's seen slot (types.h, seen4/seen6): a slot
 * that holds the flow, looked up under CZ_SEEN_NS ago, whose time is fresh for the protocol
 * whatever the closing mark (both timeouts), answers yes without a flow-table lookup -- the
 * entry's time is at least the slot's, so the entry is fresh too. Otherwise the entry is looked
 * up, and a fresh one leaves the flow, its time and now in the slot. The only difference to a
 * lookup per reply: an entry the LRU evicts from under a busy flow admits its replies for at
 * most CZ_SEEN_NS more.
 */
static __always_inline int fast_reply(int v6, const struct ip6 *pod, const struct ip6 *remote,
				      __be16 pod_port, __be16 remote_port, __u8 proto)
{
	__u32 h = cz_flow_hash(cz_fold(v6, pod), cz_fold(v6, remote), pod_port, remote_port, proto);
	struct fast_seen fs;
	struct flow4_val *v, t;
	__u64 now;

	if (!flow_hinted(h))
		return 0;
	now = bpf_ktime_get_coarse_ns();
	if (fast_seen_get(&fs, v6, pod, remote, pod_port, remote_port, proto, h, now) < 0)
		return 0;
	if (fs.holds) {
		t.last_seen_ns = fs.time;
		if (flow_fresh(&t, proto, now)) {
			t.last_seen_ns |= CZ_FLOW_CLOSING;
			if (flow_fresh(&t, proto, now))
				return 1;
		}
		/* fresh for one timeout only, or not at all: the entry says */
		v = fast_seen_entry(&fs, v6);
		return v && flow_fresh(v, proto, now);
	}
	v = fast_seen_entry(&fs, v6);
	if (!v || !flow_fresh(v, proto, now))
		return 0;
	fast_seen_put(&fs, v6, v->last_seen_ns, now);
	return 1;
}

/*
 * Port filter and source ranges, IPv4 (v->flags has CZ_F_PORT_FILTER or CZ_F_RANGES): a source
 * outside the ranges gets replies only (else drop_source); then whole-IP passes, the port filter
 * an allowed port, else a reply of a flow, else drop_port.
 */
static __always_inline __u32 fast_filter4(struct addr4_val *v, __be32 pod, __be32 remote,
					  __u8 proto, __be16 sport, __be16 dport, __u8 tcp_flags)
{
	int out = (v->flags & CZ_F_RANGES) && !src_in_range4(pod, remote);

	if (!out) {
		if (!(v->flags & CZ_F_PORT_FILTER))
			return CZ_NAT_INGRESS;
		if (fast_ports_have(v->ports, v->nports, cz_port_word(proto, dport)))
			return CZ_PASS_PORT;
		if (v->nports == CZ_PORTS_SPILL) {
			struct allow4_key a = {.pod_ip = pod, .proto = proto, .port = dport};

			if (cz_allow4.lookup(&a))
				return CZ_PASS_PORT;
		}
	}
	if (fast_reply(0, (struct ip6 *)&pod, (struct ip6 *)&remote, dport, sport, proto))
		return CZ_PASS_REPLY;
	if (cz_unlikely(cz_learns(v->flags, proto, tcp_flags)))
		return CZ_PASS_LEARN;
	return out ? CZ_DROP_SOURCE : CZ_DROP_PORT;
}

/*
 * Before a frame goes on to a full path: is it for a restricted pod (CZ_F_RANGES) and from
 * outside the pod's source ranges? Then the outside program takes it (tail.h), which lets only
 * replies of the pod's flows and ICMP errors about them through; the full path never looks at
 * ranges. Deciding this here, on the addresses at their fixed offsets, costs the full path's
 * verification nothing (a branch there doubles it). The IP header is found after up to
 * CZ_MAX_VLAN tags, as parse_eth finds it; whatever the full parser then refuses, the outside
 * program's parser refuses alike.
 */
static __always_inline int fast_outside(void *data, void *data_end)
{
	struct ethhdr *eth = data;
	void *l3 = data + sizeof(*eth);
	__be16 proto;
	int i;

	if (l3 > data_end)
		return 0;
	proto = *(__be16 *)(data + 12);
#pragma unroll
	for (i = 0; i < CZ_MAX_VLAN; i++) {
		struct cz_vlan *vh = l3;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(CZ_ETH_P_8021AD))
			break;
		if ((void *)(vh + 1) > data_end)
			return 0;
		proto = vh->proto;
		l3 = vh + 1;
	}
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		struct addr4_val *v;

		if ((void *)(ip + 1) > data_end)
			return 0;
		v = cz_addr4.lookup(&ip->daddr);
		if (cz_likely(!v || !(v->flags & CZ_F_RANGES)))
			return 0;
		return !src_in_range4((v->kind & CZ_K_LB) ? v->pod_ip : ip->daddr, ip->saddr);
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		struct addr6_val *v;
		struct ip6 pod, src;

		if ((void *)(ip6 + 1) > data_end)
			return 0;
		v = cz_addr6.lookup((struct ip6 *)&ip6->daddr);
		if (cz_likely(!v || !(v->flags & CZ_F_RANGES)))
			return 0;
		if (v->kind & CZ_K_LB)
			pod = v->pod_ip;
		else
			__builtin_memcpy(&pod, &ip6->daddr, sizeof(pod));
		__builtin_memcpy(&src, &ip6->saddr, sizeof(src));
		return !src_in_range(1, &pod, &src);
	}
	return 0;
}

/* Not decided by an IPv4 fast path (fast_xdp4, fast_egress4): not a verdict of XDP or tc. */
#define CZ_FAST_SLOW 1000
/* fast_egress4: the source is no managed pod IP (the caller may look at the destination) */
#define CZ_FAST_NOT_POD 1001

/*
 * The checks of an untagged IPv4 header and its TCP/UDP header (as fast_check4, without a
 * struct cz_fast): 0 with the ports and the checksum field, or -1 (the full path decides).
 */
static __always_inline int fast_hdrs4(struct iphdr *ip, void *data_end, __u32 frame_len,
				      __be16 *sport, __be16 *dport, __u16 **csum, __u8 *tcp_flags)
{
	__u32 tot, len;

	if (cz_unlikely(*(__u8 *)ip != 0x45 || (ip->frag_off & bpf_htons(CZ_IP_MF | CZ_IP_OFFSET))))
		return -1;
	tot = bpf_ntohs(ip->tot_len);
	if (cz_unlikely(tot < sizeof(*ip) || sizeof(struct ethhdr) + tot > frame_len))
		return -1;
	len = tot - sizeof(*ip);
	if (ip->protocol == IPPROTO_UDP) {
		struct udphdr *uh = (void *)(ip + 1);

		if (cz_unlikely((void *)(uh + 1) > data_end || len < sizeof(*uh)))
			return -1;
		if (cz_unlikely(bpf_ntohs(uh->len) < sizeof(*uh) || bpf_ntohs(uh->len) > len))
			return -1;
		*sport = uh->source;
		*dport = uh->dest;
		*csum = &uh->check;
		return 0;
	}
	if (ip->protocol == IPPROTO_TCP) {
		struct tcphdr *th = (void *)(ip + 1);

		if (cz_unlikely((void *)(th + 1) > data_end || len < sizeof(*th)))
			return -1;
		if (cz_unlikely(th->doff < 5 || th->doff * 4 > len))
			return -1;
		*sport = th->source;
		*dport = th->dest;
		*csum = &th->check;
		*tcp_flags = ((__u8 *)th)[13];
		return 0;
	}
	return -1;
}

/*
 * XDP, IPv4: the whole fast path in one piece -- decision, counter and rewrite -- with nothing
 * on the stack but map keys, so that the code and data a packet touches stay few cache lines.
 * An XDP verdict, or CZ_FAST_SLOW.
 */
static __always_inline int fast_xdp4(struct xdp_md *ctx, void *data, void *data_end,
				     struct iphdr *ip)
{
	struct addr4_val *v = cz_addr4.lookup(&ip->daddr);
	__be16 sport, dport;
	__u32 reason, delta;
	__be32 pod, from;
	__u16 *c, n;
	__u8 proto, tf = 0;

	if (!v)
		return XDP_PASS;
	if (cz_unlikely(fast_hdrs4(ip, data_end, data_end - data, &sport, &dport, &c, &tf) < 0))
		return CZ_FAST_SLOW;
	proto = ip->protocol;
	from = ip->daddr;
	pod = (v->kind & CZ_K_LB) ? v->pod_ip : from;
	reason = CZ_NAT_INGRESS;
	if (v->flags & CZ_F_FLOWS)
		reason = fast_filter4(v, pod, ip->saddr, proto, sport, dport, tf);
	if (reason == CZ_DROP_PORT) { /* the flood's path: every index a constant */
		fast_count(0, CZ_DROP_PORT, v->in_slot, data_end - data);
		fast_monitor(ctx, 1, 0, CZ_DROP_PORT, v->in_slot, data_end - data, 0, proto, ip,
			     sport, dport);
		return XDP_DROP;
	}
	if (reason == CZ_DROP_SOURCE) {
		fast_count(0, CZ_DROP_SOURCE, v->in_slot, data_end - data);
		fast_monitor(ctx, 1, 0, CZ_DROP_SOURCE, v->in_slot, data_end - data, 0, proto, ip,
			     sport, dport);
		return XDP_DROP;
	}
	fast_count(0, reason, v->in_slot, data_end - data);
	fast_monitor(ctx, 1, 0, reason, v->in_slot, data_end - data, 0, proto, ip, sport, dport);
	if (!(v->kind & CZ_K_LB))
		return XDP_PASS; /* sent to the pod IP directly: passed as it is */
	if ((void *)(c + 1) > data_end)
		return XDP_PASS;
	delta = cz_csum_delta32(from, pod);
	ip->daddr = pod;
	ip->check = cz_csum_apply(ip->check, delta);
	if (proto == IPPROTO_UDP && *c == 0)
		return XDP_PASS;
	n = cz_csum_apply(*c, delta);
	if (proto == IPPROTO_UDP && n == 0)
		n = 0xffff;
	*c = n;
	return XDP_PASS;
}

/* As fast_filter4, IPv6. */
static __always_inline __u32 fast_filter6(struct cz_fast *f, struct addr6_val *v,
					  const struct ip6 *pod, const struct ip6 *remote)
{
	int out = (v->flags & CZ_F_RANGES) && !src_in_range(1, pod, remote);

	if (!out) {
		if (!(v->flags & CZ_F_PORT_FILTER))
			return CZ_NAT_INGRESS;
		if (fast_ports_have(v->ports, v->nports, cz_port_word(f->proto, f->dport)))
			return CZ_PASS_PORT;
		if (v->nports == CZ_PORTS_SPILL && is_allowed(1, pod, f->proto, f->dport))
			return CZ_PASS_PORT;
	}
	if (fast_reply(1, pod, remote, f->dport, f->sport, f->proto))
		return CZ_PASS_REPLY;
	if (cz_unlikely(cz_learns(v->flags, f->proto, f->tcp_flags)))
		return CZ_PASS_LEARN;
	return out ? CZ_DROP_SOURCE : CZ_DROP_PORT;
}

/*
 * Ingress, IPv6: CZ_NOT_OURS, CZ_SLOW, or the cz_reason of the verdict. On a pass with
 * f->rewrite, *to is the new destination.
 */
static __always_inline __u32 fast_ingress6(void *data, void *data_end, __u32 frame_len,
					   struct ipv6hdr *ip6, struct cz_fast *f, struct ip6 *to)
{
	struct addr6_val *v = cz_addr6.lookup((struct ip6 *)&ip6->daddr);
	struct ip6 remote;

	if (!v)
		return CZ_NOT_OURS;
	if (fast_check6(f, ip6, data, data_end, frame_len) < 0)
		return CZ_SLOW;
	f->rewrite = v->kind & CZ_K_LB;
	f->slot = v->in_slot;
	if (f->rewrite)
		*to = v->pod_ip;
	else
		__builtin_memcpy(to, &ip6->daddr, sizeof(*to));
	if (!(v->flags & CZ_F_FLOWS))
		return CZ_NAT_INGRESS;
	__builtin_memcpy(&remote, &ip6->saddr, sizeof(remote));
	return fast_filter6(f, v, to, &remote);
}

/*
 * Ingress (tc): CZ_NOT_OURS, CZ_SLOW, or the cz_reason of the verdict. On a pass with
 * f->rewrite, *to is the new destination (IPv4: to->a[0]).
 */
static __always_inline __u32 fast_ingress(void *data, void *data_end, __u32 frame_len,
					  struct cz_fast *f, struct ip6 *to)
{
	struct iphdr *ip = fast_ip4(data, data_end);
	struct ipv6hdr *ip6;

	if (ip) {
		struct addr4_val *v = cz_addr4.lookup(&ip->daddr);
		__be32 pod;

		if (!v)
			return CZ_NOT_OURS;
		if (fast_check4(f, ip, data, data_end, frame_len) < 0)
			return CZ_SLOW;
		f->rewrite = v->kind & CZ_K_LB;
		f->slot = v->in_slot;
		pod = f->rewrite ? v->pod_ip : ip->daddr;
		to->a[0] = pod;
		if (!(v->flags & CZ_F_FLOWS))
			return CZ_NAT_INGRESS;
		return fast_filter4(v, pod, ip->saddr, f->proto, f->sport, f->dport, f->tcp_flags);
	}
	ip6 = fast_ip6(data, data_end);
	if (ip6)
		return fast_ingress6(data, data_end, frame_len, ip6, f, to);
	return CZ_SLOW;
}

/* Ingress rewrite in place (XDP): destination := *to, IP and L4 checksums (UDP 0 stays 0). */
static __always_inline void fast_nat_xdp(struct cz_fast *f, void *data_end, const struct ip6 *to)
{
	__u16 *c = f->csum;
	__u32 delta;
	__u16 n;

	if ((void *)(c + 1) > data_end)
		return;
	if (f->v6) {
		struct ipv6hdr *ip6 = f->l3;
		struct ip6 from;

		if ((void *)(ip6 + 1) > data_end)
			return;
		__builtin_memcpy(&from, &ip6->daddr, sizeof(from));
		__builtin_memcpy(&ip6->daddr, to, sizeof(*to));
		delta = cz_csum_delta32(from.a[0], to->a[0]) +
			cz_csum_delta32(from.a[1], to->a[1]) +
			cz_csum_delta32(from.a[2], to->a[2]) + cz_csum_delta32(from.a[3], to->a[3]);
	} else {
		struct iphdr *ip = f->l3;

		if ((void *)(ip + 1) > data_end)
			return;
		delta = cz_csum_delta32(ip->daddr, to->a[0]);
		ip->daddr = to->a[0];
		ip->check = cz_csum_apply(ip->check, delta);
	}
	if (f->proto == IPPROTO_UDP && *c == 0)
		return;
	n = cz_csum_apply(*c, delta);
	if (f->proto == IPPROTO_UDP && n == 0)
		n = 0xffff;
	*c = n;
}

/*
 * tc: the destination (is_dst) or source := *to with direct writes and the IPv4 header checksum
 * (never offloaded); the L4 checksum through bpf_l4_csum_replace, which keeps CHECKSUM_PARTIAL
 * (egress offload) and CHECKSUM_COMPLETE (ingress) skbs right (IPv6: with
 * cz_csum_complete_addr6). 0 or a helper's error; packet pointers are invalid afterwards.
 */
static __always_inline int fast_nat_skb(struct __sk_buff *skb, struct cz_fast *f, void *data_end,
					int is_dst, const struct ip6 *to)
{
	__u64 flags = BPF_F_PSEUDO_HDR | 4;
	struct ip6 from;
	int i, ret;

	if (f->proto == IPPROTO_UDP)
		flags |= BPF_F_MARK_MANGLED_0;
	if (f->v6) {
		struct ipv6hdr *ip6 = f->l3;

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		if (is_dst) {
			__builtin_memcpy(&from, &ip6->daddr, sizeof(from));
			__builtin_memcpy(&ip6->daddr, to, sizeof(*to));
		} else {
			__builtin_memcpy(&from, &ip6->saddr, sizeof(from));
			__builtin_memcpy(&ip6->saddr, to, sizeof(*to));
		}
	} else {
		struct iphdr *ip = f->l3;

		if ((void *)(ip + 1) > data_end)
			return -1;
		if (is_dst) {
			from.a[0] = ip->daddr;
			ip->daddr = to->a[0];
		} else {
			from.a[0] = ip->saddr;
			ip->saddr = to->a[0];
		}
		ip->check = cz_csum_replace32(ip->check, from.a[0], to->a[0]);
	}
#pragma unroll
	for (i = 0; i < 4; i++) {
		if (i > 0 && !f->v6)
			break;
		ret = bpf_l4_csum_replace(skb, f->csum_off, from.a[i], to->a[i], flags);
		if (ret < 0)
			return ret;
	}
	if (f->v6)
		cz_csum_complete_addr6(skb, &from, to);
	return 0;
}

/*
 * Egress fast paths: remember (refresh at most once a second, or when its closing mark changes)
 * a TCP or UDP flow the pod opened, as flow_record does, without a flow-table lookup for most
 * packets. A packet without a TCP FIN, SYN or RST (which may change the mark) whose flow sits in
 * this CPU's seen slot (types.h, seen4/seen6), checked under CZ_SEEN_NS ago with a time under a
 * second old, would write nothing: the entry's time is at least the slot's, so flow_stale() is
 * false. Every other packet looks its entry up, refreshes or adds it, and leaves the flow, the
 * entry's time and now in the slot (an insert that failed leaves nothing). The only difference
 * to a lookup per packet: an entry the LRU evicts from under a busy flow is added again within
 * CZ_SEEN_NS, not at the flow's next packet.
 */
static __always_inline void fast_flow_record(int v6, const struct ip6 *pod,
					     const struct ip6 *remote, __be16 pod_port,
					     __be16 remote_port, __u8 proto, __u8 tcp_flags)
{
	__u32 h = cz_flow_hash(cz_fold(v6, pod), cz_fold(v6, remote), pod_port, remote_port, proto);
	__u64 now = bpf_ktime_get_coarse_ns(), stamp;
	int marks = proto == IPPROTO_TCP && (tcp_flags & (CZ_TCP_FIN | CZ_TCP_SYN | CZ_TCP_RST));
	struct fast_seen fs;
	struct flow4_val *v, nv = {};
	int ret;

	if (fast_seen_get(&fs, v6, pod, remote, pod_port, remote_port, proto, h, now) < 0)
		return;
	if (!marks && fs.holds && now - fs.time <= CZ_FLOW_REFRESH_NS)
		return;
	v = fast_seen_entry(&fs, v6);
	if (v) {
		stamp = flow_stamp(now, v->last_seen_ns, proto, tcp_flags);
		if (flow_stale(stamp, v->last_seen_ns))
			v->last_seen_ns = stamp;
		else
			stamp = v->last_seen_ns;
	} else {
		stamp = flow_stamp(now, 0, proto, tcp_flags);
		nv.last_seen_ns = stamp;
		flow_hint_set(h);
		ret = v6 ? cz_flow6.update(&fs.k6, &nv) : cz_flow4.update(&fs.k4, &nv);
		cz_count(ret == 0 ? CZ_FLOW_NEW : CZ_FLOW_ERROR, 0);
		if (ret != 0)
			return;
	}
	fast_seen_put(&fs, v6, stamp, now);
}

/*
 * Egress (tc), IPv4: the whole fast path in one piece -- flow record, rewrite, counter. The
 * source and the IPv4 header checksum with direct writes, the L4 checksum through
 * bpf_l4_csum_replace (CHECKSUM_PARTIAL skbs), for the pod whose entry is v. A tc verdict, or
 * CZ_FAST_SLOW.
 */
static __always_inline int fast_snat4(struct __sk_buff *skb, void *data, void *data_end,
				      struct iphdr *ip, struct addr4_val *v)
{
	__u64 flags = BPF_F_PSEUDO_HDR | 4;
	__be16 sport, dport;
	__be32 from, to;
	__u32 slot;
	__u16 *c;
	__u8 tf = 0;

	if (cz_unlikely(fast_hdrs4(ip, data_end, skb->len, &sport, &dport, &c, &tf) < 0))
		return CZ_FAST_SLOW;
	from = ip->saddr;
	to = v->lb_ip;
	slot = v->out_slot;
	if (v->pod_flags & CZ_F_FLOWS)
		fast_flow_record(0, (struct ip6 *)&ip->saddr, (struct ip6 *)&ip->daddr, sport,
				 dport, ip->protocol, tf);
	fast_monitor(skb, 0, 1, CZ_NAT_EGRESS, slot, skb->len, 0, ip->protocol, ip, sport, dport);
	if (ip->protocol == IPPROTO_UDP)
		flags |= BPF_F_MARK_MANGLED_0;
	ip->saddr = to;
	ip->check = cz_csum_replace32(ip->check, from, to);
	if (bpf_l4_csum_replace(skb, (void *)c - data, from, to, flags) < 0) {
		fast_count(1, CZ_DROP_MALFORMED, slot, skb->len);
		return CZ_TC_DROP;
	}
	fast_count(1, CZ_NAT_EGRESS, slot, skb->len);
	return CZ_TC_NEXT;
}

/* The same for a packet whose source is not yet looked up: CZ_FAST_NOT_POD when it is no pod's */
static __always_inline int fast_egress4(struct __sk_buff *skb, void *data, void *data_end,
					struct iphdr *ip)
{
	struct addr4_val *v = cz_addr4.lookup(&ip->saddr);

	if (!v || !(v->kind & CZ_K_POD))
		return CZ_FAST_NOT_POD;
	return fast_snat4(skb, data, data_end, ip, v);
}

#endif
