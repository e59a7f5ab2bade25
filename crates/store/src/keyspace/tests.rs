//! The compact keyspace against a plain `BTreeMap` model, plus the cases worth naming.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn hlc(wall_ms: u64, node: &str) -> Hlc {
    Hlc::new(wall_ms, 7, Arc::from(node))
}

fn put(ks: &mut Keyspace, key: &str, value: &str, expires_at_ms: Option<u64>) {
    let version = hlc(1, "n");
    ks.insert(
        key.as_bytes(),
        NewEntry {
            value: value.as_bytes(),
            version: &version,
            fencing_token: None,
            expires_at_ms,
        },
    );
}

#[test]
fn stored_keys_and_values_do_not_share_the_request_buffer() {
    let request = b"SET some-key some-value".to_vec();
    let mut ks = Keyspace::default();
    let version = hlc(1, "n");
    ks.insert(
        &request[4..12],
        NewEntry {
            value: &request[13..],
            version: &version,
            fencing_token: None,
            expires_at_ms: None,
        },
    );
    let stored = ks.get(b"some-key").unwrap();
    assert_eq!(stored.value(), b"some-value");
    let buffer = request.as_ptr_range();
    assert!(!buffer.contains(&stored.key().as_ptr()));
    assert!(!buffer.contains(&stored.value().as_ptr()));
}

#[test]
fn expiry_index_follows_replacements_and_removals() {
    let mut ks = Keyspace::default();
    put(&mut ks, "a", "1", Some(50));
    put(&mut ks, "b", "22", Some(20));
    put(&mut ks, "c", "333", None);
    assert_eq!(ks.next_deadline(), Some(20));
    assert_eq!(ks.stored_bytes(), 2 + 3 + 4);
    put(&mut ks, "b", "2", Some(70));
    assert_eq!(ks.next_deadline(), Some(50));
    put(&mut ks, "a", "1", Some(50));
    assert_eq!(ks.next_deadline(), Some(50));
    put(&mut ks, "a", "1", None);
    assert_eq!(ks.next_deadline(), Some(70));
    assert_eq!(ks.first_expired(69), None);
    assert_eq!(ks.first_expired(70), Some(&b"b"[..]));
    assert!(ks.remove(b"b"));
    assert_eq!(ks.next_deadline(), None);
    assert_eq!(ks.stored_bytes(), 2 + 4);
    assert!(!ks.remove(b"zz"));
}

#[test]
fn liveness_is_relative_to_now() {
    let mut ks = Keyspace::default();
    put(&mut ks, "a", "1", Some(100));
    assert!(ks.get_live(b"a", 99).is_some());
    assert!(ks.get_live(b"a", 100).is_none());
    assert!(ks.get(b"a").is_some());
}

#[test]
fn iter_after_is_exclusive() {
    let mut ks = Keyspace::default();
    for key in ["a", "b", "c"] {
        put(&mut ks, key, "v", None);
    }
    let keys = |after: Option<&'static [u8]>| -> Vec<Vec<u8>> {
        ks.iter_after(after).map(|e| e.key().to_vec()).collect()
    };
    assert_eq!(keys(Some(b"a")), [b"b", b"c"]);
    assert_eq!(keys(Some(b"bb")), [b"c"]);
    assert_eq!(keys(None).len(), 3);
}

#[test]
fn every_part_of_an_entry_comes_back_whatever_its_node_ids() {
    let long = "L".repeat(MAX_INTERNED_NODE_BYTES + 1);
    let mut ks = Keyspace::default();
    // More distinct node ids than the table interns, one of them too long to intern.
    for i in 0..MAX_INTERNED_NODES + 3 {
        let key = format!("k{i:02}");
        let (version, token) = (hlc(u64::MAX >> 1, &format!("n{i}")), hlc(9, &long));
        ks.insert(
            key.as_bytes(),
            NewEntry {
                value: &[b'x'; 200],
                version: &version,
                fencing_token: Some(&token),
                expires_at_ms: Some(u64::MAX >> 1),
            },
        );
        let e = ks.get(key.as_bytes()).unwrap();
        assert_eq!(e.key(), key.as_bytes());
        assert_eq!(e.value(), &[b'x'; 200][..]);
        assert_eq!(e.version(), version);
        assert_eq!(e.fencing_token(), Some(token));
        assert_eq!(e.expires_at_ms(), Some(u64::MAX >> 1));
    }
    assert_eq!(ks.nodes.0.len(), MAX_INTERNED_NODES);
}

#[test]
fn a_key_of_a_multi_byte_length_orders_by_its_bytes() {
    let mut ks = Keyspace::default();
    let long = "b".repeat(300);
    put(&mut ks, &long, "1", None);
    put(&mut ks, "c", "2", None);
    put(&mut ks, "a", "3", None);
    let keys: Vec<_> = ks.iter().map(|e| e.key().len()).collect();
    assert_eq!(keys, [1, 300, 1]);
    assert_eq!(ks.get(long.as_bytes()).unwrap().value(), b"1");
}

#[test]
fn equal_contents_are_equal_whatever_the_interning_order() {
    let (mut one, mut two) = (Keyspace::default(), Keyspace::default());
    let writes = [("k1", hlc(1, "p")), ("k2", hlc(1, "q"))];
    for (ks, order) in [(&mut one, [0, 1]), (&mut two, [1, 0])] {
        for (key, version) in order.map(|i| &writes[i]) {
            let entry = NewEntry {
                value: b"v",
                version,
                fencing_token: None,
                expires_at_ms: None,
            };
            ks.insert(key.as_bytes(), entry);
        }
    }
    assert_ne!(one.nodes.0, two.nodes.0);
    assert_eq!(one, two);
    put(&mut two, "k1", "v", None);
    assert_ne!(one, two);
}

/// What a key holds in the model.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Model {
    value: Vec<u8>,
    version: Hlc,
    fencing_token: Option<Hlc>,
    expires_at_ms: Option<u64>,
}

#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<u8>, Model),
    Remove(Vec<u8>),
    Get(Vec<u8>),
    IterAfter(Option<Vec<u8>>),
    FirstExpired(u64),
}

fn key() -> impl Strategy<Value = Vec<u8>> {
    // A few short keys so operations hit the same keys, and the odd long one.
    prop_oneof![
        4 => prop::collection::vec(b'a'..b'e', 1..3),
        1 => prop::collection::vec(any::<u8>(), 1..200),
    ]
}

fn node() -> impl Strategy<Value = Hlc> {
    let id = prop_oneof![
        (0..20u8).prop_map(|i| format!("n{i}")),
        Just("L".repeat(MAX_INTERNED_NODE_BYTES + 1)),
        Just(String::new()),
    ];
    (0..u64::MAX >> 1, any::<u32>(), id).prop_map(|(w, c, id)| Hlc::new(w, c, Arc::from(id)))
}

fn op() -> impl Strategy<Value = Op> {
    let model = (
        prop::collection::vec(any::<u8>(), 0..40),
        node(),
        prop::option::of(node()),
        prop::option::of(0..100u64),
    )
        .prop_map(|(value, version, fencing_token, expires_at_ms)| Model {
            value,
            version,
            fencing_token,
            expires_at_ms,
        });
    prop_oneof![
        4 => (key(), model).prop_map(|(k, m)| Op::Insert(k, m)),
        2 => key().prop_map(Op::Remove),
        1 => key().prop_map(Op::Get),
        1 => prop::option::of(key()).prop_map(Op::IterAfter),
        1 => (0..120u64).prop_map(Op::FirstExpired),
    ]
}

fn as_model(e: Entry<'_>) -> (Vec<u8>, Model) {
    let model = Model {
        value: e.value().to_vec(),
        version: e.version(),
        fencing_token: e.fencing_token(),
        expires_at_ms: e.expires_at_ms(),
    };
    (e.key().to_vec(), model)
}

proptest! {
    #[test]
    fn behaves_like_a_btreemap(ops in prop::collection::vec(op(), 0..120)) {
        let mut ks = Keyspace::default();
        let mut model: BTreeMap<Vec<u8>, Model> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Insert(key, m) => {
                    ks.insert(&key, NewEntry {
                        value: &m.value,
                        version: &m.version,
                        fencing_token: m.fencing_token.as_ref(),
                        expires_at_ms: m.expires_at_ms,
                    });
                    model.insert(key, m);
                }
                Op::Remove(key) => prop_assert_eq!(ks.remove(&key), model.remove(&key).is_some()),
                Op::Get(key) => prop_assert_eq!(
                    ks.get(&key).map(as_model),
                    model.get(&key).map(|m| (key.clone(), m.clone()))
                ),
                Op::IterAfter(after) => {
                    let start = after.as_ref().map_or(Bound::Unbounded, |a| Bound::Excluded(a.clone()));
                    let expected: Vec<_> = model
                        .range((start, Bound::Unbounded))
                        .map(|(k, m)| (k.clone(), m.clone()))
                        .collect();
                    let got: Vec<_> = ks.iter_after(after.as_deref()).map(as_model).collect();
                    prop_assert_eq!(got, expected);
                }
                Op::FirstExpired(now) => {
                    let first = model
                        .iter()
                        .filter_map(|(k, m)| Some((m.expires_at_ms?, k)))
                        .min();
                    prop_assert_eq!(ks.next_deadline(), first.map(|(d, _)| d));
                    let expected = first.filter(|(d, _)| *d <= now).map(|(_, k)| k.as_slice());
                    prop_assert_eq!(ks.first_expired(now), expected);
                }
            }
            prop_assert_eq!(ks.len(), model.len());
            let bytes: u64 = model.iter().map(|(k, m)| entry_bytes(k, &m.value)).sum();
            prop_assert_eq!(ks.stored_bytes(), bytes);
        }
        let all: Vec<_> = ks.iter().map(as_model).collect();
        prop_assert_eq!(all, model.clone().into_iter().collect::<Vec<_>>());

        let mut builder = AscendingBuilder::with_capacity(model.len());
        for (key, m) in &model {
            builder.push(key, NewEntry {
                value: &m.value,
                version: &m.version,
                fencing_token: m.fencing_token.as_ref(),
                expires_at_ms: m.expires_at_ms,
            });
        }
        let built = builder.finish();
        prop_assert_eq!(&built, &ks);
        prop_assert_eq!(built.next_deadline(), ks.next_deadline());
    }
}
