//! The local source (`--source-dir`): YAML files in a directory, watched, fed
//! into the cache through the same path as upstream updates (origin `files`).
//! It is the default when no upstream is configured, so `cargo run --release`
//! serves the repository's `examples/config`.
//!
//! Each file holds one or more YAML documents (`---`), each an Istio
//! resource as operators keep it in Git (see `kubernetes`):
//!
//! ```yaml
//! apiVersion: networking.istio.io/v1   # any alias of the kind: v1alpha3, v1beta1, v1
//! kind: VirtualService                 # selects the collection; `kind: List` with `items`
//! metadata: {name: reviews, namespace: bookinfo, labels: {app: reviews}}
//! spec: {hosts: [reviews], http: [{timeout: 5m, route: [...]}]}   # the kind's proto
//! ```
//!
//! or a resource in the gateway's own form, for the kinds no proto here
//! reads (Mixer's, Kubernetes core), Envoy's resources and `--type-map`
//! collections:
//!
//! ```yaml
//! collection: istio/networking/v1alpha3/gateways
//! name: istio-system/ingress
//! version: "1"            # optional: a hash of the body when absent
//! labels: {app: ingress}  # optional
//! annotations: {}         # optional
//! body:
//!   type_url: type.googleapis.com/istio.networking.v1alpha3.Gateway
//!   value_base64: EhcKBWlzdGlvEg5pbmdyZXNzZ2F0ZXdheQ==   # exact bytes
//! # or, for a type this gateway has the proto of (see `proto_json`):
//! #  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
//! #  json: {name: backend, connect_timeout: 1s, type: EDS, ...}   # proto-JSON
//! # or (logged: Pilot and istiod decode none but Mixer's kinds this way):
//! #  struct: {selector: {istio: ingressgateway}}   # google.protobuf.Struct
//! ```
//!
//! The directory is the whole truth: a collection no file mentions is served
//! empty. A file that fails to parse is reported with its path, the line in
//! the file (`yaml_lines`) and the reason, and keeps contributing what it held when it last parsed, so a typo
//! never empties a collection.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use bytes::Bytes;
use prost::Message;
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::demand::Subscriptions;
use crate::cache::{CacheWriter, CachedResource, Origin, Update};
use crate::collections::CollectionTable;
use crate::proto::{Metadata, Resource};
use crate::source::kubernetes;
use crate::source::proto_json::PathStep;
use crate::source::yaml_lines;
use crate::source::UpstreamStatus;
use crate::transport::fswatch::DirWatch;
use crate::transport::safe_text::terminal_safe;
use crate::SharedStr;

pub const STRUCT_TYPE_URL: &str = "type.googleapis.com/google.protobuf.Struct";

/// The repository's examples, compiled in: served when `--source-dir` was not
/// given and `examples/config` is not there (an installed binary, an image).
pub const EMBEDDED_EXAMPLES: &[(&str, &str)] = &[
    ("networking.yaml", include_str!("../../examples/config/networking.yaml")),
    (
        "mesh-services.yaml",
        include_str!("../../examples/config/mesh-services.yaml"),
    ),
    ("security.yaml", include_str!("../../examples/config/security.yaml")),
];

/// Where the local source reads from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceDir {
    /// A directory, watched for changes.
    Dir(PathBuf),
    /// The compiled-in copy of `examples/config`.
    Embedded,
}

impl std::fmt::Display for SourceDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceDir::Dir(dir) => write!(f, "{}", dir.display()),
            SourceDir::Embedded => f.write_str("embedded examples/config"),
        }
    }
}

/// A file that did not parse: where, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}:{line}: {reason}")]
pub struct ParseError {
    pub path: String,
    pub line: usize,
    pub reason: String,
    /// The collection and name of the resource it is about, when the
    /// document says them (see [`identity`]).
    pub collection: Option<SharedStr>,
    pub name: Option<String>,
}

/// Where a body's fields are written: the first line of its document in the
/// file, and the path in that document to the body's root.
pub type BodyAt = (usize, Vec<PathStep>);

/// One resource as parsed from a file.
#[derive(Clone, Debug)]
pub struct Parsed {
    pub collection: SharedStr,
    pub name: SharedStr,
    pub version: SharedStr,
    pub body_type_url: String,
    pub encoded: Bytes,
    pub digest: u128,
    pub line: usize,
    /// The line of its name (`metadata.name`, or `name`).
    pub name_line: usize,
    /// A `struct:` body in a collection whose clients decode another type.
    pub struct_body: bool,
    /// Where its body's fields are written: the first line of its document
    /// in the file, and the path in that document to the body's root (`spec`,
    /// `items[2].spec`, `body.json`): [`field_line`] finds a field's line.
    /// Shared: the files source's origins keep it for every resource served.
    pub body_at: Arc<BodyAt>,
}

/// A document: a resource in the gateway's own form (`collection`, `name`,
/// `body`), or a Kubernetes object (`apiVersion`, `kind`, `metadata`,
/// `spec`; see `kubernetes`). One struct reads both, so an unknown key is
/// refused in either.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    #[serde(default)]
    collection: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    labels: BTreeMap<YamlString, YamlString>,
    #[serde(default)]
    annotations: BTreeMap<YamlString, YamlString>,
    #[serde(default)]
    body: Option<Body>,
    #[serde(default, rename = "apiVersion")]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    metadata: Option<kubernetes::ObjectMeta>,
    #[serde(default)]
    spec: Option<YamlValue>,
    /// Read and ignored, as Galley did.
    #[serde(default)]
    #[allow(dead_code)]
    status: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    items: Option<Vec<kubernetes::Item>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    #[serde(default)]
    type_url: Option<String>,
    #[serde(default)]
    value_base64: Option<String>,
    #[serde(default, rename = "struct")]
    structure: Option<YamlValue>,
    /// An Envoy resource's proto-JSON, with `type_url`.
    #[serde(default)]
    json: Option<YamlValue>,
}

/// What a document may build, in units of one value or 16 bytes of text.
/// YAML aliases repeat what they point to: one large anchor (a list, a map,
/// a long string) aliased many times would expand to far more than the text
/// (serde_norway bounds the number of alias jumps, not what each copies).
/// Struct bodies, labels and annotations are built against this budget, so a
/// YAML bomb fails with a clear error instead of taking the memory.
fn value_budget(document: &str) -> usize {
    1024 + document.len()
}

/// The budget units of a string of `len` bytes.
fn string_cost(len: usize) -> usize {
    1 + len / 16
}

thread_local! {
    /// What the document being parsed may still build (`value_budget`).
    static VALUES_LEFT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn spend_value<E: serde::de::Error>() -> Result<(), E> {
    spend::<E>(1)
}

fn spend<E: serde::de::Error>(units: usize) -> Result<(), E> {
    VALUES_LEFT.with(|left| match left.get().checked_sub(units) {
        None => {
            left.set(0);
            Err(E::custom(
                "the document expands to more than its size allows (YAML aliases repeating a large anchor?)",
            ))
        }
        Some(n) => {
            left.set(n);
            Ok(())
        }
    })
}

/// A string read against the document's budget (labels, annotations).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct YamlString(pub(super) String);

impl<'de> Deserialize<'de> for YamlString {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let YamlKey(text) = YamlKey::deserialize(deserializer)?;
        Ok(YamlString(text))
    }
}

/// A YAML value read against the document's budget, as JSON would read it:
/// a `struct` body (`google.protobuf.Struct`, as `protojson` reads the same
/// JSON) or a `json` body (an Envoy resource's proto-JSON).
#[derive(Debug)]
pub(super) struct YamlValue(pub(super) serde_json::Value);

impl<'de> Deserialize<'de> for YamlValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(YamlValueVisitor).map(YamlValue)
    }
}

struct YamlValueVisitor;

/// YAML's merge key.
const MERGE_KEY: &str = "<<";

/// The value of a key written a second time in one mapping: always an error.
struct WrittenTwice(String);

impl<'de> serde::de::DeserializeSeed<'de> for WrittenTwice {
    type Value = ();

    /// Fails inside the value's own read, which gives the error its line.
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl WrittenTwice {
    fn refused<E: serde::de::Error>(&self) -> Result<(), E> {
        Err(E::custom(format!(
            "mapping key {:?} is written twice in one mapping",
            self.0
        )))
    }
}

impl<'de> serde::de::Visitor<'de> for WrittenTwice {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "no second value for mapping key {:?}", self.0)
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.refused()
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.refused()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.refused()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.refused()
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        self.refused()
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.refused()
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.refused()
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.refused()
    }
}

impl<'de> serde::de::Visitor<'de> for YamlValueVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a YAML value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        spend_value::<E>()?;
        Ok(v.into())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        spend_value::<E>()?;
        Ok(v.into())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        spend_value::<E>()?;
        Ok(v.into())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        spend_value::<E>()?;
        // JSON has no NaN or infinity: null, as serde_json writes them.
        Ok(v.into())
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        spend::<E>(string_cost(v.len()))?;
        Ok(v.into())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        spend_value::<E>()?;
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        spend_value::<A::Error>()?;
        let mut values = Vec::new();
        while let Some(YamlValue(value)) = seq.next_element()? {
            values.push(value);
        }
        Ok(serde_json::Value::Array(values))
    }

    /// A mapping as kubectl reads it: a key written twice is an error, not
    /// the last value silently; merge keys (`<<: *anchor`, or a list of
    /// them) are expanded, the mapping's own keys first, then each merged
    /// mapping's in order.
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        spend_value::<A::Error>()?;
        let mut fields = serde_json::Map::new();
        let mut merged = Vec::new();
        while let Some(YamlKey(key)) = map.next_key()? {
            if key == MERGE_KEY {
                let YamlValue(value) = map.next_value()?;
                match value {
                    serde_json::Value::Object(_) => merged.push(value),
                    serde_json::Value::Array(values) if values.iter().all(serde_json::Value::is_object) => {
                        merged.extend(values)
                    }
                    _ => {
                        return Err(serde::de::Error::custom(
                            "a merge key (<<) takes a mapping or a list of mappings",
                        ))
                    }
                }
                continue;
            }
            if fields.contains_key(&key) {
                // Refused as its value is read, so that the error carries the
                // second key's line, not the mapping's first.
                return map.next_value_seed(WrittenTwice(key)).map(|()| serde_json::Value::Null);
            }
            let YamlValue(value) = map.next_value()?;
            fields.insert(key, value);
        }
        for value in merged {
            if let serde_json::Value::Object(merged) = value {
                for (key, value) in merged {
                    fields.entry(key).or_insert(value);
                }
            }
        }
        Ok(serde_json::Value::Object(fields))
    }

    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(serde::de::Error::custom("YAML tags are not supported in a body"))
    }
}

/// A JSON value as `google.protobuf.Value` (what `protojson` reads).
fn protobuf_value(value: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(v) => Kind::BoolValue(v),
        serde_json::Value::Number(v) => Kind::NumberValue(v.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(v) => Kind::StringValue(v),
        serde_json::Value::Array(values) => Kind::ListValue(prost_types::ListValue {
            values: values.into_iter().map(protobuf_value).collect(),
        }),
        serde_json::Value::Object(fields) => Kind::StructValue(protobuf_struct(fields)),
    };
    prost_types::Value { kind: Some(kind) }
}

fn protobuf_struct(fields: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: fields.into_iter().map(|(k, v)| (k, protobuf_value(v))).collect(),
    }
}

/// A mapping key: a string, or a number or boolean written as one.
struct YamlKey(String);

impl<'de> Deserialize<'de> for YamlKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl serde::de::Visitor<'_> for KeyVisitor {
            type Value = String;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, number or boolean mapping key")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                spend::<E>(string_cost(v.len()))?;
                Ok(v.to_owned())
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
                spend::<E>(1)?;
                Ok(v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                spend::<E>(1)?;
                Ok(v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                spend::<E>(1)?;
                Ok(v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
                spend::<E>(1)?;
                Ok(v.to_string())
            }
        }
        deserializer.deserialize_any(KeyVisitor).map(YamlKey)
    }
}

/// Splits YAML text into documents at `---` lines: (first line, text).
fn documents(text: &str) -> Vec<(usize, String)> {
    let mut documents = vec![(1, String::new())];
    for (index, line) in text.lines().enumerate() {
        if line == "---" || line.starts_with("--- ") || line == "..." {
            documents.push((index + 2, String::new()));
            continue;
        }
        let current = &mut documents.last_mut().expect("never empty").1;
        current.push_str(line);
        current.push('\n');
    }
    // A document starts at its first line with content; comment-only
    // documents are dropped.
    documents
        .into_iter()
        .filter_map(|(start, text)| {
            let first = text
                .lines()
                .position(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))?;
            let text = text.lines().skip(first).fold(String::new(), |mut t, l| {
                t.push_str(l);
                t.push('\n');
                t
            });
            Some((start + first, text))
        })
        .collect()
}

/// What a document names: the resources it holds, each with where it
/// is in the document.
struct Found {
    collection: SharedStr,
    name: String,
    version: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    body: prost_types::Any,
    /// Where the resource is (`[]`, or `items[2]` in a `List`).
    at: Vec<PathStep>,
    /// Where its name is.
    name_at: Vec<PathStep>,
    /// Where its body's fields are (see [`Parsed::body_at`]).
    body_at: Vec<PathStep>,
}

/// Why a document is refused: the reason and the path of what is wrong.
type Refusal = (String, Vec<PathStep>);

fn key(name: &str) -> PathStep {
    PathStep::Key(name.to_owned())
}

/// Parses one file's text. Every document must be valid for any to count.
/// Every error names the line in the file; the first one is returned.
pub fn parse(path: &str, text: &str, table: &CollectionTable) -> Result<Vec<Parsed>, ParseError> {
    let (parsed, mut errors) = parse_all(path, text, table, 1);
    match errors.is_empty() {
        true => Ok(parsed),
        false => Err(errors.swap_remove(0)),
    }
}

/// Parses one file's text: the resources that read, and the errors, up to
/// `max_errors` (at least one), in the file's order. The files source asks
/// for one (a file with an error is refused whole, so the first is enough
/// and nothing is read after it); `check` for every error of a file, read
/// past each: the next document, the next item of a `List`, the next field
/// of a body. A file with an error serves nothing, whatever else read.
pub fn parse_all(path: &str, text: &str, table: &CollectionTable, max_errors: usize) -> (Vec<Parsed>, Vec<ParseError>) {
    let max_errors = max_errors.max(1);
    let mut parsed = Vec::new();
    let mut errors: Vec<ParseError> = Vec::new();
    let mut seen: HashMap<(SharedStr, String), usize> = HashMap::new();
    let secrets = super::proto_json::SecretTypes::of(table);
    for (start, document) in documents(text) {
        if errors.len() >= max_errors {
            break;
        }
        let fail = |line: usize, reason: String, at: &[PathStep]| {
            let (collection, name) = identity(&document, at, table);
            // Text that is no YAML at all (a syntax error) names no value,
            // only the token the reader expected (`','`).
            let yaml = collection.is_some() || serde_norway::from_str::<serde::de::IgnoredAny>(&document).is_ok();
            let reason = match yaml {
                true => redacted_in(reason, collection.as_deref(), name.as_deref(), &document, table),
                false => reason,
            };
            ParseError {
                path: path.to_owned(),
                line,
                reason,
                collection,
                name,
            }
        };
        // The line in the file of the node at `steps` (or of its nearest
        // parent found).
        let line_of = |steps: &[PathStep]| start + yaml_lines::line_of(&document, steps).map_or(0, |l| l - 1);
        VALUES_LEFT.with(|left| left.set(value_budget(&document)));
        let doc: Document = match serde_norway::from_str(&document) {
            Ok(doc) => doc,
            Err(e) => {
                let message = e.to_string();
                errors.push(match e.location() {
                    // The line is reported in the file, not in the document.
                    Some(at) => {
                        let message = yaml_lines::in_file(&message, start, at.line(), at.column());
                        let last = start + document.lines().count().saturating_sub(1);
                        let mut line = start + at.line().saturating_sub(1);
                        // The end of the text ("unexpected end of stream") is
                        // past its last line: the line the message names for
                        // what was left open (a quoted scalar) is the one to fix.
                        if line > last {
                            line = yaml_lines::last_line_named(&message)
                                .filter(|l| *l <= last)
                                .unwrap_or(last);
                        }
                        fail(line, message, &[])
                    }
                    None => fail(start, message, &[]),
                });
                continue;
            }
        };
        let (found, refused) = resources(doc, table, max_errors - errors.len());
        errors.extend(
            refused
                .into_iter()
                .map(|(reason, steps)| fail(line_of(&steps), reason, &steps)),
        );
        for found in found {
            if errors.len() >= max_errors {
                break;
            }
            let name_line = line_of(&found.name_at);
            if let Some(first) = seen.insert((found.collection.clone(), found.name.clone()), name_line) {
                errors.push(ParseError {
                    path: path.to_owned(),
                    line: name_line,
                    reason: format!(
                        "{:?} in {} is defined twice (first at line {first}); names must be unique",
                        found.name, found.collection
                    ),
                    collection: Some(found.collection.clone()),
                    name: Some(found.name.clone()),
                });
                continue;
            }
            let line = line_of(&found.at);
            // A secret's body in a collection clients may read unasked (the
            // collections of secrets are read by nobody an access policy
            // does not grant them): refused, not served to every client.
            // So is one that wraps a secret's type (an `Any` of it, a
            // TypedStruct naming it): Envoy reads it as that type.
            let refusal = secrets.refusal(
                &found.collection,
                table.is_sensitive(&found.collection),
                &found.body.type_url,
                &found.body.value,
            );
            if let Some(reason) = refusal {
                errors.push(ParseError {
                    path: path.to_owned(),
                    line,
                    reason,
                    collection: Some(found.collection.clone()),
                    name: Some(found.name.clone()),
                });
                continue;
            }
            let struct_body = found.body.type_url == STRUCT_TYPE_URL
                && table
                    .get(&found.collection)
                    .is_some_and(|c| c.body_type_url != STRUCT_TYPE_URL);
            let metadata = Metadata {
                name: found.name.clone(),
                version: found.version.unwrap_or_default(),
                labels: found.labels.into_iter().collect(),
                annotations: found.annotations.into_iter().collect(),
                ..Default::default()
            };
            let body_type_url = found.body.type_url.clone();
            let encoded: Bytes = Resource {
                metadata: Some(metadata),
                body: Some(found.body),
            }
            .encode_to_vec()
            .into();
            // The same validation, and the same version rule, as upstream data.
            let resource = match crate::source::validate::decode_resources_of(table, &found.collection, &[encoded]) {
                Ok(mut resources) => resources.pop().expect("one resource in, one out"),
                Err(nack) => {
                    errors.push(ParseError {
                        path: path.to_owned(),
                        line,
                        reason: nack.message,
                        collection: Some(found.collection.clone()),
                        name: Some(found.name.clone()),
                    });
                    continue;
                }
            };
            parsed.push(Parsed {
                collection: found.collection,
                name: resource.name.clone(),
                version: resource.version().into(),
                body_type_url,
                encoded: resource.encoded.clone(),
                digest: resource.digest(),
                line,
                name_line,
                struct_body,
                body_at: Arc::new((start, found.body_at)),
            });
        }
    }
    // In the file's order (a `List`'s duplicate is found after its items).
    errors.sort_by_key(|e| e.line);
    errors.truncate(max_errors);
    (parsed, errors)
}

/// An error of a document of `collection` (the resource `name`), as the
/// files source and `check` say it: in a sensitive collection, what it
/// quotes of the document is redacted (the log, `/debug/upstream`, the
/// admin port's `/readyz`, `status` and `check` quote it nowhere: the line
/// and the path say where the error is), whichever form the document has
/// and whatever failed to read (the body, a field the form does not have,
/// a Kubernetes resource's spec, the document's shape).
///
/// A document whose collection cannot be told (its `collection` unreadable,
/// an unknown kind) may be a secret's as well as any: what an error quotes
/// of its body or spec is redacted too (an error about the collection or
/// kind itself still quotes what the operator wrote there).
///
/// In a collection that is not sensitive, an error the YAML reader made
/// inside a body (`body.json.…`: a tag, a key written twice, before the
/// body could be read as its type) is said as the body's own errors are:
/// nothing of what lies in a secret's field quoted (`proto_json::secrecy`).
fn redacted_in(
    reason: String,
    collection: Option<&str>,
    name: Option<&str>,
    document: &str,
    table: &CollectionTable,
) -> String {
    const BODY: &str = "body.json.";
    let sensitive = match collection {
        Some(collection) => table.is_sensitive(collection),
        // Which collection cannot be told (a key written twice, an unknown
        // kind): anything but what the error says of the identity itself
        // (an unknown top-level key is the document's text: a secret's line
        // that slipped out of its block scalar can be one).
        None => !["collection \"", "kind \"", "apiVersion \"", "missing field `"]
            .iter()
            .any(|about| reason.starts_with(about)),
    };
    // Read against the type the body says it is (a `Secret` may be
    // written into any collection), else the collection's; the document is
    // read for it only for such an error.
    let reason = match reason.strip_prefix(BODY).and_then(|r| r.split_once(": ")) {
        Some((path, rest)) => {
            match declared_type(document)
                .or_else(|| collection.and_then(|c| table.get(c)).map(|c| c.body_type_url.clone()))
            {
                Some(type_url) => {
                    let (path, rest) = super::proto_json::redact_body_error(&type_url, path, rest);
                    format!("{BODY}{path}: {rest}")
                }
                None => reason,
            }
        }
        None => reason,
    };
    if !sensitive {
        return reason;
    }
    // The resource's name is no secret: it stays where the error names it.
    if let Some(rest) = name.and_then(|n| reason.strip_prefix(&format!("body of \"{n}\": "))) {
        return format!("body of \"{}\": {}", name.unwrap_or_default(), redacted_reason(rest));
    }
    redacted_reason(&reason)
}

/// A reason of a sensitive document's error: what it quotes redacted, and
/// of the path it starts with (`json.tls_certificate.private_key.X: …`)
/// the steps that are the schema's field names (lower-case identifiers, as
/// every field of Envoy's and Istio's protos is), the rest (a map's key, a
/// key no field has: the document's own text, which may be a secret)
/// `[redacted]`, and always the field an "unknown field" error names. The
/// error's line in the file still says where.
fn redacted_reason(reason: &str) -> String {
    let mut reason = super::proto_json::redact_quoted(reason);
    // The type an `Any` of the body names (unquoted: it is the operator's
    // to read elsewhere, but here the body's own text).
    super::proto_json::redact_any_type(&mut reason);
    let Some((path, rest)) = reason.split_once(": ").filter(|(path, _)| !path.contains(' ')) else {
        return reason;
    };
    let field = |step: &str| {
        let name = step.split('[').next().unwrap_or_default();
        let indexes = &step[name.len()..];
        name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_' || c == '@')
            && name[1..]
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && indexes.chars().all(|c| c.is_ascii_digit() || c == '[' || c == ']')
    };
    let unknown = rest.starts_with("unrecognized field") || rest.starts_with("unknown field");
    let steps: Vec<&str> = path.split('.').collect();
    let last = steps.len() - 1;
    let shown: Vec<&str> = steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            if field(step) && !(unknown && i == last && i > 0) {
                step
            } else {
                super::proto_json::REDACTED
            }
        })
        .collect();
    format!("{}: {rest}", shown.join("."))
}

/// The collection and name of the resource an error at `at` in `document`
/// is about, when the document says them (its kind and `metadata.name`, or
/// `collection` and `name`), however broken the rest is: a finding names
/// the resource. Read only for an error.
fn identity(document: &str, at: &[PathStep], table: &CollectionTable) -> (Option<SharedStr>, Option<String>) {
    // Each field read when it has the shape it should and skipped when not
    // (`name: [x]`, `metadata: 5`): a field of the wrong type must not
    // hide which collection the document is of, and so whether what its
    // errors quote is a secret.
    #[derive(Deserialize)]
    struct Named {
        #[serde(default, rename = "apiVersion")]
        api_version: Lenient<String>,
        #[serde(default)]
        kind: Lenient<String>,
        #[serde(default)]
        metadata: Lenient<NamedMeta>,
        #[serde(default)]
        collection: Lenient<String>,
        #[serde(default)]
        name: Lenient<String>,
        #[serde(default)]
        items: Lenient<Vec<Lenient<Named>>>,
    }
    #[derive(Deserialize)]
    struct NamedMeta {
        #[serde(default)]
        name: Lenient<String>,
        #[serde(default)]
        namespace: Lenient<String>,
    }
    impl Shaped for Named {
        const SHAPE: Shape = Shape::Mapping;
    }
    impl Shaped for NamedMeta {
        const SHAPE: Shape = Shape::Mapping;
    }
    // Other fields are skipped unread; a document that does not read even
    // so (a syntax error) names nothing.
    let Ok(mut named) = serde_norway::from_str::<Named>(document) else {
        return (None, None);
    };
    if let [PathStep::Key(items), PathStep::Index(index), ..] = at {
        if items == "items" {
            match named
                .items
                .0
                .take()
                .map(|mut items| (*index < items.len()).then(|| items.swap_remove(*index).0))
            {
                Some(Some(Some(item))) => named = item,
                _ => return (None, None),
            }
        }
    }
    let (api_version, kind, collection, name) = (named.api_version.0, named.kind.0, named.collection.0, named.name.0);
    if let Some(collection) = &collection {
        return (table.name(collection.trim()), name.filter(|n| !n.trim().is_empty()));
    }
    let (Some(api_version), Some(kind)) = (&api_version, &kind) else {
        return (None, None);
    };
    let Some(info) = table.kind(api_version.trim(), kind.trim()) else {
        return (None, None);
    };
    let (name, namespace) = named.metadata.0.map_or((None, None), |m| (m.name.0, m.namespace.0));
    let name = name
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|name| kubernetes::resource_name(info.cluster_scoped, name, namespace.as_deref()));
    (Some(info.collection.clone()), name)
}

/// The type URL a document's body says it is (`body.type_url`), when it
/// says one it can read: for an error made before the body is read.
fn declared_type(document: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Doc {
        #[serde(default)]
        body: Lenient<Body>,
    }
    #[derive(Deserialize)]
    struct Body {
        #[serde(default)]
        type_url: Lenient<String>,
    }
    impl Shaped for Body {
        const SHAPE: Shape = Shape::Mapping;
    }
    let doc: Doc = serde_norway::from_str(document).ok()?;
    doc.body.0?.type_url.0.map(|t| t.trim().to_owned())
}

/// A value read when the document gives it the expected shape, and `None`
/// (skipped, unread) when it gives another: a string where a mapping was
/// expected, a list where a string was.
struct Lenient<T>(Option<T>);

/// The shape a [`Lenient`] value is read from.
trait Shaped {
    const SHAPE: Shape;
}

#[derive(PartialEq, Eq)]
enum Shape {
    Text,
    Mapping,
    List,
}

impl Shaped for String {
    const SHAPE: Shape = Shape::Text;
}

impl<T> Shaped for Vec<T> {
    const SHAPE: Shape = Shape::List;
}

impl<T> Default for Lenient<T> {
    fn default() -> Self {
        Lenient(None)
    }
}

impl<'de, T: Deserialize<'de> + Shaped> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer, StrDeserializer, StringDeserializer};
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct Reader<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Shaped> Visitor<'de> for Reader<T> {
            type Value = Lenient<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Lenient(T::deserialize(StrDeserializer::<E>::new(v)).ok()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Lenient(T::deserialize(StringDeserializer::<E>::new(v)).ok()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                if T::SHAPE != Shape::Mapping {
                    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    return Ok(Lenient(None));
                }
                T::deserialize(MapAccessDeserializer::new(map)).map(|t| Lenient(Some(t)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                if T::SHAPE != Shape::List {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(Lenient(None));
                }
                T::deserialize(SeqAccessDeserializer::new(seq)).map(|t| Lenient(Some(t)))
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                Lenient::deserialize(d)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
                // A tagged value (`!!float x`): read past, unread.
                let (IgnoredAny, variant) = data.variant::<IgnoredAny>()?;
                serde::de::VariantAccess::newtype_variant::<IgnoredAny>(variant)?;
                Ok(Lenient(None))
            }
        }
        deserializer.deserialize_any(Reader(std::marker::PhantomData))
    }
}

/// The resources of a document, in either form, and why it is refused (up
/// to `max_errors` reasons).
/// The items of a `List` that read are found beside those that do not.
fn resources(doc: Document, table: &CollectionTable, max_errors: usize) -> (Vec<Found>, Vec<Refusal>) {
    let mut refused = Vec::new();
    match resources_of(doc, table, max_errors, &mut refused) {
        Ok(found) => (found, refused),
        Err(mut whole) => {
            refused.append(&mut whole);
            (Vec::new(), refused)
        }
    }
}

fn resources_of(
    doc: Document,
    table: &CollectionTable,
    max_errors: usize,
    refused_items: &mut Vec<Refusal>,
) -> Result<Vec<Found>, Vec<Refusal>> {
    if doc.api_version.is_some() || doc.kind.is_some() {
        for (field, given) in [
            ("collection", doc.collection.is_some()),
            ("name", doc.name.is_some()),
            ("version", doc.version.is_some()),
            ("labels", !doc.labels.is_empty()),
            ("annotations", !doc.annotations.is_empty()),
            ("body", doc.body.is_some()),
        ] {
            if given {
                return Err(vec![(
                    format!(
                        "{field} belongs to the gateway's own form (collection, name, body); a Kubernetes resource \
                         (apiVersion, kind) has its name, labels and annotations under metadata, and its body as spec"
                    ),
                    vec![key(field)],
                )]);
            }
        }
        let object = kubernetes::Object {
            api_version: doc.api_version,
            kind: doc.kind,
            metadata: doc.metadata,
            spec: doc.spec,
            items: doc.items,
        };
        let (read, refused) = object.read(table, max_errors);
        refused_items.extend(refused.into_iter().map(|e| (e.reason, e.path)));
        return Ok(read
            .into_iter()
            .map(|r| Found {
                collection: r.collection,
                name: r.name,
                version: None,
                labels: r.labels,
                annotations: r.annotations,
                body: r.body,
                name_at: [r.at.clone(), vec![key("metadata"), key("name")]].concat(),
                body_at: [r.at.clone(), vec![key("spec")]].concat(),
                at: r.at,
            })
            .collect());
    }
    for (field, given) in [
        ("metadata", doc.metadata.is_some()),
        ("spec", doc.spec.is_some()),
        ("items", doc.items.is_some()),
    ] {
        if given {
            return Err(vec![(
                format!("{field} belongs to a Kubernetes resource, which names its apiVersion and kind"),
                vec![key(field)],
            )]);
        }
    }
    let missing = |field: &str| {
        vec![(
            format!(
                "missing field `{field}`: a document is a resource in the gateway's form (collection, name, body) \
                 or a Kubernetes resource (apiVersion, kind, metadata, spec)"
            ),
            Vec::new(),
        )]
    };
    let (Some(collection), Some(name)) = (doc.collection, doc.name) else {
        return Err(missing("collection` or `name"));
    };
    let body = doc.body.ok_or_else(|| missing("body"))?;
    let collection = table.name(collection.trim()).ok_or_else(|| {
        vec![(
            format!(
                "collection {collection:?} is not a known collection; add it with --type-map (collection: type_url)"
            ),
            vec![key("collection")],
        )]
    })?;
    if name.trim().is_empty() {
        return Err(vec![(
            "name is empty; every resource needs a name".into(),
            vec![key("name")],
        )]);
    }
    let body_at = match body.json {
        Some(_) => vec![key("body"), key("json")],
        None => vec![key("body")],
    };
    let body = read_body(body, max_errors).map_err(|refused| {
        // Redacted, in a sensitive collection, with every error of the
        // document (see `redacted_in`).
        refused
            .into_iter()
            .map(|(reason, steps)| {
                (
                    // Quoted, not escaped: what prints the message escapes
                    // it once, the name with the rest.
                    format!("body of \"{name}\": {reason}"),
                    [vec![key("body")], steps].concat(),
                )
            })
            .collect::<Vec<_>>()
    })?;
    Ok(vec![Found {
        collection,
        name,
        version: doc.version,
        labels: doc.labels.into_iter().map(|(k, v)| (k.0, v.0)).collect(),
        annotations: doc.annotations.into_iter().map(|(k, v)| (k.0, v.0)).collect(),
        body,
        at: Vec::new(),
        name_at: vec![key("name")],
        body_at,
    }])
}

/// The body as an `Any`; an error says why, and which field of a `json`
/// body failed (a path from the body), up to `max_errors` of them.
fn read_body(body: Body, max_errors: usize) -> Result<prost_types::Any, Vec<Refusal>> {
    let whole = |reason: String| vec![(reason, Vec::new())];
    match (body.type_url, body.value_base64, body.structure, body.json) {
        (Some(type_url), Some(value), None, None) => {
            if type_url.trim().is_empty() {
                return Err(whole("type_url is empty".into()));
            }
            let value = base64::engine::general_purpose::STANDARD
                .decode(value.trim())
                .map_err(|e| whole(format!("value_base64 is not base64: {}", base64_error(&e))))?;
            Ok(prost_types::Any { type_url, value })
        }
        (Some(type_url), None, None, Some(YamlValue(json))) => {
            let value = super::proto_json::encode_all(type_url.trim(), json, max_errors).map_err(|errors| {
                errors
                    .into_iter()
                    .map(|e| {
                        let reason = if e.path.is_empty() {
                            e.message.clone()
                        } else {
                            format!("json.{e}")
                        };
                        (reason, [vec![key("json")], e.path].concat())
                    })
                    .collect::<Vec<_>>()
            })?;
            Ok(prost_types::Any {
                type_url: type_url.trim().to_owned(),
                value,
            })
        }
        (None, None, Some(YamlValue(serde_json::Value::Object(fields))), None) => Ok(prost_types::Any {
            type_url: STRUCT_TYPE_URL.into(),
            value: protobuf_struct(fields).encode_to_vec(),
        }),
        (None, None, Some(_), None) => Err(whole("struct must be a mapping".into())),
        _ => Err(whole(
            "give one of {type_url, value_base64}, {type_url, json: <the resource's proto-JSON>} or {struct: <mapping>}"
                .into(),
        )),
    }
}

/// Why `value_base64` does not decode, by where, never by what: the
/// decoder's own words quote the offending symbol, which may be a secret's.
fn base64_error(error: &base64::DecodeError) -> String {
    match error {
        base64::DecodeError::InvalidByte(offset, _) => format!("an invalid symbol at offset {offset}"),
        base64::DecodeError::InvalidLastSymbol(offset, _) => {
            format!("the last symbol, at offset {offset}, has bits set that padding would clear")
        }
        base64::DecodeError::InvalidLength(length) => {
            format!("{length} symbols, a length no base64 text has (give whole groups of 4, with = padding)")
        }
        base64::DecodeError::InvalidPadding => "its `=` padding is wrong".to_owned(),
    }
}

#[derive(Debug, Default)]
struct FileState {
    /// What the file held when it last parsed.
    good: Vec<Parsed>,
    /// Why its current content does not parse.
    error: Option<ParseError>,
    /// The collections it gives `struct:` bodies that their clients decode
    /// as another type (logged once per file and collection).
    struct_bodies: BTreeSet<SharedStr>,
    /// A digest of the text this state was read from: a rescan parses the
    /// file again only when its text changed (one large file, broken or
    /// not, costs the edits of the others nothing).
    text: Option<u128>,
}

/// A resource's file and where its body is written there.
type FileOrigin = (SharedStr, Arc<BodyAt>);

/// Where each resource the files source serves came from: its file, and
/// where its body is written there (see [`Parsed::body_at`]), by collection
/// and name. Published after every read; `/debug/skew` names the line of a
/// field from it.
#[derive(Debug, Default)]
pub struct Origins {
    /// By collection, then name (looked up by `&str`, without a key made).
    by_resource: HashMap<SharedStr, HashMap<SharedStr, FileOrigin>>,
    /// The source's `--max-message-bytes`: a file is read again for its
    /// lines only within it.
    pub max_file_bytes: usize,
}

impl Origins {
    /// The file and where the body is, of `name` in `collection`.
    pub fn of(&self, collection: &str, name: &str) -> Option<(&str, &BodyAt)> {
        self.by_resource
            .get(collection)?
            .get(name)
            .map(|(file, at)| (&**file, &**at))
    }
}

/// The local source: parsed files, published as collections.
pub struct LocalSource {
    dir: SourceDir,
    table: Arc<CollectionTable>,
    writer: CacheWriter,
    subscriptions: Arc<Subscriptions>,
    status: watch::Sender<UpstreamStatus>,
    files: BTreeMap<String, FileState>,
    /// Every collection published so far (a collection whose last file went
    /// away is published empty, not left behind).
    published: BTreeSet<SharedStr>,
    /// `--max-message-bytes`: a larger file is an error, not read.
    max_file_bytes: usize,
    /// Where the resources served came from.
    origins: Option<watch::Sender<Arc<Origins>>>,
}

impl LocalSource {
    pub fn new(
        dir: SourceDir,
        table: Arc<CollectionTable>,
        writer: CacheWriter,
        subscriptions: Arc<Subscriptions>,
        status: watch::Sender<UpstreamStatus>,
        max_file_bytes: usize,
    ) -> Self {
        status.send_modify(|s| {
            s.mode = "files";
            s.address = dir.to_string();
            s.connected = true;
            s.since = Some(SystemTime::now());
        });
        Self {
            dir,
            table,
            writer,
            subscriptions,
            status,
            files: BTreeMap::new(),
            published: BTreeSet::new(),
            max_file_bytes,
            origins: None,
        }
    }

    /// Publishes where each served resource came from on `origins`.
    pub fn with_origins(mut self, origins: watch::Sender<Arc<Origins>>) -> Self {
        self.origins = Some(origins);
        self
    }

    /// Reads everything once and publishes it; then, for a directory,
    /// watches it until `shutdown`. Clients are served from the first read.
    /// Files are read and parsed on the blocking pool, never on the async
    /// workers.
    pub async fn start(mut self, shutdown: CancellationToken, tasks: &TaskTracker) -> Result<(), String> {
        let watch = match &self.dir {
            SourceDir::Dir(dir) => Some(
                DirWatch::new(std::slice::from_ref(dir)).map_err(|e| format!("cannot watch {}: {e}", dir.display()))?,
            ),
            SourceDir::Embedded => None,
        };
        self.rescan().await;
        let mut subscriptions = self.subscriptions.watch();
        subscriptions.mark_unchanged();
        tasks.spawn(async move {
            let mut watch = watch;
            loop {
                tokio::select! {
                    changed = async { watch.as_mut().expect("guarded").changed().await }, if watch.is_some() => {
                        if !changed {
                            return;
                        }
                        tokio::select! {
                            _ = self.rescan() => {}
                            _ = shutdown.cancelled() => return,
                        }
                    }
                    changed = subscriptions.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        // A collection a client asked for: served empty if no
                        // file has it.
                        self.publish();
                    }
                    _ = shutdown.cancelled() => return,
                }
            }
        });
        Ok(())
    }

    /// Re-reads and re-parses every file (on the blocking pool) and publishes
    /// the result.
    pub async fn rescan(&mut self) {
        let dir = self.dir.clone();
        let table = self.table.clone();
        let max = self.max_file_bytes;
        let known: HashMap<String, u128> = self
            .files
            .iter()
            .filter_map(|(path, state)| Some((path.clone(), state.text?)))
            .collect();
        let read = tokio::task::spawn_blocking(move || read_all(&dir, &table, max, &known)).await;
        match read {
            Ok(Ok(contents)) => {
                self.files.retain(|path, _| contents.iter().any(|(p, _)| p == path));
                for (path, read) in contents {
                    if let FileRead::Changed { text, parsed } = read {
                        metrics::counter!(crate::metrics::SOURCE_FILES_PARSED).increment(1);
                        self.update_file(path.clone(), parsed);
                        if let Some(state) = self.files.get_mut(&path) {
                            state.text = text;
                        }
                    }
                }
            }
            Ok(Err(e)) => tracing::warn!(
                dir = %self.dir,
                error = %e,
                "cannot read the source directory; serving what it held before"
            ),
            Err(e) => tracing::error!(dir = %self.dir, error = %e, "reading the source directory failed"),
        }
        self.publish();
    }

    fn update_file(&mut self, path: String, result: ParsedFile) {
        let state = self.files.entry(path.clone()).or_default();
        match result {
            Ok(parsed) => {
                if state.error.take().is_some() {
                    tracing::info!(file = %terminal_safe(&path), resources = parsed.len(), "a source file parses again");
                }
                let struct_bodies: BTreeSet<SharedStr> = parsed
                    .iter()
                    .filter(|p| p.struct_body)
                    .map(|p| p.collection.clone())
                    .collect();
                for collection in struct_bodies.difference(&state.struct_bodies) {
                    tracing::warn!(
                        file = %terminal_safe(&path),
                        %collection,
                        "struct: bodies are served as google.protobuf.Struct, not decodable by Pilot or istiod; \
                         write the resource as Kubernetes YAML (apiVersion, kind, metadata, spec)"
                    );
                }
                state.struct_bodies = struct_bodies;
                state.good = parsed;
            }
            Err(error) => {
                if state.error.as_ref() != Some(&error) {
                    // At start there is no last good state to keep: what
                    // the file holds is not served until it parses.
                    if state.good.is_empty() && state.error.is_none() {
                        tracing::warn!(
                            error = %terminal_safe(&error.to_string()),
                            "a source file does not parse; what it holds is not served until it does"
                        );
                    } else {
                        tracing::warn!(
                            error = %terminal_safe(&error.to_string()),
                            kept = state.good.len(),
                            "a source file does not parse; its collections keep their last good state"
                        );
                    }
                }
                state.error = Some(error);
            }
        }
    }

    /// Applies the state of every collection the files, the subscriptions or
    /// an earlier publish name.
    ///
    /// Nothing is published while a file has never parsed and nothing was
    /// published yet: what such a file holds is unknown, and publishing
    /// without it would serve its collections without its resources (an
    /// empty collection makes Pilot and istiod delete what they hold). The
    /// gateway is not ready until it parses or goes; readiness says why.
    fn publish(&mut self) {
        let unread: Vec<&ParseError> = self
            .files
            .values()
            .filter(|s| s.good.is_empty() && s.error.is_some())
            .filter_map(|s| s.error.as_ref())
            .collect();
        if self.published.is_empty() && !unread.is_empty() {
            let errors: Vec<String> = unread.iter().map(ToString::to_string).collect();
            tracing::warn!(
                files = unread.len(),
                "a source file does not parse at start: nothing is served until every file parses (its \
                 collections would be served without what it holds)"
            );
            self.status.send_modify(|s| {
                s.broken_files = errors.len();
                s.last_error = Some(format!("nothing served until every file parses: {}", errors.join("; ")));
            });
            return;
        }
        let mut collections: BTreeMap<SharedStr, Vec<CachedResource>> = BTreeMap::new();
        let mut owner: HashMap<(SharedStr, SharedStr), &str> = HashMap::new();
        let mut origins = Origins {
            max_file_bytes: self.max_file_bytes,
            ..Default::default()
        };
        for (path, state) in &self.files {
            // Shared by the file's resources in the origins.
            let file: SharedStr = path.as_str().into();
            for parsed in &state.good {
                let key = (parsed.collection.clone(), parsed.name.clone());
                if let Some(first) = owner.get(&key) {
                    tracing::warn!(
                        collection = %parsed.collection,
                        name = %parsed.name,
                        kept = %first,
                        ignored = %format!("{path}:{}", parsed.line),
                        "a resource is defined in two files; the first file (by name) wins"
                    );
                    continue;
                }
                if self.origins.is_some() {
                    origins
                        .by_resource
                        .entry(key.0.clone())
                        .or_default()
                        .insert(key.1.clone(), (file.clone(), parsed.body_at.clone()));
                }
                owner.insert(key, path);
                collections
                    .entry(parsed.collection.clone())
                    .or_default()
                    .push(CachedResource::new(
                        parsed.name.clone(),
                        parsed.encoded.clone(),
                        parsed.digest,
                    ));
            }
        }
        if let Some(sender) = &self.origins {
            sender.send_replace(Arc::new(origins));
        }
        let wanted = self.subscriptions.current().wanted;
        for collection in wanted.into_iter().chain(self.published.iter().cloned()) {
            collections.entry(collection).or_default();
        }
        // One read of the directory is one step: no client sees half of an
        // edit (a route to a cluster whose change is not there yet).
        let names: Vec<SharedStr> = collections.keys().cloned().collect();
        let step = collections
            .into_iter()
            .map(|(collection, resources)| (collection, Update::Full(resources), Origin::Files))
            .collect();
        let mut changed = Vec::new();
        for (collection, applied) in names.into_iter().zip(self.writer.apply_step(step)) {
            if let crate::cache::Applied::Changed { version } = &applied {
                metrics::counter!(crate::metrics::UPDATES_APPLIED, "collection" => crate::metrics::label(&collection), "kind" => "full")
                    .increment(1);
                changed.push(format!("{collection}@{}", &version[..version.len().min(12)]));
            }
            self.published.insert(collection);
        }
        // An edit that applies says so once, with what it changed (the
        // history and /debug/diff have the rest).
        if !changed.is_empty() {
            tracing::info!(collections = %changed.join(", "), "the source directory's change is applied");
        }
        let errors: Vec<String> = self
            .files
            .values()
            .filter_map(|s| s.error.as_ref().map(ToString::to_string))
            .collect();
        self.status.send_modify(|s| {
            s.broken_files = errors.len();
            s.last_error = (!errors.is_empty()).then(|| errors.join("; "));
        });
    }
}

/// A file's documents, split once, for finding the lines of many fields in
/// it (a view or `check` naming every field a release drops).
pub struct FileLines {
    /// (first line, text), in order.
    documents: Vec<(usize, String)>,
}

impl FileLines {
    pub fn of(text: &str) -> Self {
        Self {
            documents: documents(text),
        }
    }

    /// The line of the field at `path` (from the body's root) of a resource
    /// whose body is at `body_at` (see [`Parsed::body_at`]), each step found
    /// by its JSON name or its proto name (`proto_path`), as the YAML spells
    /// it; the nearest parent's line where a step is not there (through an
    /// alias). `None` when no document starts at that line (the file changed).
    pub fn field_line(&self, body_at: &BodyAt, path: &[PathStep], proto_path: &[PathStep]) -> Option<usize> {
        let at = self
            .documents
            .binary_search_by_key(&body_at.0, |(start, _)| *start)
            .ok()?;
        let (start, document) = &self.documents[at];
        // The whole path in one spelling (the usual case): one walk.
        for spelled in [proto_path, path] {
            if !spelled.is_empty() {
                if let Some(line) = yaml_lines::exact_line(document, &[&body_at.1[..], spelled].concat()) {
                    return Some(start + line - 1);
                }
            }
        }
        let mut steps = body_at.1.clone();
        let mut line = yaml_lines::exact_line(document, &steps);
        for (json, proto) in path.iter().zip(proto_path) {
            let spellings = if json == proto { vec![json] } else { vec![json, proto] };
            let found = spellings.into_iter().find_map(|step| {
                steps.push(step.clone());
                let found = yaml_lines::exact_line(document, &steps);
                if found.is_none() {
                    steps.pop();
                }
                found
            });
            match found {
                Some(found) => line = Some(found),
                None => break,
            }
        }
        line.map(|line| start + line - 1)
    }
}

/// A source file's text as the files source reads it (the compiled-in
/// examples by their `<embedded>/` name), for showing lines; `None` when it
/// cannot be read now.
pub fn text_of(path: &str, max_file_bytes: usize) -> Option<String> {
    match path.strip_prefix("<embedded>/") {
        Some(name) => EMBEDDED_EXAMPLES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| text.to_string()),
        None => read_text(Path::new(path), max_file_bytes).ok(),
    }
}

/// What one file parses to.
pub type ParsedFile = Result<Vec<Parsed>, ParseError>;

/// What a rescan found of one file.
enum FileRead {
    /// The same text as the state it has was read from: not parsed again.
    Unchanged,
    /// What it parses to now (an unreadable file is a parse error at line
    /// 0), and its text's digest (`None`: unreadable, read again next time).
    Changed { text: Option<u128>, parsed: ParsedFile },
}

/// Every YAML file's path and what it parses to, parsing only the files
/// whose text is not the one `known` gives a digest of. Blocking: run on
/// the blocking pool.
fn read_all(
    dir: &SourceDir,
    table: &CollectionTable,
    max_file_bytes: usize,
    known: &HashMap<String, u128>,
) -> std::io::Result<Vec<(String, FileRead)>> {
    Ok(texts(dir, max_file_bytes)?
        .into_iter()
        .map(|(path, text)| {
            let digest = text
                .as_ref()
                .ok()
                .map(|text| xxhash_rust::xxh3::xxh3_128(text.as_bytes()));
            if digest.is_some() && known.get(&path) == digest.as_ref() {
                return (path, FileRead::Unchanged);
            }
            let parsed = text
                .map_err(|reason| unreadable(&path, reason))
                .and_then(|text| parse(&path, &text, table));
            (path, FileRead::Changed { text: digest, parsed })
        })
        .collect())
}

/// Every YAML file of `dir` (in order) and its text, or why it cannot be read.
fn texts(dir: &SourceDir, max_file_bytes: usize) -> std::io::Result<Vec<(String, Result<String, String>)>> {
    Ok(match dir {
        SourceDir::Embedded => EMBEDDED_EXAMPLES
            .iter()
            .map(|(name, text)| (format!("<embedded>/{name}"), Ok(text.to_string())))
            .collect(),
        SourceDir::Dir(dir) => {
            let own_log = own_log();
            let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_yaml(p))
                .filter(|p| !is_own_log(p, &own_log))
                .collect();
            paths.sort();
            paths
                .into_iter()
                .map(|path| {
                    let text = read_text(&path, max_file_bytes);
                    (path.display().to_string(), text)
                })
                .collect()
        }
    })
}

/// A file that cannot be read: an error of the whole file (line 0).
fn unreadable(path: &str, reason: String) -> ParseError {
    ParseError {
        path: path.to_owned(),
        line: 0,
        reason,
        collection: None,
        name: None,
    }
}

/// One file as `check` reads it: what parsed, and every error (up to the
/// limit asked for). As served, a file with an error serves nothing.
pub struct CheckedFile {
    pub path: String,
    pub parsed: Vec<Parsed>,
    pub errors: Vec<ParseError>,
}

/// What `mcp-xds-gateway check` reads: a directory as `--source-dir` reads
/// it, or one file, each YAML file with what it parses to, by the same
/// reader and parser as the local source (the same limits), each file read
/// past its errors up to `max_errors` of them ([`parse_all`]). A path that
/// is not there is an `Err`. Blocking.
pub fn read_path(
    path: &Path,
    table: &CollectionTable,
    max_file_bytes: usize,
    max_errors: usize,
) -> std::io::Result<Vec<CheckedFile>> {
    // Only a path that is not there at all is refused: a link loop or a
    // FIFO given by name is the file's error, as in a directory.
    std::fs::symlink_metadata(path)?;
    let texts = if path.is_dir() {
        texts(&SourceDir::Dir(path.to_owned()), max_file_bytes)?
    } else {
        vec![(path.display().to_string(), read_text(path, max_file_bytes))]
    };
    Ok(texts
        .into_iter()
        .map(|(path, text)| {
            let (parsed, errors) = match text {
                Ok(text) => parse_all(&path, &text, table, max_errors),
                Err(reason) => (Vec::new(), vec![unreadable(&path, reason)]),
            };
            CheckedFile { path, parsed, errors }
        })
        .collect())
}

/// A source file's text: a regular file (links are followed: Kubernetes
/// mounts ConfigMaps through them), at most `max` bytes. Opened without
/// blocking, so a FIFO that replaced a file never stalls the source.
fn read_text(path: &Path, max: usize) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let metadata = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !metadata.is_file() {
        return Err("not a regular file (a FIFO, a device or a directory)".into());
    }
    if metadata.len() > max as u64 {
        return Err(format!(
            "{} bytes is larger than --max-message-bytes={max} allows for a source file",
            metadata.len()
        ));
    }
    let mut bytes = Vec::new();
    file.take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() > max {
        return Err(format!(
            "larger than --max-message-bytes={max} allows for a source file"
        ));
    }
    String::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))
}

/// The files this process writes its log to (its standard output and
/// error, when they are files), by device and inode.
fn own_log() -> Vec<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    ["/proc/self/fd/1", "/proc/self/fd/2"]
        .iter()
        .filter_map(|fd| std::fs::metadata(fd).ok())
        .filter(|m| m.is_file())
        .map(|m| (m.dev(), m.ino()))
        .collect()
}

/// Whether `path` is this process's own log: never read as a source file
/// (it would never parse, and each error logged would change it and be
/// read again), said once.
fn is_own_log(path: &Path, own_log: &[(u64, u64)]) -> bool {
    use std::os::unix::fs::MetadataExt;
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let own = std::fs::metadata(path).is_ok_and(|m| own_log.contains(&(m.dev(), m.ino())));
    if own && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            file = %terminal_safe(&path.display().to_string()),
            "this file is the gateway's own log (its standard output or error): not read as a source file; \
             write the log outside the source directory"
        );
    }
    own
}

fn is_yaml(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let yaml = matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"));
    // A link to nowhere, a link loop or a FIFO is reported by `read_text`,
    // not skipped silently: only what is plainly not ours is left out.
    !hidden && yaml && !path.is_dir()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GW: &str = "istio/networking/v1alpha3/gateways";

    fn table() -> CollectionTable {
        CollectionTable::builtin()
    }

    #[test]
    fn envoy_resources_read_as_proto_json_and_errors_name_file_line_and_field() {
        let text = "\
collection: envoy/config/cluster/v3/clusters
name: backend
body:
  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
  json:
    name: backend
    connect_timeout: 0.25s
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}
";
        let parsed = parse("clusters.yaml", text, &table()).unwrap();
        let resource = Resource::decode(parsed[0].encoded.clone()).unwrap();
        let body = resource.body.unwrap();
        assert_eq!(body.type_url, "type.googleapis.com/envoy.config.cluster.v3.Cluster");
        assert!(!body.value.is_empty());

        let broken = text.replace("port_value: 8080", "port_valeu: 8080");
        let err = parse("clusters.yaml", &broken, &table()).unwrap_err();
        assert_eq!((err.path.as_str(), err.line), ("clusters.yaml", 13), "{err}");
        assert!(
            err.reason
                .contains("json.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address")
                && err.reason.contains("port_valeu"),
            "{err}"
        );
        // The same typo in block style, in a later document: the line of
        // the field itself, in the file.
        let later = format!(
            "collection: {GW}\nname: a\nbody: {{struct: {{}}}}\n---\n{}",
            text.replace(
                "{address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}",
                "\n            address:\n              socket_address:\n                address: 127.0.0.1\n                port_valeu: 8080"
            )
        );
        let err = parse("clusters.yaml", &later, &table()).unwrap_err();
        assert_eq!(
            later.lines().nth(err.line - 1),
            Some("                port_valeu: 8080"),
            "{err}"
        );
        assert_eq!(err.line, 21, "{err}");
        let wrong_kind = text.replace("connect_timeout: 0.25s", "connect_timeout: [1]");
        let err = parse("clusters.yaml", &wrong_kind, &table()).unwrap_err();
        assert_eq!(err.line, 7, "{err}");
        assert!(err.reason.contains("json.connect_timeout"), "{err}");
    }

    fn decoded(parsed: &Parsed) -> (Metadata, serde_json::Value) {
        let resource = Resource::decode(parsed.encoded.clone()).unwrap();
        let body = resource.body.unwrap();
        let json = crate::source::proto_json::BodyDecoder::new(None)
            .unwrap()
            .decode(&body.type_url, &body.value)
            .unwrap();
        (resource.metadata.unwrap(), json)
    }

    #[test]
    fn kubernetes_resources_become_istio_protos() {
        let text = "\
# As kubectl get -o yaml writes it: metadata fields MCP has no room for, and
# a status, are ignored.
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata:
  name: reviews
  namespace: bookinfo
  labels: {app: reviews}
  annotations: {owner: team}
  resourceVersion: \"42\"
  uid: 0b7c
  creationTimestamp: \"2020-01-01T00:00:00Z\"
spec:
  hosts: [reviews]
  http:
  - timeout: 5m
    retries: {attempts: 3, per_try_timeout: 300ms}
    route:
    - destination: {host: reviews, subset: v1}
      weight: 90
    - destination: {host: reviews, subset: v2}
      weight: 10
status:
  observedGeneration: 3
---
apiVersion: v1
kind: List
items:
- apiVersion: networking.istio.io/v1alpha3
  kind: DestinationRule
  metadata: {name: reviews}
  spec:
    host: reviews
    trafficPolicy: {outlierDetection: {interval: 1h30m, baseEjectionTime: 300s}}
- apiVersion: authentication.istio.io/v1alpha1
  kind: MeshPolicy
  metadata: {name: default, namespace: ignored}
  spec:
    peers: [{mtls: {mode: PERMISSIVE}}]
";
        let parsed = parse("k.yaml", text, &table()).unwrap();
        let summary: Vec<(&str, &str, &str, usize)> = parsed
            .iter()
            .map(|p| (&*p.collection, &*p.name, p.body_type_url.as_str(), p.line))
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "istio/networking/v1alpha3/virtualservices",
                    "bookinfo/reviews",
                    "type.googleapis.com/istio.networking.v1alpha3.VirtualService",
                    3
                ),
                (
                    "istio/networking/v1alpha3/destinationrules",
                    "default/reviews",
                    "type.googleapis.com/istio.networking.v1alpha3.DestinationRule",
                    29
                ),
                (
                    "istio/authentication/v1alpha1/meshpolicies",
                    "default",
                    "type.googleapis.com/istio.authentication.v1alpha1.Policy",
                    35
                ),
            ]
        );
        let (metadata, vs) = decoded(&parsed[0]);
        assert_eq!(metadata.labels["app"], "reviews");
        assert_eq!(metadata.annotations["owner"], "team");
        assert_eq!(metadata.annotations.len(), 1);
        assert_eq!(
            metadata.version.len(),
            32,
            "a hash of the body, as for the gateway's form"
        );
        assert_eq!(vs["http"][0]["timeout"], "300s");
        assert_eq!(vs["http"][0]["retries"]["perTryTimeout"], "0.300s");
        assert_eq!(vs["http"][0]["route"][1]["weight"], 10);
        let (_, dr) = decoded(&parsed[1]);
        assert_eq!(dr["trafficPolicy"]["outlierDetection"]["interval"], "5400s");
        let (_, mesh) = decoded(&parsed[2]);
        assert_eq!(mesh["peers"][0]["mtls"]["mode"], "PERMISSIVE");
        assert!(parsed.iter().all(|p| !p.struct_body));
    }

    #[test]
    fn struct_bodies_are_marked_where_clients_decode_another_type() {
        let text = "\
collection: istio/networking/v1alpha3/gateways
name: a
body: {struct: {}}
---
collection: istio/config/v1alpha2/adapters
name: b
body: {struct: {}}
";
        let parsed = parse("s.yaml", text, &table()).unwrap();
        // `spec:` with nothing after it is an empty spec.
        let empty = parse(
            "e.yaml",
            "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: a}\nspec:\n",
            &table(),
        )
        .unwrap();
        assert_eq!(
            Resource::decode(empty[0].encoded.clone()).unwrap().body.unwrap().value,
            b""
        );
        assert_eq!(
            parsed.iter().map(|p| p.struct_body).collect::<Vec<_>>(),
            [true, false],
            "Mixer's adapters are Structs"
        );
    }

    #[test]
    fn documents_become_resources_with_struct_and_raw_bodies() {
        let text = "\
collection: istio/networking/v1alpha3/gateways
name: ns/a
version: \"7\"
labels: {app: x}
body:
  struct: {selector: {istio: ingressgateway}, ports: [80, 443], tls: null, on: true}
---
# a comment
collection: istio/networking/v1alpha3/gateways
name: ns/b
body:
  type_url: type.googleapis.com/istio.networking.v1alpha3.Gateway
  value_base64: EhcKBWlzdGlvEg5pbmdyZXNzZ2F0ZXdheQ==
";
        let parsed = parse("f.yaml", text, &table()).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(&*parsed[0].version, "7");
        assert_eq!(parsed[0].body_type_url, STRUCT_TYPE_URL);
        let resource = Resource::decode(parsed[0].encoded.clone()).unwrap();
        assert_eq!(resource.metadata.as_ref().unwrap().labels["app"], "x");
        let structure = prost_types::Struct::decode(&*resource.body.unwrap().value).unwrap();
        assert_eq!(structure.fields.len(), 4);
        assert_eq!(
            structure.fields["ports"].kind,
            Some(prost_types::value::Kind::ListValue(prost_types::ListValue {
                values: vec![
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::NumberValue(80.0))
                    },
                    prost_types::Value {
                        kind: Some(prost_types::value::Kind::NumberValue(443.0))
                    },
                ]
            }))
        );
        // No version given: a hash of the body.
        assert_eq!(parsed[1].version.len(), 32);
        assert_eq!(parsed[1].line, 9);
        let raw = Resource::decode(parsed[1].encoded.clone()).unwrap().body.unwrap();
        assert_eq!(raw.value, b"\x12\x17\x0a\x05istio\x12\x0eingressgateway");
    }

    #[test]
    fn errors_name_the_path_the_line_and_the_reason() {
        let cases = [
            (
                "collection: istio/nope\nname: a\nbody: {struct: {}}\n",
                1,
                "not a known collection",
            ),
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {struct: {}}\n---\n\
                 collection: istio/networking/v1alpha3/gateways\nname: b\nbody:\n  struct: [1]\n",
                7,
                "struct must be a mapping",
            ),
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbodee: {}\n",
                3,
                "unknown field",
            ),
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {type_url: x, value_base64: '%%'}\n",
                3,
                "not base64",
            ),
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {struct: {}}\n---\n\
                 collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {struct: {}}\n",
                6,
                "defined twice",
            ),
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {}\n",
                3,
                "give one of",
            ),
            ("collection: [\n", 1, "invalid type"),
            // Kubernetes resources: an unknown kind, an unknown apiVersion.
            (
                "apiVersion: networking.istio.io/v1\nkind: VirtualServce\nmetadata: {name: a}\n",
                2,
                "kind \"VirtualServce\" is not a kind of networking.istio.io/v1",
            ),
            (
                "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: a}\n",
                2,
                "apiVersion \"example.com/v1\" is not one this gateway reads",
            ),
            // An unknown field: its path, on its line in the file (a later
            // document).
            (
                "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata: {name: a}\n---\n\
                 apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: b\nspec:\n  \
                 hosts: [b]\n  http:\n  - route:\n    - destination: {host: b}\n  - route:\n    - destination:\n        \
                 host: b\n        subst: v1\n",
                17,
                "spec.http[1].route[0].destination.subst: unrecognized field name 'subst'",
            ),
            // A value of the wrong type, and an enum by a name it lacks.
            (
                "apiVersion: networking.istio.io/v1alpha3\nkind: ServiceEntry\nmetadata: {name: a}\nspec:\n  \
                 hosts: [a]\n  ports:\n  - number: eighty\n",
                7,
                "spec.ports[0].number:",
            ),
            (
                "apiVersion: networking.istio.io/v1alpha3\nkind: ServiceEntry\nmetadata: {name: a}\nspec:\n  \
                 hosts: [a]\n  resolution: DSN\n",
                6,
                "spec.resolution:",
            ),
            (
                "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata:\n  namespace: x\nspec: {}\n",
                3,
                "metadata.name is missing",
            ),
            (
                "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nspec: {}\n",
                1,
                "metadata.name is missing",
            ),
            // A Mixer kind, and a kind with no proto here.
            (
                "apiVersion: config.istio.io/v1alpha2\nkind: adapter\nmetadata: {name: a}\nspec: {}\n",
                2,
                "Mixer kind: its params depend on the adapter (a google.protobuf.Struct), so no proto reads its spec; \
                 write it in the gateway's own form: collection: istio/config/v1alpha2/adapters, name: namespace/name, \
                 body: {type_url: type.googleapis.com/google.protobuf.Struct, value_base64:",
            ),
            (
                "apiVersion: config.istio.io/v1alpha2\nkind: handler\nmetadata: {name: a}\nspec: {}\n",
                2,
                "has no proto in this gateway to read its spec with; write it in the gateway's own form",
            ),
            // The two forms mixed, a List's errors on the item's line.
            (
                "apiVersion: networking.istio.io/v1\nkind: Gateway\nname: a\n",
                3,
                "name belongs to the gateway's own form",
            ),
            (
                "apiVersion: v1\nkind: List\nitems:\n- apiVersion: networking.istio.io/v1\n  kind: Gateway\n  \
                 metadata: {name: a}\n- apiVersion: networking.istio.io/v1\n  kind: Gateway\n  metadata: {namespace: x}\n",
                9,
                "metadata.name is missing",
            ),
            (
                "apiVersion: v1\nkind: List\nitems:\n- apiVersion: networking.istio.io/v1\n  kind: Gateway\n  \
                 metadata: {name: a}\n  spec: {selector: {a: b}}\n- apiVersion: networking.istio.io/v1alpha3\n  \
                 kind: Gateway\n  metadata: {name: a}\n",
                10,
                "\"default/a\" in istio/networking/v1alpha3/gateways is defined twice (first at line 6)",
            ),
            // A YAML syntax error in a later document: its line in the file.
            (
                "collection: istio/networking/v1alpha3/gateways\nname: a\nbody: {struct: {}}\n---\n\
                 apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata:\n  name: b\n spec: {}\n",
                9,
                "line 9",
            ),
        ];
        for (text, line, reason) in cases {
            let error = parse("dir/f.yaml", text, &table()).expect_err(text);
            assert_eq!(error.path, "dir/f.yaml");
            assert_eq!(error.line, line, "{text}: {error}");
            assert!(error.reason.contains(reason), "{text}: {error}");
        }
    }

    #[test]
    fn every_error_of_a_file_is_found_with_its_resource_and_the_first_is_what_is_served() {
        let text = "\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: a, namespace: ns}
spec:
  hosts: [a]
  http:
  - timout: 5s
    route:
    - destination: {host: a, subst: v1}
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: g}
spec: {}
---
apiVersion: v1
kind: List
items:
- apiVersion: networking.istio.io/v1
  kind: Gateway
  metadata: {name: g}
- apiVersion: networking.istio.io/v1
  kind: Sidecar
  metadata: {name: s}
  spec: {egres: []}
- apiVersion: networking.istio.io/v1
  kind: Sidecarr
  metadata: {name: t}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: p}
spec: {mtls: {mode: STRICT}}
bogus: 1
";
        let (parsed, errors) = parse_all("f.yaml", text, &table(), 100);
        let shown: Vec<(usize, Option<&str>, Option<&str>, &str)> = errors
            .iter()
            .map(|e| (e.line, e.collection.as_deref(), e.name.as_deref(), e.reason.as_str()))
            .collect();
        let vs = Some("istio/networking/v1alpha3/virtualservices");
        assert_eq!(shown.len(), 6, "{shown:#?}");
        assert_eq!((shown[0].0, shown[0].1, shown[0].2), (7, vs, Some("ns/a")));
        assert_eq!(shown[1].0, 9);
        assert!(shown[0].3.contains("'timout' (did you mean 'timeout'?)"), "{shown:?}");
        assert!(shown[1].3.contains("'subst' (did you mean 'subset'?)"), "{shown:?}");
        // The List's first item repeats the Gateway: a duplicate in the file.
        assert_eq!((shown[2].0, shown[2].2), (21, Some("default/g")));
        assert!(shown[2].3.contains("defined twice (first at line 13)"), "{shown:?}");
        assert_eq!((shown[3].0, shown[3].2), (25, Some("default/s")));
        assert_eq!((shown[4].0, shown[4].1), (27, None));
        // A document that does not read even so still names its resource.
        assert_eq!(
            (shown[5].1, shown[5].2),
            (Some("istio/security/v1beta1/peerauthentications"), Some("default/p"))
        );
        assert!(shown[3].3.contains("'egres' (did you mean 'egress'?)"), "{shown:?}");
        assert_eq!(parsed.len(), 1, "the Gateway read; the file is still refused");
        let first = parse("f.yaml", text, &table()).unwrap_err();
        assert_eq!(first, errors[0]);
        assert_eq!(parse_all("f.yaml", text, &table(), 2).1.len(), 2);
    }

    #[test]
    fn a_body_that_is_or_wraps_a_secret_is_refused_outside_the_collections_of_secrets() {
        const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
        let secret = "{name: s, generic_secret: {secret: {inline_string: MARKER}}}";
        let bodies = [
            (format!("{{type_url: {SECRET}, json: {secret}}}"), String::new()),
            (
                format!("{{type_url: type.googleapis.com/google.protobuf.Any, json: {{'@type': {SECRET}, name: s}}}}"),
                " (within a type.googleapis.com/google.protobuf.Any)".to_owned(),
            ),
            (
                format!("{{type_url: type.googleapis.com/xds.type.v3.TypedStruct, json: {{type_url: {SECRET}, value: {secret}}}}}"),
                " (within a type.googleapis.com/xds.type.v3.TypedStruct)".to_owned(),
            ),
            (
                format!("{{type_url: type.googleapis.com/udpa.type.v1.TypedStruct, json: {{type_url: {SECRET}, value: {{}}}}}}"),
                " (within a type.googleapis.com/udpa.type.v1.TypedStruct)".to_owned(),
            ),
        ];
        // Chains of wrappers, and a prefix that is not the default one
        // (Envoy reads the name after the last `/`).
        let ts = "type.googleapis.com/xds.type.v3.TypedStruct";
        let chains = [
            (
                format!("{{type_url: {ts}, json: {{type_url: {ts}, value: {{type_url: {SECRET}, value: {secret}}}}}}}"),
                format!(" (within a {ts})"),
            ),
            (
                format!("{{type_url: {ts}, json: {{type_url: type.googleapis.com/google.protobuf.Any, value: {{'@type': {SECRET}, name: s}}}}}}"),
                format!(" (within a {ts})"),
            ),
            (
                "{type_url: type.googleapis.com/google.protobuf.Any, json: {'@type': \
                 example.com/envoy.extensions.transport_sockets.tls.v3.Secret, name: s}}"
                    .to_owned(),
                " (within a type.googleapis.com/google.protobuf.Any)".to_owned(),
            ),
            (
                format!("{{type_url: type.googleapis.com/google.protobuf.Any, json: {{'@type': {ts}, type_url: {ts}, value: {{type_url: {SECRET}, value: {{}}}}}}}}"),
                " (within a type.googleapis.com/google.protobuf.Any)".to_owned(),
            ),
            // Its own type URL with a trailing space, or another prefix:
            // read as the Secret it spells (`CgFz`: name "s").
            (
                format!("{{type_url: \"{SECRET} \", value_base64: CgFz}}"),
                format!(" (its type URL \"{SECRET} \" read as that)"),
            ),
            (
                "{type_url: example.com/envoy.extensions.transport_sockets.tls.v3.Secret, value_base64: CgFz}".to_owned(),
                " (its type URL \"example.com/envoy.extensions.transport_sockets.tls.v3.Secret\" read as that)"
                    .to_owned(),
            ),
        ];
        for (body, within) in bodies.into_iter().chain(chains) {
            let text = format!("collection: envoy/config/cluster/v3/clusters\nname: c\nbody: {body}\n");
            let error = parse("s.yaml", &text, &table()).unwrap_err();
            assert!(
                error.reason.starts_with(&format!("a body of {SECRET}{within} holds secrets, and envoy/config/cluster/v3/clusters is not a collection of secrets")),
                "{error}"
            );
            assert!(!error.reason.contains("MARKER"), "{error}");
        }
        // A TypedStruct of a type that is no secret (its secrets hidden in
        // the views) is read; so is a wrapped secret in the secrets' own.
        let tls = "{type_url: type.googleapis.com/xds.type.v3.TypedStruct, json: {type_url: \
                   type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, value: {}}}";
        parse(
            "t.yaml",
            &format!("collection: envoy/config/cluster/v3/clusters\nname: c\nbody: {tls}\n"),
            &table(),
        )
        .unwrap();
        let wrapped =
            format!("{{type_url: type.googleapis.com/google.protobuf.Any, json: {{'@type': {SECRET}, name: s}}}}");
        parse(
            "w.yaml",
            &format!("collection: envoy/extensions/transport_sockets/tls/v3/secrets\nname: s\nbody: {wrapped}\n"),
            &table().with_sensitive_types(crate::source::proto_json::secret_type_urls()),
        )
        .unwrap();
    }

    #[test]
    fn deeply_nested_documents_are_refused_at_the_readers_depth_limit() {
        // libyaml's scanner costs time quadratic in the depth of nested flow
        // collections; the reader stops at its depth limit (128) instead of
        // scanning the rest (400,000 levels took minutes before). The error
        // names the line and column of the first collection too deep.
        let gateway = "collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n";
        let deep = |open: &str, close: &str| {
            let n = 400_000;
            format!("{gateway}  struct: {{a: {}{}}}\n", open.repeat(n), close.repeat(n))
        };
        for (text, column) in [
            (deep("[", "]"), 14 + 125),
            (deep("{a: ", "}"), 14 + 125 * 4),
            // Unclosed, as an attacker would not bother to close them.
            (format!("{gateway}  struct: {{a: {}\n", "[".repeat(400_000)), 14 + 125),
        ] {
            let error = parse("deep.yaml", &text, &table()).unwrap_err();
            let shown = format!("deep.yaml:4: recursion limit exceeded (column {})", column + 1);
            assert_eq!(error.to_string(), shown);
        }
        // A Kubernetes-shaped document and one without a collection too.
        let k8s = format!(
            "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata: {{name: a}}\nspec: {}\n",
            "[".repeat(400_000)
        );
        let error = parse("deep.yaml", &k8s, &table()).unwrap_err();
        assert!(error.reason.contains("recursion limit exceeded"), "{error}");
        let bare = "{a: ".repeat(400_000);
        assert!(parse("deep.yaml", &bare, &table()).is_err());
        // 128 levels in all still read: the limit is the deserializer's own.
        let within = format!("{gateway}  struct: {{a: {}{}}}\n", "[".repeat(125), "]".repeat(125));
        parse("within.yaml", &within, &table()).unwrap();
        let past = format!("{gateway}  struct: {{a: {}{}}}\n", "[".repeat(126), "]".repeat(126));
        assert!(parse("past.yaml", &past, &table())
            .unwrap_err()
            .reason
            .contains("recursion limit"));
    }

    #[test]
    fn yaml_bombs_are_refused_with_a_clear_error() {
        // Billion laughs: serde_norway bounds the alias jumps.
        let mut laughs = String::from("collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n  struct:\n");
        laughs.push_str("    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..10 {
            let prev = i - 1;
            laughs.push_str(&format!(
                "    a{i}: &a{i} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
            ));
        }
        let error = parse("bomb.yaml", &laughs, &table()).unwrap_err();
        assert!(
            error.reason.contains("limit") || error.reason.contains("expands"),
            "{error}"
        );
        // One large anchor aliased many times: each alias is one jump, but
        // copies the whole anchor.
        let mut wide =
            String::from("collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n  struct:\n    big: &big [");
        wide.push_str(&vec!["x"; 2000].join(","));
        wide.push_str("]\n    copies:\n");
        for _ in 0..2000 {
            wide.push_str("      - *big\n");
        }
        let error = parse("wide.yaml", &wide, &table()).unwrap_err();
        assert!(error.reason.contains("expands"), "{error}");
        // A long string aliased many times, in the body and in labels.
        let long = "s".repeat(100_000);
        let mut strings = format!("collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n  struct:\n    s: &s {long}\n    copies:\n");
        for _ in 0..2000 {
            strings.push_str("      - *s\n");
        }
        let error = parse("strings.yaml", &strings, &table()).unwrap_err();
        assert!(error.reason.contains("expands"), "{error}");
        let mut labels =
            format!("collection: istio/networking/v1alpha3/gateways\nname: a\nlabels:\n  first: &s {long}\n");
        for i in 0..2000 {
            labels.push_str(&format!("  l{i}: *s\n"));
        }
        labels.push_str("body: {struct: {}}\n");
        let error = parse("labels.yaml", &labels, &table()).unwrap_err();
        assert!(error.reason.contains("expands"), "{error}");
        // A few aliases of a small anchor are fine.
        let ok = "collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n  struct:\n    \
                  ports: &p [80, 443]\n    again: *p\n";
        assert!(parse("ok.yaml", ok, &table()).is_ok());
    }

    #[test]
    fn fifos_and_oversized_files_are_errors_not_hangs() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.yaml");
        // A FIFO that cannot be made fails the test: its case is not skipped.
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(
            made.as_ref().is_ok_and(|s| s.success()),
            "mkfifo {}: {made:?}",
            fifo.display()
        );
        let error = read_text(&fifo, 1024).unwrap_err();
        assert!(error.contains("not a regular file"), "{error}");
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, vec![b'#'; 2048]).unwrap();
        let error = read_text(&big, 1024).unwrap_err();
        assert!(error.contains("--max-message-bytes=1024"), "{error}");
        let looped = dir.path().join("loop.yaml");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        assert!(read_text(&looped, 1024).is_err());
        assert!(is_yaml(&looped), "a link loop is reported, not skipped");
    }

    #[test]
    fn the_embedded_examples_parse_into_several_collections() {
        let mut collections = BTreeSet::new();
        for (name, text) in EMBEDDED_EXAMPLES {
            for parsed in parse(name, text, &table()).unwrap() {
                collections.insert(parsed.collection);
            }
        }
        assert!(collections.len() >= 3, "{collections:?}");
        assert!(collections.contains(GW));
    }

    #[test]
    fn the_embedded_examples_are_the_repository_examples() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = EMBEDDED_EXAMPLES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "add new example files to EMBEDDED_EXAMPLES");
    }
}
