//! One replica of one partition: the whole protocol as a state machine. Inputs are the driver's
//! calls ([`Replica::write`], [`Replica::read`], [`Replica::receive`], [`Replica::durable`],
//! [`Replica::set_view`], [`Replica::tick`]); outputs are collected and handed over by
//! [`Replica::take_outputs`]. No clock, no I/O: the same code runs in a node and in the simulation.
//!
//! The rules, each in one place:
//!
//! * A row is *advanced* ([`Replica::advance`]): a non-tail forwards it (phase 1) to its successor
//!   at once, in parallel with its own fsync (decision 0043); the tail — which commits at once and
//!   never holds a lock bit — sends the commit (phase 2) to its predecessor once the row is durable
//!   here, or, when it is also the head, completes it.
//! * A commit from the successor unlocks the row and goes on to the predecessor once the row is
//!   durable here too (a commit that arrives first is remembered and acted on in
//!   [`Replica::durable`]); at the head it completes the write: the client is answered, then the
//!   key's next waiting request runs. So an answered write is durable on every replica.
//! * A predecessor that lost a row in a crash before its fsync can be behind its successor: a
//!   replica restarted from its log asks its successor for its rows (`Resync`, until `Synced`),
//!   and a successor answers a stale prepare with its later row (`Ahead`); the predecessor takes a
//!   later row and rolls it forward.
//! * Per key, one write at a time: requests wait at the head while the row is locked (or not yet
//!   durable there). A read of a locked row waits for the write to complete (Flush2pc).
//! * Roll-forward only: on entering a view every locked row goes onto the repair queue and is
//!   advanced again under the new chain; a locked row is also re-advanced on ticks until it commits,
//!   so lost, duplicated and reordered messages only cost time. Duplicates are harmless because
//!   every step is keyed by (key, version) and versions of a key only grow.
//! * A note ([`Replica::note`]) travels like a row and changes none: each replica persists it,
//!   forwards it before its fsync, and acknowledges it to its predecessor once it is durable here
//!   and the successor acknowledged it (the tail: once durable); the head answers `Noted` then.
//!   A note is named by its bytes (the same bytes are the same note). Unacknowledged notes are
//!   re-sent on ticks and on entering a view, like locked rows; they are not kept across a
//!   restart (nobody waits for them there: the head answers only after the acknowledgement).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound;

use crate::message::{Answer, CopiedRow, Expect, Item, Message, Output, Write};
use crate::types::{Key, NodeId, Record, RequestId, Restored, Row, View};

/// Tuning of a replica; the defaults suit a driver that ticks every 100 ms or so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Rows per recovery chunk.
    pub copy_batch: usize,
    /// Interrupted writes re-driven per tick (the rest wait in the repair queue, unless a read
    /// needs one first).
    pub repair_batch: usize,
    /// Ticks before an unanswered step (phase 1, a copy chunk) is sent again.
    pub resend_ticks: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            copy_batch: 256,
            repair_batch: 1024,
            resend_ticks: 3,
        }
    }
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages dropped because they were of another view (or arrived with no view held).
    pub rejected_messages: u64,
    /// Interrupted writes taken from the repair queue and driven again.
    pub repaired: u64,
    /// Reads (and writes) that found their row locked and pulled its repair forward (Flush2pc).
    pub flushes: u64,
}

enum Waiting {
    Read(RequestId),
    Write(RequestId, Write),
}

/// The head's recovery agent for one replica that is catching up.
#[derive(Debug, Default)]
struct Copy {
    /// Every key up to here was sent and acknowledged (`None`: nothing yet).
    cursor: Option<Key>,
    next_seq: u64,
    outstanding: Option<Chunk>,
    scan_done: bool,
    /// Keys the scan found locked: they reach the catching-up replica through the chain.
    deferred: BTreeSet<Key>,
    done_sent: Option<u64>,
    finished: bool,
}

#[derive(Debug)]
struct Chunk {
    seq: u64,
    next_cursor: Option<Key>,
    end: bool,
    sent_at: u64,
}

/// A row whose latest record is in a batch not yet durable.
#[derive(Debug, Clone, Copy)]
struct Unsynced {
    batch: u64,
    /// Advance once durable (the tail's commit; a non-tail has forwarded already).
    advance: bool,
    /// A commit from the successor that arrived before this row was durable here.
    commit: Option<crate::Version>,
}

/// A note on its way to the tail, at one replica.
#[derive(Debug)]
struct PendingNote {
    /// The batch that holds its record here.
    batch: u64,
    /// The successor (of this view) acknowledged it.
    acked: bool,
    /// Head: the requests to answer `Noted` (none for a note inherited from an earlier head).
    requests: Vec<RequestId>,
    last_sent: Option<u64>,
}

/// A send (and perhaps an output) held until a batch is durable.
struct AfterDurable {
    index: u64,
    view: u64,
    to: NodeId,
    item: Item,
    caught_up: bool,
}

pub struct Replica {
    id: NodeId,
    config: Config,
    /// The last view entered; acted under only while `acting`.
    view: Option<View>,
    acting: bool,
    rows: BTreeMap<Key, Row>,
    /// The keys of `rows` whose lock bit is set.
    locked: BTreeSet<Key>,
    joining_since: Option<u64>,
    caught_up_view: Option<u64>,
    /// Restarted from the log and not yet given its successor's rows: it may have lost rows it
    /// had forwarded before its fsync (decision 0043).
    resync: bool,
    /// When the last `Resync` was sent (its answer carries every row: not asked for every tick).
    resync_sent: Option<u64>,

    /// The batch being collected (`records`), numbered from 1.
    batch: u64,
    durable: u64,
    records: Vec<Record>,
    /// Rows whose latest value is in a batch not yet durable.
    unsynced: BTreeMap<Key, Unsynced>,
    /// The keys recorded in each batch not yet durable (an entry is stale when `unsynced` has the
    /// key at a later batch).
    by_batch: BTreeMap<u64, Vec<Key>>,
    after_durable: Vec<AfterDurable>,

    /// Head: requests waiting for their key.
    waiting: BTreeMap<Key, VecDeque<Waiting>>,
    /// Head: writes started and not yet complete, with the request to answer (`None` when the
    /// request is not known here: a write inherited from before a restart or a fail-over).
    inflight: BTreeMap<Key, Option<RequestId>>,
    repair: VecDeque<Key>,
    copies: BTreeMap<NodeId, Copy>,
    /// Notes persisted here and not yet acknowledged from the tail, by their bytes.
    notes: BTreeMap<Vec<u8>, PendingNote>,
    /// Head: notes held back while others are on their way, with the requests they answer; they
    /// go down together once `notes` is empty (one record batch and one message per hop for all).
    held: BTreeMap<Vec<u8>, Vec<RequestId>>,

    now: u64,
    /// When each locked row was last advanced (for resends).
    last_sent: BTreeMap<Key, u64>,
    outbox: BTreeMap<NodeId, Vec<Item>>,
    outputs: Vec<Output>,
    stats: Stats,
}

impl std::fmt::Debug for Replica {
    /// A summary: what is started and not finished.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("id", &self.id)
            .field("view", &self.view)
            .field("acting", &self.acting)
            .field("joining_since", &self.joining_since)
            .field("resync", &self.resync)
            .field("rows", &self.rows.len())
            .field("locked", &self.locked)
            .field("inflight", &self.inflight)
            .field("waiting", &self.waiting.keys().collect::<Vec<_>>())
            .field("repair", &self.repair)
            .field("unsynced", &self.unsynced)
            .field("copies", &self.copies)
            .field("notes", &self.notes.len())
            .field("held", &self.held.len())
            .finish()
    }
}

impl Replica {
    /// A replica with no data, on a node that never held this partition (nothing to resync; a
    /// node restarted with no records of it uses [`Replica::restore`]).
    pub fn new(id: NodeId, config: Config) -> Replica {
        Replica {
            resync: false,
            ..Replica::restore(id, config, Restored::default())
        }
    }

    /// A replica from its log's durable records. It acts again only once given a view.
    pub fn restore(id: NodeId, config: Config, restored: Restored) -> Replica {
        let locked = restored
            .rows
            .iter()
            .filter(|(_, row)| row.locked)
            .map(|(key, _)| key.clone())
            .collect();
        Replica {
            id,
            config,
            view: None,
            acting: false,
            rows: restored.rows,
            locked,
            joining_since: restored.joining_since,
            caught_up_view: restored.caught_up_view,
            resync: true,
            resync_sent: None,
            batch: 1,
            durable: 0,
            records: Vec::new(),
            unsynced: BTreeMap::new(),
            by_batch: BTreeMap::new(),
            after_durable: Vec::new(),
            waiting: BTreeMap::new(),
            inflight: BTreeMap::new(),
            repair: VecDeque::new(),
            copies: BTreeMap::new(),
            notes: BTreeMap::new(),
            held: BTreeMap::new(),
            now: 0,
            last_sent: BTreeMap::new(),
            outbox: BTreeMap::new(),
            outputs: Vec::new(),
            stats: Stats::default(),
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The view acted under, if any.
    pub fn view(&self) -> Option<&View> {
        if self.acting {
            self.view.as_ref()
        } else {
            None
        }
    }

    pub fn row(&self, key: &[u8]) -> Option<&Row> {
        self.rows.get(key)
    }

    pub fn rows(&self) -> &BTreeMap<Key, Row> {
        &self.rows
    }

    /// What every record this replica asked to persist folds to ([`Restored::apply`]): a snapshot
    /// of it stands for all of them, and [`Replica::restore`] from it is the replica a restart
    /// would rebuild from those records. Taken between inputs, once their outputs were taken.
    pub fn image(&self) -> Restored {
        debug_assert!(
            self.records.is_empty(),
            "an image is taken after take_outputs, not with records still to persist"
        );
        Restored {
            rows: self.rows.clone(),
            joining_since: self.joining_since,
            caught_up_view: self.caught_up_view,
        }
    }

    /// Catching up (re-entered at the tail, not yet in the read view).
    pub fn joining(&self) -> bool {
        self.joining_since.is_some()
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Nothing started and not finished here: no lock, no write in flight, nothing waiting, no
    /// copy or resync under way.
    pub fn is_quiet(&self) -> bool {
        !self.resync
            && self.locked.is_empty()
            && self.inflight.is_empty()
            && self.waiting.is_empty()
            && self.repair.is_empty()
            && self.unsynced.is_empty()
            && self.notes.is_empty()
            && self.held.is_empty()
            && self.copies.values().all(|c| c.finished)
    }

    // ---- inputs -------------------------------------------------------------------------------

    /// The view to act under, or `None` when this node may not act on the partition (no lease, a
    /// change pending, or not in the chain). Give it every time the control plane's answer changes.
    pub fn set_view(&mut self, view: Option<View>) {
        let Some(view) = view else {
            self.acting = false;
            return;
        };
        let view = view.readable_first();
        if let Some(current) = &self.view {
            debug_assert!(view.id >= current.id, "views never go back");
            if view.id < current.id || (self.acting && view.id == current.id) {
                return;
            }
        }
        if view.position(self.id).is_none() {
            // Out of the chain: whatever waited here goes to the head; nothing else is ours.
            self.release_requests(Answer::NotHead { head: view.head() });
            self.copies.clear();
            self.repair.clear();
            self.notes.clear();
            self.acting = false;
            self.view = Some(view);
            return;
        }
        self.enter(view);
    }

    /// A client's write, at the node that holds this replica.
    pub fn write(&mut self, request: RequestId, write: Write) {
        if let Err(answer) = self.serving() {
            self.reply(request, answer);
            return;
        }
        let key = write.key.clone();
        if self.busy(&key) || self.waiting.contains_key(&key) {
            self.waiting
                .entry(key.clone())
                .or_default()
                .push_back(Waiting::Write(request, write));
            self.flush(&key);
        } else {
            self.start_write(request, write);
        }
    }

    /// A note of the driver's, at the head: persisted on every replica of the chain, changing no
    /// row, then answered [`Answer::Noted`]. The same bytes noted twice are one note.
    ///
    /// While notes are on their way down the chain, a new one is held here and goes down with the
    /// others held when those come back: under contention (a lock's failed acquire attempts, each
    /// a note) one round trip, one fsync per replica and one message per hop serve many notes,
    /// where each turn's few would each pay them. A held note is only a request taken later; it
    /// is answered, as any note, once every replica holds it.
    pub fn note(&mut self, request: RequestId, note: Vec<u8>) {
        if let Err(answer) = self.serving() {
            self.reply(request, answer);
            return;
        }
        if let Some(pending) = self.notes.get_mut(&note) {
            pending.requests.push(request);
        } else if !self.notes.is_empty() || self.held.contains_key(&note) {
            self.held.entry(note).or_default().push(request);
        } else {
            self.persist_note(note, vec![request]);
        }
    }

    /// A client's read of `key` (linearizable: served by the head, after any write in flight).
    pub fn read(&mut self, request: RequestId, key: Key) {
        if let Err(answer) = self.serving() {
            self.reply(request, answer);
            return;
        }
        if self.busy(&key) || self.waiting.contains_key(&key) {
            self.waiting
                .entry(key.clone())
                .or_default()
                .push_back(Waiting::Read(request));
            self.flush(&key);
        } else {
            let answer = self.value_of(&key);
            self.reply(request, answer);
        }
    }

    /// Forgets a request still waiting for its key (its message expired). A write already started
    /// is not cancelled: it completes, unanswered.
    pub fn cancel(&mut self, request: RequestId) {
        for queue in self.waiting.values_mut() {
            queue.retain(|w| match w {
                Waiting::Read(r) | Waiting::Write(r, _) => *r != request,
            });
        }
        self.waiting.retain(|_, queue| !queue.is_empty());
        for pending in self.notes.values_mut() {
            pending.requests.retain(|r| *r != request);
        }
        // A held note nobody waits for is not sent: it was never answered.
        for requests in self.held.values_mut() {
            requests.retain(|r| *r != request);
        }
        self.held.retain(|_, requests| !requests.is_empty());
    }

    /// A message from a peer.
    pub fn receive(&mut self, message: Message) {
        let Some(view) = self.view() else {
            self.stats.rejected_messages += 1;
            return;
        };
        if message.view != view.id {
            self.stats.rejected_messages += 1;
            return;
        }
        let Some(pos) = view.position(self.id) else {
            return;
        };
        let from = message.from;
        let pred = pos.checked_sub(1).map(|p| view.chain[p]);
        let succ = view.chain.get(pos + 1).copied();
        let head = view.head();
        let is_head = pos == 0;
        for item in message.items {
            match item {
                Item::Prepare {
                    key,
                    value,
                    version,
                } if Some(from) == pred => self.on_prepare(key, value, version),
                Item::Commit { key, version } if Some(from) == succ => self.on_commit(key, version),
                Item::Copy { seq, rows } if Some(from) == head && self.joining() => {
                    self.on_copy(seq, rows)
                }
                Item::CopyAck { seq } if is_head => self.on_copy_ack(from, seq),
                Item::CopyDone if Some(from) == head && self.joining() => self.on_copy_done(),
                Item::CopyDoneAck if is_head => {
                    if let Some(copy) = self.copies.get_mut(&from) {
                        copy.finished = true;
                    }
                }
                Item::Ahead {
                    key,
                    value,
                    version,
                } if Some(from) == succ => self.on_ahead(key, value, version),
                Item::Resync if Some(from) == pred => self.on_resync(from),
                Item::Synced if Some(from) == succ => self.resync = false,
                Item::Note { note } if Some(from) == pred => self.on_note(note),
                Item::NoteAck { note } if Some(from) == succ => self.on_note_ack(note),
                _ => self.stats.rejected_messages += 1,
            }
        }
    }

    /// Every batch up to `index` is fsynced.
    pub fn durable(&mut self, index: u64) {
        debug_assert!(index < self.batch, "batch {index} was never handed out");
        if index <= self.durable {
            return;
        }
        self.durable = index;
        let later = self.by_batch.split_off(&(index + 1));
        let ready = std::mem::replace(&mut self.by_batch, later);
        for (batch, keys) in ready {
            for key in keys {
                if self.unsynced.get(&key).is_none_or(|u| u.batch != batch) {
                    continue;
                }
                let Some(synced) = self.unsynced.remove(&key) else {
                    continue;
                };
                let current = self.rows.get(&key).map(|row| row.version);
                match synced.commit {
                    Some(version) if Some(version) == current => self.on_commit(key, version),
                    _ if synced.advance => self.advance(&key),
                    _ => {}
                }
            }
        }
        let tail = self.is_tail();
        let done: Vec<Vec<u8>> = self
            .notes
            .iter()
            .filter(|(_, p)| p.batch <= index && (p.acked || tail))
            .map(|(note, _)| note.clone())
            .collect();
        for note in done {
            self.finish_note(note);
        }
        self.release_after_durable();
    }

    /// Time passes (the driver's timer): resend what is unanswered, drive repairs and copies.
    pub fn tick(&mut self) {
        self.now += 1;
        if !self.acting {
            return;
        }
        self.drive_resync();
        self.drive_repair();
        // Rows still in the repair queue wait for their turn (or for a read to flush them).
        let queued: BTreeSet<&Key> = self.repair.iter().collect();
        // A head's write whose row is not locked (started while the head was also the tail, then
        // the chain grew) is resent like a locked row until its commit comes back.
        let started: BTreeSet<&Key> = self.locked.iter().chain(self.inflight.keys()).collect();
        let stale: Vec<Key> = started
            .into_iter()
            .filter(|key| !queued.contains(key))
            .filter(|key| {
                self.last_sent
                    .get(*key)
                    .is_none_or(|&at| self.now.saturating_sub(at) >= self.config.resend_ticks)
            })
            .cloned()
            .collect();
        for key in stale {
            self.advance(&key);
        }
        let stale: Vec<Vec<u8>> = self
            .notes
            .iter()
            .filter(|(_, p)| {
                p.last_sent
                    .is_some_and(|at| self.now.saturating_sub(at) >= self.config.resend_ticks)
            })
            .map(|(note, _)| note.clone())
            .collect();
        for note in stale {
            self.advance_note(note);
        }
        self.drive_copies();
    }

    /// Everything to do since the last call: the batch to persist first, then sends, answers and
    /// notices.
    pub fn take_outputs(&mut self) -> Vec<Output> {
        let mut out = Vec::with_capacity(self.outputs.len() + self.outbox.len() + 1);
        if !self.records.is_empty() {
            out.push(Output::Persist {
                index: self.batch,
                records: std::mem::take(&mut self.records),
            });
            self.batch += 1;
        }
        if let Some(view) = self.view.as_ref().map(|v| v.id) {
            for (to, items) in std::mem::take(&mut self.outbox) {
                out.push(Output::Send {
                    to,
                    message: Message {
                        view,
                        from: self.id,
                        items,
                    },
                });
            }
        }
        out.append(&mut self.outputs);
        out
    }

    // ---- roles --------------------------------------------------------------------------------

    fn position(&self) -> Option<(usize, usize)> {
        let view = self.view()?;
        Some((view.position(self.id)?, view.chain.len()))
    }

    fn is_head(&self) -> bool {
        matches!(self.position(), Some((0, _)))
    }

    fn is_tail(&self) -> bool {
        matches!(self.position(), Some((p, l)) if p + 1 == l)
    }

    fn neighbour(&self, offset: isize) -> Option<NodeId> {
        let view = self.view()?;
        let pos = view.position(self.id)? as isize + offset;
        usize::try_from(pos)
            .ok()
            .and_then(|p| view.chain.get(p).copied())
    }

    /// Whether client requests may run here; the answer if not.
    fn serving(&self) -> Result<(), Answer> {
        let Some(view) = self.view() else {
            return Err(Answer::Unavailable);
        };
        if view.head() != Some(self.id) {
            return Err(Answer::NotHead { head: view.head() });
        }
        if !view.readable(self.id) {
            // Every replica that held the data is gone; this one holds only what reached it.
            return Err(Answer::Unavailable);
        }
        Ok(())
    }

    fn busy(&self, key: &[u8]) -> bool {
        self.inflight.contains_key(key)
            || self.locked.contains(key)
            || self.unsynced.contains_key(key)
    }

    // ---- the protocol -------------------------------------------------------------------------

    fn enter(&mut self, view: View) {
        let readable = view.readable(self.id);
        let head = view.head() == Some(self.id);
        let view_id = view.id;
        let catching_up: Vec<NodeId> = view
            .chain
            .iter()
            .copied()
            .filter(|n| !view.readable(*n))
            .collect();
        let head_id = view.head();
        self.view = Some(view);
        self.acting = true;
        self.after_durable.retain(|a| a.view == view_id);
        // A commit remembered from the old chain vouches for replicas that may not be in this one:
        // the repair below asks the new chain again.
        for entry in self.unsynced.values_mut() {
            entry.commit = None;
        }

        if readable {
            if self.joining_since.is_some() {
                self.records.push(Record::Readable);
                self.joining_since = None;
                self.caught_up_view = None;
            }
        } else if self.joining_since != Some(view_id) {
            // Re-entering at the tail: what this replica held may be stale or never committed.
            // Start empty; the head's copy (which starts over with every view) and the chain's
            // writes fill it. Under the same view (a restart mid-copy) the copy goes on instead.
            self.records.push(Record::Clear { view: view_id });
            self.notes.clear();
            self.rows.clear();
            self.locked.clear();
            self.unsynced.clear();
            self.by_batch.clear();
            self.last_sent.clear();
            self.joining_since = Some(view_id);
            self.caught_up_view = None;
        }

        if !(head && readable) {
            let answer = if head {
                Answer::Unavailable
            } else {
                Answer::NotHead { head: head_id }
            };
            self.release_requests(answer);
        }

        self.copies = if head && readable {
            catching_up
                .into_iter()
                .map(|n| (n, Copy::default()))
                .collect()
        } else {
            BTreeMap::new()
        };

        let mut interrupted: BTreeSet<Key> = self.locked.clone();
        interrupted.extend(self.inflight.keys().cloned());
        self.repair = interrupted.into_iter().collect();
        self.last_sent.clear();
        // A new chain may have a new successor: ask it now.
        self.resync_sent = None;
        self.drive_resync();
        self.drive_repair();
        // An acknowledgement from the old chain vouches for replicas that may not be in this one.
        let notes: Vec<Vec<u8>> = self.notes.keys().cloned().collect();
        for note in notes {
            if let Some(pending) = self.notes.get_mut(&note) {
                pending.acked = false;
            }
            self.advance_note(note);
        }
        // Held notes wait for those on their way; with none left, nothing would release them.
        if self.notes.is_empty() {
            self.send_held();
        }
        self.drive_copies();
    }

    /// This replica no longer serves requests: answer those waiting (they were not executed).
    /// Started writes are completed by the chain or its repair; their outcome is not known here any
    /// more, so they get no answer (their driver times them out).
    fn release_requests(&mut self, answer: Answer) {
        for (_, queue) in std::mem::take(&mut self.waiting) {
            for waiting in queue {
                let (Waiting::Read(request) | Waiting::Write(request, _)) = waiting;
                self.reply(request, answer.clone());
            }
        }
        self.inflight.clear();
        // Like a started write, a note in flight completes without its answer.
        for pending in self.notes.values_mut() {
            pending.requests.clear();
        }
        // A held note was not sent: like a waiting request, not executed.
        for (_, requests) in std::mem::take(&mut self.held) {
            for request in requests {
                self.reply(request, answer.clone());
            }
        }
    }

    fn drive_repair(&mut self) {
        for _ in 0..self.config.repair_batch {
            let Some(key) = self.repair.pop_front() else {
                break;
            };
            self.stats.repaired += 1;
            self.advance(&key);
        }
    }

    /// Flush2pc: a request found `key` locked; if its write waits in the repair queue, drive it now.
    fn flush(&mut self, key: &Key) {
        if let Some(at) = self.repair.iter().position(|k| k == key) {
            self.repair.remove(at);
            self.stats.flushes += 1;
            self.advance(key);
        }
    }

    /// `key`'s row is durable here: pass it on (see the module docs).
    fn advance(&mut self, key: &Key) {
        let Some((pos, len)) = self.position() else {
            return;
        };
        let Some(row) = self.rows.get(key) else {
            return;
        };
        let version = row.version;
        if pos + 1 == len {
            // The tail's commit promises durability from here on: it waits for the fsync.
            if let Some(entry) = self.unsynced.get_mut(key) {
                entry.advance = true;
                return;
            }
            if row.locked {
                // Promoted to tail with a locked row: the tail commits at once.
                self.unlock(key);
            }
            if pos == 0 {
                self.complete(key);
            } else if let Some(pred) = self.neighbour(-1) {
                self.send(
                    pred,
                    Item::Commit {
                        key: key.clone(),
                        version,
                    },
                );
            }
        } else if let Some(succ) = self.neighbour(1) {
            let value = row.value.clone();
            self.last_sent.insert(key.clone(), self.now);
            self.send(
                succ,
                Item::Prepare {
                    key: key.clone(),
                    value,
                    version,
                },
            );
        }
    }

    fn on_prepare(&mut self, key: Key, value: Option<Vec<u8>>, version: crate::Version) {
        match self.rows.get(&key) {
            // A stale duplicate (a later write to the key already passed here), or the predecessor
            // lost that later write in a crash before its fsync: show it the row, it catches up.
            Some(row) if row.version > version => {
                if let Some(pred) = self.neighbour(-1) {
                    let item = Item::Ahead {
                        key: key.clone(),
                        value: row.value.clone(),
                        version: row.version,
                    };
                    self.send(pred, item);
                }
            }
            // A resend (or a repair): pass it on again.
            Some(row) if row.version == version => self.advance(&key),
            _ => {
                let tail = matches!(self.position(), Some((p, l)) if p + 1 == l);
                let view = self.view().map_or(0, |v| v.id);
                let row = Row {
                    value,
                    version,
                    view,
                    locked: !tail,
                };
                self.persist_row(key, row, true);
            }
        }
    }

    fn on_commit(&mut self, key: Key, version: crate::Version) {
        // A version not held here was lost in a crash before the fsync: the resync brings it.
        if self.rows.get(&key).map(|row| row.version) != Some(version) {
            return;
        }
        if let Some(entry) = self.unsynced.get_mut(&key) {
            // Passing the commit on promises durability here: wait for the fsync.
            entry.commit = Some(version);
            return;
        }
        let Some(row) = self.rows.get(&key) else {
            return;
        };
        let was_locked = row.locked;
        if was_locked {
            self.unlock(&key);
        }
        if self.is_head() {
            if was_locked || self.inflight.contains_key(&key) {
                self.complete(&key);
            }
        } else if let Some(pred) = self.neighbour(-1) {
            self.send(pred, Item::Commit { key, version });
        }
    }

    /// The successor holds a later version of `key` than this replica (which lost it before its
    /// fsync, see [`Item::Ahead`]): take it, locked, and roll it forward like a repair. A write
    /// the head started at a lower version in the meantime is superseded, never executed: its
    /// client is told to restamp above the row.
    fn on_ahead(&mut self, key: Key, value: Option<Vec<u8>>, version: crate::Version) {
        if self
            .rows
            .get(&key)
            .is_some_and(|row| row.version >= version)
        {
            return;
        }
        if let Some(slot) = self.inflight.get_mut(&key) {
            if let Some(request) = slot.take() {
                self.reply(request, Answer::StaleVersion { current: version });
            }
        }
        let view = self.view().map_or(0, |v| v.id);
        let row = Row {
            value,
            version,
            view,
            locked: true,
        };
        self.persist_row(key.clone(), row, true);
    }

    /// The predecessor restarted and may have lost rows this replica holds: send them all, unless
    /// this replica is waiting for its own successor's (the predecessor asks again).
    fn on_resync(&mut self, pred: NodeId) {
        if self.resync {
            return;
        }
        let rows: Vec<Item> = self
            .rows
            .iter()
            .map(|(key, row)| Item::Ahead {
                key: key.clone(),
                value: row.value.clone(),
                version: row.version,
            })
            .collect();
        self.outbox.entry(pred).or_default().extend(rows);
        self.send(pred, Item::Synced);
    }

    /// Asks the successor for its rows while this replica may be behind it; a tail has nobody
    /// ahead of it.
    fn drive_resync(&mut self) {
        if !self.resync {
            return;
        }
        let due = self
            .resync_sent
            .is_none_or(|at| self.now.saturating_sub(at) >= self.config.resend_ticks);
        match self.neighbour(1) {
            Some(succ) if due => {
                self.resync_sent = Some(self.now);
                self.send(succ, Item::Resync);
            }
            Some(_) => {}
            None => self.resync = false,
        }
    }

    /// Commits and unlocks here. The record is not waited for: the value is already durable, and a
    /// lost unlock only makes the row look interrupted after a restart, which repair completes.
    fn unlock(&mut self, key: &Key) {
        if let Some(row) = self.rows.get_mut(key) {
            row.locked = false;
            self.locked.remove(key);
            self.last_sent.remove(key);
            self.records.push(Record::Row {
                key: key.clone(),
                row: row.clone(),
            });
        }
    }

    /// The head's write of `key` is committed through the whole chain.
    fn complete(&mut self, key: &Key) {
        self.last_sent.remove(key);
        if let Some(Some(request)) = self.inflight.remove(key) {
            if let Some(row) = self.rows.get(key) {
                let answer = Answer::Written {
                    version: row.version,
                };
                self.reply(request, answer);
            }
        }
        self.run_waiting(key);
    }

    fn run_waiting(&mut self, key: &Key) {
        while !self.busy(key) {
            let Some(queue) = self.waiting.get_mut(key) else {
                break;
            };
            let Some(next) = queue.pop_front() else {
                self.waiting.remove(key);
                break;
            };
            if queue.is_empty() {
                self.waiting.remove(key);
            }
            match next {
                Waiting::Read(request) => {
                    let answer = self.value_of(key);
                    self.reply(request, answer);
                }
                Waiting::Write(request, write) => self.start_write(request, write),
            }
        }
    }

    fn start_write(&mut self, request: RequestId, write: Write) {
        debug_assert!(!self.busy(&write.key));
        let current = self.rows.get(&write.key);
        let holds = match write.expect {
            Expect::Any => true,
            Expect::Absent => current.is_none_or(|row| row.value.is_none()),
            Expect::Version(v) => current.is_some_and(|row| row.version == v),
        };
        if !holds {
            let answer = Answer::ConditionFailed {
                current: current.map(|row| row.version),
            };
            self.reply(request, answer);
            return;
        }
        if let Some(row) = current {
            if write.version <= row.version {
                let answer = Answer::StaleVersion {
                    current: row.version,
                };
                self.reply(request, answer);
                return;
            }
        }
        let Some((pos, len)) = self.position() else {
            return;
        };
        let view = self.view().map_or(0, |v| v.id);
        // The locked row is in the head's state (and its log) before anything is forwarded: an
        // insert is a locked row (RTable's locked tombstone) that a recovery scan cannot miss.
        let row = Row {
            value: write.value,
            version: write.version,
            view,
            locked: pos + 1 != len,
        };
        self.inflight.insert(write.key.clone(), Some(request));
        self.persist_row(write.key, row, true);
    }

    fn persist_row(&mut self, key: Key, row: Row, advance: bool) {
        if row.locked {
            self.locked.insert(key.clone());
        } else {
            self.locked.remove(&key);
        }
        self.records.push(Record::Row {
            key: key.clone(),
            row: row.clone(),
        });
        let batch = self.batch;
        match self.unsynced.get_mut(&key) {
            Some(entry) if entry.batch == batch => {}
            _ => {
                let earlier = self.unsynced.get(&key).copied();
                let entry = Unsynced {
                    batch,
                    advance: earlier.is_some_and(|e| e.advance),
                    commit: earlier.and_then(|e| e.commit),
                };
                self.unsynced.insert(key.clone(), entry);
                self.by_batch.entry(batch).or_default().push(key.clone());
            }
        }
        self.rows.insert(key.clone(), row);
        if advance {
            // Phase 1 is pipelined: a non-tail forwards now, in parallel with its own fsync; the
            // tail's commit waits for it (`advance`).
            self.advance(&key);
        }
    }

    fn value_of(&self, key: &[u8]) -> Answer {
        match self.rows.get(key) {
            Some(row) => Answer::Value {
                value: row.value.clone(),
                version: Some(row.version),
            },
            None => Answer::Value {
                value: None,
                version: None,
            },
        }
    }

    // ---- notes --------------------------------------------------------------------------------

    fn persist_note(&mut self, note: Vec<u8>, requests: Vec<RequestId>) {
        self.records.push(Record::Note { note: note.clone() });
        let pending = PendingNote {
            batch: self.batch,
            acked: false,
            requests,
            last_sent: None,
        };
        self.notes.insert(note.clone(), pending);
        self.advance_note(note);
    }

    /// Passes the note on: a non-tail forwards it (before its own fsync, as a prepare), the tail
    /// finishes it once it is durable here.
    fn advance_note(&mut self, note: Vec<u8>) {
        let (tail, succ, now, durable) =
            (self.is_tail(), self.neighbour(1), self.now, self.durable);
        let Some(pending) = self.notes.get_mut(&note) else {
            return;
        };
        if tail {
            pending.last_sent = None;
            if pending.batch <= durable {
                self.finish_note(note);
            }
        } else if let Some(succ) = succ {
            pending.last_sent = Some(now);
            self.send(succ, Item::Note { note });
        }
    }

    fn on_note(&mut self, note: Vec<u8>) {
        if self.notes.contains_key(&note) {
            // A resend: pass it on again (an acknowledgement may have been lost).
            self.advance_note(note);
        } else {
            // Unknown here, or finished already (then persisted once more: a lost acknowledgement
            // costs a record, not a wrong answer).
            self.persist_note(note, Vec::new());
        }
    }

    fn on_note_ack(&mut self, note: Vec<u8>) {
        let durable = self.durable;
        let Some(pending) = self.notes.get_mut(&note) else {
            return;
        };
        pending.acked = true;
        pending.last_sent = None;
        if pending.batch <= durable {
            self.finish_note(note);
        }
    }

    /// Head: the notes held while others were on their way, down the chain together.
    fn send_held(&mut self) {
        for (note, requests) in std::mem::take(&mut self.held) {
            self.persist_note(note, requests);
        }
    }

    /// Every replica from here to the tail holds the note durably: answer (head) or acknowledge.
    fn finish_note(&mut self, note: Vec<u8>) {
        let Some(pending) = self.notes.remove(&note) else {
            return;
        };
        if self.is_head() {
            for request in pending.requests {
                self.reply(request, Answer::Noted);
            }
            if self.notes.is_empty() {
                self.send_held();
            }
        } else if let Some(pred) = self.neighbour(-1) {
            self.send(pred, Item::NoteAck { note });
        }
    }

    // ---- recovery copy ------------------------------------------------------------------------

    fn drive_copies(&mut self) {
        if !self.is_head() {
            return;
        }
        let targets: Vec<NodeId> = self
            .copies
            .iter()
            .filter(|(_, c)| !c.finished)
            .map(|(&n, _)| n)
            .collect();
        for target in targets {
            self.drive_copy(target);
        }
    }

    fn drive_copy(&mut self, target: NodeId) {
        let now = self.now;
        let resend = self.config.resend_ticks;
        let Some(copy) = self.copies.get(&target) else {
            return;
        };
        if !copy.scan_done {
            let due = copy
                .outstanding
                .as_ref()
                .is_none_or(|c| now.saturating_sub(c.sent_at) >= resend);
            if !due {
                return;
            }
            let start = match &copy.cursor {
                Some(key) => Bound::Excluded(key.clone()),
                None => Bound::Unbounded,
            };
            let mut rows = Vec::new();
            let mut deferred = Vec::new();
            let mut next_cursor = copy.cursor.clone();
            let mut visited = 0;
            for (key, row) in self.rows.range((start, Bound::Unbounded)) {
                if visited == self.config.copy_batch {
                    break;
                }
                visited += 1;
                next_cursor = Some(key.clone());
                if self.busy(key) {
                    deferred.push(key.clone());
                } else {
                    rows.push(CopiedRow {
                        key: key.clone(),
                        value: row.value.clone(),
                        version: row.version,
                    });
                }
            }
            let end = visited < self.config.copy_batch;
            let Some(copy) = self.copies.get_mut(&target) else {
                return;
            };
            copy.deferred.extend(deferred);
            copy.next_seq += 1;
            let seq = copy.next_seq;
            copy.outstanding = Some(Chunk {
                seq,
                next_cursor,
                end,
                sent_at: now,
            });
            self.send(target, Item::Copy { seq, rows });
            return;
        }
        let deferred: BTreeSet<Key> = copy
            .deferred
            .iter()
            .filter(|k| self.busy(k))
            .cloned()
            .collect();
        let Some(copy) = self.copies.get_mut(&target) else {
            return;
        };
        copy.deferred = deferred;
        let due = copy
            .done_sent
            .is_none_or(|at| now.saturating_sub(at) >= resend);
        if copy.deferred.is_empty() && due {
            copy.done_sent = Some(now);
            self.send(target, Item::CopyDone);
        }
    }

    fn on_copy_ack(&mut self, from: NodeId, seq: u64) {
        let Some(copy) = self.copies.get_mut(&from) else {
            return;
        };
        match &copy.outstanding {
            Some(chunk) if chunk.seq == seq => {
                copy.cursor = chunk.next_cursor.clone();
                copy.scan_done = chunk.end;
                copy.outstanding = None;
            }
            _ => return,
        }
        self.drive_copy(from);
    }

    fn on_copy(&mut self, seq: u64, rows: Vec<CopiedRow>) {
        let view = self.view().map_or(0, |v| v.id);
        for copied in rows {
            let newer = self
                .rows
                .get(&copied.key)
                .is_none_or(|row| copied.version > row.version);
            if newer {
                let row = Row {
                    value: copied.value,
                    version: copied.version,
                    view,
                    locked: false,
                };
                self.persist_row(copied.key, row, false);
            }
        }
        let Some(head) = self.view().and_then(View::head) else {
            return;
        };
        // Acknowledged once everything persisted so far is durable (the chunk's rows, and any newer
        // version of them this replica already had).
        let index = self.pending_index();
        self.after_durable.push(AfterDurable {
            index,
            view,
            to: head,
            item: Item::CopyAck { seq },
            caught_up: false,
        });
        self.release_after_durable();
    }

    fn on_copy_done(&mut self) {
        let Some(view) = self.view() else {
            return;
        };
        let (view_id, head) = (view.id, view.head());
        let Some(head) = head else {
            return;
        };
        if self.caught_up_view != Some(view_id) {
            self.records.push(Record::CaughtUp { view: view_id });
            self.caught_up_view = Some(view_id);
        }
        let index = self.pending_index();
        self.after_durable.push(AfterDurable {
            index,
            view: view_id,
            to: head,
            item: Item::CopyDoneAck,
            caught_up: true,
        });
        self.release_after_durable();
    }

    /// The batch that holds everything recorded so far.
    fn pending_index(&self) -> u64 {
        if self.records.is_empty() {
            self.batch - 1
        } else {
            self.batch
        }
    }

    fn release_after_durable(&mut self) {
        let durable = self.durable;
        let current = self.view().map(|v| v.id);
        let (ready, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.after_durable)
            .into_iter()
            .partition(|a| a.index <= durable);
        self.after_durable = later;
        for a in ready {
            if Some(a.view) != current {
                continue;
            }
            if a.caught_up {
                self.outputs.push(Output::CaughtUp { view: a.view });
            }
            self.send(a.to, a.item);
        }
    }

    // ---- outputs ------------------------------------------------------------------------------

    fn send(&mut self, to: NodeId, item: Item) {
        self.outbox.entry(to).or_default().push(item);
    }

    fn reply(&mut self, request: RequestId, answer: Answer) {
        self.outputs.push(Output::Reply { request, answer });
    }
}
