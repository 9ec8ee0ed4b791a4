//! Privileged: `ringwatch-agent serve --pid P` publishes the live eBPF view:
//! the process in /api/processes, its thread states on /api/timeline (a
//! thread that sleeps 50 ms K times shows K blocked slices of ~50 ms), and
//! its figures in /metrics (which promtool checks); a thread asleep in
//! pthread_join is off CPU as the kernel's schedstat says, and threads that
//! switch every few µs (no interval sent) use the CPU it says; threads that
//! exit within milliseconds keep their names. Skips, saying why, when not root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{ApiServer, Testload, skip_unless_privileged};

// The machine: the ping-pong test keeps both cores of a 2-core machine busy
// with ~17k switches a second: it has the machine alone, the others share it.
// The sleeper's 12 records each reach the agent within the live view's 250 ms
// lag on a quiet machine; one that comes later is not on the live timeline
// (ARCHITECTURE.md), and the agent counts it
// (`ringwatch_ringbuf_late_intervals_total`), so the test asks for every sleep
// it did not count as late. Under load (beside the ping-pong, or two other
// agents starting up) one of the 12 came late.
use test_support::{have_the_machine_alone, share_the_machine};

#[test]
fn serve_publishes_the_live_view_of_a_watched_process() {
    if skip_unless_privileged() {
        return;
    }
    let _machine = share_the_machine();
    const SLEEPS: usize = 12;
    let mut load = Testload::start(&["sleep", "--count", "12", "--interval", "50ms"]);
    let pid = load.info["pid"].as_u64().unwrap();
    let tid = load.info["tid"].as_u64().unwrap();
    let mut agent = ApiServer::start(&["--pid", &pid.to_string()], true);
    load.go();
    load.wait();

    // The view is republished every second: poll until the sleeps are in (or
    // counted late).
    let deadline = Instant::now() + Duration::from_secs(60);
    let (blocked, late) = loop {
        let (status, trace) = agent.get_json(&format!("/api/timeline?pid={pid}"));
        assert_eq!(status, 200, "{trace}");
        let blocked: Vec<f64> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == "thread_state" && e["tid"] == tid && e["name"] == "blocked")
            .map(|e| e["dur"].as_f64().unwrap())
            .collect();
        let late = late_intervals(&mut agent);
        let in_view = blocked.iter().filter(|&&d| d >= 45_000.0).count();
        if in_view + late >= SLEEPS || Instant::now() > deadline {
            break (blocked, late);
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let (_, trace) = agent.get_json(&format!("/api/timeline?pid={pid}"));
    common::assert_trace_event_format(&trace);
    // Each sleep is one blocked interval of 50 ms (µs on the timeline),
    // within scheduling slack.
    let sleeps: Vec<f64> = blocked.iter().copied().filter(|&d| d >= 45_000.0).collect();
    assert!(
        sleeps.len() + late >= SLEEPS,
        "blocked slices of the sleeper ({late} intervals came late): {blocked:?}"
    );
    assert!(
        sleeps.iter().all(|&d| d < 80_000.0),
        "implausible sleep lengths: {sleeps:?}"
    );

    let (status, processes) = agent.get_json("/api/processes");
    assert_eq!(status, 200);
    assert_eq!(processes["source"], "live", "{processes}");
    assert!(
        processes["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid),
        "{processes}"
    );

    let (status, _, metrics) = agent.request("GET", "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains(&format!("ringwatch_process_cpu_ratio{{pid=\"{pid}\"")),
        "{metrics}"
    );
    assert!(
        metrics.contains("ringwatch_ringbuf_drops_total 0"),
        "{metrics}"
    );
    // Prometheus' own checker on the live page (the counter family's HELP/TYPE
    // must name its `_total` sample in the classic format).
    common::promtool_check_metrics(&metrics);

    // SIGTERM: a clean exit.
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    let status = common::wait_within(&mut agent.child, Duration::from_secs(60));
    assert!(status.success(), "{status}");
}

/// `ringwatch_ringbuf_late_intervals_total` on the agent's `/metrics`.
fn late_intervals(agent: &mut ApiServer) -> usize {
    let (status, _, metrics) = agent.request("GET", "/metrics");
    assert_eq!(status, 200, "{metrics}");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("ringwatch_ringbuf_late_intervals_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no late-interval counter: {metrics}"))
}

/// `(on-CPU ns, run-queue ns)` of a thread so far, as the kernel counts them
/// (`/proc/<pid>/task/<tid>/schedstat`: the first two fields).
fn schedstat(pid: u64, tid: u64) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).unwrap();
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().unwrap());
    (fields.next().unwrap(), fields.next().unwrap())
}

#[test]
fn a_thread_blocked_in_join_is_off_cpu_while_it_waits() {
    if skip_unless_privileged() {
        return;
    }
    let _machine = share_the_machine();
    // The main thread spawns one spinning thread and joins it: from `go` on
    // it sleeps in pthread_join and never runs, so no off-CPU interval of it
    // closes while the agent watches (the spinner outlives the test, which
    // kills it, however long the agent takes to list the thread).
    let mut load = Testload::start(&["busy", "--threads", "1", "--duration", "600s"]);
    let pid = load.info["pid"].as_u64().unwrap();
    let agent = ApiServer::start(&["--pid", &pid.to_string()], true);
    load.go();
    std::thread::sleep(Duration::from_secs(2));
    // The kernel's account over the same stretch: on a CPU or waiting for one
    // at most a sliver of the time.
    let (on0, rq0) = schedstat(pid, pid);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(60);
    let main = loop {
        std::thread::sleep(Duration::from_millis(1200));
        let (status, processes) = agent.get_json("/api/processes");
        assert_eq!(status, 200, "{processes}");
        let main = processes["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["pid"] == pid)
            .flat_map(|p| p["threads"].as_array().cloned().unwrap_or_default())
            .find(|t| t["tid"] == pid);
        if let Some(main) = main {
            break main;
        }
        assert!(
            Instant::now() < deadline,
            "the main thread {pid} is not listed: {processes:#}"
        );
    };
    let (on1, rq1) = schedstat(pid, pid);
    let elapsed = started.elapsed().as_nanos() as f64;
    let kernel_off = 100.0 * (1.0 - ((on1 - on0) + (rq1 - rq0)) as f64 / elapsed);
    assert!(
        kernel_off > 99.0,
        "the kernel says it ran: {kernel_off:.2}% off CPU"
    );
    let off = main["off_cpu_pct"].as_f64().unwrap();
    assert!(
        (off - kernel_off).abs() < 2.0,
        "agent: {off:.2}% off CPU, kernel: {kernel_off:.2}%: {main:#}"
    );
    drop(agent);
    drop(load);
}

/// Per thread of `pid`: (on-CPU ns, run-queue ns) so far, as the kernel counts them.
fn process_schedstat(pid: u64) -> Vec<(u64, u64)> {
    let mut tids: Vec<u64> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|task| task.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .collect();
    tids.sort_unstable();
    tids.into_iter().map(|tid| schedstat(pid, tid)).collect()
}

/// The time a hypervisor took from this machine's CPUs so far (the `steal`
/// column of /proc/stat's `cpu` line) and all of their time, in ticks, and
/// how many CPUs there are.
fn machine_steal() -> (u64, u64, usize) {
    let text = std::fs::read_to_string("/proc/stat").unwrap();
    let cpu: Vec<u64> = text
        .lines()
        .find(|l| l.starts_with("cpu "))
        .unwrap()
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is in user).
    let all = cpu.iter().take(8).sum();
    let cpus = text
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .count();
    (cpu[7], all, cpus)
}

#[test]
fn threads_that_switch_every_few_microseconds_are_where_the_kernel_says() {
    if skip_unless_privileged() {
        return;
    }
    let _alone = have_the_machine_alone();
    // Two threads trade one byte over loopback: their on-CPU intervals,
    // waits and sleeps last a few µs, below the default --min-interval, so
    // almost none leaves the kernel as a record. Their shares must still be
    // there: the kernel adds the held-back intervals up per thread.
    let mut load = Testload::start(&["ping-pong", "--rounds", "1000000000"]);
    let pid = load.info["pid"].as_u64().unwrap();
    let agent = ApiServer::start(&["--pid", &pid.to_string()], true);
    load.go();
    std::thread::sleep(Duration::from_secs(2));
    let before = process_schedstat(pid);
    let steal_before = machine_steal();
    let started = Instant::now();
    let (mut cpu, mut off) = (Vec::new(), Vec::new());
    let (mut sent, mut not_sent) = (0, 0);
    let mut last = serde_json::Value::Null;
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(1000));
        let (status, processes) = agent.get_json("/api/processes");
        assert_eq!(status, 200, "{processes}");
        let p = processes["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("{pid} is not listed: {processes:#}"))
            .clone();
        cpu.push(p["cpu_pct"].as_f64().unwrap());
        off.push(p["off_cpu_pct"].as_f64().unwrap());
        let totals = &p["totals"];
        not_sent = totals["intervals_not_sent"].as_u64().unwrap();
        let all: u64 = ["on_cpu_intervals", "run_queue_waits", "off_cpu_intervals"]
            .iter()
            .map(|k| totals[k].as_u64().unwrap())
            .sum();
        sent = all - not_sent;
        last = p;
    }
    let elapsed = started.elapsed().as_nanos() as f64;
    let after = process_schedstat(pid);
    let steal_after = machine_steal();
    drop(load);
    let share = |ns: u64| 100.0 * ns as f64 / elapsed;
    let kernel_cpu: f64 = after
        .iter()
        .zip(&before)
        .map(|(a, b)| share(a.0 - b.0))
        .sum();
    // Off CPU (neither running nor runnable), mean over the threads, as the
    // live view gives a process's.
    let kernel_off = after
        .iter()
        .zip(&before)
        .map(|(a, b)| 100.0 - share(a.0 - b.0) - share(a.1 - b.1))
        .sum::<f64>()
        / after.len() as f64;
    // The live view's windows are the seconds between its builds, not
    // exactly the stretch read from /proc: compare the means.
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (agent_cpu, agent_off) = (mean(&cpu), mean(&off));
    // On a virtual machine the kernel's run time leaves out the time the
    // hypervisor took while a thread was current (paravirt steal time: the
    // task clock stops), the switch times the agent reads do not; so here
    // the kernel's "off CPU" (what its on and waiting leave) holds that
    // time too. How much of it fell on these threads is not known; at most
    // all the machine's, in percent of one CPU over the stretch. The gap
    // followed the steal point for point on the shared 2-core test VM
    // (steal 4% / 8% / 15%: agent 4 / 10 / 15 points below the kernel).
    let steal = {
        let (stolen, all) = (
            (steal_after.0 - steal_before.0) as f64,
            (steal_after.1 - steal_before.1) as f64,
        );
        100.0 * stolen / (all / steal_after.2 as f64).max(1.0)
    };
    // Shown when an assertion below fails (and with --nocapture): what the
    // agent read per thread, beside the kernel's per-thread shares.
    let kernel_threads: Vec<String> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| {
            format!(
                "{:.1}% on, {:.1}% waiting",
                share(a.0 - b.0),
                share(a.1 - b.1)
            )
        })
        .collect();
    eprintln!(
        "off CPU: agent {agent_off:.1}% ({off:?}), kernel {kernel_off:.1}%; \
         on CPU: agent {agent_cpu:.1}%, kernel {kernel_cpu:.1}%; steal {steal:.1}% of a CPU; \
         {sent} sent, {not_sent} not; \
         kernel per thread: {kernel_threads:?}; the agent's last reading: {last:#}"
    );
    assert!(
        kernel_cpu > 1.0,
        "the ping-pong barely ran: {kernel_cpu:.1}% of a CPU"
    );
    // Within 25 points, and below by what was stolen: the kernel splits a
    // thread's time between running and waiting otherwise than the switch
    // times do (below), more so when other work loads the cores (28%
    // against 36% off CPU was seen then). Without the held-back intervals
    // the agent read 4% against 59%.
    let threads = after.len() as f64;
    assert!(
        agent_off < kernel_off + 25.0 && agent_off > kernel_off - steal / threads - 25.0,
        "off CPU: agent {agent_off:.1}% ({off:?}), kernel {kernel_off:.1}%, steal {steal:.1}%"
    );
    // The split between running and waiting differs: on 6.18, quiet, the
    // agent read 28% on CPU and 13% waiting per thread where schedstat read
    // 40% and 1%, the same with --min-interval 0s (every interval sent), and
    // the sums agreed. Likely cause: after a wakeup that preempts (the idle
    // task, here), the kernel skips the next run-queue clock update, so the
    // woken task's run time starts at its enqueue. So the on-CPU share is
    // only bounded here, but well away from zero, where it was when only
    // the records counted.
    assert!(
        agent_cpu > 0.3 * kernel_cpu && agent_cpu < 1.5 * kernel_cpu + steal,
        "on CPU: agent {agent_cpu:.1}% ({cpu:?}), kernel {kernel_cpu:.1}%, steal {steal:.1}%"
    );
    assert!(
        not_sent > 0,
        "no interval stayed in the kernel: {not_sent} not sent, {sent} sent"
    );
}

#[test]
fn threads_that_exit_before_a_scan_keep_their_names() {
    if skip_unless_privileged() {
        return;
    }
    let _machine = share_the_machine();
    // Twenty threads of 2 ms each, one after the other: gone from /proc long
    // before the agent reads names there; only their exit records know them.
    let mut load = Testload::start(&["short-threads", "--count", "20", "--life", "2ms"]);
    let pid = load.info["pid"].as_u64().unwrap();
    let agent = ApiServer::start(&["--pid", &pid.to_string()], true);
    load.go();
    let out = load.wait_output();
    let tids: Vec<u64> = out
        .iter()
        .find_map(|l| l["tids"].as_array().cloned())
        .expect("the workload printed its tids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let names = loop {
        std::thread::sleep(Duration::from_millis(1100));
        let (status, trace) = agent.get_json(&format!("/api/timeline?pid={pid}"));
        assert_eq!(status, 200, "{trace}");
        let names: std::collections::BTreeMap<u64, String> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .filter_map(|e| Some((e["tid"].as_u64()?, e["args"]["name"].as_str()?.to_owned())))
            .filter(|(tid, _)| tids.contains(tid))
            .collect();
        if names.len() == tids.len() || Instant::now() > deadline {
            break names;
        }
    };
    assert_eq!(
        names.len(),
        tids.len(),
        "threads on the timeline: {names:?}"
    );
    for (i, tid) in tids.iter().enumerate() {
        assert_eq!(names[tid], format!("rw-short-{i}"), "{names:?}");
    }
    let (_, trace) = agent.get_json(&format!("/api/timeline?pid={pid}"));
    common::assert_trace_event_format(&trace);
}
