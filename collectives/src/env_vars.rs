//! Every environment variable the collective runtime reads, with its unit and
//! default: the source of `docs/reference/env.md`.
//!
//! The variables are read where they apply (`knobs`, `rendezvous`,
//! `runtime`, `control`, `shm`, `gpu`); this list only describes them, and
//! its defaults come from the same constants those readers use, so the page
//! cannot state a default the code does not have. A test holds the list to
//! the code: a `RINGWATCH_*` or `HOROVOD_*` name that the runtime's sources
//! read and this list lacks fails it. It never reads the environment itself.

use crate::control::Knobs;
use crate::knobs::{
    AutotuneConfig, COLLECTIVE_TIMEOUT_VAR, DEFAULT_CACHE_CAPACITY, DEFAULT_STALL_CHECK,
    DEFAULT_TIMEOUT, DEPRECATED_TIMEOUT_VAR,
};
use crate::rendezvous::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_MASTER_PORT};

/// One variable of the runtime's.
#[derive(Debug, Clone)]
pub struct EnvVariable {
    /// Its name, e.g. `RINGWATCH_FUSION_THRESHOLD`.
    pub name: &'static str,
    /// Horovod's name for the same setting, read when `name` is not set.
    pub horovod: Option<&'static str>,
    /// The variable's old ringwatch name, still read when `name` is not set,
    /// with a deprecation warning.
    pub deprecated: Option<&'static str>,
    /// What its value is: a unit, or the values it takes.
    pub unit: &'static str,
    /// What applies when it is not set.
    pub default: String,
    /// What it sets, in a sentence or two.
    pub what: &'static str,
}

/// The runtime's variables, grouped as the page shows them.
pub fn runtime_variables() -> Vec<(&'static str, Vec<EnvVariable>)> {
    let knobs = Knobs::default();
    let autotune = AutotuneConfig::default();
    let on_off = |on: bool| if on { "on" } else { "off" }.to_owned();
    let v = |name, horovod, unit, default: String, what| EnvVariable {
        name,
        horovod,
        deprecated: None,
        unit,
        default,
        what,
    };
    vec![
        (
            "The knobs (the tuner's too)",
            vec![
                v(
                    "RINGWATCH_FUSION_THRESHOLD",
                    Some("HOROVOD_FUSION_THRESHOLD"),
                    "bytes",
                    knobs.fusion_threshold_bytes.to_string(),
                    "The most bytes of tensors fused into one allreduce.",
                ),
                v(
                    "RINGWATCH_CYCLE_TIME_MS",
                    Some("HOROVOD_CYCLE_TIME"),
                    "duration up to 60 s (`2ms`, `0.5ms`; a bare number is milliseconds)",
                    format!("{}", knobs.cycle_time_us as f64 / 1000.0),
                    "How long a cycle gathers requests before rank 0 negotiates them.",
                ),
                v(
                    "RINGWATCH_HIERARCHICAL_ALLREDUCE",
                    Some("HOROVOD_HIERARCHICAL_ALLREDUCE"),
                    "boolean (1/0, true/false, yes/no, on/off)",
                    on_off(knobs.hierarchical_allreduce),
                    "Allreduce within each host first, then across hosts, then within again.",
                ),
                v(
                    "RINGWATCH_CACHE_CAPACITY",
                    Some("HOROVOD_CACHE_CAPACITY"),
                    "tensors (0 turns the cache off)",
                    DEFAULT_CACHE_CAPACITY.to_string(),
                    "How many negotiated tensors the response cache keeps, so that a \
                     repeated tensor skips negotiation.",
                ),
            ],
        ),
        (
            "Joining the job",
            vec![
                v(
                    "RINGWATCH_MASTER_PORT",
                    None,
                    "TCP port",
                    format!(
                        "`MASTER_PORT` + 1 from Python (`ringwatch.torch`); \
                         `MASTER_PORT`, else {DEFAULT_MASTER_PORT}, from Rust"
                    ),
                    "Where rank 0 listens for the other ranks (on `MASTER_ADDR`, \
                     default 127.0.0.1). Launcher variables (`RANK`, `WORLD_SIZE`, \
                     `LOCAL_RANK`, `LOCAL_SIZE`/`LOCAL_WORLD_SIZE`, Open MPI's \
                     `OMPI_COMM_WORLD_*`) say who is who.",
                ),
                v(
                    "RINGWATCH_CONNECT_TIMEOUT_SECS",
                    None,
                    "duration (`30s`, `500ms`; a bare number is seconds)",
                    DEFAULT_CONNECT_TIMEOUT.as_secs().to_string(),
                    "How long a rank waits for the others to join.",
                ),
                EnvVariable {
                    deprecated: Some(DEPRECATED_TIMEOUT_VAR),
                    ..v(
                        COLLECTIVE_TIMEOUT_VAR,
                        None,
                        "duration (`30s`, `500ms`; a bare number is seconds)",
                        DEFAULT_TIMEOUT.as_secs().to_string(),
                        "How long a rank waits on a silent peer during a collective before \
                         failing with the peer's rank.",
                    )
                },
                v(
                    "RINGWATCH_JOB_ID",
                    None,
                    "text",
                    "`job-<port>-<12 random hex digits>`".to_owned(),
                    "The job's name: its control socket's name and how the agent and \
                     the API call it.",
                ),
                v(
                    "RINGWATCH_HOST_ID",
                    None,
                    "text",
                    "none".to_owned(),
                    "Added to the host's identity: ranks with different values never \
                     share memory, as if on different hosts (pretend nodes in tests).",
                ),
            ],
        ),
        (
            "Stalls (Horovod's stall check)",
            vec![
                v(
                    "RINGWATCH_STALL_CHECK_SECS",
                    Some("HOROVOD_STALL_CHECK_TIME_SECONDS"),
                    "duration (`60s`, `500ms`; a bare number is seconds; 0 turns the check \
                     off, as `HOROVOD_STALL_CHECK_DISABLE=1` does)",
                    DEFAULT_STALL_CHECK.as_secs().to_string(),
                    "A tensor some ranks enqueued and others not for this long makes the \
                     job stalled: rank 0 logs the tensor and the missing ranks, and the \
                     node's agent shows them (`/api/jobs/{id}/diagnosis`).",
                ),
                v(
                    "HOROVOD_STALL_CHECK_DISABLE",
                    None,
                    "boolean",
                    on_off(false),
                    "Horovod's switch for the stall check, read as \
                     `RINGWATCH_STALL_CHECK_SECS=0`.",
                ),
                v(
                    "RINGWATCH_STALL_SHUTDOWN_SECS",
                    Some("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
                    "duration (0: off; at least the stall check)",
                    "0 (off: a stalled job waits)".to_owned(),
                    "A stall this long fails every rank with an error naming the stalled \
                     tensors and the ranks missing from each, instead of waiting forever.",
                ),
            ],
        ),
        (
            "Transports",
            vec![
                v(
                    "RINGWATCH_SHM",
                    None,
                    "boolean",
                    on_off(true),
                    "Ranks on one host exchange through shared memory; off: everything \
                     goes over TCP.",
                ),
                v(
                    "RINGWATCH_NCCL",
                    None,
                    "boolean",
                    on_off(true),
                    "GPU tensors go through NCCL where every rank has a GPU of its own; \
                     off: they are staged through host memory.",
                ),
                v(
                    "RINGWATCH_NCCL_LIBRARY",
                    None,
                    "path",
                    "the `libnccl.so*` the loader finds".to_owned(),
                    "The NCCL library to load for GPU tensors.",
                ),
            ],
        ),
        (
            "What the agent sees",
            vec![
                v(
                    "RINGWATCH_CONTROL_SOCKET",
                    None,
                    "boolean",
                    on_off(true),
                    "Rank 0 opens the control socket the node's agent finds the job by \
                     (and tunes it through).",
                ),
                v(
                    "RINGWATCH_RUNTIME_DIR",
                    None,
                    "directory",
                    "`/run/ringwatch` (where not writable: \
                     `$XDG_RUNTIME_DIR/ringwatch`, else `/tmp/ringwatch-<uid>`)"
                        .to_owned(),
                    "Where the control socket is created.",
                ),
                v(
                    "RINGWATCH_TIMELINE",
                    None,
                    "path",
                    "none".to_owned(),
                    "Rank 0 writes the job's timeline of cycles and tensors there (Chrome \
                     trace JSON); a path with `{rank}` in it gives every rank its own.",
                ),
                v(
                    "RINGWATCH_LOG",
                    None,
                    "tracing filter (`info`, `debug`, `collectives=trace`, …)",
                    "`warn`".to_owned(),
                    "What the Python front end's runtime logs to standard error (collbench \
                     reads `RUST_LOG`).",
                ),
            ],
        ),
        (
            "Tuning (`RINGWATCH_AUTOTUNE=1`)",
            vec![
                v(
                    "RINGWATCH_AUTOTUNE",
                    Some("HOROVOD_AUTOTUNE"),
                    "boolean",
                    on_off(false),
                    "Ask to be tuned: by the node's agent if it claims the job, else by \
                     rank 0 itself.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_WAIT_SECS",
                    None,
                    "duration (`30s`, `500ms`; a bare number is seconds)",
                    autotune.wait.as_secs_f64().to_string(),
                    "How long rank 0 waits for an agent's claim before tuning itself.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_BUDGET",
                    None,
                    "samples (at least 1)",
                    autotune.budget.to_string(),
                    "Samples of a self-tuning session.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_WARMUP_CYCLES",
                    None,
                    "cycles",
                    autotune.warmup_cycles.to_string(),
                    "Cycles with work skipped after each knob change.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_MEASURED_CYCLES",
                    None,
                    "cycles (at least 1)",
                    autotune.measured_cycles.to_string(),
                    "Cycles with work a sample's window holds at least.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_MIN_WINDOW_MS",
                    None,
                    "duration (`5ms`, `0.5s`; a bare number is milliseconds)",
                    autotune.min_window.as_millis().to_string(),
                    "The shortest time a sample's window spans.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_SEED",
                    None,
                    "integer",
                    autotune.seed.to_string(),
                    "Seed of the optimizer's random choices.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_WATCH",
                    None,
                    "boolean",
                    on_off(autotune.watch),
                    "After pinning, keep watching the throughput and tune again if the \
                     pinned knobs lose to the start.",
                ),
                v(
                    "RINGWATCH_AUTOTUNE_LOG",
                    Some("HOROVOD_AUTOTUNE_LOG"),
                    "path (`PATH.csv`, with `.parquet` and `.html` beside it)",
                    "none: the chosen knobs are only logged".to_owned(),
                    "Where a self-tuning session writes its report.",
                ),
            ],
        ),
        (
            // Read by the plugin library (collectives/nccl-profiler), not
            // the runtime; its tests hold these lines to its constants.
            "The NCCL profiler plugin (any NCCL job, `NCCL_PROFILER_PLUGIN`)",
            vec![
                v(
                    "RINGWATCH_NCCL_PROFILER",
                    None,
                    "`off` (also `0`, `false`, `no`)",
                    "on".to_owned(),
                    "Loaded but off: NCCL gets no context and no events are asked for.",
                ),
                v(
                    "RINGWATCH_NCCL_PROFILER_SOCKET",
                    None,
                    "path",
                    "`<dir>/nccl-profiler.socket` for a library loaded from `<dir>/lib/` (as \
                     the agent publishes it), else `nccl-profiler.socket` in \
                     `RINGWATCH_RUNTIME_DIR` (`/run/ringwatch`)"
                        .to_owned(),
                    "The agent's socket the plugin sends its records to.",
                ),
                v(
                    "RINGWATCH_NCCL_PROFILER_QUEUE",
                    None,
                    "records, 16 to 1048576",
                    "8192".to_owned(),
                    "The plugin's queue: past it, while the agent is slow, collectives are \
                     dropped and counted, never waited for.",
                ),
            ],
        ),
    ]
}

/// `docs/reference/env.md`, rendered from [`runtime_variables`].
pub fn render_markdown() -> String {
    let mut page = String::from(
        "# Environment variables\n\n\
         <!-- Rendered from collectives/src/env_vars.rs by `cargo xtask reference`; do not edit. -->\n\n\
         The collective runtime (every rank of a job on ringwatch: `ringwatch.torch`, \
         `collbench`) reads these when it starts. A Horovod name is read when the \
         ringwatch name is not set, and so is a deprecated old name (with a \
         warning). A value that does not parse stops the job at \
         `init()` with the variable's name; nothing is guessed. A duration takes \
         a unit (`500ms`, `2.5s`, `1m`, `250us`), as the agent's flags do; a bare \
         number is in the unit the variable's name ends with (`_SECS`, `_MS`).\n\n\
         The agent's and the other commands' variables stand beside their flags in \
         [the CLI reference](cli/ringwatch-agent.md): every flag with an environment \
         variable reads it when the flag is not given.\n",
    );
    for (group, variables) in runtime_variables() {
        page.push_str(&format!(
            "\n## {group}\n\n| variable | unit | default | what it sets |\n|---|---|---|---|\n"
        ));
        for var in variables {
            let mut name = format!("`{}`", var.name);
            if let Some(h) = var.horovod {
                name.push_str(&format!(" (Horovod: `{h}`)"));
            }
            if let Some(old) = var.deprecated {
                name.push_str(&format!(" (deprecated: `{old}`)"));
            }
            page.push_str(&format!(
                "| {name} | {} | {} | {} |\n",
                var.unit,
                if var.default.starts_with('`')
                    || var.default.contains(' ')
                    || var.default == "none"
                {
                    var.default.clone()
                } else {
                    format!("`{}`", var.default)
                },
                var.what.split_whitespace().collect::<Vec<_>>().join(" ")
            ));
        }
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, ext, out);
            } else if path.extension().is_some_and(|e| e == ext) {
                out.push(path);
            }
        }
    }

    /// The `RINGWATCH_*`/`HOROVOD_*` names in string literals of `text`.
    fn names_in(text: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for quote in ['"', '\''] {
            for piece in text.split(quote).skip(1).step_by(2) {
                if (piece.starts_with("RINGWATCH_") || piece.starts_with("HOROVOD_"))
                    && piece.len() > 10
                    && piece
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                {
                    names.insert(piece.to_owned());
                }
            }
        }
        names
    }

    #[test]
    fn every_variable_the_runtime_reads_is_listed() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut sources = Vec::new();
        files(&root.join("src"), "rs", &mut sources);
        files(&root.join("python/ringwatch"), "py", &mut sources);
        files(&root.join("python/src"), "rs", &mut sources);
        let listed: BTreeSet<&str> = runtime_variables()
            .into_iter()
            .flat_map(|(_, vars)| vars)
            .flat_map(|v| [Some(v.name), v.horovod, v.deprecated])
            .flatten()
            .collect();
        let mut missing = Vec::new();
        for file in &sources {
            let text = std::fs::read_to_string(file).unwrap();
            // Only the code: a file's unit tests name variables to set them.
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for name in names_in(code) {
                // collbench's own flags read their variables through clap
                // (listed with the flag in the CLI reference).
                if !listed.contains(name.as_str()) && !file.ends_with("collbench.rs") {
                    missing.push(format!("{name} ({})", file.display()));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "read by the runtime but not in env_vars::runtime_variables(): {missing:?}"
        );
    }

    #[test]
    fn every_variable_is_listed_once() {
        let mut seen = BTreeSet::new();
        for (_, vars) in runtime_variables() {
            for v in vars {
                assert!(seen.insert(v.name), "{} twice", v.name);
                assert!(!v.what.is_empty() && !v.unit.is_empty(), "{}", v.name);
            }
        }
    }

    #[test]
    fn the_page_shows_the_codes_defaults() {
        let page = render_markdown();
        assert!(page.contains(&format!(
            "| `RINGWATCH_FUSION_THRESHOLD` (Horovod: `HOROVOD_FUSION_THRESHOLD`) | bytes | `{}` |",
            Knobs::default().fusion_threshold_bytes
        )));
        assert!(page.contains(
            "| `RINGWATCH_COLLECTIVE_TIMEOUT_SECS` (deprecated: `RINGWATCH_TIMEOUT_SECS`) \
             | duration (`30s`, `500ms`; a bare number is seconds) | `30` |"
        ));
    }
}
