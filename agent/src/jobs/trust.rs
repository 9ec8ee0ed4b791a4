//! `trust`: what the agent believes of a control socket and of the job behind
//! it. The agent runs as root next to the jobs of many users; a job's `hello`
//! is only words, so what decides is what the kernel says.
//!
//! - A runtime directory is scanned only if it is a real directory (not a
//!   symlink) that no user can use to tamper with another's sockets: owned
//!   by root or by the agent's own user and not writable by others unless
//!   it has the sticky bit (as `/tmp` has), or owned by one other user and
//!   writable by that user alone (a user's `/tmp/ringwatch-<uid>`).
//! - A socket is used only if its directory is owned by root or by the
//!   socket's owner, and the process serving it (`SO_PEERCRED`) runs as the
//!   socket's owner.
//! - A rank's pid is watched only if that process runs as the job's user
//!   (the server's uid); a job served by root may name any process.
//!
//! It must never follow what a job says about other users' processes, and
//! never trust a path because of its name.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use collectives::control::PeerCredentials;

/// Why a runtime directory may not be scanned; `Ok` when it may.
pub fn check_runtime_dir(dir: &Path, agent_uid: u32) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot stat it: {e}"))?;
    if meta.file_type().is_symlink() {
        return Err("it is a symbolic link".to_owned());
    }
    if !meta.is_dir() {
        return Err("it is not a directory".to_owned());
    }
    let mode = meta.permissions().mode();
    if meta.uid() != 0 && meta.uid() != agent_uid {
        // One user's own directory: only that user may add sockets
        // ([`check_socket`] then wants them to be that user's).
        if mode & 0o022 != 0 {
            return Err(format!(
                "it is owned by uid {} and others may write to it (mode {:o})",
                meta.uid(),
                mode & 0o7777
            ));
        }
        return Ok(());
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "it is writable by others (mode {:o}) without the sticky bit: anyone could replace \
             a job's socket; chmod +t it or make it 0755",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Why the socket at `socket` served by `peer` may not be taken for a job;
/// `Ok` when it may. `dir_uid` owns the directory it is in.
pub fn check_socket(socket: &Path, dir_uid: u32, peer: PeerCredentials) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(socket).map_err(|e| format!("cannot stat it: {e}"))?;
    let owner = meta.uid();
    if dir_uid != 0 && dir_uid != owner {
        return Err(format!(
            "its directory belongs to uid {dir_uid}, neither root nor the socket's owner (uid {owner})"
        ));
    }
    if peer.uid != owner {
        return Err(format!(
            "it is owned by uid {owner} but served by pid {} running as uid {}",
            peer.pid, peer.uid
        ));
    }
    Ok(())
}

/// Whether process `pid` may be watched for a job served as `job_uid`: root's
/// jobs may name any process, others only processes that run wholly as their
/// own user (real, effective, saved and filesystem uid alike, as ptrace's
/// check: a setuid program a user started is not that user's). `Err` says
/// why not.
pub fn check_rank_pid(pid: u32, job_uid: u32) -> Result<(), String> {
    if job_uid == 0 {
        return Ok(());
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read /proc/{pid}/status: {e}"))?;
    let uids = process_uids(&status).ok_or_else(|| format!("no Uid line for pid {pid}"))?;
    if uids.iter().all(|&uid| uid == job_uid) {
        Ok(())
    } else {
        Err(format!(
            "pid {pid} runs as uids {uids:?} (real, effective, saved, filesystem) but the \
             job's socket is served by uid {job_uid}"
        ))
    }
}

/// The real, effective, saved and filesystem uid of a `/proc/<pid>/status`
/// text.
fn process_uids(status: &str) -> Option<[u32; 4]> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut fields = line.split_whitespace().map(str::parse::<u32>);
    let mut uids = [0; 4];
    for uid in &mut uids {
        *uid = fields.next()?.ok()?;
    }
    Some(uids)
}

/// Creates the agent's runtime directory if it is missing, root-owned and
/// mode 1777 (writable by every user's jobs, each socket removable only by
/// its owner, as `/tmp`), and checks it either way.
pub fn ensure_runtime_dir(dir: &Path, agent_uid: u32) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if std::fs::symlink_metadata(dir).is_err() {
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create its parent: {e}"))?;
        }
        // Only a directory this call made is changed: `create` fails if
        // anything (a planted symlink) took the name meanwhile, and the mode
        // is set through a descriptor of the directory itself.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create it: {e}"))?;
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(dir)
            .map_err(|e| format!("cannot open it: {e}"))?;
        let mode = if agent_uid == 0 { 0o1777 } else { 0o700 };
        opened
            .set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("cannot set its mode: {e}"))?;
        tracing::info!(dir = %dir.display(), mode = format!("{mode:o}"), "created the runtime directory");
    }
    check_runtime_dir(dir, agent_uid)
}

/// The agent's effective uid.
pub fn agent_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TempDir(std::path::PathBuf);
    impl TempDir {
        fn new(what: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "ringwatch-trust-{what}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn world_writable_directories_need_the_sticky_bit() {
        let me = agent_uid();
        let dir = TempDir::new("modes");
        chmod(&dir.0, 0o755);
        assert_eq!(check_runtime_dir(&dir.0, me), Ok(()));
        chmod(&dir.0, 0o777);
        let why = check_runtime_dir(&dir.0, me).unwrap_err();
        assert!(why.contains("sticky"), "{why}");
        chmod(&dir.0, 0o1777);
        assert_eq!(check_runtime_dir(&dir.0, me), Ok(()));
        chmod(&dir.0, 0o775);
        assert!(check_runtime_dir(&dir.0, me).is_err());
    }

    #[test]
    fn a_symlink_or_a_file_is_not_a_runtime_directory() {
        let me = agent_uid();
        let dir = TempDir::new("links");
        let link = dir.0.join("link");
        std::os::unix::fs::symlink(&dir.0, &link).unwrap();
        assert!(
            check_runtime_dir(&link, me)
                .unwrap_err()
                .contains("symbolic")
        );
        let file = dir.0.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(
            check_runtime_dir(&file, me)
                .unwrap_err()
                .contains("not a directory")
        );
    }

    #[test]
    fn a_directory_of_another_user_is_scanned_only_if_that_user_alone_writes_it() {
        if agent_uid() != 0 {
            eprintln!("skipped: needs root to chown");
            return;
        }
        let dir = TempDir::new("owner");
        chmod(&dir.0, 0o755);
        std::os::unix::fs::chown(&dir.0, Some(65534), None).unwrap();
        assert_eq!(check_runtime_dir(&dir.0, 0), Ok(()));
        for mode in [0o775, 0o1777, 0o757] {
            chmod(&dir.0, mode);
            let why = check_runtime_dir(&dir.0, 0).unwrap_err();
            assert!(why.contains("uid 65534"), "{why}");
        }
    }

    #[test]
    fn the_runtime_directory_is_made_sticky_and_world_writable_by_root() {
        let dir = TempDir::new("ensure");
        let made = dir.0.join("run").join("ringwatch");
        ensure_runtime_dir(&made, agent_uid()).unwrap();
        let mode = std::fs::metadata(&made).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, if agent_uid() == 0 { 0o1777 } else { 0o700 });
        // A symlink in its place is refused, and what it points to untouched.
        let target = dir.0.join("target");
        std::fs::create_dir(&target).unwrap();
        chmod(&target, 0o755);
        let link = dir.0.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(ensure_runtime_dir(&link, agent_uid()).is_err());
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o755);
    }

    #[test]
    fn a_socket_must_be_served_by_its_owner() {
        let me = agent_uid();
        let dir = TempDir::new("socket");
        let path = dir.0.join("job.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mine = PeerCredentials {
            pid: std::process::id(),
            uid: me,
            gid: 0,
        };
        assert_eq!(check_socket(&path, me, mine), Ok(()));
        let other = PeerCredentials {
            uid: me + 1,
            ..mine
        };
        assert!(
            check_socket(&path, me, other)
                .unwrap_err()
                .contains("served by")
        );
        // A directory owned by someone else than root and the socket's owner.
        assert!(
            check_socket(&path, 12_345, mine)
                .unwrap_err()
                .contains("12345")
        );
    }

    #[test]
    fn ranks_must_run_as_the_jobs_user() {
        let me = agent_uid();
        let pid = std::process::id();
        // Root's jobs may name anything; a job of our own user may name us.
        assert_eq!(check_rank_pid(1, 0), Ok(()));
        assert_eq!(check_rank_pid(pid, me), Ok(()));
        if me == 0 {
            // pid 1 runs as root: a job of uid 65534 may not name it.
            let why = check_rank_pid(1, 65534).unwrap_err();
            assert!(why.contains("pid 1 runs as uids [0, 0, 0, 0]"), "{why}");
        }
        assert!(check_rank_pid(u32::MAX - 1, 65534).is_err());
    }

    #[test]
    fn uids_are_read_from_the_status_text() {
        let status = "Name:\tx\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\t5\t5\t5\n";
        assert_eq!(process_uids(status), Some([1000, 1001, 1002, 1003]));
        assert_eq!(process_uids("Name:\tx\n"), None);
    }
}
