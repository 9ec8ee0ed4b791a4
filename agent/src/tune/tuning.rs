//! `tuning`: the agent's tuning sessions, as the rest of the agent sees
//! them: the registry ([`TuningSessions`]) that starts one session per job (found
//! by the `jobs` registry), lists them, stops them and starts the default
//! sessions of new jobs, with the limits on talking to a job. A session
//! runs on its own std thread (`driver`); the API's JSON is in `request`,
//! the window judging in `disturbance`, the knob conversion in `knobs`
//! (what other modules use is re-exported here).
//!
//! It must never block a tokio worker (all socket I/O is on the session's
//! own thread), and never touch a job after its connection broke: a job
//! whose agent dies or whose socket breaks keeps the knobs it has (that is
//! the job's side of the protocol).

pub use super::disturbance::{DisturbanceCheck, LoadFeed};
pub use super::request::{Objective, SessionState, SessionView, TuningRequest};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tuner::session::TuningSession;

use super::request::unix_ms;
use crate::cluster::Cluster;
use crate::jobs::{JobState, Jobs};
use crate::reports::Reports;

/// Limits on talking to a job.
#[derive(Debug, Clone)]
pub struct TuningLimits {
    /// Connecting and reading `hello`; also claim/release answers.
    pub connect_timeout: Duration,
    /// Waiting for `knobs_applied`.
    pub apply_timeout: Duration,
    /// A job that reports no cycle with work for this long fails the session.
    pub idle_timeout: Duration,
}

impl Default for TuningLimits {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            apply_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Why a session could not start (mapped to HTTP statuses by the API).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No such job.
    #[error("{0}")]
    NotFound(String),
    /// A session already runs, the job is lost, or the job refused the claim.
    #[error("{0}")]
    Conflict(String),
    /// The request is not a valid session configuration.
    #[error("{0}")]
    BadRequest(String),
    /// The job's control socket could not be used.
    #[error("{0}")]
    Unavailable(String),
}

/// Which knobs a stopped session leaves the job on (the API's `keep=best`
/// or `keep=start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnobsOnStop {
    /// On the best knobs found.
    Best,
    /// On the knobs it had when the session started.
    Start,
}

pub(super) struct Handle {
    pub(super) view: Mutex<SessionView>,
    pub(super) stop: Mutex<Option<KnobsOnStop>>,
    /// The session released the job's claim (its knobs are pinned): a panic
    /// after that leaves the job as it is.
    pub(super) released: std::sync::atomic::AtomicBool,
}

impl Handle {
    pub(super) fn view(&self) -> MutexGuard<'_, SessionView> {
        self.view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn stop_request(&self) -> Option<KnobsOnStop> {
        *self
            .stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Every tuning session of this agent (one per job at a time; the last one
/// of each job is kept for `GET`).
pub struct TuningSessions {
    pub(super) jobs: Jobs,
    pub(super) reports: Reports,
    pub(super) disturbance: DisturbanceCheck,
    pub(super) limits: TuningLimits,
    pub(super) sessions: Mutex<BTreeMap<String, Arc<Handle>>>,
    /// The agent's peers, and the runtime their calls run on: a multi-node
    /// job's windows are judged on every node.
    pub(super) cluster: Mutex<Option<(Arc<Cluster>, tokio::runtime::Handle)>>,
}

impl TuningSessions {
    /// Sessions over `jobs`' jobs, reports into `reports`.
    pub fn new(
        jobs: Jobs,
        reports: Reports,
        disturbance: DisturbanceCheck,
        limits: TuningLimits,
    ) -> Self {
        Self {
            jobs,
            reports,
            disturbance,
            limits,
            sessions: Mutex::new(BTreeMap::new()),
            cluster: Mutex::new(None),
        }
    }

    /// Judges multi-node jobs' windows on every node too, asking `cluster`'s
    /// peers (calls run on `runtime`).
    pub fn set_cluster(&self, cluster: Arc<Cluster>, runtime: tokio::runtime::Handle) {
        if let Ok(mut slot) = self.cluster.lock() {
            *slot = Some((cluster, runtime));
        }
    }
}

impl TuningSessions {
    /// The reports directory.
    pub fn reports(&self) -> &Reports {
        &self.reports
    }

    pub(super) fn sessions(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Handle>>> {
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The session of `job_id` (running or the last one), if any.
    pub fn get(&self, job_id: &str) -> Option<SessionView> {
        self.sessions().get(job_id).map(|h| h.view().clone())
    }

    /// Whether any session is running.
    pub fn any_running(&self) -> bool {
        self.sessions()
            .values()
            .any(|h| h.view().state == SessionState::Running)
    }

    /// Every job's latest session.
    pub fn all(&self) -> Vec<SessionView> {
        self.sessions().values().map(|h| h.view().clone()).collect()
    }

    /// Asks the running session of `job_id` to stop (the job left as `keep`
    /// says); returns its view, `None` when the job never had a session.
    pub fn stop(&self, job_id: &str, keep: KnobsOnStop) -> Option<SessionView> {
        let handle = self.sessions().get(job_id).cloned()?;
        if handle.view().state == SessionState::Running {
            let mut stop = handle
                .stop
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            stop.get_or_insert(keep);
        }
        let view = handle.view().clone();
        Some(view)
    }

    /// Stops every running session (best knobs kept) and waits up to
    /// `limit` for them to end (the agent is shutting down).
    pub fn stop_all(&self, limit: Duration) {
        let running: Vec<String> = self
            .sessions()
            .iter()
            .filter(|(_, h)| h.view().state == SessionState::Running)
            .map(|(job_id, _)| job_id.clone())
            .collect();
        if running.is_empty() {
            return;
        }
        tracing::info!(
            sessions = running.len(),
            "stopping the running tuning sessions (best knobs kept)"
        );
        for job_id in &running {
            self.stop(job_id, KnobsOnStop::Best);
        }
        let deadline = Instant::now() + limit;
        while self.all().iter().any(|v| v.state == SessionState::Running) {
            if Instant::now() >= deadline {
                tracing::warn!(
                    "tuning sessions still running after {limit:?}; their jobs keep the knobs \
                     they have"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Checks the request, reserves the job's session slot and starts the
    /// session's thread; the receiver answers once the session holds the
    /// job's claim (or why it could not).
    pub fn start(
        self: &Arc<Self>,
        job_id: &str,
        request: &TuningRequest,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<SessionView, StartError>>, StartError> {
        let job = self
            .jobs
            .jobs()
            .into_iter()
            .find(|j| j.job_id == job_id)
            .ok_or_else(|| {
                StartError::NotFound(format!(
                    "no job {job_id:?} on this node (GET /api/jobs lists the jobs found)"
                ))
            })?;
        if job.id_claimed_twice {
            return Err(StartError::Conflict(format!(
                "job {job_id} cannot be tuned: {} (the agent believes neither socket)",
                job.conflict
                    .as_deref()
                    .unwrap_or("two users' sockets claim its id")
            )));
        }
        let Some(knobs) = job.knobs else {
            return Err(StartError::Conflict(format!(
                "job {job_id} is a {} job: ringwatch tunes only jobs on its own runtime \
                 (its knobs are the runtime's); it watches this one",
                job.kind.as_str()
            )));
        };
        if job.state != JobState::Connected {
            return Err(StartError::Conflict(format!(
                "job {job_id} is lost ({}); it cannot be tuned",
                job.lost_reason.as_deref().unwrap_or("no reason known")
            )));
        }
        let config = request.resolve();
        // Checked now (with the knobs the registry last saw) so a bad body
        // is a 400 at once; the session proper starts from the knobs the
        // job names on its own connection.
        TuningSession::new(config.session_config(&knobs))
            .map_err(|e| StartError::BadRequest(format!("bad tuning configuration: {e}")))?;
        let handle = {
            let mut sessions = self.sessions();
            if let Some(running) = sessions
                .get(job_id)
                .filter(|h| h.view().state == SessionState::Running)
            {
                let started = running.view().started_unix_ms;
                return Err(StartError::Conflict(format!(
                    "a tuning session of job {job_id} already runs (started at {started} ms \
                     since the epoch); DELETE /api/jobs/{job_id}/tuning stops it"
                )));
            }
            let handle = Arc::new(Handle {
                view: Mutex::new(SessionView {
                    job_id: job_id.to_owned(),
                    state: SessionState::Running,
                    error: None,
                    started_unix_ms: unix_ms(),
                    config: config.clone(),
                    start_knobs: knobs,
                    current_knobs: knobs,
                    samples: Vec::new(),
                    best: None,
                    speedup_over_start: None,
                    report_id: None,
                    disturbance_detection: self.disturbance.describe(),
                    stop_reason: None,
                    confirmation: None,
                    objective: None,
                }),
                stop: Mutex::new(None),
                released: std::sync::atomic::AtomicBool::new(false),
            });
            sessions.insert(job_id.to_owned(), handle.clone());
            forget_oldest_finished(&mut sessions);
            handle
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-tune".into())
            .spawn(move || this.drive(&handle, &job, &config, ready_tx));
        if let Err(error) = spawned {
            let message = format!("cannot start the tuning thread: {error}");
            if let Some(handle) = self.sessions().get(job_id) {
                fail(handle, message.clone());
            }
            return Err(StartError::Unavailable(message));
        }
        Ok(ready_rx)
    }
}

impl TuningSessions {
    /// Starts, once per appearance of a job, a default session for every
    /// job that asks to be tuned (`autotune: waiting|interrupted`). Runs on
    /// its own thread until the last other handle to `self` is gone.
    pub fn autotune(self: &Arc<Self>) -> std::io::Result<()> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ringwatch-autotune".into())
            .spawn(move || {
                let mut started: BTreeMap<String, PathBuf> = BTreeMap::new();
                loop {
                    std::thread::sleep(Duration::from_millis(500));
                    let Some(this) = weak.upgrade() else { break };
                    let jobs = this.jobs.jobs();
                    started.retain(|id, socket| {
                        jobs.iter().any(|j| {
                            &j.job_id == id && &j.socket == socket && j.state == JobState::Connected
                        })
                    });
                    for job in jobs {
                        if job.state != JobState::Connected
                            || !job.wants_autotune()
                            || started.contains_key(&job.job_id)
                        {
                            continue;
                        }
                        started.insert(job.job_id.clone(), job.socket.clone());
                        match this.start(&job.job_id, &TuningRequest::default()) {
                            Ok(_) => tracing::info!(
                                job_id = job.job_id,
                                "the job asks to be tuned: started a tuning session"
                            ),
                            Err(error) => tracing::warn!(
                                job_id = job.job_id,
                                %error,
                                "the job asks to be tuned, but no session could start"
                            ),
                        }
                    }
                }
            })?;
        Ok(())
    }
}

/// Finished sessions kept for `GET` (the newest; running ones always stay).
pub(super) const FINISHED_SESSIONS_KEPT: usize = 100;

/// Keeps memory bounded: forgets the oldest finished sessions beyond
/// [`FINISHED_SESSIONS_KEPT`].
pub(super) fn forget_oldest_finished(sessions: &mut BTreeMap<String, Arc<Handle>>) {
    let mut finished: Vec<(u64, String)> = sessions
        .iter()
        .filter_map(|(job_id, h)| {
            let view = h.view();
            (view.state != SessionState::Running).then(|| (view.started_unix_ms, job_id.clone()))
        })
        .collect();
    if finished.len() <= FINISHED_SESSIONS_KEPT {
        return;
    }
    finished.sort();
    let excess = finished.len() - FINISHED_SESSIONS_KEPT;
    for (_, job_id) in finished.into_iter().take(excess) {
        sessions.remove(&job_id);
    }
}

pub(super) fn fail(handle: &Handle, message: String) {
    let mut view = handle.view();
    view.state = SessionState::Failed;
    view.error = Some(message);
}
