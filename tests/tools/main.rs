//! The command-line tools against a real `mqstate serve`: the state-store CLI and `mqstate bench`.
//!
//! One test binary for the area (issue 12: each test binary links the AIO SDK and the other
//! dev-dependencies, so one per area keeps link time down); each module was a file of its own in
//! `tests/`, and its tests keep their names under it: `cargo test --test tools <module>::` runs one
//! module.

#[path = "../common/mod.rs"]
mod common;

mod bench;
mod cli;
