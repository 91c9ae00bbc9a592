//! How each protocol encodes its responses, from the cache's snapshots. What
//! every client at a version receives is encoded once and memoized on the
//! snapshot (or, per chunk, on the chunk), keyed by protocol and by what it
//! depends on; each client adds only its own suffix (type URL, nonce). The
//! parts are `Bytes` handed to HTTP/2 as they are, never copied per client.
//!
//! Protobuf lets a message's fields come in any order and a repeated field
//! repeat, so shared parts followed by a per-client suffix are one valid
//! message.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{self, WireType};

use super::type_state::{Push, ReportedNames};
use crate::cache::memo::MemoKey;
use crate::cache::{CachedResource, Chunk, CollectionSnapshot, Diff, STORAGE_FIELD};
use crate::metrics::CollectionMetrics;
use crate::proto::wire::wire_fields;

/// Distinct from-versions whose diffs a snapshot keeps per protocol (clients
/// are normally at one or two versions; this bounds a pathological spread).
const SHARED_DIFFS_PER_SNAPSHOT: usize = 32;

/// What every client at a version receives, in order.
#[derive(Clone, Debug)]
pub enum Shared {
    /// Parts made for this version (or for one client).
    Flat(Arc<[Bytes]>),
    /// Runs of parts: a chunk's pieces are kept with the chunk and shared
    /// by every version that has it, not copied into a list per version
    /// (istiod's and Envoy's forms are two pieces per resource).
    Runs(Arc<[Arc<[Bytes]>]>),
    /// One client's small response whole, its suffix included
    /// ([`Layout::response`]): one buffer, no list of parts.
    One(Bytes),
}

impl Default for Shared {
    fn default() -> Self {
        Shared::Flat(Arc::from([]))
    }
}

impl From<Arc<[Bytes]>> for Shared {
    fn from(parts: Arc<[Bytes]>) -> Self {
        Shared::Flat(parts)
    }
}

impl Shared {
    /// Whether both are the same parts (not equal ones: the same memo).
    #[cfg(test)]
    fn ptr_eq(&self, other: &Shared) -> bool {
        match (self, other) {
            (Shared::Flat(a), Shared::Flat(b)) => Arc::ptr_eq(a, b),
            (Shared::Runs(a), Shared::Runs(b)) => Arc::ptr_eq(a, b),
            (Shared::One(a), Shared::One(b)) => a.as_ptr() == b.as_ptr() && a.len() == b.len(),
            _ => false,
        }
    }

    /// The parts, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Bytes> {
        let (flat, runs): (&[Bytes], &[Arc<[Bytes]>]) = match self {
            Shared::Flat(parts) => (parts, &[]),
            Shared::Runs(runs) => (&[], runs),
            Shared::One(one) => (std::slice::from_ref(one), &[]),
        };
        flat.iter().chain(runs.iter().flat_map(|run| run.iter()))
    }

    /// The part at `at` (a run and a part within it), and where the next
    /// one is; `None` past the end.
    pub fn part(&self, at: (usize, usize)) -> Option<(&Bytes, (usize, usize))> {
        match self {
            Shared::Flat(parts) => parts.get(at.1).map(|part| (part, (0, at.1 + 1))),
            Shared::One(one) => (at.1 == 0).then_some((one, (0, 1))),
            Shared::Runs(runs) => {
                let (mut run, mut i) = at;
                loop {
                    let parts = runs.get(run)?;
                    if let Some(part) = parts.get(i) {
                        return Some((part, (run, i + 1)));
                    }
                    (run, i) = (run + 1, 0);
                }
            }
        }
    }
}

/// A response assembled from pre-encoded parts: `shared` is what every
/// client at this version receives, in order; `suffix` holds the few
/// per-client fields.
#[derive(Clone, Debug, Default)]
pub struct EncodedResponse {
    pub shared: Shared,
    pub suffix: Bytes,
    /// For the metrics recorded when it is written; not part of the message.
    pub record: Option<Record>,
    /// The message's length, summed once (the stream's view and the writer
    /// both need it).
    len: usize,
}

/// What a written response is counted under.
#[derive(Clone, Debug)]
pub struct Record {
    pub snapshot: Arc<CollectionSnapshot>,
    pub metrics: Arc<CollectionMetrics>,
}

impl EncodedResponse {
    pub fn new(shared: impl Into<Shared>, suffix: Bytes, record: Option<Record>) -> Self {
        let shared = shared.into();
        let len = shared.iter().map(Bytes::len).sum::<usize>() + suffix.len();
        Self {
            shared,
            suffix,
            record,
            len,
        }
    }

    /// The encoded message's length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole message in one buffer (tests and debugging; the server writes
    /// the parts as they are).
    pub fn to_bytes(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.len());
        for part in self.shared.iter() {
            buf.put_slice(part);
        }
        buf.put_slice(&self.suffix);
        buf.freeze()
    }
}

/// The encoded length of a string field as `put_string` writes it.
fn string_field_len(tag: u32, value: &str) -> usize {
    if value.is_empty() {
        return 0;
    }
    encoding::key_len(tag) + encoding::encoded_len_varint(value.len() as u64) + value.len()
}

/// A proto3 string field; empty strings are omitted, as prost would.
fn put_string(tag: u32, value: &str, buf: &mut BytesMut) {
    if value.is_empty() {
        return;
    }
    encoding::encode_key(tag, WireType::LengthDelimited, buf);
    encoding::encode_varint(value.len() as u64, buf);
    buf.put_slice(value.as_bytes());
}

fn put_bytes(tag: u32, value: &[u8], buf: &mut BytesMut) {
    encoding::encode_key(tag, WireType::LengthDelimited, buf);
    encoding::encode_varint(value.len() as u64, buf);
    buf.put_slice(value);
}

fn bytes_field_len(tag: u32, value: &[u8]) -> usize {
    bytes_len_of(tag, value.len())
}

/// Strings as one field each, in one buffer.
fn string_fields(tag: u32, values: &[&str]) -> Bytes {
    let mut buf = BytesMut::with_capacity(values.iter().map(|v| bytes_field_len(tag, v.as_bytes())).sum());
    for value in values {
        put_bytes(tag, value.as_bytes(), &mut buf);
    }
    buf.freeze()
}

/// Pieces a response for one client is written in as they are. The
/// vendored h2 hands a DATA frame's payload to one vectored write, 256
/// slices at most (`vendor/README.md`), of which the frame's head, the gRPC
/// frame header, the head, the removed names and the suffix take a few:
/// past 240 pieces, a response is copied into one buffer instead (one
/// memcpy of the response; more slices would take a second write). Below,
/// each resource is the cache's stored piece, shared, not copied per
/// client. (Before the patch, `bytes::Take` gave 16 slices a write, and
/// this was 12: Envoy's 50 endpoints by name took 4 writes as pieces.)
const MAX_PIECES: usize = 240;

/// The type URL of an MCP `Resource` packed in an `Any` (MCP over xDS).
pub const MCP_RESOURCE_TYPE_URL: &str = "type.googleapis.com/istio.mcp.v1alpha1.Resource";

/// How a protocol carries each resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// The `Resource` as the source sent it (MCP).
    Mcp,
    /// `Any(istio.mcp.v1alpha1.Resource)` with `metadata.version` the
    /// resource's content version and `metadata.create_time` always set
    /// (istiod 1.8 to 1.15 skip a resource without it; 1.12+ skip a changed
    /// body under an unchanged version): MCP over xDS, state of the world.
    McpAny,
    /// The body `Any` itself: plain xDS, state of the world.
    Body,
    /// Delta xDS `Resource{version, resource: McpAny, name}`.
    DeltaMcp,
    /// Delta xDS `Resource{version, resource: Body, name}`.
    DeltaBody,
}

impl Form {
    /// Writes the resource in this form into `pieces` as made bytes around a
    /// slice of the stored bytes, behind its `tag` record's key and length
    /// when a tag is given (`None`: the form's value alone). `false` for
    /// the forms and resources that are not a slice of the stored bytes
    /// (MCP's own, and an Envoy body not stored as the gateway writes it).
    fn frame(self, resource: &CachedResource, tag: Option<u32>, pieces: &mut Pieces) -> bool {
        let record = |len: usize, buf: &mut BytesMut| {
            if let Some(tag) = tag {
                encoding::encode_key(tag, WireType::LengthDelimited, buf);
                encoding::encode_varint(len as u64, buf);
            }
        };
        match self {
            Form::Mcp => false,
            Form::Body => {
                // The stored body record is a response's `resources` record
                // as it is (field 2 both).
                let Some(stored) = stored_body_record(&resource.encoded).filter(|_| tag == Some(BODY_FIELD)) else {
                    return false;
                };
                pieces.stored(resource.encoded.slice(stored));
                true
            }
            Form::McpAny => {
                let version = resource.content_version();
                let any = McpAny::of(resource, &version);
                record(any.len(), pieces.made());
                any.put(resource, &version, pieces);
                true
            }
            Form::DeltaMcp | Form::DeltaBody => {
                let version = resource.content_version();
                // What goes in the `resource` record (field 2), found once.
                enum Inner {
                    Any(McpAny),
                    /// The stored body record as it is (field 2 both).
                    Stored(std::ops::Range<usize>),
                    Made(Bytes),
                }
                let inner = match self {
                    Form::DeltaMcp => Inner::Any(McpAny::of(resource, &version)),
                    _ => match stored_body_record(&resource.encoded) {
                        Some(stored) => Inner::Stored(stored),
                        None => Inner::Made(body_of(resource)),
                    },
                };
                let len = match &inner {
                    Inner::Any(any) => bytes_len_of(2, any.len()),
                    Inner::Stored(stored) => stored.len(),
                    Inner::Made(body) => bytes_field_len(2, body),
                };
                let len = string_field_len(1, &version) + len + string_field_len(3, &resource.name);
                let buf = pieces.made();
                record(len, buf);
                put_string(1, &version, buf);
                match inner {
                    Inner::Any(any) => {
                        encoding::encode_key(2, WireType::LengthDelimited, buf);
                        encoding::encode_varint(any.len() as u64, buf);
                        any.put(resource, &version, pieces);
                    }
                    Inner::Stored(stored) => pieces.stored(resource.encoded.slice(stored)),
                    Inner::Made(body) => put_bytes(2, &body, buf),
                }
                put_string(3, &resource.name, pieces.made());
                true
            }
        }
    }
}

/// `Any(istio.mcp.v1alpha1.Resource)` as MCP over xDS sends it: the stored
/// `Resource` as it is, then a second `metadata` record (field 1) holding
/// the content version and, where the stored metadata has none, a
/// `create_time` (the epoch, the same on every replica). Protobuf merges a
/// message field given twice, the later value of a scalar winning, so
/// istiod reads the source's metadata with its version and time replaced,
/// and the stored bytes are sent as a slice of the cache rather than kept
/// a second time in this form.
struct McpAny {
    /// The appended metadata's length (its record's value).
    metadata: usize,
    create_time: bool,
    /// The `Any`'s `value`.
    value: usize,
}

impl McpAny {
    fn of(resource: &CachedResource, version: &str) -> Self {
        let create_time = !has_create_time(&resource.encoded);
        let metadata = string_field_len(3, version) + if create_time { 2 } else { 0 };
        McpAny {
            metadata,
            create_time,
            value: resource.encoded.len() + bytes_len_of(1, metadata),
        }
    }

    /// The `Any`'s length.
    fn len(&self) -> usize {
        string_field_len(1, MCP_RESOURCE_TYPE_URL) + bytes_len_of(2, self.value)
    }

    fn put(&self, resource: &CachedResource, version: &str, pieces: &mut Pieces) {
        let buf = pieces.made();
        put_string(1, MCP_RESOURCE_TYPE_URL, buf);
        encoding::encode_key(2, WireType::LengthDelimited, buf);
        encoding::encode_varint(self.value as u64, buf);
        pieces.stored(resource.encoded.clone());
        let buf = pieces.made();
        encoding::encode_key(1, WireType::LengthDelimited, buf);
        encoding::encode_varint(self.metadata as u64, buf);
        put_string(3, version, buf);
        if self.create_time {
            // `create_time` (field 2): an empty `Timestamp`.
            encoding::encode_key(2, WireType::LengthDelimited, buf);
            encoding::encode_varint(0, buf);
        }
    }
}

/// Whether a stored `Resource`'s metadata (field 1, every record of it) sets
/// `create_time` (field 2). Resources are validated before they reach the
/// cache; what does not read as protobuf counts as not set.
fn has_create_time(encoded: &[u8]) -> bool {
    fields(encoded).any(|(field, value)| field == 1 && fields(value).any(|(field, _)| field == 2))
}

/// The top-level fields of a message: field number and, for a
/// length-delimited field, its value (empty for the others). Stops at the
/// first thing that does not read.
fn fields(message: &[u8]) -> impl Iterator<Item = (u32, &[u8])> {
    wire_fields(message)
        .map_while(Result::ok)
        .map(move |f| (f.number, f.payload.map_or(&[][..], |at| &message[at..f.end])))
}

/// A record's length: key, length and `len` bytes of value.
fn bytes_len_of(tag: u32, len: usize) -> usize {
    encoding::key_len(tag) + encoding::encoded_len_varint(len as u64) + len
}

/// A response's resources as pieces: made bytes (all of them in one buffer)
/// between slices of the stored bytes. A stored slice shorter than
/// `copy_below` is copied among the made bytes instead (see [`COPY_BELOW`]).
pub(crate) struct Pieces {
    made: BytesMut,
    /// Where the made bytes not yet cut into a piece begin.
    made_from: usize,
    parts: Vec<Part>,
    copy_below: usize,
    /// Bytes of the stored slices kept as they are.
    stored_len: usize,
}

enum Part {
    Made(std::ops::Range<usize>),
    Stored(Bytes),
}

/// Below this a stored slice is copied rather than sent as it is. The
/// vendored h2 hands the socket 256 slices per write (16 before its patch,
/// through `bytes::Take`): slices of 1 KiB and more, each behind a piece of
/// made bytes, keep a 16 KiB frame to one write and a whole collection to a
/// write per 128 resources; smaller ones would take more writes (Envoy's
/// 512-byte clusters of the fan-out scenario, 500 in one response: 4 writes
/// instead of 1) for a second copy of at most the resources smaller than
/// this.
const COPY_BELOW: usize = 1024;

impl Pieces {
    /// Pieces that keep stored slices of `COPY_BELOW` bytes and more as they are.
    fn slicing() -> Self {
        Self::new(COPY_BELOW, 0)
    }

    /// Pieces that copy everything into one buffer.
    fn copying() -> Self {
        Self::new(usize::MAX, 0)
    }

    /// Pieces whose made bytes' buffer is made with room for `room` bytes
    /// (not reserved after: a reserve on an empty buffer is `bytes`' slow
    /// path).
    fn new(copy_below: usize, room: usize) -> Self {
        Pieces {
            made: BytesMut::with_capacity(room),
            made_from: 0,
            parts: Vec::new(),
            copy_below,
            stored_len: 0,
        }
    }

    /// Bytes written so far, made and stored.
    fn len(&self) -> usize {
        self.made.len() + self.stored_len
    }

    fn made(&mut self) -> &mut BytesMut {
        &mut self.made
    }

    fn stored(&mut self, stored: Bytes) {
        if stored.len() < self.copy_below {
            self.made.put_slice(&stored);
            return;
        }
        self.cut();
        self.stored_len += stored.len();
        self.parts.push(Part::Stored(stored));
    }

    fn cut(&mut self) {
        if self.made.len() > self.made_from {
            self.parts.push(Part::Made(self.made_from..self.made.len()));
            self.made_from = self.made.len();
        }
    }

    /// The pieces, in order.
    fn into_parts(mut self) -> Vec<Bytes> {
        self.cut();
        let made = self.made.freeze();
        self.parts
            .into_iter()
            .map(|part| match part {
                Part::Made(range) => made.slice(range),
                Part::Stored(stored) => stored,
            })
            .collect()
    }

    /// Everything in one buffer (pieces made `copying`).
    fn into_one(self) -> Bytes {
        debug_assert!(self.parts.iter().all(|p| matches!(p, Part::Made(_))));
        self.made.freeze()
    }
}

/// The resource's metadata and body as the source sent them. Resources are
/// validated before they reach the cache, so this decodes; should it not,
/// the metadata is left empty rather than failing a whole response.
fn parts_of(resource: &CachedResource) -> (crate::proto::Metadata, Bytes) {
    use prost::Message;
    match crate::proto::wire::RawResource::decode(resource.encoded.clone()) {
        Ok(raw) => (raw.metadata.unwrap_or_default(), raw.body.unwrap_or_default()),
        Err(_) => (crate::proto::Metadata::default(), Bytes::new()),
    }
}

fn body_of(resource: &CachedResource) -> Bytes {
    parts_of(resource).1
}

/// Where the stored `Resource`'s `body` record (field 2: key byte and
/// length, then the body `Any`) lies in its bytes. A state-of-the-world
/// response's `resources` record is field 2 as well, and the body is what
/// Envoy reads: that record is the response's record as it is stored, sent
/// as a slice (no copy, nothing kept per resource). `None` where it is not
/// written as the gateway would write it (no body, a body given twice, a key
/// or length not in its shortest form): the record is then made.
fn stored_body_record(encoded: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut found = None;
    for field in wire_fields(encoded) {
        let field = field.ok()?;
        if field.number != BODY_FIELD {
            continue;
        }
        // Length-delimited, its key in one byte and its length in the
        // fewest: the record the gateway writes.
        let payload = field.payload?;
        let shortest = payload - field.start == 1 + encoding::encoded_len_varint((field.end - payload) as u64);
        if found.is_some() || !shortest {
            return None;
        }
        found = Some(field.start..field.end);
    }
    found
}

/// Reads the first byte of each resource's stored bytes before any of them
/// is parsed ([`super::read_together`]): read by [`stored_body_record`],
/// each miss waited for the one before (8 % of the gateway's samples in
/// `mcp-load --scenario eds`, all on that first load). Keeping the record's
/// place in each resource instead took the same time off but 16 bytes more
/// per cached resource (a malloc size class: +0.8 MiB of big-config's
/// peak; BENCHMARKS, session 12). Then the byte after each resource's first
/// field: the body's key where the metadata comes first, on the next cache
/// line for most resources, whose load waited for the locked increment of
/// the slice of the resource before it (two thirds of `wire_fields`'
/// samples; BENCHMARKS, session 19).
fn read_ahead(resources: &[Arc<CachedResource>]) {
    super::read_together(
        resources
            .iter()
            .map(|r| usize::from(r.encoded.first().copied().unwrap_or(0))),
    );
    super::read_together(
        resources
            .iter()
            .map(|r| usize::from(after_first_field(&r.encoded).unwrap_or(0))),
    );
}

/// The byte after `encoded`'s first field, where that field is
/// length-delimited with a one-byte key (the metadata).
fn after_first_field(encoded: &[u8]) -> Option<u8> {
    let mut rest = encoded.get(1..)?;
    let len = usize::try_from(encoding::decode_varint(&mut rest).ok()?).ok()?;
    rest.get(len).copied()
}

/// `Resource.body` and a response's `resources`: field 2, length-delimited.
const BODY_FIELD: u32 = 2;

/// The names `reported` holds that `to` does not, sorted, once each.
pub(super) fn gone<'a>(reported: &'a ReportedNames, to: &CollectionSnapshot) -> Vec<&'a str> {
    let mut removed: Vec<&str> = reported
        .iter()
        .filter(|name| !to.resources.contains_key(*name))
        .collect();
    removed.sort_unstable();
    removed.dedup();
    removed
}

/// A protocol's message layout: where it puts the version, the resources,
/// the removed names, and (for `Resources`) the collection.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// Memo keys: one per protocol.
    pub full_key: &'static str,
    pub diff_key: &'static str,
    pub chunk_key: &'static str,
    /// A resource's field in this layout, kept with the resource.
    pub resource_key: &'static str,
    pub version: u32,
    pub collection: Option<u32>,
    pub resources: u32,
    pub removed: u32,
    pub form: Form,
}

/// `MeshConfigResponse{version_info=1, resources=2, type_url=3, nonce=4}` and
/// `IncrementalMeshConfigResponse{system_version_info=1, resources=2,
/// removed_resources=3, nonce=4}`: the legacy aggregated services.
pub const LEGACY: Layout = Layout {
    full_key: "mcp.legacy.full",
    diff_key: "mcp.legacy.diff",
    chunk_key: "mcp.legacy.chunk",
    resource_key: "mcp.legacy.resource",
    version: 1,
    collection: None,
    resources: 2,
    removed: 3,
    form: Form::Mcp,
};

/// `Resources{system_version_info=1, collection=2, resources=3,
/// removed_resources=4, nonce=5, incremental=6}`: `ResourceSource`.
pub const RESOURCES: Layout = Layout {
    full_key: "mcp.resources.full",
    diff_key: "mcp.resources.diff",
    chunk_key: "mcp.resources.chunk",
    resource_key: "mcp.resources.resource",
    version: 1,
    collection: Some(2),
    resources: 3,
    removed: 4,
    form: Form::Mcp,
};

/// Envoy's v3 `DiscoveryResponse{version_info=1, resources=2, type_url=4,
/// nonce=5}`, each resource an `Any(istio.mcp.v1alpha1.Resource)`: MCP over
/// xDS (istiod 1.8+ with `configSources: xds://`).
pub const XDS_MCP: Layout = Layout {
    full_key: "xds.sotw.mcp.full",
    diff_key: "xds.sotw.mcp.diff",
    chunk_key: "xds.sotw.mcp.chunk",
    resource_key: "xds.sotw.mcp.resource",
    version: 1,
    collection: None,
    resources: 2,
    removed: 0,
    form: Form::McpAny,
};

/// The same, each resource its body: plain xDS (Envoy).
pub const XDS_BODY: Layout = Layout {
    full_key: "xds.sotw.body.full",
    diff_key: "xds.sotw.body.diff",
    chunk_key: "xds.sotw.body.chunk",
    resource_key: "xds.sotw.body.resource",
    form: Form::Body,
    ..XDS_MCP
};

/// Envoy's v3 `DeltaDiscoveryResponse{system_version_info=1, resources=2,
/// type_url=4, nonce=5, removed_resources=6}`, each resource a
/// `Resource{version, resource: Any(istio.mcp.v1alpha1.Resource), name}`.
pub const DELTA_MCP: Layout = Layout {
    full_key: "xds.delta.mcp.full",
    diff_key: "xds.delta.mcp.diff",
    chunk_key: "xds.delta.mcp.chunk",
    resource_key: "xds.delta.mcp.resource",
    version: 1,
    collection: None,
    resources: 2,
    removed: 6,
    form: Form::DeltaMcp,
};

/// The same, each resource's `resource` its body (Envoy).
pub const DELTA_BODY: Layout = Layout {
    full_key: "xds.delta.body.full",
    diff_key: "xds.delta.body.diff",
    chunk_key: "xds.delta.body.chunk",
    resource_key: "xds.delta.body.resource",
    form: Form::DeltaBody,
    ..DELTA_MCP
};

/// A chunk's resources in one layout's form, kept with the chunk: its
/// parts, and where each member's record ends in them (counted from the
/// first part's start), so that a run of its members (a view's) is a slice
/// of them, not a second encoding.
struct Framed {
    parts: Arc<[Bytes]>,
    ends: Box<[usize]>,
}

impl Framed {
    /// The parts of members `members`: slices of these parts.
    fn members(&self, members: std::ops::Range<usize>) -> Arc<[Bytes]> {
        if members.start == 0 && members.end == self.ends.len() {
            return self.parts.clone();
        }
        let start = members.start.checked_sub(1).map_or(0, |before| self.ends[before]);
        let end = members.end.checked_sub(1).map_or(0, |last| self.ends[last]);
        let mut sliced = Vec::new();
        let mut at = 0;
        for part in self.parts.iter() {
            let (from, to) = (at, at + part.len());
            at = to;
            if to <= start || from >= end {
                continue;
            }
            sliced.push(part.slice(start.max(from) - from..end.min(to) - from));
        }
        sliced.into()
    }
}

impl Layout {
    /// A chunk's resources in MCP's form, as one part: the chunk's storage
    /// itself when the field numbers agree, else re-framed once per chunk
    /// and kept with it (a view's run of a chunk: a slice of that chunk's).
    fn mcp_chunk(&self, chunk: &Chunk) -> Arc<[Bytes]> {
        if self.resources == STORAGE_FIELD {
            return Arc::from([chunk.bytes().clone()]);
        }
        self.framed(chunk, |members| {
            let mut ends = Vec::with_capacity(members.len());
            let mut end = 0;
            for member in members {
                end += bytes_field_len(self.resources, &member.encoded);
                ends.push(end);
            }
            Framed {
                parts: Arc::from([self.fields(members)]),
                ends: ends.into(),
            }
        })
    }

    /// A chunk's resources in istiod's and Envoy's forms: pieces made once
    /// per chunk and kept with it, each resource's made bytes around a
    /// slice of its stored bytes (not a second copy of them); a view's run
    /// of a chunk: slices of that chunk's pieces.
    fn chunk_pieces(&self, chunk: &Chunk) -> Arc<[Bytes]> {
        self.framed(chunk, |members| {
            let mut pieces = Pieces::slicing();
            let mut ends = Vec::with_capacity(members.len());
            for member in members {
                self.frame(member, &mut pieces);
                ends.push(pieces.len());
            }
            Framed {
                parts: Arc::from(pieces.into_parts()),
                ends: ends.into(),
            }
        })
    }

    /// `chunk`'s resources as `frame` frames a chunk's members, made once
    /// per chunk and kept with it; for a run of another chunk's members,
    /// slices of that chunk's.
    fn framed(&self, chunk: &Chunk, frame: impl FnOnce(&[Arc<CachedResource>]) -> Framed) -> Arc<[Bytes]> {
        let (of, members) = match chunk.run_of() {
            Some(run) => (&*run.chunk, run.members.clone()),
            None => (chunk, 0..chunk.members().len()),
        };
        let framed = of
            .memo
            .get_or_make(MemoKey::of(self.chunk_key), 1, || frame(of.members()));
        framed.members(members)
    }

    /// `resource`'s `resources` record, into `pieces`.
    fn frame(&self, resource: &CachedResource, pieces: &mut Pieces) {
        if !self.form.frame(resource, Some(self.resources), pieces) {
            // MCP's own form, or an Envoy body not stored as the gateway
            // writes it: the record is made around the value.
            let value = match self.form {
                Form::Mcp => resource.encoded.clone(),
                _ => body_of(resource),
            };
            put_bytes(self.resources, &value, pieces.made());
        }
    }

    /// A resource's `resources` field in this layout. In the MCP form it is
    /// the stored bytes behind a prefix (made as needed: nothing to decode,
    /// and MCP clients name no resources);
    /// in the xDS forms it is made once per content version, kept with the
    /// resource, and shared by every response that carries it: the named
    /// responses of Envoy's EDS and RDS are assembled from these pieces.
    fn field(&self, resource: &CachedResource) -> Bytes {
        let make = || {
            let mut pieces = Pieces::copying();
            self.frame(resource, &mut pieces);
            pieces.into_one()
        };
        if self.form == Form::Mcp {
            return make();
        }
        if let Some(record) = self.stored_record(resource) {
            return resource.encoded.slice(record);
        }
        if self.made_each_time(resource) {
            // Made for each response around the stored body record, not
            // kept: a named delta client is sent a resource once per change.
            return make();
        }
        Bytes::clone(&resource.memo.get_or_make(MemoKey::of(self.resource_key), 1, make))
    }

    /// Delta's Envoy form where its `resource` record is the stored body
    /// record: cheap to make, so not kept.
    fn made_each_time(&self, resource: &CachedResource) -> bool {
        self.form == Form::DeltaBody && stored_body_record(&resource.encoded).is_some()
    }

    /// This layout's record of `resource` where it is a slice of the stored
    /// bytes (Envoy's bodies, state of the world).
    fn stored_record(&self, resource: &CachedResource) -> Option<std::ops::Range<usize>> {
        (self.form == Form::Body && self.resources == BODY_FIELD)
            .then(|| stored_body_record(&resource.encoded))
            .flatten()
    }

    /// Resources as one field each, in one buffer.
    fn fields<'a>(&self, resources: impl IntoIterator<Item = &'a Arc<CachedResource>>) -> Bytes {
        self.measured_fields(resources).0
    }

    /// [`Self::fields`], and each resource's field's length (for the xDS
    /// forms; none for MCP's).
    fn measured_fields<'a>(&self, resources: impl IntoIterator<Item = &'a Arc<CachedResource>>) -> (Bytes, Vec<usize>) {
        if self.form == Form::Mcp {
            // The stored bytes behind their prefixes, written once.
            let resources: Vec<&Arc<CachedResource>> = resources.into_iter().collect();
            let len = resources
                .iter()
                .map(|r| bytes_field_len(self.resources, &r.encoded))
                .sum();
            let mut buf = BytesMut::with_capacity(len);
            for resource in resources {
                put_bytes(self.resources, &resource.encoded, &mut buf);
            }
            return (buf.freeze(), Vec::new());
        }
        // Each resource's form copied from where it is kept, without taking
        // a reference to it (a named response reads ~50 resources spread
        // over the heap; each reference taken is a cache miss more).
        let resources: Vec<&Arc<CachedResource>> = resources.into_iter().collect();
        let key = MemoKey::of(self.resource_key);
        enum Piece {
            Stored(std::ops::Range<usize>),
            Kept(usize),
            Made(Bytes),
        }
        let pieces: Vec<Piece> = resources
            .iter()
            .map(|r| {
                if let Some(record) = self.stored_record(r) {
                    return Piece::Stored(record);
                }
                // Only a kept form is in the memo.
                match r.memo.read(&key, |field: &Bytes| field.len()) {
                    Some(len) => Piece::Kept(len),
                    None => Piece::Made(self.field(r)),
                }
            })
            .collect();
        let lengths: Vec<usize> = pieces
            .iter()
            .map(|piece| match piece {
                Piece::Stored(record) => record.len(),
                Piece::Kept(len) => *len,
                Piece::Made(field) => field.len(),
            })
            .collect();
        let mut buf = BytesMut::with_capacity(lengths.iter().sum());
        for (resource, piece) in resources.into_iter().zip(pieces) {
            match piece {
                Piece::Stored(record) => buf.put_slice(&resource.encoded[record]),
                Piece::Kept(_) => {
                    if resource.memo.read(&key, |field: &Bytes| buf.put_slice(field)).is_none() {
                        buf.put_slice(&self.field(resource));
                    }
                }
                Piece::Made(field) => buf.put_slice(&field),
            }
        }
        (buf.freeze(), lengths)
    }

    /// The fields every response for `to` starts with.
    fn head(&self, to: &CollectionSnapshot) -> Bytes {
        let collection = self.collection.map_or(0, |tag| string_field_len(tag, &to.collection));
        let mut buf = BytesMut::with_capacity(string_field_len(self.version, &to.version) + collection);
        put_string(self.version, &to.version, &mut buf);
        if let Some(tag) = self.collection {
            put_string(tag, &to.collection, &mut buf);
        }
        buf.freeze()
    }

    /// The whole collection: the head, then every chunk. Once per snapshot:
    /// MCP's chunks as one part each; the other forms' as the runs of
    /// pieces their chunks keep.
    pub fn full(&self, to: &CollectionSnapshot) -> Shared {
        let parts = to.memo.get_or_make(MemoKey::of(self.full_key), 1, || {
            if self.form == Form::Mcp {
                let mut parts = vec![self.head(to)];
                for chunk in to.chunks() {
                    parts.extend(self.mcp_chunk(chunk).iter().cloned());
                }
                return Shared::Flat(parts.into());
            }
            let head: Arc<[Bytes]> = Arc::from([self.head(to)]);
            let runs = std::iter::once(head).chain(to.chunks().map(|c| self.chunk_pieces(c)));
            Shared::Runs(runs.collect())
        });
        Shared::clone(&parts)
    }

    /// What changed from `from` to `to`: once per (from, to), shared by every
    /// client at `from`. Consecutive snapshots share structure, so the diff
    /// costs time proportional to the change.
    pub fn diff(&self, from: &CollectionSnapshot, to: &CollectionSnapshot) -> Arc<[Bytes]> {
        let key = MemoKey::with(self.diff_key, from.version.clone());
        let parts = to.memo.get_or_make(key, SHARED_DIFFS_PER_SNAPSHOT, || {
            let diff = Diff::between(&from.resources, &to.resources);
            if to.is_view() {
                self.referenced(to, &diff)
            } else {
                self.changes(to, &diff)
            }
        });
        Arc::clone(&parts)
    }

    /// A view's change (a grant's, made for its clients): each resource as
    /// made bytes around a slice of its stored bytes (or the form kept with
    /// the resource, which every view shares), not a copy per view.
    fn referenced(&self, to: &CollectionSnapshot, diff: &Diff) -> Arc<[Bytes]> {
        let mut pieces = Pieces::new(0, 0);
        for resource in &diff.upserts {
            if self.form == Form::Mcp {
                let made = pieces.made();
                encoding::encode_key(self.resources, WireType::LengthDelimited, made);
                encoding::encode_varint(resource.encoded.len() as u64, made);
                pieces.stored(resource.encoded.clone());
            } else {
                self.frame(resource, &mut pieces);
            }
        }
        self.assembled(to, pieces, diff)
    }

    /// A response of `diff` whose resources are `pieces`: `to`'s head, the
    /// pieces as they are, and the names `diff` removes.
    fn assembled(&self, to: &CollectionSnapshot, pieces: Pieces, diff: &Diff) -> Arc<[Bytes]> {
        let removed = string_fields(self.removed, &diff.removed_names());
        std::iter::once(self.head(to))
            .chain(pieces.into_parts())
            .chain((!removed.is_empty()).then_some(removed))
            .collect()
    }

    /// `diff`'s resources and removed names, at `to`'s version, in one
    /// buffer (shared by every client at the same versions).
    fn changes(&self, to: &CollectionSnapshot, diff: &Diff) -> Arc<[Bytes]> {
        debug_assert!(
            self.removed != 0 || diff.removed.is_empty(),
            "this layout removes nothing"
        );
        Arc::from([
            self.head(to),
            self.fields(&diff.upserts),
            string_fields(self.removed, &diff.removed_names()),
        ])
    }

    /// A client's own response (its names): each resource's field as the
    /// piece it is kept as, no copy; a field made for each response
    /// (delta's Envoy form) as made bytes around a slice of the stored body
    /// record, the made bytes of the whole response in one buffer. Past
    /// the pieces of one write, everything in one buffer.
    ///
    /// Not a buffer per resource: a named delta client's first response
    /// held 50 of them (~20 KB in 50 chunks) until it was written, and a
    /// sync of 2,000 clients left the heap those chunks were spread over
    /// fragmented (BENCHMARKS, session 16).
    fn selected(&self, to: &CollectionSnapshot, diff: &Diff) -> Arc<[Bytes]> {
        // A made field takes two pieces (its made bytes, its stored slice)
        // and the last name one more; a kept field, one.
        let most = if self.form == Form::DeltaBody {
            2 * diff.upserts.len() + 1
        } else {
            diff.upserts.len()
        };
        if most > MAX_PIECES {
            return self.changes(to, diff);
        }
        read_ahead(&diff.upserts);
        // A made field's bytes beside its body: the record's head, the
        // content version (16 digits) and the name behind their keys.
        let room = if self.form == Form::DeltaBody {
            diff.upserts.iter().map(|r| r.name.len() + 32).sum()
        } else {
            0
        };
        let mut pieces = Pieces::new(0, room);
        for resource in &diff.upserts {
            if self.made_each_time(resource) {
                self.frame(resource, &mut pieces);
            } else {
                pieces.stored(self.field(resource));
            }
        }
        self.assembled(to, pieces, diff)
    }

    /// The whole collection (shared), and removals for the reported names
    /// `to` does not have (this client's own). Nothing is skipped on the
    /// client's word: legacy versions are the source's, which a source may
    /// reuse for another body, and an xDS client reports the versions it
    /// last ACKed, not what it holds after a response it applied in part
    /// (Envoy's CDS and LDS, grpc).
    pub fn first_from_reported(&self, to: &CollectionSnapshot, reported: &ReportedNames) -> Shared {
        let removed = string_fields(self.removed, &gone(reported, to));
        match self.full(to) {
            Shared::Flat(parts) => Shared::Flat(parts.iter().cloned().chain([removed]).collect()),
            Shared::One(one) => Shared::Flat(Arc::from([one, removed])),
            Shared::Runs(runs) => Shared::Runs(runs.iter().cloned().chain([Arc::from([removed])]).collect()),
        }
    }

    /// The shared parts of what the state machine decided.
    pub fn encode(&self, send: &Push) -> Shared {
        match send {
            Push::Full { to } => self.full(to),
            Push::Diff { from, to } => self.diff(from, to).into(),
            Push::FirstFromReported { to, reported } => self.first_from_reported(to, reported),
            // A client's own names: its own response.
            Push::Selected { to, diff } => self.selected(to, diff).into(),
        }
    }

    /// What the state machine decided, as the response's parts and its
    /// per-client suffix: a client's own small response ([`ONE_BUFFER_AT_MOST`])
    /// whole in one buffer, its suffix included; anything else its parts as
    /// [`Self::encode`] makes them, and the suffix apart.
    pub fn response(&self, send: &Push, suffix: Suffix<'_>) -> (Shared, Bytes) {
        if let Push::Selected { to, diff } = send {
            if let Some(one) = self.one_buffer(to, diff, &suffix) {
                return (Shared::One(one), Bytes::new());
            }
        }
        (self.encode(send), suffix.bytes())
    }

    /// A client's own response (its names) and `suffix` in one buffer, if
    /// it takes about [`ONE_BUFFER_AT_MOST`] bytes or fewer: the same bytes
    /// [`Self::selected`]'s parts and the suffix are, copied once.
    fn one_buffer(&self, to: &CollectionSnapshot, diff: &Diff, suffix: &Suffix<'_>) -> Option<Bytes> {
        // MCP's form is made for each response; a layout that removes
        // nothing is sent no removals (`selected` asserts it).
        if self.form == Form::Mcp || (self.removed == 0 && !diff.removed.is_empty()) {
            return None;
        }
        let head = string_field_len(self.version, &to.version)
            + self.collection.map_or(0, |tag| string_field_len(tag, &to.collection));
        let removed: usize = diff
            .removed
            .iter()
            .map(|name| bytes_field_len(self.removed, name.as_bytes()))
            .sum();
        // Each resource's field is about its stored bytes and its name
        // behind a few keys and lengths, a content version and (MCP over
        // xDS) an `Any`'s type URL: what is held to the bound.
        let fixed = head + removed + suffix.len();
        let mut about = fixed;
        for resource in &diff.upserts {
            about += resource.encoded.len() + resource.name.len() + 128;
            if about > ONE_BUFFER_AT_MOST {
                return None;
            }
        }
        // The buffer is made once, exactly the response's size where each
        // record is a slice of the resource's stored bytes (Envoy's state of
        // the world: found here, copied below), so that it is frozen without
        // `bytes`' shared header (an allocation a response, made for a
        // buffer with room to spare); else at the size above.
        let records: smallvec::SmallVec<[Option<std::ops::Range<usize>>; 4]> =
            diff.upserts.iter().map(|r| self.stored_record(r)).collect();
        let exact = records.iter().all(Option::is_some);
        let len = if exact {
            fixed + records.iter().flatten().map(ExactSizeIterator::len).sum::<usize>()
        } else {
            about
        };
        let mut pieces = Pieces::new(usize::MAX, len);
        put_string(self.version, &to.version, pieces.made());
        if let Some(tag) = self.collection {
            put_string(tag, &to.collection, pieces.made());
        }
        let key = MemoKey::of(self.resource_key);
        for (resource, record) in diff.upserts.iter().zip(records) {
            if self.made_each_time(resource) {
                self.frame(resource, &mut pieces);
            } else if let Some(record) = record {
                pieces.made().put_slice(&resource.encoded[record]);
            } else if resource
                .memo
                .read(&key, |field: &Bytes| pieces.made().put_slice(field))
                .is_none()
            {
                let field = self.field(resource);
                pieces.made().put_slice(&field);
            }
        }
        for name in &diff.removed {
            put_bytes(self.removed, name.as_bytes(), pieces.made());
        }
        suffix.put(pieces.made());
        debug_assert!(
            !exact || pieces.len() == len,
            "a response of found records is {len} bytes"
        );
        Some(pieces.into_one())
    }
}

/// A client's own response (its names) of at most this many bytes (about:
/// its resources' fields are counted at their stored size and a little
/// more) is made whole in one buffer, its suffix included
/// ([`Layout::response`]): a copy of its bytes costs less than a list of
/// parts, a reference taken and let go for each, and a second buffer for
/// its suffix (eds's responses of one or two endpoints: about 700 bytes).
/// Larger ones (a client's first response of its 50 endpoints, 20 KB) are
/// the cache's pieces, not a copy per client: 2,000 of them queued at once
/// would be 40 MB (BENCHMARKS, "A write path past h2's 16 slices").
pub const ONE_BUFFER_AT_MOST: usize = 4096;

/// The per-client fields a response ends with: an optional string field (a
/// type URL), the nonce, and an optional `true` flag
/// (`Resources.incremental`).
#[derive(Clone, Copy, Debug)]
pub struct Suffix<'a> {
    string: Option<(u32, &'a str)>,
    nonce: (u32, &'a str),
    flag: Option<u32>,
}

impl<'a> Suffix<'a> {
    pub fn new(string: Option<(u32, &'a str)>, nonce: (u32, &'a str), flag: Option<u32>) -> Self {
        Self { string, nonce, flag }
    }

    fn len(&self) -> usize {
        self.string.map_or(0, |(tag, s)| string_field_len(tag, s))
            + string_field_len(self.nonce.0, self.nonce.1)
            + self.flag.map_or(0, |tag| encoding::key_len(tag) + 1)
    }

    fn put(&self, buf: &mut BytesMut) {
        if let Some((tag, value)) = self.string {
            put_string(tag, value, buf);
        }
        put_string(self.nonce.0, self.nonce.1, buf);
        if let Some(tag) = self.flag {
            encoding::encode_key(tag, WireType::Varint, buf);
            encoding::encode_varint(1, buf);
        }
    }

    /// The suffix in a buffer of its own.
    pub fn bytes(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.len());
        self.put(&mut buf);
        buf.freeze()
    }
}

/// The per-client suffix in a buffer of its own ([`Suffix`]).
#[cfg(test)]
pub fn suffix(string: Option<(u32, &str)>, nonce: (u32, &str), flag: Option<u32>) -> Bytes {
    Suffix::new(string, nonce, flag).bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Cache, Origin, Update};
    use crate::proto::{IncrementalMeshConfigResponse, MeshConfigResponse, Resource, Resources};
    use crate::SharedStr;
    use prost::Message;

    const C: &str = "istio/networking/v1alpha3/gateways";

    fn resource(name: &str, version: &str) -> CachedResource {
        resource_with_body(name, version, version.as_bytes())
    }

    fn resource_with_body(name: &str, version: &str, body: &[u8]) -> CachedResource {
        let encoded = crate::proto::wire::test_support::encoded_resource(name, version, body);
        let none = std::collections::HashMap::<String, String>::new();
        let digest = crate::cache::content_digest(body, &none, &none);
        CachedResource::new(name.into(), encoded, digest)
    }

    /// `version`: the resource's content version.
    fn mcp_any(resource: &CachedResource, version: String) -> Bytes {
        use prost::Message;
        let (mut metadata, body) = parts_of(resource);
        metadata.version = version;
        // A source that gave none: the epoch, the same on every replica.
        metadata.create_time.get_or_insert_with(prost_types::Timestamp::default);
        let metadata = metadata.encode_to_vec();
        let mut value = BytesMut::with_capacity(bytes_field_len(1, &metadata) + bytes_field_len(2, &body));
        put_bytes(1, &metadata, &mut value);
        put_bytes(2, &body, &mut value);
        let mut any = BytesMut::with_capacity(string_field_len(1, MCP_RESOURCE_TYPE_URL) + bytes_field_len(2, &value));
        put_string(1, MCP_RESOURCE_TYPE_URL, &mut any);
        put_bytes(2, &value, &mut any);
        any.freeze()
    }

    /// `envoy.service.discovery.v3.Resource{version=1, resource=2, name=3}`.
    /// `put_resource` writes the `resource` record (field 2), `len` bytes.
    fn delta_resource(
        resource: &CachedResource,
        version: &str,
        len: usize,
        put_resource: impl FnOnce(&mut BytesMut),
    ) -> Bytes {
        let mut buf = BytesMut::with_capacity(string_field_len(1, version) + len + string_field_len(3, &resource.name));
        put_string(1, version, &mut buf);
        put_resource(&mut buf);
        put_string(3, &resource.name, &mut buf);
        buf.freeze()
    }

    fn parts(shared: &Shared) -> Vec<Bytes> {
        shared.iter().cloned().collect()
    }

    fn response(parts: impl Into<Shared>, suffix: Bytes) -> Bytes {
        EncodedResponse::new(parts, suffix, None).to_bytes()
    }

    fn names(resources: &[Resource]) -> Vec<String> {
        resources.iter().map(|r| r.metadata.clone().unwrap().name).collect()
    }

    #[test]
    fn every_layout_decodes_as_its_message_and_is_encoded_once() {
        let (cache, mut writer) = Cache::new();
        let many: Vec<_> = (0..300).map(|i| resource(&format!("r{i:03}"), "1")).collect();
        writer.apply(C, Update::Full(many), Origin::Upstream);
        let from = cache.get(C).unwrap();
        writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource("r007", "2"), resource("new", "1")],
                removed: vec!["r008".into()],
            },
            Origin::Upstream,
        );
        let to = cache.get(C).unwrap();

        let full = LEGACY.full(&to);
        assert!(full.ptr_eq(&LEGACY.full(&to)), "encoded once per snapshot");
        let sotw = MeshConfigResponse::decode(response(full, suffix(Some((3, C)), (4, "1"), None))).unwrap();
        assert_eq!(
            (sotw.version_info.as_str(), sotw.type_url.as_str(), sotw.nonce.as_str()),
            (&*to.version, C, "1")
        );
        assert_eq!(sotw.resources.len(), 300);

        let diff = LEGACY.diff(&from, &to);
        assert!(Arc::ptr_eq(&diff, &LEGACY.diff(&from, &to)), "shared per from-version");
        let inc = IncrementalMeshConfigResponse::decode(response(diff, suffix(None, (4, "2"), None))).unwrap();
        assert_eq!(names(&inc.resources), ["new", "r007"]);
        assert_eq!(inc.removed_resources, ["r008"]);
        assert_eq!(inc.system_version_info, *to.version);

        let reported = ReportedNames::new(["r001", "ghost"]);
        let first = LEGACY.first_from_reported(&to, &reported);
        let first = IncrementalMeshConfigResponse::decode(response(first, suffix(None, (4, "3"), None))).unwrap();
        assert_eq!(first.resources.len(), 300);
        assert_eq!(first.removed_resources, ["ghost"]);

        let full = RESOURCES.full(&to);
        let message = Resources::decode(response(full, suffix(None, (5, "4"), None))).unwrap();
        assert_eq!(message.collection, C);
        assert_eq!(message.resources.len(), 300);
        assert!(!message.incremental);
        let diff = RESOURCES.diff(&from, &to);
        let message = Resources::decode(response(diff, suffix(None, (5, "5"), Some(6)))).unwrap();
        assert!(message.incremental);
        assert_eq!(names(&message.resources), ["new", "r007"]);
        assert_eq!(message.removed_resources, ["r008"]);
        // The re-framed chunks are kept with the chunks: a later snapshot
        // sharing them re-frames only the chunk that changed.
        let reframed = to.chunks().filter(|c| !c.memo.is_empty()).count();
        assert_eq!(reframed, to.chunk_count());
    }

    /// Delta's Envoy form is made around the stored body record, byte for
    /// byte what it was made as from the decoded resource, and nothing is
    /// kept with the resource for it.
    #[test]
    fn delta_bodies_are_made_around_the_stored_record_and_not_kept() {
        use crate::proto::envoy::service::discovery::v3::DeltaDiscoveryResponse;
        let (cache, mut writer) = Cache::new();
        let many: Vec<_> = (0..150).map(|i| resource(&format!("r{i:03}"), "1")).collect();
        writer.apply(C, Update::Full(many), Origin::Upstream);
        let to = cache.get(C).unwrap();
        let r = &to.resources["r007"];
        let mut made = BytesMut::new();
        // As made from the decoded resource.
        let body = body_of(r);
        let value = delta_resource(r, &r.content_version(), bytes_field_len(2, &body), |buf| {
            put_bytes(2, &body, buf)
        });
        put_bytes(DELTA_BODY.resources, &value, &mut made);
        assert_eq!(DELTA_BODY.field(r), made.freeze());
        let encoded = DELTA_BODY.encode(&Push::Selected {
            to: to.clone(),
            diff: Diff {
                upserts: smallvec::smallvec![r.clone(), to.resources["r008"].clone()],
                removed: vec!["gone".into()],
            },
        });
        let decoded = DeltaDiscoveryResponse::decode(response(encoded, suffix(Some((4, C)), (5, "1"), None))).unwrap();
        assert_eq!(decoded.resources.len(), 2);
        assert_eq!(decoded.resources[0].name, "r007");
        assert_eq!(decoded.resources[0].version, r.content_version());
        assert_eq!(
            decoded.resources[0].resource.as_ref().unwrap().encode_to_vec(),
            body_of(r)
        );
        assert_eq!(decoded.removed_resources, ["gone"]);
        assert!(r.memo.is_empty(), "nothing kept for it");
        // Each body record a slice of the stored bytes, the made bytes
        // around them in one buffer: the head, made, r007's body, made,
        // r008's body, made, the removed name.
        let selected = |names: &[String], removed: &[&str]| {
            DELTA_BODY.encode(&Push::Selected {
                to: to.clone(),
                diff: Diff {
                    upserts: names.iter().map(|n| to.resources[n.as_str()].clone()).collect(),
                    removed: removed.iter().map(|&n| n.into()).collect(),
                },
            })
        };
        let two = parts(&selected(&["r007".into(), "r008".into()], &["gone"]));
        assert_eq!(two.len(), 7, "{two:?}");
        let within = |piece: &Bytes, whole: &[u8]| {
            let start = whole.as_ptr() as usize;
            (start..start + whole.len()).contains(&(piece.as_ptr() as usize))
        };
        assert!(within(&two[2], &r.encoded), "r007's body record as stored");
        assert!(within(&two[4], &to.resources["r008"].encoded));
        assert!(
            [&two[1], &two[3], &two[5]]
                .windows(2)
                .all(|w| w[0].as_ptr() as usize + w[0].len() == w[1].as_ptr() as usize),
            "the made bytes are one buffer"
        );
        // Too many pieces for one write: one buffer, the same records.
        for count in [MAX_PIECES / 2 - 1, MAX_PIECES / 2] {
            let names: Vec<String> = (0..count).map(|i| format!("r{i:03}")).collect();
            let encoded = selected(&names, &[]);
            let pieces = parts(&encoded).len();
            if count < MAX_PIECES / 2 {
                assert_eq!(pieces, 2 * count + 2, "pieces of {count}");
            } else {
                assert!(pieces <= 3, "{count} in {pieces} pieces");
            }
            let decoded =
                DeltaDiscoveryResponse::decode(response(encoded, suffix(Some((4, C)), (5, "1"), None))).unwrap();
            assert_eq!(decoded.resources.len(), count);
            let last = &to.resources[names[count - 1].as_str()];
            assert_eq!(decoded.resources[count - 1].name, *last.name);
            assert_eq!(decoded.resources[count - 1].version, last.content_version());
            assert_eq!(
                decoded.resources[count - 1].resource.as_ref().unwrap().encode_to_vec(),
                body_of(last)
            );
        }
        // Whole, for a wildcard client: the same records, nothing kept per
        // resource either.
        DELTA_BODY.full(&to);
        assert!(to.resources["r050"].memo.is_empty());
    }

    /// A body record is sent as stored only where it is the record the
    /// gateway would write; anything else is made afresh.
    #[test]
    fn a_body_record_is_sent_as_stored_only_as_written_shortest() {
        let metadata = [0x0a, 0x03, b'a', b'/', b'b'];
        let body = [0x12, 0x04, 0x0a, 0x02, b'x', b'y'];
        let cat = |parts: &[&[u8]]| parts.concat();
        let found = |bytes: &[u8]| stored_body_record(bytes).map(|r| bytes[r].to_vec());
        assert_eq!(found(&cat(&[&metadata, &body])), Some(body.to_vec()));
        assert_eq!(found(&cat(&[&body, &metadata])), Some(body.to_vec()), "in any order");
        assert_eq!(found(&metadata), None, "no body");
        assert_eq!(found(&cat(&[&metadata, &body, &body])), None, "a body twice merges");
        let long_length = [0x12, 0x84, 0x00, 0x0a, 0x02, b'x', b'y'];
        assert_eq!(
            found(&cat(&[&metadata, &long_length])),
            None,
            "a length not in its shortest form"
        );
        let long_key = [0x92, 0x00, 0x04, 0x0a, 0x02, b'x', b'y'];
        assert_eq!(
            found(&cat(&[&metadata, &long_key])),
            None,
            "a key not in its shortest form"
        );
        assert_eq!(found(&cat(&[&metadata, &body[..4]])), None, "cut short");
        // What the gateway would write, for the resources the tests store.
        let stored = resource("r", "1");
        let record = stored_body_record(&stored.encoded).expect("stored as written");
        let mut made = BytesMut::new();
        put_bytes(2, &body_of(&stored), &mut made);
        assert_eq!(stored.encoded[record], made[..]);
    }

    /// A client's own small response is made whole in one buffer, its
    /// suffix included: the same bytes as its parts and the suffix apart,
    /// in every layout that names resources (removals included); one past
    /// [`ONE_BUFFER_AT_MOST`], MCP's form (made for each response) and a
    /// response shared by every client at a version stay parts.
    #[test]
    fn a_small_named_response_is_one_buffer_of_the_bytes_its_parts_and_suffix_are() {
        let (cache, mut writer) = Cache::new();
        let body = [b'b'; 200];
        let many: Vec<_> = (0..40)
            .map(|i| resource_with_body(&format!("r{i:02}"), "1", &body))
            .collect();
        writer.apply(C, Update::Full(many), Origin::Upstream);
        let to = cache.get(C).unwrap();
        let selected = |names: &[&str], removed: &[&str]| Push::Selected {
            to: to.clone(),
            diff: Diff {
                upserts: names.iter().map(|n| to.resources[*n].clone()).collect(),
                removed: removed.iter().map(|n| SharedStr::from(*n)).collect(),
            },
        };
        let suffix_of = Suffix::new(Some((4, C)), (5, "17"), None);
        let whole = |(shared, suffix): (Shared, Bytes)| response(shared, suffix);
        let apart = |layout: &Layout, push: &Push| response(layout.encode(push), suffix_of.bytes());
        let few = ["r01", "r02"];
        let past: Vec<String> = (0..20).map(|i| format!("r{i:02}")).collect();
        let past: Vec<&str> = past.iter().map(String::as_str).collect();
        for (layout, removes) in [
            (XDS_BODY, false),
            (XDS_MCP, false),
            (DELTA_BODY, true),
            (DELTA_MCP, true),
        ] {
            let removed: &[&str] = if removes { &["gone-1", "gone-2"] } else { &[] };
            let push = selected(&few, removed);
            let (shared, suffix) = layout.response(&push, suffix_of);
            assert!(matches!(shared, Shared::One(_)), "{}: one buffer", layout.full_key);
            assert!(suffix.is_empty(), "{}: the suffix inside it", layout.full_key);
            assert_eq!(
                whole((shared, suffix)),
                apart(&layout, &push),
                "{}: the same bytes",
                layout.full_key
            );
            // Past the bound: parts, the suffix apart, the same bytes.
            let push = selected(&past, removed);
            let (shared, suffix) = layout.response(&push, suffix_of);
            assert!(
                !matches!(shared, Shared::One(_)),
                "{}: parts past the bound",
                layout.full_key
            );
            assert_eq!(suffix, suffix_of.bytes());
            assert_eq!(whole((shared, suffix)), apart(&layout, &push));
        }
        // MCP's form, and what every client at a version shares: parts.
        for (layout, push) in [
            (RESOURCES, selected(&few, &[])),
            (XDS_BODY, Push::Full { to: to.clone() }),
        ] {
            let (shared, suffix) = layout.response(&push, suffix_of);
            assert!(!matches!(shared, Shared::One(_)), "{}", layout.full_key);
            assert_eq!(whole((shared, suffix)), apart(&layout, &push));
        }
        // Decoded as Envoy reads it.
        let decoded = crate::proto::envoy::service::discovery::v3::DeltaDiscoveryResponse::decode(whole(
            DELTA_BODY.response(&selected(&few, &["gone-1"]), suffix_of),
        ))
        .unwrap();
        assert_eq!(decoded.resources.len(), 2);
        assert_eq!(decoded.removed_resources, ["gone-1"]);
        assert_eq!((decoded.type_url.as_str(), decoded.nonce.as_str()), (C, "17"));
    }

    /// Envoy's EDS and RDS: each client names its own resources. Its
    /// response is assembled from each resource's field: Envoy's bodies are
    /// the stored bytes themselves (nothing made, nothing kept per
    /// resource); a form that must be made (MCP over xDS) is made once per
    /// content version and shared by every client, and once a wildcard
    /// client reads the collection it is a slice of the chunk's (one copy of
    /// the form). A resource nobody reads in a form holds nothing.
    #[test]
    fn named_responses_share_each_resources_field() {
        use crate::proto::envoy::service::discovery::v3::DiscoveryResponse;
        let (cache, mut writer) = Cache::new();
        let many: Vec<_> = (0..300).map(|i| resource(&format!("r{i:03}"), "1")).collect();
        writer.apply(C, Update::Full(many), Origin::Upstream);
        let to = cache.get(C).unwrap();
        let named = |names: &[&str]| Diff {
            upserts: names.iter().map(|n| to.resources[*n].clone()).collect(),
            removed: Vec::new(),
        };
        let within = |piece: &Bytes, whole: &[u8]| {
            let start = whole.as_ptr() as usize;
            (start..start + whole.len()).contains(&(piece.as_ptr() as usize))
        };
        let one = XDS_BODY.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&["r001", "r002"]),
        });
        assert_eq!(parts(&one).len(), 3, "the head and one piece per resource");
        assert!(
            within(&parts(&one)[2], &to.resources["r002"].encoded),
            "r002's body record as stored"
        );
        assert!(to.resources["r002"].memo.is_empty(), "nothing made or kept for it");
        let decoded = DiscoveryResponse::decode(response(one, suffix(Some((4, C)), (5, "1"), None))).unwrap();
        assert_eq!(decoded.version_info, *to.version);
        assert_eq!(decoded.resources.len(), 2);
        assert_eq!(decoded.resources[0].encode_to_vec(), body_of(&to.resources["r001"]));
        // A wildcard client reads the chunks: the named pieces stay as stored.
        XDS_BODY.full(&to);
        let again = XDS_BODY.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&["r002"]),
        });
        assert!(within(&parts(&again)[1], &to.resources["r002"].encoded));
        assert!(to.resources["r002"].memo.is_empty());

        // MCP over xDS: the form is made once and shared.
        let one = XDS_MCP.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&["r011", "r012"]),
        });
        let other = XDS_MCP.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&["r012", "r013"]),
        });
        assert_eq!(
            parts(&one)[2].as_ptr(),
            parts(&other)[1].as_ptr(),
            "r012's field is shared, not made again"
        );
        assert!(to.resources["r100"].memo.is_empty(), "nobody read r100");
        // A wildcard client reads the chunks' pieces: nothing is kept per
        // resource for them.
        XDS_MCP.full(&to);
        assert!(to.resources["r100"].memo.is_empty(), "nothing kept for r100");
        // Envoy's 50 endpoints by name: each its stored piece, no copy.
        let names: Vec<String> = (0..50).map(|i| format!("r{i:03}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let fifty = XDS_BODY.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&names),
        });
        assert_eq!(parts(&fifty).len(), 51, "the head and 50 pieces");
        assert!(within(&parts(&fifty)[50], &to.resources["r049"].encoded));
        // Too many pieces for one write: one buffer.
        let names: Vec<String> = (0..=MAX_PIECES).map(|i| format!("r{i:03}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let many = XDS_BODY.encode(&Push::Selected {
            to: to.clone(),
            diff: named(&names),
        });
        assert!(parts(&many).len() <= 3, "{}", parts(&many).len());
        let decoded = DiscoveryResponse::decode(response(many, suffix(Some((4, C)), (5, "2"), None))).unwrap();
        assert_eq!(decoded.resources.len(), MAX_PIECES + 1);
    }

    /// istiod's form (MCP over xDS, both protocols) is the stored `Resource`
    /// as a slice of the cache, its metadata overridden by a record after
    /// it: decoded, it is what the resource with its metadata rewritten
    /// decodes to (content version; the source's `create_time` kept, the
    /// epoch where it gave none), and a big resource's bytes are not copied.
    #[test]
    fn istiods_form_is_the_stored_resource_with_its_metadata_overridden_not_a_copy() {
        use crate::proto::envoy::service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse};
        use crate::proto::{Metadata, Resource};
        let big = |name: &str, create_time: Option<prost_types::Timestamp>| {
            let encoded: Bytes = Resource {
                metadata: Some(Metadata {
                    name: name.into(),
                    create_time,
                    version: "v9".into(),
                    labels: [("app".to_owned(), "web".to_owned())].into(),
                    annotations: [("a".to_owned(), "b".to_owned())].into(),
                }),
                body: Some(prost_types::Any {
                    type_url: "type.googleapis.com/x.Y".into(),
                    value: vec![7; 1500],
                }),
            }
            .encode_to_vec()
            .into();
            let none = std::collections::HashMap::<String, String>::new();
            let digest = crate::cache::content_digest(&encoded, &none, &none);
            CachedResource::new(name.into(), encoded, digest)
        };
        let (cache, mut writer) = Cache::new();
        let timed = prost_types::Timestamp { seconds: 42, nanos: 7 };
        writer.apply(
            C,
            Update::Full(vec![
                big("a-timed", Some(timed)),
                big("b-untimed", None),
                resource("c-small", "1"),
            ]),
            Origin::Upstream,
        );
        let to = cache.get(C).unwrap();
        let expected = |name: &str| {
            let r = &to.resources[name];
            let any = prost_types::Any::decode(mcp_any(r, r.content_version())).unwrap();
            Resource::decode(any.value.as_slice()).unwrap()
        };
        assert_eq!(expected("a-timed").metadata.unwrap().create_time, Some(timed));

        let full = XDS_MCP.full(&to);
        for name in ["a-timed", "b-untimed"] {
            let stored = &to.resources[name].encoded;
            assert!(
                full.iter()
                    .any(|part| part.as_ptr() == stored.as_ptr() && part.len() == stored.len()),
                "{name}'s stored bytes are a piece of the response, not a copy"
            );
        }
        let small = &to.resources["c-small"].encoded;
        assert!(
            !full.iter().any(|part| part.as_ptr() == small.as_ptr()),
            "a small resource is copied among the made bytes"
        );
        let sotw = DiscoveryResponse::decode(response(full, suffix(Some((4, C)), (5, "1"), None))).unwrap();
        let read: Vec<Resource> = sotw
            .resources
            .iter()
            .map(|any| {
                assert_eq!(any.type_url, MCP_RESOURCE_TYPE_URL);
                Resource::decode(any.value.as_slice()).unwrap()
            })
            .collect();
        assert_eq!(read, ["a-timed", "b-untimed", "c-small"].map(expected));

        let delta = DELTA_MCP.full(&to);
        let delta = DeltaDiscoveryResponse::decode(response(delta, suffix(Some((4, C)), (5, "2"), None))).unwrap();
        for (got, name) in delta.resources.iter().zip(["a-timed", "b-untimed", "c-small"]) {
            assert_eq!(got.name, name);
            assert_eq!(got.version, to.resources[name].content_version());
            let any = got.resource.as_ref().unwrap();
            assert_eq!(Resource::decode(any.value.as_slice()).unwrap(), expected(name));
        }
        // By name: the same bytes as in the whole.
        let one = XDS_MCP.field(&to.resources["b-untimed"]);
        let mut record = &one[..];
        assert_eq!(
            encoding::decode_key(&mut record).unwrap(),
            (2, WireType::LengthDelimited)
        );
        let len = encoding::decode_varint(&mut record).unwrap() as usize;
        assert_eq!(len, record.len());
        let any = prost_types::Any::decode(record).unwrap();
        assert_eq!(Resource::decode(any.value.as_slice()).unwrap(), expected("b-untimed"));
    }

    /// Distinct grants' views of a snapshot (each the shared part and one
    /// resource of its own, as distinct identities get) are encoded as
    /// slices of what the whole's encodings keep, in every layout and for
    /// resources above and below the size pieces copy: a view holds no copy
    /// of what it grants, whatever its size, and reads as if encoded afresh.
    /// So does a view's change for incremental clients.
    #[test]
    fn views_of_distinct_grants_refer_to_the_whole_and_copy_nothing() {
        const LAYOUTS: [Layout; 6] = [LEGACY, RESOURCES, XDS_MCP, XDS_BODY, DELTA_MCP, DELTA_BODY];
        let concat = |parts: &[Bytes]| parts.iter().flat_map(|p| p.iter().copied()).collect::<Vec<u8>>();
        let within = |outer: &Bytes, inner: &Bytes| {
            let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
            o <= i && i + inner.len() <= o + outer.len()
        };
        for size in [5000, 600] {
            let (cache, mut writer) = Cache::new();
            let body = vec![b'x'; size];
            let named = |i: usize| {
                if i % 3 == 0 {
                    format!("own-{i:03}")
                } else {
                    format!("shared-{i:03}")
                }
            };
            let make = |name: &str, version: &str| resource_with_body(name, version, &body);
            writer.apply(
                C,
                Update::Full((0..300).map(|i| make(&named(i), "1")).collect()),
                Origin::Upstream,
            );
            let whole = cache.get(C).unwrap();
            writer.apply(
                C,
                Update::Incremental {
                    upserts: vec![make("shared-001", "2"), make("own-003", "2"), make("shared-new", "1")],
                    removed: vec!["shared-002".into(), "own-006".into()],
                },
                Origin::Upstream,
            );
            let next = cache.get(C).unwrap();
            // What everyone shares: the wholes' encodings.
            let kept: Vec<Vec<Bytes>> = LAYOUTS
                .iter()
                .flat_map(|l| [parts(&l.full(&whole)), parts(&l.full(&next))])
                .collect();
            let referred = |part: &Bytes| kept.iter().flatten().any(|k| within(k, part));
            for i in (0..300).step_by(3).take(8) {
                let own = named(i);
                let keep = |name: &str| name.starts_with("shared-") || name == own;
                let view = whole.restricted(keep);
                assert_eq!(view.len(), 201);
                assert_eq!(view.bytes_apart_from(&whole), 0, "{size}: no stored bytes of its own");
                let changed = next.restricted_after(Some((&whole, &view)), keep);
                assert_eq!(changed.version, next.restricted(keep).version);
                assert_eq!(changed.bytes_apart_from(&next), 0);
                for layout in LAYOUTS {
                    for view in [&view, &changed] {
                        let full = parts(&layout.full(view));
                        let afresh: Vec<Bytes> = std::iter::once(layout.head(view))
                            .chain(view.chunks().flat_map(|c| c.members().iter().map(|r| layout.field(r))))
                            .collect();
                        assert_eq!(concat(&full), concat(&afresh), "{size} {}", layout.full_key);
                        let own_bytes: usize = full.iter().filter(|p| !referred(p)).map(Bytes::len).sum();
                        assert_eq!(
                            own_bytes,
                            layout.head(view).len(),
                            "{size} {}: only its head",
                            layout.full_key
                        );
                    }
                    if layout.removed != 0 {
                        let diff = layout.diff(&view, &changed);
                        let made = layout.changes(&changed, &Diff::between(&view.resources, &changed.resources));
                        assert_eq!(concat(&diff), concat(&made), "{size} {}", layout.diff_key);
                        // Its own: the head, the names removed and each
                        // resource's few made bytes (a version, a name),
                        // never a resource.
                        let own: usize = diff.iter().skip(1).filter(|p| !referred(p)).map(Bytes::len).sum();
                        assert!(own <= 3 * 200, "{size} {}: {own} bytes of its own", layout.diff_key);
                    }
                }
            }
        }
    }
}
