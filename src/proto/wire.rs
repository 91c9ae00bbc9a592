//! The gateway's own views of MCP messages on the wire.
//!
//! They carry the same field numbers as the proto but decode leniently (field 2
//! of `MeshConfigRequest` is read for its `id` only, whichever dialect sent it)
//! and keep bytes untouched: upstream resources stay the exact bytes Galley
//! sent, and a NACK's message or a client's `initial_resource_versions` are
//! slices of the request, read without copying. (Responses are encoded by
//! each downstream protocol: `downstream/encode.rs`.)

use bytes::{Bytes, BytesMut};
use prost::encoding::{self, WireType};

/// Field 2 of `MeshConfigRequest`: a `Client{id, Struct metadata}` from Istio
/// 1.0 clients and a `SinkNode{id, annotations}` from 1.1 clients. `id` is
/// field 1 in both; field 2 (the metadata, or the annotations' entries) is
/// kept as bytes and read leniently by [`NodeId::into_parts`], so neither
/// kind of client is ever rejected for it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeId {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(bytes = "bytes", repeated, tag = "2")]
    pub details: Vec<Bytes>,
}

/// A `map<string, string>` entry.
#[derive(Clone, PartialEq, prost::Message)]
struct StringEntry {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

impl NodeId {
    /// The id, and the labels: the annotations of a `SinkNode`, or the
    /// string fields of a 1.0 `Client`'s metadata. What reads as neither is
    /// skipped.
    pub fn into_parts(self) -> (String, Vec<(String, String)>) {
        let mut labels = Vec::new();
        for detail in &self.details {
            // An annotation's key has no control characters; the bytes of a
            // `Struct` read as an entry would.
            match <StringEntry as prost::Message>::decode(detail.clone()) {
                Ok(entry) if !entry.key.is_empty() && !entry.key.chars().any(char::is_control) => {
                    labels.push((entry.key, entry.value));
                }
                _ => {
                    if let Ok(metadata) = <prost_types::Struct as prost::Message>::decode(detail.clone()) {
                        labels.extend(struct_strings(metadata));
                    }
                }
            }
        }
        (self.id, labels)
    }
}

/// The top-level string fields of a `Struct`.
fn struct_strings(metadata: prost_types::Struct) -> impl Iterator<Item = (String, String)> {
    metadata.fields.into_iter().filter_map(|(key, value)| match value.kind {
        Some(prost_types::value::Kind::StringValue(text)) => Some((key, text)),
        _ => None,
    })
}

/// `MeshConfigRequest` as the state-of-the-world server reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SotwRequest {
    #[prost(string, tag = "1")]
    pub version_info: String,
    #[prost(message, optional, tag = "2")]
    pub node: Option<NodeId>,
    #[prost(string, tag = "3")]
    pub type_url: String,
    #[prost(string, tag = "4")]
    pub response_nonce: String,
    /// A NACK's `google.rpc.Status`, as bytes (a slice of the request, not a
    /// copy): read with [`ErrorDetail::parse`], which keeps only the start
    /// of a long message.
    #[prost(bytes = "bytes", optional, tag = "5")]
    pub error_detail: Option<Bytes>,
}

/// A message field the gateway reads by hand that does not decode.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error(transparent)]
    Decode(#[from] prost::DecodeError),
    #[error("{0}")]
    Malformed(&'static str),
    #[error("{field}[{index}] is not UTF-8")]
    NotUtf8 { field: &'static str, index: usize },
}

/// A NACK as the gateway keeps it: the code and the start of the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorDetail {
    pub code: i32,
    /// At most the limit's bytes (cut at a character boundary).
    pub message: String,
    /// The message's length as the client sent it.
    pub message_len: usize,
}

impl ErrorDetail {
    /// Reads `google.rpc.Status{code = 1, message = 2, details = 3}`, copying
    /// at most `max` bytes of the message. Details are skipped unread.
    pub fn parse(mut bytes: Bytes, max: usize) -> Result<Self, WireError> {
        use bytes::Buf;
        let mut detail = ErrorDetail {
            code: 0,
            message: String::new(),
            message_len: 0,
        };
        while bytes.has_remaining() {
            let (tag, wire_type) = encoding::decode_key(&mut bytes)?;
            match (tag, wire_type) {
                (1, WireType::Varint) => detail.code = encoding::decode_varint(&mut bytes)? as i32,
                (2, WireType::LengthDelimited) => {
                    let len = encoding::decode_varint(&mut bytes)? as usize;
                    if len > bytes.remaining() {
                        return Err(WireError::Malformed("the message runs past the end of error_detail"));
                    }
                    let message = bytes.split_to(len);
                    let mut end = len.min(max);
                    while end > 0 && end < len && (message[end] & 0xc0) == 0x80 {
                        end -= 1;
                    }
                    detail.message = String::from_utf8_lossy(&message[..end]).into_owned();
                    detail.message_len = len;
                }
                _ => encoding::skip_field(wire_type, tag, &mut bytes, encoding::DecodeContext::default())?,
            }
        }
        Ok(detail)
    }
}

/// One entry of a `map<string, string>` on the wire: a message with the key
/// as field 1 and the value as field 2. `initial_resource_versions` is kept
/// as these bytes (slices of the request) and read without copying.
pub fn version_entry(mut entry: &[u8]) -> Result<(&str, &str), WireError> {
    use bytes::Buf;
    let (mut name, mut version) = ("", "");
    while entry.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut entry)?;
        match (tag, wire_type) {
            (1 | 2, WireType::LengthDelimited) => {
                let len = encoding::decode_varint(&mut entry)? as usize;
                if len > entry.len() {
                    return Err(WireError::Malformed("a map entry runs past its end"));
                }
                let (text, rest) = entry.split_at(len);
                let text = std::str::from_utf8(text).map_err(|_| WireError::Malformed("a map entry is not UTF-8"))?;
                if tag == 1 {
                    name = text;
                } else {
                    version = text;
                }
                entry = rest;
            }
            _ => encoding::skip_field(wire_type, tag, &mut entry, encoding::DecodeContext::default())?,
        }
    }
    Ok((name, version))
}

/// `IncrementalMeshConfigRequest` as the incremental server reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IncrementalRequest {
    #[prost(message, optional, tag = "1")]
    pub node: Option<NodeId>,
    #[prost(string, tag = "2")]
    pub type_url: String,
    /// `initial_resource_versions`: what the client holds (first request
    /// only), each entry as its bytes (see [`version_entry`]).
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub initial_resource_versions: Vec<Bytes>,
    #[prost(string, tag = "4")]
    pub response_nonce: String,
    /// As in [`SotwRequest::error_detail`].
    #[prost(bytes = "bytes", optional, tag = "5")]
    pub error_detail: Option<Bytes>,
}

/// `SinkNode` as `ResourceSource` reads it: the id and the annotations (a
/// gateway announces itself there).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SinkNodeView {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(map = "string, string", tag = "2")]
    pub annotations: std::collections::HashMap<String, String>,
}

impl SinkNodeView {
    /// The id, and the annotations as the node's labels.
    pub fn into_parts(self) -> (String, Vec<(String, String)>) {
        (self.id, self.annotations.into_iter().collect())
    }
}

/// Envoy's v3 `Node` as the gateway reads it: the id, and the metadata
/// (field 3; field 2 is the cluster).
#[derive(Clone, PartialEq, prost::Message)]
pub struct XdsNode {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(message, optional, tag = "3")]
    pub metadata: Option<prost_types::Struct>,
}

impl XdsNode {
    /// The id, and the metadata's top-level string fields as the node's
    /// labels.
    pub fn into_parts(self) -> (String, Vec<(String, String)>) {
        let labels = self.metadata.map(|m| struct_strings(m).collect()).unwrap_or_default();
        (self.id, labels)
    }
}

/// `RequestResources` as the `ResourceSource` server reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SinkRequest {
    #[prost(message, optional, tag = "1")]
    pub sink_node: Option<SinkNodeView>,
    #[prost(string, tag = "2")]
    pub collection: String,
    /// As in [`IncrementalRequest::initial_resource_versions`].
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub initial_resource_versions: Vec<Bytes>,
    #[prost(string, tag = "4")]
    pub response_nonce: String,
    /// As in [`SotwRequest::error_detail`].
    #[prost(bytes = "bytes", optional, tag = "5")]
    pub error_detail: Option<Bytes>,
    #[prost(bool, tag = "6")]
    pub incremental: bool,
}

/// Envoy's v3 `DiscoveryRequest` (state of the world) as the gateway reads
/// it. `Node.id` is field 1, as in MCP's nodes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct XdsRequest {
    pub version_info: String,
    pub node: Option<XdsNode>,
    /// Read into one buffer, not a `String` or a slice each: a client
    /// repeats its names on every ACK (Envoy's EDS: 50). Checked to be
    /// UTF-8 when read ([`RequestNames::checked`]).
    pub resource_names: RequestNames,
    pub type_url: String,
    pub response_nonce: String,
    /// As in [`SotwRequest::error_detail`].
    pub error_detail: Option<Bytes>,
}

/// By hand for `resource_names` (field 3); the rest as the derive writes it.
impl prost::Message for XdsRequest {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        if !self.version_info.is_empty() {
            encoding::string::encode(1, &self.version_info, buf);
        }
        if let Some(node) = &self.node {
            encoding::message::encode(2, node, buf);
        }
        self.resource_names.encode(3, buf);
        if !self.type_url.is_empty() {
            encoding::string::encode(4, &self.type_url, buf);
        }
        if !self.response_nonce.is_empty() {
            encoding::string::encode(5, &self.response_nonce, buf);
        }
        if let Some(detail) = &self.error_detail {
            encoding::bytes::encode(6, detail, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl bytes::Buf,
        ctx: encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            1 => encoding::string::merge(wire_type, &mut self.version_info, buf, ctx),
            2 => encoding::message::merge(wire_type, self.node.get_or_insert_with(Default::default), buf, ctx),
            3 => self.resource_names.merge(wire_type, buf),
            4 => encoding::string::merge(wire_type, &mut self.type_url, buf, ctx),
            5 => encoding::string::merge(wire_type, &mut self.response_nonce, buf, ctx),
            6 => encoding::bytes::merge(wire_type, self.error_detail.get_or_insert_with(Bytes::new), buf, ctx),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let string = |tag, s: &String| {
            if s.is_empty() {
                0
            } else {
                encoding::string::encoded_len(tag, s)
            }
        };
        string(1, &self.version_info)
            + self.node.as_ref().map_or(0, |n| encoding::message::encoded_len(2, n))
            + self.resource_names.encoded_len(3)
            + string(4, &self.type_url)
            + string(5, &self.response_nonce)
            + self
                .error_detail
                .as_ref()
                .map_or(0, |d| encoding::bytes::encoded_len(6, d))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Envoy's v3 `DeltaDiscoveryRequest` as the gateway reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaXdsRequest {
    #[prost(message, optional, tag = "1")]
    pub node: Option<XdsNode>,
    #[prost(string, tag = "2")]
    pub type_url: String,
    /// As in [`XdsRequest::resource_names`].
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub resource_names_subscribe: Vec<Bytes>,
    #[prost(bytes = "bytes", repeated, tag = "4")]
    pub resource_names_unsubscribe: Vec<Bytes>,
    /// As in [`IncrementalRequest::initial_resource_versions`].
    #[prost(bytes = "bytes", repeated, tag = "5")]
    pub initial_resource_versions: Vec<Bytes>,
    #[prost(string, tag = "6")]
    pub response_nonce: String,
    /// As in [`SotwRequest::error_detail`].
    #[prost(bytes = "bytes", optional, tag = "7")]
    pub error_detail: Option<Bytes>,
}

/// The names of a repeated `string` field as a request carries them, read
/// into one buffer as they come: no allocation and no reference count per
/// name (an Envoy repeats its 50 EDS names on every state-of-the-world ACK,
/// and decoding each as its own slice of the request was 5 % of the
/// gateway's CPU in `mcp-load --scenario eds`). Not checked yet: see
/// [`Self::checked`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestNames {
    bytes: Vec<u8>,
    /// Where each name ends in `bytes`.
    ends: Vec<u32>,
}

impl RequestNames {
    /// One more name, from a length-delimited field of `buf`.
    fn merge(&mut self, wire_type: WireType, buf: &mut impl bytes::Buf) -> Result<(), prost::DecodeError> {
        encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
        let len = encoding::decode_varint(buf)?;
        if len > buf.remaining() as u64 {
            return Err(underflow());
        }
        let len = len as usize;
        if self.ends.is_empty() {
            // Names are most of what follows: one allocation for them all.
            self.bytes.reserve(buf.remaining());
            self.ends.reserve(buf.remaining() / (len + 2) + 1);
        }
        let mut left = len;
        while left > 0 {
            let chunk = buf.chunk();
            let n = chunk.len().min(left);
            self.bytes.extend_from_slice(&chunk[..n]);
            buf.advance(n);
            left -= n;
        }
        // More than 4 GiB of names: more than any request may be.
        self.ends
            .push(u32::try_from(self.bytes.len()).map_err(|_| underflow())?);
        Ok(())
    }

    fn encode(&self, tag: u32, buf: &mut impl bytes::BufMut) {
        for span in spans(&self.ends) {
            let name = &self.bytes[span];
            encoding::encode_key(tag, WireType::LengthDelimited, buf);
            encoding::encode_varint(name.len() as u64, buf);
            buf.put_slice(name);
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        spans(&self.ends)
            .map(|span| encoding::key_len(tag) + encoding::encoded_len_varint(span.len() as u64) + span.len())
            .sum()
    }

    /// Each name checked to be UTF-8, as a `string` field's decoding would:
    /// `field` names the field in the error.
    pub fn checked(self, field: &'static str) -> Result<NameList, WireError> {
        let RequestNames { bytes, ends } = self;
        let text = match String::from_utf8(bytes) {
            // Each name is, where every name ends at a character's boundary.
            Ok(text) if ends.iter().all(|&end| text.is_char_boundary(end as usize)) => text,
            Ok(text) => return Err(first_not_utf8(field, text.as_bytes(), &ends)),
            Err(e) => return Err(first_not_utf8(field, e.as_bytes(), &ends)),
        };
        Ok(NameList { text, ends })
    }
}

/// prost's own error for a field longer than what is left of the message.
#[cold]
fn underflow() -> prost::DecodeError {
    let mut field = Vec::new();
    let five_bytes_of_none: &mut &[u8] = &mut &[5u8][..];
    encoding::bytes::merge(
        WireType::LengthDelimited,
        &mut field,
        five_bytes_of_none,
        Default::default(),
    )
    .expect_err("a length past the end")
}

/// Where each name lies in a buffer of names ending at `ends`.
fn spans(ends: &[u32]) -> impl ExactSizeIterator<Item = std::ops::Range<usize>> + Clone + '_ {
    (0..ends.len()).map(|i| {
        let start = if i == 0 { 0 } else { ends[i - 1] as usize };
        start..ends[i] as usize
    })
}

/// The first of the names in `bytes` (ending at `ends`) that is not UTF-8.
fn first_not_utf8(field: &'static str, bytes: &[u8], ends: &[u32]) -> WireError {
    match spans(ends).position(|span| std::str::from_utf8(&bytes[span]).is_err()) {
        Some(index) => WireError::NotUtf8 { field, index },
        None => WireError::Malformed("names that read as UTF-8 each and not together"),
    }
}

/// Names a request carries, in its order, each checked to be UTF-8, in
/// one buffer ([`RequestNames`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameList {
    text: String,
    ends: Vec<u32>,
}

impl NameList {
    /// No names.
    pub const fn new() -> Self {
        NameList {
            text: String::new(),
            ends: Vec::new(),
        }
    }

    /// From names given one by one (tests, and the fields read as slices).
    pub fn from_names(names: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        let mut list = NameList::default();
        for name in names {
            list.text.push_str(name.as_ref());
            list.ends
                .push(u32::try_from(list.text.len()).expect("names of less than 4 GiB"));
        }
        list
    }

    /// From a field read as a slice per name, each checked to be UTF-8 as
    /// [`RequestNames::checked`] checks them.
    pub fn from_wire(field: &'static str, names: Vec<Bytes>) -> Result<Self, WireError> {
        let mut read = RequestNames::default();
        for name in &names {
            read.bytes.extend_from_slice(name);
            let end = u32::try_from(read.bytes.len()).map_err(|_| WireError::Malformed("names too long"))?;
            read.ends.push(end);
        }
        read.checked(field)
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The names, in the request's order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + Clone + '_ {
        spans(&self.ends).map(|span| &self.text[span])
    }

    /// A hash of the names in order, keyed with `seed`: the same names in
    /// the same order hash the same, and where one name ends is part of it.
    pub fn hash(&self, seed: u64) -> u64 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        hasher.update(self.text.as_bytes());
        for end in &self.ends {
            hasher.update(&end.to_le_bytes());
        }
        hasher.digest()
    }
}

/// `Resources` from a source, with each `Resource` kept as the bytes received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawResources {
    #[prost(string, tag = "1")]
    pub system_version_info: String,
    #[prost(string, tag = "2")]
    pub collection: String,
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub resources: Vec<Bytes>,
    #[prost(string, repeated, tag = "4")]
    pub removed_resources: Vec<String>,
    #[prost(string, tag = "5")]
    pub nonce: String,
    #[prost(bool, tag = "6")]
    pub incremental: bool,
    /// Not MCP's: set only in the gateway's own `--cache-dir` files, when
    /// the collection was sensitive as it was written (a reader that
    /// would serve it as open then does not restore it). Ignored on the
    /// wire.
    #[prost(bool, tag = "1000")]
    pub persisted_sensitive: bool,
}

impl RawResources {
    /// Decodes a `Resources` message read into a buffer of its own, and
    /// relabels each resource's record in that buffer as a record of field
    /// `relabel` (where both keys are one byte; a longer key is left as it
    /// is): the frozen buffer returned holds the resources as records of
    /// that field, runs of which can be used as they are (the cache keeps
    /// them as its storage records), and the message's resources are slices
    /// of it. Every other field is decoded as `decode` would.
    pub fn decode_relabelled(mut buf: BytesMut, relabel: u32) -> Result<(Self, Bytes), prost::DecodeError> {
        use bytes::Buf;
        use prost::Message;
        const RESOURCES: u32 = 3;
        let one_byte = |field: u32| {
            u8::try_from((field << 3) | WireType::LengthDelimited as u32)
                .ok()
                .filter(|k| *k < 0x80)
        };
        let (from, to) = (one_byte(RESOURCES), one_byte(relabel));
        // Where the resources' keys are, before the buffer is frozen.
        let mut keys = Vec::new();
        let mut rest: &[u8] = &buf;
        while !rest.is_empty() {
            let at = buf.len() - rest.len();
            let (tag, wire_type) = encoding::decode_key(&mut rest)?;
            if tag == RESOURCES && wire_type == WireType::LengthDelimited && Some(buf[at]) == from {
                keys.push(at);
            }
            encoding::skip_field(wire_type, tag, &mut rest, encoding::DecodeContext::default())?;
        }
        if let Some(to) = to {
            for &at in &keys {
                buf[at] = to;
            }
        }
        let buffer = buf.freeze();
        let mut message = Self::default();
        message.resources.reserve_exact(keys.len());
        let mut rest = buffer.clone();
        let mut keys = keys.into_iter().peekable();
        while rest.has_remaining() {
            let at = buffer.len() - rest.remaining();
            let (tag, wire_type) = encoding::decode_key(&mut rest)?;
            let context = encoding::DecodeContext::default();
            if keys.next_if_eq(&at).is_some() {
                encoding::bytes::merge_repeated(wire_type, &mut message.resources, &mut rest, context)?;
            } else {
                message.merge_field(tag, wire_type, &mut rest, context)?;
            }
        }
        Ok((message, buffer))
    }
}

/// One `Resource`, decoded only as far as validation needs: the metadata, and
/// the body (`google.protobuf.Any`) as raw bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawResource {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<crate::proto::Metadata>,
    #[prost(bytes = "bytes", optional, tag = "2")]
    pub body: Option<Bytes>,
}

/// The `type_url` of a `google.protobuf.Any`, read without its value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyTypeUrl {
    #[prost(string, tag = "1")]
    pub type_url: String,
}

/// One field of a message as it is on the wire: its number, where its key
/// begins, where a length-delimited field's payload begins, and where it
/// ends (offsets into the message).
#[derive(Clone, Copy, Debug)]
pub struct WireField {
    pub number: u32,
    pub start: usize,
    pub payload: Option<usize>,
    pub end: usize,
}

/// The fields of `message` in order, read with prost's own decoding; an
/// `Err` where the bytes do not read (truncated, or a group, which no
/// message here has), after which nothing more is read.
pub fn wire_fields(message: &[u8]) -> impl Iterator<Item = Result<WireField, ()>> + '_ {
    let mut rest = message;
    let mut failed = false;
    std::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        let start = message.len() - rest.len();
        let field = (|| {
            let (number, wire_type) = encoding::decode_key(&mut rest).map_err(drop)?;
            let skip = |rest: &mut &[u8], len: usize| -> Result<(), ()> {
                *rest = rest.get(len..).ok_or(())?;
                Ok(())
            };
            let payload = match wire_type {
                WireType::Varint => encoding::decode_varint(&mut rest).map(|_| None).map_err(drop)?,
                WireType::SixtyFourBit => skip(&mut rest, 8).map(|()| None)?,
                WireType::ThirtyTwoBit => skip(&mut rest, 4).map(|()| None)?,
                WireType::LengthDelimited => {
                    let len = usize::try_from(encoding::decode_varint(&mut rest).map_err(drop)?).map_err(drop)?;
                    let at = message.len() - rest.len();
                    skip(&mut rest, len)?;
                    Some(at)
                }
                WireType::StartGroup | WireType::EndGroup => return Err(()),
            };
            Ok(WireField {
                number,
                start,
                payload,
                end: message.len() - rest.len(),
            })
        })();
        failed = field.is_err();
        Some(field)
    })
}

/// A `google.protobuf.Any` whose value is a slice of the message it was
/// read from, not a copy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyBytes {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: bytes::Bytes,
}

/// A TypedStruct (`xds.type.v3` or `udpa.type.v1`): the type it names and
/// the Struct Envoy reads as that type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypedStructView {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<prost_types::Struct>,
}

/// A wrapper of one resource that clients unwrap by themselves: xDS's
/// `envoy.service.discovery.v3.Resource` and v2's `envoy.api.v2.Resource`
/// (`resource`, field 2), MCP's `Resource` (`body`, field 2): the `Any` it
/// wraps, the rest skipped.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WrappedResourceView {
    #[prost(message, optional, tag = "2")]
    pub resource: Option<prost_types::Any>,
}

/// The body's type URL of an MCP `Resource` (`body`, field 2), read
/// without its metadata or the body's value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceBodyTypeUrl {
    #[prost(message, optional, tag = "2")]
    pub body: Option<AnyTypeUrl>,
}

/// The type URL of the body of an encoded `Resource` (its `Any`'s): the
/// cache does not keep it beside the bytes (16 bytes and a malloc size
/// class per resource for what only a debug view reads). `None` for bytes
/// that do not decode (a source's resources were checked when they entered).
pub fn resource_body_type_url(encoded: &bytes::Bytes) -> Option<String> {
    <ResourceBodyTypeUrl as prost::Message>::decode(encoded.clone())
        .ok()?
        .body
        .map(|any| any.type_url)
}

/// Resources as a source sends them, for the unit tests of other rooms.
#[cfg(test)]
pub mod test_support {
    use bytes::Bytes;
    use prost::Message;

    /// An encoded `Resource{metadata{name, version}, body: Any(x.Y, body)}`.
    pub fn encoded_resource(name: &str, version: &str, body: &[u8]) -> Bytes {
        crate::proto::Resource {
            metadata: Some(crate::proto::Metadata {
                name: name.into(),
                version: version.into(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: "type.googleapis.com/x.Y".into(),
                value: body.to_vec(),
            }),
        }
        .encode_to_vec()
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// An ACK's names are read into one buffer (Envoy repeats its 50 EDS
    /// names on every ACK), in order, each checked to be UTF-8; the request
    /// reads back as the generated message wrote it; the other fields are
    /// prost's.
    #[test]
    fn request_names_are_read_into_one_buffer_checked_to_be_utf8() {
        let request = crate::proto::envoy::service::discovery::v3::DiscoveryRequest {
            version_info: "v1".into(),
            resource_names: vec!["cluster-000001".into(), "".into(), "ns/ü".into()],
            type_url: "t".into(),
            response_nonce: "n".into(),
            error_detail: Some(tonic_types::Status {
                code: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let buffer = Bytes::from(request.encode_to_vec());
        let read = XdsRequest::decode(buffer.clone()).unwrap();
        assert_eq!(
            (&*read.version_info, &*read.type_url, &*read.response_nonce),
            ("v1", "t", "n")
        );
        assert!(read.error_detail.is_some());
        assert_eq!(
            read.encode_to_vec(),
            buffer,
            "written back as the generated message writes it"
        );
        assert_eq!(read.encoded_len(), buffer.len());
        let names = read.resource_names.checked("resource_names").unwrap();
        assert_eq!(names.iter().collect::<Vec<_>>(), ["cluster-000001", "", "ns/ü"]);
        assert_eq!(names, NameList::from_names(["cluster-000001", "", "ns/ü"]));

        // A name that is not UTF-8, alone or only across two names.
        let bad = |names: &[&[u8]]| {
            let mut wire = Vec::new();
            for name in names {
                encoding::bytes::encode(3, &name.to_vec(), &mut wire);
            }
            let read = XdsRequest::decode(wire.as_slice()).unwrap();
            read.resource_names.checked("resource_names").unwrap_err().to_string()
        };
        assert_eq!(bad(&[b"ok", b"\xc3"]), "resource_names[1] is not UTF-8");
        assert_eq!(bad(&[b"ok\xc3", b"\xbc"]), "resource_names[0] is not UTF-8");
        assert_eq!(
            NameList::from_wire("x", vec![Bytes::from_static(b"a"), Bytes::from_static(b"\xff")])
                .unwrap_err()
                .to_string(),
            "x[1] is not UTF-8"
        );
        // The same names in the same order hash the same; where one ends counts.
        let hash = |names: &[&str]| NameList::from_names(names.iter().copied()).hash(7);
        assert_eq!(hash(&["a", "bc"]), hash(&["a", "bc"]));
        assert_ne!(hash(&["a", "bc"]), hash(&["ab", "c"]));
        assert_ne!(hash(&["a", "bc"]), hash(&["bc", "a"]));
    }

    #[test]
    fn node_labels_read_from_every_kind_of_node() {
        // Istio 1.1: a SinkNode with annotations.
        let sink = crate::proto::SinkNode {
            id: "canary-1".into(),
            annotations: [("track".to_owned(), "canary".to_owned())].into(),
        };
        let node = NodeId::decode(sink.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            node.into_parts(),
            ("canary-1".into(), vec![("track".into(), "canary".into())])
        );
        // Istio 1.0: a Client with a Struct of metadata.
        let string = |text: &str| prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(text.into())),
        };
        let metadata = prost_types::Struct {
            fields: [
                ("track".to_owned(), string("canary")),
                (
                    "count".to_owned(),
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::NumberValue(1.0)),
                    },
                ),
            ]
            .into(),
        };
        let mut client = Vec::new();
        prost::encoding::string::encode(1, &"pilot-0".to_owned(), &mut client);
        prost::encoding::message::encode(2, &metadata, &mut client);
        let node = NodeId::decode(client.as_slice()).unwrap();
        assert_eq!(
            node.into_parts(),
            ("pilot-0".into(), vec![("track".into(), "canary".into())])
        );
        // Anything else in field 2 is skipped, never an error.
        let mut odd = Vec::new();
        prost::encoding::bytes::encode(2, &vec![0xff, 0xfe, 0x01], &mut odd);
        let node = NodeId::decode(odd.as_slice()).unwrap();
        assert_eq!(node.into_parts(), (String::new(), vec![]));
        // Envoy's v3 Node: metadata strings, the cluster (field 2) ignored.
        let mut envoy = Vec::new();
        prost::encoding::string::encode(1, &"istiod-1".to_owned(), &mut envoy);
        prost::encoding::string::encode(2, &"cluster".to_owned(), &mut envoy);
        prost::encoding::message::encode(3, &metadata, &mut envoy);
        let node = XdsNode::decode(envoy.as_slice()).unwrap();
        assert_eq!(
            node.into_parts(),
            ("istiod-1".into(), vec![("track".into(), "canary".into())])
        );
    }

    #[test]
    fn nack_messages_are_read_up_to_the_limit_without_copying_the_rest() {
        let status = tonic_types::Status {
            code: 3,
            message: format!("{}tail", "é".repeat(10)),
            details: vec![prost_types::Any {
                type_url: "x".into(),
                value: vec![1; 100],
            }],
        };
        let bytes = Bytes::from(status.encode_to_vec());
        let detail = ErrorDetail::parse(bytes.clone(), 5).unwrap();
        assert_eq!(detail.code, 3);
        assert_eq!(detail.message, "éé", "cut at a character boundary");
        assert_eq!(detail.message_len, 24);
        let whole = ErrorDetail::parse(bytes, 1000).unwrap();
        assert_eq!(whole.message, status.message);
        assert!(ErrorDetail::parse(Bytes::from_static(b"\x12\xff\x01"), 10).is_err());
    }

    #[test]
    fn initial_versions_are_read_as_entries() {
        let request = crate::proto::IncrementalMeshConfigRequest {
            initial_resource_versions: [("ns/a".to_owned(), "1".to_owned()), ("ns/b".to_owned(), "".to_owned())].into(),
            ..Default::default()
        };
        let view = IncrementalRequest::decode(Bytes::from(request.encode_to_vec())).unwrap();
        let mut entries: Vec<(&str, &str)> = view
            .initial_resource_versions
            .iter()
            .map(|e| version_entry(e).unwrap())
            .collect();
        entries.sort();
        assert_eq!(entries, [("ns/a", "1"), ("ns/b", "")]);
        assert!(version_entry(b"\x0a\x05ab").is_err());
    }

    #[test]
    fn v1_0_client_metadata_is_skipped_not_rejected() {
        // Client{id=1, metadata=2 Struct{fields: {"k": Value{string_value: "v"}}}}
        #[derive(Clone, PartialEq, prost::Message)]
        struct Client {
            #[prost(string, tag = "1")]
            id: String,
            #[prost(message, optional, tag = "2")]
            metadata: Option<prost_types::Struct>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct V10Request {
            #[prost(message, optional, tag = "2")]
            client: Option<Client>,
            #[prost(string, tag = "3")]
            type_url: String,
        }
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(
            "k".to_string(),
            prost_types::Value {
                // 1.5 as f64 has the byte 0xF8: not UTF-8 when read as a string.
                kind: Some(prost_types::value::Kind::NumberValue(1.5)),
            },
        );
        let bytes = V10Request {
            client: Some(Client {
                id: "pilot-1".into(),
                metadata: Some(prost_types::Struct { fields }),
            }),
            type_url: "t".into(),
        }
        .encode_to_vec();
        let request = SotwRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(request.node.unwrap().id, "pilot-1");
        assert_eq!(request.type_url, "t");
        // The strict SinkNode view would read the Struct as a string map.
        assert!(crate::proto::MeshConfigRequest::decode(bytes.as_slice()).is_err());
    }

    proptest::proptest! {
        /// A `Resources` message decoded with its resources relabelled is
        /// the message prost decodes, its resources slices of the returned
        /// buffer, each now a record of the new field, whatever order the
        /// fields come in.
        #[test]
        fn relabelled_resources_decode_as_the_message_and_lie_in_the_buffer(
            collection in "[a-z/]{0,12}",
            resources in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..40), 0..20),
            removed in proptest::collection::vec("[a-z]{1,5}", 0..3),
            nonce in "[0-9]{0,4}",
            incremental in proptest::bool::ANY,
            collection_last in proptest::bool::ANY,
        ) {
            let mut buf = BytesMut::new();
            let fields = RawResources {
                system_version_info: "v".into(),
                collection: if collection_last { String::new() } else { collection.clone() },
                resources: resources.iter().map(|r| Bytes::from(r.clone())).collect(),
                removed_resources: removed,
                nonce,
                incremental,
                persisted_sensitive: false,
            };
            fields.encode(&mut buf).unwrap();
            if collection_last && !collection.is_empty() {
                prost::encoding::string::encode(2, &collection, &mut buf);
            }
            let expected = RawResources::decode(buf.clone().freeze()).unwrap();
            let (decoded, buffer) = RawResources::decode_relabelled(buf, 2).unwrap();
            proptest::prop_assert_eq!(&decoded, &expected);
            let base = buffer.as_ptr() as usize;
            for resource in &decoded.resources {
                let at = resource.as_ptr() as usize - base;
                let header = 1 + prost::encoding::encoded_len_varint(resource.len() as u64);
                proptest::prop_assert!(at >= header && at + resource.len() <= buffer.len());
                proptest::prop_assert_eq!(buffer[at - header], 0x12, "a record of field 2");
            }
        }
    }
}
