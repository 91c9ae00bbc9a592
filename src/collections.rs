//! The collection ↔ type URL table: Istio's built-in rows, the operator's
//! `--type-map` overrides, and how a downstream `type_url` resolves to a
//! collection in either dialect (Istio 1.0 type URLs, 1.1 collection names).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use crate::SharedStr;

/// Istio's collections (copied from `shared/design/istio-collections.tsv`).
const BUILTIN_TSV: &str = include_str!("../data/istio-collections.tsv");

/// Collections no Galley served: the types istiod 1.8+ added, and Envoy's
/// own resource types (plain xDS). Same columns as [`BUILTIN_TSV`].
const XDS_TSV: &str = include_str!("../data/xds-collections.tsv");

/// The Kubernetes GVKs istiod 1.8+ asks for over MCP over xDS, each to the
/// collection that answers it (every alias of a kind is the same body proto).
const GVK_TSV: &str = include_str!("../data/istio-gvks.tsv");

/// The Kubernetes kinds Galley read for the collections istiod never asks
/// for (Istio 1.0-1.7: authentication and rbac `v1alpha1`, Mixer, Kubernetes
/// core), with their scope: read by the files source only, never resolved
/// as xDS types.
const KINDS_TSV: &str = include_str!("../data/istio-kinds.tsv");

/// The type istiod asks for first and never waits for: answered empty.
pub const MESH_CONFIG_GVK: &str = "core/v1alpha1/MeshConfig";

/// The prefix that marks a downstream `type_url` as a proto type URL (1.0).
pub const TYPE_URL_PREFIX: &str = "type.googleapis.com/";

/// Whether `type_url` names a message called like a secret (`…Secret`, in
/// any case and package, read after the last `/` as Envoy reads it): Envoy
/// v2's `envoy.api.v2.auth.Secret`, Kubernetes' `k8s.io.api.core.v1.Secret`,
/// whose descriptors (when an operator gives them) mark no field. A
/// collection of such bodies is a collection of secrets, and such a body
/// is refused outside one (unless the gateway's own descriptors know the
/// type and mark nothing in it: `source::proto_json::secret_by_name`).
pub fn named_like_a_secret(type_url: &str) -> bool {
    let name = full_name(type_url);
    let message = name.rsplit('.').next().unwrap_or(name).as_bytes();
    // Compared in place, any case: no lowercased copy per call (asked for
    // each collection a table holds, and for bodies' type URLs).
    message.len() >= 6 && message[message.len() - 6..].eq_ignore_ascii_case(b"secret")
}

/// The message's full name in `type_url` as Envoy reads it: after the last
/// `/`, trimmed.
pub fn full_name(type_url: &str) -> &str {
    type_url.rsplit('/').next().unwrap_or(type_url).trim()
}

/// [`named_like_a_secret`], or named like Envoy's key material in any
/// package and version (`…TlsCertificate`, `…TlsSessionTicketKeys`: v2's
/// `envoy.api.v2.auth`, v4alpha's), whose descriptors the gateway may not
/// have: values that are secrets themselves.
pub fn named_like_key_material(type_url: &str) -> bool {
    let name = full_name(type_url);
    let message = name.rsplit('.').next().unwrap_or(name);
    named_like_a_secret(type_url)
        || message.eq_ignore_ascii_case("TlsCertificate")
        || message.eq_ignore_ascii_case("TlsSessionTicketKeys")
}

/// Whether a state-of-the-world response of `type_url`, to a client that
/// names the resources it asks for, may carry only some of them (what
/// changed since it was last sent, and what it newly asks for): the client
/// keeps what a response leaves out. Envoy's xDS protocol ("Grouping
/// Resources into Responses") groups every type but listeners and clusters
/// "in the same way as in the incremental protocol variants"; Envoy's gRPC
/// mux updates only the watches a response names, and grpc's xDS clients
/// take a left-out resource as deleted only where the type requires all
/// resources in every response (`AllResourcesRequiredInSotW`: listeners and
/// clusters). Of those types, the two the gateway tests with both: Envoy's
/// v3 `RouteConfiguration` and `ClusterLoadAssignment`.
pub fn sotw_keeps_what_is_left_out(type_url: &str) -> bool {
    matches!(
        type_url,
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
            | "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    )
}

/// Shared by every Mixer adapter/template collection: never addressable by
/// type URL, since it cannot name one collection.
const STRUCT_TYPE_URL: &str = "type.googleapis.com/google.protobuf.Struct";

#[derive(Debug, thiserror::Error)]
pub enum CollectionError {
    #[error("unsupported type_url {0:?}")]
    UnsupportedTypeUrl(String),
    #[error("cannot read {path}: {source}")]
    ReadTypeMap { path: String, source: std::io::Error },
    #[error(
        "{path} is not a YAML mapping of `collection: type_url` or `collection: {{type_url: ..., sensitive: true}}` \
         rows: {reason}"
    )]
    ParseTypeMap { path: String, reason: String },
    #[error("{path}: {reason}")]
    InvalidTypeMap { path: String, reason: String },
    #[error("built-in collection table, line {line}: {reason}")]
    Builtin { line: usize, reason: String },
}

/// Which wire dialect a downstream request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Dialect {
    /// Istio 1.0: `type_url` is a proto type URL.
    #[serde(rename = "1.0")]
    V1_0,
    /// Istio 1.1 legacy mode: `type_url` is a collection name.
    #[serde(rename = "1.1")]
    V1_1,
    /// Envoy's v3 xDS: a GVK (istiod 1.8+) or a proto type URL (Envoy).
    #[serde(rename = "xds")]
    Xds,
}

impl Dialect {
    pub fn of(type_url: &str) -> Self {
        if type_url.starts_with(TYPE_URL_PREFIX) {
            Dialect::V1_0
        } else {
            Dialect::V1_1
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::V1_0 => "1.0",
            Dialect::V1_1 => "1.1",
            Dialect::Xds => "xds",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectionInfo {
    pub name: SharedStr,
    pub body_type_url: String,
    pub default_subscribed: bool,
}

/// What an xDS type URL resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XdsType {
    /// A collection: its resources, each wrapped as an
    /// `istio.mcp.v1alpha1.Resource` (a GVK, MCP over xDS) or as the body
    /// itself (an Envoy type URL, plain xDS).
    Collection { collection: SharedStr, wrapped: bool },
    /// No collection answers it (an unknown GVK, `core/v1alpha1/MeshConfig`,
    /// istiod's `istio.io/*` debug types): answered once, empty.
    Unserved,
}

/// A Kubernetes kind the files source reads (`apiVersion` + `kind`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindInfo {
    pub collection: SharedStr,
    /// A cluster-scoped kind (MeshPolicy, ClusterRbacConfig): its resources
    /// are named `name`, as Galley named them, not `namespace/name`.
    pub cluster_scoped: bool,
}

/// A resolved downstream `type_url`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub collection: SharedStr,
    pub dialect: Dialect,
}

#[derive(Clone, Debug)]
pub struct CollectionTable {
    by_name: BTreeMap<SharedStr, CollectionInfo>,
    owner_by_type_url: HashMap<String, SharedStr>,
    /// GVK (`networking.istio.io/v1/VirtualService`) to collection.
    by_gvk: HashMap<String, SharedStr>,
    /// `apiVersion/kind` to collection, for the files source: every GVK
    /// above and the kinds of [`KINDS_TSV`].
    by_kind: HashMap<String, KindInfo>,
    /// The body types that hold a secret (a field marked
    /// `(udpa.annotations.sensitive) = true` at any depth): computed from
    /// the descriptors where they live and handed in by
    /// [`CollectionTable::with_sensitive_types`], since this room imports none.
    sensitive_types: Arc<HashSet<String>>,
    /// Collections a `--type-map` row marks `sensitive: true`, whatever their type.
    marked_sensitive: HashSet<SharedStr>,
    /// The key the versions of sensitive collections' resources are made
    /// with ([`CollectionTable::version_key`]), shared by the table's clones.
    version_key: Arc<std::sync::OnceLock<VersionKey>>,
}

/// A key that versions of a sensitive collection's resources are made with
/// (keyed digests, not plain hashes of their content: a version shown in a
/// view is no test of a guessed secret). Never printed.
#[derive(Clone)]
pub struct VersionKey {
    bytes: Arc<[u8]>,
    /// The HMAC key made of `bytes` once, not per resource.
    hmac: ring::hmac::Key,
}

impl VersionKey {
    /// The fewest bytes a key may have.
    pub const MIN_BYTES: usize = 32;

    /// A key of `bytes`; `None` when they are fewer than [`Self::MIN_BYTES`].
    pub fn new(bytes: &[u8]) -> Option<Self> {
        (bytes.len() >= Self::MIN_BYTES).then(|| Self {
            bytes: bytes.into(),
            hmac: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes),
        })
    }

    /// A new random key.
    pub fn random() -> Self {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; Self::MIN_BYTES];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .expect("the system's random source is readable");
        Self::new(&bytes).expect("MIN_BYTES bytes")
    }

    /// The key's bytes (what `--cache-dir` keeps).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The HMAC-SHA-256 key versions are made with.
    pub fn hmac(&self) -> &ring::hmac::Key {
        &self.hmac
    }
}

impl std::fmt::Debug for VersionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VersionKey([redacted])")
    }
}

/// A `--type-map` row: `collection: type_url`, or
/// `collection: {type_url: ..., sensitive: true}` for a collection whose
/// bodies hold secrets the gateway has no descriptor to see.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(untagged)]
enum TypeMapRow {
    TypeUrl(String),
    Row(TypeMapEntry),
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TypeMapEntry {
    type_url: String,
    #[serde(default)]
    sensitive: bool,
}

impl TypeMapRow {
    fn type_url(&self) -> &str {
        match self {
            TypeMapRow::TypeUrl(type_url) | TypeMapRow::Row(TypeMapEntry { type_url, .. }) => type_url,
        }
    }

    fn sensitive(&self) -> bool {
        matches!(self, TypeMapRow::Row(TypeMapEntry { sensitive: true, .. }))
    }
}

// === impl CollectionTable ===

impl CollectionTable {
    /// Istio's collections, as shipped.
    pub fn builtin() -> Self {
        let mut table =
            Self::parse_tsv(&[BUILTIN_TSV, XDS_TSV]).expect("the embedded collection table is valid (unit-tested)");
        for line in GVK_TSV.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            let mut cols = line.split('\t');
            let (Some(gvk), Some(collection)) = (cols.next(), cols.next()) else {
                continue;
            };
            let name = table
                .name(collection)
                .expect("every GVK row names a collection of the table (unit-tested)");
            table.by_gvk.insert(gvk.to_owned(), name.clone());
            table.by_kind.insert(
                gvk.to_owned(),
                KindInfo {
                    collection: name,
                    cluster_scoped: false,
                },
            );
        }
        for line in KINDS_TSV.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            let mut cols = line.split('\t');
            let (Some(gvk), Some(collection), Some(scope)) = (cols.next(), cols.next(), cols.next()) else {
                continue;
            };
            let collection = table
                .name(collection)
                .expect("every kind row names a collection of the table (unit-tested)");
            table.by_kind.insert(
                gvk.to_owned(),
                KindInfo {
                    collection,
                    cluster_scoped: scope == "cluster",
                },
            );
        }
        table
    }

    fn parse_tsv(tables: &[&str]) -> Result<Self, CollectionError> {
        let mut by_name = BTreeMap::new();
        let mut owner_by_type_url = HashMap::new();
        for (index, line) in tables.iter().flat_map(|tsv| tsv.lines().enumerate().skip(1)) {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |reason: &str| CollectionError::Builtin {
                line: index + 1,
                reason: reason.to_owned(),
            };
            let cols: Vec<&str> = line.split('\t').collect();
            if cols.len() < 5 {
                return Err(bad("fewer than 5 columns"));
            }
            let flag = |value: &str| match value {
                "yes" => Ok(true),
                "no" => Ok(false),
                _ => Err(bad("flags are yes or no")),
            };
            let name: SharedStr = SharedStr::from(cols[0]);
            if flag(cols[4])? && owner_by_type_url.insert(cols[1].to_owned(), name.clone()).is_some() {
                return Err(bad("a second owner for one type URL"));
            }
            by_name.insert(
                name.clone(),
                CollectionInfo {
                    name,
                    body_type_url: cols[1].to_owned(),
                    default_subscribed: flag(cols[3])?,
                },
            );
        }
        Ok(Self {
            by_name,
            owner_by_type_url,
            by_gvk: HashMap::new(),
            by_kind: HashMap::new(),
            sensitive_types: Arc::default(),
            marked_sensitive: HashSet::new(),
            version_key: Arc::default(),
        })
    }

    /// The body type URLs that hold a secret: every collection whose body
    /// is one of them is sensitive ([`CollectionTable::is_sensitive`]). The
    /// gateway hands in what its descriptors say
    /// (`source::proto_json::secret_type_urls`, wired in `config.rs`);
    /// a table built without this knows only the `--type-map` rows marked
    /// `sensitive: true`.
    pub fn with_sensitive_types(mut self, type_urls: impl IntoIterator<Item = String>) -> Self {
        self.sensitive_types = Arc::new(type_urls.into_iter().collect());
        self
    }

    /// Whether `collection`'s bodies are secrets: its body type is one the
    /// gateway was handed as such (from the descriptors: a field marked
    /// `(udpa.annotations.sensitive) = true` within two fields, Envoy's
    /// `Secret`; see `source::proto_json::secret_type_urls`), or a message
    /// named like a secret ([`named_like_a_secret`]: Envoy v2's, Kubernetes'
    /// `Secret`, whose descriptors mark nothing), or a `--type-map` row
    /// marks it `sensitive: true`.
    /// An unknown collection is not sensitive.
    pub fn is_sensitive(&self, collection: &str) -> bool {
        self.by_name.get(collection).is_some_and(|info| {
            self.marked_sensitive.contains(&info.name)
                || self.sensitive_types.contains(&info.body_type_url)
                || named_like_key_material(&info.body_type_url)
        })
    }

    /// Every sensitive collection ([`Self::is_sensitive`]), in name order.
    pub fn sensitive_collections(&self) -> impl Iterator<Item = &SharedStr> + '_ {
        self.by_name.keys().filter(|name| self.is_sensitive(name))
    }

    /// The body type URL a sensitive collection declares (`None`: not
    /// sensitive): the only type whose bodies there are shown with their
    /// secret fields redacted; a body claiming any other type is hidden
    /// whole (its bytes may be a secret under another name).
    /// Sets the key the versions of sensitive collections' resources are
    /// made with (`--sensitive-version-key`, or the one kept in
    /// `--cache-dir`), before any is made; `false` when one was in use.
    pub fn set_version_key(&self, key: VersionKey) -> bool {
        self.version_key.set(key).is_ok()
    }

    /// Whether a version key is set (or was made at first use).
    pub fn has_version_key(&self) -> bool {
        self.version_key.get().is_some()
    }

    /// The key versions of `collection`'s resources are made with when it
    /// is sensitive: the one set, or a random one made at first use (this
    /// process's own: versions then differ from other replicas').
    pub fn version_key(&self, collection: &str) -> Option<&VersionKey> {
        self.is_sensitive(collection).then(|| self.redacted_values_key())
    }

    /// The key the versions of a resource of any collection are made with
    /// when the views hide part of its body (an inline private key in a
    /// cluster): the sensitive collections' key (see
    /// [`Self::version_key`]).
    pub fn redacted_values_key(&self) -> &VersionKey {
        self.version_key.get_or_init(VersionKey::random)
    }

    pub fn sensitive_body_type(&self, collection: &str) -> Option<&str> {
        self.by_name
            .get(collection)
            .filter(|_| self.is_sensitive(collection))
            .map(|info| info.body_type_url.as_str())
    }

    /// The body type URL of every sensitive collection, for the views that
    /// show bodies (a type marked by `--type-map` alone is shown redacted whole).
    pub fn sensitive_body_types(&self) -> Vec<String> {
        self.by_name
            .values()
            .filter(|info| self.is_sensitive(&info.name))
            .map(|info| info.body_type_url.clone())
            .collect()
    }

    /// The body types that are secrets wherever they are sent: a sensitive
    /// collection's body type that no other collection declares (an
    /// operator's `foo.Vault` marked `sensitive: true`; not a `Cluster` of
    /// a collection so marked, which the clusters collection serves, nor
    /// `google.protobuf`'s own, which carry anything).
    pub fn secret_only_body_types(&self) -> Vec<String> {
        let open: HashSet<&str> = self
            .by_name
            .values()
            .filter(|info| !self.is_sensitive(&info.name))
            .map(|info| info.body_type_url.as_str())
            .collect();
        let mut types = self.sensitive_body_types();
        types.retain(|t| !open.contains(t.as_str()) && !t.starts_with("type.googleapis.com/google.protobuf."));
        types
    }

    /// Adds or overrides rows from a YAML file of `collection: type_url` rows
    /// (or `collection: {type_url: ..., sensitive: true}`).
    /// A row from the file owns its type URL (the operator's word wins over the
    /// built-in table); two rows of the file claiming one type URL are an error.
    pub fn with_type_map_file(self, path: &Path) -> Result<Self, CollectionError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CollectionError::ReadTypeMap {
            path: shown.clone(),
            source,
        })?;
        let map: BTreeMap<String, TypeMapRow> =
            serde_norway::from_str(&text).map_err(|e| CollectionError::ParseTypeMap {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        self.with_type_map(map)
            .map_err(|reason| CollectionError::InvalidTypeMap { path: shown, reason })
    }

    /// [`Self::with_type_map_file`] from its text.
    #[cfg(test)]
    pub fn with_type_map_yaml(self, text: &str) -> Result<Self, String> {
        let map: BTreeMap<String, TypeMapRow> = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        self.with_type_map(map)
    }

    fn with_type_map(mut self, map: BTreeMap<String, TypeMapRow>) -> Result<Self, String> {
        let mut claimed: HashMap<&str, &str> = HashMap::new();
        for (collection, row) in &map {
            let type_url = row.type_url();
            if collection.is_empty() || collection.starts_with(TYPE_URL_PREFIX) {
                return Err(format!(
                    "{collection:?} is not a collection name (collections look like istio/networking/v1alpha3/virtualservices)"
                ));
            }
            if !type_url.starts_with(TYPE_URL_PREFIX) {
                return Err(format!(
                    "the type URL of {collection:?} must start with {TYPE_URL_PREFIX:?}, got {type_url:?}"
                ));
            }
            if let Some(other) = claimed.insert(type_url, collection) {
                return Err(format!(
                    "{other:?} and {collection:?} both map to {type_url:?}; a type URL can resolve to one collection only"
                ));
            }
        }
        for (collection, row) in map {
            let name: SharedStr = SharedStr::from(collection.as_str());
            if row.sensitive() {
                self.marked_sensitive.insert(name.clone());
            } else {
                // An override written without the flag is what its type says.
                self.marked_sensitive.remove(&name);
            }
            let type_url = row.type_url().to_owned();
            // The row's old type URL no longer resolves to it.
            self.owner_by_type_url.retain(|_, owner| *owner != name);
            if type_url != STRUCT_TYPE_URL {
                self.owner_by_type_url.insert(type_url.clone(), name.clone());
            }
            let default_subscribed = self.by_name.get(&name).is_some_and(|c| c.default_subscribed);
            self.by_name.insert(
                name.clone(),
                CollectionInfo {
                    name,
                    body_type_url: type_url,
                    default_subscribed,
                },
            );
        }
        Ok(self)
    }

    /// Resolves a downstream `type_url` in either dialect.
    pub fn resolve(&self, type_url: &str) -> Result<Resolved, CollectionError> {
        let dialect = Dialect::of(type_url);
        let collection = match dialect {
            Dialect::V1_0 => self.owner_by_type_url.get(type_url).cloned(),
            Dialect::V1_1 | Dialect::Xds => self.by_name.get(type_url).map(|c| c.name.clone()),
        };
        collection
            .map(|collection| Resolved { collection, dialect })
            .ok_or_else(|| CollectionError::UnsupportedTypeUrl(type_url.to_owned()))
    }

    /// Resolves an xDS `type_url`: a GVK (MCP over xDS), an Envoy or other
    /// proto type URL a collection owns (plain xDS), or nothing this gateway
    /// serves.
    pub fn resolve_xds(&self, type_url: &str) -> XdsType {
        if let Some(collection) = self.by_gvk.get(type_url) {
            return XdsType::Collection {
                collection: collection.clone(),
                wrapped: true,
            };
        }
        match self.owner_by_type_url.get(type_url) {
            Some(collection) => XdsType::Collection {
                collection: collection.clone(),
                wrapped: false,
            },
            None => XdsType::Unserved,
        }
    }

    /// Every xDS type URL the table answers with a collection: the GVKs
    /// (MCP over xDS) and the proto type URLs a collection owns (plain
    /// xDS), sorted.
    pub fn xds_type_urls(&self) -> Vec<&str> {
        let mut all: Vec<&str> = self
            .by_gvk
            .keys()
            .chain(self.owner_by_type_url.keys())
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all
    }

    /// A GVK that names `collection` (of several aliases, the first in
    /// sorted order), if any does.
    pub fn gvk(&self, collection: &str) -> Option<&str> {
        self.by_gvk
            .iter()
            .filter(|(_, c)| ***c == *collection)
            .map(|(gvk, _)| gvk.as_str())
            .min()
    }

    /// The kind a Kubernetes resource names (`apiVersion`, `kind`), if the
    /// files source reads it.
    pub fn kind(&self, api_version: &str, kind: &str) -> Option<&KindInfo> {
        self.by_kind.get(&format!("{api_version}/{kind}"))
    }

    /// The kinds of `api_version` the files source reads, sorted (for
    /// errors); empty for an `apiVersion` it has none of.
    pub fn kinds_of(&self, api_version: &str) -> Vec<&str> {
        let mut kinds: Vec<&str> = self
            .by_kind
            .keys()
            .filter_map(|gvk| gvk.strip_prefix(api_version)?.strip_prefix('/'))
            .filter(|kind| !kind.contains('/'))
            .collect();
        kinds.sort_unstable();
        kinds
    }

    /// Every API group the files source reads a kind of, sorted (for errors).
    pub fn api_groups(&self) -> Vec<&str> {
        let mut groups: Vec<&str> = self
            .by_kind
            .keys()
            .filter_map(|gvk| gvk.rsplitn(3, '/').nth(2))
            .collect();
        groups.sort_unstable();
        groups.dedup();
        groups
    }

    pub fn get(&self, collection: &str) -> Option<&CollectionInfo> {
        self.by_name.get(collection)
    }

    /// The collection as the table names it (one shared allocation per name).
    pub fn name(&self, collection: &str) -> Option<SharedStr> {
        self.by_name.get(collection).map(|c| c.name.clone())
    }

    pub fn default_subscriptions(&self) -> Vec<SharedStr> {
        self.by_name
            .values()
            .filter(|c| c.default_subscribed)
            .map(|c| c.name.clone())
            .collect()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Every collection the table has, in name order.
    pub fn collection_names(&self) -> impl Iterator<Item = &SharedStr> {
        self.by_name.keys()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// `type_url` as the key a stream follows it by: for a type URL this
    /// table answers (a collection's name, a body type URL a collection
    /// owns, a GVK), one string for the whole process ([`interned`]), so
    /// the thousands of streams that follow one type read and clone one
    /// hot line rather than each a string of its own (each stream's own
    /// copy was a cache miss at every wake and every view it published:
    /// BENCHMARKS, session 43); any other, a string of the stream's own.
    pub fn type_key(&self, type_url: &str) -> SharedStr {
        let known = self.by_name.contains_key(type_url)
            || self.owner_by_type_url.contains_key(type_url)
            || self.by_gvk.contains_key(type_url);
        if known {
            interned(type_url)
        } else {
            SharedStr::from(type_url)
        }
    }
}

/// The most strings [`interned`] keeps: more than the type URLs of every
/// table a process builds (its own, and the tests').
const INTERNED_AT_MOST: usize = 4096;

/// `text` as one string for the whole process, never freed: static, so
/// clones of it read its header and write nothing (no reference count
/// shared by the cores that run streams). Only for the finite set of
/// names a collection table knows; past [`INTERNED_AT_MOST`] a string of
/// its own.
fn interned(text: &str) -> SharedStr {
    static INTERNED: std::sync::OnceLock<std::sync::Mutex<HashSet<SharedStr>>> = std::sync::OnceLock::new();
    let mut set = INTERNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(known) = set.get(text) {
        return known.clone();
    }
    let new = SharedStr::from(text);
    if set.len() < INTERNED_AT_MOST {
        new.leak();
        set.insert(new.clone());
    }
    new
}

/// The response header a stream of the gateway's carries, naming the
/// sensitive collections its client may read (a `--type-map` row marked
/// `sensitive: true` among them), each by its name and its body type URL,
/// so that the `client` command redacts their bodies as the gateway's views
/// do without being given the gateway's `--type-map`. Absent when the client
/// may read none.
pub const SENSITIVE_HEADER: &str = "x-mcp-gateway-sensitive";

/// Any byte of a collection's name but these is percent-encoded in the
/// header (a name may hold anything, a header value only visible ASCII).
const HEADER_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'/')
    .remove(b'.')
    .remove(b'-')
    .remove(b'_');

/// [`SENSITIVE_HEADER`]'s value: `names`, each percent-encoded, joined by `,`.
pub fn sensitive_header<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|name| percent_encoding::utf8_percent_encode(name, HEADER_KEEPS).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The collections a [`SENSITIVE_HEADER`] value names; `None` when an
/// entry is not as [`sensitive_header`] writes it (a byte it would have
/// encoded, a `%` not followed by two hex digits, text that is not UTF-8,
/// an empty entry between commas): its reader then cannot tell what is
/// sensitive.
pub fn from_sensitive_header(value: &str) -> Option<Vec<String>> {
    let written = |name: &str| {
        let bytes = name.as_bytes();
        let mut at = 0;
        while at < bytes.len() {
            match bytes[at] {
                b'%' if bytes.len() > at + 2 && bytes[at + 1..at + 3].iter().all(u8::is_ascii_hexdigit) => at += 3,
                b if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'.' | b'-' | b'_') => at += 1,
                _ => return false,
            }
        }
        true
    };
    if value.is_empty() {
        return Some(Vec::new());
    }
    value
        .split(',')
        .map(|name| {
            (!name.is_empty() && written(name))
                .then(|| percent_encoding::percent_decode_str(name).decode_utf8().ok())
                .flatten()
                .map(|decoded| decoded.into_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VS: &str = "istio/networking/v1alpha3/virtualservices";
    const VS_URL: &str = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";

    #[test]
    fn builtin_table_parses_with_istio_defaults() {
        let table = CollectionTable::builtin();
        assert_eq!(table.len(), 66 + 9, "Galley's collections and the xDS-only ones");
        let defaults: Vec<String> = table.default_subscriptions().iter().map(|c| c.to_string()).collect();
        assert_eq!(
            defaults,
            [
                "istio/networking/v1alpha3/destinationrules",
                "istio/networking/v1alpha3/envoyfilters",
                "istio/networking/v1alpha3/gateways",
                "istio/networking/v1alpha3/serviceentries",
                "istio/networking/v1alpha3/sidecars",
                VS,
            ]
        );
    }

    /// Every type URL the table answers is one static string for the whole
    /// process, whichever table (or clone) is asked: the streams that follow
    /// it share it. Any other is a string of its own, never kept.
    #[test]
    fn a_served_type_url_is_one_static_string_and_any_other_its_own() {
        let table = CollectionTable::builtin();
        let cla = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
        let gvk = table.by_gvk.keys().next().expect("a GVK").clone();
        for served in [VS, VS_URL, cla, gvk.as_str()] {
            let key = table.type_key(served);
            assert_eq!(key, served);
            assert!(SharedStr::is_static(&key), "{served}");
            // Asked with a copy of the text: the string is the table's.
            let copy = String::from(served);
            let again = CollectionTable::builtin().type_key(copy.as_str());
            assert!(SharedStr::ptr_eq(&key, &again), "{served}: one string");
        }
        let unknown = table.type_key("type.googleapis.com/made.Up");
        assert_eq!(unknown, "type.googleapis.com/made.Up");
        assert!(!SharedStr::is_static(&unknown));
        let other = table.type_key("type.googleapis.com/made.Up");
        assert!(!SharedStr::ptr_eq(&unknown, &other), "not kept");
    }

    /// The crate embeds its own copy so it builds anywhere; developers and CI
    /// have `shared/` beside the repository, and the copy must not drift.
    #[test]
    fn the_embedded_table_is_the_shared_design_table() {
        let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/design/istio-collections.tsv");
        match std::fs::read_to_string(&shared) {
            Ok(text) => assert!(
                text == BUILTIN_TSV,
                "{} changed: copy it to data/istio-collections.tsv",
                shared.display()
            ),
            Err(e) => eprintln!("{} not readable ({e}); nothing to compare", shared.display()),
        }
    }

    #[test]
    fn both_dialects_resolve() {
        let table = CollectionTable::builtin();
        let by_url = table.resolve(VS_URL).unwrap();
        assert_eq!((&*by_url.collection, by_url.dialect), (VS, Dialect::V1_0));
        let by_name = table.resolve(VS).unwrap();
        assert_eq!((&*by_name.collection, by_name.dialect), (VS, Dialect::V1_1));
    }

    #[test]
    fn shared_type_urls_resolve_to_their_owner() {
        let table = CollectionTable::builtin();
        let owner = |url: &str| table.resolve(url).unwrap().collection.to_string();
        assert_eq!(
            owner("type.googleapis.com/istio.authentication.v1alpha1.Policy"),
            "istio/authentication/v1alpha1/policies"
        );
        assert_eq!(
            owner("type.googleapis.com/istio.rbac.v1alpha1.RbacConfig"),
            "istio/rbac/v1alpha1/rbacconfigs"
        );
        assert_eq!(
            owner("type.googleapis.com/istio.networking.v1alpha3.ServiceEntry"),
            "istio/networking/v1alpha3/serviceentries"
        );
        // Non-owners are still reachable by collection name.
        assert!(table.resolve("istio/rbac/v1alpha1/clusterrbacconfigs").is_ok());
    }

    #[test]
    fn struct_empty_and_unknown_type_urls_are_unsupported() {
        let table = CollectionTable::builtin();
        for url in [STRUCT_TYPE_URL, "", "type.googleapis.com/no.Such", "istio/no/such"] {
            let err = table.resolve(url).unwrap_err();
            assert_eq!(err.to_string(), format!("unsupported type_url {url:?}"));
        }
    }

    #[test]
    fn type_map_adds_and_overrides_rows() {
        let mut map = BTreeMap::new();
        map.insert(
            "example.com/widgets".to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/example.Widget".to_string()),
        );
        map.insert(
            VS.to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/example.VS2".to_string()),
        );
        let table = CollectionTable::builtin().with_type_map(map).unwrap();
        assert_eq!(
            &*table.resolve("type.googleapis.com/example.Widget").unwrap().collection,
            "example.com/widgets"
        );
        assert_eq!(
            &*table.resolve("type.googleapis.com/example.VS2").unwrap().collection,
            VS
        );
        assert!(table.resolve(VS_URL).is_err(), "the overridden URL no longer resolves");
        assert!(
            table.get(VS).unwrap().default_subscribed,
            "an override keeps the default subscription"
        );
    }

    #[test]
    fn type_map_rejects_ambiguous_and_malformed_rows() {
        let mut map = BTreeMap::new();
        map.insert(
            "a/b".to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/x.Y".to_string()),
        );
        map.insert(
            "c/d".to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/x.Y".to_string()),
        );
        let err = CollectionTable::builtin().with_type_map(map).unwrap_err();
        assert!(err.contains("both map to"), "{err}");

        let mut map = BTreeMap::new();
        map.insert("a/b".to_string(), TypeMapRow::TypeUrl("x.Y".to_string()));
        let err = CollectionTable::builtin().with_type_map(map).unwrap_err();
        assert!(err.contains("must start with"), "{err}");
    }

    /// The table as the gateway builds it (`config.rs`): with what its
    /// descriptors say about secrets.
    fn with_descriptors(table: CollectionTable) -> CollectionTable {
        table.with_sensitive_types(crate::source::proto_json::secret_type_urls())
    }

    #[test]
    fn the_sensitive_header_names_any_collection_and_reads_back() {
        let names = ["custom/creds", "a,b c/\u{202e}ü", "plain.v1-x_y"];
        let value = super::sensitive_header(names);
        assert!(value.bytes().all(|b| b.is_ascii_graphic()), "{value}");
        assert_eq!(value.split(',').count(), 3, "{value}");
        assert_eq!(super::from_sensitive_header(&value).unwrap(), names);
        assert_eq!(super::from_sensitive_header(""), Some(vec![]));
        // Not as the gateway writes it: its reader cannot tell.
        for bad in [
            "custom/creds%",
            "%zz",
            "custom/creds;x",
            " custom/creds ",
            "%ff%fe",
            "a,b c",
            ",,,",
            "custom/creds,",
            ",custom/creds",
            "a,,b",
        ] {
            assert_eq!(super::from_sensitive_header(bad), None, "{bad}");
        }
    }

    #[test]
    fn sensitive_collections_are_what_the_descriptors_say() {
        let table = with_descriptors(CollectionTable::builtin());
        let sensitive: Vec<&str> = table
            .by_name
            .keys()
            .filter(|collection| table.is_sensitive(collection))
            .map(|collection| &**collection)
            .collect();
        // Envoy's Secret only: every other Envoy resource type can name a
        // `ConfigSource` whose Google gRPC SSL credentials hold a private
        // key (see proto_json's test for the paths), seven fields down, which
        // makes it no collection of secrets (its views still redact the
        // key). No Istio kind holds a field marked sensitive.
        assert_eq!(sensitive, ["envoy/extensions/transport_sockets/tls/v3/secrets"]);
        assert!(!table.is_sensitive(VS));
        assert!(!table.is_sensitive("no/such/collection"));
        // Without the descriptors' word, the table knows what is named
        // like a secret, and nothing more.
        let builtin = CollectionTable::builtin();
        let named: Vec<&str> = builtin
            .by_name
            .keys()
            .filter(|collection| builtin.is_sensitive(collection))
            .map(|collection| &**collection)
            .collect();
        assert_eq!(named, ["envoy/extensions/transport_sockets/tls/v3/secrets"]);
    }

    #[test]
    fn a_collection_of_a_type_named_like_a_secret_is_sensitive_whatever_its_descriptors() {
        let map: BTreeMap<String, TypeMapRow> = [
            ("custom/v2/secrets", "type.googleapis.com/envoy.api.v2.auth.Secret"),
            ("k8s/core/v1/secrets", "type.googleapis.com/k8s.io.api.core.v1.Secret"),
            ("custom/spaced", "type.googleapis.com/x.SECRET "),
            ("custom/plain", "type.googleapis.com/x.SecretRef"),
        ]
        .into_iter()
        .map(|(c, t)| (c.to_owned(), TypeMapRow::TypeUrl(t.to_owned())))
        .collect();
        let table = CollectionTable::builtin().with_type_map(map).unwrap();
        for collection in ["custom/v2/secrets", "k8s/core/v1/secrets", "custom/spaced"] {
            assert!(table.is_sensitive(collection), "{collection}");
        }
        assert!(!table.is_sensitive("custom/plain"));
        assert!(!table.is_sensitive(VS));
    }

    #[test]
    fn a_type_map_row_can_mark_a_collection_sensitive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("map.yaml");
        std::fs::write(
            &path,
            "example.com/widgets: type.googleapis.com/example.Widget\n\
             example.com/vault: {type_url: type.googleapis.com/example.Vault, sensitive: true}\n\
             example.com/plain: {type_url: type.googleapis.com/example.Plain}\n\
             envoy/extensions/transport_sockets/tls/v3/secrets: {type_url: type.googleapis.com/example.Opaque, sensitive: true}\n",
        )
        .unwrap();
        let table = with_descriptors(CollectionTable::builtin().with_type_map_file(&path).unwrap());
        assert!(table.is_sensitive("example.com/vault"));
        assert!(!table.is_sensitive("example.com/widgets"));
        assert!(!table.is_sensitive("example.com/plain"));
        assert!(table.is_sensitive("envoy/extensions/transport_sockets/tls/v3/secrets"));
        let types = table.sensitive_body_types();
        assert!(
            types.contains(&"type.googleapis.com/example.Vault".to_owned()),
            "{types:?}"
        );
        assert!(
            types.contains(&"type.googleapis.com/example.Opaque".to_owned()),
            "{types:?}"
        );
        assert!(
            !types.contains(&"type.googleapis.com/example.Plain".to_owned()),
            "{types:?}"
        );
        assert_eq!(
            &*table.resolve("type.googleapis.com/example.Vault").unwrap().collection,
            "example.com/vault"
        );
        // A type the descriptors call sensitive stays so under a row written
        // without the flag (the flag adds, never removes).
        let mut map = BTreeMap::new();
        map.insert(
            "example.com/secrets".to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret".to_string()),
        );
        let table = with_descriptors(CollectionTable::builtin().with_type_map(map).unwrap());
        assert!(table.is_sensitive("example.com/secrets"));
        // A row re-read without the flag is no longer marked.
        let mut map = BTreeMap::new();
        map.insert(
            "example.com/vault".to_string(),
            TypeMapRow::TypeUrl("type.googleapis.com/example.Vault".to_string()),
        );
        let table = CollectionTable::builtin()
            .with_type_map_file(&path)
            .unwrap()
            .with_type_map(map)
            .unwrap();
        assert!(!table.is_sensitive("example.com/vault"));

        for bad in [
            "a/b: {type_url: type.googleapis.com/x.Y, sensitive: maybe}\n",
            "a/b: {type_url: type.googleapis.com/x.Y, secret: true}\n",
            "a/b: {sensitive: true}\n",
        ] {
            std::fs::write(&path, bad).unwrap();
            let err = CollectionTable::builtin()
                .with_type_map_file(&path)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("map.yaml") && err.contains("sensitive: true"),
                "{bad}: {err}"
            );
        }
        std::fs::write(&path, "a/b: {type_url: x.Y, sensitive: true}\n").unwrap();
        let err = CollectionTable::builtin()
            .with_type_map_file(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must start with"), "{err}");
    }

    #[test]
    fn type_map_file_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("type-map-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("map.yaml");
        std::fs::write(&path, "- just\n- a list\n").unwrap();
        let err = CollectionTable::builtin()
            .with_type_map_file(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("map.yaml") && err.contains("YAML mapping"), "{err}");
        let err = CollectionTable::builtin()
            .with_type_map_file(&dir.join("missing.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.yaml"), "{err}");
        std::fs::write(&path, "example.com/w: type.googleapis.com/example.W\n").unwrap();
        let table = CollectionTable::builtin().with_type_map_file(&path).unwrap();
        assert!(table.get("example.com/w").is_some());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn xds_types_resolve_every_gvk_alias_to_one_collection() {
        let table = CollectionTable::builtin();
        let wrapped = |collection: &str| XdsType::Collection {
            collection: collection.into(),
            wrapped: true,
        };
        for gvk in [
            "networking.istio.io/v1alpha3/VirtualService",
            "networking.istio.io/v1beta1/VirtualService",
            "networking.istio.io/v1/VirtualService",
        ] {
            assert_eq!(table.resolve_xds(gvk), wrapped(VS), "{gvk}");
        }
        assert_eq!(
            table.resolve_xds("security.istio.io/v1/AuthorizationPolicy"),
            wrapped("istio/security/v1beta1/authorizationpolicies")
        );
        assert_eq!(
            table.resolve_xds("type.googleapis.com/envoy.config.cluster.v3.Cluster"),
            XdsType::Collection {
                collection: "envoy/config/cluster/v3/clusters".into(),
                wrapped: false,
            }
        );
        for unserved in [
            MESH_CONFIG_GVK,
            "extensions.istio.io/v1alpha1/TrafficExtension",
            "istio.io/debug/syncz",
            "",
        ] {
            assert_eq!(table.resolve_xds(unserved), XdsType::Unserved, "{unserved}");
        }
        // Every GVK row names a collection of the table.
        for line in GVK_TSV.lines().skip(1) {
            let gvk = line.split('\t').next().unwrap();
            assert!(matches!(table.resolve_xds(gvk), XdsType::Collection { .. }), "{gvk}");
        }
    }

    #[test]
    fn kubernetes_kinds_select_collections_for_the_files_source() {
        let table = CollectionTable::builtin();
        for api_version in [
            "networking.istio.io/v1alpha3",
            "networking.istio.io/v1beta1",
            "networking.istio.io/v1",
        ] {
            let kind = table.kind(api_version, "VirtualService").unwrap();
            assert_eq!((&*kind.collection, kind.cluster_scoped), (VS, false), "{api_version}");
        }
        let mesh = table.kind("authentication.istio.io/v1alpha1", "MeshPolicy").unwrap();
        assert_eq!(
            (&*mesh.collection, mesh.cluster_scoped),
            ("istio/authentication/v1alpha1/meshpolicies", true)
        );
        assert!(
            table
                .kind("rbac.istio.io/v1alpha1", "ClusterRbacConfig")
                .unwrap()
                .cluster_scoped
        );
        assert!(
            table.kind("networking.istio.io/v1alpha3", "virtualservice").is_none(),
            "kinds are case-sensitive"
        );
        // The legacy kinds are the files source's only: istiod never asks.
        assert_eq!(
            table.resolve_xds("authentication.istio.io/v1alpha1/Policy"),
            XdsType::Unserved
        );
        assert!(table.kinds_of("rbac.istio.io/v1alpha1").contains(&"ServiceRole"));
        assert!(table.kinds_of("rbac.istio.io").is_empty());
        assert!(table.api_groups().contains(&"networking.istio.io"));
        // Every kind row names a collection of the table (`builtin` panics
        // otherwise), and every Galley collection but the synthetic service
        // entries and the mesh config has a kind.
        let with_kind: std::collections::HashSet<&str> = table.by_kind.values().map(|k| &*k.collection).collect();
        let without: Vec<&str> = BUILTIN_TSV
            .lines()
            .skip(1)
            .filter_map(|l| l.split('\t').next())
            .filter(|c| !with_kind.contains(c))
            .collect();
        assert_eq!(
            without,
            [
                "istio/mesh/v1alpha1/MeshConfig",
                "istio/networking/v1alpha3/synthetic/serviceentries"
            ]
        );
    }
}
