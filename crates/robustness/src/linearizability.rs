//! Wing–Gong–Lowe linearizability checking of one key's history, as porcupine does it: walk the
//! history's call/return events in time order, try to linearize each pending call against the model,
//! backtrack at a return whose call could not be placed, and remember (linearized set, state) pairs
//! already explored. Keys are independent (P-compositionality), so the caller checks each key alone.
//!
//! The model is nondeterministic ([`crate::model`]), so the state is a set of states; an operation
//! whose outcome is unknown stays open until the server process it was sent to ended (or forever),
//! and may also not have happened at all.

use std::collections::HashSet;
use std::time::Instant;

use crate::history::{Cmd, Outcome};
use crate::model::{step, KeyState, Step};

/// One operation for the checker.
#[derive(Debug, Clone)]
pub struct CheckOp<'a> {
    pub cmd: &'a Cmd,
    pub outcome: &'a Outcome,
    pub invoked_us: u64,
    /// Return, or the latest moment an unknown outcome can have taken effect (`u64::MAX`: never ends).
    pub ends_us: u64,
    /// Tolerance of expiry judgements (`model::Step::clock_slack_ms`).
    pub clock_slack_ms: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// Not linearizable: `linearized` is the longest prefix found (indices into the ops), `stuck` an
    /// operation that could not be placed after it.
    Violation {
        linearized: Vec<usize>,
        stuck: usize,
    },
    /// The search ran out of its budget.
    Unknown,
}

const NIL: usize = usize::MAX;

struct Event {
    op: usize,
    is_call: bool,
    /// The other event of the same operation.
    partner: usize,
    prev: usize,
    next: usize,
}

/// Budget of the search: explored states and wall time.
pub struct Budget {
    pub max_states: usize,
    pub deadline: Instant,
}

pub fn check(ops: &[CheckOp<'_>], budget: &Budget) -> Verdict {
    if ops.is_empty() {
        return Verdict::Linearizable;
    }
    let mut events = build_events(ops);
    let head = events.len() - 1;
    let words = ops.len().div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Vec<u64>, Vec<KeyState>)> = HashSet::new();
    let mut stack: Vec<(usize, Vec<KeyState>)> = Vec::new();
    let mut state = vec![KeyState::default()];
    let mut best: (Vec<usize>, usize) = (Vec::new(), 0);
    let mut cursor = events[head].next;
    let mut steps = 0usize;
    while events[head].next != NIL {
        steps += 1;
        if steps.is_multiple_of(4096) && Instant::now() > budget.deadline
            || cache.len() > budget.max_states
        {
            return Verdict::Unknown;
        }
        let event = &events[cursor];
        if event.is_call {
            let op = event.op;
            let next = step_all(&state, &ops[op]);
            if !next.is_empty() {
                set_bit(&mut linearized, op, true);
                if cache.insert((linearized.clone(), next.clone())) {
                    stack.push((cursor, std::mem::replace(&mut state, next)));
                    lift(&mut events, cursor);
                    cursor = events[head].next;
                    continue;
                }
                set_bit(&mut linearized, op, false);
            }
            cursor = events[cursor].next;
        } else {
            // A return whose call is still pending: nothing placed so far can be extended.
            if stack.len() >= best.0.len() && (best.0.is_empty() || stack.len() > best.0.len()) {
                best = (stack.iter().map(|(e, _)| events[*e].op).collect(), event.op);
            }
            let Some((call, previous)) = stack.pop() else {
                return Verdict::Violation {
                    linearized: best.0,
                    stuck: best.1,
                };
            };
            state = previous;
            set_bit(&mut linearized, events[call].op, false);
            unlift(&mut events, call);
            cursor = events[call].next;
        }
    }
    Verdict::Linearizable
}

fn step_all(states: &[KeyState], op: &CheckOp<'_>) -> Vec<KeyState> {
    let model_step = Step {
        cmd: op.cmd,
        outcome: op.outcome,
        invoked_ms: op.invoked_us / 1000,
        effect_end_ms: if op.ends_us == u64::MAX {
            u64::MAX
        } else {
            op.ends_us / 1000
        },
        clock_slack_ms: op.clock_slack_ms,
    };
    let mut next: Vec<KeyState> = states.iter().flat_map(|s| step(s, &model_step)).collect();
    next.sort_unstable();
    next.dedup();
    next
}

/// The doubly linked list of events in time order (calls before returns at equal times, which
/// treats touching operations as concurrent), with a head sentinel last.
fn build_events(ops: &[CheckOp<'_>]) -> Vec<Event> {
    let mut order: Vec<(u64, bool, usize)> = Vec::with_capacity(ops.len() * 2);
    for (i, op) in ops.iter().enumerate() {
        debug_assert!(op.ends_us >= op.invoked_us);
        order.push((op.invoked_us, false, i));
        order.push((op.ends_us, true, i));
    }
    order.sort_unstable();
    let mut call_at = vec![0usize; ops.len()];
    let mut return_at = vec![0usize; ops.len()];
    let mut events: Vec<Event> = order
        .iter()
        .enumerate()
        .map(|(i, &(_, is_return, op))| {
            if is_return {
                return_at[op] = i;
            } else {
                call_at[op] = i;
            }
            Event {
                op,
                is_call: !is_return,
                partner: NIL,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == order.len() { NIL } else { i + 1 },
            }
        })
        .collect();
    for op in 0..ops.len() {
        events[call_at[op]].partner = return_at[op];
        events[return_at[op]].partner = call_at[op];
    }
    let head = events.len();
    events.push(Event {
        op: NIL,
        is_call: false,
        partner: NIL,
        prev: NIL,
        next: 0,
    });
    events[0].prev = head;
    events
}

fn unlink(events: &mut [Event], e: usize) {
    let (prev, next) = (events[e].prev, events[e].next);
    events[prev].next = next;
    if next != NIL {
        events[next].prev = prev;
    }
}

fn relink(events: &mut [Event], e: usize) {
    let (prev, next) = (events[e].prev, events[e].next);
    events[prev].next = e;
    if next != NIL {
        events[next].prev = e;
    }
}

/// Removes a call and its return from the list (undone, in reverse order, by [`unlift`]).
fn lift(events: &mut [Event], call: usize) {
    let ret = events[call].partner;
    unlink(events, call);
    unlink(events, ret);
}

fn unlift(events: &mut [Event], call: usize) {
    let ret = events[call].partner;
    relink(events, ret);
    relink(events, call);
}

fn set_bit(bits: &mut [u64], i: usize, on: bool) {
    if on {
        bits[i / 64] |= 1 << (i % 64);
    } else {
        bits[i / 64] &= !(1 << (i % 64));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::history::Condition;
    use crate::model::fixtures::{set, v};

    fn hit(value: &str, version: u64) -> Outcome {
        Outcome::Hit {
            value: value.into(),
            version: v(version),
        }
    }

    fn budget() -> Budget {
        Budget {
            max_states: 1_000_000,
            deadline: Instant::now() + Duration::from_secs(60),
        }
    }

    /// `(cmd, outcome, invoked, returned)` with `u64::MAX` for an open end.
    fn run(history: &[(Cmd, Outcome, u64, u64)]) -> Verdict {
        let ops: Vec<CheckOp<'_>> = history
            .iter()
            .map(|(cmd, outcome, i, r)| CheckOp {
                cmd,
                outcome,
                invoked_us: *i,
                ends_us: *r,
                clock_slack_ms: crate::model::CLOCK_SLACK_MS,
            })
            .collect();
        check(&ops, &budget())
    }

    #[test]
    fn sequential_writes_and_reads_are_linearizable() {
        let h = [
            (set("a"), Outcome::Written(v(1)), 0, 10),
            (Cmd::Get, hit("a", 1), 20, 30),
            (set("b"), Outcome::Written(v(2)), 40, 50),
            (Cmd::Get, hit("b", 2), 60, 70),
            (
                Cmd::Del {
                    fencing_token: None,
                },
                Outcome::Deleted(1),
                80,
                90,
            ),
            (Cmd::Get, Outcome::Miss, 100, 110),
        ];
        assert_eq!(run(&h), Verdict::Linearizable);
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_not_linearizable() {
        let h = [
            (set("a"), Outcome::Written(v(1)), 0, 10),
            (set("b"), Outcome::Written(v(2)), 20, 30),
            (Cmd::Get, hit("a", 1), 40, 50),
        ];
        let Verdict::Violation { stuck, .. } = run(&h) else {
            panic!("stale read accepted")
        };
        assert_eq!(stuck, 2);
    }

    #[test]
    fn a_read_concurrent_with_a_write_may_see_either_value() {
        for seen in [hit("a", 1), hit("b", 2)] {
            let h = [
                (set("a"), Outcome::Written(v(1)), 0, 10),
                (set("b"), Outcome::Written(v(2)), 20, 60),
                (Cmd::Get, seen, 30, 50),
            ];
            assert_eq!(run(&h), Verdict::Linearizable);
        }
    }

    #[test]
    fn reads_that_disagree_on_the_order_of_two_writes_are_not_linearizable() {
        // Two concurrent writes; one reader sees b then a, another (after it) a then... : the
        // classic "new-old inversion".
        let h = [
            (set("a"), Outcome::Written(v(1)), 0, 100),
            (set("b"), Outcome::Written(v(2)), 0, 100),
            (Cmd::Get, hit("b", 2), 10, 20),
            (Cmd::Get, hit("a", 1), 30, 40),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_acknowledged_write_lost_after_recovery_is_not_linearizable() {
        let h = [
            (set("a"), Outcome::Written(v(1)), 0, 10),
            (Cmd::Get, Outcome::Miss, 1000, 1010),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_unknown_write_may_show_up_later_or_never() {
        for seen in [hit("a", 1), Outcome::Miss] {
            let h = [
                (set("a"), Outcome::Unknown, 0, u64::MAX),
                (Cmd::Get, seen, 100, 110),
            ];
            assert_eq!(run(&h), Verdict::Linearizable);
        }
        // ... but once seen, it cannot disappear again.
        let h = [
            (set("a"), Outcome::Unknown, 0, u64::MAX),
            (Cmd::Get, hit("a", 1), 100, 110),
            (Cmd::Get, Outcome::Miss, 200, 210),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn an_unknown_write_cannot_take_effect_after_its_server_died() {
        let h = [
            (set("a"), Outcome::Written(v(1)), 0, 10),
            (set("b"), Outcome::Unknown, 20, 30),
            (Cmd::Get, hit("a", 1), 100, 110),
            (Cmd::Get, hit("b", 2), 200, 210),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn set_nx_twice_cannot_both_succeed() {
        let nx = |value: &str| Cmd::Set {
            value: value.into(),
            condition: Condition::NotExists,
            px_ms: None,
            fencing_token: None,
        };
        let h = [
            (nx("a"), Outcome::Written(v(1)), 0, 100),
            (nx("b"), Outcome::Written(v(2)), 0, 100),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
        let h = [
            (nx("a"), Outcome::Written(v(1)), 0, 100),
            (nx("b"), Outcome::NotApplied, 0, 100),
        ];
        assert_eq!(run(&h), Verdict::Linearizable);
    }

    #[test]
    fn versions_must_follow_the_linearization() {
        // Real-time order forces a before b, but b got the lower version.
        let h = [
            (set("a"), Outcome::Written(v(5)), 0, 10),
            (set("b"), Outcome::Written(v(3)), 20, 30),
        ];
        assert!(matches!(run(&h), Verdict::Violation { .. }));
    }

    #[test]
    fn many_concurrent_clients_check_quickly() {
        // 8 clients, 300 rounds each writing then reading its own value, all overlapping.
        let mut h = Vec::new();
        let mut version = 0;
        for round in 0..300u64 {
            for c in 0..8u64 {
                let t = round * 1000 + c;
                version += 1;
                let value = format!("c{c}-{round}");
                h.push((set(&value), Outcome::Written(v(version)), t, t + 500));
            }
            let last = format!("c7-{round}");
            h.push((
                Cmd::Get,
                hit(&last, version),
                round * 1000 + 600,
                round * 1000 + 700,
            ));
        }
        assert_eq!(run(&h), Verdict::Linearizable);
    }
}
