//! The load's clients: real gRPC streams over a set of HTTP/2 connections,
//! state of the world or incremental, legacy MCP or Envoy's v3 ADS (asking
//! for GVKs, as istiod does), ACKing like real clients and recording when
//! each version arrived and how many bytes it took.
//!
//! They decode each response's envelope (version, type, nonce) and skip the
//! resources' bytes, so the tool measures the gateway rather than itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Buf;
use mcp_xds_gateway::collections::CollectionTable;
use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use mcp_xds_gateway::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, SinkNode};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

pub use mcp_xds_gateway::downstream::service::{INCREMENTAL_PATH, SOTW_PATH, XDS_DELTA_PATH, XDS_SOTW_PATH};

use crate::scenario::ClientProtocol;

/// What a client acts on in a response: its version, type and nonce.
#[derive(Clone, Debug, Default)]
pub struct Envelope {
    pub version: String,
    /// Empty where the response names none (legacy incremental).
    pub type_url: String,
    pub nonce: String,
}

/// The legacy responses' envelope. Field 3 is the `type_url` of a
/// state-of-the-world response (and the removed names of an incremental
/// one, which the load ignores).
#[derive(Clone, PartialEq, prost::Message)]
pub struct McpEnvelope {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, repeated, tag = "3")]
    pub field3: Vec<String>,
    #[prost(string, tag = "4")]
    pub nonce: String,
}

impl From<McpEnvelope> for Envelope {
    fn from(e: McpEnvelope) -> Self {
        Envelope {
            version: e.version,
            type_url: e.field3.into_iter().next().unwrap_or_default(),
            nonce: e.nonce,
        }
    }
}

/// The v3 responses' envelope, SotW and delta alike.
#[derive(Clone, PartialEq, prost::Message)]
pub struct XdsEnvelope {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
}

impl From<XdsEnvelope> for Envelope {
    fn from(e: XdsEnvelope) -> Self {
        Envelope {
            version: e.version,
            type_url: e.type_url,
            nonce: e.nonce,
        }
    }
}

/// Encodes any prost request; decodes an envelope `E` and the message's size.
#[derive(Debug)]
pub struct LoadCodec<Req, E = McpEnvelope>(std::marker::PhantomData<(Req, E)>);

impl<Req, E> Default for LoadCodec<Req, E> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

pub struct RequestEncoder<Req>(std::marker::PhantomData<Req>);
pub struct EnvelopeDecoder<E>(std::marker::PhantomData<E>);

impl<Req: prost::Message> Encoder for RequestEncoder<Req> {
    type Item = Req;
    type Error = Status;
    fn encode(&mut self, item: Req, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst).map_err(|e| Status::internal(e.to_string()))
    }
}

impl<E: prost::Message + Default + Into<Envelope>> Decoder for EnvelopeDecoder<E> {
    type Item = (Envelope, usize);
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<(Envelope, usize)>, Status> {
        let len = src.remaining();
        let envelope = E::decode(src).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Some((envelope.into(), len)))
    }
}

impl<Req, E> Codec for LoadCodec<Req, E>
where
    Req: prost::Message + Send + 'static,
    E: prost::Message + Default + Into<Envelope> + Send + 'static,
{
    type Encode = Req;
    type Decode = (Envelope, usize);
    type Encoder = RequestEncoder<Req>;
    type Decoder = EnvelopeDecoder<E>;
    fn encoder(&mut self) -> Self::Encoder {
        RequestEncoder(std::marker::PhantomData)
    }
    fn decoder(&mut self) -> Self::Decoder {
        EnvelopeDecoder(std::marker::PhantomData)
    }
}

/// One received response.
#[derive(Clone, Debug)]
pub struct Received {
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

pub async fn connect(addr: SocketAddr, connections: usize) -> anyhow::Result<Vec<Channel>> {
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections.max(1) {
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .initial_connection_window_size(16 << 20)
            .initial_stream_window_size(4 << 20)
            .connect()
            .await?;
        channels.push(channel);
    }
    Ok(channels)
}

fn node(index: usize) -> Option<SinkNode> {
    Some(SinkNode {
        id: format!("mcp-load-{index}"),
        annotations: HashMap::new(),
    })
}

/// Runs one stream of `protocol`, asking for changes (`incremental`) or
/// for the state of the world, until `stop` is cancelled; returns what it
/// received.
pub async fn run_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    (protocol, incremental): (ClientProtocol, bool),
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: Arc<Progress>,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<Received> {
    let result = match (protocol, incremental) {
        (ClientProtocol::Mcp, true) => {
            incremental_stream(index, channel, collections[0].clone(), finals, &progress, stop).await
        }
        (ClientProtocol::Mcp, false) => sotw_stream(index, channel, collections, finals, &progress, stop).await,
        (_, false) => xds_sotw_stream(index, channel, collections, finals, &progress, stop).await,
        (_, true) => xds_delta_stream(index, channel, collections[0].clone(), finals, &progress, stop).await,
    };
    match result {
        Ok(received) => received,
        Err(e) => {
            progress.errors.fetch_add(1, Ordering::Relaxed);
            eprintln!("mcp-load: stream {index}: {e}");
            Vec::new()
        }
    }
}

/// Tracks which versions a stream holds, to count it synced and final once.
struct Holdings {
    held: HashMap<Arc<str>, String>,
    wanted: usize,
    synced: bool,
    at_final: bool,
}

impl Holdings {
    fn new(wanted: usize) -> Self {
        Self {
            held: HashMap::new(),
            wanted,
            synced: false,
            at_final: false,
        }
    }

    fn update(&mut self, progress: &Progress, finals: &Option<HashMap<String, String>>) {
        if !self.synced && self.held.len() == self.wanted {
            self.synced = true;
            progress.synced.fetch_add(1, Ordering::Relaxed);
        }
        if let (false, Some(finals)) = (self.at_final, finals) {
            if self.held.iter().all(|(c, v)| finals.get(&**c) == Some(v)) && self.held.len() == self.wanted {
                self.at_final = true;
                progress.at_final.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn sotw_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: &Progress,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<Received>> {
    let initial = collections
        .iter()
        .map(|collection| MeshConfigRequest {
            sink_node: node(index),
            type_url: collection.to_string(),
            ..Default::default()
        })
        .collect();
    let ack = |envelope: &Envelope| MeshConfigRequest {
        version_info: envelope.version.clone(),
        sink_node: node(index),
        type_url: envelope.type_url.clone(),
        response_nonce: envelope.nonce.clone(),
        error_detail: None,
    };
    let collection_of = |envelope: &Envelope| {
        collections
            .iter()
            .find(|c| ***c == *envelope.type_url)
            .cloned()
            .unwrap_or_else(|| envelope.type_url.as_str().into())
    };
    let stream = Drive {
        path: SOTW_PATH,
        initial,
        wanted: collections.len(),
    };
    stream
        .run::<McpEnvelope>(channel, ack, collection_of, finals, progress, stop)
        .await
}

/// istiod's node: its id on the first request of a stream.
fn xds_node(index: usize) -> Option<Node> {
    Some(Node {
        id: format!("mcp-load-{index}"),
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
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: &Progress,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<Received>> {
    let gvks = gvks(&collections)?;
    let initial = gvks
        .iter()
        .enumerate()
        .map(|(i, (gvk, _))| DiscoveryRequest {
            node: if i == 0 { xds_node(index) } else { None },
            type_url: gvk.clone(),
            ..Default::default()
        })
        .collect();
    let ack = |envelope: &Envelope| DiscoveryRequest {
        version_info: envelope.version.clone(),
        type_url: envelope.type_url.clone(),
        response_nonce: envelope.nonce.clone(),
        ..Default::default()
    };
    let collection_of = |envelope: &Envelope| {
        gvks.iter()
            .find(|(gvk, _)| *gvk == envelope.type_url)
            .map_or_else(|| envelope.type_url.as_str().into(), |(_, c)| c.clone())
    };
    let stream = Drive {
        path: XDS_SOTW_PATH,
        initial,
        wanted: collections.len(),
    };
    stream
        .run::<XdsEnvelope>(channel, ack, collection_of, finals, progress, stop)
        .await
}

/// A delta v3 client for one GVK (wildcard).
async fn xds_delta_stream(
    index: usize,
    channel: Channel,
    collection: Arc<str>,
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: &Progress,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<Received>> {
    let (gvk, _) = gvks(std::slice::from_ref(&collection))?.remove(0);
    let stream = Drive {
        path: XDS_DELTA_PATH,
        initial: vec![DeltaDiscoveryRequest {
            node: xds_node(index),
            type_url: gvk.clone(),
            ..Default::default()
        }],
        wanted: 1,
    };
    let ack = |envelope: &Envelope| DeltaDiscoveryRequest {
        type_url: gvk.clone(),
        response_nonce: envelope.nonce.clone(),
        ..Default::default()
    };
    stream
        .run::<XdsEnvelope>(channel, ack, |_| collection.clone(), finals, progress, stop)
        .await
}

async fn incremental_stream(
    index: usize,
    channel: Channel,
    collection: Arc<str>,
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: &Progress,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Vec<Received>> {
    let request = |nonce: String| IncrementalMeshConfigRequest {
        sink_node: node(index),
        type_url: collection.to_string(),
        response_nonce: nonce,
        ..Default::default()
    };
    let stream = Drive {
        path: INCREMENTAL_PATH,
        initial: vec![request(String::new())],
        wanted: 1,
    };
    let ack = |envelope: &Envelope| request(envelope.nonce.clone());
    stream
        .run::<McpEnvelope>(channel, ack, |_| collection.clone(), finals, progress, stop)
        .await
}

/// Opens a stream on `path` with its first requests sent; more requests go
/// through the sender. Responses are read as envelopes `E` (see
/// [`LoadCodec`]).
pub async fn open<Req, E>(
    channel: Channel,
    path: &'static str,
    initial: Vec<Req>,
) -> anyhow::Result<(mpsc::Sender<Req>, tonic::Streaming<(Envelope, usize)>)>
where
    Req: prost::Message + Send + 'static,
    E: prost::Message + Default + Into<Envelope> + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    grpc.ready().await?;
    let (tx, rx) = mpsc::channel(initial.len() + 8);
    for request in initial {
        tx.send(request).await?;
    }
    let inbound = grpc
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            tonic::codegen::http::uri::PathAndQuery::from_static(path),
            LoadCodec::<Req, E>::default(),
        )
        .await?
        .into_inner();
    Ok((tx, inbound))
}

/// One client stream of either protocol: send the initial requests, then ACK
/// every response and record when it arrived.
struct Drive<Req> {
    path: &'static str,
    initial: Vec<Req>,
    /// How many collections the stream asked for.
    wanted: usize,
}

impl<Req: prost::Message + Send + 'static> Drive<Req> {
    async fn run<E: prost::Message + Default + Into<Envelope> + Send + 'static>(
        self,
        channel: Channel,
        ack: impl Fn(&Envelope) -> Req,
        collection_of: impl Fn(&Envelope) -> Arc<str>,
        mut finals: watch::Receiver<Option<HashMap<String, String>>>,
        progress: &Progress,
        stop: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Vec<Received>> {
        let (tx, mut inbound) = open::<Req, E>(channel, self.path, self.initial).await?;
        let mut holdings = Holdings::new(self.wanted);
        let mut received = Vec::new();
        loop {
            tokio::select! {
                message = inbound.message() => {
                    let Some((envelope, bytes)) = message? else { break };
                    let at = Instant::now();
                    tx.send(ack(&envelope)).await?;
                    let collection = collection_of(&envelope);
                    holdings.held.insert(collection.clone(), envelope.version.clone());
                    received.push(Received { collection, version: envelope.version, at, bytes });
                    holdings.update(progress, &finals.borrow());
                }
                changed = finals.changed() => {
                    if changed.is_ok() {
                        holdings.update(progress, &finals.borrow_and_update());
                    }
                }
                _ = stop.cancelled() => break,
            }
        }
        Ok(received)
    }
}
