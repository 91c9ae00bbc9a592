//! Envoy resources written the way Envoy users write them: the resource's
//! proto-JSON (as YAML) under `body: {type_url, json}` in the files source,
//! read against the protos' descriptors and encoded to the bytes Envoy
//! reads. Protojson rules (`camelCase` or `snake_case` names, durations as
//! `"5s"`, `Any` with `@type`); an unknown field, a wrong kind of value or a
//! type this gateway has no descriptor for is an error naming the field.

use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage};

/// The descriptors `build.rs` compiled: Envoy's clusters, listeners, route
/// configurations, endpoints, secrets, and the extensions they commonly
/// embed (HTTP connection manager, router, TCP proxy, TLS).
const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/envoy_resources.bin"));

/// Decoded on first use: only a directory with `json` bodies pays for it.
fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| DescriptorPool::decode(DESCRIPTORS).expect("build.rs wrote a valid descriptor set"))
}

/// Why a `json` body does not read as its type.
#[derive(Debug, PartialEq, Eq)]
pub struct JsonError {
    /// The field that failed, as a path from the body (`filter_chains[0].filters`);
    /// empty for the body itself.
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "json.{}: {}", self.path, self.message)
        }
    }
}

/// Every message type a `json` body may name, sorted (for errors).
fn known_types() -> Vec<String> {
    const ROOTS: &[&str] = &[
        "envoy.config.cluster.v3.Cluster",
        "envoy.config.listener.v3.Listener",
        "envoy.config.route.v3.RouteConfiguration",
        "envoy.config.endpoint.v3.ClusterLoadAssignment",
        "envoy.extensions.transport_sockets.tls.v3.Secret",
    ];
    ROOTS.iter().map(|t| format!("type.googleapis.com/{t}")).collect()
}

/// The message `json` describes, encoded as `type_url` says.
pub fn encode(type_url: &str, json: &serde_json::Value) -> Result<Vec<u8>, JsonError> {
    let fail = |message: String| JsonError {
        path: String::new(),
        message,
    };
    let name = type_url.strip_prefix("type.googleapis.com/").ok_or_else(|| {
        fail(format!(
            "type_url {type_url:?} does not start with type.googleapis.com/"
        ))
    })?;
    let descriptor = pool().get_message_by_name(name).ok_or_else(|| {
        fail(format!(
            "type_url {type_url:?} is not a type this gateway can read as json (it reads {}, and the extensions \
             listed in proto/README.md); give the encoded message as value_base64 instead",
            known_types().join(", ")
        ))
    })?;
    let mut track = serde_path_to_error::Track::new();
    let message = {
        let deserializer = serde_path_to_error::Deserializer::new(json, &mut track);
        serde::de::DeserializeSeed::deserialize(descriptor, deserializer)
    };
    let message: DynamicMessage = message.map_err(|e: serde_json::Error| JsonError {
        path: track.path().to_string().trim_start_matches('.').to_owned(),
        message: e.to_string(),
    })?;
    Ok(prost::Message::encode_to_vec(&message))
}

/// Reads resource bodies back for the config dump (`/debug/cache/{c}?bodies=`):
/// `google.protobuf.Struct`, the Envoy types above, and every message of an
/// operator's descriptor set (`--descriptors`: a `FileDescriptorSet`, such as
/// Istio's API protos compiled by `protoc -o` or `buf build`).
#[derive(Debug)]
pub struct BodyDecoder {
    /// The operator's set merged into the built-in one; `None` without one
    /// (the built-in pool is then shared and decoded on first use).
    pool: Option<DescriptorPool>,
}

impl BodyDecoder {
    /// With `descriptors` (a file holding a `FileDescriptorSet`); an error
    /// says why it cannot be used.
    pub fn new(descriptors: Option<&std::path::Path>) -> Result<Self, String> {
        let Some(path) = descriptors else {
            return Ok(Self { pool: None });
        };
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
        let set = <prost_types::FileDescriptorSet as prost::Message>::decode(&bytes[..])
            .map_err(|e| format!("not a FileDescriptorSet (protoc -o FILE, or buf build -o FILE): {e}"))?;
        let mut pool = pool().clone();
        // The operator's files may repeat ones the built-in set has (the
        // well-known types): those are skipped, the rest added.
        let new: Vec<_> = set
            .file
            .into_iter()
            .filter(|f| pool.get_file_by_name(f.name()).is_none())
            .collect();
        pool.add_file_descriptor_protos(new)
            .map_err(|e| format!("its descriptors do not resolve: {e}"))?;
        Ok(Self { pool: Some(pool) })
    }

    fn pool(&self) -> &DescriptorPool {
        self.pool.as_ref().unwrap_or_else(|| pool())
    }

    /// The body's message as proto-JSON; `Err` says why it cannot be read
    /// (no descriptor for its type, or bytes that do not decode as it).
    pub fn decode(&self, type_url: &str, value: &[u8]) -> Result<serde_json::Value, String> {
        let name = type_url.rsplit('/').next().unwrap_or(type_url);
        let descriptor = self
            .pool()
            .get_message_by_name(name)
            .ok_or_else(|| format!("no descriptor for {name} (give --descriptors FILE with it)"))?;
        let message =
            DynamicMessage::decode(descriptor, value).map_err(|e| format!("does not decode as {name}: {e}"))?;
        serde_json::to_value(&message).map_err(|e| format!("{name} has no JSON form: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cluster_reads_as_envoy_writes_it() {
        let bytes = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            &json!({
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
            &json!({"name": "backend", "connect_timeout": "0.25s"}),
        )
        .unwrap();
        let json = decoder
            .decode("type.googleapis.com/envoy.config.cluster.v3.Cluster", &cluster)
            .unwrap();
        assert_eq!(json, json!({"name": "backend", "connectTimeout": "0.250s"}));
        let structure = prost::Message::encode_to_vec(&prost_types::Struct {
            fields: [(
                "hosts".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue("a".into())),
                },
            )]
            .into(),
        });
        let json = decoder
            .decode("type.googleapis.com/google.protobuf.Struct", &structure)
            .unwrap();
        assert_eq!(json, json!({"hosts": "a"}));
        let err = decoder
            .decode("type.googleapis.com/istio.networking.v1alpha3.Gateway", b"")
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
            &json!({
                "name": "l",
                "filter_chains": [{"filters": [{"name": "x", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "s",
                    "clutser": "c",
                }}]}],
            }),
        )
        .unwrap_err();
        assert!(
            err.path.starts_with("filter_chains[0].filters[0].typed_config"),
            "{err}"
        );
        assert!(err.message.contains("clutser"), "{err}");

        let err = encode(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            &json!({"connect_timeout": 5}),
        )
        .unwrap_err();
        assert_eq!(err.path, "connect_timeout", "{err}");

        let err = encode("type.googleapis.com/example.Unknown", &json!({})).unwrap_err();
        assert!(err.message.contains("value_base64"), "{err}");
    }
}
