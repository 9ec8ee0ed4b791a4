/* sched.bpf.c: CPU scheduling of watched processes' threads.
 *
 * Part of the ringwatch.bpf.c translation unit. Reports only switches in
 * which a watched process takes part; everything else returns after one
 * hash lookup per side.
 */

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

	struct rw_sched_switch_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return 0;
	}
	rw_fill_header(&event->hdr, RW_EVENT_SCHED_SWITCH);
	event->prev_tgid = prev_tgid;
	event->prev_tid = prev->pid;
	event->next_tgid = next_tgid;
	event->next_tid = next->pid;
	event->prev_state = prev_state;
	event->preempt = preempt;
	event->prev_watched = prev_watched;
	event->next_watched = next_watched;
	event->_pad = 0;
	bpf_ringbuf_submit(event, 0);
	return 0;
}
