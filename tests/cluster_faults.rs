//! The state store on chains under `kill -9` (issue 15): three real nodes, clients of the official
//! AIO SDK doing SET, fenced SET, GET, DEL and VDEL through the two nodes that stay up, while the
//! head, a middle node and the tail of a chain are killed one at a time at seeded random moments and
//! restarted. Afterwards every acknowledged write is there with its version, no key's version went
//! backwards, and each restarted node is back in every read view (caught up).
//!
//! Each key has one writer, so what it must hold follows from that writer's acknowledged requests.
//! A request that got no answer (its node was busy with a fail-over past the timeout) may or may not
//! have happened, and may still happen until its expiry: its key takes no more writes and is checked
//! against both outcomes. `MQSTATE_FAULT_SEED` replays a schedule.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::SetOptions;
use common::cluster::{chain_of, eventually, settled, start_founders};
use common::free_addr;
use common::sdk::SdkClient;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Clients per surviving node.
const CLIENTS_PER_NODE: usize = 2;
/// Keys each client writes at a time (one of them fenced).
const KEYS_PER_CLIENT: usize = 4;
/// Answers each client must have had after a kill before its node is restarted: the fail-over
/// happened and the chain serves again.
const ANSWERS_AFTER_KILL: u64 = 10;
/// The SDK's request timeout; an answer later than this counts as none.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A key the rounds take their chain from.
const FOCUS: &str = "fault/focus";

type Version = (SystemTime, u64, String);

fn version(v: Option<&HybridLogicalClock>) -> Option<Version> {
    v.map(|v| (v.timestamp, v.counter, v.node_id.clone()))
}

/// What one key must hold, from its one writer's point of view.
#[derive(Debug, Default, Clone)]
struct Model {
    /// The last acknowledged write: the value (`None`: deleted) and, for a SET, its version.
    value: Option<Vec<u8>>,
    set_version: Option<Version>,
    /// Values an unanswered write may have left (`None`: an unanswered delete).
    maybe: Vec<Option<Vec<u8>>>,
    fenced: bool,
}

impl Model {
    fn settled(&self) -> bool {
        self.maybe.is_empty()
    }

    /// A read of the key: `value` with `version` must be what the model allows.
    fn check_read(&self, key: &str, value: Option<&[u8]>, version: Option<Version>) {
        let acknowledged = value == self.value.as_deref();
        let possible = acknowledged || self.maybe.iter().any(|m| m.as_deref() == value);
        assert!(
            possible,
            "{key}: read {value:?}, but the last acknowledged write left {:?} (unanswered: {:?})",
            self.value, self.maybe
        );
        if acknowledged && value.is_some() && self.settled() {
            assert_eq!(
                version, self.set_version,
                "{key}: the acknowledged SET's version"
            );
        }
        if let (Some(read), Some(acked)) = (&version, &self.set_version) {
            if value.is_some() {
                assert!(
                    read >= acked,
                    "{key}: version went backwards: {read:?} < {acked:?}"
                );
            }
        }
    }
}

/// Every client's keys, kept across rounds.
type Models = Arc<Mutex<BTreeMap<String, Model>>>;

struct Load {
    stop: Arc<AtomicBool>,
    answered: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// One client's loop: a random operation on one of its keys, checked against the model.
async fn client_loop(
    client: SdkClient,
    name: String,
    seed: u64,
    models: Models,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut serial = 0u64;
    let mut generation = 0u64;
    let key_of = |slot: usize, generation: u64| format!("fault/{name}/g{generation}/k{slot}");
    let mut keys: Vec<String> = (0..KEYS_PER_CLIENT)
        .map(|s| key_of(s, generation))
        .collect();
    while !stop.load(Ordering::Relaxed) {
        let slot = rng.gen_range(0..KEYS_PER_CLIENT);
        let key = keys[slot].clone();
        let model = models
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_insert_with(|| Model {
                fenced: slot == 0,
                ..Model::default()
            })
            .clone();
        serial += 1;
        let value = format!("{name}-{serial}").into_bytes();
        // Fencing tokens of one client only grow: its counter is the request's serial number.
        let token = model.fenced.then(|| HybridLogicalClock {
            timestamp: SystemTime::now(),
            counter: serial,
            node_id: name.clone(),
        });
        let roll = rng.gen_range(0..100);
        let store = &client.store;
        // (answered, the model after it) — `None` when no answer came.
        let outcome: Option<Model> = if roll < 45 {
            let set = store.set(
                key.clone().into_bytes(),
                value.clone(),
                REQUEST_TIMEOUT,
                token,
                SetOptions::default(),
            );
            match tokio::time::timeout(REQUEST_TIMEOUT * 2, set).await {
                Ok(Ok(reply)) => {
                    assert!(reply.response, "{key}: a plain SET is always applied");
                    let new = version(reply.version.as_ref());
                    if let (Some(new), Some(old)) = (&new, &model.set_version) {
                        assert!(new > old, "{key}: SET version went backwards");
                    }
                    Some(Model {
                        value: Some(value.clone()),
                        set_version: new,
                        ..model.clone()
                    })
                }
                _ => None,
            }
        } else if roll < 65 {
            let del = store.del(key.clone().into_bytes(), token, REQUEST_TIMEOUT);
            match tokio::time::timeout(REQUEST_TIMEOUT * 2, del).await {
                Ok(Ok(reply)) => {
                    let expected = i64::from(model.value.is_some());
                    if model.settled() {
                        assert_eq!(reply.response, expected, "{key}: DEL of {:?}", model.value);
                    }
                    Some(Model {
                        value: None,
                        ..model.clone()
                    })
                }
                _ => None,
            }
        } else if roll < 75 && !model.fenced && model.value.is_some() {
            let current = model.value.clone().unwrap_or_default();
            let vdel = store.vdel(key.clone().into_bytes(), current, None, REQUEST_TIMEOUT);
            match tokio::time::timeout(REQUEST_TIMEOUT * 2, vdel).await {
                Ok(Ok(reply)) => {
                    if model.settled() {
                        assert_eq!(reply.response, 1, "{key}: VDEL of its own value");
                    }
                    Some(Model {
                        value: None,
                        ..model.clone()
                    })
                }
                _ => None,
            }
        } else {
            let get = store.get(key.clone().into_bytes(), REQUEST_TIMEOUT);
            match tokio::time::timeout(REQUEST_TIMEOUT * 2, get).await {
                Ok(Ok(reply)) => {
                    model.check_read(
                        &key,
                        reply.response.as_deref(),
                        version(reply.version.as_ref()),
                    );
                    Some(model.clone())
                }
                _ => None,
            }
        };
        let mut models = models.lock().unwrap();
        match outcome {
            Some(next) => {
                answered.fetch_add(1, Ordering::Relaxed);
                if model.settled() {
                    models.insert(key, next);
                }
            }
            None if roll >= 75 || (roll >= 65 && (model.fenced || model.value.is_none())) => {}
            None => {
                // An unanswered write: it may still happen. The key takes no more writes.
                let entry = models.entry(key).or_default();
                entry.maybe.push(if roll < 45 { Some(value) } else { None });
                generation += 1;
                keys[slot] = key_of(slot, generation);
            }
        }
    }
    client.shutdown().await;
}

fn start_load(
    runtime: &tokio::runtime::Runtime,
    ports: &[u16],
    round: usize,
    rng: &mut StdRng,
    models: &Models,
) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let mut answered = Vec::new();
    let mut tasks = Vec::new();
    for (n, &port) in ports.iter().enumerate() {
        for c in 0..CLIENTS_PER_NODE {
            // The same names every round: a client's keys outlive its connection.
            let name = format!("n{n}c{c}");
            let id = format!("fault-r{round}-{name}");
            let client = runtime.block_on(SdkClient::connect(port, &id));
            let count = Arc::new(AtomicU64::new(0));
            answered.push(Arc::clone(&count));
            tasks.push(runtime.spawn(client_loop(
                client,
                name,
                rng.gen(),
                Arc::clone(models),
                Arc::clone(&stop),
                count,
            )));
        }
    }
    Load {
        stop,
        answered,
        tasks,
    }
}

#[test]
fn acknowledged_writes_survive_kill_9_of_head_middle_and_tail_under_load() {
    let seed: u64 = std::env::var("MQSTATE_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("MQSTATE_FAULT_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr()).collect();
    let mut nodes = start_founders(root.path(), &addrs);
    let all_ports: Vec<u16> = nodes.iter().map(|n| n.server.port()).collect();
    eventually("three nodes settle", || settled(&all_ports, 3));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let models: Models = Arc::default();

    // Head, middle and tail, in a seeded order.
    let mut roles = vec![0usize, 1, 2];
    for i in (1..roles.len()).rev() {
        roles.swap(i, rng.gen_range(0..=i));
    }
    for (round, role) in roles.into_iter().enumerate() {
        let (chain, _) = eventually("the focus key's chain", || {
            chain_of(all_ports[0], FOCUS).filter(|c| c.len() == 3)
        });
        let victim = chain[role];
        let index = nodes.iter().position(|n| n.id == victim).unwrap();
        let survivors: Vec<u16> = nodes
            .iter()
            .filter(|n| n.id != victim)
            .map(|n| n.server.port())
            .collect();
        let load = start_load(&runtime, &survivors, round, &mut rng, &models);
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..1_500)));
        let before: Vec<u64> = load
            .answered
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        nodes[index].server.kill9();
        eprintln!("round {round}: killed node {victim} (position {role} of chain {chain:?})");
        eventually("every client answered again after the kill", || {
            load.answered
                .iter()
                .zip(&before)
                .all(|(a, b)| a.load(Ordering::Relaxed) >= b + ANSWERS_AFTER_KILL)
                .then_some(())
        });
        nodes[index].server.restart();
        // Back in every read view, copied while the load goes on.
        let (_, caught_up) = eventually("the restarted node is caught up everywhere", || {
            settled(&all_ports, 3)
        });
        eprintln!("round {round}: node {victim} back in every read view after {caught_up:?}");
        load.stop.store(true, Ordering::Relaxed);
        for task in load.tasks {
            runtime.block_on(task).expect("a client's checks failed");
        }
    }

    // Every key, read through every node, holds what its acknowledged writes left.
    let models = models.lock().unwrap().clone();
    let written = models.values().filter(|m| m.set_version.is_some()).count();
    assert!(written >= 3, "the load wrote only {written} keys");
    runtime.block_on(async {
        for (n, &port) in all_ports.iter().enumerate() {
            let reader = SdkClient::connect(port, &format!("fault-reader-{n}")).await;
            for (key, model) in &models {
                let got = reader.get(key.as_bytes()).await;
                model.check_read(key, got.response.as_deref(), version(got.version.as_ref()));
            }
            reader.shutdown().await;
        }
    });
    eprintln!(
        "{} keys checked on every node ({written} with an acknowledged SET)",
        models.len()
    );
}
