//! The gRPC services on the client port, each a set of methods that start a
//! protocol's stream. Requests are read by the transport's `RequestStream`
//! (bounded buffers); responses are framed here, so a shared pre-encoded body
//! reaches hyper as the same `Bytes` for every client. A response waiting on a
//! slow client's HTTP/2 flow control holds a reference, not a copy of the
//! collection.

use std::convert::Infallible;
use std::io::IoSlice;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::Frame;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http::{self, header, HeaderMap, HeaderValue};
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;

use super::encode::{EncodedResponse, Record, Shared};
use super::outbound::{self, TrySendError};
use super::wires::{LegacyIncremental, LegacySotw, ResourceSourceWire, XdsDelta, XdsSotw};
use super::{ClientGone, Downstream, Item, Responses, OUTBOUND_QUEUE};
use crate::cache::provenance::CHAIN_HEADER;
use crate::metrics as m;
use crate::transport::call;
use crate::transport::defer::ConnectionGate;
use crate::transport::grpc::ConnInfo;
use crate::transport::identity::PeerIdentity;
use crate::transport::requests::RequestBody;
use crate::transport::respond::{ResponseSlot, ResponseWriter, MAX_WRITE};

pub const SOTW_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/StreamAggregatedResources";
pub const INCREMENTAL_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/IncrementalAggregatedResources";
pub use crate::proto::RESOURCE_SOURCE_PATH;
pub const XDS_SOTW_PATH: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const XDS_DELTA_PATH: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Starts one method's stream, its responses sent to the `Outbound`.
type Start = fn(&Downstream, RequestBody, Option<SocketAddr>, Option<ConnectionGate>, Arc<PeerIdentity>, Outbound);

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
        let conn_info = request.extensions().get::<ConnInfo>();
        let identity = conn_info.map(|info| info.identity.clone()).unwrap_or_default();
        let gate = conn_info.map(|info| info.gate.clone());
        let sensitive = self.downstream.sensitive_readable(&identity);
        let mut headers = HeaderMap::new();
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
        // On the gateway's own listeners the stream's task writes its
        // responses itself: one task per stream. Elsewhere (a stream the
        // gateway dialed out, tonic's server in tests) it queues them for a
        // body the transport writes.
        let unanswered = request.extensions().get::<ResponseSlot>().and_then(ResponseSlot::take);
        let (_, body) = RequestBody::of(request);
        if let Some(unanswered) = unanswered {
            // `None`: the client reset the stream before its headers went.
            if let Some(writer) = unanswered.answer(headers) {
                start(&self.downstream, body, peer, gate, identity, Outbound::direct(writer));
            }
            // Not written: the slot was taken.
            return std::future::ready(Ok(http::Response::new(Body::empty())));
        }
        let (tx, rx) = outbound::queue(OUTBOUND_QUEUE);
        start(&self.downstream, body, peer, gate, identity, Outbound(Out::Queue(tx)));
        let mut response = http::Response::new(Body::new(FramedResponses::new(rx)));
        *response.headers_mut() = headers;
        std::future::ready(Ok(response))
    }
}

// === impl Outbound ===

/// Where a stream's task sends its responses.
pub struct Outbound(Out);

enum Out {
    /// To a queue that a body returned to the transport is read from.
    Queue(outbound::Sender<Item>),
    /// Written to the client's HTTP/2 stream by the stream's task itself.
    Direct(Direct),
}

/// What [`Outbound::try_send`] did.
pub(super) enum TrySend {
    Sent,
    /// A response is still waiting for the client to read: the item back.
    Full(Item),
    /// The client is gone: its stream was reset or its connection closed.
    Gone,
}

impl Outbound {
    fn direct(writer: ResponseWriter) -> Self {
        Outbound(Out::Direct(Direct {
            writer,
            started: Instant::now(),
        }))
    }

    /// Sends `response` if nothing waits for the client to read. Written
    /// as it is on the gateway's own listeners; boxed only where it waits
    /// (in a queue, or for the client to read): a box a response, made
    /// and freed, was about 160 instructions of eds's ~23,000 (BENCHMARKS,
    /// session 43).
    pub(super) fn try_send(&mut self, response: EncodedResponse) -> TrySend {
        match &mut self.0 {
            Out::Queue(tx) => match tx.try_send(Ok(Box::new(response))) {
                Ok(()) => TrySend::Sent,
                Err(TrySendError::Full(item)) => TrySend::Full(item),
                Err(TrySendError::Closed(_)) => TrySend::Gone,
            },
            Out::Direct(direct) => {
                if !direct.writer.is_ready() {
                    return TrySend::Full(Ok(Box::new(response)));
                }
                match direct.write(Ok(response)) {
                    Ok(()) => TrySend::Sent,
                    Err(ClientGone) => TrySend::Gone,
                }
            }
        }
    }

    /// Sends `item`, waiting until the client has read what waits.
    pub(super) async fn send(&mut self, item: Item) -> Result<(), ClientGone> {
        match &mut self.0 {
            Out::Queue(tx) => tx.send(item).await.map_err(|_| ClientGone),
            Out::Direct(direct) => {
                std::future::poll_fn(|cx| direct.writer.poll_ready(cx))
                    .await
                    .map_err(|_| ClientGone)?;
                direct.write(item.map(|response| *response))
            }
        }
    }

    /// Ends the stream's responses with `status` (none: OK) after what was
    /// sent, waiting at most `wait` for the client to read. A queue takes the
    /// status once it has room. A stream of the gateway's own listeners waits
    /// until what it wrote has been given window, then sends its trailers,
    /// or resets the stream if the client does not read in time: what h2
    /// holds of the stream goes when its place under `--max-streams` does.
    /// True when the client took nothing for `wait`, so the stream was cut
    /// short without its status (its caller counts and logs it).
    pub(super) async fn close(mut self, status: Option<Status>, wait: Duration) -> bool {
        match &mut self.0 {
            Out::Queue(tx) => {
                if let Some(status) = status {
                    if tokio::time::timeout(wait, tx.send(Err(status))).await.is_err() {
                        // The body ends after what the queue holds, without
                        // the status.
                        return true;
                    }
                }
            }
            Out::Direct(direct) if direct.writer.is_finished() => {}
            Out::Direct(direct) => {
                let drained = tokio::time::timeout(wait, std::future::poll_fn(|cx| direct.writer.poll_ready(cx))).await;
                match drained {
                    Ok(Ok(())) => direct
                        .writer
                        .finish(trailers(&status.unwrap_or_else(|| Status::ok("")))),
                    // Gone: nothing to end.
                    Ok(Err(_)) => {}
                    Err(_) => {
                        direct.writer.reset(false);
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Whether the client is gone, now. For a stream about to end: the
    /// client's leaving no longer wakes its task after this (the wait is
    /// polled with a waker that does nothing).
    pub(super) fn is_gone(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        std::future::Future::poll(std::pin::pin!(self.closed()), &mut cx).is_ready()
    }

    /// Whether the client's leaving is to be watched for apart from its
    /// requests ([`Self::closed`]). A queue's reader (a body the transport
    /// reads) can go while the requests still read. A stream written
    /// directly cannot: a reset, or its connection's close, reaches its
    /// requests as an error as well (h2 fails a stream's reads and writes
    /// together), and a client that ends its requests ends the stream. Not
    /// watching it saves each of the stream's polls a lock of the
    /// connection's streams and a waker stored (about 350 instructions a
    /// response of eds; BENCHMARKS, session 38).
    pub(super) fn watches_gone(&self) -> bool {
        matches!(self.0, Out::Queue(_))
    }

    /// Completes when the client is gone. A poll function over the borrow,
    /// not an async fn: every idle stream's task holds it.
    pub(super) fn closed(&mut self) -> impl std::future::Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| match &mut self.0 {
            Out::Queue(tx) => tx.poll_closed(cx),
            Out::Direct(direct) => direct.writer.poll_gone(cx),
        })
    }
}

/// A stream's responses written by its own task.
struct Direct {
    writer: ResponseWriter,
    /// When the stream began (push latency counts only later changes).
    started: Instant,
}

impl Direct {
    /// Writes `item`: a response as one write of its frame header, shared
    /// parts and suffix. A status, or a response too large to frame or to
    /// write, is sent as the trailers that end the stream (`Err`: the stream
    /// ends, as a queue's body ends it).
    fn write(&mut self, item: Result<EncodedResponse, Status>) -> Result<(), ClientGone> {
        let status = match item.and_then(|response| framed(response, self.started)) {
            Ok((len, parts)) if FRAME_HEADER + len as usize <= MAX_WRITE => {
                let written = match parts.into_one() {
                    Ok(one) => self.writer.write_message(frame_header(len), one),
                    Err(parts) => self.writer.write(FramedBuf::new(len, parts)),
                };
                return written.map_err(|_| ClientGone);
            }
            Ok((len, _)) => Status::resource_exhausted(format!(
                "a response of {len} bytes is larger than one HTTP/2 write takes ({MAX_WRITE} bytes)"
            )),
            Err(status) => status,
        };
        self.writer.finish(trailers(&status));
        Err(ClientGone)
    }
}

/// A stream whose task ends without closing its responses (it panicked, or
/// its runtime stopped) ends with OK, as a queue's body does when its
/// sender goes, or with a reset if its task panicked.
impl Drop for Direct {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.writer.reset(true);
        } else if !self.writer.is_finished() {
            self.writer.finish(trailers(&Status::ok("")));
        }
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

/// Where a response's next part is: among its shared parts, then its
/// suffix, then none.
#[derive(Clone, Copy)]
enum At {
    Shared((usize, usize)),
    End,
}

/// A response's parts, in order: its shared parts, then its suffix.
struct Writing {
    shared: Shared,
    suffix: Bytes,
    /// The next part.
    at: At,
}

impl Writing {
    fn new(shared: Shared, suffix: Bytes) -> Self {
        Self {
            shared,
            suffix,
            at: At::Shared((0, 0)),
        }
    }

    /// The message as one buffer, if it is one ([`Shared::One`], no suffix
    /// apart); else itself.
    fn into_one(self) -> Result<Bytes, Self> {
        match self.shared {
            Shared::One(one) if self.suffix.is_empty() && matches!(self.at, At::Shared((0, 0))) => Ok(one),
            shared => Err(Self { shared, ..self }),
        }
    }

    /// The part at `at` (possibly empty) and where the one after it is;
    /// `None` past the suffix.
    fn part(&self, at: At) -> Option<(&Bytes, At)> {
        match at {
            At::Shared(i) => Some(match self.shared.part(i) {
                Some((part, next)) => (part, At::Shared(next)),
                None => (&self.suffix, At::End),
            }),
            At::End => None,
        }
    }

    /// The next non-empty part of the message, if any is left.
    fn next_part(&mut self) -> Option<Bytes> {
        while let Some((part, next)) = self.part(self.at) {
            let part = (!part.is_empty()).then(|| part.clone());
            self.at = next;
            if part.is_some() {
                return part;
            }
        }
        None
    }
}

/// A response's gRPC message as h2 writes it from the stream's own task
/// ([`Direct`]): its 5-byte header, then its parts read where they lie, with
/// no list of them made per write and no reference counted per part.
struct FramedBuf {
    header: [u8; 5],
    /// How much of the header was written.
    head: usize,
    parts: Writing,
    /// How much of the part at `parts.at` was written.
    offset: usize,
    remaining: usize,
}

impl FramedBuf {
    fn new(len: u32, parts: Writing) -> Self {
        let mut buf = Self {
            header: frame_header(len),
            head: 0,
            parts,
            offset: 0,
            remaining: FRAME_HEADER + len as usize,
        };
        buf.skip_written();
        buf
    }

    /// Moves past the parts that are empty or written whole, so that the
    /// part at `parts.at` has bytes left (or there is none).
    fn skip_written(&mut self) {
        while let Some((part, next)) = self.parts.part(self.parts.at) {
            if self.offset < part.len() {
                return;
            }
            (self.parts.at, self.offset) = (next, 0);
        }
    }
}

impl Buf for FramedBuf {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        if self.head < FRAME_HEADER {
            return &self.header[self.head..];
        }
        self.parts
            .part(self.parts.at)
            .map_or(&[], |(part, _)| &part[self.offset..])
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        if self.head < FRAME_HEADER && !dst.is_empty() {
            dst[0] = IoSlice::new(&self.header[self.head..]);
            n = 1;
        }
        let (mut at, mut offset) = (self.parts.at, self.offset);
        while n < dst.len() {
            let Some((part, next)) = self.parts.part(at) else {
                break;
            };
            if offset < part.len() {
                dst[n] = IoSlice::new(&part[offset..]);
                n += 1;
            }
            (at, offset) = (next, 0);
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advanced past the end of a response");
        self.remaining -= cnt;
        let head = cnt.min(FRAME_HEADER - self.head);
        self.head += head;
        cnt -= head;
        while cnt > 0 {
            let Some((part, next)) = self.parts.part(self.parts.at) else {
                break;
            };
            let left = part.len() - self.offset;
            if cnt < left {
                self.offset += cnt;
                return;
            }
            cnt -= left;
            (self.parts.at, self.offset) = (next, 0);
        }
        self.skip_written();
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

/// A gRPC message's frame header: not compressed, then its length.
const FRAME_HEADER: usize = 5;

fn frame_header(len: u32) -> [u8; FRAME_HEADER] {
    let mut header = [0; FRAME_HEADER];
    header[1..].copy_from_slice(&len.to_be_bytes());
    header
}

/// A response as gRPC frames it: its length (for its frame header), then
/// its parts, with its metrics recorded as it is handed to the client's
/// connection; a response too large to frame is the status that ends the
/// stream.
fn framed(response: EncodedResponse, stream_started: Instant) -> Result<(u32, Writing), Status> {
    let len = response.len();
    if let Some(record) = &response.record {
        record_write(record, stream_started, len);
    }
    let Ok(len) = u32::try_from(len) else {
        return Err(Status::resource_exhausted(format!(
            "a response of {len} bytes is larger than gRPC can frame (4 GiB)"
        )));
    };
    Ok((len, Writing::new(response.shared, response.suffix)))
}

/// The metrics of a response handed to the client's connection.
fn record_write(record: &Record, stream_started: Instant, len: usize) {
    let Record { snapshot, metrics } = record;
    metrics.response_size.record(len as u64);
    // A change applied before the stream began is not a push: a new
    // client's first response measures nothing.
    if snapshot.applied_at >= stream_started {
        let nanos = snapshot.applied_at.elapsed().as_nanos();
        metrics.push_latency.record(u64::try_from(nanos).unwrap_or(u64::MAX));
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
            Some(item) => match item.and_then(|response| framed(*response, this.started)) {
                Ok((len, writing)) => {
                    this.writing = Some(writing);
                    let header = Bytes::copy_from_slice(&frame_header(len));
                    return Poll::Ready(Some(Ok(Frame::data(header))));
                }
                Err(status) => status,
            },
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

    /// A response's bytes as h2 reads them from a [`FramedBuf`], whatever
    /// its parts (empty ones, runs of them) and however it is read: in
    /// chunks, in slices of any number, advanced by any count.
    #[test]
    fn a_framed_buf_reads_as_its_header_and_parts_in_order() {
        use proptest::prelude::*;
        let part = proptest::collection::vec(any::<u8>(), 0..40);
        let runs = proptest::collection::vec(proptest::collection::vec(part.clone(), 0..5), 0..5);
        let steps = proptest::collection::vec((1usize..64, 0usize..6), 1..40);
        proptest!(|(runs in runs, flat in any::<bool>(), suffix in part, steps in steps)| {
            let bytes = |p: &Vec<u8>| Bytes::copy_from_slice(p);
            let shared = if flat {
                Shared::Flat(runs.iter().flatten().map(bytes).collect())
            } else {
                Shared::Runs(runs.iter().map(|run| run.iter().map(bytes).collect()).collect())
            };
            let mut expected: Vec<u8> = runs.iter().flatten().flatten().copied().collect();
            expected.extend_from_slice(&suffix);
            let len = u32::try_from(expected.len()).unwrap();
            let mut whole = frame_header(len).to_vec();
            whole.extend_from_slice(&expected);

            let mut buf = FramedBuf::new(len, Writing::new(shared, Bytes::from(suffix)));
            let mut read = Vec::new();
            for (count, slices) in steps.iter().cycle().take(10_000) {
                if !buf.has_remaining() {
                    break;
                }
                prop_assert_eq!(buf.remaining(), whole.len() - read.len());
                prop_assert!(!buf.chunk().is_empty(), "a chunk while bytes remain");
                // What the slices show is what comes next.
                let mut dst = vec![IoSlice::new(&[]); *slices];
                let n = buf.chunks_vectored(&mut dst);
                let shown: Vec<u8> = dst[..n].iter().flat_map(|s| s.iter().copied()).collect();
                prop_assert!(n == *slices || shown.len() == buf.remaining());
                prop_assert_eq!(&shown[..], &whole[read.len()..read.len() + shown.len()]);
                let take = (*count).min(buf.remaining());
                let mut taken = 0;
                while taken < take {
                    let chunk = buf.chunk();
                    let n = chunk.len().min(take - taken);
                    read.extend_from_slice(&chunk[..n]);
                    buf.advance(n);
                    taken += n;
                }
            }
            prop_assert_eq!(read, whole);
            prop_assert_eq!(buf.remaining(), 0);
            prop_assert!(buf.chunk().is_empty());
        });
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
