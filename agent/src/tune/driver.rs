//! The session's thread: opens its own control connection to the job, claims
//! its tuning, runs `tuner::session::TuningSession` over it (apply knobs,
//! feed cycles, judge windows here and on the job's other nodes), pins the
//! best knobs, releases the claim and writes the report.
//!
//! It must never run on a tokio worker, and never touch a job after its
//! connection broke: the job keeps the knobs it has.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use collectives::control::{ControlClient, ControlError, ServerMessage};
use tuner::session::{CycleObservation, Step, StepMarks, TuningSession, Verdict, Window};

use super::disturbance::{
    DisturbanceCheck, UNOBSERVED_SUB_WINDOWS, WindowLoad, WindowRates, disturbance_reason,
};
use super::knobs::{full_update, to_wire_knobs};
use super::request::{
    BestView, ConfirmationView, ConfirmationWindowView, ResolvedConfig, SampleView, SessionState,
    SessionView, WindowView, unix_ms,
};
use super::tuning::{Handle, KnobsOnStop, StartError, TuningSessions, fail};
use crate::jobs::JobSnapshot;
use crate::reports::{ReportMeta, report_id};

/// A node of a multi-node job whose agent judges the job's windows there.
pub(super) struct PeerNode {
    pub(super) addr: String,
    pub(super) node: String,
    pub(super) usual: Vec<WindowRates>,
}

impl TuningSessions {
    /// The agents of `job`'s other hosts (those that list it), when it has
    /// other hosts and this agent has peers.
    pub(super) fn peer_nodes(&self, job: &JobSnapshot) -> Vec<PeerNode> {
        if job.hosts().len() < 2 {
            return Vec::new();
        }
        let Some((cluster, runtime)) = self.cluster.lock().ok().and_then(|c| c.clone()) else {
            return Vec::new();
        };
        if !cluster.has_peers() {
            tracing::info!(
                job_id = job.job_id,
                hosts = ?job.hosts(),
                "a multi-node job, but this agent has no peers (--peers, --peers-dns): only \
                 this node's ranks are judged"
            );
            return Vec::new();
        }
        let answers =
            runtime.block_on(cluster.ask_all("/api/jobs", crate::cluster::MAX_SMALL_ANSWER_BYTES));
        let mut nodes = Vec::new();
        for answer in answers {
            let lists_job = answer.result.as_ref().ok().is_some_and(|v| {
                v.get("jobs")
                    .and_then(serde_json::Value::as_array)
                    .is_some_and(|jobs| {
                        jobs.iter().any(|j| {
                            j.get("job_id").and_then(serde_json::Value::as_str)
                                == Some(job.job_id.as_str())
                        })
                    })
            });
            if lists_job {
                nodes.push(PeerNode {
                    node: answer.node.clone().unwrap_or_else(|| answer.addr.clone()),
                    addr: answer.addr,
                    usual: Vec::new(),
                });
            } else if let Err(why) = &answer.result {
                tracing::warn!(
                    peer = answer.addr,
                    why,
                    "a peer did not answer: its node's windows are not judged"
                );
            }
        }
        tracing::info!(
            job_id = job.job_id,
            nodes = ?nodes.iter().map(|n| n.node.as_str()).collect::<Vec<_>>(),
            "the job's windows are judged on these nodes too"
        );
        nodes
    }

    /// One peer's verdict on a window: its node's load (asked on its clock),
    /// judged against that node's usual rates.
    pub(super) fn judge_on_peer(
        &self,
        peer: &mut PeerNode,
        job_id: &str,
        window: &Window,
    ) -> Option<String> {
        let (cluster, runtime) = self.cluster.lock().ok().and_then(|c| c.clone())?;
        let answer = runtime.block_on(async {
            let clock = cluster.clock(&peer.addr).await?;
            let shift = |us: u64| (us as f64 + clock.offset_us).max(0.0) as u64;
            let path = format!(
                "/api/jobs/{job_id}/load?from_unix_us={}&to_unix_us={}",
                shift(window.start_unix_us),
                shift(window.end_unix_us)
            );
            crate::cluster::get_json(&peer.addr, &path, cluster.timeout() * 2, 1 << 20).await
        });
        let load: WindowLoad = match answer.and_then(|v| {
            serde_json::from_value(v).map_err(|e| format!("its load answer is malformed: {e}"))
        }) {
            Ok(load) => load,
            Err(why) => {
                tracing::info!(
                    node = peer.node,
                    why,
                    "no figures from this node for the window: judged without them"
                );
                return None;
            }
        };
        let reason = disturbance_reason(&load, &peer.usual);
        peer.usual.push(load.rates());
        reason.map(|r| format!("node {}: {r}", peer.node))
    }
}

impl TuningSessions {
    /// The session's thread: runs it to the end and records how it ended.
    pub(super) fn drive(
        &self,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: tokio::sync::oneshot::Sender<Result<SessionView, StartError>>,
    ) {
        let job_id = job.job_id.clone();
        let span = tracing::info_span!("tuning", job_id);
        let _entered = span.enter();
        let mut ready = Some(ready);
        // A panic anywhere in the session (a bug, or a figure no check
        // caught) ends it as failed like any other error: the slot is free
        // again, and the starter hears why.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run_session(handle, job, config, &mut ready)
        }))
        .unwrap_or_else(|payload| {
            Err(SessionFailure::Failed(format!(
                "the tuning session panicked: {}",
                panic_message(payload.as_ref())
            )))
        });
        match result {
            Ok(()) => {}
            Err(SessionFailure::BeforeStart(error)) => {
                fail(handle, error.to_string());
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(error));
                }
            }
            Err(SessionFailure::Failed(message)) => {
                tracing::warn!(message, "tuning session failed");
                fail(handle, message.clone());
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(StartError::Unavailable(message)));
                }
            }
        }
    }

    pub(super) fn run_session(
        &self,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: &mut Option<tokio::sync::oneshot::Sender<Result<SessionView, StartError>>>,
    ) -> Result<(), SessionFailure> {
        let job_id = &job.job_id;
        let limits = &self.limits;
        let mut client =
            ControlClient::connect(&job.socket, limits.connect_timeout).map_err(|e| {
                SessionFailure::BeforeStart(StartError::Unavailable(format!(
                    "cannot connect to job {job_id}'s control socket {}: {e}",
                    job.socket.display()
                )))
            })?;
        client
            .claim_tuning(limits.connect_timeout)
            .map_err(|e| match e {
                ControlError::Server(message) => SessionFailure::BeforeStart(StartError::Conflict(
                    format!("job {job_id} refused the tuning claim: {message}"),
                )),
                other => SessionFailure::BeforeStart(StartError::Unavailable(format!(
                    "claiming job {job_id}'s tuning failed: {other}"
                ))),
            })?;
        // From here on the claim is ours: every way out releases it (or the
        // connection breaks, which the job sees as an interrupted claim).
        with_the_claim(&mut client, handle, limits.apply_timeout, |client| {
            self.run_claimed(client, handle, job, config, ready)
        })
    }

    /// The session proper, with the job's claim held on `client`.
    pub(super) fn run_claimed(
        &self,
        client: &mut ControlClient,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: &mut Option<tokio::sync::oneshot::Sender<Result<SessionView, StartError>>>,
    ) -> Result<(), SessionFailure> {
        let job_id = &job.job_id;
        let limits = &self.limits;
        let broken = |what: &str, e: ControlError| match e {
            ControlError::Server(message) => SessionFailure::Failed(format!(
                "job {job_id} refused a request while {what}: {message}; it keeps the knobs it has"
            )),
            e => SessionFailure::Failed(format!(
                "lost the control connection to job {job_id} while {what}: {e}; the job keeps \
                 the knobs it had"
            )),
        };
        let (start_knobs, _) = client
            .get_knobs(limits.connect_timeout)
            .map_err(|e| broken("reading its knobs", e))?;
        client
            .subscribe(true, false)
            .map_err(|e| broken("subscribing to its statistics", e))?;
        let mut session_config = config.session_config(&start_knobs);
        if !matches!(self.disturbance, DisturbanceCheck::Ebpf(_)) {
            // Nothing tells this session which windows were disturbed:
            // score each by the median of three runs of its cycles.
            session_config.sub_windows = UNOBSERVED_SUB_WINDOWS;
        }
        let mut session = match TuningSession::new(session_config) {
            Ok(session) => session,
            Err(e) => {
                let _ = client.release_tuning(false, limits.connect_timeout);
                return Err(SessionFailure::BeforeStart(StartError::BadRequest(
                    format!("bad tuning configuration: {e}"),
                )));
            }
        };
        {
            let mut view = handle.view();
            view.start_knobs = start_knobs;
            view.current_knobs = start_knobs;
        }
        if let Some(ready) = ready.take() {
            let _ = ready.send(Ok(handle.view().clone()));
        }
        tracing::info!(
            budget = config.budget,
            ?start_knobs,
            "tuning session started"
        );

        let started = Instant::now();
        // The job's ranks on this node (eBPF sees only those).
        let pids: BTreeSet<u32> = job
            .local_ranks()
            .filter(|r| r.pid != 0)
            .map(|r| r.pid)
            .collect();
        let mut usual: Vec<WindowRates> = Vec::new();
        // The job's other nodes (a multi-node job, with peers), judged there.
        let mut peers = if matches!(self.disturbance, DisturbanceCheck::Ebpf(_)) {
            self.peer_nodes(job)
        } else {
            Vec::new()
        };
        let mut last_work = Instant::now();
        let mut stopped: Option<KnobsOnStop> = None;
        loop {
            if let Some(keep) = handle.stop_request() {
                session.stop();
                stopped = Some(keep);
                break;
            }
            match session.next_step() {
                Step::Done => break,
                Step::Apply(knobs) => {
                    let wire = to_wire_knobs(&knobs);
                    let (applied, first_cycle) = client
                        .set_knobs(full_update(&wire), limits.apply_timeout)
                        .map_err(|e| broken("applying knobs", e))?;
                    tracing::debug!(?applied, first_cycle, "knobs applied");
                    handle.view().current_knobs = applied;
                    session.applied(first_cycle).map_err(|e| {
                        SessionFailure::Failed(format!("the tuner refused the applied knobs: {e}"))
                    })?;
                    last_work = Instant::now();
                }
                Step::Measure => {
                    let message = client
                        .next_message(Duration::from_millis(250))
                        .map_err(|e| broken("reading its statistics", e))?;
                    let Some(ServerMessage::CycleStats(stats)) = message else {
                        if last_work.elapsed() > limits.idle_timeout {
                            return Err(SessionFailure::Failed(format!(
                                "job {job_id} reported no cycle with work for {:?} (is it idle \
                                 or finishing?); the session ends, the job keeps its knobs",
                                limits.idle_timeout
                            )));
                        }
                        continue;
                    };
                    last_work = Instant::now();
                    let observation = CycleObservation {
                        cycle: stats.cycle,
                        start_unix_us: stats.start_unix_us,
                        duration_us: stats.duration_us,
                        bytes_reduced: stats.bytes_reduced,
                        steps: StepMarks {
                            count: stats.steps.count,
                            first_unix_us: stats.steps.first_unix_us,
                            last_unix_us: stats.steps.last_unix_us,
                        },
                    };
                    let Some(window) = session.observe_cycle(&observation) else {
                        continue;
                    };
                    let mut disturbed = self.judge_window(handle, &window, &pids, &mut usual);
                    if !peers.is_empty() {
                        // Every node's verdict, each named.
                        let mut reasons: Vec<String> = disturbed
                            .take()
                            .map(|r| format!("node {}: {r}", self.node_name()))
                            .into_iter()
                            .collect();
                        for peer in &mut peers {
                            reasons.extend(self.judge_on_peer(peer, job_id, &window));
                        }
                        disturbed = (!reasons.is_empty()).then(|| reasons.join("; "));
                    }
                    let wall_time_s = started.elapsed().as_secs_f64();
                    let verdict = session
                        .judge(&window, disturbed.clone(), wall_time_s)
                        .map_err(|e| {
                            SessionFailure::Failed(format!("the tuner refused a window: {e}"))
                        })?;
                    match verdict {
                        Verdict::Remeasure => {
                            tracing::info!(
                                reason = disturbed.as_deref().unwrap_or(""),
                                "window disturbed; measuring again"
                            );
                        }
                        Verdict::Repeat => {
                            tracing::info!(
                                score = window.score,
                                unit = window.objective.unit(),
                                "the start's first window; measuring a second (the faster is kept)"
                            );
                        }
                        Verdict::Sample(index) => {
                            if let Some(sample) = session.samples().get(index) {
                                tracing::info!(
                                    index,
                                    score = sample.score,
                                    unit = window.objective.unit(),
                                    knobs = ?to_wire_knobs(&sample.knobs),
                                    "sample"
                                );
                            }
                        }
                        Verdict::Confirmation(index) => {
                            if let Some(c) = session.confirmation() {
                                log_confirmation(c, index);
                            }
                        }
                    }
                    update_view(&mut handle.view(), &session);
                }
            }
        }

        // The end: pin the chosen knobs, release the claim, write the report.
        let keep = stopped.unwrap_or(KnobsOnStop::Best);
        let pinned = match keep {
            KnobsOnStop::Start => Some(start_knobs),
            KnobsOnStop::Best => session.best().map(|best| to_wire_knobs(&best.knobs)),
        };
        if let Some(knobs) = pinned {
            let (applied, _) = client
                .set_knobs(full_update(&knobs), limits.apply_timeout)
                .map_err(|e| broken("pinning the chosen knobs", e))?;
            handle.view().current_knobs = applied;
            tracing::info!(?applied, "pinned the chosen knobs");
        }
        client
            .release_tuning(true, limits.connect_timeout)
            .map_err(|e| broken("releasing the tuning claim", e))?;
        handle
            .released
            .store(true, std::sync::atomic::Ordering::Release);
        let state = if stopped.is_some() {
            SessionState::Stopped
        } else {
            SessionState::Done
        };
        {
            let mut view = handle.view();
            update_view(&mut view, &session);
            view.stop_reason = match (stopped, session.stop_reason()) {
                (Some(_), _) => Some("stopped".to_owned()),
                (None, Some(reason)) => Some(format!("{reason:?}").to_lowercase()),
                (None, None) => None,
            };
        }
        let report = if session.samples().is_empty() {
            None
        } else {
            match self.write_report(&session, &handle.view(), state) {
                Ok(id) => Some(id),
                Err(error) => {
                    return Err(SessionFailure::Failed(format!(
                        "the session ended (knobs pinned) but its report could not be written: \
                         {error:#}"
                    )));
                }
            }
        };
        let mut view = handle.view();
        view.report_id = report;
        view.state = state;
        tracing::info!(state = ?state, report = view.report_id.as_deref().unwrap_or("none"), speedup = view.speedup_over_start, "tuning session ended");
        Ok(())
    }

    /// This node's name among its peers.
    pub(super) fn node_name(&self) -> String {
        self.cluster
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|(c, _)| c.node_name().to_owned()))
            .unwrap_or_else(crate::jobs::host_name)
    }

    /// eBPF's verdict on a window; also keeps the run-queue baseline.
    pub(super) fn judge_window(
        &self,
        handle: &Handle,
        window: &Window,
        pids: &BTreeSet<u32>,
        usual: &mut Vec<WindowRates>,
    ) -> Option<String> {
        let DisturbanceCheck::Ebpf(feed) = &self.disturbance else {
            return None;
        };
        // The feed copies the model a few times a second: wait (a little)
        // until it has read past the window's end. A window it has not
        // read whole (serve's loop is behind) is not judged: a verdict on
        // part of it would be noise. A session asked to stop does not wait:
        // an agent that is stopping reads no more figures, and meanwhile
        // the job's statistics pile up unread (a job closes a client that
        // falls 4 MiB behind, which a fast job reaches within a second).
        let deadline = Instant::now() + Duration::from_millis(1_500);
        while !feed.covers(window.end_unix_us) {
            if Instant::now() >= deadline || handle.stop_request().is_some() {
                tracing::info!(
                    first_cycle = window.first_cycle,
                    last_cycle = window.last_cycle,
                    "the eBPF figures for this window are not read yet (serve's loop is \
                     behind): the window is not judged"
                );
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let load = feed.window(pids, window.start_unix_us, window.end_unix_us)?;
        let reason = disturbance_reason(&load, usual);
        tracing::debug!(
            run_queue_ms_per_s = load.run_queue_ms_per_s(),
            retransmits = load.retransmits(),
            span_s = load.span_s,
            pids = load.pids.len(),
            disturbed = reason.as_deref().unwrap_or("no"),
            "window load (eBPF)"
        );
        usual.push(load.rates());
        reason
    }

    pub(super) fn write_report(
        &self,
        session: &TuningSession,
        view: &SessionView,
        state: SessionState,
    ) -> anyhow::Result<String> {
        use anyhow::Context;
        let created_unix_ms = unix_ms();
        let id = report_id(&view.job_id, created_unix_ms);
        let title = format!("ringwatch tuning of job {}", view.job_id);
        let files =
            tuner::report::write_report(&session.report_data(), self.reports.dir(), &id, &title)
                .with_context(|| {
                    format!("writing report {id} into {}", self.reports.dir().display())
                })?;
        let state_name = match state {
            SessionState::Running => "running",
            SessionState::Done => "done",
            SessionState::Stopped => "stopped",
            SessionState::Failed => "failed",
        };
        self.reports.write_meta(&ReportMeta {
            id: id.clone(),
            job_id: view.job_id.clone(),
            created_unix_ms,
            samples: view.samples.len(),
            best: view.best.as_ref().map(|b| b.knobs),
            speedup_over_start: view.speedup_over_start,
            state: state_name.to_owned(),
            disturbance_detection: view.disturbance_detection.clone(),
            start_knobs: view.start_knobs,
        })?;
        tracing::info!(html = %files.html.display(), "tuning report written");
        Ok(id)
    }
}

pub(super) enum SessionFailure {
    /// Before the claim was ours: answered to the starter.
    BeforeStart(StartError),
    /// After: the session failed.
    Failed(String),
}

/// Runs `session` with the job's claim held on `client`, and releases the
/// claim when it fails. A panic in it fails the session too, and since its
/// state is not to be trusted then, the job goes back to the knobs it had
/// when the session started (`handle`'s `start_knobs`).
pub(super) fn with_the_claim(
    client: &mut ControlClient,
    handle: &Handle,
    apply_timeout: Duration,
    session: impl FnOnce(&mut ControlClient) -> Result<(), SessionFailure>,
) -> Result<(), SessionFailure> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| session(client)))
        .unwrap_or_else(|payload| {
            let why = panic_message(payload.as_ref());
            if handle.released.load(std::sync::atomic::Ordering::Acquire) {
                tracing::error!(why, "the tuning session panicked after it released the job");
                return Err(SessionFailure::Failed(format!(
                    "the tuning session panicked after it pinned the job's knobs and released \
                     it ({why}); the job keeps them"
                )));
            }
            tracing::error!(
                why,
                "the tuning session panicked; the job goes back to its start knobs"
            );
            let start = handle.view().start_knobs;
            let back = match client.set_knobs(full_update(&start), apply_timeout) {
                Ok((applied, _)) => {
                    handle.view().current_knobs = applied;
                    "the job is back on its start knobs".to_owned()
                }
                Err(e) => format!("setting the job back to its start knobs failed: {e}"),
            };
            Err(SessionFailure::Failed(format!(
                "the tuning session panicked ({why}); {back}"
            )))
        });
    if result.is_err() && !handle.released.load(std::sync::atomic::Ordering::Acquire) {
        // Best effort: a broken connection already ended the claim.
        let _ = client.release_tuning(false, Duration::from_secs(2));
    }
    result
}

/// What a panic said (its `&str` or `String` payload), for the session's error.
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Logs one confirmation window, and the verdict once it is in.
pub(super) fn log_confirmation(c: &tuner::session::Confirmation, index: usize) {
    if let Some(w) = c.windows.get(index) {
        tracing::info!(
            index,
            candidate = ?w.candidate,
            score = w.score,
            "confirmation window (the choice and the start, interleaved)"
        );
    }
    if let (Some(kept), Some(choice), Some(start)) = (c.kept, c.choice_median, c.start_median) {
        tracing::info!(
            ?kept,
            choice_median = choice,
            start_median = start,
            required_gain = c.required_gain.unwrap_or(0.0),
            "confirmation decided"
        );
    }
}

/// Copies the session's samples and best into the view.
pub(super) fn update_view(view: &mut SessionView, session: &TuningSession) {
    view.samples = session
        .samples()
        .iter()
        .map(|s| SampleView {
            index: s.index,
            knobs: to_wire_knobs(&s.knobs),
            score: s.score,
            noise_hint: s.noise_hint,
            disturbed: s.disturbed.clone(),
            remeasured_because: s.remeasured_because.clone(),
            wall_time_s: s.wall_time_s,
            window: WindowView {
                first_cycle: s.window.first_cycle,
                last_cycle: s.window.last_cycle,
                cycles: s.window.cycles,
                duration_s: s.window.duration_s(),
            },
        })
        .collect();
    view.best = session.best().map(|b| BestView {
        knobs: to_wire_knobs(&b.knobs),
        predicted_score: b.predicted_score,
        sample: b.sample,
    });
    view.speedup_over_start = session.speedup_over_start();
    view.objective = session.objective().map(Into::into);
    view.confirmation = session.confirmation().map(|c| ConfirmationView {
        choice: to_wire_knobs(&c.choice),
        choice_sample: c.choice_sample,
        windows: c
            .windows
            .iter()
            .map(|w| ConfirmationWindowView {
                candidate: w.candidate.into(),
                score: w.score,
                disturbed: w.disturbed.clone(),
                wall_time_s: w.wall_time_s,
            })
            .collect(),
        choice_median: c.choice_median,
        start_median: c.start_median,
        required_gain: c.required_gain,
        kept: c.kept.map(Into::into),
    });
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::sync::Mutex;

    use collectives::control::{
        AutotuneState, ClientMessage, Hello, Knobs, PROTOCOL_VERSION, read_message, write_message,
    };

    use super::super::request::TuningRequest;
    use super::*;

    /// A job's control socket that grants the claim, applies knobs and
    /// accepts the release, and tells what it was asked.
    fn fake_job(path: &std::path::Path) -> std::thread::JoinHandle<Vec<ClientMessage>> {
        let listener = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let hello = Hello {
                protocol_version: PROTOCOL_VERSION,
                job_id: "panicky".into(),
                world_size: 1,
                local_size: 1,
                ranks: Vec::new(),
                knobs: Knobs::default(),
                cycle: 0,
                autotune: AutotuneState::default(),
                host: None,
                served_by_rank: None,
            };
            write_message(&mut conn, &ServerMessage::Hello(hello)).unwrap();
            let mut asked = Vec::new();
            while let Ok(message) = read_message::<_, ClientMessage>(&mut conn) {
                let answer = match &message {
                    ClientMessage::ClaimTuning { request_id }
                    | ClientMessage::ReleaseTuning { request_id, .. } => {
                        ServerMessage::TuningClaim {
                            request_id: *request_id,
                            granted: true,
                            state: AutotuneState::default(),
                            message: String::new(),
                        }
                    }
                    ClientMessage::SetKnobs { request_id, knobs } => ServerMessage::KnobsApplied {
                        request_id: *request_id,
                        knobs: Knobs {
                            fusion_threshold_bytes: knobs.fusion_threshold_bytes.unwrap_or(0),
                            cycle_time_us: knobs.cycle_time_us.unwrap_or(0),
                            hierarchical_allreduce: knobs.hierarchical_allreduce.unwrap_or(false),
                        },
                        applied_at_cycle: 9,
                    },
                    _ => continue,
                };
                asked.push(message);
                write_message(&mut conn, &answer).unwrap();
            }
            asked
        })
    }

    #[test]
    fn a_panic_fails_the_session_and_puts_the_job_back_on_its_start_knobs() {
        let dir = tempfile_dir();
        let socket = dir.join("panicky.sock");
        let job = fake_job(&socket);
        let start = Knobs {
            fusion_threshold_bytes: 1 << 20,
            cycle_time_us: 2_500,
            hierarchical_allreduce: false,
        };
        let config = TuningRequest::default().resolve();
        let handle = Handle {
            view: Mutex::new(SessionView {
                job_id: "panicky".into(),
                state: SessionState::Running,
                error: None,
                started_unix_ms: 0,
                config,
                start_knobs: start,
                current_knobs: Knobs::default(),
                samples: Vec::new(),
                best: None,
                speedup_over_start: None,
                report_id: None,
                disturbance_detection: "off".into(),
                stop_reason: None,
                confirmation: None,
                objective: None,
            }),
            stop: Mutex::new(None),
            released: std::sync::atomic::AtomicBool::new(false),
        };
        let mut client = ControlClient::connect(&socket, Duration::from_secs(60)).unwrap();
        client.claim_tuning(Duration::from_secs(60)).unwrap();
        let result = with_the_claim(&mut client, &handle, Duration::from_secs(60), |client| {
            // What the session did before it broke: other knobs.
            client
                .set_knobs(full_update(&Knobs::default()), Duration::from_secs(60))
                .unwrap();
            let figures = [u64::MAX, 1];
            panic!("attempt to add with overflow: {}", figures[1]);
        });
        let Err(SessionFailure::Failed(message)) = result else {
            panic!("the panic did not fail the session")
        };
        assert!(
            message.contains("panicked (attempt to add with overflow: 1)")
                && message.contains("back on its start knobs"),
            "{message}"
        );
        assert_eq!(handle.view().current_knobs, start);
        drop(client);
        let asked = job.join().unwrap();
        // Claimed, the session's knobs, the start's again, released.
        assert!(
            matches!(asked[0], ClientMessage::ClaimTuning { .. }),
            "{asked:?}"
        );
        let Some(ClientMessage::SetKnobs { knobs, .. }) = asked.get(2) else {
            panic!("the start knobs were not sent back: {asked:?}")
        };
        assert_eq!(*knobs, full_update(&start));
        assert!(
            matches!(
                asked[3],
                ClientMessage::ReleaseTuning {
                    completed: false,
                    ..
                }
            ),
            "{asked:?}"
        );
        assert_eq!(asked.len(), 4, "{asked:?}");
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ringwatch-panic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_panic_message_is_read_from_either_payload() {
        let owned: Box<dyn std::any::Any + Send> = Box::new(String::from("owned"));
        let literal: Box<dyn std::any::Any + Send> = Box::new("literal");
        let other: Box<dyn std::any::Any + Send> = Box::new(7_u8);
        assert_eq!(panic_message(owned.as_ref()), "owned");
        assert_eq!(panic_message(literal.as_ref()), "literal");
        assert_eq!(panic_message(other.as_ref()), "a panic without a message");
    }
}
