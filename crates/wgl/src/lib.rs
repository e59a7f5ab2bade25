//! Wing–Gong–Lowe linearizability checking of one key's history (the idea of
//! `crates/robustness/src/linearizability.rs`, for the simulations' simpler models): depth-first,
//! placing at each step any operation invoked before every unplaced operation returned, memoizing
//! (placed set, model state). An operation whose outcome is unknown never returns: it may take
//! effect at any point after its invocation, or never.
//!
//! A dev-dependency of the simulations: the chain's (`crates/chain/tests/simulation.rs`, a
//! [`register`]), the data plane's (`crates/replication/tests/turmoil_sim.rs`), the front end's
//! (`crates/statestore/tests/turmoil_sim.rs`) and the cluster's (`crates/node/tests/turmoil_sim.rs`),
//! with [`kv`], the state-store commands. [`notify`], the rules of KEYNOTIFY notifications, is
//! shared by the cluster simulation and the robustness tool's checker.

pub mod kv;
pub mod notify;

use std::collections::HashSet;
use std::hash::Hash;

/// The sequential specification: what an operation, with the outcome it recorded, does to a state.
pub trait Model {
    type State: Clone + Eq + Hash;
    type Op;
    /// The state after `op` ran in `state`, or `None` if its recorded outcome is impossible there.
    fn step(&self, state: &Self::State, op: &Self::Op) -> Option<Self::State>;
}

/// An operation with its place in real time: `invoked` and `returned` are instants of one clock
/// (any order-preserving counter); `returned` is [`UNKNOWN`] when no outcome came back.
#[derive(Debug, Clone)]
pub struct Timed<O> {
    pub op: O,
    pub invoked: u64,
    pub returned: u64,
}

/// The `returned` of an operation whose outcome is unknown (it may have taken effect or not).
pub const UNKNOWN: u64 = u64::MAX;

/// `Ok`, or why no order of the operations agrees with `model` and real time: the most completed
/// operations a linearizable prefix held. Gives up after `max_states` distinct search states.
pub fn check<M: Model>(
    model: &M,
    ops: &[Timed<M::Op>],
    initial: M::State,
    max_states: usize,
) -> Result<(), String> {
    let n = ops.len();
    let words = n.div_ceil(64);
    let is_placed = |placed: &[u64], i: usize| placed[i / 64] >> (i % 64) & 1 == 1;
    let mut seen: HashSet<(Vec<u64>, M::State)> = HashSet::new();
    let mut stack: Vec<(Vec<u64>, M::State)> = vec![(vec![0; words], initial)];
    let must = ops.iter().filter(|o| o.returned != UNKNOWN).count();
    let mut best = 0;
    while let Some((placed, state)) = stack.pop() {
        let done = (0..n)
            .filter(|&i| is_placed(&placed, i) && ops[i].returned != UNKNOWN)
            .count();
        best = best.max(done);
        if done == must {
            return Ok(());
        }
        if !seen.insert((placed.clone(), state.clone())) {
            continue;
        }
        if seen.len() > max_states {
            return Err(format!(
                "search budget of {max_states} states exhausted (at most {best} of {must} completed operations ordered so far)"
            ));
        }
        // No operation invoked after an unplaced one returned can come next.
        let horizon = (0..n)
            .filter(|&i| !is_placed(&placed, i))
            .map(|i| ops[i].returned)
            .min()
            .unwrap_or(UNKNOWN);
        for i in 0..n {
            if is_placed(&placed, i) || ops[i].invoked > horizon {
                continue;
            }
            if let Some(next) = model.step(&state, &ops[i].op) {
                let mut p = placed.clone();
                p[i / 64] |= 1 << (i % 64);
                stack.push((p, next));
            }
        }
    }
    Err(format!(
        "not linearizable: at most {best} of {must} completed operations can be ordered"
    ))
}

/// A register of `u64` values (`None`: absent), the chain simulation's model.
pub mod register {
    /// What an operation did.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Kind {
        /// Writes this value (`None`: delete).
        Write(Option<u64>),
        /// Read this value.
        Read(Option<u64>),
    }

    #[derive(Debug, Clone)]
    pub struct Op {
        pub kind: Kind,
        pub invoked: u64,
        /// [`super::UNKNOWN`]: the outcome is unknown (a write may have taken effect or not).
        pub returned: u64,
    }

    struct Register;

    impl super::Model for Register {
        type State = Option<u64>;
        type Op = Kind;
        fn step(&self, state: &Option<u64>, op: &Kind) -> Option<Option<u64>> {
            match op {
                Kind::Write(v) => Some(*v),
                Kind::Read(v) => (v == state).then_some(*v),
            }
        }
    }

    /// [`super::check`] of a register starting at `initial`.
    pub fn check(ops: &[Op], initial: Option<u64>, max_states: usize) -> Result<(), String> {
        let timed: Vec<super::Timed<Kind>> = ops
            .iter()
            .map(|o| super::Timed {
                op: o.kind.clone(),
                invoked: o.invoked,
                returned: o.returned,
            })
            .collect();
        super::check(&Register, &timed, initial, max_states)
    }
}

#[cfg(test)]
mod tests {
    use super::register::{check, Kind, Op};
    use super::UNKNOWN;

    fn op(kind: Kind, invoked: u64, returned: u64) -> Op {
        Op {
            kind,
            invoked,
            returned,
        }
    }

    #[test]
    fn the_checker_accepts_and_refuses() {
        // Write 1, then a read of 1: fine; a read of the initial value after the write returned: not.
        let good = [
            op(Kind::Write(Some(1)), 0, 2),
            op(Kind::Read(Some(1)), 3, 4),
        ];
        assert!(check(&good, None, 1000).is_ok());
        let bad = [op(Kind::Write(Some(1)), 0, 2), op(Kind::Read(None), 3, 4)];
        assert!(check(&bad, None, 1000).is_err());
        // Overlapping: either order.
        let overlap = [op(Kind::Write(Some(1)), 0, 5), op(Kind::Read(None), 1, 2)];
        assert!(check(&overlap, None, 1000).is_ok());
        // An unknown write may have happened (late) or not.
        let unknown = [
            op(Kind::Write(Some(1)), 0, UNKNOWN),
            op(Kind::Read(None), 3, 4),
            op(Kind::Read(Some(1)), 5, 6),
        ];
        assert!(check(&unknown, None, 1000).is_ok());
        let back = [
            op(Kind::Write(Some(1)), 0, UNKNOWN),
            op(Kind::Read(Some(1)), 3, 4),
            op(Kind::Read(None), 5, 6),
        ];
        assert!(check(&back, None, 1000).is_err());
    }

    #[test]
    fn a_search_over_budget_says_so() {
        // Many concurrent writes and no read: every order is fine, but a budget of 3 states is not
        // enough to place them one by one.
        let ops: Vec<Op> = (0..8)
            .map(|v| op(Kind::Write(Some(v)), 0, 100))
            .chain([op(Kind::Read(Some(99)), 101, 102)])
            .collect();
        let e = check(&ops, None, 3).unwrap_err();
        assert!(e.contains("budget"), "{e}");
    }
}
