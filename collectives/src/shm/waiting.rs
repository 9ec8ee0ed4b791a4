//! How a rank waits on its peers: spin, then sleep on its doorbell (a futex) in slices,
//! watching for a peer's abort or death ([`Patience`]), moving off a core another member
//! shares, and failing with the peer's name once the op timeout passes without progress.
//!
//! It must never wait without a deadline, and never decide what it waits for: the callers
//! (rings, posts, fold) give the condition.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::ShmGroup;
use super::layout::{Flags, OVERSUBSCRIBED_SPINS, SPINS, WAIT_SLICE};
use crate::error::{CollectiveError, Result};

/// What a rank needs from the layer above while it waits: whether a peer's process is gone
/// (its TCP link closed), checked every [`WAIT_SLICE`] without progress.
pub(crate) type PeerGone<'a> = &'a (dyn Fn(usize) -> bool + Sync);

/// Tracks how long an operation has gone without progress and whom it waits on. Its
/// clocks start at the first wait that does not end within the spins: a small
/// collective whose peers are there at once reads no clock and allocates nothing.
pub(super) struct Patience<'a> {
    /// When the current stretch without progress began to cost a wait (`None`: progress
    /// since, or none waited yet).
    pub(super) since: Option<Instant>,
    pub(super) last_health_check: Option<Instant>,
    /// Members whose health is watched (this member is skipped).
    pub(super) peers: Peers<'a>,
    /// The member named if the wait times out: the one not heard from.
    pub(super) waiting_on: usize,
    pub(super) cancel: Option<&'a AtomicBool>,
    pub(super) peer_gone: PeerGone<'a>,
}

/// The members a wait watches: those of a collective, or the one or two of an exchange.
#[derive(Clone, Copy)]
pub(super) enum Peers<'a> {
    Members(&'a [usize]),
    Pair([Option<usize>; 2]),
}

impl Peers<'_> {
    pub(super) fn iter(&self, me: usize) -> impl Iterator<Item = usize> + '_ {
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
    pub(super) fn progressed(&mut self) {
        self.since = None;
    }
}

impl ShmGroup {
    /// Waits until `ready(flags)` holds for every one of `members`.
    pub(super) fn wait_for_all(
        &self,
        members: &[usize],
        ready: impl Fn(&Flags) -> bool,
        patience: &mut Patience<'_>,
    ) -> Result<()> {
        self.wait_for_members(members, |m| ready(self.flags(m)), patience)
    }

    /// Waits until `ready(member)` holds for every one of `members`.
    pub(super) fn wait_for_members(
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
    pub(super) fn patience<'p>(
        &self,
        members: &'p [usize],
        peer_gone: PeerGone<'p>,
    ) -> Patience<'p> {
        Patience {
            since: None,
            last_health_check: None,
            peers: Peers::Members(members),
            waiting_on: self.me,
            cancel: None,
            peer_gone,
        }
    }
}

impl ShmGroup {
    pub(super) fn notify_all(&self, members: &[usize]) {
        for &m in members.iter().filter(|&&m| m != self.me) {
            self.notify(m);
        }
    }
}

impl ShmGroup {
    /// Where every member of the host can have a core of its own, moves this member off a
    /// core that another member last waited on, to an allowed core none did. Yielding
    /// keeps two members on the core where they are: the scheduler moves a task when it
    /// wakes up or when load balancing finds it not "cache hot" (run in the last 0.5 ms),
    /// and two members that hand a core back and forth with yields are always hot. Seen:
    /// 2 ranks on one core for a whole run next to an idle one, 12 µs a 4 KiB call
    /// instead of 3 (Open MPI binds its ranks to cores for the same reason). The move
    /// sets the affinity to the free core and at once back to the mask it was: the task
    /// stays where it was moved, its mask is the user's. Of two members on one core the
    /// later one moves; at most one move per `move_every` ([`MOVE_EVERY`]) and thread.
    /// Returns whether this member still shares its core with another (its next waits
    /// spin less).
    pub(super) fn leave_a_shared_core(&self) -> bool {
        if !self.spread {
            return false;
        }
        // SAFETY: no arguments; returns the calling thread's current core or -1.
        let Ok(cpu) = u32::try_from(unsafe { libc::sched_getcpu() }) else {
            return false;
        };
        self.leave_a_shared_core_at(cpu)
    }

    /// [`Self::leave_a_shared_core`] for a thread found on core `cpu` (tests give it,
    /// so that the scheduler cannot move the thread between their reading and this).
    pub(super) fn leave_a_shared_core_at(&self, cpu: u32) -> bool {
        if !self.spread {
            return false;
        }
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
                .is_some_and(|t| now.duration_since(t) < self.move_every)
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
            Some(Moved { to, .. }) => {
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
    pub(super) fn wait(&self, seq: u32, patience: &mut Patience<'_>) -> Result<()> {
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
pub(super) const MOVE_EVERY: Duration = Duration::from_millis(100);

thread_local! {
    /// When this thread last moved to another core.
    static LAST_MOVE: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Where [`move_to_a_free_core`] moved the calling thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Moved {
    /// The core it chose.
    pub to: u32,
    /// The core the thread ran on while that core alone was its affinity (`None`: the
    /// kernel did not say). Once the mask is back the scheduler may move it again, so
    /// this, not the core it runs on later, shows where the move took it (the tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub pinned_on: Option<u32>,
}

/// Moves the calling thread from core `from` to an allowed core that is not in `taken`,
/// leaving its affinity mask as it was; returns the core, or `None` when there is none
/// or the kernel refuses.
pub(super) fn move_to_a_free_core(from: u32, taken: &[u32]) -> Option<Moved> {
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
        // The kernel moved the thread before returning: it runs on `to` now.
        let pinned_on = u32::try_from(libc::sched_getcpu()).ok();
        // Back to the whole mask at once: the thread stays on `to` until the scheduler
        // moves it, as any thread would.
        libc::sched_setaffinity(0, size, &mask);
        moved.then_some(Moved { to, pinned_on })
    }
}

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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

pub(super) fn futex_wake(word: &AtomicU32) {
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
