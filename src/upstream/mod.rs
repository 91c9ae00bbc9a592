//! The gateway as an MCP sink: which collections it subscribes to, the sink
//! protocol shared by every transport (`session`), and the client mode that
//! dials Galley's `ResourceSource` (`client`). It writes the cache and never
//! talks to downstream streams.

pub mod backoff;
pub mod client;
pub mod session;
pub mod sink;
pub mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

pub use session::SinkSession;

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

/// What the sink side of every upstream stream is built from, whoever
/// dialled (client mode or Galley's dial-out).
#[derive(Clone, Debug)]
pub struct SinkContext {
    pub node: crate::proto::SinkNode,
    /// Ask for incremental updates (`--no-incremental` turns it off).
    pub incremental: bool,
    pub cache: Arc<crate::cache::Cache>,
    pub subscriptions: Arc<Subscriptions>,
    /// Writes each changed collection to `--cache-dir`.
    pub persister: Option<crate::persist::Persister>,
    /// `--max-message-bytes`, for error messages.
    pub max_message_bytes: usize,
}

impl SinkContext {
    /// A new stream's session, with the initial request of every wanted
    /// collection already queued.
    pub fn open(&self) -> stream::Opened {
        let session = SinkSession::new(self.node.clone(), self.incremental, self.cache.clone())
            .persisting(self.persister.clone())
            .with_max_message_bytes(self.max_message_bytes);
        stream::open(session, &self.subscriptions)
    }
}

/// What the upstream side is doing, for readiness, logs and the debug view.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct UpstreamStatus {
    pub mode: &'static str,
    pub address: String,
    pub connected: bool,
    /// When the current connection state (connected or not) began.
    pub since: Option<SystemTime>,
    pub last_error: Option<String>,
    /// Streams attempted since start.
    pub attempts: u64,
    /// Attempts since a stream last made progress (every subscribed
    /// collection applied).
    pub consecutive_failures: u32,
    /// The wait before the next attempt, while disconnected.
    pub next_retry_in: Option<Duration>,
    /// Dial-out mode: the connected source's address.
    pub peer: Option<String>,
    /// Dial-out mode: the source's gRPC metadata (Galley's `--sinkMeta`
    /// pairs, `config.source.version`).
    pub source_metadata: BTreeMap<String, String>,
}
