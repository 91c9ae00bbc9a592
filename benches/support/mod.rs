//! What the benchmarks and the callgrind driver apply: the same resources.

use std::collections::HashMap;

use bytes::Bytes;
use mcp_xds_gateway::cache::{content_digest, CachedResource};

pub const C: &str = "istio/networking/v1alpha3/virtualservices";

/// Resource `i` at `version`, about 100 bytes (a million of them fit in
/// memory easily).
pub fn resource(i: usize, version: usize) -> CachedResource {
    let name = format!("ns-{}/vs-{i:07}", i % 97);
    let body = format!("{name}@{version}:{}", "x".repeat(64));
    let none = HashMap::<String, String>::new();
    CachedResource::new(
        name.into(),
        Bytes::from(body.clone()),
        content_digest(body.as_bytes(), &none, &none),
    )
}
