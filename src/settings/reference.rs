//! `docs/configuration.md` is rendered from the clap schema of `mqstate serve`; this test fails when the
//! committed file is out of date, so the reference cannot drift from [`super::Settings`].

use std::path::Path;

use clap::CommandFactory;

const REGENERATE: &str = "MQSTATE_UPDATE_DOCS=1 cargo test --bin mqstate configuration_reference";

/// The example settings file shipped in `packaging/`, shown in the reference and checked here.
const EXAMPLE: &str = include_str!("../../packaging/mqstate.toml");

fn serve_command() -> clap::Command {
    crate::Cli::command()
        .find_subcommand("serve")
        .expect("the serve subcommand exists")
        .clone()
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// Splits `"What it is. Default X"` (clap drops the final period) into the description and `X`.
fn split_default(help: &str) -> (String, &str) {
    match help.rsplit_once(". Default") {
        Some((what, default)) => (format!("{what}."), default.trim_start_matches(':').trim()),
        None => (help.to_owned(), ""),
    }
}

fn render() -> String {
    let mut out = format!(
        "# Configuration reference\n\n\
         <!-- Generated from src/settings.rs; do not edit. Regenerate with `{REGENERATE}`. -->\n\n\
         `mqstate serve` reads each setting from, lowest precedence first: the settings file \
         (`--config FILE`: TOML, or JSON when the name ends in `.json`), an `MQSTATE_*` environment \
         variable, and a command-line flag. File keys are the flag names in snake_case. Unknown file keys \
         and invalid values stop the server with an error that names them.\n\n\
         | File key | Flag | Environment | Default | Description |\n\
         |---|---|---|---|---|\n"
    );
    for arg in serve_command().get_arguments() {
        let Some(long) = arg.get_long() else {
            continue; // --help
        };
        let value = arg
            .get_value_names()
            .and_then(|names| names.first())
            .map(|name| format!(" {name}"))
            .unwrap_or_default();
        let key = if arg.get_id() == "config" {
            "—".to_owned()
        } else {
            format!("`{}`", arg.get_id())
        };
        let env = arg
            .get_env()
            .map(|env| format!("`{}`", env.to_string_lossy()))
            .unwrap_or_default();
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let (mut help, default) = split_default(&help);
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !possible.is_empty() {
            help.push_str(&format!(" Values: {}.", possible.join(", ")));
        }
        out.push_str(&format!(
            "| {key} | `--{long}{value}` | {env} | {} | {} |\n",
            cell(default),
            cell(&help)
        ));
    }
    out.push_str(&format!(
        "\n## Example settings file\n\n`packaging/mqstate.toml`:\n\n```toml\n{EXAMPLE}```\n"
    ));
    out
}

#[test]
fn configuration_reference_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let rendered = render();
    if std::env::var_os("MQSTATE_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &rendered).expect("write docs/configuration.md");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "docs/configuration.md is out of date with src/settings.rs; regenerate it with `{REGENERATE}`"
    );
}

#[test]
fn every_setting_documents_its_default() {
    for arg in serve_command().get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "config") {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(
            !split_default(&help).1.is_empty(),
            "the help of `{id}` does not end in `. Default <value>`: {help:?}"
        );
    }
}

#[test]
fn the_example_settings_file_is_valid() {
    let rendered = render();
    let example = rendered
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("an example in the reference");
    let settings: super::Settings = toml::from_str(example).expect("the example parses");
    let resolved = settings.resolve().expect("the example resolves");
    crate::auth::check_exposure(&resolved).expect("the example may listen beyond loopback");
}
