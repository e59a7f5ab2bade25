//! Wire formats of the AIO state-store protocol (`docs/protocol.md`).
//!
//! Pure and deterministic: no I/O, no clock reads (callers pass `now_ms`). A request travels through
//! the modules in this order:
//!
//! * [`resp`] — RESP framing: [`parse_request`] splits a payload into zero-copy arguments,
//!   [`encode_request`] builds one (CLI, tests).
//! * [`command`] — [`Command::parse`] turns arguments into a typed command, with the exact spec errors.
//! * [`glob`] — [`Glob`], the SCAN pattern matcher (semantics of the `glob` crate, byte-wise, linear).
//! * [`hlc`] — [`Hlc`] versions (`__ts`, `__ft`) and the server's [`HybridClock`].
//! * [`reply`] — [`Reply`] and [`NotifyPayload`]: encoded by the server, parsed by clients.
//! * [`topic`] — the invoke topic, notification topics, forbidden response topics.
//! * [`error`] — [`ErrorKind`] (the spec's `-ERR` texts) and [`ProtocolError`] (decoder failures).
//!
//! Architecture invariant: this crate depends on nothing but `bytes` and `thiserror`, and every
//! decoder returns an error — never panics — on arbitrary input (fuzzed by `fuzz/fuzz_targets`).

pub mod command;
pub mod error;
pub mod glob;
pub mod hlc;
pub mod reply;
pub mod resp;
pub mod topic;

pub use command::{Command, SetCondition};
pub use error::{ErrorKind, ProtocolError};
pub use glob::Glob;
pub use hlc::{Hlc, HybridClock};
pub use reply::{NotifyPayload, Reply};
pub use resp::{encode_request, parse_request, RequestLimits};
