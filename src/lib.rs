//! mcp-xds-gateway: one process between Istio's config sources and every
//! generation of config client.
//!
//! Data flows one way: `source` writes the `cache`; `downstream` streams read
//! it; `admin` reports on both; `transport` carries bytes; `app` wires them
//! together. `architecture.md` says what each room owns and may import.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod cache;
pub mod collections;
pub mod config;
pub mod downstream;
pub mod memory;
pub mod metrics;
pub mod proto;
pub mod runtime;
pub mod skew;
pub mod source;
pub mod tools;
pub mod transport;

/// The gateway's shared string: resource names (a collection's map keys,
/// the resources, the named clients' name sets share one allocation),
/// collection names, versions. One pointer, its length and count in the
/// allocation (`Arc<str>` is a pointer and a length: 16 bytes in every map
/// key and struct that holds one).
pub type SharedStr = arcstr::ArcStr;
