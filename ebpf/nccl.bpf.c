/* nccl.bpf.c: NCCL collective calls of watched processes, through uprobes.
 *
 * Part of the ringwatch.bpf.c translation unit. The agent attaches these to
 * libnccl.so in each watched process that maps it (per pid, so other
 * processes never hit them). Entry saves the arguments per thread; the
 * return sends one record with both times. Never reads the buffers.
 */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32); /* tid */
	__type(value, struct rw_nccl_pending);
} nccl_pending SEC(".maps");

static __always_inline int rw_nccl_entry(struct pt_regs *ctx, __u32 func, bool has_args)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	if (!rw_is_watched(pid_tgid >> 32))
		return 0;
	__u32 tid = (__u32)pid_tgid;
	struct rw_nccl_pending pending = {};
	pending.func = func;
	pending.entry_ns = bpf_ktime_get_ns();
	if (has_args) {
		/* (sendbuff, recvbuff, count, datatype, op|root|comm, ...) */
		pending.count = PT_REGS_PARM3(ctx);
		pending.datatype = PT_REGS_PARM4(ctx);
		if (func != RW_NCCL_ALL_GATHER)
			pending.op = PT_REGS_PARM5(ctx);
	}
	if (bpf_map_update_elem(&nccl_pending, &tid, &pending, BPF_ANY))
		rw_count(RW_COUNTER_MAP_FULL);
	return 0;
}

#define RW_NCCL_ENTRY(prog, func, has_args)                        \
	SEC("uprobe")                                              \
	int prog(struct pt_regs *ctx)                              \
	{                                                          \
		return rw_nccl_entry(ctx, func, has_args);         \
	}

RW_NCCL_ENTRY(rw_nccl_all_reduce, RW_NCCL_ALL_REDUCE, true)
RW_NCCL_ENTRY(rw_nccl_all_gather, RW_NCCL_ALL_GATHER, true)
RW_NCCL_ENTRY(rw_nccl_reduce_scatter, RW_NCCL_REDUCE_SCATTER, true)
RW_NCCL_ENTRY(rw_nccl_broadcast, RW_NCCL_BROADCAST, true)
RW_NCCL_ENTRY(rw_nccl_group_start, RW_NCCL_GROUP_START, false)
RW_NCCL_ENTRY(rw_nccl_group_end, RW_NCCL_GROUP_END, false)

SEC("uretprobe")
int rw_nccl_return(struct pt_regs *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid;
	struct rw_nccl_pending *pending = bpf_map_lookup_elem(&nccl_pending, &tid);
	if (!pending)
		return 0;
	struct rw_nccl_call_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (event) {
		rw_fill_header(&event->hdr, RW_EVENT_NCCL_CALL, bpf_ktime_get_ns());
		event->tgid = pid_tgid >> 32;
		event->tid = tid;
		event->func = pending->func;
		event->datatype = pending->datatype;
		event->op = pending->op;
		event->result = (__s32)PT_REGS_RC(ctx);
		event->count = pending->count;
		event->entry_ns = pending->entry_ns;
		event->return_ns = event->hdr.ts_ns;
		rw_submit(event);
	} else {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
	}
	bpf_map_delete_elem(&nccl_pending, &tid);
	return 0;
}
