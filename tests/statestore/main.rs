//! The state store against a real `mqstate serve`: the wire protocol, the official AIO SDK, floods
//! of bad requests, the clock across restarts, persistent notifications.
//!
//! One test binary for the area (issue 12: each test binary links the AIO SDK and the other
//! dev-dependencies, so one per area keeps link time down); each module was a file of its own in
//! `tests/`, and its tests keep their names under it: `cargo test --test statestore <module>::` runs one
//! module.

#[path = "../common/mod.rs"]
mod common;

mod clock;
mod cluster_failover;
mod cluster_observers;
mod cluster_sdk;
mod notify;
mod statestore_flood;
mod statestore_sdk;
mod statestore_wire;
