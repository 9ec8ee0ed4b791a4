//! `cargo xtask python`: the Python package `ringwatch` (`collectives/python`,
//! `import ringwatch.torch`) built and installed into `target/python-venv`,
//! and its tests.
//!
//! The venv is Debian's python3 with its system packages visible, so that
//! Debian's python3-torch is the torch the package is built and tested
//! against; maturin and pytest are pinned from PyPI
//! (`collectives/python/requirements-dev.txt`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::venv::path_str;

/// Debian packages of the Python front end, with what each is for.
pub const APT_PACKAGES: &[(&str, &str)] = &[
    (
        "python3-torch",
        "PyTorch for the Python front end's tests (ringwatch.torch)",
    ),
    (
        "python3-dev",
        "libpython, which the PyO3 extension links in cargo's own builds",
    ),
    (
        "python3-venv",
        "the virtual environment the Python package is installed into",
    ),
    (
        "python3-torchvision",
        "the model of examples/pytorch/train.py, which the README runs",
    ),
];

/// Whether one of [`APT_PACKAGES`] is there.
pub fn package_present(package: &str) -> bool {
    let python = |code: &str| {
        Command::new("/usr/bin/python3")
            .args(["-c", code])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    match package {
        "python3-torch" => python("import torch"),
        "python3-torchvision" => python("import torchvision"),
        "python3-dev" => python(
            "import sysconfig, os, sys; \
             d = sysconfig.get_config_var('LIBDIR'); \
             n = sysconfig.get_config_var('LDLIBRARY'); \
             sys.exit(0 if os.path.exists(os.path.join(d, n)) else 1)",
        ),
        "python3-venv" => python("import ensurepip"),
        _ => false,
    }
}

/// Options of `cargo xtask python`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Build the extension optimized (cargo's release profile: several minutes
    /// cold) instead of the dev profile, whose runtime code is optimized anyway.
    #[arg(long)]
    pub release: bool,
    /// Then run the package's tests (pytest, collectives/python/tests).
    #[arg(long)]
    pub test: bool,
}

/// `cargo xtask python`.
pub fn run(root: &Path, target_dir: &Path, args: &Args) -> Result<()> {
    let venv = install(root, target_dir, args.release)?;
    if args.test {
        // The agent's dev build, when there is one (the test that needs it skips otherwise).
        let agent = target_dir.join("debug/ringwatch-agent");
        test(root, &venv, agent.is_file().then_some(agent.as_path()))?;
    }
    println!(
        "ringwatch.torch is installed in {}: `source {}/bin/activate`, then `import ringwatch.torch as rw`",
        venv.display(),
        venv.display()
    );
    Ok(())
}

/// Makes the venv (first time) and builds the package into it with `maturin develop`.
pub fn install(root: &Path, target_dir: &Path, release: bool) -> Result<PathBuf> {
    crate::ensure_packages(APT_PACKAGES, package_present)?;
    let venv = crate::venv::pinned_over_system(
        root,
        target_dir,
        "collectives/python/requirements-dev.txt",
        "python-venv",
        "maturin and pytest",
    )?;
    let mut maturin = Command::new(venv.join("bin/maturin"));
    maturin
        .args([
            "develop",
            "--manifest-path",
            "collectives/python/Cargo.toml",
        ])
        .env("VIRTUAL_ENV", &venv)
        .env("PATH", path_with(&venv)?)
        .current_dir(root);
    if release {
        maturin.arg("--release");
    }
    eprintln!(
        "xtask: $ {}/bin/maturin develop --manifest-path collectives/python/Cargo.toml{}",
        venv.display(),
        if release { " --release" } else { "" }
    );
    let status = maturin.status().context("could not start maturin")?;
    if !status.success() {
        bail!("maturin develop failed ({status})");
    }
    Ok(venv)
}

/// The package's tests, with the venv's pytest. `agent`: the agent binary for the test
/// in which the agent tunes a PyTorch job (`None`: that test skips, saying so).
pub fn test(root: &Path, venv: &Path, agent: Option<&Path>) -> Result<()> {
    let python = venv.join("bin/python");
    if let Some(agent) = agent
        && !agent.is_file()
    {
        bail!("{} is missing (cargo build -p agent)", agent.display());
    }
    eprintln!(
        "xtask: $ {} -m pytest -q collectives/python/tests",
        python.display()
    );
    let mut pytest = Command::new(&python);
    pytest
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "collectives/python/tests",
        ])
        .current_dir(root);
    if let Some(agent) = agent {
        pytest.env("RINGWATCH_AGENT_BIN", agent);
        // The NCCL profiler plugin the same build made (its GPU test).
        let plugin = agent.with_file_name("libringwatch_nccl_profiler.so");
        if plugin.is_file() {
            pytest.env("RINGWATCH_NCCL_PROFILER_LIB", plugin);
        }
    }
    let status = pytest
        .status()
        .with_context(|| format!("could not start {}", python.display()))?;
    if !status.success() {
        bail!("the Python package's tests failed ({status})");
    }
    Ok(())
}

/// `PATH` with the venv's `bin` first (maturin calls pip and python by name).
fn path_with(venv: &Path) -> Result<String> {
    let bin = venv.join("bin");
    Ok(match std::env::var("PATH") {
        Ok(path) if !path.is_empty() => format!("{}:{path}", path_str(&bin)?),
        _ => path_str(&bin)?.to_string(),
    })
}
