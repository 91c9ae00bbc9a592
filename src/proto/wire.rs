//! The gateway's own views of MCP messages on the wire.
//!
//! They carry the same field numbers as the proto but decode leniently (field 2
//! of `MeshConfigRequest` is read for its `id` only, whichever dialect sent it)
//! and keep bytes untouched: upstream resources stay the exact bytes Galley
//! sent, and a NACK's message or a client's `initial_resource_versions` are
//! slices of the request, read without copying. (Responses are encoded by
//! each downstream protocol: `downstream/encode.rs`.)

use bytes::{Bytes, BytesMut};
use bytestring::ByteString;
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

/// A received message read as a [`bytes::Buf`]: its keys, varints and
/// strings from a plain slice, and each `bytes` field a share of the
/// message's buffer (as reading the `Bytes` itself gives), not a copy.
///
/// prost's decoding is generic over the buffer: over `Bytes` each step
/// (`chunk`, `advance`) goes through `Bytes`' own bookkeeping and its varint
/// reads are calls of their own; over a slice they are a pointer's
/// arithmetic, inlined. An Envoy's state-of-the-world ACK (50 names, 850
/// bytes) took 8,700 instructions to decode over `Bytes` and 7,200 over
/// this (BENCHMARKS, session 32).
pub struct MessageBuf<'a> {
    whole: &'a Bytes,
    rest: &'a [u8],
}

impl<'a> MessageBuf<'a> {
    /// All of `whole`, from its start.
    pub fn new(whole: &'a Bytes) -> Self {
        Self { whole, rest: whole }
    }
}

impl bytes::Buf for MessageBuf<'_> {
    #[inline]
    fn remaining(&self) -> usize {
        self.rest.len()
    }

    #[inline]
    fn chunk(&self) -> &[u8] {
        self.rest
    }

    #[inline]
    fn advance(&mut self, cnt: usize) {
        self.rest = &self.rest[cnt..];
    }

    /// A share of the message's buffer: a `bytes` field is not copied. Cut
    /// by its offset in the whole (`slice_ref` would find it again from
    /// the pointers, with its checks).
    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        let at = self.whole.len() - self.rest.len();
        self.rest = &self.rest[len..];
        self.whole.slice(at..at + len)
    }
}

/// prost's decoding of a message received whole, through [`MessageBuf`].
pub fn decode_shared<M: prost::Message + Default>(whole: &Bytes) -> Result<M, prost::DecodeError> {
    M::decode(MessageBuf::new(whole))
}

/// Envoy's v3 `DiscoveryRequest` (state of the world) as the gateway reads
/// it. `Node.id` is field 1, as in MCP's nodes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct XdsRequest {
    /// Its strings shares of the request's buffer where it is read whole
    /// (`read_shared`), not a copy each: an ACK of every response carries
    /// three of them.
    pub version_info: ByteString,
    pub node: Option<XdsNode>,
    /// Read into one buffer, not a `String` or a slice each: a client
    /// repeats its names on every ACK (Envoy's EDS: 50). Checked to be
    /// UTF-8 when read ([`RequestNames::checked`]).
    pub resource_names: RequestNames,
    pub type_url: ByteString,
    pub response_nonce: ByteString,
    /// As in [`SotwRequest::error_detail`].
    pub error_detail: Option<Bytes>,
}

/// By hand for `resource_names` (field 3); the rest as the derive writes it.
impl prost::Message for XdsRequest {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        encode_shared_string(1, &self.version_info, buf);
        if let Some(node) = &self.node {
            encoding::message::encode(2, node, buf);
        }
        self.resource_names.encode(3, buf);
        encode_shared_string(4, &self.type_url, buf);
        encode_shared_string(5, &self.response_nonce, buf);
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
            1 => merge_shared_string(wire_type, &mut self.version_info, buf, ctx),
            2 => encoding::message::merge(wire_type, self.node.get_or_insert_with(Default::default), buf, ctx),
            3 => self.resource_names.merge(wire_type, buf),
            4 => merge_shared_string(wire_type, &mut self.type_url, buf, ctx),
            5 => merge_shared_string(wire_type, &mut self.response_nonce, buf, ctx),
            6 => encoding::bytes::merge(wire_type, self.error_detail.get_or_insert_with(Bytes::new), buf, ctx),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let string = |tag, s: &ByteString| {
            if s.is_empty() {
                0
            } else {
                encoding::bytes::encoded_len(tag, s.as_bytes())
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

/// A proto3 string field held as a [`ByteString`], as prost writes a
/// `String`'s (an empty one omitted).
fn encode_shared_string(tag: u32, value: &ByteString, buf: &mut impl bytes::BufMut) {
    if !value.is_empty() {
        encoding::bytes::encode(tag, value.as_bytes(), buf);
    }
}

/// Reads a string field as prost reads a `String` (the same errors), into
/// a [`ByteString`]: from a [`MessageBuf`], a share of the message's
/// buffer, not a copy.
fn merge_shared_string(
    wire_type: WireType,
    value: &mut ByteString,
    buf: &mut impl bytes::Buf,
    ctx: encoding::DecodeContext,
) -> Result<(), prost::DecodeError> {
    // As prost's `bytes::merge` reads a field (its checks and errors, in
    // its order), without its generic step through a second `Buf`: a
    // request's version, type and nonce on every ACK.
    encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
    let len = encoding::decode_varint(buf)?;
    if len > buf.remaining() as u64 {
        return Err(underflow());
    }
    match ByteString::try_from(buf.copy_to_bytes(len as usize)) {
        Ok(read) => {
            *value = read;
            Ok(())
        }
        Err(_) => {
            *value = ByteString::new();
            // prost's own error for a string that is not UTF-8.
            let mut scratch = String::new();
            let not_utf8: &mut &[u8] = &mut &[1u8, 0xff][..];
            encoding::string::merge(WireType::LengthDelimited, &mut scratch, not_utf8, ctx)
                .and_then(|()| Err(underflow()))
        }
    }
}

impl XdsRequest {
    /// Reads a request received whole (`whole`, shared), as prost's
    /// decoding reads it, with the names' records, where they come one
    /// after another (each with a one-byte key, as every encoder writes
    /// them), kept as they came ([`RequestNames`]) rather than read name
    /// by name. Errors are prost's, word for word.
    pub fn read_shared(whole: &Bytes) -> Result<Self, prost::DecodeError> {
        let mut request = XdsRequest::default();
        let mut buf = MessageBuf::new(whole);
        let at = |buf: &MessageBuf<'_>| whole.len() - bytes::Buf::remaining(buf);
        // Where the run of names' records is in `whole`.
        let mut run: Option<std::ops::Range<usize>> = None;
        while bytes::Buf::has_remaining(&buf) {
            let start = at(&buf);
            let (tag, wire_type) = encoding::decode_key(&mut buf)?;
            let one_byte_key = at(&buf) == start + 1;
            if tag == NAMES_FIELD && wire_type == WireType::LengthDelimited && one_byte_key {
                let len = encoding::decode_varint(&mut buf)?;
                if len > bytes::Buf::remaining(&buf) as u64 {
                    return Err(underflow());
                }
                bytes::Buf::advance(&mut buf, len as usize);
                // The records that follow, each a one-byte key of field 3
                // and a one-byte length (as every name of fewer than 128
                // bytes is written), in one tight loop: what the loop
                // above would read of them, a record at a time.
                while let [NAMES_KEY, len, ..] = *bytes::Buf::chunk(&buf) {
                    let record = 2 + usize::from(len);
                    if len >= 0x80 || record > bytes::Buf::remaining(&buf) {
                        break;
                    }
                    bytes::Buf::advance(&mut buf, record);
                }
                let end = at(&buf);
                match &mut run {
                    Some(names) if names.end == start => names.end = end,
                    None if request.resource_names.ends.is_empty() => run = Some(start..end),
                    // Names before other fields and after them: read one
                    // by one, in order, from here.
                    _ => {
                        if let Some(names) = run.take() {
                            request.resource_names.read_records(&whole[names]);
                        }
                        request.resource_names.read_records(&whole[start..end]);
                    }
                }
                continue;
            }
            if tag == NAMES_FIELD {
                if let Some(names) = run.take() {
                    request.resource_names.read_records(&whole[names]);
                }
            }
            prost::Message::merge_field(
                &mut request,
                tag,
                wire_type,
                &mut buf,
                encoding::DecodeContext::default(),
            )?;
        }
        if let Some(names) = run {
            request.resource_names.run = whole.slice(names);
        }
        Ok(request)
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
///
/// A request read whole ([`XdsRequest::read_shared`]) whose names' records
/// come one after another, as every client writes them, keeps those
/// records as they came (`run`, a share of the request) instead: an ACK
/// repeats the names the stream already holds, and is then only hashed
/// ([`Self::hash`]), never read name by name (BENCHMARKS, session 32).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestNames {
    bytes: Vec<u8>,
    /// Where each name ends in `bytes`.
    ends: Vec<u32>,
    /// Or the names as records of one key byte, a length and the name, one
    /// after another, as the request carried them (then `bytes` and `ends`
    /// are empty).
    run: Bytes,
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
        self.read_run();
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
        self.end_name()
    }

    /// The name just put in `bytes` ends there.
    fn end_name(&mut self) -> Result<(), prost::DecodeError> {
        // More than 4 GiB of names: more than any request may be.
        self.ends
            .push(u32::try_from(self.bytes.len()).map_err(|_| underflow())?);
        Ok(())
    }

    /// The names of `run`, if any, read into `bytes` ([`Self::read_records`]).
    fn read_run(&mut self) {
        if !self.run.is_empty() {
            let run = std::mem::take(&mut self.run);
            self.read_records(&run);
        }
    }

    /// The names of `records` (read and checked by the reader that found
    /// them: one key byte, a length, the name) read into `bytes`, after
    /// those already there.
    fn read_records(&mut self, records_of: &[u8]) {
        self.bytes.reserve(records_of.len());
        for name in records(records_of) {
            self.bytes.extend_from_slice(name);
            self.end_name().expect("records within a request of less than 4 GiB");
        }
    }

    /// The names, in order, however they were read.
    fn names(&self) -> impl Iterator<Item = &[u8]> + '_ {
        records(&self.run).chain(spans(&self.ends).map(|span| &self.bytes[span]))
    }

    fn encode(&self, tag: u32, buf: &mut impl bytes::BufMut) {
        for name in self.names() {
            encoding::encode_key(tag, WireType::LengthDelimited, buf);
            encoding::encode_varint(name.len() as u64, buf);
            buf.put_slice(name);
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        self.names()
            .map(|name| encoding::key_len(tag) + encoding::encoded_len_varint(name.len() as u64) + name.len())
            .sum()
    }

    /// A hash of the names keyed with `seed`, as [`NameList::hash`] makes
    /// it: the same names, in the same order, read as they came or one by
    /// one, hash the same (where the request wrote each length in as few
    /// bytes as it takes, as every encoder does; otherwise only differently,
    /// never the same for other names). Not checked to be UTF-8.
    pub fn hash(&self, seed: u64) -> u64 {
        if self.run.is_empty() {
            records_hash(self.names(), seed)
        } else {
            xxhash_rust::xxh3::xxh3_64_with_seed(&self.run, seed)
        }
    }

    /// Each name checked to be UTF-8, as a `string` field's decoding would:
    /// `field` names the field in the error.
    pub fn checked(mut self, field: &'static str) -> Result<NameList, WireError> {
        self.read_run();
        let RequestNames { bytes, ends, .. } = self;
        let text = match String::from_utf8(bytes) {
            // Each name is, where every name ends at a character's boundary.
            Ok(text) if ends.iter().all(|&end| text.is_char_boundary(end as usize)) => text,
            Ok(text) => return Err(first_not_utf8(field, text.as_bytes(), &ends)),
            Err(e) => return Err(first_not_utf8(field, e.as_bytes(), &ends)),
        };
        Ok(NameList { text, ends })
    }
}

/// The names of a run of records, each one key byte, a length and the
/// name, as [`XdsRequest::read_shared`] checked them.
fn records(mut run: &[u8]) -> impl Iterator<Item = &[u8]> + '_ {
    std::iter::from_fn(move || {
        let (_key, rest) = run.split_first()?;
        let mut rest = rest;
        let len = encoding::decode_varint(&mut rest).expect("a run's records were read whole") as usize;
        let (name, after) = rest.split_at(len);
        run = after;
        Some(name)
    })
}

/// The field of a state-of-the-world request's names
/// (`resource_names`): the records [`records_hash`] hashes are of it.
const NAMES_FIELD: u32 = 3;

/// The one-byte key of a [`NAMES_FIELD`] record: the field, length-delimited.
const NAMES_KEY: u8 = (NAMES_FIELD << 3) as u8 | WireType::LengthDelimited as u8;

/// A keyed hash of `names` as a state-of-the-world request carries them:
/// a record of [`NAMES_FIELD`] each (its key, its length in as few bytes as
/// it takes, the name), one after another. The records are gathered on the
/// stack and hashed a block at a time (the streaming hash gives what one
/// pass over them gives), with nothing allocated: a stream hashes its
/// names whenever they change, 2,000 at once at a fleet's first requests.
fn records_hash<'a>(names: impl Iterator<Item = &'a [u8]>, seed: u64) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    let mut block = [0u8; 512];
    let mut filled = 0;
    let mut put = |bytes: &[u8], hasher: &mut xxhash_rust::xxh3::Xxh3| {
        if filled + bytes.len() > block.len() {
            hasher.update(&block[..filled]);
            filled = 0;
        }
        if bytes.len() > block.len() {
            hasher.update(bytes);
        } else {
            block[filled..filled + bytes.len()].copy_from_slice(bytes);
            filled += bytes.len();
        }
    };
    for name in names {
        let mut head = [NAMES_KEY; 11];
        let mut length = &mut head[1..];
        encoding::encode_varint(name.len() as u64, &mut length);
        let head_len = 11 - length.len();
        put(&head[..head_len], &mut hasher);
        put(name, &mut hasher);
    }
    hasher.update(&block[..filled]);
    hasher.digest()
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
    /// It is the hash of the names as a state-of-the-world request carries
    /// them (their records of `resource_names`), so a request's names
    /// hash the same before they are read ([`RequestNames::hash`]).
    pub fn hash(&self, seed: u64) -> u64 {
        records_hash(self.iter().map(str::as_bytes), seed)
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

/// The fields of `message` in order, read as prost's own decoding reads
/// them; an `Err` where the bytes do not read (truncated, or a group, which
/// no message here has), after which nothing more is read.
pub fn wire_fields(message: &[u8]) -> impl Iterator<Item = Result<WireField, ()>> + '_ {
    let mut at = 0;
    let mut failed = false;
    std::iter::from_fn(move || {
        if at >= message.len() || failed {
            return None;
        }
        let field = read_field(message, at);
        match &field {
            Ok(field) => at = field.end,
            Err(()) => failed = true,
        }
        Some(field)
    })
}

/// The field of `message` that begins at `start`. A key of one byte and a
/// varint or length of one or two bytes (nearly every field of a resource:
/// every endpoint of a `ClusterLoadAssignment` is a few of them, a stored
/// body's length two bytes) are read here; anything else by prost's
/// decoding, as before. Through prost's `Buf` reads each field was about 65
/// instructions (a walk of each changed resource for what the views hide
/// at ingestion, and each response's stored records: ~800 instructions a
/// response of eds; BENCHMARKS, session 40).
#[inline]
fn read_field(message: &[u8], start: usize) -> Result<WireField, ()> {
    let rest = &message[start..];
    // Field 1 and up (a key of 8 and up), under 16: a key of one byte.
    if let [key @ 8..0x80, ..] = *rest {
        // A varint (or length) of one or two bytes, and where it ends.
        let varint = match rest[1..] {
            [low @ 0..0x80, ..] => Some((u64::from(low), 2)),
            [low, high @ 0..0x80, ..] => Some((u64::from(low & 0x7f) | u64::from(high) << 7, 3)),
            _ => None,
        };
        let number = u32::from(key >> 3);
        match (key & 0x07, varint) {
            (0, Some((_, read))) => {
                return Ok(WireField {
                    number,
                    start,
                    payload: None,
                    end: start + read,
                })
            }
            (2, Some((len, read))) => {
                let payload = start + read;
                let end = payload + len as usize;
                return match end <= message.len() {
                    true => Ok(WireField {
                        number,
                        start,
                        payload: Some(payload),
                        end,
                    }),
                    false => Err(()),
                };
            }
            _ => {}
        }
    }
    read_field_by_prost(message, start)
}

/// [`read_field`] by prost's decoding of keys and varints.
fn read_field_by_prost(message: &[u8], start: usize) -> Result<WireField, ()> {
    let mut rest = &message[start..];
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
    /// A message's fields read with the one-byte fast path are those
    /// prost's decoding reads, field by field, to the first that does not
    /// read: over arbitrary bytes, and over messages of one-byte and
    /// longer keys, varints and lengths.
    #[test]
    fn fields_read_fast_are_those_prost_reads() {
        let by_prost = |message: &[u8]| -> Vec<Result<(u32, usize, Option<usize>, usize), ()>> {
            let mut fields = Vec::new();
            let mut at = 0;
            while at < message.len() {
                match read_field_by_prost(message, at) {
                    Ok(f) => {
                        fields.push(Ok((f.number, f.start, f.payload, f.end)));
                        at = f.end;
                    }
                    Err(()) => {
                        fields.push(Err(()));
                        break;
                    }
                }
            }
            fields
        };
        let fast = |message: &[u8]| -> Vec<Result<(u32, usize, Option<usize>, usize), ()>> {
            wire_fields(message)
                .map(|f| f.map(|f| (f.number, f.start, f.payload, f.end)))
                .collect()
        };
        let field = proptest::prop_oneof![
            // A varint field, its number and value of one byte or more.
            (1u32..40, proptest::prelude::any::<u64>()).prop_map(|(n, v)| {
                let mut b = Vec::new();
                encoding::encode_key(n, WireType::Varint, &mut b);
                encoding::encode_varint(v, &mut b);
                b
            }),
            // A length-delimited field, some of its payload cut off.
            (1u32..40, 0usize..300, 0usize..4).prop_map(|(n, len, cut)| {
                let mut b = Vec::new();
                encoding::encode_key(n, WireType::LengthDelimited, &mut b);
                encoding::encode_varint(len as u64, &mut b);
                b.extend(std::iter::repeat_n(7u8, len.saturating_sub(cut)));
                b
            }),
            proptest::collection::vec(proptest::prelude::any::<u8>(), 0..6),
        ];
        use proptest::prelude::Strategy;
        proptest::proptest!(proptest::test_runner::Config::with_cases(512), |(
            fields in proptest::collection::vec(field, 0..12),
        )| {
            let message: Vec<u8> = fields.concat();
            proptest::prop_assert_eq!(fast(&message), by_prost(&message));
        });
    }

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
        // The hash of the names as a request's records of field 3.
        for count in [0, 1, 64, 130] {
            let mut names: Vec<String> = (0..count).map(|i| format!("cluster-{i}")).collect();
            // A name longer than the block the records are gathered in.
            names.insert(names.len() / 2, "y".repeat(700));
            let mut records = Vec::new();
            for name in &names {
                encoding::string::encode(3, name, &mut records);
            }
            let expected = xxhash_rust::xxh3::xxh3_64_with_seed(&records, 7);
            assert_eq!(NameList::from_names(&names).hash(7), expected, "{count} names");
        }
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

    /// Whether `field` lies within `whole`'s buffer (a share, not a copy).
    fn lies_in(field: &Bytes, whole: &Bytes) -> bool {
        let (start, end) = (whole.as_ptr() as usize, whole.as_ptr() as usize + whole.len());
        let at = field.as_ptr() as usize;
        !field.is_empty() && at >= start && at + field.len() <= end
    }

    /// `request` with its names read one by one, as prost reads them.
    fn read_names(mut request: XdsRequest) -> XdsRequest {
        request.resource_names.read_run();
        request
    }

    /// An ACK's names, one record after another as every client writes
    /// them, are kept as those records, a share of the request, and hash as
    /// the names read one by one do; they read as prost reads them.
    #[test]
    fn an_acks_names_are_kept_as_they_came_and_hash_as_read() {
        let names: Vec<String> = (0..50).map(|i| format!("cluster-{:05}", i * 197)).collect();
        let request = XdsRequest {
            version_info: "c7f3".into(),
            resource_names: RequestNames {
                bytes: names.concat().into_bytes(),
                ends: names
                    .iter()
                    .scan(0, |end, name| {
                        *end += name.len() as u32;
                        Some(*end)
                    })
                    .collect(),
                run: Bytes::new(),
            },
            type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
            response_nonce: "17".into(),
            ..Default::default()
        };
        let whole = Bytes::from(request.encode_to_vec());
        let read = XdsRequest::read_shared(&whole).unwrap();
        assert!(read.resource_names.ends.is_empty(), "not read name by name");
        assert!(lies_in(&read.resource_names.run, &whole));
        // Its strings too are shares of the request, not copies.
        for string in [&read.version_info, &read.type_url, &read.response_nonce] {
            assert!(lies_in(string.as_bytes(), &whole), "{string}");
        }
        let list = NameList::from_names(&names);
        assert_eq!(read.resource_names.hash(7), list.hash(7));
        assert_ne!(read.resource_names.hash(8), list.hash(7), "keyed");
        assert_eq!(read.resource_names.clone().checked("n").unwrap(), list);
        assert_eq!(read_names(read), XdsRequest::decode(whole.clone()).unwrap());

        // A name of 128 bytes or more (its length in two bytes) among
        // short ones: still one run, read as prost reads it.
        let long = "x".repeat(200);
        let mixed = ["a", long.as_str(), "b", "c"];
        let mut records = BytesMut::new();
        for name in mixed {
            encoding::string::encode(3, &name.to_owned(), &mut records);
        }
        encoding::string::encode(5, &"9".to_owned(), &mut records);
        let whole = records.freeze();
        let read = XdsRequest::read_shared(&whole).unwrap();
        assert!(read.resource_names.ends.is_empty(), "one run");
        assert_eq!(read.resource_names.hash(7), NameList::from_names(mixed).hash(7));
        assert_eq!(read_names(read), XdsRequest::decode(whole.clone()).unwrap());

        // Names among other fields: read one by one, in order.
        let mut split = BytesMut::new();
        encoding::string::encode(3, &"a".to_owned(), &mut split);
        encoding::string::encode(4, &"t".to_owned(), &mut split);
        encoding::string::encode(3, &"b".to_owned(), &mut split);
        encoding::string::encode(3, &"c".to_owned(), &mut split);
        let whole = split.freeze();
        let read = XdsRequest::read_shared(&whole).unwrap();
        assert!(read.resource_names.run.is_empty());
        assert_eq!(
            read.resource_names.clone().checked("n").unwrap(),
            NameList::from_names(["a", "b", "c"])
        );
        assert_eq!(
            read.resource_names.hash(7),
            NameList::from_names(["a", "b", "c"]).hash(7)
        );
    }

    /// A request read through [`MessageBuf`] is the request prost reads from
    /// the `Bytes`, and its `bytes` fields are shares of the message, as
    /// they are when read from the `Bytes`: a NACK's detail is not copied.
    #[test]
    fn a_message_read_through_message_buf_shares_its_bytes_fields() {
        let detail = tonic_types::Status {
            code: 3,
            message: "bad cluster".into(),
            details: vec![],
        }
        .encode_to_vec();
        let mut request = BytesMut::new();
        encoding::string::encode(1, &"v1".to_owned(), &mut request);
        for name in ["a", "bé"] {
            encoding::string::encode(3, &name.to_owned(), &mut request);
        }
        encoding::string::encode(4, &"t".to_owned(), &mut request);
        encoding::string::encode(5, &"7".to_owned(), &mut request);
        encoding::bytes::encode(6, &detail, &mut request);
        // A field it does not know, skipped.
        encoding::uint64::encode(99, &5, &mut request);
        let whole = request.freeze();
        let read = XdsRequest::decode(MessageBuf::new(&whole)).unwrap();
        assert_eq!(read, XdsRequest::decode(whole.clone()).unwrap());
        assert_eq!(read.type_url, "t");
        let shared = read.error_detail.expect("a detail");
        assert_eq!(&shared[..], &detail[..]);
        assert!(lies_in(&shared, &whole), "the detail is a share of the message");

        let delta = DeltaXdsRequest {
            type_url: "t".into(),
            resource_names_subscribe: vec![Bytes::from_static(b"x")],
            initial_resource_versions: vec![Bytes::from_static(b"\x0a\x01a\x12\x011")],
            ..Default::default()
        }
        .encode_to_vec();
        let whole = Bytes::from(delta);
        let read = DeltaXdsRequest::decode(MessageBuf::new(&whole)).unwrap();
        assert_eq!(read, DeltaXdsRequest::decode(whole.clone()).unwrap());
        assert!(read.resource_names_subscribe.iter().all(|n| lies_in(n, &whole)));
        assert!(read.initial_resource_versions.iter().all(|e| lies_in(e, &whole)));
    }

    /// `XdsRequest` as prost's derive reads it, its strings `String`s (and
    /// its names bytes: `XdsRequest` checks them after, not as it reads).
    #[derive(Clone, PartialEq, prost::Message)]
    struct StringsXdsRequest {
        #[prost(string, tag = "1")]
        version_info: String,
        #[prost(message, optional, tag = "2")]
        node: Option<XdsNode>,
        #[prost(bytes = "vec", repeated, tag = "3")]
        resource_names: Vec<Vec<u8>>,
        #[prost(string, tag = "4")]
        type_url: String,
        #[prost(string, tag = "5")]
        response_nonce: String,
        #[prost(bytes = "bytes", optional, tag = "6")]
        error_detail: Option<Bytes>,
    }

    proptest::proptest! {
        /// Any bytes read through [`MessageBuf`] decode as they do from
        /// `Bytes`: the same request, or an error with the same words.
        #[test]
        fn any_bytes_decode_through_message_buf_as_from_bytes(
            fields in proptest::collection::vec(
                (1u32..9, 0u8..4, proptest::collection::vec(proptest::num::u8::ANY, 0..24)),
                0..12,
            ),
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..8),
        ) {
            // Fields of every wire type at the requests' field numbers, their
            // contents anything (often a field of another type, or a
            // message that is not one), then bytes that may cut it short.
            let mut buf = BytesMut::new();
            for (tag, kind, payload) in &fields {
                let word = payload.iter().fold(0u64, |w, b| w.rotate_left(8) ^ u64::from(*b));
                match kind {
                    0 => encoding::uint64::encode(*tag, &word, &mut buf),
                    1 => encoding::fixed64::encode(*tag, &word, &mut buf),
                    2 => encoding::fixed32::encode(*tag, &(word as u32), &mut buf),
                    _ => encoding::bytes::encode(*tag, payload, &mut buf),
                }
            }
            buf.extend_from_slice(&tail);
            let whole = buf.freeze();
            fn both<M: Message + Default + PartialEq + std::fmt::Debug>(whole: &Bytes) -> (Result<M, String>, Result<M, String>) {
                (
                    M::decode(MessageBuf::new(whole)).map_err(|e| e.to_string()),
                    M::decode(whole.clone()).map_err(|e| e.to_string()),
                )
            }
            let (through, from_bytes) = both::<XdsRequest>(&whole);
            proptest::prop_assert_eq!(through, from_bytes.clone());
            // Read whole, its names kept as they came where they came in a
            // run: the same request, names and hash, or the same error.
            let shared = XdsRequest::read_shared(&whole).map_err(|e| e.to_string());
            if let (Ok(shared), Ok(decoded)) = (&shared, &from_bytes) {
                proptest::prop_assert_eq!(shared.resource_names.hash(7), decoded.resource_names.hash(7));
                proptest::prop_assert_eq!(
                    shared.resource_names.clone().checked("n").map_err(|e| e.to_string()),
                    decoded.resource_names.clone().checked("n").map_err(|e| e.to_string())
                );
            }
            // Its strings (shares of the request) read as prost reads
            // `String`s: the same values, or the same error.
            let reference = StringsXdsRequest::decode(whole.clone()).map_err(|e| {
                ["version_info", "node", "resource_names", "type_url", "response_nonce", "error_detail"]
                    .iter()
                    .fold(e.to_string(), |text, field| text.replace(&format!("StringsXdsRequest.{field}: "), ""))
            });
            let strings = from_bytes
                .clone()
                .map(|r| (r.version_info.to_string(), r.type_url.to_string(), r.response_nonce.to_string()));
            let reference = reference.map(|r| (r.version_info, r.type_url, r.response_nonce));
            proptest::prop_assert_eq!(strings, reference);
            proptest::prop_assert_eq!(shared.map(read_names), from_bytes);
            let (through, from_bytes) = both::<DeltaXdsRequest>(&whole);
            proptest::prop_assert_eq!(through, from_bytes);
            let (through, from_bytes) = both::<SotwRequest>(&whole);
            proptest::prop_assert_eq!(through, from_bytes);
            let (through, from_bytes) = both::<SinkRequest>(&whole);
            proptest::prop_assert_eq!(through, from_bytes);
            let (through, from_bytes) = both::<IncrementalRequest>(&whole);
            proptest::prop_assert_eq!(through, from_bytes);
        }
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
