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

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Validates the manifest and runs the check's self-test.
pub fn run(root: &Path, target_dir: &Path) -> Result<()> {
    let python = crate::venv::pinned(
        root,
        target_dir,
        "deploy/requirements.txt",
        "kubernetes-validate",
        "kubernetes-validate",
    )?
    .join("bin/python");
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
