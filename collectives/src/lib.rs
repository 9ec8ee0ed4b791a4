//! `collectives`: a Horovod-style collective runtime over TCP and shared memory.
//!
//! # Code map
//! The crate is split the way Gloo splits a collective library; data flows downward:
//! - [`runtime`]: what a training job calls. Named tensors are enqueued and waited on through
//!   handles; a background thread runs one *cycle* every `cycle_time`, in which rank 0 (the
//!   coordinator) decides which tensors are ready on every rank, fuses them up to
//!   `fusion_threshold` bytes and all ranks run the same schedule.
//! - [`algorithms`]: pure schedules (ring allreduce, hierarchical allreduce, ring allgather,
//!   chain broadcast) over the [`transport::Transport`] trait.
//! - [`mesh`]: the links the runtime uses: shared memory ([`shm`]) to the ranks on this host,
//!   TCP ([`transport`]) to the others, decided once at start.
//! - [`transport`]: moves bytes between two ranks (TCP, full duplex; an in-memory mesh for tests).
//! - [`rendezvous`]: who my peers are and how to reach them (torchrun / Open MPI variables).
//! - [`control`]: the one wire protocol between a job (rank 0) and the ringwatch agent. The
//!   agent imports only this module.
//! - [`tensor`], [`knobs`], [`timeline`], [`error`]: the data types around them.
//!
//! # Configuration (environment)
//! - Launcher: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_SIZE` (or `LOCAL_WORLD_SIZE`),
//!   `MASTER_ADDR` (default 127.0.0.1), `MASTER_PORT` (default 29500; `RINGWATCH_MASTER_PORT`
//!   wins, for a job whose torch.distributed store holds `MASTER_PORT`); Open MPI's
//!   `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}` too. `RINGWATCH_JOB_ID` names the job.
//! - Knobs: `RINGWATCH_FUSION_THRESHOLD` (bytes, default 64 MiB), `RINGWATCH_CYCLE_TIME_MS`
//!   (default 1), `RINGWATCH_HIERARCHICAL_ALLREDUCE` (default off); Horovod's
//!   `HOROVOD_FUSION_THRESHOLD`, `HOROVOD_CYCLE_TIME`, `HOROVOD_HIERARCHICAL_ALLREDUCE` too.
//! - Links: `RINGWATCH_SHM=0` sends everything over TCP (default: ranks on the same host —
//!   same boot, network and mount namespace — share a segment in `/dev/shm`).
//!   `RINGWATCH_HOST_ID` splits one machine into hosts that never share memory (tests).
//! - Negotiation: `RINGWATCH_CACHE_CAPACITY` (or Horovod's `HOROVOD_CACHE_CAPACITY`; default
//!   1024, 0 disables): tensors in the response cache, through which a tensor negotiated
//!   before is sent as a bit instead of its name and shape. Rank 0's value holds for all.
//! - Faults: `RINGWATCH_COLLECTIVE_TIMEOUT_SECS` (silent-peer timeout during a collective,
//!   default 30; its old name `RINGWATCH_TIMEOUT_SECS` is still read, with a warning),
//!   `RINGWATCH_CONNECT_TIMEOUT_SECS` (rendezvous, default 60).
//! - Observation: `RINGWATCH_TIMELINE` (Chrome-trace file; `{rank}` in it for one per rank),
//!   `RINGWATCH_RUNTIME_DIR` (control socket dir, default /run/ringwatch, falling back to
//!   `$XDG_RUNTIME_DIR/ringwatch` or `/tmp/ringwatch-<uid>`), `RINGWATCH_CONTROL_SOCKET=0`
//!   to not serve it.
//! - Tuning: `RINGWATCH_AUTOTUNE=1` (or `HOROVOD_AUTOTUNE=1`) puts the job in `waiting`
//!   for `RINGWATCH_AUTOTUNE_WAIT_SECS` (default 5) so that an agent may claim it (see
//!   [`control`]); if none does, rank 0 tunes the job itself (feature `autotune`) with
//!   `RINGWATCH_AUTOTUNE_BUDGET` samples (20), `RINGWATCH_AUTOTUNE_WARMUP_CYCLES` (3),
//!   `RINGWATCH_AUTOTUNE_MEASURED_CYCLES` (10), `RINGWATCH_AUTOTUNE_MIN_WINDOW_MS` (1000),
//!   `RINGWATCH_AUTOTUNE_SEED` (0), pins the best knobs and writes its report to
//!   `RINGWATCH_AUTOTUNE_LOG=PATH.csv` (or `HOROVOD_AUTOTUNE_LOG`) plus `PATH.parquet` and
//!   `PATH.html`. Without an agent there is no disturbance detection: every measured
//!   window counts as clean, scored by the median of three sub-windows, and the choice is
//!   confirmed against the start before it is pinned. After the pin rank 0 watches the
//!   throughput (`RINGWATCH_AUTOTUNE_WATCH`, default on) and re-checks the knobs when it
//!   moves, writing `PATH-recheckN.*`.
//!
//! # Determinism
//! Every rank gets bit-identical results. Each element's reduction order depends only on
//! its index in its own tensor, the world size and the algorithm, never on fusion or cycle
//! time. Switching `hierarchical_allreduce` changes the order, so float sums may differ in
//! the last bits between the two algorithms (integers, min and max never do).
//!
//! # Dependencies
//! This crate depends on nothing else of ringwatch's, with one exception behind the default
//! feature `autotune`: `tuner`, which is allowed because it is pure (no I/O, threads or
//! clock of its own; the one file-writing call, the report, runs on a helper thread here),
//! so it cannot put anything on the job's data path. The agent uses this crate with
//! `default-features = false` and so never pulls it in.
//!
//! # Invariants
//! - Never depends on the agent: a job runs the same with or without one; the control socket
//!   is an observer and advisor, never on the data path.
//! - Every rank gets a bit-identical result: each element is reduced once, in a fixed order,
//!   by exactly one rank, and copied to the others.
//! - Every rank's response cache holds the same tensors under the same bits: tables change
//!   only through rank 0's responses, the same way on every rank. A bit is sent only for a
//!   request identical to the cached one; anything else goes by name, so a mismatch is
//!   still found and reported as without a cache.
//! - Knobs change only at a cycle boundary decided by rank 0 and carried in its response, so
//!   all ranks run the same knobs on the same fused buffers. A knob never changes a result.
//! - Nothing blocks forever: every wait on a peer has a timeout that names the peer, and
//!   the rendezvous connections stay open as a fault channel through which rank 0 tells
//!   every rank which process went away, so survivors name the rank that died.

pub mod algorithms;
pub mod control;
pub mod env_vars;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod knobs;
pub mod mesh;
mod poll;
pub mod rendezvous;
pub mod runtime;
pub mod shm;
pub mod tensor;
pub mod timeline;
pub mod transport;

pub use control::Knobs;
pub use error::{CollectiveError, Result};
pub use runtime::{Handle, Interrupter, Runtime, RuntimeConfig};
pub use tensor::{DType, Element, ReduceOp, Tensor};

/// Helpers shared by the unit tests of several modules.
#[cfg(test)]
mod test_support {
    use std::collections::HashMap;

    /// An environment lookup backed by `pairs`, for code that reads
    /// variables through a `Fn(&str) -> Option<String>`.
    pub fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |n| map.get(n).cloned()
    }
}
