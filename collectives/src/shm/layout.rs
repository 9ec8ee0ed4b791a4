//! Where everything is in a host's segment: the sizes (rings, posts, arenas) chosen from
//! the members and the free memory, the offsets ([`Layout`]), and the shared words at them
//! (header, doorbells, shared-allreduce flags).
//!
//! It must never read or write the segment: plain arithmetic and `#[repr(C)]` layouts.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// Largest ring: more lets a writer run further ahead of a reader that is off the CPU
/// (4 ranks on 2 cores: 2 → 8 MiB took 64 MiB busbw from ~1.4 to ~2.0 GB/s).
pub const MAX_RING_BYTES: usize = 8 << 20;

/// Smallest ring a segment is made with; below this a host uses TCP.
pub const MIN_RING_BYTES: usize = 256 << 10;

/// Most memory one host's segment reserves for its rings (there are `m(m-1)` of them).
pub const SEGMENT_BUDGET_BYTES: usize = 256 << 20;

/// The ring size for `members` ranks when `free_bytes` are free in [`SHM_DIR`](super::SHM_DIR): the
/// largest power of two up to [`MAX_RING_BYTES`] whose rings fit in the budget and in half
/// of the free space (containers often get a small `/dev/shm`), or `None` below
/// [`MIN_RING_BYTES`].
pub fn ring_bytes_for(members: usize, free_bytes: u64) -> Option<usize> {
    // m(m-1) rings and 2m allreduce slots, all of one size.
    let rings = (members * members.saturating_sub(1) + 2 * members).max(1) as u64;
    let budget = (SEGMENT_BUDGET_BYTES as u64).min(free_bytes / 2);
    let mut ring = MAX_RING_BYTES;
    while ring > MIN_RING_BYTES && ring as u64 * rings > budget {
        ring /= 2;
    }
    (ring as u64 * rings <= budget).then_some(ring)
}

/// Whether a ring size offered by another rank is one this build can use.
pub fn valid_ring_bytes(ring: usize) -> bool {
    ring.is_power_of_two() && (MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring)
}

/// Free bytes in `dir`'s file system.
pub fn free_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `path` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers for the duration of the call.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Every message starts at a multiple of this, so payloads are aligned for any dtype and
/// for vector loads when reduced in place.
pub const ALIGN: usize = 64;

/// A writer moves at most this much per step, so that a full-duplex step interleaves its
/// send and its receive finely and the reader can start on the first bytes early.
pub(super) const WRITE_GRANULE: usize = 128 * 1024;

/// Longest single sleep on a doorbell: how often a waiting rank checks its peers' health.
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(10);

/// Largest allreduce done in one shot ([`ShmGroup::one_shot_allreduce`](super::ShmGroup::one_shot_allreduce)): one barrier
/// instead of three, every member folding the whole buffer.
pub(super) const ONE_SHOT_MAX_BYTES: usize = 64 << 10;

/// Spins on the doorbell before sleeping: a peer that is running on another core usually
/// answers within this.
pub(super) const SPINS: u32 = 200;

/// [`SPINS`] where the host has more ranks than cores.
pub(super) const OVERSUBSCRIBED_SPINS: u32 = 10;

pub(super) const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"RWSHM\0v3");
pub(super) const MESSAGE_MAGIC: u64 = u64::from_le_bytes(*b"RWmsg\0v1");
/// Header in front of every message: payload length, magic (detects a protocol slip).
pub(super) const HEADER: usize = ALIGN;
/// Control words of different writers live on different cache-line pairs.
pub(super) const LINE: usize = 128;
pub(super) const PAGE: usize = 4096;

/// Bytes of one member's post (of two, alternating) in [`ShmGroup::same_posts`](super::ShmGroup::same_posts): the
/// round it is for and its length, then the bytes posted.
pub(super) const POST_BYTES: usize = 1024;
pub(super) const POST_HEADER: usize = 16;
/// Most bytes one [`ShmGroup::same_posts`](super::ShmGroup::same_posts) can post.
pub const MAX_POST_BYTES: usize = POST_BYTES - POST_HEADER;

/// What an early post adds to its bytes ([`ShmGroup::same_posts_early`](super::ShmGroup::same_posts_early)): whether the
/// inputs went into the slot (1 byte) and their length (8).
pub const EARLY_TRAILER_BYTES: usize = 9;

/// Most address space each member's arena of shared tensors takes in the segment
/// ([`ShmGroup::alloc_shared`](super::ShmGroup::alloc_shared); see [`arena_bytes_for`]). Sparse: memory is taken only by
/// what is allocated, and given back when it is freed.
pub const ARENA_BYTES: usize = 16 << 30;

/// Each member's arena for `members` ranks when `free_bytes` of the segment's directory
/// are free besides the segment's rings and slots: its share of that, at most
/// [`ARENA_BYTES`], in whole pages. No arena could ever hold more than the directory has
/// (a container's `/dev/shm` is often 64 MiB), and a smaller one maps less address space.
pub fn arena_bytes_for(members: usize, free_bytes: u64) -> usize {
    let share = usize::try_from(free_bytes / members.max(1) as u64).unwrap_or(usize::MAX);
    share.min(ARENA_BYTES) / PAGE * PAGE
}

/// Bytes of a segment for `members` ranks with rings of `ring_bytes` before its arenas:
/// control lines, posts, rings and slots.
pub fn staging_bytes(members: usize, ring_bytes: usize) -> u64 {
    let layout = Layout {
        members,
        ring_bytes,
        arena_bytes: 0,
    };
    layout.total() as u64
}

/// Shared tensors' allocations are whole pages (so freeing one gives its pages back
/// without touching a neighbour).
pub(super) const ARENA_GRANULE: usize = PAGE;

/// A folded block of a shared-tensor allreduce ([`ShmGroup::fold_allreduce`](super::ShmGroup::fold_allreduce)): all the
/// peers' bytes are folded into it and its result sent back while it is in the cache.
pub(super) const ARENA_BLOCK: usize = 64 << 10;

/// The segment's first line.
#[repr(C)]
pub(super) struct SegmentHeader {
    pub(super) magic: AtomicU64,
    pub(super) members: AtomicU64,
    pub(super) ring_bytes: AtomicU64,
    pub(super) nonce: AtomicU64,
    pub(super) arena_bytes: AtomicU64,
}

/// A rank's doorbell: every event that may let it progress (data in one of its incoming
/// rings, space in one of its outgoing rings, a peer's abort) bumps `seq` and wakes it.
#[repr(C)]
pub(super) struct Bell {
    pub(super) seq: AtomicU32,
    pub(super) waiters: AtomicU32,
    pub(super) aborted: AtomicU32,
    /// The core this member last waited on, plus one (0: not known).
    pub(super) cpu: AtomicU32,
}

/// Where things are in a segment of `members` ranks with rings of `ring_bytes`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    pub(super) members: usize,
    pub(super) ring_bytes: usize,
    /// Bytes of each member's arena of shared tensors, after the slots.
    pub(super) arena_bytes: usize,
}

impl Layout {
    pub(super) fn bell(&self, i: usize) -> usize {
        LINE * (1 + i)
    }
    /// Member `i`'s progress through shared allreduces ([`Flags`]).
    pub(super) fn flags(&self, i: usize) -> usize {
        LINE * (1 + self.members + i)
    }
    /// The ring from member `src` to member `dst`: `head` (written by `src`) and, one line
    /// pair further, `tail` (written by `dst`).
    pub(super) fn ring_control(&self, src: usize, dst: usize) -> usize {
        LINE * (1 + 2 * self.members) + 2 * LINE * (src * self.members + dst)
    }
    /// Member `i`'s post `parity` (of two) for [`ShmGroup::same_posts`](super::ShmGroup::same_posts).
    pub(super) fn post(&self, i: usize, parity: usize) -> usize {
        LINE * (1 + 2 * self.members)
            + 2 * LINE * self.members * self.members
            + (2 * i + parity) * POST_BYTES
    }
    pub(super) fn data_start(&self) -> usize {
        self.post(self.members, 0).div_ceil(PAGE) * PAGE
    }
    pub(super) fn ring_data(&self, src: usize, dst: usize) -> usize {
        self.data_start() + (src * self.members + dst) * self.ring_bytes
    }
    /// Member `i`'s slot `s` (of two) for shared allreduces, as large as a ring.
    pub(super) fn slot(&self, i: usize, s: usize) -> usize {
        self.data_start() + (self.members * self.members + 2 * i + s) * self.ring_bytes
    }
    /// Member `i`'s arena of shared tensors.
    pub(super) fn arena(&self, i: usize) -> usize {
        self.slot(self.members, 0) + i * self.arena_bytes
    }
    pub(super) fn total(&self) -> usize {
        self.arena(self.members)
    }
}

/// How far a member is through the chunks of shared allreduces (counts, only growing):
/// its inputs are in its slot, its own part is reduced, it has copied everyone's results.
/// A member whose buffer is a shared tensor says so with the first chunk's `written`.
#[repr(C)]
pub(super) struct Flags {
    pub(super) written: AtomicU64,
    pub(super) reduced: AtomicU64,
    pub(super) consumed: AtomicU64,
    /// Chunk + 1 for which `arena_at`/`arena_len` hold: the buffer is at `arena_at` in
    /// this member's arena, `arena_len` bytes.
    pub(super) arena_chunk: AtomicU64,
    pub(super) arena_at: AtomicU64,
    pub(super) arena_len: AtomicU64,
    /// Chunk + 1 whose inputs this member put in its slot late: it offered its shared
    /// tensor instead, and not every member did.
    pub(super) late_written: AtomicU64,
}
