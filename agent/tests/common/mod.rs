//! Helpers for the agent's integration tests: start a workload, start the
//! agent on it, and collect the agent's JSON, with watchdogs so a bug fails
//! the test instead of hanging it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod nodes;
pub mod procs;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The agent binary built for these tests.
pub const AGENT: &str = env!("CARGO_BIN_EXE_ringwatch-agent");
/// The workload binary built for these tests.
pub const TESTLOAD: &str = env!("CARGO_BIN_EXE_ringwatch-testload");

/// True (after printing why) when this test cannot load BPF here.
pub fn skip_unless_privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: this test loads eBPF programs and needs root (CI runs as root)");
        return true;
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!("SKIPPED: the kernel has no BTF (/sys/kernel/btf/vmlinux)");
        return true;
    }
    false
}

/// A running `ringwatch-testload --wait …` (or any program that follows its
/// protocol: one JSON line, then wait for a line on stdin).
pub struct Testload {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    /// The JSON line the workload printed about itself.
    pub info: serde_json::Value,
}

impl Testload {
    /// Starts the workload and reads its description line.
    pub fn start(args: &[&str]) -> Self {
        let mut command = Command::new(TESTLOAD);
        command.arg("--wait").args(args);
        Self::start_command(command)
    }

    /// Starts `command` (which must follow the `--wait` protocol).
    pub fn start_command(mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the workload printed no description within 60 s");
        let info = serde_json::from_str(&line).unwrap();
        Self {
            child,
            stdin,
            lines,
            info,
        }
    }

    /// The workload's pid.
    pub fn pid(&self) -> u32 {
        self.info["pid"].as_u64().unwrap() as u32
    }

    /// Lets the workload start working (or, for one that waits again after
    /// its figures, finish).
    pub fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("the workload's stdin is open");
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    /// The next JSON line the workload prints (within 60 s).
    pub fn next_output(&mut self) -> serde_json::Value {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the workload printed nothing more within 60 s");
        serde_json::from_str(&line).unwrap()
    }

    /// Waits for the workload to finish (it is killed after 120 s: a hang guard).
    pub fn wait(self) {
        let _ = self.wait_output();
    }

    /// Waits for the workload to finish and returns the JSON lines it
    /// printed after its description.
    pub fn wait_output(mut self) -> Vec<serde_json::Value> {
        // A workload that waits for more lines after `go` reads end of file.
        drop(self.stdin.take());
        let status = wait_within(&mut self.child, Duration::from_secs(120));
        assert!(status.success(), "workload failed: {status}");
        // The reader ends at the child's end of file: every line is in.
        let mut out = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(60)) {
            out.push(serde_json::from_str(&line).unwrap());
        }
        out
    }
}

impl Drop for Testload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `ringwatch-agent …` whose stdout is the result.
pub struct Agent {
    child: Child,
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// Agents of one test process run one at a time. While another agent attaches or
/// detaches its programs on the same tracepoints, an agent's programs were seen to miss
/// an event now and then (a wakeup or a switch in, on 6.18, with several agents starting
/// and stopping at once), which breaks the tests that count exactly. A node runs one
/// agent (its lock file says so): the tests should see what a node sees.
pub fn one_agent_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Agent {
    /// Starts the agent and waits until it says it is watching. Each test
    /// agent gets its own lock file (tests run in parallel) unless the test
    /// sets `RINGWATCH_LOCK_FILE` through [`Agent::start_with_lock`].
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_lock(args, &unique_lock_file())
    }

    /// Starts the agent with the given lock file.
    pub fn start_with_lock(args: &[&str], lock_file: &str) -> Self {
        let turn = one_agent_at_a_time();
        let mut child = Command::new(AGENT)
            .args(args)
            .env("RINGWATCH_LOCK_FILE", lock_file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[agent] {line}");
                if !ready && watching_line(&line) {
                    ready = true;
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = child.kill();
            panic!("the agent did not start watching within 60 s (see its log above)");
        }
        Self { child, _turn: turn }
    }

    /// Stops the agent now (SIGINT: it prints what it counted so far) and
    /// parses its JSON output.
    pub fn interrupt(self, limit: Duration) -> serde_json::Value {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.finish(limit)
    }

    /// Waits for the agent to exit and parses its JSON output.
    pub fn finish(self, limit: Duration) -> serde_json::Value {
        let text = self.finish_text(limit);
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("agent printed bad JSON ({e}): {text}"))
    }

    /// Waits for the agent to exit (successfully) and returns its output.
    pub fn finish_text(mut self, limit: Duration) -> String {
        let mut stdout = self.child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
            text
        });
        let status = wait_within(&mut self.child, limit);
        let text = reader.join().unwrap();
        assert!(status.success(), "agent failed ({status}); stdout: {text}");
        text
    }
}

/// A lock-file path no other test agent uses.
/// The agent's line that says its probes are loaded and what they watch.
fn watching_line(line: &str) -> bool {
    line.contains("watching pid") || line.contains("watching no process yet")
}

pub fn unique_lock_file() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir()
        .join(format!(
            "ringwatch-test-{}-{}.lock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
        .display()
        .to_string()
}

/// Waits for `child` to exit; kills it and fails the test after `limit`.
pub fn wait_within(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("process {} did not exit within {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `ringwatch-agent serve --listen 127.0.0.1:0 …`, spoken to with
/// raw HTTP/1.1 (so tests can also send malformed requests). Killed on drop.
pub struct ApiServer {
    /// The agent process.
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl ApiServer {
    /// Starts `serve` with `extra` arguments and its own lock file; waits
    /// until it serves, and with `watching` also until its live pipeline
    /// watches something.
    pub fn start(extra: &[&str], watching: bool) -> Self {
        Self::start_listening("127.0.0.1:0", extra, watching)
    }

    /// Like [`ApiServer::start`], listening on `listen` (port 0: any).
    pub fn start_listening(listen: &str, extra: &[&str], watching: bool) -> Self {
        Self::start_configured(listen, extra, watching, |_| {})
    }

    /// Like [`ApiServer::start_listening`], with the command adjusted by
    /// `configure` first (e.g. another uid).
    pub fn start_configured(
        listen: &str,
        extra: &[&str],
        watching: bool,
        configure: impl FnOnce(&mut Command),
    ) -> Self {
        let mut command = Command::new(AGENT);
        configure(&mut command);
        let mut child = command
            .args(["serve", "--listen", listen])
            .args(extra)
            .env("RINGWATCH_LOCK_FILE", unique_lock_file())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[agent] {line}");
                if let Some(rest) = line.split("http://").nth(1) {
                    let _ = tx.send(Some(rest.split('/').next().unwrap().to_owned()));
                }
                if watching_line(&line) {
                    let _ = tx.send(None);
                }
            }
        });
        let mut addr = None;
        let mut watched = !watching;
        while addr.is_none() || !watched {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(Some(a)) => addr = Some(a),
                Ok(None) => watched = true,
                Err(_) => {
                    let _ = child.kill();
                    panic!("the agent did not start serving within 60 s (see its log above)");
                }
            }
        }
        Self {
            child,
            addr: addr.unwrap(),
        }
    }

    /// Sends raw bytes, returns (status, headers, body).
    pub fn raw(&self, request: &[u8]) -> (u16, String, String) {
        use std::io::Read;
        let mut stream = std::net::TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP status in {response:?}"));
        (status, head.to_owned(), body.to_owned())
    }

    /// One request with extra header lines (`Name: value`) and a body.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[&str],
        body: &str,
    ) -> (u16, String, String) {
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if !body.is_empty() {
            request.push_str("Content-Type: application/json\r\n");
        }
        for header in headers {
            request.push_str(header);
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        request.push_str(body);
        self.raw(request.as_bytes())
    }

    /// One request without a body.
    pub fn request(&self, method: &str, path: &str) -> (u16, String, String) {
        self.raw(
            format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.addr
            )
            .as_bytes(),
        )
    }

    /// A GET whose answer must be JSON.
    pub fn get_json(&self, path: &str) -> (u16, serde_json::Value) {
        let (status, head, body) = self.request("GET", path);
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{head}"
        );
        (
            status,
            serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{path}: bad JSON ({e}): {body}")),
        )
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs Prometheus' own checker (`promtool check metrics`, Debian's
/// `prometheus` package) on a `/metrics` page in the classic text format and
/// fails the test on any problem it names. Without promtool it says SKIPPED,
/// unless `RINGWATCH_REQUIRE_PROMTOOL=1` (`cargo xtask test` sets it, having
/// installed it), which makes its absence a failure.
#[allow(dead_code)] // not every test binary checks metrics
pub fn promtool_check_metrics(page: &str) {
    let mut child = match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            assert!(
                std::env::var("RINGWATCH_REQUIRE_PROMTOOL").as_deref() != Ok("1"),
                "promtool is required here but cannot run ({e}): apt-get install prometheus"
            );
            eprintln!("SKIPPED promtool check metrics: promtool cannot run ({e})");
            return;
        }
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(page.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n--- the page:\n{page}"
    );
}

/// Holds a Chrome trace (`/api/timeline`'s answer) to the Trace Event Format
/// (the JSON Object Format of Google's "Trace Event Format" document): a
/// `traceEvents` array; every event has a string `ph` and the fields its
/// phase requires (`X`: `ts`, `dur` ≥ 0; `B`/`E`: `ts`, balanced per thread;
/// `i`/`I`: `ts` and a scope `g`/`p`/`t` if any; `C`: `ts` and numeric
/// `args`; `M`: a known metadata name with its argument), `pid` and `tid`
/// (integers, or strings, which the trace viewers accept as labels); and
/// every process and thread with events is named by `process_name` /
/// `thread_name` metadata. Panics naming the first offending event.
#[allow(dead_code)] // not every test binary checks traces
pub fn assert_trace_event_format(trace: &serde_json::Value) {
    use std::collections::{BTreeMap, BTreeSet};
    let events = trace["traceEvents"]
        .as_array()
        .unwrap_or_else(|| panic!("no traceEvents array: {trace}"));
    if let Some(unit) = trace.get("displayTimeUnit") {
        assert!(unit == "ms" || unit == "ns", "displayTimeUnit {unit}");
    }
    let id = |v: &serde_json::Value| -> Option<String> {
        match v {
            serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => Some(n.to_string()),
            serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
            _ => None,
        }
    };
    let num = |e: &serde_json::Value, f: &str| {
        e[f].as_f64()
            .filter(|x| x.is_finite())
            .unwrap_or_else(|| panic!("`{f}` is not a finite number in {e}"))
    };
    let mut named_pids = BTreeSet::new();
    let mut named_threads = BTreeSet::new();
    let mut used_pids = BTreeSet::new();
    let mut used_threads = BTreeSet::new();
    let mut open: BTreeMap<(String, String), usize> = BTreeMap::new();
    for e in events {
        let ph = e["ph"].as_str().unwrap_or_else(|| panic!("no ph: {e}"));
        let pid = id(&e["pid"]).unwrap_or_else(|| panic!("no pid: {e}"));
        match ph {
            "M" => {
                let name = e["name"].as_str().unwrap_or_else(|| panic!("no name: {e}"));
                match name {
                    "process_name" | "process_labels" => {
                        assert!(
                            e["args"][if name == "process_name" {
                                "name"
                            } else {
                                "labels"
                            }]
                            .is_string(),
                            "{e}"
                        );
                        if name == "process_name" {
                            named_pids.insert(pid);
                        }
                    }
                    "process_sort_index" | "thread_sort_index" => {
                        assert!(e["args"]["sort_index"].is_number(), "{e}");
                    }
                    "thread_name" => {
                        assert!(e["args"]["name"].is_string(), "{e}");
                        let tid = id(&e["tid"]).unwrap_or_else(|| panic!("no tid: {e}"));
                        named_threads.insert((pid, tid));
                    }
                    other => panic!("unknown metadata event {other}: {e}"),
                }
            }
            "X" | "B" | "E" | "i" | "I" => {
                let tid = id(&e["tid"]).unwrap_or_else(|| panic!("no tid: {e}"));
                num(e, "ts");
                if ph != "E" {
                    assert!(e["name"].is_string(), "no name: {e}");
                }
                match ph {
                    "X" => assert!(num(e, "dur") >= 0.0, "negative dur: {e}"),
                    "B" => *open.entry((pid.clone(), tid.clone())).or_default() += 1,
                    "E" => {
                        let depth = open.entry((pid.clone(), tid.clone())).or_default();
                        assert!(*depth > 0, "E without B: {e}");
                        *depth -= 1;
                    }
                    _ => {
                        if let Some(s) = e.get("s") {
                            assert!(s == "g" || s == "p" || s == "t", "instant scope: {e}");
                        }
                    }
                }
                used_pids.insert(pid.clone());
                used_threads.insert((pid, tid));
            }
            "C" => {
                num(e, "ts");
                assert!(e["name"].is_string(), "no name: {e}");
                let args = e["args"]
                    .as_object()
                    .unwrap_or_else(|| panic!("no args: {e}"));
                assert!(
                    !args.is_empty() && args.values().all(serde_json::Value::is_number),
                    "counter args must be numbers: {e}"
                );
                used_pids.insert(pid);
            }
            other => panic!("phase {other} is not one ringwatch writes: {e}"),
        }
    }
    for pid in &used_pids {
        assert!(
            named_pids.contains(pid),
            "process {pid} has events but no process_name"
        );
    }
    for thread in &used_threads {
        assert!(
            named_threads.contains(thread),
            "thread {thread:?} has events but no thread_name"
        );
    }
}
