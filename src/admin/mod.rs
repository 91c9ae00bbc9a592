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

use crate::cache::demand::Subscriptions;
use crate::cache::{Cache, CollectionSnapshot};
use crate::downstream::registry::{StreamView, TypeView};
use crate::downstream::Registry;
use crate::metrics as m;
use crate::source::UpstreamStatus;

mod dump;
pub mod guard;
mod history;
mod index;
mod rollout;
pub mod syncz;

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
    /// Reads bodies back for the config dump.
    pub bodies: Arc<crate::source::proto_json::BodyDecoder>,
    /// Every flag's effective value and where it came from (`/debug/config`).
    pub config: Arc<Value>,
    /// The log filter's control (`/logging`); `None` in a gateway built
    /// in-process, whose logs are its host's.
    pub logs: Option<Arc<m::LogControl>>,
}

impl AdminState {
    pub fn missing(&self) -> Vec<String> {
        missing(&self.subscriptions, &self.cache)
    }
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
    let mut collections: BTreeMap<Arc<str>, ServingStatus> = BTreeMap::new();
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
        let names: Vec<Arc<str>> = subscriptions
            .current()
            .wanted
            .into_iter()
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

/// Liveness, readiness and metrics: on both ports.
fn probes() -> Router<AdminState> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

/// The monitoring port: what Prometheus and the kubelet need, nothing that
/// names a client or a resource.
pub fn monitoring_router(state: AdminState) -> Router {
    probes().route("/", get(index::monitoring)).with_state(state)
}

/// The admin port: the monitoring paths, every debug view and the
/// controls, behind the guard against web pages ([`guard`]).
pub fn admin_router(state: AdminState, guard: guard::Guard) -> Router {
    probes()
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
        .route("/logging", axum::routing::post(logging))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(guard, guard::guard))
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    let missing = state.missing();
    if missing.is_empty() {
        return (StatusCode::OK, "ready\n".into());
    }
    let mut body = format!(
        "not ready: waiting for the first state of {} collection(s):\n",
        missing.len()
    );
    for collection in missing {
        body.push_str(&collection);
        body.push('\n');
    }
    (StatusCode::SERVICE_UNAVAILABLE, body)
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
        handle.render()
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Gauges that are views of the current state, set at scrape time.
fn refresh_gauges(state: &AdminState) {
    let snapshots = state.cache.snapshots();
    let mut delivered: Vec<Arc<str>> = Vec::new();
    for snapshot in &snapshots {
        let collection = snapshot.collection.clone();
        metrics::gauge!(m::CACHE_RESOURCES, "collection" => collection.clone()).set(snapshot.len() as f64);
        metrics::gauge!(m::CACHE_BYTES, "collection" => collection.clone()).set(snapshot.bytes as f64);
        let (versions, bytes) = state.cache.history_usage(&collection);
        metrics::gauge!(m::HISTORY_VERSIONS, "collection" => collection.clone()).set(versions as f64);
        metrics::gauge!(m::HISTORY_BYTES, "collection" => collection.clone()).set(bytes as f64);
        metrics::gauge!(m::LAST_UPDATE, "collection" => collection.clone()).set(unix_seconds(snapshot.updated_at));
        delivered.push(collection);
    }

    for rollout in state.rollout.views() {
        let collection = rollout.collection.clone();
        let flag = |on: bool| f64::from(u8::from(on));
        metrics::gauge!(m::ROLLOUT_PINNED, "collection" => collection.clone()).set(flag(rollout.pinned.is_some()));
        metrics::gauge!(m::ROLLOUT_HELD, "collection" => collection.clone()).set(flag(rollout.held.is_some()));
        metrics::gauge!(m::ROLLOUT_CANARY_ROUND, "collection" => collection.clone()).set(flag(rollout.round.is_some()));
        metrics::gauge!(m::ROLLOUT_CANARIES, "collection" => collection).set(rollout.canaries_connected as f64);
    }

    let streams = state.registry.streams();
    metrics::gauge!(m::CLIENTS, "component" => m::COMPONENT_DOWNSTREAM).set(streams.len() as f64);
    let mut by_kind: BTreeMap<(&'static str, &'static str), f64> = BTreeMap::new();
    for protocol in crate::downstream::registry::Protocol::ALL {
        for dialect in protocol.dialects().iter().map(|d| d.as_str()).chain(["none"]) {
            by_kind.insert((protocol.as_str(), dialect), 0.0);
        }
    }
    for stream in &streams {
        let mut dialects: Vec<&'static str> = stream.types.values().map(|t| t.dialect.as_str()).collect();
        dialects.sort_unstable();
        dialects.dedup();
        if dialects.is_empty() {
            dialects.push("none");
        }
        for dialect in dialects {
            *by_kind.entry((stream.protocol.as_str(), dialect)).or_default() += 1.0;
        }
    }
    for ((protocol, dialect), count) in by_kind {
        metrics::gauge!(m::DOWNSTREAM_STREAMS, "protocol" => protocol, "dialect" => dialect).set(count);
    }
    let rows = syncz::rows(&streams, &state.rollout, state.registry.clock(), state.stale_after);
    // Behind what its group is served (a pin or a canary round keeps
    // clients on an older version on purpose): each row's current version.
    let mut behind: BTreeMap<Arc<str>, f64> = delivered.into_iter().map(|c| (c, 0.0)).collect();
    for row in &rows {
        if let Some(count) = behind.get_mut(&row.view.collection) {
            if row.current.is_some() && row.view.acked_version != row.current {
                *count += 1.0;
            }
        }
    }
    for (collection, count) in behind {
        metrics::gauge!(m::CLIENTS_BEHIND, "collection" => collection).set(count);
    }
    let configured = state.subscriptions.awaited();
    for ((status, collection), count) in syncz::counts(&rows, configured) {
        metrics::gauge!(m::CLIENTS_BY_STATUS, "status" => status.as_str(), "collection" => collection)
            .set(count as f64);
    }
    let (connected, broken_files) = {
        let upstream = state.upstream.borrow();
        (upstream.connected, upstream.broken_files)
    };
    metrics::gauge!(m::UPSTREAM_CONNECTED).set(if connected { 1.0 } else { 0.0 });
    metrics::gauge!(m::SOURCE_FILES_BROKEN).set(broken_files as f64);
    metrics::gauge!(m::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
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

/// JSON, or an HTML page of tables when the client asks for `text/html`.
fn view(headers: &HeaderMap, title: &str, value: Value) -> Response {
    let html = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if html {
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
        value["subscribed"] = json!({"wildcard": subscribed.wildcard, "names": subscribed.names});
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
                "types": s.types.iter().map(|(url, t)| (url.clone(), type_json(t))).collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect();
    view(&headers, "Connected clients", Value::Array(streams))
}

async fn syncz(State(state): State<AdminState>, Query(filter): Query<syncz::Filter>, headers: HeaderMap) -> Response {
    let streams = state.registry.streams();
    let clock = state.registry.clock();
    let rows = syncz::rows(&streams, &state.rollout, clock, state.stale_after);
    match syncz::view(&rows, clock, &filter) {
        Ok(mut value) => {
            value["rollout"] = syncz::rollouts(&state.rollout, &filter);
            view(
                &headers,
                "Sync status: a summary, the collections pinned, held or in a canary round, then one row per \
                 client stream and type",
                value,
            )
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
    if let Some(format) = &query.bodies {
        return dump::dump(&snapshot, snapshot_json(&snapshot), format, &state.bodies);
    }
    let mut value = snapshot_json(&snapshot);
    value["resources"] = snapshot
        .resources
        .values()
        .map(|r| json!({"name": r.name, "version": r.version, "body_type_url": r.body_type_url}))
        .collect();
    view(&headers, &format!("Cache: {collection}"), value)
}

/// Every flag with its value and where it came from, and the log filter in
/// force.
async fn config(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let value = json!({
        "flags": *state.config,
        "log_filter": state.logs.as_ref().map(|l| l.current()),
        "version": env!("CARGO_PKG_VERSION"),
    });
    view(&headers, "Effective configuration", value)
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
        "gateway_id": state.cache.provenance().gateway_id,
        "upstream_gateways": state.cache.provenance().upstream_chain(),
    });
    view(&headers, "Upstream", value)
}

// === HTML ===

fn escape(text: &str) -> String {
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

/// A value as HTML: objects as key/value tables, arrays of objects as one
/// table with a column per key, everything else as text.
fn html(value: &Value, out: &mut String) {
    match value {
        Value::Null => {}
        Value::String(s) => out.push_str(&escape(s)),
        Value::Object(map) => {
            out.push_str("<table>");
            for (key, value) in map {
                out.push_str(&format!("<tr><th>{}</th><td>", escape(key)));
                html(value, out);
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
                    html(&item[column.as_str()], out);
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
                    html(item, &mut text);
                    text
                })
                .collect();
            out.push_str(&texts.join("<br>"));
        }
        other => out.push_str(&escape(&other.to_string())),
    }
}

fn page(title: &str, value: &Value) -> String {
    let mut body = String::new();
    match value {
        Value::Array(items) if items.is_empty() => body.push_str("<p>none</p>"),
        _ => html(value, &mut body),
    }
    body.push_str(
        "<p><a href=\"/\">index</a> · <a href=\"/debug/clients\">clients</a> · <a href=\"/debug/syncz\">syncz</a> · \
         <a href=\"/debug/cache\">cache</a> · <a href=\"/debug/upstream\">upstream</a> · \
         <a href=\"/metrics\">metrics</a></p>",
    );
    document(title, &body)
}

/// An HTML page: `title` as its heading, then `body` (HTML).
fn document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title><style>\
         body{{font-family:sans-serif}}table{{border-collapse:collapse}}\
         th,td{{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}}\
         </style></head><body><h1>{title}</h1>{body}</body></html>",
        title = escape(title)
    )
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
}
