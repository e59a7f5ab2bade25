//! `mqstate lock NAME --ttl MS -- COMMAND…`: hold a lease while a command runs.
//!
//! Acquire is `SET NAME <client id> NEX PX ttl` (the AIO lease pattern, as the SDK's leased-lock client
//! sends it), renewed every ttl/3 (so two renewals can fail before the lease lapses); the command gets
//! the fencing token (the SET's `__ts`) in `MQSTATE_FENCING_TOKEN`; release is `VDEL NAME <client id>`.
//!
//! The lock is released only once the command has ended: SIGTERM, SIGINT and SIGHUP (what `timeout`,
//! systemd and a terminal send) are forwarded to the command, which is waited for while the lease is
//! still renewed. A command that cannot start releases the lock at once. If a renewal fails the command
//! is killed: it can no longer be sure it holds the lock. Exit status: the command's, or 128+n when a
//! signal n ended it, as a shell reports it.

use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::{Hlc, Reply};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

use super::connection::ConnectionArgs;
use super::error::{CliError, EXIT_FAILED};
use super::rpc::{self, RawClient};

/// How often `--wait` retries a lock held by someone else.
pub const WAIT_RETRY: Duration = Duration::from_millis(200);
/// Renewals per TTL: renewing at ttl/3 survives one lost or slow renewal.
pub const RENEWALS_PER_TTL: u32 = 3;
/// Environment variable carrying the fencing token to the command.
pub const FENCING_TOKEN_ENV: &str = "MQSTATE_FENCING_TOKEN";
/// Shortest TTL: renewals every ttl/3 must leave time for a request round trip.
pub const MIN_TTL_MS: u64 = 30;
/// Exit status base of a command ended by a signal (a shell's `128 + n`).
pub const EXIT_SIGNAL_BASE: i32 = 128;

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
    // Before connecting: from here on these signals are ours to forward, not to die of.
    let mut signals = Signals::register()?;
    let mut client = RawClient::connect(&args.conn).await?;
    let result = hold(&mut client, args, &mut signals).await;
    client.close().await;
    result
}

/// `SET NAME holder NEX PX ttl`: the fencing token if we hold the lock now, `None` if another does.
async fn acquire(client: &mut RawClient, args: &LockArgs) -> Result<Option<Hlc>, CliError> {
    let request = [
        Bytes::from_static(b"SET"),
        Bytes::from(args.name.clone().into_bytes()),
        Bytes::from(client.client_id().as_bytes().to_vec()),
        Bytes::from_static(b"NEX"),
        Bytes::from_static(b"PX"),
        Bytes::from(args.ttl.to_string()),
    ];
    let response = client.request(&request, None).await?;
    match rpc::parse_reply("SET", &response.payload)? {
        Reply::Ok => {
            let token = response.ts.as_deref().and_then(|t| Hlc::parse(t).ok());
            token.map(Some).ok_or_else(|| CliError::Protocol {
                command: "SET".into(),
                detail: "no valid __ts (the fencing token) on the reply".into(),
            })
        }
        Reply::Integer(-1) | Reply::Nil => Ok(None),
        other => Err(CliError::Protocol {
            command: "SET".into(),
            detail: format!("unexpected reply {other:?}"),
        }),
    }
}

/// `VDEL NAME holder`: best effort; the lease expires by itself otherwise.
async fn release(client: &mut RawClient, args: &LockArgs) {
    let request = [
        Bytes::from_static(b"VDEL"),
        Bytes::from(args.name.clone().into_bytes()),
        Bytes::from(client.client_id().as_bytes().to_vec()),
    ];
    if let Err(e) = client.request(&request, None).await {
        eprintln!(
            "mqstate: could not release lock {} ({e}); it expires by itself after {} ms",
            args.name, args.ttl
        );
    }
}

async fn hold(
    client: &mut RawClient,
    args: &LockArgs,
    signals: &mut Signals,
) -> Result<ExitCode, CliError> {
    let ttl = Duration::from_millis(args.ttl);
    let token = loop {
        match acquire(client, args).await? {
            Some(token) => break token,
            None if args.wait => {
                tokio::select! {
                    () = tokio::time::sleep(WAIT_RETRY.min(ttl)) => {}
                    signal = signals.next() => {
                        let code = EXIT_SIGNAL_BASE + signal as i32;
                        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(EXIT_FAILED)));
                    }
                }
            }
            None => {
                return Err(CliError::LockHeld {
                    name: args.name.clone(),
                })
            }
        }
    };
    eprintln!(
        "mqstate: lock {} acquired; fencing token {token}",
        args.name
    );
    let outcome = supervise(client, args, signals, &token).await;
    release(client, args).await;
    outcome
}

/// Runs the command while renewing the lease; forwards signals to it and waits for it.
async fn supervise(
    client: &mut RawClient,
    args: &LockArgs,
    signals: &mut Signals,
    token: &Hlc,
) -> Result<ExitCode, CliError> {
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
    let renew_every = Duration::from_millis(args.ttl) / RENEWALS_PER_TTL;
    let mut next_renewal = Instant::now() + renew_every;
    let lost = loop {
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|source| CliError::Spawn {
                    program: program.clone(),
                    source,
                })?;
                return Ok(exit_code(status));
            }
            () = tokio::time::sleep_until(next_renewal) => {
                match acquire(client, args).await {
                    Ok(Some(_)) => next_renewal += renew_every,
                    Ok(None) => break "another client holds it now".to_owned(),
                    Err(e) => break e.to_string(),
                }
            }
            unexpected = client.notification() => {
                // Nothing else is subscribed: only the end of the connection gets here.
                if let Err(e) = unexpected {
                    break e.to_string();
                }
            }
            signal = signals.next() => {
                if let Some(pid) = child.id() {
                    forward(signal, pid);
                }
            }
        }
    };
    // The lease may lapse any moment now: the command must not go on believing it holds the lock.
    let _ = child.kill().await;
    Err(CliError::LockLost {
        name: args.name.clone(),
        reason: lost,
    })
}

/// A shell's exit status for the command: its own code, or 128+n when signal n ended it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => EXIT_SIGNAL_BASE + signal,
        (None, None) => i32::from(EXIT_FAILED),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(EXIT_FAILED))
}

/// The signals `lock` forwards to its command.
struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl Signals {
    fn register() -> Result<Signals, CliError> {
        let listen = |kind: SignalKind| {
            signal(kind).map_err(|source| CliError::Input {
                what: "signal handlers".into(),
                source,
            })
        };
        Ok(Signals {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
            hup: listen(SignalKind::hangup())?,
        })
    }

    /// The next of these signals to arrive.
    async fn next(&mut self) -> nix::sys::signal::Signal {
        use nix::sys::signal::Signal as S;
        tokio::select! {
            _ = self.term.recv() => S::SIGTERM,
            _ = self.int.recv() => S::SIGINT,
            _ = self.hup.recv() => S::SIGHUP,
        }
    }
}

fn forward(signal: nix::sys::signal::Signal, pid: u32) {
    let Ok(pid) = i32::try_from(pid) else {
        return;
    };
    // The child may have exited meanwhile; its wait() reports that.
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exit_status_is_the_commands_or_128_plus_the_signal() {
        // Raw wait statuses: exit code n is n << 8; death by signal n is n.
        assert_eq!(
            exit_code(std::process::ExitStatus::from_raw(7 << 8)),
            ExitCode::from(7)
        );
        assert_eq!(
            exit_code(std::process::ExitStatus::from_raw(15)),
            ExitCode::from(143)
        );
        assert_eq!(
            exit_code(std::process::ExitStatus::from_raw(9)),
            ExitCode::from(137)
        );
    }
}
