//! The route tables (pure): the filters this node's sessions hold, counted, and the routes each
//! other node told this one; and the plan of one publish over them (decision 0044).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use mqstate_broker::{topic_matches, GroupKey, Plan};
use mqstate_cluster::NodeId;

use crate::wire::Route;

#[derive(Debug, Default)]
pub struct Tables {
    /// This node's routes with the number of subscriptions holding each.
    local: BTreeMap<Route, usize>,
    /// What each other node told this one it holds.
    remote: BTreeMap<NodeId, BTreeSet<Route>>,
    /// Round-robin cursor per shared group over the nodes holding members of it.
    turns: HashMap<GroupKey, usize>,
}

/// Who holds members of a shared group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Here,
    Peer(NodeId),
}

impl Tables {
    /// One more subscription to `route` here; whether the route is new (the others must learn it).
    pub fn local_added(&mut self, route: Route) -> bool {
        let count = self.local.entry(route).or_default();
        *count += 1;
        *count == 1
    }

    /// One subscription to `route` less; whether the route is gone.
    pub fn local_removed(&mut self, route: &Route) -> bool {
        let Some(count) = self.local.get_mut(route) else {
            debug_assert!(false, "a route removed more often than added: {route:?}");
            return false;
        };
        *count -= 1;
        if *count == 0 {
            self.local.remove(route);
            return true;
        }
        false
    }

    pub fn local_routes(&self) -> Vec<Route> {
        self.local.keys().cloned().collect()
    }

    pub fn replace_remote(&mut self, node: NodeId, routes: Vec<Route>) {
        self.remote.insert(node, routes.into_iter().collect());
    }

    pub fn remote_added(&mut self, node: NodeId, route: Route) {
        self.remote.entry(node).or_default().insert(route);
    }

    pub fn remote_removed(&mut self, node: NodeId, route: &Route) {
        if let Some(routes) = self.remote.get_mut(&node) {
            routes.remove(route);
        }
    }

    /// Forgets a node that left the cluster.
    pub fn forget(&mut self, node: NodeId) {
        self.remote.remove(&node);
    }

    /// Those of `nodes` with a non-shared route matching `topic`.
    pub fn plain_matches(&self, topic: &str, nodes: &[NodeId]) -> Vec<NodeId> {
        nodes
            .iter()
            .copied()
            .filter(|node| {
                self.remote.get(node).is_some_and(|routes| {
                    routes
                        .iter()
                        .any(|r| r.group.is_none() && topic_matches(&r.filter, topic))
                })
            })
            .collect()
    }

    /// Where a publish on `topic` goes among the `live` other nodes: each one with a matching
    /// non-shared route gets a copy; each shared group matching anywhere goes to one holder, in
    /// turn (this node included); a retained message goes to every live node (each keeps the
    /// retained set).
    pub fn plan(&mut self, topic: &str, retain: bool, live: &[NodeId]) -> Plan {
        let mut targets: BTreeMap<NodeId, (bool, Vec<GroupKey>)> = BTreeMap::new();
        let mut groups: BTreeMap<GroupKey, Vec<Holder>> = BTreeMap::new();
        for route in self.local.keys() {
            if let Some(key) = route.group_key() {
                if topic_matches(&route.filter, topic) {
                    groups.entry(key).or_default().push(Holder::Here);
                }
            }
        }
        for &node in live {
            if retain {
                targets.entry(node).or_default();
            }
            let Some(routes) = self.remote.get(&node) else {
                continue;
            };
            for route in routes {
                if !topic_matches(&route.filter, topic) {
                    continue;
                }
                match route.group_key() {
                    None => targets.entry(node).or_default().0 = true,
                    Some(key) => groups.entry(key).or_default().push(Holder::Peer(node)),
                }
            }
        }
        let mut plan = Plan::default();
        for (key, holders) in groups {
            if holders == [Holder::Here] {
                continue;
            }
            let turn = self.turns.entry(key.clone()).or_default();
            let pick = holders[*turn % holders.len()];
            *turn = turn.wrapping_add(1);
            if let Holder::Peer(node) = pick {
                if holders[0] == Holder::Here {
                    plan.elsewhere.push(key.clone());
                }
                targets.entry(node).or_default().1.push(key);
            }
        }
        plan.targets = targets
            .into_iter()
            .filter(|(_, (any, groups))| retain || *any || !groups.is_empty())
            .map(|(node, (_, groups))| (node, groups))
            .collect();
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(filter: &str, group: Option<&str>) -> Route {
        Route::new(filter, group)
    }

    #[test]
    fn routes_are_counted() {
        let mut t = Tables::default();
        assert!(t.local_added(r("a/#", None)));
        assert!(!t.local_added(r("a/#", None)));
        assert!(!t.local_removed(&r("a/#", None)));
        assert!(t.local_removed(&r("a/#", None)));
        assert!(t.local_routes().is_empty());
    }

    #[test]
    fn only_live_nodes_with_a_match_get_a_copy() {
        let mut t = Tables::default();
        t.replace_remote(2, vec![r("a/+", None)]);
        t.replace_remote(3, vec![r("b", None)]);
        t.replace_remote(4, vec![r("#", None)]);
        let plan = t.plan("a/x", false, &[2, 3]);
        assert_eq!(plan.targets, vec![(2, vec![])]);
        assert!(plan.elsewhere.is_empty());
        assert!(t.plan("c", false, &[2, 3]).is_empty());
        // A retained message (or its clear) reaches every live node.
        assert_eq!(
            t.plan("c", true, &[2, 3]).targets,
            vec![(2, vec![]), (3, vec![])]
        );
        assert_eq!(t.plain_matches("a/x", &[2, 3, 4]), vec![2, 4]);
        // `$` topics are not matched by leading wildcards, as in the trie.
        t.replace_remote(2, vec![r("#", None)]);
        assert!(t.plan("$SYS/x", false, &[2]).is_empty());
    }

    #[test]
    fn a_shared_group_takes_turns_over_its_holders() {
        let mut t = Tables::default();
        t.local_added(r("s/+", Some("g")));
        t.replace_remote(2, vec![r("s/+", Some("g"))]);
        t.replace_remote(3, vec![r("s/+", Some("other"))]);
        let key = GroupKey {
            filter: "s/+".into(),
            group: "g".into(),
        };
        let other = GroupKey {
            filter: "s/+".into(),
            group: "other".into(),
        };
        let mut here = 0;
        for _ in 0..4 {
            let plan = t.plan("s/1", false, &[2, 3]);
            // The other group lives on node 3 alone: every message.
            assert!(plan.targets.contains(&(3, vec![other.clone()])), "{plan:?}");
            if plan.elsewhere.is_empty() {
                here += 1;
                assert!(!plan.targets.iter().any(|(n, _)| *n == 2));
            } else {
                assert_eq!(plan.elsewhere, vec![key.clone()]);
                assert!(plan.targets.contains(&(2, vec![key.clone()])));
            }
        }
        assert_eq!(here, 2, "each message to one holder, in turn");
    }
}
