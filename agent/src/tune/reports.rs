//! `reports`: the directory where finished tuning sessions leave their
//! reports (`ID.csv`, `ID.parquet`, `ID.html` from `tuner`, and `ID.json`,
//! this module's small metadata file), and the listing the API serves.
//!
//! It only reads and writes files under its one directory: a report id that
//! could name anything outside it (a path separator, a leading dot) is
//! refused, never resolved.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use collectives::control::Knobs;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The system-wide default reports directory.
pub const DEFAULT_REPORTS_DIR: &str = "/var/lib/ringwatch/reports";

/// What `ID.json` holds, and one entry of `GET /api/reports`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ReportMeta {
    /// The report's id (also its files' stem).
    pub id: String,
    /// The job it tuned.
    pub job_id: String,
    /// When it was written, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Samples taken.
    pub samples: usize,
    /// The knobs the session chose (and pinned on the job).
    pub best: Option<Knobs>,
    /// The chosen knobs' measured score over the starting knobs' score.
    pub speedup_over_start: Option<f64>,
    /// How the session ended: `done`, `stopped` or `failed`.
    pub state: String,
    /// Whether eBPF judged the windows, or why not.
    pub disturbance_detection: String,
    /// The knobs the job had when the session started.
    pub start_knobs: Knobs,
}

/// One report as listed by the API, with its links.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = ReportEntry)]
pub struct ListedReport {
    /// The metadata.
    #[serde(flatten)]
    pub meta: ReportMeta,
    /// Link to the HTML page.
    pub html: String,
    /// Link to the CSV table.
    pub csv: String,
    /// Link to the Parquet table.
    pub parquet: String,
}

/// A report file format served by `GET /api/reports/{id}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportFormat {
    /// The HTML page (default).
    Html,
    /// The table of samples as CSV.
    Csv,
    /// The table of samples as Parquet.
    Parquet,
    /// The metadata.
    Json,
}

impl ReportFormat {
    /// Parses `html|csv|parquet|json`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "html" => Some(Self::Html),
            "csv" => Some(Self::Csv),
            "parquet" => Some(Self::Parquet),
            "json" => Some(Self::Json),
            _ => None,
        }
    }

    /// The file extension.
    pub fn extension(self) -> &'static str {
        match self {
            Self::Html => "html",
            Self::Csv => "csv",
            Self::Parquet => "parquet",
            Self::Json => "json",
        }
    }

    /// The HTTP content type.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Html => "text/html; charset=utf-8",
            Self::Csv => "text/csv; charset=utf-8",
            Self::Parquet => "application/vnd.apache.parquet",
            Self::Json => "application/json",
        }
    }
}

/// The reports directory, resolved and writable.
#[derive(Debug, Clone)]
pub struct Reports {
    dir: PathBuf,
}

impl Reports {
    /// Uses `wanted` if it can be created and written; otherwise (with a
    /// logged notice) `$XDG_STATE_HOME/ringwatch/reports` or
    /// `~/.local/state/ringwatch/reports`. Fails only when none is writable.
    pub fn open(wanted: &Path) -> Result<Self> {
        let first = match writable(wanted) {
            Ok(()) => {
                return Ok(Self {
                    dir: wanted.to_owned(),
                });
            }
            Err(error) => error,
        };
        let fallback = fallback_dir().with_context(|| {
            format!(
                "the reports directory {} is not writable ({first:#}), and there is no \
                 $XDG_STATE_HOME or $HOME to fall back to; give --reports-dir",
                wanted.display()
            )
        })?;
        writable(&fallback).with_context(|| {
            format!(
                "neither the reports directory {} ({first:#}) nor the fallback {} is writable; \
                 give --reports-dir",
                wanted.display(),
                fallback.display()
            )
        })?;
        tracing::info!(
            wanted = %wanted.display(),
            using = %fallback.display(),
            reason = format!("{first:#}"),
            "the reports directory is not writable; writing tuning reports to the fallback"
        );
        Ok(Self { dir: fallback })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `ID.json` (after the report files themselves were written).
    pub fn write_meta(&self, meta: &ReportMeta) -> Result<PathBuf> {
        let path = self.dir.join(format!("{}.json", meta.id));
        let text = serde_json::to_vec_pretty(meta).context("encoding the report metadata")?;
        // Written whole under a temporary name, then renamed: a listing
        // never reads half a file.
        let partial = self.dir.join(format!(".{}.json.partial", meta.id));
        std::fs::write(&partial, text).with_context(|| format!("writing {}", partial.display()))?;
        std::fs::rename(&partial, &path)
            .with_context(|| format!("renaming {} to {}", partial.display(), path.display()))?;
        Ok(path)
    }

    /// Every report with a readable metadata file, newest first.
    pub fn list(&self) -> Vec<ListedReport> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut reports: Vec<ListedReport> = entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| {
                let text = std::fs::read(e.path()).ok()?;
                let meta: ReportMeta = serde_json::from_slice(&text).ok()?;
                valid_id(&meta.id).then_some(meta)
            })
            .map(|meta| ListedReport {
                html: format!("/api/reports/{}", meta.id),
                csv: format!("/api/reports/{}?format=csv", meta.id),
                parquet: format!("/api/reports/{}?format=parquet", meta.id),
                meta,
            })
            .collect();
        reports.sort_by(|a, b| {
            b.meta
                .created_unix_ms
                .cmp(&a.meta.created_unix_ms)
                .then_with(|| a.meta.id.cmp(&b.meta.id))
        });
        reports
    }

    /// The path of report `id`'s file in `format`, if `id` is a valid id
    /// and the file exists.
    pub fn file(&self, id: &str, format: ReportFormat) -> Option<PathBuf> {
        if !valid_id(id) {
            return None;
        }
        let path = self.dir.join(format!("{id}.{}", format.extension()));
        path.is_file().then_some(path)
    }
}

/// A report id for `job_id` at `unix_ms`: the job id with anything but
/// `[A-Za-z0-9_-]` replaced by `_`, then the time.
pub fn report_id(job_id: &str, unix_ms: u64) -> String {
    let job: String = job_id
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{job}-{unix_ms}")
}

/// True for ids this module could have made: no path separators, no
/// leading dot, nothing outside `[A-Za-z0-9._-]`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn fallback_dir() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| PathBuf::from(home).join(".local/state"))
        })?;
    Some(state.join("ringwatch/reports"))
}

/// Creates `dir` and checks a file can be written in it.
fn writable(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let probe = dir.join(format!(".ringwatch-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").with_context(|| format!("writing in {}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ringwatch-reports-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn meta(id: &str, created_unix_ms: u64) -> ReportMeta {
        ReportMeta {
            id: id.to_owned(),
            job_id: "job/1".to_owned(),
            created_unix_ms,
            samples: 3,
            best: Some(Knobs::default()),
            speedup_over_start: Some(1.25),
            state: "done".to_owned(),
            disturbance_detection: "off: no eBPF (not root)".to_owned(),
            start_knobs: Knobs::default(),
        }
    }

    #[test]
    fn ids_cannot_leave_the_directory() {
        assert_eq!(report_id("job/../x y", 12), "job____x_y-12");
        assert!(valid_id(&report_id("job/../x y", 12)));
        for bad in ["", "../etc/passwd", ".hidden", "a/b", "a\\b", "é"] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn reports_are_listed_newest_first_and_files_found_by_format() {
        let dir = temp_dir("list");
        let reports = Reports::open(&dir).unwrap();
        assert_eq!(reports.dir(), dir);
        reports.write_meta(&meta("a-1", 1)).unwrap();
        reports.write_meta(&meta("b-2", 2)).unwrap();
        std::fs::write(dir.join("a-1.html"), "<html>").unwrap();
        // Not a report: ignored.
        std::fs::write(dir.join("junk.json"), "{").unwrap();
        let listed = reports.list();
        let ids: Vec<&str> = listed.iter().map(|r| r.meta.id.as_str()).collect();
        assert_eq!(ids, ["b-2", "a-1"]);
        assert_eq!(listed[1].csv, "/api/reports/a-1?format=csv");
        assert_eq!(listed[1].meta, meta("a-1", 1));
        assert!(reports.file("a-1", ReportFormat::Html).is_some());
        assert!(reports.file("a-1", ReportFormat::Csv).is_none());
        assert!(reports.file("../a-1", ReportFormat::Html).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_directory_falls_back_to_the_state_home() {
        // A regular file where the directory should be: never writable,
        // also for root.
        let blocker = temp_dir("blocker");
        std::fs::write(&blocker, b"").unwrap();
        let wanted = blocker.join("reports");
        let state = temp_dir("state");
        // SAFETY: the only test in this binary that reads XDG_STATE_HOME.
        unsafe { std::env::set_var("XDG_STATE_HOME", &state) };
        let reports = Reports::open(&wanted).unwrap();
        assert_eq!(reports.dir(), state.join("ringwatch/reports"));
        std::fs::remove_file(&blocker).unwrap();
        std::fs::remove_dir_all(&state).unwrap();
    }
}
