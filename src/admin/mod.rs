//! The HTTP ports. Monitoring (`--monitoring-listen`, reachable by the kubelet
//! and Prometheus) serves only liveness, readiness and metrics. Admin
//! (`--admin-listen`, loopback by default) serves the same plus the debug
//! views, which show client addresses, node ids and resource names. Every
//! debug view is JSON by default and an HTML table for a browser
//! (`Accept: text/html`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::cache::demand::{DemandRoute, SubscriptionState, Subscriptions};
use crate::cache::{Cache, CollectionSnapshot};
use crate::downstream::registry::{StreamView, TypeView};
use crate::downstream::Registry;
use crate::metrics as m;
use crate::source::UpstreamStatus;
use crate::transport::safe_text::{json_safe, lines_safe};
use crate::SharedStr;

mod dump;
pub mod guard;
mod history;
mod index;
mod rollout;
mod skew;
pub mod syncz;
pub mod versions;

#[derive(Clone)]
pub struct AdminState {
    pub cache: Arc<Cache>,
    /// Pins, promotions and the canary rounds (`/pin`, `/promote`,
    /// `/debug/rollout`).
    pub rollout: Arc<crate::downstream::rollout::Rollout>,
    pub subscriptions: Arc<Subscriptions>,
    pub registry: Arc<Registry>,
    pub upstream: watch::Receiver<UpstreamStatus>,
    /// `None` when the process has another metrics recorder.
    pub metrics: Option<PrometheusHandle>,
    /// `--stale-after`.
    pub stale_after: std::time::Duration,
    /// `--debug-access-wait`: how long a `/debug/access` request waits for
    /// the one answer being made before it is told to retry.
    pub access_wait: std::time::Duration,
    /// Reads bodies back for the config dump.
    pub bodies: Arc<crate::source::proto_json::BodyDecoder>,
    /// Every flag's effective value and where it came from (`/debug/config`).
    pub config: Arc<Value>,
    /// The log filter's control (`/logging`); `None` in a gateway built
    /// in-process, whose logs are its host's.
    pub logs: Option<Arc<m::LogControl>>,
    /// Who may read what (`--access-policy`): `/debug/access`, `/debug/config`.
    pub access: Arc<crate::transport::access::AccessControl>,
    pub table: Arc<crate::collections::CollectionTable>,
    /// What connected clients' releases drop (`/debug/skew`, syncz).
    pub skew: Arc<crate::skew::SkewTracker>,
}

impl AdminState {
    /// What the views need to show what clients' releases drop.
    pub fn skew_lookup<'a>(&'a self, policy: &'a crate::transport::access::AccessPolicy) -> syncz::SkewLookup<'a> {
        syncz::SkewLookup {
            tracker: &self.skew,
            policy,
        }
    }

    /// Why the gateway is not ready, on one line; `None` when it is.
    pub fn not_ready(&self) -> Option<String> {
        not_ready(&self.subscriptions, &self.cache, &self.upstream.borrow())
    }

    /// [`not_ready`] for whoever may not read the details: counts only.
    pub fn not_ready_counted(&self) -> Option<String> {
        not_ready_counted(&self.subscriptions, &self.cache, &self.upstream.borrow())
    }
}

/// Whether the gateway is ready, for a reader of the monitoring port or a
/// client of the gRPC port (neither the operator): the count of collections
/// without a first state and whether the source has an error, and where the
/// details are. No collection, file, resource, address or message is named:
/// a source's error quotes what it read (a file's line, a peer's words).
pub fn not_ready_counted(subscriptions: &Subscriptions, cache: &Cache, upstream: &UpstreamStatus) -> Option<String> {
    let missing = missing(subscriptions, cache).len();
    if missing == 0 {
        return None;
    }
    let problems = missing + usize::from(upstream.last_error.is_some());
    let source = match (upstream.connected, upstream.last_error.is_some()) {
        (_, true) => "the source has an error",
        (true, false) => "the source is connected and has not sent them yet",
        (false, false) => "the source is not connected yet",
    };
    Some(format!(
        "not ready: {problems} problem{}: {missing} collection{} without a first state; {source}; \
         the details are on the admin port (/readyz, /debug/upstream)",
        if problems == 1 { "" } else { "s" },
        if missing == 1 { "" } else { "s" },
    ))
}

/// Configured collections without a first state: the gateway is ready when
/// there are none. Only the configured set counts: a client asking for a
/// collection nobody serves never makes a replica unready. A collection the
/// source refused is not waited for: it would never arrive.
pub fn missing(subscriptions: &Subscriptions, cache: &Cache) -> Vec<String> {
    subscriptions
        .awaited()
        .iter()
        .filter(|c| cache.get(c).is_none())
        .map(|c| c.to_string())
        .collect()
}

/// Why the gateway is not ready, on one line (`None`: it is): the
/// configured collections without a first state, and where the source
/// stands (connected or not, its last error, the next attempt).
pub fn not_ready(subscriptions: &Subscriptions, cache: &Cache, upstream: &UpstreamStatus) -> Option<String> {
    let missing = missing(subscriptions, cache);
    if missing.is_empty() {
        return None;
    }
    let line = format!(
        "not ready: waiting for the first state of {} collection{} ({}); {}",
        missing.len(),
        if missing.len() == 1 { "" } else { "s" },
        missing.join(", "),
        source_state(upstream)
    );
    // Errors can span lines (a file's parse error, a peer's message).
    Some(line.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// Where the source stands, as a clause of the readiness line.
fn source_state(status: &UpstreamStatus) -> String {
    let source = match status.mode {
        "client" => format!("upstream {}", status.address),
        "sink" => format!("--sink-listen {}", status.address),
        "files" => format!("source directory {}", status.address),
        _ => "no source yet".to_owned(),
    };
    let mut text = if status.connected {
        match &status.peer {
            Some(peer) => format!("{source}: {peer} connected, and has not sent them yet"),
            None => format!("{source}: connected, and has not sent them yet"),
        }
    } else {
        match (status.mode, status.attempts) {
            ("sink", _) => format!("{source}: no source has dialled in"),
            (_, 0) => format!("{source}: not connected yet"),
            (_, attempts) => format!(
                "{source}: not connected after {attempts} attempt{}",
                if attempts == 1 { "" } else { "s" }
            ),
        }
    };
    if let Some(error) = &status.last_error {
        text.push_str(&format!("; last error: {error}"));
    }
    if let Some(wait) = status.next_retry_in.filter(|_| !status.connected) {
        text.push_str(&format!("; next attempt in {:.1}s", wait.as_secs_f64()));
    }
    text
}

/// The gRPC health response header that says why the gateway is not
/// serving (the health protocol's answer has a status only): the readiness
/// line.
pub const NOT_READY_HEADER: &str = "mcp-gateway-not-ready";

/// The gRPC health service, each answer carrying [`NOT_READY_HEADER`] while
/// the gateway is not ready, so `grpcurl -v` and `grpc_health_probe` users
/// see that it is not and how much is missing, as the monitoring port's
/// `/readyz` says it (the details are the admin port's: a client is not the
/// operator).
#[derive(Clone)]
pub struct HealthWithReason<S> {
    inner: S,
    subscriptions: Arc<Subscriptions>,
    cache: Arc<Cache>,
    upstream: watch::Receiver<UpstreamStatus>,
}

impl<S> HealthWithReason<S> {
    pub fn new(
        inner: S,
        subscriptions: Arc<Subscriptions>,
        cache: Arc<Cache>,
        upstream: watch::Receiver<UpstreamStatus>,
    ) -> Self {
        Self {
            inner,
            subscriptions,
            cache,
            upstream,
        }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for HealthWithReason<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<B>> for HealthWithReason<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let reason = not_ready_counted(&self.subscriptions, &self.cache, &self.upstream.borrow());
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            if let Some(reason) = reason {
                // Header values are visible ASCII.
                let visible: String = reason
                    .chars()
                    .map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' })
                    .collect();
                if let Ok(value) = http::HeaderValue::from_str(&visible) {
                    response.headers_mut().insert(NOT_READY_HEADER, value);
                }
            }
            Ok(response)
        })
    }
}

/// gRPC health as the client port answers it: the gateway (`""`) and its
/// services to everyone the transport admits; a collection (its name as the
/// service name) only to a client that may read some of it. Any other gets
/// `NOT_FOUND`, as for a collection that does not exist: health tells no one
/// what it may not read.
pub struct HealthByAccess {
    inner: tonic_health::server::HealthService,
    access: Arc<crate::transport::access::AccessControl>,
    table: Arc<crate::collections::CollectionTable>,
    services: &'static [&'static str],
}

impl HealthByAccess {
    pub fn new(
        reporter: tonic_health::server::HealthReporter,
        access: Arc<crate::transport::access::AccessControl>,
        table: Arc<crate::collections::CollectionTable>,
        services: &'static [&'static str],
    ) -> tonic_health::pb::health_server::HealthServer<Self> {
        tonic_health::pb::health_server::HealthServer::new(Self {
            inner: tonic_health::server::HealthService::from_health_reporter(reporter),
            access,
            table,
            services,
        })
    }

    /// `NOT_FOUND` (tonic-health's own words for a service it does not
    /// know) unless the request's client may read some of what it asks of.
    fn visible(&self, request: &tonic::Request<tonic_health::pb::HealthCheckRequest>) -> Result<(), tonic::Status> {
        let service = request.get_ref().service.as_str();
        if service.is_empty() || self.services.contains(&service) {
            return Ok(());
        }
        let readable = request
            .extensions()
            .get::<crate::transport::grpc::ConnInfo>()
            .is_some_and(|conn| {
                self.access
                    .current()
                    .grant(&conn.identity, service, self.table.is_sensitive(service))
                    .is_some()
            });
        if readable {
            Ok(())
        } else {
            Err(tonic::Status::not_found("service not registered"))
        }
    }
}

#[tonic::async_trait]
impl tonic_health::pb::health_server::Health for HealthByAccess {
    async fn check(
        &self,
        request: tonic::Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<tonic::Response<tonic_health::pb::HealthCheckResponse>, tonic::Status> {
        self.visible(&request)?;
        self.inner.check(request).await
    }

    type WatchStream = tonic_health::server::WatchStream;

    async fn watch(
        &self,
        request: tonic::Request<tonic_health::pb::HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        self.visible(&request)?;
        self.inner.watch(request).await
    }
}

/// Keeps gRPC health at SERVING while the gateway is ready and NOT_SERVING
/// before and after (shutdown), for `""` and the aggregated service; and per
/// collection (the collection's name as the service name), SERVING once it
/// has a first state.
pub async fn track_health(
    health: tonic_health::server::HealthReporter,
    services: &'static [&'static str],
    subscriptions: Arc<Subscriptions>,
    cache: Arc<Cache>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    use tonic_health::ServingStatus;
    let mut changes = cache.changes();
    let mut wanted = subscriptions.watch();
    let mut reported = None;
    let mut collections: BTreeMap<SharedStr, ServingStatus> = BTreeMap::new();
    loop {
        let status = if missing(&subscriptions, &cache).is_empty() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        if reported != Some(status) {
            health.set_service_status("", status).await;
            for service in services {
                health.set_service_status(*service, status).await;
            }
            reported = Some(status);
        }
        let current = subscriptions.current();
        let names: Vec<SharedStr> = current
            .wanted
            .into_iter()
            .chain(current.demanded.into_keys())
            .chain(cache.snapshots().into_iter().map(|s| s.collection.clone()))
            .collect();
        for name in names {
            let status = if cache.get(&name).is_some() {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            if collections.insert(name.clone(), status) != Some(status) {
                health.set_service_status(&*name, status).await;
            }
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = wanted.changed() => {}
            _ = shutdown.cancelled() => {
                health.set_service_status("", ServingStatus::NotServing).await;
                for service in services {
                    health.set_service_status(*service, ServingStatus::NotServing).await;
                }
                return;
            }
        }
    }
}

/// Liveness and metrics: on both ports.
fn probes() -> Router<AdminState> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
}

/// The monitoring port: what Prometheus and the kubelet need, nothing that
/// names a client or a resource: `/readyz` counts what is missing.
pub fn monitoring_router(state: AdminState) -> Router {
    probes()
        .route("/readyz", get(readyz_counted))
        .route("/", get(index::monitoring))
        .with_state(state)
        .layer(axum::middleware::map_response(nosniff))
}

/// The admin port: the monitoring paths (`/readyz` with its details), every
/// debug view and the controls, behind the guard against web pages
/// ([`guard`]).
pub fn admin_router(state: AdminState, guard: guard::Guard) -> Router {
    probes()
        .route("/readyz", get(readyz))
        .route("/", get(index::admin))
        .route("/debug/clients", get(clients))
        .route("/debug/syncz", get(syncz))
        .route("/debug/cache", get(cache))
        .route("/debug/cache/{*collection}", get(cache_collection))
        .route("/debug/history/{*collection}", get(history::history))
        .route("/debug/diff/{*collection}", get(history::diff))
        .route("/debug/rollout", get(rollout::rollouts))
        .route("/debug/rollout/{*collection}", get(rollout::rollout))
        .route(
            "/pin/{*collection}",
            axum::routing::post(rollout::pin).delete(rollout::unpin),
        )
        .route("/promote/{*collection}", axum::routing::post(rollout::promote))
        .route("/debug/upstream", get(upstream))
        .route("/debug/config", get(config))
        .route("/debug/access", get(access))
        .route("/debug/skew", get(skew::skew))
        .route("/logging", axum::routing::post(logging))
        .with_state(state)
        .layer(axum::middleware::from_fn(json_safe_body))
        .layer(axum::middleware::from_fn_with_state(guard, guard::guard))
        .layer(axum::middleware::map_response(nosniff))
}

/// Every answer is read as the type it says: a YAML or text view holding
/// what a source wrote (`<script>` in a name) is never sniffed into HTML.
async fn nosniff(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    response
}

/// Every JSON answer of the admin port with what a client wrote (node ids,
/// NACK messages, names, metadata) escaped by the crate's one rule, as
/// `\u202e` inside its strings: the same JSON to a parser, nothing raw on a
/// terminal that prints it (`curl`) or a page that shows it.
async fn json_safe_body(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let response = next.run(request).await;
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // The views' JSON is built whole before it is sent: no limit to add.
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(bytes) => bytes,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot write JSON: {e}\n")).into_response(),
    };
    let body = match std::str::from_utf8(&bytes).map(json_safe) {
        Ok(std::borrow::Cow::Owned(safe)) => {
            parts.headers.remove(header::CONTENT_LENGTH);
            axum::body::Body::from(safe)
        }
        _ => axum::body::Body::from(bytes),
    };
    Response::from_parts(parts, body)
}

/// 200 `ready`, or 503 and why not, on one line.
async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    match state.not_ready() {
        None => (StatusCode::OK, "ready\n".into()),
        // Plain text an operator reads with curl: what a source wrote in it
        // (a file's name, a quoted value) escaped.
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", crate::transport::safe_text::terminal_safe(&reason)),
        ),
    }
}

/// 200 `ready`, or 503 with the count of problems: the monitoring port's.
async fn readyz_counted(State(state): State<AdminState>) -> (StatusCode, String) {
    match state.not_ready_counted() {
        None => (StatusCode::OK, "ready\n".into()),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
    }
}

fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// === metrics ===

async fn metrics(State(state): State<AdminState>) -> Response {
    let Some(handle) = &state.metrics else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics are off: another metrics recorder is installed in this process\n",
        )
            .into_response();
    };
    // The scrape-time gauges are series of the process's one recorder: a
    // scrape sets them and renders them in one step, so two gateways in one
    // process (the integration tests run many) never render the values the
    // other set in between. One gateway per process never waits here.
    static SCRAPE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let text = {
        let _one_scrape = SCRAPE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        refresh_gauges(&state);
        let mut text = handle.render();
        m::render_histograms(&mut text);
        text
    };
    let text = m::cpu_seconds_as_counter(text);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Gauges that are views of the current state, set at scrape time. Every
/// configured collection has its series from the start, at 0 until its
/// first state (a last update at 0: never).
fn refresh_gauges(state: &AdminState) {
    crate::runtime::refresh();
    let snapshots = state.cache.snapshots();
    let configured = state.subscriptions.awaited();
    for collection in configured.iter().filter(|c| state.cache.get(c).is_none()) {
        for name in [
            m::CACHE_RESOURCES,
            m::CACHE_BYTES,
            m::HISTORY_VERSIONS,
            m::HISTORY_BYTES,
            m::LAST_UPDATE,
        ] {
            metrics::gauge!(name, "collection" => crate::metrics::label(collection)).set(0.0);
        }
    }
    let mut delivered: Vec<SharedStr> = Vec::new();
    for snapshot in &snapshots {
        let collection = snapshot.collection.clone();
        metrics::gauge!(m::CACHE_RESOURCES, "collection" => crate::metrics::label(&collection))
            .set(snapshot.len() as f64);
        metrics::gauge!(m::CACHE_BYTES, "collection" => crate::metrics::label(&collection)).set(snapshot.bytes as f64);
        let (versions, bytes) = state.cache.history_usage(&collection);
        metrics::gauge!(m::HISTORY_VERSIONS, "collection" => crate::metrics::label(&collection)).set(versions as f64);
        metrics::gauge!(m::HISTORY_BYTES, "collection" => crate::metrics::label(&collection)).set(bytes as f64);
        metrics::gauge!(m::LAST_UPDATE, "collection" => crate::metrics::label(&collection))
            .set(unix_seconds(snapshot.updated_at));
        delivered.push(collection);
    }

    let flag = |on: bool| f64::from(u8::from(on));
    // (pinned, held, in a round, canaries) per collection: nothing for a
    // configured collection not delivered yet.
    let mut rollouts: BTreeMap<SharedStr, [f64; 4]> = configured.iter().map(|c| (c.clone(), [0.0; 4])).collect();
    for rollout in state.rollout.views() {
        rollouts.insert(
            rollout.collection.clone(),
            [
                flag(rollout.pinned.is_some()),
                flag(rollout.held.is_some()),
                flag(rollout.round.is_some()),
                rollout.canaries_connected as f64,
            ],
        );
    }
    for (collection, [pinned, held, round, canaries]) in rollouts {
        metrics::gauge!(m::ROLLOUT_PINNED, "collection" => crate::metrics::label(&collection)).set(pinned);
        metrics::gauge!(m::ROLLOUT_HELD, "collection" => crate::metrics::label(&collection)).set(held);
        metrics::gauge!(m::ROLLOUT_CANARY_ROUND, "collection" => crate::metrics::label(&collection)).set(round);
        metrics::gauge!(m::ROLLOUT_CANARIES, "collection" => m::label(&collection)).set(canaries);
    }

    // Counted in place (`Registry::each`), not from a copy of every view.
    let mut streams = 0usize;
    let mut by_kind: BTreeMap<(&'static str, &'static str), f64> = BTreeMap::new();
    for protocol in crate::downstream::registry::Protocol::ALL {
        for dialect in protocol.dialects().iter().map(|d| d.as_str()).chain(["none"]) {
            by_kind.insert((protocol.as_str(), dialect), 0.0);
        }
    }
    // Behind what its group is served (a pin or a canary round keeps
    // clients on an older version on purpose): each type's current version.
    let mut behind: BTreeMap<SharedStr, f64> = delivered
        .into_iter()
        .chain(configured.iter().cloned())
        .map(|c| (c, 0.0))
        .collect();
    let mut by_status = syncz::StatusCounts::new(configured);
    let mut served = syncz::Served::default();
    let clock = state.registry.clock();
    state.registry.each(|stream| {
        streams += 1;
        let mut dialects: Vec<&'static str> = stream.types.values().map(|t| t.dialect.as_str()).collect();
        dialects.sort_unstable();
        dialects.dedup();
        if dialects.is_empty() {
            dialects.push("none");
        }
        for dialect in dialects {
            *by_kind.entry((stream.protocol.as_str(), dialect)).or_default() += 1.0;
        }
        for (_, view) in &stream.types {
            let view = view.as_held();
            let found = syncz::TypeStatus::of(stream, &view, &mut served, &state.rollout, clock, state.stale_after);
            if let Some(count) = behind.get_mut(&view.collection) {
                if found.behind(&view) {
                    *count += 1.0;
                }
            }
            by_status.add(found.status, &view.collection);
        }
    });
    metrics::gauge!(m::CLIENTS, "component" => m::COMPONENT_DOWNSTREAM).set(streams as f64);
    for ((protocol, dialect), count) in by_kind {
        metrics::gauge!(m::DOWNSTREAM_STREAMS, "protocol" => protocol, "dialect" => dialect).set(count);
    }
    for (collection, count) in behind {
        metrics::gauge!(m::CLIENTS_BEHIND, "collection" => m::label(&collection)).set(count);
    }
    for ((status, collection), count) in by_status.into_map() {
        metrics::gauge!(m::CLIENTS_BY_STATUS, "status" => status.as_str(), "collection" => m::label(&collection))
            .set(count as f64);
    }
    let (connected, broken_files) = {
        let upstream = state.upstream.borrow();
        (upstream.connected, upstream.broken_files)
    };
    metrics::gauge!(m::UPSTREAM_CONNECTED).set(if connected { 1.0 } else { 0.0 });
    metrics::gauge!(m::SOURCE_FILES_BROKEN).set(broken_files as f64);
    metrics::gauge!(m::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // The runtime serving this scrape: the gateway's own.
    let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    metrics::gauge!(m::RUNTIME_TASKS).set(tasks as f64);
    process_collector().collect();
}

fn process_collector() -> &'static metrics_process::Collector {
    static COLLECTOR: std::sync::OnceLock<metrics_process::Collector> = std::sync::OnceLock::new();
    COLLECTOR.get_or_init(|| {
        let collector = metrics_process::Collector::default();
        collector.describe();
        collector
    })
}

// === debug views ===

/// The client asks for `text/html` (a browser).
fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

/// JSON, or an HTML page of tables when the client asks for `text/html`.
fn view(headers: &HeaderMap, title: &str, value: Value) -> Response {
    if wants_html(headers) {
        Html(page(title, &value)).into_response()
    } else {
        Json(value).into_response()
    }
}

/// Dialects of a stream's types: `1.0`, `1.1`, `mixed`, or empty before its
/// first request.
fn stream_dialect(stream: &StreamView) -> &'static str {
    let mut dialects = stream.types.values().map(|t| t.dialect.as_str());
    match dialects.next() {
        None => "",
        Some(first) if dialects.all(|d| d == first) => first,
        Some(_) => "mixed",
    }
}

fn type_json(view: &TypeView) -> Value {
    let mut value = json!({
        "collection": view.collection,
        "dialect": view.dialect.as_str(),
        "incremental": view.incremental,
        "last_sent_version": view.last_sent_version,
        "last_sent_nonce": view.last_sent_nonce,
        "acked_version": view.acked_version,
        "outstanding": view.outstanding,
        "last_nack": view.last_nack.as_ref().map(|n| json!({
            "version": n.version,
            "code": m::code_label(n.code),
            "message": n.message,
            "superseded": n.superseded,
        })),
    });
    // Only where they say something: most clients take everything and get
    // responses under 4 MiB.
    if let Some(bytes) = view.oversized_bytes {
        value["oversized_bytes"] = json!(bytes);
    }
    if let Some(subscribed) = &view.subscribed {
        value["subscribed"] = json!({
            "wildcard": subscribed.wildcard,
            "count": subscribed.count,
            "names": subscribed.first,
        });
    }
    value
}

async fn clients(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let streams: Vec<Value> = state
        .registry
        .streams()
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "peer": s.peer.map(|p| p.to_string()),
                "node_id": s.node_id,
                "gateway_id": s.gateway_id,
                "protocol": s.protocol.as_str(),
                "dialect": stream_dialect(s),
                "connected_since": time(s.connected_since),
                "types": s.types.iter().map(|(url, t)| (url.to_string(), type_json(t))).collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect();
    view(&headers, "Connected clients", Value::Array(streams))
}

async fn syncz(
    State(state): State<AdminState>,
    Query(filter): Query<syncz::Filter>,
    Query(positions): Query<Positions>,
    headers: HeaderMap,
) -> Response {
    let streams = state.registry.streams();
    let clock = state.registry.clock();
    let policy = state.access.current();
    let skew = state.skew_lookup(&policy);
    let rows = syncz::rows(&streams, &state.rollout, Some(&skew), clock, state.stale_after);
    if wants_html(&headers) {
        let shown = match syncz::filtered(&rows, &filter) {
            Ok(shown) => shown,
            Err(message) => return (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
        };
        let mut body = String::from(NAVIGATION);
        index::problems_html(&index::source_problems(&state), &mut body);
        if let Some(reason) = state.not_ready() {
            body.push_str(&format!("<p class=\"problem\">{}</p>", escape(&reason)));
        }
        body.push_str(&syncz::counts_html(&rows));
        let rollouts = syncz::rollouts(
            &state.rollout,
            &state.access.current(),
            rollout::canary_policy(&state),
            &filter,
        );
        if rollouts["collections"].as_array().is_some_and(|r| !r.is_empty()) {
            body.push_str("<h2>Collections pinned, held or in a canary round</h2>");
            html(&rollouts["collections"], &mut body);
        }
        let not_delivered = not_delivered(&state);
        if not_delivered.as_array().is_some_and(|c| !c.is_empty()) {
            body.push_str("<h2>Asked for by clients, not delivered by the source (answered empty)</h2>");
            html(&not_delivered, &mut body);
        }
        body.push_str("<h2>Every client stream and type, those that need an eye first</h2>");
        syncz::rows_html(&syncz::problems_first(shown), clock, &mut body);
        // What clients' releases drop, and who is not checked (the banner
        // the JSON has as `skew_not_checked`): warnings, after the clients
        // with their NACKs, as on the index.
        index::warnings_html(skew::lead(&state).iter().chain(&skew::unchecked(&streams)), &mut body);
        body.push_str("<h2>Per collection</h2>");
        html(&syncz::summary(&rows)["by_collection"], &mut body);
        body.push_str(positions.script());
        return Html(document("Sync status", &body)).into_response();
    }
    match syncz::view(&rows, clock, &filter) {
        Ok(mut value) => {
            value["rollout"] = syncz::rollouts(
                &state.rollout,
                &state.access.current(),
                rollout::canary_policy(&state),
                &filter,
            );
            value["not_delivered"] = not_delivered(&state);
            // The source's health (files that do not parse, ...): `status` exits 1 on it.
            value["source"] = syncz::source_json(&index::source_problems(&state));
            // What connected clients' releases drop (`status` prints it),
            // and who is not checked.
            value["skew"] = json!(skew::lead(&state));
            value["skew_not_checked"] = json!(skew::unchecked(&streams));
            // Why the gateway is not ready, if it is not (what /readyz says).
            value["not_ready"] = json!(state.not_ready());
            Json(value).into_response()
        }
        Err(message) => (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
    }
}

fn snapshot_json(snapshot: &CollectionSnapshot) -> Value {
    json!({
        "collection": snapshot.collection,
        "version": snapshot.version,
        "resources": snapshot.len(),
        "bytes": snapshot.bytes,
        "updated_at": time(snapshot.updated_at),
        "origin": snapshot.origin,
    })
}

async fn cache(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let mut snapshots = state.cache.snapshots();
    snapshots.sort_by(|a, b| a.collection.cmp(&b.collection));
    let rows = snapshots.iter().map(|s| snapshot_json(s)).collect();
    view(&headers, "Cache", Value::Array(rows))
}

/// The 404 for a collection the cache has never held.
fn unknown_collection(collection: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        format!("collection {collection:?} is not in the cache (see /debug/cache)\n"),
    )
        .into_response()
}

async fn cache_collection(
    State(state): State<AdminState>,
    Path(collection): Path<String>,
    Query(query): Query<dump::DumpQuery>,
    headers: HeaderMap,
) -> Response {
    let collection = collection.trim_start_matches('/');
    let Some(snapshot) = state.cache.get(collection) else {
        return unknown_collection(collection);
    };
    let sensitive = state.table.sensitive_body_type(&snapshot.collection);
    if let Some(format) = &query.bodies {
        return dump::dump(&snapshot, snapshot_json(&snapshot), format, &state.bodies, sensitive);
    }
    let mut value = snapshot_json(&snapshot);
    value["resources"] = snapshot
        .resources
        .values()
        .map(|r| {
            let body_type_url = crate::proto::wire::resource_body_type_url(&r.encoded)
                .map(|t| crate::source::proto_json::shown_type_url(sensitive, &t).to_owned());
            json!({"name": r.name, "version": r.version(), "body_type_url": body_type_url})
        })
        .collect();
    view(&headers, &format!("Cache: {collection}"), value)
}

/// Every flag with the value in effect and where it came from (a flag left
/// out shows the value it took: the source directory, the node id, ...),
/// and the log filter in force (`--log-level` shows it too, once `POST
/// /logging` or `RUST_LOG` set it).
async fn config(State(state): State<AdminState>, Query(positions): Query<Positions>, headers: HeaderMap) -> Response {
    let mut flags = (*state.config).clone();
    if let Some(logs) = &state.logs {
        let log_level = flags
            .as_array_mut()
            .and_then(|all| all.iter_mut().find(|f| f["flag"] == "--log-level"));
        if let Some(flag) = log_level {
            flag["value"] = json!(logs.current());
            flag["source"] = json!(logs.origin());
        }
    }
    let policy = state.access.current();
    let value = json!({
        "flags": flags,
        "access_policy": {
            "path": policy.path().map(|p| p.display().to_string()),
            "rules": policy.rules_json(),
            "without_a_policy": policy.path().is_none().then_some(
                "every client the transport admits reads every collection but the sensitive ones, which nobody reads"
            ),
        },
        "log_filter": state.logs.as_ref().map(|l| l.current()),
        "version": env!("CARGO_PKG_VERSION"),
    });
    if wants_html(&headers) {
        // A long value (a list of collections) wraps; a flag's name never.
        const CONFIG_STYLE: &str =
            "<style>td{overflow-wrap:anywhere}td:first-child{white-space:nowrap;overflow-wrap:normal}</style>";
        let page = page("Effective configuration", &value)
            .replacen("</head>", &format!("{CONFIG_STYLE}</head>"), 1)
            .replacen("</body>", &format!("{}</body>", positions.script()), 1);
        return Html(page).into_response();
    }
    view(&headers, "Effective configuration", value)
}

/// `?identity=`: one identity (a URI or DNS SAN, or `unauthenticated`).
#[derive(Debug, serde::Deserialize)]
struct AccessQuery {
    identity: Option<String>,
    /// The page lists every collection, not only those with content.
    all: Option<String>,
}

/// The form `/debug/access`'s page leads with (`identity`: what was asked).
fn access_form(identity: &str) -> String {
    format!(
        "<form method=\"get\" action=\"/debug/access\"><label>identity \
         <input name=\"identity\" size=\"60\" value=\"{}\" \
         placeholder=\"spiffe://cluster.local/ns/NS/sa/SA, a DNS name, or unauthenticated\"></label> \
         <button type=\"submit\">what may it read?</button></form>\
         <p>A client certificate's URI SAN (a SPIFFE id) or DNS SAN, or <code>unauthenticated</code>: what \
         that identity reads of each collection under the policy in effect. Streams show theirs in \
         <a href=\"/debug/syncz\">/debug/syncz</a> (identity).</p>",
        escape(identity)
    )
}

/// `/debug/access?identity=ID`: what that identity would read of each
/// collection under the policy in effect (an operator's "why can't it see
/// X"): all of it, the names its rules grant (with how many of the cached
/// resources they match), or nothing.
async fn access(State(state): State<AdminState>, Query(query): Query<AccessQuery>, headers: HeaderMap) -> Response {
    let Some(identity) = query.identity.filter(|i| !i.trim().is_empty()) else {
        // A browser (the index links here) gets the form.
        if wants_html(&headers) {
            let body = format!("{NAVIGATION}{}", access_form(""));
            return Html(document("Access", &body)).into_response();
        }
        return (
            StatusCode::BAD_REQUEST,
            "give ?identity=ID: a client certificate's URI or DNS SAN with its kind (uri:spiffe://cluster.local/ns/NS/sa/SA, \
             dns:web.example; without one, a SAN with a scheme:// is a URI SAN), or unauthenticated\n",
        )
            .into_response();
    };
    // One at a time, on the blocking pool: a policy of many rules matched
    // against a long identity, and its name patterns against every cached
    // name, is work the runtime's threads (the monitoring port's `/healthz`
    // among what they serve) do not wait on. A request waits for its turn
    // at most `--debug-access-wait`, then is told to retry (counted as that
    // limit's refusal): an answer never queues
    // behind many others (16 callers asking about 60,000-character
    // identities at once took up to 2 s each when every one waited; the
    // thirty-third check of issue 42).
    static ONE_AT_A_TIME: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let Ok(Ok(_turn)) = tokio::time::timeout(state.access_wait, ONE_AT_A_TIME.acquire()).await else {
        m::limit_refused("debug_access_wait");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, "1")],
            "another /debug/access answer is being made (one at a time); retry\n",
        )
            .into_response();
    };
    let asked = identity.clone();
    let Ok(value) = tokio::task::spawn_blocking(move || access_value(&state, &asked)).await else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "the access view failed\n").into_response();
    };
    if !wants_html(&headers) {
        return Json(value).into_response();
    }
    access_page(query.all.as_deref(), &identity, &value)
}

/// What [`access`] answers for `identity`, as JSON.
fn access_value(state: &AdminState, identity: &str) -> Value {
    let policy = state.access.current();
    let mut collections: Vec<(SharedStr, bool)> = state
        .table
        .collection_names()
        .map(|c| (c.clone(), state.table.is_sensitive(c)))
        .collect();
    for snapshot in state.cache.snapshots() {
        if !collections.iter().any(|(c, _)| *c == snapshot.collection) {
            let sensitive = state.table.is_sensitive(&snapshot.collection);
            collections.push((snapshot.collection.clone(), sensitive));
        }
    }
    let grants = policy.explain(identity.trim(), &collections);
    let sensitive: std::collections::BTreeMap<SharedStr, bool> = collections.into_iter().collect();
    let rows: Vec<Value> = grants
        .iter()
        .map(|(collection, grant)| {
            let cached = state.cache.get(collection);
            let (reads, names, readable) = match grant {
                None => ("nothing", Value::Null, Some(0)),
                Some(crate::transport::access::Grant::All) => ("all", json!(["*"]), cached.as_ref().map(|s| s.len())),
                Some(crate::transport::access::Grant::Names(g)) => (
                    "names",
                    json!(g.patterns()),
                    cached
                        .as_ref()
                        .map(|s| s.resources.keys().filter(|n| g.allows(n)).count()),
                ),
            };
            json!({
                "collection": collection,
                "sensitive": sensitive.get(collection).copied().unwrap_or(false),
                "reads": reads,
                "names": names,
                "resources_readable": readable,
                "resources_cached": cached.as_ref().map(|s| s.len()),
                "rules": policy.rules_for(collection),
            })
        })
        .collect();
    json!({
        "identity": crate::transport::identity::PeerIdentity::parse(identity).to_string(),
        "policy": policy.path().map(|p| p.display().to_string()),
        "collections": rows,
    })
}

/// [`access`]'s page: the form, then `value`'s collections.
fn access_page(all: Option<&str>, identity: &str, value: &Value) -> Response {
    // The page: the form, then the collections with content (the table
    // knows some 75, most never populated); `?all=1` lists every one.
    let all = all.is_some_and(|a| !matches!(a, "" | "0" | "false"));
    let (shown, empty): (Vec<&Value>, Vec<&Value>) = value["collections"]
        .as_array()
        .into_iter()
        .flatten()
        .partition(|row| all || row["resources_cached"].as_u64().is_some_and(|n| n > 0));
    let mut body = format!("{NAVIGATION}{}", access_form(identity.trim()));
    html(
        &json!({"identity": value["identity"], "policy": value["policy"]}),
        &mut body,
    );
    html(&Value::Array(shown.into_iter().cloned().collect()), &mut body);
    if !empty.is_empty() {
        body.push_str(&format!(
            "<p>{} more collections hold nothing now: <a href=\"/debug/access?identity={}&amp;all=1\">list \
             them too</a></p>",
            empty.len(),
            url_part(identity.trim())
        ));
    }
    Html(document("Access", &body)).into_response()
}

/// `?level=FILTER`: tracing's EnvFilter syntax (`debug`,
/// `info,mcp_xds_gateway::downstream=debug`).
#[derive(Debug, serde::Deserialize)]
struct LoggingQuery {
    level: Option<String>,
}

/// `POST /logging?level=...`: changes the log filter, like Envoy's admin.
async fn logging(State(state): State<AdminState>, Query(query): Query<LoggingQuery>) -> Response {
    let Some(logs) = &state.logs else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "this gateway runs inside another process, whose logs are its own\n",
        )
            .into_response();
    };
    let Some(level) = query.level.filter(|l| !l.trim().is_empty()) else {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "give ?level=FILTER (tracing's EnvFilter syntax); now: {}\n",
                logs.current()
            ),
        )
            .into_response();
    };
    match logs.set(level.trim()) {
        Ok(()) => (StatusCode::OK, format!("log filter: {}\n", logs.current())).into_response(),
        Err(why) => (
            StatusCode::BAD_REQUEST,
            format!("{level:?} is not a log filter: {why}\n"),
        )
            .into_response(),
    }
}

async fn upstream(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let status = state.upstream.borrow().clone();
    let subscriptions = state.subscriptions.current();
    let value = json!({
        "mode": status.mode,
        "address": status.address,
        "connected": status.connected,
        "since": status.since.map(time),
        "last_error": status.last_error,
        "attempts": status.attempts,
        "consecutive_failures": status.consecutive_failures,
        "connections": status.connections,
        "next_retry_in_seconds": status.next_retry_in.map(|d| d.as_secs_f64()),
        "peer": status.peer,
        "source_metadata": status.source_metadata,
        "subscribed": subscriptions.wanted,
        "refused": subscriptions.refused,
        "demand": demand_json(&state, &status, &subscriptions),
        "gateway_id": state.cache.provenance().gateway_id,
        "upstream_gateways": state.cache.provenance().upstream_chain(),
    });
    view(&headers, "Upstream", value)
}

/// Collections only clients asked for, while the source has neither
/// delivered nor refused them: how they are asked for, and whether
/// `--demand-timeout` passed ("not delivered by the source").
fn demand_json(state: &AdminState, status: &UpstreamStatus, subscriptions: &SubscriptionState) -> Value {
    let route = state.subscriptions.route();
    let collections: Vec<Value> = subscriptions
        .demanded
        .iter()
        .map(|(collection, demand)| {
            let overdue = demand.overdue_since.is_some() && state.cache.get(collection).is_none();
            let state = match (route, overdue) {
                (_, true) => NOT_DELIVERED,
                _ if demand.clock.is_none() => "waiting for the upstream to connect",
                (DemandRoute::Hold, false) => "waiting for --demand-timeout",
                _ => "asking the source",
            };
            json!({
                "collection": collection,
                "asked_at": time(demand.asked_at),
                "state": state,
                "overdue_since": demand.overdue_since.map(time),
                "note": (route == DemandRoute::Hold).then_some(
                    "not requested: in dial-out mode the gateway cannot probe the source; list it in --collections \
                     if the source serves it"
                ),
            })
        })
        .collect();
    json!({
        "route": route,
        "timeout_seconds": state.subscriptions.timeout().as_secs_f64(),
        "collections": collections,
        "probe": status.probe.as_ref().map(|p| json!({
            "asking": p.asking,
            "attempts": p.attempts,
            "last_error": p.last_error,
            "next_retry_in_seconds": p.next_retry_in.map(|d| d.as_secs_f64()),
        })),
    })
}

/// How a demanded collection the source left unanswered past
/// `--demand-timeout` is shown (`/debug/upstream`, `/debug/syncz`).
const NOT_DELIVERED: &str = "not delivered by the source";

/// The collections clients asked for that are overdue and still not in the
/// cache: what `/debug/syncz` and the `status` command show.
fn not_delivered(state: &AdminState) -> Value {
    let subscriptions = state.subscriptions.current();
    let overdue: Vec<Value> = subscriptions
        .demanded
        .iter()
        .filter(|(collection, demand)| demand.overdue_since.is_some() && state.cache.get(collection).is_none())
        .map(|(collection, demand)| {
            json!({
                "collection": collection,
                "state": NOT_DELIVERED,
                "since": demand.overdue_since.map(time),
            })
        })
        .collect();
    Value::Array(overdue)
}

// === HTML ===

/// `text` in HTML: `<>&"` as entities, and every character the crate's
/// one rule escapes (`transport::safe_text`: C0 and C1 controls, the
/// bidirectional overrides and isolates that would reorder what an operator
/// reads) shown as its escape (`\x1b`, `\u{202e}`); line ends and tabs,
/// which HTML shows as spaces, kept.
fn escape(text: &str) -> String {
    let text = lines_safe(text);
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// What a link's path or query value keeps as it is: letters, digits and a
/// collection's slashes; everything else is percent-encoded.
const URL_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC.remove(b'/');

/// `text` for a URL (then escaped for an attribute).
fn url_part(text: &str) -> String {
    escape(&percent_encoding::utf8_percent_encode(text, URL_KEEPS).to_string())
}

/// A version as HTML: its first 12 characters, the whole one on hover.
fn version_html(version: &str) -> String {
    let short = versions::short(version);
    if short.len() == version.len() {
        return format!("<code>{}</code>", escape(version));
    }
    format!("<code title=\"{}\">{}</code>", escape(version), escape(short))
}

/// A collection as HTML: a link to its history (whose versions link to
/// their diffs).
fn collection_html(collection: &str) -> String {
    format!(
        "<a href=\"/debug/history/{}\">{}</a>",
        url_part(collection),
        escape(collection)
    )
}

/// A link to the diff of `collection` between two versions.
fn diff_link(collection: &str, from: &str, to: &str, text: &str) -> String {
    format!(
        "<a href=\"/debug/diff/{}?from={}&amp;to={}\">{}</a>",
        url_part(collection),
        url_part(from),
        url_part(to),
        escape(text)
    )
}

/// Keys whose string values are collection versions.
fn is_version_key(key: &str) -> bool {
    key == "version"
        || key.ends_with("_version")
        || matches!(
            key,
            "from" | "to" | "latest" | "everyone" | "canaries" | "pinned" | "released"
        )
}

/// A value as HTML: objects as key/value tables, arrays of objects as one
/// table with a column per key, everything else as text; versions (by
/// their key) shortened, collections linked to their history.
fn html(value: &Value, out: &mut String) {
    html_under(None, value, out);
}

fn html_under(key: Option<&str>, value: &Value, out: &mut String) {
    match value {
        Value::Null => {}
        Value::String(s) => match key {
            Some(key) if is_version_key(key) => out.push_str(&version_html(s)),
            Some("collection") => out.push_str(&collection_html(s)),
            _ => out.push_str(&escape(s)),
        },
        Value::Object(map) => {
            out.push_str("<table>");
            for (key, value) in map {
                out.push_str(&format!("<tr><th>{}</th><td>", escape(key)));
                html_under(Some(key), value, out);
                out.push_str("</td></tr>");
            }
            out.push_str("</table>");
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
            let mut columns: Vec<&String> = Vec::new();
            for item in items {
                for key in item.as_object().expect("checked").keys() {
                    if !columns.contains(&key) {
                        columns.push(key);
                    }
                }
            }
            out.push_str("<table><tr>");
            for column in &columns {
                out.push_str(&format!("<th>{}</th>", escape(column)));
            }
            out.push_str("</tr>");
            for item in items {
                out.push_str("<tr>");
                for column in &columns {
                    out.push_str("<td>");
                    html_under(Some(column), &item[column.as_str()], out);
                    out.push_str("</td>");
                }
                out.push_str("</tr>");
            }
            out.push_str("</table>");
        }
        Value::Array(items) => {
            let texts: Vec<String> = items
                .iter()
                .map(|item| {
                    let mut text = String::new();
                    html_under(key, item, &mut text);
                    text
                })
                .collect();
            out.push_str(&texts.join("<br>"));
        }
        other => out.push_str(&escape(&other.to_string())),
    }
}

/// The debug views' links, at the top of every page.
const NAVIGATION: &str = "<p class=\"nav\"><a href=\"/\">index</a> · <a href=\"/debug/syncz\">syncz</a> · \
     <a href=\"/debug/clients\">clients</a> · <a href=\"/debug/cache\">cache</a> · \
     <a href=\"/debug/rollout\">rollout</a> · <a href=\"/debug/skew\">skew</a> · \
     <a href=\"/debug/upstream\">upstream</a> · \
     <a href=\"/debug/config\">config</a> · <a href=\"/metrics\">metrics</a></p>";

fn page(title: &str, value: &Value) -> String {
    let mut body = String::from(NAVIGATION);
    match value {
        Value::Array(items) if items.is_empty() => body.push_str("<p>none</p>"),
        _ => html(value, &mut body),
    }
    document(title, &body)
}

/// The pages' style: small type and tight cells, so a row of the sync
/// tables fits 1,400 px; a node id on one line (cut with an ellipsis, whole
/// on hover); a NACK message wrapped in its own column.
const STYLE: &str = "body{font-family:sans-serif;font-size:13px;line-height:1.35;margin:8px}\
     table{border-collapse:collapse;margin-bottom:8px}\
     th,td{border:1px solid #ccc;padding:2px 4px;text-align:left;vertical-align:top}\
     code{font-size:12px}\
     .node{display:inline-block;max-width:20em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;\
     vertical-align:top}\
     .nowrap{white-space:nowrap}\
     .message{min-width:24em;max-width:36em;overflow-wrap:anywhere}\
     .wrap{max-width:22em;overflow-wrap:anywhere}\
     .warning{background:#fffbea;border:1px solid #e0d090;padding:4px 8px}\
     .past{color:#777}\
     .NACKED{color:#b00000;font-weight:bold}.STALE{color:#a05a00;font-weight:bold}\
     .problem{background:#fff3f3;border:1px solid #e0b0b0;padding:4px 8px}";

/// An HTML page: `title` as its heading, then `body` (HTML).
fn document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title><style>{STYLE}</style></head>\
         <body><h1>{title}</h1>{body}</body></html>",
        title = escape(title)
    )
}

/// `?positions`: the page also records where its cells lie (`data-col`
/// elements: their box and lines), as JSON in `<pre id="positions">`, for a
/// browser test to read from the rendered page.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct Positions {
    positions: Option<String>,
}

impl Positions {
    fn script(&self) -> &'static str {
        if self.positions.is_none() {
            return "";
        }
        "<script>(function(){var cells=[];document.querySelectorAll('[data-col]').forEach(function(e){\
         var r=e.getBoundingClientRect(),line=parseFloat(getComputedStyle(e).lineHeight)||1;\
         cells.push({col:e.dataset.col,left:r.left,right:r.right,top:r.top,height:r.height,\
         lines:Math.round(r.height/line),text:e.textContent.slice(0,80)})});\
         var p=document.createElement('pre');p.id='positions';\
         p.textContent=JSON.stringify({width:window.innerWidth,scroll_width:document.documentElement.scrollWidth,\
         cells:cells});document.body.appendChild(p)})();\
         </script>"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_tables_escape_and_take_every_key() {
        let value = json!([{"a": "<x>", "b": 1}, {"a": "y", "c": [1, 2]}]);
        let page = page("T", &value);
        assert!(page.contains("<th>a</th><th>b</th><th>c</th>"), "{page}");
        assert!(page.contains("&lt;x&gt;"));
        assert!(page.contains("1<br>2"));
    }

    #[test]
    fn versions_show_twelve_characters_and_collections_link_to_their_history() {
        let full = "0123456789abcdef0123456789abcdef";
        let value = json!({"collection": "istio/a b", "version": full, "nonce": full});
        let page = page("T", &value);
        assert!(
            page.contains(&format!("<code title=\"{full}\">0123456789ab</code>")),
            "{page}"
        );
        assert!(
            page.contains(&format!("<td>{full}</td>")),
            "a nonce stays whole: {page}"
        );
        assert!(
            page.contains("<a href=\"/debug/history/istio/a%20b\">istio/a b</a>"),
            "{page}"
        );
    }
}
