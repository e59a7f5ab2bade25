//! The server's edges against a real `mqstate serve`: authentication and authorization, TLS and
//! WebSocket listeners, hostile clients and resource limits, the metrics endpoint.
//!
//! One test binary for the area (issue 12: each test binary links the AIO SDK and the other
//! dev-dependencies, so one per area keeps link time down); each module was a file of its own in
//! `tests/`, and its tests keep their names under it: `cargo test --test server <module>::` runs one
//! module.

#[path = "../common/mod.rs"]
mod common;

mod auth;
mod metrics;
mod resource;
mod tls;
