//! The one-shot slot between a collective's inbox entry and its [`super::Handle`]: the
//! result goes in once, the handle takes it once. One allocation per collective (a
//! channel and a shared flag were three), and a waiting caller that runs its own cycle
//! finds its result with one uncontended lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::tensor::Tensor;

enum Slot {
    /// Not done yet.
    Empty,
    Full(Result<Tensor>),
    /// Nothing (more) will come: the handle took the result, or the entry went away
    /// without one (the runtime is gone).
    Closed,
}

/// What a handle finds in its slot.
pub(super) enum Taken {
    Result(Result<Tensor>),
    /// Nothing yet.
    Pending,
    /// Nothing will come: the result was taken already, or the runtime is gone.
    Closed,
}

pub(super) struct Completion {
    /// A caller waits for this tensor and runs its cycle itself (see `Handle::drive`):
    /// the background thread leaves it in the inbox until its timer.
    pub(super) waited: AtomicBool,
    slot: Mutex<Guarded>,
    filled: Condvar,
}

struct Guarded {
    slot: Slot,
    /// Threads asleep on `filled`: a send with nobody asleep skips the futex wake-up
    /// (std's condvar makes that system call whether anyone waits or not).
    sleepers: u32,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Completion")
    }
}

/// The entry's side: fills the slot once; dropped unfilled, it closes it.
pub(super) struct Done(Arc<Completion>);

impl Completion {
    /// A new slot, its two sides: the entry's and the handle's.
    pub(super) fn new(waited: bool) -> (Done, Arc<Completion>) {
        let c = Arc::new(Completion {
            waited: AtomicBool::new(waited),
            slot: Mutex::new(Guarded {
                slot: Slot::Empty,
                sleepers: 0,
            }),
            filled: Condvar::new(),
        });
        (Done(c.clone()), c)
    }

    pub(super) fn waited(&self) -> bool {
        self.waited.load(Ordering::Relaxed)
    }

    fn slot(&self) -> MutexGuard<'_, Guarded> {
        // The slot is only ever replaced whole: a panic elsewhere leaves it consistent.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_from(slot: &mut Slot) -> Taken {
        match std::mem::replace(slot, Slot::Closed) {
            Slot::Full(r) => Taken::Result(r),
            Slot::Empty => {
                *slot = Slot::Empty;
                Taken::Pending
            }
            Slot::Closed => Taken::Closed,
        }
    }

    /// The result if it is there, without waiting.
    pub(super) fn try_take(&self) -> Taken {
        Self::take_from(&mut self.slot().slot)
    }

    /// Waits for the result, at most `timeout` (`None`: as long as it takes).
    pub(super) fn take_within(&self, timeout: Option<Duration>) -> Taken {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut g = self.slot();
        loop {
            if !matches!(g.slot, Slot::Empty) {
                return Self::take_from(&mut g.slot);
            }
            g.sleepers += 1;
            g = match deadline {
                None => self.filled.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        g.sleepers -= 1;
                        return Taken::Pending;
                    };
                    self.filled
                        .wait_timeout(g, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
            g.sleepers -= 1;
        }
    }
}

impl Done {
    pub(super) fn completion(&self) -> &Completion {
        &self.0
    }

    /// Puts the result in the slot and wakes its handle.
    pub(super) fn send(self, result: Result<Tensor>) {
        let mut g = self.0.slot();
        if matches!(g.slot, Slot::Empty) {
            g.slot = Slot::Full(result);
        }
        let wake = g.sleepers > 0;
        drop(g);
        if wake {
            self.0.filled.notify_all();
        }
        // Dropping `self` now finds the slot filled and leaves it alone.
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        let mut g = self.0.slot();
        if matches!(g.slot, Slot::Empty) {
            g.slot = Slot::Closed;
            let wake = g.sleepers > 0;
            drop(g);
            if wake {
                self.0.filled.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CollectiveError;

    fn tensor() -> Tensor {
        Tensor::from_slice(&[1.0f32, 2.0])
    }

    #[test]
    fn a_result_is_taken_once_and_then_the_slot_is_closed() {
        let (done, c) = Completion::new(true);
        assert!(c.waited());
        assert!(matches!(c.try_take(), Taken::Pending));
        done.send(Ok(tensor()));
        match c.try_take() {
            Taken::Result(Ok(t)) => assert_eq!(t.to_vec::<f32>(), Some(vec![1.0, 2.0])),
            _ => panic!("the result should be there"),
        }
        assert!(matches!(c.try_take(), Taken::Closed));
    }

    #[test]
    fn an_entry_dropped_without_a_result_closes_the_slot_and_wakes_the_waiter() {
        let (done, c) = Completion::new(false);
        let waiter = std::thread::spawn(move || matches!(c.take_within(None), Taken::Closed));
        std::thread::sleep(Duration::from_millis(20));
        drop(done);
        assert!(waiter.join().expect("waiter thread"));
    }

    #[test]
    fn a_wait_with_a_timeout_comes_back_empty_and_a_later_result_still_arrives() {
        let (done, c) = Completion::new(false);
        let start = Instant::now();
        assert!(matches!(
            c.take_within(Some(Duration::from_millis(30))),
            Taken::Pending
        ));
        assert!(start.elapsed() >= Duration::from_millis(30));
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            done.send(Err(CollectiveError::ShutDown { rank: 3 }));
        });
        match c.take_within(Some(Duration::from_secs(10))) {
            Taken::Result(Err(CollectiveError::ShutDown { rank: 3 })) => {}
            _ => panic!("the error sent should arrive"),
        }
        sender.join().expect("sender thread");
    }
}
