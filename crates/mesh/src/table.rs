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
    /// retained set). Nodes `down` lately, whose sessions may not have been adopted yet, get a
    /// copy if a non-shared route of theirs matches, and serve a group none of whose holders
    /// is live: the mesh holds what it cannot deliver to them (decision 0062).
    pub fn plan(&mut self, topic: &str, retain: bool, live: &[NodeId], down: &[NodeId]) -> Plan {
        let mut targets: BTreeMap<NodeId, (bool, Vec<GroupKey>)> = BTreeMap::new();
        if retain {
            for &node in live {
                targets.entry(node).or_default();
            }
        }
        for node in self.plain_matches(topic, live) {
            targets.entry(node).or_default().0 = true;
        }
        for node in self.plain_matches(topic, down) {
            targets.entry(node).or_default().0 = true;
        }
        let mut plan = Plan::default();
        for (key, holders) in self.group_holders(topic, None, live, down) {
            if holders.live == [Holder::Here] {
                continue;
            }
            match self.pick(&key, &holders) {
                Some(Holder::Peer(node)) => {
                    if holders.live.first() == Some(&Holder::Here) {
                        plan.elsewhere.push(key.clone());
                    }
                    targets.entry(node).or_default().1.push(key);
                }
                Some(Holder::Here) | None => {}
            }
        }
        plan.targets = targets
            .into_iter()
            .filter(|(_, (any, groups))| retain || *any || !groups.is_empty())
            .map(|(node, (_, groups))| (node, groups))
            .collect();
        plan
    }

    /// Where a held publish on `topic` goes again: every node of `live` and `down` with a
    /// matching non-shared route (the receiver gives it only to the sessions it put back
    /// since), and each group of `missed` — the nodes a copy missed, each with the groups it was
    /// to serve — to one holder: where a member may have it, which skips it there (decision
    /// 0066) — this node if it is of `took_here` (a member here took it in), else the node it
    /// missed if that one is live again and still holds members — else one as [`Tables::plan`]
    /// picks it, live ones first.
    pub fn replan(
        &mut self,
        topic: &str,
        missed: &[(NodeId, Vec<GroupKey>)],
        took_here: &[GroupKey],
        live: &[NodeId],
        down: &[NodeId],
    ) -> Replan {
        let mut groups: Vec<GroupKey> = missed
            .iter()
            .flat_map(|(_, groups)| groups.iter().cloned())
            .collect();
        groups.sort();
        groups.dedup();
        let mut targets: BTreeMap<NodeId, Vec<GroupKey>> = BTreeMap::new();
        for node in self.plain_matches(topic, live) {
            targets.entry(node).or_default();
        }
        for node in self.plain_matches(topic, down) {
            targets.entry(node).or_default();
        }
        let mut replan = Replan::default();
        for (key, holders) in self.group_holders(topic, Some(&groups), live, down) {
            // Another member than the one that took the copy in would get the message a second
            // time. A member here did (the node it missed died, and this one adopted it), or
            // the node it missed answered too late and may have: the member that took it is
            // there (unless its client moved it since).
            let here = (took_here.contains(&key) && holders.live.contains(&Holder::Here))
                .then_some(Holder::Here);
            let missed_by = missed
                .iter()
                .map(|&(node, ref groups)| (Holder::Peer(node), groups))
                .find(|(node, groups)| groups.contains(&key) && holders.live.contains(node))
                .map(|(node, _)| node);
            match here.or(missed_by).or_else(|| self.pick(&key, &holders)) {
                Some(Holder::Here) => replan.here.push(key),
                Some(Holder::Peer(node)) => targets.entry(node).or_default().push(key),
                None => {}
            }
        }
        for key in groups {
            let served = replan.here.contains(&key) || targets.values().any(|g| g.contains(&key));
            if !served {
                replan.unserved.push(key);
            }
        }
        replan.targets = targets.into_iter().collect();
        replan
    }

    /// The holders of every shared group matching `topic` (of `only`, if given): this node and
    /// the `live` nodes, and apart the `down` ones.
    fn group_holders(
        &self,
        topic: &str,
        only: Option<&[GroupKey]>,
        live: &[NodeId],
        down: &[NodeId],
    ) -> BTreeMap<GroupKey, Holders> {
        let mut groups: BTreeMap<GroupKey, Holders> = BTreeMap::new();
        let wanted = |key: &GroupKey| only.is_none_or(|only| only.contains(key));
        for route in self.local.keys() {
            if let Some(key) = route.group_key().filter(|k| wanted(k)) {
                if topic_matches(&route.filter, topic) {
                    groups.entry(key).or_default().live.push(Holder::Here);
                }
            }
        }
        for (nodes, is_live) in [(live, true), (down, false)] {
            for &node in nodes {
                let Some(routes) = self.remote.get(&node) else {
                    continue;
                };
                for route in routes {
                    let Some(key) = route.group_key().filter(|k| wanted(k)) else {
                        continue;
                    };
                    if !topic_matches(&route.filter, topic) {
                        continue;
                    }
                    let holders = groups.entry(key).or_default();
                    if is_live {
                        holders.live.push(Holder::Peer(node));
                    } else {
                        holders.down.push(node);
                    }
                }
            }
        }
        groups
    }

    /// One holder of a group, in turn: a live one if any, else one of the nodes down lately.
    fn pick(&mut self, key: &GroupKey, holders: &Holders) -> Option<Holder> {
        let turn = self.turns.entry(key.clone()).or_default();
        let pick = if holders.live.is_empty() {
            Holder::Peer(*holders.down.get(*turn % holders.down.len().max(1))?)
        } else {
            holders.live[*turn % holders.live.len()]
        };
        *turn = turn.wrapping_add(1);
        Some(pick)
    }
}

/// The holders of one shared group.
#[derive(Debug, Default)]
struct Holders {
    /// This node first (if it holds members), then the live nodes.
    live: Vec<Holder>,
    /// Nodes down lately that held members (their sessions may be adopted elsewhere soon).
    down: Vec<NodeId>,
}

/// Where a held publish goes again ([`Tables::replan`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replan {
    /// Each other node that gets it, with the groups it serves.
    pub targets: Vec<(NodeId, Vec<GroupKey>)>,
    /// The groups this node serves.
    pub here: Vec<GroupKey>,
    /// The groups that no node holds members of any more (their members ended).
    pub unserved: Vec<GroupKey>,
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
        let plan = t.plan("a/x", false, &[2, 3], &[]);
        assert_eq!(plan.targets, vec![(2, vec![])]);
        assert!(plan.elsewhere.is_empty());
        assert!(t.plan("c", false, &[2, 3], &[]).is_empty());
        // A retained message (or its clear) reaches every live node.
        assert_eq!(
            t.plan("c", true, &[2, 3], &[]).targets,
            vec![(2, vec![]), (3, vec![])]
        );
        assert_eq!(t.plain_matches("a/x", &[2, 3, 4]), vec![2, 4]);
        // `$` topics are not matched by leading wildcards, as in the trie.
        t.replace_remote(2, vec![r("#", None)]);
        assert!(t.plan("$SYS/x", false, &[2], &[]).is_empty());
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
            let plan = t.plan("s/1", false, &[2, 3], &[]);
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

    #[test]
    fn a_group_held_only_on_nodes_down_lately_goes_to_them_and_live_holders_come_first() {
        let mut t = Tables::default();
        let key = GroupKey {
            filter: "s/+".into(),
            group: "g".into(),
        };
        t.replace_remote(2, vec![r("s/+", Some("g")), r("p", None)]);
        t.replace_remote(3, vec![r("s/+", Some("g"))]);
        // Node 2 is down lately, node 3 live: node 3 serves every message.
        for _ in 0..3 {
            let plan = t.plan("s/1", false, &[3], &[2]);
            assert_eq!(plan.targets, vec![(3, vec![key.clone()])]);
        }
        // Only node 2 holds members: it is planned (and the mesh holds what it cannot deliver).
        assert_eq!(
            t.plan("s/1", false, &[], &[2]).targets,
            vec![(2, vec![key.clone()])]
        );
        // A non-shared route of a node down lately matches too.
        assert_eq!(t.plan("p", false, &[3], &[2]).targets, vec![(2, vec![])]);

        // Given again: the group to a live holder (here, or node 3), never to one of its
        // non-shared routes' nodes only.
        let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[3], &[]);
        assert_eq!(again.targets, vec![(3, vec![key.clone()])]);
        assert!(again.here.is_empty() && again.unserved.is_empty());
        t.local_added(r("s/+", Some("g")));
        let mut here = 0;
        for _ in 0..4 {
            let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[3], &[]);
            here += again.here.len();
        }
        assert_eq!(here, 2, "in turn with node 3");
        // No holder left anywhere: unserved.
        t.local_removed(&r("s/+", Some("g")));
        let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[], &[]);
        assert_eq!(again.unserved, vec![key.clone()]);
        // Non-shared routes of live nodes get it again (for sessions put back since).
        assert_eq!(
            t.replan("p", &[], &[], &[2], &[]).targets,
            vec![(2, vec![])]
        );
    }

    #[test]
    fn a_group_goes_again_to_the_node_it_missed_when_that_one_answers_again() {
        let mut t = Tables::default();
        let key = GroupKey {
            filter: "s/+".into(),
            group: "g".into(),
        };
        t.replace_remote(2, vec![r("s/+", Some("g"))]);
        t.replace_remote(3, vec![r("s/+", Some("g"))]);
        t.local_added(r("s/+", Some("g")));
        // Node 2 answered too late, and answers again: it may have taken its copy in, and its
        // member remembers it. Every time, whatever the turn.
        for _ in 0..3 {
            let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[2, 3], &[]);
            assert_eq!(again.targets, vec![(2, vec![key.clone()])]);
            assert!(again.here.is_empty());
        }
        // Node 2 is down: the holders in turn.
        let mut served = BTreeSet::new();
        for _ in 0..4 {
            let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[3], &[2]);
            served.extend(again.targets.into_iter().map(|(node, _)| Some(node)));
            served.extend(again.here.into_iter().map(|_| None));
        }
        assert_eq!(served, BTreeSet::from([None, Some(3)]));
        // A member here took it in (it adopted node 2's): here, whatever the turn.
        for _ in 0..3 {
            let took_here = std::slice::from_ref(&key);
            let again = t.replan("s/1", &[(2, vec![key.clone()])], took_here, &[3], &[2]);
            assert!(again.targets.is_empty());
            assert_eq!(again.here, vec![key.clone()]);
        }
        // Node 2 answers again but holds no member any more: the others.
        t.replace_remote(2, vec![]);
        let again = t.replan("s/1", &[(2, vec![key.clone()])], &[], &[2, 3], &[]);
        assert!(!again.targets.iter().any(|(node, _)| *node == 2));
    }
}
