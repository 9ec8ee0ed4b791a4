/* maps.bpf.h: the maps every ringwatch program shares, and helpers on them.
 *
 * Included once, by ringwatch.bpf.c. Map names are part of the agent's
 * contract (agent/src/probes.rs looks them up by name).
 */
#pragma once

/* Processes (thread-group ids) the agent asked us to watch, as a bitmap:
 * bit (tgid % 64) of element (tgid / 64). An array lookup is inlined by the
 * verifier (no helper call), which matters: sched_switch runs this test for
 * every context switch on the machine, watched or not. Covers every pid up
 * to PID_MAX_LIMIT (2^22). */
#define RW_WATCHED_WORDS (1 << 16)
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RW_WATCHED_WORDS);
	__type(key, __u32);
	__type(value, __u64);
} watched_tgids SEC(".maps");

/* Every record leaves the kernel through this ring buffer. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 * 1024 * 1024);
} events SEC(".maps");

/* enum rw_counter slots, per CPU so counting never contends. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RW_COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void rw_count(__u32 slot)
{
	__u64 *value = bpf_map_lookup_elem(&counters, &slot);
	if (value)
		*value += 1;
}

/* Wake the agent only once this much is waiting: a wakeup per record costs
 * more than the record (an irq_work and a reschedule of the reader). The
 * agent also drains on a short timer, so records never wait long. */
#define RW_WAKEUP_BYTES (256 * 1024)

static __always_inline void rw_submit(void *record)
{
	__u64 flags = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= RW_WAKEUP_BYTES
			      ? BPF_RB_FORCE_WAKEUP
			      : BPF_RB_NO_WAKEUP;
	bpf_ringbuf_submit(record, flags);
}

static __always_inline bool rw_is_watched(__u32 tgid)
{
	__u32 word = tgid >> 6;
	__u64 *bits = bpf_map_lookup_elem(&watched_tgids, &word);
	return tgid != 0 && bits && (*bits >> (tgid & 63)) & 1;
}

/* The caller passes the time it already read: a second bpf_ktime_get_ns()
 * per record is a helper call for nothing. */
static __always_inline void rw_fill_header(struct rw_event_header *hdr, __u32 kind,
					   __u64 ts_ns)
{
	hdr->ts_ns = ts_ns;
	hdr->kind = kind;
	hdr->cpu = bpf_get_smp_processor_id();
}
