//! The segment file: which ranks share a host ([`host_key`]), creating the segment in
//! `/dev/shm` (removing ones whose creator died), and mapping it into a group.
//!
//! It must never map a segment it cannot check is the announced one (magic, nonce, sizes).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memmap2::MmapOptions;

use super::ShmGroup;
use super::arena::{ArenaFree, fallocate};
use super::fold::Chunks;
use super::layout::{Layout, PAGE, SEGMENT_MAGIC, SPINS, SegmentHeader};

// ---------------------------------------------------------------------------------------
// Host identity and segments

/// What ranks must share to share memory: the boot, the network namespace (pretend nodes
/// in separate namespaces stay separate hosts) and the mount namespace (the same
/// `/dev/shm`). `RINGWATCH_HOST_ID`, if set, is added: ranks with different values never
/// share memory (a way to split one machine into hosts for tests). `None` if any part
/// cannot be read; such a rank uses TCP only.
pub fn host_key() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let net = std::fs::read_link("/proc/self/ns/net").ok()?;
    let mnt = std::fs::read_link("/proc/self/ns/mnt").ok()?;
    let extra = std::env::var("RINGWATCH_HOST_ID").unwrap_or_default();
    Some(format!(
        "{}|{}|{}|{extra}",
        boot.trim(),
        net.display(),
        mnt.display()
    ))
}

/// Where segments are created.
pub const SHM_DIR: &str = "/dev/shm";

/// A segment file created by a group's first rank, removed from the directory as soon as
/// every member has mapped it (or on drop), so nothing is left behind after a crash.
#[derive(Debug)]
pub struct SegmentFile {
    pub(super) path: PathBuf,
    pub(super) file: File,
    pub(super) nonce: u64,
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub(super) fn random_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

pub(super) fn segment_name(job_id: &str, nonce: u64) -> String {
    let job: String = job_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    format!("ringwatch-{job}-{}-{nonce:016x}", std::process::id())
}

/// The creator's pid in a segment file's name (`ringwatch-<job>-<pid>-<nonce>`).
pub(super) fn creator_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("ringwatch-")?;
    let (before_nonce, nonce) = rest.rsplit_once('-')?;
    if nonce.len() != 16 || !nonce.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    before_nonce.rsplit_once('-')?.1.parse().ok()
}

/// Removes segment files whose creator is gone. A segment's name lives only between its
/// creation and the end of the start-up handshake; a file left behind means its creator
/// died in between, and it would hold its memory until the next boot.
pub(super) fn remove_orphans(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(creator_pid) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::remove_file(entry.path()).is_ok()
        {
            tracing::info!(path = %entry.path().display(), "removed a shared-memory segment whose creator is gone");
        }
    }
}

/// Creates and initializes a segment for `members` ranks in `dir`, reserving its memory
/// now (so a full `/dev/shm` is an error here, not a SIGBUS later).
pub fn create_segment(
    dir: &std::path::Path,
    job_id: &str,
    members: usize,
    ring_bytes: usize,
    arena_bytes: usize,
) -> std::io::Result<SegmentFile> {
    let layout = Layout {
        members,
        ring_bytes,
        arena_bytes: arena_bytes / PAGE * PAGE,
    };
    remove_orphans(dir);
    let nonce = random_nonce();
    let path = dir.join(segment_name(job_id, nonce));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    let segment = SegmentFile { path, file, nonce };
    segment.file.set_len(layout.total() as u64)?;
    let reserve = |offset: usize, len: usize| fallocate(&segment.file, 0, offset, len);
    reserve(0, layout.data_start())?;
    for src in 0..members {
        for dst in (0..members).filter(|&d| d != src) {
            reserve(layout.ring_data(src, dst), ring_bytes)?;
        }
    }
    reserve(layout.slot(0, 0), 2 * members * ring_bytes)?;
    // The arenas stay sparse: shared tensors reserve their pages when allocated.
    let map = MmapOptions::new()
        .len(layout.data_start())
        .map_raw(&segment.file)?;
    // SAFETY: offset 0 of a fresh, page-aligned mapping that nobody else has yet.
    let header = unsafe { &*(map.as_mut_ptr() as *const SegmentHeader) };
    header.members.store(members as u64, Ordering::Relaxed);
    header
        .ring_bytes
        .store(ring_bytes as u64, Ordering::Relaxed);
    header.nonce.store(nonce, Ordering::Relaxed);
    header
        .arena_bytes
        .store(layout.arena_bytes as u64, Ordering::Relaxed);
    header.magic.store(SEGMENT_MAGIC, Ordering::Release);
    Ok(segment)
}

impl SegmentFile {
    /// The file's path (sent to the other members).
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
    /// The nonce the other members check after mapping.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }
}

/// Maps the segment at `path` as member `me` of `ranks`, checking that it is the one
/// announced (`nonce`) and laid out as expected (rings of `ring_bytes`, arenas of
/// `arena_bytes`).
pub fn map_segment(
    path: &std::path::Path,
    nonce: u64,
    ranks: &[usize],
    me: usize,
    ring_bytes: usize,
    arena_bytes: usize,
    timeout: Duration,
) -> std::result::Result<ShmGroup, String> {
    let layout = Layout {
        members: ranks.len(),
        ring_bytes,
        arena_bytes: arena_bytes / PAGE * PAGE,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .len();
    if len != layout.total() as u64 {
        return Err(format!(
            "{} has {len} bytes, expected {}",
            path.display(),
            layout.total()
        ));
    }
    let map = MmapOptions::new()
        .len(layout.total())
        .map_raw(&file)
        .map_err(|e| format!("cannot map {}: {e}", path.display()))?;
    let group = ShmGroup {
        map: Arc::new(map),
        file: Arc::new(file),
        arena: Arc::new(Mutex::new(ArenaFree::new(layout.arena_bytes))),
        in_place: AtomicU64::new(0),
        layout,
        ranks: ranks.to_vec(),
        active: vec![true; ranks.len()],
        me,
        timeout,
        tx: (0..ranks.len()).map(|_| Mutex::default()).collect(),
        rx: (0..ranks.len()).map(|_| Mutex::default()).collect(),
        chunks: Mutex::new(Chunks::default()),
        posts: Mutex::new(0),
        spread: std::thread::available_parallelism().is_ok_and(|cores| ranks.len() <= cores.get()),
        move_every: super::waiting::MOVE_EVERY,
        spins: AtomicU32::new(SPINS),
    };
    let header = group.header();
    let ok = header.magic.load(Ordering::Acquire) == SEGMENT_MAGIC
        && header.nonce.load(Ordering::Relaxed) == nonce
        && header.members.load(Ordering::Relaxed) == ranks.len() as u64
        && header.ring_bytes.load(Ordering::Relaxed) == ring_bytes as u64
        && header.arena_bytes.load(Ordering::Relaxed) == group.layout.arena_bytes as u64;
    if !ok {
        return Err(format!(
            "{} is not the segment that was announced",
            path.display()
        ));
    }
    Ok(group)
}

impl ShmGroup {
    /// Keeps only the members in `active` (those that mapped the segment).
    pub fn restrict(&mut self, active: &[usize]) {
        self.active = self.ranks.iter().map(|r| active.contains(r)).collect();
    }
}
