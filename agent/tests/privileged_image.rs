//! Privileged: the agent's offline OCI image (deploy/Containerfile.local,
//! FROM scratch with this build's binary and its libraries), run the way the
//! DaemonSet runs it — not privileged, `--cap-drop=all` plus the least
//! capabilities measured in deploy/CAPABILITIES.md, `--pid=host`, read-only
//! root, BTF, tracefs and the jobs' runtime directory read-only, a writable
//! reports directory — traces a 2-rank collbench job started on the host: the
//! container's API lists the job with its ranks' host pids, the ranks' TCP
//! bytes equal the kernel's tcp_info counts, their thread states are on
//! /api/timeline, and /api/health answers. The check itself is
//! `cargo xtask image --run`'s (xtask/src/image.rs, shared through
//! `#[path]`). Skips, saying why, when not root, without BTF, or without
//! podman and runc. The container, the image and the job are removed on every
//! path.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "../../xtask/src/image.rs"]
#[allow(dead_code)] // `cargo xtask image`'s own entry point and flags
mod image;

use std::time::Instant;

use common::{AGENT, skip_unless_privileged};
use test_support::TempDir;

#[test]
fn the_image_traces_a_host_job_with_the_least_capabilities() {
    if skip_unless_privileged() {
        return;
    }
    if let Some(why) = image::engine_missing() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let collbench = common::procs::collbench();
    let suffix = image::unique_suffix();
    let dir = TempDir::new(&format!("image-test-{suffix}"));

    // The image, from the binary this test build made (no nested cargo build).
    let started = Instant::now();
    let context = dir.path().join("context");
    let containerfile = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/Containerfile.local");
    image::stage_context(
        std::path::Path::new(AGENT),
        std::path::Path::new(containerfile),
        &context,
    )
    .unwrap();
    let tag = format!("localhost/ringwatch-agent-test:{suffix}");
    let _image = image::ImageGuard(tag.clone());
    image::build_image(&context, &tag).unwrap();
    let size = image::image_size(&tag).unwrap();
    eprintln!(
        "image {tag}: {:.1} MB, built in {:.1} s",
        size as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    // The context holds a ~160 MB copy (or link) of the binary: gone now.
    let _ = std::fs::remove_dir_all(&context);

    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let report = image::check(&image::CheckOptions {
        image: tag,
        collbench,
        work,
        verbose: true,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{report}");
    assert_eq!(report.tcp.len(), 2, "{report}");
    assert!(
        report.tcp.values().all(|&(tx, rx)| tx > 0 && rx > 0),
        "{report}"
    );
    assert!(report.thread_states.values().all(|&n| n > 0), "{report}");
}
