/* ringwatch.h: the records that leave the kernel, and the maps' key layouts.
 *
 * The agent mirrors every struct here with a #[repr(C)] struct in
 * ebpf/src/lib.rs; a test (ebpf/tools/layout_probe.c + the `layout` test)
 * checks that sizes and offsets agree. Fixed-width fields only, padding
 * written out, so the layout is the same for the BPF target and the host.
 */
#pragma once

#include <linux/types.h>

/* Kinds of ring-buffer records; every record starts with rw_event_header. */
enum rw_event_kind {
	RW_EVENT_SCHED_SWITCH = 1,
};

/* Slots of the `counters` per-CPU array: things counted, never hidden. */
enum rw_counter {
	/* a record could not be reserved in the ring buffer (it was full) */
	RW_COUNTER_RINGBUF_DROPS = 0,
	/* sched_switch events involving a watched process */
	RW_COUNTER_SCHED_SWITCH_SEEN = 1,
	RW_COUNTER_MAX = 16,
};

struct rw_event_header {
	__u64 ts_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u32 kind;  /* enum rw_event_kind */
	__u32 cpu;
};

/* One context switch on a CPU where the outgoing or incoming thread belongs
 * to a watched process. */
struct rw_sched_switch_event {
	struct rw_event_header hdr;
	__u32 prev_tgid;
	__u32 prev_tid;
	__u32 next_tgid;
	__u32 next_tid;
	__u32 prev_state;  /* the outgoing task's __state: 0 = runnable (preempted) */
	__u8 preempt;      /* the switch was a preemption */
	__u8 prev_watched; /* prev_tgid is in watched_tgids */
	__u8 next_watched; /* next_tgid is in watched_tgids */
	__u8 _pad;
};
