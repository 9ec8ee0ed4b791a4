/* sched.bpf.c: CPU scheduling of watched processes' threads.
 *
 * Part of the ringwatch.bpf.c translation unit. Reports only switches in
 * which a watched process takes part; everything else returns after one
 * bitmap test per side. Per watched thread it keeps where the thread is
 * (on CPU, runnable, blocked) since when and counts its switches (in its
 * slot of `thread_slots`, in its task storage, `task_state`, or in the
 * `thread_state` hash map; see rw_thread_slots and rw_task_storage), fills
 * log2 histograms of run-queue waits and off-CPU (blocked) time where the
 * agent asked for them
 * (rw_histograms), and sends finished intervals of at least
 * rw_min_interval_ns, at most rw_max_intervals_per_s per thread; the others
 * are only counted (never silently lost): their time and number per kind
 * add up in the thread's state (rw_unsent), and they are in the histograms.
 *
 * This runs on every context switch of the watched job, so it sends at most
 * one record per switch (the intervals a switch ends travel together, the
 * off-CPU interval a wakeup ends with the switch in after it) and none when
 * there is nothing to send: every ring-buffer record costs a reservation, a
 * cache line and the agent's time to read it.
 */

/* Set by the agent at load time (aya's set_global); 0 sends every interval. */
const volatile __u64 rw_min_interval_ns = 0;
/* At most this many interval records per thread per second; 0: no limit. */
const volatile __u32 rw_max_intervals_per_s = 0;
/* Whether to fill the per-thread histograms (sched_hist). Only `watch`
 * reads them; without them a switch in saves a hash lookup and two
 * atomic adds, about a fifth of this program's run time under a busy job
 * (the verifier drops the dead branch, so off costs nothing). */
const volatile __u8 rw_histograms = 1;

/* Where a thread's rw_thread_state lives: 1 in task storage (task_state),
 * 0 in the thread_state hash map. The agent picks task storage where it can
 * read an entry back (a pidfd of any thread: Linux >= 6.9): the state then
 * hangs off the task_struct the switch already has in its cache, which saved
 * ~60 ns a watched switch and ~50 a wakeup against hashing the tid. The
 * verifier drops the branch not taken. */
const volatile __u8 rw_task_storage = 0;

/* 1: a watched thread's state lives first in its slot of thread_slots, an
 * array indexed by tid & rw_thread_slot_mask. An array lookup is inlined by
 * the verifier (a bounds check and an add, no helper call), which took
 * 50-70 ns off each watched switch in all (30-45 by the BPF statistics)
 * and 60-75 off each wakeup against task storage on this project's 2-core
 * test VM (docs/BENCHMARKS.md); it works on every kernel, and
 * user space reads a slot by its index. A slot names its thread (tid; 0 is
 * free, the idle task is never watched); a thread whose slot another live
 * thread holds (only where pid_max exceeds the slots) uses the hash map.
 * A thread's last switch frees its slot. */
const volatile __u8 rw_thread_slots = 0;
const volatile __u32 rw_thread_slot_mask = 0;

/* __state of a task making its last switch (include/linux/sched.h). */
#define RW_TASK_DEAD 0x80

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tid */
	__type(value, struct rw_thread_state); /* include/ringwatch.h */
} thread_state SEC(".maps");

/* The same state, a slot per thread id (rw_thread_slots). 65,536 slots
 * (8 MiB) by default; the agent sets the size (a power of two) at load
 * time, and 1 when another store is used. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32); /* tid & rw_thread_slot_mask */
	__type(value, struct rw_thread_state);
} thread_slots SEC(".maps");

/* The same state in task storage (rw_task_storage): freed with the task;
 * user space reads an entry by a pidfd of the thread. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int); /* pidfd, from user space */
	__type(value, struct rw_thread_state);
} task_state SEC(".maps");

/* Log2 histograms, one entry per thread; the agent deletes a thread's entry
 * when it forgets the thread. One entry per thread (not one per bucket) so
 * that an add looks up a key that the thread's own events keep hot in the
 * cache: a key per bucket spread the adds over a 4 MiB bucket array and
 * cost more than the rest of sched_switch. 16 MiB preallocated, as before. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tid */
	__type(value, struct rw_thread_hist);
} sched_hist SEC(".maps");

/* Never written: the zeros a new sched_hist entry starts from (an entry is
 * larger than the BPF stack). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rw_thread_hist);
} sched_hist_zero SEC(".maps");

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

static __always_inline struct rw_thread_hist *rw_hist_of(__u32 tid)
{
	struct rw_thread_hist *hist = bpf_map_lookup_elem(&sched_hist, &tid);
	if (hist)
		return hist;
	__u32 zero_key = 0;
	struct rw_thread_hist *zero = bpf_map_lookup_elem(&sched_hist_zero, &zero_key);
	if (!zero)
		return 0;
	bpf_map_update_elem(&sched_hist, &tid, zero, BPF_NOEXIST);
	hist = bpf_map_lookup_elem(&sched_hist, &tid);
	if (!hist)
		rw_count(RW_COUNTER_MAP_FULL);
	return hist;
}

/* Counts one run-queue wait (run_queue true) or off-CPU interval in a
 * thread's histograms (none: the map was full, already counted). */
static __always_inline void rw_hist_count(struct rw_thread_hist *hist, bool run_queue,
					  __u64 duration_ns)
{
	if (!hist)
		return;
	__u32 slot = rw_log2(duration_ns) & (RW_HIST_SLOTS - 1);
	__sync_fetch_and_add(run_queue ? &hist->run_queue[slot] : &hist->off_cpu[slot], 1);
}

/* Whether an interval of `duration_ns` ending at `end_ns` leaves the kernel:
 * long enough, and within its thread's rate limit (which it then uses up).
 * What is held back is counted, and its time and number are added to the
 * thread's `unsent_ns` and `unsent` (one kind of its rw_unsent). */
static __always_inline bool rw_interval_sent(struct rw_thread_state *state,
					     __u64 duration_ns, __u64 end_ns,
					     __u64 *unsent_ns, __u64 *unsent)
{
	if (duration_ns < rw_min_interval_ns) {
		rw_count(RW_COUNTER_INTERVALS_SKIPPED);
		goto held_back;
	}
	if (rw_max_intervals_per_s) {
		if (end_ns - state->rate_window_ns >= 1000000000ULL) {
			state->rate_window_ns = end_ns;
			state->rate_count = 0;
		}
		if (state->rate_count >= rw_max_intervals_per_s) {
			rw_count(RW_COUNTER_INTERVALS_RATE_LIMITED);
			goto held_back;
		}
		state->rate_count++;
	}
	return true;
held_back:
	*unsent_ns += duration_ns;
	*unsent += 1;
	return false;
}

/* The thread's slot of thread_slots if it holds it, or (claim) takes it if
 * free; none if another thread holds it. */
static __always_inline struct rw_thread_state *rw_slot(__u32 tid, bool claim)
{
	__u32 index = tid & rw_thread_slot_mask;
	struct rw_thread_state *slot = bpf_map_lookup_elem(&thread_slots, &index);
	if (!slot)
		return 0;
	if (slot->tid == tid)
		return slot;
	if (!claim || slot->tid != 0)
		return 0;
	/* A free slot is all zeros (rw_release); two CPUs may race for it,
	 * the thread itself among them (its switch out on one CPU, its
	 * wakeup on another): the slot is its own then too. */
	__u64 was = __sync_val_compare_and_swap(&slot->tid, 0, tid);
	return was == 0 || was == tid ? slot : 0;
}

/* A watched thread's state, created if it has none (none: no memory, or
 * task storage busy on this CPU; counted as a full map). */
static __always_inline struct rw_thread_state *rw_thread(struct task_struct *task,
							  __u32 tid, __u32 tgid)
{
	if (rw_thread_slots) {
		struct rw_thread_state *state = rw_slot(tid, false);
		if (state)
			return state;
		/* A thread that went to the hash map (its slot was held when it
		 * was first seen) stays there for its life: claiming the slot
		 * once it is free would start it over from zero counts. */
		if (!rw_task_storage) {
			state = bpf_map_lookup_elem(&thread_state, &tid);
			if (state)
				return state;
		}
		state = rw_slot(tid, true);
		if (state) {
			if (!state->tgid)
				state->tgid = tgid;
			return state;
		}
		/* Held by another thread: the hash map, below. */
	}
	if (rw_task_storage) {
		struct rw_thread_state *state = bpf_task_storage_get(
			&task_state, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (!state) {
			rw_count(RW_COUNTER_MAP_FULL);
			return 0;
		}
		if (!state->tgid)
			state->tgid = tgid;
		return state;
	}
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

/* A thread's state if it has one, without creating it. */
static __always_inline struct rw_thread_state *rw_thread_if_any(struct task_struct *task,
								 __u32 tid)
{
	if (rw_thread_slots) {
		struct rw_thread_state *state = rw_slot(tid, false);
		if (state)
			return state;
	}
	if (rw_task_storage)
		return bpf_task_storage_get(&task_state, task, 0, 0);
	return bpf_map_lookup_elem(&thread_state, &tid);
}

/* A dead thread's state goes (the kernel may reuse the tid): its slot is
 * zeroed and then freed, or its hash entry deleted; task storage goes with
 * the task. */
static __always_inline void rw_release(__u32 tid)
{
	if (rw_thread_slots) {
		struct rw_thread_state *slot = rw_slot(tid, false);
		if (slot) {
			*slot = (struct rw_thread_state){ .tid = tid };
			/* Last, and a full barrier: a claim must find it zeroed. */
			__sync_lock_test_and_set(&slot->tid, 0);
			return;
		}
	}
	if (!rw_task_storage)
		bpf_map_delete_elem(&thread_state, &tid);
}

/* A watched thread's last switch out: its final counts leave with the
 * exit record, and its state goes (the kernel may reuse the tid). */
static __always_inline void rw_thread_exited(__u32 tgid, __u32 tid, __u64 now,
					     __u64 switched_out, __u64 switched_in,
					     __u64 preempted,
					     const struct rw_unsent *unsent)
{
	rw_release(tid);
	struct rw_thread_exit_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return;
	}
	rw_fill_header(&event->hdr, RW_EVENT_THREAD_EXIT, now);
	event->tgid = tgid;
	event->tid = tid;
	event->switched_out = switched_out;
	event->switched_in = switched_in;
	event->preempted = preempted;
	event->unsent = *unsent;
	/* Called from sched_switch for the outgoing task, which is current. */
	__builtin_memset(event->comm, 0, sizeof(event->comm));
	bpf_get_current_comm(event->comm, sizeof(event->comm));
	rw_submit(event);
}

/* Where the kernel's own run-queue accounting can be read (CONFIG_SCHED_INFO,
 * and the rq through the task's cfs_rq: CONFIG_FAIR_GROUP_SCHED). */
#define RW_KERNEL_RUN_DELAY                                                   \
	(bpf_core_field_exists(((struct task_struct *)0)->sched_info) &&      \
	 bpf_core_field_exists(((struct task_struct *)0)->se) &&              \
	 bpf_core_field_exists(((struct sched_entity *)0)->cfs_rq) &&         \
	 bpf_core_field_exists(((struct cfs_rq *)0)->rq))

/* Notes the kernel's run-queue time of a watched thread so far, from which
 * its next wait is measured (rw_kernel_wait). */
static __always_inline void rw_note_run_delay(struct task_struct *task,
					      struct rw_thread_state *state)
{
	if (!RW_KERNEL_RUN_DELAY)
		return;
	state->run_delay_base = task->sched_info.run_delay;
	state->run_delay_known = 1;
}

/* The run-queue wait that ends as `next` takes this CPU, as the kernel
 * accounts it (and /proc/<tid>/schedstat shows it): what it added to the
 * thread's run_delay since the base was noted (the part of a wait before a
 * migration) and what sched_info_arrive() adds right after this tracepoint,
 * the rq clock (read once in __schedule() before the pick) less the clock
 * when the wait began. Our own clock, read at the wakeup and switch
 * tracepoints, sits a few microseconds after the kernel's at each end, and
 * more on a busy virtual machine (measured: 2-8 us a wait), which added up
 * to over 15% of the waits of a ping-pong beside busy threads. False when
 * it cannot be read (no base yet, another CPU's rq): the caller uses its
 * own clock then. */
static __always_inline bool rw_kernel_wait(struct task_struct *next,
					   struct rw_thread_state *state, __u64 *wait)
{
	if (!RW_KERNEL_RUN_DELAY || !state->run_delay_known)
		return false;
	struct cfs_rq *cfs_rq = next->se.cfs_rq;
	if (!cfs_rq)
		return false;
	struct rq *rq = cfs_rq->rq;
	/* A task of another class may point at a stale cfs_rq: only this
	 * CPU's rq has the clock sched_info_arrive() reads. */
	if (!rq || rq->cpu != (int)bpf_get_smp_processor_id())
		return false;
	__u64 clock = rq->clock;
	__u64 queued = next->sched_info.last_queued;
	__u64 run_delay = next->sched_info.run_delay;
	if (run_delay < state->run_delay_base || (queued && clock < queued))
		return false;
	*wait = run_delay - state->run_delay_base + (queued ? clock - queued : 0);
	return true;
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
	__u32 prev_tid = prev->pid;
	__u32 next_tid = next->pid;
	/* The intervals this switch ends, for one record. */
	__u64 on_cpu_start = 0, off_cpu_start = 0, runnable = 0;
	__u8 on_cpu_cause = 0, run_queue_cause = 0;
	bool has_on_cpu = false, has_off_cpu = false, has_run_queue = false;
	/* The dying thread's final counts (its state is deleted below). */
	bool prev_dead = false;
	__u64 dead_out = 1, dead_in = 0, dead_preempted = 0;
	struct rw_unsent dead_unsent = {};

	if (prev_watched) {
		prev_dead = prev_state & RW_TASK_DEAD;
		/* A dying thread's state is not created just to be deleted. */
		struct rw_thread_state *state =
			prev_dead ? rw_thread_if_any(prev, prev_tid)
				  : rw_thread(prev, prev_tid, prev_tgid);
		if (state) {
			/* Preempted (or still runnable): it waits on the run
			 * queue from now on; otherwise it blocked until woken. */
			bool still_runnable = preempt || prev_state == 0;
			state->switched_out++;
			/* __state 0 (TASK_RUNNING) when leaving: preempted
			 * rather than blocked. */
			if (prev_state == 0)
				state->preempted++;
			if (state->on_cpu &&
			    rw_interval_sent(state, now - state->on_ts, now,
					     &state->unsent.on_cpu_ns,
					     &state->unsent.on_cpu)) {
				has_on_cpu = true;
				on_cpu_start = state->on_ts;
				on_cpu_cause = still_runnable ? RW_CAUSE_PREEMPTED
							      : RW_CAUSE_BLOCKED;
			}
			state->on_cpu = 0;
			state->off_ts = now;
			state->runq_ts = still_runnable ? now : 0;
			state->runq_cause = RW_CAUSE_PREEMPTED;
			state->off_cpu_pending = 0;
			rw_note_run_delay(prev, state);
			dead_out = state->switched_out;
			dead_in = state->switched_in;
			dead_preempted = state->preempted;
			if (prev_dead)
				dead_unsent = state->unsent;
		}
	}
	if (next_watched) {
		struct rw_thread_state *state = rw_thread(next, next_tid, next_tgid);
		if (state) {
			state->switched_in++;
			__u64 kernel_wait = 0;
			bool by_kernel = rw_kernel_wait(next, state, &kernel_wait);
			/* The kernel counted a wait whose wakeup we did not see
			 * begin (it found our state still on a CPU): the thread
			 * was blocked since its switch out, then woken. */
			if (!state->runq_ts && by_kernel && kernel_wait && state->off_ts) {
				state->runq_ts = now;
				state->off_cpu_pending = 1;
				state->runq_cause = RW_CAUSE_WOKEN;
			}
			if (state->runq_ts) {
				/* By the kernel's accounting where it can be
				 * read, placed to end now (not before the switch
				 * out that began the off-CPU time). */
				runnable = state->runq_ts;
				if (by_kernel) {
					runnable = kernel_wait < now ? now - kernel_wait : 0;
					/* A wakeup's wait began after its sleep. */
					if (state->off_cpu_pending && runnable < state->off_ts)
						runnable = state->off_ts;
				}
				run_queue_cause = state->runq_cause;
				struct rw_thread_hist *hist =
					rw_histograms ? rw_hist_of(next_tid) : 0;
				/* The off-CPU interval its wakeup ended, accounted
				 * here with the run-queue wait after it: one
				 * histogram lookup for both, and the wakeup stays
				 * cheap. In the order they ended, for the rate
				 * limit. */
				if (state->off_cpu_pending) {
					__u64 off_cpu = runnable - state->off_ts;
					rw_hist_count(hist, false, off_cpu);
					has_off_cpu = rw_interval_sent(
						state, off_cpu, runnable,
						&state->unsent.off_cpu_ns,
						&state->unsent.off_cpu);
					off_cpu_start = state->off_ts;
				}
				__u64 wait = now - runnable;
				rw_hist_count(hist, true, wait);
				has_run_queue = rw_interval_sent(
					state, wait, now,
					&state->unsent.run_queue_ns,
					&state->unsent.run_queue);
			}
			state->off_cpu_pending = 0;
			state->runq_ts = 0;
			state->on_ts = now;
			state->on_cpu = 1;
		}
	}

	if (has_on_cpu || has_off_cpu || has_run_queue) {
		struct rw_sched_switch_event *event =
			bpf_ringbuf_reserve(&events, sizeof(*event), 0);
		if (event) {
			rw_fill_header(&event->hdr, RW_EVENT_SCHED_SWITCH, now);
			event->prev_tgid = prev_tgid;
			event->prev_tid = prev_tid;
			event->next_tgid = next_tgid;
			event->next_tid = next_tid;
			event->on_cpu_start_ns = on_cpu_start;
			event->off_cpu_start_ns = off_cpu_start;
			event->runnable_ns = runnable;
			event->prev_watched = prev_watched;
			event->next_watched = next_watched;
			event->has_on_cpu = has_on_cpu;
			event->has_off_cpu = has_off_cpu;
			event->has_run_queue = has_run_queue;
			event->on_cpu_cause = on_cpu_cause;
			event->run_queue_cause = run_queue_cause;
			event->_pad = 0;
			rw_submit(event);
		} else {
			rw_count(RW_COUNTER_RINGBUF_DROPS);
		}
	}
	if (prev_dead)
		rw_thread_exited(prev_tgid, prev_tid, now, dead_out, dead_in, dead_preempted,
				 &dead_unsent);
	return 0;
}

/* A blocked watched thread became runnable: its off-CPU interval ends and
 * its run-queue wait begins. Both are accounted (histograms, limits, the
 * record) at the thread's next switch in, by rw_sched_switch: this runs for
 * every wakeup of the job and only notes the time. */
static __always_inline void rw_woken(struct task_struct *p, bool new_thread)
{
	__u32 tgid = p->tgid;
	if (!rw_is_watched(tgid))
		return;
	__u32 tid = p->pid;
	struct rw_thread_state *state = rw_thread(p, tid, tgid);
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
		state->off_cpu_pending = 1;
		state->runq_cause = RW_CAUSE_WOKEN;
	}
	rw_note_run_delay(p, state);
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
