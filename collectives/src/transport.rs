//! Moves bytes between two ranks: the [`Transport`] trait, its TCP implementation and an
//! in-memory mesh for testing algorithms without sockets.
//!
//! A transport knows nothing of tensors, dtypes or schedules; it must never reorder the
//! bytes of one link, and must never wait on a peer without a timeout that names that peer.
//! Every TCP link is full duplex: a writer thread per link sends while the caller's thread
//! receives, so a ring step sends and receives at the same time.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{CollectiveError, Result};

/// Received data is handed to `on_chunk` callbacks in pieces of this many bytes (the last
/// piece may be shorter). A multiple of every element size, so pieces hold whole elements.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Socket send and receive buffer sizes asked of the kernel for data links.
pub const SOCKET_BUFFER_BYTES: usize = 4 * 1024 * 1024;

/// Largest frame [`recv_frame`] accepts by default (coordination messages).
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Point-to-point byte movement between the ranks of one job.
///
/// All operations on one link happen in program order on both ends; the algorithms make
/// sure that every rank issues matching operations.
pub trait Transport: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Sends all of `data` to `to`; returns when the bytes are handed to the link.
    fn send(&self, to: usize, data: &[u8]) -> Result<()>;

    /// Receives exactly `buf.len()` bytes from `from`.
    fn recv(&self, from: usize, buf: &mut [u8]) -> Result<()>;

    /// Sends `send` to `to` while receiving exactly `recv.len()` bytes from `from`, at the
    /// same time. As received data arrives, `on_chunk(offset, bytes)` is called for each
    /// piece of [`CHUNK_BYTES`] (the last may be shorter), so the caller can reduce a piece
    /// while the next one is still on the wire.
    fn send_recv(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        on_chunk: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()>;

    /// Like [`Transport::send_recv`], but the `recv_len` received bytes pass through
    /// `piece_buf`, reused for every piece of `piece_buf.len()` bytes (the last may be
    /// shorter): `on_piece(offset, bytes)` must consume each piece before the next arrives.
    /// A small, cache-resident piece buffer is what makes reduce-scatter fast.
    fn send_recv_pieces(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        piece_buf: &mut [u8],
        on_piece: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()>;

    /// Receives `buf.len()` bytes from `from` and, piece by piece as they arrive, forwards
    /// them to `to` (a pipelined chain for broadcast).
    fn recv_forward(&self, from: usize, to: Option<usize>, buf: &mut [u8]) -> Result<()>;

    /// Breaks every link at once so that peers notice a failure immediately instead of
    /// waiting for their timeout. The transport is unusable afterwards.
    fn abort(&self) {}

    /// The ranks this rank reaches through shared memory rather than sockets.
    fn shared_memory_peers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// `len` zeroed bytes that this rank's shared-memory peers can read and write, for a
    /// tensor that [`Transport::native_allreduce`] reduces in place when every rank passes
    /// one (see [`crate::Runtime::shared_tensor`]); `Ok(None)`: the transport has no such
    /// memory (no peers on this host share it, or its arena is full).
    fn alloc_shared(&self, _len: usize) -> std::io::Result<Option<crate::shm::SharedLease>> {
        Ok(None)
    }

    /// How many of [`Transport::native_allreduce`]'s calls reduced shared tensors in place
    /// (every rank passed memory from [`Transport::alloc_shared`]).
    fn in_place_allreduces(&self) -> u64 {
        0
    }

    /// Allreduce of `buf` among `ranks` done by the transport itself, when it has a native
    /// way for exactly these ranks (all in one shared-memory segment); `None`: run a
    /// schedule. It must give the bits a ring reduce-scatter then allgather over
    /// `segments` would (byte ranges, one per position in `ranks`): segment `j` starts as
    /// position j's bytes, takes `combine(acc, incoming)` with positions j+1, j+2, … in
    /// turn, and is `finish`ed. `combine` and `finish` know the dtype; the transport not.
    fn native_allreduce(
        &self,
        _ranks: &[usize],
        _buf: &mut [u8],
        _segments: &[std::ops::Range<usize>],
        _combine: &dyn Fn(&mut [u8], &[u8]),
        _finish: &dyn Fn(&mut [u8]),
    ) -> Option<Result<()>> {
        None
    }

    /// Whether every rank of `ranks` passes exactly the bytes of `post` to this call, found
    /// through memory they all share, without a round trip to anyone; `None`: the transport
    /// has no such way for exactly these ranks (then nothing was posted). Every rank of
    /// `ranks` must make the same calls, in the same order; at most
    /// [`crate::shm::MAX_POST_BYTES`] bytes. `early`: the buffer of the allreduce this
    /// rank runs next if every post agrees; a transport that can may move its inputs with
    /// the post, so that the allreduce then needs no barrier of its own (the others'
    /// `early` must be the same size, which agreeing posts imply).
    fn same_posts(
        &self,
        _ranks: &[usize],
        _post: &[u8],
        _early: Option<&[u8]>,
    ) -> Option<Result<bool>> {
        None
    }

    /// Waits until another rank of `ranks` is waiting in [`Transport::same_posts`] for
    /// this one, or until `deadline`; returns whether one is. `None`: no such way (as for
    /// `same_posts`).
    fn wait_for_a_post(&self, _ranks: &[usize], _deadline: Instant) -> Option<Result<bool>> {
        None
    }
}

/// Sends one length-prefixed frame (4-byte big-endian length, then the payload).
pub fn send_frame(t: &dyn Transport, to: usize, payload: &[u8]) -> Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| CollectiveError::Link {
        rank: t.rank(),
        peer: to,
        message: format!("frame of {} bytes is too large", payload.len()),
    })?;
    let mut framed = Vec::with_capacity(4 + payload.len());
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(payload);
    t.send(to, &framed)
}

/// Receives one frame sent by [`send_frame`]; fails if it is larger than `max_bytes`.
pub fn recv_frame(t: &dyn Transport, from: usize, max_bytes: usize) -> Result<Vec<u8>> {
    let mut header = [0u8; 4];
    t.recv(from, &mut header)?;
    let len = u32::from_be_bytes(header) as usize;
    if len > max_bytes {
        return Err(CollectiveError::Link {
            rank: t.rank(),
            peer: from,
            message: format!("frame of {len} bytes exceeds the limit of {max_bytes}"),
        });
    }
    let mut payload = vec![0u8; len];
    t.recv(from, &mut payload)?;
    Ok(payload)
}

// ---------------------------------------------------------------------------------------
// TCP

struct WriteJob {
    ptr: *const u8,
    len: usize,
    done: mpsc::SyncSender<std::io::Result<()>>,
}

// SAFETY: a job only carries a pointer to bytes that its submitter keeps alive and unchanged
// until `done` is answered (see `PendingWrite`); the writer thread only reads them.
unsafe impl Send for WriteJob {}

/// A write handed to a link's writer thread. Dropping it waits for the write to finish, so
/// the borrowed bytes cannot be freed while the writer reads them.
pub(crate) struct PendingWrite<'a> {
    done: Option<mpsc::Receiver<std::io::Result<()>>>,
    /// Set when the write was seen to have succeeded before `wait`.
    succeeded: bool,
    _data: PhantomData<&'a [u8]>,
}

impl PendingWrite<'_> {
    fn wait(mut self) -> Option<std::io::Result<()>> {
        if self.succeeded {
            return Some(Ok(()));
        }
        self.done.take().and_then(|rx| rx.recv().ok())
    }

    /// The write's error if it has already failed, without waiting.
    fn failed_already(&mut self) -> Option<std::io::Error> {
        match self.done.as_ref().map(|rx| rx.try_recv()) {
            Some(Ok(Err(e))) => {
                self.done = None;
                Some(e)
            }
            Some(Ok(Ok(()))) => {
                self.done = None;
                self.succeeded = true;
                None
            }
            _ => None,
        }
    }
}

impl Drop for PendingWrite<'_> {
    fn drop(&mut self) {
        if let Some(rx) = self.done.take() {
            let _ = rx.recv();
        }
    }
}

struct Link {
    reader: Mutex<TcpStream>,
    control: TcpStream,
    jobs: Option<mpsc::Sender<WriteJob>>,
    writer: Option<JoinHandle<()>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = self.control.shutdown(Shutdown::Both);
        self.jobs.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// A full mesh of TCP connections, one per peer, each with a writer thread.
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    links: Vec<Option<Link>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

/// Sets the options every data link needs: no Nagle delay, large kernel buffers, timeouts.
pub fn configure_stream(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    // The kernel may cap these (net.core.wmem_max); smaller buffers only cost speed.
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(())
}

impl TcpTransport {
    /// Wraps connected streams: `streams[peer]` is the connection to `peer` (`None` for
    /// this rank itself). `timeout` bounds every wait on a peer.
    pub fn new(
        rank: usize,
        world_size: usize,
        streams: Vec<Option<TcpStream>>,
        timeout: Duration,
    ) -> Result<Self> {
        let mut links = Vec::with_capacity(world_size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                links.push(None);
                continue;
            };
            let io_err = |e: std::io::Error| CollectiveError::Link {
                rank,
                peer,
                message: format!("cannot set up the connection: {e}"),
            };
            configure_stream(&stream, timeout).map_err(io_err)?;
            let mut write_half = stream.try_clone().map_err(io_err)?;
            let control = stream.try_clone().map_err(io_err)?;
            let (tx, rx) = mpsc::channel::<WriteJob>();
            let writer = std::thread::Builder::new()
                .name(format!("ringwatch-tx-{peer}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        // SAFETY: see `WriteJob`: the submitter waits for `done` before the
                        // bytes may be freed or changed.
                        let data = unsafe { std::slice::from_raw_parts(job.ptr, job.len) };
                        let result = write_half.write_all(data);
                        let _ = job.done.send(result);
                    }
                })
                .map_err(io_err)?;
            links.push(Some(Link {
                reader: Mutex::new(stream),
                control,
                jobs: Some(tx),
                writer: Some(writer),
            }));
        }
        Ok(TcpTransport {
            rank,
            world_size,
            timeout,
            links,
        })
    }

    fn link(&self, peer: usize) -> Result<&Link> {
        self.links
            .get(peer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| CollectiveError::Link {
                rank: self.rank,
                peer,
                message: "no such link".into(),
            })
    }

    /// Hands `data` to the writer thread of the link to `to`.
    pub(crate) fn submit<'a>(&self, to: usize, data: &'a [u8]) -> Result<PendingWrite<'a>> {
        let link = self.link(to)?;
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let job = WriteJob {
            ptr: data.as_ptr(),
            len: data.len(),
            done: done_tx,
        };
        let sent = link.jobs.as_ref().map(|jobs| jobs.send(job).is_ok());
        if sent != Some(true) {
            return Err(self.link_error(to, "the writer thread has stopped"));
        }
        Ok(PendingWrite {
            done: Some(done_rx),
            succeeded: false,
            _data: PhantomData,
        })
    }

    fn finish_write(&self, to: usize, pending: PendingWrite<'_>) -> Result<()> {
        match pending.wait() {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(self.io_error(to, e)),
            None => Err(self.link_error(to, "the writer thread has stopped")),
        }
    }

    fn link_error(&self, peer: usize, message: &str) -> CollectiveError {
        CollectiveError::Link {
            rank: self.rank,
            peer,
            message: message.to_string(),
        }
    }

    fn io_error(&self, peer: usize, e: std::io::Error) -> CollectiveError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                CollectiveError::PeerTimeout {
                    rank: self.rank,
                    peer,
                    timeout: self.timeout,
                }
            }
            _ => self.link_error(peer, &e.to_string()),
        }
    }

    fn read_full(&self, from: usize, stream: &mut TcpStream, buf: &mut [u8]) -> Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            match stream.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(self.link_error(
                        from,
                        "connection closed by the peer (that rank exited, crashed, or gave up after another rank failed)",
                    ));
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(from, e)),
            }
        }
        Ok(())
    }

    fn lock_reader(&self, from: usize) -> Result<std::sync::MutexGuard<'_, TcpStream>> {
        self.link(from)?
            .reader
            .lock()
            .map_err(|_| self.link_error(from, "reader lock poisoned"))
    }

    /// Finishes a concurrent send and receive. When the receive failed, a send that had
    /// already failed is the better report: its peer is certainly gone, while a closed
    /// receive link may only be a neighbour giving up after that same failure.
    pub(crate) fn settle(
        &self,
        to: usize,
        pending: Option<PendingWrite<'_>>,
        received: Result<()>,
    ) -> Result<()> {
        let Some(mut pending) = pending else {
            return received;
        };
        if received.is_err() {
            if let Some(e) = pending.failed_already() {
                return Err(self.io_error(to, e));
            }
            // Do not leave the writer blocked on a peer we are about to give up on.
            self.shutdown_link(to);
        }
        let sent = self.finish_write(to, pending);
        received?;
        sent
    }

    pub(crate) fn shutdown_link(&self, peer: usize) {
        if let Ok(link) = self.link(peer) {
            let _ = link.control.shutdown(Shutdown::Both);
        }
    }

    /// Whether the link to `peer` was closed or broken (the peer's process exited, or it
    /// aborted its links), without reading from it: for links that carry nothing while
    /// the bytes go another way (shared memory).
    pub(crate) fn peer_gone(&self, peer: usize) -> bool {
        let Ok(link) = self.link(peer) else {
            return true;
        };
        let mut fd = libc::pollfd {
            fd: link.control.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no waiting.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        ready > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// How long any wait on a peer may last.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send(&self, to: usize, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let pending = self.submit(to, data)?;
        self.finish_write(to, pending)
    }

    fn recv(&self, from: usize, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut stream = self.lock_reader(from)?;
        self.read_full(from, &mut stream, buf)
    }

    fn send_recv(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        on_chunk: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let pending = if send.is_empty() {
            None
        } else {
            Some(self.submit(to, send)?)
        };
        let received = (|| {
            if recv.is_empty() {
                return Ok(());
            }
            let mut stream = self.lock_reader(from)?;
            let mut offset = 0;
            while offset < recv.len() {
                let end = (offset + CHUNK_BYTES).min(recv.len());
                self.read_full(from, &mut stream, &mut recv[offset..end])?;
                on_chunk(offset, &recv[offset..end]);
                offset = end;
            }
            Ok(())
        })();
        self.settle(to, pending, received)
    }

    fn send_recv_pieces(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        piece_buf: &mut [u8],
        on_piece: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        if piece_buf.is_empty() && recv_len > 0 {
            return Err(self.link_error(from, "empty piece buffer"));
        }
        let pending = if send.is_empty() {
            None
        } else {
            Some(self.submit(to, send)?)
        };
        let received = (|| {
            if recv_len == 0 {
                return Ok(());
            }
            let mut stream = self.lock_reader(from)?;
            let mut offset = 0;
            while offset < recv_len {
                let len = piece_buf.len().min(recv_len - offset);
                self.read_full(from, &mut stream, &mut piece_buf[..len])?;
                on_piece(offset, &piece_buf[..len]);
                offset += len;
            }
            Ok(())
        })();
        self.settle(to, pending, received)
    }

    fn recv_forward(&self, from: usize, to: Option<usize>, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        let base = buf.as_mut_ptr();
        let mut pendings = Vec::new();
        let result = (|| {
            let mut stream = self.lock_reader(from)?;
            let mut offset = 0;
            while offset < len {
                let end = (offset + CHUNK_BYTES).min(len);
                // SAFETY: [offset, end) lies inside `buf` and is disjoint from every piece
                // handed to the writer before; `buf` itself is not used while these exist.
                let piece =
                    unsafe { std::slice::from_raw_parts_mut(base.add(offset), end - offset) };
                self.read_full(from, &mut stream, piece)?;
                if let Some(to) = to {
                    pendings.push(self.submit(to, piece)?);
                }
                offset = end;
            }
            Ok(())
        })();
        if let (Err(_), Some(to)) = (&result, to) {
            self.shutdown_link(to);
        }
        let mut sent = Ok(());
        for pending in pendings {
            let outcome = pending
                .wait()
                .unwrap_or_else(|| Err(std::io::Error::other("the writer thread has stopped")));
            if let (Err(e), Some(to), true) = (outcome, to, sent.is_ok()) {
                sent = Err(self.io_error(to, e));
            }
        }
        result?;
        sent
    }

    fn abort(&self) {
        for link in self.links.iter().flatten() {
            let _ = link.control.shutdown(Shutdown::Both);
        }
    }
}

// ---------------------------------------------------------------------------------------
// In memory

struct Inbox {
    rx: mpsc::Receiver<Vec<u8>>,
    pending: VecDeque<u8>,
}

/// One rank of an in-memory mesh: sends never block, receives wait up to the timeout.
/// For testing algorithms and the runtime without sockets.
pub struct MemoryTransport {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    outboxes: Vec<mpsc::Sender<Vec<u8>>>,
    inboxes: Vec<Mutex<Inbox>>,
}

impl std::fmt::Debug for MemoryTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTransport")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl MemoryTransport {
    /// A fully connected mesh of `world_size` ranks; element `r` is rank `r`.
    pub fn mesh(world_size: usize, timeout: Duration) -> Vec<MemoryTransport> {
        // channels[src][dst]
        let mut senders: Vec<Vec<Option<mpsc::Sender<Vec<u8>>>>> =
            (0..world_size).map(|_| vec![None; world_size]).collect();
        let mut receivers: Vec<Vec<Option<mpsc::Receiver<Vec<u8>>>>> = (0..world_size)
            .map(|_| (0..world_size).map(|_| None).collect())
            .collect();
        for src in 0..world_size {
            for dst in 0..world_size {
                let (tx, rx) = mpsc::channel();
                senders[src][dst] = Some(tx);
                receivers[dst][src] = Some(rx);
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (outs, ins))| MemoryTransport {
                rank,
                world_size,
                timeout,
                outboxes: outs.into_iter().flatten().collect(),
                inboxes: ins
                    .into_iter()
                    .flatten()
                    .map(|rx| {
                        Mutex::new(Inbox {
                            rx,
                            pending: VecDeque::new(),
                        })
                    })
                    .collect(),
            })
            .collect()
    }

    fn error(&self, peer: usize, message: &str) -> CollectiveError {
        CollectiveError::Link {
            rank: self.rank,
            peer,
            message: message.to_string(),
        }
    }
}

impl Transport for MemoryTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send(&self, to: usize, data: &[u8]) -> Result<()> {
        let outbox = self
            .outboxes
            .get(to)
            .ok_or_else(|| self.error(to, "no such rank"))?;
        if data.is_empty() {
            return Ok(());
        }
        outbox
            .send(data.to_vec())
            .map_err(|_| self.error(to, "peer has gone away"))
    }

    fn recv(&self, from: usize, buf: &mut [u8]) -> Result<()> {
        let inbox = self
            .inboxes
            .get(from)
            .ok_or_else(|| self.error(from, "no such rank"))?;
        let mut inbox = inbox
            .lock()
            .map_err(|_| self.error(from, "inbox lock poisoned"))?;
        let deadline = Instant::now() + self.timeout;
        let mut filled = 0;
        while filled < buf.len() {
            if inbox.pending.is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                match inbox.rx.recv_timeout(left) {
                    Ok(piece) => inbox.pending.extend(piece),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        return Err(CollectiveError::PeerTimeout {
                            rank: self.rank,
                            peer: from,
                            timeout: self.timeout,
                        });
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(self.error(from, "peer has gone away"));
                    }
                }
            }
            let n = inbox.pending.len().min(buf.len() - filled);
            for (dst, src) in buf[filled..filled + n]
                .iter_mut()
                .zip(inbox.pending.drain(..n))
            {
                *dst = src;
            }
            filled += n;
        }
        Ok(())
    }

    fn send_recv(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        on_chunk: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.send(to, send)?;
        let mut offset = 0;
        while offset < recv.len() {
            let end = (offset + CHUNK_BYTES).min(recv.len());
            self.recv(from, &mut recv[offset..end])?;
            on_chunk(offset, &recv[offset..end]);
            offset = end;
        }
        Ok(())
    }

    fn send_recv_pieces(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        piece_buf: &mut [u8],
        on_piece: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        if piece_buf.is_empty() && recv_len > 0 {
            return Err(self.error(from, "empty piece buffer"));
        }
        self.send(to, send)?;
        let mut offset = 0;
        while offset < recv_len {
            let len = piece_buf.len().min(recv_len - offset);
            self.recv(from, &mut piece_buf[..len])?;
            on_piece(offset, &piece_buf[..len]);
            offset += len;
        }
        Ok(())
    }

    fn recv_forward(&self, from: usize, to: Option<usize>, buf: &mut [u8]) -> Result<()> {
        let mut offset = 0;
        while offset < buf.len() {
            let end = (offset + CHUNK_BYTES).min(buf.len());
            self.recv(from, &mut buf[offset..end])?;
            if let Some(to) = to {
                self.send(to, &buf[offset..end])?;
            }
            offset = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn tcp_pair(timeout: Duration) -> (TcpTransport, TcpTransport) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).unwrap();
        let (server, _) = listener.accept().unwrap();
        let a = TcpTransport::new(0, 2, vec![None, Some(client)], timeout).unwrap();
        let b = TcpTransport::new(1, 2, vec![Some(server), None], timeout).unwrap();
        (a, b)
    }

    #[test]
    fn tcp_send_recv_is_full_duplex_for_payloads_larger_than_socket_buffers() {
        // Both sides send 24 MiB before reading anything back: with a half-duplex link this
        // would deadlock once the socket buffers fill; here it must finish.
        let (a, b) = tcp_pair(Duration::from_secs(10));
        let size = 24 << 20;
        let run = |t: TcpTransport, seed: u8| {
            std::thread::spawn(move || {
                let send: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(seed)).collect();
                let mut recv = vec![0u8; size];
                let mut pieces = 0;
                let peer = 1 - t.rank();
                t.send_recv(peer, &send, peer, &mut recv, &mut |_, _| pieces += 1)
                    .unwrap();
                (recv, pieces)
            })
        };
        let ha = run(a, 3);
        let hb = run(b, 7);
        let (ra, pa) = ha.join().unwrap();
        let (rb, _) = hb.join().unwrap();
        assert!(
            ra.iter()
                .enumerate()
                .all(|(i, &v)| v == (i as u8).wrapping_mul(7))
        );
        assert!(
            rb.iter()
                .enumerate()
                .all(|(i, &v)| v == (i as u8).wrapping_mul(3))
        );
        assert_eq!(pa, size.div_ceil(CHUNK_BYTES));
    }

    #[test]
    fn tcp_silent_peer_times_out_naming_it() {
        let (a, _b) = tcp_pair(Duration::from_millis(200));
        let mut buf = [0u8; 8];
        let started = Instant::now();
        let err = a.recv(1, &mut buf).unwrap_err();
        // A hang guard, not a bound on how long past its timeout a loaded machine takes:
        // the error's kind shows that the wait timed out.
        assert!(started.elapsed() < Duration::from_secs(60));
        assert!(
            matches!(
                err,
                CollectiveError::PeerTimeout {
                    rank: 0,
                    peer: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn tcp_closed_peer_is_a_link_error_naming_it() {
        let (a, b) = tcp_pair(Duration::from_secs(10));
        drop(b);
        let mut buf = [0u8; 8];
        let err = a.recv(1, &mut buf).unwrap_err();
        assert!(
            matches!(
                err,
                CollectiveError::Link {
                    rank: 0,
                    peer: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn frames_round_trip_and_oversized_frames_are_refused() {
        let mesh = MemoryTransport::mesh(2, Duration::from_secs(1));
        send_frame(&mesh[0], 1, b"hello").unwrap();
        assert_eq!(recv_frame(&mesh[1], 0, 16).unwrap(), b"hello");
        send_frame(&mesh[0], 1, &[0u8; 32]).unwrap();
        assert!(recv_frame(&mesh[1], 0, 16).is_err());
    }
}
