//! The ACL file: mosquitto's format, extended with state-store keys and certificate identities.
//!
//! ```text
//! # Rules before the first section apply to every client.
//! topic read public/#
//! # `pattern` rules apply to every client wherever they appear; %c is the client id, %u the user.
//! pattern readwrite clients/%c/#
//! pattern write statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke
//! key readwrite %c/*
//!
//! # Rules for the authenticated user alice, the client id gateway-1, a certificate identity.
//! user alice
//! topic readwrite sensors/#
//! key read config/*
//! client gateway-1
//! topic write telemetry/#
//! cert CN=edge-7
//! key deny secrets/*
//! ```
//!
//! Lines starting with `#` are comments. `topic ACCESS FILTER` governs topics: `write` lets a client publish on topics the filter matches;
//! `read` lets it subscribe to filters within it (`sensors/#` allows `sensors/+/temp`, not `#`); a
//! `deny` rule refuses every subscription that could receive a topic it covers.
//! `key ACCESS PATTERN` governs state-store keys: the pattern is exact (`config`), a prefix (`config/*`)
//! or any SCAN glob. ACCESS is `read`, `write`, `readwrite` (the default when omitted) or `deny`.
//! A request is allowed when some applicable rule grants it and no applicable `deny` rule matches;
//! everything else is refused. `%c`/`%u` rules do not apply to clients whose id or user name contains
//! characters that would widen the rule (`+ # /` in topics, `* ? [ ]` in keys) or that have no user.

use std::path::Path;

use anyhow::Context;
use mqstate_broker::{Authorizer, Principal};
use mqstate_protocol::Glob;
use mqstate_statestore::access::KeyAuthorizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
    ReadWrite,
    Deny,
}

impl Access {
    fn grants(self, want: Want) -> bool {
        matches!(
            (self, want),
            (Access::ReadWrite, _) | (Access::Read, Want::Read) | (Access::Write, Want::Write)
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Read,
    Write,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    Everyone,
    User(String),
    Client(String),
    Cert(String),
}

impl Scope {
    fn applies(&self, who: Principal<'_>) -> bool {
        match self {
            Scope::Everyone => true,
            Scope::User(u) => who.identity.user.as_deref() == Some(u.as_str()),
            Scope::Client(c) => who.client_id == c,
            Scope::Cert(c) => who.identity.cert.as_deref() == Some(c.as_str()),
        }
    }
}

#[derive(Debug, Clone)]
struct Rule<P> {
    scope: Scope,
    access: Access,
    pattern: P,
}

/// A key pattern, compiled once unless it depends on the client.
#[derive(Debug, Clone)]
enum KeyPattern {
    Fixed(Glob),
    PerClient(String),
}

/// A parsed ACL file.
#[derive(Debug, Clone, Default)]
pub struct Acl {
    topics: Vec<Rule<String>>,
    keys: Vec<Rule<KeyPattern>>,
}

const TOPIC_UNSAFE: &[char] = &['+', '#', '/'];
const KEY_UNSAFE: &[char] = &['*', '?', '[', ']'];

impl Acl {
    pub fn load(path: &Path) -> anyhow::Result<Acl> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read ACL file {}", path.display()))?;
        Acl::parse(&text).with_context(|| format!("invalid ACL file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Acl> {
        let mut acl = Acl::default();
        let mut section = Scope::Everyone;
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |msg: String| anyhow::anyhow!("line {}: {msg}", n + 1);
            let (word, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let rest = rest.trim();
            match word {
                "user" | "client" | "cert" => {
                    if rest.is_empty() {
                        return Err(at(format!("`{word}` needs a name")));
                    }
                    section = match word {
                        "user" => Scope::User(rest.to_owned()),
                        "client" => Scope::Client(rest.to_owned()),
                        _ => Scope::Cert(rest.to_owned()),
                    };
                }
                "topic" | "pattern" | "key" => {
                    let (access, pattern) = split_access(rest).map_err(at)?;
                    let scope = if word == "pattern" {
                        Scope::Everyone
                    } else {
                        section.clone()
                    };
                    if word == "key" {
                        let compiled = if pattern.contains('%') {
                            KeyPattern::PerClient(pattern.to_owned())
                        } else {
                            KeyPattern::Fixed(compile_key(pattern).map_err(at)?)
                        };
                        acl.keys.push(Rule {
                            scope,
                            access,
                            pattern: compiled,
                        });
                    } else {
                        if !is_valid_filter(pattern) {
                            return Err(at(format!("{pattern:?} is not a valid MQTT topic filter")));
                        }
                        acl.topics.push(Rule {
                            scope,
                            access,
                            pattern: pattern.to_owned(),
                        });
                    }
                }
                other => {
                    return Err(at(format!(
                        "unknown directive `{other}`; expected user, client, cert, topic, pattern or key"
                    )))
                }
            }
        }
        Ok(acl)
    }

    fn topic_allowed(&self, who: Principal<'_>, want: Want, fits: impl Fn(&str) -> bool) -> bool {
        let mut granted = false;
        for rule in self.topics.iter().filter(|r| r.scope.applies(who)) {
            let Some(pattern) = substitute(&rule.pattern, who, TOPIC_UNSAFE) else {
                continue;
            };
            if !fits(&pattern) {
                continue;
            }
            if rule.access == Access::Deny {
                return false;
            }
            granted |= rule.access.grants(want);
        }
        granted
    }

    fn key_allowed(&self, who: Principal<'_>, want: Want, key: &[u8]) -> bool {
        let mut granted = false;
        for rule in self.keys.iter().filter(|r| r.scope.applies(who)) {
            let matched = match &rule.pattern {
                KeyPattern::Fixed(glob) => glob.matches(key),
                KeyPattern::PerClient(text) => substitute(text, who, KEY_UNSAFE)
                    .and_then(|p| compile_key(&p).ok())
                    .is_some_and(|glob| glob.matches(key)),
            };
            if !matched {
                continue;
            }
            if rule.access == Access::Deny {
                return false;
            }
            granted |= rule.access.grants(want);
        }
        granted
    }
}

impl Authorizer for Acl {
    fn may_publish(&self, who: Principal<'_>, topic: &str) -> bool {
        self.topic_allowed(who, Want::Write, |rule| filter_matches(rule, topic))
    }

    fn may_subscribe(&self, who: Principal<'_>, filter: &str) -> bool {
        // A deny rule refuses any subscription that could receive what it covers; grants must cover
        // the whole subscription.
        let mut granted = false;
        for rule in self.topics.iter().filter(|r| r.scope.applies(who)) {
            let Some(pattern) = substitute(&rule.pattern, who, TOPIC_UNSAFE) else {
                continue;
            };
            if rule.access == Access::Deny {
                if filters_overlap(&pattern, filter) {
                    return false;
                }
            } else if rule.access.grants(Want::Read) && filter_within(&pattern, filter) {
                granted = true;
            }
        }
        granted
    }
}

impl KeyAuthorizer for Acl {
    fn may_read(&self, who: Principal<'_>, key: &[u8]) -> bool {
        self.key_allowed(who, Want::Read, key)
    }

    fn may_write(&self, who: Principal<'_>, key: &[u8]) -> bool {
        self.key_allowed(who, Want::Write, key)
    }
}

fn split_access(rest: &str) -> Result<(Access, &str), String> {
    let (first, tail) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let access = match first {
        "read" => Access::Read,
        "write" => Access::Write,
        "readwrite" => Access::ReadWrite,
        "deny" => Access::Deny,
        _ => {
            return match rest {
                "" => Err("missing topic filter or key pattern".into()),
                pattern => Ok((Access::ReadWrite, pattern)),
            }
        }
    };
    match tail.trim() {
        "" => Err(format!("`{first}` needs a topic filter or key pattern")),
        pattern => Ok((access, pattern)),
    }
}

fn compile_key(pattern: &str) -> Result<Glob, String> {
    Glob::new(pattern.as_bytes()).map_err(|e| format!("invalid key pattern {pattern:?}: {e}"))
}

/// `%c` and `%u` replaced; `None` when the rule cannot apply to this client (no user, or a value that
/// contains a character that would widen the rule).
fn substitute(pattern: &str, who: Principal<'_>, unsafe_chars: &[char]) -> Option<String> {
    let mut out = pattern.to_owned();
    if out.contains("%c") {
        if who.client_id.contains(unsafe_chars) || who.client_id.is_empty() {
            return None;
        }
        out = out.replace("%c", who.client_id);
    }
    if out.contains("%u") {
        let user = who.identity.user.as_deref()?;
        if user.contains(unsafe_chars) || user.is_empty() {
            return None;
        }
        out = out.replace("%u", user);
    }
    Some(out)
}

fn is_valid_filter(filter: &str) -> bool {
    if filter.is_empty() {
        return false;
    }
    let levels: Vec<&str> = filter.split('/').collect();
    levels.iter().enumerate().all(|(i, l)| match *l {
        "#" => i == levels.len() - 1,
        "+" => true,
        l => !l.contains(['+', '#']),
    })
}

/// MQTT matching of a topic name against a filter (wildcards do not match a leading `$` level).
fn filter_matches(filter: &str, topic: &str) -> bool {
    let mut f = filter.split('/');
    let mut t = topic.split('/').peekable();
    let mut first = true;
    loop {
        match (f.next(), t.peek()) {
            (Some("#"), _) => return !(first && topic.starts_with('$')),
            (Some("+"), Some(_)) if !(first && topic.starts_with('$')) => {}
            (Some(fl), Some(tl)) if fl == *tl => {}
            (None, None) => return true,
            _ => return false,
        }
        t.next();
        first = false;
    }
}

/// Whether every topic `sub` can match is matched by `rule`.
fn filter_within(rule: &str, sub: &str) -> bool {
    let mut r = rule.split('/');
    let mut s = sub.split('/');
    let mut first = true;
    loop {
        match (r.next(), s.next()) {
            (Some("#"), _) => return !(first && sub.starts_with('$')),
            (Some("+"), Some(sl)) if sl != "#" && !(first && sub.starts_with('$')) => {}
            (Some(rl), Some(sl)) if rl == sl && rl != "+" => {}
            (Some("+"), Some("+")) => {}
            (None, None) => return true,
            _ => return false,
        }
        first = false;
    }
}

/// Whether some topic matches both filters.
fn filters_overlap(a: &str, b: &str) -> bool {
    let mut x = a.split('/');
    let mut y = b.split('/');
    loop {
        match (x.next(), y.next()) {
            (Some("#"), _) | (_, Some("#")) => return true,
            (Some("+"), Some(_)) | (Some(_), Some("+")) => {}
            (Some(p), Some(q)) if p == q => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mqstate_broker::Identity;

    fn who<'a>(client_id: &'a str, identity: &'a Identity) -> Principal<'a> {
        Principal {
            client_id,
            identity,
        }
    }

    fn user(name: &str) -> Identity {
        Identity {
            user: Some(name.into()),
            cert: None,
        }
    }

    const ACL: &str = "\
# everyone
topic read public/#
pattern readwrite clients/%c/#
pattern read users/%u/#
key readwrite %c/*

user alice
topic readwrite sensors/#
topic deny sensors/secret/#
key read config/*
key readwrite shared
client gateway-1
topic write telemetry/#
cert CN=edge-7
key deny config/private
key read config/*
";

    #[test]
    fn topics_by_section_and_substitution() {
        let acl = Acl::parse(ACL).unwrap();
        let alice = user("alice");
        let bob = user("bob");
        let anon = Identity::default();
        let a = who("a1", &alice);
        let b = who("b1", &bob);
        let g = who("gateway-1", &anon);

        assert!(acl.may_publish(a, "sensors/1/temp"));
        assert!(!acl.may_publish(a, "sensors/secret/x"), "deny wins");
        assert!(!acl.may_publish(b, "sensors/1/temp"));
        assert!(!acl.may_publish(a, "public/news"), "read only");
        assert!(acl.may_subscribe(b, "public/+"));
        assert!(acl.may_publish(b, "clients/b1/x"));
        assert!(!acl.may_publish(b, "clients/a1/x"));
        assert!(acl.may_subscribe(b, "users/bob/#"));
        assert!(!acl.may_subscribe(b, "users/alice/#"));
        assert!(
            !acl.may_subscribe(who("c", &anon), "users/+/#"),
            "%u needs a user"
        );
        assert!(acl.may_publish(g, "telemetry/x"));
        assert!(!acl.may_publish(who("gateway-2", &anon), "telemetry/x"));

        // Subscriptions must stay within a grant and clear of denials.
        assert!(acl.may_subscribe(a, "sensors/1/+"));
        assert!(
            !acl.may_subscribe(a, "sensors/#"),
            "overlaps sensors/secret/#"
        );
        assert!(
            !acl.may_subscribe(a, "sensors/+/temp"),
            "+ could be `secret`"
        );
        assert!(!acl.may_subscribe(a, "#"));
    }

    #[test]
    fn substitution_never_widens_a_rule() {
        let acl = Acl::parse(ACL).unwrap();
        let anon = Identity::default();
        assert!(
            Acl::parse("topic read #").is_ok(),
            "# is a filter, not a comment"
        );
        for evil in ["+", "#", "x/../b1", "a/b"] {
            assert!(
                !acl.may_publish(who(evil, &anon), &format!("clients/{evil}/x")),
                "{evil}"
            );
        }
        assert!(!acl.may_read(who("*", &anon), b"anything/x"));
    }

    #[test]
    fn keys_exact_prefix_glob_read_write_deny() {
        let acl = Acl::parse(ACL).unwrap();
        let alice = user("alice");
        let anon = Identity::default();
        let cert = Identity {
            user: None,
            cert: Some("CN=edge-7".into()),
        };
        let a = who("a1", &alice);
        assert!(acl.may_read(a, b"config/x"));
        assert!(!acl.may_write(a, b"config/x"));
        assert!(acl.may_write(a, b"shared"));
        assert!(!acl.may_write(a, b"shared2"), "exact");
        assert!(acl.may_write(a, b"a1/k"), "%c prefix");
        assert!(!acl.may_read(a, b"b1/k"));
        let e = who("edge", &cert);
        assert!(acl.may_read(e, b"config/public"));
        assert!(!acl.may_read(e, b"config/private"), "deny wins");
        assert!(!acl.may_read(who("x", &anon), b"config/x"));
    }

    #[test]
    fn parse_errors_name_the_line() {
        for (text, needle) in [
            ("topic", "line 1"),
            ("topic read", "needs"),
            ("user\n", "needs a name"),
            ("\nfrobnicate x", "line 2: unknown directive"),
            ("topic read a/#/b", "not a valid MQTT topic filter"),
            ("key read [abc", "invalid key pattern"),
        ] {
            let err = format!("{:#}", Acl::parse(text).unwrap_err());
            assert!(err.contains(needle), "{text:?}: {err}");
        }
        // Access defaults to readwrite, as in mosquitto.
        let acl = Acl::parse("topic a/b").unwrap();
        let anon = Identity::default();
        assert!(acl.may_publish(who("c", &anon), "a/b"));
        assert!(acl.may_subscribe(who("c", &anon), "a/b"));
    }

    #[test]
    fn matching_helpers() {
        assert!(filter_matches("a/+/c", "a/b/c"));
        assert!(filter_matches("a/#", "a"));
        assert!(!filter_matches("#", "$SYS/x"));
        assert!(!filter_matches("a/+", "a/b/c"));
        assert!(filter_within("a/#", "a/+/c"));
        assert!(filter_within("a/+", "a/+"));
        assert!(!filter_within("a/+", "a/#"));
        assert!(!filter_within("a/b", "a/+"));
        assert!(filters_overlap("a/+/c", "a/b/#"));
        assert!(!filters_overlap("a/b", "a/c"));
    }
}
