//! The bounded, non-blocking way out: NCCL's threads `try_send` a record
//! into a queue of [`queue_capacity`] records and go on; one thread of the
//! plugin writes them to the agent's socket. When the queue is full (the
//! agent slow) or no agent answers, records are dropped and counted, never
//! waited for.
//!
//! The wire: the plugin writes a hello line, the agent answers one line,
//! then the plugin writes one JSON line per collective ([`Record::line`])
//! and, every [`HEARTBEAT`], a line with its counters.
//!
//! ```text
//! > {"hello":"ringwatch-nccl-profiler","proto":1,"profiler":6}
//! < {"ok":true,"proto":1}
//! > {"seq":0,"comm":"…","rank":0,…}
//! > {"counters":{"collectives":…,"sent":…,"dropped_queue_full":…,…}}
//! ```
//!
//! An answer other than `"ok":true` (or a socket served by a user other than
//! root or the job's own), disables the plugin for the process: it says so
//! once on stderr, clears NCCL's event mask and NCCL runs on without it. A
//! missing socket or a silent agent is not an answer: the plugin retries
//! each second, and says once that records are being dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::record::Record;

/// The wire protocol's version.
pub const PROTO: u32 = 1;
/// The socket's name in the agent's runtime directory.
pub const SOCKET_NAME: &str = "nccl-profiler.socket";
/// How often the counters go to the agent when collectives are sparse.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// Records in the queue by default (`RINGWATCH_NCCL_PROFILER_QUEUE`).
pub const DEFAULT_QUEUE: usize = 8192;
/// How long a write to the agent may block the plugin's own thread.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the agent has to answer the hello.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// What the plugin counted since the process loaded it.
#[derive(Debug, Default)]
pub struct Counters {
    /// Collectives completed (or sent incomplete).
    pub collectives: AtomicU64,
    /// Records the agent's socket accepted.
    pub sent: AtomicU64,
    /// Dropped because the queue was full (the agent slow).
    pub dropped_queue_full: AtomicU64,
    /// Dropped because no agent was connected.
    pub dropped_no_agent: AtomicU64,
    /// Sent with channels missing (their slot was needed again).
    pub incomplete: AtomicU64,
    /// Records queued, not yet written.
    pub pending: AtomicU64,
    /// Connections made to an agent.
    pub connects: AtomicU64,
}

pub fn counters() -> &'static Counters {
    static COUNTERS: OnceLock<Counters> = OnceLock::new();
    COUNTERS.get_or_init(Counters::default)
}

static DISABLED: AtomicBool = AtomicBool::new(false);
/// NCCL's process-wide event mask, as the last `init` gave it.
static MASK: AtomicPtr<i32> = AtomicPtr::new(std::ptr::null_mut());
static TX: OnceLock<Option<SyncSender<Record>>> = OnceLock::new();

pub fn disabled() -> bool {
    DISABLED.load(Ordering::Relaxed)
}

/// Remembers NCCL's event mask so that disabling can clear it.
pub fn set_mask(mask: *mut i32) {
    MASK.store(mask, Ordering::Relaxed);
}

/// Disables the plugin for the rest of the process, says why once, and
/// asks NCCL for no more events.
pub fn disable(why: &str) {
    if DISABLED.swap(true, Ordering::Relaxed) {
        return;
    }
    say(&format!("disabled: {why}; NCCL runs on without it"));
    let mask = MASK.load(Ordering::Relaxed);
    if !mask.is_null() {
        // SAFETY: NCCL's mask is a process-global int that lives as long as
        // libnccl, which outlives its communicators; NCCL reads it
        // atomically, so it is written atomically.
        unsafe { std::sync::atomic::AtomicI32::from_ptr(mask) }.store(0, Ordering::Relaxed);
    }
}

/// One line on stderr, prefixed with the plugin's name.
pub fn say(what: &str) {
    let _ = writeln!(std::io::stderr(), "ringwatch-nccl-profiler: {what}");
}

/// Where the agent listens: `RINGWATCH_NCCL_PROFILER_SOCKET`; else, for
/// the library the agent published (`<dir>/lib/<this library>`),
/// [`SOCKET_NAME`] in `<dir>`; else [`SOCKET_NAME`] in
/// `RINGWATCH_RUNTIME_DIR` (default `/run/ringwatch`).
pub fn socket_path(library: Option<&std::path::Path>) -> PathBuf {
    if let Some(path) = std::env::var_os("RINGWATCH_NCCL_PROFILER_SOCKET").filter(|p| !p.is_empty())
    {
        return PathBuf::from(path);
    }
    if let Some(dir) = library
        .and_then(std::path::Path::parent)
        .filter(|d| d.file_name().is_some_and(|n| n == "lib"))
        .and_then(std::path::Path::parent)
    {
        return dir.join(SOCKET_NAME);
    }
    std::env::var_os("RINGWATCH_RUNTIME_DIR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/ringwatch"))
        .join(SOCKET_NAME)
}

/// The queue's capacity: `RINGWATCH_NCCL_PROFILER_QUEUE` (16…1,048,576),
/// else [`DEFAULT_QUEUE`].
pub fn queue_capacity() -> usize {
    std::env::var("RINGWATCH_NCCL_PROFILER_QUEUE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map(|n| n.clamp(16, 1 << 20))
        .unwrap_or(DEFAULT_QUEUE)
}

/// Starts the writer thread, once per process; `profiler` is the plugin
/// version NCCL loaded (said in the hello), `library` where this library
/// was loaded from.
pub fn start(profiler: u8, library: Option<&std::path::Path>) {
    TX.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue_capacity());
        let path = socket_path(library);
        match std::thread::Builder::new()
            .name("rw-nccl-profiler".into())
            .spawn(move || run(&path, profiler, &rx))
        {
            Ok(_) => Some(tx),
            Err(e) => {
                disable(&format!("could not start its thread ({e})"));
                None
            }
        }
    });
}

/// Queues a finished collective; never blocks.
pub fn send(rec: Record) {
    let c = counters();
    c.collectives.fetch_add(1, Ordering::Relaxed);
    let Some(Some(tx)) = TX.get() else {
        c.dropped_no_agent.fetch_add(1, Ordering::Relaxed);
        return;
    };
    c.pending.fetch_add(1, Ordering::Relaxed);
    match tx.try_send(rec) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            c.pending.fetch_sub(1, Ordering::Relaxed);
            c.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Disconnected(_)) => {
            c.pending.fetch_sub(1, Ordering::Relaxed);
            c.dropped_no_agent.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Waits up to `limit` for the queue to be written out (the last
/// communicator's finalize: a short job's last collectives are not lost).
pub fn flush(limit: Duration) {
    let start = Instant::now();
    while counters().pending.load(Ordering::Relaxed) > 0 && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(2));
    }
}

enum Connect {
    /// No agent now (no socket, refused, no answer in time): retry.
    Absent(String),
    /// The agent said no, or something that is not it answered: stop.
    Refused(String),
}

fn run(path: &std::path::Path, profiler: u8, rx: &Receiver<Record>) {
    let said_absent = Mutex::new(false);
    loop {
        if disabled() {
            drain(rx, None);
            return;
        }
        match connect(path, profiler) {
            Ok(stream) => {
                counters().connects.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut said) = said_absent.lock() {
                    *said = false;
                }
                if !serve(stream, rx) {
                    return;
                }
            }
            Err(Connect::Refused(why)) => {
                disable(&why);
                drain(rx, None);
                return;
            }
            Err(Connect::Absent(why)) => {
                if let Ok(mut said) = said_absent.lock()
                    && !*said
                {
                    *said = true;
                    say(&format!(
                        "no agent at {} ({why}): collectives are counted as dropped until one answers (retried each second)",
                        path.display()
                    ));
                }
                if !drain(rx, Some(Duration::from_secs(1))) {
                    return;
                }
            }
        }
    }
}

/// Drops what is queued for `limit` (or for good), counting it. False once
/// every sender is gone.
fn drain(rx: &Receiver<Record>, limit: Option<Duration>) -> bool {
    let start = Instant::now();
    let c = counters();
    loop {
        let left = match limit {
            Some(l) => match l.checked_sub(start.elapsed()) {
                Some(left) => left,
                None => return true,
            },
            None => Duration::from_secs(3600),
        };
        match rx.recv_timeout(left) {
            Ok(_) => {
                c.pending.fetch_sub(1, Ordering::Relaxed);
                c.dropped_no_agent.fetch_add(1, Ordering::Relaxed);
            }
            Err(RecvTimeoutError::Timeout) => {
                if limit.is_some() {
                    return true;
                }
            }
            Err(RecvTimeoutError::Disconnected) => return false,
        }
    }
}

/// The uid of the process serving `stream`.
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid fd, a ucred-sized buffer and its length.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

fn connect(path: &std::path::Path, profiler: u8) -> Result<UnixStream, Connect> {
    let stream = UnixStream::connect(path).map_err(|e| Connect::Absent(e.to_string()))?;
    // Only root (the agent) or the job's own user may receive its records.
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    match peer_uid(&stream) {
        Some(uid) if uid == 0 || uid == me => {}
        Some(uid) => {
            return Err(Connect::Refused(format!(
                "{} is served by uid {uid}, neither root nor this job's user",
                path.display()
            )));
        }
        None => return Err(Connect::Absent("could not read its peer".into())),
    }
    let set = stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .and_then(|()| stream.set_read_timeout(Some(ANSWER_TIMEOUT)));
    if let Err(e) = set {
        return Err(Connect::Absent(e.to_string()));
    }
    let hello = format!(
        "{{\"hello\":\"ringwatch-nccl-profiler\",\"proto\":{PROTO},\"profiler\":{profiler}}}\n"
    );
    (&stream)
        .write_all(hello.as_bytes())
        .map_err(|e| Connect::Absent(e.to_string()))?;
    let mut answer = Vec::new();
    let read = BufReader::new(&stream)
        .take(512)
        .read_until(b'\n', &mut answer);
    match read {
        Ok(0) => return Err(Connect::Absent("it closed the connection".into())),
        Ok(_) => {}
        Err(e) => return Err(Connect::Absent(format!("no answer ({e})"))),
    }
    let answer = String::from_utf8_lossy(&answer);
    let answer = answer.trim();
    let compact: String = answer.chars().filter(|c| !c.is_whitespace()).collect();
    if compact.starts_with('{') && compact.contains("\"ok\":true") {
        if !compact.contains(&format!("\"proto\":{PROTO}")) {
            return Err(Connect::Refused(format!(
                "the agent speaks another protocol version ({})",
                printable(answer)
            )));
        }
        // Nothing more is read: the agent never writes again.
        let _ = stream.shutdown(std::net::Shutdown::Read);
        Ok(stream)
    } else {
        Err(Connect::Refused(format!(
            "the agent at {} answered {}",
            path.display(),
            printable(answer)
        )))
    }
}

/// At most 120 printable characters of a peer's answer.
fn printable(s: &str) -> String {
    let s: String = s.chars().filter(|c| !c.is_control()).take(120).collect();
    format!("{s:?}")
}

fn counters_line() -> String {
    let c = counters();
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    format!(
        "{{\"counters\":{{\"collectives\":{},\"sent\":{},\"dropped_queue_full\":{},\"dropped_no_agent\":{},\"incomplete\":{}}}}}\n",
        l(&c.collectives),
        l(&c.sent),
        l(&c.dropped_queue_full),
        l(&c.dropped_no_agent),
        l(&c.incomplete),
    )
}

/// Writes records until the connection fails (true: reconnect) or every
/// sender is gone (false).
fn serve(stream: UnixStream, rx: &Receiver<Record>) -> bool {
    let c = counters();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stream);
    if out
        .write_all(counters_line().as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
        return true;
    }
    loop {
        let first = match rx.recv_timeout(HEARTBEAT) {
            Ok(rec) => rec,
            Err(RecvTimeoutError::Timeout) => {
                if out
                    .write_all(counters_line().as_bytes())
                    .and_then(|()| out.flush())
                    .is_err()
                {
                    return true;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return false,
        };
        // A batch: the first record and whatever else is queued (up to 256).
        let mut batch = 1u64;
        let mut result = out.write_all(first.line().as_bytes());
        while result.is_ok() && batch < 256 {
            match rx.try_recv() {
                Ok(rec) => {
                    batch += 1;
                    result = out.write_all(rec.line().as_bytes());
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        let result = result.and_then(|()| out.flush());
        c.pending.fetch_sub(batch, Ordering::Relaxed);
        match result {
            Ok(()) => {
                c.sent.fetch_add(batch, Ordering::Relaxed);
            }
            Err(_) => {
                // The agent went away or stopped reading for a second: the
                // batch is lost with the connection.
                c.dropped_no_agent.fetch_add(batch, Ordering::Relaxed);
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// `docs/reference/env.md` (rendered from `collectives/src/env_vars.rs`)
    /// states this plugin's variables with its defaults.
    #[test]
    fn the_reference_page_states_the_plugins_variables_and_defaults() {
        let page = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/reference/env.md"
        ))
        .unwrap();
        let row = |name: &str| {
            page.lines()
                .find(|l| l.starts_with(&format!("| `{name}`")))
                .unwrap_or_else(|| panic!("no row for {name}"))
                .to_owned()
        };
        assert!(
            row("RINGWATCH_NCCL_PROFILER_QUEUE").contains(&format!("`{}`", super::DEFAULT_QUEUE))
        );
        assert!(row("RINGWATCH_NCCL_PROFILER_SOCKET").contains(super::SOCKET_NAME));
        assert!(row("RINGWATCH_NCCL_PROFILER").contains("off"));
    }
}
