//! The sequential specification of one key (spec §3, §5): value, version, fencing token and expiry.
//!
//! Nondeterministic where the history cannot tell: an operation whose outcome is unknown may or may
//! not have taken effect (and if it did, its version is unknown), and a key set with `PX` may or may
//! not have expired at an operation that ran around its deadline (the deadline is the server's wall
//! clock at the SET plus `PX`; the client only knows the SET's invocation and return). So a step maps
//! one state to a set of states, and the checker carries sets (as porcupine's powerset models do).

use crate::history::{Cmd, Condition, Outcome, Version};

/// Milliseconds of tolerance between the client's and the server's reading of the same clock.
pub const CLOCK_SLACK_MS: u64 = 2;

/// Text of the fencing errors (spec §3): deterministic refusals the model predicts.
const FENCE_REQUIRED: &str = "a fencing token is required for this request";
const FENCE_LOWER: &str =
    "the request fencing token is a lower version than the fencing token protecting the resource";

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub value: String,
    /// `None` when written by an operation whose reply never came.
    pub version: Option<Version>,
    pub token: Option<Version>,
    /// Earliest and latest possible deadline (wall ms).
    pub deadline_ms: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyState {
    pub entry: Option<Entry>,
    /// The highest version this key is known to have had: later versions are above it.
    pub floor: Option<Version>,
}

/// One operation as the model sees it.
#[derive(Debug, Clone)]
pub struct Step<'a> {
    pub cmd: &'a Cmd,
    pub outcome: &'a Outcome,
    /// Invocation (wall ms).
    pub invoked_ms: u64,
    /// The latest moment it can have taken effect (wall ms; `u64::MAX` if unbounded).
    pub effect_end_ms: u64,
    /// How far the clock that judges an expiry may be from the client's: `CLOCK_SLACK_MS`, plus
    /// the spread of the nodes' clock offsets on a cluster whose nodes were skewed (a key's
    /// deadline is stamped by one head and may be judged by another after a fail-over).
    pub clock_slack_ms: u64,
}

/// What the sequential specification answers in one state.
#[derive(Debug, PartialEq, Eq)]
enum Expected {
    Written,
    NotApplied,
    Hit,
    Miss,
    Deleted(i64),
    Refused(&'static str),
}

/// Every state `state` can move to under `step` with the recorded outcome; empty if the outcome
/// is impossible from `state`.
pub fn step(state: &KeyState, step: &Step<'_>) -> Vec<KeyState> {
    let mut next = Vec::new();
    for view in expiry_views(state, step) {
        apply(&view, step, &mut next);
    }
    next
}

/// `state` as the operation may have seen it: with a key whose deadline may have passed, both the
/// live and the expired key.
fn expiry_views(state: &KeyState, step: &Step<'_>) -> Vec<KeyState> {
    let Some((lo, hi)) = state.entry.as_ref().and_then(|e| e.deadline_ms) else {
        return vec![state.clone()];
    };
    // Live if it ran at some t before the deadline d, expired if at some t at or after it.
    let live = step.invoked_ms < hi.saturating_add(step.clock_slack_ms);
    let expired = step.effect_end_ms.saturating_add(step.clock_slack_ms) >= lo;
    let mut views = Vec::with_capacity(2);
    if live {
        views.push(state.clone());
    }
    if expired {
        views.push(KeyState {
            entry: None,
            floor: state.floor.clone(),
        });
    }
    views
}

/// The fencing rule (spec §5): the token to store, or the refusal.
fn fence(
    stored: Option<&Version>,
    request: Option<&Version>,
) -> Result<Option<Version>, &'static str> {
    match (stored, request) {
        (None, request) => Ok(request.cloned()),
        (Some(_), None) => Err(FENCE_REQUIRED),
        (Some(stored), Some(request)) if request < stored => Err(FENCE_LOWER),
        (Some(stored), Some(request)) => Ok(Some(stored.max(request).clone())),
    }
}

/// What `cmd` answers in `view`, and the state after it if it changes the key (with the version
/// to be filled in from the reply).
fn specify(view: &KeyState, step: &Step<'_>) -> (Expected, Option<Option<Entry>>) {
    let current = view.entry.as_ref();
    match step.cmd {
        Cmd::Set {
            value,
            condition,
            px_ms,
            fencing_token,
        } => {
            let token = match fence(
                current.and_then(|e| e.token.as_ref()),
                fencing_token.as_ref(),
            ) {
                Ok(token) => token,
                Err(refusal) => return (Expected::Refused(refusal), None),
            };
            let applies = match (condition, current) {
                (Condition::Always, _) | (_, None) => true,
                (Condition::NotExists, Some(_)) => false,
                (Condition::NotExistsOrEqual, Some(e)) => e.value == *value,
            };
            if !applies {
                return (Expected::NotApplied, None);
            }
            let entry = Entry {
                value: value.clone(),
                version: None,
                token,
                deadline_ms: px_ms.map(|px| {
                    (
                        step.invoked_ms.saturating_add(px),
                        step.effect_end_ms.saturating_add(px),
                    )
                }),
            };
            (Expected::Written, Some(Some(entry)))
        }
        Cmd::Get => match current {
            Some(_) => (Expected::Hit, None),
            None => (Expected::Miss, None),
        },
        Cmd::Del { fencing_token } | Cmd::VDel { fencing_token, .. } => {
            let Some(current) = current else {
                return (Expected::Deleted(0), None);
            };
            if let Err(refusal) = fence(current.token.as_ref(), fencing_token.as_ref()) {
                return (Expected::Refused(refusal), None);
            }
            if let Cmd::VDel { value, .. } = step.cmd {
                if *value != current.value {
                    return (Expected::Deleted(-1), None);
                }
            }
            (Expected::Deleted(1), Some(None))
        }
    }
}

fn apply(view: &KeyState, step: &Step<'_>, next: &mut Vec<KeyState>) {
    let (expected, change) = specify(view, step);
    let changed = |entry: Option<Entry>| KeyState {
        entry,
        floor: view.floor.clone(),
    };
    match (step.outcome, expected) {
        (Outcome::Unknown, _) => {
            next.push(view.clone());
            if let Some(entry) = change {
                next.push(changed(entry));
            }
        }
        (Outcome::Error(text), Expected::Refused(refusal)) if text == refusal => {
            next.push(view.clone());
        }
        // Other errors (a full disk, a quota) are refusals without effect that the model does
        // not predict; a fencing error the model did not predict is a violation.
        (Outcome::Error(text), _) if text != FENCE_REQUIRED && text != FENCE_LOWER => {
            next.push(view.clone());
        }
        (Outcome::Written(version), Expected::Written) => {
            let above_floor = view.floor.as_ref().is_none_or(|f| version > f);
            if let (true, Some(Some(mut entry))) = (above_floor, change) {
                entry.version = Some(version.clone());
                next.push(KeyState {
                    entry: Some(entry),
                    floor: Some(version.clone()),
                });
            }
        }
        (Outcome::NotApplied, Expected::NotApplied) | (Outcome::Miss, Expected::Miss) => {
            next.push(view.clone());
        }
        (Outcome::Hit { value, version }, Expected::Hit) => {
            let Some(entry) = &view.entry else { return };
            if entry.value != *value {
                return;
            }
            match &entry.version {
                Some(known) if known == version => next.push(view.clone()),
                Some(_) => {}
                None if view.floor.as_ref().is_none_or(|f| version > f) => {
                    let mut learned = view.clone();
                    if let Some(e) = learned.entry.as_mut() {
                        e.version = Some(version.clone());
                    }
                    learned.floor = Some(version.clone());
                    next.push(learned);
                }
                None => {}
            }
        }
        (Outcome::Deleted(n), Expected::Deleted(m)) if *n == m => {
            next.push(match change {
                Some(entry) => changed(entry),
                None => view.clone(),
            });
        }
        _ => {}
    }
}

/// Histories written by hand in the checker's and the model's tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use crate::history::{Cmd, Condition, Version};

    /// The version whose wall clock is `ms`.
    pub(crate) fn v(ms: u64) -> Version {
        Version::parse(&format!("{ms:015}:00000:n")).unwrap()
    }

    /// An unconditional SET without expiry or fencing.
    pub(crate) fn set(value: &str) -> Cmd {
        Cmd::Set {
            value: value.into(),
            condition: Condition::Always,
            px_ms: None,
            fencing_token: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{set, v};
    use super::*;

    fn at<'a>(cmd: &'a Cmd, outcome: &'a Outcome, t: u64) -> Step<'a> {
        Step {
            cmd,
            outcome,
            invoked_ms: t,
            effect_end_ms: t + 1,
            clock_slack_ms: CLOCK_SLACK_MS,
        }
    }

    #[test]
    fn a_write_then_a_read_of_it_is_legal_and_a_stale_version_is_not() {
        let (s, written) = (set("a"), Outcome::Written(v(10)));
        let after = step(&KeyState::default(), &at(&s, &written, 0));
        assert_eq!(after.len(), 1);
        let get = Cmd::Get;
        let hit = Outcome::Hit {
            value: "a".into(),
            version: v(10),
        };
        assert_eq!(step(&after[0], &at(&get, &hit, 2)).len(), 1);
        let stale = Outcome::Hit {
            value: "a".into(),
            version: v(9),
        };
        assert!(step(&after[0], &at(&get, &stale, 2)).is_empty());
        // A second write must get a higher version.
        let older = Outcome::Written(v(5));
        assert!(step(&after[0], &at(&set("b"), &older, 3)).is_empty());
    }

    #[test]
    fn an_unknown_write_may_or_may_not_have_happened() {
        let (s, unknown) = (set("a"), Outcome::Unknown);
        let after = step(&KeyState::default(), &at(&s, &unknown, 0));
        assert_eq!(after.len(), 2);
        assert!(after.iter().any(|k| k.entry.is_none()));
        assert!(after
            .iter()
            .any(|k| k.entry.as_ref().is_some_and(|e| e.value == "a")));
    }

    #[test]
    fn an_older_fencing_token_is_refused_and_accepting_it_is_illegal() {
        let fenced = |value: &str, token: u64| Cmd::Set {
            value: value.into(),
            condition: Condition::Always,
            px_ms: None,
            fencing_token: Some(v(token)),
        };
        let first = fenced("a", 100);
        let ok = Outcome::Written(v(200));
        let state = step(&KeyState::default(), &at(&first, &ok, 0)).remove(0);
        let stale = fenced("b", 50);
        let refused = Outcome::Error(FENCE_LOWER.into());
        assert_eq!(step(&state, &at(&stale, &refused, 1)).len(), 1);
        let accepted = Outcome::Written(v(300));
        assert!(step(&state, &at(&stale, &accepted, 1)).is_empty());
        let unfenced = set("c");
        let required = Outcome::Error(FENCE_REQUIRED.into());
        assert_eq!(step(&state, &at(&unfenced, &required, 1)).len(), 1);
    }

    #[test]
    fn a_key_near_its_deadline_may_be_live_or_expired() {
        let s = Cmd::Set {
            value: "a".into(),
            condition: Condition::Always,
            px_ms: Some(100),
            fencing_token: None,
        };
        let ok = Outcome::Written(v(1));
        let state = step(&KeyState::default(), &at(&s, &ok, 1000)).remove(0);
        let (get, miss) = (Cmd::Get, Outcome::Miss);
        assert!(
            step(&state, &at(&get, &miss, 1010)).is_empty(),
            "long before the deadline"
        );
        assert_eq!(step(&state, &at(&get, &miss, 1100)).len(), 1, "around it");
        let hit = Outcome::Hit {
            value: "a".into(),
            version: v(1),
        };
        assert!(
            step(&state, &at(&get, &hit, 1200)).is_empty(),
            "long after it"
        );
    }

    #[test]
    fn vdel_compares_the_value() {
        let (s, ok) = (set("a"), Outcome::Written(v(1)));
        let state = step(&KeyState::default(), &at(&s, &ok, 0)).remove(0);
        let vdel = |value: &str| Cmd::VDel {
            value: value.into(),
            fencing_token: None,
        };
        let (other, mismatch) = (vdel("b"), Outcome::Deleted(-1));
        assert_eq!(step(&state, &at(&other, &mismatch, 1)).len(), 1);
        let (same, deleted) = (vdel("a"), Outcome::Deleted(1));
        let after = step(&state, &at(&same, &deleted, 1));
        assert_eq!(after.len(), 1);
        assert!(after[0].entry.is_none());
        assert!(step(&state, &at(&same, &mismatch, 1)).is_empty());
    }
}
