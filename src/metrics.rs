//! The operations endpoint of `mqstate serve` (`--metrics-listen ADDR`): Prometheus metrics on
//! `/metrics`, liveness on `/health` (200 while the process runs) and readiness on `/ready` (200 once
//! recovery finished and the MQTT listeners are bound, 503 before that and while shutting down; on
//! a cluster node also only while it is a member caught up in its partitions, the 503 saying why).
//!
//! The library crates record through the `metrics` facade; this module installs the Prometheus recorder
//! behind it, and at each scrape reads the values that are kept elsewhere anyway (sessions in the
//! broker, WAL counters in `WalStats`) instead of counting them a second time. See
//! `docs/decisions/0006-metrics.md`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use mqstate_wal::WalStats;
use tokio::net::TcpListener;

/// Histogram buckets of every `*_seconds` metric: 50 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
];
/// Buckets of `mqstate_wal_batch_records` (records per group commit).
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];
/// Histograms accumulate between scrapes; upkeep bounds that if nobody scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);
/// A client that has not sent its request headers by then is dropped.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Prometheus exposition format, version 0.0.4.
const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The installed recorder and the state the endpoints report.
pub struct Exporter {
    handle: PrometheusHandle,
    ready: AtomicBool,
    /// A further condition of `/ready` (a cluster node's membership and catch-up): `Err` is why not.
    ready_check: OnceLock<ReadyCheck>,
    on_scrape: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

type ReadyCheck = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

impl Exporter {
    /// Installs the process-wide Prometheus recorder. Call once, before anything records.
    pub fn install() -> anyhow::Result<Arc<Exporter>> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("mqstate_wal_batch_records".into()),
                    BATCH_BUCKETS,
                )
            })
            .context("invalid histogram buckets")?
            .install_recorder()
            .context("cannot install the metrics recorder")?;
        describe();
        Ok(Arc::new(Exporter::new(handle)))
    }

    fn new(handle: PrometheusHandle) -> Exporter {
        Exporter {
            handle,
            ready: AtomicBool::new(false),
            ready_check: OnceLock::new(),
            on_scrape: OnceLock::new(),
        }
    }

    /// `/ready` answers 200 while this is true.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// `/ready` also asks `check` at each request once the flag is set, and answers 503 with its
    /// reason while it fails. Set once; later calls are ignored.
    pub fn ready_when(&self, check: impl Fn() -> Result<(), String> + Send + Sync + 'static) {
        let _ = self.ready_check.set(Box::new(check));
    }

    /// Runs `collect` before each scrape, to read values kept elsewhere. Set once, when the server is
    /// wired up; later calls are ignored.
    pub fn on_scrape(&self, collect: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_scrape.set(Box::new(collect));
    }

    fn render(&self) -> String {
        if let Some(collect) = self.on_scrape.get() {
            collect();
        }
        self.handle.render()
    }

    fn respond(&self, method: &Method, path: &str) -> Response<Full<Bytes>> {
        if method != Method::GET && method != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        match path {
            "/metrics" => {
                let mut response = Response::new(Full::new(Bytes::from(self.render())));
                response.headers_mut().insert(
                    CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static(PROMETHEUS_CONTENT_TYPE),
                );
                response
            }
            "/health" => text(StatusCode::OK, "ok\n"),
            "/ready" if !self.ready.load(Ordering::Acquire) => {
                text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
            }
            "/ready" => match self.ready_check.get().map_or(Ok(()), |check| check()) {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(why) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {why}\n"),
                ),
            },
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /health or /ready\n",
            ),
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Serves the endpoints on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    exporter: Arc<Exporter>,
    shutdown: impl Future<Output = ()>,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics and health endpoint started");
    }
    let upkeep = {
        let exporter = Arc::clone(&exporter);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(UPKEEP_INTERVAL);
            loop {
                every.tick().await;
                exporter.handle.run_upkeep();
            }
        })
    };
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let exporter = Arc::clone(&exporter);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let response = exporter.respond(request.method(), request.uri().path());
                async move { Ok::<_, Infallible>(response) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "metrics endpoint: connection ended with an error");
            }
        });
    }
    upkeep.abort();
}

/// Exports the WAL writer's counters (kept by `WalStats`) as of now.
pub fn record_wal(stats: &WalStats) {
    let log = stats.name();
    let now = stats.snapshot();
    counter!("mqstate_wal_records_total", "log" => log).absolute(now.records);
    counter!("mqstate_wal_bytes_written_total", "log" => log).absolute(now.bytes_written);
    counter!("mqstate_wal_write_errors_total", "log" => log).absolute(now.write_errors);
}

/// Exports the number of sessions, connected or not.
pub fn record_sessions(sessions: usize) {
    gauge!("mqstate_sessions").set(sessions as f64);
}

/// How long recovery took at start-up.
pub fn record_recovery(took: Duration) {
    gauge!("mqstate_recovery_duration_seconds").set(took.as_secs_f64());
}

/// HELP lines for every metric, in one place (the names are recorded in the library crates).
fn describe() {
    describe_counter!(
        "mqstate_connections_accepted_total",
        "TCP connections accepted on the MQTT listeners, before any handshake."
    );
    describe_gauge!(
        "mqstate_clients_connected",
        "MQTT clients past CONNACK and not yet disconnected."
    );
    describe_gauge!("mqstate_sessions", "MQTT sessions, connected or not.");
    describe_counter!(
        "mqstate_messages_received_total",
        "PUBLISH packets received from clients, by QoS."
    );
    describe_counter!(
        "mqstate_messages_sent_total",
        "PUBLISH packets written to clients, by delivery QoS (resends not counted)."
    );
    describe_counter!(
        "mqstate_statestore_requests_total",
        "State-store requests by command and result (ok, error, not_durable, duplicate, bad_request, forbidden, dropped)."
    );
    describe_histogram!(
        "mqstate_statestore_request_duration_seconds",
        Unit::Seconds,
        "State-store request latency from receipt to the published reply, durability wait included."
    );
    describe_gauge!("mqstate_statestore_keys", "Keys in the state store.");
    describe_gauge!(
        "mqstate_statestore_bytes",
        Unit::Bytes,
        "Bytes of keys and values in the state store (what the max-bytes quota counts)."
    );
    describe_histogram!(
        "mqstate_snapshot_duration_seconds",
        Unit::Seconds,
        "Snapshot time by phase: encode (blocks the state store) and write (in the background)."
    );
    describe_counter!("mqstate_snapshots_total", "Snapshots taken, by result.");
    describe_histogram!(
        "mqstate_wal_fsync_duration_seconds",
        Unit::Seconds,
        "Time of each fdatasync of the write-ahead log."
    );
    describe_histogram!(
        "mqstate_wal_batch_records",
        "Records per group commit of the write-ahead log."
    );
    describe_counter!(
        "mqstate_wal_records_total",
        "Records appended to the write-ahead log."
    );
    describe_counter!(
        "mqstate_wal_bytes_written_total",
        Unit::Bytes,
        "Bytes written to the write-ahead log."
    );
    describe_counter!(
        "mqstate_wal_write_errors_total",
        "Failed writes or fsyncs of the write-ahead log."
    );
    describe_gauge!(
        "mqstate_recovery_duration_seconds",
        Unit::Seconds,
        "How long loading the snapshot and replaying the log took at start-up."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(exporter: &Exporter, path: &str) -> StatusCode {
        exporter.respond(&Method::GET, path).status()
    }

    #[test]
    fn ready_follows_the_flag_and_health_does_not() {
        let exporter = Exporter::new(PrometheusBuilder::new().build_recorder().handle());
        assert_eq!(status(&exporter, "/ready"), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(&exporter, "/health"), StatusCode::OK);
        exporter.set_ready(true);
        assert_eq!(status(&exporter, "/ready"), StatusCode::OK);
        exporter.set_ready(false);
        assert_eq!(status(&exporter, "/ready"), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(&exporter, "/health"), StatusCode::OK);
    }

    #[test]
    fn ready_also_asks_the_check_and_says_why_not() {
        let exporter = Exporter::new(PrometheusBuilder::new().build_recorder().handle());
        let caught_up = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&caught_up);
        exporter.ready_when(move || {
            if seen.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("catching up in 1 partition(s): 7".into())
            }
        });
        // Before recovery the flag decides, whatever the check says.
        assert_eq!(status(&exporter, "/ready"), StatusCode::SERVICE_UNAVAILABLE);
        exporter.set_ready(true);
        let response = exporter.respond(&Method::GET, "/ready");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body_text(response.into_body()),
            "not ready: catching up in 1 partition(s): 7\n"
        );
        caught_up.store(true, Ordering::Relaxed);
        assert_eq!(status(&exporter, "/ready"), StatusCode::OK);
        exporter.set_ready(false);
        assert_eq!(status(&exporter, "/ready"), StatusCode::SERVICE_UNAVAILABLE);
    }

    fn body_text(body: Full<Bytes>) -> String {
        use http_body_util::BodyExt;
        let collected = futures::executor::block_on(body.collect()).unwrap();
        String::from_utf8(collected.to_bytes().to_vec()).unwrap()
    }

    #[test]
    fn scrape_runs_the_collector_and_other_methods_are_refused() {
        let exporter = Exporter::new(PrometheusBuilder::new().build_recorder().handle());
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        exporter.on_scrape(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(status(&exporter, "/metrics"), StatusCode::OK);
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        assert_eq!(
            exporter.respond(&Method::POST, "/metrics").status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(status(&exporter, "/other"), StatusCode::NOT_FOUND);
    }
}
