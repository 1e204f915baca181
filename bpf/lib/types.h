/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Map keys and values shared with user space (cozyebpf/datapath/layout.py mirrors them; a test
 * checks sizes and offsets against what bcc generates from this file). This is a contract:
 * never reorder or resize a field; add reservedN slots instead and bump CZ_LAYOUT_VERSION.
 */
#ifndef COZYEBPF_TYPES_H
#define COZYEBPF_TYPES_H

#include <linux/types.h>

#define CZ_LAYOUT_VERSION 1

/* svc4_val.flags and pod4_val.flags */
#define CZ_F_PORT_FILTER 0x01 /* only allowed ports, replies and (opt.) ICMP pass */
#define CZ_F_ALLOW_ICMP 0x02  /* ICMP passes in port-filter mode */

/* svc4: key __be32 LB IP */
struct svc4_val {
	__be32 pod_ip;	  /* destination after translation */
	__u8 flags;	  /* CZ_F_* */
	__u8 reserved[3]; /* zero */
};

/* pod4: key __be32 pod IP */
struct pod4_val {
	__be32 lb_ip;	  /* source after translation on egress */
	__u8 flags;	  /* CZ_F_* of the Service that owns the pod's egress */
	__u8 reserved[3]; /* zero */
};

/* allow4: a set; value __u8 (1) */
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
	__u64 last_seen_ns; /* bpf_ktime_get_ns() of the last egress packet, 1 s resolution */
};

/* IPv6: the same maps, keyed and valued with 16-byte addresses */
struct ip6 {
	__be32 a[4]; /* network byte order, as in the header */
};

/* svc6: key struct ip6 (LB IP) */
struct svc6_val {
	struct ip6 pod_ip; /* destination after translation */
	__u8 flags;	   /* CZ_F_* */
	__u8 reserved[3];  /* zero */
};

/* pod6: key struct ip6 (pod IP) */
struct pod6_val {
	struct ip6 lb_ip; /* source after translation on egress */
	__u8 flags;	  /* CZ_F_* */
	__u8 reserved[3]; /* zero */
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
