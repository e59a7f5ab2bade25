//! `mqstate watch KEY…`: KEYNOTIFY every key and print each change until interrupted (or `--count`).
//!
//! When the connection is lost (the broker restarts), it reconnects and registers again, backing off
//! up to [`MAX_RECONNECT_DELAY`]; registrations end with a connection (spec §6), so changes made while
//! disconnected are not shown, and a line on stderr says so. A broker that refuses the connection
//! (credentials, authorization) ends the watch: retrying would not help.

use std::collections::HashMap;
use std::io::Write;
use std::pin::pin;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::topic::notify_topic;
use mqstate_protocol::{parse_request, Reply, RequestLimits};
use rumqttc::v5::mqttbytes::v5::Publish;
use serde_json::json;

use super::connection::ConnectionArgs;
use super::error::CliError;
use super::output::{finish, Outcome};
use super::rpc::{self, RawClient};
use super::value::{self, OutputArgs};

/// First wait before reconnecting; doubled after each failed attempt.
pub const FIRST_RECONNECT_DELAY: Duration = Duration::from_millis(200);
/// Longest wait between reconnection attempts.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);

#[derive(clap::Args)]
pub struct WatchArgs {
    #[arg(required = true)]
    pub keys: Vec<String>,
    /// Stop after this many notifications (default: run until Ctrl-C).
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    #[command(flatten)]
    pub conn: ConnectionArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub async fn run(args: &WatchArgs) -> ExitCode {
    finish(args.output, watch(args).await)
}

/// A change of a watched key.
#[derive(Debug, PartialEq, Eq)]
enum Change {
    Set(Bytes),
    Delete,
}

/// A connection with every key registered, and the notification topic of each key.
struct Registered {
    client: RawClient,
    keys_by_topic: HashMap<String, String>,
}

async fn register(conn: &ConnectionArgs, keys: &[String]) -> Result<Registered, CliError> {
    let mut client = RawClient::connect(conn).await?;
    let mut keys_by_topic = HashMap::new();
    for key in keys {
        let request = [
            Bytes::from_static(b"KEYNOTIFY"),
            Bytes::from(key.clone().into_bytes()),
        ];
        let registered = match client.request(&request, None).await {
            Ok(response) => rpc::parse_reply("KEYNOTIFY", &response.payload),
            Err(e) => Err(e),
        };
        match registered {
            Ok(Reply::Ok) => {}
            Ok(other) => {
                client.close().await;
                return Err(CliError::Protocol {
                    command: "KEYNOTIFY".into(),
                    detail: format!("unexpected reply {other:?}"),
                });
            }
            Err(e) => {
                client.close().await;
                return Err(e);
            }
        }
        keys_by_topic.insert(
            notify_topic(client.client_id().as_bytes(), key.as_bytes()),
            key.clone(),
        );
    }
    Ok(Registered {
        client,
        keys_by_topic,
    })
}

async fn watch(args: &WatchArgs) -> Result<Outcome, CliError> {
    let mut current = Some(register(&args.conn, &args.keys).await?);
    // Tells scripts (and tests) that every registration is in place.
    eprintln!("mqstate: watching {} key(s)", args.keys.len());
    let mut interrupted = pin!(tokio::signal::ctrl_c());
    let mut seen = 0u64;
    let mut delay = FIRST_RECONNECT_DELAY;
    while args.count.is_none_or(|limit| seen < limit) {
        let Some(watching) = current.as_mut() else {
            // Disconnected: wait, then try again.
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = &mut interrupted => break,
            }
            match register(&args.conn, &args.keys).await {
                Ok(registered) => {
                    eprintln!(
                        "mqstate: reconnected, watching {} key(s) again (changes made while disconnected are not shown)",
                        args.keys.len()
                    );
                    current = Some(registered);
                    delay = FIRST_RECONNECT_DELAY;
                }
                Err(e) if retryable(&e) => delay = (delay * 2).min(MAX_RECONNECT_DELAY),
                Err(e) => return Err(e),
            }
            continue;
        };
        tokio::select! {
            next = watching.client.notification() => match next {
                Ok(publish) => {
                    if let Some((key, change, version)) = decode(&watching.keys_by_topic, &publish) {
                        seen += 1;
                        print(args.output, key, &change, &version).map_err(|source| CliError::Input {
                            what: "stdout (closed?)".into(),
                            source,
                        })?;
                    }
                }
                Err(e) => {
                    eprintln!("mqstate: {e}; reconnecting");
                    current = None;
                }
            },
            _ = &mut interrupted => break,
        }
    }
    if let Some(watching) = current {
        // The registrations end with the connection (and its session: expiry 0).
        watching.client.close().await;
    }
    Ok(Outcome::new(
        super::error::EXIT_OK,
        json!({ "notifications": seen }),
    ))
}

/// Whether reconnecting may help: the broker is down or restarting, not refusing us.
fn retryable(e: &CliError) -> bool {
    matches!(
        e,
        CliError::Connect { .. } | CliError::ConnectionLost { .. } | CliError::Timeout { .. }
    )
}

/// The watched key, change and version (`__ts`) of a notification; `None` for anything else.
fn decode<'a>(
    keys_by_topic: &'a HashMap<String, String>,
    publish: &Publish,
) -> Option<(&'a str, Change, String)> {
    let topic = std::str::from_utf8(&publish.topic).ok()?;
    let key = keys_by_topic.get(topic)?;
    let version = rpc::user_property(publish.properties.as_ref(), rpc::TIMESTAMP)?.to_owned();
    let args = parse_request(&publish.payload, &RequestLimits::default()).ok()?;
    let change = match args.as_slice() {
        [notify, set, value_word, data]
            if &notify[..] == b"NOTIFY" && &set[..] == b"SET" && &value_word[..] == b"VALUE" =>
        {
            Change::Set(data.clone())
        }
        [notify, delete] if &notify[..] == b"NOTIFY" && &delete[..] == b"DELETE" => Change::Delete,
        _ => return None,
    };
    Some((key, change, version))
}

/// One line per change: tab-separated `SET key value version` or `DELETE key version` (fields escaped,
/// so tabs inside them cannot be confused with separators), or one JSON object per line.
fn print(output: OutputArgs, key: &str, change: &Change, version: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if output.json {
        let mut doc = serde_json::Map::new();
        value::put_bytes(&mut doc, "key", key.as_bytes());
        match change {
            Change::Set(data) => {
                doc.insert("operation".into(), "SET".into());
                value::put_bytes(&mut doc, "value", data);
            }
            Change::Delete => {
                doc.insert("operation".into(), "DELETE".into());
            }
        }
        doc.insert("version".into(), version.into());
        writeln!(out, "{}", serde_json::Value::Object(doc))?;
    } else {
        let key = value::escape(key.as_bytes());
        match change {
            Change::Set(data) => writeln!(out, "SET\t{key}\t{}\t{version}", value::escape(data))?,
            Change::Delete => writeln!(out, "DELETE\t{key}\t{version}")?,
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::v5::mqttbytes::v5::PublishProperties;
    use rumqttc::v5::mqttbytes::QoS;

    fn notification(topic: &str, payload: &'static [u8], ts: Option<&str>) -> Publish {
        let properties = PublishProperties {
            user_properties: ts
                .map(|t| vec![(rpc::TIMESTAMP.to_owned(), t.to_owned())])
                .unwrap_or_default(),
            ..PublishProperties::default()
        };
        Publish::new(topic, QoS::AtLeastOnce, payload, Some(properties))
    }

    #[test]
    fn notifications_decode_to_key_change_and_version() {
        let topic = notify_topic(b"me", b"k");
        let keys: HashMap<String, String> = [(topic.clone(), "k".to_owned())].into();
        let set = notification(
            &topic,
            b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$2\r\nv1\r\n",
            Some("1:0:n"),
        );
        assert_eq!(
            decode(&keys, &set),
            Some(("k", Change::Set(Bytes::from_static(b"v1")), "1:0:n".into()))
        );
        let del = notification(
            &topic,
            b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n",
            Some("2:0:n"),
        );
        assert_eq!(
            decode(&keys, &del),
            Some(("k", Change::Delete, "2:0:n".into()))
        );
        // Without a version, on another topic, or malformed: not a notification we show.
        let no_ts = notification(&topic, b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n", None);
        assert_eq!(decode(&keys, &no_ts), None);
        let other = notification("x/y", b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n", Some("1"));
        assert_eq!(decode(&keys, &other), None);
        let garbage = notification(&topic, b"+OK\r\n", Some("1"));
        assert_eq!(decode(&keys, &garbage), None);
    }

    #[test]
    fn refusals_end_the_watch_outages_do_not() {
        let down = CliError::Connect {
            addr: "a".into(),
            reason: "refused".into(),
            fix: String::new(),
        };
        assert!(retryable(&down));
        let refused = CliError::Refused {
            addr: "a".into(),
            reason: "wrong user name or password".into(),
            fix: String::new(),
        };
        assert!(!retryable(&refused));
    }
}
