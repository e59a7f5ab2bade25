//! The receiving side: batches from the other nodes, applied in the order each sender sent them.

use std::sync::Arc;
use std::time::Duration;

use mqstate_broker::GroupKey;
use mqstate_cluster::transport::BoxFuture;
use mqstate_cluster::MeshHandler;

use crate::wire::{self, Batch, Item, Reply};
use crate::Shared;

pub(crate) struct Inbound(pub Arc<Shared>);

impl MeshHandler for Inbound {
    fn handle(&self, request: Vec<u8>) -> BoxFuture<'_, Vec<u8>> {
        Box::pin(async move { wire::encode(&self.apply(&request).await) })
    }
}

impl Inbound {
    async fn apply(&self, request: &[u8]) -> Reply {
        let batch = match Batch::decode(request) {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(error = %e, "mesh: undecodable batch refused");
                return Reply::Resync;
            }
        };
        let shared = &self.0;
        let from = batch.from;
        let mut work = Vec::new();
        let resync = matches!(batch.items.first(), Some(Item::Resync { .. }));
        {
            let mut state = shared.lock();
            let state = &mut *state;
            let known = state.inbound.get(&from).copied();
            if !resync && known != Some((batch.incarnation, batch.seq)) {
                return Reply::Resync;
            }
            if resync && known.map(|k| k.0) != Some(batch.incarnation) {
                // A sender we did not follow: new, or restarted (and then it lost our routes).
                tracing::info!(node = from, "mesh: following a node's stream");
                if let Some(outbox) = state.outboxes.get_mut(&from) {
                    outbox.want_resync();
                }
            }
            state
                .inbound
                .insert(from, (batch.incarnation, batch.seq + 1));
            for item in batch.items {
                match item {
                    Item::Resync { routes, retained } => {
                        state.tables.replace_remote(from, routes);
                        work.extend(retained.into_iter().map(Work::Retained));
                    }
                    Item::Added(route) => state.tables.remote_added(from, route),
                    Item::Removed(route) => state.tables.remote_removed(from, &route),
                    Item::Publish(p) => work.push(Work::Publish(p)),
                    Item::Claim(client_id) => work.push(Work::Claim(client_id)),
                    Item::Redeliver {
                        publish,
                        put_back_within_ms,
                    } => work.push(Work::Redeliver(publish, put_back_within_ms)),
                }
            }
        }
        // The broker is called with the mesh unlocked: it calls the mesh under its trie lock.
        let broker = &shared.broker;
        let mut durable = Vec::new();
        for w in work {
            match w {
                Work::Retained(message) => {
                    if let Some((message, age)) = message.into_message() {
                        durable.extend(broker.adopt_retained(message, age));
                    }
                }
                Work::Publish(p) => {
                    let Some((message, age)) = p.message.into_message() else {
                        tracing::warn!(node = from, "mesh: publish with an unknown QoS dropped");
                        continue;
                    };
                    durable.extend(broker.accept_forwarded(
                        message,
                        p.origin.as_deref(),
                        age,
                        &group_keys(p.groups),
                        p.id,
                    ));
                }
                Work::Redeliver(p, within_ms) => {
                    let Some((message, age)) = p.message.into_message() else {
                        tracing::warn!(node = from, "mesh: publish with an unknown QoS dropped");
                        continue;
                    };
                    durable.extend(broker.accept_redelivered(
                        message,
                        p.origin.as_deref(),
                        age,
                        Duration::from_millis(within_ms),
                        &group_keys(p.groups),
                        p.id,
                    ));
                }
                Work::Claim(client_id) => broker.take_over_here(&client_id).await,
            }
        }
        for d in durable {
            if let Err(error) = d.await {
                tracing::error!(%error, node = from, "mesh: a forwarded message is not durable here");
            }
        }
        if resync {
            // Its retained messages and clears are in the store: new subscriptions waiting for
            // every member's resync may be served (decision 0072).
            let mut state = shared.lock();
            state.resynced_from.insert(from);
            shared.note_retained_ready(&state);
        }
        Reply::Accepted
    }
}

fn group_keys(groups: Vec<(String, String)>) -> Vec<GroupKey> {
    groups
        .into_iter()
        .map(|(filter, group)| GroupKey {
            filter: filter.into(),
            group: group.into(),
        })
        .collect()
}

enum Work {
    Retained(wire::WireMessage),
    Publish(wire::WirePublish),
    Claim(String),
    Redeliver(wire::WirePublish, u64),
}
