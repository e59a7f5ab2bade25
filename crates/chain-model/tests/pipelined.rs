//! The pipelined chain write of decision 0043, checked exhaustively with stateright for
//! linearizability: what `tests/model.rs` does for the view change, this does for the write path
//! as `crates/chain/src/replica.rs` runs it now.
//!
//! Modelled: one partition on a chain of 2 or 3 replicas (head first) holding two keys; clients
//! that send each operation to the head; several writes in flight at once (one per key); each
//! replica's memory and disk apart, with the fsync a step of its own (`Sync`: everything written
//! so far becomes durable, as a group commit does). The rules of the pipelined protocol:
//!
//! * the head stamps a write with the next version of the node's clock (an HLC, which a restart
//!   resumes above every version handed out) and forwards it at once, in parallel with its fsync;
//!   each middle replica does the same when the prepare arrives;
//! * the tail holds the row committed (never locked) and sends the commit back once the row is
//!   durable there; a commit passes a replica once the row is durable there too (a commit that
//!   arrives first waits for the fsync); at the head it answers the client — so an answered write
//!   is durable everywhere;
//! * one write per key at a time at the head, reads and writes of a busy key (locked, in flight,
//!   or not yet durable at the head) wait (Flush2pc);
//! * a replica crashes with power loss (its unsynced rows are lost, as are its requests and
//!   their clients' answers) and restarts in the same chain: it re-advances its locked rows and
//!   asks its successor for its rows (`Resync`), which answers with every row it holds (`Ahead`,
//!   then `Synced`); a successor answers a stale prepare with its later row (`Ahead`) too; a
//!   replica takes a later row locked and rolls it forward, and a write the head had started at
//!   a lower version is superseded (its client's driver executes it again on the new row).
//!
//! Messages are delivered in any order; none is lost (a crashed replica's messages that were
//! waiting for its fsync are, with the rows). Not modelled here: view changes and the recovery
//! copy (`tests/model.rs` has the view change, on the same write rules without pipelining),
//! conditional writes, more than one crash.
//!
//! The broken variant — a replica passing a commit on before its own fsync — must be rejected:
//! the head answers a write its own disk does not hold, crashes, and reads the older value.

mod common;

use std::collections::BTreeSet;

use common::{Clients, Op, Row, KEYS};
use stateright::semantics::register::RegisterRet;
use stateright::{Checker, Model, Property};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Item {
    /// Phase 1, predecessor → successor.
    Prepare { key: usize, value: u8, version: u8 },
    /// Phase 2, successor → predecessor.
    Commit { key: usize, version: u8 },
    /// Successor → predecessor: its later row of `key`.
    Ahead { key: usize, value: u8, version: u8 },
    /// A restarted replica asks its successor for its rows.
    Resync,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Message {
    to: usize,
    item: Item,
}

/// What a row waits for before its next step: it is in memory, not yet durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Unsynced {
    /// The tail's commit (or a chain of one's answer), once durable.
    advance: bool,
    /// A commit from the successor that arrived first.
    commit: Option<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Replica {
    rows: [Row; KEYS],
    disk: [Row; KEYS],
    unsynced: [Option<Unsynced>; KEYS],
    /// Client requests that reached the head and wait for it to act on them.
    inbox: BTreeSet<(usize, Op)>,
    /// Writes this head started, waiting for their commit: (client, key, value, version).
    inflight: BTreeSet<(usize, usize, u8, u8)>,
    crashed: bool,
}

#[derive(Clone, Debug, PartialEq, Hash)]
struct State {
    replicas: Vec<Replica>,
    network: BTreeSet<Message>,
    /// The head's clock (HLC): every version it stamps is above every earlier one.
    clock: u8,
    clients: Clients,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Invoke(usize),
    /// The head takes a request whose key is not busy.
    Handle(usize, Op),
    Deliver(Message),
    /// A replica's fsync completes.
    Sync(usize),
    /// Power loss and restart of a replica.
    Crash(usize),
    /// A replica re-advances a locked row (after a restart, as its resend timer does).
    Resend(usize, usize),
}

struct Pipelined {
    replicas: usize,
    scripts: Vec<Vec<Op>>,
    crashes: usize,
    /// The broken variant: commits pass a replica before its own fsync.
    commit_before_fsync: bool,
}

impl State {
    fn is_tail(&self, r: usize) -> bool {
        r + 1 == self.replicas.len()
    }

    fn send(&mut self, to: usize, item: Item) {
        self.network.insert(Message { to, item });
    }

    fn busy_at_head(&self, key: usize) -> bool {
        let head = &self.replicas[0];
        head.rows[key].locked
            || head.unsynced[key].is_some()
            || head.inflight.iter().any(|w| w.1 == key)
    }

    /// A row written in memory; durable at the next `Sync`.
    fn hold(&mut self, r: usize, key: usize, row: Row) {
        self.replicas[r].rows[key] = row;
        self.replicas[r].unsynced[key] = Some(Unsynced::default());
    }

    /// Passes `key`'s row on: a non-tail forwards it at once; the tail commits once durable.
    fn advance(&mut self, r: usize, key: usize, commit_before_fsync: bool) {
        let row = self.replicas[r].rows[key];
        if !self.is_tail(r) {
            self.send(
                r + 1,
                Item::Prepare {
                    key,
                    value: row.value,
                    version: row.version,
                },
            );
            return;
        }
        if let Some(u) = self.replicas[r].unsynced[key].as_mut() {
            if !commit_before_fsync {
                u.advance = true;
                return;
            }
        }
        self.replicas[r].rows[key].locked = false;
        if r == 0 {
            self.complete(key, row.version);
        } else {
            self.send(
                r - 1,
                Item::Commit {
                    key,
                    version: row.version,
                },
            );
        }
    }

    fn on_commit(&mut self, r: usize, key: usize, version: u8, commit_before_fsync: bool) {
        if self.replicas[r].rows[key].version != version {
            return; // lost in a crash before the fsync: the resync brings it
        }
        if let Some(u) = self.replicas[r].unsynced[key].as_mut() {
            if !commit_before_fsync {
                u.commit = Some(version);
                return;
            }
        }
        self.replicas[r].rows[key].locked = false;
        if r == 0 {
            self.complete(key, version);
        } else {
            self.send(r - 1, Item::Commit { key, version });
        }
    }

    /// At the head: the write of `key` at `version` committed; its client is answered.
    fn complete(&mut self, key: usize, version: u8) {
        let done: Vec<_> = self.replicas[0]
            .inflight
            .iter()
            .filter(|w| w.1 == key && w.3 == version)
            .copied()
            .collect();
        for w in done {
            self.replicas[0].inflight.remove(&w);
            self.clients.reply(w.0, key, RegisterRet::WriteOk);
        }
    }

    fn on_ahead(&mut self, r: usize, key: usize, value: u8, version: u8, broken: bool) {
        if self.replicas[r].rows[key].version >= version {
            return;
        }
        if r == 0 {
            // A write started at a lower version is superseded, never executed: its driver
            // executes it again on the later row.
            let stale: Vec<_> = self.replicas[0]
                .inflight
                .iter()
                .filter(|w| w.1 == key && w.3 < version)
                .copied()
                .collect();
            for w in stale {
                self.replicas[0].inflight.remove(&w);
                self.replicas[0].inbox.insert((w.0, Op::Write(key, w.2)));
            }
        }
        self.hold(
            r,
            key,
            Row {
                value,
                version,
                locked: true,
            },
        );
        self.advance(r, key, broken);
    }

    fn sync(&mut self, r: usize, broken: bool) {
        let replica = &mut self.replicas[r];
        replica.disk = replica.rows;
        let pending = std::mem::take(&mut replica.unsynced);
        for (key, u) in pending.iter().enumerate() {
            let Some(u) = u else { continue };
            let version = self.replicas[r].rows[key].version;
            match u.commit {
                Some(v) if v == version => self.on_commit(r, key, v, broken),
                _ if u.advance => self.advance(r, key, broken),
                _ => {}
            }
        }
    }
}

impl Model for Pipelined {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let replica = Replica {
            rows: [Row::default(); KEYS],
            disk: [Row::default(); KEYS],
            unsynced: [None; KEYS],
            inbox: BTreeSet::new(),
            inflight: BTreeSet::new(),
            crashed: false,
        };
        vec![State {
            replicas: vec![replica; self.replicas],
            network: BTreeSet::new(),
            clock: 0,
            clients: Clients::new(&self.scripts),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        actions.extend(state.clients.ready(&self.scripts).map(Action::Invoke));
        for &(c, op) in &state.replicas[0].inbox {
            if !state.busy_at_head(op.key()) {
                actions.push(Action::Handle(c, op));
            }
        }
        for m in &state.network {
            actions.push(Action::Deliver(*m));
        }
        let crashes = state.replicas.iter().filter(|r| r.crashed).count();
        for (r, replica) in state.replicas.iter().enumerate() {
            if replica.unsynced.iter().any(Option::is_some) {
                actions.push(Action::Sync(r));
            }
            if crashes < self.crashes {
                actions.push(Action::Crash(r));
            }
            if crashes > 0 {
                for (key, row) in replica.rows.iter().enumerate() {
                    if row.locked && replica.unsynced[key].is_none() {
                        actions.push(Action::Resend(r, key));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let broken = self.commit_before_fsync;
        let mut s = last.clone();
        match action {
            Action::Invoke(c) => {
                let op = s.clients.invoke(&self.scripts, c);
                s.replicas[0].inbox.insert((c, op));
            }
            Action::Handle(c, op) => {
                s.replicas[0].inbox.remove(&(c, op));
                match op {
                    Op::Read(key) => {
                        let value = s.replicas[0].rows[key].value;
                        s.clients.reply(c, key, RegisterRet::ReadOk(value));
                    }
                    Op::Write(key, value) => {
                        s.clock += 1;
                        let version = s.clock;
                        s.replicas[0].inflight.insert((c, key, value, version));
                        let locked = !s.is_tail(0);
                        s.hold(
                            0,
                            key,
                            Row {
                                value,
                                version,
                                locked,
                            },
                        );
                        s.advance(0, key, broken);
                    }
                }
            }
            Action::Deliver(m) => {
                s.network.remove(&m);
                let r = m.to;
                match m.item {
                    Item::Prepare {
                        key,
                        value,
                        version,
                    } => {
                        let row = s.replicas[r].rows[key];
                        if row.version > version {
                            let ahead = Item::Ahead {
                                key,
                                value: row.value,
                                version: row.version,
                            };
                            s.send(r - 1, ahead);
                        } else if row.version == version {
                            s.advance(r, key, broken);
                        } else {
                            let locked = !s.is_tail(r);
                            s.hold(
                                r,
                                key,
                                Row {
                                    value,
                                    version,
                                    locked,
                                },
                            );
                            s.advance(r, key, broken);
                        }
                    }
                    Item::Commit { key, version } => s.on_commit(r, key, version, broken),
                    Item::Ahead {
                        key,
                        value,
                        version,
                    } => s.on_ahead(r, key, value, version, broken),
                    Item::Resync => {
                        for key in 0..KEYS {
                            let row = s.replicas[r].rows[key];
                            if row.version > 0 {
                                let ahead = Item::Ahead {
                                    key,
                                    value: row.value,
                                    version: row.version,
                                };
                                s.send(r - 1, ahead);
                            }
                        }
                    }
                }
            }
            Action::Sync(r) => s.sync(r, broken),
            Action::Crash(r) => {
                let replica = &mut s.replicas[r];
                replica.crashed = true;
                replica.rows = replica.disk;
                replica.unsynced = [None; KEYS];
                // Requests and their answers were in the process: their clients never hear back.
                replica.inbox.clear();
                replica.inflight.clear();
                if !s.is_tail(r) {
                    s.send(r + 1, Item::Resync);
                }
            }
            Action::Resend(r, key) => s.advance(r, key, broken),
        }
        if s == *last {
            return None;
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("linearizable", |_, s: &State| s.clients.linearizable()),
            Property::sometimes("every operation answered", |model: &Self, s: &State| {
                s.clients.finished(&model.scripts)
            }),
        ]
    }
}

/// A write of each key in flight at once, and a read of each racing them.
fn two_keys_in_flight() -> Vec<Vec<Op>> {
    vec![
        vec![Op::Write(0, 1), Op::Read(1)],
        vec![Op::Write(1, 2)],
        vec![Op::Read(0)],
    ]
}

/// Two writes of one key behind each other and a read racing them (smaller, for three replicas).
fn one_key_twice() -> Vec<Vec<Op>> {
    vec![vec![Op::Write(0, 1), Op::Write(0, 2)], vec![Op::Read(0)]]
}

fn check(model: Pipelined) -> impl Checker<Pipelined> {
    model.checker().threads(2).spawn_bfs().join()
}

fn exhaustive(replicas: usize, scripts: Vec<Vec<Op>>) {
    let started = std::time::Instant::now();
    let checker = check(Pipelined {
        replicas,
        scripts,
        crashes: 1,
        commit_before_fsync: false,
    });
    eprintln!(
        "pipelined chain model, {replicas} replicas: {} states ({} unique), every one checked, in {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        started.elapsed()
    );
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn pipelined_writes_on_two_replicas_are_linearizable_through_a_power_loss() {
    exhaustive(2, two_keys_in_flight());
}

#[test]
fn pipelined_writes_on_three_replicas_are_linearizable_through_a_power_loss() {
    exhaustive(3, one_key_twice());
}

#[test]
fn a_commit_passed_on_before_the_fsync_is_caught() {
    let checker = check(Pipelined {
        replicas: 2,
        scripts: vec![vec![Op::Write(0, 1)], vec![Op::Read(0)]],
        crashes: 1,
        commit_before_fsync: true,
    });
    let path = checker
        .discovery("linearizable")
        .expect("the checker finds a history that is not linearizable");
    eprintln!("counterexample: {:?}", path.into_actions());
}
