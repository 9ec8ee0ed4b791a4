//! A blocking allreduce of one cached tensor, run as its own settled cycle on the
//! caller's thread without the inbox, the result slot or the cycle's tables.
//!
//! When every rank shares this host's segment and this rank is idle, a blocking
//! allreduce of a tensor negotiated before is, in the steady state, one settled cycle
//! ([`CycleThread::settled`]): one post, one fold. The general path builds around that
//! the machinery any cycle may need (an inbox entry, a result slot, the pending table,
//! a request, the cycle's items), about twenty allocations and a dozen table lookups,
//! which made a 2-rank 4 KiB call twice as slow as Open MPI's. Here the caller posts
//! the same bytes the general path would post, folds the same way, and changes the
//! cache and rank 0's coordinator as that cycle would.
//!
//! This module must never post or decide anything the general path would not: every
//! case that needs more (a timeline, knob changes, self-tuning, a tensor not cached with
//! exactly this request, a job not in one segment) is declined before anything is
//! posted, and a post the other ranks do not match (they sent other tensors) turns the
//! tensor into an ordinary pending entry, negotiated with rank 0 in the same cycle.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Runtime;
use super::completion::Completion;
use super::coordinator::{self, BitRun, OpKind, Ready, Request, TensorRequest};
use super::cycle::{CycleThread, Engine, Events, Work};
use super::handle::Handle;
use super::negotiate::{push_run, settled_post};
use super::shared::Entry;
use crate::algorithms::{SLICE_BYTES, Schedule, allreduce_tensors};
use crate::error::Result;
use crate::tensor::{ReduceOp, Tensor};

/// What became of a blocking allreduce offered to the quick path.
pub(super) enum Quick {
    /// It ran: the result.
    Done(Tensor),
    /// Nothing was posted: the caller takes the general path.
    Declined(Tensor),
    /// It was posted but went to rank 0 (other ranks sent other tensors), or the cycle
    /// failed: the tensor is pending like any other; its slot says when it is done.
    Pending(Arc<Completion>),
}

impl Runtime {
    /// Runs `name`'s blocking allreduce as its own settled cycle when it can; otherwise
    /// hands the tensor back untouched ([`Quick::Declined`]).
    pub(super) fn quick_allreduce(&self, name: &str, tensor: Tensor, op: ReduceOp) -> Quick {
        let Some(engine) = self.engine.0.upgrade() else {
            return Quick::Declined(tensor);
        };
        let Ok(mut e) = engine.try_lock() else {
            return Quick::Declined(tensor);
        };
        if e.outcome.is_some() || !e.cycle.pending.is_empty() || !self.idle_inbox(name) {
            return Quick::Declined(tensor);
        }
        let quick = e.quick_step(name, tensor, op);
        Engine::release_to_background(e);
        quick
    }

    /// Whether nothing waits in the inbox (a cycle would take it along) and `name` is
    /// not in flight (the general path reports that).
    fn idle_inbox(&self, name: &str) -> bool {
        let empty = self.shared.inbox.lock().is_ok_and(|inbox| {
            inbox.entries.is_empty()
                && inbox.knobs.is_empty()
                && !inbox.shutdown
                && inbox.join.is_none()
                && inbox.closed.is_none()
                && !inbox.ended
        });
        empty
            && self
                .shared
                .in_flight
                .lock()
                .is_ok_and(|in_flight| !in_flight.contains(name))
    }

    /// The caller's handle on a tensor the quick path left pending.
    fn quick_handle(&self, name: &str, done: Arc<Completion>) -> Handle {
        Handle {
            name: name.to_string(),
            rank: self.shared.rank,
            done,
            engine: self.engine.clone(),
        }
    }

    /// Allreduce and wait: the quick path when it applies, else the general one.
    pub(super) fn allreduce_blocking(
        &self,
        name: &str,
        tensor: Tensor,
        op: ReduceOp,
    ) -> Result<Tensor> {
        match self.quick_allreduce(name, tensor, op) {
            Quick::Done(tensor) => Ok(tensor),
            Quick::Pending(done) => self.quick_handle(name, done).wait(),
            Quick::Declined(tensor) => self
                .enqueue(name, OpKind::Allreduce(op), tensor, true)?
                .wait(),
        }
    }
}

impl Engine {
    /// [`Engine::step`] for the quick path, on the caller's thread.
    fn quick_step(&mut self, name: &str, tensor: Tensor, op: ReduceOp) -> Quick {
        let start = Instant::now();
        let interrupted = self
            .cycle
            .shared
            .interrupted
            .lock()
            .map_or(true, |r| r.is_some());
        if interrupted {
            return Quick::Declined(tensor);
        }
        let (quick, result) = self.cycle.quick_cycle(name, tensor, op, start);
        if let Quick::Declined(_) = quick {
            return quick;
        }
        self.cycle
            .shared
            .caller_cycles
            .fetch_add(1, Ordering::Relaxed);
        self.stepped(start, true, result);
        quick
    }
}

impl CycleThread {
    /// One cycle that allreduces `name` alone, begun at `start`, and how it ended (as
    /// [`CycleThread::cycle`]'s result; unused when declined).
    fn quick_cycle(
        &mut self,
        name: &str,
        mut tensor: Tensor,
        op: ReduceOp,
        start: Instant,
    ) -> (Quick, Result<bool>) {
        let Some(bit) = self.quick_bit(name, &tensor, op, start) else {
            return (Quick::Declined(tensor), Ok(false));
        };
        let Some(cycle) = self.next_cycle else {
            return (Quick::Declined(tensor), Ok(false));
        };
        let mut post = std::mem::take(&mut self.post);
        settled_post(&mut post, cycle);
        push_run(&mut post, BitRun(bit, 1));
        // As the general path: the bytes go with the post when there is room.
        let early = (crate::shm::EARLY_TRAILER_BYTES + post.len() <= crate::shm::MAX_POST_BYTES)
            .then(|| tensor.as_bytes());
        let same = self.transport.same_posts(&self.all_ranks, &post, early);
        self.post = post;
        match same {
            // Not one segment after all: nothing was posted.
            None => {
                self.settle = false;
                (Quick::Declined(tensor), Ok(false))
            }
            Some(Ok(true)) => match self.quick_settled(name, &mut tensor, op, cycle, start) {
                Ok(()) => (Quick::Done(tensor), Ok(false)),
                Err(e) => (self.pend(name, tensor, op), Err(e)),
            },
            Some(Ok(false)) => {
                // Other ranks sent something else: rank 0 decides this cycle, with this
                // tensor named by its bit as the general path would have sent it.
                let quick = self.pend(name, tensor, op);
                let request = Request {
                    tensors: vec![Ready::Cached(BitRun(bit, 1))],
                    knobs: Vec::new(),
                    shutdown: false,
                    join: false,
                };
                let mut events = Events {
                    enabled: false,
                    rank: self.rank,
                    list: Vec::new(),
                };
                let result = self
                    .negotiated(request, Vec::new(), None)
                    .and_then(|response| self.run_response(response, &mut events, start));
                (quick, result)
            }
            Some(Err(e)) => (self.pend(name, tensor, op), Err(e)),
        }
    }

    /// The cache bit of `name` when the quick path applies to it now: every rank in this
    /// host's segment, no timeline, no knob change waiting, no self-tuning on this rank,
    /// rank 0's coordinator settled, the flat schedule, and `name` cached with exactly
    /// this allreduce's request.
    fn quick_bit(
        &mut self,
        name: &str,
        tensor: &Tensor,
        op: ReduceOp,
        start: Instant,
    ) -> Option<u32> {
        let timeline = self.timeline.is_some()
            || self.server.as_ref().is_some_and(|s| s.wants_timeline())
            || self
                .feeder
                .as_mut()
                .is_some_and(|f| f.wants_timeline(start));
        let usable = self.settle
            && !timeline
            && self.autotune.is_none()
            && !self.knobs.hierarchical_allreduce
            && self.server.as_ref().is_none_or(|s| !s.has_knob_requests())
            && self
                .coordinator
                .as_ref()
                .is_none_or(coordinator::Coordinator::is_settled);
        if !usable {
            return None;
        }
        let (bit, cached) = self.cache.table().bit(name)?;
        (cached.kind == OpKind::Allreduce(op)
            && !cached.device
            && cached.dtype == tensor.dtype()
            && cached.shape == tensor.shape())
        .then_some(bit)
    }

    /// The settled cycle `cycle` of `name` alone, every rank having posted it: the
    /// cache and rank 0's coordinator change as [`CycleThread::settled`] changes them,
    /// and the fold is the one [`CycleThread::execute`] runs for that item.
    fn quick_settled(
        &mut self,
        name: &str,
        tensor: &mut Tensor,
        op: ReduceOp,
        cycle: u64,
        start: Instant,
    ) -> Result<()> {
        let index = self.coordinator.as_mut().map(|c| c.settled_step_of(name));
        self.check_settled(cycle, index)?;
        self.cache.touch(name);
        self.shared.settled_cycles.fetch_add(1, Ordering::Relaxed);
        self.shared.quick_cycles.fetch_add(1, Ordering::Relaxed);
        self.begin_response(cycle, self.knobs);
        let dtype = tensor.dtype();
        let bytes = tensor.byte_len() as u64;
        allreduce_tensors(
            &*self.transport,
            &mut [tensor.as_bytes_mut()],
            dtype,
            op,
            Schedule::Ring,
            SLICE_BYTES,
            &mut self.fusion,
            &mut |_, _| {},
        )?;
        let work = Work {
            bytes_reduced: bytes,
            bytes_total: bytes,
            tensors: 1,
            buffers: 1,
        };
        self.account(&work, cycle, start);
        Ok(())
    }

    /// `tensor` as an ordinary pending entry, for a cycle that left the quick path
    /// after its post: rank 0 schedules it, or the job's failure fails it with the
    /// error every rank agrees on.
    fn pend(&mut self, name: &str, tensor: Tensor, op: ReduceOp) -> Quick {
        if let Ok(mut in_flight) = self.shared.in_flight.lock() {
            in_flight.insert(name.to_string());
        }
        let (done, completion) = Completion::new(true);
        let entry = Entry {
            request: TensorRequest {
                name: name.to_string(),
                kind: OpKind::Allreduce(op),
                dtype: tensor.dtype(),
                shape: tensor.shape().to_vec(),
                device: false,
            },
            tensor,
            #[cfg(feature = "cuda")]
            device: None,
            done,
        };
        self.pending.insert(name.to_string(), entry);
        Quick::Pending(completion)
    }
}
