//! The gRPC services on the client port, each a set of methods that start a
//! protocol's stream. Requests are read by the transport's `RequestStream`
//! (bounded buffers); responses are framed here, so a shared pre-encoded body
//! reaches hyper as the same `Bytes` for every client. A response waiting on a
//! slow client's HTTP/2 flow control holds a reference, not a copy of the
//! collection.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http::{self, header, HeaderMap, HeaderValue};
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;

use super::encode::{Record, Shared};
use super::wires::{LegacyIncremental, LegacySotw, ResourceSourceWire, XdsDelta, XdsSotw};
use super::{Downstream, Responses};
use crate::cache::provenance::CHAIN_HEADER;
use crate::metrics as m;
use crate::transport::call;
use crate::transport::grpc::ConnInfo;
use crate::transport::identity::PeerIdentity;

pub const SOTW_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/StreamAggregatedResources";
pub const INCREMENTAL_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/IncrementalAggregatedResources";
pub use crate::proto::RESOURCE_SOURCE_PATH;
pub const XDS_SOTW_PATH: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const XDS_DELTA_PATH: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Starts one method's stream.
type Start = fn(&Downstream, Body, Option<SocketAddr>, Arc<PeerIdentity>) -> Responses;

/// One gRPC service: its name and its methods.
pub trait Methods: Send + Sync + 'static {
    const NAME: &'static str;
    const METHODS: &'static [(&'static str, Start)];
    /// The service announces the gateway chain in its response headers.
    const ANNOUNCES_CHAIN: bool;
}

/// `AggregatedMeshConfigService` (Istio 1.0/1.1): state of the world and
/// incremental.
pub enum Aggregated {}

impl Methods for Aggregated {
    const NAME: &'static str = "istio.mcp.v1alpha1.AggregatedMeshConfigService";
    const METHODS: &'static [(&'static str, Start)] = &[
        (SOTW_PATH, Downstream::start::<LegacySotw>),
        (INCREMENTAL_PATH, Downstream::start::<LegacyIncremental>),
    ];
    const ANNOUNCES_CHAIN: bool = false;
}

/// `ResourceSource` (Pilot 1.2 to 1.7 as sinks, and chained gateways).
pub enum Source {}

impl Methods for Source {
    const NAME: &'static str = "istio.mcp.v1alpha1.ResourceSource";
    const METHODS: &'static [(&'static str, Start)] =
        &[(RESOURCE_SOURCE_PATH, Downstream::start::<ResourceSourceWire>)];
    const ANNOUNCES_CHAIN: bool = true;
}

/// Envoy's v3 `AggregatedDiscoveryService` (istiod 1.8+ reading MCP over
/// xDS, and Envoy): state of the world and delta.
pub enum Xds {}

impl Methods for Xds {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
    const METHODS: &'static [(&'static str, Start)] = &[
        (XDS_SOTW_PATH, Downstream::start::<XdsSotw>),
        (XDS_DELTA_PATH, Downstream::start::<XdsDelta>),
    ];
    const ANNOUNCES_CHAIN: bool = false;
}

/// A gRPC service of the client port.
pub struct MeshService<M> {
    downstream: Downstream,
    _methods: PhantomData<fn() -> M>,
}

pub type AggregatedService = MeshService<Aggregated>;
pub type ResourceSourceService = MeshService<Source>;
pub type XdsService = MeshService<Xds>;

impl<M> Clone for MeshService<M> {
    fn clone(&self) -> Self {
        Self {
            downstream: self.downstream.clone(),
            _methods: PhantomData,
        }
    }
}

impl<M: Methods> MeshService<M> {
    pub fn new(downstream: Downstream) -> Self {
        Self {
            downstream,
            _methods: PhantomData,
        }
    }
}

impl<M: Methods> NamedService for MeshService<M> {
    const NAME: &'static str = M::NAME;
}

impl<M: Methods> tonic::codegen::Service<http::Request<Body>> for MeshService<M> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if let Some(status) = call::compressed(&request) {
            return std::future::ready(Ok(status.into_http()));
        }
        let Some((_, start)) = M::METHODS.iter().find(|(path, _)| *path == request.uri().path()) else {
            return std::future::ready(Ok(call::not_a_method(&request, M::NAME).into_http()));
        };
        let peer = request
            .extensions()
            .get::<TcpConnectInfo>()
            .and_then(TcpConnectInfo::remote_addr);
        // What TLS proved of the peer; without the listener's word (the
        // `source` command's dial-out serves a stream it dialed), none:
        // `unauthenticated`.
        let identity = request
            .extensions()
            .get::<ConnInfo>()
            .map(|info| info.identity.clone())
            .unwrap_or_default();
        let sensitive = self.downstream.sensitive_readable(&identity);
        let responses = start(&self.downstream, request.into_body(), peer, identity);
        let mut response = http::Response::new(Body::new(FramedResponses::new(responses)));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        // Percent-encoded: always a valid value.
        if let Some(value) = sensitive.and_then(|v| HeaderValue::try_from(v).ok()) {
            headers.insert(crate::collections::SENSITIVE_HEADER, value);
        }
        if M::ANNOUNCES_CHAIN {
            // Gateway ids are ASCII; an invalid value is only left out.
            if let Ok(chain) = HeaderValue::try_from(self.downstream.inner.cache.provenance().announced()) {
                headers.insert(CHAIN_HEADER, chain);
            }
        }
        std::future::ready(Ok(response))
    }
}

// === impl FramedResponses ===

/// A gRPC response body: each message as its 5-byte frame header, then its
/// shared parts and per-client suffix as they are; trailers with the status.
pub struct FramedResponses {
    responses: Responses,
    /// The message being written.
    writing: Option<Writing>,
    done: bool,
    /// When the stream began (push latency counts only later changes).
    started: Instant,
}

struct Writing {
    shared: Shared,
    /// Where the next part is in `shared`.
    next: (usize, usize),
    suffix: Option<Bytes>,
}

impl Writing {
    /// The next non-empty part of the message, if any is left.
    fn next_part(&mut self) -> Option<Bytes> {
        while let Some((part, next)) = self.shared.part(self.next) {
            self.next = next;
            if !part.is_empty() {
                return Some(part.clone());
            }
        }
        self.suffix.take().filter(|s| !s.is_empty())
    }
}

impl FramedResponses {
    fn new(responses: Responses) -> Self {
        Self {
            responses,
            writing: None,
            done: false,
            started: Instant::now(),
        }
    }
}

/// The metrics of a response handed to the client's connection.
fn record_write(record: &Record, stream_started: Instant, len: usize) {
    let Record { snapshot, metrics } = record;
    metrics.response_size.record(len as f64);
    // A change applied before the stream began is not a push: a new
    // client's first response measures nothing.
    if snapshot.applied_at >= stream_started {
        metrics.push_latency.record(snapshot.applied_at.elapsed().as_secs_f64());
    }
    if len > m::LEGACY_CLIENT_LIMIT {
        metrics.oversized.increment(1);
        // Once per version: every client of a big collection gets one.
        if !snapshot
            .oversized_logged
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                collection = %snapshot.collection,
                bytes = len,
                "a response is larger than 4 MiB, the default receive limit of legacy clients and of istiod 1.8 \
                 to 1.11; a client that did not raise it will reject it (see oversized_bytes in /debug/clients)"
            );
        }
    }
}

fn trailers(status: &Status) -> HeaderMap {
    let mut map = HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message that cannot be a header value gets here.
        map.insert("grpc-status", HeaderValue::from(status.code() as i32));
    }
    map
}

impl http_body::Body for FramedResponses {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if let Some(part) = this.writing.as_mut().and_then(Writing::next_part) {
            return Poll::Ready(Some(Ok(Frame::data(part))));
        }
        this.writing = None;
        if this.done {
            return Poll::Ready(None);
        }
        let status = match ready!(this.responses.poll_recv(cx)) {
            Some(Ok(response)) => {
                let len = response.len();
                if let Some(record) = &response.record {
                    record_write(record, this.started, len);
                }
                match u32::try_from(len) {
                    Ok(len) => {
                        let mut header = BytesMut::with_capacity(5);
                        header.put_u8(0); // not compressed
                        header.put_u32(len);
                        this.writing = Some(Writing {
                            shared: response.shared,
                            next: (0, 0),
                            suffix: Some(response.suffix),
                        });
                        return Poll::Ready(Some(Ok(Frame::data(header.freeze()))));
                    }
                    Err(_) => Status::resource_exhausted(format!(
                        "a response of {len} bytes is larger than gRPC can frame (4 GiB)"
                    )),
                }
            }
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        this.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.writing.is_none()
    }
}

#[cfg(test)]
mod tests {
    use crate::SharedStr;
    use std::io::Write;
    use std::sync::Mutex;

    use super::*;
    use crate::cache::CollectionSnapshot;
    use crate::metrics::CollectionMetrics;

    /// Log lines written into a shared buffer.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn an_oversized_version_is_logged_once_however_many_clients_get_it() {
        let collection: SharedStr = "c".into();
        let metrics = Arc::new(CollectionMetrics::new(&collection));
        let version = |snapshot| Record {
            snapshot,
            metrics: metrics.clone(),
        };
        let (v1, v2) = (
            version(CollectionSnapshot::empty(collection.clone())),
            version(CollectionSnapshot::empty(collection.clone())),
        );
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).finish();
        tracing::subscriber::with_default(subscriber, || {
            let started = Instant::now();
            // Three clients get v1 above the limit, one below it; one gets v2.
            for len in [
                m::LEGACY_CLIENT_LIMIT + 1,
                m::LEGACY_CLIENT_LIMIT + 1,
                100,
                m::LEGACY_CLIENT_LIMIT + 2,
            ] {
                record_write(&v1, started, len);
            }
            record_write(&v2, started, m::LEGACY_CLIENT_LIMIT + 1);
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("larger than 4 MiB").count(), 2, "once per version: {text}");
    }
}
