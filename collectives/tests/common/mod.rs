//! Helpers of the integration tests that run jobs of one thread per rank: ports, configs,
//! the job runner, and the small-integer inputs with their exact reference results.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use collectives::rendezvous::RendezvousConfig;
use collectives::runtime::RuntimeConfig;
use collectives::{DType, ReduceOp, Runtime, Tensor};
use half::{bf16, f16};

pub const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::BF16,
];
pub const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
];

pub use test_support::free_port;

pub fn config(rank: usize, n: usize, local_size: usize, port: u16) -> RuntimeConfig {
    let mut c = RuntimeConfig::new(RendezvousConfig {
        rank,
        world_size: n,
        local_rank: rank % local_size,
        local_size,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: Some(format!("test-{port}")),
        connect_timeout: Duration::from_secs(20),
        host: None,
    });
    c.timeout = Duration::from_secs(15);
    c
}

/// Runs `body` on `n` ranks (threads) of one job; fails instead of hanging after `limit`.
pub fn run_job<R: Send + 'static>(
    n: usize,
    local_size: usize,
    limit: Duration,
    adjust: impl Fn(&mut RuntimeConfig) + Send + Sync + 'static,
    body: impl Fn(&Runtime) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let port = free_port();
    let adjust = Arc::new(adjust);
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (adjust, body, tx) = (adjust.clone(), body.clone(), tx.clone());
        std::thread::spawn(move || {
            let mut cfg = config(rank, n, local_size, port);
            adjust(&mut cfg);
            let rt = Runtime::new(cfg).unwrap();
            let r = body(&rt);
            rt.shutdown();
            tx.send((rank, r)).unwrap();
        });
    }
    let deadline = Instant::now() + limit;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, r) = rx
            .recv_timeout(left)
            .expect("job did not finish in time (hang?)");
        out[rank] = Some(r);
    }
    out.into_iter().map(Option::unwrap).collect()
}

pub fn value(rank: usize, i: usize, seed: usize) -> i64 {
    ((rank * 31 + i * 17 + seed * 7) % 41) as i64 - 20
}

pub fn make(dtype: DType, shape: &[usize], vals: &[i64]) -> Tensor {
    match dtype {
        DType::F32 => Tensor::new(shape, &vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::new(shape, &vals.iter().map(|&v| v as f64).collect::<Vec<_>>()),
        DType::I32 => Tensor::new(shape, &vals.iter().map(|&v| v as i32).collect::<Vec<_>>()),
        DType::I64 => Tensor::new(shape, vals),
        DType::F16 => Tensor::new(
            shape,
            &vals
                .iter()
                .map(|&v| f16::from_f32(v as f32))
                .collect::<Vec<_>>(),
        ),
        DType::BF16 => Tensor::new(
            shape,
            &vals
                .iter()
                .map(|&v| bf16::from_f32(v as f32))
                .collect::<Vec<_>>(),
        ),
    }
    .unwrap()
}

pub fn input(dtype: DType, rank: usize, count: usize, seed: usize) -> Tensor {
    let vals: Vec<i64> = (0..count).map(|i| value(rank, i, seed)).collect();
    make(dtype, &[count], &vals)
}

/// The expected allreduce result, computed element by element from every rank's input.
pub fn reference(dtype: DType, op: ReduceOp, n: usize, count: usize, seed: usize) -> Tensor {
    let per_elem = |i: usize| -> Vec<i64> { (0..n).map(|r| value(r, i, seed)).collect() };
    if op == ReduceOp::Average {
        let sums: Vec<i64> = (0..count).map(|i| per_elem(i).iter().sum()).collect();
        return match dtype {
            DType::F32 => Tensor::from_slice(
                &sums
                    .iter()
                    .map(|&s| s as f32 / n as f32)
                    .collect::<Vec<_>>(),
            ),
            DType::F64 => Tensor::from_slice(
                &sums
                    .iter()
                    .map(|&s| s as f64 / n as f64)
                    .collect::<Vec<_>>(),
            ),
            DType::I32 => Tensor::from_slice(
                &sums
                    .iter()
                    .map(|&s| (s / n as i64) as i32)
                    .collect::<Vec<_>>(),
            ),
            DType::I64 => {
                Tensor::from_slice(&sums.iter().map(|&s| s / n as i64).collect::<Vec<_>>())
            }
            DType::F16 => Tensor::from_slice(
                &sums
                    .iter()
                    .map(|&s| f16::from_f32(s as f32 / n as f32))
                    .collect::<Vec<_>>(),
            ),
            DType::BF16 => Tensor::from_slice(
                &sums
                    .iter()
                    .map(|&s| bf16::from_f32(s as f32 / n as f32))
                    .collect::<Vec<_>>(),
            ),
        };
    }
    let vals: Vec<i64> = (0..count)
        .map(|i| {
            let v = per_elem(i);
            match op {
                ReduceOp::Sum => v.iter().sum(),
                ReduceOp::Min => *v.iter().min().unwrap(),
                ReduceOp::Max => *v.iter().max().unwrap(),
                ReduceOp::Average => unreachable!(),
            }
        })
        .collect();
    make(dtype, &[count], &vals)
}
