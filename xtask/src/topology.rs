//! Pretend nodes on one machine: network namespaces joined through a bridge
//! by veth links whose bandwidth is limited with `tc tbf`, so traffic between
//! nodes is scarce the way it is in a real cluster while ranks on one node
//! talk over that node's loopback.
//!
//! Everything it creates is named `<prefix>-…` and removed on drop, and also
//! when the process gets SIGINT or SIGTERM (see [`install_signal_cleanup`]);
//! stale namespaces of an earlier run with the same prefix are removed first.
//! It never touches the host's own interfaces or addresses: every link and
//! address lives inside the namespaces it made.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Mutex, Once};

use anyhow::{Context, Result, bail};

/// A set of pretend nodes. Dropping it deletes them.
pub struct Topology {
    prefix: String,
    nodes: usize,
    rate_mbit: u32,
}

/// The subnet the pretend nodes live in (node i has `10.77.0.(i+1)`); it
/// exists only inside the namespaces.
const SUBNET: &str = "10.77.0";

/// What a signal handler must clean up: namespace prefixes in use and the
/// pids of processes running inside them.
struct Live {
    prefixes: BTreeSet<String>,
    children: BTreeSet<u32>,
}

static LIVE: Mutex<Live> = Mutex::new(Live {
    prefixes: BTreeSet::new(),
    children: BTreeSet::new(),
});

fn live() -> std::sync::MutexGuard<'static, Live> {
    // A panic while holding the lock leaves plain sets behind: still usable.
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Remembers a process started inside the pretend nodes, so that a signal
/// kills it before its namespace is deleted.
pub fn register_child(pid: u32) {
    live().children.insert(pid);
}

/// Forgets a process that was waited for.
pub fn unregister_child(pid: u32) {
    live().children.remove(&pid);
}

/// On SIGINT or SIGTERM: kill the registered processes, delete every
/// namespace of every live topology, and exit (130 for SIGINT, 143 for
/// SIGTERM), so that Ctrl-C never leaves namespaces behind. Installing twice
/// is harmless.
pub fn install_signal_cleanup() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = crate::exit_on_signal("stopping the job, removing the pretend nodes", || {
            let live = live();
            for pid in &live.children {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            for prefix in &live.prefixes {
                remove_namespaces(prefix);
            }
        });
    });
    result
}

fn ip(args: &[&str]) -> Result<()> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .context("could not run `ip` (install iproute2: cargo xtask setup)")?;
    if !output.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

fn in_ns(ns: &str, program: &str, args: &[&str]) -> Result<()> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    ip(&full)
}

/// The namespaces whose name starts with `<prefix>-`.
pub fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let Ok(output) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    let start = format!("{prefix}-");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(&start))
        .map(str::to_owned)
        .collect()
}

/// Kills what still runs in, and deletes, every namespace `<prefix>-…`.
fn remove_namespaces(prefix: &str) {
    for name in namespaces_with_prefix(prefix) {
        // A namespace outlives `ip netns del` while a process is in it.
        if let Ok(output) = Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&output.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
        }
        let _ = ip(&["netns", "del", &name]);
    }
}

impl Topology {
    /// Creates `nodes` namespaces `<prefix>-n0…`, each linked to a bridge in
    /// `<prefix>-sw` at `rate_mbit` Mbit/s in both directions. Namespaces left
    /// with this prefix by an earlier run (one that was killed with SIGKILL,
    /// say) are removed first.
    pub fn create(prefix: &str, nodes: usize, rate_mbit: u32) -> Result<Self> {
        if !(1..=200).contains(&nodes) {
            bail!("between 1 and 200 pretend nodes, not {nodes}");
        }
        if rate_mbit == 0 {
            bail!("the inter-node rate must be at least 1 Mbit/s");
        }
        install_signal_cleanup()?;
        let stale = namespaces_with_prefix(prefix);
        if !stale.is_empty() {
            eprintln!(
                "xtask: removing pretend nodes of an earlier run: {}",
                stale.join(" ")
            );
            remove_namespaces(prefix);
        }
        live().prefixes.insert(prefix.to_owned());
        // From here on, Drop cleans up whatever part was made.
        let topology = Self {
            prefix: prefix.to_owned(),
            nodes,
            rate_mbit,
        };
        topology.build().with_context(|| {
            format!("creating {nodes} pretend nodes `{prefix}-n*` (needs root)")
        })?;
        Ok(topology)
    }

    fn build(&self) -> Result<()> {
        let switch = self.switch();
        ip(&["netns", "add", &switch])?;
        in_ns(&switch, "ip", &["link", "add", "br0", "type", "bridge"])?;
        in_ns(&switch, "ip", &["link", "set", "br0", "up"])?;
        let rate = format!("{}mbit", self.rate_mbit);
        // tbf needs a bucket of at least one (GSO) packet; a few ms of traffic
        // at the rate keeps it from starving at high rates.
        let burst = format!("{}kb", (self.rate_mbit as u64 / 8 * 4).max(256));
        for node in 0..self.nodes {
            let ns = self.namespace(node);
            ip(&["netns", "add", &ns])?;
            in_ns(&ns, "ip", &["link", "set", "lo", "up"])?;
            let (inner, outer) = (format!("rwn{node}"), format!("rws{node}"));
            ip(&[
                "link", "add", &inner, "netns", &ns, "type", "veth", "peer", "name", &outer,
                "netns", &switch,
            ])?;
            in_ns(
                &ns,
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/24", self.address(node)),
                    "dev",
                    &inner,
                ],
            )?;
            in_ns(&ns, "ip", &["link", "set", &inner, "up"])?;
            in_ns(&switch, "ip", &["link", "set", &outer, "master", "br0"])?;
            in_ns(&switch, "ip", &["link", "set", &outer, "up"])?;
            // Egress of both ends: node → switch and switch → node.
            for (where_, dev) in [(&ns, &inner), (&switch, &outer)] {
                in_ns(
                    where_,
                    "tc",
                    &[
                        "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst,
                        "latency", "50ms",
                    ],
                )?;
            }
        }
        Ok(())
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// The namespace of node `node`.
    pub fn namespace(&self, node: usize) -> String {
        format!("{}-n{node}", self.prefix)
    }

    /// The address of node `node` on the inter-node network.
    pub fn address(&self, node: usize) -> String {
        format!("{SUBNET}.{}", node + 1)
    }

    /// How many nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The inter-node rate limit, Mbit/s in each direction of each node's link.
    pub fn rate_mbit(&self) -> u32 {
        self.rate_mbit
    }

    /// A command that runs `program` inside node `node`'s namespace
    /// (`ip netns exec` execs it, so the child's pid is the program's).
    pub fn command(&self, node: usize, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.namespace(node)])
            .arg(program);
        command
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        remove_namespaces(&self.prefix);
        live().prefixes.remove(&self.prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qdisc(ns: &str, dev: &str) -> String {
        let output = Command::new("ip")
            .args(["netns", "exec", ns, "tc", "qdisc", "show", "dev", dev])
            .output()
            .expect("tc runs inside the namespace");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Privileged: makes real namespaces (CI runs as root).
    #[test]
    fn nodes_are_made_rate_limited_and_removed_also_when_stale() {
        if !crate::is_root() {
            eprintln!("SKIPPED: pretend nodes need root (network namespaces)");
            return;
        }
        let prefix = "rwtopotest";
        // A leftover of a killed run is removed at the next start.
        ip(&["netns", "add", &format!("{prefix}-n7")]).expect("ip netns add works as root");
        let topology = Topology::create(prefix, 2, 300).expect("pretend nodes are created");
        let mut names = namespaces_with_prefix(prefix);
        names.sort();
        assert_eq!(
            names,
            [
                format!("{prefix}-n0"),
                format!("{prefix}-n1"),
                format!("{prefix}-sw")
            ]
        );
        for (ns, dev) in [(topology.namespace(1), "rwn1"), (topology.switch(), "rws1")] {
            let shown = qdisc(&ns, dev);
            assert!(
                shown.contains("tbf") && shown.contains("300Mbit"),
                "{ns} {dev}: {shown}"
            );
        }
        // Node 0 reaches node 1 through its veth (the transfer itself is
        // measured by `cargo xtask bench tuning-grid`, with collbench).
        let route = Command::new("ip")
            .args([
                "netns",
                "exec",
                &topology.namespace(0),
                "ip",
                "route",
                "get",
            ])
            .arg(topology.address(1))
            .output()
            .expect("ip runs inside the namespace");
        let route = String::from_utf8_lossy(&route.stdout);
        assert!(route.contains("dev rwn0"), "{route}");
        drop(topology);
        assert!(namespaces_with_prefix(prefix).is_empty());
    }
}
