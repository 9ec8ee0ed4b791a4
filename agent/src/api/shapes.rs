//! `api::shapes`: the document's shapes of answers and bodies whose types
//! live outside the API (the tuning session, its knobs, a report's entry,
//! the tuning request, the Chrome trace a timeline answer is), written as types so the document is derived from
//! them.
//!
//! Nothing here is built at run time: these types exist for
//! `#[utoipa::path]`'s `body = …` only. The session types they describe are
//! `crate::tuning`'s; a field added there is added here too (the snapshot
//! test shows the document's change).
#![allow(dead_code)] // shapes for the document only: never constructed

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

/// The knobs a tuning session turns.
#[derive(ToSchema)]
pub struct Knobs {
    /// Bytes up to which tensors are fused into one collective.
    fusion_threshold_bytes: i64,
    /// The coordinator's cycle, µs.
    cycle_time_us: i64,
    /// Whether allreduce runs hierarchically (within hosts, then across).
    hierarchical_allreduce: bool,
}

/// A job's tuning session (running, or the last one).
#[derive(ToSchema)]
pub struct TuningSession {
    /// The job tuned.
    job_id: String,
    /// Where the session is.
    state: SessionState,
    /// Why it failed.
    error: Option<String>,
    /// When it started, ms since the Unix epoch.
    started_unix_ms: i64,
    /// The configuration, defaults filled in.
    #[schema(value_type = Object)]
    config: Value,
    /// The job's knobs when the session started.
    start_knobs: Knobs,
    /// The knobs in force now (as last confirmed by the job).
    current_knobs: Knobs,
    /// The samples so far.
    samples: Vec<Sample>,
    /// The best knobs so far.
    best: Option<Best>,
    /// The best sample's measured score over sample 0's.
    speedup_over_start: Option<f64>,
    /// The report, once written.
    report_id: Option<String>,
    /// on, or off with the reason
    #[schema(required = false)]
    disturbance_detection: String,
    /// Why the optimizer stopped (`budget`, `converged`), or `stopped`.
    #[schema(required = false)]
    stop_reason: Option<String>,
    /// the choice against the start on fresh interleaved windows before pinning; null until it starts and when the choice is the start
    #[schema(required = false)]
    confirmation: Option<Confirmation>,
}

/// Where a session is.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum SessionState {
    /// Sampling.
    Running,
    /// Finished its budget or converged; the best knobs pinned.
    Done,
    /// Stopped by DELETE.
    Stopped,
    /// Failed (`error` says why).
    Failed,
}

/// One sampled window.
#[derive(ToSchema)]
pub struct Sample {
    /// Its index, from 0 (the start).
    index: i64,
    /// The knobs it ran with.
    knobs: Knobs,
    /// Bytes reduced per second in the window.
    score_bytes_per_s: f64,
    /// How noisy the score looks, when known.
    noise_hint: Option<f64>,
    /// What disturbed the window, when something did.
    disturbed: Option<String>,
    /// Why it was measured again, when it was.
    remeasured_because: Option<String>,
    /// Seconds since the session started.
    wall_time_s: f64,
    /// The cycles the window covered.
    window: SampleWindow,
}

/// A sample's cycles.
#[derive(ToSchema)]
pub struct SampleWindow {
    /// The first cycle measured.
    #[schema(required = false)]
    first_cycle: i64,
    /// The last cycle measured.
    #[schema(required = false)]
    last_cycle: i64,
    /// Cycles with work.
    #[schema(required = false)]
    cycles: i64,
    /// The window's length, s.
    #[schema(required = false)]
    duration_s: f64,
}

/// The best knobs so far.
#[derive(ToSchema)]
pub struct Best {
    /// The knobs.
    #[schema(required = false)]
    knobs: Knobs,
    /// The model's predicted score for them.
    #[schema(required = false)]
    predicted_score_bytes_per_s: f64,
    /// The sample that measured them.
    #[schema(required = false)]
    sample: i64,
}

/// The choice against the start, before pinning.
#[derive(ToSchema)]
pub struct Confirmation {
    /// The knobs chosen.
    choice: Knobs,
    /// The sample that chose them.
    choice_sample: i64,
    /// The interleaved windows.
    windows: Vec<ConfirmationWindow>,
    /// The choice's median score.
    choice_median_bytes_per_s: Option<f64>,
    /// The start's median score.
    start_median_bytes_per_s: Option<f64>,
    /// The gain the choice must show.
    required_gain: Option<f64>,
    /// Which was kept (null until decided).
    kept: Option<Candidate>,
}

/// One confirmation window.
#[derive(ToSchema)]
pub struct ConfirmationWindow {
    /// Which knobs ran.
    candidate: Candidate,
    /// Bytes reduced per second.
    score_bytes_per_s: f64,
    /// What disturbed the window, when something did.
    disturbed: Option<String>,
    /// Seconds since the session started.
    wall_time_s: f64,
}

/// The two sides of a confirmation.
#[derive(ToSchema)]
#[schema(rename_all = "snake_case")]
pub enum Candidate {
    /// The knobs chosen.
    Choice,
    /// The job's starting knobs.
    Start,
}

/// A report written by this agent.
#[derive(ToSchema)]
pub struct ReportEntry {
    /// The report's id.
    id: String,
    /// The job tuned.
    job_id: String,
    /// When it was written, ms since the Unix epoch.
    created_unix_ms: i64,
    /// Samples in it.
    samples: i64,
    /// The best knobs, when there were samples.
    best: Option<Knobs>,
    /// The best sample's score over the start's.
    speedup_over_start: Option<f64>,
    /// Link to the HTML page.
    html: String,
    /// Link to the CSV table.
    csv: String,
    /// Link to the Parquet table.
    parquet: String,
}

/// A tuning request (every field optional; an empty body takes the
/// defaults).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TuningRequestBody {
    /// samples
    #[schema(minimum = 1, maximum = 18446744073709551615_u64, default = 20)]
    budget: Option<u64>,
    /// cycles with work skipped after knobs are applied
    #[schema(minimum = 0, maximum = 18446744073709551615_u64, default = 3)]
    warmup_cycles: Option<u64>,
    /// cycles with work per window (at least)
    #[schema(minimum = 0, maximum = 18446744073709551615_u64, default = 10)]
    measured_cycles: Option<u64>,
    /// shortest window
    #[schema(minimum = 0, maximum = 18446744073709551615_u64, default = 1000)]
    min_window_ms: Option<u64>,
    /// the optimizer's seed
    #[schema(minimum = 0, maximum = 18446744073709551615_u64, default = 0)]
    seed: Option<u64>,
    /// the ranges sampled
    bounds: Option<Bounds>,
    /// knobs held fixed
    fixed: Option<Fixed>,
}

/// The ranges a session samples, `[lo, hi]`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Bounds {
    /// bytes
    #[schema(min_items = 2, max_items = 2)]
    fusion_threshold_bytes: Option<Vec<u64>>,
    /// milliseconds
    #[schema(min_items = 2, max_items = 2)]
    cycle_time_ms: Option<Vec<f64>>,
}

/// Knobs a session holds fixed.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Fixed {
    /// bytes
    fusion_threshold_bytes: Option<u64>,
    /// milliseconds
    cycle_time_ms: Option<f64>,
    /// hierarchical allreduce on or off
    hierarchical_allreduce: Option<bool>,
}

/// A timeline in the Chrome trace event format (Perfetto and
/// chrome://tracing open it).
#[derive(ToSchema)]
#[allow(non_snake_case)] // the Chrome trace event format's name
pub struct ChromeTrace {
    /// The events, in the Chrome trace event format.
    #[schema(value_type = Vec<Object>)]
    traceEvents: Vec<Value>,
    /// What the answer holds and leaves out.
    metadata: TraceMetadata,
}

/// A timeline answer's `metadata`.
#[derive(ToSchema)]
pub struct TraceMetadata {
    /// the present on the trace's clock (µs)
    now: f64,
    /// where the events come from
    source: String,
    /// why a window holds nothing (after now, or from after to)
    #[schema(nullable = false)]
    empty_window: Option<String>,
    /// thread-state slices dropped to fit max_events (downsample=true)
    #[schema(value_type = Option<Object>, nullable = false)]
    downsampled: Option<Value>,
    /// with job=: since when (streaming_since_unix_ms, null: not yet) the job streams its tensor events to this agent, which asks for them while someone reads its timeline (--job-timeline)
    #[schema(value_type = Option<Object>, nullable = false)]
    job_timeline: Option<Value>,
    /// with width or resolution: the pixel's length and what was merged
    #[schema(nullable = false)]
    detail: Option<DetailNote>,
    /// events left out at the answer's byte budget: narrow the window
    #[schema(nullable = false)]
    truncated: Option<TruncatedNote>,
}

/// `metadata.detail`.
#[derive(ToSchema)]
pub struct DetailNote {
    /// µs one pixel stands for
    pixel_us: f64,
    /// thread-state slices in the window
    slices_in_range: u64,
    /// summary slices written for them
    summary_slices: u64,
    /// slices kept as they were
    slices_kept: u64,
}

/// `metadata.truncated`.
#[derive(ToSchema)]
pub struct TruncatedNote {
    /// why the answer stopped
    reason: String,
    /// the answer's byte budget
    max_bytes: u64,
    /// events in the answer
    events_written: u64,
    /// events left out
    events_left_out: u64,
}
