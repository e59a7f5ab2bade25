//! The queue owner: every `walk_interval` (and at once when a topic is created) it takes or renews
//! the lock of every queue — RGW's walk of `queues_list_object` — and runs one pusher per queue it
//! holds. A pusher lists entries in batches, pushes them, and removes those the endpoint
//! acknowledged with a removal fenced by its lease; on failure it retries the same entries with
//! backoff. Each pusher is its own task, so one endpoint being down never delays another queue.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use mqstate_broker::SharedClock;
use mqstate_notify::endpoint::uses_tls;
use mqstate_notify::tls::ClientConfig;
use mqstate_notify::{Endpoint, EndpointError, Options, Record};
use mqstate_protocol::Hlc;
use mqstate_store::notify::{QueueEntry, RemoveError, TopicDef};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;

use super::{DeliveryStats, Internal, LockState, NotifyConfig};
use crate::metrics;

/// The lock a pusher removes under.
#[derive(Debug, Clone)]
struct Lease {
    holder: Bytes,
    token: Hlc,
}

struct Pusher {
    lease: Arc<Mutex<Lease>>,
    endpoint: String,
    task: JoinHandle<()>,
}

/// What the owner needs from the service.
pub(crate) struct OwnerPort {
    pub(crate) requests: mpsc::Sender<Internal>,
    /// Notified when a topic is created: walk now.
    pub(crate) wake: Arc<Notify>,
    /// Bumped when entries were queued; closed when the service stops.
    pub(crate) queued: watch::Receiver<u64>,
    pub(crate) stats: Arc<DeliveryStats>,
    /// The node's clock: holder cookies carry its wall time.
    pub(crate) clock: SharedClock,
    /// Acquisitions so far, so that two in one millisecond get different cookies.
    pub(crate) acquisitions: AtomicU64,
}

async fn call<T>(
    requests: &mpsc::Sender<Internal>,
    make: impl FnOnce(oneshot::Sender<T>) -> Internal,
) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    requests.send(make(tx)).await.ok()?;
    rx.await.ok()
}

/// A holder string for a new acquisition: `<node id>/<cookie>` (the cookie of RGW's `lock info`),
/// the cookie unique to this run of the node: its wall time and a count of acquisitions.
fn fresh_holder(node_id: &str, port: &OwnerPort) -> Bytes {
    let n = port.acquisitions.fetch_add(1, Ordering::Relaxed);
    let cookie = (u128::from(port.clock.now_ms()) << 20) | u128::from(n & 0xF_FFFF);
    Bytes::from(format!("{node_id}/{cookie:x}"))
}

/// Runs until the service stops.
pub(crate) async fn run(config: NotifyConfig, port: OwnerPort) {
    let mut pushers: HashMap<String, Pusher> = HashMap::new();
    let mut tls = TlsCache::default();
    let mut closed = port.queued.clone();
    loop {
        let Some(topics) = call(&port.requests, |reply| Internal::Topics { reply }).await else {
            break;
        };
        walk(&config, &port, &mut pushers, &mut tls, topics).await;
        tokio::select! {
            () = tokio::time::sleep(config.walk_interval) => {}
            () = port.wake.notified() => {}
            changed = closed.changed() => if changed.is_err() { break },
        }
    }
    for (_, pusher) in pushers {
        pusher.task.abort();
    }
}

/// The TLS configuration of `https`/`mqtts` endpoints, made when the first one is used (reading the
/// system's roots costs a few milliseconds no node without TLS endpoints should pay).
#[derive(Default)]
struct TlsCache(Option<Result<Arc<ClientConfig>, String>>);

impl TlsCache {
    fn for_endpoint(
        &mut self,
        config: &NotifyConfig,
        url: &str,
    ) -> Result<Option<Arc<ClientConfig>>, String> {
        if !uses_tls(url) {
            return Ok(None);
        }
        self.0
            .get_or_insert_with(|| {
                mqstate_notify::tls::client_config(config.tls_ca_file.as_deref())
            })
            .clone()
            .map(Some)
    }
}

async fn walk(
    config: &NotifyConfig,
    port: &OwnerPort,
    pushers: &mut HashMap<String, Pusher>,
    tls: &mut TlsCache,
    topics: Vec<TopicDef>,
) {
    let names: Vec<&str> = topics.iter().map(|t| t.name.as_str()).collect();
    pushers.retain(|name, pusher| {
        let keep = names.contains(&name.as_str());
        if !keep {
            pusher.task.abort();
            port.stats.forget(name);
        }
        keep
    });
    for def in topics {
        let current = pushers.get(&def.name).map(|p| {
            p.lease
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .holder
                .clone()
        });
        let fresh = fresh_holder(&config.node_id, port);
        let Some(state) = call(&port.requests, |reply| Internal::Lock {
            topic: def.name.clone(),
            current,
            fresh,
            reply,
        })
        .await
        else {
            return;
        };
        let LockState {
            holder: Some(holder),
            token: Some(token),
            ..
        } = state
        else {
            if let Some(pusher) = pushers.remove(&def.name) {
                tracing::info!(topic = %def.name, holder = ?state.holder, "notification queue lost to another owner");
                pusher.task.abort();
            }
            continue;
        };
        let lease = Lease { holder, token };
        match pushers.get_mut(&def.name) {
            Some(pusher) if !pusher.task.is_finished() && pusher.endpoint == def.endpoint => {
                *pusher.lease.lock().unwrap_or_else(|e| e.into_inner()) = lease;
            }
            _ => {
                if let Some(old) = pushers.remove(&def.name) {
                    old.task.abort();
                }
                tracing::info!(topic = %def.name, holder = %String::from_utf8_lossy(&lease.holder), "owning notification queue");
                let lease = Arc::new(Mutex::new(lease));
                let tls = tls.for_endpoint(config, &def.endpoint);
                let task = tokio::spawn(push_loop(
                    config.clone(),
                    def.clone(),
                    tls,
                    Arc::clone(&lease),
                    port.requests.clone(),
                    port.queued.clone(),
                    Arc::clone(&port.stats),
                ));
                pushers.insert(
                    def.name.clone(),
                    Pusher {
                        lease,
                        endpoint: def.endpoint.clone(),
                        task,
                    },
                );
            }
        }
    }
}

fn record(topic: &Arc<str>, entry: QueueEntry) -> Record {
    // The HLC's text in one allocation (`to_string` grows it field by field).
    let mut version = String::with_capacity(HLC_TIME_TEXT + entry.version.node_id.len());
    let _ = write!(version, "{}", entry.version);
    Record {
        topic: Arc::clone(topic),
        seq: entry.seq,
        key: entry.key,
        event: entry.event.as_str(),
        version,
        value: entry.value,
    }
}

/// `{wall:015}:{counter:05}:` as long as it gets (a u64 and a u32 in full).
const HLC_TIME_TEXT: usize = 20 + 1 + 10 + 1;

/// The wait after a failed push that waited `backoff`: doubling from `retry_min` up to `retry_max`.
fn next_backoff(backoff: Duration, config: &NotifyConfig) -> Duration {
    (backoff * 2).min(config.retry_max.max(config.retry_min))
}

async fn push_loop(
    config: NotifyConfig,
    def: TopicDef,
    tls: Result<Option<Arc<ClientConfig>>, String>,
    lease: Arc<Mutex<Lease>>,
    requests: mpsc::Sender<Internal>,
    mut queued: watch::Receiver<u64>,
    stats: Arc<DeliveryStats>,
) {
    let topic = def.name.clone();
    let shared_topic: Arc<str> = Arc::from(topic.as_str());
    let client_id = format!("mqstate-notify-{}-{topic}", config.node_id);
    let endpoint = tls
        .map_err(|reason| EndpointError::Tls {
            url: def.endpoint.clone(),
            reason,
        })
        .and_then(|tls| {
            let options = Options {
                client_id,
                timeout: config.push_timeout,
                tls,
            };
            Endpoint::new(&def.endpoint, &options)
        });
    let mut endpoint = match endpoint {
        Ok(endpoint) => endpoint,
        Err(e) => {
            stats.update(&topic, |d| d.last_error = Some(e.to_string()));
            return tracing::error!(%topic, "notification endpoint unusable: {e}");
        }
    };
    let mut backoff = config.retry_min;
    loop {
        queued.mark_unchanged();
        let Some(Some(entries)) = call(&requests, |reply| Internal::List {
            topic: topic.clone(),
            max: config.batch_max,
            reply,
        })
        .await
        else {
            return; // the service stopped or the topic is gone
        };
        if entries.is_empty() {
            // Woken when entries are queued; the timeout only guards against a missed wake-up.
            if let Ok(Err(_)) = tokio::time::timeout(config.retry_max, queued.changed()).await {
                return;
            }
            continue;
        }
        let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
        let records: Vec<Record> = entries
            .into_iter()
            .map(|e| record(&shared_topic, e))
            .collect();
        let pushed = endpoint.push(&records).await;
        if pushed.acknowledged > 0 {
            let Lease { holder, token } = lease.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let up_to_seq = seqs[pushed.acknowledged - 1];
            let removed = call(&requests, |reply| Internal::Remove {
                topic: topic.clone(),
                up_to_seq,
                holder,
                token,
                reply,
            })
            .await;
            match removed {
                Some(Ok(())) => {
                    let n = pushed.acknowledged as u64;
                    stats.update(&topic, |d| d.delivered += n);
                    metrics::notifications_delivered(&topic, n);
                }
                Some(Err(RemoveError::Fenced)) => {
                    stats.update(&topic, |d| d.fenced += 1);
                    metrics::notification_removal_fenced(&topic);
                    return tracing::warn!(%topic, "acknowledged notifications not removed: this node no longer holds the queue's lock");
                }
                Some(Err(RemoveError::NoSuchTopic)) | None => return,
            }
        }
        match pushed.error {
            None => {
                backoff = config.retry_min;
                stats.update(&topic, |d| d.last_error = None);
                // A full batch means more is waiting: list again at once. A partial one means the
                // queue was drained; give it a moment to fill rather than push a handful at a time.
                if records.len() < config.batch_max && !config.linger.is_zero() {
                    tokio::time::sleep(config.linger).await;
                }
            }
            Some(e) => {
                let retried = (records.len() - pushed.acknowledged) as u64;
                stats.update(&topic, |d| {
                    d.failed_pushes += 1;
                    d.retried += retried;
                    d.last_error = Some(e.to_string());
                });
                metrics::notification_push_failed(&topic, retried);
                tracing::debug!(%topic, "notification push failed, retrying in {backoff:?}: {e}");
                tokio::time::sleep(backoff).await;
                backoff = next_backoff(backoff, &config);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_from_one_second_to_thirty_by_default() {
        let config = NotifyConfig::default();
        let mut backoff = config.retry_min;
        let mut waits = vec![backoff];
        for _ in 0..6 {
            backoff = next_backoff(backoff, &config);
            waits.push(backoff);
        }
        let secs: Vec<u64> = waits.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 30, 30]);
        let custom = NotifyConfig {
            retry_min: Duration::from_millis(50),
            retry_max: Duration::from_millis(120),
            ..NotifyConfig::default()
        };
        assert_eq!(
            next_backoff(Duration::from_millis(100), &custom),
            Duration::from_millis(120)
        );
    }
}
