//! The shared cache: one immutable snapshot per collection, swapped whole on
//! every apply, with a change notification per collection. It knows nothing of
//! gRPC or clients: upstream writes it, downstream streams read it.
//!
//! Snapshots share structure (a persistent ordered map): applying a full state
//! touches only the resources whose version changed, so two consecutive
//! snapshots differ in as many tree nodes as resources changed, and the diff
//! between them costs time proportional to the change.
//!
//! Resources are stored in chunks (`chunks.rs`): runs of resources, in the
//! order they arrived, whose bytes are the `resources` field of a response.
//! A change rebuilds only what it touches and every other chunk is shared
//! with the previous version. A state-of-the-world response is the version
//! field followed by the chunks; each resource's bytes are a slice of its
//! chunk, and a collection's chunks are slices of the message it arrived in,
//! so the config is held once.

pub mod chunks;
pub mod demand;
pub mod memo;
pub mod provenance;
pub mod recent;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use chunks::Chunks;
pub use chunks::{Chunk, STORAGE_FIELD};
use memo::{LazyMemo, Memo};

use bytes::Bytes;
use imbl::OrdMap;
use tokio::sync::watch;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64, Xxh3};

use crate::SharedStr;

/// One resource as the cache holds it: encoded once, when it entered.
#[derive(Debug)]
pub struct CachedResource {
    pub name: SharedStr,
    /// A whole encoded `Resource` message, written into responses as is
    /// (in the cache: a slice of its chunk). Its `metadata.version` is the
    /// resource's version ([`Self::version`]).
    pub encoded: Bytes,
    /// The content: a digest of the body, labels and annotations. A changed
    /// body under an unchanged version is a change. Two halves, not a
    /// `u128`, whose 16-byte alignment would pad the struct ([`Self::digest`]).
    digest: [u64; 2],
    /// A hash of the version, which equality compares: two versions of a
    /// collection share most resources, and a diff compares the ones a
    /// change stored anew (the same content in another chunk) by digest,
    /// name and version, which read from the bytes each time cost eds's
    /// delta streams a tenth of their CPU (BENCHMARKS, session 23).
    version_hash: u64,
    /// Encodings readers made of this resource (a protocol's form of it,
    /// shared by every response that carries it), made on first use and
    /// gone with this content.
    pub memo: LazyMemo,
}

// 72 bytes and the `Arc`'s two counts: 88 bytes asked, glibc's 96-byte
// chunk: the name one pointer (its length and count in its allocation), the
// version read from the stored bytes, where it always is (a source's, or
// the body's hash written into them when the source gave none), and only a
// hash of it kept, rather than the version itself (24 bytes inline: a
// 112-byte chunk). Each 16 bytes more costs a size class, ~1 MiB per 60,000
// resources: move this only with a commit that says why.
const _: () = assert!(std::mem::size_of::<CachedResource>() <= 72);

/// What identifies a resource's content (its body digest and its version's
/// hash), kept where the resource itself is not: the same for two resources
/// exactly when [`CachedResource::same_content`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Content {
    digest: [u64; 2],
    version_hash: u64,
}

impl CachedResource {
    /// A resource of the encoded `Resource` `encoded`, whose
    /// `metadata.version` is its version.
    pub fn new(name: SharedStr, encoded: Bytes, digest: u128) -> Self {
        Self {
            name,
            version_hash: xxh3_64(stored_version(&encoded).as_bytes()),
            encoded,
            digest: [digest as u64, (digest >> 64) as u64],
            memo: LazyMemo::default(),
        }
    }

    /// Whether `other` has the same content: the same body digest (which
    /// covers labels and annotations) and version, its name aside. The
    /// versions are compared by their 64-bit hashes, kept beside the bytes.
    pub fn same_content(&self, other: &CachedResource) -> bool {
        self.content() == other.content()
    }

    /// What [`Self::same_content`] compares, to keep without the resource.
    pub fn content(&self) -> Content {
        Content {
            digest: self.digest,
            version_hash: self.version_hash,
        }
    }

    /// Upstream `metadata.version`, or a hash of the body when that was
    /// empty: read from the stored bytes ([`stored_version`]).
    pub fn version(&self) -> &str {
        stored_version(&self.encoded)
    }

    /// The content digest: see the field.
    pub fn digest(&self) -> u128 {
        u128::from(self.digest[0]) | (u128::from(self.digest[1]) << 64)
    }

    /// This resource with bytes of its own, not a slice of its chunk.
    fn detached(&self) -> Self {
        self.repointed(Bytes::copy_from_slice(&self.encoded))
    }

    /// This resource with its bytes at `encoded` (the same bytes, stored
    /// elsewhere: in a chunk).
    fn repointed(&self, encoded: Bytes) -> Self {
        debug_assert_eq!(encoded, self.encoded);
        Self {
            name: self.name.clone(),
            version_hash: self.version_hash,
            encoded,
            digest: self.digest,
            memo: self.memo.carried(),
        }
    }

    /// This resource's share of the collection version: a hash of its name,
    /// version and digest. Computed when needed (on a change, and for xDS
    /// encodings that are memoized), not stored: 32 bytes less per resource
    /// with the padding it took.
    fn entry(&self) -> u128 {
        entry_hash(&self.name, self.version(), self.digest())
    }

    /// A version of this resource that changes whenever its name, version
    /// or content does (xDS clients skip a changed body under an unchanged
    /// version): the same on every replica and every gateway of a chain.
    pub fn content_version(&self) -> String {
        format!("{:016x}", self.entry() as u64)
    }

    /// Whether `version` is [`Self::content_version`], read without making
    /// it (a reconnecting client reports one per resource it holds).
    pub fn has_content_version(&self, version: &str) -> bool {
        version.len() == 16
            && version.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && u64::from_str_radix(version, 16).is_ok_and(|v| v == self.entry() as u64)
    }
}

/// The content digest of a resource: its body (the encoded `Any`, type URL
/// included) and its labels and annotations in key order.
pub fn content_digest<'a>(
    body: &[u8],
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
    annotations: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> u128 {
    let mut hasher = Xxh3::new();
    content_fields(body, labels, annotations, |bytes| hasher.update(bytes));
    hasher.digest128()
}

/// [`content_digest`] keyed with `key` (HMAC-SHA-256, its first 128 bits),
/// of the resource `name` of `collection`: for a sensitive collection,
/// whose versions views show and whose content a plain hash would let
/// anyone who sees one test guesses against. The collection and the name
/// are in it: two secrets of equal content have versions that do not say so.
pub fn keyed_content_digest<'a>(
    key: &ring::hmac::Key,
    collection: &str,
    name: &str,
    body: &[u8],
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
    annotations: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> u128 {
    let mut context = keyed(key, b"content", collection, name);
    content_fields(body, labels, annotations, |bytes| context.update(bytes));
    first_128(context.sign().as_ref())
}

/// [`body_version`] keyed with `key`, as [`keyed_content_digest`].
pub fn keyed_body_version(key: &ring::hmac::Key, collection: &str, name: &str, body: &[u8]) -> String {
    let mut context = keyed(key, b"version", collection, name);
    context.update(body);
    format!("{:032x}", first_128(context.sign().as_ref()))
}

/// An HMAC-SHA-256 context under `key` for `what` of `collection`'s
/// resource `name`, each length-prefixed.
fn keyed(key: &ring::hmac::Key, what: &[u8], collection: &str, name: &str) -> ring::hmac::Context {
    let mut context = ring::hmac::Context::with_key(key);
    for field in [what, collection.as_bytes(), name.as_bytes()] {
        context.update(&(field.len() as u64).to_le_bytes());
        context.update(field);
    }
    context
}

fn first_128(tag: &[u8]) -> u128 {
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&tag[..16]);
    u128::from_le_bytes(bytes)
}

/// The content of a resource as a sequence of length-prefixed fields: its
/// body, then its labels and annotations in key order.
fn content_fields<'a>(
    body: &[u8],
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
    annotations: impl IntoIterator<Item = (&'a String, &'a String)>,
    mut update: impl FnMut(&[u8]),
) {
    let mut field = |bytes: &[u8]| {
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        update(&(bytes.len() as u64).to_le_bytes());
        update(bytes);
    };
    field(body);
    for map in [
        labels.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
        annotations.into_iter().collect(),
    ] {
        field(&(map.len() as u64).to_le_bytes());
        for (key, value) in map {
            field(key.as_bytes());
            field(value.as_bytes());
        }
    }
}

/// The `metadata.version` (field 3 of field 1) of an encoded `Resource`,
/// read in place: the last one given, as protobuf's merge of a message
/// field given twice reads it; "" where there is none, or for bytes that do
/// not read as a `Resource` (a source's resources were decoded when they
/// entered, so their versions are UTF-8). The cache keeps a resource's
/// version only in its bytes: 24 bytes less per resource, a malloc size
/// class smaller.
fn stored_version(encoded: &[u8]) -> &str {
    const METADATA: u32 = 1;
    const VERSION: u32 = 3;
    let mut version: &[u8] = &[];
    for_each_bytes_field(encoded, |number, metadata| {
        if number == METADATA {
            for_each_bytes_field(metadata, |number, value| {
                if number == VERSION {
                    version = value;
                }
            });
        }
    });
    std::str::from_utf8(version).unwrap_or_default()
}

/// Calls `each` with the number and payload of each length-delimited field
/// of `message`, in order, until its end or the first bytes that do not
/// read as a field.
fn for_each_bytes_field<'a>(message: &'a [u8], mut each: impl FnMut(u32, &'a [u8])) {
    use prost::encoding::{decode_key, decode_varint, WireType};
    let mut rest = message;
    while !rest.is_empty() {
        let Ok((number, wire_type)) = decode_key(&mut rest) else {
            return;
        };
        let len = match wire_type {
            WireType::Varint => match decode_varint(&mut rest) {
                Ok(_) => continue,
                Err(_) => return,
            },
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            WireType::LengthDelimited => match decode_varint(&mut rest).ok().and_then(|l| usize::try_from(l).ok()) {
                Some(len) => len,
                None => return,
            },
            WireType::StartGroup | WireType::EndGroup => return,
        };
        let Some((value, after)) = rest.split_at_checked(len) else {
            return;
        };
        if wire_type == WireType::LengthDelimited {
            each(number, value);
        }
        rest = after;
    }
}

fn entry_hash(name: &str, version: &str, digest: u128) -> u128 {
    let mut hasher = Xxh3::new();
    hasher.update(&(name.len() as u64).to_le_bytes());
    hasher.update(name.as_bytes());
    hasher.update(&(version.len() as u64).to_le_bytes());
    hasher.update(version.as_bytes());
    hasher.update(&digest.to_le_bytes());
    hasher.digest128()
}

/// Resources are the same when their name, version and content are: a
/// source that reuses a version for new content (a restarted counter, a file
/// edited but its `version:` kept) still changes the resource.
impl PartialEq for CachedResource {
    fn eq(&self, other: &Self) -> bool {
        self.same_content(other) && self.name == other.name
    }
}

// An equivalence (equal digests, names and versions): with it, `Arc`'s
// equality compares pointers first, so a diff reads the content of none of
// the resources two versions share.
impl Eq for CachedResource {}

pub type ResourceMap = OrdMap<SharedStr, Arc<CachedResource>>;

/// Where a collection's current state came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    Upstream,
    Disk,
    Files,
    /// No source serves it: an empty answer to a client's type (xDS).
    Unserved,
}

/// A collection at one version. Immutable: a change makes a new snapshot.
#[derive(Debug)]
pub struct CollectionSnapshot {
    pub collection: SharedStr,
    pub version: SharedStr,
    pub resources: ResourceMap,
    /// The sum of the resources' entry hashes, kept as resources change so a
    /// version costs the change, not the collection.
    content_sum: u128,
    /// Sum of the encoded resources' sizes.
    pub bytes: usize,
    pub updated_at: SystemTime,
    /// `updated_at` on the monotonic clock, for push latency.
    pub applied_at: tokio::time::Instant,
    pub origin: Origin,
    chunks: Chunks,
    /// Encodings readers made of this snapshot (responses, diffs).
    pub memo: Memo,
    /// Whether a response of this version above the legacy clients' limit
    /// was logged: once per version, not once per client.
    pub oversized_logged: std::sync::atomic::AtomicBool,
    /// A view of a snapshot (a grant's part of it, or one with removals
    /// held back), made for some clients: its encodings refer to what the
    /// snapshot's keep rather than copy it.
    view: bool,
    /// What the last few applies stored anew and removed, by name (see
    /// [`Self::resource`]).
    recent: recent::Recent,
    /// The version this snapshot was applied on and the names the apply
    /// upserted or removed (see [`Self::changed_from`]).
    applied: Option<AppliedStep>,
}

/// What an apply changed from the snapshot it was applied on: that
/// snapshot's version, and the names it upserted or removed, sorted.
#[derive(Debug)]
struct AppliedStep {
    from: SharedStr,
    changed: Box<[SharedStr]>,
    /// What a reader made of the step, once ([`CollectionSnapshot::step_made`]).
    made: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

/// Names a snapshot keeps of what its apply changed at most
/// ([`CollectionSnapshot::changed_from`]): a quarter of its collection (a
/// larger change is a large part of it, which a reader diffs), at least
/// [`STEP_NAMES_MIN`] and at most [`STEP_NAMES_MAX`]. A pointer each: at
/// most 128 KiB a snapshot, 800 bytes for eds's 1 % of 10,000 changing.
pub fn step_names(collection: usize) -> usize {
    (collection / 4).clamp(STEP_NAMES_MIN, STEP_NAMES_MAX)
}

const STEP_NAMES_MIN: usize = 64;
const STEP_NAMES_MAX: usize = 1 << 14;

impl CollectionSnapshot {
    #[allow(clippy::too_many_arguments)]
    fn new(
        collection: SharedStr,
        resources: ResourceMap,
        content_sum: u128,
        chunks: Chunks,
        bytes: usize,
        origin: Origin,
    ) -> Self {
        let version: SharedStr = version_from_sum(content_sum, resources.len()).into();
        Self {
            version,
            bytes,
            collection,
            resources,
            content_sum,
            updated_at: SystemTime::now(),
            applied_at: tokio::time::Instant::now(),
            origin,
            chunks,
            memo: Memo::default(),
            oversized_logged: Default::default(),
            view: false,
            recent: recent::Recent::default(),
            applied: None,
        }
    }

    /// The names an apply on `version`'s snapshot upserted or removed to
    /// make this one (at most [`step_names`]), sorted: every name whose
    /// content differs between the two is among them (with any it added
    /// and removed again), so a reader finds what changed by looking
    /// them up, without a diff's walk of every part of both maps the
    /// change left alone. `None`: unknown here (stored afresh, a view, a
    /// version rebuilt from the history, another predecessor); diff.
    pub fn changed_from(&self, version: &str) -> Option<&[SharedStr]> {
        self.applied
            .as_ref()
            .filter(|applied| *applied.from == *version)
            .map(|applied| &*applied.changed)
    }

    /// What `make` makes of the step from `version` to this snapshot, made
    /// once and kept with the step, where this snapshot was applied on
    /// `version`'s (as [`Self::changed_from`] says); `None` otherwise, or
    /// where what is kept is of another type. For what every reader at the
    /// version before looks up (the names that changed, for each named
    /// client a version touches): a field of its own, not among
    /// [`Self::memo`]'s entries, which a reader finds under a lock by a
    /// walk of them (about 150 instructions a response of eds; BENCHMARKS,
    /// session 39).
    pub fn step_made<T: std::any::Any + Send + Sync>(&self, version: &str, make: impl FnOnce() -> T) -> Option<Arc<T>> {
        let applied = self.applied.as_ref().filter(|applied| *applied.from == *version)?;
        let made = applied.made.get_or_init(|| Arc::new(make()));
        made.clone().downcast().ok()
    }

    /// The resource named `name`, as [`Self::resources`] holds it: found
    /// among what the last few applies stored anew where they stored it
    /// (a hash probe or two), else looked up in the map. How a reader
    /// whose weak reference the cache let go (the resource moved to
    /// another chunk, or changed) finds it again (see [`recent`]).
    pub fn resource(&self, name: &str) -> Option<Arc<CachedResource>> {
        match self.recent.find(name) {
            Some(found) => {
                debug_assert_eq!(
                    found.as_ref().map(Arc::as_ptr),
                    self.resources.get(name).map(Arc::as_ptr),
                    "the window's newest record of {name:?} is what the snapshot holds"
                );
                found
            }
            None => self.resources.get(name).cloned(),
        }
    }

    /// A collection with nothing in it, for a type no source serves: it is
    /// answered (empty) and never changes. Not in the cache.
    pub fn empty(collection: SharedStr) -> Arc<Self> {
        Arc::new(Self::new(
            collection,
            ResourceMap::default(),
            0,
            Chunks::default(),
            0,
            Origin::Unserved,
        ))
    }

    /// The part of this snapshot whose names `keep` keeps (an access
    /// policy's view of it): a snapshot of its own, with this one's times
    /// and origin. Its version follows the same content rule, so clients
    /// (and replicas) restricted alike see one version, and keeping
    /// everything is this very snapshot.
    ///
    /// A view holds references, not copies: its resources are this one's
    /// (the same `Arc`s, so what readers keep with a resource is shared
    /// too), its chunks this one's or runs of them ([`Chunks::restricted`]),
    /// and its map shares this one's nodes where it keeps most of them. What
    /// a view costs is a few pointers per name it keeps, whatever the
    /// resources' size.
    ///
    /// `base`: an earlier whole snapshot of the collection and the view
    /// `keep` made of it. The view is then made from it at the cost of the
    /// change (its map and chunks shared), and is that view itself when
    /// nothing it keeps changed.
    pub fn restricted_after(
        self: &Arc<Self>,
        base: Option<(&CollectionSnapshot, &Arc<CollectionSnapshot>)>,
        keep: impl Fn(&str) -> bool,
    ) -> Arc<CollectionSnapshot> {
        match base.filter(|(whole, view)| whole.collection == self.collection && view.collection == self.collection) {
            Some((whole, view)) => self.restricted_from(whole, view, keep),
            None => self.restricted(keep),
        }
    }

    /// [`Self::restricted_after`] without a base.
    pub fn restricted(self: &Arc<Self>, keep: impl Fn(&str) -> bool) -> Arc<CollectionSnapshot> {
        let mut withheld: Vec<SharedStr> = Vec::new();
        let chunks = self.chunks.restricted(
            |resource| {
                let kept = keep(&resource.name);
                if !kept {
                    withheld.push(resource.name.clone());
                }
                kept
            },
            None,
        );
        if withheld.is_empty() {
            return self.clone();
        }
        let kept = || chunks.iter().flat_map(|c| c.members().iter());
        let resources = if withheld.len() * 2 <= self.resources.len() {
            // Most of it: this map without the rest, sharing every node the
            // rest is not in (names a grant keeps are mostly runs in name
            // order: a prefix, a namespace).
            let mut resources = self.resources.clone();
            for name in &withheld {
                resources.remove(&**name);
            }
            resources
        } else {
            packed_map(kept().cloned())
        };
        let (mut sum, mut bytes) = (0u128, 0usize);
        for resource in kept() {
            sum = sum.wrapping_add(resource.entry());
            bytes += resource.encoded.len();
        }
        self.view(resources, sum, chunks, bytes)
    }

    /// The view `keep` makes of this snapshot, from `view`, the one it made
    /// of `whole`: what changed from `whole` to this one and `keep` keeps is
    /// taken in, the rest of `view` shared.
    fn restricted_from(
        self: &Arc<Self>,
        whole: &CollectionSnapshot,
        view: &Arc<CollectionSnapshot>,
        keep: impl Fn(&str) -> bool,
    ) -> Arc<CollectionSnapshot> {
        let diff = Diff::between(&whole.resources, &self.resources);
        let mut resources = view.resources.clone();
        let mut total = Total::of(view);
        for resource in diff.upserts.iter().filter(|r| keep(&r.name)) {
            total.upsert(&mut resources, resource);
        }
        for name in diff.removed.iter().filter(|n| keep(n)) {
            total.remove(&mut resources, name);
        }
        // Nothing it keeps changed: it is that view itself, unless the
        // change moved what it keeps to other chunks (a cut chunk's rest
        // stored anew). A view handed on as this snapshot's must refer to
        // this snapshot's chunks, as the next change reads it so (what it
        // kept of a chunk both have is what it keeps of it now).
        if total.changed.is_empty() && view.refers_to_chunks_of(self) {
            return view.clone();
        }
        if resources.len() == self.resources.len() {
            // It keeps everything now: the whole, stored once.
            return self.clone();
        }
        // What it keeps of the chunks that changed: a resource the change
        // moved to another chunk (the same content, stored anew) is taken
        // as that chunk holds it, so the map and the chunks hold one `Arc`.
        let mut fresh = Vec::new();
        let chunks = self.chunks.restricted(
            |resource| {
                let kept = keep(&resource.name);
                if kept {
                    fresh.push(resource.clone());
                }
                kept
            },
            Some((&whole.chunks, &view.chunks)),
        );
        for resource in fresh {
            if resources
                .get(&*resource.name)
                .is_none_or(|held| !Arc::ptr_eq(held, &resource))
            {
                resources.insert(resource.name.clone(), resource);
            }
        }
        debug_assert_eq!(chunks.iter().map(|c| c.members().len()).sum::<usize>(), resources.len());
        self.view(resources, total.sum, chunks, total.bytes)
    }

    /// Whether each of this view's chunks is one of `whole`'s chunks or a
    /// run of one.
    fn refers_to_chunks_of(&self, whole: &CollectionSnapshot) -> bool {
        let chunks: HashSet<*const Chunk> = whole.chunks().map(Arc::as_ptr).collect();
        self.chunks().all(|chunk| chunks.contains(&chunk.of_whole()))
    }

    /// Bytes of this snapshot's chunks that are not slices of `whole`'s:
    /// what a view of `whole` stores of its own (nothing, as views are
    /// made; a copy of what it keeps, were it copied).
    pub fn bytes_apart_from(&self, whole: &CollectionSnapshot) -> usize {
        let within = |bytes: &Bytes| {
            let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
            whole.chunks().any(|c| {
                let at = c.bytes().as_ptr() as usize;
                at <= start && end <= at + c.bytes().len()
            })
        };
        self.chunks()
            .filter(|c| !within(c.bytes()))
            .map(|c| c.bytes().len())
            .sum()
    }

    /// This snapshot with the resources of `held` that it no longer has put
    /// back: the "make" half of a change whose "break" half must wait (make
    /// before break across Envoy's types, see `downstream::order`). Its
    /// version follows the content rule, so every replica makes the same
    /// one, and it is made at the cost of the removals; this very snapshot
    /// when it removes nothing.
    pub fn keeping(self: &Arc<Self>, held: &CollectionSnapshot) -> Arc<CollectionSnapshot> {
        self.keeping_only(held, |_| true)
    }

    /// As [`Self::keeping`], keeping only the removed resources `keep`
    /// chooses (the rest go now).
    pub fn keeping_only(
        self: &Arc<Self>,
        held: &CollectionSnapshot,
        keep: impl Fn(&str) -> bool,
    ) -> Arc<CollectionSnapshot> {
        let mut diff = Diff::between(&held.resources, &self.resources);
        diff.removed.retain(|name| keep(name));
        if diff.removed.is_empty() {
            return self.clone();
        }
        let mut resources = self.resources.clone();
        let mut total = Total::of(self);
        for name in &diff.removed {
            if let Some(resource) = held.resources.get(&**name) {
                total.upsert(&mut resources, resource);
            }
        }
        self.view_from(self, resources, total)
    }

    /// A view of this snapshot holding `resources`: `base` (of the same
    /// collection) after `total`'s changes, its chunks shared but where they
    /// changed.
    fn view_from(
        &self,
        base: &CollectionSnapshot,
        mut resources: ResourceMap,
        total: Total,
    ) -> Arc<CollectionSnapshot> {
        let Total {
            sum,
            bytes,
            mut changed,
        } = total;
        changed.sort_unstable();
        changed.dedup();
        let chunks = rechunk(&base.chunks, &base.resources, &mut resources, &changed).chunks;
        self.view(resources, sum, chunks, bytes)
    }

    /// A view of this snapshot holding `resources`, with this one's times and
    /// origin.
    fn view(&self, resources: ResourceMap, sum: u128, chunks: Chunks, bytes: usize) -> Arc<CollectionSnapshot> {
        // With an empty window of its own, never this one's: see `recent`.
        let mut view = CollectionSnapshot::new(self.collection.clone(), resources, sum, chunks, bytes, self.origin);
        view.updated_at = self.updated_at;
        view.applied_at = self.applied_at;
        view.view = true;
        Arc::new(view)
    }

    /// Whether this is a view of a snapshot made for some clients (a
    /// grant's part of it, or one with removals held back), not a version
    /// of the collection.
    pub fn is_view(&self) -> bool {
        self.view
    }

    /// The chunks that hold the resources, in their order (the order the
    /// resources arrived in, changes at the end).
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = &Arc<Chunk>> + '_ {
        self.chunks.iter()
    }

    /// How many chunks hold the resources.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    pub fn len(&self) -> usize {
        self.resources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.resources.is_empty()
    }
}

/// The collection version of a resource map: the same content gives the same
/// version on every replica, and any change of a name, version or content
/// changes it.
pub fn collection_version(resources: &ResourceMap) -> String {
    let sum = resources.values().fold(0u128, |sum, r| sum.wrapping_add(r.entry()));
    version_from_sum(sum, resources.len())
}

/// The collection version of `(name, resource version, content digest)`
/// entries, in any order: what a client sees as `version_info` for that
/// content (tools and tests predict versions with it).
pub fn version_of_entries<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str, u128)>) -> String {
    let mut count = 0;
    let sum = entries.into_iter().fold(0u128, |sum, (name, version, digest)| {
        count += 1;
        sum.wrapping_add(entry_hash(name, version, digest))
    });
    version_from_sum(sum, count)
}

/// A commutative sum of per-resource hashes, mixed with the count and hashed
/// once more so versions look alike whatever the content.
fn version_from_sum(sum: u128, count: usize) -> String {
    let mut bytes = [0u8; 24];
    bytes[..16].copy_from_slice(&sum.to_le_bytes());
    bytes[16..].copy_from_slice(&(count as u64).to_le_bytes());
    format!("{:032x}", xxh3_128(&bytes))
}

/// The version of a resource whose source gave none: a hash of its body.
pub fn body_version(body: &[u8]) -> String {
    format!("{:032x}", xxh3_128(body))
}

/// A change to one collection, its resources as values or already in the
/// `Arc`s the cache shares them by (a source's decoder makes those, so a
/// large update is not held twice while it is taken in).
#[derive(Debug)]
pub enum Update<R = CachedResource> {
    /// The complete state: replaces the collection.
    Full(Vec<R>),
    /// Upserts and removals against the current state (unknown names in
    /// `removed` are ignored).
    Incremental { upserts: Vec<R>, removed: Vec<String> },
}

/// What an apply did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The content changed; readers were notified.
    Changed { version: SharedStr },
    /// The content equals what the cache held: nobody was notified.
    Unchanged { version: SharedStr },
}

impl Applied {
    pub fn version(&self) -> &SharedStr {
        match self {
            Applied::Changed { version } | Applied::Unchanged { version } => version,
        }
    }
}

type Slot = watch::Sender<Option<Arc<CollectionSnapshot>>>;

/// How many versions of each collection the history keeps when not told
/// (`--history`).
pub const DEFAULT_HISTORY: usize = 10;

/// One version of a collection in its history, as `/debug/history` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub version: SharedStr,
    pub updated_at: SystemTime,
    pub origin: Origin,
    pub resources: usize,
    pub bytes: usize,
    /// What the apply that made this version did to the one before it.
    pub added: usize,
    pub changed: usize,
    pub removed: usize,
}

/// A version the history keeps. The newest holds its snapshot; each older
/// one holds only how to turn the next newer version's resources back into
/// its own (`undo`: a name and the resource it had, or `None` where it had
/// none), so a version costs what changed after it, not the collection.
#[derive(Debug)]
struct Kept {
    entry: HistoryEntry,
    undo: Vec<(SharedStr, Option<Arc<CachedResource>>)>,
    snapshot: Option<Arc<CollectionSnapshot>>,
}

/// A version of a collection's history as it is kept elsewhere
/// (`--cache-dir`): its entry, and how to turn the next newer version's
/// resources back into its own (empty for the newest).
#[derive(Clone, Debug)]
pub struct KeptVersion {
    pub entry: HistoryEntry,
    pub undo: Vec<(SharedStr, Option<Arc<CachedResource>>)>,
}

/// A version being rebuilt from the history, one undo at a time from the
/// newest: its resources, their collection-version sum and size (kept as
/// each undo applies, so a version costs its changes), and the names where
/// they differ from the newest's (unsorted, repeats possible).
struct Rebuilt {
    resources: ResourceMap,
    sum: u128,
    bytes: usize,
    changed: Vec<SharedStr>,
}

impl Rebuilt {
    fn from_newest(newest: &CollectionSnapshot) -> Self {
        Self {
            resources: newest.resources.clone(),
            sum: newest.content_sum,
            bytes: newest.bytes,
            changed: Vec::new(),
        }
    }

    /// One version further back: the older version's undo applied.
    fn undo(&mut self, undo: &[(SharedStr, Option<Arc<CachedResource>>)]) {
        for (name, had) in undo {
            let replaced = match had {
                Some(resource) => self.resources.insert(name.clone(), resource.clone()),
                None => self.resources.remove(&**name),
            };
            if let Some(old) = replaced {
                self.sum = self.sum.wrapping_sub(old.entry());
                self.bytes -= old.encoded.len();
            }
            if let Some(resource) = had {
                self.sum = self.sum.wrapping_add(resource.entry());
                self.bytes += resource.encoded.len();
            }
            self.changed.push(name.clone());
        }
    }

    /// The content version of what was rebuilt.
    fn version(&self) -> String {
        version_from_sum(self.sum, self.resources.len())
    }
}

/// The last versions of one collection, oldest first.
type History = std::collections::VecDeque<Kept>;

/// The collections, each behind its own change notification. Shared by
/// every reader; written only through the one [`CacheWriter`].
#[derive(Debug, Default)]
pub struct Cache {
    // Held only to find or create a slot, never across an await.
    slots: RwLock<HashMap<SharedStr, Slot>>,
    /// Bumped on every change to any collection (readiness follows it).
    generation: watch::Sender<u64>,
    provenance: provenance::Provenance,
    /// The last versions of each collection. Written by the one writer
    /// after its slot; held only to copy or push, never across an await.
    histories: RwLock<HashMap<SharedStr, History>>,
    /// Versions kept per collection, the current one included (at least 1;
    /// 0 only in a `Default` cache, read as 1).
    history_len: usize,
    /// Held (write) while one step of a source changes several collections,
    /// and (read) while [`Cache::snapshots`] lists them: whoever lists the
    /// cache sees all of a step or none of it. Never held across an await.
    step: RwLock<()>,
}

/// The one handle that writes the cache. Not `Clone`: whoever holds it is
/// the source (the upstream session, the dial-out source that holds the slot,
/// the local files), and there is no second one.
#[derive(Debug)]
pub struct CacheWriter {
    cache: Arc<Cache>,
    /// Inside [`CacheWriter::step`]: whether an apply changed something,
    /// whom the step wakes once at its end.
    stepping: Option<bool>,
}

// === impl Cache ===

impl Cache {
    /// A new, empty cache and its writer.
    #[allow(clippy::new_ret_no_self)]
    pub fn new() -> (Arc<Cache>, CacheWriter) {
        Self::with_history(DEFAULT_HISTORY)
    }

    /// A new, empty cache that keeps the last `versions` versions of each
    /// collection (at least one: the current).
    pub fn with_history(versions: usize) -> (Arc<Cache>, CacheWriter) {
        let cache = Arc::new(Cache {
            history_len: versions.max(1),
            ..Cache::default()
        });
        (cache.clone(), CacheWriter { cache, stepping: None })
    }

    /// Versions kept per collection.
    pub fn history_len(&self) -> usize {
        self.history_len.max(1)
    }

    /// The versions of `collection` the history holds, newest first; `None`
    /// for a collection never delivered.
    pub fn history(&self, collection: &str) -> Option<Vec<HistoryEntry>> {
        let histories = self.histories.read().expect("cache lock poisoned");
        histories
            .get(collection)
            .map(|h| h.iter().rev().map(|k| k.entry.clone()).collect())
    }

    /// (versions kept, bytes of the resources the older versions hold
    /// beyond the newest) of `collection`'s history.
    pub fn history_usage(&self, collection: &str) -> (usize, usize) {
        let histories = self.histories.read().expect("cache lock poisoned");
        histories.get(collection).map_or((0, 0), |h| {
            let bytes = h
                .iter()
                .flat_map(|k| k.undo.iter().filter_map(|(_, had)| had.as_ref()))
                .map(|r| r.encoded.len())
                .sum();
            (h.len(), bytes)
        })
    }

    /// `collection`'s history as it can be kept elsewhere: the newest
    /// snapshot and every version, oldest first, the newest's included (taken
    /// together, so the two always agree).
    pub fn export_history(&self, collection: &str) -> Option<(Arc<CollectionSnapshot>, Vec<KeptVersion>)> {
        let histories = self.histories.read().expect("cache lock poisoned");
        let history = histories.get(collection)?;
        let newest = history.back()?.snapshot.clone()?;
        let versions = history
            .iter()
            .map(|k| KeptVersion {
                entry: k.entry.clone(),
                undo: k.undo.clone(),
            })
            .collect();
        Some((newest, versions))
    }

    /// The resources of version `version` of `collection`, if the history
    /// still holds it: the newest's, with the undos of every newer version
    /// applied (the cost is the changes since, and the map shares the rest
    /// with the newest).
    pub fn version_resources(&self, collection: &str, version: &str) -> Option<ResourceMap> {
        self.rebuild(collection, version)
            .map(|(rebuilt, _, _)| rebuilt.resources)
    }

    /// Version `version` of `collection` as a snapshot clients can be served
    /// (a pin): the newest itself, or an older one rebuilt from the history,
    /// its chunks shared with the newest's where nothing changed since.
    /// `None` once the history no longer holds it.
    pub fn version_snapshot(&self, collection: &str, version: &str) -> Option<Arc<CollectionSnapshot>> {
        let (mut rebuilt, newest, entry) = self.rebuild(collection, version)?;
        if rebuilt.changed.is_empty() {
            return Some(newest);
        }
        rebuilt.changed.sort_unstable();
        rebuilt.changed.dedup();
        let chunks = rechunk(
            &newest.chunks,
            &newest.resources,
            &mut rebuilt.resources,
            &rebuilt.changed,
        )
        .chunks;
        let mut snapshot = CollectionSnapshot::new(
            newest.collection.clone(),
            rebuilt.resources,
            rebuilt.sum,
            chunks,
            rebuilt.bytes,
            entry.origin,
        );
        snapshot.updated_at = entry.updated_at;
        debug_assert_eq!(snapshot.version, entry.version);
        Some(Arc::new(snapshot))
    }

    /// Walks `collection`'s history back from the newest to `version`: the
    /// rebuilt resources and the names that differ from the newest's, the
    /// newest snapshot, and the version's entry.
    fn rebuild(&self, collection: &str, version: &str) -> Option<(Rebuilt, Arc<CollectionSnapshot>, HistoryEntry)> {
        let histories = self.histories.read().expect("cache lock poisoned");
        let history = histories.get(collection)?;
        let newest = history.back()?.snapshot.clone()?;
        let mut rebuilt = Rebuilt::from_newest(&newest);
        for at in (0..history.len()).rev() {
            if &*history[at].entry.version == version {
                return Some((rebuilt, newest, history[at].entry.clone()));
            }
            if let Some(older) = history.get(at.wrapping_sub(1)) {
                rebuilt.undo(&older.undo);
            }
        }
        None
    }

    /// The newest version's content, now from `snapshot`'s origin.
    fn reorigin(&self, snapshot: &Arc<CollectionSnapshot>) {
        let mut histories = self.histories.write().expect("cache lock poisoned");
        if let Some(newest) = histories.get_mut(&snapshot.collection).and_then(|h| h.back_mut()) {
            newest.entry.origin = snapshot.origin;
            newest.snapshot = Some(snapshot.clone());
        }
    }

    /// Puts `versions` (oldest first, as [`Cache::export_history`] gave
    /// them) back under `collection`'s current snapshot, which must be the
    /// newest of them and the only version the history holds. Each older
    /// version must rebuild to exactly its content version, or nothing is
    /// restored. The newest keeps its current origin; at most
    /// [`Cache::history_len`] versions are kept, the oldest dropped.
    fn restore_history(&self, collection: &str, mut versions: Vec<KeptVersion>) -> Result<usize, String> {
        let mut histories = self.histories.write().expect("cache lock poisoned");
        let history = histories
            .get_mut(collection)
            .ok_or("the collection is not in the cache")?;
        if history.len() > 1 {
            return Err("the cache already holds older versions of the collection".into());
        }
        let newest = history
            .back()
            .and_then(|k| k.snapshot.clone())
            .ok_or("the collection is not in the cache")?;
        let Some(newest_kept) = versions.pop() else {
            return Err("it holds no version".into());
        };
        if newest_kept.entry.version != newest.version {
            return Err(format!(
                "its newest version is {}, not the loaded {}: it is older or newer than the collection's file",
                newest_kept.entry.version, newest.version
            ));
        }
        let dropped = (versions.len() + 1).saturating_sub(self.history_len());
        versions.drain(..dropped);
        // Walk back from the newest, as `rebuild` will: each version costs
        // its changes.
        let mut rebuilt = Rebuilt::from_newest(&newest);
        for kept in versions.iter_mut().rev() {
            for (name, had) in &mut kept.undo {
                if let Some(resource) = had {
                    if resource.name != *name {
                        return Err(format!(
                            "version {} lists {:?} as {name:?}",
                            kept.entry.version, resource.name
                        ));
                    }
                    // Bytes of its own, not a slice of whatever it was read from.
                    *resource = Arc::new(resource.detached());
                }
            }
            rebuilt.undo(&kept.undo);
            let version = rebuilt.version();
            if *version != *kept.entry.version {
                return Err(format!(
                    "version {} rebuilds to {version}: its recorded changes are not the ones to the next version",
                    kept.entry.version
                ));
            }
            kept.entry.resources = rebuilt.resources.len();
            kept.entry.bytes = rebuilt.bytes;
        }
        let current = history.back_mut().expect("the newest is there");
        current.entry = HistoryEntry {
            version: newest.version.clone(),
            origin: newest.origin,
            resources: newest.len(),
            bytes: newest.bytes,
            ..newest_kept.entry
        };
        let restored = versions.len() + 1;
        for kept in versions.into_iter().rev() {
            history.push_front(Kept {
                entry: kept.entry,
                undo: kept.undo,
                snapshot: None,
            });
        }
        Ok(restored)
    }

    /// Records `snapshot`, a new version, as the newest of its collection,
    /// turns the version it replaces into its undo, and drops what falls
    /// past the history's length.
    fn remember(&self, snapshot: &Arc<CollectionSnapshot>, changed: &[SharedStr]) {
        let mut histories = self.histories.write().expect("cache lock poisoned");
        let history = histories.entry(snapshot.collection.clone()).or_default();
        let previous = history.back_mut().and_then(|newest| newest.snapshot.take());
        let (mut added, mut removed) = (0, 0);
        let mut undo = Vec::with_capacity(changed.len());
        for name in changed {
            let had = previous.as_ref().and_then(|p| p.resources.get(&**name));
            match (had.is_some(), snapshot.resources.contains_key(&**name)) {
                (false, true) => added += 1,
                (true, false) => removed += 1,
                _ => {}
            }
            // Its bytes are copied out of its chunk, so the history keeps
            // the resource and not the chunk it sat in.
            undo.push((name.clone(), had.map(|r| Arc::new(r.detached()))));
        }
        if let Some(previous) = history.back_mut() {
            previous.undo = undo;
        }
        history.push_back(Kept {
            entry: HistoryEntry {
                version: snapshot.version.clone(),
                updated_at: snapshot.updated_at,
                origin: snapshot.origin,
                resources: snapshot.len(),
                bytes: snapshot.bytes,
                added,
                changed: changed.len() - added - removed,
                removed,
            },
            undo: Vec::new(),
            snapshot: Some(snapshot.clone()),
        });
        while history.len() > self.history_len() {
            history.pop_front();
        }
    }

    /// This gateway's id and the gateways upstream of it.
    pub fn provenance(&self) -> &provenance::Provenance {
        &self.provenance
    }

    /// Sees a new value whenever any collection changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn slot(&self, collection: &str) -> Slot {
        if let Some(slot) = self.slots.read().expect("cache lock poisoned").get(collection) {
            return slot.clone();
        }
        self.slots
            .write()
            .expect("cache lock poisoned")
            .entry(SharedStr::from(collection))
            .or_insert_with(|| watch::Sender::new(None))
            .clone()
    }

    /// A receiver that sees every new snapshot of `collection`; `None` until
    /// the collection is first delivered.
    pub fn subscribe(&self, collection: &str) -> watch::Receiver<Option<Arc<CollectionSnapshot>>> {
        self.slot(collection).subscribe()
    }

    pub fn get(&self, collection: &str) -> Option<Arc<CollectionSnapshot>> {
        let slots = self.slots.read().expect("cache lock poisoned");
        slots.get(collection).and_then(|slot| slot.borrow().clone())
    }

    /// Every delivered collection's current snapshot, sorted by name: all
    /// of a source's step or none of it (see [`CacheWriter::apply_step`]).
    pub fn snapshots(&self) -> Vec<Arc<CollectionSnapshot>> {
        let _step = self.step.read().expect("cache lock poisoned");
        let slots = self.slots.read().expect("cache lock poisoned");
        let mut all: Vec<_> = slots.values().filter_map(|slot| slot.borrow().clone()).collect();
        all.sort_by(|a, b| a.collection.cmp(&b.collection));
        all
    }

    /// `name → version` of a collection, as a sink reports it upstream in
    /// `initial_resource_versions`.
    pub fn resource_versions(&self, collection: &str) -> HashMap<String, String> {
        self.get(collection)
            .map(|snapshot| {
                snapshot
                    .resources
                    .iter()
                    .map(|(name, r)| (name.to_string(), r.version().to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

// === impl CacheWriter ===

impl CacheWriter {
    /// What it writes.
    pub fn cache(&self) -> &Arc<Cache> {
        &self.cache
    }

    /// The gateways upstream of the source now writing (empty when the
    /// source is not a gateway).
    pub fn set_upstream_chain(&mut self, chain: Vec<SharedStr>) {
        self.cache.provenance.set_upstream_chain(chain);
    }

    /// Applies an update. Readers are woken only when the content changed.
    pub fn apply(&mut self, collection: &str, update: Update, origin: Origin) -> Applied {
        let applied = self.cache.apply(collection, update, origin, None);
        self.applied(&applied);
        applied
    }

    /// Runs `apply` as one step of the source (one read of a directory, the
    /// messages of several collections that came together): whoever lists
    /// the cache (the rollout, which fills every stream's versions from it)
    /// sees all of its applies or none, and is woken once, at its end. A
    /// stream that orders Envoy's types (make before break) must never see a
    /// route to a cluster without the cluster's change beside it.
    pub fn step<R>(&mut self, apply: impl FnOnce(&mut CacheWriter) -> R) -> R {
        let cache = self.cache.clone();
        let step = cache.step.write().expect("cache lock poisoned");
        let outer = self.stepping.replace(false);
        let result = apply(self);
        let changed = std::mem::replace(&mut self.stepping, outer).unwrap_or(false);
        drop(step);
        if changed {
            match &mut self.stepping {
                Some(outer) => *outer = true,
                None => cache.wake(),
            }
        }
        result
    }

    /// Applies the updates of several collections as one [`Self::step`].
    pub fn apply_step(&mut self, updates: Vec<(SharedStr, Update, Origin)>) -> Vec<Applied> {
        self.step(|writer| {
            updates
                .into_iter()
                .map(|(collection, update, origin)| writer.apply(&collection, update, origin))
                .collect()
        })
    }

    /// Wakes whoever follows every collection, now or (in a step) at its
    /// end, when `applied` changed one.
    fn applied(&mut self, applied: &Applied) {
        if matches!(applied, Applied::Changed { .. }) {
            match &mut self.stepping {
                Some(changed) => *changed = true,
                None => self.cache.wake(),
            }
        }
    }

    /// Applies an update decoded from `message`, a source's message whose
    /// resources' records were relabelled as storage records
    /// ([`STORAGE_FIELD`]) when it was read: a collection stored afresh
    /// keeps runs of those records where they lie, so the message is its
    /// storage and is not copied.
    pub fn apply_message<R: Into<Arc<CachedResource>>>(
        &mut self,
        collection: &str,
        update: Update<R>,
        origin: Origin,
        message: &Bytes,
    ) -> Applied {
        let applied = self.cache.apply(collection, update, origin, Some(message));
        self.applied(&applied);
        applied
    }

    /// Puts back the history of `collection` kept elsewhere (`versions`,
    /// oldest first, as [`Cache::export_history`] gave them) under its
    /// current snapshot, the newest of them: how many versions it now
    /// holds, or why none was restored (the collection itself is untouched).
    pub fn restore_history(&mut self, collection: &str, versions: Vec<KeptVersion>) -> Result<usize, String> {
        self.cache.restore_history(collection, versions)
    }
}

impl Cache {
    /// Applies `update`; `message` is the buffer its resources were decoded
    /// from, if they were (see [`Chunks::build`]).
    fn apply<R: Into<Arc<CachedResource>>>(
        &self,
        collection: &str,
        update: Update<R>,
        origin: Origin,
        message: Option<&Bytes>,
    ) -> Applied {
        let slot = self.slot(collection);
        let current = slot.borrow().clone();
        let name = current
            .as_ref()
            .map(|s| s.collection.clone())
            .unwrap_or_else(|| SharedStr::from(collection));
        let mut resources = current.as_ref().map(|s| s.resources.clone()).unwrap_or_default();
        let was_empty = resources.is_empty();
        let mut total = Total {
            sum: current.as_ref().map_or(0, |s| s.content_sum),
            bytes: current.as_ref().map_or(0, |s| s.bytes),
            changed: Vec::new(),
        };
        // What arrived, in its order, when it is the whole collection.
        let whole: Option<Vec<Arc<CachedResource>>> = match update {
            Update::Full(incoming) if was_empty => {
                let incoming = shared(incoming);
                total.fill(&mut resources, &incoming);
                Some(incoming)
            }
            Update::Full(incoming) => {
                let incoming = shared(incoming);
                // Start from the current map and touch only what changed, so
                // unchanged subtrees stay shared with the previous snapshot.
                let mut seen = std::collections::HashSet::with_capacity(incoming.len());
                for resource in &incoming {
                    seen.insert(resource.name.clone());
                    total.upsert(&mut resources, resource);
                }
                if seen.len() != resources.len() {
                    let gone: Vec<SharedStr> = resources.keys().filter(|n| !seen.contains(*n)).cloned().collect();
                    for name in gone {
                        total.remove(&mut resources, &name);
                    }
                }
                Some(incoming)
            }
            Update::Incremental { upserts, removed } => {
                let upserts = shared(upserts);
                if was_empty {
                    total.fill(&mut resources, &upserts);
                } else {
                    for resource in &upserts {
                        total.upsert(&mut resources, resource);
                    }
                }
                for name in removed {
                    total.remove(&mut resources, &name);
                }
                was_empty.then_some(upserts)
            }
        };
        let Total {
            sum,
            bytes,
            mut changed,
        } = total;
        changed.sort_unstable();
        changed.dedup();
        // A new collection, or one mostly changed, is stored afresh in the
        // order it arrived (its message, where it can, as the storage);
        // else only the change is stored.
        // Stored afresh, every resource is a new `Arc`: the window starts
        // empty.
        let mut applied = None;
        let (chunks, recent) = match whole.filter(|_| was_empty || changed.len() * 2 > resources.len()) {
            Some(mut whole) => {
                if !was_empty {
                    // The arrived resources, not the equal ones held before:
                    // what stored those is freed.
                    resources = arrived_map(&whole, &resources);
                }
                // Each name once, as the map holds it.
                whole.retain(|r| resources.get(&*r.name).is_some_and(|held| Arc::ptr_eq(held, r)));
                (Chunks::build(whole, message, &mut resources), recent::Recent::default())
            }
            None => match &current {
                Some(current) => {
                    let rechunked = rechunk(&current.chunks, &current.resources, &mut resources, &changed);
                    let recent = current.recent.after(&rechunked.stored, &rechunked.removed);
                    applied = (changed.len() <= step_names(resources.len())).then(|| AppliedStep {
                        from: current.version.clone(),
                        changed: changed.as_slice().into(),
                        made: std::sync::OnceLock::new(),
                    });
                    (rechunked.chunks, recent)
                }
                None => (Chunks::default(), recent::Recent::default()),
            },
        };
        let mut snapshot = CollectionSnapshot::new(name, resources, sum, chunks, bytes, origin);
        snapshot.recent = recent;
        snapshot.applied = applied;
        let snapshot = Arc::new(snapshot);
        let version = snapshot.version.clone();
        // The one decision, for the slot and the history alike.
        if let Some(old) = current.filter(|old| old.version == snapshot.version) {
            // Same content from another origin (upstream confirming what was
            // loaded from disk): record where it now comes from without
            // waking anyone.
            if old.origin != snapshot.origin {
                self.reorigin(&snapshot);
                slot.send_if_modified(|held| {
                    *held = Some(snapshot);
                    false
                });
            }
            return Applied::Unchanged { version };
        }
        self.remember(&snapshot, &changed);
        slot.send_replace(Some(snapshot));
        Applied::Changed { version }
    }

    /// Wakes whoever follows every collection.
    fn wake(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

/// What an apply changed: the collection version's sum, the resources'
/// total size, and the names upserted or removed.
struct Total {
    sum: u128,
    bytes: usize,
    changed: Vec<SharedStr>,
}

impl Total {
    /// Nothing changed yet from `snapshot`.
    fn of(snapshot: &CollectionSnapshot) -> Self {
        Total {
            sum: snapshot.content_sum,
            bytes: snapshot.bytes,
            changed: Vec::new(),
        }
    }

    fn upsert(&mut self, resources: &mut ResourceMap, resource: &Arc<CachedResource>) {
        if let Some(old) = resources.get(&*resource.name) {
            if old == resource {
                return;
            }
            self.sum = self.sum.wrapping_sub(old.entry());
            self.bytes -= old.encoded.len();
        }
        self.added(resource);
        resources.insert(resource.name.clone(), resource.clone());
    }

    /// `resource` is in the map, where nothing of its name was.
    fn added(&mut self, resource: &CachedResource) {
        self.sum = self.sum.wrapping_add(resource.entry());
        self.bytes += resource.encoded.len();
        self.changed.push(resource.name.clone());
    }

    /// `resources` (the last of a name counts) into an empty map, its
    /// leaves full ([`packed_map`]).
    fn fill(&mut self, resources: &mut ResourceMap, incoming: &[Arc<CachedResource>]) {
        debug_assert!(resources.is_empty());
        *resources = packed_map(incoming.iter().cloned());
        for resource in resources.values() {
            self.added(resource);
        }
    }

    fn remove(&mut self, resources: &mut ResourceMap, name: &str) {
        if let Some(old) = resources.remove(name) {
            self.sum = self.sum.wrapping_sub(old.entry());
            self.bytes -= old.encoded.len();
            self.changed.push(old.name.clone());
        }
    }
}

/// What [`rechunk`] made.
struct Rechunked {
    chunks: Chunks,
    /// Every resource stored anew: what changed, and what moved with it.
    stored: Vec<Arc<CachedResource>>,
    /// The names that changed to nothing.
    removed: Vec<SharedStr>,
}

/// `previous` (the chunks of `previous_resources`) after the `changed`
/// names became what `resources` holds: what they had is taken out of its
/// chunks, what they have is stored at the end.
fn rechunk(
    previous: &Chunks,
    previous_resources: &ResourceMap,
    resources: &mut ResourceMap,
    changed: &[SharedStr],
) -> Rechunked {
    let gone: Vec<Arc<CachedResource>> = changed
        .iter()
        .filter_map(|name| previous_resources.get(&**name))
        .cloned()
        .collect();
    let mut added = Vec::with_capacity(changed.len());
    let mut removed = Vec::new();
    for name in changed {
        match resources.get(&**name) {
            Some(now) => added.push(now.clone()),
            None => removed.push(name.clone()),
        }
    }
    let (chunks, stored) = previous.change(&gone, &added, resources);
    Rechunked {
        chunks,
        stored,
        removed,
    }
}

/// `resources`, in order, each in the `Arc` the cache shares it by. Values
/// are moved from the back and the vector shrunk as it empties, so a large
/// update is not held twice (its vector and its `Arc`s) while it is taken
/// in: the vector's freed tail makes room for the `Arc`s.
fn shared<R: Into<Arc<CachedResource>>>(mut resources: Vec<R>) -> Vec<Arc<CachedResource>> {
    const SHRINK_EVERY: usize = 1024;
    let mut shared = Vec::with_capacity(resources.len());
    while let Some(resource) = resources.pop() {
        shared.push(resource.into());
        if resources.capacity() - resources.len() >= SHRINK_EVERY {
            resources.shrink_to_fit();
        }
    }
    shared.reverse();
    shared
}

/// The resources of `whole`, a collection as it arrived, whose names
/// `resources` holds (the last of a name counts, as in an apply).
fn arrived_map(whole: &[Arc<CachedResource>], resources: &ResourceMap) -> ResourceMap {
    packed_map(whole.iter().filter(|r| resources.contains_key(&*r.name)).cloned())
}

/// A map of `resources` built whole (the last of a name counts, as in an
/// apply), its leaves full. `imbl` splits a full leaf at its median and
/// never merges what a split left, so a map built by inserts is half full
/// where the names come in order and about two thirds where they come at
/// random (41 and 28 bytes asked per entry of 16). Inserting every other
/// name in order first leaves each leaf half full with a gap after each of
/// its names; the rest then fill the gaps without a split (20.5 bytes per
/// entry). The order is only the layout: any order makes the same map.
/// The heap budget `CACHE_RESOURCE` holds the layout (`tests/it/budgets.rs`);
/// `a_map_built_whole_is_the_map_its_inserts_make` its content.
fn packed_map(resources: impl IntoIterator<Item = Arc<CachedResource>>) -> ResourceMap {
    let mut sorted: Vec<Arc<CachedResource>> = resources.into_iter().collect();
    // Stable, then each name's run reversed: its last to arrive first.
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    sorted.reverse();
    sorted.dedup_by(|a, b| a.name == b.name);
    sorted.reverse();
    let mut map = ResourceMap::new();
    for resource in sorted.iter().step_by(2).chain(sorted.iter().skip(1).step_by(2)) {
        map.insert(resource.name.clone(), resource.clone());
    }
    map
}

/// The difference between two states of one collection. Removed names are
/// the cache's own (`SharedStr`) or borrowed from a client's request (`&str`).
#[derive(Debug)]
pub struct Diff<R = SharedStr> {
    pub upserts: Upserts,
    pub removed: Vec<R>,
}

/// A diff's changed resources: two inline, so that a named client's
/// response of one or two (eds's) allocates nothing for them.
pub type Upserts = smallvec::SmallVec<[Arc<CachedResource>; 2]>;

impl<R> Default for Diff<R> {
    fn default() -> Self {
        Self {
            upserts: Upserts::new(),
            removed: Vec::new(),
        }
    }
}

impl<R: AsRef<str>> Diff<R> {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.removed.is_empty()
    }

    /// The removed names, borrowed.
    pub fn removed_names(&self) -> Vec<&str> {
        self.removed.iter().map(AsRef::as_ref).collect()
    }
}

impl<'a> Diff<&'a str> {
    /// From what a client reports holding (`initial_resource_versions` as
    /// `(name, version)`, sorted by name) to a snapshot: the resources whose
    /// version differs, and the names that are gone. A merge of two sorted
    /// lists: nothing is copied.
    pub fn from_versions(known: &[(&'a str, &'a str)], to: &ResourceMap) -> Self {
        let mut diff = Diff::default();
        let mut known = known.iter().peekable();
        for resource in to.values() {
            while let Some((name, _)) = known.next_if(|(name, _)| **name < *resource.name) {
                diff.removed.push(*name);
            }
            let held = known.next_if(|(name, _)| **name == *resource.name);
            // A name given twice: the first one counts.
            while known.next_if(|(name, _)| **name == *resource.name).is_some() {}
            if held.is_none_or(|(_, version)| **version != *resource.version()) {
                diff.upserts.push(resource.clone());
            }
        }
        diff.removed.extend(known.map(|(name, _)| *name));
        diff.removed.dedup();
        diff
    }
}

impl Diff {
    /// From one snapshot's resources to another's: proportional to the change
    /// when the two share structure (consecutive applies do).
    pub fn between(from: &ResourceMap, to: &ResourceMap) -> Self {
        let mut diff = Diff::default();
        for item in from.diff(to) {
            match item {
                imbl::ordmap::DiffItem::Add(_, new) | imbl::ordmap::DiffItem::Update { new: (_, new), .. } => {
                    diff.upserts.push(new.clone())
                }
                imbl::ordmap::DiffItem::Remove(name, _) => diff.removed.push(name.clone()),
            }
        }
        diff
    }
}

/// Resources as a source sends them, for the tests of the cache and of
/// what reads it.
#[cfg(test)]
pub(crate) mod test_support {
    use super::{content_digest, CachedResource};

    /// A `Resource` `name` at `version`, its body naming both.
    pub fn resource(name: &str, version: &str) -> CachedResource {
        with_body(name, version, &format!("{name}@{version}"))
    }

    /// A `Resource` of `body` at `version`.
    pub fn with_body(name: &str, version: &str, body: &str) -> CachedResource {
        let none = std::collections::HashMap::<String, String>::new();
        CachedResource::new(
            name.into(),
            crate::proto::wire::test_support::encoded_resource(name, version, body.as_bytes()),
            content_digest(body.as_bytes(), &none, &none),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{resource, with_body};
    use super::*;

    /// What a reader makes of a snapshot's step is made once and kept for
    /// the version the snapshot was applied on only, of the type it was
    /// made as; a snapshot stored afresh has no step.
    #[test]
    fn a_step_keeps_what_was_made_of_it_for_its_own_version_only() {
        let (cache, mut writer) = Cache::new();
        let many = |v: &str| (0..20).map(|i| resource(&format!("r{i:02}"), v)).collect::<Vec<_>>();
        writer.apply("c", Update::Full(many("1")), Origin::Files);
        let first = cache.get("c").unwrap();
        assert!(
            first.step_made(&first.version, || 1u32).is_none(),
            "stored afresh: no step"
        );
        let change = |v: &str| Update::Incremental {
            upserts: vec![resource("r03", v)],
            removed: Vec::new(),
        };
        writer.apply("c", change("2"), Origin::Files);
        let second = cache.get("c").unwrap();
        writer.apply("c", change("3"), Origin::Files);
        let third = cache.get("c").unwrap();
        let made = std::cell::Cell::new(0);
        let make = |n: u32| {
            made.set(made.get() + 1);
            n
        };
        assert_eq!(third.step_made(&second.version, || make(7)).as_deref(), Some(&7));
        assert_eq!(
            third.step_made(&second.version, || make(8)).as_deref(),
            Some(&7),
            "kept"
        );
        assert_eq!(made.get(), 1, "made once");
        assert!(third.step_made(&first.version, || make(9)).is_none(), "not its step");
        assert!(third.step_made(&third.version, || make(9)).is_none(), "not its step");
        assert!(third.step_made(&second.version, String::new).is_none(), "another type");
        assert_eq!(made.get(), 1);
        assert_eq!(
            second.step_made(&first.version, || 5u32).as_deref(),
            Some(&5),
            "each step its own"
        );
    }

    /// A diff's changed resources hold two inline in a `Vec`'s room: the
    /// diffs a version shares are no larger for it.
    #[test]
    fn a_diffs_changed_resources_take_a_vecs_room() {
        assert_eq!(
            std::mem::size_of::<Upserts>(),
            std::mem::size_of::<Vec<Arc<CachedResource>>>()
        );
        assert!(!Upserts::from_iter([Arc::new(resource("a", "1")), Arc::new(resource("b", "1"))]).spilled());
    }

    /// What a version removes, kept beside what it adds and changes: the
    /// union, at the version the same content has anywhere (another replica
    /// makes the same one); a version that removes nothing is itself.
    #[test]
    fn keeping_what_a_version_removes_is_the_union_at_its_content_version() {
        let (cache, mut writer) = Cache::new();
        writer.apply(
            "c",
            Update::Full(vec![resource("a", "1"), resource("b", "1")]),
            Origin::Files,
        );
        let held = cache.get("c").unwrap();
        writer.apply(
            "c",
            Update::Full(vec![resource("b", "2"), resource("c", "1")]),
            Origin::Files,
        );
        let to = cache.get("c").unwrap();
        let first = to.keeping(&held);
        let versions: Vec<(String, String)> = first
            .resources
            .values()
            .map(|r| (r.name.to_string(), r.version().to_string()))
            .collect();
        assert_eq!(
            versions,
            [("a", "1"), ("b", "2"), ("c", "1")].map(|(n, v)| (n.to_owned(), v.to_owned()))
        );
        let (elsewhere, mut other) = Cache::new();
        other.apply(
            "c",
            Update::Full(vec![resource("a", "1"), resource("b", "2"), resource("c", "1")]),
            Origin::Files,
        );
        assert_eq!(first.version, elsewhere.get("c").unwrap().version);
        let members: usize = first.chunks().map(|c| c.members().len()).sum();
        assert_eq!(members, 3, "its chunks hold what it holds");
        assert!(Arc::ptr_eq(&to.keeping(&to), &to));
    }

    /// A step wakes whoever follows every collection once, at its end,
    /// whatever it applied; a step that changed nothing wakes nobody.
    #[test]
    fn a_step_wakes_once_at_its_end() {
        let (cache, mut writer) = Cache::new();
        let mut changes = cache.changes();
        changes.mark_unchanged();
        let before = *changes.borrow();
        let applied = writer.step(|writer| {
            let a = writer.apply("a", Update::Full(vec![resource("x", "1")]), Origin::Files);
            let b = writer.apply("b", Update::Full(vec![resource("y", "1")]), Origin::Files);
            assert!(!changes.has_changed().unwrap(), "nobody woken before the step ends");
            assert_eq!(cache.get("b").map(|s| s.len()), Some(1), "each apply is in its slot");
            [a, b]
        });
        assert!(applied.iter().all(|a| matches!(a, Applied::Changed { .. })));
        assert_eq!(*changes.borrow_and_update(), before + 1, "woken once");
        let names: Vec<String> = cache.snapshots().iter().map(|s| s.collection.to_string()).collect();
        assert_eq!(names, ["a", "b"]);

        let applied = writer.apply_step(vec![(
            "a".into(),
            Update::Full(vec![resource("x", "1")]),
            Origin::Files,
        )]);
        assert!(matches!(applied[..], [Applied::Unchanged { .. }]));
        assert!(!changes.has_changed().unwrap(), "nothing changed: nobody woken");
    }

    /// A restricted view made from the last one, at the cost of the change,
    /// is the view made afresh: the same names, bytes and version, through
    /// upserts and removals kept and not kept, back to everything kept and
    /// a change it does not keep (the very view again).
    #[test]
    fn a_view_from_the_last_is_the_view_made_afresh() {
        let (cache, mut writer) = Cache::new();
        let keep = |name: &str| name.starts_with("a/");
        let names = |n: usize| -> Vec<CachedResource> {
            (0..n)
                .flat_map(|i| [resource(&format!("a/{i:03}"), "1"), resource(&format!("b/{i:03}"), "1")])
                .collect()
        };
        writer.apply(C, Update::Full(names(100)), Origin::Upstream);
        let mut whole = cache.get(C).unwrap();
        let mut view = whole.restricted(keep);
        assert_eq!(view.len(), 100);
        let changes: Vec<Update> = vec![
            Update::Incremental {
                upserts: vec![resource("a/001", "2"), resource("b/001", "2")],
                removed: vec![],
            },
            Update::Incremental {
                upserts: vec![resource("a/500", "1")],
                removed: vec!["a/002".into(), "b/003".into()],
            },
            Update::Incremental {
                upserts: vec![resource("b/900", "1")],
                removed: vec![],
            },
            Update::Full(names(3)),
            Update::Incremental {
                upserts: vec![],
                removed: (0..3).map(|i| format!("b/{i:03}")).collect(),
            },
            Update::Incremental {
                upserts: vec![resource("b/777", "1")],
                removed: vec![],
            },
        ];
        for (step, update) in changes.into_iter().enumerate() {
            writer.apply(C, update, Origin::Upstream);
            let next = cache.get(C).unwrap();
            let from_last = next.restricted_after(Some((&whole, &view)), keep);
            let afresh = next.restricted(keep);
            assert_eq!(from_last.version, afresh.version, "step {step}");
            let listed = |s: &CollectionSnapshot| -> Vec<(String, Bytes)> {
                s.resources
                    .values()
                    .map(|r| (r.name.to_string(), r.encoded.clone()))
                    .collect()
            };
            assert_eq!(listed(&from_last), listed(&afresh), "step {step}");
            let stored: usize = from_last.chunks().map(|c| c.members().len()).sum();
            assert_eq!(stored, from_last.len(), "step {step}: every resource stored once");
            if step == 2 {
                assert!(
                    Arc::ptr_eq(&from_last, &view),
                    "a change it does not keep is the same view"
                );
            }
            whole = next;
            view = from_last;
        }
    }

    /// The history keeps the last N versions, newest first, with what each
    /// apply changed; an older version is rebuilt from the newest and the
    /// undos, sharing the resources that did not change since, and holding
    /// bytes of its own (not its old chunk) for those that did.
    #[test]
    fn the_history_keeps_n_versions_as_undos_of_the_newest() {
        let (cache, mut writer) = Cache::with_history(3);
        writer.apply(
            C,
            Update::Full(vec![resource("a", "1"), resource("b", "1")]),
            Origin::Upstream,
        );
        let first = cache.get(C).unwrap();
        writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource("b", "2"), resource("c", "1")],
                removed: vec!["a".into()],
            },
            Origin::Upstream,
        );
        let second = cache.get(C).unwrap();
        let history = cache.history(C).unwrap();
        let versions: Vec<&str> = history.iter().map(|e| &*e.version).collect();
        assert_eq!(versions, [&*second.version, &*first.version]);
        let counts: Vec<_> = history.iter().map(|e| (e.added, e.changed, e.removed)).collect();
        assert_eq!(counts, [(1, 1, 1), (2, 0, 0)]);
        let rebuilt = cache.version_resources(C, &first.version).unwrap();
        assert!(rebuilt == first.resources, "the first version, rebuilt");
        assert_eq!(collection_version(&rebuilt), *first.version);
        let b = &rebuilt["b"];
        assert!(
            !Arc::ptr_eq(b, &first.resources["b"]) && b.encoded.as_ptr() != first.resources["b"].encoded.as_ptr(),
            "a changed resource's old bytes are its own, not its chunk's"
        );

        // The same content again, from disk: no new version.
        writer.apply(
            C,
            Update::Full(vec![resource("b", "2"), resource("c", "1")]),
            Origin::Disk,
        );
        assert_eq!(cache.history(C).unwrap().len(), 2);
        assert_eq!(cache.history(C).unwrap()[0].origin, Origin::Disk);

        writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource("d", "1")],
                removed: vec![],
            },
            Origin::Upstream,
        );
        writer.apply(
            C,
            Update::Incremental {
                upserts: vec![],
                removed: vec!["d".into()],
            },
            Origin::Upstream,
        );
        let history = cache.history(C).unwrap();
        assert_eq!(history.len(), 3, "the oldest fell out");
        assert!(cache.version_resources(C, &first.version).is_none());
        let second_again = cache.version_resources(C, &second.version).unwrap();
        assert!(second_again == second.resources);
        // What did not change since is the newest's own allocation.
        let newest = cache.get(C).unwrap();
        assert!(Arc::ptr_eq(&second_again["c"], &newest.resources["c"]));
        assert!(cache.history("unknown").is_none());
        assert!(cache.version_resources(C, "no-such-version").is_none());
    }

    /// An exported history goes back under the same newest version, older
    /// versions and all, and nowhere else.
    #[test]
    fn an_exported_history_is_restored_only_under_its_newest_version() {
        let (cache, mut writer) = Cache::with_history(3);
        for version in ["1", "2", "3", "4"] {
            writer.apply(
                C,
                Update::Full(vec![resource("a", version), resource("b", "1")]),
                Origin::Upstream,
            );
        }
        let (newest, versions) = cache.export_history(C).unwrap();
        assert_eq!(versions.len(), 3);
        assert_eq!(versions[2].entry.version, newest.version);
        let undone: Vec<Option<&str>> = versions
            .iter()
            .map(|v| v.undo.first().and_then(|(_, had)| had.as_ref()).map(|r| r.version()))
            .collect();
        assert_eq!(undone, [Some("2"), Some("3"), None], "each older version's a");

        let (restored, mut restorer) = Cache::with_history(3);
        assert!(restorer
            .restore_history(C, versions.clone())
            .unwrap_err()
            .contains("not in the cache"));
        restorer.apply(
            C,
            Update::Full(vec![resource("a", "3"), resource("b", "1")]),
            Origin::Disk,
        );
        let refused = restorer.restore_history(C, versions.clone()).unwrap_err();
        assert!(refused.contains("newest version"), "{refused}");
        restorer.apply(
            C,
            Update::Full(vec![resource("a", "4"), resource("b", "1")]),
            Origin::Disk,
        );
        let refused = restorer.restore_history(C, versions.clone()).unwrap_err();
        assert!(refused.contains("already holds older versions"), "{refused}");

        let (restored_again, mut restorer) = Cache::with_history(2);
        restorer.apply(
            C,
            Update::Full(vec![resource("a", "4"), resource("b", "1")]),
            Origin::Disk,
        );
        assert_eq!(
            restorer.restore_history(C, versions.clone()),
            Ok(2),
            "the oldest dropped"
        );
        let mut expected = cache.history(C).unwrap();
        expected.truncate(2);
        expected[0].origin = Origin::Disk;
        assert_eq!(restored_again.history(C).unwrap(), expected);
        assert_eq!(
            restored.history(C).unwrap().len(),
            2,
            "a refused restore changes nothing"
        );
    }

    #[test]
    fn a_new_body_under_the_same_version_is_a_change() {
        let (cache, mut cache_writer) = Cache::new();
        let mut rx = cache.subscribe(C);
        let first = cache_writer.apply(C, Update::Full(vec![with_body("a", "1", "old")]), Origin::Upstream);
        rx.borrow_and_update();
        // A restarted source reusing version "1" for other content.
        let second = cache_writer.apply(C, Update::Full(vec![with_body("a", "1", "new")]), Origin::Upstream);
        assert!(matches!(second, Applied::Changed { .. }));
        assert_ne!(first.version(), second.version());
        assert!(rx.has_changed().unwrap(), "readers are woken");
        let snapshot = cache.get(C).unwrap();
        let stored =
            <crate::proto::Resource as prost::Message>::decode(snapshot.resources["a"].encoded.clone()).unwrap();
        assert_eq!(stored.body.unwrap().value, b"new");
        // The same through an incremental update, and labels count too.
        let labels: HashMap<String, String> = [("app".to_owned(), "x".to_owned())].into();
        let none = HashMap::new();
        let labelled = CachedResource::new(
            "a".into(),
            crate::proto::wire::test_support::encoded_resource("a", "1", b"new"),
            content_digest(b"new", &labels, &none),
        );
        let third = cache_writer.apply(
            C,
            Update::Incremental {
                upserts: vec![labelled],
                removed: vec![],
            },
            Origin::Upstream,
        );
        assert!(matches!(third, Applied::Changed { .. }));
    }

    #[test]
    fn the_kept_version_equals_one_computed_from_scratch() {
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(
            C,
            Update::Full((0..100).map(|i| resource(&format!("r{i}"), "1")).collect()),
            Origin::Upstream,
        );
        cache_writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource("r5", "2"), resource("new", "1")],
                removed: vec!["r7".into(), "unknown".into()],
            },
            Origin::Upstream,
        );
        let snapshot = cache.get(C).unwrap();
        assert_eq!(*snapshot.version, collection_version(&snapshot.resources));
        let entries: Vec<(String, String, u128)> = snapshot
            .resources
            .values()
            .map(|r| (r.name.to_string(), r.version().to_string(), r.digest()))
            .collect();
        assert_eq!(
            *snapshot.version,
            version_of_entries(entries.iter().rev().map(|(n, v, d)| (n.as_str(), v.as_str(), *d)))
        );
    }

    const C: &str = "istio/networking/v1alpha3/gateways";

    #[test]
    fn version_is_content_derived_and_order_independent() {
        let (_a, mut a_writer) = Cache::new();
        let (_b, mut b_writer) = Cache::new();
        let va = a_writer.apply(
            C,
            Update::Full(vec![resource("x", "1"), resource("y", "2")]),
            Origin::Upstream,
        );
        let vb = b_writer.apply(
            C,
            Update::Full(vec![resource("y", "2"), resource("x", "1")]),
            Origin::Upstream,
        );
        assert_eq!(va, vb);
        let vc = b_writer.apply(
            C,
            Update::Full(vec![resource("y", "3"), resource("x", "1")]),
            Origin::Upstream,
        );
        assert_ne!(va, vc);
        // Length prefixes: ("ab","c") is not ("a","bc").
        let mut m1 = ResourceMap::new();
        m1.insert("ab".into(), Arc::new(resource("ab", "c")));
        let mut m2 = ResourceMap::new();
        m2.insert("a".into(), Arc::new(resource("a", "bc")));
        assert_ne!(collection_version(&m1), collection_version(&m2));
    }

    #[test]
    fn equal_content_does_not_wake_readers() {
        let (cache, mut cache_writer) = Cache::new();
        let mut rx = cache.subscribe(C);
        assert!(rx.borrow_and_update().is_none(), "not delivered yet");
        cache_writer.apply(C, Update::Full(vec![resource("x", "1")]), Origin::Upstream);
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        let again = cache_writer.apply(C, Update::Full(vec![resource("x", "1")]), Origin::Upstream);
        assert!(matches!(again, Applied::Unchanged { .. }));
        assert!(!rx.has_changed().unwrap());
    }

    #[test]
    fn delivered_empty_is_not_missing() {
        let (cache, mut cache_writer) = Cache::new();
        assert!(cache.get(C).is_none());
        cache_writer.apply(C, Update::Full(vec![]), Origin::Upstream);
        let snapshot = cache.get(C).expect("an empty collection is delivered");
        assert!(snapshot.is_empty());
    }

    #[test]
    fn incremental_upserts_and_removes_ignoring_unknown_names() {
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(
            C,
            Update::Full(vec![resource("a", "1"), resource("b", "1")]),
            Origin::Upstream,
        );
        cache_writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource("b", "2"), resource("c", "1")],
                removed: vec!["a".into(), "never-existed".into()],
            },
            Origin::Upstream,
        );
        let snapshot = cache.get(C).unwrap();
        let got: Vec<(String, String)> = snapshot
            .resources
            .values()
            .map(|r| (r.name.to_string(), r.version().to_string()))
            .collect();
        assert_eq!(got, [("b".into(), "2".into()), ("c".into(), "1".into())]);
    }

    #[test]
    fn full_state_replaces_and_diffs_follow_the_change() {
        let (cache, mut cache_writer) = Cache::new();
        let many: Vec<_> = (0..1000).map(|i| resource(&format!("r{i:04}"), "1")).collect();
        cache_writer.apply(C, Update::Full(many), Origin::Upstream);
        let before = cache.get(C).unwrap();
        let mut next: Vec<_> = (1..1000).map(|i| resource(&format!("r{i:04}"), "1")).collect();
        next[10] = resource("r0011", "2");
        next.push(resource("zz", "1"));
        cache_writer.apply(C, Update::Full(next), Origin::Upstream);
        let after = cache.get(C).unwrap();
        assert_eq!(after.len(), 1000);
        let diff = Diff::between(&before.resources, &after.resources);
        let upserts: Vec<&str> = diff.upserts.iter().map(|r| &*r.name).collect();
        assert_eq!(upserts, ["r0011", "zz"]);
        assert_eq!(diff.removed, vec![Arc::<str>::from("r0000")]);
    }

    /// Each version's diff from every earlier one is exactly what changed,
    /// checked name by name, over applies that share most of the tree (the
    /// diff skips shared nodes: imbl 6 dropped the first change after a
    /// shared leaf, which left named and incremental clients behind).
    #[test]
    fn diffs_between_any_two_versions_are_exact() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(24), |(
            size in 200usize..3000,
            changes in proptest::collection::vec(proptest::collection::vec((0usize..3000, 0u8..8), 1..60), 2..8),
        )| {
            let (cache, mut writer) = Cache::new();
            let name = |n: usize| format!("r{n:05}");
            writer.apply(C, Update::Full((0..size).map(|n| resource(&name(n), "0")).collect()), Origin::Upstream);
            let mut versions = vec![cache.get(C).unwrap()];
            for (step, change) in changes.iter().enumerate() {
                let mut upserts = Vec::new();
                let mut removed = Vec::new();
                for &(n, what) in change {
                    match what {
                        0 => removed.push(name(n)),
                        _ => upserts.push(resource(&name(n), &format!("{}", step + 1))),
                    }
                }
                writer.apply(C, Update::Incremental { upserts, removed }, Origin::Upstream);
                versions.push(cache.get(C).unwrap());
            }
            for (i, from) in versions.iter().enumerate() {
                for to in &versions[i + 1..] {
                    let diff = Diff::between(&from.resources, &to.resources);
                    let upserts: Vec<&str> = diff.upserts.iter().map(|r| &*r.name).collect();
                    let expected: Vec<&str> = to
                        .resources
                        .iter()
                        .filter(|(n, r)| from.resources.get(*n).is_none_or(|f| f != *r))
                        .map(|(n, _)| &**n)
                        .collect();
                    proptest::prop_assert_eq!(upserts, expected);
                    let gone: Vec<&str> = from.resources.keys().filter(|n| !to.resources.contains_key(*n)).map(|n| &**n).collect();
                    let removed: Vec<&str> = diff.removed.iter().map(|n| &**n).collect();
                    proptest::prop_assert_eq!(removed, gone);
                }
            }
        });
    }

    #[test]
    fn diff_from_client_versions() {
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(
            C,
            Update::Full(vec![resource("a", "1"), resource("b", "2")]),
            Origin::Upstream,
        );
        let snapshot = cache.get(C).unwrap();
        let known = [("0", "1"), ("a", "1"), ("b", "1"), ("z", "9"), ("z", "9")];
        let diff = Diff::from_versions(&known, &snapshot.resources);
        assert_eq!(diff.upserts.iter().map(|r| &*r.name).collect::<Vec<_>>(), ["b"]);
        assert_eq!(diff.removed, ["0", "z"]);
        let from_nothing = Diff::from_versions(&[], &snapshot.resources);
        assert_eq!(from_nothing.upserts.len(), 2);
        assert!(from_nothing.removed.is_empty());
    }

    /// What the chunks store: each member's name and bytes (chunks keep the
    /// order resources arrived in, which a version rebuilt from the history
    /// need not share).
    fn stored(snapshot: &CollectionSnapshot) -> std::collections::BTreeMap<String, Bytes> {
        snapshot
            .chunks()
            .flat_map(|c| c.members().iter().map(|m| (m.name.to_string(), m.encoded.clone())))
            .collect()
    }

    /// An incremental update of generated names (`name(i)`) at versions `v`.
    fn generated_step(name: impl Fn(u16) -> String, upserts: &[(u16, u8)], removed: &[u16]) -> Update {
        Update::Incremental {
            upserts: upserts
                .iter()
                .map(|(i, v)| resource(&name(*i), &v.to_string()))
                .collect(),
            removed: removed.iter().map(|i| name(*i)).collect(),
        }
    }

    #[test]
    fn a_resource_version_is_read_as_protobuf_merges_it() {
        use prost::encoding::{bytes as field, string};
        let metadata = |fields: &[(u32, &str)]| {
            let mut buf = Vec::new();
            for (number, value) in fields {
                string::encode(*number, &(*value).to_owned(), &mut buf);
            }
            buf
        };
        let resource = |metadatas: &[Vec<u8>]| {
            let mut buf = Vec::new();
            for m in metadatas {
                field::encode(1, m, &mut buf);
            }
            field::encode(2, &Vec::new(), &mut buf);
            buf
        };
        // As a source sends it: name, then version.
        let one = crate::proto::wire::test_support::encoded_resource("a", "17", b"x");
        assert_eq!(stored_version(&one), "17");
        assert_eq!(
            stored_version(&one),
            <crate::proto::Resource as prost::Message>::decode(one.clone())
                .unwrap()
                .metadata
                .unwrap()
                .version
        );
        // Given twice, in one metadata or in two: the last one counts,
        // as prost's decoding reads it (an explicit "" too).
        for (bytes, expected) in [
            (resource(&[metadata(&[(1, "a"), (3, "1"), (3, "2")])]), "2"),
            (resource(&[metadata(&[(3, "1")]), metadata(&[(1, "a"), (3, "3")])]), "3"),
            (resource(&[metadata(&[(3, "1")]), metadata(&[(3, "")])]), ""),
            (resource(&[metadata(&[(3, "1")]), metadata(&[(1, "a")])]), "1"),
            (resource(&[metadata(&[(1, "a")])]), ""),
            (resource(&[]), ""),
        ] {
            let decoded = <crate::proto::Resource as prost::Message>::decode(&bytes[..]).unwrap();
            assert_eq!(stored_version(&bytes), expected);
            assert_eq!(decoded.metadata.unwrap_or_default().version, expected);
        }
        // Bytes that are no `Resource`: no version, and no panic.
        for bad in [&b"\xff\xff\xff"[..], &b"\x0a\x05ab"[..], &b"\x0a\x02\x1a\x05"[..], b"x"] {
            assert_eq!(stored_version(bad), "");
        }
        let not_utf8 = resource(&[]);
        let mut not_utf8 = not_utf8.clone();
        let mut m = Vec::new();
        field::encode(3, &vec![0xc3], &mut m);
        let mut bytes = Vec::new();
        field::encode(1, &m, &mut bytes);
        not_utf8.splice(0..0, bytes);
        assert_eq!(stored_version(&not_utf8), "");
    }

    proptest::proptest! {
        /// A map built whole holds what inserting the resources one by one
        /// in their order holds: each name's last resource, in name order.
        #[test]
        fn a_map_built_whole_is_the_map_its_inserts_make(
            arrived in proptest::collection::vec((0u16..300, 0u8..3), 0..400),
        ) {
            let arrived: Vec<Arc<CachedResource>> = arrived
                .iter()
                .map(|(i, v)| Arc::new(resource(&format!("n{i:03}"), &v.to_string())))
                .collect();
            let mut inserted = ResourceMap::new();
            for resource in &arrived {
                inserted.insert(resource.name.clone(), resource.clone());
            }
            let packed = packed_map(arrived.iter().cloned());
            let entries = |m: &ResourceMap| m.iter().map(|(k, v)| (k.clone(), Arc::as_ptr(v))).collect::<Vec<_>>();
            proptest::prop_assert_eq!(entries(&packed), entries(&inserted));
        }

        /// Under any applies, every version the history still holds rebuilds
        /// to exactly the resources it had, with its content version, and
        /// the history holds the last N distinct versions.
        #[test]
        fn every_version_in_the_history_rebuilds_as_it_was(
            keep in 1usize..5,
            steps in proptest::collection::vec(
                (proptest::collection::vec((0u16..40, 0u8..3), 0..6), proptest::collection::vec(0u16..40, 0..4)),
                1..12,
            ),
        ) {
            let name = |i: u16| format!("n{i:02}");
            let (cache, mut writer) = Cache::with_history(keep);
            let mut seen: Vec<Arc<CollectionSnapshot>> = Vec::new();
            for (upserts, removed) in steps {
                writer.apply(C, generated_step(name, &upserts, &removed), Origin::Upstream);
                let now = cache.get(C).unwrap();
                if seen.last().is_none_or(|last| last.version != now.version) {
                    seen.push(now);
                }
                let history = cache.history(C).unwrap();
                let expected: Vec<&str> = seen.iter().rev().take(keep).map(|s| &*s.version).collect();
                let listed: Vec<&str> = history.iter().map(|e| &*e.version).collect();
                proptest::prop_assert_eq!(&listed, &expected);
                for snapshot in seen.iter().rev().take(keep) {
                    let rebuilt = cache.version_resources(C, &snapshot.version).unwrap();
                    proptest::prop_assert!(rebuilt == snapshot.resources);
                    proptest::prop_assert_eq!(collection_version(&rebuilt), &*snapshot.version);
                    // As a snapshot to serve (a pin): the same version, size
                    // and stored resources as the one that was current then.
                    let served = cache.version_snapshot(C, &snapshot.version).unwrap();
                    proptest::prop_assert_eq!(&served.version, &snapshot.version);
                    proptest::prop_assert_eq!(served.bytes, snapshot.bytes);
                    proptest::prop_assert_eq!(stored(&served), stored(snapshot));
                    proptest::prop_assert_eq!(served.chunks().map(|c| c.members().len()).sum::<usize>(), snapshot.len());
                }
                proptest::prop_assert!(cache.version_snapshot(C, "no such version").is_none());
            }
        }

    }
}
