//! What nodes send each other for the data plane, inside the cluster transport's
//! `Request::Data` / `Response::Data` frames (postcard, like the control plane's messages).

use serde::{Deserialize, Serialize};

use mqstate_chain::{Message, Version};

/// A state-store request as the node that received it hands it to a partition's head: the
/// envelope's checks (response topic, `__ts`/`__ft` syntax, key access, rate) were made there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    pub client_id: String,
    pub correlation: Vec<u8>,
    /// The key the command names (its partition's head executes it).
    pub key: Vec<u8>,
    /// The RESP request, as the client sent it.
    pub payload: Vec<u8>,
    /// `__ts` and `__ft`, as HLC text.
    pub ts: Option<String>,
    pub fencing_token: Option<String>,
    /// How long the request stays valid (its message expiry), from when it was received.
    pub expiry_ms: u64,
    /// Unix ms, on the receiving node's clock, after which no head starts executing it: its front
    /// end has given up by then, and a copy that waited out a pause in a socket must not run
    /// after the retry window of [`crate::recent`] closed (0: no deadline).
    pub deadline_ms: u64,
}

/// The reply the client gets: RESP payload and the response `__ts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Executed {
    pub payload: Vec<u8>,
    pub ts: Option<String>,
}

impl Executed {
    /// An `-ERR` reply with `text`.
    pub fn error(text: &str) -> Executed {
        Executed {
            payload: format!("-ERR {text}\r\n").into_bytes(),
            ts: None,
        }
    }
}

/// A change committed through a partition's chain, for the nodes whose clients observe its key
/// (KEYNOTIFY): the key, its new version (HLC text) and value (`None`: deleted or expired), and
/// the version of the committed row it replaced, if known (decision 0061: an observing node that
/// did not get that one holds this change back until it has it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    pub key: Vec<u8>,
    pub version: String,
    pub value: Option<Vec<u8>>,
    pub prev: Option<String>,
}

/// One page of a SCAN, asked of the heads of some partitions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScanPage {
    pub pattern: Vec<u8>,
    /// Keys strictly after this one (the client's continuation).
    pub after: Option<Vec<u8>>,
    /// At most this many keys per partition.
    pub page_keys: u32,
    /// At most this many rows examined per partition.
    pub visit_max: u32,
}

/// One partition's part of a SCAN page: the matching live keys in key order and, if it stopped
/// before its last row, the last key it examined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartScan {
    pub keys: Vec<Vec<u8>>,
    pub stopped_at: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataRequest {
    /// Chain messages for the replicas here, each with its partition: what one peer had queued for
    /// this node (`batch`: one frame per hop, not one per message).
    Chains(Vec<(u32, Message)>),
    /// Execute at the head of the key's partition: one request per call, as nodes of the previous
    /// release forward (still answered; this release sends [`DataRequest::ExecuteMany`]).
    Execute(Routed),
    /// The keys clients of `node` observe (all of them; a higher `generation` replaces a lower).
    Interest {
        node: u64,
        generation: u64,
        keys: Vec<Vec<u8>>,
    },
    /// Committed changes of keys observed at the receiving node, in commit order.
    Notify(Vec<Committed>),
    /// A SCAN page of each of `partitions`, at their head.
    Scan {
        partitions: Vec<u32>,
        page: ScanPage,
    },
    /// Read a session row at the head of the client id's partition (sessions space).
    SessionRead { client_id: String },
    /// Write (`None`: delete) a session row at the head, if the row is as `expect` says.
    SessionWrite {
        client_id: String,
        value: Option<Vec<u8>>,
        expect: RowExpect,
    },
    /// The requests this member remembers for `partition` ([`crate::recent`]), for one that
    /// re-entered its chain.
    Recent { partition: u32 },
    /// Execute each at the head of its key's partition: the requests one node had queued for
    /// this one (`forward`: one frame per batch, not one call per request). Answered by
    /// [`DataResponse::ExecutedMany`], in the same order.
    ExecuteMany(Vec<Routed>),
    /// The changes of `key` after version `after` up to `until` that this replica persisted
    /// ([`crate::trail`]): what an observing node missed. Answered by [`DataResponse::Trail`].
    Trail {
        key: Vec<u8>,
        after: String,
        until: String,
    },
    /// The version of `key`'s committed row, at its partition's head: where a node that starts
    /// observing the key starts (older changes still on their way are not delivered). Answered
    /// by [`DataResponse::Current`].
    Current { key: Vec<u8> },
    /// The head's remembered requests of `partition` ([`crate::recent`]), sent with the end of its
    /// recovery copy under `view` (`Item::CopyDone`): the replica that caught up knows what the
    /// chain ran without asking the members, one of which may fail first (decision 0050).
    /// Answered [`DataResponse::Received`].
    RecentOfHead {
        partition: u32,
        view: u64,
        entries: Vec<crate::recent::Exported>,
    },
    /// As [`DataRequest::Trail`], but when this replica's links break off before `after`, the
    /// changes back to where they break off (decision 0065: a session that moved catches up).
    /// Answered by [`DataResponse::Reach`].
    TrailReach {
        key: Vec<u8>,
        after: String,
        until: String,
    },
}

/// The changes of a key a replica holds back from a version towards an earlier one (decision
/// 0065), in order: all of them (`whole`), or back to where its links end — at a change it holds
/// nothing before (`unlinked`: the first it noted since it last saw the key unobserved, or at all)
/// or at one whose predecessor it no longer holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reach {
    pub changes: Vec<Committed>,
    pub whole: bool,
    pub unlinked: bool,
}

/// The condition of a session row write: compare-and-set on the row's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RowExpect {
    /// No value (never written, or deleted).
    Absent,
    /// The row is at exactly this version.
    Version(Version),
}

/// A session row as the head read it: its committed value (`None`: none) and version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRow {
    pub value: Option<Vec<u8>>,
    pub version: Option<Version>,
}

/// What became of a session row write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RowWritten {
    /// Committed through the chain (every replica of the write view fsynced it) at this version.
    Written(Version),
    /// Not written: the row is not as expected; its version now.
    Conflict(Option<Version>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataResponse {
    /// A chain message was taken (what happens to it is the protocol's business).
    Received,
    Executed(Executed),
    /// Not executed here (not the head under a view this node holds now, or the chain did not
    /// answer in time); the reason, for the log. The sender retries within the request's expiry.
    Retry(String),
    /// The request did not decode.
    Refused(String),
    /// The parts of a SCAN page, per partition; `None` where this node is not the head now.
    Scanned(Vec<(u32, Option<PartScan>)>),
    SessionRow(SessionRow),
    SessionWritten(RowWritten),
    /// `None`: this member re-entered too and cannot vouch for its entries yet.
    Recent(Option<Vec<crate::recent::Exported>>),
    /// The outcome of each request of an [`DataRequest::ExecuteMany`], in its order: the reply,
    /// or why it was not executed here (the sender retries it within its expiry).
    ExecutedMany(Vec<Result<Executed, String>>),
    /// The answer to [`DataRequest::Interest`]: the answering node's own interest, so that a
    /// node that (re)started learns every member's in its first round.
    Interest {
        generation: u64,
        keys: Vec<Vec<u8>>,
    },
    /// The changes asked for, in order; `None`: this replica does not hold all of them.
    Trail(Option<Vec<Committed>>),
    /// What this replica holds of the changes asked for by [`DataRequest::TrailReach`].
    Reach(Reach),
    /// The key's committed version (`None`: no row); `Err`: not the head now, or not answered.
    Current(Result<Option<String>, String>),
}

/// How these messages are encoded and decoded: as every message inside the cluster transport.
pub use mqstate_cluster::transport::{decode_body as decode, encode_body as encode};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_garbage_is_an_error() {
        let request = DataRequest::Execute(Routed {
            client_id: "c".into(),
            correlation: vec![1, 2],
            key: b"k".to_vec(),
            payload: b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n".to_vec(),
            ts: Some("1:0:n".into()),
            fencing_token: None,
            expiry_ms: 10_000,
            deadline_ms: 1_700_000_010_000,
        });
        assert_eq!(decode::<DataRequest>(&encode(&request)).unwrap(), request);
        let DataRequest::Execute(routed) = request else {
            unreachable!()
        };
        let many = DataRequest::ExecuteMany(vec![routed.clone(), routed]);
        assert_eq!(decode::<DataRequest>(&encode(&many)).unwrap(), many);
        let answers =
            DataResponse::ExecutedMany(vec![Ok(Executed::error("x")), Err("not the head".into())]);
        assert_eq!(decode::<DataResponse>(&encode(&answers)).unwrap(), answers);
        let write = DataRequest::SessionWrite {
            client_id: "c".into(),
            value: Some(vec![9]),
            expect: RowExpect::Version(Version {
                wall_ms: 5,
                counter: 1,
                node: 2,
            }),
        };
        assert_eq!(decode::<DataRequest>(&encode(&write)).unwrap(), write);
        assert!(decode::<DataRequest>(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode::<DataResponse>(&[]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_or_fail_without_panicking(body in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            if let Ok(request) = decode::<DataRequest>(&body) {
                proptest::prop_assert_eq!(decode::<DataRequest>(&encode(&request)).ok(), Some(request));
            }
            let _ = decode::<DataResponse>(&body);
        }
    }
}
