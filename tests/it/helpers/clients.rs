//! Legacy clients of `AggregatedMeshConfigService`: real tonic clients over
//! 127.0.0.1. One generic bidi stream serves every dialect: 1.1 (the proto's
//! messages), 1.0 (a `Client{id, Struct metadata}` on field 2) and incremental.

use std::collections::HashMap;
use std::net::SocketAddr;

use bytes::{Buf, Bytes};
use mcp_xds_gateway::proto::{
    IncrementalMeshConfigRequest, IncrementalMeshConfigResponse, MeshConfigRequest, MeshConfigResponse, SinkNode,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Endpoint};
use tonic::{Status, Streaming};

use super::within;

pub const SOTW_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/StreamAggregatedResources";
pub const INCREMENTAL_PATH: &str = "/istio.mcp.v1alpha1.AggregatedMeshConfigService/IncrementalAggregatedResources";

pub async fn channel(addr: SocketAddr) -> Channel {
    within(
        "connecting to the gateway",
        Endpoint::from_shared(format!("http://{addr}")).unwrap().connect(),
    )
    .await
    .expect("connect to the gateway")
}

/// A TLS channel to 127.0.0.1:PORT (checked as "localhost") trusting `ca_pem`, presenting
/// `identity` (certificate, key) when given. Errors are returned, not
/// asserted: some tests expect the connection to be refused.
pub async fn tls_channel(
    addr: SocketAddr,
    ca_pem: &str,
    identity: Option<&super::certs::Leaf>,
) -> Result<Channel, tonic::transport::Error> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some(leaf) = identity {
        tls = tls.identity(Identity::from_pem(&leaf.cert, &leaf.key));
    }
    let endpoint = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?;
    within("a TLS connection to the gateway", endpoint.connect()).await
}

/// One bidi stream with any request and response codec.
pub struct Bidi<Req, Resp> {
    tx: mpsc::UnboundedSender<Req>,
    rx: Streaming<Resp>,
}

impl<Req, Resp> Bidi<Req, Resp>
where
    Req: Send + Sync + 'static,
    Resp: Send + Sync + 'static,
{
    pub async fn open_with<C>(channel: Channel, path: &'static str, codec: C) -> Self
    where
        C: Codec<Encode = Req, Decode = Resp> + Send + 'static,
    {
        Self::try_open_with(channel, path, codec)
            .await
            .expect("the gateway accepts the stream")
    }

    /// Opens a stream; Err is the status the gateway refused it with.
    pub async fn try_open_with<C>(channel: Channel, path: &'static str, codec: C) -> Result<Self, Status>
    where
        C: Codec<Encode = Req, Decode = Resp> + Send + 'static,
    {
        let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(usize::MAX);
        within("the client to be ready", grpc.ready()).await.unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let response = within(
            "the gateway to answer a stream",
            grpc.streaming(
                tonic::Request::new(UnboundedReceiverStream::new(rx)),
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                codec,
            ),
        )
        .await?;
        Ok(Self {
            tx,
            rx: response.into_inner(),
        })
    }

    pub fn send(&self, request: Req) {
        self.tx.send(request).expect("the request stream is open");
    }

    pub async fn recv(&mut self) -> Resp {
        within("a response from the gateway", self.rx.message())
            .await
            .expect("a response, not an error")
            .expect("a response, not the end of the stream")
    }

    /// The next response, or the status the stream ended with.
    pub async fn try_recv(&mut self) -> Result<Resp, Status> {
        within("a response or a status from the gateway", self.rx.message())
            .await?
            .ok_or_else(|| Status::ok("the stream ended"))
    }

    /// The status the gateway ended the stream with.
    pub async fn end_status(&mut self) -> Status {
        loop {
            match within("the gateway to end the stream", self.rx.message()).await {
                Ok(Some(_)) => continue,
                Ok(None) => return Status::ok(""),
                Err(status) => return status,
            }
        }
    }

    /// Closes the request side (client EOF).
    pub fn close(self) -> Streaming<Resp> {
        drop(self.tx);
        self.rx
    }
}

impl<Req, Resp> Bidi<Req, Resp>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    pub async fn open(addr: SocketAddr, path: &'static str) -> Self {
        Self::open_on(channel(addr).await, path).await
    }

    pub async fn open_on(channel: Channel, path: &'static str) -> Self {
        Self::open_with(channel, path, tonic_prost::ProstCodec::<Req, Resp>::default()).await
    }

    pub async fn try_open_on(channel: Channel, path: &'static str) -> Result<Self, Status> {
        Self::try_open_with(channel, path, tonic_prost::ProstCodec::<Req, Resp>::default()).await
    }
}

/// An Istio 1.1 legacy client (`type_url` = collection name, `SinkNode`).
pub type SotwClient = Bidi<MeshConfigRequest, MeshConfigResponse>;

pub async fn sotw(addr: SocketAddr) -> SotwClient {
    SotwClient::open(addr, SOTW_PATH).await
}

pub fn node() -> Option<SinkNode> {
    Some(SinkNode {
        id: "pilot-test".into(),
        annotations: HashMap::new(),
    })
}

impl SotwClient {
    pub fn subscribe(&self, type_url: &str) {
        self.request(type_url, "", "");
    }

    pub fn request(&self, type_url: &str, version: &str, nonce: &str) {
        self.send(MeshConfigRequest {
            version_info: version.into(),
            sink_node: node(),
            type_url: type_url.into(),
            response_nonce: nonce.into(),
            error_detail: None,
        });
    }

    pub fn ack(&self, response: &MeshConfigResponse) {
        self.request(&response.type_url, &response.version_info, &response.nonce);
    }

    /// Rejects `response`, reporting `held` as the version still applied.
    pub fn nack(&self, response: &MeshConfigResponse, held: &str, message: &str) {
        self.send(MeshConfigRequest {
            version_info: held.into(),
            sink_node: node(),
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            error_detail: Some(tonic_types::Status {
                code: tonic::Code::InvalidArgument as i32,
                message: message.into(),
                details: vec![],
            }),
        });
    }

    /// The next response, asserting its type.
    pub async fn recv_type(&mut self, type_url: &str) -> MeshConfigResponse {
        let response = self.recv().await;
        assert_eq!(response.type_url, type_url, "a response for another type came first");
        response
    }
}

/// Istio 1.0's request: field 2 is `Client{id, metadata: Struct}`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct V10Client {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(message, optional, tag = "2")]
    pub metadata: Option<prost_types::Struct>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct V10Request {
    #[prost(string, tag = "1")]
    pub version_info: String,
    #[prost(message, optional, tag = "2")]
    pub client: Option<V10Client>,
    #[prost(string, tag = "3")]
    pub type_url: String,
    #[prost(string, tag = "4")]
    pub response_nonce: String,
}

pub type V10SotwClient = Bidi<V10Request, MeshConfigResponse>;

pub type IncrementalClient = Bidi<IncrementalMeshConfigRequest, IncrementalMeshConfigResponse>;

pub async fn incremental(addr: SocketAddr) -> IncrementalClient {
    IncrementalClient::open(addr, INCREMENTAL_PATH).await
}

impl IncrementalClient {
    pub fn start(&self, type_url: &str, known: &[(&str, &str)]) {
        self.send(IncrementalMeshConfigRequest {
            sink_node: node(),
            type_url: type_url.into(),
            initial_resource_versions: known.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            response_nonce: String::new(),
            error_detail: None,
        });
    }

    pub fn reply(&self, type_url: &str, nonce: &str, error: Option<&str>) {
        self.send(IncrementalMeshConfigRequest {
            sink_node: node(),
            type_url: type_url.into(),
            initial_resource_versions: HashMap::new(),
            response_nonce: nonce.into(),
            error_detail: error.map(|message| tonic_types::Status {
                code: tonic::Code::InvalidArgument as i32,
                message: message.into(),
                details: vec![],
            }),
        });
    }
}

/// Sends prost requests and hands back each response's raw bytes, to compare
/// what two clients received byte for byte.
#[derive(Debug, Clone, Default)]
pub struct RawCodec;

pub struct RawEncoder;
pub struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = MeshConfigRequest;
    type Error = Status;
    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        prost::Message::encode(&item, dst).map_err(|e| Status::internal(e.to_string()))
    }
}

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl Codec for RawCodec {
    type Encode = MeshConfigRequest;
    type Decode = Bytes;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

pub type RawSotwClient = Bidi<MeshConfigRequest, Bytes>;

pub async fn raw_sotw(addr: SocketAddr) -> RawSotwClient {
    RawSotwClient::open_with(channel(addr).await, SOTW_PATH, RawCodec).await
}

/// Opens a SotW stream, sends a request that does not decode (field 3,
/// `type_url`, as a varint: the wrong wire type for a string), and returns
/// the status the gateway ends the stream with.
pub async fn send_garbled(addr: SocketAddr) -> Status {
    #[derive(Clone, PartialEq, prost::Message)]
    struct Garbled {
        #[prost(uint64, tag = "3")]
        type_url: u64,
    }
    let mut bad: Bidi<Garbled, MeshConfigResponse> =
        Bidi::open_with(channel(addr).await, SOTW_PATH, tonic_prost::ProstCodec::default()).await;
    bad.send(Garbled { type_url: 7 });
    bad.end_status().await
}

pub const RESOURCE_SOURCE_PATH: &str = "/istio.mcp.v1alpha1.ResourceSource/EstablishResourceStream";

/// A sink as Istio's `pkg/mcp/sink` runs one (Pilot 1.2 to 1.7 with
/// `configSources: mcp://…`, dialing a `ResourceSource`): an initial
/// `RequestResources` per collection (with the versions it holds when
/// incremental), then an ACK or a NACK per `Resources`, tracking the
/// versions it holds as `UpdateResourceVersionTracking` does.
pub struct PilotSink {
    pub stream: Bidi<mcp_xds_gateway::proto::RequestResources, mcp_xds_gateway::proto::Resources>,
    pub node: SinkNode,
    pub incremental: bool,
    /// collection → name → version, as ACKed.
    pub held: HashMap<String, std::collections::BTreeMap<String, String>>,
}

impl PilotSink {
    pub async fn connect(addr: SocketAddr, collections: &[&str], incremental: bool) -> Self {
        Self::connect_on(channel(addr).await, collections, incremental).await
    }

    /// As [`PilotSink::connect`], on a channel of the test's (TLS).
    pub async fn connect_on(channel: Channel, collections: &[&str], incremental: bool) -> Self {
        let sink = Self {
            stream: Bidi::open_on(channel, RESOURCE_SOURCE_PATH).await,
            node: SinkNode {
                id: "pilot-sink".into(),
                annotations: HashMap::new(),
            },
            incremental,
            held: collections
                .iter()
                .map(|c| (c.to_string(), Default::default()))
                .collect(),
        };
        sink.request_all();
        sink
    }

    /// A new stream on `addr`, reporting what it holds (incremental only).
    pub async fn reconnect(&mut self, addr: SocketAddr) {
        self.stream = Bidi::open(addr, RESOURCE_SOURCE_PATH).await;
        self.request_all();
    }

    fn request_all(&self) {
        let mut collections: Vec<&String> = self.held.keys().collect();
        collections.sort();
        for collection in collections {
            let initial_resource_versions = if self.incremental {
                self.held[collection].clone().into_iter().collect()
            } else {
                HashMap::new()
            };
            self.stream.send(mcp_xds_gateway::proto::RequestResources {
                sink_node: Some(self.node.clone()),
                collection: collection.clone(),
                initial_resource_versions,
                incremental: self.incremental,
                ..Default::default()
            });
        }
    }

    /// The next `Resources`, applied to what the sink holds and ACKed.
    pub async fn recv_and_ack(&mut self) -> mcp_xds_gateway::proto::Resources {
        let message = self.stream.recv().await;
        let held = self
            .held
            .get_mut(&message.collection)
            .expect("a collection this sink asked for");
        if !message.incremental {
            held.clear();
        }
        for resource in &message.resources {
            let metadata = resource.metadata.as_ref().expect("metadata");
            held.insert(metadata.name.clone(), metadata.version.clone());
        }
        for name in &message.removed_resources {
            held.remove(name);
        }
        self.stream.send(mcp_xds_gateway::proto::RequestResources {
            sink_node: Some(self.node.clone()),
            collection: message.collection.clone(),
            response_nonce: message.nonce.clone(),
            incremental: self.incremental,
            ..Default::default()
        });
        message
    }

    /// NACKs `message` as the sink does when its updater refuses a change.
    pub fn nack(&self, message: &mcp_xds_gateway::proto::Resources, reason: &str) {
        self.stream.send(mcp_xds_gateway::proto::RequestResources {
            sink_node: Some(self.node.clone()),
            collection: message.collection.clone(),
            response_nonce: message.nonce.clone(),
            error_detail: Some(tonic_types::Status {
                code: tonic::Code::InvalidArgument as i32,
                message: reason.into(),
                details: Vec::new(),
            }),
            ..Default::default()
        });
    }

    /// Sorted names the sink holds of `collection`.
    pub fn names(&self, collection: &str) -> Vec<String> {
        self.held[collection].keys().cloned().collect()
    }
}
