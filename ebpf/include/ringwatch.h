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
	/* 2 was one interval per record: they travel in rw_sched_switch_event */
	RW_EVENT_THREAD_EXIT = 3,
	RW_EVENT_TCP_RETRANSMIT = 4,
	RW_EVENT_TCP_CLOSE = 5,
	RW_EVENT_NCCL_CALL = 6,
};

/* Slots of the `counters` per-CPU array: things counted, never hidden. */
enum rw_counter {
	/* a record could not be reserved in the ring buffer (it was full) */
	RW_COUNTER_RINGBUF_DROPS = 0,
	/* sched_switch events involving a watched process */
	RW_COUNTER_SCHED_SWITCH_SEEN = 1,
	/* intervals not sent because shorter than rw_min_interval_ns
	 * (they are still in the histograms) */
	RW_COUNTER_INTERVALS_SKIPPED = 2,
	/* a map (thread state, histogram, socket, thread traffic, NCCL
	 * pending call) was full: that thread/socket/call is not accounted */
	RW_COUNTER_MAP_FULL = 3,
	/* intervals not sent because their thread reached
	 * rw_max_intervals_per_s (they are still in the histograms) */
	RW_COUNTER_INTERVALS_RATE_LIMITED = 4,
	RW_COUNTER_MAX = 16,
};

/* Why a thread was runnable (its run-queue wait) or how it left the CPU (its
 * on-CPU interval). */
enum rw_interval_cause {
	RW_CAUSE_BLOCKED = 0,   /* on-CPU (and off-CPU): it blocked (slept, waited on I/O) */
	RW_CAUSE_PREEMPTED = 1, /* on-CPU: ended by preemption; run-queue: after one */
	RW_CAUSE_WOKEN = 2,     /* run-queue: after a wakeup */
	RW_CAUSE_NEW = 3,       /* run-queue: a new thread's first wait */
};

/* NCCL entry points (rw_nccl_call_event.func). */
enum rw_nccl_func {
	RW_NCCL_ALL_REDUCE = 1,
	RW_NCCL_ALL_GATHER = 2,
	RW_NCCL_REDUCE_SCATTER = 3,
	RW_NCCL_BROADCAST = 4,
	RW_NCCL_GROUP_START = 5,
	RW_NCCL_GROUP_END = 6,
};

struct rw_event_header {
	__u64 ts_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u32 kind;  /* enum rw_event_kind */
	__u32 cpu;
};

/* The intervals one context switch ended, for the watched threads in it:
 * the outgoing thread's on-CPU interval [on_cpu_start_ns, ts_ns); for the
 * incoming thread its run-queue wait [runnable_ns, ts_ns) and, when it had
 * blocked, the off-CPU interval before it [off_cpu_start_ns, runnable_ns)
 * (sent here rather than at the wakeup that ended it: one record instead of
 * two). One record per switch, not one per interval: each record costs a
 * ring-buffer reservation on the hottest path in the kernel. Each part is
 * there only when it passed rw_min_interval_ns and the rate limit; a switch
 * with no part sends no record (switch counts live in rw_thread_state). */
struct rw_sched_switch_event {
	struct rw_event_header hdr; /* ts_ns: the switch */
	__u32 prev_tgid;
	__u32 prev_tid;
	__u32 next_tgid;
	__u32 next_tid;
	__u64 on_cpu_start_ns;  /* if has_on_cpu */
	__u64 off_cpu_start_ns; /* if has_off_cpu */
	__u64 runnable_ns;      /* if has_run_queue or has_off_cpu */
	__u8 prev_watched;      /* prev_tgid is in watched_tgids */
	__u8 next_watched;      /* next_tgid is in watched_tgids */
	__u8 has_on_cpu;
	__u8 has_off_cpu;
	__u8 has_run_queue;
	__u8 on_cpu_cause;      /* enum rw_interval_cause: preempted or blocked */
	__u8 run_queue_cause;   /* enum rw_interval_cause: preempted, woken or new */
	__u8 _pad;
};

/* The intervals a thread finished that did not leave the kernel (shorter
 * than rw_min_interval_ns, or over the per-thread rate limit): their time and
 * number per kind, so that the agent's totals and per-second figures still
 * add up to the thread's whole time without a record per interval. */
struct rw_unsent {
	__u64 on_cpu_ns;
	__u64 run_queue_ns;
	__u64 off_cpu_ns;
	__u64 on_cpu;         /* intervals */
	__u64 run_queue;      /* waits */
	__u64 off_cpu;        /* intervals */
};

/* A watched thread exited (sent at its last switch out; its kernel-side
 * state is gone), with its final context-switch counts and its name (a
 * thread that lives less than the agent's scan would otherwise have none). */
struct rw_thread_exit_event {
	struct rw_event_header hdr;
	__u32 tgid;
	__u32 tid;
	__u64 switched_out; /* that last switch included */
	__u64 switched_in;
	__u64 preempted;
	char comm[16];      /* task->comm at that switch (NUL-padded) */
	struct rw_unsent unsent; /* its last on-CPU interval included */
};

/* Value of the `thread_state` map (key: tid): where a watched thread is and
 * since when, and its context switches since the agent loaded the programs.
 * The agent reads the map for the counts and for "on CPU since"; the
 * counts of an exited thread come in its rw_thread_exit_event. */
struct rw_thread_state {
	__u64 on_ts;          /* switched in at (valid while on_cpu) */
	__u64 off_ts;         /* switched out at */
	__u64 runq_ts;        /* became runnable at; 0 when not waiting */
	__u64 rate_window_ns; /* start of the current one-second rate window */
	__u64 switched_out;   /* times it left a CPU */
	__u64 switched_in;    /* times it got a CPU */
	__u64 preempted;      /* of switched_out, still runnable (__state 0) */
	__u32 rate_count;     /* intervals sent in the rate window */
	__u32 tgid;
	__u8 on_cpu;
	__u8 runq_cause;      /* enum rw_interval_cause */
	__u8 off_cpu_pending; /* woken: [off_ts, runq_ts) is accounted at its switch in */
	__u8 run_delay_known; /* run_delay_base was read (rw_kernel_wait) */
	__u8 _pad[4];
	struct rw_unsent unsent; /* cumulative */
	/* Whose slot this is in thread_slots (0: free; 64 bits for the
	 * atomics of BPF's first instruction set); 0 in the other stores. */
	__u64 tid;
	/* The kernel's run-queue time of the thread (task->sched_info.run_delay)
	 * at its last switch out or wakeup: its waits since then are the growth
	 * from here (rw_kernel_wait). */
	__u64 run_delay_base;
};

/* Log2 buckets of a histogram of durations (ns): bucket `slot` counts
 * durations d with 2^slot <= d < 2^(slot+1) (slot 0 also holds d = 0). */
#define RW_HIST_SLOTS 64

/* Value of the `sched_hist` map (key: tid): one thread's histograms. */
struct rw_thread_hist {
	__u64 run_queue[RW_HIST_SLOTS]; /* run-queue waits */
	__u64 off_cpu[RW_HIST_SLOTS];   /* off-CPU (blocked) intervals */
};

/* Key of the `thread_net` map. */
struct rw_thread_key {
	__u32 tgid;
	__u32 tid;
};

/* Value of the `thread_net` map: TCP traffic one thread moved (exact bytes
 * each send/receive call returned). */
struct rw_thread_net {
	__u64 tx_bytes;
	__u64 rx_bytes;
	__u64 tx_calls;
	__u64 rx_calls;
};

/* Value of the `sock_stats` map (key: the kernel's struct sock address),
 * one TCP connection used by a watched process. Ports in host order,
 * addresses in network order (IPv4 in the first 4 bytes). */
struct rw_sock_stats {
	__u32 tgid;       /* the first watched process seen using it */
	__u16 family;     /* AF_INET (2) or AF_INET6 (10) */
	__u16 sport;
	__u16 dport;
	__u16 _pad[3];
	__u8 saddr[16];
	__u8 daddr[16];
	__u64 tx_bytes;
	__u64 rx_bytes;
	__u64 tx_calls;
	__u64 rx_calls;
	__u64 retransmits;
	__u32 srtt_us;    /* from the last tcp_probe */
	__u32 cwnd;       /* segments, from the last tcp_probe */
	__u64 opened_ns;  /* connect() (SYN_SENT) or the first send/receive seen */
	__u64 last_ns;    /* last send/receive/probe */
};

/* A segment of a watched connection was retransmitted. */
struct rw_tcp_retransmit_event {
	struct rw_event_header hdr;
	__u64 sock;       /* the struct sock address: key of sock_stats */
	__u32 tgid;
	__u32 _pad;
};

/* A watched connection reached TCP_CLOSE: its final figures (its sock_stats
 * entry is deleted, as the kernel may reuse the address). */
struct rw_tcp_close_event {
	struct rw_event_header hdr;
	__u64 sock;
	struct rw_sock_stats stats;
};

/* One NCCL call of a watched thread, sent when it returns. */
struct rw_nccl_call_event {
	struct rw_event_header hdr;
	__u32 tgid;
	__u32 tid;
	__u32 func;      /* enum rw_nccl_func */
	__u32 datatype;  /* ncclDataType_t */
	__u32 op;        /* ncclRedOp_t (all-reduce, reduce-scatter), root (broadcast), else 0 */
	__s32 result;    /* ncclResult_t returned */
	__u64 count;     /* elements */
	__u64 entry_ns;
	__u64 return_ns;
};

/* Value of the `nccl_pending` map (key: tid) between entry and return. */
struct rw_nccl_pending {
	__u64 entry_ns;
	__u64 count;
	__u32 func;
	__u32 datatype;
	__u32 op;
	__u32 _pad;
};
