//! Shared-memory links between the ranks of one host: a segment in `/dev/shm` holding one
//! single-producer single-consumer byte ring per ordered pair of ranks and a doorbell per
//! rank, and the handshake that sets it up over the TCP mesh.
//!
//! A byte crosses a ring with one copy in and one copy out, or none out: a reduce-scatter
//! reduces straight from the ring. TCP on loopback costs two kernel copies plus the stack.
//! Ranks share a segment only if they share a host *as the kernel sees it*: the same boot,
//! network namespace and mount namespace (so pretend nodes in network namespaces are
//! separate hosts, as real nodes are).
//!
//! This module knows nothing of tensors or schedules, and must never wait without a
//! deadline: a rank waiting on a ring also watches its peer's doorbell for an abort and
//! asks the caller (the TCP link, still open and carrying nothing) whether the peer's
//! process is gone; with no progress for the op timeout, the error names the peer.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{CollectiveError, Result};

/// Largest ring: more lets a writer run further ahead of a reader that is off the CPU
/// (4 ranks on 2 cores: 2 → 8 MiB took 64 MiB busbw from ~1.4 to ~2.0 GB/s).
pub const MAX_RING_BYTES: usize = 8 << 20;

/// Smallest ring a segment is made with; below this a host uses TCP.
pub const MIN_RING_BYTES: usize = 256 << 10;

/// Most memory one host's segment reserves for its rings (there are `m(m-1)` of them).
pub const SEGMENT_BUDGET_BYTES: usize = 256 << 20;

/// The ring size for `members` ranks when `free_bytes` are free in [`SHM_DIR`]: the
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
const WRITE_GRANULE: usize = 128 * 1024;

/// Longest single sleep on a doorbell: how often a waiting rank checks its peers' health.
const WAIT_SLICE: Duration = Duration::from_millis(10);

/// Largest allreduce done in one shot ([`ShmGroup::one_shot_allreduce`]): one barrier
/// instead of three, every member folding the whole buffer.
const ONE_SHOT_MAX_BYTES: usize = 64 << 10;

/// Spins on the doorbell before sleeping: a peer that is running on another core usually
/// answers within this.
const SPINS: u32 = 200;

/// [`SPINS`] where the host has more ranks than cores.
const OVERSUBSCRIBED_SPINS: u32 = 10;

const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"RWSHM\0v3");
const MESSAGE_MAGIC: u64 = u64::from_le_bytes(*b"RWmsg\0v1");
/// Header in front of every message: payload length, magic (detects a protocol slip).
const HEADER: usize = ALIGN;
/// Control words of different writers live on different cache-line pairs.
const LINE: usize = 128;
const PAGE: usize = 4096;

/// Bytes of one member's post (of two, alternating) in [`ShmGroup::same_posts`]: the
/// round it is for and its length, then the bytes posted.
const POST_BYTES: usize = 1024;
const POST_HEADER: usize = 16;
/// Most bytes one [`ShmGroup::same_posts`] can post.
pub const MAX_POST_BYTES: usize = POST_BYTES - POST_HEADER;

/// What an early post adds to its bytes ([`ShmGroup::same_posts_early`]): whether the
/// inputs went into the slot (1 byte) and their length (8).
pub const EARLY_TRAILER_BYTES: usize = 9;

/// Most address space each member's arena of shared tensors takes in the segment
/// ([`ShmGroup::alloc_shared`]; see [`arena_bytes_for`]). Sparse: memory is taken only by
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
const ARENA_GRANULE: usize = PAGE;

/// A folded block of a shared-tensor allreduce ([`ShmGroup::fold_allreduce`]): all the
/// peers' bytes are folded into it and its result sent back while it is in the cache.
const ARENA_BLOCK: usize = 64 << 10;

/// The segment's first line.
#[repr(C)]
struct SegmentHeader {
    magic: AtomicU64,
    members: AtomicU64,
    ring_bytes: AtomicU64,
    nonce: AtomicU64,
    arena_bytes: AtomicU64,
}

/// A rank's doorbell: every event that may let it progress (data in one of its incoming
/// rings, space in one of its outgoing rings, a peer's abort) bumps `seq` and wakes it.
#[repr(C)]
struct Bell {
    seq: AtomicU32,
    waiters: AtomicU32,
    aborted: AtomicU32,
    /// The core this member last waited on, plus one (0: not known).
    cpu: AtomicU32,
}

/// Where things are in a segment of `members` ranks with rings of `ring_bytes`.
#[derive(Clone, Copy, Debug)]
struct Layout {
    members: usize,
    ring_bytes: usize,
    /// Bytes of each member's arena of shared tensors, after the slots.
    arena_bytes: usize,
}

impl Layout {
    fn bell(&self, i: usize) -> usize {
        LINE * (1 + i)
    }
    /// Member `i`'s progress through shared allreduces ([`Flags`]).
    fn flags(&self, i: usize) -> usize {
        LINE * (1 + self.members + i)
    }
    /// The ring from member `src` to member `dst`: `head` (written by `src`) and, one line
    /// pair further, `tail` (written by `dst`).
    fn ring_control(&self, src: usize, dst: usize) -> usize {
        LINE * (1 + 2 * self.members) + 2 * LINE * (src * self.members + dst)
    }
    /// Member `i`'s post `parity` (of two) for [`ShmGroup::same_posts`].
    fn post(&self, i: usize, parity: usize) -> usize {
        LINE * (1 + 2 * self.members)
            + 2 * LINE * self.members * self.members
            + (2 * i + parity) * POST_BYTES
    }
    fn data_start(&self) -> usize {
        self.post(self.members, 0).div_ceil(PAGE) * PAGE
    }
    fn ring_data(&self, src: usize, dst: usize) -> usize {
        self.data_start() + (src * self.members + dst) * self.ring_bytes
    }
    /// Member `i`'s slot `s` (of two) for shared allreduces, as large as a ring.
    fn slot(&self, i: usize, s: usize) -> usize {
        self.data_start() + (self.members * self.members + 2 * i + s) * self.ring_bytes
    }
    /// Member `i`'s arena of shared tensors.
    fn arena(&self, i: usize) -> usize {
        self.slot(self.members, 0) + i * self.arena_bytes
    }
    fn total(&self) -> usize {
        self.arena(self.members)
    }
}

/// How far a member is through the chunks of shared allreduces (counts, only growing):
/// its inputs are in its slot, its own part is reduced, it has copied everyone's results.
/// A member whose buffer is a shared tensor says so with the first chunk's `written`.
#[repr(C)]
struct Flags {
    written: AtomicU64,
    reduced: AtomicU64,
    consumed: AtomicU64,
    /// Chunk + 1 for which `arena_at`/`arena_len` hold: the buffer is at `arena_at` in
    /// this member's arena, `arena_len` bytes.
    arena_chunk: AtomicU64,
    arena_at: AtomicU64,
    arena_len: AtomicU64,
    /// Chunk + 1 whose inputs this member put in its slot late: it offered its shared
    /// tensor instead, and not every member did.
    late_written: AtomicU64,
}

/// What a rank needs from the layer above while it waits: whether a peer's process is gone
/// (its TCP link closed), checked every [`WAIT_SLICE`] without progress.
pub(crate) type PeerGone<'a> = &'a (dyn Fn(usize) -> bool + Sync);

/// The writer's position in one outgoing ring (only this rank writes `head`).
#[derive(Default)]
struct TxState {
    head: u64,
}

/// The reader's position in one incoming ring: `tail`, and what is left of the message
/// being read.
#[derive(Default)]
struct RxState {
    tail: u64,
    message_left: u64,
}

/// This rank's view of a host's segment: rings to and from every other member.
pub struct ShmGroup {
    /// Shared with this member's shared tensors ([`SharedLease`]), which may outlive the
    /// group.
    map: Arc<MmapRaw>,
    /// The segment file (its name is gone after the handshake): shared tensors reserve
    /// and give back their pages through it.
    file: Arc<File>,
    /// What is free in this member's arena.
    arena: Arc<Mutex<ArenaFree>>,
    /// Allreduces this member folded in place from shared tensors ([`Self::arena_fold`]).
    in_place: AtomicU64,
    layout: Layout,
    /// Global rank of each member, in member order.
    ranks: Vec<usize>,
    /// Members that took part (a member that could not map the segment is left out).
    active: Vec<bool>,
    me: usize,
    timeout: Duration,
    tx: Vec<Mutex<TxState>>,
    rx: Vec<Mutex<RxState>>,
    /// Chunks of shared allreduces this rank has started, and the early one (one lock
    /// for both: a small allreduce takes it twice, not four times).
    chunks: Mutex<Chunks>,
    /// Rounds of [`Self::same_posts`] this rank has started (the same count on every
    /// member).
    posts: Mutex<u64>,
    /// Every member of the host can have a core of its own ([`Self::leave_a_shared_core`]).
    spread: bool,
    /// How many times a wait spins before it yields: [`SPINS`], or
    /// [`OVERSUBSCRIBED_SPINS`] after a wait found another member on this core
    /// (spinning then only keeps that member from running).
    spins: AtomicU32,
}

impl std::fmt::Debug for ShmGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmGroup")
            .field("ranks", &self.ranks)
            .field("active", &self.active)
            .field("me", &self.me)
            .finish()
    }
}

/// The free ranges of a member's arena (offsets from its start), sorted, none touching.
#[derive(Debug)]
struct ArenaFree {
    ranges: Vec<std::ops::Range<usize>>,
}

impl ArenaFree {
    fn new(bytes: usize) -> Self {
        ArenaFree {
            ranges: (bytes > 0).then_some(0..bytes).into_iter().collect(),
        }
    }

    /// The first free range of `len` bytes (a multiple of [`ARENA_GRANULE`]), taken.
    fn take(&mut self, len: usize) -> Option<usize> {
        let i = self.ranges.iter().position(|r| r.len() >= len)?;
        let at = self.ranges[i].start;
        self.ranges[i].start += len;
        if self.ranges[i].is_empty() {
            self.ranges.remove(i);
        }
        Some(at)
    }

    /// Gives `at..at + len` back, joined with its free neighbours.
    fn give(&mut self, at: usize, len: usize) {
        let i = self.ranges.partition_point(|r| r.start < at);
        self.ranges.insert(i, at..at + len);
        if i + 1 < self.ranges.len() && self.ranges[i].end == self.ranges[i + 1].start {
            let next = self.ranges.remove(i + 1);
            self.ranges[i].end = next.end;
        }
        if i > 0 && self.ranges[i - 1].end == self.ranges[i].start {
            let this = self.ranges.remove(i);
            self.ranges[i - 1].end = this.end;
        }
    }
}

/// `fallocate(2)` on the segment file: reserve (`mode` 0) or give back pages.
fn fallocate(file: &File, mode: libc::c_int, offset: usize, len: usize) -> std::io::Result<()> {
    // SAFETY: a plain syscall on an open file.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One shared tensor's memory in its member's arena ([`ShmGroup::alloc_shared`]): the
/// pages are reserved while it lives and given back when it is dropped. It keeps the
/// mapping alive, so a tensor may outlive the runtime.
pub struct SharedLease {
    map: Arc<MmapRaw>,
    file: Arc<File>,
    arena: Arc<Mutex<ArenaFree>>,
    /// Where the bytes are in the file, and in the arena.
    file_offset: usize,
    arena_offset: usize,
    /// Bytes reserved (whole pages).
    len: usize,
}

impl SharedLease {
    /// The first byte; valid for the length asked of [`ShmGroup::alloc_shared`].
    pub fn ptr(&self) -> *mut u8 {
        // SAFETY: `file_offset + len` is inside the mapping, which `self.map` keeps.
        unsafe { self.map.as_mut_ptr().add(self.file_offset) }
    }
}

impl std::fmt::Debug for SharedLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLease")
            .field("arena_offset", &self.arena_offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for SharedLease {
    fn drop(&mut self) {
        // The pages go back to the system zeroed, so the next tensor there starts at 0.
        if let Err(e) = fallocate(
            &self.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            self.file_offset,
            self.len,
        ) {
            // Not given back: the range stays taken rather than hand out dirty memory.
            tracing::warn!("cannot free a shared tensor's {} bytes: {e}", self.len);
            return;
        }
        if let Ok(mut free) = self.arena.lock() {
            free.give(self.arena_offset, self.len);
        }
    }
}

/// A ring as seen from one end.
struct Ring {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *mut u8,
    capacity: usize,
}

impl Ring {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: points into the live mapping at an aligned offset (see `ShmGroup::ring`).
        unsafe { &*self.head }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as for `head`.
        unsafe { &*self.tail }
    }
}

fn pad_to_align(position: u64) -> u64 {
    (ALIGN as u64 - position % ALIGN as u64) % ALIGN as u64
}

/// An outgoing message being written: `data`, of which `sent` bytes are in the ring.
pub(crate) struct Outgoing<'a> {
    data: &'a [u8],
    sent: usize,
    started: bool,
}

impl<'a> Outgoing<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Outgoing {
            data,
            sent: 0,
            started: false,
        }
    }
    fn done(&self) -> bool {
        self.data.is_empty() || (self.started && self.sent == self.data.len())
    }
}

/// Called with `(offset, bytes)` as received data arrive.
pub(crate) type OnData<'f> = &'f mut dyn FnMut(usize, &[u8]);

/// An incoming stream of bytes being read.
pub(crate) enum Incoming<'a, 'f> {
    /// Into `buf`; `on_chunk(offset, bytes)` for each completed chunk of `chunk` bytes.
    Copy {
        buf: &'a mut [u8],
        filled: usize,
        reported: usize,
        chunk: usize,
        on_chunk: Option<OnData<'f>>,
    },
    /// `len` bytes handed to `on_piece(offset, bytes)` in pieces of `piece_buf.len()`:
    /// straight from the ring when a piece lies whole and aligned in it, else gathered in
    /// `piece_buf`.
    Pieces {
        len: usize,
        done: usize,
        piece_buf: &'a mut [u8],
        piece_filled: usize,
        on_piece: OnData<'f>,
    },
}

impl<'a, 'f> Incoming<'a, 'f> {
    pub(crate) fn copy(buf: &'a mut [u8], chunk: usize, on_chunk: Option<OnData<'f>>) -> Self {
        Incoming::Copy {
            buf,
            filled: 0,
            reported: 0,
            chunk: chunk.max(1),
            on_chunk,
        }
    }

    pub(crate) fn pieces(len: usize, piece_buf: &'a mut [u8], on_piece: OnData<'f>) -> Self {
        Incoming::Pieces {
            len,
            done: 0,
            piece_buf,
            piece_filled: 0,
            on_piece,
        }
    }

    fn done(&self) -> bool {
        match self {
            Incoming::Copy { buf, filled, .. } => *filled == buf.len(),
            Incoming::Pieces { len, done, .. } => *done == *len,
        }
    }
}

/// A member's shared-allreduce chunks ([`ShmGroup::fold_allreduce`]).
#[derive(Default)]
struct Chunks {
    /// The next chunk's number (the same count on every member).
    next: u64,
    /// A one-shot chunk whose inputs every member put in its slot before a round of
    /// [`ShmGroup::same_posts_early`] on which they all agreed: (chunk, address and
    /// length of this member's buffer). The next one-shot of that chunk and buffer skips
    /// its copy and its barrier.
    early: Option<(u64, usize, usize)>,
}

/// Member indices of a collective, on the stack for a host's usual rank counts: every
/// small call names them.
pub(crate) type Members = smallvec::SmallVec<[usize; 16]>;

/// Tracks how long an operation has gone without progress and whom it waits on. Its
/// clocks start at the first wait that does not end within the spins: a small
/// collective whose peers are there at once reads no clock and allocates nothing.
struct Patience<'a> {
    /// When the current stretch without progress began to cost a wait (`None`: progress
    /// since, or none waited yet).
    since: Option<Instant>,
    last_health_check: Option<Instant>,
    /// Members whose health is watched (this member is skipped).
    peers: Peers<'a>,
    /// The member named if the wait times out: the one not heard from.
    waiting_on: usize,
    cancel: Option<&'a AtomicBool>,
    peer_gone: PeerGone<'a>,
}

/// The members a wait watches: those of a collective, or the one or two of an exchange.
#[derive(Clone, Copy)]
enum Peers<'a> {
    Members(&'a [usize]),
    Pair([Option<usize>; 2]),
}

impl Peers<'_> {
    fn iter(&self, me: usize) -> impl Iterator<Item = usize> + '_ {
        let (members, pair): (&[usize], &[Option<usize>]) = match self {
            Peers::Members(m) => (m, &[]),
            Peers::Pair(p) => (&[], p),
        };
        members
            .iter()
            .copied()
            .chain(pair.iter().flatten().copied())
            .filter(move |&m| m != me)
    }
}

impl Patience<'_> {
    /// Progress was made: the next wait starts a fresh stretch.
    fn progressed(&mut self) {
        self.since = None;
    }
}

// SAFETY: the raw pointers inside `Ring`s are derived on use from `map`, which lives as
// long as the group; every shared word is an atomic and ring bytes are handed over through
// the head/tail protocol, so sharing the group between threads is sound.
unsafe impl Send for ShmGroup {}
// SAFETY: see above; per-ring local state is behind mutexes.
unsafe impl Sync for ShmGroup {}

impl ShmGroup {
    fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn header(&self) -> &SegmentHeader {
        // SAFETY: offset 0 of a mapping of at least one page, page aligned.
        unsafe { &*(self.base() as *const SegmentHeader) }
    }

    fn bell(&self, member: usize) -> &Bell {
        // SAFETY: `Layout::bell` is inside the mapping and 128-byte aligned.
        unsafe { &*(self.base().add(self.layout.bell(member)) as *const Bell) }
    }

    fn ring(&self, src: usize, dst: usize) -> Ring {
        let control = self.layout.ring_control(src, dst);
        // SAFETY: control and data offsets are inside the mapping (see `Layout::total`),
        // 128-byte and page aligned respectively.
        unsafe {
            Ring {
                head: self.base().add(control) as *const AtomicU64,
                tail: self.base().add(control + LINE) as *const AtomicU64,
                data: self.base().add(self.layout.ring_data(src, dst)),
                capacity: self.layout.ring_bytes,
            }
        }
    }

    fn flags(&self, member: usize) -> &Flags {
        // SAFETY: `Layout::flags` is inside the mapping and 128-byte aligned.
        unsafe { &*(self.base().add(self.layout.flags(member)) as *const Flags) }
    }

    fn slot(&self, member: usize, s: usize) -> *mut u8 {
        // SAFETY: `Layout::slot` is inside the mapping (see `Layout::total`).
        unsafe { self.base().add(self.layout.slot(member, s)) }
    }

    /// Member indices of `ranks`, in their order, if they are exactly the members that share
    /// this segment (so every member takes part in every shared allreduce).
    pub(crate) fn whole_group(&self, ranks: &[usize]) -> Option<Members> {
        let active = self.active.iter().filter(|&&a| a).count();
        if ranks.len() != active || active < 2 {
            return None;
        }
        let members: Members = ranks
            .iter()
            .map(|&r| {
                let m = self.ranks.iter().position(|&x| x == r)?;
                self.active[m].then_some(m)
            })
            .collect::<Option<_>>()?;
        members.contains(&self.me).then_some(members)
    }

    /// Waits until `ready(flags)` holds for every one of `members`.
    fn wait_for_all(
        &self,
        members: &[usize],
        ready: impl Fn(&Flags) -> bool,
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        self.wait_for_members(members, |m| ready(self.flags(m)), patience)
    }

    /// Waits until `ready(member)` holds for every one of `members`.
    fn wait_for_members(
        &self,
        members: &[usize],
        ready: impl Fn(usize) -> bool,
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        let bell = self.bell(self.me);
        loop {
            let seq = bell.seq.load(Ordering::SeqCst);
            match members.iter().find(|&&m| !ready(m)) {
                None => {
                    patience.progressed();
                    return Ok(());
                }
                Some(&laggard) => patience.waiting_on = laggard,
            }
            self.wait(seq, patience)?;
        }
    }

    /// A wait on `members` (the others among them watched) that starts now.
    fn patience<'p>(&self, members: &'p [usize], peer_gone: PeerGone<'p>) -> Patience<'p> {
        Patience {
            since: None,
            last_health_check: None,
            peers: Peers::Members(members),
            waiting_on: self.me,
            cancel: None,
            peer_gone,
        }
    }

    /// The next shared-allreduce chunk's number and slot (of two), once every member
    /// is done with the chunk that used that slot before (two chunks ago).
    fn next_chunk(
        &self,
        chunks: &mut u64,
        members: &[usize],
        patience: &mut Patience<'_>,
    ) -> Result<(u64, usize)> {
        let g = *chunks;
        *chunks += 1;
        self.wait_for_all(
            members,
            |f| f.consumed.load(Ordering::Acquire) + 1 >= g,
            patience,
        )?;
        Ok((g, (g % 2) as usize))
    }

    /// Says that this member's inputs for chunk `g` are in its slot, and waits until
    /// every member's are.
    fn written_barrier(
        &self,
        members: &[usize],
        g: u64,
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        self.flags(self.me).written.store(g + 1, Ordering::Release);
        self.notify_all(members);
        self.wait_for_all(members, |f| f.written.load(Ordering::Acquire) > g, patience)
    }

    fn notify_all(&self, members: &[usize]) {
        for &m in members.iter().filter(|&&m| m != self.me) {
            self.notify(m);
        }
    }

    /// Allreduce of `buf` among `members` (member indices by position) straight through
    /// the segment, in chunks, with two alternating slots per member: each member puts its
    /// inputs for the others in its slot; the member at position `j` folds segment `j`
    /// (byte ranges `segments[j]`, whole elements) in the ring's order, starting from its
    /// own bytes: `combine(acc, x[j+1])`, `combine(acc, x[j+2])`, … (`combine` puts the
    /// incoming operand where the ring does), then `finish`es it and publishes it in its
    /// slot; everyone copies the others' results. Each byte is copied in once and out
    /// once, against twice each way on a ring, and a chunk takes three barriers instead of
    /// `2(n-1)` ring steps.
    pub(crate) fn fold_allreduce(
        &self,
        members: &[usize],
        buf: &mut [u8],
        segments: &[std::ops::Range<usize>],
        combine: &dyn Fn(&mut [u8], &[u8]),
        finish: &dyn Fn(&mut [u8]),
        peer_gone: PeerGone<'_>,
    ) -> Result<()> {
        let n = members.len();
        let p = members
            .iter()
            .position(|&m| m == self.me)
            .ok_or_else(|| self.link_error(self.my_rank(), "not a member of this allreduce"))?;
        let part = self.layout.ring_bytes / n / ALIGN * ALIGN;
        if part == 0 || segments.len() != n || segments.iter().any(|s| s.end > buf.len()) {
            return Err(self.link_error(self.my_rank(), "shared allreduce: bad layout"));
        }
        let rounds = segments
            .iter()
            .map(|s| s.len().div_ceil(part))
            .max()
            .unwrap_or(0);
        if buf.len() <= ONE_SHOT_MAX_BYTES.min(self.layout.ring_bytes) && rounds > 0 {
            return self.one_shot_allreduce(members, buf, segments, combine, finish, peer_gone);
        }
        let mut chunks = self.lock(&self.chunks, self.me)?;
        let mut patience = self.patience(members, peer_gone);
        let me = self.flags(self.me);
        let shared = self.arena_offset_of(buf);
        for round in 0..rounds {
            let (g, s) = self.next_chunk(&mut chunks.next, members, &mut patience)?;
            let sub = |j: usize| {
                let seg = &segments[j];
                let start = (seg.start + round * part).min(seg.end);
                start..(start + part).min(seg.end)
            };
            let my_slot = self.slot(self.me, s);
            let copy_in = |buf: &[u8]| {
                for j in (0..n).filter(|&j| j != p) {
                    let r = sub(j);
                    // SAFETY: part j of our slot has room for `part` bytes; nobody reads
                    // it until `written` (or `late_written`) says so.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            buf[r.clone()].as_ptr(),
                            my_slot.add(j * part),
                            r.len(),
                        )
                    };
                }
            };
            match shared {
                // A shared tensor is offered instead of the first chunk's inputs; they
                // go in the slot late if not every member offers one.
                Some(at) if round == 0 => {
                    me.arena_at.store(at as u64, Ordering::Relaxed);
                    me.arena_len.store(buf.len() as u64, Ordering::Relaxed);
                    me.arena_chunk.store(g + 1, Ordering::Relaxed);
                }
                _ => copy_in(buf),
            }
            self.written_barrier(members, g, &mut patience)?;
            if round == 0 {
                let offers: smallvec::SmallVec<[Option<usize>; 16]> = members
                    .iter()
                    .map(|&m| self.offered(m, g, buf.len()))
                    .collect();
                if let Some(at) = offers.iter().copied().collect::<Option<Members>>() {
                    return self.arena_fold(
                        members,
                        p,
                        g,
                        &at,
                        buf,
                        segments,
                        combine,
                        finish,
                        &mut patience,
                    );
                }
                if shared.is_some() {
                    copy_in(buf);
                    me.late_written.store(g + 1, Ordering::Release);
                    self.notify_all(members);
                }
                let late: Members = members
                    .iter()
                    .zip(&offers)
                    .filter(|&(&m, offer)| m != self.me && offer.is_some())
                    .map(|(&m, _)| m)
                    .collect();
                self.wait_for_members(
                    &late,
                    |m| self.flags(m).late_written.load(Ordering::Acquire) > g,
                    &mut patience,
                )?;
            }
            let mine = sub(p);
            if !mine.is_empty() {
                let acc = &mut buf[mine];
                for k in 1..n {
                    let q = members[(p + k) % n];
                    // SAFETY: member q published part p of its slot (`written` > g) and
                    // leaves it alone until we say `consumed`.
                    let incoming = unsafe {
                        std::slice::from_raw_parts(
                            self.slot(q, s).add(p * part) as *const u8,
                            acc.len(),
                        )
                    };
                    combine(acc, incoming);
                }
                finish(acc);
                // SAFETY: part p of our own slot is read by nobody until `reduced`.
                unsafe {
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), my_slot.add(p * part), acc.len())
                };
            }
            me.reduced.store(g + 1, Ordering::Release);
            self.notify_all(members);

            self.wait_for_all(
                members,
                |f| f.reduced.load(Ordering::Acquire) > g,
                &mut patience,
            )?;
            for j in (0..n).filter(|&j| j != p) {
                let r = sub(j);
                // SAFETY: the member at position j published its result in part j of its
                // slot, and does not touch it before we say `consumed`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.slot(members[j], s).add(j * part) as *const u8,
                        buf[r.clone()].as_mut_ptr(),
                        r.len(),
                    )
                };
            }
            me.consumed.store(g + 1, Ordering::Release);
            self.notify_all(members);
        }
        Ok(())
    }

    /// Where in this member's arena `buf` is, if it is a shared tensor there.
    fn arena_offset_of(&self, buf: &[u8]) -> Option<usize> {
        let arena = self.base() as usize + self.layout.arena(self.me);
        let at = (buf.as_ptr() as usize).checked_sub(arena)?;
        (!buf.is_empty() && at + buf.len() <= self.layout.arena_bytes).then_some(at)
    }

    /// Where in its arena member `m` offered its buffer of `len` bytes for chunk `g`, if it
    /// did (read after `g`'s `written` barrier, which published it).
    fn offered(&self, m: usize, g: u64, len: usize) -> Option<usize> {
        let f = self.flags(m);
        if f.arena_chunk.load(Ordering::Acquire) != g + 1
            || f.arena_len.load(Ordering::Relaxed) != len as u64
        {
            return None;
        }
        let at = usize::try_from(f.arena_at.load(Ordering::Relaxed)).ok()?;
        at.checked_add(len)
            .is_some_and(|end| end <= self.layout.arena_bytes)
            .then_some(at)
    }

    /// [`Self::fold_allreduce`] when every member's buffer is a shared tensor (`at[j]`:
    /// where in its arena the buffer of the member at position `j` is): the member at
    /// position `p` folds segment `p` straight from the others' tensors, in the fold's
    /// order (its own bytes, then positions p+1, p+2, …), into its own tensor, and writes
    /// the result into theirs, a block at a time while the block is in the cache. Each
    /// member reads the inputs of its segment once and writes each result byte once per
    /// member: 2·S of memory traffic per member for S bytes, the least any allreduce
    /// moves, against (7(n−1)+2)·S/n through the slots. One chunk, two barriers.
    #[allow(clippy::too_many_arguments)] // fold_allreduce's, plus where the tensors are
    fn arena_fold(
        &self,
        members: &[usize],
        p: usize,
        g: u64,
        at: &[usize],
        buf: &mut [u8],
        segments: &[std::ops::Range<usize>],
        combine: &dyn Fn(&mut [u8], &[u8]),
        finish: &dyn Fn(&mut [u8]),
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        let n = members.len();
        // SAFETY (for the pointers below): `offered` checked that every member's buffer
        // lies inside its arena; the members are all in this allreduce (past `written`),
        // and until everyone says `reduced` each touches only its own segment of every
        // member's tensor, so no byte is read and written by two members at once.
        let tensor = |position: usize| unsafe {
            self.base()
                .add(self.layout.arena(members[position]) + at[position])
        };
        let mine = segments[p].clone();
        let mut start = mine.start;
        while start < mine.end {
            let r = start..(start + ARENA_BLOCK).min(mine.end);
            let acc = &mut buf[r.clone()];
            for k in 1..n {
                // SAFETY: see above; `r` is inside segment `p` of a buffer of `buf.len()`.
                let incoming = unsafe {
                    std::slice::from_raw_parts(
                        tensor((p + k) % n).add(r.start) as *const u8,
                        r.len(),
                    )
                };
                combine(acc, incoming);
            }
            finish(acc);
            for k in 1..n {
                // SAFETY: as above; only this member writes segment `p` of any tensor.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        acc.as_ptr(),
                        tensor((p + k) % n).add(r.start),
                        r.len(),
                    )
                };
            }
            start = r.end;
        }
        self.in_place.fetch_add(1, Ordering::Relaxed);
        let me = self.flags(self.me);
        me.reduced.store(g + 1, Ordering::Release);
        // No slot was used: the chunk's slot is free for the next one at once.
        me.consumed.store(g + 1, Ordering::Release);
        self.notify_all(members);
        self.wait_for_all(members, |f| f.reduced.load(Ordering::Acquire) > g, patience)
    }

    /// How many allreduces this member folded in place from shared tensors.
    pub fn in_place_allreduces(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    /// `len` zeroed bytes in this member's arena, for a tensor that the members can
    /// allreduce in place when every one of them passes one ([`Self::fold_allreduce`]);
    /// `Ok(None)`: the arena has no room left for them. The pages are reserved now, so a
    /// full `/dev/shm` is an error here, not a SIGBUS later.
    pub fn alloc_shared(&self, len: usize) -> std::io::Result<Option<SharedLease>> {
        let len = len.max(1).div_ceil(ARENA_GRANULE) * ARENA_GRANULE;
        let arena = || {
            self.arena
                .lock()
                .map_err(|_| std::io::Error::other("the shared-tensor arena's lock is poisoned"))
        };
        let Some(at) = arena()?.take(len) else {
            return Ok(None);
        };
        let file_offset = self.layout.arena(self.me) + at;
        if let Err(e) = fallocate(&self.file, 0, file_offset, len) {
            arena()?.give(at, len);
            return Err(e);
        }
        Ok(Some(SharedLease {
            map: self.map.clone(),
            file: self.file.clone(),
            arena: self.arena.clone(),
            file_offset,
            arena_offset: at,
            len,
        }))
    }

    /// [`Self::fold_allreduce`] for a buffer that fits in one slot, with one barrier
    /// instead of three: every member puts its whole buffer in its slot and then folds
    /// *every* segment itself, each in exactly the order the fold uses (segment `j` starts
    /// from the bytes of the member at position `j`, then `j+1`, `j+2`, …), so the bits
    /// are the fold's and the ring's. It reduces `n` times as much as the fold, which for
    /// small buffers costs less than the two barriers it saves.
    fn one_shot_allreduce(
        &self,
        members: &[usize],
        buf: &mut [u8],
        segments: &[std::ops::Range<usize>],
        combine: &dyn Fn(&mut [u8], &[u8]),
        finish: &dyn Fn(&mut [u8]),
        peer_gone: PeerGone<'_>,
    ) -> Result<()> {
        let n = members.len();
        let p = members
            .iter()
            .position(|&m| m == self.me)
            .ok_or_else(|| self.link_error(self.my_rank(), "not a member of this allreduce"))?;
        let mut chunks = self.lock(&self.chunks, self.me)?;
        let mut patience = self.patience(members, peer_gone);
        let me = self.flags(self.me);
        let (g, s) = self.next_chunk(&mut chunks.next, members, &mut patience)?;
        let early = chunks.early.take();
        if early == Some((g, buf.as_ptr() as usize, buf.len())) {
            // Every member put this chunk's inputs in its slot before the round of posts
            // that agreed on this allreduce (`same_posts_early`): they are all there.
            me.written.store(g + 1, Ordering::Release);
        } else {
            // SAFETY: the slot holds a ring's bytes (at least `buf.len()`, checked by
            // the caller); nobody reads it until `written` says so.
            unsafe {
                std::ptr::copy_nonoverlapping(buf.as_ptr(), self.slot(self.me, s), buf.len())
            };
            self.written_barrier(members, g, &mut patience)?;
        }
        // SAFETY: every member published its whole buffer in slot `s` (`written` > g) and
        // leaves it alone until everyone says `consumed`; our own input is read from our
        // slot, so `buf` can take the results as they are made.
        let input = |position: usize, range: &std::ops::Range<usize>| unsafe {
            std::slice::from_raw_parts(
                self.slot(members[position], s).add(range.start) as *const u8,
                range.len(),
            )
        };
        for (j, range) in segments.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let acc = &mut buf[range.clone()];
            if j != p {
                // Our own segment starts from our own bytes, which `buf` still holds
                // there (segments are disjoint; each is written only in its turn).
                acc.copy_from_slice(input(j, range));
            }
            for k in 1..n {
                combine(acc, input((j + k) % n, range));
            }
            finish(acc);
        }
        me.reduced.store(g + 1, Ordering::Release);
        me.consumed.store(g + 1, Ordering::Release);
        self.notify_all(members);
        Ok(())
    }

    /// Whether every one of `members` (member indices, this rank among them) posts exactly
    /// the bytes of `post` (at most [`MAX_POST_BYTES`]) in this round: one barrier through
    /// the segment, no round trip to anyone. Every member must take part in every round, in
    /// the same order; all of them get the same answer (a member that posts something else
    /// sees that too). Each member's post alternates between two buffers: a member writes
    /// round `r` over round `r - 2`, which everyone has read, since it has seen everyone's
    /// post of round `r - 1`, which each wrote after reading round `r - 2`.
    #[cfg(test)]
    pub(crate) fn same_posts(
        &self,
        members: &[usize],
        post: &[u8],
        peer_gone: PeerGone<'_>,
    ) -> Result<bool> {
        self.same_posts_early(members, post, None, peer_gone)
    }

    /// [`Self::same_posts`], and with `early` (the buffer of the allreduce this member
    /// expects to run next, when every post agrees) its inputs go into this member's
    /// slot first, if that allreduce is a one-shot ([`Self::fold_allreduce`]) and the
    /// slot is free now, which it is between cycles. Whether they did goes into the
    /// post, so all members agree on it too; if they all did, the one-shot of `early`
    /// skips its copy and its barrier: the round of posts was that barrier. Otherwise
    /// nothing was published (`written` is untouched) and the one-shot runs as always.
    pub(crate) fn same_posts_early(
        &self,
        members: &[usize],
        post: &[u8],
        early: Option<&[u8]>,
        peer_gone: PeerGone<'_>,
    ) -> Result<bool> {
        let extra = if early.is_some() {
            EARLY_TRAILER_BYTES
        } else {
            0
        };
        if post.len() + extra > MAX_POST_BYTES || !members.contains(&self.me) {
            return Err(self.link_error(self.my_rank(), "shared post: bad size or members"));
        }
        let mut early_chunk = None;
        let mut trailer = [0u8; EARLY_TRAILER_BYTES];
        // Held through the round: nothing else starts a chunk meanwhile.
        let mut chunks = self.lock(&self.chunks, self.me)?;
        if let Some(data) = early {
            early_chunk = self.put_early(members, data, chunks.next)?;
            trailer[0] = u8::from(early_chunk.is_some());
            trailer[1..].copy_from_slice(&(data.len() as u64).to_le_bytes());
        }
        let same = self.exchange_posts(members, [post, &trailer[..extra]], peer_gone)?;
        chunks.early = match (same, early_chunk, early) {
            (true, Some(g), Some(data)) => Some((g, data.as_ptr() as usize, data.len())),
            _ => None,
        };
        Ok(same)
    }

    /// Puts `data` in this member's slot for the next shared-allreduce chunk when that
    /// chunk would be a one-shot of it and every member is done with the chunk that
    /// used the slot before (as [`Self::next_chunk`] would wait for, without waiting);
    /// returns that chunk. Publishes nothing: `written` is left alone.
    fn put_early(&self, members: &[usize], data: &[u8], g: u64) -> Result<Option<u64>> {
        if data.is_empty() || data.len() > ONE_SHOT_MAX_BYTES.min(self.layout.ring_bytes) {
            return Ok(None);
        }
        let free = members
            .iter()
            .all(|&m| self.flags(m).consumed.load(Ordering::Acquire) + 1 >= g);
        if !free {
            return Ok(None);
        }
        // SAFETY: slot g % 2 holds a ring's bytes (at least `data.len()`, checked
        // above); every member is done with its previous chunk (checked above) and
        // nobody reads it for chunk g until `written` or an agreed post says so.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.slot(self.me, (g % 2) as usize),
                data.len(),
            )
        };
        Ok(Some(g))
    }

    /// One round of posts: whether every member posted exactly the bytes of `parts`, one
    /// after the other (a post and its trailer, written straight into the segment).
    fn exchange_posts(
        &self,
        members: &[usize],
        parts: [&[u8]; 2],
        peer_gone: PeerGone<'_>,
    ) -> Result<bool> {
        let mut rounds = self.lock(&self.posts, self.me)?;
        let round = *rounds;
        *rounds += 1;
        let parity = (round % 2) as usize;
        let header = |m: usize| {
            // SAFETY: `Layout::post` is inside the mapping and 128-byte aligned; the
            // first two words of a post are its round (plus one) and length.
            unsafe {
                let words = self.base().add(self.layout.post(m, parity)) as *const AtomicU64;
                (&*words, &*words.add(1))
            }
        };
        let body = |m: usize| {
            // SAFETY: `Layout::post` is inside the mapping; a post's body follows its
            // header and has room for MAX_POST_BYTES (the callers' bound).
            unsafe { self.base().add(self.layout.post(m, parity) + POST_HEADER) }
        };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let (mine, my_len) = header(self.me);
        let mut at = body(self.me);
        for part in parts {
            // SAFETY: our own post, which nobody reads until its round says so; the
            // parts add up to at most MAX_POST_BYTES.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), at, part.len());
                at = at.add(part.len());
            }
        }
        my_len.store(len as u64, Ordering::Relaxed);
        mine.store(round + 1, Ordering::Release);
        self.notify_all(members);
        let mut patience = self.patience(members, peer_gone);
        self.wait_for_members(
            members,
            |m| header(m).0.load(Ordering::Acquire) > round,
            &mut patience,
        )?;
        Ok(members.iter().filter(|&&m| m != self.me).all(|&m| {
            if header(m).1.load(Ordering::Relaxed) != len as u64 {
                return false;
            }
            // SAFETY: member m published this round's post of `len` bytes (its round
            // word, read with Acquire above) and leaves it alone until it has seen ours
            // of the next round.
            let theirs = unsafe { std::slice::from_raw_parts(body(m) as *const u8, len) };
            let (first, rest) = theirs.split_at(parts[0].len());
            first == parts[0] && rest == parts[1]
        }))
    }

    /// Waits until one of `members` has posted a round of [`Self::same_posts`] that this
    /// rank has not (it waits there for this rank), or until `deadline`; returns whether
    /// one has. Woken by the post's doorbell, so the wait costs nothing while nobody posts.
    pub(crate) fn wait_for_a_post(&self, members: &[usize], deadline: Instant) -> Result<bool> {
        let round = *self.lock(&self.posts, self.me)?;
        let parity = (round % 2) as usize;
        let bell = self.bell(self.me);
        loop {
            let seq = bell.seq.load(Ordering::SeqCst);
            let posted = members.iter().filter(|&&m| m != self.me).any(|&m| {
                // SAFETY: as in `same_posts`: the first word of a post is its round + 1.
                let word =
                    unsafe { &*(self.base().add(self.layout.post(m, parity)) as *const AtomicU64) };
                word.load(Ordering::Acquire) > round
            });
            let now = Instant::now();
            if posted || now >= deadline {
                return Ok(posted);
            }
            bell.waiters.fetch_add(1, Ordering::SeqCst);
            futex_wait(&bell.seq, seq, (deadline - now).min(WAIT_SLICE));
            bell.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The member index of global rank `rank`, if it shares memory with this rank.
    pub fn member_of(&self, rank: usize) -> Option<usize> {
        let m = self.ranks.iter().position(|&r| r == rank)?;
        (m != self.me && self.active[m] && self.active[self.me]).then_some(m)
    }

    /// Global ranks that share memory with this rank.
    pub fn peers(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&m| m != self.me && self.active[m])
            .map(|m| self.ranks[m])
            .collect()
    }

    fn my_rank(&self) -> usize {
        self.ranks[self.me]
    }

    fn notify(&self, member: usize) {
        let bell = self.bell(member);
        bell.seq.fetch_add(1, Ordering::SeqCst);
        if bell.waiters.load(Ordering::SeqCst) > 0 {
            futex_wake(&bell.seq);
        }
    }

    /// Marks this rank as aborted and wakes every peer, so that their waits on it end now.
    pub fn abort(&self) {
        self.bell(self.me).aborted.store(1, Ordering::SeqCst);
        for m in 0..self.ranks.len() {
            if m != self.me {
                self.notify(m);
            }
        }
    }

    /// Wakes this rank's own waits (after setting a cancel flag they watch).
    pub(crate) fn wake_self(&self) {
        self.notify(self.me);
    }

    fn link_error(&self, peer: usize, message: impl Into<String>) -> CollectiveError {
        CollectiveError::Link {
            rank: self.my_rank(),
            peer,
            message: message.into(),
        }
    }

    /// Writes as much of `out` as fits now, one granule at most. Returns whether it moved.
    fn write_step(&self, to: usize, tx: &mut TxState, out: &mut Outgoing<'_>) -> bool {
        if out.done() {
            return false;
        }
        let ring = self.ring(self.me, to);
        let capacity = ring.capacity as u64;
        let mut free = capacity - (tx.head - ring.tail().load(Ordering::Acquire));
        let mut moved = false;
        if !out.started {
            let pad = pad_to_align(tx.head);
            if free < pad + HEADER as u64 {
                return false;
            }
            tx.head += pad;
            let at = (tx.head % capacity) as usize;
            // SAFETY: `at` is a multiple of ALIGN inside the ring (capacity is a multiple
            // of ALIGN), and these bytes are free: the reader's tail is behind them.
            unsafe {
                let words = ring.data.add(at) as *mut u64;
                words.write(out.data.len() as u64);
                words.add(1).write(MESSAGE_MAGIC);
            }
            tx.head += HEADER as u64;
            free -= pad + HEADER as u64;
            out.started = true;
            moved = true;
        }
        let at = (tx.head % capacity) as usize;
        let n = (out.data.len() - out.sent)
            .min(free as usize)
            .min(ring.capacity - at)
            .min(WRITE_GRANULE);
        if n > 0 {
            // SAFETY: [at, at + n) is inside the ring and free (see above); the source is a
            // live slice that does not overlap the mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(out.data.as_ptr().add(out.sent), ring.data.add(at), n)
            };
            tx.head += n as u64;
            out.sent += n;
            moved = true;
        }
        if moved {
            ring.head().store(tx.head, Ordering::Release);
            self.notify(to);
        }
        moved
    }

    /// The next readable span of the current message from `from` (reading its header first
    /// if a new message starts), or `None` if nothing is there yet.
    fn readable(&self, from: usize, rx: &mut RxState) -> Result<Option<(*const u8, usize)>> {
        let ring = self.ring(from, self.me);
        let capacity = ring.capacity as u64;
        let head = ring.head().load(Ordering::Acquire);
        if rx.message_left == 0 {
            let pad = pad_to_align(rx.tail);
            if head - rx.tail < pad + HEADER as u64 {
                return Ok(None);
            }
            rx.tail += pad;
            let at = (rx.tail % capacity) as usize;
            // SAFETY: the writer published these HEADER bytes (head is past them).
            let (len, magic) = unsafe {
                let words = ring.data.add(at) as *const u64;
                (words.read(), words.add(1).read())
            };
            if magic != MESSAGE_MAGIC || len == 0 {
                return Err(self.link_error(
                    self.ranks[from],
                    "corrupt shared-memory ring (a message header is wrong): the ranks \
                     disagree on the order of operations",
                ));
            }
            rx.tail += HEADER as u64;
            rx.message_left = len;
        }
        let at = (rx.tail % capacity) as usize;
        let n = ((head - rx.tail).min(rx.message_left) as usize).min(ring.capacity - at);
        if n == 0 {
            return Ok(None);
        }
        // SAFETY: [at, at + n) is inside the ring and published by the writer.
        Ok(Some((unsafe { ring.data.add(at) as *const u8 }, n)))
    }

    fn consume(&self, from: usize, rx: &mut RxState, n: usize) {
        rx.tail += n as u64;
        rx.message_left -= n as u64;
        self.ring(from, self.me)
            .tail()
            .store(rx.tail, Ordering::Release);
        self.notify(from);
    }

    /// Reads what is there now into `incoming`, one chunk or piece at most.
    fn read_step(&self, from: usize, rx: &mut RxState, incoming: &mut Incoming) -> Result<bool> {
        match incoming {
            Incoming::Copy {
                buf,
                filled,
                reported,
                chunk,
                on_chunk,
            } => {
                if *filled == buf.len() {
                    return Ok(false);
                }
                let Some((ptr, n)) = self.readable(from, rx)? else {
                    return Ok(false);
                };
                let next_report = (*reported + *chunk).min(buf.len());
                let n = n.min(next_report - *filled);
                // SAFETY: `ptr` points at `n` published bytes of the ring; `buf` is ours.
                unsafe { std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr().add(*filled), n) };
                self.consume(from, rx, n);
                *filled += n;
                if *filled == next_report {
                    if let Some(cb) = on_chunk {
                        cb(*reported, &buf[*reported..*filled]);
                    }
                    *reported = *filled;
                }
                Ok(true)
            }
            Incoming::Pieces {
                len,
                done,
                piece_buf,
                piece_filled,
                on_piece,
            } => {
                if *done == *len {
                    return Ok(false);
                }
                let needed = piece_buf.len().min(*len - *done);
                let Some((ptr, n)) = self.readable(from, rx)? else {
                    return Ok(false);
                };
                if *piece_filled == 0 {
                    let ring = self.ring(from, self.me);
                    let at = (rx.tail % ring.capacity as u64) as usize;
                    let whole_in_place =
                        rx.message_left >= needed as u64 && at + needed <= ring.capacity;
                    if whole_in_place {
                        if n < needed {
                            // It will lie whole in the ring: wait for the rest rather
                            // than copying.
                            return Ok(false);
                        }
                        // SAFETY: `needed` published bytes at `ptr`; the writer does not
                        // touch them until `consume` moves the tail past them.
                        let piece = unsafe { std::slice::from_raw_parts(ptr, needed) };
                        on_piece(*done, piece);
                        self.consume(from, rx, needed);
                        *done += needed;
                        return Ok(true);
                    }
                }
                let n = n.min(needed - *piece_filled);
                // SAFETY: as above; `piece_buf` is ours and has room for `needed` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr, piece_buf.as_mut_ptr().add(*piece_filled), n)
                };
                self.consume(from, rx, n);
                *piece_filled += n;
                if *piece_filled == needed {
                    on_piece(*done, &piece_buf[..needed]);
                    *done += needed;
                    *piece_filled = 0;
                }
                Ok(true)
            }
        }
    }

    fn lock<'s, T>(&self, m: &'s Mutex<T>, peer: usize) -> Result<std::sync::MutexGuard<'s, T>> {
        m.lock()
            .map_err(|_| self.link_error(self.ranks[peer], "shared-memory ring lock poisoned"))
    }

    /// Sends `out` to member `to` while receiving `incoming` from member `from`, on this
    /// thread, interleaving the two. Either may be absent. `cancel` ends the wait early.
    pub(crate) fn exchange(
        &self,
        to: Option<(usize, Outgoing<'_>)>,
        from: Option<(usize, Incoming<'_, '_>)>,
        cancel: Option<&AtomicBool>,
        peer_gone: PeerGone<'_>,
    ) -> Result<()> {
        let (to_member, mut out) = match to {
            Some((m, o)) => (Some(m), Some(o)),
            None => (None, None),
        };
        let (from_member, mut incoming) = match from {
            Some((m, i)) => (Some(m), Some(i)),
            None => (None, None),
        };
        let mut tx = match to_member {
            Some(m) => Some(self.lock(&self.tx[m], m)?),
            None => None,
        };
        let mut rx = match from_member {
            Some(m) => Some(self.lock(&self.rx[m], m)?),
            None => None,
        };
        let mut patience = Patience {
            since: None,
            last_health_check: None,
            peers: Peers::Pair([to_member, from_member]),
            // Name the peer we were waiting to hear from, else the one we were sending to.
            waiting_on: from_member.or(to_member).unwrap_or(self.me),
            cancel,
            peer_gone,
        };
        let bell = self.bell(self.me);
        loop {
            let sending = out.as_ref().is_some_and(|o| !o.done());
            let receiving = incoming.as_ref().is_some_and(|i| !i.done());
            if !sending && !receiving {
                return Ok(());
            }
            let seq = bell.seq.load(Ordering::SeqCst);
            let mut progressed = false;
            if let (Some(m), Some(o), Some(tx)) = (to_member, out.as_mut(), tx.as_mut()) {
                progressed |= self.write_step(m, tx, o);
            }
            if let (Some(m), Some(i), Some(rx)) = (from_member, incoming.as_mut(), rx.as_mut()) {
                progressed |= self.read_step(m, rx, i)?;
            }
            if progressed {
                patience.progressed();
                continue;
            }
            self.wait(seq, &mut patience)?;
        }
    }

    /// Where every member of the host can have a core of its own, moves this member off a
    /// core that another member last waited on, to an allowed core none did. Yielding
    /// keeps two members on the core where they are: the scheduler moves a task when it
    /// wakes up or when load balancing finds it not "cache hot" (run in the last 0.5 ms),
    /// and two members that hand a core back and forth with yields are always hot. Seen:
    /// 2 ranks on one core for a whole run next to an idle one, 12 µs a 4 KiB call
    /// instead of 3 (Open MPI binds its ranks to cores for the same reason). The move
    /// sets the affinity to the free core and at once back to the mask it was: the task
    /// stays where it was moved, its mask is the user's. Of two members on one core the
    /// later one moves; at most one move per [`MOVE_EVERY`] and thread. Returns whether
    /// this member still shares its core with another (its next waits spin less).
    fn leave_a_shared_core(&self) -> bool {
        if !self.spread {
            return false;
        }
        // SAFETY: no arguments; returns the calling thread's current core or -1.
        let Ok(cpu) = u32::try_from(unsafe { libc::sched_getcpu() }) else {
            return false;
        };
        self.bell(self.me).cpu.store(cpu + 1, Ordering::Relaxed);
        let on_this_core = |m: usize| {
            m != self.me && self.active[m] && self.bell(m).cpu.load(Ordering::Relaxed) == cpu + 1
        };
        let shared_with_earlier = (0..self.me).any(on_this_core);
        if !shared_with_earlier {
            return (self.me + 1..self.ranks.len()).any(on_this_core);
        }
        // Per thread: the thread that moved at start-up (the cycle thread, which runs
        // the first cycles) is not the one that waits later (a caller running its own
        // cycles), and that one must not wait out the other's turn on a shared core.
        let recently = LAST_MOVE.with(|last| {
            let now = Instant::now();
            if last
                .get()
                .is_some_and(|t| now.duration_since(t) < MOVE_EVERY)
            {
                return true;
            }
            last.set(Some(now));
            false
        });
        if recently {
            return true;
        }
        // Only now, on the rare wait that moves: the cores the others last waited on.
        let taken: Vec<u32> = (0..self.ranks.len())
            .filter(|&m| m != self.me && self.active[m])
            .map(|m| self.bell(m).cpu.load(Ordering::Relaxed))
            .filter(|&c| c != 0)
            .map(|c| c - 1)
            .collect();
        match move_to_a_free_core(cpu, &taken) {
            Some(to) => {
                // Said at once, so that the member left behind sees its core as its own
                // (it would otherwise keep spinning less until this one waits long again).
                self.bell(self.me).cpu.store(to + 1, Ordering::Relaxed);
                tracing::debug!(
                    rank = self.my_rank(),
                    from = cpu,
                    to,
                    "shared a core with another rank of this host: moved to a free one"
                );
                false
            }
            None => true,
        }
    }

    /// Sleeps on this rank's doorbell until it rings past `seq`, a slice passes, or a
    /// reason to give up appears.
    fn wait(&self, seq: u32, patience: &mut Patience<'_>) -> Result<()> {
        let bell = self.bell(self.me);
        // With more ranks than cores the peer most often waits for this core: spinning
        // only keeps it from running.
        let spins = if self.spread {
            self.spins.load(Ordering::Relaxed)
        } else {
            OVERSUBSCRIBED_SPINS
        };
        for _ in 0..spins {
            if bell.seq.load(Ordering::Relaxed) != seq {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        // The spins did not do: from here on the wait counts against the timeout.
        let started = *patience.since.get_or_insert_with(Instant::now);
        // Two members on one core hand it to each other with yields: a long spin there
        // only delays the one that is waited for (seen: 2-rank 4 KiB calls at 9 µs
        // instead of 1.3 µs for the first ~100 ms of a job, until the scheduler left
        // them on separate cores). Full spins again once this core is its own.
        let shared = self.leave_a_shared_core();
        self.spins.store(
            if shared { OVERSUBSCRIBED_SPINS } else { SPINS },
            Ordering::Relaxed,
        );
        // The peers run on other cores: a yield or a sleep beside other work would
        // lose this core for a slice, so spin a while first (crate::poll).
        if !shared
            && self.spread
            && crate::poll::spin_until(crate::poll::SPIN_BUDGET, || {
                bell.seq.load(Ordering::Relaxed) != seq
            })
        {
            return Ok(());
        }
        // The peer may be waiting for this core (more ranks than cores): hand it over.
        if crate::poll::yield_until(crate::poll::YIELD_BUDGET, || {
            bell.seq.load(Ordering::Relaxed) != seq
        }) {
            return Ok(());
        }
        bell.waiters.fetch_add(1, Ordering::SeqCst);
        futex_wait(&bell.seq, seq, WAIT_SLICE);
        bell.waiters.fetch_sub(1, Ordering::SeqCst);
        // Why we might have to stop, cheapest first.
        if bell.aborted.load(Ordering::SeqCst) != 0 {
            return Err(self.link_error(
                self.ranks[patience.waiting_on],
                "this rank aborted its links after a failure",
            ));
        }
        if patience.cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
            return Err(self.link_error(
                self.ranks[patience.waiting_on],
                "cancelled: the other half of this step failed",
            ));
        }
        for m in patience.peers.iter(self.me) {
            if self.bell(m).aborted.load(Ordering::SeqCst) != 0 {
                return Err(self.link_error(
                    self.ranks[m],
                    "the peer aborted its links (it failed, or gave up after another rank failed)",
                ));
            }
        }
        let now = Instant::now();
        // A peer that wrote its last bytes and then exited (closing its TCP link) is
        // not a failure while those bytes wait in the ring: when the bell rang since
        // the caller looked, let it look again before judging the peers.
        let rang = bell.seq.load(Ordering::SeqCst) != seq;
        let last_check = *patience.last_health_check.get_or_insert(started);
        if !rang && now.duration_since(last_check) >= WAIT_SLICE {
            patience.last_health_check = Some(now);
            for m in patience.peers.iter(self.me) {
                if (patience.peer_gone)(self.ranks[m]) {
                    return Err(self.link_error(
                        self.ranks[m],
                        "connection closed by the peer (that rank exited, crashed, or gave up after another rank failed)",
                    ));
                }
            }
        }
        if now.duration_since(started) >= self.timeout {
            return Err(CollectiveError::PeerTimeout {
                rank: self.my_rank(),
                peer: self.ranks[patience.waiting_on],
                timeout: self.timeout,
            });
        }
        Ok(())
    }
}

/// How often a thread may move to another core ([`ShmGroup::leave_a_shared_core`]).
const MOVE_EVERY: Duration = Duration::from_millis(100);

thread_local! {
    /// When this thread last moved to another core.
    static LAST_MOVE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Moves the calling thread from core `from` to an allowed core that is not in `taken`,
/// leaving its affinity mask as it was; returns the core, or `None` when there is none
/// or the kernel refuses.
fn move_to_a_free_core(from: u32, taken: &[u32]) -> Option<u32> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls get its size and write
    // at most that much; pid 0 is the calling thread.
    unsafe {
        let mut mask: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        if libc::sched_getaffinity(0, size, &mut mask) != 0 {
            return None;
        }
        let to = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &mask))
            .map(|c| c as u32)
            .find(|&c| c != from && !taken.contains(&c))?;
        let mut only = std::mem::zeroed::<libc::cpu_set_t>();
        libc::CPU_SET(to as usize, &mut only);
        let moved = libc::sched_setaffinity(0, size, &only) == 0;
        // Back to the whole mask at once: the thread stays on `to` until the scheduler
        // moves it, as any thread would.
        libc::sched_setaffinity(0, size, &mask);
        moved.then_some(to)
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 in a shared mapping (hence no PRIVATE flag);
    // the kernel only reads it and compares with `expected`. Errors (EAGAIN when the word
    // changed, EINTR, ETIMEDOUT) all mean "look again", which every caller does.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as for `futex_wait`; waking has no memory effects.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Host identity and segments

/// What ranks must share to share memory: the boot, the network namespace (pretend nodes
/// in separate namespaces stay separate hosts) and the mount namespace (the same
/// `/dev/shm`). `RINGWATCH_HOST_ID`, if set, is added: ranks with different values never
/// share memory (a way to split one machine into hosts for tests). `None` if any part
/// cannot be read; such a rank uses TCP only.
pub fn host_key() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    let mnt = std::fs::read_link("/proc/self/ns/mnt").ok()?;
    let extra = std::env::var("RINGWATCH_HOST_ID").unwrap_or_default();
    Some(format!(
        "{}|{}|{}|{extra}",
        boot.trim(),
        net.display(),
        mnt.display()
    ))
}

/// Where segments are created.
pub const SHM_DIR: &str = "/dev/shm";

/// A segment file created by a group's first rank, removed from the directory as soon as
/// every member has mapped it (or on drop), so nothing is left behind after a crash.
#[derive(Debug)]
pub struct SegmentFile {
    path: PathBuf,
    file: File,
    nonce: u64,
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn random_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

fn segment_name(job_id: &str, nonce: u64) -> String {
    let job: String = job_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    format!("ringwatch-{job}-{}-{nonce:016x}", std::process::id())
}

/// The creator's pid in a segment file's name (`ringwatch-<job>-<pid>-<nonce>`).
fn creator_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("ringwatch-")?;
    let (before_nonce, nonce) = rest.rsplit_once('-')?;
    if nonce.len() != 16 || !nonce.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    before_nonce.rsplit_once('-')?.1.parse().ok()
}

/// Removes segment files whose creator is gone. A segment's name lives only between its
/// creation and the end of the start-up handshake; a file left behind means its creator
/// died in between, and it would hold its memory until the next boot.
fn remove_orphans(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(creator_pid) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::remove_file(entry.path()).is_ok()
        {
            tracing::info!(path = %entry.path().display(), "removed a shared-memory segment whose creator is gone");
        }
    }
}

/// Creates and initializes a segment for `members` ranks in `dir`, reserving its memory
/// now (so a full `/dev/shm` is an error here, not a SIGBUS later).
pub fn create_segment(
    dir: &std::path::Path,
    job_id: &str,
    members: usize,
    ring_bytes: usize,
    arena_bytes: usize,
) -> std::io::Result<SegmentFile> {
    let layout = Layout {
        members,
        ring_bytes,
        arena_bytes: arena_bytes / PAGE * PAGE,
    };
    remove_orphans(dir);
    let nonce = random_nonce();
    let path = dir.join(segment_name(job_id, nonce));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    let segment = SegmentFile { path, file, nonce };
    segment.file.set_len(layout.total() as u64)?;
    let reserve = |offset: usize, len: usize| fallocate(&segment.file, 0, offset, len);
    reserve(0, layout.data_start())?;
    for src in 0..members {
        for dst in (0..members).filter(|&d| d != src) {
            reserve(layout.ring_data(src, dst), ring_bytes)?;
        }
    }
    reserve(layout.slot(0, 0), 2 * members * ring_bytes)?;
    // The arenas stay sparse: shared tensors reserve their pages when allocated.
    let map = MmapOptions::new()
        .len(layout.data_start())
        .map_raw(&segment.file)?;
    // SAFETY: offset 0 of a fresh, page-aligned mapping that nobody else has yet.
    let header = unsafe { &*(map.as_mut_ptr() as *const SegmentHeader) };
    header.members.store(members as u64, Ordering::Relaxed);
    header
        .ring_bytes
        .store(ring_bytes as u64, Ordering::Relaxed);
    header.nonce.store(nonce, Ordering::Relaxed);
    header
        .arena_bytes
        .store(layout.arena_bytes as u64, Ordering::Relaxed);
    header.magic.store(SEGMENT_MAGIC, Ordering::Release);
    Ok(segment)
}

impl SegmentFile {
    /// The file's path (sent to the other members).
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
    /// The nonce the other members check after mapping.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }
}

/// Maps the segment at `path` as member `me` of `ranks`, checking that it is the one
/// announced (`nonce`) and laid out as expected (rings of `ring_bytes`, arenas of
/// `arena_bytes`).
pub fn map_segment(
    path: &std::path::Path,
    nonce: u64,
    ranks: &[usize],
    me: usize,
    ring_bytes: usize,
    arena_bytes: usize,
    timeout: Duration,
) -> std::result::Result<ShmGroup, String> {
    let layout = Layout {
        members: ranks.len(),
        ring_bytes,
        arena_bytes: arena_bytes / PAGE * PAGE,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .len();
    if len != layout.total() as u64 {
        return Err(format!(
            "{} has {len} bytes, expected {}",
            path.display(),
            layout.total()
        ));
    }
    let map = MmapOptions::new()
        .len(layout.total())
        .map_raw(&file)
        .map_err(|e| format!("cannot map {}: {e}", path.display()))?;
    let group = ShmGroup {
        map: Arc::new(map),
        file: Arc::new(file),
        arena: Arc::new(Mutex::new(ArenaFree::new(layout.arena_bytes))),
        in_place: AtomicU64::new(0),
        layout,
        ranks: ranks.to_vec(),
        active: vec![true; ranks.len()],
        me,
        timeout,
        tx: (0..ranks.len()).map(|_| Mutex::default()).collect(),
        rx: (0..ranks.len()).map(|_| Mutex::default()).collect(),
        chunks: Mutex::new(Chunks::default()),
        posts: Mutex::new(0),
        spread: std::thread::available_parallelism().is_ok_and(|cores| ranks.len() <= cores.get()),
        spins: AtomicU32::new(SPINS),
    };
    let header = group.header();
    let ok = header.magic.load(Ordering::Acquire) == SEGMENT_MAGIC
        && header.nonce.load(Ordering::Relaxed) == nonce
        && header.members.load(Ordering::Relaxed) == ranks.len() as u64
        && header.ring_bytes.load(Ordering::Relaxed) == ring_bytes as u64
        && header.arena_bytes.load(Ordering::Relaxed) == group.layout.arena_bytes as u64;
    if !ok {
        return Err(format!(
            "{} is not the segment that was announced",
            path.display()
        ));
    }
    Ok(group)
}

impl ShmGroup {
    /// Keeps only the members in `active` (those that mapped the segment).
    pub fn restrict(&mut self, active: &[usize]) {
        self.active = self.ranks.iter().map(|r| active.contains(r)).collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(n: usize, ring_bytes: usize, timeout: Duration) -> (SegmentFile, Vec<ShmGroup>) {
        let dir = std::env::temp_dir();
        let seg = create_segment(&dir, "unit", n, ring_bytes, 64 << 20).unwrap();
        let ranks: Vec<usize> = (10..10 + n).collect();
        let groups = (0..n)
            .map(|me| {
                map_segment(
                    seg.path(),
                    seg.nonce(),
                    &ranks,
                    me,
                    ring_bytes,
                    64 << 20,
                    timeout,
                )
                .unwrap()
            })
            .collect();
        (seg, groups)
    }

    #[test]
    fn an_arena_is_its_share_of_the_free_memory_up_to_the_cap() {
        // A container's 64 MiB /dev/shm for 4 ranks: 16 MiB each, whole pages.
        assert_eq!(arena_bytes_for(4, 64 << 20), 16 << 20);
        assert_eq!(arena_bytes_for(3, 64 << 20) % PAGE, 0);
        assert_eq!(arena_bytes_for(2, 1 << 40), ARENA_BYTES);
        assert_eq!(arena_bytes_for(2, 100), 0);
    }

    #[test]
    fn an_arenas_free_ranges_join_when_given_back_in_any_order() {
        let mut free = ArenaFree::new(10 * PAGE);
        let a = free.take(2 * PAGE).unwrap();
        let b = free.take(3 * PAGE).unwrap();
        let c = free.take(PAGE).unwrap();
        assert_eq!((a, b, c), (0, 2 * PAGE, 5 * PAGE));
        assert_eq!(free.take(5 * PAGE), None, "4 pages are left");
        free.give(a, 2 * PAGE);
        free.give(c, PAGE);
        assert_eq!(free.ranges, vec![0..2 * PAGE, 5 * PAGE..10 * PAGE]);
        free.give(b, 3 * PAGE);
        assert_eq!(free.ranges, vec![0..10 * PAGE]);
        assert_eq!(free.take(10 * PAGE), Some(0));
        assert!(free.ranges.is_empty());
    }

    /// `err` is member 0 (rank 10) giving up on member 1 (rank 11).
    fn assert_times_out_naming_rank_11(err: &CollectiveError) {
        assert!(
            matches!(
                err,
                CollectiveError::PeerTimeout {
                    rank: 10,
                    peer: 11,
                    ..
                }
            ),
            "{err}"
        );
    }

    fn never_gone(_: usize) -> bool {
        false
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add((i >> 8) as u8))
            .collect()
    }

    #[test]
    fn messages_of_odd_sizes_cross_a_small_ring_intact_and_in_order() {
        let (_seg, mut g) = group(2, 4096, Duration::from_secs(10));
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        let sizes = [1usize, 63, 64, 65, 4000, 4096, 10_000, 3, 70_000];
        std::thread::scope(|s| {
            s.spawn(|| {
                for (i, &n) in sizes.iter().enumerate() {
                    let data = pattern(n, i as u8 + 1);
                    a.exchange(Some((1, Outgoing::new(&data))), None, None, &never_gone)
                        .unwrap();
                }
            });
            for (i, &n) in sizes.iter().enumerate() {
                let mut buf = vec![0u8; n];
                b.exchange(
                    None,
                    Some((0, Incoming::copy(&mut buf, 1000, None))),
                    None,
                    &never_gone,
                )
                .unwrap();
                assert_eq!(buf, pattern(n, i as u8 + 1), "message {i} of {n} bytes");
            }
        });
    }

    #[test]
    fn a_receive_may_span_several_sends() {
        let (_seg, mut g) = group(2, 8192, Duration::from_secs(10));
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        let whole = pattern(30_000, 7);
        std::thread::scope(|s| {
            s.spawn(|| {
                for part in whole.chunks(7001) {
                    a.exchange(Some((1, Outgoing::new(part))), None, None, &never_gone)
                        .unwrap();
                }
            });
            let mut buf = vec![0u8; whole.len()];
            let mut chunks = Vec::new();
            let mut cb = |off: usize, bytes: &[u8]| chunks.push((off, bytes.len()));
            b.exchange(
                None,
                Some((0, Incoming::copy(&mut buf, 4096, Some(&mut cb)))),
                None,
                &never_gone,
            )
            .unwrap();
            assert_eq!(buf, whole);
            let expected: Vec<(usize, usize)> = (0..whole.len())
                .step_by(4096)
                .map(|o| (o, 4096.min(whole.len() - o)))
                .collect();
            assert_eq!(chunks, expected);
        });
    }

    #[test]
    fn full_duplex_exchange_larger_than_the_rings_both_ways() {
        // Both ranks send 3 MiB through 64 KiB rings before either finishes receiving:
        // only a truly interleaved exchange gets through.
        let (_seg, mut g) = group(2, 64 * 1024, Duration::from_secs(10));
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        let size = 3 << 20;
        let run = |t: &ShmGroup, me: usize, seed: u8| {
            let peer = 1 - me;
            let send = pattern(size, seed);
            let mut recv = vec![0u8; size];
            t.exchange(
                Some((peer, Outgoing::new(&send))),
                Some((peer, Incoming::copy(&mut recv, 1 << 20, None))),
                None,
                &never_gone,
            )
            .unwrap();
            recv
        };
        let (ra, rb) = std::thread::scope(|s| {
            let ha = s.spawn(|| run(&a, 0, 3));
            let rb = run(&b, 1, 5);
            (ha.join().unwrap(), rb)
        });
        assert_eq!(ra, pattern(size, 5));
        assert_eq!(rb, pattern(size, 3));
    }

    #[test]
    fn pieces_come_straight_from_the_ring_when_whole_and_are_gathered_otherwise() {
        let ring = 64 * 1024;
        let (_seg, mut g) = group(2, ring, Duration::from_secs(10));
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        let piece = 16 * 1024;
        // A leading odd-sized message shifts later pieces so that some straddle the end of
        // the ring; every byte must still arrive, in order, in pieces of `piece` bytes.
        let lead = pattern(100, 1);
        let data = pattern(300_000, 9);
        std::thread::scope(|s| {
            s.spawn(|| {
                a.exchange(Some((1, Outgoing::new(&lead))), None, None, &never_gone)
                    .unwrap();
                a.exchange(Some((1, Outgoing::new(&data))), None, None, &never_gone)
                    .unwrap();
            });
            let mut head = vec![0u8; lead.len()];
            b.exchange(
                None,
                Some((0, Incoming::copy(&mut head, 4096, None))),
                None,
                &never_gone,
            )
            .unwrap();
            assert_eq!(head, lead);
            let mut piece_buf = vec![0u8; piece];
            let mut got = vec![0u8; data.len()];
            let mut in_place = 0;
            let mut seen = Vec::new();
            let base = b.map.as_ptr() as usize;
            let end = base + b.layout.total();
            let mut on_piece = |off: usize, bytes: &[u8]| {
                let p = bytes.as_ptr() as usize;
                if (base..end).contains(&p) {
                    in_place += 1;
                    assert_eq!(p % ALIGN, 0, "pieces handed in place are aligned");
                }
                seen.push((off, bytes.len()));
                got[off..off + bytes.len()].copy_from_slice(bytes);
            };
            b.exchange(
                None,
                Some((
                    0,
                    Incoming::pieces(data.len(), &mut piece_buf, &mut on_piece),
                )),
                None,
                &never_gone,
            )
            .unwrap();
            assert_eq!(got, data);
            let expected: Vec<(usize, usize)> = (0..data.len())
                .step_by(piece)
                .map(|o| (o, piece.min(data.len() - o)))
                .collect();
            assert_eq!(seen, expected);
            assert!(
                in_place >= expected.len() / 2,
                "{in_place} of {} in place",
                expected.len()
            );
            assert!(
                in_place < expected.len(),
                "some pieces straddle the ring's end"
            );
        });
    }

    #[test]
    fn posts_agree_only_when_every_member_posts_the_same_bytes_round_after_round() {
        let n = 3;
        let (_seg, g) = group(n, 4096, Duration::from_secs(10));
        let members: Vec<usize> = (0..n).collect();
        // Round r: everyone posts the same bytes, except that in every third round the
        // last member changes one byte, and in every fifth it posts a shorter message.
        // Lengths vary from round to round, so a post shorter than the last one in the
        // same buffer must not pass for it.
        let post = |r: usize, m: usize| {
            let mut p = pattern(1 + (r * 37) % MAX_POST_BYTES, r as u8 + 1);
            if m == n - 1 && r % 3 == 1 {
                let at = r % p.len();
                p[at] ^= 1;
            }
            if m == n - 1 && r % 5 == 4 {
                p.pop();
            }
            p
        };
        let rounds = 200;
        let answers: Vec<Vec<bool>> = std::thread::scope(|s| {
            let threads: Vec<_> = g
                .iter()
                .enumerate()
                .map(|(m, group)| {
                    let members = &members;
                    s.spawn(move || {
                        (0..rounds)
                            .map(|r| group.same_posts(members, &post(r, m), &never_gone).unwrap())
                            .collect::<Vec<bool>>()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let expected: Vec<bool> = (0..rounds).map(|r| post(r, 0) == post(r, n - 1)).collect();
        assert!(expected.iter().any(|&e| e) && expected.iter().any(|&e| !e));
        for (m, got) in answers.iter().enumerate() {
            assert_eq!(got, &expected, "member {m}");
        }
        let too_long = vec![0u8; MAX_POST_BYTES + 1];
        assert!(g[0].same_posts(&members, &too_long, &never_gone).is_err());
    }

    #[test]
    fn a_member_waiting_for_a_post_is_woken_by_one_and_otherwise_gives_up_at_its_deadline() {
        let (_seg, g) = group(2, 4096, Duration::from_secs(10));
        let members = [0, 1];
        let started = Instant::now();
        let deadline = started + Duration::from_millis(50);
        assert!(!g[1].wait_for_a_post(&members, deadline).unwrap());
        assert!(Instant::now() >= deadline);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(30);
                let posted = g[1].wait_for_a_post(&members, deadline).unwrap();
                // Back before its deadline: woken by the post, not by giving up.
                assert!(Instant::now() < deadline);
                // It joins the round it was woken for.
                let same = g[1].same_posts(&members, b"x", &never_gone).unwrap();
                (posted, same)
            });
            std::thread::sleep(Duration::from_millis(20));
            assert!(g[0].same_posts(&members, b"x", &never_gone).unwrap());
            assert_eq!(waiter.join().unwrap(), (true, true));
        });
        // Nothing posted beyond the rounds both took part in.
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(!g[0].wait_for_a_post(&members, deadline).unwrap());
    }

    #[test]
    fn a_post_nobody_answers_times_out_naming_the_silent_member() {
        let (_seg, g) = group(2, 4096, Duration::from_millis(200));
        let err = g[0].same_posts(&[0, 1], b"ready", &never_gone).unwrap_err();
        assert_times_out_naming_rank_11(&err);
    }

    #[test]
    fn a_silent_peer_times_out_naming_it() {
        let (_seg, g) = group(2, 4096, Duration::from_millis(200));
        let mut buf = [0u8; 8];
        let started = Instant::now();
        let err = g[0]
            .exchange(
                None,
                Some((1, Incoming::copy(&mut buf, 8, None))),
                None,
                &never_gone,
            )
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_times_out_naming_rank_11(&err);
    }

    #[test]
    fn a_peers_abort_or_death_ends_the_wait_at_once_naming_it() {
        let (_seg, g) = group(3, 4096, Duration::from_secs(30));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let mut buf = [0u8; 8];
                let started = Instant::now();
                let err = g[0]
                    .exchange(
                        None,
                        Some((1, Incoming::copy(&mut buf, 8, None))),
                        None,
                        &never_gone,
                    )
                    .unwrap_err();
                (err, started.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            g[1].abort();
            let (err, waited) = waiter.join().unwrap();
            assert!(waited < Duration::from_secs(2), "{waited:?}");
            assert!(
                matches!(
                    err,
                    CollectiveError::Link {
                        rank: 10,
                        peer: 11,
                        ..
                    }
                ),
                "{err}"
            );
        });
        // A peer whose process is gone (as the TCP link reports) is named too.
        let gone = |r: usize| r == 12;
        let mut buf = [0u8; 8];
        let err = g[0]
            .exchange(
                None,
                Some((2, Incoming::copy(&mut buf, 8, None))),
                None,
                &gone,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::Link {
                    rank: 10,
                    peer: 12,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn ring_size_shrinks_with_more_members_and_less_free_space() {
        let plenty = 1 << 40;
        // m(m-1) rings plus 2m allreduce slots of the same size.
        assert_eq!(ring_bytes_for(2, plenty), Some(MAX_RING_BYTES));
        assert_eq!(ring_bytes_for(4, plenty), Some(MAX_RING_BYTES)); // 20 of them, 160 MiB
        assert_eq!(ring_bytes_for(8, plenty), Some(2 << 20)); // 72, 144 MiB
        assert_eq!(ring_bytes_for(16, plenty), Some(512 << 10)); // 272, 136 MiB
        // Docker's default 64 MiB /dev/shm: 4 ranks get 1 MiB (20 MiB in all).
        assert_eq!(ring_bytes_for(4, 64 << 20), Some(1 << 20));
        assert_eq!(ring_bytes_for(4, 1 << 20), None);
        for m in 2..40 {
            if let Some(r) = ring_bytes_for(m, plenty) {
                assert!(valid_ring_bytes(r));
                assert!(r * m * (m + 1) <= SEGMENT_BUDGET_BYTES);
            }
        }
        assert!(!valid_ring_bytes(3 << 20) && !valid_ring_bytes(64 << 20));
        assert!(free_bytes(std::path::Path::new("/")).unwrap() > 0);
    }

    #[test]
    fn a_segment_left_by_a_dead_creator_is_removed_and_a_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("rw-shm-orphans-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // pid_max is at most 2^22: this pid cannot be running.
        let dead = dir.join("ringwatch-job-a-99999999-00000000deadbeef");
        let alive = dir.join(format!(
            "ringwatch-job-a-{}-00000000deadbeef",
            std::process::id()
        ));
        let unrelated = dir.join("ringwatch-notes-99999999-x");
        for p in [&dead, &alive, &unrelated] {
            std::fs::write(p, b"x").unwrap();
        }
        assert_eq!(
            creator_pid("ringwatch-job-a-99999999-00000000deadbeef"),
            Some(99_999_999)
        );
        let seg = create_segment(&dir, "job", 2, MIN_RING_BYTES, 0).unwrap();
        assert!(!dead.exists());
        assert!(alive.exists() && unrelated.exists() && seg.path().exists());
        drop(seg);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The calling thread's affinity mask, as the cores in it.
    fn allowed_cores() -> Vec<usize> {
        // SAFETY: as in `move_to_a_free_core`.
        unsafe {
            let mut mask: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut mask),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &mask))
                .collect()
        }
    }

    #[test]
    fn a_rank_moves_to_a_core_nobody_took_and_keeps_its_affinity_mask() {
        std::thread::spawn(|| {
            let allowed = allowed_cores();
            if allowed.len() < 2 {
                eprintln!("one core allowed: nowhere to move to, nothing to check");
                return;
            }
            // SAFETY: no arguments.
            let here = unsafe { libc::sched_getcpu() } as u32;
            // Every other allowed core taken: it stays.
            let others: Vec<u32> = allowed
                .iter()
                .map(|&c| c as u32)
                .filter(|&c| c != here)
                .collect();
            assert_eq!(move_to_a_free_core(here, &others), None);
            assert_eq!(allowed_cores(), allowed);
            // One free: it goes there, and its mask is what it was.
            let free = others[0];
            let taken: Vec<u32> = others[1..].to_vec();
            assert_eq!(move_to_a_free_core(here, &taken), Some(free));
            // SAFETY: no arguments.
            assert_eq!(unsafe { libc::sched_getcpu() } as u32, free);
            assert_eq!(allowed_cores(), allowed);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn members_on_one_core_see_it_shared_and_the_later_one_leaves() {
        std::thread::spawn(|| {
            let (_seg, groups) = group(2, MIN_RING_BYTES, Duration::from_secs(5));
            let allowed = allowed_cores();
            if allowed.len() < 2 || !groups[0].spread {
                eprintln!("one core allowed: no core of its own for each member, nothing to check");
                return;
            }
            // Read right before each call: a loaded machine may move this thread.
            // SAFETY: no arguments.
            let current = || unsafe { libc::sched_getcpu() } as u32;
            let elsewhere = |cpu: u32| allowed.iter().map(|&c| c as u32).find(|&c| c != cpu);
            let publish = |member: usize, cpu: u32| {
                groups[0].bell(member).cpu.store(cpu + 1, Ordering::Relaxed)
            };
            // Member 1 last waited elsewhere: member 0 has this core to itself.
            publish(1, elsewhere(current()).unwrap());
            assert!(!groups[0].leave_a_shared_core());
            // Member 1 last waited here: member 0 shares the core and, as the earlier of
            // the two, stays (its waits spin less meanwhile).
            let here = current();
            publish(1, here);
            assert!(groups[0].leave_a_shared_core());
            assert_eq!(groups[0].bell(0).cpu.load(Ordering::Relaxed), here + 1);
            // Member 1, on the core member 0 published, is the later one: it moves to a
            // core nobody waited on, says so at once, and has a core of its own.
            assert!(!groups[1].leave_a_shared_core());
            let moved_to = groups[0].bell(1).cpu.load(Ordering::Relaxed) - 1;
            assert_ne!(moved_to, here);
            // Within MOVE_EVERY it does not move again.
            publish(0, current());
            assert!(
                groups[1].leave_a_shared_core(),
                "moved again within MOVE_EVERY"
            );
            assert_eq!(allowed_cores(), allowed);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_segment_that_is_not_the_announced_one_is_refused() {
        let seg = create_segment(&std::env::temp_dir(), "unit", 2, 4096, PAGE).unwrap();
        let err = map_segment(
            seg.path(),
            seg.nonce() ^ 2,
            &[0, 1],
            1,
            4096,
            PAGE,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(err.contains("not the segment"), "{err}");
        let err = map_segment(
            seg.path(),
            seg.nonce(),
            &[0, 1, 2],
            1,
            4096,
            PAGE,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(err.contains("expected"), "{err}");
        // Arenas of another size than announced: refused too.
        let err = map_segment(
            seg.path(),
            seg.nonce(),
            &[0, 1],
            1,
            4096,
            2 * PAGE,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(err.contains("expected"), "{err}");
        let path = seg.path().to_path_buf();
        drop(seg);
        assert!(!path.exists(), "the creator removes the file");
    }
}
