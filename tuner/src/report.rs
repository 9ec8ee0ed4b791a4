//! The report of a tuning session: one row per sample as a polars DataFrame,
//! written as CSV or Parquet, read back from Parquet, and rendered as a
//! self-contained HTML page (inline SVG convergence plot, the table, the
//! chosen knobs and the measured speedup over the starting knobs).
//!
//! It is the one module of the crate that does I/O, and only this: the
//! frame functions write to and read from the `Write`/`Read` the caller
//! hands it, and [`write_report`] creates a finished session's three files
//! in the directory the caller names (so the agent and a self-tuning job
//! write the same report). It must never read a clock, start threads or
//! talk to anything; wall times come from the caller. Everything the HTML
//! shows comes from the frame alone, so a Parquet file is enough to
//! re-render the page. It reads a session only through the data the session
//! hands it ([`ReportData`]); the session never calls back into it.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use polars::prelude::*;
use thiserror::Error;

use crate::optimizer::Optimizer;
use crate::session::{Candidate, Confirmation, ReportData};
use crate::space::{
    CYCLE_TIME_MS, CollectiveKnobs, Dim, DimKind, FUSION_THRESHOLD_BYTES, HIERARCHICAL_ALLREDUCE,
    Point, Space, Value,
};

/// Column: sample index, from 0.
pub const COL_SAMPLE: &str = "sample";
/// Column: measured score (higher is better).
pub const COL_SCORE: &str = "score";
/// Column: extra noise standard deviation hinted for the sample (score units).
pub const COL_NOISE_HINT: &str = "noise_hint";
/// Column: whether the measurement window was disturbed.
pub const COL_DISTURBED: &str = "disturbed";
/// Column: why it was disturbed (null when it was not).
pub const COL_DISTURBED_REASON: &str = "disturbed_reason";
/// Column: why a first measurement window of the sample was thrown away and
/// measured again (null when the first window was clean).
pub const COL_REMEASURED_BECAUSE: &str = "remeasured_because";
/// Column: best undisturbed score so far (null before the first one).
pub const COL_BEST_SO_FAR: &str = "best_so_far";
/// Column: seconds since the session started, as the caller measured.
pub const COL_WALL_TIME_S: &str = "wall_time_s";
/// Column: whether this sample's knobs are the session's recommendation.
pub const COL_CHOSEN: &str = "chosen";

const FIXED_COLUMNS: [&str; 9] = [
    COL_SAMPLE,
    COL_SCORE,
    COL_NOISE_HINT,
    COL_DISTURBED,
    COL_DISTURBED_REASON,
    COL_REMEASURED_BECAUSE,
    COL_BEST_SO_FAR,
    COL_WALL_TIME_S,
    COL_CHOSEN,
];

/// Why a report could not be built, written, read or rendered.
#[derive(Debug, Error)]
pub enum ReportError {
    /// A knob is named like one of the report's own columns.
    #[error("knob `{0}` clashes with a report column of the same name; rename the knob")]
    ColumnClash(String),
    /// A sample's knobs do not fit the space.
    #[error("sample {index}: {source}")]
    BadSample {
        /// Index of the sample.
        index: usize,
        /// What is wrong with it.
        source: crate::space::SpaceError,
    },
    /// Per-sample annotations and observations differ in number.
    #[error("{observations} observations but {annotations} annotations; give one per sample")]
    AnnotationCount {
        /// Observations in the optimizer.
        observations: usize,
        /// Annotations given.
        annotations: usize,
    },
    /// The chosen sample index is past the end.
    #[error("chosen sample {chosen} does not exist (there are {samples} samples)")]
    ChosenOutOfRange {
        /// The index given.
        chosen: usize,
        /// Number of samples.
        samples: usize,
    },
    /// The frame lacks a column the report needs, or has it with another type.
    #[error("report frame: {0}")]
    Frame(String),
    /// polars failed (writing, reading or building the frame).
    #[error("polars: {0}")]
    Polars(#[from] PolarsError),
    /// Reading the caller's reader failed.
    #[error("reading the report: {0}")]
    Io(#[from] std::io::Error),
}

/// One evaluated sample, as the caller (the agent) recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRecord {
    /// The knobs evaluated.
    pub knobs: Point,
    /// The measured score.
    pub score: f64,
    /// Extra noise standard deviation hinted to the optimizer, if any.
    pub noise_hint: Option<f64>,
    /// Why the window was disturbed (`None` when it was clean).
    pub disturbed: Option<String>,
    /// Why an earlier window of this sample was measured again (`None` when
    /// the first window was kept).
    pub remeasured_because: Option<String>,
    /// Seconds since the session started when the sample was taken.
    pub wall_time_s: f64,
}

/// What the caller knows about a sample beyond what the optimizer holds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampleAnnotation {
    /// Seconds since the session started.
    pub wall_time_s: f64,
    /// Why the window was disturbed (`None` when it was clean).
    pub disturbed: Option<String>,
}

/// The samples of an optimizer's session joined with the caller's
/// annotations (one per observation, in order), and the index of the
/// recommended sample ([`Optimizer::best`]).
pub fn samples_from_optimizer(
    optimizer: &Optimizer,
    annotations: &[SampleAnnotation],
) -> Result<(Vec<SampleRecord>, Option<usize>), ReportError> {
    let observations = optimizer.observations();
    if observations.len() != annotations.len() {
        return Err(ReportError::AnnotationCount {
            observations: observations.len(),
            annotations: annotations.len(),
        });
    }
    let samples = observations
        .iter()
        .zip(annotations)
        .map(|(o, a)| SampleRecord {
            knobs: o.point.clone(),
            score: o.score,
            noise_hint: (o.noise_sd > 0.0).then_some(o.noise_sd),
            disturbed: a.disturbed.clone(),
            remeasured_because: None,
            wall_time_s: a.wall_time_s,
        })
        .collect();
    Ok((samples, optimizer.best().map(|b| b.index)))
}

/// The session as a DataFrame: `sample`, one column per knob (Float64 for
/// continuous, Int64 for integer, String for categorical, Boolean for
/// boolean knobs), `score`, `noise_hint`, `disturbed`, `disturbed_reason`,
/// `remeasured_because`,
/// `best_so_far` (running maximum of undisturbed scores), `wall_time_s`,
/// `chosen`.
pub fn session_frame(
    space: &Space,
    samples: &[SampleRecord],
    chosen: Option<usize>,
) -> Result<DataFrame, ReportError> {
    for dim in space.dims() {
        if FIXED_COLUMNS.contains(&dim.name.as_str()) {
            return Err(ReportError::ColumnClash(dim.name.clone()));
        }
    }
    if let Some(c) = chosen
        && c >= samples.len()
    {
        return Err(ReportError::ChosenOutOfRange {
            chosen: c,
            samples: samples.len(),
        });
    }
    for (index, s) in samples.iter().enumerate() {
        space
            .validate(&s.knobs)
            .map_err(|source| ReportError::BadSample { index, source })?;
    }
    let n = samples.len();
    let mut columns = vec![Column::new(
        COL_SAMPLE.into(),
        (0..n as i64).collect::<Vec<i64>>(),
    )];
    for (d, dim) in space.dims().iter().enumerate() {
        let values = samples.iter().map(|s| s.knobs.0[d]);
        let name: PlSmallStr = dim.name.as_str().into();
        let column = match &dim.kind {
            DimKind::Continuous { .. } => Column::new(
                name,
                values
                    .map(|v| match v {
                        Value::Real(x) => x,
                        _ => f64::NAN,
                    })
                    .collect::<Vec<f64>>(),
            ),
            DimKind::Integer { .. } => Column::new(
                name,
                values
                    .map(|v| match v {
                        Value::Integer(x) => x,
                        _ => 0,
                    })
                    .collect::<Vec<i64>>(),
            ),
            DimKind::Categorical { .. } => Column::new(
                name,
                values
                    .map(|v| space.describe(d, &v))
                    .collect::<Vec<String>>(),
            ),
            DimKind::Boolean => Column::new(
                name,
                values
                    .map(|v| matches!(v, Value::Bool(true)))
                    .collect::<Vec<bool>>(),
            ),
        };
        columns.push(column);
    }
    let mut best = None::<f64>;
    let best_so_far: Vec<Option<f64>> = samples
        .iter()
        .map(|s| {
            if s.disturbed.is_none() {
                best = Some(best.map_or(s.score, |b: f64| b.max(s.score)));
            }
            best
        })
        .collect();
    columns.extend([
        Column::new(
            COL_SCORE.into(),
            samples.iter().map(|s| s.score).collect::<Vec<f64>>(),
        ),
        Column::new(
            COL_NOISE_HINT.into(),
            samples
                .iter()
                .map(|s| s.noise_hint)
                .collect::<Vec<Option<f64>>>(),
        ),
        Column::new(
            COL_DISTURBED.into(),
            samples
                .iter()
                .map(|s| s.disturbed.is_some())
                .collect::<Vec<bool>>(),
        ),
        Column::new(
            COL_DISTURBED_REASON.into(),
            samples
                .iter()
                .map(|s| s.disturbed.clone())
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(
            COL_REMEASURED_BECAUSE.into(),
            samples
                .iter()
                .map(|s| s.remeasured_because.clone())
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(COL_BEST_SO_FAR.into(), best_so_far),
        Column::new(
            COL_WALL_TIME_S.into(),
            samples.iter().map(|s| s.wall_time_s).collect::<Vec<f64>>(),
        ),
        Column::new(
            COL_CHOSEN.into(),
            (0..n).map(|i| Some(i) == chosen).collect::<Vec<bool>>(),
        ),
    ]);
    Ok(DataFrame::new(n, columns)?)
}

/// Writes the frame as CSV with a header row.
pub fn write_csv<W: Write>(frame: &DataFrame, writer: W) -> Result<(), ReportError> {
    let mut frame = frame.clone();
    CsvWriter::new(writer)
        .include_header(true)
        .finish(&mut frame)?;
    Ok(())
}

/// Writes the frame as Parquet.
pub fn write_parquet<W: Write>(frame: &DataFrame, writer: W) -> Result<(), ReportError> {
    let mut frame = frame.clone();
    ParquetWriter::new(writer).finish(&mut frame)?;
    Ok(())
}

/// Reads a frame written by [`write_parquet`].
pub fn read_parquet<R: Read>(mut reader: R) -> Result<DataFrame, ReportError> {
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes)?;
    Ok(ParquetReader::new(std::io::Cursor::new(bytes)).finish()?)
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

fn cell(value: &AnyValue<'_>) -> String {
    match value {
        AnyValue::Null => String::new(),
        AnyValue::String(s) => (*s).to_owned(),
        AnyValue::StringOwned(s) => s.to_string(),
        AnyValue::Float64(v) => format_number(*v),
        other => other.to_string(),
    }
}

/// Numbers for people: integers without a fraction, others to 4 significant
/// digits.
fn format_number(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v != 0.0 && (v.abs() >= 1e6 || v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

fn f64_column(frame: &DataFrame, name: &str) -> Result<Vec<Option<f64>>, ReportError> {
    let column = frame
        .column(name)
        .map_err(|_| ReportError::Frame(format!("missing column `{name}`")))?;
    let values = column
        .f64()
        .map_err(|_| ReportError::Frame(format!("column `{name}` is not Float64")))?;
    Ok((0..values.len()).map(|i| values.get(i)).collect())
}

fn bool_column(frame: &DataFrame, name: &str) -> Result<Vec<bool>, ReportError> {
    let column = frame
        .column(name)
        .map_err(|_| ReportError::Frame(format!("missing column `{name}`")))?;
    let values = column
        .bool()
        .map_err(|_| ReportError::Frame(format!("column `{name}` is not Boolean")))?;
    Ok((0..values.len())
        .map(|i| values.get(i).unwrap_or(false))
        .collect())
}

/// The convergence plot: every score (clean as dots, disturbed as crosses)
/// and the best-so-far step line, against the sample index.
fn convergence_svg(scores: &[f64], best: &[Option<f64>], disturbed: &[bool]) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 320.0, 70.0, 20.0, 20.0, 40.0);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="convergence plot">"#
    );
    if scores.is_empty() {
        svg.push_str(r#"<text x="20" y="40">no samples</text></svg>"#);
        return svg;
    }
    let lo = scores.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if hi > lo {
        let pad = 0.05 * (hi - lo);
        (lo - pad, hi + pad)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let n = scores.len();
    let px = |i: usize| {
        left + (w - left - right)
            * if n > 1 {
                i as f64 / (n - 1) as f64
            } else {
                0.5
            }
    };
    let py = |v: f64| top + (h - top - bottom) * (1.0 - (v - lo) / (hi - lo));
    // Axes and labels.
    let _ = write!(
        svg,
        r##"<g stroke="#888" stroke-width="1"><line x1="{left}" y1="{t}" x2="{left}" y2="{b}"/><line x1="{left}" y1="{b}" x2="{r}" y2="{b}"/></g>"##,
        t = top,
        b = h - bottom,
        r = w - right
    );
    for frac in [0.0, 0.5, 1.0] {
        let v = lo + frac * (hi - lo);
        let _ = write!(
            svg,
            r#"<text x="{x}" y="{y}" font-size="11" text-anchor="end">{label}</text>"#,
            x = left - 6.0,
            y = py(v) + 4.0,
            label = escape(&format_number(v))
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{x}" y="{y}" font-size="11" text-anchor="middle">sample</text><text x="{l}" y="{y}" font-size="11">0</text><text x="{r}" y="{y}" font-size="11" text-anchor="end">{last}</text>"#,
        x = (left + w - right) / 2.0,
        y = h - 10.0,
        l = left,
        r = w - right,
        last = n - 1
    );
    // Best-so-far as a step line.
    let mut path = String::new();
    let mut prev: Option<f64> = None;
    for (i, b) in best.iter().enumerate() {
        if let Some(b) = b {
            match prev {
                None => {
                    let _ = write!(path, "M{:.1},{:.1}", px(i), py(*b));
                }
                Some(p) => {
                    let _ = write!(
                        path,
                        " L{:.1},{:.1} L{:.1},{:.1}",
                        px(i),
                        py(p),
                        px(i),
                        py(*b)
                    );
                }
            }
            prev = Some(*b);
        }
    }
    if !path.is_empty() {
        let _ = write!(
            svg,
            r##"<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"><title>best so far</title></path>"##
        );
    }
    for (i, (&s, &d)) in scores.iter().zip(disturbed).enumerate() {
        let (x, y) = (px(i), py(s));
        if d {
            let _ = write!(
                svg,
                r##"<path d="M{a:.1},{b:.1} L{c:.1},{e:.1} M{a:.1},{e:.1} L{c:.1},{b:.1}" stroke="#d62728" stroke-width="2"><title>sample {i}: {v} (disturbed)</title></path>"##,
                a = x - 4.0,
                b = y - 4.0,
                c = x + 4.0,
                e = y + 4.0,
                v = escape(&format_number(s))
            );
        } else {
            let _ = write!(
                svg,
                r##"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="#ff7f0e"><title>sample {i}: {v}</title></circle>"##,
                v = escape(&format_number(s))
            );
        }
    }
    svg.push_str("</svg>");
    svg
}

/// A self-contained HTML page of a session frame (as built by
/// [`session_frame`] or read back by [`read_parquet`]): the convergence
/// plot, the chosen knobs with the measured speedup over the starting knobs
/// (sample 0), and the full table. No script, no external resource.
pub fn render_html(frame: &DataFrame, title: &str) -> Result<String, ReportError> {
    let scores: Vec<f64> = f64_column(frame, COL_SCORE)?
        .into_iter()
        .map(|v| v.unwrap_or(f64::NAN))
        .collect();
    let best = f64_column(frame, COL_BEST_SO_FAR)?;
    let disturbed = bool_column(frame, COL_DISTURBED)?;
    let chosen = bool_column(frame, COL_CHOSEN)?;
    let names: Vec<String> = frame
        .get_column_names()
        .iter()
        .map(|n| n.to_string())
        .collect();
    let knobs: Vec<&String> = names
        .iter()
        .filter(|n| !FIXED_COLUMNS.contains(&n.as_str()))
        .collect();

    let mut html = String::new();
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title>\
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}\
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}\
tr.chosen{{background:#e6f4ea;font-weight:bold}}tr.disturbed{{color:#a33}}\
.summary td{{text-align:left}}.wide{{overflow-x:auto;max-width:100%}}</style></head><body><h1>{t}</h1>\n",
        t = escape(title)
    );
    let _ = write!(
        html,
        "<h2>Convergence</h2>\n{}\n<p>Dots: measured score per sample; crosses: disturbed windows; line: best undisturbed score so far.</p>\n",
        convergence_svg(&scores, &best, &disturbed)
    );

    html.push_str("<h2>Chosen knobs</h2>\n");
    match chosen.iter().position(|&c| c) {
        Some(row) => {
            html.push_str("<table class=\"summary\">");
            for name in &knobs {
                let start = cell(&frame.column(name)?.get(0)?);
                let pick = cell(&frame.column(name)?.get(row)?);
                let _ = write!(
                    html,
                    "<tr><th>{}</th><td>{}</td><td>(start: {})</td></tr>",
                    escape(name),
                    escape(&readable(name, &pick)),
                    escape(&readable(name, &start))
                );
            }
            let (start_score, chosen_score) = (scores[0], scores[row]);
            let _ = write!(
                html,
                "<tr><th>score</th><td>{}</td><td>(start: {})</td></tr>",
                format_number(chosen_score),
                format_number(start_score)
            );
            if start_score > 0.0 && chosen_score.is_finite() {
                let _ = write!(
                    html,
                    "<tr><th>speedup</th><td>{:.3}×</td><td>measured: chosen sample {row} over sample 0 (the starting knobs)</td></tr>",
                    chosen_score / start_score
                );
            }
            html.push_str("</table>\n");
        }
        None => html.push_str("<p>No knobs were chosen in this session.</p>\n"),
    }

    // Many columns: the table scrolls inside the page rather than widening it.
    html.push_str("<h2>Samples</h2>\n<div class=\"wide\"><table><thead><tr>");
    for name in &names {
        let _ = write!(html, "<th>{}</th>", escape(name));
    }
    html.push_str("</tr></thead><tbody>\n");
    let columns = frame.columns();
    for row in 0..frame.height() {
        let class = if chosen[row] {
            " class=\"chosen\""
        } else if disturbed[row] {
            " class=\"disturbed\""
        } else {
            ""
        };
        let _ = write!(html, "<tr{class}>");
        for column in columns {
            let _ = write!(html, "<td>{}</td>", escape(&cell(&column.get(row)?)));
        }
        html.push_str("</tr>\n");
    }
    html.push_str("</tbody></table></div>\n</body></html>\n");
    Ok(html)
}

/// A knob's value as a person reads it: a byte count also in MiB
/// (`506477648 (483.0 MiB)`); anything else as it is.
fn readable(name: &str, value: &str) -> String {
    match value.parse::<f64>() {
        Ok(bytes) if name.ends_with("_bytes") && bytes.is_finite() => {
            format!("{value} ({:.1} MiB)", bytes / (1024.0 * 1024.0))
        }
        _ => value.to_string(),
    }
}

/// The confirmation of a session's choice against its start, as an HTML
/// section (`<h2>heading</h2>` and a table of its windows, in the order
/// measured).
pub fn confirmation_html(c: &Confirmation, heading: &str, unit: &str) -> String {
    let mut html = format!("<h2>{}</h2>\n", escape(heading));
    let name = |k: Candidate| match k {
        Candidate::Choice => "the choice",
        Candidate::Start => "the start",
    };
    let _ = writeln!(
        html,
        "<p>The optimizer chose sample {} ({} B fusion, {:.3} ms cycle, hierarchical {}). \
         It and the start were measured again on fresh windows, interleaved; the choice is \
         pinned only if the median of its windows beats the start's by more than the \
         required gain (noise of the difference, at least 1%).</p>",
        c.choice_sample,
        c.choice.fusion_threshold_bytes,
        c.choice.cycle_time_ms,
        c.choice.hierarchical_allreduce
    );
    let _ = writeln!(
        html,
        "<table><thead><tr><th>window</th><th>knobs</th><th>score ({})</th><th>disturbed</th></tr></thead><tbody>",
        escape(unit)
    );
    for (i, w) in c.windows.iter().enumerate() {
        let _ = writeln!(
            html,
            "<tr><td>{i}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            name(w.candidate),
            format_number(w.score),
            escape(w.disturbed.as_deref().unwrap_or(""))
        );
    }
    html.push_str("</tbody></table>\n");
    match (c.kept, c.choice_median, c.start_median) {
        (Some(kept), Some(choice), Some(start)) => {
            let _ = writeln!(
                html,
                "<p>Median of the choice: {}; of the start: {} ({:.3}×, required: more than \
                 {:.3}×). Kept: <strong>{}</strong>.</p>",
                format_number(choice),
                format_number(start),
                if start > 0.0 {
                    choice / start
                } else {
                    f64::NAN
                },
                1.0 + c.required_gain.unwrap_or(0.0),
                name(kept)
            );
        }
        _ => html.push_str("<p>The confirmation did not finish (the session was stopped).</p>\n"),
    }
    html
}

/// Why a session started and the job's throughput before it (seconds,
/// bytes/s per watched window), as an HTML section with a line chart.
pub fn context_html(note: &str, timeline: &[(f64, f64)]) -> String {
    let mut html = format!("<h2>Why this session</h2>\n<p>{}</p>\n", escape(note));
    if timeline.len() >= 2 {
        let (w, h, pad) = (640.0, 200.0, 40.0);
        let t_max = timeline.iter().map(|p| p.0).fold(0.0, f64::max).max(1e-9);
        let y_max = timeline.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9);
        let points: Vec<String> = timeline
            .iter()
            .map(|(t, y)| {
                format!(
                    "{:.1},{:.1}",
                    pad + (w - 2.0 * pad) * t / t_max,
                    h - pad - (h - 2.0 * pad) * y / y_max
                )
            })
            .collect();
        let _ = writeln!(
            html,
            "<svg width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"throughput since the previous pin\">\
             <polyline fill=\"none\" stroke=\"#1f6feb\" stroke-width=\"2\" points=\"{}\"/>\
             <text x=\"{pad}\" y=\"{:.0}\" font-size=\"11\">0 s</text>\
             <text x=\"{:.0}\" y=\"{:.0}\" font-size=\"11\" text-anchor=\"end\">{t_max:.0} s</text>\
             <text x=\"4\" y=\"{:.0}\" font-size=\"11\">{}</text></svg>",
            points.join(" "),
            h - pad / 2.0,
            w - pad,
            h - pad / 2.0,
            pad,
            format_number(y_max)
        );
        html.push_str(
            "<p>The job's throughput (bytes reduced per second, one point per watched window) \
             on the knobs the previous session pinned.</p>\n",
        );
    }
    html
}

/// A re-check whose knobs lost at their first sample (so no confirmation
/// ran), as an HTML section.
pub fn recheck_lost_html(start_score: f64, pinned_score: f64) -> String {
    format!(
        "<h2>Re-check of the knobs pinned before (they lost: tuned again)</h2>\n<p>Sample 1 ran \
         the knobs pinned before at {} bytes/s, below the start's {} (sample 0): they no \
         longer win, so the session tuned again from the start.</p>\n",
        format_number(pinned_score),
        format_number(start_score)
    )
}

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    /// The table of samples as CSV.
    pub csv: PathBuf,
    /// The same table as Parquet (re-render with `ringwatch-report`).
    pub parquet: PathBuf,
    /// The self-contained HTML page.
    pub html: PathBuf,
}

/// The report shows every knob, searched or fixed, over ranges wide enough
/// for any value a session can apply (fusion off is the 0 of the column).
fn report_space() -> Space {
    Space::new(vec![
        Dim {
            name: FUSION_THRESHOLD_BYTES.to_owned(),
            kind: DimKind::Continuous {
                low: 0.0,
                high: f64::MAX,
                log_scale: false,
            },
        },
        Dim {
            name: CYCLE_TIME_MS.to_owned(),
            kind: DimKind::Continuous {
                low: 0.0,
                high: f64::MAX,
                log_scale: false,
            },
        },
        Dim {
            name: HIERARCHICAL_ALLREDUCE.to_owned(),
            kind: DimKind::Boolean,
        },
    ])
    .expect("the report space is declared with valid, distinct dimensions")
}

fn report_point(knobs: &CollectiveKnobs) -> Point {
    Point(vec![
        Value::Real(knobs.fusion_threshold_bytes as f64),
        Value::Real(knobs.cycle_time_ms),
        Value::Bool(knobs.hierarchical_allreduce),
    ])
}

/// A tuning session's table (see [`session_frame`]): one row per sample
/// with all three knobs, whether searched or fixed.
pub fn session_report_frame(data: &ReportData<'_>) -> Result<DataFrame, ReportError> {
    let records: Vec<SampleRecord> = data
        .samples
        .iter()
        .map(|s| SampleRecord {
            knobs: report_point(&s.knobs),
            score: s.score,
            noise_hint: s.noise_hint,
            disturbed: s.disturbed.clone(),
            remeasured_because: s.remeasured_because.clone(),
            wall_time_s: s.wall_time_s,
        })
        .collect();
    session_frame(&report_space(), &records, data.best_sample)
}

/// Writes a tuning session's report as `<dir>/<stem>.csv`, `.parquet` and
/// `.html` (the directory must exist). This is the one function of the
/// crate that opens files: the agent and a self-tuning job both call it so
/// that their reports are the same.
pub fn write_report(
    data: &ReportData<'_>,
    dir: &Path,
    stem: &str,
    title: &str,
) -> Result<ReportFiles, ReportError> {
    let frame = session_report_frame(data)?;
    let files = ReportFiles {
        csv: dir.join(format!("{stem}.csv")),
        parquet: dir.join(format!("{stem}.parquet")),
        html: dir.join(format!("{stem}.html")),
    };
    let create = |path: &Path| std::fs::File::create(path).map(std::io::BufWriter::new);
    write_csv(&frame, create(&files.csv)?)?;
    write_parquet(&frame, create(&files.parquet)?)?;
    let mut html = render_html(&frame, title)?;
    let unit = data.objective.map_or("", |o| o.unit());
    let mut sections = String::new();
    if let Some(c) = data.recheck_confirmation {
        sections.push_str(&confirmation_html(
            c,
            "Re-check of the knobs pinned before (they lost: tuned again)",
            unit,
        ));
    }
    if let Some(c) = data.confirmation {
        let heading = if data.rechecked && !data.recheck_lost {
            "Re-check of the knobs pinned before"
        } else {
            "Confirmation before pinning"
        };
        sections.push_str(&confirmation_html(c, heading, unit));
    }
    if data.rechecked
        && data.recheck_lost
        && data.recheck_confirmation.is_none()
        && let (Some(start), Some(pinned)) = (data.samples.first(), data.samples.get(1))
    {
        sections.push_str(&recheck_lost_html(start.score, pinned.score));
    }
    let at = html.find("<h2>Samples</h2>").unwrap_or(html.len());
    html.insert_str(at, &sections);
    if let Some(context) = data.context {
        let at = html.find("<h2>Convergence</h2>").unwrap_or(html.len());
        html.insert_str(at, &context_html(&context.note, &context.timeline));
    }
    if let Some(objective) = data.objective {
        let at = html.find("<h2>").unwrap_or(html.len());
        html.insert_str(
            at,
            &format!(
                "<p class=\"objective\">{}</p>\n",
                escape(objective.describe())
            ),
        );
    }
    std::fs::write(&files.html, html)?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{FakeJob, config, drive, fusion_fixed_config};
    use crate::session::{SessionConfig, TuningSession};

    #[test]
    fn fixed_knobs_show_in_the_report_frame() {
        let mut session = TuningSession::new(fusion_fixed_config()).unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        let frame = session_report_frame(&session.report_data()).unwrap();
        assert_eq!(frame.height(), session.samples().len());
        let fusion = frame.column(FUSION_THRESHOLD_BYTES).unwrap().f64().unwrap();
        assert!((0..fusion.len()).all(|i| fusion.get(i) == Some(0.0)));
    }

    #[test]
    fn writes_csv_parquet_and_html_whose_rows_are_the_samples() {
        let mut session = TuningSession::new(SessionConfig {
            budget: 4,
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        let dir = std::env::temp_dir().join(format!("tuner-session-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = write_report(&session.report_data(), &dir, "job-1", "job 1").unwrap();
        let frame = read_parquet(std::fs::File::open(&files.parquet).unwrap()).unwrap();
        let column = frame.column(COL_SCORE).unwrap().f64().unwrap();
        let scores: Vec<f64> = (0..column.len()).filter_map(|i| column.get(i)).collect();
        let expected: Vec<f64> = session.samples().iter().map(|s| s.score).collect();
        assert_eq!(scores, expected);
        let csv = std::fs::read_to_string(&files.csv).unwrap();
        assert_eq!(csv.lines().count(), 1 + session.samples().len());
        let html = std::fs::read_to_string(&files.html).unwrap();
        assert!(html.contains("job 1"));
        // The confirmation's windows are in the page, before the samples.
        let c = session
            .confirmation()
            .expect("hierarchical beats the start");
        let section = html
            .find("Confirmation before pinning")
            .expect("a confirmation section");
        assert!(section < html.find("<h2>Samples</h2>").unwrap());
        assert_eq!(
            html.matches("<td>the choice</td>").count(),
            c.windows.len() / 2
        );
        assert!(html.contains("Kept: <strong>the choice</strong>"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
