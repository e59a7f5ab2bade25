//! Durability against a real `mqstate serve`: crashes and failpoints, a full disk, persistent
//! sessions and QoS 2 across restarts, the offline data tools.
//!
//! One test binary for the area (issue 12: each test binary links the AIO SDK and the other
//! dev-dependencies, so one per area keeps link time down); each module was a file of its own in
//! `tests/`, and its tests keep their names under it: `cargo test --test durability <module>::` runs one
//! module.

#[path = "../common/mod.rs"]
mod common;

mod crash;
mod data_tools;
mod disk_full;
mod qos2_restart;
mod topic_alias_durable;
