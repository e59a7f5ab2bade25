//! Crash points of the chain protocol, armed like the log's (`MQSTATE_FAILPOINT=<name>` or
//! `<name>@<marker file>`, `mqstate_wal::failpoint`): the process aborts there, so a test can check
//! what a crash at that step of a write, or of a recovery copy, leaves behind.

use mqstate_chain::{Item, Message};
use mqstate_wal::Failpoints;

/// The head hands phase 1 to its successor: its own row is written, no other replica has it.
pub const CHAIN_HEAD_AFTER_PREPARE: &str = "chain-head-after-prepare";
/// The tail holds phase 1 (committed there) and is about to send phase 2 back.
pub const CHAIN_TAIL_BEFORE_COMMIT: &str = "chain-tail-before-commit";
/// A replica catching up received a chunk of its recovery copy, before it holds it.
pub const CHAIN_MID_COPY: &str = "chain-mid-copy";

/// Before `message` goes from this node, at `position` in the partition's chain of `length`.
pub fn before_send(
    failpoints: &Failpoints,
    position: Option<usize>,
    length: usize,
    message: &Message,
) {
    if !failpoints.is_armed() {
        return;
    }
    let has = |f: fn(&Item) -> bool| message.items.iter().any(f);
    if position == Some(0) && has(|i| matches!(i, Item::Prepare { .. })) {
        failpoints.hit(CHAIN_HEAD_AFTER_PREPARE);
    }
    if length > 1 && position == Some(length - 1) && has(|i| matches!(i, Item::Commit { .. })) {
        failpoints.hit(CHAIN_TAIL_BEFORE_COMMIT);
    }
}

/// When `message` arrives at this node.
pub fn on_receive(failpoints: &Failpoints, message: &Message) {
    if failpoints.is_armed() && message.items.iter().any(|i| matches!(i, Item::Copy { .. })) {
        failpoints.hit(CHAIN_MID_COPY);
    }
}
