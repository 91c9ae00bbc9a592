//! What every source's resources must be before they reach the cache: a
//! decodable `Resource` with metadata, a name unique in its collection, and a
//! body that is an `Any`. Upstream messages, local files and persisted files
//! all pass through here, and a resource without a version gets a hash of its
//! body as its version.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

use super::proto_json::{SecretTypes, ViewsOfType};
use super::session::Nack;
use crate::cache::{body_version, content_digest, keyed_body_version, keyed_content_digest, CachedResource};
use crate::collections::CollectionTable;
use crate::proto::wire::{AnyBytes, RawResource};
use crate::SharedStr;

/// What keeps a secret's body out of the collections every client may read,
/// for a source that may write any collection (Galley, a chained gateway,
/// Galley's dial-out): a body that is or wraps a secret's type
/// ([`SecretTypes`]) is refused outside the collections of secrets, as the
/// files source refuses it.
#[derive(Clone, Debug)]
pub struct SecretGuard {
    table: Arc<CollectionTable>,
    types: SecretTypes,
}

impl SecretGuard {
    pub fn new(table: Arc<CollectionTable>) -> Self {
        let types = SecretTypes::of(&table);
        Self { table, types }
    }

    /// Whether `collection` is one of secrets here.
    pub fn is_sensitive(&self, collection: &str) -> bool {
        self.table.is_sensitive(collection)
    }

    /// Of `sensitive` (what an upstream gateway says it serves as
    /// sensitive: collections and body type URLs), the collections this
    /// gateway serves but not as sensitive.
    pub fn served_open(&self, sensitive: &[String]) -> Vec<String> {
        sensitive
            .iter()
            .filter(|name| self.table.get(name).is_some() && !self.table.is_sensitive(name))
            .cloned()
            .collect()
    }

    /// Why `body` (an encoded `Any` of a type URL a secret's type may be or
    /// not, as `may_hold` says: [`BodyTypes`]) may not be in `collection`.
    fn refusal(&self, collection: &str, may_hold: bool, body: &Bytes) -> Option<String> {
        if !(may_hold || self.types.may_nest(body)) || self.table.is_sensitive(collection) {
            return None;
        }
        // Only a secret's type, a wrapper, or a body naming a secret's type
        // gets here: its value is read (in place).
        let any = crate::proto::wire::AnyBytes::decode(body.clone()).ok()?;
        self.types.refusal(collection, false, &any.type_url, &any.value)
    }
}

/// What the bodies of one message need read of their type URL, read once
/// for a run of bodies of the same type URL (a collection's bodies share
/// one): whether a secret's type may be it (string work on the URL: the
/// built-in secret types, names like a secret's, other versions of Envoy's
/// API) and how the views read its bodies ([`ViewsOfType`]). Together about
/// 6,700 instructions, which every resource of a large update paid
/// (BENCHMARKS, session 31).
struct BodyTypes<'a> {
    secrets: Option<&'a SecretGuard>,
    last: Option<TypeFacts>,
}

/// What [`BodyTypes`] read of one type URL.
struct TypeFacts {
    type_url: String,
    /// With a [`SecretGuard`]: whether a secret's type may be this one.
    may_hold: bool,
    /// How the views read a body of this type, read where first asked.
    views: std::cell::OnceCell<ViewsOfType>,
}

impl TypeFacts {
    /// [`super::proto_json::hidden_in_part`] for a body of this type.
    fn hidden_in_part(&self, value: &[u8]) -> bool {
        self.views
            .get_or_init(|| ViewsOfType::of(&self.type_url))
            .hide_in_part(value)
    }
}

impl<'a> BodyTypes<'a> {
    fn new(secrets: Option<&'a SecretGuard>) -> Self {
        Self { secrets, last: None }
    }

    fn of(&mut self, type_url: &str) -> &TypeFacts {
        let facts = match self.last.take() {
            Some(last) if last.type_url == type_url => last,
            _ => TypeFacts {
                type_url: type_url.to_owned(),
                may_hold: self.secrets.is_some_and(|s| s.types.may_hold(type_url)),
                views: std::cell::OnceCell::new(),
            },
        };
        self.last.insert(facts)
    }
}

/// Validates every resource of a message and turns it into cache entries.
/// Nothing is applied unless every resource is valid.
pub fn decode_resources(collection: &str, raw: &[Bytes]) -> Result<Vec<CachedResource>, Nack> {
    decode(collection, raw, None, None)
}

/// As [`decode_resources`], the versions of a collection `table` says is
/// sensitive made with its key (the files source's rule, as the upstream's).
pub fn decode_resources_of(
    table: &CollectionTable,
    collection: &str,
    raw: &[Bytes],
) -> Result<Vec<CachedResource>, Nack> {
    decode(collection, raw, None, Some(table))
}

/// As [`decode_resources`], refusing a secret's body outside the
/// collections of secrets with `secrets` ([`SecretGuard`]): what was
/// persisted is held to the rule the source is (a file written by an
/// earlier build, or by anyone else, is not trusted more).
pub fn decode_resources_refusing(
    collection: &str,
    raw: &[Bytes],
    secrets: Option<&SecretGuard>,
) -> Result<Vec<CachedResource>, Nack> {
    decode(collection, raw, secrets, secrets.map(|s| &*s.table))
}

/// As [`decode_resources`], each entry in the `Arc` the cache shares it by:
/// a large message's entries are then not held twice while they are taken
/// in (as values, then in `Arc`s). With `secrets`, a secret's body outside
/// the collections of secrets is refused ([`SecretGuard`]).
pub fn decode_shared_resources(
    collection: &str,
    raw: &[Bytes],
    secrets: Option<&SecretGuard>,
) -> Result<Vec<Arc<CachedResource>>, Nack> {
    decode(collection, raw, secrets, secrets.map(|s| &*s.table))
}

/// Decodes and checks `raw`. With `table`, the versions and content
/// digests of a sensitive collection's resources, and of any resource whose
/// body the views hide in part ([`hidden_in_part`]), are
/// keyed ([`keyed_content_digest`]): a version is then no test of a guessed
/// secret.
fn decode<R: From<CachedResource>>(
    collection: &str,
    raw: &[Bytes],
    secrets: Option<&SecretGuard>,
    table: Option<&CollectionTable>,
) -> Result<Vec<R>, Nack> {
    let collection_key = table.and_then(|t| t.version_key(collection));
    let mut seen = HashSet::with_capacity(raw.len());
    let mut resources = Vec::with_capacity(raw.len());
    let mut types = BodyTypes::new(secrets);
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
        let name: SharedStr = SharedStr::from(metadata.name.as_str());
        let Some(body) = resource.body else {
            return Err(Nack::invalid(format!(
                "resource {name:?} of collection {collection:?} has no body"
            )));
        };
        // The body must be an `Any`; its type URL is read back from the
        // stored bytes when a view asks (`CachedResource::body_type_url`).
        let any = AnyBytes::decode(body.clone()).map_err(|e| {
            Nack::invalid(format!(
                "resource {name:?} of collection {collection:?} has a body that is not a google.protobuf.Any: {e}"
            ))
        })?;
        let facts = types.of(&any.type_url);
        if let Some(reason) = secrets.and_then(|s| s.refusal(collection, facts.may_hold, &body)) {
            return Err(Nack::invalid(format!(
                "resource {name:?} of collection {collection:?}: {reason}"
            )));
        }
        // The name's own `Arc`: a full state's set of names costs its table.
        if !seen.insert(name.clone()) {
            return Err(Nack::invalid(format!(
                "resource {name:?} appears twice in one update of collection {collection:?}; \
                 names must be unique in a collection"
            )));
        }
        let key = collection_key.or_else(|| {
            table
                .filter(|_| facts.hidden_in_part(&any.value))
                .map(CollectionTable::redacted_values_key)
        });
        let digest = match key {
            Some(key) => keyed_content_digest(
                key.hmac(),
                collection,
                &name,
                &body,
                &metadata.labels,
                &metadata.annotations,
            ),
            None => content_digest(&body, &metadata.labels, &metadata.annotations),
        };
        // Keep the bytes as received. Only a missing version is filled in (a
        // hash of the body), so incremental clients can report it back; the
        // body itself is never re-encoded.
        // The version is read back from these bytes (`CachedResource::version`).
        let encoded = if metadata.version.is_empty() {
            metadata.version = match key {
                Some(key) => keyed_body_version(key.hmac(), collection, &name, &body),
                None => body_version(&body),
            };
            encode_resource(&metadata, &body)
        } else {
            bytes.clone()
        };
        resources.push(R::from(CachedResource::new(name, encoded, digest)));
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
    use crate::proto::wire::test_support::encoded_resource;

    fn resource(type_url: &str, value: Vec<u8>) -> Bytes {
        crate::tools::galley::resource("r", "1", type_url, &value)
            .encode_to_vec()
            .into()
    }

    /// A message's bodies are checked each by its own type URL, read once
    /// for a run of bodies of one type URL: a secret's body after plain ones
    /// (of another type URL, or of the same one wrapping the secret) is
    /// refused, and plain bodies of several type URLs in turn are not.
    #[test]
    fn each_body_of_a_message_is_checked_by_its_own_type() {
        const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
        const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        const ANY: &str = "type.googleapis.com/google.protobuf.Any";
        const SSL_CREDENTIALS: &str = "type.googleapis.com/envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials";
        let table = CollectionTable::builtin().with_sensitive_types(crate::source::proto_json::secret_type_urls());
        let guard = SecretGuard::new(Arc::new(table));
        let plain = "envoy/config/cluster/v3/clusters";
        let named = |name: &str, type_url: &str, value: Vec<u8>| -> Bytes {
            crate::tools::galley::resource(name, "1", type_url, &value)
                .encode_to_vec()
                .into()
        };
        let wrapped = |type_url: &str| {
            prost_types::Any {
                type_url: type_url.into(),
                value: b"\x0a\x01x".to_vec(),
            }
            .encode_to_vec()
        };
        let refused = [
            vec![
                named("a", CLUSTER, vec![]),
                named("b", CLUSTER, vec![]),
                named("c", SECRET, vec![]),
            ],
            vec![named("a", ANY, wrapped(CLUSTER)), named("b", ANY, wrapped(SECRET))],
            vec![named("a", ANY, wrapped(CLUSTER)), named("b", SECRET, vec![])],
            // A secret's type whose name holds no word the bytes are
            // searched for: only its type URL tells.
            vec![
                named("a", CLUSTER, vec![]),
                named("b", SSL_CREDENTIALS, b"\x12\x03\x1a\x01k".to_vec()),
            ],
        ];
        for message in refused {
            let nack = decode_shared_resources(plain, &message, Some(&guard)).unwrap_err();
            assert!(nack.message.contains("holds secrets"), "{}", nack.message);
        }
        let plain_bodies = [
            named("a", CLUSTER, vec![]),
            named("b", ANY, wrapped(CLUSTER)),
            named("c", CLUSTER, vec![]),
            named("d", ANY, wrapped(CLUSTER)),
        ];
        assert_eq!(
            decode_shared_resources(plain, &plain_bodies, Some(&guard))
                .unwrap()
                .len(),
            4
        );
    }

    /// What the files source refuses, an upstream's update is NACKed for:
    /// a secret's body (a v3 `Secret`, one named like a secret, a type
    /// `--type-map` marks sensitive, any of them wrapped) outside the
    /// collections of secrets. The reason quotes none of it.
    #[test]
    fn an_upstreams_secret_outside_the_collections_of_secrets_is_refused() {
        const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
        // Secret{name: "MARKER-NAME"}.
        let secret = b"\x0a\x0bMARKER-NAME".to_vec();
        let any = |type_url: &str, value: Vec<u8>| {
            prost_types::Any {
                type_url: type_url.into(),
                value,
            }
            .encode_to_vec()
        };
        let table = CollectionTable::builtin()
            .with_type_map_yaml(
                "custom/vault: {type_url: type.googleapis.com/example.Vault, sensitive: true}\n\
                 custom/anything: {type_url: type.googleapis.com/google.protobuf.Struct, sensitive: true}\n\
                 custom/private-clusters: {type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster, sensitive: true}\n",
            )
            .unwrap()
            .with_sensitive_types(crate::source::proto_json::secret_type_urls());
        let guard = SecretGuard::new(Arc::new(table));
        let plain = "envoy/config/cluster/v3/clusters";
        let refused = [
            (SECRET.to_owned(), secret.clone()),
            (
                "type.googleapis.com/google.protobuf.Any".to_owned(),
                any(SECRET, secret.clone()),
            ),
            (format!("{SECRET} "), secret.clone()),
            (
                "type.googleapis.com/envoy.api.v2.auth.Secret".to_owned(),
                b"\x0a\x0bMARKER-NAME".to_vec(),
            ),
            (
                "type.googleapis.com/k8s.io.api.core.v1.Secret".to_owned(),
                b"MARKER".to_vec(),
            ),
            ("type.googleapis.com/example.Vault".to_owned(), b"MARKER".to_vec()),
            (
                "type.googleapis.com/google.protobuf.Any".to_owned(),
                any("type.googleapis.com/example.Vault", b"MARKER".to_vec()),
            ),
        ];
        for (type_url, value) in refused {
            let nack = decode_shared_resources(plain, &[resource(&type_url, value.clone())], Some(&guard)).unwrap_err();
            assert!(
                nack.message
                    .contains("holds secrets, and envoy/config/cluster/v3/clusters is not a collection of secrets"),
                "{type_url}: {}",
                nack.message
            );
            assert!(!nack.message.contains("MARKER"), "{}", nack.message);
            // In a collection of secrets, or without the guard (a file the
            // gateway wrote itself), it is read.
            decode_shared_resources(
                "envoy/extensions/transport_sockets/tls/v3/secrets",
                &[resource(&type_url, value.clone())],
                Some(&guard),
            )
            .unwrap();
            decode_shared_resources(plain, &[resource(&type_url, value)], None).unwrap();
        }
        // An ordinary body (a Cluster: a collection of them marked sensitive
        // does not make the clusters collection's a secret), and a Struct
        // (nor does a Struct row make every Struct one: the views hide those).
        decode_shared_resources(
            plain,
            &[resource("type.googleapis.com/envoy.config.cluster.v3.Cluster", vec![])],
            Some(&guard),
        )
        .unwrap();
        decode_shared_resources(
            plain,
            &[resource(
                "type.googleapis.com/google.protobuf.Any",
                any("type.googleapis.com/x.Y", vec![]),
            )],
            Some(&guard),
        )
        .unwrap();
        decode_shared_resources(
            plain,
            &[resource("type.googleapis.com/google.protobuf.Struct", vec![])],
            Some(&guard),
        )
        .unwrap();

        // Deep in an ordinary body: a Secret as a cluster's transport
        // socket is refused, naming where; an UpstreamTlsContext there (the
        // usual way to name a secret, its inline key hidden in the views)
        // and a name that merely says "secret" are read.
        const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let cluster = |typed_config: serde_json::Value| {
            crate::source::proto_json::encode(
                CLUSTER,
                serde_json::json!({"name": "my-secret-cluster", "transport_socket": {"name": "tls", "typed_config": typed_config}}),
            )
            .unwrap()
        };
        let nested = cluster(serde_json::json!({"@type": SECRET, "name": "MARKER-NAME"}));
        let nack = decode_shared_resources(plain, &[resource(CLUSTER, nested)], Some(&guard)).unwrap_err();
        assert!(
            nack.message.contains(&format!(
                "a body of {CLUSTER} holds a {SECRET} at transport_socket.typed_config"
            )),
            "{}",
            nack.message
        );
        assert!(!nack.message.contains("MARKER"), "{}", nack.message);
        let tls = cluster(serde_json::json!({
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"tls_certificates": [{"private_key": {"inline_string": "k"}}],
                                   "tls_certificate_sds_secret_configs": [{"name": "secret-1"}]}
        }));
        decode_shared_resources(plain, &[resource(CLUSTER, tls)], Some(&guard)).unwrap();
        // Inside a TypedStruct's JSON value, which Envoy reads as the type
        // it names: its `@type`s are Anys too.
        let typed = cluster(serde_json::json!({
            "@type": "type.googleapis.com/xds.type.v3.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "value": {"common_tls_context": {"custom_handshaker": {"name": "h", "typed_config": {
                "@type": SECRET, "name": "MARKER-NAME"}}}}
        }));
        let nack = decode_shared_resources(plain, &[resource(CLUSTER, typed)], Some(&guard)).unwrap_err();
        assert!(
            nack.message.contains(&format!(
                "holds a {SECRET} at transport_socket.typed_config.value.common_tls_context.custom_handshaker.typed_config"
            )),
            "{}",
            nack.message
        );
        assert!(!nack.message.contains("MARKER"), "{}", nack.message);
        // An EnvoyFilter's patch, which istiod turns into the Any it names.
        const ENVOY_FILTER: &str = "type.googleapis.com/istio.networking.v1alpha3.EnvoyFilter";
        let filter = crate::source::proto_json::encode(
            ENVOY_FILTER,
            serde_json::json!({"configPatches": [{"applyTo": "CLUSTER", "patch": {"operation": "MERGE",
                "value": {"transport_socket": {"name": "tls", "typed_config": {"@type": SECRET, "name": "MARKER-NAME"}}}}}]}),
        )
        .unwrap();
        let nack = decode_shared_resources(
            "istio/networking/v1alpha3/envoyfilters",
            &[resource(ENVOY_FILTER, filter)],
            Some(&guard),
        )
        .unwrap_err();
        assert!(
            nack.message.contains(&format!(
                "holds a {SECRET} at config_patches.patch.value.transport_socket.typed_config"
            )),
            "{}",
            nack.message
        );
        // A Bootstrap's secrets, a typed field (the fifteenth check).
        let bootstrap = cluster(serde_json::json!({
            "@type": "type.googleapis.com/envoy.config.bootstrap.v3.Bootstrap",
            "static_resources": {"secrets": [{"name": "MARKER-NAME"}]}
        }));
        let nack = decode_shared_resources(plain, &[resource(CLUSTER, bootstrap)], Some(&guard)).unwrap_err();
        assert!(
            nack.message.contains(&format!(
                "holds a {SECRET} at transport_socket.typed_config.static_resources.secrets"
            )),
            "{}",
            nack.message
        );
        // Anys nested past what is read into: refused, not taken unread.
        let mut deep = prost_types::Any {
            type_url: SECRET.into(),
            value: b"\x0a\x0bMARKER-NAME".to_vec(),
        };
        for _ in 0..70 {
            deep = prost_types::Any {
                type_url: "type.googleapis.com/google.protobuf.Any".into(),
                value: deep.encode_to_vec(),
            };
        }
        let nack = decode_shared_resources(plain, &[resource(&deep.type_url, deep.value)], Some(&guard)).unwrap_err();
        assert!(nack.message.contains("deeper than 32 levels"), "{}", nack.message);
        assert!(!nack.message.contains("MARKER"), "{}", nack.message);

        // Bytes that name a secret's type and do not decode (the sixteenth
        // check): a field whose wire type is not its declaration's makes
        // this reader fail, where upb and Envoy's parser skip the field and
        // read the rest, a Secret included. Refused, at the body or at the
        // Any whose value does not decode.
        let mismatch = |mut bytes: Vec<u8>| {
            // Field 24 (a Cluster's transport_socket, a message) as a varint.
            bytes.extend_from_slice(&[0xc0, 0x01, 0x05]);
            bytes
        };
        let nested = cluster(serde_json::json!({"@type": SECRET, "name": "MARKER-NAME"}));
        let nack = decode_shared_resources(plain, &[resource(CLUSTER, mismatch(nested))], Some(&guard)).unwrap_err();
        assert!(
            nack.message.contains(&format!(
                "a body of {CLUSTER} does not decode as envoy.config.cluster.v3.Cluster, and it may hold a \
                 secret (its bytes hold \"secret\""
            )),
            "{}",
            nack.message
        );
        assert!(!nack.message.contains("MARKER"), "{}", nack.message);
        // In an Any of an Any: the Cluster decodes, the inner Any does not
        // (its type_url, field 1, written as a varint).
        let mut inner = vec![0x08, 0x05];
        inner.extend(any(SECRET, b"\x0a\x0bMARKER-NAME".to_vec()));
        let mut socket = Vec::new();
        prost::encoding::string::encode(1, &"tls".to_owned(), &mut socket);
        prost::encoding::message::encode(
            3,
            &prost_types::Any {
                type_url: "type.googleapis.com/google.protobuf.Any".into(),
                value: inner,
            },
            &mut socket,
        );
        let mut wrapped = Vec::new();
        prost::encoding::string::encode(1, &"c".to_owned(), &mut wrapped);
        prost::encoding::bytes::encode(24, &socket, &mut wrapped);
        let nack = decode_shared_resources(plain, &[resource(CLUSTER, wrapped)], Some(&guard)).unwrap_err();
        assert!(
            nack.message
                .contains("does not decode at transport_socket.typed_config (an Any's value)"),
            "{}",
            nack.message
        );
        // An Any written value first, its type_url a varint, then a
        // Secret's type URL: the body of a VirtualService collection.
        let mut value_first = vec![0x08, 0x01];
        prost::encoding::bytes::encode(2, &b"\x12\x0bMARKER-NAME".to_vec(), &mut value_first);
        prost::encoding::string::encode(1, &SECRET.to_owned(), &mut value_first);
        let nack = decode_shared_resources(
            "istio/networking/v1alpha3/virtualservices",
            &[resource("type.googleapis.com/google.protobuf.Any", value_first)],
            Some(&guard),
        )
        .unwrap_err();
        assert!(
            nack.message.contains("does not decode as google.protobuf.Any"),
            "{}",
            nack.message
        );
        // The seventeenth check: a Bootstrap as the body itself holds its
        // secrets as a typed field, whose type its bytes do not name.
        const BOOTSTRAP: &str = "type.googleapis.com/envoy.config.bootstrap.v3.Bootstrap";
        let secrets = serde_json::json!({"secrets": [{"name": "MARKER-NAME", "tls_certificate": {
            "private_key": {"inline_string": "MARKER-KEY"}}}]});
        for (type_url, json) in [
            (BOOTSTRAP.to_owned(), serde_json::json!({ "static_resources": secrets })),
            (format!("{BOOTSTRAP}.StaticResources"), secrets.clone()),
        ] {
            let body = crate::source::proto_json::encode(&type_url, json).unwrap();
            let nack = decode_shared_resources(plain, &[resource(&type_url, body.clone())], Some(&guard)).unwrap_err();
            assert!(
                nack.message.contains(&format!("holds a {SECRET} at ")),
                "{type_url}: {}",
                nack.message
            );
            assert!(!nack.message.contains("MARKER"), "{}", nack.message);
            // Not decodable (field 1, a message of either, as a varint):
            // refused as one that may hold a secret.
            let undecodable = [&[0x08, 0x05][..], &body].concat();
            let nack = decode_shared_resources(plain, &[resource(&type_url, undecodable)], Some(&guard)).unwrap_err();
            assert!(
                nack.message.contains("does not decode as"),
                "{type_url}: {}",
                nack.message
            );
        }
        // An Any of a type the gateway has no descriptor for (Envoy's
        // contrib extensions, anyone's) holding an Any of a Secret: the
        // secret's type URL in its bytes, where no descriptor walks.
        let unknown = any(
            "type.googleapis.com/acme.v1.Wrapper",
            any(SECRET, b"\x0a\x0bMARKER-NAME".to_vec()),
        );
        let mut socket = Vec::new();
        prost::encoding::string::encode(1, &"tls".to_owned(), &mut socket);
        prost::encoding::bytes::encode(3, &unknown, &mut socket);
        let mut in_cluster = Vec::new();
        prost::encoding::string::encode(1, &"c".to_owned(), &mut in_cluster);
        prost::encoding::bytes::encode(24, &socket, &mut in_cluster);
        let as_body = any(SECRET, b"\x0a\x0bMARKER-NAME".to_vec());
        for (type_url, body) in [(CLUSTER, in_cluster), ("type.googleapis.com/acme.v1.Wrapper", as_body)] {
            let nack = decode_shared_resources(plain, &[resource(type_url, body)], Some(&guard)).unwrap_err();
            assert!(
                nack.message.contains(&format!(
                    "names the type {} (a secret's, by its name) in an Any of a type the gateway has no descriptor for",
                    SECRET.rsplit('/').next().unwrap()
                )),
                "{type_url}: {}",
                nack.message
            );
        }
        // A body refused in the clusters collection as a secret: the NACK's
        // message.
        let nack_in_clusters = |type_url: &str, body: Vec<u8>| {
            let nack = decode_shared_resources(plain, &[resource(type_url, body)], Some(&guard)).unwrap_err();
            assert!(
                nack.message
                    .contains("envoy/config/cluster/v3/clusters is not a collection of secrets"),
                "{type_url}: {}",
                nack.message
            );
            nack.message
        };
        // The eighteenth check: Envoy's key material of other versions
        // (v2's `auth`, v4alpha's), which the gateway has no descriptors
        // for, as the body, in an Any, or in an Any of an unknown type.
        for key_material in [
            "type.googleapis.com/envoy.api.v2.auth.TlsCertificate",
            "type.googleapis.com/envoy.api.v2.auth.TlsSessionTicketKeys",
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v4alpha.TlsCertificate",
        ] {
            let value = b"\x12\x0c\x1a\x0aMARKER-KEY".to_vec();
            let wrapped = any(key_material, value.clone());
            for (type_url, body) in [
                (key_material, value),
                ("type.googleapis.com/google.protobuf.Any", wrapped.clone()),
                ("type.googleapis.com/acme.v1.Wrapper", wrapped),
            ] {
                let message = nack_in_clusters(type_url, body);
                assert!(!message.contains("MARKER"), "{key_material} as {type_url}: {message}");
            }
        }
        // The nineteenth check: the values of a built-in secret type in
        // another version of Envoy's API (v2's, v2alpha's, v4alpha's: no
        // descriptors here), and contrib's key providers, as the body.
        for other_version in [
            "type.googleapis.com/envoy.api.v2.core.GrpcService.GoogleGrpc.SslCredentials",
            "type.googleapis.com/envoy.config.core.v4alpha.GrpcService.GoogleGrpc.SslCredentials",
            "type.googleapis.com/envoy.api.v2.auth.DownstreamTlsContext",
            "type.googleapis.com/envoy.config.grpc_credential.v2alpha.FileBasedMetadataConfig",
            "type.googleapis.com/envoy.config.filter.network.redis_proxy.v2.RedisProxy",
            "type.googleapis.com/envoy.extensions.private_key_providers.cryptomb.v3alpha.CryptoMbPrivateKeyMethodConfig",
        ] {
            nack_in_clusters(other_version, b"\x12\x06MARKER".to_vec());
        }
        // The twentieth check: a resource wrapper clients unwrap by
        // themselves (xDS's `discovery.v3.Resource`, v2's), around a type
        // refused as a body; the KAE key provider (any contrib provider);
        // another version of a Bootstrap (it cannot be walked).
        let ssl = any(
            "type.googleapis.com/envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials",
            b"\x12\x0c\x1a\x0aMARKER-KEY".to_vec(),
        );
        let mut wrapper = Vec::new();
        prost::encoding::string::encode(3, &"w1".to_owned(), &mut wrapper);
        prost::encoding::bytes::encode(2, &ssl, &mut wrapper);
        for (type_url, body) in [
            (
                "type.googleapis.com/envoy.service.discovery.v3.Resource",
                wrapper.clone(),
            ),
            ("type.googleapis.com/envoy.api.v2.Resource", wrapper.clone()),
            (
                "type.googleapis.com/google.protobuf.Any",
                any("type.googleapis.com/envoy.service.discovery.v3.Resource", wrapper),
            ),
            (
                "type.googleapis.com/envoy.extensions.private_key_providers.kae.v3alpha.KaePrivateKeyMethodConfig",
                b"\x0a\x0c\x1a\x0aMARKER-KEY".to_vec(),
            ),
            (
                "type.googleapis.com/envoy.config.bootstrap.v2.Bootstrap",
                b"\x12\x06MARKER".to_vec(),
            ),
            (
                "type.googleapis.com/envoy.config.bootstrap.v4alpha.Bootstrap",
                b"\x12\x06MARKER".to_vec(),
            ),
        ] {
            let message = nack_in_clusters(type_url, body);
            assert!(!message.contains("MARKER"), "{message}");
        }
        // The twenty-first check: a TypedStruct naming a resource wrapper,
        // or a Bootstrap, with its value as JSON.
        let typed_struct = |type_url: &str, value: serde_json::Value| {
            crate::source::proto_json::encode(
                "type.googleapis.com/xds.type.v3.TypedStruct",
                serde_json::json!({"type_url": type_url, "value": value}),
            )
            .unwrap()
        };
        for body in [
            typed_struct(
                "type.googleapis.com/envoy.service.discovery.v3.Resource",
                serde_json::json!({"resource": {
                    "@type": "type.googleapis.com/envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials",
                    "private_key": {"inline_string": "MARKER-KEY"}}}),
            ),
            typed_struct(
                "type.googleapis.com/envoy.config.bootstrap.v3.Bootstrap",
                serde_json::json!({"static_resources": {"secrets": [{"name": "s", "tls_certificate": {
                    "private_key": {"inline_string": "MARKER-KEY"}}}]}}),
            ),
            typed_struct(
                "type.googleapis.com/envoy.service.discovery.v3.Resource",
                serde_json::json!({"resource": {
                    "@type": "type.googleapis.com/envoy.config.bootstrap.v3.Bootstrap",
                    "static_resources": {"secrets": [{"name": "s"}]}}}),
            ),
            // The twenty-second check: a TypedStruct as JSON inside the
            // wrapper (its own `value` is its, not the Any's).
            typed_struct(
                "type.googleapis.com/envoy.service.discovery.v3.Resource",
                serde_json::json!({"resource": {
                    "@type": "type.googleapis.com/xds.type.v3.TypedStruct",
                    "type_url": "type.googleapis.com/envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials",
                    "value": {"private_key": {"inline_string": "MARKER-KEY"}}}}),
            ),
            typed_struct(
                "type.googleapis.com/google.protobuf.Any",
                serde_json::json!({"@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                    "typeUrl": "type.googleapis.com/envoy.extensions.private_key_providers.kae.v3alpha.KaePrivateKeyMethodConfig",
                    "value": {"private_key": {"inline_string": "MARKER-KEY"}}}),
            ),
        ] {
            let message = nack_in_clusters("type.googleapis.com/xds.type.v3.TypedStruct", body);
            assert!(!message.contains("MARKER"), "{message}");
        }
        // A Bootstrap as JSON without secrets is read.
        decode_shared_resources(
            plain,
            &[resource(
                "type.googleapis.com/xds.type.v3.TypedStruct",
                typed_struct(
                    "type.googleapis.com/envoy.config.bootstrap.v3.Bootstrap",
                    serde_json::json!({"static_resources": {"secrets": []}}),
                ),
            )],
            Some(&guard),
        )
        .unwrap();
        // Another version's type whose values are no secret is read.
        decode_shared_resources(
            plain,
            &[resource(
                "type.googleapis.com/envoy.api.v2.Cluster",
                b"\x0a\x01c".to_vec(),
            )],
            Some(&guard),
        )
        .unwrap();
        // A type the descriptors know that is named like a secret and marks
        // nothing (Envoy's access-log formatter `GenericSecret`, which maps
        // names to SDS secrets) is no secret.
        let formatter = cluster(serde_json::json!({
            "@type": "type.googleapis.com/envoy.extensions.formatter.generic_secret.v3.GenericSecret"
        }));
        decode_shared_resources(plain, &[resource(CLUSTER, formatter)], Some(&guard)).unwrap();
        // A type of no descriptor whose bytes merely say "secret" (an SDS
        // name in a contrib filter's config) is not refused.
        decode_shared_resources(
            plain,
            &[resource(
                "type.googleapis.com/acme.v1.Filter",
                b"\x0a\x09my-secret".to_vec(),
            )],
            Some(&guard),
        )
        .unwrap();

        // Bytes that do not decode and name no secret are no secret's
        // business (a source's bad body is the client's to refuse).
        decode_shared_resources(
            plain,
            &[resource(CLUSTER, mismatch(b"\x0a\x01c".to_vec()))],
            Some(&guard),
        )
        .unwrap();
    }

    #[test]
    fn a_resources_body_type_is_read_back_from_its_bytes() {
        let raw = [encoded_resource("a", "1", b"x"), encoded_resource("b", "", b"y")];
        let decoded = decode_resources("c", &raw).unwrap();
        for resource in &decoded {
            assert_eq!(
                crate::proto::wire::resource_body_type_url(&resource.encoded).as_deref(),
                Some("type.googleapis.com/x.Y")
            );
        }
    }
}
