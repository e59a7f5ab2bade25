//! A loopback TCP front for a cluster, as a load balancer or a Kubernetes Service is: clients
//! connect to one address, and the test chooses which node it leads to. Switching closes the
//! connections open through it, as a dead node's would be.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Front {
    pub addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    /// Bumped on every switch: open connections end when it changes.
    generation: watch::Sender<u64>,
    accept: JoinHandle<()>,
}

impl Front {
    /// A front leading to `target`.
    pub async fn start(target: SocketAddr) -> Front {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind front");
        let addr = listener.local_addr().expect("front address");
        let target = Arc::new(Mutex::new(target));
        let (generation, _) = watch::channel(0u64);
        let accept = {
            let target = Arc::clone(&target);
            let generation = generation.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let to = *target.lock().unwrap();
                    let mut switched = generation.subscribe();
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(to).await else {
                            return; // the node is down: the client sees its connection close
                        };
                        let (mut client, mut server) = (client, server);
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            _ = switched.changed() => {}
                        }
                    });
                }
            })
        };
        Front {
            addr,
            target,
            generation,
            accept,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// New connections lead to `target`; the open ones are closed.
    pub fn switch(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
        self.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
