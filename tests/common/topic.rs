//! Persistent-notification topics of a running server, through the `mqstate topic` CLI.

use std::process::{Command, Output};

use serde_json::Value;

use super::Server;

/// `mqstate <args>` against `server` (the first two arguments are the subcommand, e.g. `topic stats`).
pub fn cli(server: &Server, args: &[&str]) -> Output {
    let (sub, rest) = args.split_first().expect("a subcommand");
    let (sub2, rest) = rest.split_first().expect("a subcommand of it");
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .args([sub, sub2])
        .args(["--port", &server.port().to_string(), "--timeout", "10"])
        .args(rest)
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .output()
        .expect("mqstate runs")
}

/// Creates topic `name` for the keys `order:*`, pushed to `endpoint`.
pub fn create(server: &Server, name: &str, endpoint: &str, extra: &[&str]) {
    let mut args = vec![
        "topic",
        "create",
        name,
        "--endpoint",
        endpoint,
        "--keys",
        "order:*",
    ];
    args.extend_from_slice(extra);
    let out = cli(server, &args);
    assert!(out.status.success(), "topic create: {out:?}");
}

/// `topic stats <name> --json`.
pub fn stats(server: &Server, name: &str) -> Value {
    let out = cli(server, &["topic", "stats", name, "--json"]);
    assert!(out.status.success(), "topic stats: {out:?}");
    serde_json::from_slice(&out.stdout).expect("topic stats prints JSON")
}
