//! The job's timeline: Horovod's activity names, and a writer of Chrome-trace JSON files
//! (they open in Perfetto and chrome://tracing).
//!
//! Events are produced only when someone listens (a file or a control-socket subscriber);
//! with neither, the runtime builds no event at all. The file is written by its own thread:
//! this module must never block the cycle thread on disk I/O.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::control::{Phase, TimelineEvent};
use crate::error::{CollectiveError, Result};

/// Horovod's activity names.
pub mod activity {
    /// Rank 0 waits for every rank to report an allreduce tensor ready.
    pub const NEGOTIATE_ALLREDUCE: &str = "NEGOTIATE_ALLREDUCE";
    /// Rank 0 waits for every rank to report an allgather tensor ready.
    pub const NEGOTIATE_ALLGATHER: &str = "NEGOTIATE_ALLGATHER";
    /// Rank 0 waits for every rank to report a broadcast tensor ready.
    pub const NEGOTIATE_BROADCAST: &str = "NEGOTIATE_BROADCAST";
    /// The tensor is ready everywhere and waits for its turn in the cycle.
    pub const QUEUE: &str = "QUEUE";
    /// The tensor is copied into the fusion buffer.
    pub const MEMCPY_IN_FUSION_BUFFER: &str = "MEMCPY_IN_FUSION_BUFFER";
    /// The allreduce runs (`args.algorithm` says which).
    pub const ALLREDUCE: &str = "ALLREDUCE";
    /// The allgather runs.
    pub const ALLGATHER: &str = "ALLGATHER";
    /// The broadcast runs.
    pub const BROADCAST: &str = "BROADCAST";
    /// The result is copied out of the fusion buffer.
    pub const MEMCPY_OUT_FUSION_BUFFER: &str = "MEMCPY_OUT_FUSION_BUFFER";
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Writes timeline events to a Chrome-trace JSON file, from a background thread.
pub struct TimelineFile {
    path: PathBuf,
    tx: Option<mpsc::Sender<Vec<TimelineEvent>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TimelineFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimelineFile")
            .field("path", &self.path)
            .finish()
    }
}

impl TimelineFile {
    /// Creates (truncates) the file at `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let file = std::fs::File::create(path).map_err(|e| {
            CollectiveError::Config(format!(
                "cannot create timeline file {}: {e}",
                path.display()
            ))
        })?;
        let (tx, rx) = mpsc::channel::<Vec<TimelineEvent>>();
        let shown = path.display().to_string();
        let thread = std::thread::Builder::new()
            .name("ringwatch-timeline".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::new(file);
                if let Err(e) = write_trace(&mut out, rx) {
                    tracing::warn!(path = %shown, error = %e, "timeline file write failed; timeline stops");
                }
            })
            .map_err(|e| CollectiveError::Config(format!("cannot start the timeline writer: {e}")))?;
        Ok(TimelineFile {
            path: path.to_path_buf(),
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues events for writing.
    pub fn write(&self, events: Vec<TimelineEvent>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(events);
        }
    }
}

impl Drop for TimelineFile {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write_trace(
    out: &mut impl Write,
    rx: mpsc::Receiver<Vec<TimelineEvent>>,
) -> std::io::Result<()> {
    // One trace "process" per tensor, as Horovod's timeline does; a thread per rank.
    let mut pids: HashMap<String, usize> = HashMap::new();
    out.write_all(b"[\n")?;
    let mut first = true;
    let mut emit = |out: &mut dyn Write, v: serde_json::Value| -> std::io::Result<()> {
        if !first {
            out.write_all(b",\n")?;
        }
        first = false;
        serde_json::to_writer(&mut *out, &v)?;
        Ok(())
    };
    while let Ok(events) = rx.recv() {
        for e in events {
            let next = pids.len() + 1;
            let pid = *pids.entry(e.tensor.clone()).or_insert_with(|| next);
            if pid == next {
                emit(
                    out,
                    serde_json::json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": e.tensor}}),
                )?;
                emit(
                    out,
                    serde_json::json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}),
                )?;
            }
            let ph = match e.phase {
                Phase::Begin => "B",
                Phase::End => "E",
                Phase::Instant => "i",
            };
            let mut v = serde_json::json!({"name": e.activity, "ph": ph, "ts": e.ts_us, "pid": pid, "tid": e.rank});
            if !e.args.is_empty() {
                v["args"] = serde_json::to_value(&e.args)?;
            }
            if e.phase == Phase::Instant {
                v["s"] = "t".into();
            }
            emit(out, v)?;
        }
        out.flush()?;
    }
    out.write_all(b"\n]\n")?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_is_valid_chrome_trace_json() {
        let dir = std::env::temp_dir().join(format!("rw-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        let tl = TimelineFile::create(&path).unwrap();
        let ev = |activity: &str, phase| TimelineEvent {
            rank: 0,
            tensor: "grad.w".into(),
            activity: activity.into(),
            phase,
            ts_us: 10,
            args: Default::default(),
        };
        tl.write(vec![
            ev(activity::ALLREDUCE, Phase::Begin),
            ev(activity::ALLREDUCE, Phase::End),
        ]);
        drop(tl);
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 4);
        assert_eq!(arr[2]["name"], "ALLREDUCE");
        assert_eq!(arr[3]["ph"], "E");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
