// SPDX-License-Identifier: GPL-2.0
/*
 * Load generator for BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES: every frame is rewritten
 * from the template before XDP_TX. Live frames are NOT reset between batches, and a frame that
 * was forwarded comes back to the page pool carrying the forwarder's rewrites (MACs, TTL, NAT),
 * so without this copy nothing would be forwarded after the first batch.
 *
 * With `spread` > 1 (an IPv4 template) each frame of a CPU goes to the next of `spread`
 * consecutive destination addresses from the template's, in turn (a VM that talks to many
 * remote addresses): the IP and UDP checksums follow the address (RFC 1624).
 */
#include <uapi/linux/bpf.h>

#define GEN_LEN 60
#define GEN_IP_CHECK 24	 /* offsets in the frame: Ethernet, then the IPv4 header's checksum, */
#define GEN_IP_DST 30	 /* its destination, */
#define GEN_UDP_CHECK 40 /* and the UDP checksum after a 20-byte header */

struct gen_tmpl {
	__u8 bytes[64];
	__u32 spread; /* destinations to go round; 0 or 1: the template's only */
	__u32 pad;
};

BPF_ARRAY(gen_tmpl, struct gen_tmpl, 1);
BPF_PERCPU_ARRAY(gen_turn, __u32, 1);

/* ones' complement: `check` after a 32-bit word of its data went from `from` to `to` */
static __always_inline __u16 gen_csum4(__u16 check, __u32 from, __u32 to)
{
	__u32 sum = (__u16)~check;

	sum += (__u16)~from + (__u16) ~(from >> 16) + (__u16)to + (__u16)(to >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

int bench_gen(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0, *turn, from, to;
	struct gen_tmpl *t = gen_tmpl.lookup(&zero);

	if (!t || data + GEN_LEN > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(data, t->bytes, GEN_LEN);
	if (t->spread <= 1)
		return GEN_VERDICT;
	turn = gen_turn.lookup(&zero);
	if (!turn)
		return XDP_ABORTED;
	if (++*turn >= t->spread)
		*turn = 0;
	from = *(__u32 *)(data + GEN_IP_DST);
	to = bpf_htonl(bpf_ntohl(from) + *turn);
	*(__u32 *)(data + GEN_IP_DST) = to;
	*(__u16 *)(data + GEN_IP_CHECK) = gen_csum4(*(__u16 *)(data + GEN_IP_CHECK), from, to);
	if (*(__u16 *)(data + GEN_UDP_CHECK))
		*(__u16 *)(data + GEN_UDP_CHECK) =
			gen_csum4(*(__u16 *)(data + GEN_UDP_CHECK), from, to);
	return GEN_VERDICT;
}
