//! `cargo xtask check-deploy` (also a step of `cargo xtask test`): the
//! Kubernetes manifest `deploy/ringwatch.yaml` checked offline by
//! `deploy/check_manifest.py` — every document against the Kubernetes
//! schemas that the pinned `kubernetes-validate` bundles (strict: unknown
//! fields fail), then the manifest's invariants (no privileged container,
//! only allowed capabilities, one port everywhere, the kernel mounts
//! read-only, the token from a Secret, …) — and `--self-test`, which breaks
//! the manifest in memory in many ways and fails unless each is caught.
//!
//! The Python packages come from PyPI, pinned with every dependency
//! (`deploy/requirements.txt`), into a virtual environment under
//! `target/kubernetes-validate` made once and reused while the pins hold,
//! so later runs need no network.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Validates the manifest and runs the check's self-test.
pub fn run(root: &Path, target_dir: &Path) -> Result<()> {
    let python = install(root, target_dir)?;
    let script = root.join("deploy/check_manifest.py");
    for extra in [None, Some("--self-test")] {
        let mut command = Command::new(&python);
        command.arg(&script).args(extra).current_dir(root);
        eprintln!(
            "xtask: $ {} {}{}",
            python.display(),
            script.display(),
            extra.map(|e| format!(" {e}")).unwrap_or_default()
        );
        let status = command
            .status()
            .with_context(|| format!("could not start {}", python.display()))?;
        if !status.success() {
            bail!(
                "deploy/ringwatch.yaml: {} failed ({status}); its messages are above",
                match extra {
                    None => "the manifest check",
                    Some(_) => "the manifest check's self-test",
                }
            );
        }
    }
    Ok(())
}

/// Makes (or reuses) the virtual environment with the pinned packages;
/// returns its `python`.
fn install(root: &Path, target_dir: &Path) -> Result<PathBuf> {
    let requirements = root.join("deploy/requirements.txt");
    let pins = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let venv = target_dir.join("kubernetes-validate");
    let python = venv.join("bin/python");
    let installed = venv.join("installed-requirements.txt");
    if python.is_file() && std::fs::read_to_string(&installed).is_ok_and(|done| done == pins) {
        return Ok(python);
    }
    eprintln!(
        "xtask: installing kubernetes-validate from PyPI into {} (pinned in {})",
        venv.display(),
        requirements.display()
    );
    let venv_str = path_str(&venv)?;
    let system_python = ["python3", "python"]
        .into_iter()
        .find(|p| crate::which(p))
        .context("the manifest check needs Python 3 (python3 with venv and pip)")?;
    if crate::run(system_python, &["-m", "venv", "--clear", venv_str]).is_err() {
        // Debian's python3 makes venvs only with python3-venv installed.
        eprintln!(
            "xtask: `{system_python} -m venv` failed; trying Debian's python3 with python3-venv"
        );
        crate::ensure_packages(&[("python3-venv", "venvs for the manifest check")], |_| {
            Command::new("/usr/bin/python3")
                .args(["-c", "import ensurepip"])
                .status()
                .is_ok_and(|s| s.success())
        })?;
        crate::run("/usr/bin/python3", &["-m", "venv", "--clear", venv_str])?;
    }
    crate::run(
        path_str(&venv.join("bin/pip"))?,
        &[
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--requirement",
            path_str(&requirements)?,
        ],
    )?;
    std::fs::write(&installed, pins).with_context(|| format!("writing {}", installed.display()))?;
    Ok(python)
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}
