// SPDX-License-Identifier: GPL-2.0
/*
 * A paced load generator for BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (bench/limits.py's
 * fixed-rate flood): like bench_gen (gen.c) it copies the 60-byte template over every live
 * frame, but sends it (XDP_TX) only when its time has come, one frame every `gap_ns`, and
 * drops it (XDP_DROP: the frame goes back to the pool, nothing leaves) otherwise. A run then
 * offers the same rate to whatever is behind the device, however fast that takes the frames,
 * within one long call: a call of BPF_PROG_RUN costs some 20 ms of set-up and tear-down on
 * this VM, so pacing by short calls and sleeps cannot go past about 150,000 frames a second.
 * One generator thread runs it (no atomics); a lag of more than 64 gaps is forgiven, not
 * caught up in a burst.
 */
#include <uapi/linux/bpf.h>

#define GEN_LEN 60
#define PACE_SLACK 64

struct pace_state {
	__u8 bytes[64]; /* the template (the first GEN_LEN bytes are used) */
	__u64 gap_ns;	/* between two frames sent */
	__u64 next_ns;	/* when the next one may go */
	__u64 sent;	/* frames sent (XDP_TX) so far */
};

BPF_ARRAY(pace, struct pace_state, 1);

int bench_gen_paced(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;
	struct pace_state *p = pace.lookup(&zero);
	__u64 now;

	if (!p || data + GEN_LEN > data_end)
		return XDP_ABORTED;
	now = bpf_ktime_get_ns();
	if (now < p->next_ns)
		return XDP_DROP;
	if (p->next_ns + PACE_SLACK * p->gap_ns < now)
		p->next_ns = now;
	p->next_ns += p->gap_ns;
	p->sent += 1;
	__builtin_memcpy(data, p->bytes, GEN_LEN);
	return XDP_TX;
}
