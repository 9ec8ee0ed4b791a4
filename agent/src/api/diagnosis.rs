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
    /// A rank's process on this node is stopped (SIGSTOP, a debugger): every rank
    /// waits for it.
    Stopped,
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

/// What the kernel says of a late rank's process now (the live view's window), when the
/// agent watches it with eBPF.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RankEvidence {
    /// Its threads' CPU time, percent of one CPU.
    cpu_pct: f64,
    /// Its threads' mean time off the CPU (blocked: I/O, sleeps, waits), percent.
    off_cpu_pct: f64,
    /// Its threads' run-queue waits, median, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    run_queue_p50_us: Option<f64>,
    /// Its threads' run-queue waits, 99th percentile, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    run_queue_p99_us: Option<f64>,
    /// TCP retransmits of its connections in the window.
    retransmits_in_window: u64,
}

/// Where a late rank's main thread (its training loop) was, sampled from /proc while the
/// diagnosis was made: what tells its own work from its own waits.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct MainThreadSamples {
    /// Samples taken ([`MAIN_THREAD_SAMPLES`], [`MAIN_THREAD_SAMPLE_MS`] apart).
    samples: u32,
    /// On or waiting for a CPU (state R).
    running: u32,
    /// Asleep on a timer (`time.sleep`, a timed wait).
    sleeping: u32,
    /// Waiting on I/O: an uninterruptible wait (D: disk, page faults) or a read of a
    /// file, pipe or socket.
    io: u32,
    /// Waiting on a futex: a lock, a queue, or its own collectives.
    futex: u32,
    /// Anything else.
    other: u32,
    /// Its share of the sampling's wall time on a CPU, from the kernel's
    /// `/proc/<pid>/schedstat` (0–1).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    cpu_share: Option<f64>,
    /// Its share of the sampling's wall time runnable but waiting for a CPU (0–1).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    cpu_wait_share: Option<f64>,
    /// The same share for the job's other ranks' main threads on this node, median.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    others_cpu_wait_share: Option<f64>,
}

/// Why a late rank is late, when its kernel figures say so clearly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LateCause {
    /// Its threads wait for a CPU far longer than the other ranks' here: something else
    /// takes its CPUs.
    CpuContention,
    /// Its connections retransmit far more than the other ranks': a slow or lossy link.
    Network,
    /// Its main thread mostly runs, with no contention: its own work takes longer.
    OwnCompute,
    /// Its main thread mostly sleeps or waits on I/O: its own waits (a data loader, a
    /// timer, a file).
    OwnWaits,
}

/// A rank that enqueued tensors last.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RankLateness {
    /// The rank.
    rank: usize,
    /// Its host.
    host: String,
    /// Its pid on this node, when it runs here.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pid: Option<u32>,
    /// Tensors it enqueued last in the window.
    last_tensors: u64,
    /// Its share of the tensors the job waited for a rank on in the window, 0–1.
    last_share: f64,
    /// How late it was, median over the cycles it was late in, milliseconds.
    late_ms_p50: f64,
    /// How late it was, 90th percentile, milliseconds.
    late_ms_p90: f64,
    /// Its process as the kernel saw it (this node's ranks, with eBPF).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    evidence: Option<RankEvidence>,
    /// Where its main thread was (the rank a verdict names, on this node).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    main_thread: Option<MainThreadSamples>,
    /// Why it is late (the rank a verdict names), when the figures say so clearly.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    cause: Option<LateCause>,
}

/// Which ranks the others waited for, from rank 0's negotiation: a tensor some ranks
/// enqueued in an earlier cycle than the last one did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Lateness {
    /// The window, seconds (the job's statistics of the last minute the agent holds).
    window_secs: f64,
    /// Tensors the job completed in the window.
    tensors: u64,
    /// Of those, the ones the job waited for a rank on (some rank enqueued them a cycle
    /// or more after the first).
    tensors_waited: u64,
    /// Negotiation sees arrivals per cycle: lateness below the cycle time is not seen.
    resolution_ms: f64,
    /// The ranks that were last at least once, most often first.
    ranks: Vec<RankLateness>,
    /// The median figures of the job's other ranks on this node (what the first rank's
    /// are compared with), when the agent watches them.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    others_here: Option<RankEvidence>,
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
    /// Which ranks the others waited for (ringwatch jobs with statistics in the window).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    lateness: Option<Lateness>,
    /// Ranks on this node whose every thread is stopped (state T or t).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stopped_ranks: Vec<usize>,
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
    let stats = registry.recent_stats(&id).unwrap_or_default();
    let live = state.live_view();
    let evidence = move |pid: u32| {
        live.as_ref()?
            .processes
            .iter()
            .find(|p| p.snapshot.pid == pid)
            .map(|p| RankEvidence {
                cpu_pct: p.snapshot.cpu_pct,
                off_cpu_pct: p.snapshot.off_cpu_pct,
                run_queue_p50_us: p.snapshot.run_queue_p50_us,
                run_queue_p99_us: p.snapshot.run_queue_p99_us,
                retransmits_in_window: p.snapshot.retransmits_in_window,
            })
    };
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    // /proc reads block.
    let answer = tokio::task::spawn_blocking(move || {
        let mut answer = diagnose(&job, node, Path::new("/proc"));
        answer.lateness = lateness(&job, &stats, now_us, &evidence);
        // The rank a verdict would name: where its main thread is, and why it is late.
        if let Some(l) = answer.lateness.as_mut()
            && lateness_verdict(l).is_some()
        {
            if let Some(top) = l.ranks.first_mut() {
                let others: Vec<u32> = job
                    .ranks
                    .iter()
                    .filter(|r| r.rank != top.rank && r.host == job.host && r.pid != 0)
                    .map(|r| r.pid)
                    .collect();
                top.main_thread = top
                    .pid
                    .and_then(|pid| sample_main_thread(Path::new("/proc"), pid, &others));
            }
            let cause = late_cause(l).map(|(c, _)| c);
            if let Some(top) = l.ranks.first_mut() {
                top.cause = cause;
            }
        }
        if answer.verdict.is_none() {
            answer.verdict = answer.lateness.as_ref().and_then(lateness_verdict);
        }
        answer
    })
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
    let mut verdict = stall.as_ref().and_then(verdict);
    // A stopped rank sends nothing, so rank 0's stall check (which runs between cycles)
    // never sees it: its threads' state here does.
    let stopped: Vec<(usize, u32, usize)> = job
        .ranks
        .iter()
        .filter(|r| r.host == job.host && r.pid != 0)
        .filter_map(|r| {
            let threads = read_threads(proc, r.pid).ok()?;
            let all =
                !threads.is_empty() && threads.iter().all(|t| t.state == "T" || t.state == "t");
            all.then_some((r.rank, r.pid, threads.len()))
        })
        .collect();
    let mut progress = progress;
    if !stopped.is_empty() && progress != Progress::Lost {
        progress = Progress::Stopped;
        let names: Vec<String> = stopped
            .iter()
            .map(|(rank, pid, n)| {
                let threads = if *n == 1 {
                    "its one thread".to_owned()
                } else {
                    format!("all {n} threads")
                };
                format!("rank {rank} ({}, pid {pid}, {threads})", job.host)
            })
            .collect();
        let stopped_sentence = format!(
            "{} {} stopped (SIGSTOP, or a debugger): every other rank waits for {}; `kill \
             -CONT <pid>` resumes it{}",
            names.join(", "),
            if stopped.len() == 1 { "is" } else { "are" },
            if stopped.len() == 1 { "it" } else { "them" },
            if job.kind == JobKind::Ringwatch {
                ", and the job fails after RINGWATCH_COLLECTIVE_TIMEOUT_SECS, naming it"
            } else {
                ""
            }
        );
        verdict = Some(match verdict {
            Some(v) => format!("{stopped_sentence}; {v}"),
            None => stopped_sentence,
        });
    }
    DiagnosisAnswer {
        job_id: job.job_id.clone(),
        node,
        progress,
        verdict,
        stall,
        lateness: None,
        stopped_ranks: stopped.iter().map(|(rank, _, _)| *rank).collect(),
    }
}

/// The window [`lateness`] looks at.
pub const LATENESS_WINDOW_US: u64 = 60_000_000;

/// Which ranks came last, from the job's statistics of the last
/// [`LATENESS_WINDOW_US`] before `now_us`; `evidence` gives a local pid's kernel figures.
pub fn lateness(
    job: &JobSnapshot,
    stats: &[collectives::control::CycleStats],
    now_us: u64,
    evidence: &dyn Fn(u32) -> Option<RankEvidence>,
) -> Option<Lateness> {
    let from = now_us.saturating_sub(LATENESS_WINDOW_US);
    let window: Vec<_> = stats.iter().filter(|s| s.start_unix_us >= from).collect();
    let first = window.first()?;
    let tensors: u64 = window.iter().map(|s| s.tensors).sum();
    let waited: u64 = window.iter().map(|s| s.tensors_waited).sum();
    if tensors == 0 {
        return None;
    }
    let mut per_rank: std::collections::BTreeMap<usize, (u64, Vec<f64>)> = Default::default();
    for s in &window {
        for l in &s.late {
            let entry = per_rank.entry(l.rank).or_default();
            entry.0 += l.tensors;
            entry
                .1
                .push(l.late_us_sum as f64 / l.tensors.max(1) as f64 / 1000.0);
        }
    }
    let quantile = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        let i = ((v.len() as f64 - 1.0) * q).round() as usize;
        v.get(i).copied().unwrap_or(0.0)
    };
    let mut ranks: Vec<RankLateness> = per_rank
        .into_iter()
        .map(|(rank, (last, mut samples))| {
            let info = job.ranks.iter().find(|r| r.rank == rank);
            let pid = info
                .filter(|r| r.host == job.host && r.pid != 0)
                .map(|r| r.pid);
            RankLateness {
                rank,
                host: info.map(|r| r.host.clone()).unwrap_or_default(),
                pid,
                last_tensors: last,
                last_share: last as f64 / waited.max(1) as f64,
                late_ms_p50: quantile(&mut samples, 0.5),
                late_ms_p90: quantile(&mut samples, 0.9),
                evidence: pid.and_then(evidence),
                main_thread: None,
                cause: None,
            }
        })
        .collect();
    ranks.sort_by(|a, b| {
        b.last_tensors
            .cmp(&a.last_tensors)
            .then(a.rank.cmp(&b.rank))
    });
    let last = window
        .last()
        .map_or(first.start_unix_us, |s| s.start_unix_us + s.duration_us);
    // The other ranks here, for the first one to be compared with.
    let top = ranks.first().map(|r| r.rank);
    let others: Vec<RankEvidence> = job
        .ranks
        .iter()
        .filter(|r| Some(r.rank) != top && r.host == job.host && r.pid != 0)
        .filter_map(|r| evidence(r.pid))
        .collect();
    Some(Lateness {
        window_secs: last.saturating_sub(first.start_unix_us) as f64 / 1e6,
        tensors,
        tensors_waited: waited,
        resolution_ms: first.knobs.cycle_time_us as f64 / 1000.0,
        ranks,
        others_here: median_evidence(&others),
    })
}

/// The element-wise median of `all` (none when empty).
fn median_evidence(all: &[RankEvidence]) -> Option<RankEvidence> {
    if all.is_empty() {
        return None;
    }
    let median = |mut v: Vec<f64>| -> Option<f64> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    };
    Some(RankEvidence {
        cpu_pct: median(all.iter().map(|e| e.cpu_pct).collect()).unwrap_or(0.0),
        off_cpu_pct: median(all.iter().map(|e| e.off_cpu_pct).collect()).unwrap_or(0.0),
        run_queue_p50_us: median(all.iter().filter_map(|e| e.run_queue_p50_us).collect()),
        run_queue_p99_us: median(all.iter().filter_map(|e| e.run_queue_p99_us).collect()),
        retransmits_in_window: median(all.iter().map(|e| e.retransmits_in_window as f64).collect())
            .map_or(0, |m| m as u64),
    })
}

/// How many times [`sample_main_thread`] looks.
pub const MAIN_THREAD_SAMPLES: u32 = 25;
/// How far apart, milliseconds (the samples span half a second).
pub const MAIN_THREAD_SAMPLE_MS: u64 = 20;

/// `(ns on a CPU, ns runnable waiting for one)` of `pid`'s main thread so far.
fn schedstat(proc: &Path, pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(proc.join(pid.to_string()).join("schedstat")).ok()?;
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    Some((fields.next()?.ok()?, fields.next()?.ok()?))
}

/// Where `pid`'s main thread is, [`MAIN_THREAD_SAMPLES`] times, and its shares of the
/// time on a CPU and waiting for one (with `others`' main threads' waiting share over
/// the same time); `None` when it cannot be read (gone, another node's pid namespace).
/// Blocks for about half a second.
pub fn sample_main_thread(proc: &Path, pid: u32, others: &[u32]) -> Option<MainThreadSamples> {
    let dir = proc.join(pid.to_string());
    let mut s = MainThreadSamples::default();
    let started = std::time::Instant::now();
    let mine = schedstat(proc, pid);
    let theirs: Vec<(u32, (u64, u64))> = others
        .iter()
        .filter_map(|&o| Some((o, schedstat(proc, o)?)))
        .collect();
    for i in 0..MAIN_THREAD_SAMPLES {
        if i > 0 {
            std::thread::sleep(std::time::Duration::from_millis(MAIN_THREAD_SAMPLE_MS));
        }
        let Ok(stat) = std::fs::read_to_string(dir.join("stat")) else {
            break;
        };
        let Some((_, state)) = parse_stat(&stat) else {
            break;
        };
        let wchan = std::fs::read_to_string(dir.join("wchan")).unwrap_or_default();
        s.samples += 1;
        *match (state.as_str(), wchan.trim()) {
            ("R", _) => &mut s.running,
            ("D", _) => &mut s.io,
            (_, w) if w.contains("nanosleep") || w.contains("hrtimer") => &mut s.sleeping,
            (_, w) if w.contains("futex") => &mut s.futex,
            (_, w)
                if [
                    "pipe_read",
                    "io_schedule",
                    "folio_wait",
                    "wait_on_page",
                    "sk_wait_data",
                ]
                .iter()
                .any(|x| w.contains(x))
                    || w.contains("_read") =>
            {
                &mut s.io
            }
            _ => &mut s.other,
        } += 1;
    }
    let wall = started.elapsed().as_nanos() as f64;
    let share = |before: (u64, u64), after: (u64, u64)| {
        (
            after.0.saturating_sub(before.0) as f64 / wall,
            after.1.saturating_sub(before.1) as f64 / wall,
        )
    };
    if let (Some(before), Some(after)) = (mine, schedstat(proc, pid))
        && wall > 0.0
    {
        let (on, waiting) = share(before, after);
        s.cpu_share = Some(on.min(1.0));
        s.cpu_wait_share = Some(waiting.min(1.0));
        let mut waits: Vec<f64> = theirs
            .iter()
            .filter_map(|&(o, before)| Some(share(before, schedstat(proc, o)?).1.min(1.0)))
            .collect();
        waits.sort_by(f64::total_cmp);
        s.others_cpu_wait_share = waits.get(waits.len() / 2).copied();
    }
    (s.samples > 0).then_some(s)
}

/// The run-queue wait (µs, p99) at which a rank's threads count as kept from a CPU.
pub const CONTENDED_RUN_QUEUE_US: f64 = 2000.0;
/// The retransmits in a window from which a rank's link counts as lossy.
pub const LOSSY_RETRANSMITS: u64 = 20;
/// How many times the other ranks' figure the late rank's must be.
pub const CAUSE_FACTOR: f64 = 4.0;
/// The share of main-thread samples that names its own waits, and of its wall time on
/// a CPU that names its own work.
pub const MAIN_THREAD_SHARE: f64 = 0.6;
/// The share of its wall time a main thread spends runnable but off a CPU from which
/// its CPUs count as taken (and [`CAUSE_FACTOR`] / 2 times the other ranks').
pub const CONTENDED_WAIT_SHARE: f64 = 0.2;

/// Why the rank `l` names first is late, with the figures that say so: a run-queue wait
/// or retransmits [`CAUSE_FACTOR`] times the other ranks' here (and past a floor), else
/// where its main thread was in most samples. None when nothing stands out.
pub fn late_cause(l: &Lateness) -> Option<(LateCause, String)> {
    let top = l.ranks.first()?;
    let others = l.others_here.as_ref();
    if let Some(e) = &top.evidence {
        let base_rt = others.map_or(0, |o| o.retransmits_in_window);
        if e.retransmits_in_window >= LOSSY_RETRANSMITS
            && e.retransmits_in_window as f64 >= CAUSE_FACTOR * (base_rt + 1) as f64
        {
            return Some((
                LateCause::Network,
                format!(
                    "a slow or lossy link: its connections retransmitted {} TCP segments in \
                     the window{}",
                    e.retransmits_in_window,
                    others.map_or(String::new(), |_| format!(
                        " (the other ranks here: {base_rt})"
                    ))
                ),
            ));
        }
        if let Some(p99) = e.run_queue_p99_us {
            let base = others.and_then(|o| o.run_queue_p99_us);
            if p99 >= CONTENDED_RUN_QUEUE_US
                && base.is_none_or(|b| p99 >= CAUSE_FACTOR * b.max(CONTENDED_RUN_QUEUE_US / 8.0))
            {
                return Some((
                    LateCause::CpuContention,
                    format!(
                        "CPU taken by others: its threads waited for a CPU {:.1} ms at p99{}",
                        p99 / 1000.0,
                        base.map_or(String::new(), |b| format!(
                            " (the other ranks here: {:.1} ms)",
                            b / 1000.0
                        ))
                    ),
                ));
            }
        }
    }
    let m = top.main_thread.as_ref().filter(|m| m.samples >= 10)?;
    if let Some(waiting) = m.cpu_wait_share
        && waiting >= CONTENDED_WAIT_SHARE
        && m.others_cpu_wait_share
            .is_none_or(|o| waiting >= CAUSE_FACTOR / 2.0 * o + 0.05)
    {
        return Some((
            LateCause::CpuContention,
            format!(
                "CPU taken by others: its main thread waited for a CPU {:.0}% of the time{}",
                100.0 * waiting,
                m.others_cpu_wait_share.map_or(String::new(), |o| format!(
                    " (the other ranks here: {:.0}%)",
                    100.0 * o
                ))
            ),
        ));
    }
    let share = |n: u32| f64::from(n) / f64::from(m.samples);
    if share(m.sleeping + m.io) >= MAIN_THREAD_SHARE {
        return Some((
            LateCause::OwnWaits,
            format!(
                "its own waits: its main thread was asleep or waiting on I/O in {:.0}% of {} \
                 samples (asleep {}, I/O {}), e.g. a data loader, a timer or a file",
                100.0 * share(m.sleeping + m.io),
                m.samples,
                m.sleeping,
                m.io
            ),
        ));
    }
    // Running: on a CPU most of the time by the kernel's count (state R alone is also
    // a thread waiting for one).
    let on_cpu = m.cpu_share.unwrap_or(0.0);
    if share(m.running) >= MAIN_THREAD_SHARE && on_cpu >= MAIN_THREAD_SHARE {
        return Some((
            LateCause::OwnCompute,
            format!(
                "its own work: its main thread was on a CPU {:.0}% of the time, with no CPU \
                 contention seen (more data, or a slower input pipeline on the CPU)",
                100.0 * on_cpu
            ),
        ));
    }
    None
}

/// The fewest late tensors in a window that make a verdict.
pub const MIN_LATE_TENSORS: u64 = 20;
/// The share of a window's tensors one rank must be last in for a verdict.
pub const MIN_LAST_SHARE: f64 = 0.6;

/// "rank R was last in …" when one rank was last in most of the window's tensors
/// (at least [`MIN_LAST_SHARE`], and [`MIN_LATE_TENSORS`]) by more than the
/// negotiation's resolution; none otherwise.
fn lateness_verdict(l: &Lateness) -> Option<String> {
    let top = l.ranks.first()?;
    if top.last_tensors < MIN_LATE_TENSORS
        || top.last_share < MIN_LAST_SHARE
        || top.late_ms_p50 < l.resolution_ms.max(1.0)
    {
        return None;
    }
    let mut sentence = format!(
        "rank {} ({}{}) was last in {:.0}% of the {} tensors the job waited for a rank on \
         in the last {:.0} s ({} in all), {:.0} ms late at the median (p90 {:.0} ms)",
        top.rank,
        top.host,
        top.pid.map(|p| format!(", pid {p}")).unwrap_or_default(),
        100.0 * top.last_share,
        l.tensors_waited,
        l.window_secs,
        l.tensors,
        top.late_ms_p50,
        top.late_ms_p90,
    );
    if let Some((_, why)) = late_cause(l) {
        sentence.push_str(&format!("; likely cause: {why}"));
    }
    if let Some(e) = &top.evidence {
        sentence.push_str(&format!(
            "; its threads: {:.0}% of a CPU, {:.0}% off the CPU, run-queue wait p99 {}, {} \
             retransmits",
            e.cpu_pct,
            e.off_cpu_pct,
            e.run_queue_p99_us
                .map_or("unknown".to_owned(), |us| if us >= 1000.0 {
                    format!("{:.1} ms", us / 1000.0)
                } else {
                    format!("{us:.0} µs")
                }),
            e.retransmits_in_window
        ));
    }
    Some(sentence)
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
        assert_eq!(d.progress, Progress::Stopped);
        assert_eq!(d.stopped_ranks, vec![1]);
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
            "rank 1 (node-0, pid 200, all 2 threads) is stopped (SIGSTOP, or a debugger): every \
             other rank waits for it; `kill -CONT <pid>` resumes it, and the job fails after \
             RINGWATCH_COLLECTIVE_TIMEOUT_SECS, naming it; stalled for 95 s: allreduce 'grad.3' \
             is enqueued on rank 0 and waits for ranks 1, 2; rank 1 (pid 200) is stopped: all 2 \
             threads (SIGSTOP, or a debugger)"
        );
    }

    #[test]
    fn a_stopped_rank_is_named_before_any_stall_check_sees_it() {
        // Rank 0's stall check runs between cycles, and a stopped rank holds the cycle:
        // no report comes, and the threads' state is what says it.
        let dir = test_support::TempDir::new("diagnosis-stopped");
        fake_proc(
            dir.path(),
            100,
            &[(100, "python3", "S", "futex_wait_queue")],
        );
        fake_proc(
            dir.path(),
            200,
            &[
                (200, "python3", "t", "ptrace_stop"),
                (201, "rw cycle", "T", "do_signal_stop"),
            ],
        );
        let mut j = job(None);
        j.kind = JobKind::Ringwatch;
        let d = diagnose(&j, "node-0".into(), dir.path());
        assert_eq!(
            (d.progress, d.stopped_ranks.clone()),
            (Progress::Stopped, vec![1])
        );
        assert_eq!(
            d.verdict.as_deref().unwrap(),
            "rank 1 (node-0, pid 200, all 2 threads) is stopped (SIGSTOP, or a debugger): every \
             other rank waits for it; `kill -CONT <pid>` resumes it, and the job fails after \
             RINGWATCH_COLLECTIVE_TIMEOUT_SECS, naming it"
        );
        // One thread still running: not stopped.
        fake_proc(dir.path(), 200, &[(202, "worker", "R", "0")]);
        let d = diagnose(&j, "node-0".into(), dir.path());
        assert_eq!(d.progress, Progress::Progressing);
        assert!(d.stopped_ranks.is_empty() && d.verdict.is_none(), "{d:?}");
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

    fn stats(
        start_us: u64,
        tensors: u64,
        late: &[(usize, u64, u64)],
    ) -> collectives::control::CycleStats {
        collectives::control::CycleStats {
            cycle: 0,
            start_unix_us: start_us,
            duration_us: 1000,
            bytes_reduced: 0,
            bytes_total: 0,
            tensors,
            fused_buffers: 0,
            knobs: collectives::control::Knobs::default(),
            late: late
                .iter()
                .map(|&(rank, n, us)| collectives::control::LateRank {
                    rank,
                    tensors: n,
                    late_us_max: us,
                    late_us_sum: us * n,
                })
                .collect(),
            tensors_waited: late.iter().map(|&(_, n, _)| n).sum(),
            steps: Default::default(),
        }
    }

    #[test]
    fn the_rank_last_in_most_tensors_is_named_with_how_late_and_its_evidence() {
        let now = 100_000_000;
        // 30 cycles of 2 tensors each in the window: rank 1 last in 27 of them, 40–60 ms
        // late; rank 0 last in 3, 5 ms; one cycle before the window does not count.
        let mut all = vec![stats(now - 70_000_000, 2, &[(0, 2, 900_000)])];
        for i in 0..30u64 {
            let late = if i % 10 == 0 {
                vec![(0, 1, 5_000)]
            } else {
                vec![(1, 1, 40_000 + (i % 3) * 10_000)]
            };
            all.push(stats(now - 50_000_000 + i * 1_000_000, 2, &late));
        }
        let j = job(None);
        let evidence = |pid: u32| {
            (pid == 200).then_some(RankEvidence {
                cpu_pct: 12.0,
                off_cpu_pct: 80.0,
                run_queue_p50_us: Some(20.0),
                run_queue_p99_us: Some(1500.0),
                retransmits_in_window: 0,
            })
        };
        let l = lateness(&j, &all, now, &evidence).unwrap();
        assert_eq!(l.tensors, 60);
        assert_eq!(
            l.ranks
                .iter()
                .map(|r| (r.rank, r.last_tensors))
                .collect::<Vec<_>>(),
            vec![(1, 27), (0, 3)]
        );
        assert_eq!(
            (l.ranks[0].late_ms_p50, l.ranks[0].late_ms_p90),
            (50.0, 60.0)
        );
        assert_eq!(l.tensors_waited, 30);
        assert_eq!(
            lateness_verdict(&l).unwrap(),
            "rank 1 (node-0, pid 200) was last in 90% of the 30 tensors the job waited for a \
             rank on in the last 29 s (60 in all), 50 ms late at the median (p90 60 ms); its \
             threads: 12% of a CPU, 80% off the CPU, run-queue wait p99 1.5 ms, 0 retransmits"
        );
        // No verdict from too few tensors, or when no rank is last most of the time.
        let few = lateness(&j, &all[all.len() - 10..], now, &evidence).unwrap();
        assert!(lateness_verdict(&few).is_none(), "{few:?}");
        let mut even: Vec<_> = (0..40u64)
            .map(|i| {
                stats(
                    now - 40_000_000 + i * 1_000_000,
                    1,
                    &[((i % 2) as usize, 1, 30_000)],
                )
            })
            .collect();
        let split = lateness(&j, &even, now, &evidence).unwrap();
        assert!(lateness_verdict(&split).is_none(), "{split:?}");
        // Late by less than the negotiation can see: no verdict.
        even.iter_mut().for_each(|s| {
            s.late = vec![collectives::control::LateRank {
                rank: 1,
                tensors: 1,
                late_us_max: 200,
                late_us_sum: 200,
            }]
        });
        let tiny = lateness(&j, &even, now, &evidence).unwrap();
        assert!(lateness_verdict(&tiny).is_none(), "{tiny:?}");
    }

    fn figures(cpu: f64, rq_p99_us: f64, retransmits: u64) -> RankEvidence {
        RankEvidence {
            cpu_pct: cpu,
            off_cpu_pct: 100.0 - cpu,
            run_queue_p50_us: Some(rq_p99_us / 10.0),
            run_queue_p99_us: Some(rq_p99_us),
            retransmits_in_window: retransmits,
        }
    }

    fn late_one(evidence: Option<RankEvidence>, main: Option<MainThreadSamples>) -> Lateness {
        Lateness {
            window_secs: 30.0,
            tensors: 60,
            tensors_waited: 30,
            resolution_ms: 1.0,
            ranks: vec![RankLateness {
                rank: 1,
                host: "node-0".into(),
                pid: Some(200),
                last_tensors: 27,
                last_share: 0.9,
                late_ms_p50: 50.0,
                late_ms_p90: 60.0,
                evidence,
                main_thread: main,
                cause: None,
            }],
            others_here: None,
        }
    }

    #[test]
    fn a_cause_is_named_only_when_the_late_ranks_figures_stand_out_from_the_others() {
        let cause = |l: &Lateness| late_cause(l).map(|(c, _)| c);
        // Kept from its CPUs: 12 ms at p99 against 0.3 ms on the other ranks here.
        let mut l = late_one(Some(figures(40.0, 12_000.0, 0)), None);
        l.others_here = Some(figures(40.0, 300.0, 0));
        assert_eq!(
            late_cause(&l).unwrap().1,
            "CPU taken by others: its threads waited for a CPU 12.0 ms at p99 (the other ranks \
             here: 0.3 ms)"
        );
        // The whole node is contended alike: not this rank's cause.
        l.others_here = Some(figures(40.0, 5_000.0, 0));
        assert_eq!(cause(&l), None);
        // Alone on the node: the floor decides.
        l.others_here = None;
        assert_eq!(cause(&l), Some(LateCause::CpuContention));
        let l = late_one(Some(figures(40.0, 1_500.0, 0)), None);
        assert_eq!(cause(&l), None, "1.5 ms is under the floor");
        // A lossy link: 50 retransmits against 2.
        let mut l = late_one(Some(figures(40.0, 300.0, 50)), None);
        l.others_here = Some(figures(40.0, 300.0, 2));
        assert_eq!(cause(&l), Some(LateCause::Network));
        l.others_here = Some(figures(40.0, 300.0, 20));
        assert_eq!(cause(&l), None, "everyone retransmits");
        // Its main thread: asleep (or reading) most of the time, or running.
        let main = |running, sleeping, io, futex| MainThreadSamples {
            samples: 25,
            running,
            sleeping,
            io,
            futex,
            other: 25 - running - sleeping - io - futex,
            cpu_share: Some(f64::from(running) / 25.0),
            cpu_wait_share: Some(0.01),
            others_cpu_wait_share: Some(0.01),
        };
        let quiet = Some(figures(10.0, 300.0, 0));
        let l = late_one(quiet.clone(), Some(main(2, 14, 4, 5)));
        assert_eq!(
            late_cause(&l).unwrap().1,
            "its own waits: its main thread was asleep or waiting on I/O in 72% of 25 samples \
             (asleep 14, I/O 4), e.g. a data loader, a timer or a file"
        );
        assert_eq!(
            cause(&late_one(quiet.clone(), Some(main(20, 1, 0, 4)))),
            Some(LateCause::OwnCompute)
        );
        assert_eq!(
            cause(&late_one(quiet.clone(), Some(main(10, 5, 0, 10)))),
            None
        );
        // State R all the time, but half of it waiting for a CPU that another process
        // holds (the kernel's schedstat): contention, not its own work.
        let mut shared = main(25, 0, 0, 0);
        shared.cpu_share = Some(0.5);
        shared.cpu_wait_share = Some(0.48);
        shared.others_cpu_wait_share = Some(0.1);
        assert_eq!(
            late_cause(&late_one(quiet.clone(), Some(shared.clone())))
                .unwrap()
                .1,
            "CPU taken by others: its main thread waited for a CPU 48% of the time (the other \
             ranks here: 10%)"
        );
        // Every rank here waits as much: the node is busy, not this rank's cause.
        shared.others_cpu_wait_share = Some(0.4);
        assert_eq!(cause(&late_one(quiet.clone(), Some(shared))), None);
        // Too few samples (the process went away): nothing.
        let mut few = main(0, 5, 0, 0);
        few.samples = 5;
        few.other = 0;
        assert_eq!(cause(&late_one(quiet, Some(few))), None);
    }

    #[test]
    fn main_thread_samples_sort_states_and_wait_channels() {
        let dir = test_support::TempDir::new("diagnosis-main");
        let proc = dir.path();
        let at = |state: &str, wchan: &str| {
            let d = proc.join("300");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("stat"), format!("300 (python3) {state} 1 1 1\n")).unwrap();
            std::fs::write(d.join("wchan"), wchan).unwrap();
            sample_main_thread(proc, 300, &[]).unwrap()
        };
        let s = at("S", "hrtimer_nanosleep");
        assert_eq!(
            (s.samples, s.sleeping),
            (MAIN_THREAD_SAMPLES, MAIN_THREAD_SAMPLES)
        );
        assert_eq!(at("R", "0").running, MAIN_THREAD_SAMPLES);
        assert_eq!(at("D", "io_schedule").io, MAIN_THREAD_SAMPLES);
        assert_eq!(at("S", "pipe_read").io, MAIN_THREAD_SAMPLES);
        assert_eq!(at("S", "futex_wait_queue").futex, MAIN_THREAD_SAMPLES);
        assert_eq!(at("S", "do_epoll_wait").other, MAIN_THREAD_SAMPLES);
        assert!(
            sample_main_thread(proc, 301, &[]).is_none(),
            "no such process"
        );
        // The kernel's counts: no schedstat, no shares; a schedstat that does not move
        // (this fake one), shares of 0.
        assert_eq!(at("S", "x").cpu_share, None);
        std::fs::write(proc.join("300/schedstat"), "5000 7000 3\n").unwrap();
        let s = sample_main_thread(proc, 300, &[300]).unwrap();
        assert_eq!(
            (s.cpu_share, s.cpu_wait_share, s.others_cpu_wait_share),
            (Some(0.0), Some(0.0), Some(0.0))
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
