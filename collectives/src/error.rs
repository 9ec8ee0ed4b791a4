//! Typed errors of the collective runtime.
//!
//! Every error names the thing it is about (the rank, the peer, the tensor, the path) and,
//! where there is one, what to do. Errors are `Clone` so that one failure can be handed to
//! every pending handle; this module must never hold live I/O objects for that reason.

use std::time::Duration;

/// Result type of this crate.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// What went wrong in a collective job.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    /// A configuration value (environment variable or config field) is missing or invalid.
    #[error("configuration: {0}")]
    Config(String),

    /// Rendezvous could not complete in time; `missing` lists the ranks that never came.
    #[error(
        "rank {rank}: rendezvous timed out after {timeout:?}: rank(s) {missing:?} never came \
         (were they started, with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?)"
    )]
    RendezvousTimeout {
        /// The rank reporting the error.
        rank: usize,
        /// The ranks that did not show up.
        missing: Vec<usize>,
        /// How long we waited.
        timeout: Duration,
    },

    /// Rendezvous failed for another reason (bad hello, mismatched world size or job id).
    #[error("rank {rank}: rendezvous failed: {message}")]
    Rendezvous {
        /// The rank reporting the error.
        rank: usize,
        /// What went wrong.
        message: String,
    },

    /// The link to a peer broke (closed, reset, protocol error).
    #[error("rank {rank}: link to rank {peer} failed: {message}")]
    Link {
        /// The rank reporting the error.
        rank: usize,
        /// The peer at the other end of the link.
        peer: usize,
        /// What went wrong.
        message: String,
    },

    /// A peer did not answer within the operation timeout.
    #[error(
        "rank {rank}: rank {peer} did not answer within {timeout:?} \
         (is it dead or stopped? RINGWATCH_COLLECTIVE_TIMEOUT_SECS sets this limit)"
    )]
    PeerTimeout {
        /// The rank reporting the error.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// The timeout that expired.
        timeout: Duration,
    },

    /// A tensor was enqueued differently on different ranks (shape, dtype, op, root, kind).
    #[error("tensor '{name}': {message}")]
    Mismatch {
        /// The tensor's name.
        name: String,
        /// Which ranks disagree, and on what.
        message: String,
    },

    /// A tensor is invalid on this rank (wrong data length, name already in flight, …).
    #[error("rank {rank}: tensor '{name}': {message}")]
    InvalidTensor {
        /// The rank reporting the error.
        rank: usize,
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        message: String,
    },

    /// Another rank's process went away (seen on the fault channel); `detail` is what this
    /// rank itself saw.
    #[error("rank {rank}: rank {dead} is gone ({how}); here: {detail}")]
    RankLost {
        /// The rank reporting the error.
        rank: usize,
        /// The rank that went away.
        dead: usize,
        /// How it was noticed.
        how: String,
        /// The failure this rank saw (often a neighbour giving up after `dead`).
        detail: String,
    },

    /// Another rank's process is there but stopped answering (stopped with SIGSTOP, hung,
    /// starved of CPU), as rank 0's liveness probe found; `detail` is what this rank saw.
    #[error("rank {rank}: rank {silent} stopped answering ({how}); here: {detail}")]
    RankSilent {
        /// The rank reporting the error.
        rank: usize,
        /// The rank that did not answer.
        silent: usize,
        /// How it was noticed.
        how: String,
        /// The failure this rank saw (often a neighbour giving up after `silent`).
        detail: String,
    },

    /// This rank was told to stop (by a signal, through [`crate::runtime::Interrupter`])
    /// and left the job; the other ranks fail naming it.
    #[error("rank {rank}: interrupted ({reason}); this rank left the job")]
    Interrupted {
        /// The rank reporting the error.
        rank: usize,
        /// Why, e.g. "SIGTERM".
        reason: String,
    },

    /// The job failed earlier (another rank died, a link broke); this operation cannot run.
    #[error("rank {rank}: the job has failed: {cause}")]
    JobFailed {
        /// The rank reporting the error.
        rank: usize,
        /// The original failure.
        cause: String,
    },

    /// A GPU tensor could not be used or reduced (no driver, bad memory, a CUDA or NCCL
    /// failure); the message says which and, where there is one, what to do.
    #[error("rank {rank}: GPU: {message}")]
    Gpu {
        /// The rank reporting the error.
        rank: usize,
        /// What went wrong.
        message: String,
    },

    /// The runtime was shut down before the operation completed.
    #[error("rank {rank}: the runtime has shut down")]
    ShutDown {
        /// The rank reporting the error.
        rank: usize,
    },

    /// Waiting on a handle took longer than the caller allowed.
    #[error("rank {rank}: tensor '{name}' not done after {timeout:?}")]
    WaitTimeout {
        /// The rank reporting the error.
        rank: usize,
        /// The tensor's name.
        name: String,
        /// The caller's limit.
        timeout: Duration,
    },

    /// The control socket failed (bind, protocol).
    #[error("control socket {path}: {message}")]
    Control {
        /// The socket's path.
        path: String,
        /// What went wrong.
        message: String,
    },
}
