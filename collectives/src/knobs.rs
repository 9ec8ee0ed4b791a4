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

/// Horovod's default response-cache capacity (`HOROVOD_CACHE_CAPACITY`): enough for the
/// gradients of the models people train (ResNet-50 has 161, BERT-large about 400).
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;

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

/// The unit of a duration variable's bare number (its name's `_SECS` or `_MS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BareUnit {
    /// A bare number is seconds.
    Seconds,
    /// A bare number is milliseconds.
    Milliseconds,
}

/// Parses a duration variable's value: a number with a unit (`500ms`, `2.5s`,
/// `1m`, `250us`; also `ns`, `min`, `h`), as the agent's flags take them, or a
/// bare number in the unit the variable's name says (`bare`). Fractions are
/// allowed; negative, infinite and unit-less-but-garbled values are refused,
/// naming the variable.
pub fn parse_duration(name: &str, value: &str, bare: BareUnit) -> Result<Duration> {
    let v = value.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+' || c == 'e'))
        .unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let want = match bare {
        BareUnit::Seconds => "a duration (`30s`, `500ms`, or a bare number of seconds)",
        BareUnit::Milliseconds => "a duration (`5ms`, `0.5s`, or a bare number of milliseconds)",
    };
    let number: f64 = number.parse().map_err(|_| bad(name, value, want))?;
    let unit_secs = match (unit.trim(), bare) {
        ("", BareUnit::Seconds) | ("s", _) => 1.0,
        ("", BareUnit::Milliseconds) | ("ms", _) => 1e-3,
        ("us" | "µs", _) => 1e-6,
        ("ns", _) => 1e-9,
        ("m" | "min", _) => 60.0,
        ("h", _) => 3600.0,
        _ => return Err(bad(name, value, want)),
    };
    let secs = number * unit_secs;
    if !(secs.is_finite() && (0.0..1e7).contains(&secs)) {
        return Err(bad(name, value, want));
    }
    Ok(Duration::from_secs_f64(secs))
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
        let cycle = parse_duration(&name, &v, BareUnit::Milliseconds)?;
        if cycle > Duration::from_secs(60) {
            return Err(bad(&name, &v, "at most 60 s (60000 milliseconds)"));
        }
        knobs.cycle_time_us = (cycle.as_secs_f64() * 1e6).round() as u64;
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

/// How a job asked to be auto-tuned (`RINGWATCH_AUTOTUNE=1`); see [`autotune_from`].
#[derive(Clone, Debug, PartialEq)]
pub struct AutotuneConfig {
    /// How long rank 0 waits for an agent to claim the tuning before tuning itself
    /// (`RINGWATCH_AUTOTUNE_WAIT_SECS`, default 5).
    pub wait: Duration,
    /// Samples of a self-tuning session (`RINGWATCH_AUTOTUNE_BUDGET`, default 20).
    pub budget: usize,
    /// Cycles with work skipped after each knob change (`RINGWATCH_AUTOTUNE_WARMUP_CYCLES`,
    /// default 3).
    pub warmup_cycles: u64,
    /// Cycles with work a sample's window holds at least
    /// (`RINGWATCH_AUTOTUNE_MEASURED_CYCLES`, default 10).
    pub measured_cycles: u64,
    /// Time a sample's window spans at least (`RINGWATCH_AUTOTUNE_MIN_WINDOW_MS`, default
    /// 1000).
    pub min_window: Duration,
    /// Seed of the optimizer (`RINGWATCH_AUTOTUNE_SEED`, default 0).
    pub seed: u64,
    /// Where the self-tuning report goes: `PATH.csv`, with `PATH.parquet` and `PATH.html`
    /// beside it (`RINGWATCH_AUTOTUNE_LOG` / `HOROVOD_AUTOTUNE_LOG`); none: the chosen knobs
    /// are only logged.
    pub log: Option<std::path::PathBuf>,
    /// After pinning, keep watching the job's throughput and, when it moves beyond
    /// noise, re-check the pinned knobs against the start and tune again if they lost
    /// (`RINGWATCH_AUTOTUNE_WATCH`, default on).
    pub watch: bool,
}

impl Default for AutotuneConfig {
    fn default() -> Self {
        AutotuneConfig {
            wait: Duration::from_secs(5),
            budget: 20,
            warmup_cycles: 3,
            measured_cycles: 10,
            min_window: Duration::from_secs(1),
            seed: 0,
            log: None,
            watch: true,
        }
    }
}

fn number<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    names: &[&str],
    want: &str,
) -> Result<Option<T>> {
    match first_set(get, names) {
        None => Ok(None),
        Some((name, v)) => v.trim().parse().map(Some).map_err(|_| bad(&name, &v, want)),
    }
}

/// The autotune request from variables looked up with `get`: `None` unless
/// `RINGWATCH_AUTOTUNE` (or Horovod's `HOROVOD_AUTOTUNE`) is true. Reads
/// `RINGWATCH_AUTOTUNE_WAIT_SECS`, `RINGWATCH_AUTOTUNE_BUDGET`,
/// `RINGWATCH_AUTOTUNE_WARMUP_CYCLES`, `RINGWATCH_AUTOTUNE_MEASURED_CYCLES`,
/// `RINGWATCH_AUTOTUNE_MIN_WINDOW_MS`, `RINGWATCH_AUTOTUNE_SEED`,
/// `RINGWATCH_AUTOTUNE_WATCH` and
/// `RINGWATCH_AUTOTUNE_LOG` / `HOROVOD_AUTOTUNE_LOG` (see [`AutotuneConfig`]).
pub fn autotune_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<AutotuneConfig>> {
    let on = match first_set(get, &["RINGWATCH_AUTOTUNE", "HOROVOD_AUTOTUNE"]) {
        Some((name, v)) => parse_bool(&name, &v)?,
        None => false,
    };
    if !on {
        return Ok(None);
    }
    let mut c = AutotuneConfig::default();
    if let Some((name, v)) = first_set(get, &["RINGWATCH_AUTOTUNE_WAIT_SECS"]) {
        c.wait = parse_duration(&name, &v, BareUnit::Seconds)?;
    }
    if let Some(v) = number::<usize>(get, &["RINGWATCH_AUTOTUNE_BUDGET"], "a sample count")? {
        if v == 0 {
            return Err(bad("RINGWATCH_AUTOTUNE_BUDGET", "0", "at least 1 sample"));
        }
        c.budget = v;
    }
    if let Some(v) = number(get, &["RINGWATCH_AUTOTUNE_WARMUP_CYCLES"], "a cycle count")? {
        c.warmup_cycles = v;
    }
    if let Some(v) = number::<u64>(
        get,
        &["RINGWATCH_AUTOTUNE_MEASURED_CYCLES"],
        "a cycle count",
    )? {
        if v == 0 {
            return Err(bad(
                "RINGWATCH_AUTOTUNE_MEASURED_CYCLES",
                "0",
                "at least 1 cycle",
            ));
        }
        c.measured_cycles = v;
    }
    if let Some((name, v)) = first_set(get, &["RINGWATCH_AUTOTUNE_MIN_WINDOW_MS"]) {
        c.min_window = parse_duration(&name, &v, BareUnit::Milliseconds)?;
    }
    if let Some(v) = number(get, &["RINGWATCH_AUTOTUNE_SEED"], "an integer seed")? {
        c.seed = v;
    }
    if let Some((name, v)) = first_set(get, &["RINGWATCH_AUTOTUNE_WATCH"]) {
        c.watch = parse_bool(&name, &v)?;
    }
    c.log = first_set(get, &["RINGWATCH_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"])
        .map(|(_, v)| std::path::PathBuf::from(v));
    Ok(Some(c))
}

/// The response cache's capacity from `RINGWATCH_CACHE_CAPACITY` / Horovod's
/// `HOROVOD_CACHE_CAPACITY` (tensors; 0 disables the cache), or
/// [`DEFAULT_CACHE_CAPACITY`].
pub fn cache_capacity_from(get: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let names = ["RINGWATCH_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"];
    match first_set(get, &names) {
        None => Ok(DEFAULT_CACHE_CAPACITY),
        Some((name, v)) => v
            .trim()
            .parse::<u32>()
            .map(|c| c as usize)
            .map_err(|_| bad(&name, &v, "a number of tensors (0 disables the cache)")),
    }
}

/// How long a tensor may wait for some ranks before rank 0 calls the job stalled: it
/// logs the tensor and the missing ranks, and the control socket reports them.
pub const DEFAULT_STALL_CHECK: Duration = Duration::from_secs(60);

/// Rank 0's stall check (Horovod's stall inspector).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallConfig {
    /// A tensor some ranks enqueued and others not for this long makes the job stalled
    /// (`RINGWATCH_STALL_CHECK_SECS`, Horovod's `HOROVOD_STALL_CHECK_TIME_SECONDS`);
    /// `None`: never checked (`0`, or Horovod's `HOROVOD_STALL_CHECK_DISABLE=1`).
    pub check: Option<Duration>,
    /// A stall this long fails every rank with an error naming the tensors and the
    /// missing ranks (`RINGWATCH_STALL_SHUTDOWN_SECS`, Horovod's
    /// `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`); `None` (the default, or `0`): the job
    /// waits.
    pub shutdown: Option<Duration>,
}

impl Default for StallConfig {
    fn default() -> Self {
        StallConfig {
            check: Some(DEFAULT_STALL_CHECK),
            shutdown: None,
        }
    }
}

/// The stall check from the environment (see [`StallConfig`]).
pub fn stall_from(get: &dyn Fn(&str) -> Option<String>) -> Result<StallConfig> {
    let seconds = |names: &[&str]| -> Result<Option<Option<Duration>>> {
        match first_set(get, names) {
            None => Ok(None),
            Some((name, v)) => {
                let d = parse_duration(&name, &v, BareUnit::Seconds)?;
                Ok(Some((!d.is_zero()).then_some(d)))
            }
        }
    };
    let disabled = match get("HOROVOD_STALL_CHECK_DISABLE") {
        Some(v) if !v.trim().is_empty() => parse_bool("HOROVOD_STALL_CHECK_DISABLE", &v)?,
        _ => false,
    };
    let check = match seconds(&[
        "RINGWATCH_STALL_CHECK_SECS",
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
    ])? {
        _ if disabled => None,
        None => Some(DEFAULT_STALL_CHECK),
        Some(set) => set,
    };
    let shutdown = seconds(&[
        "RINGWATCH_STALL_SHUTDOWN_SECS",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    ])?
    .flatten();
    if let (Some(shutdown), Some(check)) = (shutdown, check)
        && shutdown < check
    {
        return Err(CollectiveError::Config(format!(
            "RINGWATCH_STALL_SHUTDOWN_SECS ({shutdown:?}) is shorter than the stall check \
             ({check:?}, RINGWATCH_STALL_CHECK_SECS): a job would be failed before it is \
             called stalled; make it at least as long"
        )));
    }
    Ok(StallConfig { check, shutdown })
}

/// The collective's silent-peer timeout: how long a rank waits on a peer
/// during a collective before failing with the peer's rank.
pub const COLLECTIVE_TIMEOUT_VAR: &str = "RINGWATCH_COLLECTIVE_TIMEOUT_SECS";

/// The old name of [`COLLECTIVE_TIMEOUT_VAR`], still read when the new one is
/// not set (with a warning): beside the agent's `RINGWATCH_PEER_TIMEOUT` it
/// did not say whose timeout it was.
pub const DEPRECATED_TIMEOUT_VAR: &str = "RINGWATCH_TIMEOUT_SECS";

/// The peer timeout from `RINGWATCH_COLLECTIVE_TIMEOUT_SECS` (seconds,
/// fractions allowed), else from its deprecated name `RINGWATCH_TIMEOUT_SECS`
/// (warned about once per process), or [`DEFAULT_TIMEOUT`].
pub fn timeout_from(get: &dyn Fn(&str) -> Option<String>) -> Result<Duration> {
    match first_set(get, &[COLLECTIVE_TIMEOUT_VAR, DEPRECATED_TIMEOUT_VAR]) {
        None => Ok(DEFAULT_TIMEOUT),
        Some((name, v)) => {
            if name == DEPRECATED_TIMEOUT_VAR {
                warn_deprecated_timeout_once();
            }
            let timeout = parse_duration(&name, &v, BareUnit::Seconds)?;
            if timeout.is_zero() {
                return Err(bad(&name, &v, "a positive duration"));
            }
            Ok(timeout)
        }
    }
}

/// Every rank reads the timeout once, but a process may start several
/// runtimes (tests, a restarted job): one warning is enough.
fn warn_deprecated_timeout_once() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "{DEPRECATED_TIMEOUT_VAR} is deprecated: set {COLLECTIVE_TIMEOUT_VAR} instead \
             (the old name is read only while the new one is unset)"
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::vars;

    #[test]
    fn the_stall_check_reads_ringwatchs_names_then_horovods() {
        let stall = |pairs: &[(&str, &str)]| stall_from(&vars(pairs));
        assert_eq!(stall(&[]).unwrap(), StallConfig::default());
        assert_eq!(
            stall(&[
                ("HOROVOD_STALL_CHECK_TIME_SECONDS", "5"),
                ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20"),
            ])
            .unwrap(),
            StallConfig {
                check: Some(Duration::from_secs(5)),
                shutdown: Some(Duration::from_secs(20)),
            }
        );
        let both = stall(&[
            ("RINGWATCH_STALL_CHECK_SECS", "1.5"),
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", "5"),
        ])
        .unwrap();
        assert_eq!(both.check, Some(Duration::from_millis(1500)));
        assert_eq!(both.shutdown, None);
        assert_eq!(
            stall(&[("RINGWATCH_STALL_CHECK_SECS", "0")]).unwrap().check,
            None
        );
        assert_eq!(
            stall(&[("HOROVOD_STALL_CHECK_DISABLE", "1")])
                .unwrap()
                .check,
            None
        );
        let short = stall(&[
            ("RINGWATCH_STALL_CHECK_SECS", "10"),
            ("RINGWATCH_STALL_SHUTDOWN_SECS", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(short.contains("shorter than the stall check"), "{short}");
        let bad = stall(&[("RINGWATCH_STALL_SHUTDOWN_SECS", "soon")])
            .unwrap_err()
            .to_string();
        assert!(bad.contains("RINGWATCH_STALL_SHUTDOWN_SECS"), "{bad}");
    }

    #[test]
    fn durations_take_a_unit_or_the_names_unit() {
        let d = |v: &str, bare| parse_duration("X", v, bare);
        assert_eq!(
            d("2.5", BareUnit::Seconds).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            d("2.5", BareUnit::Milliseconds).unwrap(),
            Duration::from_micros(2500)
        );
        assert_eq!(
            d(" 500ms ", BareUnit::Seconds).unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(
            d("1.5s", BareUnit::Milliseconds).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            d("250us", BareUnit::Seconds).unwrap(),
            Duration::from_micros(250)
        );
        assert_eq!(
            d("250µs", BareUnit::Seconds).unwrap(),
            Duration::from_micros(250)
        );
        assert_eq!(
            d("2m", BareUnit::Seconds).unwrap(),
            Duration::from_secs(120)
        );
        assert_eq!(
            d("1h", BareUnit::Seconds).unwrap(),
            Duration::from_secs(3600)
        );
        assert_eq!(d("0", BareUnit::Seconds).unwrap(), Duration::ZERO);
        for bad in [
            "",
            "s",
            "fast",
            "-1",
            "-1s",
            "5 parsecs",
            "1e400",
            "inf",
            "NaN",
            "3d",
        ] {
            let err = d(bad, BareUnit::Seconds).unwrap_err().to_string();
            assert!(
                err.contains("X=") && err.contains("bare number of seconds"),
                "{bad}: {err}"
            );
        }
        // The knobs and timeouts read them so.
        let knobs = knobs_from(&vars(&[("RINGWATCH_CYCLE_TIME_MS", "2500us")])).unwrap();
        assert_eq!(knobs.cycle_time_us, 2500);
        assert!(knobs_from(&vars(&[("RINGWATCH_CYCLE_TIME_MS", "61s")])).is_err());
        let t = timeout_from(&vars(&[("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", "1m")])).unwrap();
        assert_eq!(t, Duration::from_secs(60));
        assert!(timeout_from(&vars(&[("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", "0ms")])).is_err());
    }

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
    fn autotune_is_off_unless_asked_and_reads_horovods_names() {
        assert_eq!(autotune_from(&vars(&[])).unwrap(), None);
        assert_eq!(
            autotune_from(&vars(&[
                ("RINGWATCH_AUTOTUNE", "0"),
                ("HOROVOD_AUTOTUNE", "1")
            ]))
            .unwrap(),
            None
        );
        let c = autotune_from(&vars(&[("HOROVOD_AUTOTUNE", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!(c, AutotuneConfig::default());
        assert_eq!(c.wait, Duration::from_secs(5));
        let c = autotune_from(&vars(&[
            ("RINGWATCH_AUTOTUNE", "true"),
            ("RINGWATCH_AUTOTUNE_WAIT_SECS", "0.5"),
            ("RINGWATCH_AUTOTUNE_BUDGET", "4"),
            ("RINGWATCH_AUTOTUNE_WARMUP_CYCLES", "1"),
            ("RINGWATCH_AUTOTUNE_MEASURED_CYCLES", "2"),
            ("RINGWATCH_AUTOTUNE_MIN_WINDOW_MS", "50"),
            ("RINGWATCH_AUTOTUNE_SEED", "9"),
            ("HOROVOD_AUTOTUNE_LOG", "/tmp/x.csv"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.wait, Duration::from_millis(500));
        assert_eq!((c.budget, c.warmup_cycles, c.measured_cycles), (4, 1, 2));
        // A duration with its unit means the same whatever the name's unit.
        let with_units = autotune_from(&vars(&[
            ("RINGWATCH_AUTOTUNE", "1"),
            ("RINGWATCH_AUTOTUNE_WAIT_SECS", "500ms"),
            ("RINGWATCH_AUTOTUNE_MIN_WINDOW_MS", "0.05s"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(with_units.wait, c.wait);
        assert_eq!(with_units.min_window, Duration::from_millis(50));
        assert_eq!(c.min_window, Duration::from_millis(50));
        assert_eq!(c.seed, 9);
        assert_eq!(c.log, Some(std::path::PathBuf::from("/tmp/x.csv")));
        let err = autotune_from(&vars(&[
            ("RINGWATCH_AUTOTUNE", "1"),
            ("RINGWATCH_AUTOTUNE_BUDGET", "0"),
        ]))
        .unwrap_err();
        assert!(
            err.to_string().contains("RINGWATCH_AUTOTUNE_BUDGET"),
            "{err}"
        );
        let err = autotune_from(&vars(&[("RINGWATCH_AUTOTUNE", "maybe")])).unwrap_err();
        assert!(err.to_string().contains("RINGWATCH_AUTOTUNE"), "{err}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let err = knobs_from(&vars(&[("RINGWATCH_CYCLE_TIME_MS", "fast")])).unwrap_err();
        assert!(err.to_string().contains("RINGWATCH_CYCLE_TIME_MS"), "{err}");
        let err = timeout_from(&vars(&[("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", "-1")])).unwrap_err();
        assert!(
            err.to_string()
                .contains("RINGWATCH_COLLECTIVE_TIMEOUT_SECS"),
            "{err}"
        );
        let err = timeout_from(&vars(&[("RINGWATCH_TIMEOUT_SECS", "-1")])).unwrap_err();
        assert!(err.to_string().contains("RINGWATCH_TIMEOUT_SECS"), "{err}");
        let err = cache_capacity_from(&vars(&[("HOROVOD_CACHE_CAPACITY", "-1")])).unwrap_err();
        assert!(err.to_string().contains("HOROVOD_CACHE_CAPACITY"), "{err}");
    }

    #[test]
    fn the_deprecated_timeout_name_is_read_until_the_new_one_is_set() {
        let old = timeout_from(&vars(&[("RINGWATCH_TIMEOUT_SECS", "7.5")])).unwrap();
        assert_eq!(old, Duration::from_millis(7500));
        let new = timeout_from(&vars(&[("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", "4")])).unwrap();
        assert_eq!(new, Duration::from_secs(4));
        let both = timeout_from(&vars(&[
            ("RINGWATCH_TIMEOUT_SECS", "7.5"),
            ("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", "4"),
        ]))
        .unwrap();
        assert_eq!(both, Duration::from_secs(4), "the new name wins");
        // An empty new name counts as unset, as for every variable here.
        let empty_new = timeout_from(&vars(&[
            ("RINGWATCH_TIMEOUT_SECS", "7.5"),
            ("RINGWATCH_COLLECTIVE_TIMEOUT_SECS", ""),
        ]))
        .unwrap();
        assert_eq!(empty_new, Duration::from_millis(7500));
    }

    #[test]
    fn cache_capacity_defaults_to_horovods_and_zero_disables() {
        assert_eq!(cache_capacity_from(&vars(&[])).unwrap(), 1024);
        assert_eq!(
            cache_capacity_from(&vars(&[("HOROVOD_CACHE_CAPACITY", "0")])).unwrap(),
            0
        );
        let both = [
            ("HOROVOD_CACHE_CAPACITY", "0"),
            ("RINGWATCH_CACHE_CAPACITY", "64"),
        ];
        assert_eq!(cache_capacity_from(&vars(&both)).unwrap(), 64);
    }
}
