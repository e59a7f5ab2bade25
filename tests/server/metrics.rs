//! `--metrics-listen`: health and readiness answer, and `/metrics` counters move with real MQTT and
//! state-store traffic.

use crate::common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{free_addr, http_get, Server};
use rumqttc::{Client, Event, MqttOptions, Packet, QoS};

/// The value of one series (`name` or `name{labels}`, labels as rendered), if present.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        Some(value.trim().parse().expect("numeric sample"))
    })
}

fn scrape(addr: SocketAddr) -> String {
    let (status, body) = http_get(addr, "/metrics");
    assert_eq!(status, 200, "{body}");
    body
}

fn cli(server: &Server, args: &[&str]) -> std::process::Output {
    let (subcommand, rest) = args.split_first().expect("a subcommand");
    Command::new(env!("CARGO_BIN_EXE_mqstate"))
        .arg(subcommand)
        .args(["--host", "127.0.0.1", "--port", &server.port().to_string()])
        .args(rest)
        .env_remove("AIO_BROKER_HOSTNAME")
        .env_remove("AIO_BROKER_TCP_PORT")
        .env_remove("AIO_MQTT_USE_TLS")
        .env_remove("AIO_MQTT_CLIENT_ID")
        .output()
        .expect("run mqstate")
}

/// Subscribes to `metrics/test` at QoS 1, publishes `count` messages at `qos` and waits for them.
fn pub_sub(server: &Server, qos: QoS, count: usize) {
    let mut options = MqttOptions::new("metrics-test", "127.0.0.1", server.port());
    options.set_keep_alive(Duration::from_secs(30));
    let (client, mut connection) = Client::new(options, 64);
    client
        .subscribe("metrics/test", QoS::AtLeastOnce)
        .expect("subscribe");
    let mut received = 0;
    let mut published = false;
    for event in connection.iter() {
        match event.expect("MQTT connection") {
            Event::Incoming(Packet::SubAck(_)) if !published => {
                for i in 0..count {
                    client
                        .publish("metrics/test", qos, false, format!("m{i}"))
                        .expect("publish");
                }
                published = true;
            }
            Event::Incoming(Packet::Publish(_)) => {
                received += 1;
                if received == count {
                    break;
                }
            }
            _ => {}
        }
    }
    client.disconnect().expect("disconnect");
}

#[test]
fn health_and_ready_answer_and_unknown_paths_are_404() {
    let metrics = free_addr();
    let _server = Server::start_with(&["--metrics-listen", &metrics.to_string()]);
    assert_eq!(http_get(metrics, "/health"), (200, "ok\n".to_owned()));
    assert_eq!(http_get(metrics, "/ready"), (200, "ready\n".to_owned()));
    assert_eq!(http_get(metrics, "/nothing-here").0, 404);
}

#[test]
fn counters_move_with_mqtt_and_state_store_traffic() {
    let metrics = free_addr();
    let server = Server::start_with(&["--metrics-listen", &metrics.to_string()]);
    let before = scrape(metrics);
    let value = |text: &str, series: &str| sample(text, series).unwrap_or(0.0);
    assert_eq!(value(&before, "mqstate_statestore_keys"), 0.0);

    pub_sub(&server, QoS::AtLeastOnce, 5);
    pub_sub(&server, QoS::AtMostOnce, 3);
    for (args, exit_code) in [
        (&["set", "alpha", "one"][..], 0),
        (&["set", "beta", "two"], 0),
        (&["get", "alpha"], 0),
        (&["get", "missing"], 1),
        (&["del", "beta"], 0),
    ] {
        let output = cli(&server, args);
        assert_eq!(
            output.status.code(),
            Some(exit_code),
            "{args:?}: {output:?}"
        );
    }

    let after = scrape(metrics);
    let moved = |series: &str| value(&after, series) - value(&before, series);
    // Five publishes and five state-store requests (the CLI sends them at QoS 1).
    assert_eq!(moved(r#"mqstate_messages_received_total{qos="1"}"#), 10.0);
    assert!(
        moved(r#"mqstate_messages_received_total{qos="0"}"#) >= 3.0,
        "{after}"
    );
    // Subscribed at QoS 1: QoS 1 publishes go out at 1, QoS 0 ones at 0 (plus the CLI's replies).
    assert!(
        moved(r#"mqstate_messages_sent_total{qos="1"}"#) >= 5.0,
        "{after}"
    );
    assert!(
        moved(r#"mqstate_messages_sent_total{qos="0"}"#) >= 3.0,
        "{after}"
    );
    assert!(
        moved("mqstate_connections_accepted_total") >= 7.0,
        "{after}"
    );
    assert_eq!(
        moved(r#"mqstate_statestore_requests_total{command="set",result="ok"}"#),
        2.0
    );
    // A miss is a normal reply, not an error.
    assert_eq!(
        moved(r#"mqstate_statestore_requests_total{command="get",result="ok"}"#),
        2.0
    );
    assert_eq!(
        moved(r#"mqstate_statestore_requests_total{command="del",result="ok"}"#),
        1.0
    );
    assert_eq!(
        moved(r#"mqstate_statestore_request_duration_seconds_count{command="set"}"#),
        2.0
    );
    assert_eq!(value(&after, "mqstate_statestore_keys"), 1.0);
    assert_eq!(
        value(&after, "mqstate_statestore_bytes"),
        ("alpha".len() + "one".len()) as f64
    );
    // Three writes, each logged and made durable before its reply.
    assert_eq!(moved(r#"mqstate_wal_records_total{log="statestore"}"#), 3.0);
    assert!(
        moved(r#"mqstate_wal_bytes_written_total{log="statestore"}"#) > 0.0,
        "{after}"
    );
    assert!(
        moved(r#"mqstate_wal_fsync_duration_seconds_count{log="statestore"}"#) >= 1.0,
        "{after}"
    );
    assert_eq!(
        moved(r#"mqstate_wal_batch_records_sum{log="statestore"}"#),
        3.0
    );
    // The last CLI client has exited, but the server may not have seen its socket close yet.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut connected = value(&after, "mqstate_clients_connected");
    while connected != 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        connected = value(&scrape(metrics), "mqstate_clients_connected");
    }
    assert_eq!(connected, 0.0, "clients still counted as connected");
    assert!(after.contains("# HELP mqstate_statestore_requests_total"));
}

#[test]
fn snapshots_are_counted_and_timed() {
    let metrics = free_addr();
    let server = Server::start_with(&[
        "--metrics-listen",
        &metrics.to_string(),
        "--snapshot-threshold-bytes",
        "1",
    ]);
    let output = cli(&server, &["set", "snap", "shot"]);
    assert!(output.status.success(), "{output:?}");
    // The snapshot is written in the background after the reply.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = scrape(metrics);
        if sample(&text, r#"mqstate_snapshots_total{result="ok"}"#).is_some()
            || std::time::Instant::now() > deadline
        {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        sample(&text, r#"mqstate_snapshots_total{result="ok"}"#),
        Some(1.0),
        "{text}"
    );
    for phase in ["encode", "write"] {
        let series = format!(r#"mqstate_snapshot_duration_seconds_count{{phase="{phase}"}}"#);
        assert_eq!(sample(&text, &series), Some(1.0), "{series}: {text}");
    }
}

#[test]
fn text_logs_carry_no_colour_codes_off_a_terminal() {
    let (stderr, status) = common::serve_stderr(
        &["--listen", "127.0.0.1:0", "--log-format", "text"],
        &[("MQSTATE_LOG", "info")],
        "mqstate ready",
    );
    assert!(status.is_none(), "exited: {status:?} {stderr}");
    assert!(stderr.contains("mqstate ready"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "ANSI escape in {stderr:?}");
}
