//! Generated code, nothing hand-written: the MCP messages and services as the
//! proto defines them, and (in [`gateway`]) the same gRPC routes typed with the
//! gateway's wire types from [`crate::proto::wire`].
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("istio.mcp.v1alpha1");

pub mod wire;

/// The MCP services on the gateway's own wire types (see `build.rs`).
pub mod gateway {
    include!(concat!(
        env!("OUT_DIR"),
        "/gateway/istio.mcp.v1alpha1.ResourceSource.rs"
    ));
    include!(concat!(env!("OUT_DIR"), "/gateway/istio.mcp.v1alpha1.ResourceSink.rs"));
}

/// The encoded `FileDescriptorSet` of the MCP protos and their imports, for
/// gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/mcp_descriptor.bin"));
