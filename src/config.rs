//! Flags and their `MCP_GATEWAY_*` environment fallbacks, validated into the
//! typed settings the gateway runs with. A bad value is an error that names
//! its flag; nothing here does I/O beyond reading the files the flags name.

pub mod source;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::collections::CollectionTable;
use crate::downstream::rollout::gate::WhenNone;
use crate::downstream::rollout::selector::{Selector, MAX_SELECTORS};
use crate::downstream::rollout::Membership;
use crate::downstream::DownstreamLimits;
use crate::proto::SinkNode;
use crate::source::backoff::BackoffPolicy;
use crate::source::client::ClientSettings;
use crate::source::files::SourceDir;
use crate::source::sink::SinkSettings;
use crate::transport::access::AccessPolicy;
use crate::transport::grpc::GrpcLimits;
use crate::transport::http::HttpLimits;
use crate::transport::identity::AllowList;
use crate::transport::sniff::FloodLimits;
use crate::transport::tls::{ClientTlsFiles, ServerTlsFiles, TlsError};
use crate::SharedStr;

/// The default `--max-connections` where the open file limit allows more:
/// about 300 MiB of idle HTTP/2 connections at most.
const DEFAULT_MAX_CONNECTIONS: usize = 20_000;

/// The keepalive interval Galley enforces as a minimum (istio#13910).
const GALLEY_MIN_KEEPALIVE: Duration = Duration::from_secs(30);

#[derive(Debug, Parser)]
#[command(
    name = "mcp-xds-gateway",
    version,
    about = "Serves Istio config (from Galley, another gateway, or YAML files) to every generation of config \
             client: Istio 1.0/1.1's AggregatedMeshConfigService, Pilot 1.2-1.7's ResourceSource, and Envoy's v3 ADS \
             (istiod 1.8+ over MCP over xDS, Envoy, grpc)",
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Where each flag's value came from (`Args::parse_with_sources`).
    #[arg(skip)]
    pub effective: Vec<EffectiveFlag>,

    /// Dial Galley's ResourceSource at this address, e.g. http://galley:9901
    /// or https://galley:9901. One of --upstream, --sink-listen, --source-dir.
    #[arg(long, env = "MCP_GATEWAY_UPSTREAM", value_name = "URL")]
    pub upstream: Option<String>,

    /// Serve ResourceSink on this address for Galley's dial-out (Galley's
    /// --sinkAddress points here).
    #[arg(long, env = "MCP_GATEWAY_SINK_LISTEN", value_name = "ADDR")]
    pub sink_listen: Option<SocketAddr>,

    /// Serve the YAML files in this directory, watched for changes. The
    /// default when no source is given and ./examples/config exists (a
    /// checkout of the repository).
    #[arg(long, env = "MCP_GATEWAY_SOURCE_DIR", value_name = "DIR")]
    pub source_dir: Option<PathBuf>,

    /// Serve the compiled-in example config (bookinfo routes, a mesh policy):
    /// for trying the gateway where there is no checkout. Logged as a
    /// warning, and every metric carries demo="true". Never with another
    /// source.
    #[arg(long, env = "MCP_GATEWAY_DEMO")]
    pub demo: bool,

    /// Keep the upstream's last applied state of each collection here, and
    /// serve it at start before the upstream connects; and, with any source,
    /// the gateway's own state: the rollout's, and the clients' NACKs
    /// (--nack-memory). The files source's collections are already on disk:
    /// only the gateway's own state is kept for it.
    #[arg(long, env = "MCP_GATEWAY_CACHE_DIR", value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,

    /// A file of 32 bytes or more (a Secret's key, mounted) that the
    /// versions of sensitive collections' resources are made with (keyed
    /// digests: a version a view shows tests no guess of a secret). Give
    /// every replica the same file for the same versions. Default: a key
    /// made once and kept in --cache-dir, or this process's own.
    #[arg(long, env = "MCP_GATEWAY_SENSITIVE_VERSION_KEY", value_name = "FILE")]
    pub sensitive_version_key: Option<PathBuf>,

    /// CA certificate(s) (PEM) that sign the https --upstream's certificate
    /// (default: the system's roots).
    #[arg(long, env = "MCP_GATEWAY_UPSTREAM_CA", value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,

    /// Client certificate (PEM) presented to an https --upstream that
    /// requires one; needs --upstream-key.
    #[arg(long, env = "MCP_GATEWAY_UPSTREAM_CERT", value_name = "FILE")]
    pub upstream_cert: Option<PathBuf>,

    /// Private key (PEM) of --upstream-cert.
    #[arg(long, env = "MCP_GATEWAY_UPSTREAM_KEY", value_name = "FILE")]
    pub upstream_key: Option<PathBuf>,

    /// The name the upstream's certificate must carry, when it differs from
    /// the host in --upstream.
    #[arg(long, env = "MCP_GATEWAY_UPSTREAM_SERVER_NAME", value_name = "NAME")]
    pub upstream_server_name: Option<String>,

    /// Certificate chain (PEM) for the downstream and sink listeners; turns
    /// TLS on for both. Re-read when it changes on disk.
    #[arg(long, env = "MCP_GATEWAY_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,

    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "MCP_GATEWAY_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,

    /// CA certificate(s) (PEM): clients of the TLS listeners must present a
    /// certificate signed by one of them (mTLS).
    #[arg(long, env = "MCP_GATEWAY_CLIENT_CA", value_name = "FILE")]
    pub client_ca: Option<PathBuf>,

    /// The sink node id sent upstream (default: this host's name).
    #[arg(long, env = "MCP_GATEWAY_NODE_ID", value_name = "ID")]
    pub node_id: Option<String>,

    /// A sink node annotation sent upstream, as key=value (repeatable).
    #[arg(
        long = "node-annotation",
        env = "MCP_GATEWAY_NODE_ANNOTATIONS",
        value_name = "KEY=VALUE",
        value_delimiter = ',',
        value_parser = parse_key_value()
    )]
    pub node_annotations: Vec<(String, String)>,

    /// Ask the source for full state only (incremental is requested by default).
    #[arg(long, env = "MCP_GATEWAY_NO_INCREMENTAL")]
    pub no_incremental: bool,

    /// Collections to subscribe to at start (comma-separated; default: Istio's
    /// networking collections). Collections clients ask for are added.
    #[arg(long, env = "MCP_GATEWAY_COLLECTIONS", value_name = "A,B,...", value_delimiter = ',')]
    pub collections: Option<Vec<String>>,

    /// YAML file of `collection: type_url` pairs that add to or override the
    /// built-in collection table.
    #[arg(long, env = "MCP_GATEWAY_TYPE_MAP", value_name = "FILE")]
    pub type_map: Option<PathBuf>,

    /// Address of the gRPC port for downstream clients. Loopback by default:
    /// serving config beyond this host is a choice (give 0.0.0.0:15010, and
    /// --tls-cert/--tls-key/--client-ca so only trusted clients read it).
    #[arg(long, env = "MCP_GATEWAY_LISTEN", default_value = "127.0.0.1:15010")]
    pub listen: SocketAddr,

    /// Address of the admin HTTP port: debug views and controls, plus
    /// /metrics, /healthz and /readyz. Shows client addresses, node ids and
    /// every resource name: keep it on loopback.
    #[arg(long, env = "MCP_GATEWAY_ADMIN_LISTEN", default_value = "127.0.0.1:15000")]
    pub admin_listen: SocketAddr,

    /// Address of the monitoring HTTP port: only /metrics, /healthz and
    /// /readyz (what Prometheus and the kubelet need).
    #[arg(long, env = "MCP_GATEWAY_MONITORING_LISTEN", default_value = "0.0.0.0:15014")]
    pub monitoring_listen: SocketAddr,

    /// Accept dial-out sources without client certificates on --sink-listen.
    /// Anyone who reaches the port becomes the config source of every client:
    /// only where the network alone is trusted.
    #[arg(long, env = "MCP_GATEWAY_SINK_INSECURE")]
    pub sink_insecure: bool,

    /// An identity allowed to act as the dial-out source (repeatable): a
    /// pattern over the client certificate's SANs, the access policy's rule:
    /// with a `scheme://` (a SPIFFE id) it matches URI SANs only, else DNS
    /// SANs only; `*` matches any run of characters, `{name}` one segment.
    /// Needs --client-ca.
    #[arg(
        long = "sink-allow",
        env = "MCP_GATEWAY_SINK_ALLOW",
        value_name = "ID",
        value_delimiter = ','
    )]
    pub sink_allow: Vec<String>,

    /// An identity allowed as a downstream client on the mTLS listener
    /// (repeatable), matched like --sink-allow. Needs --client-ca.
    #[arg(
        long = "client-allow",
        env = "MCP_GATEWAY_CLIENT_ALLOW",
        value_name = "ID",
        value_delimiter = ','
    )]
    pub client_allow: Vec<String>,

    /// YAML rules of who may read what: identities (the SANs of a client's
    /// certificate, or `unauthenticated`) to collections and resource names.
    /// Reloaded when the file changes. Without it, every client the
    /// transport admits reads every collection but the sensitive ones
    /// (secrets), which nobody reads.
    #[arg(long, env = "MCP_GATEWAY_ACCESS_POLICY", value_name = "FILE")]
    pub access_policy: Option<PathBuf>,

    /// Time to connect to the upstream: TCP, TLS and the HTTP/2 handshake
    /// together.
    #[arg(long, env = "MCP_GATEWAY_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,

    /// The most gateways in a chain, this one included: an --upstream that
    /// is a gateway with more gateways behind it than this allows is
    /// refused (as is one whose chain includes this gateway: a loop).
    #[arg(long, env = "MCP_GATEWAY_MAX_CHAIN_DEPTH", default_value_t = 4)]
    pub max_chain_depth: usize,

    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of the gRPC listeners.
    #[arg(long, env = "MCP_GATEWAY_MAX_STREAMS_PER_CONNECTION", default_value_t = 100)]
    pub max_streams_per_connection: u32,

    /// HTTP/2 receive window of each client connection (and of each stream
    /// on it): what a client may send before the gateway reads it.
    #[arg(long, env = "MCP_GATEWAY_MAX_RECEIVE_WINDOW_BYTES", default_value_t = 256 << 10)]
    pub max_receive_window_bytes: u32,

    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE of the gRPC listeners, in bytes.
    #[arg(long, env = "MCP_GATEWAY_MAX_HEADER_LIST_BYTES", default_value_t = 16 << 10)]
    pub max_header_list_bytes: u32,

    /// Open gRPC connections (default: 20,000, or fewer when the open file
    /// limit, raised to its hard maximum at start, allows fewer after a
    /// reserve for everything else). An idle connection costs about 15 KiB.
    #[arg(long, env = "MCP_GATEWAY_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,

    /// Open gRPC streams across all connections.
    #[arg(long, env = "MCP_GATEWAY_MAX_STREAMS", default_value_t = 100_000)]
    pub max_streams: usize,

    /// New streams per second per peer IP address (bursts of ten seconds' worth).
    #[arg(long, env = "MCP_GATEWAY_MAX_NEW_STREAMS_PER_SECOND", default_value_t = 50)]
    pub max_new_streams_per_second: u32,

    /// Requests per second on one stream (bursts of ten seconds' worth).
    #[arg(long, env = "MCP_GATEWAY_MAX_REQUESTS_PER_SECOND", default_value_t = 50)]
    pub max_requests_per_second: u32,

    /// Largest request a downstream client may send, in bytes.
    #[arg(long, env = "MCP_GATEWAY_MAX_REQUEST_BYTES", default_value_t = 4 << 20)]
    pub max_request_bytes: usize,

    /// Bytes of large requests (64 KiB and more: initial versions, long
    /// NACKs) being received at once, across all streams; a large request
    /// waits for room. Small requests never wait.
    #[arg(long, env = "MCP_GATEWAY_MAX_REQUEST_BUFFER_BYTES", default_value_t = 64 << 20)]
    pub max_request_buffer_bytes: usize,

    /// Time for a large request to arrive completely once it started
    /// (waiting for room included).
    #[arg(long, env = "MCP_GATEWAY_REQUEST_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub request_read_timeout: Duration,

    /// How long a client stream that ends (its client closed it, a limit
    /// or a policy refused it, the gateway is stopping) waits for its
    /// client to take what it was sent and the status; a client not
    /// reading by then has its stream reset (CANCEL), and what was held
    /// for it, and its place under --max-streams, is freed.
    #[arg(long, env = "MCP_GATEWAY_STREAM_END_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub stream_end_timeout: Duration,

    /// A NACK's message is kept and logged up to this many bytes (with its
    /// full length).
    #[arg(long, env = "MCP_GATEWAY_MAX_NACK_MESSAGE_BYTES", default_value_t = 4096)]
    pub max_nack_message_bytes: usize,

    /// Types (collections) one downstream stream may subscribe to.
    #[arg(long, env = "MCP_GATEWAY_MAX_TYPES_PER_STREAM", default_value_t = 128)]
    pub max_types_per_stream: usize,

    /// Distinct name grants of one collection served at once (under
    /// --access-policy, identities granted part of a collection: one view
    /// of each version per distinct grant, shared by its clients). A client
    /// whose grant would be one more is refused RESOURCE_EXHAUSTED; clients
    /// already served are never cut off to make room.
    #[arg(long, env = "MCP_GATEWAY_MAX_GRANTS_PER_VERSION", default_value_t = 1024)]
    pub max_grants_per_version: usize,

    /// How often the allocator's free heap is checked: past 1 MiB freed and
    /// kept, its free pages go back to the kernel (after a burst: every
    /// client syncing, a reconnect storm, a big version), so RSS at rest is
    /// the heap in use, not the burst's peak ("0s": never; glibc builds).
    #[arg(long, env = "MCP_GATEWAY_MEMORY_TRIM_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub memory_trim_interval: Duration,

    /// How long a runtime worker that ran out of work waits for more events
    /// before it parks: events that come together (a version's ACKs, a
    /// burst of requests) are then read in one wake-up, not one each. An
    /// event within the wait of the work before it is handled up to the
    /// wait later; after a quiet spell, at once ("0s": no wait; at most 5ms).
    #[arg(long, env = "MCP_GATEWAY_WORKER_IDLE_WAIT", default_value = "200us", value_parser = parse_duration)]
    pub worker_idle_wait: Duration,

    /// Versions of each collection kept (the current one included) for
    /// `/debug/history` and `/debug/diff`. Unchanged resources are shared
    /// between versions: memory grows with the changes, not with N times the
    /// collection.
    #[arg(long, env = "MCP_GATEWAY_HISTORY", default_value_t = 10)]
    pub history: usize,

    /// Clients that get each new version first (repeatable): a glob over
    /// the node id (`canary-*`), or KEY=VALUE matching a node annotation
    /// (MCP) or a metadata string (xDS). The others get a version once every
    /// connected canary ACKed it, and never when one NACKs it (it is held).
    /// A selector chooses among the clients whose proven identity an
    /// --access-policy rule with `canary: true` allows (mTLS); a client
    /// only named like a canary is an ordinary client.
    #[arg(long = "canary", env = "MCP_GATEWAY_CANARY", value_name = "NODE_SELECTOR")]
    pub canary: Vec<String>,

    /// Let --canary selectors alone decide who is a canary, without a
    /// proven identity: any client that names itself so gets versions
    /// first, and its NACK holds a version from everyone. Only where every
    /// client that can connect is trusted (plaintext test setups).
    #[arg(long, env = "MCP_GATEWAY_CANARY_TRUST_NODE_IDS")]
    pub canary_trust_node_ids: bool,

    /// How long after the last canary ACK a new version waits before it goes
    /// to every client.
    #[arg(long, env = "MCP_GATEWAY_CANARY_SOAK", default_value = "0s", value_parser = parse_duration)]
    pub canary_soak: Duration,

    /// With --canary, what a new version does while no canary is connected:
    /// go to everyone (with a warning), or wait for a canary.
    #[arg(long, env = "MCP_GATEWAY_CANARY_WHEN_NONE", value_enum, default_value_t = WhenNone::Proceed)]
    pub canary_when_none: WhenNone,

    /// Which Istio release a client is, where its wire does not tell
    /// (repeatable): GLOB=RELEASE, the glob over the node id or a
    /// certificate identity, e.g. 'spiffe://*/sa/istio-pilot*=1.3' (real
    /// Pilots on ResourceSource send an empty node id and no version). First
    /// match wins, before the client's own ISTIO_VERSION; the legacy
    /// service's dialect (1.0, 1.1) is never overridden. What the release's
    /// protos lack of the served config is shown as the client's skew
    /// (/debug/skew, `status`); a client nothing names shows "unknown".
    #[arg(
        long = "client-generation",
        env = "MCP_GATEWAY_CLIENT_GENERATION",
        value_name = "GLOB=RELEASE"
    )]
    pub client_generation: Vec<String>,

    /// Resource names one xDS client may subscribe to per type (RDS, EDS:
    /// named subscriptions).
    #[arg(long, env = "MCP_GATEWAY_MAX_SUBSCRIBED_NAMES", default_value_t = 100_000)]
    pub max_subscribed_names: usize,

    /// State of the world, to a client naming the route configurations or
    /// load assignments it asks for (Envoy's RDS and EDS, grpc): send every
    /// one it asks for in every response. By default a response after the
    /// first carries only what changed since the client was last sent and
    /// what it newly asks for, and the client keeps the rest (Envoy's xDS
    /// protocol allows it for every type but listeners and clusters; Envoy
    /// and grpc do keep it). After a NACK the next response carries all.
    #[arg(long, env = "MCP_GATEWAY_SOTW_RESEND_UNCHANGED")]
    pub sotw_resend_unchanged: bool,

    /// How long an xDS client's NACK is remembered (per node id, identity
    /// and type; across restarts with --cache-dir): what the NACKed response
    /// carried is sent again when the client reconnects, whatever version it
    /// reports ("0s": nothing is remembered, and nothing a reconnecting
    /// client reports holding is skipped).
    #[arg(long, env = "MCP_GATEWAY_NACK_MEMORY", default_value = "24h", value_parser = parse_duration)]
    pub nack_memory: Duration,

    /// Clients and types whose NACKs are remembered; past it the expired go,
    /// then the oldest of the identity whose NACK needs the room (never
    /// another identity's).
    #[arg(long, env = "MCP_GATEWAY_MAX_NACK_MEMORY_ENTRIES", default_value_t = 100_000)]
    pub max_nack_memory_entries: usize,

    /// Of --max-nack-memory-entries, the entries one identity (a client
    /// certificate's SANs, or unauthenticated) may hold; past it, its own
    /// oldest is forgotten. Default: a tenth of --max-nack-memory-entries.
    #[arg(long, env = "MCP_GATEWAY_MAX_NACK_MEMORY_ENTRIES_PER_IDENTITY")]
    pub max_nack_memory_entries_per_identity: Option<usize>,

    /// How long an Envoy drains a listener it replaced or removed (its
    /// `--drain-time-s`, 600 s by default): a cluster (and its load
    /// assignment) that such a listener still sends its open connections
    /// to is removed this long after the listener's change settled, not at
    /// once ("0s": at once, as with Envoy's `--drain-strategy immediate`).
    #[arg(long, env = "MCP_GATEWAY_LISTENER_DRAIN_TIME", default_value = "600s", value_parser = parse_duration)]
    pub listener_drain_time: Duration,

    /// A connection that has not finished TLS and the HTTP/2 preface and
    /// SETTINGS this long after it was accepted is closed.
    #[arg(long, env = "MCP_GATEWAY_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,

    /// A gRPC connection with no stream this long is closed ("0s": never).
    #[arg(long, env = "MCP_GATEWAY_IDLE_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub idle_timeout: Duration,

    /// Stream resets a peer may send a minute on one connection; past it the
    /// connection gets GOAWAY ENHANCE_YOUR_CALM (rapid reset).
    #[arg(long, env = "MCP_GATEWAY_MAX_RESETS_PER_MINUTE", default_value_t = 300)]
    pub max_resets_per_minute: u32,

    /// HTTP/2 pings a peer may send a minute on one connection.
    #[arg(long, env = "MCP_GATEWAY_MAX_PINGS_PER_MINUTE", default_value_t = 1200)]
    pub max_pings_per_minute: u32,

    /// HTTP/2 SETTINGS frames a peer may send a minute on one connection.
    #[arg(long, env = "MCP_GATEWAY_MAX_SETTINGS_PER_MINUTE", default_value_t = 60)]
    pub max_settings_per_minute: u32,

    /// Other HTTP/2 control frames (WINDOW_UPDATE, PRIORITY, unknown types;
    /// empty DATA too, though h2 itself ends a connection at its 101st) a
    /// peer may send a minute on one connection.
    #[arg(long, env = "MCP_GATEWAY_MAX_CONTROL_FRAMES_PER_MINUTE", default_value_t = 60_000)]
    pub max_control_frames_per_minute: u32,

    /// Open connections per admin or monitoring port (an eighth of them per
    /// peer address).
    #[arg(long, env = "MCP_GATEWAY_HTTP_MAX_CONNECTIONS", default_value_t = 64)]
    pub http_max_connections: usize,

    /// Time an admin or monitoring client has to send its request headers
    /// (also the longest idle keep-alive).
    #[arg(long, env = "MCP_GATEWAY_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,

    /// Largest request to the admin or monitoring port (head or body), in bytes.
    #[arg(long, env = "MCP_GATEWAY_HTTP_MAX_REQUEST_BYTES", default_value_t = 64 << 10)]
    pub http_max_request_bytes: usize,

    /// Largest message accepted from the upstream source (and largest file
    /// of --source-dir), in bytes.
    #[arg(long, env = "MCP_GATEWAY_MAX_MESSAGE_BYTES", default_value_t = 64 << 20)]
    pub max_message_bytes: usize,

    /// HTTP/2 keepalive ping interval on every gRPC connection: towards the
    /// source, and from the listeners to their peers; a peer that does not
    /// answer within min(interval, 20s) is dropped ("0s" turns pings off).
    /// Galley answers pings more often than every 30s with GOAWAY.
    #[arg(long, env = "MCP_GATEWAY_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub keepalive_interval: Duration,

    /// First reconnect delay; it doubles per failed attempt and resets only
    /// after a stream delivered data.
    #[arg(long, env = "MCP_GATEWAY_RECONNECT_MIN_DELAY", default_value = "100ms", value_parser = parse_duration)]
    pub reconnect_min_delay: Duration,

    /// Largest base reconnect delay (each wait adds up to as much again as jitter).
    #[arg(long, env = "MCP_GATEWAY_RECONNECT_MAX_DELAY", default_value = "30s", value_parser = parse_duration)]
    pub reconnect_max_delay: Duration,

    /// Downstream connections older than this get GOAWAY, so clients
    /// rebalance across interchangeable replicas ("0s": never).
    #[arg(long, env = "MCP_GATEWAY_MAX_CONNECTION_AGE", default_value = "30m", value_parser = parse_duration)]
    pub max_connection_age: Duration,

    /// After GOAWAY, how long a connection's streams may continue before it
    /// is closed (clients then reconnect, possibly to another replica).
    #[arg(long, env = "MCP_GATEWAY_MAX_CONNECTION_AGE_GRACE", default_value = "1m", value_parser = parse_duration)]
    pub max_connection_age_grace: Duration,

    /// How long shutdown waits for streams to close before exiting.
    #[arg(long, env = "MCP_GATEWAY_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// A protobuf FileDescriptorSet (protoc -o FILE, buf build -o FILE) for
    /// the config dump (/debug/cache/{collection}?bodies=yaml) to decode
    /// bodies of types the gateway has no descriptor for (it has Struct,
    /// Istio's kinds and Envoy's; not Mixer's).
    #[arg(long, env = "MCP_GATEWAY_DESCRIPTORS", value_name = "FILE")]
    pub descriptors: Option<PathBuf>,

    /// How long a collection a client asked for (not in --collections) may
    /// go neither delivered nor refused by the source, while the upstream is
    /// connected, before clients that wait for every type (xDS, istiod) are
    /// answered it empty; they get its content if the source delivers it
    /// later.
    #[arg(long, env = "MCP_GATEWAY_DEMAND_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub demand_timeout: Duration,

    /// A client behind the cache's current version for longer than this is
    /// STALE in /debug/syncz, the status command and mcp_gateway_clients.
    #[arg(long, env = "MCP_GATEWAY_STALE_AFTER", default_value = "30s", value_parser = parse_duration)]
    pub stale_after: Duration,

    /// `/debug/access` makes one answer at a time (a policy matched against
    /// an identity, its patterns against every cached name); a request
    /// waits this long for its turn, then is answered 503 with
    /// `Retry-After: 1` ("0s": never waits).
    #[arg(long, env = "MCP_GATEWAY_DEBUG_ACCESS_WAIT", default_value = "300ms", value_parser = parse_duration)]
    pub debug_access_wait: Duration,

    /// Log filter (tracing's EnvFilter syntax); RUST_LOG, when set, wins.
    /// The HTTP/2 library logs only errors by default: what a misbehaving
    /// peer does is in the gateway's own rate-limited lines.
    #[arg(long, env = "MCP_GATEWAY_LOG_LEVEL", default_value = "info,h2=error")]
    pub log_level: String,

    /// Log lines as text or as one JSON object per line.
    #[arg(long, env = "MCP_GATEWAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// A flag's effective value and where it came from: what `/debug/config`
/// shows. Paths (certificates, keys) are shown as paths: no flag holds a
/// secret itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EffectiveFlag {
    pub flag: String,
    /// `None`: not set, and no default.
    pub value: Option<String>,
    /// `default`, `environment` (its variable) or `command line`.
    pub source: String,
}

impl Args {
    /// Parses `argv` and the environment like [`Parser::try_parse_from`],
    /// keeping where each value came from in [`Args::effective`].
    pub fn try_parse_with_sources<I, T>(argv: I) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let command = Args::command();
        let matches = command.clone().try_get_matches_from(argv)?;
        let mut args = Args::from_arg_matches(&matches)?;
        match (&mut args.command, matches.subcommand()) {
            (None, _) => args.effective = effective(&command, &matches),
            (Some(Command::Source(source)), Some((name, sub))) => {
                if let Some(sub_command) = command.find_subcommand(name) {
                    source.effective = effective(sub_command, sub);
                }
            }
            _ => {}
        }
        Ok(args)
    }

    /// Every flag at its default, whatever the environment holds: what the
    /// `source` command builds its settings on (its own flags and
    /// `MCP_SOURCE_*` variables set the rest; the gateway's variables must
    /// not reach it).
    pub fn defaults() -> Args {
        use clap::{CommandFactory, FromArgMatches};
        let command = Args::command().mut_args(|arg| arg.env(None::<&str>));
        let matches = command
            .try_get_matches_from(["mcp-xds-gateway"])
            .expect("every flag has a valid default");
        Args::from_arg_matches(&matches).expect("the defaults parse")
    }
}

fn effective(command: &clap::Command, matches: &clap::ArgMatches) -> Vec<EffectiveFlag> {
    use clap::parser::ValueSource;
    command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            if matches!(long, "help" | "version") {
                return None;
            }
            let id = arg.get_id().as_str();
            // KEY=VALUE pairs (`--node-annotation`, `--sink-meta`) show a
            // credential's value redacted; the flag's own parser reads the
            // pairs. No other flag holds a secret itself (paths only).
            let pairs = matches!(long, "node-annotation" | "sink-meta");
            let value = matches.get_raw(id).map(|values| {
                values
                    .map(|v| {
                        let v = v.to_string_lossy();
                        match v.split_once('=') {
                            Some((key, value)) if pairs => {
                                format!(
                                    "{}={}",
                                    crate::transport::safe_text::key_shown(key.trim()),
                                    crate::transport::safe_text::credential_shown(key.trim(), value)
                                )
                            }
                            _ => v.into_owned(),
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            });
            let source = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => "command line".to_owned(),
                Some(ValueSource::EnvVariable) => {
                    format!(
                        "environment ({})",
                        arg.get_env().map(|e| e.to_string_lossy()).unwrap_or_default()
                    )
                }
                Some(ValueSource::DefaultValue) => "default".to_owned(),
                _ => "not set".to_owned(),
            };
            Some(EffectiveFlag {
                flag: format!("--{long}"),
                value,
                source,
            })
        })
        .collect()
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Act as a legacy client: subscribe, ACK, and print one line per update.
    Client(crate::tools::client::ClientArgs),
    /// Every client's sync status, per collection, from the admin port (like
    /// `istioctl proxy-status`).
    Status(crate::tools::status::StatusArgs),
    /// Rollout safety over the admin port: status, history, diff, pin,
    /// unpin, promote.
    Rollout(crate::tools::rollout::RolloutArgs),
    /// Serve a directory as an MCP source, as Galley did: a ResourceSource
    /// server (--listen), or a dial-out to a sink (--sink).
    Source(Box<source::SourceArgs>),
    /// Check files and directories of config as the files source reads them,
    /// without serving (for CI): exit 0 when everything would be served, 1
    /// when anything would not or Envoy would refuse it (every error of a
    /// file, at its line), 2 for usage.
    Check(crate::tools::check::CheckArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, thiserror::Error)]
#[error("{flag}: {message}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub message: String,
}

pub(crate) fn invalid(flag: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        message: message.into(),
    }
}

/// Where config comes from: exactly one.
#[derive(Clone, Debug)]
pub enum Source {
    /// `--upstream`: the gateway dials Galley.
    Client(ClientSettings),
    /// `--sink-listen`: Galley dials the gateway.
    Sink(SinkSettings),
    /// `--source-dir`, the default: local YAML files.
    Files(SourceDir),
}

/// What the gRPC side of the process serves.
#[derive(Clone, Debug, Default)]
pub enum Serve {
    /// The gateway: every protocol on `--listen`.
    #[default]
    Gateway,
    /// `source --listen`: `ResourceSource` only, as Galley's `--server` did.
    ResourceSource,
    /// `source --sink`: nothing listens for config; `ResourceSource` is
    /// served over the stream this process dials to a sink.
    DialOut(Box<crate::tools::dial_out::DialOutSettings>),
}

/// The local source used when no source flag is given.
pub const DEFAULT_SOURCE_DIR: &str = "examples/config";

/// `--memory-trim-interval`'s shortest period.
pub const MIN_MEMORY_TRIM_INTERVAL: Duration = Duration::from_millis(100);

/// The longest `--worker-idle-wait`: any longer and a burst's first event
/// would wait several times longer than tokio's own timers are coarse (1 ms).
pub const MAX_WORKER_IDLE_WAIT: Duration = Duration::from_millis(5);

/// The longest `--canary-soak`.
pub const MAX_CANARY_SOAK: Duration = Duration::from_secs(24 * 3600);

/// The longest `--demand-timeout`.
pub const MAX_DEMAND_TIMEOUT: Duration = Duration::from_secs(3600);

/// The most versions `--history` keeps per collection.
pub const MAX_HISTORY: usize = 1000;

/// The validated settings the gateway runs with.
#[derive(Clone, Debug)]
pub struct Settings {
    pub source: Source,
    /// What the gRPC side serves (the gateway, or the `source` command).
    pub serve: Serve,
    /// `--demo`: the compiled-in examples, labelled as such.
    pub demo: bool,
    pub cache_dir: Option<PathBuf>,
    /// Versions kept per collection (`--history`).
    pub history: usize,
    /// `--canary`, `--canary-when-none`, `--canary-soak`.
    pub canaries: Vec<Selector>,
    /// What makes a client that matches `canaries` one: its identity, or
    /// (`--canary-trust-node-ids`) its node alone.
    pub canary_membership: Membership,
    /// `--client-generation`.
    pub client_generations: crate::skew::GenerationRules,
    pub canary_when_none: WhenNone,
    pub canary_soak: Duration,
    /// TLS for the downstream and sink listeners.
    pub server_tls: Option<ServerTlsFiles>,
    /// With mTLS: the downstream identities accepted (`--client-allow`).
    pub client_allow: Option<AllowList>,
    /// Who may read what (`--access-policy`, read at start).
    pub access_policy: Arc<AccessPolicy>,
    pub table: Arc<CollectionTable>,
    pub type_map: Option<PathBuf>,
    /// Configured collections: subscribed at start, and what readiness
    /// waits for.
    pub collections: Vec<SharedStr>,
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub monitoring_listen: SocketAddr,
    pub shutdown_grace: Duration,
    /// `--stale-after`.
    pub stale_after: Duration,
    /// `--debug-access-wait`.
    pub debug_access_wait: Duration,
    /// `--demand-timeout`.
    pub demand_timeout: Duration,
    /// Reads bodies back for the config dump (`--descriptors`).
    pub bodies: Arc<crate::source::proto_json::BodyDecoder>,
    /// Every flag's value and where it came from: the value in effect where
    /// a flag left out has one (the source directory, the node id, ...).
    pub effective: Vec<EffectiveFlag>,
    /// What the flags allow but an operator should hear about, logged once
    /// the gateway has started (a failed start prints its error alone).
    pub warnings: Vec<String>,
    /// HTTP/2 and connection limits of the gRPC listeners.
    pub grpc: GrpcLimits,
    pub max_connections: usize,
    pub max_streams: usize,
    pub max_new_streams_per_second: u32,
    pub downstream: DownstreamLimits,
    pub http: HttpLimits,
    /// `--max-message-bytes`, for the local source's files.
    pub max_source_file_bytes: usize,
    /// `--memory-trim-interval`; `None`: never.
    pub memory_trim_interval: Option<Duration>,
    /// `--worker-idle-wait`; `None`: none (the binary's runtime: `runtime`).
    pub worker_idle_wait: Option<Duration>,
}

// === impl Args ===

impl Args {
    /// Validates every flag; the first bad one is reported by name.
    pub fn validate(self) -> Result<Settings, ConfigError> {
        let table = match &self.type_map {
            Some(path) => CollectionTable::builtin().with_type_map_file(path).map_err(|e| {
                invalid(
                    "--type-map",
                    crate::transport::safe_text::terminal_safe(&e.to_string()).into_owned(),
                )
            })?,
            None => CollectionTable::builtin(),
        }
        // Which body types are secrets is the descriptors' word, and they
        // live in `source`, a room `collections` does not import.
        .with_sensitive_types(crate::source::proto_json::secret_type_urls());
        if let Some(path) = &self.sensitive_version_key {
            let bytes = std::fs::read(path).map_err(|e| {
                invalid(
                    "--sensitive-version-key",
                    format!(
                        "cannot read {}: {e}",
                        crate::transport::safe_text::terminal_safe(&path.display().to_string())
                    ),
                )
            })?;
            let key = crate::collections::VersionKey::new(&bytes).ok_or_else(|| {
                invalid(
                    "--sensitive-version-key",
                    format!(
                        "the file holds {} bytes, fewer than {} (make one with: head -c 32 /dev/urandom > FILE)",
                        bytes.len(),
                        crate::collections::VersionKey::MIN_BYTES
                    ),
                )
            })?;
            table.set_version_key(key);
        }
        let collections = match &self.collections {
            None => table.default_subscriptions(),
            Some(list) => {
                let mut names = Vec::new();
                for name in list.iter().map(|c| c.trim()).filter(|c| !c.is_empty()) {
                    let known = table.name(name).ok_or_else(|| {
                        invalid(
                            "--collections",
                            format!(
                                "{name:?} is not a known collection; add it with --type-map (collection: type_url)"
                            ),
                        )
                    })?;
                    if !names.contains(&known) {
                        names.push(known);
                    }
                }
                if names.is_empty() {
                    return Err(invalid("--collections", "no collection given"));
                }
                names
            }
        };
        if self.max_message_bytes < 4096 {
            return Err(invalid(
                "--max-message-bytes",
                format!(
                    "{} bytes is too small for any MCP message; the default is 67108864 (64 MiB)",
                    self.max_message_bytes
                ),
            ));
        }
        if self.reconnect_min_delay.is_zero() {
            return Err(invalid(
                "--reconnect-min-delay",
                "must be above zero (a zero delay is a hot loop)",
            ));
        }
        if self.reconnect_max_delay < self.reconnect_min_delay {
            return Err(invalid(
                "--reconnect-max-delay",
                format!(
                    "{:?} is below --reconnect-min-delay {:?}",
                    self.reconnect_max_delay, self.reconnect_min_delay
                ),
            ));
        }
        // Warnings wait in the settings until every flag is checked: a bad
        // flag is the one line a failed start prints.
        let mut warnings = Vec::new();
        let mut effective = self.effective;
        let keepalive = (!self.keepalive_interval.is_zero()).then_some(self.keepalive_interval);
        if keepalive.is_some_and(|k| k < GALLEY_MIN_KEEPALIVE) {
            warnings.push(format!(
                "--keepalive-interval {} is below Galley's 30s minimum; Galley answers with GOAWAY ENHANCE_YOUR_CALM",
                humantime::format_duration(self.keepalive_interval)
            ));
        }
        let node_id = match self.node_id {
            Some(id) if id.trim().is_empty() => return Err(invalid("--node-id", "must not be empty")),
            Some(id) => id,
            None => {
                let host = gethostname::gethostname().to_string_lossy().into_owned();
                in_effect(&mut effective, "--node-id", &host, "default (this host's name)");
                host
            }
        };
        let node = SinkNode {
            id: node_id,
            annotations: self.node_annotations.into_iter().collect(),
        };
        let server_tls = server_tls(self.tls_cert, self.tls_key, self.client_ca)?;
        let mtls = server_tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        let client_allow = allow_list("--client-allow", &self.client_allow, mtls)?;
        let access_policy = match &self.access_policy {
            Some(path) => AccessPolicy::load(path).map_err(|e| invalid("--access-policy", e.to_string()))?,
            None => AccessPolicy::none(),
        };
        let sink_allow = allow_list("--sink-allow", &self.sink_allow, mtls)?;
        let upstream_tls = ClientTlsFiles {
            ca: self.upstream_ca,
            cert: self.upstream_cert,
            key: self.upstream_key,
            server_name: self.upstream_server_name,
            flag_prefix: "--upstream-",
        };
        let given: Vec<&str> = [
            self.upstream.as_ref().map(|_| "--upstream"),
            self.sink_listen.as_ref().map(|_| "--sink-listen"),
            self.source_dir.as_ref().map(|_| "--source-dir"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let (true, Some(first)) = (self.demo, given.first()) {
            return Err(invalid(
                "--demo",
                format!("serves the compiled-in example config and cannot be combined with {first}"),
            ));
        }
        if let [first, second, ..] = given[..] {
            return Err(invalid(
                if second == "--sink-listen" {
                    "--sink-listen"
                } else {
                    "--source-dir"
                },
                format!(
                    "cannot be combined with {first}: the gateway takes config from exactly one source \
                     (--upstream to dial Galley, --sink-listen for Galley's dial-out, --source-dir for local files)"
                ),
            ));
        }
        if self.sink_listen.is_none() {
            if self.sink_insecure {
                return Err(invalid("--sink-insecure", "only applies with --sink-listen"));
            }
            if sink_allow.is_some() {
                return Err(invalid("--sink-allow", "only applies with --sink-listen"));
            }
        }
        let source = if let Some(url) = self.upstream {
            let address = validate_upstream(&url)?;
            let tls = if address.starts_with("https://") {
                upstream_tls.load().map_err(tls_config_error)?;
                Some(upstream_tls)
            } else {
                if let Some(flag) = upstream_tls.first_flag() {
                    return Err(invalid(flag, "only applies to an https:// --upstream"));
                }
                None
            };
            if self.connect_timeout.is_zero() {
                return Err(invalid("--connect-timeout", "must be above zero"));
            }
            if self.max_chain_depth < 2 {
                return Err(invalid(
                    "--max-chain-depth",
                    format!(
                        "{} leaves no room for an upstream gateway (it counts this one); the default is 4",
                        self.max_chain_depth
                    ),
                ));
            }
            Source::Client(ClientSettings {
                address,
                node,
                incremental: !self.no_incremental,
                max_message_bytes: self.max_message_bytes,
                keepalive,
                backoff: BackoffPolicy {
                    min: self.reconnect_min_delay,
                    max: self.reconnect_max_delay,
                },
                tls,
                connect_timeout: self.connect_timeout,
                max_chain_depth: self.max_chain_depth,
            })
        } else {
            if let Some(flag) = upstream_tls.first_flag() {
                return Err(invalid(flag, "only applies to an https:// --upstream"));
            }
            if let Some(listen) = self.sink_listen {
                if !mtls && !self.sink_insecure {
                    return Err(invalid(
                        "--sink-listen",
                        "whoever dials this port becomes the config source of every client, so sources must be \
                         authenticated: give --tls-cert, --tls-key and --client-ca (mTLS, and --sink-allow for the \
                         source's identity), or --sink-insecure where the network alone is trusted",
                    ));
                }
                Source::Sink(SinkSettings {
                    listen,
                    node,
                    incremental: !self.no_incremental,
                    max_message_bytes: self.max_message_bytes,
                    allow: sink_allow,
                    insecure: !mtls,
                })
            } else {
                let given = self.source_dir.is_some();
                let dir = source_dir(self.source_dir, self.demo)?;
                if !given {
                    match &dir {
                        SourceDir::Embedded => {
                            in_effect(&mut effective, "--source-dir", "(compiled-in examples)", "--demo")
                        }
                        SourceDir::Dir(path) => in_effect(
                            &mut effective,
                            "--source-dir",
                            &path.display().to_string(),
                            &format!("default (./{DEFAULT_SOURCE_DIR} exists: a checkout)"),
                        ),
                    }
                }
                Source::Files(dir)
            }
        };
        if self.collections.is_none() {
            let names: Vec<&str> = collections.iter().map(|c| &**c).collect();
            in_effect(
                &mut effective,
                "--collections",
                &names.join(","),
                "default (Istio's networking collections)",
            );
        }
        for (flag, value) in [
            ("--max-streams-per-connection", self.max_streams_per_connection as usize),
            ("--max-streams", self.max_streams),
            ("--max-new-streams-per-second", self.max_new_streams_per_second as usize),
            ("--max-requests-per-second", self.max_requests_per_second as usize),
            ("--max-types-per-stream", self.max_types_per_stream),
            ("--max-grants-per-version", self.max_grants_per_version),
            ("--max-subscribed-names", self.max_subscribed_names),
            ("--max-nack-memory-entries", self.max_nack_memory_entries),
            (
                "--max-nack-memory-entries-per-identity",
                self.max_nack_memory_entries_per_identity.unwrap_or(1),
            ),
            ("--history", self.history),
            ("--max-resets-per-minute", self.max_resets_per_minute as usize),
            ("--max-pings-per-minute", self.max_pings_per_minute as usize),
            ("--max-settings-per-minute", self.max_settings_per_minute as usize),
            (
                "--max-control-frames-per-minute",
                self.max_control_frames_per_minute as usize,
            ),
            ("--http-max-connections", self.http_max_connections),
        ] {
            if value == 0 {
                return Err(invalid(flag, "must be at least 1"));
            }
        }
        if !(65_535..=(1 << 31) - 1).contains(&self.max_receive_window_bytes) {
            return Err(invalid(
                "--max-receive-window-bytes",
                "must be between 65535 (HTTP/2's initial window) and 2147483647",
            ));
        }
        for (flag, value, minimum) in [
            ("--max-request-bytes", self.max_request_bytes, 1024),
            ("--max-nack-message-bytes", self.max_nack_message_bytes, 64),
            ("--max-header-list-bytes", self.max_header_list_bytes as usize, 1024),
            ("--http-max-request-bytes", self.http_max_request_bytes, 1024),
        ] {
            if value < minimum {
                return Err(invalid(flag, format!("{value} is below the minimum of {minimum}")));
            }
        }
        if self.max_request_buffer_bytes < self.max_request_bytes {
            return Err(invalid(
                "--max-request-buffer-bytes",
                format!(
                    "{} is below --max-request-bytes={}: the largest request could never be received",
                    self.max_request_buffer_bytes, self.max_request_bytes
                ),
            ));
        }
        if u32::try_from(self.max_request_bytes).is_err() {
            return Err(invalid(
                "--max-request-bytes",
                "must be below 4 GiB (the gRPC frame limit)",
            ));
        }
        for (flag, value) in [
            ("--handshake-timeout", self.handshake_timeout),
            ("--http-header-timeout", self.http_header_timeout),
            ("--request-read-timeout", self.request_read_timeout),
            ("--stream-end-timeout", self.stream_end_timeout),
        ] {
            if value.is_zero() {
                return Err(invalid(flag, "must be above zero"));
            }
        }
        let fd_limit = crate::transport::raise_fd_limit();
        let reserve = crate::transport::fd_reserve(self.http_max_connections);
        let fd_room = fd_limit.saturating_sub(reserve).max(16) as usize;
        let max_connections = match self.max_connections {
            Some(0) => return Err(invalid("--max-connections", "must be at least 1")),
            Some(n) if n > fd_room => {
                return Err(invalid(
                    "--max-connections",
                    format!(
                        "{n} needs more file descriptors than the open file limit allows ({fd_limit}, of which \
                         {reserve} are kept for the upstream, the HTTP ports and the cache); raise the limit \
                         (ulimit -n) or lower the flag"
                    ),
                ))
            }
            Some(n) => n,
            None => {
                let n = fd_room.min(DEFAULT_MAX_CONNECTIONS);
                in_effect(
                    &mut effective,
                    "--max-connections",
                    &n.to_string(),
                    &format!("default ({DEFAULT_MAX_CONNECTIONS}, or fewer under the open file limit of {fd_limit})"),
                );
                n
            }
        };
        if !self.listen.ip().is_loopback() && !mtls {
            warnings.push(format!(
                "--listen {}: serving config without client authentication beyond this host: anyone who reaches \
                 --listen reads every resource; give --tls-cert, --tls-key and --client-ca (and --client-allow) \
                 to serve only trusted clients",
                self.listen
            ));
        }
        if self.stream_end_timeout >= self.shutdown_grace {
            warnings.push(format!(
                "--stream-end-timeout={} is not below --shutdown-grace={}: at shutdown, a stream whose client is \
                 not reading waits past the grace, and the gateway exits with it still open",
                humantime::format_duration(self.stream_end_timeout),
                humantime::format_duration(self.shutdown_grace)
            ));
        }
        if let Some(per_identity) = self.max_nack_memory_entries_per_identity {
            let total = self.max_nack_memory_entries;
            // How many identities, each at its share, fill the memory.
            let identities = total.div_ceil(per_identity.clamp(1, total.max(1))).max(1);
            if per_identity.saturating_mul(10) > total {
                let fill = if identities == 1 {
                    "one identity whose NACKs fill its share fills".to_owned()
                } else {
                    format!("{identities} identities whose NACKs fill their share fill")
                };
                warnings.push(format!(
                    "--max-nack-memory-entries-per-identity={per_identity} is more than a tenth of \
                     --max-nack-memory-entries={total}: {fill} the memory, and the next identity's NACKs are not \
                     remembered (room is never taken from another identity)"
                ));
            }
        }
        let idle_timeout = (!self.idle_timeout.is_zero()).then_some(self.idle_timeout);
        let bodies = crate::source::proto_json::BodyDecoder::new(self.descriptors.as_deref()).map_err(|e| {
            let file = self
                .descriptors
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            invalid("--descriptors", format!("{file}: {e}"))
        })?;
        let bodies = Arc::new(bodies.with_sensitive_types(table.sensitive_body_types()));
        if self.history > MAX_HISTORY {
            return Err(invalid(
                "--history",
                format!("{} is above the maximum of {MAX_HISTORY}", self.history),
            ));
        }
        if self.demand_timeout.is_zero() || self.demand_timeout > MAX_DEMAND_TIMEOUT {
            return Err(invalid(
                "--demand-timeout",
                format!(
                    "{} is outside 1ms to {}: a zero timeout answers a collection empty before any source could \
                     deliver it, and istiod is not ready until every type it asks for is answered; the default is 5s",
                    humantime::format_duration(self.demand_timeout),
                    humantime::format_duration(MAX_DEMAND_TIMEOUT)
                ),
            ));
        }
        if self.canary.len() > MAX_SELECTORS {
            return Err(invalid(
                "--canary",
                format!(
                    "{} selectors are more than the maximum of {MAX_SELECTORS}",
                    self.canary.len()
                ),
            ));
        }
        let canaries = self
            .canary
            .iter()
            .map(|text| Selector::parse(text).map_err(|e| invalid("--canary", e)))
            .collect::<Result<Vec<_>, _>>()?;
        let canary_membership = canary_membership(
            &self.canary,
            self.canary_trust_node_ids,
            mtls,
            &access_policy,
            &mut warnings,
        )?;
        let client_generations = crate::skew::GenerationRules::parse(&self.client_generation)
            .map_err(|e| invalid("--client-generation", format!("{:?}: {}", e.rule, e.reason)))?;
        if !self.memory_trim_interval.is_zero() && self.memory_trim_interval < MIN_MEMORY_TRIM_INTERVAL {
            return Err(invalid(
                "--memory-trim-interval",
                format!(
                    "{} is below the minimum of {} (each check walks the allocator's free lists; \"0s\" turns trimming off)",
                    humantime::format_duration(self.memory_trim_interval),
                    humantime::format_duration(MIN_MEMORY_TRIM_INTERVAL)
                ),
            ));
        }
        duration_at_most(
            "--worker-idle-wait",
            self.worker_idle_wait,
            MAX_WORKER_IDLE_WAIT,
            " (a burst's first event waits up to it; \"0s\" turns the wait off)",
        )?;
        duration_at_most("--canary-soak", self.canary_soak, MAX_CANARY_SOAK, "")?;
        Ok(Settings {
            serve: Serve::Gateway,
            demo: self.demo,
            source,
            cache_dir: self.cache_dir,
            history: self.history,
            canaries,
            canary_membership,
            client_generations,
            canary_when_none: self.canary_when_none,
            canary_soak: self.canary_soak,
            server_tls,
            client_allow,
            access_policy: Arc::new(access_policy),
            table: Arc::new(table),
            type_map: self.type_map,
            collections,
            listen: self.listen,
            admin_listen: self.admin_listen,
            monitoring_listen: self.monitoring_listen,
            shutdown_grace: self.shutdown_grace,
            stale_after: self.stale_after,
            debug_access_wait: self.debug_access_wait,
            demand_timeout: self.demand_timeout,
            bodies,
            effective,
            warnings,
            grpc: GrpcLimits {
                max_streams_per_connection: self.max_streams_per_connection,
                max_header_list_bytes: self.max_header_list_bytes,
                handshake_timeout: self.handshake_timeout,
                idle_timeout,
                keepalive,
                max_connection_age: (!self.max_connection_age.is_zero()).then_some(self.max_connection_age),
                max_connection_age_grace: self.max_connection_age_grace,
                floods: FloodLimits {
                    resets_per_minute: self.max_resets_per_minute,
                    pings_per_minute: self.max_pings_per_minute,
                    settings_per_minute: self.max_settings_per_minute,
                    control_frames_per_minute: self.max_control_frames_per_minute,
                },
                max_pending_accept_resets: 20,
                max_local_error_resets: 200,
                receive_window: self.max_receive_window_bytes,
            },
            max_connections,
            max_streams: self.max_streams,
            max_new_streams_per_second: self.max_new_streams_per_second,
            downstream: DownstreamLimits {
                max_requests_per_second: self.max_requests_per_second,
                max_request_bytes: self.max_request_bytes,
                max_request_buffer_bytes: self.max_request_buffer_bytes,
                request_read_timeout: self.request_read_timeout,
                stream_end_timeout: self.stream_end_timeout,
                max_nack_message_bytes: self.max_nack_message_bytes,
                max_types_per_stream: self.max_types_per_stream,
                max_grants_per_version: self.max_grants_per_version,
                max_subscribed_names: self.max_subscribed_names,
                sotw_resend_unchanged: self.sotw_resend_unchanged,
                nack_memory: self.nack_memory,
                max_nack_memory_entries: self.max_nack_memory_entries,
                // A tenth of the memory unless given: one identity never
                // fills it, whatever the total.
                max_nack_memory_entries_per_identity: self
                    .max_nack_memory_entries_per_identity
                    .unwrap_or(self.max_nack_memory_entries / 10)
                    .clamp(1, self.max_nack_memory_entries.max(1)),
                listener_drain_time: self.listener_drain_time,
            },
            http: HttpLimits {
                max_connections: self.http_max_connections,
                header_timeout: self.http_header_timeout,
                max_request_bytes: self.http_max_request_bytes,
            },
            max_source_file_bytes: self.max_message_bytes,
            memory_trim_interval: (!self.memory_trim_interval.is_zero()).then_some(self.memory_trim_interval),
            worker_idle_wait: (!self.worker_idle_wait.is_zero()).then_some(self.worker_idle_wait),
        })
    }
}

/// `flag`'s `value` if it is at most `max`; else the error naming both,
/// then `why`.
fn duration_at_most(flag: &'static str, value: Duration, max: Duration, why: &str) -> Result<(), ConfigError> {
    if value <= max {
        return Ok(());
    }
    Err(invalid(
        flag,
        format!(
            "{} is above the maximum of {}{why}",
            humantime::format_duration(value),
            humantime::format_duration(max)
        ),
    ))
}

/// Records the value `flag` has in effect, where it was not given (a
/// command line or environment value stays as given).
fn in_effect(effective: &mut [EffectiveFlag], flag: &str, value: &str, source: &str) {
    if let Some(entry) = effective
        .iter_mut()
        .find(|f| f.flag == flag && (f.source == "default" || f.source == "not set"))
    {
        entry.value = Some(value.to_owned());
        entry.source = source.to_owned();
    }
}

/// What makes a client whose node matches `--canary` a canary: secure by
/// default, a proven identity the access policy allows; node ids alone only
/// when `--canary-trust-node-ids` says so. Without a way for any client to
/// prove it may be a canary, `--canary` is refused rather than silently
/// making no canary.
fn canary_membership(
    selectors: &[String],
    trust_node_ids: bool,
    mtls: bool,
    policy: &AccessPolicy,
    warnings: &mut Vec<String>,
) -> Result<Membership, ConfigError> {
    const HOW: &str = "give --tls-cert, --tls-key and --client-ca (mTLS), and an --access-policy rule with \
                       `canary: true` for your canaries' identities (the selectors then choose among them); or \
                       --canary-trust-node-ids to let node ids, which any client writes, decide";
    if selectors.is_empty() {
        if trust_node_ids {
            return Err(invalid("--canary-trust-node-ids", "only applies with --canary"));
        }
        return Ok(Membership::Identity);
    }
    if trust_node_ids {
        warnings.push(
            "--canary-trust-node-ids: node ids and metadata, which every client writes of itself, decide who is a \
             canary: any client that can connect and names itself so gets new versions first, its NACK holds a \
             version from everyone, and its ACK can release one"
                .into(),
        );
        return Ok(Membership::NodeIds);
    }
    if !mtls {
        return Err(invalid(
            "--canary",
            format!(
                "a canary holds or releases versions for everyone, so it must prove who it is, and without \
                 --client-ca no client proves an identity: {HOW}"
            ),
        ));
    }
    if policy.path().is_none() {
        return Err(invalid(
            "--canary",
            format!("who may be a canary is a rule of --access-policy, and none is given: {HOW}"),
        ));
    }
    if policy.canary_rules() == 0 {
        return Err(invalid(
            "--canary",
            format!("no rule of --access-policy has `canary: true`, so no client could be a canary: {HOW}"),
        ));
    }
    Ok(Membership::Identity)
}

fn allow_list(flag: &'static str, values: &[String], mtls: bool) -> Result<Option<AllowList>, ConfigError> {
    if values.is_empty() {
        return Ok(None);
    }
    if !mtls {
        return Err(invalid(
            flag,
            "identities come from client certificates: give --tls-cert, --tls-key and --client-ca",
        ));
    }
    AllowList::parse(flag, values).map(Some).map_err(|e| invalid(flag, e))
}

fn tls_config_error(e: TlsError) -> ConfigError {
    invalid(e.flag, format!("{}: {}", e.path.display(), e.message))
}

fn server_tls(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<ServerTlsFiles>, ConfigError> {
    let files = match (cert, key) {
        (None, None) => {
            if client_ca.is_some() {
                return Err(invalid(
                    "--client-ca",
                    "requires --tls-cert and --tls-key (mTLS is TLS first)",
                ));
            }
            return Ok(None);
        }
        (Some(_), None) => return Err(invalid("--tls-key", "is required with --tls-cert")),
        (None, Some(_)) => return Err(invalid("--tls-cert", "is required with --tls-key")),
        (Some(cert), Some(key)) => ServerTlsFiles { cert, key, client_ca },
    };
    files.load().map_err(tls_config_error)?;
    Ok(Some(files))
}

/// The local source: `--source-dir`, else `examples/config` where it exists
/// (a checkout), else the compiled-in copy with `--demo` only: a container
/// started without its source flag must not push example config to real
/// clients.
fn source_dir(dir: Option<PathBuf>, demo: bool) -> Result<SourceDir, ConfigError> {
    match dir {
        Some(dir) if dir.is_dir() => Ok(SourceDir::Dir(dir)),
        Some(dir) => Err(invalid(
            "--source-dir",
            format!("{} is not a readable directory", dir.display()),
        )),
        None if demo => Ok(SourceDir::Embedded),
        None if Path::new(DEFAULT_SOURCE_DIR).is_dir() => Ok(SourceDir::Dir(DEFAULT_SOURCE_DIR.into())),
        None => Err(invalid(
            "--upstream",
            format!(
                "no source of config: give --upstream (dial Galley), --sink-listen (Galley's dial-out) or \
                 --source-dir (local files); ./{DEFAULT_SOURCE_DIR} is not here, and the compiled-in example \
                 config is served only with --demo"
            ),
        )),
    }
}

/// An address a flag dials: user info (`user:password@`), a query or a
/// fragment is never sent by gRPC, and the address is logged and shown in
/// views; refused without quoting it (it may hold a credential).
pub(crate) fn refuse_credentials_in_address(flag: &'static str, address: &str) -> Result<(), ConfigError> {
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(invalid(
            flag,
            "the address holds user info (USER:PASSWORD@), which gRPC never sends and the logs would show; give \
             the host and port alone (a client certificate authenticates the gateway)"
                .to_owned(),
        ));
    }
    let path = rest.find('/').map_or("", |at| &rest[at..]);
    if !path.is_empty() && path != "/" && !path.contains(['?', '#']) {
        return Err(invalid(
            flag,
            "the address holds a path, which gRPC never uses and the logs would show; give the host and port alone"
                .to_owned(),
        ));
    }
    if address.contains(['?', '#']) {
        return Err(invalid(
            flag,
            "the address holds a query or a fragment, which gRPC never sends and the logs would show; give the \
             host and port alone"
                .to_owned(),
        ));
    }
    Ok(())
}

fn validate_upstream(url: &str) -> Result<String, ConfigError> {
    refuse_credentials_in_address("--upstream", url)?;
    // Not quoted back: the logs would show it, and what follows a port may
    // be anything.
    let uri: tonic::transport::Uri = url
        .parse()
        .map_err(|e| invalid("--upstream", format!("not a URL like http://galley:9901: {e}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {}
        _ => {
            return Err(invalid(
                "--upstream",
                "needs the scheme http:// or https://, as in http://galley:9901",
            ))
        }
    }
    let (host, port) = crate::transport::connect::host_and_port(&uri);
    if host.is_empty() {
        return Err(invalid("--upstream", "has no host; use http://HOST:PORT"));
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b))
    {
        return Err(invalid(
            "--upstream",
            "the host holds what no host name or address does; use http://HOST:PORT",
        ));
    }
    if port.is_some_and(|p| !crate::transport::connect::is_port(p)) {
        return Err(invalid(
            "--upstream",
            "the port is not a number from 1 to 65535; use http://HOST:PORT",
        ));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

pub(crate) fn parse_key_value() -> KeyValue {
    KeyValue
}

/// A `KEY=VALUE` flag's parser (`--node-annotation`, `--sink-meta`): its
/// refusal quotes nothing (clap's own `invalid value '…'` would, and the
/// part of a value after a comma, which splits the flag's values, may be a
/// credential's tail).
#[derive(Clone)]
pub(crate) struct KeyValue;

impl clap::builder::TypedValueParser for KeyValue {
    type Value = (String, String);

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<(String, String), clap::Error> {
        let flag = arg.and_then(clap::Arg::get_long).unwrap_or("the flag");
        let refused = || {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("--{flag}: a value is not KEY=VALUE (values are split at commas: a value cannot hold one)\n"),
            )
            .with_cmd(cmd)
        };
        let value = value.to_str().ok_or_else(refused)?;
        match value.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => Ok((key.trim().to_owned(), value.to_owned())),
            _ => Err(refused()),
        }
    }
}

pub(crate) fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|e| format!("{value:?} is not a duration like 30s or 100ms: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings, String> {
        let args = Args::try_parse_from(std::iter::once("mcp-xds-gateway").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        args.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_istios_networking_collections() {
        let settings = parse(&[]).unwrap();
        assert_eq!(settings.collections.len(), 6);
        assert!(matches!(settings.source, Source::Files(_)));
        // Config and debug views stay on this host unless a flag says so;
        // the monitoring port is for the kubelet and Prometheus.
        assert_eq!(settings.listen.to_string(), "127.0.0.1:15010");
        assert_eq!(settings.admin_listen.to_string(), "127.0.0.1:15000");
        assert_eq!(settings.monitoring_listen.to_string(), "0.0.0.0:15014");
    }

    /// A worker waits 200 µs for more events by default; `0s` is no wait,
    /// and a wait past 5 ms is refused by name.
    #[test]
    fn the_worker_idle_wait_defaults_to_200us_and_is_bounded() {
        assert_eq!(parse(&[]).unwrap().worker_idle_wait, Some(Duration::from_micros(200)));
        assert_eq!(parse(&["--worker-idle-wait", "0s"]).unwrap().worker_idle_wait, None);
        assert_eq!(
            parse(&["--worker-idle-wait", "5ms"]).unwrap().worker_idle_wait,
            Some(MAX_WORKER_IDLE_WAIT)
        );
        let refused = parse(&["--worker-idle-wait", "50ms"]).unwrap_err();
        assert!(
            refused.contains("--worker-idle-wait") && refused.contains("5ms") && refused.contains("0s"),
            "{refused}"
        );
    }

    #[test]
    fn flags_left_out_show_the_value_they_took_and_warnings_wait() {
        let parse = |args: &[&str]| {
            Args::try_parse_with_sources(std::iter::once("mcp-xds-gateway").chain(args.iter().copied()))
                .unwrap()
                .validate()
                .unwrap()
        };
        let settings = parse(&["--keepalive-interval", "5s"]);
        let flag = |name: &str| settings.effective.iter().find(|f| f.flag == name).unwrap().clone();
        // Unit tests run from the package root: a checkout.
        assert_eq!(flag("--source-dir").value.as_deref(), Some(DEFAULT_SOURCE_DIR));
        assert!(flag("--source-dir")
            .source
            .starts_with("default (./examples/config exists"));
        assert_eq!(
            flag("--node-id").value,
            Some(gethostname::gethostname().to_string_lossy().into_owned())
        );
        assert_eq!(
            flag("--max-connections").value,
            Some(settings.max_connections.to_string())
        );
        assert_eq!(flag("--collections").value.unwrap().split(',').count(), 6);
        // Given flags stay as given.
        assert_eq!(flag("--keepalive-interval").source, "command line");
        assert!(
            settings
                .warnings
                .iter()
                .any(|w| w.starts_with("--keepalive-interval 5s is below")),
            "{:?}",
            settings.warnings
        );
        // A stream's end that may outwait the shutdown: said; the defaults
        // (5 s, 10 s) say nothing.
        let outwaits = |args: &[&str]| {
            parse(args)
                .warnings
                .iter()
                .any(|w| w.starts_with("--stream-end-timeout=10s is not below --shutdown-grace=10s"))
        };
        assert!(outwaits(&["--stream-end-timeout", "10s"]));
        assert!(!parse(&[]).warnings.iter().any(|w| w.contains("--stream-end-timeout")));
        // A NACK memory share above a tenth: said, with what it allows.
        let shares = |args: &[&str]| {
            parse(args)
                .warnings
                .iter()
                .any(|w| w.starts_with("--max-nack-memory-entries-per-identity=15 is more than a tenth"))
        };
        assert!(shares(&[
            "--max-nack-memory-entries",
            "20",
            "--max-nack-memory-entries-per-identity",
            "15"
        ]));
        assert!(!shares(&[
            "--max-nack-memory-entries",
            "200",
            "--max-nack-memory-entries-per-identity",
            "15"
        ]));
        // How many identities fill it: rounded up, one when a share is all.
        let said = |total: &str, share: &str| {
            parse(&[
                "--max-nack-memory-entries",
                total,
                "--max-nack-memory-entries-per-identity",
                share,
            ])
            .warnings
            .into_iter()
            .find(|w| w.contains("is more than a tenth"))
            .unwrap()
        };
        assert!(said("20", "15").contains(": 2 identities whose NACKs fill their share fill the memory"));
        assert!(said("20", "3").contains(": 7 identities"));
        assert!(said("20", "40").contains(": one identity whose NACKs fill its share fills the memory"));
        assert!(!said("20", "40").contains("  "), "{}", said("20", "40"));
        let given = parse(&["--node-id", "gw-7"]);
        let node = given.effective.iter().find(|f| f.flag == "--node-id").unwrap();
        assert_eq!(
            (node.value.as_deref(), node.source.as_str()),
            (Some("gw-7"), "command line")
        );
    }

    #[test]
    fn credentials_given_in_flags_are_never_shown() {
        // User info in --upstream is refused without quoting it.
        for url in ["http://user:pw-7Q@galley:9901", "https://pw-7Q@galley:9901/x"] {
            let err = parse(&["--upstream", url]).unwrap_err();
            assert!(err.contains("--upstream") && err.contains("user info"), "{err}");
            assert!(!err.contains("pw-7Q"), "{err}");
        }
        for url in ["http://galley:9901/?token=pw-7Q", "http://galley:9901#pw-7Q"] {
            let err = parse(&["--upstream", url]).unwrap_err();
            assert!(
                err.contains("--upstream") && err.contains("a query or a fragment"),
                "{err}"
            );
            assert!(!err.contains("pw-7Q"), "{err}");
        }
        // A path is refused too, without quoting it.
        let err = parse(&["--upstream", "http://galley:9901/pw-7Q"]).unwrap_err();
        assert!(err.contains("a path") && !err.contains("pw-7Q"), "{err}");
        assert!(parse(&["--upstream", "http://galley:9901/"]).is_ok());
        assert!(parse(&["--upstream", "http://[::1]:9901"]).is_ok());
        // A value's tail after a comma (split off as a value of its own)
        // is not quoted by the refusal.
        // A token left in a key (`authorization: Bearer …==` split at its
        // first `=`) is not shown as a key.
        let settings = Args::try_parse_with_sources([
            "mcp-xds-gateway",
            "--node-annotation",
            "authorization: Bearer pw-7Qc2VjcmV0==",
        ])
        .unwrap()
        .validate()
        .unwrap();
        let shown = format!("{:?}", settings.effective);
        assert!(
            !shown.contains("pw-7Q") && shown.contains("[redacted]=[redacted]"),
            "{shown}"
        );
        let err = parse(&["--node-annotation", "authorization=Bearer abc,pw-7Q"]).unwrap_err();
        assert!(err.contains("--node-annotation") && !err.contains("pw-7Q"), "{err}");
        // What follows a port, a port that is no number, a host no name
        // holds: refused without quoting (`;x` read as a port dialled 80).
        for bad in [
            "http://galley:9901;pw-7Q",
            "http://galley:pw-7Q",
            "http://gal;pw-7Q:9901",
            "ftp://pw-7Q:9901",
            "pw-7Q:9901",
        ] {
            let err = parse(&["--upstream", bad]).unwrap_err();
            assert!(err.contains("--upstream") && !err.contains("pw-7Q"), "{bad}: {err}");
        }
        // A credential's value among the annotations is redacted in the
        // effective configuration (`/debug/config`, the first log line);
        // the others are shown, and both are sent.
        let args = Args::try_parse_with_sources(["mcp-xds-gateway", "--node-annotation", "auth-token=pw-7Q,zone=eu-1"])
            .unwrap();
        assert!(args
            .node_annotations
            .contains(&("auth-token".to_owned(), "pw-7Q".to_owned())));
        let settings = args.validate().unwrap();
        let shown = settings
            .effective
            .iter()
            .find(|f| f.flag == "--node-annotation")
            .unwrap();
        assert_eq!(shown.value.as_deref(), Some("auth-token=[redacted],zone=eu-1"));
    }

    #[test]
    fn history_defaults_to_the_caches_and_is_bounded() {
        assert_eq!(parse(&[]).unwrap().history, crate::cache::DEFAULT_HISTORY);
        assert_eq!(parse(&["--history", "1"]).unwrap().history, 1);
        let zero = parse(&["--history", "0"]).unwrap_err();
        assert!(zero.contains("--history") && zero.contains("at least 1"), "{zero}");
        let many = parse(&["--history", "1001"]).unwrap_err();
        assert!(many.contains("--history") && many.contains("maximum of 1000"), "{many}");
    }

    #[test]
    fn upstream_settings_follow_the_flags() {
        let settings = parse(&[
            "--upstream",
            "http://galley:9901",
            "--node-id",
            "gw-1",
            "--node-annotation",
            "team=mesh",
            "--node-annotation",
            "zone=a",
            "--no-incremental",
        ])
        .unwrap();
        let Source::Client(upstream) = settings.source else {
            panic!("client mode")
        };
        assert_eq!(upstream.address, "http://galley:9901");
        assert_eq!(upstream.node.id, "gw-1");
        assert_eq!(upstream.node.annotations.get("team").map(String::as_str), Some("mesh"));
        assert_eq!(upstream.node.annotations.len(), 2);
        assert!(!upstream.incremental);
        assert_eq!(upstream.max_message_bytes, 64 << 20);
        assert_eq!(upstream.keepalive, Some(Duration::from_secs(30)));
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&["--upstream", "galley:9901"][..], "--upstream"),
            (&["--upstream", "ftp://galley:9901"][..], "--upstream"),
            (
                &["--upstream", "http://g:1", "--sink-listen", "127.0.0.1:0"][..],
                "--sink-listen",
            ),
            (&["--upstream", "http://g:1", "--source-dir", "."][..], "--source-dir"),
            (
                &["--sink-listen", "127.0.0.1:0", "--source-dir", "."][..],
                "--source-dir",
            ),
            (&["--source-dir", "/nonexistent/dir"][..], "--source-dir"),
            (
                &["--upstream", "http://g:1", "--upstream-ca", "/x.pem"][..],
                "--upstream-ca",
            ),
            (
                &["--upstream", "https://g:1", "--upstream-ca", "/nonexistent.pem"][..],
                "--upstream-ca",
            ),
            (&["--tls-cert", "/nonexistent.pem"][..], "--tls-key"),
            (
                &["--tls-cert", "/nonexistent.pem", "--tls-key", "/k.pem"][..],
                "--tls-cert",
            ),
            (&["--client-ca", "/ca.pem"][..], "--client-ca"),
            (&["--collections", "istio/nope"][..], "--collections"),
            (&["--collections", ","][..], "--collections"),
            (&["--max-message-bytes", "10"][..], "--max-message-bytes"),
            (&["--reconnect-min-delay", "0s"][..], "--reconnect-min-delay"),
            (&["--stream-end-timeout", "0s"][..], "--stream-end-timeout"),
            (&["--reconnect-max-delay", "1ms"][..], "--reconnect-max-delay"),
            (&["--node-id", " "][..], "--node-id"),
            (&["--node-annotation", "novalue"][..], "--node-annotation"),
            (&["--keepalive-interval", "soon"][..], "--keepalive-interval"),
            (&["--listen", "nowhere"][..], "--listen"),
            (&["--type-map", "/nonexistent/map.yaml"][..], "--type-map"),
            (
                &["--sensitive-version-key", "/nonexistent/key"][..],
                "--sensitive-version-key",
            ),
            // Fewer than 32 bytes.
            (&["--sensitive-version-key", "/dev/null"][..], "--sensitive-version-key"),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(flag), "{args:?}: {err}");
        }
    }
}
