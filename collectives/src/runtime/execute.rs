//! Running a response's items: the tensors taken from the pending set, the allreduce
//! schedule chosen from the knobs, fused buffers reduced and copied back, allgathers and
//! broadcasts, and each entry handed its result.
//!
//! It must never run anything the response did not name, nor in another order.

use super::coordinator::Item;
use super::cycle::{CycleThread, Events, Work};
use super::shared::Entry;
use crate::algorithms::{
    Algorithm, CopyPhase, SLICE_BYTES, Schedule, allreduce_tensors, chain_broadcast, ring_allgather,
};
use crate::control::Phase;
use crate::error::{CollectiveError, Result};
use crate::tensor::{AlignedBuf, Tensor};
use crate::timeline::activity;

/// The timeline activity and phase of a fusion-buffer copy.
pub(super) fn copy_activity(phase: CopyPhase) -> (&'static str, Phase) {
    match phase {
        CopyPhase::InBegin => (activity::MEMCPY_IN_FUSION_BUFFER, Phase::Begin),
        CopyPhase::InEnd => (activity::MEMCPY_IN_FUSION_BUFFER, Phase::End),
        CopyPhase::OutBegin => (activity::MEMCPY_OUT_FUSION_BUFFER, Phase::Begin),
        CopyPhase::OutEnd => (activity::MEMCPY_OUT_FUSION_BUFFER, Phase::End),
    }
}

impl CycleThread {
    /// The element count this joined rank adds zeros of for `name`, if the response runs
    /// it while ranks have joined.
    fn join_count(&self, name: &str) -> Option<usize> {
        self.join_counts
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, count)| count)
    }

    /// The allreduce schedule for this cycle's knobs (the same on every rank), and the
    /// algorithm it names.
    fn schedule(&mut self) -> (Algorithm, Schedule) {
        let algorithm = self.algorithm();
        let schedule = match (algorithm, self.layout) {
            (Algorithm::Hierarchical, Some(l)) => Schedule::Hierarchical(l),
            _ => Schedule::Ring,
        };
        (algorithm, schedule)
    }

    /// An allreduce on a rank that has joined: in the item's order, `zeros[i]` where this
    /// rank adds zeros, else the next of its own `entries` (enqueued before it joined).
    /// The zeros have no timeline events.
    fn allreduce_joined(
        &mut self,
        mut entries: Vec<Entry>,
        mut zeros: Vec<Option<AlignedBuf>>,
        dtype: crate::tensor::DType,
        op: crate::tensor::ReduceOp,
        work: &mut Work,
        events: &mut Events,
    ) -> Result<()> {
        let (_, schedule) = self.schedule();
        let total: usize = entries.iter().map(|e| e.tensor.byte_len()).sum::<usize>()
            + zeros.iter().flatten().map(AlignedBuf::len).sum::<usize>();
        let outcome = {
            let mut own = entries.iter_mut().map(|e| e.tensor.as_bytes_mut());
            let mut views: Vec<&mut [u8]> = zeros
                .iter_mut()
                .filter_map(|z| match z {
                    Some(z) => Some(z.as_mut_slice()),
                    None => own.next(),
                })
                .collect();
            allreduce_tensors(
                &*self.transport,
                &mut views,
                dtype,
                op,
                schedule,
                SLICE_BYTES,
                &mut self.fusion,
                &mut |_, _| {},
            )
        };
        if let Err(e) = outcome {
            for entry in entries {
                self.pending.insert(entry.request.name.clone(), entry);
            }
            return Err(e);
        }
        for e in &entries {
            events.add(&e.request.name, activity::QUEUE, Phase::End, &[]);
        }
        work.allreduced(total, entries);
        Ok(())
    }

    pub(super) fn take(&mut self, name: &str) -> Result<Entry> {
        let entry = self
            .pending
            .remove(name)
            .ok_or_else(|| CollectiveError::JobFailed {
                rank: self.rank,
                cause: format!("rank 0 scheduled tensor '{name}', which this rank never enqueued"),
            })?;
        self.shared.forget(name);
        Ok(entry)
    }

    pub(super) fn algorithm(&mut self) -> Algorithm {
        if !self.knobs.hierarchical_allreduce {
            // The flat schedule; the transport runs it natively when every rank shares
            // this rank's memory, and the timeline says so.
            if self.world_size > 1
                && self.transport.shared_memory_peers().len() + 1 == self.world_size
            {
                return Algorithm::SharedMemory;
            }
            return Algorithm::Ring;
        }
        if self.layout.is_some() {
            return Algorithm::Hierarchical;
        }
        if !self.warned_fallback {
            self.warned_fallback = true;
            tracing::warn!(
                rank = self.rank,
                "hierarchical allreduce needs the same number of ranks on every node \
                 (and LOCAL_RANK = RANK % LOCAL_SIZE); using the flat ring"
            );
        }
        Algorithm::Ring
    }

    pub(super) fn execute(
        &mut self,
        item: Item,
        work: &mut Work,
        events: &mut Events,
    ) -> Result<()> {
        match item {
            Item::Error { name, message } => {
                if self.pending.contains_key(&name) {
                    let entry = self.take(&name)?;
                    events.add(&name, activity::QUEUE, Phase::End, &[]);
                    entry.finish(Err(CollectiveError::Mismatch { name, message }));
                }
                Ok(())
            }
            Item::Allreduce { names, dtype, op } => {
                let mut entries = Vec::with_capacity(names.len());
                // A joined rank's zeros for the tensors it does not hold, in names' order
                // (`None`: one of its own entries).
                let mut zeros: Vec<Option<AlignedBuf>> = Vec::new();
                for n in &names {
                    match self.join_count(n) {
                        Some(count) if !self.pending.contains_key(n) => {
                            zeros.push(Some(AlignedBuf::zeroed(count * dtype.size())));
                        }
                        _ => {
                            zeros.push(None);
                            entries.push(self.take(n)?);
                        }
                    }
                }
                if zeros.iter().any(Option::is_some) {
                    return self.allreduce_joined(entries, zeros, dtype, op, work, events);
                }
                let (algorithm, schedule) = self.schedule();
                let algorithm_name = algorithm.name();
                let args: [(&str, &dyn std::fmt::Display); 1] = [("algorithm", &algorithm_name)];
                for e in &entries {
                    events.add(&e.request.name, activity::QUEUE, Phase::End, &[]);
                    events.add(&e.request.name, activity::ALLREDUCE, Phase::Begin, &args);
                }
                #[cfg(feature = "cuda")]
                if entries.iter().any(|e| e.request.device) {
                    return self.execute_device(entries, dtype, op, schedule, work, events);
                }
                let total: usize = entries.iter().map(|e| e.tensor.byte_len()).sum();
                // Only the timeline needs them while the tensors are lent out below.
                let names: Vec<String> = if events.enabled {
                    entries.iter().map(|e| e.request.name.clone()).collect()
                } else {
                    Vec::new()
                };
                let mut views: Vec<&mut [u8]> = entries
                    .iter_mut()
                    .map(|e| e.tensor.as_bytes_mut())
                    .collect();
                let outcome = allreduce_tensors(
                    &*self.transport,
                    &mut views,
                    dtype,
                    op,
                    schedule,
                    SLICE_BYTES,
                    &mut self.fusion,
                    &mut |i, phase| {
                        if let Some(name) = names.get(i) {
                            let (activity, phase) = copy_activity(phase);
                            events.add(name, activity, phase, &[]);
                        }
                    },
                );
                if let Err(e) = outcome {
                    // Back into `pending`, so that they fail with the job's final error.
                    for entry in entries {
                        self.pending.insert(entry.request.name.clone(), entry);
                    }
                    return Err(e);
                }
                for name in &names {
                    events.add(name, activity::ALLREDUCE, Phase::End, &[]);
                }
                work.allreduced(total, entries);
                Ok(())
            }
            Item::Allgather { name, first_dims } => {
                let entry = self.take(&name)?;
                events.add(&name, activity::QUEUE, Phase::End, &[]);
                events.add(&name, activity::ALLGATHER, Phase::Begin, &[]);
                let shape = entry.tensor.shape().to_vec();
                let row_bytes: usize =
                    shape[1..].iter().product::<usize>() * entry.tensor.dtype().size();
                let mut blocks = Vec::with_capacity(first_dims.len());
                let mut start = 0;
                for d in &first_dims {
                    blocks.push(start..start + d * row_bytes);
                    start += d * row_bytes;
                }
                let mut out = AlignedBuf::zeroed(start);
                out.as_mut_slice()[blocks[self.rank].clone()]
                    .copy_from_slice(entry.tensor.as_bytes());
                if let Err(e) = ring_allgather(&*self.transport, out.as_mut_slice(), &blocks) {
                    self.pending.insert(name, entry);
                    return Err(e);
                }
                let mut out_shape = shape;
                out_shape[0] = first_dims.iter().sum();
                events.add(&name, activity::ALLGATHER, Phase::End, &[]);
                work.bytes_total += start as u64;
                work.tensors += 1;
                let result =
                    Tensor::from_bytes(entry.tensor.dtype(), &out_shape, out).ok_or_else(|| {
                        CollectiveError::JobFailed {
                            rank: self.rank,
                            cause: format!("allgather of '{name}' produced a wrong size"),
                        }
                    });
                entry.finish(result);
                Ok(())
            }
            Item::Broadcast { name, root } => {
                let mut entry = self.take(&name)?;
                events.add(&name, activity::QUEUE, Phase::End, &[]);
                events.add(&name, activity::BROADCAST, Phase::Begin, &[("root", &root)]);
                if let Err(e) = chain_broadcast(&*self.transport, root, entry.tensor.as_bytes_mut())
                {
                    self.pending.insert(name, entry);
                    return Err(e);
                }
                events.add(&name, activity::BROADCAST, Phase::End, &[]);
                work.bytes_total += entry.tensor.byte_len() as u64;
                work.tensors += 1;
                entry.succeed();
                Ok(())
            }
        }
    }
}
