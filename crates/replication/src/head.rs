//! A state-store command executed at a partition's head, against the key's committed chain row
//! (decision 0035): pure, no I/O.
//!
//! The row's value is a store log record — `Change::Requested` of a key delta (`Put` with value,
//! version, fencing token and expiry, or `Delete`) with the identity and first reply of the request
//! that made it. The head loads it into a fresh [`StateMachine`] with `apply_change`, runs the
//! command with the store's own `execute` (so SET NX/NEX/PX, GET, DEL, VDEL, fencing and HLC
//! versions are the single-node semantics, not a second implementation), and turns the resulting
//! delta into the next row. A retry of the request that made the row gets that request's reply.
//!
//! In process a request is a [`KeyRequest`] and its reply a [`KeyReply`]: `Bytes` shared with the
//! front end, `__ts` as an HLC, the request id hashed once where the request was received. The
//! wire's [`Routed`] and [`Executed`] (text and `Vec`s, postcard) are for requests forwarded to
//! another node only.

use std::sync::Arc;

use bytes::Bytes;
use mqstate_chain::Version;
use mqstate_protocol::{parse_request, Command, ErrorKind, Hlc, Reply, RequestLimits};
use mqstate_store::{
    Change, Delta, RequestContext, RequestId, RequestRecord, StateMachine, StoreConfig,
};

use crate::wire::{Executed, Routed};

/// A state-store request for one key, as the node that received it checked it (see [`Routed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRequest {
    pub client_id: Arc<str>,
    /// `RequestId::of(client_id, correlation)`, computed once.
    pub id: RequestId,
    pub correlation: Bytes,
    pub key: Bytes,
    /// The RESP request, as the client sent it (what is forwarded).
    pub payload: Bytes,
    /// `payload` parsed, once, where the request was received.
    pub command: Command,
    pub ts: Option<Hlc>,
    pub fencing_token: Option<Hlc>,
    /// How long the request stays valid (its message expiry), from when it was received.
    pub expiry_ms: u64,
    /// See [`Routed::deadline_ms`] (0: no deadline).
    pub deadline_ms: u64,
}

impl KeyRequest {
    /// A request forwarded by another node, parsed with `limits`; what does not parse (the
    /// sender checked it, so a bug) is answered with the store's error for it.
    pub fn from_wire(routed: Routed, limits: &RequestLimits) -> Result<KeyRequest, KeyReply> {
        let error = |kind: ErrorKind| reply_of(&Reply::Error(kind), None);
        let payload = Bytes::from(routed.payload);
        let command = parse_request(&payload, limits)
            .map_err(|e| e.kind())
            .and_then(Command::parse)
            .map_err(error)?;
        let parse_hlc = |text: Option<String>| text.as_deref().map(Hlc::parse).transpose();
        let (Ok(ts), Ok(fencing_token)) = (parse_hlc(routed.ts), parse_hlc(routed.fencing_token))
        else {
            return Err(error(ErrorKind::MalformedTimestamp));
        };
        Ok(KeyRequest {
            id: RequestId::of(&routed.client_id, &routed.correlation),
            client_id: Arc::from(routed.client_id),
            correlation: Bytes::from(routed.correlation),
            key: Bytes::from(routed.key),
            payload,
            command,
            ts,
            fencing_token,
            expiry_ms: routed.expiry_ms,
            deadline_ms: routed.deadline_ms,
        })
    }

    /// As it is forwarded to the head on another node.
    pub fn to_wire(&self) -> Routed {
        Routed {
            client_id: self.client_id.to_string(),
            correlation: self.correlation.to_vec(),
            key: self.key.to_vec(),
            payload: self.payload.to_vec(),
            ts: self.ts.as_ref().map(Hlc::to_string),
            fencing_token: self.fencing_token.as_ref().map(Hlc::to_string),
            expiry_ms: self.expiry_ms,
            deadline_ms: self.deadline_ms,
        }
    }
}

/// The reply the client gets: RESP payload and the response `__ts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyReply {
    pub payload: Bytes,
    pub ts: Option<Hlc>,
}

impl KeyReply {
    /// An `-ERR` reply with `text`.
    pub fn error(text: &str) -> KeyReply {
        KeyReply {
            payload: Bytes::from(format!("-ERR {text}\r\n")),
            ts: None,
        }
    }

    /// A reply from a head on another node; a `__ts` that does not parse (the head wrote it, so
    /// damage) is left off rather than guessed.
    pub fn from_wire(executed: Executed) -> KeyReply {
        KeyReply {
            payload: Bytes::from(executed.payload),
            ts: executed.ts.as_deref().and_then(|ts| Hlc::parse(ts).ok()),
        }
    }

    /// As it goes back to the node that forwarded the request.
    pub fn to_wire(&self) -> Executed {
        Executed {
            payload: self.payload.to_vec(),
            ts: self.ts.as_ref().map(Hlc::to_string),
        }
    }
}

/// How far past a request's deadline (set on its front end's clock) a head still starts it: the
/// nodes' clocks may differ by this much ([`crate::recent`] keeps entries well beyond it).
pub const DEADLINE_SLACK_MS: u64 = 1_000;

/// What the head does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Answer at once: a read, an error, or a retry of the row's own request.
    Reply(KeyReply),
    /// Answer at once a write that ran and changed nothing (a SET NX that found the key, a DEL of
    /// no key, a failed VDEL or fencing check); no row records it, so the head remembers `record`
    /// itself: a late copy of the request must get this reply, not run again.
    Unwritten {
        reply: KeyReply,
        record: RequestRecord,
    },
    /// Write `value` at `version` through the chain, then answer `reply`; `delta` is the key
    /// change `value` holds (its deadline and notification, once committed).
    Write {
        value: Vec<u8>,
        version: Version,
        delta: Delta,
        reply: KeyReply,
    },
}

/// The fixed inputs of [`step`].
#[derive(Debug, Clone)]
pub struct HeadConfig {
    pub store: StoreConfig,
    pub limits: RequestLimits,
    /// This node's id, the tie-breaker of chain versions.
    pub node: u64,
}

/// Executes `request` against the committed row `row` (its value; `None` if the key has no row)
/// at wall time `now_ms`. `floor` is the highest HLC this node handed out, so its versions never
/// go backwards; the second value is the new floor.
pub fn step(
    config: &HeadConfig,
    request: &KeyRequest,
    row: Option<&[u8]>,
    now_ms: u64,
    floor: Option<&Hlc>,
) -> (Step, Option<Hlc>) {
    let change = match row.map(Change::decode).transpose() {
        Ok(change) => change,
        Err(e) => {
            tracing::error!(key = ?String::from_utf8_lossy(&request.key), "a chain row does not decode: {e}");
            return (
                Step::Reply(KeyReply::error("the stored row of this key is damaged")),
                None,
            );
        }
    };
    if let Some(first) = change.as_ref().and_then(Change::request) {
        if first.id == request.id && first.expires_at_ms > now_ms {
            // A retry of the request that made this row (after a fail-over, say): its first reply.
            return (
                Step::Reply(KeyReply {
                    payload: first.reply.clone(),
                    ts: first.reply_ts.clone(),
                }),
                None,
            );
        }
    }
    if request.deadline_ms != 0 && now_ms > request.deadline_ms.saturating_add(DEADLINE_SLACK_MS) {
        // Its front end has given up; running it now could run it a second time, after the
        // window in which a retry is recognised (robustness seed 80144).
        return (
            Step::Reply(KeyReply::error(
                "the request expired before it could run; retry",
            )),
            None,
        );
    }
    let mut machine = match StateMachine::new(config.store.clone()) {
        Ok(machine) => machine,
        Err(e) => return (Step::Reply(KeyReply::error(&e.to_string())), None),
    };
    if let Some(floor) = floor {
        machine.observe_clock(floor);
    }
    if let Some(change) = &change {
        machine.apply_change(change);
    }
    let context = RequestContext {
        client_id: Arc::clone(&request.client_id),
        ts: request.ts.clone(),
        fencing_token: request.fencing_token.clone(),
        now_ms,
    };
    let execution = machine.execute(request.command.clone(), &context);
    let high_water = Some(machine.clock().high_water());
    let reply = reply_of(&execution.reply, execution.ts.as_ref());
    // What a retry of this write must get, whether it writes a row or not.
    let record = RequestRecord {
        id: request.id,
        expires_at_ms: now_ms.saturating_add(request.expiry_ms),
        reply: reply.payload.clone(),
        reply_ts: execution.ts,
    };
    let Some(delta) = execution.delta else {
        if matches!(request.command, Command::Get { .. }) {
            return (Step::Reply(reply), high_water);
        }
        return (Step::Unwritten { reply, record }, high_water);
    };
    let version = delta.version();
    let version = Version {
        wall_ms: version.wall_ms,
        counter: version.counter,
        node: config.node,
    };
    let row = Change::Requested {
        request: record,
        change: Box::new(Change::Key(delta.clone())),
    };
    match row.encode() {
        Ok(value) => (
            Step::Write {
                value,
                version,
                delta,
                reply,
            },
            high_water,
        ),
        Err(e) => (Step::Reply(KeyReply::error(&e.to_string())), None),
    }
}

fn reply_of(reply: &Reply, ts: Option<&Hlc>) -> KeyReply {
    KeyReply {
        payload: reply.encode(),
        ts: ts.cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_protocol::encode_request;
    use mqstate_store::Limits;

    fn config() -> HeadConfig {
        HeadConfig {
            store: StoreConfig {
                node_id: "mqstate".into(),
                limits: Limits::default(),
            },
            limits: RequestLimits::default(),
            node: 1,
        }
    }

    fn request(args: &[&str], correlation: u8, ts_ms: u64) -> KeyRequest {
        let routed = Routed {
            client_id: "client".into(),
            correlation: vec![correlation],
            key: args[1].as_bytes().to_vec(),
            payload: encode_request(args).to_vec(),
            ts: Some(format!("{ts_ms}:0:client")),
            fencing_token: None,
            expiry_ms: 10_000,
            deadline_ms: 0,
        };
        KeyRequest::from_wire(routed, &RequestLimits::default()).expect("a valid request")
    }

    /// Runs requests one after the other against one row, as the head does.
    fn run(requests: &[KeyRequest], now_ms: u64) -> (Vec<KeyReply>, Option<Vec<u8>>) {
        let mut row: Option<Vec<u8>> = None;
        let mut floor = None;
        let mut replies = Vec::new();
        let mut last_version = None;
        for request in requests {
            let (step, high) = step(&config(), request, row.as_deref(), now_ms, floor.as_ref());
            floor = high.or(floor);
            match step {
                Step::Reply(reply) | Step::Unwritten { reply, .. } => replies.push(reply),
                Step::Write {
                    value,
                    version,
                    reply,
                    ..
                } => {
                    assert!(Some(version) > last_version, "versions only grow");
                    last_version = Some(version);
                    row = Some(value);
                    replies.push(reply);
                }
            }
        }
        (replies, row)
    }

    #[test]
    fn store_semantics_on_a_row_nx_vdel_and_retries() {
        let now = 1_700_000_000_000;
        let (replies, _) = run(
            &[
                request(&["SET", "k", "v1", "NX"], 1, now),
                request(&["SET", "k", "v2", "NX"], 2, now),
                request(&["GET", "k"], 3, now),
                request(&["VDEL", "k", "other"], 4, now),
                request(&["VDEL", "k", "v1"], 5, now),
                request(&["GET", "k"], 6, now),
                // A retry of the VDEL that made the row: its first reply, not a second run.
                request(&["VDEL", "k", "v1"], 5, now),
            ],
            now,
        );
        let payloads: Vec<String> = replies
            .iter()
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect();
        assert_eq!(
            payloads,
            [
                "+OK\r\n",
                ":-1\r\n",
                "$2\r\nv1\r\n",
                ":-1\r\n",
                ":1\r\n",
                "$-1\r\n",
                ":1\r\n"
            ]
        );
        // The GET answers the SET's version as its `__ts`.
        assert_eq!(replies[0].ts, replies[2].ts);
        assert!(replies[0].ts.is_some());
    }

    /// Cluster simulation seed 61: a write that changed nothing is remembered by its head (a late
    /// copy of it must not run again and apply); a read is not.
    #[test]
    fn a_write_that_changed_nothing_is_answered_with_a_record_to_remember() {
        let now = 1_700_000_000_000;
        let (_, row) = run(&[request(&["SET", "k", "v1"], 1, now)], now);
        for (args, reply) in [
            (&["SET", "k", "v2", "NX"][..], ":-1\r\n"),
            (&["VDEL", "k", "other"][..], ":-1\r\n"),
        ] {
            let (outcome, _) = step(&config(), &request(args, 2, now), row.as_deref(), now, None);
            let Step::Unwritten {
                reply: answer,
                record,
            } = outcome
            else {
                panic!("{args:?} changes nothing: {outcome:?}");
            };
            assert_eq!(&answer.payload[..], reply.as_bytes(), "{args:?}");
            assert_eq!(record.reply, answer.payload);
            assert_eq!(record.id, RequestId::of("client", &[2]));
            assert_eq!(record.expires_at_ms, now + 10_000);
        }
        let (outcome, _) = step(
            &config(),
            &request(&["DEL", "gone"], 3, now),
            None,
            now,
            None,
        );
        assert!(matches!(outcome, Step::Unwritten { .. }), "{outcome:?}");
        let (outcome, _) = step(
            &config(),
            &request(&["GET", "k"], 4, now),
            row.as_deref(),
            now,
            None,
        );
        assert!(matches!(outcome, Step::Reply(_)), "{outcome:?}");
    }

    #[test]
    fn a_request_past_its_deadline_does_not_run() {
        // A copy of a request that waited out a pause (robustness seed 80144): its front end
        // gave up, and running it now would be a second run no retry window recognises.
        let now = 1_700_000_000_000;
        let late = KeyRequest {
            deadline_ms: now - DEADLINE_SLACK_MS - 1,
            ..request(&["SET", "k", "v"], 1, now)
        };
        let (step_late, _) = step(&config(), &late, None, now, None);
        let Step::Reply(reply) = step_late else {
            panic!("a late request must not write: {step_late:?}");
        };
        assert!(reply.payload.starts_with(b"-ERR"), "{reply:?}");
        // Within the clocks' slack it still runs.
        let on_time = KeyRequest {
            deadline_ms: now - DEADLINE_SLACK_MS,
            ..request(&["SET", "k", "v"], 2, now)
        };
        assert!(matches!(
            step(&config(), &on_time, None, now, None).0,
            Step::Write { .. }
        ));
    }

    #[test]
    fn fencing_tokens_are_kept_in_the_row() {
        let now = 1_700_000_000_000;
        let fenced = |args: &[&str], correlation: u8, token: &str| KeyRequest {
            fencing_token: Some(Hlc::parse(token).expect("a valid token")),
            ..request(args, correlation, now)
        };
        let (replies, _) = run(
            &[
                fenced(&["SET", "lock", "a"], 1, &format!("{now}:5:a")),
                // A lower token is refused, an equal or higher one accepted (the store's rule).
                fenced(&["SET", "lock", "b"], 2, &format!("{now}:4:a")),
                fenced(&["SET", "lock", "c"], 3, &format!("{now}:6:a")),
                request(&["GET", "lock"], 4, now),
            ],
            now,
        );
        let payloads: Vec<String> = replies
            .iter()
            .map(|r| String::from_utf8_lossy(&r.payload).into_owned())
            .collect();
        assert_eq!(payloads[0], "+OK\r\n");
        assert!(payloads[1].starts_with("-ERR"), "{payloads:?}");
        assert_eq!(payloads[2], "+OK\r\n");
        assert_eq!(payloads[3], "$1\r\nc\r\n");
    }

    #[test]
    fn expired_rows_are_absent_and_damaged_rows_are_an_error() {
        let now = 1_700_000_000_000;
        let (_, row) = run(&[request(&["SET", "k", "v", "PX", "10"], 1, now)], now);
        let later = now + 1_000;
        let (step_after, _) = step(
            &config(),
            &request(&["GET", "k"], 2, later),
            row.as_deref(),
            later,
            None,
        );
        assert_eq!(
            step_after,
            Step::Reply(KeyReply {
                payload: Bytes::from_static(b"$-1\r\n"),
                ts: None
            })
        );
        let (damaged, _) = step(
            &config(),
            &request(&["GET", "k"], 3, now),
            Some(b"??"),
            now,
            None,
        );
        assert!(matches!(damaged, Step::Reply(r) if r.payload.starts_with(b"-ERR")));
    }
}
