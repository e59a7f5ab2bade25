//! The AIO state-store service, attached to the broker's system service port.
//!
//! * [`envelope`] — what a request must carry (response topic, correlation data, `__ts`, `__ft`) and the
//!   properties of every reply (`__stat`, `__protVer`, `__srcId`, `__ts`).
//! * [`dedup`] — the duplicate-request cache: a retried request gets its first reply, never a second run.
//! * [`access`] — key-level authorization (`-ERR not authorized`); [`guard`] — the built-in topic rules
//!   (only the state store publishes in its namespace; clients subscribe to their own notifications only).
//! * [`notify`] — persistent notifications: settings, the admin RPC of topics, the queue owner
//!   (lock walk, pushers); the executor's side is `service/notify_exec.rs`.
//! * `rate` — requests per second per client (`-ERR the quota has been exceeded` beyond).
//! * [`router`] — the port a cluster node routes key commands through (to their partition's head).
//! * [`service`] — the executor and the completer over the store's
//!   [`DurableLog`](mqstate_wal::DurableLog); [`recovery`] — snapshot, replay and clock ceiling
//!   at start.
//!
//! Architecture invariant: this is the only crate that knows both the broker port and the store.

pub mod access;
pub mod dedup;
pub mod envelope;
pub mod guard;
pub mod metrics;
pub mod notify;
mod rate;
pub mod recovery;
pub mod router;
pub mod service;
