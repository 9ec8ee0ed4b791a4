//! NCCL's profiler-plugin ABI, re-declared from NCCL's published headers
//! (`src/include/plugin/profiler/profiler_v{3,4,5,6,7}.h` in NVIDIA's nccl
//! repository), for x86_64 and aarch64 Linux (LP64).
//!
//! Only the union members this plugin reads are spelled out (the collective
//! and the kernel channel); each union is padded to the size NCCL's header
//! gives, and the tests check every size and offset against the figures
//! read off those headers with `offsetof`.
//!
//! | plugin version | NCCL that looks it up first | descriptor size |
//! |---|---|---:|
//! | v3 | 2.26 (torch 2.7) | 120 |
//! | v4 | 2.27 (torch 2.8–2.10) | 104 |
//! | v5 | 2.28 (torch 2.11) | 112 |
//! | v6 | 2.29, 2.30 (torch 2.12–2.15) | 112 |
//! | v7 | 2.31 | 136 |
//!
//! NCCL tries the newest version it knows first and falls back to older
//! symbols, so a library exporting v3…v7 is loaded by every NCCL from 2.26
//! on; 2.23–2.25 (v1, v2) find none of them and run without the plugin.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclResult_t`; the plugin only ever returns `ncclSuccess`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;

/// Event-type bits (`ncclProfileColl`, …): `uint8_t` in v3/v4 descriptors,
/// `uint64_t` from v5 on; the activation mask is an `int` of them.
pub mod event {
    /// `ncclProfileGroup`.
    pub const GROUP: u64 = 1 << 0;
    /// `ncclProfileColl`: one collective, started at enqueue.
    pub const COLL: u64 = 1 << 1;
    /// `ncclProfileP2p`.
    pub const P2P: u64 = 1 << 2;
    /// `ncclProfileProxyOp`.
    pub const PROXY_OP: u64 = 1 << 3;
    /// `ncclProfileKernelCh` (v3+): one channel of a collective's kernel.
    pub const KERNEL_CH: u64 = 1 << 6;
}

/// `ncclProfilerKernelChStop` (v4+): the state whose argument holds the
/// channel's GPU stop time.
pub const STATE_KERNEL_CH_STOP: c_int = 22;

/// `ncclDebugLogger_t` (C variadic).
pub type Logger = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;

/// The descriptor's header, common to every version: the event type
/// (`uint8_t` before v5, `uint64_t` from v5), the parent event's handle
/// (the one this plugin returned for it) and the rank, then the union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Descr<T: Copy, U: Copy> {
    pub type_: T,
    pub parent_obj: *mut c_void,
    pub rank: c_int,
    pub u: U,
}

/// v3's collective (v2's without `trafficBytes`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV3 {
    pub name: *const c_char,
    pub comm_hash: u64,
    pub seq_number: u64,
    pub func: *const c_char,
    pub send_buff: *const c_void,
    pub recv_buff: *mut c_void,
    pub count: usize,
    pub root: c_int,
    pub datatype: *const c_char,
    pub n_max_channels: u8,
    pub n_warps: u8,
    pub algo: *const c_char,
    pub proto: *const c_char,
}

/// v3's kernel channel: no GPU timestamp.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelChV3 {
    pub channel_id: u8,
}

/// v3's union, padded to its 96 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub union UnionV3 {
    pub coll: CollV3,
    pub kernel_ch: KernelChV3,
    pub _size: [u64; 12],
}

/// v4's collective.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV4 {
    pub seq_number: u64,
    pub func: *const c_char,
    pub send_buff: *const c_void,
    pub recv_buff: *mut c_void,
    pub count: usize,
    pub root: c_int,
    pub datatype: *const c_char,
    pub n_channels: u8,
    pub n_warps: u8,
    pub algo: *const c_char,
    pub proto: *const c_char,
}

/// The kernel channel from v4 on: `pTimer` is the GPU's `%globaltimer` (ns)
/// when the channel started.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelChV4 {
    pub channel_id: u8,
    pub p_timer: u64,
}

/// v4's union, padded to its 80 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub union UnionV4 {
    pub coll: CollV4,
    pub kernel_ch: KernelChV4,
    pub _size: [u64; 10],
}

/// v5's and v6's collective: v4's and the legacy group's handle.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV5 {
    pub base: CollV4,
    pub parent_group: *mut c_void,
}

/// v5's and v6's union (v6 adds copy-engine members of the same size),
/// padded to 88 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub union UnionV5 {
    pub coll: CollV5,
    pub kernel_ch: KernelChV4,
    pub _size: [u64; 11],
}

/// v7's collective: v5's, the kernel variant, symmetric-memory flag and the
/// user's tag.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollV7 {
    pub base: CollV5,
    pub kernel_variant: *const c_char,
    pub is_sym_coll: bool,
    pub user_tag: u64,
}

/// v7's union, padded to 112 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub union UnionV7 {
    pub coll: CollV7,
    pub kernel_ch: KernelChV4,
    pub _size: [u64; 14],
}

pub type DescrV3 = Descr<u8, UnionV3>;
pub type DescrV4 = Descr<u8, UnionV4>;
/// v5 and v6 descriptors are the same size and, for what is read here, the
/// same layout.
pub type DescrV5 = Descr<u64, UnionV5>;
pub type DescrV7 = Descr<u64, UnionV7>;

/// v3's state arguments (16 bytes); nothing in them is read.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StateArgsV3 {
    pub _size: [u64; 2],
}

/// The state arguments from v4 on (8 bytes): with
/// [`STATE_KERNEL_CH_STOP`], the channel's GPU stop time.
#[repr(C)]
#[derive(Clone, Copy)]
pub union StateArgsV4 {
    pub kernel_ch_p_timer: u64,
    pub _size: u64,
}

pub type InitV3 = unsafe extern "C" fn(context: *mut *mut c_void, mask: *mut c_int) -> NcclResult;
pub type InitV4 = unsafe extern "C" fn(
    context: *mut *mut c_void,
    mask: *mut c_int,
    comm_name: *const c_char,
    comm_hash: u64,
    n_nodes: c_int,
    nranks: c_int,
    rank: c_int,
    logfn: Logger,
) -> NcclResult;
/// From v5 on the communicator's id comes second (the order changed).
pub type InitV5 = unsafe extern "C" fn(
    context: *mut *mut c_void,
    comm_id: u64,
    mask: *mut c_int,
    comm_name: *const c_char,
    n_nodes: c_int,
    nranks: c_int,
    rank: c_int,
    logfn: Logger,
) -> NcclResult;

/// `ncclProfiler_vN_t`: the same six members in every version (48 bytes).
#[repr(C)]
pub struct Profiler<I, D, S> {
    pub name: *const c_char,
    pub init: I,
    pub start_event: unsafe extern "C" fn(
        context: *mut c_void,
        handle: *mut *mut c_void,
        descr: *mut D,
    ) -> NcclResult,
    pub stop_event: unsafe extern "C" fn(handle: *mut c_void) -> NcclResult,
    pub record_event_state:
        unsafe extern "C" fn(handle: *mut c_void, state: c_int, args: *mut S) -> NcclResult,
    pub finalize: unsafe extern "C" fn(context: *mut c_void) -> NcclResult,
}

/// A plugin struct that can live in an exported `static`: NCCL only reads
/// it, and its pointers point to static data and functions.
#[repr(transparent)]
pub struct Exported<T>(pub T);

// SAFETY: the wrapped struct is immutable and holds pointers to 'static
// data and functions only.
unsafe impl<T> Sync for Exported<T> {}

pub type ProfilerV3 = Profiler<InitV3, DescrV3, StateArgsV3>;
pub type ProfilerV4 = Profiler<InitV4, DescrV4, StateArgsV4>;
pub type ProfilerV5 = Profiler<InitV5, DescrV5, StateArgsV4>;
pub type ProfilerV7 = Profiler<InitV5, DescrV7, StateArgsV4>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    // Sizes and offsets read off NCCL's headers (v2.26.2-1 … 2.31.2) with
    // gcc's offsetof on x86_64.

    #[test]
    fn descriptor_sizes_are_nccls() {
        assert_eq!(size_of::<DescrV3>(), 120);
        assert_eq!(size_of::<DescrV4>(), 104);
        assert_eq!(size_of::<DescrV5>(), 112);
        assert_eq!(size_of::<DescrV7>(), 136);
        assert_eq!(size_of::<StateArgsV3>(), 16);
        assert_eq!(size_of::<StateArgsV4>(), 8);
        assert_eq!(size_of::<ProfilerV3>(), 48);
        assert_eq!(size_of::<ProfilerV4>(), 48);
        assert_eq!(size_of::<ProfilerV5>(), 48);
        assert_eq!(size_of::<ProfilerV7>(), 48);
    }

    #[test]
    fn header_offsets_are_nccls() {
        assert_eq!(offset_of!(DescrV4, parent_obj), 8);
        assert_eq!(offset_of!(DescrV4, rank), 16);
        assert_eq!(offset_of!(DescrV4, u), 24);
        assert_eq!(offset_of!(DescrV5, parent_obj), 8);
        assert_eq!(offset_of!(DescrV5, u), 24);
        assert_eq!(offset_of!(ProfilerV5, start_event), 16);
        assert_eq!(offset_of!(ProfilerV5, record_event_state), 32);
        assert_eq!(offset_of!(ProfilerV5, finalize), 40);
    }

    #[test]
    fn collective_offsets_are_nccls() {
        // Offsets from the start of the descriptor: 24 + within the union.
        let v3 = |o: usize| 24 + o;
        assert_eq!(v3(offset_of!(CollV3, seq_number)), 40);
        assert_eq!(v3(offset_of!(CollV3, func)), 48);
        assert_eq!(v3(offset_of!(CollV3, count)), 72);
        assert_eq!(v3(offset_of!(CollV3, root)), 80);
        assert_eq!(v3(offset_of!(CollV3, datatype)), 88);
        assert_eq!(v3(offset_of!(CollV3, n_max_channels)), 96);
        assert_eq!(v3(offset_of!(CollV3, algo)), 104);
        assert_eq!(v3(offset_of!(CollV3, proto)), 112);
        assert_eq!(v3(offset_of!(CollV4, seq_number)), 24);
        assert_eq!(v3(offset_of!(CollV4, func)), 32);
        assert_eq!(v3(offset_of!(CollV4, count)), 56);
        assert_eq!(v3(offset_of!(CollV4, root)), 64);
        assert_eq!(v3(offset_of!(CollV4, datatype)), 72);
        assert_eq!(v3(offset_of!(CollV4, n_channels)), 80);
        assert_eq!(v3(offset_of!(CollV4, n_warps)), 81);
        assert_eq!(v3(offset_of!(CollV4, algo)), 88);
        assert_eq!(v3(offset_of!(CollV4, proto)), 96);
        assert_eq!(v3(offset_of!(CollV5, parent_group)), 104);
        assert_eq!(v3(offset_of!(CollV7, kernel_variant)), 112);
        assert_eq!(v3(offset_of!(CollV7, is_sym_coll)), 120);
        assert_eq!(v3(offset_of!(CollV7, user_tag)), 128);
        assert_eq!(v3(offset_of!(KernelChV4, p_timer)), 32);
    }
}
