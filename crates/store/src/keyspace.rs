//! The keyspace: key → entry, plus an ordered `(deadline, key)` index so the next deadline and
//! each expired key cost `O(log n)` — expiry never scans all keys.
//!
//! The keyspace stores what deltas say; whether an entry is *live* depends on the caller's `now_ms`.
//! An expired entry stays until its Delete delta is applied, but every command treats it as absent.
//!
//! Memory per key is the point of the representation (issue 3, decision 0015): each key is one heap
//! allocation, a [`Slot`], holding the key, the metadata and the value, in an ordered set keyed by the
//! key part, behind a one-word pointer ([`thin`], the crate's only `unsafe`). In memory only (the
//! snapshot has its own format), integers little-endian:
//!
//! ```text
//! slot = slot length varint | key length varint | key | flags u8 | version | [fencing token] | [deadline u64] | value
//! HLC  = wall ms varint | counter varint | node u8 [| node id length varint | node id]
//! ```
//! `flags` says whether the fencing token and the deadline are present. `node` indexes a small table
//! of interned node ids — versions almost always carry this server's id — or is [`INLINE_NODE`] when
//! the id follows inline (the table is full or the id is long: client-chosen ids cannot grow it
//! without bound). The value runs to the end of the slot.
//!
//! Representation differs between equal keyspaces (interning follows history), so equality compares
//! what the entries say.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;

use mqstate_protocol::Hlc;

use thin::{varint_len, write_varint, ThinBytes};

#[allow(unsafe_code)] // the crate's one reviewed unsafe module (decision 0015)
mod thin;

/// Bytes a key and its value count against the memory quota.
pub fn entry_bytes(key: &[u8], value: &[u8]) -> u64 {
    (key.len() as u64).saturating_add(value.len() as u64)
}

/// What [`Keyspace::insert`] stores for a key.
#[derive(Debug, Clone, Copy)]
pub struct NewEntry<'a> {
    pub value: &'a [u8],
    /// Version of the write that produced this entry.
    pub version: &'a Hlc,
    /// The newest fencing token that protected a write to this key.
    pub fencing_token: Option<&'a Hlc>,
    /// Absolute deadline (Unix ms); the entry is expired from this instant on.
    pub expires_at_ms: Option<u64>,
}

/// A stored entry, borrowed from the keyspace.
#[derive(Clone, Copy)]
pub struct Entry<'a> {
    key: &'a [u8],
    value: &'a [u8],
    version: RawHlc<'a>,
    fencing_token: Option<RawHlc<'a>>,
    expires_at_ms: Option<u64>,
    nodes: &'a NodeIds,
}

impl<'a> Entry<'a> {
    pub fn key(&self) -> &'a [u8] {
        self.key
    }

    pub fn value(&self) -> &'a [u8] {
        self.value
    }

    /// Version of the write that produced this entry.
    pub fn version(&self) -> Hlc {
        self.version.to_hlc(self.nodes)
    }

    /// The newest fencing token that protected a write to this key.
    pub fn fencing_token(&self) -> Option<Hlc> {
        self.fencing_token.map(|token| token.to_hlc(self.nodes))
    }

    /// Absolute deadline (Unix ms); the entry is expired from this instant on.
    pub fn expires_at_ms(&self) -> Option<u64> {
        self.expires_at_ms
    }

    /// Whether the entry still exists at `now_ms`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|deadline| now_ms < deadline)
    }
}

impl PartialEq for Entry<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
            && self.value == other.value
            && self.expires_at_ms == other.expires_at_ms
            && self.version() == other.version()
            && self.fencing_token() == other.fencing_token()
    }
}

impl Eq for Entry<'_> {}

impl fmt::Debug for Entry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("key", &format_args!("b\"{}\"", self.key.escape_ascii()))
            .field("value", &format_args!("b\"{}\"", self.value.escape_ascii()))
            .field("version", &self.version())
            .field("fencing_token", &self.fencing_token())
            .field("expires_at_ms", &self.expires_at_ms)
            .finish()
    }
}

/// Keys, their entries and the expiry index, kept consistent by the only two mutators.
#[derive(Clone, Default)]
pub struct Keyspace {
    entries: BTreeSet<Slot>,
    /// A key copy per key with a deadline: keys without one (most) pay nothing here.
    deadlines: BTreeSet<(u64, Box<[u8]>)>,
    nodes: NodeIds,
    stored_bytes: u64,
}

impl Keyspace {
    /// Inserts or replaces `key`.
    ///
    /// Key and value are copied into the slot: what arrives is usually a slice of a network read
    /// buffer or of a log segment, and keeping that would pin the whole buffer for as long as the key
    /// lives.
    pub fn insert(&mut self, key: &[u8], entry: NewEntry<'_>) {
        debug_assert!(!key.is_empty(), "keys are never empty");
        let slot = Slot::encode(key, &entry, &mut self.nodes);
        self.stored_bytes = self
            .stored_bytes
            .saturating_add(entry_bytes(key, entry.value));
        let old_deadline = self.entries.replace(slot).and_then(|old| {
            let old = old.parse();
            self.stored_bytes = self
                .stored_bytes
                .saturating_sub(entry_bytes(key, old.value));
            old.deadline
        });
        if old_deadline != entry.expires_at_ms {
            if let Some(deadline) = old_deadline {
                self.deadlines.remove(&(deadline, Box::from(key)));
            }
            if let Some(deadline) = entry.expires_at_ms {
                self.deadlines.insert((deadline, Box::from(key)));
            }
        }
        self.debug_check();
    }

    /// Removes `key`; whether it was stored.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        let Some(old) = self.entries.take(key) else {
            return false;
        };
        let old = old.parse();
        if let Some(deadline) = old.deadline {
            self.deadlines.remove(&(deadline, Box::from(key)));
        }
        self.stored_bytes = self
            .stored_bytes
            .saturating_sub(entry_bytes(key, old.value));
        self.debug_check();
        true
    }

    /// The stored entry, live or expired.
    pub fn get(&self, key: &[u8]) -> Option<Entry<'_>> {
        self.entries.get(key).map(|slot| self.view(slot))
    }

    /// The entry if it is live at `now_ms`.
    pub fn get_live(&self, key: &[u8], now_ms: u64) -> Option<Entry<'_>> {
        self.get(key).filter(|e| e.is_live(now_ms))
    }

    /// Number of stored keys (expired but not yet deleted ones included).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of [`entry_bytes`] over stored keys.
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// The earliest deadline of any stored key.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.first().map(|(deadline, _)| *deadline)
    }

    /// The key with the earliest deadline, if that deadline is at or before `now_ms`.
    pub fn first_expired(&self, now_ms: u64) -> Option<&[u8]> {
        self.deadlines
            .first()
            .filter(|(deadline, _)| *deadline <= now_ms)
            .map(|(_, key)| &key[..])
    }

    /// All entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = Entry<'_>> {
        self.entries.iter().map(|slot| self.view(slot))
    }

    /// Entries with keys strictly after `after` (all of them when `None`), in key order.
    pub fn iter_after<'a>(&'a self, after: Option<&'a [u8]>) -> impl Iterator<Item = Entry<'a>> {
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.entries
            .range::<[u8], _>((start, Bound::Unbounded))
            .map(|slot| self.view(slot))
    }

    fn view<'a>(&'a self, slot: &'a Slot) -> Entry<'a> {
        let parsed = slot.parse();
        Entry {
            key: parsed.key,
            value: parsed.value,
            version: parsed.version,
            fencing_token: parsed.fencing_token,
            expires_at_ms: parsed.deadline,
            nodes: &self.nodes,
        }
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) && self.entries.len() <= 64 {
            let deadlines: BTreeSet<(u64, Box<[u8]>)> = self
                .iter()
                .filter_map(|e| Some((e.expires_at_ms()?, Box::from(e.key()))))
                .collect();
            debug_assert_eq!(deadlines, self.deadlines, "expiry index out of sync");
            let bytes: u64 = self.iter().map(|e| entry_bytes(e.key(), e.value())).sum();
            debug_assert_eq!(bytes, self.stored_bytes, "byte count out of sync");
        }
    }
}

impl PartialEq for Keyspace {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len()
            && self.stored_bytes == other.stored_bytes
            && self.iter().eq(other.iter())
    }
}

impl Eq for Keyspace {}

impl fmt::Debug for Keyspace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Builds a keyspace from entries given in strictly ascending key order (a snapshot's) in one pass:
/// the B-tree gets full nodes, where insertion in key order leaves them about half full.
#[derive(Default)]
pub(crate) struct AscendingBuilder {
    keyspace: Keyspace,
    slots: Vec<Slot>,
}

impl AscendingBuilder {
    /// Room for `keys` entries (a bound the caller has checked against the input's size).
    pub(crate) fn with_capacity(keys: usize) -> AscendingBuilder {
        AscendingBuilder {
            keyspace: Keyspace::default(),
            slots: Vec::with_capacity(keys),
        }
    }

    /// The key pushed last.
    pub(crate) fn last_key(&self) -> Option<&[u8]> {
        self.slots.last().map(Slot::key)
    }

    /// Adds an entry; `key` must be greater than [`last_key`](Self::last_key).
    pub(crate) fn push(&mut self, key: &[u8], entry: NewEntry<'_>) {
        debug_assert!(self.last_key().is_none_or(|last| last < key));
        let ks = &mut self.keyspace;
        self.slots.push(Slot::encode(key, &entry, &mut ks.nodes));
        ks.stored_bytes = ks
            .stored_bytes
            .saturating_add(entry_bytes(key, entry.value));
        if let Some(deadline) = entry.expires_at_ms {
            ks.deadlines.insert((deadline, Box::from(key)));
        }
    }

    pub(crate) fn finish(self) -> Keyspace {
        let mut keyspace = self.keyspace;
        // Sorting sorted input is one pass; then the set is built bottom-up with full nodes.
        keyspace.entries = self.slots.into_iter().collect();
        keyspace.debug_check();
        keyspace
    }
}

const HAS_FENCING_TOKEN: u8 = 1;
const HAS_DEADLINE: u8 = 2;
/// The `node` byte of an HLC whose node id follows inline.
const INLINE_NODE: u8 = u8::MAX;
/// Interned node ids per keyspace: this server's, and the few others versions and tokens carry.
const MAX_INTERNED_NODES: usize = 16;
/// Longer node ids are stored inline, so the table stays small whatever clients send.
const MAX_INTERNED_NODE_BYTES: usize = 64;

/// The interned node ids; a slot refers to one by its index.
#[derive(Debug, Clone, Default)]
struct NodeIds(Vec<Arc<str>>);

impl NodeIds {
    fn intern<'h>(&mut self, id: &'h Arc<str>) -> NodeRef<'h> {
        if let Some(index) = self
            .0
            .iter()
            .position(|known| Arc::ptr_eq(known, id) || **known == **id)
        {
            return NodeRef::Interned(index as u8);
        }
        if self.0.len() < MAX_INTERNED_NODES && id.len() <= MAX_INTERNED_NODE_BYTES {
            self.0.push(id.clone());
            return NodeRef::Interned((self.0.len() - 1) as u8);
        }
        NodeRef::Inline(id)
    }
}

#[derive(Debug, Clone, Copy)]
enum NodeRef<'a> {
    Interned(u8),
    Inline(&'a str),
}

/// An HLC as a slot holds it.
#[derive(Debug, Clone, Copy)]
struct RawHlc<'a> {
    wall_ms: u64,
    counter: u32,
    node: NodeRef<'a>,
}

impl RawHlc<'_> {
    fn to_hlc(self, nodes: &NodeIds) -> Hlc {
        let node_id = match self.node {
            NodeRef::Interned(index) => nodes.0[usize::from(index)].clone(),
            NodeRef::Inline(id) => Arc::from(id),
        };
        Hlc::new(self.wall_ms, self.counter, node_id)
    }
}

/// One key with its entry in a single allocation (layout in the module docs). Ordered by key.
#[derive(Clone)]
struct Slot(ThinBytes);

impl Slot {
    fn encode(key: &[u8], entry: &NewEntry<'_>, nodes: &mut NodeIds) -> Slot {
        let version = (entry.version, nodes.intern(&entry.version.node_id));
        let token = entry
            .fencing_token
            .map(|token| (token, nodes.intern(&token.node_id)));
        let hlc_len = |node: NodeRef<'_>| match node {
            NodeRef::Interned(_) => 0,
            NodeRef::Inline(id) => varint_len(id.len() as u64) + id.len(),
        };
        let hlc_len = |(hlc, node): (&Hlc, NodeRef<'_>)| {
            varint_len(hlc.wall_ms) + varint_len(u64::from(hlc.counter)) + 1 + hlc_len(node)
        };
        let len = varint_len(key.len() as u64)
            + key.len()
            + 1
            + hlc_len(version)
            + token.map_or(0, hlc_len)
            + entry.expires_at_ms.map_or(0, |_| 8)
            + entry.value.len();
        let flags = if token.is_some() {
            HAS_FENCING_TOKEN
        } else {
            0
        } | if entry.expires_at_ms.is_some() {
            HAS_DEADLINE
        } else {
            0
        };
        Slot(ThinBytes::build(len, |out| {
            let mut w = SlotWriter(out);
            w.varint(key.len() as u64);
            w.put(key);
            w.put(&[flags]);
            for (hlc, node) in std::iter::once(version).chain(token) {
                w.varint(hlc.wall_ms);
                w.varint(u64::from(hlc.counter));
                match node {
                    NodeRef::Interned(index) => w.put(&[index]),
                    NodeRef::Inline(id) => {
                        w.put(&[INLINE_NODE]);
                        w.varint(id.len() as u64);
                        w.put(id.as_bytes());
                    }
                }
            }
            if let Some(deadline) = entry.expires_at_ms {
                w.put(&deadline.to_le_bytes());
            }
            w.put(entry.value);
            debug_assert!(w.0.is_empty(), "slot length miscounted");
        }))
    }

    #[inline]
    fn key(&self) -> &[u8] {
        let mut r = SlotReader(self.0.as_slice());
        let len = r.len();
        r.take(len)
    }

    fn parse(&self) -> Parsed<'_> {
        let mut r = SlotReader(self.0.as_slice());
        let key_len = r.len();
        let key = r.take(key_len);
        let flags = r.take(1)[0];
        let version = r.hlc();
        let fencing_token = (flags & HAS_FENCING_TOKEN != 0).then(|| r.hlc());
        let deadline = (flags & HAS_DEADLINE != 0).then(|| r.u64());
        Parsed {
            key,
            version,
            fencing_token,
            deadline,
            value: r.0,
        }
    }
}

/// Fills a slot front to back.
struct SlotWriter<'a>(&'a mut [u8]);

impl SlotWriter<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let (head, rest) = std::mem::take(&mut self.0).split_at_mut(bytes.len());
        head.copy_from_slice(bytes);
        self.0 = rest;
    }

    fn varint(&mut self, value: u64) {
        let written = write_varint(self.0, value);
        self.0 = &mut std::mem::take(&mut self.0)[written..];
    }
}

impl Borrow<[u8]> for Slot {
    #[inline]
    fn borrow(&self) -> &[u8] {
        self.key()
    }
}

impl Ord for Slot {
    #[inline]
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(other.key())
    }
}

impl PartialOrd for Slot {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Slot {}

struct Parsed<'a> {
    key: &'a [u8],
    version: RawHlc<'a>,
    fencing_token: Option<RawHlc<'a>>,
    deadline: Option<u64>,
    value: &'a [u8],
}

/// Reads a slot this module wrote, so its layout is trusted: a violation is a bug here.
struct SlotReader<'a>(&'a [u8]);

impl<'a> SlotReader<'a> {
    #[inline]
    fn take(&mut self, len: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        head
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N));
        out
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// A length this module wrote from a `usize`.
    #[inline]
    fn len(&mut self) -> usize {
        self.varint() as usize
    }

    #[inline]
    fn varint(&mut self) -> u64 {
        // Keys shorter than 128 bytes, the usual case, have a one-byte length.
        if let Some((&first, rest)) = self.0.split_first() {
            if first < 0x80 {
                self.0 = rest;
                return u64::from(first);
            }
        }
        let mut value = 0u64;
        let mut shift = 0;
        loop {
            let byte = self.take(1)[0];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return value;
            }
            shift += 7;
        }
    }

    fn hlc(&mut self) -> RawHlc<'a> {
        let wall_ms = self.varint();
        let counter = self.varint() as u32;
        let node = match self.take(1)[0] {
            INLINE_NODE => {
                let len = self.len();
                let id = std::str::from_utf8(self.take(len))
                    .expect("a slot's inline node id is the UTF-8 it was given");
                NodeRef::Inline(id)
            }
            index => NodeRef::Interned(index),
        };
        RawHlc {
            wall_ms,
            counter,
            node,
        }
    }
}

#[cfg(test)]
mod tests;
