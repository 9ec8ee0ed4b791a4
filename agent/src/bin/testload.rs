//! `ringwatch-testload`: workloads whose behaviour is known exactly, for the
//! agent's privileged integration tests and the demo.
//!
//! Each workload prints one JSON line describing itself (pid, the tid that
//! does the work) on stdout, then, with `--wait`, waits for a line on stdin
//! before starting, so a test can attach the agent first.

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// Workloads with known ground truth for testing ringwatch-agent.
#[derive(Debug, Parser)]
#[command(name = "ringwatch-testload", version)]
struct Cli {
    /// Print the JSON line, then wait for a line on stdin before working.
    #[arg(long, global = true)]
    wait: bool,

    #[command(subcommand)]
    workload: Workload,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// One thread named `rw-sleeper` sleeps COUNT times for INTERVAL each:
    /// at least COUNT switches out (blocked) and COUNT in.
    Sleep {
        /// How many sleeps.
        #[arg(long, default_value_t = 10)]
        count: u32,
        /// How long each sleep lasts, e.g. `100ms`.
        #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
    /// Listens on TCP (prints the port), accepts one connection, reads it to
    /// the end, then prints `{"received": N}`.
    TcpRecv {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        bind: String,
    },
    /// Connects to `--to` and sends exactly BYTES bytes in WRITES write
    /// calls (the last one takes the remainder), half-closes and waits for
    /// the peer to close; prints `{"sent": N}`.
    TcpSend {
        /// Where to connect, `addr:port`.
        #[arg(long)]
        to: String,
        /// Bytes to send in total.
        #[arg(long)]
        bytes: u64,
        /// Number of write calls.
        #[arg(long, default_value_t = 1)]
        writes: u64,
        /// Pause between writes, e.g. `10ms`.
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        pause: Duration,
    },
    /// THREADS threads named `rw-busy-N` spin for DURATION (more threads
    /// than cores: they wait on the run queue).
    Busy {
        /// Spinning threads.
        #[arg(long, default_value_t = 4)]
        threads: u32,
        /// How long they spin.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
    /// COUNT threads named `rw-short-N`, one after the other, each sleeping
    /// SLEEPS times for 200 µs, then spinning for LIFE and exiting: threads
    /// gone before anyone reads their names from /proc. Prints `{"tids":
    /// [...], "switches": [...]}` at the end: each thread's context switches
    /// as the kernel counted them just before it ended (voluntary and not).
    ShortThreads {
        /// How many threads.
        #[arg(long, default_value_t = 20)]
        count: u32,
        /// How long each lives, e.g. `2ms`.
        #[arg(long, default_value = "2ms", value_parser = humantime::parse_duration)]
        life: Duration,
        /// Sleeps of 200 µs each thread takes first.
        #[arg(long, default_value_t = 0)]
        sleeps: u32,
    },
    /// Two threads ping-pong one byte over loopback TCP ROUNDS times: a
    /// context switch and a send/receive per round (the benchmark's load).
    /// Prints, per thread, what it waited on run queues during its rounds
    /// by the kernel's schedstat (`threads`: tid, run_delay_ns).
    PingPong {
        /// Round trips.
        #[arg(long, default_value_t = 10_000)]
        rounds: u64,
    },
    /// Two threads named `rw-yield-N`, pinned to one CPU, hand it to each
    /// other with sched_yield until SWITCHES switches: nothing but context
    /// switches, as between the ranks of a job that share a core. Prints
    /// the switches the kernel counted (nonvoluntary_ctxt_switches) and
    /// the time per switch.
    Yield {
        /// Switches in all (yields of both threads).
        #[arg(long, default_value_t = 200_000)]
        switches: u64,
        /// The CPU both threads run on (default: the last one).
        #[arg(long)]
        cpu: Option<usize>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.workload {
        Workload::Sleep { count, interval } => {
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let sleeper = std::thread::Builder::new()
                .name("rw-sleeper".into())
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    let _ = tid_tx.send(tid);
                    if go_rx.recv().is_ok() {
                        for _ in 0..count {
                            std::thread::sleep(interval);
                        }
                    }
                })
                .context("spawning the sleeper thread")?;
            let tid = tid_rx
                .recv()
                .context("the sleeper thread died before reporting its tid")?;
            announce(&serde_json::json!({
                "workload": "sleep", "pid": std::process::id(), "tid": tid,
                "count": count, "interval_ms": interval.as_millis() as u64,
            }))?;
            wait_for_go(cli.wait)?;
            go_tx.send(()).context("the sleeper thread exited early")?;
            sleeper
                .join()
                .map_err(|_| anyhow::anyhow!("the sleeper thread panicked"))?;
        }
        Workload::TcpRecv { bind } => tcp_recv(&bind, cli.wait)?,
        Workload::TcpSend {
            to,
            bytes,
            writes,
            pause,
        } => tcp_send(&to, bytes, writes, pause, cli.wait)?,
        Workload::Busy { threads, duration } => busy(threads, duration, cli.wait)?,
        Workload::PingPong { rounds } => ping_pong(rounds, cli.wait)?,
        Workload::Yield { switches, cpu } => yield_switches(switches, cpu, cli.wait)?,
        Workload::ShortThreads {
            count,
            life,
            sleeps,
        } => short_threads(count, life, sleeps, cli.wait)?,
    }
    Ok(())
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

fn tcp_recv(bind: &str, wait: bool) -> Result<()> {
    use std::io::Read;
    let listener =
        std::net::TcpListener::bind(bind).with_context(|| format!("listening on {bind}"))?;
    let port = listener
        .local_addr()
        .context("reading the local address")?
        .port();
    announce(&serde_json::json!({
        "workload": "tcp-recv", "pid": std::process::id(), "tid": gettid(), "port": port,
    }))?;
    wait_for_go(wait)?;
    let (mut stream, _) = listener.accept().context("accepting the connection")?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut received = 0u64;
    loop {
        let n = stream.read(&mut buf).context("reading")?;
        if n == 0 {
            break;
        }
        received += n as u64;
    }
    announce(&serde_json::json!({ "received": received }))
}

fn tcp_send(to: &str, bytes: u64, writes: u64, pause: Duration, wait: bool) -> Result<()> {
    announce(&serde_json::json!({
        "workload": "tcp-send", "pid": std::process::id(), "tid": gettid(),
        "bytes": bytes, "writes": writes,
    }))?;
    wait_for_go(wait)?;
    let mut stream =
        std::net::TcpStream::connect(to).with_context(|| format!("connecting to {to}"))?;
    announce(&serde_json::json!({ "connected": to }))?;
    let writes = writes.max(1);
    let chunk = bytes / writes;
    let data = vec![0x5au8; usize::try_from(bytes - chunk * (writes - 1)).context("too big")?];
    let mut sent = 0u64;
    for i in 0..writes {
        let len = if i + 1 == writes { bytes - sent } else { chunk };
        let len = usize::try_from(len).context("too big")?;
        stream.write_all(&data[..len]).context("writing")?;
        sent += len as u64;
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    // Half-close, then wait for the peer's close: returns only once every
    // byte was delivered (retransmissions included).
    stream
        .shutdown(std::net::Shutdown::Write)
        .context("closing the sending side")?;
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut stream, &mut rest).context("waiting for the peer to close")?;
    drop(stream);
    announce(&serde_json::json!({ "sent": sent }))
}

fn busy(threads: u32, duration: Duration, wait: bool) -> Result<()> {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads as usize + 1));
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for i in 0..threads {
        let barrier = barrier.clone();
        let tid_tx = tid_tx.clone();
        handles.push(
            std::thread::Builder::new()
                .name(format!("rw-busy-{i}"))
                .spawn(move || {
                    let _ = tid_tx.send(gettid());
                    barrier.wait();
                    let end = std::time::Instant::now() + duration;
                    let mut x = 0u64;
                    while std::time::Instant::now() < end {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                })
                .context("spawning a busy thread")?,
        );
    }
    drop(tid_tx);
    // Each thread keeps its sender until it ends: take exactly one tid each.
    let tids: Vec<i32> = tid_rx.iter().take(threads as usize).collect();
    announce(&serde_json::json!({
        "workload": "busy", "pid": std::process::id(), "tids": tids,
    }))?;
    wait_for_go(wait)?;
    barrier.wait();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a busy thread panicked"))?;
    }
    Ok(())
}

fn short_threads(count: u32, life: Duration, sleeps: u32, wait: bool) -> Result<()> {
    announce(&serde_json::json!({
        "workload": "short-threads", "pid": std::process::id(), "count": count,
    }))?;
    wait_for_go(wait)?;
    let mut tids = Vec::new();
    let mut switches = Vec::new();
    for i in 0..count {
        let handle = std::thread::Builder::new()
            .name(format!("rw-short-{i}"))
            .spawn(move || -> Result<(i32, u64)> {
                let tid = gettid();
                for _ in 0..sleeps {
                    std::thread::sleep(Duration::from_micros(200));
                }
                let end = std::time::Instant::now() + life;
                let mut x = 0u64;
                while std::time::Instant::now() < end {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                Ok((tid, context_switches()?))
            })
            .context("spawning a short-lived thread")?;
        let (tid, switched) = handle
            .join()
            .map_err(|_| anyhow::anyhow!("a short-lived thread panicked"))??;
        tids.push(tid);
        switches.push(switched);
    }
    announce(&serde_json::json!({ "tids": tids, "switches": switches }))?;
    Ok(())
}

/// This thread's context switches so far, voluntary and not.
fn context_switches() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .context("reading /proc/thread-self/status")?;
    let count = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .with_context(|| format!("no {key} in /proc/thread-self/status"))
    };
    Ok(count("voluntary_ctxt_switches:")? + count("nonvoluntary_ctxt_switches:")?)
}

fn ping_pong(rounds: u64, wait: bool) -> Result<()> {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("listening")?;
    let addr = listener.local_addr().context("local address")?;
    announce(&serde_json::json!({
        "workload": "ping-pong", "pid": std::process::id(), "rounds": rounds,
    }))?;
    wait_for_go(wait)?;
    let server = std::thread::Builder::new()
        .name("rw-pong".into())
        .spawn(move || -> Result<serde_json::Value> {
            let (mut s, _) = listener.accept().context("accepting")?;
            s.set_nodelay(true).context("nodelay")?;
            let before = own_run_delay()?;
            let mut b = [0u8; 1];
            for _ in 0..rounds {
                s.read_exact(&mut b).context("pong read")?;
                s.write_all(&b).context("pong write")?;
            }
            Ok(serde_json::json!({"tid": gettid(), "run_delay_ns": own_run_delay()? - before}))
        })
        .context("spawning the pong thread")?;
    let mut c = std::net::TcpStream::connect(addr).context("connecting")?;
    c.set_nodelay(true).context("nodelay")?;
    let started = std::time::Instant::now();
    let before = own_run_delay()?;
    let mut b = [1u8; 1];
    for _ in 0..rounds {
        c.write_all(&b).context("ping write")?;
        c.read_exact(&mut b).context("ping read")?;
    }
    let ping = serde_json::json!({"tid": gettid(), "run_delay_ns": own_run_delay()? - before});
    let elapsed = started.elapsed();
    let pong = server
        .join()
        .map_err(|_| anyhow::anyhow!("the pong thread panicked"))??;
    announce(&serde_json::json!({
        "rounds": rounds, "elapsed_s": elapsed.as_secs_f64(),
        "rounds_per_s": rounds as f64 / elapsed.as_secs_f64(),
        "threads": [ping, pong],
    }))
}

/// What the calling thread has waited on run queues so far, by the kernel
/// (the second field of its schedstat), ns. Read while it runs, so no wait
/// is in progress: the difference of two readings is exactly the waits that
/// ended between them.
fn own_run_delay() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat")
        .context("reading /proc/thread-self/schedstat")?;
    text.split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .with_context(|| format!("no run delay in schedstat {text:?}"))
}

fn yield_switches(switches: u64, cpu: Option<usize>, wait: bool) -> Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let cpu = cpu.unwrap_or(cpus - 1);
    if cpu >= cpus || cpu >= libc::CPU_SETSIZE as usize {
        anyhow::bail!("--cpu {cpu}: this machine has CPUs 0 to {}", cpus - 1);
    }
    announce(&serde_json::json!({
        "workload": "yield", "pid": std::process::id(), "switches": switches, "cpu": cpu,
    }))?;
    wait_for_go(wait)?;
    let yields = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(3));
    let release = Arc::new(Barrier::new(3));
    let (done_tx, done) = std::sync::mpsc::channel::<Result<(i32, u64)>>();
    let threads = (0..2)
        .map(|i| {
            let yields = Arc::clone(&yields);
            let start = Arc::clone(&start);
            let release = Arc::clone(&release);
            let done_tx = done_tx.clone();
            std::thread::Builder::new()
                .name(format!("rw-yield-{i}"))
                .spawn(move || {
                    let counted = (|| -> Result<u64> {
                        pin_to(cpu)?;
                        let before = nonvoluntary_switches()?;
                        start.wait();
                        while yields.fetch_add(1, Ordering::Relaxed) < switches {
                            // SAFETY: sched_yield has no preconditions.
                            unsafe { libc::sched_yield() };
                        }
                        Ok(nonvoluntary_switches()? - before)
                    })();
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    let _ = done_tx.send(counted.map(|c| (tid, c)));
                    // Blocked until the main thread has read this thread's
                    // whole-life count and the watcher has finished.
                    release.wait();
                })
                .context("spawning a yield thread")
        })
        .collect::<Result<Vec<_>>>()?;
    start.wait();
    let started = std::time::Instant::now();
    let mut counted = 0;
    let mut tids = Vec::new();
    for _ in 0..2 {
        let (tid, c) = done
            .recv()
            .map_err(|_| anyhow::anyhow!("a yield thread panicked"))??;
        counted += c;
        tids.push(tid);
    }
    let elapsed = started.elapsed();
    // Once a thread sleeps on the barrier, the kernel's count of its
    // involuntary switches is its whole life's: nothing preempts a sleeper.
    let mut whole_lives = 0;
    for tid in tids {
        whole_lives += switches_once_asleep(tid)?;
    }
    announce(&serde_json::json!({
        "switches": counted, "switches_whole_lives": whole_lives,
        "elapsed_s": elapsed.as_secs_f64(),
        "ns_per_switch": elapsed.as_nanos() as f64 / counted.max(1) as f64,
    }))?;
    // With `--wait`, the threads stay (asleep) until a second line: a
    // watcher can read its figures before they exit.
    wait_for_go(wait)?;
    release.wait();
    for thread in threads {
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("a yield thread panicked"))?;
    }
    Ok(())
}

/// Thread `tid`'s involuntary context switches, read once it sleeps for
/// good: in state `S`, with the same counts, twice 5 ms apart (a brief
/// sleep on the barrier's lock would have woken and switched again). From
/// then on the count cannot change: nothing preempts a sleeper.
fn switches_once_asleep(tid: i32) -> Result<u64> {
    let dir = format!("/proc/self/task/{tid}");
    let read = || -> Result<Option<(u64, u64)>> {
        let stat = std::fs::read_to_string(format!("{dir}/stat"))
            .with_context(|| format!("reading {dir}/stat"))?;
        // The state follows the command name, which ends at the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .with_context(|| format!("no state in {dir}/stat: {stat:?}"))?;
        let status = std::fs::read_to_string(format!("{dir}/status"))
            .with_context(|| format!("reading {dir}/status"))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .with_context(|| format!("no {name} in {dir}/status"))
        };
        let counts = (
            field("voluntary_ctxt_switches:")?,
            field("nonvoluntary_ctxt_switches:")?,
        );
        Ok((state == "S").then_some(counts))
    };
    let mut last = None;
    loop {
        let now = read()?;
        if now.is_some() && now == last {
            return Ok(now.map_or(0, |(_, involuntary)| involuntary));
        }
        last = now;
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn pin_to(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it
    // (cpu < CPU_SETSIZE, checked by the caller), and sched_setaffinity reads
    // it for this thread (pid 0).
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("pinning to CPU {cpu}"));
    }
    Ok(())
}

/// This thread's involuntary context switches so far (a yield to another
/// thread is one: the thread leaves the CPU still runnable).
fn nonvoluntary_switches() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .context("reading /proc/thread-self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no nonvoluntary_ctxt_switches in /proc/thread-self/status")
}

fn announce(description: &serde_json::Value) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{description}").context("writing to stdout")?;
    stdout.flush().context("flushing stdout")
}

fn wait_for_go(wait: bool) -> Result<()> {
    if wait {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .context("reading the go line from stdin")?;
    }
    Ok(())
}
