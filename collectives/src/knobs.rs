//! Initial knob values and timeouts from the environment.
//!
//! Reads `RINGWATCH_*` variables first, then Horovod's names for people who come from
//! Horovod. Only parses; it must never apply a knob (the coordinator does, at a cycle
//! boundary).

use std::time::Duration;

use crate::control::Knobs;
use crate::error::{CollectiveError, Result};

/// Default time a rank waits on a silent peer before failing: 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

fn first_set(get: &dyn Fn(&str) -> Option<String>, names: &[&str]) -> Option<(String, String)> {
    names.iter().find_map(|n| {
        get(n)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (n.to_string(), v))
    })
}

fn bad(name: &str, value: &str, want: &str) -> CollectiveError {
    CollectiveError::Config(format!("{name}={value:?} is not {want}"))
}

/// Parses a boolean the way launchers write them: 1/0, true/false, yes/no, on/off.
pub fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(bad(name, value, "a boolean (1/0, true/false)")),
    }
}

/// Knobs from variables looked up with `get` (the environment, or a map in tests):
/// `RINGWATCH_FUSION_THRESHOLD` / `HOROVOD_FUSION_THRESHOLD` (bytes),
/// `RINGWATCH_CYCLE_TIME_MS` / `HOROVOD_CYCLE_TIME` (milliseconds, fractions allowed),
/// `RINGWATCH_HIERARCHICAL_ALLREDUCE` / `HOROVOD_HIERARCHICAL_ALLREDUCE` (boolean).
pub fn knobs_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Knobs> {
    let mut knobs = Knobs::default();
    if let Some((name, v)) = first_set(
        get,
        &["RINGWATCH_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"],
    ) {
        knobs.fusion_threshold_bytes = v
            .trim()
            .parse()
            .map_err(|_| bad(&name, &v, "a number of bytes"))?;
    }
    if let Some((name, v)) = first_set(get, &["RINGWATCH_CYCLE_TIME_MS", "HOROVOD_CYCLE_TIME"]) {
        let ms: f64 = v
            .trim()
            .parse()
            .map_err(|_| bad(&name, &v, "milliseconds"))?;
        if !(0.0..=60_000.0).contains(&ms) {
            return Err(bad(&name, &v, "between 0 and 60000 milliseconds"));
        }
        knobs.cycle_time_us = (ms * 1000.0).round() as u64;
    }
    if let Some((name, v)) = first_set(
        get,
        &[
            "RINGWATCH_HIERARCHICAL_ALLREDUCE",
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
        ],
    ) {
        knobs.hierarchical_allreduce = parse_bool(&name, &v)?;
    }
    Ok(knobs)
}

/// Knobs from the process environment (see [`knobs_from`]).
pub fn knobs_from_env() -> Result<Knobs> {
    knobs_from(&|n| std::env::var(n).ok())
}

/// The peer timeout from `RINGWATCH_TIMEOUT_SECS` (seconds, fractions allowed), or
/// [`DEFAULT_TIMEOUT`].
pub fn timeout_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Duration> {
    match first_set(get, &["RINGWATCH_TIMEOUT_SECS"]) {
        None => Ok(DEFAULT_TIMEOUT),
        Some((name, v)) => {
            let secs: f64 = v.trim().parse().map_err(|_| bad(&name, &v, "seconds"))?;
            if !(secs > 0.0 && secs < 1e7) {
                return Err(bad(&name, &v, "a positive number of seconds"));
            }
            Ok(Duration::from_secs_f64(secs))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::vars;

    #[test]
    fn defaults_are_horovods() {
        let k = knobs_from(&vars(&[])).unwrap();
        assert_eq!(k.fusion_threshold_bytes, 64 << 20);
        assert_eq!(k.cycle_time_us, 1000);
        assert!(!k.hierarchical_allreduce);
        assert_eq!(timeout_from(&vars(&[])).unwrap(), DEFAULT_TIMEOUT);
    }

    #[test]
    fn ringwatch_names_win_over_horovod_names() {
        let k = knobs_from(&vars(&[
            ("HOROVOD_FUSION_THRESHOLD", "1024"),
            ("RINGWATCH_FUSION_THRESHOLD", "2048"),
            ("HOROVOD_CYCLE_TIME", "2.5"),
            ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
        ]))
        .unwrap();
        assert_eq!(k.fusion_threshold_bytes, 2048);
        assert_eq!(k.cycle_time_us, 2500);
        assert!(k.hierarchical_allreduce);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = knobs_from(&vars(&[("RINGWATCH_CYCLE_TIME_MS", "fast")])).unwrap_err();
        assert!(err.to_string().contains("RINGWATCH_CYCLE_TIME_MS"), "{err}");
        let err = timeout_from(&vars(&[("RINGWATCH_TIMEOUT_SECS", "-1")])).unwrap_err();
        assert!(err.to_string().contains("RINGWATCH_TIMEOUT_SECS"), "{err}");
    }
}
