// SPDX-License-Identifier: GPL-2.0
/*
 * Load generator for BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES: every frame is rewritten
 * from the template before XDP_TX. Live frames are NOT reset between batches, and a frame that
 * was forwarded comes back to the page pool carrying the forwarder's rewrites (MACs, TTL, NAT),
 * so without this copy nothing would be forwarded after the first batch.
 */
#include <uapi/linux/bpf.h>

#define GEN_LEN 60

struct gen_tmpl {
	__u8 bytes[64];
};

BPF_ARRAY(gen_tmpl, struct gen_tmpl, 1);

int bench_gen(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;
	struct gen_tmpl *t = gen_tmpl.lookup(&zero);

	if (!t || data + GEN_LEN > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(data, t->bytes, GEN_LEN);
	return GEN_VERDICT;
}
