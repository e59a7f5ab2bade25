//! CONNECT on a cluster node: before the client attaches, ask the broker's `SessionSource`
//! whether its session lives elsewhere, and put what it found in place (decision
//! 0047). Kept apart from the handshake so the cluster-wide client-id claim, which
//! runs before it, merges next to it.

use tokio::time::Instant;

use super::Connection;
use crate::codec::reason;
use crate::persist::{CopyId, Located};
use crate::registry::{Resume, Untaken, WillOnEnd};

/// How long to wait between tries to drop a stale copy that a connection here still holds.
const RETAKE_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

impl Connection {
    /// Asks where the session is and makes this broker hold the right copy before `attach`.
    /// Returns which copy `attach` takes: the one located here or taken in, which it must resume
    /// (not create), or the one held or a new one as `copy`; `None` (with the refusing CONNACK
    /// written) if the connection must close: the session could not be located (0x88 Server
    /// unavailable: retry) or a stale copy is still held by a connection here past `deadline`
    /// (0x89 Server busy: retry).
    pub(super) async fn locate_elsewhere(
        &mut self,
        deadline: Instant,
        copy: CopyId,
    ) -> Option<Resume> {
        let Some(source) = self.inner.elsewhere.clone() else {
            return Some(Resume::OrNew(copy));
        };
        let held = self.inner.registry.copy_of(&self.client_id);
        let located = source
            .locate(
                &self.client_id,
                self.connect.clean_start,
                // Kept in the cluster: a persistent session, or a clean one's will (decision 0063).
                self.session_expiry_secs > 0 || self.will.is_some(),
                held.is_some(),
                copy,
            )
            .await;
        let taken = match located {
            Ok(Located::Here) => {
                return Some(match held {
                    Some(held) if !self.connect.clean_start => Resume::Only(held),
                    _ => Resume::OrNew(copy),
                })
            }
            Ok(Located::Gone) => None,
            Ok(Located::Taken(stored)) => Some(stored),
            Err(error) => {
                tracing::warn!(client_id = %self.client_id, %error, "CONNECT refused: the session could not be located in the cluster");
                self.codec.refuse_connack(
                    reason::SERVER_UNAVAILABLE,
                    Some("the session cannot be located in the cluster now; retry"),
                    &mut self.out,
                );
                return None;
            }
        };
        // Whatever copy is here is stale (the claim this CONNECT made is the session's newest):
        // drop it, unrecorded; a connection still on it is told the session moved.
        while let Some(stale) = self.inner.registry.copy_of(&self.client_id) {
            match self.inner.forget(&self.client_id, stale) {
                // Dropped, or replaced meanwhile: look again.
                Ok(_) | Err(Untaken::Missing | Untaken::Another(_)) => {}
                Err(Untaken::Connected) if self.inner.clock.tokio_now() < deadline => {
                    self.inner.registry.send_control(
                        &self.client_id,
                        Some(stale),
                        crate::registry::Control::Disconnect {
                            reason_code: reason::SESSION_TAKEN_OVER,
                            reason_string: Some("the session moved to another node".into()),
                            will: WillOnEnd::Skip,
                        },
                    );
                    tokio::time::sleep(RETAKE_EVERY).await;
                }
                Err(Untaken::Connected) => {
                    self.codec.refuse_connack(
                        reason::SERVER_BUSY,
                        Some("an earlier connection still holds the session; retry"),
                        &mut self.out,
                    );
                    return None;
                }
            }
        }
        let Some(stored) = taken else {
            return Some(Resume::OrNew(copy));
        };
        let durable = match self.inner.adopt(self.client_id.clone(), *stored, copy) {
            Ok(adoption) => adoption.durable,
            Err(error) => {
                // Another CONNECT of the same client put a session here meanwhile.
                tracing::warn!(client_id = %self.client_id, %error, "CONNECT refused: a session raced it");
                self.codec.refuse_connack(
                    reason::SERVER_BUSY,
                    Some("another connection of this client is being set up; retry"),
                    &mut self.out,
                );
                return None;
            }
        };
        if let Some(durable) = durable {
            if let Err(error) = durable.await {
                tracing::warn!(client_id = %self.client_id, %error, "CONNECT refused: the restored session is not durable here");
                self.codec.refuse_connack(
                    reason::SERVER_UNAVAILABLE,
                    Some("the session could not be stored; retry"),
                    &mut self.out,
                );
                return None;
            }
        }
        tracing::info!(client_id = %self.client_id, "session restored from the cluster");
        Some(Resume::Only(copy))
    }
}
