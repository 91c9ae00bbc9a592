//! The sink side of one MCP stream, whoever dialled it: the initial
//! `RequestResources` per collection, then for each `Resources` message:
//! validate, apply to the cache, and answer with an ACK or a NACK whose message
//! a person can act on. A NACKed message leaves the cache exactly as it was.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use tonic::Code;

use crate::cache::{body_version, content_digest, Applied, Cache, CachedResource, Origin, Update};
use crate::metrics as m;
use crate::persist::Persister;
use crate::proto::{RequestResources, SinkNode};
use crate::wire::{AnyTypeUrl, RawResource, RawResources};

/// Why a `Resources` message was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Nack {
    pub code: Code,
    pub message: String,
}

impl Nack {
    fn invalid(message: String) -> Self {
        Self {
            code: Code::InvalidArgument,
            message,
        }
    }
}

/// The result of handling one `Resources` message.
#[derive(Debug)]
pub struct Handled {
    /// The ACK or NACK to send back.
    pub reply: RequestResources,
    pub outcome: Result<Applied, Nack>,
}

#[derive(Debug)]
pub struct SinkSession {
    node: SinkNode,
    /// Ask for incremental updates (`--no-incremental` turns it off).
    incremental: bool,
    cache: Arc<Cache>,
    origin: Origin,
    /// Subscribed collections on this stream → whether incremental was asked.
    collections: HashMap<Arc<str>, bool>,
    /// Subscribed collections applied (ACKed) at least once on this stream.
    applied: HashSet<Arc<str>>,
    /// Writes each changed collection to `--cache-dir`.
    persister: Option<Persister>,
    /// `--max-message-bytes`, for error messages.
    max_message_bytes: usize,
}

// === impl SinkSession ===

impl SinkSession {
    pub fn new(node: SinkNode, incremental: bool, cache: Arc<Cache>) -> Self {
        Self {
            node,
            incremental,
            cache,
            origin: Origin::Upstream,
            collections: HashMap::new(),
            applied: HashSet::new(),
            persister: None,
            max_message_bytes: usize::MAX,
        }
    }

    /// The receive limit the transport enforces, for error messages.
    pub fn with_max_message_bytes(mut self, max: usize) -> Self {
        self.max_message_bytes = max;
        self
    }

    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Whether every collection subscribed on this stream has been applied
    /// at least once: the stream made progress.
    pub fn applied_every_collection(&self) -> bool {
        !self.collections.is_empty() && self.collections.keys().all(|c| self.applied.contains(c))
    }

    /// Persists every collection this session changes.
    pub fn persisting(mut self, persister: Option<Persister>) -> Self {
        self.persister = persister;
        self
    }

    pub fn is_subscribed(&self, collection: &str) -> bool {
        self.collections.contains_key(collection)
    }

    /// The initial request for a collection on this stream, or `None` when it
    /// was already requested. With incremental on, it carries the versions the
    /// cache holds so a source could resume from them.
    pub fn subscribe(&mut self, collection: Arc<str>) -> Option<RequestResources> {
        if self.collections.contains_key(&collection) {
            return None;
        }
        let initial_resource_versions = if self.incremental {
            self.cache.resource_versions(&collection)
        } else {
            HashMap::new()
        };
        self.collections.insert(collection.clone(), self.incremental);
        Some(RequestResources {
            sink_node: Some(self.node.clone()),
            collection: collection.to_string(),
            initial_resource_versions,
            response_nonce: String::new(),
            error_detail: None,
            incremental: self.incremental,
        })
    }

    /// Validates and applies one message; returns the ACK or NACK for it.
    pub fn handle(&mut self, message: RawResources) -> Handled {
        let outcome = self.apply(&message);
        let collection_label = if self.is_subscribed(&message.collection) {
            message.collection.clone()
        } else {
            "unsubscribed".to_owned()
        };
        metrics::histogram!(
            m::MESSAGE_SIZES,
            "component" => m::COMPONENT_UPSTREAM,
            "collection" => collection_label.clone()
        )
        .record(message.encoded_len() as f64);
        let reply = match &outcome {
            Ok(applied) => {
                if let Some((name, _)) = self.collections.get_key_value(message.collection.as_str()) {
                    self.applied.insert(name.clone());
                }
                if let (Some(persister), Applied::Changed { .. }) = (&self.persister, applied) {
                    persister.changed(&message.collection);
                }
                metrics::counter!(m::REQUEST_ACKS, "component" => m::COMPONENT_UPSTREAM, "collection" => collection_label)
                    .increment(1);
                tracing::debug!(
                    collection = %message.collection,
                    nonce = %message.nonce,
                    source_version = %message.system_version_info,
                    incremental = message.incremental,
                    resources = message.resources.len(),
                    ?applied,
                    "applied upstream update"
                );
                RequestResources {
                    sink_node: Some(self.node.clone()),
                    collection: message.collection.clone(),
                    initial_resource_versions: HashMap::new(),
                    response_nonce: message.nonce.clone(),
                    error_detail: None,
                    incremental: self
                        .collections
                        .get(message.collection.as_str())
                        .copied()
                        .unwrap_or(false),
                }
            }
            Err(nack) => {
                metrics::counter!(
                    m::REQUEST_NACKS,
                    "component" => m::COMPONENT_UPSTREAM,
                    "collection" => collection_label,
                    "code" => m::code_label(nack.code as i32)
                )
                .increment(1);
                tracing::warn!(
                    collection = %message.collection,
                    nonce = %message.nonce,
                    code = ?nack.code,
                    reason = %nack.message,
                    "NACK sent upstream; the cache keeps its previous state"
                );
                RequestResources {
                    sink_node: Some(self.node.clone()),
                    collection: message.collection.clone(),
                    initial_resource_versions: HashMap::new(),
                    response_nonce: message.nonce.clone(),
                    error_detail: Some(tonic_types::Status {
                        code: nack.code as i32,
                        message: nack.message.clone(),
                        details: Vec::new(),
                    }),
                    incremental: false,
                }
            }
        };
        Handled { reply, outcome }
    }

    fn apply(&self, message: &RawResources) -> Result<Applied, Nack> {
        let collection = message.collection.as_str();
        let Some(&incremental_requested) = self.collections.get(collection) else {
            let mut subscribed: Vec<&str> = self.collections.keys().map(|c| &**c).collect();
            subscribed.sort_unstable();
            return Err(Nack {
                code: Code::Unimplemented,
                message: format!(
                    "collection {collection:?} is not subscribed by this sink (subscribed: {})",
                    subscribed.join(", ")
                ),
            });
        };
        if message.incremental && !incremental_requested {
            return Err(Nack::invalid(format!(
                "incremental update for collection {collection:?}, but this sink requested full state for it \
                 (incremental: false); send the complete collection"
            )));
        }
        let resources = decode_resources(collection, &message.resources)?;
        if message.incremental {
            let upserted: HashSet<&str> = resources.iter().map(|r| &*r.name).collect();
            if let Some(name) = message.removed_resources.iter().find(|n| upserted.contains(n.as_str())) {
                return Err(Nack::invalid(format!(
                    "resource {name:?} of collection {collection:?} is both updated and removed in one incremental \
                     update; send one or the other"
                )));
            }
        }
        let update = if message.incremental {
            Update::Incremental {
                upserts: resources,
                removed: message.removed_resources.clone(),
            }
        } else {
            // `removed_resources` means nothing in a full state.
            Update::Full(resources)
        };
        let kind = if message.incremental { "incremental" } else { "full" };
        metrics::counter!(m::UPDATES_APPLIED, "collection" => collection.to_owned(), "kind" => kind).increment(1);
        Ok(self.cache.apply(collection, update, self.origin))
    }
}

/// Validates every resource of a message and turns it into cache entries.
/// Nothing is applied unless every resource is valid.
pub fn decode_resources(collection: &str, raw: &[Bytes]) -> Result<Vec<CachedResource>, Nack> {
    let mut seen = HashSet::with_capacity(raw.len());
    let mut resources = Vec::with_capacity(raw.len());
    for (index, bytes) in raw.iter().enumerate() {
        let resource = RawResource::decode(bytes.clone()).map_err(|e| {
            Nack::invalid(format!(
                "resource #{index} of collection {collection:?} is not a valid istio.mcp.v1alpha1.Resource: {e}"
            ))
        })?;
        let Some(mut metadata) = resource.metadata else {
            return Err(Nack::invalid(format!(
                "resource #{index} of collection {collection:?} has no metadata; every resource needs metadata with a name"
            )));
        };
        if metadata.name.is_empty() {
            return Err(Nack::invalid(format!(
                "resource #{index} of collection {collection:?} has an empty metadata.name; \
                 every resource needs a name unique in its collection"
            )));
        }
        let name = metadata.name.clone();
        let Some(body) = resource.body else {
            return Err(Nack::invalid(format!(
                "resource {name:?} of collection {collection:?} has no body"
            )));
        };
        let body_type_url = AnyTypeUrl::decode(body.clone())
            .map_err(|e| {
                Nack::invalid(format!(
                    "resource {name:?} of collection {collection:?} has a body that is not a google.protobuf.Any: {e}"
                ))
            })?
            .type_url;
        if !seen.insert(name.clone()) {
            return Err(Nack::invalid(format!(
                "resource {name:?} appears twice in one update of collection {collection:?}; \
                 names must be unique in a collection"
            )));
        }
        let digest = content_digest(&body, &metadata.labels, &metadata.annotations);
        // Keep the bytes as received. Only a missing version is filled in (a
        // hash of the body), so incremental clients can report it back; the
        // body itself is never re-encoded.
        let (version, encoded) = if metadata.version.is_empty() {
            let version = body_version(&body);
            metadata.version = version.clone();
            (version, encode_resource(&metadata, &body))
        } else {
            (metadata.version.clone(), bytes.clone())
        };
        resources.push(CachedResource::new(
            name.into(),
            version.into(),
            body_type_url,
            encoded,
            digest,
        ));
    }
    Ok(resources)
}

/// `Resource{metadata, body}` with the body's bytes copied as they are.
fn encode_resource(metadata: &crate::proto::Metadata, body: &Bytes) -> Bytes {
    use prost::encoding::{encode_key, encode_varint, message, WireType};
    let mut buf = BytesMut::with_capacity(metadata.encoded_len() + body.len() + 16);
    message::encode(1, metadata, &mut buf);
    encode_key(2, WireType::LengthDelimited, &mut buf);
    encode_varint(body.len() as u64, &mut buf);
    buf.put_slice(body);
    buf.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Metadata, Resource};

    const C: &str = "istio/networking/v1alpha3/gateways";

    fn session() -> SinkSession {
        let mut s = SinkSession::new(
            SinkNode {
                id: "gw".into(),
                annotations: Default::default(),
            },
            true,
            Arc::new(Cache::new()),
        );
        s.subscribe(C.into());
        s
    }

    fn encoded(name: &str, version: &str, body: Option<&[u8]>) -> Bytes {
        Resource {
            metadata: Some(Metadata {
                name: name.into(),
                version: version.into(),
                ..Default::default()
            }),
            body: body.map(|b| prost_types::Any {
                type_url: "type.googleapis.com/x.Y".into(),
                value: b.to_vec(),
            }),
        }
        .encode_to_vec()
        .into()
    }

    #[test]
    fn resources_pass_through_byte_for_byte() {
        let bytes = encoded("a", "7", Some(b"\x0a\x03abc"));
        let decoded = decode_resources(C, std::slice::from_ref(&bytes)).unwrap();
        assert_eq!(decoded[0].encoded, bytes);
        assert_eq!(&*decoded[0].version, "7");
        assert_eq!(decoded[0].body_type_url, "type.googleapis.com/x.Y");
    }

    #[test]
    fn a_missing_version_becomes_a_body_hash_and_the_body_is_kept() {
        let bytes = encoded("a", "", Some(b"body"));
        let decoded = decode_resources(C, &[bytes]).unwrap();
        let resource = Resource::decode(decoded[0].encoded.clone()).unwrap();
        assert_eq!(resource.metadata.unwrap().version, *decoded[0].version);
        assert_eq!(resource.body.unwrap().value, b"body");
        assert_eq!(decoded[0].version.len(), 32);
    }

    #[test]
    fn an_invalid_message_is_nacked_and_applies_nothing() {
        let mut s = session();
        let handled = s.handle(RawResources {
            collection: C.into(),
            nonce: "1".into(),
            resources: vec![encoded("a", "1", Some(b"x")), encoded("b", "1", None)],
            ..Default::default()
        });
        let nack = handled.outcome.unwrap_err();
        assert_eq!(nack.code, Code::InvalidArgument);
        assert!(
            nack.message.contains("\"b\"") && nack.message.contains("no body"),
            "{}",
            nack.message
        );
        assert!(s.cache.get(C).is_none());
        let status = handled.reply.error_detail.unwrap();
        assert_eq!(status.code, Code::InvalidArgument as i32);
        assert_eq!(handled.reply.response_nonce, "1");
        assert!(!handled.reply.incremental);
    }
}
