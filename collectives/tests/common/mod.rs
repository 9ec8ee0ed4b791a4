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

pub const DTYPES: [DType; 9] = [
    DType::F32,
    DType::F64,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::U8,
    DType::I8,
    DType::I16,
];
pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
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

/// The input of element `i` of `rank` for `op`: [`value`], except for `Product`, whose
/// inputs are -2, -1, 0, 1 or 2, so that every partial product of up to 8 ranks is exact in
/// every dtype (the ranks may multiply in any order) and zeros carry their IEEE sign.
pub fn value_for(op: ReduceOp, rank: usize, i: usize, seed: usize) -> i64 {
    if op == ReduceOp::Product {
        [-2, -1, 0, 1, 2][(rank * 3 + i * 7 + seed) % 5]
    } else {
        value(rank, i, seed)
    }
}

/// `v` as `dtype` holds it (integers wrap), back in an i64.
fn wrap(dtype: DType, v: i64) -> i64 {
    match dtype {
        DType::U8 => i64::from(v as u8),
        DType::I8 => i64::from(v as i8),
        DType::I16 => i64::from(v as i16),
        DType::I32 => i64::from(v as i32),
        _ => v,
    }
}

pub fn make(dtype: DType, shape: &[usize], vals: &[i64]) -> Tensor {
    match dtype {
        DType::F32 => Tensor::new(shape, &vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::new(shape, &vals.iter().map(|&v| v as f64).collect::<Vec<_>>()),
        DType::I32 => Tensor::new(shape, &vals.iter().map(|&v| v as i32).collect::<Vec<_>>()),
        DType::I64 => Tensor::new(shape, vals),
        DType::U8 => Tensor::new(shape, &vals.iter().map(|&v| v as u8).collect::<Vec<_>>()),
        DType::I8 => Tensor::new(shape, &vals.iter().map(|&v| v as i8).collect::<Vec<_>>()),
        DType::I16 => Tensor::new(shape, &vals.iter().map(|&v| v as i16).collect::<Vec<_>>()),
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

/// A float tensor of `vals` (for the signs of zero products); panics for integer dtypes.
fn make_float(dtype: DType, vals: &[f64]) -> Tensor {
    match dtype {
        DType::F32 => Tensor::from_slice(&vals.iter().map(|&v| v as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::from_slice(vals),
        DType::F16 => {
            Tensor::from_slice(&vals.iter().map(|&v| f16::from_f64(v)).collect::<Vec<_>>())
        }
        DType::BF16 => {
            Tensor::from_slice(&vals.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<_>>())
        }
        other => panic!("{other:?} is not a float dtype"),
    }
}

pub fn input(dtype: DType, rank: usize, count: usize, seed: usize) -> Tensor {
    let vals: Vec<i64> = (0..count).map(|i| value(rank, i, seed)).collect();
    make(dtype, &[count], &vals)
}

/// `rank`'s input for an allreduce with `op` ([`value_for`]).
pub fn input_for(op: ReduceOp, dtype: DType, rank: usize, count: usize, seed: usize) -> Tensor {
    let vals: Vec<i64> = (0..count).map(|i| value_for(op, rank, i, seed)).collect();
    make(dtype, &[count], &vals)
}

/// The expected allreduce result, computed element by element from every rank's input
/// ([`input_for`]) in the dtype's own range: integers wrap, averages truncate.
pub fn reference(dtype: DType, op: ReduceOp, n: usize, count: usize, seed: usize) -> Tensor {
    let per_elem = |i: usize| -> Vec<i64> {
        (0..n)
            .map(|r| wrap(dtype, value_for(op, r, i, seed)))
            .collect()
    };
    if op == ReduceOp::Product && !dtype.is_integer() {
        // In f64, one factor after another: exact (powers of two), and a zero's sign is
        // the product of the signs whatever the order, as in IEEE arithmetic.
        let vals: Vec<f64> = (0..count)
            .map(|i| per_elem(i).iter().fold(1.0f64, |p, &v| p * v as f64))
            .collect();
        return make_float(dtype, &vals);
    }
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
            // Integers: the wrapped sum, divided with truncation.
            _ => make(
                dtype,
                &[count],
                &sums
                    .iter()
                    .map(|&s| wrap(dtype, s) / n as i64)
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
                ReduceOp::Product => v.iter().fold(1i64, |p, &x| p.wrapping_mul(x)),
                ReduceOp::Average => unreachable!(),
            }
        })
        .collect();
    make(dtype, &[count], &vals)
}
