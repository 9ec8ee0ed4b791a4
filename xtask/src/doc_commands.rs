//! `cargo xtask doc-commands`: the commands the README and the guides ask a
//! user to paste, run as written.
//!
//! Every fenced ```` ```sh ```` block of `README.md` and `docs/guide/*.md` is
//! a command a person would paste, and the line above its fence says what the
//! suite does with it:
//!
//! - `<!-- doc-test: run -->`: run as written (bash, `-eo pipefail`, from the
//!   repository root), with the workspace's `target/debug` and the Python
//!   venv's `bin` first on `PATH`, and a `sudo` that only runs its command
//!   when this is root already;
//! - `<!-- doc-test: run-background -->`: started the same way and left
//!   running while the document's later blocks run (an agent the next block
//!   asks something), then stopped;
//! - `<!-- doc-test: skip: why -->`: not run here; the reason is printed.
//!
//! A block without one of these fails the check, so a new command in the
//! docs cannot go untested by accident. This module never edits the docs.

use std::fs;
use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// What the suite does with one command block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Run,
    RunBackground,
    Skip(String),
}

/// One ```` ```sh ```` block of a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The document, relative to the repository root.
    pub file: PathBuf,
    /// The 1-based line of the opening fence.
    pub line: usize,
    pub action: Action,
    pub script: String,
}

/// The longest a foreground block may take before it counts as failed.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(300);

/// The documents whose command blocks are checked.
pub fn documents(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![PathBuf::from("README.md")];
    let guide = root.join("docs/guide");
    if guide.is_dir() {
        let mut guides: Vec<PathBuf> = fs::read_dir(&guide)
            .with_context(|| format!("could not list {}", guide.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|e| e == "md"))
            .filter_map(|path| path.strip_prefix(root).ok().map(Path::to_path_buf))
            .collect();
        guides.sort();
        files.extend(guides);
    }
    Ok(files)
}

/// The command blocks of one document, or the lines whose marker is missing
/// or unreadable.
pub fn parse(file: &Path, text: &str) -> Result<Vec<Block>, Vec<String>> {
    let mut blocks = Vec::new();
    let mut problems = Vec::new();
    let mut previous = "";
    let mut lines = text.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let trimmed = line.trim();
        if let Some(info) = trimmed.strip_prefix("```") {
            let fence_line = index + 1;
            let mut body = Vec::new();
            let mut closed = false;
            for (_, inner) in lines.by_ref() {
                if inner.trim() == "```" {
                    closed = true;
                    break;
                }
                body.push(inner);
            }
            if !closed {
                problems.push(format!(
                    "{}:{fence_line}: a code block that never closes",
                    file.display()
                ));
            }
            if info.trim() == "sh" {
                match marker(previous) {
                    Some(Ok(action)) => blocks.push(Block {
                        file: file.to_path_buf(),
                        line: fence_line,
                        action,
                        script: body.join("\n"),
                    }),
                    Some(Err(why)) => {
                        problems.push(format!("{}:{fence_line}: {why}", file.display()));
                    }
                    None => problems.push(format!(
                        "{}:{fence_line}: a ```sh block needs `<!-- doc-test: run -->`, \
                         `<!-- doc-test: run-background -->` or `<!-- doc-test: skip: why -->` \
                         on the line above it",
                        file.display()
                    )),
                }
            }
            previous = "";
            continue;
        }
        if !trimmed.is_empty() {
            previous = trimmed;
        }
    }
    if problems.is_empty() {
        Ok(blocks)
    } else {
        Err(problems)
    }
}

/// The action a `<!-- doc-test: … -->` line names; `None` when the line is
/// no such marker.
fn marker(line: &str) -> Option<Result<Action, String>> {
    let inner = line
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim()
        .strip_prefix("doc-test:")?
        .trim();
    Some(match inner {
        "run" => Ok(Action::Run),
        "run-background" => Ok(Action::RunBackground),
        _ => match inner.strip_prefix("skip:").map(str::trim) {
            Some(why) if !why.is_empty() => Ok(Action::Skip(why.to_owned())),
            Some(_) => Err("`doc-test: skip:` needs the reason after it".to_owned()),
            None => Err(format!(
                "unknown doc-test marker `{inner}` (run, run-background, skip: why)"
            )),
        },
    })
}

/// Every command block of the docs, checked for its marker.
pub fn collect(root: &Path) -> Result<Vec<Block>> {
    let mut all = Vec::new();
    let mut problems = Vec::new();
    for file in documents(root)? {
        let text = fs::read_to_string(root.join(&file))
            .with_context(|| format!("could not read {}", file.display()))?;
        match parse(&file, &text) {
            Ok(blocks) => all.extend(blocks),
            Err(mut found) => problems.append(&mut found),
        }
    }
    if !problems.is_empty() {
        bail!("the docs' command blocks:\n  {}", problems.join("\n  "));
    }
    Ok(all)
}

/// Runs every block marked `run` (and `run-background`), in document order;
/// prints the skipped ones with their reasons.
pub fn run(root: &Path, target_dir: &Path, venv: Option<&Path>) -> Result<()> {
    let blocks = collect(root)?;
    let shims = target_dir.join("doc-commands/bin");
    fs::create_dir_all(&shims).with_context(|| format!("could not create {}", shims.display()))?;
    write_sudo_shim(&shims)?;
    let mut path = vec![shims, target_dir.join("debug")];
    if let Some(venv) = venv {
        path.push(venv.join("bin"));
    }
    let old_path = std::env::var_os("PATH").unwrap_or_default();
    path.extend(std::env::split_paths(&old_path));
    let path = std::env::join_paths(path).context("a PATH entry holds a colon")?;

    let runnable = blocks
        .iter()
        .filter(|b| !matches!(b.action, Action::Skip(_)))
        .count();
    let mut done = 0;
    let mut failures = Vec::new();
    let mut background: Vec<(String, Child)> = Vec::new();
    let mut current_file: Option<&Path> = None;
    for block in &blocks {
        if current_file != Some(block.file.as_path()) {
            stop_all(&mut background);
            current_file = Some(block.file.as_path());
        }
        let place = format!("{}:{}", block.file.display(), block.line);
        match &block.action {
            Action::Skip(why) => eprintln!("doc-commands: {place}: not run here: {why}"),
            Action::RunBackground => {
                done += 1;
                eprintln!("doc-commands: [{done}/{runnable}] {place}: started in the background");
                eprintln!("{}", indent(&block.script));
                let child = bash(&block.script, &path, root)
                    .spawn()
                    .with_context(|| format!("{place}: could not start bash"))?;
                background.push((place, child));
            }
            Action::Run => {
                done += 1;
                eprintln!("doc-commands: [{done}/{runnable}] {place}");
                eprintln!("{}", indent(&block.script));
                let started = Instant::now();
                match run_one(&block.script, &path, root) {
                    Ok(()) => eprintln!(
                        "doc-commands: {place}: passed in {:.1} s",
                        started.elapsed().as_secs_f64()
                    ),
                    Err(error) => {
                        eprintln!("doc-commands: {place}: FAILED: {error:#}");
                        failures.push(format!("{place}: {error:#}"));
                    }
                }
            }
        }
    }
    stop_all(&mut background);
    let skipped = blocks.len() - runnable;
    if !failures.is_empty() {
        bail!(
            "{} of the docs' commands failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    eprintln!("doc-commands: {runnable} run as written, {skipped} marked as not run here");
    Ok(())
}

fn indent(script: &str) -> String {
    script
        .lines()
        .map(|l| format!("    $ {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn bash(script: &str, path: &std::ffi::OsStr, root: &Path) -> Command {
    let mut command = Command::new("bash");
    command
        .args(["-eo", "pipefail", "-c", script])
        .env("PATH", path)
        .current_dir(root)
        .stdin(Stdio::null())
        // Its own process group, so that a timeout or the end of a
        // background block stops everything it started.
        .process_group(0);
    command
}

/// Runs one block to its end, with its output shown and a timeout.
fn run_one(script: &str, path: &std::ffi::OsStr, root: &Path) -> Result<()> {
    let mut child = bash(script, path, root)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("could not start bash")?;
    let mut stdout = child.stdout.take().context("no stdout pipe")?;
    let mut stderr = child.stderr.take().context("no stderr pipe")?;
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().context("could not wait for bash")? {
            break Some(status);
        }
        if started.elapsed() > BLOCK_TIMEOUT {
            kill_group(&child);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    let show = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(40);
        lines[from..]
            .iter()
            .map(|l| format!("    | {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let shown = format!("{}\n{}", show(&out), show(&err));
    eprintln!("{}", shown.trim_end());
    match status {
        None => bail!("still running after {} s", BLOCK_TIMEOUT.as_secs()),
        Some(status) if !status.success() => bail!("exited with {status}"),
        Some(_) => Ok(()),
    }
}

fn kill_group(child: &Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: a plain kill(2) of the group this module started.
        unsafe {
            libc::kill(-pid, libc::SIGTERM);
        }
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: as above.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

fn stop_all(background: &mut Vec<(String, Child)>) {
    for (place, mut child) in background.drain(..) {
        kill_group(&child);
        let _ = child.wait();
        eprintln!("doc-commands: {place}: stopped");
    }
}

/// A `sudo` for the docs' commands: they are written for a person who is
/// not root, the suite runs as root (or skips what needs it).
fn write_sudo_shim(dir: &Path) -> Result<()> {
    let shim = dir.join("sudo");
    let script = "#!/bin/sh\n\
        # doc-commands: sudo's options are dropped; as root the command just runs.\n\
        while [ $# -gt 0 ]; do case \"$1\" in -*) shift ;; *) break ;; esac; done\n\
        if [ \"$(id -u)\" != 0 ]; then echo 'doc-commands: needs root' >&2; exit 1; fi\n\
        exec \"$@\"\n";
    fs::write(&shim, script).with_context(|| format!("could not write {}", shim.display()))?;
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(&shim, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("could not make {} executable", shim.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_block_takes_the_marker_above_it() {
        let text = "# T\n\n<!-- doc-test: run -->\n```sh\necho a\n```\n\ntext\n\
                    <!-- doc-test: skip: needs a cluster -->\n\n```sh\nkubectl apply\n```\n\
                    ```text\nnot a command\n```\n\
                    <!-- doc-test: run-background -->\n```sh\nserve\n```\n";
        let blocks = parse(Path::new("x.md"), text).unwrap();
        assert_eq!(blocks.len(), 3);
        assert_eq!(blocks[0].action, Action::Run);
        assert_eq!(blocks[0].script, "echo a");
        assert_eq!(blocks[0].line, 4);
        assert_eq!(blocks[1].action, Action::Skip("needs a cluster".into()));
        assert_eq!(blocks[2].action, Action::RunBackground);
    }

    #[test]
    fn a_block_without_a_marker_is_named() {
        let text = "Run this:\n```sh\nrm -rf /\n```\n<!-- doc-test: skip: -->\n```sh\nx\n```\n\
                    <!-- doc-test: maybe -->\n```sh\ny\n```\n";
        let problems = parse(Path::new("r.md"), text).unwrap_err();
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].starts_with("r.md:2:"), "{problems:?}");
        assert!(problems[1].contains("needs the reason"), "{problems:?}");
        assert!(
            problems[2].contains("unknown doc-test marker"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_marker_for_another_block_does_not_carry_over() {
        let text = "<!-- doc-test: run -->\n```text\nout\n```\n```sh\nx\n```\n";
        assert!(parse(Path::new("d.md"), text).is_err());
    }
}
