//! Resource limits of the state machine; every bound is a named, configurable value.

use mqstate_protocol::hlc::DEFAULT_MAX_CLOCK_DRIFT_MS;

/// Default [`Limits::max_keys`].
pub const DEFAULT_MAX_KEYS: u64 = 10_000_000;
/// Default [`Limits::max_total_bytes`] (keys plus values): 1 GiB.
pub const DEFAULT_MAX_TOTAL_BYTES: u64 = 1 << 30;
/// Default [`Limits::max_key_bytes`]; the spec requires at least 6,500.
pub const DEFAULT_MAX_KEY_BYTES: u64 = 64 * 1024;
/// Default [`Limits::max_value_bytes`]; the spec requires at least 65,000.
pub const DEFAULT_MAX_VALUE_BYTES: u64 = 16 * 1024 * 1024;
/// Default [`Limits::max_registrations_per_client`].
pub const DEFAULT_MAX_REGISTRATIONS_PER_CLIENT: usize = 10_000;
/// Default [`Limits::scan_page_keys`]: a 100-key scan takes 2 pages (the spec allows 64).
pub const DEFAULT_SCAN_PAGE_KEYS: usize = 64;
/// Default [`Limits::scan_visit_max`].
pub const DEFAULT_SCAN_VISIT_MAX: usize = 4096;
/// Default [`Limits::scan_pattern_bytes_max`].
pub const DEFAULT_SCAN_PATTERN_BYTES_MAX: usize = 1024;
/// Default [`Limits::expire_batch_max`].
pub const DEFAULT_EXPIRE_BATCH_MAX: usize = 1024;

/// Limits applied by [`StateMachine`](crate::StateMachine). Exceeding a quota answers
/// `the quota has been exceeded` and changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most keys stored at once.
    pub max_keys: u64,
    /// Most key plus value bytes stored at once.
    pub max_total_bytes: u64,
    /// Longest key a SET may create (capped by the on-disk `Int32` length).
    pub max_key_bytes: u64,
    /// Longest value a SET may store (capped by the on-disk `Int32` length).
    pub max_value_bytes: u64,
    /// Most KEYNOTIFY registrations one client may hold.
    pub max_registrations_per_client: usize,
    /// Most keys in one SCAN page.
    pub scan_page_keys: usize,
    /// Most entries one SCAN request examines, matching or not, so a sparse pattern over a large
    /// keyspace costs bounded work per request (the client just asks for the next page).
    pub scan_visit_max: usize,
    /// Longest SCAN pattern (matching costs pattern × key length); longer is `syntax error`.
    pub scan_pattern_bytes_max: usize,
    /// Most keys one [`StateMachine::expire_due`](crate::StateMachine::expire_due) call deletes.
    pub expire_batch_max: usize,
    /// How far ahead of the server clock `__ts` and `__ft` may be.
    pub max_clock_drift_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_keys: DEFAULT_MAX_KEYS,
            max_total_bytes: DEFAULT_MAX_TOTAL_BYTES,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_registrations_per_client: DEFAULT_MAX_REGISTRATIONS_PER_CLIENT,
            scan_page_keys: DEFAULT_SCAN_PAGE_KEYS,
            scan_visit_max: DEFAULT_SCAN_VISIT_MAX,
            scan_pattern_bytes_max: DEFAULT_SCAN_PATTERN_BYTES_MAX,
            expire_batch_max: DEFAULT_EXPIRE_BATCH_MAX,
            max_clock_drift_ms: DEFAULT_MAX_CLOCK_DRIFT_MS,
        }
    }
}
