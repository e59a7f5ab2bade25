//! `bench --responder`: answer every state-store request with `+OK` (`__stat` 200, correlation data
//! echoed) without storing anything — what MQTT request/response alone costs.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use tokio::task::JoinSet;

use super::BenchArgs;
use mqstate_cli::dial::{Connection, Dialer};
use mqstate_cli::error::CliError;
use mqstate_cli::rpc;
use mqstate_cli::wire;

pub async fn run(args: &BenchArgs) -> Result<(), CliError> {
    let prefix = args.conn.client_id("mqstate-responder");
    let dialer = Dialer::new(&args.conn)?;
    let mut connections = Vec::new();
    for i in 0..args.connections {
        let client_id = format!("{prefix}-{i}");
        let filter = Filter::new(args.responder_topic.as_str(), QoS::AtLeastOnce);
        // Replies in flight are limited by the server's Receive Maximum alone.
        let link = dialer.open(&client_id, vec![filter], u16::MAX).await?;
        connections.push((client_id, link));
    }
    // Scripts and tests wait for this line before sending requests.
    println!(
        "mqstate bench: responder ready on {} ({} connection(s))",
        args.responder_topic, args.connections
    );
    let _ = std::io::stdout().flush();

    let answered = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for (client_id, link) in connections {
        tasks.spawn(serve(client_id, link, Arc::clone(&answered)));
    }
    let duration = args.duration.map(std::time::Duration::from_secs_f64);
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = async {
            match duration {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        } => {}
        Some(ended) = tasks.join_next() => {
            if let Ok(Err(reason)) = ended {
                return Err(CliError::ConnectionLost { addr: args.conn.addr(), reason });
            }
        }
    }
    tasks.abort_all();
    println!(
        "mqstate bench: responder answered {} request(s)",
        answered.load(Ordering::Relaxed)
    );
    Ok(())
}

fn reply_to(
    request: &Publish,
    client_id: &str,
    clock: &mut mqstate_protocol::HybridClock,
) -> Option<(String, PublishProperties)> {
    let properties = request.properties.as_ref()?;
    // Without a response topic a request cannot be answered (spec §1).
    let topic = properties.response_topic.clone()?;
    let reply = PublishProperties {
        correlation_data: properties.correlation_data.clone(),
        user_properties: vec![
            (rpc::STATUS.to_owned(), rpc::STATUS_OK.to_owned()),
            (
                rpc::PROTOCOL_VERSION.to_owned(),
                rpc::PROTOCOL_VERSION_VALUE.to_owned(),
            ),
            (rpc::SOURCE_ID.to_owned(), client_id.to_owned()),
            (
                rpc::TIMESTAMP.to_owned(),
                clock.now(rpc::now_ms()).to_string(),
            ),
        ],
        content_type: Some(rpc::CONTENT_TYPE.to_owned()),
        ..PublishProperties::default()
    };
    Some((topic, reply))
}

/// One connection's task. A request is acknowledged only once its reply is queued, so a full reply
/// window holds requests back in the server rather than here; replies and PUBACKs of a turn leave in
/// one write.
async fn serve(
    client_id: String,
    mut link: Connection,
    answered: Arc<AtomicU64>,
) -> Result<(), String> {
    const OK: &[u8] = b"+OK\r\n";
    let mut clock = rpc::client_clock(&client_id);
    let mut waiting = VecDeque::new();
    loop {
        while let Some(request) = link.next()? {
            waiting.push_back(request);
        }
        while link.window_open() {
            let Some(request) = waiting.pop_front() else {
                break;
            };
            link.acknowledge(&request)?;
            if let Some((topic, properties)) = reply_to(&request, &client_id, &mut clock) {
                let mut reply = wire::publish(
                    &Bytes::from(topic),
                    QoS::AtLeastOnce,
                    Bytes::from_static(OK),
                    Some(properties),
                );
                link.publish(&mut reply)?;
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }
        link.flush().await?;
        link.read().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_echo_correlation_and_carry_status_200() {
        let mut clock = rpc::client_clock("r");
        let request = Publish {
            properties: Some(PublishProperties {
                response_topic: Some("clients/c/resp".into()),
                correlation_data: Some(Bytes::from_static(b"0123456789abcdef")),
                ..PublishProperties::default()
            }),
            ..Publish::new(
                mqstate_protocol::topic::INVOKE_TOPIC,
                QoS::AtLeastOnce,
                "",
                None,
            )
        };
        let (topic, props) = reply_to(&request, "r", &mut clock).unwrap();
        assert_eq!(topic, "clients/c/resp");
        assert_eq!(
            props.correlation_data.as_deref(),
            Some(&b"0123456789abcdef"[..])
        );
        assert_eq!(rpc::user_property(Some(&props), rpc::STATUS), Some("200"));
        let no_topic = Publish::new("t", QoS::AtLeastOnce, "", None);
        assert!(reply_to(&no_topic, "r", &mut clock).is_none());
    }
}
