//! kernel → model: what to watch (`discovery`, and each process's container
//! from `containers`), the BPF programs (`probes`), their records decoded
//! (`events`) into bounded per-thread and per-connection series (`model`),
//! the GPUs (`gpu`, NVML); `lock` keeps one agent per node. The crate's
//! `session` wires them together with the jobs.

pub mod containers;
pub mod discovery;
pub mod events;
pub mod gpu;
pub mod lock;
pub mod model;
pub mod nccl_profiler;
pub mod probes;
pub mod thread_store;
