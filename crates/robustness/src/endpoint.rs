//! The persistent-notification endpoint of a run: an HTTP server on loopback that records every
//! record pushed to it (docs/notifications.md: one `POST` per batch, `{"records": [ … ]}`) and
//! acknowledges with 200 — except a seeded share of pushes it fails on purpose, so the queue
//! owner's retries are exercised: some refused before they are read (nothing recorded), some
//! recorded and then answered 500 (delivered, not acknowledged: they must come again).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::history::now_us;

/// Per cent of pushes refused unread, and recorded then refused.
const REFUSE_PERCENT: u32 = 5;
const RECORD_THEN_FAIL_PERCENT: u32 = 5;

/// One record as it reached the endpoint (a push that was refused after recording counts too:
/// it was delivered, only not acknowledged).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivered {
    pub topic: String,
    pub seq: u64,
    pub key: String,
    /// `set`, `delete` or `expire`.
    pub event: String,
    pub version: String,
    pub value: Option<String>,
    pub received_us: u64,
    /// The push it came in was answered 500 after recording (so it must be delivered again).
    pub refused: bool,
}

/// What the endpoint saw: records, and pushes it could not read as the documented format.
#[derive(Debug, Default)]
pub struct Received {
    pub records: Vec<Delivered>,
    pub malformed: Vec<String>,
    pub pushes: u64,
    pub refused_pushes: u64,
}

pub struct Endpoint {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Received>>,
    task: JoinHandle<()>,
}

impl Endpoint {
    /// Listens on a free loopback port (call inside the runtime).
    pub async fn start(seed: u64) -> anyhow::Result<Endpoint> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Mutex::new(Received::default()));
        let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed ^ 0xE4D9)));
        let shared = Arc::clone(&received);
        let task = tokio::spawn(async move {
            // Ends with the task (aborted by `stop`); connections end with their task too.
            while let Ok((stream, _)) = listener.accept().await {
                let received = Arc::clone(&shared);
                let rng = Arc::clone(&rng);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                        let received = Arc::clone(&received);
                        let rng = Arc::clone(&rng);
                        async move { Ok::<_, Infallible>(handle(request, &received, &rng).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Endpoint {
            addr,
            received,
            task,
        })
    }

    /// The endpoint URL of a topic.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// Stops listening; returns what was received.
    pub fn stop(self) -> Received {
        self.task.abort();
        std::mem::take(&mut *self.received.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

async fn handle(
    request: Request<Incoming>,
    received: &Mutex<Received>,
    rng: &Mutex<StdRng>,
) -> Response<Full<Bytes>> {
    let roll = rng
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .gen_range(0..100);
    if request.method() != Method::POST {
        return reply(StatusCode::METHOD_NOT_ALLOWED);
    }
    if roll < REFUSE_PERCENT {
        received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .refused_pushes += 1;
        return reply(StatusCode::SERVICE_UNAVAILABLE);
    }
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return reply(StatusCode::BAD_REQUEST),
    };
    let now = now_us();
    let fail_after = roll < REFUSE_PERCENT + RECORD_THEN_FAIL_PERCENT;
    let mut received = received.lock().unwrap_or_else(|p| p.into_inner());
    received.pushes += 1;
    match parse_batch(&body, now, fail_after) {
        Ok(records) => received.records.extend(records),
        Err(e) => {
            received.malformed.push(e);
            return reply(StatusCode::BAD_REQUEST);
        }
    }
    if fail_after {
        received.refused_pushes += 1;
        reply(StatusCode::INTERNAL_SERVER_ERROR)
    } else {
        reply(StatusCode::OK)
    }
}

fn reply(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response
}

/// The records of one push body, each with every field docs/notifications.md promises.
fn parse_batch(body: &[u8], received_us: u64, refused: bool) -> Result<Vec<Delivered>, String> {
    let text = || {
        String::from_utf8_lossy(body)
            .chars()
            .take(200)
            .collect::<String>()
    };
    let batch: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON ({e}): {}", text()))?;
    let records = batch["records"]
        .as_array()
        .ok_or_else(|| format!("no \"records\" list: {}", text()))?;
    records
        .iter()
        .map(|r| {
            let field = |name: &str| {
                r[name]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("a record without {name:?}: {r}"))
            };
            Ok(Delivered {
                topic: field("topic")?,
                seq: r["seq"]
                    .as_u64()
                    .ok_or_else(|| format!("a record without a numeric \"seq\": {r}"))?,
                key: field("key")?,
                event: field("event")?,
                version: field("version")?,
                value: r["value"].as_str().map(str::to_owned),
                received_us,
                refused,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_read_as_documented() {
        let body = br#"{"records":[{"topic":"t","seq":7,"key":"reg/1","event":"set","version":"001700000000000:00000:mqstate","value":"w1-3"},{"topic":"t","seq":8,"key":"reg/1","event":"delete","version":"001700000000001:00000:mqstate"}]}"#;
        let records = parse_batch(body, 5, false).expect("valid batch");
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].seq, 7);
        assert_eq!(records[0].value.as_deref(), Some("w1-3"));
        assert_eq!(records[1].event, "delete");
        assert_eq!(records[1].value, None);
        assert!(parse_batch(br#"{"records":[{"topic":"t","key":"k"}]}"#, 0, false).is_err());
        assert!(parse_batch(b"nope", 0, false).is_err());
    }
}
