//! `mqstate`: one binary for the broker (`serve`), the state-store CLI (`get`, `set`, ...), the load
//! generator (`bench`) and the data tools (`data inspect|verify|repair`). The CLI and `bench` are crates of
//! their own (`crates/cli`, `crates/bench`); this file dispatches to them.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mqstate_bench as bench;
use mqstate_cli as client;

mod auth;
mod cluster;
mod data;
mod manual;
mod metrics;
mod repeated_logs;
mod serve;
mod settings;

/// jemalloc, not the C library's malloc: with a million keys it holds 208 MB after a load where
/// glibc holds 243 MB (size-segregated slabs; the keyspace's 128-byte slots fill a size class),
/// decision 0015.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "mqstate",
    version,
    about = "MQTT 5 broker with a built-in durable state store"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker and state store (default: 127.0.0.1:1883, data in ./data).
    Serve(Box<ServeArgs>),
    #[command(flatten)]
    Client(client::Command),
    /// Cluster status and membership (over any node's MQTT port).
    #[command(subcommand)]
    Cluster(client::cluster::Command),
    /// Load generator for any AIO state store (or plain MQTT pub/sub).
    Bench(bench::BenchArgs),
    /// Inspect, verify or repair a data directory (offline).
    #[command(subcommand)]
    Data(data::Command),
    /// Add, change or delete a user in a password file (argon2id hashes).
    Passwd(auth::passwd::PasswdArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(manual::CompletionsArgs),
    /// Print the man page (roff), or write one page per command with --dir.
    Man(manual::ManArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Settings file (TOML, or JSON if it ends in .json); flags and MQSTATE_* variables override it.
    #[arg(long, env = "MQSTATE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: settings::Settings,
}

/// A command once `serve`'s settings are resolved.
// One value per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Run {
    Serve(settings::Resolved),
    Other(Command),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Client(_) | Command::Data(_) | Command::Completions(_) | Command::Man(_)
    ) {
        quiet_on_closed_pipe();
    }
    let mut builder = match &cli.command {
        Command::Bench(args) => bench::runtime(args),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    // `serve` sizes its runtime from its settings, so they are resolved first.
    let command = match cli.command {
        Command::Serve(args) => match serve::settings(args.config, args.settings) {
            Ok(settings) => {
                builder.worker_threads(settings.worker_threads());
                Run::Serve(settings)
            }
            Err(e) => {
                eprintln!("mqstate: {}", error_chain(&e));
                return ExitCode::FAILURE;
            }
        },
        other => Run::Other(other),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mqstate: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(async move {
        let command = match command {
            Run::Serve(settings) => {
                return match serve::run(settings).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("mqstate: {}", error_chain(&e));
                        ExitCode::FAILURE
                    }
                }
            }
            Run::Other(command) => command,
        };
        match command {
            Command::Serve(_) => unreachable!("resolved into Run::Serve above"),
            Command::Client(cmd) => client::run(cmd).await,
            Command::Cluster(cmd) => client::cluster::run(cmd).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Data(cmd) => data::run(cmd),
            Command::Completions(args) => manual::completions(&args),
            Command::Man(args) => manual::man(&args),
            Command::Passwd(args) => match auth::passwd::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("mqstate passwd: {}", error_chain(&e));
                    ExitCode::FAILURE
                }
            },
        }
    })
}

/// An error and its causes, `: `-separated like `{:#}`, except a cause whose text the message
/// before it already ends with (an error that prints its source, an `io::Error` most often): one
/// "Permission denied (os error 13)", not two.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    }
    text
}

/// `mqstate data inspect | head` and `mqstate scan '*' | head` end quietly when the reader goes away,
/// as `cat` does: SIGPIPE ends the process (status 141) instead of a write error or a `println!`
/// panic. Not for `serve`, which must outlive any one peer's closed socket.
#[allow(unsafe_code)]
fn quiet_on_closed_pipe() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_DFL installs no handler code, and this runs before any other thread exists (the
    // async runtime is built afterwards), so nothing races with the change of disposition.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("open the lock file /d/LOCK: {source}")]
    struct Shows {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn a_cause_the_message_already_shows_is_printed_once() {
        let io = std::io::Error::from_raw_os_error(13);
        let shown = io.to_string();
        let e =
            anyhow::Error::new(Shows { source: io }).context("cannot open the data directory /d");
        assert_eq!(
            error_chain(&e),
            format!("cannot open the data directory /d: open the lock file /d/LOCK: {shown}")
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_chain(&plain), "outer: inner");
    }
}
