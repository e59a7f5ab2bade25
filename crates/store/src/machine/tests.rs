//! Spec tables (§3, §5, §6) row by row, plus replay determinism and snapshot round trips.

use super::*;
use proptest::prelude::*;

const NODE: &str = "StateStore";
const T0: u64 = 1_700_000_000_000;

fn hlc(wall_ms: u64, counter: u32, node: &str) -> Hlc {
    Hlc::new(wall_ms, counter, Arc::from(node))
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn config(limits: Limits) -> StoreConfig {
    StoreConfig {
        node_id: Arc::from(NODE),
        limits,
    }
}

fn machine() -> StateMachine {
    StateMachine::new(config(Limits::default())).unwrap()
}

fn ctx(client: &str, now_ms: u64) -> RequestContext {
    RequestContext {
        client_id: Arc::from(client),
        ts: Some(hlc(now_ms, 0, "client")),
        fencing_token: None,
        now_ms,
    }
}

fn run(m: &mut StateMachine, words: &[&str], ctx: &RequestContext) -> Execution {
    let command = Command::parse(words.iter().map(|w| b(w)).collect()).unwrap();
    m.execute(command, ctx)
}

fn set(key: &str, value: &str) -> Command {
    Command::Set {
        key: b(key),
        value: b(value),
        condition: SetCondition::Always,
        expiry_ms: None,
    }
}

#[test]
fn set_then_get_returns_the_same_version() {
    let mut m = machine();
    let c = ctx("c1", T0);
    let put = m.execute(set("k", "v"), &c);
    assert_eq!(put.reply, Reply::Ok);
    let version = put.ts.clone().unwrap();
    assert!(version > *c.ts.as_ref().unwrap());
    assert_eq!(version.node_id.as_ref(), NODE);
    assert!(matches!(put.delta, Some(Delta::Put { .. })));
    let get = run(&mut m, &["GET", "k"], &c);
    assert_eq!(get.reply, Reply::Bulk(b("v")));
    assert_eq!(get.ts, Some(version));
    assert_eq!(get.delta, None);
}

#[test]
fn get_miss_has_no_timestamp() {
    let mut m = machine();
    let get = run(&mut m, &["GET", "nope"], &ctx("c", T0));
    assert_eq!((get.reply, get.ts), (Reply::Nil, None));
}

#[test]
fn empty_and_large_values_round_trip() {
    let mut m = machine();
    let c = ctx("c", T0);
    m.execute(set("empty", ""), &c);
    assert_eq!(
        run(&mut m, &["GET", "empty"], &c).reply,
        Reply::Bulk(Bytes::new())
    );
    let key = "k".repeat(6_500);
    let value = "v".repeat(65_000);
    assert_eq!(m.execute(set(&key, &value), &c).reply, Reply::Ok);
    assert_eq!(
        run(&mut m, &["GET", &key], &c).reply,
        Reply::Bulk(b(&value))
    );
}

#[test]
fn versions_exceed_request_ts_and_previous_version() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    c.ts = Some(hlc(T0 + 30_000, 7, "zzz"));
    let first = m.execute(set("k", "1"), &c).ts.unwrap();
    assert_eq!((first.wall_ms, first.counter), (T0 + 30_000, 8));
    c.ts = Some(hlc(T0 - 5_000, 0, "a"));
    let second = m.execute(set("k", "2"), &c).ts.unwrap();
    assert!(second > first);
}

#[test]
fn set_conditions() {
    let mut m = machine();
    let c = ctx("c", T0);
    assert_eq!(run(&mut m, &["SET", "k", "v", "NX"], &c).reply, Reply::Ok);
    let refused = run(&mut m, &["SET", "k", "w", "NX"], &c);
    assert_eq!(refused.reply, Reply::Integer(-1));
    assert!(
        refused.ts.is_some(),
        "a SET that is not applied still carries __ts"
    );
    assert_eq!(refused.delta, None);
    assert_eq!(run(&mut m, &["SET", "k", "v", "NEX"], &c).reply, Reply::Ok);
    assert_eq!(
        run(&mut m, &["SET", "k", "w", "NEX"], &c).reply,
        Reply::Integer(-1)
    );
    assert_eq!(
        run(&mut m, &["SET", "new", "w", "NEX"], &c).reply,
        Reply::Ok
    );
    assert_eq!(run(&mut m, &["GET", "k"], &c).reply, Reply::Bulk(b("v")));
}

#[test]
fn del_and_vdel() {
    let mut m = machine();
    let c = ctx("c", T0);
    m.execute(set("k", "v"), &c);
    assert_eq!(
        run(&mut m, &["VDEL", "k", "other"], &c).reply,
        Reply::Integer(-1)
    );
    assert_eq!(
        run(&mut m, &["VDEL", "missing", "v"], &c).reply,
        Reply::Integer(0)
    );
    let vdel = run(&mut m, &["VDEL", "k", "v"], &c);
    assert_eq!(vdel.reply, Reply::Integer(1));
    assert!(matches!(vdel.delta, Some(Delta::Delete { .. })));
    assert_eq!(run(&mut m, &["DEL", "k"], &c).reply, Reply::Integer(0));
    m.execute(set("k", "v"), &c);
    let del = run(&mut m, &["DEL", "k"], &c);
    assert_eq!((del.reply, del.ts), (Reply::Integer(1), None));
    assert_eq!(run(&mut m, &["GET", "k"], &c).reply, Reply::Nil);
}

#[test]
fn timestamp_errors() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    c.ts = None;
    assert_eq!(
        m.execute(set("k", "v"), &c).reply,
        Reply::Error(ErrorKind::MissingTimestamp)
    );
    // Only SET requires __ts.
    assert_eq!(run(&mut m, &["GET", "k"], &c).reply, Reply::Nil);
    c.ts = Some(hlc(T0 + 60_001, 0, "c"));
    let err = m.execute(set("k", "v"), &c);
    assert_eq!(err.reply, Reply::Error(ErrorKind::TimestampTooFarInFuture));
    assert_eq!((err.ts, err.delta), (None, None));
    assert_eq!(
        run(&mut m, &["GET", "k"], &c).reply,
        Reply::Error(ErrorKind::TimestampTooFarInFuture)
    );
    c.ts = Some(hlc(T0 + 60_000, 0, "c"));
    assert_eq!(m.execute(set("k", "v"), &c).reply, Reply::Ok);
    c.ts = Some(hlc(0, 0, "c"));
    assert_eq!(
        m.execute(set("k", "v"), &c).reply,
        Reply::Ok,
        "any past time is accepted"
    );
}

#[test]
fn fencing_matrix() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    let token = hlc(T0, 5, "lock");
    // 1. Unfenced key + token: applied, token stored.
    c.fencing_token = Some(token.clone());
    assert_eq!(m.execute(set("k", "1"), &c).reply, Reply::Ok);
    assert_eq!(
        m.keyspace().get(b"k").unwrap().fencing_token(),
        Some(token.clone())
    );
    // 2a. No token.
    c.fencing_token = None;
    for words in [&["SET", "k", "2"][..], &["DEL", "k"], &["VDEL", "k", "1"]] {
        assert_eq!(
            run(&mut m, words, &c).reply,
            Reply::Error(ErrorKind::FencingTokenRequired)
        );
    }
    // 2b. Older token.
    c.fencing_token = Some(hlc(T0, 4, "lock"));
    for words in [&["SET", "k", "2"][..], &["DEL", "k"], &["VDEL", "k", "1"]] {
        assert_eq!(
            run(&mut m, words, &c).reply,
            Reply::Error(ErrorKind::FencingTokenLowerVersion)
        );
    }
    // Reads never need a token.
    c.fencing_token = None;
    assert_eq!(run(&mut m, &["GET", "k"], &c).reply, Reply::Bulk(b("1")));
    // 2c. Equal, then newer: applied; the newer one is stored.
    c.fencing_token = Some(token.clone());
    assert_eq!(m.execute(set("k", "2"), &c).reply, Reply::Ok);
    assert_eq!(
        m.keyspace().get(b"k").unwrap().fencing_token(),
        Some(token.clone())
    );
    let newer = hlc(T0, 9, "lock");
    c.fencing_token = Some(newer.clone());
    assert_eq!(m.execute(set("k", "3"), &c).reply, Reply::Ok);
    assert_eq!(
        m.keyspace().get(b"k").unwrap().fencing_token(),
        Some(newer.clone())
    );
    c.fencing_token = Some(token);
    assert_eq!(
        m.execute(set("k", "4"), &c).reply,
        Reply::Error(ErrorKind::FencingTokenLowerVersion)
    );
    // 3. Delete removes the token with the key.
    c.fencing_token = Some(newer);
    assert_eq!(run(&mut m, &["DEL", "k"], &c).reply, Reply::Integer(1));
    c.fencing_token = None;
    assert_eq!(m.execute(set("k", "5"), &c).reply, Reply::Ok);
    // Future fencing tokens are refused, on writes only.
    c.fencing_token = Some(hlc(T0 + 60_001, 0, "lock"));
    assert_eq!(
        m.execute(set("k", "6"), &c).reply,
        Reply::Error(ErrorKind::FencingTokenTooFarInFuture)
    );
    assert_eq!(run(&mut m, &["GET", "k"], &c).reply, Reply::Bulk(b("5")));
}

#[test]
fn fencing_is_checked_before_conditions_and_missing_keys_need_none() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    c.fencing_token = Some(hlc(T0, 1, "lock"));
    m.execute(set("k", "v"), &c);
    c.fencing_token = None;
    assert_eq!(
        run(&mut m, &["SET", "k", "v", "NX"], &c).reply,
        Reply::Error(ErrorKind::FencingTokenRequired)
    );
    assert_eq!(
        run(&mut m, &["VDEL", "k", "other"], &c).reply,
        Reply::Error(ErrorKind::FencingTokenRequired)
    );
    assert_eq!(
        run(&mut m, &["DEL", "missing"], &c).reply,
        Reply::Integer(0)
    );
}

#[test]
fn lock_pattern_renewal() {
    let mut m = machine();
    let c1 = ctx("c1", T0);
    let acquired = run(
        &mut m,
        &["SET", "lock", "client1", "NEX", "PX", "10000"],
        &c1,
    );
    assert_eq!(acquired.reply, Reply::Ok);
    let c2 = ctx("c2", T0 + 1);
    assert_eq!(
        run(
            &mut m,
            &["SET", "lock", "client2", "NEX", "PX", "10000"],
            &c2
        )
        .reply,
        Reply::Integer(-1)
    );
    let c1 = ctx("c1", T0 + 2);
    let renewed = run(
        &mut m,
        &["SET", "lock", "client1", "NEX", "PX", "10000"],
        &c1,
    );
    assert_eq!(renewed.reply, Reply::Ok);
    assert!(renewed.ts.unwrap() > acquired.ts.unwrap());
    // After expiry another client acquires it.
    let c2 = ctx("c2", T0 + 2 + 10_000);
    assert_eq!(
        run(
            &mut m,
            &["SET", "lock", "client2", "NEX", "PX", "10000"],
            &c2
        )
        .reply,
        Reply::Ok
    );
}

#[test]
fn expired_keys_are_absent_before_reaping() {
    let mut m = machine();
    let c = ctx("c", T0);
    let put = run(&mut m, &["SET", "k", "v", "PX", "1000"], &c);
    assert!(matches!(put.delta, Some(Delta::Put { expires_at_ms: Some(d), .. }) if d == T0 + 1000));
    assert_eq!(m.next_deadline(), Some(T0 + 1000));
    let before = ctx("c", T0 + 999);
    assert_eq!(
        run(&mut m, &["GET", "k"], &before).reply,
        Reply::Bulk(b("v"))
    );
    let after = ctx("c", T0 + 1000);
    assert_eq!(run(&mut m, &["GET", "k"], &after).reply, Reply::Nil);
    assert_eq!(run(&mut m, &["DEL", "k"], &after).reply, Reply::Integer(0));
    assert_eq!(
        run(&mut m, &["VDEL", "k", "v"], &after).reply,
        Reply::Integer(0)
    );
    assert_eq!(
        run(&mut m, &["SCAN", "*"], &after).reply,
        Reply::Keys {
            keys: vec![],
            continuation: None
        }
    );
    assert_eq!(
        run(&mut m, &["SET", "k", "w", "NX"], &after).reply,
        Reply::Ok
    );
    assert_eq!(
        m.next_deadline(),
        None,
        "SET without PX clears the deadline"
    );
}

#[test]
fn expiry_deletes_with_fresh_versions_and_notifies() {
    let mut m = machine();
    let c = ctx("watcher", T0);
    run(&mut m, &["KEYNOTIFY", "a"], &c);
    let put = run(&mut m, &["SET", "a", "v", "PX", "10"], &c);
    run(&mut m, &["SET", "b", "v", "PX", "20"], &c);
    run(&mut m, &["SET", "c", "v", "PX", "30"], &c);
    assert!(m.expire_due(T0 + 9).is_empty());
    let expired = m.expire_due(T0 + 20);
    assert_eq!(expired.len(), 2);
    let Delta::Delete { key, version } = &expired[0].delta else {
        panic!("expected a delete")
    };
    assert_eq!(key, &b("a"));
    assert!(*version > put.ts.unwrap());
    assert_eq!(
        expired[0].notifications,
        vec![KeyNotification {
            client_id: Arc::from("watcher"),
            key: b("a"),
            payload: NotifyPayload::Delete,
            version: version.clone(),
        }]
    );
    assert!(expired[1].notifications.is_empty());
    assert_eq!(m.keyspace().len(), 1);
    assert_eq!(m.next_deadline(), Some(T0 + 30));
}

#[test]
fn expiry_is_batched() {
    let mut m = StateMachine::new(config(Limits {
        expire_batch_max: 2,
        ..Limits::default()
    }))
    .unwrap();
    let c = ctx("c", T0);
    for k in ["a", "b", "c"] {
        run(&mut m, &["SET", k, "v", "PX", "1"], &c);
    }
    assert_eq!(m.expire_due(T0 + 1).len(), 2);
    assert_eq!(m.next_deadline(), Some(T0 + 1));
    assert_eq!(m.expire_due(T0 + 1).len(), 1);
    assert_eq!(m.next_deadline(), None);
}

#[test]
fn notifications_follow_applied_changes_only() {
    let mut m = machine();
    let watcher = ctx("watcher", T0);
    let writer = ctx("writer", T0);
    assert_eq!(run(&mut m, &["KEYNOTIFY", "k"], &watcher).reply, Reply::Ok);
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "k"], &watcher).reply,
        Reply::Ok,
        "re-registering is fine"
    );
    assert_eq!(run(&mut m, &["KEYNOTIFY", "k"], &writer).reply, Reply::Ok);
    let put = m.execute(set("k", "v"), &writer);
    let version = put.ts.clone().unwrap();
    let expected: Vec<_> = ["watcher", "writer"]
        .into_iter()
        .map(|client| KeyNotification {
            client_id: Arc::from(client),
            key: b("k"),
            payload: NotifyPayload::Set(b("v")),
            version: version.clone(),
        })
        .collect();
    assert_eq!(
        put.notifications, expected,
        "the writer's own registration counts"
    );
    for words in [
        &["SET", "k", "x", "NX"][..],
        &["VDEL", "k", "x"],
        &["DEL", "other"],
        &["GET", "k"],
    ] {
        assert!(
            run(&mut m, words, &writer).notifications.is_empty(),
            "{words:?}"
        );
    }
    let del = run(&mut m, &["DEL", "k"], &writer);
    let Some(Delta::Delete { version, .. }) = &del.delta else {
        panic!("expected a delete")
    };
    assert_eq!(del.notifications.len(), 2);
    assert!(del
        .notifications
        .iter()
        .all(|n| n.payload == NotifyPayload::Delete && n.version == *version));
    assert!(run(&mut m, &["DEL", "k"], &writer).notifications.is_empty());
}

#[test]
fn keynotify_stop_and_drop_client() {
    let mut m = machine();
    let c = ctx("c", T0);
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "k", "STOP"], &c).reply,
        Reply::Integer(0)
    );
    run(&mut m, &["KEYNOTIFY", "k"], &c);
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "k", "STOP"], &c).reply,
        Reply::Ok
    );
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "k", "STOP"], &c).reply,
        Reply::Integer(0)
    );
    run(&mut m, &["KEYNOTIFY", "a"], &c);
    run(&mut m, &["KEYNOTIFY", "b"], &c);
    assert_eq!(m.registration_count("c"), 2);
    assert_eq!(m.drop_client("c"), 2);
    assert!(m.execute(set("a", "v"), &c).notifications.is_empty());
}

#[test]
fn registration_quota() {
    let mut m = StateMachine::new(config(Limits {
        max_registrations_per_client: 1,
        ..Limits::default()
    }))
    .unwrap();
    let c = ctx("c", T0);
    assert_eq!(run(&mut m, &["KEYNOTIFY", "a"], &c).reply, Reply::Ok);
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "b"], &c).reply,
        Reply::Error(ErrorKind::QuotaExceeded)
    );
    assert_eq!(
        run(&mut m, &["KEYNOTIFY", "b"], &ctx("other", T0)).reply,
        Reply::Ok
    );
}

#[test]
fn quotas_have_no_partial_effects() {
    let limits = Limits {
        max_keys: 2,
        max_total_bytes: 9,
        max_key_bytes: 3,
        max_value_bytes: 4,
        ..Limits::default()
    };
    let mut m = StateMachine::new(config(limits)).unwrap();
    let c = ctx("c", T0);
    run(&mut m, &["KEYNOTIFY", "kkkk"], &c);
    let quota = Reply::Error(ErrorKind::QuotaExceeded);
    assert_eq!(m.execute(set("kkkk", "v"), &c).reply, quota, "key too long");
    assert_eq!(
        m.execute(set("k", "vvvvv"), &c).reply,
        quota,
        "value too long"
    );
    assert_eq!(m.execute(set("a", "1234"), &c).reply, Reply::Ok);
    assert_eq!(m.execute(set("b", "12"), &c).reply, Reply::Ok);
    let before = m.keyspace().clone();
    let refused = m.execute(set("c", "1"), &c);
    assert_eq!(
        (refused.reply, refused.delta, refused.notifications.len()),
        (quota.clone(), None, 0),
        "key count"
    );
    assert_eq!(m.execute(set("b", "1234"), &c).reply, quota, "total bytes");
    assert_eq!(*m.keyspace(), before);
    // Replacing within the budget is fine, and deleting frees room.
    assert_eq!(m.execute(set("b", "123"), &c).reply, Reply::Ok);
    run(&mut m, &["DEL", "a"], &c);
    assert_eq!(m.execute(set("c", "1"), &c).reply, Reply::Ok);
}

#[test]
fn scan_pages_without_resurrecting_deleted_keys() {
    let mut m = StateMachine::new(config(Limits {
        scan_page_keys: 3,
        ..Limits::default()
    }))
    .unwrap();
    let c = ctx("c", T0);
    for i in 0..10 {
        m.execute(set(&format!("key{i}"), "v"), &c);
    }
    m.execute(set("other", "v"), &c);
    let mut seen = Vec::new();
    let mut token: Option<Bytes> = None;
    let mut pages = 0;
    loop {
        pages += 1;
        let command = Command::Scan {
            pattern: b("key*"),
            continuation: token.clone(),
        };
        let Reply::Keys { keys, continuation } = m.execute(command, &c).reply else {
            panic!("expected keys")
        };
        seen.extend(keys);
        if pages == 1 {
            // Deleted between pages: must not come back; key0 was already returned.
            run(&mut m, &["DEL", "key5"], &c);
            run(&mut m, &["DEL", "key0"], &c);
        }
        match continuation {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    let expected: Vec<Bytes> = [0, 1, 2, 3, 4, 6, 7, 8, 9]
        .iter()
        .map(|i| b(&format!("key{i}")))
        .collect();
    assert_eq!(seen, expected);
    // The last key page is followed by one empty page, as `other` sorts after `key9`.
    assert_eq!(pages, 4);
}

#[test]
fn scan_hundred_keys_within_page_budget_and_bounded_work() {
    let mut m = machine();
    let c = ctx("c", T0);
    for i in 0..100 {
        m.execute(set(&format!("k{i:03}"), "v"), &c);
    }
    let (mut pages, mut total, mut token) = (0, 0, None);
    loop {
        pages += 1;
        let Reply::Keys { keys, continuation } = m
            .execute(
                Command::Scan {
                    pattern: b("*"),
                    continuation: token,
                },
                &c,
            )
            .reply
        else {
            panic!("expected keys")
        };
        total += keys.len();
        token = continuation;
        if token.is_none() {
            break;
        }
    }
    assert_eq!((total, pages), (100, 2));
    let mut bounded = StateMachine::new(config(Limits {
        scan_visit_max: 10,
        ..Limits::default()
    }))
    .unwrap();
    for i in 0..25 {
        bounded.execute(set(&format!("k{i:03}"), "v"), &c);
    }
    let Reply::Keys { keys, continuation } = run(&mut bounded, &["SCAN", "nomatch*"], &c).reply
    else {
        panic!()
    };
    assert_eq!((keys.len(), continuation), (0, Some(b("k009"))));
}

#[test]
fn scan_pattern_errors() {
    let mut m = machine();
    let c = ctx("c", T0);
    assert_eq!(
        run(&mut m, &["SCAN", "a**b"], &c).reply,
        Reply::Error(ErrorKind::SyntaxError)
    );
    let long = "a".repeat(Limits::default().scan_pattern_bytes_max + 1);
    assert_eq!(
        run(&mut m, &["SCAN", &long], &c).reply,
        Reply::Error(ErrorKind::SyntaxError)
    );
}

#[test]
fn clock_never_goes_back_when_wall_clock_steps_back() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    let first = m.execute(set("k", "1"), &c).ts.unwrap();
    c.now_ms = T0 - 100_000;
    c.ts = Some(hlc(T0 - 100_000, 0, "c"));
    let second = m.execute(set("k", "2"), &c).ts.unwrap();
    assert!(second > first);
    assert_eq!(second.wall_ms, first.wall_ms);
}

#[test]
fn snapshot_round_trip_restores_keys_and_clock() {
    let mut m = machine();
    let mut c = ctx("c", T0);
    c.fencing_token = Some(hlc(T0, 0, "lock"));
    m.execute(set("fenced", "v"), &c);
    c.fencing_token = None;
    run(&mut m, &["SET", "ttl", "v", "PX", "5000"], &c);
    let last = m.execute(set("plain", ""), &c).ts.unwrap();
    let bytes = m.snapshot_encode().unwrap();
    let mut restored = StateMachine::snapshot_decode(&bytes, config(Limits::default())).unwrap();
    assert_eq!(restored.keyspace(), m.keyspace());
    assert_eq!(restored.snapshot_encode().unwrap(), bytes);
    assert!(
        restored.clock.now(0) > last,
        "restored clock continues after the high-water mark"
    );
    for cut in 0..bytes.len() {
        assert!(StateMachine::snapshot_decode(&bytes[..cut], config(Limits::default())).is_err());
    }
}

#[test]
fn golden_empty_snapshot_and_bad_snapshots() {
    let m = machine();
    let bytes = m.snapshot_encode().unwrap();
    let mut expected = vec![b'S', 0, 0, 0, 4];
    expected.extend_from_slice(&[0; 8]);
    expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 10]);
    expected.extend_from_slice(NODE.as_bytes());
    expected.extend_from_slice(&[0, 0, 0, 0]); // no topics
    expected.extend_from_slice(&[0, 0, 0, 0]); // no keys
    expected.extend_from_slice(&[0, 0, 0, 0]); // no requests
    assert_eq!(bytes, expected);
    // Format version 2 (before requests) and 1 (before topics) are still read.
    let mut v2 = bytes.clone();
    v2[4] = 2;
    v2.truncate(bytes.len() - 4);
    assert!(StateMachine::snapshot_decode(&v2, config(Limits::default())).is_ok());
    let mut v1 = v2.clone();
    v1[4] = 1;
    v1.drain(v2.len() - 8..v2.len() - 4);
    assert!(StateMachine::snapshot_decode(&v1, config(Limits::default())).is_ok());
    // One request after the keys, read back.
    let id = crate::RequestId::of("c", b"\x01");
    let request = crate::RequestRecord {
        id,
        expires_at_ms: 9,
        reply: Bytes::from_static(b":1\r\n"),
        reply_ts: None,
    };
    let with_request = crate::SnapshotEncoder::new(&m)
        .unwrap()
        .finish(&m, std::slice::from_ref(&request))
        .unwrap();
    let mut expected_request = bytes[..bytes.len() - 4].to_vec();
    expected_request.extend_from_slice(&[0, 0, 0, 1]);
    expected_request.extend_from_slice(&id.0);
    expected_request.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 9]);
    expected_request.push(2); // `:1`
    expected_request.push(0); // no `__ts`
    assert_eq!(with_request, expected_request);
    let (_, requests) =
        StateMachine::snapshot_decode_with_requests(&with_request, config(Limits::default()))
            .unwrap();
    assert_eq!(requests, vec![request.clone()]);
    // Format version 3 spelled out the client id and correlation data: read, its id computed.
    let mut v3 = bytes[..bytes.len() - 4].to_vec();
    v3[4] = 3;
    v3.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, b'c', 0, 0, 0, 1, 1]);
    v3.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 4]);
    v3.extend_from_slice(b":1\r\n");
    v3.push(0);
    let (_, requests) =
        StateMachine::snapshot_decode_with_requests(&v3, config(Limits::default())).unwrap();
    assert_eq!(requests, vec![request]);
    // Duplicate keys are rejected.
    let mut two = machine();
    two.execute(set("a", "1"), &ctx("c", T0));
    let one = two.snapshot_encode().unwrap();
    let header_len = 1 + 4 + 8 + 4 + 4 + NODE.len() + 4;
    let entry = one[header_len + 4..one.len() - 4].to_vec();
    let mut dup = one[..header_len].to_vec();
    dup.extend_from_slice(&2i32.to_be_bytes());
    dup.extend_from_slice(&entry);
    dup.extend_from_slice(&entry);
    dup.extend_from_slice(&[0, 0, 0, 0]);
    assert!(matches!(
        StateMachine::snapshot_decode(&dup, config(Limits::default())),
        Err(StoreError::Invalid {
            reason: "keys must be strictly ascending",
            ..
        })
    ));
    let mut wrong_version = bytes.clone();
    wrong_version[4] = 5;
    assert!(StateMachine::snapshot_decode(&wrong_version, config(Limits::default())).is_err());
}

fn op() -> impl Strategy<Value = (u8, u8, u8, u16)> {
    (0..6u8, 0..4u8, 0..3u8, 0..200u16)
}

proptest! {
    #[test]
    fn replaying_deltas_reproduces_state(ops in prop::collection::vec(op(), 1..60)) {
        let mut live = machine();
        let mut deltas = Vec::new();
        let mut now = T0;
        for (kind, key, value, step) in ops {
            now += u64::from(step);
            let c = ctx("c", now);
            let (key, value) = (b(&format!("k{key}")), b(&format!("v{value}")));
            let command = match kind {
                0 => Command::Set { key, value, condition: SetCondition::Always, expiry_ms: None },
                1 => Command::Set { key, value, condition: SetCondition::NotExistsOrEqual, expiry_ms: Some(100) },
                2 => Command::Set { key, value, condition: SetCondition::NotExists, expiry_ms: None },
                3 => Command::Del { key },
                4 => Command::VDel { key, value },
                _ => {
                    deltas.extend(live.expire_due(now).into_iter().map(|e| e.delta));
                    continue;
                }
            };
            deltas.extend(live.execute(command, &c).delta);
        }
        let mut replayed = machine();
        for delta in &deltas {
            let decoded = Delta::decode(&delta.encode().unwrap()).unwrap();
            replayed.apply_delta(&decoded);
        }
        prop_assert_eq!(replayed.keyspace(), live.keyspace());
        // Observed `__ts` values leave no delta, so the replayed clock may trail the live one, but it
        // is past every version, which is what later writes need.
        prop_assert!(replayed.clock.high_water() <= live.clock.high_water());
        for entry in replayed.keyspace().iter() {
            let version = entry.version();
            prop_assert!((replayed.clock.high_water().wall_ms, replayed.clock.high_water().counter)
                >= (version.wall_ms, version.counter));
        }
        let snapshot = live.snapshot_encode().unwrap();
        let restored = StateMachine::snapshot_decode(&snapshot, config(Limits::default())).unwrap();
        prop_assert_eq!(restored.keyspace(), live.keyspace());
    }

    /// What a failed commit does: every write after the last durable one is undone, newest first,
    /// which leaves the keyspace as it was at that point, expired-but-unreaped keys included.
    #[test]
    fn undoing_writes_newest_first_restores_the_keyspace(
        ops in prop::collection::vec(op(), 1..60),
        durable in 0..60usize,
    ) {
        let mut m = machine();
        let mut undos = Vec::new();
        let mut at_durable = None;
        let mut now = T0;
        for (i, (kind, key, value, step)) in ops.into_iter().enumerate() {
            if i == durable {
                at_durable = Some(m.keyspace().clone());
            }
            now += u64::from(step);
            let c = ctx("c", now);
            let (key, value) = (b(&format!("k{key}")), b(&format!("v{value}")));
            let command = match kind {
                0 | 5 => Command::Set { key, value, condition: SetCondition::Always, expiry_ms: None },
                1 => Command::Set { key, value, condition: SetCondition::NotExistsOrEqual, expiry_ms: Some(100) },
                2 => Command::Set { key, value, condition: SetCondition::NotExists, expiry_ms: None },
                3 => Command::Del { key },
                _ => Command::VDel { key, value },
            };
            let execution = m.execute(command, &c);
            prop_assert_eq!(execution.delta.is_some(), execution.undo.is_some());
            if i >= durable {
                undos.extend(execution.undo);
            }
        }
        let Some(expected) = at_durable else { return Ok(()) };
        for undo in undos.iter().rev() {
            m.apply_delta(undo);
        }
        prop_assert_eq!(m.keyspace(), &expected);
    }

    #[test]
    fn snapshot_decode_never_panics(data in prop::collection::vec(any::<u8>(), 0..128)) {
        let _ = StateMachine::snapshot_decode(&data, config(Limits::default()));
    }
}
