//! Serving the cache to clients: every protocol on one engine. A stream's
//! task ([`stream`]) owns, per type, a pure state machine ([`type_state`])
//! that decides what to send; a protocol ([`wires`]) is only how its
//! requests read and its responses encode ([`encode`]). The tasks read the
//! cache and never write it.

pub mod by_type;
pub mod cluster_refs;
pub mod drains;
pub mod encode;
pub mod grants;
pub mod nack_memory;
pub mod names;
pub mod order;
mod outbound;
pub mod registry;
pub mod rollout;
pub mod service;
mod stream;
pub mod type_state;
pub mod wakes;
pub mod wires;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use dashmap::DashMap;

use crate::cache::demand::Subscriptions;
use crate::cache::Cache;
use crate::collections::{CollectionTable, Resolved};
use crate::metrics::{self as m, CollectionMetrics};
use crate::skew::SkewTracker;
use crate::transport::access::{self, AccessControl, AccessPolicy, Grant};
use crate::transport::bucket::PeerBuckets;
use crate::transport::identity::PeerIdentity;
use crate::transport::requests::{RequestBudget, RequestStream};
use crate::SharedStr;
use encode::EncodedResponse;
use registry::NackRecord;
pub use registry::Registry;
use service::Outbound;
pub use service::{AggregatedService, ResourceSourceService, XdsService};

/// Per-stream limits (and how responses are grouped) of the downstream
/// services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DownstreamLimits {
    pub max_requests_per_second: u32,
    pub max_request_bytes: usize,
    pub max_request_buffer_bytes: usize,
    pub request_read_timeout: Duration,
    /// How long a stream that ends waits for its client to take what it
    /// was sent and its status before it is reset (`--stream-end-timeout`).
    pub stream_end_timeout: Duration,
    pub max_nack_message_bytes: usize,
    pub max_types_per_stream: usize,
    /// Distinct name grants of one collection served at once
    /// (`--max-grants-per-version`).
    pub max_grants_per_version: usize,
    pub max_subscribed_names: usize,
    /// `--sotw-resend-unchanged`: every state-of-the-world response to a
    /// client naming route configurations or load assignments carries all
    /// it asks for (by default, after the first, only what changed and
    /// what it newly asks for: `collections::sotw_keeps_what_is_left_out`).
    pub sotw_resend_unchanged: bool,
    /// How long a client's NACK is remembered (`--nack-memory`; zero: not,
    /// and nothing is skipped on a reconnecting client's word).
    pub nack_memory: Duration,
    pub max_nack_memory_entries: usize,
    /// Of those, the entries one identity may hold
    /// (`--max-nack-memory-entries-per-identity`).
    pub max_nack_memory_entries_per_identity: usize,
    /// How long the removal of what a changed or removed listener sent to
    /// waits for Envoy's drain of it (`--listener-drain-time`; zero: not).
    pub listener_drain_time: Duration,
}

/// Envoy's own default `--drain-time-s`.
pub const DEFAULT_LISTENER_DRAIN_TIME: Duration = Duration::from_secs(600);

impl Default for DownstreamLimits {
    fn default() -> Self {
        Self {
            max_requests_per_second: 50,
            max_request_bytes: 4 << 20,
            max_request_buffer_bytes: 64 << 20,
            request_read_timeout: Duration::from_secs(10),
            stream_end_timeout: Duration::from_secs(5),
            max_nack_message_bytes: 4096,
            max_types_per_stream: 128,
            max_grants_per_version: grants::DEFAULT_MAX_GRANTS_PER_VERSION,
            max_subscribed_names: 100_000,
            sotw_resend_unchanged: false,
            nack_memory: Duration::from_secs(24 * 3600),
            max_nack_memory_entries: 100_000,
            max_nack_memory_entries_per_identity: 10_000,
            listener_drain_time: DEFAULT_LISTENER_DRAIN_TIME,
        }
    }
}

/// Responses queued per stream, where a queue carries them (a stream the
/// gateway dialed out). A stream has at most one response outstanding per
/// type, so a client that stops reading holds at most this many (and then
/// only its own task waits). A stream of the gateway's own listeners writes
/// one response beyond its client's window, then waits.
const OUTBOUND_QUEUE: usize = 16;

/// A response, or the status that ends the stream. Boxed: a queued
/// response is 16 bytes, not 56.
type Item = Result<Box<EncodedResponse>, Status>;

/// What every stream shares.
#[derive(Clone)]
pub struct Downstream {
    inner: Arc<Shared>,
}

struct Shared {
    cache: Arc<Cache>,
    /// What each group of clients is served of each collection.
    rollout: Arc<rollout::Rollout>,
    table: Arc<CollectionTable>,
    /// The table's sensitive collections, each by its name (MCP) and its
    /// body type URL (xDS asks by that): what a stream's
    /// [`SENSITIVE_HEADER`](crate::collections::SENSITIVE_HEADER) names of
    /// them, found once (the table is the gateway's for its life), not by a
    /// pass over every collection at each stream's start.
    sensitive: Box<[(SharedStr, Option<String>)]>,
    subscriptions: Arc<Subscriptions>,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    next_stream_id: AtomicU64,
    /// The broadcasts' relay is started ([`Downstream::relay_broadcasts`]).
    relaying: AtomicBool,
    /// Set by the broadcasts' relay when the gateway's shutdown begins,
    /// before it wakes every stream: what a stream's wait reads. The
    /// token's own `is_cancelled` locks its mutex, one for every stream,
    /// on each of their polls (3.9 a response in eds's update phase).
    /// Its own allocation: the relay holds it, not the whole of this.
    shutting_down: Arc<AtomicBool>,
    limits: DownstreamLimits,
    /// Large requests being read, across all streams.
    requests: Arc<RequestBudget>,
    /// One permit: work that grows with what a client sent (a large
    /// `initial_resource_versions`) runs one stream at a time.
    heavy: tokio::sync::Semaphore,
    /// Per collection (collections are the table's, so this is bounded).
    metrics: DashMap<SharedStr, Arc<CollectionMetrics>>,
    /// Client connect and leave lines: a burst of 20 per peer address, then
    /// one a second; the lines skipped meanwhile are counted in the next.
    peer_logs: PeerBuckets,
    peer_logs_skipped: AtomicU64,
    /// Who may read what (`--access-policy`).
    access: Arc<AccessControl>,
    /// Access denials logged: once per identity and collection per
    /// [`LOG_INTERVAL`].
    denial_logs: DashMap<(SharedStr, SharedStr), tokio::time::Instant>,
    /// What clients are told at shutdown: this gateway, or the `source`
    /// command's server, is going away.
    shutdown_message: &'static str,
    /// Each Istio client's generation, and the skew of what it reads.
    skew: Arc<SkewTracker>,
    /// What xDS clients NACKed (`--nack-memory`).
    nack_memory: Arc<nack_memory::NackMemory>,
    /// The distinct grants each collection is served to
    /// (`--max-grants-per-version`).
    grants: Arc<grants::Grants>,
}

// === impl Downstream ===

impl Downstream {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cache: Arc<Cache>,
        rollout: Arc<rollout::Rollout>,
        table: Arc<CollectionTable>,
        subscriptions: Arc<Subscriptions>,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
        tasks: TaskTracker,
        limits: DownstreamLimits,
        access: Arc<AccessControl>,
        skew: Arc<SkewTracker>,
    ) -> Self {
        let sensitive = table
            .sensitive_collections()
            .map(|collection| {
                (
                    collection.clone(),
                    table.sensitive_body_type(collection).map(str::to_owned),
                )
            })
            .collect();
        Self {
            inner: Arc::new(Shared {
                cache,
                rollout,
                table,
                sensitive,
                subscriptions,
                registry,
                shutdown,
                tasks,
                next_stream_id: AtomicU64::new(1),
                relaying: AtomicBool::new(false),
                shutting_down: Arc::new(AtomicBool::new(false)),
                limits,
                requests: RequestBudget::new(
                    limits.max_request_buffer_bytes,
                    limits.max_request_bytes,
                    limits.request_read_timeout,
                ),
                heavy: tokio::sync::Semaphore::new(1),
                metrics: DashMap::new(),
                peer_logs: PeerBuckets::new(1.0, 20.0, 10_000),
                peer_logs_skipped: AtomicU64::new(0),
                access,
                denial_logs: DashMap::new(),
                shutdown_message: "the gateway is shutting down; reconnect to another replica",
                skew,
                nack_memory: nack_memory::NackMemory::new(
                    limits.nack_memory,
                    limits.max_nack_memory_entries,
                    limits.max_nack_memory_entries_per_identity,
                ),
                grants: grants::Grants::new(limits.max_grants_per_version),
            }),
        }
    }

    /// For the `source` command: its clients are told the source is going
    /// away, not a gateway. Before any stream starts.
    pub fn as_source(mut self) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.inner) {
            shared.shutdown_message = "the source is shutting down; reconnect to another replica";
        }
        self
    }

    pub fn limits(&self) -> DownstreamLimits {
        self.inner.limits
    }

    /// What xDS clients NACKed: restored from and saved to `--cache-dir`.
    pub fn nack_memory(&self) -> &Arc<nack_memory::NackMemory> {
        &self.inner.nack_memory
    }

    /// The downstream metrics of a collection, made once.
    pub fn collection_metrics(&self, collection: &SharedStr) -> Arc<CollectionMetrics> {
        if let Some(metrics) = self.inner.metrics.get(collection) {
            return metrics.clone();
        }
        self.inner
            .metrics
            .entry(collection.clone())
            .or_insert_with(|| Arc::new(CollectionMetrics::new(collection)))
            .clone()
    }

    /// Whether a connect or leave line of `peer` may be logged: `Some(lines
    /// skipped since the last one)`.
    fn peer_log(&self, peer: Option<std::net::SocketAddr>) -> Option<u64> {
        let allowed = peer.is_none_or(|p| self.inner.peer_logs.take(p.ip()));
        if allowed {
            Some(self.inner.peer_logs_skipped.swap(0, Ordering::Relaxed))
        } else {
            self.inner.peer_logs_skipped.fetch_add(1, Ordering::Relaxed);
            None
        }
    }

    /// Waits for the turn to do work that grows with a client's request.
    async fn heavy_work(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.inner.heavy.acquire().await.expect("the semaphore is never closed")
    }

    /// A stream may follow at most `--max-types-per-stream` types.
    fn check_type_count(&self, following: usize) -> Result<(), Status> {
        let max = self.inner.limits.max_types_per_stream;
        if following >= max {
            m::limit_refused("max_types_per_stream");
            return Err(Status::resource_exhausted(format!(
                "this stream already follows {following} types: --max-types-per-stream={max}"
            )));
        }
        Ok(())
    }

    fn next_id(&self) -> u64 {
        self.inner.next_stream_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Resolves the type a client named in its `field`; an unknown one ends
    /// the stream with `unsupported {field} "…"`, as Istio's servers did
    /// (Galley's words for a collection: a sink, or a gateway chained behind
    /// this one, reads them to drop the collection and reconnect).
    fn resolve(&self, field: &str, name: &str) -> Result<Resolved, Status> {
        self.inner
            .table
            .resolve(name)
            .map_err(|_| Status::invalid_argument(format!("unsupported {field} {name:?}")))
    }

    /// What `identity` may read of `collection` under `policy`: `Err` ends
    /// the stream `PERMISSION_DENIED` naming the type, the identity and
    /// the policy (counted and logged); `None` is all of it.
    fn grant(
        &self,
        policy: &AccessPolicy,
        identity: &PeerIdentity,
        type_url: &str,
        collection: &SharedStr,
    ) -> Result<Option<Arc<access::NameGrant>>, Status> {
        match policy.grant(identity, collection, self.inner.table.is_sensitive(collection)) {
            Some(Grant::All) => Ok(None),
            Some(Grant::Names(names)) => Ok(Some(names)),
            None => {
                m::access_denied(collection, "collection", 1);
                let why = policy.denial(identity, collection, None);
                self.log_denial(identity, collection, &why.log);
                Err(Status::permission_denied(format!(
                    "type_url {type_url:?}: {}",
                    why.status
                )))
            }
        }
    }

    /// The sensitive collections `identity` may read, as the stream's
    /// [`SENSITIVE_HEADER`](crate::collections::SENSITIVE_HEADER) says them
    /// (`None`: none; without a policy nobody reads a sensitive collection).
    fn sensitive_readable(&self, identity: &PeerIdentity) -> Option<String> {
        if self.inner.sensitive.is_empty() {
            return None;
        }
        let policy = self.inner.access.current();
        let readable: Vec<&str> = self
            .inner
            .sensitive
            .iter()
            .filter(|(collection, _)| policy.grant(identity, collection, true).is_some())
            .flat_map(|(collection, body_type)| [Some(collection.as_str()), body_type.as_deref()])
            .flatten()
            .collect();
        (!readable.is_empty()).then(|| crate::collections::sensitive_header(readable))
    }

    /// Holds `grant` of `collection` for a stream: a new distinct grant
    /// past `--max-grants-per-version` ends a new stream's type
    /// `RESOURCE_EXHAUSTED` naming the flag (counted); `enforce: false` (a
    /// connected client's grant a reload changed) holds it anyway.
    fn hold_grant(
        &self,
        collection: &SharedStr,
        grant: &access::NameGrant,
        enforce: bool,
    ) -> Result<grants::GrantHold, Status> {
        let grants = &self.inner.grants;
        grants.hold(collection, &grant.key, enforce).map_err(|full| {
            m::limit_refused("max_grants_per_version");
            let max = grants.max();
            Status::resource_exhausted(format!(
                "{collection}: {} distinct grants of it are served to connected clients, the limit \
                 (--max-grants-per-version={max}); a client of one of them is served, a new one once one is no \
                 longer in use",
                full.held
            ))
        })
    }

    /// Logs an access denial, once per identity and collection per
    /// [`LOG_INTERVAL`].
    fn log_denial(&self, identity: &PeerIdentity, collection: &SharedStr, why: &str) {
        const MAX_REMEMBERED: usize = 10_000;
        let who: SharedStr = identity.to_string().into();
        let now = tokio::time::Instant::now();
        let logs = &self.inner.denial_logs;
        let key = (who, collection.clone());
        if logs
            .get(&key)
            .is_some_and(|last| now.duration_since(*last) < LOG_INTERVAL)
        {
            return;
        }
        if logs.len() >= MAX_REMEMBERED {
            logs.clear();
        }
        logs.insert(key, now);
        tracing::warn!(%collection, "access denied: {why}");
    }

    /// Starts, once, the task that relays the gateway's broadcasts to every
    /// stream: it wakes each stream's [`registry::RegistryEntry::control`]
    /// after the access policy changed and at shutdown (a stream registers
    /// there, then reads both, so no broadcast is lost). Ends at shutdown.
    ///
    /// The relay's view of the policy is taken before the relay is claimed:
    /// a stream that finds it claimed (and only then is polled) waits after
    /// it, so a policy that changes once that stream has read it is one the
    /// relay sees change.
    fn relay_broadcasts(&self) {
        if self.inner.relaying.load(Ordering::Acquire) {
            return;
        }
        let mut policy = self.watch_policy();
        if self.inner.relaying.swap(true, Ordering::AcqRel) {
            return;
        }
        let shutdown = self.inner.shutdown.clone();
        let registry = self.inner.registry.clone();
        let shutting_down = self.inner.shutting_down.clone();
        self.inner.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    changed = policy.changed() => match changed {
                        Ok(()) => registry.wake_all(),
                        // No policy can change any more.
                        Err(_) => {
                            shutdown.cancelled().await;
                            break;
                        }
                    },
                }
            }
            // Set before the wakes: a stream registers, then reads it.
            shutting_down.store(true, Ordering::Release);
            registry.wake_all();
        });
    }

    /// The gateway's shutdown has begun (as the broadcasts' relay says).
    fn shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::Acquire)
    }

    /// The policy in effect, as it changes.
    fn watch_policy(&self) -> tokio::sync::watch::Receiver<Arc<AccessPolicy>> {
        self.inner.access.subscribe()
    }

    /// Starts following a collection for a stream: subscribes upstream when a
    /// client is the first to ask for it.
    fn follow(&self, collection: &SharedStr) {
        if !self.inner.subscriptions.request(collection) {
            tracing::warn!(
                %collection,
                "a client asked for a collection the source refused; it gets no response until the source serves it"
            );
        }
    }
}

/// How often one stream may log each kind of repeated event.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Rate limit for one stream's repeated log lines: the first is logged, then
/// at most one per [`LOG_INTERVAL`], carrying how many were skipped. A client
/// that NACKs or sends stale nonces in a loop cannot flood the log.
#[derive(Debug, Default)]
struct LogLimit {
    last: Option<tokio::time::Instant>,
    skipped: u32,
}

impl LogLimit {
    /// `Some(skipped since the last line)` when this one may be logged.
    fn allow(&mut self) -> Option<u32> {
        let now = tokio::time::Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < LOG_INTERVAL => {
                self.skipped = self.skipped.saturating_add(1);
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.skipped))
            }
        }
    }
}

/// A stream's log limits, one per kind of repeated event.
#[derive(Debug, Default)]
struct StreamLogs {
    nacks: LogLimit,
    stale: LogLimit,
}

/// Counts a request with a stale or unknown nonce, and logs it (rate-limited).
fn record_stale(
    stream: u64,
    logs: &mut StreamLogs,
    metrics: &CollectionMetrics,
    type_url: &str,
    expected: &str,
    got: &str,
) {
    metrics.stale.increment(1);
    if let Some(skipped) = logs.stale.allow() {
        tracing::info!(
            stream,
            %type_url,
            expected,
            got,
            skipped,
            "stale request ignored (a nonce that is not the last one sent)"
        );
    }
}

/// Counts and logs a client's NACK (the log rate-limited per stream), with
/// who sent it: the stream, its node and its peer.
fn record_nack(
    stream: u64,
    who: impl FnOnce() -> (String, Option<std::net::SocketAddr>),
    logs: &mut StreamLogs,
    type_url: &str,
    collection: &SharedStr,
    nack: &NackRecord,
) {
    metrics::counter!(
        m::REQUEST_NACKS,
        "component" => m::COMPONENT_DOWNSTREAM,
        "collection" => crate::metrics::label(collection),
        "code" => m::code_number(nack.code)
    )
    .increment(1);
    if let Some(skipped) = logs.nacks.allow() {
        let (node, peer) = who();
        tracing::warn!(
            stream,
            node,
            peer = peer.map(|p| p.to_string()),
            %type_url,
            version = %nack.version,
            code = nack.code,
            // Quoted: a client's message with line breaks stays one log line.
            nack_message = ?nack.message,
            skipped,
            "client NACKed a version; it keeps its previous state and this version is not sent to it again"
        );
    }
}

/// Issues one load from each of many allocations together, before the
/// work that reads them one after another, and does nothing with what it
/// read (`values` names the loads; `black_box` keeps them). A named
/// response reads ~50 resources and names that lie all over the heap, each
/// a cache miss; read by that work, each miss waits for the one before,
/// all the more where the work takes a reference (a locked instruction,
/// which lets no later load start before it). These loads depend on
/// nothing but their allocation, so the processor has them in flight
/// together (BENCHMARKS, sessions 12 and 19).
pub(super) fn read_together(values: impl Iterator<Item = usize>) {
    std::hint::black_box(values.fold(0usize, |seen, value| seen ^ value));
}

/// Counts a client's ACK.
fn record_ack(metrics: &CollectionMetrics) {
    metrics.acks.increment(1);
}

/// A response could not be queued: the client's stream is gone.
fn send_failed() {
    metrics::counter!(m::SEND_FAILURES, "component" => m::COMPONENT_DOWNSTREAM, "code" => m::code_number(1))
        .increment(1);
}

type Responses = outbound::Receiver<Item>;

/// Why a downstream stream ended: the `reason` of
/// `mcp_gateway_downstream_stream_ends_total` and of the log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The client closed its side of the stream.
    ClientClosed,
    /// The client is gone: it cancelled, its connection closed (GOAWAY, a
    /// reset) or it stopped taking responses.
    ClientGone,
    /// The gateway is shutting down.
    Shutdown,
    /// A limit: the request rate, types per stream, a request's size or read time.
    Limit,
    /// A request the gateway cannot serve: an unknown type, a malformed field,
    /// a second type on a one-type stream, a request that does not decode.
    InvalidRequest,
    /// The gateway refuses to go on: the client NACKed a first response it
    /// cannot rebuild, or the peer is this gateway itself.
    Refused,
}

impl End {
    pub const ALL: [End; 6] = [
        End::ClientClosed,
        End::ClientGone,
        End::Shutdown,
        End::Limit,
        End::InvalidRequest,
        End::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            End::ClientClosed => "client_closed",
            End::ClientGone => "client_gone",
            End::Shutdown => "shutdown",
            End::Limit => "limit",
            End::InvalidRequest => "invalid_request",
            End::Refused => "refused",
        }
    }

    /// The reason a stream ending with `status` ends for.
    fn of(status: &Status) -> Self {
        match status.code() {
            tonic::Code::Cancelled => End::ClientGone,
            tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded => End::Limit,
            tonic::Code::FailedPrecondition => End::Refused,
            tonic::Code::Unavailable => End::Shutdown,
            _ => End::InvalidRequest,
        }
    }
}

/// The client went away: its response stream is closed.
struct ClientGone;

/// Registers the downstream series at 0, so dashboards and alerts see them
/// before the first event.
pub fn register_metrics(downstream: &Downstream, collections: &[SharedStr]) {
    for protocol in registry::Protocol::ALL {
        for end in End::ALL {
            metrics::counter!(m::DOWNSTREAM_STREAM_ENDS, "protocol" => protocol.as_str(), "reason" => end.as_str())
                .absolute(0);
        }
    }
    for collection in collections {
        downstream.collection_metrics(collection);
    }
}

impl Downstream {
    /// Starts a stream of protocol `W`: its task, which sends its responses
    /// to `out`.
    fn start<W: wires::Wire>(
        &self,
        body: crate::transport::requests::RequestBody,
        peer: Option<std::net::SocketAddr>,
        gate: Option<crate::transport::defer::ConnectionGate>,
        identity: Arc<PeerIdentity>,
        out: Outbound,
    ) {
        let inbound = RequestStream::new(body, self.inner.requests.clone(), W::REQUEST);
        let stream = stream::TypedStream::<W>::new(self.clone(), self.next_id(), peer, gate, identity);
        self.inner.tasks.spawn(stream.drive(inbound, out));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn repeated_logs_are_limited_and_count_what_they_skip() {
        let mut limit = LogLimit::default();
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), None);
        tokio::time::advance(LOG_INTERVAL / 2).await;
        assert_eq!(limit.allow(), None);
        tokio::time::advance(LOG_INTERVAL / 2).await;
        assert_eq!(limit.allow(), Some(2));
        assert_eq!(limit.allow(), None);
    }

    #[test]
    fn every_stream_end_has_a_reason_label() {
        let mut labels: Vec<&str> = End::ALL.iter().map(|e| e.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), End::ALL.len());
        assert_eq!(End::of(&Status::resource_exhausted("x")), End::Limit);
        assert_eq!(End::of(&Status::failed_precondition("x")), End::Refused);
        assert_eq!(End::of(&Status::cancelled("x")), End::ClientGone);
        assert_eq!(End::of(&Status::invalid_argument("x")), End::InvalidRequest);
    }
}
