//! One collective as the plugin sends it, and its line on the wire.

use std::ffi::{CStr, c_char};
use std::fmt::Write as _;

/// The longest name kept (NCCL's names — `AllReduce`, `ncclFloat32`,
/// `COLLNET_DIRECT`, `LL128` — are shorter).
const NAME_LEN: usize = 24;

/// A short ASCII name copied out of NCCL (`[A-Za-z0-9_]` only, so it needs
/// no escaping on the wire).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Name {
    len: u8,
    bytes: [u8; NAME_LEN],
}

impl Name {
    /// Copies NCCL's C string: at most [`NAME_LEN`] bytes, up to the first
    /// byte outside `[A-Za-z0-9_]`; NULL is the empty name.
    ///
    /// # Safety
    /// `ptr` is NULL or points to a NUL-terminated string.
    pub unsafe fn from_c(ptr: *const c_char) -> Name {
        let mut name = Name::default();
        if ptr.is_null() {
            return name;
        }
        // SAFETY: the caller promises a NUL-terminated string.
        let bytes = unsafe { CStr::from_ptr(ptr) }.to_bytes();
        for &b in bytes.iter().take(NAME_LEN) {
            if !(b.is_ascii_alphanumeric() || b == b'_') {
                break;
            }
            name.bytes[name.len as usize] = b;
            name.len += 1;
        }
        name
    }

    pub fn from_ascii(s: &str) -> Name {
        let mut name = Name::default();
        for &b in s.as_bytes().iter().take(NAME_LEN) {
            if !(b.is_ascii_alphanumeric() || b == b'_') {
                break;
            }
            name.bytes[name.len as usize] = b;
            name.len += 1;
        }
        name
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII bytes are ever stored.
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("")
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One collective: what NCCL said at enqueue, and the times of its kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The plugin version NCCL loaded (3…7).
    pub profiler: u8,
    /// The communicator's hash (the same on every rank of it).
    pub comm: u64,
    pub rank: i32,
    /// Ranks of the communicator; 0 where NCCL does not say (v3).
    pub nranks: i32,
    /// NCCL's per-communicator, per-function sequence number.
    pub seq: u64,
    pub func: Name,
    pub datatype: Name,
    pub algo: Name,
    pub proto: Name,
    /// Elements.
    pub count: u64,
    /// `count` × the datatype's size; 0 for a datatype not known here.
    pub bytes: u64,
    /// Channels NCCL said the collective uses (kernel-channel events to
    /// expect).
    pub channels: u32,
    /// Kernel channels that stopped.
    pub channels_done: u32,
    /// CLOCK_MONOTONIC when NCCL started and finished enqueuing it.
    pub enqueue_start_ns: u64,
    pub enqueue_stop_ns: u64,
    /// CLOCK_MONOTONIC when the plugin saw the first channel start and the
    /// last one stop (NCCL's proxy thread notices them; 0 if none was seen).
    pub kernel_cpu_start_ns: u64,
    pub kernel_cpu_stop_ns: u64,
    /// The GPU's `%globaltimer` (ns) at the first channel's start and the
    /// last channel's stop, from v4 on; 0 where not given.
    pub gpu_start_ns: u64,
    pub gpu_stop_ns: u64,
}

/// Bytes of one element of NCCL datatype `name`; 0 for one not known here.
pub fn datatype_size(name: &str) -> u64 {
    match name {
        "ncclInt8" | "ncclUint8" | "ncclChar" | "ncclFloat8e4m3" | "ncclFloat8e5m2" => 1,
        "ncclFloat16" | "ncclHalf" | "ncclBfloat16" => 2,
        "ncclInt32" | "ncclInt" | "ncclUint32" | "ncclFloat32" | "ncclFloat" => 4,
        "ncclInt64" | "ncclUint64" | "ncclFloat64" | "ncclDouble" => 8,
        _ => 0,
    }
}

impl Record {
    /// The record's line on the wire (JSON, newline-terminated, under 600
    /// bytes: every string is a [`Name`]).
    pub fn line(&self) -> String {
        let mut s = String::with_capacity(480);
        let _ = writeln!(
            s,
            "{{\"seq\":{},\"comm\":\"{:016x}\",\"rank\":{},\"nranks\":{},\"func\":\"{}\",\"datatype\":\"{}\",\"count\":{},\"bytes\":{},\"algo\":\"{}\",\"proto\":\"{}\",\"channels\":{},\"channels_done\":{},\"enqueue_ns\":[{},{}],\"kernel_cpu_ns\":[{},{}],\"gpu_ns\":[{},{}],\"profiler\":{}}}",
            self.seq,
            self.comm,
            self.rank,
            self.nranks,
            self.func.as_str(),
            self.datatype.as_str(),
            self.count,
            self.bytes,
            self.algo.as_str(),
            self.proto.as_str(),
            self.channels,
            self.channels_done,
            self.enqueue_start_ns,
            self.enqueue_stop_ns,
            self.kernel_cpu_start_ns,
            self.kernel_cpu_stop_ns,
            self.gpu_start_ns,
            self.gpu_stop_ns,
            self.profiler,
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_only_plain_ascii_and_are_bounded() {
        let n = unsafe { Name::from_c(c"AllReduce".as_ptr()) };
        assert_eq!(n.as_str(), "AllReduce");
        let n = unsafe { Name::from_c(c"ev\"il\nname".as_ptr()) };
        assert_eq!(n.as_str(), "ev");
        let n = unsafe { Name::from_c(c"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123".as_ptr()) };
        assert_eq!(n.as_str(), "ABCDEFGHIJKLMNOPQRSTUVWX");
        assert_eq!(unsafe { Name::from_c(std::ptr::null()) }.as_str(), "");
    }

    #[test]
    fn a_line_is_one_json_object() {
        let rec = Record {
            profiler: 6,
            comm: 0xabc,
            rank: 1,
            nranks: 4,
            seq: 7,
            func: Name::from_ascii("AllReduce"),
            datatype: Name::from_ascii("ncclFloat32"),
            count: 10,
            bytes: 40,
            channels: 2,
            channels_done: 2,
            ..Record::default()
        };
        let line = rec.line();
        assert!(line.ends_with("}\n"));
        assert_eq!(line.matches('\n').count(), 1);
        assert!(line.contains("\"comm\":\"0000000000000abc\""));
        assert!(line.contains("\"func\":\"AllReduce\""));
    }
}
