//! The aggregated services legacy clients use: `StreamAggregatedResources`
//! (state of the world, many types per stream) and
//! `IncrementalAggregatedResources` (diffs, one type per stream). One task per
//! stream owns its nonce state; it reads the cache and never writes it.

mod incremental;
pub mod registry;
pub mod service;
mod sotw;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Status, Streaming};

use crate::cache::Cache;
use crate::collections::{CollectionTable, Resolved};
use crate::metrics as m;
use crate::upstream::Subscriptions;
use crate::wire::{EncodedResponse, IncrementalRequest, SotwRequest};
use registry::NackRecord;
pub use registry::Registry;
pub use service::AggregatedService;

/// Responses queued per stream. A stream has at most one response outstanding
/// per type, so a client that stops reading holds at most this many (and then
/// only its own task waits).
const OUTBOUND_QUEUE: usize = 16;

/// How long a stream that ends with an error waits to hand its status to a
/// client that is not reading.
const STATUS_SEND_TIMEOUT: Duration = Duration::from_secs(5);

type Outbound = mpsc::Sender<Result<EncodedResponse, Status>>;

/// What every stream shares.
#[derive(Clone)]
pub struct Downstream {
    inner: Arc<Shared>,
}

struct Shared {
    cache: Arc<Cache>,
    table: Arc<CollectionTable>,
    subscriptions: Arc<Subscriptions>,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    next_stream_id: AtomicU64,
}

// === impl Downstream ===

impl Downstream {
    pub fn new(
        cache: Arc<Cache>,
        table: Arc<CollectionTable>,
        subscriptions: Arc<Subscriptions>,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            inner: Arc::new(Shared {
                cache,
                table,
                subscriptions,
                registry,
                shutdown,
                tasks,
                next_stream_id: AtomicU64::new(1),
            }),
        }
    }

    fn next_id(&self) -> u64 {
        self.inner.next_stream_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Resolves a client's `type_url`; an unknown one ends the stream.
    fn resolve(&self, type_url: &str) -> Result<Resolved, Status> {
        self.inner
            .table
            .resolve(type_url)
            .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    /// Starts following a collection for a stream: subscribes upstream when a
    /// client is the first to ask for it.
    fn follow(&self, collection: &Arc<str>) {
        if !self.inner.subscriptions.request(collection) {
            tracing::warn!(
                %collection,
                "a client asked for a collection the source refused; it gets no response until the source serves it"
            );
        }
    }
}

/// Counts and logs a client's NACK of `version`, and returns the record the
/// stream keeps (the version is never sent to that client again).
fn record_nack(
    stream: u64,
    type_url: &str,
    collection: &Arc<str>,
    version: Arc<str>,
    error: tonic_types::Status,
) -> NackRecord {
    metrics::counter!(m::DOWNSTREAM_NACKS, "collection" => collection.clone()).increment(1);
    metrics::counter!(
        m::REQUEST_NACKS,
        "component" => m::COMPONENT_DOWNSTREAM,
        "collection" => collection.clone(),
        "code" => m::code_label(error.code)
    )
    .increment(1);
    tracing::warn!(
        stream,
        %type_url,
        %version,
        code = error.code,
        message = %error.message,
        "client NACKed a version; it keeps its previous state and this version is not sent to it again"
    );
    NackRecord {
        version,
        code: error.code,
        message: error.message,
    }
}

/// Counts a client's ACK.
fn record_ack(collection: &Arc<str>) {
    metrics::counter!(m::REQUEST_ACKS, "component" => m::COMPONENT_DOWNSTREAM, "collection" => collection.clone())
        .increment(1);
}

/// Ends a stream's response with `status`, or gives up if the client does not
/// read it in time.
async fn end_with(out: &Outbound, status: Status) {
    let _ = tokio::time::timeout(STATUS_SEND_TIMEOUT, out.send(Err(status))).await;
}

fn shutting_down() -> Status {
    Status::unavailable("the gateway is shutting down; reconnect to another replica")
}

type Responses = mpsc::Receiver<Result<EncodedResponse, Status>>;

impl Downstream {
    /// Starts a `StreamAggregatedResources` stream's task.
    fn start_sotw(&self, inbound: Streaming<SotwRequest>, peer: Option<std::net::SocketAddr>) -> Responses {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let stream = sotw::SotwStream::new(self.clone(), self.next_id(), peer);
        self.inner.tasks.spawn(stream.run(inbound, tx));
        rx
    }

    /// Starts an `IncrementalAggregatedResources` stream's task.
    fn start_incremental(
        &self,
        inbound: Streaming<IncrementalRequest>,
        peer: Option<std::net::SocketAddr>,
    ) -> Responses {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let stream = incremental::IncrementalStream::new(self.clone(), self.next_id(), peer);
        self.inner.tasks.spawn(stream.run(inbound, tx));
        rx
    }
}
