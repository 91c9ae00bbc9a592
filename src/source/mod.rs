//! Sources: everything that writes the cache. The MCP sink session (one
//! implementation, `session` and `stream`) with its two transports: client
//! mode dials Galley's `ResourceSource` (`client`), dial-out serves
//! `ResourceSink` (`sink`), client mode's probe for collections only
//! clients asked for (`probe`), and the deadline of those demands
//! (`overdue`); the local files (`files`, with Kubernetes objects in
//! `kubernetes`, proto-JSON bodies in `proto_json`); the persisted snapshot
//! (`persisted`); the validation they share (`validate`), and what Envoy
//! would refuse of a resource, for `check` (`envoy_rules`). Sources never talk
//! to downstream streams: what clients want reaches them as the cache's
//! demand.

pub mod backoff;
pub mod client;
pub mod envoy_rules;
pub mod files;
mod kubernetes;
pub mod overdue;
pub mod persisted;
pub mod probe;
pub mod proto_json;
pub mod session;
pub mod sink;
pub mod stream;
pub mod validate;
mod yaml_lines;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::cache::demand::Subscriptions;
use crate::cache::CacheWriter;

pub use session::SinkSession;

/// Records that the source refused `collection` (it is not asked for again
/// until restart) and counts it; false when it was not wanted any more (or
/// already refused).
fn refuse(subscriptions: &Subscriptions, collection: &str, message: &str) -> bool {
    let refused = subscriptions.refuse(collection, message.to_owned());
    if refused {
        metrics::counter!(crate::metrics::UPSTREAM_REFUSED_COLLECTIONS, "collection" => collection.to_owned())
            .increment(1);
    }
    refused
}

/// Registers the sources' counters at 0, so dashboards and alerts see them
/// before the first event. (Their gauges, `mcp_gateway_upstream_connected`
/// and `mcp_gateway_source_files_broken`, are read from the upstream status
/// at every scrape.)
pub fn register_metrics() {
    for reason in stream::StreamEnd::REASONS {
        metrics::counter!(crate::metrics::UPSTREAM_STREAM_TERMINATIONS, "reason" => reason).absolute(0);
    }
    for reason in probe::REASONS {
        metrics::counter!(crate::metrics::PROBE_ENDS, "reason" => reason).absolute(0);
    }
}

/// What the sink side of every upstream stream is built from, whoever
/// dialled (client mode or Galley's dial-out).
#[derive(Clone, Debug)]
pub struct SinkContext {
    pub node: crate::proto::SinkNode,
    /// Ask for incremental updates (`--no-incremental` turns it off).
    pub incremental: bool,
    pub subscriptions: Arc<Subscriptions>,
    /// Writes each changed collection to `--cache-dir`.
    pub persister: Option<crate::source::persisted::Persister>,
    /// `--max-message-bytes`, for error messages.
    pub max_message_bytes: usize,
    /// Refuses a secret's body outside the collections of secrets.
    pub secrets: Arc<validate::SecretGuard>,
}

impl SinkContext {
    /// A new stream's session (reading the cache `writer` writes), and what
    /// the source is to receive.
    pub fn open(
        &self,
        writer: &CacheWriter,
    ) -> (
        stream::Opened,
        tokio::sync::mpsc::Receiver<crate::proto::RequestResources>,
    ) {
        let session = SinkSession::new(self.node.clone(), self.incremental, writer.cache().clone())
            .persisting(self.persister.clone())
            .with_max_message_bytes(self.max_message_bytes)
            .refusing_secrets(Some(self.secrets.clone()));
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
    /// Streams established (connected) so far.
    pub connections: u64,
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
    /// Files source: files that do not parse now (the last error names
    /// them); `mcp_gateway_source_files_broken` at scrape time.
    #[serde(skip)]
    pub broken_files: usize,
    /// Client mode: the probe stream, on which collections only clients
    /// asked for are asked first. Its failures never touch the fields
    /// above, which are the main stream's.
    pub probe: Option<ProbeStatus>,
}

/// What the probe stream is doing (client mode).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProbeStatus {
    /// The collections asked for on the open probe stream; empty while no
    /// probe is open.
    pub asking: Vec<String>,
    /// Probe streams attempted since start.
    pub attempts: u64,
    pub last_error: Option<String>,
    /// The wait before the next probe, after a failure.
    pub next_retry_in: Option<Duration>,
}
