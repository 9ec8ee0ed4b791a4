//! Self-tuning without an agent (Horovod's way): when a job asked for tuning
//! (`RINGWATCH_AUTOTUNE=1`) and no agent claimed it in time, rank 0 drives a
//! [`tuner::session::TuningSession`] in-process from its cycle thread.
//!
//! The session's knobs go through the runtime's own knob-change path (the same list of
//! updates the control socket's `set_knobs` feeds the coordinator), so every rank switches
//! on the same cycle boundary; the session is fed rank 0's own per-cycle statistics. There
//! is no disturbance detection here (no eBPF in the job): every window is judged clean, and
//! the session copes without a signal (windows scored by the median of three sub-windows,
//! low outliers discounted by the model, the choice confirmed against the start).
//!
//! The optimizer's suggestion (a few ms) runs inline at the cycle boundary after a window
//! closes: it then falls before the next knobs are applied, so it never lands in a
//! measured window, and the protocol stays on one thread. Only the report's files are
//! written on a helper thread, so that file I/O never stalls the cycle loop. This module
//! must never change a result: it only chooses knobs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tuner::report::write_report;
use tuner::session::{
    CycleObservation, SessionConfig, SessionContext, Step, StepMarks, TuningSession, Verdict,
};
use tuner::space::CollectiveKnobs;
use tuner::watch::{Watch, WatchConfig, WatchEvent};

use crate::control::{CycleStats, KnobUpdate, Knobs};
use crate::knobs::AutotuneConfig;
use crate::runtime::SelfTuneOutcome;
use crate::runtime::claim::TuningClaims;

/// The runtime's knobs as the tuner's.
pub(crate) fn to_tuner(k: &Knobs) -> CollectiveKnobs {
    CollectiveKnobs {
        fusion_threshold_bytes: k.fusion_threshold_bytes,
        cycle_time_ms: k.cycle_time_us as f64 / 1000.0,
        hierarchical_allreduce: k.hierarchical_allreduce,
    }
}

/// The tuner's knobs as the runtime's (cycle time rounded to whole microseconds).
pub(crate) fn from_tuner(k: &CollectiveKnobs) -> Knobs {
    Knobs {
        fusion_threshold_bytes: k.fusion_threshold_bytes,
        cycle_time_us: (k.cycle_time_ms * 1000.0).round().max(1.0) as u64,
        hierarchical_allreduce: k.hierarchical_allreduce,
    }
}

fn full_update(k: &Knobs) -> KnobUpdate {
    KnobUpdate {
        fusion_threshold_bytes: Some(k.fusion_threshold_bytes),
        cycle_time_us: Some(k.cycle_time_us),
        hierarchical_allreduce: Some(k.hierarchical_allreduce),
    }
}

/// Where the knobs of the session stand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pending {
    /// Nothing to send.
    None,
    /// Send these knobs with the next negotiation.
    Send(Knobs),
    /// Sent; waiting for the coordinator's response that puts them in force.
    Sent(Knobs),
}

/// One self-tuning session on rank 0.
pub(crate) struct SelfTuner {
    session: TuningSession,
    config: AutotuneConfig,
    job_id: String,
    started: Instant,
    pending: Pending,
    /// The session is over and `pending` carries the pin of its best knobs.
    pinning: Option<Knobs>,
    /// 0 for the first session; n for the n-th re-check after the watch saw a change.
    round: usize,
}

/// After a pin: watches rank 0's throughput on the pinned knobs (see [`tuner::watch`]).
pub(crate) struct Watcher {
    watch: Watch,
    pinned: Knobs,
    start: Knobs,
    round: usize,
}

/// A cycle's statistics as the tuner reads them: its timing, bytes and step marks.
fn observation(stats: &CycleStats) -> CycleObservation {
    CycleObservation {
        cycle: stats.cycle,
        start_unix_us: stats.start_unix_us,
        duration_us: stats.duration_us,
        bytes_reduced: stats.bytes_reduced,
        steps: StepMarks {
            count: stats.steps.count,
            first_unix_us: stats.steps.first_unix_us,
            last_unix_us: stats.steps.last_unix_us,
        },
    }
}

impl Watcher {
    /// One cycle with work; `Some(context)` when the throughput moved beyond noise (the
    /// caller then starts [`SelfTuner::recheck`]).
    pub fn observe(&mut self, stats: &CycleStats) -> Option<SessionContext> {
        let event = self.watch.observe_cycle(&observation(stats))?;
        let (usual, now) = match event {
            WatchEvent::Window(w) => {
                tracing::debug!(score_bytes_per_s = w.score, usual = ?self.watch.usual(),
                    "self-tuning watch: a window on the pinned knobs");
                return None;
            }
            WatchEvent::Changed { usual, now } => (usual, now),
        };
        tracing::info!(
            usual_bytes_per_s = usual, now_bytes_per_s = now, pinned = ?self.pinned,
            "self-tuning: the job's throughput on the pinned knobs changed; re-checking them \
             against the start"
        );
        let first = self.watch.windows().first().map_or(0, |w| w.start_unix_us);
        Some(SessionContext {
            note: format!(
                "After session {} pinned its knobs, the job's throughput on them moved from \
                 {:.3} GB/s (median of the first watched windows) to {:.3} GB/s (median of the \
                 latest): conditions changed, so the pinned knobs were re-checked against the \
                 start.",
                self.round,
                usual / 1e9,
                now / 1e9
            ),
            timeline: self
                .watch
                .windows()
                .iter()
                .map(|w| ((w.end_unix_us.saturating_sub(first)) as f64 / 1e6, w.score))
                .collect(),
        })
    }

    /// Where the watch stands, for [`crate::Runtime::self_tune_watch`].
    pub fn status(&self) -> crate::runtime::WatchStatus {
        crate::runtime::WatchStatus {
            pinned: self.pinned,
            windows: self.watch.windows().len(),
            usual_bytes_per_s: self.watch.usual(),
        }
    }

    /// The knobs watched, the start they are re-checked against, and the round.
    pub fn recheck_of(&self) -> (Knobs, Knobs, usize) {
        (self.pinned, self.start, self.round + 1)
    }
}

impl SelfTuner {
    /// A session starting from the knobs in force.
    pub fn start(config: &AutotuneConfig, current: Knobs, job_id: &str) -> Result<Self, String> {
        Self::new(config, current, None, job_id, 0, None)
    }

    /// Round `round`: the knobs pinned before (`pinned`) against the job's first knobs
    /// (`start`), tuning again only if they lost (see `SessionConfig::recheck`).
    pub fn recheck(
        config: &AutotuneConfig,
        (pinned, start, round): (Knobs, Knobs, usize),
        job_id: &str,
        context: SessionContext,
    ) -> Result<Self, String> {
        Self::new(config, start, Some(pinned), job_id, round, Some(context))
    }

    fn new(
        config: &AutotuneConfig,
        current: Knobs,
        recheck: Option<Knobs>,
        job_id: &str,
        round: usize,
        context: Option<SessionContext>,
    ) -> Result<Self, String> {
        let mut session = TuningSession::new(SessionConfig {
            budget: config.budget,
            warmup_cycles: config.warmup_cycles,
            measured_cycles: config.measured_cycles,
            min_window_us: config.min_window.as_micros() as u64,
            seed: config.seed,
            start: to_tuner(&current),
            // No eBPF in the job: a window is scored by the median rate of
            // three runs of its cycles, so a disturbance in part of it does
            // not decide it.
            sub_windows: 3,
            recheck: recheck.as_ref().map(to_tuner),
            ..SessionConfig::default()
        })
        .map_err(|e| e.to_string())?;
        if let Some(context) = context {
            session.set_context(context);
        }
        let mut tuner = SelfTuner {
            session,
            config: config.clone(),
            job_id: job_id.to_string(),
            started: Instant::now(),
            pending: Pending::None,
            pinning: None,
            round,
        };
        tuner.advance();
        Ok(tuner)
    }

    /// Follows the session's next step: knobs to apply, or the end (pin the best).
    fn advance(&mut self) {
        match self.session.next_step() {
            Step::Apply(k) => self.pending = Pending::Send(from_tuner(&k)),
            Step::Measure => {}
            Step::Done => {
                if self.pinning.is_none() {
                    let best = self
                        .session
                        .best()
                        .map(|b| from_tuner(&b.knobs))
                        .unwrap_or_else(|| from_tuner(&self.session.config().start));
                    self.pinning = Some(best);
                    self.pending = Pending::Send(best);
                }
            }
        }
    }

    /// The knob change to carry in this cycle's negotiation, if any.
    pub fn take_update(&mut self) -> Option<KnobUpdate> {
        match self.pending {
            Pending::Send(k) => {
                self.pending = Pending::Sent(k);
                Some(full_update(&k))
            }
            _ => None,
        }
    }

    /// The coordinator answered the negotiation that carried our update: `knobs` are in
    /// force from `cycle` on. Returns true once the best knobs are pinned (the session is
    /// over and [`SelfTuner::finish`] should be called).
    pub fn confirmed(&mut self, knobs: Knobs, cycle: u64) -> bool {
        let Pending::Sent(wanted) = self.pending else {
            return false;
        };
        self.pending = Pending::None;
        if knobs != wanted {
            // A control client changed knobs in the same cycle, or the coordinator clamped
            // them: the sample is measured with what is really in force.
            tracing::warn!(
                ?wanted, in_force = ?knobs,
                "self-tuning: the knobs in force differ from the ones asked for"
            );
        }
        if self.pinning.is_some() {
            return true;
        }
        if let Err(e) = self.session.applied(cycle) {
            tracing::error!(error = %e, "self-tuning protocol error; stopping the session");
            self.session.stop();
        }
        self.advance();
        false
    }

    /// One cycle with work (rank 0's statistics).
    pub fn observe(&mut self, stats: &CycleStats) {
        if self.pending != Pending::None || self.pinning.is_some() {
            return;
        }
        if self.session.next_step() != Step::Measure {
            return;
        }
        let window = self.session.observe_cycle(&observation(stats));
        let Some(window) = window else { return };
        // No eBPF in the job: every window is judged undisturbed.
        let wall = self.started.elapsed().as_secs_f64();
        match self.session.judge(&window, None, wall) {
            Ok(Verdict::Sample(i)) => {
                if let Some(s) = self.session.samples().get(i) {
                    tracing::debug!(sample = i, knobs = ?s.knobs, score = s.score,
                        "self-tuning sample");
                }
            }
            Ok(Verdict::Remeasure | Verdict::Repeat) => {}
            Ok(Verdict::Confirmation(i)) => {
                if let Some(c) = self.session.confirmation() {
                    tracing::debug!(window = i, candidate = ?c.windows.get(i).map(|w| w.candidate),
                        kept = ?c.kept, "self-tuning confirmation window");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "self-tuning could not record a sample; stopping");
                self.session.stop();
            }
        }
        self.advance();
    }

    /// The session is over and its best knobs are in force from `cycle` on: logs them and
    /// writes the report on a helper thread, which then publishes `outcome` and marks the
    /// job `done`. Returns that thread and, when the config says to watch, the watch of
    /// the pinned knobs.
    pub fn finish(
        self,
        pinned_at_cycle: u64,
        claims: Arc<TuningClaims>,
        outcome: Arc<Mutex<Option<SelfTuneOutcome>>>,
    ) -> (Option<JoinHandle<()>>, Option<Watcher>) {
        let SelfTuner {
            session,
            config,
            job_id,
            started,
            pinning,
            round,
            ..
        } = self;
        let start = from_tuner(&session.config().start);
        let best = pinning.unwrap_or(start);
        let watcher = config.watch.then(|| Watcher {
            watch: Watch::new(
                WatchConfig {
                    measured_cycles: config.measured_cycles,
                    min_window_us: config.min_window.as_micros() as u64,
                    ..WatchConfig::default()
                },
                pinned_at_cycle,
            ),
            pinned: best,
            start,
            round,
        });
        (
            Self::report(
                session,
                config,
                job_id,
                started,
                best,
                start,
                pinned_at_cycle,
                round,
                claims,
                outcome,
            ),
            watcher,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn report(
        session: TuningSession,
        config: AutotuneConfig,
        job_id: String,
        started: Instant,
        best: Knobs,
        start: Knobs,
        pinned_at_cycle: u64,
        round: usize,
        claims: Arc<TuningClaims>,
        outcome: Arc<Mutex<Option<SelfTuneOutcome>>>,
    ) -> Option<JoinHandle<()>> {
        let wall = started.elapsed();
        let mut result = SelfTuneOutcome {
            start,
            best,
            pinned_at_cycle,
            samples: session.samples().len(),
            speedup_over_start: session.speedup_over_start(),
            wall,
            report: None,
        };
        tracing::info!(
            job_id, round, samples = result.samples, ?best, ?start,
            speedup_over_start = ?result.speedup_over_start,
            kept = ?session.confirmation().and_then(|c| c.kept),
            recheck_lost = session.recheck_lost(),
            wall_s = wall.as_secs_f64(),
            "self-tuning done; the best knobs are pinned"
        );
        let Some(log) = config.log.clone() else {
            publish(&claims, &outcome, result);
            return None;
        };
        let spawned = std::thread::Builder::new()
            .name("ringwatch-autotune-report".into())
            .spawn({
                let (claims, outcome) = (claims.clone(), outcome.clone());
                let result = result.clone();
                move || {
                    let mut result = result;
                    match write(&session, &log, &job_id, round) {
                        Ok(files) => {
                            tracing::info!(csv = %files.0.display(), parquet = %files.1.display(),
                                html = %files.2.display(), "self-tuning report written");
                            result.report = Some(files.0);
                        }
                        Err(e) => tracing::error!(error = %e, "self-tuning report not written"),
                    }
                    publish(&claims, &outcome, result);
                }
            });
        match spawned {
            Ok(handle) => Some(handle),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the report thread; no report written");
                result.report = None;
                publish(&claims, &outcome, result);
                None
            }
        }
    }

    /// The session was cut short (the job shuts down): logs what it had.
    pub fn abandon(self) {
        tracing::warn!(
            samples = self.session.samples().len(),
            budget = self.config.budget,
            "the job ended before self-tuning finished; no report written"
        );
    }
}

fn publish(
    claims: &TuningClaims,
    outcome: &Mutex<Option<SelfTuneOutcome>>,
    result: SelfTuneOutcome,
) {
    if let Ok(mut o) = outcome.lock() {
        *o = Some(result);
    }
    claims.end_self_tuning(true);
}

/// Writes the report beside `log` (`PATH.csv` -> `PATH.csv`, `PATH.parquet`, `PATH.html`).
/// Round n > 0 (a re-check) writes `PATH-recheckN.*`.
fn write(
    session: &TuningSession,
    log: &Path,
    job_id: &str,
    round: usize,
) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let dir = match log.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let stem = log
        .file_stem()
        .ok_or_else(|| format!("RINGWATCH_AUTOTUNE_LOG={} names no file", log.display()))?
        .to_string_lossy()
        .into_owned();
    let stem = if round == 0 {
        stem
    } else {
        format!("{stem}-recheck{round}")
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let title = if round == 0 {
        format!("Self-tuning of job {job_id}")
    } else {
        format!("Self-tuning of job {job_id}: re-check {round}")
    };
    let files = write_report(&session.report_data(), &dir, &stem, &title)
        .map_err(|e| format!("writing the report {}/{stem}.*: {e}", dir.display()))?;
    Ok((files.csv, files.parquet, files.html))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_convert_both_ways() {
        let k = Knobs {
            fusion_threshold_bytes: 16 << 20,
            cycle_time_us: 2500,
            hierarchical_allreduce: true,
        };
        let t = to_tuner(&k);
        assert_eq!(t.cycle_time_ms, 2.5);
        assert_eq!(from_tuner(&t), k);
        let t = CollectiveKnobs {
            fusion_threshold_bytes: 0,
            cycle_time_ms: 0.73449,
            hierarchical_allreduce: false,
        };
        assert_eq!(from_tuner(&t).cycle_time_us, 734);
    }
}
