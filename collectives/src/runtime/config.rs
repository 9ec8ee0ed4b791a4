//! What a runtime needs to start ([`RuntimeConfig`]), from the environment or given.
//!
//! It must never start anything: it only reads and checks settings.

use std::path::PathBuf;
use std::time::Duration;

use super::cache::DEFAULT_CACHE_CAPACITY;
use crate::control::Knobs;
use crate::error::Result;
use crate::knobs::{
    AutotuneConfig, StallConfig, autotune_from, cache_capacity_from, knobs_from_env, parse_bool,
    stall_from, timeout_from,
};
use crate::rendezvous::RendezvousConfig;

/// Everything a runtime needs to start.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Where this rank stands and how to meet the others.
    pub rendezvous: RendezvousConfig,
    /// Initial knobs.
    pub knobs: Knobs,
    /// How long any rank waits on a silent peer before failing
    /// (`RINGWATCH_COLLECTIVE_TIMEOUT_SECS`).
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
    /// Rank 0's stall check and the optional stall shutdown (`RINGWATCH_STALL_CHECK_SECS`,
    /// `RINGWATCH_STALL_SHUTDOWN_SECS`). Only rank 0's value matters.
    pub stall: StallConfig,
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
            stall: StallConfig::default(),
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
            stall: stall_from(&get)?,
        })
    }
}
