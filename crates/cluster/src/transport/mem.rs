//! Frames handed over in memory, for tests of several nodes in one process: each message is still
//! encoded and decoded (the codec is exercised), and links can be cut and healed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::{
    decode_body, encode_frame, BoxFuture, Handler, Request, Response, Transport, TransportError,
};

#[derive(Default)]
struct Inner {
    handlers: HashMap<String, Arc<dyn Handler>>,
    /// Cut links, both directions listed.
    cut: HashSet<(String, String)>,
}

/// The in-memory "network": who answers at which address, and which links are cut.
#[derive(Clone, Default)]
pub struct MemNetwork {
    inner: Arc<Mutex<Inner>>,
}

impl MemNetwork {
    pub fn new() -> MemNetwork {
        MemNetwork::default()
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `handler` answers at `addr` from now on.
    pub fn register(&self, addr: &str, handler: Arc<dyn Handler>) {
        self.inner().handlers.insert(addr.to_owned(), handler);
    }

    /// Nobody answers at `addr` any more (a crashed node).
    pub fn unregister(&self, addr: &str) {
        self.inner().handlers.remove(addr);
    }

    /// Messages between `a` and `b` are lost, both ways.
    pub fn cut(&self, a: &str, b: &str) {
        let mut inner = self.inner();
        inner.cut.insert((a.to_owned(), b.to_owned()));
        inner.cut.insert((b.to_owned(), a.to_owned()));
    }

    pub fn heal_all(&self) {
        self.inner().cut.clear();
    }

    /// The transport of the node at `from`.
    pub fn transport(&self, from: &str) -> MemTransport {
        MemTransport {
            net: self.clone(),
            from: from.to_owned(),
        }
    }
}

/// One node's end of a [`MemNetwork`].
#[derive(Clone)]
pub struct MemTransport {
    net: MemNetwork,
    from: String,
}

impl Transport for MemTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Request,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>> {
        Box::pin(async move {
            let unreachable = |reason: &str| TransportError::Unreachable {
                addr: addr.to_owned(),
                reason: reason.to_owned(),
            };
            let handler = {
                let inner = self.net.inner();
                if inner.cut.contains(&(self.from.clone(), addr.to_owned())) {
                    return Err(unreachable("link cut"));
                }
                inner.handlers.get(addr).cloned()
            };
            let handler = handler.ok_or_else(|| unreachable("nobody listens"))?;
            let frame_error = |e: postcard::Error| TransportError::Frame {
                addr: addr.to_owned(),
                reason: e.to_string(),
            };
            let frame = encode_frame(&request).map_err(frame_error)?;
            let request: Request = decode_body(&frame[4..]).map_err(frame_error)?;
            let response = tokio::time::timeout(timeout, handler.handle(request))
                .await
                .map_err(|_| TransportError::Timeout {
                    addr: addr.to_owned(),
                    timeout,
                })?;
            // The answer is lost if the link was cut meanwhile.
            if self
                .net
                .inner()
                .cut
                .contains(&(addr.to_owned(), self.from.clone()))
            {
                return Err(unreachable("link cut"));
            }
            let frame = encode_frame(&response).map_err(frame_error)?;
            decode_body(&frame[4..]).map_err(frame_error)
        })
    }
}
