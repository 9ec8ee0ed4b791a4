//! Rank 0's control socket server: speaks [`crate::control`]'s protocol to any number of
//! clients (the agent, tools, tests).
//!
//! It must never touch the data path: it only reads the shared knob state, queues knob
//! requests for the coordinator, and forwards statistics and timeline events. A client that
//! misbehaves or reads too slowly is closed or loses messages (counted); the job never
//! waits on a client. Tuning claims are kept in [`TuningClaims`], held per connection: when
//! a connection ends, for whatever reason, its claim ends as `interrupted`.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::control::{
    ClientMessage, ControlError, CycleStats, Hello, KnobUpdate, Knobs, ServerMessage,
    TimelineEvent, default_runtime_dir, fallback_runtime_dirs, read_message, socket_path,
    write_message,
};
use crate::error::{CollectiveError, Result};
use crate::runtime::claim::TuningClaims;

/// Messages queued per client before newer ones are dropped.
const CLIENT_QUEUE: usize = 4096;

struct Client {
    id: u64,
    stream: UnixStream,
    tx: Mutex<Option<SyncSender<ServerMessage>>>,
    stats: AtomicBool,
    timeline: AtomicBool,
    dropped: AtomicU64,
}

impl Client {
    fn send(&self, m: ServerMessage) {
        if let Ok(guard) = self.tx.lock()
            && let Some(tx) = guard.as_ref()
            && let Err(TrySendError::Full(_)) = tx.try_send(m)
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn close(&self) {
        if let Ok(mut guard) = self.tx.lock() {
            guard.take();
        }
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
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

impl ControlServer {
    /// Binds `<dir>/<job_id>.sock` and starts accepting clients.
    pub fn start(dir: Option<PathBuf>, state: ServerState) -> Result<Arc<Self>> {
        let dir = pick_dir(dir)?;
        let path = socket_path(&dir, &state.hello.job_id);
        let err = |message: String| CollectiveError::Control {
            path: path.display().to_string(),
            message,
        };
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(err(
                    "another live job serves this socket (same job id?)".into()
                ));
            }
            let _ = std::fs::remove_file(&path);
        }
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
                    if let Err(e) = self.clone().add_client(stream) {
                        tracing::warn!(error = %e, "could not serve a control client");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "control socket accept failed"),
            }
        }
    }

    fn add_client(self: Arc<Self>, stream: UnixStream) -> std::io::Result<()> {
        let (tx, rx) = mpsc::sync_channel::<ServerMessage>(CLIENT_QUEUE);
        let client = Arc::new(Client {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            stream: stream.try_clone()?,
            tx: Mutex::new(Some(tx)),
            stats: AtomicBool::new(false),
            timeline: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
        });
        let (knobs, cycle) = self.knob_state();
        let mut hello = self.state.hello.clone();
        hello.knobs = knobs;
        hello.cycle = cycle;
        hello.autotune = self.state.claims.state();
        client.send(ServerMessage::Hello(hello));
        if let Ok(mut clients) = self.clients.lock() {
            clients.push(client.clone());
        }
        let mut writer = stream.try_clone()?;
        let wclient = client.clone();
        std::thread::Builder::new()
            .name("ringwatch-control-tx".into())
            .spawn(move || {
                while let Ok(m) = rx.recv() {
                    if write_message(&mut writer, &m).is_err() {
                        break;
                    }
                }
                let dropped = wclient.dropped.load(Ordering::Relaxed);
                if dropped > 0 {
                    tracing::warn!(
                        client = wclient.id,
                        dropped,
                        "control client read too slowly; messages were dropped"
                    );
                }
                let _ = writer.shutdown(std::net::Shutdown::Both);
            })?;
        let mut reader = stream;
        std::thread::Builder::new()
            .name("ringwatch-control-rx".into())
            .spawn(move || {
                self.serve_client(&client, &mut reader);
                self.remove_client(&client);
            })?;
        Ok(())
    }

    fn serve_client(&self, client: &Arc<Client>, reader: &mut UnixStream) {
        loop {
            match read_message::<_, ClientMessage>(reader) {
                Ok(ClientMessage::Subscribe { stats, timeline }) => {
                    let was = client.stats.swap(stats, Ordering::AcqRel);
                    adjust(&self.stats_subscribers, was, stats);
                    let was = client.timeline.swap(timeline, Ordering::AcqRel);
                    adjust(&self.timeline_subscribers, was, timeline);
                }
                Ok(ClientMessage::GetKnobs { request_id }) => {
                    let (knobs, cycle) = self.knob_state();
                    client.send(ServerMessage::Knobs {
                        request_id,
                        knobs,
                        cycle,
                    });
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
                Ok(ClientMessage::ClaimTuning { request_id }) => {
                    let answer = self.state.claims.claim(client.id);
                    tracing::info!(
                        client = client.id,
                        granted = answer.granted,
                        state = answer.state.as_str(),
                        "tuning claim: {}",
                        answer.message
                    );
                    client.send(answer.into_message(request_id));
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
                    client.send(answer.into_message(request_id));
                }
                Err(ControlError::Closed) => return,
                Err(e) => {
                    tracing::warn!(client = client.id, error = %e, "closing a control client");
                    client.send(ServerMessage::Error {
                        request_id: None,
                        message: format!("{e}; closing this connection"),
                    });
                    return;
                }
            }
        }
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
        adjust(
            &self.timeline_subscribers,
            client.timeline.swap(false, Ordering::AcqRel),
            false,
        );
        client.close();
        if let Ok(mut clients) = self.clients.lock() {
            clients.retain(|c| c.id != client.id);
        }
    }

    fn knob_state(&self) -> (Knobs, u64) {
        self.state.knobs.lock().map(|g| *g).unwrap_or_default()
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
            r.client.send(ServerMessage::KnobsApplied {
                request_id: r.request_id,
                knobs,
                applied_at_cycle: cycle,
            });
        }
    }

    /// Whether any client wants timeline events.
    pub fn wants_timeline(&self) -> bool {
        self.timeline_subscribers.load(Ordering::Relaxed) > 0
    }

    /// Sends one cycle's statistics to subscribers.
    pub fn publish_stats(&self, stats: &CycleStats) {
        if self.stats_subscribers.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.for_each(
            |c| c.stats.load(Ordering::Relaxed),
            || ServerMessage::CycleStats(stats.clone()),
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

    fn for_each(&self, wants: impl Fn(&Client) -> bool, message: impl Fn() -> ServerMessage) {
        let clients: Vec<Arc<Client>> = self.clients.lock().map(|c| c.clone()).unwrap_or_default();
        for c in clients.iter().filter(|c| wants(c)) {
            c.send(message());
        }
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

fn adjust(counter: &AtomicUsize, was: bool, now: bool) {
    match (was, now) {
        (false, true) => {
            counter.fetch_add(1, Ordering::AcqRel);
        }
        (true, false) => {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unusable_runtime_dir_falls_back_to_a_writable_one() {
        // Nothing can be created under /proc, even as root.
        let dir = pick_dir(Some(PathBuf::from("/proc/ringwatch-test"))).unwrap();
        assert_ne!(dir, PathBuf::from("/proc/ringwatch-test"));
        assert!(writable(&dir));
        assert!(fallback_runtime_dirs().contains(&dir));
    }
}
