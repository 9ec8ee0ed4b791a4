//! GPU tensors in the runtime (feature `cuda`): enqueued like host tensors, with an empty
//! host stand-in and the device memory beside it; negotiated like them (their requests
//! say they are on a GPU); run by [`crate::gpu::GpuEngine`] when their item comes.

use super::Runtime;
use super::coordinator::{OpKind, TensorRequest};
use super::cycle::{CycleThread, Events, Work};
use super::execute::copy_activity;
use super::handle::Handle;
use super::shared::Entry;
use crate::algorithms::{SLICE_BYTES, Schedule, allreduce_tensors};
use std::sync::atomic::Ordering;

use crate::control::Phase;
use crate::error::{CollectiveError, Result};
use crate::gpu::{self, DeviceTensor, GpuEngine};
use crate::tensor::{AlignedBuf, DType, ReduceOp, Tensor};
use crate::timeline::activity;

impl Runtime {
    /// Enqueues an in-place allreduce of the GPU tensor `tensor` under `name` (the same
    /// name, shape and dtype on every rank, on a GPU on every rank). Waits first for the
    /// work on the tensor's stream; the result is in the tensor when the handle is waited
    /// on. A rank's GPU tensors must all be on one GPU.
    ///
    /// # Safety
    /// [`DeviceTensor::new`]'s contract: the memory stays valid and untouched until the
    /// handle has been waited on.
    pub unsafe fn allreduce_device_async(
        &self,
        name: &str,
        tensor: DeviceTensor,
        op: ReduceOp,
    ) -> Result<Handle> {
        // SAFETY: the caller's promise.
        unsafe { self.enqueue_device(name, tensor, op, false, None) }
    }

    /// [`Runtime::allreduce_device_async`] with `owner`, whatever keeps the tensor's
    /// memory alive (a framework's tensor object): the runtime holds it until it is done
    /// with the memory, even if the handle is dropped unwaited, and gives it back with the
    /// handle's result.
    ///
    /// # Safety
    /// As [`Runtime::allreduce_device_async`], with "until the handle has been waited on"
    /// read as "while `owner` lives".
    pub unsafe fn allreduce_device_async_owned(
        &self,
        name: &str,
        tensor: DeviceTensor,
        op: ReduceOp,
        owner: Box<dyn Send>,
    ) -> Result<Handle> {
        // SAFETY: the caller's promise.
        unsafe { self.enqueue_device(name, tensor, op, false, Some(owner)) }
    }

    /// Allreduces the GPU tensor `tensor` in place and waits.
    ///
    /// # Safety
    /// As [`Runtime::allreduce_device_async`].
    pub unsafe fn allreduce_device(
        &self,
        name: &str,
        tensor: DeviceTensor,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.enqueue_device(name, tensor, op, true, None) }?
            .wait()
            .map(drop)
    }

    unsafe fn enqueue_device(
        &self,
        name: &str,
        tensor: DeviceTensor,
        op: ReduceOp,
        waited: bool,
        owner: Option<Box<dyn Send>>,
    ) -> Result<Handle> {
        let rank = self.rank();
        gpu::prepare(&tensor).map_err(|m| CollectiveError::Gpu {
            rank,
            message: format!("tensor '{name}': {m}"),
        })?;
        let first = *self.gpu_device.get_or_init(|| tensor.device());
        if first != tensor.device() {
            return Err(CollectiveError::InvalidTensor {
                rank,
                name: name.to_string(),
                message: format!(
                    "it is on GPU {}, but this rank's GPU tensors are on GPU {first} (one \
                     GPU per rank)",
                    tensor.device()
                ),
            });
        }
        let request = TensorRequest {
            name: name.to_string(),
            kind: OpKind::Allreduce(op),
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            device: true,
        };
        let stand_in = stand_in(tensor.dtype(), owner);
        self.enqueue_entry(
            request,
            |request, done| Entry {
                request,
                tensor: stand_in,
                device: Some(tensor),
                done,
            },
            waited,
        )
    }
}

/// The host tensor a GPU tensor's entry carries: no elements, and the tensor's owner,
/// if any, so that the owner lives exactly as long as the entry and its result.
fn stand_in(dtype: DType, owner: Option<Box<dyn Send>>) -> Tensor {
    match owner {
        // SAFETY: zero bytes at a dangling, never dereferenced address.
        Some(owner) => unsafe {
            Tensor::from_external(
                dtype,
                &[0],
                std::ptr::NonNull::dangling().as_ptr(),
                0,
                owner,
            )
        },
        None => Tensor::from_bytes(dtype, &[0], AlignedBuf::zeroed(0)),
    }
    .expect("zero elements of any dtype are zero bytes")
}

impl CycleThread {
    /// Runs an allreduce item of GPU tensors (`entries`, taken from `pending`; their
    /// queue-end and allreduce-begin events are already added).
    pub(super) fn execute_device(
        &mut self,
        entries: Vec<Entry>,
        dtype: DType,
        op: ReduceOp,
        schedule: Schedule,
        work: &mut Work,
        events: &mut Events,
    ) -> Result<()> {
        let tensors: Vec<DeviceTensor> = entries.iter().filter_map(|e| e.device.clone()).collect();
        let outcome = (|| {
            if tensors.len() != entries.len() {
                // The coordinator fuses GPU tensors only with GPU tensors.
                return Err(CollectiveError::Gpu {
                    rank: self.rank,
                    message: "an item mixes GPU and host tensors (a bug in collectives)".into(),
                });
            }
            if self.gpu.is_none() {
                let device = tensors.first().map_or(0, DeviceTensor::device);
                self.gpu = Some(GpuEngine::start(
                    &*self.transport,
                    self.rank,
                    device,
                    self.nccl,
                    self.layout,
                    self.gpu_timeout,
                )?);
            }
            let names: Vec<&str> = if events.enabled {
                entries.iter().map(|e| e.request.name.as_str()).collect()
            } else {
                Vec::new()
            };
            let (transport, fusion) = (&*self.transport, &mut self.fusion);
            let Some(engine) = self.gpu.as_mut() else {
                return Err(CollectiveError::Gpu {
                    rank: self.rank,
                    message: "the GPU side did not start (a bug in collectives)".into(),
                });
            };
            let hierarchical = match schedule {
                Schedule::Hierarchical(layout) => Some(layout),
                Schedule::Ring => None,
            };
            engine.allreduce(transport, &tensors, dtype, op, hierarchical, |views| {
                allreduce_tensors(
                    transport,
                    views,
                    dtype,
                    op,
                    schedule,
                    SLICE_BYTES,
                    fusion,
                    &mut |i, phase| {
                        if let Some(name) = names.get(i) {
                            let (activity, phase) = copy_activity(phase);
                            events.add(name, activity, phase, &[]);
                        }
                    },
                )
            })
        })();
        let path = match outcome {
            Ok(path) => path,
            Err(e) => {
                // Back into `pending`, so that they fail with the job's final error.
                for entry in entries {
                    self.pending.insert(entry.request.name.clone(), entry);
                }
                return Err(e);
            }
        };
        match path {
            gpu::Path::Nccl | gpu::Path::NcclHierarchical => &self.shared.nccl_allreduces,
            gpu::Path::Staged => &self.shared.staged_allreduces,
        }
        .fetch_add(1, Ordering::Relaxed);
        let total: usize = tensors.iter().map(DeviceTensor::byte_len).sum();
        for e in &entries {
            events.add(&e.request.name, activity::ALLREDUCE, Phase::End, &[]);
        }
        work.allreduced(total, entries);
        Ok(())
    }
}
