/* tcp.bpf.c: TCP traffic of watched processes, from tracepoints only.
 *
 * Part of the ringwatch.bpf.c translation unit. Bytes come from
 * sock_send_length / sock_recv_length (the exact return value of every
 * send/receive call, in the calling thread's context) and are added up in
 * the kernel per thread (`thread_net`) and per connection (`sock_stats`,
 * keyed by the struct sock address), so traffic costs no ring-buffer record
 * per call. Retransmits, RTT/cwnd and state changes are matched to the
 * watched connections through that address. Never kprobes or fentry: they do
 * not exist or are refused on the kernels we target.
 */

#define RW_AF_INET 2
#define RW_AF_INET6 10
#define RW_IPPROTO_TCP 6
#define RW_MSG_PEEK 2
#define RW_TCP_SYN_SENT 2
#define RW_TCP_CLOSE 7

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct rw_thread_key);
	__type(value, struct rw_thread_net);
} thread_net SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64); /* struct sock address */
	__type(value, struct rw_sock_stats);
} sock_stats SEC(".maps");

static __always_inline bool rw_is_tcp(struct sock *sk)
{
	__u16 family = BPF_CORE_READ(sk, __sk_common.skc_family);
	if (family != RW_AF_INET && family != RW_AF_INET6)
		return false;
	return BPF_CORE_READ(sk, sk_protocol) == RW_IPPROTO_TCP;
}

static __always_inline struct rw_sock_stats *rw_sock_entry(struct sock *sk, __u32 tgid, __u64 now)
{
	__u64 key = (__u64)sk;
	struct rw_sock_stats *stats = bpf_map_lookup_elem(&sock_stats, &key);
	if (stats)
		return stats;
	struct rw_sock_stats fresh = {};
	fresh.tgid = tgid;
	fresh.family = BPF_CORE_READ(sk, __sk_common.skc_family);
	fresh.sport = BPF_CORE_READ(sk, __sk_common.skc_num);
	fresh.dport = bpf_ntohs(BPF_CORE_READ(sk, __sk_common.skc_dport));
	if (fresh.family == RW_AF_INET) {
		__be32 saddr = BPF_CORE_READ(sk, __sk_common.skc_rcv_saddr);
		__be32 daddr = BPF_CORE_READ(sk, __sk_common.skc_daddr);
		__builtin_memcpy(fresh.saddr, &saddr, 4);
		__builtin_memcpy(fresh.daddr, &daddr, 4);
	} else {
		BPF_CORE_READ_INTO(&fresh.saddr, sk, __sk_common.skc_v6_rcv_saddr.in6_u.u6_addr8);
		BPF_CORE_READ_INTO(&fresh.daddr, sk, __sk_common.skc_v6_daddr.in6_u.u6_addr8);
	}
	fresh.opened_ns = now;
	bpf_map_update_elem(&sock_stats, &key, &fresh, BPF_NOEXIST);
	stats = bpf_map_lookup_elem(&sock_stats, &key);
	if (!stats)
		rw_count(RW_COUNTER_MAP_FULL);
	return stats;
}

static __always_inline void rw_sock_io(struct sock *sk, int ret, int flags, bool tx)
{
	if (ret <= 0 || (!tx && (flags & RW_MSG_PEEK)))
		return;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;
	if (!rw_is_watched(tgid) || !rw_is_tcp(sk))
		return;
	__u64 now = bpf_ktime_get_ns();

	struct rw_thread_key tkey = { .tgid = tgid, .tid = (__u32)pid_tgid };
	struct rw_thread_net *thread = bpf_map_lookup_elem(&thread_net, &tkey);
	if (!thread) {
		struct rw_thread_net zero = {};
		bpf_map_update_elem(&thread_net, &tkey, &zero, BPF_NOEXIST);
		thread = bpf_map_lookup_elem(&thread_net, &tkey);
	}
	if (thread) {
		if (tx) {
			__sync_fetch_and_add(&thread->tx_bytes, ret);
			__sync_fetch_and_add(&thread->tx_calls, 1);
		} else {
			__sync_fetch_and_add(&thread->rx_bytes, ret);
			__sync_fetch_and_add(&thread->rx_calls, 1);
		}
	} else {
		rw_count(RW_COUNTER_MAP_FULL);
	}

	struct rw_sock_stats *stats = rw_sock_entry(sk, tgid, now);
	if (stats) {
		/* Seen first at connect(), before the local port was chosen. */
		if (!stats->sport)
			stats->sport = BPF_CORE_READ(sk, __sk_common.skc_num);
		if (tx) {
			__sync_fetch_and_add(&stats->tx_bytes, ret);
			__sync_fetch_and_add(&stats->tx_calls, 1);
		} else {
			__sync_fetch_and_add(&stats->rx_bytes, ret);
			__sync_fetch_and_add(&stats->rx_calls, 1);
		}
		stats->last_ns = now;
	}
}

SEC("tp_btf/sock_send_length")
int BPF_PROG(rw_sock_send_length, struct sock *sk, int ret, int flags)
{
	rw_sock_io(sk, ret, flags, true);
	return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(rw_sock_recv_length, struct sock *sk, int ret, int flags)
{
	rw_sock_io(sk, ret, flags, false);
	return 0;
}

/* Runs in whatever context retransmits (often a timer): matched by address. */
SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(rw_tcp_retransmit_skb, struct sock *sk)
{
	__u64 key = (__u64)sk;
	struct rw_sock_stats *stats = bpf_map_lookup_elem(&sock_stats, &key);
	if (!stats)
		return 0;
	__sync_fetch_and_add(&stats->retransmits, 1);
	struct rw_tcp_retransmit_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (!event) {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
		return 0;
	}
	rw_fill_header(&event->hdr, RW_EVENT_TCP_RETRANSMIT, bpf_ktime_get_ns());
	event->sock = key;
	event->tgid = stats->tgid;
	event->_pad = 0;
	rw_submit(event);
	return 0;
}

/* Every ACK on an established connection: cheap for unwatched sockets (one
 * failed lookup). */
SEC("tp_btf/tcp_probe")
int BPF_PROG(rw_tcp_probe, struct sock *sk)
{
	__u64 key = (__u64)sk;
	struct rw_sock_stats *stats = bpf_map_lookup_elem(&sock_stats, &key);
	if (!stats)
		return 0;
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	stats->srtt_us = BPF_CORE_READ(tp, srtt_us) >> 3;
	stats->cwnd = BPF_CORE_READ(tp, snd_cwnd);
	stats->last_ns = bpf_ktime_get_ns();
	return 0;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(rw_inet_sock_set_state, struct sock *sk, int oldstate, int newstate)
{
	__u64 key = (__u64)sk;
	if (newstate == RW_TCP_SYN_SENT) {
		/* connect() runs in the connecting thread: the open time of an
		 * active connection. */
		__u32 tgid = bpf_get_current_pid_tgid() >> 32;
		if (rw_is_watched(tgid) && rw_is_tcp(sk))
			rw_sock_entry(sk, tgid, bpf_ktime_get_ns());
		return 0;
	}
	if (newstate != RW_TCP_CLOSE)
		return 0;
	struct rw_sock_stats *stats = bpf_map_lookup_elem(&sock_stats, &key);
	if (!stats)
		return 0;
	struct rw_tcp_close_event *event =
		bpf_ringbuf_reserve(&events, sizeof(*event), 0);
	if (event) {
		rw_fill_header(&event->hdr, RW_EVENT_TCP_CLOSE, bpf_ktime_get_ns());
		event->sock = key;
		__builtin_memcpy(&event->stats, stats, sizeof(event->stats));
		rw_submit(event);
	} else {
		rw_count(RW_COUNTER_RINGBUF_DROPS);
	}
	bpf_map_delete_elem(&sock_stats, &key);
	return 0;
}
