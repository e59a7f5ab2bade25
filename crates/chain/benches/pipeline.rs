//! The protocol's own CPU cost per write: a chain of 1 or 3 replicas in one thread, a batch of writes
//! to distinct keys (64-byte values) driven to completion, every persist reported durable at once and
//! every message delivered at once. No disk and no network: what is left is the state machines'
//! work (and its allocations), the floor under a node's per-write cost.
//!
//! `cargo bench -p mqstate-chain --bench pipeline`

use std::collections::VecDeque;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use mqstate_chain::{
    Answer, Config, Expect, Message, NodeId, Output, Replica, Version, View, Write,
};

const BATCH: u64 = 256;

fn chain(len: u64) -> Vec<Replica> {
    let ids: Vec<NodeId> = (1..=len).collect();
    let view = View {
        id: 1,
        chain: ids.clone(),
        read_view: ids.clone(),
    };
    ids.iter()
        .map(|&id| {
            let mut r = Replica::new(id, Config::default());
            r.set_view(Some(view.clone()));
            r
        })
        .collect()
}

/// Submits a batch at the head and runs every replica until all writes are answered.
fn run(replicas: &mut [Replica], round: u64) -> u64 {
    let value = vec![7u8; 64];
    for i in 0..BATCH {
        replicas[0].write(
            i,
            Write {
                key: format!("key:{i:06}").into_bytes(),
                value: Some(value.clone()),
                version: Version {
                    wall_ms: round + 1,
                    counter: 0,
                    node: 1,
                },
                expect: Expect::Any,
            },
        );
    }
    let mut answered = 0;
    let mut work: VecDeque<usize> = (0..replicas.len()).collect();
    let mut inbox: Vec<Vec<Message>> = vec![Vec::new(); replicas.len()];
    while let Some(at) = work.pop_front() {
        for message in std::mem::take(&mut inbox[at]) {
            replicas[at].receive(message);
        }
        for output in replicas[at].take_outputs() {
            match output {
                Output::Persist { index, .. } => {
                    replicas[at].durable(index);
                    work.push_back(at);
                }
                Output::Send { to, message } => {
                    let to = (to - 1) as usize;
                    inbox[to].push(message);
                    work.push_back(to);
                }
                Output::Reply { answer, .. } => {
                    debug_assert!(matches!(answer, Answer::Written { .. }));
                    answered += 1;
                }
                Output::CaughtUp { .. } => {}
            }
        }
    }
    answered
}

fn pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("chain");
    group.throughput(Throughput::Elements(BATCH));
    for len in [1, 3] {
        let mut round = 0;
        group.bench_function(format!("{BATCH} writes, chain of {len}"), |b| {
            b.iter_batched_ref(
                || chain(len),
                |replicas| {
                    round += 1;
                    let answered = run(replicas, round);
                    assert_eq!(answered, BATCH);
                    black_box(answered)
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
