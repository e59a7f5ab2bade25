//! One notification as JSON (`docs/notifications.md`):
//!
//! ```json
//! {"topic":"orders","seq":7,"key":"order:1","event":"set","version":"1700000000000:0:mqstate","value":"…"}
//! ```
//! Keys and values that are UTF-8 are JSON strings; any other bytes go in `key_base64` /
//! `value_base64` (standard alphabet, padded) instead. A delete or expire has no value.

use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use serde::Serialize;

/// A notification to deliver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Shared by the records of a topic.
    pub topic: Arc<str>,
    /// 1, 2, 3 … per topic: a consumer drops a seq it has seen (at-least-once delivery).
    pub seq: u64,
    pub key: Bytes,
    /// `set`, `delete` or `expire`.
    pub event: &'static str,
    /// The HLC text of the change.
    pub version: String,
    pub value: Option<Bytes>,
}

/// A record as serialized: borrowed, so that a batch is written straight into its buffer (no JSON
/// tree, no copies of keys and values that are UTF-8).
#[derive(Serialize)]
struct Wire<'a> {
    topic: &'a str,
    seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_base64: Option<String>,
    event: &'a str,
    version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value_base64: Option<String>,
}

/// Text if UTF-8, else base64 (standard alphabet, padded).
fn text_or_base64(bytes: &[u8]) -> (Option<&str>, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(text) => (Some(text), None),
        Err(_) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
        ),
    }
}

impl Record {
    fn wire(&self) -> Wire<'_> {
        let (key, key_base64) = text_or_base64(&self.key);
        let (value, value_base64) = match &self.value {
            Some(value) => text_or_base64(value),
            None => (None, None),
        };
        Wire {
            topic: &self.topic,
            seq: self.seq,
            key,
            key_base64,
            event: self.event,
            version: &self.version,
            value,
            value_base64,
        }
    }

    /// The record's JSON (an MQTT push's payload).
    pub fn to_json(&self) -> Vec<u8> {
        // Cannot fail: every field is a string or a number.
        serde_json::to_vec(&self.wire()).unwrap_or_default()
    }
}

/// The body of an HTTP push: `{"records": [...]}`.
pub fn batch_json(records: &[Record]) -> Vec<u8> {
    #[derive(Serialize)]
    struct Batch<'a> {
        records: Vec<Wire<'a>>,
    }
    let batch = Batch {
        records: records.iter().map(Record::wire).collect(),
    };
    // The body in one allocation, as a rule: a record's fields, names and punctuation, and keys
    // and values that need no escapes.
    let size = records
        .iter()
        .map(|r| {
            96 + r.topic.len()
                + r.key.len()
                + r.version.len()
                + r.value.as_ref().map_or(0, Bytes::len)
        })
        .sum::<usize>();
    let mut body = Vec::with_capacity(16 + size);
    // Cannot fail: every field is a string or a number.
    match serde_json::to_writer(&mut body, &batch) {
        Ok(()) => body,
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn record(value: Option<&'static [u8]>) -> Record {
        Record {
            topic: "orders".into(),
            seq: 7,
            key: Bytes::from_static(b"order:1"),
            event: "set",
            version: "5:0:mqstate".into(),
            value: value.map(Bytes::from_static),
        }
    }

    fn json(record: &Record) -> Value {
        serde_json::from_slice(&record.to_json()).unwrap()
    }

    #[test]
    fn golden_record() {
        assert_eq!(
            String::from_utf8(record(Some(b"hi")).to_json()).unwrap(),
            r#"{"topic":"orders","seq":7,"key":"order:1","event":"set","version":"5:0:mqstate","value":"hi"}"#
        );
        let binary = json(&record(Some(&[0xff, 0x00])));
        assert_eq!(binary["value_base64"], "/wA=");
        assert!(binary.get("value").is_none());
        assert!(json(&record(None)).get("value").is_none());
        let mut binary_key = record(None);
        binary_key.key = Bytes::from_static(&[0x80]);
        let binary_key = json(&binary_key);
        assert_eq!(binary_key["key_base64"], "gA==");
        assert!(binary_key.get("key").is_none());
    }

    #[test]
    fn a_batch_wraps_records() {
        let body: Value = serde_json::from_slice(&batch_json(&[record(None)])).unwrap();
        assert_eq!(body["records"][0]["seq"], 7);
        assert_eq!(body["records"][0], json(&record(None)));
    }

    #[test]
    fn escapes_are_json() {
        let mut tricky = record(Some(b"a\"b\\c\n\x01"));
        tricky.key = Bytes::from_static("k\u{2028}é".as_bytes());
        let back = json(&tricky);
        assert_eq!(back["value"], "a\"b\\c\n\u{1}");
        assert_eq!(back["key"], "k\u{2028}é");
    }
}
