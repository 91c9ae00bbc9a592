//! mcp-xds-gateway: an MCP sink for Istio's Galley that serves the shared
//! config cache to legacy clients of `AggregatedMeshConfigService`.
//!
//! Data flows one way: `upstream` writes the `cache`; `downstream` streams read
//! it; `admin` reports on both; `app` wires them together.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod cache;
pub mod client_cmd;
pub mod collections;
pub mod config;
pub mod downstream;
pub mod local;
pub mod metrics;
pub mod persist;
pub mod proto;
pub mod transport;
pub mod upstream;
pub mod wire;
