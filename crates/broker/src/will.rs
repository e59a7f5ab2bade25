//! Last Will and Testament.

use crate::message::Message;

/// A client's will: published when its connection ends abnormally (or with DISCONNECT 0x04), after
/// `delay_secs` unless the client reconnects first, and no later than the end of its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Will {
    pub message: Message,
    /// Will Delay Interval in seconds (0 = publish at once).
    pub delay_secs: u32,
}
