//! The state machine's hot paths over a keyspace of 100,000 keys (16-byte keys, 100-byte values, as
//! the memory bench): SET over an existing key, GET hit, and decoding a snapshot (the restart path).
//! Written against `StateMachine`'s command API so it measures any keyspace representation.
//!
//! `cargo bench -p mqstate-store --bench machine`

use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use mqstate_protocol::{Command, Hlc, SetCondition};
use mqstate_store::{Limits, RequestContext, StateMachine, StoreConfig};

const KEYS: u64 = 100_000;
const T0: u64 = 1_700_000_000_000;

fn config() -> StoreConfig {
    StoreConfig {
        node_id: Arc::from("StateStore"),
        limits: Limits::default(),
    }
}

fn key(i: u64) -> Bytes {
    Bytes::from(format!("bench:{:010}", i % KEYS))
}

fn ctx(now_ms: u64) -> RequestContext {
    RequestContext {
        client_id: Arc::from("bench"),
        ts: Some(Hlc::new(now_ms, 0, Arc::from("client"))),
        fencing_token: None,
        now_ms,
    }
}

fn set(i: u64, value: &Bytes) -> Command {
    Command::Set {
        key: key(i),
        value: value.clone(),
        condition: SetCondition::Always,
        expiry_ms: None,
    }
}

fn loaded() -> StateMachine {
    let mut m = StateMachine::new(config()).expect("valid config");
    let value = Bytes::from(vec![b'v'; 100]);
    for i in 0..KEYS {
        m.execute(set(i, &value), &ctx(T0 + i));
    }
    m
}

fn machine(c: &mut Criterion) {
    let mut m = loaded();
    let value = Bytes::from(vec![b'w'; 100]);
    let mut i = 0u64;
    c.bench_function("set_existing_key", |b| {
        b.iter(|| {
            i += 7919;
            black_box(m.execute(set(i, &value), &ctx(T0 + KEYS + i)))
        })
    });
    c.bench_function("get_hit", |b| {
        b.iter(|| {
            i += 7919;
            black_box(m.execute(Command::Get { key: key(i) }, &ctx(T0 + KEYS + i)))
        })
    });
    let snapshot = m.snapshot_encode().expect("encodes");
    let mut group = c.benchmark_group("snapshot");
    group.sample_size(10);
    group.bench_function("decode_100k_keys", |b| {
        b.iter_batched(
            config,
            |config| black_box(StateMachine::snapshot_decode(&snapshot, config)),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("encode_100k_keys", |b| {
        b.iter(|| black_box(m.snapshot_encode()))
    });
    group.finish();
}

criterion_group!(benches, machine);
criterion_main!(benches);
