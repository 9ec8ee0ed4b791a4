//! Blocking 4 KiB allreduces with uneven "compute" between them (a busy loop of 0–3 ms,
//! different on every rank), as a training step's small collectives meet ranks that do
//! not arrive together. Rank 0 prints how long its calls waited in all (the compute
//! imbalance is most of it) and the percentiles of one call's wait. docs/BENCHMARKS.md
//! ("Ranks out of step") has the numbers and the command:
//!
//! ```sh
//! cargo build --release -p collectives --example jitter
//! for r in 0 1; do RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
//!   RINGWATCH_CONTROL_SOCKET=0 target/release/examples/jitter & done; wait
//! ```

use std::time::{Duration, Instant};

use collectives::runtime::Runtime;
use collectives::tensor::{ReduceOp, Tensor};

const CALLS: usize = 400;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::from_env()?;
    let rank = rt.rank();
    let mut rng = fastrand::Rng::with_seed(rank as u64 + 1);
    let mut t = Tensor::from_slice(&vec![1.0f32; 1024]);
    let mut waits = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let compute = Duration::from_micros(rng.u64(0..3000));
        let start = Instant::now();
        while start.elapsed() < compute {
            std::hint::spin_loop();
        }
        let start = Instant::now();
        t = rt.allreduce("g", t, ReduceOp::Sum)?;
        waits.push(start.elapsed().as_secs_f64() * 1e6);
    }
    waits.sort_by(f64::total_cmp);
    if rank == 0 {
        let at = |q: f64| waits[((CALLS as f64 * q) as usize).min(CALLS - 1)];
        println!(
            "waited {:.1} ms in {CALLS} calls; one call's wait p50 {:.0} us, p90 {:.0} us, p99 {:.0} us",
            waits.iter().sum::<f64>() / 1e3,
            at(0.5),
            at(0.9),
            at(0.99)
        );
    }
    Ok(())
}
