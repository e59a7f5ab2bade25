//! `mqstate topic create|list|get|stats|rm`: persistent-notification topics, over the admin RPC of
//! any mqstate node (a JSON request on `mqstate/admin/v1/notify`, the reply on our response topic).

use bytes::Bytes;
use mqstate_protocol::topic::NOTIFY_ADMIN_TOPIC as ADMIN_TOPIC;
use serde_json::{json, Value};

use super::connection::ConnectionArgs;
use super::error::{CliError, EXIT_OK};
use super::output::{self, Outcome};
use super::rpc::RawClient;
use super::value::OutputArgs;
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum TopicCommand {
    /// Create a topic (or replace its definition; its queue stays).
    Create(CreateArgs),
    /// List the topics.
    List(CommonArgs),
    /// Print a topic's definition.
    Get(NameArgs),
    /// Print a topic's queue and delivery figures and who owns it.
    Stats(NameArgs),
    /// Delete a topic with its queue and pending notifications.
    Rm(NameArgs),
}

#[derive(clap::Args)]
pub struct CommonArgs {
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(clap::Args)]
pub struct NameArgs {
    pub name: String,
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(clap::Args)]
pub struct CreateArgs {
    pub name: String,
    /// http(s)://host:port/path (a JSON batch per POST) or mqtt(s)://host:port/topic (QoS 1 per record).
    #[arg(long)]
    pub endpoint: String,
    /// Key pattern (SCAN glob) of the keys whose changes are notified.
    #[arg(long)]
    pub keys: String,
    /// Events to notify, comma-separated: set, delete, expire (default: all three).
    #[arg(long, value_delimiter = ',')]
    pub events: Vec<String>,
    /// Entries (reserved slots included) the queue holds before writes are refused (default 10000).
    #[arg(long)]
    pub max_queue: Option<u32>,
    #[command(flatten)]
    pub common: CommonArgs,
}

pub async fn run(command: TopicCommand) -> ExitCode {
    let (common, request, label) = match command {
        TopicCommand::Create(args) => {
            let mut request = json!({
                "op": "create", "name": args.name, "endpoint": args.endpoint, "keys": args.keys,
            });
            if !args.events.is_empty() {
                request["events"] = json!(args.events);
            }
            if let Some(max) = args.max_queue {
                request["max_queue"] = json!(max);
            }
            (args.common, request, "topic create")
        }
        TopicCommand::List(common) => (common, json!({"op": "list"}), "topic list"),
        TopicCommand::Get(a) => (a.common, json!({"op": "get", "name": a.name}), "topic get"),
        TopicCommand::Stats(a) => (
            a.common,
            json!({"op": "stats", "name": a.name}),
            "topic stats",
        ),
        TopicCommand::Rm(a) => (a.common, json!({"op": "rm", "name": a.name}), "topic rm"),
    };
    let result = admin(&common.conn, &request, label).await.map(|reply| {
        let mut outcome = Outcome::new(EXIT_OK, reply.clone());
        outcome.text = Some(human(&request, &reply));
        outcome
    });
    output::finish(common.output, result)
}

/// The plain-text form of a reply.
fn human(request: &Value, reply: &Value) -> String {
    match request["op"].as_str() {
        Some("list") => reply["topics"]
            .as_array()
            .map(|topics| {
                topics
                    .iter()
                    .map(|t| {
                        format!(
                            "{}\t{}\t{}",
                            t["name"].as_str().unwrap_or(""),
                            t["keys"].as_str().unwrap_or(""),
                            t["endpoint"].as_str().unwrap_or("")
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default(),
        Some("rm") => "deleted".into(),
        _ => serde_json::to_string_pretty(reply).unwrap_or_default(),
    }
}

/// Sends one admin request and waits for its reply.
async fn admin(conn: &ConnectionArgs, request: &Value, label: &str) -> Result<Value, CliError> {
    let mut client = RawClient::connect(conn).await?;
    let payload = client
        .call(ADMIN_TOPIC, Bytes::from(request.to_string()), label)
        .await;
    client.close().await;
    let reply: Value = serde_json::from_slice(&payload?).map_err(|e| CliError::Protocol {
        command: label.to_owned(),
        detail: format!("the reply is not JSON: {e}"),
    })?;
    if let Some(error) = reply["error"].as_str() {
        return Err(CliError::Service {
            command: label.to_owned(),
            text: error.to_owned(),
            condition: false,
        });
    }
    Ok(reply)
}
