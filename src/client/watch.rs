//! `mqstate watch KEY…`: KEYNOTIFY every key and print each change until interrupted (or `--count`).

use std::io::Write;
use std::process::ExitCode;

use azure_iot_operations_services::state_store::{KeyNotification, Operation};
use serde_json::json;
use tokio::sync::mpsc;

use super::connection::ConnectionArgs;
use super::error::CliError;
use super::output::{finish, Outcome};
use super::sdk::{map_error, Store};
use super::value::{self, OutputArgs};

/// Notifications buffered between the per-key receivers and the printer.
pub const NOTIFICATION_BUFFER: usize = 1024;

#[derive(clap::Args)]
pub struct WatchArgs {
    #[arg(required = true)]
    pub keys: Vec<String>,
    /// Stop after this many notifications (default: run until Ctrl-C).
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub async fn run(args: &WatchArgs) -> ExitCode {
    finish(args.output, watch(args).await)
}

async fn watch(args: &WatchArgs) -> Result<Outcome, CliError> {
    let store = Store::connect(&args.conn).await?;
    let result = observe_and_print(&store, args).await;
    for key in &args.keys {
        // Best effort: the registrations also end with the session.
        let _ = store
            .client
            .unobserve(key.as_bytes().to_vec(), args.conn.timeout())
            .await;
    }
    store.close().await;
    let seen = result?;
    Ok(Outcome::new(
        super::error::EXIT_OK,
        json!({ "notifications": seen }),
    ))
}

async fn observe_and_print(store: &Store, args: &WatchArgs) -> Result<u64, CliError> {
    let conn = &args.conn;
    let (tx, mut rx) = mpsc::channel::<KeyNotification>(NOTIFICATION_BUFFER);
    for key in &args.keys {
        let observation = store
            .client
            .observe(key.as_bytes().to_vec(), conn.timeout())
            .await
            .map_err(|e| map_error("KEYNOTIFY", &conn.addr(), conn.timeout, &e))?;
        let mut observation = observation.response;
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some((notification, _ack)) = observation.recv_notification().await {
                if tx.send(notification).await.is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    // Tells scripts (and tests) that every registration is in place.
    eprintln!("mqstate: watching {} key(s)", args.keys.len());
    let mut seen = 0u64;
    while args.count.is_none_or(|limit| seen < limit) {
        tokio::select! {
            notification = rx.recv() => match notification {
                Some(n) => {
                    seen += 1;
                    print_notification(args.output, &n).map_err(|source| CliError::Input {
                        what: "stdout (closed?)".into(),
                        source,
                    })?;
                }
                None => break,
            },
            error = store.disconnected() => return Err(error),
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    Ok(seen)
}

/// One line per change: tab-separated `SET key value version` or `DELETE key version` (fields escaped,
/// so tabs inside them cannot be confused with separators), or one JSON object per line.
fn print_notification(output: OutputArgs, n: &KeyNotification) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    let version = n.version.to_string();
    if output.json {
        let mut doc = serde_json::Map::new();
        value::put_bytes(&mut doc, "key", &n.key);
        match &n.operation {
            Operation::Set(data) => {
                doc.insert("operation".into(), "SET".into());
                value::put_bytes(&mut doc, "value", data);
            }
            Operation::Del => {
                doc.insert("operation".into(), "DELETE".into());
            }
        }
        doc.insert("version".into(), version.into());
        writeln!(out, "{}", serde_json::Value::Object(doc))?;
    } else {
        let key = value::escape(&n.key);
        match &n.operation {
            Operation::Set(data) => {
                writeln!(out, "SET\t{key}\t{}\t{version}", value::escape(data))?
            }
            Operation::Del => writeln!(out, "DELETE\t{key}\t{version}")?,
        }
    }
    out.flush()
}
