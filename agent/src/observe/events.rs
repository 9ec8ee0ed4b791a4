//! `events`: turns raw ring-buffer items into typed events.
//!
//! Pure decoding: no state, no I/O. Unknown or short records are reported as
//! such, never guessed at.

use ebpf::{
    EventHeader, EventKind, NcclCallEvent, SchedSwitchEvent, TcpCloseEvent, TcpRetransmitEvent,
    ThreadExitEvent, read_record,
};

/// A decoded kernel record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The on-CPU, off-CPU and run-queue intervals a context switch of a
    /// watched process ended.
    SchedSwitch(SchedSwitchEvent),
    /// A watched thread exited.
    ThreadExit(ThreadExitEvent),
    /// A segment of a watched connection was retransmitted.
    TcpRetransmit(TcpRetransmitEvent),
    /// A watched connection closed, with its final figures.
    TcpClose(TcpCloseEvent),
    /// An NCCL call returned.
    NcclCall(NcclCallEvent),
}

/// Why a ring-buffer item could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than the header or than its kind's record.
    #[error("record of {len} bytes is too short for kind {kind:?}")]
    Short {
        /// The item's length.
        len: usize,
        /// The kind from the header, if the header was complete.
        kind: Option<u32>,
    },
    /// A kind this agent does not know (BPF object and agent out of step).
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
}

/// Decodes one ring-buffer item.
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    let header: EventHeader = read_record(bytes).ok_or(DecodeError::Short {
        len: bytes.len(),
        kind: None,
    })?;
    let short = || DecodeError::Short {
        len: bytes.len(),
        kind: Some(header.kind),
    };
    match EventKind::from_raw(header.kind) {
        Some(EventKind::SchedSwitch) => {
            read_record(bytes).map(Event::SchedSwitch).ok_or_else(short)
        }
        Some(EventKind::ThreadExit) => read_record(bytes).map(Event::ThreadExit).ok_or_else(short),
        Some(EventKind::TcpRetransmit) => read_record(bytes)
            .map(Event::TcpRetransmit)
            .ok_or_else(short),
        Some(EventKind::TcpClose) => read_record(bytes).map(Event::TcpClose).ok_or_else(short),
        Some(EventKind::NcclCall) => read_record(bytes).map(Event::NcclCall).ok_or_else(short),
        None => Err(DecodeError::UnknownKind(header.kind)),
    }
}

#[cfg(test)]
mod tests {
    use ebpf::IntervalKind;

    use super::*;

    fn switch_bytes() -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&123u64.to_ne_bytes()); // ts_ns
        bytes.extend_from_slice(&1u32.to_ne_bytes()); // kind
        bytes.extend_from_slice(&3u32.to_ne_bytes()); // cpu
        for v in [10u32, 11, 20, 21] {
            bytes.extend_from_slice(&v.to_ne_bytes());
        }
        // on-CPU start, off-CPU start, runnable
        for v in [100u64, 40, 110] {
            bytes.extend_from_slice(&v.to_ne_bytes());
        }
        // watched prev and next; on-CPU, off-CPU and run-queue parts;
        // preempted, woken; padding
        bytes.extend_from_slice(&[1, 1, 1, 1, 1, 1, 2, 0]);
        bytes
    }

    #[test]
    fn decodes_a_sched_switch_and_its_intervals() {
        let Event::SchedSwitch(e) = decode(&switch_bytes()).unwrap() else {
            panic!("not a switch")
        };
        assert_eq!((e.hdr.ts_ns, e.hdr.cpu), (123, 3));
        assert_eq!(
            (e.prev_tgid, e.prev_tid, e.next_tgid, e.next_tid),
            (10, 11, 20, 21)
        );
        assert_eq!((e.prev_watched, e.next_watched), (1, 1));
        let parts: Vec<_> = e
            .intervals()
            .map(|i| (i.tid, i.kind, i.cause, i.start_ns, i.end_ns))
            .collect();
        assert_eq!(
            parts,
            [
                (11, IntervalKind::OnCpu, 1, 100, 123),
                (21, IntervalKind::OffCpu, 0, 40, 110),
                (21, IntervalKind::RunQueue, 2, 110, 123),
            ]
        );
        // Only the parts the kernel marked are there.
        let mut bytes = switch_bytes();
        bytes[58..61].copy_from_slice(&[0, 0, 1]);
        let Event::SchedSwitch(e) = decode(&bytes).unwrap() else {
            panic!("not a switch")
        };
        let kinds: Vec<_> = e.intervals().map(|i| i.kind).collect();
        assert_eq!(kinds, [IntervalKind::RunQueue]);
    }

    #[test]
    fn rejects_short_and_unknown_records() {
        let bytes = switch_bytes();
        assert_eq!(
            decode(&bytes[..8]),
            Err(DecodeError::Short { len: 8, kind: None })
        );
        assert_eq!(
            decode(&bytes[..20]),
            Err(DecodeError::Short {
                len: 20,
                kind: Some(1)
            })
        );
        let mut unknown = bytes.clone();
        unknown[8..12].copy_from_slice(&99u32.to_ne_bytes());
        assert_eq!(decode(&unknown), Err(DecodeError::UnknownKind(99)));
    }
}
