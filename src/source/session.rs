//! The sink side of one MCP stream, whoever dialled it: the initial
//! `RequestResources` per collection, then for each `Resources` message:
//! validate, apply to the cache, and answer with an ACK or a NACK whose message
//! a person can act on. A NACKed message leaves the cache exactly as it was.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use prost::Message;
use tonic::Code;

use super::validate::{decode_shared_resources, SecretGuard};
use crate::cache::{Applied, Cache, CacheWriter, Origin, Update};
use crate::metrics as m;
use crate::proto::wire::RawResources;
use crate::proto::{RequestResources, SinkNode};
use crate::source::persisted::Persister;
use crate::transport::requests::FromBuffer;
use crate::SharedStr;

/// The collection of Galley's dial-out trigger from 1.2 on.
pub const TRIGGER_COLLECTION: &str = "$triggerCollection";

/// Why a `Resources` message was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Nack {
    pub code: Code,
    pub message: String,
}

impl Nack {
    pub(super) fn invalid(message: String) -> Self {
        Self {
            code: Code::InvalidArgument,
            message,
        }
    }
}

/// A source's `Resources` message as its stream reads it, and the buffer it
/// was read into, where its resources' records are relabelled as the
/// cache's storage records: a collection stored afresh keeps them there
/// instead of copying them.
#[derive(Debug)]
pub struct Received {
    pub message: RawResources,
    pub buffer: Bytes,
}

impl FromBuffer for Received {
    fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
        let (message, buffer) = RawResources::decode_relabelled(buf, crate::cache::STORAGE_FIELD)?;
        Ok(Self { message, buffer })
    }
}

/// A source's response as the probe reads it (`probe.rs`): prost's decoding,
/// its resources shares of the message.
impl FromBuffer for RawResources {
    fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
        crate::proto::wire::decode_shared(&buf.freeze())
    }
}

/// A message without a buffer to keep (tests, messages made in the gateway).
impl From<RawResources> for Received {
    fn from(message: RawResources) -> Self {
        Self {
            message,
            buffer: Bytes::new(),
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
    collections: HashMap<SharedStr, bool>,
    /// Subscribed collections applied (ACKed) at least once on this stream.
    applied: HashSet<SharedStr>,
    /// Writes each changed collection to `--cache-dir`.
    persister: Option<Persister>,
    /// `--max-message-bytes`, for error messages.
    max_message_bytes: usize,
    /// Refuses a secret's body outside the collections of secrets.
    secrets: Option<Arc<SecretGuard>>,
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
            secrets: None,
        }
    }

    /// Of what an upstream gateway serves as sensitive, the collections
    /// this session would take in as not sensitive
    /// ([`SecretGuard::served_open`]; none without a guard).
    pub fn served_open(&self, sensitive: &[String]) -> Vec<String> {
        self.secrets
            .as_deref()
            .map_or_else(Vec::new, |guard| guard.served_open(sensitive))
    }

    /// Refuses (NACKs) a secret's body outside the collections of secrets.
    pub fn refusing_secrets(mut self, secrets: Option<Arc<SecretGuard>>) -> Self {
        self.secrets = secrets;
        self
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
    pub fn subscribe(&mut self, collection: SharedStr) -> Option<RequestResources> {
        // Collection "" is Galley's trigger, never a collection to ask for.
        if collection.is_empty() || self.collections.contains_key(&collection) {
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

    /// Galley's dial-out speaks first with a trigger: `Resources` for
    /// collection `""` (1.1) or `$triggerCollection` (1.2 on).
    pub fn is_trigger(message: &RawResources) -> bool {
        message.collection.is_empty() || message.collection == TRIGGER_COLLECTION
    }

    /// The answer Galley 1.1 requires to its trigger before it serves
    /// anything: a NACK with code `UNIMPLEMENTED` (1.2 on ignores it).
    pub fn trigger_reply(&self, message: &RawResources) -> RequestResources {
        self.nack_reply(
            message,
            &Nack {
                code: Code::Unimplemented,
                message: "the trigger of a dial-out stream: this sink asks for its collections next".into(),
            },
        )
    }

    /// The NACK of `message`.
    fn nack_reply(&self, message: &RawResources, nack: &Nack) -> RequestResources {
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

    /// Validates and applies one message; returns the ACK or NACK for it.
    pub fn handle(&mut self, mut received: Received, writer: &mut CacheWriter) -> Handled {
        // What the message was, for the metrics and the log: its resources
        // are taken while it is applied.
        let (size, count) = (received.message.encoded_len(), received.message.resources.len());
        let outcome = self.apply(&mut received, writer);
        let message = received.message;
        let collection_label = if self.is_subscribed(&message.collection) {
            message.collection.clone()
        } else {
            "unsubscribed".to_owned()
        };
        m::MESSAGE_SIZE_HISTOGRAM
            .series(&[
                ("component", m::COMPONENT_UPSTREAM),
                ("collection", collection_label.as_str()),
            ])
            .record(size as u64);
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
                    collection = %crate::transport::safe_text::terminal_safe(&message.collection),
                    nonce = %crate::transport::safe_text::terminal_safe(&message.nonce),
                    source_version = %crate::transport::safe_text::terminal_safe(&message.system_version_info),
                    incremental = message.incremental,
                    resources = count,
                    changed = matches!(applied, crate::cache::Applied::Changed { .. }),
                    version = %applied.version(),
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
                    "code" => m::code_number(nack.code as i32)
                )
                .increment(1);
                tracing::warn!(
                    collection = %crate::transport::safe_text::terminal_safe(&message.collection),
                    nonce = %crate::transport::safe_text::terminal_safe(&message.nonce),
                    code = m::code_label(nack.code as i32),
                    reason = %crate::transport::safe_text::terminal_safe(&nack.message),
                    "NACK sent upstream; the cache keeps its previous state"
                );
                self.nack_reply(&message, nack)
            }
        };
        Handled { reply, outcome }
    }

    fn apply(&self, received: &mut Received, writer: &mut CacheWriter) -> Result<Applied, Nack> {
        // The resources' slices of the message, freed once decoded: the
        // cache's entries for a large collection take their room.
        let raw = std::mem::take(&mut received.message.resources);
        let message = &received.message;
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
        let resources = decode_shared_resources(collection, &raw, self.secrets.as_deref())?;
        drop(raw);
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
        Ok(writer.apply_message(collection, update, self.origin, &received.buffer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Metadata, Resource};
    use crate::source::validate::decode_resources;
    use bytes::Bytes;

    const C: &str = "istio/networking/v1alpha3/gateways";

    fn session() -> (SinkSession, CacheWriter) {
        let (cache, writer) = Cache::new();
        let mut s = SinkSession::new(
            SinkNode {
                id: "gw".into(),
                annotations: Default::default(),
            },
            true,
            cache,
        );
        assert!(s.subscribe("".into()).is_none(), "collection \"\" is never asked for");
        s.subscribe(C.into());
        (s, writer)
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
        assert_eq!(decoded[0].version(), "7");
        assert_eq!(
            crate::proto::wire::resource_body_type_url(&decoded[0].encoded).as_deref(),
            Some("type.googleapis.com/x.Y")
        );
    }

    #[test]
    fn a_missing_version_becomes_a_body_hash_and_the_body_is_kept() {
        let bytes = encoded("a", "", Some(b"body"));
        let decoded = decode_resources(C, &[bytes]).unwrap();
        let resource = Resource::decode(decoded[0].encoded.clone()).unwrap();
        assert_eq!(resource.metadata.unwrap().version, decoded[0].version());
        assert_eq!(resource.body.unwrap().value, b"body");
        assert_eq!(decoded[0].version().len(), 32);
    }

    #[test]
    fn an_invalid_message_is_nacked_and_applies_nothing() {
        let (mut s, mut writer) = session();
        let handled = s.handle(
            RawResources {
                collection: C.into(),
                nonce: "1".into(),
                resources: vec![encoded("a", "1", Some(b"x")), encoded("b", "1", None)],
                ..Default::default()
            }
            .into(),
            &mut writer,
        );
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

    #[test]
    fn a_collection_is_stored_in_the_buffer_it_was_read_into_in_its_order() {
        use crate::proto::wire::test_support::encoded_resource;
        let (mut s, mut writer) = session();
        let names = ["z", "a", "m"];
        let message = RawResources {
            collection: C.into(),
            nonce: "1".into(),
            resources: names.iter().map(|n| encoded_resource(n, "1", n.as_bytes())).collect(),
            ..Default::default()
        };
        let received = Received::from_buffer(BytesMut::from(&message.encode_to_vec()[..])).unwrap();
        let buffer = received.buffer.clone();
        assert!(s.handle(received, &mut writer).outcome.is_ok());
        let snapshot = s.cache.get(C).unwrap();
        let range = buffer.as_ptr() as usize..buffer.as_ptr() as usize + buffer.len();
        assert!(snapshot
            .chunks()
            .all(|c| range.contains(&(c.bytes().as_ptr() as usize))));
        // The chunks are a legacy response's resources as they are.
        let mut response = bytes::BytesMut::new();
        for chunk in snapshot.chunks() {
            response.extend_from_slice(chunk.bytes());
        }
        let response = crate::proto::MeshConfigResponse::decode(response.freeze()).unwrap();
        let order: Vec<String> = response
            .resources
            .iter()
            .map(|r| r.metadata.clone().unwrap().name)
            .collect();
        assert_eq!(order, names, "in the order they arrived");
    }
}
