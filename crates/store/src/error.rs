//! The store layer's error type: everything but command outcomes, which are replies (`ErrorKind`).

use mqstate_protocol::ProtocolError;

/// Failures of configuration, encoding and decoding in the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The configured node id cannot appear in an HLC.
    #[error("invalid store configuration: {0}")]
    Config(#[from] ProtocolError),
    /// A buffer longer than the on-disk format's `Int32` length allows.
    #[error("{what} is {len} bytes, more than the {max} an Int32 length can describe; lower the size limits")]
    BufferTooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    /// The bytes end before the value being decoded.
    #[error("{context}: truncated while reading {what} at byte {offset}; the data is incomplete")]
    Truncated {
        context: &'static str,
        what: &'static str,
        offset: usize,
    },
    /// A field holds a value the format does not allow.
    #[error("{context}: invalid {what} at byte {offset}: {reason}")]
    Invalid {
        context: &'static str,
        what: &'static str,
        offset: usize,
        reason: &'static str,
    },
    /// Bytes after a complete value.
    #[error("{context}: {extra} unexpected trailing bytes at byte {offset}")]
    TrailingBytes {
        context: &'static str,
        offset: usize,
        extra: usize,
    },
}
