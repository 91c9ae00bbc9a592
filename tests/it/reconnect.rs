//! Reconnect sends what changed (issue 41): an xDS client that comes back to
//! a restarted gateway (or moves to another replica of the same source)
//! reporting what it holds is sent only what differs, except what a response
//! it NACKed carried and the load assignments of the clusters sent on the
//! stream. Gateways run as processes of their own (`--source-dir` and
//! `--cache-dir`), so their metrics are their own; the clients speak delta
//! and state of the world over real gRPC, recording versions as Envoy does
//! (only for a response they ACK).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tempfile::TempDir;

use crate::helpers::clients::{channel, Bidi};
use crate::helpers::envoy::{AdsApi, Envoy};
use crate::helpers::grpc::{eds_cluster, endpoints, write_files, CDS, CLUSTERS, EDS, ENDPOINTS};
use crate::helpers::{
    eventually_async, http_get, sample, spawn_gateway, start_gateway, start_gateway_on, within, Running,
};

const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
const SOTW: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";

type DeltaStream = Bidi<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;
type SotwStream = Bidi<DiscoveryRequest, DiscoveryResponse>;

/// Type URL → name → version: what a delta client reports holding.
type Held = BTreeMap<String, BTreeMap<String, String>>;

fn node(id: &str) -> Option<Node> {
    Some(Node {
        id: id.into(),
        ..Default::default()
    })
}

fn nack_detail() -> Option<tonic_types::Status> {
    Some(tonic_types::Status {
        code: 3,
        message: "cluster b: refused".into(),
        details: vec![],
    })
}

/// The files: EDS clusters (each with its own load assignment `<name>-eps`),
/// `timeouts` giving each cluster's connect timeout, and the endpoints with
/// their ports.
fn config(dir: &Path, clusters: &[(&str, &str)], assignments: &[(&str, u16)]) {
    let mut docs: Vec<String> = clusters
        .iter()
        .map(|(name, timeout)| {
            eds_cluster(name, &format!("{name}-eps"))
                .replace("connect_timeout: 1s", &format!("connect_timeout: {timeout}"))
        })
        .collect();
    docs.extend(
        assignments
            .iter()
            .map(|(name, port)| endpoints(&format!("{name}-eps"), &[*port])),
    );
    write_files(dir, &docs);
}

/// A gateway process on `files`, keeping its own state in `cache`.
async fn gateway(files: &Path, cache: &Path) -> Running {
    let (files, cache) = (files.to_str().unwrap(), cache.to_str().unwrap());
    spawn_gateway(None, &["--source-dir", files, "--cache-dir", cache]).await
}

/// A counter of the gateway's `/metrics` (0 when absent).
async fn counter(gw: &Running, name: &str, labels: &[&str]) -> f64 {
    let (_, exposition) = http_get(gw.monitoring, "/metrics").await;
    sample(&exposition, name, labels).unwrap_or(0.0)
}

/// Waits for the gateway's counter to read `value`.
async fn counter_is(gw: &Running, name: &str, labels: &[&str], value: f64) {
    eventually_async(&format!("{name}{labels:?} to be {value}"), || async {
        counter(gw, name, labels).await == value
    })
    .await;
}

const SKIPPED: &str = "mcp_gateway_reconnect_resources_skipped_total";
const RESENT: &str = "mcp_gateway_reconnect_resources_resent_total";

/// A delta ADS client as Envoy is one: clusters by wildcard and load
/// assignments by name on one stream, each response ACKed, and a
/// resource's version recorded only when the response that carried it is
/// ACKed (Envoy's `DeltaSubscriptionState`).
struct DeltaClient {
    stream: DeltaStream,
    held: Held,
}

impl DeltaClient {
    /// Opens a stream to `addr` reporting `held`, subscribing to every
    /// cluster and to `assignments`.
    async fn open(addr: SocketAddr, id: &str, assignments: &[&str], held: Held) -> Self {
        let stream = DeltaStream::open_on(channel(addr).await, DELTA).await;
        for (i, (type_url, names)) in [(CDS, &[][..]), (EDS, assignments)].into_iter().enumerate() {
            stream.send(DeltaDiscoveryRequest {
                node: if i == 0 { node(id) } else { None },
                type_url: type_url.into(),
                resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
                initial_resource_versions: held.get(type_url).cloned().unwrap_or_default().into_iter().collect(),
                ..Default::default()
            });
        }
        Self { stream, held }
    }

    /// The next response, answered: ACKed (its versions recorded) or, with
    /// `nack`, NACKed (nothing recorded).
    async fn next(&mut self, nack: bool) -> DeltaDiscoveryResponse {
        let response = within("a delta response", self.stream.recv()).await;
        self.stream.send(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            error_detail: if nack { nack_detail() } else { None },
            ..Default::default()
        });
        if !nack {
            let held = self.held.entry(response.type_url.clone()).or_default();
            for r in &response.resources {
                held.insert(r.name.clone(), r.version.clone());
            }
            for name in &response.removed_resources {
                held.remove(name);
            }
        }
        response
    }

    /// The first response of each type after the stream opened.
    async fn first_of_each(&mut self) -> BTreeMap<String, DeltaDiscoveryResponse> {
        let mut first = BTreeMap::new();
        while first.len() < 2 {
            let response = self.next(false).await;
            first.entry(response.type_url.clone()).or_insert(response);
        }
        first
    }

    fn holds(&self, type_url: &str) -> Vec<&str> {
        self.held
            .get(type_url)
            .map(|h| h.keys().map(String::as_str).collect())
            .unwrap_or_default()
    }
}

/// What a delta response carries: names sent, names removed.
fn carried(response: &DeltaDiscoveryResponse) -> (Vec<&str>, Vec<&str>) {
    let mut sent: Vec<&str> = response.resources.iter().map(|r| r.name.as_str()).collect();
    sent.sort_unstable();
    let mut removed: Vec<&str> = response.removed_resources.iter().map(String::as_str).collect();
    removed.sort_unstable();
    (sent, removed)
}

fn dirs() -> (TempDir, TempDir) {
    (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap())
}

/// After a restart (SIGTERM, on the same files and `--cache-dir`), a delta
/// client that reports what it holds is sent what changed while the
/// gateway was down and nothing else: a changed load assignment, the
/// removal of a cluster that went (after the first response: see
/// `make_before_break`), the removal of a name it asks for that does not
/// exist; each type answered (an empty response for nothing).
#[tokio::test]
async fn a_delta_client_is_sent_only_what_changed_across_a_restart() {
    let (files, cache) = dirs();
    config(
        files.path(),
        &[("a", "1s"), ("b", "1s"), ("c", "1s")],
        &[("a", 1001), ("b", 1002)],
    );
    let gw = gateway(files.path(), cache.path()).await;
    let asked = ["a-eps", "b-eps", "ghost"];
    let mut client = DeltaClient::open(gw.listen, "envoy-1", &asked, Held::new()).await;
    let first = client.first_of_each().await;
    assert_eq!(carried(&first[CDS]), (vec!["a", "b", "c"], vec![]));
    assert_eq!(carried(&first[EDS]), (vec!["a-eps", "b-eps"], vec!["ghost"]));
    assert!(gw.stop().await);

    // While it is down: b's endpoints change, cluster c goes.
    config(files.path(), &[("a", "1s"), ("b", "1s")], &[("a", 1001), ("b", 2002)]);
    let gw = gateway(files.path(), cache.path()).await;
    let held = std::mem::take(&mut client.held);
    let mut client = DeltaClient::open(gw.listen, "envoy-1", &asked, held).await;
    let resumed = client.first_of_each().await;
    assert_eq!(
        carried(&resumed[CDS]),
        (vec![], vec![]),
        "clusters: nothing changed; the one that went is not removed by the first response"
    );
    assert_eq!(
        carried(&resumed[EDS]),
        (vec!["b-eps"], vec!["ghost"]),
        "endpoints: the changed one, and the name that does not exist"
    );
    // The removal goes once the first response is ACKed (make before
    // break: the types that may name it had not been asked for yet).
    let removal = client.next(false).await;
    assert_eq!(
        (removal.type_url.as_str(), carried(&removal)),
        (CDS, (vec![], vec!["c"]))
    );
    assert_eq!(client.holds(CDS), ["a", "b"]);
    assert_eq!(client.holds(EDS), ["a-eps", "b-eps"]);
    counter_is(&gw, SKIPPED, &[&format!("collection=\"{CLUSTERS}\"")], 2.0).await;
    counter_is(&gw, SKIPPED, &[&format!("collection=\"{ENDPOINTS}\"")], 1.0).await;
    let changed = [&format!("collection=\"{ENDPOINTS}\"")[..], "reason=\"changed\""];
    counter_is(&gw, RESENT, &changed, 1.0).await;
    assert!(gw.stop().await);
}

/// A cluster sent on reconnect (it changed while the gateway was down) has
/// its load assignment sent too, although the client reports it at the
/// current content: Envoy warms a changed cluster until its endpoints come
/// (envoy#22418). The other load assignment is not sent.
#[tokio::test]
async fn a_cluster_sent_on_reconnect_brings_its_load_assignment() {
    let (files, cache) = dirs();
    config(files.path(), &[("a", "1s"), ("b", "1s")], &[("a", 1001), ("b", 1002)]);
    let gw = gateway(files.path(), cache.path()).await;
    let asked = ["a-eps", "b-eps"];
    let mut client = DeltaClient::open(gw.listen, "envoy-2", &asked, Held::new()).await;
    client.first_of_each().await;
    assert!(gw.stop().await);

    config(files.path(), &[("a", "3s"), ("b", "1s")], &[("a", 1001), ("b", 1002)]);
    let gw = gateway(files.path(), cache.path()).await;
    let held = std::mem::take(&mut client.held);
    let mut client = DeltaClient::open(gw.listen, "envoy-2", &asked, held).await;
    let resumed = client.first_of_each().await;
    assert_eq!(carried(&resumed[CDS]), (vec!["a"], vec![]));
    // The load assignment may come in the first EDS response (the cluster
    // went out before it was decided) or right after it.
    let mut assignments = carried(&resumed[EDS])
        .0
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>();
    if assignments.is_empty() {
        let forced = client.next(false).await;
        assert_eq!(forced.type_url, EDS);
        assignments = carried(&forced).0.iter().map(|n| n.to_string()).collect();
    }
    assert_eq!(assignments, ["a-eps"], "a's endpoints, not b's");
    let forced = [&format!("collection=\"{ENDPOINTS}\"")[..], "reason=\"forced\""];
    let sent_again = counter(&gw, RESENT, &forced).await + counter(&gw, "mcp_gateway_forced_resends_total", &[]).await;
    assert!(sent_again >= 1.0, "counted as forced");
    assert!(gw.stop().await);
}

/// A client that NACKed a response before the gateway restarted reports the
/// versions it last ACKed, but may hold part of what it refused (Envoy's
/// CDS applies the valid clusters of a response it NACKs). When the source
/// reverts exactly that while the gateway is down, the revert reaches it
/// only through the reconnect: what the NACKed response carried is sent
/// again (the NACK memory, kept in `--cache-dir`), the rest is not; once it
/// ACKs that, the memory lets go of it. Delta, then state of the world.
#[tokio::test]
async fn a_client_that_nacked_before_the_restart_is_resent_what_it_nacked() {
    let (files, cache) = dirs();
    let assignments = [("a", 1001), ("b", 1002)];
    config(files.path(), &[("a", "1s"), ("b", "1s")], &assignments);
    let gw = gateway(files.path(), cache.path()).await;
    let asked = ["a-eps", "b-eps"];
    let mut client = DeltaClient::open(gw.listen, "envoy-3", &asked, Held::new()).await;
    client.first_of_each().await;
    let mut sotw = SotwClient::open(gw.listen, "envoy-3-sotw", "").await;
    let v1 = sotw.next(false).await.version_info;

    config(files.path(), &[("a", "1s"), ("b", "2s")], &assignments);
    let refused = client.next(true).await;
    assert_eq!(carried(&refused), (vec!["b"], vec![]));
    sotw.next(true).await;
    let memory = cache.path().join("nack-memory.json");
    eventually_async("both NACKs in --cache-dir", || async {
        std::fs::read_to_string(&memory).is_ok_and(|m| m.contains("envoy-3\"") && m.contains("envoy-3-sotw"))
    })
    .await;
    assert!(gw.stop().await);

    // The revert, made while the gateway is down.
    config(files.path(), &[("a", "1s"), ("b", "1s")], &assignments);
    let gw = gateway(files.path(), cache.path()).await;
    let held = std::mem::take(&mut client.held);
    let mut client = DeltaClient::open(gw.listen, "envoy-3", &asked, held).await;
    let resumed = client.first_of_each().await;
    assert_eq!(carried(&resumed[CDS]), (vec!["b"], vec![]), "what it NACKed, not a");
    let mut sotw = SotwClient::open(gw.listen, "envoy-3-sotw", &v1).await;
    let full = sotw.next(false).await;
    assert_eq!(full.version_info, v1, "the version it reported, sent all the same");
    assert_eq!(full.resources.len(), 2);
    let nacked = [&format!("collection=\"{CLUSTERS}\"")[..], "reason=\"nacked\""];
    counter_is(&gw, RESENT, &nacked, 3.0).await;
    counter_is(&gw, SKIPPED, &[&format!("collection=\"{CLUSTERS}\"")], 1.0).await;
    // ACKed: nothing left to remember.
    eventually_async("the NACK memory to let go once ACKed", || async {
        std::fs::read_to_string(&memory).is_ok_and(|m| !m.contains("envoy-3"))
    })
    .await;
    assert!(gw.stop().await);
}

/// A state-of-the-world client asking for every cluster, as Envoy's CDS
/// does: each response ACKed with its version.
struct SotwClient {
    stream: SotwStream,
    acked: String,
}

impl SotwClient {
    async fn open(addr: SocketAddr, id: &str, version: &str) -> Self {
        let stream = SotwStream::open_on(channel(addr).await, SOTW).await;
        stream.send(DiscoveryRequest {
            node: node(id),
            type_url: CDS.into(),
            version_info: version.into(),
            ..Default::default()
        });
        Self {
            stream,
            acked: version.into(),
        }
    }

    /// The next response, ACKed (or NACKed, naming the version it last
    /// ACKed, as Envoy does).
    async fn next(&mut self, nack: bool) -> DiscoveryResponse {
        let response = within("a response", self.stream.recv()).await;
        if !nack {
            self.acked = response.version_info.clone();
        }
        self.stream.send(DiscoveryRequest {
            type_url: CDS.into(),
            response_nonce: response.nonce.clone(),
            version_info: self.acked.clone(),
            error_detail: if nack { nack_detail() } else { None },
            ..Default::default()
        });
        response
    }
}

/// Two replicas of the same source (two gateways on one files directory,
/// as a rolling update has them): a client that moves from one to the
/// other is sent nothing it holds, delta (empty answers) and state of the
/// world (no answer, until something changes).
#[tokio::test]
async fn a_client_moved_to_another_replica_is_resent_nothing() {
    let files = tempfile::tempdir().unwrap();
    let (cache_a, cache_b) = dirs();
    config(files.path(), &[("a", "1s"), ("b", "1s")], &[("a", 1001), ("b", 1002)]);
    let (a, b) = (
        gateway(files.path(), cache_a.path()).await,
        gateway(files.path(), cache_b.path()).await,
    );
    let asked = ["a-eps", "b-eps"];
    let mut client = DeltaClient::open(a.listen, "envoy-4", &asked, Held::new()).await;
    client.first_of_each().await;
    let mut sotw = SotwClient::open(a.listen, "envoy-4-sotw", "").await;
    let version = sotw.next(false).await.version_info;

    let held = std::mem::take(&mut client.held);
    let mut moved = DeltaClient::open(b.listen, "envoy-4", &asked, held).await;
    let resumed = moved.first_of_each().await;
    assert_eq!(carried(&resumed[CDS]), (vec![], vec![]), "an empty answer");
    assert_eq!(carried(&resumed[EDS]), (vec![], vec![]), "an empty answer");
    let mut sotw_moved = SotwClient::open(b.listen, "envoy-4-sotw", &version).await;
    counter_is(&b, SKIPPED, &[&format!("collection=\"{CLUSTERS}\"")], 4.0).await;
    counter_is(&b, SKIPPED, &[&format!("collection=\"{ENDPOINTS}\"")], 2.0).await;
    for reason in ["changed", "nacked", "forced"] {
        assert_eq!(
            counter(&b, RESENT, &[&format!("reason=\"{reason}\"")]).await,
            0.0,
            "{reason}"
        );
    }

    // A change: the first response the moved state-of-the-world client
    // gets on its new stream is the new version (nothing was sent before).
    config(files.path(), &[("a", "1s"), ("b", "2s")], &[("a", 1001), ("b", 1002)]);
    let changed = sotw_moved.next(false).await;
    assert_ne!(changed.version_info, version);
    assert_eq!(changed.resources.len(), 2);
    assert!(a.stop().await && b.stop().await);
}

// === with a real Envoy ===

/// An echo server on a port of the kernel's choosing: what a connection
/// sends comes back.
async fn echo_server() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    (port, task)
}

/// Whether a connection to Envoy's `port` reaches the echo server.
async fn echoes(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        stream.write_all(b"ping").await.ok()?;
        let mut answer = [0u8; 4];
        stream.read_exact(&mut answer).await.ok()?;
        Some(answer == *b"ping")
    };
    let limit = std::time::Duration::from_millis(500);
    matches!(tokio::time::timeout(limit, attempt).await, Ok(Some(true)))
}

/// Envoy's files: EDS cluster `backend` (its connect timeout `timeout`),
/// its load assignment `backend-eps` (the echo server), and a TCP proxy
/// `ingress` to it.
fn envoy_config(dir: &Path, timeout: &str, port: u16) {
    let cluster =
        eds_cluster("backend", "backend-eps").replace("connect_timeout: 1s", &format!("connect_timeout: {timeout}"));
    let listener = crate::envoy::listener_doc("ingress", "backend");
    write_files(dir, &[cluster, endpoints("backend-eps", &[port]), listener]);
}

/// The clusters Envoy is warming (waiting for their endpoints).
fn warming(dump: &serde_json::Value) -> usize {
    crate::helpers::envoy::section(dump, "ClustersConfigDump")
        .and_then(|s| s["dynamic_warming_clusters"].as_array())
        .map_or(0, Vec::len)
}

/// A cluster changed while the gateway was down (its connect timeout) is
/// sent on the reconnect, and so is its load assignment, which Envoy
/// reports holding at the current content (the endpoints did not change):
/// Envoy re-creates the cluster, warms it with those endpoints, and
/// traffic flows through it; no cluster is left warming (envoy#22418).
async fn a_cluster_changed_while_the_gateway_is_down_is_warmed_and_serves(api: AdsApi) {
    let (port, _echo) = echo_server().await;
    let (files, cache) = dirs();
    envoy_config(files.path(), "1s", port);
    let flags = [
        "--source-dir",
        files.path().to_str().unwrap(),
        "--cache-dir",
        cache.path().to_str().unwrap(),
    ];
    let gw = start_gateway(&flags).await;
    let envoy = Envoy::start(gw.listen, api, "envoy-reconnect")
        .await
        .unwrap_or_else(|why| panic!("Envoy: {why}"));
    envoy
        .clusters_text_when("backend's endpoint", |t| {
            t.contains(&format!("backend::127.0.0.1:{port}::"))
        })
        .await;
    let ingress: u16 = crate::helpers::eventually_some("Envoy's ingress listener", || async {
        let listeners = envoy.listeners().await;
        let line = listeners.lines().find(|l| l.starts_with("ingress::"))?;
        line.rsplit(':').next()?.trim().parse().ok().filter(|p| *p != 0)
    })
    .await;
    eventually_async("traffic through ingress", || echoes(ingress)).await;

    let listen = gw.listen.to_string();
    assert!(gw.shutdown().await);
    envoy_config(files.path(), "2s", port);
    let restarted = tokio::time::Instant::now();
    let _again = start_gateway_on(&listen, &flags).await;
    envoy
        .dump_matches(
            "backend re-created (connect timeout 2 s), warmed, nothing warming",
            |d| crate::envoy::connect_timeout(d, "backend").as_deref() == Some("2s") && warming(d) == 0,
        )
        .await;
    eventually_async("traffic through the re-created cluster", || echoes(ingress)).await;
    // Measured, not asserted (BENCHMARKS.md has the figures).
    eprintln!(
        "{api:?}: traffic through the re-created cluster {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(0));
    assert_eq!(envoy.stat("cluster_manager.warming_clusters").await, Some(0));
    // Warmed by its endpoints, not by giving up on them: without them,
    // Envoy 1.40 waits its initial fetch timeout (15 s) and then serves.
    assert_eq!(
        envoy.stat("cluster.backend.init_fetch_timeout").await.unwrap_or(0),
        0,
        "backend's endpoints were not sent after it: Envoy gave up waiting"
    );
}

#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_cluster_changed_while_the_gateway_is_down_is_warmed_and_serves_delta() {
    a_cluster_changed_while_the_gateway_is_down_is_warmed_and_serves(AdsApi::Delta).await;
}

#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_cluster_changed_while_the_gateway_is_down_is_warmed_and_serves_state_of_the_world() {
    a_cluster_changed_while_the_gateway_is_down_is_warmed_and_serves(AdsApi::Sotw).await;
}

/// istiod (MCP over xDS, state of the world, GVK types) is answered on
/// every stream whatever `version_info` it reports: istiod 1.16+ is not
/// ready until every type it asked for has answered, so a type it asks for
/// is never skipped, nor one nobody serves. (istiod's `adsc` reconnects
/// without a version; a client that does report one is answered all the
/// same.)
#[tokio::test]
async fn istiods_types_are_answered_whatever_version_it_reports() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config");
    let cache = tempfile::tempdir().unwrap();
    let gw = gateway(&examples, cache.path()).await;
    const VS: &str = "networking.istio.io/v1/VirtualService";
    const MESH: &str = "core/v1alpha1/MeshConfig";
    let ask = |version: String| {
        let listen = gw.listen;
        async move {
            let stream = SotwStream::open_on(channel(listen).await, SOTW).await;
            for (i, type_url) in [VS, MESH].into_iter().enumerate() {
                stream.send(DiscoveryRequest {
                    node: if i == 0 { node("istiod-1") } else { None },
                    type_url: type_url.into(),
                    version_info: version.clone(),
                    ..Default::default()
                });
            }
            stream
        }
    };
    let mut first = ask(String::new()).await;
    let mut versions = BTreeMap::new();
    for _ in 0..2 {
        let response = within("a response", first.recv()).await;
        versions.insert(response.type_url.clone(), response.version_info.clone());
    }
    assert!(versions.contains_key(VS) && versions.contains_key(MESH));
    drop(first);
    let mut again = ask(versions[VS].clone()).await;
    let mut answered = Vec::new();
    for _ in 0..2 {
        let response = within("istiod's types answered again", again.recv()).await;
        answered.push(response.type_url);
    }
    answered.sort();
    assert_eq!(answered, [MESH, VS]);
    assert!(gw.stop().await);
}

/// A `nack-memory.json` that does not read (damaged, or foreign) is
/// logged, and nothing is skipped on a reconnecting client's word for the
/// life of that process: what clients NACKed before it is not known.
#[tokio::test]
async fn a_damaged_nack_memory_turns_the_skip_off() {
    let (files, cache) = dirs();
    config(files.path(), &[("a", "1s")], &[("a", 1001)]);
    let gw = gateway(files.path(), cache.path()).await;
    let mut client = DeltaClient::open(gw.listen, "envoy-5", &["a-eps"], Held::new()).await;
    client.first_of_each().await;
    assert!(gw.stop().await);

    crate::helpers::certs::write(cache.path(), "nack-memory.json", "{\"entries\": [");
    let mut gw = gateway(files.path(), cache.path()).await;
    let warning = gw.logged("the saved NACK memory is unusable").await;
    assert!(warning.contains("nack-memory.json"), "{warning}");
    let held = std::mem::take(&mut client.held);
    let mut client = DeltaClient::open(gw.listen, "envoy-5", &["a-eps"], held).await;
    let resumed = client.first_of_each().await;
    assert_eq!(carried(&resumed[CDS]), (vec!["a"], vec![]), "everything, as before");
    assert_eq!(carried(&resumed[EDS]), (vec!["a-eps"], vec![]));
    assert_eq!(counter(&gw, SKIPPED, &[]).await, 0.0);
    assert!(gw.stop().await);
}

/// With a real Envoy and `--cache-dir`: Envoy applies the valid part of a
/// response it NACKs, the files are reverted to what it last ACKed while
/// the gateway is down, and Envoy reconnects reporting that (state of the
/// world: the version; delta: each resource's version). Its report is
/// trusted, but not for what the response it NACKed carried, which the NACK
/// memory kept across the restart: the revert reaches it.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_revert_made_while_the_gateway_is_down_reaches_envoy_that_nacked_state_of_the_world() {
    let cache = tempfile::tempdir().unwrap();
    let flags = ["--cache-dir", cache.path().to_str().unwrap()];
    crate::envoy::a_revert_made_while_the_gateway_is_down_reaches_envoy(AdsApi::Sotw, &flags).await;
}

#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_revert_made_while_the_gateway_is_down_reaches_envoy_that_nacked_delta() {
    let cache = tempfile::tempdir().unwrap();
    let flags = ["--cache-dir", cache.path().to_str().unwrap()];
    crate::envoy::a_revert_made_while_the_gateway_is_down_reaches_envoy(AdsApi::Delta, &flags).await;
}
