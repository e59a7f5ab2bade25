//! The chain log's records (`<data-dir>/chains/`, decision 0035) as `mqstate data` shows them: per
//! record its partition, then each replica record — a row's key, version, lock bit and view, with
//! the store change its value holds (the request and key change the head made), or a replica's
//! re-entry (`clear`), its copy complete (`caught-up`), it being readable again, or a note (a
//! request its head answered without a row, decision 0050). A row of a
//! sessions replica (its number has [`space::SESSIONS`] set, decision 0047) holds a client's
//! persistent session (`mqstate_sessions::row`), not a store change, and is shown as one.

use mqstate_chain::{Record, Row};
use mqstate_replication::log::decode_batch;
use mqstate_replication::recent::decode_note;
use mqstate_replication::space;
use mqstate_sessions::row::{self as session_row, SessionRow};
use mqstate_store::Change;
use serde_json::{json, Value};

use super::{DeltaView, RequestShown, Shown};

/// One record, as text (`; `-separated records) or as JSON text.
pub(super) fn describe(data: &[u8], max_bytes: usize, as_json: bool) -> String {
    match decode_batch(data) {
        Ok((partition, records)) if as_json => json!({
            "partition": partition,
            "records": records.iter().map(|r| record_json(partition, r, max_bytes)).collect::<Vec<_>>(),
        })
        .to_string(),
        Ok((partition, records)) => format!(
            "partition {partition}: {}",
            records
                .iter()
                .map(|r| record_text(partition, r, max_bytes))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Err(e) if as_json => json!({"op": "undecodable", "error": e}).to_string(),
        Err(e) => format!("UNDECODABLE: {e}"),
    }
}

/// Why a record's data is not a replica's batch; `None` if it is.
pub(super) fn decode_error(data: &[u8]) -> Option<String> {
    decode_batch(data).err()
}

fn version(row: &Row) -> String {
    let v = row.version;
    format!("{}:{}:{}", v.wall_ms, v.counter, v.node)
}

/// Whether `replica` is a sessions replica, whose rows are sessions.
fn holds_sessions(replica: u32) -> bool {
    replica & space::SESSIONS != 0
}

fn decode_session(client_id: &[u8], value: &[u8]) -> Result<SessionRow, String> {
    let client_id = std::str::from_utf8(client_id)
        .map_err(|_| "the key is not a UTF-8 client id".to_owned())?;
    session_row::decode(client_id, value).map_err(|e| e.to_string())
}

/// A session row's summary, or why it does not decode. A row's key is its client id.
fn session_text(client_id: &[u8], value: &[u8]) -> String {
    match decode_session(client_id, value) {
        Ok(row) => {
            let SessionRow {
                owner,
                epoch,
                session,
                observed,
                ..
            } = &row;
            let state = match session.detached_at_ms {
                Some(at) => format!("detached at {at} ms"),
                None => "connected".to_owned(),
            };
            let will = if session.will.is_some() {
                ", a delayed will"
            } else if session.connected_will.is_some() {
                ", a will"
            } else {
                ""
            };
            format!(
                "session owner {owner} epoch {epoch}, {state}, expiry {} s, {} subscriptions, \
                 {} queued messages, {} observed keys{will}",
                session.expiry_secs,
                session.subscriptions.len(),
                session.messages.len(),
                observed.len(),
            )
        }
        Err(e) => format!("UNDECODABLE session row: {e}"),
    }
}

fn session_json(client_id: &[u8], value: &[u8]) -> Value {
    match decode_session(client_id, value) {
        Ok(row) => json!({
            "op": "session",
            "owner": row.owner,
            "epoch": row.epoch,
            "connected": row.session.detached_at_ms.is_none(),
            "detached_at_ms": row.session.detached_at_ms,
            "expiry_secs": row.session.expiry_secs,
            "subscriptions": row.session.subscriptions.len(),
            "queued_messages": row.session.messages.len(),
            "observed_keys": row.observed.len(),
            "will": row.session.will.is_some() || row.session.connected_will.is_some(),
        }),
        Err(e) => json!({"op": "undecodable", "error": e}),
    }
}

fn record_text(replica: u32, record: &Record, max_bytes: usize) -> String {
    match record {
        Record::Row { key, row } => {
            let value = match &row.value {
                None => "tombstone".to_owned(),
                Some(value) if holds_sessions(replica) => session_text(key, value),
                Some(value) => {
                    let change = Change::decode(value);
                    let request = RequestShown::of(&change, max_bytes);
                    let view = DeltaView::of(change, max_bytes);
                    match request {
                        Some(request) => format!("{view} {request}"),
                        None => view.to_string(),
                    }
                }
            };
            format!(
                "row {} version {} view {} {}: {value}",
                Shown::new(key, max_bytes),
                version(row),
                row.view,
                if row.locked { "LOCKED" } else { "unlocked" },
            )
        }
        Record::Clear { view } => format!("clear (re-enters at the tail of view {view})"),
        Record::CaughtUp { view } => format!("caught-up (copy complete in view {view})"),
        Record::Readable => "readable".to_owned(),
        Record::Note { note } => match decode_note(note) {
            Ok(request) => format!(
                "note: answered without a row {}",
                RequestShown::of_record(&request, max_bytes)
            ),
            Err(e) => format!("note UNDECODABLE: {e}"),
        },
    }
}

fn record_json(replica: u32, record: &Record, max_bytes: usize) -> Value {
    match record {
        Record::Row { key: raw_key, row } => {
            let key = Shown::new(raw_key, max_bytes);
            let value = row.value.as_ref().map(|value| {
                if holds_sessions(replica) {
                    return session_json(raw_key, value);
                }
                let change = Change::decode(value);
                let request = RequestShown::of(&change, max_bytes);
                let mut view = DeltaView::of(change, max_bytes).to_json();
                if let (Value::Object(fields), Some(request)) = (&mut view, request) {
                    fields.insert("request".to_owned(), request.to_json());
                }
                view
            });
            json!({
                "op": "row",
                "key": key.text, "key_len": key.len,
                "version": version(row),
                "view": row.view,
                "locked": row.locked,
                "tombstone": row.value.is_none(),
                "change": value,
            })
        }
        Record::Clear { view } => json!({"op": "clear", "view": view}),
        Record::CaughtUp { view } => json!({"op": "caught-up", "view": view}),
        Record::Readable => json!({"op": "readable"}),
        Record::Note { note } => match decode_note(note) {
            Ok(request) => json!({
                "op": "note",
                "request": RequestShown::of_record(&request, max_bytes).to_json(),
            }),
            Err(e) => json!({"op": "note", "error": e}),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_chain::Version;

    #[test]
    fn a_row_shows_partition_key_version_lock_and_view() {
        let value = mqstate_store::Delta::Delete {
            key: bytes::Bytes::from_static(b"k1"),
            version: mqstate_protocol::Hlc::new(1_700_000_000_000, 2, "n1".into()),
        }
        .encode()
        .unwrap();
        let data = mqstate_replication::log::encode_batch(
            7,
            vec![
                Record::Clear { view: 4 },
                Record::Row {
                    key: b"k1".to_vec(),
                    row: Row {
                        value: Some(value.to_vec()),
                        version: Version {
                            wall_ms: 1_700_000_000_000,
                            counter: 2,
                            node: 3,
                        },
                        view: 5,
                        locked: true,
                    },
                },
            ],
        );
        assert_eq!(decode_error(&data), None);
        let text = describe(&data, 64, false);
        assert!(text.starts_with("partition 7: clear"), "{text}");
        assert!(
            text.contains("row \"k1\" version 1700000000000:2:3 view 5 LOCKED: "),
            "{text}"
        );
        assert!(text.contains("delete"), "{text}");
        let json: Value = serde_json::from_str(&describe(&data, 64, true)).unwrap();
        assert_eq!(json["partition"], 7);
        assert_eq!(json["records"][1]["locked"], true);
        assert_eq!(json["records"][1]["view"], 5);
        assert_eq!(json["records"][1]["key"], "k1");
        assert!(describe(b"\xff\xff\xff\xff\xff\xff", 64, false).starts_with("UNDECODABLE"));
    }

    #[test]
    fn a_sessions_replica_row_shows_the_session_it_holds() {
        let client_id: std::sync::Arc<str> = "c1".into();
        let session = mqstate_broker::StoredSession {
            expiry_secs: 60,
            detached_at_ms: Some(1_700_000_000_000),
            ..Default::default()
        };
        let row = SessionRow {
            owner: 2,
            epoch: 3,
            session,
            observed: vec![b"k1".to_vec()],
            cursors: Default::default(),
        };
        let record = |value: Vec<u8>| Record::Row {
            key: b"c1".to_vec(),
            row: Row {
                value: Some(value),
                version: Version {
                    wall_ms: 1_700_000_000_001,
                    counter: 0,
                    node: 2,
                },
                view: 1,
                locked: false,
            },
        };
        let replica = space::sessions(7);
        let data = mqstate_replication::log::encode_batch(
            replica,
            vec![
                record(session_row::encode(&client_id, &row)),
                record(vec![9]),
            ],
        );
        let text = describe(&data, 64, false);
        assert!(
            text.contains(
                "session owner 2 epoch 3, detached at 1700000000000 ms, expiry 60 s, \
                 0 subscriptions, 0 queued messages, 1 observed keys; "
            ),
            "{text}"
        );
        assert!(text.contains("UNDECODABLE session row"), "{text}");
        let json: Value = serde_json::from_str(&describe(&data, 64, true)).unwrap();
        assert_eq!(json["records"][0]["key"], "c1");
        assert_eq!(json["records"][0]["change"]["op"], "session");
        assert_eq!(json["records"][0]["change"]["epoch"], 3);
        assert_eq!(json["records"][1]["change"]["op"], "undecodable");
    }

    #[test]
    fn a_note_shows_its_request() {
        let request = mqstate_store::RequestRecord {
            id: mqstate_store::RequestId::of("c", b"1"),
            expires_at_ms: 99,
            reply: bytes::Bytes::from_static(b":-1\r\n"),
            reply_ts: None,
        };
        let note = mqstate_replication::recent::note_of(&request);
        let data = mqstate_replication::log::encode_batch(
            2,
            vec![
                Record::Note { note },
                Record::Note {
                    note: b"\xff".to_vec(),
                },
            ],
        );
        let text = describe(&data, 64, false);
        assert!(
            text.contains("note: answered without a row by request"),
            "{text}"
        );
        assert!(text.contains("until 99 ms gets \":-1\""), "{text}");
        assert!(text.contains("note UNDECODABLE"), "{text}");
        let json: Value = serde_json::from_str(&describe(&data, 64, true)).unwrap();
        assert_eq!(json["records"][0]["op"], "note");
        assert_eq!(json["records"][0]["request"]["expires_at_ms"], 99);
        assert!(json["records"][1]["error"].is_string());
    }
}
