//! The config dump: `/debug/cache/{collection}?bodies=json|yaml`, each
//! resource with its metadata and its body read back (Struct, Istio's kinds
//! and Envoy's types natively, by the descriptors the files source encodes
//! with, so YAML written in gives its spec back; others through
//! `--descriptors`, else its size and a preview of its bytes). Every field
//! marked `(udpa.annotations.sensitive) = true` reads `[redacted]`, a body
//! of a sensitive collection whose secrets the gateway does not know reads
//! `[redacted]` whole, and a body of a sensitive type (or of no type: a
//! type URL that is not one) that cannot be read shows no bytes.

use std::collections::BTreeMap;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use prost::Message;
use serde_json::{json, Value};

use crate::cache::{CachedResource, CollectionSnapshot};
use crate::proto::wire::RawResource;
use crate::source::proto_json::{
    hidden_whole, redact_quoted, shown_type_url, without_type_name, BodyDecoder, REDACTED,
};
use crate::transport::safe_text::yaml_terminal_safe;

/// `?bodies=`.
#[derive(Debug, Default, serde::Deserialize)]
pub struct DumpQuery {
    pub bodies: Option<String>,
}

/// How much of an undecodable body the dump shows.
const PREVIEW_BYTES: usize = 64;

/// A resource with its metadata and body; `sensitive`: the body type its
/// collection declares, when it is a sensitive one (see [`shown`]).
pub(super) fn resource(resource: &CachedResource, bodies: &BodyDecoder, sensitive: Option<&str>) -> Value {
    shown(resource, bodies, sensitive).0
}

/// [`resource`], with digests of what its body's redacted fields held, by
/// path (for telling a changed secret apart; never shown). A body of a
/// `sensitive` collection is shown only as far as the gateway knows its
/// secrets (a `Secret`, a `Cluster`: those fields `[redacted]`); any other
/// (a `Struct`, a `StringValue`, a type without marks, one that does not
/// decode) is `[redacted]` whole, whatever its type URL says: the
/// collection is what clients are refused, so it is what the views hide.
/// Only the collection's own body type (`sensitive`) is read: a body there
/// claiming another type is hidden whole (a `Secret`'s bytes labelled a
/// `RouteConfiguration` would decode as one, its key in a field no mark
/// covers).
pub(super) fn shown(
    resource: &CachedResource,
    bodies: &BodyDecoder,
    sensitive: Option<&str>,
) -> (Value, BTreeMap<String, u64>) {
    let raw = RawResource::decode(resource.encoded.clone()).unwrap_or_default();
    let mut metadata = raw.metadata.unwrap_or_default();
    let any = raw
        .body
        .and_then(|b| prost_types::Any::decode(b).ok())
        .unwrap_or_default();
    let whole = hidden_whole(sensitive, &any.type_url);
    let (body, secrets) = match bodies.decode_redacted(&any.type_url, &any.value) {
        Ok(_) if whole => (json!(REDACTED), BTreeMap::from([(String::new(), digest(&any.value))])),
        Ok(body) => (body.json, body.secrets),
        // A secret's bytes are never shown, not even a few.
        // Nor what the error quotes of them (a type URL an `Any` inside it
        // names, a string it holds).
        Err(why) if whole || !bodies.previewable(&any.type_url, &any.value) => (
            json!({
                "bytes": any.value.len(),
                "not_decoded": match shown_type_url(sensitive, &any.type_url) {
                    shown if shown == any.type_url => redact_quoted(&why),
                    _ => without_type_name(&redact_quoted(&why), &any.type_url),
                },
                "sensitive": true,
            }),
            BTreeMap::from([(String::new(), digest(&any.value))]),
        ),
        Err(why) => (
            json!({
                "bytes": any.value.len(),
                "preview_base64": base64::engine::general_purpose::STANDARD
                    .encode(&any.value[..any.value.len().min(PREVIEW_BYTES)]),
                "not_decoded": why,
            }),
            BTreeMap::new(),
        ),
    };
    // Annotations of a sensitive collection's resource are redacted too:
    // `kubectl apply` keeps a copy of the whole object in one
    // (`kubectl.kubernetes.io/last-applied-configuration`), and any may
    // hold what the body does. Their keys stay; a change of one is told
    // apart by its digest, as a redacted field is.
    let mut secrets = secrets;
    let annotations: BTreeMap<String, String> = match sensitive {
        Some(_) => metadata
            .annotations
            .iter()
            .map(|(key, value)| {
                secrets.insert(format!("annotations.{key}"), digest(value.as_bytes()));
                (key.clone(), REDACTED.to_owned())
            })
            .collect(),
        None => std::mem::take(&mut metadata.annotations).into_iter().collect(),
    };
    let create_time = metadata.create_time.map(|t| {
        let at = std::time::UNIX_EPOCH
            + std::time::Duration::new(
                u64::try_from(t.seconds).unwrap_or(0),
                u32::try_from(t.nanos).unwrap_or(0),
            );
        humantime::format_rfc3339(at).to_string()
    });
    let value = json!({
        "name": resource.name,
        "version": resource.version(),
        "content_version": resource.content_version(),
        "create_time": create_time,
        "labels": metadata.labels,
        "annotations": annotations,
        "type_url": shown_type_url(sensitive, &any.type_url),
        "body": body,
    });
    (value, secrets)
}

fn digest(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// The dump of `snapshot` (`head`: its summary) in `format`.
pub fn dump(
    snapshot: &CollectionSnapshot,
    mut head: Value,
    format: &str,
    bodies: &BodyDecoder,
    sensitive: Option<&str>,
) -> Response {
    head["resources"] = snapshot
        .resources
        .values()
        .map(|r| resource(r, bodies, sensitive))
        .collect();
    match format {
        "json" => axum::Json(head).into_response(),
        "yaml" => match yaml_terminal_safe(&head) {
            Ok(text) => ([(header::CONTENT_TYPE, "application/yaml; charset=utf-8")], text).into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write YAML: {e}\n")).into_response(),
        },
        other => (
            StatusCode::BAD_REQUEST,
            format!("bodies={other:?}: give bodies=json or bodies=yaml\n"),
        )
            .into_response(),
    }
}
