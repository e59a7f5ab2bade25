//! `--mode idle`: open many MQTT connections that then do nothing, to measure what an idle
//! connection costs the broker. With `--server-pid` the broker's resident memory is read from
//! `/proc/<pid>/status` before and after, and the difference per connection is reported.
//!
//! Connections are raw sockets that send one CONNECT (encoded by rumqttc's codec) and read the
//! CONNACK: a full MQTT client per connection would measure the client, not the broker.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rumqttc::v5::mqttbytes::v5::{Connect, ConnectProperties};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinSet;

use super::BenchArgs;
use mqstate_cli::error::CliError;

/// Connections opened concurrently while ramping up; keeps the accept backlog from overflowing.
const RAMP_CONCURRENCY: usize = 256;
/// Keep Alive the idle clients announce: longer than any run, so the broker never times them out.
const IDLE_KEEP_ALIVE_S: u16 = 3600;
/// Connections per loopback source address: fewer than the ephemeral ports Linux has by default
/// (32768-60999) towards one server address.
const CONNECTIONS_PER_SOURCE_ADDRESS: usize = 25_000;
/// Settle time before the second memory reading, so the broker's last allocations are counted.
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize)]
pub struct IdleReport {
    pub mode: &'static str,
    pub connections: usize,
    pub connect_seconds: f64,
    pub held_seconds: f64,
    pub server_rss_before_kib: Option<u64>,
    pub server_rss_after_kib: Option<u64>,
    pub bytes_per_connection: Option<f64>,
}

impl IdleReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "idle connections   {}\nconnect time       {:.2} s\nheld               {:.1} s\n",
            self.connections, self.connect_seconds, self.held_seconds
        );
        if let (Some(before), Some(after), Some(per)) = (
            self.server_rss_before_kib,
            self.server_rss_after_kib,
            self.bytes_per_connection,
        ) {
            out.push_str(&format!(
                "server RSS         {before} KiB -> {after} KiB\nper connection     {:.0} bytes ({:.1} KiB)\n",
                per,
                per / 1024.0
            ));
        }
        out
    }
}

/// Resident set size of `pid` in KiB, from `/proc/<pid>/status`.
fn rss_kib(pid: u32) -> Result<u64, CliError> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|source| CliError::Input {
        what: format!("--server-pid {pid} ({path})"),
        source,
    })?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| CliError::usage("--server-pid", format!("no VmRSS line in {path}")))
}

fn connect_packet(client_id: String) -> Result<BytesMut, CliError> {
    let connect = Connect {
        keep_alive: IDLE_KEEP_ALIVE_S,
        client_id,
        clean_start: true,
        properties: Some(ConnectProperties::new()),
    };
    let mut buf = BytesMut::new();
    connect
        .write(&None, &None, &mut buf)
        .map_err(|e| CliError::usage("client id", e.to_string()))?;
    Ok(buf)
}

/// The local address connection `i` of `total` binds to: on loopback past what one source
/// address has ephemeral ports for, 127.0.0.2 and up take turns (`None`: the system chooses).
fn source_address(host: &str, total: usize, i: usize) -> Option<IpAddr> {
    let loopback = host == "localhost" || host.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback());
    if !loopback || total <= CONNECTIONS_PER_SOURCE_ADDRESS {
        return None;
    }
    let n = u8::try_from(2 + i / CONNECTIONS_PER_SOURCE_ADDRESS).unwrap_or(u8::MAX);
    Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n)))
}

/// Opens one connection (from `source`, if given) and waits for a successful CONNACK.
async fn open(
    addr: String,
    source: Option<IpAddr>,
    client_id: String,
) -> Result<TcpStream, CliError> {
    let connect_error = |reason: String| CliError::Connect {
        addr: addr.clone(),
        reason,
        fix: "is the broker running there (--host/--port)?".into(),
    };
    let connected = async {
        let Some(source) = source else {
            return TcpStream::connect(&addr).await;
        };
        let target = tokio::net::lookup_host(&addr)
            .await?
            .find(SocketAddr::is_ipv4)
            .ok_or_else(|| std::io::Error::other("no IPv4 address"))?;
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(source, 0))?;
        socket.connect(target).await
    };
    let mut stream = connected.await.map_err(|e| connect_error(e.to_string()))?;
    stream
        .write_all(&connect_packet(client_id)?)
        .await
        .map_err(|e| connect_error(e.to_string()))?;
    // CONNACK: 0x20, remaining length, flags, reason code, properties.
    let mut head = [0u8; 4];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| connect_error(format!("no CONNACK: {e}")))?;
    if head[0] != 0x20 || head[3] != 0 {
        return Err(connect_error(format!(
            "CONNACK refused (packet type {:#04x}, reason code {:#04x})",
            head[0], head[3]
        )));
    }
    Ok(stream)
}

pub async fn run(args: &BenchArgs, hold: Duration) -> Result<IdleReport, CliError> {
    let before = args.server_pid.map(rss_kib).transpose()?;
    let prefix = args.conn.client_id("mqstate-idle");
    let timeout = args.conn.timeout();
    let total = args.connections as usize;
    let started = Instant::now();
    let mut streams = Vec::with_capacity(total);
    let mut pending = JoinSet::new();
    let mut next = 0usize;
    while streams.len() < total {
        while next < total && pending.len() < RAMP_CONCURRENCY {
            let open = open(
                args.conn.addr(),
                source_address(&args.conn.host, total, next),
                format!("{prefix}-{next}"),
            );
            pending.spawn(async move {
                tokio::time::timeout(timeout, open)
                    .await
                    .unwrap_or_else(|_| {
                        Err(CliError::Timeout {
                            command: "CONNECT".into(),
                            timeout_s: timeout.as_secs(),
                        })
                    })
            });
            next += 1;
        }
        match pending.join_next().await {
            Some(Ok(result)) => streams.push(result?),
            Some(Err(e)) => return Err(CliError::usage("connection task", e.to_string())),
            None => break,
        }
    }
    let connect_seconds = started.elapsed().as_secs_f64();
    let held_from = Instant::now();
    tokio::select! {
        () = tokio::time::sleep(hold.max(SETTLE)) => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let after = args.server_pid.map(rss_kib).transpose()?;
    let bytes_per_connection = match (before, after) {
        (Some(b), Some(a)) if total > 0 => Some((a.saturating_sub(b) * 1024) as f64 / total as f64),
        _ => None,
    };
    let report = IdleReport {
        mode: "idle",
        connections: streams.len(),
        connect_seconds,
        held_seconds: held_from.elapsed().as_secs_f64(),
        server_rss_before_kib: before,
        server_rss_after_kib: after,
        bytes_per_connection,
    };
    drop(streams);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_connections_past_the_port_range_spread_over_source_addresses() {
        assert_eq!(source_address("127.0.0.1", 10_000, 9_999), None);
        assert_eq!(source_address("10.0.0.1", 100_000, 99_999), None);
        let first = source_address("127.0.0.1", 100_000, 0);
        let last = source_address("localhost", 100_000, 99_999);
        assert_eq!(first, Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))));
        assert_eq!(last, Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 5))));
    }

    #[test]
    fn connect_packet_is_an_mqtt5_connect() {
        let packet = connect_packet("idle-1".into()).unwrap();
        assert_eq!(packet[0], 0x10);
        // Protocol name "MQTT", level 5.
        assert_eq!(&packet[2..9], b"\x00\x04MQTT\x05");
    }

    #[test]
    fn rss_of_this_process_is_readable() {
        assert!(rss_kib(std::process::id()).unwrap() > 0);
    }
}
