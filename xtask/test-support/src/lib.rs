//! Helpers shared by the integration tests of `agent` and `collectives`
//! (a dev-dependency only; nothing here ships).
//!
//! Invariants: this crate knows nothing about ringwatch's own crates (no
//! dependency on them), so any crate's tests can use it; it only waits,
//! picks ports and makes scratch directories, and never asserts a test's
//! meaning: the tests keep their own assertions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// How often [`eventually`] asks again.
const POLL_PERIOD: Duration = Duration::from_millis(50);

/// Polls `check` every 50 ms until it returns `Some`, and returns that value.
///
/// `timeout` is a hang guard, not a timing assertion: when `check` has not
/// held within it, the test fails with a message naming `what` and the
/// timeout instead of hanging. `check` runs at least once, and once more at
/// the deadline.
#[track_caller]
pub fn eventually<T>(timeout: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    eventually_reporting(timeout, what, || check().ok_or("it did not hold"))
}

/// Like [`eventually`], for a `check` that says what it saw instead
/// (`Err(seen)`): when it never holds, the failure shows the last `seen`
/// (the session, the listing, the state) beside `what` and the timeout.
#[track_caller]
pub fn eventually_reporting<T, Seen: std::fmt::Display>(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<T, Seen>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let past_deadline = Instant::now() > deadline;
        match check() {
            Ok(value) => return value,
            Err(seen) => assert!(
                !past_deadline,
                "{what}: not within {timeout:?}; last seen: {seen}"
            ),
        }
        std::thread::sleep(POLL_PERIOD);
    }
}

/// A free TCP port on 127.0.0.1, below the kernel's ephemeral range (32768
/// and up): one the kernel handed out and gave back can go to any outgoing
/// connection of the tests running beside this one before the job binds it.
pub fn free_port() -> u16 {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .subsec_nanos()
        ^ std::process::id().wrapping_mul(2_654_435_761);
    (0..64u32)
        .map(|i| 20_000 + (seed.wrapping_add(i.wrapping_mul(7_919)) % 12_000) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port in 20000..32000")
}

/// A scratch directory of its own under the system's temporary directory,
/// created empty and removed (with its contents) on drop, so a failing test
/// leaves nothing behind.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `ringwatch-<name>-<pid>-<n>`: unique among the tests of this
    /// process (they run in parallel) and of other test processes.
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ringwatch-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // A directory left by an earlier process with the same pid.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        Self(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The machine (its cores), shared by the tests of one test binary: tests
/// that run jobs side by side take it shared ([`share_the_machine`]), one
/// whose counts the other tests' load would disturb takes it alone
/// ([`have_the_machine_alone`]). Each test binary is its own process, with
/// its own lock.
static MACHINE: RwLock<()> = RwLock::new(());

/// Holds the machine shared with the other tests that share it, until the
/// guard drops; waits while a test has it alone.
pub fn share_the_machine() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// Holds the machine alone (no test that shares it runs) until the guard
/// drops: for a test that counts events other tests' load would add to.
pub fn have_the_machine_alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `ip ARGS…` (iproute2; network namespaces, links, routes) and fails
/// the test, with `ip`'s error output, when it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
