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

//!
//! The module map: `layout` (sizes and offsets), `segment` (creating and mapping the
//! file), `rings` (pairwise byte rings), `fold` (the shared-memory allreduce),
//! `posts` (agreeing through the segment), `arena` (shared tensors), `waiting`
//! (doorbells, patience, timeouts). This file holds the group and its accessors.
//! The words (post, one-shot, fold, early one-shot) are defined in docs/glossary.md.

mod arena;
mod fold;
mod layout;
mod posts;
mod rings;
mod segment;
#[cfg(test)]
mod tests;
mod waiting;

pub use arena::SharedLease;
pub use layout::{
    ALIGN, ARENA_BYTES, EARLY_TRAILER_BYTES, MAX_POST_BYTES, MAX_RING_BYTES, MIN_RING_BYTES,
    SEGMENT_BUDGET_BYTES, arena_bytes_for, free_bytes, ring_bytes_for, staging_bytes,
    valid_ring_bytes,
};
pub(crate) use rings::{Incoming, Outgoing};
pub use segment::{SHM_DIR, SegmentFile, create_segment, host_key, map_segment};

use std::fs::File;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arena::ArenaFree;
use fold::Chunks;
use layout::{Bell, Flags, LINE, Layout, SegmentHeader};
use memmap2::MmapRaw;
use rings::{Ring, RxState, TxState};
use waiting::futex_wake;

use crate::error::{CollectiveError, Result};

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
    /// How often a thread may move to another core: [`waiting::MOVE_EVERY`] (tests set
    /// another).
    move_every: Duration,
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

/// Member indices of a collective, on the stack for a host's usual rank counts: every
/// small call names them.
pub(crate) type Members = smallvec::SmallVec<[usize; 16]>;

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
}

impl ShmGroup {
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
}

impl ShmGroup {
    fn lock<'s, T>(&self, m: &'s Mutex<T>, peer: usize) -> Result<std::sync::MutexGuard<'s, T>> {
        m.lock()
            .map_err(|_| self.link_error(self.ranks[peer], "shared-memory ring lock poisoned"))
    }
}
