//! `timeline`: timelines in the Chrome trace event format, and the range
//! queries the API answers with them (`GET /api/timeline`).
//!
//! Today's source is a recorded trace (`serve --replay FILE`: a
//! `RINGWATCH_TIMELINE` file, a Horovod timeline, or any Chrome trace); the
//! live model joins it as another source. Queries are bounded: a range with
//! more events than the limit is refused with a request to narrow it, never
//! answered by exhausting memory. Pure: no I/O but `RecordedTrace::load`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Where a range starts or ends, on the trace's clock (µs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimePoint {
    /// An absolute timestamp in µs.
    At(f64),
    /// The present minus a duration (`now-10s`; `now` is a zero duration).
    BeforeNow(Duration),
}

impl TimePoint {
    /// Parses `123456.5` (µs), `now`, or `now-<duration>` (`now-10s`, `now-500ms`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "now" {
            return Ok(Self::BeforeNow(Duration::ZERO));
        }
        if let Some(ago) = text.strip_prefix("now-") {
            return humantime::parse_duration(ago)
                .map(Self::BeforeNow)
                .map_err(|e| format!("{text:?}: {e} (write e.g. now-10s)"));
        }
        match text.parse::<f64>() {
            Ok(us) if us.is_finite() => Ok(Self::At(us)),
            _ => Err(format!(
                "{text:?} is neither a timestamp in µs nor now-<duration>"
            )),
        }
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
}

/// Why a query could not be answered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QueryError {
    /// `from` is after `to`.
    #[error("the range is empty: from ({from} µs) is after to ({to} µs)")]
    EmptyRange {
        /// Resolved start.
        from: f64,
        /// Resolved end.
        to: f64,
    },
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

    /// "Now" of the trace (µs on its clock): what `now-…` counts back from.
    pub fn now_us(&self) -> f64 {
        self.now_us
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

    /// The events of a range as a Chrome trace, at most `limit` of them.
    pub fn query(&self, query: &TimelineQuery, limit: usize) -> Result<Value, QueryError> {
        let from = query
            .from
            .map_or(f64::NEG_INFINITY, |p| p.resolve(self.now_us));
        let to = query.to.map_or(f64::INFINITY, |p| p.resolve(self.now_us));
        if from > to {
            return Err(QueryError::EmptyRange { from, to });
        }
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
        // Sorted by start: everything after `to` is out; before it, keep what
        // ends at or after `from`.
        let upper = self.events.partition_point(|e| ts(e) <= to);
        let selected: Vec<&Value> = self.events[..upper]
            .iter()
            .filter(|e| end(e) >= from && wanted(e))
            .collect();
        let mut downsampled = Value::Null;
        let selected = if selected.len() <= limit {
            selected
        } else if query.downsample {
            let count = selected.len();
            let (kept, note) =
                downsample(selected, limit).ok_or(QueryError::TooLarge { count, limit })?;
            downsampled = note;
            kept
        } else {
            return Err(QueryError::TooLarge {
                count: selected.len(),
                limit,
            });
        };
        let mut trace_events: Vec<&Value> = self.metadata.iter().filter(|e| wanted(e)).collect();
        trace_events.extend(selected);
        let mut metadata =
            json!({ "now": self.now_us, "source": format!("recorded: {}", self.source) });
        if !downsampled.is_null() {
            metadata["downsampled"] = downsampled;
        }
        Ok(json!({
            "traceEvents": trace_events,
            "displayTimeUnit": "ms",
            "metadata": metadata,
        }))
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
        let all = trace.query(&TimelineQuery::default(), 100).unwrap();
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
            names(&trace.query(&q, 100).unwrap()),
            ["ALLREDUCE@100", "util@650"]
        );
        // now-0.35ms = 650 µs.
        let q = TimelineQuery {
            from: Some(TimePoint::parse("now-350us").unwrap()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            names(&trace.query(&q, 100).unwrap()),
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
        let answer = trace.query(&q, 100).unwrap();
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
            names(&trace.query(&q, 100).unwrap()),
            ["ALLREDUCE@100", "ALLREDUCE@300", "QUEUE@700"]
        );
        let q = TimelineQuery {
            pid: Some("gpu0".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(names(&trace.query(&q, 100).unwrap()), ["util@650"]);
        let q = TimelineQuery {
            job: Some("nope".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            trace.query(&q, 100),
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
        let answer = trace.query(&q, 4).unwrap();
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
            trace.query(&q, 6).unwrap()["metadata"]
                .get("downsampled")
                .is_none()
        );
        assert_eq!(
            trace.query(&q, 2).unwrap()["traceEvents"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
        assert!(matches!(
            trace.query(&q, 1),
            Err(QueryError::TooLarge { .. })
        ));
    }

    #[test]
    fn too_large_and_empty_ranges_are_refused() {
        let trace = RecordedTrace::parse(TRACE, "t").unwrap();
        assert_eq!(
            trace.query(&TimelineQuery::default(), 3),
            Err(QueryError::TooLarge { count: 4, limit: 3 })
        );
        let q = TimelineQuery {
            from: Some(TimePoint::At(10.0)),
            to: Some(TimePoint::At(5.0)),
            ..TimelineQuery::default()
        };
        assert!(matches!(
            trace.query(&q, 100),
            Err(QueryError::EmptyRange { .. })
        ));
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
        let answer = trace.query(&TimelineQuery::default(), 10).unwrap();
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
