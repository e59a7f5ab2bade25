//! The admin RPC of notification topics: a JSON request PUBLISHed (MQTT 5, with Response Topic and
//! Correlation Data) on [`super::ADMIN_TOPIC`], a JSON reply on the response topic. Who may publish
//! there is the broker's topic authorization: with an ACL configured, only users it grants the topic.
//!
//! ```text
//! {"op":"create","name":"orders","endpoint":"http://…","keys":"order:*","events":["set"],"max_queue":10000}
//! {"op":"list"} | {"op":"get","name":"orders"} | {"op":"stats","name":"orders"} | {"op":"rm","name":"orders"}
//! ```
//! A reply is the requested object, or `{"error": "<what is wrong>"}`.

use bytes::Bytes;
use mqstate_store::notify::{Event, TopicDef, ALL_EVENTS};
use serde_json::{json, Value};

/// Default `max_queue` of a new topic.
pub const DEFAULT_MAX_QUEUE: u32 = 10_000;

/// One admin request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminRequest {
    Create(TopicDef),
    List,
    Get(String),
    Stats(String),
    Remove(String),
}

fn name(request: &Value) -> Result<String, String> {
    request["name"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| "the request needs \"name\" (a string)".to_owned())
}

impl AdminRequest {
    pub fn parse(payload: &[u8]) -> Result<AdminRequest, String> {
        let request: Value =
            serde_json::from_slice(payload).map_err(|e| format!("the request is not JSON: {e}"))?;
        match request["op"].as_str() {
            Some("create") => {
                let events = match &request["events"] {
                    Value::Null => ALL_EVENTS,
                    Value::Array(list) => list.iter().try_fold(0u8, |bits, e| {
                        e.as_str()
                            .and_then(Event::parse)
                            .map(|e| bits | e.bit())
                            .ok_or_else(|| format!("unknown event {e}: use set, delete, expire"))
                    })?,
                    _ => return Err("\"events\" must be a list of set, delete, expire".into()),
                };
                let max_queue = match &request["max_queue"] {
                    Value::Null => DEFAULT_MAX_QUEUE,
                    value => value
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or("\"max_queue\" must be a positive integer")?,
                };
                let def = TopicDef {
                    name: name(&request)?,
                    endpoint: request["endpoint"]
                        .as_str()
                        .ok_or("the request needs \"endpoint\"")?
                        .to_owned(),
                    keys: Bytes::from(
                        request["keys"]
                            .as_str()
                            .ok_or("the request needs \"keys\" (a key pattern)")?
                            .to_owned(),
                    ),
                    events,
                    max_queue,
                };
                def.validate()?;
                mqstate_notify::endpoint::validate(&def.endpoint).map_err(|e| e.to_string())?;
                Ok(AdminRequest::Create(def))
            }
            Some("list") => Ok(AdminRequest::List),
            Some("get") => Ok(AdminRequest::Get(name(&request)?)),
            Some("stats") => Ok(AdminRequest::Stats(name(&request)?)),
            Some("rm") => Ok(AdminRequest::Remove(name(&request)?)),
            _ => Err("\"op\" must be create, list, get, stats or rm".into()),
        }
    }
}

/// A topic definition as JSON.
pub fn def_json(def: &TopicDef) -> Value {
    let events: Vec<&str> = Event::ALL
        .into_iter()
        .filter(|e| def.events & e.bit() != 0)
        .map(Event::as_str)
        .collect();
    json!({
        "name": def.name,
        "endpoint": def.endpoint,
        "keys": String::from_utf8_lossy(&def.keys),
        "events": events,
        "max_queue": def.max_queue,
    })
}

pub fn error_json(message: &str) -> Value {
    json!({ "error": message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn parse_never_panics(data in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = AdminRequest::parse(&data);
        }

        #[test]
        fn parse_never_panics_on_json_shaped_input(
            op in "(create|list|get|stats|rm|x)",
            name in ".{0,8}",
            events in prop::collection::vec("(set|delete|expire|put|)", 0..4),
            max in any::<i64>(),
        ) {
            let request = json!({"op": op, "name": name, "endpoint": "http://h:1/", "keys": name,
                                 "events": events, "max_queue": max});
            let _ = AdminRequest::parse(request.to_string().as_bytes());
        }
    }

    #[test]
    fn create_with_defaults_and_errors() {
        let request = br#"{"op":"create","name":"orders","endpoint":"http://127.0.0.1:9/h","keys":"order:*"}"#;
        let AdminRequest::Create(def) = AdminRequest::parse(request).unwrap() else {
            panic!("not a create");
        };
        assert_eq!((def.events, def.max_queue), (ALL_EVENTS, DEFAULT_MAX_QUEUE));
        assert_eq!(def_json(&def)["events"], json!(["set", "delete", "expire"]));
        for bad in [
            &br#"{"op":"create","name":"a/b","endpoint":"http://h/","keys":"*"}"#[..],
            br#"{"op":"create","name":"a","endpoint":"gopher://h/","keys":"*"}"#,
            br#"{"op":"create","name":"a","endpoint":"http://h/","keys":"*","events":["put"]}"#,
            br#"{"op":"create","name":"a","endpoint":"http://h/","keys":"*","max_queue":0}"#,
            br#"{"op":"stats"}"#,
            br#"{"op":"fly"}"#,
            b"not json",
        ] {
            assert!(
                AdminRequest::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            AdminRequest::parse(br#"{"op":"rm","name":"x"}"#).unwrap(),
            AdminRequest::Remove("x".into())
        );
    }
}
