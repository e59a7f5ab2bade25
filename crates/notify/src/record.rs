//! One notification as JSON (`docs/notifications.md`):
//!
//! ```json
//! {"topic":"orders","seq":7,"key":"order:1","event":"set","version":"1700000000000:0:mqstate","value":"…"}
//! ```
//! Keys and values that are UTF-8 are JSON strings; any other bytes go in `key_base64` /
//! `value_base64` (standard alphabet, padded) instead. A delete or expire has no value.

use std::sync::Arc;

use std::io::Write;

use base64::Engine;
use bytes::Bytes;

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

/// Text if UTF-8, else base64 (standard alphabet, padded).
fn text_or_base64(bytes: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(bytes).map_err(|_| base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// A JSON string: serde_json's escaping of one `&str` (cannot fail into a `Vec`).
fn put_str(out: &mut Vec<u8>, text: &str) {
    let _ = serde_json::to_writer(&mut *out, text);
}

impl Record {
    /// Appends the record's JSON object to `out`. Written field by field (serde_json escapes the
    /// strings) rather than through a derived `Serialize`: it is the delivery side's per-record
    /// cost, on the cores the writes use.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"topic\":");
        put_str(out, &self.topic);
        out.extend_from_slice(b",\"seq\":");
        let _ = write!(out, "{}", self.seq);
        match text_or_base64(&self.key) {
            Ok(key) => {
                out.extend_from_slice(b",\"key\":");
                put_str(out, key);
            }
            Err(base64) => {
                out.extend_from_slice(b",\"key_base64\":");
                put_str(out, &base64);
            }
        }
        out.extend_from_slice(b",\"event\":");
        put_str(out, self.event);
        out.extend_from_slice(b",\"version\":");
        put_str(out, &self.version);
        match self.value.as_deref().map(text_or_base64) {
            None => {}
            Some(Ok(value)) => {
                out.extend_from_slice(b",\"value\":");
                put_str(out, value);
            }
            Some(Err(base64)) => {
                out.extend_from_slice(b",\"value_base64\":");
                put_str(out, &base64);
            }
        }
        out.push(b'}');
    }

    /// About the size of the record's JSON when nothing needs escaping.
    fn json_len_hint(&self) -> usize {
        96 + self.topic.len()
            + self.key.len()
            + self.version.len()
            + self.value.as_ref().map_or(0, Bytes::len)
    }

    /// The record's JSON (an MQTT push's payload).
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.json_len_hint());
        self.write_json(&mut out);
        out
    }
}

/// The body of an HTTP push: `{"records": [...]}`, in one allocation as a rule.
pub fn batch_json(records: &[Record]) -> Vec<u8> {
    let size = records.iter().map(Record::json_len_hint).sum::<usize>();
    let mut body = Vec::with_capacity(16 + size);
    body.extend_from_slice(b"{\"records\":[");
    for (i, record) in records.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        record.write_json(&mut body);
    }
    body.extend_from_slice(b"]}");
    body
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
