//! `ebpf`: ringwatch's kernel-side programs, compiled and embedded.
//!
//! The C sources live beside this crate (`ebpf/*.bpf.c`, `ebpf/include/`);
//! `build.rs` compiles them with clang into one CO-RE object that
//! [`bpf_object`] returns, ready for `aya::Ebpf::load`. This crate also holds
//! the `#[repr(C)]` mirrors of the records in `include/ringwatch.h`, checked
//! against the C compiler's layout by the `layout` test.
//!
//! It never loads or attaches anything: that is the agent's job.

/// Bytes aligned for the ELF parser (aya reads the object in place).
#[repr(C, align(8))]
struct Aligned<Bytes: ?Sized>(Bytes);

static BPF_OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/ringwatch.bpf.o"
)));

/// The compiled BPF object (ELF, with BTF), 8-byte aligned.
pub fn bpf_object() -> &'static [u8] {
    &BPF_OBJECT.0
}

/// Names of the maps and programs in the object, as the C sources spell them.
pub mod names {
    /// `HASH` map: thread-group ids to watch (key `u32`, value `u8`).
    pub const MAP_WATCHED_TGIDS: &str = "watched_tgids";
    /// `RINGBUF` map every record leaves the kernel through.
    pub const MAP_EVENTS: &str = "events";
    /// `PERCPU_ARRAY` of `u64` counters, indexed by [`crate::Counter`].
    pub const MAP_COUNTERS: &str = "counters";
    /// BTF tracepoint program on `sched_switch`.
    pub const PROG_SCHED_SWITCH: &str = "rw_sched_switch";
}

/// `enum rw_event_kind`: the first field after the timestamp in every record.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// [`SchedSwitchEvent`].
    SchedSwitch = 1,
}

impl EventKind {
    /// The kind for a raw value read from a record, if known.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::SchedSwitch),
            _ => None,
        }
    }
}

/// `enum rw_counter`: slots of the `counters` map.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Records lost because the ring buffer was full.
    RingbufDrops = 0,
    /// Context switches involving a watched process.
    SchedSwitchSeen = 1,
}

/// Number of slots in the `counters` map (`RW_COUNTER_MAX`).
pub const COUNTER_SLOTS: u32 = 16;

/// `struct rw_event_header`: starts every ring-buffer record.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventHeader {
    /// `bpf_ktime_get_ns()`: nanoseconds of `CLOCK_MONOTONIC`.
    pub ts_ns: u64,
    /// An [`EventKind`] value.
    pub kind: u32,
    /// The CPU the event happened on.
    pub cpu: u32,
}

/// `struct rw_sched_switch_event`: a context switch in which a watched
/// process's thread went off or came on a CPU.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedSwitchEvent {
    /// Common header; `kind` is [`EventKind::SchedSwitch`].
    pub hdr: EventHeader,
    /// Process of the thread leaving the CPU.
    pub prev_tgid: u32,
    /// Thread leaving the CPU.
    pub prev_tid: u32,
    /// Process of the thread taking the CPU.
    pub next_tgid: u32,
    /// Thread taking the CPU.
    pub next_tid: u32,
    /// The outgoing thread's `__state` (0: still runnable).
    pub prev_state: u32,
    /// 1 when the switch was a preemption.
    pub preempt: u8,
    /// 1 when `prev_tgid` is watched.
    pub prev_watched: u8,
    /// 1 when `next_tgid` is watched.
    pub next_watched: u8,
    /// Padding, zero.
    pub _pad: u8,
}

/// Reads a record of type `T` from the front of a ring-buffer item, or `None`
/// when the item is too short. The kernel writes plain-old-data records, so
/// any bit pattern is a valid `T` for the types in this crate.
pub fn read_record<T: Record>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked above; `T: Record` is a #[repr(C)] struct of
    // integers, valid for every bit pattern; read_unaligned has no alignment
    // requirement.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Marker for the `#[repr(C)]` integer-only records that [`read_record`] may
/// produce from raw bytes.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs whose fields are integers (or such
/// structs), so every bit pattern is a valid value.
pub unsafe trait Record: Copy {}

// SAFETY: repr(C), integer fields only.
unsafe impl Record for EventHeader {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for SchedSwitchEvent {}

#[cfg(test)]
mod layout {
    //! The C side and the Rust side must agree byte for byte.
    use super::*;
    use std::mem::{offset_of, size_of};

    include!(concat!(env!("OUT_DIR"), "/c_layout.rs"));

    fn rust_layout() -> Vec<(&'static str, usize)> {
        vec![
            ("rw_event_header", size_of::<EventHeader>()),
            ("rw_event_header.ts_ns", offset_of!(EventHeader, ts_ns)),
            ("rw_event_header.kind", offset_of!(EventHeader, kind)),
            ("rw_event_header.cpu", offset_of!(EventHeader, cpu)),
            ("rw_sched_switch_event", size_of::<SchedSwitchEvent>()),
            (
                "rw_sched_switch_event.hdr",
                offset_of!(SchedSwitchEvent, hdr),
            ),
            (
                "rw_sched_switch_event.prev_tgid",
                offset_of!(SchedSwitchEvent, prev_tgid),
            ),
            (
                "rw_sched_switch_event.prev_tid",
                offset_of!(SchedSwitchEvent, prev_tid),
            ),
            (
                "rw_sched_switch_event.next_tgid",
                offset_of!(SchedSwitchEvent, next_tgid),
            ),
            (
                "rw_sched_switch_event.next_tid",
                offset_of!(SchedSwitchEvent, next_tid),
            ),
            (
                "rw_sched_switch_event.prev_state",
                offset_of!(SchedSwitchEvent, prev_state),
            ),
            (
                "rw_sched_switch_event.preempt",
                offset_of!(SchedSwitchEvent, preempt),
            ),
            (
                "rw_sched_switch_event.prev_watched",
                offset_of!(SchedSwitchEvent, prev_watched),
            ),
            (
                "rw_sched_switch_event.next_watched",
                offset_of!(SchedSwitchEvent, next_watched),
            ),
        ]
    }

    #[test]
    fn rust_mirrors_match_the_c_layout() {
        assert_eq!(rust_layout(), C_LAYOUT.to_vec());
    }

    #[test]
    fn enum_values_match_the_c_header() {
        let rust: Vec<(&str, u32)> = vec![
            ("RW_EVENT_SCHED_SWITCH", EventKind::SchedSwitch as u32),
            ("RW_COUNTER_RINGBUF_DROPS", Counter::RingbufDrops as u32),
            (
                "RW_COUNTER_SCHED_SWITCH_SEEN",
                Counter::SchedSwitchSeen as u32,
            ),
            ("RW_COUNTER_MAX", COUNTER_SLOTS),
        ];
        assert_eq!(rust, C_CONSTANTS.to_vec());
    }

    #[test]
    fn object_is_an_elf_for_bpf() {
        let object = bpf_object();
        assert_eq!(&object[..4], b"\x7fELF");
        // e_machine at offset 18: EM_BPF = 247.
        assert_eq!(u16::from_le_bytes([object[18], object[19]]), 247);
        assert_eq!(object.as_ptr() as usize % 8, 0);
    }

    #[test]
    fn short_records_are_refused() {
        assert!(read_record::<SchedSwitchEvent>(&[0u8; 8]).is_none());
        let bytes = [1u8; 40];
        let event = read_record::<SchedSwitchEvent>(&bytes).unwrap();
        assert_eq!(event.prev_tgid, 0x0101_0101);
    }
}
