//! The state store's clock never goes backwards across a restart, even when nothing in the log
//! carries the latest timestamp it handed out (here: a key not persisted under `--persistence
//! opt-in`, stamped by a client clock ahead of ours, as a wall clock that later steps back would be).

use crate::common;

use common::state::{hlc_in, hlc_now, hlc_order, StateClient, NIL, OK};
use common::Server;

/// Ahead of the server's wall clock, within the allowed client drift (60 s).
const AHEAD_MS: u64 = 30_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_after_a_kill9_restart_are_above_every_version_handed_out_before() {
    let mut server = Server::start_with(&["--persistence", "opt-in"]);
    let mut client = StateClient::connect(server.addr, "clock-1").await;
    let (reply, before) = client
        .request_at(&[b"SET", b"volatile", b"v"], hlc_in(AHEAD_MS))
        .await;
    assert_eq!(reply.as_ref(), OK);
    let before = before.expect("SET reply carries __ts");

    tokio::task::block_in_place(|| {
        server.kill9();
        server.restart();
    });
    let mut client = StateClient::connect(server.addr, "clock-2").await;
    let (reply, _) = client.request_at(&[b"GET", b"volatile"], hlc_now()).await;
    assert_eq!(
        reply.as_ref(),
        NIL,
        "the key was not persisted, so the log has no trace of it"
    );
    let (reply, after) = client.request_at(&[b"SET", b"next", b"v"], hlc_now()).await;
    assert_eq!(reply.as_ref(), OK);
    let after = after.expect("SET reply carries __ts");
    assert!(
        hlc_order(&after) > hlc_order(&before),
        "version {after} after the restart is not above {before} handed out before it"
    );
}
