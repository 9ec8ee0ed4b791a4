//! The negotiation of one cycle: a settled cycle decided on every rank through the
//! host's shared memory when it can be, else the request to rank 0 and its response
//! (rank 0 runs the [`super::coordinator`]), and the traffic it cost.
//!
//! It must never run a collective: it only decides which ones run, the same on every
//! rank.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::coordinator::{
    BitRun, Coordinator, Item, OpKind, Request, Response, TensorRequest, WireResponse,
};
use super::cycle::CycleThread;
use crate::control::KnobUpdate;
use crate::error::{CollectiveError, Result};
use crate::transport::{MAX_FRAME_BYTES, recv_frame, send_frame};

/// The length prefix [`send_frame`] puts before every message.
pub(super) const FRAME_HEADER_BYTES: usize = 4;

/// Makes `post` the start of a settled cycle's post ([`CycleThread::settled`]) for cycle
/// `cycle`: the cached tensors' runs follow ([`push_run`]). A post that is not settled
/// is the single byte 0. Every rank's post is built here, whichever path builds it, so
/// that equal cycles post equal bytes.
pub(super) fn settled_post(post: &mut Vec<u8>, cycle: u64) {
    post.clear();
    post.push(1);
    post.extend_from_slice(&cycle.to_le_bytes());
}

/// Adds a run of cached tensors to a settled post.
pub(super) fn push_run(post: &mut Vec<u8>, run: BitRun) {
    post.extend_from_slice(&run.0.to_le_bytes());
    post.extend_from_slice(&run.1.to_le_bytes());
}

impl CycleThread {
    /// The cycle's response decided on every rank at once, when it can be: every rank
    /// shares this host's segment, posts there that it sends exactly these cached tensors
    /// (all of them cached, no allgather, no knobs, no shutdown; rank 0 adds that its
    /// coordinator is settled, [`Coordinator::is_settled`]), and finds every other rank
    /// posting the same. Then the answer is [`super::coordinator::settled_items`] under the knobs
    /// in force, which is what rank 0 would answer, and every cache changes as it would
    /// have. `None`: negotiate with rank 0 (every rank finds the same). `updates`: knob
    /// changes wait for this rank's request. The answer is worked out before the post:
    /// when it is one allreduce of one tensor, the tensor's bytes go with the post
    /// ([`Transport::same_posts`]'s `early`), so that a small one needs no barrier of its
    /// own once every post agrees.
    pub(super) fn settled(&mut self, request: &Request, updates: bool) -> Result<Option<Response>> {
        let Some(cycle) = self.next_cycle.filter(|_| self.settle) else {
            return Ok(None);
        };
        // Last cycle's buffer, so that a post allocates nothing.
        let mut post = std::mem::take(&mut self.post);
        post.clear();
        post.push(0u8);
        let eligible = !updates
            && request.knobs.is_empty()
            && !request.shutdown
            && !request.join
            && self
                .coordinator
                .as_ref()
                .is_none_or(Coordinator::is_settled)
            && request.tensors.iter().all(|r| match r {
                super::coordinator::Ready::Cached(_) => true,
                super::coordinator::Ready::Full(_) => false,
            })
            && self
                .pending
                .values()
                .all(|e| e.request.kind != OpKind::Allgather)
            && 9 + 8 * request.tensors.len() <= crate::shm::MAX_POST_BYTES;
        // What this cycle runs if every rank posts the same: decided before the post,
        // so that a lone small allreduce can move its inputs with it.
        let mut items = Vec::new();
        if eligible {
            settled_post(&mut post, cycle);
            let mut ready: Vec<&TensorRequest> = Vec::with_capacity(request.tensors.len());
            for r in &request.tensors {
                if let super::coordinator::Ready::Cached(run) = r {
                    push_run(&mut post, *run);
                    for bit in run.bits() {
                        let (_, cached) = self.cache.table().get(bit).ok_or_else(|| {
                            CollectiveError::JobFailed {
                                rank: self.rank,
                                cause: format!(
                                    "cache bit {bit} is not in this rank's response cache (a \
                                     bug in collectives)"
                                ),
                            }
                        })?;
                        ready.push(cached);
                    }
                }
            }
            items = super::coordinator::settled_items(ready, &self.knobs);
        }
        // A lone allreduce of one tensor on the flat schedule is the transport's one-shot
        // when it is small: its bytes can go with the post.
        let early = match items.as_slice() {
            [Item::Allreduce { names, .. }]
                if names.len() == 1
                    && !self.knobs.hierarchical_allreduce
                    && crate::shm::EARLY_TRAILER_BYTES + post.len()
                        <= crate::shm::MAX_POST_BYTES =>
            {
                // A GPU tensor's bytes are not in host memory.
                self.pending
                    .get(&names[0])
                    .filter(|e| !e.request.device)
                    .map(|e| e.tensor.as_bytes())
            }
            _ => None,
        };
        let same = self.transport.same_posts(&self.all_ranks, &post, early);
        self.post = post;
        let same = match same {
            Some(same) => same?,
            None => {
                // Not one segment after all (it is the same on every rank).
                self.settle = false;
                return Ok(None);
            }
        };
        if !(same && eligible) {
            return Ok(None);
        }
        let index = self.coordinator.as_mut().map(|c| c.settled_step(&items));
        self.check_settled(cycle, index)?;
        self.cache.refresh(&items);
        self.shared.settled_cycles.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Response {
            cycle,
            knobs: self.knobs,
            items,
            shutdown: false,
            abort: None,
            cache_capacity: None,
            join_counts: Vec::new(),
            join_done: None,
        }))
    }

    /// Rank 0's coordinator counted the settled cycle `cycle` as `index` (`None`: not
    /// rank 0): the two must agree.
    pub(super) fn check_settled(&self, cycle: u64, index: Option<u64>) -> Result<()> {
        match index {
            Some(index) if index != cycle => Err(CollectiveError::JobFailed {
                rank: self.rank,
                cause: format!(
                    "settled cycle {cycle} is cycle {index} for rank 0's coordinator (a bug \
                     in collectives)"
                ),
            }),
            _ => Ok(()),
        }
    }

    pub(super) fn negotiate(
        &mut self,
        request: Request,
        knob_requests: Vec<super::server::KnobRequest>,
        tuner_update: Option<KnobUpdate>,
    ) -> Result<WireResponse> {
        let t = &*self.transport;
        let encode = |v: &dyn erased::Encode| v.encode();
        if let Some(coordinator) = &mut self.coordinator {
            let mut requests = Vec::with_capacity(self.world_size);
            requests.push(request);
            let mut request_bytes = 0;
            for peer in 1..self.world_size {
                let got = recv_frame(t, peer, MAX_FRAME_BYTES).and_then(|bytes| {
                    request_bytes += FRAME_HEADER_BYTES + bytes.len();
                    serde_json::from_slice::<Request>(&bytes).map_err(|e| CollectiveError::Link {
                        rank: 0,
                        peer,
                        message: format!("bad request: {e}"),
                    })
                });
                match got {
                    Ok(r) => requests.push(r),
                    Err(e) => {
                        // Tell everyone else which rank failed before the links go down.
                        let abort: WireResponse = Response {
                            cycle: 0,
                            knobs: coordinator.knobs(),
                            items: Vec::new(),
                            shutdown: false,
                            abort: Some(e.to_string()),
                            cache_capacity: None,
                            join_counts: Vec::new(),
                            join_done: None,
                        };
                        let bytes = encode(&abort);
                        for other in (1..self.world_size).filter(|&o| o != peer) {
                            let _ = send_frame(t, other, &bytes);
                        }
                        return Err(e);
                    }
                }
            }
            let mut updates: Vec<KnobUpdate> = knob_requests.iter().map(|r| r.update).collect();
            #[cfg_attr(not(feature = "autotune"), allow(unused_variables))]
            let tuner_sent = tuner_update.is_some();
            updates.extend(tuner_update);
            let mut response = coordinator.step(requests, &updates);
            if let Some(check) = self.stall.check {
                let now = Instant::now();
                for (name, missing) in coordinator.stalled(now, check) {
                    tracing::warn!(
                        tensor = %name,
                        ?missing,
                        "tensor enqueued on some ranks but not on ranks {missing:?} for \
                         {check:?}; every rank must enqueue the same tensors"
                    );
                }
                let stalled = coordinator.waiting(now, check);
                let published: Vec<(String, Vec<usize>)> = stalled
                    .iter()
                    .map(|t| (t.name.clone(), t.missing_ranks.clone()))
                    .collect();
                if published != self.stall_published {
                    self.stall_published = published;
                    if let Some(server) = &self.server {
                        server.publish_stall(crate::control::StallReport {
                            cycle: response.cycle,
                            at_unix_us: crate::timeline::now_us(),
                            stalled: stalled.clone(),
                            check_secs: check.as_secs_f64(),
                            shutdown_after_secs: self.stall.shutdown.map(|d| d.as_secs_f64()),
                        });
                    }
                }
                if let Some(after) = self.stall.shutdown {
                    let past: Vec<_> = stalled
                        .into_iter()
                        .filter(|t| t.waiting_secs >= after.as_secs_f64())
                        .collect();
                    if !past.is_empty() {
                        response = coordinator.stall_shutdown(&past, after);
                        tracing::error!(
                            cause = response.abort.as_deref().unwrap_or_default(),
                            "stall shutdown: failing every rank"
                        );
                    }
                }
            }
            let bytes = encode(&response);
            for peer in 1..self.world_size {
                send_frame(t, peer, &bytes)?;
            }
            let response_bytes = (self.world_size - 1) * (FRAME_HEADER_BYTES + bytes.len());
            self.count_negotiation(response.cycle, request_bytes, response_bytes);
            // In force here before anyone is told so.
            if let Ok(mut k) = self.shared.knobs.lock() {
                *k = (response.knobs, response.cycle);
            }
            if let Some(server) = &self.server {
                server.confirm(knob_requests, response.knobs, response.cycle);
            }
            #[cfg(feature = "autotune")]
            if tuner_sent && let Some(d) = self.autotune.as_mut() {
                let pinned = d
                    .tuner
                    .as_mut()
                    .is_some_and(|t| t.confirmed(response.knobs, response.cycle));
                if pinned && let Some(t) = d.tuner.take() {
                    let (thread, watcher) = t.finish(
                        response.cycle,
                        self.shared.claims.clone(),
                        self.shared.self_tune.clone(),
                    );
                    d.report_threads.retain(|t| !t.is_finished());
                    d.report_threads.extend(thread);
                    d.watcher = watcher;
                    if let Ok(mut w) = self.shared.watch.lock() {
                        *w = d.watcher.as_ref().map(|w| w.status());
                    }
                }
            }
            Ok(response)
        } else {
            // Knob changes asked for on this host's socket go to rank 0 with the request.
            let mut request = request;
            request.knobs.extend(knob_requests.iter().map(|r| r.update));
            let request = encode(&request);
            send_frame(t, 0, &request)?;
            let bytes = recv_frame(t, 0, MAX_FRAME_BYTES)?;
            let response: WireResponse =
                serde_json::from_slice(&bytes).map_err(|e| CollectiveError::Link {
                    rank: self.rank,
                    peer: 0,
                    message: format!("bad response: {e}"),
                })?;
            self.count_negotiation(
                response.cycle,
                FRAME_HEADER_BYTES + request.len(),
                FRAME_HEADER_BYTES + bytes.len(),
            );
            if let Some(server) = &self.server {
                server.confirm(knob_requests, response.knobs, response.cycle);
            }
            Ok(response)
        }
    }

    /// Adds one cycle's negotiation traffic on this rank's links to the totals.
    pub(super) fn count_negotiation(
        &self,
        cycle: u64,
        request_bytes: usize,
        response_bytes: usize,
    ) {
        self.shared
            .negotiation_bytes
            .fetch_add((request_bytes + response_bytes) as u64, Ordering::Relaxed);
        tracing::debug!(
            rank = self.rank,
            cycle,
            request_bytes,
            response_bytes,
            "negotiation bytes"
        );
    }
}

mod erased {
    use serde::Serialize;

    /// JSON encoding of coordination messages (small, once per cycle).
    pub trait Encode {
        fn encode(&self) -> Vec<u8>;
    }

    impl<T: Serialize> Encode for T {
        fn encode(&self) -> Vec<u8> {
            // Serializing these plain structs cannot fail.
            serde_json::to_vec(self).unwrap_or_default()
        }
    }
}
