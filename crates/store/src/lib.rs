//! The deterministic state-store core: keyspace, versions, fencing, quotas, expiry, notifications.
//!
//! No I/O and no clock reads — time arrives as `now_ms` — so the same inputs always give the same
//! outputs, which is what recovery, replication and simulation rely on.
//!
//! * [`machine`] — [`StateMachine::execute`] runs a [`Command`](mqstate_protocol::Command) in a
//!   [`RequestContext`] and returns an [`Execution`]: reply, response `__ts`, the [`Delta`] to make
//!   durable and the [`KeyNotification`]s to publish. Also `expire_due`, `next_deadline`,
//!   `drop_client` and `apply_delta`.
//! * [`delta`] — [`Delta`] (put / delete) and its binary form (`storage-format.md` conventions).
//! * [`snapshot`] — [`SnapshotEncoder`] (chunk by chunk, while the machine changes; the chunks
//!   kept or taken to be written out as they are encoded),
//!   `StateMachine::snapshot_encode` (in one go) / `snapshot_decode`.
//! * [`keyspace`] — [`Keyspace`] (one allocation per key), [`Entry`] (a stored entry, borrowed) and
//!   [`NewEntry`], with the `(deadline, key)` expiry index.
//! * [`notify`] — persistent notifications: topics and their bounded two-phase queues
//!   (reserve, commit or abort, remove once delivered), logged as [`notify::QueueDelta`]s;
//!   [`Change`] is a log record of either kind.
//! * [`request`] — [`RequestRecord`]: the identity and first reply of the request that made a
//!   change, logged with it (and kept in snapshots) to rebuild the service's duplicate cache.
//! * [`limits`] — [`Limits`], every bound with its default.
//! * [`error`] — [`StoreError`] (configuration and codec failures; command errors are replies).
//!
//! Architecture invariant: the keyspace changes only through `StateMachine::apply_delta`, so
//! executing a command and replaying its delta yield the same state.

pub mod change;
mod codec;
pub mod delta;
pub mod error;
pub mod keyspace;
pub mod limits;
pub mod machine;
pub mod notify;
mod registrations;
pub mod request;
pub mod snapshot;

pub use change::Change;
pub use codec::MAX_BUFFER_BYTES;
pub use delta::Delta;
pub use error::StoreError;
pub use keyspace::{Entry, Keyspace, NewEntry};
pub use limits::Limits;
pub use machine::{
    Execution, Expiration, KeyNotification, RequestContext, StateMachine, StoreConfig,
};
pub use request::{RequestId, RequestRecord};
pub use snapshot::{Progress, SnapshotEncoder, StatePatch, StreamedEnd};
