//! Operating the gateway: `/metrics`, the debug views, gRPC health and
//! reflection, the `client` subcommand, the dashboard's queries, and the
//! maximum connection age.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use mcp_xds_gateway::proto::{MeshConfigResponse, Resource};
use tokio::process::Command;
use tonic::Code;

use crate::helpers::clients::{channel, incremental, send_garbled, sotw, SotwClient};
use crate::helpers::galley::{full, resource, FakeGalley, GalleyStream};
use crate::helpers::{eventually, gateway_for, http_get, http_get_with, within, DR, GW, GW_TYPE_URL, VS};

const BIN: &str = env!("CARGO_BIN_EXE_mcp-xds-gateway");

async fn json(addr: SocketAddr, path: &str) -> serde_json::Value {
    crate::helpers::get_json(addr, path).await
}

/// A gateway that has seen every kind of event a metric counts: in-process
/// (`Bound`), or a process of its own (`Running`) where its metrics are the
/// assertion (in-process gateways share one recorder).
struct Exercised<G = mcp_xds_gateway::app::Bound> {
    gw: G,
    _galley: FakeGalley,
    upstream: GalleyStream,
    /// ACKed the current VS version.
    synced: SotwClient,
    /// NACKed the current VS version.
    nacked: SotwClient,
    /// Holds an unACKed response for VS.
    pending: SotwClient,
    /// A second gateway whose upstream refuses connections.
    _unreachable: mcp_xds_gateway::app::Bound,
}

async fn exercise() -> Exercised {
    exercise_on(
        |url| async move {
            crate::helpers::start_gateway(&exercise_flags(&url).iter().map(String::as_str).collect::<Vec<_>>()).await
        },
        |gw| gw.listen,
    )
    .await
}

/// The flags of the exercised gateway (as `gateway_for` gives them).
fn exercise_flags(url: &str) -> Vec<String> {
    let collections = [VS, GW, DR].join(",");
    [
        "--upstream",
        url,
        "--collections",
        &collections,
        "--reconnect-min-delay",
        "10ms",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// [`exercise`] with the gateway a process of its own.
async fn exercise_process() -> Exercised<crate::helpers::Running> {
    exercise_on(
        |url| async move {
            crate::helpers::spawn_gateway(
                None,
                &exercise_flags(&url).iter().map(String::as_str).collect::<Vec<_>>(),
            )
            .await
        },
        |gw| gw.listen,
    )
    .await
}

async fn exercise_on<G, F: std::future::Future<Output = G>>(
    start: impl FnOnce(String) -> F,
    listen: impl Fn(&G) -> SocketAddr,
) -> Exercised<G> {
    let mut galley = FakeGalley::start().await;
    galley.refuse(DR);
    let gw = start(galley.url()).await;
    let _refused = galley.next_stream().await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(2).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    upstream.push_full(GW, vec![resource("g", "1", b"g")]).await;
    // An upstream NACK (a resource without metadata).
    let nack = upstream
        .send(full(
            VS,
            vec![Resource {
                metadata: None,
                ..resource("x", "1", b"x")
            }],
        ))
        .await;
    assert!(nack.error_detail.is_some());

    let mut synced = sotw(listen(&gw)).await;
    let mut nacked = sotw(listen(&gw)).await;
    let mut pending = sotw(listen(&gw)).await;
    let mut first: Vec<MeshConfigResponse> = Vec::new();
    for client in [&mut synced, &mut nacked, &mut pending] {
        client.subscribe(VS);
        first.push(client.recv().await);
    }
    synced.ack(&first[0]);
    nacked.ack(&first[1]);
    // A change after the streams began: push latency is measured.
    upstream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    let second = synced.recv().await;
    synced.ack(&second);
    let refused = nacked.recv().await;
    nacked.nack(&refused, &first[1].version_info, "bad route");
    // A stale nonce.
    synced.request(VS, &second.version_info, "no-such-nonce");
    // An incremental client and a 1.0 client on GW.
    let mut inc = incremental(listen(&gw)).await;
    inc.start(GW, &[]);
    inc.recv().await;
    pending.subscribe(GW_TYPE_URL);
    let gateways = pending.recv_type(GW_TYPE_URL).await;
    pending.ack(&gateways);
    // A response above 4 MiB.
    let big = vec![resource("huge", "1", &vec![b'x'; 5 << 20])];
    upstream.push_full(GW, big).await;
    pending.recv_type(GW_TYPE_URL).await;
    // A request that does not decode: a receive failure downstream.
    assert_eq!(send_garbled(listen(&gw)).await.code(), Code::InvalidArgument);
    // Upstream ends a stream (receive failure, termination, reconnection).
    upstream.kill(tonic::Status::unavailable("galley restarts"));
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(2).await;
    // An upstream that refuses connections (send failures).
    let unreachable = crate::helpers::start_gateway(&[
        "--upstream",
        "http://127.0.0.1:1",
        "--collections",
        VS,
        "--reconnect-min-delay",
        "10ms",
    ])
    .await;
    eventually("a failed connection attempt", || {
        unreachable.upstream.borrow().last_error.is_some()
    })
    .await;
    Exercised {
        gw,
        _galley: galley,
        upstream,
        synced,
        nacked,
        pending,
        _unreachable: unreachable,
    }
}

/// Metric names in an exposition: the first token of every sample line.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn metrics_carry_istio_names_help_lines_and_bounded_labels() {
    let ex = exercise_process().await;
    let (status, text) = http_get(ex.gw.admin, "/metrics").await;
    assert_eq!(status, 200);
    let names = exported(&text);
    for name in [
        "istio_mcp_clients_total",
        "istio_mcp_message_sizes_bytes_bucket",
        "istio_mcp_request_acks_total",
        "istio_mcp_request_nacks_total",
        "istio_mcp_send_failures_total",
        "istio_mcp_recv_failures_total",
        "istio_mcp_reconnections",
        "mcp_gateway_upstream_connected",
        "mcp_gateway_upstream_stream_terminations_total",
        "mcp_gateway_upstream_refused_collections_total",
        "mcp_gateway_updates_applied_total",
        "mcp_gateway_last_update_timestamp_seconds",
        "mcp_gateway_cache_resources",
        "mcp_gateway_cache_bytes",
        "mcp_gateway_history_versions",
        "mcp_gateway_history_bytes",
        "mcp_gateway_pinned",
        "mcp_gateway_held",
        "mcp_gateway_canary_round",
        "mcp_gateway_canaries",
        "mcp_gateway_downstream_streams",
        "mcp_gateway_downstream_pushes_total",
        "mcp_gateway_downstream_stale_requests_total",
        "mcp_gateway_push_latency_seconds_bucket",
        "mcp_gateway_upstream_connect_attempts_total",
        "mcp_gateway_clients_behind",
        "mcp_gateway_clients",
        "mcp_gateway_oversized_responses_total",
        "mcp_gateway_build_info",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(names.contains(name), "{name} is not exported:\n{text}");
    }
    // The stream gauge keeps a series for each protocol and its dialects, so
    // one that had streams goes back to zero rather than keeping its value.
    for (protocol, dialect) in [("xds-sotw", "xds"), ("xds-delta", "xds"), ("sotw", "1.1")] {
        assert!(
            text.lines().any(|l| l.starts_with("mcp_gateway_downstream_streams{")
                && l.contains(&format!("protocol=\"{protocol}\""))
                && l.contains(&format!("dialect=\"{dialect}\""))),
            "no stream gauge for {protocol}/{dialect}:\n{text}"
        );
    }
    // Every metric has a HELP line.
    let helped: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    for name in &names {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| helped.contains(f)))
            .unwrap_or(name);
        assert!(helped.contains(family), "{name} has no HELP line");
    }
    // Istio's size buckets: 1, 4, 16, ... 1 GiB.
    assert!(text.contains("istio_mcp_message_sizes_bytes_bucket{component=\"upstream\",collection=\"istio/networking/v1alpha3/virtualservices\",le=\"1073741824\"}"), "{text}");
    // No label names a client, a node or an address.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        for forbidden in ["peer=", "node=", "node_id=", "client=", "address=", "ip=", "pod="] {
            assert!(!line.contains(forbidden), "{line}");
        }
    }
    let value = |series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    // Exact: the gateway is a process of its own. One response over 4 MiB
    // (to the legacy client following GW); two clients behind on VS (the
    // one that NACKed and the one that never ACKed).
    assert_eq!(
        value("mcp_gateway_oversized_responses_total{collection=\"istio/networking/v1alpha3/gateways\"}"),
        1.0
    );
    assert_eq!(
        value("mcp_gateway_clients_behind{collection=\"istio/networking/v1alpha3/virtualservices\"}"),
        2.0
    );
    // One series per status and collection, zero included.
    let by_status = |status: &str, collection: &str| -> Option<f64> {
        text.lines()
            .find(|l| {
                l.starts_with("mcp_gateway_clients{")
                    && l.contains(&format!("status=\"{status}\""))
                    && l.contains(&format!("collection=\"{collection}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    assert_eq!(by_status("NACKED", VS), Some(1.0), "{text}");
    assert_eq!(by_status("SYNCED", VS), Some(1.0), "{text}");
    assert_eq!(by_status("STALE", VS), Some(0.0), "{text}");
    assert_eq!(by_status("NOT SENT", GW), Some(0.0), "{text}");
    assert_eq!(value("mcp_gateway_upstream_connected"), 1.0);
    // Three streams to Galley: the first, ended by its refusal of DR; the
    // next, killed; the last. So two reconnections and three attempts (the
    // unreachable gateway is another, in-process one).
    assert_eq!(value("istio_mcp_reconnections{component=\"upstream\"}"), 2.0);
    assert_eq!(value("mcp_gateway_upstream_connect_attempts_total"), 3.0);
    // Istio's codes are numbers: the NACK was InvalidArgument.
    assert!(
        text.lines().any(
            |l| l.starts_with("istio_mcp_request_nacks_total{component=\"downstream\"")
                && l.contains("code=\"3\"")
                && !l.ends_with(" 0")
        ),
        "{text}"
    );
}

/// Metric names a PromQL expression reads.
pub(crate) fn queried(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut token = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            token.push(c);
        } else {
            if ["istio_mcp_", "mcp_gateway_", "process_"]
                .iter()
                .any(|p| token.starts_with(p))
            {
                names.push(token.clone());
            }
            token.clear();
        }
    }
    names
}

#[tokio::test]
async fn every_dashboard_query_names_a_metric_the_gateway_exports() {
    let ex = exercise().await;
    let (_, text) = http_get(ex.gw.admin, "/metrics").await;
    let names = exported(&text);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/dashboards/mcp-xds-gateway.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(variables.contains(&"datasource"), "{variables:?}");
    let mut rows = Vec::new();
    let mut queried_names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        if panel["type"] == "row" {
            rows.push(title);
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            panel["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .is_some_and(|u| !u.is_empty()),
            "{title} has no unit"
        );
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} queries nothing");
        for target in targets {
            let expr = target["expr"].as_str().unwrap();
            if expr.contains("rate(") || expr.contains("increase(") {
                assert!(expr.contains("[$__rate_interval]"), "{title}: {expr}");
            }
            let found = queried(expr);
            assert!(!found.is_empty(), "{title}: {expr}");
            for name in found {
                assert!(
                    names.contains(&name),
                    "{title} queries {name}, which /metrics does not export"
                );
                queried_names.insert(name);
            }
        }
    }
    assert_eq!(rows, ["Upstream", "Cache", "Downstream", "Rollout", "Process"]);
    assert!(queried_names.len() >= 20, "{queried_names:?}");
}

#[tokio::test]
async fn debug_views_show_clients_sync_cache_and_upstream() {
    let ex = exercise().await;
    let cached = ex.gw.cache.get(VS).unwrap();
    let addr = ex.gw.admin;

    let clients = json(addr, "/debug/clients").await;
    let clients = clients.as_array().unwrap();
    let nacked = clients
        .iter()
        .find(|c| c["types"][VS]["last_nack"]["message"] == "bad route")
        .expect("the NACKing client with its message");
    assert_eq!(nacked["protocol"], "sotw");
    assert_eq!(nacked["dialect"], "1.1");
    assert_eq!(nacked["node_id"], "pilot-test");
    assert!(nacked["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(nacked["connected_since"].as_str().unwrap().ends_with('Z'));
    assert_eq!(nacked["types"][VS]["last_nack"]["code"], "InvalidArgument");
    assert!(clients.iter().any(|c| c["protocol"] == "incremental"));
    assert!(
        clients.iter().any(|c| c["dialect"] == "mixed"),
        "the pending client has 1.1 and 1.0 types"
    );
    // The response above 4 MiB is shown with its size.
    let oversized = clients
        .iter()
        .find_map(|c| c["types"][GW_TYPE_URL]["oversized_bytes"].as_u64())
        .expect("the oversized response in the view");
    assert!(oversized > 4 << 20, "{oversized}");
    assert!(clients.iter().all(|c| c["types"][VS].get("oversized_bytes").is_none()));

    let syncz = json(addr, "/debug/syncz").await;
    let rows = syncz["rows"].as_array().unwrap();
    let statuses: BTreeSet<&str> = rows
        .iter()
        .filter(|row| row["type_url"] == VS)
        .map(|row| row["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, BTreeSet::from(["SYNCED", "NACKED", "SENT"]), "{syncz}");
    let row = rows.iter().find(|r| r["status"] == "NACKED").unwrap();
    assert_eq!(row["current_version"], *cached.version);
    assert_eq!(row["nack"]["message"], "bad route");
    assert_eq!(row["nack"]["version"], *cached.version);
    assert_eq!(row["node_id"], "pilot-test");
    assert_eq!(row["protocol"], "sotw");
    for time in [
        &row["since"],
        &row["nack"]["at"],
        &row["last_request"],
        &row["sent"]["at"],
        &row["connected_since"],
    ] {
        assert!(time.as_str().is_some_and(|t| t.ends_with('Z')), "{row}");
    }
    assert!(row["for_seconds"].as_f64().is_some(), "{row}");
    let sent = rows.iter().find(|r| r["status"] == "SENT").unwrap();
    assert_eq!(sent["sent"]["awaiting_ack"], true, "{sent}");
    assert!(sent["acked"].is_null(), "{sent}");
    // The summary counts every row; the filters narrow the rows only.
    let total: u64 = syncz["summary"]["clients"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(total as usize, rows.len());
    assert_eq!(syncz["summary"]["by_collection"][VS]["NACKED"], 1, "{syncz}");
    let nacked = json(addr, "/debug/syncz?status=nacked").await;
    assert_eq!(nacked["rows"].as_array().unwrap().len(), 1, "{nacked}");
    assert_eq!(nacked["summary"], syncz["summary"]);
    let by_collection = json(addr, &format!("/debug/syncz?collection={GW}")).await;
    assert!(by_collection["rows"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["collection"] == GW));
    assert!(!by_collection["rows"].as_array().unwrap().is_empty());
    let by_node = json(addr, "/debug/syncz?node=no-such-node").await;
    assert!(by_node["rows"].as_array().unwrap().is_empty());
    let (status, body) = http_get(addr, "/debug/syncz?status=late").await;
    assert_eq!(status, 400);
    assert!(body.contains("SYNCED, SENT, STALE, NACKED, NOT SENT"), "{body}");

    // The admin index: every endpoint, and the clients not in sync with
    // their collection, status, since when and why.
    let (status, index) = http_get_with(addr, "/", "Accept: application/json\r\n").await;
    assert_eq!(status, 200);
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    let paths: Vec<&str> = index["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    for path in [
        "/debug/syncz",
        "/debug/clients",
        "/debug/cache",
        "/debug/upstream",
        "/metrics",
        "/readyz",
    ] {
        assert!(paths.contains(&path), "{index}");
    }
    assert_eq!(index["clients"], syncz["summary"]["clients"]);
    let stuck = index["not_synced"].as_array().unwrap();
    assert!(stuck.iter().all(|r| r["status"] != "SYNCED"), "{index}");
    let nacked = stuck
        .iter()
        .find(|r| r["status"] == "NACKED")
        .expect("the NACKing client");
    assert_eq!(
        (&nacked["collection"], &nacked["nack"], &nacked["node_id"]),
        (&VS.into(), &"bad route".into(), &"pilot-test".into())
    );
    assert!(nacked["since"].as_str().is_some_and(|t| t.ends_with('Z')), "{nacked}");
    let (_, page) = http_get_with(addr, "/", "Accept: text/html\r\n").await;
    assert!(
        page.contains("<a href=\"/debug/syncz\">") && page.contains("bad route") && page.contains("NACKED"),
        "{page}"
    );
    // The clients not in sync come before the endpoints; versions show 12
    // characters, whole on hover; collections link to their history, and
    // to the diff between what a client holds and what it refused.
    let problems = page.find("Clients not in sync").unwrap();
    assert!(problems < page.find("<h2>Endpoints</h2>").unwrap(), "{page}");
    let version = &cached.version;
    assert!(
        page.contains(&format!("<code title=\"{version}\">{}</code>", &version[..12])),
        "{page}"
    );
    assert!(
        page.contains(&format!("<a href=\"/debug/history/{VS}\">{VS}</a>")),
        "{page}"
    );
    assert!(page.contains(&format!("/debug/diff/{VS}?from=")), "{page}");
    let (_, syncz_page) = http_get_with(addr, "/debug/syncz", "Accept: text/html\r\n").await;
    let first_row = syncz_page.find("<tr><td data-col=\"status\">").unwrap();
    assert!(
        syncz_page[first_row..].starts_with("<tr><td data-col=\"status\"><span class=\"NACKED\">"),
        "NACKED first: {syncz_page}"
    );
    let (_, history_page) = http_get_with(addr, &format!("/debug/history/{VS}"), "Accept: text/html\r\n").await;
    assert!(
        history_page.contains(&format!("/debug/diff/{VS}?from=")) && history_page.contains("with the one before"),
        "{history_page}"
    );

    let cache = json(addr, "/debug/cache").await;
    let vs = cache
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["collection"] == VS)
        .unwrap();
    assert_eq!(vs["version"], *cached.version);
    assert_eq!(vs["resources"], 2);
    assert_eq!(vs["bytes"], cached.bytes);
    assert_eq!(vs["origin"], "upstream");
    assert!(vs["updated_at"].as_str().unwrap().ends_with('Z'));

    let one = json(addr, &format!("/debug/cache/{VS}")).await;
    let resources = one["resources"].as_array().unwrap();
    assert_eq!(resources[0]["name"], "a");
    assert_eq!(resources[0]["version"], "1");
    assert_eq!(resources[1]["name"], "b");
    assert_eq!(http_get(addr, "/debug/cache/istio/nope").await.0, 404);

    let upstream = json(addr, "/debug/upstream").await;
    assert_eq!(upstream["mode"], "client");
    assert_eq!(upstream["connected"], true);
    assert!(upstream["refused"][DR]
        .as_str()
        .unwrap()
        .contains("unsupported collection"));
    assert_eq!(
        upstream["last_error"].as_str().map(|e| e.contains("galley restarts")),
        Some(true)
    );

    // The same views as HTML tables for a browser.
    for path in ["/debug/clients", "/debug/syncz", "/debug/cache", "/debug/upstream"] {
        let (status, html) = http_get_with(addr, path, "Accept: text/html\r\n").await;
        assert_eq!(status, 200);
        assert!(
            html.starts_with("<!doctype html>") && html.contains("<table>"),
            "{path}: {html}"
        );
    }
    // Keep the clients until the views were read.
    drop((ex.synced, ex.nacked, ex.pending, ex.upstream));
}

#[tokio::test]
async fn grpc_health_follows_readiness_and_reflection_lists_the_services() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let health = HealthClient::new(channel(gw.listen).await);
    let check = |service: &'static str| {
        let mut health = health.clone();
        async move {
            within(
                "a health check",
                health.check(HealthCheckRequest {
                    service: service.into(),
                }),
            )
            .await
            .unwrap()
            .into_inner()
            .status
        }
    };
    assert_eq!(check("").await, ServingStatus::NotServing as i32);
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    within("SERVING once ready", async {
        loop {
            if check("istio.mcp.v1alpha1.AggregatedMeshConfigService").await == ServingStatus::Serving as i32 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(check("").await, ServingStatus::Serving as i32);

    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut reflection = ServerReflectionClient::new(channel(gw.listen).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = within(
        "reflection",
        reflection.server_reflection_info(tokio_stream::iter(vec![request])),
    )
    .await
    .unwrap()
    .into_inner();
    let response = within("the service list", responses.message()).await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("{response:?}")
    };
    let services: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        services.contains(&"istio.mcp.v1alpha1.AggregatedMeshConfigService".to_owned()),
        "{services:?}"
    );
    assert!(services.contains(&"grpc.health.v1.Health".to_owned()), "{services:?}");
}

async fn client_command(args: &[&str]) -> (Option<i32>, String, String) {
    subcommand("client", args).await
}

/// Runs `mcp-xds-gateway SUBCOMMAND ARGS…`: exit code, stdout, stderr.
pub(crate) async fn subcommand(name: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let output = within(
        &format!("the {name} command to exit"),
        Command::new(BIN).arg(name).args(args).kill_on_drop(true).output(),
    )
    .await
    .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_client_command_prints_updates_and_exits_once_everything_arrived() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS, GW], &[]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(2).await;
    upstream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "2", b"b")])
        .await;
    upstream.push_full(GW, vec![resource("g", "7", b"g")]).await;
    let target = gw.listen.to_string();
    let version = gw.cache.get(VS).unwrap().version.to_string();

    let (code, stdout, stderr) = client_command(&[
        "--target",
        &target,
        "--type-url",
        VS,
        "--type-url",
        GW_TYPE_URL,
        "--once",
        "--show",
        "resources",
    ])
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "{VS} version={version} resources=2 added=2 changed=0 removed=0"
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("  b version=2 body={}", crate::helpers::VS_TYPE_URL)),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("{GW_TYPE_URL} version=")), "{stdout}");

    let (code, stdout, stderr) =
        client_command(&["--target", &target, "--type-url", VS, "--incremental", "--once"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("resources=2 added=2"), "{stdout}");

    // Errors: an unknown type, a type never delivered, nobody listening.
    let (code, _, stderr) = client_command(&["--target", &target, "--type-url", "istio/nope", "--once"]).await;
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("istio/nope") && stderr.contains("InvalidArgument"),
        "{stderr}"
    );
    let (code, _, stderr) =
        client_command(&["--target", &target, "--type-url", DR, "--once", "--timeout", "200ms"]).await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("no response within") && stderr.contains(DR), "{stderr}");
    let (code, _, stderr) = client_command(&["--target", "127.0.0.1:1", "--type-url", VS, "--once"]).await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("cannot connect"), "{stderr}");

    // Without --once it follows changes and ACKs each one.
    let mut follower = Command::new(BIN)
        .args(["client", "--target", &target, "--type-url", VS])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(follower.stdout.take().unwrap()).lines();
    let first = within("the first update line", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(first.contains("added=2"), "{first}");
    upstream.push_full(VS, vec![resource("a", "2", b"a2")]).await;
    let second = within("the second update line", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(second.contains("resources=1 added=0 changed=1 removed=1"), "{second}");
    follower.kill().await.unwrap();
}

#[tokio::test]
async fn connections_past_their_maximum_age_are_closed_and_clients_come_back() {
    use crate::helpers::h2raw::{self, grpc_headers, RawConn};
    // A gateway process of its own: the `max_age` count is its own.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        format!("collection: {VS}\nname: ns/a\nversion: \"1\"\nbody:\n  struct: {{a: 1}}\n"),
    )
    .unwrap();
    let source = dir.path().to_str().unwrap();
    let flags = [
        "--source-dir",
        source,
        "--collections",
        VS,
        "--max-connection-age",
        "300ms",
        "--max-connection-age-grace",
        "1s",
    ];
    let gw = crate::helpers::spawn_gateway(None, &flags).await;
    // A connection with a live stream: past its age it gets GOAWAY
    // NO_ERROR, and is closed after the grace.
    let connected = tokio::time::Instant::now();
    let mut conn = RawConn::http2(gw.listen).await;
    conn.send(&grpc_headers(1, crate::helpers::clients::SOTW_PATH, 0)).await;
    let goaway = conn.until(|f| f.kind == h2raw::GOAWAY).await.expect("a GOAWAY");
    assert_eq!(goaway.goaway().map(|g| g.0), Some(h2raw::NO_ERROR), "{goaway:?}");
    conn.until_closed().await;
    // Measured from before the connection was made, so that a late read of
    // either frame cannot shorten it: the close comes no earlier than the
    // age (less its 10 % jitter) and then the whole grace. A gateway that
    // closed at the GOAWAY would close at about 300 ms.
    let lived = connected.elapsed();
    assert!(
        lived >= Duration::from_millis(270 + 1000),
        "closed after {lived:?}: before the age and the grace"
    );
    crate::limits::metric_is(
        gw.monitoring,
        "mcp_gateway_connections_closed_total{listener=\"--listen\",reason=\"max_age\"}",
        1,
    )
    .await;
    // A client comes back on a new connection and is served.
    let mut again = sotw(gw.listen).await;
    again.subscribe(VS);
    assert_eq!(again.recv().await.resources.len(), 1);
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    use tokio::io::AsyncBufReadExt;
    let mut child = Command::new(BIN)
        .args(crate::helpers::LOOPBACK_PORTS)
        .args(["--log-format", "json"])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = within("a log line", lines.next_line()).await.unwrap().unwrap();
    let entry: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(entry["message"], "effective configuration");
    assert_eq!(entry["level"], "INFO");
    // Lines until one with `message`, as JSON.
    async fn next<R: tokio::io::AsyncBufRead + Unpin>(
        lines: &mut tokio::io::Lines<R>,
        message: &'static str,
    ) -> serde_json::Value {
        within(message, async {
            loop {
                let line = lines.next_line().await.unwrap().expect("the gateway is running");
                let entry: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
                if entry["message"] == message {
                    return entry;
                }
            }
        })
        .await
    }
    let listening = next(&mut lines, "gateway listening").await;
    let listen: SocketAddr = listening["listen"].as_str().unwrap().parse().unwrap();
    // A client connects, is answered, and leaves: a line each, with who,
    // why and what it had ACKed.
    let mut client = sotw(listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    client.ack(&response);
    let admin: SocketAddr = listening["admin"].as_str().unwrap().parse().unwrap();
    crate::helpers::eventually_async("the ACK to be taken", || async {
        json(admin, "/debug/syncz").await["rows"][0]["status"] == "SYNCED"
    })
    .await;
    let connected = next(&mut lines, "client connected").await;
    assert_eq!(connected["protocol"], "sotw", "{connected}");
    assert_eq!(connected["node"], "pilot-test", "{connected}");
    assert!(
        connected["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{connected}"
    );
    drop(client);
    let left = next(&mut lines, "client left").await;
    assert_eq!(left["reason"], "client_gone", "{left}");
    assert_eq!(left["node"], "pilot-test", "{left}");
    assert!(left["connected_seconds"].as_f64().is_some(), "{left}");
    assert!(left["acked"].as_str().unwrap().starts_with(&format!("{VS}=")), "{left}");
    child.kill().await.unwrap();
}

/// A client that does not ACK is SENT, then STALE once it has been behind
/// for longer than --stale-after (here 0s: as soon as the clock moves), and
/// SYNCED once it ACKs; the metric follows.
#[tokio::test]
async fn a_client_behind_for_longer_than_stale_after_is_stale() {
    let gw = crate::helpers::start_gateway(&["--stale-after", "0s"]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    let status = || async {
        let syncz = json(gw.admin, "/debug/syncz").await;
        syncz["rows"][0]["status"].as_str().unwrap_or_default().to_owned()
    };
    crate::helpers::eventually_async("the unACKed client to be STALE", || async { status().await == "STALE" }).await;
    let syncz = json(gw.admin, "/debug/syncz?status=stale").await;
    let row = &syncz["rows"][0];
    assert_eq!(row["collection"], VS);
    assert_eq!(row["since"], row["behind_since"], "{row}");
    let (_, metrics) = http_get(gw.admin, "/metrics").await;
    assert!(
        metrics.lines().any(|l| l.starts_with("mcp_gateway_clients{")
            && l.contains("status=\"STALE\"")
            && l.contains(VS)
            && l.ends_with(" 1")),
        "{metrics}"
    );
    client.ack(&response);
    crate::helpers::eventually_async("the ACK to make it SYNCED", || async { status().await == "SYNCED" }).await;
}

/// `status`: one line per client stream with a status column per
/// collection, like `istioctl proxy-status`, and the NACK messages.
#[tokio::test]
async fn the_status_command_shows_every_client_per_collection() {
    let ex = exercise().await;
    let admin = format!("http://{}", ex.gw.admin);
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    // A NACKing client: exit 1, and the first line says why.
    assert_eq!(code, Some(1), "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("NOT SYNCED: ") && lines[0].contains("1 NACKED"),
        "{stdout}"
    );
    let lines = &lines[1..];
    assert!(
        lines[0].starts_with("NODE") && lines[0].contains("PROTOCOL"),
        "{stdout}"
    );
    assert!(
        lines[0].contains("VIRTUALSERVICES") && lines[0].contains("GATEWAYS"),
        "{stdout}"
    );
    assert!(
        lines.iter().any(|l| l.contains("pilot-test") && l.contains("NACKED")),
        "{stdout}"
    );
    assert!(lines.iter().any(|l| l.contains("SENT")), "{stdout}");
    // The NACK with the version refused (12 characters) and how long ago.
    let refused = ex.gw.cache.get(VS).unwrap().version.clone();
    assert!(
        stdout.contains(&format!("NACK pilot-test {VS}: bad route ({}, NACKed ", &refused[..12])),
        "{stdout}"
    );
    assert!(stdout.contains("1 NACKED"), "{stdout}");
    // The streams that need an eye first: the NACKing one leads.
    assert!(lines[1].contains("NACKED"), "{stdout}");

    let (code, only, _) = subcommand("status", &["--admin", &admin, "--status", "nacked"]).await;
    assert_eq!(code, Some(1));
    let clients = only.lines().skip(2).take_while(|l| !l.is_empty()).count();
    assert_eq!(clients, 1, "{only}");

    // An admin port that is not there: exit 2, saying where it looked.
    let (code, _, stderr) = subcommand("status", &["--admin", "127.0.0.1:1"]).await;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("cannot connect to the admin port at 127.0.0.1:1"),
        "{stderr}"
    );
}

/// A gateway fed by a fake Galley, and a client that ACKed VS's first
/// version (`first`) and NACKed the second (`refused`) "bad route", shown
/// NACKED in `/debug/syncz`.
struct Nacked {
    _galley: FakeGalley,
    gw: mcp_xds_gateway::app::Bound,
    upstream: GalleyStream,
    client: SotwClient,
    first: MeshConfigResponse,
    refused: MeshConfigResponse,
}

impl Nacked {
    async fn start() -> Nacked {
        let (galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
        upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
        let mut client = sotw(gw.listen).await;
        client.subscribe(VS);
        let first = client.recv().await;
        client.ack(&first);
        upstream.push_full(VS, vec![resource("a", "2", b"bad")]).await;
        let refused = client.recv().await;
        client.nack(&refused, &first.version_info, "bad route");
        let nacked = Nacked {
            _galley: galley,
            gw,
            upstream,
            client,
            first,
            refused,
        };
        crate::helpers::eventually_async("the NACK in the view", || async {
            first_row(nacked.gw.admin).await["status"] == "NACKED"
        })
        .await;
        nacked
    }
}

/// The first row of `/debug/syncz`.
async fn first_row(admin: SocketAddr) -> serde_json::Value {
    json(admin, "/debug/syncz").await["rows"][0].clone()
}

/// A NACK the client has since ACKed past stays visible, marked as such:
/// the row is SYNCED, `/debug/syncz` has `nack.superseded`, and `status`
/// says "since fixed".
#[tokio::test]
async fn the_status_command_marks_a_nack_since_fixed() {
    let Nacked {
        _galley,
        gw,
        mut upstream,
        mut client,
        refused,
        ..
    } = Nacked::start().await;
    let row = || first_row(gw.admin);
    let admin = format!("http://{}", gw.admin);
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "NACKED: {stderr}");
    let nack_line = format!(
        "NACK pilot-test {VS}: bad route ({}, NACKed ",
        &refused.version_info[..12]
    );
    assert!(stdout.contains(&nack_line), "{stdout}");
    assert!(!stdout.contains("since fixed"), "{stdout}");

    upstream.push_full(VS, vec![resource("a", "3", b"good")]).await;
    let fixed = client.recv().await;
    client.ack(&fixed);
    crate::helpers::eventually_async("the ACK past the NACK", || async { row().await["status"] == "SYNCED" }).await;
    let now = row().await;
    assert_eq!(now["nack"]["superseded"], true, "{now}");
    assert_eq!(now["nack"]["version"], refused.version_info.as_str(), "{now}");
    assert!(now["nack"]["age_seconds"].as_f64().is_some(), "{now}");
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains(&nack_line) && stdout.contains(" ago, since fixed)"),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("pilot-test") && l.contains("SYNCED")),
        "{stdout}"
    );
    // Not a problem any more: the index does not list it.
    let (_, index) = http_get_with(gw.admin, "/", "Accept: application/json\r\n").await;
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert!(index["not_synced"].as_array().unwrap().is_empty(), "{index}");
}

/// "Since fixed" only while the client no longer refuses the current
/// version. Pinned back to the version before the bad one, the NACKing
/// client ACKs it; unpinned, the version it NACKed is the current one again:
/// its row is NACKED, so the NACK must read as current everywhere: not
/// `superseded` in `/debug/syncz`, no "since fixed" in `status`, its message
/// in the index's problem table. Having ACKed a later response, the client
/// is sent that version again, and its ACK of it makes the NACK since fixed.
#[tokio::test]
async fn a_nack_of_the_version_current_again_after_an_unpin_is_not_since_fixed() {
    let Nacked {
        _galley,
        upstream: _upstream,
        gw,
        mut client,
        first,
        refused,
    } = Nacked::start().await;
    let row = || first_row(gw.admin);

    let pin = format!("/pin/{VS}?version={}", &first.version_info[..12]);
    let (code, body) = crate::helpers::http_request(gw.admin, "POST", &pin, "").await;
    assert_eq!(code, 200, "{body}");
    let pinned = client.recv().await;
    assert_eq!(pinned.version_info, first.version_info);
    client.ack(&pinned);
    crate::helpers::eventually_async("the pinned version ACKed", || async {
        row().await["status"] == "SYNCED"
    })
    .await;

    let (code, body) = crate::helpers::http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    crate::helpers::eventually_async("the NACKed version current again", || async {
        row().await["current_version"] == refused.version_info.as_str()
    })
    .await;
    let now = row().await;
    assert_eq!(now["status"], "NACKED", "{now}");
    assert_eq!(now["nack"]["version"], refused.version_info.as_str(), "{now}");
    assert_eq!(now["nack"]["superseded"], false, "the NACK is current: {now}");

    let admin = format!("http://{}", gw.admin);
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "NACKED: {stderr}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("pilot-test") && l.contains("NACKED")),
        "{stdout}"
    );
    assert!(
        !stdout.contains("since fixed"),
        "a NACKED row's NACK is not since fixed: {stdout}"
    );

    let (_, index) = http_get_with(gw.admin, "/", "Accept: application/json\r\n").await;
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert_eq!(index["not_synced"][0]["status"], "NACKED", "{index}");
    assert_eq!(
        index["not_synced"][0]["nack"], "bad route",
        "the problem table says why: {index}"
    );

    // It ACKed a later response (the pinned one), so the cache going back
    // to the version it NACKed is a change like any other and is sent
    // (docs/protocols.md); once it ACKs that, the NACK is since fixed.
    let again = client.recv().await;
    assert_eq!(again.version_info, refused.version_info);
    client.ack(&again);
    crate::helpers::eventually_async("the NACK since fixed", || async {
        let now = row().await;
        now["status"] == "SYNCED" && now["nack"]["superseded"] == true
    })
    .await;
}

/// The rollout command prints 12 characters of each version and takes them
/// back (or any unique prefix of at least 8); a shorter one is refused with
/// the reason.
#[tokio::test]
async fn the_rollout_command_takes_the_versions_it_prints() {
    let (_galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    use crate::rollout::{push, vs};
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.example", 1.0)]).await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "b.example", 1.0)]).await;
    let admin = format!("http://{}", gw.admin);
    let (code, history, stderr) = subcommand("rollout", &["history", VS, "--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let shown: Vec<&str> = history
        .lines()
        .skip(1)
        .map(|l| l.trim_start_matches('*').split_whitespace().next().unwrap())
        .collect();
    assert_eq!(shown, [&v2[..12], &v1[..12]], "{history}");

    let (code, diff, stderr) = subcommand("rollout", &["diff", VS, "--to", &v2[..8], "--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        diff.starts_with(&format!("{VS} {} -> {}\n", &v1[..12], &v2[..12])) && diff.contains("~ a"),
        "{diff}"
    );

    let (code, pinned, stderr) = subcommand("rollout", &["pin", VS, shown[1], "--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        pinned.starts_with(&format!("PINNED {VS}: every client is served {}", &v1[..12])),
        "{pinned}"
    );
    let (code, _, stderr) = subcommand("rollout", &["pin", VS, &v1[..5], "--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("400") && stderr.contains("at least 8"), "{stderr}");
}

/// The config dump: each resource's metadata and its body read back, as
/// JSON or YAML: Envoy's types, Istio's kinds and Struct natively; a type
/// the gateway has no descriptor for as its size and a preview, saying so.
#[tokio::test]
async fn the_config_dump_reads_bodies_back() {
    let dir = tempfile::tempdir().unwrap();
    for example in ["examples/envoy/config", "examples/config"] {
        for entry in std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(example)).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    // A body of a type the gateway has no proto for (Mixer's handlers).
    std::fs::write(
        dir.path().join("handlers.yaml"),
        "collection: istio/policy/v1beta1/handlers\nname: ns/h\nbody:\n  type_url: type.googleapis.com/istio.policy.v1beta1.Handler\n  value_base64: CgNmb28=\n",
    )
    .unwrap();
    let gw = crate::helpers::start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let (status, head, yaml) = crate::helpers::http_exchange(
        gw.admin,
        "GET",
        "/debug/cache/envoy/config/cluster/v3/clusters?bodies=yaml",
        "",
    )
    .await;
    assert_eq!(status, 200, "{yaml}");
    // Read as the YAML it says it is, never sniffed into a page.
    assert!(head.contains("\r\nx-content-type-options: nosniff"), "{head}");
    let dump: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
    let cluster = &dump["resources"][0];
    assert_eq!(cluster["name"], "backend");
    assert_eq!(
        cluster["type_url"],
        "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    );
    assert_eq!(cluster["body"]["connectTimeout"], "1s", "{yaml}");
    assert_eq!(cluster["body"]["type"], "EDS", "{yaml}");
    assert!(
        cluster["create_time"].is_null() && cluster["content_version"].is_string(),
        "{yaml}"
    );

    let vs = json(gw.admin, &format!("/debug/cache/{VS}?bodies=json")).await;
    let ratings = vs["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "bookinfo/ratings")
        .unwrap();
    assert_eq!(
        ratings["body"]["hosts"],
        serde_json::json!(["ratings"]),
        "an Istio body, decoded by its proto: {ratings}"
    );
    let gateways = json(gw.admin, &format!("/debug/cache/{GW}?bodies=json")).await;
    assert_eq!(
        gateways["resources"][0]["body"]["selector"]["istio"], "ingressgateway",
        "{gateways}"
    );

    let handlers = json(gw.admin, "/debug/cache/istio/policy/v1beta1/handlers?bodies=json").await;
    let body = &handlers["resources"][0]["body"];
    // A type the gateway has no descriptor for: what it holds cannot be
    // told, so none of its bytes are shown.
    assert!(
        body["bytes"].as_u64().unwrap() > 0 && body.get("preview_base64").is_none(),
        "{body}"
    );
    assert!(
        body["not_decoded"].as_str().unwrap().contains("--descriptors"),
        "{body}"
    );

    let (status, said) = http_get(gw.admin, &format!("/debug/cache/{VS}?bodies=xml")).await;
    assert_eq!(status, 400);
    assert!(said.contains("bodies=json or bodies=yaml"), "{said}");
}

/// The `client` command follows a rollout: when the gateway goes away it
/// says so on stderr and reconnects, an incremental stream resuming from
/// what it holds; and `--output yaml` prints the resources with their bodies.
#[tokio::test]
async fn the_client_command_reconnects_and_resumes() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    let vs = |host: &str| format!("collection: {VS}\nname: ns/a\nbody:\n  struct: {{hosts: [{host}]}}\n");
    std::fs::write(dir.path().join("vs.yaml"), vs("a")).unwrap();
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = crate::helpers::start_gateway(&["--source-dir", &dir_flag]).await;
    let listen = gw.listen.to_string();
    let mut client = Command::new(BIN)
        .args([
            "client",
            "--target",
            &listen,
            "--type-url",
            VS,
            "--incremental",
            "--output",
            "yaml",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(client.stdout.take().unwrap()).lines();
    let mut stderr = tokio::io::BufReader::new(client.stderr.take().unwrap()).lines();
    async fn line_with<R: tokio::io::AsyncBufRead + Unpin>(lines: &mut tokio::io::Lines<R>, text: &str) -> String {
        within(text, async {
            loop {
                let line = lines.next_line().await.unwrap().expect("the client is running");
                if line.contains(text) {
                    return line;
                }
            }
        })
        .await
    }
    line_with(&mut stdout, "- name: ns/a").await;
    line_with(&mut stdout, "hosts:").await;

    // The gateway restarts on the same port with a change.
    assert!(gw.shutdown().await);
    line_with(&mut stderr, "reconnecting in").await;
    std::fs::write(dir.path().join("vs.yaml"), vs("b")).unwrap();
    let _again = crate::helpers::start_gateway_on(&listen, &["--source-dir", &dir_flag]).await;
    line_with(&mut stderr, "resuming with the 1 resources held").await;
    line_with(&mut stdout, "- b").await;
    client.kill().await.unwrap();
}

/// `status` for scripts: `-o json` is `/debug/syncz` (the same rows), `-o
/// yaml` the same as YAML, `-o wide` each type's sent, ACKed and current
/// versions; a NACKing client makes it (and `rollout status`) exit 1, first
/// saying why; once the client ACKs past it, 0.
#[tokio::test]
async fn status_for_scripts_json_yaml_wide_and_exit_codes() {
    let Nacked {
        _galley,
        gw,
        mut upstream,
        mut client,
        first,
        refused,
    } = Nacked::start().await;
    let admin = format!("http://{}", gw.admin);
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin, "-o", "json"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.starts_with("NOT SYNCED: 1 of 1 client types (1 NACKED)"),
        "{stderr}"
    );
    let printed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let served = json(gw.admin, "/debug/syncz").await;
    let key = |v: &serde_json::Value| -> Vec<String> {
        v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{} {} {} {} {} {} {}",
                    r["stream"],
                    r["node_id"],
                    r["collection"],
                    r["status"],
                    r["sent"]["version"],
                    r["acked"]["version"],
                    r["current_version"]
                )
            })
            .collect()
    };
    assert_eq!(key(&printed), key(&served));
    assert_eq!(printed["source"], served["source"]);
    assert_eq!(printed["source"]["healthy"], true, "{printed}");
    let (code, yaml, _) = subcommand("status", &["--admin", &admin, "--output", "yaml"]).await;
    assert_eq!(code, Some(1));
    let from_yaml: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
    assert_eq!(key(&from_yaml), key(&served));
    let (code, wide, _) = subcommand("status", &["--admin", &admin, "-o", "wide"]).await;
    assert_eq!(code, Some(1));
    let lines: Vec<&str> = wide.lines().collect();
    assert!(lines[0].starts_with("NOT SYNCED: "), "{wide}");
    assert!(
        lines[1].starts_with("NODE") && lines[1].contains("SENT") && lines[1].ends_with("CURRENT"),
        "{wide}"
    );
    let row: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        row[3..],
        [
            VS,
            "NACKED",
            &refused.version_info[..12],
            &first.version_info[..12],
            &refused.version_info[..12]
        ],
        "{wide}"
    );
    let (code, rollout, stderr) = subcommand("rollout", &["status", "--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(rollout.starts_with("NOT SYNCED: 1 of 1"), "{rollout}");
    let (code, rollout, _) = subcommand("rollout", &["status", VS, "--admin", &admin, "-o", "json"]).await;
    assert_eq!(code, Some(1));
    let rollout: serde_json::Value = serde_json::from_str(&rollout).unwrap();
    assert_eq!(rollout["rollout"]["collections"][0]["collection"], VS, "{rollout}");
    assert_eq!(rollout["rollout"]["api_version"], 2, "{rollout}");
    // `status -o json` has the same shape (the collections that need an eye).
    let (_, status, _) = subcommand("status", &["--admin", &admin, "-o", "json"]).await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let keys = |v: &serde_json::Value| -> Vec<String> {
        v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
    };
    assert_eq!(
        keys(&status["rollout"]),
        keys(&rollout["rollout"]),
        "{status}\n{rollout}"
    );
    assert_eq!(status["rollout"]["canaries"], rollout["rollout"]["canaries"]);
    assert_eq!(rollout["rows"][0]["status"], "NACKED", "{rollout}");

    upstream.push_full(VS, vec![resource("a", "3", b"good")]).await;
    let fixed = client.recv().await;
    client.ack(&fixed);
    crate::helpers::eventually_async("the client SYNCED", || async {
        first_row(gw.admin).await["status"] == "SYNCED"
    })
    .await;
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("NODE"), "{stdout}");
    let (code, stdout, stderr) = subcommand("rollout", &["status", "--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
}

/// A port that is not the gateway's admin port: exit 2, saying so and
/// which port to give (the monitoring port answers 404, the gRPC port does
/// not speak HTTP/1.1).
#[tokio::test]
async fn status_on_a_port_that_is_not_the_admin_port_exits_2_saying_so() {
    let gw = crate::helpers::start_gateway(&[]).await;
    for (port, says) in [
        (gw.monitoring, "not the gateway's admin port (the monitoring port"),
        (gw.listen, "not the gateway's admin port (the gRPC port"),
    ] {
        let (code, stdout, stderr) = subcommand("status", &["--admin", &port.to_string()]).await;
        assert_eq!(code, Some(2), "{stdout}{stderr}");
        assert!(stderr.contains(says) && stderr.contains("--admin-listen"), "{stderr}");
        let (code, _, stderr) = subcommand("rollout", &["status", "--admin", &port.to_string()]).await;
        assert_eq!(code, Some(2), "{stderr}");
    }
}

/// A client of VS that ACKed it, shown SYNCED, and `status` exiting 0.
async fn synced_and_status_0(gw: &mcp_xds_gateway::app::Bound) -> SotwClient {
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    client.ack(&response);
    crate::helpers::eventually_async("the client SYNCED", || async {
        first_row(gw.admin).await["status"] == "SYNCED"
    })
    .await;
    let (code, _, stderr) = subcommand("status", &["--admin", &gw.admin.to_string()]).await;
    assert_eq!(code, Some(0), "{stderr}");
    client
}

/// A file that breaks while the gateway runs: it keeps serving the file's
/// last good state (ready, gRPC health SERVING, every client SYNCED), and
/// the index, `/debug/syncz` and `status` lead with it; `status` exits 1.
#[tokio::test]
async fn a_file_broken_at_run_time_is_shown_where_operators_look() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let dir = tempfile::tempdir().unwrap();
    let good = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: a, namespace: ns}\n\
                spec:\n  hosts: [a]\n";
    let file = dir.path().join("vs.yaml");
    std::fs::write(&file, good).unwrap();
    let gw = crate::helpers::start_gateway(&["--source-dir", dir.path().to_str().unwrap(), "--collections", VS]).await;
    let client = synced_and_status_0(&gw).await;
    let admin = gw.admin.to_string();

    std::fs::write(&file, good.replace("hosts: [a]", "hosts: [a]\n  htp: []")).unwrap();
    let source = crate::helpers::eventually_some("the broken file in /debug/syncz", || async {
        let syncz = json(gw.admin, "/debug/syncz").await;
        (syncz["source"]["healthy"] == false).then(|| syncz["source"]["problems"][0].clone())
    })
    .await;
    let shown = format!("{}:6: spec.htp: unrecognized field name 'htp'", file.display());
    let lead = "SOURCE: 1 file does not parse, serving their last good state: ";
    assert!(
        source
            .as_str()
            .is_some_and(|s| s.starts_with(lead) && s.contains(&shown)),
        "{source}"
    );
    // status: the first line, exit 1; the client is still SYNCED.
    let (code, stdout, _) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stdout}");
    assert!(
        stdout.starts_with(lead) && stdout.lines().next().unwrap().contains(&shown),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.contains("SYNCED")), "{stdout}");
    // The index leads with it, before the clients (none out of sync).
    let (_, index) = http_get_with(gw.admin, "/", "Accept: text/html\r\n").await;
    let at = index.find("SOURCE: 1 file does not parse").expect(&index);
    assert!(at < index.find("Clients not in sync").unwrap(), "{index}");
    let (_, index) = http_get_with(gw.admin, "/", "Accept: application/json\r\n").await;
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert_eq!(index["source"]["healthy"], false, "{index}");
    assert_eq!(index["ready"], true, "{index}");
    // Still ready, still SERVING: clients are served the last good state.
    let (ready, _) = http_get(gw.monitoring, "/readyz").await;
    assert_eq!(ready, 200);
    let mut health = HealthClient::new(channel(gw.listen).await);
    let serving = within(
        "a health check",
        health.check(HealthCheckRequest { service: String::new() }),
    )
    .await
    .unwrap()
    .into_inner()
    .status;
    assert_eq!(serving, ServingStatus::Serving as i32);

    // Fixed: healthy again, exit 0.
    std::fs::write(&file, good).unwrap();
    crate::helpers::eventually_async("the source healthy again", || async {
        json(gw.admin, "/debug/syncz").await["source"]["healthy"] == true
    })
    .await;
    let (code, stdout, _) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stdout}");
    drop(client);
}

/// `client --protocol xds-delta --names`: what it prints is what a delta
/// ADS stream of the same subscription receives (names, versions, bodies,
/// removals), and `--once` exits only after the gateway read its ACKs (the
/// gateway's own count, in a process of its own). `xds-sotw` reads istiod's
/// MCP over xDS by GVK.
#[tokio::test]
async fn the_client_speaks_envoys_ads_by_name_as_envoy_does() {
    use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
    use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse};
    const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
    const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    const ROUTES: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/envoy/config");
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", examples]).await;
    let target = gw.listen.to_string();
    // Each type by name, as Envoy asks for endpoints and routes.
    let names = [(CLA, "backend"), (ROUTES, "local_route")];
    let (cla_names, route_names) = (format!("{CLA}=backend"), format!("{ROUTES}=local_route"));
    let args = [
        "--target",
        &target,
        "--protocol",
        "xds-delta",
        "--type-url",
        CLA,
        "--type-url",
        ROUTES,
        "--names",
        &cla_names,
        "--names",
        &route_names,
        "--once",
    ];
    let (code, stdout, stderr) = client_command(&[&args[..], &["--output", "json"]].concat()).await;
    assert_eq!(code, Some(0), "{stderr}");
    let printed: std::collections::BTreeMap<String, serde_json::Value> = stdout
        .lines()
        .map(|l| {
            let update: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            (update["type_url"].as_str().unwrap().to_owned(), update)
        })
        .collect();
    assert_eq!(printed.len(), 2, "{stdout}");
    // Its ACKs were read before it exited: one per type.
    let (_, metrics) = http_get(gw.admin, "/metrics").await;
    for collection in [
        "envoy/config/endpoint/v3/clusterloadassignments",
        "envoy/config/route/v3/routeconfigurations",
    ] {
        let acked = format!("istio_mcp_request_acks_total{{component=\"downstream\",collection=\"{collection}\"}} 1");
        assert!(metrics.lines().any(|l| l == acked), "{acked} in\n{metrics}");
    }
    // What a delta stream of the same subscription receives.
    let mut delta = crate::helpers::clients::Bidi::<DeltaDiscoveryRequest, DeltaDiscoveryResponse>::open_on(
        channel(gw.listen).await,
        DELTA,
    )
    .await;
    for (type_url, name) in names {
        delta.send(DeltaDiscoveryRequest {
            node: Some(Node {
                id: "envoy-1".into(),
                ..Default::default()
            }),
            type_url: type_url.into(),
            resource_names_subscribe: vec![name.into()],
            ..Default::default()
        });
    }
    let decoder = mcp_xds_gateway::source::proto_json::BodyDecoder::new(None).unwrap();
    for _ in 0..2 {
        let response = delta.recv().await;
        let shown = &printed[&response.type_url];
        assert_eq!(shown["version"], response.system_version_info.as_str());
        assert_eq!(shown["removed"], serde_json::json!(response.removed_resources));
        let received: Vec<serde_json::Value> = response
            .resources
            .iter()
            .map(|r| {
                let any = r.resource.clone().unwrap();
                serde_json::json!({
                    "name": r.name, "version": r.version, "type_url": any.type_url,
                    "body": decoder.decode(&any.type_url, &any.value).unwrap(),
                })
            })
            .collect();
        let resources: Vec<serde_json::Value> = shown["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| serde_json::json!({"name": r["name"], "version": r["version"], "type_url": r["type_url"], "body": r["body"]}))
            .collect();
        assert_eq!(resources, received, "{stdout}");
        assert_eq!(received.len(), 1, "one named resource of each type");
        // ACKed, as Envoy does: the routes go once the endpoints they may
        // send to are ACKed (make before break).
        delta.send(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        });
    }
    // The text form: the update line, each resource and its body.
    let (code, text, stderr) = client_command(&[&args[..], &["--show", "bodies"]].concat()).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("  backend version=") && l.ends_with(CLA))
            && text
                .lines()
                .any(|l| l.trim_start().starts_with("{\"clusterName\":\"backend\"")),
        "{text}"
    );

    // istiod's MCP over xDS, state of the world, by GVK.
    let istio =
        crate::helpers::start_gateway(&["--source-dir", concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config")]).await;
    let target = istio.listen.to_string();
    let (code, text, stderr) = client_command(&[
        "--target",
        &target,
        "--protocol",
        "xds-sotw",
        "--type-url",
        "networking.istio.io/v1/VirtualService",
        "--once",
        "--show",
        "resources",
    ])
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("networking.istio.io/v1/VirtualService version="),
        "{text}"
    );
    let mut resources: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    resources.sort_unstable();
    assert_eq!(resources, ["bookinfo/ratings", "bookinfo/reviews"], "{text}");
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.ends_with("body=type.googleapis.com/istio.networking.v1alpha3.VirtualService")),
        "MCP over xDS: each an istio.mcp.v1alpha1.Resource read back: {text}"
    );
    // State of the world shows each resource at its version: the
    // Resource's own in MCP over xDS.
    assert!(
        lines[1..].iter().all(|l| !l.contains(" version= ")),
        "every resource has a version: {text}"
    );
    // Names are an xDS notion: a usage error.
    let (code, _, stderr) = client_command(&["--target", &target, "--type-url", VS, "--names", "a", "--once"]).await;
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("--names needs --protocol xds-sotw or xds-delta"),
        "{stderr}"
    );
}

/// Envoy's usual subscription in one run (clusters wildcard, routes by
/// name), what it removes in the summary and the names, each resource's
/// version in state of the world, and a mistyped type URL refused with the
/// closest known one.
#[tokio::test]
async fn the_client_mimics_envoys_subscriptions_and_refuses_unknown_types() {
    const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const ROUTES: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/envoy/config");
    let gw = crate::helpers::start_gateway(&["--source-dir", examples]).await;
    let target = gw.listen.to_string();
    let routes = format!("{ROUTES}=local_route,no_such_route");
    let run = |protocol: &'static str, output: &'static str| {
        let args = [
            "--target",
            &target,
            "--protocol",
            protocol,
            "--type-url",
            CDS,
            "--type-url",
            ROUTES,
            "--names",
            &routes,
            "--once",
            "-o",
            output,
        ]
        .map(str::to_owned);
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            client_command(&args).await
        }
    };

    let (code, text, stderr) = run("xds-delta", "names").await;
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<&str> = text.lines().collect();
    let cds = lines.iter().position(|l| l.starts_with(CDS)).expect(&text);
    let rds = lines.iter().position(|l| l.starts_with(ROUTES)).expect(&text);
    // Clusters: the wildcard, nothing removed.
    assert!(lines[cds].ends_with("removed=0"), "{text}");
    assert!(
        lines[cds + 1..]
            .iter()
            .take_while(|l| l.starts_with("  "))
            .any(|l| *l == "  backend"),
        "{text}"
    );
    // Routes by name: the one that exists, the one that does not removed,
    // counted and listed.
    assert!(lines[rds].contains("resources=1 added=1 changed=0 removed=1"), "{text}");
    let listed: Vec<&str> = lines[rds + 1..]
        .iter()
        .take_while(|l| l.starts_with("  "))
        .copied()
        .collect();
    assert_eq!(listed, ["  local_route", "  no_such_route removed"], "{text}");

    let (code, json, stderr) = run("xds-sotw", "json").await;
    assert_eq!(code, Some(0), "{stderr}");
    for line in json.lines() {
        let update: serde_json::Value = serde_json::from_str(line).unwrap();
        let version = update["version"].as_str().unwrap();
        assert!(!version.is_empty(), "{line}");
        for resource in update["resources"].as_array().unwrap() {
            assert_eq!(
                resource["version"], version,
                "plain xDS: the response's version: {line}"
            );
        }
        if update["type_url"] == ROUTES {
            let names: Vec<&str> = update["resources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["name"].as_str().unwrap())
                .collect();
            assert_eq!(names, ["local_route"], "{line}");
        }
    }

    let typo = "type.googleapis.com/envoy.config.cluster.v3.Clustr";
    let (code, stdout, stderr) = client_command(&[
        "--target",
        &target,
        "--protocol",
        "xds-delta",
        "--type-url",
        typo,
        "--once",
    ])
    .await;
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains(&format!("--type-url {typo}")) && stderr.contains(&format!("did you mean {CDS}?")),
        "{stderr}"
    );
    // Plain names with several types cannot be placed.
    let (code, _, stderr) = client_command(&[
        "--target",
        &target,
        "--protocol",
        "xds-sotw",
        "--type-url",
        CDS,
        "--type-url",
        ROUTES,
        "--names",
        "local_route",
        "--once",
    ])
    .await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--names TYPE=A,B"), "{stderr}");
}

/// The NACK warning says who NACKed: the stream, its node and its peer, and
/// the message (one line, however it ends).
#[tokio::test]
async fn the_nack_warning_names_the_node_and_the_peer() {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config");
    let mut gw = crate::helpers::spawn_gateway(None, &["--source-dir", examples]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let response = client.recv_type(VS).await;
    client.nack(&response, "", "a route to nowhere\n");
    let line = gw.log_line("client NACKed a version").await;
    assert!(line.contains("node=\"pilot-test\""), "{line}");
    assert!(line.contains("peer=\"127.0.0.1:"), "{line}");
    assert!(line.contains("a route to nowhere"), "{line}");
}

/// An upstream that goes away once the gateway holds its state: clients
/// are still served (ready, SYNCED), and `status` leads with the
/// disconnected upstream and exits 1, as the index and `/debug/syncz` do.
#[tokio::test]
async fn a_disconnected_upstream_is_shown_where_operators_look() {
    let (galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let _client = synced_and_status_0(&gw).await;
    let admin = gw.admin.to_string();

    galley.stop().await;
    drop(upstream);
    let problem = crate::helpers::eventually_some("the disconnected upstream in /debug/syncz", || async {
        let syncz = json(gw.admin, "/debug/syncz").await;
        syncz["source"]["problems"][0].as_str().map(str::to_owned)
    })
    .await;
    assert!(
        problem.starts_with("SOURCE: the upstream ") && problem.contains(" is disconnected since "),
        "{problem}"
    );
    let (code, stdout, _) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.starts_with("SOURCE: the upstream "), "{stdout}");
    let (_, index) = http_get_with(gw.admin, "/", "Accept: application/json\r\n").await;
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert_eq!(
        (index["source"]["healthy"].clone(), index["ready"].clone()),
        (false.into(), true.into()),
        "{index}"
    );
}

/// A file broken at run time is logged with its path, the line and the
/// reason, and keeps its last good state; `mcp_gateway_source_files_broken`
/// counts it. The gateway is a process of its own: the gauge is set from
/// this gateway's state alone, and its log is this test's.
#[tokio::test]
async fn a_file_broken_at_run_time_is_logged_with_its_path_line_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let doc = |generation: u32| {
        format!(
            "collection: {VS}\nname: ns/a\nversion: \"{generation}\"\nbody:\n  struct: {{generation: {generation}}}\n"
        )
    };
    let file = dir.path().join("vs.yaml");
    // Each version whole at once: a half-written file would be an error
    // (and a log line) of its own.
    let write = |text: String| crate::helpers::write_whole(dir.path(), "vs.yaml", text.as_bytes());
    write(doc(1));
    let source = dir.path().to_str().unwrap().to_owned();
    let mut gw = crate::helpers::spawn_gateway(None, &["--source-dir", &source, "--collections", VS]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    assert_eq!(
        crate::limits::metric(gw.monitoring, "mcp_gateway_source_files_broken ").await,
        0
    );

    // A typo on line 4 (the `body` key).
    write(doc(2).replace("body:", "bodee:"));
    let line = gw.log_line("a source file does not parse").await;
    assert!(line.contains("its collections keep their last good state"), "{line}");
    assert!(
        line.contains(&format!("{}:4:", file.display())),
        "the path and the line: {line}"
    );
    assert!(line.contains("unknown field `bodee`"), "the reason: {line}");
    crate::limits::metric_is(gw.monitoring, "mcp_gateway_source_files_broken ", 1).await;

    // Fixed: logged, no longer counted, and the fix is what is served.
    write(doc(3));
    let line = gw.log_line("a source file parses again").await;
    assert!(line.contains(&file.display().to_string()), "{line}");
    crate::limits::metric_is(gw.monitoring, "mcp_gateway_source_files_broken ", 0).await;
    let fixed = client.recv_type(VS).await;
    assert_eq!(fixed.resources[0].metadata.as_ref().unwrap().version, "3");
}

/// The files source's log lines say which file, and at start a broken file
/// has no last good state to keep.
#[tokio::test]
async fn the_files_sources_log_names_the_file_and_what_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let good =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config/networking.yaml")).unwrap();
    let file = dir.path().join("networking.yaml");
    std::fs::write(&file, "kind: [\n").unwrap();
    std::fs::write(dir.path().join("other.yaml"), good.replace("bookinfo", "other")).unwrap();
    let mut gw = crate::helpers::spawn_gateway(None, &["--source-dir", dir.path().to_str().unwrap()]).await;
    // Logged at start, before the gateway listens.
    let line = gw
        .log
        .iter()
        .find(|l| l.contains("a source file does not parse"))
        .cloned()
        .unwrap_or_else(|| panic!("no line about the broken file: {:?}", gw.log));
    assert!(line.contains("not served until it does"), "{line}");
    assert!(line.contains("networking.yaml"), "{line}");
    std::fs::write(&file, &good).unwrap();
    let line = gw.log_line("a source file parses again").await;
    assert!(line.contains("networking.yaml"), "names the file: {line}");
}

/// What a client writes (its node id, its NACK's message) reaches the
/// terminal escaped: `status`, `status -o wide` and `rollout status` print
/// no control character but their own line ends, and a client's `\n` forges
/// no line of theirs.
#[tokio::test]
async fn the_tools_print_what_clients_write_escaped() {
    use crate::canary::request_as;

    let (_galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(gw.listen).await;
    let node = "evil\x1b[2J\x1b]0;owned\x07\nNACK forged-node";
    client.send(request_as(node, VS, "", "", None));
    let first = client.recv().await;
    client.send(request_as(node, VS, &first.version_info, &first.nonce, None));
    upstream.push_full(VS, vec![resource("a", "2", b"bad")]).await;
    let refused = client.recv().await;
    client.send(request_as(
        node,
        VS,
        &first.version_info,
        &refused.nonce,
        Some("bad \x1b[31mred\x1b[0m\r\nNACK forged-node: all is well\u{202e}"),
    ));
    // The version an xDS client says it holds is its own text too (the
    // ACKED column of `-o wide`: the sixth check of issue 42).
    use mcp_xds_gateway::proto::envoy::service::discovery::v3::DiscoveryRequest;
    let hostile = "\x1b[2J\u{9b}\u{202e}VV";
    let gvk = "networking.istio.io/v1alpha3/VirtualService";
    let mut ads = crate::xds::SotwStream::open(gw.listen, crate::xds::SOTW).await;
    ads.send(DiscoveryRequest {
        type_url: gvk.into(),
        version_info: hostile.into(),
        node: crate::xds::istiod_node(),
        ..Default::default()
    });
    let served = ads.recv().await;
    ads.send(DiscoveryRequest {
        type_url: gvk.into(),
        version_info: hostile.into(),
        response_nonce: served.nonce.clone(),
        node: crate::xds::istiod_node(),
        error_detail: Some(tonic_types::Status {
            code: 3,
            message: "no".into(),
            details: Vec::new(),
        }),
        ..Default::default()
    });
    crate::helpers::eventually_async("both NACKs in the view", || async {
        let rows = json(gw.admin, "/debug/syncz").await["rows"].clone();
        rows.as_array()
            .is_some_and(|rows| rows.iter().filter(|r| r["status"] == "NACKED").count() == 2)
    })
    .await;
    let admin = format!("http://{}", gw.admin);
    for args in [
        vec!["status", "--admin", &admin],
        vec!["status", "--admin", &admin, "-o", "wide"],
        vec!["rollout", "status", "--admin", &admin],
        vec!["rollout", "status", "--admin", &admin, "-o", "wide"],
    ] {
        let (code, stdout, stderr) = subcommand(args[0], &args[1..]).await;
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        for (stream, text) in [("stdout", &stdout), ("stderr", &stderr)] {
            let raw: Vec<char> = text
                .chars()
                .filter(|c| (c.is_control() && *c != '\n') || *c == '\u{202e}')
                .collect();
            assert!(raw.is_empty(), "{args:?} {stream} prints {raw:?}:\n{text}");
            assert!(
                !text.lines().any(|l| l.starts_with("NACK forged-node")),
                "{args:?}: a client's newline forged a line:\n{text}"
            );
        }
        if args[0] == "status" && args.len() == 3 {
            assert!(
                stdout.contains("NACK evil\\x1b[2J\\x1b]0;owned\\x07\\nNACK forged-node")
                    && stdout.contains("bad \\x1b[31mred\\x1b[0m\\r\\nNACK forged-node: all is well\\u{202e}"),
                "{stdout}"
            );
        }
    }
}

/// Issue 42's re-check: a node id and a NACK's message (what a client
/// writes) and a resource's name and label (what a source writes) holding
/// ESC, a C1 CSI (`U+009B`), a bidi override (`U+202E`) and isolate
/// (`U+2066`) reach none of the outputs raw: the `--log-format json` log,
/// every admin JSON, YAML and HTML view, and the tools' `-o yaml` and
/// `-o json`. Where the output is JSON or YAML, a parser reads back the text
/// that was sent; an HTML page shows the escape (`\u{202e}`).
#[tokio::test]
async fn what_clients_and_sources_write_reaches_no_output_raw() {
    use crate::canary::request_as;
    const NODE: &str = "evil-\x1b[31m\u{9b}2J\u{202e}exe.txt\u{2066}node\u{2069}";
    const NACK: &str = "bad \x1b]0;owned\x07\u{9b}31m\u{202e}all is well\u{2066}";
    const NAME: &str = "cfg-\u{202e}txt\u{2066}\u{9b}";
    const LABEL: &str = "team-\x1b[2J\u{9b}\u{202e}\u{2066}";
    // A line end alone: in YAML too it is an escape, no line of its own.
    const LINES: &str = "cfg-lf\nFORGED SYNCED";
    let forged = |text: &str| text.lines().any(|l| l.trim_start().starts_with("FORGED"));
    fn raw(text: &str) -> Vec<char> {
        text.chars()
            .filter(|&c| {
                (c.is_control() && c != '\n')
                    || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
            })
            .collect()
    }
    /// Every string of a JSON value (keys too).
    fn strings(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
            serde_json::Value::Object(map) => map.iter().for_each(|(k, v)| {
                out.push(k.clone());
                strings(v, out);
            }),
            _ => {}
        }
    }
    let holds = |value: &serde_json::Value, text: &str| {
        let mut all = Vec::new();
        strings(value, &mut all);
        all.iter().any(|s| s.contains(text))
    };
    let hostile_resource = |version: &str| {
        let mut r = resource(NAME, version, version.as_bytes());
        r.metadata.as_mut().unwrap().labels.insert("team".into(), LABEL.into());
        r
    };

    let mut galley = FakeGalley::start().await;
    let mut gw = crate::helpers::gateway_process_for(
        &galley,
        &[VS],
        &["--log-format", "json", "--canary", "evil-*", "--canary-trust-node-ids"],
    )
    .await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream
        .push_full(VS, vec![hostile_resource("1"), resource(LINES, "1", b"1")])
        .await;
    let mut client = sotw(gw.listen).await;
    client.send(request_as(NODE, VS, "", "", None));
    let first = client.recv_type(VS).await;
    client.send(request_as(NODE, VS, &first.version_info, &first.nonce, None));
    upstream
        .push_full(VS, vec![hostile_resource("2"), resource(LINES, "1", b"1")])
        .await;
    let offered = client.recv_type(VS).await;
    assert_ne!(offered.version_info, first.version_info);
    client.send(request_as(NODE, VS, &first.version_info, &offered.nonce, Some(NACK)));
    crate::helpers::eventually_async("the canary's NACK to hold the version", || async {
        json(gw.admin, "/debug/rollout").await.to_string().contains("HELD")
    })
    .await;

    // The admin port's JSON views: valid JSON, nothing raw, the text read back.
    let admin = gw.admin;
    let views = [
        "/debug/clients".to_owned(),
        "/debug/syncz".to_owned(),
        "/debug/rollout".to_owned(),
        format!("/debug/rollout/{VS}"),
        "/debug/cache".to_owned(),
        format!("/debug/cache/{VS}"),
        format!("/debug/cache/{VS}?bodies=json"),
        format!("/debug/history/{VS}"),
        "/debug/upstream".to_owned(),
        "/debug/config".to_owned(),
        "/debug/skew".to_owned(),
    ];
    for path in &views {
        let (code, body) = http_get(admin, path).await;
        assert_eq!(code, 200, "{path}: {body}");
        assert_eq!(raw(&body), Vec::<char>::new(), "{path} prints raw: {body}");
        let value: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} is not JSON ({e}): {body}"));
        for (view, texts) in [
            ("/debug/clients", &[NODE][..]),
            ("/debug/syncz", &[NODE, NACK]),
            ("/debug/rollout", &[NODE, NACK]),
            (&format!("/debug/cache/{VS}?bodies=json") as &str, &[NAME, LABEL]),
        ] {
            if path == view {
                for text in texts {
                    assert!(holds(&value, text), "{path} reads back {text:?}: {value}");
                }
            }
        }
    }
    // The YAML views: valid YAML, nothing raw, the text read back.
    for path in [format!("/debug/cache/{VS}?bodies=yaml")] {
        let (code, body) = http_get(admin, &path).await;
        assert_eq!(code, 200, "{path}: {body}");
        assert_eq!(raw(&body), Vec::<char>::new(), "{path} prints raw: {body}");
        let value: serde_json::Value =
            serde_norway::from_str(&body).unwrap_or_else(|e| panic!("{path} is not YAML ({e}): {body}"));
        assert!(holds(&value, NAME) && holds(&value, LABEL), "{path}: {value}");
        assert!(holds(&value, LINES) && !forged(&body), "{path}: {body}");
    }
    // The HTML pages: nothing raw; the escape shown.
    for path in views.iter().chain([&"/".to_owned()]) {
        let (code, page) = http_get_with(admin, path, "Accept: text/html\r\n").await;
        assert_eq!(code, 200, "{path}: {page}");
        assert_eq!(raw(&page), Vec::<char>::new(), "{path} shows raw: {page}");
    }
    let (_, syncz_page) = http_get_with(admin, "/debug/syncz", "Accept: text/html\r\n").await;
    assert!(
        syncz_page.contains("evil-\\x1b[31m\\u{9b}2J\\u{202e}exe.txt"),
        "{syncz_page}"
    );

    // The tools' -o yaml and -o json.
    let admin_url = format!("http://{admin}");
    let target = gw.listen.to_string();
    let mut runs = Vec::new();
    for output in ["yaml", "json"] {
        runs.push((vec!["status", "--admin", &admin_url, "-o", output], &[NODE, NACK][..]));
        runs.push((
            vec!["rollout", "status", "--admin", &admin_url, "-o", output],
            &[NODE, NACK][..],
        ));
        let client = vec![
            "client",
            "--target",
            &target,
            "--type-url",
            VS,
            "--once",
            "--output",
            output,
        ];
        runs.push((client, &[NAME, LABEL, LINES][..]));
    }
    for (args, texts) in runs {
        let (_, stdout, stderr) = subcommand(args[0], &args[1..]).await;
        assert_eq!(raw(&stdout), Vec::<char>::new(), "{args:?} prints raw: {stdout}");
        assert_eq!(raw(&stderr), Vec::<char>::new(), "{args:?} prints raw: {stderr}");
        assert!(
            !forged(&stdout) && !forged(&stderr),
            "{args:?} starts a line: {stdout}{stderr}"
        );
        // The document: the client's YAML starts with `---`, its JSON is a
        // line; the others' verdict lines follow the document on stderr.
        let value: serde_json::Value = if args.last() == Some(&"yaml") {
            let documents: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&stdout)
                .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}")))
                .collect();
            serde_json::Value::Array(documents)
        } else {
            let documents: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&stdout)
                .into_iter()
                .map(|d| d.unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}")))
                .collect();
            serde_json::Value::Array(documents)
        };
        for text in texts {
            assert!(holds(&value, text), "{args:?} reads back {text:?}: {value}");
        }
    }

    // The JSON log: every line JSON, nothing raw, the node id read back.
    drop(client);
    let lines = gw.lines_until("client left").await;
    let mut node_logged = false;
    for line in &lines {
        assert_eq!(raw(line), Vec::<char>::new(), "a log line prints raw: {line}");
        let entry: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        node_logged |= entry["node"] == NODE;
    }
    assert!(node_logged, "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.contains("\\u202e")),
        "the override is written as JSON's escape: {lines:#?}"
    );
}

/// What a source writes reaches no output raw (issue 42's re-check): a
/// resource name with a line feed in `rollout diff --bodies`' unified-diff
/// header (it forged a line), and a file whose name holds ESC, CR and a line
/// feed in the text log's "does not parse" line (it forged a log line).
#[tokio::test]
async fn a_source_written_name_forges_no_line() {
    let (_galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    use crate::rollout::{push, vs};
    let name = "a\nFAKE LINE";
    push(&mut upstream, &gw, vec![vs(name, "1", "a.example", 1.0)]).await;
    let v2 = push(&mut upstream, &gw, vec![vs(name, "2", "b.example", 1.0)]).await;
    let admin = format!("http://{}", gw.admin);
    let (code, diff, stderr) = subcommand(
        "rollout",
        &["diff", VS, "--to", &v2[..8], "--bodies", "--admin", &admin],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(diff.contains("--- a\\nFAKE LINE@"), "{diff}");
    assert!(!diff.lines().any(|l| l.starts_with("FAKE")), "{diff}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.yaml"), "# nothing\n").unwrap();
    let mut files = crate::helpers::spawn_gateway(None, &["--source-dir", dir.path().to_str().unwrap()]).await;
    std::fs::write(dir.path().join("x\u{1b}[31m\r\nFAKE.yaml"), "kind: [\n").unwrap();
    let line = files.log_line("a source file does not parse").await;
    assert!(!line.contains('\u{1b}') && !line.contains('\r'), "{line:?}");
    assert!(line.contains("x\\x1b[31m\\r\\nFAKE.yaml"), "{line:?}");

    // A file that does not parse at start: the admin port's /readyz (plain
    // text, read with curl) names it escaped.
    let broken = tempfile::tempdir().unwrap();
    std::fs::write(broken.path().join("f\u{1b}]0;TITLE\u{7}.yaml"), "kind: [\n").unwrap();
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", broken.path().to_str().unwrap()]).await;
    let (status, text) = http_get(gw.admin, "/readyz").await;
    assert_eq!(status, 503, "{text}");
    assert!(!text.contains('\u{1b}') && !text.contains('\u{7}'), "{text:?}");
    assert!(text.contains("f\\x1b]0;TITLE\\x07.yaml"), "{text:?}");
}
