//! Demand: the collections someone wants. Configured at start, added to when
//! a client asks for one, refused by the source. Sources read it to know what
//! to subscribe to; downstream adds to it; readiness waits for its configured
//! part. Both sides see it here, beside the cache, and never each other.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;

/// The collections the gateway wants from its source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubscriptionState {
    /// Configured at start (`--collections`, or the default set): what
    /// readiness waits for. A client's demand never changes it.
    pub configured: BTreeSet<Arc<str>>,
    /// Subscribed: configured at start, or asked for by a downstream client.
    pub wanted: BTreeSet<Arc<str>>,
    /// Refused by the source (`unsupported collection`), with its message.
    /// Never asked for again until restart: a refusal must not cause a loop.
    pub refused: BTreeMap<Arc<str>, String>,
}

/// The subscription set, shared by upstream (reads it, refuses from it),
/// downstream (adds collections clients ask for) and readiness.
#[derive(Debug)]
pub struct Subscriptions {
    state: watch::Sender<SubscriptionState>,
}

// === impl Subscriptions ===

impl Subscriptions {
    pub fn new(initial: impl IntoIterator<Item = Arc<str>>) -> Self {
        let configured: BTreeSet<Arc<str>> = initial.into_iter().collect();
        let state = SubscriptionState {
            wanted: configured.clone(),
            configured,
            refused: BTreeMap::new(),
        };
        Self {
            state: watch::Sender::new(state),
        }
    }

    /// Adds a collection a downstream client asked for. Returns false when the
    /// source refused it earlier (it is not asked for again).
    pub fn request(&self, collection: &Arc<str>) -> bool {
        let mut accepted = true;
        self.state.send_if_modified(|state| {
            if state.refused.contains_key(collection) {
                accepted = false;
                return false;
            }
            state.wanted.insert(collection.clone())
        });
        accepted
    }

    /// Drops a collection the source refused. Returns true if it was wanted.
    pub fn refuse(&self, collection: &str, message: String) -> bool {
        self.state.send_if_modified(|state| {
            let Some(name) = state.wanted.iter().find(|c| &***c == collection).cloned() else {
                return false;
            };
            state.wanted.remove(&name);
            state.refused.insert(name, message);
            true
        })
    }

    /// Whether the source refused the collection.
    pub fn is_refused(&self, collection: &str) -> bool {
        self.state.borrow().refused.contains_key(collection)
    }

    pub fn current(&self) -> SubscriptionState {
        self.state.borrow().clone()
    }

    /// Configured collections still subscribed (not refused by the source):
    /// the gateway is ready when the cache holds each of them.
    pub fn awaited(&self) -> Vec<Arc<str>> {
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
