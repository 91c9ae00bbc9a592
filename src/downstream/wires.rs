//! The protocols served downstream, each as how its messages look: what its
//! requests say and where its responses put things. Everything else is the
//! shared stream (`stream.rs`) and state machine (`type_state.rs`).

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;

use tonic::Status;

use super::encode::{Layout, Shared, Suffix, DELTA_BODY, DELTA_MCP, LEGACY, RESOURCES, XDS_BODY, XDS_MCP};
use super::registry::Protocol;
use super::type_state::{Family, Mode, Push};
use super::Downstream;
use crate::cache::provenance::GATEWAY_ID_ANNOTATION;
use crate::collections::{Dialect, Resolved, XdsType, TYPE_URL_PREFIX};
use crate::proto::wire::{
    decode_shared, DeltaXdsRequest, IncrementalRequest, NameList, RequestNames, SinkRequest, SotwRequest, WireError,
    XdsRequest,
};
use crate::transport::requests::FromBuffer;

/// Each protocol's requests read through `MessageBuf` (a slice's speed,
/// `bytes` fields shares of the request), state-of-the-world xDS with its
/// names kept as they came ([`XdsRequest::read_shared`]). They read shared
/// bytes either way: a buffer is frozen and read as a frame is.
macro_rules! read_shared {
    ($($request:ty),*) => {$(
        impl FromBuffer for $request {
            fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
                Self::from_frame(buf.freeze())
            }

            fn from_frame(bytes: Bytes) -> Result<Self, prost::DecodeError> {
                decode_shared(&bytes)
            }
        }
    )*};
}

read_shared!(SotwRequest, IncrementalRequest, SinkRequest, DeltaXdsRequest);

impl FromBuffer for XdsRequest {
    fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
        Self::from_frame(buf.freeze())
    }

    fn from_frame(bytes: Bytes) -> Result<Self, prost::DecodeError> {
        XdsRequest::read_shared(&bytes)
    }
}

/// What a requested type is answered from.
#[derive(Debug)]
pub enum Target {
    /// A collection of the cache: answered once its source delivered it.
    Collection(Resolved),
    /// Nothing this gateway serves: answered at once, empty, and never
    /// again (xDS clients wait for an answer to every type they ask for).
    Unserved,
}

/// The collection label of types no source serves (one label, whatever
/// clients ask for: metric series stay bounded).
pub const UNSERVED: &str = "(unserved)";

/// A node's id and labels.
type Node = (String, Vec<(String, String)>);

/// A request's string as its wire read it: a share of the request
/// (`XdsRequest`'s strings) or the `String` the other wires' requests hold,
/// each taken as it is (a `String` made a `ByteString` would cost its ACK an
/// allocation whenever its capacity is not its length).
#[derive(Clone, Debug)]
pub enum Text {
    Shared(ByteString),
    Owned(String),
}

impl Default for Text {
    fn default() -> Self {
        Text::Owned(String::new())
    }
}

impl std::ops::Deref for Text {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Text::Shared(text) => text,
            Text::Owned(text) => text,
        }
    }
}

impl From<ByteString> for Text {
    fn from(text: ByteString) -> Self {
        Text::Shared(text)
    }
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Text::Owned(text)
    }
}

/// What a protocol's request says, read once.
#[derive(Debug, Default)]
pub struct WireRequest {
    /// The type: a type URL or a collection name. The strings a client
    /// repeats on every ACK are shares of the request where its wire reads
    /// them so (`XdsRequest`), not copies.
    pub type_url: Text,
    pub node_id: Option<String>,
    /// The node's annotations (MCP) or metadata strings (xDS), as `--canary`
    /// selectors match them.
    pub node_labels: Vec<(String, String)>,
    /// The peer's gateway id, when the peer is another gateway.
    pub gateway_id: Option<String>,
    pub nonce: Text,
    /// State of the world: the version the client holds (`version_info`).
    pub version_info: Text,
    pub error_detail: Option<Bytes>,
    /// How responses for this type carry the collection (the first request
    /// of a type decides).
    pub mode: Mode,
    /// `initial_resource_versions` entries (first requests of incremental
    /// types), as they are on the wire.
    pub reported: Vec<Bytes>,
    /// xDS: the names asked for (state of the world: all of them; delta:
    /// those subscribed by this request).
    pub names: NameList,
    /// State-of-the-world xDS: the names as the request carried them, not
    /// read yet. The stream reads them into `names` (the error naming the
    /// request, as [`names`] makes it) unless they hash as the names its
    /// type last asked for: an ACK repeats them (Envoy's 50 EDS names), and
    /// reading them was a sixth of a response's instructions.
    pub unread_names: Option<RequestNames>,
    /// Delta xDS: the names unsubscribed by this request.
    pub unsubscribe: NameList,
}

impl WireRequest {
    /// A state-of-the-world request: the client names the version it holds.
    fn full(
        type_url: impl Into<Text>,
        node: Option<Node>,
        nonce: impl Into<Text>,
        version_info: impl Into<Text>,
        error_detail: Option<Bytes>,
    ) -> Self {
        let (node_id, node_labels) = node.unzip();
        WireRequest {
            type_url: type_url.into(),
            node_id,
            node_labels: node_labels.unwrap_or_default(),
            nonce: nonce.into(),
            version_info: version_info.into(),
            error_detail,
            mode: Mode::Full,
            ..Default::default()
        }
    }

    /// A request for changes: the client reports what it holds (first
    /// request of a type).
    fn changes(
        type_url: impl Into<Text>,
        node: Option<Node>,
        nonce: impl Into<Text>,
        error_detail: Option<Bytes>,
        reported: Vec<Bytes>,
    ) -> Self {
        let (node_id, node_labels) = node.unzip();
        WireRequest {
            type_url: type_url.into(),
            node_id,
            node_labels: node_labels.unwrap_or_default(),
            nonce: nonce.into(),
            error_detail,
            mode: Mode::Incremental,
            reported,
            ..Default::default()
        }
    }
}

/// How one protocol's messages look.
pub trait Wire: Send + 'static {
    type Request: FromBuffer + Send + 'static;
    const PROTOCOL: Protocol;
    /// The request message's name, for errors about it.
    const REQUEST: &'static str;
    /// The request field that names the type, for errors about it.
    const TYPE_FIELD: &'static str;
    /// The stream carries one type, and its responses name none (legacy
    /// incremental); later requests may leave the type empty.
    const ONE_TYPE: bool;
    /// Every type a client asks for is answered, if only empty (xDS: istiod
    /// waits for each): a type naming nothing this gateway serves is
    /// answered empty instead of ending the stream, and so is a collection
    /// the source refuses while a type waits for it. Types are then named
    /// as xDS names them (GVKs, proto type URLs).
    const ANSWERS_EVERY_TYPE: bool = false;
    /// What its clients hold after a NACK.
    const FAMILY: Family = Family::Mcp;
    /// An ACK names the version it accepts (`version_info`), and a request
    /// with the last nonce but another version is not one (xDS state of the
    /// world: Envoy repeats its last ACKed version after a NACK).
    const ACK_NAMES_VERSION: bool = false;

    /// `Err` (the stream ends with it): what the message's decoding left to
    /// check (names read as bytes are UTF-8).
    fn read(request: Self::Request) -> Result<WireRequest, Status>;

    /// What a requested type is answered from. MCP: a collection of the
    /// table, else the stream ends with `unsupported {TYPE_FIELD} "…"`, as
    /// Istio's servers did. Protocols that answer every type: see
    /// [`resolve_xds`].
    fn resolve(shared: &Downstream, type_url: &str) -> Result<Target, Status> {
        if Self::ANSWERS_EVERY_TYPE {
            return Ok(resolve_xds(shared, type_url));
        }
        shared.resolve(Self::TYPE_FIELD, type_url).map(Target::Collection)
    }

    /// The shared parts and the per-client suffix of the response for
    /// `send` on `type_url`.
    fn encode(send: &Push, type_url: &str, nonce: &str) -> (Shared, Bytes);
}

/// `AggregatedMeshConfigService.StreamAggregatedResources` (Istio 1.0/1.1):
/// state of the world, many types per stream, `type_url` in each response.
pub struct LegacySotw;

impl Wire for LegacySotw {
    type Request = SotwRequest;
    const PROTOCOL: Protocol = Protocol::Sotw;
    const REQUEST: &'static str = "istio.mcp.v1alpha1.MeshConfigRequest";
    const TYPE_FIELD: &'static str = "type_url";
    const ONE_TYPE: bool = false;

    fn read(r: SotwRequest) -> Result<WireRequest, Status> {
        Ok(WireRequest::full(
            r.type_url,
            r.node.map(|n| n.into_parts()),
            r.response_nonce,
            r.version_info,
            r.error_detail,
        ))
    }

    fn encode(send: &Push, type_url: &str, nonce: &str) -> (Shared, Bytes) {
        LEGACY.response(send, Suffix::new(Some((3, type_url)), (4, nonce), None))
    }
}

/// `AggregatedMeshConfigService.IncrementalAggregatedResources`: diffs, one
/// type per stream (its responses name none).
pub struct LegacyIncremental;

impl Wire for LegacyIncremental {
    type Request = IncrementalRequest;
    const PROTOCOL: Protocol = Protocol::Incremental;
    const REQUEST: &'static str = "istio.mcp.v1alpha1.IncrementalMeshConfigRequest";
    const TYPE_FIELD: &'static str = "type_url";
    const ONE_TYPE: bool = true;

    fn read(r: IncrementalRequest) -> Result<WireRequest, Status> {
        Ok(WireRequest::changes(
            r.type_url,
            r.node.map(|n| n.into_parts()),
            r.response_nonce,
            r.error_detail,
            r.initial_resource_versions,
        ))
    }

    fn encode(send: &Push, _type_url: &str, nonce: &str) -> (Shared, Bytes) {
        LEGACY.response(send, Suffix::new(None, (4, nonce), None))
    }
}

/// `ResourceSource.EstablishResourceStream` (Pilot 1.2 to 1.7 as a sink, and
/// gateways chained behind this one): `RequestResources` per collection,
/// `Resources` back, full or incremental as each collection's first request
/// asked.
pub struct ResourceSourceWire;

impl Wire for ResourceSourceWire {
    type Request = SinkRequest;
    const PROTOCOL: Protocol = Protocol::ResourceSource;
    const REQUEST: &'static str = "istio.mcp.v1alpha1.RequestResources";
    const TYPE_FIELD: &'static str = "collection";
    const ONE_TYPE: bool = false;

    fn read(request: SinkRequest) -> Result<WireRequest, Status> {
        let (node_id, node_labels, gateway_id) = match request.sink_node {
            Some(node) => {
                let gateway = node.annotations.get(GATEWAY_ID_ANNOTATION).cloned();
                let (id, labels) = node.into_parts();
                (Some(id), labels, gateway)
            }
            None => (None, Vec::new(), None),
        };
        let mode = if request.incremental {
            Mode::Incremental
        } else {
            Mode::Full
        };
        Ok(WireRequest {
            type_url: request.collection.into(),
            node_id,
            node_labels,
            gateway_id,
            nonce: request.response_nonce.into(),
            error_detail: request.error_detail,
            mode,
            // A sink that asks for full state gets it whatever it holds.
            reported: if request.incremental {
                request.initial_resource_versions
            } else {
                Vec::new()
            },
            ..Default::default()
        })
    }

    fn encode(send: &Push, _collection: &str, nonce: &str) -> (Shared, Bytes) {
        let incremental = !matches!(send, Push::Full { .. } | Push::Selected { .. });
        RESOURCES.response(send, Suffix::new(None, (5, nonce), incremental.then_some(6)))
    }
}

/// How xDS resolves a type: a GVK or a type URL a collection owns, unless
/// the source refused that collection; anything else is answered empty.
fn resolve_xds(shared: &Downstream, type_url: &str) -> Target {
    match shared.inner.table.resolve_xds(type_url) {
        XdsType::Collection { collection, .. } if !shared.inner.subscriptions.is_refused(&collection) => {
            Target::Collection(Resolved {
                collection,
                dialect: Dialect::Xds,
            })
        }
        _ => Target::Unserved,
    }
}

/// The field of a state-of-the-world xDS request's names, as errors name it.
pub(super) const SOTW_NAMES_FIELD: &str = "resource_names";

/// A request's names, checked as its decoding would check a `string` field:
/// not UTF-8 ends the stream as a request that does not decode does.
pub(super) fn names<W: Wire>(names: Result<NameList, WireError>) -> Result<NameList, Status> {
    names.map_err(|e| Status::invalid_argument(format!("the request is not a valid {}: {e}", W::REQUEST)))
}

/// Both xDS responses carry `type_url` (4) and `nonce` (5). A GVK carries MCP
/// resources (the first layout); a proto type URL (Envoy's) the bodies.
fn xds_encode(send: &Push, type_url: &str, nonce: &str, [mcp, body]: [Layout; 2]) -> (Shared, Bytes) {
    let layout = if type_url.starts_with(TYPE_URL_PREFIX) {
        body
    } else {
        mcp
    };
    layout.response(send, Suffix::new(Some((4, type_url)), (5, nonce), None))
}

/// Envoy's v3 `AggregatedDiscoveryService.StreamAggregatedResources`: state
/// of the world per type. istiod 1.8+ (`configSources: xds://`) asks for
/// GVKs and reads `Any(istio.mcp.v1alpha1.Resource)`; Envoy asks for its own
/// type URLs and reads the bodies.
pub struct XdsSotw;

impl Wire for XdsSotw {
    type Request = XdsRequest;
    const PROTOCOL: Protocol = Protocol::XdsSotw;
    const REQUEST: &'static str = "envoy.service.discovery.v3.DiscoveryRequest";
    const TYPE_FIELD: &'static str = "type_url";
    const ONE_TYPE: bool = false;
    const ANSWERS_EVERY_TYPE: bool = true;
    const FAMILY: Family = Family::Xds;
    const ACK_NAMES_VERSION: bool = true;

    fn read(r: XdsRequest) -> Result<WireRequest, Status> {
        Ok(WireRequest {
            unread_names: Some(r.resource_names),
            ..WireRequest::full(
                r.type_url,
                r.node.map(|n| n.into_parts()),
                r.response_nonce,
                r.version_info,
                r.error_detail,
            )
        })
    }

    fn encode(send: &Push, type_url: &str, nonce: &str) -> (Shared, Bytes) {
        xds_encode(send, type_url, nonce, [XDS_MCP, XDS_BODY])
    }
}

/// Envoy's v3 `AggregatedDiscoveryService.DeltaAggregatedResources`: what
/// changed per type, each resource with its content version; a client that
/// reconnects with `initial_resource_versions` is sent only what differs.
pub struct XdsDelta;

impl Wire for XdsDelta {
    type Request = DeltaXdsRequest;
    const PROTOCOL: Protocol = Protocol::XdsDelta;
    const REQUEST: &'static str = "envoy.service.discovery.v3.DeltaDiscoveryRequest";
    const TYPE_FIELD: &'static str = "type_url";
    const ONE_TYPE: bool = false;
    const ANSWERS_EVERY_TYPE: bool = true;
    const FAMILY: Family = Family::Xds;

    fn read(r: DeltaXdsRequest) -> Result<WireRequest, Status> {
        Ok(WireRequest {
            names: names::<Self>(NameList::from_wire(
                "resource_names_subscribe",
                r.resource_names_subscribe,
            ))?,
            unsubscribe: names::<Self>(NameList::from_wire(
                "resource_names_unsubscribe",
                r.resource_names_unsubscribe,
            ))?,
            ..WireRequest::changes(
                r.type_url,
                r.node.map(|n| n.into_parts()),
                r.response_nonce,
                r.error_detail,
                r.initial_resource_versions,
            )
        })
    }

    fn encode(send: &Push, type_url: &str, nonce: &str) -> (Shared, Bytes) {
        xds_encode(send, type_url, nonce, [DELTA_MCP, DELTA_BODY])
    }
}
