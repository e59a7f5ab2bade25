//! `--keys-at-head`: which keys each server heads, so that a connection sends only those and no
//! request is forwarded between nodes — the chain's cost without the forwarding hop. Learnt once,
//! before the run, from each server's `cluster status` (its node id and its partition map); a view
//! change during the run is not followed (the requests are then forwarded, as without the flag).

use mqstate_cli::cluster;
use mqstate_cli::connection::ConnectionArgs;
use mqstate_cli::error::CliError;
use mqstate_cluster::admin::AdminCall;
use mqstate_cluster::partition::partition_of;
use mqstate_cluster::Status;

/// Picks of a key a connection makes at most before it takes one its server does not head (the
/// chooser cannot be asked for a key of a given partition; with three heads a pick hits one in
/// three times, so this bound is practically never reached).
pub const MAX_PICKS: usize = 64;

/// Per server (in `--servers` order, or the one of `--port`), the partitions it heads.
pub struct Heads {
    partition_count: u32,
    headed: Vec<Vec<bool>>,
}

impl Heads {
    /// Asks each server for its status.
    pub async fn learn(servers: &[ConnectionArgs]) -> Result<Heads, CliError> {
        let mut statuses = Vec::with_capacity(servers.len());
        for conn in servers {
            let reply = cluster::call(conn, "cluster status", &AdminCall::Status).await?;
            let status = reply.status.ok_or_else(|| {
                CliError::usage("--keys-at-head", "a server answered its status without one")
            })?;
            statuses.push(status);
        }
        Heads::from_statuses(&statuses)
    }

    fn from_statuses(statuses: &[Status]) -> Result<Heads, CliError> {
        let partition_count = statuses.first().map_or(0, |s| s.partition_count);
        if partition_count == 0
            || statuses
                .iter()
                .any(|s| s.partition_count != partition_count)
        {
            return Err(CliError::usage(
                "--keys-at-head",
                "the servers are not one formed cluster (no partition map, or different ones)",
            ));
        }
        let headed: Vec<Vec<bool>> = statuses
            .iter()
            .map(|status| {
                let mut headed = vec![false; partition_count as usize];
                for p in &status.partitions {
                    // The head as the replicas order the chain: its first readable member.
                    let head = p.chain.iter().find(|n| p.read_view.contains(n));
                    if let Some(slot) = headed.get_mut(p.id as usize) {
                        *slot = head == Some(&status.node_id);
                    }
                }
                headed
            })
            .collect();
        if let Some(i) = headed.iter().position(|h| !h.contains(&true)) {
            return Err(CliError::usage(
                "--keys-at-head",
                format!("server {} heads no partition", i + 1),
            ));
        }
        Ok(Heads {
            partition_count,
            headed,
        })
    }

    /// Whether `server` heads `key`'s partition.
    pub fn heads(&self, server: usize, key: &[u8]) -> bool {
        let p = partition_of(key, self.partition_count) as usize;
        self.headed
            .get(server)
            .and_then(|h| h.get(p))
            .copied()
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_cluster::status::PartitionStatus;

    fn status(node_id: u64, chains: &[&[u64]]) -> Status {
        Status {
            node_id,
            leader: Some(1),
            term: 1,
            applied_index: Some(1),
            members: Vec::new(),
            partition_count: chains.len() as u32,
            replication_factor: 3,
            partitions: chains
                .iter()
                .enumerate()
                .map(|(id, chain)| PartitionStatus {
                    id: id as u32,
                    chain: chain.to_vec(),
                    view: 1,
                    read_view: chain.to_vec(),
                    write_view: chain.to_vec(),
                    pending: false,
                })
                .collect(),
        }
    }

    #[test]
    fn each_server_heads_the_keys_of_its_partitions_only() {
        let chains: &[&[u64]] = &[&[1, 2, 3], &[2, 3, 1], &[3, 1, 2], &[1, 2, 3]];
        let statuses = [status(1, chains), status(2, chains), status(3, chains)];
        let heads = Heads::from_statuses(&statuses).unwrap();
        for i in 0..200u64 {
            let key = format!("bench:{i:010}");
            let p = partition_of(key.as_bytes(), 4) as usize;
            let owners: Vec<usize> = (0..3).filter(|&s| heads.heads(s, key.as_bytes())).collect();
            assert_eq!(owners, vec![chains[p][0] as usize - 1], "key {key}");
        }
    }

    #[test]
    fn a_member_catching_up_is_not_the_head() {
        // Partition 0: node 1 first in the chain but still catching up (not in the read view).
        let chains: &[&[u64]] = &[&[1, 2, 3], &[1, 2, 3]];
        let catching_up = |node_id| {
            let mut s = status(node_id, chains);
            s.partitions[0].read_view = vec![2, 3];
            s
        };
        let heads = Heads::from_statuses(&[catching_up(1), catching_up(2)]).unwrap();
        let key_of = |p: u32| {
            (0u64..)
                .map(|i| format!("k{i}"))
                .find(|k| partition_of(k.as_bytes(), 2) == p)
                .unwrap()
        };
        let (k0, k1) = (key_of(0), key_of(1));
        assert!(!heads.heads(0, k0.as_bytes()));
        assert!(heads.heads(1, k0.as_bytes()));
        assert!(heads.heads(0, k1.as_bytes()));
        assert!(!heads.heads(1, k1.as_bytes()));
    }

    #[test]
    fn servers_without_a_map_or_a_partition_are_refused() {
        assert!(Heads::from_statuses(&[status(1, &[])]).is_err());
        let chains: &[&[u64]] = &[&[1, 2, 3]];
        assert!(Heads::from_statuses(&[status(1, chains), status(2, chains)]).is_err());
    }
}
