//! Demand: the collections someone wants. Configured at start, added to when
//! a client asks for one, refused by the source. Sources read it to know what
//! to subscribe to; downstream adds to it; readiness waits for its configured
//! part. Both sides see it here, beside the cache, and never each other.
//!
//! A collection only a client asked for never risks what others get: it is
//! *demanded* until the source shows it serves it (then it is subscribed
//! like a configured one) or refuses it, and a demand the source leaves
//! unanswered for `--demand-timeout` is *overdue*: clients that must be
//! answered (xDS) are answered empty meanwhile.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::SharedStr;

/// `--demand-timeout`'s default.
pub const DEFAULT_DEMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// How a collection that only a client asked for reaches the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DemandRoute {
    /// Subscribed at once: the files source answers every wanted collection.
    Subscribe,
    /// Client mode: asked first on a probe stream of its own, and
    /// subscribed on the main stream once the source delivered it there. A
    /// source that ends a stream for a collection it does not serve (Galley
    /// 1.1 to 1.7, istio#13559) ends only the probe.
    Probe,
    /// Dial-out: never asked. The gateway cannot open a second stream to
    /// the source, and a refusal would end the one stream, for every
    /// collection.
    Hold,
}

/// A collection a client asked for that is not configured, while the source
/// has neither delivered nor refused it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Demand {
    /// When a client first asked.
    pub asked_at: SystemTime,
    /// When the source could first answer: the deadline counts from here.
    /// The client's ask, or, if the upstream was down then, when it came
    /// up: a source that cannot be reached has not left anything
    /// unanswered, and an empty answer would make istiod drop what it holds.
    pub clock: Option<Instant>,
    /// When `--demand-timeout` passed without an answer from the source.
    pub overdue_since: Option<SystemTime>,
}

/// The collections the gateway wants from its source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubscriptionState {
    /// Configured at start (`--collections`, or the default set): what
    /// readiness waits for. A client's demand never changes it.
    pub configured: BTreeSet<SharedStr>,
    /// Subscribed: configured at start, or asked for by a downstream client
    /// and delivered by the source (or at once, for the files source).
    pub wanted: BTreeSet<SharedStr>,
    /// Asked for by a client, not configured, and neither delivered nor
    /// refused by the source yet.
    pub demanded: BTreeMap<SharedStr, Demand>,
    /// Refused by the source (`unsupported collection`), with its message.
    /// Never asked for again until restart: a refusal must not cause a loop.
    pub refused: BTreeMap<SharedStr, String>,
}

/// The subscription set, shared by upstream (reads it, refuses from it),
/// downstream (adds collections clients ask for) and readiness.
#[derive(Debug)]
pub struct Subscriptions {
    state: watch::Sender<SubscriptionState>,
    route: DemandRoute,
    /// `--demand-timeout`.
    timeout: Duration,
}

// === impl Subscriptions ===

impl Subscriptions {
    /// The files source's subscriptions: every collection asked for is
    /// subscribed at once.
    pub fn new(initial: impl IntoIterator<Item = SharedStr>) -> Self {
        Self::with_route(initial, DemandRoute::Subscribe, DEFAULT_DEMAND_TIMEOUT)
    }

    pub fn with_route(initial: impl IntoIterator<Item = SharedStr>, route: DemandRoute, timeout: Duration) -> Self {
        let configured: BTreeSet<SharedStr> = initial.into_iter().collect();
        let state = SubscriptionState {
            wanted: configured.clone(),
            configured,
            ..Default::default()
        };
        Self {
            state: watch::Sender::new(state),
            route,
            timeout,
        }
    }

    pub fn route(&self) -> DemandRoute {
        self.route
    }

    /// `--demand-timeout`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Adds a collection a downstream client asked for: subscribed, or
    /// demanded as the route says. Returns false when the source refused it
    /// earlier (it is not asked for again).
    pub fn request(&self, collection: &SharedStr) -> bool {
        let mut accepted = true;
        self.state.send_if_modified(|state| {
            if state.refused.contains_key(collection) {
                accepted = false;
                return false;
            }
            if state.wanted.contains(collection) || state.demanded.contains_key(collection) {
                return false;
            }
            if self.route == DemandRoute::Subscribe {
                return state.wanted.insert(collection.clone());
            }
            state.demanded.insert(
                collection.clone(),
                Demand {
                    asked_at: SystemTime::now(),
                    clock: None,
                    overdue_since: None,
                },
            );
            true
        });
        accepted
    }

    /// The source delivered a demanded collection (on a probe): it is
    /// subscribed from now on. Returns false if it was not demanded.
    pub fn deliver(&self, collection: &str) -> bool {
        self.state.send_if_modified(|state| {
            let Some((name, _)) = state.demanded.remove_entry(collection) else {
                return false;
            };
            state.wanted.insert(name);
            true
        })
    }

    /// Drops a collection the source refused. Returns true if it was wanted
    /// or demanded.
    pub fn refuse(&self, collection: &str, message: String) -> bool {
        self.state.send_if_modified(|state| {
            let name = match state.demanded.remove_entry(collection) {
                Some((name, _)) => name,
                None => match state.wanted.iter().find(|c| &***c == collection).cloned() {
                    Some(name) => {
                        state.wanted.remove(&name);
                        name
                    }
                    None => return false,
                },
            };
            state.refused.insert(name, message);
            true
        })
    }

    /// Whether the source refused the collection.
    pub fn is_refused(&self, collection: &str) -> bool {
        self.state.borrow().refused.contains_key(collection)
    }

    /// Whether the collection is demanded and `--demand-timeout` passed
    /// without an answer from the source: clients that must be answered
    /// get it empty until the source delivers it.
    pub fn is_overdue(&self, collection: &str) -> bool {
        self.state
            .borrow()
            .demanded
            .get(collection)
            .is_some_and(|d| d.overdue_since.is_some())
    }

    /// The collections demanded and not yet delivered or refused, in order.
    pub fn demanded(&self) -> Vec<SharedStr> {
        self.state.borrow().demanded.keys().cloned().collect()
    }

    /// Starts the clock of every demand that has none: the upstream is up
    /// at `now`, so the source can answer. Returns whether one started.
    pub fn start_clocks(&self, now: Instant) -> bool {
        self.state.send_if_modified(|state| {
            let mut started = false;
            for demand in state.demanded.values_mut().filter(|d| d.clock.is_none()) {
                demand.clock = Some(now);
                started = true;
            }
            started
        })
    }

    /// Marks the demands whose clock ran `--demand-timeout` by `now` as
    /// overdue; returns those newly marked.
    pub fn expire(&self, now: Instant) -> Vec<SharedStr> {
        let mut expired = Vec::new();
        self.state.send_if_modified(|state| {
            for (collection, demand) in &mut state.demanded {
                let due = demand.clock.is_some_and(|clock| now >= clock + self.timeout);
                if demand.overdue_since.is_none() && due {
                    demand.overdue_since = Some(SystemTime::now());
                    expired.push(collection.clone());
                }
            }
            !expired.is_empty()
        });
        expired
    }

    /// When the next demand becomes overdue, if one is pending.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.state
            .borrow()
            .demanded
            .values()
            .filter(|d| d.overdue_since.is_none())
            .filter_map(|d| d.clock)
            .min()
            .map(|clock| clock + self.timeout)
    }

    pub fn current(&self) -> SubscriptionState {
        self.state.borrow().clone()
    }

    /// Configured collections still subscribed (not refused by the source):
    /// the gateway is ready when the cache holds each of them.
    pub fn awaited(&self) -> Vec<SharedStr> {
        let state = self.state.borrow();
        state
            .configured
            .iter()
            .filter(|c| state.wanted.contains(*c))
            .cloned()
            .collect()
    }

    pub fn watch(&self) -> watch::Receiver<SubscriptionState> {
        self.state.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VS: &str = "istio/networking/v1alpha3/virtualservices";
    const WG: &str = "istio/networking/v1alpha3/workloadgroups";
    const TELEMETRY: &str = "istio/telemetry/v1alpha1/telemetries";

    fn probing() -> Subscriptions {
        Subscriptions::with_route([SharedStr::from(VS)], DemandRoute::Probe, Duration::from_secs(5))
    }

    #[test]
    fn the_files_source_subscribes_what_a_client_asks_for_at_once() {
        let subscriptions = Subscriptions::new([SharedStr::from(VS)]);
        assert!(subscriptions.request(&SharedStr::from(WG)));
        let state = subscriptions.current();
        assert!(state.wanted.contains(WG));
        assert!(state.demanded.is_empty());
        assert_eq!(
            subscriptions.awaited(),
            [SharedStr::from(VS)],
            "a client's demand is not awaited"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_demand_is_held_apart_until_the_source_delivers_it() {
        let subscriptions = probing();
        let mut watch = subscriptions.watch();
        watch.borrow_and_update();
        assert!(subscriptions.request(&SharedStr::from(WG)));
        assert!(watch.has_changed().unwrap(), "the probe hears of it");
        let state = subscriptions.current();
        assert!(!state.wanted.contains(WG), "not on the main stream");
        assert_eq!(subscriptions.demanded(), [SharedStr::from(WG)]);
        // Asking again changes nothing; a configured collection is not demanded.
        watch.borrow_and_update();
        assert!(subscriptions.request(&SharedStr::from(WG)));
        assert!(subscriptions.request(&SharedStr::from(VS)));
        assert!(!watch.has_changed().unwrap());

        assert!(subscriptions.deliver(WG));
        let state = subscriptions.current();
        assert!(state.wanted.contains(WG) && state.demanded.is_empty());
        assert!(!subscriptions.deliver(WG), "delivered once");
        assert_eq!(
            subscriptions.awaited(),
            [SharedStr::from(VS)],
            "readiness never waits for it"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_demand_is_never_asked_again() {
        let subscriptions = probing();
        subscriptions.request(&SharedStr::from(WG));
        assert!(subscriptions.refuse(WG, "unsupported collection".into()));
        assert!(subscriptions.is_refused(WG));
        assert!(subscriptions.demanded().is_empty());
        assert!(!subscriptions.request(&SharedStr::from(WG)), "refused until restart");
        assert!(subscriptions.demanded().is_empty());
        assert!(!subscriptions.refuse(WG, "again".into()), "refused once");
        // A configured collection the source refuses leaves the subscription.
        assert!(subscriptions.refuse(VS, "unsupported collection".into()));
        assert!(subscriptions.awaited().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_demand_is_overdue_once_the_timeout_passes_and_only_once() {
        let subscriptions = probing();
        assert_eq!(subscriptions.next_deadline(), None);
        subscriptions.request(&SharedStr::from(WG));
        // The upstream is down: the source has not been given a chance.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            subscriptions.next_deadline(),
            None,
            "no clock while the upstream is down"
        );
        assert!(subscriptions.expire(Instant::now()).is_empty());
        let start = Instant::now();
        assert!(subscriptions.start_clocks(start), "up: the clock starts");
        assert!(!subscriptions.start_clocks(start), "once");
        tokio::time::advance(Duration::from_secs(2)).await;
        subscriptions.request(&SharedStr::from(TELEMETRY));
        subscriptions.start_clocks(Instant::now());
        assert_eq!(subscriptions.next_deadline(), Some(start + Duration::from_secs(5)));

        assert!(subscriptions.expire(Instant::now()).is_empty());
        assert!(!subscriptions.is_overdue(WG));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(subscriptions.expire(Instant::now()), [SharedStr::from(WG)]);
        assert!(subscriptions.is_overdue(WG));
        assert!(!subscriptions.is_overdue(TELEMETRY));
        assert_eq!(
            subscriptions.next_deadline(),
            Some(start + Duration::from_secs(7)),
            "an overdue demand has no deadline left"
        );
        assert!(subscriptions.expire(Instant::now()).is_empty(), "overdue once");

        // Still demanded: the source may deliver it later.
        assert_eq!(subscriptions.demanded().len(), 2);
        assert!(subscriptions.deliver(WG));
        assert!(!subscriptions.is_overdue(WG), "delivered is no longer overdue");
    }
}
