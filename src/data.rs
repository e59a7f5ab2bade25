//! `mqstate data inspect|verify|repair DIR`: the operator's tools for a data directory.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print segments, records (decoded deltas), snapshot and metadata.
    Inspect { dir: PathBuf },
}

pub fn run(cmd: Command) -> ExitCode {
    match cmd {
        Command::Inspect { dir } => {
            eprintln!("mqstate data inspect {}: not implemented yet", dir.display());
            ExitCode::from(2)
        }
    }
}
