//! mqstate-chain: chain replication of one partition, after RTable (seed `002`, `docs/chain.md`).
//!
//! A [`Replica`] is one node's copy of one partition, as a sans-IO state machine: the driver feeds
//! it client requests, peer [`Message`]s, durability reports, views from the control plane and
//! ticks, and carries out its [`Output`]s — append these records, send this message, answer this
//! request, report caught up. No sockets, no disk, no clock, no async: a node and the deterministic
//! simulation (`tests/simulation.rs`) run the same code.
//!
//! Modules: [`types`] (rows, versions, views, log records and their replay), [`message`] (what
//! replicas send each other and what a replica asks of its driver), [`replica`] (the protocol).

pub mod message;
pub mod replica;
pub mod types;

pub use message::{Answer, CopiedRow, Expect, Item, Message, Output, Write};
pub use replica::{Config, Replica, Stats};
pub use types::{Key, NodeId, Record, RequestId, Restored, Row, Version, View};
