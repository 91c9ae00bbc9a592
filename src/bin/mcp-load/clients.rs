//! The load's clients: real gRPC streams over a set of HTTP/2 connections,
//! state of the world or incremental, ACKing like real clients and recording
//! when each version arrived and how many bytes it took.
//!
//! They decode each response's envelope (version, type, nonce) and skip the
//! resources' bytes, so the tool measures the gateway rather than itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Buf;
use mcp_xds_gateway::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, SinkNode};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

pub use mcp_xds_gateway::downstream::service::{INCREMENTAL_PATH, SOTW_PATH};

/// The fields of both response kinds that a client acts on. Field 3 is the
/// `type_url` of a state-of-the-world response (and the removed names of an
/// incremental one, which the load ignores).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Envelope {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, repeated, tag = "3")]
    pub field3: Vec<String>,
    #[prost(string, tag = "4")]
    pub nonce: String,
}

/// Encodes any prost request; decodes an `Envelope` and the message's size.
#[derive(Debug)]
pub struct LoadCodec<Req>(std::marker::PhantomData<Req>);

impl<Req> Default for LoadCodec<Req> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

pub struct RequestEncoder<Req>(std::marker::PhantomData<Req>);
pub struct EnvelopeDecoder;

impl<Req: prost::Message> Encoder for RequestEncoder<Req> {
    type Item = Req;
    type Error = Status;
    fn encode(&mut self, item: Req, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst).map_err(|e| Status::internal(e.to_string()))
    }
}

impl Decoder for EnvelopeDecoder {
    type Item = (Envelope, usize);
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<(Envelope, usize)>, Status> {
        let len = src.remaining();
        let envelope = <Envelope as prost::Message>::decode(src).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Some((envelope, len)))
    }
}

impl<Req: prost::Message + Send + 'static> Codec for LoadCodec<Req> {
    type Encode = Req;
    type Decode = (Envelope, usize);
    type Encoder = RequestEncoder<Req>;
    type Decoder = EnvelopeDecoder;
    fn encoder(&mut self) -> Self::Encoder {
        RequestEncoder(std::marker::PhantomData)
    }
    fn decoder(&mut self) -> Self::Decoder {
        EnvelopeDecoder
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

/// Runs one stream until `stop` is cancelled; returns what it received.
pub async fn run_stream(
    index: usize,
    channel: Channel,
    collections: Vec<Arc<str>>,
    incremental: bool,
    finals: watch::Receiver<Option<HashMap<String, String>>>,
    progress: Arc<Progress>,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<Received> {
    let result = if incremental {
        incremental_stream(index, channel, collections[0].clone(), finals, &progress, stop).await
    } else {
        sotw_stream(index, channel, collections, finals, &progress, stop).await
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
    let type_url = |envelope: &Envelope| envelope.field3.first().cloned().unwrap_or_default();
    let ack = |envelope: &Envelope| MeshConfigRequest {
        version_info: envelope.version.clone(),
        sink_node: node(index),
        type_url: type_url(envelope),
        response_nonce: envelope.nonce.clone(),
        error_detail: None,
    };
    let collection_of = |envelope: &Envelope| {
        let type_url = type_url(envelope);
        collections
            .iter()
            .find(|c| ***c == *type_url)
            .cloned()
            .unwrap_or_else(|| type_url.as_str().into())
    };
    let stream = Drive {
        path: SOTW_PATH,
        initial,
        wanted: collections.len(),
    };
    stream.run(channel, ack, collection_of, finals, progress, stop).await
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
        .run(channel, ack, |_| collection.clone(), finals, progress, stop)
        .await
}

/// Opens a stream on `path` with its first requests sent; more requests go
/// through the sender. Responses are read as envelopes (see [`LoadCodec`]).
pub async fn open<Req: prost::Message + Send + 'static>(
    channel: Channel,
    path: &'static str,
    initial: Vec<Req>,
) -> anyhow::Result<(mpsc::Sender<Req>, tonic::Streaming<(Envelope, usize)>)> {
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
            LoadCodec::<Req>::default(),
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
    async fn run(
        self,
        channel: Channel,
        ack: impl Fn(&Envelope) -> Req,
        collection_of: impl Fn(&Envelope) -> Arc<str>,
        mut finals: watch::Receiver<Option<HashMap<String, String>>>,
        progress: &Progress,
        stop: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<Vec<Received>> {
        let (tx, mut inbound) = open(channel, self.path, self.initial).await?;
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
