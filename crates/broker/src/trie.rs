//! The subscription trie: topic filters split on `/`, one node per level, so routing a publish costs
//! the topic's depth (times the wildcard branches), not the number of subscriptions.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The shared group a visited subscription belongs to: `(filter, group name)`; `None` if it is
/// not shared.
pub(crate) type Shared<'a> = Option<(&'a str, &'a str)>;

/// Subscriptions keyed by filter level. `T` is what a subscription carries (options, session).
pub(crate) struct Trie<T> {
    root: Node<T>,
}

struct Node<T> {
    children: HashMap<Box<str>, Node<T>>,
    /// Non-shared subscribers at this filter, in client id order: fan-out delivers in client id
    /// order (decision 0029), and a publish matching one filter then finds its targets sorted
    /// already instead of sorting them by client id every time.
    subscribers: BTreeMap<Arc<str>, T>,
    /// Shared subscription groups at this filter, by group name (ordered: a message matching
    /// several groups reaches them in the same order every time).
    shared: BTreeMap<Box<str>, SharedGroup<T>>,
    /// Whether `children` has a `#` or a `+` level: most nodes have neither, and a publish then
    /// looks its topic's level up once instead of three times (every lookup hashes a string).
    wildcards: Wildcards,
}

#[derive(Default, Clone, Copy)]
struct Wildcards {
    hash: bool,
    plus: bool,
}

impl Wildcards {
    fn of<T>(children: &HashMap<Box<str>, Node<T>>) -> Wildcards {
        Wildcards {
            hash: children.contains_key("#"),
            plus: children.contains_key("+"),
        }
    }
}

struct SharedGroup<T> {
    /// The group's filter (without `$share/<group>/`): a node of a cluster names the group by it.
    filter: Box<str>,
    members: Vec<(Arc<str>, T)>,
    /// Round-robin cursor; atomic so routing works under a read lock.
    next: AtomicUsize,
}

impl<T> Default for Node<T> {
    fn default() -> Self {
        Self {
            children: HashMap::new(),
            subscribers: BTreeMap::new(),
            shared: BTreeMap::new(),
            wildcards: Wildcards::default(),
        }
    }
}

impl<T> Node<T> {
    fn is_empty(&self) -> bool {
        self.children.is_empty() && self.subscribers.is_empty() && self.shared.is_empty()
    }
}

impl<T> Default for Trie<T> {
    fn default() -> Self {
        Self {
            root: Node::default(),
        }
    }
}

impl<T> Trie<T> {
    /// Adds or replaces `client`'s subscription to `filter` (in `group` if shared). Returns `true`
    /// if the subscription is new.
    pub(crate) fn insert(
        &mut self,
        filter: &str,
        group: Option<&str>,
        client: &Arc<str>,
        value: T,
    ) -> bool {
        let mut node = &mut self.root;
        for level in filter.split('/') {
            if matches!(level, "#" | "+") && !node.children.contains_key(level) {
                node.children.insert(level.into(), Node::default());
                node.wildcards = Wildcards::of(&node.children);
            }
            node = node.children.entry(level.into()).or_default();
        }
        match group {
            None => node.subscribers.insert(client.clone(), value).is_none(),
            Some(group) => {
                let group = node
                    .shared
                    .entry(group.into())
                    .or_insert_with(|| SharedGroup {
                        filter: filter.into(),
                        members: Vec::new(),
                        next: AtomicUsize::new(0),
                    });
                if let Some(slot) = group.members.iter_mut().find(|(c, _)| c == client) {
                    slot.1 = value;
                    false
                } else {
                    group.members.push((client.clone(), value));
                    true
                }
            }
        }
    }

    /// Removes `client`'s subscription; returns whether one existed. Empty nodes are pruned.
    pub(crate) fn remove(&mut self, filter: &str, group: Option<&str>, client: &str) -> bool {
        self.remove_if(filter, group, client, |_| true)
    }

    /// [`Trie::remove`], only if `client`'s value there satisfies `pred`.
    pub(crate) fn remove_if(
        &mut self,
        filter: &str,
        group: Option<&str>,
        client: &str,
        pred: impl Fn(&T) -> bool,
    ) -> bool {
        let levels: Vec<&str> = filter.split('/').collect();
        Self::remove_at(&mut self.root, &levels, group, client, &pred)
    }

    fn remove_at(
        node: &mut Node<T>,
        levels: &[&str],
        group: Option<&str>,
        client: &str,
        pred: &impl Fn(&T) -> bool,
    ) -> bool {
        let Some((first, rest)) = levels.split_first() else {
            return match group {
                None => {
                    if !node.subscribers.get(client).is_some_and(pred) {
                        return false;
                    }
                    node.subscribers.remove(client).is_some()
                }
                Some(group) => {
                    let Some(g) = node.shared.get_mut(group) else {
                        return false;
                    };
                    let before = g.members.len();
                    g.members.retain(|(c, v)| &**c != client || !pred(v));
                    let removed = g.members.len() != before;
                    if g.members.is_empty() {
                        node.shared.remove(group);
                    }
                    removed
                }
            };
        };
        let Some(child) = node.children.get_mut(*first) else {
            return false;
        };
        let removed = Self::remove_at(child, rest, group, client, pred);
        if child.is_empty() {
            node.children.remove(*first);
            node.wildcards = Wildcards::of(&node.children);
        }
        removed
    }

    /// Calls `visit(client, value, None)` for every non-shared subscription matching `topic`, and
    /// once for one member (round robin) of every shared group matching it, with the group's
    /// `(filter, name)`. A client with several matching subscriptions is visited once per
    /// subscription; callers merge.
    pub(crate) fn for_each_match(
        &self,
        topic: &str,
        mut visit: impl FnMut(&Arc<str>, &T, Shared<'_>),
    ) {
        Self::walk(&self.root, topic.split('/'), true, &mut visit);
    }

    /// The members of shared group `group` on `filter` (the filter it was inserted with).
    pub(crate) fn group_members(&self, filter: &str, group: &str) -> &[(Arc<str>, T)] {
        let mut node = &self.root;
        for level in filter.split('/') {
            match node.children.get(level) {
                Some(child) => node = child,
                None => return &[],
            }
        }
        node.shared
            .get(group)
            .map_or(&[], |group| group.members.as_slice())
    }

    /// Calls `visit(filter, group)` once per subscription (with the filter it was inserted with).
    pub(crate) fn for_each_subscription(&self, mut visit: impl FnMut(&str, Option<&str>)) {
        let mut path = String::new();
        Self::each(&self.root, &mut path, &mut visit);
    }

    fn each(node: &Node<T>, path: &mut String, visit: &mut impl FnMut(&str, Option<&str>)) {
        // `path` is "/level/level…": the root's children start the filter.
        let filter = path.get(1..).unwrap_or("");
        for _ in &node.subscribers {
            visit(filter, None);
        }
        for (name, group) in &node.shared {
            for _ in &group.members {
                visit(&group.filter, Some(name));
            }
        }
        for (level, child) in &node.children {
            let len = path.len();
            path.push('/');
            path.push_str(level);
            Self::each(child, path, visit);
            path.truncate(len);
        }
    }

    fn walk<'t>(
        node: &Node<T>,
        mut levels: std::str::Split<'t, char>,
        first: bool,
        visit: &mut impl FnMut(&Arc<str>, &T, Shared<'_>),
    ) {
        debug_assert!(
            node.wildcards.hash == node.children.contains_key("#")
                && node.wildcards.plus == node.children.contains_key("+"),
            "the wildcard flags follow the children"
        );
        match levels.next() {
            None => {
                Self::emit(node, visit);
                // "a/#" also matches "a".
                if node.wildcards.hash {
                    if let Some(hash) = node.children.get("#") {
                        Self::emit(hash, visit);
                    }
                }
            }
            Some(level) => {
                // Wildcards at the first level never match `$` topics.
                if !(first && level.starts_with('$')) {
                    if node.wildcards.hash {
                        if let Some(hash) = node.children.get("#") {
                            Self::emit(hash, visit);
                        }
                    }
                    if node.wildcards.plus {
                        if let Some(plus) = node.children.get("+") {
                            Self::walk(plus, levels.clone(), false, visit);
                        }
                    }
                }
                if let Some(child) = node.children.get(level) {
                    Self::walk(child, levels, false, visit);
                }
            }
        }
    }

    fn emit(node: &Node<T>, visit: &mut impl FnMut(&Arc<str>, &T, Shared<'_>)) {
        for (client, value) in &node.subscribers {
            visit(client, value, None);
        }
        for (name, group) in &node.shared {
            debug_assert!(!group.members.is_empty(), "empty shared groups are pruned");
            let i = group.next.fetch_add(1, Ordering::Relaxed) % group.members.len();
            let (client, value) = &group.members[i];
            visit(client, value, Some((&group.filter, name)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topic;
    use proptest::prelude::*;

    fn matched(trie: &Trie<u32>, topic: &str) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        trie.for_each_match(topic, |c, v, _| out.push((c.to_string(), *v)));
        out.sort();
        out
    }

    #[test]
    fn routes_wildcards_and_prunes() {
        let mut trie = Trie::default();
        let a: Arc<str> = "a".into();
        let b: Arc<str> = "b".into();
        assert!(trie.insert("x/+/z", None, &a, 1));
        assert!(!trie.insert("x/+/z", None, &a, 2));
        assert!(trie.insert("x/#", None, &b, 3));
        assert_eq!(
            matched(&trie, "x/y/z"),
            vec![("a".into(), 2), ("b".into(), 3)]
        );
        assert_eq!(matched(&trie, "x"), vec![("b".into(), 3)]);
        assert!(trie.remove("x/+/z", None, "a"));
        assert!(!trie.remove("x/+/z", None, "a"));
        assert!(trie.remove("x/#", None, "b"));
        assert!(trie.root.is_empty());
    }

    #[test]
    fn every_subscription_is_visited_with_its_filter() {
        let mut trie = Trie::default();
        trie.insert("a/+/c", None, &Arc::from("x"), 1);
        trie.insert("a/+/c", None, &Arc::from("y"), 2);
        trie.insert("#", Some("g"), &Arc::from("x"), 3);
        trie.insert("/lead", None, &Arc::from("x"), 4);
        let mut seen = Vec::new();
        trie.for_each_subscription(|f, g| seen.push((f.to_owned(), g.map(str::to_owned))));
        seen.sort();
        assert_eq!(
            seen,
            vec![
                ("#".into(), Some("g".into())),
                ("/lead".into(), None),
                ("a/+/c".into(), None),
                ("a/+/c".into(), None),
            ]
        );
    }

    #[test]
    fn shared_groups_round_robin() {
        let mut trie = Trie::default();
        for (i, c) in ["a", "b", "c"].into_iter().enumerate() {
            trie.insert("t", Some("g"), &Arc::from(c), i as u32);
        }
        let picks: Vec<_> = (0..6).map(|_| matched(&trie, "t")).collect();
        assert!(picks.iter().all(|p| p.len() == 1));
        let firsts: Vec<u32> = picks.iter().map(|p| p[0].1).collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn dollar_topics_skip_leading_wildcards() {
        let mut trie = Trie::default();
        trie.insert("#", None, &Arc::from("a"), 1);
        trie.insert("+/x", None, &Arc::from("b"), 2);
        trie.insert("$SYS/#", None, &Arc::from("c"), 3);
        assert_eq!(matched(&trie, "$SYS/x"), vec![("c".into(), 3)]);
    }

    proptest! {
        /// The trie agrees with the plain matcher for any filter set and topic.
        #[test]
        fn trie_agrees_with_matcher(
            filters in proptest::collection::vec("(a|b|\\+|\\$s)(/(a|b|\\+|#)){0,3}", 1..8),
            topic in "(a|b|\\$s)(/(a|b)){0,3}",
        ) {
            let mut trie = Trie::default();
            let mut expected = Vec::new();
            for (i, f) in filters.iter().enumerate() {
                if !topic::is_valid_filter(f) { continue; }
                let client: Arc<str> = format!("c{i}").into();
                trie.insert(f, None, &client, i as u32);
                if topic::matches(f, &topic) { expected.push((client.to_string(), i as u32)); }
            }
            expected.sort();
            prop_assert_eq!(matched(&trie, &topic), expected);
        }

        /// It still agrees once some subscriptions are removed again (the nodes' wildcard flags
        /// follow their children both ways).
        #[test]
        fn trie_agrees_with_matcher_after_removals(
            filters in proptest::collection::vec("(a|\\+)(/(a|\\+|#)){0,2}", 1..8),
            removed in proptest::collection::vec(any::<bool>(), 8),
            topic in "a(/a){0,2}",
        ) {
            let mut trie = Trie::default();
            for (i, f) in filters.iter().enumerate() {
                if topic::is_valid_filter(f) {
                    trie.insert(f, None, &format!("c{i}").into(), i as u32);
                }
            }
            let mut expected = Vec::new();
            for (i, f) in filters.iter().enumerate() {
                if !topic::is_valid_filter(f) { continue; }
                if removed[i] {
                    trie.remove(f, None, &format!("c{i}"));
                } else if topic::matches(f, &topic) {
                    expected.push((format!("c{i}"), i as u32));
                }
            }
            expected.sort();
            prop_assert_eq!(matched(&trie, &topic), expected);
        }
    }

    #[test]
    fn a_groups_members_are_found_by_its_filter() {
        let mut trie = Trie::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        trie.insert("s/+", Some("g"), &a, 1);
        trie.insert("s/+", Some("g"), &b, 2);
        trie.insert("s/+", Some("h"), &a, 3);
        let members: Vec<u32> = trie.group_members("s/+", "g").iter().map(|m| m.1).collect();
        assert_eq!(members, [1, 2]);
        assert!(trie.group_members("s/1", "g").is_empty());
        assert!(trie.group_members("s/+", "x").is_empty());
    }
}
