//! The job's knobs on the wire ([`Knobs`], cycle time in µs) and the tuner's
//! ([`CollectiveKnobs`], cycle time in ms), converted here and nowhere else.
//!
//! It must never round a knob anywhere but here, nor talk to a job.

use collectives::control::{KnobUpdate, Knobs};
use tuner::space::CollectiveKnobs;

/// The tuner's view of the job's knobs (cycle time in ms).
pub fn to_tuner_knobs(knobs: &Knobs) -> CollectiveKnobs {
    CollectiveKnobs {
        fusion_threshold_bytes: knobs.fusion_threshold_bytes,
        cycle_time_ms: knobs.cycle_time_us as f64 / 1_000.0,
        hierarchical_allreduce: knobs.hierarchical_allreduce,
    }
}

/// The wire's knobs for the tuner's (cycle time rounded to whole µs, at
/// least 1 µs).
pub fn to_wire_knobs(knobs: &CollectiveKnobs) -> Knobs {
    let cycle_time_us = if knobs.cycle_time_ms.is_finite() {
        (knobs.cycle_time_ms * 1_000.0).round().max(1.0) as u64
    } else {
        collectives::control::DEFAULT_CYCLE_TIME_US
    };
    Knobs {
        fusion_threshold_bytes: knobs.fusion_threshold_bytes,
        cycle_time_us,
        hierarchical_allreduce: knobs.hierarchical_allreduce,
    }
}

pub(super) fn full_update(knobs: &Knobs) -> KnobUpdate {
    KnobUpdate {
        fusion_threshold_bytes: Some(knobs.fusion_threshold_bytes),
        cycle_time_us: Some(knobs.cycle_time_us),
        hierarchical_allreduce: Some(knobs.hierarchical_allreduce),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_convert_both_ways() {
        let wire = Knobs {
            fusion_threshold_bytes: 8 << 20,
            cycle_time_us: 2_500,
            hierarchical_allreduce: true,
        };
        let tuner = to_tuner_knobs(&wire);
        assert_eq!(tuner.cycle_time_ms, 2.5);
        assert_eq!(to_wire_knobs(&tuner), wire);
        let odd = CollectiveKnobs {
            fusion_threshold_bytes: 0,
            cycle_time_ms: 0.6004,
            hierarchical_allreduce: false,
        };
        assert_eq!(to_wire_knobs(&odd).cycle_time_us, 600);
    }
}
