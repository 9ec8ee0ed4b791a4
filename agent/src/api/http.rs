//! `http`: serves the API's router over TCP with the bounds a root daemon on
//! a shared node needs against slow, idle or hostile clients.
//!
//! `axum::serve` has no header-read timeout and no connection limit: 1100
//! half-sent requests once exhausted the agent's file descriptors and left
//! `/api/health` unanswered for a minute. Here every connection is HTTP/1
//! with a header-read timeout (which also closes idle keep-alive
//! connections), every request has a deadline (a body that trickles in, or
//! never comes, ends in 408), and the number of open connections is capped.
//! At the cap a new connection does not wait behind the old ones: the
//! oldest connection that is not inside a request right now (idle, or still
//! sending its headers) is closed to make room, so a flood of slow clients
//! cannot lock out a health check. Only when every connection is inside a
//! request is the new one refused. Both are counted and logged.
//!
//! It must never: block the accept loop on a client, keep a connection past
//! the header-read timeout without a request, or buffer more than hyper's
//! per-connection buffer for one client.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tower::ServiceExt;

/// The bounds on the API's connections.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections open at once; at the cap the oldest idle one is closed.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, counted from the end
    /// of the previous request on a keep-alive connection.
    pub header_read_timeout: Duration,
    /// Time from a request's headers to its answer, reading the body
    /// included.
    pub request_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// hyper's read buffer per connection (its default is ~400 KiB); request
/// headers must fit in it.
const MAX_BUFFER_BYTES: usize = 64 * 1024;

/// How long open connections get to finish their request at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Counts of what the limits did, for logs and tests.
#[derive(Debug, Default)]
pub struct HttpCounters {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Idle or header-sending connections closed to make room at the cap.
    pub evicted: AtomicU64,
    /// New connections closed at once because every open one was busy.
    pub refused: AtomicU64,
    /// Requests answered 408 because they took longer than the deadline.
    pub timed_out: AtomicU64,
    /// Connections open now.
    pub open: AtomicUsize,
}

/// One open connection, as the accept loop sees it.
struct Connection {
    id: u64,
    /// Requests being handled on it now (0: idle or sending headers).
    in_request: Arc<AtomicUsize>,
    /// Tells its task to close it.
    evict: Arc<Notify>,
    /// Its task says it has closed it.
    closed: Arc<Notify>,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    connections: Mutex<VecDeque<Connection>>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Connection>> {
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes room for one more connection under `max`: `Room::Free` when
    /// there is room, `Room::Evicted` after telling the oldest connection
    /// that is not inside a request to close (wait for it before accepting,
    /// so the descriptors stay within the cap), `Room::Full` when every open
    /// connection is busy.
    fn make_room(&self, max: usize, counters: &HttpCounters) -> Room {
        let mut connections = self.lock();
        if connections.len() < max {
            return Room::Free;
        }
        let Some(index) = connections
            .iter()
            .position(|c| c.in_request.load(Ordering::Acquire) == 0)
        else {
            return Room::Full;
        };
        match connections.remove(index) {
            Some(oldest) => {
                oldest.evict.notify_one();
                counters.evicted.fetch_add(1, Ordering::Relaxed);
                Room::Evicted(oldest.closed)
            }
            None => Room::Full,
        }
    }

    fn insert(&self, connection: Connection) {
        self.lock().push_back(connection);
    }

    fn remove(&self, id: u64) {
        self.lock().retain(|c| c.id != id);
    }
}

/// What [`Table::make_room`] did.
enum Room {
    Free,
    Evicted(Arc<Notify>),
    Full,
}

/// How long the accept loop waits for an evicted connection to close.
const EVICTION_WAIT: Duration = Duration::from_millis(200);

/// Decrements a connection's in-request count when a request ends, however
/// it ends (answered, timed out, or the connection dropped mid-request).
struct InRequest(Arc<AtomicUsize>);

impl InRequest {
    fn enter(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for InRequest {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves,
/// then gives open requests [`SHUTDOWN_GRACE`] to finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    counters: Arc<HttpCounters>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let table = Arc::new(Table::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut next_id = 0u64;
    let mut last_accept_error: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and friends: say so at most once a second and let
                // the timeouts free descriptors; never spin.
                if last_accept_error.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    tracing::warn!(%error, "the API cannot accept a connection");
                    last_accept_error = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let room = table.make_room(limits.max_connections, &counters);
        if let Room::Evicted(closed) = &room {
            let _ = tokio::time::timeout(EVICTION_WAIT, closed.notified()).await;
        }
        if matches!(room, Room::Full) {
            let refused = counters.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    %peer,
                    refused,
                    max_connections = limits.max_connections,
                    "the API refused a connection: every open connection is inside a request"
                );
            }
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        next_id += 1;
        let id = next_id;
        let in_request = Arc::new(AtomicUsize::new(0));
        let evict = Arc::new(Notify::new());
        let closed = Arc::new(Notify::new());
        table.insert(Connection {
            id,
            in_request: in_request.clone(),
            evict: evict.clone(),
            closed: closed.clone(),
        });
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        counters.open.fetch_add(1, Ordering::AcqRel);
        let in_request_of_socket = in_request.clone();
        let task = ConnectionTask {
            router: router.clone(),
            limits,
            counters: counters.clone(),
            in_request,
        };
        let table = table.clone();
        let mut stop_rx = stop_rx.clone();
        tokio::spawn(async move {
            let counters = task.counters.clone();
            let mut connection = Box::pin(
                hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_read_timeout)
                    .max_buf_size(MAX_BUFFER_BYTES)
                    .serve_connection(
                        TokioIo::new(WriteDeadline::new(
                            stream,
                            limits.request_timeout,
                            in_request_of_socket,
                        )),
                        task.service(),
                    ),
            );
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "API connection ended");
                    }
                }
                () = evict.notified() => {
                    tracing::debug!(%peer, "API connection closed to make room");
                }
                _ = async { stop_rx.wait_for(|stop| *stop).await.is_ok() } => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection.as_mut()).await;
                }
            }
            // The socket is closed once `connection` is dropped.
            drop(connection);
            table.remove(id);
            counters.open.fetch_sub(1, Ordering::AcqRel);
            closed.notify_one();
        });
    }
    let _ = stop_tx.send(true);
    // Let the connections see the stop and finish their requests.
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while counters.open.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one connection's requests run through.
struct ConnectionTask {
    router: Router,
    limits: HttpLimits,
    counters: Arc<HttpCounters>,
    in_request: Arc<AtomicUsize>,
}

impl ConnectionTask {
    fn service(
        self,
    ) -> impl hyper::service::Service<
        hyper::Request<Incoming>,
        Response = axum::response::Response,
        Error = Infallible,
        Future = impl Send,
    > + Send {
        let task = Arc::new(self);
        hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let task = task.clone();
            async move {
                let in_request = InRequest::enter(&task.in_request);
                let deadline = task.limits.request_timeout;
                match tokio::time::timeout(deadline, task.router.clone().oneshot(request)).await {
                    // Inside the request until its answer is sent (a large
                    // timeline answer is not "idle" while it streams).
                    Ok(Ok(answer)) => Ok(answer.map(|body| {
                        axum::body::Body::new(GuardedBody {
                            inner: body,
                            _in_request: in_request,
                        })
                    })),
                    Ok(Err(never)) => match never {},
                    Err(_) => {
                        task.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                        Ok(crate::api::ApiError::new(
                            axum::http::StatusCode::REQUEST_TIMEOUT,
                            format!(
                                "the request took longer than {deadline:?} (sending its body \
                             included); the agent closed it"
                            ),
                        )
                        .into_response())
                    }
                }
            }
        })
    }
}

/// A response body that keeps its connection counted as inside a request
/// until the body is done (or dropped).
struct GuardedBody {
    inner: axum::body::Body,
    _in_request: InRequest,
}

impl http_body::Body for GuardedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A socket whose writes fail when they make no progress for `limit`: hyper
/// has no write timeout, and a client that never reads would otherwise hold
/// its answer (and the slot it was built in) forever.
/// While a write waits on the client, the connection also counts as inside
/// a request (`busy`): an answer hyper holds in its buffers is not idle.
struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    busy: Arc<AtomicUsize>,
    /// An answer of hyper's own being replaced (see [`with_error_body`]):
    /// the bytes to write instead, how many are written, and the length of
    /// hyper's write they stand for.
    replacing: Option<(Vec<u8>, usize, usize)>,
}

/// hyper answers a request it cannot parse (a request line that is not
/// UTF-8, headers over the buffer) itself, before any handler runs, with an
/// empty 400 or 431. This gives such an answer the API's JSON error body.
/// `None` for any other write.
fn with_error_body(buf: &[u8]) -> Option<Vec<u8>> {
    let (status, why) = if buf.starts_with(b"HTTP/1.1 400 ") {
        (
            400,
            "the request could not be parsed as HTTP/1.1 (its request line or headers are malformed)",
        )
    } else if buf.starts_with(b"HTTP/1.1 431 ") {
        (431, "the request's headers are too large")
    } else {
        return None;
    };
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    // Only hyper's own: the API's errors always have a body.
    if end + 4 != buf.len()
        || !head
            .lines()
            .any(|l| l.eq_ignore_ascii_case("content-length: 0"))
    {
        return None;
    }
    let body = serde_json::json!({ "error": { "status": status, "message": why } }).to_string();
    let mut out = Vec::with_capacity(end + body.len() + 64);
    for line in head.lines() {
        if line.eq_ignore_ascii_case("content-length: 0") {
            out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
            out.extend_from_slice(b"content-type: application/json\r\n");
        } else {
            out.extend_from_slice(line.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, limit: Duration, busy: Arc<AtomicUsize>) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
            busy,
            replacing: None,
        }
    }

    /// A write went through: the stall (if any) is over.
    fn moving(&mut self) {
        if self.stalled.take().is_some() {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// `Pending` from the socket: start (or check) the stall clock.
    fn stalled<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future;
        let limit = self.limit;
        if self.stalled.is_none() {
            self.busy.fetch_add(1, Ordering::AcqRel);
        }
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl<S> Drop for WriteDeadline<S> {
    fn drop(&mut self) {
        self.moving();
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.replacing.is_none()
            && let Some(replacement) = with_error_body(buf)
        {
            self.replacing = Some((replacement, 0, buf.len()));
        }
        if let Some((bytes, written, stands_for)) = self.replacing.take() {
            let this = &mut *self;
            return match std::pin::Pin::new(&mut this.inner).poll_write(cx, &bytes[written..]) {
                std::task::Poll::Pending => {
                    this.replacing = Some((bytes, written, stands_for));
                    this.stalled(cx)
                }
                std::task::Poll::Ready(Ok(0)) => {
                    std::task::Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                std::task::Poll::Ready(Ok(n)) if written + n < bytes.len() => {
                    this.moving();
                    this.replacing = Some((bytes, written + n, stands_for));
                    // Ask to be called again for the rest.
                    cx.waker().wake_by_ref();
                    std::task::Poll::Pending
                }
                std::task::Poll::Ready(Ok(_)) => {
                    this.moving();
                    std::task::Poll::Ready(Ok(stands_for))
                }
                std::task::Poll::Ready(Err(e)) => std::task::Poll::Ready(Err(e)),
            };
        }
        match std::pin::Pin::new(&mut self.inner).poll_write(cx, buf) {
            std::task::Poll::Pending => self.stalled(cx),
            ready => {
                self.moving();
                ready
            }
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match std::pin::Pin::new(&mut self.inner).poll_flush(cx) {
            std::task::Poll::Pending => self.stalled(cx),
            ready => {
                self.moving();
                ready
            }
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Raises this process's soft limit on open files to its hard limit, so a
/// burst of clients meets the connection cap before the descriptor limit.
/// Returns the soft limit now in force.
pub fn raise_open_file_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid rlimit to write to.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit; the kernel checks the values.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use axum::routing::{get, post};

    use super::*;

    /// An agent-less server with `limits` on a free loopback port; stops when
    /// the returned sender is dropped.
    async fn start(
        limits: HttpLimits,
    ) -> (
        std::net::SocketAddr,
        Arc<HttpCounters>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let router = Router::new()
            .route("/api/health", get(|| async { "ok" }))
            .route(
                "/api/echo",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
            .route(
                "/api/big",
                get(|| async { axum::body::Body::new(Chunks(1024)) }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let counters = Arc::new(HttpCounters::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, router, limits, counters.clone(), async {
            let _ = rx.await;
        }));
        (address, counters, tx)
    }

    /// A streamed answer of this many 64 KiB chunks (as a timeline answer
    /// streams).
    struct Chunks(usize);

    impl http_body::Body for Chunks {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            if self.0 == 0 {
                return std::task::Poll::Ready(None);
            }
            self.0 -= 1;
            let chunk = axum::body::Bytes::from(vec![b'x'; 64 << 10]);
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
        }
    }

    /// One GET on a fresh connection, on a blocking thread: the answer's
    /// status line.
    async fn get_status(address: std::net::SocketAddr, path: &'static str) -> String {
        tokio::task::spawn_blocking(move || {
            let mut stream = TcpStream::connect(address).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            write!(
                stream,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            answer.lines().next().unwrap_or("").to_owned()
        })
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn half_sent_requests_make_room_for_a_health_check() {
        let limits = HttpLimits {
            max_connections: 8,
            header_read_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
        };
        let (address, counters, _stop) = start(limits).await;
        // More half-sent requests than the cap, each holding its connection.
        let mut slow = Vec::new();
        for _ in 0..20 {
            let mut stream = TcpStream::connect(address).unwrap();
            stream.write_all(b"GET /api/health HTTP/1.1\r\nHo").unwrap();
            slow.push(stream);
        }
        assert_eq!(get_status(address, "/api/health").await, "HTTP/1.1 200 OK");
        assert!(counters.evicted.load(Ordering::Relaxed) >= 13);
        // Evicted connections close on their own tasks: wait for them (the
        // limit is only a hang guard).
        let deadline = Instant::now() + Duration::from_secs(30);
        while counters.open.load(Ordering::Acquire) > 8 {
            assert!(Instant::now() < deadline, "connections stay over the cap");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_hyper_cannot_parse_get_the_json_error_body() {
        let (address, _counters, _stop) = start(HttpLimits::default()).await;
        let ask = move |request: Vec<u8>| {
            tokio::task::spawn_blocking(move || {
                let mut stream = TcpStream::connect(address).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(60)))
                    .unwrap();
                // The server may answer before it has read it all; the rest
                // is sent, then the writing side closed, so no unread bytes
                // reset the connection before the answer is read.
                let _ = stream.write_all(&request);
                let _ = stream.shutdown(std::net::Shutdown::Write);
                let mut answer = Vec::new();
                let _ = stream.read_to_end(&mut answer);
                String::from_utf8_lossy(&answer).into_owned()
            })
        };
        let not_utf8 = ask(b"GET /api/health\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n".to_vec())
            .await
            .unwrap();
        // Over hyper's count of headers (100), in a few KiB the server reads
        // whole: no unread bytes make its close a reset that could eat the
        // answer.
        let mut huge = b"GET /api/health HTTP/1.1\r\nHost: x\r\n".to_vec();
        for i in 0..150 {
            huge.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
        }
        huge.extend_from_slice(b"\r\n");
        let too_large = ask(huge).await.unwrap();
        for (answer, status) in [(not_utf8, "400"), (too_large, "431")] {
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status} ")),
                "{answer}"
            );
            let (head, body) = answer.split_once("\r\n\r\n").unwrap();
            assert!(head.contains("content-type: application/json"), "{head}");
            let body: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(body["error"]["status"].to_string(), status, "{body}");
            assert!(body["error"]["message"].as_str().unwrap().len() > 10);
        }
        // The API's own errors are left as they are.
        assert_eq!(get_status(address, "/api/health").await, "HTTP/1.1 200 OK");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_reads_its_answer_is_closed_and_not_counted_idle() {
        let limits = HttpLimits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(60),
            // Long enough that a stalled test still sees the refusal first.
            request_timeout: Duration::from_secs(15),
        };
        let (address, counters, _stop) = start(limits).await;
        // Asks for 64 MiB, streamed, and reads none of it past the status:
        // the kernel's buffers fill and the agent's writes stall.
        let mut stream = TcpStream::connect(address).unwrap();
        stream
            .write_all(b"GET /api/big HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        // The answer has begun (its handler is done)...
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        // ...and while it is stuck it is inside a request: a new client at
        // the cap is refused rather than the download cut off...
        let deadline = Instant::now() + Duration::from_secs(120);
        while counters.refused.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "never refused: {counters:?}");
            let _ = TcpStream::connect(address);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(counters.evicted.load(Ordering::Relaxed), 0);
        // ...and once its writes stall past the deadline the agent closes it.
        while counters.open.load(Ordering::Acquire) > 0 {
            assert!(
                Instant::now() < deadline,
                "the stalled answer is never dropped"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(get_status(address, "/api/health").await, "HTTP/1.1 200 OK");
        drop(stream);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_finishes_its_headers_is_closed() {
        let limits = HttpLimits {
            max_connections: 8,
            header_read_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_secs(60),
        };
        let (address, _counters, _stop) = start(limits).await;
        let closed = tokio::task::spawn_blocking(move || {
            let mut stream = TcpStream::connect(address).unwrap();
            // A hang guard only: the server closes long before it.
            stream
                .set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            stream.write_all(b"GET /api/health HTTP/1.1\r\n").unwrap();
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).map(|_| rest)
        })
        .await
        .unwrap();
        // Closed by the server (end of stream, maybe after a 408), not by
        // the guard's read timeout.
        let rest = closed.expect("the server closes the connection");
        assert!(rest.is_empty() || rest.starts_with(b"HTTP/1.1 408"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_never_comes_ends_in_408() {
        let limits = HttpLimits {
            max_connections: 8,
            header_read_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_millis(300),
        };
        let (address, counters, _stop) = start(limits).await;
        let answer = tokio::task::spawn_blocking(move || {
            let mut stream = TcpStream::connect(address).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            stream
                .write_all(
                    b"POST /api/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n0123456789",
                )
                .unwrap();
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            answer
        })
        .await
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"error\""), "{answer}");
        assert_eq!(counters.timed_out.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let soft = raise_open_file_limit().unwrap();
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) };
        assert_eq!(soft, limit.rlim_max);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
    }
}
