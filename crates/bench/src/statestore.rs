//! State-store load: one task per connection keeps `--inflight` requests outstanding, matches replies
//! to them by correlation data, recording latency and reply kind, and sends the PUBACKs it owes together
//! with the next requests (one write per turn, [`wire`](super::wire)).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mqstate_protocol::topic::{INVOKE_TOPIC, NOTIFY_TOPIC_PREFIX};
use mqstate_protocol::{encode_request, Hlc, HybridClock};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rumqttc::v5::mqttbytes::v5::{Filter, Publish};
use rumqttc::v5::mqttbytes::QoS;
use tokio::task::JoinSet;

use super::heads::{Heads, MAX_PICKS};
use super::stats::{classify, Outcome};
use super::workload::{key_name, value_of_size, KeyChooser, Mix, Op};
use super::{BenchArgs, Shared};
use mqstate_cli::connection::ConnectionArgs;
use mqstate_cli::dial::{Connection, Dialer};
use mqstate_cli::error::CliError;
use mqstate_cli::rpc;
use mqstate_cli::wire::{self, Turn};

/// One connection, connected and subscribed.
struct Opened {
    client_id: String,
    response_topic: String,
    notify_prefix: String,
    filters: Vec<Filter>,
    /// Index in `Prepared::dialers` of the server it is connected to.
    server: usize,
    link: Connection,
}

pub struct Prepared {
    connections: Vec<Opened>,
    /// One per server (`--servers`), or the one of `--host`/`--port`.
    dialers: Arc<Vec<Dialer>>,
    /// Whether a connection that dies reconnects (`--servers` given).
    reconnect: bool,
    window: u16,
    mix: Mix,
    chooser: Arc<KeyChooser>,
    /// `--keys-at-head`: the partitions each server heads.
    heads: Option<Arc<Heads>>,
    value_size: usize,
    inflight: usize,
    timeout: Duration,
}

/// Opens every connection (before the clock starts, so connecting is not measured).
pub async fn prepare(args: &BenchArgs) -> Result<super::Prepared, CliError> {
    let chooser =
        KeyChooser::new(args.distribution, args.keys).map_err(|e| CliError::usage("--keys", e))?;
    let inflight = usize::from(args.inflight);
    let prefix = args.conn.client_id("mqstate-bench");
    let dialers = Arc::new(dialers(args)?);
    let heads = match args.keys_at_head {
        true => Some(Arc::new(Heads::learn(&server_conns(args)?).await?)),
        false => None,
    };
    let mut opening = JoinSet::new();
    for i in 0..args.connections {
        let client_id = format!("{prefix}-{i}");
        let response_topic = rpc::response_topic(&client_id);
        let notify_prefix = format!(
            "{NOTIFY_TOPIC_PREFIX}/{}/command/notify/",
            hex_upper(client_id.as_bytes())
        );
        let mut filters = vec![Filter::new(response_topic.as_str(), QoS::AtLeastOnce)];
        if args.mix.contains(Op::KeyNotify) {
            filters.push(Filter::new(format!("{notify_prefix}+"), QoS::AtLeastOnce));
        }
        let dialers = Arc::clone(&dialers);
        let server = i as usize % dialers.len();
        let window = args.inflight;
        opening.spawn(async move {
            let link = dialers[server]
                .open(&client_id, filters.clone(), window)
                .await?;
            Ok::<_, CliError>(Opened {
                client_id,
                response_topic,
                notify_prefix,
                filters,
                server,
                link,
            })
        });
    }
    let mut connections = Vec::with_capacity(args.connections as usize);
    while let Some(joined) = opening.join_next().await {
        connections.push(joined.map_err(|e| CliError::usage("bench", e.to_string()))??);
    }
    Ok(super::Prepared::Statestore(Prepared {
        connections,
        dialers,
        reconnect: !args.servers.is_empty(),
        window: args.inflight,
        mix: args.mix.clone(),
        chooser: Arc::new(chooser),
        heads,
        value_size: args.value_size,
        inflight,
        timeout: args.conn.timeout(),
    }))
}

/// A dialer per `--servers` entry, or the one of `--host`/`--port`.
pub(crate) fn dialers(args: &BenchArgs) -> Result<Vec<Dialer>, CliError> {
    server_conns(args)?.iter().map(Dialer::new).collect()
}

/// The connection flags of each `--servers` entry, or those of `--host`/`--port`.
fn server_conns(args: &BenchArgs) -> Result<Vec<ConnectionArgs>, CliError> {
    if args.servers.is_empty() {
        return Ok(vec![args.conn.clone()]);
    }
    args.servers
        .iter()
        .map(|server| {
            let (host, port) = server
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                .filter(|(host, _)| !host.is_empty())
                .ok_or_else(|| {
                    CliError::usage("--servers", format!("{server:?} is not HOST:PORT"))
                })?;
            let mut conn = args.conn.clone();
            conn.host = host.to_owned();
            conn.port = port;
            Ok(conn)
        })
        .collect()
}

/// Pause after every server refused a reconnect.
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// Requests sent and not yet answered: correlation sequence → (send time, operation).
type Pending = HashMap<u64, (Instant, Op)>;

impl Prepared {
    pub async fn run(self, shared: Arc<Shared>) -> Result<(), CliError> {
        let mut workers = JoinSet::new();
        for (i, opened) in self.connections.into_iter().enumerate() {
            let worker = Worker {
                shared: Arc::clone(&shared),
                dialers: Arc::clone(&self.dialers),
                reconnect: self.reconnect,
                window: self.window,
                filters: opened.filters,
                server: opened.server,
                mix: self.mix.clone(),
                chooser: Arc::clone(&self.chooser),
                heads: self.heads.clone(),
                value_size: self.value_size,
                inflight: self.inflight,
                timeout: self.timeout,
                seed: i as u64,
                client_id: opened.client_id,
                response_topic: opened.response_topic,
                notify_prefix: opened.notify_prefix,
            };
            workers.spawn(worker.run(opened.link));
        }
        while workers.join_next().await.is_some() {}
        Ok(())
    }
}

/// The task that owns one connection (and its successors, after a reconnect).
struct Worker {
    shared: Arc<Shared>,
    dialers: Arc<Vec<Dialer>>,
    reconnect: bool,
    window: u16,
    filters: Vec<Filter>,
    server: usize,
    mix: Mix,
    chooser: Arc<KeyChooser>,
    heads: Option<Arc<Heads>>,
    value_size: usize,
    inflight: usize,
    timeout: Duration,
    seed: u64,
    client_id: String,
    response_topic: String,
    notify_prefix: String,
}

/// What a client keeps across its connections: correlation data must never repeat under one client
/// id (the store would answer a reused one with its first reply), and its unavailability is measured
/// from its last successful reply, whichever connection brought it.
struct Client {
    seq: u64,
    rng: StdRng,
    clock: HybridClock,
    last_ok: Option<Instant>,
}

impl Worker {
    async fn run(mut self, link: Connection) {
        let mut client = Client {
            seq: 0,
            rng: StdRng::seed_from_u64(self.seed ^ rand::random::<u64>()),
            clock: rpc::client_clock(&self.client_id),
            last_ok: None,
        };
        let mut link = Some(link);
        let mut pending = Pending::new();
        while let Some(mut current) = link.take() {
            let driven = self.drive(&mut current, &mut pending, &mut client).await;
            match driven {
                Ok(()) => {
                    // Unanswered when the run's wait for replies ran out.
                    self.lose(&mut pending, true);
                    let _ = tokio::time::timeout(self.timeout, current.disconnect()).await;
                }
                Err(reason) => {
                    self.shared
                        .recorder
                        .count(&format!("connection: {reason}"), true, 1);
                    self.lose(&mut pending, false);
                    if self.reconnect {
                        drop(current);
                        link = self.reopen().await;
                    }
                }
            }
        }
    }

    /// Counts the outstanding requests as lost: timed out, or gone with their connection.
    fn lose(&self, pending: &mut Pending, timed_out: bool) {
        if pending.is_empty() {
            return;
        }
        let n = pending.len() as u64;
        let label = if timed_out {
            "timeout"
        } else {
            "lost with the connection"
        };
        self.shared.recorder.count(label, true, n);
        self.shared.timeline.lost(Instant::now(), n, timed_out);
        pending.clear();
    }

    /// Connects to the next server, and the next, until one accepts or the run is over.
    async fn reopen(&mut self) -> Option<Connection> {
        let mut failures = 0usize;
        while !self.shared.is_stopped() {
            self.server = (self.server + 1) % self.dialers.len();
            match self.dialers[self.server]
                .open(&self.client_id, self.filters.clone(), self.window)
                .await
            {
                Ok(link) => return Some(link),
                Err(_) => {
                    failures += 1;
                    self.shared.recorder.count("reconnect refused", true, 1);
                    // A full round refused: pause before the next, as an SDK's backoff would.
                    if failures.is_multiple_of(self.dialers.len()) {
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                    }
                }
            }
        }
        None
    }

    /// Turns until the run is over and the outstanding replies are in (or one reply timeout passed):
    /// take in what arrived, top the window up, send it all in one write, wait for more.
    async fn drive(
        &self,
        link: &mut Connection,
        pending: &mut Pending,
        client: &mut Client,
    ) -> Result<(), String> {
        let value: Bytes = value_of_size(self.value_size, &mut client.rng);
        // One PUBLISH for every request: only payload, correlation data and timestamp change.
        let properties = rpc::request_properties(
            &self.client_id,
            &self.response_topic,
            Bytes::new(),
            &client.clock.now(rpc::now_ms()),
            None,
            self.timeout,
        );
        let invoke = Bytes::from_static(INVOKE_TOPIC.as_bytes());
        let mut request = wire::publish(&invoke, QoS::AtLeastOnce, Bytes::new(), Some(properties));
        // Set once the run is over: the last moment to wait for outstanding replies.
        let mut deadline: Option<Instant> = None;
        loop {
            while let Some(publish) = link.next()? {
                link.acknowledge(&publish)?;
                if publish.topic.as_ref() == self.response_topic.as_bytes() {
                    self.on_reply(pending, &publish, client);
                } else if publish.topic.starts_with(self.notify_prefix.as_bytes()) {
                    self.shared.recorder.count("notification", false, 1);
                }
            }
            while deadline.is_none() && pending.len() < self.inflight && link.window_open() {
                if !self.shared.take_ticket() {
                    deadline = Some(Instant::now() + self.timeout);
                    break;
                }
                let op = self.mix.pick(&mut client.rng);
                let key = self.pick_key(&mut client.rng);
                client.seq += 1;
                request.payload = encode_request(&op.request(&key, &value));
                restamp(
                    &mut request,
                    rpc::correlation(client.seq),
                    &client.clock.now(rpc::now_ms()),
                );
                link.publish(&mut request)?;
                pending.insert(client.seq, (Instant::now(), op));
            }
            link.flush().await?;
            if let Some(deadline) = deadline {
                if pending.is_empty() || Instant::now() >= deadline {
                    return Ok(());
                }
            }
            let turn = link.read().await?;
            if turn == Turn::Tick {
                if deadline.is_none() && self.shared.is_stopped() {
                    deadline = Some(Instant::now() + self.timeout);
                }
                self.expire(pending);
            }
        }
    }

    /// The next request's key: with `--keys-at-head`, one the connected server heads.
    fn pick_key(&self, rng: &mut StdRng) -> Bytes {
        let mut key = key_name(self.chooser.pick(rng));
        if let Some(heads) = &self.heads {
            for _ in 1..MAX_PICKS {
                if heads.heads(self.server, &key) {
                    break;
                }
                key = key_name(self.chooser.pick(rng));
            }
        }
        key
    }

    /// Gives up on requests unanswered for a whole reply timeout (their message expiry has passed:
    /// the server will not answer them either), freeing their place in the window.
    fn expire(&self, pending: &mut Pending) {
        let now = Instant::now();
        let before = pending.len();
        pending.retain(|_, (sent, _)| now.saturating_duration_since(*sent) < self.timeout);
        let expired = (before - pending.len()) as u64;
        if expired > 0 {
            self.shared.recorder.count("timeout", true, expired);
            self.shared.timeline.lost(now, expired, true);
        }
    }

    fn on_reply(&self, pending: &mut Pending, publish: &Publish, client: &mut Client) {
        let now = Instant::now();
        let properties = publish.properties.as_ref();
        let Some(seq) = properties
            .and_then(|p| p.correlation_data.as_deref())
            .and_then(rpc::correlation_seq)
        else {
            self.shared
                .recorder
                .count("reply without our correlation data", true, 1);
            return;
        };
        let Some((sent, _op)) = pending.remove(&seq) else {
            // A duplicate (a retried PUBLISH answered twice) or a reply after its timeout.
            self.shared
                .recorder
                .count("duplicate or late reply", true, 1);
            return;
        };
        let outcome: Outcome = classify(
            rpc::user_property(properties, rpc::STATUS),
            &publish.payload,
        );
        self.shared
            .timeline
            .reply(now, now - sent, outcome.is_error);
        if !outcome.is_error {
            if let Some(last) = client.last_ok.replace(now) {
                self.shared.timeline.client_gap(last, now);
            }
        }
        if self.shared.measuring(sent) {
            self.shared.recorder.record(now - sent, &outcome);
            self.shared.completed_at(now);
        }
    }
}

/// Gives a request from [`rpc::request_properties`] new correlation data and a new `__ts`, reusing
/// the rest: allocating every property afresh per request would be CPU taken from the server.
fn restamp(request: &mut Publish, correlation: Bytes, ts: &Hlc) {
    let Some(properties) = request.properties.as_mut() else {
        return;
    };
    properties.correlation_data = Some(correlation);
    if let Some((_, value)) = properties
        .user_properties
        .iter_mut()
        .find(|(name, _)| name == rpc::TIMESTAMP)
    {
        value.clear();
        // Writing into a String cannot fail.
        let _ = write!(value, "{ts}");
    }
}

/// Upper-case base16, as notification topics spell client ids (spec §6).
fn hex_upper(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restamping_changes_only_correlation_and_timestamp() {
        let mut clock = rpc::client_clock("c");
        let (first, second) = (clock.now(1), clock.now(2));
        let properties = rpc::request_properties(
            "c",
            "clients/c/resp",
            rpc::correlation(1),
            &first,
            None,
            std::time::Duration::from_secs(5),
        );
        let topic = Bytes::from_static(INVOKE_TOPIC.as_bytes());
        let mut request = wire::publish(&topic, QoS::AtLeastOnce, Bytes::new(), Some(properties));
        restamp(&mut request, rpc::correlation(2), &second);
        let expected = rpc::request_properties(
            "c",
            "clients/c/resp",
            rpc::correlation(2),
            &second,
            None,
            std::time::Duration::from_secs(5),
        );
        assert_eq!(request.properties, Some(expected));
    }

    #[test]
    fn notification_topics_use_upper_case_hex() {
        assert_eq!(hex_upper(b"client-id1"), "636C69656E742D696431");
        let topic = mqstate_protocol::topic::notify_topic(b"client-id1", b"SOMEKEY");
        assert!(topic.starts_with(&format!(
            "{NOTIFY_TOPIC_PREFIX}/{}/command/notify/",
            hex_upper(b"client-id1")
        )));
    }
}
