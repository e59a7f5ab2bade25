//! Crash-test hooks: named points where a test or an operator can make the process abort (to
//! test recovery) or an I/O call fail (to test the failed state).
//!
//! Armed from the environment with `MQSTATE_FAILPOINT=<name>` (aborts there), with
//! `MQSTATE_FAILPOINT=enospc:<marker file>` (every failpoint fails with "no space left on device"
//! while the marker file exists: a disk that fills and frees on demand, for tests that cannot mount
//! a small filesystem), with `<name>@<marker file>` (aborts there once the marker file exists: a
//! crash at a moment another process chooses, as the robustness suite does), or in-process with
//! [`Failpoints::with_hook`]. Several specs may be joined with `,`; the first that acts wins.
//! Disarmed, a check costs one `Option` test.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

/// After a batch is written to the segment and before it is fsynced.
pub const AFTER_WRITE_BEFORE_FSYNC: &str = "after-write-before-fsync";
/// Halfway through writing a snapshot into `temp/`.
pub const MID_SNAPSHOT: &str = "mid-snapshot";
/// After a temp file (snapshot, metadata, segment) is fsynced, before it is renamed into place.
pub const BEFORE_RENAME: &str = "before-rename";
/// Power loss at the log's fsync: the bytes written since the last completed fsync are discarded
/// (as a disk cache that never reached the platter), then the process aborts. Only the log checks
/// it; arm it with `power-loss@<marker>`.
pub const POWER_LOSS: &str = "power-loss";
/// The environment variable that arms one failpoint to abort (or all of them to fail, see
/// [`ENOSPC_PREFIX`]).
pub const FAILPOINT_ENV: &str = "MQSTATE_FAILPOINT";
/// `MQSTATE_FAILPOINT=enospc:<path>`: the disk is "full" while `<path>` exists.
pub const ENOSPC_PREFIX: &str = "enospc:";

/// What an armed failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    Continue,
    /// `std::process::abort()`: a crash without unwinding or flushing.
    Abort,
    /// The I/O call at this point fails with an injected error.
    Error,
    /// The I/O call at this point fails as on a full disk (`ErrorKind::StorageFull`).
    NoSpace,
}

type Hook = Arc<dyn Fn(&str) -> FailAction + Send + Sync>;

/// The set of armed failpoints (none by default).
#[derive(Clone, Default)]
pub struct Failpoints(Option<Hook>);

impl Failpoints {
    /// Arms what `MQSTATE_FAILPOINT` names, if set: one failpoint to abort, or with
    /// [`ENOSPC_PREFIX`] every failpoint to fail while the marker file exists.
    pub fn from_env() -> Self {
        std::env::var(FAILPOINT_ENV).map_or_else(|_| Self::default(), |spec| Self::parse(&spec))
    }

    /// The failpoints a `MQSTATE_FAILPOINT` value arms: specs joined with `,`, the first that acts wins.
    fn parse(spec: &str) -> Self {
        let armed: Vec<Self> = spec.split(',').map(Self::parse_one).collect();
        match armed.len() {
            1 => armed.into_iter().next().unwrap_or_default(),
            _ => Self::with_hook(move |name| {
                armed
                    .iter()
                    .filter_map(|f| f.0.as_ref())
                    .map(|hook| hook(name))
                    .find(|action| *action != FailAction::Continue)
                    .unwrap_or(FailAction::Continue)
            }),
        }
    }

    /// One spec: `enospc:<marker>`, `<name>@<marker>` or `<name>`.
    fn parse_one(spec: &str) -> Self {
        if let Some(marker) = spec.strip_prefix(ENOSPC_PREFIX) {
            let marker = PathBuf::from(marker);
            return Self::with_hook(move |_| {
                if marker.exists() {
                    FailAction::NoSpace
                } else {
                    FailAction::Continue
                }
            });
        }
        if spec.is_empty() {
            return Self::default();
        }
        if let Some((armed, marker)) = spec.split_once('@') {
            let (armed, marker) = (armed.to_owned(), PathBuf::from(marker));
            return Self::with_hook(move |name| {
                if name == armed && marker.exists() {
                    FailAction::Abort
                } else {
                    FailAction::Continue
                }
            });
        }
        let armed = spec.to_owned();
        Self::with_hook(move |name| {
            if name == armed {
                FailAction::Abort
            } else {
                FailAction::Continue
            }
        })
    }

    pub fn with_hook(hook: impl Fn(&str) -> FailAction + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(hook)))
    }

    /// Whether the failpoint `name` is armed to abort now (for points that do more than abort
    /// first, such as [`POWER_LOSS`]). A full disk (`enospc`) fails I/O calls; it arms no crash.
    pub(crate) fn aborts_at(&self, name: &str) -> bool {
        self.0
            .as_ref()
            .is_some_and(|hook| hook(name) == FailAction::Abort)
    }

    /// Whether any failpoint is armed (a caller may prepare for one, e.g. wait for durability).
    pub fn is_armed(&self) -> bool {
        self.0.is_some()
    }

    /// A crash point outside this crate: aborts if armed to, ignores injected I/O errors.
    pub fn hit(&self, name: &str) {
        if let Some(hook) = &self.0 {
            if hook(name) == FailAction::Abort {
                tracing::error!(failpoint = name, "failpoint armed: aborting the process");
                std::process::abort()
            }
        }
    }

    pub(crate) fn check(&self, name: &str) -> io::Result<()> {
        let Some(hook) = &self.0 else { return Ok(()) };
        match hook(name) {
            FailAction::Continue => Ok(()),
            FailAction::Abort => {
                tracing::error!(failpoint = name, "failpoint armed: aborting the process");
                std::process::abort()
            }
            FailAction::Error => Err(io::Error::other(format!(
                "injected failure at failpoint {name}"
            ))),
            FailAction::NoSpace => Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!("no space left on device (injected at failpoint {name})"),
            )),
        }
    }
}

impl fmt::Debug for Failpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Failpoints(armed)"
        } else {
            "Failpoints(none)"
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_fails_every_point_while_the_marker_exists() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("full");
        let failpoints = Failpoints::parse(&format!("{ENOSPC_PREFIX}{}", marker.display()));
        assert!(failpoints.check(AFTER_WRITE_BEFORE_FSYNC).is_ok());
        std::fs::write(&marker, b"").unwrap();
        for name in [AFTER_WRITE_BEFORE_FSYNC, MID_SNAPSHOT, BEFORE_RENAME] {
            let error = failpoints.check(name).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::StorageFull, "{name}");
        }
        std::fs::remove_file(&marker).unwrap();
        assert!(failpoints.check(BEFORE_RENAME).is_ok());
    }

    #[test]
    fn a_marker_arms_one_point_and_specs_combine() {
        let dir = tempfile::tempdir().unwrap();
        let (full, crash) = (dir.path().join("full"), dir.path().join("crash"));
        let failpoints = Failpoints::parse(&format!(
            "{ENOSPC_PREFIX}{},{POWER_LOSS}@{}",
            full.display(),
            crash.display()
        ));
        assert!(!failpoints.aborts_at(POWER_LOSS));
        std::fs::write(&crash, b"").unwrap();
        assert!(failpoints.aborts_at(POWER_LOSS));
        assert!(!failpoints.aborts_at(MID_SNAPSHOT), "only the named point");
        std::fs::remove_file(&crash).unwrap();
        std::fs::write(&full, b"").unwrap();
        let error = failpoints.check(MID_SNAPSHOT).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::StorageFull);
        assert!(
            !failpoints.aborts_at(POWER_LOSS),
            "a full disk is not a power loss"
        );
    }

    #[test]
    fn empty_spec_arms_nothing() {
        assert!(Failpoints::parse("").0.is_none());
    }
}
