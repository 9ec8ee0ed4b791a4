/* layout_probe.c: prints the C layout of ringwatch.h's records as Rust source.
 *
 * Built and run on the host by ebpf/build.rs; the `layout` test in
 * ebpf/src/lib.rs compares the output with the #[repr(C)] mirrors. Add a
 * line here for every struct and field added to ringwatch.h.
 */
#include <stddef.h>
#include <stdio.h>
#include "ringwatch.h"

#define SIZE(s) printf("    (\"%s\", %zu),\n", #s, sizeof(struct s))
#define FIELD(s, f) printf("    (\"%s.%s\", %zu),\n", #s, #f, offsetof(struct s, f))

int main(void)
{
	printf("/// (`struct` or `struct.field`, size or offset) as the C compiler lays them out.\n");
	printf("pub const C_LAYOUT: &[(&str, usize)] = &[\n");
	SIZE(rw_event_header);
	FIELD(rw_event_header, ts_ns);
	FIELD(rw_event_header, kind);
	FIELD(rw_event_header, cpu);
	SIZE(rw_sched_switch_event);
	FIELD(rw_sched_switch_event, hdr);
	FIELD(rw_sched_switch_event, prev_tgid);
	FIELD(rw_sched_switch_event, prev_tid);
	FIELD(rw_sched_switch_event, next_tgid);
	FIELD(rw_sched_switch_event, next_tid);
	FIELD(rw_sched_switch_event, on_cpu_start_ns);
	FIELD(rw_sched_switch_event, off_cpu_start_ns);
	FIELD(rw_sched_switch_event, runnable_ns);
	FIELD(rw_sched_switch_event, prev_watched);
	FIELD(rw_sched_switch_event, next_watched);
	FIELD(rw_sched_switch_event, has_on_cpu);
	FIELD(rw_sched_switch_event, has_off_cpu);
	FIELD(rw_sched_switch_event, has_run_queue);
	FIELD(rw_sched_switch_event, on_cpu_cause);
	FIELD(rw_sched_switch_event, run_queue_cause);
	SIZE(rw_thread_exit_event);
	FIELD(rw_thread_exit_event, hdr);
	FIELD(rw_thread_exit_event, tgid);
	FIELD(rw_thread_exit_event, tid);
	FIELD(rw_thread_exit_event, switched_out);
	FIELD(rw_thread_exit_event, switched_in);
	FIELD(rw_thread_exit_event, preempted);
	FIELD(rw_thread_exit_event, comm);
	FIELD(rw_thread_exit_event, unsent);
	SIZE(rw_thread_state);
	FIELD(rw_thread_state, on_ts);
	FIELD(rw_thread_state, off_ts);
	FIELD(rw_thread_state, runq_ts);
	FIELD(rw_thread_state, rate_window_ns);
	FIELD(rw_thread_state, switched_out);
	FIELD(rw_thread_state, switched_in);
	FIELD(rw_thread_state, preempted);
	FIELD(rw_thread_state, rate_count);
	FIELD(rw_thread_state, tgid);
	FIELD(rw_thread_state, on_cpu);
	FIELD(rw_thread_state, runq_cause);
	FIELD(rw_thread_state, off_cpu_pending);
	FIELD(rw_thread_state, unsent);
	FIELD(rw_thread_state, tid);
	SIZE(rw_unsent);
	FIELD(rw_unsent, on_cpu_ns);
	FIELD(rw_unsent, run_queue_ns);
	FIELD(rw_unsent, off_cpu_ns);
	FIELD(rw_unsent, on_cpu);
	FIELD(rw_unsent, run_queue);
	FIELD(rw_unsent, off_cpu);
	SIZE(rw_thread_hist);
	FIELD(rw_thread_hist, run_queue);
	FIELD(rw_thread_hist, off_cpu);
	SIZE(rw_thread_key);
	FIELD(rw_thread_key, tgid);
	FIELD(rw_thread_key, tid);
	SIZE(rw_thread_net);
	FIELD(rw_thread_net, tx_bytes);
	FIELD(rw_thread_net, rx_bytes);
	FIELD(rw_thread_net, tx_calls);
	FIELD(rw_thread_net, rx_calls);
	SIZE(rw_sock_stats);
	FIELD(rw_sock_stats, tgid);
	FIELD(rw_sock_stats, family);
	FIELD(rw_sock_stats, sport);
	FIELD(rw_sock_stats, dport);
	FIELD(rw_sock_stats, saddr);
	FIELD(rw_sock_stats, daddr);
	FIELD(rw_sock_stats, tx_bytes);
	FIELD(rw_sock_stats, rx_bytes);
	FIELD(rw_sock_stats, tx_calls);
	FIELD(rw_sock_stats, rx_calls);
	FIELD(rw_sock_stats, retransmits);
	FIELD(rw_sock_stats, srtt_us);
	FIELD(rw_sock_stats, cwnd);
	FIELD(rw_sock_stats, opened_ns);
	FIELD(rw_sock_stats, last_ns);
	SIZE(rw_tcp_retransmit_event);
	FIELD(rw_tcp_retransmit_event, hdr);
	FIELD(rw_tcp_retransmit_event, sock);
	FIELD(rw_tcp_retransmit_event, tgid);
	SIZE(rw_tcp_close_event);
	FIELD(rw_tcp_close_event, hdr);
	FIELD(rw_tcp_close_event, sock);
	FIELD(rw_tcp_close_event, stats);
	SIZE(rw_nccl_call_event);
	FIELD(rw_nccl_call_event, hdr);
	FIELD(rw_nccl_call_event, tgid);
	FIELD(rw_nccl_call_event, tid);
	FIELD(rw_nccl_call_event, func);
	FIELD(rw_nccl_call_event, datatype);
	FIELD(rw_nccl_call_event, op);
	FIELD(rw_nccl_call_event, result);
	FIELD(rw_nccl_call_event, count);
	FIELD(rw_nccl_call_event, entry_ns);
	FIELD(rw_nccl_call_event, return_ns);
	SIZE(rw_nccl_pending);
	FIELD(rw_nccl_pending, entry_ns);
	FIELD(rw_nccl_pending, count);
	FIELD(rw_nccl_pending, func);
	FIELD(rw_nccl_pending, datatype);
	FIELD(rw_nccl_pending, op);
	printf("];\n");
	printf("/// enum rw_event_kind and enum rw_counter values.\n");
	printf("pub const C_CONSTANTS: &[(&str, u32)] = &[\n");
	printf("    (\"RW_EVENT_SCHED_SWITCH\", %u),\n", RW_EVENT_SCHED_SWITCH);
	printf("    (\"RW_COUNTER_RINGBUF_DROPS\", %u),\n", RW_COUNTER_RINGBUF_DROPS);
	printf("    (\"RW_COUNTER_SCHED_SWITCH_SEEN\", %u),\n", RW_COUNTER_SCHED_SWITCH_SEEN);
	printf("    (\"RW_EVENT_THREAD_EXIT\", %u),\n", RW_EVENT_THREAD_EXIT);
	printf("    (\"RW_EVENT_TCP_RETRANSMIT\", %u),\n", RW_EVENT_TCP_RETRANSMIT);
	printf("    (\"RW_EVENT_TCP_CLOSE\", %u),\n", RW_EVENT_TCP_CLOSE);
	printf("    (\"RW_EVENT_NCCL_CALL\", %u),\n", RW_EVENT_NCCL_CALL);
	printf("    (\"RW_COUNTER_INTERVALS_SKIPPED\", %u),\n", RW_COUNTER_INTERVALS_SKIPPED);
	printf("    (\"RW_COUNTER_MAP_FULL\", %u),\n", RW_COUNTER_MAP_FULL);
	printf("    (\"RW_CAUSE_BLOCKED\", %u),\n", RW_CAUSE_BLOCKED);
	printf("    (\"RW_CAUSE_PREEMPTED\", %u),\n", RW_CAUSE_PREEMPTED);
	printf("    (\"RW_CAUSE_WOKEN\", %u),\n", RW_CAUSE_WOKEN);
	printf("    (\"RW_CAUSE_NEW\", %u),\n", RW_CAUSE_NEW);
	printf("    (\"RW_NCCL_ALL_REDUCE\", %u),\n", RW_NCCL_ALL_REDUCE);
	printf("    (\"RW_NCCL_ALL_GATHER\", %u),\n", RW_NCCL_ALL_GATHER);
	printf("    (\"RW_NCCL_REDUCE_SCATTER\", %u),\n", RW_NCCL_REDUCE_SCATTER);
	printf("    (\"RW_NCCL_BROADCAST\", %u),\n", RW_NCCL_BROADCAST);
	printf("    (\"RW_NCCL_GROUP_START\", %u),\n", RW_NCCL_GROUP_START);
	printf("    (\"RW_NCCL_GROUP_END\", %u),\n", RW_NCCL_GROUP_END);
	printf("    (\"RW_COUNTER_INTERVALS_RATE_LIMITED\", %u),\n", RW_COUNTER_INTERVALS_RATE_LIMITED);
	printf("    (\"RW_HIST_SLOTS\", %u),\n", RW_HIST_SLOTS);
	printf("    (\"RW_COUNTER_MAX\", %u),\n", RW_COUNTER_MAX);
	printf("];\n");
	return 0;
}
