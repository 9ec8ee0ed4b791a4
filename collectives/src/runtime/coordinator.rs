//! Rank 0's negotiation: which tensors are ready on every rank, in which order, fused how,
//! and which knobs are in force. Pure logic on messages, so it is tested without sockets.
//!
//! It must never look at tensor data, and every decision it makes must be sent to every
//! rank in the same response: ranks never decide anything on their own.
//!
//! With the response cache ([`super::cache`]) ranks send bits for tensors negotiated before
//! and the response names such tensors by bit. The coordinator turns bits back into the
//! requests they stand for before deciding anything, so its decisions are exactly those of
//! the name path; only the messages are smaller.

use std::collections::HashMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use super::cache::ResponseCache;
pub use super::messages::{
    BitRun, Item, OpKind, Ready, Request, Response, TensorRef, TensorRequest, WireResponse,
};
use crate::control::{KnobUpdate, Knobs};
use crate::tensor::{DType, ReduceOp};

/// Longest cycle time the coordinator accepts (longer requests are clamped), so that a knob
/// cannot make ranks wait on each other past their timeout.
pub const MAX_CYCLE_TIME_US: u64 = 1_000_000;

/// What rank 0 keeps of a cached tensor: enough to rebuild any rank's request from its bit.
/// (Not every rank's request: a validated request is the same on every rank, but for the
/// first dimension of an allgather.)
#[derive(Clone, Debug)]
struct Negotiated {
    /// Rank 0's request.
    request: TensorRequest,
    /// For an allgather, each rank's first dimension; empty otherwise.
    first_dims: Vec<usize>,
}

impl Negotiated {
    /// From the validated requests of every rank.
    fn of(reqs: &[TensorRequest]) -> Self {
        Negotiated {
            request: reqs[0].clone(),
            first_dims: match reqs[0].kind {
                OpKind::Allgather => reqs.iter().map(|r| r.shape[0]).collect(),
                _ => Vec::new(),
            },
        }
    }

    /// The request `rank` made.
    fn request_of(&self, rank: usize) -> TensorRequest {
        let mut request = self.request.clone();
        if let (Some(dim), Some(&mine)) = (request.shape.first_mut(), self.first_dims.get(rank)) {
            *dim = mine;
        }
        request
    }
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
    /// Ranks whose request for a waiting name came in this step, after others' in an
    /// earlier one: the late ranks, if the name completes now.
    arrived_late: Vec<(String, usize)>,
    /// Late ranks since the last [`Self::take_late`], and the tensors they made wait.
    late: Vec<crate::control::LateRank>,
    waited: u64,
    /// When the current (or last) step began.
    step_started: Instant,
    /// Rank 0's copy of the response cache every rank keeps.
    cache: ResponseCache<Negotiated>,
    /// Ranks that have joined (`Request::join`) and wait for the others; the join ends
    /// when every rank has.
    joined: Vec<bool>,
    /// The rank that joined last in the current join.
    last_joined: Option<usize>,
}

impl Coordinator {
    /// A coordinator for `world_size` ranks starting with `knobs`, without a response cache
    /// (every tensor negotiated by name).
    pub fn new(world_size: usize, knobs: Knobs) -> Self {
        Coordinator {
            world_size,
            table: HashMap::new(),
            arrival: Vec::new(),
            shutdown: vec![false; world_size],
            knobs: clamp(knobs),
            cycle: 0,
            first_seen: HashMap::new(),
            arrived_late: Vec::new(),
            late: Vec::new(),
            waited: 0,
            step_started: Instant::now(),
            cache: ResponseCache::new(0),
            joined: vec![false; world_size],
            last_joined: None,
        }
    }

    /// This coordinator with a response cache of `capacity` tensors (0: none), which every
    /// rank adopts from the first response. Set it before the first [`Self::step`].
    pub fn with_cache_capacity(mut self, capacity: usize) -> Self {
        self.cache = ResponseCache::new(capacity);
        self
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

    /// Every tensor some ranks have enqueued and others not for at least `after` (as of
    /// `now`), longest waiting first: what the job is stalled on.
    pub fn waiting(&self, now: Instant, after: Duration) -> Vec<crate::control::StalledTensor> {
        let mut out: Vec<(Duration, crate::control::StalledTensor)> = Vec::new();
        for name in &self.arrival {
            let (Some((since, _)), Some(slot)) = (self.first_seen.get(name), self.table.get(name))
            else {
                continue;
            };
            let waited = now.saturating_duration_since(*since);
            if waited < after {
                continue;
            }
            let (mut waiting_ranks, mut missing_ranks) = (Vec::new(), Vec::new());
            let mut kind = "";
            for (rank, request) in slot.iter().enumerate() {
                match request {
                    Some(r) => {
                        waiting_ranks.push(rank);
                        kind = match r.kind {
                            OpKind::Allreduce(_) => "allreduce",
                            OpKind::Allgather => "allgather",
                            OpKind::Broadcast(_) => "broadcast",
                        };
                    }
                    None => missing_ranks.push(rank),
                }
            }
            out.push((
                waited,
                crate::control::StalledTensor {
                    name: name.clone(),
                    kind: kind.to_owned(),
                    waiting_ranks,
                    missing_ranks,
                    waiting_secs: waited.as_secs_f64(),
                },
            ));
        }
        out.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.name.cmp(&b.1.name)));
        out.into_iter().map(|(_, t)| t).collect()
    }

    /// A response that fails every rank because the job has been stalled past the stall
    /// shutdown: the error names the tensors and the ranks missing from each.
    pub fn stall_shutdown(
        &mut self,
        stalled: &[crate::control::StalledTensor],
        after: Duration,
    ) -> WireResponse {
        let shown = 8;
        let mut tensors: Vec<String> = stalled
            .iter()
            .take(shown)
            .map(|t| {
                format!(
                    "{} '{}' enqueued on ranks {:?} but not on ranks {:?}",
                    t.kind, t.name, t.waiting_ranks, t.missing_ranks
                )
            })
            .collect();
        if stalled.len() > shown {
            tensors.push(format!("and {} more", stalled.len() - shown));
        }
        self.abort(format!(
            "the job stalled for {after:?} (RINGWATCH_STALL_SHUTDOWN_SECS): {}; every rank \
             must enqueue the same tensors (uneven data across ranks?)",
            tensors.join("; ")
        ))
    }

    /// One cycle: `requests[r]` is rank r's request; `control_updates` are knob changes
    /// from the control socket (applied after those from ranks). The response names by bit
    /// the tensors every rank caches; every rank decodes it with its
    /// [`super::cache::RankCache`].
    pub fn step(&mut self, requests: Vec<Request>, control_updates: &[KnobUpdate]) -> WireResponse {
        let mut items = Vec::new();
        let now = Instant::now();
        self.step_started = now;
        self.arrived_late.clear();
        for (rank, request) in requests.into_iter().enumerate() {
            for update in &request.knobs {
                self.knobs = clamp(self.knobs.with(update));
            }
            self.shutdown[rank] |= request.shutdown;
            if request.join && !self.joined[rank] {
                self.joined[rank] = true;
                self.last_joined = Some(rank);
            }
            for ready in request.tensors {
                match ready {
                    Ready::Full(t) => self.arrive(rank, t, &mut items),
                    Ready::Cached(run) => {
                        for bit in run.bits() {
                            match self.cache.get(bit).map(|(_, n)| n.request_of(rank)) {
                                Some(t) => self.arrive(rank, t, &mut items),
                                None => {
                                    return self.abort(format!(
                                        "rank {rank} sent response-cache bit {bit}, which rank \
                                         0's cache does not hold (the caches diverged: a bug \
                                         in collectives)"
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
        for update in control_updates {
            self.knobs = clamp(self.knobs.with(update));
        }

        // A tensor is complete when every rank that has not joined sent it: a joined rank
        // adds zeros to an allreduce (Horovod's join).
        let any_joined = self.joined.iter().any(|&j| j);
        let mut ready = Vec::new();
        let mut waiting = Vec::new();
        for name in std::mem::take(&mut self.arrival) {
            let complete = self.table.get(&name).is_some_and(|slot| {
                slot.iter()
                    .zip(&self.joined)
                    .all(|(s, &joined)| s.is_some() || joined)
            });
            if complete {
                if let Some((since, _)) = self.first_seen.remove(&name) {
                    self.count_late(&name, now.saturating_duration_since(since));
                }
                if let Some(slot) = self.table.remove(&name) {
                    let lacking: Vec<usize> =
                        (0..slot.len()).filter(|&r| slot[r].is_none()).collect();
                    ready.push((slot.into_iter().flatten().collect::<Vec<_>>(), lacking));
                }
            } else {
                waiting.push(name);
            }
        }
        self.arrival = waiting;

        let mut fusion = Fusion::new(self.knobs.fusion_threshold_bytes);
        let caching = self.cache.capacity() > 0;
        let mut scheduled: HashMap<String, Negotiated> = HashMap::new();
        let mut join_counts = Vec::new();
        for (reqs, lacking) in ready {
            match validate(&reqs, self.world_size).and_then(|()| joined_rule(&reqs[0], &lacking)) {
                Err(message) => items.push(Item::Error {
                    name: reqs[0].name.clone(),
                    message,
                }),
                Ok(()) => {
                    if any_joined {
                        // A joined rank has no request to cache it with: it goes the full
                        // way next time, and every cache drops it alike.
                        if let OpKind::Allreduce(_) = reqs[0].kind {
                            join_counts
                                .push((reqs[0].name.clone(), reqs[0].shape.iter().product()));
                        }
                    } else if caching {
                        scheduled.insert(reqs[0].name.clone(), Negotiated::of(&reqs));
                    }
                    fusion.push(&mut items, &reqs[0], || {
                        reqs.iter().map(|r| r.shape[0]).collect()
                    });
                }
            }
        }
        let join_done = if any_joined && self.joined.iter().all(|&j| j) {
            self.joined.fill(false);
            self.last_joined.take()
        } else {
            None
        };
        // Named with the cache as every rank has it now, then changed as every rank will.
        let wire_items = self.cache.encode(items.clone());
        self.cache
            .apply(&items, |name| scheduled.get(name).cloned());
        let response = Response {
            cycle: self.cycle,
            knobs: self.knobs,
            items: wire_items,
            shutdown: self.shutdown.iter().all(|&s| s),
            abort: None,
            cache_capacity: (self.cycle == 0 && caching).then(|| self.cache.capacity()),
            join_counts,
            join_done,
        };
        self.cycle += 1;
        response
    }

    /// Whether nothing is waiting between cycles: no tensor some ranks have sent and others
    /// not, no rank asking to shut down, the first response (with the cache's capacity)
    /// sent. Then a cycle in which every rank sends the same cached bits and nothing else
    /// is decided by [`settled_items`] alone, and every rank can decide it
    /// ([`super::settled`]).
    pub fn is_settled(&self) -> bool {
        self.cycle > 0
            && self.table.is_empty()
            && !self.shutdown.iter().any(|&s| s)
            && !self.joined.iter().any(|&j| j)
    }

    /// Records a cycle every rank decided itself (see [`Self::is_settled`]): `items` from
    /// [`settled_items`], with every tensor cached. Changes the cache exactly as
    /// [`Self::step`] would have, and returns the cycle's index.
    pub fn settled_step(&mut self, items: &[Item]) -> u64 {
        self.cache.refresh(items);
        self.next_settled()
    }

    /// [`Self::settled_step`] for a settled cycle of one allreduce of `name`.
    pub fn settled_step_of(&mut self, name: &str) -> u64 {
        self.cache.touch(name);
        self.next_settled()
    }

    fn next_settled(&mut self) -> u64 {
        let cycle = self.cycle;
        self.cycle += 1;
        cycle
    }

    /// Counts the ranks whose request for `name` (complete now, `waited` after its first
    /// request) came in this step while others' came earlier.
    fn count_late(&mut self, name: &str, waited: Duration) {
        let late_us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        if self.arrived_late.iter().any(|(n, _)| n == name) {
            self.waited += 1;
        }
        for (_, rank) in self.arrived_late.iter().filter(|(n, _)| n == name) {
            match self.late.iter_mut().find(|l| l.rank == *rank) {
                Some(l) => {
                    l.tensors += 1;
                    l.late_us_max = l.late_us_max.max(late_us);
                    l.late_us_sum = l.late_us_sum.saturating_add(late_us);
                }
                None => self.late.push(crate::control::LateRank {
                    rank: *rank,
                    tensors: 1,
                    late_us_max: late_us,
                    late_us_sum: late_us,
                }),
            }
        }
    }

    /// The ranks that completed tensors last since the last call (for the cycle's
    /// statistics), by rank, and how many tensors waited for a rank.
    pub fn take_late(&mut self) -> (Vec<crate::control::LateRank>, u64) {
        let mut late = std::mem::take(&mut self.late);
        late.sort_by_key(|l| l.rank);
        (late, std::mem::take(&mut self.waited))
    }

    /// Rank `rank` says `t` is ready.
    fn arrive(&mut self, rank: usize, t: TensorRequest, items: &mut Vec<Item>) {
        // Waiting since an earlier step: this rank comes late.
        let earlier = self
            .first_seen
            .get(&t.name)
            .is_some_and(|(since, _)| *since < self.step_started);
        let slot = self.table.entry(t.name.clone()).or_insert_with(|| {
            self.arrival.push(t.name.clone());
            self.first_seen
                .insert(t.name.clone(), (Instant::now(), false));
            vec![None; self.world_size]
        });
        if earlier && slot[rank].is_none() {
            self.arrived_late.push((t.name.clone(), rank));
        }
        if slot[rank].is_some() {
            items.push(Item::Error {
                message: format!("enqueued twice on rank {rank} before completing"),
                name: t.name,
            });
        } else {
            slot[rank] = Some(t);
        }
    }

    /// A response that fails the job on every rank with `message`.
    fn abort(&mut self, message: String) -> WireResponse {
        let response = Response {
            cycle: self.cycle,
            knobs: self.knobs,
            items: Vec::new(),
            shutdown: false,
            abort: Some(message),
            cache_capacity: None,
            join_counts: Vec::new(),
            join_done: None,
        };
        self.cycle += 1;
        response
    }

    /// The knobs in force.
    pub fn knobs(&self) -> Knobs {
        self.knobs
    }
}

/// Puts ready tensors into a response's items, in order: an allreduce joins the open
/// buffer of its dtype and op if it fits under the fusion threshold (0: no fusion).
struct Fusion {
    threshold: u64,
    /// Per dtype, op and memory (GPU or host): the open buffer's item and its bytes so far.
    open: HashMap<(DType, ReduceOp, bool), (usize, u64)>,
}

impl Fusion {
    fn new(threshold: u64) -> Self {
        Fusion {
            threshold,
            open: HashMap::new(),
        }
    }

    /// Schedules `first` (rank 0's request of a tensor validated on every rank);
    /// `first_dims` gives every rank's first dimension for an allgather.
    fn push(
        &mut self,
        items: &mut Vec<Item>,
        first: &TensorRequest,
        first_dims: impl FnOnce() -> Vec<usize>,
    ) {
        match first.kind {
            OpKind::Allreduce(op) => {
                let bytes = (first.shape.iter().product::<usize>() * first.dtype.size()) as u64;
                let key = (first.dtype, op, first.device);
                match self.open.get_mut(&key) {
                    Some((idx, used)) if self.threshold > 0 && *used + bytes <= self.threshold => {
                        if let Some(Item::Allreduce { names, .. }) = items.get_mut(*idx) {
                            names.push(first.name.clone());
                            *used += bytes;
                        }
                    }
                    _ => {
                        self.open.insert(key, (items.len(), bytes));
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
                first_dims: first_dims(),
            }),
            OpKind::Broadcast(root) => items.push(Item::Broadcast {
                name: first.name.clone(),
                root,
            }),
        }
    }
}

/// The items of a settled cycle ([`Coordinator::is_settled`]) in which every rank sent
/// exactly `ready` (cached, validated before, no allgather: its first dimensions are only
/// rank 0's to know), in order, under `knobs`: what [`Coordinator::step`] would answer.
pub fn settled_items<'a>(
    ready: impl IntoIterator<Item = &'a TensorRequest>,
    knobs: &Knobs,
) -> Vec<Item> {
    let mut items = Vec::new();
    let mut fusion = Fusion::new(knobs.fusion_threshold_bytes);
    for request in ready {
        fusion.push(&mut items, request, Vec::new);
    }
    items
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

/// What may run while the ranks `lacking` have joined without `first`'s tensor: an
/// allreduce of host memory, to which they add zeros (Horovod's rule; an allgather or a
/// broadcast fails on the ranks that enqueued it).
fn joined_rule(first: &TensorRequest, lacking: &[usize]) -> Result<(), String> {
    if lacking.is_empty() {
        return Ok(());
    }
    match first.kind {
        OpKind::Allreduce(_) if first.device => Err(format!(
            "ranks {lacking:?} have joined: a GPU tensor cannot be allreduced with joined \
             ranks (not supported yet; join after the last GPU allreduce)"
        )),
        OpKind::Allreduce(_) => Ok(()),
        OpKind::Allgather | OpKind::Broadcast(_) => Err(format!(
            "ranks {lacking:?} have joined (join): only allreduce goes on while ranks have \
             joined, an allgather or broadcast needs every rank"
        )),
    }
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
    let memory: Vec<&str> = reqs
        .iter()
        .map(|r| if r.device { "gpu" } else { "host" })
        .collect();
    if memory.iter().any(|m| *m != memory[0]) {
        return Err(format!(
            "the tensor is on a GPU on some ranks and in host memory on others: {}",
            describe(&memory)
        ));
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

    fn request(name: &str, shape: &[usize], kind: OpKind) -> TensorRequest {
        TensorRequest {
            name: name.into(),
            kind,
            dtype: DType::F32,
            shape: shape.to_vec(),
            device: false,
        }
    }

    fn req(name: &str, shape: &[usize], kind: OpKind) -> Ready {
        Ready::Full(request(name, shape, kind))
    }

    impl Coordinator {
        /// A step of a coordinator without a cache, whose response names every tensor.
        fn step_named(&mut self, requests: Vec<Request>, updates: &[KnobUpdate]) -> Response {
            let wire = self.step(requests, updates);
            Response {
                items: ResponseCache::<()>::new(0)
                    .decode(wire.items)
                    .expect("no cache, no bits"),
                cycle: wire.cycle,
                knobs: wire.knobs,
                shutdown: wire.shutdown,
                abort: wire.abort,
                cache_capacity: wire.cache_capacity,
                join_counts: wire.join_counts,
                join_done: wire.join_done,
            }
        }
    }

    fn joining() -> Request {
        Request {
            join: true,
            ..Default::default()
        }
    }

    #[test]
    fn a_joined_rank_adds_zeros_to_allreduces_and_fails_the_rest_until_all_join() {
        let mut c = Coordinator::new(3, Knobs::default()).with_cache_capacity(16);
        // Cached first on every rank, so that rank 2 later sends "a" by bit.
        let all_a = || Request {
            tensors: vec![req("a", &[2, 3], sum())],
            ..Default::default()
        };
        let r = c.step(vec![all_a(), all_a(), all_a()], &[]);
        assert_eq!(r.join_counts, Vec::new());
        assert_eq!(c.cache.len(), 1);

        // Rank 1 joins; ranks 0 and 2 go on.
        let r = c.step(vec![Request::default(), joining(), Request::default()], &[]);
        assert!(r.items.is_empty());
        assert_eq!(r.join_done, None);
        assert!(!c.is_settled(), "no settled cycles while a rank has joined");
        let others = |tensors: Vec<Ready>| Request {
            tensors,
            ..Default::default()
        };
        let r = c.step(
            vec![
                others(vec![
                    Ready::Cached(BitRun(0, 1)),
                    req("g", &[4], OpKind::Allgather),
                    req("b", &[5], OpKind::Broadcast(0)),
                ]),
                joining(),
                others(vec![
                    Ready::Cached(BitRun(0, 1)),
                    req("g", &[4], OpKind::Allgather),
                    req("b", &[5], OpKind::Broadcast(0)),
                ]),
            ],
            &[],
        );
        // The allreduce runs, with the joined rank's count of zeros; it leaves the cache.
        assert!(matches!(
            &r.items[0],
            Item::Allreduce { names, .. } if names == &[TensorRef::Cached(BitRun(0, 1))]
        ));
        assert_eq!(r.join_counts, vec![("a".to_string(), 6)]);
        assert_eq!(
            c.cache.len(),
            0,
            "run while a rank had joined: cached nowhere"
        );
        // Allgather and broadcast fail, naming the joined rank.
        for (item, name) in r.items[1..].iter().zip(["g", "b"]) {
            match item {
                Item::Error { name: n, message } => {
                    assert_eq!(n, name);
                    assert!(message.contains("[1] have joined"), "{message}");
                }
                other => panic!("expected an error for {name}, got {other:?}"),
            }
        }
        assert_eq!(r.join_done, None);

        // Ranks 2 then 0 join: the join ends when the last does, naming it.
        let r = c.step(vec![Request::default(), joining(), joining()], &[]);
        assert_eq!(r.join_done, None);
        let r = c.step(vec![joining(), joining(), joining()], &[]);
        assert_eq!(r.join_done, Some(0));
        // A new join starts from nothing.
        let r = c.step(vec![Request::default(), Request::default(), joining()], &[]);
        assert_eq!(r.join_done, None);
        let r = c.step(vec![joining(), joining(), joining()], &[]);
        assert_eq!(
            r.join_done,
            Some(1),
            "ranks joining in one cycle: the highest is last"
        );
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
        let resp = c.step_named(vec![r0, r1], &[]);
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
        let resp = c.step_named(vec![Request::default(), r1], &[]);
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
            let resp = c.step_named(
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
        c.step_named(vec![r.clone(), Request::default(), r], &[]);
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
    fn a_stall_names_its_tensors_longest_first_and_its_shutdown_fails_every_rank() {
        let mut c = Coordinator::new(3, Knobs::default());
        let first = Request {
            tensors: vec![req("grad.0", &[4], sum())],
            ..Default::default()
        };
        c.step_named(vec![first.clone(), Request::default(), first], &[]);
        let t0 = Instant::now();
        let second = Request {
            tensors: vec![req("step.1", &[2], OpKind::Allgather)],
            ..Default::default()
        };
        c.step_named(vec![Request::default(), second, Request::default()], &[]);
        // Neither is stalled before the check; after it, the older first.
        assert!(c.waiting(t0, Duration::from_secs(5)).is_empty());
        let later = Instant::now() + Duration::from_secs(10);
        let stalled = c.waiting(later, Duration::from_secs(5));
        let named: Vec<(&str, &str, &[usize], &[usize])> = stalled
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.kind.as_str(),
                    t.waiting_ranks.as_slice(),
                    t.missing_ranks.as_slice(),
                )
            })
            .collect();
        assert_eq!(
            named,
            vec![
                ("grad.0", "allreduce", &[0, 2][..], &[1][..]),
                ("step.1", "allgather", &[1][..], &[0, 2][..]),
            ]
        );
        assert!(stalled[0].waiting_secs >= stalled[1].waiting_secs);
        assert!(stalled[1].waiting_secs >= 10.0);
        // Reported on every call (the log warns once; the state is the state).
        assert_eq!(c.waiting(later, Duration::from_secs(5)).len(), 2);

        let abort = c
            .stall_shutdown(&stalled, Duration::from_secs(30))
            .abort
            .unwrap_or_default();
        assert!(
            abort.contains("allreduce 'grad.0' enqueued on ranks [0, 2] but not on ranks [1]")
                && abort
                    .contains("allgather 'step.1' enqueued on ranks [1] but not on ranks [0, 2]")
                && abort.contains("RINGWATCH_STALL_SHUTDOWN_SECS"),
            "{abort}"
        );
        // Once the missing ranks come, nothing waits.
        c.step_named(
            vec![
                Request {
                    tensors: vec![req("step.1", &[2], OpKind::Allgather)],
                    ..Default::default()
                },
                first_of("grad.0"),
                Request {
                    tensors: vec![req("step.1", &[2], OpKind::Allgather)],
                    ..Default::default()
                },
            ],
            &[],
        );
        assert!(c.waiting(later, Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn a_rank_whose_request_comes_a_cycle_after_the_others_is_counted_late() {
        let mut c = Coordinator::new(3, Knobs::default());
        let t = |name: &str| Request {
            tensors: vec![req(name, &[4], sum())],
            ..Default::default()
        };
        // Every rank in one step: nobody is late.
        c.step_named(vec![t("a"), t("a"), t("a")], &[]);
        assert!(c.take_late().0.is_empty());
        // Ranks 0 and 2 in one step, rank 1 two steps later: rank 1 was late, for as long
        // as the tensor waited.
        c.step_named(vec![t("b"), Request::default(), t("b")], &[]);
        c.step_named(vec![Request::default(); 3], &[]);
        std::thread::sleep(Duration::from_millis(2));
        c.step_named(vec![Request::default(), t("b"), Request::default()], &[]);
        let (late, waited) = c.take_late();
        assert_eq!(waited, 1);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!((late[0].rank, late[0].tensors), (1, 1));
        assert!(late[0].late_us_max >= 2_000, "{late:?}");
        assert_eq!(late[0].late_us_sum, late[0].late_us_max);
        // Taken once.
        assert_eq!(c.take_late(), (Vec::new(), 0));
        // Two ranks late together are both counted; a tensor still waiting counts nobody.
        c.step_named(vec![t("c"), Request::default(), Request::default()], &[]);
        c.step_named(vec![Request::default(), t("c"), t("c")], &[]);
        c.step_named(vec![t("d"), Request::default(), Request::default()], &[]);
        let (late, waited) = c.take_late();
        let ranks: Vec<usize> = late.iter().map(|l| l.rank).collect();
        assert_eq!((ranks, waited), (vec![1, 2], 1));
    }

    fn first_of(name: &str) -> Request {
        Request {
            tensors: vec![req(name, &[4], sum())],
            ..Default::default()
        }
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
        let resp = c.step_named(reqs, &[]);
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
        let resp = c.step_named(
            vec![Request::default(), r1],
            &[KnobUpdate {
                cycle_time_us: Some(u64::MAX),
                ..Default::default()
            }],
        );
        assert!(resp.knobs.hierarchical_allreduce);
        assert_eq!(resp.knobs.cycle_time_us, MAX_CYCLE_TIME_US);
        assert!(!resp.shutdown);
        let resp = c.step_named(
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

    // The response cache, driven through every rank's side as the runtime does, with every
    // message through JSON as on the wire.

    use crate::runtime::cache::RankCache;

    /// A job without sockets: rank 0's coordinator and every rank's cache and pending
    /// tensors.
    struct Job {
        coordinator: Coordinator,
        ranks: Vec<RankCache>,
        pending: Vec<HashMap<String, TensorRequest>>,
        /// What each rank sent in the last cycle.
        sent: Vec<Vec<Ready>>,
        /// JSON bytes naming tensors in requests (from ranks 1..) and responses (to ranks
        /// 1..) so far: what the cache saves (knobs, cycle and flags are sent anyway).
        wire_bytes: usize,
    }

    impl Job {
        fn new(world_size: usize, capacity: usize) -> Self {
            Job {
                coordinator: Coordinator::new(world_size, Knobs::default())
                    .with_cache_capacity(capacity),
                ranks: (0..world_size).map(|_| RankCache::new()).collect(),
                pending: vec![HashMap::new(); world_size],
                sent: Vec::new(),
                wire_bytes: 0,
            }
        }

        /// One cycle in which `ready[r]` became ready on rank r; the response as every
        /// rank decoded it (they must agree).
        fn cycle(&mut self, ready: &[Vec<TensorRequest>], updates: &[KnobUpdate]) -> Response {
            let n = self.ranks.len();
            let mut requests = Vec::new();
            self.sent.clear();
            for (r, tensors) in ready.iter().enumerate() {
                let request = Request {
                    tensors: self.ranks[r].encode(tensors),
                    ..Default::default()
                };
                for t in tensors {
                    self.pending[r].insert(t.name.clone(), t.clone());
                }
                let json = serde_json::to_vec(&request).unwrap();
                if r > 0 {
                    self.wire_bytes += serde_json::to_vec(&request.tensors).unwrap().len();
                }
                let request: Request = serde_json::from_slice(&json).unwrap();
                self.sent.push(request.tensors.clone());
                requests.push(request);
            }
            let response = self.coordinator.step(requests, updates);
            let json = serde_json::to_vec(&response).unwrap();
            self.wire_bytes += serde_json::to_vec(&response.items).unwrap().len() * (n - 1);
            let mut decoded: Vec<Response> = Vec::new();
            for r in 0..n {
                let wire: WireResponse = serde_json::from_slice(&json).unwrap();
                let pending = &self.pending[r];
                let response = self.ranks[r]
                    .decode(wire, |name| pending.get(name).cloned())
                    .unwrap();
                // As the runtime does: scheduled and failed tensors leave `pending`.
                for item in &response.items {
                    match item {
                        Item::Allreduce { names, .. } => names.iter().for_each(|name| {
                            self.pending[r].remove(name);
                        }),
                        Item::Allgather { name, .. }
                        | Item::Broadcast { name, .. }
                        | Item::Error { name, .. } => {
                            self.pending[r].remove(name);
                        }
                    }
                }
                if let Some(first) = decoded.first() {
                    assert_eq!(&response, first, "rank {r} decoded another response");
                }
                decoded.push(response);
            }
            decoded.swap_remove(0)
        }

        /// A cycle as the runtime runs it when every rank shares one segment: decided by
        /// every rank itself when the coordinator is settled and every rank sends the same
        /// cached bits (no allgather, no knob change); `None` (nothing changed) otherwise.
        fn settled_cycle(&mut self, ready: &[Vec<TensorRequest>]) -> Option<Response> {
            let sent: Vec<Vec<Ready>> = ready
                .iter()
                .enumerate()
                .map(|(r, tensors)| self.ranks[r].encode(tensors))
                .collect();
            let settled = self.coordinator.is_settled()
                && sent.iter().all(|s| *s == sent[0])
                && sent[0].iter().all(|t| matches!(t, Ready::Cached(_)))
                && ready.iter().flatten().all(|t| t.kind != OpKind::Allgather);
            if !settled {
                return None;
            }
            let knobs = self.coordinator.knobs();
            let mut decided: Vec<Vec<Item>> = Vec::new();
            for (r, tensors) in ready.iter().enumerate() {
                for t in tensors {
                    self.pending[r].insert(t.name.clone(), t.clone());
                }
                let cached: Vec<TensorRequest> = sent[r]
                    .iter()
                    .flat_map(|t| match t {
                        Ready::Cached(run) => run.bits(),
                        Ready::Full(_) => unreachable!("checked above"),
                    })
                    .map(|bit| self.ranks[r].table().get(bit).unwrap().1.clone())
                    .collect();
                decided.push(settled_items(&cached, &knobs));
            }
            assert!(
                decided.iter().all(|d| *d == decided[0]),
                "ranks decided apart"
            );
            let items = decided.swap_remove(0);
            let cycle = self.coordinator.settled_step(&items);
            for r in 0..self.ranks.len() {
                self.ranks[r].refresh(&items);
            }
            for item in &items {
                if let Item::Allreduce { names, .. } = item {
                    for p in &mut self.pending {
                        names.iter().for_each(|name| {
                            p.remove(name);
                        });
                    }
                } else if let Item::Broadcast { name, .. } = item {
                    self.pending.iter_mut().for_each(|p| {
                        p.remove(name);
                    });
                }
            }
            Some(Response {
                cycle,
                knobs,
                items,
                shutdown: false,
                abort: None,
                cache_capacity: None,
                join_counts: Vec::new(),
                join_done: None,
            })
        }

        /// The name under each bit on rank `r`'s table, checked against every other
        /// rank's and rank 0's coordinator's.
        fn table(&self) -> Vec<Option<String>> {
            let bits = (0..64u64).map(|b| {
                let names: Vec<Option<&str>> = self
                    .ranks
                    .iter()
                    .map(|c| c.table().get(b).map(|(n, _)| n))
                    .collect();
                let coordinator = self.coordinator.cache.get(b).map(|(n, _)| n);
                assert!(
                    names.iter().all(|n| *n == coordinator),
                    "bit {b}: ranks {names:?}, coordinator {coordinator:?}"
                );
                coordinator.map(String::from)
            });
            let mut out: Vec<Option<String>> = bits.collect();
            while out.last() == Some(&None) {
                out.pop();
            }
            out
        }
    }

    /// In one cycle of `one_in`, at random, a change of the fusion threshold to one of
    /// `choices`.
    fn now_and_then_a_threshold(
        rng: &mut fastrand::Rng,
        one_in: u32,
        choices: &[u64],
    ) -> Vec<KnobUpdate> {
        if rng.u32(0..one_in) != 0 {
            return Vec::new();
        }
        vec![KnobUpdate {
            fusion_threshold_bytes: Some(choices[rng.usize(0..choices.len())]),
            ..Default::default()
        }]
    }

    fn all(n: usize, tensors: &[TensorRequest]) -> Vec<Vec<TensorRequest>> {
        vec![tensors.to_vec(); n]
    }

    fn some(names: &[&str]) -> Vec<Option<String>> {
        names.iter().map(|n| Some(n.to_string())).collect()
    }

    #[test]
    fn settled_cycles_decided_by_every_rank_answer_as_rank_0_would() {
        let n = 3;
        let model: Vec<TensorRequest> = (0..20)
            .map(|i| {
                let op = [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max][i % 3];
                TensorRequest {
                    name: format!("w{i}"),
                    kind: OpKind::Allreduce(op),
                    dtype: [DType::F32, DType::F32, DType::I32, DType::BF16][i % 4],
                    shape: vec![i * 13 + 1, 5],
                    device: false,
                }
            })
            .chain([request("bc", &[9], OpKind::Broadcast(2))])
            .collect();
        // Two jobs with the same history: one negotiates every cycle with rank 0, the
        // other decides the cycles it can itself. Each step every rank reports its tensors
        // at once (a settled cycle once cached) or spread over cycles at random (not
        // settled: ranks send different bits); now and then a knob changes, an allgather
        // comes, a tensor is new, or a cycle is idle. A capacity of 24 evicts now and then.
        let mut rng = fastrand::Rng::with_seed(11);
        let mut by_rank_0 = Job::new(n, 24);
        let mut settled = Job::new(n, 24);
        let mut settled_cycles = 0;
        for step in 0..100 {
            let mut tensors: Vec<TensorRequest> = model[..rng.usize(8..=model.len())].to_vec();
            rng.shuffle(&mut tensors[..4]);
            if step % 7 == 3 {
                tensors.push(request("ag", &[2, 2], OpKind::Allgather));
            }
            if step % 9 == 5 {
                tensors.push(request(&format!("new{step}"), &[3], sum()));
            }
            let mut left: Vec<std::collections::VecDeque<TensorRequest>> =
                vec![tensors.clone().into(); n];
            let at_once = rng.u32(0..3) > 0;
            while left.iter().any(|l| !l.is_empty()) {
                let ready: Vec<Vec<TensorRequest>> = left
                    .iter_mut()
                    .map(|l| {
                        let k = if at_once {
                            l.len()
                        } else {
                            rng.usize(0..=l.len().min(6))
                        };
                        l.drain(..k).collect()
                    })
                    .collect();
                let updates = now_and_then_a_threshold(&mut rng, 10, &[0, 200, 2000, 1 << 20]);
                let expected = by_rank_0.cycle(&ready, &updates);
                let got = match updates.is_empty().then(|| settled.settled_cycle(&ready)) {
                    Some(Some(response)) => {
                        settled_cycles += 1;
                        response
                    }
                    _ => settled.cycle(&ready, &updates),
                };
                assert_eq!(got, expected, "step {step}");
                assert_eq!(settled.table(), by_rank_0.table(), "step {step}");
                assert_eq!(settled.pending, by_rank_0.pending, "step {step}");
            }
            if rng.u32(0..4) == 0 {
                let idle = vec![Vec::new(); n];
                let expected = by_rank_0.cycle(&idle, &[]);
                let got = settled
                    .settled_cycle(&idle)
                    .expect("an idle cycle is settled");
                settled_cycles += 1;
                assert_eq!(got, expected, "idle after step {step}");
            }
        }
        assert!(settled_cycles > 50, "{settled_cycles} settled cycles");
    }

    #[test]
    fn cache_hits_give_the_same_responses_as_the_name_path() {
        let n = 3;
        let model: Vec<TensorRequest> = (0..12)
            .map(|i| {
                let op = [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max][i % 3];
                TensorRequest {
                    name: format!("w{i}"),
                    kind: OpKind::Allreduce(op),
                    dtype: if i % 4 == 3 { DType::I32 } else { DType::F32 },
                    shape: vec![i * 7 + 1, 3],
                    device: false,
                }
            })
            .chain([request("bc", &[9], OpKind::Broadcast(1))])
            .collect();
        // Each step every rank reports every tensor of the step, each in one of the next
        // cycles at random, in model order; some steps change something.
        let mut rng = fastrand::Rng::with_seed(7);
        let mut schedule: Vec<(Vec<Vec<TensorRequest>>, Vec<KnobUpdate>)> = Vec::new();
        for step in 0..30 {
            let mut tensors: Vec<Vec<TensorRequest>> = vec![model.clone(); n];
            for (r, ts) in tensors.iter_mut().enumerate() {
                // An allgather whose first dimension is each rank's own.
                let rows = if step >= 14 && r == 2 { 5 } else { r + 1 };
                ts.push(request("ag", &[rows, 2], OpKind::Allgather));
                if step >= 5 {
                    ts.push(request("late", &[4], sum()));
                }
                if step >= 8 {
                    ts[3].shape = vec![100]; // changed on every rank: fine
                }
                if step == 11 && r == 1 {
                    ts[1].shape = vec![1]; // changed on one rank: a mismatch
                }
                if step == 17 && r == 0 {
                    ts[2].dtype = DType::F64; // another mismatch
                }
            }
            let mut left: Vec<std::collections::VecDeque<TensorRequest>> =
                tensors.into_iter().map(Into::into).collect();
            while left.iter().any(|l| !l.is_empty()) {
                let ready = left
                    .iter_mut()
                    .map(|l| {
                        let k = rng.usize(0..=l.len().min(6));
                        l.drain(..k).collect()
                    })
                    .collect();
                let updates = now_and_then_a_threshold(&mut rng, 8, &[0, 64, 300, 1 << 20]);
                schedule.push((ready, updates));
            }
        }
        let mut by_name = Job::new(n, 0);
        let mut cached = Job::new(n, 1024);
        let mut tiny = Job::new(n, 5);
        let (mut errors, mut all_bits) = (0, 0);
        for (cycle, (ready, updates)) in schedule.iter().enumerate() {
            let want = by_name.cycle(ready, updates);
            for job in [&mut cached, &mut tiny] {
                let mut got = job.cycle(ready, updates);
                got.cache_capacity = None;
                assert_eq!(got, want, "cycle {cycle}");
            }
            errors += want
                .items
                .iter()
                .filter(|i| matches!(i, Item::Error { .. }))
                .count();
            let sent_tensors = cached.sent.iter().any(|s| !s.is_empty());
            if sent_tensors
                && cached
                    .sent
                    .iter()
                    .flatten()
                    .all(|r| matches!(r, Ready::Cached(_)))
            {
                all_bits += 1;
            }
            cached.table();
            tiny.table();
        }
        assert_eq!(errors, 2, "both mismatches are reported");
        assert!(
            all_bits > schedule.len() / 2,
            "{all_bits} of {}",
            schedule.len()
        );
        // Mixed ops and dtypes make many small buffers, each with its dtype and op, so
        // this workload saves less than a model's step (see the test below).
        assert!(
            cached.wire_bytes * 3 < by_name.wire_bytes * 2,
            "cached {} bytes, by name {}",
            cached.wire_bytes,
            by_name.wire_bytes
        );
    }

    #[test]
    fn a_steady_step_of_161_tensors_is_one_bit_run_each_way() {
        let n = 2;
        let step: Vec<TensorRequest> = (0..161)
            .rev()
            .map(|i| request(&format!("grad.{i}"), &[i + 1], sum()))
            .collect();
        let mut job = Job::new(n, 1024);
        let first = job.cycle(&all(n, &step), &[]);
        let names_bytes = job.wire_bytes;
        let second = job.cycle(&all(n, &step), &[]);
        assert_eq!(first.items, second.items);
        assert_eq!(job.sent, vec![vec![Ready::Cached(BitRun(0, 161))]; n]);
        let wire = job.wire_bytes - names_bytes;
        assert!(wire < 300, "{wire} bytes (by name: {names_bytes})");
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_tensor_on_every_rank() {
        let n = 2;
        let t = |name: &str| request(name, &[4], sum());
        let mut job = Job::new(n, 2);
        job.cycle(&all(n, &[t("a"), t("b")]), &[]);
        assert_eq!(job.table(), some(&["a", "b"]));
        job.cycle(&all(n, &[t("a")]), &[]);
        assert_eq!(job.sent, vec![vec![Ready::Cached(BitRun(0, 1))]; n]);
        // c takes the bit of b, the least recently used.
        job.cycle(&all(n, &[t("c")]), &[]);
        assert_eq!(job.table(), some(&["a", "c"]));
        // b again goes by name, and now a (used before c) gives up its bit.
        let response = job.cycle(&all(n, &[t("b"), t("c")]), &[]);
        assert_eq!(
            job.sent,
            vec![vec![Ready::Full(t("b")), Ready::Cached(BitRun(1, 1))]; n]
        );
        assert_eq!(job.table(), some(&["b", "c"]));
        assert!(
            matches!(&response.items[0], Item::Allreduce { names, .. } if names == &["b", "c"])
        );
    }

    #[test]
    fn a_cached_tensor_whose_shape_changes_on_one_rank_fails_on_every_rank() {
        let n = 3;
        let (w, x) = (request("w", &[4], sum()), request("x", &[2], sum()));
        let mut job = Job::new(n, 16);
        job.cycle(&all(n, &[w.clone(), x.clone()]), &[]);
        job.cycle(&all(n, &[w.clone(), x.clone()]), &[]);
        assert_eq!(job.sent, vec![vec![Ready::Cached(BitRun(0, 2))]; n]);
        let w5 = request("w", &[5], sum());
        let mut ready = all(n, &[w.clone(), x.clone()]);
        ready[1][0] = w5.clone();
        let response = job.cycle(&ready, &[]);
        // Rank 1 sends its changed request in full; the others' bits stand for [4].
        assert_eq!(
            job.sent[1],
            vec![Ready::Full(w5), Ready::Cached(BitRun(1, 1))]
        );
        assert_eq!(job.sent[0], vec![Ready::Cached(BitRun(0, 2))]);
        match &response.items[..] {
            [Item::Error { name, message }, Item::Allreduce { names, .. }] => {
                assert_eq!(name, "w");
                assert!(
                    message.contains("[4] on ranks [0, 2]") && message.contains("[5] on ranks [1]"),
                    "{message}"
                );
                assert_eq!(names, &["x"]);
            }
            other => panic!("expected the mismatch and x, got {other:?}"),
        }
        // w left every cache: its next use goes by name everywhere, and is cached again.
        assert_eq!(job.table(), vec![None, Some("x".to_string())]);
        job.cycle(&all(n, std::slice::from_ref(&w)), &[]);
        assert_eq!(job.sent, vec![vec![Ready::Full(w)]; n]);
        assert_eq!(job.table(), some(&["w", "x"]));
    }

    #[test]
    fn a_bit_rank_0_does_not_hold_aborts_the_job_naming_the_rank() {
        let mut c = Coordinator::new(2, Knobs::default()).with_cache_capacity(8);
        let bad = Request {
            tensors: vec![Ready::Cached(BitRun(7, 1))],
            ..Default::default()
        };
        let response = c.step(vec![Request::default(), bad], &[]);
        let abort = response.abort.unwrap_or_default();
        assert!(
            abort.contains("rank 1") && abort.contains("bit 7"),
            "{abort}"
        );
    }

    #[test]
    fn rank_0_gives_its_capacity_in_the_first_response_only() {
        let mut c = Coordinator::new(1, Knobs::default()).with_cache_capacity(8);
        assert_eq!(
            c.step(vec![Request::default()], &[]).cache_capacity,
            Some(8)
        );
        assert_eq!(c.step(vec![Request::default()], &[]).cache_capacity, None);
        let mut off = Coordinator::new(1, Knobs::default());
        assert_eq!(off.step(vec![Request::default()], &[]).cache_capacity, None);
    }
}
