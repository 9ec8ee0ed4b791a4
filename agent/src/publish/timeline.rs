//! `timeline`: timelines in the Chrome trace event format, and the range
//! queries the API answers with them (`GET /api/timeline`).
//!
//! Today's source is a recorded trace (`serve --replay FILE`: a
//! `RINGWATCH_TIMELINE` file, a Horovod timeline, or any Chrome trace); the
//! live model joins it as another source. A query may ask for a level of
//! detail (`width`/`resolution`: slices shorter than a pixel merged per
//! track into summaries, see [`lod`]). Queries are bounded twice: a range
//! with more events than the limit is refused with a request to narrow it
//! (or thinned, with `downsample`), and an answer is written straight to
//! JSON bytes ([`TraceWriter`]) that stop at a byte budget, saying so in
//! `metadata.truncated`. Never answered by exhausting memory: no
//! `serde_json::Value` tree of the answer is built (one would be ~10× its
//! bytes). Pure: no I/O but `RecordedTrace::load`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::lod::{self, Detail};

/// Where a range starts or ends, on the trace's clock (µs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimePoint {
    /// An absolute timestamp in µs.
    At(f64),
    /// The present minus a duration (`now-10s`; `now` is a zero duration).
    BeforeNow(Duration),
}

/// The grammar `from`/`to` accept, as the OpenAPI document states it: a
/// timestamp in µs (digits, an optional fraction) or `now`, `now-<duration>`
/// with one to eight `<digits><unit>` parts (`now-10s`, `now-1m30s`).
pub const TIME_POINT_PATTERN: &str =
    "^([0-9]{1,16}(\\.[0-9]{1,6})?|now(-([0-9]{1,9}(ns|us|µs|ms|s|m|h|d)){1,8})?)$";

/// Units `now-<duration>` accepts (longest first, so `ms` is not read as `m`).
const DURATION_UNITS: [&str; 8] = ["ns", "us", "µs", "ms", "s", "m", "h", "d"];

/// Whether `text` is `<digits><unit>` repeated 1..=8 times, digits 1..=9
/// long: exactly the duration part of [`TIME_POINT_PATTERN`].
fn is_duration_text(text: &str) -> bool {
    let mut rest = text;
    let mut parts = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if !(1..=9).contains(&digits) {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = DURATION_UNITS
            .iter()
            .filter(|unit| rest.starts_with(**unit))
            .max_by_key(|unit| unit.len())
        else {
            return false;
        };
        rest = &rest[unit.len()..];
        parts += 1;
    }
    (1..=8).contains(&parts)
}

/// Whether `text` is a timestamp of [`TIME_POINT_PATTERN`]: 1..=16 digits,
/// optionally `.` and 1..=6 digits.
fn is_timestamp_text(text: &str) -> bool {
    let (whole, fraction) = match text.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (text, None),
    };
    let digits = |s: &str, most: usize| {
        (1..=most).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())
    };
    digits(whole, 16) && fraction.is_none_or(|f| digits(f, 6))
}

impl TimePoint {
    /// Parses `123456.5` (µs), `now`, or `now-<duration>` (`now-10s`,
    /// `now-500ms`, `now-1m30s`): exactly [`TIME_POINT_PATTERN`], nothing
    /// looser (no spaces, signs or exponents), so the API's document and
    /// the server agree.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "now" {
            return Ok(Self::BeforeNow(Duration::ZERO));
        }
        if let Some(ago) = text.strip_prefix("now-") {
            if !is_duration_text(ago) {
                return Err(format!(
                    "{text:?}: write now-<duration> as 1 to 8 parts of digits and a unit \
                     (ns, us, µs, ms, s, m, h, d), e.g. now-10s or now-1m30s"
                ));
            }
            return humantime::parse_duration(ago)
                .map(Self::BeforeNow)
                .map_err(|e| format!("{text:?}: {e} (write e.g. now-10s)"));
        }
        if !is_timestamp_text(text) {
            return Err(format!(
                "{text:?} is neither a timestamp in µs (digits, optionally a fraction: \
                 123456.5) nor now or now-<duration> (now-10s)"
            ));
        }
        text.parse::<f64>()
            .map(Self::At)
            .map_err(|e| format!("{text:?}: {e}"))
    }

    /// The point in µs, with `now` at `now_us`.
    pub fn resolve(self, now_us: f64) -> f64 {
        match self {
            Self::At(us) => us,
            Self::BeforeNow(ago) => now_us - ago.as_secs_f64() * 1e6,
        }
    }
}

/// One `GET /api/timeline` query.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TimelineQuery {
    /// Start of the range (default: the beginning).
    pub from: Option<TimePoint>,
    /// End of the range (default: now).
    pub to: Option<TimePoint>,
    /// Only this job's ranks.
    pub job: Option<String>,
    /// Only this process (a Chrome-trace pid: a number, or a name like `gpu0`).
    pub pid: Option<String>,
    /// Over the limit, answer anyway with the longest thread-state slices
    /// (every other event kept), saying so in `metadata.downsampled`,
    /// instead of refusing.
    pub downsample: bool,
    /// The level of detail: slices shorter than a pixel merged into
    /// summaries (see [`lod`]).
    pub detail: Detail,
    /// Every thread and tensor (the default), or the overview: per
    /// process, its threads and its job's tensors merged into counters.
    pub view: View,
}

/// What a timeline answer shows of each process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum View {
    /// Every thread's states and every tensor's activities.
    #[default]
    Full,
    /// Per process: `threads` (running, runnable: average threads per
    /// pixel) and `activity` (share of each pixel per class of job
    /// activity) counters in place of its threads' states and its tensors'
    /// activities (see [`lod::Overview`]).
    Overview,
}

/// Why a query could not be answered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QueryError {
    /// More events than one answer may carry.
    #[error(
        "the range holds {count} events, more than the {limit} one answer may carry; narrow from/to, or pick a job or pid"
    )]
    TooLarge {
        /// Events in the range.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// An unknown job.
    #[error("no job {0:?} in this timeline")]
    UnknownJob(String),
}

/// A Chrome trace held in memory, events sorted by time.
#[derive(Debug, Clone)]
pub struct RecordedTrace {
    /// Where it came from, for the answer's metadata.
    source: String,
    /// `ph: "M"` events (names, sort order): sent with every answer.
    metadata: Vec<Value>,
    /// Every other event, sorted by `ts`.
    events: Vec<Value>,
    /// The present on the trace's clock: `metadata.now`, else its last instant.
    now_us: f64,
    /// Chrome-trace pid (as text) → job name, from `process_name` args.
    process_jobs: HashMap<String, String>,
}

fn ts(event: &Value) -> f64 {
    event.get("ts").and_then(Value::as_f64).unwrap_or(0.0)
}

fn end(event: &Value) -> f64 {
    ts(event) + event.get("dur").and_then(Value::as_f64).unwrap_or(0.0)
}

fn pid_key(event: &Value) -> Option<String> {
    match event.get("pid")? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

impl RecordedTrace {
    /// Reads a trace file (see [`RecordedTrace::parse`]).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the trace {}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
            .with_context(|| format!("parsing the trace {}", path.display()))
    }

    /// Parses a Chrome trace: `{"traceEvents": [...]}` or a bare array,
    /// including a Horovod timeline still being written (no closing `]`, or
    /// a half-written last event: read up to the last complete event).
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let value: Value = match serde_json::from_str(text) {
            Ok(value) => value,
            Err(error) => parse_unterminated_array(text)
                .with_context(|| format!("not a Chrome trace (JSON error: {error})"))?,
        };
        let (events, file_metadata) = match value {
            Value::Array(events) => (events, Value::Null),
            Value::Object(mut object) => match object.remove("traceEvents") {
                Some(Value::Array(events)) => {
                    (events, object.remove("metadata").unwrap_or(Value::Null))
                }
                _ => bail!("a JSON object without a traceEvents array is not a Chrome trace"),
            },
            _ => bail!("a Chrome trace is a JSON array or an object with traceEvents"),
        };
        let now_us = file_metadata.get("now").and_then(Value::as_f64);
        Self::from_events(events, now_us, source)
    }

    /// A trace from events already in memory; `now_us` defaults to the end of
    /// the last event.
    pub fn from_events(events: Vec<Value>, now_us: Option<f64>, source: &str) -> Result<Self> {
        let mut metadata = Vec::new();
        let mut timed = Vec::new();
        let mut process_jobs = HashMap::new();
        for event in events {
            if !event.is_object() {
                continue;
            }
            if event.get("ph").and_then(Value::as_str) == Some("M") {
                if event.get("name").and_then(Value::as_str) == Some("process_name")
                    && let (Some(pid), Some(job)) = (
                        pid_key(&event),
                        event.pointer("/args/job").and_then(Value::as_str),
                    )
                {
                    process_jobs.insert(pid, job.to_owned());
                }
                metadata.push(event);
            } else {
                timed.push(event);
            }
        }
        timed.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
        let last = timed.iter().map(end).fold(0.0, f64::max);
        let now_us = now_us.unwrap_or(last);
        Ok(Self {
            source: source.to_owned(),
            metadata,
            events: timed,
            now_us,
            process_jobs,
        })
    }

    /// The jobs the trace's processes belong to (`process_name` args `job`,
    /// `rank`), as `/api/jobs` lists them.
    pub fn jobs(&self) -> Vec<Value> {
        let mut jobs: std::collections::BTreeMap<&str, Vec<Value>> =
            std::collections::BTreeMap::new();
        for event in &self.metadata {
            if event.get("name").and_then(Value::as_str) != Some("process_name") {
                continue;
            }
            if let Some(job) = event.pointer("/args/job").and_then(Value::as_str) {
                jobs.entry(job).or_default().push(json!({
                    "rank": event.pointer("/args/rank"),
                    "pid": event.get("pid"),
                    "name": event.pointer("/args/name"),
                }));
            }
        }
        jobs.into_iter()
            .map(|(id, ranks)| json!({ "id": id, "ranks": ranks, "source": "recorded" }))
            .collect()
    }

    /// The trace's named processes, as `/api/processes` lists them.
    pub fn processes(&self) -> Vec<Value> {
        self.metadata
            .iter()
            .filter(|e| e.get("name").and_then(Value::as_str) == Some("process_name"))
            .map(|e| json!({ "pid": e.get("pid"), "name": e.pointer("/args/name"), "source": "recorded" }))
            .collect()
    }

    /// Whether an event of process `pid` passes the query's `job`/`pid`
    /// filters (for events kept outside the trace, e.g. the live thread
    /// states).
    pub fn wanted_pid(&self, query: &TimelineQuery, pid: &str) -> bool {
        if query.pid.as_deref().is_some_and(|want| want != pid) {
            return false;
        }
        match &query.job {
            Some(job) => self.process_jobs.get(pid) == Some(job),
            None => true,
        }
    }

    /// Events in the trace (metadata excluded).
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// The events of a range as a Chrome trace: at most `limits.max_events`
    /// of them (over it refused, or thinned with `downsample`), written as
    /// JSON up to `limits.max_bytes`.
    pub fn query(
        &self,
        query: &TimelineQuery,
        limits: AnswerLimits,
    ) -> Result<TraceAnswer, QueryError> {
        let mut selection = self.select(query)?;
        if let Some(pixel_us) = selection.pixel_us {
            let is_slice = |e: &&&Value| e.get("ph").and_then(Value::as_str) == Some("X");
            let in_range = selection.events.iter().filter(is_slice).count();
            let merged = match (query.view, selection.span) {
                (View::Overview, Some((from, to))) => selection.overview(pixel_us, from, to),
                _ => (0, pixel_us),
            };
            let (_, summaries, kept) = selection.summarize(pixel_us);
            let mut note = lod::detail_note(pixel_us, in_range, summaries, kept);
            if query.view == View::Overview {
                note["overview"] = lod::overview_note(merged.0, merged.1);
            }
            selection.note("detail", note);
        }
        let limit = limits.max_events;
        let count = selection.events.len() + selection.summaries.len();
        if count > limit {
            if !query.downsample {
                return Err(QueryError::TooLarge { count, limit });
            }
            let (kept, note) = downsample(std::mem::take(&mut selection.events), limit)
                .ok_or(QueryError::TooLarge { count, limit })?;
            selection.events = kept;
            selection.note("downsampled", note);
        }
        let mut writer = TraceWriter::new(limits.max_bytes);
        selection.write_events(&mut writer);
        Ok(writer.finish(selection.metadata))
    }

    /// What a query picks from the trace, by reference: the names
    /// (`ph: "M"`) of the wanted processes and the events of the range, in
    /// time order, with no limit applied. A window that is empty (`from`
    /// after `to`) or lies after the trace's present selects no events,
    /// and `metadata.empty_window` says why: a range with nothing in it
    /// holds nothing, as the API documents (200, not an error).
    pub fn select(&self, query: &TimelineQuery) -> Result<Selection<'_>, QueryError> {
        let from = query
            .from
            .map_or(f64::NEG_INFINITY, |p| p.resolve(self.now_us));
        let to = query.to.map_or(f64::INFINITY, |p| p.resolve(self.now_us));
        if let Some(job) = &query.job
            && !self.process_jobs.values().any(|j| j == job)
        {
            return Err(QueryError::UnknownJob(job.clone()));
        }
        let wanted = |event: &Value| -> bool {
            let pid = pid_key(event);
            if let Some(want) = &query.pid
                && pid.as_ref() != Some(want)
            {
                return false;
            }
            if let Some(job) = &query.job
                && pid.and_then(|p| self.process_jobs.get(&p)) != Some(job)
            {
                return false;
            }
            true
        };
        let mut metadata = serde_json::Map::new();
        metadata.insert("now".into(), json!(self.now_us));
        metadata.insert("source".into(), json!(format!("recorded: {}", self.source)));
        let empty = if from > to {
            Some(format!(
                "from ({from} µs) is after to ({to} µs): the window holds nothing"
            ))
        } else if from > self.now_us {
            Some(format!(
                "from ({from} µs) is after now ({} µs on this trace's clock): the window \
                 holds nothing yet (the live clock is CLOCK_MONOTONIC µs, not Unix time; \
                 now-<duration> counts back from metadata.now)",
                self.now_us
            ))
        } else {
            None
        };
        let names: Vec<&Value> = self.metadata.iter().filter(|e| wanted(e)).collect();
        let events = match empty {
            Some(reason) => {
                metadata.insert("empty_window".into(), json!(reason));
                Vec::new()
            }
            None => {
                // Sorted by start: everything after `to` is out; before it,
                // keep what ends at or after `from`.
                let upper = self.events.partition_point(|e| ts(e) <= to);
                self.events[..upper]
                    .iter()
                    .filter(|e| end(e) >= from && wanted(e))
                    .collect()
            }
        };
        let window = metadata.get("empty_window").is_none().then_some((from, to));
        // A window open at the start begins with the trace's first event,
        // and one open at the end with its present.
        let span = window.map(|(from, to)| {
            let first = self.events.first().map_or(self.now_us, ts);
            let from = if from.is_finite() { from } else { first };
            let to = if to.is_finite() { to } else { self.now_us };
            (from, to)
        });
        // The overview needs pixels: 1,000 over the window unless told.
        let detail = match (query.view, query.detail) {
            (View::Overview, Detail::Full) => Detail::Width(1_000),
            (_, detail) => detail,
        };
        let pixel_us = span.and_then(|(from, to)| detail.pixel_us(from, to));
        Ok(Selection {
            names,
            events,
            window,
            span,
            pixel_us,
            summaries: Vec::new(),
            metadata,
        })
    }
}

/// Bounds on one timeline answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerLimits {
    /// The most events (past it: refused, or thinned with `downsample`).
    pub max_events: usize,
    /// The most bytes of JSON; events past it are left out and
    /// `metadata.truncated` says how many.
    pub max_bytes: usize,
}

/// What [`RecordedTrace::select`] picked, by reference into the trace.
#[derive(Debug)]
pub struct Selection<'a> {
    /// The wanted processes' and threads' names (`ph: "M"`).
    pub names: Vec<&'a Value>,
    /// The range's events, in time order.
    pub events: Vec<&'a Value>,
    /// The resolved `[from, to]` in µs, or `None` when the window is
    /// empty (see `metadata.empty_window`).
    pub window: Option<(f64, f64)>,
    /// The window with its open ends closed (the trace's first event, its
    /// present), when it is not empty.
    pub span: Option<(f64, f64)>,
    /// One pixel's length (µs) when the query asked for a level of detail
    /// (or an overview).
    pub pixel_us: Option<f64>,
    /// Summary slices standing for events of the range (see
    /// [`Selection::summarize`]), written after them.
    pub summaries: Vec<Value>,
    /// The answer's `metadata` so far (`now`, `source`, notes).
    pub metadata: serde_json::Map<String, Value>,
}

impl Selection<'_> {
    /// Adds a note to the answer's metadata (`downsampled`, …).
    pub fn note(&mut self, key: &str, value: Value) {
        self.metadata.insert(key.to_owned(), value);
    }

    /// Writes the names, then the events, then the summaries.
    pub fn write_events(&self, writer: &mut TraceWriter) {
        for event in self.names.iter().chain(&self.events) {
            writer.push(event);
        }
        for summary in &self.summaries {
            writer.push(summary);
        }
    }

    /// The overview (see [`View::Overview`]): the selected thread states and
    /// job activities (by their names) become each process's `threads` and
    /// `activity` counters, added to the summaries; every other event stays.
    /// Returns how many slices were merged, and the overview's pixel (µs).
    pub fn overview(&mut self, pixel_us: f64, from: f64, to: f64) -> (usize, f64) {
        let mut overview = lod::Overview::new(pixel_us, from, to);
        let mut merged = 0;
        let mut rest = Vec::new();
        for event in std::mem::take(&mut self.events) {
            let name = event.get("name").and_then(Value::as_str).unwrap_or("");
            let (Some("X"), Some(key)) = (event.get("ph").and_then(Value::as_str), pid_key(event))
            else {
                rest.push(event);
                continue;
            };
            let (start, dur) = (ts(event), end(event) - ts(event));
            let pid = || event["pid"].clone();
            let cycles =
                event.get("tid").and_then(Value::as_str) == Some(crate::tracks::CYCLES_TID);
            let counted = match lod::ThreadState::of_name(name) {
                Some(state) => {
                    overview.add_state(&key, pid, state, start, dur);
                    true
                }
                None => !cycles && overview.add_activity(&key, pid, name, start, dur),
            };
            if counted {
                merged += 1;
            } else {
                rest.push(event);
            }
        }
        self.events = rest;
        let pixel_us = overview.pixel_us();
        self.summaries.extend(overview.counters());
        (merged, pixel_us)
    }

    /// Merges the selected slices (`X` events) shorter than `pixel_us` per
    /// track (pid, tid) into summary slices (see [`lod`]); every other
    /// event stays. Returns the slices there were, the summaries made and
    /// the slices kept as they were.
    pub fn summarize(&mut self, pixel_us: f64) -> (usize, usize, usize) {
        type Key = (Option<String>, Option<String>);
        let is_slice = |e: &Value| e.get("ph").and_then(Value::as_str) == Some("X");
        // Per track: its first event (for the summaries' pid, tid and
        // category) and its slices.
        let mut tracks: HashMap<Key, (&Value, lod::Track<&Value, &str>)> = HashMap::new();
        let mut rest = Vec::new();
        let mut slices = 0;
        for event in std::mem::take(&mut self.events) {
            if !is_slice(event) {
                rest.push(event);
                continue;
            }
            slices += 1;
            let tid = match event.get("tid") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            };
            let name = event.get("name").and_then(Value::as_str).unwrap_or("");
            tracks
                .entry((pid_key(event), tid))
                .or_insert_with(|| (event, lod::Track::new(pixel_us)))
                .1
                .push(event, name, ts(event), end(event) - ts(event), 0.0);
        }
        let (mut summaries, mut kept) = (0, 0);
        for (first, track) in tracks.into_values() {
            let cat = first.get("cat").and_then(Value::as_str).unwrap_or("");
            let (pid, tid) = (&first["pid"], &first["tid"]);
            for piece in track.finish() {
                match piece {
                    lod::Piece::Keep(event) => {
                        kept += 1;
                        rest.push(event);
                    }
                    lod::Piece::Summary(summary) => {
                        summaries += 1;
                        let event = lod::SummaryEvent::new(cat, pid, tid, &summary);
                        self.summaries
                            .push(serde_json::to_value(&event).expect("plain data serializes"));
                    }
                }
            }
        }
        rest.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
        self.events = rest;
        (slices, summaries, kept)
    }
}

/// A timeline answer: a Chrome trace as JSON bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceAnswer {
    /// `{"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}`.
    pub json: Vec<u8>,
    /// Events written.
    pub events: usize,
    /// Events left out at the byte budget (0: the answer is whole).
    pub truncated: usize,
}

impl TraceAnswer {
    /// The answer parsed back (for tests: a `Value` tree is ~10× the bytes).
    #[cfg(test)]
    pub fn to_value(&self) -> Value {
        serde_json::from_slice(&self.json).unwrap_or(Value::Null)
    }
}

/// Writes a Chrome trace's events straight to JSON bytes, one at a time,
/// up to a budget: an event that would take the answer past it is left
/// out, as is every event after it (counted, and said in
/// `metadata.truncated`), so an answer never holds more than the budget
/// plus its metadata.
#[derive(Debug)]
pub struct TraceWriter {
    out: Vec<u8>,
    max_bytes: usize,
    written: usize,
    left_out: usize,
}

impl TraceWriter {
    const HEAD: &'static [u8] = b"{\"traceEvents\":[";

    /// A writer whose events may take up to `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            out: Self::HEAD.to_vec(),
            max_bytes,
            written: 0,
            left_out: 0,
        }
    }

    /// Whether the budget is spent: every further event is left out.
    pub fn is_full(&self) -> bool {
        self.left_out > 0
    }

    /// Adds one event, or counts it as left out once the budget is spent.
    /// Returns whether it was written.
    pub fn push(&mut self, event: &impl serde::Serialize) -> bool {
        if self.is_full() {
            self.left_out += 1;
            return false;
        }
        let mark = self.out.len();
        if self.written > 0 {
            self.out.push(b',');
        }
        let fits = serde_json::to_writer(&mut self.out, event).is_ok()
            && self.out.len() - Self::HEAD.len() <= self.max_bytes;
        if !fits {
            self.out.truncate(mark);
            self.left_out += 1;
            return false;
        }
        self.written += 1;
        true
    }

    /// Closes the trace with `metadata` (plus `truncated` when events were
    /// left out).
    pub fn finish(mut self, mut metadata: serde_json::Map<String, Value>) -> TraceAnswer {
        if self.left_out > 0 {
            metadata.insert(
                "truncated".into(),
                json!({
                    "reason": format!(
                        "the answer reached its budget of {} bytes of events; narrow \
                         from/to, pick a job or pid, or ask for downsample=true with a \
                         smaller max_events",
                        self.max_bytes
                    ),
                    "max_bytes": self.max_bytes,
                    "events_written": self.written,
                    "events_left_out": self.left_out,
                }),
            );
        }
        self.out
            .extend_from_slice(b"],\"displayTimeUnit\":\"ms\",\"metadata\":");
        serde_json::to_writer(&mut self.out, &metadata)
            .expect("a JSON map of strings and values serializes into memory");
        self.out.push(b'}');
        // Not shrunk: that would copy the answer (up to 3x its budget at
        // once); the spare capacity (at most as much again) goes with it.
        TraceAnswer {
            json: self.out,
            events: self.written,
            truncated: self.left_out,
        }
    }
}

/// Thins `selected` (in time order) to at most `limit` events: every event
/// that is not a thread-state slice stays (job activities, counters, NCCL
/// calls), and of the thread-state slices the longest are kept. Returns the
/// kept events, still in time order, and a note for the answer's metadata;
/// `None` when the other events alone exceed the limit.
fn downsample(selected: Vec<&Value>, limit: usize) -> Option<(Vec<&Value>, Value)> {
    let is_state = |e: &Value| e.get("cat").and_then(Value::as_str) == Some("thread_state");
    let others = selected.iter().filter(|e| !is_state(e)).count();
    let room = limit.checked_sub(others)?;
    let mut states: Vec<(usize, f64)> = selected
        .iter()
        .enumerate()
        .filter(|(_, e)| is_state(e))
        .map(|(i, e)| (i, end(e) - ts(e)))
        .collect();
    // Longest first; ties by time so the choice is deterministic.
    states.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let dropped = states.len().saturating_sub(room);
    let shortest_kept = states.get(room.saturating_sub(1)).map(|s| s.1);
    let mut keep = vec![true; selected.len()];
    for &(i, _) in states.iter().skip(room) {
        keep[i] = false;
    }
    let note = downsample_note(
        selected.len(),
        limit,
        dropped,
        states.len() - dropped,
        shortest_kept,
    );
    let kept = selected
        .into_iter()
        .zip(keep)
        .filter_map(|(e, k)| k.then_some(e))
        .collect();
    Some((kept, note))
}

/// What `metadata.downsampled` says when thread-state slices were dropped
/// to fit an answer into `limit` events.
pub fn downsample_note(
    total: usize,
    limit: usize,
    dropped: usize,
    kept: usize,
    shortest_kept_us: Option<f64>,
) -> Value {
    json!({
        "reason": format!("the range holds {total} events, more than the {limit} one answer may carry"),
        "thread_state_slices_dropped": dropped,
        "thread_state_slices_kept": kept,
        "shortest_kept_us": shortest_kept_us,
    })
}

fn parse_unterminated_array(text: &str) -> Result<Value> {
    let body = text.trim_start();
    if !body.starts_with('[') {
        bail!("not an array");
    }
    // Keep complete events only: cut after the last '}' that closes an
    // event at depth 1 of the array.
    let mut depth = 0i32;
    let mut in_string = false;
    let mut escaped = false;
    let mut last_complete = None;
    for (i, c) in body.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '[' | '{' => depth += 1,
            ']' | '}' => {
                depth -= 1;
                if c == '}' && depth == 1 {
                    last_complete = Some(i);
                }
            }
            _ => {}
        }
    }
    let cut = match last_complete {
        Some(i) => format!("{}]", &body[..=i]),
        None => "[]".to_owned(),
    };
    serde_json::from_str(&cut).context("even the complete events do not parse")
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"{"traceEvents":[
        {"ph":"M","name":"process_name","pid":1,"args":{"name":"train rank 0","job":"j1","rank":0}},
        {"ph":"M","name":"process_name","pid":2,"args":{"name":"train rank 1","job":"j1","rank":1}},
        {"ph":"M","name":"process_name","pid":"gpu0","args":{"name":"GPU 0"}},
        {"ph":"X","name":"ALLREDUCE","pid":2,"tid":2,"ts":300,"dur":50},
        {"ph":"X","name":"ALLREDUCE","pid":1,"tid":1,"ts":100,"dur":500},
        {"ph":"X","name":"QUEUE","pid":1,"tid":1,"ts":700,"dur":10},
        {"ph":"C","name":"util","pid":"gpu0","ts":650,"args":{"util":90}}
    ],"metadata":{"now":1000}}"#;

    /// A query with no byte budget, parsed back.
    fn ask(
        trace: &RecordedTrace,
        query: &TimelineQuery,
        limit: usize,
    ) -> Result<Value, QueryError> {
        let limits = AnswerLimits {
            max_events: limit,
            max_bytes: usize::MAX,
        };
        trace.query(query, limits).map(|answer| answer.to_value())
    }

    fn names(answer: &Value) -> Vec<String> {
        answer["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] != "M")
            .map(|e| format!("{}@{}", e["name"].as_str().unwrap(), e["ts"]))
            .collect()
    }

    #[test]
    fn a_range_returns_the_overlapping_events_in_time_order() {
        let trace = RecordedTrace::parse(TRACE, "t").unwrap();
        let all = ask(&trace, &TimelineQuery::default(), 100).unwrap();
        assert_eq!(
            names(&all),
            ["ALLREDUCE@100", "ALLREDUCE@300", "util@650", "QUEUE@700"]
        );
        assert_eq!(all["metadata"]["now"], 1000.0);
        // [400, 660]: the long ALLREDUCE overlaps it, the short one ended at 350.
        let q = TimelineQuery {
            from: Some(TimePoint::At(400.0)),
            to: Some(TimePoint::At(660.0)),
            ..TimelineQuery::default()
        };
        assert_eq!(
            names(&ask(&trace, &q, 100).unwrap()),
            ["ALLREDUCE@100", "util@650"]
        );
        // now-0.35ms = 650 µs.
        let q = TimelineQuery {
            from: Some(TimePoint::parse("now-350us").unwrap()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            names(&ask(&trace, &q, 100).unwrap()),
            ["util@650", "QUEUE@700"]
        );
    }

    #[test]
    fn job_and_pid_filters_keep_only_their_processes() {
        let trace = RecordedTrace::parse(TRACE, "t").unwrap();
        let q = TimelineQuery {
            pid: Some("2".into()),
            ..TimelineQuery::default()
        };
        let answer = ask(&trace, &q, 100).unwrap();
        assert_eq!(names(&answer), ["ALLREDUCE@300"]);
        assert_eq!(
            answer["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["ph"] == "M")
                .count(),
            1
        );
        let q = TimelineQuery {
            job: Some("j1".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            names(&ask(&trace, &q, 100).unwrap()),
            ["ALLREDUCE@100", "ALLREDUCE@300", "QUEUE@700"]
        );
        let q = TimelineQuery {
            pid: Some("gpu0".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(names(&ask(&trace, &q, 100).unwrap()), ["util@650"]);
        let q = TimelineQuery {
            job: Some("nope".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            ask(&trace, &q, 100),
            Err(QueryError::UnknownJob("nope".into()))
        );
    }

    #[test]
    fn jobs_and_processes_come_from_the_process_names() {
        let trace = RecordedTrace::parse(TRACE, "t").unwrap();
        let jobs = trace.jobs();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0]["id"], "j1");
        assert_eq!(jobs[0]["ranks"][1]["pid"], 2);
        assert_eq!(jobs[0]["ranks"][1]["rank"], 1);
        let processes = trace.processes();
        assert_eq!(processes.len(), 3);
        assert_eq!(processes[2]["pid"], "gpu0");
    }

    #[test]
    fn downsampling_keeps_other_events_and_the_longest_thread_states() {
        let mut events = vec![
            json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "p"}}),
            json!({"ph": "X", "cat": "job", "name": "ALLREDUCE", "pid": 1, "tid": 1, "ts": 5.0, "dur": 1.0}),
            json!({"ph": "C", "name": "tcp", "pid": 1, "ts": 6.0, "args": {"tx": 1}}),
        ];
        // Thread states of durations 10, 1, 7, 3 µs at ts 0, 20, 40, 60.
        for (i, dur) in [10.0, 1.0, 7.0, 3.0].into_iter().enumerate() {
            events.push(json!({"ph": "X", "cat": "thread_state", "name": "running",
                "pid": 1, "tid": 2, "ts": 20.0 * i as f64, "dur": dur}));
        }
        let trace = RecordedTrace::from_events(events, Some(100.0), "t").unwrap();
        let q = TimelineQuery {
            downsample: true,
            ..TimelineQuery::default()
        };
        // 6 events, room for 4: the job slice, the counter and the two
        // longest states (10 and 7 µs), in time order.
        let answer = ask(&trace, &q, 4).unwrap();
        let kept: Vec<(String, f64)> = answer["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] != "M")
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_owned(),
                    e["ts"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            kept,
            [
                ("running".to_owned(), 0.0),
                ("ALLREDUCE".to_owned(), 5.0),
                ("tcp".to_owned(), 6.0),
                ("running".to_owned(), 40.0)
            ]
        );
        let note = &answer["metadata"]["downsampled"];
        assert_eq!(note["thread_state_slices_dropped"], 2);
        assert_eq!(note["shortest_kept_us"], 7.0);
        // Under the limit nothing is said; with only room for the others,
        // every state goes; below that it is refused.
        assert!(
            ask(&trace, &q, 6).unwrap()["metadata"]
                .get("downsampled")
                .is_none()
        );
        assert_eq!(
            ask(&trace, &q, 2).unwrap()["traceEvents"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
        assert!(matches!(
            ask(&trace, &q, 1),
            Err(QueryError::TooLarge { .. })
        ));
    }

    #[test]
    fn too_large_ranges_are_refused_and_empty_or_future_windows_hold_nothing() {
        let trace = RecordedTrace::parse(TRACE, "t").unwrap();
        assert_eq!(
            ask(&trace, &TimelineQuery::default(), 3),
            Err(QueryError::TooLarge { count: 4, limit: 3 })
        );
        // from after to, and a window after now (1000 µs): 200, no events,
        // the process names, and why in metadata.empty_window.
        for (from, to) in [(10.0, Some(5.0)), (5_000.0, None), (2_000.0, Some(3_000.0))] {
            let q = TimelineQuery {
                from: Some(TimePoint::At(from)),
                to: to.map(TimePoint::At),
                ..TimelineQuery::default()
            };
            let answer = ask(&trace, &q, 100).unwrap();
            assert!(names(&answer).is_empty(), "{answer}");
            assert_eq!(answer["traceEvents"].as_array().unwrap().len(), 3);
            let why = answer["metadata"]["empty_window"].as_str().unwrap();
            assert!(why.contains("holds nothing"), "{why}");
        }
        // A window that starts before now and ends after it is fine.
        let q = TimelineQuery {
            from: Some(TimePoint::At(690.0)),
            to: Some(TimePoint::At(1e9)),
            ..TimelineQuery::default()
        };
        let answer = ask(&trace, &q, 100).unwrap();
        assert_eq!(names(&answer), ["QUEUE@700"]);
        assert!(answer["metadata"].get("empty_window").is_none());
    }

    #[test]
    fn an_answer_stops_at_its_byte_budget_and_says_so() {
        // 10,000 events of ~100 bytes each: ~1 MB of JSON.
        let events: Vec<Value> = (0..10_000)
            .map(|i| {
                json!({"ph": "X", "cat": "thread_state", "name": "running",
                "pid": 1, "tid": 2, "ts": f64::from(i), "dur": 0.5,
                "args": {"cause": "preempted"}})
            })
            .collect();
        let trace = RecordedTrace::from_events(events, None, "t").unwrap();
        let whole = trace
            .query(
                &TimelineQuery::default(),
                AnswerLimits {
                    max_events: usize::MAX,
                    max_bytes: usize::MAX,
                },
            )
            .unwrap();
        assert_eq!((whole.events, whole.truncated), (10_000, 0));
        assert!(whole.json.len() > 900_000, "{}", whole.json.len());
        let budget = 64 * 1024;
        let cut = trace
            .query(
                &TimelineQuery::default(),
                AnswerLimits {
                    max_events: usize::MAX,
                    max_bytes: budget,
                },
            )
            .unwrap();
        // Under the budget plus the metadata, still valid JSON, the first
        // events in time order, and the rest counted.
        assert!(cut.json.len() <= budget + 1024, "{}", cut.json.len());
        assert!(cut.events > 100 && cut.events < 10_000, "{}", cut.events);
        assert_eq!(cut.events + cut.truncated, 10_000);
        let answer = cut.to_value();
        let kept = answer["traceEvents"].as_array().unwrap();
        assert_eq!(kept.len(), cut.events);
        assert_eq!(kept[0]["ts"], 0.0);
        let note = &answer["metadata"]["truncated"];
        assert_eq!(note["events_left_out"], cut.truncated);
        assert_eq!(note["max_bytes"], budget);
        assert!(
            note["reason"].as_str().unwrap().contains("narrow"),
            "{note}"
        );
        assert!(whole.to_value()["metadata"].get("truncated").is_none());
    }

    #[test]
    fn time_points_accept_exactly_the_documented_pattern() {
        for good in [
            "0",
            "123456",
            "12.5",
            "1234567890123456.123456",
            "now",
            "now-10s",
            "now-500ms",
            "now-350us",
            "now-350µs",
            "now-1m30s",
            "now-2h",
            "now-1d",
            "now-0ns",
        ] {
            assert!(TimePoint::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            " 5",
            "5 ",
            "+5",
            "-5",
            "1e5",
            "5.",
            ".5",
            "inf",
            "NaN",
            "now-",
            "now-10",
            "now-s",
            "now-10 s",
            "now-10sec",
            "now-1s1s1s1s1s1s1s1s1s",
            "now-1234567890s",
            "12345678901234567",
            "1.1234567",
            "now+1s",
            "Now",
        ] {
            assert!(TimePoint::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            TimePoint::parse("now-1m30s").unwrap(),
            TimePoint::BeforeNow(Duration::from_secs(90))
        );
    }

    #[test]
    fn horovod_timelines_still_being_written_are_read_up_to_the_last_complete_event() {
        let text = r#"[
{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "grad_0"}},
{"name": "NEGOTIATE_ALLREDUCE", "ph": "B", "ts": 10, "pid": 0},
{"name": "NEGOTIATE_ALLREDUCE", "ph": "E", "ts": 25, "pid": 0},
{"name": "ALLREDUCE", "ph": "B", "ts": 30, "pid": 0, "args": {"x": "}"}},
{"name": "ALLRED"#;
        let trace = RecordedTrace::parse(text, "horovod").unwrap();
        assert_eq!(trace.len(), 3);
        let answer = ask(&trace, &TimelineQuery::default(), 10).unwrap();
        assert_eq!(
            names(&answer),
            [
                "NEGOTIATE_ALLREDUCE@10",
                "NEGOTIATE_ALLREDUCE@25",
                "ALLREDUCE@30"
            ]
        );
        // A trailing comma and no ']' too.
        let trace =
            RecordedTrace::parse("[{\"ph\":\"X\",\"name\":\"a\",\"ts\":1,\"dur\":1},\n", "h")
                .unwrap();
        assert_eq!(trace.len(), 1);
    }

    #[test]
    fn bad_files_and_time_points_are_clear_errors() {
        assert!(RecordedTrace::parse("hello", "x").is_err());
        assert!(RecordedTrace::parse(r#"{"events": []}"#, "x").is_err());
        assert!(TimePoint::parse("yesterday").is_err());
        assert!(TimePoint::parse("now-forever").is_err());
        assert_eq!(
            TimePoint::parse("now-10s").unwrap(),
            TimePoint::BeforeNow(Duration::from_secs(10))
        );
        assert_eq!(TimePoint::parse("12.5").unwrap(), TimePoint::At(12.5));
        assert!(TimePoint::parse("NaN").is_err());
    }
}
