//! The protocol layer's two error types.
//!
//! [`ErrorKind`] is not a Rust-side failure but part of the wire vocabulary: the closed set of texts a
//! state-store server may put after `-ERR ` (spec §3). [`ProtocolError`] is what this crate's decoders and
//! validators return; each variant says which [`ErrorKind`] a server should answer with.

use std::fmt;

/// One variant per error text of spec §3; [`ErrorKind::as_str`] is the byte-exact text after `-ERR `.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// Request `__ts` more than the allowed drift ahead of the server clock.
    TimestampTooFarInFuture,
    /// The key is fenced and the write carries no `__ft`.
    FencingTokenRequired,
    /// `__ft` more than the allowed drift ahead of the server clock.
    FencingTokenTooFarInFuture,
    /// `__ft` older than the token protecting the key.
    FencingTokenLowerVersion,
    /// A configured key-count, memory, size or registration quota would be exceeded.
    QuotaExceeded,
    /// Invalid RESP payload, bad option, bad or overflowing number.
    SyntaxError,
    /// Key-level authorization denied.
    NotAuthorized,
    /// The command word is not one this server knows.
    UnknownCommand,
    /// The command has too few or too many arguments.
    WrongNumberOfArguments,
    /// A SET without `__ts`.
    MissingTimestamp,
    /// `__ts` or `__ft` does not parse as an HLC.
    MalformedTimestamp,
    /// The key argument is empty.
    KeyLengthZero,
}

impl ErrorKind {
    /// Every error kind, in declaration order (for exhaustive tests and text lookup).
    pub const ALL: [ErrorKind; 12] = [
        ErrorKind::TimestampTooFarInFuture,
        ErrorKind::FencingTokenRequired,
        ErrorKind::FencingTokenTooFarInFuture,
        ErrorKind::FencingTokenLowerVersion,
        ErrorKind::QuotaExceeded,
        ErrorKind::SyntaxError,
        ErrorKind::NotAuthorized,
        ErrorKind::UnknownCommand,
        ErrorKind::WrongNumberOfArguments,
        ErrorKind::MissingTimestamp,
        ErrorKind::MalformedTimestamp,
        ErrorKind::KeyLengthZero,
    ];

    /// The exact text a server writes after `-ERR ` (spec §3).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::TimestampTooFarInFuture => {
                "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
            }
            ErrorKind::FencingTokenRequired => "a fencing token is required for this request",
            ErrorKind::FencingTokenTooFarInFuture => {
                "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
            }
            ErrorKind::FencingTokenLowerVersion => {
                "the request fencing token is a lower version than the fencing token protecting the resource"
            }
            ErrorKind::QuotaExceeded => "the quota has been exceeded",
            ErrorKind::SyntaxError => "syntax error",
            ErrorKind::NotAuthorized => "not authorized",
            ErrorKind::UnknownCommand => "unknown command",
            ErrorKind::WrongNumberOfArguments => "wrong number of arguments",
            ErrorKind::MissingTimestamp => "missing timestamp",
            ErrorKind::MalformedTimestamp => "malformed timestamp",
            ErrorKind::KeyLengthZero => "the key length is zero",
        }
    }

    /// The kind whose text is exactly `text`, if any (used when parsing replies).
    pub fn from_text(text: &[u8]) -> Option<ErrorKind> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str().as_bytes() == text)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::error::Error for ErrorKind {}

/// Failures of this crate's decoders and validators.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The payload ended before the RESP value was complete.
    #[error("RESP payload is truncated at byte {offset}: the sender must send the complete value")]
    Truncated { offset: usize },
    /// A byte other than the one the RESP grammar requires.
    #[error("RESP payload has an unexpected byte at {offset}: expected {expected}")]
    Unexpected {
        offset: usize,
        expected: &'static str,
    },
    /// A length or integer that is not a canonical decimal in range.
    #[error("RESP payload has an invalid number at byte {offset}: expected a canonical decimal that fits 64 bits")]
    InvalidNumber { offset: usize },
    /// An array claims more elements than the configured limit allows.
    #[error("RESP array claims {count} elements but at most {max} are accepted; raise the limit or send fewer")]
    TooManyElements { count: u64, max: usize },
    /// Bytes after a complete RESP value.
    #[error("RESP payload has {extra} trailing bytes after the value ending at byte {offset}")]
    TrailingBytes { offset: usize, extra: usize },
    /// A `-ERR` reply whose text is not one of spec §3.
    #[error("reply carries an error text this client does not know: {text:?}")]
    UnknownErrorText { text: String },
    /// A well-formed RESP value that is not a valid state-store reply or notification.
    #[error("unexpected reply shape: {what}")]
    UnexpectedReply { what: &'static str },
    /// Text that is not `{wall:015}:{counter:05}:{node}` with in-range numbers.
    #[error("malformed HLC timestamp {text:?}: expected `<wall ms>:<counter>:<node id>`")]
    MalformedHlc { text: String },
    /// A node id that cannot appear in an HLC.
    #[error("invalid HLC node id {node_id:?}: it must not contain ':'")]
    InvalidNodeId { node_id: String },
    /// A remote timestamp too far ahead of this server's clock.
    #[error("timestamp is {ahead_ms} ms ahead of the server clock (at most {max_drift_ms} ms allowed); synchronize the clocks")]
    ClockDrift { ahead_ms: u64, max_drift_ms: u64 },
    /// A SCAN pattern the `glob` crate would also reject.
    #[error("invalid glob pattern at byte {position}: {reason}")]
    InvalidGlob {
        position: usize,
        reason: &'static str,
    },
}

impl ProtocolError {
    /// The error text a server answers with. Clock drift maps to the `__ts` text; the caller picks
    /// [`ErrorKind::FencingTokenTooFarInFuture`] itself when the drifting value was a fencing token.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtocolError::MalformedHlc { .. } | ProtocolError::InvalidNodeId { .. } => {
                ErrorKind::MalformedTimestamp
            }
            ProtocolError::ClockDrift { .. } => ErrorKind::TimestampTooFarInFuture,
            ProtocolError::Truncated { .. }
            | ProtocolError::Unexpected { .. }
            | ProtocolError::InvalidNumber { .. }
            | ProtocolError::TooManyElements { .. }
            | ProtocolError::TrailingBytes { .. }
            | ProtocolError::UnknownErrorText { .. }
            | ProtocolError::UnexpectedReply { .. }
            | ProtocolError::InvalidGlob { .. } => ErrorKind::SyntaxError,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_byte_exact_and_distinct() {
        let texts: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(texts[0], "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized");
        assert_eq!(texts[1], "a fencing token is required for this request");
        assert_eq!(texts[2], "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized");
        assert_eq!(texts[3], "the request fencing token is a lower version than the fencing token protecting the resource");
        assert_eq!(texts[4], "the quota has been exceeded");
        assert_eq!(texts[5], "syntax error");
        assert_eq!(texts[6], "not authorized");
        assert_eq!(texts[7], "unknown command");
        assert_eq!(texts[8], "wrong number of arguments");
        assert_eq!(texts[9], "missing timestamp");
        assert_eq!(texts[10], "malformed timestamp");
        assert_eq!(texts[11], "the key length is zero");
        let mut unique = texts.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), texts.len());
    }

    #[test]
    fn from_text_inverts_as_str() {
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_text(kind.as_str().as_bytes()), Some(kind));
            assert_eq!(kind.to_string(), kind.as_str());
        }
        assert_eq!(ErrorKind::from_text(b"Syntax Error"), None);
    }
}
