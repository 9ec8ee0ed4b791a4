//! kernel → model: what to watch (`discovery`, and each process's container
//! from `containers`), the BPF programs (`probes`), their records decoded
//! (`events`) into bounded per-thread and per-connection series (`model`),
//! wired together by `session`; `lock` keeps one agent per node.

pub mod containers;
pub mod discovery;
pub mod events;
pub mod lock;
pub mod model;
pub mod probes;
pub mod session;
pub mod thread_store;
