//! How the BPF object is compiled: one definition, used by `ebpf/build.rs`
//! (every cargo build of the agent) and by `cargo xtask build-ebpf`.
//!
//! Must stay dependency-free (it is `#[path]`-included into a build script).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The translation unit that includes every `*.bpf.c` concern file.
pub const BPF_MAIN_SOURCE: &str = "ringwatch.bpf.c";

/// What to install when the toolchain is missing (Debian/Ubuntu).
pub const INSTALL_HINT: &str =
    "apt-get install -y clang libbpf-dev (or run `cargo xtask setup` as root)";

/// The compiler: `$CLANG` if set, else `clang` on the PATH.
pub fn clang() -> PathBuf {
    std::env::var_os("CLANG").map_or_else(|| PathBuf::from("clang"), PathBuf::from)
}

/// Checks clang and the libbpf headers are present; the error is one line
/// that says what to install.
pub fn check_toolchain() -> Result<(), String> {
    let clang = clang();
    match Command::new(&clang).arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(_) | Err(_) => {
            return Err(format!(
                "clang not found (looked for `{}`): it compiles ringwatch's BPF programs; install it: {INSTALL_HINT}",
                clang.display()
            ));
        }
    }
    if !Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        return Err(format!(
            "libbpf headers not found (/usr/include/bpf/bpf_helpers.h): install them: {INSTALL_HINT}"
        ));
    }
    Ok(())
}

/// The kernel's name for an architecture, as `__TARGET_ARCH_*` wants it,
/// and Debian's multiarch include directory, from Rust's `target_arch`.
fn arch_names(target_arch: &str) -> Result<(&'static str, &'static str), String> {
    match target_arch {
        "x86_64" => Ok(("x86", "x86_64-linux-gnu")),
        "aarch64" => Ok(("arm64", "aarch64-linux-gnu")),
        other => Err(format!(
            "ringwatch's BPF programs are not built for target_arch {other}"
        )),
    }
}

/// Compiles `<ebpf_dir>/ringwatch.bpf.c` to `out` (`-O2 -g -target bpf`, with
/// BTF for CO-RE). The error carries clang's own diagnostics.
pub fn compile_bpf(ebpf_dir: &Path, out: &Path, target_arch: &str) -> Result<(), String> {
    check_toolchain()?;
    let (kernel_arch, multiarch) = arch_names(target_arch)?;
    let output = Command::new(clang())
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .arg(format!("-D__TARGET_ARCH_{kernel_arch}"))
        .arg("-I")
        .arg(ebpf_dir.join("include"))
        .arg(format!("-I/usr/include/{multiarch}"))
        .arg("-c")
        .arg(ebpf_dir.join(BPF_MAIN_SOURCE))
        .arg("-o")
        .arg(out)
        .output()
        .map_err(|e| format!("could not run clang: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "clang failed to compile {}:\n{}",
            ebpf_dir.join(BPF_MAIN_SOURCE).display(),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// Compiles and runs `tools/layout_probe.c` on the host; it prints the C
/// layout of every shared record as Rust source (see `ebpf/src/lib.rs`).
pub fn c_layout_source(ebpf_dir: &Path, out_dir: &Path) -> Result<String, String> {
    let probe = out_dir.join("layout_probe");
    let output = Command::new(clang())
        .arg("-I")
        .arg(ebpf_dir.join("include"))
        .arg(ebpf_dir.join("tools/layout_probe.c"))
        .arg("-o")
        .arg(&probe)
        .output()
        .map_err(|e| format!("could not run clang: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "clang failed to compile the layout probe:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let run = Command::new(&probe)
        .output()
        .map_err(|e| format!("could not run {}: {e}", probe.display()))?;
    if !run.status.success() {
        return Err(format!("{} failed", probe.display()));
    }
    String::from_utf8(run.stdout).map_err(|e| format!("layout probe printed non-UTF-8: {e}"))
}
