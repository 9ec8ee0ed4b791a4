//! The cycle loop: the state of one rank's cycles ([`CycleThread`]), the [`Engine`] that
//! whichever thread runs them holds, when the next cycle is due, and one cycle from
//! taking the inbox to running the response, then finishing the job.
//!
//! It must never decide on its own what the other ranks do: what runs comes from the
//! negotiation ([`super::negotiate`]) and is run by [`super::execute`].

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::cache::RankCache;
use super::coordinator::{Coordinator, Item, OpKind, Request, Response};
use super::faults::{FaultChannel, LostRank};
use super::server::{ControlServer, Feeder};
use super::shared::{Entry, Shared};
use crate::algorithms::NodeLayout;
use crate::control::{CycleStats, KnobUpdate, Knobs, Phase, TimelineEvent};
use crate::error::{CollectiveError, Result};
use crate::knobs::AutotuneConfig;
use crate::tensor::AlignedBuf;
use crate::timeline::{TimelineFile, activity, now_us};
use crate::transport::Transport;

pub(super) struct CycleThread {
    pub(super) shared: Arc<Shared>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) layout: Option<NodeLayout>,
    pub(super) coordinator: Option<Coordinator>,
    /// This rank's response cache (rank 0 has one too, beside its coordinator's).
    pub(super) cache: RankCache,
    pub(super) all_ranks: Vec<usize>,
    /// Every rank shares this host's segment: settled cycles are decided there.
    pub(super) settle: bool,
    /// The index of the next cycle, known from the last response (`None` before the
    /// first: the same on every rank).
    pub(super) next_cycle: Option<u64>,
    pub(super) knobs: Knobs,
    pub(super) pending: HashMap<String, Entry, foldhash::fast::RandomState>,
    /// An empty vector for the inbox's next entries (see `cycle`).
    pub(super) spare_entries: Vec<Entry>,
    /// Statistics of cycles not reported yet, and when the last report went
    /// ([`CycleThread::report_stats`]).
    pub(super) stats_held: Option<CycleStats>,
    pub(super) stats_sent_at: Option<Instant>,
    pub(super) fusion: AlignedBuf,
    /// This rank's GPU side, started by the job's first GPU allreduce.
    #[cfg(feature = "cuda")]
    pub(super) gpu: Option<crate::gpu::GpuEngine>,
    /// `RuntimeConfig::nccl`.
    #[cfg(feature = "cuda")]
    pub(super) nccl: bool,
    /// `RuntimeConfig::timeout`: how long NCCL's work may wait on the peers.
    #[cfg(feature = "cuda")]
    pub(super) gpu_timeout: Duration,
    pub(super) timeline: Option<TimelineFile>,
    pub(super) server: Option<Arc<ControlServer>>,
    /// A rank that is not its host's first: its timeline goes to the host's socket.
    pub(super) feeder: Option<Feeder>,
    pub(super) warned_fallback: bool,
    /// Rank 0's stall check ([`crate::knobs::StallConfig`]).
    pub(super) stall: crate::knobs::StallConfig,
    /// What the control socket was last told is stalled: each tensor's name and missing
    /// ranks (a new report goes out when this changes).
    pub(super) stall_published: Vec<(String, Vec<usize>)>,
    pub(super) faults: Option<Arc<FaultChannel>>,
    /// Rank 0 of a job started with `RINGWATCH_AUTOTUNE=1`.
    pub(super) autotune: Option<AutotuneDriver>,
    /// The last settled post's buffer, reused ([`CycleThread::settled`]).
    pub(super) post: Vec<u8>,
    /// The response being run's [`Response::join_counts`]: the tensors a joined rank that
    /// lacks them adds zeros of.
    pub(super) join_counts: Vec<(String, usize)>,
}

/// Rank 0's side of `RINGWATCH_AUTOTUNE=1`: waits for an agent's claim, else self-tunes.
pub(super) struct AutotuneDriver {
    pub(super) config: AutotuneConfig,
    pub(super) job_id: String,
    /// The "cannot self-tune" warning was logged.
    #[cfg_attr(feature = "autotune", allow(dead_code))]
    pub(super) warned: bool,
    #[cfg(feature = "autotune")]
    pub(super) tuner: Option<super::selftune::SelfTuner>,
    /// After a pin: the watch that starts a re-check when the throughput moves.
    #[cfg(feature = "autotune")]
    pub(super) watcher: Option<super::selftune::Watcher>,
    /// Report writers (one per session); joined at shutdown.
    pub(super) report_threads: Vec<JoinHandle<()>>,
}

/// Timeline events of one cycle; builds nothing when disabled.
pub(super) struct Events {
    pub(super) enabled: bool,
    pub(super) rank: usize,
    pub(super) list: Vec<TimelineEvent>,
}

impl Events {
    /// `args` are formatted only when the timeline is on.
    pub(super) fn add(
        &mut self,
        tensor: &str,
        activity: &str,
        phase: Phase,
        args: &[(&str, &dyn std::fmt::Display)],
    ) {
        if !self.enabled {
            return;
        }
        self.list.push(TimelineEvent {
            rank: self.rank,
            tensor: tensor.to_string(),
            activity: activity.to_string(),
            phase,
            ts_us: now_us(),
            args: args
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        });
    }
}

pub(super) fn negotiate_activity(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce(_) => activity::NEGOTIATE_ALLREDUCE,
        OpKind::Allgather => activity::NEGOTIATE_ALLGATHER,
        OpKind::Broadcast(_) => activity::NEGOTIATE_BROADCAST,
    }
}

/// When the cycle after one that started at `start` and ended at `end` is due
/// (see [`CycleThread::run`]): `cycle_time` after the start with tensors in flight,
/// after the end when idle.
pub(super) fn next_cycle_at(
    start: Instant,
    end: Instant,
    cycle_time: Duration,
    idle: bool,
) -> Instant {
    if idle { end } else { start }.max(start) + cycle_time
}

#[derive(Default)]
pub(super) struct Work {
    pub(super) bytes_reduced: u64,
    pub(super) bytes_total: u64,
    pub(super) tensors: u64,
    pub(super) buffers: u64,
}

impl Work {
    /// Counts an allreduce item of `tensors` tensors and `bytes` bytes, and hands each
    /// entry its result.
    pub(super) fn allreduced(&mut self, bytes: usize, entries: Vec<Entry>) {
        self.bytes_reduced += bytes as u64;
        self.bytes_total += bytes as u64;
        self.tensors += entries.len() as u64;
        self.buffers += 1;
        for e in entries {
            e.succeed();
        }
    }
}

/// One rank's cycles, run by whichever thread holds it: the background thread (on its
/// timer, or when work arrives while it waits) or a caller waiting for its result while
/// nothing else is in flight ([`Handle::drive`]).
pub(super) struct Engine {
    pub(super) cycle: CycleThread,
    /// When the last cycle started and ended; `None` before the first.
    pub(super) last: Option<(Instant, Instant)>,
    /// How the job ended, once it has: the background thread then tears it down.
    pub(super) outcome: Option<Result<()>>,
}

impl Engine {
    /// The background thread: runs every cycle that is due and nobody else runs, then,
    /// when the job ends, fails what is left and closes the job.
    pub(super) fn run(engine: Arc<Mutex<Engine>>, shared: &Shared) {
        // Another rank waits in the segment for this rank's next cycle.
        let mut awaited = false;
        loop {
            let locked = if shared.callers_drive.load(Ordering::Relaxed) {
                // Callers run the cycles (`Handle::drive`) of blocking calls one after
                // the other. Blocking on the lock would have every cycle's unlock wake
                // this thread, only to find the next call's caller holding it again.
                match engine.try_lock() {
                    Err(std::sync::TryLockError::WouldBlock) => {
                        wait_while_callers_drive(shared);
                        continue;
                    }
                    Err(std::sync::TryLockError::Poisoned(_)) => Err(()),
                    Ok(e) => Ok(e),
                }
            } else {
                // This thread runs the cycles (async tensors): it takes the engine as
                // soon as a caller that ran one in between lets go.
                engine.lock().map_err(|_| ())
            };
            // A cycle panicked: nothing can be trusted; the links go when we do.
            let Ok(mut e) = locked else {
                return;
            };
            if e.outcome.is_some() {
                break;
            }
            let (next, idle) = e.next_cycle();
            if Instant::now() >= next || (idle && shared.inbox_ready()) || (awaited && !idle) {
                awaited = false;
                e.step(false);
                continue;
            }
            if !idle && e.cycle.settle {
                // Tensors in flight here wait for other ranks' (a cycle in which ranks
                // sent different tensors). When another rank starts a cycle it waits in
                // the segment for this one: join it now rather than at this rank's timer,
                // so that a rank that fell out of step with the others (its idle cycle
                // met their tensors) catches up within microseconds, not a cycle time.
                let transport = e.cycle.transport.clone();
                let ranks = e.cycle.all_ranks.clone();
                drop(e);
                match transport.wait_for_a_post(&ranks, next) {
                    Some(Ok(posted)) => awaited = posted,
                    Some(Err(_)) | None => wait_for_next_cycle(shared, next, idle, false),
                }
                continue;
            }
            // A caller that ran the last cycle runs the next one for its next tensor
            // too: no yielding for it.
            let yield_first = !shared.callers_drive.load(Ordering::Relaxed);
            drop(e);
            wait_for_next_cycle(shared, next, idle, yield_first);
        }
        if let Ok(mut e) = engine.lock() {
            let outcome = e.outcome.take().unwrap_or(Ok(()));
            e.cycle.finish(outcome);
        }
    }

    /// When the next cycle is due, and whether this rank is idle (nothing in flight).
    pub(super) fn next_cycle(&self) -> (Instant, bool) {
        let idle = self.cycle.pending.is_empty();
        match self.last {
            // With tensors in flight the next cycle comes `cycle_time` after this one
            // started: the cycle time bounds how long they wait for others to fuse
            // with. An idle rank's timer only keeps the job's cycles going (knobs,
            // shutdown, ranks that wait on it); it counts from the end of the last
            // cycle, so that a cycle that ran longer than `cycle_time` is not followed
            // at once by an empty one that the caller's next tensor misses: that rank
            // would then send nothing while the others send the tensor, they would
            // wait out a whole cycle time, overrun again, and the job would stay in
            // that lock-step of one call per cycle time (seen: 64 KiB blocking calls
            // at ~1.2 ms instead of ~0.1 ms in some runs).
            Some((start, end)) => (
                next_cycle_at(start, end, self.cycle.knobs.cycle_time(), idle),
                idle,
            ),
            None => (Instant::now(), idle),
        }
    }

    /// A caller that ran a cycle lets go of the engine (`e`, locked): the background
    /// thread is woken when the job ended, or when tensors wait for later cycles or came
    /// in for it while the caller held the engine (it takes over now); otherwise it
    /// sleeps on.
    pub(super) fn release_to_background(e: std::sync::MutexGuard<'_, Self>) {
        let left = !e.cycle.pending.is_empty();
        let shared = e.cycle.shared.clone();
        let ended = e.outcome.is_some();
        drop(e);
        if let Ok(mut inbox) = shared.inbox.lock() {
            if ended {
                inbox.ended = true;
            } else if left || inbox.has_work() {
                inbox.engine_free = true;
                shared.handoffs.fetch_add(1, Ordering::Relaxed);
            } else {
                return;
            }
        }
        shared.work.notify_all();
    }

    /// Runs one cycle (`by_caller`: on a waiting caller's thread).
    pub(super) fn step(&mut self, by_caller: bool) {
        let start = Instant::now();
        if by_caller {
            self.cycle
                .shared
                .caller_cycles
                .fetch_add(1, Ordering::Relaxed);
        }
        let interrupted = self
            .cycle
            .shared
            .interrupted
            .lock()
            .ok()
            .and_then(|r| r.clone());
        let result = match interrupted {
            // A job of one rank has no link for the interrupt to break.
            Some(reason) => Err(CollectiveError::Interrupted {
                rank: self.cycle.rank,
                reason,
            }),
            None => {
                self.cycle.autotune_tick();
                self.cycle.cycle(start)
            }
        };
        self.stepped(start, by_caller, result);
    }

    /// A cycle begun at `start` ended with `result` (`Ok(true)`: the job shut down).
    pub(super) fn stepped(&mut self, start: Instant, by_caller: bool, result: Result<bool>) {
        self.last = Some((start, Instant::now()));
        self.cycle
            .shared
            .callers_drive
            .store(by_caller, Ordering::Relaxed);
        match result {
            Ok(false) => {}
            Ok(true) => self.outcome = Some(Ok(())),
            Err(e) => self.outcome = Some(Err(e)),
        }
    }
}

/// Waits while a caller holds the engine: until one leaves work for this thread (or
/// ends the job), or for at most a cycle time, after which the engine is tried again.
pub(super) fn wait_while_callers_drive(shared: &Shared) {
    let cycle_time = shared
        .knobs
        .lock()
        .map_or(Duration::from_millis(1), |k| k.0.cycle_time());
    let Ok(mut inbox) = shared.inbox.lock() else {
        return;
    };
    if !std::mem::take(&mut inbox.engine_free)
        && !inbox.ended
        && let Ok((mut inbox, _)) = shared.work.wait_timeout(inbox, cycle_time)
    {
        inbox.engine_free = false;
    }
}

/// Waits until `next`, the start of the next cycle. A rank with nothing in flight
/// (`idle`) starts at once when work arrives instead: the cycle time bounds how long
/// tensors wait to be fused with others, it is not a sleep every request pays. Ranks
/// meet at rank 0 in every cycle anyway, so one that starts early waits there for the
/// others, as it would have at its own timer; results do not depend on when cycles run
/// (see the determinism contract in the crate's docs). Returns at once, too, when a
/// caller's cycle ended the job.
pub(super) fn wait_for_next_cycle(shared: &Shared, next: Instant, idle: bool, yield_first: bool) {
    if idle && yield_first {
        // The caller's next tensor often follows within microseconds (a blocking
        // allreduce in a loop): yield to it rather than sleep.
        crate::poll::yield_until(crate::poll::YIELD_BUDGET, || {
            Instant::now() >= next || shared.inbox_ready()
        });
    }
    let Ok(mut inbox) = shared.inbox.lock() else {
        return;
    };
    loop {
        // `engine_free`: a caller's cycle left tensors in flight; what to do next is
        // decided afresh.
        if (idle && inbox.has_work()) || inbox.ended || std::mem::take(&mut inbox.engine_free) {
            return;
        }
        let now = Instant::now();
        if now >= next {
            return;
        }
        inbox = match shared.work.wait_timeout(inbox, next - now) {
            Ok((inbox, _)) => inbox,
            Err(_) => return,
        };
    }
}

impl CycleThread {
    /// Fails what is left with the job's final error and closes the job.
    pub(super) fn finish(&mut self, outcome: Result<()>) {
        let error = match outcome {
            Ok(()) => CollectiveError::ShutDown { rank: self.rank },
            Err(e) => {
                // Break every link so that peers fail now, not after their timeout.
                self.transport.abort();
                let interrupted = self.shared.interrupted.lock().ok().and_then(|r| r.clone());
                let e = match interrupted {
                    // This rank is the cause; the others were told.
                    Some(reason) => CollectiveError::Interrupted {
                        rank: self.rank,
                        reason,
                    },
                    // What this rank saw may be a neighbour giving up: name the rank that
                    // failed first, as rank 0 establishes it (a process that went away, or
                    // one that no longer answers).
                    None => match self.faults.as_ref().and_then(|f| f.lost_rank()) {
                        Some(LostRank {
                            rank: dead,
                            how,
                            silent: false,
                        }) => CollectiveError::RankLost {
                            rank: self.rank,
                            dead,
                            how,
                            detail: e.to_string(),
                        },
                        Some(LostRank {
                            rank: silent,
                            how,
                            silent: true,
                        }) => CollectiveError::RankSilent {
                            rank: self.rank,
                            silent,
                            how,
                            detail: e.to_string(),
                        },
                        None => e,
                    },
                };
                tracing::error!(rank = self.rank, error = %e, "collective job failed");
                e
            }
        };
        let (leftovers, join) = match self.shared.inbox.lock() {
            Ok(mut inbox) => {
                inbox.closed = Some(match &error {
                    CollectiveError::ShutDown { .. } | CollectiveError::Interrupted { .. } => {
                        error.clone()
                    }
                    e => CollectiveError::JobFailed {
                        rank: self.rank,
                        cause: e.to_string(),
                    },
                });
                (std::mem::take(&mut inbox.entries), inbox.join.take())
            }
            Err(_) => (Vec::new(), None),
        };
        if let Some(join) = join {
            join.send(Err(error.clone()));
        }
        let pending: Vec<Entry> = self.pending.drain().map(|(_, e)| e).collect();
        for entry in pending.into_iter().chain(leftovers) {
            self.shared.forget(&entry.request.name);
            entry.finish(Err(error.clone()));
        }
        if let Some(server) = self.server.take() {
            server.stop();
        }
        self.timeline.take();
        if let Some(mut d) = self.autotune.take() {
            #[cfg(feature = "autotune")]
            if let Some(t) = d.tuner.take() {
                t.abandon();
                self.shared.claims.end_self_tuning(false);
            }
            for t in d.report_threads.drain(..) {
                let _ = t.join();
            }
        }
    }

    /// Rank 0 of an autotuned job, at a cycle boundary: once the wait for an agent is over
    /// with no claim, start tuning itself (or, built without the `autotune` feature, say
    /// that it cannot).
    pub(super) fn autotune_tick(&mut self) {
        let Some(d) = &mut self.autotune else { return };
        #[cfg(feature = "autotune")]
        if d.tuner.is_none() && self.shared.claims.begin_self_tuning(Instant::now()) {
            let current = self
                .coordinator
                .as_ref()
                .map(Coordinator::knobs)
                .unwrap_or(self.knobs);
            match super::selftune::SelfTuner::start(&d.config, current, &d.job_id) {
                Ok(t) => {
                    tracing::info!(
                        job_id = d.job_id,
                        budget = d.config.budget,
                        wait_s = d.config.wait.as_secs_f64(),
                        "no agent claimed the tuning in time; rank 0 tunes the job itself \
                         (no disturbance detection without an agent)"
                    );
                    d.tuner = Some(t);
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot start self-tuning; the job runs untuned");
                    self.shared.claims.end_self_tuning(false);
                }
            }
        }
        #[cfg(not(feature = "autotune"))]
        if !d.warned
            && self.shared.claims.wait_over(Instant::now())
            && self.shared.claims.state() == crate::control::AutotuneState::Waiting
        {
            d.warned = true;
            tracing::warn!(
                job_id = d.job_id,
                wait_s = d.config.wait.as_secs_f64(),
                "RINGWATCH_AUTOTUNE=1, but this build of collectives has no `autotune` \
                 feature and no agent claimed the job: it runs untuned on its current knobs \
                 (it stays `waiting`, so an agent that comes later may still tune it)"
            );
        }
    }

    /// One cycle, begun at `cycle_start`; `Ok(true)` when the job shuts down.
    pub(super) fn cycle(&mut self, cycle_start: Instant) -> Result<bool> {
        let mut events = Events {
            enabled: self.timeline.is_some()
                || self.server.as_ref().is_some_and(|s| s.wants_timeline())
                || self
                    .feeder
                    .as_mut()
                    .is_some_and(|f| f.wants_timeline(cycle_start)),
            rank: self.rank,
            list: Vec::new(),
        };
        let (mut entries, knob_updates, shutdown, join) = {
            let mut inbox = self
                .shared
                .inbox
                .lock()
                .map_err(|_| CollectiveError::JobFailed {
                    rank: self.rank,
                    cause: "runtime state poisoned".into(),
                })?;
            // The inbox gets last cycle's emptied vector, so that enqueueing does not
            // allocate one per cycle.
            (
                std::mem::replace(&mut inbox.entries, std::mem::take(&mut self.spare_entries)),
                std::mem::take(&mut inbox.knobs),
                inbox.shutdown,
                inbox.join.is_some(),
            )
        };
        let request = Request {
            tensors: self.cache.encode(entries.iter().map(|e| &e.request)),
            knobs: knob_updates,
            shutdown,
            join,
        };
        for entry in entries.drain(..) {
            events.add(
                &entry.request.name,
                negotiate_activity(entry.request.kind),
                Phase::Begin,
                &[],
            );
            self.pending.insert(entry.request.name.clone(), entry);
        }
        self.spare_entries = entries;

        let knob_requests = self
            .server
            .as_ref()
            .map(|s| s.take_knob_requests())
            .unwrap_or_default();
        // A self-tuning session's knobs take the same path as the socket's, last.
        #[cfg(feature = "autotune")]
        let tuner_update = self
            .autotune
            .as_mut()
            .and_then(|d| d.tuner.as_mut())
            .and_then(|t| t.take_update());
        #[cfg(not(feature = "autotune"))]
        let tuner_update: Option<KnobUpdate> = None;
        let settled = self.settled(
            &request,
            !knob_requests.is_empty() || tuner_update.is_some(),
        )?;
        let response = match settled {
            Some(response) => response,
            None => self.negotiated(request, knob_requests, tuner_update)?,
        };
        self.run_response(response, &mut events, cycle_start)
    }

    /// Rank 0's answer to `request`, with this rank's names (see [`Self::negotiate`]).
    pub(super) fn negotiated(
        &mut self,
        request: Request,
        knob_requests: Vec<super::server::KnobRequest>,
        tuner_update: Option<KnobUpdate>,
    ) -> Result<Response> {
        let response = self.negotiate(request, knob_requests, tuner_update)?;
        if let Some(cause) = response.abort {
            return Err(CollectiveError::JobFailed {
                rank: self.rank,
                cause,
            });
        }
        let pending = &self.pending;
        self.cache
            .decode(response, |name| {
                pending.get(name).map(|e| e.request.clone())
            })
            .map_err(|cause| CollectiveError::JobFailed {
                rank: self.rank,
                cause,
            })
    }

    /// Every rank has joined, `last` the last: this rank's join returns it.
    fn end_join(&mut self, last: usize) {
        let done = self
            .shared
            .inbox
            .lock()
            .ok()
            .and_then(|mut i| i.join.take());
        let Some(done) = done else {
            return;
        };
        let value = i64::try_from(last).unwrap_or(i64::MAX).to_le_bytes();
        let mut buf = AlignedBuf::zeroed(value.len());
        buf.as_mut_slice().copy_from_slice(&value);
        let result = crate::tensor::Tensor::from_bytes(crate::DType::I64, &[1], buf).ok_or(
            CollectiveError::JobFailed {
                rank: self.rank,
                cause: "join's result does not fit its tensor (a bug in collectives)".into(),
            },
        );
        done.send(result);
    }

    /// The cycle `cycle` runs under `knobs`: both in force here from now on.
    pub(super) fn begin_response(&mut self, cycle: u64, knobs: Knobs) {
        self.next_cycle = Some(cycle + 1);
        if knobs.hierarchical_allreduce && !self.knobs.hierarchical_allreduce {
            self.warned_fallback = false;
        }
        self.knobs = knobs;
        if let Ok(mut k) = self.shared.knobs.lock() {
            *k = (knobs, cycle);
        }
        self.shared.cycles.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs the cycle's `response` (settled or rank 0's): its items, then the statistics
    /// and the timeline; `Ok(true)` when the job shuts down.
    pub(super) fn run_response(
        &mut self,
        response: Response,
        events: &mut Events,
        cycle_start: Instant,
    ) -> Result<bool> {
        self.begin_response(response.cycle, response.knobs);

        let timeline_on = events.enabled;
        for item in response.items.iter().filter(|_| timeline_on) {
            let names: Vec<&String> = match item {
                Item::Allreduce { names, .. } => names.iter().collect(),
                Item::Allgather { name, .. }
                | Item::Broadcast { name, .. }
                | Item::Error { name, .. } => {
                    vec![name]
                }
            };
            for name in names {
                if let Some(e) = self.pending.get(name) {
                    events.add(name, negotiate_activity(e.request.kind), Phase::End, &[]);
                    events.add(name, activity::QUEUE, Phase::Begin, &[]);
                }
            }
        }
        let mut work = Work::default();
        // What a joined rank adds zeros of, for this response's items only.
        self.join_counts = response.join_counts;
        let executed = response
            .items
            .into_iter()
            .try_for_each(|item| self.execute(item, &mut work, events));
        self.join_counts.clear();
        executed?;
        if let Some(last) = response.join_done {
            self.end_join(last);
        }
        self.account(&work, response.cycle, cycle_start);
        if !events.list.is_empty() {
            if let Some(server) = &self.server {
                server.publish_timeline(&events.list);
            }
            if let Some(feeder) = self.feeder.as_mut() {
                feeder.send(if self.timeline.is_some() {
                    events.list.clone()
                } else {
                    std::mem::take(&mut events.list)
                });
            }
            if let Some(t) = &self.timeline {
                t.write(std::mem::take(&mut events.list));
            }
        }
        Ok(response.shutdown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_rank_counts_its_next_cycle_from_the_end_of_the_last_one() {
        let start = Instant::now();
        let cycle = Duration::from_millis(1);
        // A cycle that overran its cycle time (3 ms).
        let end = start + Duration::from_millis(3);
        // Tensors in flight: due a cycle time after the start (already past: at once),
        // as the fusion bound says.
        assert_eq!(next_cycle_at(start, end, cycle, false), start + cycle);
        // Idle: a whole cycle time after the end, never at once, so that it does not
        // run an empty cycle that the caller's next tensor just misses.
        assert_eq!(next_cycle_at(start, end, cycle, true), end + cycle);
        // A short cycle: idle still counts from its end.
        let end = start + Duration::from_micros(100);
        assert_eq!(next_cycle_at(start, end, cycle, true), end + cycle);
    }
}
