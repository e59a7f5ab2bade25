//! State-store commands as values: [`Command::parse`] turns request arguments into one, and
//! [`Command::to_args`] turns it back.
//!
//! Decisions where the spec is silent (each pinned by a test below):
//! * Words (command names, `NX`, `NEX`, `PX`, `STOP`) match case-insensitively; keys, values, patterns
//!   and tokens are opaque bytes.
//! * Checks run in this order: command word (`unknown command`, also for an empty request), argument
//!   count (`wrong number of arguments`), empty key (`the key length is zero`), options (`syntax error`).
//! * SET options: at most one condition (`NX` or `NEX`) and at most one `PX <ms>`, in either order
//!   (clients send the condition first; Redis accepts both). A repeated option, both `NX` and `NEX`,
//!   or a `PX` without its number is a `syntax error`.
//! * `PX` takes a canonical decimal in `1..=i64::MAX`: `PX 0`, negatives, `+5`, `007` and overflow
//!   are `syntax error` (as Redis rejects a zero expiry; a key that is born expired is never useful).
//! * SCAN's pattern may be empty (it matches no key, as keys are never empty).

use bytes::Bytes;

use crate::error::ErrorKind;

/// When a SET applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SetCondition {
    /// Always.
    Always,
    /// `NX`: only if the key does not exist.
    NotExists,
    /// `NEX`: only if the key does not exist or its current value equals the new one.
    NotExistsOrEqual,
}

/// A parsed state-store request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `SET key value [NX|NEX] [PX ms]`; `expiry_ms` is relative and never 0.
    Set {
        key: Bytes,
        value: Bytes,
        condition: SetCondition,
        expiry_ms: Option<u64>,
    },
    /// `GET key`
    Get { key: Bytes },
    /// `DEL key`
    Del { key: Bytes },
    /// `VDEL key value`
    VDel { key: Bytes, value: Bytes },
    /// `KEYNOTIFY key`
    KeyNotify { key: Bytes },
    /// `KEYNOTIFY key STOP`
    KeyNotifyStop { key: Bytes },
    /// `SCAN pattern [token]`
    Scan {
        pattern: Bytes,
        continuation: Option<Bytes>,
    },
}

impl Command {
    /// Interprets request arguments (command word first).
    pub fn parse(args: Vec<Bytes>) -> Result<Command, ErrorKind> {
        let mut args = args.into_iter();
        let word = args.next().ok_or(ErrorKind::UnknownCommand)?;
        let rest: Vec<Bytes> = args.collect();
        let is = |name: &str| word.eq_ignore_ascii_case(name.as_bytes());
        if is("SET") {
            parse_set(rest)
        } else if is("GET") {
            let [key] = exactly(rest)?;
            Ok(Command::Get {
                key: non_empty(key)?,
            })
        } else if is("DEL") {
            let [key] = exactly(rest)?;
            Ok(Command::Del {
                key: non_empty(key)?,
            })
        } else if is("VDEL") {
            let [key, value] = exactly(rest)?;
            Ok(Command::VDel {
                key: non_empty(key)?,
                value,
            })
        } else if is("KEYNOTIFY") {
            match <[Bytes; 1]>::try_from(rest) {
                Ok([key]) => Ok(Command::KeyNotify {
                    key: non_empty(key)?,
                }),
                Err(rest) => {
                    let [key, stop] = exactly(rest)?;
                    let key = non_empty(key)?;
                    if stop.eq_ignore_ascii_case(b"STOP") {
                        Ok(Command::KeyNotifyStop { key })
                    } else {
                        Err(ErrorKind::SyntaxError)
                    }
                }
            }
        } else if is("SCAN") {
            match <[Bytes; 1]>::try_from(rest) {
                Ok([pattern]) => Ok(Command::Scan {
                    pattern,
                    continuation: None,
                }),
                Err(rest) => {
                    let [pattern, token] = exactly(rest)?;
                    Ok(Command::Scan {
                        pattern,
                        continuation: Some(token),
                    })
                }
            }
        } else {
            Err(ErrorKind::UnknownCommand)
        }
    }

    /// The request arguments that [`Command::parse`] maps back to this command (upper-case words,
    /// condition before `PX`, as the official clients send them).
    pub fn to_args(&self) -> Vec<Bytes> {
        let word = |w: &'static str| Bytes::from_static(w.as_bytes());
        match self {
            Command::Set {
                key,
                value,
                condition,
                expiry_ms,
            } => {
                let mut args = vec![word("SET"), key.clone(), value.clone()];
                match condition {
                    SetCondition::Always => {}
                    SetCondition::NotExists => args.push(word("NX")),
                    SetCondition::NotExistsOrEqual => args.push(word("NEX")),
                }
                if let Some(ms) = expiry_ms {
                    args.push(word("PX"));
                    args.push(Bytes::from(ms.to_string()));
                }
                args
            }
            Command::Get { key } => vec![word("GET"), key.clone()],
            Command::Del { key } => vec![word("DEL"), key.clone()],
            Command::VDel { key, value } => vec![word("VDEL"), key.clone(), value.clone()],
            Command::KeyNotify { key } => vec![word("KEYNOTIFY"), key.clone()],
            Command::KeyNotifyStop { key } => vec![word("KEYNOTIFY"), key.clone(), word("STOP")],
            Command::Scan {
                pattern,
                continuation,
            } => {
                let mut args = vec![word("SCAN"), pattern.clone()];
                args.extend(continuation.iter().cloned());
                args
            }
        }
    }

    /// Whether the command may change the keyspace (and so takes fencing tokens).
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            Command::Set { .. } | Command::Del { .. } | Command::VDel { .. }
        )
    }
}

fn exactly<const N: usize>(rest: Vec<Bytes>) -> Result<[Bytes; N], ErrorKind> {
    <[Bytes; N]>::try_from(rest).map_err(|_| ErrorKind::WrongNumberOfArguments)
}

fn non_empty(key: Bytes) -> Result<Bytes, ErrorKind> {
    if key.is_empty() {
        Err(ErrorKind::KeyLengthZero)
    } else {
        Ok(key)
    }
}

fn parse_set(rest: Vec<Bytes>) -> Result<Command, ErrorKind> {
    let mut rest = rest.into_iter();
    let (Some(key), Some(value)) = (rest.next(), rest.next()) else {
        return Err(ErrorKind::WrongNumberOfArguments);
    };
    let key = non_empty(key)?;
    let mut condition = None;
    let mut expiry_ms = None;
    while let Some(option) = rest.next() {
        let new_condition = if option.eq_ignore_ascii_case(b"NX") {
            SetCondition::NotExists
        } else if option.eq_ignore_ascii_case(b"NEX") {
            SetCondition::NotExistsOrEqual
        } else if option.eq_ignore_ascii_case(b"PX") && expiry_ms.is_none() {
            let ms = rest.next().ok_or(ErrorKind::SyntaxError)?;
            expiry_ms = Some(parse_expiry_ms(&ms)?);
            continue;
        } else {
            return Err(ErrorKind::SyntaxError);
        };
        if condition.replace(new_condition).is_some() {
            return Err(ErrorKind::SyntaxError);
        }
    }
    Ok(Command::Set {
        key,
        value,
        condition: condition.unwrap_or(SetCondition::Always),
        expiry_ms,
    })
}

/// A canonical decimal in `1..=i64::MAX`.
fn parse_expiry_ms(text: &[u8]) -> Result<u64, ErrorKind> {
    let canonical =
        matches!(text.first(), Some(b'1'..=b'9')) && text.iter().all(u8::is_ascii_digit);
    if !canonical {
        return Err(ErrorKind::SyntaxError);
    }
    let mut value: u64 = 0;
    for &digit in text {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(digit - b'0')))
            .filter(|&v| i64::try_from(v).is_ok())
            .ok_or(ErrorKind::SyntaxError)?;
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(words: &[&str]) -> Result<Command, ErrorKind> {
        Command::parse(
            words
                .iter()
                .map(|w| Bytes::copy_from_slice(w.as_bytes()))
                .collect(),
        )
    }

    fn set(condition: SetCondition, expiry_ms: Option<u64>) -> Command {
        Command::Set {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"v"),
            condition,
            expiry_ms,
        }
    }

    #[test]
    fn set_forms() {
        use SetCondition::*;
        assert_eq!(parse(&["SET", "k", "v"]), Ok(set(Always, None)));
        assert_eq!(parse(&["set", "k", "v"]), Ok(set(Always, None)));
        assert_eq!(parse(&["SET", "k", "v", "NX"]), Ok(set(NotExists, None)));
        assert_eq!(
            parse(&["SET", "k", "v", "nex"]),
            Ok(set(NotExistsOrEqual, None))
        );
        assert_eq!(
            parse(&["SET", "k", "v", "PX", "10"]),
            Ok(set(Always, Some(10)))
        );
        assert_eq!(
            parse(&["SET", "k", "v", "NX", "PX", "1000"]),
            Ok(set(NotExists, Some(1000)))
        );
        assert_eq!(
            parse(&["SET", "k", "v", "px", "5", "Nex"]),
            Ok(set(NotExistsOrEqual, Some(5)))
        );
        assert_eq!(
            parse(&["SET", "k", "v", "PX", "9223372036854775807"]),
            Ok(set(Always, Some(i64::MAX as u64)))
        );
        assert_eq!(
            parse(&["SET", "k", "", "NX"]),
            Ok(Command::Set {
                key: Bytes::from_static(b"k"),
                value: Bytes::new(),
                condition: NotExists,
                expiry_ms: None
            })
        );
    }

    #[test]
    fn set_errors() {
        let syntax = Err(ErrorKind::SyntaxError);
        for bad in [
            &["SET", "k", "v", "XX"][..],
            &["SET", "k", "v", "NX", "NX"],
            &["SET", "k", "v", "NX", "NEX"],
            &["SET", "k", "v", "PX"],
            &["SET", "k", "v", "PX", "0"],
            &["SET", "k", "v", "PX", "-5"],
            &["SET", "k", "v", "PX", "+5"],
            &["SET", "k", "v", "PX", "05"],
            &["SET", "k", "v", "PX", "1.5"],
            &["SET", "k", "v", "PX", ""],
            &["SET", "k", "v", "PX", "9223372036854775808"],
            &["SET", "k", "v", "PX", "99999999999999999999999"],
            &["SET", "k", "v", "PX", "10", "PX", "10"],
            &["SET", "k", "v", "NX", "PX", "10", "extra"],
        ] {
            assert_eq!(parse(bad), syntax, "{bad:?}");
        }
        assert_eq!(parse(&["SET"]), Err(ErrorKind::WrongNumberOfArguments));
        assert_eq!(parse(&["SET", "k"]), Err(ErrorKind::WrongNumberOfArguments));
        assert_eq!(parse(&["SET", "", "v"]), Err(ErrorKind::KeyLengthZero));
        assert_eq!(
            parse(&["SET", "", "v", "BAD"]),
            Err(ErrorKind::KeyLengthZero)
        );
    }

    #[test]
    fn other_commands() {
        let k = || Bytes::from_static(b"k");
        assert_eq!(parse(&["GET", "k"]), Ok(Command::Get { key: k() }));
        assert_eq!(parse(&["Del", "k"]), Ok(Command::Del { key: k() }));
        assert_eq!(
            parse(&["VDEL", "k", "v"]),
            Ok(Command::VDel {
                key: k(),
                value: Bytes::from_static(b"v")
            })
        );
        assert_eq!(
            parse(&["KEYNOTIFY", "k"]),
            Ok(Command::KeyNotify { key: k() })
        );
        assert_eq!(
            parse(&["keynotify", "k", "stop"]),
            Ok(Command::KeyNotifyStop { key: k() })
        );
        assert_eq!(
            parse(&["KEYNOTIFY", "k", "GO"]),
            Err(ErrorKind::SyntaxError)
        );
        assert_eq!(
            parse(&["SCAN", "key*"]),
            Ok(Command::Scan {
                pattern: Bytes::from_static(b"key*"),
                continuation: None
            })
        );
        assert_eq!(
            parse(&["SCAN", "", "t"]),
            Ok(Command::Scan {
                pattern: Bytes::new(),
                continuation: Some(Bytes::from_static(b"t"))
            })
        );
    }

    #[test]
    fn arity_key_and_unknown_errors() {
        let wrong = Err(ErrorKind::WrongNumberOfArguments);
        for bad in [
            &["GET"][..],
            &["GET", "k", "x"],
            &["DEL"],
            &["DEL", "k", "x"],
            &["VDEL", "k"],
            &["VDEL", "k", "v", "x"],
            &["KEYNOTIFY"],
            &["KEYNOTIFY", "k", "STOP", "x"],
            &["SCAN"],
            &["SCAN", "p", "t", "x"],
        ] {
            assert_eq!(parse(bad), wrong, "{bad:?}");
        }
        for empty_key in [
            &["GET", ""][..],
            &["DEL", ""],
            &["VDEL", "", "v"],
            &["KEYNOTIFY", ""],
            &["KEYNOTIFY", "", "STOP"],
        ] {
            assert_eq!(
                parse(empty_key),
                Err(ErrorKind::KeyLengthZero),
                "{empty_key:?}"
            );
        }
        assert_eq!(parse(&[]), Err(ErrorKind::UnknownCommand));
        assert_eq!(parse(&["PING"]), Err(ErrorKind::UnknownCommand));
        assert_eq!(parse(&["GETX", "k"]), Err(ErrorKind::UnknownCommand));
        assert_eq!(
            parse(&["FLUSHALL", "k", "x", "y"]),
            Err(ErrorKind::UnknownCommand)
        );
    }

    fn bytes() -> impl Strategy<Value = Bytes> {
        prop::collection::vec(any::<u8>(), 0..16).prop_map(Bytes::from)
    }

    fn key() -> impl Strategy<Value = Bytes> {
        prop::collection::vec(any::<u8>(), 1..16).prop_map(Bytes::from)
    }

    fn command() -> impl Strategy<Value = Command> {
        let condition = prop::sample::select(vec![
            SetCondition::Always,
            SetCondition::NotExists,
            SetCondition::NotExistsOrEqual,
        ]);
        prop_oneof![
            (
                key(),
                bytes(),
                condition,
                prop::option::of(1..=i64::MAX as u64)
            )
                .prop_map(|(key, value, condition, expiry_ms)| Command::Set {
                    key,
                    value,
                    condition,
                    expiry_ms
                }),
            key().prop_map(|key| Command::Get { key }),
            key().prop_map(|key| Command::Del { key }),
            (key(), bytes()).prop_map(|(key, value)| Command::VDel { key, value }),
            key().prop_map(|key| Command::KeyNotify { key }),
            key().prop_map(|key| Command::KeyNotifyStop { key }),
            (bytes(), prop::option::of(bytes())).prop_map(|(pattern, continuation)| {
                Command::Scan {
                    pattern,
                    continuation,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn to_args_round_trips(cmd in command()) {
            prop_assert_eq!(Command::parse(cmd.to_args()), Ok(cmd));
        }

        #[test]
        fn parse_never_panics(args in prop::collection::vec(bytes(), 0..8)) {
            let _ = Command::parse(args);
        }
    }
}
