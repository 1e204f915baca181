/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Map keys and values shared with user space (cozyebpf/datapath/layout.py mirrors them; a test
 * checks sizes and offsets against what bcc generates from this file). This is a contract:
 * never reorder or resize a field; add reservedN slots instead and bump CZ_LAYOUT_VERSION.
 */
#ifndef COZYEBPF_TYPES_H
#define COZYEBPF_TYPES_H

#include <uapi/linux/types.h>

#define CZ_LAYOUT_VERSION 7

/* addr4_val.flags, .pod_flags */
#define CZ_F_PORT_FILTER 0x01 /* only allowed ports, replies and (opt.) ICMP pass */
#define CZ_F_ALLOW_ICMP 0x02  /* ICMP passes in port-filter mode */
/*
 * flags: the pod accepts only the sources in range4/range6 (loadBalancerSourceRanges), and
 * replies to its own flows; pod_flags: egress records the pod's flows (as with PORT_FILTER)
 */
#define CZ_F_RANGES 0x04
#define CZ_F_FLOWS (CZ_F_PORT_FILTER | CZ_F_RANGES) /* pod_flags: egress records flows */
/*
 * flags: the pod is migrating (ready on two nodes, or moved a moment ago): its flows were
 * recorded on the node it came from, so TCP that opens nothing (no SYN, or SYN with ACK) passes
 * where only a reply would (pass_learn), in the fast paths (a frame they leave to a full path is
 * decided as before: a branch there costs its verification a third more); the pod's answer
 * records the flow here
 */
#define CZ_F_LEARN 0x08
/*
 * flags (an LB IP): its Service has ingress limits; pod_flags (a pod IP): its Service has an
 * egress limit. Either: the Service's slot indexes `limits` and `buckets` (limit.h). Since
 * 0.3.0, in layout 7 still: older programs never read it.
 */
#define CZ_F_LIMIT 0x10

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
	__u32 in_slot; /* svcstats slot of ingress: the LB IP's Service, else the pod's (0: none) */
	__u32 out_slot; /* svcstats slot of egress (CZ_K_POD): the Service of lb_ip (0: none) */
	/*
	 * CZ_K_POD: the device the node routes the pod IP to, as the programs last confirmed it
	 * (cz_spoofed in source.h); user space writes 0 ("not known yet"). Was `reserved`, zero:
	 * values of older layouts are valid as they are.
	 */
	__u32 dev;
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

/*
 * last_seen_ns: bits 0-62 CLOCK_MONOTONIC_COARSE of the pod's last packet of the flow (egress,
 * refreshed at most once a second); bit 63 (CZ_FLOW_CLOSING) set once the pod sent a TCP FIN or
 * RST (cleared by a SYN): the flow then expires after the closing timeout (flowcfg).
 */
#define CZ_FLOW_CLOSING (1ULL << 63)

struct flow4_val {
	__u64 last_seen_ns; /* the time (bits 0-62) and CZ_FLOW_CLOSING */
};

/*
 * flowcfg: array of one. The idle timeouts after which a flow no longer admits replies, written
 * by the agent (--flow-timeout-*); 0: never.
 */
#define CZ_TO_UDP 0	    /* UDP */
#define CZ_TO_ICMP 1	    /* ICMP and ICMPv6 echo */
#define CZ_TO_TCP 2	    /* TCP and SCTP */
#define CZ_TO_TCP_CLOSING 3 /* TCP after the pod's FIN or RST */

/*
 * The node's part (docs/design.md, "On a Cozystack cluster"), in what layout 5 kept reserved (a
 * layout-5 agent writes zeros: the cluster paths are then off): the ifindexes of the uplinks
 * (--devices), which the FIB's output device is compared with, and CZ_CFG_* flags.
 */
#define CZ_UPLINKS_MAX 6
#define CZ_CFG_POD_DEVICES 0x01	 /* pod-facing hooks are attached: the cluster paths are on */
#define CZ_CFG_HOST_ROUTING 0x02 /* --host-routing on: translated packets skip the stack */
#define CZ_CFG_SHAPED 0x04	 /* every uplink has fq: egress limits shape (limit.h, cz_shape) */
/* XDP metadata: ingress let this frame through; cz_route_tc hands it on (lib/route.h) */
#define CZ_META_ROUTE 0x72687a63

struct flow_cfg {
	__u64 timeout_ns[4];	       /* by CZ_TO_* */
	__u32 uplinks[CZ_UPLINKS_MAX]; /* ifindexes of the uplinks; 0: unused */
	__u32 flags;		       /* CZ_CFG_* */
	/*
	 * The node's routes' generation, bumped by the agent on every change of routes, rules and
	 * links (and by each write of the node's part): cz_fib4_cached's answers are valid while
	 * it is the one they were asked under. Was `reserved`, zero; older programs never read it.
	 */
	__u32 fib_gen;
};

/*
 * range4: LPM trie of the sources each restricted pod (CZ_F_RANGES) accepts; value __u8 (1).
 * prefixlen is 32 (the pod IP, whole) + the range's prefix length.
 */
struct range4_key {
	__u32 prefixlen; /* 32 + the range's prefix length */
	__be32 pod_ip;	 /* the pod's own address */
	__be32 src;	 /* the range's network address */
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

/*
 * rolehint (layout 7, since 0.4.0): array of CZ_ROLEHINT_MAX __u64, one-hash Bloom filters of
 * addr4's keys by role, in two halves of 1 << CZ_ROLEHINT_LOG2 bits: the pod IPs (words from 0),
 * the LB IPs (words from CZ_ROLEHINT_MAX / 2). User space is its only writer: a key's bit is set
 * before the key is written and cleared (when no other key has it) after the key is gone, so an
 * address whose bit is clear has no such role in addr4, and the pod-facing hook and the uplinks'
 * egress let a packet go without a lookup when its source is no pod IP and its destination no LB
 * IP. A stale bit costs a lookup, never a verdict.
 *
 * addrhint (layout 7, 0.3.0's): one filter of every key over the whole array, which 0.3.0's
 * programs read. These programs do not; user space keeps it so, for 0.3.0's programs while they
 * are still attached (an upgrade from 0.3.0, a rollback to it). A pinned map keeps its meaning
 * within a layout: the role split is rolehint, not a new reading of addrhint.
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
	__u32 in_slot;	/* as addr4_val */
	__u32 out_slot; /* as addr4_val */
	__u32 dev;	/* as addr4_val */
};

/* allow6: a set; value __u8 (1) */
struct allow6_key {
	struct ip6 pod_ip;
	__u8 proto;    /* IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP */
	__u8 reserved; /* zero */
	__be16 port;   /* destination port */
};

/* range6: as range4; prefixlen 128 + the range's prefix length */
struct range6_key {
	__u32 prefixlen;
	struct ip6 pod_ip;
	struct ip6 src;
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

/*
 * seen4/seen6: per-CPU arrays of CZ_SEEN_MAX, indexed by the low bits of the flow hint (a
 * direct-mapped cache): the flow whose entry a fast path of this CPU last looked up (and found,
 * refreshed or added), when (checked), and the time the entry then held (time: bits 0-62 of
 * last_seen_ns). Within CZ_SEEN_NS of `checked` the slot stands for the entry: egress need not
 * refresh it while `time` is under a second old, and a reply passes while `time` is live under
 * both of its protocol's timeouts (lib/flow.h, flow_record, flow_reply). A zeroed slot
 * matches no flow. User space zeroes every slot when it writes, deletes or replaces flow
 * entries; an entry the LRU evicts from under a busy flow is recorded again, and stops
 * admitting replies, within CZ_SEEN_NS.
 */
struct flow4_seen {
	struct flow4_key key;
	__u64 time;
	__u64 checked;
};

struct flow6_seen {
	struct flow6_key key;
	__u64 time;
	__u64 checked;
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

/*
 * svcstats: per-CPU array indexed by a Service's slot, which the control plane allocates and
 * writes into the addr values of the Service's addresses (in_slot, out_slot); svcnames (user
 * space only: hash, slot -> struct svc_name) names it. Slot 0 is never allocated: traffic of an
 * address without a slot is counted there, and nothing reads it. Every packet counted under a
 * reason (stats.h) is counted here once more for its Service: accepted ones by direction,
 * dropped ones by reason.
 */
#define CZ_SVC_DROPS 16 /* drops[]: cz_drop_index() of each drop reason (11 used); layout 6 */

struct svc_stat {
	__u64 in_packets; /* accepted on ingress: translated or passed by the port filter */
	__u64 in_bytes;
	__u64 out_packets; /* translated on egress */
	__u64 out_bytes;
	__u64 drops[CZ_SVC_DROPS]; /* dropped packets, by cz_drop_index(reason) */
};

/*
 * limits: array indexed by a Service's slot (as svcstats), written by the control plane: the
 * Service's limits as GCRA buckets (limit.h; cozyebpf/datapath/buckets.py, Bucket): `unit`, the
 * time one byte (or packet) takes at the rate in 2^-16 ns, 0 for no such limit; `tol`, the
 * burst's time in ns. Since 0.3.0, in layout 7 still: older agents leave the map.
 */
#define CZ_UNIT_SHIFT 16

struct cz_gcra {
	__u64 unit; /* 2^-16 ns per byte (or packet); 0: no limit */
	__u64 tol;  /* ns: how far the bucket's time may run ahead of the clock */
};

struct cz_limit {
	struct cz_gcra in_bytes;  /* ingress: bits per second (ingressBandwidth) */
	struct cz_gcra in_pkts;	  /* ingress: packets per second (ingressPacketRate, the guard) */
	struct cz_gcra out_bytes; /* egress: bits per second (egressBandwidth) */
	/* user space's, which the programs never read: the rates as asked (ingress bits/s,
	 * ingress packets/s, egress bits/s; 0: none) and 1 when in_pkts is the node's guard */
	__u64 rates[3];
	__u64 guard;
};

/*
 * buckets: array indexed by the same slot, the programs' own: each bucket's time (GCRA's
 * theoretical arrival time on the limits' clock, limit.h; 0: full), shared by every CPU, and the
 * shaped egress's next departure time (bpf_ktime_get_ns(), the clock fq compares skb->tstamp
 * with; 0: none). Ingress and egress on cache lines of their own (their CPUs differ). Pinned: an
 * agent's restart or upgrade keeps them, so that no bucket starts full again.
 */
struct cz_bucket {
	__u64 in_bytes; /* ingress, the bytes' time */
	__u64 in_pkts;	/* ingress, the packets' time */
	__u64 reserved0[6];
	__u64 out_bytes; /* egress policed, the bytes' time */
	__u64 out_edt;	 /* egress shaped, the next departure (was reserved, zero) */
	__u64 reserved1[6];
};

/* svcnames: key __u32 slot; strings NUL-padded */
struct svc_name {
	char ns[64];   /* the Service's namespace */
	char name[64]; /* its name */
	__u32 active;  /* 1: its addresses carry the slot; 0: parked (kept for the same Service) */
	__u32 reserved;
};

/*
 * monctl: array of one. The monitor's switch, which every counted packet reads, and the token
 * bucket that limits the events (GCRA: one event per interval_ns, bursts of burst_ns). tat is
 * written on every event: 64 bytes away from the switch, on another cache line.
 */
#define CZ_MON_OFF 0
#define CZ_MON_DROPS 1 /* events for dropped packets */
#define CZ_MON_ALL 2   /* events for every counted packet */

struct mon_ctl {
	__u32 mode; /* CZ_MON_* */
	__u32 reserved0;
	__u64 interval_ns;  /* nanoseconds per event at the sustained rate */
	__u64 burst_ns;	    /* how far tat may run ahead of the clock: the burst */
	__u64 reserved1[5]; /* zero */
	__u64 tat;	    /* theoretical arrival time (CLOCK_MONOTONIC_COARSE, ns) */
	__u64 reserved2[7]; /* zero */
};

/* monstats: per-CPU array of one */
struct mon_stat {
	__u64 events;	  /* events written to the ring buffer */
	__u64 lost_limit; /* events the token bucket refused */
	__u64 lost_full;  /* events that found the ring buffer full */
	__u64 reserved;
};

/* events: ring buffer of struct cz_event, one per counted packet the monitor wants */
struct cz_event {
	__u64 time_ns; /* bpf_ktime_get_ns() */
	__u32 ifindex; /* the device */
	__u32 slot;    /* the Service's svcstats slot (0: none) */
	__u32 len;     /* frame length */
	__u8 reason;   /* enum cz_reason */
	__u8 dir;      /* 0 ingress, 1 egress */
	__u8 proto;    /* IPPROTO_* */
	__u8 v6;       /* 1: IPv6 addresses */
	__be16 sport;  /* ports (ICMP echo: the identifier), 0 without an L4 header */
	__be16 dport;
	__u32 reserved; /* zero */
	struct ip6 src; /* as received, before translation (IPv4: a[0]) */
	struct ip6 dst;
};

/*
 * dryrun: per-CPU array of one. `cozyebpf explain` runs the attached program with
 * BPF_PROG_RUN on a frame carrying a marker that real traffic cannot carry (XDP: 16 bytes of
 * metadata before the frame; tc: skb->cb[0..3]) and an 802.1Q tag (a frame the fast path leaves
 * to the full path). The full path then changes nothing (no counter, flow, fragment entry or
 * event) and writes its decision here instead, with the marker's nonce.
 */
#define CZ_DRY_MAGIC 0x31757279647a6363ULL /* "ccdzyru1", the marker's first 8 bytes */

struct dry_res {
	__u64 nonce;  /* the marker's second 8 bytes */
	__u32 reason; /* enum cz_reason, or 0xffffffff: not for a managed address */
	__u32 slot;   /* the Service's slot (0: none) */
};

#endif
