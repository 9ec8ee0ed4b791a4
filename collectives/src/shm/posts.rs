//! Posts: small messages every member of a host writes to the segment so that they agree,
//! with one barrier and no round trip, on whether they all posted the same bytes (a
//! settled cycle), and may put an early allreduce's inputs in place meanwhile.
//!
//! An *early* allreduce is the one-shot a member expects to run right after the round:
//! its inputs ride in the round, so that if every post agrees the one-shot finds them in
//! place and skips its own copy and barrier (see "Post" and "One-shot" in
//! docs/glossary.md).
//!
//! It must never decide for one member alone: every member takes part in every round and
//! gets the same answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::ShmGroup;
use super::layout::{
    EARLY_TRAILER_BYTES, MAX_POST_BYTES, ONE_SHOT_MAX_BYTES, POST_HEADER, WAIT_SLICE,
};
use super::waiting::{PeerGone, futex_wait};
use crate::error::Result;

impl ShmGroup {
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
    pub(super) fn put_early(&self, members: &[usize], data: &[u8], g: u64) -> Result<Option<u64>> {
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
    pub(super) fn exchange_posts(
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
}
