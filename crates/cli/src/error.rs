//! The one error type of the CLI layer, and how each error maps to an exit status.

use std::process::ExitCode;

/// Exit status: the command did what was asked.
pub const EXIT_OK: u8 = 0;
/// Exit status: the key was not found or a condition (NX, NEX, VDEL value, fencing token) was not met.
pub const EXIT_NOT_MET: u8 = 1;
/// Exit status: bad usage, unreachable broker, or any other failure.
pub const EXIT_FAILED: u8 = 2;

/// Exit status of `lock` when its command does not exist (a shell's 127).
pub const EXIT_NOT_FOUND: u8 = 127;
/// Exit status of `lock` when its command cannot be executed (a shell's 126).
pub const EXIT_NOT_EXECUTABLE: u8 = 126;

/// Everything that can stop a CLI command. Messages name the thing and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("invalid {what}: {reason}")]
    Usage { what: String, reason: String },

    #[error("cannot read {what}: {source}")]
    Input {
        what: String,
        #[source]
        source: std::io::Error,
    },

    #[error("the MQTT broker at {addr} refused the connection: {reason} — {fix}")]
    Refused {
        addr: String,
        reason: String,
        fix: String,
    },

    #[error("cannot connect to the MQTT broker at {addr}: {reason} — {fix}")]
    Connect {
        addr: String,
        reason: String,
        /// What to do about it (flags to set, what to check).
        fix: String,
    },

    #[error("lost the connection to the MQTT broker at {addr}: {reason}")]
    ConnectionLost { addr: String, reason: String },

    #[error(
        "no reply within {timeout_s} s to {command} — is a state store serving this broker? \
         Raise --timeout if it is only slow"
    )]
    Timeout { command: String, timeout_s: u64 },

    #[error("the state store refused {command}: {text}")]
    Service {
        command: String,
        text: String,
        /// Fencing rejections are a condition not met (exit 1), not a failure of the tool.
        condition: bool,
    },

    #[error("unexpected reply to {command}: {detail} — is this an AIO-compatible state store?")]
    Protocol { command: String, detail: String },

    #[error("{command} failed: {text}")]
    Admin { command: String, text: String },
    #[error(
        "the {command} request would be {size} bytes, more than the broker's maximum packet size of \
         {max} bytes; store a smaller value, or raise the broker's max_packet_size"
    )]
    TooLarge {
        command: String,
        size: usize,
        max: u32,
    },

    #[error("lock {name} is held by another client; pass --wait to wait for it")]
    LockHeld { name: String },

    #[error("lost lock {name} while the command ran ({reason}); the command was stopped")]
    LockLost { name: String, reason: String },

    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

impl CliError {
    pub fn exit_status(&self) -> u8 {
        match self {
            CliError::Service {
                condition: true, ..
            }
            | CliError::LockHeld { .. }
            | CliError::LockLost { .. } => EXIT_NOT_MET,
            // As a shell reports a command it cannot run.
            CliError::Spawn { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => EXIT_NOT_EXECUTABLE,
                _ => EXIT_FAILED,
            },
            _ => EXIT_FAILED,
        }
    }

    pub fn usage(what: impl Into<String>, reason: impl Into<String>) -> CliError {
        CliError::Usage {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// Prints the error as `mqstate: …` and returns its exit code.
    pub fn report(&self) -> ExitCode {
        eprintln!("mqstate: {self}");
        ExitCode::from(self.exit_status())
    }
}

/// Whether a state-store `-ERR` text is a fencing rejection (a condition not met rather than a failure).
pub fn is_fencing_rejection(text: &str) -> bool {
    text.contains("fencing token")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fencing_rejections_exit_1_other_service_errors_exit_2() {
        let fenced = CliError::Service {
            command: "SET".into(),
            text: "a fencing token is required for this request".into(),
            condition: is_fencing_rejection("a fencing token is required for this request"),
        };
        assert_eq!(fenced.exit_status(), EXIT_NOT_MET);
        let syntax = CliError::Service {
            command: "SET".into(),
            text: "syntax error".into(),
            condition: is_fencing_rejection("syntax error"),
        };
        assert_eq!(syntax.exit_status(), EXIT_FAILED);
    }

    #[test]
    fn connection_errors_say_which_flags_to_set() {
        let e = CliError::Connect {
            addr: "127.0.0.1:1".into(),
            reason: "connection refused".into(),
            fix: "is the broker running? Set --host/--port".into(),
        };
        assert_eq!(e.exit_status(), EXIT_FAILED);
        assert!(e.to_string().contains("--host/--port"));
    }
}
