//! Per-cycle statistics: what a cycle moved, sent to the control socket's subscribers
//! and to a self-tuning session when someone reads them.
//!
//! It must never change what a cycle does: it only counts and reports.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::cycle::{CycleThread, Work};
use crate::control::{CycleStats, STATS_EVERY_US};
use crate::timeline::now_us;

impl CycleThread {
    /// Counts the cycle's `work` and reports its statistics when someone reads them.
    pub(super) fn account(&mut self, work: &Work, cycle: u64, cycle_start: Instant) {
        self.shared
            .bytes_reduced
            .fetch_add(work.bytes_reduced, Ordering::Relaxed);
        if work.tensors > 0
            && (self.server.as_ref().is_some_and(|s| s.wants_stats()) || self.self_tuning())
        {
            // The wall clock of the cycle's start, read only for the statistics.
            let duration_us = cycle_start.elapsed().as_micros() as u64;
            let (late, tensors_waited) = self
                .coordinator
                .as_mut()
                .map(|c| c.take_late())
                .unwrap_or_default();
            let stats = CycleStats {
                cycle,
                start_unix_us: now_us().saturating_sub(duration_us),
                duration_us,
                bytes_reduced: work.bytes_reduced,
                bytes_total: work.bytes_total,
                tensors: work.tensors,
                fused_buffers: work.buffers,
                knobs: self.knobs,
                late,
                tensors_waited,
                steps: self
                    .shared
                    .steps
                    .lock()
                    .map(|mut s| std::mem::take(&mut *s))
                    .unwrap_or_default(),
            };
            self.report_stats(stats, cycle_start);
        }
    }

    /// Reports a cycle's statistics to the socket's subscribers and the self-tuner, at
    /// most once per [`STATS_EVERY_US`]: a cycle that comes sooner is added to the
    /// held ones (with the same knobs; a knob change sends what is held first). A job
    /// whose callers run a cycle per small call runs hundreds of thousands a second,
    /// which no reader keeps up with.
    pub(super) fn report_stats(&mut self, stats: CycleStats, cycle_start: Instant) {
        let stats = match self.stats_held.take() {
            Some(mut held) if held.knobs == stats.knobs => {
                held.absorb(&stats);
                held
            }
            Some(held) => {
                self.send_stats(&held);
                stats
            }
            None => stats,
        };
        let due = self.stats_sent_at.is_none_or(|at| {
            cycle_start.saturating_duration_since(at) >= Duration::from_micros(STATS_EVERY_US)
        });
        if due {
            self.send_stats(&stats);
            self.stats_sent_at = Some(cycle_start);
        } else {
            self.stats_held = Some(stats);
        }
    }

    pub(super) fn send_stats(&mut self, stats: &CycleStats) {
        if let Some(server) = &self.server {
            server.publish_stats(stats);
        }
        #[cfg(feature = "autotune")]
        if let Some(d) = self.autotune.as_mut() {
            if let Some(t) = d.tuner.as_mut() {
                t.observe(stats);
            } else if let Some(w) = d.watcher.as_mut() {
                let changed = w.observe(stats);
                if let Ok(mut published) = self.shared.watch.lock() {
                    *published = changed.is_none().then(|| w.status());
                }
                let Some(context) = changed else { return };
                // The pinned knobs' throughput moved: re-check them (and tune again
                // if they lost), unless an agent holds the tuning now.
                let recheck = d.watcher.take().map(|w| w.recheck_of());
                if let Some(recheck) = recheck {
                    if self.shared.claims.resume_self_tuning() {
                        match super::selftune::SelfTuner::recheck(
                            &d.config, recheck, &d.job_id, context,
                        ) {
                            Ok(t) => d.tuner = Some(t),
                            Err(e) => {
                                tracing::error!(error = %e, "cannot start the re-check");
                                self.shared.claims.end_self_tuning(false);
                            }
                        }
                    } else {
                        tracing::info!(
                            "the throughput changed but the tuning is no longer rank 0's \
                             (an agent holds it): no re-check"
                        );
                    }
                }
            }
        }
    }

    /// Whether rank 0 runs a self-tuning session now, or watches the knobs one pinned:
    /// either way it needs the per-cycle statistics.
    pub(super) fn self_tuning(&self) -> bool {
        #[cfg(feature = "autotune")]
        return self
            .autotune
            .as_ref()
            .is_some_and(|d| d.tuner.is_some() || d.watcher.is_some());
        #[cfg(not(feature = "autotune"))]
        false
    }
}
