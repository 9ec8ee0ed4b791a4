//! The control socket server of a host's first rank (rank 0's holds the tuning claim): speaks [`crate::control`]'s protocol to at most
//! [`MAX_CLIENTS`] clients at once (the agent, tools, tests).
//!
//! It must never touch the data path: it only reads the shared knob state, queues knob
//! requests for the coordinator, and forwards statistics and timeline events. The job never
//! waits on a client and a client never costs the job more than a bounded amount: a message
//! is encoded once and shared by every client's queue, each queue holds at most
//! [`CLIENT_QUEUE_BYTES`], and a client whose queue would grow past that, or whose socket
//! takes no bytes for [`CLIENT_WRITE_TIMEOUT`], is closed as too slow (counted and logged).
//! A client past [`MAX_CLIENTS`] is answered with an `error` message and closed. Tuning
//! claims are kept in [`TuningClaims`], held per connection: when a connection ends, for
//! whatever reason, its claim ends as `interrupted`.

use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::control::{
    AutotuneState, ClientMessage, ControlError, CycleStats, Hello, KnobUpdate, Knobs,
    MAX_MESSAGE_BYTES, ServerMessage, StallReport, TimelineEvent, default_runtime_dir,
    fallback_runtime_dirs, read_client_message, read_server_message, socket_path,
};
use crate::error::{CollectiveError, Result};
use crate::runtime::claim::TuningClaims;

/// Clients served at once; one more is answered with an `error` message and closed. Each
/// costs two threads and at most [`CLIENT_QUEUE_BYTES`] of queued messages.
pub(crate) const MAX_CLIENTS: usize = 16;

/// Bytes of encoded messages one client may have waiting to be written (the kernel's
/// socket buffer comes on top). A client that falls further behind is closed as too slow:
/// a bounded queue that silently lost messages would hand an agent a timeline with holes.
pub(crate) const CLIENT_QUEUE_BYTES: usize = 4 << 20;

/// How long one write to a client may block (its socket buffer full, the client not
/// reading) before the client is closed as too slow.
pub(crate) const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// One encoded frame (length prefix and JSON body), shared by every client it goes to.
type Frame = Arc<[u8]>;

/// Frames of `message`, each at most [`MAX_MESSAGE_BYTES`] of body: a timeline batch too
/// large for one frame is split in halves until its parts fit. A message that still does
/// not fit (one event over 1 MiB) is dropped with a log line rather than sent malformed.
fn encode(message: &ServerMessage) -> Vec<Frame> {
    let body = match serde_json::to_vec(message) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a control message; dropped");
            return Vec::new();
        }
    };
    if body.len() <= MAX_MESSAGE_BYTES {
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        return vec![frame.into()];
    }
    match message {
        ServerMessage::Timeline { events } if events.len() > 1 => {
            let (a, b) = events.split_at(events.len() / 2);
            let mut frames = encode(&ServerMessage::Timeline { events: a.to_vec() });
            frames.extend(encode(&ServerMessage::Timeline { events: b.to_vec() }));
            frames
        }
        _ => {
            tracing::warn!(
                bytes = body.len(),
                max = MAX_MESSAGE_BYTES,
                "a control message is over the frame limit; dropped"
            );
            Vec::new()
        }
    }
}

/// What waits to be written to one client.
#[derive(Default)]
struct Outbox {
    frames: VecDeque<Frame>,
    bytes: usize,
    /// Nothing more is queued; the writer writes what is left and stops.
    closed: bool,
}

/// How [`Client::send`] went.
#[derive(Debug, PartialEq, Eq)]
enum Queued {
    Yes,
    /// The client is closed already; nothing was queued.
    Closed,
    /// The queue would have grown past [`CLIENT_QUEUE_BYTES`]: the client is now closed,
    /// its queue emptied, and it must be disconnected.
    TooSlow {
        queued_bytes: usize,
    },
}

struct Client {
    id: u64,
    stream: UnixStream,
    outbox: Mutex<Outbox>,
    wake_writer: Condvar,
    stats: AtomicBool,
    timeline: AtomicBool,
    /// A rank of this host sending its timeline (`rank_timeline`): told when the timeline
    /// is wanted.
    feeder: AtomicBool,
    /// The peer is another rank of this host (its own slots; only it, or this
    /// process itself, may send `rank_timeline`).
    rank_peer: bool,
    /// The peer is this very process (ranks played by threads, in tests).
    same_process: bool,
}

impl Client {
    fn send(&self, frames: &[Frame]) -> Queued {
        let Ok(mut out) = self.outbox.lock() else {
            return Queued::Closed;
        };
        if out.closed {
            return Queued::Closed;
        }
        let adding: usize = frames.iter().map(|f| f.len()).sum();
        if out.bytes + adding > CLIENT_QUEUE_BYTES {
            let queued_bytes = out.bytes;
            out.frames.clear();
            out.bytes = 0;
            out.closed = true;
            self.wake_writer.notify_all();
            return Queued::TooSlow { queued_bytes };
        }
        out.frames.extend(frames.iter().cloned());
        out.bytes += adding;
        self.wake_writer.notify_all();
        Queued::Yes
    }

    /// No more messages; the writer sends what is queued and stops.
    fn close(&self) {
        if let Ok(mut out) = self.outbox.lock() {
            out.closed = true;
        }
        self.wake_writer.notify_all();
    }

    /// The next frame to write, waiting for one; `None` once closed and drained.
    fn next_frame(&self) -> Option<Frame> {
        let mut out = self.outbox.lock().ok()?;
        loop {
            if let Some(f) = out.frames.pop_front() {
                out.bytes -= f.len();
                return Some(f);
            }
            if out.closed {
                return None;
            }
            out = self.wake_writer.wait(out).ok()?;
        }
    }

    #[cfg(test)]
    fn queued_bytes(&self) -> usize {
        self.outbox.lock().map(|o| o.bytes).unwrap_or(0)
    }
}

/// A knob change asked for on the socket, waiting for the coordinator.
pub(crate) struct KnobRequest {
    client: Arc<Client>,
    request_id: u64,
    /// The change.
    pub update: KnobUpdate,
}

/// State the server reads from the runtime.
pub(crate) struct ServerState {
    /// Static part of `hello`; `knobs` and `cycle` are filled in from `knobs`.
    pub hello: Hello,
    /// The knobs in force and the cycle they are at.
    pub knobs: Arc<Mutex<(Knobs, u64)>>,
    /// The autotune state and the tuning claim.
    pub claims: Arc<TuningClaims>,
}

/// The running server.
pub(crate) struct ControlServer {
    path: PathBuf,
    state: ServerState,
    clients: Mutex<Vec<Arc<Client>>>,
    knob_requests: Mutex<Vec<KnobRequest>>,
    stats_subscribers: AtomicUsize,
    timeline_subscribers: AtomicUsize,
    stop: AtomicBool,
    next_id: AtomicU64,
    accept_thread: Mutex<Option<JoinHandle<()>>>,
    /// Clients refused because [`MAX_CLIENTS`] were connected.
    refused_clients: AtomicU64,
    /// Clients closed for reading too slowly.
    slow_clients_closed: AtomicU64,
    /// The stall check's last report while the job is stalled (sent to a client that
    /// subscribes then); `None` while it is not.
    stall: Mutex<Option<StallReport>>,
}

/// Whether the process at the other end of `stream` may use this job's
/// control socket: a process of the job's own user, or root (the node's
/// agent). The socket may sit in a directory every user can reach (the
/// agent's runtime dir is mode 1777), and a client can change the job's
/// knobs or take its few client slots.
fn client_allowed(stream: &UnixStream) -> std::result::Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    match crate::control::peer_credentials(stream) {
        Ok(peer) if peer.uid == me || peer.uid == 0 => Ok(()),
        Ok(peer) => Err(format!(
            "this job's control socket serves only uid {me} and root; pid {} runs as uid {}",
            peer.pid, peer.uid
        )),
        Err(error) => Err(format!("cannot read the client's credentials: {error}")),
    }
}

fn pick_dir(preferred: Option<PathBuf>) -> Result<PathBuf> {
    let first = preferred.unwrap_or_else(default_runtime_dir);
    let mut tried = Vec::new();
    for dir in std::iter::once(first.clone()).chain(fallback_runtime_dirs()) {
        match std::fs::create_dir_all(&dir) {
            Ok(()) if writable(&dir) => {
                if dir != first {
                    tracing::info!(
                        wanted = %first.display(),
                        using = %dir.display(),
                        "runtime dir is not writable; control socket goes to a fallback dir \
                         (set RINGWATCH_RUNTIME_DIR to choose)"
                    );
                }
                return Ok(dir);
            }
            Ok(()) => tried.push(format!("{}: not writable", dir.display())),
            Err(e) => tried.push(format!("{}: {e}", dir.display())),
        }
    }
    Err(CollectiveError::Control {
        path: first.display().to_string(),
        message: format!("no usable runtime dir ({})", tried.join("; ")),
    })
}

fn writable(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    // The directory may be writable by every user (the agent's is 1777): the
    // probe never follows a link and never opens a file someone planted.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let probe = dir.join(format!(".probe-{}-{nanos}", std::process::id()));
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&probe);
    let ok = created.is_ok();
    if ok {
        let _ = std::fs::remove_file(&probe);
    }
    ok
}

/// What holds the name `path` so that this job may not take it, if anything
/// does: anything of another user (a socket, a plain file, a socket nobody
/// serves or nobody may connect to), a file of this user that is not a
/// socket, or a live socket of this user (another job of the same id). A
/// socket of this user that nobody serves was left by a crashed job: it is
/// removed, and the name is free. Another user's socket is never connected
/// to (a full backlog would block the connect).
fn holder(path: &Path) -> Option<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::symlink_metadata(path).ok()?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let kind = if meta.file_type().is_socket() {
        "socket"
    } else if meta.file_type().is_symlink() {
        "symlink"
    } else {
        "file"
    };
    if meta.uid() != me {
        return Some(format!("a {kind} of uid {}", meta.uid()));
    }
    if kind != "socket" {
        return Some(format!("a {kind} of this user"));
    }
    match UnixStream::connect(path) {
        Ok(stream) => Some(match crate::control::peer_credentials(&stream) {
            Ok(server) => format!("a live job of this user (pid {})", server.pid),
            Err(_) => "a live job of this user".to_owned(),
        }),
        Err(_) => {
            let _ = std::fs::remove_file(path);
            None
        }
    }
}

/// The marker between a job's id and the random part of its alternate name.
pub(crate) const ALTERNATE_MARK: &str = ".taken-";

/// The name a job's socket takes where its own is held (see [`holder`]): the
/// id, [`ALTERNATE_MARK`] and 48 random bits, which nobody can take first.
/// The host's other ranks find it by its prefix; the agent lists both names
/// as a conflict.
pub(crate) fn alternate_job_id(job_id: &str) -> String {
    format!(
        "{job_id}{ALTERNATE_MARK}{}",
        crate::rendezvous::random_suffix()
    )
}

impl ControlServer {
    /// Binds `<dir>/<job_id>.sock` and starts accepting clients. When that
    /// name is held (see [`holder`]), the socket takes an alternate name
    /// ([`alternate_job_id`]; the hello says so) and an error is logged
    /// naming the holder: the job is watched under the other name, never
    /// unwatched in silence. Without a usable directory the job runs without
    /// a socket, saying why.
    pub(crate) fn start(dir: Option<PathBuf>, mut state: ServerState) -> Result<Arc<Self>> {
        let dir = pick_dir(dir)?;
        let mut path = socket_path(&dir, &state.hello.job_id);
        if let Some(held_by) = holder(&path) {
            let mut alternate = alternate_job_id(&state.hello.job_id);
            // 48 random bits: a second draw only if the kernel's randomness failed.
            for _ in 0..3 {
                if holder(&socket_path(&dir, &alternate)).is_none() {
                    break;
                }
                alternate = alternate_job_id(&state.hello.job_id);
            }
            tracing::error!(
                socket = %path.display(),
                held_by,
                alternate,
                "this job's socket name is held by someone else; the job's socket takes the \
                 alternate name, and the node's agent lists the job under it (set \
                 RINGWATCH_JOB_ID to a name of your own)"
            );
            path = socket_path(&dir, &alternate);
            state.hello.job_id = alternate;
        }
        let err = |message: String| CollectiveError::Control {
            path: path.display().to_string(),
            message,
        };
        let listener = UnixListener::bind(&path).map_err(|e| err(format!("cannot bind: {e}")))?;
        let server = Arc::new(ControlServer {
            path: path.clone(),
            state,
            clients: Mutex::new(Vec::new()),
            knob_requests: Mutex::new(Vec::new()),
            stats_subscribers: AtomicUsize::new(0),
            timeline_subscribers: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            accept_thread: Mutex::new(None),
            refused_clients: AtomicU64::new(0),
            slow_clients_closed: AtomicU64::new(0),
            stall: Mutex::new(None),
        });
        let s = server.clone();
        let thread = std::thread::Builder::new()
            .name("ringwatch-control".into())
            .spawn(move || s.accept_loop(listener))
            .map_err(|e| err(format!("cannot start the server thread: {e}")))?;
        if let Ok(mut t) = server.accept_thread.lock() {
            *t = Some(thread);
        }
        tracing::info!(path = %path.display(), "control socket listening");
        Ok(server)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn accept_loop(self: Arc<Self>, listener: UnixListener) {
        for stream in listener.incoming() {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            match stream {
                Ok(stream) => {
                    // The host's other ranks (sending their timeline) have slots of
                    // their own: clients never crowd them out, nor they the clients.
                    let rank_peer = self.is_local_rank(&stream);
                    let connected = self
                        .clients
                        .lock()
                        .map(|c| c.iter().filter(|c| c.rank_peer == rank_peer).count())
                        .unwrap_or(0);
                    let limit = if rank_peer {
                        self.state.hello.local_ranks().count()
                    } else {
                        MAX_CLIENTS
                    };
                    if let Err(why) = client_allowed(&stream) {
                        self.refuse_stranger(stream, &why);
                    } else if connected >= limit {
                        self.refuse(stream, connected);
                    } else if let Err(e) = self.clone().add_client(stream, rank_peer) {
                        tracing::warn!(error = %e, "could not serve a control client");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "control socket accept failed"),
            }
        }
    }

    /// Answers a client of another user with an `error` message and closes it.
    fn refuse_stranger(&self, mut stream: UnixStream, why: &str) {
        tracing::warn!(why, "control client refused");
        let message = ServerMessage::Error {
            request_id: None,
            message: format!("{why}; closing this connection"),
        };
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        for frame in encode(&message) {
            let _ = stream.write_all(&frame);
        }
    }

    /// Answers a client past [`MAX_CLIENTS`] with an `error` message and closes it; the
    /// write cannot hold up the accept loop (a fresh socket's buffer takes the short
    /// message, and a write timeout bounds it anyway).
    fn refuse(&self, mut stream: UnixStream, connected: usize) {
        let refused = self.refused_clients.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            connected,
            max = MAX_CLIENTS,
            refused,
            "control client refused: too many clients connected"
        );
        let message = ServerMessage::Error {
            request_id: None,
            message: format!(
                "this job serves at most {MAX_CLIENTS} control clients at once and \
                 {connected} are connected; closing this connection (close an idle client \
                 and retry)"
            ),
        };
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        for frame in encode(&message) {
            let _ = stream.write_all(&frame);
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }

    /// Whether the process at the other end is another rank of this host (its pid, as
    /// the kernel gives it in this namespace, is one the job's `hello` lists for this
    /// host: ranks of one host share a pid namespace with their first rank).
    fn is_local_rank(&self, stream: &UnixStream) -> bool {
        let Ok(peer) = crate::control::peer_credentials(stream) else {
            return false;
        };
        let hello = &self.state.hello;
        peer.pid != std::process::id()
            && hello
                .local_ranks()
                .any(|r| r.pid == peer.pid && r.rank != hello.served_by_rank())
    }

    fn add_client(self: Arc<Self>, stream: UnixStream, rank_peer: bool) -> std::io::Result<()> {
        // Bounds how long the writer may block on a client that does not read.
        stream.set_write_timeout(Some(CLIENT_WRITE_TIMEOUT))?;
        let client = Arc::new(Client {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            stream: stream.try_clone()?,
            outbox: Mutex::new(Outbox::default()),
            wake_writer: Condvar::new(),
            stats: AtomicBool::new(false),
            timeline: AtomicBool::new(false),
            feeder: AtomicBool::new(false),
            rank_peer,
            same_process: crate::control::peer_credentials(&stream)
                .is_ok_and(|p| p.pid == std::process::id()),
        });
        let (knobs, cycle) = self.knob_state();
        let mut hello = self.state.hello.clone();
        hello.knobs = knobs;
        hello.cycle = cycle;
        hello.autotune = self.state.claims.state();
        client.send(&encode(&ServerMessage::Hello(hello)));
        if let Ok(mut clients) = self.clients.lock() {
            clients.push(client.clone());
        }
        let mut writer = stream.try_clone()?;
        let wclient = client.clone();
        let wserver = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-control-tx".into())
            .spawn(move || {
                while let Some(frame) = wclient.next_frame() {
                    if let Err(e) = writer.write_all(&frame) {
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) {
                            wserver.close_slow(
                                &wclient,
                                &format!("a write blocked for {CLIENT_WRITE_TIMEOUT:?}"),
                            );
                        }
                        break;
                    }
                }
                wclient.close();
                let _ = writer.shutdown(std::net::Shutdown::Both);
            });
        if let Err(e) = spawned {
            self.remove_client(&client);
            return Err(e);
        }
        let mut reader = stream;
        let rclient = client.clone();
        let server = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-control-rx".into())
            .spawn(move || {
                server.serve_client(&rclient, &mut reader);
                server.remove_client(&rclient);
            });
        if let Err(e) = spawned {
            // The writer ends once the client is closed and its socket shut.
            let _ = client.stream.shutdown(std::net::Shutdown::Both);
            self.remove_client(&client);
            return Err(e);
        }
        Ok(())
    }

    /// Queues `frames` for `client`; a client whose queue would pass
    /// [`CLIENT_QUEUE_BYTES`] is closed as too slow. Never blocks on the client.
    fn send(&self, client: &Client, frames: &[Frame]) {
        if let Queued::TooSlow { queued_bytes } = client.send(frames) {
            self.close_slow(
                client,
                &format!(
                    "{queued_bytes} bytes were waiting and {} more would pass the limit of \
                     {CLIENT_QUEUE_BYTES}",
                    frames.iter().map(|f| f.len()).sum::<usize>()
                ),
            );
        }
    }

    /// Disconnects a client that reads too slowly: its queue is dropped and its socket shut
    /// down, which ends its reader and writer threads.
    fn close_slow(&self, client: &Client, why: &str) {
        client.close();
        let _ = client.stream.shutdown(std::net::Shutdown::Both);
        let closed = self.slow_clients_closed.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(
            client = client.id,
            slow_clients_closed = closed,
            "control client closed: it reads too slowly ({why})"
        );
    }

    fn serve_client(&self, client: &Arc<Client>, reader: &mut UnixStream) {
        loop {
            match read_client_message(reader) {
                Ok(ClientMessage::Subscribe { stats, timeline }) => {
                    let was = client.stats.swap(stats, Ordering::AcqRel);
                    adjust(&self.stats_subscribers, was, stats);
                    if stats && !was {
                        let stall = self.stall.lock().ok().and_then(|s| s.clone());
                        if let Some(report) = stall {
                            self.send(client, &encode(&ServerMessage::Stall(report)));
                        }
                    }
                    let was = client.timeline.swap(timeline, Ordering::AcqRel);
                    if adjust(&self.timeline_subscribers, was, timeline) {
                        self.tell_feeders();
                    }
                }
                Ok(ClientMessage::RankTimeline { .. })
                    if !(client.rank_peer || client.same_process) =>
                {
                    tracing::warn!(
                        client = client.id,
                        "a client that is not a rank of this host sent timeline events; \
                         closing it"
                    );
                    self.send(
                        client,
                        &encode(&ServerMessage::Error {
                            request_id: None,
                            message: "only the job's ranks on this host may send timeline \
                                      events; closing this connection"
                                .into(),
                        }),
                    );
                    return;
                }
                Ok(ClientMessage::RankTimeline { events }) => {
                    if !client.feeder.swap(true, Ordering::AcqRel) {
                        self.send(
                            client,
                            &encode(&ServerMessage::TimelineWanted {
                                wanted: self.wants_timeline(),
                            }),
                        );
                    }
                    // Only this host's ranks (a rank of another host has its own socket).
                    let host = self.state.hello.host();
                    let local = |rank: usize| {
                        self.state
                            .hello
                            .ranks
                            .get(rank)
                            .is_some_and(|r| r.host == host)
                    };
                    let events: Vec<TimelineEvent> =
                        events.into_iter().filter(|e| local(e.rank)).collect();
                    self.publish_timeline(&events);
                }
                Ok(ClientMessage::GetKnobs { request_id }) => {
                    let (knobs, cycle) = self.knob_state();
                    self.send(
                        client,
                        &encode(&ServerMessage::Knobs {
                            request_id,
                            knobs,
                            cycle,
                        }),
                    );
                }
                Ok(ClientMessage::SetKnobs { request_id, knobs }) => {
                    if let Ok(mut q) = self.knob_requests.lock() {
                        q.push(KnobRequest {
                            client: client.clone(),
                            request_id,
                            update: knobs,
                        });
                    }
                }
                Ok(ClientMessage::ClaimTuning { request_id }) if !self.state.hello.is_rank0() => {
                    self.send(client, &encode(&self.not_rank0(request_id)));
                }
                Ok(ClientMessage::ReleaseTuning { request_id, .. })
                    if !self.state.hello.is_rank0() =>
                {
                    self.send(client, &encode(&self.not_rank0(request_id)));
                }
                Ok(ClientMessage::ClaimTuning { request_id }) => {
                    let answer = self.state.claims.claim(client.id);
                    tracing::info!(
                        client = client.id,
                        granted = answer.granted,
                        state = answer.state.as_str(),
                        "tuning claim: {}",
                        answer.message
                    );
                    self.send(client, &encode(&answer.into_message(request_id)));
                }
                Ok(ClientMessage::ReleaseTuning {
                    request_id,
                    completed,
                }) => {
                    let answer = self.state.claims.release(client.id, completed);
                    tracing::info!(
                        client = client.id,
                        completed,
                        granted = answer.granted,
                        state = answer.state.as_str(),
                        "tuning release: {}",
                        answer.message
                    );
                    self.send(client, &encode(&answer.into_message(request_id)));
                }
                Err(ControlError::Closed) => return,
                Err(e) => {
                    tracing::warn!(client = client.id, error = %e, "closing a control client");
                    self.send(
                        client,
                        &encode(&ServerMessage::Error {
                            request_id: None,
                            message: format!("{e}; closing this connection"),
                        }),
                    );
                    return;
                }
            }
        }
    }

    /// The answer to a claim on a socket that is not rank 0's: the job's one claim is
    /// held there.
    fn not_rank0(&self, request_id: u64) -> ServerMessage {
        let hello = &self.state.hello;
        let rank0_host = hello.ranks.first().map_or("?", |r| r.host.as_str());
        ServerMessage::TuningClaim {
            request_id,
            granted: false,
            state: AutotuneState::Off,
            message: format!(
                "this socket speaks for host {} (rank {}); job {}'s tuning claim is held \
                 through rank 0's socket on host {rank0_host}: tune it there (its node's agent)",
                hello.host(),
                hello.served_by_rank(),
                hello.job_id
            ),
        }
    }

    /// Tells every feeding rank whether the timeline is wanted now.
    fn tell_feeders(&self) {
        let wanted = self.wants_timeline();
        self.for_each(
            |c| c.feeder.load(Ordering::Relaxed),
            || ServerMessage::TimelineWanted { wanted },
        );
    }

    fn remove_client(&self, client: &Arc<Client>) {
        if self.state.claims.disconnected(client.id) {
            tracing::warn!(
                client = client.id,
                "the tuning client went away holding its claim; the job stays on its \
                 current knobs (autotune state: interrupted)"
            );
        }
        adjust(
            &self.stats_subscribers,
            client.stats.swap(false, Ordering::AcqRel),
            false,
        );
        if adjust(
            &self.timeline_subscribers,
            client.timeline.swap(false, Ordering::AcqRel),
            false,
        ) {
            self.tell_feeders();
        }
        client.close();
        if let Ok(mut clients) = self.clients.lock() {
            clients.retain(|c| c.id != client.id);
        }
    }

    fn knob_state(&self) -> (Knobs, u64) {
        self.state.knobs.lock().map(|g| *g).unwrap_or_default()
    }

    /// Whether knob changes wait for the next cycle's request.
    pub fn has_knob_requests(&self) -> bool {
        self.knob_requests.lock().map_or(true, |q| !q.is_empty())
    }

    /// Knob changes asked for since the last call.
    pub fn take_knob_requests(&self) -> Vec<KnobRequest> {
        self.knob_requests
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default()
    }

    /// Tells the clients behind `requests` that `knobs` are in force from `cycle` on.
    pub fn confirm(&self, requests: Vec<KnobRequest>, knobs: Knobs, cycle: u64) {
        for r in requests {
            self.send(
                &r.client,
                &encode(&ServerMessage::KnobsApplied {
                    request_id: r.request_id,
                    knobs,
                    applied_at_cycle: cycle,
                }),
            );
        }
    }

    /// Whether any client wants timeline events.
    pub fn wants_timeline(&self) -> bool {
        self.timeline_subscribers.load(Ordering::Relaxed) > 0
    }

    /// Whether any client subscribed to the cycles' statistics.
    pub fn wants_stats(&self) -> bool {
        self.stats_subscribers.load(Ordering::Relaxed) > 0
    }

    /// Sends one cycle's statistics to subscribers.
    pub fn publish_stats(&self, stats: &CycleStats) {
        if !self.wants_stats() {
            return;
        }
        self.for_each(
            |c| c.stats.load(Ordering::Relaxed),
            || ServerMessage::CycleStats(stats.clone()),
        );
    }

    /// Sends a change of the job's stall state to the `stats` subscribers, and keeps it
    /// for those who subscribe while it lasts.
    pub fn publish_stall(&self, report: StallReport) {
        if let Ok(mut kept) = self.stall.lock() {
            *kept = (!report.stalled.is_empty()).then(|| report.clone());
        }
        self.for_each(
            |c| c.stats.load(Ordering::Relaxed),
            || ServerMessage::Stall(report.clone()),
        );
    }

    /// Sends timeline events to subscribers.
    pub fn publish_timeline(&self, events: &[TimelineEvent]) {
        if events.is_empty() || !self.wants_timeline() {
            return;
        }
        self.for_each(
            |c| c.timeline.load(Ordering::Relaxed),
            || ServerMessage::Timeline {
                events: events.to_vec(),
            },
        );
    }

    /// Encodes the message once (only if some client wants it) and queues it for each.
    fn for_each(&self, wants: impl Fn(&Client) -> bool, message: impl Fn() -> ServerMessage) {
        let clients: Vec<Arc<Client>> = self
            .clients
            .lock()
            .map(|c| c.iter().filter(|c| wants(c)).cloned().collect())
            .unwrap_or_default();
        if clients.is_empty() {
            return;
        }
        let frames = encode(&message());
        for c in &clients {
            self.send(c, &frames);
        }
    }

    /// Clients connected now, clients refused so far for being too many, and clients
    /// closed so far for reading too slowly.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn client_counts(&self) -> (usize, u64, u64) {
        (
            self.clients.lock().map(|c| c.len()).unwrap_or(0),
            self.refused_clients.load(Ordering::Relaxed),
            self.slow_clients_closed.load(Ordering::Relaxed),
        )
    }

    /// Closes every client, stops accepting and removes the socket file.
    pub fn stop(&self) {
        if self.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the blocking accept.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.accept_thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
        let clients: Vec<Arc<Client>> = self.clients.lock().map(|c| c.clone()).unwrap_or_default();
        for c in clients {
            c.close();
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Counts a client in or out; true when the count went from 0 to 1 or from 1 to 0.
fn adjust(counter: &AtomicUsize, was: bool, now: bool) -> bool {
    match (was, now) {
        (false, true) => counter.fetch_add(1, Ordering::AcqRel) == 0,
        (true, false) => counter.fetch_sub(1, Ordering::AcqRel) == 1,
        _ => false,
    }
}

/// A rank that is not its host's first sends its timeline events to its host's socket
/// (`rank_timeline`), which streams them with its own. It never blocks the cycle: it
/// connects at most once a second, writes with a short timeout (a failed write drops the
/// connection and the cycle's events), and builds events only while the socket says a
/// client wants them.
pub(crate) struct Feeder {
    /// The runtime dir and the job's id: the socket is `<id>.sock`, or an
    /// alternate name `<id>.taken-…` where that was held.
    dir: PathBuf,
    job_id: String,
    stream: Option<UnixStream>,
    wanted: Arc<AtomicBool>,
    last_try: Option<std::time::Instant>,
    /// Servers refused (not this job's user), logged once each.
    refused: Vec<(PathBuf, u32)>,
}

/// How long a feeder's write may block before it gives up the connection.
const FEEDER_WRITE_TIMEOUT: Duration = Duration::from_millis(20);

impl Feeder {
    /// A feeder for the socket of `job_id` in `dir` (the runtime dir the host's first rank
    /// picks by the same rules).
    pub fn new(dir: Option<PathBuf>, job_id: &str) -> Self {
        Feeder {
            dir: dir.unwrap_or_else(default_runtime_dir),
            job_id: job_id.to_owned(),
            stream: None,
            wanted: Arc::new(AtomicBool::new(false)),
            last_try: None,
            refused: Vec::new(),
        }
    }

    /// The job's socket name, then its alternate names in the directory (at most 16).
    fn candidates(&self) -> Vec<PathBuf> {
        let mut paths = vec![socket_path(&self.dir, &self.job_id)];
        let prefix = format!("{}{ALTERNATE_MARK}", self.job_id);
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            paths.extend(
                entries
                    .flatten()
                    .filter(|e| {
                        e.file_name()
                            .to_str()
                            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".sock"))
                    })
                    .take(16)
                    .map(|e| e.path()),
            );
        }
        paths
    }

    /// A connection to the first of the job's socket names served by this job's user
    /// (or root): the events carry the job's tensor names, so a socket of anyone else (a
    /// squatter of the name) gets nothing. Another user's socket is not even connected
    /// to (its backlog could block the connect); the server is checked again once
    /// connected (`SO_PEERCRED`).
    fn connect_to_the_job(&mut self) -> Option<UnixStream> {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        for path in self.candidates() {
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let owner = if meta.uid() == me || meta.uid() == 0 {
                match UnixStream::connect(&path) {
                    Ok(stream) => match crate::control::peer_credentials(&stream) {
                        Ok(server) if server.uid == me || server.uid == 0 => return Some(stream),
                        Ok(server) => server.uid,
                        Err(_) => continue,
                    },
                    Err(_) => continue,
                }
            } else {
                meta.uid()
            };
            if !self.refused.contains(&(path.clone(), owner)) {
                tracing::warn!(
                    socket = %path.display(),
                    owner_uid = owner,
                    "not sending this rank's timeline there: the socket is another user's, \
                     not this job's"
                );
                if self.refused.len() < 16 {
                    self.refused.push((path, owner));
                }
            }
        }
        None
    }

    /// Whether this cycle's events are wanted (connecting first, at most once a second);
    /// `now`: the cycle's start, which the caller has read already.
    pub fn wants_timeline(&mut self, now: std::time::Instant) -> bool {
        if self.stream.is_none() {
            self.connect(now);
        }
        self.stream.is_some() && self.wanted.load(Ordering::Relaxed)
    }

    fn connect(&mut self, now: std::time::Instant) {
        if self
            .last_try
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        self.last_try = Some(now);
        let Some(mut stream) = self.connect_to_the_job() else {
            return;
        };
        let Ok(reader) = stream.try_clone() else {
            return;
        };
        if stream
            .set_write_timeout(Some(FEEDER_WRITE_TIMEOUT))
            .is_err()
            || crate::control::write_message(
                &mut stream,
                &ClientMessage::RankTimeline { events: Vec::new() },
            )
            .is_err()
        {
            return;
        }
        // The socket's answers (hello, then timeline_wanted as it changes) are read on a
        // thread of their own; it ends when the connection does.
        self.wanted.store(false, Ordering::Relaxed);
        let wanted = self.wanted.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-feeder".into())
            .spawn(move || {
                let mut reader = reader;
                while let Ok(message) = read_server_message(&mut reader) {
                    if let ServerMessage::TimelineWanted { wanted: w } = message {
                        wanted.store(w, Ordering::Relaxed);
                    }
                }
                wanted.store(false, Ordering::Relaxed);
            });
        if spawned.is_ok() {
            self.stream = Some(stream);
        }
    }

    /// Sends one cycle's events; a failed write drops the connection (retried later).
    pub fn send(&mut self, events: Vec<TimelineEvent>) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        if !self.wanted.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) =
            crate::control::write_message(stream, &ClientMessage::RankTimeline { events })
        {
            tracing::debug!(error = %e, "dropping the timeline connection to the host's socket");
            let _ = stream.shutdown(std::net::Shutdown::Both);
            self.stream = None;
            self.wanted.store(false, Ordering::Relaxed);
        }
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        if let Some(stream) = &self.stream {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{AutotuneState, ControlClient, PROTOCOL_VERSION, Phase, write_message};
    use std::time::Instant;

    fn server(tag: &str) -> (Arc<ControlServer>, PathBuf) {
        let dir = std::env::temp_dir().join(format!("rw-server-{tag}-{}", std::process::id()));
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            job_id: format!("server-test-{tag}"),
            world_size: 1,
            local_size: 1,
            ranks: Vec::new(),
            knobs: Knobs::default(),
            cycle: 0,
            autotune: AutotuneState::Off,
            host: None,
            served_by_rank: None,
        };
        let state = ServerState {
            hello,
            knobs: Arc::new(Mutex::new((Knobs::default(), 0))),
            claims: Arc::new(TuningClaims::new(AutotuneState::Off, None)),
        };
        (ControlServer::start(Some(dir.clone()), state).unwrap(), dir)
    }

    /// A process of user `nobody` serving a Unix socket at `path` until killed
    /// (`None`, saying why, where the test cannot make one: not root, no
    /// setpriv or /usr/bin/python3).
    fn squatter(path: &Path) -> Option<std::process::Child> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0
            || !Path::new("/usr/bin/setpriv").exists()
            || !Path::new("/usr/bin/python3").exists()
        {
            eprintln!("SKIPPED: the squatter needs root, /usr/bin/setpriv and /usr/bin/python3");
            return None;
        }
        let script = "import socket,sys,time\n\
                      s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n\
                      print('ready', flush=True)\n\
                      while True: c,_=s.accept()\n";
        let mut child = std::process::Command::new("/usr/bin/setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
            ])
            .arg(script)
            .arg(path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .ok()?;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take()?),
            &mut line,
        )
        .ok()?;
        assert_eq!(line.trim(), "ready", "the squatter did not start");
        Some(child)
    }

    #[test]
    fn a_name_squatted_by_another_user_gets_the_alternate_and_no_timeline() {
        let dir = std::env::temp_dir().join(format!("rw-squat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        let Some(mut squat) = squatter(&dir.join("relsq.sock")) else {
            return;
        };
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            job_id: "relsq".into(),
            world_size: 2,
            local_size: 2,
            ranks: Vec::new(),
            knobs: Knobs::default(),
            cycle: 0,
            autotune: AutotuneState::Off,
            host: None,
            served_by_rank: Some(0),
        };
        let state = || ServerState {
            hello: hello.clone(),
            knobs: Arc::new(Mutex::new((Knobs::default(), 0))),
            claims: Arc::new(TuningClaims::new(AutotuneState::Off, None)),
        };
        let me = std::process::id();
        let server = ControlServer::start(Some(dir.clone()), state()).unwrap();
        let stem = server
            .path()
            .file_stem()
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        let suffix = stem
            .strip_prefix("relsq.taken-")
            .expect("the alternate name");
        assert!(
            suffix.len() == 12 && suffix.chars().all(|c| c.is_ascii_hexdigit()),
            "{stem}"
        );
        // The agent finds the job under its alternate name.
        let client = ControlClient::connect(server.path(), Duration::from_secs(60)).unwrap();
        assert_eq!(client.hello().job_id, stem);
        // A rank's feeder skips the squatter's socket for the job's own.
        let mut feeder = Feeder::new(Some(dir.clone()), "relsq");
        let stream = feeder.connect_to_the_job().expect("the job's own socket");
        let server_pid = crate::control::peer_credentials(&stream).unwrap().pid;
        assert_eq!(server_pid, me);
        assert_eq!(feeder.refused, vec![(dir.join("relsq.sock"), 65534)]);
        drop(stream);
        drop(client);
        server.stop();
        // Not only a live socket holds a name: another user's plain file
        // does too (a socket nobody serves cannot be told from one whose
        // backlog is full without connecting).
        let _ = squat.kill();
        let _ = squat.wait();
        std::fs::remove_file(dir.join("relsq.sock")).unwrap();
        std::fs::write(dir.join("relsq.sock"), b"squat").unwrap();
        std::os::unix::fs::chown(dir.join("relsq.sock"), Some(65534), Some(65534)).unwrap();
        let server = ControlServer::start(Some(dir.clone()), state()).unwrap();
        assert!(
            server.path().to_str().unwrap().contains("relsq.taken-"),
            "{}",
            server.path().display()
        );
        server.stop();
        // This user's socket that nobody serves was left by a crash: reused.
        std::fs::remove_file(dir.join("relsq.sock")).unwrap();
        drop(std::os::unix::net::UnixListener::bind(dir.join("relsq.sock")).unwrap());
        let server = ControlServer::start(Some(dir.clone()), state()).unwrap();
        assert_eq!(server.path(), dir.join("relsq.sock"));
        server.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Polls `done` until it holds; the limit only guards against a hang.
    fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A timeline batch of `n` events, about 150 bytes each once encoded.
    fn events(n: usize) -> Vec<TimelineEvent> {
        (0..n)
            .map(|i| TimelineEvent {
                rank: 0,
                tensor: format!("grad.{i}"),
                activity: "ALLREDUCE".into(),
                phase: Phase::Begin,
                ts_us: i as u64,
                args: Default::default(),
            })
            .collect()
    }

    #[test]
    fn clients_past_the_limit_are_refused_with_an_error_and_a_freed_slot_is_reused() {
        let (server, dir) = server("limit");
        let path = server.path().to_path_buf();
        let timeout = Duration::from_secs(20);
        let mut clients: Vec<ControlClient> = (0..MAX_CLIENTS)
            .map(|_| ControlClient::connect(&path, timeout).unwrap())
            .collect();
        for extra in 0..3 {
            match ControlClient::connect(&path, timeout) {
                Err(ControlError::Server(m)) => {
                    assert!(m.contains(&format!("at most {MAX_CLIENTS}")), "{m}")
                }
                other => panic!("client {} past the limit: {other:?}", MAX_CLIENTS + extra),
            }
        }
        assert_eq!(server.client_counts(), (MAX_CLIENTS, 3, 0));
        // A client that leaves frees its slot (and its threads: they end with it).
        drop(clients.pop());
        eventually("the closed client is removed", || {
            server.client_counts().0 == MAX_CLIENTS - 1
        });
        clients.push(ControlClient::connect(&path, timeout).unwrap());
        assert_eq!(server.client_counts(), (MAX_CLIENTS, 3, 0));
        server.stop();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_client_of_another_user_is_refused() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/python3").exists() {
            eprintln!("skipped: needs root (to connect as nobody) and /usr/bin/python3");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let (server, dir) = server("stranger");
        let path = server.path().to_path_buf();
        // Even a socket anyone may connect to serves only its own user and root.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let script = "import socket,struct,sys\n\
            s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(20)\n\
            n=struct.unpack('>I', s.recv(4, socket.MSG_WAITALL))[0]\n\
            print(s.recv(n, socket.MSG_WAITALL).decode())\n";
        let out = std::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .args(["/usr/bin/python3", "-c", script])
            .arg(&path)
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&out.stdout);
        assert!(answer.contains("\"error\""), "{answer} {out:?}");
        assert!(answer.contains("serves only uid 0 and root"), "{answer}");
        assert!(answer.contains("runs as uid 65534"), "{answer}");
        // Root (the agent) is still served.
        assert!(ControlClient::connect(&path, Duration::from_secs(20)).is_ok());
        server.stop();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_subscriber_that_never_reads_is_closed_its_queue_bounded_and_a_reader_keeps_up() {
        let (server, dir) = server("slow");
        let path = server.path().to_path_buf();
        let mut reader = ControlClient::connect(&path, Duration::from_secs(20)).unwrap();
        reader.subscribe(false, true).unwrap();
        // The slow one: reads its hello, subscribes, then never reads again.
        let mut slow = UnixStream::connect(&path).unwrap();
        let hello: ServerMessage = crate::control::read_message(&mut slow).unwrap();
        assert!(matches!(hello, ServerMessage::Hello(_)));
        write_message(
            &mut slow,
            &ClientMessage::Subscribe {
                stats: true,
                timeline: true,
            },
        )
        .unwrap();
        eventually("both subscribed", || {
            server.timeline_subscribers.load(Ordering::Relaxed) == 2
        });
        // The test is the cycle thread: publish, and the reader takes each batch before the
        // next, so it never has more than one waiting.
        let batch = events(1000);
        let batch_bytes = encode(&ServerMessage::Timeline {
            events: batch.clone(),
        })[0]
            .len();
        let mut published = 0usize;
        while server.client_counts().2 == 0 {
            assert!(
                published * batch_bytes < 64 * CLIENT_QUEUE_BYTES,
                "the slow client was never closed"
            );
            server.publish_timeline(&batch);
            published += 1;
            let clients = server.clients.lock().unwrap().clone();
            for c in &clients {
                assert!(c.queued_bytes() <= CLIENT_QUEUE_BYTES);
            }
            match reader.next_message(Duration::from_secs(20)).unwrap() {
                Some(ServerMessage::Timeline { events }) => assert_eq!(events, batch),
                other => panic!("the reader got {other:?}"),
            }
        }
        // It was closed once its queue was full (on top of what the kernel buffers).
        assert!(published * batch_bytes > CLIENT_QUEUE_BYTES);
        eventually("the slow client is removed", || {
            server.client_counts().0 == 1
        });
        // What reaches it is what was queued or in the kernel buffer, then the end.
        let mut received = Vec::new();
        std::io::Read::read_to_end(&mut slow, &mut received).unwrap();
        assert!(received.len() < published * batch_bytes);
        assert!(received.len() <= CLIENT_QUEUE_BYTES + (8 << 20));
        // The reader is still served.
        server.publish_timeline(&batch);
        assert!(matches!(
            reader.next_message(Duration::from_secs(20)).unwrap(),
            Some(ServerMessage::Timeline { .. })
        ));
        assert_eq!(server.client_counts(), (1, 0, 1));
        server.stop();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_timeline_batch_over_the_frame_limit_is_split_not_lost() {
        let batch = events(20_000);
        let frames = encode(&ServerMessage::Timeline {
            events: batch.clone(),
        });
        assert!(frames.len() > 1);
        let mut got = Vec::new();
        for f in &frames {
            assert!(f.len() <= 4 + MAX_MESSAGE_BYTES);
            match crate::control::read_message::<_, ServerMessage>(&mut &f[..]).unwrap() {
                ServerMessage::Timeline { events } => got.extend(events),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, batch);
    }

    #[test]
    fn an_unusable_runtime_dir_falls_back_to_a_writable_one() {
        // Nothing can be created under /proc, even as root.
        let dir = pick_dir(Some(PathBuf::from("/proc/ringwatch-test"))).unwrap();
        assert_ne!(dir, PathBuf::from("/proc/ringwatch-test"));
        assert!(writable(&dir));
        assert!(fallback_runtime_dirs().contains(&dir));
    }
}
