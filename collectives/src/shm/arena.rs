//! Each member's arena of shared tensors: free ranges, page reservation and release
//! (`fallocate`), and the [`SharedLease`] that a shared tensor holds.
//!
//! It must never hand out memory that is not zeroed, nor pages the system did not reserve.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use memmap2::MmapRaw;

use super::ShmGroup;
use super::layout::ARENA_GRANULE;

/// The free ranges of a member's arena (offsets from its start), sorted, none touching.
#[derive(Debug)]
pub(super) struct ArenaFree {
    pub(super) ranges: Vec<std::ops::Range<usize>>,
}

impl ArenaFree {
    pub(super) fn new(bytes: usize) -> Self {
        ArenaFree {
            ranges: (bytes > 0).then_some(0..bytes).into_iter().collect(),
        }
    }

    /// The first free range of `len` bytes (a multiple of [`ARENA_GRANULE`]), taken.
    pub(super) fn take(&mut self, len: usize) -> Option<usize> {
        let i = self.ranges.iter().position(|r| r.len() >= len)?;
        let at = self.ranges[i].start;
        self.ranges[i].start += len;
        if self.ranges[i].is_empty() {
            self.ranges.remove(i);
        }
        Some(at)
    }

    /// Gives `at..at + len` back, joined with its free neighbours.
    pub(super) fn give(&mut self, at: usize, len: usize) {
        let i = self.ranges.partition_point(|r| r.start < at);
        self.ranges.insert(i, at..at + len);
        if i + 1 < self.ranges.len() && self.ranges[i].end == self.ranges[i + 1].start {
            let next = self.ranges.remove(i + 1);
            self.ranges[i].end = next.end;
        }
        if i > 0 && self.ranges[i - 1].end == self.ranges[i].start {
            let this = self.ranges.remove(i);
            self.ranges[i - 1].end = this.end;
        }
    }
}

/// `fallocate(2)` on the segment file: reserve (`mode` 0) or give back pages.
pub(super) fn fallocate(
    file: &File,
    mode: libc::c_int,
    offset: usize,
    len: usize,
) -> std::io::Result<()> {
    // SAFETY: a plain syscall on an open file.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One shared tensor's memory in its member's arena ([`ShmGroup::alloc_shared`]): the
/// pages are reserved while it lives and given back when it is dropped. It keeps the
/// mapping alive, so a tensor may outlive the runtime.
pub struct SharedLease {
    pub(super) map: Arc<MmapRaw>,
    pub(super) file: Arc<File>,
    pub(super) arena: Arc<Mutex<ArenaFree>>,
    /// Where the bytes are in the file, and in the arena.
    pub(super) file_offset: usize,
    pub(super) arena_offset: usize,
    /// Bytes reserved (whole pages).
    pub(super) len: usize,
}

impl SharedLease {
    /// The first byte; valid for the length asked of [`ShmGroup::alloc_shared`].
    pub fn ptr(&self) -> *mut u8 {
        // SAFETY: `file_offset + len` is inside the mapping, which `self.map` keeps.
        unsafe { self.map.as_mut_ptr().add(self.file_offset) }
    }
}

impl std::fmt::Debug for SharedLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLease")
            .field("arena_offset", &self.arena_offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for SharedLease {
    fn drop(&mut self) {
        // The pages go back to the system zeroed, so the next tensor there starts at 0.
        if let Err(e) = fallocate(
            &self.file,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            self.file_offset,
            self.len,
        ) {
            // Not given back: the range stays taken rather than hand out dirty memory.
            tracing::warn!("cannot free a shared tensor's {} bytes: {e}", self.len);
            return;
        }
        if let Ok(mut free) = self.arena.lock() {
            free.give(self.arena_offset, self.len);
        }
    }
}

impl ShmGroup {
    /// `len` zeroed bytes in this member's arena, for a tensor that the members can
    /// allreduce in place when every one of them passes one ([`Self::fold_allreduce`]);
    /// `Ok(None)`: the arena has no room left for them. The pages are reserved now, so a
    /// full `/dev/shm` is an error here, not a SIGBUS later.
    pub fn alloc_shared(&self, len: usize) -> std::io::Result<Option<SharedLease>> {
        let len = len.max(1).div_ceil(ARENA_GRANULE) * ARENA_GRANULE;
        let arena = || {
            self.arena
                .lock()
                .map_err(|_| std::io::Error::other("the shared-tensor arena's lock is poisoned"))
        };
        let Some(at) = arena()?.take(len) else {
            return Ok(None);
        };
        let file_offset = self.layout.arena(self.me) + at;
        if let Err(e) = fallocate(&self.file, 0, file_offset, len) {
            arena()?.give(at, len);
            return Err(e);
        }
        Ok(Some(SharedLease {
            map: self.map.clone(),
            file: self.file.clone(),
            arena: self.arena.clone(),
            file_offset,
            arena_offset: at,
            len,
        }))
    }
}
