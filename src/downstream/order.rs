//! Make before break across Envoy's types on one ADS stream: the rule that
//! decides whether a type's change goes out now, goes out in part (what it
//! adds and changes, keeping what it removes), or waits for another type of
//! the same stream. Pure: what each type of the stream stands at in, a
//! decision out; the stream (`stream.rs`) reads the standings and acts.
//!
//! The rule (Envoy's `xds_protocol.rst`, "Eventual consistency
//! considerations"; istiod's push order): clusters, then their endpoints,
//! then listeners, then routes, secrets before all of them; removals the
//! other way. A type's additions and changes wait until every type before
//! it holds what it is to add (ACKed); its removals wait until every type
//! that may name what it removes is settled (nothing outstanding, nothing
//! to send, nothing refused): the types after it, except that nothing names
//! a listener and route configurations are named by listeners. A type whose change both adds and removes sends its additions
//! first, keeping what it removes, and the removals once the types after it
//! settled. A type the client refused (NACKed) holds the types that depend
//! on it: a route to a cluster Envoy rejected is not sent.
//!
//! Only the ranked types take part; a change of one type is sent at once,
//! as are the names a client newly asks for (Envoy asks for a new cluster's
//! endpoints while it warms the cluster, before it ACKs it).

use super::names::Names;
use crate::cache::{CollectionSnapshot, Diff};

/// Where a type stands in Envoy's order of dependencies: each may name
/// those before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rank {
    Secrets,
    Clusters,
    Endpoints,
    Listeners,
    Routes,
}

impl Rank {
    /// The rank of an xDS type URL; `None`: a type whose order does not
    /// matter (Istio's kinds over MCP over xDS, anything else).
    pub fn of(type_url: &str) -> Option<Rank> {
        let name = type_url.strip_prefix("type.googleapis.com/")?;
        Some(match name {
            "envoy.extensions.transport_sockets.tls.v3.Secret" => Rank::Secrets,
            "envoy.config.cluster.v3.Cluster" => Rank::Clusters,
            "envoy.config.endpoint.v3.ClusterLoadAssignment" => Rank::Endpoints,
            "envoy.config.listener.v3.Listener" => Rank::Listeners,
            "envoy.config.route.v3.RouteConfiguration"
            | "envoy.config.route.v3.ScopedRouteConfiguration"
            | "envoy.config.route.v3.VirtualHost" => Rank::Routes,
            _ => return None,
        })
    }

    /// Whether a resource of type `other` may name one of this type: its
    /// removals wait for `other` to settle. Every type after it, except
    /// that nothing names a listener, and of the types after them only
    /// listeners name route configurations (by RDS): a route configuration
    /// goes once the listener that read it moved on (Envoy's draining
    /// listener still reads it, see `drains`).
    pub fn named_by(self, other: Rank) -> bool {
        match self {
            Rank::Listeners => false,
            Rank::Routes => other == Rank::Listeners,
            _ => other > self,
        }
    }

    /// As the views name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rank::Secrets => "secrets",
            Rank::Clusters => "clusters",
            Rank::Endpoints => "endpoints",
            Rank::Listeners => "listeners",
            Rank::Routes => "routes",
        }
    }
}

/// What a response does to what the client holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// It adds or changes a resource.
    pub makes: bool,
    /// It removes a resource.
    pub breaks: bool,
}

impl Change {
    pub const NONE: Change = Change {
        makes: false,
        breaks: false,
    };

    pub fn any(self) -> bool {
        self.makes || self.breaks
    }

    /// From what the client holds (`None`: nothing yet) to `to`, in the
    /// resources it asks for (`None`: all of them). At the cost of the
    /// change (consecutive versions share their structure).
    pub fn between(held: Option<&CollectionSnapshot>, to: &CollectionSnapshot, names: Option<&Names>) -> Change {
        let covers = |name: &str| names.is_none_or(|n| n.covers(name));
        let Some(held) = held else {
            let makes = match names {
                Some(n) if !n.wildcard => n.names.iter().any(|name| to.resources.contains_key(&**name)),
                _ => !to.is_empty(),
            };
            return Change { makes, breaks: false };
        };
        if held.version == to.version {
            return Change::NONE;
        }
        let diff = Diff::between(&held.resources, &to.resources);
        Change {
            makes: diff.upserts.iter().any(|r| covers(&r.name)),
            breaks: diff.removed.iter().any(|n| covers(n)),
        }
    }
}

/// One ranked type of a stream, as the order sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    pub rank: Rank,
    /// A response is outstanding: what it does.
    pub in_flight: Option<Change>,
    /// What it has yet to send to reach what its group is served.
    pub pending: Change,
    /// Its last response was refused (NACKed), and nothing later ACKed: what
    /// that response did (the client may hold any part of it).
    pub refused: Option<Change>,
}

impl Standing {
    /// What it is still to add or change: the types after it wait for that.
    fn unmade(&self) -> Option<Why> {
        if self.in_flight.is_some_and(|c| c.makes) {
            Some(Why::Unacked)
        } else if self.refused.is_some_and(|c| c.makes) {
            Some(Why::Refused)
        } else if self.pending.makes {
            Some(Why::Pending)
        } else {
            None
        }
    }

    /// Anything it is still to do: the removals of the types before it wait
    /// for that (a route that stops naming a cluster goes before the
    /// cluster).
    fn unsettled(&self) -> Option<Why> {
        if self.in_flight.is_some() {
            Some(Why::Unacked)
        } else if self.refused.is_some() {
            Some(Why::Refused)
        } else if self.pending.any() {
            Some(Why::Pending)
        } else {
            None
        }
    }
}

/// Why a type waits for another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The other's response is not answered yet.
    Unacked,
    /// The client refused the other's last response.
    Refused,
    /// The other has a change of its own to send first.
    Pending,
    /// What it removes was named by a listener that Envoy still drains
    /// (see `drains`): the removal goes when the drain ends.
    Draining,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Unacked => "UNACKED",
            Why::Refused => "NACKED",
            Why::Pending => "PENDING",
            Why::Draining => "DRAINING",
        }
    }
}

/// The type a change waits for, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocker {
    pub rank: Rank,
    pub why: Why,
    /// It waits to remove (for a type after it), not to add (for one
    /// before it).
    pub removal: bool,
}

/// What a type with a change does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Send the whole change.
    Send,
    /// Send what it adds and changes, keeping what it removes; the removals
    /// wait for `Blocker`.
    MakesFirst(Blocker),
    /// Send nothing yet.
    Hold(Blocker),
}

/// `decision` for a change that does `wants`, when its removals must
/// also wait for a drain of listeners (`draining`): what it adds goes as
/// decided, what it removes waits.
/// `partly`: some of its removals need not wait (they go with what it
/// adds, the drained ones kept).
pub fn after_drain(decision: Decision, wants: Change, draining: bool, partly: bool) -> Decision {
    if !draining || !wants.breaks || !matches!(decision, Decision::Send) {
        return decision;
    }
    let blocker = Blocker {
        rank: Rank::Listeners,
        why: Why::Draining,
        removal: true,
    };
    if wants.makes || partly {
        Decision::MakesFirst(blocker)
    } else {
        Decision::Hold(blocker)
    }
}

/// Whether the type at `rank`, whose change does `wants`, may send it,
/// given the stream's other ranked types.
pub fn decide(rank: Rank, wants: Change, others: &[Standing]) -> Decision {
    if wants.makes {
        // Lowest first: the one the chain waits for at its root.
        let before = others
            .iter()
            .filter(|o| o.rank < rank)
            .filter_map(|o| o.unmade().map(|why| (o.rank, why)))
            .min_by_key(|(rank, _)| *rank);
        if let Some((rank, why)) = before {
            return Decision::Hold(Blocker {
                rank,
                why,
                removal: false,
            });
        }
    }
    if wants.breaks {
        let after = others
            .iter()
            .filter(|o| rank.named_by(o.rank))
            .filter_map(|o| o.unsettled().map(|why| (o.rank, why)))
            .max_by_key(|(rank, _)| *rank);
        if let Some((rank, why)) = after {
            let blocker = Blocker {
                rank,
                why,
                removal: true,
            };
            return if wants.makes {
                Decision::MakesFirst(blocker)
            } else {
                Decision::Hold(blocker)
            };
        }
    }
    Decision::Send
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAKES: Change = Change {
        makes: true,
        breaks: false,
    };
    const BREAKS: Change = Change {
        makes: false,
        breaks: true,
    };
    const BOTH: Change = Change {
        makes: true,
        breaks: true,
    };

    fn settled(rank: Rank) -> Standing {
        Standing {
            rank,
            in_flight: None,
            pending: Change::NONE,
            refused: None,
        }
    }

    fn pending(rank: Rank, change: Change) -> Standing {
        Standing {
            pending: change,
            ..settled(rank)
        }
    }

    fn in_flight(rank: Rank, change: Change) -> Standing {
        Standing {
            in_flight: Some(change),
            ..settled(rank)
        }
    }

    fn refused(rank: Rank, change: Change) -> Standing {
        Standing {
            refused: Some(change),
            ..settled(rank)
        }
    }

    fn hold(rank: Rank, why: Why, removal: bool) -> Decision {
        Decision::Hold(Blocker { rank, why, removal })
    }

    #[test]
    fn envoys_types_rank_in_its_order_and_others_have_none() {
        let rank = |t: &str| Rank::of(&format!("type.googleapis.com/{t}"));
        assert_eq!(
            rank("envoy.extensions.transport_sockets.tls.v3.Secret"),
            Some(Rank::Secrets)
        );
        assert_eq!(rank("envoy.config.cluster.v3.Cluster"), Some(Rank::Clusters));
        assert_eq!(
            rank("envoy.config.endpoint.v3.ClusterLoadAssignment"),
            Some(Rank::Endpoints)
        );
        assert_eq!(rank("envoy.config.listener.v3.Listener"), Some(Rank::Listeners));
        assert_eq!(rank("envoy.config.route.v3.RouteConfiguration"), Some(Rank::Routes));
        assert_eq!(
            rank("envoy.config.route.v3.ScopedRouteConfiguration"),
            Some(Rank::Routes)
        );
        assert!(Rank::Secrets < Rank::Clusters && Rank::Clusters < Rank::Endpoints);
        assert!(Rank::Endpoints < Rank::Listeners && Rank::Listeners < Rank::Routes);
        assert_eq!(rank("istio.networking.v1alpha3.VirtualService"), None);
        assert_eq!(Rank::of("networking.istio.io/v1alpha3/VirtualService"), None);
        assert_eq!(
            Rank::of("envoy.config.cluster.v3.Cluster"),
            None,
            "a type URL, not a name"
        );
    }

    /// A change of one type goes out at once: nothing else is moving.
    #[test]
    fn a_change_of_one_type_is_sent_at_once() {
        let others = [
            settled(Rank::Clusters),
            settled(Rank::Endpoints),
            settled(Rank::Listeners),
        ];
        assert_eq!(decide(Rank::Routes, BOTH, &others), Decision::Send);
        let others = [
            settled(Rank::Endpoints),
            settled(Rank::Listeners),
            settled(Rank::Routes),
        ];
        assert_eq!(decide(Rank::Clusters, BOTH, &others), Decision::Send);
    }

    /// A route to a new cluster waits for the cluster, then for its
    /// endpoints (Envoy warms an EDS cluster until they come), then goes.
    #[test]
    fn a_route_to_a_new_cluster_goes_after_the_cluster_and_its_endpoints() {
        let mut clusters = pending(Rank::Clusters, MAKES);
        let mut endpoints = settled(Rank::Endpoints);
        let step = |c: Standing, e: Standing| decide(Rank::Routes, MAKES, &[c, e, settled(Rank::Listeners)]);
        assert_eq!(step(clusters, endpoints), hold(Rank::Clusters, Why::Pending, false));
        assert_eq!(decide(Rank::Clusters, MAKES, &[endpoints]), Decision::Send);
        clusters = in_flight(Rank::Clusters, MAKES);
        assert_eq!(step(clusters, endpoints), hold(Rank::Clusters, Why::Unacked, false));
        // Envoy asks for the new cluster's endpoints before it ACKs the
        // cluster (a new name: answered at once, see the stream).
        endpoints = in_flight(Rank::Endpoints, MAKES);
        clusters = settled(Rank::Clusters);
        assert_eq!(step(clusters, endpoints), hold(Rank::Endpoints, Why::Unacked, false));
        endpoints = settled(Rank::Endpoints);
        assert_eq!(step(clusters, endpoints), Decision::Send);
    }

    /// A cluster that routes stop naming goes once the routes went and were
    /// ACKed: removals wait for every type after them.
    #[test]
    fn a_cluster_is_removed_after_the_route_away_from_it() {
        let routes = pending(Rank::Routes, MAKES);
        assert_eq!(
            decide(Rank::Routes, MAKES, &[pending(Rank::Clusters, BREAKS)]),
            Decision::Send
        );
        assert_eq!(
            decide(Rank::Clusters, BREAKS, &[routes, settled(Rank::Listeners)]),
            hold(Rank::Routes, Why::Pending, true)
        );
        let routes = in_flight(Rank::Routes, MAKES);
        assert_eq!(
            decide(Rank::Clusters, BREAKS, &[routes]),
            hold(Rank::Routes, Why::Unacked, true)
        );
        assert_eq!(decide(Rank::Clusters, BREAKS, &[settled(Rank::Routes)]), Decision::Send);
    }

    /// A switch: a cluster added, another removed, and the route moved from
    /// one to the other. The clusters' additions go first (keeping the old
    /// one), then the route, then the removal.
    #[test]
    fn a_switch_adds_first_and_removes_last() {
        let routes = pending(Rank::Routes, MAKES);
        assert_eq!(
            decide(Rank::Clusters, BOTH, &[routes]),
            Decision::MakesFirst(Blocker {
                rank: Rank::Routes,
                why: Why::Pending,
                removal: true
            })
        );
        // The clusters' additions in flight: the route waits for them.
        let clusters = in_flight(Rank::Clusters, MAKES);
        assert_eq!(
            decide(Rank::Routes, MAKES, &[clusters]),
            hold(Rank::Clusters, Why::Unacked, false)
        );
        // ACKed, with only the removal pending: the route goes.
        let clusters = pending(Rank::Clusters, BREAKS);
        assert_eq!(decide(Rank::Routes, MAKES, &[clusters]), Decision::Send);
        // The route in flight, then ACKed: the removal goes.
        assert_eq!(
            decide(Rank::Clusters, BREAKS, &[in_flight(Rank::Routes, MAKES)]),
            hold(Rank::Routes, Why::Unacked, true)
        );
        assert_eq!(decide(Rank::Clusters, BREAKS, &[settled(Rank::Routes)]), Decision::Send);
    }

    /// A refused cluster holds what depends on it, and a refused route holds
    /// the removal of the cluster it still names.
    #[test]
    fn a_refused_step_holds_the_steps_that_depend_on_it() {
        let clusters = refused(Rank::Clusters, MAKES);
        assert_eq!(
            decide(Rank::Routes, MAKES, &[clusters, settled(Rank::Listeners)]),
            hold(Rank::Clusters, Why::Refused, false)
        );
        assert_eq!(
            decide(Rank::Listeners, MAKES, &[clusters]),
            hold(Rank::Clusters, Why::Refused, false)
        );
        // A refused removal holds no addition after it.
        assert_eq!(
            decide(Rank::Routes, MAKES, &[refused(Rank::Clusters, BREAKS)]),
            Decision::Send
        );
        let routes = refused(Rank::Routes, MAKES);
        assert_eq!(
            decide(Rank::Clusters, BREAKS, &[routes]),
            hold(Rank::Routes, Why::Refused, true)
        );
    }

    /// Each step waits for the nearest end of what it depends on: additions
    /// for the lowest unmade type, removals for the highest unsettled one.
    #[test]
    fn the_blocker_named_is_where_the_chain_starts() {
        let others = [
            pending(Rank::Clusters, MAKES),
            pending(Rank::Endpoints, MAKES),
            pending(Rank::Listeners, MAKES),
        ];
        assert_eq!(
            decide(Rank::Routes, MAKES, &others),
            hold(Rank::Clusters, Why::Pending, false)
        );
        let others = [pending(Rank::Listeners, BREAKS), pending(Rank::Routes, MAKES)];
        assert_eq!(
            decide(Rank::Clusters, BREAKS, &others),
            hold(Rank::Routes, Why::Pending, true)
        );
    }

    /// A route configuration goes once the listeners moved off it (a
    /// listener reads it by RDS), and a listener's removal waits for no
    /// route: a listener and its routes removed together go without a cycle.
    #[test]
    fn route_configurations_go_after_the_listeners_that_read_them() {
        assert_eq!(
            decide(Rank::Routes, BREAKS, &[pending(Rank::Listeners, BOTH)]),
            hold(Rank::Listeners, Why::Pending, true)
        );
        assert_eq!(
            decide(Rank::Routes, BREAKS, &[in_flight(Rank::Listeners, MAKES)]),
            hold(Rank::Listeners, Why::Unacked, true)
        );
        assert_eq!(
            decide(Rank::Listeners, BREAKS, &[pending(Rank::Routes, BREAKS)]),
            Decision::Send
        );
        assert_eq!(
            decide(Rank::Routes, BREAKS, &[settled(Rank::Listeners)]),
            Decision::Send
        );
    }

    /// Secrets come before the clusters and listeners that name them, and
    /// go after them.
    #[test]
    fn secrets_come_first_and_go_last() {
        let secrets = in_flight(Rank::Secrets, MAKES);
        assert_eq!(
            decide(Rank::Clusters, MAKES, &[secrets]),
            hold(Rank::Secrets, Why::Unacked, false)
        );
        assert_eq!(
            decide(Rank::Secrets, BREAKS, &[pending(Rank::Listeners, MAKES)]),
            hold(Rank::Listeners, Why::Pending, true)
        );
    }

    /// A drain holds only removals that the order would let go: what the
    /// change adds goes first.
    #[test]
    fn a_drain_holds_removals_only() {
        let drain = Blocker {
            rank: Rank::Listeners,
            why: Why::Draining,
            removal: true,
        };
        assert_eq!(
            after_drain(Decision::Send, BOTH, true, false),
            Decision::MakesFirst(drain)
        );
        assert_eq!(after_drain(Decision::Send, BREAKS, true, false), Decision::Hold(drain));
        assert_eq!(
            after_drain(Decision::Send, BREAKS, true, true),
            Decision::MakesFirst(drain),
            "the removals that need not wait go"
        );
        assert_eq!(after_drain(Decision::Send, MAKES, true, false), Decision::Send);
        assert_eq!(after_drain(Decision::Send, BREAKS, false, false), Decision::Send);
        let routes = hold(Rank::Routes, Why::Pending, true);
        assert_eq!(after_drain(routes, BREAKS, true, false), routes, "the routes first");
    }

    /// Every mix of standings is decided without a cycle: whatever the
    /// stream's types are doing, the lowest type with additions or the
    /// highest with removals can always go, so the order never deadlocks.
    #[test]
    fn some_type_can_always_go() {
        let ranks = [Rank::Clusters, Rank::Endpoints, Rank::Listeners, Rank::Routes];
        let changes = [Change::NONE, MAKES, BREAKS, BOTH];
        for combo in 0..4usize.pow(4) {
            let wants: Vec<Change> = (0..4).map(|i| changes[(combo / 4usize.pow(i)) % 4]).collect();
            if wants.iter().all(|c| !c.any()) {
                continue;
            }
            let standings: Vec<Standing> = ranks.iter().zip(&wants).map(|(r, c)| pending(*r, *c)).collect();
            let goes = ranks.iter().zip(&wants).enumerate().any(|(i, (rank, want))| {
                let others: Vec<Standing> = standings
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, s)| *s)
                    .collect();
                want.any() && !matches!(decide(*rank, *want, &others), Decision::Hold(_))
            });
            assert!(goes, "nothing can go with {wants:?}");
        }
    }
}
