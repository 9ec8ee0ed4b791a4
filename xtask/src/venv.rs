//! Python tools pinned in a requirements file, each in its own virtual
//! environment under `target/` (Schemathesis, kubernetes-validate): made on
//! first use, reused while the pins are unchanged, so the suite runs
//! offline after the first install.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

/// Makes (or reuses) `target_dir/<name>` with the packages pinned in
/// `root/<requirements>`; returns the venv's directory. `what` names the
/// tool in messages (`schemathesis`, `kubernetes-validate`).
pub fn pinned(
    root: &Path,
    target_dir: &Path,
    requirements: &str,
    name: &str,
    what: &str,
) -> Result<PathBuf> {
    make(root, target_dir, requirements, name, what, false)
}

/// As [`pinned`], over Debian's `/usr/bin/python3` with its system packages
/// visible (`--system-site-packages`): for tools that need Debian's
/// python3-torch beside the pinned ones.
pub fn pinned_over_system(
    root: &Path,
    target_dir: &Path,
    requirements: &str,
    name: &str,
    what: &str,
) -> Result<PathBuf> {
    make(root, target_dir, requirements, name, what, true)
}

fn make(
    root: &Path,
    target_dir: &Path,
    requirements: &str,
    name: &str,
    what: &str,
    system: bool,
) -> Result<PathBuf> {
    let requirements = root.join(requirements);
    let pins = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let venv = target_dir.join(name);
    let installed = venv.join("installed-requirements.txt");
    if venv.join("bin/python").is_file()
        && std::fs::read_to_string(&installed).is_ok_and(|done| done == pins)
    {
        return Ok(venv);
    }
    eprintln!(
        "xtask: installing {what} from PyPI into {} (pinned in {})",
        venv.display(),
        requirements.display()
    );
    let python = if system {
        "/usr/bin/python3"
    } else {
        ["python3", "python"]
            .into_iter()
            .find(|p| crate::which(p))
            .with_context(|| format!("{what} needs Python 3 (python3 with venv and pip)"))?
    };
    let mut venv_args = vec!["-m", "venv", "--clear"];
    if system {
        venv_args.push("--system-site-packages");
    }
    venv_args.push(path_str(&venv)?);
    if crate::run(python, &venv_args).is_err() {
        // Debian's python3 makes venvs only with python3-venv installed.
        eprintln!("xtask: `{python} -m venv` failed; trying Debian's python3 with python3-venv");
        crate::ensure_packages(
            &[("python3-venv", "virtual environments for Python tools")],
            |_| {
                Command::new("/usr/bin/python3")
                    .args(["-c", "import ensurepip"])
                    .status()
                    .is_ok_and(|s| s.success())
            },
        )?;
        crate::run("/usr/bin/python3", &venv_args)?;
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
    Ok(venv)
}

/// `path` as UTF-8, or an error naming it.
pub fn path_str(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}
