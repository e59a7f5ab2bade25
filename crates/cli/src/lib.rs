//! The state-store CLI (`get`, `set`, `del`, `vdel`, `scan`, `watch`, `lock`), like redis-cli or
//! etcdctl, for any AIO-compatible broker.
//!
//! Every command speaks the state-store protocol over our own MQTT 5 client ([`rpc`] over [`wire`],
//! connected by [`dial`]), the same path `bench` drives; the official AIO SDK is a dev-dependency only,
//! proving the server's compatibility in `tests/`. So the shipped binary links no OpenSSL. Exit status:
//! 0 success, 1 not found / condition not met, 2 usage or connection error (see [`error`]).
//!
//! A new subcommand: a variant of [`Command`] (its arguments struct beside it, or in its own module
//! like [`watch`] and [`lock`]) and its arm in [`run`]; connect with [`rpc::RawClient::connect`].

pub mod cluster;
pub mod connection;
pub mod dial;
pub mod error;
mod lock;
mod output;
pub mod rpc;
pub mod topic;
pub mod value;
mod watch;
pub mod wire;

use std::process::ExitCode;

use bytes::Bytes;
use mqstate_protocol::{Hlc, Reply};
use serde_json::json;

use connection::ConnectionArgs;
use error::{CliError, EXIT_NOT_MET, EXIT_OK};
use output::Outcome;
use rpc::{RawClient, Response};
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

fn parse_fence(token: Option<&str>) -> Result<Option<Hlc>, CliError> {
    token
        .map(|t| {
            Hlc::parse(t).map_err(|e| {
                CliError::usage(
                    "--fence",
                    format!("{t:?} is not an HLC like 001696374425000:00001:node ({e})"),
                )
            })
        })
        .transpose()
}

/// Connects, sends one request, and closes the connection whatever happened.
async fn one_request(
    conn: &ConnectionArgs,
    args: &[Bytes],
    fencing: Option<&Hlc>,
    extra: &[(&str, &str)],
) -> Result<(Reply, Option<String>), CliError> {
    let mut client = RawClient::connect(conn).await?;
    let result = client.request_with(args, fencing, extra).await;
    client.close().await;
    let Response { payload, ts } = result?;
    let command = String::from_utf8_lossy(&args[0]).into_owned();
    Ok((rpc::parse_reply(&command, &payload)?, ts))
}

fn unexpected(command: &str, reply: &Reply) -> CliError {
    CliError::Protocol {
        command: command.to_owned(),
        detail: format!("unexpected reply {reply:?}"),
    }
}

fn arg(bytes: impl Into<Bytes>) -> Bytes {
    bytes.into()
}

async fn get(args: &KeyArgs) -> Result<Outcome, CliError> {
    let request = [arg("GET"), arg(args.key.clone().into_bytes())];
    let (reply, version) = one_request(&args.conn, &request, None, &[]).await?;
    let mut out = Outcome::new(EXIT_OK, json!({}));
    value::put_bytes(out.object(), "key", args.key.as_bytes());
    match reply {
        Reply::Bulk(data) => {
            out.object().insert("found".into(), true.into());
            value::put_bytes(out.object(), "value", &data);
            if let Some(version) = version {
                out.object().insert("version".into(), version.into());
            }
            out.values.push(data.to_vec());
        }
        Reply::Nil => {
            out.status = EXIT_NOT_MET;
            out.object().insert("found".into(), false.into());
            out.note = Some(format!(
                "key {} not found",
                value::escape(args.key.as_bytes())
            ));
        }
        other => return Err(unexpected("GET", &other)),
    }
    Ok(out)
}

async fn set(args: &SetArgs) -> Result<Outcome, CliError> {
    let data = read_value(&args.value)?;
    let fence = parse_fence(args.fence.as_deref())?;
    let mut request = vec![arg("SET"), arg(args.key.clone().into_bytes()), arg(data)];
    if args.nx {
        request.push(arg("NX"));
    } else if args.nex {
        request.push(arg("NEX"));
    }
    if let Some(px) = args.px {
        request.push(arg("PX"));
        request.push(arg(px.to_string()));
    }
    let persist: &[(&str, &str)] = if args.persist {
        &[(rpc::PERSIST, "true")]
    } else {
        &[]
    };
    let (reply, version) = one_request(&args.conn, &request, fence.as_ref(), persist).await?;
    let applied = match reply {
        Reply::Ok => true,
        // A condition (NX, NEX) not met.
        Reply::Integer(-1) | Reply::Nil => false,
        other => return Err(unexpected("SET", &other)),
    };
    let mut out = Outcome::new(EXIT_OK, json!({ "applied": applied }));
    if let Some(version) = version {
        out.object().insert("version".into(), version.into());
    }
    if applied {
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
    let request = [arg("DEL"), arg(args.key.clone().into_bytes())];
    match one_request(&args.conn, &request, None, &[]).await?.0 {
        Reply::Integer(count) => Ok(deleted_outcome(&args.key, count)),
        other => Err(unexpected("DEL", &other)),
    }
}

async fn vdel(args: &VdelArgs) -> Result<Outcome, CliError> {
    let data = read_value(&args.value)?;
    let fence = parse_fence(args.fence.as_deref())?;
    let request = [arg("VDEL"), arg(args.key.clone().into_bytes()), arg(data)];
    match one_request(&args.conn, &request, fence.as_ref(), &[])
        .await?
        .0
    {
        Reply::Integer(count) => Ok(deleted_outcome(&args.key, count)),
        other => Err(unexpected("VDEL", &other)),
    }
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
    let mut client = RawClient::connect(&args.conn).await?;
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

async fn scan_pages(client: &mut RawClient, pattern: &[u8]) -> Result<Vec<Bytes>, CliError> {
    let mut keys = Vec::new();
    let mut token: Option<Bytes> = None;
    for _ in 0..MAX_SCAN_PAGES {
        let mut request = vec![Bytes::from_static(b"SCAN"), Bytes::copy_from_slice(pattern)];
        request.extend(token.take());
        let payload = client.request(&request, None).await?.payload;
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
