//! Loss and delay between nodes (the faults `loss` and `slow_link`). This kernel has no
//! `sch_netem`, so random loss is an nftables rule (`numgen random mod 100 < N drop`) and a slow
//! link a token-bucket qdisc (`tbf`: a rate below what the node sends in a burst makes packets
//! queue, up to `latency`, and drops beyond it). Both live inside a node's own namespace only, so
//! they go with it when the namespaces are removed, and `unshape` clears them after each fault and
//! before each run.

use anyhow::Context;

use super::{quiet, run, Net};

/// The nftables table of the loss rules in a node's namespace.
const TABLE: &str = "mqrfault";

impl Net {
    fn in_ns(&self, node: usize, command: &[&str]) -> anyhow::Result<()> {
        let ns = self.ns(node);
        let mut args = vec!["ip", "netns", "exec", &ns];
        args.extend_from_slice(command);
        run(&args)
    }

    /// Drops `percent` % of the packets between node `node` and each of `others`, both ways (an
    /// output and an input rule in `node`'s namespace). Clients, which reach the node from the
    /// bridge's address, are not affected.
    pub fn lose(&mut self, node: usize, others: &[usize], percent: u32) -> anyhow::Result<()> {
        let peers = others
            .iter()
            .map(|&o| self.ip(o).to_string())
            .collect::<Vec<_>>()
            .join(", ");
        self.in_ns(node, &["nft", "add", "table", "inet", TABLE])?;
        for (chain, hook, field) in [("out", "output", "daddr"), ("in", "input", "saddr")] {
            let create = format!(
                "add chain inet {TABLE} {chain} {{ type filter hook {hook} priority 0; policy accept; }}"
            );
            let rule = format!(
                "add rule inet {TABLE} {chain} ip {field} {{ {peers} }} numgen random mod 100 < {percent} drop"
            );
            self.in_ns(node, &["nft", &create])
                .and_then(|()| self.in_ns(node, &["nft", &rule]))
                .with_context(|| format!("packet loss on node {}", node + 1))?;
        }
        Ok(())
    }

    /// Limits what node `node` sends (to its peers and its clients) to `rate_kbit` with a queue of
    /// at most `latency_ms`: a slow link whose queueing delay grows with the traffic.
    pub fn slow(&mut self, node: usize, rate_kbit: u32, latency_ms: u32) -> anyhow::Result<()> {
        let rate = format!("{rate_kbit}kbit");
        let latency = format!("{latency_ms}ms");
        self.in_ns(
            node,
            &[
                "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &rate, "burst",
                "16kbit", "latency", &latency,
            ],
        )
        .with_context(|| format!("slowing node {}'s link", node + 1))
    }

    /// Removes every loss rule and rate limit (errors ignored: most nodes have none).
    pub fn unshape(&self) {
        for node in 0..self.nodes {
            let ns = self.ns(node);
            quiet(&[
                "ip", "netns", "exec", &ns, "nft", "delete", "table", "inet", TABLE,
            ]);
            quiet(&[
                "ip", "netns", "exec", &ns, "tc", "qdisc", "del", "dev", "eth0", "root",
            ]);
        }
    }
}
