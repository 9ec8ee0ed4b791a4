//! The single-producer single-consumer byte rings between two members: messages written
//! in granules and read straight from the ring or copied out ([`Outgoing`], [`Incoming`]),
//! and the full-duplex exchange of one member with two others.
//!
//! It must never know what the bytes are (tensors, schedules): the algorithms above say.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::ShmGroup;
use super::layout::{ALIGN, HEADER, MESSAGE_MAGIC, WRITE_GRANULE};
use super::waiting::{Patience, PeerGone, Peers};
use crate::error::Result;

/// The writer's position in one outgoing ring (only this rank writes `head`).
#[derive(Default)]
pub(super) struct TxState {
    pub(super) head: u64,
}

/// The reader's position in one incoming ring: `tail`, and what is left of the message
/// being read.
#[derive(Default)]
pub(super) struct RxState {
    pub(super) tail: u64,
    pub(super) message_left: u64,
}

/// A ring as seen from one end.
pub(super) struct Ring {
    pub(super) head: *const AtomicU64,
    pub(super) tail: *const AtomicU64,
    pub(super) data: *mut u8,
    pub(super) capacity: usize,
}

impl Ring {
    pub(super) fn head(&self) -> &AtomicU64 {
        // SAFETY: points into the live mapping at an aligned offset (see `ShmGroup::ring`).
        unsafe { &*self.head }
    }
    pub(super) fn tail(&self) -> &AtomicU64 {
        // SAFETY: as for `head`.
        unsafe { &*self.tail }
    }
}

pub(super) fn pad_to_align(position: u64) -> u64 {
    (ALIGN as u64 - position % ALIGN as u64) % ALIGN as u64
}

/// An outgoing message being written: `data`, of which `sent` bytes are in the ring.
pub(crate) struct Outgoing<'a> {
    pub(super) data: &'a [u8],
    pub(super) sent: usize,
    pub(super) started: bool,
}

impl<'a> Outgoing<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Outgoing {
            data,
            sent: 0,
            started: false,
        }
    }
    pub(super) fn done(&self) -> bool {
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

    pub(super) fn done(&self) -> bool {
        match self {
            Incoming::Copy { buf, filled, .. } => *filled == buf.len(),
            Incoming::Pieces { len, done, .. } => *done == *len,
        }
    }
}

impl ShmGroup {
    /// Writes as much of `out` as fits now, one granule at most. Returns whether it moved.
    pub(super) fn write_step(&self, to: usize, tx: &mut TxState, out: &mut Outgoing<'_>) -> bool {
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
    pub(super) fn readable(
        &self,
        from: usize,
        rx: &mut RxState,
    ) -> Result<Option<(*const u8, usize)>> {
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

    pub(super) fn consume(&self, from: usize, rx: &mut RxState, n: usize) {
        rx.tail += n as u64;
        rx.message_left -= n as u64;
        self.ring(from, self.me)
            .tail()
            .store(rx.tail, Ordering::Release);
        self.notify(from);
    }

    /// Reads what is there now into `incoming`, one chunk or piece at most.
    pub(super) fn read_step(
        &self,
        from: usize,
        rx: &mut RxState,
        incoming: &mut Incoming,
    ) -> Result<bool> {
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
}

impl ShmGroup {
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
}
