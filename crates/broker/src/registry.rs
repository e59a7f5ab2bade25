//! Client id -> session, connection ownership and atomic takeover.
//!
//! Takeover protocol: a new connection asks the registry to attach. If another connection owns the
//! session, the registry sends that connection [`Control::TakeOver`] and the new connection waits
//! (bounded) for the old one to detach and reply; then it attaches. If the old connection does not
//! answer in time the new one takes the session by force. Either way the new connection is never
//! refused. All ownership changes happen under the registry mutex; each one bumps the session's
//! epoch so that timers armed for an older epoch (will delay, session expiry) become no-ops.
//!
//! The registry does no I/O and publishes nothing itself: it returns what must happen (wills to
//! publish, sessions that ended, timers to arm) for the caller to carry out outside the lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mqstate_clock::SharedClock;
use tokio::sync::oneshot;

use crate::mailbox;

use crate::persist::{CopyId, Durable, SessionChange, SessionJournal};
use crate::session::SessionHandle;
use crate::will::Will;

/// Requests to a connection task from the rest of the broker.
#[derive(Debug)]
pub(crate) enum Control {
    /// Another connection wants this session: disconnect with 0x8E, detach, then reply.
    TakeOver { done: oneshot::Sender<()> },
    /// Disconnect with this reason (a service asked for it); `will` says what becomes of the
    /// connection's will.
    Disconnect {
        reason_code: u8,
        reason_string: Option<String>,
        will: WillOnEnd,
    },
}

/// What becomes of the will of a connection when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WillOnEnd {
    /// Published now, or armed if delayed, as at any abnormal end.
    Publish,
    /// Not published: the client ended normally, or the session moved to another node, whose
    /// copy holds the will.
    Skip,
    /// As `Publish`, but a will due now waits until what this node recorded of the session (the
    /// connection's end) landed in its row, and is dropped if another node took the session
    /// over first: a cluster node whose lease lapsed sends its clients away, and another node
    /// may be adopting their sessions (decision 0057). (On a cluster node a delayed will always
    /// waits so: `session_timer`.)
    OnceLanded,
}

/// The connection that currently owns a session.
pub(crate) struct Owner {
    pub conn_id: u64,
    pub control: mailbox::Sender<Control>,
}

struct Entry {
    handle: Arc<SessionHandle>,
    /// Which copy of the client's session this is: a drop that names another leaves it.
    copy: CopyId,
    owner: Option<Owner>,
    epoch: u64,
    /// A delayed will and when it is due (wall-clock ms).
    /// Boxed: one entry per session, and few have a delayed will.
    pending_will: Option<Box<(Will, u64)>>,
}

#[derive(Default)]
struct Sessions {
    by_client: HashMap<Arc<str>, Entry>,
    next_epoch: u64,
}

impl Sessions {
    fn bump(&mut self) -> u64 {
        self.next_epoch += 1;
        self.next_epoch
    }
}

pub(crate) struct Registry {
    sessions: Mutex<Sessions>,
    /// The last copy identity given out.
    last_copy: AtomicU64,
    journal: Option<Arc<dyn SessionJournal>>,
    /// When connections end, and the wall time of it the journal records.
    clock: SharedClock,
}

/// Side effects of a registry change, to carry out after the lock is released.
#[derive(Default)]
pub(crate) struct Effects {
    pub wills: Vec<Will>,
    pub ended: Vec<Arc<SessionHandle>>,
    pub timer: Option<Timer>,
}

/// Deadlines of a session that lost its connection.
#[derive(Debug, Clone)]
pub(crate) struct Timer {
    pub client_id: Arc<str>,
    pub epoch: u64,
    pub will_at: Option<Instant>,
    pub expire_at: Option<Instant>,
}

/// A session removed from the registry to be handed over.
pub(crate) struct Taken {
    pub handle: Arc<SessionHandle>,
    /// Its delayed will and when it is due (wall-clock ms).
    pub will: Option<(Will, u64)>,
}

/// Why a session could not be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Untaken {
    Missing,
    Connected,
    /// The copy held is not the one named.
    Another(CopyId),
}

/// Which copy of its session a CONNECT attaches to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resume {
    /// The copy held (unless Clean Start discards it), or else a new one, which gets this
    /// identity.
    OrNew(CopyId),
    /// This copy, located here or taken in for the CONNECT. If it is gone (dropped, expired)
    /// nothing is created ([`Attach::Vanished`]): a fresh session would answer Session Present 0
    /// for a session that may exist elsewhere.
    Only(CopyId),
}

pub(crate) enum Attach {
    Attached {
        handle: Arc<SessionHandle>,
        session_present: bool,
        effects: Effects,
        /// When the session's new state is durable (CONNACK waits for it).
        durable: Option<Durable>,
    },
    /// Another connection owns the session and was asked to hand it over.
    Wait(oneshot::Receiver<()>),
    /// [`Resume::Only`], and that copy is not here: nothing was created.
    Vanished,
}

impl Registry {
    pub(crate) fn new(journal: Option<Arc<dyn SessionJournal>>, clock: SharedClock) -> Self {
        Self {
            sessions: Mutex::default(),
            last_copy: AtomicU64::new(0),
            journal,
            clock,
        }
    }

    /// A copy identity not given out before.
    pub(crate) fn new_copy(&self) -> CopyId {
        CopyId(self.last_copy.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn new_session(&self, client_id: &Arc<str>, expiry_secs: u32) -> Arc<SessionHandle> {
        Arc::new(SessionHandle::new(
            client_id.clone(),
            expiry_secs,
            self.journal.clone(),
            self.clock.clone(),
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Sessions> {
        // Updates under this lock are single map operations; a poisoned lock still holds a
        // consistent map.
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches connection `owner` to `client_id`'s session (creating it, or discarding the old one
    /// when `clean_start`), the copy `resume` says. With `force`, a current owner is displaced
    /// without waiting.
    pub(crate) fn attach(
        &self,
        client_id: &Arc<str>,
        clean_start: bool,
        expiry_secs: u32,
        owner: Owner,
        force: bool,
        resume: Resume,
    ) -> Attach {
        let mut sessions = self.lock();
        let new_copy = match resume {
            Resume::OrNew(copy) => copy,
            Resume::Only(copy) => {
                if sessions
                    .by_client
                    .get(client_id)
                    .is_none_or(|e| e.copy != copy)
                {
                    return Attach::Vanished;
                }
                copy
            }
        };
        if let Some(entry) = sessions.by_client.get_mut(client_id) {
            if let Some(current) = &entry.owner {
                if !force && current.conn_id != owner.conn_id {
                    let (done, wait) = oneshot::channel();
                    if current.control.try_send(Control::TakeOver { done }).is_ok() {
                        return Attach::Wait(wait);
                    }
                    // The old connection's task is gone or swamped: take the session now.
                }
            }
        }
        let epoch = sessions.bump();
        let mut effects = Effects::default();
        let (handle, copy, session_present) = match sessions.by_client.remove(client_id) {
            Some(mut old) => {
                if let Some(displaced) = old.owner.take() {
                    // Forced takeover: tell the old task (best effort) it no longer owns anything.
                    let _ = displaced.control.try_send(Control::Disconnect {
                        reason_code: crate::codec::reason::SESSION_TAKEN_OVER,
                        reason_string: None,
                        will: WillOnEnd::Publish,
                    });
                }
                if clean_start {
                    effects.wills.extend(old.pending_will.take().map(|p| p.0));
                    old.handle.set_online(false);
                    old.handle.lock().end();
                    effects.ended.push(old.handle);
                    (self.new_session(client_id, expiry_secs), new_copy, false)
                } else {
                    // Reconnecting cancels a delayed will.
                    old.handle.lock().attached(expiry_secs, &*self.clock);
                    (old.handle, old.copy, true)
                }
            }
            None => (self.new_session(client_id, expiry_secs), new_copy, false),
        };
        let durable = handle.lock().commit();
        handle.set_online(true);
        sessions.by_client.insert(
            client_id.clone(),
            Entry {
                handle: handle.clone(),
                copy,
                owner: Some(owner),
                epoch,
                pending_will: None,
            },
        );
        Attach::Attached {
            handle,
            session_present,
            effects,
            durable,
        }
    }

    /// Detaches connection `conn_id`. `will` is the will to publish (already filtered by how the
    /// connection ended). Returns what to do next: publish now, arm a timer, or end the session.
    pub(crate) fn detach(&self, client_id: &Arc<str>, conn_id: u64, will: Option<Will>) -> Effects {
        let mut effects = Effects::default();
        let mut sessions = self.lock();
        let epoch = sessions.bump();
        let Some(entry) = sessions.by_client.get_mut(client_id) else {
            effects.wills.extend(will.filter(|w| w.delay_secs == 0));
            return effects;
        };
        if entry.owner.as_ref().is_none_or(|o| o.conn_id != conn_id) {
            // Displaced by a forced takeover: the session is someone else's now. A delayed will
            // would be cancelled by that reconnect anyway.
            effects.wills.extend(will.filter(|w| w.delay_secs == 0));
            return effects;
        }
        entry.owner = None;
        entry.epoch = epoch;
        entry.handle.set_online(false);
        let expiry_secs = entry.handle.lock().expiry_interval_secs;
        if expiry_secs == 0 {
            if let Some(ended) = sessions.by_client.remove(client_id) {
                ended.handle.lock().end();
                effects.ended.push(ended.handle);
            }
            effects.wills.extend(will);
            return effects;
        }
        let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
        let expire_at =
            (expiry_secs != u32::MAX).then(|| now + Duration::from_secs(u64::from(expiry_secs)));
        let mut state = entry.handle.lock();
        state.detached(now_ms);
        let mut will_at = None;
        match will {
            Some(w) if w.delay_secs == 0 => effects.wills.push(w),
            Some(w) => {
                let delay = Duration::from_secs(u64::from(w.delay_secs.min(expiry_secs)));
                will_at = Some(now + delay);
                let at_ms = now_ms.saturating_add(u64::try_from(delay.as_millis()).unwrap_or(0));
                state.note(|client_id| SessionChange::WillScheduled {
                    client_id,
                    will: w.clone(),
                    at_ms,
                });
                entry.pending_will = Some(Box::new((w, at_ms)));
            }
            None => {}
        }
        drop(state);
        effects.timer = Some(Timer {
            client_id: client_id.clone(),
            epoch,
            will_at,
            expire_at,
        });
        effects
    }

    /// The delayed will of a session still disconnected since `epoch`, if any.
    pub(crate) fn take_due_will(&self, client_id: &str, epoch: u64) -> Option<Will> {
        let mut sessions = self.lock();
        let entry = sessions.by_client.get_mut(client_id)?;
        if entry.epoch != epoch || entry.owner.is_some() {
            return None;
        }
        let (will, _) = *entry.pending_will.take()?;
        entry
            .handle
            .lock()
            .note(|client_id| SessionChange::WillCancelled { client_id });
        Some(will)
    }

    /// Ends a session still disconnected since `epoch` (its expiry passed).
    pub(crate) fn expire(&self, client_id: &str, epoch: u64) -> Effects {
        let mut effects = Effects::default();
        let mut sessions = self.lock();
        let still_idle = sessions
            .by_client
            .get(client_id)
            .is_some_and(|e| e.epoch == epoch && e.owner.is_none());
        if still_idle {
            if let Some(mut entry) = sessions.by_client.remove(client_id) {
                effects.wills.extend(entry.pending_will.take().map(|p| p.0));
                entry.handle.lock().end();
                effects.ended.push(entry.handle);
            }
        }
        effects
    }

    /// Ends the session that connection `conn_id` created (Session Present 0) when its CONNECT
    /// was refused (its state could not be made durable): a refused CONNECT leaves nothing
    /// behind, so the client's next attempt gets the answer it would have got without it. The
    /// journal records the session as deleted (a row that landed after all goes too). Returns
    /// the session ended, if the connection still owned it.
    pub(crate) fn discard_refused(
        &self,
        client_id: &str,
        conn_id: u64,
    ) -> Option<Arc<SessionHandle>> {
        let mut sessions = self.lock();
        let owned = sessions
            .by_client
            .get(client_id)
            .and_then(|e| e.owner.as_ref())
            .is_some_and(|o| o.conn_id == conn_id);
        if !owned {
            return None;
        }
        let entry = sessions.by_client.remove(client_id)?;
        entry.handle.set_online(false);
        entry.handle.lock().end();
        Some(entry.handle)
    }

    /// Adds a session read back from a journal or handed over by another node, not connected,
    /// with its delayed will, as copy `copy`. Returns the epoch its timers must be armed with, or
    /// `None` (and adds nothing) if the client has a session already.
    pub(crate) fn restore(
        &self,
        handle: Arc<SessionHandle>,
        will: Option<(Will, u64)>,
        copy: CopyId,
    ) -> Option<u64> {
        let mut sessions = self.lock();
        if sessions.by_client.contains_key(&handle.client_id) {
            return None;
        }
        let epoch = sessions.bump();
        sessions.by_client.insert(
            handle.client_id.clone(),
            Entry {
                handle,
                copy,
                owner: None,
                epoch,
                pending_will: will.map(Box::new),
            },
        );
        Some(epoch)
    }

    /// Removes the session of `client_id` (if `copy` names one, only that copy) if no connection
    /// owns it, with its pending delayed will: the session is handed over to another node, or
    /// the copy is obsolete. Its timers, armed for the epoch it had, find no entry of that epoch
    /// and do nothing.
    pub(crate) fn take(&self, client_id: &str, copy: Option<CopyId>) -> Result<Taken, Untaken> {
        let mut sessions = self.lock();
        match sessions.by_client.get(client_id) {
            None => return Err(Untaken::Missing),
            Some(entry) if copy.is_some_and(|copy| copy != entry.copy) => {
                return Err(Untaken::Another(entry.copy))
            }
            Some(entry) if entry.owner.is_some() => return Err(Untaken::Connected),
            Some(_) => {}
        }
        let mut entry = sessions
            .by_client
            .remove(client_id)
            .ok_or(Untaken::Missing)?;
        Ok(Taken {
            will: entry.pending_will.take().map(|p| *p),
            handle: entry.handle,
        })
    }

    /// The changes that recreate every journalled session (with its delayed will) from nothing, by
    /// client id (the order does not depend on the map's hash).
    pub(crate) fn image(&self, now: Instant, now_ms: u64) -> Vec<SessionChange> {
        let sessions = self.lock();
        let mut entries: Vec<&Entry> = sessions.by_client.values().collect();
        entries.sort_unstable_by(|a, b| a.handle.client_id.cmp(&b.handle.client_id));
        let mut image = Vec::new();
        for entry in entries {
            let state = entry.handle.lock();
            if !state.in_journal {
                continue;
            }
            image.extend(state.image(now, now_ms));
            if let Some((will, at_ms)) = entry.pending_will.as_deref() {
                image.push(SessionChange::WillScheduled {
                    client_id: entry.handle.client_id.clone(),
                    will: will.clone(),
                    at_ms: *at_ms,
                });
            }
        }
        image
    }

    pub(crate) fn session(&self, client_id: &str) -> Option<Arc<SessionHandle>> {
        self.lock()
            .by_client
            .get(client_id)
            .map(|e| e.handle.clone())
    }

    /// Sends `control` to the connection owning `client_id`'s session (if `copy` names one,
    /// only if the session is that copy); false if none.
    pub(crate) fn send_control(
        &self,
        client_id: &str,
        copy: Option<CopyId>,
        control: Control,
    ) -> bool {
        let sessions = self.lock();
        sessions
            .by_client
            .get(client_id)
            .filter(|e| copy.is_none_or(|copy| copy == e.copy))
            .and_then(|e| e.owner.as_ref())
            .is_some_and(|o| o.control.try_send(control).is_ok())
    }

    /// Which copy of `client_id`'s session is here, if any.
    pub(crate) fn copy_of(&self, client_id: &str) -> Option<CopyId> {
        self.lock().by_client.get(client_id).map(|e| e.copy)
    }

    /// Number of sessions, connected or not.
    pub(crate) fn len(&self) -> usize {
        self.lock().by_client.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Message, QoS};
    use bytes::Bytes;
    use mqstate_clock::ManualClock;

    fn registry() -> Registry {
        Registry::new(None, Arc::new(ManualClock::starting_at(1_000_000)))
    }

    /// The copy held, or a new one.
    fn new(reg: &Registry) -> Resume {
        Resume::OrNew(reg.new_copy())
    }

    fn owner(conn_id: u64) -> (Owner, mailbox::Receiver<Control>) {
        let (tx, rx) = mailbox::channel(4);
        (
            Owner {
                conn_id,
                control: tx,
            },
            rx,
        )
    }

    fn will(delay_secs: u32) -> Will {
        Will {
            message: Message {
                topic: "w".into(),
                payload: Bytes::from_static(b"gone"),
                qos: QoS::AtMostOnce,
                retain: false,
                properties: Default::default(),
            },
            delay_secs,
        }
    }

    fn attached(a: Attach) -> (Arc<SessionHandle>, bool, Effects) {
        match a {
            Attach::Attached {
                handle,
                session_present,
                effects,
                ..
            } => (handle, session_present, effects),
            Attach::Wait(_) | Attach::Vanished => panic!("expected attach"),
        }
    }

    #[test]
    fn takeover_asks_the_owner_then_inherits() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, mut rx1) = owner(1);
        let (h1, present, _) = attached(reg.attach(&id, false, 60, o1, false, new(&reg)));
        assert!(!present);
        let (o2, _rx2) = owner(2);
        let Attach::Wait(_) = reg.attach(&id, false, 60, o2, false, new(&reg)) else {
            panic!("must wait")
        };
        assert!(matches!(rx1.try_recv(), Some(Control::TakeOver { .. })));
        let fx = reg.detach(&id, 1, None);
        assert!(fx.ended.is_empty());
        let (o2, _rx2) = owner(2);
        let (h2, present, _) = attached(reg.attach(&id, false, 60, o2, false, new(&reg)));
        assert!(present);
        assert!(Arc::ptr_eq(&h1, &h2));
    }

    #[test]
    fn forced_takeover_and_stale_detach() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, _rx1) = owner(1);
        attached(reg.attach(&id, false, 60, o1, false, new(&reg)));
        let (o2, _rx2) = owner(2);
        let (_, present, _) = attached(reg.attach(&id, false, 60, o2, true, new(&reg)));
        assert!(present);
        // The displaced connection's detach changes nothing.
        let fx = reg.detach(&id, 1, Some(will(10)));
        assert!(fx.timer.is_none() && fx.ended.is_empty() && fx.wills.is_empty());
        assert!(reg.send_control(
            &id,
            None,
            Control::Disconnect {
                reason_code: 0,
                reason_string: None,
                will: WillOnEnd::Publish,
            }
        ));
    }

    #[test]
    fn expiry_zero_ends_at_disconnect_and_publishes_will() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, _rx) = owner(1);
        attached(reg.attach(&id, true, 0, o1, false, new(&reg)));
        let fx = reg.detach(&id, 1, Some(will(30)));
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(
            fx.wills.len(),
            1,
            "will is sent at session end if sooner than its delay"
        );
        assert_eq!(reg.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_will_cancelled_by_reconnect_and_expiry_epochs() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, _rx) = owner(1);
        attached(reg.attach(&id, false, 100, o1, false, new(&reg)));
        let now = reg.clock.now();
        let fx = reg.detach(&id, 1, Some(will(10)));
        let timer = fx.timer.unwrap();
        assert_eq!(timer.will_at, Some(now + Duration::from_secs(10)));
        assert_eq!(timer.expire_at, Some(now + Duration::from_secs(100)));
        let (o2, _rx2) = owner(2);
        attached(reg.attach(&id, false, 100, o2, false, new(&reg)));
        assert!(reg.take_due_will(&id, timer.epoch).is_none());
        assert!(reg.expire(&id, timer.epoch).ended.is_empty());

        let fx = reg.detach(&id, 2, Some(will(10)));
        let timer = fx.timer.unwrap();
        assert!(reg.take_due_will(&id, timer.epoch).is_some());
        assert_eq!(reg.expire(&id, timer.epoch).ended.len(), 1);
    }

    #[test]
    fn clean_start_discards_the_old_session() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, _rx) = owner(1);
        let (h1, _, _) = attached(reg.attach(&id, false, 100, o1, false, new(&reg)));
        reg.detach(&id, 1, Some(will(50)));
        let (o2, _rx2) = owner(2);
        let (h2, present, fx) = attached(reg.attach(&id, true, 100, o2, false, new(&reg)));
        assert!(!present);
        assert!(!Arc::ptr_eq(&h1, &h2));
        assert_eq!(fx.ended.len(), 1);
        assert_eq!(fx.wills.len(), 1);
    }

    #[test]
    fn only_a_session_without_connection_is_taken_and_a_taken_one_is_gone() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        assert!(matches!(reg.take(&id, None), Err(Untaken::Missing)));
        let (o1, _rx) = owner(1);
        let (h1, _, _) = attached(reg.attach(&id, false, 100, o1, false, new(&reg)));
        assert!(matches!(reg.take(&id, None), Err(Untaken::Connected)));
        let timer = reg.detach(&id, 1, Some(will(30))).timer.unwrap();
        let Ok(Taken { handle, will }) = reg.take(&id, None) else {
            panic!("a session without connection is taken")
        };
        assert!(Arc::ptr_eq(&h1, &handle));
        assert_eq!(
            will.map(|(w, at_ms)| (w.delay_secs, at_ms)),
            Some((30, 1_030_000))
        );
        assert_eq!(reg.len(), 0);
        // Its timers find nothing; a session put back gets a new epoch.
        assert!(reg.take_due_will(&id, timer.epoch).is_none());
        let epoch = reg.restore(handle.clone(), None, reg.new_copy()).unwrap();
        assert_ne!(epoch, timer.epoch);
        assert!(
            reg.restore(handle, None, reg.new_copy()).is_none(),
            "one session per client"
        );
    }

    /// Issue 16 (robustness seed 500764): a drop, or a CONNECT's resume, that names an older copy
    /// of a client's session leaves the copy held now.
    #[test]
    fn what_names_another_copy_leaves_the_one_held() {
        let reg = registry();
        let id: Arc<str> = "c".into();
        let (o1, _rx) = owner(1);
        let old = reg.new_copy();
        attached(reg.attach(&id, false, 100, o1, false, Resume::OrNew(old)));
        assert_eq!(reg.copy_of(&id), Some(old));
        reg.detach(&id, 1, None);
        let Ok(Taken { handle, .. }) = reg.take(&id, Some(old)) else {
            panic!("the copy named is taken")
        };
        let newer = reg.new_copy();
        assert_ne!(newer, old);
        reg.restore(handle, None, newer).unwrap();
        assert!(matches!(
            reg.take(&id, Some(old)),
            Err(Untaken::Another(copy)) if copy == newer
        ));
        let (o2, _rx2) = owner(2);
        assert!(matches!(
            reg.attach(&id, false, 100, o2, false, Resume::Only(old)),
            Attach::Vanished
        ));
        let (o2, _rx2) = owner(2);
        let (_, present, _) = attached(reg.attach(&id, false, 100, o2, false, Resume::Only(newer)));
        assert!(present);
        assert_eq!(
            reg.copy_of(&id),
            Some(newer),
            "resumed, the copy keeps its identity"
        );
    }
}
