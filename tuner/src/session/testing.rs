//! A pretend job and a driver, for the session's tests and the report's.
//!
//! It must never be built outside tests.

use super::{CycleObservation, FixedKnobs, KnobBounds, SessionConfig, Step, TuningSession};
use crate::space::CollectiveKnobs;

/// A pretend job: throughput is a known function of the knobs, the
/// clock advances with each cycle.
pub(crate) struct FakeJob {
    pub(crate) cycle: u64,
    pub(crate) now_us: u64,
    pub(crate) knobs: CollectiveKnobs,
}

impl FakeJob {
    /// A job at `cycle`, at time 0, on the default knobs.
    pub(crate) fn new(cycle: u64) -> Self {
        FakeJob {
            cycle,
            now_us: 0,
            knobs: CollectiveKnobs::default(),
        }
    }

    /// Bytes per second of these knobs: best at 16 MiB, 2 ms,
    /// hierarchical.
    pub(crate) fn rate(knobs: &CollectiveKnobs) -> f64 {
        let f = (knobs.fusion_threshold_bytes.max(1024) as f64).log2() - 24.0;
        let c = knobs.cycle_time_ms.log2() - 1.0;
        let h = if knobs.hierarchical_allreduce {
            1.5
        } else {
            1.0
        };
        1e9 * h / (1.0 + 0.05 * f * f + 0.1 * c * c)
    }

    pub(crate) fn next_cycle(&mut self) -> CycleObservation {
        self.cycle += 1;
        let duration_us = 10_000;
        let bytes = (Self::rate(&self.knobs) * duration_us as f64 / 1e6) as u64;
        let c = CycleObservation {
            cycle: self.cycle,
            start_unix_us: self.now_us,
            duration_us,
            bytes_reduced: bytes,
            ..Default::default()
        };
        self.now_us += duration_us;
        c
    }
}

pub(crate) fn config() -> SessionConfig {
    SessionConfig {
        budget: 12,
        warmup_cycles: 2,
        measured_cycles: 5,
        min_window_us: 0,
        ..SessionConfig::default()
    }
}

/// `config()` with the fusion threshold fixed at 0 and the cycle time
/// searched in 1–4 ms.
pub(crate) fn fusion_fixed_config() -> SessionConfig {
    SessionConfig {
        bounds: KnobBounds {
            cycle_time_ms: Some((1.0, 4.0)),
            fusion_threshold_bytes: None,
        },
        fixed: FixedKnobs {
            fusion_threshold_bytes: Some(0),
            ..FixedKnobs::default()
        },
        ..config()
    }
}

/// Drives a session against the fake job; `disturb(sample, window)` says
/// which windows were disturbed.
pub(crate) fn drive(
    session: &mut TuningSession,
    job: &mut FakeJob,
    mut disturb: impl FnMut(usize, u64) -> Option<String>,
) {
    let mut windows = 0;
    for _ in 0..100_000 {
        match session.next_step() {
            Step::Apply(knobs) => {
                job.knobs = knobs;
                session.applied(job.cycle + 1).unwrap();
            }
            Step::Measure => {
                let c = job.next_cycle();
                if let Some(w) = session.observe_cycle(&c) {
                    windows += 1;
                    let d = disturb(session.samples().len(), windows);
                    session.judge(&w, d, windows as f64).unwrap();
                }
            }
            Step::Done => return,
        }
    }
    panic!("the session never ended");
}
