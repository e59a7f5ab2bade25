//! `mqstate completions SHELL` and `mqstate man`: shell completions and man pages rendered from the same
//! clap definitions that parse the command line, so they cannot drift from it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::CommandFactory;

use crate::Cli;

/// Shells `mqstate completions` writes a script for.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
    Elvish,
    Powershell,
}

#[derive(clap::Args)]
pub struct CompletionsArgs {
    /// The shell, e.g. `mqstate completions bash > /etc/bash_completion.d/mqstate`,
    /// `mqstate completions zsh > "${fpath[1]}/_mqstate"`,
    /// `mqstate completions fish > ~/.config/fish/completions/mqstate.fish`.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(clap::Args)]
pub struct ManArgs {
    /// Write `mqstate.1` and one page per subcommand (`mqstate-get.1`, ...) into this directory
    /// instead of printing `mqstate.1` on standard output.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

pub fn completions(args: &CompletionsArgs) -> ExitCode {
    use clap_complete::Shell as S;
    let shell = match args.shell {
        Shell::Bash => S::Bash,
        Shell::Zsh => S::Zsh,
        Shell::Fish => S::Fish,
        Shell::Elvish => S::Elvish,
        Shell::Powershell => S::PowerShell,
    };
    let mut command = Cli::command();
    clap_complete::generate(shell, &mut command, "mqstate", &mut std::io::stdout());
    ExitCode::SUCCESS
}

pub fn man(args: &ManArgs) -> ExitCode {
    let result = match &args.dir {
        Some(dir) => write_pages(dir),
        None => render(&Cli::command()).and_then(|page| {
            std::io::stdout()
                .write_all(&page)
                .context("cannot write the man page")
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mqstate man: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn render(command: &clap::Command) -> anyhow::Result<Vec<u8>> {
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone())
        .render(&mut page)
        .context("cannot render the man page")?;
    Ok(page)
}

/// `mqstate.1`, then `mqstate-<sub>.1` for every subcommand (nested ones too, e.g. `mqstate-data-verify.1`).
fn write_pages(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut command = Cli::command();
    command.build();
    write_tree(dir, &command, "mqstate")
}

fn write_tree(dir: &Path, command: &clap::Command, name: &str) -> anyhow::Result<()> {
    let command = command.clone().name(name.to_owned());
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, render(&command)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    for sub in command.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        write_tree(dir, sub, &format!("{name}-{}", sub.get_name()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The commands users run, whichever crate implements them (`crates/cli`, `crates/bench`, `src/`):
    /// each has its man page and its completion.
    const COMMANDS: &[&str] = &[
        "serve",
        "get",
        "set",
        "del",
        "vdel",
        "scan",
        "watch",
        "lock",
        "topic",
        "cluster",
        "bench",
        "data",
        "passwd",
        "completions",
        "man",
    ];

    #[test]
    fn every_subcommand_has_a_man_page_and_a_completion() {
        let dir = tempfile::tempdir().unwrap();
        write_pages(dir.path()).unwrap();
        let mut command = Cli::command();
        command.build();
        let names: Vec<&str> = command
            .get_subcommands()
            .map(|sub| sub.get_name())
            .filter(|name| *name != "help")
            .collect();
        assert_eq!(names, COMMANDS, "the top-level commands changed");
        let mut bash = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "mqstate",
            &mut bash,
        );
        let bash = String::from_utf8(bash).unwrap();
        for name in COMMANDS {
            assert!(
                dir.path().join(format!("mqstate-{name}.1")).is_file(),
                "no man page for {name}"
            );
            assert!(
                bash.contains(&format!("cmd=\"mqstate__subcmd__{name}\"")),
                "no completion for {name}"
            );
        }
        for nested in [
            "mqstate-topic-create.1",
            "mqstate-cluster-status.1",
            "mqstate-data-verify.1",
        ] {
            assert!(dir.path().join(nested).is_file(), "no man page {nested}");
        }
    }
}
