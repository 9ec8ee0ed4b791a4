//! The fault channel: the rendezvous connections, kept open, over which rank 0 learns which
//! rank failed and tells the others, so that every rank's error names that rank rather than
//! a neighbour that gave up after it.
//!
//! Two kinds of fault are told apart. A rank whose process went away closes its connection:
//! rank 0 hears it at once. A rank that is stopped (SIGSTOP) or hung keeps its connection
//! open, and its kernel still acknowledges bytes, so only an answer tells it from a live
//! one: when any rank's job fails (rank 0's own, or a `Failed` report from another rank),
//! rank 0 probes every rank once and names the ranks whose process did not answer within
//! [`PROBE_WINDOW`]; a rank whose report rank 0 does not take up (no probe comes) names
//! rank 0. Either verdict goes to every rank.
//!
//! It carries only rare notices, never data, and it must never block the cycle thread: a
//! reader thread per link waits on the socket (and answers probes even while the cycle
//! thread is stuck), and the cycle thread only reads the verdict.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{read_message, write_message};

/// How long rank 0 waits for every rank to answer its probe, and a rank for rank 0 to
/// take up its failure report. An answer comes from a reader thread that only waits on
/// its socket, so a live process answers in far less, even on a loaded machine.
pub(crate) const PROBE_WINDOW: Duration = Duration::from_secs(2);

/// How long a rank waits for rank 0's verdict beyond [`PROBE_WINDOW`].
const VERDICT_SLACK: Duration = Duration::from_secs(1);

#[derive(Serialize, Deserialize)]
enum Notice {
    /// This rank's process went away (seen by rank 0, or said by the rank itself as it
    /// leaves on a signal).
    Dead { rank: usize, how: String },
    /// The sender is shutting down cleanly.
    Bye,
    /// To rank 0: the sender's job failed; find out who is not answering.
    Failed,
    /// From rank 0: answer with `Alive`.
    Probe,
    /// To rank 0: the answer to `Probe`.
    Alive,
    /// From rank 0: this rank's process did not answer the probe.
    Silent { rank: usize, how: String },
    /// From rank 0: every rank answered the probe; nobody is to blame.
    AllAnswered,
}

/// Which rank failed, as the fault channel established it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LostRank {
    /// The rank.
    pub rank: usize,
    /// How it was noticed.
    pub how: String,
    /// Its process is there but did not answer (stopped or hung), rather than gone.
    pub silent: bool,
}

#[derive(Default)]
struct State {
    verdict: Option<LostRank>,
    /// Rank 0's probe found every rank answering.
    all_answered: bool,
    /// Rank 0 has probed this rank (so rank 0's process runs).
    probed: bool,
    /// This rank reported its failure to rank 0.
    reported: bool,
    /// Rank 0: the probe, once started: which ranks have answered it.
    answered: Option<Vec<bool>>,
}

struct Inner {
    rank: usize,
    writers: Vec<Option<Arc<Mutex<TcpStream>>>>,
    state: Mutex<State>,
    changed: Condvar,
    closing: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// This rank's end of the fault channel.
pub(crate) struct FaultChannel {
    inner: Arc<Inner>,
}

impl Inner {
    fn state(&self) -> Option<MutexGuard<'_, State>> {
        self.state.lock().ok()
    }

    fn send(&self, peer: usize, notice: &Notice) {
        if let Some(Some(w)) = self.writers.get(peer)
            && let Ok(mut w) = w.lock()
        {
            let _ = write_message(&mut *w, notice);
        }
    }

    /// Sends `notice` to every linked rank but those in `except`.
    fn broadcast(&self, except: &[usize], notice: &Notice) {
        for peer in 0..self.writers.len() {
            if !except.contains(&peer) {
                self.send(peer, notice);
            }
        }
    }

    /// Records the first verdict; later ones are ignored. Returns whether this one counted.
    fn record(&self, lost: LostRank) -> bool {
        let Some(mut s) = self.state() else {
            return false;
        };
        if s.verdict.is_some() {
            return false;
        }
        s.verdict = Some(lost);
        self.changed.notify_all();
        true
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        if let Some(mut s) = self.state() {
            f(&mut s);
            self.changed.notify_all();
        }
    }

    /// Rank 0: records that `rank` is gone and tells everyone else.
    fn declare_gone(&self, rank: usize, how: String) {
        if self.record(LostRank {
            rank,
            how: how.clone(),
            silent: false,
        }) {
            self.broadcast(&[rank], &Notice::Dead { rank, how });
        }
    }

    /// Rank 0: probes every rank, once; a thread names who did not answer.
    fn start_probe(self: &Arc<Self>) {
        {
            let Some(mut s) = self.state() else { return };
            if s.answered.is_some() {
                return;
            }
            let answered = self
                .writers
                .iter()
                .enumerate()
                .map(|(peer, w)| peer == self.rank || w.is_none())
                .collect();
            s.answered = Some(answered);
        }
        self.broadcast(&[], &Notice::Probe);
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-fault-probe".into())
            .spawn(move || inner.finish_probe(Instant::now() + PROBE_WINDOW));
        match spawned {
            Ok(t) => {
                if let Ok(mut threads) = self.threads.lock() {
                    threads.push(t);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot start the fault probe"),
        }
    }

    fn finish_probe(&self, deadline: Instant) {
        let silent: Vec<usize> = {
            let Some(mut s) = self.state() else { return };
            loop {
                let all = s.answered.as_ref().is_some_and(|a| a.iter().all(|&x| x));
                let left = deadline.saturating_duration_since(Instant::now());
                if all
                    || s.verdict.is_some()
                    || left.is_zero()
                    || self.closing.load(Ordering::Acquire)
                {
                    break;
                }
                s = match self.changed.wait_timeout(s, left) {
                    Ok((s, _)) => s,
                    Err(_) => return,
                };
            }
            if s.verdict.is_some() {
                // A process went away meanwhile; that verdict has gone out already.
                return;
            }
            let silent: Vec<usize> = s
                .answered
                .iter()
                .flatten()
                .enumerate()
                .filter(|&(_, &a)| !a)
                .map(|(r, _)| r)
                .collect();
            if silent.is_empty() {
                s.all_answered = true;
                self.changed.notify_all();
            }
            silent
        };
        let Some(&first) = silent.first() else {
            self.broadcast(&[], &Notice::AllAnswered);
            return;
        };
        let mut how = format!(
            "its process did not answer rank 0's liveness probe within {PROBE_WINDOW:?}: it is \
             stopped (SIGSTOP?), hung or starved of CPU"
        );
        if silent.len() > 1 {
            how.push_str(&format!("; ranks {silent:?} did not answer"));
        }
        tracing::error!(rank = first, silent = ?silent, "{how}");
        if self.record(LostRank {
            rank: first,
            how: how.clone(),
            silent: true,
        }) {
            self.broadcast(&silent, &Notice::Silent { rank: first, how });
        }
    }

    /// Reads notices from `peer` until the link ends.
    fn read_link(self: &Arc<Self>, peer: usize, mut reader: TcpStream) {
        loop {
            match read_message::<_, Notice>(&mut reader) {
                Ok(Notice::Bye) => {
                    // A rank leaving cleanly was alive: it counts as an answer.
                    self.update(|s| {
                        if let Some(a) = s.answered.as_mut().and_then(|a| a.get_mut(peer)) {
                            *a = true;
                        }
                    });
                    return;
                }
                Ok(Notice::Dead { rank: dead, how }) => {
                    if self.rank == 0 && dead == peer {
                        // A rank telling rank 0 it leaves (on a signal): tell the others.
                        self.declare_gone(dead, how);
                    } else {
                        self.record(LostRank {
                            rank: dead,
                            how,
                            silent: false,
                        });
                    }
                }
                Ok(Notice::Silent { rank, how }) => {
                    self.record(LostRank {
                        rank,
                        how,
                        silent: true,
                    });
                }
                Ok(Notice::AllAnswered) => self.update(|s| s.all_answered = true),
                Ok(Notice::Failed) => {
                    if self.rank == 0 {
                        self.start_probe();
                    }
                }
                Ok(Notice::Probe) => {
                    self.send(peer, &Notice::Alive);
                    self.update(|s| s.probed = true);
                }
                Ok(Notice::Alive) => self.update(|s| {
                    if let Some(a) = s.answered.as_mut().and_then(|a| a.get_mut(peer)) {
                        *a = true;
                    }
                }),
                Err(_) => {
                    if self.closing.load(Ordering::Acquire) {
                        return;
                    }
                    if self.rank == 0 {
                        self.declare_gone(
                            peer,
                            "its process exited or crashed: its connection to rank 0 closed"
                                .to_string(),
                        );
                    } else {
                        self.record(LostRank {
                            rank: peer,
                            how: "its process exited or crashed".to_string(),
                            silent: false,
                        });
                    }
                    return;
                }
            }
        }
    }
}

impl FaultChannel {
    /// Starts a reader per link (`links[p]` is the connection to rank `p`).
    pub fn start(rank: usize, links: Vec<Option<TcpStream>>) -> Self {
        let mut writers: Vec<Option<Arc<Mutex<TcpStream>>>> = Vec::new();
        let mut readers = Vec::new();
        for (peer, link) in links.into_iter().enumerate() {
            let pair = link.and_then(|s| {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                s.try_clone().ok().map(|w| (s, w))
            });
            match pair {
                Some((r, w)) => {
                    writers.push(Some(Arc::new(Mutex::new(w))));
                    readers.push((peer, r));
                }
                None => writers.push(None),
            }
        }
        let inner = Arc::new(Inner {
            rank,
            writers,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            closing: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        for (peer, reader) in readers {
            let i = inner.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ringwatch-fault-{peer}"))
                .spawn(move || i.read_link(peer, reader));
            if let Ok(t) = spawned
                && let Ok(mut threads) = inner.threads.lock()
            {
                threads.push(t);
            }
        }
        FaultChannel { inner }
    }

    /// After this rank's job failed: the rank that failed first, as rank 0 establishes it
    /// (a process that went away, or one that does not answer), or `None` when every rank
    /// answers. Rank 0 probes the others; another rank reports its failure to rank 0 and
    /// waits for the verdict, naming rank 0 itself if rank 0 does not take the report up.
    /// Waits at most [`PROBE_WINDOW`] and a little more; at once when the news is in.
    pub fn lost_rank(&self) -> Option<LostRank> {
        let inner = &self.inner;
        let start = Instant::now();
        let linked_to_rank0 = inner.writers.first().is_some_and(|w| w.is_some());
        if inner.rank == 0 {
            inner.start_probe();
        } else if linked_to_rank0 {
            let first_report = inner
                .state()
                .is_some_and(|mut s| !std::mem::replace(&mut s.reported, true));
            if first_report {
                inner.send(0, &Notice::Failed);
            }
        } else {
            return None;
        }
        let mut s = inner.state()?;
        loop {
            if s.verdict.is_some() || s.all_answered || inner.closing.load(Ordering::Acquire) {
                break;
            }
            let waited = start.elapsed();
            if inner.rank != 0 && !s.probed && waited >= PROBE_WINDOW {
                // Rank 0's reader would have probed at once: its process does not run.
                s.verdict = Some(LostRank {
                    rank: 0,
                    how: format!(
                        "its process did not take up this rank's failure report within \
                         {PROBE_WINDOW:?}: it is stopped (SIGSTOP?), hung or starved of CPU"
                    ),
                    silent: true,
                });
                break;
            }
            let Some(left) = (PROBE_WINDOW + VERDICT_SLACK).checked_sub(waited) else {
                break;
            };
            let left = if inner.rank != 0 && !s.probed {
                left.min(PROBE_WINDOW.saturating_sub(waited))
                    .max(Duration::from_millis(1))
            } else {
                left
            };
            s = inner.changed.wait_timeout(s, left).ok()?.0;
        }
        s.verdict.clone().filter(|v| v.rank != inner.rank)
    }

    /// Tells the others that this rank leaves now, and why (it was told to stop by a
    /// signal): rank 0 passes it on, so every rank names this one.
    pub fn announce_exit(&self, how: &str) {
        let inner = &self.inner;
        let notice = Notice::Dead {
            rank: inner.rank,
            how: how.to_string(),
        };
        if inner.rank == 0 {
            inner.broadcast(&[], &notice);
        } else {
            inner.send(0, &notice);
        }
    }

    /// Says goodbye on every link and stops the readers.
    pub fn close(&self) {
        let inner = &self.inner;
        if inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        inner.changed.notify_all();
        for w in inner.writers.iter().flatten() {
            if let Ok(mut w) = w.lock() {
                let _ = write_message(&mut *w, &Notice::Bye);
                let _ = w.shutdown(Shutdown::Both);
            }
        }
        let threads = inner
            .threads
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for FaultChannel {
    fn drop(&mut self) {
        self.close();
    }
}
