//! Big-endian primitives shared by the three file formats.
//!
//! Reading never panics: every accessor checks the remaining length and reports
//! [`Damage::Truncated`] with the offset where the missing field starts.

use crate::error::{Damage, FormatError, WalError};

/// A cursor over a file's bytes that knows its absolute offset, so errors can name it.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    pub(crate) fn at(bytes: &'a [u8], pos: usize) -> Self {
        debug_assert!(pos <= bytes.len());
        Self { bytes, pos }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    pub(crate) fn error(&self, damage: Damage) -> FormatError {
        FormatError {
            offset: self.pos as u64,
            damage,
        }
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.remaining() < n {
            return Err(self.error(Damage::Truncated));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub(crate) fn array4(&mut self) -> Result<[u8; 4], FormatError> {
        let mut out = [0u8; 4];
        out.copy_from_slice(self.take(4)?);
        Ok(out)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_be_bytes(self.array4()?))
    }

    pub(crate) fn i32(&mut self) -> Result<i32, FormatError> {
        Ok(i32::from_be_bytes(self.array4()?))
    }

    pub(crate) fn i64(&mut self) -> Result<i64, FormatError> {
        let mut out = [0u8; 8];
        out.copy_from_slice(self.take(8)?);
        Ok(i64::from_be_bytes(out))
    }

    /// An `Int64` field that the format only allows to be non-negative (indexes, terms).
    pub(crate) fn non_negative_i64(&mut self, field: &'static str) -> Result<u64, FormatError> {
        let at = self.pos;
        let value = self.i64()?;
        u64::try_from(value).map_err(|_| FormatError {
            offset: at as u64,
            damage: Damage::Negative { field, value },
        })
    }

    /// A `Buffer`: `Int32` length then that many bytes.
    pub(crate) fn buffer(&mut self, max_len: usize) -> Result<&'a [u8], FormatError> {
        let at = self.pos;
        let len = self.i32()?;
        let len = usize::try_from(len).map_err(|_| FormatError {
            offset: at as u64,
            damage: Damage::Negative {
                field: "buffer length",
                value: i64::from(len),
            },
        })?;
        if len > max_len {
            return Err(FormatError {
                offset: at as u64,
                damage: Damage::TooLong { len, max: max_len },
            });
        }
        self.take(len)
    }

    pub(crate) fn expect_end(&self) -> Result<(), FormatError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(self.error(Damage::TrailingBytes(extra))),
        }
    }
}

pub(crate) fn put_i32(out: &mut Vec<u8>, v: i32) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub(crate) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}

pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_be_bytes());
}

/// Converts an in-memory index or term to its on-disk `Int64`.
pub(crate) fn to_disk_i64(v: u64) -> Option<i64> {
    i64::try_from(v).ok()
}

/// Writes a `Buffer` (length + bytes); `what` names the field if it is too long for an `Int32`.
pub(crate) fn put_buffer(
    out: &mut Vec<u8>,
    bytes: &[u8],
    what: &'static str,
) -> Result<(), WalError> {
    let len = i32::try_from(bytes.len()).map_err(|_| WalError::TooLarge {
        what,
        len: bytes.len(),
        max: i32::MAX as usize,
    })?;
    put_i32(out, len);
    out.extend_from_slice(bytes);
    Ok(())
}
