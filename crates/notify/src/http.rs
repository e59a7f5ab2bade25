//! HTTP push: one POST per batch with `{"records": [...]}`; any 2xx acknowledges the whole batch.
//! One kept-alive HTTP/1.1 connection per endpoint (TLS for `https`), reopened after any failure.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::dial::Dialer;
use crate::endpoint::{EndpointError, Pushed};
use crate::record::{batch_json, Record};

pub struct HttpEndpoint {
    dialer: Dialer,
    path: String,
    timeout: Duration,
    connection: Option<SendRequest<Full<Bytes>>>,
}

impl HttpEndpoint {
    pub(crate) fn new(dialer: Dialer, path: String, timeout: Duration) -> HttpEndpoint {
        HttpEndpoint {
            dialer,
            path,
            timeout,
            connection: None,
        }
    }

    pub(crate) async fn push(&mut self, records: &[Record]) -> Pushed {
        let result = tokio::time::timeout(self.timeout, self.post(batch_json(records))).await;
        let error = match result {
            Ok(Ok(())) => {
                return Pushed {
                    acknowledged: records.len(),
                    error: None,
                }
            }
            Ok(Err(e)) => e,
            Err(_) => EndpointError::Timeout(self.timeout),
        };
        // The connection's state is unknown after a failure: start afresh next time.
        self.connection = None;
        Pushed {
            acknowledged: 0,
            error: Some(error),
        }
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, EndpointError> {
        let stream = self.dialer.connect().await?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| EndpointError::Connect {
                addr: self.dialer.authority.clone(),
                reason: e.to_string(),
            })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("notification HTTP connection ended: {e}");
            }
        });
        Ok(sender)
    }

    /// Posts on the kept-alive connection; if that one fails (the server may have closed it while
    /// idle), once more on a new one.
    async fn post(&mut self, body: Vec<u8>) -> Result<(), EndpointError> {
        let body = Bytes::from(body);
        if let Some(sender) = self.connection.take().filter(|s| !s.is_closed()) {
            match self.post_on(sender, body.clone()).await {
                Err(EndpointError::Io(reason)) => {
                    tracing::debug!(
                        "kept-alive notification connection failed ({reason}); reconnecting"
                    );
                }
                other => return other,
            }
        }
        let sender = self.connect().await?;
        self.post_on(sender, body).await
    }

    async fn post_on(
        &mut self,
        mut sender: SendRequest<Full<Bytes>>,
        body: Bytes,
    ) -> Result<(), EndpointError> {
        sender
            .ready()
            .await
            .map_err(|e| EndpointError::Io(e.to_string()))?;
        let request = hyper::Request::post(&self.path)
            .header(hyper::header::HOST, &self.dialer.authority)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| EndpointError::Io(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| EndpointError::Io(e.to_string()))?;
        let status = response.status();
        // Read the body so the connection can carry the next request.
        let _ = response.into_body().collect().await;
        self.connection = Some(sender);
        if !status.is_success() {
            return Err(EndpointError::Rejected(format!("HTTP {status}")));
        }
        Ok(())
    }
}
