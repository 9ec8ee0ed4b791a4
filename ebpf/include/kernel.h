/* kernel.h: the few kernel types ringwatch's BPF programs read, declared by hand.
 *
 * Every struct is marked preserve_access_index, so clang records CO-RE
 * relocations and libbpf/aya fix the field offsets against the running
 * kernel's BTF at load time. Declare only the fields we read; never copy a
 * generated vmlinux.h here (3 MB, tied to one kernel). Fields that the kernel
 * keeps inside anonymous unions/structs are declared flat: the CO-RE matcher
 * looks through anonymous members by name.
 */
#pragma once

#include <linux/types.h>

typedef int pid_t;

/* The scheduler's clock of one CPU's run queue (rq_clock()). */
struct rq {
	__u64 clock;
	int cpu;
} __attribute__((preserve_access_index));

struct cfs_rq {
	struct rq *rq; /* CONFIG_FAIR_GROUP_SCHED */
} __attribute__((preserve_access_index));

struct sched_entity {
	struct cfs_rq *cfs_rq; /* CONFIG_FAIR_GROUP_SCHED */
} __attribute__((preserve_access_index));

/* The kernel's own run-queue accounting (CONFIG_SCHED_INFO), which
 * /proc/<tid>/schedstat shows: run_delay sums the waits, last_queued is
 * the rq clock when the current one began (0 when not queued). */
struct sched_info {
	unsigned long long run_delay;
	unsigned long long last_queued;
} __attribute__((preserve_access_index));

struct task_struct {
	pid_t pid;
	pid_t tgid;
	struct sched_entity se;
	struct sched_info sched_info;
} __attribute__((preserve_access_index));

struct in6_addr {
	union {
		__u8 u6_addr8[16];
	} in6_u;
} __attribute__((preserve_access_index));

struct sock_common {
	__be32 skc_daddr;
	__be32 skc_rcv_saddr;
	__be16 skc_dport;
	__u16 skc_num;
	unsigned short skc_family;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 srtt_us;   /* smoothed RTT << 3, in microseconds */
	__u32 snd_cwnd;  /* congestion window, in segments */
} __attribute__((preserve_access_index));

struct sk_buff;
