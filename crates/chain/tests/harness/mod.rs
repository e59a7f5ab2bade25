//! A deterministic driver for replicas: an in-memory network (a bag of messages, delivered in any
//! order, droppable), a disk per node (appended batches, fsynced on command, unsynced ones lost at a
//! crash), and crash / restart from the durable records. The tests decide every step.

#![allow(dead_code)]

use std::collections::BTreeMap;

use mqstate_chain::{
    Answer, Config, Key, Message, NodeId, Output, Record, Replica, RequestId, Restored, Version,
    View,
};

/// SplitMix64: small, seedable, the same on every platform.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }
}

#[derive(Default)]
pub struct Disk {
    pub durable: Vec<Record>,
    /// The durable records folded: each key's version on disk.
    pub durable_versions: BTreeMap<Key, Version>,
    /// Appended, not yet fsynced: (batch index, records).
    pub pending: Vec<(u64, Vec<Record>)>,
}

pub struct Node {
    pub replica: Option<Replica>,
    pub disk: Disk,
    /// The highest version this node's log holds per key (reset by `Clear`): checks that a
    /// replica never writes a key's version backwards.
    pub versions: BTreeMap<Key, Version>,
}

pub struct Cluster {
    pub config: Config,
    pub nodes: BTreeMap<NodeId, Node>,
    /// Messages in flight: (to, message).
    pub net: Vec<(NodeId, Message)>,
    pub replies: Vec<(RequestId, Answer)>,
    pub caught_up: Vec<(NodeId, u64)>,
    pub delivered: u64,
    pub dropped: u64,
}

impl Cluster {
    pub fn new(ids: &[NodeId], config: Config) -> Cluster {
        let nodes = ids
            .iter()
            .map(|&id| {
                let node = Node {
                    replica: Some(Replica::new(id, config)),
                    disk: Disk::default(),
                    versions: BTreeMap::new(),
                };
                (id, node)
            })
            .collect();
        Cluster {
            config,
            nodes,
            net: Vec::new(),
            replies: Vec::new(),
            caught_up: Vec::new(),
            delivered: 0,
            dropped: 0,
        }
    }

    pub fn alive(&self, id: NodeId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.replica.is_some())
    }

    pub fn alive_ids(&self) -> Vec<NodeId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.replica.is_some())
            .map(|(&id, _)| id)
            .collect()
    }

    pub fn replica(&self, id: NodeId) -> &Replica {
        self.nodes[&id].replica.as_ref().expect("alive")
    }

    /// Runs `f` on a live replica and carries out its outputs.
    pub fn with<T>(&mut self, id: NodeId, f: impl FnOnce(&mut Replica) -> T) -> Option<T> {
        let node = self.nodes.get_mut(&id)?;
        let replica = node.replica.as_mut()?;
        let result = f(replica);
        self.pump(id);
        Some(result)
    }

    fn pump(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let Some(replica) = node.replica.as_mut() else {
            return;
        };
        for output in replica.take_outputs() {
            match output {
                Output::Persist { index, records } => {
                    for record in &records {
                        match record {
                            Record::Row { key, row } => {
                                let last = node.versions.entry(key.clone()).or_default();
                                assert!(
                                    row.version >= *last,
                                    "node {id} wrote {key:?} back from {last:?} to {:?}",
                                    row.version
                                );
                                *last = row.version;
                            }
                            Record::Clear { .. } => node.versions.clear(),
                            _ => {}
                        }
                    }
                    if let Some((last, _)) = node.disk.pending.last() {
                        assert!(index > *last, "batches are numbered in order");
                    }
                    node.disk.pending.push((index, records));
                }
                Output::Send { to, message } => self.net.push((to, message)),
                Output::Reply { request, answer } => self.replies.push((request, answer)),
                Output::CaughtUp { view } => self.caught_up.push((id, view)),
            }
        }
    }

    pub fn set_view(&mut self, id: NodeId, view: Option<View>) {
        self.with(id, |r| r.set_view(view));
    }

    /// Gives `view` to every live node (those outside its chain stop acting).
    pub fn publish(&mut self, view: &View) {
        for id in self.alive_ids() {
            self.set_view(id, Some(view.clone()));
        }
    }

    /// No live node acts (a view change is pending).
    pub fn pause(&mut self) {
        for id in self.alive_ids() {
            self.set_view(id, None);
        }
    }

    /// Delivers message `i` of the bag (to a dead node: lost).
    pub fn deliver(&mut self, i: usize) {
        let (to, message) = self.net.swap_remove(i);
        self.delivered += 1;
        self.with(to, |r| r.receive(message));
    }

    pub fn drop_message(&mut self, i: usize) {
        self.net.swap_remove(i);
        self.dropped += 1;
    }

    /// Delivers in order until the network is empty (or `limit` deliveries).
    pub fn deliver_all(&mut self, limit: usize) {
        for _ in 0..limit {
            if self.net.is_empty() {
                return;
            }
            self.deliver(0);
        }
    }

    /// Fsyncs `id`'s appended batches up to `upto` (all when `None`).
    pub fn sync(&mut self, id: NodeId, upto: Option<u64>) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        if node.replica.is_none() || node.disk.pending.is_empty() {
            return;
        }
        let mut last = None;
        let mut keep = Vec::new();
        for (index, records) in std::mem::take(&mut node.disk.pending) {
            if upto.is_none_or(|u| index <= u) && keep.is_empty() {
                for record in &records {
                    match record {
                        Record::Row { key, row } => {
                            node.disk.durable_versions.insert(key.clone(), row.version);
                        }
                        Record::Clear { .. } => node.disk.durable_versions.clear(),
                        _ => {}
                    }
                }
                node.disk.durable.extend(records);
                last = Some(index);
            } else {
                keep.push((index, records));
            }
        }
        node.disk.pending = keep;
        if let Some(index) = last {
            self.with(id, |r| r.durable(index));
        }
    }

    pub fn sync_all(&mut self) {
        for id in self.alive_ids() {
            self.sync(id, None);
        }
    }

    pub fn tick_all(&mut self) {
        for id in self.alive_ids() {
            self.with(id, |r| r.tick());
        }
    }

    /// Until nothing moves: fsync everything, deliver everything, tick.
    pub fn settle(&mut self, rounds: usize) {
        for _ in 0..rounds {
            for _ in 0..50 {
                self.sync_all();
                if self.net.is_empty() {
                    break;
                }
                self.deliver_all(100_000);
            }
            let quiet = self.alive_ids().iter().all(|&id| {
                let replica = self.replica(id);
                replica.is_quiet() || replica.view().is_none()
            });
            if quiet && self.net.is_empty() {
                return;
            }
            self.tick_all();
        }
    }

    /// Kill -9 with power loss: memory and unsynced batches are gone.
    pub fn crash(&mut self, id: NodeId) {
        if let Some(node) = self.nodes.get_mut(&id) {
            node.replica = None;
            node.disk.pending.clear();
        }
    }

    /// Every live replica's image is what its log (durable and pending batches) folds to: what a
    /// snapshot of the log may stand for.
    pub fn assert_images_are_their_logs(&self) {
        for (id, node) in &self.nodes {
            let Some(replica) = &node.replica else {
                continue;
            };
            let mut folded = Restored::default();
            let pending = node.disk.pending.iter().flat_map(|(_, records)| records);
            for record in node.disk.durable.iter().chain(pending).cloned() {
                folded.apply(record);
            }
            assert_eq!(replica.image(), folded, "node {id}'s image is not its log");
        }
    }

    /// Starts `id` again from its durable records, acting under no view yet.
    pub fn restart(&mut self, id: NodeId) {
        let config = self.config;
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let mut restored = Restored::default();
        for record in node.disk.durable.iter().cloned() {
            restored.apply(record);
        }
        node.versions = restored
            .rows
            .iter()
            .map(|(k, r)| (k.clone(), r.version))
            .collect();
        node.replica = Some(Replica::restore(id, config, restored));
    }

    /// Takes the answer to `request`, if it came.
    pub fn answer(&mut self, request: RequestId) -> Option<Answer> {
        let at = self.replies.iter().position(|(r, _)| *r == request)?;
        Some(self.replies.remove(at).1)
    }
}

pub fn view(id: u64, chain: &[NodeId], read_view: &[NodeId]) -> View {
    View {
        id,
        chain: chain.to_vec(),
        read_view: read_view.to_vec(),
    }
}

pub fn version(wall_ms: u64) -> Version {
    Version {
        wall_ms,
        counter: 0,
        node: 0,
    }
}
