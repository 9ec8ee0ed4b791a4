//! `thread_store`: where the kernel keeps each watched thread's scheduling
//! state (`struct rw_thread_state`), and how the agent reads it back.
//!
//! `sched_switch` reads and writes that state on every switch of the job,
//! so where it lives is on the job's hot path. Three stores, measured
//! against each other on the 2-core test VM (docs/BENCHMARKS.md):
//!
//! - **Slots** (`thread_slots`, the default): an array with a slot per
//!   thread id (`tid & mask`). The verifier inlines an array lookup, so a
//!   switch pays no helper call for it: 50–70 ns less per watched switch in
//!   all and 60–75 less per wakeup (by the BPF statistics) than task
//!   storage. Any kernel; the agent reads a slot by its index. A slot names
//!   its thread; one whose slot another live thread holds (tids that agree
//!   modulo the slots, only where `pid_max` is larger than the array) falls
//!   back to the hash map.
//! - **Task storage** hangs the state off the `task_struct`; a switch pays a
//!   helper call per side. User space can look an entry up only by a pidfd
//!   of the thread, which Linux gives for a thread that is not its process's
//!   leader from 6.9 on (`PIDFD_THREAD`). aya 0.13 has no task-storage map
//!   type, so its lookups and deletes are the two `bpf(2)` commands, here.
//! - **The hash map** keyed by tid: a hash and a bucket walk per side
//!   (~60 ns more per switch than task storage, session 18).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use anyhow::{Result, bail};
use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use ebpf::ThreadState;

/// Which map holds thread state; chosen at load time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ThreadStateStore {
    /// An array with a slot per thread id (`--thread-slots`): cheapest per
    /// switch, any kernel; a thread whose slot another holds uses the hash
    /// map. The default (also read as `auto`, its old name).
    // `auto` never chose anything but the slots: a hidden alias keeps old
    // command lines and RINGWATCH_THREAD_STATE=auto working.
    #[default]
    #[value(alias = "auto")]
    Slots,
    /// Task storage (`BPF_MAP_TYPE_TASK_STORAGE`): needs pidfds of threads
    /// (Linux 6.9 or later).
    TaskStorage,
    /// A hash map keyed by thread id: any supported kernel.
    HashMap,
}

impl ThreadStateStore {
    /// The store itself, checked against this kernel: an explicit
    /// `TaskStorage` the kernel cannot serve is an error that says why.
    pub fn resolve(self) -> Result<Self> {
        match self {
            Self::TaskStorage if !thread_pidfds_work() => bail!(
                "--thread-state task-storage needs pidfds of threads (PIDFD_THREAD, Linux 6.9 or later) to read the state back, and this kernel refuses them; use --thread-state hash-map (or slots)"
            ),
            definite => Ok(definite),
        }
    }
}

/// Whether this kernel opens pidfds with `PIDFD_THREAD` (Linux >= 6.9;
/// older kernels refuse the flag with EINVAL). Tried on our own pid, which
/// every kernel accepts without the flag.
pub fn thread_pidfds_work() -> bool {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    pidfd_of_thread(pid.unsigned_abs()).is_ok()
}

/// Slots in `thread_slots` unless `--thread-slots` says otherwise: 8 MiB,
/// and a slot for every thread id where `pid_max` is at most 65,536.
pub const DEFAULT_THREAD_SLOTS: u32 = 1 << 16;

/// Checks a `--thread-slots` value: a power of two from 1 to 2^22
/// (`PID_MAX_LIMIT`: beyond it no two thread ids share a slot anyway).
pub fn parse_thread_slots(text: &str) -> Result<u32, String> {
    let slots: u32 = text
        .parse()
        .map_err(|e| format!("{text:?} is not a number of slots: {e}"))?;
    if !slots.is_power_of_two() || slots > 1 << 22 {
        return Err(format!(
            "{slots} slots: give a power of two from 1 to 4194304 (a thread's slot is its id modulo the slots)"
        ));
    }
    Ok(slots)
}

/// The kernel's per-thread state, in whichever map holds it.
pub enum StateMap {
    /// `thread_state`, key: tid.
    Hash(BpfHashMap<MapData, u32, PodThreadState>),
    /// `thread_slots` (index: tid & mask), and `thread_state` for the
    /// threads whose slot another thread held.
    Slots {
        slots: Array<MapData, PodThreadState>,
        mask: u32,
        hash: BpfHashMap<MapData, u32, PodThreadState>,
    },
    /// `task_state`, key: a pidfd of the thread.
    Task {
        map: MapData,
        /// A pidfd of each live watched thread, kept between readings: the
        /// open and close would be two of the three system calls a reading
        /// of a thread takes.
        pidfds: HashMap<u32, OwnedFd>,
    },
}

/// `ThreadState` as aya reads it.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct PodThreadState(pub ThreadState);
// SAFETY: wraps a #[repr(C)] struct of integers (ebpf crate, layout checked
// against the C header), valid for every bit pattern.
unsafe impl aya::Pod for PodThreadState {}

impl StateMap {
    /// The state of every thread of `processes` that has one (tid → state).
    /// `known` names threads of each process that the caller has seen: a
    /// thread that is ending has left `/proc/<pid>/task` a little before its
    /// last switch (and its exit record), so the slots and task storage,
    /// which are read thread by thread, ask for those too.
    pub fn read(
        &mut self,
        processes: &BTreeSet<u32>,
        known: &BTreeMap<u32, Vec<u32>>,
    ) -> Vec<(u32, ThreadState)> {
        match self {
            Self::Hash(map) => map
                .iter()
                .flatten()
                .map(|(tid, state)| (tid, state.0))
                .filter(|(_, state)| processes.contains(&state.tgid))
                .collect(),
            Self::Slots { slots, mask, hash } => {
                let mut states = Vec::new();
                for &pid in processes {
                    for tid in threads_of(pid, known) {
                        let state = match slots.get(&(tid & *mask), 0) {
                            Ok(slot) if slot.0.tid == u64::from(tid) => Some(slot.0),
                            // Another thread's slot (or none yet): the
                            // hash map, where it went if it has run.
                            Ok(_) => hash.get(&tid, 0).ok().map(|s| s.0),
                            Err(error) => {
                                tracing::debug!(%error, tid, "reading a thread's slot");
                                None
                            }
                        };
                        // A tid reused by another process keeps nothing of ours.
                        if let Some(state) = state.filter(|s| s.tgid == pid) {
                            states.push((tid, state));
                        }
                    }
                }
                states
            }
            Self::Task { map, pidfds } => {
                drop_exited(pidfds);
                let mut states = Vec::new();
                let mut live = BTreeSet::new();
                for &pid in processes {
                    for tid in threads_of(pid, known) {
                        live.insert(tid);
                        match lookup(map.fd().as_fd(), pidfds, tid) {
                            // A tid reused by another process keeps nothing
                            // of ours; its storage says whose it is.
                            Ok(Some(state)) if state.tgid == pid => states.push((tid, state)),
                            Ok(_) => {}
                            Err(error) => {
                                tracing::debug!(%error, tid, "reading a thread's task storage");
                            }
                        }
                    }
                }
                pidfds.retain(|tid, _| live.contains(tid));
                states
            }
        }
    }

    /// Drops the state of threads the model forgot (a hash entry would
    /// otherwise stay; task storage goes with its task, but a process that
    /// is watched again must not find a stale state).
    pub fn forget(&mut self, tids: &[u32]) {
        match self {
            Self::Hash(map) => {
                for tid in tids {
                    let _ = map.remove(tid);
                }
            }
            Self::Slots { slots, mask, hash } => {
                for &tid in tids {
                    let index = tid & *mask;
                    // Only its own slot. A thread's last switch while
                    // watched frees its slot; this frees those of threads
                    // that died unwatched or live on in a process no longer
                    // watched (no program touches those now).
                    if slots
                        .get(&index, 0)
                        .is_ok_and(|slot| slot.0.tid == u64::from(tid))
                    {
                        let _ = slots.set(index, PodThreadState(ThreadState::default()), 0);
                    }
                    let _ = hash.remove(&tid);
                }
            }
            Self::Task { map, pidfds } => {
                for &tid in tids {
                    // A kept pidfd may name an earlier thread of that tid.
                    pidfds.remove(&tid);
                    if let Ok(pidfd) = pidfd_of_thread(tid) {
                        let _ = map_elem(map.fd().as_fd(), BPF_MAP_DELETE_ELEM, &pidfd, None);
                    }
                }
            }
        }
    }
}

/// The threads of `pid` to read: those in `/proc/<pid>/task` and those in
/// `known` (a thread that has left /proc may not have made its last switch
/// yet; one that has, has no state left to find, and its last counts came
/// with its exit record).
fn threads_of(pid: u32, known: &BTreeMap<u32, Vec<u32>>) -> BTreeSet<u32> {
    let mut tids: BTreeSet<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .collect()
        })
        .unwrap_or_default();
    if let Some(seen) = known.get(&pid) {
        tids.extend(seen);
    }
    tids
}

/// At most this many pidfds are kept between readings (a process of many
/// thousands of threads must not take as many of the agent's descriptors);
/// the threads past it get one for each reading.
const MAX_KEPT_PIDFDS: usize = 4096;

/// `PIDFD_THREAD` (linux/pidfd.h): a pidfd of this very thread.
const PIDFD_THREAD: libc::c_uint = libc::O_EXCL as libc::c_uint;
/// `enum bpf_cmd` (linux/bpf.h).
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;

fn pidfd_of_thread(tid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(tid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, PIDFD_THREAD) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One thread's state, through its kept pidfd (opened and kept if there is
/// none): none when the thread has none (it never switched while watched)
/// or is gone.
fn lookup(
    map: BorrowedFd<'_>,
    pidfds: &mut HashMap<u32, OwnedFd>,
    tid: u32,
) -> io::Result<Option<ThreadState>> {
    let full = pidfds.len() >= MAX_KEPT_PIDFDS;
    let opened;
    let pidfd = match pidfds.entry(tid) {
        Entry::Occupied(kept) => &*kept.into_mut(),
        Entry::Vacant(slot) => match pidfd_of_thread(tid) {
            Ok(fd) if !full => &*slot.insert(fd),
            // Past the bound: used once and closed.
            Ok(fd) => {
                opened = fd;
                &opened
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
            Err(e) => return Err(e),
        },
    };
    let mut state = ThreadState::default();
    match map_elem(map, BPF_MAP_LOOKUP_ELEM, pidfd, Some(&mut state)) {
        Ok(()) => Ok(Some(state)),
        // No state yet (a thread that has not run since it was watched), or
        // the thread exited since `drop_exited` looked: its pidfd goes at
        // the next reading.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Drops the kept pidfds of threads that exited: a thread's pidfd polls
/// readable once it has (Linux >= 6.9), and its tid may name a new thread
/// by now. One system call for all of them.
fn drop_exited(pidfds: &mut HashMap<u32, OwnedFd>) {
    if pidfds.is_empty() {
        return;
    }
    let tids: Vec<u32> = pidfds.keys().copied().collect();
    let mut polled: Vec<libc::pollfd> = tids
        .iter()
        .filter_map(|tid| pidfds.get(tid))
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let Ok(count) = libc::nfds_t::try_from(polled.len()) else {
        pidfds.clear();
        return;
    };
    // SAFETY: `polled` holds `count` initialized pollfds of descriptors we
    // own, and poll writes only their revents; timeout 0 never blocks.
    let ready = unsafe { libc::poll(polled.as_mut_ptr(), count, 0) };
    if ready < 0 {
        // Cannot tell which are gone: open them all afresh.
        pidfds.clear();
        return;
    }
    for (tid, p) in tids.iter().zip(&polled) {
        if p.revents != 0 {
            pidfds.remove(tid);
        }
    }
}

/// The map-element part of `union bpf_attr`.
#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

fn map_elem(
    map: BorrowedFd<'_>,
    cmd: libc::c_long,
    pidfd: &OwnedFd,
    value: Option<&mut ThreadState>,
) -> io::Result<()> {
    let key: libc::c_int = pidfd.as_raw_fd();
    let attr = MapElemAttr {
        map_fd: map.as_raw_fd().unsigned_abs(),
        _pad: 0,
        key: std::ptr::from_ref(&key) as u64,
        value: value.map_or(0, |v| std::ptr::from_mut(v) as u64),
        flags: 0,
    };
    // SAFETY: attr points at a key of the map's key size (int) and, for a
    // lookup, a value of its value size (ThreadState, checked against the C
    // struct); both outlive the call, and the kernel reads size_of attr.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_ref(&attr),
            std::mem::size_of::<MapElemAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attribute_block_is_laid_out_as_the_kernels() {
        // union bpf_attr, BPF_MAP_*_ELEM: map_fd, key, value, flags, each
        // 64-bit aligned but the first.
        assert_eq!(std::mem::size_of::<MapElemAttr>(), 32);
        assert_eq!(std::mem::offset_of!(MapElemAttr, key), 8);
        assert_eq!(std::mem::offset_of!(MapElemAttr, value), 16);
        assert_eq!(std::mem::offset_of!(MapElemAttr, flags), 24);
    }

    #[test]
    fn the_threads_read_are_those_in_proc_and_those_already_seen() {
        // SAFETY: getpid and gettid have no preconditions.
        let (pid, tid) = unsafe { (libc::getpid().unsigned_abs(), libc::gettid().unsigned_abs()) };
        // One that has left /proc (no such tid can exist above pid_max).
        let ending = (1 << 22) + 1;
        let known = BTreeMap::from([(pid, vec![ending])]);
        let tids = threads_of(pid, &known);
        assert!(tids.contains(&pid) && tids.contains(&tid) && tids.contains(&ending));
        // A process not in /proc: only what was seen of it.
        let gone = BTreeMap::from([(ending, vec![7])]);
        assert_eq!(threads_of(ending, &gone), BTreeSet::from([7]));
        assert!(threads_of(ending, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn thread_slots_are_a_power_of_two_up_to_the_pid_limit() {
        assert_eq!(parse_thread_slots("65536"), Ok(65536));
        assert_eq!(parse_thread_slots("1"), Ok(1));
        assert_eq!(parse_thread_slots("4194304"), Ok(1 << 22));
        for bad in ["0", "3", "65535", "8388608", "-2", "lots"] {
            assert!(parse_thread_slots(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_old_auto_value_still_parses_as_the_slots() {
        use clap::ValueEnum;
        for value in ["auto", "slots"] {
            assert_eq!(
                ThreadStateStore::from_str(value, false),
                Ok(ThreadStateStore::Slots),
                "{value}"
            );
        }
        assert_eq!(ThreadStateStore::default(), ThreadStateStore::Slots);
        // Hidden: `--help` and the reference list the stores, not the alias.
        let listed: Vec<String> = ThreadStateStore::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .filter(|v| !v.is_hide_set())
            .map(|v| v.get_name().to_owned())
            .collect();
        assert_eq!(listed, ["slots", "task-storage", "hash-map"]);
    }

    #[test]
    fn a_pidfd_of_a_thread_that_is_not_the_leader_opens_where_the_kernel_allows_it() {
        // The slots serve on every kernel. This kernel's answer decides
        // whether task storage can be asked for; a thread of ours must then
        // get a pidfd too (the point of the flag), and a tid that does not
        // exist must not.
        assert_eq!(
            ThreadStateStore::Slots.resolve().unwrap(),
            ThreadStateStore::Slots
        );
        if !thread_pidfds_work() {
            assert!(ThreadStateStore::TaskStorage.resolve().is_err());
            return;
        }
        assert_eq!(
            ThreadStateStore::TaskStorage.resolve().unwrap(),
            ThreadStateStore::TaskStorage
        );
        // SAFETY: gettid has no preconditions.
        let tid = std::thread::spawn(|| unsafe { libc::gettid() })
            .join()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            // SAFETY: as above.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = done_rx.recv();
        });
        let live = rx.recv().unwrap();
        assert!(pidfd_of_thread(live.unsigned_abs()).is_ok());
        done_tx.send(()).unwrap();
        worker.join().unwrap();
        // The first thread has exited (joined): its tid names no thread,
        // unless the kernel reused it already.
        if std::fs::metadata(format!("/proc/{tid}")).is_err() {
            assert!(pidfd_of_thread(tid.unsigned_abs()).is_err());
        }
        assert_eq!(
            ThreadStateStore::HashMap.resolve().unwrap(),
            ThreadStateStore::HashMap
        );
    }

    #[test]
    fn kept_pidfds_of_threads_that_exited_are_dropped_and_the_others_kept() {
        if !thread_pidfds_work() {
            return; // no thread pidfds, no task storage: nothing is kept
        }
        // A thread that says its tid, then waits to be told to end.
        let spawn = || {
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
            let thread = std::thread::spawn(move || {
                // SAFETY: gettid has no preconditions.
                tid_tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = end_rx.recv();
            });
            (tid_rx.recv().unwrap().unsigned_abs(), end_tx, thread)
        };
        let (ending_tid, end_tx, ending) = spawn();
        let (staying_tid, stay_tx, staying) = spawn();
        let mut pidfds = HashMap::new();
        for tid in [ending_tid, staying_tid] {
            pidfds.insert(tid, pidfd_of_thread(tid).unwrap());
        }
        drop_exited(&mut pidfds);
        assert_eq!(pidfds.len(), 2, "both threads live");
        end_tx.send(()).unwrap();
        ending.join().unwrap();
        // join returns when the thread's tid word is cleared, a little
        // before the kernel finishes its exit (and the pidfd polls
        // readable): look again for a while.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        drop_exited(&mut pidfds);
        while pidfds.contains_key(&ending_tid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
            drop_exited(&mut pidfds);
        }
        assert!(!pidfds.contains_key(&ending_tid), "its thread exited");
        assert!(pidfds.contains_key(&staying_tid), "its thread still runs");
        stay_tx.send(()).unwrap();
        staying.join().unwrap();
    }
}
