//! `metrics`: the Prometheus/OpenMetrics exposition of what the agent knows.
//!
//! Built per scrape from snapshots (prometheus-client's encoder), so a value
//! is never stale and nothing is registered twice. Only formats: it never
//! reads a device or a map itself.

use std::collections::HashMap;

use prometheus_client::encoding::text::encode_registry;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::gpu::{GpuReading, GpuSnapshot};
use crate::jobs::{JobSnapshot, JobState};
use crate::live::{LiveView, NamedProcess};
use crate::nccl_profiler::ProcessTotals;
use crate::tuning::{Objective, SessionState, SessionView};

/// Renders every metric as OpenMetrics text: GPUs, the live view's
/// processes, the jobs found and their knobs, and tuning sessions.
pub fn render_metrics(
    gpus: &GpuSnapshot,
    live: Option<&LiveView>,
    jobs: &[JobSnapshot],
    sessions: &[SessionView],
    nccl: &[ProcessTotals],
) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    let jobs_of = jobs_of_pids(jobs);
    if !nccl.is_empty() || describing() {
        registry.register_collector(Box::new(NcclCollector {
            procs: nccl.to_vec(),
            jobs_of: jobs_of.clone(),
        }));
    }
    registry.register_collector(Box::new(GpuCollector(gpus.clone())));
    if !jobs.is_empty() || !sessions.is_empty() || describing() {
        registry.register_collector(Box::new(TuningCollector {
            jobs: jobs.to_vec(),
            sessions: sessions.to_vec(),
        }));
    }
    if let Some(live) = live {
        registry.register_collector(Box::new(ProcessCollector {
            processes: live.processes.clone(),
            jobs_of,
            ringbuf_drops: live.ringbuf_drops,
            intervals_late: live.intervals_late,
        }));
    }
    let mut text = String::new();
    encode_registry(&mut text, &registry)?;
    text.push_str("# EOF\n");
    Ok(text)
}

/// The exposition formats `/metrics` speaks (chosen by the scraper's `Accept`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 (`application/openmetrics-text`), what Prometheus asks for first.
    OpenMetrics,
    /// Prometheus' classic text format 0.0.4 (`text/plain`), the default and what
    /// `promtool check metrics` reads.
    Classic,
}

impl Format {
    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Classic => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: the supported media type with the highest
    /// q-value (OpenMetrics on a tie); classic text when nothing supported is named (no
    /// header, `*/*`, or only types we do not speak), as Prometheus' own exporters do.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let mut best: Option<(f32, Format)> = None;
        for item in accept.unwrap_or("").split(',') {
            let mut parts = item.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|v| v.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            let format = match media.as_str() {
                "application/openmetrics-text" => Format::OpenMetrics,
                "text/plain" => Format::Classic,
                _ => continue,
            };
            if q.is_nan() || q <= 0.0 {
                continue;
            }
            let better = match best {
                None => true,
                Some((bq, bf)) => {
                    q > bq || (q == bq && format == Format::OpenMetrics && bf != format)
                }
            };
            if better {
                best = Some((q, format));
            }
        }
        best.map_or(Format::Classic, |(_, f)| f)
    }
}

/// Rewrites [`render_metrics`]' OpenMetrics text as the classic text format: a counter
/// family's `# HELP`/`# TYPE` name the `_total` sample (OpenMetrics names the family
/// without it), OpenMetrics-only types become their classic kin (`info` → gauge of
/// `_info`, `unknown` → untyped, `stateset` → gauge, `gaugehistogram` → histogram), and
/// `# UNIT` and `# EOF` go (the classic format has neither). Samples are unchanged.
pub fn to_classic(openmetrics: &str) -> String {
    fn help_line(out: &mut String, name: &str, text: &str) {
        out.push_str("# HELP ");
        out.push_str(name);
        out.push(' ');
        out.push_str(text);
        out.push('\n');
    }
    let mut out = String::with_capacity(openmetrics.len());
    // The current family's `# HELP` (name, text), held until its `# TYPE` says how to
    // name it; written as it was when no `# TYPE` of the same name follows.
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (suffix, kind) = match kind {
                "counter" => ("_total", "counter"),
                "info" => ("_info", "gauge"),
                "unknown" => ("", "untyped"),
                "stateset" => ("", "gauge"),
                "gaugehistogram" => ("", "histogram"),
                other => ("", other),
            };
            let classic = if name.ends_with(suffix) {
                name.to_string()
            } else {
                format!("{name}{suffix}")
            };
            match help.take() {
                Some((n, text)) if n == name => help_line(&mut out, &classic, text),
                Some((n, text)) => help_line(&mut out, n, text),
                None => {}
            }
            out.push_str("# TYPE ");
            out.push_str(&classic);
            out.push(' ');
            out.push_str(kind);
            out.push('\n');
            continue;
        }
        if let Some((n, text)) = help.take() {
            help_line(&mut out, n, text);
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    if let Some((n, text)) = help.take() {
        help_line(&mut out, n, text);
    }
    out
}

/// One scrape's GPU figures.
#[derive(Debug)]
struct GpuCollector(GpuSnapshot);

type Labels = Vec<(&'static str, String)>;

/// Label values escaped as the exposition formats want (`\\`, `\"`, `\n`):
/// prometheus-client writes them as given, and a process name or a job id
/// comes from users.
fn escaped(labels: Labels) -> Labels {
    labels
        .into_iter()
        .map(|(name, value)| {
            if !value.contains(['\\', '"', '\n']) {
                return (name, value);
            }
            let mut out = String::with_capacity(value.len() + 8);
            for c in value.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            (name, out)
        })
        .collect()
}

/// The labels of every `ringwatch_gpu_*` series.
const GPU_LABELS: [&str; 3] = ["gpu", "uuid", "name"];

fn gpu_labels(gpu: &GpuReading) -> Labels {
    let [index, uuid, name] = GPU_LABELS;
    vec![
        (index, gpu.index.to_string()),
        (uuid, gpu.uuid.clone().unwrap_or_default()),
        (name, gpu.name.clone().unwrap_or_default()),
    ]
}

#[cfg(test)]
thread_local! {
    /// Set by the reference page's test: every family's descriptor is
    /// encoded, with or without series.
    static DESCRIBE_ALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether every family is to be described even without series (only the
/// reference page's test asks).
fn describing() -> bool {
    #[cfg(test)]
    return DESCRIBE_ALL.with(std::cell::Cell::get);
    #[cfg(not(test))]
    false
}

/// Encodes one gauge family: a value per item that has the figure, labelled
/// by `labels`. Nothing at all when no item has it.
fn gauge_family<T>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: &[T],
    labels: impl Fn(&T) -> Labels,
    value: impl Fn(&T) -> Option<f64>,
) -> Result<(), std::fmt::Error> {
    let values: Vec<(Labels, f64)> = items
        .iter()
        .filter_map(|item| value(item).map(|v| (escaped(labels(item)), v)))
        .collect();
    if values.is_empty() && !describing() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in values {
        ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A gauge family over the GPUs.
fn gpu_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    gpus: &[GpuReading],
    value: impl Fn(&GpuReading) -> Option<f64>,
) -> Result<(), std::fmt::Error> {
    gauge_family(encoder, name, help, gpus, gpu_labels, value)
}

impl prometheus_client::collector::Collector for GpuCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let gpus = &self.0.gpus;
        let available = ConstGauge::new(i64::from(
            self.0.unavailable_reason.is_none() || !gpus.is_empty(),
        ));
        available.encode(encoder.encode_descriptor(
            "ringwatch_gpu_nvml_available",
            "1 when NVML could be read on this node",
            None,
            MetricType::Gauge,
        )?)?;
        let e = &mut encoder;
        gpu_gauge(
            e,
            "ringwatch_gpu_utilization_ratio",
            "Fraction of time a kernel ran on the GPU",
            gpus,
            |g| g.utilization_gpu_percent.map(|p| f64::from(p) / 100.0),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_memory_utilization_ratio",
            "Fraction of time device memory was read or written",
            gpus,
            |g| g.utilization_memory_percent.map(|p| f64::from(p) / 100.0),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_memory_used_bytes",
            "Device memory in use",
            gpus,
            |g| g.memory_used_bytes.map(|b| b as f64),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_memory_total_bytes",
            "Device memory installed",
            gpus,
            |g| g.memory_total_bytes.map(|b| b as f64),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_power_watts",
            "Board power draw",
            gpus,
            |g| g.power_watts,
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_temperature_celsius",
            "GPU die temperature",
            gpus,
            |g| g.temperature_celsius.map(f64::from),
        )?;
        gpu_gauge(e, "ringwatch_gpu_sm_clock_hertz", "SM clock", gpus, |g| {
            g.clock_sm_mhz.map(|mhz| f64::from(mhz) * 1e6)
        })?;
        gpu_gauge(
            e,
            "ringwatch_gpu_memory_clock_hertz",
            "Memory clock",
            gpus,
            |g| g.clock_memory_mhz.map(|mhz| f64::from(mhz) * 1e6),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_pcie_tx_bytes_per_second",
            "PCIe bytes/s sent by the GPU",
            gpus,
            |g| g.pcie_tx_bytes_per_second.map(|b| b as f64),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_pcie_rx_bytes_per_second",
            "PCIe bytes/s received by the GPU",
            gpus,
            |g| g.pcie_rx_bytes_per_second.map(|b| b as f64),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_nvlink_tx_bytes",
            "NVLink bytes sent since the driver loaded",
            gpus,
            |g| g.nvlink_tx_bytes_total.map(|b| b as f64),
        )?;
        gpu_gauge(
            e,
            "ringwatch_gpu_nvlink_rx_bytes",
            "NVLink bytes received since the driver loaded",
            gpus,
            |g| g.nvlink_rx_bytes_total.map(|b| b as f64),
        )?;
        Ok(())
    }
}

/// One scrape's figures of the watched processes (the live view's last second).
#[derive(Debug)]
struct ProcessCollector {
    processes: Vec<NamedProcess>,
    /// pid -> (job id, rank) of the processes some job names.
    jobs_of: HashMap<u32, (String, String)>,
    ringbuf_drops: u64,
    intervals_late: u64,
}

/// A watched process's labels: `pid`, `comm`, `container_id` and `pod_uid`.
/// The last two are empty when the process's cgroup names no container or
/// pod: every series of a family has the same label names, and Prometheus
/// reads an empty label as an absent one, so `{container_id=""}` selects
/// the processes outside containers.
///
/// `job` and `rank` name the job and rank the process is of (a rank's
/// children, such as data-loader workers, carry their rank's; a process of
/// unknown rank an empty rank), empty for processes of no job. They add no
/// series: each stays one per watched process, so their cardinality is the
/// number of watched processes (bounded by the agent's thread and process
/// caps), whatever jobs say about themselves.
/// The labels of every `ringwatch_process_*` series.
const PROCESS_LABELS: [&str; 6] = ["pid", "comm", "container_id", "pod_uid", "job", "rank"];

/// pid -> (job id, rank) of every local process a connected job names,
/// each process labelled by the first job that names it (ringwatch jobs come
/// first in the list).
fn jobs_of_pids(jobs: &[JobSnapshot]) -> HashMap<u32, (String, String)> {
    let mut of = HashMap::new();
    for job in jobs.iter().filter(|j| j.state == JobState::Connected) {
        for (pid, rank) in job.local_processes() {
            of.entry(pid).or_insert_with(|| {
                (
                    job.job_id.clone(),
                    rank.map_or_else(String::new, |r| r.to_string()),
                )
            });
        }
    }
    of
}

fn process_labels(p: &NamedProcess, jobs_of: &HashMap<u32, (String, String)>) -> Labels {
    let [pid, comm, container_id, pod_uid, job, rank] = PROCESS_LABELS;
    let (job_id, rank_no) = jobs_of.get(&p.snapshot.pid).cloned().unwrap_or_default();
    vec![
        (pid, p.snapshot.pid.to_string()),
        (comm, p.name.clone()),
        (
            container_id,
            p.container.container_id.clone().unwrap_or_default(),
        ),
        (pod_uid, p.container.pod_uid.clone().unwrap_or_default()),
        (job, job_id),
        (rank, rank_no),
    ]
}

fn process_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    collector: &ProcessCollector,
    value: impl Fn(&NamedProcess) -> Option<f64>,
) -> Result<(), std::fmt::Error> {
    gauge_family(
        encoder,
        name,
        help,
        &collector.processes,
        |p| process_labels(p, &collector.jobs_of),
        value,
    )
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        ConstCounter::new(self.ringbuf_drops).encode(encoder.encode_descriptor(
            "ringwatch_ringbuf_drops",
            "Kernel records lost because the ring buffer was full",
            None,
            MetricType::Counter,
        )?)?;
        ConstCounter::new(self.intervals_late).encode(encoder.encode_descriptor(
            "ringwatch_ringbuf_late_intervals",
            "Scheduling intervals whose record reached the agent after the live view had \
             published their time, so they are missing from the live timeline",
            None,
            MetricType::Counter,
        )?)?;
        let p = self;
        let e = &mut encoder;
        process_gauge(
            e,
            "ringwatch_process_cpu_ratio",
            "On-CPU time over the last second, in CPUs",
            p,
            |p| Some(p.snapshot.cpu_pct / 100.0),
        )?;
        process_gauge(
            e,
            "ringwatch_process_off_cpu_ratio",
            "Mean blocked share of its threads over the last second",
            p,
            |p| Some(p.snapshot.off_cpu_pct / 100.0),
        )?;
        process_gauge(
            e,
            "ringwatch_process_run_queue_wait_p99_seconds",
            "99th percentile run-queue wait over the last second",
            p,
            |p| p.snapshot.run_queue_p99_us.map(|us| us / 1e6),
        )?;
        process_gauge(
            e,
            "ringwatch_process_tcp_tx_bytes_per_second",
            "TCP bytes sent per second",
            p,
            |p| Some(p.snapshot.tcp_tx_bytes_per_s),
        )?;
        process_gauge(
            e,
            "ringwatch_process_tcp_rx_bytes_per_second",
            "TCP bytes received per second",
            p,
            |p| Some(p.snapshot.tcp_rx_bytes_per_s),
        )?;
        process_gauge(
            e,
            "ringwatch_process_tcp_retransmits",
            "TCP retransmits since the agent first saw the process",
            p,
            |p| Some(p.snapshot.retransmits_total as f64),
        )?;
        process_gauge(
            e,
            "ringwatch_process_nccl_calls_per_second",
            "NCCL collective calls per second",
            p,
            |p| Some(p.snapshot.nccl_calls_per_s),
        )?;
        Ok(())
    }
}

/// One scrape's totals of the NCCL profiler plugins' records.
#[derive(Debug)]
struct NcclCollector {
    procs: Vec<ProcessTotals>,
    /// pid -> (job id, rank) of the processes some job names.
    jobs_of: HashMap<u32, (String, String)>,
}

/// The labels of the `ringwatch_nccl_*` series: the process (and its job
/// and rank), the communicator (hex hash; a process's first 8, the rest
/// `other`), NCCL's function (9 named, the rest `other`) and a size bucket
/// (5). Bounded: at most 256 processes × 9 × 10 × 5 series, whatever the
/// jobs send.
const NCCL_LABELS: [&str; 6] = ["pid", "job", "rank", "comm", "func", "size"];

/// Encodes one family of `(labels, value)` as a counter or a gauge.
fn family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: Vec<(Labels, f64)>,
) -> Result<(), std::fmt::Error> {
    if values.is_empty() && !describing() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in values {
        let labels = escaped(labels);
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(family.encode_family(&labels)?)?,
            _ => ConstGauge::new(v).encode(family.encode_family(&labels)?)?,
        }
    }
    Ok(())
}

impl NcclCollector {
    fn process_labels(&self, pid: u32) -> Labels {
        let (job, rank) = self.jobs_of.get(&pid).cloned().unwrap_or_default();
        vec![("pid", pid.to_string()), ("job", job), ("rank", rank)]
    }

    fn series(
        &self,
        value: impl Fn(&crate::nccl_profiler::SeriesTotals) -> Option<f64>,
    ) -> Vec<(Labels, f64)> {
        let [_, _, _, comm, func, size] = NCCL_LABELS;
        let mut out = Vec::new();
        for p in &self.procs {
            for ((c, f, b), totals) in &p.series {
                if let Some(v) = value(totals) {
                    let mut labels = self.process_labels(p.pid);
                    labels.extend([
                        (comm, c.clone()),
                        (func, (*f).to_owned()),
                        (size, (*b).to_owned()),
                    ]);
                    out.push((labels, v));
                }
            }
        }
        out
    }
}

impl prometheus_client::collector::Collector for NcclCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        family(
            e,
            "ringwatch_nccl_collectives",
            "Collectives NCCL's profiler plugin reported, per communicator, function and size",
            MetricType::Counter,
            self.series(|t| Some(t.collectives as f64)),
        )?;
        family(
            e,
            "ringwatch_nccl_collective_seconds",
            "Time in collectives: on the GPU where NCCL gives kernel times (2.27+), else as the plugin saw the kernel start and stop",
            MetricType::Counter,
            self.series(|t| Some(t.seconds)),
        )?;
        family(
            e,
            "ringwatch_nccl_collective_bytes",
            "Bytes of the collectives (elements times the datatype's size)",
            MetricType::Counter,
            self.series(|t| Some(t.bytes as f64)),
        )?;
        family(
            e,
            "ringwatch_nccl_bus_bandwidth_bytes_per_second",
            "Bus bandwidth of the timed collectives since the plugin connected (nccl-tests' bus bytes over time in collectives)",
            MetricType::Gauge,
            self.series(|t| {
                (t.seconds > 0.0 && t.bus_bytes > 0.0).then(|| t.bus_bytes / t.seconds)
            }),
        )?;
        let mut dropped = Vec::new();
        for p in &self.procs {
            for (reason, n) in [
                ("queue_full", p.counters.dropped_queue_full),
                ("no_agent", p.counters.dropped_no_agent),
            ] {
                let mut labels = self.process_labels(p.pid);
                labels.push(("reason", reason.to_owned()));
                dropped.push((labels, n as f64));
            }
        }
        family(
            e,
            "ringwatch_nccl_profiler_dropped",
            "Collectives the plugin dropped, as it last reported; labels pid, job, rank and reason: queue_full (the agent slow) or no_agent",
            MetricType::Counter,
            dropped,
        )?;
        Ok(())
    }
}

/// One scrape's jobs (their knobs) and tuning sessions.
#[derive(Debug)]
struct TuningCollector {
    jobs: Vec<JobSnapshot>,
    sessions: Vec<SessionView>,
}

/// The labels of every `ringwatch_job_*` and `ringwatch_tuning_*` series.
const JOB_LABELS: [&str; 1] = ["job"];

fn job_labels(job: &JobSnapshot) -> Labels {
    vec![(JOB_LABELS[0], job.job_id.clone())]
}

/// The best sample's measured score, if the session scores by `objective`.
fn best_score(session: &SessionView, objective: Objective) -> Option<f64> {
    if session.objective != Some(objective) {
        return None;
    }
    let best = session.best.as_ref()?;
    session.samples.get(best.sample).map(|x| x.score)
}

fn session_labels(session: &SessionView) -> Labels {
    vec![(JOB_LABELS[0], session.job_id.clone())]
}

impl prometheus_client::collector::Collector for TuningCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        let j = &self.jobs;
        gauge_family(
            e,
            "ringwatch_job_connected",
            "1 while the agent talks to the job's control socket (or, for a job found from its launcher's variables, sees its processes), 0 once lost",
            j,
            job_labels,
            |job| Some(f64::from(u8::from(job.state == JobState::Connected))),
        )?;
        gauge_family(
            e,
            "ringwatch_job_fusion_threshold_bytes",
            "The job's fusion threshold (0: fusion off)",
            j,
            job_labels,
            |job| job.knobs.map(|k| k.fusion_threshold_bytes as f64),
        )?;
        gauge_family(
            e,
            "ringwatch_job_cycle_time_seconds",
            "The job's cycle time",
            j,
            job_labels,
            |job| job.knobs.map(|k| k.cycle_time_us as f64 / 1e6),
        )?;
        gauge_family(
            e,
            "ringwatch_job_hierarchical_allreduce",
            "1 when the job uses hierarchical allreduce",
            j,
            job_labels,
            |job| {
                job.knobs
                    .map(|k| f64::from(u8::from(k.hierarchical_allreduce)))
            },
        )?;
        gauge_family(
            e,
            "ringwatch_job_stalled_tensors",
            "Tensors some of the job's ranks enqueued and others not for longer than its stall check (0: not stalled; ringwatch jobs only)",
            j,
            job_labels,
            |job| {
                (job.kind == crate::jobs::JobKind::Ringwatch)
                    .then(|| job.stall.as_ref().map_or(0.0, |s| s.stalled.len() as f64))
            },
        )?;
        let s = &self.sessions;
        gauge_family(
            e,
            "ringwatch_tuning_running",
            "1 while a tuning session of the job runs",
            s,
            session_labels,
            |t| Some(f64::from(u8::from(t.state == SessionState::Running))),
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_samples",
            "Samples taken by the job's latest tuning session",
            s,
            session_labels,
            |t| Some(t.samples.len() as f64),
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_budget_samples",
            "Sample budget of the job's latest tuning session",
            s,
            session_labels,
            |t| Some(t.config.budget as f64),
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_best_score_steps_per_second",
            "Measured training steps per second of the best knobs so far (sessions of jobs that mark their steps)",
            s,
            session_labels,
            |t| best_score(t, Objective::StepsPerSecond),
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_best_score_bytes_per_second",
            "Measured bytes reduced per second of the best knobs so far (sessions of jobs that mark no steps)",
            s,
            session_labels,
            |t| best_score(t, Objective::BytesPerSecond),
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_speedup_over_start_ratio",
            "Best knobs' measured score over the starting knobs'",
            s,
            session_labels,
            |t| t.speedup_over_start,
        )?;
        gauge_family(
            e,
            "ringwatch_tuning_disturbed_samples",
            "Samples whose window eBPF found disturbed",
            s,
            session_labels,
            |t| Some(t.samples.iter().filter(|x| x.disturbed.is_some()).count() as f64),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod format_tests {
    use super::*;

    #[test]
    fn classic_text_names_counters_by_their_total_sample() {
        let om = "# HELP ringwatch_ringbuf_drops Kernel records lost.\n\
                  # TYPE ringwatch_ringbuf_drops counter\n\
                  ringwatch_ringbuf_drops_total 3\n\
                  # HELP ringwatch_gpu_nvml_available Whether NVML loaded.\n\
                  # TYPE ringwatch_gpu_nvml_available gauge\n\
                  # UNIT ringwatch_gpu_nvml_available none\n\
                  ringwatch_gpu_nvml_available 0\n\
                  # HELP build Build facts.\n\
                  # TYPE build info\n\
                  build_info{version=\"1\"} 1\n\
                  # EOF\n";
        assert_eq!(
            to_classic(om),
            "# HELP ringwatch_ringbuf_drops_total Kernel records lost.\n\
             # TYPE ringwatch_ringbuf_drops_total counter\n\
             ringwatch_ringbuf_drops_total 3\n\
             # HELP ringwatch_gpu_nvml_available Whether NVML loaded.\n\
             # TYPE ringwatch_gpu_nvml_available gauge\n\
             ringwatch_gpu_nvml_available 0\n\
             # HELP build_info Build facts.\n\
             # TYPE build_info gauge\n\
             build_info{version=\"1\"} 1\n"
        );
    }

    #[test]
    fn the_accept_header_picks_the_format() {
        use Format::*;
        for (accept, want) in [
            (None, Classic),
            (Some("*/*"), Classic),
            (Some("text/plain"), Classic),
            (Some("text/plain;version=0.0.4"), Classic),
            (Some("application/openmetrics-text"), OpenMetrics),
            // What Prometheus 2.x sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.2, text/plain;q=0.9"),
                Classic,
            ),
            (Some("application/openmetrics-text;q=0"), Classic),
            (Some("application/json"), Classic),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::containers::Container;
    use crate::timeline::RecordedTrace;

    fn view(processes: Vec<NamedProcess>) -> LiveView {
        LiveView {
            processes,
            timeline: RecordedTrace::from_events(Vec::new(), Some(0.0), "test").unwrap(),
            states: Vec::new(),
            job_activities: Vec::new(),
            ringbuf_drops: 0,
            intervals_late: 0,
            jobs: Vec::new(),
            min_interval_ns: 0,
        }
    }

    fn process(pid: u32, container: Container) -> NamedProcess {
        NamedProcess {
            name: "collbench".into(),
            container,
            snapshot: crate::model::Model::new(1, 1).process_snapshot(pid, 0, 1),
        }
    }

    #[test]
    fn process_series_carry_the_container_and_pod_empty_when_unknown() {
        // Pid 7 is rank 3 of a torchrun job.
        let job: JobSnapshot = serde_json::from_value(serde_json::json!({
            "job_id": "torchrun/r@a:1/uid0", "kind": "torchrun", "protocol_version": 0,
            "world_size": 4, "local_size": 1,
            "ranks": [{"rank": 3, "local_rank": 1, "local_size": 2, "host": "n", "pid": 7}],
            "host": "n", "served_by_rank": 3, "ns_pids": {}, "knobs": null, "cycle": 0,
            "autotune": "off", "state": "connected", "lost_reason": null,
            "last_seen_unix_ms": 0, "stats_received": 0, "timeline_events_received": 0,
            "timeline_events_dropped": 0, "timeline_bytes": 0,
            "timeline_streaming_since_unix_ms": null, "owner_uid": 0, "owner_pid": 1,
        }))
        .unwrap();
        let id = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
        let uid = "1234abcd-5678-4ef0-9abc-def012345678";
        let live = view(vec![
            process(
                7,
                Container {
                    container_id: Some(id.into()),
                    pod_uid: Some(uid.into()),
                },
            ),
            process(8, Container::default()),
        ]);
        let text = render_metrics(
            &GpuSnapshot {
                gpus: Vec::new(),
                unavailable_reason: Some("test".into()),
            },
            Some(&live),
            &[job],
            &[],
            &[],
        )
        .unwrap();
        assert!(
            text.contains(&format!(
                "ringwatch_process_cpu_ratio{{pid=\"7\",comm=\"collbench\",container_id=\"{id}\",pod_uid=\"{uid}\",job=\"torchrun/r@a:1/uid0\",rank=\"3\"}} "
            )),
            "{text}"
        );
        assert!(
            text.contains(
                "ringwatch_process_cpu_ratio{pid=\"8\",comm=\"collbench\",container_id=\"\",pod_uid=\"\",job=\"\",rank=\"\"} "
            ),
            "{text}"
        );
        // A job found from its launcher's variables has no knobs: no knob series.
        assert!(
            !text.contains("ringwatch_job_fusion_threshold_bytes{"),
            "{text}"
        );
        assert!(
            text.contains("ringwatch_job_connected{job=\"torchrun/r@a:1/uid0\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let labels = escaped(vec![
            ("comm", "a\"b\\c\nd".to_owned()),
            ("job", "plain".into()),
        ]);
        assert_eq!(labels[0].1, "a\\\"b\\\\c\\nd");
        assert_eq!(labels[1].1, "plain");
    }

    /// `docs/reference/metrics.md`: every family the agent can serve, as
    /// the encoders describe it, with its labels (`cargo xtask reference`
    /// writes it).
    #[test]
    fn reference_metrics_is_current() {
        DESCRIBE_ALL.with(|d| d.set(true));
        let text = render_metrics(
            &GpuSnapshot {
                gpus: Vec::new(),
                unavailable_reason: None,
            },
            Some(&view(Vec::new())),
            &[],
            &[],
            &[],
        )
        .unwrap();
        DESCRIBE_ALL.with(|d| d.set(false));
        let classic = to_classic(&text);
        let mut families: Vec<(String, String, String)> = Vec::new();
        for line in classic.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                families.push((name.to_owned(), String::new(), help.to_owned()));
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                let family = families.last_mut().unwrap();
                assert_eq!(family.0, name, "{classic}");
                family.1 = kind.to_owned();
            }
        }
        let groups: [(&str, &str, &[&str]); 6] = [
            ("GPUs (NVML)", "ringwatch_gpu_", &GPU_LABELS),
            (
                "Watched processes (eBPF)",
                "ringwatch_process_",
                &PROCESS_LABELS,
            ),
            ("The agent's eBPF side", "ringwatch_ringbuf_", &[]),
            ("Jobs found", "ringwatch_job_", &JOB_LABELS),
            ("Tuning sessions", "ringwatch_tuning_", &JOB_LABELS),
            (
                "NCCL collectives (the profiler plugin)",
                "ringwatch_nccl_",
                &NCCL_LABELS,
            ),
        ];
        let mut page = String::from(
            "# Metrics\n\n\
             <!-- Rendered from agent/src/publish/metrics.rs by `cargo xtask reference`; do not edit. -->\n\n\
             `GET /metrics` on the agent's port, in Prometheus' text format (OpenMetrics when \
             the scraper asks for it). Every series is built from a snapshot at the scrape; a \
             family appears only when something has the figure (no GPU, no GPU series).\n",
        );
        let mut shown = 0;
        for (title, prefix, labels) in groups {
            page.push_str(&format!("\n## {title}\n\n"));
            if labels.is_empty() {
                page.push_str("No labels.\n\n");
            } else {
                let labels: Vec<String> = labels.iter().map(|l| format!("`{l}`")).collect();
                page.push_str(&format!("Labels: {}.\n\n", labels.join(", ")));
            }
            page.push_str("| metric | type | what it measures |\n|---|---|---|\n");
            for (name, kind, help) in families.iter().filter(|f| f.0.starts_with(prefix)) {
                page.push_str(&format!("| `{name}` | {kind} | {help} |\n"));
                shown += 1;
            }
        }
        assert_eq!(shown, families.len(), "a family in no group: {families:?}");
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/reference/metrics.md");
        crate::cli_reference::check_page(std::path::Path::new(path), &page);
    }
}
