//! `mqstate lock NAME --ttl MS -- COMMAND…`: hold a lease while a command runs.
//!
//! Acquire is `SET NAME <client id> NEX PX ttl` through the SDK's lease client, renewed every ttl/3 (so two
//! renewals can fail before the lease lapses); the command gets the fencing token in
//! `MQSTATE_FENCING_TOKEN`; release is `VDEL NAME <client id>`. If a renewal fails the command is killed:
//! it can no longer be sure it holds the lock.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use azure_iot_operations_services::leased_lock::{self, lease};
use azure_iot_operations_services::state_store;

use super::connection::ConnectionArgs;
use super::error::{CliError, EXIT_FAILED};
use super::sdk::{map_error, Store};

/// How often `--wait` retries a lock held by someone else.
pub const WAIT_RETRY: Duration = Duration::from_millis(200);
/// Renewals per TTL: renewing at ttl/3 survives one lost or slow renewal.
pub const RENEWALS_PER_TTL: u32 = 3;
/// Environment variable carrying the fencing token to the command.
pub const FENCING_TOKEN_ENV: &str = "MQSTATE_FENCING_TOKEN";
/// Shortest TTL: renewals every ttl/3 must leave time for a request round trip.
pub const MIN_TTL_MS: u64 = 30;

#[derive(clap::Args)]
pub struct LockArgs {
    /// The lock's key.
    pub name: String,
    /// Lease time in milliseconds; renewed every ttl/3 while the command runs.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(MIN_TTL_MS..))]
    pub ttl: u64,
    /// Wait for the lock if someone else holds it (default: exit 1 at once).
    #[arg(long)]
    pub wait: bool,
    /// The command to run while holding the lock.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
    #[command(flatten)]
    pub conn: ConnectionArgs,
}

pub async fn run(args: &LockArgs) -> ExitCode {
    match lock(args).await {
        Ok(code) => code,
        Err(e) => e.report(),
    }
}

async fn lock(args: &LockArgs) -> Result<ExitCode, CliError> {
    let store = Store::connect(&args.conn).await?;
    let result = hold(&store, args).await;
    store.close().await;
    result
}

fn lease_error(args: &LockArgs, error: leased_lock::Error) -> CliError {
    match error.kind() {
        leased_lock::ErrorKind::LeaseAlreadyHeld => CliError::LockHeld {
            name: args.name.clone(),
        },
        _ => {
            // Re-express through the state-store mapping so exit codes and hints match other commands.
            let kind = match error.kind() {
                leased_lock::ErrorKind::ServiceError(e) => {
                    state_store::ErrorKind::ServiceError(clone_service_error(e))
                }
                other => state_store::ErrorKind::UnexpectedPayload(other.to_string()),
            };
            map_error(
                "SET NEX",
                &args.conn.addr(),
                args.conn.timeout,
                &state_store::Error::from(kind),
            )
        }
    }
}

fn clone_service_error(e: &state_store::ServiceError) -> state_store::ServiceError {
    state_store::ServiceError::from(e.to_string().into_bytes())
}

async fn hold(store: &Store, args: &LockArgs) -> Result<ExitCode, CliError> {
    let ttl = Duration::from_millis(args.ttl);
    let timeout = args.conn.timeout();
    let lease = lease::Client::new(
        Arc::clone(&store.client),
        args.name.as_bytes().to_vec(),
        store.client_id.as_bytes().to_vec(),
    )
    .map_err(|e| CliError::usage("lock name", e.to_string()))?;
    let token = loop {
        match lease.acquire(ttl, timeout, None).await {
            Ok(token) => break token,
            Err(e) if args.wait && matches!(e.kind(), leased_lock::ErrorKind::LeaseAlreadyHeld) => {
                tokio::time::sleep(WAIT_RETRY.min(ttl)).await;
            }
            Err(e) => return Err(lease_error(args, e)),
        }
    };
    eprintln!(
        "mqstate: lock {} acquired; fencing token {token}",
        args.name
    );

    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| CliError::usage("lock", "no command given after --"))?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .env(FENCING_TOKEN_ENV, token.to_string())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| CliError::Spawn {
            program: program.clone(),
            source,
        })?;

    let renew_every = ttl / RENEWALS_PER_TTL;
    let mut renewals =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    let outcome = loop {
        tokio::select! {
            status = child.wait() => break status.map_err(|source| CliError::Spawn {
                program: program.clone(),
                source,
            }),
            _ = renewals.tick() => {
                if let Err(e) = lease.acquire(ttl, timeout, None).await {
                    let _ = child.kill().await;
                    return Err(CliError::LockLost { name: args.name.clone(), reason: e.to_string() });
                }
            }
            error = store.disconnected() => {
                let _ = child.kill().await;
                return Err(CliError::LockLost { name: args.name.clone(), reason: error.to_string() });
            }
            _ = tokio::signal::ctrl_c() => {
                let _ = child.kill().await;
                break Ok(std::process::ExitStatus::default());
            }
        }
    };
    if let Err(e) = lease.release(timeout).await {
        eprintln!(
            "mqstate: could not release lock {} ({e}); it expires by itself after {} ms",
            args.name, args.ttl
        );
    }
    let status = outcome?;
    Ok(match status.code() {
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(EXIT_FAILED)),
        None => ExitCode::from(EXIT_FAILED),
    })
}
