//! Pretend nodes on this machine: two network namespaces joined by a
//! rate-limited veth link (10.78.0.1 and 10.78.0.2), removed on drop.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command};

use test_support::ip;

/// The pretend nodes: two namespaces and the veth link between them.
pub struct Nodes {
    prefix: String,
}

impl Nodes {
    pub fn create() -> Self {
        // Unique per process and per call: tests of one binary run at once.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
        let prefix = format!("rwc{}{n}", std::process::id() % 100_000);
        let nodes = Self { prefix };
        for node in 0..2 {
            ip(&["netns", "add", &nodes.ns(node)]);
            ip(&["-n", &nodes.ns(node), "link", "set", "lo", "up"]);
        }
        let (a, b) = (format!("{}a", nodes.prefix), format!("{}b", nodes.prefix));
        ip(&[
            "link",
            "add",
            &a,
            "netns",
            &nodes.ns(0),
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            &nodes.ns(1),
        ]);
        for (node, dev) in [(0, &a), (1, &b)] {
            let ns = nodes.ns(node);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(node)),
                "dev",
                dev,
            ]);
            ip(&["-n", &ns, "link", "set", dev, "up"]);
            // Scarce bandwidth between nodes, as in a cluster.
            let status = Command::new("ip")
                .args([
                    "netns", "exec", &ns, "tc", "qdisc", "add", "dev", dev, "root",
                ])
                .args(["tbf", "rate", "2000mbit", "burst", "1mb", "latency", "50ms"])
                .status()
                .unwrap();
            assert!(status.success(), "tc in {ns}");
        }
        nodes
    }

    pub fn ns(&self, node: usize) -> String {
        format!("{}-n{node}", self.prefix)
    }

    /// Node `node`'s end of the veth link.
    pub fn dev(&self, node: usize) -> String {
        format!("{}{}", self.prefix, if node == 0 { "a" } else { "b" })
    }

    pub fn addr(node: usize) -> String {
        format!("10.78.0.{}", node + 1)
    }

    pub fn host(node: usize) -> String {
        format!("rw-node-{node}")
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for node in 0..2 {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(node)])
                .status();
        }
    }
}

/// The job's ranks (or launchers), killed on drop with their children.
pub struct Ranks(pub Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            // A launcher's ranks first (torchrun's would outlive it).
            for pid in super::procs::children_of(child.id()) {
                // SAFETY: kill has no memory preconditions; the pid is our grandchild.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
