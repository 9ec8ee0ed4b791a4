//! Rank 0's negotiation: which tensors are ready on every rank, in which order, fused how,
//! and which knobs are in force. Pure logic on messages, so it is tested without sockets.
//!
//! It must never look at tensor data, and every decision it makes must be sent to every
//! rank in the same response: ranks never decide anything on their own.

use std::collections::HashMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{KnobUpdate, Knobs};
use crate::tensor::{DType, ReduceOp};

/// Longest cycle time the coordinator accepts (longer requests are clamped), so that a knob
/// cannot make ranks wait on each other past their timeout.
pub const MAX_CYCLE_TIME_US: u64 = 1_000_000;

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
}

/// What one rank sends rank 0 every cycle.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Request {
    /// Tensors that became ready on this rank since the last cycle.
    pub tensors: Vec<TensorRequest>,
    /// Knob changes asked for on this rank.
    pub knobs: Vec<KnobUpdate>,
    /// This rank wants to shut down.
    pub shutdown: bool,
}

/// One thing every rank does in a cycle, in response order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Item {
    /// Allreduce these tensors together (one fused buffer when more than one).
    Allreduce {
        /// The tensors, in fusion-buffer order.
        names: Vec<String>,
        /// Their dtype.
        dtype: DType,
        /// Their op.
        op: ReduceOp,
    },
    /// Allgather one tensor; `first_dims[r]` is rank r's first dimension.
    Allgather {
        /// The tensor.
        name: String,
        /// First dimension on each rank.
        first_dims: Vec<usize>,
    },
    /// Broadcast one tensor from `root`.
    Broadcast {
        /// The tensor.
        name: String,
        /// The root rank.
        root: usize,
    },
    /// The tensor was enqueued inconsistently: fail it on every rank with this message.
    Error {
        /// The tensor.
        name: String,
        /// Which ranks disagree on what.
        message: String,
    },
}

/// Rank 0's answer for one cycle, the same for every rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// Index of this cycle.
    pub cycle: u64,
    /// Knobs in force from this cycle on.
    pub knobs: Knobs,
    /// What to do, in order.
    pub items: Vec<Item>,
    /// Every rank asked to shut down: stop after this cycle.
    pub shutdown: bool,
    /// The job failed (a rank died): fail everything with this message.
    pub abort: Option<String>,
}

/// The coordinator's state between cycles.
#[derive(Debug)]
pub struct Coordinator {
    world_size: usize,
    table: HashMap<String, Vec<Option<TensorRequest>>>,
    /// Names in order of first arrival: the order ready tensors are answered in.
    arrival: Vec<String>,
    shutdown: Vec<bool>,
    knobs: Knobs,
    cycle: u64,
    /// When each waiting name first arrived, and whether it was reported as stalled.
    first_seen: HashMap<String, (Instant, bool)>,
}

impl Coordinator {
    /// A coordinator for `world_size` ranks starting with `knobs`.
    pub fn new(world_size: usize, knobs: Knobs) -> Self {
        Coordinator {
            world_size,
            table: HashMap::new(),
            arrival: Vec::new(),
            shutdown: vec![false; world_size],
            knobs: clamp(knobs),
            cycle: 0,
            first_seen: HashMap::new(),
        }
    }

    /// Tensors some ranks have enqueued and others not, for longer than `after` (as of
    /// `now`), each with the ranks that have not enqueued it. Each is reported once: a
    /// rank that never enqueues a tensor is a bug in the training script, not a hang here,
    /// but it must be visible (Horovod's stall check).
    pub fn stalled(&mut self, now: Instant, after: Duration) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for name in &self.arrival {
            if let (Some((since, reported)), Some(slot)) =
                (self.first_seen.get_mut(name), self.table.get(name))
                && !*reported
                && now.saturating_duration_since(*since) >= after
            {
                *reported = true;
                let missing = slot
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.is_none())
                    .map(|(r, _)| r)
                    .collect();
                out.push((name.clone(), missing));
            }
        }
        out
    }

    /// One cycle: `requests[r]` is rank r's request; `control_updates` are knob changes
    /// from the control socket (applied after those from ranks).
    pub fn step(&mut self, requests: Vec<Request>, control_updates: &[KnobUpdate]) -> Response {
        let mut items = Vec::new();
        for (rank, request) in requests.into_iter().enumerate() {
            for update in &request.knobs {
                self.knobs = clamp(self.knobs.with(update));
            }
            self.shutdown[rank] |= request.shutdown;
            for t in request.tensors {
                let slot = self.table.entry(t.name.clone()).or_insert_with(|| {
                    self.arrival.push(t.name.clone());
                    self.first_seen
                        .insert(t.name.clone(), (Instant::now(), false));
                    vec![None; self.world_size]
                });
                if slot[rank].is_some() {
                    items.push(Item::Error {
                        message: format!("enqueued twice on rank {rank} before completing"),
                        name: t.name,
                    });
                } else {
                    slot[rank] = Some(t);
                }
            }
        }
        for update in control_updates {
            self.knobs = clamp(self.knobs.with(update));
        }

        let mut ready = Vec::new();
        let mut waiting = Vec::new();
        for name in std::mem::take(&mut self.arrival) {
            let complete = self
                .table
                .get(&name)
                .is_some_and(|slot| slot.iter().all(Option::is_some));
            if complete {
                self.first_seen.remove(&name);
                if let Some(slot) = self.table.remove(&name) {
                    ready.push(slot.into_iter().flatten().collect::<Vec<_>>());
                }
            } else {
                waiting.push(name);
            }
        }
        self.arrival = waiting;

        // Fusion: an allreduce joins the open buffer of its dtype and op if it fits.
        let threshold = self.knobs.fusion_threshold_bytes;
        let mut open: HashMap<(DType, ReduceOp), (usize, u64)> = HashMap::new();
        for reqs in ready {
            match validate(&reqs, self.world_size) {
                Err(message) => items.push(Item::Error {
                    name: reqs[0].name.clone(),
                    message,
                }),
                Ok(()) => {
                    let first = &reqs[0];
                    match first.kind {
                        OpKind::Allreduce(op) => {
                            let bytes =
                                (first.shape.iter().product::<usize>() * first.dtype.size()) as u64;
                            let key = (first.dtype, op);
                            match open.get_mut(&key) {
                                Some((idx, used))
                                    if threshold > 0 && *used + bytes <= threshold =>
                                {
                                    if let Some(Item::Allreduce { names, .. }) = items.get_mut(*idx)
                                    {
                                        names.push(first.name.clone());
                                        *used += bytes;
                                    }
                                }
                                _ => {
                                    open.insert(key, (items.len(), bytes));
                                    items.push(Item::Allreduce {
                                        names: vec![first.name.clone()],
                                        dtype: first.dtype,
                                        op,
                                    });
                                }
                            }
                        }
                        OpKind::Allgather => items.push(Item::Allgather {
                            name: first.name.clone(),
                            first_dims: reqs.iter().map(|r| r.shape[0]).collect(),
                        }),
                        OpKind::Broadcast(root) => items.push(Item::Broadcast {
                            name: first.name.clone(),
                            root,
                        }),
                    }
                }
            }
        }
        let response = Response {
            cycle: self.cycle,
            knobs: self.knobs,
            items,
            shutdown: self.shutdown.iter().all(|&s| s),
            abort: None,
        };
        self.cycle += 1;
        response
    }

    /// The knobs in force.
    pub fn knobs(&self) -> Knobs {
        self.knobs
    }
}

/// Shortest cycle time the coordinator accepts: a cycle of 0 would spin on negotiation.
pub const MIN_CYCLE_TIME_US: u64 = 50;

fn clamp(mut knobs: Knobs) -> Knobs {
    knobs.cycle_time_us = knobs
        .cycle_time_us
        .clamp(MIN_CYCLE_TIME_US, MAX_CYCLE_TIME_US);
    knobs
}

/// "x on ranks [0, 2], y on ranks [1]" for the values that differ.
fn describe<T: Debug + PartialEq>(values: &[T]) -> String {
    let mut groups: Vec<(&T, Vec<usize>)> = Vec::new();
    for (rank, v) in values.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((v, vec![rank])),
        }
    }
    groups
        .iter()
        .map(|(v, ranks)| format!("{v:?} on ranks {ranks:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn validate(reqs: &[TensorRequest], world_size: usize) -> Result<(), String> {
    let kinds: Vec<OpKind> = reqs.iter().map(|r| r.kind).collect();
    if kinds.iter().any(|k| *k != kinds[0]) {
        return Err(format!(
            "operation differs across ranks: {}",
            describe(&kinds)
        ));
    }
    let dtypes: Vec<DType> = reqs.iter().map(|r| r.dtype).collect();
    if dtypes.iter().any(|d| *d != dtypes[0]) {
        return Err(format!("dtype differs across ranks: {}", describe(&dtypes)));
    }
    match kinds[0] {
        OpKind::Allgather => {
            let tails: Vec<&[usize]> = reqs
                .iter()
                .map(|r| r.shape.get(1..).unwrap_or(&[]))
                .collect();
            if reqs.iter().any(|r| r.shape.is_empty()) {
                return Err("allgather needs at least one dimension on every rank".into());
            }
            if tails.iter().any(|t| *t != tails[0]) {
                let shapes: Vec<&Vec<usize>> = reqs.iter().map(|r| &r.shape).collect();
                return Err(format!(
                    "allgather shapes differ beyond the first dimension: {}",
                    describe(&shapes)
                ));
            }
        }
        OpKind::Broadcast(root) if root >= world_size => {
            return Err(format!(
                "broadcast root {root} is not a rank (world size {world_size})"
            ));
        }
        _ => {
            let shapes: Vec<&Vec<usize>> = reqs.iter().map(|r| &r.shape).collect();
            if shapes.iter().any(|s| *s != shapes[0]) {
                return Err(format!("shape differs across ranks: {}", describe(&shapes)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, shape: &[usize], kind: OpKind) -> TensorRequest {
        TensorRequest {
            name: name.into(),
            kind,
            dtype: DType::F32,
            shape: shape.to_vec(),
        }
    }

    fn sum() -> OpKind {
        OpKind::Allreduce(ReduceOp::Sum)
    }

    #[test]
    fn answers_only_tensors_ready_everywhere_in_arrival_order() {
        let mut c = Coordinator::new(2, Knobs::default());
        let r0 = Request {
            tensors: vec![req("a", &[4], sum()), req("b", &[4], sum())],
            ..Default::default()
        };
        let r1 = Request {
            tensors: vec![req("b", &[4], sum())],
            ..Default::default()
        };
        let resp = c.step(vec![r0, r1], &[]);
        assert_eq!(
            resp.items,
            vec![Item::Allreduce {
                names: vec!["b".into()],
                dtype: DType::F32,
                op: ReduceOp::Sum
            }]
        );
        let r1 = Request {
            tensors: vec![req("a", &[4], sum())],
            ..Default::default()
        };
        let resp = c.step(vec![Request::default(), r1], &[]);
        assert_eq!(resp.cycle, 1);
        assert!(
            matches!(&resp.items[0], Item::Allreduce { names, .. } if names == &vec!["a".to_string()])
        );
    }

    #[test]
    fn fuses_up_to_the_threshold_and_zero_disables() {
        for (threshold, expected_buffers) in [(0u64, 3usize), (32, 2), (1 << 20, 1)] {
            let knobs = Knobs {
                fusion_threshold_bytes: threshold,
                ..Knobs::default()
            };
            let mut c = Coordinator::new(1, knobs);
            let tensors = vec![
                req("a", &[4], sum()),
                req("b", &[4], sum()),
                req("c", &[4], sum()),
            ];
            let resp = c.step(
                vec![Request {
                    tensors,
                    ..Default::default()
                }],
                &[],
            );
            assert_eq!(resp.items.len(), expected_buffers, "threshold {threshold}");
        }
    }

    #[test]
    fn a_tensor_missing_on_some_ranks_is_reported_once_as_stalled() {
        let mut c = Coordinator::new(3, Knobs::default());
        let r = Request {
            tensors: vec![req("late", &[4], sum())],
            ..Default::default()
        };
        c.step(vec![r.clone(), Request::default(), r], &[]);
        let later = Instant::now() + Duration::from_secs(61);
        assert!(
            c.stalled(Instant::now(), Duration::from_secs(60))
                .is_empty()
        );
        assert_eq!(
            c.stalled(later, Duration::from_secs(60)),
            vec![("late".to_string(), vec![1])]
        );
        assert!(c.stalled(later, Duration::from_secs(60)).is_empty());
    }

    #[test]
    fn mismatches_name_the_tensor_and_the_ranks() {
        let mut c = Coordinator::new(3, Knobs::default());
        let reqs = (0..3)
            .map(|r| Request {
                tensors: vec![req("w", &[if r == 1 { 5 } else { 4 }], sum())],
                ..Default::default()
            })
            .collect();
        let resp = c.step(reqs, &[]);
        match &resp.items[0] {
            Item::Error { name, message } => {
                assert_eq!(name, "w");
                assert!(
                    message.contains("[4] on ranks [0, 2]") && message.contains("[5] on ranks [1]"),
                    "{message}"
                );
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn knob_changes_are_carried_and_shutdown_needs_every_rank() {
        let mut c = Coordinator::new(2, Knobs::default());
        let r1 = Request {
            knobs: vec![KnobUpdate {
                hierarchical_allreduce: Some(true),
                ..Default::default()
            }],
            shutdown: true,
            ..Default::default()
        };
        let resp = c.step(
            vec![Request::default(), r1],
            &[KnobUpdate {
                cycle_time_us: Some(u64::MAX),
                ..Default::default()
            }],
        );
        assert!(resp.knobs.hierarchical_allreduce);
        assert_eq!(resp.knobs.cycle_time_us, MAX_CYCLE_TIME_US);
        assert!(!resp.shutdown);
        let resp = c.step(
            vec![
                Request {
                    shutdown: true,
                    ..Default::default()
                },
                Request::default(),
            ],
            &[],
        );
        assert!(resp.shutdown);
    }
}
