//! The broker's persistent sessions on the chains (decision 0047): one row per session,
//! keyed by client id, in the sessions space ([`crate::space`]) of the client id's partition (the
//! same FNV-1a hash as state-store keys). The rows are opaque here — the binary's session journal
//! decides what they hold — and every write is a compare-and-set on the row's version, which is
//! what fences a node that lost a session to another.
//!
//! As for state-store requests, a read or write goes to the partition's head (here, or forwarded
//! over the cluster transport) and is retried while the partition has no head acting, within the
//! caller's budget; then it fails with the reason, and the caller refuses retryably.

use std::time::Duration;

// tokio's: simulated time moves it (turmoil, paused test time), as every timer here.
use tokio::time::Instant;

use mqstate_chain::{Answer, Expect, Version, Write};
use mqstate_cluster::partition::partition_of;
use mqstate_cluster::transport::{Request, Response};

use crate::wire::{decode, encode, DataRequest, DataResponse, RowExpect, RowWritten, SessionRow};
use crate::{not_served, space, Replication, MAX_ATTEMPTS, RETRY_EVERY, STEP_TIMEOUT};

impl Replication {
    /// Reads `client_id`'s session row at its partition's head (linearizable: a row being
    /// written is flushed first), retrying within `budget`.
    pub async fn session_read(
        &self,
        client_id: &str,
        budget: Duration,
    ) -> Result<SessionRow, String> {
        let request = DataRequest::SessionRead {
            client_id: client_id.to_owned(),
        };
        match self.session_call(client_id, request, budget).await? {
            DataResponse::SessionRow(row) => Ok(row),
            other => Err(format!("unexpected answer to a session read: {other:?}")),
        }
    }

    /// Writes (`None`: deletes) `client_id`'s session row if it is as `expect` says, retrying
    /// within `budget` while the partition has no head. `Err` means the outcome is unknown only if
    /// a try reached the chain and timed out; the caller reads the row to find out.
    pub async fn session_write(
        &self,
        client_id: &str,
        value: Option<Vec<u8>>,
        expect: RowExpect,
        budget: Duration,
    ) -> Result<RowWritten, String> {
        let request = DataRequest::SessionWrite {
            client_id: client_id.to_owned(),
            value,
            expect,
        };
        match self.session_call(client_id, request, budget).await? {
            DataResponse::SessionWritten(written) => Ok(written),
            other => Err(format!("unexpected answer to a session write: {other:?}")),
        }
    }

    /// The session rows this node's replicas hold now — client id, the row's first `prefix`
    /// bytes (its header), whether this node acts as the head of its partition: where a node looks
    /// for sessions nobody holds (decision 0057). A replica's copy may trail the head's; whoever
    /// acts on a row reads it again at the head.
    pub async fn sessions_here(&self, prefix: usize) -> Vec<(Vec<u8>, Vec<u8>, bool)> {
        let Some(count) = self.node.partition_count() else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for partition in 0..count {
            let rows = self
                .driver
                .visit(space::sessions(partition), move |replica, head| {
                    replica
                        .rows()
                        .iter()
                        .filter_map(|(key, row)| {
                            let value = row.value.as_ref().filter(|_| !row.locked)?;
                            let header = value[..prefix.min(value.len())].to_vec();
                            Some((key.clone(), header, head))
                        })
                        .collect::<Vec<_>>()
                })
                .await;
            found.extend(rows.into_iter().flatten());
        }
        found
    }

    /// Whether member `node` is up: its lease is current in the control plane (a node counts
    /// down once its lease lapsed).
    pub fn is_up(&self, node: u64) -> bool {
        self.node
            .members()
            .iter()
            .any(|&(id, _, up)| id == node && up)
    }

    /// Whether this node holds its control-plane lease (`ClusterNode::lease_valid`).
    pub fn lease_held(&self) -> bool {
        self.node.lease_valid()
    }

    async fn session_call(
        &self,
        client_id: &str,
        request: DataRequest,
        budget: Duration,
    ) -> Result<DataResponse, String> {
        let started = Instant::now();
        loop {
            let last = match self.session_try(client_id, &request).await {
                Ok(response) => return Ok(response),
                Err(reason) => reason,
            };
            if started.elapsed() + RETRY_EVERY >= budget {
                return Err(last);
            }
            tokio::time::sleep(RETRY_EVERY).await;
        }
    }

    async fn session_try(
        &self,
        client_id: &str,
        request: &DataRequest,
    ) -> Result<DataResponse, String> {
        let count = self
            .node
            .partition_count()
            .ok_or("the cluster has not formed yet")?;
        let partition = partition_of(client_id.as_bytes(), count);
        let head = self
            .head_of(partition)
            .ok_or_else(|| format!("partition {partition} has no replica up"))?;
        if head == self.node.id() {
            return match self.handle_session(request.clone()).await {
                DataResponse::Retry(reason) => Err(reason),
                response => Ok(response),
            };
        }
        let addr = self.node.addr_of(head).ok_or_else(|| {
            format!("the head of partition {partition}, node {head}, has no address")
        })?;
        let frame = encode(request);
        match self
            .node
            .transport()
            .call(&addr, Request::Data(frame), STEP_TIMEOUT * 2)
            .await
        {
            Ok(Response::Data(bytes)) => match decode::<DataResponse>(&bytes) {
                Ok(DataResponse::Retry(reason)) => Err(format!("node {head}: {reason}")),
                Ok(response) => Ok(response),
                Err(e) => Err(format!(
                    "node {head} answered a frame that does not decode: {e}"
                )),
            },
            Ok(other) => Err(format!("node {head} answered {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// At the head: a session read or write on this node's replica of the sessions space.
    pub(crate) async fn handle_session(&self, request: DataRequest) -> DataResponse {
        let Some(count) = self.node.partition_count() else {
            return DataResponse::Retry("the cluster has not formed yet".into());
        };
        let result = match request {
            DataRequest::SessionRead { client_id } => {
                let partition = partition_of(client_id.as_bytes(), count);
                self.session_read_here(partition, client_id.into_bytes())
                    .await
                    .map(DataResponse::SessionRow)
            }
            DataRequest::SessionWrite {
                client_id,
                value,
                expect,
            } => {
                let partition = partition_of(client_id.as_bytes(), count);
                self.session_write_here(partition, client_id.into_bytes(), value, expect)
                    .await
                    .map(DataResponse::SessionWritten)
            }
            other => Err(format!("not a session request: {other:?}")),
        };
        result.unwrap_or_else(DataResponse::Retry)
    }

    async fn session_read_here(&self, partition: u32, key: Vec<u8>) -> Result<SessionRow, String> {
        let replica = space::sessions(partition);
        match self.driver.read(replica, key, STEP_TIMEOUT).await {
            Answer::Value { value, version } => Ok(SessionRow { value, version }),
            other => Err(not_served(partition, &other)),
        }
    }

    async fn session_write_here(
        &self,
        partition: u32,
        key: Vec<u8>,
        value: Option<Vec<u8>>,
        expect: RowExpect,
    ) -> Result<RowWritten, String> {
        let replica = space::sessions(partition);
        let mut floor = match expect {
            RowExpect::Version(version) => Some(version),
            RowExpect::Absent => None,
        };
        for _ in 0..MAX_ATTEMPTS {
            let write = Write {
                key: key.clone(),
                value: value.clone(),
                version: stamp_above(self.clock.now_ms(), floor, self.config.node),
                expect: match expect {
                    RowExpect::Absent => Expect::Absent,
                    RowExpect::Version(version) => Expect::Version(version),
                },
            };
            match self.driver.write(replica, write, STEP_TIMEOUT).await {
                Answer::Written { version } => return Ok(RowWritten::Written(version)),
                Answer::ConditionFailed { current } => return Ok(RowWritten::Conflict(current)),
                // A deleted row keeps its version: stamp above it.
                Answer::StaleVersion { current } => floor = Some(current),
                other => return Err(not_served(partition, &other)),
            }
        }
        Err(format!(
            "partition {partition}: the session row's version kept moving under {MAX_ATTEMPTS} attempts"
        ))
    }
}

/// A row version above `floor`, at wall time `now_ms` when the clock is ahead of it.
fn stamp_above(now_ms: u64, floor: Option<Version>, node: u64) -> Version {
    match floor {
        Some(floor) if floor.wall_ms >= now_ms => Version {
            wall_ms: floor.wall_ms,
            counter: floor.counter.saturating_add(1),
            node,
        },
        _ => Version {
            wall_ms: now_ms,
            counter: 0,
            node,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_go_above_the_floor_even_with_a_clock_behind_it() {
        let floor = Version {
            wall_ms: 100,
            counter: 3,
            node: 9,
        };
        for now in [0, 50, 100] {
            assert!(stamp_above(now, Some(floor), 1) > floor, "now {now}");
        }
        assert_eq!(stamp_above(200, Some(floor), 1).wall_ms, 200);
        assert_eq!(stamp_above(7, None, 1).wall_ms, 7);
    }
}
