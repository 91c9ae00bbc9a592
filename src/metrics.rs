//! Every metric name the gateway records, declared in one place with its help
//! text, and the Prometheus exporter behind `/metrics`. Labels are bounded:
//! collection, code, reason, kind, protocol, dialect, component; never a
//! client, a node id or an address.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{describe_counter, describe_gauge, Counter, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::SharedStr;

mod histogram;

pub use histogram::Buckets;

/// Istio's own names, so existing alerts keep working.
pub const CLIENTS: &str = "istio_mcp_clients_total";
pub const MESSAGE_SIZES: &str = "istio_mcp_message_sizes_bytes";
pub const REQUEST_ACKS: &str = "istio_mcp_request_acks_total";
pub const REQUEST_NACKS: &str = "istio_mcp_request_nacks_total";
pub const SEND_FAILURES: &str = "istio_mcp_send_failures_total";
pub const RECV_FAILURES: &str = "istio_mcp_recv_failures_total";
pub const RECONNECTIONS: &str = "istio_mcp_reconnections";

pub const UPSTREAM_CONNECTED: &str = "mcp_gateway_upstream_connected";
pub const UPSTREAM_CONNECT_ATTEMPTS: &str = "mcp_gateway_upstream_connect_attempts_total";
pub const UPSTREAM_STREAM_TERMINATIONS: &str = "mcp_gateway_upstream_stream_terminations_total";
pub const UPSTREAM_REFUSED_COLLECTIONS: &str = "mcp_gateway_upstream_refused_collections_total";
pub const DEMAND_TIMEOUTS: &str = "mcp_gateway_upstream_demand_timeouts_total";
pub const PROBE_ENDS: &str = "mcp_gateway_upstream_probe_ends_total";
pub const UPDATES_APPLIED: &str = "mcp_gateway_updates_applied_total";
pub const LAST_UPDATE: &str = "mcp_gateway_last_update_timestamp_seconds";
pub const CACHE_RESOURCES: &str = "mcp_gateway_cache_resources";
pub const CACHE_BYTES: &str = "mcp_gateway_cache_bytes";
pub const HISTORY_VERSIONS: &str = "mcp_gateway_history_versions";
pub const HISTORY_BYTES: &str = "mcp_gateway_history_bytes";
pub const ROLLOUT_PINNED: &str = "mcp_gateway_pinned";
pub const ROLLOUT_HELD: &str = "mcp_gateway_held";
pub const ROLLOUT_CANARY_ROUND: &str = "mcp_gateway_canary_round";
pub const ROLLOUT_CANARIES: &str = "mcp_gateway_canaries";
pub const ROLLOUT_CANARY_CLAIMS_REFUSED: &str = "mcp_gateway_canary_claims_refused_total";
pub const DOWNSTREAM_STREAMS: &str = "mcp_gateway_downstream_streams";
pub const DOWNSTREAM_PUSHES: &str = "mcp_gateway_downstream_pushes_total";
pub const DOWNSTREAM_STALE_REQUESTS: &str = "mcp_gateway_downstream_stale_requests_total";
pub const PUSH_LATENCY: &str = "mcp_gateway_push_latency_seconds";
pub const CLIENTS_BEHIND: &str = "mcp_gateway_clients_behind";
pub const CLIENTS_BY_STATUS: &str = "mcp_gateway_clients";
pub const SOURCE_FILES_BROKEN: &str = "mcp_gateway_source_files_broken";
pub const SOURCE_FILES_PARSED: &str = "mcp_gateway_source_files_parsed_total";
pub const OVERSIZED_RESPONSES: &str = "mcp_gateway_oversized_responses_total";
pub const BUILD_INFO: &str = "mcp_gateway_build_info";
/// Tasks alive on the gateway's tokio runtime (a leak shows as growth).
pub const RUNTIME_TASKS: &str = "mcp_gateway_runtime_tasks";
pub const LIMIT_REFUSALS: &str = "mcp_gateway_limit_refusals_total";
pub const CONNECTIONS: &str = "mcp_gateway_connections";
/// Bytes of large client requests being read now, of `--max-request-buffer-bytes`.
pub const REQUEST_BUFFER_BYTES: &str = "mcp_gateway_request_buffer_bytes";
pub const CONNECTIONS_CLOSED: &str = "mcp_gateway_connections_closed_total";
pub const CONNECTIONS_EVICTED: &str = "mcp_gateway_connections_evicted_total";
pub const ACCEPT_ERRORS: &str = "mcp_gateway_accept_errors_total";
pub const PEERS_NOT_ALLOWED: &str = "mcp_gateway_peers_not_allowed_total";
/// `--access-policy` refusals: a collection (the stream ends) or names
/// (withheld), by `reason`.
pub const ACCESS_DENIED: &str = "mcp_gateway_access_denied_total";
/// Distinct name grants of a collection served now, by `collection`
/// (`--max-grants-per-version`).
pub const ACCESS_GRANTS: &str = "mcp_gateway_access_grants";
/// `--access-policy` files read again after a change, by `result`.
pub const ACCESS_POLICY_RELOADS: &str = "mcp_gateway_access_policy_reloads_total";
/// Resources of a collection that a connected client's release drops a field
/// of (its protos lack it), by collection and generation (`1.1`).
pub const SKEW_RESOURCES: &str = "mcp_gateway_skew_resources";
/// The access policy's denial reasons.
pub const ACCESS_DENIAL_REASONS: [&str; 2] = ["collection", "name"];
pub const SINK_REFUSALS: &str = "mcp_gateway_sink_refusals_total";
/// `source --sink`: the stream it dials to a sink.
pub const DIAL_OUT_CONNECTED: &str = "mcp_gateway_dial_out_connected";
pub const DIAL_OUT_ATTEMPTS: &str = "mcp_gateway_dial_out_attempts_total";
pub const DIAL_OUT_STREAM_ENDS: &str = "mcp_gateway_dial_out_stream_ends_total";
pub const CACHE_WRITE_FAILURES: &str = "mcp_gateway_cache_write_failures_total";
pub const NACK_MESSAGES_TRUNCATED: &str = "mcp_gateway_nack_messages_truncated_total";
/// Changes of an Envoy type held back for another type of the same stream
/// (make before break), by `collection` and `step` (`add`, `remove`).
pub const ORDER_HOLDS: &str = "mcp_gateway_order_holds_total";
/// The steps of [`ORDER_HOLDS`].
pub const ORDER_HOLD_STEPS: [&str; 3] = ["add", "remove", "drain"];
/// The collections of the types make before break orders (their type URLs
/// are `downstream::order::Rank`'s), whose hold series are there from start.
const ORDERED_COLLECTIONS: [&str; 5] = [
    "envoy/extensions/transport_sockets/tls/v3/secrets",
    "envoy/config/cluster/v3/clusters",
    "envoy/config/endpoint/v3/clusterloadassignments",
    "envoy/config/listener/v3/listeners",
    "envoy/config/route/v3/routeconfigurations",
];
/// Clients and types whose NACKs are remembered (`--nack-memory`).
pub const NACK_MEMORY_ENTRIES: &str = "mcp_gateway_nack_memory_entries";
/// Remembered NACKs dropped before their client ACKed, by `reason`.
pub const NACK_MEMORY_DROPPED: &str = "mcp_gateway_nack_memory_dropped_total";
/// The `reason` label of `NACK_MEMORY_DROPPED`.
pub const NACK_MEMORY_DROP_REASONS: [&str; 3] = ["expired", "full", "identity_full"];
/// Resources a reconnecting xDS client reported holding at the current
/// content, not sent again.
pub const RECONNECT_SKIPPED: &str = "mcp_gateway_reconnect_resources_skipped_total";
/// Resources a reconnecting xDS client reported, sent again, by `reason`.
pub const RECONNECT_RESENT: &str = "mcp_gateway_reconnect_resources_resent_total";
/// The `reason` label of `RECONNECT_RESENT`.
pub const RECONNECT_RESENT_REASONS: [&str; 3] = ["changed", "nacked", "forced"];
/// Resources forced out again after another type's response (the load
/// assignments of clusters sent).
pub const FORCED_RESENDS: &str = "mcp_gateway_forced_resends_total";
pub const DOWNSTREAM_STREAM_ENDS: &str = "mcp_gateway_downstream_stream_ends_total";
pub const ADMIN_CONTROLS: &str = "mcp_gateway_admin_controls_total";
pub const ADMIN_REFUSALS: &str = "mcp_gateway_admin_refusals_total";
/// The `control` label of `ADMIN_CONTROLS`: the admin port's controls.
pub const ADMIN_CONTROL_NAMES: [&str; 4] = ["pin", "unpin", "promote", "logging"];
/// The `reason` label of `ADMIN_REFUSALS`.
pub const ADMIN_REFUSAL_REASONS: [&str; 2] = ["cross_site", "host"];

/// The family `metrics-process` exports the process's CPU time as.
pub const PROCESS_CPU_SECONDS: &str = "process_cpu_seconds_total";

/// The exposition with `process_cpu_seconds_total` typed as the counter it
/// is. `metrics` counters are integers: the CPU time is recorded as a gauge
/// to keep its sub-second part (whole seconds read as no CPU on an idle
/// gateway), and the exposition format allows a float counter.
pub fn cpu_seconds_as_counter(exposition: String) -> String {
    let gauge = format!("# TYPE {PROCESS_CPU_SECONDS} gauge\n");
    if !exposition.contains(&gauge) {
        return exposition;
    }
    exposition.replacen(&gauge, &format!("# TYPE {PROCESS_CPU_SECONDS} counter\n"), 1)
}

/// The log filter, changed at run time (`POST /logging` on the admin port),
/// like Envoy's admin `/logging`. The binary builds it around its
/// subscriber's reload handle; a gateway built in-process has none.
pub struct LogControl {
    apply: Box<ApplyFilter>,
    /// The filter in force, and where it came from.
    current: std::sync::Mutex<(String, String)>,
}

/// Sets a log filter, or says why it is not one.
type ApplyFilter = dyn Fn(&str) -> Result<(), String> + Send + Sync;

/// Where the log filter in force came from, once `POST /logging` set it.
pub const SET_AT_RUN_TIME: &str = "POST /logging";

impl LogControl {
    /// `initial` came from `origin` (`default`, `command line`,
    /// `environment (RUST_LOG)`, ...).
    pub fn new(
        initial: String,
        origin: String,
        apply: impl Fn(&str) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            apply: Box::new(apply),
            current: std::sync::Mutex::new((initial, origin)),
        }
    }

    /// Applies `filter` (tracing's EnvFilter syntax); an error says why it
    /// is not one, and the filter in force stays.
    pub fn set(&self, filter: &str) -> Result<(), String> {
        (self.apply)(filter)?;
        let (previous, _) = std::mem::replace(
            &mut *self.current.lock().unwrap_or_else(|e| e.into_inner()),
            (filter.to_owned(), SET_AT_RUN_TIME.to_owned()),
        );
        tracing::warn!(filter, previous, "log filter changed at run time (POST /logging)");
        Ok(())
    }

    pub fn current(&self) -> String {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).0.clone()
    }

    /// Where the filter in force came from.
    pub fn origin(&self) -> String {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).1.clone()
    }
}

impl std::fmt::Debug for LogControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogControl")
            .field("current", &self.current())
            .field("origin", &self.origin())
            .finish()
    }
}

/// Every `limit` label of [`LIMIT_REFUSALS`]: the flag or protocol bound
/// that refused a peer.
pub const LIMITS: &[&str] = &[
    "max_connections",
    "max_streams",
    "new_streams_rate",
    "requests_rate",
    "max_types_per_stream",
    "max_subscribed_names",
    "max_request_bytes",
    "handshake_timeout",
    "resets",
    "pings",
    "settings",
    "control_frames",
    "h2_resets",
    "http_connections",
    "http_header_timeout",
    "max_message_bytes",
    "request_read_timeout",
    "refused_streams",
    "max_grants_per_version",
    "stream_end_timeout",
    "debug_access_wait",
];

/// Every listener label: the flag that configured the port.
pub const LISTENERS: &[&str] = &["--listen", "--sink-listen", "--admin-listen", "--monitoring-listen"];

/// The gRPC listeners: the ports with connection slots (`--max-connections`,
/// the dial-out port's own).
pub const GRPC_LISTENERS: &[&str] = &["--listen", "--sink-listen"];

/// Every `reason` label of [`CONNECTIONS_CLOSED`].
pub const CLOSE_REASONS: &[&str] = &[
    "peer_closed",
    "handshake_timeout",
    "tls_handshake",
    "idle",
    "max_age",
    "flood",
    "keepalive_timeout",
    "protocol_error",
    "shutdown",
    "header_timeout",
    "evicted",
];

/// Every `reason` label of [`CONNECTIONS_EVICTED`].
pub const EVICTION_REASONS: [&str; 2] = ["handshake", "idle"];

/// A peer was refused by a limit.
pub fn limit_refused(limit: &'static str) {
    metrics::counter!(LIMIT_REFUSALS, "limit" => limit).increment(1);
}

pub fn connection_opened(listener: &'static str) {
    metrics::gauge!(CONNECTIONS, "listener" => listener).increment(1.0);
}

pub fn connection_closed(listener: &'static str, reason: &'static str) {
    metrics::gauge!(CONNECTIONS, "listener" => listener).decrement(1.0);
    metrics::counter!(CONNECTIONS_CLOSED, "listener" => listener, "reason" => reason).increment(1);
}

/// A connection without a live stream gave its slot to a new one at
/// `--max-connections`; `reason` is `handshake` or `idle`.
pub fn connection_evicted(listener: &'static str, reason: &'static str) {
    metrics::counter!(CONNECTIONS_EVICTED, "listener" => listener, "reason" => reason).increment(1);
}

pub fn accept_error(listener: &'static str, kind: &'static str) {
    metrics::counter!(ACCEPT_ERRORS, "listener" => listener, "kind" => kind).increment(1);
}

pub fn order_held(collection: &SharedStr, step: &'static str) {
    metrics::counter!(ORDER_HOLDS, "collection" => label(collection), "step" => step).increment(1);
}

pub fn access_denied(collection: &SharedStr, reason: &'static str, count: u64) {
    metrics::counter!(ACCESS_DENIED, "collection" => label(collection), "reason" => reason).increment(count);
}

pub fn skew_resources(collection: &SharedStr, generation: impl std::fmt::Display, count: usize) {
    metrics::gauge!(SKEW_RESOURCES, "collection" => label(collection), "generation" => generation.to_string())
        .set(count as f64);
}

/// Distinct name grants of `collection` served now.
pub fn access_grants(collection: &SharedStr, held: usize) {
    metrics::gauge!(ACCESS_GRANTS, "collection" => label(collection)).set(held as f64);
}

pub fn access_policy_reloaded(ok: bool) {
    metrics::counter!(ACCESS_POLICY_RELOADS, "result" => if ok { "ok" } else { "error" }).increment(1);
}

pub fn peer_not_allowed(listener: &'static str) {
    metrics::counter!(PEERS_NOT_ALLOWED, "listener" => listener).increment(1);
}

/// Registers every documented series with its label values at 0, so alerts
/// and dashboards see them before the first event (a counter that appears at
/// 1 has no increase to rate).
pub fn register_defaults(collections: &[SharedStr]) {
    for component in [COMPONENT_UPSTREAM, COMPONENT_DOWNSTREAM] {
        metrics::counter!(RECONNECTIONS, "component" => component).absolute(0);
        for code in CODES {
            metrics::counter!(SEND_FAILURES, "component" => component, "code" => *code).absolute(0);
            metrics::counter!(RECV_FAILURES, "component" => component, "code" => *code).absolute(0);
        }
    }
    for limit in LIMITS {
        metrics::counter!(LIMIT_REFUSALS, "limit" => *limit).absolute(0);
    }
    for listener in LISTENERS {
        metrics::gauge!(CONNECTIONS, "listener" => *listener).increment(0.0);
        metrics::counter!(PEERS_NOT_ALLOWED, "listener" => *listener).absolute(0);
        for kind in ["resources", "other"] {
            metrics::counter!(ACCEPT_ERRORS, "listener" => *listener, "kind" => kind).absolute(0);
        }
        for reason in CLOSE_REASONS {
            metrics::counter!(CONNECTIONS_CLOSED, "listener" => *listener, "reason" => *reason).absolute(0);
        }
    }
    for listener in GRPC_LISTENERS {
        for reason in EVICTION_REASONS {
            metrics::counter!(CONNECTIONS_EVICTED, "listener" => *listener, "reason" => reason).absolute(0);
        }
    }
    metrics::counter!(SINK_REFUSALS, "reason" => "another_source").absolute(0);
    metrics::counter!(UPSTREAM_CONNECT_ATTEMPTS).absolute(0);
    metrics::gauge!(CLIENTS, "component" => COMPONENT_DOWNSTREAM).set(0.0);
    metrics::gauge!(REQUEST_BUFFER_BYTES).set(0.0);
    metrics::counter!(NACK_MESSAGES_TRUNCATED).absolute(0);
    metrics::counter!(SOURCE_FILES_PARSED).absolute(0);
    for collection in ORDERED_COLLECTIONS {
        for step in ORDER_HOLD_STEPS {
            metrics::counter!(ORDER_HOLDS, "collection" => collection, "step" => step).absolute(0);
        }
    }
    for control in ADMIN_CONTROL_NAMES {
        metrics::counter!(ADMIN_CONTROLS, "control" => control, "code" => "200").absolute(0);
    }
    for reason in ADMIN_REFUSAL_REASONS {
        metrics::counter!(ADMIN_REFUSALS, "reason" => reason).absolute(0);
    }
    for result in ["ok", "error"] {
        metrics::counter!(ACCESS_POLICY_RELOADS, "result" => result).absolute(0);
    }
    for collection in collections {
        let c = || label(collection);
        for reason in ACCESS_DENIAL_REASONS {
            metrics::counter!(ACCESS_DENIED, "collection" => c(), "reason" => reason).absolute(0);
        }
        metrics::gauge!(ACCESS_GRANTS, "collection" => c()).set(0.0);
        metrics::counter!(UPSTREAM_REFUSED_COLLECTIONS, "collection" => c()).absolute(0);
        // Only Envoy's types are ordered; like every collection-labelled
        // family, the series of each configured collection is there.
        for step in ORDER_HOLD_STEPS {
            metrics::counter!(ORDER_HOLDS, "collection" => c(), "step" => step).absolute(0);
        }
        // A configured collection is never demanded; the series is there, at
        // 0, for the dashboards and the docs' promise of every series.
        metrics::counter!(DEMAND_TIMEOUTS, "collection" => c()).absolute(0);
        metrics::counter!(CACHE_WRITE_FAILURES, "collection" => c()).absolute(0);
        metrics::counter!(RECONNECT_SKIPPED, "collection" => c()).absolute(0);
        for reason in RECONNECT_RESENT_REASONS {
            metrics::counter!(RECONNECT_RESENT, "collection" => c(), "reason" => reason).absolute(0);
        }
        metrics::counter!(FORCED_RESENDS, "collection" => c()).absolute(0);
        metrics::counter!(ROLLOUT_CANARY_CLAIMS_REFUSED, "collection" => c()).absolute(0);
        for kind in ["full", "incremental"] {
            metrics::counter!(UPDATES_APPLIED, "collection" => c(), "kind" => kind).absolute(0);
        }
        for component in [COMPONENT_UPSTREAM, COMPONENT_DOWNSTREAM] {
            metrics::counter!(REQUEST_ACKS, "component" => component, "collection" => c()).absolute(0);
            for code in CODES {
                metrics::counter!(REQUEST_NACKS, "component" => component, "collection" => c(), "code" => *code)
                    .absolute(0);
            }
        }
    }
}

/// gRPC codes as numbers, the values of every `code` label (Istio's MCP
/// series carried the number: its alerts match on `code="3"`, ...).
const CODES: &[&str] = &[
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
];

/// A gRPC code as a label value: its number; a number outside gRPC's codes
/// (a client's arbitrary one) is `2` (Unknown), so no new series appear.
pub fn code_number(code: i32) -> &'static str {
    usize::try_from(code)
        .ok()
        .and_then(|i| CODES.get(i))
        .copied()
        .unwrap_or("2")
}

pub const COMPONENT_UPSTREAM: &str = "upstream";
pub const COMPONENT_DOWNSTREAM: &str = "downstream";

/// Legacy clients' default gRPC receive limit: a larger response is rejected
/// by a client that did not raise it.
pub const LEGACY_CLIENT_LIMIT: usize = 4 << 20;

/// Sizes of messages received and responses sent, in bytes: Istio's buckets
/// (`istio_mcp_message_sizes_bytes`), 1, 4, 16, ... 1 GiB.
pub static MESSAGE_SIZE_HISTOGRAM: histogram::Family = histogram::Family::new(
    MESSAGE_SIZES,
    "Sizes of messages received from the source (component=upstream) and of responses sent to clients \
     (component=downstream).",
    &SIZE_BOUNDS,
    1.0,
);

const SIZE_BOUNDS: [u64; 16] = {
    let mut bounds = [0u64; 16];
    let mut i = 0;
    while i < 16 {
        bounds[i] = 1 << (2 * i);
        i += 1;
    }
    bounds
};

/// From a change applied to the cache until its response is handed to a
/// client's connection, in nanoseconds: 1 ms to 30 s.
pub static PUSH_LATENCY_HISTOGRAM: histogram::Family = histogram::Family::new(
    PUSH_LATENCY,
    "From a change applied to the cache until the response carrying it is handed to a client's connection.",
    &[
        1_000_000,
        2_500_000,
        5_000_000,
        10_000_000,
        25_000_000,
        50_000_000,
        100_000_000,
        250_000_000,
        500_000_000,
        1_000_000_000,
        2_500_000_000,
        5_000_000_000,
        10_000_000_000,
        30_000_000_000,
    ],
    1e9,
);

/// The histograms recorded outside the exporter ([`histogram`]), in the
/// text format, after its series: `demo="true"` on each where the exporter
/// adds it.
pub fn render_histograms(out: &mut String) {
    let global: &[(&str, &str)] = if DEMO.get().copied().unwrap_or(false) {
        &[("demo", "true")]
    } else {
        &[]
    };
    for family in [&MESSAGE_SIZE_HISTOGRAM, &PUSH_LATENCY_HISTOGRAM] {
        family.render(global, out);
    }
}

/// Whether the exporter was installed with `demo="true"` on every series.
static DEMO: OnceLock<bool> = OnceLock::new();

/// A collection's downstream metrics, registered once and shared by every
/// stream and snapshot of the collection: the hot paths (a response written,
/// an ACK) update a handle instead of looking up a label set per call.
pub struct CollectionMetrics {
    pub pushes: Counter,
    pub acks: Counter,
    pub stale: Counter,
    pub oversized: Counter,
    /// In nanoseconds.
    pub push_latency: std::sync::Arc<Buckets>,
    /// `istio_mcp_message_sizes_bytes{component="downstream"}`, in bytes.
    pub response_size: std::sync::Arc<Buckets>,
}

impl CollectionMetrics {
    pub fn new(collection: &SharedStr) -> Self {
        let c = || label(collection);
        Self {
            pushes: metrics::counter!(DOWNSTREAM_PUSHES, "collection" => c()),
            acks: metrics::counter!(REQUEST_ACKS, "component" => COMPONENT_DOWNSTREAM, "collection" => c()),
            stale: metrics::counter!(DOWNSTREAM_STALE_REQUESTS, "collection" => c()),
            oversized: metrics::counter!(OVERSIZED_RESPONSES, "collection" => c()),
            push_latency: PUSH_LATENCY_HISTOGRAM.series(&[("collection", collection.as_str())]),
            response_size: MESSAGE_SIZE_HISTOGRAM
                .series(&[("component", COMPONENT_DOWNSTREAM), ("collection", collection.as_str())]),
        }
    }
}

impl std::fmt::Debug for CollectionMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CollectionMetrics")
    }
}

static EXPORTER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder (once per process; every gateway in the
/// process shares it) and returns its handle. `None` when another recorder
/// was installed first.
/// Installs the exporter once per process; with `demo`, every series
/// carries `demo="true"` (the first call decides).
pub fn install(demo: bool) -> Option<PrometheusHandle> {
    EXPORTER
        .get_or_init(|| {
            let builder = if demo {
                PrometheusBuilder::new().add_global_label("demo", "true")
            } else {
                PrometheusBuilder::new()
            };
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::error!("another metrics recorder is installed; /metrics is off");
                return None;
            }
            let _ = DEMO.set(demo);
            describe();
            // The exporter's histograms (none of the gateway's own: see
            // `histogram`) buffer samples until upkeep folds them in.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || upkeep_forever(&upkeep))
                .ok();
            Some(handle)
        })
        .clone()
}

/// Folds buffered histogram samples in every 5 s, on a thread of its own.
#[allow(clippy::disallowed_methods, reason = "a dedicated thread, not an async worker")]
fn upkeep_forever(handle: &PrometheusHandle) -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(5));
        handle.run_upkeep();
    }
}

/// A gRPC code by its name (debug views and logs; metrics carry the number:
/// [`code_number`]); unknown numbers are `Unknown`.
pub fn code_label(code: i32) -> &'static str {
    match tonic::Code::from(code) {
        tonic::Code::Ok => "Ok",
        tonic::Code::Cancelled => "Cancelled",
        tonic::Code::Unknown => "Unknown",
        tonic::Code::InvalidArgument => "InvalidArgument",
        tonic::Code::DeadlineExceeded => "DeadlineExceeded",
        tonic::Code::NotFound => "NotFound",
        tonic::Code::AlreadyExists => "AlreadyExists",
        tonic::Code::PermissionDenied => "PermissionDenied",
        tonic::Code::ResourceExhausted => "ResourceExhausted",
        tonic::Code::FailedPrecondition => "FailedPrecondition",
        tonic::Code::Aborted => "Aborted",
        tonic::Code::OutOfRange => "OutOfRange",
        tonic::Code::Unimplemented => "Unimplemented",
        tonic::Code::Internal => "Internal",
        tonic::Code::Unavailable => "Unavailable",
        tonic::Code::DataLoss => "DataLoss",
        tonic::Code::Unauthenticated => "Unauthenticated",
    }
}

/// Registers the help text of every metric with the installed recorder.
pub fn describe() {
    describe_gauge!(
        SKEW_RESOURCES,
        "Resources of a collection that connected clients of an Istio release (generation) read without a field, \
         enum value or type their release's protos lack: dropped without a word (0 when none; a generation with no \
         client connected reads 0). See /debug/skew."
    );
    describe_gauge!(CLIENTS, "Connected downstream streams.");
    describe_gauge!(
        REQUEST_BUFFER_BYTES,
        Unit::Bytes,
        "Bytes of large client requests (64 KiB and more) being read now, held against --max-request-buffer-bytes: \
         a request that finds no room waits for it."
    );
    describe_counter!(
        ACCESS_DENIED,
        "Reads the --access-policy refused, by collection and reason: collection (a client asked for a type it may \
         not read; its stream ended PERMISSION_DENIED) or name (resources withheld from a client that may read \
         only some names)."
    );
    describe_gauge!(
        ACCESS_GRANTS,
        "Distinct name grants of a collection served now (identities the --access-policy grants part of it, each \
         grant's view shared by its clients), of --max-grants-per-version: a client whose grant would be one more \
         is refused RESOURCE_EXHAUSTED."
    );
    describe_counter!(
        ACCESS_POLICY_RELOADS,
        "The --access-policy file read again after it changed, by result (error: the last good policy stays)."
    );
    describe_counter!(
        REQUEST_ACKS,
        "ACKs sent upstream (component=upstream) or received from clients (component=downstream)."
    );
    describe_counter!(
        REQUEST_NACKS,
        "NACKs sent upstream or received from clients, by gRPC code."
    );
    describe_counter!(
        SEND_FAILURES,
        "Messages that could not be sent: requests to the source (connection refused, stream closed) or \
         responses to clients that went away."
    );
    describe_counter!(
        RECV_FAILURES,
        "Streams that ended with an error while receiving, by gRPC code."
    );
    describe_counter!(
        RECONNECTIONS,
        "Upstream streams established again after an earlier one (successful reconnections, as Istio counted them)."
    );
    describe_counter!(
        UPSTREAM_CONNECT_ATTEMPTS,
        "Upstream stream attempts: dials in client mode (successful or not), dial-out streams accepted in sink mode."
    );
    describe_gauge!(UPSTREAM_CONNECTED, "1 while an upstream stream is established, else 0.");
    describe_gauge!(
        DIAL_OUT_CONNECTED,
        "source --sink: 1 while the stream to the sink is established, else 0."
    );
    describe_counter!(DIAL_OUT_ATTEMPTS, "source --sink: streams to the sink attempted.");
    describe_counter!(
        DIAL_OUT_STREAM_ENDS,
        "source --sink: streams to the sink that ended, by reason (connect, refused, lost, sink_ended, source_ended, shutdown)."
    );
    describe_counter!(UPSTREAM_STREAM_TERMINATIONS, "Upstream streams that ended, by reason.");
    describe_counter!(
        UPSTREAM_REFUSED_COLLECTIONS,
        "Collections the source refused (unsupported collection), dropped from the subscription."
    );
    describe_counter!(
        DEMAND_TIMEOUTS,
        "Collections a client asked for (not in --collections) that the source neither delivered nor refused within \
         --demand-timeout (in dial-out mode: that were not requested): clients that wait for every type (xDS) were \
         answered empty."
    );
    describe_counter!(
        PROBE_ENDS,
        "Probe streams that ended, by reason: the stream of its own on which client mode first asks for collections \
         only clients asked for (delivered: nothing left to ask; refused_collection; or a failure, as for the main \
         stream)."
    );
    describe_counter!(
        UPDATES_APPLIED,
        "Upstream updates applied to the cache, by collection and kind (full, incremental)."
    );
    describe_gauge!(
        LAST_UPDATE,
        Unit::Seconds,
        "Unix time of the last change to each collection's cached state."
    );
    describe_gauge!(CACHE_RESOURCES, "Resources in the cache, by collection.");
    describe_gauge!(
        HISTORY_VERSIONS,
        "Versions of each collection the history keeps (at most --history), the current one included."
    );
    describe_gauge!(
        ROLLOUT_PINNED,
        "1 while a collection is pinned to a version of its history (POST /pin): clients are not served the latest."
    );
    describe_gauge!(
        ROLLOUT_HELD,
        "1 while a version of a collection is held because a canary NACKed it (until promoted or a newer version is released)."
    );
    describe_gauge!(
        ROLLOUT_CANARY_ROUND,
        "1 while a new version of a collection is served to the canaries only, waiting for their ACKs."
    );
    describe_gauge!(ROLLOUT_CANARIES, "Connected canary streams following each collection.");
    describe_counter!(
        ROLLOUT_CANARY_CLAIMS_REFUSED,
        "Streams whose node matched --canary and that are not canaries of the collection (their proven identity has \
         no --access-policy rule with canary: true for it, or they read only part of it): served as everyone is."
    );
    describe_gauge!(
        HISTORY_BYTES,
        Unit::Bytes,
        "Encoded size of the resources the history keeps for older versions (what changed since each), by collection."
    );
    describe_gauge!(
        CACHE_BYTES,
        Unit::Bytes,
        "Encoded size of the cached resources, by collection."
    );
    describe_gauge!(
        DOWNSTREAM_STREAMS,
        "Open downstream streams by protocol (sotw, incremental, resource-source, xds-sotw, xds-delta) and dialect (1.0, 1.1; none before a first request; xds for Envoy's v3 ADS)."
    );
    describe_counter!(
        DOWNSTREAM_PUSHES,
        "Responses written to downstream clients, by collection."
    );
    describe_counter!(
        DOWNSTREAM_STALE_REQUESTS,
        "Downstream requests ignored for a stale or unknown nonce, by collection."
    );
    describe_gauge!(
        CLIENTS_BEHIND,
        "Client streams whose ACKed version of a collection is not the current one."
    );
    describe_gauge!(
        SOURCE_FILES_BROKEN,
        "Files of the local source (--source-dir) that do not parse; each keeps serving what it held when it last \
         parsed (/debug/upstream names the file, the line and the reason)."
    );
    describe_counter!(
        SOURCE_FILES_PARSED,
        "Files of the local source parsed: at start, then each file whose text changed (a rescan reads every file \
         and parses only those)."
    );
    describe_gauge!(
        CLIENTS_BY_STATUS,
        "Client streams per collection and sync status (SYNCED, SENT, STALE: behind for longer than \
         --stale-after, NACKED, NOT SENT), as /debug/syncz shows them."
    );
    describe_counter!(
        OVERSIZED_RESPONSES,
        "Responses above 4 MiB, the default receive limit of legacy clients (they reject them unless raised)."
    );
    describe_gauge!(BUILD_INFO, "Always 1; the version label is the gateway's version.");
    describe_gauge!(
        RUNTIME_TASKS,
        "Tasks alive on the gateway's async runtime (spawned and not yet finished), read at scrape time."
    );
    describe_counter!(
        LIMIT_REFUSALS,
        "Peers refused or connections closed by a limit, by limit (see the limits table of docs/reference.md)."
    );
    describe_gauge!(
        CONNECTIONS,
        "Open connections, by listener (the flag that configured it)."
    );
    describe_counter!(
        CONNECTIONS_CLOSED,
        "Connections closed, by listener and reason (peer_closed, idle, max_age, flood, handshake_timeout, evicted, \
         ...)."
    );
    describe_counter!(
        CONNECTIONS_EVICTED,
        "Connections closed at --max-connections to admit a new one, by listener and reason: handshake (the oldest \
         not handshaken: TLS, the HTTP/2 preface and SETTINGS), idle (the one without a stream for the longest)."
    );
    describe_counter!(
        ACCEPT_ERRORS,
        "Failed accepts, by listener and kind (resources: out of file descriptors or memory)."
    );
    describe_counter!(
        PEERS_NOT_ALLOWED,
        "Streams refused because the peer's certificate identity is not in --sink-allow or --client-allow."
    );
    describe_counter!(
        ADMIN_CONTROLS,
        "Admin controls (pin, unpin, promote, logging) by control and HTTP status code; each is also logged with \
         its peer."
    );
    describe_counter!(
        ADMIN_REFUSALS,
        "Admin requests refused as a web page's: cross_site (a control with Origin or Sec-Fetch-Site), host (a \
         loopback admin port named by another host name: DNS rebinding)."
    );
    describe_counter!(
        SINK_REFUSALS,
        "Dial-out sources refused because another source is connected."
    );
    describe_counter!(
        CACHE_WRITE_FAILURES,
        "Failed writes of a collection to --cache-dir (the previous file is kept)."
    );
    describe_counter!(
        NACK_MESSAGES_TRUNCATED,
        "Client NACK messages longer than --max-nack-message-bytes, kept and logged truncated."
    );
    describe_gauge!(
        NACK_MEMORY_ENTRIES,
        "xDS clients and types whose NACKs are remembered (--nack-memory): what those responses carried is sent \
         again when the client reconnects."
    );
    describe_counter!(
        NACK_MEMORY_DROPPED,
        "Remembered NACKs dropped before their client ACKed what they carried, by reason (expired: older than \
         --nack-memory; full: --max-nack-memory-entries)."
    );
    describe_counter!(
        RECONNECT_SKIPPED,
        "Resources a reconnecting xDS client reported holding at the current content, not sent again."
    );
    describe_counter!(
        RECONNECT_RESENT,
        "Resources a reconnecting xDS client reported, sent again, by reason (changed: another content; nacked: a \
         response it NACKed carried them; forced: the load assignment of a cluster sent on the stream)."
    );
    describe_counter!(
        FORCED_RESENDS,
        "Resources forced out again after another type's response: the load assignments of the clusters sent."
    );
    describe_counter!(
        ORDER_HOLDS,
        "Changes of an Envoy type held back for another type of the same stream (make before break): step add \
         (its additions wait for the clusters, endpoints or listeners they depend on to be ACKed) or remove (its \
         removals wait for the types that still name what it removes)."
    );
    describe_counter!(
        DOWNSTREAM_STREAM_ENDS,
        "Downstream streams that ended, by protocol and reason (client_closed, client_gone, shutdown, limit, \
         invalid_request, refused)."
    );
}

/// A collection's name as a label value. The metrics crate shares an
/// `Arc<str>` but not the gateway's [`SharedStr`], so the name is copied:
/// only where a series is looked up, never per resource.
pub fn label(collection: &SharedStr) -> metrics::SharedString {
    metrics::SharedString::from(String::from(collection.as_str()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_time_is_typed_as_the_counter_it_is() {
        let exposition = "# HELP process_cpu_seconds_total Total CPU.\n# TYPE process_cpu_seconds_total gauge\n\
                          process_cpu_seconds_total 0.25\n# TYPE process_open_fds gauge\nprocess_open_fds 9\n";
        let typed = super::cpu_seconds_as_counter(exposition.to_owned());
        assert!(
            typed.contains("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 0.25\n"),
            "{typed}"
        );
        assert!(typed.contains("# TYPE process_open_fds gauge\n"), "{typed}");
        assert_eq!(super::cpu_seconds_as_counter("up 1\n".to_owned()), "up 1\n");
    }

    #[test]
    fn code_labels_are_bounded_names() {
        assert_eq!(super::code_label(3), "InvalidArgument");
        assert_eq!(super::code_label(12345), "Unknown");
        assert_eq!(super::code_number(3), "3");
        assert_eq!(super::code_number(16), "16");
        assert_eq!(super::code_number(17), "2");
        assert_eq!(super::code_number(-1), "2");
    }
}
