//! Wing–Gong–Lowe linearizability check of one key's history against a register (the idea of
//! `crates/robustness/src/linearizability.rs`, for the simpler model here): depth-first, placing at
//! each step any operation that was invoked before every unplaced operation returned, memoizing
//! (placed set, register value). A write whose outcome is unknown never returns and may be left out.

use std::collections::HashSet;

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
    /// `u64::MAX`: the outcome is unknown (a write may have taken effect or not).
    pub returned: u64,
}

/// `Ok` or the ops of the longest linearizable prefix found and an op that could not follow it.
pub fn check(ops: &[Op], initial: Option<u64>, max_states: usize) -> Result<(), String> {
    let n = ops.len();
    let words = n.div_ceil(64);
    let mut seen: HashSet<(Vec<u64>, Option<u64>)> = HashSet::new();
    // (placed, value, next candidate index to try)
    let mut stack: Vec<(Vec<u64>, Option<u64>)> = vec![(vec![0; words], initial)];
    let must: usize = ops.iter().filter(|o| o.returned != u64::MAX).count();
    let mut best = 0;
    while let Some((placed, value)) = stack.pop() {
        let count_done = (0..n)
            .filter(|&i| placed[i / 64] >> (i % 64) & 1 == 1 && ops[i].returned != u64::MAX)
            .count();
        best = best.max(count_done);
        if count_done == must {
            return Ok(());
        }
        if !seen.insert((placed.clone(), value)) {
            continue;
        }
        if seen.len() > max_states {
            return Err(format!("search budget of {max_states} states exhausted"));
        }
        let horizon = (0..n)
            .filter(|&i| placed[i / 64] >> (i % 64) & 1 == 0)
            .map(|i| ops[i].returned)
            .min()
            .unwrap_or(u64::MAX);
        for i in 0..n {
            if placed[i / 64] >> (i % 64) & 1 == 1 || ops[i].invoked > horizon {
                continue;
            }
            let next = match ops[i].kind {
                Kind::Write(v) => v,
                Kind::Read(v) if v == value => value,
                Kind::Read(_) => continue,
            };
            let mut p = placed.clone();
            p[i / 64] |= 1 << (i % 64);
            stack.push((p, next));
        }
    }
    Err(format!(
        "not linearizable: at most {best} of {must} completed operations can be ordered"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
            op(Kind::Write(Some(1)), 0, u64::MAX),
            op(Kind::Read(None), 3, 4),
            op(Kind::Read(Some(1)), 5, 6),
        ];
        assert!(check(&unknown, None, 1000).is_ok());
        let back = [
            op(Kind::Write(Some(1)), 0, u64::MAX),
            op(Kind::Read(Some(1)), 3, 4),
            op(Kind::Read(None), 5, 6),
        ];
        assert!(check(&back, None, 1000).is_err());
    }
}
