//! What every source's resources must be before they reach the cache: a
//! decodable `Resource` with metadata, a name unique in its collection, and a
//! body that is an `Any`. Upstream messages, local files and persisted files
//! all pass through here, and a resource without a version gets a hash of its
//! body as its version.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

use super::session::Nack;
use crate::cache::{body_version, content_digest, CachedResource};
use crate::proto::wire::{AnyTypeUrl, RawResource};

/// Validates every resource of a message and turns it into cache entries.
/// Nothing is applied unless every resource is valid.
pub fn decode_resources(collection: &str, raw: &[Bytes]) -> Result<Vec<CachedResource>, Nack> {
    decode(collection, raw)
}

/// As [`decode_resources`], each entry in the `Arc` the cache shares it by:
/// a large message's entries are then not held twice while they are taken
/// in (as values, then in `Arc`s).
pub fn decode_shared_resources(collection: &str, raw: &[Bytes]) -> Result<Vec<Arc<CachedResource>>, Nack> {
    decode(collection, raw)
}

fn decode<R: From<CachedResource>>(collection: &str, raw: &[Bytes]) -> Result<Vec<R>, Nack> {
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
        let name: Arc<str> = Arc::from(metadata.name.as_str());
        let Some(body) = resource.body else {
            return Err(Nack::invalid(format!(
                "resource {name:?} of collection {collection:?} has no body"
            )));
        };
        // The body must be an `Any`; its type URL is read back from the
        // stored bytes when a view asks (`CachedResource::body_type_url`).
        AnyTypeUrl::decode(body.clone()).map_err(|e| {
            Nack::invalid(format!(
                "resource {name:?} of collection {collection:?} has a body that is not a google.protobuf.Any: {e}"
            ))
        })?;
        // The name's own `Arc`: a full state's set of names costs its table.
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
        resources.push(R::from(CachedResource::new(name, version.into(), encoded, digest)));
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
