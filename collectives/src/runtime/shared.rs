//! What the callers' threads and the cycle's thread share: the inbox of enqueued tensors
//! ([`Entry`], [`Inbox`]), the knobs in force, the counters behind [`super::Totals`].
//!
//! It must never run a cycle or wait on the network: it only holds state behind locks
//! and atomics.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};

use super::SelfTuneOutcome;
use super::claim::TuningClaims;
use super::completion::Done;
use super::coordinator::TensorRequest;
use crate::control::{KnobUpdate, Knobs, StepMarks};
use crate::error::{CollectiveError, Result};
use crate::tensor::Tensor;

pub(super) struct Entry {
    pub(super) request: TensorRequest,
    /// The tensor; for a GPU tensor, an empty stand-in (its memory is `device`).
    pub(super) tensor: Tensor,
    #[cfg(feature = "cuda")]
    pub(super) device: Option<crate::gpu::DeviceTensor>,
    /// Its handle's slot; also says whether a caller waits for this tensor and runs
    /// its cycle itself ([`Handle::drive`]): the background thread leaves such a tensor
    /// in the inbox until its timer.
    pub(super) done: Done,
}

impl Entry {
    pub(super) fn finish(self, result: Result<Tensor>) {
        self.done.send(result);
    }

    pub(super) fn succeed(self) {
        let Entry { tensor, done, .. } = self;
        done.send(Ok(tensor));
    }
}

#[derive(Default)]
pub(super) struct Inbox {
    pub(super) entries: Vec<Entry>,
    pub(super) knobs: Vec<KnobUpdate>,
    pub(super) shutdown: bool,
    /// This rank has joined ([`super::Runtime::join_async`]): the join's result slot,
    /// filled with the last rank to join when every rank has.
    pub(super) join: Option<Done>,
    pub(super) closed: Option<CollectiveError>,
    /// A caller's cycle ended the job: the background thread must tear it down now.
    pub(super) ended: bool,
    /// A caller ran a cycle and left work for the background thread, which found the
    /// engine busy and waits for this ([`wait_while_callers_drive`]).
    pub(super) engine_free: bool,
}

impl Inbox {
    /// Something for the background thread to start a cycle for now: tensors no caller
    /// is about to run itself, knob changes or the shutdown.
    pub(super) fn has_work(&self) -> bool {
        self.entries.iter().any(|e| !e.done.completion().waited())
            || !self.knobs.is_empty()
            || self.shutdown
    }
}

pub(super) struct Shared {
    pub(super) rank: usize,
    pub(super) inbox: Mutex<Inbox>,
    /// Signalled when work (or a knob change, or shutdown) lands in the
    /// inbox: an idle cycle thread starts its next cycle at once.
    pub(super) work: Condvar,
    pub(super) in_flight: Mutex<HashSet<String, foldhash::fast::RandomState>>,
    pub(super) knobs: Arc<Mutex<(Knobs, u64)>>,
    pub(super) cycles: AtomicU64,
    pub(super) bytes_reduced: AtomicU64,
    pub(super) negotiation_bytes: AtomicU64,
    pub(super) settled_cycles: AtomicU64,
    pub(super) caller_cycles: AtomicU64,
    pub(super) quick_cycles: AtomicU64,
    /// [`Totals::handoffs`].
    pub(super) handoffs: AtomicU64,
    /// [`Totals::nccl_allreduces`] and [`Totals::staged_allreduces`].
    pub(super) nccl_allreduces: AtomicU64,
    pub(super) staged_allreduces: AtomicU64,
    pub(super) claims: Arc<TuningClaims>,
    pub(super) self_tune: Arc<Mutex<Option<SelfTuneOutcome>>>,
    /// [`super::Runtime::self_tune_watch`], kept by the cycle thread.
    pub(super) watch: Mutex<Option<super::WatchStatus>>,
    /// Set by an [`Interrupter`]: why this rank leaves.
    pub(super) interrupted: Mutex<Option<String>>,
    /// The last cycle was run by a waiting caller ([`Handle::drive`]).
    pub(super) callers_drive: AtomicBool,
    /// Step boundaries marked ([`super::Runtime::mark_step`]) and not yet reported.
    pub(super) steps: Mutex<StepMarks>,
    /// [`Totals::steps_marked`](super::Totals::steps_marked).
    pub(super) steps_marked: AtomicU64,
}

impl Shared {
    pub(super) fn forget(&self, name: &str) {
        if let Ok(mut f) = self.in_flight.lock() {
            f.remove(name);
        }
    }
}

impl Shared {
    /// Whether the inbox holds something for a cycle (work, knobs, shutdown), or a
    /// caller's cycle ended the job.
    pub(super) fn inbox_ready(&self) -> bool {
        self.inbox.lock().map_or(true, |i| i.has_work() || i.ended)
    }
}
