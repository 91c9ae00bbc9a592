//! Generated code, nothing hand-written: the MCP messages and services (and
//! Envoy's v3 ADS, in [`envoy`]) as the
//! proto defines them, and (in [`gateway`]) the same gRPC routes typed with the
//! gateway's wire types from [`crate::proto::wire`].
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("istio.mcp.v1alpha1");

pub mod wire;

/// Envoy's v3 aggregated discovery service and the messages it carries (the
/// import closure of `ads.proto`: see `proto/README.md`). Each module is a
/// proto package; generated code refers to the others by relative path, so
/// they sit side by side here.
pub mod envoy {
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
    }
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
}

/// Imported by the Envoy protos.
pub mod xds {
    pub mod core {
        pub mod v3 {
            tonic::include_proto!("xds.core.v3");
        }
    }
    pub mod annotations {
        pub mod v3 {
            tonic::include_proto!("xds.annotations.v3");
        }
    }
}

/// Imported by the Envoy protos.
pub mod udpa {
    pub mod annotations {
        tonic::include_proto!("udpa.annotations");
    }
}

/// Imported by the Envoy protos.
pub mod validate {
    tonic::include_proto!("validate");
}

/// The MCP services on the gateway's own wire types (see `build.rs`).
pub mod gateway {
    include!(concat!(
        env!("OUT_DIR"),
        "/gateway/istio.mcp.v1alpha1.ResourceSource.rs"
    ));
    include!(concat!(env!("OUT_DIR"), "/gateway/istio.mcp.v1alpha1.ResourceSink.rs"));
}

/// `ResourceSource.EstablishResourceStream`: the gateway serves it, and dials
/// it on a source.
pub const RESOURCE_SOURCE_PATH: &str = "/istio.mcp.v1alpha1.ResourceSource/EstablishResourceStream";

/// The encoded `FileDescriptorSet` of the MCP protos and their imports, for
/// gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/mcp_descriptor.bin"));
