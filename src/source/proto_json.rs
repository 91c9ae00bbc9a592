//! Resource bodies written as their proto-JSON (as YAML), read against the
//! protos' descriptors and encoded to the bytes the clients read: Envoy's
//! resources under `body: {type_url, json}`, and the `spec` of Istio's kinds
//! written as Kubernetes resources (both in the files source). Protojson
//! rules (`camelCase` or original names, enums by name, `Any` with `@type`),
//! durations also as Go and Istio's docs write them (`5m`, `1h30m`,
//! `300ms`); an unknown field, a wrong kind of value or a type this gateway
//! has no descriptor for is an error naming the field's path.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use prost_reflect::{DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor};

use crate::proto::wire::{wire_fields, WireField};
use serde_json::Value;

/// The descriptors `build.rs` compiled: Envoy's whole v3 API (every
/// resource and every extension a `typed_config` may hold) and CNCF xds,
/// with their imports (see proto/README.md).
const ENVOY_DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/envoy_resources.bin"));

/// Istio's kinds (`proto/istio-api/`): networking, security, telemetry,
/// extensions, and Istio 1.0-1.4's authentication and rbac `v1alpha1`.
pub const ISTIO_DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/istio_resources.bin"));

/// A pool of descriptors with what its fields mark sensitive.
#[derive(Debug)]
struct Descriptors {
    pool: DescriptorPool,
    sensitivity: Sensitivity,
}

impl Descriptors {
    fn new(pool: DescriptorPool) -> Self {
        Self {
            sensitivity: Sensitivity::of(&pool),
            pool,
        }
    }
}

/// Istio's kinds alone, decoded on first use: a directory of Istio's kinds
/// (the embedded examples among them), and the version skew's walk, never
/// pay for Envoy's API.
fn istio_descriptors() -> &'static Arc<Descriptors> {
    static ISTIO: OnceLock<Arc<Descriptors>> = OnceLock::new();
    ISTIO.get_or_init(|| {
        let pool = DescriptorPool::decode(ISTIO_DESCRIPTORS).expect("build.rs wrote a valid descriptor set");
        Arc::new(Descriptors::new(pool))
    })
}

/// Istio's kinds' descriptors (see [`istio_descriptors`]).
pub fn istio_pool() -> &'static DescriptorPool {
    &istio_descriptors().pool
}

#[path = "descriptor_files.rs"]
mod descriptor_files;
pub use descriptor_files::LazyPool;

/// Istio's kinds, a package decoded the first time one of its types is
/// looked up: what the version skew's walk names fields by (a gateway
/// relaying VirtualServices decodes `istio.networking.v1alpha3`, not the
/// whole set, 1.3 MB decoded).
pub static ISTIO_LAZY: LazyPool = LazyPool::new(ISTIO_DESCRIPTORS);

/// Envoy's API, CNCF xds and Istio's kinds, as the files decoded so far.
struct Loaded {
    index: descriptor_files::FileIndex,
    files: HashSet<&'static str>,
    current: Arc<Descriptors>,
}

/// The built-in sets' files, indexed on first use; a file is decoded the
/// first time a message of its package is read (a `json` body, a view of a
/// body, an `Any` in one), with what it imports. A gateway reads the types
/// of a few dozen files of Envoy's 529: see BENCHMARKS.md.
fn loaded() -> std::sync::MutexGuard<'static, Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let index = descriptor_files::FileIndex::of(&[ENVOY_DESCRIPTORS, ISTIO_DESCRIPTORS])
                .expect("build.rs wrote a valid descriptor set");
            Mutex::new(Loaded {
                index,
                files: HashSet::new(),
                current: Arc::new(Descriptors::new(DescriptorPool::new())),
            })
        })
        .lock()
        // Nothing is left half done by a panic: `current` and the files it
        // holds are replaced together, once the files decoded.
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Loaded {
    /// The descriptors with `files` (and what they import) decoded.
    fn with(&mut self, files: &[&'static str]) -> Arc<Descriptors> {
        // A file is decoded with its imports: one decoded has them.
        if files.iter().all(|file| self.files.contains(file)) {
            return self.current.clone();
        }
        let mut decoded = self.files.clone();
        let set = self.index.set_of(files, &mut decoded);
        if !set.is_empty() {
            let mut pool = self.current.pool.clone();
            pool.decode_file_descriptor_set(&set[..])
                .expect("build.rs wrote a valid descriptor set");
            self.current = Arc::new(Descriptors::new(pool));
            self.files = decoded;
        }
        self.current.clone()
    }
}

/// The built-in descriptors with the messages `names` (full names) and
/// what they import decoded, and any decoded before.
fn envoy_descriptors(names: &[&str]) -> Arc<Descriptors> {
    let mut loaded = loaded();
    let files: Vec<&'static str> = names
        .iter()
        .flat_map(|name| loaded.index.files_of(name).to_vec())
        .collect();
    loaded.with(&files)
}

/// Every file of the built-in sets decoded (an operator's `--descriptors`
/// may import any).
fn all_descriptors() -> Arc<Descriptors> {
    let mut loaded = loaded();
    let files: Vec<&'static str> = loaded.index.names().collect();
    loaded.with(&files)
}

#[cfg(test)]
fn pool() -> DescriptorPool {
    all_descriptors().pool.clone()
}

/// The built-in descriptors the messages `names` are read with (the body's
/// type first, then the types of `Any`s in it): Istio's alone for Istio's
/// kinds (which embed no `Any`), else Envoy's with their files decoded.
fn builtin(names: &[&str]) -> Arc<Descriptors> {
    match names.first() {
        Some(name) if name.starts_with("istio.") => istio_descriptors().clone(),
        _ => envoy_descriptors(names),
    }
}

/// The built-in descriptors `descriptor` is one of, decoded as far as now.
fn builtin_of(descriptor: &MessageDescriptor) -> Arc<Descriptors> {
    if descriptor.parent_pool() == istio_pool() {
        istio_descriptors().clone()
    } else {
        envoy_descriptors(&[])
    }
}

/// The full names of the types `@type` names in `json`, at any depth.
fn any_types(json: &Value, names: &mut Vec<String>) {
    match json {
        Value::Object(fields) => {
            if let Some(Value::String(url)) = fields.get("@type") {
                names.push(url.rsplit('/').next().unwrap_or(url).to_owned());
            }
            fields.values().for_each(|value| any_types(value, names));
        }
        Value::Array(items) => items.iter().for_each(|value| any_types(value, names)),
        _ => {}
    }
}

/// The type prost-reflect could not find writing an `Any` (its error says
/// "message 'x.y.Z' not found"), if that is the error.
fn missing_type(error: &str) -> Option<&str> {
    let (_, rest) = error.split_once("message '")?;
    Some(rest.split_once("' not found")?.0)
}

/// Which fields of a pool are marked sensitive, and which messages hold one at any depth.
#[derive(Debug, Default)]
pub struct Sensitivity {
    /// Full names of the fields marked sensitive.
    fields: DescribedNames,
    /// Full names of the messages holding a sensitive field at any depth,
    /// following message fields, map values and oneofs. An `Any` cannot be
    /// followed statically (its type is known only from a value), so a
    /// message that reaches a secret only through an `Any` (a Listener's
    /// `transport_socket.typed_config`) is not in this set; redaction of a
    /// decoded body follows the `Any`'s value, which this set cannot.
    messages: DescribedNames,
}

/// Names of the built-in descriptors, looked up for every field and message
/// a body's walk meets (each endpoint of an Envoy `ClusterLoadAssignment`
/// taken in: with std's SipHash, the lookups were 1.1 % of `mcp-load
/// --scenario eds`'s gateway samples, on the path from a source's message to
/// its version's publication). Hashed with foldhash (randomly seeded): the
/// keys are the descriptors' own, fixed when the set is made, so no source
/// chooses what collides, whatever it looks up.
type DescribedNames = HashSet<String, foldhash::fast::RandomState>;

impl Sensitivity {
    /// The fields `pool` marks sensitive (see [`secret_types_of::SENSITIVE_OPTIONS`]):
    /// private keys, passwords, PKCS#12, session ticket keys, generic
    /// secrets, basic auth users, API keys, cloud credentials. Envoy's
    /// `/config_dump` redacts them.
    fn of(pool: &DescriptorPool) -> Self {
        let Some(marked) = secret_types_of::sensitive_marks(pool) else {
            return Self::default();
        };
        let fields: DescribedNames = pool
            .all_messages()
            .flat_map(|message| message.fields().collect::<Vec<_>>())
            .filter(marked)
            .map(|field| field.full_name().to_owned())
            .collect();
        // A message holds a secret if a field of it is marked, or a field's
        // message (a map's entry message, for a map) holds one: grown to a
        // fixed point, which also ends on recursive messages.
        let mut messages = DescribedNames::default();
        loop {
            let before = messages.len();
            for message in pool.all_messages() {
                if messages.contains(message.full_name()) {
                    continue;
                }
                let holds = message.fields().any(|field| {
                    fields.contains(field.full_name())
                        || matches!(field.kind(), Kind::Message(inner) if messages.contains(inner.full_name()))
                });
                if holds {
                    messages.insert(message.full_name().to_owned());
                }
            }
            if messages.len() == before {
                break;
            }
        }
        Self { fields, messages }
    }

    /// Whether `field` is marked sensitive.
    pub fn is_sensitive_field(&self, field: &FieldDescriptor) -> bool {
        self.fields.contains(field.full_name())
    }

    /// Whether the message `full_name` holds a sensitive field at any depth
    /// (not through an `Any`).
    pub fn holds_secrets(&self, full_name: &str) -> bool {
        self.messages.contains(full_name)
    }
}

/// The type URL of every message of the built-in descriptors whose values
/// *are* secrets (see `secret_types.rs`), found when the gateway was built:
/// the access policy's sensitive collections (nobody reads them without
/// `--access-policy`).
pub fn secret_type_urls() -> Vec<String> {
    const SECRET_TYPES: &[&str] = include!(concat!(env!("OUT_DIR"), "/secret_types.rs"));
    SECRET_TYPES.iter().map(|url| (*url).to_owned()).collect()
}

/// CNCF xds's TypedStruct (and udpa's before it): a type URL and a Struct
/// Envoy reads as that type.
fn is_typed_struct(full_name: &str) -> bool {
    matches!(full_name, "xds.type.v3.TypedStruct" | "udpa.type.v1.TypedStruct")
}

/// Whether `full_name` wraps one resource in an `Any` that its readers
/// unwrap by themselves ([`crate::proto::wire::WrappedResourceView`]):
/// Envoy and grpc's xDS clients take a `discovery.v3.Resource` as what it
/// wraps.
fn is_resource_wrapper(full_name: &str) -> bool {
    matches!(
        full_name,
        "envoy.service.discovery.v3.Resource" | "envoy.api.v2.Resource" | "istio.mcp.v1alpha1.Resource"
    )
}

/// Whether a message of `descriptor`, at any depth, can hold what its
/// descriptor does not describe (an `Any`, a `Struct` or its values, a
/// TypedStruct): a secret may lie there that no field marks.
fn holds_opaque_values(descriptor: &MessageDescriptor) -> bool {
    reaches_one_of(descriptor, |name| {
        is_typed_struct(name)
            || matches!(
                name,
                "google.protobuf.Any"
                    | "google.protobuf.Struct"
                    | "google.protobuf.Value"
                    | "google.protobuf.ListValue"
            )
    })
}

/// Envoy's types whose values are key material themselves (beside the
/// messages named like a secret).
const SECRETS_THEMSELVES: &[&str] = &[
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.TlsCertificate",
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.TlsSessionTicketKeys",
];

/// Whether a message of `name` (a full name or a type URL) is a secret by
/// its name ([`crate::collections::named_like_a_secret`], or with
/// `key_material` [`crate::collections::named_like_key_material`]), as
/// decided by the built-in descriptors when they know the type: one named
/// so whose values are not secrets ([`is_secret_type`]: Envoy's access-log
/// formatter `GenericSecret` maps names to SDS configs) is no secret; one
/// they do not know (Envoy v2's `auth.Secret` and `auth.TlsCertificate`,
/// Kubernetes' `Secret`) is.
fn secret_by_name(name: &str, key_material: bool) -> bool {
    let named = if key_material {
        crate::collections::named_like_key_material(name)
    } else {
        crate::collections::named_like_a_secret(name)
    };
    if !named {
        return false;
    }
    let full_name = crate::collections::full_name(name);
    match builtin(&[full_name]).pool.get_message_by_name(full_name) {
        Some(known) => is_secret_type(&format!("{}{}", crate::collections::TYPE_URL_PREFIX, known.full_name())),
        None => true,
    }
}

/// The types whose values are secrets wherever they are sent, for one
/// collection table: the types the descriptors mark ([`is_secret_type`]),
/// any message named like a secret
/// ([`crate::collections::named_like_a_secret`]: Envoy v2's, Kubernetes'),
/// and the body type of a collection `--type-map` marks `sensitive: true`
/// that no other collection declares
/// ([`crate::collections::CollectionTable::secret_only_body_types`]). A
/// body that is or wraps one is refused outside the collections of
/// secrets, by every source alike.
#[derive(Clone, Debug, Default)]
pub struct SecretTypes {
    extra: std::collections::HashSet<String>,
    /// Per body type, whether its descriptor holds a secret as a typed
    /// field at some depth ([`Self::holds_typed_secret`]): read once.
    typed: Arc<Mutex<HashMap<String, bool>>>,
    /// What a body's bytes must hold (ASCII, any case) for an `Any` deep in
    /// it to name a secret's type: each secret type's message name, and
    /// `secret` (the end of every name like a secret's). A body holding
    /// none is read no further. Each kept as its `memmem` finder (which
    /// holds the needle), for a body lowercased ([`Self::needle_in`]).
    needles: Arc<[memchr::memmem::Finder<'static>]>,
}

impl SecretTypes {
    pub fn of(table: &crate::collections::CollectionTable) -> Self {
        // In any case, as Envoy's own secret types are matched: a type
        // named `acme.v1.creds` beside a sensitive `acme.v1.Creds` is one.
        let extra: std::collections::HashSet<String> = table
            .secret_only_body_types()
            .into_iter()
            .map(|url| url.to_ascii_lowercase())
            .collect();
        let mut needles: Vec<Vec<u8>> = extra
            .iter()
            .map(String::as_str)
            .chain(SECRETS_THEMSELVES.iter().copied())
            .map(|url| {
                let name = url.rsplit('/').next().unwrap_or(url);
                name.rsplit('.')
                    .next()
                    .unwrap_or(name)
                    .to_ascii_lowercase()
                    .into_bytes()
            })
            // A Bootstrap holds its secrets as a typed field, whose type
            // the bytes do not name.
            .chain([b"secret".to_vec(), b"bootstrap".to_vec()])
            .collect();
        needles.sort();
        needles.dedup();
        let needles = needles
            .iter()
            .map(|needle| memchr::memmem::Finder::new(needle).into_owned())
            .collect();
        Self {
            extra,
            needles,
            typed: Default::default(),
        }
    }

    /// Whether a message of `name` (a full name) holds a secret's type as a
    /// typed field at some depth (a `Bootstrap`'s `static_resources.secrets`),
    /// not in an `Any`: its bytes then need not name the secret's type. Read
    /// from the built-in descriptors once per type; a type they do not hold
    /// is not known to.
    fn holds_typed_secret(&self, name: &str) -> bool {
        let mut known = self.typed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(&holds) = known.get(name) {
            return holds;
        }
        let holds = builtin(&[name]).pool.get_message_by_name(name).is_some_and(|top| {
            let mut seen = HashSet::new();
            let mut pending = vec![top];
            while let Some(message) = pending.pop() {
                let full_name = message.full_name();
                if secret_by_name(full_name, false)
                    || (!self.extra.is_empty()
                        && self.extra_has(&format!("{}{full_name}", crate::collections::TYPE_URL_PREFIX)))
                {
                    return true;
                }
                if seen.insert(full_name.to_owned()) {
                    pending.extend(message.fields().filter_map(|field| match field.kind() {
                        Kind::Message(inner) => Some(inner),
                        _ => None,
                    }));
                }
            }
            false
        });
        known.insert(name.to_owned(), holds);
        holds
    }

    /// A secret's type named in `bytes` as a type URL would name it (a
    /// full name of three parts or more, the last named like a secret, or
    /// one of the secrets themselves), for bytes the descriptors cannot
    /// walk: a body, or an `Any` in it, of a type the gateway has no
    /// descriptor for, whose own `Any` of a `Secret` names it so.
    fn named_within(&self, bytes: &[u8]) -> Option<String> {
        let is_name = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'.';
        let mut at = 0;
        while at < bytes.len() {
            if !is_name(bytes[at]) {
                at += 1;
                continue;
            }
            let end = bytes[at..]
                .iter()
                .position(|&b| !is_name(b))
                .map_or(bytes.len(), |n| at + n);
            let run = std::str::from_utf8(&bytes[at..end])
                .unwrap_or_default()
                .trim_matches('.');
            let url = format!("{}{run}", crate::collections::TYPE_URL_PREFIX);
            if (run.split('.').count() >= 3 && secret_by_name(run, true))
                || SECRETS_THEMSELVES.contains(&url.as_str())
                || self.extra_has(&url)
            {
                return Some(run.to_owned());
            }
            at = end;
        }
        None
    }

    /// The first word of a secret type's name `bytes` hold (any case), for
    /// saying why a body was read further.
    ///
    /// A body of at most [`LOWERED_AT_MOST`] bytes is lowercased once (into
    /// its thread's buffer) and each needle found in it by `memmem`, whose
    /// search skips ahead by a rare pair of the needle's bytes; a larger
    /// one is read for each needle's first letter in either case. Each
    /// changed resource of an update is read so: a `ClusterLoadAssignment`
    /// of 12 endpoints took about 3,600 instructions the second way
    /// (BENCHMARKS, session 41).
    fn needle_in(&self, bytes: &[u8]) -> Option<&str> {
        let found = match lowered_search(bytes, &self.needles) {
            Some(found) => found,
            None => self
                .needles
                .iter()
                .position(|needle| holds_ignoring_case(bytes, needle.needle())),
        };
        found.and_then(|at| std::str::from_utf8(self.needles[at].needle()).ok())
    }

    /// Whether a value of `type_url` (canonical) is a secret itself, not a
    /// configuration that may carry one (a `DownstreamTlsContext` in a
    /// listener's transport socket is the usual way to name a secret, and
    /// is not refused): a message named like a secret, Envoy's TLS key
    /// material, or a type only collections of secrets declare.
    fn is_a_secret_itself(&self, type_url: &str) -> bool {
        secret_by_name(type_url, true) || SECRETS_THEMSELVES.contains(&type_url) || self.extra_has(type_url)
    }

    /// Whether `type_url` is a type only collections of secrets declare
    /// (a `--type-map` row's, in any case).
    fn extra_has(&self, type_url: &str) -> bool {
        !self.extra.is_empty() && self.extra.contains(&type_url.to_ascii_lowercase())
    }

    /// Whether `type_url` (as Envoy reads it: canonical) is a secret's type:
    /// one whose values are secrets in the built-in descriptors, in another
    /// version of Envoy's API ([`another_version_of_a_secret`]), named like
    /// a secret, or declared only by sensitive collections.
    pub fn contains(&self, type_url: &str) -> bool {
        is_secret_type(type_url)
            || secret_by_name(type_url, true)
            || another_version_of_a_secret(type_url)
            || self.extra_has(type_url)
    }

    /// Whether a body of `type_url` needs its value read to tell: it is a
    /// secret's type or a wrapper that may carry one. Every other body is
    /// no secret by its type URL alone (the cheap path of a large update).
    pub fn may_hold(&self, type_url: &str) -> bool {
        let name = crate::collections::full_name(type_url);
        if name == "google.protobuf.Any" || is_typed_struct(name) || is_resource_wrapper(name) {
            return true;
        }
        // Read in place when written as Envoy reads it (every body of a
        // large update): no copy per resource.
        match type_url.strip_prefix(crate::collections::TYPE_URL_PREFIX) {
            Some(rest) if rest == name => self.contains(type_url),
            _ => self.contains(&canonical_type_url(type_url)),
        }
    }

    /// Why a body of `type_url` and `value` may not be in `collection`
    /// (`sensitive`: a collection of secrets, where it may): it is or
    /// wraps a secret's type. The reason quotes no value.
    pub fn refusal(&self, collection: &str, sensitive: bool, type_url: &str, value: &[u8]) -> Option<String> {
        if sensitive {
            return None;
        }
        let at_top = self
            .may_hold(type_url)
            .then(|| secret_type_within(type_url, value, &|url| self.contains(url)))
            .flatten();
        let secret = match at_top {
            Some(secret) if secret == TOO_DEEP => return Some(too_deep(type_url, "", collection)),
            Some(secret) => secret,
            None => {
                let (secret, field) = self.nested(type_url, value)?;
                if secret == TOO_DEEP {
                    return Some(too_deep(type_url, &field, collection));
                }
                if secret == UNDECODABLE {
                    let word = self.needle_in(value).unwrap_or("secret");
                    return Some(undecodable(type_url, &field, collection, word));
                }
                if field == UNWALKED {
                    return Some(format!(
                        "a body of {type_url} names the type {secret} (a secret's, by its name) in an Any of a type \
                         the gateway has no descriptor for, and {collection} is not a collection of secrets (clients \
                         read it unless --access-policy says otherwise): put the secret in a collection of secrets \
                         and name it (SDS)"
                    ));
                }
                return Some(format!(
                    "a body of {type_url} holds a {secret} at {field}, and {collection} is not a \
                     collection of secrets (clients read it unless --access-policy says otherwise): put the \
                     secret in a collection of secrets and name it (SDS), or mark this one sensitive: true with \
                     --type-map"
                ));
            }
        };
        // The body's own type URL spelling the secret's differently
        // (another prefix, spaces) is read as it, not wrapped.
        let own = type_url.rsplit('/').next().unwrap_or_default().trim();
        let wrapped = if secret == type_url {
            String::new()
        } else if secret.rsplit('/').next() == Some(own) {
            format!(" (its type URL {type_url:?} read as that)")
        } else {
            format!(" (within a {type_url})")
        };
        // A type no descriptor here reads is decided by its name.
        let by_name = if message_type(&secret).is_some() {
            ""
        } else {
            " (no descriptor here reads that type: its name is that of a type whose values are or hold secrets)"
        };
        Some(format!(
            "a body of {secret}{wrapped} holds secrets, and {collection} is not a collection of secrets (clients \
             read it unless --access-policy says otherwise): put it in a collection of secrets, or mark this one \
             sensitive: true with --type-map{by_name}"
        ))
    }

    /// Whether `bytes` (a body, or its `Any`) hold the name of a secret's
    /// type, in any case: only then may an `Any` deep in it be a secret.
    pub fn may_nest(&self, bytes: &[u8]) -> bool {
        self.needle_in(bytes).is_some()
    }

    /// A secret's type an `Any` (or a TypedStruct) anywhere inside a body
    /// of `type_url` is or wraps, and the field path it is at: a `Cluster`
    /// whose `transport_socket.typed_config` is a `Secret` serves that
    /// secret to every reader of the clusters. Read only when the bytes
    /// hold a secret type's name (any case), by the built-in descriptors;
    /// a type they do not know is not read.
    fn nested(&self, type_url: &str, value: &[u8]) -> Option<(String, String)> {
        let name = type_name(type_url)?;
        // Its bytes name no secret's type and its type holds none as a
        // field: the cheap path of a large update.
        if !self.may_nest(value) && !self.holds_typed_secret(name) {
            return None;
        }
        // The body's type, then each `Any`'s it turns out to hold, loaded
        // as found (the built-in descriptors are read a package at a time).
        let mut names = vec![name.to_owned()];
        for _ in 0..MAX_ANY_DEPTH {
            let wanted: Vec<&str> = names.iter().map(String::as_str).collect();
            let descriptors = builtin(&wanted);
            let Some(descriptor) = descriptors.pool.get_message_by_name(name) else {
                // No descriptor to walk it by: the type URL an `Any` of a
                // secret in it would carry.
                return self.named_within(value).map(|secret| (secret, UNWALKED.to_owned()));
            };
            let Ok(message) = DynamicMessage::decode(descriptor, value) else {
                // Its bytes name a secret's type (or its type holds one)
                // and it does not decode: a client's parser that skips what
                // it cannot read (upb, Envoy's) may find a secret in what
                // this one cannot walk.
                return Some((UNDECODABLE.to_owned(), String::new()));
            };
            let mut path = Vec::new();
            match self.nested_in(&message, &descriptors.pool, &mut path, 0) {
                Nested::Found(secret, field) => return Some((secret, field)),
                Nested::Unknown(missing) if !names.contains(&missing) => names.push(missing),
                Nested::Unknown(_) => {
                    return self.named_within(value).map(|secret| (secret, UNWALKED.to_owned()));
                }
                Nested::None => return None,
            }
        }
        None
    }

    fn nested_in(
        &self,
        message: &DynamicMessage,
        pool: &prost_reflect::DescriptorPool,
        path: &mut Vec<String>,
        depth: usize,
    ) -> Nested {
        if depth > MAX_ANY_DEPTH {
            return Nested::Found(TOO_DEEP.to_owned(), path.join("."));
        }
        // A secret held as a field of its own type (a Bootstrap's
        // `static_resources.secrets`), not in an `Any`. (A TLS context's
        // `tls_certificates` is the usual inline key, read as before.)
        let descriptor = prost_reflect::ReflectMessage::descriptor(message);
        let full_name = descriptor.full_name();
        // The type URL is made only where it is compared (a type-map's own
        // types), not for every message walked.
        let as_url = || format!("{}{full_name}", crate::collections::TYPE_URL_PREFIX);
        if secret_by_name(full_name, false) || (!self.extra.is_empty() && self.extra_has(&as_url())) {
            return Nested::Found(as_url(), path.join("."));
        }
        // A Struct is JSON another reader turns into a type (a TypedStruct's
        // value, an EnvoyFilter's patch): every `@type` in it is an `Any`
        // to Envoy and istiod.
        if full_name == "google.protobuf.Struct" {
            return match serde_json::to_value(message) {
                Ok(json) => match self.secret_in_json(&json, path, 0) {
                    Some(secret) => Nested::Found(secret, path.join(".")),
                    None => Nested::None,
                },
                Err(_) => Nested::Found(UNDECODABLE.to_owned(), path.join(".")),
            };
        }
        if full_name == "google.protobuf.Any" {
            let type_url = message
                .get_field_by_name("type_url")
                .and_then(|t| t.as_str().map(str::to_owned))
                .unwrap_or_default();
            let bytes = message
                .get_field_by_name("value")
                .and_then(|v| v.as_bytes().cloned())
                .unwrap_or_default();
            if let Some(secret) = secret_type_within(&type_url, &bytes, &|url| self.is_a_secret_itself(url)) {
                return Nested::Found(secret, path.join("."));
            }
            let name = type_url.rsplit('/').next().unwrap_or(&type_url).trim().to_owned();
            return match pool.get_message_by_name(&name) {
                Some(inner) => match DynamicMessage::decode(inner, bytes.clone()) {
                    Ok(inner) => self.nested_in(&inner, pool, path, depth + 1),
                    // As for the body itself ([`Self::nested`]).
                    Err(_) if self.may_nest(&bytes) => Nested::Found(UNDECODABLE.to_owned(), path.join(".")),
                    Err(_) => Nested::None,
                },
                None if name.is_empty() => Nested::None,
                None => Nested::Unknown(name),
            };
        }
        let mut unknown = Nested::None;
        for (field, value) in message.fields() {
            path.push(field.name().to_owned());
            let mut found = Nested::None;
            let mut visit = |value: &prost_reflect::Value| {
                if let (prost_reflect::Value::Message(inner), Nested::None | Nested::Unknown(_)) = (value, &found) {
                    match self.nested_in(inner, pool, path, depth) {
                        Nested::None => {}
                        other => found = other,
                    }
                }
            };
            match value {
                prost_reflect::Value::List(items) => items.iter().for_each(&mut visit),
                prost_reflect::Value::Map(entries) => entries.values().for_each(&mut visit),
                other => visit(other),
            }
            path.pop();
            match found {
                Nested::Found(..) => return found,
                Nested::Unknown(_) => unknown = found,
                Nested::None => {}
            }
        }
        unknown
    }

    /// A secret's type that an object of `json` names as its type (`@type`,
    /// or a TypedStruct's `type_url`), at any depth; `path` ends at it.
    fn secret_in_json(&self, json: &Value, path: &mut Vec<String>, depth: usize) -> Option<String> {
        if depth > MAX_JSON_DEPTH {
            return Some(TOO_DEEP.to_owned());
        }
        match json {
            Value::Object(fields) => {
                for key in ["@type", "type_url", "typeUrl"] {
                    if let Some(Value::String(named)) = fields.get(key) {
                        let canonical = canonical_type_url(named);
                        if self.is_a_secret_itself(&canonical) {
                            return Some(canonical);
                        }
                    }
                }
                for (key, value) in fields {
                    path.push(key.clone());
                    let found = self.secret_in_json(value, path, depth + 1);
                    if found.is_some() {
                        return found;
                    }
                    path.pop();
                }
                None
            }
            Value::Array(items) => items.iter().find_map(|item| self.secret_in_json(item, path, depth + 1)),
            _ => None,
        }
    }
}

/// How deep [`SecretTypes::secret_in_json`] reads (a Struct nested past
/// it is no config Envoy reads; the YAML reader stops at 128).
const MAX_JSON_DEPTH: usize = 256;

/// What [`SecretTypes::nested_in`] found: a secret's type at a field path,
/// an `Any` of a type the descriptors read so far do not hold, or nothing.
enum Nested {
    Found(String, String),
    Unknown(String),
    None,
}

/// The bodies [`SecretTypes::needle_in`] lowercases to search (its thread
/// keeps a buffer of at most this size).
const LOWERED_AT_MOST: usize = 16 * 1024;

thread_local! {
    /// A body lowercased, for [`lowered_search`].
    static LOWERED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Which of `finders` (of lowercase ASCII needles) finds its needle first
/// in `bytes` lowercased (ASCII): the one [`holds_ignoring_case`] finds,
/// as a byte's ASCII case is all either ignores. `None` where `bytes` is
/// larger than [`LOWERED_AT_MOST`] or the thread's buffer cannot be had
/// (the thread is ending): the caller reads it as before.
fn lowered_search(bytes: &[u8], finders: &[memchr::memmem::Finder<'static>]) -> Option<Option<usize>> {
    if bytes.len() > LOWERED_AT_MOST {
        return None;
    }
    LOWERED
        .try_with(|buf| {
            let mut lowered = buf.try_borrow_mut().ok()?;
            lowered.clear();
            lowered.extend(bytes.iter().map(u8::to_ascii_lowercase));
            Some(finders.iter().position(|finder| finder.find(&lowered).is_some()))
        })
        .ok()
        .flatten()
}

/// Whether `bytes` hold `needle` (lowercase ASCII) in any case: its first
/// letter found by `memchr`, then the rest compared (a body of 1 KB is
/// read in tens of nanoseconds when it holds neither form of that letter).
fn holds_ignoring_case(bytes: &[u8], needle: &[u8]) -> bool {
    let Some(&first) = needle.first() else {
        return true;
    };
    memchr::memchr2_iter(first, first.to_ascii_uppercase(), bytes).any(|at| {
        bytes
            .get(at..at + needle.len())
            .is_some_and(|w| w.eq_ignore_ascii_case(needle))
    })
}

/// The refusal of a body of `type_url` whose wrappers, `Any`s or JSON go
/// deeper (at `field`) than the gateway reads into to look for a secret.
fn too_deep(type_url: &str, field: &str, collection: &str) -> String {
    let at = if field.is_empty() {
        String::new()
    } else {
        format!(" at {field}")
    };
    format!(
        "a body of {type_url} nests Anys, TypedStructs or JSON{at} deeper than {MAX_ANY_DEPTH} levels, too deep to \
         tell whether it holds a secret, and {collection} is not a collection of secrets: refused (no config Envoy \
         reads nests so deep)"
    )
}

/// A type URL as Envoy reads it: the name after the last `/`, trimmed,
/// under the default prefix.
fn canonical_type_url(type_url: &str) -> String {
    let name = crate::collections::full_name(type_url);
    format!("{}{name}", crate::collections::TYPE_URL_PREFIX)
}

/// The secret type a body is, or wraps at its top (an `Any` of it, a
/// TypedStruct naming it, any chain of them, to [`MAX_ANY_DEPTH`]): such a
/// body is a secret whatever the type URL it is sent under. A type is read
/// as Envoy reads it, by the name after the last `/`, whatever the prefix.
fn secret_type_within(type_url: &str, value: &[u8], is_secret: &dyn Fn(&str) -> bool) -> Option<String> {
    use prost::Message as _;
    use prost_types::value::Kind as JsonKind;
    /// What is being looked into: bytes of a type, or a Struct Envoy reads
    /// as one (a TypedStruct's value, an `Any` within it).
    enum Wrapped {
        Bytes(Vec<u8>),
        Json(prost_types::Struct),
    }
    let text = |fields: &prost_types::Struct, keys: &[&str]| {
        keys.iter()
            .find_map(|key| match fields.fields.get(*key).and_then(|v| v.kind.as_ref()) {
                Some(JsonKind::StringValue(text)) => Some(text.clone()),
                _ => None,
            })
    };
    let inner_struct =
        |fields: &prost_types::Struct, key: &str| match fields.fields.get(key).and_then(|v| v.kind.as_ref()) {
            Some(JsonKind::StructValue(inner)) => Some(inner.clone()),
            _ => None,
        };
    let mut type_url = type_url.to_owned();
    let mut wrapped = Wrapped::Bytes(value.to_vec());
    for _ in 0..MAX_ANY_DEPTH {
        let canonical = canonical_type_url(&type_url);
        if is_secret(&canonical) {
            return Some(canonical);
        }
        let name = &canonical[crate::collections::TYPE_URL_PREFIX.len()..];
        // A type holding its secrets as a typed field (a Bootstrap's
        // `static_resources.secrets`), given as JSON (a TypedStruct's
        // value): its `secrets`, written, are secrets.
        if let Wrapped::Json(fields) = &wrapped {
            if typed_secret_holder(name) && json_lists_secrets(fields, 0) {
                return Some(canonical);
            }
        }
        (type_url, wrapped) = match (name, wrapped) {
            ("google.protobuf.Any", Wrapped::Bytes(bytes)) => {
                let inner = prost_types::Any::decode(bytes.as_slice()).ok()?;
                (inner.type_url, Wrapped::Bytes(inner.value))
            }
            (wrapper, Wrapped::Bytes(bytes)) if is_resource_wrapper(wrapper) => {
                let inner = crate::proto::wire::WrappedResourceView::decode(bytes.as_slice())
                    .ok()?
                    .resource?;
                (inner.type_url, Wrapped::Bytes(inner.value))
            }
            (typed, Wrapped::Bytes(bytes)) if is_typed_struct(typed) => {
                let inner = crate::proto::wire::TypedStructView::decode(bytes.as_slice()).ok()?;
                (inner.type_url, Wrapped::Json(inner.value.unwrap_or_default()))
            }
            // An `Any` written as JSON: `@type` and its fields (or `value`).
            ("google.protobuf.Any", Wrapped::Json(fields)) => {
                let named = text(&fields, &["@type"])?;
                let rest = any_json_payload(&named, fields);
                (named, Wrapped::Json(rest))
            }
            (typed, Wrapped::Json(fields)) if is_typed_struct(typed) => {
                let named = text(&fields, &["type_url", "typeUrl"])?;
                (named, Wrapped::Json(inner_struct(&fields, "value").unwrap_or_default()))
            }
            // A resource wrapper written as JSON: its `resource` (MCP's
            // `body`) is an `Any` as JSON.
            (wrapper, Wrapped::Json(fields)) if is_resource_wrapper(wrapper) => {
                let inner = inner_struct(&fields, "resource").or_else(|| inner_struct(&fields, "body"))?;
                let named = text(&inner, &["@type"])?;
                let rest = any_json_payload(&named, inner);
                (named, Wrapped::Json(rest))
            }
            _ => return None,
        };
    }
    // Wrapped deeper than any reader unwraps here: not read, so not taken.
    Some(TOO_DEEP.to_owned())
}

/// What a body whose bytes name a secret's type, and that does not decode
/// as its type (or an `Any` in it as its own), is refused as (see
/// [`SecretTypes::refusal`]).
const UNDECODABLE: &str = "(does not decode)";

/// The refusal of a body of `type_url` that names a secret's type in its
/// bytes and does not decode (at `field`, an `Any`'s value, when not the
/// body itself).
fn undecodable(type_url: &str, field: &str, collection: &str, word: &str) -> String {
    let what = if field.is_empty() {
        format!("as {}", crate::collections::full_name(type_url))
    } else {
        format!("at {field} (an Any's value)")
    };
    format!(
        "a body of {type_url} does not decode {what}, and it may hold a secret (its bytes hold {word:?}, a word of \
         a secret type's name, or its type holds a secret as a field) that a client which skips what it cannot \
         read would find; {collection} is not a collection of secrets: refused (check how the body was encoded)"
    )
}

/// Where [`SecretTypes::nested`] found a secret's type URL named in bytes
/// it had no descriptor to walk by.
const UNWALKED: &str = "(no descriptor)";

/// What a body too deep to read through is refused as (see
/// [`SecretTypes::refusal`]): a chain of wrappers or `Any`s, or JSON, past
/// what the gateway reads into.
const TOO_DEEP: &str = "(too deep)";

/// Whether `type_url` is one of [`secret_type_urls`]: a type whose values
/// *are* secrets, every one of them marked within two fields. Only such a
/// body is shown in a sensitive collection with its secret fields
/// `[redacted]`; any other (a `Cluster` in a collection `--type-map` marks
/// sensitive: its marks are deep and few, and the operator said the whole
/// collection is secret) is hidden whole.
pub fn is_secret_type(type_url: &str) -> bool {
    static SECRET_TYPES: std::sync::OnceLock<std::collections::HashSet<String>> = std::sync::OnceLock::new();
    SECRET_TYPES
        .get_or_init(|| secret_type_urls().into_iter().collect())
        .contains(type_url)
}

/// How [`BodyDecoder::decode`]'s error begins for bytes that do not decode
/// as their (known) type, as `check` tells that case apart.
pub const DOES_NOT_DECODE: &str = "does not decode as";

/// What an `Any` written as JSON (`@type` and the rest) holds of the type
/// `named`: its fields beside `@type`, or, for a well-known type with a JSON
/// form of its own (a Struct, a Duration), its `value` (proto3's JSON
/// mapping). A TypedStruct's own `value` field is its, not the `Any`'s.
fn any_json_payload(named: &str, fields: prost_types::Struct) -> prost_types::Struct {
    let well_known = crate::collections::full_name(named).starts_with("google.protobuf.");
    match fields.fields.get("value").and_then(|v| v.kind.as_ref()) {
        Some(prost_types::value::Kind::StructValue(inner)) if well_known => inner.clone(),
        _ => fields,
    }
}

/// A message's name without its package, from its first capitalised part
/// (`GrpcService.GoogleGrpc.SslCredentials` of
/// `envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials`): the same
/// in every version of Envoy's API.
fn message_path(full_name: &str) -> Option<&str> {
    let mut at = 0;
    for part in full_name.split('.') {
        if part.starts_with(|c: char| c.is_ascii_uppercase()) {
            return Some(&full_name[at..]);
        }
        at += part.len() + 1;
    }
    None
}

/// Whether `full_name` is, in any version, a type that holds secrets as a
/// typed field ([`TYPED_SECRET_HOLDERS`]: a Bootstrap and its parts).
fn typed_secret_holder(full_name: &str) -> bool {
    full_name.starts_with("envoy.") && message_path(full_name).is_some_and(|path| TYPED_SECRET_HOLDERS.contains(&path))
}

/// Whether `fields` (a Bootstrap and its parts as JSON) hold a `secrets`
/// list that is not empty, at any depth: the typed field a Bootstrap keeps
/// its secrets in.
fn json_lists_secrets(fields: &prost_types::Struct, depth: usize) -> bool {
    use prost_types::value::Kind;
    if depth > MAX_JSON_DEPTH {
        return true;
    }
    fields.fields.iter().any(|(key, value)| match value.kind.as_ref() {
        Some(Kind::ListValue(list)) => key == "secrets" && !list.values.is_empty(),
        Some(Kind::StructValue(inner)) => json_lists_secrets(inner, depth + 1),
        _ => false,
    })
}

/// Whether `full_name` is the config of a private key provider of Envoy's
/// `contrib` extensions (CryptoMb, QAT, KAE, any later one), which holds a
/// private key inline and which the built-in descriptors do not hold: a
/// body of one is a secret (inside a TLS context's `private_key_provider`,
/// as Envoy takes them, they are read like the context).
fn contrib_key_config(full_name: &str) -> bool {
    full_name.starts_with("envoy.extensions.private_key_providers.") && full_name.ends_with("PrivateKeyMethodConfig")
}

/// The messages (their names from the first capitalised part) of the
/// built-in types that hold a secret as a typed field
/// ([`SecretTypes::holds_typed_secret`]; a test checks the list against the
/// descriptors): another version of one cannot be walked, and may hold one.
const TYPED_SECRET_HOLDERS: &[&str] = &["Bootstrap", "Bootstrap.StaticResources", "BootstrapConfigDump"];

/// Whether `type_url` names, in Envoy's family of packages (`envoy.`,
/// `udpa.`, `xds.`), a type the built-in descriptors do not hold whose
/// message (its name from the first capitalised part:
/// `GrpcService.GoogleGrpc.SslCredentials`) is that of a built-in secret
/// type ([`is_secret_type`]): the same values in another version of the API
/// (v2's `envoy.api.v2.core…`, v2alpha's, v4alpha's), which Envoy 1.8 to
/// 1.17 and the control planes of their day read), or of a built-in type
/// that holds one as a typed field ([`TYPED_SECRET_HOLDERS`]); or a contrib
/// extension holding a key ([`contrib_key_config`]). Read once per type.
fn another_version_of_a_secret(type_url: &str) -> bool {
    static KNOWN: OnceLock<Mutex<HashMap<String, bool>>> = OnceLock::new();
    static PATHS: OnceLock<HashSet<String>> = OnceLock::new();
    let full_name = crate::collections::full_name(type_url);
    if !["envoy.", "udpa.", "xds."]
        .iter()
        .any(|family| full_name.starts_with(family))
    {
        return false;
    }
    let known = KNOWN.get_or_init(Default::default);
    let mut known = known.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&is) = known.get(full_name) {
        return is;
    }
    let is = builtin(&[full_name]).pool.get_message_by_name(full_name).is_none()
        && (contrib_key_config(full_name)
            || message_path(full_name).is_some_and(|path| {
                TYPED_SECRET_HOLDERS.contains(&path)
                    || PATHS
                        .get_or_init(|| {
                            secret_type_urls()
                                .iter()
                                .filter_map(|url| message_path(crate::collections::full_name(url)))
                                .map(str::to_owned)
                                .collect()
                        })
                        .contains(path)
            }));
    known.insert(full_name.to_owned(), is);
    is
}

/// Whether a body of `type_url` in a collection declaring `declared` (its
/// body type; `None`: not a sensitive collection) is hidden whole in every
/// view: in a sensitive collection, any body but one of the collection's
/// own type that is a secret type (shown with its secret fields hidden).
/// The views and `client` decide by it alike.
pub fn hidden_whole(declared: Option<&str>, type_url: &str) -> bool {
    declared.is_some_and(|declared| type_url != declared || !is_secret_type(type_url))
}

/// The body type URL a view shows for a body of a collection whose body
/// type is `declared` when it is a sensitive one: any other type URL there
/// reads `[redacted]`. Its upstream chose that name, and it may carry what
/// the body does; the collection's own type is no one's secret.
pub fn shown_type_url<'a>(declared: Option<&str>, type_url: &'a str) -> &'a str {
    match declared {
        Some(declared) if type_url != declared => REDACTED,
        _ => type_url,
    }
}

/// `message` with the type `type_url` names (whole, and its message name)
/// written `[redacted]`: what a decoding error says of a body whose type URL
/// [`shown_type_url`] hides.
pub fn without_type_name(message: &str, type_url: &str) -> String {
    let name = type_url.rsplit('/').next().unwrap_or_default().trim();
    let message = if type_url.trim().is_empty() {
        message.to_owned()
    } else {
        message.replace(type_url, REDACTED)
    };
    if name.is_empty() {
        message
    } else {
        message.replace(name, REDACTED)
    }
}

/// Which fields mark secrets, shared with build.rs (which lists the
/// collections of secrets with it; the test checks that list here).
#[path = "secret_types.rs"]
#[cfg_attr(not(test), allow(dead_code))]
mod secret_types_of;

/// One step of a path into a body: a field or map key, or a list index.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PathStep {
    Key(String),
    Index(usize),
}

/// Writes `steps` as `filter_chains[0].filters` (empty for the body itself).
pub fn display_path(steps: &[PathStep]) -> String {
    let mut shown = String::new();
    for step in steps {
        match step {
            PathStep::Key(key) if shown.is_empty() => shown.push_str(key),
            PathStep::Key(key) => {
                shown.push('.');
                shown.push_str(key);
            }
            PathStep::Index(index) => shown.push_str(&format!("[{index}]")),
        }
    }
    shown
}

/// Why a body does not read as its type.
#[derive(Debug, PartialEq, Eq)]
pub struct JsonError {
    /// The field that failed, from the body (`filter_chains[0].filters`);
    /// empty for the body itself. For an unknown field, the field itself.
    pub path: Vec<PathStep>,
    pub message: String,
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", display_path(&self.path), self.message)
        }
    }
}

/// What a `json` body (and an `Any` in one) may be, for errors.
const READABLE: &str = "it reads every message of Envoy's v3 API and CNCF xds (resources and every extension's \
                        typed_config, see proto/README.md) and Istio's kinds";

/// The message type `type_url` names, if this gateway has its descriptor.
pub fn message_type(type_url: &str) -> Option<MessageDescriptor> {
    let name = type_url.strip_prefix(crate::collections::TYPE_URL_PREFIX)?;
    builtin(&[name]).pool.get_message_by_name(name)
}

/// The message `json` describes, encoded as `type_url` says.
pub fn encode(type_url: &str, json: Value) -> Result<Vec<u8>, JsonError> {
    encode_all(type_url, json, 1).map_err(first_error)
}

/// As [`encode`], with up to `max_errors` errors (see [`encode_message_all`]).
pub fn encode_all(type_url: &str, json: Value, max_errors: usize) -> Result<Vec<u8>, Vec<JsonError>> {
    let fail = |message: String| {
        vec![JsonError {
            path: Vec::new(),
            message,
        }]
    };
    if !type_url.starts_with(crate::collections::TYPE_URL_PREFIX) {
        return Err(fail(format!(
            "type_url {type_url:?} does not start with type.googleapis.com/"
        )));
    }
    // The body's type and every `@type` in it, decoded before it is read:
    // the reader looks an `Any`'s type up in the body's pool.
    let name = &type_url[crate::collections::TYPE_URL_PREFIX.len()..];
    let mut names = vec![name.to_owned()];
    any_types(&json, &mut names);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let descriptor = builtin(&names).pool.get_message_by_name(name).ok_or_else(|| {
        fail(format!(
            "type_url {type_url:?} is not a type this gateway can read as json ({READABLE}); give the encoded \
             message as value_base64 instead"
        ))
    })?;
    encode_message_all(&descriptor, json, max_errors)
}

fn first_error(mut errors: Vec<JsonError>) -> JsonError {
    errors.swap_remove(0)
}

/// `json` read as `descriptor`'s message, encoded.
pub fn encode_message(descriptor: &MessageDescriptor, json: Value) -> Result<Vec<u8>, JsonError> {
    encode_message_all(descriptor, json, 1).map_err(first_error)
}

/// `json` read as `descriptor`'s message, encoded; or its errors, up to
/// `max_errors` of them (at least one), in the order the reader meets them.
/// The reader stops at the first; each next one is found by reading again
/// without what failed (the field, or the list it is an item of), so one
/// typo does not hide the next. The served files source asks for one (a
/// file with an error is refused whole); `check` for all of them.
pub fn encode_message_all(
    descriptor: &MessageDescriptor,
    mut json: Value,
    max_errors: usize,
) -> Result<Vec<u8>, Vec<JsonError>> {
    let mut errors = Vec::new();
    loop {
        let more = errors.len() + 1 < max_errors;
        let attempt = if more { json.clone() } else { std::mem::take(&mut json) };
        match encode_once(descriptor, attempt) {
            Ok(bytes) if errors.is_empty() => return Ok(bytes),
            Ok(_) => return Err(errors),
            Err(error) => {
                let pruned = more && prune(&mut json, &error.path);
                errors.push(error);
                if !pruned {
                    return Err(errors);
                }
            }
        }
    }
}

/// Removes the node at `path` from `json` (the list holding it, for an
/// item); whether anything was removed.
fn prune(json: &mut Value, path: &[PathStep]) -> bool {
    let keyed = match path.iter().rposition(|step| matches!(step, PathStep::Key(_))) {
        Some(at) => &path[..=at],
        None => return false,
    };
    let Some((PathStep::Key(last), parent)) = keyed.split_last() else {
        return false;
    };
    let mut node = json;
    for step in parent {
        node = match (step, node) {
            (PathStep::Key(key), Value::Object(fields)) => match fields.get_mut(key) {
                Some(next) => next,
                None => return false,
            },
            (PathStep::Index(index), Value::Array(items)) => match items.get_mut(*index) {
                Some(next) => next,
                None => return false,
            },
            _ => return false,
        };
    }
    node.as_object_mut().is_some_and(|fields| fields.remove(last).is_some())
}

/// One read of `json` as `descriptor`'s message: its bytes, or the first
/// error, with the closest field name or enum value when one is misspelt.
fn encode_once(descriptor: &MessageDescriptor, mut json: Value) -> Result<Vec<u8>, JsonError> {
    if let Err(error) = normalize_durations(descriptor, &mut json, &mut Vec::new()) {
        let secrecy = secrecy(descriptor, &json, &error.path);
        return Err(redact_error(error, secrecy));
    }
    let mut track = serde_path_to_error::Track::new();
    let message = {
        let deserializer = serde_path_to_error::Deserializer::new(&json, &mut track);
        serde::de::DeserializeSeed::deserialize(descriptor.clone(), deserializer)
    };
    let message: DynamicMessage = message.map_err(|e: serde_json::Error| {
        let mut path: Vec<PathStep> = track
            .path()
            .iter()
            .filter_map(|segment| match segment {
                serde_path_to_error::Segment::Seq { index } => Some(PathStep::Index(*index)),
                serde_path_to_error::Segment::Map { key } => Some(PathStep::Key(key.clone())),
                serde_path_to_error::Segment::Enum { variant } => Some(PathStep::Key(variant.clone())),
                serde_path_to_error::Segment::Unknown => None,
            })
            .collect();
        let mut message = e.to_string();
        // The error goes to the log and to /debug/upstream: a value it
        // quotes from a secret (a private key written as a plain string)
        // is not repeated there (decided on the path as reported, before
        // the field below is added to it; a field's name is the schema's,
        // never a value, and stays).
        let mut secrecy = secrecy(descriptor, &json, &path);
        let sensitive = secrecy.quoted;
        // An `Any` of a type no descriptor here describes (prost-reflect
        // says "message 'x.y.Z' not found"): the type named in full, and
        // what reads instead.
        if let Some(name) = missing_type(&message).map(str::to_owned) {
            message = format!(
                "@type names {name}, not a type this gateway can read as json ({READABLE}); give the resource as \
                 value_base64 instead"
            );
        }
        // The path ends at the message that holds an unknown field: the
        // field itself is what the operator has to find.
        if let Some(field) = message
            .strip_prefix("unrecognized field name '")
            .and_then(|rest| rest.split('\'').next())
            .map(str::to_owned)
        {
            if let Some(near) = message_at(descriptor, &json, &path).and_then(|m| closest_field(&m, &field)) {
                message.push_str(&format!(" (did you mean '{near}'?)"));
            }
            // What it quotes is the field it names: hidden where that is
            // the secret's text (inside a secret, or in a secret type's
            // message), shown where it is a typo in the schema's place.
            secrecy.quoted = secrecy.text_from.is_some_and(|from| from <= path.len());
            path.push(PathStep::Key(field));
        } else if let Some(value) = message
            .strip_prefix("unrecognized enum value '")
            .and_then(|rest| rest.split('\'').next())
            .filter(|_| !sensitive)
        {
            if let Some(near) = enum_at(descriptor, &json, &path).and_then(|e| {
                closest(
                    value,
                    e.values()
                        .map(|v| v.name().to_owned())
                        .collect::<Vec<_>>()
                        .iter()
                        .map(String::as_str),
                )
                .map(str::to_owned)
            }) {
                message.push_str(&format!(" (did you mean '{near}'?)"));
            }
        }
        redact_error(JsonError { path, message }, secrecy)
    })?;
    Ok(canonical(descriptor, &prost::Message::encode_to_vec(&message), 0))
}

/// `bytes`, a message of `descriptor`, with every map's entries in the order
/// of their bytes, at any depth and inside `Any`s of a type `descriptor`'s
/// pool has: prost-reflect writes a map (a `Struct`'s fields, an
/// `EnvoyFilter`'s patch, a cluster's `typed_extension_protocol_options`)
/// in its hash map's order, which is each process's own, so the same file
/// would make other bytes, and another version, on every replica and at
/// every restart. Nothing else moves: every field keeps its bytes and its
/// place, so the lengths around it stay. Bytes that do not read as the
/// message are left as they are.
fn canonical(descriptor: &MessageDescriptor, bytes: &[u8], depth: usize) -> Vec<u8> {
    let found: Result<Vec<WireField>, ()> = wire_fields(bytes).collect();
    let Some(found) = found.ok().filter(|_| depth <= 2 * MAX_ANY_DEPTH + 64) else {
        return bytes.to_vec();
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut maps_written = HashSet::new();
    for field in &found {
        let descriptor_field = descriptor.get_field(field.number);
        let (Some(payload), Some(described)) = (field.payload, descriptor_field) else {
            out.extend_from_slice(&bytes[field.start..field.end]);
            continue;
        };
        let Kind::Message(inner) = described.kind() else {
            out.extend_from_slice(&bytes[field.start..field.end]);
            continue;
        };
        if described.is_map() {
            // Every entry of the map, where its first one was, in order.
            if !maps_written.insert(field.number) {
                continue;
            }
            let mut entries: Vec<Vec<u8>> = found
                .iter()
                .filter(|f| f.number == field.number && f.payload.is_some())
                .map(|f| {
                    let at = f.payload.expect("filtered");
                    let mut entry = bytes[f.start..at].to_vec();
                    entry.extend(canonical(&inner, &bytes[at..f.end], depth + 1));
                    entry
                })
                .collect();
            entries.sort_unstable();
            entries.iter().for_each(|entry| out.extend_from_slice(entry));
            continue;
        }
        out.extend_from_slice(&bytes[field.start..payload]);
        let value = &bytes[payload..field.end];
        if inner.full_name() == "google.protobuf.Any" {
            out.extend(canonical_any(&inner, value, depth));
        } else {
            out.extend(canonical(&inner, value, depth + 1));
        }
    }
    out
}

/// [`canonical`] of an `Any`: its value by the type its URL names, in the
/// pool of `any` (the `Any`'s own descriptor).
fn canonical_any(any: &MessageDescriptor, bytes: &[u8], depth: usize) -> Vec<u8> {
    let Ok(mut read) = <crate::proto::wire::AnyBytes as prost::Message>::decode(bytes) else {
        return bytes.to_vec();
    };
    let Some(inner) = type_name(&read.type_url).and_then(|name| any.parent_pool().get_message_by_name(name)) else {
        return bytes.to_vec();
    };
    let value = canonical(&inner, &read.value, depth + 1);
    if value[..] == read.value[..] {
        return bytes.to_vec();
    }
    read.value = value.into();
    // The same fields, the same lengths: only the value's bytes moved.
    let mut out = Vec::with_capacity(bytes.len());
    // An `Any` prost-reflect wrote is its type URL then its value; one
    // written otherwise is written again the same way (prost's order).
    prost::Message::encode(&read, &mut out).expect("a Vec grows");
    out
}

/// The message the node at `path` of a body of `descriptor` (written
/// `json`) is, through lists, maps and `Any`s; `None` where the path leads
/// to no message known here.
fn message_at(descriptor: &MessageDescriptor, json: &Value, path: &[PathStep]) -> Option<MessageDescriptor> {
    follow(descriptor, json, path, &mut Vec::new())
}

/// `path` (of JSON names, as a body read back has them) of a body of
/// `type_url` (written `json`) by the protos' field names
/// (`loadAssignment` → `load_assignment`), which YAML may use instead: for
/// finding a field's line. Steps past what the descriptors know are kept.
pub fn proto_path(type_url: &str, json: &Value, path: &[PathStep]) -> Vec<PathStep> {
    let mut names = Vec::new();
    if let Some(descriptor) = message_type(type_url) {
        follow(&descriptor, json, path, &mut names);
    }
    names.extend(path[names.len()..].iter().cloned());
    names
}

/// Walks `path` down a body of `descriptor`, each step it follows written
/// to `names` by its proto name; the message it ends at.
fn follow(
    descriptor: &MessageDescriptor,
    json: &Value,
    path: &[PathStep],
    names: &mut Vec<PathStep>,
) -> Option<MessageDescriptor> {
    let mut message = descriptor.clone();
    let mut value = json;
    let mut steps = path.iter();
    loop {
        if message.full_name() == "google.protobuf.Any" {
            message = value.get("@type").and_then(Value::as_str).and_then(message_type)?;
        }
        let Some(step) = steps.next() else {
            return Some(message);
        };
        let PathStep::Key(key) = step else {
            return None;
        };
        let field = field_named(&message, key)?;
        names.push(PathStep::Key(field.name().to_owned()));
        value = value.get(key.as_str()).unwrap_or(&Value::Null);
        let Kind::Message(inner) = field.kind() else {
            return None;
        };
        message = inner;
        if field.is_map() || field.is_list() {
            if field.is_map() {
                let Kind::Message(item) = message.map_entry_value_field().kind() else {
                    return None;
                };
                message = item;
            }
            let step = steps.next()?;
            names.push(step.clone());
            value = match step {
                PathStep::Key(entry) => value.get(entry.as_str()),
                PathStep::Index(index) => value.get(*index),
            }
            .unwrap_or(&Value::Null);
        }
    }
}

/// The enum of the field at `path` (an item of a list or a map's value
/// included).
fn enum_at(descriptor: &MessageDescriptor, json: &Value, path: &[PathStep]) -> Option<prost_reflect::EnumDescriptor> {
    let keyed = &path[..path.iter().rposition(|step| matches!(step, PathStep::Key(_)))?];
    let (field, parent) = (path.get(keyed.len())?, keyed);
    let PathStep::Key(field) = field else { return None };
    let message = message_at(descriptor, json, parent)?;
    let field = field_named(&message, field)?;
    let kind = if field.is_map() {
        match field.kind() {
            Kind::Message(entry) => entry.map_entry_value_field().kind(),
            other => other,
        }
    } else {
        field.kind()
    };
    match kind {
        Kind::Enum(values) => Some(values),
        _ => None,
    }
}

/// The field of `message` closest to a misspelt `name`, as the file would
/// spell it (the JSON name, or the proto name for a name with `_`).
fn closest_field(message: &MessageDescriptor, name: &str) -> Option<String> {
    let names: Vec<String> = message
        .fields()
        .map(|f| if name.contains('_') { f.name() } else { f.json_name() }.to_owned())
        .collect();
    closest(name, names.iter().map(String::as_str)).map(str::to_owned)
}

/// The candidate closest to a misspelt `wanted` (edit distance, ignoring
/// case), when it is close enough to be what was meant (about one edit in
/// three characters) and no other is as close.
pub fn closest<'a>(wanted: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let wanted_lower = wanted.to_lowercase();
    let limit = (wanted.chars().count() / 3).max(1);
    let mut best: Option<(usize, &str)> = None;
    let mut tied = false;
    for candidate in candidates {
        if candidate == wanted {
            continue;
        }
        let distance = edit_distance(&wanted_lower, &candidate.to_lowercase());
        match best {
            _ if distance > limit => {}
            Some((kept, _)) if distance > kept => {}
            Some((kept, name)) if distance == kept => tied |= name != candidate,
            _ => {
                best = Some((distance, candidate));
                tied = false;
            }
        }
    }
    best.filter(|_| !tied).map(|(_, candidate)| candidate)
}

/// `Invalid symbol [redacted] #33, offset 16` as `Invalid symbol [redacted],
/// offset 16`: the code after each mark dropped.
fn strip_symbol_codes(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("[redacted] #") {
        out.push_str(&rest[..at + "[redacted]".len()]);
        rest = rest[at + "[redacted] #".len()..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

/// Edit distance in characters (insertions, deletions, substitutions and
/// swaps of two neighbours, each one edit: `hots` is one from `host`):
/// strsim's optimal string alignment.
fn edit_distance(a: &str, b: &str) -> usize {
    strsim::osa_distance(a, b)
}

/// What an error at a path of a body may not show of the document's text
/// (see [`secrecy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Secrecy {
    /// The value the error is about may be a secret: what it quotes is
    /// redacted.
    pub quoted: bool,
    /// The path's steps from here on (and a field an unknown-field error
    /// adds) are the secret's own text (a sensitive map's keys, a key in a
    /// secret's message that no field has, what lies in an `Any` of a type
    /// not known here, inside a secret).
    pub text_from: Option<usize>,
    /// A type an `Any` inside a secret names is the secret's text too.
    pub any_type: bool,
}

impl Secrecy {
    /// At a value that is a secret's when the path went through a marked
    /// field (`inside`), `at` steps down: then it and what follows are.
    fn within(inside: bool, at: usize) -> Self {
        Secrecy {
            quoted: inside,
            text_from: inside.then_some(at),
            any_type: inside,
        }
    }
}

/// How much of an error at `path` of a body of `descriptor` (written
/// `json`, or `Null` where it did not read) may be shown: the value may be
/// a secret when the path goes through a field marked sensitive, reaches
/// an `Any` of a type not known here, or ends at (or at an unknown key of)
/// a message holding a secret at any depth. Inside a secret (past a marked
/// field), its field names stay (the schema's) and what is not a field is
/// its text; outside, only a secret type's message (`Secret`,
/// `TlsCertificate`: its values are secrets) makes an unknown key text.
pub fn secrecy(descriptor: &MessageDescriptor, json: &Value, path: &[PathStep]) -> Secrecy {
    let descriptors = builtin_of(descriptor);
    let sensitivity = &descriptors.sensitivity;
    let secret_type = |message: &MessageDescriptor| {
        is_secret_type(&format!(
            "{}{}",
            crate::collections::TYPE_URL_PREFIX,
            message.full_name()
        ))
    };
    let mut message = descriptor.clone();
    let mut value = json;
    let mut inside = false;
    let mut at = 0;
    let mut hops = 0;
    loop {
        while message.full_name() == "google.protobuf.Any" {
            hops += 1;
            match value.get("@type").and_then(Value::as_str).and_then(message_type) {
                // An `Any` of an `Any` holds the inner one under `value`.
                Some(inner) if inner.full_name() == "google.protobuf.Any" && hops < 64 => {
                    value = value.get("value").unwrap_or(&Value::Null);
                }
                Some(inner) if inner.full_name() != "google.protobuf.Any" => message = inner,
                // An `Any` of a type not known here: nothing says it is
                // harmless, and nothing in it is the schema's.
                _ => {
                    return Secrecy {
                        quoted: true,
                        text_from: Some(at),
                        any_type: inside,
                    }
                }
            }
        }
        let holds = inside || sensitivity.holds_secrets(message.full_name());
        let end = |text: bool| Secrecy {
            quoted: holds,
            text_from: text.then_some(at),
            any_type: inside,
        };
        let Some(PathStep::Key(key)) = path.get(at) else {
            // The error is about this message's value, or names a field of
            // it that is not there (added after `at`).
            return end(inside || secret_type(&message));
        };
        let Some(field) = field_named(&message, key) else {
            return end(inside || secret_type(&message));
        };
        at += 1;
        inside |= sensitivity.is_sensitive_field(&field);
        let Kind::Message(inner) = field.kind() else {
            return Secrecy::within(inside, at);
        };
        value = value.get(key.as_str()).unwrap_or(&Value::Null);
        message = inner;
        if field.is_map() || field.is_list() {
            let Kind::Message(item) = (if field.is_map() {
                message.map_entry_value_field().kind()
            } else {
                Kind::Message(message.clone())
            }) else {
                // A map or list of scalars: its keys (a secret's) and values.
                return Secrecy::within(inside, at);
            };
            match path.get(at) {
                Some(PathStep::Key(entry)) => {
                    if inside {
                        return Secrecy {
                            quoted: true,
                            text_from: Some(at),
                            any_type: true,
                        };
                    }
                    value = value.get(entry.as_str()).unwrap_or(&Value::Null);
                }
                Some(PathStep::Index(index)) => value = value.get(*index).unwrap_or(&Value::Null),
                // The error is about the list or map itself.
                None => {
                    return Secrecy {
                        quoted: inside || sensitivity.holds_secrets(item.full_name()),
                        text_from: inside.then_some(at),
                        any_type: inside,
                    }
                }
            }
            at += 1;
            message = item;
        }
    }
}

/// How deep `Any`s may nest in a body read back (an `Any` holding an `Any`
/// holding …): Envoy's own limit for a message's nesting is 100.
pub const MAX_ANY_DEPTH: usize = 32;

/// How deep `Any`s nest in `message`, `depth` deep already; past
/// [`MAX_ANY_DEPTH`] it stops looking. An `Any` of a type `pool` does not
/// have counts as one level.
pub fn any_depth(message: &DynamicMessage, pool: &prost_reflect::DescriptorPool, depth: usize) -> usize {
    if depth > MAX_ANY_DEPTH {
        return depth;
    }
    if prost_reflect::ReflectMessage::descriptor(message).full_name() == "google.protobuf.Any" {
        let inner = message
            .get_field_by_name("type_url")
            .and_then(|t| t.as_str().map(|t| t.rsplit('/').next().unwrap_or(t).to_owned()))
            .and_then(|name| pool.get_message_by_name(&name))
            .zip(message.get_field_by_name("value").and_then(|v| v.as_bytes().cloned()))
            .and_then(|(inner, bytes)| DynamicMessage::decode(inner, bytes).ok());
        return match inner {
            Some(inner) => any_depth(&inner, pool, depth + 1),
            None => depth + 1,
        };
    }
    let mut deepest = depth;
    for (_, value) in message.fields() {
        let mut visit = |value: &prost_reflect::Value| {
            if let prost_reflect::Value::Message(inner) = value {
                deepest = deepest.max(any_depth(inner, pool, depth));
            }
        };
        match value {
            prost_reflect::Value::List(items) => items.iter().for_each(&mut visit),
            prost_reflect::Value::Map(entries) => entries.values().for_each(&mut visit),
            other => visit(other),
        }
        if deepest > MAX_ANY_DEPTH {
            break;
        }
    }
    deepest
}

/// An error the YAML reader made at `path` (written as [`display_path`]
/// writes one) inside a body of `type_url`, before the body could be read
/// as its type (a tag, a key written twice): said as [`secrecy`] allows,
/// with nothing of the body to tell an `Any`'s type (what lies in one is
/// taken for a secret's). A type not known here: its quoted values hidden.
pub fn redact_body_error(type_url: &str, path: &str, message: &str) -> (String, String) {
    let steps: Vec<PathStep> = path
        .split('.')
        .flat_map(|part| {
            let mut steps = Vec::new();
            let mut rest = part;
            if let Some(open) = rest.find('[') {
                steps.push(PathStep::Key(rest[..open].to_owned()));
                rest = &rest[open..];
                while let Some(index) = rest
                    .strip_prefix('[')
                    .and_then(|r| r.split_once(']'))
                    .and_then(|(n, after)| n.parse().ok().map(|n| (n, after)))
                {
                    steps.push(PathStep::Index(index.0));
                    rest = index.1;
                }
            } else {
                steps.push(PathStep::Key(rest.to_owned()));
            }
            steps
        })
        .collect();
    let secrecy = match message_type(type_url) {
        Some(descriptor) => secrecy(&descriptor, &Value::Null, &steps),
        None => Secrecy {
            quoted: true,
            ..Secrecy::default()
        },
    };
    let error = redact_error(
        JsonError {
            path: steps,
            message: message.to_owned(),
        },
        secrecy,
    );
    (display_path(&error.path), error.message)
}

/// An error about a value that may be a secret (see [`secrecy`]), said
/// without the document's text: what its message quotes, a type an `Any`
/// inside a secret names, and the path's steps that are the secret's text.
fn redact_error(mut error: JsonError, secrecy: Secrecy) -> JsonError {
    if secrecy.quoted {
        error.message = redact_quoted(&error.message);
    }
    if secrecy.any_type {
        redact_any_type(&mut error.message);
    }
    if let Some(from) = secrecy.text_from {
        for step in error.path.iter_mut().skip(from) {
            if let PathStep::Key(key) = step {
                *key = REDACTED.to_owned();
            }
        }
    }
    error
}

/// `message` without the type an `Any` names in it (`@type names X, …`,
/// unquoted): the body's own text where the `Any` lies in a secret.
pub fn redact_any_type(message: &mut String) {
    const NAMES: &str = "@type names ";
    if let Some(at) = message.find(NAMES).map(|at| at + NAMES.len()) {
        let end = message[at..].find(',').map_or(message.len(), |e| at + e);
        message.replace_range(at..end, REDACTED);
    }
}

/// `message` with every quoted value (`"..."`, as serde quotes strings,
/// `` `...` ``, as it quotes numbers and variants, and `'...'`, as
/// prost-reflect quotes an enum's value) written `[redacted]`: an error
/// about a body that may hold a secret, or about any body of a sensitive
/// collection, as the log and the admin port show it.
pub fn redact_quoted(message: &str) -> String {
    // A base64 decoder's "Invalid symbol 33, offset 16" gives away a byte of
    // the value: only where it is stays.
    let message = &message.replace("Invalid symbol ", "Invalid symbol [redacted] #");
    let message = &strip_symbol_codes(message);
    let mut shown = String::with_capacity(message.len());
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                // To the closing quote, past escaped ones.
                let mut escaped = false;
                for c in chars.by_ref() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => break,
                        _ => escaped = false,
                    }
                }
                shown.push_str(REDACTED);
            }
            // A `'` opens a quote where a word may start (`value 'X'`),
            // not inside one (`Envoy's`). What it quotes is not escaped (a
            // value may hold a `'`), nor is a backtick's: redacted to the
            // last one of the message, so no part of the value is left
            // (what follows it in the message goes too).
            '\'' if !shown.chars().next_back().is_some_and(char::is_alphanumeric) => {
                redact_to_last(&mut chars, '\'');
                shown.push_str(REDACTED);
            }
            '`' => {
                redact_to_last(&mut chars, '`');
                shown.push_str(REDACTED);
            }
            c => shown.push(c),
        }
    }
    shown
}

/// Whether a type the gateway may have no descriptor of may hold a secret
/// all the same: any Envoy, xDS or UDPA type (their v2 and v4alpha
/// versions, the admin's config dumps, discovery responses: every one of
/// them can carry a key), or one named like a secret's holder anywhere in
/// its type URL, in any case (`…Secret`, `…/SECRET/x`, `foo.PrivateKey`,
/// `…TlsCertificate`, credentials, passwords, tokens). Its bytes are never
/// previewed.
fn looks_secret(type_url: &str, name: &str) -> bool {
    const PACKAGES: &[&str] = &["envoy.", "xds.", "udpa.", "istio.security."];
    const WORDS: &[&str] = &[
        "secret",
        "key",
        "tls",
        "cert",
        "credential",
        "password",
        "token",
        "auth",
    ];
    let url = type_url.to_ascii_lowercase();
    PACKAGES.iter().any(|p| name.starts_with(p)) || WORDS.iter().any(|w| url.contains(w))
}

/// Moves `chars` past the last `quote` it holds (to its end when it holds
/// none: an unclosed quote hides the rest).
fn redact_to_last(chars: &mut std::str::Chars<'_>, quote: char) {
    let rest = chars.as_str();
    let end = rest.rfind(quote).map_or(rest.len(), |at| at + quote.len_utf8());
    *chars = rest[end..].chars();
}

/// The field of `descriptor` a proto-JSON key names: its JSON name
/// (`connectTimeout`) or its own (`connect_timeout`).
fn field_named(descriptor: &MessageDescriptor, key: &str) -> Option<FieldDescriptor> {
    descriptor
        .get_field_by_json_name(key)
        .or_else(|| descriptor.get_field_by_name(key))
}

const DURATION: &str = "google.protobuf.Duration";

/// Rewrites every `google.protobuf.Duration` written as Go writes durations
/// (`5m`, `1h30m`, `300ms`, `1.5h`) to its proto-JSON (`300s`), so both
/// forms read. Fields this pass does not know are left to the reader, which
/// names them.
fn normalize_durations(
    descriptor: &MessageDescriptor,
    json: &mut Value,
    path: &mut Vec<PathStep>,
) -> Result<(), JsonError> {
    let Value::Object(fields) = json else {
        return Ok(());
    };
    if descriptor.full_name() == "google.protobuf.Any" {
        // An `Any` holds its own type's fields beside `@type`.
        let inner = fields.get("@type").and_then(Value::as_str).and_then(message_type);
        return match inner {
            // An `Any` of an `Any` holds the inner one under `value` (read
            // again as itself, it would never end).
            Some(inner) if inner.full_name() == "google.protobuf.Any" => match fields.get_mut("value") {
                Some(value) => {
                    path.push(PathStep::Key("value".to_owned()));
                    normalize_durations(&inner, value, path)?;
                    path.pop();
                    Ok(())
                }
                None => Ok(()),
            },
            Some(inner) if inner.full_name() != DURATION => normalize_durations(&inner, json, path),
            _ => Ok(()),
        };
    }
    for (key, value) in fields.iter_mut() {
        let Some(field) = field_named(descriptor, key) else {
            continue;
        };
        let Kind::Message(mut message) = field.kind() else {
            continue;
        };
        if field.is_map() {
            let Kind::Message(values) = message.map_entry_value_field().kind() else {
                continue;
            };
            message = values;
        }
        path.push(PathStep::Key(key.clone()));
        match value {
            Value::Array(items) if field.is_list() => {
                for (index, item) in items.iter_mut().enumerate() {
                    path.push(PathStep::Index(index));
                    normalize_value(&message, item, path)?;
                    path.pop();
                }
            }
            Value::Object(entries) if field.is_map() => {
                for (entry, item) in entries.iter_mut() {
                    path.push(PathStep::Key(entry.clone()));
                    normalize_value(&message, item, path)?;
                    path.pop();
                }
            }
            _ => normalize_value(&message, value, path)?,
        }
        path.pop();
    }
    Ok(())
}

fn normalize_value(message: &MessageDescriptor, value: &mut Value, path: &mut Vec<PathStep>) -> Result<(), JsonError> {
    match value {
        Value::String(text) if message.full_name() == DURATION => {
            *text = proto_json_duration(text).map_err(|message| JsonError {
                path: path.clone(),
                message,
            })?;
            Ok(())
        }
        _ => normalize_durations(message, value, path),
    }
}

/// The largest `google.protobuf.Duration`, in seconds (10,000 years).
const MAX_DURATION_SECONDS: u128 = 315_576_000_000;

/// A duration as Go's `time.ParseDuration` reads it (`1h30m`, `300ms`,
/// `0.25s`, `-5s`; units ns, us, µs, ms, s, m, h), written as proto-JSON
/// (`5400s`, `0.300s`).
pub fn proto_json_duration(text: &str) -> Result<String, String> {
    let invalid = || {
        format!(
            "invalid duration {text:?}: give a number and a unit, as in 300s, 5m, 1h30m, 300ms or 0.25s \
             (units: h, m, s, ms, us, ns)"
        )
    };
    let (negative, mut rest) = match text.trim() {
        t if t.starts_with('-') => (true, &t[1..]),
        t => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    if rest == "0" {
        return Ok("0s".into());
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(invalid()),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
            return Err(invalid());
        }
        let digits = |d: &str| -> Result<u128, String> {
            if d.is_empty() {
                Ok(0)
            } else {
                d.parse::<u128>().map_err(|_| invalid())
            }
        };
        // Beyond nanoseconds a fraction's digits add nothing.
        let fraction = &fraction[..fraction.len().min(18)];
        let scale = 10u128.pow(fraction.len() as u32);
        nanos = digits(whole)?
            .checked_mul(per_unit)
            .and_then(|n| n.checked_add(digits(fraction).ok()? * per_unit / scale))
            .and_then(|n| n.checked_add(nanos))
            .ok_or_else(invalid)?;
        rest = after;
    }
    let (seconds, nanos) = (nanos / 1_000_000_000, nanos % 1_000_000_000);
    if seconds > MAX_DURATION_SECONDS {
        return Err(format!(
            "duration {text:?} is longer than a google.protobuf.Duration holds (10,000 years)"
        ));
    }
    let sign = if negative { "-" } else { "" };
    Ok(if nanos == 0 {
        format!("{sign}{seconds}s")
    } else {
        let fraction = format!("{nanos:09}");
        format!("{sign}{seconds}.{}s", fraction.trim_end_matches('0'))
    })
}

/// The message full name a type URL names (after its last `/`), when it is
/// written as a type URL: no whitespace or control character anywhere, and
/// a full name's characters only (`a.b.C`, letters, digits and `_`). Type
/// URLs are compared exactly everywhere: `…tls.v3.Secret ` is not `Secret`,
/// and since it is no type at all, no view reads or previews it.
pub fn type_name(type_url: &str) -> Option<&str> {
    if type_url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return None;
    }
    let name = type_url.rsplit('/').next()?;
    let well_formed = !name.is_empty()
        && name.split('.').all(|part| {
            part.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    well_formed.then_some(name)
}

/// What every view shows in place of a sensitive field's value.
pub use crate::transport::safe_text::REDACTED;

/// Whether the views hide part of a body of `type_url` (the `Any`'s value
/// `value`) in a collection that is not one of secrets, as possibly secret:
/// a field marked `(udpa.annotations.sensitive) = true`, present, at any
/// depth and inside any `Any` (a cluster's `UpstreamTlsContext` with an
/// inline key or its password); a `TypedStruct` (its value is shown
/// `[redacted]` whole); an `Any` or a body of a type the built-in
/// descriptors do not have, or bytes that do not read as their type (shown
/// by size). Its versions are then keyed as a secret's are: a plain hash of
/// a body whose every other byte a view shows (or of a short body a view
/// hides whole) would test a guess of what is hidden offline. A body the
/// views show whole (every Istio kind, a `Struct`, endpoints) keeps plain
/// hashes, the same on every replica.
///
/// Cheap for what cannot hide anything: a type whose descriptor marks no
/// field at any depth and reaches no `Any` is not read; any other is walked
/// on the wire by its type's plan ([`WalkPlan`], made once per type), not
/// decoded.
pub fn hidden_in_part(type_url: &str, value: &[u8]) -> bool {
    ViewsOfType::of(type_url).hide_in_part(value)
}

/// What [`hidden_in_part`] reads of a body's type URL, read once for every
/// body of that type URL: whether the URL is well formed is a pass over
/// its characters, and the type's plan a lookup (together about 3,000
/// instructions a body; BENCHMARKS, session 31).
#[derive(Clone, Debug)]
pub struct ViewsOfType(Option<Arc<WalkPlan>>);

impl ViewsOfType {
    pub fn of(type_url: &str) -> Self {
        // No type the views read, or no built-in descriptor (with
        // `--descriptors`, read by those, whose marked fields are
        // redacted): `None`, a body shown by its size.
        Self(type_name(type_url).and_then(WalkPlan::of))
    }

    /// [`hidden_in_part`] for a body of this type, its value `value`.
    pub fn hide_in_part(&self, value: &[u8]) -> bool {
        match &self.0 {
            None => true,
            Some(plan) => plan.walked && plan.hidden_on_the_wire(0, value, 0),
        }
    }
}

/// How a body of one type is walked on the wire to find what the views hide
/// in it ([`hidden_in_part`]): the message types met from it, each with the
/// fields that need a look, made once per type from the built-in
/// descriptors. A body is then read by field numbers alone: no descriptor
/// lookup, name hash or lock per field (those were 12 % of the gateway's
/// CPU in `mcp-load --scenario reconnect`, where every endpoint of 10,000
/// `ClusterLoadAssignment`s was looked up twice, once restored and once
/// from the source).
#[derive(Debug)]
struct WalkPlan {
    /// Whether a body of this type at the top is walked at all: its type
    /// holds a marked field at some depth or reaches an `Any` (an `Any`'s
    /// value is always read, at least to see that it reads).
    walked: bool,
    /// The body's type first, then every type a look leads into.
    messages: Vec<MessageWalk>,
}

#[derive(Debug, Default)]
struct MessageWalk {
    /// A TypedStruct: its value is shown `[redacted]` whole.
    typed_struct: bool,
    /// The fields that need a look, by number, ascending; any other field
    /// is skipped by its length.
    fields: Vec<(u32, Look)>,
}

#[derive(Debug, Clone, Copy)]
enum Look {
    /// Marked sensitive: the views redact it, whatever it holds.
    Sensitive,
    /// An `Any`: its value read by the type its URL names.
    Any,
    /// A message that holds a marked field or reaches an `Any`: walked into
    /// by the plan's message at this index.
    Into(usize),
}

impl WalkPlan {
    /// The plan of the message type `name` (a full name), made the first
    /// time; `None` where the built-in descriptors have no such type (not
    /// kept: only described types, a finite set, are; all of them planned
    /// hold under a MiB, a test says).
    fn of(name: &str) -> Option<Arc<WalkPlan>> {
        type Plans = HashMap<String, Arc<WalkPlan>, foldhash::fast::RandomState>;
        static PLANS: OnceLock<Mutex<Plans>> = OnceLock::new();
        let plans = PLANS.get_or_init(Mutex::default);
        let lock = || plans.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(plan) = lock().get(name) {
            return Some(plan.clone());
        }
        let descriptors = builtin(&[name]);
        let top = descriptors.pool.get_message_by_name(name)?;
        let plan = Arc::new(WalkPlan::make(&descriptors, &top));
        Some(lock().entry(name.to_owned()).or_insert(plan).clone())
    }

    fn make(descriptors: &Descriptors, top: &MessageDescriptor) -> WalkPlan {
        let walked = |message: &MessageDescriptor| {
            descriptors.sensitivity.holds_secrets(message.full_name()) || reaches_an_any(message)
        };
        let mut index = HashMap::from([(top.full_name().to_owned(), 0)]);
        let mut messages = vec![MessageWalk::default()];
        let mut pending = vec![(0, top.clone())];
        while let Some((at, message)) = pending.pop() {
            let typed_struct = is_typed_struct(message.full_name());
            let mut fields = Vec::new();
            for field in message.fields().filter(|_| !typed_struct) {
                let look = if descriptors.sensitivity.is_sensitive_field(&field) {
                    Look::Sensitive
                } else {
                    match field.kind() {
                        Kind::Message(inner) if inner.full_name() == "google.protobuf.Any" => Look::Any,
                        Kind::Message(inner) if walked(&inner) => {
                            let next = messages.len();
                            let into = *index.entry(inner.full_name().to_owned()).or_insert(next);
                            if into == next {
                                messages.push(MessageWalk::default());
                                pending.push((next, inner));
                            }
                            Look::Into(into)
                        }
                        _ => continue,
                    }
                };
                fields.push((field.number(), look));
            }
            fields.sort_unstable_by_key(|&(number, _)| number);
            messages[at] = MessageWalk { typed_struct, fields };
        }
        WalkPlan {
            walked: walked(top),
            messages,
        }
    }

    /// Whether the views hide part of `bytes`, a message of the plan's
    /// message `at`, found without decoding it: a field marked sensitive
    /// present (whatever it holds: the views redact it so), a `TypedStruct`,
    /// an `Any` of a type the built-in descriptors lack, or bytes that do
    /// not read. Only fields of a message type that holds a marked field or
    /// reaches an `Any` are walked into, an `Any`'s value by the type it
    /// names; everything else is skipped by its length.
    fn hidden_on_the_wire(&self, at: usize, bytes: &[u8], depth: usize) -> bool {
        let message = &self.messages[at];
        if depth > 2 * MAX_ANY_DEPTH + 64 || message.typed_struct {
            return true;
        }
        for field in wire_fields(bytes) {
            let Ok(field) = field else {
                return true;
            };
            let Ok(found) = message
                .fields
                .binary_search_by_key(&field.number, |&(number, _)| number)
            else {
                continue;
            };
            let look = message.fields[found].1;
            let hidden = match (look, field.payload) {
                (Look::Sensitive, _) => true,
                (Look::Any, Some(start)) => any_hidden_on_the_wire(&bytes[start..field.end], depth),
                (Look::Into(inner), Some(start)) => self.hidden_on_the_wire(inner, &bytes[start..field.end], depth + 1),
                // A message field not written as one: skipped, as a
                // reader that skips what it cannot read would.
                (_, None) => false,
            };
            if hidden {
                return true;
            }
        }
        false
    }
}

/// [`WalkPlan::hidden_on_the_wire`] for an `Any`'s bytes: its value by the
/// type its URL names, in the built-in descriptors.
fn any_hidden_on_the_wire(bytes: &[u8], depth: usize) -> bool {
    let Ok(any) = <crate::proto::wire::AnyBytes as prost::Message>::decode(bytes) else {
        return true;
    };
    let Some(name) = type_name(&any.type_url) else {
        return true;
    };
    match WalkPlan::of(name) {
        Some(plan) => plan.hidden_on_the_wire(0, &any.value, depth + 1),
        None => true,
    }
}

/// Whether a message of `descriptor` reaches an `Any` (or a `TypedStruct`)
/// through its fields at any depth. Found once per type; only described
/// types get here (a finite set), never a name a source made up.
fn reaches_an_any(descriptor: &MessageDescriptor) -> bool {
    static FOUND: OnceLock<Mutex<HashMap<String, bool, foldhash::fast::RandomState>>> = OnceLock::new();
    let found = FOUND.get_or_init(Mutex::default);
    let lock = || found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(known) = lock().get(descriptor.full_name()) {
        return *known;
    }
    let reaches = reaches_one_of(descriptor, |name| {
        name == "google.protobuf.Any" || is_typed_struct(name)
    });
    lock().insert(descriptor.full_name().to_owned(), reaches);
    reaches
}

/// Whether `descriptor`, or a message its fields reach at any depth, is one
/// `wanted` names.
fn reaches_one_of(descriptor: &MessageDescriptor, wanted: impl Fn(&str) -> bool) -> bool {
    let mut seen = HashSet::new();
    let mut pending = vec![descriptor.clone()];
    while let Some(message) = pending.pop() {
        if wanted(message.full_name()) {
            return true;
        }
        if seen.insert(message.full_name().to_owned()) {
            pending.extend(message.fields().filter_map(|field| match field.kind() {
                Kind::Message(inner) => Some(inner),
                _ => None,
            }));
        }
    }
    false
}

/// A body read back for a person: its proto-JSON with every sensitive field
/// `[redacted]`, and what the redacted fields held as digests (never shown),
/// by path, so two versions of a body can be told apart by their secrets
/// without showing them.
#[derive(Debug, Clone, PartialEq)]
pub struct RedactedBody {
    pub json: Value,
    /// The path of each redacted field (`tlsCertificate.privateKey`; empty
    /// for a body redacted whole) to a digest of its value.
    pub secrets: BTreeMap<String, u64>,
}

/// Reads resource bodies back for a person (the config dump, the diffs,
/// `client --output`): `google.protobuf.Struct`, the Envoy types and Istio
/// kinds above, and every message of an operator's descriptor set
/// (`--descriptors`: a `FileDescriptorSet` compiled by `protoc -o` or `buf
/// build`). Every field marked `(udpa.annotations.sensitive) = true` reads
/// `[redacted]`, at any depth and inside `Any`, as in Envoy's `/config_dump`.
#[derive(Debug)]
pub struct BodyDecoder {
    /// The operator's set merged into the built-in one, with its sensitive
    /// fields; `None` without one (the built-in pools are then shared, each
    /// decoded on first use).
    own: Option<Arc<Descriptors>>,
    /// Type URLs marked sensitive whatever their descriptors say
    /// (`--type-map` rows written `sensitive: true`): one whose descriptor
    /// marks no field is shown `[redacted]` whole.
    sensitive_types: HashSet<String>,
}

impl BodyDecoder {
    /// With `descriptors` (a file holding a `FileDescriptorSet`); an error
    /// says why it cannot be used.
    pub fn new(descriptors: Option<&std::path::Path>) -> Result<Self, String> {
        let Some(path) = descriptors else {
            return Ok(Self {
                own: None,
                sensitive_types: HashSet::new(),
            });
        };
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
        let mut pool = all_descriptors().pool.clone();
        let not_a_set =
            |e: prost::DecodeError| format!("not a FileDescriptorSet (protoc -o FILE, or buf build -o FILE): {e}");
        // Read as a dynamic message, not as prost_types: the files' options
        // keep their extensions, `(udpa.annotations.sensitive)` among them.
        let set_type = pool
            .get_message_by_name("google.protobuf.FileDescriptorSet")
            .expect("the built-in descriptors import descriptor.proto");
        let mut set = DynamicMessage::decode(set_type, &bytes[..]).map_err(not_a_set)?;
        // The operator's files may repeat ones the built-in set has (the
        // well-known types): those are skipped, the rest added.
        if let Some(prost_reflect::Value::List(files)) = set.get_field_by_name_mut("file") {
            files.retain(|file| {
                let name = file
                    .as_message()
                    .and_then(|f| f.get_field_by_name("name"))
                    .and_then(|n| n.as_str().map(str::to_owned))
                    .unwrap_or_default();
                pool.get_file_by_name(&name).is_none()
            });
        }
        pool.decode_file_descriptor_set(&prost::Message::encode_to_vec(&set)[..])
            .map_err(|e| format!("its descriptors do not resolve: {e}"))?;
        Ok(Self {
            own: Some(Arc::new(Descriptors::new(pool))),
            sensitive_types: HashSet::new(),
        })
    }

    /// Marks `type_urls` sensitive whatever their descriptors say (the
    /// collection table's sensitive body types, `--type-map`'s among them).
    pub fn with_sensitive_types(mut self, type_urls: impl IntoIterator<Item = String>) -> Self {
        self.sensitive_types = type_urls.into_iter().collect();
        self
    }

    /// The descriptors the messages `names` are read with (see [`builtin`]).
    fn descriptors(&self, names: &[&str]) -> Arc<Descriptors> {
        match &self.own {
            Some(own) => own.clone(),
            None => builtin(names),
        }
    }

    /// Whether a body of `type_url` may hold a secret: its type is marked
    /// sensitive, or its descriptor holds a sensitive field, or it is not a
    /// type URL at all (`…Secret ` with a space is no type the gateway
    /// knows, and may be a secret all the same), or its message is named
    /// like one in any case (`…tls.v3.SECRET`, Envoy v2's
    /// `envoy.api.v2.auth.Secret`: types the gateway has no descriptor of,
    /// whose bytes would otherwise be previewed). Its bytes are then never
    /// shown.
    pub fn is_sensitive_type(&self, type_url: &str) -> bool {
        let Some(name) = type_name(type_url) else {
            return true;
        };
        self.sensitive_types.contains(type_url) || looks_secret(type_url, name) || self.knows_secrets_of(type_url)
    }

    /// Whether a few bytes of `value`, a body of `type_url` that does not
    /// decode, may be shown: its type holds no secret the gateway knows of
    /// ([`Self::is_sensitive_type`]), nor anything opaque (an `Any`, a
    /// Struct) that could carry one, and its bytes name no secret's type.
    /// Any other body (`google.protobuf.Any` itself, a `Cluster`) shows its
    /// size and why it does not decode, never its bytes: an `Any` written
    /// value first shows whatever it wraps in its first bytes. Nor is a
    /// body of a type the gateway has no descriptor for: what it holds
    /// cannot be told (give `--descriptors` to read it).
    pub fn previewable(&self, type_url: &str, value: &[u8]) -> bool {
        let Some(name) = type_name(type_url) else {
            return false;
        };
        let names_a_secret = ["secret", "bootstrap", "tlscertificate", "ticketkey"]
            .iter()
            .any(|needle| holds_ignoring_case(value, needle.as_bytes()))
            || self.sensitive_types.iter().any(|t| {
                let own = crate::collections::full_name(t).to_ascii_lowercase();
                holds_ignoring_case(value, own.as_bytes())
            });
        !names_a_secret
            && !self.is_sensitive_type(type_url)
            && self
                .descriptors(&[name])
                .pool
                .get_message_by_name(name)
                .is_some_and(|m| !holds_opaque_values(&m))
    }

    /// Whether the gateway knows which fields of a body of `type_url` hold
    /// secrets, so that a body of a sensitive collection may be shown with
    /// those fields `[redacted]` rather than hidden whole: its descriptor
    /// marks one (a `Secret`, a `Cluster`), as [`Redactor::body`] reads it.
    pub fn knows_secrets_of(&self, type_url: &str) -> bool {
        type_name(type_url).is_some_and(|name| self.descriptors(&[name]).sensitivity.holds_secrets(name))
    }

    /// The body's message as proto-JSON, its sensitive fields `[redacted]`;
    /// `Err` says why it cannot be read (no descriptor for its type, or
    /// bytes that do not decode as it).
    pub fn decode(&self, type_url: &str, value: &[u8]) -> Result<Value, String> {
        self.decode_redacted(type_url, value).map(|body| body.json)
    }

    /// [`BodyDecoder::decode`], with digests of what was redacted.
    pub fn decode_redacted(&self, type_url: &str, value: &[u8]) -> Result<RedactedBody, String> {
        let name = type_name(type_url).ok_or_else(|| {
            format!(
                "{:?} is not a type URL (a prefix, `/` and a message's full name, nothing else)",
                type_url.chars().take(200).collect::<String>()
            )
        })?;
        // The body's type, then each `Any`'s the body turns out to hold.
        let mut names = vec![name.to_owned()];
        let (descriptors, descriptor, mut json) = loop {
            let wanted: Vec<&str> = names.iter().map(String::as_str).collect();
            let descriptors = self.descriptors(&wanted);
            let descriptor = descriptors
                .pool
                .get_message_by_name(name)
                .ok_or_else(|| format!("no descriptor for {name} (give --descriptors FILE with it)"))?;
            let message = DynamicMessage::decode(descriptor.clone(), value)
                .map_err(|e| format!("{DOES_NOT_DECODE} {name}: {e}"))?;
            // Written as JSON, each `Any` is decoded inside the one holding
            // it: a chain of thousands would overflow the stack.
            if any_depth(&message, &descriptors.pool, 0) > MAX_ANY_DEPTH {
                return Err(format!(
                    "its Anys nest more than {MAX_ANY_DEPTH} deep: not read back (Envoy would not either)"
                ));
            }
            match serde_json::to_value(&message) {
                Ok(json) => break (descriptors, descriptor, json),
                Err(e) => {
                    let error = e.to_string();
                    // An `Any` of a type not decoded yet: again with it (a
                    // type tried once and still missing is not there).
                    match missing_type(&error) {
                        Some(missing) if self.own.is_none() && !names.iter().any(|n| n == missing) => {
                            names.push(missing.to_owned());
                        }
                        _ => return Err(format!("{name} has no JSON form: {error}")),
                    }
                }
            }
        };
        let mut redactor = Redactor {
            descriptors: &descriptors,
            sensitive_types: &self.sensitive_types,
            path: Vec::new(),
            secrets: BTreeMap::new(),
        };
        redactor.body(type_url, &descriptor, &mut json);
        Ok(RedactedBody {
            json,
            secrets: redactor.secrets,
        })
    }
}

/// Walks a body's proto-JSON beside its descriptor, replacing each
/// sensitive field's value.
struct Redactor<'a> {
    /// The pool the body was read with (an `Any`'s type is in it).
    descriptors: &'a Descriptors,
    sensitive_types: &'a HashSet<String>,
    path: Vec<PathStep>,
    secrets: BTreeMap<String, u64>,
}

impl Redactor<'_> {
    /// A body (or an `Any`'s value) of `type_url`: redacted whole if its
    /// type is marked sensitive and its descriptor marks no field.
    fn body(&mut self, type_url: &str, descriptor: &MessageDescriptor, json: &mut Value) {
        if self.sensitive_types.contains(type_url)
            && !self.descriptors.sensitivity.holds_secrets(descriptor.full_name())
        {
            self.redact(json);
        } else {
            self.message(descriptor, json);
        }
    }

    fn message(&mut self, descriptor: &MessageDescriptor, json: &mut Value) {
        if descriptor.full_name() == "google.protobuf.Any" {
            return self.any(json);
        }
        if is_typed_struct(descriptor.full_name()) {
            return self.typed_struct(json);
        }
        // The other well-known types hold no secret and have JSON forms of
        // their own (a Struct's keys are not its fields).
        if descriptor.package_name() == "google.protobuf" {
            return;
        }
        let Value::Object(fields) = json else {
            return;
        };
        for (key, value) in fields.iter_mut() {
            let Some(field) = field_named(descriptor, key) else {
                continue;
            };
            self.path.push(PathStep::Key(key.clone()));
            if self.descriptors.sensitivity.is_sensitive_field(&field) {
                self.redact(value);
            } else if let Kind::Message(inner) = field.kind() {
                match value {
                    Value::Object(entries) if field.is_map() => {
                        if let Kind::Message(values) = inner.map_entry_value_field().kind() {
                            for (entry, item) in entries.iter_mut() {
                                self.path.push(PathStep::Key(entry.clone()));
                                self.message(&values, item);
                                self.path.pop();
                            }
                        }
                    }
                    Value::Array(items) if field.is_list() => {
                        for (index, item) in items.iter_mut().enumerate() {
                            self.path.push(PathStep::Index(index));
                            self.message(&inner, item);
                            self.path.pop();
                        }
                    }
                    _ => self.message(&inner, value),
                }
            }
            self.path.pop();
        }
    }

    /// An `Any` is written `{"@type": ..., <its fields>}`, or `{"@type":
    /// ..., "value": <its JSON>}` for a well-known type.
    fn any(&mut self, json: &mut Value) {
        let Some(type_url) = json.get("@type").and_then(Value::as_str).map(str::to_owned) else {
            return;
        };
        let name = type_url.rsplit('/').next().unwrap_or(&type_url);
        // Writing the `Any` as JSON needed its type: the pool has it.
        let Some(inner) = self.descriptors.pool.get_message_by_name(name) else {
            return;
        };
        if is_typed_struct(inner.full_name()) {
            return self.typed_struct(json);
        }
        let marked_whole =
            self.sensitive_types.contains(&type_url) && !self.descriptors.sensitivity.holds_secrets(inner.full_name());
        if marked_whole {
            // Everything but the type is the marked message's.
            if let Value::Object(fields) = json {
                let mut held = std::mem::take(fields);
                let type_field = held.remove("@type").unwrap_or_default();
                let mut value = Value::Object(held);
                self.path.push(PathStep::Key("value".into()));
                self.redact(&mut value);
                self.path.pop();
                fields.insert("@type".into(), type_field);
                fields.insert("value".into(), value);
            }
        } else if inner.package_name() == "google.protobuf" {
            if let Some(value) = json.get_mut("value") {
                self.path.push(PathStep::Key("value".into()));
                self.message(&inner, value);
                self.path.pop();
            }
        } else {
            // `@type` is no field of the message: the walk passes it by.
            self.message(&inner, json);
        }
    }

    /// A TypedStruct, as an `Any`'s type or a body's own: Envoy reads its
    /// `value` as the type its `type_url` names, whose secrets then lie in
    /// a Struct, which marks none. Unless that type is known here and holds
    /// none, the value is hidden whole.
    fn typed_struct(&mut self, json: &mut Value) {
        let named = ["typeUrl", "type_url"]
            .iter()
            .find_map(|k| json.get(*k).and_then(Value::as_str))
            .map(|url| url.rsplit('/').next().unwrap_or(url).to_owned());
        let harmless = named.as_deref().is_some_and(|name| {
            message_type(&format!("{}{name}", crate::collections::TYPE_URL_PREFIX))
                .is_some_and(|m| !builtin_of(&m).sensitivity.holds_secrets(m.full_name()) && !holds_opaque_values(&m))
                && !self.sensitive_types.iter().any(|t| t.ends_with(&format!("/{name}")))
        });
        if !harmless {
            if let Some(value) = json.get_mut("value") {
                self.path.push(PathStep::Key("value".into()));
                self.redact(value);
                self.path.pop();
            }
        }
    }

    /// Replaces `value` with `[redacted]`, keeping a digest of it by path.
    fn redact(&mut self, value: &mut Value) {
        use std::hash::{Hash, Hasher};
        // Compared between two reads of one gateway, never shown: any
        // stable hash does.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        value.to_string().hash(&mut hasher);
        self.secrets.insert(display_path(&self.path), hasher.finish());
        *value = Value::String(REDACTED.to_owned());
    }
}

#[cfg(test)]
mod tests {

    /// Which types hold a secret as a typed field, whose bytes need not
    /// name it: a Bootstrap, not the config Envoy is served (whose secrets
    /// are in `Any`s, or named by SDS), which keeps the cheap path cheap.
    #[test]
    fn only_types_that_hold_a_secret_as_a_field_are_walked_without_a_needle() {
        let types = super::SecretTypes::of(&crate::collections::CollectionTable::builtin());
        for (name, holds) in [
            ("envoy.config.bootstrap.v3.Bootstrap", true),
            ("envoy.config.bootstrap.v3.Bootstrap.StaticResources", true),
            ("envoy.config.cluster.v3.Cluster", false),
            ("envoy.config.listener.v3.Listener", false),
            ("envoy.config.route.v3.RouteConfiguration", false),
            ("envoy.config.endpoint.v3.ClusterLoadAssignment", false),
            ("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext", false),
            ("istio.networking.v1alpha3.VirtualService", false),
            ("istio.networking.v1alpha3.EnvoyFilter", false),
            ("acme.v1.Unknown", false),
        ] {
            assert_eq!(types.holds_typed_secret(name), holds, "{name}");
        }
    }

    /// A type only a `--type-map` collection marked sensitive declares is a
    /// secret in any case, as Envoy's own secret types are (the
    /// twenty-third check of issue 42).
    #[test]
    fn a_sensitive_type_map_rows_type_is_a_secret_in_any_case() {
        let table = crate::collections::CollectionTable::builtin()
            .with_type_map_yaml("example.com/vault: {type_url: type.googleapis.com/acme.v1.Creds, sensitive: true}\n")
            .unwrap();
        let types = super::SecretTypes::of(&table);
        for url in [
            "type.googleapis.com/acme.v1.Creds",
            "type.googleapis.com/acme.v1.creds",
            "type.googleapis.com/ACME.V1.CREDS",
        ] {
            assert!(types.contains(url) && types.is_a_secret_itself(url), "{url}");
        }
        assert!(!types.contains("type.googleapis.com/acme.v1.Plain"));
    }

    /// Every built-in type that holds a secret as a typed field is in
    /// [`super::TYPED_SECRET_HOLDERS`], so that another version of it is
    /// refused unread.
    #[test]
    fn the_list_of_typed_secret_holders_is_the_descriptors() {
        let types = super::SecretTypes::of(&crate::collections::CollectionTable::builtin());
        let pool = super::pool();
        let mut holders: Vec<String> = pool
            .all_messages()
            .filter(|m| m.full_name().starts_with("envoy.") && types.holds_typed_secret(m.full_name()))
            .filter(|m| !crate::collections::named_like_key_material(m.full_name()))
            .map(|m| super::message_path(m.full_name()).unwrap().to_owned())
            .collect();
        holders.sort();
        holders.dedup();
        let mut listed: Vec<String> = super::TYPED_SECRET_HOLDERS.iter().map(|s| s.to_string()).collect();
        listed.sort();
        assert_eq!(holders, listed);
    }

    #[test]
    fn type_urls_are_read_exactly() {
        let secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
        assert_eq!(
            super::type_name(secret),
            Some("envoy.extensions.transport_sockets.tls.v3.Secret")
        );
        assert_eq!(super::type_name("example.com/x.Y_z"), Some("x.Y_z"));
        for not_one in [
            &format!("{secret} ")[..],
            &format!(" {secret}"),
            &format!("{secret}\n"),
            "type.googleapis.com/",
            "type.googleapis.com/a..b",
            "type.googleapis.com/a.1b",
            "type.googleapis.com/a-b",
            "",
        ] {
            assert_eq!(super::type_name(not_one), None, "{not_one:?}");
        }
        let bodies = super::BodyDecoder::new(None).unwrap();
        assert!(
            bodies.is_sensitive_type(&format!("{secret} ")),
            "a type URL that is not one may hide anything"
        );
        assert!(bodies.knows_secrets_of(secret));
        assert!(!bodies.knows_secrets_of(&format!("{secret} ")));
        assert!(!bodies.knows_secrets_of("type.googleapis.com/google.protobuf.Struct"));
    }

    use super::*;
    use serde_json::json;

    proptest::proptest! {
        /// A body lowercased and searched by `memmem` finds the needle the
        /// search for each needle's first letter in either case finds (the
        /// first of them in order), or none where that finds none; a body
        /// past the bound is left to that search. Bodies of the needles'
        /// letters in both cases and other bytes, so that they hold the
        /// needles and near misses.
        #[test]
        fn a_body_lowercased_holds_the_needles_the_search_in_any_case_finds(
            needles in proptest::collection::vec("[sectrb]{1,7}", 1..5),
            body in proptest::collection::vec(
                proptest::sample::select(b"sSeEcCrRtTbB\x00\xffz.".to_vec()),
                0..200,
            ),
            past in proptest::bool::ANY,
        ) {
            let mut needles: Vec<Vec<u8>> = needles.into_iter().map(String::into_bytes).collect();
            needles.sort();
            needles.dedup();
            let finders: Vec<_> = needles.iter().map(|n| memchr::memmem::Finder::new(n).into_owned()).collect();
            let body = if past {
                body.iter().copied().cycle().take(LOWERED_AT_MOST + 1 + body.len()).collect()
            } else {
                body
            };
            let each = needles.iter().position(|needle| holds_ignoring_case(&body, needle));
            let lowered = lowered_search(&body, &finders);
            if body.len() > LOWERED_AT_MOST {
                proptest::prop_assert_eq!(lowered, None);
            } else {
                proptest::prop_assert_eq!(lowered, Some(each));
            }
        }
    }

    /// The first path of fields from `message` to a sensitive field (fields
    /// in declaration order), to show why a type holds a secret.
    fn secret_path(sensitivity: &Sensitivity, message: &MessageDescriptor) -> Option<String> {
        if let Some(field) = message.fields().find(|f| sensitivity.is_sensitive_field(f)) {
            return Some(field.name().to_owned());
        }
        message.fields().find_map(|field| match field.kind() {
            Kind::Message(inner) if sensitivity.holds_secrets(inner.full_name()) && inner != *message => {
                Some(format!("{}.{}", field.name(), secret_path(sensitivity, &inner)?))
            }
            _ => None,
        })
    }

    #[test]
    fn sensitive_fields_are_read_from_the_descriptors_and_followed_through_fields() {
        let all = all_descriptors();
        let sensitivity = &all.sensitivity;
        let mut fields: Vec<&str> = sensitivity.fields.iter().map(String::as_str).collect();
        fields.sort_unstable();
        // Every field Envoy's v3 API marks (`grep -r 'sensitive) = true' proto/envoy`).
        assert_eq!(
            fields,
            [
                "envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials.private_key",
                "envoy.config.grpc_credential.v3.FileBasedMetadataConfig.secret_data",
                "envoy.config.trace.v3.ClientConfig.backend_token",
                "envoy.extensions.common.aws.v3.AssumeRoleWithWebIdentityCredentialProvider.web_identity_token_data_source",
                "envoy.extensions.common.aws.v3.CredentialsFileCredentialProvider.credentials_data_source",
                "envoy.extensions.common.aws.v3.IAMRolesAnywhereCredentialProvider.private_key",
                "envoy.extensions.common.aws.v3.InlineCredentialProvider.secret_access_key",
                "envoy.extensions.common.aws.v3.InlineCredentialProvider.session_token",
                "envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth.credentials",
                "envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuthPerRoute.credentials",
                "envoy.extensions.filters.http.basic_auth.v3.BasicAuth.users",
                "envoy.extensions.filters.http.basic_auth.v3.BasicAuthPerRoute.users",
                "envoy.extensions.filters.http.ext_authz.v3.CheckSettings.context_extensions",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProtocolOptions.Credential.auth_password",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProtocolOptions.Credential.auth_username",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProtocolOptions.auth_password",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProtocolOptions.auth_username",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProxy.downstream_auth_password",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProxy.downstream_auth_passwords",
                "envoy.extensions.filters.network.redis_proxy.v3.RedisProxy.downstream_auth_username",
                "envoy.extensions.grpc_service.call_credentials.file_based_metadata.v3.FileBasedMetadataCallCredentials.secret_data",
                "envoy.extensions.transport_sockets.tls.v3.GenericSecret.secret",
                "envoy.extensions.transport_sockets.tls.v3.GenericSecret.secrets",
                "envoy.extensions.transport_sockets.tls.v3.PrivateKeyProvider.typed_config",
                "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.password",
                "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.pkcs12",
                "envoy.extensions.transport_sockets.tls.v3.TlsCertificate.private_key",
                "envoy.extensions.transport_sockets.tls.v3.TlsSessionTicketKeys.keys",
            ]
        );
        // Every Envoy resource type reaches one through plain fields: a
        // `ConfigSource` may name a Google gRPC service whose SSL
        // credentials carry a private key. (A Listener's TLS context is an
        // `Any`, not followed; its config discovery's `ConfigSource` is.)
        let grpc_key = "api_config_source.grpc_services.google_grpc.channel_credentials.ssl_credentials.private_key";
        for (message, path) in [
            (
                "envoy.extensions.transport_sockets.tls.v3.Secret",
                "tls_certificate.private_key".to_owned(),
            ),
            (
                "envoy.config.cluster.v3.Cluster",
                format!("eds_cluster_config.eds_config.{grpc_key}"),
            ),
            (
                "envoy.config.listener.v3.Listener",
                format!("filter_chains.filters.config_discovery.config_source.{grpc_key}"),
            ),
            (
                "envoy.config.route.v3.RouteConfiguration",
                format!("vhds.config_source.{grpc_key}"),
            ),
            (
                "envoy.config.endpoint.v3.ClusterLoadAssignment",
                format!("endpoints.leds_cluster_locality_config.leds_config.{grpc_key}"),
            ),
        ] {
            let descriptor = pool().get_message_by_name(message).unwrap();
            assert!(sensitivity.holds_secrets(message), "{message}");
            assert_eq!(
                secret_path(sensitivity, &descriptor).as_deref(),
                Some(&*path),
                "{message}"
            );
        }
        for message in [
            "google.protobuf.Any",
            "envoy.config.core.v3.Node",
            "istio.networking.v1alpha3.VirtualService",
            "istio.networking.v1alpha3.DestinationRule",
            "istio.networking.v1alpha3.Gateway",
            "istio.networking.v1alpha3.EnvoyFilter",
            "istio.security.v1beta1.RequestAuthentication",
        ] {
            assert!(!sensitivity.holds_secrets(message), "{message}");
        }
    }

    const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nTUlJRXZRSUJBREFOQmdrcWhraUc5dzBC\n-----END PRIVATE KEY-----\n";

    #[test]
    fn a_typed_struct_body_hides_its_value_as_a_nested_one_does() {
        let decoder = BodyDecoder::new(None).unwrap();
        for typed_struct in [
            "type.googleapis.com/xds.type.v3.TypedStruct",
            "type.googleapis.com/udpa.type.v1.TypedStruct",
        ] {
            for (named, hidden) in [
                (SECRET, true),
                (
                    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    true,
                ),
                ("type.googleapis.com/example.Unknown", true),
                // What can hold what no descriptor marks: a TypedStruct, an
                // `Any`, a type with an `Any` inside.
                ("type.googleapis.com/xds.type.v3.TypedStruct", true),
                ("type.googleapis.com/google.protobuf.Any", true),
                ("type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig", true),
                ("type.googleapis.com/envoy.config.listener.v3.Filter", true),
                ("type.googleapis.com/envoy.config.core.v3.SocketAddress", false),
            ] {
                let body = encode(
                    typed_struct,
                    json!({"type_url": named, "value": {"private_key": {"inline_string": KEY}}}),
                )
                .unwrap();
                let read = decoder.decode_redacted(typed_struct, &body).unwrap();
                let shown = read.json.to_string();
                assert_eq!(
                    read.json["value"] == REDACTED,
                    hidden,
                    "{typed_struct} of {named}: {shown}"
                );
                assert_eq!(read.json["typeUrl"], named, "{shown}");
                if !hidden {
                    assert_eq!(read.json["value"]["private_key"]["inline_string"], KEY, "{shown}");
                }
            }
        }
    }

    #[test]
    fn sensitive_fields_read_redacted_at_any_depth_in_lists_maps_and_any() {
        let decoder = BodyDecoder::new(None).unwrap();
        let secret = encode(
            SECRET,
            json!({
                "name": "server-cert",
                "tls_certificate": {
                    "certificate_chain": {"inline_string": "CERT"},
                    "private_key": {"inline_string": KEY},
                    "password": {"filename": "/etc/password"},
                },
            }),
        )
        .unwrap();
        let read = decoder.decode_redacted(SECRET, &secret).unwrap();
        assert_eq!(
            read.json,
            json!({
                "name": "server-cert",
                "tlsCertificate": {
                    "certificateChain": {"inlineString": "CERT"},
                    "privateKey": REDACTED,
                    "password": REDACTED,
                },
            })
        );
        assert_eq!(
            read.secrets.keys().collect::<Vec<_>>(),
            ["tlsCertificate.password", "tlsCertificate.privateKey"]
        );
        assert!(decoder.is_sensitive_type(SECRET));

        // Lists and maps: a sensitive field is redacted whole.
        let generic = encode(
            SECRET,
            json!({"name": "g", "generic_secret": {"secrets": {"a": {"inline_string": KEY}}}}),
        )
        .unwrap();
        let json = decoder.decode(SECRET, &generic).unwrap();
        assert_eq!(json["genericSecret"]["secrets"], REDACTED);
        let tickets = encode(
            SECRET,
            json!({"name": "t", "session_ticket_keys": {"keys": [{"inline_bytes": "a2V5"}, {"inline_string": KEY}]}}),
        )
        .unwrap();
        assert_eq!(
            decoder.decode(SECRET, &tickets).unwrap()["sessionTicketKeys"]["keys"],
            REDACTED
        );

        // Inside an `Any`: a Listener's TLS context, in a list of filter chains.
        let listener_url = "type.googleapis.com/envoy.config.listener.v3.Listener";
        let listener = encode(
            listener_url,
            json!({
                "name": "https",
                "filter_chains": [{"transport_socket": {"name": "tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "common_tls_context": {"tls_certificates": [{
                        "certificate_chain": {"inline_string": "CERT"},
                        "private_key": {"inline_string": KEY},
                    }]},
                }}}],
            }),
        )
        .unwrap();
        let read = decoder.decode_redacted(listener_url, &listener).unwrap();
        let text = read.json.to_string();
        assert!(!text.contains("TUlJRXZR"), "{text}");
        let context = &read.json["filterChains"][0]["transportSocket"]["typedConfig"];
        assert_eq!(
            context["commonTlsContext"]["tlsCertificates"][0]["privateKey"], REDACTED,
            "{text}"
        );
        assert_eq!(
            context["commonTlsContext"]["tlsCertificates"][0]["certificateChain"]["inlineString"],
            "CERT"
        );
        assert_eq!(
            read.secrets.keys().collect::<Vec<_>>(),
            ["filterChains[0].transportSocket.typedConfig.commonTlsContext.tlsCertificates[0].privateKey"]
        );

        // A changed key changes its digest, and nothing else shown.
        let other = encode(
            SECRET,
            json!({
                "name": "server-cert",
                "tls_certificate": {
                    "certificate_chain": {"inline_string": "CERT"},
                    "private_key": {"inline_string": "another key"},
                    "password": {"filename": "/etc/password"},
                },
            }),
        )
        .unwrap();
        let (one, two) = (
            decoder.decode_redacted(SECRET, &secret).unwrap(),
            decoder.decode_redacted(SECRET, &other).unwrap(),
        );
        assert_eq!(one.json, two.json);
        assert_ne!(
            one.secrets["tlsCertificate.privateKey"],
            two.secrets["tlsCertificate.privateKey"]
        );
        assert_eq!(
            one.secrets["tlsCertificate.password"],
            two.secrets["tlsCertificate.password"]
        );

        // Bodies without secrets read as before.
        let cluster_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let cluster = encode(cluster_url, json!({"name": "backend"})).unwrap();
        let read = decoder.decode_redacted(cluster_url, &cluster).unwrap();
        assert_eq!((read.json, read.secrets.len()), (json!({"name": "backend"}), 0));
    }

    /// An `Any` whose type is `Any` holds the inner one under `value`: read
    /// as such, never as itself again (that recursed until the stack
    /// overflowed, ending `check` and the gateway: issue 42's seventh check).
    #[test]
    fn an_any_of_an_any_reads_and_ends() {
        const ANY: &str = "type.googleapis.com/google.protobuf.Any";
        let wrapped =
            json!({"@type": ANY, "value": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "ok"}});
        assert!(encode(ANY, wrapped.clone()).is_ok());
        assert!(encode(ANY, json!({"@type": ANY})).is_err());
        let cluster = json!({"name": "c", "transport_socket": {"name": "t", "typed_config": wrapped}});
        assert!(encode("type.googleapis.com/envoy.config.cluster.v3.Cluster", cluster).is_ok());
        let mut deep = json!({"@type": ANY});
        for _ in 0..200 {
            deep = json!({"@type": ANY, "value": deep});
        }
        let _ = encode(ANY, deep);
    }

    /// A body whose `Any`s nest thousands deep (as `value_base64`: it is
    /// never read at the source) is not read back for a view: written as
    /// JSON each is decoded inside the one holding it, and a chain of 2,000
    /// overflowed the stack of the request's worker (issue 42's eighth
    /// check).
    #[test]
    fn a_body_of_anys_nested_thousands_deep_is_not_read_back() {
        use prost::Message as _;
        const ANY: &str = "type.googleapis.com/google.protobuf.Any";
        let mut any = prost_types::Any {
            type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
            value: "ok".to_owned().encode_to_vec(),
        };
        for _ in 0..2000 {
            any = prost_types::Any {
                type_url: ANY.into(),
                value: any.encode_to_vec(),
            };
        }
        let bodies = BodyDecoder::new(None).unwrap();
        let why = bodies.decode(ANY, &any.encode_to_vec()).unwrap_err();
        assert!(why.contains(&format!("more than {MAX_ANY_DEPTH} deep")), "{why}");
        // A few levels read.
        let shallow = prost_types::Any {
            type_url: ANY.into(),
            value: prost_types::Any {
                type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                value: "ok".to_owned().encode_to_vec(),
            }
            .encode_to_vec(),
        };
        assert!(bodies.decode(ANY, &shallow.encode_to_vec()).is_ok());
    }

    #[test]
    fn errors_about_a_secret_name_its_path_never_its_value() {
        let pem = "-----BEGIN PRIVATE KEY-----\nTUlJRXZRSUJBREFOQmdrcWhraUc5dzBC\n-----END PRIVATE KEY-----\n";
        for (body, path) in [
            (
                json!({"name": "s", "tls_certificate": {"private_key": pem}}),
                "tls_certificate.private_key",
            ),
            (
                json!({"name": "s", "tls_certificate": {"private_key": {"inline_string": 5}}}),
                "tls_certificate.private_key.inline_string",
            ),
            (
                json!({"name": "s", "generic_secret": {"secrets": {"a": pem}}}),
                // A sensitive map's keys are its text too (issue 42's
                // sixth check: ext_authz's context_extensions).
                "generic_secret.secrets.[redacted]",
            ),
            (
                json!({"name": "s", "session_ticket_keys": {"keys": [pem]}}),
                "session_ticket_keys.keys[0]",
            ),
        ] {
            let err = encode(SECRET, body).unwrap_err();
            let shown = err.to_string();
            assert_eq!(display_path(&err.path), path, "{shown}");
            assert!(!shown.contains("TUlJRXZR") && !shown.contains('5'), "{shown}");
            assert!(shown.contains(REDACTED), "{shown}");
        }
        // Inside an `Any`, where the reader's path stops at the `Any`.
        let err = encode(
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            json!({"name": "l", "filter_chains": [{"transport_socket": {"name": "tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                "common_tls_context": {"tls_certificates": [{"private_key": pem}]},
            }}}]}),
        )
        .unwrap_err();
        assert!(!err.to_string().contains("TUlJRXZR"), "{err}");
        assert!(
            display_path(&err.path).starts_with("filter_chains[0].transport_socket.typed_config"),
            "{err}"
        );
        // A value of a field that is no secret is still quoted.
        let err = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            json!({"name": "c", "connect_timeout": "soon"}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("soon"), "{err}");
        assert_eq!(
            redact_quoted(r#"invalid type: string "a \"b\" c", expected `x` or y"#),
            "invalid type: string [redacted], expected [redacted] or y"
        );
        assert_eq!(
            redact_quoted("invalid base64: Invalid symbol 33, offset 16."),
            "invalid base64: Invalid symbol [redacted], offset 16."
        );
        assert_eq!(
            redact_quoted("unrecognized enum value 'HUNTER2' (Envoy's words)"),
            "unrecognized enum value [redacted]s words)",
            "to the last quote: what it quotes is not escaped"
        );
        // A quote inside the value (issue 42's fourth check: `'x'` was
        // taken for the whole value, the rest shown).
        assert_eq!(
            redact_quoted("trust_chain_verification: unrecognized enum value 'x'MARKER-E13'"),
            "trust_chain_verification: unrecognized enum value [redacted]"
        );
        assert_eq!(redact_quoted("value 'unclosed MARKER"), "value [redacted]");
        assert_eq!(
            redact_quoted("invalid type: integer `9876`, expected `x` or `y`"),
            "invalid type: integer [redacted]"
        );
    }

    /// A `google.protobuf.Struct` of one string, encoded.
    fn one_string_struct(key: &str, value: &str) -> Vec<u8> {
        prost::Message::encode_to_vec(&prost_types::Struct {
            fields: [(
                key.to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(value.into())),
                },
            )]
            .into(),
        })
    }

    /// What keys a resource's versions in an open collection: what the
    /// views hide, through an `Any` too; nothing else is decoded.
    #[test]
    fn a_body_the_views_hide_in_part_is_found_and_others_are_not() {
        use super::hidden_in_part;
        const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let cluster = |tls: serde_json::Value| {
            encode(
                CLUSTER,
                serde_json::json!({"name": "c", "transport_socket": {"name": "tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": tls}}}),
            )
            .unwrap()
        };
        let password = cluster(serde_json::json!({"tls_certificates": [{"password": {"inline_string": "pw"}}]}));
        let ca = cluster(serde_json::json!({"validation_context": {"trusted_ca": {"filename": "/ca.pem"}}}));
        assert!(hidden_in_part(CLUSTER, &password));
        assert!(!hidden_in_part(CLUSTER, &ca));
        // Deeper: a listener's filter chain's TLS context, its key inline.
        const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
        let listener = encode(
            LISTENER,
            serde_json::json!({"name": "l", "filter_chains": [{"transport_socket": {"name": "tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                "common_tls_context": {"tls_certificates": [{"private_key": {"inline_string": "k"}}]}}}}]}),
        )
        .unwrap();
        assert!(hidden_in_part(LISTENER, &listener));
        // Endpoints: walked, nothing marked.
        const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
        let cla = encode(
            CLA,
            serde_json::json!({"cluster_name": "c", "endpoints": [{"lb_endpoints": [{"endpoint": {"address":
                {"socket_address": {"address": "10.0.0.1", "port_value": 80}}}}]}]}),
        )
        .unwrap();
        assert!(!hidden_in_part(CLA, &cla));
        // An `Any` of a type only --descriptors could read.
        let unknown = unknown_any("acme.v1.Options");
        // Cluster.typed_extension_protocol_options (field 36), a map entry
        // of a key and that `Any`.
        let mut entry = vec![0x0a, 1, b'k', 0x12, unknown.len() as u8];
        entry.extend_from_slice(&unknown);
        let mut options = vec![0xa2, 0x02, entry.len() as u8];
        options.extend_from_slice(&entry);
        assert!(hidden_in_part(CLUSTER, &options), "shown by its size");
        let vs = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
        let body = encode(vs, serde_json::json!({"hosts": ["a/b"]})).unwrap();
        assert!(!hidden_in_part(vs, &body), "Istio's kinds hold none");
        let structure = "type.googleapis.com/google.protobuf.Struct";
        let body = encode(structure, serde_json::json!({"a": "b"})).unwrap();
        assert!(!hidden_in_part(structure, &body));
        // A type no built-in descriptor has, a body that does not read:
        // shown by their size.
        assert!(hidden_in_part("type.googleapis.com/acme.v1.Thing", b"x"));
        assert!(hidden_in_part("no type url", b"x"));
        assert!(hidden_in_part(CLUSTER, b"\x0a\xff"));
        // A TypedStruct: its value is shown [redacted] whole.
        let typed = cluster_typed_struct();
        assert!(hidden_in_part(CLUSTER, &typed));
    }

    /// An encoded `Any` of `name`, a type no built-in descriptor has.
    fn unknown_any(name: &str) -> Vec<u8> {
        let any = crate::proto::wire::AnyBytes {
            type_url: format!("type.googleapis.com/{name}"),
            value: bytes::Bytes::from_static(b"\x0a\x01x"),
        };
        prost::Message::encode_to_vec(&any)
    }

    /// A type's walk is planned once and shared; a type that holds itself
    /// (a matcher's `on_match` holds a matcher) is planned as a cycle, and a
    /// body nested in it is walked to any depth the wire has.
    #[test]
    fn a_types_walk_is_planned_once_and_follows_a_type_that_holds_itself() {
        use super::{hidden_in_part, Look, WalkPlan};
        const CLUSTER: &str = "envoy.config.cluster.v3.Cluster";
        let plan = WalkPlan::of(CLUSTER).unwrap();
        assert!(Arc::ptr_eq(&plan, &WalkPlan::of(CLUSTER).unwrap()));
        assert!(plan.walked);
        assert!(WalkPlan::of("acme.v1.NoSuchType").is_none());
        let endpoints = WalkPlan::of("envoy.config.endpoint.v3.ClusterLoadAssignment").unwrap();
        assert!(endpoints.walked, "an endpoint's metadata holds Anys");
        let plain = WalkPlan::of("envoy.config.core.v3.SocketAddress").unwrap();
        assert!(!plain.walked && plain.messages.len() == 1 && plain.messages[0].fields.is_empty());

        const MATCHER: &str = "xds.type.matcher.v3.Matcher";
        let matcher = WalkPlan::of(MATCHER).unwrap();
        let back = matcher
            .messages
            .iter()
            .flat_map(|message| &message.fields)
            .any(|&(_, look)| matches!(look, Look::Into(0)));
        assert!(back, "a look leads back to the matcher itself");
        // Matcher{on_no_match: OnMatch{matcher: Matcher{on_no_match:
        // OnMatch{action: TypedExtensionConfig{typed_config: Any}}}}}, the
        // innermost `Any` of a type no built-in descriptor has.
        let nest = |field: u8, inner: Vec<u8>| [vec![field, inner.len() as u8], inner].concat();
        let unknown = unknown_any("acme.v1.Action");
        let action = nest(0x12, nest(0x12, unknown)); // OnMatch.action.typed_config
        let deep = nest(0x1a, nest(0x0a, nest(0x1a, action))); // Matcher.on_no_match.matcher.on_no_match
        let url = format!("type.googleapis.com/{MATCHER}");
        assert!(hidden_in_part(&url, &deep), "the Any two matchers down is found");
        // The same nesting with the action's Any left out hides nothing.
        let bare = nest(0x1a, nest(0x0a, nest(0x1a, nest(0x12, Vec::new()))));
        assert!(!hidden_in_part(&url, &bare));
    }

    /// The plans are kept for the life of the process, one per type a body
    /// or an `Any` in one named: with every built-in type planned (what a
    /// source naming each of them in turn would leave), they hold under a
    /// MiB.
    #[test]
    fn every_built_in_types_walk_planned_is_under_a_mebibyte() {
        use super::{Look, MessageWalk, WalkPlan};
        let pool = super::all_descriptors().pool.clone();
        let mut bytes = 0;
        for message in pool.all_messages() {
            let plan = WalkPlan::of(message.full_name()).unwrap();
            let looks: usize = plan.messages.iter().map(|walk| walk.fields.len()).sum();
            bytes += std::mem::size_of::<WalkPlan>()
                + message.full_name().len()
                + plan.messages.len() * std::mem::size_of::<MessageWalk>()
                + looks * std::mem::size_of::<(u32, Look)>();
        }
        assert!(pool.all_messages().count() > 1_000, "Envoy's API and Istio's kinds");
        assert!(bytes < 1 << 20, "{bytes} B of plans");
    }

    /// A map written from YAML or JSON (a `Struct`'s fields, at any depth and
    /// inside an `Any`) is encoded in one order, whatever the hash map's:
    /// the same file makes the same bytes, and version, on every replica.
    #[test]
    fn maps_are_encoded_in_the_order_of_their_bytes() {
        let fields: serde_json::Map<String, serde_json::Value> = (0..20)
            .map(|i| {
                (
                    format!("k{i:02}"),
                    serde_json::json!({"n": i, "inner": {"z": 1, "a": 2}}),
                )
            })
            .collect();
        let structure = serde_json::Value::Object(fields);
        let ordered = |bytes: &[u8]| {
            let at = |needle: &[u8]| bytes.windows(needle.len()).position(|w| w == needle);
            (0..20)
                .map(|i| at(format!("k{i:02}").as_bytes()).unwrap())
                .collect::<Vec<_>>()
                .windows(2)
                .all(|w| w[0] < w[1])
        };
        let first = encode("type.googleapis.com/google.protobuf.Struct", structure.clone()).unwrap();
        assert!(ordered(&first));
        // Inside an `Any` (a TypedStruct in a cluster's transport socket).
        let cluster = serde_json::json!({"name": "c", "transport_socket": {"name": "t", "typed_config": {
            "@type": "type.googleapis.com/xds.type.v3.TypedStruct", "type_url": "x/y", "value": structure}}});
        let url = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let wrapped = encode(url, cluster.clone()).unwrap();
        assert!(ordered(&wrapped));
        for _ in 0..10 {
            assert_eq!(encode(url, cluster.clone()).unwrap(), wrapped);
        }
        let back = BodyDecoder::new(None).unwrap().decode(url, &wrapped).unwrap();
        assert_eq!(
            back["transportSocket"]["typedConfig"]["@type"],
            "type.googleapis.com/xds.type.v3.TypedStruct"
        );
    }

    /// A cluster whose transport socket is a TypedStruct of a TLS context.
    fn cluster_typed_struct() -> Vec<u8> {
        encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            serde_json::json!({"name": "c", "transport_socket": {"name": "tls", "typed_config": {
                "@type": "type.googleapis.com/xds.type.v3.TypedStruct",
                "type_url": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "value": {"sni": "x"}}}}),
        )
        .unwrap()
    }

    #[test]
    fn a_type_marked_sensitive_without_marked_fields_reads_redacted_whole() {
        let route_url = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
        let struct_url = "type.googleapis.com/google.protobuf.Struct";
        let decoder = BodyDecoder::new(None)
            .unwrap()
            .with_sensitive_types([struct_url.to_owned(), route_url.to_owned()]);
        let structure = one_string_struct("token", "hunter2");
        let read = decoder.decode_redacted(struct_url, &structure).unwrap();
        assert_eq!(read.json, json!(REDACTED));
        assert_eq!(read.secrets.keys().collect::<Vec<_>>(), [""]);
        assert!(decoder.is_sensitive_type(struct_url));
        assert!(!BodyDecoder::new(None).unwrap().is_sensitive_type(struct_url));
        // A type whose descriptor marks fields is redacted field by field.
        let route = encode(route_url, json!({"name": "r"})).unwrap();
        assert_eq!(decoder.decode(route_url, &route).unwrap(), json!({"name": "r"}));
    }

    #[test]
    fn misspelt_fields_and_enum_values_name_the_closest_and_every_error_is_found() {
        assert_eq!(edit_distance("hots", "host"), 1, "a swap is one edit");
        assert_eq!(edit_distance("timout", "timeout"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(closest("timout", ["timeout", "retries"]), Some("timeout"));
        assert_eq!(closest("STRICTT", ["STRICT", "PERMISSIVE"]), Some("STRICT"));
        assert_eq!(closest("zzz", ["timeout"]), None, "too far to be meant");
        assert_eq!(closest("ab", ["ac", "ad"]), None, "two as close: neither is named");
        let route = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
        let body = json!({"hosts": ["r"], "http": [{"timout": "5s", "route": [{"destination": {"hots": "r"}}]}]});
        let errors = encode_all(route, body.clone(), 10).unwrap_err();
        let shown: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "http[0].timout: unrecognized field name 'timout' (did you mean 'timeout'?)",
                "http[0].route[0].destination.hots: unrecognized field name 'hots' (did you mean 'host'?)",
            ]
        );
        // One asked for: the first alone, as the served source reads.
        assert_eq!(encode_all(route, body, 1).unwrap_err().len(), 1);
        let peer = "type.googleapis.com/istio.security.v1beta1.PeerAuthentication";
        let err = encode(peer, json!({"mtls": {"mode": "STRICTT"}})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "mtls.mode: unrecognized enum value 'STRICTT' (did you mean 'STRICT'?)"
        );
        // A field of an `Any`, by its proto name.
        let err = encode(
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            listener_with_http_filter(json!({
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                "suppress_envoy_header": true,
            })),
        )
        .unwrap_err();
        assert!(
            err.message.contains("(did you mean 'suppress_envoy_headers'?)"),
            "{err}"
        );
    }

    #[test]
    fn a_path_of_json_names_reads_by_proto_names() {
        let listener = "type.googleapis.com/envoy.config.listener.v3.Listener";
        let json = json!({"filterChains": [{"filters": [{"typedConfig": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "statPrefix": "s"}}]}]});
        let path: Vec<PathStep> = ["filterChains", "0", "filters", "0", "typedConfig", "statPrefix", "x"]
            .iter()
            .map(|s| s.parse().map_or_else(|_| PathStep::Key(s.to_string()), PathStep::Index))
            .collect();
        assert_eq!(
            display_path(&proto_path(listener, &json, &path)),
            "filter_chains[0].filters[0].typed_config.stat_prefix.x"
        );
    }

    #[test]
    fn a_cluster_reads_as_envoy_writes_it() {
        let bytes = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            json!({
                "name": "backend",
                "connect_timeout": "0.25s",
                "type": "EDS",
                "edsClusterConfig": {"edsConfig": {"ads": {}, "resourceApiVersion": "V3"}},
            }),
        )
        .unwrap();
        let pool = pool();
        let cluster = DynamicMessage::decode(
            pool.get_message_by_name("envoy.config.cluster.v3.Cluster").unwrap(),
            &bytes[..],
        )
        .unwrap();
        assert_eq!(cluster.get_field_by_name("name").unwrap().as_str(), Some("backend"));
    }

    #[test]
    fn bodies_decode_back_to_json() {
        let decoder = BodyDecoder::new(None).unwrap();
        let cluster = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            json!({"name": "backend", "connect_timeout": "0.25s"}),
        )
        .unwrap();
        let json = decoder
            .decode("type.googleapis.com/envoy.config.cluster.v3.Cluster", &cluster)
            .unwrap();
        assert_eq!(json, json!({"name": "backend", "connectTimeout": "0.250s"}));
        let structure = one_string_struct("hosts", "a");
        let json = decoder
            .decode("type.googleapis.com/google.protobuf.Struct", &structure)
            .unwrap();
        assert_eq!(json, json!({"hosts": "a"}));
        let err = decoder
            .decode("type.googleapis.com/istio.policy.v1beta1.Handler", b"")
            .unwrap_err();
        assert!(err.contains("--descriptors"), "{err}");
        // An operator's set: the MCP protos' own descriptors, for instance.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("set.pb");
        std::fs::write(&file, include_bytes!(concat!(env!("OUT_DIR"), "/mcp_descriptor.bin"))).unwrap();
        let with = BodyDecoder::new(Some(&file)).unwrap();
        let metadata = prost::Message::encode_to_vec(&crate::proto::Metadata {
            name: "ns/a".into(),
            ..Default::default()
        });
        let json = with.decode("istio.mcp.v1alpha1.Metadata", &metadata).unwrap();
        assert_eq!(json["name"], "ns/a");
        std::fs::write(&file, b"not a descriptor set").unwrap();
        assert!(BodyDecoder::new(Some(&file)).unwrap_err().contains("FileDescriptorSet"));
    }

    #[test]
    fn errors_name_the_field() {
        let err = encode(
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            json!({
                "name": "l",
                "filter_chains": [{"filters": [{"name": "x", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "s",
                    "clutser": "c",
                }}]}],
            }),
        )
        .unwrap_err();
        assert_eq!(
            display_path(&err.path),
            "filter_chains[0].filters[0].typed_config.clutser",
            "{err}"
        );
        assert!(err.message.contains("clutser"), "{err}");

        let err = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            json!({"connect_timeout": 5}),
        )
        .unwrap_err();
        assert_eq!(display_path(&err.path), "connect_timeout", "{err}");

        let err = encode("type.googleapis.com/example.Unknown", json!({})).unwrap_err();
        assert!(err.message.contains("value_base64"), "{err}");
    }

    /// A listener whose connection manager holds `filter` as its one HTTP
    /// filter's `typed_config`.
    fn listener_with_http_filter(filter: Value) -> Value {
        json!({
            "name": "l",
            "filter_chains": [{"filters": [{"name": "hcm", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "s",
                "access_log": [{"name": "file", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": "/dev/null",
                }}],
                "http_filters": [{"name": "f", "typed_config": filter}],
            }}]}],
        })
    }

    #[test]
    fn any_extension_of_envoys_api_reads_and_a_type_of_none_is_named() {
        let listener_url = "type.googleapis.com/envoy.config.listener.v3.Listener";
        for filter in [
            json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                   "default_source_code": {"inline_string": "function envoy_on_request(h) end"}}),
            json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
                   "grpc_service": {"envoy_grpc": {"cluster_name": "authz"}, "timeout": "250ms"}}),
            json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
                   "providers": {"p": {"issuer": "i", "local_jwks": {"inline_string": "{}"}}}}),
            // CNCF xds's TypedStruct, as Wasm and Go filters are configured.
            json!({"@type": "type.googleapis.com/xds.type.v3.TypedStruct",
                   "type_url": "type.googleapis.com/example.Config", "value": {"k": "v"}}),
        ] {
            let bytes = encode(listener_url, listener_with_http_filter(filter.clone()))
                .unwrap_or_else(|e| panic!("{filter}: {e}"));
            let back = BodyDecoder::new(None).unwrap().decode(listener_url, &bytes).unwrap();
            let hcm = &back["filterChains"][0]["filters"][0]["typedConfig"];
            assert_eq!(hcm["httpFilters"][0]["typedConfig"]["@type"], filter["@type"], "{back}");
            assert_eq!(hcm["accessLog"][0]["typedConfig"]["path"], "/dev/null", "{back}");
        }
        // The dynamic forward proxy's cluster, which protox reads only with
        // its relative name written out (build.rs, PROTOC_NAMES).
        let cluster = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            json!({"name": "dfp", "cluster_type": {"name": "envoy.clusters.dynamic_forward_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.dynamic_forward_proxy.v3.ClusterConfig",
                "dns_cache_config": {"name": "cache", "dns_lookup_family": "V4_ONLY"},
            }}}),
        );
        assert!(cluster.is_ok(), "{cluster:?}");

        let err = encode(
            listener_url,
            listener_with_http_filter(
                json!({"@type": "type.googleapis.com/envoy.extensions.filters.http.nosuch.v3.NoSuch"}),
            ),
        )
        .unwrap_err();
        assert_eq!(
            display_path(&err.path),
            "filter_chains[0].filters[0].typed_config.http_filters[0].typed_config",
            "{err}"
        );
        assert!(
            err.message
                .starts_with("@type names envoy.extensions.filters.http.nosuch.v3.NoSuch, not a type this gateway"),
            "{err}"
        );
        assert!(err.message.contains("value_base64"), "{err}");
    }

    #[test]
    fn istios_kinds_read_with_istios_descriptors_alone() {
        let route = message_type("type.googleapis.com/istio.networking.v1alpha3.VirtualService").unwrap();
        assert!(route.parent_pool() == istio_pool());
        assert!(istio_pool()
            .get_message_by_name("envoy.config.listener.v3.Listener")
            .is_none());
        let listener = message_type("type.googleapis.com/envoy.config.listener.v3.Listener").unwrap();
        assert!(listener.parent_pool() != istio_pool());
    }

    #[test]
    fn durations_read_as_go_and_as_proto_json_write_them() {
        for (written, proto_json) in [
            ("300s", "300s"),
            ("5m", "300s"),
            ("1h", "3600s"),
            ("1h30m", "5400s"),
            ("300ms", "0.3s"),
            ("0.25s", "0.25s"),
            ("1.5h", "5400s"),
            ("1m0.5s", "60.5s"),
            ("2us", "0.000002s"),
            ("7ns", "0.000000007s"),
            ("-5s", "-5s"),
            ("0", "0s"),
        ] {
            let got = proto_json_duration(written).unwrap_or_else(|e| panic!("{written}: {e}"));
            assert_eq!(got, proto_json, "{written}");
            // What prost-reflect reads.
            encode(
                "type.googleapis.com/istio.networking.v1alpha3.HTTPRoute",
                json!({"timeout": written}),
            )
            .unwrap_or_else(|e| panic!("{written}: {e}"));
        }
        for bad in ["", "5", "5x", "m", "1..5s", "h1", "99999999999999h", "1e3s"] {
            let err = proto_json_duration(bad).unwrap_err();
            assert!(err.contains("duration"), "{bad}: {err}");
        }
    }

    #[test]
    fn istio_kinds_read_with_go_durations_and_name_the_failing_field() {
        let route = json!({
            "hosts": ["reviews"],
            "http": [{
                "timeout": "5m",
                "retries": {"attempts": 3, "per_try_timeout": "300ms"},
                "route": [{"destination": {"host": "reviews", "subset": "v1"}}],
            }],
        });
        let bytes = encode(
            "type.googleapis.com/istio.networking.v1alpha3.VirtualService",
            route.clone(),
        )
        .unwrap();
        let message = DynamicMessage::decode(
            pool()
                .get_message_by_name("istio.networking.v1alpha3.VirtualService")
                .unwrap(),
            &bytes[..],
        )
        .unwrap();
        let back = serde_json::to_value(&message).unwrap();
        assert_eq!(back["http"][0]["timeout"], "300s");
        assert_eq!(
            back["http"][0]["retries"]["perTryTimeout"], "0.300s",
            "as prost-reflect writes it"
        );

        let mut bad = route.clone();
        bad["http"][0]["retries"]["per_try_timeout"] = json!("soon");
        let err = encode("type.googleapis.com/istio.networking.v1alpha3.VirtualService", bad).unwrap_err();
        assert_eq!(display_path(&err.path), "http[0].retries.per_try_timeout", "{err}");
        let mut bad = route;
        bad["http"][0]["route"][0]["destination"]["hots"] = json!("x");
        let err = encode("type.googleapis.com/istio.networking.v1alpha3.VirtualService", bad).unwrap_err();
        assert_eq!(display_path(&err.path), "http[0].route[0].destination.hots", "{err}");
        // Map values that are durations: none in these protos is a map of
        // durations, but a list of messages holding one is walked.
        let err = encode(
            "type.googleapis.com/istio.networking.v1alpha3.DestinationRule",
            json!({"host": "r", "trafficPolicy": {"outlierDetection": {"interval": "1x"}}}),
        )
        .unwrap_err();
        assert_eq!(
            display_path(&err.path),
            "trafficPolicy.outlierDetection.interval",
            "{err}"
        );
    }
}

#[cfg(test)]
mod secret_types {
    #[test]
    fn envoys_secret_is_a_collection_of_secrets_and_its_config_types_are_not() {
        let urls = super::secret_type_urls();
        assert_eq!(
            urls,
            super::secret_types_of::secret_type_urls_of(&super::pool()),
            "the list built in is what the embedded descriptors say"
        );
        let has = |name: &str| urls.iter().any(|u| u == &format!("type.googleapis.com/{name}"));
        assert!(has("envoy.extensions.transport_sockets.tls.v3.Secret"), "{urls:?}");
        for config in [
            "envoy.config.cluster.v3.Cluster",
            "envoy.config.listener.v3.Listener",
            "envoy.config.route.v3.RouteConfiguration",
            "envoy.config.endpoint.v3.ClusterLoadAssignment",
            "istio.networking.v1alpha3.VirtualService",
            "istio.networking.v1alpha3.DestinationRule",
        ] {
            assert!(!has(config), "{config} is not a collection of secrets: {urls:?}");
        }
    }
}
