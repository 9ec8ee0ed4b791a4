//! Compiles the BPF programs with clang so the agent can embed the object.
//! A missing toolchain is one clear error line, not a wall of text.

#[path = "build_support.rs"]
mod build_support;

use std::path::PathBuf;

fn main() {
    let ebpf_dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target_arch =
        std::env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    for path in [
        "ringwatch.bpf.c",
        "maps.bpf.h",
        "include",
        "tools",
        "build_support.rs",
    ] {
        println!("cargo::rerun-if-changed={path}");
    }
    for entry in std::fs::read_dir(&ebpf_dir)
        .expect("ebpf/ is readable")
        .flatten()
    {
        if entry.file_name().to_string_lossy().ends_with(".bpf.c") {
            println!("cargo::rerun-if-changed={}", entry.path().display());
        }
    }
    println!("cargo::rerun-if-env-changed=CLANG");

    let object = out_dir.join("ringwatch.bpf.o");
    if let Err(message) = build_support::compile_bpf(&ebpf_dir, &object, &target_arch) {
        fail(&message);
    }
    match build_support::c_layout_source(&ebpf_dir, &out_dir) {
        Ok(source) => {
            std::fs::write(out_dir.join("c_layout.rs"), source).expect("OUT_DIR is writable");
        }
        Err(message) => fail(&message),
    }
}

fn fail(message: &str) -> ! {
    // Only the first line goes into `cargo::error` (one line per directive);
    // clang's diagnostics follow as warnings so nothing is hidden.
    let mut lines = message.lines();
    println!(
        "cargo::error={}",
        lines.next().unwrap_or("BPF build failed")
    );
    for line in lines {
        println!("cargo::warning={line}");
    }
    // `cargo::error` already fails the build; exiting 0 keeps cargo from
    // dumping the script's whole output a second time.
    std::process::exit(0);
}
