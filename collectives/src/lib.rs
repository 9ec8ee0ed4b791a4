//! `collectives`: a Horovod-style collective runtime over TCP.
//!
//! # Code map
//! The crate is split the way Gloo splits a collective library; data flows downward:
//! - [`runtime`]: what a training job calls. Named tensors are enqueued and waited on through
//!   handles; a background thread runs one *cycle* every `cycle_time`, in which rank 0 (the
//!   coordinator) decides which tensors are ready on every rank, fuses them up to
//!   `fusion_threshold` bytes and all ranks run the same schedule.
//! - [`algorithms`]: pure schedules (ring allreduce, hierarchical allreduce, ring allgather,
//!   chain broadcast) over the [`transport::Transport`] trait.
//! - [`transport`]: moves bytes between two ranks (TCP, full duplex; an in-memory mesh for tests).
//! - [`rendezvous`]: who my peers are and how to reach them (torchrun / Open MPI variables).
//! - [`control`]: the one wire protocol between a job (rank 0) and the ringwatch agent. The
//!   agent imports only this module.
//! - [`tensor`], [`knobs`], [`timeline`], [`error`]: the data types around them.
//!
//! # Invariants
//! - Never depends on the agent: a job runs the same with or without one; the control socket
//!   is an observer and advisor, never on the data path.
//! - Every rank gets a bit-identical result: each element is reduced once, in a fixed order,
//!   by exactly one rank, and copied to the others.
//! - Knobs change only at a cycle boundary decided by rank 0 and carried in its response, so
//!   all ranks run the same knobs on the same fused buffers. A knob never changes a result.
//! - Nothing blocks forever: every wait on a peer has a timeout that names the peer.

pub mod algorithms;
pub mod control;
pub mod error;
pub mod knobs;
pub mod rendezvous;
pub mod runtime;
pub mod tensor;
pub mod timeline;
pub mod transport;

pub use control::Knobs;
pub use error::{CollectiveError, Result};
pub use runtime::{Handle, Runtime, RuntimeConfig};
pub use tensor::{DType, Element, ReduceOp, Tensor};
