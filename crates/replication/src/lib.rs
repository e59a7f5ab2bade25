//! mqstate-replication: the state store replicated on chains, as a cluster node runs it.
//!
//! * [`head`] — a state-store command executed at a partition's head against the key's committed
//!   row, with the store's own semantics (pure).
//! * [`wire`] — the data plane's messages inside the cluster transport's frames.
//! * [`log`] — the replicas' log on `mqstate-wal` (`<data-dir>/chains/`), restored at start.
//! * [`driver`] — the task that owns this node's replicas (`mqstate-chain`, sans-IO) and gives
//!   them disk, network, views and time.
//!
//! [`Replication`] ties them together: a request received at any node goes to its key's
//! partition head (here, or forwarded over the cluster transport); the head reads the committed
//! row, executes, writes the new row through the chain and answers once the chain answered
//! `Written`. Architecture invariant: the protocol stays in `mqstate-chain`; this crate does I/O and
//! knows nothing of MQTT (the binary connects it to the state-store service's router port).

pub mod driver;
pub mod failpoint;
pub mod head;
pub mod log;
pub mod wire;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mqstate_chain::{Answer, Expect, Restored, View, Write};
use mqstate_clock::SharedClock;
use mqstate_cluster::partition::partition_of;
use mqstate_cluster::transport::{BoxFuture, Request, Response};
use mqstate_cluster::{ClusterNode, DataHandler};
use mqstate_protocol::Hlc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::Driver;
use crate::head::{HeadConfig, Step};
use crate::log::ChainLog;
use crate::wire::{decode, encode, DataRequest, DataResponse, Executed, Routed};

/// A request is retried (head unknown, no view yet, head changing) this often within its expiry.
const RETRY_EVERY: Duration = Duration::from_millis(50);
/// Longest a request is tried, whatever its expiry.
const MAX_TRY: Duration = Duration::from_secs(30);
/// How long one step at the head (a read, a chain write) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// Executions at the head of one request, when other writes to its key keep winning.
const MAX_ATTEMPTS: usize = 16;

/// The data plane of a cluster node.
pub struct Replication {
    node: Arc<ClusterNode>,
    driver: Driver,
    config: HeadConfig,
    clock: SharedClock,
    /// The highest HLC this node handed out at a head.
    floor: Mutex<Option<Hlc>>,
}

/// The running data plane; stop it with [`Running::stop`].
pub struct Running {
    pub replication: Arc<Replication>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    /// Stops the driver and closes the chain log (requests still waiting get `Unavailable`).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// What the node holds to hand data requests over.
struct Attached(Weak<Replication>);

impl DataHandler for Attached {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>> {
        Box::pin(async move {
            match self.0.upgrade() {
                Some(replication) => replication.handle_data(request).await,
                None => encode(&DataResponse::Retry("this node is shutting down".into())),
            }
        })
    }
}

impl Replication {
    /// Starts the driver over the restored log and attaches the data plane to `node`.
    pub fn start(
        node: Arc<ClusterNode>,
        log: ChainLog,
        restored: BTreeMap<u32, Restored>,
        config: HeadConfig,
        clock: SharedClock,
    ) -> Running {
        let (stop, stopped) = watch::channel(false);
        let (driver, task) = Driver::start(Arc::clone(&node), log, restored, stopped);
        let replication = Arc::new(Replication {
            node: Arc::clone(&node),
            driver,
            config,
            clock,
            floor: Mutex::new(None),
        });
        // Weak: the node outlives nothing it hands requests to, and shuts down once we are gone.
        node.set_data_handler(Arc::new(Attached(Arc::downgrade(&replication))));
        Running {
            replication,
            stop,
            task,
        }
    }

    /// Executes a state-store request for one key, at whichever node holds its partition's head,
    /// trying again while the partition has no head acting (a view change, a lease renewal), up to
    /// the request's expiry.
    pub async fn execute(&self, request: Routed) -> Executed {
        let started = Instant::now();
        let budget = Duration::from_millis(request.expiry_ms).min(MAX_TRY);
        loop {
            let last = match self.try_once(&request).await {
                Ok(executed) => return executed,
                Err(reason) => reason,
            };
            if started.elapsed() + RETRY_EVERY >= budget {
                tracing::debug!(client_id = %request.client_id, "state-store request not served in time: {last}");
                return Executed::error(&format!(
                    "the cluster could not serve the request in time ({last}); retry"
                ));
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }

    async fn try_once(&self, request: &Routed) -> Result<Executed, String> {
        let count = self
            .node
            .partition_count()
            .ok_or("the cluster has not formed yet")?;
        let partition = partition_of(&request.key, count);
        let head = self
            .head_of(partition)
            .ok_or_else(|| format!("partition {partition} has no replica up"))?;
        if head == self.node.id() {
            return self.execute_here(partition, request).await;
        }
        let addr = self.node.addr_of(head).ok_or_else(|| {
            format!("the head of partition {partition}, node {head}, has no address")
        })?;
        let frame = encode(&DataRequest::Execute(request.clone()));
        let timeout = STEP_TIMEOUT * 2;
        match self
            .node
            .transport()
            .call(&addr, Request::Data(frame), timeout)
            .await
        {
            Ok(Response::Data(bytes)) => match decode::<DataResponse>(&bytes) {
                Ok(DataResponse::Executed(executed)) => Ok(executed),
                Ok(DataResponse::Retry(reason)) => Err(format!("node {head}: {reason}")),
                Ok(other) => Err(format!("node {head} answered {other:?}")),
                Err(e) => Err(format!(
                    "node {head} answered a frame that does not decode: {e}"
                )),
            },
            Ok(other) => Err(format!("node {head} answered {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The head of `partition` as this node last learnt it: the published chain, read view first
    /// (as the replicas order it).
    fn head_of(&self, partition: u32) -> Option<u64> {
        let p = self.node.partition(partition)?;
        View {
            id: p.view,
            chain: p.chain,
            read_view: p.read_view,
        }
        .readable_first()
        .head()
    }

    /// At the head: read the committed row, execute, write the new row through the chain.
    async fn execute_here(&self, partition: u32, request: &Routed) -> Result<Executed, String> {
        for _ in 0..MAX_ATTEMPTS {
            let (value, version) = match self
                .driver
                .read(partition, request.key.clone(), STEP_TIMEOUT)
                .await
            {
                Answer::Value { value, version } => (value, version),
                other => return Err(not_served(partition, &other)),
            };
            let floor = self.floor.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let (step, high) = head::step(
                &self.config,
                request,
                value.as_deref(),
                self.clock.now_ms(),
                floor.as_ref(),
            );
            if let Some(high) = high {
                let mut floor = self.floor.lock().unwrap_or_else(|p| p.into_inner());
                if floor.as_ref().is_none_or(|f| high > *f) {
                    *floor = Some(high);
                }
            }
            let (value_to_write, new_version, reply) = match step {
                Step::Reply(reply) => return Ok(reply),
                Step::Write {
                    value,
                    version,
                    reply,
                } => (value, version, reply),
            };
            let expect = match (&value, version) {
                (Some(_), Some(current)) => Expect::Version(current),
                _ => Expect::Absent,
            };
            let write = Write {
                key: request.key.clone(),
                value: Some(value_to_write),
                version: new_version,
                expect,
            };
            match self.driver.write(partition, write, STEP_TIMEOUT).await {
                Answer::Written { .. } => return Ok(reply),
                // Another write to the key came first: execute again on the row it left.
                Answer::ConditionFailed { .. } | Answer::StaleVersion { .. } => continue,
                other => return Err(not_served(partition, &other)),
            }
        }
        Err(format!(
            "partition {partition}: the key kept changing under {MAX_ATTEMPTS} attempts"
        ))
    }
}

fn not_served(partition: u32, answer: &Answer) -> String {
    match answer {
        Answer::NotHead { head } => format!(
            "this node is not the head of partition {partition} (node {head:?} is, by its view)"
        ),
        Answer::Unavailable => {
            format!("partition {partition} is not available here now (no view held, or changing)")
        }
        other => format!("partition {partition}: unexpected answer {other:?}"),
    }
}

impl Replication {
    /// Answers a [`DataRequest`] from another node.
    pub async fn handle_data(&self, request: Vec<u8>) -> Vec<u8> {
        let response = match decode::<DataRequest>(&request) {
            Ok(DataRequest::Chain { partition, message }) => {
                self.driver.receive(partition, message);
                DataResponse::Received
            }
            Ok(DataRequest::Execute(routed)) => {
                let partition = self
                    .node
                    .partition_count()
                    .map(|count| partition_of(&routed.key, count));
                match partition {
                    Some(partition) => match self.execute_here(partition, &routed).await {
                        Ok(executed) => DataResponse::Executed(executed),
                        Err(reason) => DataResponse::Retry(reason),
                    },
                    None => DataResponse::Retry("the cluster has not formed yet".into()),
                }
            }
            Err(e) => DataResponse::Refused(format!("data request does not decode: {e}")),
        };
        encode(&response)
    }
}
