//! The job's links as the runtime uses them: shared memory to the ranks on this host, TCP to
//! the others ([`HostTransport`]), and the start-up handshake that decides which is which.
//!
//! Which peers share memory is decided once, before the first cycle, by the first rank of
//! each host: it creates the segment, offers it over TCP, and tells every member who mapped
//! it, so both ends of every link always agree on its kind. The choice never changes a
//! result: algorithms see one [`Transport`] and send the same bytes either way.
//!
//! The TCP mesh stays up under the shared-memory links: it is how a waiting rank learns
//! that a peer's process is gone, and it is what `abort` breaks. The agent's TCP probes do
//! not see bytes that cross shared memory; `RINGWATCH_SHM=0` sends everything over TCP.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{CollectiveError, Result};
use crate::shm::{
    Incoming, Outgoing, SHM_DIR, ShmGroup, arena_bytes_for, create_segment, free_bytes,
    map_segment, ring_bytes_for, staging_bytes, valid_ring_bytes,
};
use crate::transport::{
    CHUNK_BYTES, MAX_FRAME_BYTES, TcpTransport, Transport, recv_frame, send_frame,
};

#[derive(Serialize, Deserialize)]
enum Offer {
    Segment {
        path: String,
        nonce: u64,
        ring_bytes: usize,
        /// Each member's arena of shared tensors.
        arena_bytes: usize,
    },
    Declined {
        reason: String,
    },
}

#[derive(Serialize, Deserialize)]
enum Answer {
    Mapped,
    Declined { reason: String },
}

/// TCP to every peer, and shared memory to the peers on this host that agreed to it.
pub struct HostTransport {
    tcp: TcpTransport,
    shm: Option<ShmGroup>,
}

impl std::fmt::Debug for HostTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTransport")
            .field("tcp", &self.tcp)
            .field("shared_memory_peers", &self.shared_memory_peers())
            .finish()
    }
}

fn handshake_error(
    rank: usize,
    peer: usize,
    what: &str,
    e: impl std::fmt::Display,
) -> CollectiveError {
    CollectiveError::Link {
        rank,
        peer,
        message: format!("bad shared-memory handshake ({what}): {e}"),
    }
}

fn send_json<T: Serialize>(tcp: &TcpTransport, to: usize, value: &T) -> Result<()> {
    let bytes =
        serde_json::to_vec(value).map_err(|e| handshake_error(tcp.rank(), to, "encoding", e))?;
    send_frame(tcp, to, &bytes)
}

fn recv_json<T: for<'de> Deserialize<'de>>(tcp: &TcpTransport, from: usize) -> Result<T> {
    let bytes = recv_frame(tcp, from, MAX_FRAME_BYTES)?;
    serde_json::from_slice(&bytes).map_err(|e| handshake_error(tcp.rank(), from, "decoding", e))
}

impl HostTransport {
    /// Everything over TCP.
    pub fn tcp_only(tcp: TcpTransport) -> Self {
        HostTransport { tcp, shm: None }
    }

    /// Agrees with the other ranks, over `tcp`, on which links go through shared memory:
    /// ranks whose `host_keys` are equal (see [`crate::shm::host_key`]) share a segment if
    /// `enabled` on the host's first rank and on the member, and the member could map it.
    /// Every rank must call this at the same point, with the same `host_keys`.
    pub fn connect(
        tcp: TcpTransport,
        job_id: &str,
        host_keys: &[Option<String>],
        enabled: bool,
    ) -> Result<Self> {
        let rank = tcp.rank();
        let Some(Some(my_key)) = host_keys.get(rank) else {
            return Ok(Self::tcp_only(tcp));
        };
        let group: Vec<usize> = (0..tcp.world_size())
            .filter(|&r| host_keys.get(r).and_then(|k| k.as_ref()) == Some(my_key))
            .collect();
        if group.len() < 2 {
            return Ok(Self::tcp_only(tcp));
        }
        let leader = group[0];
        let shm = if rank == leader {
            Self::lead(&tcp, job_id, &group, enabled)?
        } else {
            Self::join(&tcp, &group, enabled)?
        };
        Ok(HostTransport { tcp, shm })
    }

    fn lead(
        tcp: &TcpTransport,
        job_id: &str,
        group: &[usize],
        enabled: bool,
    ) -> Result<Option<ShmGroup>> {
        let m = group.len();
        let segment = if enabled {
            let free =
                free_bytes(Path::new(SHM_DIR)).map_err(|e| format!("cannot use {SHM_DIR}: {e}"));
            let sizes = free.and_then(|free| {
                let ring = ring_bytes_for(m, free)
                    .ok_or_else(|| format!("{SHM_DIR} has only {} MiB free", free >> 20))?;
                // The arenas get what the rings and slots leave.
                let staged = staging_bytes(m, ring);
                Ok((ring, arena_bytes_for(m, free.saturating_sub(staged))))
            });
            sizes.and_then(|(ring, arena)| {
                create_segment(Path::new(SHM_DIR), job_id, m, ring, arena)
                    .map(|seg| (seg, ring, arena))
                    .map_err(|e| {
                        format!(
                            "cannot create a {} MiB segment in {SHM_DIR}: {e}",
                            (m * (m - 1) * ring) >> 20
                        )
                    })
            })
        } else {
            Err(format!("RINGWATCH_SHM=0 on rank {}", tcp.rank()))
        };
        let (offer, mapped) = match &segment {
            Ok((seg, ring, arena)) => (
                Offer::Segment {
                    path: seg.path().display().to_string(),
                    nonce: seg.nonce(),
                    ring_bytes: *ring,
                    arena_bytes: *arena,
                },
                map_segment(
                    seg.path(),
                    seg.nonce(),
                    group,
                    0,
                    *ring,
                    *arena,
                    tcp.timeout(),
                ),
            ),
            Err(reason) => (
                Offer::Declined {
                    reason: reason.clone(),
                },
                Err(reason.clone()),
            ),
        };
        for &m in &group[1..] {
            send_json(tcp, m, &offer)?;
        }
        if let Offer::Declined { reason } = &offer {
            tracing::info!(ranks = ?group, "ranks on this host talk over TCP: {reason}");
            return Ok(None);
        }
        let mut active = vec![group[0]];
        for &m in &group[1..] {
            match recv_json::<Answer>(tcp, m)? {
                Answer::Mapped => active.push(m),
                Answer::Declined { reason } => {
                    tracing::info!(rank = m, "rank talks over TCP on this host: {reason}");
                }
            }
        }
        let mut mapped = match mapped {
            Ok(g) if active.len() > 1 => Some(g),
            Ok(_) => None,
            Err(reason) => {
                tracing::warn!("cannot map this rank's own segment: {reason}; using TCP");
                None
            }
        };
        if mapped.is_none() {
            active.clear();
        }
        for &m in &group[1..] {
            send_json(tcp, m, &active)?;
        }
        drop(segment); // every member that will map it has: remove the name
        if let Some(g) = mapped.as_mut() {
            g.restrict(&active);
            tracing::info!(ranks = ?active, "ranks on this host exchange data through shared memory");
        }
        Ok(mapped)
    }

    fn join(tcp: &TcpTransport, group: &[usize], enabled: bool) -> Result<Option<ShmGroup>> {
        let rank = tcp.rank();
        let leader = group[0];
        let (path, nonce, ring_bytes, arena_bytes) = match recv_json::<Offer>(tcp, leader)? {
            Offer::Declined { .. } => return Ok(None),
            Offer::Segment {
                path,
                nonce,
                ring_bytes,
                arena_bytes,
            } => (path, nonce, ring_bytes, arena_bytes),
        };
        let me = group
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| handshake_error(rank, leader, "membership", "not in the group"))?;
        let mapped = if !enabled {
            Err(format!("RINGWATCH_SHM=0 on rank {rank}"))
        } else if !valid_ring_bytes(ring_bytes) {
            Err(format!(
                "rings of {ring_bytes} bytes offered: not a size this build uses"
            ))
        } else if arena_bytes > crate::shm::ARENA_BYTES {
            Err(format!(
                "arenas of {arena_bytes} bytes offered: more than this build maps"
            ))
        } else {
            map_segment(
                Path::new(&path),
                nonce,
                group,
                me,
                ring_bytes,
                arena_bytes,
                tcp.timeout(),
            )
        };
        let answer = match &mapped {
            Ok(_) => Answer::Mapped,
            Err(reason) => Answer::Declined {
                reason: reason.clone(),
            },
        };
        send_json(tcp, leader, &answer)?;
        let active: Vec<usize> = recv_json(tcp, leader)?;
        match mapped {
            Ok(mut g) if active.contains(&rank) => {
                g.restrict(&active);
                Ok(Some(g))
            }
            _ => Ok(None),
        }
    }

    fn member(&self, peer: usize) -> Option<(&ShmGroup, usize)> {
        let g = self.shm.as_ref()?;
        g.member_of(peer).map(|m| (g, m))
    }

    /// A step that receives `incoming` from shared-memory member `from` while sending
    /// `send` to rank `to`: on this thread through the rings if `to` shares memory too,
    /// else through `to`'s TCP writer thread.
    fn step_into_shared_memory(
        &self,
        to: usize,
        send: &[u8],
        g: &ShmGroup,
        from: usize,
        incoming: Incoming<'_, '_>,
    ) -> Result<()> {
        let gone = |r: usize| self.tcp.peer_gone(r);
        if let Some((_, mt)) = self.member(to) {
            return g.exchange(
                Some((mt, Outgoing::new(send))),
                Some((from, incoming)),
                None,
                &gone,
            );
        }
        let pending = if send.is_empty() {
            None
        } else {
            Some(self.tcp.submit(to, send)?)
        };
        let received = g.exchange(None, Some((from, incoming)), None, &gone);
        self.tcp.settle(to, pending, received)
    }

    /// Sends `send` to shared-memory member `to` on a helper thread while `receive` runs
    /// here (a step whose receive comes over TCP); a failed receive cancels the send.
    fn send_while(
        &self,
        g: &ShmGroup,
        to: usize,
        send: &[u8],
        receive: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if send.is_empty() {
            return receive();
        }
        let cancel = AtomicBool::new(false);
        let gone = |r: usize| self.tcp.peer_gone(r);
        std::thread::scope(|s| {
            let writer =
                s.spawn(|| g.exchange(Some((to, Outgoing::new(send))), None, Some(&cancel), &gone));
            let received = receive();
            if received.is_err() {
                cancel.store(true, Ordering::SeqCst);
                g.wake_self();
            }
            let sent = writer.join().unwrap_or_else(|_| {
                Err(CollectiveError::Link {
                    rank: self.tcp.rank(),
                    peer: g.peers().first().copied().unwrap_or(0),
                    message: "the shared-memory writer thread panicked".into(),
                })
            });
            received?;
            sent
        })
    }
}

impl Transport for HostTransport {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world_size(&self) -> usize {
        self.tcp.world_size()
    }

    fn send(&self, to: usize, data: &[u8]) -> Result<()> {
        match self.member(to) {
            Some((g, m)) => {
                let gone = |r: usize| self.tcp.peer_gone(r);
                g.exchange(Some((m, Outgoing::new(data))), None, None, &gone)
            }
            None => self.tcp.send(to, data),
        }
    }

    fn recv(&self, from: usize, buf: &mut [u8]) -> Result<()> {
        match self.member(from) {
            Some((g, m)) => {
                let gone = |r: usize| self.tcp.peer_gone(r);
                g.exchange(
                    None,
                    Some((m, Incoming::copy(buf, CHUNK_BYTES, None))),
                    None,
                    &gone,
                )
            }
            None => self.tcp.recv(from, buf),
        }
    }

    fn send_recv(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv: &mut [u8],
        on_chunk: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        match (self.member(from), self.member(to)) {
            (Some((g, mf)), _) => self.step_into_shared_memory(
                to,
                send,
                g,
                mf,
                Incoming::copy(recv, CHUNK_BYTES, Some(on_chunk)),
            ),
            (None, None) => self.tcp.send_recv(to, send, from, recv, on_chunk),
            (None, Some((g, mt))) => self.send_while(g, mt, send, || {
                self.tcp.send_recv(to, &[], from, recv, on_chunk)
            }),
        }
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
            return Err(CollectiveError::Link {
                rank: self.rank(),
                peer: from,
                message: "empty piece buffer".into(),
            });
        }
        match (self.member(from), self.member(to)) {
            (Some((g, mf)), _) => self.step_into_shared_memory(
                to,
                send,
                g,
                mf,
                Incoming::pieces(recv_len, piece_buf, on_piece),
            ),
            (None, None) => self
                .tcp
                .send_recv_pieces(to, send, from, recv_len, piece_buf, on_piece),
            (None, Some((g, mt))) => self.send_while(g, mt, send, || {
                self.tcp
                    .send_recv_pieces(to, &[], from, recv_len, piece_buf, on_piece)
            }),
        }
    }

    fn recv_forward(&self, from: usize, to: Option<usize>, buf: &mut [u8]) -> Result<()> {
        let forward_over_shm = to.is_some_and(|t| self.member(t).is_some());
        if self.member(from).is_none() && !forward_over_shm {
            return self.tcp.recv_forward(from, to, buf);
        }
        // Piece by piece: each is passed on as soon as it is here, so a chain of ranks
        // works on different pieces at once.
        for piece in buf.chunks_mut(CHUNK_BYTES) {
            self.recv(from, piece)?;
            if let Some(to) = to {
                self.send(to, piece)?;
            }
        }
        Ok(())
    }

    fn shared_memory_peers(&self) -> Vec<usize> {
        self.shm.as_ref().map(ShmGroup::peers).unwrap_or_default()
    }

    fn alloc_shared(&self, len: usize) -> std::io::Result<Option<crate::shm::SharedLease>> {
        match &self.shm {
            Some(g) => g.alloc_shared(len),
            None => Ok(None),
        }
    }

    fn in_place_allreduces(&self) -> u64 {
        self.shm.as_ref().map_or(0, ShmGroup::in_place_allreduces)
    }

    fn native_allreduce(
        &self,
        ranks: &[usize],
        buf: &mut [u8],
        segments: &[std::ops::Range<usize>],
        combine: &dyn Fn(&mut [u8], &[u8]),
        finish: &dyn Fn(&mut [u8]),
    ) -> Option<Result<()>> {
        let g = self.shm.as_ref()?;
        let members = g.whole_group(ranks)?;
        let gone = |r: usize| self.tcp.peer_gone(r);
        Some(g.fold_allreduce(&members, buf, segments, combine, finish, &gone))
    }

    fn same_posts(
        &self,
        ranks: &[usize],
        post: &[u8],
        early: Option<&[u8]>,
    ) -> Option<Result<bool>> {
        let g = self.shm.as_ref()?;
        let members = g.whole_group(ranks)?;
        let gone = |r: usize| self.tcp.peer_gone(r);
        Some(g.same_posts_early(&members, post, early, &gone))
    }

    fn wait_for_a_post(
        &self,
        ranks: &[usize],
        deadline: std::time::Instant,
    ) -> Option<Result<bool>> {
        let g = self.shm.as_ref()?;
        let members = g.whole_group(ranks)?;
        Some(g.wait_for_a_post(&members, deadline))
    }

    fn abort(&self) {
        if let Some(g) = &self.shm {
            g.abort();
        }
        self.tcp.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    /// A full TCP mesh of `n` ranks in this process.
    fn tcp_mesh(n: usize, timeout: Duration) -> Vec<TcpTransport> {
        let mut streams: Vec<Vec<Option<TcpStream>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, b) in (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b))) {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, _) = listener.accept().unwrap();
            streams[a][b] = Some(client);
            streams[b][a] = Some(server);
        }
        streams
            .into_iter()
            .enumerate()
            .map(|(r, s)| TcpTransport::new(r, n, s, timeout).unwrap())
            .collect()
    }

    /// Connects `n` ranks whose host keys are `keys`, with shared memory `enabled[r]`.
    fn connect(keys: &[Option<&str>], enabled: &[bool]) -> Vec<HostTransport> {
        let n = keys.len();
        let keys: Vec<Option<String>> = keys.iter().map(|k| k.map(String::from)).collect();
        let handles: Vec<_> = tcp_mesh(n, Duration::from_secs(10))
            .into_iter()
            .zip(enabled.to_vec())
            .map(|(tcp, on)| {
                let keys = keys.clone();
                std::thread::spawn(move || HostTransport::connect(tcp, "mesh-test", &keys, on))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    }

    #[test]
    fn ranks_share_memory_exactly_with_the_ranks_of_their_host() {
        let t = connect(
            &[Some("a"), Some("b"), Some("a"), Some("a"), Some("b"), None],
            &[true; 6],
        );
        let peers: Vec<Vec<usize>> = t.iter().map(|t| t.shared_memory_peers()).collect();
        assert_eq!(
            peers,
            vec![vec![2, 3], vec![4], vec![0, 3], vec![0, 2], vec![1], vec![]]
        );
    }

    #[test]
    fn a_member_that_opts_out_talks_tcp_to_everyone_and_the_rest_still_share() {
        let t = connect(&[Some("h"); 3], &[true, true, false]);
        let peers: Vec<Vec<usize>> = t.iter().map(|t| t.shared_memory_peers()).collect();
        assert_eq!(peers, vec![vec![1], vec![0], vec![]]);
        // The host's first rank opting out turns it off for the whole host.
        let t = connect(&[Some("h"); 3], &[false, true, true]);
        assert!(t.iter().all(|t| t.shared_memory_peers().is_empty()));
    }

    #[test]
    fn mixed_links_carry_a_ring_of_exchanges_intact() {
        // Ranks 0,1 on host a, 2,3 on host b: the ring 0→1→2→3→0 has shared-memory and TCP
        // links, and ranks 1 and 3 send over one kind while receiving over the other.
        let t = connect(&[Some("a"), Some("a"), Some("b"), Some("b")], &[true; 4]);
        let n = t.len();
        let size = 5 << 20; // larger than a ring and than a socket buffer
        let handles: Vec<_> = t
            .into_iter()
            .map(|t| {
                std::thread::spawn(move || {
                    let r = t.rank();
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let send: Vec<u8> = (0..size).map(|i| (i * (r + 1)) as u8).collect();
                    let mut recv = vec![0u8; size];
                    t.send_recv(next, &send, prev, &mut recv, &mut |_, _| {})
                        .unwrap();
                    let mut piece_buf = vec![0u8; 100_000];
                    let mut pieces = vec![0u8; size];
                    t.send_recv_pieces(next, &send, prev, size, &mut piece_buf, &mut |o, b| {
                        pieces[o..o + b.len()].copy_from_slice(b)
                    })
                    .unwrap();
                    (r, recv, pieces)
                })
            })
            .collect();
        for h in handles {
            let (r, recv, pieces) = h.join().unwrap();
            let prev = (r + n - 1) % n;
            let expected: Vec<u8> = (0..size).map(|i| (i * (prev + 1)) as u8).collect();
            assert!(recv == expected, "rank {r} send_recv");
            assert!(pieces == expected, "rank {r} send_recv_pieces");
        }
    }

    #[test]
    fn shared_memory_allreduce_gives_the_rings_bits_for_random_floats() {
        use crate::algorithms::ring_allreduce;
        use crate::tensor::{DType, ReduceOp};
        use crate::transport::MemoryTransport;
        // Random floats make the result depend on the order of every operation: the
        // shared-memory fold (and its one-shot form for small buffers) must match the
        // ring's reduce-scatter bit for bit. Sizes cross
        // the slot parts (several chunks) and leave segments of unequal and zero length.
        let run = |transports: Vec<Box<dyn Transport>>, inputs: &[Vec<f32>], op: ReduceOp| {
            let handles: Vec<_> = transports
                .into_iter()
                .zip(inputs.to_vec())
                .map(|(t, data)| {
                    std::thread::spawn(move || {
                        let mut buf: Vec<u8> = bytemuck::cast_slice(&data).to_vec();
                        ring_allreduce(&*t, &mut buf, DType::F32, op).unwrap();
                        buf
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        };
        for n in [2usize, 3, 4] {
            let shm: Vec<Box<dyn Transport>> = connect(&vec![Some("h"); n], &vec![true; n])
                .into_iter()
                .map(|t| {
                    assert_eq!(t.shared_memory_peers().len(), n - 1);
                    Box::new(t) as Box<dyn Transport>
                })
                .collect();
            let shm = std::sync::Arc::new(std::sync::Mutex::new(Some(shm)));
            for (count, op) in [
                (0usize, ReduceOp::Sum),
                (1, ReduceOp::Sum),
                (n + 1, ReduceOp::Average),
                // Up to 64 KiB in one shot (every member folds every segment), above
                // it the chunked fold: both must give the ring's bits.
                (1000, ReduceOp::Max),
                (16_384, ReduceOp::Sum),
                (16_385, ReduceOp::Average),
                (3_000_001, ReduceOp::Sum),
                (777_777, ReduceOp::Min),
            ] {
                let mut rng = fastrand::Rng::with_seed((n * 1000 + count) as u64);
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|_| (0..count).map(|_| rng.f32() * 2e3 - 1e3).collect())
                    .collect();
                let memory: Vec<Box<dyn Transport>> =
                    MemoryTransport::mesh(n, Duration::from_secs(10))
                        .into_iter()
                        .map(|t| Box::new(t) as Box<dyn Transport>)
                        .collect();
                let expected = run(memory, &inputs, op);
                // The same shared-memory links serve every case in turn, as in a job:
                // plain; after a round of posts that agrees and carries every member's
                // inputs early (a settled cycle's lone small allreduce); and after one
                // that carries them but does not agree (they must not be used).
                for posts in [None, Some(true), Some(false)] {
                    let links = shm.lock().unwrap().take().unwrap();
                    let shared: Vec<std::sync::Arc<Box<dyn Transport>>> =
                        links.into_iter().map(std::sync::Arc::new).collect();
                    let handles: Vec<_> = shared
                        .iter()
                        .cloned()
                        .zip(inputs.clone())
                        .map(|(t, data)| {
                            std::thread::spawn(move || {
                                let mut buf: Vec<u8> = bytemuck::cast_slice(&data).to_vec();
                                if let Some(agree) = posts {
                                    let all: Vec<usize> = (0..t.world_size()).collect();
                                    let post: &[u8] = if !agree && t.rank() == 1 {
                                        b"another cycle"
                                    } else {
                                        b"this cycle"
                                    };
                                    let same = t.same_posts(&all, post, Some(&buf));
                                    assert_eq!(same.unwrap().unwrap(), agree);
                                }
                                ring_allreduce(&**t, &mut buf, DType::F32, op).unwrap();
                                buf
                            })
                        })
                        .collect();
                    let got: Vec<Vec<u8>> =
                        handles.into_iter().map(|h| h.join().unwrap()).collect();
                    assert!(
                        got == expected,
                        "n={n} count={count} {op:?} posts {posts:?}"
                    );
                    let links: Vec<Box<dyn Transport>> = shared
                        .into_iter()
                        .map(|a| std::sync::Arc::try_unwrap(a).ok().unwrap())
                        .collect();
                    *shm.lock().unwrap() = Some(links);
                }
            }
        }
    }

    #[test]
    fn shared_tensors_reduce_in_place_with_the_rings_bits() {
        use crate::algorithms::ring_allreduce;
        use crate::tensor::{DType, ReduceOp};
        use crate::transport::MemoryTransport;
        // Every member's buffer in its arena: folded in place from the others' tensors.
        // Some members' only: staged through the slots (the members that offered theirs
        // put their first chunk in late). Either way the ring's bits, on every rank, and
        // the same links go on working for ordinary buffers after each.
        for n in [2usize, 3, 4] {
            let links: Vec<std::sync::Arc<HostTransport>> =
                connect(&vec![Some("h"); n], &vec![true; n])
                    .into_iter()
                    .map(std::sync::Arc::new)
                    .collect();
            for (count, op, shared_on) in [
                (16_385usize, ReduceOp::Sum, vec![true; n]),
                (3_000_001, ReduceOp::Average, vec![true; n]),
                (777_777, ReduceOp::Min, vec![true; n]),
                (3_000_001, ReduceOp::Sum, (0..n).map(|r| r != 1).collect()),
                (777_777, ReduceOp::Sum, (0..n).map(|r| r == 0).collect()),
                (3_000_001, ReduceOp::Sum, vec![false; n]),
            ] {
                let mut rng = fastrand::Rng::with_seed((n * 7 + count) as u64);
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|_| (0..count).map(|_| rng.f32() * 2e3 - 1e3).collect())
                    .collect();
                let handles: Vec<_> = MemoryTransport::mesh(n, Duration::from_secs(10))
                    .into_iter()
                    .zip(inputs.clone())
                    .map(|(t, data)| {
                        std::thread::spawn(move || {
                            let mut buf: Vec<u8> = bytemuck::cast_slice(&data).to_vec();
                            ring_allreduce(&t, &mut buf, DType::F32, op).unwrap();
                            buf
                        })
                    })
                    .collect();
                let expected: Vec<Vec<u8>> =
                    handles.into_iter().map(|h| h.join().unwrap()).collect();
                let handles: Vec<_> = links
                    .iter()
                    .cloned()
                    .zip(inputs.clone())
                    .zip(shared_on.clone())
                    .map(|((t, data), shared)| {
                        std::thread::spawn(move || {
                            let bytes: &[u8] = bytemuck::cast_slice(&data);
                            let lease = if shared {
                                Some(t.alloc_shared(bytes.len()).unwrap().unwrap())
                            } else {
                                None
                            };
                            let mut own = Vec::new();
                            let buf: &mut [u8] = match &lease {
                                // SAFETY: the lease is at least `bytes.len()` bytes and
                                // lives until the end of this closure.
                                Some(l) => unsafe {
                                    std::slice::from_raw_parts_mut(l.ptr(), bytes.len())
                                },
                                None => {
                                    own.resize(bytes.len(), 0);
                                    &mut own
                                }
                            };
                            buf.copy_from_slice(bytes);
                            ring_allreduce(&*t, buf, DType::F32, op).unwrap();
                            buf.to_vec()
                        })
                    })
                    .collect();
                let got: Vec<Vec<u8>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
                assert!(
                    got == expected,
                    "n={n} count={count} {op:?} shared {shared_on:?}"
                );
            }
        }
    }

    #[test]
    fn a_shared_tensors_pages_come_back_zeroed_and_its_room_is_reused() {
        let t = connect(&[Some("h"); 2], &[true; 2]);
        let first = t[0].alloc_shared(3 << 20).unwrap().unwrap();
        let at = first.ptr();
        // SAFETY: the lease is 3 MiB and lives until dropped below.
        unsafe { std::ptr::write_bytes(at, 0xAB, 3 << 20) };
        let second = t[0].alloc_shared(100).unwrap().unwrap();
        assert_eq!(second.ptr() as usize, at as usize + (3 << 20));
        drop(first);
        let again = t[0].alloc_shared(1 << 20).unwrap().unwrap();
        assert_eq!(again.ptr(), at, "the freed room is taken first");
        // SAFETY: the lease is 1 MiB.
        let bytes = unsafe { std::slice::from_raw_parts(again.ptr(), 1 << 20) };
        assert!(
            bytes.iter().all(|&b| b == 0),
            "a new shared tensor starts at 0"
        );
        // More than the arena holds: no memory, no error.
        assert!(
            t[0].alloc_shared(crate::shm::ARENA_BYTES + 1)
                .unwrap()
                .is_none()
        );
        // A rank that shares memory with nobody has no arena.
        let alone = connect(&[Some("h"), Some("other")], &[true; 2]);
        assert!(alone[0].alloc_shared(100).unwrap().is_none());
    }

    #[test]
    fn an_aborted_peer_fails_a_shared_memory_wait_naming_it() {
        let mut t = connect(&[Some("h"); 2], &[true; 2]);
        let b = t.pop().unwrap();
        let a = t.pop().unwrap();
        let waiter = std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            a.recv(1, &mut buf).unwrap_err()
        });
        std::thread::sleep(Duration::from_millis(50));
        b.abort();
        let err = waiter.join().unwrap();
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
        // A peer that simply goes away (its process exited: its sockets close) too.
        let mut t = connect(&[Some("h"); 2], &[true; 2]);
        let b = t.pop().unwrap();
        let a = t.pop().unwrap();
        drop(b);
        let mut buf = [0u8; 16];
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
}
