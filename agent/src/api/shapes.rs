//! `api::shapes`: the shape of the Chrome trace a timeline answer is. The
//! answer is written as JSON by `publish::timeline` as it streams (no typed
//! value is ever built), so its shape is written here as types for the
//! document.
//!
//! Nothing here is built at run time: these types exist for
//! `#[utoipa::path]`'s `body = …` only; a field added to the answer is added
//! here too (the snapshot test shows the document's change). Every other
//! answer's schema is derived from the type that is serialized.
#![allow(dead_code)] // shapes for the document only: never constructed

use serde_json::Value;
use utoipa::ToSchema;

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
