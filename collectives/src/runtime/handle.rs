//! A pending collective's [`Handle`]: waiting for its result, or running the rank's
//! cycle on the caller's thread when nothing else would run it soon ([`Handle::drive`]).
//!
//! It must never decide a cycle's contents: it only runs the engine's next cycle.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::completion::{Completion, Taken};
use super::cycle::Engine;
use super::shared::Shared;
use crate::error::{CollectiveError, Result};
use crate::tensor::Tensor;

/// A pending collective; [`Handle::wait`] returns its result.
#[derive(Debug)]
pub struct Handle {
    pub(super) name: String,
    pub(super) rank: usize,
    /// Shared with the tensor's inbox entry ([`Entry::done`]).
    pub(super) done: Arc<Completion>,
    pub(super) engine: EngineRef,
}

/// The rank's [`Engine`], for a waiting caller to run a cycle itself; gone once the
/// background thread has ended.
#[derive(Clone)]
pub(super) struct EngineRef(
    pub(super) std::sync::Weak<Mutex<Engine>>,
    pub(super) std::sync::Weak<Shared>,
);

impl std::fmt::Debug for EngineRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineRef")
    }
}

impl Handle {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for the result. Never waits forever: the runtime completes or fails every
    /// handle within its peer timeout.
    pub fn wait(mut self) -> Result<Tensor> {
        if let Some(result) = self.drive() {
            return result;
        }
        if let Some(result) = self.poll(crate::poll::YIELD_BUDGET) {
            return result;
        }
        self.outcome(self.done.take_within(None))
            .unwrap_or(Err(CollectiveError::ShutDown { rank: self.rank }))
    }

    /// Waits at most `timeout` for the result, keeping the handle when it is not there yet
    /// (`None`), so that a caller can wake up in between (a Python front end checks for
    /// Ctrl-C). After a `Some`, the handle is spent: a further call reports a shut-down.
    pub fn wait_for(&mut self, timeout: Duration) -> Option<Result<Tensor>> {
        if let Some(result) = self.drive() {
            return Some(result);
        }
        if let Some(result) = self.poll(timeout.min(crate::poll::YIELD_BUDGET)) {
            return Some(result);
        }
        self.outcome(self.done.take_within(Some(timeout)))
    }

    /// What the slot held, as a result: `None` while it is still running; a slot that
    /// will never be filled (taken already, or the runtime is gone) is a shut-down.
    pub(super) fn outcome(&self, taken: Taken) -> Option<Result<Tensor>> {
        match taken {
            Taken::Result(r) => Some(r),
            Taken::Pending => None,
            Taken::Closed => Some(Err(CollectiveError::ShutDown { rank: self.rank })),
        }
    }

    /// The result if it is there, or comes from a cycle this thread runs itself: when
    /// nothing is in flight on this rank (so the background thread would start a cycle
    /// for this tensor at once too) and no other thread runs one, the waiting caller
    /// runs it, and the tensor does not cross to the background thread and back.
    /// Cycles stay one at a time and matched across ranks, whoever runs them.
    pub(super) fn drive(&mut self) -> Option<Result<Tensor>> {
        if let Some(result) = self.try_wait() {
            return Some(result);
        }
        let engine = self.engine.0.upgrade()?;
        // A blocking call's tensor (`waited` from the start) is left to its caller by the
        // background thread, which must take it back if the caller cannot run it. An
        // async one's is the background thread's to start (a framework enqueues a step's
        // gradients, then waits for each): its caller runs a cycle only when nothing
        // else does.
        let Ok(mut e) = engine.try_lock() else {
            self.hand_back();
            return None;
        };
        if e.outcome.is_some() || !e.cycle.pending.is_empty() {
            drop(e);
            self.hand_back();
            return None;
        }
        e.step(true);
        Engine::release_to_background(e);
        self.try_wait()
    }

    /// This caller will not run its tensor's cycle after all (another thread runs one, or
    /// tensors are in flight): the background thread starts it, now.
    pub(super) fn hand_back(&self) {
        if !self.done.waited() {
            return;
        }
        let Some(shared) = self.engine.1.upgrade() else {
            return;
        };
        // Under the inbox's lock, so that a background thread about to sleep sees it.
        if let Ok(_inbox) = shared.inbox.lock() {
            self.done.waited.store(false, Ordering::Relaxed);
        }
        shared.work.notify_one();
    }

    /// The result if it comes while this thread yields the core for a moment (the
    /// cycle thread finishing a small collective), without a futex sleep and wake-up.
    pub(super) fn poll(&mut self, budget: Duration) -> Option<Result<Tensor>> {
        let mut got = None;
        crate::poll::yield_until(budget, || {
            got = self.try_wait();
            got.is_some()
        });
        got
    }

    /// The result if it is there, without waiting (`None`: still running).
    pub fn try_wait(&mut self) -> Option<Result<Tensor>> {
        self.outcome(self.done.try_take())
    }

    /// Waits at most `timeout` for the result.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Tensor> {
        let taken = self.done.take_within(Some(timeout));
        self.outcome(taken)
            .unwrap_or(Err(CollectiveError::WaitTimeout {
                rank: self.rank,
                name: self.name,
                timeout,
            }))
    }
}
