//! The shared-memory allreduce: every member's inputs in its slot (or its shared tensor
//! in its arena), each segment folded by one member in the ring's order, the results
//! copied out, chunk by chunk behind three barriers; or, for a small buffer, one barrier
//! and every member folding everything (the one-shot).
//!
//! It must never fold in another order than the ring's: the bits must be the ring's.

use std::sync::atomic::Ordering;

use super::layout::{ALIGN, ARENA_BLOCK, ONE_SHOT_MAX_BYTES};
use super::waiting::{Patience, PeerGone};
use super::{Members, ShmGroup};
use crate::error::Result;

/// A member's shared-allreduce chunks ([`ShmGroup::fold_allreduce`]).
#[derive(Default)]
pub(super) struct Chunks {
    /// The next chunk's number (the same count on every member).
    pub(super) next: u64,
    /// A one-shot chunk whose inputs every member put in its slot before a round of
    /// [`ShmGroup::same_posts_early`] on which they all agreed: (chunk, address and
    /// length of this member's buffer). The next one-shot of that chunk and buffer skips
    /// its copy and its barrier.
    pub(super) early: Option<(u64, usize, usize)>,
}

impl ShmGroup {
    /// The next shared-allreduce chunk's number and slot (of two), once every member
    /// is done with the chunk that used that slot before (two chunks ago).
    pub(super) fn next_chunk(
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
    pub(super) fn written_barrier(
        &self,
        members: &[usize],
        g: u64,
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        self.flags(self.me).written.store(g + 1, Ordering::Release);
        self.notify_all(members);
        self.wait_for_all(members, |f| f.written.load(Ordering::Acquire) > g, patience)
    }
}

impl ShmGroup {
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
    pub(super) fn arena_offset_of(&self, buf: &[u8]) -> Option<usize> {
        let arena = self.base() as usize + self.layout.arena(self.me);
        let at = (buf.as_ptr() as usize).checked_sub(arena)?;
        (!buf.is_empty() && at + buf.len() <= self.layout.arena_bytes).then_some(at)
    }

    /// Where in its arena member `m` offered its buffer of `len` bytes for chunk `g`, if it
    /// did (read after `g`'s `written` barrier, which published it).
    pub(super) fn offered(&self, m: usize, g: u64, len: usize) -> Option<usize> {
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
    pub(super) fn arena_fold(
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
}

impl ShmGroup {
    /// [`Self::fold_allreduce`] for a buffer that fits in one slot, with one barrier
    /// instead of three: every member puts its whole buffer in its slot and then folds
    /// *every* segment itself, each in exactly the order the fold uses (segment `j` starts
    /// from the bytes of the member at position `j`, then `j+1`, `j+2`, …), so the bits
    /// are the fold's and the ring's. It reduces `n` times as much as the fold, which for
    /// small buffers costs less than the two barriers it saves.
    pub(super) fn one_shot_allreduce(
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
}
