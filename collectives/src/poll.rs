//! Waiting for a peer without losing the core to the wrong process.
//!
//! A rank that waits on another rank of its host (a doorbell in the segment, the
//! cycle thread waiting for the caller's next tensor, the caller waiting for its
//! result) can sleep at once (a futex; the waker pays a system call and the sleeper a
//! wake-up through the scheduler), spin (burns the core the peer may need: 4 ranks on
//! 2 cores), or yield: `sched_yield` hands the core to another runnable task and
//! comes back when that one blocks, which on an oversubscribed host is exactly the
//! peer it waits for. Measured on the 2-core test VM, 4 ranks, blocking allreduce:
//! 4 KiB 170 → 70 µs, 64 KiB 240 → 80 µs with a short yielding phase before the
//! futex (docs/BENCHMARKS.md).
//!
//! Yielding is the wrong thing when the other runnable tasks are not ours: a
//! framework's compute threads or any busy process. A yield then gives away a whole
//! scheduler slice (2–4 ms measured beside niced busy loops, against < 0.3 ms for
//! 99.99% of yields between ranks), and yields made the contended 4 KiB allreduce
//! 4.5× slower. So a yield that takes longer than [`SLOW_YIELD`] ends the yielding
//! phase at once, and two such within [`SLOW_YIELD_WINDOW`] turn yielding off for
//! the whole process for [`BACK_OFF`]: the rank then sleeps on the futex as before,
//! and pays at most one slice per second to find out whether the contention is over.
//!
//! Sleeping or yielding beside such work costs a slice as well: the rank gets its
//! core back only when the busy task's protected slice runs out. Open MPI never
//! sleeps; beside one niced busy loop per rank its 2-rank 4 KiB allreduce took 15 µs
//! by median and ours, which slept after 5 µs of spins, 6 to 20 (up to 80). So a
//! rank whose peers run on cores of their own first spins for up to [`SPIN_BUDGET`]
//! ([`spin_until`]) and yields or sleeps only after that: the same call took 1.2 µs
//! (docs/BENCHMARKS.md, "Under contention"). Where ranks outnumber cores the peer
//! needs this core, and nothing spins that long.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a rank yields before it sleeps: about ten hand-offs between ranks.
pub(crate) const YIELD_BUDGET: Duration = Duration::from_micros(250);

/// A yield shorter than this found nothing else to run on this core.
pub(crate) const EMPTY_YIELD: Duration = Duration::from_micros(3);

/// How long a rank keeps yielding to nobody (spinning, in effect) before it sleeps.
pub(crate) const EMPTY_BUDGET: Duration = Duration::from_micros(20);

/// A yield longer than this handed the core to something that ran a full slice.
pub(crate) const SLOW_YIELD: Duration = Duration::from_millis(1);

/// Two slow yields this close together mean contention, not a peer's long step.
pub(crate) const SLOW_YIELD_WINDOW: Duration = Duration::from_millis(100);

/// How long yielding stays off after contention is seen.
pub(crate) const BACK_OFF: Duration = Duration::from_secs(1);

/// How long a rank whose peers run on other cores spins before it yields or sleeps:
/// longer than the hand-offs between ranks within one call, short beside a
/// scheduler slice (2 ranks beside niced busy loops: 50 µs left 4 KiB–1 MiB calls
/// 1.2–2.6× slower than 200 µs).
pub(crate) const SPIN_BUDGET: Duration = Duration::from_micros(200);

/// Microseconds since the first call (0 is "never").
fn now_us() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64 + 1
}

/// When the last slow yield ended, and until when yielding is off (µs, [`now_us`]).
static LAST_SLOW_US: AtomicU64 = AtomicU64::new(0);
static OFF_UNTIL_US: AtomicU64 = AtomicU64::new(0);

/// Yields the core until `done()` holds, for at most `budget` (at most
/// [`YIELD_BUDGET`] is meant); returns `done()`'s last answer. The caller sleeps
/// properly (futex, condvar) when this returns `false`. Does not yield at all while
/// contention keeps yielding off.
pub(crate) fn yield_until(budget: Duration, mut done: impl FnMut() -> bool) -> bool {
    if done() {
        return true;
    }
    if now_us() < OFF_UNTIL_US.load(Ordering::Relaxed) {
        return false;
    }
    let start = Instant::now();
    let mut empty = Duration::ZERO;
    while start.elapsed() < budget {
        let before = Instant::now();
        // SAFETY: no arguments and no memory effects; it cannot fail on Linux.
        unsafe { libc::sched_yield() };
        let took = before.elapsed();
        if done() {
            return true;
        }
        if took > SLOW_YIELD {
            note_slow_yield();
            return false;
        }
        if took < EMPTY_YIELD {
            // Nothing else wanted this core: the rank we wait for runs (or waits)
            // elsewhere. Sleeping lets this core go idle and pull it over.
            empty += took;
            if empty > EMPTY_BUDGET {
                return false;
            }
        }
    }
    false
}

/// Spins until `done()` holds, for at most `budget`, without giving the core away;
/// returns `done()`'s last answer. The clock is read once per 64 looks.
pub(crate) fn spin_until(budget: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + budget;
    loop {
        for _ in 0..64 {
            if done() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= until {
            return done();
        }
    }
}

fn note_slow_yield() {
    let now = now_us();
    let previous = LAST_SLOW_US.swap(now, Ordering::Relaxed);
    if let Some(until) = back_off_until(previous, now)
        && OFF_UNTIL_US.swap(until, Ordering::Relaxed) < now
    {
        tracing::debug!(
            back_off_ms = BACK_OFF.as_millis() as u64,
            "other work holds the cores (yields took a full slice): waits sleep \
             instead of yielding"
        );
    }
}

/// After a slow yield at `now` (µs) with the one before at `previous` (0: none): until
/// when yielding is off, if it is.
fn back_off_until(previous: u64, now: u64) -> Option<u64> {
    (previous != 0 && now.saturating_sub(previous) <= SLOW_YIELD_WINDOW.as_micros() as u64)
        .then(|| now + BACK_OFF.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn returns_at_once_when_already_done_and_gives_up_after_its_budget() {
        let mut calls = 0;
        assert!(yield_until(YIELD_BUDGET, || {
            calls += 1;
            true
        }));
        assert_eq!(calls, 1);
        let start = Instant::now();
        assert!(!yield_until(YIELD_BUDGET, || false));
        // A zero budget looks once and never yields.
        let mut calls = 0;
        assert!(!yield_until(Duration::ZERO, || {
            calls += 1;
            false
        }));
        assert_eq!(calls, 1);
        // It stops: never much past its budget unless a yield itself was slow.
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn sees_a_flag_set_by_another_thread() {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = {
            let flag = flag.clone();
            std::thread::spawn(move || flag.store(true, Ordering::SeqCst))
        };
        setter.join().unwrap();
        assert!(yield_until(YIELD_BUDGET, || flag.load(Ordering::SeqCst)));
    }

    #[test]
    fn spinning_sees_a_flag_set_elsewhere_and_stops_after_its_budget() {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(1));
                flag.store(true, Ordering::SeqCst);
            })
        };
        assert!(spin_until(Duration::from_secs(60), || flag.load(Ordering::SeqCst)));
        setter.join().unwrap();
        let start = Instant::now();
        let mut looks = 0u64;
        assert!(!spin_until(SPIN_BUDGET, || {
            looks += 1;
            false
        }));
        assert!(start.elapsed() >= SPIN_BUDGET);
        // It looked many times, not once per budget.
        assert!(looks >= 64, "{looks}");
    }

    #[test]
    fn only_two_slow_yields_close_together_turn_yielding_off() {
        let window = SLOW_YIELD_WINDOW.as_micros() as u64;
        let off = BACK_OFF.as_micros() as u64;
        // The first slow yield is a peer's long step: yielding stays on.
        assert_eq!(back_off_until(0, 5_000_000), None);
        // One long after the last is another such step.
        assert_eq!(back_off_until(1_000_000, 1_000_001 + window), None);
        // A second within the window is contention: off for BACK_OFF.
        assert_eq!(
            back_off_until(1_000_000, 1_000_000 + window),
            Some(1_000_000 + window + off)
        );
        assert_eq!(back_off_until(1_000_000, 1_000_010), Some(1_000_010 + off));
    }
}
