//! `ringwatch-report`: re-renders a tuning session's HTML page from the
//! Parquet file the agent wrote, so a report can be regenerated (or shared)
//! without the agent.
//!
//! It must never change the Parquet file: it only reads it and writes HTML.

use std::fs::File;
use std::io::{BufReader, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;

/// Re-render the HTML report of a ringwatch tuning session from its Parquet
/// table (the `*.parquet` file a session writes next to its CSV and HTML).
///
/// The page is self-contained (inline SVG, no scripts or external files): the
/// convergence plot, the chosen knobs and the measured speedup over the
/// starting knobs (sample 0), and every sample.
#[derive(Debug, Parser)]
#[command(name = "ringwatch-report", version)]
struct Args {
    /// The session's Parquet file.
    parquet: PathBuf,

    /// Where to write the HTML page; `-` for standard output. Defaults to the
    /// Parquet path with an `.html` extension.
    #[arg(short, long, env = "RINGWATCH_REPORT_OUTPUT")]
    output: Option<PathBuf>,

    /// Title shown at the top of the page.
    #[arg(
        short,
        long,
        env = "RINGWATCH_REPORT_TITLE",
        default_value = "ringwatch tuning session"
    )]
    title: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file =
        File::open(&args.parquet).with_context(|| format!("opening {}", args.parquet.display()))?;
    let frame = tuner::report::read_parquet(BufReader::new(file)).with_context(|| {
        format!(
            "reading {} as a session table (is it a ringwatch report's .parquet?)",
            args.parquet.display()
        )
    })?;
    let html = tuner::report::render_html(&frame, &args.title)
        .with_context(|| format!("rendering {}", args.parquet.display()))?;
    let output = args
        .output
        .unwrap_or_else(|| args.parquet.with_extension("html"));
    if output.as_os_str() == "-" {
        std::io::stdout()
            .write_all(html.as_bytes())
            .context("writing the page to standard output")?;
    } else {
        std::fs::write(&output, html).with_context(|| format!("writing {}", output.display()))?;
        eprintln!("wrote {}", output.display());
    }
    Ok(())
}

/// `docs/reference/cli/ringwatch-report.md` (`cargo xtask reference` writes it).
#[cfg(test)]
#[path = "../../../xtask/src/cli_reference.rs"]
mod cli_reference;

#[cfg(test)]
mod reference {
    use super::cli_reference;
    #[test]
    fn reference_ringwatch_report_cli_is_current() {
        let page = cli_reference::render_cli(
            &<super::Args as clap::CommandFactory>::command(),
            "ringwatch-report",
        );
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/reference/cli/ringwatch-report.md"
        );
        cli_reference::check_page(std::path::Path::new(path), &page);
    }
}
