//! Key-level authorization: the state store asks a [`KeyAuthorizer`] before it executes a command, and
//! answers `-ERR not authorized` (spec §3) when the answer is no. GET and KEYNOTIFY (start and stop)
//! read a key; SET, DEL and VDEL write it. SCAN is never refused: it returns only the keys the client may
//! read (a page can come back shorter, even empty, with a continuation token as usual).

use std::sync::Arc;

use mqstate_broker::Principal;

/// Decides which keys a client may read and write. Called on the executor for every request, so it
/// must be cheap and must not block.
pub trait KeyAuthorizer: Send + Sync + 'static {
    fn may_read(&self, who: Principal<'_>, key: &[u8]) -> bool;
    fn may_write(&self, who: Principal<'_>, key: &[u8]) -> bool;
}

/// Every client may read and write every key: the state store without configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllKeys;

impl KeyAuthorizer for AllKeys {
    fn may_read(&self, _: Principal<'_>, _: &[u8]) -> bool {
        true
    }

    fn may_write(&self, _: Principal<'_>, _: &[u8]) -> bool {
        true
    }
}

/// The key policy a service enforces (a handle, so [`crate::service::ServiceConfig`] stays plain data).
#[derive(Clone)]
pub struct KeyAccess(pub Arc<dyn KeyAuthorizer>);

impl Default for KeyAccess {
    fn default() -> Self {
        KeyAccess(Arc::new(AllKeys))
    }
}

impl std::fmt::Debug for KeyAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyAccess")
    }
}
