//! `mqstate cluster status|add-node|remove-node|partition-of`: the operator's view of a cluster,
//! over any node's MQTT port like the other CLI commands (a JSON request on the admin topic, the
//! reply on this client's response topic; see `mqstate_cluster::admin`).

use std::process::ExitCode;

use bytes::Bytes;
use mqstate_cluster::admin::{AdminCall, AdminReply, ADMIN_TOPIC};

use super::connection::ConnectionArgs;
use super::error::CliError;
use super::rpc::RawClient;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Show the leader, the members and every partition's chain and views, as one node sees them.
    Status(StatusArgs),
    /// Add a node (started with --join) to the cluster, by id and cluster address.
    AddNode(AddNodeArgs),
    /// Remove a node from the cluster (it is listed no more; its id is never reused).
    RemoveNode(RemoveNodeArgs),
    /// Print the partition a key belongs to and that partition's chain.
    PartitionOf(PartitionOfArgs),
}

#[derive(clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

#[derive(clap::Args)]
pub struct AddNodeArgs {
    /// The new node's id (a positive number never used before).
    pub id: u64,
    /// Its cluster address (its --cluster-listen as the other nodes reach it), HOST:PORT.
    pub addr: String,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

#[derive(clap::Args)]
pub struct RemoveNodeArgs {
    pub id: u64,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

#[derive(clap::Args)]
pub struct PartitionOfArgs {
    pub key: String,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

pub async fn run(cmd: Command) -> ExitCode {
    match execute(cmd).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => e.report(),
    }
}

async fn execute(cmd: Command) -> Result<(), CliError> {
    match cmd {
        Command::Status(args) => {
            let reply = call(&args.conn, "cluster status", &AdminCall::Status).await?;
            let status = reply.status.ok_or_else(|| missing("cluster status"))?;
            if args.json {
                println!("{}", to_json(&status));
            } else {
                print!("{}", status.render_table());
            }
        }
        Command::AddNode(args) => {
            if args.id == 0 {
                return Err(CliError::usage("node id", "node ids start at 1"));
            }
            let request = AdminCall::AddNode {
                id: args.id,
                addr: args.addr.clone(),
            };
            call(&args.conn, "cluster add-node", &request).await?;
            println!("node {} ({}) added to the cluster", args.id, args.addr);
        }
        Command::RemoveNode(args) => {
            call(
                &args.conn,
                "cluster remove-node",
                &AdminCall::RemoveNode { id: args.id },
            )
            .await?;
            println!("node {} removed from the cluster", args.id);
        }
        Command::PartitionOf(args) => {
            let request = AdminCall::PartitionOf {
                key: args.key.clone(),
            };
            let reply = call(&args.conn, "cluster partition-of", &request).await?;
            let placement = reply
                .placement
                .ok_or_else(|| missing("cluster partition-of"))?;
            if args.json {
                println!("{}", to_json(&placement));
            } else {
                let chain: Vec<String> = placement.chain.iter().map(u64::to_string).collect();
                println!(
                    "key {:?}: partition {}, chain {} (head first), view {}",
                    placement.key,
                    placement.partition,
                    chain.join(" → "),
                    placement.view
                );
            }
        }
    }
    Ok(())
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

fn missing(command: &str) -> CliError {
    CliError::Protocol {
        command: command.to_owned(),
        detail: "the reply holds neither a result nor an error".into(),
    }
}

/// One request/response exchange on the admin topic; a reply with an error becomes
/// [`CliError::Admin`]. Also the bench's way to learn where keys are headed.
pub async fn call(
    conn: &ConnectionArgs,
    command: &str,
    request: &AdminCall,
) -> Result<AdminReply, CliError> {
    let payload = serde_json::to_vec(request).map_err(|e| CliError::Protocol {
        command: command.to_owned(),
        detail: format!("cannot encode the request: {e}"),
    })?;
    let mut client = RawClient::connect(conn).await?;
    let reply = client
        .call(ADMIN_TOPIC, Bytes::from(payload), command)
        .await;
    client.close().await;
    let reply = serde_json::from_slice::<AdminReply>(&reply?).map_err(|e| CliError::Protocol {
        command: command.to_owned(),
        detail: format!("the reply is not an admin reply: {e}"),
    })?;
    match reply.error {
        Some(text) => Err(CliError::Admin {
            command: command.to_owned(),
            text,
        }),
        None => Ok(reply),
    }
}
