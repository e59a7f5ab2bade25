//! Reply and notification payloads: encoding (server side) and strict parsing (CLI, bench, tests).

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{ErrorKind, ProtocolError};
use crate::resp::{put_bulk, put_header, Reader};

/// A state-store reply payload (spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK\r\n`
    Ok,
    /// `:<n>\r\n`
    Integer(i64),
    /// `$<n>\r\n<bytes>\r\n`
    Bulk(Bytes),
    /// `$-1\r\n` (GET miss)
    Nil,
    /// `-ERR <text>\r\n`
    Error(ErrorKind),
    /// One SCAN page: `*1\r\n*<k>\r\n<keys>` when `continuation` is `None` (last page), otherwise
    /// `*2\r\n*<k>\r\n<keys>$<n>\r\n<token>\r\n`.
    Keys {
        keys: Vec<Bytes>,
        continuation: Option<Bytes>,
    },
}

impl Reply {
    /// The payload bytes of this reply.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::new();
        match self {
            // The constant replies, most of them, allocate nothing (and cost nothing to remember in
            // the duplicate-request cache).
            Reply::Ok => return Bytes::from_static(b"+OK\r\n"),
            Reply::Nil => return Bytes::from_static(b"$-1\r\n"),
            Reply::Integer(-1) => return Bytes::from_static(b":-1\r\n"),
            Reply::Integer(0) => return Bytes::from_static(b":0\r\n"),
            Reply::Integer(1) => return Bytes::from_static(b":1\r\n"),
            Reply::Integer(n) => {
                out.put_u8(b':');
                out.put_slice(n.to_string().as_bytes());
                out.put_slice(b"\r\n");
            }
            Reply::Bulk(data) => put_bulk(&mut out, data),
            Reply::Error(kind) => {
                out.put_slice(b"-ERR ");
                out.put_slice(kind.as_str().as_bytes());
                out.put_slice(b"\r\n");
            }
            Reply::Keys { keys, continuation } => {
                put_header(&mut out, b'*', if continuation.is_some() { 2 } else { 1 });
                put_header(&mut out, b'*', keys.len());
                for key in keys {
                    put_bulk(&mut out, key);
                }
                if let Some(token) = continuation {
                    put_bulk(&mut out, token);
                }
            }
        }
        out.freeze()
    }

    /// Parses a reply payload; anything but exactly one well-formed reply is an error.
    pub fn parse(input: &Bytes) -> Result<Reply, ProtocolError> {
        let mut reader = Reader::new(input);
        let reply = match reader.peek()? {
            b'+' => {
                reader.expect(b'+', "'+'")?;
                if reader.line()?.as_ref() != b"OK" {
                    return Err(ProtocolError::UnexpectedReply {
                        what: "a simple string other than OK",
                    });
                }
                Reply::Ok
            }
            b':' => {
                reader.expect(b':', "':'")?;
                let offset = 1;
                let n = reader.decimal(true)?;
                Reply::Integer(
                    i64::try_from(n).map_err(|_| ProtocolError::InvalidNumber { offset })?,
                )
            }
            b'$' => match reader.length(b'$', "'$'", true)? {
                None => Reply::Nil,
                Some(len) => Reply::Bulk(reader.bulk_body(len)?),
            },
            b'-' => {
                reader.expect(b'-', "'-'")?;
                let line = reader.line()?;
                let text = line
                    .strip_prefix(b"ERR ")
                    .ok_or(ProtocolError::UnexpectedReply {
                        what: "an error without the `ERR ` prefix",
                    })?;
                Reply::Error(ErrorKind::from_text(text).ok_or_else(|| {
                    ProtocolError::UnknownErrorText {
                        text: String::from_utf8_lossy(text).into_owned(),
                    }
                })?)
            }
            b'*' => {
                let parts = reader.array_header(2)?;
                if parts == 0 {
                    return Err(ProtocolError::UnexpectedReply {
                        what: "a SCAN reply without its key array",
                    });
                }
                let count = reader.array_header(usize::MAX)?;
                let mut keys = Vec::with_capacity(reader.capacity_hint(count));
                for _ in 0..count {
                    keys.push(reader.bulk()?);
                }
                let continuation = if parts == 2 {
                    Some(reader.bulk()?)
                } else {
                    None
                };
                Reply::Keys { keys, continuation }
            }
            _ => {
                return Err(ProtocolError::Unexpected {
                    offset: 0,
                    expected: "one of '+', ':', '$', '-', '*'",
                })
            }
        };
        reader.finish()?;
        Ok(reply)
    }
}

/// The payload of a KEYNOTIFY notification (spec §6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifyPayload {
    /// `*4 NOTIFY SET VALUE <value>`
    Set(Bytes),
    /// `*2 NOTIFY DELETE` — for DEL, VDEL and expiry alike.
    Delete,
}

impl NotifyPayload {
    /// The payload bytes of this notification.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::new();
        match self {
            NotifyPayload::Set(value) => {
                out.put_slice(b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n");
                put_bulk(&mut out, value);
            }
            NotifyPayload::Delete => out.put_slice(b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n"),
        }
        out.freeze()
    }

    /// Parses a notification payload exactly as [`NotifyPayload::encode`] writes it.
    pub fn parse(input: &Bytes) -> Result<NotifyPayload, ProtocolError> {
        let mut reader = Reader::new(input);
        let parts = reader.array_header(4)?;
        let shape = ProtocolError::UnexpectedReply {
            what: "a notification other than NOTIFY SET VALUE <v> or NOTIFY DELETE",
        };
        if parts == 0 || reader.bulk()?.as_ref() != b"NOTIFY" {
            return Err(shape);
        }
        let payload = match (parts, reader.bulk()?.as_ref()) {
            (2, b"DELETE") => NotifyPayload::Delete,
            (4, b"SET") => {
                if reader.bulk()?.as_ref() != b"VALUE" {
                    return Err(shape);
                }
                NotifyPayload::Set(reader.bulk()?)
            }
            _ => return Err(shape),
        };
        reader.finish()?;
        Ok(payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(s: &'static [u8]) -> Bytes {
        Bytes::from_static(s)
    }

    #[test]
    fn golden_replies() {
        let cases: Vec<(Reply, &[u8])> = vec![
            (Reply::Ok, b"+OK\r\n"),
            (Reply::Integer(1), b":1\r\n"),
            (Reply::Integer(0), b":0\r\n"),
            (Reply::Integer(-1), b":-1\r\n"),
            (Reply::Bulk(b(b"v")), b"$1\r\nv\r\n"),
            (Reply::Bulk(Bytes::new()), b"$0\r\n\r\n"),
            (Reply::Nil, b"$-1\r\n"),
            (
                Reply::Error(ErrorKind::SyntaxError),
                b"-ERR syntax error\r\n",
            ),
            (
                Reply::Keys {
                    keys: vec![],
                    continuation: None,
                },
                b"*1\r\n*0\r\n",
            ),
            (
                Reply::Keys {
                    keys: vec![b(b"key1"), b(b"key2")],
                    continuation: None,
                },
                b"*1\r\n*2\r\n$4\r\nkey1\r\n$4\r\nkey2\r\n",
            ),
            (
                Reply::Keys {
                    keys: vec![b(b"key1")],
                    continuation: Some(b(b"1;1;")),
                },
                b"*2\r\n*1\r\n$4\r\nkey1\r\n$4\r\n1;1;\r\n",
            ),
            (
                Reply::Keys {
                    keys: vec![],
                    continuation: Some(b(b"\x00\xffx")),
                },
                b"*2\r\n*0\r\n$3\r\n\x00\xffx\r\n",
            ),
        ];
        for (reply, wire) in cases {
            assert_eq!(reply.encode().as_ref(), wire, "{reply:?}");
            assert_eq!(Reply::parse(&Bytes::copy_from_slice(wire)).unwrap(), reply);
        }
    }

    #[test]
    fn every_error_kind_round_trips() {
        for kind in ErrorKind::ALL {
            let wire = Reply::Error(kind).encode();
            assert_eq!(&wire[..5], b"-ERR ");
            assert_eq!(Reply::parse(&wire).unwrap(), Reply::Error(kind));
        }
    }

    #[test]
    fn rejects_malformed_replies() {
        let cases: &[&[u8]] = &[
            b"",
            b"+PONG\r\n",
            b"+OK\r\nx",
            b":1",
            b":01\r\n",
            b":9223372036854775808\r\n",
            b"$2\r\nv\r\n",
            b"$-2\r\n",
            b"-ERRsyntax error\r\n",
            b"-ERR something new\r\n",
            b"*0\r\n",
            b"*3\r\n*0\r\n",
            b"*2\r\n*0\r\n",
            b"*1\r\n*-1\r\n",
            b"*1\r\n*1\r\n$-1\r\n",
            b"*1\r\n$0\r\n\r\n",
            b"%1\r\n",
        ];
        for case in cases {
            assert!(
                Reply::parse(&Bytes::copy_from_slice(case)).is_err(),
                "accepted {:?}",
                String::from_utf8_lossy(case)
            );
        }
        assert!(matches!(
            Reply::parse(&b(b"-ERR something new\r\n")),
            Err(ProtocolError::UnknownErrorText { .. })
        ));
    }

    #[test]
    fn golden_notifications() {
        let set = NotifyPayload::Set(b(b"hello"));
        let set_wire: &[u8] = b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$5\r\nhello\r\n";
        assert_eq!(set.encode().as_ref(), set_wire);
        assert_eq!(
            NotifyPayload::parse(&Bytes::copy_from_slice(set_wire)).unwrap(),
            set
        );
        let del_wire: &[u8] = b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n";
        assert_eq!(NotifyPayload::Delete.encode().as_ref(), del_wire);
        assert_eq!(
            NotifyPayload::parse(&Bytes::copy_from_slice(del_wire)).unwrap(),
            NotifyPayload::Delete
        );
        for bad in [
            &b"*2\r\n$6\r\nNOTIFY\r\n$3\r\nDEL\r\n"[..],
            b"*4\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n$5\r\nVALUE\r\n$0\r\n\r\n",
            b"*3\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n",
            b"*0\r\n",
        ] {
            assert!(NotifyPayload::parse(&Bytes::copy_from_slice(bad)).is_err());
        }
    }

    fn reply_strategy() -> impl Strategy<Value = Reply> {
        let bytes = || prop::collection::vec(any::<u8>(), 0..32).prop_map(Bytes::from);
        prop_oneof![
            Just(Reply::Ok),
            any::<i64>().prop_map(Reply::Integer),
            bytes().prop_map(Reply::Bulk),
            Just(Reply::Nil),
            prop::sample::select(ErrorKind::ALL.to_vec()).prop_map(Reply::Error),
            (
                prop::collection::vec(bytes(), 0..8),
                prop::option::of(bytes())
            )
                .prop_map(|(keys, continuation)| Reply::Keys { keys, continuation }),
        ]
    }

    proptest! {
        #[test]
        fn reply_round_trip(reply in reply_strategy()) {
            prop_assert_eq!(Reply::parse(&reply.encode()).unwrap(), reply);
        }

        #[test]
        fn reply_parser_never_panics(input in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = Reply::parse(&Bytes::from(input.clone()));
            let _ = NotifyPayload::parse(&Bytes::from(input));
        }
    }
}
