/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Map keys and values shared with user space (cozyebpf/datapath/layout.py mirrors them; a test
 * checks sizes and offsets against what bcc generates from this file). This is a contract:
 * never reorder or resize a field; add reservedN slots instead and bump CZ_LAYOUT_VERSION.
 */
#ifndef COZYEBPF_TYPES_H
#define COZYEBPF_TYPES_H

#include <linux/types.h>

#define CZ_LAYOUT_VERSION 2

/* addr4_val.flags, .pod_flags */
#define CZ_F_PORT_FILTER 0x01 /* only allowed ports, replies and (opt.) ICMP pass */
#define CZ_F_ALLOW_ICMP 0x02  /* ICMP passes in port-filter mode */

/* addr4_val.kind: what the address is (both bits: an LB IP that is also some pod's IP) */
#define CZ_K_LB 0x01  /* an LB IP: ingress translates the destination to pod_ip */
#define CZ_K_POD 0x02 /* a pod IP: egress translates the source to lb_ip */

#define CZ_INLINE_PORTS 8   /* allowed ports kept in the address's own value */
#define CZ_PORTS_SPILL 0xff /* nports: more than that; look them up in allow4/allow6 */

/* An allowed port inline; the same bytes as the tail of allow4_key. All zero: none. */
struct cz_port {
	__u8 proto;    /* IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP */
	__u8 reserved; /* zero */
	__be16 port;   /* destination port */
};

/*
 * addr4: key __be32 address -> what one lookup tells every program about it. Ingress uses the
 * LB role when there is one (pod_ip, flags, the allowed ports of pod_ip), else the pod role
 * (no rewrite, flags, the pod's own allowed ports); egress uses the pod role only. What the
 * common paths read comes first and close together (ingress: pod_ip, kind, flags, nports and
 * the first ports; egress: kind, pod_flags, lb_ip), so that a packet touches as few cache lines
 * of the map element as it can.
 */
struct addr4_val {
	__be32 pod_ip;	/* CZ_K_LB: the destination after translation */
	__u8 kind;	/* CZ_K_* */
	__u8 flags;	/* CZ_F_* of ingress: the Service's (CZ_K_LB), else the pod's */
	__u8 pod_flags; /* CZ_F_* of the pod (CZ_K_POD): with PORT_FILTER egress records flows */
	__u8 nports;	/* ports[] used; CZ_PORTS_SPILL: all of them are in allow4 instead */
	__be32 lb_ip;	/* CZ_K_POD: the source after translation on egress */
	struct cz_port ports[CZ_INLINE_PORTS]; /* the ingress pod IP's allowed ports, sorted */
	__u32 reserved[3];		       /* zero; room for a Service index, source ranges */
};

/* allow4: a set; value __u8 (1). Every allowed port of every pod, also those inline in addr4 */
struct allow4_key {
	__be32 pod_ip; /* after translation */
	__u8 proto;    /* IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP */
	__u8 reserved; /* zero */
	__be16 port;   /* destination port */
};

/* flow4: connections the pod opened (port-filter mode), so that replies pass */
struct flow4_key {
	__be32 pod_ip;	    /* the pod's own address */
	__be32 remote_ip;   /* the peer */
	__be16 pod_port;    /* the pod's port; ICMP echo: the identifier */
	__be16 remote_port; /* the peer's port; ICMP echo: 0 */
	__u8 proto;	    /* IPPROTO_* */
	__u8 reserved[3];   /* zero */
};

struct flow4_val {
	__u64 last_seen_ns; /* CLOCK_MONOTONIC_COARSE of the last egress packet, 1 s resolution */
};

/*
 * flowhint: array of 2 * CZ_FLOWHINT_WORDS __u64, a one-hash Bloom filter of the flow tables
 * (both families), in two interleaved halves: the bit of every flow in flow4/flow6 is set, in
 * word 2i by the egress program that records the flow, in word 2i + 1 by user space (flows it
 * copied or seeded). Neither side writes the other's words, so no bit is ever lost to a
 * concurrent update, and both words of a bit share a cache line. Ingress looks a reply up in
 * the flow table only when its bit is set in either. Bits are never cleared: a stale bit costs
 * one lookup, never a verdict.
 */

/* IPv6: the same maps, keyed and valued with 16-byte addresses */
struct ip6 {
	__be32 a[4]; /* network byte order, as in the header */
};

/* addr6: key struct ip6; as addr4_val */
struct addr6_val {
	struct ip6 pod_ip; /* CZ_K_LB: the destination after translation */
	__u8 kind;	   /* CZ_K_* */
	__u8 flags;	   /* CZ_F_* of ingress */
	__u8 pod_flags;	   /* CZ_F_* of the pod */
	__u8 nports;	   /* ports[] used, or CZ_PORTS_SPILL */
	struct ip6 lb_ip;  /* CZ_K_POD: the source after translation on egress */
	struct cz_port ports[CZ_INLINE_PORTS];
	__u32 reserved[3]; /* zero */
};

/* allow6: a set; value __u8 (1) */
struct allow6_key {
	struct ip6 pod_ip;
	__u8 proto;    /* IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP */
	__u8 reserved; /* zero */
	__be16 port;   /* destination port */
};

/* flow6: as flow4; value struct flow4_val */
struct flow6_key {
	struct ip6 pod_ip;
	struct ip6 remote_ip;
	__be16 pod_port;    /* ICMPv6 echo: the identifier */
	__be16 remote_port; /* ICMPv6 echo: 0 */
	__u8 proto;
	__u8 reserved[3];
};

/* frag4/frag6: the verdict of a first fragment, for the fragments after it (port filter) */
struct frag4_key {
	__be32 remote_ip; /* the sender */
	__be32 pod_ip;	  /* the destination after translation */
	__be16 id;	  /* IP identification */
	__u8 proto;
	__u8 reserved; /* zero */
};

struct frag6_key {
	struct ip6 remote_ip;
	struct ip6 pod_ip;
	__be32 id; /* fragment header identification */
	__u8 proto;
	__u8 reserved[3];
};

struct frag_val {
	__u64 seen_ns; /* bpf_ktime_get_ns() of the first fragment */
	__u8 passed;   /* 1: the first fragment passed */
	__u8 reserved[7];
};

/* stats: per-CPU array indexed by enum cz_reason (stats.h) */
struct stat_val {
	__u64 packets;
	__u64 bytes;
};

#endif
