//! An exhaustive model of the chain protocol of `mqstate-chain` (docs/chain.md), checked with
//! stateright for linearizability (decision 0048).
//!
//! Modelled: three replicas of one partition (chain `[0, 1, 2]`) holding two keys; clients that
//! send each operation to the head of the view they last saw published; the chain write (the head
//! stamps the next version and holds the row locked, phase 1 head → tail with each replica
//! holding the row before it forwards, the tail committing at once, phase 2 tail → head unlocking,
//! the head answering `Written`); reads at the head, a locked row flushed first (Flush2pc: the read
//! waits for the write to commit); and one view change: any replica may fail (it stops for good —
//! its disk is fsynced before every forward, so a crash loses nothing that was forwarded), the
//! control plane publishes the chain without it, and each survivor adopts the new view at its own
//! step (a replica acts only under the view it holds; messages of another view are dropped).
//! Entering a view — and at any time after, as the driver's resend timer does — a replica
//! re-advances its locked rows: a tail commits them and sends the commit back, any other replica
//! re-sends the prepare. The network delivers messages in any order, and duplicates are
//! harmless (a set of messages; a resend of a message in flight is the same message).
//!
//! Not modelled: the recovery copy of a returning replica (no node rejoins), conditional writes
//! (`Expect`), the driver's batching, loss of an unsynced tail (fsync before each forward is the
//! rule the simulation in `crates/chain/tests/simulation.rs` checks against power loss).
//!
//! Each key's history must be linearizable against a register (stateright's
//! `LinearizabilityTester`; linearizability is local, so checking each key alone checks the
//! whole). A client whose request reached a replica that then failed never gets an answer: its
//! operation stays in flight and may or may not have taken effect.
//!
//! The broken variant (the head answering a read of a locked row at once with the new value,
//! without flushing it) must be rejected: the head answers a value that is only on its own disk,
//! fails, and the new head answers the older value.

mod common;

use std::collections::BTreeSet;

use common::{Clients, Op, Row, KEYS};
use stateright::semantics::register::RegisterRet;
use stateright::{Checker, Model, Property};

const REPLICAS: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Item {
    /// Phase 1, predecessor → successor.
    Prepare { key: usize, value: u8, version: u8 },
    /// Phase 2, successor → predecessor.
    Commit { key: usize, version: u8 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Message {
    view: u8,
    to: usize,
    item: Item,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Replica {
    alive: bool,
    /// The view this replica acts under (its index in `State::views`).
    view: u8,
    rows: [Row; KEYS],
    /// Client requests that reached this replica and wait for it to act on them as head.
    inbox: BTreeSet<(usize, Op)>,
    /// Writes this replica started as head, waiting for their commit: (client, key, version).
    waiting: BTreeSet<(usize, usize, u8)>,
}

#[derive(Clone, Debug, PartialEq, Hash)]
struct State {
    replicas: [Replica; REPLICAS],
    /// Published chains, head first; the last is the current one.
    views: Vec<Vec<usize>>,
    network: BTreeSet<Message>,
    clients: Clients,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// A client sends its next operation to the head of the current view.
    Invoke(usize),
    /// A replica acting as head takes a request from its inbox.
    Handle(usize, usize, Op),
    Deliver(Message),
    /// A replica re-advances a locked row (entering a view, or its resend timer).
    Repair(usize, usize),
    /// A replica fails; the control plane publishes the chain without it.
    Fail(usize),
    /// A survivor adopts the newest view.
    Adopt(usize),
}

struct ChainModel {
    scripts: Vec<Vec<Op>>,
    /// The broken variant: a read of a locked row is answered at once with its (uncommitted) value.
    read_without_flush: bool,
    /// How many replicas may fail (each failure is a view change).
    failures: usize,
}

impl State {
    fn chain(&self, r: usize) -> &[usize] {
        &self.views[self.replicas[r].view as usize]
    }

    fn position(&self, r: usize) -> Option<usize> {
        self.chain(r).iter().position(|&m| m == r)
    }

    fn successor(&self, r: usize) -> Option<usize> {
        let chain = self.chain(r);
        self.position(r).and_then(|i| chain.get(i + 1).copied())
    }

    fn predecessor(&self, r: usize) -> Option<usize> {
        let chain = self.chain(r);
        self.position(r)
            .and_then(|i| i.checked_sub(1))
            .map(|i| chain[i])
    }

    fn is_head(&self, r: usize) -> bool {
        self.position(r) == Some(0)
    }

    fn is_tail(&self, r: usize) -> bool {
        self.position(r).is_some() && self.successor(r).is_none()
    }

    fn send(&mut self, from: usize, to: usize, item: Item) {
        let view = self.replicas[from].view;
        self.network.insert(Message { view, to, item });
    }

    /// Unlocks `key` at version `version` at `r`; at the head, answers the write's client.
    fn committed(&mut self, r: usize, key: usize, version: u8) {
        let row = &mut self.replicas[r].rows[key];
        if row.version == version {
            row.locked = false;
        }
        if self.is_head(r) {
            let done: Vec<_> = self.replicas[r]
                .waiting
                .iter()
                .filter(|&&(_, k, v)| k == key && v == version)
                .copied()
                .collect();
            for entry in done {
                self.replicas[r].waiting.remove(&entry);
                self.clients.reply(entry.0, key, RegisterRet::WriteOk);
            }
        } else if let Some(p) = self.predecessor(r) {
            self.send(r, p, Item::Commit { key, version });
        }
    }

    /// Holds (key, value, version) at `r`, then commits it (tail) or passes it on.
    fn advance(&mut self, r: usize, key: usize, value: u8, version: u8) {
        if self.is_tail(r) {
            self.committed(r, key, version);
        } else if let Some(s) = self.successor(r) {
            self.send(
                r,
                s,
                Item::Prepare {
                    key,
                    value,
                    version,
                },
            );
        }
    }
}

impl Model for ChainModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let replica = Replica {
            alive: true,
            view: 0,
            rows: [Row::default(); KEYS],
            inbox: BTreeSet::new(),
            waiting: BTreeSet::new(),
        };
        vec![State {
            replicas: [replica.clone(), replica.clone(), replica],
            views: vec![(0..REPLICAS).collect()],
            network: BTreeSet::new(),
            clients: Clients::new(&self.scripts),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        actions.extend(state.clients.ready(&self.scripts).map(Action::Invoke));
        for (r, replica) in state.replicas.iter().enumerate() {
            if !replica.alive {
                continue;
            }
            if state.is_head(r) {
                for &(c, op) in &replica.inbox {
                    let row = replica.rows[op.key()];
                    // One write per key at a time; a read of a locked row waits for its flush.
                    if !row.locked || (self.read_without_flush && matches!(op, Op::Read(_))) {
                        actions.push(Action::Handle(r, c, op));
                    }
                }
            }
            // Without a failure no message is lost, so only a replica that entered a new view
            // re-advances its locked rows (the resend timer is the same step, taken any time).
            for (key, row) in replica.rows.iter().enumerate() {
                if row.locked && replica.view > 0 && state.position(r).is_some() {
                    actions.push(Action::Repair(r, key));
                }
            }
            if (replica.view as usize) < state.views.len() - 1 {
                actions.push(Action::Adopt(r));
            }
            let failed = state.replicas.iter().filter(|x| !x.alive).count();
            // The chain keeps at least one replica; a failure waits for the last change to settle.
            let settled = state
                .replicas
                .iter()
                .all(|x| !x.alive || x.view as usize == state.views.len() - 1);
            if failed < self.failures && settled {
                actions.push(Action::Fail(r));
            }
        }
        for m in &state.network {
            actions.push(Action::Deliver(*m));
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Invoke(c) => {
                let op = s.clients.invoke(&self.scripts, c);
                let head = *s.views.last()?.first()?;
                if s.replicas[head].alive {
                    s.replicas[head].inbox.insert((c, op));
                }
                // Sent to a replica that has failed: never answered, stays in flight.
            }
            Action::Handle(r, c, op) => {
                s.replicas[r].inbox.remove(&(c, op));
                match op {
                    Op::Read(key) => {
                        let value = s.replicas[r].rows[key].value;
                        s.clients.reply(c, key, RegisterRet::ReadOk(value));
                    }
                    Op::Write(key, value) => {
                        let version = s.replicas[r].rows[key].version + 1;
                        s.replicas[r].rows[key] = Row {
                            value,
                            version,
                            locked: true,
                        };
                        s.replicas[r].waiting.insert((c, key, version));
                        s.advance(r, key, value, version);
                    }
                }
            }
            Action::Deliver(m) => {
                s.network.remove(&m);
                let r = m.to;
                if !s.replicas[r].alive || s.replicas[r].view != m.view {
                    return Some(s);
                }
                match m.item {
                    Item::Prepare {
                        key,
                        value,
                        version,
                    } => {
                        let row = s.replicas[r].rows[key];
                        if version > row.version {
                            s.replicas[r].rows[key] = Row {
                                value,
                                version,
                                locked: true,
                            };
                        }
                        // Held already (a resend): passed on all the same, so it reaches the tail.
                        if version >= row.version {
                            s.advance(r, key, value, version);
                        }
                    }
                    Item::Commit { key, version } => s.committed(r, key, version),
                }
            }
            Action::Repair(r, key) => {
                let row = s.replicas[r].rows[key];
                s.advance(r, key, row.value, row.version);
            }
            Action::Fail(r) => {
                s.replicas[r].alive = false;
                s.replicas[r].inbox.clear();
                let chain: Vec<usize> = s
                    .views
                    .last()?
                    .iter()
                    .copied()
                    .filter(|&m| m != r)
                    .collect();
                if chain.is_empty() {
                    return None;
                }
                s.views.push(chain);
            }
            Action::Adopt(r) => {
                s.replicas[r].view = u8::try_from(s.views.len() - 1).ok()?;
                // Requests that reached a replica that is no longer head get no answer here.
                if !s.is_head(r) {
                    s.replicas[r].inbox.clear();
                }
            }
        }
        if s == *last {
            return None;
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("linearizable", |_, s: &State| s.clients.linearizable()),
            Property::sometimes("a write is answered", |_, s: &State| {
                s.clients.answered_and_idle()
            }),
        ]
    }
}

/// Two writers of key 0 racing at the head, a writer of key 1, reads of both keys.
fn writes_racing() -> Vec<Vec<Op>> {
    vec![
        vec![Op::Write(0, 1), Op::Read(1)],
        vec![Op::Write(0, 2)],
        vec![Op::Write(1, 3), Op::Read(0)],
    ]
}

/// Reads of key 0 by two clients while it is written (the history a head answering an
/// unflushed row breaks once it fails), and a write and read of key 1.
fn reads_racing_a_write() -> Vec<Vec<Op>> {
    vec![
        vec![Op::Write(0, 1)],
        vec![Op::Read(0), Op::Write(1, 2)],
        vec![Op::Read(0), Op::Read(1)],
    ]
}

fn check(model: ChainModel) -> impl Checker<ChainModel> {
    model.checker().threads(2).spawn_bfs().join()
}

fn exhaustive(name: &str, scripts: Vec<Vec<Op>>) {
    let checker = check(ChainModel {
        scripts,
        read_without_flush: false,
        failures: 1,
    });
    eprintln!(
        "chain model, {name}: {} states ({} unique), every one checked",
        checker.state_count(),
        checker.unique_state_count()
    );
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn writes_racing_at_the_head_are_linearizable_through_a_failure() {
    exhaustive("writes racing", writes_racing());
}

#[test]
fn reads_racing_a_write_are_linearizable_through_a_failure() {
    exhaustive("reads racing a write", reads_racing_a_write());
}

#[test]
fn a_head_answering_a_locked_row_without_flushing_is_caught() {
    let checker = check(ChainModel {
        scripts: reads_racing_a_write(),
        read_without_flush: true,
        failures: 1,
    });
    let path = checker
        .discovery("linearizable")
        .expect("the checker finds a history that is not linearizable");
    eprintln!("counterexample: {:?}", path.into_actions());
}
