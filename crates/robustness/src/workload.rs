//! The clients of a run: register writers, lock holders writing fenced keys, and observers with
//! persistent sessions. Every request is recorded with its invocation and result.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use mqstate_protocol::{NotifyPayload, Reply as RespReply};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::{sleep, Instant};

use crate::client::{Client, Options};
use crate::history::{
    now_us, Change, Cmd, Condition, History, Incarnation, Notified, Op, Outcome, Registration,
    Version,
};

pub const REGISTER_KEYS: usize = 6;
pub const LOCKS: usize = 2;
const WRITERS: usize = 6;
const LOCK_CLIENTS: usize = 3;
const OBSERVERS: usize = 2;
/// Longer than a pause may last is not required: a timed-out request is simply unknown.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The lock lease (`PX`); pauses are longer than it.
pub const LEASE_MS: u64 = 1500;
const SESSION_EXPIRY_SECS: u32 = 3600;

/// Every key a run touches.
pub fn all_keys() -> Vec<String> {
    let mut keys: Vec<String> = (0..REGISTER_KEYS).map(|i| format!("reg/{i}")).collect();
    for i in 0..LOCKS {
        keys.push(format!("lock/{i}"));
        keys.push(format!("fenced/{i}"));
    }
    keys
}

/// What the clients, the fault injector and the driver share.
pub struct Shared {
    /// Every node's MQTT address (one on a single node); clients spread over them.
    pub addrs: Vec<SocketAddr>,
    pub stop_writers: AtomicBool,
    pub stop_observers: AtomicBool,
    /// The server process requests go to now (bumped the moment one ends, before the next starts).
    pub incarnation: AtomicU32,
    /// Client clock skew in milliseconds, added to every `__ts` (a fault).
    pub skew_ms: AtomicI64,
    pub history: Mutex<History>,
}

impl Shared {
    pub fn new(addrs: Vec<SocketAddr>) -> Arc<Shared> {
        let history = History {
            cluster: addrs.len() > 1,
            incarnations: vec![Incarnation {
                started_us: now_us(),
                ended_us: None,
            }],
            ..History::default()
        };
        Arc::new(Shared {
            addrs,
            stop_writers: AtomicBool::new(false),
            stop_observers: AtomicBool::new(false),
            incarnation: AtomicU32::new(0),
            skew_ms: AtomicI64::new(0),
            history: Mutex::new(history),
        })
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current process is gone (killed or crashed); the next gets a new number.
    pub fn end_incarnation(&self) {
        let mut history = self.history();
        let now = now_us();
        if let Some(last) = history.incarnations.last_mut() {
            last.ended_us = Some(now);
        }
        history.incarnations.push(Incarnation {
            started_us: now,
            ended_us: None,
        });
        self.incarnation.fetch_add(1, Ordering::SeqCst);
    }

    pub fn record_clock_offset(&self, offset_ms: i64) {
        self.history().clock_offsets_ms.push(offset_ms);
    }

    pub fn record_fault(&self, fault: crate::history::FaultRecord) {
        self.history().faults.push(fault);
    }

    /// `__ts` for a request now: this machine's clock plus the injected skew.
    fn timestamp(&self, client: &str) -> String {
        let skew = self.skew_ms.load(Ordering::Relaxed);
        let ms = (now_us() / 1000).saturating_add_signed(skew);
        format!("{ms:015}:00000:{client}")
    }
}

/// A connection and the server process it reached.
struct Conn {
    client: Client,
    incarnation: u32,
}

/// Connects to node `node` (modulo the node count).
async fn connect(
    shared: &Shared,
    options: Options<'_>,
    node: usize,
) -> Result<(Conn, bool), String> {
    let incarnation = shared.incarnation.load(Ordering::SeqCst);
    let addr = shared.addrs[node % shared.addrs.len()];
    let (client, present) =
        Client::connect(addr, options, Instant::now() + CONNECT_TIMEOUT).await?;
    Ok((
        Conn {
            client,
            incarnation,
        },
        present,
    ))
}

/// One recorded request on `conn` (dropped if its outcome is unknown).
async fn invoke(
    shared: &Shared,
    conn: &mut Option<Conn>,
    client: &str,
    key: &str,
    cmd: Cmd,
) -> Outcome {
    let Some(c) = conn.as_mut() else {
        return Outcome::Unknown;
    };
    let key_bytes = key.as_bytes();
    let px_text;
    let mut args: Vec<&[u8]> = Vec::with_capacity(6);
    let fencing_token = match &cmd {
        Cmd::Set {
            value,
            condition,
            px_ms,
            fencing_token,
        } => {
            args.extend([&b"SET"[..], key_bytes, value.as_bytes()]);
            match condition {
                Condition::Always => {}
                Condition::NotExists => args.push(b"NX"),
                Condition::NotExistsOrEqual => args.push(b"NEX"),
            }
            if let Some(px) = px_ms {
                px_text = px.to_string();
                args.extend([&b"PX"[..], px_text.as_bytes()]);
            }
            fencing_token.as_ref()
        }
        Cmd::Get => {
            args.extend([&b"GET"[..], key_bytes]);
            None
        }
        Cmd::Del { fencing_token } => {
            args.extend([&b"DEL"[..], key_bytes]);
            fencing_token.as_ref()
        }
        Cmd::VDel {
            value,
            fencing_token,
        } => {
            args.extend([&b"VDEL"[..], key_bytes, value.as_bytes()]);
            fencing_token.as_ref()
        }
    };
    let ft = fencing_token.map(ToString::to_string);
    let ts = shared.timestamp(client);
    let invoked_us = now_us();
    let reply = c
        .client
        .request(&args, &ts, ft.as_deref(), Instant::now() + REQUEST_TIMEOUT)
        .await;
    let returned_us = now_us();
    let incarnation = c.incarnation;
    let outcome = match reply {
        Ok(reply) => interpret(&cmd, &reply.payload, reply.ts.as_deref()),
        Err(_) => {
            *conn = None;
            Outcome::Unknown
        }
    };
    let mut history = shared.history();
    let id = history.ops.len();
    history.ops.push(Op {
        id,
        client: client.to_owned(),
        key: key.to_owned(),
        cmd,
        invoked_us,
        returned_us: outcome.is_known().then_some(returned_us),
        outcome: outcome.clone(),
        incarnation,
    });
    outcome
}

/// The outcome a reply payload stands for.
fn interpret(cmd: &Cmd, payload: &Bytes, ts: Option<&str>) -> Outcome {
    if let Some(text) = payload.strip_prefix(b"-ERR ") {
        let text = String::from_utf8_lossy(text);
        return Outcome::Error(text.trim_end_matches("\r\n").to_owned());
    }
    let version = ts.and_then(Version::parse);
    // Not a reply the protocol allows: what it did is unknown (and the checks report it).
    let unexpected = || {
        Outcome::Unexpected(format!(
            "{:?} (__ts {ts:?})",
            String::from_utf8_lossy(payload)
        ))
    };
    match (cmd, RespReply::parse(payload)) {
        (Cmd::Set { .. }, Ok(RespReply::Ok)) => version.map_or_else(unexpected, Outcome::Written),
        (Cmd::Set { .. }, Ok(RespReply::Integer(-1))) => Outcome::NotApplied,
        (Cmd::Get, Ok(RespReply::Nil)) => Outcome::Miss,
        (Cmd::Get, Ok(RespReply::Bulk(value))) => match version {
            Some(version) => Outcome::Hit {
                value: String::from_utf8_lossy(&value).into_owned(),
                version,
            },
            None => unexpected(),
        },
        (Cmd::Del { .. } | Cmd::VDel { .. }, Ok(RespReply::Integer(n))) => Outcome::Deleted(n),
        _ => unexpected(),
    }
}

/// Connects when not connected: to `node`, and on a failure to the next node (a client whose
/// node died goes on through another).
async fn ensure_connected(
    shared: &Shared,
    conn: &mut Option<Conn>,
    client: &str,
    node: &mut usize,
) {
    if conn.is_none() {
        // Lost (or never had) a connection: the next node first, so clients of a node that
        // died move on and the first connections spread over the nodes.
        *node += 1;
    }
    while conn.is_none() && !shared.stop_writers.load(Ordering::Relaxed) {
        let options = Options {
            client_id: client,
            clean_start: true,
            session_expiry_secs: 0,
        };
        match connect(shared, options, *node).await {
            Ok((c, _)) => *conn = Some(c),
            Err(_) => {
                *node += 1;
                sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A writer of the register keys: SET, GET, DEL, VDEL, SET NX / NEX, and short-lived keys (PX).
pub async fn writer(shared: Arc<Shared>, index: usize, seed: u64) {
    let name = format!("w{index}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut conn = None;
    let mut node = index;
    let mut seq = 0u64;
    let mut last_seen: HashMap<String, String> = HashMap::new();
    while !shared.stop_writers.load(Ordering::Relaxed) {
        ensure_connected(&shared, &mut conn, &name, &mut node).await;
        let key = format!("reg/{}", rng.gen_range(0..REGISTER_KEYS));
        seq += 1;
        let fresh = format!("{name}-{seq}");
        let seen = last_seen.get(&key).cloned();
        let set = |value: String, condition, px_ms| Cmd::Set {
            value,
            condition,
            px_ms,
            fencing_token: None,
        };
        let cmd = match rng.gen_range(0..100) {
            0..30 => set(fresh, Condition::Always, None),
            30..55 => Cmd::Get,
            55..62 => Cmd::Del {
                fencing_token: None,
            },
            62..72 => Cmd::VDel {
                value: seen.unwrap_or(fresh),
                fencing_token: None,
            },
            72..82 => set(fresh, Condition::NotExists, None),
            82..92 => set(
                if rng.gen_bool(0.5) {
                    seen.unwrap_or(fresh)
                } else {
                    fresh
                },
                Condition::NotExistsOrEqual,
                None,
            ),
            _ => set(fresh, Condition::Always, Some(rng.gen_range(100..2000))),
        };
        let written = match &cmd {
            Cmd::Set { value, .. } => Some(value.clone()),
            _ => None,
        };
        match invoke(&shared, &mut conn, &name, &key, cmd).await {
            Outcome::Written(_) => {
                if let Some(value) = written {
                    last_seen.insert(key, value);
                }
            }
            Outcome::Hit { value, .. } => {
                last_seen.insert(key, value);
            }
            _ => {}
        }
        sleep(Duration::from_millis(rng.gen_range(1..8))).await;
    }
    if let Some(c) = conn {
        c.client.disconnect().await;
    }
}

/// A lock holder: acquires `lock/j` with `SET NEX PX`, writes `fenced/j` with the lock's version as
/// fencing token, renews, releases with VDEL, and sometimes sleeps past its lease first.
pub async fn lock_holder(shared: Arc<Shared>, index: usize, seed: u64) {
    let name = format!("l{index}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut conn = None;
    let mut node = index;
    let mut seq = 0u64;
    let mut holding: Option<(usize, Version)> = None;
    let lease = |name: &str| Cmd::Set {
        value: name.to_owned(),
        condition: Condition::NotExistsOrEqual,
        px_ms: Some(LEASE_MS),
        fencing_token: None,
    };
    while !shared.stop_writers.load(Ordering::Relaxed) {
        ensure_connected(&shared, &mut conn, &name, &mut node).await;
        seq += 1;
        let Some((j, token)) = holding.clone() else {
            let j = rng.gen_range(0..LOCKS);
            match invoke(
                &shared,
                &mut conn,
                &name,
                &format!("lock/{j}"),
                lease(&name),
            )
            .await
            {
                Outcome::Written(version) => holding = Some((j, version)),
                _ => sleep(Duration::from_millis(rng.gen_range(5..40))).await,
            }
            continue;
        };
        let (lock, fenced) = (format!("lock/{j}"), format!("fenced/{j}"));
        match rng.gen_range(0..100) {
            0..60 => {
                let cmd = Cmd::Set {
                    value: format!("{name}-{seq}"),
                    condition: Condition::Always,
                    px_ms: None,
                    fencing_token: Some(token),
                };
                invoke(&shared, &mut conn, &name, &fenced, cmd).await;
            }
            60..75 => match invoke(&shared, &mut conn, &name, &lock, lease(&name)).await {
                Outcome::Written(version) => holding = Some((j, version)),
                Outcome::NotApplied => holding = None,
                _ => {}
            },
            75..85 => {
                invoke(&shared, &mut conn, &name, &fenced, Cmd::Get).await;
            }
            85..97 => {
                let release = Cmd::VDel {
                    value: name.clone(),
                    fencing_token: None,
                };
                invoke(&shared, &mut conn, &name, &lock, release).await;
                holding = None;
            }
            _ => {
                // A holder that stalls past its lease and writes with its old token anyway: the
                // token must be refused if a newer holder has written since.
                sleep(Duration::from_millis(LEASE_MS + 200)).await;
                let cmd = Cmd::Set {
                    value: format!("{name}-{seq}-late"),
                    condition: Condition::Always,
                    px_ms: None,
                    fencing_token: Some(token),
                };
                invoke(&shared, &mut conn, &name, &fenced, cmd).await;
                holding = None;
            }
        }
        sleep(Duration::from_millis(rng.gen_range(1..10))).await;
    }
    if let Some(c) = conn {
        c.client.disconnect().await;
    }
}

/// An observer with a persistent session: KEYNOTIFY on every key, on every connection (the
/// registrations end with a connection), recording what arrives.
pub async fn observer(shared: Arc<Shared>, index: usize) {
    let name = format!("o{index}");
    let keys = all_keys();
    let mut epoch = 0u32;
    let mut first = true;
    while !shared.stop_observers.load(Ordering::Relaxed) {
        let options = Options {
            client_id: &name,
            clean_start: first,
            session_expiry_secs: SESSION_EXPIRY_SECS,
        };
        let mut client = match connect(&shared, options, index).await {
            Ok((conn, present)) => {
                if !first && !present {
                    shared.history().sessions_lost.push(name.clone());
                }
                conn.client
            }
            Err(_) => {
                sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        first = false;
        epoch += 1;
        if observe(&shared, &mut client, &name, epoch, &keys)
            .await
            .is_ok()
        {
            client.disconnect().await;
            return;
        }
    }
}

/// Registers every key, then records notifications until told to stop (`Ok`) or the connection
/// fails (`Err`).
async fn observe(
    shared: &Shared,
    client: &mut Client,
    name: &str,
    epoch: u32,
    keys: &[String],
) -> Result<(), String> {
    for key in keys {
        let ts = shared.timestamp(name);
        let reply = client
            .request(
                &[b"KEYNOTIFY", key.as_bytes()],
                &ts,
                None,
                Instant::now() + REQUEST_TIMEOUT,
            )
            .await?;
        if reply.payload.as_ref() != b"+OK\r\n" {
            return Err(format!("KEYNOTIFY {key} answered {:?}", reply.payload));
        }
        shared.history().registrations.push(Registration {
            observer: name.to_owned(),
            epoch,
            key: key.clone(),
            registered_us: now_us(),
        });
    }
    loop {
        let stopping = shared.stop_observers.load(Ordering::Relaxed);
        let wait = Instant::now() + Duration::from_millis(100);
        let notification = client.next_notification(wait).await?;
        let Some(n) = notification else {
            if stopping {
                return Ok(());
            }
            continue;
        };
        let Some(key) = n
            .topic
            .rsplit('/')
            .next()
            .and_then(decode_hex)
            .and_then(|k| String::from_utf8(k).ok())
        else {
            continue;
        };
        let change = match NotifyPayload::parse(&n.payload) {
            Ok(NotifyPayload::Set(value)) => Change::Set(String::from_utf8_lossy(&value).into()),
            Ok(NotifyPayload::Delete) => Change::Delete,
            Err(_) => continue,
        };
        shared.history().notifications.push(Notified {
            observer: name.to_owned(),
            epoch,
            key,
            change,
            version: n.ts.as_deref().and_then(Version::parse),
            received_us: now_us(),
        });
    }
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// How long the final reads may wait for a cluster to serve again after its full restart.
const FINAL_READS_BOUND: Duration = Duration::from_secs(90);

/// The reads after the final recovery: one GET of every key that answers with a value or a miss,
/// recorded like any operation. A cluster that is still forming answers errors (or nothing): the
/// read is tried again, through the next node, within `FINAL_READS_BOUND`.
pub async fn final_reads(shared: &Shared) -> Result<(), String> {
    let client = crate::checks::FINAL_CLIENT;
    let deadline = Instant::now() + FINAL_READS_BOUND;
    let mut node = 0;
    let mut conn: Option<Conn> = None;
    for key in all_keys() {
        loop {
            if Instant::now() > deadline {
                return Err(format!(
                    "the final GET {key} got no value or miss within {FINAL_READS_BOUND:?}"
                ));
            }
            if conn.is_none() {
                let options = Options {
                    client_id: client,
                    clean_start: true,
                    session_expiry_secs: 0,
                };
                match connect(shared, options, node).await {
                    Ok((c, _)) => conn = Some(c),
                    Err(_) => {
                        node += 1;
                        sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                }
            }
            match invoke(shared, &mut conn, client, &key, Cmd::Get).await {
                Outcome::Hit { .. } | Outcome::Miss => break,
                Outcome::Error(_) if shared.addrs.len() > 1 => {
                    sleep(Duration::from_millis(200)).await;
                }
                outcome if shared.addrs.len() == 1 => {
                    if outcome.is_known() {
                        break;
                    }
                    return Err(format!("the final GET {key} got no reply"));
                }
                _ => {
                    node += 1;
                    conn = None;
                }
            }
        }
    }
    if let Some(c) = conn {
        c.client.disconnect().await;
    }
    Ok(())
}

/// Starts every client; returns their handles.
pub fn spawn_clients(
    shared: &Arc<Shared>,
    seed: u64,
    observers: bool,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let mut writers = Vec::new();
    for i in 0..WRITERS {
        writers.push(tokio::spawn(writer(
            shared.clone(),
            i,
            seed ^ (i as u64 + 1),
        )));
    }
    for i in 0..LOCK_CLIENTS {
        writers.push(tokio::spawn(lock_holder(
            shared.clone(),
            i,
            seed ^ (0x100 + i as u64),
        )));
    }
    // On a cluster unless `--no-cluster-observers`.
    let observers = if observers { OBSERVERS } else { 0 };
    let observers = (0..observers)
        .map(|i| tokio::spawn(observer(shared.clone(), i)))
        .collect();
    (writers, observers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_map_to_outcomes() {
        let set = Cmd::Set {
            value: "v".into(),
            condition: Condition::NotExists,
            px_ms: None,
            fencing_token: None,
        };
        let ts = "001700000000000:00001:n";
        assert!(matches!(
            interpret(&set, &Bytes::from_static(b"+OK\r\n"), Some(ts)),
            Outcome::Written(_)
        ));
        assert_eq!(
            interpret(&set, &Bytes::from_static(b":-1\r\n"), Some(ts)),
            Outcome::NotApplied
        );
        assert_eq!(
            interpret(&Cmd::Get, &Bytes::from_static(b"$-1\r\n"), None),
            Outcome::Miss
        );
        assert_eq!(
            interpret(
                &Cmd::Get,
                &Bytes::from_static(b"-ERR syntax error\r\n"),
                None
            ),
            Outcome::Error("syntax error".into())
        );
        // An OK without a version is a protocol violation, not a refusal.
        assert!(matches!(
            interpret(&set, &Bytes::from_static(b"+OK\r\n"), None),
            Outcome::Unexpected(_)
        ));
        assert_eq!(decode_hex("7265672F30").as_deref(), Some(&b"reg/0"[..]));
    }
}
