//! GPU tensors (feature `cuda`): allreduce of device memory, bit for bit against the
//! small-integer reference (exact in every dtype, whatever the order of reduction) and,
//! for random floats, against the host path on the same data (staged GPU tensors go
//! through the same rings, so they must give the same bits).
//!
//! Where no GPU is usable these tests print SKIPPED and pass, except the one that checks
//! the error a GPU tensor gets without a driver, which runs only there.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use collectives::gpu::{DeviceBuffer, DeviceTensor, device_count};
use collectives::{CollectiveError, DType, ReduceOp, Runtime, Tensor};
use common::*;

fn upload(bytes: &[u8]) -> DeviceBuffer {
    DeviceBuffer::upload(0, bytes).unwrap()
}

fn gpus() -> Option<usize> {
    match device_count() {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU: {e}");
            None
        }
    }
}

/// Every dtype, op and size through GPU tensors on this rank; returns mismatches.
fn check_device(rt: &Runtime, seed: usize, sizes: &[usize]) -> Vec<String> {
    let (rank, n) = (rt.rank(), rt.world_size());
    let mut wrong = Vec::new();
    for dtype in DTYPES {
        for op in OPS {
            for &count in sizes {
                let host = input_for(op, dtype, rank, count, seed);
                let buf = upload(host.as_bytes());
                let name = format!("gpu.{dtype:?}.{op:?}.{count}");
                unsafe { rt.allreduce_device(&name, buf.tensor(dtype, &[count]), op) }.unwrap();
                let want = reference(dtype, op, n, count, seed);
                if buf.download().unwrap() != want.as_bytes() {
                    wrong.push(name);
                }
            }
        }
    }
    // Several tensors at once, fused into one buffer (and one NCCL call) per dtype and op.
    let counts = [5usize, 1031, 0, 64, 7];
    let bufs: Vec<DeviceBuffer> = counts
        .iter()
        .enumerate()
        .map(|(i, &c)| upload(input(DType::F32, rank, c, seed + i).as_bytes()))
        .collect();
    let handles: Vec<_> = bufs
        .iter()
        .zip(counts)
        .enumerate()
        .map(|(i, (b, c))| {
            let t = unsafe { b.tensor(DType::F32, &[c]) };
            unsafe { rt.allreduce_device_async(&format!("fused.{i}"), t, ReduceOp::Sum) }.unwrap()
        })
        .collect();
    for h in handles {
        h.wait().unwrap();
    }
    for (i, (b, c)) in bufs.iter().zip(counts).enumerate() {
        let want = reference(DType::F32, ReduceOp::Sum, n, c, seed + i);
        if b.download().unwrap() != want.as_bytes() {
            wrong.push(format!("fused.{i}"));
        }
    }
    wrong
}

/// Random floats: the GPU tensor's result against the host path's on the same data.
fn check_against_host(rt: &Runtime, count: usize) -> bool {
    let rank = rt.rank();
    let mut same = true;
    for (step, op) in OPS.iter().enumerate() {
        let mut state = (rank as u64 + 1) * 0x9E37_79B9_7F4A_7C15 + step as u64;
        let vals: Vec<f32> = (0..count)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 20_000) as f32 / 997.0 - 10.0
            })
            .collect();
        let buf = upload(bytemuck_bytes(&vals));
        unsafe {
            rt.allreduce_device(
                &format!("rand.gpu.{step}"),
                buf.tensor(DType::F32, &[count]),
                *op,
            )
        }
        .unwrap();
        let host = rt
            .allreduce(&format!("rand.host.{step}"), Tensor::from_slice(&vals), *op)
            .unwrap();
        same &= buf.download().unwrap() == host.as_bytes();
    }
    same
}

fn bytemuck_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice covers exactly the vector's bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[test]
fn staged_gpu_tensors_match_the_reference_bit_for_bit_with_ranks_sharing_a_gpu() {
    if gpus().is_none() {
        return;
    }
    for n in [2, 3] {
        let out = run_job(
            n,
            n,
            Duration::from_secs(240),
            |_| {},
            |rt| {
                let wrong = check_device(rt, 3, &[0, 1, 7, 1031, 300_001]);
                let same = check_against_host(rt, 100_003);
                (wrong, same, rt.totals())
            },
        );
        for (rank, (wrong, same, totals)) in out.iter().enumerate() {
            assert!(wrong.is_empty(), "{n} ranks, rank {rank}: wrong {wrong:?}");
            assert!(
                same,
                "{n} ranks, rank {rank}: random floats differ from the host path"
            );
            assert!(totals.staged_allreduces > 0, "{totals:?}");
            assert_eq!(totals.nccl_allreduces, 0, "ranks share a GPU: no NCCL");
        }
        eprintln!("{n} ranks on one GPU, staged: {:?}", out[0].2);
    }
}

#[test]
fn nccl_gpu_tensors_match_the_reference_with_one_rank_per_gpu() {
    let Some(n) = gpus() else {
        return;
    };
    if let Err(e) = collectives::gpu::nccl::nccl() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    // One rank per GPU; every rank uses its GPU as device 0 of its own
    // CUDA_VISIBLE_DEVICES in a real job, but here the ranks are threads of one process.
    if n > 1 {
        eprintln!("note: {n} GPUs, but ranks here use GPU 0 only; running one rank");
    }
    let out = run_job(
        1,
        1,
        Duration::from_secs(240),
        |_| {},
        |rt| {
            let wrong = check_device(rt, 5, &[0, 1, 7, 1031, 300_001]);
            (wrong, rt.totals())
        },
    );
    let (wrong, totals) = &out[0];
    assert!(wrong.is_empty(), "wrong {wrong:?}");
    assert!(totals.nccl_allreduces > 0, "{totals:?}");
    eprintln!("1 rank, NCCL: {totals:?}");
}

#[test]
fn the_hierarchical_knob_runs_nccl_within_nodes_and_the_rings_across_them() {
    if gpus().is_none() {
        return;
    }
    if let Err(e) = collectives::gpu::nccl::nccl() {
        eprintln!("SKIPPED: {e}");
        return;
    }
    // Pretend nodes of one rank each share the one GPU: no NCCL over every rank (ranks
    // share a GPU), but every node's communicator (one rank, one GPU) is NCCL's, so with
    // the hierarchical knob each item runs NCCL within the node, a segment through host
    // memory into the ring across nodes, and NCCL's grouped broadcasts back.
    for n in [2, 3] {
        let out = run_job(
            n,
            1,
            Duration::from_secs(240),
            |c| c.knobs.hierarchical_allreduce = true,
            |rt| (check_device(rt, 9, &[0, 1, 7, 1031, 300_001]), rt.totals()),
        );
        for (rank, (wrong, totals)) in out.iter().enumerate() {
            assert!(wrong.is_empty(), "{n} nodes, rank {rank}: wrong {wrong:?}");
            assert!(totals.nccl_allreduces > 0, "{totals:?}");
            assert_eq!(totals.staged_allreduces, 0, "{totals:?}");
        }
        eprintln!(
            "{n} one-rank nodes on one GPU, hierarchical: {:?}",
            out[0].1
        );
    }
}

#[test]
fn nccl_can_be_turned_off_and_then_every_gpu_tensor_is_staged() {
    if gpus().is_none() {
        return;
    }
    let out = run_job(
        1,
        1,
        Duration::from_secs(120),
        |c| c.nccl = false,
        |rt| {
            let wrong = check_device(rt, 7, &[1031]);
            (wrong, rt.totals())
        },
    );
    assert!(out[0].0.is_empty(), "{:?}", out[0].0);
    assert_eq!(out[0].1.nccl_allreduces, 0);
    assert!(out[0].1.staged_allreduces > 0);
}

#[test]
fn bad_gpu_tensors_are_refused_before_they_reach_the_job() {
    if gpus().is_none() {
        return;
    }
    let out = run_job(
        1,
        1,
        Duration::from_secs(60),
        |_| {},
        |rt| {
            let buf = upload(&[0u8; 4096]);
            let host = [0u8; 64];
            let errors = [
                // 4 KiB allocated, 4 MiB asked for (beyond any rounding of the allocation).
                unsafe {
                    rt.allreduce_device("long", buf.tensor(DType::F32, &[1 << 20]), ReduceOp::Sum)
                },
                // Host memory.
                unsafe {
                    rt.allreduce_device(
                        "host",
                        DeviceTensor::new(host.as_ptr() as u64, DType::F32, &[16], 0, 0),
                        ReduceOp::Sum,
                    )
                },
                // No such GPU.
                unsafe {
                    rt.allreduce_device(
                        "gpu99",
                        DeviceTensor::new(buf.ptr(), DType::F32, &[16], 99, 0),
                        ReduceOp::Sum,
                    )
                },
            ]
            .map(|r| r.unwrap_err().to_string());
            // The job goes on.
            unsafe { rt.allreduce_device("ok", buf.tensor(DType::F32, &[16]), ReduceOp::Sum) }
                .unwrap();
            errors
        },
    );
    let [long, host, gpu99] = &out[0];
    assert!(
        long.contains("run past the end of its allocation"),
        "{long}"
    );
    assert!(
        host.contains("not GPU memory") || host.contains("not memory the CUDA driver knows"),
        "{host}"
    );
    assert!(gpu99.contains("no GPU 99"), "{gpu99}");
}

#[test]
fn without_a_driver_a_gpu_tensor_fails_clearly_and_the_job_goes_on() {
    if device_count().is_ok() {
        eprintln!("SKIPPED: this machine has a usable GPU");
        return;
    }
    let out = run_job(
        2,
        2,
        Duration::from_secs(60),
        |_| {},
        |rt| {
            // SAFETY: never touched: there is no driver to touch it.
            let t = unsafe { DeviceTensor::new(0x1000, DType::F32, &[4], 0, 0) };
            let e = unsafe { rt.allreduce_device("g", t, ReduceOp::Sum) }.unwrap_err();
            let host = rt
                .allreduce("h", input(DType::F32, rt.rank(), 9, 1), ReduceOp::Sum)
                .unwrap();
            (e, host)
        },
    );
    for (e, host) in out {
        assert!(matches!(e, CollectiveError::Gpu { .. }), "{e:?}");
        assert!(e.to_string().contains("libcuda.so"), "{e}");
        assert_eq!(host, reference(DType::F32, ReduceOp::Sum, 2, 9, 1));
    }
}
