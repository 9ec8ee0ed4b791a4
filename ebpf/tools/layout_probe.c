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
	FIELD(rw_sched_switch_event, prev_state);
	FIELD(rw_sched_switch_event, preempt);
	FIELD(rw_sched_switch_event, prev_watched);
	FIELD(rw_sched_switch_event, next_watched);
	printf("];\n");
	printf("/// enum rw_event_kind and enum rw_counter values.\n");
	printf("pub const C_CONSTANTS: &[(&str, u32)] = &[\n");
	printf("    (\"RW_EVENT_SCHED_SWITCH\", %u),\n", RW_EVENT_SCHED_SWITCH);
	printf("    (\"RW_COUNTER_RINGBUF_DROPS\", %u),\n", RW_COUNTER_RINGBUF_DROPS);
	printf("    (\"RW_COUNTER_SCHED_SWITCH_SEEN\", %u),\n", RW_COUNTER_SCHED_SWITCH_SEEN);
	printf("    (\"RW_COUNTER_MAX\", %u),\n", RW_COUNTER_MAX);
	printf("];\n");
	return 0;
}
