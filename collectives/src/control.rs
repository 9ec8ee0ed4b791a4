//! The one wire protocol between a job and the ringwatch agent, and a small client for it.
//!
//! Rank 0 of a job serves a Unix stream socket `<runtime dir>/<job_id>.sock`. Every message,
//! in both directions, is a frame: a 4-byte big-endian length, then that many bytes of UTF-8
//! JSON (one object with a `"type"` field), at most [`MAX_MESSAGE_BYTES`]. On connect the
//! server sends [`ServerMessage::Hello`]; the client then sends [`ClientMessage`]s:
//! `subscribe` (per-cycle statistics and/or timeline events are then streamed), `get_knobs`,
//! `set_knobs` (answered with `knobs_applied` once rank 0 has put them in force: the cycle
//! named there is the first cycle that every rank runs with the new knobs). A malformed or
//! oversized message closes that client with an `error` message; the job is not affected.
//!
//! # Tuning claims
//! At most one client at a time tunes a job. It first sends `claim_tuning`; the server
//! answers `tuning_claim` with `granted` and the job's [`AutotuneState`] after the request.
//! A claim is granted unless another client holds it or the job is tuning itself
//! ([`AutotuneState::SelfTuning`]); in every other state (also `off` and `done`: an explicit
//! request re-tunes) it is granted and the state becomes `agent`. A client that already holds
//! the claim is granted again. The claim is held by that client *connection* and ends:
//! - on `release_tuning` with `completed: true` -> `done`;
//! - on `release_tuning` with `completed: false` -> `interrupted`;
//! - when that connection closes (or is closed for a malformed message) -> `interrupted`.
//!
//! A `release_tuning` from a client that does not hold the claim is answered with
//! `granted: false` and changes nothing. The claim is advisory: it does not lock
//! `set_knobs`. `hello` carries the state (`autotune`, absent from older servers = `off`).
//!
//! A job started with `RINGWATCH_AUTOTUNE=1` (or Horovod's `HOROVOD_AUTOTUNE=1`) starts in
//! `waiting`: it waits `RINGWATCH_AUTOTUNE_WAIT_SECS` (default 5) for a claim, then rank 0
//! tunes itself (`self_tuning`, then `done`; see [`crate::runtime`]). A job in `interrupted`
//! stays on its current knobs and never tunes itself from there; an agent that sees
//! `waiting` or `interrupted` in `hello` starts a session on its own.
//!
//! # One socket per host
//! A job spread over several hosts serves one socket on each: the first local rank of every
//! host serves `<runtime dir>/<job_id>.sock` there, so the agent of every node finds every
//! job with ranks on it. Its `hello` lists every rank and says which host it speaks for
//! (`host`) and which rank serves it (`served_by_rank`). Every socket streams its host's
//! statistics (its serving rank's view of each cycle) and the timeline events of its host's
//! ranks: the other local ranks send theirs to it (`rank_timeline`). `set_knobs` works on
//! every socket: a request on another host's socket travels to rank 0 with its rank's next
//! negotiation request and is answered once in force, as on rank 0's. The tuning claim is
//! one per job: only rank 0's socket grants it; the others answer `granted: false` naming
//! rank 0's host, and say `off` in `hello`.
//!
//! Compatibility: [`PROTOCOL_VERSION`] changes when a message changes meaning; new optional
//! fields may be added without a change, so readers must ignore unknown fields.
//!
//! The agent's side, in short:
//! ```no_run
//! use std::time::Duration;
//! use collectives::control::{ControlClient, KnobUpdate, ServerMessage, socket_path};
//!
//! let path = socket_path(&collectives::control::default_runtime_dir(), "my-job");
//! let mut client = ControlClient::connect(&path, Duration::from_secs(5))?;
//! println!("{} ranks: {:?}", client.hello().world_size, client.hello().ranks);
//! client.claim_tuning(Duration::from_secs(5))?; // Err(Server(..)) if someone else tunes it
//! client.subscribe(true, false)?;
//! let (knobs, first_cycle) = client.set_knobs(
//!     KnobUpdate { fusion_threshold_bytes: Some(8 << 20), ..Default::default() },
//!     Duration::from_secs(10),
//! )?;
//! while let Some(message) = client.next_message(Duration::from_secs(1))? {
//!     if let ServerMessage::CycleStats(s) = message {
//!         if s.cycle >= first_cycle { /* a sample measured with `knobs` */ }
//!     }
//! }
//! client.release_tuning(true, Duration::from_secs(5))?; // the job is now `done`
//! # Ok::<(), collectives::control::ControlError>(())
//! ```
//!
//! This module is imported by the agent: it must stay small and depend only on `serde`,
//! `serde_json`, `thiserror` and `std`; it must never depend on the runtime's internals.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Version of this protocol, sent in `hello`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame payload either side accepts, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Default fusion threshold: 64 MiB, as Horovod.
pub const DEFAULT_FUSION_THRESHOLD_BYTES: u64 = 64 * 1024 * 1024;

/// Default cycle time: 1 ms, as recent Horovod versions (old ones used 5 ms).
pub const DEFAULT_CYCLE_TIME_US: u64 = 1_000;

/// The runtime's tunable knobs. All ranks always run with the same values, switched at the
/// same cycle; a knob never changes a result, only its speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Knobs {
    /// Ready tensors of one dtype and op are packed into buffers of at most this many bytes
    /// and reduced together. 0 disables fusion.
    pub fusion_threshold_bytes: u64,
    /// Time between the starts of two negotiation cycles, in microseconds.
    pub cycle_time_us: u64,
    /// Use hierarchical allreduce (falls back to the ring, with a log line, when nodes have
    /// different numbers of ranks).
    pub hierarchical_allreduce: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            fusion_threshold_bytes: DEFAULT_FUSION_THRESHOLD_BYTES,
            cycle_time_us: DEFAULT_CYCLE_TIME_US,
            hierarchical_allreduce: false,
        }
    }
}

impl Knobs {
    /// The cycle time as a duration.
    pub fn cycle_time(&self) -> Duration {
        Duration::from_micros(self.cycle_time_us)
    }

    /// These knobs with the fields set in `update` replaced.
    pub fn with(mut self, update: &KnobUpdate) -> Knobs {
        if let Some(v) = update.fusion_threshold_bytes {
            self.fusion_threshold_bytes = v;
        }
        if let Some(v) = update.cycle_time_us {
            self.cycle_time_us = v;
        }
        if let Some(v) = update.hierarchical_allreduce {
            self.hierarchical_allreduce = v;
        }
        self
    }
}

/// A change to some knobs; `None` fields stay as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnobUpdate {
    /// New fusion threshold in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fusion_threshold_bytes: Option<u64>,
    /// New cycle time in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycle_time_us: Option<u64>,
    /// New hierarchical-allreduce switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hierarchical_allreduce: Option<bool>,
}

/// One rank of the job, as announced in `hello`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Rank within its node.
    pub local_rank: usize,
    /// Ranks on its node.
    pub local_size: usize,
    /// Host name of its machine.
    pub host: String,
    /// Process id (in its own pid namespace).
    pub pid: u32,
}

/// Whether and how the job is auto-tuned (`RINGWATCH_AUTOTUNE=1`); see the module doc's
/// "Tuning claims".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AutotuneState {
    /// The job did not ask to be tuned (an agent may still tune it on request).
    #[default]
    Off,
    /// Asked (`RINGWATCH_AUTOTUNE=1`); waiting `RINGWATCH_AUTOTUNE_WAIT_SECS` (default 5) for
    /// an agent to claim it.
    Waiting,
    /// A client holds the tuning claim.
    Agent,
    /// No agent came: rank 0 tunes itself with `tuner::session`.
    SelfTuning,
    /// The claim holder went away before releasing it as completed; the job stays on its
    /// current knobs and never tunes itself from here.
    Interrupted,
    /// Tuned (released with `completed: true`, or self-tuning finished).
    Done,
}

impl AutotuneState {
    /// The state's wire name (`off`, `waiting`, `agent`, `self_tuning`, `interrupted`, `done`).
    pub fn as_str(&self) -> &'static str {
        match self {
            AutotuneState::Off => "off",
            AutotuneState::Waiting => "waiting",
            AutotuneState::Agent => "agent",
            AutotuneState::SelfTuning => "self_tuning",
            AutotuneState::Interrupted => "interrupted",
            AutotuneState::Done => "done",
        }
    }
}

/// What the server says first to every client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the server.
    pub protocol_version: u32,
    /// The job's id (also the socket's file name without `.sock`).
    pub job_id: String,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per node (rank 0's node).
    pub local_size: usize,
    /// Every rank, in rank order.
    pub ranks: Vec<RankInfo>,
    /// The knobs in force.
    pub knobs: Knobs,
    /// The cycle the job is at.
    pub cycle: u64,
    /// Whether and how the job is auto-tuned (absent from older servers: `off`).
    /// Only rank 0's socket holds the job's tuning claim; the sockets of other hosts say
    /// `off` and refuse claims (see the module doc's "One socket per host").
    #[serde(default)]
    pub autotune: AutotuneState,
    /// The host this socket speaks for: its ranks (those of `ranks` with this `host`) run
    /// on the machine that serves it. Absent from older servers: rank 0's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The rank that serves this socket (the first local rank of `host`). Absent from older
    /// servers: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by_rank: Option<usize>,
}

impl Hello {
    /// The host this socket speaks for (rank 0's for servers that do not say).
    pub fn host(&self) -> &str {
        match &self.host {
            Some(host) => host,
            None => self.ranks.first().map_or("", |r| r.host.as_str()),
        }
    }

    /// The rank serving this socket.
    pub fn served_by_rank(&self) -> usize {
        self.served_by_rank.unwrap_or(0)
    }

    /// Whether this socket is rank 0's: the one that holds the job's tuning claim.
    pub fn is_rank0(&self) -> bool {
        self.served_by_rank() == 0
    }

    /// The ranks this socket speaks for: those on its host.
    pub fn local_ranks(&self) -> impl Iterator<Item = &RankInfo> {
        let host = self.host().to_owned();
        self.ranks.iter().filter(move |r| r.host == host)
    }

    /// Every host of the job, in rank order, each once.
    pub fn hosts(&self) -> Vec<&str> {
        let mut hosts: Vec<&str> = Vec::new();
        for r in &self.ranks {
            if !hosts.contains(&r.host.as_str()) {
                hosts.push(&r.host);
            }
        }
        hosts
    }
}

/// Statistics of one cycle that did work (cycles with nothing to do are not reported).
/// Cycles that follow each other within [`STATS_EVERY_US`] of the last report (a job
/// whose callers run a cycle per small call: microseconds each) are reported together,
/// as one: the first one's index and start, the sums of the rest; the knobs are the
/// same throughout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CycleStats {
    /// Index of the cycle (the same on every rank); of the first, for cycles reported
    /// together.
    pub cycle: u64,
    /// When the cycle started, microseconds since the Unix epoch (rank 0's clock).
    pub start_unix_us: u64,
    /// Wall time of the cycle's work (negotiation, copies, collectives), microseconds.
    pub duration_us: u64,
    /// Bytes of tensor data reduced by allreduce in this cycle (each tensor counted once).
    pub bytes_reduced: u64,
    /// Bytes of all collectives (allreduce, allgather output, broadcast) in this cycle.
    pub bytes_total: u64,
    /// Tensors completed in this cycle.
    pub tensors: u64,
    /// Allreduce buffers run (fused buffers plus unfused tensors).
    pub fused_buffers: u64,
    /// The knobs in force during this cycle.
    pub knobs: Knobs,
    /// Ranks that completed some of the tensors last: rank 0 had a tensor from some
    /// ranks in an earlier cycle than from these. Empty when every tensor came from every
    /// rank in one cycle (then nobody was late, as far as negotiation can tell: its
    /// resolution is the cycle).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub late: Vec<LateRank>,
    /// Of `tensors`, those some rank enqueued in a later cycle than the first rank did
    /// (the ones the job waited for a rank on).
    #[serde(default)]
    pub tensors_waited: u64,
    /// The step boundaries rank 0 marked ([`crate::Runtime::mark_step`]: a training
    /// step ended) since the previous statistics; none when the job marks no steps.
    #[serde(default, skip_serializing_if = "StepMarks::is_empty")]
    pub steps: StepMarks,
}

/// Step boundaries marked between two cycles' statistics: how many, and when the first
/// and the last were marked (microseconds since the Unix epoch; 0 when none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMarks {
    /// Boundaries marked.
    pub count: u64,
    /// When the first was marked.
    pub first_unix_us: u64,
    /// When the last was marked.
    pub last_unix_us: u64,
}

impl StepMarks {
    /// No boundary marked.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Adds a boundary marked at `unix_us`.
    pub fn mark(&mut self, unix_us: u64) {
        if self.count == 0 {
            self.first_unix_us = unix_us;
        }
        self.last_unix_us = unix_us;
        self.count += 1;
    }

    /// Adds the boundaries marked after these.
    pub fn absorb(&mut self, later: &StepMarks) {
        if later.count == 0 {
            return;
        }
        if self.count == 0 {
            self.first_unix_us = later.first_unix_us;
        }
        self.last_unix_us = later.last_unix_us;
        self.count += later.count;
    }
}

/// A rank that was the last to enqueue some of a cycle's tensors.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateRank {
    /// The rank.
    pub rank: usize,
    /// Tensors it enqueued last.
    pub tensors: u64,
    /// The longest time between the first rank's request for one of them and this
    /// rank's, as rank 0 saw them (whole cycles), microseconds.
    pub late_us_max: u64,
    /// The sum of those times, microseconds.
    pub late_us_sum: u64,
}

/// At most one [`CycleStats`] per this many microseconds: faster cycles are added up.
pub const STATS_EVERY_US: u64 = 200;

impl CycleStats {
    /// Adds a later cycle run with the same knobs (see [`CycleStats`]).
    pub fn absorb(&mut self, later: &CycleStats) {
        self.duration_us += later.duration_us;
        self.bytes_reduced += later.bytes_reduced;
        self.bytes_total += later.bytes_total;
        self.tensors += later.tensors;
        self.fused_buffers += later.fused_buffers;
        self.tensors_waited += later.tensors_waited;
        self.steps.absorb(&later.steps);
        for l in &later.late {
            match self.late.iter_mut().find(|m| m.rank == l.rank) {
                Some(m) => {
                    m.tensors += l.tensors;
                    m.late_us_max = m.late_us_max.max(l.late_us_max);
                    m.late_us_sum += l.late_us_sum;
                }
                None => self.late.push(l.clone()),
            }
        }
    }
}

/// A tensor some ranks enqueued and others not, for longer than the job's stall check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StalledTensor {
    /// The tensor's name.
    pub name: String,
    /// The collective: `allreduce`, `allgather` or `broadcast`.
    pub kind: String,
    /// The ranks that enqueued it and wait for the others.
    pub waiting_ranks: Vec<usize>,
    /// The ranks that have not enqueued it.
    pub missing_ranks: Vec<usize>,
    /// How long it has waited, seconds.
    pub waiting_secs: f64,
}

/// Rank 0's stall check: what the job waits for. Sent to `stats` subscribers when it
/// changes (a stall begins, grows, or ends: then `stalled` is empty), and on subscribing
/// while the job is stalled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StallReport {
    /// The cycle rank 0 was at.
    pub cycle: u64,
    /// When rank 0 saw it, microseconds since the Unix epoch.
    pub at_unix_us: u64,
    /// The stalled tensors, longest waiting first; empty: no stall (any more).
    pub stalled: Vec<StalledTensor>,
    /// The stall check, seconds.
    pub check_secs: f64,
    /// After this many seconds of stall every rank fails (`RINGWATCH_STALL_SHUTDOWN_SECS`);
    /// `None`: the job waits.
    pub shutdown_after_secs: Option<f64>,
}

/// Phase of a timeline event, as in the Chrome trace event format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// An activity begins.
    #[serde(rename = "B")]
    Begin,
    /// An activity ends.
    #[serde(rename = "E")]
    End,
    /// An instant (a rank reporting a tensor ready during negotiation).
    #[serde(rename = "i")]
    Instant,
}

/// One timeline event: an activity of one tensor on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimelineEvent {
    /// Rank that recorded it.
    pub rank: usize,
    /// Tensor the activity belongs to.
    pub tensor: String,
    /// Horovod's activity name: NEGOTIATE_ALLREDUCE, QUEUE, MEMCPY_IN_FUSION_BUFFER, …
    pub activity: String,
    /// Begin, end or instant.
    pub phase: Phase,
    /// Microseconds since the Unix epoch.
    pub ts_us: u64,
    /// Extra details (`algorithm`, `bytes`, `ready_rank`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub args: BTreeMap<String, String>,
}

/// Messages from the job (rank 0) to a client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    /// Sent once, first.
    Hello(Hello),
    /// Answer to `get_knobs`.
    Knobs {
        /// The request's id.
        request_id: u64,
        /// The knobs in force.
        knobs: Knobs,
        /// The cycle the job is at.
        cycle: u64,
    },
    /// Answer to `set_knobs`, sent once the knobs are in force on every rank.
    KnobsApplied {
        /// The request's id.
        request_id: u64,
        /// The knobs now in force.
        knobs: Knobs,
        /// The first cycle that every rank runs with these knobs.
        applied_at_cycle: u64,
    },
    /// Answer to `claim_tuning` and to `release_tuning`.
    TuningClaim {
        /// The request's id.
        request_id: u64,
        /// The claim was granted (or the release accepted).
        granted: bool,
        /// The job's autotune state after the request.
        state: AutotuneState,
        /// Why, in words (who holds the claim when refused).
        message: String,
    },
    /// Statistics of one cycle (after `subscribe` with `stats`).
    CycleStats(CycleStats),
    /// The job's stall state changed (after `subscribe` with `stats`).
    Stall(StallReport),
    /// Timeline events (after `subscribe` with `timeline`).
    Timeline {
        /// The events, in time order.
        events: Vec<TimelineEvent>,
    },
    /// To a rank that sends its timeline to its host's socket (`rank_timeline`): whether
    /// any client wants timeline events now (sent on its first `rank_timeline` and whenever
    /// it changes), so that ranks build no events nobody reads.
    TimelineWanted {
        /// A client is subscribed to the timeline.
        wanted: bool,
    },
    /// The last message before the server closes this client, or a refused request.
    Error {
        /// The request it answers, if any.
        #[serde(default)]
        request_id: Option<u64>,
        /// What went wrong.
        message: String,
    },
}

/// Messages from a client to the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMessage {
    /// Start (or stop) streaming statistics and/or timeline events.
    Subscribe {
        /// Stream [`ServerMessage::CycleStats`].
        #[serde(default)]
        stats: bool,
        /// Stream [`ServerMessage::Timeline`].
        #[serde(default)]
        timeline: bool,
    },
    /// Ask for the knobs in force.
    GetKnobs {
        /// Echoed in the answer.
        request_id: u64,
    },
    /// Change knobs at the next cycle boundary.
    SetKnobs {
        /// Echoed in the answer.
        request_id: u64,
        /// The change.
        knobs: KnobUpdate,
    },
    /// Ask to be the one client that tunes this job (answered with `tuning_claim`).
    ClaimTuning {
        /// Echoed in the answer.
        request_id: u64,
    },
    /// End this client's claim (answered with `tuning_claim`).
    ReleaseTuning {
        /// Echoed in the answer.
        request_id: u64,
        /// The session finished (-> `done`); otherwise -> `interrupted`.
        completed: bool,
    },
    /// Timeline events of another rank of this host, sent by that rank (a process of the
    /// job's own user) to its host's socket, which streams them to its `timeline`
    /// subscribers with its own. Events of ranks of other hosts are dropped.
    RankTimeline {
        /// The events, in time order.
        events: Vec<TimelineEvent>,
    },
}

/// Errors of the control protocol.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket failed.
    #[error("control socket I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A frame is larger than [`MAX_MESSAGE_BYTES`].
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer closed the connection.
    #[error("the other side closed the connection")]
    Closed,
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The server refused a request or said something unexpected.
    #[error("server: {0}")]
    Server(String),
}

/// Writes one frame holding `message`.
pub fn write_message<W: Write, M: Serialize>(w: &mut W, message: &M) -> Result<(), ControlError> {
    let body = serde_json::to_vec(message).map_err(|e| ControlError::Malformed(e.to_string()))?;
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(ControlError::TooLarge {
            len: body.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and decodes it; an oversized frame is refused before its body is read.
pub fn read_message<R: Read, M: DeserializeOwned>(r: &mut R) -> Result<M, ControlError> {
    let body = read_frame(r)?;
    serde_json::from_slice(&body).map_err(|e| ControlError::Malformed(e.to_string()))
}

/// Reads one frame holding a [`ServerMessage`] ([`ServerMessage::from_json`]).
pub fn read_server_message<R: Read>(r: &mut R) -> Result<ServerMessage, ControlError> {
    let body = read_frame(r)?;
    ServerMessage::from_json(&body).map_err(|e| ControlError::Malformed(e.to_string()))
}

/// Reads one frame holding a [`ClientMessage`] ([`ClientMessage::from_json`]).
pub fn read_client_message<R: Read>(r: &mut R) -> Result<ClientMessage, ControlError> {
    let body = read_frame(r)?;
    ClientMessage::from_json(&body).map_err(|e| ControlError::Malformed(e.to_string()))
}

/// The `type` of an internally tagged message, read without buffering the rest.
#[derive(Deserialize)]
struct Tag<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
}

/// The fields of a message that carries timeline events.
#[derive(Deserialize)]
struct EventsBody {
    events: Vec<TimelineEvent>,
}

impl ServerMessage {
    /// Decodes a frame's JSON, as `serde_json::from_slice` would. An internally tagged
    /// enum is otherwise read through serde's buffered content tree (every string and
    /// number copied once more before the variant is known): for a `timeline` of a
    /// busy job that was most of the agent's CPU (perf, collbench resnet50 watched).
    /// Here the tag is read first (the rest skipped, nothing allocated) and the bulky
    /// variants are read straight into their fields; the others take serde's way.
    pub fn from_json(body: &[u8]) -> serde_json::Result<Self> {
        let tag: Tag<'_> = serde_json::from_slice(body)?;
        match tag.kind.as_ref() {
            "timeline" => Ok(Self::Timeline {
                events: serde_json::from_slice::<EventsBody>(body)?.events,
            }),
            "cycle_stats" => Ok(Self::CycleStats(serde_json::from_slice(body)?)),
            _ => serde_json::from_slice(body),
        }
    }
}

impl ClientMessage {
    /// Decodes a frame's JSON, as `serde_json::from_slice` would; `rank_timeline`
    /// straight into its events (see [`ServerMessage::from_json`]).
    pub fn from_json(body: &[u8]) -> serde_json::Result<Self> {
        let tag: Tag<'_> = serde_json::from_slice(body)?;
        match tag.kind.as_ref() {
            "rank_timeline" => Ok(Self::RankTimeline {
                events: serde_json::from_slice::<EventsBody>(body)?.events,
            }),
            _ => serde_json::from_slice(body),
        }
    }
}

/// Reads one frame's body (length-checked).
fn read_frame<R: Read>(r: &mut R) -> Result<Vec<u8>, ControlError> {
    let mut header = [0u8; 4];
    match r.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ControlError::Closed);
        }
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(ControlError::TooLarge {
            len,
            max: MAX_MESSAGE_BYTES,
        });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// The directory control sockets live in: `RINGWATCH_RUNTIME_DIR` if set, else
/// `/run/ringwatch`.
pub fn default_runtime_dir() -> PathBuf {
    std::env::var_os("RINGWATCH_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/ringwatch"))
}

/// Where an unprivileged job puts its socket when the runtime dir is not writable:
/// `$XDG_RUNTIME_DIR/ringwatch`, else `/tmp/ringwatch-<uid>`. The agent scans these
/// only when its operator names them (`--also-scan`): any user can create them.
pub fn fallback_runtime_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
        dirs.push(PathBuf::from(xdg).join("ringwatch"));
    }
    let uid = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap_or(0);
    dirs.push(PathBuf::from(format!("/tmp/ringwatch-{uid}")));
    dirs
}

/// The socket path of job `job_id` in `dir`.
pub fn socket_path(dir: &Path, job_id: &str) -> PathBuf {
    dir.join(format!("{job_id}.sock"))
}

/// The process at the other end of a Unix socket, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Its pid in the reader's pid namespace (0 when it is in none the reader sees).
    pub pid: u32,
    /// Its effective uid when it called `listen`/`connect`.
    pub uid: u32,
    /// Its effective gid then.
    pub gid: u32,
}

/// The process at the other end of the Unix socket `socket`, as the kernel
/// recorded it at `connect` or `listen` (`SO_PEERCRED`).
pub fn peer_credentials(socket: &impl std::os::fd::AsRawFd) -> std::io::Result<PeerCredentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a `ucred`, and the fd
    // is an open socket borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCredentials {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// A connection to a job's control socket, for the agent and for tests.
#[derive(Debug)]
pub struct ControlClient {
    stream: UnixStream,
    hello: Hello,
    next_request_id: u64,
    backlog: VecDeque<ServerMessage>,
}

impl ControlClient {
    /// Connects to the socket at `path` and reads the job's `hello` within `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ControlError> {
        let mut stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let hello = match read_server_message(&mut stream).map_err(map_timeout(timeout))? {
            ServerMessage::Hello(hello) => hello,
            other => {
                return Err(ControlError::Server(format!(
                    "expected hello, got {other:?}"
                )));
            }
        };
        Ok(ControlClient {
            stream,
            hello,
            next_request_id: 1,
            backlog: VecDeque::new(),
        })
    }

    /// The job's `hello`.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Who serves the socket, as the kernel saw it when the server called
    /// `listen` (`SO_PEERCRED`): its pid (in the caller's pid namespace), uid
    /// and gid. What a job's `hello` says about itself is only as good as this.
    pub fn peer_credentials(&self) -> std::io::Result<PeerCredentials> {
        peer_credentials(&self.stream)
    }

    /// Asks for statistics and/or timeline events to be streamed.
    pub fn subscribe(&mut self, stats: bool, timeline: bool) -> Result<(), ControlError> {
        write_message(
            &mut self.stream,
            &ClientMessage::Subscribe { stats, timeline },
        )
    }

    /// The next message from the server (streamed statistics, timeline, answers), waiting
    /// at most `timeout`; `Ok(None)` if none came.
    pub fn next_message(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<ServerMessage>, ControlError> {
        if let Some(m) = self.backlog.pop_front() {
            return Ok(Some(m));
        }
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        match read_server_message(&mut self.stream) {
            Ok(m) => Ok(Some(m)),
            Err(ControlError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn await_answer(
        &mut self,
        request_id: u64,
        timeout: Duration,
    ) -> Result<ServerMessage, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ControlError::Timeout(timeout));
            }
            self.stream.set_read_timeout(Some(left))?;
            let message = read_server_message(&mut self.stream).map_err(map_timeout(timeout))?;
            match &message {
                ServerMessage::Knobs { request_id: id, .. }
                | ServerMessage::KnobsApplied { request_id: id, .. }
                | ServerMessage::TuningClaim { request_id: id, .. }
                    if *id == request_id =>
                {
                    return Ok(message);
                }
                ServerMessage::Error {
                    request_id: Some(id),
                    message,
                } if *id == request_id => return Err(ControlError::Server(message.clone())),
                ServerMessage::Error {
                    request_id: None,
                    message,
                } => return Err(ControlError::Server(message.clone())),
                _ => self.backlog.push_back(message),
            }
        }
    }

    /// The knobs in force and the current cycle.
    pub fn get_knobs(&mut self, timeout: Duration) -> Result<(Knobs, u64), ControlError> {
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        write_message(&mut self.stream, &ClientMessage::GetKnobs { request_id })?;
        match self.await_answer(request_id, timeout)? {
            ServerMessage::Knobs { knobs, cycle, .. } => Ok((knobs, cycle)),
            other => Err(ControlError::Server(format!("unexpected answer {other:?}"))),
        }
    }

    /// Changes knobs and waits until every rank runs with them; returns the knobs now in
    /// force and the first cycle that runs with them.
    pub fn set_knobs(
        &mut self,
        update: KnobUpdate,
        timeout: Duration,
    ) -> Result<(Knobs, u64), ControlError> {
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        write_message(
            &mut self.stream,
            &ClientMessage::SetKnobs {
                request_id,
                knobs: update,
            },
        )?;
        match self.await_answer(request_id, timeout)? {
            ServerMessage::KnobsApplied {
                knobs,
                applied_at_cycle,
                ..
            } => Ok((knobs, applied_at_cycle)),
            other => Err(ControlError::Server(format!("unexpected answer {other:?}"))),
        }
    }
}

impl ControlClient {
    fn tuning_request(
        &mut self,
        message: impl FnOnce(u64) -> ClientMessage,
        timeout: Duration,
    ) -> Result<AutotuneState, ControlError> {
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        write_message(&mut self.stream, &message(request_id))?;
        match self.await_answer(request_id, timeout)? {
            ServerMessage::TuningClaim {
                granted: true,
                state,
                ..
            } => Ok(state),
            ServerMessage::TuningClaim {
                granted: false,
                message,
                ..
            } => Err(ControlError::Server(message)),
            other => Err(ControlError::Server(format!("unexpected answer {other:?}"))),
        }
    }

    /// Claims the job for tuning; returns the state now (`agent`). Refused with
    /// `Err(ControlError::Server(why))` while another client holds the claim or the job
    /// tunes itself. The claim lasts until [`Self::release_tuning`] or until this client is
    /// dropped (the job then goes to `interrupted`).
    pub fn claim_tuning(&mut self, timeout: Duration) -> Result<AutotuneState, ControlError> {
        self.tuning_request(
            |request_id| ClientMessage::ClaimTuning { request_id },
            timeout,
        )
    }

    /// Releases this client's claim: `completed` -> `done`, otherwise `interrupted`; returns
    /// the state now. `Err(ControlError::Server(why))` when this client holds no claim.
    pub fn release_tuning(
        &mut self,
        completed: bool,
        timeout: Duration,
    ) -> Result<AutotuneState, ControlError> {
        self.tuning_request(
            |request_id| ClientMessage::ReleaseTuning {
                request_id,
                completed,
            },
            timeout,
        )
    }
}

fn map_timeout(timeout: Duration) -> impl Fn(ControlError) -> ControlError {
    move |e| match e {
        ControlError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            ControlError::Timeout(timeout)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_frames() {
        let messages = vec![
            ClientMessage::Subscribe {
                stats: true,
                timeline: false,
            },
            ClientMessage::SetKnobs {
                request_id: 7,
                knobs: KnobUpdate {
                    fusion_threshold_bytes: Some(1 << 20),
                    ..Default::default()
                },
            },
        ];
        let mut wire = Vec::new();
        for m in &messages {
            write_message(&mut wire, m).unwrap();
        }
        let first_len = u32::from_be_bytes(wire[..4].try_into().unwrap()) as usize;
        assert_eq!(first_len, serde_json::to_vec(&messages[0]).unwrap().len());
        let mut reader = &wire[..];
        for m in &messages {
            let got: ClientMessage = read_message(&mut reader).unwrap();
            assert_eq!(&got, m);
        }
        assert!(matches!(
            read_message::<_, ClientMessage>(&mut reader),
            Err(ControlError::Closed)
        ));
    }

    #[test]
    fn the_fast_decoders_read_what_serde_reads_and_refuse_what_it_refuses() {
        let events = vec![
            TimelineEvent {
                rank: 1,
                tensor: "layer1.weight \"q\"".into(),
                activity: "ALLREDUCE".into(),
                phase: Phase::Begin,
                ts_us: 1_700_000_000_000_123,
                args: [("algorithm".to_string(), "ring".to_string())].into(),
            },
            TimelineEvent {
                rank: 0,
                tensor: "loss".into(),
                activity: "QUEUE".into(),
                phase: Phase::End,
                ts_us: 7,
                args: BTreeMap::new(),
            },
        ];
        let server = [
            ServerMessage::Timeline {
                events: events.clone(),
            },
            ServerMessage::Timeline { events: Vec::new() },
            ServerMessage::CycleStats(CycleStats {
                cycle: 9,
                start_unix_us: 1,
                duration_us: 2,
                bytes_reduced: 3,
                bytes_total: 4,
                tensors: 5,
                fused_buffers: 6,
                knobs: Knobs::default(),
                late: vec![LateRank {
                    rank: 1,
                    tensors: 2,
                    late_us_max: 3,
                    late_us_sum: 4,
                }],
                tensors_waited: 2,
                steps: Default::default(),
            }),
            ServerMessage::Stall(StallReport {
                cycle: 7,
                at_unix_us: 8,
                stalled: vec![StalledTensor {
                    name: "grad".into(),
                    kind: "allreduce".into(),
                    waiting_ranks: vec![0],
                    missing_ranks: vec![1],
                    waiting_secs: 61.5,
                }],
                check_secs: 60.0,
                shutdown_after_secs: None,
            }),
            ServerMessage::TimelineWanted { wanted: true },
            ServerMessage::Error {
                request_id: None,
                message: "no".into(),
            },
        ];
        for m in &server {
            let body = serde_json::to_vec(m).unwrap();
            assert_eq!(&ServerMessage::from_json(&body).unwrap(), m);
            let mut wire = Vec::new();
            write_message(&mut wire, m).unwrap();
            assert_eq!(&read_server_message(&mut &wire[..]).unwrap(), m);
        }
        let client = [
            ClientMessage::RankTimeline {
                events: events.clone(),
            },
            ClientMessage::Subscribe {
                stats: true,
                timeline: false,
            },
        ];
        for m in &client {
            let body = serde_json::to_vec(m).unwrap();
            assert_eq!(&ClientMessage::from_json(&body).unwrap(), m);
        }
        // The tag may come anywhere in the object.
        let late = br#"{"events":[{"rank":2,"tensor":"t","activity":"QUEUE","phase":"E","ts_us":5}],"type":"timeline"}"#;
        assert_eq!(
            ServerMessage::from_json(late).unwrap(),
            serde_json::from_slice::<ServerMessage>(late).unwrap()
        );
        // What serde refuses, these refuse.
        for bad in [
            &br#"{"events":[]}"#[..],
            br#"{"type":"timeline"}"#,
            br#"{"type":"timeline","events":[{"rank":-1}]}"#,
            br#"{"type":"cycle_stats","cycle":"x"}"#,
            br#"{"type":"no_such_message"}"#,
            br#"[1,2]"#,
        ] {
            assert!(serde_json::from_slice::<ServerMessage>(bad).is_err());
            assert!(ServerMessage::from_json(bad).is_err(), "{bad:?}");
        }
        assert!(ClientMessage::from_json(br#"{"type":"rank_timeline"}"#).is_err());
    }

    #[test]
    fn wire_format_is_tagged_json() {
        let json = serde_json::to_string(&ClientMessage::GetKnobs { request_id: 3 }).unwrap();
        assert_eq!(json, r#"{"type":"get_knobs","request_id":3}"#);
        let m: ClientMessage = serde_json::from_str(
            r#"{"type":"set_knobs","request_id":1,"knobs":{"cycle_time_us":5000}}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            ClientMessage::SetKnobs {
                request_id: 1,
                knobs: KnobUpdate {
                    cycle_time_us: Some(5000),
                    ..Default::default()
                }
            }
        );
    }

    #[test]
    fn oversized_frames_are_refused_before_reading_the_body() {
        let mut wire = ((MAX_MESSAGE_BYTES + 1) as u32).to_be_bytes().to_vec();
        wire.extend_from_slice(b"{}");
        assert!(matches!(
            read_message::<_, ClientMessage>(&mut &wire[..]),
            Err(ControlError::TooLarge { .. })
        ));
        let mut wire = 5u32.to_be_bytes().to_vec();
        wire.extend_from_slice(b"nope!");
        assert!(matches!(
            read_message::<_, ClientMessage>(&mut &wire[..]),
            Err(ControlError::Malformed(_))
        ));
    }

    #[test]
    fn tuning_messages_and_states_have_their_wire_names() {
        let json = serde_json::to_string(&ClientMessage::ReleaseTuning {
            request_id: 4,
            completed: true,
        })
        .unwrap();
        assert_eq!(
            json,
            r#"{"type":"release_tuning","request_id":4,"completed":true}"#
        );
        let m: ServerMessage = serde_json::from_str(
            r#"{"type":"tuning_claim","request_id":2,"granted":false,"state":"self_tuning","message":"no"}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            ServerMessage::TuningClaim {
                request_id: 2,
                granted: false,
                state: AutotuneState::SelfTuning,
                message: "no".into()
            }
        );
        for s in [
            AutotuneState::Off,
            AutotuneState::Waiting,
            AutotuneState::Agent,
            AutotuneState::SelfTuning,
            AutotuneState::Interrupted,
            AutotuneState::Done,
        ] {
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        // A hello from a server without the field reads as `off`.
        let hello = serde_json::json!({"protocol_version": 1, "job_id": "j", "world_size": 1,
            "local_size": 1, "ranks": [], "knobs": Knobs::default(), "cycle": 0});
        let hello: Hello = serde_json::from_value(hello).unwrap();
        assert_eq!(hello.autotune, AutotuneState::Off);
    }

    #[test]
    fn knob_updates_replace_only_given_fields() {
        let k = Knobs::default().with(&KnobUpdate {
            hierarchical_allreduce: Some(true),
            ..Default::default()
        });
        assert!(k.hierarchical_allreduce);
        assert_eq!(k.fusion_threshold_bytes, DEFAULT_FUSION_THRESHOLD_BYTES);
    }
}
