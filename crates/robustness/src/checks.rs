//! The checks of one run's history: linearizability per key, acknowledged writes after recovery,
//! versions, fencing tokens, notifications, persistent sessions.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mqstate_wgl::notify;
use serde::Serialize;

use crate::history::{Change, Cmd, History, Op, Outcome, Version};
use crate::linearizability::{check, Budget, CheckOp, Verdict};

/// The client name of the reads after the final recovery.
pub const FINAL_CLIENT: &str = "final";

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub check: &'static str,
    pub key: String,
    pub detail: String,
    /// Operation ids the timeline highlights.
    pub ops: Vec<usize>,
}

#[derive(Debug, Default, Serialize)]
pub struct Findings {
    pub violations: Vec<Violation>,
    /// Keys whose read after recovery lost an acknowledged write.
    pub acked_lost: usize,
    /// Keys the linearizability search could not finish within its budget.
    pub incomplete: Vec<String>,
}

pub fn run_checks(history: &History, budget_per_key: Duration) -> Findings {
    let mut findings = Findings::default();
    let mut by_key: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in &history.ops {
        by_key.entry(op.key.as_str()).or_default().push(op);
    }
    for (key, ops) in &by_key {
        linearizable(history, key, ops, budget_per_key, &mut findings);
        versions_never_go_back(key, ops, &mut findings);
        if key.starts_with("fenced/") {
            fencing_tokens_never_go_back(key, ops, &mut findings);
        }
    }
    notifications(history, &by_key, &mut findings);
    for op in &history.ops {
        if let Outcome::Unexpected(reply) = &op.outcome {
            findings.violations.push(Violation {
                check: "protocol",
                key: op.key.clone(),
                detail: format!("{} #{} got the reply {reply}", op.cmd.name(), op.id),
                ops: vec![op.id],
            });
        }
    }
    for client in &history.sessions_lost {
        findings.violations.push(Violation {
            check: "session-present",
            key: String::new(),
            detail: format!("persistent session of {client} was gone after a reconnect"),
            ops: Vec::new(),
        });
    }
    findings
}

fn check_ops<'a>(history: &History, ops: &[&'a Op]) -> Vec<CheckOp<'a>> {
    ops.iter()
        .map(|op| CheckOp {
            cmd: &op.cmd,
            outcome: if op.effect_known(history.cluster) {
                &op.outcome
            } else {
                &Outcome::Unknown
            },
            invoked_us: op.invoked_us,
            ends_us: op
                .returned_us
                .filter(|_| op.effect_known(history.cluster))
                .unwrap_or_else(|| history.effect_deadline_us(op.incarnation))
                .max(op.invoked_us),
            clock_slack_ms: crate::model::CLOCK_SLACK_MS + history.clock_spread_ms(),
        })
        .collect()
}

fn linearizable(
    history: &History,
    key: &str,
    ops: &[&Op],
    budget_per_key: Duration,
    findings: &mut Findings,
) {
    let budget = || Budget {
        max_states: 2_000_000,
        deadline: Instant::now() + budget_per_key,
    };
    let kept: Vec<&Op> = ops
        .iter()
        .copied()
        // A read that never answered tells nothing.
        .filter(|op| op.outcome.is_known() || op.cmd != Cmd::Get)
        .collect();
    match check(&check_ops(history, &kept), &budget()) {
        Verdict::Linearizable => {}
        Verdict::Unknown => findings.incomplete.push(key.to_owned()),
        Verdict::Violation { linearized, stuck } => {
            let stuck_op = kept[stuck];
            let mut detail = format!(
                "no linearization: after {} operations, {} #{} ({} by {}) cannot be placed",
                linearized.len(),
                stuck_op.cmd.name(),
                stuck_op.id,
                outcome_text(&stuck_op.outcome),
                stuck_op.client
            );
            let mut highlighted: Vec<usize> = linearized
                .iter()
                .rev()
                .take(5)
                .map(|&i| kept[i].id)
                .collect();
            highlighted.push(stuck_op.id);
            let before_final: Vec<&Op> = kept
                .iter()
                .copied()
                .filter(|op| op.client != FINAL_CLIENT)
                .collect();
            let has_final = before_final.len() < kept.len();
            let check_name = if has_final
                && check(&check_ops(history, &before_final), &budget()) == Verdict::Linearizable
            {
                detail.push_str("; the history is linearizable without the read after recovery");
                if final_read_lost_a_write(&kept) {
                    findings.acked_lost += 1;
                    "acknowledged-write-lost"
                } else {
                    "recovery"
                }
            } else {
                "linearizability"
            };
            findings.violations.push(Violation {
                check: check_name,
                key: key.to_owned(),
                detail,
                ops: highlighted,
            });
        }
    }
}

/// Whether the read after recovery shows less than the newest acknowledged SET: a miss or an older
/// version.
fn final_read_lost_a_write(ops: &[&Op]) -> bool {
    let newest_acked = ops
        .iter()
        .filter(|op| op.client != FINAL_CLIENT)
        .filter_map(|op| match &op.outcome {
            Outcome::Written(v) => Some(v),
            _ => None,
        })
        .max();
    let Some(newest_acked) = newest_acked else {
        return false;
    };
    ops.iter()
        .filter(|op| op.client == FINAL_CLIENT)
        .any(|op| match &op.outcome {
            Outcome::Miss => true,
            Outcome::Hit { version, .. } => version < newest_acked,
            _ => false,
        })
}

fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Written(v) => format!("OK {v}"),
        Outcome::NotApplied => ":-1".into(),
        Outcome::Hit { value, version } => format!("{value} @ {version}"),
        Outcome::Miss => "nil".into(),
        Outcome::Deleted(n) => format!(":{n}"),
        Outcome::Error(e) => format!("-ERR {e}"),
        Outcome::Unknown => "unknown".into(),
        Outcome::Unexpected(reply) => format!("unexpected {reply}"),
    }
}

/// An operation that started after another finished never sees an older version of the key, and
/// a SET that started after another operation finished gets a newer version than it saw.
fn versions_never_go_back(key: &str, ops: &[&Op], findings: &mut Findings) {
    let mut versioned: Vec<(&Op, &Version, u64)> = ops
        .iter()
        .filter_map(|op| Some((*op, op.version()?, op.returned_us?)))
        .collect();
    let mut by_return = versioned.clone();
    by_return.sort_by_key(|(_, _, ret)| *ret);
    versioned.sort_by_key(|(op, _, _)| op.invoked_us);
    let mut seen: Option<(&Version, usize)> = None;
    let mut returned = by_return.iter().peekable();
    for (op, version, _) in versioned {
        while let Some((done, v, ret)) = returned.peek() {
            if *ret >= op.invoked_us {
                break;
            }
            if seen.is_none_or(|(max, _)| *v > max) {
                seen = Some((v, done.id));
            }
            returned.next();
        }
        let Some((max, earlier)) = seen else { continue };
        let backwards =
            version < max || (version == max && matches!(op.outcome, Outcome::Written(_)));
        if backwards {
            findings.violations.push(Violation {
                check: "version-order",
                key: key.to_owned(),
                detail: format!(
                    "{} #{} got version {version} after #{earlier} had returned version {max}",
                    op.cmd.name(),
                    op.id
                ),
                ops: vec![earlier, op.id],
            });
        }
    }
}

/// In the order of the versions the server gave them, accepted fenced writes carry tokens that
/// never go down (the fenced keys are never deleted, so a token once stored stays).
fn fencing_tokens_never_go_back(key: &str, ops: &[&Op], findings: &mut Findings) {
    let mut accepted: Vec<(&Version, &Version, usize)> = ops
        .iter()
        .filter_map(|op| match (&op.cmd, &op.outcome) {
            (
                Cmd::Set {
                    fencing_token: Some(token),
                    ..
                },
                Outcome::Written(version),
            ) => Some((version, token, op.id)),
            _ => None,
        })
        .collect();
    accepted.sort();
    let mut highest: Option<(&Version, usize)> = None;
    for (version, token, id) in accepted {
        if let Some((max, by)) = highest {
            if token < max {
                findings.violations.push(Violation {
                    check: "fencing",
                    key: key.to_owned(),
                    detail: format!(
                        "write #{id} with fencing token {token} accepted at version {version} after #{by} had been accepted with the newer token {max}"
                    ),
                    ops: vec![by, id],
                });
            }
        }
        if highest.is_none_or(|(max, _)| token > max) {
            highest = Some((token, id));
        }
    }
}

/// The rules of KEYNOTIFY notifications (`mqstate_wgl::notify`, shared with the cluster
/// simulation): each observer sees each key's changes in version order, and, within one
/// registration, every acknowledged SET between the first and the last change it saw.
fn notifications(history: &History, by_key: &BTreeMap<&str, Vec<&Op>>, findings: &mut Findings) {
    let changes: Vec<notify::Change<String>> = history
        .notifications
        .iter()
        .map(|n| match &n.change {
            Change::Set(value) => notify::Change::Set(value.clone()),
            Change::Delete => notify::Change::Delete,
        })
        .collect();
    let notes: Vec<notify::Note<'_, String>> = history
        .notifications
        .iter()
        .zip(&changes)
        .map(|(n, change)| notify::Note {
            observer: &n.observer,
            epoch: n.epoch,
            key: &n.key,
            change,
            version: n.version.as_ref().map(|v| &v.0),
        })
        .collect();
    let registrations: Vec<notify::Registered<'_>> = history
        .registrations
        .iter()
        .map(|r| notify::Registered {
            observer: &r.observer,
            epoch: r.epoch,
            key: &r.key,
            at: r.registered_us,
        })
        .collect();
    let writes: Vec<notify::Write<'_, String>> = by_key
        .values()
        .flatten()
        .filter_map(|op| match (&op.cmd, &op.outcome) {
            (Cmd::Set { value, .. }, Outcome::Written(version)) => Some(notify::Write {
                id: op.id,
                key: &op.key,
                invoked: op.invoked_us,
                version: &version.0,
                value,
            }),
            _ => None,
        })
        .collect();
    for f in notify::check(&notes, &registrations, &writes) {
        findings.violations.push(Violation {
            check: f.check,
            key: f.key,
            detail: f.detail,
            ops: f.ops,
        });
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::history::{Condition, Notified, Registration, CLUSTER_GAVE_UP};

    fn v(n: u64) -> Version {
        Version::parse(&format!("{n:015}:00000:n")).unwrap()
    }

    fn op(id: usize, key: &str, cmd: Cmd, outcome: Outcome, at: u64) -> Op {
        Op {
            id,
            client: format!("c{id}"),
            key: key.into(),
            cmd,
            invoked_us: at,
            returned_us: Some(at + 10),
            outcome,
            incarnation: 0,
        }
    }

    fn set(value: &str, token: Option<u64>) -> Cmd {
        Cmd::Set {
            value: value.into(),
            condition: Condition::Always,
            px_ms: None,
            fencing_token: token.map(v),
        }
    }

    fn notified(epoch: u32, value: &str, version: u64) -> Notified {
        Notified {
            observer: "o".into(),
            epoch,
            key: "k".into(),
            change: Change::Set(value.into()),
            version: Some(v(version)),
            received_us: 0,
        }
    }

    fn checks_of(history: &History) -> Vec<&'static str> {
        run_checks(history, Duration::from_secs(10))
            .violations
            .iter()
            .map(|v| v.check)
            .collect()
    }

    fn three_sets() -> History {
        History {
            ops: vec![
                op(0, "k", set("a", None), Outcome::Written(v(1)), 100),
                op(1, "k", set("b", None), Outcome::Written(v(2)), 200),
                op(2, "k", set("c", None), Outcome::Written(v(3)), 300),
            ],
            registrations: vec![Registration {
                observer: "o".into(),
                epoch: 1,
                key: "k".into(),
                registered_us: 50,
            }],
            ..History::default()
        }
    }

    /// A cluster node that gave up waiting for the head answered an error, and the write still
    /// landed later (a GET after the error sees it): possible on a cluster, where the error says
    /// nothing about the write; on a single node an error is a refusal, so that GET is a violation.
    #[test]
    fn a_cluster_error_after_giving_up_may_still_have_written() {
        let gave_up = Outcome::Error(format!("{CLUSTER_GAVE_UP} (node 2: timeout); retry"));
        let mut history = History {
            ops: vec![
                op(0, "k", set("a", None), Outcome::Written(v(1)), 100),
                op(1, "k", set("b", None), gave_up, 200),
                op(
                    2,
                    "k",
                    Cmd::Get,
                    Outcome::Hit {
                        value: "b".into(),
                        version: v(2),
                    },
                    300,
                ),
            ],
            incarnations: vec![crate::history::Incarnation {
                started_us: 0,
                ended_us: None,
            }],
            ..History::default()
        };
        assert_eq!(checks_of(&history), vec!["linearizability"]);
        history.cluster = true;
        assert_eq!(checks_of(&history), Vec::<&str>::new());
    }

    #[test]
    fn repeated_notifications_after_a_reconnect_are_not_out_of_order() {
        let mut history = three_sets();
        history.notifications = vec![
            notified(1, "a", 1),
            notified(1, "b", 2),
            notified(2, "a", 1),
            notified(2, "b", 2),
            notified(2, "c", 3),
        ];
        assert_eq!(checks_of(&history), Vec::<&str>::new());
    }

    #[test]
    fn a_missing_or_reordered_notification_is_reported() {
        let mut history = three_sets();
        history.notifications = vec![notified(1, "a", 1), notified(1, "c", 3)];
        assert_eq!(checks_of(&history), vec!["notification-gap"]);
        history.notifications = vec![
            notified(1, "a", 1),
            notified(1, "c", 3),
            notified(1, "b", 2),
        ];
        assert_eq!(checks_of(&history), vec!["notification-order"]);
    }

    #[test]
    fn an_older_fencing_token_accepted_later_is_reported() {
        let history = History {
            ops: vec![
                op(
                    0,
                    "fenced/0",
                    set("a", Some(50)),
                    Outcome::Written(v(100)),
                    0,
                ),
                op(
                    1,
                    "fenced/0",
                    set("b", Some(40)),
                    Outcome::Written(v(200)),
                    100,
                ),
            ],
            ..History::default()
        };
        let found = checks_of(&history);
        assert!(found.contains(&"fencing"), "{found:?}");
        assert!(found.contains(&"linearizability"), "{found:?}");
    }

    #[test]
    fn a_version_going_back_is_reported() {
        let history = History {
            ops: vec![
                op(0, "k", set("a", None), Outcome::Written(v(5)), 0),
                op(
                    1,
                    "k",
                    Cmd::Get,
                    Outcome::Hit {
                        value: "a".into(),
                        version: v(4),
                    },
                    100,
                ),
            ],
            ..History::default()
        };
        assert!(checks_of(&history).contains(&"version-order"));
    }

    #[test]
    fn a_final_read_missing_an_acknowledged_write_counts_as_lost() {
        let mut history = History {
            ops: vec![op(0, "k", set("a", None), Outcome::Written(v(1)), 0)],
            ..History::default()
        };
        let mut read = op(1, "k", Cmd::Get, Outcome::Miss, 1000);
        read.client = FINAL_CLIENT.into();
        history.ops.push(read);
        let findings = run_checks(&history, Duration::from_secs(10));
        assert_eq!(findings.acked_lost, 1);
        assert_eq!(findings.violations[0].check, "acknowledged-write-lost");
    }

    /// Seed 7112 (docs/robustness.md), reduced to the operations on `reg/4` that decide it: the
    /// SET `w2-418` sent just before node 2 was paused never answered; a GET saw it at version
    /// `…501025:00002`, a later SET replaced it, and 3 s after that a GET saw `w2-418` again, at
    /// version `…506077:00000`. One write of unknown outcome takes effect at most once, with one
    /// version: no linearization. (The server executed it twice, a second time at the new head
    /// when the node that forwarded it retried; crates/replication.)
    pub(crate) fn seed_7112_reg_4() -> History {
        const T0: u64 = 1_795_505_497_416_325;
        let at = |ms: f64| T0 + (ms * 1000.0) as u64;
        let hlc = |text: &str| Version::parse(text).unwrap();
        let op = |id, client: &str, cmd, outcome, invoked: f64, returned: Option<f64>| Op {
            id,
            client: client.into(),
            key: "reg/4".into(),
            cmd,
            invoked_us: at(invoked),
            returned_us: returned.map(at),
            outcome,
            incarnation: 0,
        };
        let hit = |version: &str| Outcome::Hit {
            value: "w2-418".into(),
            version: hlc(version),
        };
        History {
            cluster: true,
            ops: vec![
                op(
                    3034,
                    "w2",
                    set("w2-418", None),
                    Outcome::Unknown,
                    3608.890,
                    None,
                ),
                op(
                    2981,
                    "w4",
                    Cmd::Get,
                    hit("001795505501025:00002:mqstate"),
                    5511.527,
                    Some(5511.681),
                ),
                op(
                    3021,
                    "w4",
                    set("w4-445", None),
                    Outcome::Written(hlc("001795505503003:00000:mqstate")),
                    5586.660,
                    Some(5588.556),
                ),
                op(
                    5697,
                    "w5",
                    Cmd::Get,
                    hit("001795505506077:00000:mqstate"),
                    8666.205,
                    Some(8666.742),
                ),
            ],
            incarnations: vec![crate::history::Incarnation {
                started_us: T0,
                ended_us: Some(at(17629.0)),
            }],
            ..History::default()
        }
    }

    #[test]
    fn an_unknown_write_takes_effect_at_most_once() {
        let mut history = seed_7112_reg_4();
        let found = run_checks(&history, Duration::from_secs(10)).violations;
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].check, "linearizability");
        assert!(found[0].detail.contains("GET #5697"), "{}", found[0].detail);
        // Without the SET in between, the second read is still a second version of one write.
        history.ops.retain(|op| op.id != 3021);
        assert_eq!(checks_of(&history), vec!["linearizability"]);
        // Seen once (either read alone), the late write is placeable.
        for read in [2981, 5697] {
            let mut one = seed_7112_reg_4();
            one.ops.retain(|op| op.id == 3034 || op.id == read);
            assert_eq!(checks_of(&one), Vec::<&str>::new(), "only #{read}");
        }
    }
}
