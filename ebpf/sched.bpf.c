/* sched.bpf.c: CPU scheduling of watched processes' threads.
 *
 * Part of the ringwatch.bpf.c translation unit. Reports only switches in
 * which a watched process takes part; everything else returns after one
 * hash lookup per side. Per watched thread it keeps where the thread is
 * (on CPU, runnable, blocked) since when, fills log2 histograms of run-queue
 * waits and off-CPU (blocked) time, and sends finished intervals of at least
 * rw_min_interval_ns, at most rw_max_intervals_per_s per thread; the others
 * are only counted (never silently lost) and are still in the histograms.
 */

/* Set by the agent at load time (aya's set_global); 0 sends every interval. */
const volatile __u64 rw_min_interval_ns = 0;
/* At most this many interval records per thread per second; 0: no limit. */
const volatile __u32 rw_max_intervals_per_s = 0;

/* __state of a task making its last switch (include/linux/sched.h). */
#define RW_TASK_DEAD 0x80

/* Where a watched thread is, and since when. */
struct rw_thread_state {
	__u64 on_ts;     /* switched in at (valid while on_cpu) */
	__u64 off_ts;    /* switched out at */
	__u64 runq_ts;   /* became runnable at; 0 when not waiting */
	__u64 rate_window_ns; /* start of the current one-second rate window */
	__u32 rate_count;     /* records sent in it */
	__u32 tgid;
	__u8 on_cpu;
	__u8 runq_cause; /* enum rw_interval_cause */
	__u8 _pad[6];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tid */
	__type(value, struct rw_thread_state);
} thread_state SEC(".maps");

/* Log2 histograms per thread; the agent deletes a thread's buckets when it
 * forgets the thread. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__type(key, struct rw_hist_key);
	__type(value, __u64);
} sched_hist SEC(".maps");

static __always_inline __u32 rw_log2(__u64 v)
{
	__u32 r = 0, shift;
	shift = (v > 0xFFFFFFFFULL) << 5; v >>= shift; r |= shift;
	shift = (v > 0xFFFF) << 4; v >>= shift; r |= shift;
	shift = (v > 0xFF) << 3; v >>= shift; r |= shift;
	shift = (v > 0xF) << 2; v >>= shift; r |= shift;
	shift = (v > 0x3) << 1; v >>= shift; r |= shift;
	r |= (v >> 1);
	return r;
}

static __always_inline void rw_hist_add(__u32 tid, __u16 kind, __u64 duration_ns)
{
	struct rw_hist_key key = { .tid = tid, .kind = kind, .slot = rw_log2(duration_ns) };
	__u64 *count = bpf_map_lookup_elem(&sched_hist, &key);
	if (!count) {
		__u64 zero = 0;
		bpf_map_update_elem(&sched_hist, &key, &zero, BPF_NOEXIST);
		count = bpf_map_lookup_elem(&sched_hist, &key);
		if (!count) {
			rw_count(RW_COUNTER_MAP_FULL);
			return;
		}
	}
	__sync_fetch_and_add(count, 1);
}

static __always_inline void rw_send_interval(struct rw_thread_state *state, __u32 tgid,
					     __u32 tid, __u32 interval, __u32 cause,
					     __u64 start_ns, __u64 end_ns)
{
	__u64 duration = end_ns - start_ns;
	if (duration < rw_min_interval_ns) {
		rw_count(RW_COUNTER_INTERVALS_SKIPPED);
		return;
	}
	if (rw_max_intervals_per_s) {
		if (end_ns - state->rate_window_ns >= 1000000000ULL) {
			state->rate_window_ns = end_ns;
			state->rate_count = 0;
		}
		if (state->rate_count >= rw_max_intervals_per_s) {
			rw_count(RW_COUNTER_INTERVALS_RATE_LIMITED);
			return;
		}
		state->rate_count++;
	}
	struct rw_sched_interval_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return;
	}
	rw_fill_header(&event->hdr, RW_EVENT_SCHED_INTERVAL, end_ns);
	event->tgid = tgid;
	event->tid = tid;
	event->start_ns = start_ns;
	event->duration_ns = duration;
	event->interval = interval;
	event->cause = cause;
	rw_submit(event);
}

static __always_inline struct rw_thread_state *rw_thread(__u32 tid, __u32 tgid)
{
	struct rw_thread_state *state = bpf_map_lookup_elem(&thread_state, &tid);
	if (state)
		return state;
	struct rw_thread_state fresh = { .tgid = tgid };
	bpf_map_update_elem(&thread_state, &tid, &fresh, BPF_NOEXIST);
	state = bpf_map_lookup_elem(&thread_state, &tid);
	if (!state)
		rw_count(RW_COUNTER_MAP_FULL);
	return state;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(rw_sched_switch, bool preempt, struct task_struct *prev,
	     struct task_struct *next, unsigned int prev_state)
{
	__u32 prev_tgid = prev->tgid;
	__u32 next_tgid = next->tgid;
	bool prev_watched = rw_is_watched(prev_tgid);
	bool next_watched = rw_is_watched(next_tgid);

	if (!prev_watched && !next_watched)
		return 0;
	rw_count(RW_COUNTER_SCHED_SWITCH_SEEN);
	__u64 now = bpf_ktime_get_ns();

	if (prev_watched) {
		__u32 tid = prev->pid;
		/* Lookup only: an exiting thread's last switch must not bring
		 * back the state that sched_process_exit deleted. */
		struct rw_thread_state *state = bpf_map_lookup_elem(&thread_state, &tid);
		if (!state && !(prev_state & RW_TASK_DEAD))
			state = rw_thread(tid, prev_tgid);
		if (state) {
			/* Preempted (or still runnable): it waits on the run
			 * queue from now on; otherwise it blocked until woken. */
			bool runnable = preempt || prev_state == 0;
			if (state->on_cpu)
				rw_send_interval(state, prev_tgid, tid, RW_INTERVAL_ON_CPU,
						 runnable ? RW_CAUSE_PREEMPTED : RW_CAUSE_BLOCKED,
						 state->on_ts, now);
			state->on_cpu = 0;
			state->off_ts = now;
			state->runq_ts = runnable ? now : 0;
			state->runq_cause = RW_CAUSE_PREEMPTED;
		}
	}
	if (next_watched) {
		__u32 tid = next->pid;
		struct rw_thread_state *state = rw_thread(tid, next_tgid);
		if (state) {
			if (state->runq_ts) {
				__u64 wait = now - state->runq_ts;
				rw_hist_add(tid, RW_HIST_RUN_QUEUE, wait);
				rw_send_interval(state, next_tgid, tid, RW_INTERVAL_RUN_QUEUE,
						 state->runq_cause, state->runq_ts, now);
			}
			state->runq_ts = 0;
			state->on_cpu = 1;
			state->on_ts = now;
		}
	}

	struct rw_sched_switch_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return 0;
	}
	rw_fill_header(&event->hdr, RW_EVENT_SCHED_SWITCH, now);
	event->prev_tgid = prev_tgid;
	event->prev_tid = prev->pid;
	event->next_tgid = next_tgid;
	event->next_tid = next->pid;
	event->prev_state = prev_state;
	event->preempt = preempt;
	event->prev_watched = prev_watched;
	event->next_watched = next_watched;
	event->_pad = 0;
	rw_submit(event);
	return 0;
}

/* A blocked watched thread became runnable: its off-CPU interval ends and
 * its run-queue wait begins. */
static __always_inline void rw_woken(struct task_struct *p, bool new_thread)
{
	__u32 tgid = p->tgid;
	if (!rw_is_watched(tgid))
		return;
	__u32 tid = p->pid;
	struct rw_thread_state *state = rw_thread(tid, tgid);
	if (!state)
		return;
	/* A wakeup of a thread still on CPU (woken before it switched out)
	 * or already runnable ends nothing. */
	if (state->on_cpu || state->runq_ts)
		return;
	__u64 now = bpf_ktime_get_ns();
	if (new_thread) {
		state->runq_cause = RW_CAUSE_NEW;
	} else {
		if (!state->off_ts)
			return; /* first seen now: we do not know when it blocked */
		rw_hist_add(tid, RW_HIST_OFF_CPU, now - state->off_ts);
		rw_send_interval(state, tgid, tid, RW_INTERVAL_OFF_CPU, RW_CAUSE_BLOCKED,
				 state->off_ts, now);
		state->runq_cause = RW_CAUSE_WOKEN;
	}
	state->runq_ts = now;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(rw_sched_wakeup, struct task_struct *p)
{
	rw_woken(p, false);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(rw_sched_wakeup_new, struct task_struct *p)
{
	rw_woken(p, true);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(rw_sched_process_exit, struct task_struct *p)
{
	__u32 tgid = p->tgid;
	if (!rw_is_watched(tgid))
		return 0;
	__u32 tid = p->pid;
	bpf_map_delete_elem(&thread_state, &tid);
	struct rw_thread_exit_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return 0;
	}
	rw_fill_header(&event->hdr, RW_EVENT_THREAD_EXIT, bpf_ktime_get_ns());
	event->tgid = tgid;
	event->tid = tid;
	rw_submit(event);
	return 0;
}
