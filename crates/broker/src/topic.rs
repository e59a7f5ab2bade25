//! Topic names and topic filters: validation, shared-subscription parsing and matching.

/// Prefix of shared subscription filters: `$share/{group}/{filter}`.
const SHARE_PREFIX: &str = "$share/";

/// A valid topic name: non-empty, no wildcards, no NUL.
pub(crate) fn is_valid_topic_name(topic: &str) -> bool {
    topic_name_problem(topic).is_none()
}

/// Why a string is not a valid topic name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TopicNameProblem {
    Empty,
    /// U+0000 is forbidden in every MQTT string (MQTT-1.5.4-2: a malformed packet).
    Nul,
    /// `+` or `#` (MQTT-3.3.2-2, and MQTT-3.3.2-14 for a Response Topic).
    Wildcard,
}

/// What is wrong with `topic` as a topic name, if anything.
pub(crate) fn topic_name_problem(topic: &str) -> Option<TopicNameProblem> {
    if topic.is_empty() {
        Some(TopicNameProblem::Empty)
    } else if topic.contains('\0') {
        Some(TopicNameProblem::Nul)
    } else if topic.contains(['+', '#']) {
        Some(TopicNameProblem::Wildcard)
    } else {
        None
    }
}

/// A valid (non-shared) topic filter: `+` and `#` only as whole levels, `#` only last.
pub(crate) fn is_valid_filter(filter: &str) -> bool {
    if filter.is_empty() || filter.contains('\0') {
        return false;
    }
    let mut levels = filter.split('/').peekable();
    while let Some(level) = levels.next() {
        match level {
            "#" => return levels.peek().is_none(),
            "+" => {}
            _ if level.contains(['+', '#']) => return false,
            _ => {}
        }
    }
    true
}

/// A subscription filter as the client wrote it, split into its shared group (if any) and filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParsedFilter<'a> {
    pub group: Option<&'a str>,
    pub filter: &'a str,
}

/// Parses and validates a SUBSCRIBE/UNSUBSCRIBE filter; `None` when it is invalid.
pub(crate) fn parse_filter(raw: &str) -> Option<ParsedFilter<'_>> {
    if let Some(rest) = raw.strip_prefix(SHARE_PREFIX) {
        let (group, filter) = rest.split_once('/')?;
        if group.is_empty() || group.contains(['+', '#']) || !is_valid_filter(filter) {
            return None;
        }
        return Some(ParsedFilter {
            group: Some(group),
            filter,
        });
    }
    if raw == "$share" || !is_valid_filter(raw) {
        return None;
    }
    Some(ParsedFilter {
        group: None,
        filter: raw,
    })
}

/// Whether `filter` (valid, non-shared) matches `topic` (valid). Topics starting with `$` are not
/// matched by a leading wildcard.
pub fn matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut f = filter.split('/');
    let mut t = topic.split('/');
    loop {
        match (f.next(), t.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(fl), Some(tl)) if fl == tl => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn validates_filters() {
        for ok in ["a", "a/b", "+", "#", "a/+/c", "a/#", "+/+", "/", "$SYS/#"] {
            assert!(is_valid_filter(ok), "{ok}");
        }
        for bad in ["", "a#", "a/#/b", "a+", "a/b+/c", "#/a"] {
            assert!(!is_valid_filter(bad), "{bad}");
        }
    }

    #[test]
    fn parses_shared_filters() {
        assert_eq!(
            parse_filter("$share/g/a/+"),
            Some(ParsedFilter {
                group: Some("g"),
                filter: "a/+"
            })
        );
        assert_eq!(
            parse_filter("a/b"),
            Some(ParsedFilter {
                group: None,
                filter: "a/b"
            })
        );
        assert_eq!(parse_filter("$share/g"), None);
        assert_eq!(parse_filter("$share//a"), None);
        assert_eq!(parse_filter("$share/g+/a"), None);
        assert_eq!(parse_filter("$share"), None);
    }

    #[test]
    fn matches_wildcards() {
        assert!(matches("a/+/c", "a/b/c"));
        assert!(matches("a/#", "a"));
        assert!(matches("a/#", "a/b/c"));
        assert!(matches("#", "a/b"));
        assert!(matches("+/+", "/x"));
        assert!(!matches("a/+", "a/b/c"));
        assert!(!matches("a/b", "a"));
        assert!(!matches("#", "$SYS/x"));
        assert!(!matches("+/x", "$SYS/x"));
        assert!(matches("$SYS/#", "$SYS/x"));
    }

    proptest! {
        #[test]
        fn a_topic_matches_itself_and_hash(topic in "[a-z/]{1,20}") {
            prop_assert!(matches(&topic, &topic));
            prop_assert!(matches("#", &topic));
        }

        #[test]
        fn validation_never_panics(s in "\\PC{0,30}") {
            let _ = parse_filter(&s);
            let _ = is_valid_topic_name(&s);
        }
    }
}
