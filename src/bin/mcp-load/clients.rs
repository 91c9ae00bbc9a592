//! The load's clients: real gRPC streams over a set of HTTP/2 connections,
//! state of the world or incremental, legacy MCP or Envoy's v3 ADS (asking
//! for GVKs, as istiod does), ACKing like real clients and recording when
//! each version arrived and how many bytes it took.
//!
//! They decode each response's envelope (version, type, nonce) and skip the
//! resources' bytes where they lie (`reader.rs`), so the tool measures the
//! gateway rather than itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use mcp_xds_gateway::collections::CollectionTable;
use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use mcp_xds_gateway::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, SinkNode};
use mcp_xds_gateway::transport::call;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

pub use mcp_xds_gateway::downstream::service::{INCREMENTAL_PATH, SOTW_PATH, XDS_DELTA_PATH, XDS_SOTW_PATH};

use crate::reader::{Fields, Responses, MCP, XDS};
use crate::scenario::ClientProtocol;

/// What a client acts on in a response: its version, type and nonce (and,
/// for a named client, its resources and removed names: see `reader.rs`).
#[derive(Clone, Debug, Default)]
pub struct Envelope {
    pub version: String,
    /// Empty where the response names none (legacy incremental).
    pub type_url: String,
    pub nonce: String,
    /// Each resource's encoded bytes, where the reader collects them.
    pub resources: Vec<Bytes>,
    /// Each removed name's bytes, where the reader collects them.
    pub removed: Vec<Bytes>,
}

/// One received response.
#[derive(Clone, Debug)]
pub struct Received {
    /// The stream's index (its connection is this modulo the connections).
    pub stream: usize,
    pub collection: Arc<str>,
    pub version: String,
    pub at: Instant,
    pub bytes: usize,
}

/// Shared progress of every stream.
#[derive(Default)]
pub struct Progress {
    /// Streams holding a first state of every collection they asked for.
    pub synced: AtomicUsize,
    /// Streams holding the final published version of every collection.
    pub at_final: AtomicUsize,
    pub errors: AtomicUsize,
}

/// HTTP/2 frames the clients received, counted on the wire.
#[derive(Debug, Default)]
pub struct Frames {
    pub all: AtomicU64,
    pub data: AtomicU64,
}

/// Opens `connections` HTTP/2 connections whose frames are counted in
/// `frames`. `max_frame_size` is the largest frame the clients accept
/// (SETTINGS_MAX_FRAME_SIZE; grpc-go and Envoy accept 16 KiB).
pub async fn connect(
    addr: SocketAddr,
    connections: usize,
    max_frame_size: u32,
    frames: Arc<Frames>,
) -> anyhow::Result<Vec<Channel>> {
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections.max(1) {
        let frames = frames.clone();
        let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let frames = frames.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                tcp.set_nodelay(true)?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(FrameCounter::new(tcp, frames)))
            }
        });
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .initial_connection_window_size(16 << 20)
            .initial_stream_window_size(4 << 20)
            .max_frame_size(max_frame_size)
            .connect_with_connector(connector)
            .await?;
        channels.push(channel);
    }
    Ok(channels)
}

/// A connection that counts the HTTP/2 frames read from it (after the
/// server's part of the preface, which is a SETTINGS frame itself).
struct FrameCounter {
    io: tokio::net::TcpStream,
    frames: Arc<Frames>,
    header: [u8; 9],
    have: usize,
    skip: usize,
}

impl FrameCounter {
    fn new(io: tokio::net::TcpStream, frames: Arc<Frames>) -> Self {
        Self {
            io,
            frames,
            header: [0; 9],
            have: 0,
            skip: 0,
        }
    }

    fn count(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (9 - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == 9 {
                self.have = 0;
                self.skip =
                    usize::from(self.header[0]) << 16 | usize::from(self.header[1]) << 8 | usize::from(self.header[2]);
                self.frames.all.fetch_add(1, Ordering::Relaxed);
                if self.header[3] == 0 {
                    self.frames.data.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl tokio::io::AsyncRead for FrameCounter {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if polled.is_ready() {
            this.count(&buf.filled()[before..]);
        }
        polled
    }
}

impl tokio::io::AsyncWrite for FrameCounter {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

fn node(index: usize) -> Option<SinkNode> {
    Some(SinkNode {
        id: format!("mcp-load-{index}"),
        annotations: HashMap::new(),
    })
}

/// Runs one stream of `protocol`, asking for changes (`incremental`: one of
/// `collections`, stream `index` the one at `index` in turn) or for the
/// state of the world (all of them), until `stop` is cancelled; returns what
/// it received.
pub async fn run_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    (protocol, incremental): (ClientProtocol, bool),
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: Arc<Progress>,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<Received> {
    let watch = Watch {
        finals,
        progress: &progress,
        stop,
    };
    let result = match (protocol, incremental) {
        (ClientProtocol::Mcp, true) => incremental_stream(index, channel, one_of(&collections, index), watch).await,
        (ClientProtocol::Mcp, false) => sotw_stream(index, channel, collections, watch).await,
        (_, false) => xds_sotw_stream(index, channel, collections, watch).await,
        (_, true) => xds_delta_stream(index, channel, one_of(&collections, index), watch).await,
    };
    let mut received = kept(index, &progress, result).unwrap_or_default();
    for r in &mut received {
        r.stream = index;
    }
    received
}

/// Stream `index`'s one collection.
fn one_of(collections: &[Arc<str>], index: usize) -> Arc<str> {
    collections[index % collections.len()].clone()
}

/// What stream `index` kept; a failure is counted in `progress` and said.
pub fn kept<T>(index: usize, progress: &Progress, result: anyhow::Result<T>) -> Option<T> {
    match result {
        Ok(kept) => Some(kept),
        Err(e) => {
            progress.errors.fetch_add(1, Ordering::Relaxed);
            eprintln!("mcp-load: stream {index}: {e}");
            None
        }
    }
}

/// What every stream reports to and stops on.
pub struct Watch<'a, F> {
    /// The publisher's final state, once published.
    pub finals: watch::Receiver<Option<F>>,
    pub progress: &'a Progress,
    pub stop: tokio_util::sync::CancellationToken,
}

/// What a stream keeps of its responses, and whether it holds a first state
/// and the final state of what it asked for.
pub trait Holder {
    /// The publisher's final state, as this holder compares with it.
    type Finals;
    fn on_response(&mut self, envelope: Envelope, bytes: usize, at: Instant) -> anyhow::Result<()>;
    /// Holds a first state of everything it asked for.
    fn synced(&self) -> bool;
    /// Holds the final state of everything it asked for.
    fn at_final(&self, finals: &Self::Finals) -> bool;
}

/// Counts a stream in [`Progress`] once when synced and once when final.
#[derive(Default)]
struct Counted {
    synced: bool,
    at_final: bool,
}

impl Counted {
    fn update<H: Holder>(&mut self, holder: &H, progress: &Progress, finals: &Option<H::Finals>) {
        if !self.synced && holder.synced() {
            self.synced = true;
            progress.synced.fetch_add(1, Ordering::Relaxed);
        }
        if let (false, Some(finals)) = (self.at_final, finals) {
            if holder.at_final(finals) {
                self.at_final = true;
                progress.at_final.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The version of each collection a stream holds, and every response it
/// received.
struct Versions<C> {
    held: HashMap<Arc<str>, String>,
    /// How many collections the stream asked for.
    wanted: usize,
    /// The collection a response is of.
    collection_of: C,
    received: Vec<Received>,
}

impl<C> Versions<C> {
    fn new(wanted: usize, collection_of: C) -> Self {
        Self {
            held: HashMap::new(),
            wanted,
            collection_of,
            received: Vec::new(),
        }
    }
}

impl<C: Fn(&Envelope) -> Arc<str>> Holder for Versions<C> {
    /// The final version of each collection.
    type Finals = HashMap<String, String>;

    fn on_response(&mut self, envelope: Envelope, bytes: usize, at: Instant) -> anyhow::Result<()> {
        let collection = (self.collection_of)(&envelope);
        self.held.insert(collection.clone(), envelope.version.clone());
        self.received.push(Received {
            stream: 0,
            collection,
            version: envelope.version,
            at,
            bytes,
        });
        Ok(())
    }

    fn synced(&self) -> bool {
        self.held.len() == self.wanted
    }

    fn at_final(&self, finals: &Self::Finals) -> bool {
        self.synced() && self.held.iter().all(|(c, v)| finals.get(&**c) == Some(v))
    }
}

async fn sotw_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>> {
    let types = collections.iter().map(|c| (c.to_string(), c.clone())).collect();
    let request = |type_url: &str, version: &str, nonce: &str, _first: bool| MeshConfigRequest {
        version_info: version.to_owned(),
        sink_node: node(index),
        type_url: type_url.to_owned(),
        response_nonce: nonce.to_owned(),
        error_detail: None,
    };
    many_types(channel, SOTW_PATH, MCP, types, request, watch).await
}

/// A state-of-the-world stream of several types: `types` are (the type URL
/// asked for, its collection); `request(type_url, version, nonce, first of
/// the stream)` is each first request (no version, no nonce) and each ACK.
async fn many_types<Req>(
    channel: Channel,
    path: &'static str,
    fields: Fields,
    types: Vec<(String, Arc<str>)>,
    request: impl Fn(&str, &str, &str, bool) -> Req,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>>
where
    Req: prost::Message + Send + 'static,
{
    let initial = types
        .iter()
        .enumerate()
        .map(|(i, (type_url, _))| request(type_url, "", "", i == 0))
        .collect();
    let ack = |envelope: &Envelope| request(&envelope.type_url, &envelope.version, &envelope.nonce, false);
    let collection_of = |envelope: &Envelope| {
        types
            .iter()
            .find(|(type_url, _)| *type_url == envelope.type_url)
            .map_or_else(|| envelope.type_url.as_str().into(), |(_, c)| c.clone())
    };
    let stream = Drive { path, fields, initial };
    let held = stream
        .run(channel, ack, Versions::new(types.len(), collection_of), watch)
        .await?;
    Ok(held.received)
}

/// `--generations`: the Istio releases the v3 clients say they are
/// (`ISTIO_VERSION` in their node), in turn by stream; unset: none say.
pub static GENERATIONS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// istiod's node: its id on the first request of a stream, and with
/// `--generations` the release it says it is.
pub fn xds_node(index: usize) -> Option<Node> {
    let metadata = GENERATIONS.get().filter(|g| !g.is_empty()).map(|releases| {
        let version = prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(
                releases[index % releases.len()].clone(),
            )),
        };
        prost_types::Struct {
            fields: [("ISTIO_VERSION".to_owned(), version)].into(),
        }
    });
    Some(Node {
        id: format!("mcp-load-{index}"),
        metadata,
        ..Default::default()
    })
}

/// The GVK of each collection (MCP over xDS), and back.
fn gvks(collections: &[Arc<str>]) -> anyhow::Result<Vec<(String, Arc<str>)>> {
    let table = CollectionTable::builtin();
    collections
        .iter()
        .map(|c| {
            let gvk = table.gvk(c).ok_or_else(|| anyhow::anyhow!("no GVK names {c}"))?;
            Ok((gvk.to_owned(), c.clone()))
        })
        .collect()
}

/// An istiod-style v3 client: every GVK at once, wildcard, the node first.
async fn xds_sotw_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>> {
    let request = |type_url: &str, version: &str, nonce: &str, first: bool| DiscoveryRequest {
        node: first.then(|| xds_node(index)).flatten(),
        version_info: version.to_owned(),
        type_url: type_url.to_owned(),
        response_nonce: nonce.to_owned(),
        ..Default::default()
    };
    many_types(channel, XDS_SOTW_PATH, XDS, gvks(&collections)?, request, watch).await
}

/// A delta v3 client for one GVK (wildcard).
async fn xds_delta_stream(
    index: usize,
    channel: Channel,
    collection: Arc<str>,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>> {
    let (gvk, _) = gvks(std::slice::from_ref(&collection))?.remove(0);
    let request = |nonce: String| DeltaDiscoveryRequest {
        node: nonce.is_empty().then(|| xds_node(index)).flatten(),
        type_url: gvk.clone(),
        response_nonce: nonce,
        ..Default::default()
    };
    one_type(channel, XDS_DELTA_PATH, XDS, request, collection, watch).await
}

async fn incremental_stream(
    index: usize,
    channel: Channel,
    collection: Arc<str>,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>> {
    let request = |nonce: String| IncrementalMeshConfigRequest {
        sink_node: node(index),
        type_url: collection.to_string(),
        response_nonce: nonce,
        ..Default::default()
    };
    one_type(channel, INCREMENTAL_PATH, MCP, request, collection.clone(), watch).await
}

/// A stream of one type that asks for changes (legacy incremental, xDS
/// delta): `request(nonce)` is its first request (no nonce) and each ACK.
async fn one_type<Req>(
    channel: Channel,
    path: &'static str,
    fields: Fields,
    request: impl Fn(String) -> Req,
    collection: Arc<str>,
    watch: Watch<'_, HashMap<String, String>>,
) -> anyhow::Result<Vec<Received>>
where
    Req: prost::Message + Send + 'static,
{
    let stream = Drive {
        path,
        fields,
        initial: vec![request(String::new())],
    };
    let ack = |envelope: &Envelope| request(envelope.nonce.clone());
    let held = stream
        .run(channel, ack, Versions::new(1, |_: &Envelope| collection.clone()), watch)
        .await?;
    Ok(held.received)
}

/// Opens a stream on `path` with its first requests sent; more requests go
/// through the sender. Responses are read as envelopes of `fields` (see
/// `reader.rs`).
pub async fn open<Req: prost::Message + Send + 'static>(
    channel: Channel,
    path: &'static str,
    fields: Fields,
    initial: Vec<Req>,
) -> anyhow::Result<(mpsc::Sender<Req>, Responses)> {
    let (tx, rx) = mpsc::channel(initial.len() + 8);
    for request in initial {
        tx.send(request).await?;
    }
    let answered = call::open(channel, path, rx).await?;
    Ok((tx, Responses::new(answered.body, answered.ended, fields)))
}

/// One client stream of any protocol: send the initial requests, then ACK
/// every response and hand it to the stream's [`Holder`].
pub struct Drive<Req> {
    pub path: &'static str,
    pub fields: Fields,
    pub initial: Vec<Req>,
}

impl<Req: prost::Message + Send + 'static> Drive<Req> {
    /// Runs until `watch.stop` is cancelled or the stream ends with OK;
    /// returns what `holder` kept.
    pub async fn run<H: Holder>(
        self,
        channel: Channel,
        ack: impl Fn(&Envelope) -> Req,
        mut holder: H,
        watch: Watch<'_, H::Finals>,
    ) -> anyhow::Result<H> {
        self.run_on(channel, ack, &mut holder, watch).await?;
        Ok(holder)
    }

    /// [`Drive::run`] on a holder the caller keeps, so that what it held
    /// survives a stream the gateway broke (a restart: `reconnect.rs`).
    pub async fn run_on<H: Holder>(
        self,
        channel: Channel,
        ack: impl Fn(&Envelope) -> Req,
        holder: &mut H,
        watch: Watch<'_, H::Finals>,
    ) -> anyhow::Result<()> {
        let Watch {
            mut finals,
            progress,
            stop,
        } = watch;
        let (tx, mut inbound) = open(channel, self.path, self.fields, self.initial).await?;
        let mut counted = Counted::default();
        loop {
            tokio::select! {
                message = inbound.message() => {
                    let Some((envelope, bytes)) = message? else { break };
                    let at = Instant::now();
                    tx.send(ack(&envelope)).await?;
                    holder.on_response(envelope, bytes, at)?;
                    counted.update(&*holder, progress, &finals.borrow());
                }
                changed = finals.changed() => {
                    if changed.is_ok() {
                        counted.update(&*holder, progress, &finals.borrow_and_update());
                    }
                }
                _ = stop.cancelled() => break,
            }
        }
        Ok(())
    }
}
