//! The negotiation's messages: what a rank sends rank 0 every cycle ([`Request`]) and the
//! answer every rank gets ([`Response`]), with the ways they name tensors (by name, or by
//! response-cache bits). Both the coordinator ([`super::coordinator`]) and the response
//! cache ([`super::cache`]) speak them, so they live here, below both.
//!
//! It must never hold logic of either side: plain serializable data, nothing that decides,
//! caches or sends.

use serde::{Deserialize, Serialize};

use crate::control::{KnobUpdate, Knobs};
use crate::tensor::{DType, ReduceOp};

/// The collective a tensor was enqueued for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OpKind {
    /// Allreduce with this op.
    Allreduce(ReduceOp),
    /// Allgather along the first dimension.
    Allgather,
    /// Broadcast from this root.
    Broadcast(usize),
}

/// One rank saying "this tensor is ready here".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRequest {
    /// The tensor's name (the same on every rank).
    pub name: String,
    /// What to do with it.
    pub kind: OpKind,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its memory is on a GPU (feature `cuda`). GPU and host tensors are never fused
    /// together, and a tensor must be on a GPU on every rank or on none.
    #[serde(default, skip_serializing_if = "is_false")]
    pub device: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Response-cache bits `first, first + 1, …, first + count - 1`, written `[first, count]`.
/// Bits are given out in response order, so in a steady workload a whole step's tensors
/// are one run: the order of tensors is kept (it decides what runs first), at a few bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BitRun(pub u32, pub u32);

impl BitRun {
    /// The bits, in order.
    pub fn bits(self) -> impl Iterator<Item = u64> {
        let first = u64::from(self.0);
        first..first + u64::from(self.1)
    }

    /// Whether `bit` is the one right after this run.
    pub fn extends_to(self, bit: u32) -> bool {
        u64::from(self.0) + u64::from(self.1) == u64::from(bit)
    }
}

/// A tensor that became ready on a rank: by its cache bits when it is cached there with
/// exactly this request, else the whole request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Ready {
    /// Tensors cached with exactly these requests on this rank.
    Cached(BitRun),
    /// A tensor by its whole request (new, or changed since it was cached).
    Full(TensorRequest),
}

impl From<TensorRequest> for Ready {
    fn from(request: TensorRequest) -> Self {
        Ready::Full(request)
    }
}

/// A tensor named in a response on the wire: by cache bits when every rank caches it, else
/// by name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TensorRef {
    /// Tensors every rank caches under these bits.
    Cached(BitRun),
    /// A tensor by name.
    Name(String),
}

/// What one rank sends rank 0 every cycle.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Request {
    /// Tensors that became ready on this rank since the last cycle, in the order they did.
    pub tensors: Vec<Ready>,
    /// Knob changes asked for on this rank.
    pub knobs: Vec<KnobUpdate>,
    /// This rank wants to shut down.
    pub shutdown: bool,
    /// This rank has called join (Horovod's `hvd.join`: it has no more data) and waits
    /// for the others; sent every cycle until the response that ends the join.
    #[serde(default, skip_serializing_if = "is_false")]
    pub join: bool,
}

/// One thing every rank does in a cycle, in response order. `T` names a tensor: `String`
/// once decoded, [`TensorRef`] on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Item<T = String> {
    /// Allreduce these tensors together (one fused buffer when more than one).
    Allreduce {
        /// The tensors, in fusion-buffer order.
        names: Vec<T>,
        /// Their dtype.
        dtype: DType,
        /// Their op.
        op: ReduceOp,
    },
    /// Allgather one tensor; `first_dims[r]` is rank r's first dimension.
    Allgather {
        /// The tensor.
        name: T,
        /// First dimension on each rank.
        first_dims: Vec<usize>,
    },
    /// Broadcast one tensor from `root`.
    Broadcast {
        /// The tensor.
        name: T,
        /// The root rank.
        root: usize,
    },
    /// The tensor was enqueued inconsistently: fail it on every rank with this message.
    Error {
        /// The tensor (always by name: a failed tensor leaves every cache).
        name: String,
        /// Which ranks disagree on what.
        message: String,
    },
}

/// Rank 0's answer for one cycle, the same for every rank. `T` names a tensor: `String`
/// once decoded, [`TensorRef`] on the wire ([`WireResponse`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response<T = String> {
    /// Index of this cycle.
    pub cycle: u64,
    /// Knobs in force from this cycle on.
    pub knobs: Knobs,
    /// What to do, in order.
    pub items: Vec<Item<T>>,
    /// Every rank asked to shut down: stop after this cycle.
    pub shutdown: bool,
    /// The job failed (a rank died): fail everything with this message.
    pub abort: Option<String>,
    /// The response cache's capacity, which rank 0 decides for every rank: sent in the
    /// first response (absent: no cache). Every rank sets it before decoding that response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_capacity: Option<usize>,
    /// While some rank has joined: every allreduced tensor of this response with its
    /// element count, so that a joined rank that does not hold it adds zeros of that
    /// size. These tensors leave every response cache (a joined rank has no request to
    /// cache them with).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub join_counts: Vec<(String, usize)>,
    /// Every rank has joined: the join ends on every rank after this cycle, and each
    /// returns this rank, the one that joined last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_done: Option<usize>,
}

/// A response as sent: tensors every rank caches are named by their bits.
pub type WireResponse = Response<TensorRef>;
