//! The collective runtime a training job calls: enqueue named tensors, wait on handles.
//!
//! A background thread runs one cycle every `cycle_time`: every rank tells rank 0 which
//! tensors became ready, rank 0 ([`coordinator`]) answers with the tensors ready on every
//! rank, fused into buffers, and the knobs in force; every rank then runs exactly that
//! list with [`crate::algorithms`]. When every rank shares one host's memory and nothing
//! waits between cycles, a cycle in which every rank sends the same cached tensors is
//! decided by every rank at once instead, through the shared segment (`settled`): the
//! answer is the one rank 0 would have given. A caller waiting for its result on an idle
//! rank runs the cycle itself (`Handle::drive`); cycles stay one at a time per rank either
//! way.
//! This module must never let a rank decide anything the others do not also decide, and
//! must never leave a handle waiting forever: a failure fails every pending handle with
//! an error that names the rank or tensor.

pub mod cache;
mod claim;
mod completion;
pub mod coordinator;
#[cfg(feature = "cuda")]
mod device;
mod faults;
pub mod messages;
mod quick;
#[cfg(feature = "autotune")]
mod selftune;
mod server;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::algorithms::{
    Algorithm, CopyPhase, NodeLayout, SLICE_BYTES, Schedule, allreduce_tensors, chain_broadcast,
    ring_allgather,
};
use crate::control::{
    AutotuneState, CycleStats, Hello, KnobUpdate, Knobs, PROTOCOL_VERSION, Phase, RankInfo,
    STATS_EVERY_US, TimelineEvent,
};
use crate::error::{CollectiveError, Result};
use crate::knobs::{
    AutotuneConfig, autotune_from, cache_capacity_from, knobs_from_env, parse_bool, timeout_from,
};
use crate::mesh::HostTransport;
use crate::rendezvous::{RendezvousConfig, rendezvous};
use crate::tensor::{AlignedBuf, ReduceOp, Tensor};
use crate::timeline::{TimelineFile, activity, now_us};
use crate::transport::{MAX_FRAME_BYTES, Transport, recv_frame, send_frame};
use cache::{DEFAULT_CACHE_CAPACITY, RankCache};
use claim::TuningClaims;
use completion::{Completion, Done, Taken};
use coordinator::{Coordinator, Item, OpKind, Request, Response, TensorRequest, WireResponse};
use faults::{FaultChannel, LostRank};
use server::{ControlServer, Feeder, ServerState};

/// The length prefix [`send_frame`] puts before every message.
const FRAME_HEADER_BYTES: usize = 4;

/// How long a tensor may wait for some ranks before rank 0 logs a stall warning.
pub const STALL_WARNING: Duration = Duration::from_secs(60);

/// Everything a runtime needs to start.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Where this rank stands and how to meet the others.
    pub rendezvous: RendezvousConfig,
    /// Initial knobs.
    pub knobs: Knobs,
    /// How long any rank waits on a silent peer before failing (`RINGWATCH_TIMEOUT_SECS`).
    pub timeout: Duration,
    /// Write a Chrome-trace timeline here (`RINGWATCH_TIMELINE`). Rank 0 writes it; a path
    /// containing `{rank}` makes every rank write its own.
    pub timeline_path: Option<PathBuf>,
    /// Serve the control socket on rank 0 (`RINGWATCH_CONTROL_SOCKET`, default on).
    pub control_socket: bool,
    /// Directory of the control socket (`RINGWATCH_RUNTIME_DIR`, default /run/ringwatch
    /// with a fallback to a user-writable dir).
    pub runtime_dir: Option<PathBuf>,
    /// Auto-tune the job (`RINGWATCH_AUTOTUNE=1`): wait for an agent's claim, else rank 0
    /// tunes itself. Only rank 0's value matters.
    pub autotune: Option<AutotuneConfig>,
    /// Exchange data with ranks on the same host through shared memory (`RINGWATCH_SHM`,
    /// default on); off, every byte goes over TCP (where the agent's TCP probes see it).
    pub shared_memory: bool,
    /// Tensors the response cache holds (`RINGWATCH_CACHE_CAPACITY`, default 1024; 0: no
    /// cache, every tensor is negotiated by name). Only rank 0's value matters: it gives it
    /// to every rank in its first response.
    pub cache_capacity: usize,
    /// GPU tensors may go through NCCL (`RINGWATCH_NCCL`, default on) where every rank has
    /// a GPU of its own; off, they are staged through host memory into the rings. Only
    /// matters with the `cuda` feature.
    pub nccl: bool,
}

impl RuntimeConfig {
    /// A configuration for `rendezvous` with default knobs and timeouts, control socket off.
    pub fn new(rendezvous: RendezvousConfig) -> Self {
        RuntimeConfig {
            rendezvous,
            knobs: Knobs::default(),
            timeout: crate::knobs::DEFAULT_TIMEOUT,
            timeline_path: None,
            control_socket: false,
            runtime_dir: None,
            autotune: None,
            shared_memory: true,
            cache_capacity: DEFAULT_CACHE_CAPACITY,
            nccl: true,
        }
    }

    /// Everything from the environment (launcher variables, `RINGWATCH_*`, `HOROVOD_*`).
    pub fn from_env() -> Result<Self> {
        let get = |n: &str| std::env::var(n).ok();
        Ok(RuntimeConfig {
            rendezvous: RendezvousConfig::from_env()?,
            knobs: knobs_from_env()?,
            timeout: timeout_from(&get)?,
            timeline_path: get("RINGWATCH_TIMELINE")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            control_socket: match get("RINGWATCH_CONTROL_SOCKET") {
                Some(v) => parse_bool("RINGWATCH_CONTROL_SOCKET", &v)?,
                None => true,
            },
            runtime_dir: get("RINGWATCH_RUNTIME_DIR")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            autotune: autotune_from(&get)?,
            shared_memory: match get("RINGWATCH_SHM") {
                Some(v) => parse_bool("RINGWATCH_SHM", &v)?,
                None => true,
            },
            cache_capacity: cache_capacity_from(&get)?,
            nccl: match get("RINGWATCH_NCCL") {
                Some(v) => parse_bool("RINGWATCH_NCCL", &v)?,
                None => true,
            },
        })
    }
}

struct Entry {
    request: TensorRequest,
    /// The tensor; for a GPU tensor, an empty stand-in (its memory is `device`).
    tensor: Tensor,
    #[cfg(feature = "cuda")]
    device: Option<crate::gpu::DeviceTensor>,
    /// Its handle's slot; also says whether a caller waits for this tensor and runs
    /// its cycle itself ([`Handle::drive`]): the background thread leaves such a tensor
    /// in the inbox until its timer.
    done: Done,
}

impl Entry {
    fn finish(self, result: Result<Tensor>) {
        self.done.send(result);
    }

    fn succeed(self) {
        let Entry { tensor, done, .. } = self;
        done.send(Ok(tensor));
    }
}

#[derive(Default)]
struct Inbox {
    entries: Vec<Entry>,
    knobs: Vec<KnobUpdate>,
    shutdown: bool,
    closed: Option<CollectiveError>,
    /// A caller's cycle ended the job: the background thread must tear it down now.
    ended: bool,
    /// A caller ran a cycle and left work for the background thread, which found the
    /// engine busy and waits for this ([`wait_while_callers_drive`]).
    engine_free: bool,
}

impl Inbox {
    /// Something for the background thread to start a cycle for now: tensors no caller
    /// is about to run itself, knob changes or the shutdown.
    fn has_work(&self) -> bool {
        self.entries.iter().any(|e| !e.done.completion().waited())
            || !self.knobs.is_empty()
            || self.shutdown
    }
}

struct Shared {
    rank: usize,
    inbox: Mutex<Inbox>,
    /// Signalled when work (or a knob change, or shutdown) lands in the
    /// inbox: an idle cycle thread starts its next cycle at once.
    work: Condvar,
    in_flight: Mutex<HashSet<String, foldhash::fast::RandomState>>,
    knobs: Arc<Mutex<(Knobs, u64)>>,
    cycles: AtomicU64,
    bytes_reduced: AtomicU64,
    negotiation_bytes: AtomicU64,
    settled_cycles: AtomicU64,
    caller_cycles: AtomicU64,
    quick_cycles: AtomicU64,
    /// [`Totals::nccl_allreduces`] and [`Totals::staged_allreduces`].
    nccl_allreduces: AtomicU64,
    staged_allreduces: AtomicU64,
    claims: Arc<TuningClaims>,
    self_tune: Arc<Mutex<Option<SelfTuneOutcome>>>,
    /// Set by an [`Interrupter`]: why this rank leaves.
    interrupted: Mutex<Option<String>>,
    /// The last cycle was run by a waiting caller ([`Handle::drive`]).
    callers_drive: AtomicBool,
}

/// A pending collective; [`Handle::wait`] returns its result.
#[derive(Debug)]
pub struct Handle {
    name: String,
    rank: usize,
    /// Shared with the tensor's inbox entry ([`Entry::done`]).
    done: Arc<Completion>,
    engine: EngineRef,
}

/// The rank's [`Engine`], for a waiting caller to run a cycle itself; gone once the
/// background thread has ended.
#[derive(Clone)]
struct EngineRef(std::sync::Weak<Mutex<Engine>>, std::sync::Weak<Shared>);

impl std::fmt::Debug for EngineRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineRef")
    }
}

impl Handle {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for the result. Never waits forever: the runtime completes or fails every
    /// handle within its peer timeout.
    pub fn wait(mut self) -> Result<Tensor> {
        if let Some(result) = self.drive() {
            return result;
        }
        if let Some(result) = self.poll(crate::poll::YIELD_BUDGET) {
            return result;
        }
        self.outcome(self.done.take_within(None))
            .unwrap_or(Err(CollectiveError::ShutDown { rank: self.rank }))
    }

    /// Waits at most `timeout` for the result, keeping the handle when it is not there yet
    /// (`None`), so that a caller can wake up in between (a Python front end checks for
    /// Ctrl-C). After a `Some`, the handle is spent: a further call reports a shut-down.
    pub fn wait_for(&mut self, timeout: Duration) -> Option<Result<Tensor>> {
        if let Some(result) = self.drive() {
            return Some(result);
        }
        if let Some(result) = self.poll(timeout.min(crate::poll::YIELD_BUDGET)) {
            return Some(result);
        }
        self.outcome(self.done.take_within(Some(timeout)))
    }

    /// What the slot held, as a result: `None` while it is still running; a slot that
    /// will never be filled (taken already, or the runtime is gone) is a shut-down.
    fn outcome(&self, taken: Taken) -> Option<Result<Tensor>> {
        match taken {
            Taken::Result(r) => Some(r),
            Taken::Pending => None,
            Taken::Closed => Some(Err(CollectiveError::ShutDown { rank: self.rank })),
        }
    }

    /// The result if it is there, or comes from a cycle this thread runs itself: when
    /// nothing is in flight on this rank (so the background thread would start a cycle
    /// for this tensor at once too) and no other thread runs one, the waiting caller
    /// runs it, and the tensor does not cross to the background thread and back.
    /// Cycles stay one at a time and matched across ranks, whoever runs them.
    fn drive(&mut self) -> Option<Result<Tensor>> {
        if let Some(result) = self.try_wait() {
            return Some(result);
        }
        let engine = self.engine.0.upgrade()?;
        // A blocking call's tensor (`waited` from the start) is left to its caller by the
        // background thread, which must take it back if the caller cannot run it. An
        // async one's is the background thread's to start (a framework enqueues a step's
        // gradients, then waits for each): its caller runs a cycle only when nothing
        // else does.
        let Ok(mut e) = engine.try_lock() else {
            self.hand_back();
            return None;
        };
        if e.outcome.is_some() || !e.cycle.pending.is_empty() {
            drop(e);
            self.hand_back();
            return None;
        }
        e.step(true);
        Engine::release_to_background(e);
        self.try_wait()
    }

    /// This caller will not run its tensor's cycle after all (another thread runs one, or
    /// tensors are in flight): the background thread starts it, now.
    fn hand_back(&self) {
        if !self.done.waited() {
            return;
        }
        let Some(shared) = self.engine.1.upgrade() else {
            return;
        };
        // Under the inbox's lock, so that a background thread about to sleep sees it.
        if let Ok(_inbox) = shared.inbox.lock() {
            self.done.waited.store(false, Ordering::Relaxed);
        }
        shared.work.notify_one();
    }

    /// The result if it comes while this thread yields the core for a moment (the
    /// cycle thread finishing a small collective), without a futex sleep and wake-up.
    fn poll(&mut self, budget: Duration) -> Option<Result<Tensor>> {
        let mut got = None;
        crate::poll::yield_until(budget, || {
            got = self.try_wait();
            got.is_some()
        });
        got
    }

    /// The result if it is there, without waiting (`None`: still running).
    pub fn try_wait(&mut self) -> Option<Result<Tensor>> {
        self.outcome(self.done.try_take())
    }

    /// Waits at most `timeout` for the result.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Tensor> {
        let taken = self.done.take_within(Some(timeout));
        self.outcome(taken)
            .unwrap_or(Err(CollectiveError::WaitTimeout {
                rank: self.rank,
                name: self.name,
                timeout,
            }))
    }
}

/// How a self-tuning session ended (rank 0; see [`Runtime::self_tune_outcome`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SelfTuneOutcome {
    /// The knobs the session started from (its sample 0).
    pub start: Knobs,
    /// The best knobs (the optimizer's recommendation), now pinned on every rank.
    pub best: Knobs,
    /// The first cycle every rank ran with `best`.
    pub pinned_at_cycle: u64,
    /// Samples taken.
    pub samples: usize,
    /// Measured score of the best knobs' sample over sample 0's.
    pub speedup_over_start: Option<f64>,
    /// Wall time of the session, from its start to the pin.
    pub wall: Duration,
    /// The report's CSV (`.parquet` and `.html` beside it), when `RINGWATCH_AUTOTUNE_LOG`
    /// was set and it was written.
    pub report: Option<PathBuf>,
}

/// Totals since the runtime started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Cycles run.
    pub cycles: u64,
    /// Bytes reduced by allreduce.
    pub bytes_reduced: u64,
    /// Bytes of negotiation messages (requests and responses, frame headers included)
    /// this rank sent and received. Rank 0 takes part in every exchange, so its count is
    /// the job's whole negotiation traffic.
    pub negotiation_bytes: u64,
    /// Cycles every rank decided at once through the host's shared memory, with no
    /// message to rank 0 (nothing counted in `negotiation_bytes`).
    pub settled_cycles: u64,
    /// Cycles a waiting caller ran on its own thread (the rest ran on the background
    /// thread: on its timer, or for tensors nobody waited for yet).
    pub caller_cycles: u64,
    /// Of the caller's cycles, those of a blocking allreduce of one cached tensor that
    /// settled without an inbox entry or a result slot (the quick path, `runtime::quick`).
    pub quick_cycles: u64,
    /// Fused buffers of GPU tensors reduced by one `ncclAllReduce` (feature `cuda`).
    pub nccl_allreduces: u64,
    /// Fused buffers of GPU tensors staged through pinned host memory into the rings.
    pub staged_allreduces: u64,
    /// Allreduces (slices of at most 8 MiB) of shared tensors folded in place across the
    /// host's ranks ([`Runtime::shared_tensor`]); the rest were staged through the segment.
    pub in_place_allreduces: u64,
}

/// One rank of a collective job.
pub struct Runtime {
    shared: Arc<Shared>,
    transport: Arc<dyn Transport>,
    engine: EngineRef,
    thread: Option<JoinHandle<()>>,
    finished: mpsc::Receiver<()>,
    timeout: Duration,
    ranks: Vec<RankInfo>,
    job_id: String,
    control_path: Option<PathBuf>,
    faults: Option<Arc<FaultChannel>>,
    /// The GPU this rank's GPU tensors are on (set by the first one).
    #[cfg(feature = "cuda")]
    gpu_device: std::sync::OnceLock<i32>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.ranks.len())
            .field("job_id", &self.job_id)
            .finish()
    }
}

impl Runtime {
    /// Starts a runtime from the environment (see [`RuntimeConfig::from_env`]).
    pub fn from_env() -> Result<Self> {
        Self::new(RuntimeConfig::from_env()?)
    }

    /// Meets the other ranks and starts the cycle thread.
    pub fn new(config: RuntimeConfig) -> Result<Self> {
        let rv = rendezvous(&config.rendezvous, config.timeout)?;
        let faults = FaultChannel::start(rv.transport.rank(), rv.fault_links);
        let transport = HostTransport::connect(
            rv.transport,
            &rv.job_id,
            &rv.host_keys,
            config.shared_memory,
        )?;
        Self::start(
            config,
            Arc::new(transport),
            rv.ranks,
            rv.job_id,
            Some(Arc::new(faults)),
        )
    }

    /// Starts on an already connected transport (tests use the in-memory mesh).
    /// `ranks[r]` describes rank r.
    pub fn with_transport(
        config: RuntimeConfig,
        transport: Arc<dyn Transport>,
        ranks: Vec<RankInfo>,
        job_id: String,
    ) -> Result<Self> {
        Self::start(config, transport, ranks, job_id, None)
    }

    fn start(
        config: RuntimeConfig,
        transport: Arc<dyn Transport>,
        ranks: Vec<RankInfo>,
        job_id: String,
        faults: Option<Arc<FaultChannel>>,
    ) -> Result<Self> {
        let rank = transport.rank();
        let world_size = transport.world_size();
        let knobs_state = Arc::new(Mutex::new((config.knobs, 0u64)));
        let claims = Arc::new(match (&config.autotune, rank) {
            (Some(a), 0) => {
                TuningClaims::new(AutotuneState::Waiting, Some(Instant::now() + a.wait))
            }
            _ => TuningClaims::new(AutotuneState::Off, None),
        });
        let shared = Arc::new(Shared {
            rank,
            inbox: Mutex::new(Inbox::default()),
            work: Condvar::new(),
            in_flight: Mutex::new(HashSet::default()),
            knobs: knobs_state.clone(),
            cycles: AtomicU64::new(0),
            bytes_reduced: AtomicU64::new(0),
            negotiation_bytes: AtomicU64::new(0),
            settled_cycles: AtomicU64::new(0),
            caller_cycles: AtomicU64::new(0),
            quick_cycles: AtomicU64::new(0),
            nccl_allreduces: AtomicU64::new(0),
            staged_allreduces: AtomicU64::new(0),
            claims: claims.clone(),
            self_tune: Arc::new(Mutex::new(None)),
            interrupted: Mutex::new(None),
            callers_drive: AtomicBool::new(false),
        });
        let layout = node_layout(&ranks);
        let timeline = match &config.timeline_path {
            Some(p) => {
                let s = p.to_string_lossy();
                if s.contains("{rank}") {
                    Some(TimelineFile::create(Path::new(
                        &s.replace("{rank}", &rank.to_string()),
                    ))?)
                } else if rank == 0 {
                    Some(TimelineFile::create(p)?)
                } else {
                    None
                }
            }
            None => None,
        };
        // Every host's first rank serves the job's socket there (rank 0's holds the tuning
        // claim); the host's other ranks send it their timeline events. Hosts are told
        // apart by the host name the ranks report: ranks of one name share one socket
        // (pretend nodes in network namespaces of one machine share one too).
        let first_on_host = match ranks.get(rank) {
            Some(me) => ranks[..rank].iter().all(|r| r.host != me.host),
            None => true,
        };
        let server = if first_on_host && config.control_socket {
            let hello = Hello {
                protocol_version: PROTOCOL_VERSION,
                job_id: job_id.clone(),
                world_size,
                local_size: ranks.first().map(|r| r.local_size).unwrap_or(1),
                ranks: ranks.clone(),
                knobs: config.knobs,
                cycle: 0,
                autotune: claims.state(),
                host: ranks.get(rank).map(|r| r.host.clone()),
                served_by_rank: Some(rank),
            };
            match ControlServer::start(
                config.runtime_dir.clone(),
                ServerState {
                    hello,
                    knobs: knobs_state,
                    claims: claims.clone(),
                },
            ) {
                Ok(s) => Some(s),
                Err(e) => {
                    // The agent is an observer: a job runs without it.
                    tracing::warn!(error = %e, "control socket unavailable; the job runs without it");
                    None
                }
            }
        } else {
            None
        };
        let feeder = (!first_on_host && config.control_socket)
            .then(|| Feeder::new(config.runtime_dir.clone(), &job_id));
        let control_path = server.as_ref().map(|s| s.path().to_path_buf());
        let (finished_tx, finished) = mpsc::channel();
        let cycle = CycleThread {
            shared: shared.clone(),
            transport: transport.clone(),
            rank,
            world_size,
            layout,
            coordinator: (rank == 0).then(|| {
                Coordinator::new(world_size, config.knobs)
                    .with_cache_capacity(config.cache_capacity)
            }),
            cache: RankCache::new(),
            all_ranks: (0..world_size).collect(),
            settle: world_size > 1 && transport.shared_memory_peers().len() + 1 == world_size,
            next_cycle: None,
            knobs: config.knobs,
            pending: HashMap::default(),
            spare_entries: Vec::new(),
            stats_held: None,
            stats_sent_at: None,
            fusion: AlignedBuf::default(),
            #[cfg(feature = "cuda")]
            gpu: None,
            #[cfg(feature = "cuda")]
            nccl: config.nccl,
            #[cfg(feature = "cuda")]
            gpu_timeout: config.timeout,
            timeline,
            server,
            feeder,
            warned_fallback: false,
            faults: faults.clone(),
            autotune: match (&config.autotune, rank) {
                (Some(a), 0) => Some(AutotuneDriver {
                    config: a.clone(),
                    job_id: job_id.clone(),
                    warned: false,
                    #[cfg(feature = "autotune")]
                    tuner: None,
                    #[cfg(feature = "autotune")]
                    watcher: None,
                    report_threads: Vec::new(),
                }),
                _ => None,
            },
            post: Vec::with_capacity(crate::shm::MAX_POST_BYTES),
        };
        // The background thread holds the only strong reference: the engine (and the
        // links it holds) goes when the thread ends, not when the last handle does.
        let engine = Arc::new(Mutex::new(Engine {
            cycle,
            last: None,
            outcome: None,
        }));
        let engine_ref = EngineRef(Arc::downgrade(&engine), Arc::downgrade(&shared));
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ringwatch-cycle-{rank}"))
            .spawn(move || {
                Engine::run(engine, &thread_shared);
                let _ = finished_tx.send(());
            })
            .map_err(|e| CollectiveError::Config(format!("cannot start the cycle thread: {e}")))?;
        Ok(Runtime {
            shared,
            transport,
            engine: engine_ref,
            thread: Some(thread),
            finished,
            timeout: config.timeout,
            ranks,
            job_id,
            control_path,
            faults,
            #[cfg(feature = "cuda")]
            gpu_device: std::sync::OnceLock::new(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The ranks this rank exchanges data with through shared memory (same host), not TCP.
    pub fn shared_memory_peers(&self) -> Vec<usize> {
        self.transport.shared_memory_peers()
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Every rank of the job.
    pub fn ranks(&self) -> &[RankInfo] {
        &self.ranks
    }

    /// The job's id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// The control socket's path (rank 0 with the socket enabled).
    pub fn control_socket_path(&self) -> Option<&Path> {
        self.control_path.as_deref()
    }

    /// The knobs in force and the cycle this rank is at.
    pub fn knobs(&self) -> (Knobs, u64) {
        self.shared.knobs.lock().map(|g| *g).unwrap_or_default()
    }

    /// The job's autotune state (rank 0 keeps it; other ranks say `off`).
    pub fn autotune_state(&self) -> AutotuneState {
        self.shared.claims.state()
    }

    /// How this job's self-tuning session ended, once it has (rank 0, state `done` after
    /// self-tuning; the report, if asked for, is written by then).
    pub fn self_tune_outcome(&self) -> Option<SelfTuneOutcome> {
        self.shared.self_tune.lock().ok().and_then(|o| o.clone())
    }

    /// Totals since start.
    pub fn totals(&self) -> Totals {
        Totals {
            cycles: self.shared.cycles.load(Ordering::Relaxed),
            bytes_reduced: self.shared.bytes_reduced.load(Ordering::Relaxed),
            negotiation_bytes: self.shared.negotiation_bytes.load(Ordering::Relaxed),
            settled_cycles: self.shared.settled_cycles.load(Ordering::Relaxed),
            caller_cycles: self.shared.caller_cycles.load(Ordering::Relaxed),
            quick_cycles: self.shared.quick_cycles.load(Ordering::Relaxed),
            nccl_allreduces: self.shared.nccl_allreduces.load(Ordering::Relaxed),
            staged_allreduces: self.shared.staged_allreduces.load(Ordering::Relaxed),
            in_place_allreduces: self.transport.in_place_allreduces(),
        }
    }

    /// A handle that stops this rank from another thread (a signal handler's); see
    /// [`Interrupter`].
    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            shared: self.shared.clone(),
            transport: self.transport.clone(),
            faults: self.faults.clone(),
        }
    }

    /// Asks for a knob change; rank 0 applies it at the next cycle boundary on every rank.
    pub fn set_knobs(&self, update: KnobUpdate) {
        if let Ok(mut inbox) = self.shared.inbox.lock() {
            inbox.knobs.push(update);
            self.shared.work.notify_one();
        }
    }

    /// Puts a tensor in the inbox; `waited`: the caller waits for it at once and runs its
    /// cycle itself ([`Handle::drive`]), so the background thread is not woken for it.
    fn enqueue(&self, name: &str, kind: OpKind, tensor: Tensor, waited: bool) -> Result<Handle> {
        let request = TensorRequest {
            name: name.to_string(),
            kind,
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            device: false,
        };
        self.enqueue_entry(
            request,
            |request, done| Entry {
                request,
                tensor,
                #[cfg(feature = "cuda")]
                device: None,
                done,
            },
            waited,
        )
    }

    /// Puts the entry `make` builds (whose request is `request`) in the inbox.
    fn enqueue_entry(
        &self,
        request: TensorRequest,
        make: impl FnOnce(TensorRequest, Done) -> Entry,
        waited: bool,
    ) -> Result<Handle> {
        let rank = self.shared.rank;
        let name = request.name.clone();
        let name = name.as_str();
        let kind = request.kind;
        let invalid = |message: &str| CollectiveError::InvalidTensor {
            rank,
            name: name.to_string(),
            message: message.to_string(),
        };
        if let OpKind::Broadcast(root) = kind
            && root >= self.world_size()
        {
            return Err(invalid(&format!("root {root} is not a rank")));
        }
        if kind == OpKind::Allgather && request.shape.is_empty() {
            return Err(invalid("allgather needs at least one dimension"));
        }
        {
            let mut in_flight = self
                .shared
                .in_flight
                .lock()
                .map_err(|_| invalid("runtime state poisoned"))?;
            if !in_flight.insert(name.to_string()) {
                return Err(invalid(
                    "a tensor of this name is already in flight on this rank",
                ));
            }
        }
        let (done, completion) = Completion::new(waited);
        let entry = make(request, done);
        let mut inbox = self
            .shared
            .inbox
            .lock()
            .map_err(|_| invalid("runtime state poisoned"))?;
        if let Some(e) = &inbox.closed {
            let e = e.clone();
            drop(inbox);
            self.shared.forget(name);
            return Err(e);
        }
        inbox.entries.push(entry);
        drop(inbox);
        // While callers run the cycles (see `Handle::drive`), this one will run its own
        // when it waits; the background thread's timer takes it within a cycle time if
        // it does not. Waking the background thread for it would cost a wake-up per call
        // and a thread that competes with the callers for the cores.
        if !waited && !self.shared.callers_drive.load(Ordering::Relaxed) {
            self.shared.work.notify_one();
        }
        Ok(Handle {
            name: name.to_string(),
            rank,
            done: completion,
            engine: self.engine.clone(),
        })
    }

    /// Enqueues an allreduce of `tensor` under `name` (the same name and shape on every rank).
    pub fn allreduce_async(&self, name: &str, tensor: Tensor, op: ReduceOp) -> Result<Handle> {
        self.enqueue(name, OpKind::Allreduce(op), tensor, false)
    }

    /// Enqueues an allgather along the first dimension (which may differ across ranks).
    pub fn allgather_async(&self, name: &str, tensor: Tensor) -> Result<Handle> {
        self.enqueue(name, OpKind::Allgather, tensor, false)
    }

    /// Enqueues a broadcast from `root`; other ranks pass a tensor of the same shape.
    pub fn broadcast_async(&self, name: &str, tensor: Tensor, root: usize) -> Result<Handle> {
        self.enqueue(name, OpKind::Broadcast(root), tensor, false)
    }

    /// A zeroed tensor in memory that the other ranks of this host can reach, for a job that
    /// allreduces the same large tensors over and over (gradients). When every rank of a
    /// one-host job allreduces such a tensor, alone (not fused with others: pass them one
    /// at a time, or set the fusion threshold below their size) and larger than 64 KiB, the
    /// runtime reduces it in place: each rank folds its part of the tensor straight from
    /// the others' tensors and writes the result into all of them. No byte is staged
    /// through the shared segment's slots, so a call moves 2 bytes of memory traffic per
    /// byte of the tensor on each rank instead of 4.5 (2 ranks) to 5.75 (4 ranks); see
    /// docs/BENCHMARKS.md. The results are the same bits as an ordinary tensor's.
    ///
    /// Write the tensor and read its result through [`Tensor::as_bytes_mut`] /
    /// [`Tensor::as_bytes`]; hand it to [`Self::allreduce`] and use the tensor it returns
    /// (the same memory). Its memory is given back when it is dropped. Where this rank
    /// shares no memory with others (one rank per host, `RINGWATCH_SHM=0`) it is an
    /// ordinary tensor, and where this rank's arena (its share of `/dev/shm`'s free space
    /// at start, at most 16 GiB) is full too, with a warning. An error where `/dev/shm`
    /// has no room for its pages now.
    pub fn shared_tensor(&self, dtype: crate::DType, shape: &[usize]) -> Result<Tensor> {
        let invalid = |message: String| CollectiveError::InvalidTensor {
            rank: self.shared.rank,
            name: "(shared tensor)".into(),
            message,
        };
        let len = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| invalid(format!("shape {shape:?} of {dtype:?} overflows")))?;
        let lease = self.transport.alloc_shared(len).map_err(|e| {
            invalid(format!(
                "cannot reserve {len} bytes in {}: {e}",
                crate::shm::SHM_DIR
            ))
        })?;
        let Some(lease) = lease.filter(|_| len > 0) else {
            if len > 0 && !self.transport.shared_memory_peers().is_empty() {
                tracing::warn!(
                    bytes = len,
                    "this rank's shared-tensor arena is full: an ordinary tensor instead \
                     (same results, staged through the segment)"
                );
            }
            return Tensor::from_bytes(dtype, shape, crate::tensor::AlignedBuf::zeroed(len))
                .ok_or_else(|| invalid(format!("shape {shape:?} does not fit {len} bytes")));
        };
        let ptr = lease.ptr();
        // SAFETY: the lease is `len` bytes (rounded up to pages), zeroed, mapped for as long
        // as the lease lives, and nobody else writes it outside an allreduce that this
        // tensor is handed to; the tensor owns the lease.
        unsafe { Tensor::from_external(dtype, shape, ptr, len, Box::new(lease)) }
            .ok_or_else(|| invalid(format!("shape {shape:?} does not fit {len} bytes")))
    }

    /// Allreduce and wait.
    pub fn allreduce(&self, name: &str, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.allreduce_blocking(name, tensor, op)
    }

    /// Allgather and wait.
    pub fn allgather(&self, name: &str, tensor: Tensor) -> Result<Tensor> {
        self.enqueue(name, OpKind::Allgather, tensor, true)?.wait()
    }

    /// Broadcast and wait.
    pub fn broadcast(&self, name: &str, tensor: Tensor, root: usize) -> Result<Tensor> {
        self.enqueue(name, OpKind::Broadcast(root), tensor, true)?
            .wait()
    }

    /// Shuts down: waits (up to the peer timeout) until every rank has asked to shut down,
    /// then stops the cycle thread. Pending handles fail.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Ok(mut inbox) = self.shared.inbox.lock() {
            inbox.shutdown = true;
        }
        self.shared.work.notify_one();
        if self.finished.recv_timeout(self.timeout).is_err() {
            tracing::warn!(
                rank = self.shared.rank,
                "other ranks did not shut down in time; breaking the links"
            );
            self.transport.abort();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(f) = &self.faults {
            f.close();
        }
    }
}

/// Stops a running [`Runtime`] from another thread, e.g. on SIGTERM: the other ranks are
/// told that this rank leaves and why, its links are broken, and every pending and later
/// operation fails with [`CollectiveError::Interrupted`]; the runtime then shuts down as on
/// any failure (the control socket's file is removed). Dropping the `Runtime` afterwards
/// does not wait for the other ranks.
#[derive(Clone)]
pub struct Interrupter {
    shared: Arc<Shared>,
    transport: Arc<dyn Transport>,
    faults: Option<Arc<FaultChannel>>,
}

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interrupter")
            .field("rank", &self.shared.rank)
            .finish()
    }
}

impl Interrupter {
    /// Interrupts the runtime; `reason` (e.g. "SIGTERM") goes into every error. Only the
    /// first call counts.
    pub fn interrupt(&self, reason: &str) {
        let first = match self.shared.interrupted.lock() {
            Ok(mut r) if r.is_none() => {
                *r = Some(reason.to_string());
                true
            }
            _ => false,
        };
        if !first {
            return;
        }
        tracing::warn!(
            rank = self.shared.rank,
            reason,
            "interrupted; leaving the job"
        );
        // The notice goes out before the links break, so that rank 0 names this rank
        // before anyone's probe finds every rank still answering.
        if let Some(f) = &self.faults {
            f.announce_exit(&format!("it was interrupted ({reason}) and left the job"));
        }
        self.transport.abort();
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop();
        }
    }
}

impl Shared {
    fn forget(&self, name: &str) {
        if let Ok(mut f) = self.in_flight.lock() {
            f.remove(name);
        }
    }
}

/// The node layout if every node has the same number of ranks in torchrun's order.
fn node_layout(ranks: &[RankInfo]) -> Option<NodeLayout> {
    let local_size = ranks.first()?.local_size;
    let consistent = local_size > 0
        && ranks.len().is_multiple_of(local_size)
        && ranks
            .iter()
            .enumerate()
            .all(|(r, info)| info.local_size == local_size && info.local_rank == r % local_size);
    consistent.then(|| NodeLayout {
        local_size,
        nodes: ranks.len() / local_size,
    })
}

struct CycleThread {
    shared: Arc<Shared>,
    transport: Arc<dyn Transport>,
    rank: usize,
    world_size: usize,
    layout: Option<NodeLayout>,
    coordinator: Option<Coordinator>,
    /// This rank's response cache (rank 0 has one too, beside its coordinator's).
    cache: RankCache,
    all_ranks: Vec<usize>,
    /// Every rank shares this host's segment: settled cycles are decided there.
    settle: bool,
    /// The index of the next cycle, known from the last response (`None` before the
    /// first: the same on every rank).
    next_cycle: Option<u64>,
    knobs: Knobs,
    pending: HashMap<String, Entry, foldhash::fast::RandomState>,
    /// An empty vector for the inbox's next entries (see `cycle`).
    spare_entries: Vec<Entry>,
    /// Statistics of cycles not reported yet, and when the last report went
    /// ([`CycleThread::report_stats`]).
    stats_held: Option<CycleStats>,
    stats_sent_at: Option<Instant>,
    fusion: AlignedBuf,
    /// This rank's GPU side, started by the job's first GPU allreduce.
    #[cfg(feature = "cuda")]
    gpu: Option<crate::gpu::GpuEngine>,
    /// `RuntimeConfig::nccl`.
    #[cfg(feature = "cuda")]
    nccl: bool,
    /// `RuntimeConfig::timeout`: how long NCCL's work may wait on the peers.
    #[cfg(feature = "cuda")]
    gpu_timeout: Duration,
    timeline: Option<TimelineFile>,
    server: Option<Arc<ControlServer>>,
    /// A rank that is not its host's first: its timeline goes to the host's socket.
    feeder: Option<Feeder>,
    warned_fallback: bool,
    faults: Option<Arc<FaultChannel>>,
    /// Rank 0 of a job started with `RINGWATCH_AUTOTUNE=1`.
    autotune: Option<AutotuneDriver>,
    /// The last settled post's buffer, reused ([`CycleThread::settled`]).
    post: Vec<u8>,
}

/// Rank 0's side of `RINGWATCH_AUTOTUNE=1`: waits for an agent's claim, else self-tunes.
struct AutotuneDriver {
    config: AutotuneConfig,
    job_id: String,
    /// The "cannot self-tune" warning was logged.
    #[cfg_attr(feature = "autotune", allow(dead_code))]
    warned: bool,
    #[cfg(feature = "autotune")]
    tuner: Option<selftune::SelfTuner>,
    /// After a pin: the watch that starts a re-check when the throughput moves.
    #[cfg(feature = "autotune")]
    watcher: Option<selftune::Watcher>,
    /// Report writers (one per session); joined at shutdown.
    report_threads: Vec<JoinHandle<()>>,
}

/// Timeline events of one cycle; builds nothing when disabled.
struct Events {
    enabled: bool,
    rank: usize,
    list: Vec<TimelineEvent>,
}

impl Events {
    /// `args` are formatted only when the timeline is on.
    fn add(
        &mut self,
        tensor: &str,
        activity: &str,
        phase: Phase,
        args: &[(&str, &dyn std::fmt::Display)],
    ) {
        if !self.enabled {
            return;
        }
        self.list.push(TimelineEvent {
            rank: self.rank,
            tensor: tensor.to_string(),
            activity: activity.to_string(),
            phase,
            ts_us: now_us(),
            args: args
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        });
    }
}

/// Makes `post` the start of a settled cycle's post ([`CycleThread::settled`]) for cycle
/// `cycle`: the cached tensors' runs follow ([`push_run`]). A post that is not settled
/// is the single byte 0. Every rank's post is built here, whichever path builds it, so
/// that equal cycles post equal bytes.
fn settled_post(post: &mut Vec<u8>, cycle: u64) {
    post.clear();
    post.push(1);
    post.extend_from_slice(&cycle.to_le_bytes());
}

/// Adds a run of cached tensors to a settled post.
fn push_run(post: &mut Vec<u8>, run: coordinator::BitRun) {
    post.extend_from_slice(&run.0.to_le_bytes());
    post.extend_from_slice(&run.1.to_le_bytes());
}

/// The timeline activity and phase of a fusion-buffer copy.
fn copy_activity(phase: CopyPhase) -> (&'static str, Phase) {
    match phase {
        CopyPhase::InBegin => (activity::MEMCPY_IN_FUSION_BUFFER, Phase::Begin),
        CopyPhase::InEnd => (activity::MEMCPY_IN_FUSION_BUFFER, Phase::End),
        CopyPhase::OutBegin => (activity::MEMCPY_OUT_FUSION_BUFFER, Phase::Begin),
        CopyPhase::OutEnd => (activity::MEMCPY_OUT_FUSION_BUFFER, Phase::End),
    }
}

fn negotiate_activity(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce(_) => activity::NEGOTIATE_ALLREDUCE,
        OpKind::Allgather => activity::NEGOTIATE_ALLGATHER,
        OpKind::Broadcast(_) => activity::NEGOTIATE_BROADCAST,
    }
}

/// When the cycle after one that started at `start` and ended at `end` is due
/// (see [`CycleThread::run`]): `cycle_time` after the start with tensors in flight,
/// after the end when idle.
fn next_cycle_at(start: Instant, end: Instant, cycle_time: Duration, idle: bool) -> Instant {
    if idle { end } else { start }.max(start) + cycle_time
}

#[derive(Default)]
struct Work {
    bytes_reduced: u64,
    bytes_total: u64,
    tensors: u64,
    buffers: u64,
}

impl Work {
    /// Counts an allreduce item of `tensors` tensors and `bytes` bytes, and hands each
    /// entry its result.
    fn allreduced(&mut self, bytes: usize, entries: Vec<Entry>) {
        self.bytes_reduced += bytes as u64;
        self.bytes_total += bytes as u64;
        self.tensors += entries.len() as u64;
        self.buffers += 1;
        for e in entries {
            e.succeed();
        }
    }
}

/// One rank's cycles, run by whichever thread holds it: the background thread (on its
/// timer, or when work arrives while it waits) or a caller waiting for its result while
/// nothing else is in flight ([`Handle::drive`]).
struct Engine {
    cycle: CycleThread,
    /// When the last cycle started and ended; `None` before the first.
    last: Option<(Instant, Instant)>,
    /// How the job ended, once it has: the background thread then tears it down.
    outcome: Option<Result<()>>,
}

impl Engine {
    /// The background thread: runs every cycle that is due and nobody else runs, then,
    /// when the job ends, fails what is left and closes the job.
    fn run(engine: Arc<Mutex<Engine>>, shared: &Shared) {
        // Another rank waits in the segment for this rank's next cycle.
        let mut awaited = false;
        loop {
            let locked = if shared.callers_drive.load(Ordering::Relaxed) {
                // Callers run the cycles (`Handle::drive`) of blocking calls one after
                // the other. Blocking on the lock would have every cycle's unlock wake
                // this thread, only to find the next call's caller holding it again.
                match engine.try_lock() {
                    Err(std::sync::TryLockError::WouldBlock) => {
                        wait_while_callers_drive(shared);
                        continue;
                    }
                    Err(std::sync::TryLockError::Poisoned(_)) => Err(()),
                    Ok(e) => Ok(e),
                }
            } else {
                // This thread runs the cycles (async tensors): it takes the engine as
                // soon as a caller that ran one in between lets go.
                engine.lock().map_err(|_| ())
            };
            // A cycle panicked: nothing can be trusted; the links go when we do.
            let Ok(mut e) = locked else {
                return;
            };
            if e.outcome.is_some() {
                break;
            }
            let (next, idle) = e.next_cycle();
            if Instant::now() >= next || (idle && shared.inbox_ready()) || (awaited && !idle) {
                awaited = false;
                e.step(false);
                continue;
            }
            if !idle && e.cycle.settle {
                // Tensors in flight here wait for other ranks' (a cycle in which ranks
                // sent different tensors). When another rank starts a cycle it waits in
                // the segment for this one: join it now rather than at this rank's timer,
                // so that a rank that fell out of step with the others (its idle cycle
                // met their tensors) catches up within microseconds, not a cycle time.
                let transport = e.cycle.transport.clone();
                let ranks = e.cycle.all_ranks.clone();
                drop(e);
                match transport.wait_for_a_post(&ranks, next) {
                    Some(Ok(posted)) => awaited = posted,
                    Some(Err(_)) | None => wait_for_next_cycle(shared, next, idle, false),
                }
                continue;
            }
            // A caller that ran the last cycle runs the next one for its next tensor
            // too: no yielding for it.
            let yield_first = !shared.callers_drive.load(Ordering::Relaxed);
            drop(e);
            wait_for_next_cycle(shared, next, idle, yield_first);
        }
        if let Ok(mut e) = engine.lock() {
            let outcome = e.outcome.take().unwrap_or(Ok(()));
            e.cycle.finish(outcome);
        }
    }

    /// When the next cycle is due, and whether this rank is idle (nothing in flight).
    fn next_cycle(&self) -> (Instant, bool) {
        let idle = self.cycle.pending.is_empty();
        match self.last {
            // With tensors in flight the next cycle comes `cycle_time` after this one
            // started: the cycle time bounds how long they wait for others to fuse
            // with. An idle rank's timer only keeps the job's cycles going (knobs,
            // shutdown, ranks that wait on it); it counts from the end of the last
            // cycle, so that a cycle that ran longer than `cycle_time` is not followed
            // at once by an empty one that the caller's next tensor misses: that rank
            // would then send nothing while the others send the tensor, they would
            // wait out a whole cycle time, overrun again, and the job would stay in
            // that lock-step of one call per cycle time (seen: 64 KiB blocking calls
            // at ~1.2 ms instead of ~0.1 ms in some runs).
            Some((start, end)) => (
                next_cycle_at(start, end, self.cycle.knobs.cycle_time(), idle),
                idle,
            ),
            None => (Instant::now(), idle),
        }
    }

    /// A caller that ran a cycle lets go of the engine (`e`, locked): the background
    /// thread is woken when the job ended, or when tensors wait for later cycles or came
    /// in for it while the caller held the engine (it takes over now); otherwise it
    /// sleeps on.
    fn release_to_background(e: std::sync::MutexGuard<'_, Self>) {
        let left = !e.cycle.pending.is_empty();
        let shared = e.cycle.shared.clone();
        let ended = e.outcome.is_some();
        drop(e);
        if let Ok(mut inbox) = shared.inbox.lock() {
            if ended {
                inbox.ended = true;
            } else if left || inbox.has_work() {
                inbox.engine_free = true;
            } else {
                return;
            }
        }
        shared.work.notify_all();
    }

    /// Runs one cycle (`by_caller`: on a waiting caller's thread).
    fn step(&mut self, by_caller: bool) {
        let start = Instant::now();
        if by_caller {
            self.cycle
                .shared
                .caller_cycles
                .fetch_add(1, Ordering::Relaxed);
        }
        let interrupted = self
            .cycle
            .shared
            .interrupted
            .lock()
            .ok()
            .and_then(|r| r.clone());
        let result = match interrupted {
            // A job of one rank has no link for the interrupt to break.
            Some(reason) => Err(CollectiveError::Interrupted {
                rank: self.cycle.rank,
                reason,
            }),
            None => {
                self.cycle.autotune_tick();
                self.cycle.cycle(start)
            }
        };
        self.stepped(start, by_caller, result);
    }

    /// A cycle begun at `start` ended with `result` (`Ok(true)`: the job shut down).
    fn stepped(&mut self, start: Instant, by_caller: bool, result: Result<bool>) {
        self.last = Some((start, Instant::now()));
        self.cycle
            .shared
            .callers_drive
            .store(by_caller, Ordering::Relaxed);
        match result {
            Ok(false) => {}
            Ok(true) => self.outcome = Some(Ok(())),
            Err(e) => self.outcome = Some(Err(e)),
        }
    }
}

impl Shared {
    /// Whether the inbox holds something for a cycle (work, knobs, shutdown), or a
    /// caller's cycle ended the job.
    fn inbox_ready(&self) -> bool {
        self.inbox.lock().map_or(true, |i| i.has_work() || i.ended)
    }
}

/// Waits while a caller holds the engine: until one leaves work for this thread (or
/// ends the job), or for at most a cycle time, after which the engine is tried again.
fn wait_while_callers_drive(shared: &Shared) {
    let cycle_time = shared
        .knobs
        .lock()
        .map_or(Duration::from_millis(1), |k| k.0.cycle_time());
    let Ok(mut inbox) = shared.inbox.lock() else {
        return;
    };
    if !std::mem::take(&mut inbox.engine_free)
        && !inbox.ended
        && let Ok((mut inbox, _)) = shared.work.wait_timeout(inbox, cycle_time)
    {
        inbox.engine_free = false;
    }
}

/// Waits until `next`, the start of the next cycle. A rank with nothing in flight
/// (`idle`) starts at once when work arrives instead: the cycle time bounds how long
/// tensors wait to be fused with others, it is not a sleep every request pays. Ranks
/// meet at rank 0 in every cycle anyway, so one that starts early waits there for the
/// others, as it would have at its own timer; results do not depend on when cycles run
/// (see the determinism contract in the crate's docs). Returns at once, too, when a
/// caller's cycle ended the job.
fn wait_for_next_cycle(shared: &Shared, next: Instant, idle: bool, yield_first: bool) {
    if idle && yield_first {
        // The caller's next tensor often follows within microseconds (a blocking
        // allreduce in a loop): yield to it rather than sleep.
        crate::poll::yield_until(crate::poll::YIELD_BUDGET, || {
            Instant::now() >= next || shared.inbox_ready()
        });
    }
    let Ok(mut inbox) = shared.inbox.lock() else {
        return;
    };
    loop {
        // `engine_free`: a caller's cycle left tensors in flight; what to do next is
        // decided afresh.
        if (idle && inbox.has_work()) || inbox.ended || std::mem::take(&mut inbox.engine_free) {
            return;
        }
        let now = Instant::now();
        if now >= next {
            return;
        }
        inbox = match shared.work.wait_timeout(inbox, next - now) {
            Ok((inbox, _)) => inbox,
            Err(_) => return,
        };
    }
}

impl CycleThread {
    /// Fails what is left with the job's final error and closes the job.
    fn finish(&mut self, outcome: Result<()>) {
        let error = match outcome {
            Ok(()) => CollectiveError::ShutDown { rank: self.rank },
            Err(e) => {
                // Break every link so that peers fail now, not after their timeout.
                self.transport.abort();
                let interrupted = self.shared.interrupted.lock().ok().and_then(|r| r.clone());
                let e = match interrupted {
                    // This rank is the cause; the others were told.
                    Some(reason) => CollectiveError::Interrupted {
                        rank: self.rank,
                        reason,
                    },
                    // What this rank saw may be a neighbour giving up: name the rank that
                    // failed first, as rank 0 establishes it (a process that went away, or
                    // one that no longer answers).
                    None => match self.faults.as_ref().and_then(|f| f.lost_rank()) {
                        Some(LostRank {
                            rank: dead,
                            how,
                            silent: false,
                        }) => CollectiveError::RankLost {
                            rank: self.rank,
                            dead,
                            how,
                            detail: e.to_string(),
                        },
                        Some(LostRank {
                            rank: silent,
                            how,
                            silent: true,
                        }) => CollectiveError::RankSilent {
                            rank: self.rank,
                            silent,
                            how,
                            detail: e.to_string(),
                        },
                        None => e,
                    },
                };
                tracing::error!(rank = self.rank, error = %e, "collective job failed");
                e
            }
        };
        let leftovers = match self.shared.inbox.lock() {
            Ok(mut inbox) => {
                inbox.closed = Some(match &error {
                    CollectiveError::ShutDown { .. } | CollectiveError::Interrupted { .. } => {
                        error.clone()
                    }
                    e => CollectiveError::JobFailed {
                        rank: self.rank,
                        cause: e.to_string(),
                    },
                });
                std::mem::take(&mut inbox.entries)
            }
            Err(_) => Vec::new(),
        };
        let pending: Vec<Entry> = self.pending.drain().map(|(_, e)| e).collect();
        for entry in pending.into_iter().chain(leftovers) {
            self.shared.forget(&entry.request.name);
            entry.finish(Err(error.clone()));
        }
        if let Some(server) = self.server.take() {
            server.stop();
        }
        self.timeline.take();
        if let Some(mut d) = self.autotune.take() {
            #[cfg(feature = "autotune")]
            if let Some(t) = d.tuner.take() {
                t.abandon();
                self.shared.claims.end_self_tuning(false);
            }
            for t in d.report_threads.drain(..) {
                let _ = t.join();
            }
        }
    }

    /// Rank 0 of an autotuned job, at a cycle boundary: once the wait for an agent is over
    /// with no claim, start tuning itself (or, built without the `autotune` feature, say
    /// that it cannot).
    fn autotune_tick(&mut self) {
        let Some(d) = &mut self.autotune else { return };
        #[cfg(feature = "autotune")]
        if d.tuner.is_none() && self.shared.claims.begin_self_tuning(Instant::now()) {
            let current = self
                .coordinator
                .as_ref()
                .map(Coordinator::knobs)
                .unwrap_or(self.knobs);
            match selftune::SelfTuner::start(&d.config, current, &d.job_id) {
                Ok(t) => {
                    tracing::info!(
                        job_id = d.job_id,
                        budget = d.config.budget,
                        wait_s = d.config.wait.as_secs_f64(),
                        "no agent claimed the tuning in time; rank 0 tunes the job itself \
                         (no disturbance detection without an agent)"
                    );
                    d.tuner = Some(t);
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot start self-tuning; the job runs untuned");
                    self.shared.claims.end_self_tuning(false);
                }
            }
        }
        #[cfg(not(feature = "autotune"))]
        if !d.warned
            && self.shared.claims.wait_over(Instant::now())
            && self.shared.claims.state() == AutotuneState::Waiting
        {
            d.warned = true;
            tracing::warn!(
                job_id = d.job_id,
                wait_s = d.config.wait.as_secs_f64(),
                "RINGWATCH_AUTOTUNE=1, but this build of collectives has no `autotune` \
                 feature and no agent claimed the job: it runs untuned on its current knobs \
                 (it stays `waiting`, so an agent that comes later may still tune it)"
            );
        }
    }

    /// One cycle, begun at `cycle_start`; `Ok(true)` when the job shuts down.
    fn cycle(&mut self, cycle_start: Instant) -> Result<bool> {
        let mut events = Events {
            enabled: self.timeline.is_some()
                || self.server.as_ref().is_some_and(|s| s.wants_timeline())
                || self
                    .feeder
                    .as_mut()
                    .is_some_and(|f| f.wants_timeline(cycle_start)),
            rank: self.rank,
            list: Vec::new(),
        };
        let (mut entries, knob_updates, shutdown) = {
            let mut inbox = self
                .shared
                .inbox
                .lock()
                .map_err(|_| CollectiveError::JobFailed {
                    rank: self.rank,
                    cause: "runtime state poisoned".into(),
                })?;
            // The inbox gets last cycle's emptied vector, so that enqueueing does not
            // allocate one per cycle.
            (
                std::mem::replace(&mut inbox.entries, std::mem::take(&mut self.spare_entries)),
                std::mem::take(&mut inbox.knobs),
                inbox.shutdown,
            )
        };
        let request = Request {
            tensors: self.cache.encode(entries.iter().map(|e| &e.request)),
            knobs: knob_updates,
            shutdown,
        };
        for entry in entries.drain(..) {
            events.add(
                &entry.request.name,
                negotiate_activity(entry.request.kind),
                Phase::Begin,
                &[],
            );
            self.pending.insert(entry.request.name.clone(), entry);
        }
        self.spare_entries = entries;

        let knob_requests = self
            .server
            .as_ref()
            .map(|s| s.take_knob_requests())
            .unwrap_or_default();
        // A self-tuning session's knobs take the same path as the socket's, last.
        #[cfg(feature = "autotune")]
        let tuner_update = self
            .autotune
            .as_mut()
            .and_then(|d| d.tuner.as_mut())
            .and_then(|t| t.take_update());
        #[cfg(not(feature = "autotune"))]
        let tuner_update: Option<KnobUpdate> = None;
        let settled = self.settled(
            &request,
            !knob_requests.is_empty() || tuner_update.is_some(),
        )?;
        let response = match settled {
            Some(response) => response,
            None => self.negotiated(request, knob_requests, tuner_update)?,
        };
        self.run_response(response, &mut events, cycle_start)
    }

    /// Rank 0's answer to `request`, with this rank's names (see [`Self::negotiate`]).
    fn negotiated(
        &mut self,
        request: Request,
        knob_requests: Vec<server::KnobRequest>,
        tuner_update: Option<KnobUpdate>,
    ) -> Result<Response> {
        let response = self.negotiate(request, knob_requests, tuner_update)?;
        if let Some(cause) = response.abort {
            return Err(CollectiveError::JobFailed {
                rank: self.rank,
                cause,
            });
        }
        let pending = &self.pending;
        self.cache
            .decode(response, |name| {
                pending.get(name).map(|e| e.request.clone())
            })
            .map_err(|cause| CollectiveError::JobFailed {
                rank: self.rank,
                cause,
            })
    }

    /// The cycle `cycle` runs under `knobs`: both in force here from now on.
    fn begin_response(&mut self, cycle: u64, knobs: Knobs) {
        self.next_cycle = Some(cycle + 1);
        if knobs.hierarchical_allreduce && !self.knobs.hierarchical_allreduce {
            self.warned_fallback = false;
        }
        self.knobs = knobs;
        if let Ok(mut k) = self.shared.knobs.lock() {
            *k = (knobs, cycle);
        }
        self.shared.cycles.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs the cycle's `response` (settled or rank 0's): its items, then the statistics
    /// and the timeline; `Ok(true)` when the job shuts down.
    fn run_response(
        &mut self,
        response: Response,
        events: &mut Events,
        cycle_start: Instant,
    ) -> Result<bool> {
        self.begin_response(response.cycle, response.knobs);

        let timeline_on = events.enabled;
        for item in response.items.iter().filter(|_| timeline_on) {
            let names: Vec<&String> = match item {
                Item::Allreduce { names, .. } => names.iter().collect(),
                Item::Allgather { name, .. }
                | Item::Broadcast { name, .. }
                | Item::Error { name, .. } => {
                    vec![name]
                }
            };
            for name in names {
                if let Some(e) = self.pending.get(name) {
                    events.add(name, negotiate_activity(e.request.kind), Phase::End, &[]);
                    events.add(name, activity::QUEUE, Phase::Begin, &[]);
                }
            }
        }
        let mut work = Work::default();
        for item in response.items {
            self.execute(item, &mut work, events)?;
        }
        self.account(&work, response.cycle, cycle_start);
        if !events.list.is_empty() {
            if let Some(server) = &self.server {
                server.publish_timeline(&events.list);
            }
            if let Some(feeder) = self.feeder.as_mut() {
                feeder.send(if self.timeline.is_some() {
                    events.list.clone()
                } else {
                    std::mem::take(&mut events.list)
                });
            }
            if let Some(t) = &self.timeline {
                t.write(std::mem::take(&mut events.list));
            }
        }
        Ok(response.shutdown)
    }

    /// Counts the cycle's `work` and reports its statistics when someone reads them.
    fn account(&mut self, work: &Work, cycle: u64, cycle_start: Instant) {
        self.shared
            .bytes_reduced
            .fetch_add(work.bytes_reduced, Ordering::Relaxed);
        if work.tensors > 0
            && (self.server.as_ref().is_some_and(|s| s.wants_stats()) || self.self_tuning())
        {
            // The wall clock of the cycle's start, read only for the statistics.
            let duration_us = cycle_start.elapsed().as_micros() as u64;
            let stats = CycleStats {
                cycle,
                start_unix_us: now_us().saturating_sub(duration_us),
                duration_us,
                bytes_reduced: work.bytes_reduced,
                bytes_total: work.bytes_total,
                tensors: work.tensors,
                fused_buffers: work.buffers,
                knobs: self.knobs,
            };
            self.report_stats(stats, cycle_start);
        }
    }

    /// Reports a cycle's statistics to the socket's subscribers and the self-tuner, at
    /// most once per [`STATS_EVERY_US`]: a cycle that comes sooner is added to the
    /// held ones (with the same knobs; a knob change sends what is held first). A job
    /// whose callers run a cycle per small call runs hundreds of thousands a second,
    /// which no reader keeps up with.
    fn report_stats(&mut self, stats: CycleStats, cycle_start: Instant) {
        let stats = match self.stats_held.take() {
            Some(mut held) if held.knobs == stats.knobs => {
                held.absorb(&stats);
                held
            }
            Some(held) => {
                self.send_stats(&held);
                stats
            }
            None => stats,
        };
        let due = self.stats_sent_at.is_none_or(|at| {
            cycle_start.saturating_duration_since(at) >= Duration::from_micros(STATS_EVERY_US)
        });
        if due {
            self.send_stats(&stats);
            self.stats_sent_at = Some(cycle_start);
        } else {
            self.stats_held = Some(stats);
        }
    }

    fn send_stats(&mut self, stats: &CycleStats) {
        if let Some(server) = &self.server {
            server.publish_stats(stats);
        }
        #[cfg(feature = "autotune")]
        if let Some(d) = self.autotune.as_mut() {
            if let Some(t) = d.tuner.as_mut() {
                t.observe(stats);
            } else if let Some(context) = d.watcher.as_mut().and_then(|w| w.observe(stats)) {
                // The pinned knobs' throughput moved: re-check them (and tune again
                // if they lost), unless an agent holds the tuning now.
                let recheck = d.watcher.take().map(|w| w.recheck_of());
                if let Some(recheck) = recheck {
                    if self.shared.claims.resume_self_tuning() {
                        match selftune::SelfTuner::recheck(&d.config, recheck, &d.job_id, context) {
                            Ok(t) => d.tuner = Some(t),
                            Err(e) => {
                                tracing::error!(error = %e, "cannot start the re-check");
                                self.shared.claims.end_self_tuning(false);
                            }
                        }
                    } else {
                        tracing::info!(
                            "the throughput changed but the tuning is no longer rank 0's \
                             (an agent holds it): no re-check"
                        );
                    }
                }
            }
        }
    }

    /// Whether rank 0 runs a self-tuning session now, or watches the knobs one pinned:
    /// either way it needs the per-cycle statistics.
    fn self_tuning(&self) -> bool {
        #[cfg(feature = "autotune")]
        return self
            .autotune
            .as_ref()
            .is_some_and(|d| d.tuner.is_some() || d.watcher.is_some());
        #[cfg(not(feature = "autotune"))]
        false
    }

    /// The cycle's response decided on every rank at once, when it can be: every rank
    /// shares this host's segment, posts there that it sends exactly these cached tensors
    /// (all of them cached, no allgather, no knobs, no shutdown; rank 0 adds that its
    /// coordinator is settled, [`Coordinator::is_settled`]), and finds every other rank
    /// posting the same. Then the answer is [`coordinator::settled_items`] under the knobs
    /// in force, which is what rank 0 would answer, and every cache changes as it would
    /// have. `None`: negotiate with rank 0 (every rank finds the same). `updates`: knob
    /// changes wait for this rank's request. The answer is worked out before the post:
    /// when it is one allreduce of one tensor, the tensor's bytes go with the post
    /// ([`Transport::same_posts`]'s `early`), so that a small one needs no barrier of its
    /// own once every post agrees.
    fn settled(&mut self, request: &Request, updates: bool) -> Result<Option<Response>> {
        let Some(cycle) = self.next_cycle.filter(|_| self.settle) else {
            return Ok(None);
        };
        // Last cycle's buffer, so that a post allocates nothing.
        let mut post = std::mem::take(&mut self.post);
        post.clear();
        post.push(0u8);
        let eligible = !updates
            && request.knobs.is_empty()
            && !request.shutdown
            && self
                .coordinator
                .as_ref()
                .is_none_or(Coordinator::is_settled)
            && request.tensors.iter().all(|r| match r {
                coordinator::Ready::Cached(_) => true,
                coordinator::Ready::Full(_) => false,
            })
            && self
                .pending
                .values()
                .all(|e| e.request.kind != OpKind::Allgather)
            && 9 + 8 * request.tensors.len() <= crate::shm::MAX_POST_BYTES;
        // What this cycle runs if every rank posts the same: decided before the post,
        // so that a lone small allreduce can move its inputs with it.
        let mut items = Vec::new();
        if eligible {
            settled_post(&mut post, cycle);
            let mut ready: Vec<&TensorRequest> = Vec::with_capacity(request.tensors.len());
            for r in &request.tensors {
                if let coordinator::Ready::Cached(run) = r {
                    push_run(&mut post, *run);
                    for bit in run.bits() {
                        let (_, cached) = self.cache.table().get(bit).ok_or_else(|| {
                            CollectiveError::JobFailed {
                                rank: self.rank,
                                cause: format!(
                                    "cache bit {bit} is not in this rank's response cache (a \
                                     bug in collectives)"
                                ),
                            }
                        })?;
                        ready.push(cached);
                    }
                }
            }
            items = coordinator::settled_items(ready, &self.knobs);
        }
        // A lone allreduce of one tensor on the flat schedule is the transport's one-shot
        // when it is small: its bytes can go with the post.
        let early = match items.as_slice() {
            [Item::Allreduce { names, .. }]
                if names.len() == 1
                    && !self.knobs.hierarchical_allreduce
                    && crate::shm::EARLY_TRAILER_BYTES + post.len()
                        <= crate::shm::MAX_POST_BYTES =>
            {
                // A GPU tensor's bytes are not in host memory.
                self.pending
                    .get(&names[0])
                    .filter(|e| !e.request.device)
                    .map(|e| e.tensor.as_bytes())
            }
            _ => None,
        };
        let same = self.transport.same_posts(&self.all_ranks, &post, early);
        self.post = post;
        let same = match same {
            Some(same) => same?,
            None => {
                // Not one segment after all (it is the same on every rank).
                self.settle = false;
                return Ok(None);
            }
        };
        if !(same && eligible) {
            return Ok(None);
        }
        let index = self.coordinator.as_mut().map(|c| c.settled_step(&items));
        self.check_settled(cycle, index)?;
        self.cache.refresh(&items);
        self.shared.settled_cycles.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Response {
            cycle,
            knobs: self.knobs,
            items,
            shutdown: false,
            abort: None,
            cache_capacity: None,
        }))
    }

    /// Rank 0's coordinator counted the settled cycle `cycle` as `index` (`None`: not
    /// rank 0): the two must agree.
    fn check_settled(&self, cycle: u64, index: Option<u64>) -> Result<()> {
        match index {
            Some(index) if index != cycle => Err(CollectiveError::JobFailed {
                rank: self.rank,
                cause: format!(
                    "settled cycle {cycle} is cycle {index} for rank 0's coordinator (a bug \
                     in collectives)"
                ),
            }),
            _ => Ok(()),
        }
    }

    fn negotiate(
        &mut self,
        request: Request,
        knob_requests: Vec<server::KnobRequest>,
        tuner_update: Option<KnobUpdate>,
    ) -> Result<WireResponse> {
        let t = &*self.transport;
        let encode = |v: &dyn erased::Encode| v.encode();
        if let Some(coordinator) = &mut self.coordinator {
            let mut requests = Vec::with_capacity(self.world_size);
            requests.push(request);
            let mut request_bytes = 0;
            for peer in 1..self.world_size {
                let got = recv_frame(t, peer, MAX_FRAME_BYTES).and_then(|bytes| {
                    request_bytes += FRAME_HEADER_BYTES + bytes.len();
                    serde_json::from_slice::<Request>(&bytes).map_err(|e| CollectiveError::Link {
                        rank: 0,
                        peer,
                        message: format!("bad request: {e}"),
                    })
                });
                match got {
                    Ok(r) => requests.push(r),
                    Err(e) => {
                        // Tell everyone else which rank failed before the links go down.
                        let abort: WireResponse = Response {
                            cycle: 0,
                            knobs: coordinator.knobs(),
                            items: Vec::new(),
                            shutdown: false,
                            abort: Some(e.to_string()),
                            cache_capacity: None,
                        };
                        let bytes = encode(&abort);
                        for other in (1..self.world_size).filter(|&o| o != peer) {
                            let _ = send_frame(t, other, &bytes);
                        }
                        return Err(e);
                    }
                }
            }
            let mut updates: Vec<KnobUpdate> = knob_requests.iter().map(|r| r.update).collect();
            #[cfg_attr(not(feature = "autotune"), allow(unused_variables))]
            let tuner_sent = tuner_update.is_some();
            updates.extend(tuner_update);
            let response = coordinator.step(requests, &updates);
            for (name, missing) in coordinator.stalled(Instant::now(), STALL_WARNING) {
                tracing::warn!(
                    tensor = %name,
                    ?missing,
                    "tensor enqueued on some ranks but not on ranks {missing:?} for {STALL_WARNING:?}; \
                     every rank must enqueue the same tensors"
                );
            }
            let bytes = encode(&response);
            for peer in 1..self.world_size {
                send_frame(t, peer, &bytes)?;
            }
            let response_bytes = (self.world_size - 1) * (FRAME_HEADER_BYTES + bytes.len());
            self.count_negotiation(response.cycle, request_bytes, response_bytes);
            // In force here before anyone is told so.
            if let Ok(mut k) = self.shared.knobs.lock() {
                *k = (response.knobs, response.cycle);
            }
            if let Some(server) = &self.server {
                server.confirm(knob_requests, response.knobs, response.cycle);
            }
            #[cfg(feature = "autotune")]
            if tuner_sent && let Some(d) = self.autotune.as_mut() {
                let pinned = d
                    .tuner
                    .as_mut()
                    .is_some_and(|t| t.confirmed(response.knobs, response.cycle));
                if pinned && let Some(t) = d.tuner.take() {
                    let (thread, watcher) = t.finish(
                        response.cycle,
                        self.shared.claims.clone(),
                        self.shared.self_tune.clone(),
                    );
                    d.report_threads.retain(|t| !t.is_finished());
                    d.report_threads.extend(thread);
                    d.watcher = watcher;
                }
            }
            Ok(response)
        } else {
            // Knob changes asked for on this host's socket go to rank 0 with the request.
            let mut request = request;
            request.knobs.extend(knob_requests.iter().map(|r| r.update));
            let request = encode(&request);
            send_frame(t, 0, &request)?;
            let bytes = recv_frame(t, 0, MAX_FRAME_BYTES)?;
            let response: WireResponse =
                serde_json::from_slice(&bytes).map_err(|e| CollectiveError::Link {
                    rank: self.rank,
                    peer: 0,
                    message: format!("bad response: {e}"),
                })?;
            self.count_negotiation(
                response.cycle,
                FRAME_HEADER_BYTES + request.len(),
                FRAME_HEADER_BYTES + bytes.len(),
            );
            if let Some(server) = &self.server {
                server.confirm(knob_requests, response.knobs, response.cycle);
            }
            Ok(response)
        }
    }

    /// Adds one cycle's negotiation traffic on this rank's links to the totals.
    fn count_negotiation(&self, cycle: u64, request_bytes: usize, response_bytes: usize) {
        self.shared
            .negotiation_bytes
            .fetch_add((request_bytes + response_bytes) as u64, Ordering::Relaxed);
        tracing::debug!(
            rank = self.rank,
            cycle,
            request_bytes,
            response_bytes,
            "negotiation bytes"
        );
    }

    fn take(&mut self, name: &str) -> Result<Entry> {
        let entry = self
            .pending
            .remove(name)
            .ok_or_else(|| CollectiveError::JobFailed {
                rank: self.rank,
                cause: format!("rank 0 scheduled tensor '{name}', which this rank never enqueued"),
            })?;
        self.shared.forget(name);
        Ok(entry)
    }

    fn algorithm(&mut self) -> Algorithm {
        if !self.knobs.hierarchical_allreduce {
            // The flat schedule; the transport runs it natively when every rank shares
            // this rank's memory, and the timeline says so.
            if self.world_size > 1
                && self.transport.shared_memory_peers().len() + 1 == self.world_size
            {
                return Algorithm::SharedMemory;
            }
            return Algorithm::Ring;
        }
        if self.layout.is_some() {
            return Algorithm::Hierarchical;
        }
        if !self.warned_fallback {
            self.warned_fallback = true;
            tracing::warn!(
                rank = self.rank,
                "hierarchical allreduce needs the same number of ranks on every node \
                 (and LOCAL_RANK = RANK % LOCAL_SIZE); using the flat ring"
            );
        }
        Algorithm::Ring
    }

    fn execute(&mut self, item: Item, work: &mut Work, events: &mut Events) -> Result<()> {
        match item {
            Item::Error { name, message } => {
                if self.pending.contains_key(&name) {
                    let entry = self.take(&name)?;
                    events.add(&name, activity::QUEUE, Phase::End, &[]);
                    entry.finish(Err(CollectiveError::Mismatch { name, message }));
                }
                Ok(())
            }
            Item::Allreduce { names, dtype, op } => {
                let mut entries = Vec::with_capacity(names.len());
                for n in &names {
                    entries.push(self.take(n)?);
                }
                let algorithm = self.algorithm();
                let schedule = match (algorithm, self.layout) {
                    (Algorithm::Hierarchical, Some(l)) => Schedule::Hierarchical(l),
                    _ => Schedule::Ring,
                };
                let algorithm_name = algorithm.name();
                let args: [(&str, &dyn std::fmt::Display); 1] = [("algorithm", &algorithm_name)];
                for e in &entries {
                    events.add(&e.request.name, activity::QUEUE, Phase::End, &[]);
                    events.add(&e.request.name, activity::ALLREDUCE, Phase::Begin, &args);
                }
                #[cfg(feature = "cuda")]
                if entries.iter().any(|e| e.request.device) {
                    return self.execute_device(entries, dtype, op, schedule, work, events);
                }
                let total: usize = entries.iter().map(|e| e.tensor.byte_len()).sum();
                // Only the timeline needs them while the tensors are lent out below.
                let names: Vec<String> = if events.enabled {
                    entries.iter().map(|e| e.request.name.clone()).collect()
                } else {
                    Vec::new()
                };
                let mut views: Vec<&mut [u8]> = entries
                    .iter_mut()
                    .map(|e| e.tensor.as_bytes_mut())
                    .collect();
                let outcome = allreduce_tensors(
                    &*self.transport,
                    &mut views,
                    dtype,
                    op,
                    schedule,
                    SLICE_BYTES,
                    &mut self.fusion,
                    &mut |i, phase| {
                        if let Some(name) = names.get(i) {
                            let (activity, phase) = copy_activity(phase);
                            events.add(name, activity, phase, &[]);
                        }
                    },
                );
                if let Err(e) = outcome {
                    // Back into `pending`, so that they fail with the job's final error.
                    for entry in entries {
                        self.pending.insert(entry.request.name.clone(), entry);
                    }
                    return Err(e);
                }
                for name in &names {
                    events.add(name, activity::ALLREDUCE, Phase::End, &[]);
                }
                work.allreduced(total, entries);
                Ok(())
            }
            Item::Allgather { name, first_dims } => {
                let entry = self.take(&name)?;
                events.add(&name, activity::QUEUE, Phase::End, &[]);
                events.add(&name, activity::ALLGATHER, Phase::Begin, &[]);
                let shape = entry.tensor.shape().to_vec();
                let row_bytes: usize =
                    shape[1..].iter().product::<usize>() * entry.tensor.dtype().size();
                let mut blocks = Vec::with_capacity(first_dims.len());
                let mut start = 0;
                for d in &first_dims {
                    blocks.push(start..start + d * row_bytes);
                    start += d * row_bytes;
                }
                let mut out = AlignedBuf::zeroed(start);
                out.as_mut_slice()[blocks[self.rank].clone()]
                    .copy_from_slice(entry.tensor.as_bytes());
                if let Err(e) = ring_allgather(&*self.transport, out.as_mut_slice(), &blocks) {
                    self.pending.insert(name, entry);
                    return Err(e);
                }
                let mut out_shape = shape;
                out_shape[0] = first_dims.iter().sum();
                events.add(&name, activity::ALLGATHER, Phase::End, &[]);
                work.bytes_total += start as u64;
                work.tensors += 1;
                let result =
                    Tensor::from_bytes(entry.tensor.dtype(), &out_shape, out).ok_or_else(|| {
                        CollectiveError::JobFailed {
                            rank: self.rank,
                            cause: format!("allgather of '{name}' produced a wrong size"),
                        }
                    });
                entry.finish(result);
                Ok(())
            }
            Item::Broadcast { name, root } => {
                let mut entry = self.take(&name)?;
                events.add(&name, activity::QUEUE, Phase::End, &[]);
                events.add(&name, activity::BROADCAST, Phase::Begin, &[("root", &root)]);
                if let Err(e) = chain_broadcast(&*self.transport, root, entry.tensor.as_bytes_mut())
                {
                    self.pending.insert(name, entry);
                    return Err(e);
                }
                events.add(&name, activity::BROADCAST, Phase::End, &[]);
                work.bytes_total += entry.tensor.byte_len() as u64;
                work.tensors += 1;
                entry.succeed();
                Ok(())
            }
        }
    }
}

mod erased {
    use serde::Serialize;

    /// JSON encoding of coordination messages (small, once per cycle).
    pub trait Encode {
        fn encode(&self) -> Vec<u8>;
    }

    impl<T: Serialize> Encode for T {
        fn encode(&self) -> Vec<u8> {
            // Serializing these plain structs cannot fail.
            serde_json::to_vec(self).unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_rank_counts_its_next_cycle_from_the_end_of_the_last_one() {
        let start = Instant::now();
        let cycle = Duration::from_millis(1);
        // A cycle that overran its cycle time (3 ms).
        let end = start + Duration::from_millis(3);
        // Tensors in flight: due a cycle time after the start (already past: at once),
        // as the fusion bound says.
        assert_eq!(next_cycle_at(start, end, cycle, false), start + cycle);
        // Idle: a whole cycle time after the end, never at once, so that it does not
        // run an empty cycle that the caller's next tensor just misses.
        assert_eq!(next_cycle_at(start, end, cycle, true), end + cycle);
        // A short cycle: idle still counts from its end.
        let end = start + Duration::from_micros(100);
        assert_eq!(next_cycle_at(start, end, cycle, true), end + cycle);
    }
}
