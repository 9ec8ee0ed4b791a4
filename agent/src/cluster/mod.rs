//! `cluster`: the agents of a cluster know each other, and answer job-wide
//! questions by asking the agents of the job's other hosts.
//!
//! An agent learns its peers from `--peers host:port,…` and from a DNS name
//! that resolves to every agent (`--peers-dns`, a headless Service),
//! re-resolved every [`DNS_REFRESH`]. It asks them only read-only questions
//! over their plain HTTP API (`GET /api/jobs`, `/api/clock`,
//! `/api/timeline?clock=unix`, `/api/jobs/{id}/load`), the same that any
//! client may ask; each call has a deadline ([`ClusterConfig::timeout`]) and
//! a byte limit, and runs on the blocking pool, so a dead, slow or hostile
//! peer makes an answer partial (the peer named in `missing`), never a hang
//! or an error of the whole answer. An agent that finds itself among its
//! peers (the DNS name resolves to every agent, itself included) knows
//! itself by its `agent_id` and skips that address.
//!
//! Time across nodes: every agent exports its timeline on its wall clock
//! (`clock=unix`: its eBPF monotonic clock mapped to CLOCK_REALTIME), and
//! the asking agent estimates each peer's wall-clock offset from round trips
//! to `/api/clock` (NTP's way: of a few probes, the one with the shortest
//! round trip; offset = peer's time − the probe's midpoint, uncertainty =
//! half that round trip). A merged answer is on the asking agent's clock and
//! states each node's offset and uncertainty.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Value, json};

/// How often `--peers-dns` is resolved again.
pub const DNS_REFRESH: Duration = Duration::from_secs(30);

/// How long a peer's clock offset estimate is reused.
const CLOCK_REUSE: Duration = Duration::from_secs(30);

/// Round trips per clock estimate (the shortest one wins).
const CLOCK_PROBES: usize = 4;

/// Bytes read of one peer answer that is not a timeline.
pub const MAX_SMALL_ANSWER_BYTES: u64 = 4 << 20;

/// Peers asked at once.
const MAX_PEERS: usize = 256;

/// How long a peer whose call failed is not asked again: every cluster
/// answer in that time names it at once instead of waiting out its deadline.
pub const PEER_FAILURE_MEMORY: Duration = Duration::from_secs(10);

/// The longest node or host name believed from a peer, bytes (a DNS name's
/// limit): a longer one is cut, so no name can blow up an answer it is
/// copied into.
pub const MAX_NAME_BYTES: usize = 253;

/// The most hosts of one job believed from a peer's answer (the rest are
/// left out of the merged view, which says so): a job's hosts are listed in
/// every merged answer.
pub const MAX_JOB_HOSTS: usize = 4096;

/// Whether a peer call's error says the peer could not be reached or did not
/// answer in time (remembered for [`PEER_FAILURE_MEMORY`]), rather than that
/// it answered something unwanted (an HTTP error, an answer too large or not
/// JSON: the next question may go well).
fn unreachable(why: &str) -> bool {
    !(why.starts_with("HTTP ") || why.starts_with("its answer") || why.starts_with("reading its"))
}

/// `name` cut to [`MAX_NAME_BYTES`] (at a character boundary).
pub fn bounded_name(name: &str) -> &str {
    if name.len() <= MAX_NAME_BYTES {
        return name;
    }
    let mut end = MAX_NAME_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// Who this agent is among its peers, and where they are.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's name (`--node-name`; Kubernetes' `spec.nodeName`).
    pub node_name: String,
    /// Peers given by address (`--peers`), `host:port`.
    pub peers: Vec<String>,
    /// A name resolving to every agent, `host:port` (`--peers-dns`).
    pub peers_dns: Option<String>,
    /// Deadline of one peer call.
    pub timeout: Duration,
    /// Bytes read of one peer's timeline answer.
    pub max_timeline_bytes: u64,
}

/// A peer's wall clock against ours.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct ClockEstimate {
    /// Peer's wall clock minus ours, µs.
    pub offset_us: f64,
    /// Half the shortest round trip, µs: the offset is within this.
    pub uncertainty_us: f64,
}

/// What one peer said, or why it said nothing.
#[derive(Debug, Clone)]
pub struct PeerAnswer {
    /// The address asked.
    pub addr: String,
    /// The node name it gave (absent when it did not answer).
    pub node: Option<String>,
    /// Its answer, or why there is none.
    pub result: Result<Value, String>,
}

/// The cluster view of one agent: its identity and its peers.
pub struct Cluster {
    config: ClusterConfig,
    /// Random per agent process: how an agent recognises itself among the
    /// addresses its DNS name resolves to.
    agent_id: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Addresses from `--peers-dns` at its last resolution.
    resolved: Vec<String>,
    /// When the DNS name was last resolved, and why it failed if it did.
    resolved_at: Option<Instant>,
    dns_error: Option<String>,
    /// Addresses that turned out to be this agent.
    own_addrs: BTreeSet<String>,
    /// Clock estimates per address.
    clocks: HashMap<String, (Instant, ClockEstimate)>,
    /// Peers whose last call failed: when, and why (asked again only after
    /// [`PEER_FAILURE_MEMORY`]).
    failed: HashMap<String, (Instant, String)>,
}

/// CLOCK_REALTIME now, µs.
pub fn unix_now_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

impl Cluster {
    /// A cluster view; nothing is resolved or asked until needed.
    pub fn new(config: ClusterConfig) -> Arc<Self> {
        let agent_id = format!(
            "{:016x}{:08x}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            std::process::id()
        );
        Arc::new(Self {
            config,
            agent_id,
            state: Mutex::new(State::default()),
        })
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.config.node_name
    }

    /// This agent's id (random per process).
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// Whether any peer is configured.
    pub fn has_peers(&self) -> bool {
        !self.config.peers.is_empty() || self.config.peers_dns.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The peers to ask now: `--peers` and `--peers-dns` (re-resolved when
    /// older than [`DNS_REFRESH`]), without this agent's own addresses.
    pub async fn peers(&self) -> Vec<String> {
        if let Some(name) = &self.config.peers_dns {
            let stale = self
                .lock()
                .resolved_at
                .is_none_or(|at| at.elapsed() >= DNS_REFRESH);
            if stale {
                let resolved =
                    tokio::time::timeout(self.config.timeout, tokio::net::lookup_host(name)).await;
                let mut state = self.lock();
                state.resolved_at = Some(Instant::now());
                match resolved {
                    Ok(Ok(addrs)) => {
                        let mut list: Vec<String> =
                            addrs.map(|a: SocketAddr| a.to_string()).collect();
                        list.sort();
                        list.dedup();
                        if state.resolved != list {
                            tracing::info!(name, peers = ?list, "peers resolved");
                        }
                        state.resolved = list;
                        state.dns_error = None;
                    }
                    Ok(Err(error)) => {
                        if state.dns_error.is_none() {
                            tracing::warn!(name, %error, "cannot resolve --peers-dns (kept the last answer)");
                        }
                        state.dns_error = Some(error.to_string());
                    }
                    Err(_) => {
                        state.dns_error =
                            Some(format!("no answer within {:?}", self.config.timeout));
                    }
                }
            }
        }
        let state = self.lock();
        let mut all: Vec<String> = self
            .config
            .peers
            .iter()
            .chain(state.resolved.iter())
            .filter(|a| !state.own_addrs.contains(*a))
            .cloned()
            .collect();
        all.sort();
        all.dedup();
        all.truncate(MAX_PEERS);
        all
    }

    /// Why the peer list may be incomplete (a failed DNS resolution).
    pub fn dns_error(&self) -> Option<String> {
        self.lock().dns_error.clone()
    }

    /// GETs `path` of every peer at once, each within the deadline; answers
    /// from this agent itself (its `agent_id`) are dropped and its address
    /// remembered.
    pub async fn ask_all(&self, path: &str, max_bytes: u64) -> Vec<PeerAnswer> {
        let peers = self.peers().await;
        let mut tasks = tokio::task::JoinSet::new();
        for addr in peers {
            let path = path.to_owned();
            let timeout = self.config.timeout;
            let remembered = self.failed_lately(&addr);
            tasks.spawn(async move {
                let result = match remembered {
                    Err(why) => Err(why),
                    Ok(()) => get_json(&addr, &path, timeout, max_bytes).await,
                };
                (addr, result)
            });
        }
        let mut answers = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            let Ok((addr, result)) = joined else {
                continue;
            };
            if let Err(why) = &result
                && unreachable(why)
                && self.failed_lately(&addr).is_ok()
            {
                self.remember_failure(&addr, why);
            }
            if let Ok(value) = &result
                && value.get("agent_id").and_then(Value::as_str) == Some(self.agent_id.as_str())
            {
                self.lock().own_addrs.insert(addr);
                continue;
            }
            let node = result
                .as_ref()
                .ok()
                .and_then(|v| v.get("node"))
                .and_then(Value::as_str)
                .map(|name| bounded_name(name).to_owned());
            answers.push(PeerAnswer { addr, node, result });
        }
        answers.sort_by(|a, b| a.addr.cmp(&b.addr));
        answers
    }

    /// The wall-clock offset of the peer at `addr` (reused for
    /// [`CLOCK_REUSE`]).
    pub async fn clock(&self, addr: &str) -> Result<ClockEstimate, String> {
        if let Some((at, estimate)) = self.lock().clocks.get(addr)
            && at.elapsed() < CLOCK_REUSE
        {
            return Ok(*estimate);
        }
        self.failed_lately(addr)?;
        // One deadline for all the probes, and none after a failure: a
        // peer that hangs costs one timeout, not one per probe.
        let deadline = Instant::now() + self.config.timeout;
        let mut best: Option<ClockEstimate> = None;
        let mut last_error = None;
        for _ in 0..CLOCK_PROBES {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let sent = unix_now_us();
            let started = Instant::now();
            match get_json(addr, "/api/clock", left, 4096).await {
                Ok(answer) => {
                    let rtt_us = started.elapsed().as_secs_f64() * 1e6;
                    let Some(peer_us) = answer.get("unix_us").and_then(Value::as_f64) else {
                        return Err("its /api/clock answer has no unix_us".into());
                    };
                    let estimate = ClockEstimate {
                        offset_us: peer_us - (sent + rtt_us / 2.0),
                        uncertainty_us: rtt_us / 2.0,
                    };
                    if best.is_none_or(|b| estimate.uncertainty_us < b.uncertainty_us) {
                        best = Some(estimate);
                    }
                }
                Err(error) => last_error = Some(error),
            }
        }
        let estimate = match best {
            Some(estimate) => estimate,
            None => {
                let why = last_error
                    .unwrap_or_else(|| format!("no clock answer within {:?}", self.config.timeout));
                self.remember_failure(addr, &why);
                return Err(why);
            }
        };
        self.lock()
            .clocks
            .insert(addr.to_owned(), (Instant::now(), estimate));
        Ok(estimate)
    }

    /// `Err` with the remembered reason when the peer at `addr` failed less
    /// than [`PEER_FAILURE_MEMORY`] ago.
    pub fn failed_lately(&self, addr: &str) -> Result<(), String> {
        let mut state = self.lock();
        match state.failed.get(addr) {
            Some((at, why)) if at.elapsed() < PEER_FAILURE_MEMORY => Err(format!(
                "{why} ({:.0} s ago; asked again {} s after a failure)",
                at.elapsed().as_secs_f64(),
                PEER_FAILURE_MEMORY.as_secs()
            )),
            Some(_) => {
                state.failed.remove(addr);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Remembers that a call to the peer at `addr` failed.
    pub fn remember_failure(&self, addr: &str, why: &str) {
        let mut state = self.lock();
        // Bounded by the peers there are (at most MAX_PEERS addresses are asked).
        if state.failed.len() < 4 * MAX_PEERS || state.failed.contains_key(addr) {
            let why: String = why.chars().take(1024).collect();
            state.failed.insert(addr.to_owned(), (Instant::now(), why));
        }
    }

    /// Deadline of one peer call.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// Byte limit of a peer's timeline answer.
    pub fn max_timeline_bytes(&self) -> u64 {
        self.config.max_timeline_bytes
    }
}

/// GETs `http://addr/path` and parses its JSON, within `timeout` and
/// `max_bytes`; any failure is a sentence naming what failed.
pub async fn get_json(
    addr: &str,
    path: &str,
    timeout: Duration,
    max_bytes: u64,
) -> Result<Value, String> {
    let bytes = get_bytes(addr, path, timeout, max_bytes).await?;
    serde_json::from_slice(&bytes).map_err(|e| format!("its answer is not JSON: {e}"))
}

/// GETs `http://addr/path`: the body's bytes, within `timeout` and
/// `max_bytes`; an answer that is not 200 is an error with its message.
pub async fn get_bytes(
    addr: &str,
    path: &str,
    timeout: Duration,
    max_bytes: u64,
) -> Result<Vec<u8>, String> {
    let url = format!("http://{addr}{path}");
    let task = tokio::task::spawn_blocking(move || {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout)
            .timeout(timeout)
            .redirects(0)
            .build();
        let response = agent.get(&url).call().map_err(|e| match e {
            ureq::Error::Status(code, response) => {
                let mut body = Vec::new();
                let _ = response.into_reader().take(64 << 10).read_to_end(&mut body);
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let why = body
                    .get("error")
                    .and_then(|e| e.get("message").or(Some(e)))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                format!("HTTP {code} {why}").trim().to_owned()
            }
            other => other.to_string(),
        })?;
        let mut bytes = Vec::new();
        response
            .into_reader()
            .take(max_bytes + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("reading its answer: {e}"))?;
        if bytes.len() as u64 > max_bytes {
            return Err(format!("its answer is over {max_bytes} bytes"));
        }
        Ok(bytes)
    });
    match tokio::time::timeout(timeout + Duration::from_secs(1), task).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(format!("the call failed: {e}")),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Merges this agent's jobs with its peers' `/api/jobs` answers: per job,
/// which node speaks for which host, and which of the job's hosts no
/// reachable agent speaks for.
pub fn merge_jobs(local_node: &str, local_jobs: &[Value], answers: &[PeerAnswer]) -> Value {
    // job id -> (a hello-like summary, node entries)
    let mut jobs: BTreeMap<String, (Value, Vec<Value>)> = BTreeMap::new();
    let mut add = |node: &str, agent: &str, job: &Value| {
        let Some(id) = job.get("job_id").and_then(Value::as_str) else {
            return;
        };
        let entry = jobs
            .entry(id.to_owned())
            .or_insert_with(|| (job.clone(), Vec::new()));
        let host = bounded_name(job.get("host").and_then(Value::as_str).unwrap_or(""));
        let local: Vec<Value> = job
            .get("ranks")
            .and_then(Value::as_array)
            .map(|ranks| {
                ranks
                    .iter()
                    .filter(|r| r.get("host").and_then(Value::as_str) == Some(host))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        entry.1.push(json!({
            "node": node,
            "agent": agent,
            "host": host,
            "served_by_rank": job.get("served_by_rank").cloned().unwrap_or(json!(0)),
            "state": job.get("state").cloned().unwrap_or(Value::Null),
            "ranks": local,
        }));
    };
    for job in local_jobs {
        add(local_node, "self", job);
    }
    let mut missing_peers = Vec::new();
    for answer in answers {
        match &answer.result {
            Ok(value) => {
                let node = answer.node.as_deref().unwrap_or(&answer.addr);
                for job in value
                    .get("jobs")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    add(node, &answer.addr, job);
                }
            }
            Err(why) => missing_peers.push(json!({ "agent": answer.addr, "error": why })),
        }
    }
    let list: Vec<Value> = jobs
        .into_iter()
        .map(|(id, (summary, nodes))| {
            let kind = summary
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or("ringwatch");
            let covered: BTreeSet<&str> = nodes
                .iter()
                .filter_map(|n| n.get("host").and_then(Value::as_str))
                .collect();
            // A ringwatch job's hello names every rank and host; a job found
            // from its launcher's variables is known only by the ranks each
            // node's agent sees: whole once they add up to its world size.
            let world_size = summary.get("world_size").and_then(Value::as_u64);
            // Of connected nodes, the ranks below the world size.
            let ranks_seen: BTreeSet<u64> = nodes
                .iter()
                .filter(|n| n.get("state").and_then(Value::as_str) != Some("lost"))
                .filter_map(|n| n.get("ranks").and_then(Value::as_array))
                .flatten()
                .filter_map(|r| r.get("rank").and_then(Value::as_u64))
                .filter(|&r| world_size.is_some_and(|w| r < w))
                .collect();
            let hosts: Vec<String> = if kind == "ringwatch" {
                job_hosts(&summary)
            } else {
                covered.iter().map(|h| (*h).to_owned()).collect()
            };
            let missing: Vec<&String> = hosts
                .iter()
                .filter(|h| !covered.contains(h.as_str()))
                .collect();
            let listed = summary
                .get("ranks")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            let whole = if kind == "ringwatch" {
                missing.is_empty()
            } else {
                world_size.is_some_and(|w| w > 0 && ranks_seen.len() as u64 == w)
            };
            json!({
                "job_id": id,
                "kind": kind,
                "ranks_seen": ranks_seen.len(),
                "world_size": summary.get("world_size").cloned().unwrap_or(Value::Null),
                // At MAX_JOB_HOSTS the list is cut: the view cannot say the job is whole.
                "hosts_cut_at": (hosts.len() == MAX_JOB_HOSTS && listed > MAX_JOB_HOSTS)
                    .then_some(MAX_JOB_HOSTS),
                "hosts": hosts,
                "nodes": nodes,
                "missing_hosts": missing,
                "complete": whole && hosts.len() < MAX_JOB_HOSTS,
            })
        })
        .collect();
    json!({ "node": local_node, "jobs": list, "missing_peers": missing_peers })
}

/// A job's hosts from its (`/api/jobs`) entry, in rank order, each once,
/// each name at most [`MAX_NAME_BYTES`], at most [`MAX_JOB_HOSTS`] of them.
/// Linear in the ranks: a peer's answer may list tens of thousands.
pub fn job_hosts(job: &Value) -> Vec<String> {
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut hosts: Vec<String> = Vec::new();
    for rank in job
        .get("ranks")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(host) = rank.get("host").and_then(Value::as_str).map(bounded_name)
            && seen.insert(host)
        {
            if hosts.len() == MAX_JOB_HOSTS {
                break;
            }
            hosts.push(host.to_owned());
        }
    }
    hosts
}

/// One node's part of a merged timeline.
pub struct NodeTrace {
    /// The node's name.
    pub node: String,
    /// The agent asked (`self` for this one).
    pub agent: String,
    /// Its wall-clock offset to ours (zero for this agent).
    pub clock: ClockEstimate,
    /// Added to each of its timestamps to put it on our wall clock: this
    /// agent's CLOCK_REALTIME − CLOCK_MONOTONIC for its own live answer,
    /// minus the offset for a peer's (already on its wall clock).
    pub shift_us: f64,
    /// Its `/api/timeline` answer, as JSON bytes.
    pub trace: Vec<u8>,
}

/// A trace answer read without building it: its events stay slices of the
/// answer's bytes.
#[derive(serde::Deserialize)]
struct RawTrace<'a> {
    #[serde(borrow, rename = "traceEvents")]
    events: Vec<&'a serde_json::value::RawValue>,
}

/// What the merge reads of each event to sort it.
#[derive(serde::Deserialize)]
struct EventKey {
    #[serde(default)]
    ph: Option<String>,
    #[serde(default)]
    ts: Option<f64>,
    #[serde(default)]
    pid: Option<Value>,
}

/// One event written back with a new `ts` and `pid` (and, for a
/// `process_name`, its node in the name), its other fields as they were.
fn rewrite_event(
    raw: &serde_json::value::RawValue,
    ts: Option<f64>,
    pid: Option<&str>,
    node: Option<&str>,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let fields: BTreeMap<std::borrow::Cow<'_, str>, &serde_json::value::RawValue> =
        serde_json::from_str(raw.get()).map_err(|e| format!("an event is not an object: {e}"))?;
    out.push(b'{');
    let mut first = true;
    for (key, value) in &fields {
        if !first {
            out.push(b',');
        }
        first = false;
        serde_json::to_writer(&mut *out, key).map_err(|e| e.to_string())?;
        out.push(b':');
        match key.as_ref() {
            "ts" if ts.is_some() => {
                serde_json::to_writer(&mut *out, &ts).map_err(|e| e.to_string())?;
            }
            "pid" if pid.is_some() => {
                serde_json::to_writer(&mut *out, &pid).map_err(|e| e.to_string())?;
            }
            "args" if node.is_some() => {
                let mut args: Value = serde_json::from_str(value.get()).unwrap_or(Value::Null);
                if let (Some(node), Some(object)) = (node, args.as_object_mut()) {
                    let base = object.get("name").and_then(Value::as_str).unwrap_or("");
                    let named = format!("{base} @ {node}");
                    object.insert("name".into(), json!(named));
                    object.insert("node".into(), json!(node));
                }
                serde_json::to_writer(&mut *out, &args).map_err(|e| e.to_string())?;
            }
            _ => out.extend_from_slice(value.get().as_bytes()),
        }
    }
    out.push(b'}');
    Ok(())
}

/// The latest event time believed from a node, µs since the Unix epoch
/// (year 2286): a peer's ±1e308 is not a time.
const MAX_TS_US: f64 = 1e16;

/// Merges nodes' timelines onto this agent's wall clock, in time order,
/// into JSON bytes of at most about `max_bytes`. Each node's processes are
/// keyed `<node>/<pid>` (pid numbers repeat across nodes) and named with
/// their node; the metadata says per node its offset, uncertainty and event
/// count, and which nodes are missing and why. At most `max_events` events
/// (names first, then the earliest) are kept, in about `max_bytes`;
/// `truncated` says how many were left out (at the count or the byte
/// budget), `events_rejected` how many a node sent that are not events. Events stay slices
/// of the answers' bytes until written: memory is the answers plus 24 bytes
/// an event.
pub fn merge_timelines(
    nodes: &[NodeTrace],
    mut missing: Vec<Value>,
    max_events: usize,
    max_bytes: usize,
    extra: serde_json::Map<String, Value>,
) -> Vec<u8> {
    let mut parsed: Vec<(usize, RawTrace<'_>)> = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        match serde_json::from_slice::<RawTrace<'_>>(&node.trace) {
            Ok(trace) => parsed.push((i, trace)),
            Err(e) => missing.push(json!({
                "node": node.node, "agent": node.agent,
                "error": format!("its timeline is not a trace: {e}"),
            })),
        }
    }
    // (ts on our clock, node, event index); metadata events first.
    let mut meta: Vec<(usize, usize)> = Vec::new();
    let mut timed: Vec<(f64, usize, usize)> = Vec::new();
    let mut counts = vec![0usize; nodes.len()];
    let mut rejected = 0usize;
    for (i, trace) in &parsed {
        for (j, raw) in trace.events.iter().enumerate() {
            let Ok(key) = serde_json::from_str::<EventKey>(raw.get()) else {
                rejected += 1;
                continue;
            };
            // A node's events are believed only with a pid (a number, or a
            // short name) and, when timed, a time on the Unix clock in µs.
            let pid_ok = match &key.pid {
                None => true,
                Some(Value::Number(n)) => n.is_u64(),
                Some(Value::String(s)) => s.len() <= MAX_NAME_BYTES,
                Some(_) => false,
            };
            let ts_ok = key.ts.is_none_or(|ts| {
                let ts = ts + nodes[*i].shift_us;
                ts.is_finite() && (0.0..=MAX_TS_US).contains(&ts)
            });
            if !(pid_ok && ts_ok) {
                rejected += 1;
                continue;
            }
            if key.ph.as_deref() == Some("M") {
                // A rank of another host, named here for lack of its
                // threads: its own node's part has it.
                if !key.pid.as_ref().is_some_and(Value::is_string) {
                    meta.push((*i, j));
                }
                continue;
            }
            if let Some(ts) = key.ts {
                timed.push((ts + nodes[*i].shift_us, *i, j));
                counts[*i] += 1;
            }
        }
    }
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let events_of = |i: usize| -> &[&serde_json::value::RawValue] {
        parsed
            .iter()
            .find(|(n, _)| *n == i)
            .map_or(&[], |(_, t)| t.events.as_slice())
    };
    let mut out = Vec::with_capacity(max_bytes.min(64 << 20) / 4);
    out.extend_from_slice(b"{\"traceEvents\":[");
    let mut written = 0usize;
    let mut first = true;
    let mut write = |out: &mut Vec<u8>, i: usize, j: usize, ts: Option<f64>| -> bool {
        let raw = events_of(i)[j];
        let node = bounded_name(&nodes[i].node);
        let key: Option<EventKey> = serde_json::from_str(raw.get()).ok();
        let pid = key.and_then(|k| k.pid).map(|pid| match pid {
            Value::String(s) => format!("{node}/{s}"),
            other => format!("{node}/{other}"),
        });
        let is_name = ts.is_none() && raw.get().contains("\"process_name\"");
        let mark = out.len();
        if !first {
            out.push(b',');
        }
        if rewrite_event(raw, ts, pid.as_deref(), is_name.then_some(node), out).is_err() {
            out.truncate(mark);
            return true;
        }
        first = false;
        true
    };
    // Names first (a viewer needs them before the events), through the same
    // budget as every other event: a peer's metadata counts too.
    // Names count against the bytes only: a job's thousands of thread names
    // must not crowd out its events, and the bytes bound what a peer sends.
    let mut left_out = 0usize;
    let mut names_written = 0usize;
    for &(i, j) in &meta {
        if out.len() >= max_bytes {
            left_out += 1;
            continue;
        }
        write(&mut out, i, j, None);
        names_written += 1;
    }
    for &(ts, i, j) in &timed {
        if written >= max_events || out.len() >= max_bytes {
            left_out += 1;
            continue;
        }
        write(&mut out, i, j, Some(ts));
        written += 1;
    }
    let node_notes: Vec<Value> = nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| parsed.iter().any(|(n, _)| n == i))
        .map(|(i, node)| {
            json!({
                "node": bounded_name(&node.node),
                "agent": node.agent,
                "status": "ok",
                "clock_offset_us": node.clock.offset_us,
                "clock_uncertainty_us": node.clock.uncertainty_us,
                "events": counts[i],
            })
        })
        .collect();
    let mut metadata = extra;
    metadata.insert("clock".into(), json!("unix_us"));
    metadata.insert("now".into(), json!(unix_now_us()));
    metadata.insert("scope".into(), json!("cluster"));
    metadata.insert("source".into(), json!("live eBPF, every node of the job"));
    metadata.insert("nodes".into(), json!(node_notes));
    metadata.insert("partial".into(), json!(!missing.is_empty()));
    metadata.insert("missing".into(), json!(missing));
    if rejected > 0 {
        metadata.insert(
            "events_rejected".into(),
            json!({
                "count": rejected,
                "reason": "not an object with a numeric or short pid and a time on the Unix \
                           clock in µs",
            }),
        );
    }
    if left_out > 0 {
        metadata.insert(
            "truncated".into(),
            json!({
                "reason": format!(
                    "the merged answer holds at most {max_events} events and {max_bytes} bytes; \
                     narrow from/to, or ask for downsample=true"
                ),
                "max_bytes": max_bytes,
                "events_written": written + names_written,
                "events_left_out": left_out,
            }),
        );
    }
    out.extend_from_slice(b"],\"displayTimeUnit\":\"ms\",\"metadata\":");
    let _ = serde_json::to_writer(&mut out, &metadata);
    out.push(b'}');
    out
}

/// Shifts a timeline answer (JSON bytes, on the live monotonic clock) to
/// the wall clock: every event's `ts` and `metadata.now` plus `offset_us`
/// (CLOCK_REALTIME − CLOCK_MONOTONIC), and says so in `metadata.clock`.
/// Events are rewritten one at a time from the answer's bytes.
pub fn to_wall_clock(json_bytes: &[u8], offset_us: f64) -> Result<Vec<u8>, String> {
    #[derive(serde::Deserialize)]
    struct Whole<'a> {
        #[serde(borrow, rename = "traceEvents")]
        events: Vec<&'a serde_json::value::RawValue>,
        #[serde(default)]
        metadata: serde_json::Map<String, Value>,
    }
    let whole: Whole<'_> = serde_json::from_slice(json_bytes)
        .map_err(|e| format!("the answer is not a trace: {e}"))?;
    let mut out = Vec::with_capacity(json_bytes.len() + json_bytes.len() / 8);
    out.extend_from_slice(b"{\"traceEvents\":[");
    for (i, raw) in whole.events.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let ts = serde_json::from_str::<EventKey>(raw.get())
            .ok()
            .and_then(|k| k.ts)
            .map(|ts| ts + offset_us);
        match ts {
            Some(ts) => rewrite_event(raw, Some(ts), None, None, &mut out)?,
            None => out.extend_from_slice(raw.get().as_bytes()),
        }
    }
    let mut metadata = whole.metadata;
    if let Some(now) = metadata.get("now").and_then(Value::as_f64) {
        metadata.insert("now".into(), json!(now + offset_us));
    }
    metadata.insert("clock".into(), json!("unix_us"));
    metadata.insert("clock_offset_applied_us".into(), json!(offset_us));
    out.extend_from_slice(b"],\"displayTimeUnit\":\"ms\",\"metadata\":");
    serde_json::to_writer(&mut out, &metadata).map_err(|e| e.to_string())?;
    out.push(b'}');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(events: Vec<Value>) -> Vec<u8> {
        serde_json::to_vec(&json!({ "traceEvents": events, "metadata": {} })).unwrap()
    }

    fn node(name: &str, offset_us: f64, shift_us: f64, events: Vec<Value>) -> NodeTrace {
        NodeTrace {
            node: name.into(),
            agent: if offset_us == 0.0 {
                "self".into()
            } else {
                "10.0.0.2:9477".into()
            },
            clock: ClockEstimate {
                offset_us,
                uncertainty_us: 40.0,
            },
            shift_us,
            trace: trace(events),
        }
    }

    #[test]
    fn timelines_merge_in_time_order_on_our_clock_with_node_keyed_pids() {
        // Our own part is on the monotonic clock (shifted by +1000 to Unix);
        // node b's clock runs 1 s ahead of ours: its 1_000_150 is our 150.
        let a = node(
            "a",
            0.0,
            1_000.0,
            vec![
                json!({"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "r0"}}),
                json!({"ph": "X", "cat": "thread_state", "pid": 7, "tid": 7, "ts": -900.0, "dur": 5.0, "args": {"x": [1, 2]}}),
                json!({"ph": "X", "pid": 7, "tid": 7, "ts": -800.0, "dur": 5.0}),
                json!({"ph": "M", "name": "process_name", "pid": "j rank 2", "args": {"name": "j rank 2"}}),
            ],
        );
        let b = node(
            "b",
            1_000_000.0,
            -1_000_000.0,
            vec![
                json!({"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "r2"}}),
                json!({"ph": "X", "pid": 7, "tid": 9, "ts": 1_000_150.0, "dur": 5.0}),
            ],
        );
        let bytes = merge_timelines(
            &[a, b],
            vec![json!({"node": "c", "error": "timeout"})],
            10,
            1 << 20,
            serde_json::Map::new(),
        );
        let merged: Value = serde_json::from_slice(&bytes).unwrap();
        let events = merged["traceEvents"].as_array().unwrap();
        let timed: Vec<(f64, &str)> = events
            .iter()
            .filter(|e| e["ph"] != "M")
            .map(|e| (e["ts"].as_f64().unwrap(), e["pid"].as_str().unwrap()))
            .collect();
        assert_eq!(timed, vec![(100.0, "a/7"), (150.0, "b/7"), (200.0, "a/7")]);
        // Other fields pass through untouched.
        assert_eq!(
            events.iter().find(|e| e["cat"] == "thread_state").unwrap()["args"]["x"],
            json!([1, 2])
        );
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        // The placeholder of a remote rank is dropped: its node has it.
        assert_eq!(names, vec!["r0 @ a", "r2 @ b"]);
        assert_eq!(merged["metadata"]["partial"], true);
        assert_eq!(merged["metadata"]["nodes"][1]["clock_uncertainty_us"], 40.0);
        assert_eq!(merged["metadata"]["nodes"][0]["events"], 2);
        // The cap keeps the earliest events and says so.
        let capped = merge_timelines(
            &[node(
                "a",
                0.0,
                0.0,
                vec![
                    json!({"ph": "X", "pid": 1, "ts": 3.0}),
                    json!({"ph": "X", "pid": 1, "ts": 1.0}),
                ],
            )],
            vec![],
            1,
            1 << 20,
            serde_json::Map::new(),
        );
        let capped: Value = serde_json::from_slice(&capped).unwrap();
        assert_eq!(capped["traceEvents"][0]["ts"], 1.0);
        assert_eq!(capped["metadata"]["truncated"]["events_left_out"], 1);
        // A part that is not a trace is named, not fatal.
        let mut broken = node("z", 0.0, 0.0, vec![]);
        broken.trace = b"<html>".to_vec();
        let merged: Value = serde_json::from_slice(&merge_timelines(
            &[broken],
            vec![],
            5,
            1 << 20,
            serde_json::Map::new(),
        ))
        .unwrap();
        assert_eq!(merged["metadata"]["partial"], true);
        assert_eq!(merged["metadata"]["missing"][0]["node"], "z");
    }

    #[test]
    fn a_peers_names_metadata_and_figures_stay_in_the_budget() {
        // A peer names itself with 4 MiB and sends 1,000 process names, and
        // events at ±1e308 or with pids that are objects.
        let long = "n".repeat(4 << 20);
        let mut events: Vec<Value> = (0..1_000)
            .map(|p| json!({"ph": "M", "name": "process_name", "pid": p, "args": {"name": "r"}}))
            .collect();
        events.push(json!({"ph": "X", "pid": 1, "tid": 1, "ts": 1e308, "dur": 1.0}));
        events.push(json!({"ph": "X", "pid": 1, "tid": 1, "ts": -1e308, "dur": 1.0}));
        events.push(json!({"ph": "X", "pid": {"a": 1}, "tid": 1, "ts": 5.0, "dur": 1.0}));
        events.push(json!({"ph": "X", "pid": 1, "tid": 1, "ts": 6.0, "dur": 1.0}));
        let peer = NodeTrace {
            node: long.clone(),
            ..node("b", 1.0, 0.0, events)
        };
        let max_bytes = 64 << 10;
        let bytes = merge_timelines(&[peer], vec![], 100, max_bytes, serde_json::Map::new());
        // About the budget: the last event written may pass it, by one
        // event's size (its name cut to MAX_NAME_BYTES), plus the metadata.
        assert!(bytes.len() < max_bytes + 4 * 1024, "{} bytes", bytes.len());
        let merged: Value = serde_json::from_slice(&bytes).unwrap();
        let metadata = &merged["metadata"];
        assert_eq!(metadata["events_rejected"]["count"], 3, "{metadata:#}");
        // The names fill the byte budget (they count against bytes, not
        // against the event count); everything else is left out, and counted.
        let written = merged["traceEvents"].as_array().unwrap().len();
        assert!(written < 1_000, "{written} events");
        assert_eq!(
            metadata["truncated"]["events_left_out"].as_u64().unwrap() as usize,
            1_001 - written,
            "{metadata:#}"
        );
        let name = merged["traceEvents"][0]["args"]["name"].as_str().unwrap();
        assert!(name.len() <= MAX_NAME_BYTES + 10, "{} bytes", name.len());
    }

    #[tokio::test]
    async fn a_hanging_peer_costs_one_deadline_and_is_remembered() {
        use std::sync::Mutex as StdMutex;
        // A peer that accepts and never answers; it lists who called, in
        // the order the kernel queued the calls.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let callers = std::sync::Arc::new(StdMutex::new(Vec::new()));
        let listed = callers.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming().flatten() {
                listed.lock().unwrap().push(conn.peer_addr().unwrap());
                held.push(conn);
            }
        });
        // The calls made so far: those the peer took before a last one of
        // the test's own (the queue is first in, first out).
        let calls_so_far = || {
            let sentinel = std::net::TcpStream::connect(&addr).unwrap();
            let me = sentinel.local_addr().unwrap();
            loop {
                let callers = callers.lock().unwrap();
                if let Some(at) = callers.iter().position(|c| *c == me) {
                    return at;
                }
                drop(callers);
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let cluster = Cluster::new(ClusterConfig {
            node_name: "n0".into(),
            peers: vec![addr.clone()],
            peers_dns: None,
            timeout: Duration::from_millis(300),
            max_timeline_bytes: 1 << 20,
        });
        let first = cluster.clock(&addr).await.unwrap_err();
        // One probe, not CLOCK_PROBES: the first failure ends the estimate.
        assert_eq!(calls_so_far(), 1, "{first}");
        // Remembered: the next clock and jobs questions fail at once, naming
        // the failure, without calling the peer.
        let again = cluster.clock(&addr).await.unwrap_err();
        assert!(again.contains("ago"), "{again}");
        let answers = cluster.ask_all("/api/jobs", 4096).await;
        assert!(answers[0].result.as_ref().unwrap_err().contains("ago"));
        // The first call and the first sentinel.
        assert_eq!(calls_so_far(), 2);
    }

    #[test]
    fn a_job_listing_fifty_thousand_hosts_is_read_once_and_capped() {
        let ranks: Vec<Value> = (0..50_000)
            .map(|r| json!({"rank": r, "host": format!("h{r}"), "pid": r}))
            .collect();
        let hosts = job_hosts(&json!({ "ranks": ranks }));
        assert_eq!(hosts.len(), MAX_JOB_HOSTS);
        assert_eq!(hosts[1], "h1");
        let long = "h".repeat(1 << 20);
        let one = job_hosts(&json!({ "ranks": [{"host": long}, {"host": "x"}] }));
        assert_eq!(one[0].len(), MAX_NAME_BYTES);
        assert_eq!(one[1], "x");
    }

    #[test]
    fn jobs_merge_per_node_and_name_hosts_no_agent_speaks_for() {
        let ranks = json!([
            {"rank": 0, "host": "h0", "pid": 10, "local_rank": 0, "local_size": 1},
            {"rank": 1, "host": "h1", "pid": 11, "local_rank": 0, "local_size": 1},
            {"rank": 2, "host": "h2", "pid": 12, "local_rank": 0, "local_size": 1},
        ]);
        let local = vec![
            json!({"job_id": "j", "world_size": 3, "host": "h0", "served_by_rank": 0, "ranks": ranks}),
        ];
        let answers = vec![
            PeerAnswer {
                addr: "10.0.0.2:9477".into(),
                node: Some("node-1".into()),
                result: Ok(json!({"node": "node-1", "jobs": [
                    {"job_id": "j", "world_size": 3, "host": "h1", "served_by_rank": 1, "ranks": ranks}
                ]})),
            },
            PeerAnswer {
                addr: "10.0.0.3:9477".into(),
                node: None,
                result: Err("no answer within 2s".into()),
            },
        ];
        let merged = merge_jobs("node-0", &local, &answers);
        let job = &merged["jobs"][0];
        assert_eq!(job["hosts"], json!(["h0", "h1", "h2"]));
        assert_eq!(job["missing_hosts"], json!(["h2"]));
        assert_eq!(job["complete"], false);
        assert_eq!(job["nodes"][1]["node"], "node-1");
        assert_eq!(job["nodes"][1]["ranks"][0]["rank"], 1);
        assert_eq!(merged["missing_peers"][0]["agent"], "10.0.0.3:9477");
    }

    #[test]
    fn wall_clock_shift_moves_every_timestamp_and_now() {
        let bytes = br#"{"traceEvents":[{"ph":"X","ts":10.5,"args":{"a":"b"}},{"ph":"M","name":"x"}],"metadata":{"now":20.0}}"#;
        let shifted: Value =
            serde_json::from_slice(&to_wall_clock(bytes, 1_000.0).unwrap()).unwrap();
        assert_eq!(shifted["traceEvents"][0]["ts"], 1_010.5);
        assert_eq!(shifted["traceEvents"][0]["args"]["a"], "b");
        assert!(shifted["traceEvents"][1].get("ts").is_none());
        assert_eq!(shifted["metadata"]["now"], 1_020.0);
        assert_eq!(shifted["metadata"]["clock"], "unix_us");
        assert!(to_wall_clock(b"not json", 1.0).is_err());
    }

    #[tokio::test]
    async fn peers_come_from_the_list_and_the_dns_name_and_this_agent_is_skipped() {
        let cluster = Cluster::new(ClusterConfig {
            node_name: "n0".into(),
            peers: vec!["10.0.0.9:9477".into()],
            peers_dns: Some("localhost:9477".into()),
            timeout: Duration::from_secs(2),
            max_timeline_bytes: 1 << 20,
        });
        let peers = cluster.peers().await;
        assert!(peers.contains(&"10.0.0.9:9477".to_owned()), "{peers:?}");
        assert!(
            peers
                .iter()
                .any(|p| p == "127.0.0.1:9477" || p == "[::1]:9477"),
            "localhost resolves: {peers:?}"
        );
        // An address found to be this agent (its agent_id answered) is skipped.
        cluster.lock().own_addrs.insert("10.0.0.9:9477".into());
        assert!(!cluster.peers().await.contains(&"10.0.0.9:9477".to_owned()));
        // A name that does not resolve keeps the last answer and says why.
        let broken = Cluster::new(ClusterConfig {
            node_name: "n0".into(),
            peers: Vec::new(),
            peers_dns: Some("no-such-agents.invalid:9477".into()),
            timeout: Duration::from_secs(2),
            max_timeline_bytes: 1 << 20,
        });
        assert!(broken.peers().await.is_empty());
        assert!(broken.dns_error().is_some());
    }

    #[tokio::test]
    async fn a_dead_peer_is_an_error_within_the_deadline_not_a_hang() {
        // A listener that accepts and never answers.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let started = Instant::now();
        let result = get_json(&addr, "/api/jobs", Duration::from_millis(300), 1024).await;
        assert!(result.is_err());
        // Not a hang (the deadline is 300 ms; a loaded machine may add seconds).
        assert!(started.elapsed() < Duration::from_secs(60));
        drop(listener);
        // Nobody listening at all.
        let result = get_json(&addr, "/api/jobs", Duration::from_millis(300), 1024).await;
        assert!(result.is_err(), "{result:?}");
    }
}
