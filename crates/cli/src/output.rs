//! What a finished command prints, in the chosen style, and its exit status.

use std::io::Write;
use std::process::ExitCode;

use serde_json::{json, Map, Value};

use super::error::{CliError, EXIT_FAILED};
use super::value::{write_value, OutputArgs};

/// The result of a command, before printing.
#[derive(Debug)]
pub struct Outcome {
    pub status: u8,
    /// The `--json` document (an object).
    pub json: Value,
    /// Values printed one after another on stdout (raw, or escaped: [`OutputArgs::raw_values`]).
    pub values: Vec<Vec<u8>>,
    /// With `--raw`, end each value with a newline (lists of keys) instead of writing bytes back to back.
    pub values_are_lines: bool,
    /// A confirmation line for stdout (`OK`, `deleted`).
    pub text: Option<String>,
    /// Why the status is not 0, for stderr.
    pub note: Option<String>,
}

impl Outcome {
    pub fn new(status: u8, json: Value) -> Outcome {
        debug_assert!(json.is_object(), "--json output is always an object");
        Outcome {
            status,
            json,
            values: Vec::new(),
            values_are_lines: false,
            text: None,
            note: None,
        }
    }

    pub fn object(&mut self) -> &mut Map<String, Value> {
        if !self.json.is_object() {
            self.json = json!({});
        }
        match &mut self.json {
            Value::Object(map) => map,
            _ => unreachable!("replaced by an object above"),
        }
    }
}

/// Prints the outcome (or the error) and returns the exit status.
pub fn finish(output: OutputArgs, result: Result<Outcome, CliError>) -> ExitCode {
    let status = match result {
        Ok(outcome) => print_outcome(output, &outcome).map(|()| outcome.status),
        Err(error) if output.json => {
            let status = error.exit_status();
            let doc = json!({ "error": error.to_string(), "exit": status });
            writeln!(std::io::stdout().lock(), "{doc}").map(|()| status)
        }
        Err(error) => return error.report(),
    };
    match status {
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            // A closed stdout (e.g. `| head`) is not worth a panic, but the output is incomplete.
            eprintln!("mqstate: cannot write the output: {e}");
            ExitCode::from(EXIT_FAILED)
        }
    }
}

fn print_outcome(output: OutputArgs, outcome: &Outcome) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if output.json {
        writeln!(out, "{}", outcome.json)?;
    } else {
        if let Some(text) = &outcome.text {
            writeln!(out, "{text}")?;
        }
        let raw = output.raw_values();
        for value in &outcome.values {
            write_value(&mut out, raw, value)?;
            if raw && outcome.values_are_lines {
                out.write_all(b"\n")?;
            }
        }
        if let Some(note) = &outcome.note {
            eprintln!("mqstate: {note}");
        }
    }
    out.flush()
}
