//! How the agent drives a tuning session, end to end, against a synthetic
//! collective-throughput function: construct the space and optimizer, loop
//! suggest → measure → observe until `should_stop`, pin `best()`, and write
//! the report (CSV, Parquet, HTML) into a directory.
//!
//! Run: `cargo run -p tuner --example collective_session -- /tmp/session`

use std::fs::File;
use std::path::PathBuf;

use tuner::report::{self, SampleAnnotation};
use tuner::{CollectiveKnobs, Optimizer, OptimizerConfig, Space};

/// Stand-in for a measurement window: bytes reduced per second (GB/s).
fn measure(knobs: &CollectiveKnobs, window: usize) -> (f64, Option<String>) {
    let threshold = knobs.fusion_threshold_bytes.max(2 << 20) as f64;
    let fusion = 1.0 / (1.0 + (32.0 * 1048576.0 / threshold) * 0.08 + threshold / 2.0e9);
    let cycle = 1.0 / (1.0 + 0.5 / knobs.cycle_time_ms + 0.02 * knobs.cycle_time_ms);
    let hierarchical = if knobs.hierarchical_allreduce {
        2.2
    } else {
        1.0
    };
    let score = 1.5 * fusion * cycle * hierarchical;
    // Pretend eBPF flagged the fourth window (a noisy neighbour).
    if window == 3 {
        (
            score * 1.4,
            Some("run-queue wait of comm threads 35%".to_owned()),
        )
    } else {
        (score, None)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "session".into()));
    std::fs::create_dir_all(&dir)?;

    let start = CollectiveKnobs::default();
    let mut optimizer = Optimizer::new(
        Space::collective(),
        OptimizerConfig {
            seed: 1,
            budget: 20,
            start: Some(start.to_point()),
            ..OptimizerConfig::default()
        },
    )?;
    let mut annotations = Vec::new();
    let mut window = 0;
    while !optimizer.should_stop() {
        let point = optimizer.suggest();
        let knobs = CollectiveKnobs::from_point(&point)?;
        let (score, disturbed) = measure(&knobs, window);
        // A disturbed window still counts, but with a large noise hint.
        let hint = disturbed.as_ref().map(|_| 0.5 * score);
        optimizer.observe(point, score, hint)?;
        annotations.push(SampleAnnotation {
            wall_time_s: 15.0 * window as f64,
            disturbed,
        });
        window += 1;
    }
    let best = optimizer.best().ok_or("no observations")?;
    println!(
        "stopped ({:?}) after {window} windows; pin {:?} (predicted {:.3})",
        optimizer.stop_reason(),
        CollectiveKnobs::from_point(&best.point)?,
        best.predicted_score
    );

    let (samples, chosen) = report::samples_from_optimizer(&optimizer, &annotations)?;
    let frame = report::session_frame(optimizer.space(), &samples, chosen)?;
    report::write_csv(&frame, File::create(dir.join("session.csv"))?)?;
    report::write_parquet(&frame, File::create(dir.join("session.parquet"))?)?;
    let html = report::render_html(&frame, "collective tuning session (example)")?;
    std::fs::write(dir.join("session.html"), html)?;
    println!("report in {}", dir.display());
    Ok(())
}
