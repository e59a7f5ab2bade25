//! Built-in topic rules of the state store, enforced around whatever topic policy is configured so that
//! no ACL can loosen them:
//!
//! * only the state store publishes on topics naming it (notifications, replies on the SDKs' response
//!   topics, anything under its id) — clients may publish there only on the invoke topic, so they cannot
//!   spoof notifications or replies (PUBACK 0x87);
//! * a client may subscribe to its own notification topics only (SUBACK 0x87) — and always may, whatever
//!   the ACL says, since the state store delivers them into its session anyway.
//!
//! The third rule, that a request may not name the invoke topic, a notification topic or another
//! client's state-store response topic as its Response Topic, is checked on each request
//! ([`crate::envelope`]) and disconnects the client.

use std::sync::Arc;

use mqstate_broker::{Authorizer, Principal};
use mqstate_protocol::topic;

/// `inner`'s decisions, within the state store's built-in rules.
pub struct Guarded {
    inner: Arc<dyn Authorizer>,
}

impl Guarded {
    pub fn new(inner: Arc<dyn Authorizer>) -> Guarded {
        Guarded { inner }
    }
}

impl Authorizer for Guarded {
    fn may_publish(&self, who: Principal<'_>, topic: &str) -> bool {
        !topic::is_reserved_for_service(topic) && self.inner.may_publish(who, topic)
    }

    fn may_subscribe(&self, who: Principal<'_>, filter: &str) -> bool {
        if filter.starts_with(topic::NOTIFY_TOPIC_PREFIX) {
            return !topic::is_foreign_notification_filter(filter, who.client_id.as_bytes());
        }
        self.inner.may_subscribe(who, filter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_broker::auth::AllowAll;
    use mqstate_broker::Identity;

    #[test]
    fn built_in_rules_hold_even_when_everything_is_allowed() {
        let guard = Guarded::new(Arc::new(AllowAll));
        let identity = Identity::default();
        let me = Principal {
            client_id: "me",
            identity: &identity,
        };
        assert!(guard.may_publish(me, topic::INVOKE_TOPIC));
        assert!(guard.may_publish(me, "any/topic"));
        assert!(!guard.may_publish(me, &topic::notify_topic(b"me", b"k")));
        assert!(!guard.may_publish(
            me,
            &format!(
                "clients/other/services/statestore/v1/{}/command/invoke/response",
                topic::SERVICE_ID
            )
        ));
        let own = format!("{}/6D65/command/notify/+", topic::NOTIFY_TOPIC_PREFIX);
        let other = format!("{}/+/command/notify/+", topic::NOTIFY_TOPIC_PREFIX);
        assert!(guard.may_subscribe(me, &own));
        assert!(!guard.may_subscribe(me, &other));
        assert!(guard.may_subscribe(me, "#"));
    }

    #[test]
    fn the_configured_policy_still_applies_inside_the_rules() {
        struct Nothing;
        impl Authorizer for Nothing {
            fn may_publish(&self, _: Principal<'_>, _: &str) -> bool {
                false
            }
            fn may_subscribe(&self, _: Principal<'_>, _: &str) -> bool {
                false
            }
        }
        let guard = Guarded::new(Arc::new(Nothing));
        let identity = Identity::default();
        let me = Principal {
            client_id: "me",
            identity: &identity,
        };
        assert!(!guard.may_publish(me, topic::INVOKE_TOPIC));
        assert!(!guard.may_subscribe(me, "#"));
        let own = format!("{}/6D65/command/notify/+", topic::NOTIFY_TOPIC_PREFIX);
        assert!(
            guard.may_subscribe(me, &own),
            "own notifications need no ACL grant"
        );
    }
}
