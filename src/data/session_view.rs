//! The session log's records and snapshot as `mqstate data` shows them: change lists decoded with
//! the broker's own decoder (`mqstate_broker::persist::decode_changes`), one line per change.

use mqstate_broker::persist::decode_changes;
use mqstate_broker::{Message, Restored, SessionChange};
use serde_json::{json, Value};

use super::Shown;

/// One record's change list, as text (`; `-separated) or as JSON text.
pub(super) fn describe(data: &[u8], max_bytes: usize, as_json: bool) -> String {
    match decode_changes(data) {
        Ok(changes) if as_json => Value::Array(
            changes
                .iter()
                .map(
                    |c| json!({"op": op(c), "client_id": client_id(c), "text": text(c, max_bytes)}),
                )
                .collect(),
        )
        .to_string(),
        Ok(changes) if changes.is_empty() => "checkpoint (no changes)".to_owned(),
        Ok(changes) => changes
            .iter()
            .map(|c| text(c, max_bytes))
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) if as_json => json!({"op": "undecodable", "error": e.to_string()}).to_string(),
        Err(e) => format!("UNDECODABLE: {e}"),
    }
}

/// Why a record's (or snapshot's) data is not a change list; `None` if it is.
pub(super) fn decode_error(data: &[u8]) -> Option<String> {
    decode_changes(data).err().map(|e| e.to_string())
}

/// What a session snapshot holds: counts to show, or why it does not decode.
pub(super) fn snapshot_counts(state: &[u8]) -> Result<Vec<(&'static str, usize)>, String> {
    let changes = decode_changes(state).map_err(|e| e.to_string())?;
    let mut restored = Restored::default();
    for change in changes {
        restored.apply(change);
    }
    let messages = restored.sessions.values().map(|s| s.messages.len()).sum();
    let wills = restored
        .sessions
        .values()
        .filter(|s| s.will.is_some())
        .count();
    let qos2_ids = restored
        .sessions
        .values()
        .map(|s| s.inbound_qos2.len())
        .sum();
    Ok(vec![
        ("sessions", restored.sessions.len()),
        ("queued messages", messages),
        ("inbound qos2 packet ids", qos2_ids),
        ("delayed wills", wills),
        ("retained messages", restored.retained.len()),
    ])
}

fn op(change: &SessionChange) -> &'static str {
    match change {
        SessionChange::Created { .. } => "created",
        SessionChange::Attached { .. } => "attached",
        SessionChange::Detached { .. } => "detached",
        SessionChange::Subscribed { .. } => "subscribed",
        SessionChange::Unsubscribed { .. } => "unsubscribed",
        SessionChange::Appended { .. } => "appended",
        SessionChange::Sent { .. } => "sent",
        SessionChange::Released { .. } => "released",
        SessionChange::Removed { .. } => "removed",
        SessionChange::Deleted { .. } => "deleted",
        SessionChange::Qos2Received { .. } => "qos2-received",
        SessionChange::Qos2Released { .. } => "qos2-released",
        SessionChange::WillScheduled { .. } => "will-scheduled",
        SessionChange::WillCancelled { .. } => "will-cancelled",
        SessionChange::WillSet { .. } => "will-set",
        SessionChange::Took { .. } => "took",
        SessionChange::RetainedSet { .. } => "retained-set",
        SessionChange::RetainedCleared { .. } => "retained-cleared",
    }
}

fn client_id(change: &SessionChange) -> Option<&str> {
    match change {
        SessionChange::Created { client_id, .. }
        | SessionChange::Attached { client_id, .. }
        | SessionChange::Detached { client_id, .. }
        | SessionChange::Subscribed { client_id, .. }
        | SessionChange::Unsubscribed { client_id, .. }
        | SessionChange::Appended { client_id, .. }
        | SessionChange::Sent { client_id, .. }
        | SessionChange::Released { client_id, .. }
        | SessionChange::Removed { client_id, .. }
        | SessionChange::Deleted { client_id }
        | SessionChange::Qos2Received { client_id, .. }
        | SessionChange::Qos2Released { client_id, .. }
        | SessionChange::WillScheduled { client_id, .. }
        | SessionChange::WillCancelled { client_id }
        | SessionChange::WillSet { client_id, .. }
        | SessionChange::Took { client_id, .. } => Some(client_id),
        SessionChange::RetainedSet { .. } | SessionChange::RetainedCleared { .. } => None,
    }
}

fn message(m: &Message, max_bytes: usize) -> String {
    format!(
        "topic {} payload {} qos {}{}",
        Shown::new(m.topic.as_bytes(), max_bytes),
        Shown::new(&m.payload, max_bytes),
        m.qos as u8,
        if m.retain { " retain" } else { "" }
    )
}

fn text(change: &SessionChange, max_bytes: usize) -> String {
    let id = |id: &str| Shown::new(id.as_bytes(), max_bytes);
    match change {
        SessionChange::Created {
            client_id,
            expiry_secs,
        } => format!("created {} expiry {expiry_secs}s", id(client_id)),
        SessionChange::Attached {
            client_id,
            expiry_secs,
        } => format!("attached {} expiry {expiry_secs}s", id(client_id)),
        SessionChange::Detached {
            client_id,
            expiry_secs,
            at_ms,
        } => format!(
            "detached {} at-ms {at_ms} expiry {expiry_secs}s",
            id(client_id)
        ),
        SessionChange::Subscribed {
            client_id,
            filter,
            options,
        } => format!(
            "subscribed {} filter {} qos {}",
            id(client_id),
            Shown::new(filter.as_bytes(), max_bytes),
            options.qos as u8
        ),
        SessionChange::Unsubscribed { client_id, filter } => format!(
            "unsubscribed {} filter {}",
            id(client_id),
            Shown::new(filter.as_bytes(), max_bytes)
        ),
        SessionChange::Appended {
            client_id,
            seq,
            message: stored,
        } => format!(
            "appended {} seq {seq} {} received-at-ms {}",
            id(client_id),
            message(&stored.message, max_bytes),
            stored.received_at_ms
        ),
        SessionChange::Sent {
            client_id,
            seq,
            packet_id,
        } => format!("sent {} seq {seq} packet-id {packet_id}", id(client_id)),
        SessionChange::Released { client_id, seq } => {
            format!("released {} seq {seq}", id(client_id))
        }
        SessionChange::Removed { client_id, seq } => {
            format!("removed {} seq {seq}", id(client_id))
        }
        SessionChange::Deleted { client_id } => format!("deleted {}", id(client_id)),
        SessionChange::Qos2Received {
            client_id,
            packet_id,
        } => format!("qos2-received {} packet-id {packet_id}", id(client_id)),
        SessionChange::Qos2Released {
            client_id,
            packet_id,
        } => format!("qos2-released {} packet-id {packet_id}", id(client_id)),
        SessionChange::WillScheduled {
            client_id,
            will,
            at_ms,
        } => format!(
            "will-scheduled {} due-at-ms {at_ms} {}",
            id(client_id),
            message(&will.message, max_bytes)
        ),
        SessionChange::WillCancelled { client_id } => {
            format!("will-cancelled {}", id(client_id))
        }
        SessionChange::Took {
            client_id,
            id: publish,
            at_ms,
            keep_ms,
        } => format!(
            "took {} publish {}/{}/{} at-ms {at_ms} keep-ms {keep_ms}",
            id(client_id),
            publish.node,
            publish.incarnation,
            publish.seq
        ),
        SessionChange::WillSet { client_id, will } => format!(
            "will-set {} delay-secs {} {}",
            id(client_id),
            will.delay_secs,
            message(&will.message, max_bytes)
        ),
        SessionChange::RetainedSet {
            message: m,
            received_at_ms,
        } => format!(
            "retained-set {} received-at-ms {received_at_ms}",
            message(m, max_bytes)
        ),
        SessionChange::RetainedCleared { topic, at_ms } => format!(
            "retained-cleared topic {}{}",
            Shown::new(topic.as_bytes(), max_bytes),
            at_ms.map_or_else(String::new, |at| format!(" at-ms {at}"))
        ),
    }
}

#[cfg(test)]
mod tests {
    use mqstate_broker::persist::encode_changes;

    use super::*;

    #[test]
    fn changes_read_as_one_line_each_and_garbage_is_flagged() {
        let data = encode_changes(&[
            SessionChange::Created {
                client_id: "dev\n1".into(),
                expiry_secs: 60,
            },
            SessionChange::Removed {
                client_id: "dev\n1".into(),
                seq: 7,
            },
            SessionChange::Qos2Received {
                client_id: "p".into(),
                packet_id: 9,
            },
            SessionChange::Qos2Released {
                client_id: "p".into(),
                packet_id: 9,
            },
        ]);
        assert_eq!(
            describe(&data, 64, false),
            "created \"dev\\n1\" expiry 60s; removed \"dev\\n1\" seq 7; \
             qos2-received \"p\" packet-id 9; qos2-released \"p\" packet-id 9"
        );
        let listed: Value = serde_json::from_str(&describe(&data, 64, true)).unwrap();
        assert_eq!(listed[1]["op"], "removed");
        assert_eq!(listed[1]["client_id"], "dev\n1");
        assert_eq!(
            describe(&encode_changes(&[]), 64, false),
            "checkpoint (no changes)"
        );
        assert!(describe(b"\x07", 64, false).starts_with("UNDECODABLE: "));
        assert!(decode_error(b"\x07").is_some());
        assert_eq!(decode_error(&data), None);
    }
}
