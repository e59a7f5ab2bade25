//! The state-store CLI (`get`, `set`, `del`, `vdel`, `scan`, `watch`, `lock`), like redis-cli or
//! etcdctl, for any AIO-compatible broker.
//!
//! Every command except `scan` goes through the official AIO Rust SDK ([`sdk`]), so the CLI doubles as
//! proof that our server works with it; `scan` (not in SDK 1.3.0) uses the raw MQTT 5 path ([`rpc`])
//! that `bench` also drives. Exit status: 0 success, 1 not found / condition not met, 2 usage or
//! connection error (see [`error`]).

pub mod cluster;
pub mod connection;
pub mod error;
mod lock;
mod output;
pub mod rpc;
mod sdk;
pub mod topic;
pub mod value;
mod watch;

use std::process::ExitCode;
use std::time::Duration;

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::{SetCondition, SetOptions};
use bytes::Bytes;
use mqstate_protocol::Reply;
use serde_json::json;

use connection::ConnectionArgs;
use error::{CliError, EXIT_NOT_MET, EXIT_OK};
use output::Outcome;
use sdk::{map_error, Store};
use value::{read_value, OutputArgs};

/// Most SCAN pages followed before giving up: a server that keeps returning continuation tokens is
/// broken, and the spec's worst case (a 100-key scan in ≤ 64 pages) is far below this.
pub const MAX_SCAN_PAGES: usize = 1_000_000;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print a key's value (exit 1 if the key does not exist).
    Get(KeyArgs),
    /// Set a key (exit 1 if --nx/--nex was not met).
    Set(SetArgs),
    /// Delete a key (exit 1 if it did not exist).
    Del(KeyArgs),
    /// Delete a key only if it holds VALUE (exit 1 if missing or different).
    Vdel(VdelArgs),
    /// List the keys matching a glob pattern (`*`, `?`, `[a-z]`, `[!x]`).
    Scan(ScanArgs),
    /// Print every change of the given keys until interrupted.
    Watch(watch::WatchArgs),
    /// Hold a lock while running a command (acquire with NEX+PX, renew at ttl/3, release with VDEL).
    Lock(lock::LockArgs),
    /// Persistent-notification topics: changes of matching keys delivered to an endpoint.
    #[command(subcommand)]
    Topic(topic::TopicCommand),
}

#[derive(clap::Args)]
pub struct KeyArgs {
    pub key: String,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(clap::Args)]
pub struct SetArgs {
    pub key: String,
    /// The value, `@FILE` to read it from a file, or `-` to read it from stdin.
    pub value: String,
    /// Only set if the key does not exist.
    #[arg(long, conflicts_with = "nex")]
    pub nx: bool,
    /// Only set if the key does not exist or already holds this value (renewing a lock you hold).
    #[arg(long)]
    pub nex: bool,
    /// Expire the key after this many milliseconds.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub px: Option<u64>,
    /// Fencing token (an HLC such as `001696374425000:00001:node`, as printed by `mqstate lock`).
    #[arg(long, value_name = "TOKEN")]
    pub fence: Option<String>,
    /// Ask AIO to persist the key to disk (`aio-persistence`; mqstate persists every key anyway).
    #[arg(long)]
    pub persist: bool,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(clap::Args)]
pub struct VdelArgs {
    pub key: String,
    /// The value the key must hold, `@FILE`, or `-` for stdin.
    pub value: String,
    /// Fencing token.
    #[arg(long, value_name = "TOKEN")]
    pub fence: Option<String>,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(clap::Args)]
pub struct ScanArgs {
    /// Glob over whole keys: `*` (also across `/`), `?`, `[abc]`, `[a-z]`, `[!…]`.
    pub pattern: String,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub async fn run(cmd: Command) -> ExitCode {
    let (output, result) = match cmd {
        Command::Get(args) => (args.output, get(&args).await),
        Command::Set(args) => (args.output, set(&args).await),
        Command::Del(args) => (args.output, del(&args).await),
        Command::Vdel(args) => (args.output, vdel(&args).await),
        Command::Scan(args) => (args.output, scan(&args).await),
        Command::Watch(args) => return watch::run(&args).await,
        Command::Lock(args) => return lock::run(&args).await,
        Command::Topic(command) => return topic::run(command).await,
    };
    output::finish(output, result)
}

fn parse_fence(token: Option<&str>) -> Result<Option<HybridLogicalClock>, CliError> {
    token
        .map(|t| {
            t.parse().map_err(|e| {
                CliError::usage(
                    "--fence",
                    format!("{t:?} is not an HLC like 001696374425000:00001:node ({e})"),
                )
            })
        })
        .transpose()
}

/// Connects, runs `op` on the SDK client, and closes the session whatever happened.
async fn with_store<T, F, Fut>(conn: &ConnectionArgs, op: F) -> Result<T, CliError>
where
    F: FnOnce(std::sync::Arc<azure_iot_operations_services::state_store::Client>) -> Fut,
    Fut: std::future::Future<Output = Result<T, CliError>>,
{
    let store = Store::connect(conn).await?;
    let result = op(store.client.clone()).await;
    store.close().await;
    result
}

async fn get(args: &KeyArgs) -> Result<Outcome, CliError> {
    let conn = &args.conn;
    let key = args.key.as_bytes().to_vec();
    let response = with_store(conn, |client| async move {
        client
            .get(key, conn.timeout())
            .await
            .map_err(|e| map_error("GET", &conn.addr(), conn.timeout, &e))
    })
    .await?;
    let mut out = Outcome::new(EXIT_OK, json!({}));
    value::put_bytes(out.object(), "key", args.key.as_bytes());
    match response.response {
        Some(data) => {
            out.object().insert("found".into(), true.into());
            value::put_bytes(out.object(), "value", &data);
            if let Some(version) = response.version {
                out.object()
                    .insert("version".into(), version.to_string().into());
            }
            out.values.push(data);
        }
        None => {
            out.status = EXIT_NOT_MET;
            out.object().insert("found".into(), false.into());
            out.note = Some(format!(
                "key {} not found",
                value::escape(args.key.as_bytes())
            ));
        }
    }
    Ok(out)
}

async fn set(args: &SetArgs) -> Result<Outcome, CliError> {
    let conn = &args.conn;
    let data = read_value(&args.value)?;
    let fence = parse_fence(args.fence.as_deref())?;
    let options = SetOptions {
        set_condition: if args.nx {
            SetCondition::OnlyIfDoesNotExist
        } else if args.nex {
            SetCondition::OnlyIfEqualOrDoesNotExist
        } else {
            SetCondition::Unconditional
        },
        expires: args.px.map(Duration::from_millis),
        persist: args.persist,
    };
    let key = args.key.as_bytes().to_vec();
    let response = with_store(conn, |client| async move {
        client
            .set(key, data, conn.timeout(), fence, options)
            .await
            .map_err(|e| map_error("SET", &conn.addr(), conn.timeout, &e))
    })
    .await?;
    let mut out = Outcome::new(EXIT_OK, json!({ "applied": response.response }));
    if let Some(version) = response.version {
        out.object()
            .insert("version".into(), version.to_string().into());
    }
    if response.response {
        out.text = Some("OK".into());
    } else {
        out.status = EXIT_NOT_MET;
        out.note = Some(if args.nx {
            "not set: the key exists (--nx)".into()
        } else {
            "not set: the key holds another value (--nex)".into()
        });
    }
    Ok(out)
}

async fn del(args: &KeyArgs) -> Result<Outcome, CliError> {
    let conn = &args.conn;
    let key = args.key.as_bytes().to_vec();
    let response = with_store(conn, |client| async move {
        client
            .del(key, None, conn.timeout())
            .await
            .map_err(|e| map_error("DEL", &conn.addr(), conn.timeout, &e))
    })
    .await?;
    Ok(deleted_outcome(&args.key, response.response))
}

async fn vdel(args: &VdelArgs) -> Result<Outcome, CliError> {
    let conn = &args.conn;
    let data = read_value(&args.value)?;
    let fence = parse_fence(args.fence.as_deref())?;
    let key = args.key.as_bytes().to_vec();
    let response = with_store(conn, |client| async move {
        client
            .vdel(key, data, fence, conn.timeout())
            .await
            .map_err(|e| map_error("VDEL", &conn.addr(), conn.timeout, &e))
    })
    .await?;
    Ok(deleted_outcome(&args.key, response.response))
}

/// DEL and VDEL replies: 1 deleted, 0 missing, -1 value differs (VDEL only).
fn deleted_outcome(key: &str, count: i64) -> Outcome {
    let shown = value::escape(key.as_bytes());
    match count {
        1 => {
            let mut out = Outcome::new(EXIT_OK, json!({ "deleted": true }));
            out.text = Some("deleted".into());
            out
        }
        0 => {
            let mut out = Outcome::new(
                EXIT_NOT_MET,
                json!({ "deleted": false, "reason": "not found" }),
            );
            out.note = Some(format!("key {shown} not found"));
            out
        }
        _ => {
            let mut out = Outcome::new(
                EXIT_NOT_MET,
                json!({ "deleted": false, "reason": "value differs" }),
            );
            out.note = Some(format!("key {shown} holds another value; not deleted"));
            out
        }
    }
}

async fn scan(args: &ScanArgs) -> Result<Outcome, CliError> {
    let mut client = rpc::RawClient::connect(&args.conn).await?;
    let result = scan_pages(&mut client, args.pattern.as_bytes()).await;
    client.close().await;
    let keys = result?;
    let listed: Vec<serde_json::Value> = keys
        .iter()
        .map(|k| match std::str::from_utf8(k) {
            Ok(text) => json!(text),
            Err(_) => json!({ "hex": value::hex(k) }),
        })
        .collect();
    let mut out = Outcome::new(EXIT_OK, json!({ "keys": listed }));
    out.values = keys.into_iter().map(|k| k.to_vec()).collect();
    out.values_are_lines = true;
    Ok(out)
}

async fn scan_pages(client: &mut rpc::RawClient, pattern: &[u8]) -> Result<Vec<Bytes>, CliError> {
    let mut keys = Vec::new();
    let mut token: Option<Bytes> = None;
    for _ in 0..MAX_SCAN_PAGES {
        let mut request = vec![Bytes::from_static(b"SCAN"), Bytes::copy_from_slice(pattern)];
        request.extend(token.take());
        let payload = client.request(&request).await?;
        match rpc::parse_reply("SCAN", &payload)? {
            Reply::Keys {
                keys: page,
                continuation,
            } => {
                keys.extend(page);
                match continuation {
                    Some(next) => token = Some(next),
                    None => return Ok(keys),
                }
            }
            other => {
                return Err(CliError::Protocol {
                    command: "SCAN".into(),
                    detail: format!("expected a key list, got {other:?}"),
                })
            }
        }
    }
    Err(CliError::Protocol {
        command: "SCAN".into(),
        detail: format!("still paging after {MAX_SCAN_PAGES} pages"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[test]
    fn command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn set_flags_parse() {
        let cli = Cli::try_parse_from([
            "m", "set", "k", "v", "--nex", "--px", "500", "--key", "k.pem", "--cert", "c.pem",
        ])
        .unwrap();
        let Command::Set(args) = cli.command else {
            panic!("not set")
        };
        assert!(args.nex && !args.nx);
        assert_eq!(args.px, Some(500));
        assert_eq!(args.key, "k");
        assert!(Cli::try_parse_from(["m", "set", "k", "v", "--nx", "--nex"]).is_err());
        assert!(Cli::try_parse_from(["m", "set", "k", "v", "--px", "0"]).is_err());
    }

    #[test]
    fn lock_takes_the_command_after_double_dash() {
        let cli = Cli::try_parse_from(["m", "lock", "L", "--ttl", "3000", "--", "echo", "--flag"])
            .unwrap();
        let Command::Lock(args) = cli.command else {
            panic!("not lock")
        };
        assert_eq!(args.command, ["echo", "--flag"]);
        assert!(Cli::try_parse_from(["m", "lock", "L", "--ttl", "3000"]).is_err());
    }

    #[test]
    fn fence_tokens_are_checked_before_connecting() {
        assert!(parse_fence(Some("001696374425000:00001:node"))
            .unwrap()
            .is_some());
        let err = parse_fence(Some("yesterday")).unwrap_err();
        assert!(err.to_string().contains("--fence"));
    }

    #[test]
    fn delete_counts_map_to_exit_statuses() {
        assert_eq!(deleted_outcome("k", 1).status, EXIT_OK);
        assert_eq!(deleted_outcome("k", 0).status, EXIT_NOT_MET);
        let differs = deleted_outcome("k", -1);
        assert_eq!(differs.status, EXIT_NOT_MET);
        assert_eq!(differs.json["reason"], "value differs");
    }
}
