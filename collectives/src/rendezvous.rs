//! Rendezvous: who my peers are and how to reach them, from the variables launchers set.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects, says who it is
//! and where its data listener is, and gets back the table of every rank. Then each rank
//! connects to every lower rank and accepts from every higher one: a full mesh of TCP links.
//! This module only builds connections; it must never move tensor data, and it must never
//! wait without a deadline (the error names the ranks that never came).

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{RankInfo, read_message, write_message};
use crate::error::{CollectiveError, Result};
use crate::knobs::{BareUnit, parse_duration};
use crate::transport::TcpTransport;

/// Default `MASTER_PORT`, as torchrun.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Default time to wait for every rank to arrive.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// Where this rank stands in the job and where to meet the others.
#[derive(Clone, Debug, PartialEq)]
pub struct RendezvousConfig {
    /// This rank (`RANK`, `OMPI_COMM_WORLD_RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`).
    pub world_size: usize,
    /// Rank within this node (`LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`).
    pub local_rank: usize,
    /// Ranks on this node (`LOCAL_SIZE`, `LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`).
    pub local_size: usize,
    /// Host of rank 0 (`MASTER_ADDR`, default 127.0.0.1).
    pub master_addr: String,
    /// Port rank 0 listens on for rendezvous (`RINGWATCH_MASTER_PORT`, else `MASTER_PORT`,
    /// default 29500).
    pub master_port: u16,
    /// The job's id (`RINGWATCH_JOB_ID`); if rank 0 has none, it makes one up.
    pub job_id: Option<String>,
    /// How long to wait for all ranks (`RINGWATCH_CONNECT_TIMEOUT_SECS`, default 60 s).
    pub connect_timeout: Duration,
    /// The host name this rank reports in the job's `hello` (`None`: this machine's,
    /// [`host_name`]). Ranks with the same host share their host's control socket; tests
    /// use it to play several hosts in one process.
    pub host: Option<String>,
}

impl RendezvousConfig {
    /// A job of one rank (no network).
    pub fn single() -> Self {
        RendezvousConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            job_id: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            host: None,
        }
    }

    /// From the process environment (see [`RendezvousConfig::from_vars`]).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(&|n| std::env::var(n).ok())
    }

    /// From variables looked up with `get`. Without `RANK`/`WORLD_SIZE` (or the Open MPI
    /// equivalents) this is a job of one rank. Missing local values default to a single
    /// node: `LOCAL_SIZE = WORLD_SIZE`, `LOCAL_RANK = RANK % LOCAL_SIZE`.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |names: &[&str]| -> Result<Option<usize>> {
            for n in names {
                if let Some(v) = get(n).filter(|v| !v.trim().is_empty()) {
                    return v.trim().parse().map(Some).map_err(|_| {
                        CollectiveError::Config(format!("{n}={v:?} is not a number"))
                    });
                }
            }
            Ok(None)
        };
        let rank = num(&["RANK", "OMPI_COMM_WORLD_RANK"])?;
        let world_size = num(&["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"])?;
        let (rank, world_size) = match (rank, world_size) {
            (None, None) => (0, 1),
            (Some(r), Some(w)) => (r, w),
            _ => {
                return Err(CollectiveError::Config(
                    "set both RANK and WORLD_SIZE (or neither, for a single rank)".into(),
                ));
            }
        };
        if world_size == 0 || rank >= world_size {
            return Err(CollectiveError::Config(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let local_size = num(&[
            "LOCAL_SIZE",
            "LOCAL_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ])?
        .unwrap_or(world_size);
        if local_size == 0 {
            return Err(CollectiveError::Config(
                "LOCAL_SIZE must be at least 1".into(),
            ));
        }
        let local_rank =
            num(&["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"])?.unwrap_or(rank % local_size);
        let master_port = match num(&["RINGWATCH_MASTER_PORT", "MASTER_PORT"])? {
            None => DEFAULT_MASTER_PORT,
            Some(p) => u16::try_from(p)
                .map_err(|_| CollectiveError::Config(format!("master port {p} is not a port")))?,
        };
        let connect_timeout = match get("RINGWATCH_CONNECT_TIMEOUT_SECS") {
            None => DEFAULT_CONNECT_TIMEOUT,
            Some(v) => {
                let name = "RINGWATCH_CONNECT_TIMEOUT_SECS";
                let timeout = parse_duration(name, &v, BareUnit::Seconds)?;
                if timeout.is_zero() {
                    return Err(CollectiveError::Config(format!(
                        "{name}={v:?} is not a positive duration"
                    )));
                }
                timeout
            }
        };
        Ok(RendezvousConfig {
            rank,
            world_size,
            local_rank,
            local_size,
            master_addr: get("MASTER_ADDR")
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            job_id: get("RINGWATCH_JOB_ID").filter(|v| !v.trim().is_empty()),
            connect_timeout,
            host: None,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct Join {
    info: RankInfo,
    world_size: usize,
    job_id: Option<String>,
    data_port: u16,
    /// See [`crate::shm::host_key`]; ranks with equal keys may share memory.
    #[serde(default)]
    host_key: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Peer {
    info: RankInfo,
    /// `None` for rank 0: reach it at the address used for `MASTER_ADDR`.
    ip: Option<IpAddr>,
    data_port: u16,
    #[serde(default)]
    host_key: Option<String>,
}

#[derive(Serialize, Deserialize)]
enum JoinReply {
    Ok { job_id: String, peers: Vec<Peer> },
    Refused { message: String },
}

/// The result of a rendezvous.
#[derive(Debug)]
pub struct Rendezvous {
    /// Links to every other rank.
    pub transport: TcpTransport,
    /// Every rank, in rank order.
    pub ranks: Vec<RankInfo>,
    /// The job's id (the same on every rank).
    pub job_id: String,
    /// The rendezvous connections, kept open as the fault channel: on rank 0 one per other
    /// rank (`fault_links[r]`), elsewhere one to rank 0 (`fault_links[0]`).
    pub fault_links: Vec<Option<TcpStream>>,
    /// Every rank's host key ([`crate::shm::host_key`]), in rank order: ranks with equal
    /// keys share a host and may share memory.
    pub host_keys: Vec<Option<String>>,
}

/// This machine's host name.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

fn sanitize_job_id(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect()
}

/// 48 random bits from the kernel, in hex: the part of a default job id no
/// other user can guess (and so squat before the job binds its socket).
pub(crate) fn random_suffix() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 6];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        // No /dev/urandom (a bare container): the standard library's
        // per-process random hash keys, which come from the kernel too.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        bytes.copy_from_slice(&h.finish().to_le_bytes()[..6]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const HANDSHAKE_MAGIC: [u8; 4] = *b"RWv1";

/// Meets the other ranks and connects a full mesh; `op_timeout` bounds every later wait on
/// a peer.
pub fn rendezvous(cfg: &RendezvousConfig, op_timeout: Duration) -> Result<Rendezvous> {
    let me = RankInfo {
        rank: cfg.rank,
        local_rank: cfg.local_rank,
        local_size: cfg.local_size,
        host: cfg.host.clone().unwrap_or_else(host_name),
        pid: std::process::id(),
    };
    if cfg.world_size == 1 {
        let job_id = sanitize_job_id(
            &cfg.job_id
                .clone()
                .unwrap_or_else(|| format!("job-{}-{}", std::process::id(), random_suffix())),
        );
        return Ok(Rendezvous {
            transport: TcpTransport::new(0, 1, vec![None], op_timeout)?,
            ranks: vec![me],
            job_id,
            fault_links: vec![None],
            host_keys: vec![None],
        });
    }
    let deadline = Instant::now() + cfg.connect_timeout;
    let err = |message: String| CollectiveError::Rendezvous {
        rank: cfg.rank,
        message,
    };
    let data_listener =
        TcpListener::bind("0.0.0.0:0").map_err(|e| err(format!("cannot open a data port: {e}")))?;
    let data_port = data_listener
        .local_addr()
        .map_err(|e| err(e.to_string()))?
        .port();
    let master = resolve(&cfg.master_addr, cfg.master_port).map_err(&err)?;

    let (job_id, peers, fault_links) = if cfg.rank == 0 {
        serve_rendezvous(cfg, me, data_port, deadline)?
    } else {
        join_rendezvous(cfg, me, data_port, master, deadline)?
    };
    let addrs: Vec<SocketAddr> = peers
        .iter()
        .map(|p| SocketAddr::new(p.ip.unwrap_or(master.ip()), p.data_port))
        .collect();

    // Mesh: connect to every lower rank, accept every higher one.
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    for (peer, addr) in addrs.iter().enumerate().take(cfg.rank) {
        let mut s = connect_until(*addr, deadline)
            .map_err(|e| err(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
        let mut hs = HANDSHAKE_MAGIC.to_vec();
        hs.extend_from_slice(&(cfg.rank as u32).to_be_bytes());
        std::io::Write::write_all(&mut s, &hs)
            .map_err(|e| err(format!("handshake with rank {peer} failed: {e}")))?;
        streams[peer] = Some(s);
    }
    data_listener
        .set_nonblocking(true)
        .map_err(|e| err(e.to_string()))?;
    while streams.iter().skip(cfg.rank + 1).any(|s| s.is_none()) {
        match data_listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false).map_err(|e| err(e.to_string()))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .map_err(|e| err(e.to_string()))?;
                let mut hs = [0u8; 8];
                if std::io::Read::read_exact(&mut s, &mut hs).is_err() || hs[..4] != HANDSHAKE_MAGIC
                {
                    tracing::warn!(rank = cfg.rank, %from, "ignored a connection without a valid handshake");
                    continue;
                }
                let peer = u32::from_be_bytes([hs[4], hs[5], hs[6], hs[7]]) as usize;
                if peer <= cfg.rank || peer >= cfg.world_size || streams[peer].is_some() {
                    tracing::warn!(
                        rank = cfg.rank,
                        peer,
                        "ignored an unexpected mesh connection"
                    );
                    continue;
                }
                streams[peer] = Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (cfg.rank + 1..cfg.world_size)
                        .filter(|&r| streams[r].is_none())
                        .collect();
                    return Err(CollectiveError::RendezvousTimeout {
                        rank: cfg.rank,
                        missing,
                        timeout: cfg.connect_timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(err(format!("accept failed: {e}"))),
        }
    }
    let transport = TcpTransport::new(cfg.rank, cfg.world_size, streams, op_timeout)?;
    tracing::info!(
        rank = cfg.rank,
        world_size = cfg.world_size,
        job_id,
        "rendezvous complete"
    );
    let host_keys = peers.iter().map(|p| p.host_key.clone()).collect();
    Ok(Rendezvous {
        transport,
        ranks: peers.into_iter().map(|p| p.info).collect(),
        job_id,
        fault_links,
        host_keys,
    })
}

fn resolve(host: &str, port: u16) -> std::result::Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve MASTER_ADDR={host}: {e}"))?
        .find(|a| a.is_ipv4())
        .or_else(|| {
            (host, port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
        })
        .ok_or_else(|| format!("MASTER_ADDR={host} has no address"))
}

fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.max(Duration::from_millis(10))
                .min(Duration::from_secs(2)),
        ) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn serve_rendezvous(
    cfg: &RendezvousConfig,
    me: RankInfo,
    data_port: u16,
    deadline: Instant,
) -> Result<(String, Vec<Peer>, Vec<Option<TcpStream>>)> {
    let err = |message: String| CollectiveError::Rendezvous { rank: 0, message };
    let listener = TcpListener::bind(("0.0.0.0", cfg.master_port)).map_err(|e| {
        err(format!(
            "cannot listen on port {} (RINGWATCH_MASTER_PORT or MASTER_PORT): {e} \
             (is another job, or torch.distributed's store, using it?)",
            cfg.master_port
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| err(e.to_string()))?;
    let mut joined: Vec<Option<(TcpStream, Peer)>> = (0..cfg.world_size).map(|_| None).collect();
    let mut remaining = cfg.world_size - 1;
    while remaining > 0 {
        match listener.accept() {
            Ok((mut s, from)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                let join: Join = match read_message(&mut s) {
                    Ok(j) => j,
                    Err(e) => {
                        tracing::warn!(%from, error = %e, "ignored a bad rendezvous request");
                        continue;
                    }
                };
                let r = join.info.rank;
                let refusal = if join.world_size != cfg.world_size {
                    Some(format!(
                        "rank {r} has WORLD_SIZE={} but rank 0 has {}",
                        join.world_size, cfg.world_size
                    ))
                } else if r == 0 || r >= cfg.world_size || joined[r].is_some() {
                    Some(format!("rank {r} is not expected (duplicate RANK?)"))
                } else if cfg.job_id.is_some() && join.job_id.is_some() && join.job_id != cfg.job_id
                {
                    Some(format!(
                        "rank {r} belongs to job {:?}, not {:?}",
                        join.job_id, cfg.job_id
                    ))
                } else {
                    None
                };
                if let Some(message) = refusal {
                    tracing::warn!(%from, message, "refused a rank at rendezvous");
                    let _ = write_message(&mut s, &JoinReply::Refused { message });
                    continue;
                }
                let peer = Peer {
                    info: join.info,
                    ip: Some(from.ip()),
                    data_port: join.data_port,
                    host_key: join.host_key,
                };
                joined[r] = Some((s, peer));
                remaining -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..cfg.world_size)
                        .filter(|&r| joined[r].is_none())
                        .collect();
                    for (s, _) in joined.iter_mut().flatten() {
                        let _ = write_message(
                            s,
                            &JoinReply::Refused {
                                message: format!("rank(s) {missing:?} never came"),
                            },
                        );
                    }
                    return Err(CollectiveError::RendezvousTimeout {
                        rank: 0,
                        missing,
                        timeout: cfg.connect_timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(err(format!("accept failed: {e}"))),
        }
    }
    let job_id = sanitize_job_id(
        &cfg.job_id
            .clone()
            .unwrap_or_else(|| format!("job-{}-{}", cfg.master_port, random_suffix())),
    );
    let mut peers = vec![Peer {
        info: me,
        ip: None,
        data_port,
        host_key: crate::shm::host_key(),
    }];
    let mut streams: Vec<Option<TcpStream>> = vec![None];
    for (s, p) in joined.into_iter().flatten() {
        streams.push(Some(s));
        peers.push(p);
    }
    let reply = JoinReply::Ok {
        job_id: job_id.clone(),
        peers,
    };
    for s in streams.iter_mut().flatten() {
        write_message(s, &reply).map_err(|e| err(format!("cannot answer a rank: {e}")))?;
    }
    match reply {
        JoinReply::Ok { job_id, peers } => Ok((job_id, peers, streams)),
        JoinReply::Refused { message } => Err(err(message)),
    }
}

fn join_rendezvous(
    cfg: &RendezvousConfig,
    me: RankInfo,
    data_port: u16,
    master: SocketAddr,
    deadline: Instant,
) -> Result<(String, Vec<Peer>, Vec<Option<TcpStream>>)> {
    let err = |message: String| CollectiveError::Rendezvous {
        rank: cfg.rank,
        message,
    };
    let mut s =
        connect_until(master, deadline).map_err(|_| CollectiveError::RendezvousTimeout {
            rank: cfg.rank,
            missing: vec![0],
            timeout: cfg.connect_timeout,
        })?;
    let join = Join {
        info: me,
        world_size: cfg.world_size,
        job_id: cfg.job_id.clone(),
        data_port,
        host_key: crate::shm::host_key(),
    };
    write_message(&mut s, &join).map_err(|e| err(format!("cannot reach rank 0: {e}")))?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_secs(1))))
        .map_err(|e| err(e.to_string()))?;
    match read_message::<_, JoinReply>(&mut s) {
        Ok(JoinReply::Ok { job_id, peers }) => {
            if peers.len() != cfg.world_size {
                return Err(err(format!("rank 0 sent {} ranks", peers.len())));
            }
            let mut links: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
            links[0] = Some(s);
            Ok((job_id, peers, links))
        }
        Ok(JoinReply::Refused { message }) => Err(err(format!("rank 0 refused: {message}"))),
        Err(e) => Err(err(format!(
            "no answer from rank 0 (some ranks may not have come): {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::vars;

    #[test]
    fn reads_torchrun_and_open_mpi_variables() {
        let c = RendezvousConfig::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_size, c.local_rank),
            (3, 4, 2, 1)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", 1234));
        let c = RendezvousConfig::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_size),
            (1, 2, 1, 2)
        );
        assert_eq!(
            RendezvousConfig::from_vars(&vars(&[])).unwrap().world_size,
            1
        );
        assert!(RendezvousConfig::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "2")])).is_err());
        // A job that also runs torch.distributed (its store on MASTER_PORT) moves ours.
        let c = RendezvousConfig::from_vars(&vars(&[
            ("MASTER_PORT", "1234"),
            ("RINGWATCH_MASTER_PORT", "1240"),
        ]))
        .unwrap();
        assert_eq!(c.master_port, 1240);
    }

    #[test]
    fn a_rank_that_never_comes_is_named() {
        let port = free_port();
        // Rank 0 waits this long for rank 2, and for rank 1, which comes at once: long
        // enough that a loaded machine cannot keep rank 1 from joining in time (it would
        // be named missing too).
        let cfg = RendezvousConfig {
            rank: 0,
            world_size: 3,
            master_port: port,
            connect_timeout: Duration::from_secs(10),
            ..RendezvousConfig::single()
        };
        // Rank 1 waits for rank 0's answer past rank 0's own deadline (its wait begins
        // on another thread, maybe before rank 0's): the answer names rank 2.
        let c1 = RendezvousConfig {
            rank: 1,
            connect_timeout: Duration::from_secs(60),
            ..cfg.clone()
        };
        let joiner = std::thread::spawn(move || rendezvous(&c1, Duration::from_secs(1)));
        let err = rendezvous(&cfg, Duration::from_secs(1)).unwrap_err();
        assert!(
            matches!(&err, CollectiveError::RendezvousTimeout { missing, .. } if missing == &vec![2]),
            "{err}"
        );
        let err1 = joiner.join().unwrap().unwrap_err();
        assert!(err1.to_string().contains("[2]"), "{err1}");
    }

    pub(crate) fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}
