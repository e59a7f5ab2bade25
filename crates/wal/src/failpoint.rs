//! Crash-test hooks: named points where a test or an operator can make the process abort (to
//! test recovery) or an I/O call fail (to test the failed state).
//!
//! Armed from the environment with `MQSTATE_FAILPOINT=<name>` (aborts there) or in-process with
//! [`Failpoints::with_hook`]. Disarmed, a check costs one `Option` test.

use std::fmt;
use std::io;
use std::sync::Arc;

/// After a batch is written to the segment and before it is fsynced.
pub const AFTER_WRITE_BEFORE_FSYNC: &str = "after-write-before-fsync";
/// Halfway through writing a snapshot into `temp/`.
pub const MID_SNAPSHOT: &str = "mid-snapshot";
/// After a temp file (snapshot, metadata, segment) is fsynced, before it is renamed into place.
pub const BEFORE_RENAME: &str = "before-rename";
/// The environment variable that arms one failpoint to abort.
pub const FAILPOINT_ENV: &str = "MQSTATE_FAILPOINT";

/// What an armed failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    Continue,
    /// `std::process::abort()`: a crash without unwinding or flushing.
    Abort,
    /// The I/O call at this point fails with an injected error.
    Error,
}

type Hook = Arc<dyn Fn(&str) -> FailAction + Send + Sync>;

/// The set of armed failpoints (none by default).
#[derive(Clone, Default)]
pub struct Failpoints(Option<Hook>);

impl Failpoints {
    /// Arms the failpoint named by `MQSTATE_FAILPOINT`, if set, to abort.
    pub fn from_env() -> Self {
        match std::env::var(FAILPOINT_ENV) {
            Ok(armed) if !armed.is_empty() => Self::with_hook(move |name| {
                if name == armed {
                    FailAction::Abort
                } else {
                    FailAction::Continue
                }
            }),
            _ => Self::default(),
        }
    }

    pub fn with_hook(hook: impl Fn(&str) -> FailAction + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(hook)))
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
