//! The session's protocol driven against a pretend job ([`super::testing`]).

use super::testing::*;
use super::*;

#[test]
fn scores_windows_exactly_and_pins_a_near_optimal_point() {
    let mut session = TuningSession::new(config()).unwrap();
    let mut job = FakeJob::new(100);
    drive(&mut session, &mut job, |_, _| None);
    let samples = session.samples();
    assert!(!samples.is_empty() && samples.len() <= 12);
    assert_eq!(samples[0].knobs, config().start, "sample 0 is the start");
    for s in samples {
        // Every cycle of the window ran with the sample's knobs at a
        // constant rate, so the score is that rate (to integer bytes).
        let expected = FakeJob::rate(&s.knobs);
        assert!(
            (s.score - expected).abs() / expected < 1e-6,
            "score {} vs rate {expected}",
            s.score
        );
        assert_eq!(s.window.cycles, 6);
        assert!(s.disturbed.is_none() && s.noise_hint.is_none());
    }
    let best = session.best().unwrap();
    let optimum = FakeJob::rate(&CollectiveKnobs {
        fusion_threshold_bytes: 16 << 20,
        cycle_time_ms: 2.0,
        hierarchical_allreduce: true,
    });
    assert!(best.knobs.hierarchical_allreduce);
    assert!(FakeJob::rate(&best.knobs) > 0.9 * optimum);
    assert!(session.speedup_over_start().unwrap() > 1.3);
    assert_eq!(session.next_step(), Step::Done);
}

#[test]
fn skips_warmup_and_cycles_of_old_knobs() {
    let mut session = TuningSession::new(config()).unwrap();
    assert!(matches!(session.next_step(), Step::Apply(_)));
    session.applied(10).unwrap();
    let cycle = |n: u64, bytes: u64| CycleObservation {
        cycle: n,
        start_unix_us: n * 1000,
        duration_us: 100,
        bytes_reduced: bytes,
        ..Default::default()
    };
    // Old knobs, then 2 warm-up cycles: all ignored (huge bytes).
    for n in [8, 9, 10, 11] {
        assert!(session.observe_cycle(&cycle(n, u64::MAX / 16)).is_none());
    }
    let mut window = None;
    for n in 12..=17 {
        window = session.observe_cycle(&cycle(n, 1000));
    }
    let w = window.expect("5 intervals complete the window");
    assert_eq!((w.first_cycle, w.last_cycle, w.cycles), (12, 17, 6));
    assert_eq!(w.bytes_reduced, 5000);
    // 5000 bytes over 5 ms.
    assert!((w.score - 1e6).abs() < 1e-6);
    // Nothing more is taken until it is judged.
    assert!(session.observe_cycle(&cycle(18, 1000)).is_none());
    assert!(
        session
            .judge(&Window { score: 1.0, ..w }, None, 0.0)
            .is_err()
    );
    // The start is measured on a second window.
    assert_eq!(session.judge(&w, None, 0.0).unwrap(), Verdict::Repeat);
}

#[test]
fn a_disturbed_window_is_measured_again_once() {
    let mut session = TuningSession::new(SessionConfig {
        budget: 3,
        ..config()
    })
    .unwrap();
    let mut job = FakeJob::new(0);
    // Sample 0: first window disturbed, second clean. Sample 1: both
    // disturbed. Sample 2: clean.
    drive(&mut session, &mut job, |sample, _| match sample {
        0 | 1 => Some(format!("retransmits during sample {sample}")),
        _ => None,
    });
    let s = session.samples();
    assert_eq!(s.len(), 3);
    assert_eq!(
        s[0].remeasured_because.as_deref(),
        Some("retransmits during sample 0")
    );
    assert!(s[0].noise_hint.is_some(), "both windows disturbed → hint");
    assert_eq!(
        s[0].disturbed.as_deref(),
        Some("retransmits during sample 0")
    );
    assert!(s[2].disturbed.is_none() && s[2].remeasured_because.is_none());
    // The hint is at least 10% of the score even when both agree.
    assert!(s[0].noise_hint.unwrap() >= 0.1 * s[0].score - 1e-9);
}

#[test]
fn a_clean_remeasure_is_kept_without_a_hint() {
    let mut session = TuningSession::new(SessionConfig {
        budget: 2,
        ..config()
    })
    .unwrap();
    let mut job = FakeJob::new(0);
    drive(&mut session, &mut job, |_, window| {
        (window == 1).then(|| "run-queue wait".to_owned())
    });
    let s = session.samples();
    assert_eq!(s[0].remeasured_because.as_deref(), Some("run-queue wait"));
    assert!(s[0].disturbed.is_none() && s[0].noise_hint.is_none());
    assert!(s[1].remeasured_because.is_none());
}

#[test]
fn fixed_knobs_and_bounds_are_respected() {
    let mut session = TuningSession::new(fusion_fixed_config()).unwrap();
    assert_eq!(session.space().dims().len(), 2);
    let mut job = FakeJob::new(0);
    drive(&mut session, &mut job, |_, _| None);
    for s in session.samples() {
        assert_eq!(s.knobs.fusion_threshold_bytes, 0);
        assert!(
            (1.0..=4.0).contains(&s.knobs.cycle_time_ms),
            "{:?}",
            s.knobs
        );
    }
}

#[test]
fn refuses_configurations_that_cannot_work() {
    let all_fixed = SessionConfig {
        fixed: FixedKnobs {
            fusion_threshold_bytes: Some(1 << 20),
            cycle_time_ms: Some(1.0),
            hierarchical_allreduce: Some(false),
        },
        ..config()
    };
    assert!(TuningSession::new(all_fixed).is_err());
    assert!(
        TuningSession::new(SessionConfig {
            budget: 0,
            ..config()
        })
        .is_err()
    );
    let bad_bounds = SessionConfig {
        bounds: KnobBounds {
            cycle_time_ms: Some((5.0, 2.0)),
            ..KnobBounds::default()
        },
        ..config()
    };
    assert!(TuningSession::new(bad_bounds).is_err());
    let mut session = TuningSession::new(config()).unwrap();
    session.applied(0).unwrap();
    assert!(session.applied(0).is_err(), "applied twice");
}

#[test]
fn stop_ends_the_session_and_keeps_the_samples() {
    let mut session = TuningSession::new(config()).unwrap();
    let mut job = FakeJob::new(0);
    drive(&mut session, &mut job, |_, _| None);
    let n = session.samples().len();
    session.stop();
    assert_eq!(session.next_step(), Step::Done);
    assert!(session.was_stopped());
    assert_eq!(session.samples().len(), n);
}

#[test]
fn the_start_keeps_the_faster_of_two_windows() {
    let mut session = TuningSession::new(config()).unwrap();
    session.applied(1).unwrap();
    let mut at = 0;
    // Two warm-up cycles, then a window of 6 cycles 1000 bytes each, 1 ms
    // apart; then one at 2 ms apart (a disturbance nobody reported).
    let mut window = |session: &mut TuningSession, gap_us: u64| {
        let mut out = None;
        for _ in 0..8 {
            at += 1;
            let c = CycleObservation {
                cycle: at,
                start_unix_us: at * gap_us,
                duration_us: 10,
                bytes_reduced: 1000,
                ..Default::default()
            };
            out = out.or(session.observe_cycle(&c));
        }
        out.expect("a window")
    };
    let fast = window(&mut session, 1000);
    assert_eq!(session.judge(&fast, None, 1.0).unwrap(), Verdict::Repeat);
    let slow = window(&mut session, 2000);
    assert_eq!(session.judge(&slow, None, 2.0).unwrap(), Verdict::Sample(0));
    let s = &session.samples()[0];
    assert_eq!(s.score, fast.score);
    assert_eq!(s.window, fast);
    assert!((fast.score - 1e6).abs() < 1e-6 && (slow.score - 5e5).abs() < 1e-6);
}

#[test]
fn sub_windows_score_by_their_median_rate() {
    // 9 intervals of 1 ms, 1000 bytes each, but the middle three took
    // 10 ms each (a disturbance): the overall rate is dragged down, the
    // median of three runs is not.
    let mut t = 0;
    let cycles: Vec<CycleObservation> = (0..10u64)
        .map(|i| {
            let c = CycleObservation {
                cycle: i,
                start_unix_us: t,
                duration_us: 10,
                bytes_reduced: 1000,
                ..Default::default()
            };
            t += if (3..6).contains(&i) { 10_000 } else { 1000 };
            c
        })
        .collect();
    assert_eq!(sub_window_median(&cycles, 3), Some(1e6));
    assert_eq!(sub_window_median(&cycles, 1), None);
    assert_eq!(sub_window_median(&cycles[..3], 3), None);
    let mut session = TuningSession::new(SessionConfig {
        sub_windows: 3,
        measured_cycles: 9,
        warmup_cycles: 0,
        ..config()
    })
    .unwrap();
    session.applied(0).unwrap();
    let w = cycles
        .iter()
        .find_map(|c| session.observe_cycle(c))
        .expect("9 intervals make a window");
    assert_eq!(w.score, 1e6);
    assert!((w.overall_score - 9000.0 / 0.036).abs() < 1e-6);
}

/// A job whose knobs other than the start lose half their speed once
/// `slow_after` samples are in (conditions changed under the session).
fn drive_changing(session: &mut TuningSession, slow_after: usize) {
    let start = session.config().start;
    let mut job = FakeJob::new(0);
    let mut slowed = false;
    for _ in 0..100_000 {
        match session.next_step() {
            Step::Apply(knobs) => {
                job.knobs = knobs;
                session.applied(job.cycle + 1).unwrap();
                slowed = session.samples().len() >= slow_after && knobs != start;
            }
            Step::Measure => {
                let mut c = job.next_cycle();
                if slowed {
                    c.bytes_reduced /= 2;
                }
                if let Some(w) = session.observe_cycle(&c) {
                    session.judge(&w, None, 0.0).unwrap();
                }
            }
            Step::Done => return,
        }
    }
    panic!("the session never ended");
}

#[test]
fn the_choice_is_confirmed_against_the_start_before_it_is_pinned() {
    // Nothing changes: hierarchical is 1.5× the start, so one window of
    // each settles it.
    let mut session = TuningSession::new(config()).unwrap();
    drive_changing(&mut session, usize::MAX);
    let c = session.confirmation().expect("the choice is not the start");
    assert_eq!(c.kept, Some(Candidate::Choice));
    let order: Vec<Candidate> = c.windows.iter().map(|w| w.candidate).collect();
    assert_eq!(order, [Candidate::Choice, Candidate::Start]);
    assert_eq!(session.best().unwrap().knobs, c.choice);
    let speedup = session.speedup_over_start().unwrap();
    assert!((speedup - c.choice_median.unwrap() / c.start_median.unwrap()).abs() < 1e-12);
    assert!(speedup > 1.3);

    // The choice halves once the budget is spent: the start is kept,
    // after all the windows (interleaved) it is owed.
    let mut session = TuningSession::new(config()).unwrap();
    drive_changing(&mut session, config().budget);
    let c = session.confirmation().expect("the choice is not the start");
    assert_eq!(c.kept, Some(Candidate::Start));
    assert_eq!(c.windows.len(), 2 * config().confirm_windows);
    assert!(c.windows.iter().enumerate().all(|(i, w)| w.candidate
        == if i % 2 == 0 {
            Candidate::Choice
        } else {
            Candidate::Start
        }));
    let best = session.best().unwrap();
    assert_eq!((best.knobs, best.sample), (config().start, 0));
    assert_eq!(session.speedup_over_start(), Some(1.0));
}

#[test]
fn without_confirmation_the_models_choice_is_pinned() {
    let mut session = TuningSession::new(SessionConfig {
        confirm_windows: 0,
        ..config()
    })
    .unwrap();
    drive_changing(&mut session, config().budget);
    assert!(session.confirmation().is_none());
    assert!(session.best().unwrap().knobs.hierarchical_allreduce);
}

#[test]
fn a_recheck_keeps_knobs_that_still_win_without_tuning_again() {
    let pinned = CollectiveKnobs {
        fusion_threshold_bytes: 16 << 20,
        cycle_time_ms: 2.0,
        hierarchical_allreduce: true,
    };
    let mut session = TuningSession::new(SessionConfig {
        recheck: Some(pinned),
        ..config()
    })
    .unwrap();
    let mut job = FakeJob::new(0);
    drive(&mut session, &mut job, |_, _| None);
    assert_eq!(
        session.samples().len(),
        2,
        "the start, then the pinned knobs"
    );
    assert_eq!(session.samples()[1].knobs, pinned);
    assert!(!session.recheck_lost());
    assert_eq!(
        session.confirmation().unwrap().kept,
        Some(Candidate::Choice)
    );
    assert_eq!(session.best().unwrap().knobs, pinned);
}

#[test]
fn a_recheck_that_loses_tunes_again() {
    let stale = CollectiveKnobs {
        fusion_threshold_bytes: 0,
        cycle_time_ms: 50.0,
        hierarchical_allreduce: false,
    };
    let mut session = TuningSession::new(SessionConfig {
        recheck: Some(stale),
        ..config()
    })
    .unwrap();
    let mut job = FakeJob::new(0);
    drive(&mut session, &mut job, |_, _| None);
    assert!(session.recheck_lost());
    assert_eq!(session.samples()[1].knobs, stale);
    assert!(session.samples().len() > 2, "it tuned again");
    let best = session.best().unwrap();
    assert_ne!(best.knobs, stale);
    assert!(FakeJob::rate(&best.knobs) > FakeJob::rate(&config().start));
}

/// A job whose steps end every `step_us(knobs)` µs while its cycles move
/// bytes at [`FakeJob::rate`]: the two disagree on the best knobs.
struct SteppingJob {
    job: FakeJob,
    /// When the next step ends, µs.
    next_step_us: u64,
}

impl SteppingJob {
    /// Step time: best at a 1 ms cycle time (bytes are best at 2 ms).
    fn step_us(knobs: &CollectiveKnobs) -> u64 {
        let c = knobs.cycle_time_ms.log2();
        (100_000.0 * (1.0 + 0.2 * c * c)) as u64
    }

    fn next_cycle(&mut self) -> CycleObservation {
        let mut c = self.job.next_cycle();
        let end = c.start_unix_us + c.duration_us;
        let step_us = Self::step_us(&self.job.knobs);
        // A step of new knobs starts with them.
        self.next_step_us = self.next_step_us.min(c.start_unix_us + step_us);
        while self.next_step_us < end {
            c.steps.mark(self.next_step_us);
            self.next_step_us += step_us;
        }
        c
    }
}

#[test]
fn a_job_that_marks_its_steps_is_tuned_for_steps_per_second() {
    // Its first window (at least 3 × 50 ms while no step was seen) holds its
    // first mark: the start's steps are 100 ms long.
    let mut session = TuningSession::new(SessionConfig {
        min_window_us: 50_000,
        ..config()
    })
    .unwrap();
    let mut job = SteppingJob {
        job: FakeJob::new(100),
        next_step_us: u64::MAX,
    };
    for _ in 0..100_000 {
        match session.next_step() {
            Step::Apply(knobs) => {
                job.job.knobs = knobs;
                job.next_step_us = u64::MAX;
                session.applied(job.job.cycle + 1).unwrap();
            }
            Step::Measure => {
                let c = job.next_cycle();
                if let Some(w) = session.observe_cycle(&c) {
                    session.judge(&w, None, 0.0).unwrap();
                }
            }
            Step::Done => break,
        }
    }
    assert_eq!(session.next_step(), Step::Done);
    assert_eq!(session.objective(), Some(Objective::StepsPerSecond));
    assert_eq!(
        session.report_data().objective,
        Some(Objective::StepsPerSecond)
    );
    for s in session.samples() {
        // Whole steps of one length: the score is exactly one over it.
        let expected = 1e6 / SteppingJob::step_us(&s.knobs) as f64;
        assert!(
            (s.score - expected).abs() / expected < 1e-9,
            "score {} vs {expected} steps/s",
            s.score
        );
        assert!(s.window.steps >= config().min_window_steps);
        assert_eq!(s.window.objective, Objective::StepsPerSecond);
    }
    // The pick is near the steps' optimum (1 ms), not the bytes' (2 ms).
    let best = session.best().unwrap();
    let optimum = 1e6 / 100_000.0;
    let picked = 1e6 / SteppingJob::step_us(&best.knobs) as f64;
    assert!(
        picked > 0.95 * optimum,
        "picked {picked} steps/s of {optimum}"
    );
}

#[test]
fn a_job_that_marks_no_steps_is_tuned_for_bytes_per_second() {
    let mut session = TuningSession::new(config()).unwrap();
    let mut job = FakeJob::new(100);
    drive(&mut session, &mut job, |_, _| None);
    assert_eq!(session.objective(), Some(Objective::BytesPerSecond));
    assert!(session.samples().iter().all(|s| s.window.steps == 0));
}

#[test]
fn a_window_scored_by_steps_waits_for_whole_steps() {
    let mut session = TuningSession::new(SessionConfig {
        warmup_cycles: 0,
        min_window_steps: 3,
        ..config()
    })
    .unwrap();
    assert!(matches!(session.next_step(), Step::Apply(_)));
    session.applied(1).unwrap();
    // Cycles every 10 ms; a step ends 5 ms into every 10th cycle, from the 3rd.
    let mut window = None;
    for n in 1..=200u64 {
        let mut c = CycleObservation {
            cycle: n,
            start_unix_us: n * 10_000,
            duration_us: 1_000,
            bytes_reduced: 1_000,
            ..Default::default()
        };
        if n % 10 == 3 {
            c.steps.mark(n * 10_000 + 5_000);
        }
        if let Some(w) = session.observe_cycle(&c) {
            window = Some((n, w));
            break;
        }
    }
    let (n, w) = window.expect("a window");
    // Marks at cycles 3, 13, 23 and 33: three whole steps, at the 33rd (5
    // intervals were enough long before).
    assert_eq!(
        (n, w.steps, w.objective),
        (33, 3, Objective::StepsPerSecond)
    );
    // 100 ms a step.
    assert!((w.score - 10.0).abs() < 1e-9 && (w.overall_score - 10.0).abs() < 1e-9);
}

#[test]
fn step_durations_split_a_cycle_with_several_marks_evenly() {
    let marks = |count, first_unix_us, last_unix_us| CycleObservation {
        steps: StepMarks {
            count,
            first_unix_us,
            last_unix_us,
        },
        ..Default::default()
    };
    let cycles = [
        marks(1, 100, 100),
        marks(0, 0, 0),
        marks(3, 300, 500),
        marks(1, 900, 900),
    ];
    assert_eq!(
        window::step_durations(&cycles),
        vec![200.0, 100.0, 100.0, 400.0]
    );
    // A mark before the previous one (a clock step) is no step.
    assert_eq!(
        window::step_durations(&[marks(1, 500, 500), marks(1, 400, 400)]),
        Vec::<f64>::new()
    );
}
