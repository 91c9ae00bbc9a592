//! The local source (`--source-dir`): YAML files in a directory, watched, fed
//! into the cache through the same path as upstream updates (origin `files`).
//! It is the default when no upstream is configured, so `cargo run --release`
//! serves the repository's `examples/config`.
//!
//! Each file holds one or more YAML documents:
//!
//! ```yaml
//! collection: istio/networking/v1alpha3/gateways
//! name: istio-system/ingress
//! version: "1"            # optional: a hash of the body when absent
//! labels: {app: ingress}  # optional
//! annotations: {}         # optional
//! body:
//!   struct: {selector: {istio: ingressgateway}}   # google.protobuf.Struct
//! # or
//! #  type_url: type.googleapis.com/istio.networking.v1alpha3.Gateway
//! #  value_base64: EhcKBWlzdGlvEg5pbmdyZXNzZ2F0ZXdheQ==   # exact bytes
//! # or, for Envoy's resources (see `envoy_json`):
//! #  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
//! #  json: {name: backend, connect_timeout: 1s, type: EDS, ...}   # proto-JSON
//! ```
//!
//! The directory is the whole truth: a collection no file mentions is served
//! empty. A file that fails to parse is reported with its path, line and
//! reason, and keeps contributing what it held when it last parsed, so a typo
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
use crate::source::UpstreamStatus;
use crate::transport::fswatch::DirWatch;

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
}

/// One resource as parsed from a file.
#[derive(Clone, Debug)]
pub struct Parsed {
    pub collection: Arc<str>,
    pub name: Arc<str>,
    pub version: Arc<str>,
    pub body_type_url: String,
    pub encoded: Bytes,
    pub digest: u128,
    pub line: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    collection: String,
    name: String,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    labels: BTreeMap<YamlString, YamlString>,
    #[serde(default)]
    annotations: BTreeMap<YamlString, YamlString>,
    body: Body,
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
struct YamlString(String);

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
struct YamlValue(serde_json::Value);

impl<'de> Deserialize<'de> for YamlValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(YamlValueVisitor).map(YamlValue)
    }
}

struct YamlValueVisitor;

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

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        spend_value::<A::Error>()?;
        let mut fields = serde_json::Map::new();
        while let Some((YamlKey(key), YamlValue(value))) = map.next_entry()? {
            fields.insert(key, value);
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

/// The line of a top-level `key:` in a document starting at `start`.
fn key_line(document: &str, start: usize, key: &str) -> usize {
    document
        .lines()
        .position(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(':')))
        .map_or(start, |i| start + i)
}

/// Parses one file's text. Every document must be valid for any to count.
pub fn parse(path: &str, text: &str, table: &CollectionTable) -> Result<Vec<Parsed>, ParseError> {
    let mut parsed = Vec::new();
    let mut seen: HashMap<(Arc<str>, String), usize> = HashMap::new();
    for (start, document) in documents(text) {
        let fail = |line: usize, reason: String| ParseError {
            path: path.to_owned(),
            line,
            reason,
        };
        VALUES_LEFT.with(|left| left.set(value_budget(&document)));
        let doc: Document = serde_norway::from_str(&document).map_err(|e| {
            let message = e.to_string();
            match e.location() {
                // The line is reported in the file, not in the document.
                Some(at) => {
                    let suffix = format!(" at line {} column {}", at.line(), at.column());
                    let message = message.strip_suffix(&suffix).unwrap_or(&message);
                    fail(
                        start + at.line().saturating_sub(1),
                        format!("{message} (column {})", at.column()),
                    )
                }
                None => fail(start, message),
            }
        })?;
        let collection = table.name(doc.collection.trim()).ok_or_else(|| {
            fail(
                key_line(&document, start, "collection"),
                format!(
                    "collection {:?} is not a known collection; add it with --type-map (collection: type_url)",
                    doc.collection
                ),
            )
        })?;
        if doc.name.trim().is_empty() {
            return Err(fail(
                key_line(&document, start, "name"),
                "name is empty; every resource needs a name".into(),
            ));
        }
        let name_line = key_line(&document, start, "name");
        if let Some(first) = seen.insert((collection.clone(), doc.name.clone()), name_line) {
            return Err(fail(
                name_line,
                format!(
                    "{:?} in {collection} is defined twice (first at line {first}); names must be unique",
                    doc.name
                ),
            ));
        }
        let body = body(doc.body).map_err(|(reason, path)| {
            let body_line = key_line(&document, start, "body");
            fail(
                path.map_or(body_line, |path| field_line(&document, start, body_line, &path)),
                format!("body of {:?}: {reason}", doc.name),
            )
        })?;
        let metadata = Metadata {
            name: doc.name.clone(),
            version: doc.version.unwrap_or_default(),
            labels: doc.labels.into_iter().map(|(k, v)| (k.0, v.0)).collect(),
            annotations: doc.annotations.into_iter().map(|(k, v)| (k.0, v.0)).collect(),
            ..Default::default()
        };
        let encoded: Bytes = Resource {
            metadata: Some(metadata),
            body: Some(body),
        }
        .encode_to_vec()
        .into();
        // The same validation, and the same version rule, as upstream data.
        let resource = crate::source::validate::decode_resources(&collection, &[encoded])
            .map_err(|nack| fail(start, nack.message))?
            .pop()
            .expect("one resource in, one out");
        parsed.push(Parsed {
            collection,
            name: resource.name.clone(),
            version: resource.version.clone(),
            body_type_url: resource.body_type_url.to_string(),
            encoded: resource.encoded.clone(),
            digest: resource.digest,
            line: start,
        });
    }
    Ok(parsed)
}

/// The body as an `Any`; an error says why, and which field of a `json`
/// body failed (a path from the body).
fn body(body: Body) -> Result<prost_types::Any, (String, Option<String>)> {
    let whole = |reason: String| (reason, None);
    match (body.type_url, body.value_base64, body.structure, body.json) {
        (Some(type_url), Some(value), None, None) => {
            if type_url.trim().is_empty() {
                return Err(whole("type_url is empty".into()));
            }
            let value = base64::engine::general_purpose::STANDARD
                .decode(value.trim())
                .map_err(|e| whole(format!("value_base64 is not base64: {e}")))?;
            Ok(prost_types::Any { type_url, value })
        }
        (Some(type_url), None, None, Some(YamlValue(json))) => {
            let value = super::envoy_json::encode(type_url.trim(), &json).map_err(|e| {
                let path = format!("json.{}", e.path);
                (e.to_string(), Some(path))
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

/// The line of the field at `path` (`json.filter_chains[0].filters`) under
/// the body at `body_line`: each named step is looked for as a `key:` after
/// the previous one (indexes are not counted: the nearest following key is
/// taken), so the line is that of the field, or of its nearest parent found.
fn field_line(document: &str, start: usize, body_line: usize, path: &str) -> usize {
    let lines: Vec<&str> = document.lines().collect();
    let mut at = body_line.saturating_sub(start);
    for step in path.split('.') {
        let key = step.split('[').next().unwrap_or(step).trim_matches('"');
        if key.is_empty() {
            continue;
        }
        let found = lines.iter().enumerate().skip(at + 1).find(|(_, line)| {
            let line = line.trim_start().trim_start_matches("- ");
            line.strip_prefix(key)
                .or_else(|| line.strip_prefix(&format!("\"{key}\"")))
                .or_else(|| line.strip_prefix(&format!("'{key}'")))
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
        });
        match found {
            Some((i, _)) => at = i,
            None => break,
        }
    }
    start + at
}

#[derive(Debug, Default)]
struct FileState {
    /// What the file held when it last parsed.
    good: Vec<Parsed>,
    /// Why its current content does not parse.
    error: Option<ParseError>,
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
    published: BTreeSet<Arc<str>>,
    /// `--max-message-bytes`: a larger file is an error, not read.
    max_file_bytes: usize,
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
        }
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
        let read = tokio::task::spawn_blocking(move || read_all(&dir, &table, max)).await;
        match read {
            Ok(Ok(contents)) => {
                self.files.retain(|path, _| contents.iter().any(|(p, _)| p == path));
                for (path, parsed) in contents {
                    self.update_file(path, parsed);
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
        let state = self.files.entry(path).or_default();
        match result {
            Ok(parsed) => {
                if state.error.take().is_some() {
                    tracing::info!(count = parsed.len(), "a source file parses again");
                }
                state.good = parsed;
            }
            Err(error) => {
                if state.error.as_ref() != Some(&error) {
                    tracing::warn!(
                        %error,
                        kept = state.good.len(),
                        "a source file does not parse; its collections keep their last good state"
                    );
                }
                state.error = Some(error);
            }
        }
    }

    /// Applies the state of every collection the files, the subscriptions or
    /// an earlier publish name.
    fn publish(&mut self) {
        let mut collections: BTreeMap<Arc<str>, Vec<CachedResource>> = BTreeMap::new();
        let mut owner: HashMap<(Arc<str>, Arc<str>), &str> = HashMap::new();
        for (path, state) in &self.files {
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
                owner.insert(key, path);
                collections
                    .entry(parsed.collection.clone())
                    .or_default()
                    .push(CachedResource::new(
                        parsed.name.clone(),
                        parsed.version.clone(),
                        parsed.body_type_url.as_str().into(),
                        parsed.encoded.clone(),
                        parsed.digest,
                    ));
            }
        }
        let wanted = self.subscriptions.current().wanted;
        for collection in wanted.into_iter().chain(self.published.iter().cloned()) {
            collections.entry(collection).or_default();
        }
        for (collection, resources) in collections {
            let applied = self.writer.apply(&collection, Update::Full(resources), Origin::Files);
            if matches!(applied, crate::cache::Applied::Changed { .. }) {
                metrics::counter!(crate::metrics::UPDATES_APPLIED, "collection" => collection.clone(), "kind" => "full")
                    .increment(1);
            }
            self.published.insert(collection);
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

/// What one file parses to.
type ParsedFile = Result<Vec<Parsed>, ParseError>;

/// Every YAML file's path and what it parses to (an unreadable file is a
/// parse error at line 0). Blocking: run on the blocking pool.
fn read_all(
    dir: &SourceDir,
    table: &CollectionTable,
    max_file_bytes: usize,
) -> std::io::Result<Vec<(String, ParsedFile)>> {
    let texts: Vec<(String, Result<String, String>)> = match dir {
        SourceDir::Embedded => EMBEDDED_EXAMPLES
            .iter()
            .map(|(name, text)| (format!("<embedded>/{name}"), Ok(text.to_string())))
            .collect(),
        SourceDir::Dir(dir) => {
            let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_yaml(p))
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
    };
    Ok(texts
        .into_iter()
        .map(|(path, text)| {
            let parsed = text
                .map_err(|reason| ParseError {
                    path: path.clone(),
                    line: 0,
                    reason,
                })
                .and_then(|text| parse(&path, &text, table));
            (path, parsed)
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
        let wrong_kind = text.replace("connect_timeout: 0.25s", "connect_timeout: [1]");
        let err = parse("clusters.yaml", &wrong_kind, &table()).unwrap_err();
        assert_eq!(err.line, 7, "{err}");
        assert!(err.reason.contains("json.connect_timeout"), "{err}");
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
        ];
        for (text, line, reason) in cases {
            let error = parse("dir/f.yaml", text, &table()).unwrap_err();
            assert_eq!(error.path, "dir/f.yaml");
            assert_eq!(error.line, line, "{text}: {error}");
            assert!(error.reason.contains(reason), "{text}: {error}");
        }
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
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let error = read_text(&fifo, 1024).unwrap_err();
            assert!(error.contains("not a regular file"), "{error}");
        }
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
