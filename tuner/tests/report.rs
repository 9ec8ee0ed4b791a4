//! Session reports: the frame's contents, the Parquet round trip, CSV, the
//! HTML page, and the `ringwatch-report` binary re-rendering from Parquet.
#![allow(clippy::unwrap_used)]

use tuner::report::{
    self, SampleAnnotation, SampleRecord, read_parquet, render_html, session_frame, write_csv,
    write_parquet,
};
use tuner::space::{CollectiveKnobs, Dim, DimKind, Point, Space, Value};
use tuner::{Optimizer, OptimizerConfig};

fn mixed_space() -> Space {
    Space::new(vec![
        Dim {
            name: "algorithm".into(),
            kind: DimKind::Categorical {
                choices: vec!["ring".into(), "tree".into()],
            },
        },
        Dim {
            name: "chunks".into(),
            kind: DimKind::Integer {
                low: 1,
                high: 16,
                log_scale: true,
            },
        },
        Dim {
            name: "cycle_time_ms".into(),
            kind: DimKind::Continuous {
                low: 0.5,
                high: 50.0,
                log_scale: true,
            },
        },
        Dim {
            name: "hierarchical".into(),
            kind: DimKind::Boolean,
        },
    ])
    .unwrap()
}

fn samples() -> Vec<SampleRecord> {
    let p = |a, c, t, h| {
        Point(vec![
            Value::Choice(a),
            Value::Integer(c),
            Value::Real(t),
            Value::Bool(h),
        ])
    };
    vec![
        SampleRecord {
            knobs: p(0, 1, 1.0, false),
            score: 2.0,
            noise_hint: None,
            disturbed: None,
            remeasured_because: None,
            wall_time_s: 0.0,
        },
        SampleRecord {
            knobs: p(1, 4, 3.5, true),
            score: 2.6,
            noise_hint: None,
            disturbed: None,
            remeasured_because: None,
            wall_time_s: 12.5,
        },
        SampleRecord {
            knobs: p(1, 8, 10.0, true),
            score: 9.0,
            noise_hint: Some(0.8),
            disturbed: Some("run-queue wait 40% <rank 3>".into()),
            remeasured_because: None,
            wall_time_s: 25.0,
        },
        SampleRecord {
            knobs: p(0, 4, 4.0, true),
            score: 3.0,
            noise_hint: None,
            disturbed: None,
            remeasured_because: None,
            wall_time_s: 37.5,
        },
    ]
}

#[test]
fn frame_holds_one_typed_row_per_sample() {
    let frame = session_frame(&mixed_space(), &samples(), Some(3)).unwrap();
    assert_eq!(frame.height(), 4);
    let names: Vec<String> = frame
        .get_column_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        names,
        [
            "sample",
            "algorithm",
            "chunks",
            "cycle_time_ms",
            "hierarchical",
            "score",
            "noise_hint",
            "disturbed",
            "disturbed_reason",
            "remeasured_because",
            "best_so_far",
            "wall_time_s",
            "chosen"
        ]
    );
    let algorithm_column = frame.column("algorithm").unwrap().str().unwrap();
    let algorithm: Vec<Option<&str>> = (0..4).map(|i| algorithm_column.get(i)).collect();
    assert_eq!(
        algorithm,
        [Some("ring"), Some("tree"), Some("tree"), Some("ring")]
    );
    // The disturbed high reading does not count as best so far.
    let best_column = frame.column("best_so_far").unwrap().f64().unwrap();
    let best: Vec<Option<f64>> = (0..4).map(|i| best_column.get(i)).collect();
    assert_eq!(best, [Some(2.0), Some(2.6), Some(2.6), Some(3.0)]);
    let chosen_column = frame.column("chosen").unwrap().bool().unwrap();
    let chosen: Vec<Option<bool>> = (0..4).map(|i| chosen_column.get(i)).collect();
    assert_eq!(chosen, [Some(false), Some(false), Some(false), Some(true)]);
}

#[test]
fn parquet_round_trip_gives_the_same_frame() {
    let frame = session_frame(&mixed_space(), &samples(), Some(3)).unwrap();
    let mut bytes = Vec::new();
    write_parquet(&frame, &mut bytes).unwrap();
    let back = read_parquet(bytes.as_slice()).unwrap();
    assert_eq!(back.schema(), frame.schema());
    assert!(back.equals_missing(&frame), "{back}\nvs\n{frame}");
}

#[test]
fn csv_has_a_header_and_a_line_per_sample() {
    let frame = session_frame(&mixed_space(), &samples(), Some(3)).unwrap();
    let mut bytes = Vec::new();
    write_csv(&frame, &mut bytes).unwrap();
    let text = String::from_utf8(bytes).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5);
    assert!(lines[0].starts_with("sample,algorithm,chunks,cycle_time_ms,hierarchical,score"));
    assert!(lines[3].contains("run-queue wait 40% <rank 3>"));
}

#[test]
fn html_shows_plot_choice_speedup_and_escapes_text() {
    let frame = session_frame(&mixed_space(), &samples(), Some(3)).unwrap();
    let html = render_html(&frame, "job <42>").unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.contains("<svg"));
    assert!(html.contains("job &lt;42&gt;"));
    assert!(!html.contains("<rank 3>"));
    assert!(html.contains("&lt;rank 3&gt;"));
    // Chosen sample 3 scored 3.0 against 2.0 at the start.
    assert!(html.contains("1.500×"), "speedup missing");
    // One table row per sample plus the header.
    assert_eq!(html.matches("<tr class=\"chosen\">").count(), 1);
    assert_eq!(html.matches("<tr class=\"disturbed\">").count(), 1);
    assert!(!html.contains("<script"));
    assert!(!html.contains("http://") || html.contains("http://www.w3.org/2000/svg"));
}

#[test]
fn bad_inputs_are_refused() {
    let space = mixed_space();
    assert!(matches!(
        session_frame(&space, &samples(), Some(9)),
        Err(report::ReportError::ChosenOutOfRange { .. })
    ));
    let mut wrong = samples();
    wrong[1].knobs = Point(vec![Value::Real(1.0)]);
    assert!(matches!(
        session_frame(&space, &wrong, None),
        Err(report::ReportError::BadSample { index: 1, .. })
    ));
    let clash = Space::new(vec![Dim {
        name: "score".into(),
        kind: DimKind::Boolean,
    }])
    .unwrap();
    assert!(matches!(
        session_frame(&clash, &[], None),
        Err(report::ReportError::ColumnClash(_))
    ));
}

#[test]
fn an_optimizer_session_becomes_a_report() {
    let mut optimizer = Optimizer::new(
        Space::collective(),
        OptimizerConfig {
            seed: 11,
            budget: 6,
            start: Some(CollectiveKnobs::default().to_point()),
            ..OptimizerConfig::default()
        },
    )
    .unwrap();
    let mut annotations = Vec::new();
    for i in 0..6 {
        let p = optimizer.suggest();
        let k = CollectiveKnobs::from_point(&p).unwrap();
        let score = if k.hierarchical_allreduce { 2.0 } else { 1.0 } + k.cycle_time_ms / 100.0;
        optimizer.observe(p, score, None).unwrap();
        annotations.push(SampleAnnotation {
            wall_time_s: 10.0 * i as f64,
            disturbed: None,
        });
    }
    assert!(report::samples_from_optimizer(&optimizer, &annotations[..5]).is_err());
    let (samples, chosen) = report::samples_from_optimizer(&optimizer, &annotations).unwrap();
    assert_eq!(chosen, optimizer.best().map(|b| b.index));
    let frame = session_frame(optimizer.space(), &samples, chosen).unwrap();
    assert_eq!(frame.height(), 6);
    let threshold = frame
        .column("fusion_threshold_bytes")
        .unwrap()
        .f64()
        .unwrap()
        .get(0);
    assert_eq!(threshold, Some(64.0 * 1024.0 * 1024.0));
}

#[test]
fn the_binary_re_renders_html_from_parquet() {
    let frame = session_frame(&mixed_space(), &samples(), Some(3)).unwrap();
    let dir = std::env::temp_dir().join(format!("ringwatch-report-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let parquet = dir.join("session.parquet");
    write_parquet(&frame, std::fs::File::create(&parquet).unwrap()).unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_ringwatch-report"))
        .arg(&parquet)
        .args(["--title", "from parquet"])
        .status()
        .unwrap();
    assert!(status.success());
    let html = std::fs::read_to_string(dir.join("session.html")).unwrap();
    assert_eq!(html, render_html(&frame, "from parquet").unwrap());
    let missing = std::process::Command::new(env!("CARGO_BIN_EXE_ringwatch-report"))
        .arg(dir.join("nope.parquet"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nope.parquet"));
    std::fs::remove_dir_all(&dir).unwrap();
}
