//! Generates the MCP and Envoy v3 ADS code from `proto/` with protox (pure Rust: no system
//! `protoc`) and tonic.
//!
//! Two kinds of output:
//! - `istio.mcp.v1alpha1.rs`: every message and a client/server for every
//!   service, exactly as the proto says (used by tests and the client side).
//! - hand-described upstream services (tonic_build::manual) on the same gRPC
//!   routes, typed with the gateway's wire types: each `Resource` stays the
//!   raw bytes Galley sent. (The downstream service frames its pre-encoded
//!   responses itself: see src/downstream/service.rs.)

use tonic_build::manual::{Builder, Method, Service};

const PACKAGE: &str = "istio.mcp.v1alpha1";

/// The trees under `proto/` whose every file the files source reads as
/// proto-JSON: Envoy's v3 API (data-plane-api) and CNCF xds (`xds`, `udpa`),
/// every resource and every extension (see proto/README.md).
const ENVOY_JSON_TREES: &[&str] = &["envoy", "xds", "udpa"];

/// Relative type names protox resolves differently from protoc, written
/// out in full as protoc reads them: (file, name as written, full name).
/// protoc looks a name's first part up among the packages of the file and
/// its direct imports; protox among every package of its pool, so in
/// `dynamic_forward_proxy/v3/cluster.proto` (in package
/// `envoy.extensions.clusters.dynamic_forward_proxy.v3`) `common.` finds
/// `envoy.extensions.clusters.common` (an indirect import's package)
/// before `envoy.extensions.common`. The files stay as copied; the
/// compiler reads them so rewritten.
const PROTOC_NAMES: &[(&str, &str, &str)] = &[(
    "envoy/extensions/clusters/dynamic_forward_proxy/v3/cluster.proto",
    " common.dynamic_forward_proxy.v3.DnsCacheConfig ",
    " .envoy.extensions.common.dynamic_forward_proxy.v3.DnsCacheConfig ",
)];
/// The Istio kinds the files source reads as Kubernetes YAML (their `spec`),
/// from `proto/istio-api/` (its own include root, as in istio/api).
const ISTIO_KIND_ROOTS: &[&str] = &[
    "networking/v1alpha3/virtual_service.proto",
    "networking/v1alpha3/destination_rule.proto",
    "networking/v1alpha3/gateway.proto",
    "networking/v1alpha3/service_entry.proto",
    "networking/v1alpha3/sidecar.proto",
    "networking/v1alpha3/envoy_filter.proto",
    "networking/v1alpha3/workload_entry.proto",
    "networking/v1alpha3/workload_group.proto",
    "networking/v1beta1/proxy_config.proto",
    "security/v1beta1/authorization_policy.proto",
    "security/v1beta1/peer_authentication.proto",
    "security/v1beta1/request_authentication.proto",
    "telemetry/v1alpha1/telemetry.proto",
    "extensions/v1alpha1/wasm.proto",
    "authentication/v1alpha1/policy.proto",
    "rbac/v1alpha1/rbac.proto",
];
const CODEC: &str = "tonic_prost::ProstCodec";

fn bidi(name: &str, route: &str, input: &str, output: &str) -> Method {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(input)
        .output_type(output)
        .codec_path(CODEC)
        .client_streaming()
        .server_streaming()
        .build()
}

/// The real peers the integration tests run against, each a cfg set when
/// the variable that points at it is: `.ci/run` installs the peer and exports
/// the variable. A test that needs one carries
/// `#[cfg_attr(not(peer_envoy), ignore = "needs Envoy …")]`, so where the
/// peer is missing libtest reports the test as ignored, with the reason,
/// never as passed (see tests/it/helpers/peers.rs).
const PEERS: &[(&str, &str)] = &[
    // Envoy 1.40's binary.
    ("peer_envoy", "ENVOY_BIN"),
    // A python3 that imports grpcio (grpc's proxyless xDS client).
    ("peer_grpcio", "GRPCIO_PYTHON"),
    // A directory holding `prometheus` and `promtool`.
    ("peer_prometheus", "PROMETHEUS_DIR"),
    // A headless Chromium (the admin pages rendered in a real browser).
    ("peer_chromium", "CHROMIUM_BIN"),
    // kubectl, whose `kubectl kustomize` the deploy tests' renderer is
    // compared with.
    ("peer_kubectl", "KUBECTL_BIN"),
    // openssl, which runs the certificate recipe of docs/operating.md.
    ("peer_openssl", "OPENSSL_BIN"),
];

/// Declares every peer's cfg, and sets those whose variable is set (and not
/// empty). A change of the variable re-runs this script.
fn peer_cfgs() {
    for (cfg, variable) in PEERS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        println!("cargo::rerun-if-env-changed={variable}");
        if std::env::var_os(variable).is_some_and(|value| !value.is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    peer_cfgs();
    // MCP, and Envoy's v3 aggregated discovery service with its imports
    // (see proto/README.md).
    let fds = protox::compile(
        ["istio/mcp/v1alpha1/mcp.proto", "envoy/service/discovery/v3/ads.proto"],
        ["proto"],
    )?;
    // For gRPC server reflection on the downstream port.
    let descriptor_path = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("mcp_descriptor.bin");
    std::fs::write(descriptor_path, prost::Message::encode_to_vec(&fds))?;
    // Every Envoy resource and extension, for the files source's proto-JSON
    // (descriptors only, no code, no comments): see proto/README.md.
    compile_envoy_descriptors()?;
    compile_istio_descriptors()?;
    compile_istio_releases()?;
    write_secret_types()?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .extern_path(".google.rpc.Status", "::tonic_types::Status")
        .compile_fds(fds)?;

    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("gateway");
    std::fs::create_dir_all(&out_dir)?;
    Builder::new().out_dir(&out_dir).compile(&[
        Service::builder()
            .name("ResourceSource")
            .package(PACKAGE)
            .method(bidi(
                "establish_resource_stream",
                "EstablishResourceStream",
                "crate::proto::RequestResources",
                "crate::proto::wire::RawResources",
            ))
            .build(),
        Service::builder()
            .name("ResourceSink")
            .package(PACKAGE)
            .method(bidi(
                "establish_resource_stream",
                "EstablishResourceStream",
                "crate::proto::wire::RawResources",
                "crate::proto::RequestResources",
            ))
            .build(),
    ]);
    Ok(())
}

/// The Istio kinds' descriptors (no code, no comments), for the files
/// source's Kubernetes YAML and the config dump: see proto/istio-api/README.md.
fn compile_istio_descriptors() -> Result<(), Box<dyn std::error::Error>> {
    write_descriptor_set("proto/istio-api", ISTIO_KIND_ROOTS, "istio_resources.bin")
}

/// Each Istio release's config-kind protos (`proto/istio-api-releases/<release>/`,
/// with `common/` for the imports they share) as a descriptor set of its own,
/// and `OUT_DIR/istio_releases.rs`: a `&[(release, descriptor set bytes)]`,
/// oldest first. What a client of each generation can decode (src/skew).
fn compile_istio_releases() -> Result<(), Box<dyn std::error::Error>> {
    const ROOT: &str = "proto/istio-api-releases";
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let mut releases = Vec::new();
    for entry in std::fs::read_dir(ROOT)? {
        let entry = entry?;
        let release = entry.file_name().to_string_lossy().into_owned();
        if !entry.file_type()?.is_dir() || !release.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        let key: Vec<u32> = release.split('.').map(str::parse).collect::<Result<_, _>>()?;
        releases.push((key, release));
    }
    releases.sort();
    let mut table = String::from("&[\n");
    for (_, release) in &releases {
        let folder = format!("{ROOT}/{release}");
        let mut roots = Vec::new();
        proto_files(std::path::Path::new(&folder), std::path::Path::new(&folder), &mut roots)?;
        roots.sort();
        let set = protox::Compiler::new([folder.as_str(), &format!("{ROOT}/common")])?
            .include_imports(true)
            .include_source_info(false)
            .open_files(&roots)?
            .encode_file_descriptor_set();
        let file = out.join(format!("istio_release_{release}.bin"));
        std::fs::write(&file, set)?;
        table.push_str(&format!(
            "    ({release:?}, include_bytes!({:?}) as &[u8]),\n",
            file.display().to_string()
        ));
    }
    table.push(']');
    std::fs::write(out.join("istio_releases.rs"), table)?;
    Ok(())
}

/// Every `.proto` file under `dir`, relative to `root`.
fn proto_files(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            proto_files(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            let relative = path.strip_prefix(root).expect("under its root");
            out.push(relative.to_string_lossy().into_owned());
        }
    }
    Ok(())
}

mod secret_types {
    include!("src/source/secret_types.rs");
}

/// The type URLs of the collections of secrets, as `OUT_DIR/secret_types.rs`
/// (a `&[&str]`), from the descriptor sets written above.
fn write_secret_types() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let mut pool = prost_reflect::DescriptorPool::decode(&*std::fs::read(out.join("envoy_resources.bin"))?)?;
    pool.decode_file_descriptor_set(&*std::fs::read(out.join("istio_resources.bin"))?)?;
    let urls = secret_types::secret_type_urls_of(&pool);
    let list: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    std::fs::write(out.join("secret_types.rs"), format!("&[{}]", list.join(", ")))?;
    println!("cargo:rerun-if-changed=src/source/secret_types.rs");
    Ok(())
}

/// Every file of `ENVOY_JSON_TREES` with its imports, as one descriptor
/// set (no code, no comments): `OUT_DIR/envoy_resources.bin`.
///
/// One protox pool cannot hold them all: a relative type name resolves
/// against every package of the pool (see `PROTOC_NAMES`), so a file read
/// after another package `envoy.extensions.config` exists cannot name
/// `config.core.v3.HttpUri` as protoc lets it. Each file goes to the first
/// pool it compiles in, or to a new one (three in all); the pools' files,
/// their names fully resolved, are then merged into one set (a file two
/// pools hold is the same file, kept once).
fn compile_envoy_descriptors() -> Result<(), Box<dyn std::error::Error>> {
    let mut roots = Vec::new();
    for tree in ENVOY_JSON_TREES {
        proto_files(
            std::path::Path::new("proto"),
            &std::path::Path::new("proto").join(tree),
            &mut roots,
        )?;
    }
    roots.sort();
    let mut pools: Vec<protox::Compiler> = Vec::new();
    for root in &roots {
        if pools.iter_mut().any(|pool| pool.open_file(root).is_ok()) {
            continue;
        }
        let mut pool = protox::Compiler::with_file_resolver(ProtocNames::new("proto"));
        pool.include_imports(true).include_source_info(false);
        pool.open_file(root).map_err(|e| format!("{root}: {e}"))?;
        pools.push(pool);
    }
    let mut merged = prost_reflect::DescriptorPool::new();
    for pool in &pools {
        // Encoded with the extension options (`file_descriptor_set()` drops
        // them), which the merged pool keeps: the gateway reads
        // `(udpa.annotations.sensitive)` to redact secrets in every view.
        merged.decode_file_descriptor_set(&*pool.encode_file_descriptor_set())?;
    }
    let path = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("envoy_resources.bin");
    std::fs::write(path, merged.encode_to_vec())?;
    Ok(())
}

/// The files under an include root as protox reads them, but for the names
/// `PROTOC_NAMES` writes out in full.
struct ProtocNames(protox::file::ChainFileResolver);

impl ProtocNames {
    fn new(include: &str) -> Self {
        let mut chain = protox::file::ChainFileResolver::new();
        chain.add(protox::file::IncludeFileResolver::new(include.into()));
        chain.add(protox::file::GoogleFileResolver::new());
        Self(chain)
    }
}

impl protox::file::FileResolver for ProtocNames {
    fn resolve_path(&self, path: &std::path::Path) -> Option<String> {
        self.0.resolve_path(path)
    }

    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        let file = self.0.open_file(name)?;
        let mut fixes = PROTOC_NAMES.iter().filter(|(fixed, _, _)| *fixed == name).peekable();
        if fixes.peek().is_none() {
            return Ok(file);
        }
        let mut source = file.source().unwrap_or_default().to_owned();
        for (_, written, full) in fixes {
            // A proto updated past the fix must not keep it silently.
            assert!(
                source.contains(written),
                "{name} no longer has {written:?}: update PROTOC_NAMES"
            );
            source = source.replace(written, full);
        }
        protox::file::File::from_source(name, &source)
    }
}

/// The descriptors of `roots` and their imports (no code, no comments),
/// compiled from the include root `include` into `OUT_DIR/file`.
fn write_descriptor_set(include: &str, roots: &[&str], file: &str) -> Result<(), Box<dyn std::error::Error>> {
    let set = protox::Compiler::new([include])?
        .include_imports(true)
        .include_source_info(false)
        .open_files(roots)?
        // Encoded with the extension options (`file_descriptor_set()` drops
        // them): the gateway reads `(udpa.annotations.sensitive)` to redact
        // secrets in every view.
        .encode_file_descriptor_set();
    let path = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join(file);
    std::fs::write(path, set)?;
    Ok(())
}
