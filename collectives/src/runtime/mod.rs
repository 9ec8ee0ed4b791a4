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
//!
//! This file is the API a job calls ([`Runtime`], [`Interrupter`], [`Totals`]); beside it:
//! `config` (what a runtime needs to start), `shared` (what the callers and the cycle's
//! thread share), `handle` (a pending collective), `cycle` (the loop and the engine),
//! `negotiate` (settled cycles and rank 0's answer), `execute` (running the answer),
//! `stats` (per-cycle statistics), and the pieces they use ([`coordinator`], [`cache`],
//! [`messages`], the control socket's server, fault notices, the self-tuner).

pub mod cache;
mod claim;
mod completion;
mod config;
pub mod coordinator;
mod cycle;
#[cfg(feature = "cuda")]
mod device;
mod execute;
mod faults;
mod handle;
pub mod messages;
mod negotiate;
mod quick;
#[cfg(feature = "autotune")]
mod selftune;
mod server;
mod shared;
mod stats;

pub use config::RuntimeConfig;
pub use handle::Handle;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cache::RankCache;
use claim::TuningClaims;
use completion::{Completion, Done};
use coordinator::{Coordinator, OpKind, TensorRequest};
use cycle::{AutotuneDriver, CycleThread, Engine};
use faults::FaultChannel;
use handle::EngineRef;
use server::{ControlServer, Feeder, ServerState};
use shared::{Entry, Inbox, Shared};

use crate::algorithms::NodeLayout;
use crate::control::{
    AutotuneState, Hello, KnobUpdate, Knobs, PROTOCOL_VERSION, RankInfo, StepMarks,
};
use crate::error::{CollectiveError, Result};
use crate::mesh::HostTransport;
use crate::rendezvous::rendezvous;
use crate::tensor::{AlignedBuf, ReduceOp, Tensor};
use crate::timeline::TimelineFile;
use crate::transport::Transport;

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

/// Rank 0's watch over the knobs a self-tuning session pinned (see
/// [`Runtime::self_tune_watch`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WatchStatus {
    /// The knobs watched.
    pub pinned: Knobs,
    /// Windows scored since the pin.
    pub windows: usize,
    /// The pinned knobs' usual rate (bytes reduced per second, median of the first
    /// windows), once enough windows closed to learn it; a later move beyond noise starts a
    /// re-check.
    pub usual_bytes_per_s: Option<f64>,
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
    /// Times a caller's cycle handed the engine back to the background thread, waking it
    /// (tensors left in flight, or others came in meanwhile); the thread's other wake-ups
    /// are its timer's.
    pub handoffs: u64,
    /// Fused buffers of GPU tensors reduced by one `ncclAllReduce` (feature `cuda`).
    pub nccl_allreduces: u64,
    /// Fused buffers of GPU tensors staged through pinned host memory into the rings.
    pub staged_allreduces: u64,
    /// Allreduces (slices of at most 8 MiB) of shared tensors folded in place across the
    /// host's ranks ([`Runtime::shared_tensor`]); the rest were staged through the segment.
    pub in_place_allreduces: u64,
    /// Training steps this rank marked ([`Runtime::mark_step`]).
    pub steps_marked: u64,
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
            handoffs: AtomicU64::new(0),
            nccl_allreduces: AtomicU64::new(0),
            staged_allreduces: AtomicU64::new(0),
            claims: claims.clone(),
            self_tune: Arc::new(Mutex::new(None)),
            watch: Mutex::new(None),
            interrupted: Mutex::new(None),
            callers_drive: AtomicBool::new(false),
            steps: Mutex::new(StepMarks::default()),
            steps_marked: AtomicU64::new(0),
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
            stall: config.stall,
            stall_published: Vec::new(),
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
            join_counts: Vec::new(),
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

    /// Rank 0's watch over the knobs its self-tuning pinned, while it watches
    /// (`RINGWATCH_AUTOTUNE_WATCH`); `None` before the pin, during a re-check, and on the
    /// other ranks.
    pub fn self_tune_watch(&self) -> Option<WatchStatus> {
        self.shared.watch.lock().ok().and_then(|w| *w)
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
            handoffs: self.shared.handoffs.load(Ordering::Relaxed),
            nccl_allreduces: self.shared.nccl_allreduces.load(Ordering::Relaxed),
            staged_allreduces: self.shared.staged_allreduces.load(Ordering::Relaxed),
            in_place_allreduces: self.transport.in_place_allreduces(),
            steps_marked: self.shared.steps_marked.load(Ordering::Relaxed),
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

    /// Marks the end of a training step (call it once per step, on every rank; rank 0's
    /// marks are the ones reported). The per-cycle statistics carry the marks, so a tuning
    /// session scores the job by steps per second, what its user measures, rather than
    /// by the bytes its collectives move. `ringwatch.torch`'s `DistributedOptimizer`
    /// marks each `step()`; a job that marks nothing is tuned by bytes per second.
    pub fn mark_step(&self) {
        self.shared.steps_marked.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut steps) = self.shared.steps.lock() {
            steps.mark(crate::timeline::now_us());
        }
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

    /// Joins (Horovod's `hvd.join`): this rank has no more data. Until every rank has
    /// joined, the others' allreduces go on with zeros from this rank (an average still
    /// divides by the world size), and their allgathers and broadcasts fail, naming the
    /// joined ranks. The handle's result is a one-element `i64` tensor: the rank that
    /// joined last, the same on every rank. An error if this rank has joined already.
    pub fn join_async(&self) -> Result<Handle> {
        let rank = self.shared.rank;
        let (done, completion) = Completion::new(false);
        {
            let mut inbox = self
                .shared
                .inbox
                .lock()
                .map_err(|_| CollectiveError::JobFailed {
                    rank,
                    cause: "runtime state poisoned".into(),
                })?;
            if let Some(e) = &inbox.closed {
                return Err(e.clone());
            }
            if inbox.join.is_some() {
                return Err(CollectiveError::InvalidTensor {
                    rank,
                    name: "(join)".into(),
                    message: "this rank has joined already and waits for the others".into(),
                });
            }
            inbox.join = Some(done);
        }
        self.shared.work.notify_one();
        Ok(Handle {
            name: "(join)".to_string(),
            rank,
            done: completion,
            engine: self.engine.clone(),
        })
    }

    /// [`Self::join_async`] and wait: the rank that joined last.
    pub fn join(&self) -> Result<usize> {
        let last = self.join_async()?.wait()?;
        let bytes: [u8; 8] =
            last.as_bytes()
                .try_into()
                .map_err(|_| CollectiveError::JobFailed {
                    rank: self.shared.rank,
                    cause: "join's result is not one i64 (a bug in collectives)".into(),
                })?;
        Ok(usize::try_from(i64::from_le_bytes(bytes)).unwrap_or(usize::MAX))
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
