//! `lock`: one agent per node. An exclusive `flock` on a file under the
//! runtime directory, held for the agent's life, so a second agent fails
//! with a clear message instead of attaching the probes twice.
//!
//! It never removes the file (a stale file is harmless: the kernel drops the
//! lock when its holder dies).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Default lock path.
///
/// Not inside the runtime directory: that one is writable by every user's
/// jobs (mode 1777), and a user who created the lock file first could keep
/// the agent from starting.
pub const DEFAULT_LOCK_FILE: &str = "/run/ringwatch-agent.lock";

/// Held while the agent runs; released on drop (or death).
#[derive(Debug)]
pub struct AgentLock {
    _file: File,
    path: PathBuf,
}

impl AgentLock {
    /// Takes the lock or says who holds it.
    pub fn acquire(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the runtime directory {}", dir.display()))?;
        }
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        // Never through a symlink, and only a file of our own user: a lock
        // file planted by someone else could point the pid we write at
        // another file, or hold the lock to keep the agent out.
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .with_context(|| format!("opening the agent lock file {}", path.display()))?;
        let owner = file
            .metadata()
            .with_context(|| format!("reading the agent lock file {}", path.display()))?
            .uid();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if owner != me {
            bail!(
                "the agent lock file {} belongs to uid {owner}, not to the agent's user ({me}); \
                 remove it, or give the agent its own --lock-file",
                path.display()
            );
        }
        // SAFETY: flock on a valid, owned descriptor.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            let holder = std::fs::read_to_string(path).unwrap_or_default();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                bail!(
                    "another ringwatch-agent is already running on this node (pid {}, lock {}); stop it first, or give this one its own --lock-file",
                    holder.trim(),
                    path.display()
                );
            }
            return Err(err).with_context(|| format!("locking {}", path.display()));
        }
        use std::io::{Seek, Write};
        file.set_len(0).ok();
        file.seek(std::io::SeekFrom::Start(0)).ok();
        let _ = writeln!(file, "{}", std::process::id());
        Ok(Self {
            _file: file,
            path: path.to_owned(),
        })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_drops() {
        let dir = std::env::temp_dir().join(format!("rw-lock-test-{}", std::process::id()));
        let path = dir.join("agent.lock");
        let first = AgentLock::acquire(&path).unwrap();
        // flock locks belong to the open file description: a second open
        // in the same process conflicts like another process would.
        let err = AgentLock::acquire(&path).unwrap_err().to_string();
        assert!(err.contains("already running"), "{err}");
        drop(first);
        let again = AgentLock::acquire(&path).unwrap();
        assert_eq!(again.path(), path);
        drop(again);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_planted_symlink_or_a_foreign_lock_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("rw-lock-plant-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("precious");
        std::fs::write(&target, b"keep me").unwrap();
        let link = dir.join("agent.lock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(AgentLock::acquire(&link).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let foreign = dir.join("foreign.lock");
            std::fs::write(&foreign, b"").unwrap();
            std::os::unix::fs::chown(&foreign, Some(65534), None).unwrap();
            let err = AgentLock::acquire(&foreign).unwrap_err().to_string();
            assert!(err.contains("uid 65534"), "{err}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
