//! The aggregated services legacy clients use: `StreamAggregatedResources`
//! (state of the world, many types per stream) and
//! `IncrementalAggregatedResources` (diffs, one type per stream). One task per
//! stream owns its nonce state; it reads the cache and never writes it.

mod incremental;
pub mod registry;
pub mod service;
mod sotw;

use incremental::IncrementalStream;
use sotw::SotwStream;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use crate::cache::Cache;
use crate::collections::{CollectionTable, Resolved};
use crate::config::DownstreamLimits;
use crate::metrics::{self as m, CollectionMetrics};
use crate::transport::bucket::TokenBucket;
use crate::transport::requests::{RequestBudget, RequestStream};
use crate::upstream::Subscriptions;
use crate::wire::{EncodedResponse, ErrorDetail};
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

/// Boxed: every stream's queue allocates 32 slots up front, and a boxed
/// response keeps a slot at 16 bytes instead of 56 (1.3 KiB per idle stream).
type Outbound = mpsc::Sender<Result<Box<EncodedResponse>, Status>>;

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
    limits: DownstreamLimits,
    /// Large requests being read, across all streams.
    requests: Arc<RequestBudget>,
    /// One permit: work that grows with what a client sent (a large
    /// `initial_resource_versions`) runs one stream at a time.
    heavy: tokio::sync::Semaphore,
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
        limits: DownstreamLimits,
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
                limits,
                requests: RequestBudget::new(
                    limits.max_request_buffer_bytes,
                    limits.max_request_bytes,
                    limits.request_read_timeout,
                ),
                heavy: tokio::sync::Semaphore::new(1),
            }),
        }
    }

    pub fn limits(&self) -> DownstreamLimits {
        self.inner.limits
    }

    /// A stream's requests, read against the shared budget.
    pub fn requests<T: prost::Message + Default>(
        &self,
        body: tonic::body::Body,
        message: &'static str,
    ) -> RequestStream<T> {
        RequestStream::new(body, self.inner.requests.clone(), message)
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

/// How often one stream may log each kind of repeated event.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Rate limit for one stream's repeated log lines: the first is logged, then
/// at most one per [`LOG_INTERVAL`], carrying how many were skipped. A client
/// that NACKs or sends stale nonces in a loop cannot flood the log.
#[derive(Debug, Default)]
struct LogLimit {
    last: Option<std::time::Instant>,
    skipped: u32,
}

impl LogLimit {
    /// `Some(skipped since the last line)` when this one may be logged.
    fn allow(&mut self) -> Option<u32> {
        let now = std::time::Instant::now();
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

/// Counts and logs a client's NACK of `version` (the log rate-limited per
/// stream), and returns the record the stream keeps (the version is never
/// sent to that client again). Only the start of a long message is read and
/// kept (`--max-nack-message-bytes`), with its full length.
#[allow(clippy::too_many_arguments)]
fn record_nack(
    stream: u64,
    logs: &mut StreamLogs,
    type_url: &str,
    collection: &Arc<str>,
    version: Arc<str>,
    error: bytes::Bytes,
    metrics: &CollectionMetrics,
    max_message_bytes: usize,
) -> NackRecord {
    let detail = ErrorDetail::parse(error, max_message_bytes).unwrap_or_else(|e| ErrorDetail {
        code: tonic::Code::Unknown as i32,
        message: format!("(the NACK's error_detail does not decode: {e})"),
        message_len: 0,
    });
    let message = if detail.message_len > detail.message.len() {
        metrics::counter!(m::NACK_MESSAGES_TRUNCATED).increment(1);
        format!("{}… ({} bytes in all)", detail.message, detail.message_len)
    } else {
        detail.message
    };
    metrics.nacks.increment(1);
    metrics::counter!(
        m::REQUEST_NACKS,
        "component" => m::COMPONENT_DOWNSTREAM,
        "collection" => collection.clone(),
        "code" => m::code_label(detail.code)
    )
    .increment(1);
    if let Some(skipped) = logs.nacks.allow() {
        tracing::warn!(
            stream,
            %type_url,
            %version,
            code = detail.code,
            %message,
            skipped,
            "client NACKed a version; it keeps its previous state and this version is not sent to it again"
        );
    }
    NackRecord {
        version,
        code: detail.code,
        message,
    }
}

/// Counts a client's ACK.
fn record_ack(metrics: &CollectionMetrics) {
    metrics.acks.increment(1);
}

/// A response could not be queued: the client's stream is gone.
fn send_failed() {
    metrics::counter!(m::SEND_FAILURES, "component" => m::COMPONENT_DOWNSTREAM, "code" => "Cancelled").increment(1);
}

/// Ends a stream's response with `status`, or gives up if the client does not
/// read it in time.
async fn end_with(out: &Outbound, status: Status) {
    let _ = tokio::time::timeout(STATUS_SEND_TIMEOUT, out.send(Err(status))).await;
}

fn shutting_down() -> Status {
    Status::unavailable("the gateway is shutting down; reconnect to another replica")
}

type Responses = mpsc::Receiver<Result<Box<EncodedResponse>, Status>>;

/// The client went away: its response stream is closed.
struct ClientGone;

/// What differs between the two kinds of stream; [`drive`] runs the loop they
/// share.
trait StreamProtocol: Sized + Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    /// What a change notification names (a type, or nothing on a one-type stream).
    type Change: Send;

    fn new(shared: Downstream, id: u64, peer: Option<std::net::SocketAddr>) -> Self;

    fn id(&self) -> u64;

    // The futures are declared `Send` so a stream's task can be spawned.

    /// Handles one request. `Err` ends the stream with that status.
    fn on_request(
        &mut self,
        request: Self::Request,
        out: &Outbound,
    ) -> impl Future<Output = Result<Result<(), ClientGone>, Status>> + Send;

    /// The next change to a followed collection; pending while there is none.
    /// Must be cancel-safe.
    fn next_change(&mut self) -> impl Future<Output = Self::Change> + Send;

    /// Sends what a change makes due.
    fn on_change(
        &mut self,
        change: Self::Change,
        out: &Outbound,
    ) -> impl Future<Output = Result<(), ClientGone>> + Send;
}

/// One stream's task: requests, cache changes and shutdown, until one of them
/// ends the stream. Its state is removed when the stream value is dropped.
async fn drive<P: StreamProtocol>(
    mut stream: P,
    mut inbound: RequestStream<P::Request>,
    out: Outbound,
    shutdown: CancellationToken,
    limits: DownstreamLimits,
) {
    // Real clients send a request per type and an ACK per response; a loop
    // of requests (stale nonces, re-subscriptions) is cut off.
    let mut requests = TokenBucket::new(
        f64::from(limits.max_requests_per_second),
        f64::from(limits.max_requests_per_second) * 10.0,
    );
    let end = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Some(shutting_down()),
            _ = out.closed() => break None,
            request = inbound.message() => match request {
                Ok(Some(_)) if !requests.take() => {
                    m::limit_refused("requests_rate");
                    break Some(Status::resource_exhausted(format!(
                        "too many requests on this stream: --max-requests-per-second={}",
                        limits.max_requests_per_second
                    )));
                }
                Ok(Some(request)) => match stream.on_request(request, &out).await {
                    Ok(Ok(())) => {}
                    Ok(Err(ClientGone)) => {
                        send_failed();
                        break None;
                    }
                    Err(status) => break Some(status),
                },
                Ok(None) => break None,
                // A request that does not decode ends the stream with its
                // status; after a client's cancel nobody reads it.
                Err(status) => {
                    tracing::debug!(stream = stream.id(), %status, "client stream ended");
                    metrics::counter!(
                        m::RECV_FAILURES,
                        "component" => m::COMPONENT_DOWNSTREAM,
                        "code" => m::code_label(status.code() as i32)
                    )
                    .increment(1);
                    break Some(status);
                }
            },
            change = stream.next_change() => {
                if stream.on_change(change, &out).await.is_err() {
                    send_failed();
                    break None;
                }
            }
        }
    };
    if let Some(status) = end {
        tracing::debug!(stream = stream.id(), %status, "ending stream");
        end_with(&out, status).await;
    }
}

impl Downstream {
    /// Starts a stream's task and returns its responses.
    fn start<P: StreamProtocol>(
        &self,
        inbound: RequestStream<P::Request>,
        peer: Option<std::net::SocketAddr>,
    ) -> Responses {
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let stream = P::new(self.clone(), self.next_id(), peer);
        self.inner.tasks.spawn(drive(
            stream,
            inbound,
            tx,
            self.inner.shutdown.clone(),
            self.inner.limits,
        ));
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_logs_are_limited_and_count_what_they_skip() {
        let mut limit = LogLimit::default();
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), None);
        assert_eq!(limit.allow(), None);
        // As if the interval had passed.
        limit.last = Some(std::time::Instant::now() - LOG_INTERVAL);
        assert_eq!(limit.allow(), Some(2));
        assert_eq!(limit.allow(), None);
    }
}
