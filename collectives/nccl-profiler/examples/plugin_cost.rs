//! What the plugin costs NCCL per collective: the built library driven as
//! NCCL drives it (one collective = its event, two kernel channels with
//! their GPU stop state, all stopped: 8 calls), timed per collective, with
//! the agent reading, absent, stopped (not reading), and with the plugin
//! off. Each case runs in its own process (the plugin is process-wide);
//! the cases alternate, `--rounds` times, and the table gives the medians.
//!
//! `cargo xtask bench nccl-profiler` builds it in release and runs it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ringwatch_nccl_profiler::harness::{Coll, Plugin};

const CASES: [&str; 4] = ["reading", "absent", "stopped", "off"];

fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let lib = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/examples/")
        .join("libringwatch_nccl_profiler.so");
    assert!(lib.is_file(), "no {}", lib.display());
    lib
}

/// A stand-in agent: answers the hello, then reads (or, `read` false,
/// never reads again).
fn agent(path: &Path, read: bool) {
    let listener = UnixListener::bind(path).expect("bind");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                let _ = (&stream).write_all(b"{\"ok\":true,\"proto\":1}\n");
                if read {
                    for line in reader.lines() {
                        if line.is_err() {
                            break;
                        }
                    }
                } else {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            });
        }
    });
}

fn child(case: &str, n: u64) {
    let dir = std::env::temp_dir().join(format!("rw-plugin-cost-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let socket = dir.join("agent.socket");
    let _ = std::fs::remove_file(&socket);
    // SAFETY: before any other thread starts.
    unsafe { std::env::set_var("RINGWATCH_NCCL_PROFILER_SOCKET", &socket) };
    match case {
        "reading" => agent(&socket, true),
        "stopped" => agent(&socket, false),
        // SAFETY: as above.
        "off" => unsafe { std::env::set_var("RINGWATCH_NCCL_PROFILER", "off") },
        _ => {}
    }
    let plugin = Plugin::open(&library()).expect("dlopen");
    let (_, comm) = plugin.init(6, 0xc0, 2, 0);
    if case == "reading" || case == "stopped" {
        let t = Instant::now();
        while plugin.counters().connects == 0 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    let script: Vec<Coll> = (0..1024).map(|s| Coll::allreduce(s, 1 << 20, 2)).collect();
    // Warm up, then time each collective.
    for c in &script {
        comm.collective(c);
    }
    let mut ns: Vec<u64> = Vec::with_capacity(n as usize);
    for i in 0..n {
        let c = &script[(i % 1024) as usize];
        let t = Instant::now();
        comm.collective(c);
        ns.push(t.elapsed().as_nanos() as u64);
    }
    ns.sort_unstable();
    let q = |p: f64| ns[((ns.len() - 1) as f64 * p) as usize];
    let c = plugin.counters();
    println!(
        "{{\"case\":\"{case}\",\"median_ns\":{},\"p99_ns\":{},\"max_ns\":{},\"collectives\":{},\"sent\":{},\"dropped\":{}}}",
        q(0.5),
        q(0.99),
        ns[ns.len() - 1],
        c.collectives,
        c.sent,
        c.dropped_queue_full + c.dropped_no_agent
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str, default: u64| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n = get("--collectives", 200_000);
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1], n);
        return;
    }
    let rounds = get("--rounds", 3);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut results: Vec<(String, Vec<serde_json::Value>)> = CASES
        .iter()
        .map(|c| ((*c).to_owned(), Vec::new()))
        .collect();
    for round in 0..rounds {
        for (case, out) in &mut results {
            eprintln!("round {}/{rounds}: {case}", round + 1);
            let output = Command::new(std::env::current_exe().expect("own path"))
                .args(["--child", case, "--collectives", &n.to_string()])
                .output()
                .expect("run a case");
            let line = String::from_utf8_lossy(&output.stdout);
            match serde_json::from_str(line.trim()) {
                Ok(v) => out.push(v),
                Err(_) => {
                    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
                    panic!("the {case} case failed ({})", output.status);
                }
            }
        }
    }
    let median = |v: &[serde_json::Value], key: &str| {
        let mut xs: Vec<u64> = v.iter().filter_map(|r| r[key].as_u64()).collect();
        xs.sort_unstable();
        xs[xs.len() / 2]
    };
    println!("load average before: {}", load.trim());
    println!("| agent | median ns / collective | p99 ns | worst ns | sent | dropped |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut json = Vec::new();
    for (case, out) in &results {
        let last = out.last().expect("a round");
        println!(
            "| {case} | {} | {} | {} | {} | {} |",
            median(out, "median_ns"),
            median(out, "p99_ns"),
            median(out, "max_ns"),
            last["sent"],
            last["dropped"]
        );
        json.push(serde_json::json!({"case": case, "runs": out}));
    }
    println!(
        "load average after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let path = Path::new("target/bench/nccl-profiler.json");
    let _ = std::fs::create_dir_all("target/bench");
    let _ = std::fs::write(
        path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    );
}
