//! One notification as JSON (`docs/notifications.md`):
//!
//! ```json
//! {"topic":"orders","seq":7,"key":"order:1","event":"set","version":"1700000000000:0:mqstate","value":"…"}
//! ```
//! Keys and values that are UTF-8 are JSON strings; any other bytes go in `key_base64` /
//! `value_base64` (standard alphabet, padded) instead. A delete or expire has no value.

use base64::Engine;
use bytes::Bytes;
use serde_json::{Map, Value};

/// A notification to deliver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub topic: String,
    /// 1, 2, 3 … per topic: a consumer drops a seq it has seen (at-least-once delivery).
    pub seq: u64,
    pub key: Bytes,
    /// `set`, `delete` or `expire`.
    pub event: &'static str,
    /// The HLC text of the change.
    pub version: String,
    pub value: Option<Bytes>,
}

impl Record {
    pub fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("topic".into(), Value::from(self.topic.as_str()));
        object.insert("seq".into(), Value::from(self.seq));
        put_bytes(&mut object, "key", &self.key);
        object.insert("event".into(), Value::from(self.event));
        object.insert("version".into(), Value::from(self.version.as_str()));
        if let Some(value) = &self.value {
            put_bytes(&mut object, "value", value);
        }
        Value::Object(object)
    }
}

fn put_bytes(object: &mut Map<String, Value>, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => object.insert(name.to_owned(), Value::from(text)),
        Err(_) => object.insert(
            format!("{name}_base64"),
            Value::from(base64::engine::general_purpose::STANDARD.encode(bytes)),
        ),
    };
}

/// The body of an HTTP push: `{"records": [...]}`.
pub fn batch_json(records: &[Record]) -> Vec<u8> {
    let records: Vec<Value> = records.iter().map(Record::to_json).collect();
    serde_json::to_vec(&serde_json::json!({ "records": records })).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn golden_record() {
        assert_eq!(
            record(Some(b"hi")).to_json(),
            serde_json::json!({"topic": "orders", "seq": 7, "key": "order:1", "event": "set",
                               "version": "5:0:mqstate", "value": "hi"})
        );
        let binary = record(Some(&[0xff, 0x00])).to_json();
        assert_eq!(binary["value_base64"], "/wA=");
        assert!(binary.get("value").is_none());
        assert!(record(None).to_json().get("value").is_none());
    }

    #[test]
    fn a_batch_wraps_records() {
        let body: Value = serde_json::from_slice(&batch_json(&[record(None)])).unwrap();
        assert_eq!(body["records"][0]["seq"], 7);
    }
}
