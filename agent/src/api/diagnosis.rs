//! `api::diagnosis`: `GET /api/jobs/{id}/diagnosis`, what holds a job up.
//!
//! Today it answers for stalls of ringwatch jobs: rank 0's stall check names
//! the tensors some ranks enqueued and others not (`RINGWATCH_STALL_CHECK_SECS`),
//! and this node adds what the missing ranks' threads are doing, from
//! `/proc/<pid>/task/<tid>/{stat,wchan}` (two small files per thread, at most
//! [`MAX_THREADS`] threads per rank). A verdict is a sentence with its
//! numbers, or none: no verdict rather than a wrong one.
//!
//! It only reads: the registry's snapshot and /proc.

use std::path::Path;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiState;
use super::extract::{ApiError, ApiQuery, ErrorBody, NoQuery};
use crate::jobs::{JobKind, JobSnapshot, JobState};

/// The most threads of one rank read and listed.
pub const MAX_THREADS: usize = 256;

/// Where the job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    /// Rank 0's stall check reports tensors waiting for some ranks.
    Stalled,
    /// A ringwatch job whose stall check reports nothing waiting.
    Progressing,
    /// The job is gone (its control connection closed).
    Lost,
    /// A job found from its launcher's variables: it has no stall check, so
    /// whether it progresses is not known here.
    Unknown,
}

/// One tensor the job waits on.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct WaitingTensor {
    /// The tensor's name.
    name: String,
    /// `allreduce`, `allgather` or `broadcast`.
    kind: String,
    /// The ranks that enqueued it and wait.
    waiting_ranks: Vec<usize>,
    /// The ranks that have not enqueued it.
    missing_ranks: Vec<usize>,
    /// How long it had waited when rank 0 reported it, seconds.
    waiting_secs: f64,
}

/// One thread of a missing rank, as /proc has it now.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ThreadNow {
    /// Thread id (this node's pid namespace).
    tid: u32,
    /// The thread's name.
    comm: String,
    /// The kernel's state letter: R running, S sleeping, D in an uninterruptible wait,
    /// T stopped, t stopped by a debugger, Z zombie, I idle.
    state: String,
    /// Where in the kernel it sleeps (`/proc/…/wchan`), when it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    wchan: Option<String>,
}

/// A rank some stalled tensor waits for.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MissingRank {
    /// The rank.
    rank: usize,
    /// Its host.
    host: String,
    /// Its pid on this node; absent on another node or when it could not be mapped.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pid: Option<u32>,
    /// The stalled tensors it is itself enqueued in (ranks that wait for different
    /// tensors enqueued different ones).
    waits_in: Vec<String>,
    /// Its threads now (at most 256); absent when they could not be read here.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    threads: Option<Vec<ThreadNow>>,
    /// What its threads are doing, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    doing: Option<String>,
    /// Why its threads are not listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    not_read: Option<String>,
}

/// What a stalled job waits for.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StallDiagnosis {
    /// When rank 0 reported it, microseconds since the Unix epoch.
    reported_at_unix_us: u64,
    /// The cycle rank 0 was at.
    cycle: u64,
    /// The job's stall check, seconds.
    check_secs: f64,
    /// After this many seconds of stall every rank fails (`RINGWATCH_STALL_SHUTDOWN_SECS`);
    /// absent: the job waits.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    shutdown_after_secs: Option<f64>,
    /// The stalled tensors, longest waiting first.
    tensors: Vec<WaitingTensor>,
    /// Every rank some stalled tensor waits for.
    missing_ranks: Vec<MissingRank>,
}

/// `GET /api/jobs/{id}/diagnosis`'s answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DiagnosisAnswer {
    /// The job's id.
    job_id: String,
    /// This node's name.
    node: String,
    /// Where the job stands.
    progress: Progress,
    /// One sentence with its numbers; absent when there is nothing to say.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    verdict: Option<String>,
    /// What a stalled job waits for.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    stall: Option<StallDiagnosis>,
}

/// What holds a job up: for a stalled ringwatch job, the tensors it waits on,
/// the ranks missing from them and what their threads are doing on this
/// node, and a verdict.
#[utoipa::path(
    get,
    path = "/api/jobs/{id}/diagnosis",
    tag = "node",
    params(
        ("id" = String, Path, min_length = 1, description = "the job's id"),
        NoQuery,
    ),
    responses(
        (status = 200, description = "the diagnosis", body = DiagnosisAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 404, description = "no such job on this node", body = ErrorBody),
        (status = 503, description = "this agent does not follow jobs (--jobs off)", body = ErrorBody),
    )
)]
pub(super) async fn job_diagnosis(
    State(state): State<ApiState>,
    UrlPath(id): UrlPath<String>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<axum::Json<DiagnosisAnswer>, ApiError> {
    let Some(registry) = state.jobs.clone() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this agent does not follow jobs (it runs with --jobs off)",
        ));
    };
    let job = registry
        .jobs()
        .into_iter()
        .find(|j| j.job_id == id)
        .ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, format!("no job {id:?} on this node"))
        })?;
    let node = state.cluster.node_name().to_owned();
    // /proc reads block.
    let answer = tokio::task::spawn_blocking(move || diagnose(&job, node, Path::new("/proc")))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the diagnosis failed: {e}"),
            )
        })?;
    Ok(axum::Json(answer))
}

/// The diagnosis of `job` with its ranks' threads read under `proc`.
pub fn diagnose(job: &JobSnapshot, node: String, proc: &Path) -> DiagnosisAnswer {
    let progress = match (job.state, job.kind, &job.stall) {
        (JobState::Lost, _, _) => Progress::Lost,
        (_, _, Some(report)) if !report.stalled.is_empty() => Progress::Stalled,
        (_, JobKind::Ringwatch, _) => Progress::Progressing,
        _ => Progress::Unknown,
    };
    let stall = job
        .stall
        .as_ref()
        .filter(|_| progress == Progress::Stalled)
        .map(|report| {
            let tensors: Vec<WaitingTensor> = report
                .stalled
                .iter()
                .map(|t| WaitingTensor {
                    name: t.name.clone(),
                    kind: t.kind.clone(),
                    waiting_ranks: t.waiting_ranks.clone(),
                    missing_ranks: t.missing_ranks.clone(),
                    waiting_secs: t.waiting_secs,
                })
                .collect();
            let mut missing: Vec<usize> = tensors
                .iter()
                .flat_map(|t| t.missing_ranks.iter().copied())
                .collect();
            missing.sort_unstable();
            missing.dedup();
            let missing_ranks = missing
                .into_iter()
                .map(|rank| missing_rank(job, rank, &tensors, proc))
                .collect();
            StallDiagnosis {
                reported_at_unix_us: report.at_unix_us,
                cycle: report.cycle,
                check_secs: report.check_secs,
                shutdown_after_secs: report.shutdown_after_secs,
                tensors,
                missing_ranks,
            }
        });
    let verdict = stall.as_ref().and_then(verdict);
    DiagnosisAnswer {
        job_id: job.job_id.clone(),
        node,
        progress,
        verdict,
        stall,
    }
}

fn missing_rank(
    job: &JobSnapshot,
    rank: usize,
    tensors: &[WaitingTensor],
    proc: &Path,
) -> MissingRank {
    let info = job.ranks.iter().find(|r| r.rank == rank);
    let host = info.map(|r| r.host.clone()).unwrap_or_default();
    let waits_in = tensors
        .iter()
        .filter(|t| t.waiting_ranks.contains(&rank))
        .map(|t| t.name.clone())
        .collect();
    let local_pid = info
        .filter(|r| r.host == job.host && r.pid != 0)
        .map(|r| r.pid);
    let (threads, not_read) = match (info, local_pid) {
        (None, _) => (
            None,
            Some(format!("the job did not say where rank {rank} runs")),
        ),
        (Some(r), None) if r.host != job.host => (
            None,
            Some(format!(
                "rank {rank} runs on {}: ask that node's agent (GET /api/jobs/{}/diagnosis there)",
                r.host, job.job_id
            )),
        ),
        (Some(_), None) => (
            None,
            Some(format!("rank {rank}'s pid on this node is not known")),
        ),
        (Some(_), Some(pid)) => match read_threads(proc, pid) {
            Ok(threads) => (Some(threads), None),
            Err(e) => (None, Some(format!("/proc/{pid}: {e}"))),
        },
    };
    let doing = threads.as_deref().map(doing);
    MissingRank {
        rank,
        host,
        pid: local_pid,
        waits_in,
        threads,
        doing,
        not_read,
    }
}

/// The threads of `pid` under `proc` (at most [`MAX_THREADS`]), by tid.
fn read_threads(proc: &Path, pid: u32) -> std::io::Result<Vec<ThreadNow>> {
    let task = proc.join(pid.to_string()).join("task");
    let mut tids: Vec<u32> = std::fs::read_dir(&task)?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    tids.truncate(MAX_THREADS);
    let mut threads = Vec::with_capacity(tids.len());
    for tid in tids {
        // A thread that exits between the listing and the read is left out.
        let Ok(stat) = std::fs::read_to_string(task.join(tid.to_string()).join("stat")) else {
            continue;
        };
        let Some((comm, state)) = parse_stat(&stat) else {
            continue;
        };
        let wchan = std::fs::read_to_string(task.join(tid.to_string()).join("wchan"))
            .ok()
            .map(|w| w.trim().to_owned())
            .filter(|w| !w.is_empty() && w != "0");
        threads.push(ThreadNow {
            tid,
            comm,
            state,
            wchan,
        });
    }
    Ok(threads)
}

/// `(comm, state letter)` from a `/proc/…/stat` line: the name is between the
/// first `(` and the last `)` (it may hold either), the state follows.
fn parse_stat(stat: &str) -> Option<(String, String)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let state = stat.get(close + 1..)?.split_whitespace().next()?.to_owned();
    Some((comm, state))
}

/// What a rank's threads are doing, in words.
fn doing(threads: &[ThreadNow]) -> String {
    let n = threads.len();
    if n == 0 {
        return "no threads (the process is gone)".to_owned();
    }
    let count = |letters: &[&str]| {
        threads
            .iter()
            .filter(|t| letters.contains(&t.state.as_str()))
            .count()
    };
    let stopped = count(&["T", "t"]);
    let running = count(&["R"]);
    let zombie = count(&["Z", "X"]);
    if stopped == n {
        return format!("stopped: all {n} threads (SIGSTOP, or a debugger)");
    }
    if zombie == n {
        return format!("exiting: all {n} threads are zombies");
    }
    if running > 0 {
        return format!(
            "running: {running} of {n} threads on or waiting for a CPU (busy in its own code)"
        );
    }
    let mut where_: Vec<(usize, String)> = Vec::new();
    for t in threads {
        let w = t.wchan.clone().unwrap_or_else(|| "?".into());
        match where_.iter_mut().find(|(_, x)| *x == w) {
            Some((c, _)) => *c += 1,
            None => where_.push((1, w)),
        }
    }
    where_.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let top: Vec<String> = where_
        .iter()
        .take(3)
        .map(|(c, w)| format!("{c} in {w}"))
        .collect();
    let disk = count(&["D"]);
    format!(
        "sleeping: all {n} threads blocked{} ({})",
        if disk > 0 {
            format!(", {disk} in an uninterruptible wait")
        } else {
            String::new()
        },
        top.join(", ")
    )
}

fn verdict(stall: &StallDiagnosis) -> Option<String> {
    let first = stall.tensors.first()?;
    let ranks = |v: &[usize]| {
        let list: Vec<String> = v.iter().map(|r| r.to_string()).collect();
        format!(
            "rank{} {}",
            if v.len() == 1 { "" } else { "s" },
            list.join(", ")
        )
    };
    let mut sentence = format!(
        "stalled for {:.0} s: {} '{}' is enqueued on {} and waits for {}",
        first.waiting_secs,
        first.kind,
        first.name,
        ranks(&first.waiting_ranks),
        ranks(&first.missing_ranks),
    );
    if stall.tensors.len() > 1 {
        sentence.push_str(&format!(" ({} tensors stalled)", stall.tensors.len()));
    }
    // Ranks enqueued in other stalled tensors: they disagree on what comes next.
    let elsewhere: Vec<String> = stall
        .missing_ranks
        .iter()
        .filter(|m| !m.waits_in.is_empty())
        .map(|m| format!("rank {} waits in '{}'", m.rank, m.waits_in[0]))
        .collect();
    if !elsewhere.is_empty() {
        sentence.push_str(&format!(
            "; {}: the ranks enqueued different tensors (uneven data across ranks?)",
            elsewhere.join(", ")
        ));
    }
    for m in &stall.missing_ranks {
        if let (Some(pid), Some(doing)) = (m.pid, &m.doing) {
            sentence.push_str(&format!("; rank {} (pid {pid}) is {doing}", m.rank));
        }
    }
    if let Some(after) = stall.shutdown_after_secs {
        sentence.push_str(&format!(
            "; every rank fails after {after:.0} s of stall (RINGWATCH_STALL_SHUTDOWN_SECS)"
        ));
    }
    Some(sentence)
}

#[cfg(test)]
mod tests {
    use super::*;
    use collectives::control::{RankInfo, StallReport, StalledTensor};

    fn job(stall: Option<StallReport>) -> JobSnapshot {
        let mut j: JobSnapshot = serde_json::from_value(serde_json::json!({
            "job_id": "j", "protocol_version": 1, "world_size": 3, "local_size": 2,
            "ranks": [], "host": "node-0", "served_by_rank": 0, "knobs": null, "cycle": 5,
            "autotune": "off", "state": "connected", "lost_reason": null,
            "last_seen_unix_ms": 0, "stats_received": 0, "timeline_events_received": 0,
            "timeline_events_dropped": 0, "timeline_bytes": 0,
            "timeline_streaming_since_unix_ms": null, "owner_uid": 0, "owner_pid": 1,
            "ns_pids": {}, "id_claimed_twice": false,
        }))
        .expect("a snapshot");
        j.ranks = vec![
            RankInfo {
                rank: 0,
                local_rank: 0,
                local_size: 2,
                host: "node-0".into(),
                pid: 100,
            },
            RankInfo {
                rank: 1,
                local_rank: 1,
                local_size: 2,
                host: "node-0".into(),
                pid: 200,
            },
            RankInfo {
                rank: 2,
                local_rank: 0,
                local_size: 1,
                host: "node-1".into(),
                pid: 300,
            },
        ];
        j.stall = stall;
        j
    }

    fn tensor(name: &str, waiting: &[usize], missing: &[usize], secs: f64) -> StalledTensor {
        StalledTensor {
            name: name.into(),
            kind: "allreduce".into(),
            waiting_ranks: waiting.to_vec(),
            missing_ranks: missing.to_vec(),
            waiting_secs: secs,
        }
    }

    /// A fake /proc: `pid` with threads `(tid, comm, state, wchan)`.
    fn fake_proc(dir: &Path, pid: u32, threads: &[(u32, &str, &str, &str)]) {
        for (tid, comm, state, wchan) in threads {
            let t = dir.join(format!("{pid}/task/{tid}"));
            std::fs::create_dir_all(&t).unwrap();
            std::fs::write(
                t.join("stat"),
                format!("{tid} ({comm}) {state} 1 1 1 0 -1 4194560 0 0 0 0 5 7 0 0 20 0 3 0\n"),
            )
            .unwrap();
            std::fs::write(t.join("wchan"), wchan).unwrap();
        }
    }

    #[test]
    fn a_stopped_rank_is_named_with_its_threads_and_a_rank_elsewhere_is_pointed_to() {
        let dir = test_support::TempDir::new("diagnosis");
        fake_proc(
            dir.path(),
            200,
            &[
                (200, "python3", "T", "do_signal_stop"),
                (201, "rw cycle", "T", "do_signal_stop"),
            ],
        );
        let report = StallReport {
            cycle: 9,
            at_unix_us: 1,
            stalled: vec![tensor("grad.3", &[0], &[1, 2], 95.4)],
            check_secs: 60.0,
            shutdown_after_secs: None,
        };
        let d = diagnose(&job(Some(report)), "node-0".into(), dir.path());
        assert_eq!(d.progress, Progress::Stalled);
        let stall = d.stall.as_ref().unwrap();
        let one = &stall.missing_ranks[0];
        assert_eq!((one.rank, one.pid), (1, Some(200)));
        assert_eq!(one.threads.as_ref().unwrap().len(), 2);
        assert_eq!(
            one.doing.as_deref(),
            Some("stopped: all 2 threads (SIGSTOP, or a debugger)")
        );
        let two = &stall.missing_ranks[1];
        assert!(two.threads.is_none() && two.pid.is_none());
        assert!(
            two.not_read.as_deref().unwrap().contains("runs on node-1"),
            "{two:?}"
        );
        let verdict = d.verdict.unwrap();
        assert_eq!(
            verdict,
            "stalled for 95 s: allreduce 'grad.3' is enqueued on rank 0 and waits for ranks \
             1, 2; rank 1 (pid 200) is stopped: all 2 threads (SIGSTOP, or a debugger)"
        );
    }

    #[test]
    fn ranks_waiting_in_different_tensors_are_called_uneven_and_sleepers_say_where() {
        let dir = test_support::TempDir::new("diagnosis");
        fake_proc(
            dir.path(),
            200,
            &[
                (200, "python3", "S", "futex_wait_queue"),
                (201, "rw cycle", "S", "futex_wait_queue"),
                (202, "rw io", "S", "ep_poll"),
            ],
        );
        let report = StallReport {
            cycle: 9,
            at_unix_us: 1,
            stalled: vec![
                tensor("grad.7", &[0], &[1], 70.0),
                tensor("barrier", &[1], &[0], 65.0),
            ],
            check_secs: 60.0,
            shutdown_after_secs: Some(120.0),
        };
        let mut j = job(Some(report));
        j.ranks.truncate(2);
        let d = diagnose(&j, "node-0".into(), dir.path());
        assert_eq!(
            d.verdict.clone().unwrap(),
            "stalled for 70 s: allreduce 'grad.7' is enqueued on rank 0 and waits for rank 1 \
             (2 tensors stalled); rank 0 waits in 'grad.7', rank 1 waits in 'barrier': the \
             ranks enqueued different tensors (uneven data across ranks?); rank 1 (pid 200) is \
             sleeping: all 3 threads blocked (2 in futex_wait_queue, 1 in ep_poll); every rank \
             fails after 120 s of stall (RINGWATCH_STALL_SHUTDOWN_SECS)"
        );
        // Rank 0's process is not under this /proc: said, not guessed.
        let zero = &d.stall.as_ref().unwrap().missing_ranks[0];
        assert!(
            zero.threads.is_none() && zero.not_read.as_deref().unwrap().starts_with("/proc/100")
        );
    }

    #[test]
    fn a_job_without_a_stall_has_no_verdict() {
        let d = diagnose(&job(None), "node-0".into(), Path::new("/nonexistent"));
        assert_eq!(d.progress, Progress::Progressing);
        assert!(d.verdict.is_none() && d.stall.is_none());
        let mut launched = job(None);
        launched.kind = JobKind::Torchrun;
        assert_eq!(
            diagnose(&launched, "node-0".into(), Path::new("/nonexistent")).progress,
            Progress::Unknown
        );
    }

    #[test]
    fn a_thread_name_with_parentheses_and_spaces_is_read_whole() {
        assert_eq!(
            parse_stat("12 (a (b) c) S 1 2"),
            Some(("a (b) c".to_owned(), "S".to_owned()))
        );
        assert_eq!(parse_stat("garbage"), None);
    }
}
