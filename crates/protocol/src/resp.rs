//! RESP framing: the strict reader shared by request and reply parsing, and the request codec.
//!
//! A request is a RESP array of bulk strings (`*<n>\r\n` then `n` × `$<len>\r\n<bytes>\r\n`). Parsing is
//! zero-copy: every argument is a slice of the input [`Bytes`]. The grammar is enforced exactly —
//! canonical decimal lengths, CRLF terminators, no trailing bytes — because a lenient parser lets two
//! peers disagree about where a value ends.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::ProtocolError;

/// Default for [`RequestLimits::max_args`]: far above the 6 arguments of the longest command
/// (`SET k v NX PX ms`), far below anything that could exhaust memory.
pub const DEFAULT_MAX_REQUEST_ARGS: usize = 1024;

/// The smallest encoding of one bulk string, `$0\r\n\r\n`. A claimed element count is never trusted
/// beyond `remaining bytes / this`, so a tiny payload cannot make the parser pre-allocate a huge vector.
pub(crate) const MIN_BULK_ENCODED_LEN: usize = 6;

/// Bounds applied while parsing a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most arguments (command word included) one request may carry.
    pub max_args: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_args: DEFAULT_MAX_REQUEST_ARGS,
        }
    }
}

/// Parses a request payload into its arguments (command word first), each a zero-copy slice of `input`.
pub fn parse_request(input: &Bytes, limits: &RequestLimits) -> Result<Vec<Bytes>, ProtocolError> {
    let mut reader = Reader::new(input);
    let count = reader.array_header(limits.max_args)?;
    let mut args = Vec::with_capacity(reader.capacity_hint(count));
    for _ in 0..count {
        args.push(reader.bulk()?);
    }
    reader.finish()?;
    Ok(args)
}

/// Encodes arguments as a request payload; [`parse_request`] returns them unchanged.
pub fn encode_request<A: AsRef<[u8]>>(args: &[A]) -> Bytes {
    let body: usize = args.iter().map(|a| a.as_ref().len() + 16).sum();
    let mut out = BytesMut::with_capacity(16 + body);
    put_header(&mut out, b'*', args.len());
    for arg in args {
        put_bulk(&mut out, arg.as_ref());
    }
    out.freeze()
}

pub(crate) fn put_header(out: &mut BytesMut, prefix: u8, len: usize) {
    out.put_u8(prefix);
    out.put_slice(len.to_string().as_bytes());
    out.put_slice(b"\r\n");
}

pub(crate) fn put_bulk(out: &mut BytesMut, data: &[u8]) {
    put_header(out, b'$', data.len());
    out.put_slice(data);
    out.put_slice(b"\r\n");
}

/// A cursor over one RESP value that rejects anything but the exact grammar.
pub(crate) struct Reader<'a> {
    input: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(input: &'a Bytes) -> Self {
        Reader { input, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.input.len() - self.pos
    }

    /// How many elements it is safe to pre-allocate for a claimed `count`.
    pub(crate) fn capacity_hint(&self, count: usize) -> usize {
        count.min(self.remaining() / MIN_BULK_ENCODED_LEN)
    }

    pub(crate) fn peek(&self) -> Result<u8, ProtocolError> {
        self.input
            .get(self.pos)
            .copied()
            .ok_or(ProtocolError::Truncated { offset: self.pos })
    }

    pub(crate) fn expect(&mut self, byte: u8, expected: &'static str) -> Result<(), ProtocolError> {
        if self.peek()? != byte {
            return Err(ProtocolError::Unexpected {
                offset: self.pos,
                expected,
            });
        }
        self.pos += 1;
        Ok(())
    }

    fn crlf(&mut self) -> Result<(), ProtocolError> {
        self.expect(b'\r', "CR")?;
        self.expect(b'\n', "LF")
    }

    /// The bytes up to the next CRLF (not included), consuming the CRLF.
    pub(crate) fn line(&mut self) -> Result<Bytes, ProtocolError> {
        let start = self.pos;
        let rest = &self.input[start..];
        let Some(cr) = rest.iter().position(|&b| b == b'\r') else {
            return Err(ProtocolError::Truncated {
                offset: self.input.len(),
            });
        };
        self.pos = start + cr;
        self.crlf()?;
        Ok(self.input.slice(start..start + cr))
    }

    /// A canonical decimal (`0` or no leading zero, optional `-` only when `signed`) ending in CRLF.
    pub(crate) fn decimal(&mut self, signed: bool) -> Result<i128, ProtocolError> {
        let offset = self.pos;
        let line = self.line()?;
        parse_canonical_decimal(&line, signed).ok_or(ProtocolError::InvalidNumber { offset })
    }

    /// A length after `prefix`; `-1` (RESP null) is returned as `None` only when `allow_null`.
    pub(crate) fn length(
        &mut self,
        prefix: u8,
        expected: &'static str,
        allow_null: bool,
    ) -> Result<Option<u64>, ProtocolError> {
        self.expect(prefix, expected)?;
        let offset = self.pos;
        match self.decimal(allow_null)? {
            -1 if allow_null => Ok(None),
            n => u64::try_from(n)
                .map(Some)
                .map_err(|_| ProtocolError::InvalidNumber { offset }),
        }
    }

    /// `*<n>\r\n` with `n <= max`.
    pub(crate) fn array_header(&mut self, max: usize) -> Result<usize, ProtocolError> {
        let count = self
            .length(b'*', "'*' (array)", false)?
            .ok_or(ProtocolError::Unexpected {
                offset: self.pos,
                expected: "an array length",
            })?;
        match usize::try_from(count) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(ProtocolError::TooManyElements { count, max }),
        }
    }

    /// The body of a bulk string of `len` bytes, then CRLF.
    pub(crate) fn bulk_body(&mut self, len: u64) -> Result<Bytes, ProtocolError> {
        let len = match usize::try_from(len) {
            Ok(len) if len <= self.remaining() => len,
            _ => {
                return Err(ProtocolError::Truncated {
                    offset: self.input.len(),
                })
            }
        };
        let data = self.input.slice(self.pos..self.pos + len);
        self.pos += len;
        self.crlf()?;
        Ok(data)
    }

    /// A non-null bulk string `$<len>\r\n<bytes>\r\n`.
    pub(crate) fn bulk(&mut self) -> Result<Bytes, ProtocolError> {
        let len =
            self.length(b'$', "'$' (bulk string)", false)?
                .ok_or(ProtocolError::Unexpected {
                    offset: self.pos,
                    expected: "a bulk length",
                })?;
        self.bulk_body(len)
    }

    /// Succeeds only when the whole input has been consumed.
    pub(crate) fn finish(&self) -> Result<(), ProtocolError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(ProtocolError::TrailingBytes {
                offset: self.pos,
                extra,
            }),
        }
    }
}

/// Parses `0`, `[1-9][0-9]*` or (when `signed`) `-[1-9][0-9]*`, rejecting anything beyond i64.
fn parse_canonical_decimal(text: &[u8], signed: bool) -> Option<i128> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) if signed => (true, rest),
        _ => (false, text),
    };
    let canonical = match digits {
        [] => false,
        [b'0'] => !negative,
        [first, ..] => *first != b'0',
    };
    if !canonical || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut value: i128 = 0;
    for &d in digits {
        value = value.checked_mul(10)?.checked_add(i128::from(d - b'0'))?;
        if value > i128::from(u64::MAX) {
            return None;
        }
    }
    let value = if negative { -value } else { value };
    if signed && i64::try_from(value).is_err() {
        return None;
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(input: &[u8]) -> Result<Vec<Bytes>, ProtocolError> {
        parse_request(&Bytes::copy_from_slice(input), &RequestLimits::default())
    }

    #[test]
    fn golden_set_request() {
        let wire = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n";
        assert_eq!(encode_request(&[&b"SET"[..], b"k", b"v"]).as_ref(), wire);
        assert_eq!(parse(wire).unwrap(), vec!["SET", "k", "v"]);
    }

    #[test]
    fn empty_bulk_and_empty_array() {
        assert_eq!(
            parse(b"*2\r\n$3\r\nGET\r\n$0\r\n\r\n").unwrap(),
            vec!["GET", ""]
        );
        assert_eq!(parse(b"*0\r\n").unwrap(), Vec::<Bytes>::new());
    }

    #[test]
    fn arguments_are_zero_copy_slices() {
        let input = Bytes::from_static(b"*2\r\n$3\r\nGET\r\n$3\r\nkey\r\n");
        let args = parse_request(&input, &RequestLimits::default()).unwrap();
        assert_eq!(args[1].as_ptr(), input[17..].as_ptr());
    }

    #[test]
    fn rejects_malformed_framing() {
        let cases: &[&[u8]] = &[
            b"",
            b"*1\r\n",
            b"*1\r\n$3\r\nGET",
            b"*1\r\n$3\r\nGETX\r\n",
            b"*1\r\n$4\r\nGET\r\n",
            b"*1\r\n$3\nGET\r\n",
            b"*1\n$3\r\nGET\r\n",
            b"*1\r\n$3\r\nGET\r\n ",
            b"*01\r\n$3\r\nGET\r\n",
            b"*1\r\n$03\r\nGET\r\n",
            b"*+1\r\n$3\r\nGET\r\n",
            b"*-1\r\n",
            b"*1\r\n$-1\r\n",
            b"*1\r\n:1\r\n",
            b"$3\r\nGET\r\n",
            b"*\r\n",
            b"*1\r\n$99999999999999999999999\r\n",
            b"*1\r\n$18446744073709551615\r\nx\r\n",
        ];
        for case in cases {
            assert!(
                parse(case).is_err(),
                "accepted {:?}",
                String::from_utf8_lossy(case)
            );
        }
    }

    #[test]
    fn claimed_count_is_bounded_and_not_preallocated() {
        let err = parse(b"*1025\r\n").unwrap_err();
        assert_eq!(
            err,
            ProtocolError::TooManyElements {
                count: 1025,
                max: 1024
            }
        );
        // A count within the limit but larger than the payload fails as truncated, not as an allocation.
        assert_eq!(
            parse(b"*1024\r\n"),
            Err(ProtocolError::Truncated { offset: 7 })
        );
        let tight = RequestLimits { max_args: 1 };
        let input = Bytes::from_static(b"*2\r\n$1\r\na\r\n$1\r\nb\r\n");
        assert!(matches!(
            parse_request(&input, &tight),
            Err(ProtocolError::TooManyElements { count: 2, max: 1 })
        ));
    }

    #[test]
    fn canonical_decimals() {
        assert_eq!(parse_canonical_decimal(b"0", false), Some(0));
        assert_eq!(parse_canonical_decimal(b"-1", true), Some(-1));
        assert_eq!(parse_canonical_decimal(b"-0", true), None);
        assert_eq!(parse_canonical_decimal(b"-1", false), None);
        assert_eq!(parse_canonical_decimal(b"007", false), None);
        assert_eq!(parse_canonical_decimal(b"", false), None);
        assert_eq!(parse_canonical_decimal(b"1a", false), None);
        assert_eq!(
            parse_canonical_decimal(b"18446744073709551615", false),
            Some(u64::MAX.into())
        );
        assert_eq!(
            parse_canonical_decimal(b"18446744073709551616", false),
            None
        );
        assert_eq!(
            parse_canonical_decimal(b"9223372036854775807", true),
            Some(i64::MAX.into())
        );
        assert_eq!(parse_canonical_decimal(b"9223372036854775808", true), None);
        assert_eq!(
            parse_canonical_decimal(b"-9223372036854775808", true),
            Some(i64::MIN.into())
        );
    }

    proptest! {
        #[test]
        fn request_round_trip(args in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..12)) {
            let wire = encode_request(&args);
            let parsed = parse_request(&wire, &RequestLimits::default()).unwrap();
            prop_assert_eq!(parsed.iter().map(|b| b.to_vec()).collect::<Vec<_>>(), args);
        }

        #[test]
        fn parser_never_panics(input in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse(&input);
        }

        #[test]
        fn parser_never_panics_on_near_valid_input(
            args in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..8), 0..6),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let wire = encode_request(&args).to_vec();
            let truncated = &wire[..cut.index(wire.len() + 1)];
            prop_assert!(parse(truncated).is_err() || truncated.len() == wire.len());
            let mut mutated = wire.clone();
            let at = flip.index(mutated.len());
            mutated[at] = byte;
            let _ = parse(&mutated);
        }
    }
}
