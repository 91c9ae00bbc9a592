//! Make before break across Envoy's types on one ADS stream (see
//! `downstream::order`): a change that adds a cluster and routes to it sends
//! the cluster, then (once Envoy asks) its endpoints, then the route, each
//! after the one before was ACKed; a change that routes away from a cluster
//! and removes it sends the route first and the removal after its ACK; a
//! switch does both, the old cluster kept until the route moved. A refused
//! step holds what depends on it, and says so. The source is a directory
//! swapped whole, as a Kubernetes volume is (`..data` renamed over): one
//! read of it is one step, and no stream sees half of it.
//!
//! These clients are tonic clients that behave as Envoy does on the wire
//! (asks for a new cluster's endpoints before it ACKs the cluster); the same
//! transitions with a real Envoy and traffic through it are in
//! `envoy_order`.

use std::net::SocketAddr;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use prost::Message;
use serde_json::Value;
use tempfile::TempDir;

use crate::helpers::clients::Bidi;
use crate::helpers::{eventually_some, get_json, spawn_gateway, start_gateway};

const SOTW: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
pub(crate) const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub(crate) const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub(crate) const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub(crate) const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const ROUTE_NAME: &str = "local_route";

type SotwStream = Bidi<DiscoveryRequest, DiscoveryResponse>;
type DeltaStream = Bidi<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

// === the source: a directory swapped whole ===

/// A directory laid out as Kubernetes mounts a ConfigMap: each file a link
/// through `..data`, which a swap renames over a new directory at once.
pub(crate) struct Volume {
    pub(crate) dir: TempDir,
    generation: u32,
}

/// The files every version of the volume has.
const FILES: [&str; 4] = ["clusters.yaml", "endpoints.yaml", "listeners.yaml", "routes.yaml"];

impl Volume {
    pub(crate) fn new(config: &Config) -> Self {
        let mut volume = Volume {
            dir: tempfile::tempdir().unwrap(),
            generation: 0,
        };
        volume.swap(config);
        for file in FILES {
            std::os::unix::fs::symlink(format!("..data/{file}"), volume.dir.path().join(file)).unwrap();
        }
        volume
    }

    pub(crate) fn path(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }

    /// The whole directory becomes `config` at once.
    pub(crate) fn swap(&mut self, config: &Config) {
        self.generation += 1;
        let dir = self.dir.path();
        let version = format!("..v{}", self.generation);
        std::fs::create_dir(dir.join(&version)).unwrap();
        for (file, text) in FILES.iter().zip(config.files()) {
            std::fs::write(dir.join(&version).join(file), text).unwrap();
        }
        let link = dir.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &link).unwrap();
        std::fs::rename(&link, dir.join("..data")).unwrap();
    }
}

/// How a cluster finds its endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Inline (`load_assignment`).
    Static,
    /// By name over the same stream (EDS).
    Eds,
}

/// One version of the config: clusters (name, upstream port), the route's
/// cluster, and (`listener`) an HTTP listener using the route, on a port of
/// Envoy's choosing.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) kind: Kind,
    pub(crate) clusters: Vec<(String, u16)>,
    pub(crate) route_to: String,
    pub(crate) listener: bool,
    /// Every cluster's connect timeout (a change of the clusters that
    /// touches nothing else).
    pub(crate) connect_timeout: &'static str,
    /// The route configuration's name, which the listener reads by RDS (a
    /// change of it is a change of the listener: Envoy drains the old one).
    pub(crate) route_name: &'static str,
    /// A TCP listener (`tcp`) whose proxy sends to this cluster.
    pub(crate) tcp_to: Option<&'static str>,
}

impl Config {
    pub(crate) fn new(kind: Kind, clusters: &[(&str, u16)], route_to: &str) -> Self {
        Config {
            kind,
            clusters: clusters.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect(),
            route_to: route_to.to_owned(),
            listener: false,
            connect_timeout: "1s",
            route_name: ROUTE_NAME,
            tcp_to: None,
        }
    }

    /// The files' texts, in the order of [`FILES`].
    fn files(&self) -> [String; 4] {
        let mut clusters = String::from("# clusters\n");
        let mut endpoints = String::from("# endpoints\n");
        for (name, port) in &self.clusters {
            let assignment = format!(
                "cluster_name: {name}\n    endpoints:\n    - lb_endpoints:\n      - endpoint: {{address: \
                 {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}"
            );
            let how = match self.kind {
                Kind::Static => format!("type: STATIC\n    load_assignment:\n      {}", indent(&assignment, 1)),
                Kind::Eds => {
                    endpoints.push_str(&format!(
                        "---\ncollection: envoy/config/endpoint/v3/clusterloadassignments\nname: {name}\nbody:\n  \
                         type_url: {ENDPOINTS}\n  json:\n    {assignment}\n"
                    ));
                    "type: EDS\n    eds_cluster_config: {eds_config: {ads: {}, resource_api_version: V3, \
                     initial_fetch_timeout: 300s}}"
                        .to_owned()
                }
            };
            clusters.push_str(&format!(
                "---\ncollection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: {CLUSTER}\n  json:\n    \
                 name: {name}\n    connect_timeout: {}\n    {how}\n",
                self.connect_timeout
            ));
        }
        let routes = format!(
            "collection: envoy/config/route/v3/routeconfigurations\nname: {route_name}\nbody:\n  type_url: {ROUTE}\n  \
             json:\n    name: {route_name}\n    virtual_hosts:\n    - name: all\n      domains: [\"*\"]\n      routes:\n      \
             - match: {{prefix: /}}\n        route: {{cluster: {}}}\n",
            self.route_to,
            route_name = self.route_name,
        );
        let tcp = self.tcp_to.map(|cluster| {
            format!(
                "---\ncollection: envoy/config/listener/v3/listeners\nname: tcp\nbody:\n  type_url: {LISTENER}\n  json:\n    \
                 name: tcp\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
                 filter_chains:\n    - filters:\n      - name: envoy.filters.network.tcp_proxy\n        \
                 typed_config:\n          \"@type\": \
                 type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy\n          \
                 stat_prefix: tcp\n          cluster: {cluster}\n"
            )
        });
        let listeners = if !self.listener {
            format!("# listeners\n{}", tcp.unwrap_or_default())
        } else {
            format!(
                "collection: envoy/config/listener/v3/listeners\nname: http\nbody:\n  type_url: {LISTENER}\n  json:\n    \
                 name: http\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
                 filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n        \
                 typed_config:\n          \"@type\": \
                 type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n          \
                 stat_prefix: http\n          rds:\n            route_config_name: {}\n            \
                 config_source: {{ads: {{}}, resource_api_version: V3}}\n          http_filters:\n          - name: \
                 envoy.filters.http.router\n            typed_config:\n              \"@type\": \
                 type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n{}",
                self.route_name,
                tcp.unwrap_or_default()
            )
        };
        [clusters, endpoints, listeners, routes]
    }
}

/// `text`'s lines after the first indented by `levels` × 2 more spaces.
fn indent(text: &str, levels: usize) -> String {
    text.replace('\n', &format!("\n{}", "  ".repeat(levels)))
}

// === what a response holds ===

/// The first field of Envoy's resources (`Cluster.name`,
/// `ClusterLoadAssignment.cluster_name`, `RouteConfiguration.name`,
/// `Listener.name`): enough to tell them apart without their Rust types.
#[derive(Clone, PartialEq, prost::Message)]
struct FirstField {
    #[prost(string, tag = "1")]
    name: String,
}

fn name_of(value: &[u8]) -> String {
    FirstField::decode(value).expect("a resource named in field 1").name
}

/// The names a state-of-the-world response holds, sorted.
fn sotw_names(response: &DiscoveryResponse) -> Vec<String> {
    let mut names: Vec<String> = response.resources.iter().map(|r| name_of(&r.value)).collect();
    names.sort();
    names
}

/// The cluster the route of a response routes to (its bytes name it).
fn routes_to(values: &[&[u8]], clusters: &[&str]) -> String {
    let found: Vec<&str> = clusters
        .iter()
        .copied()
        .filter(|c| values.iter().any(|v| v.windows(c.len()).any(|w| w == c.as_bytes())))
        .collect();
    assert_eq!(found.len(), 1, "one cluster named by the route, of {clusters:?}");
    found[0].to_owned()
}

// === a client that does what Envoy does on the wire ===

fn node() -> Option<Node> {
    Some(Node {
        id: "envoy-order".into(),
        ..Default::default()
    })
}

struct Sotw {
    stream: SotwStream,
}

impl Sotw {
    async fn open(addr: SocketAddr) -> Self {
        Sotw {
            stream: SotwStream::open(addr, SOTW).await,
        }
    }

    /// A client of the clusters (wildcard) and the route (static clusters:
    /// no endpoints), each ACKed, nothing held: and its clusters' response.
    async fn synced(addr: SocketAddr, admin: SocketAddr) -> (Self, DiscoveryResponse) {
        let mut envoy = Sotw::open(addr).await;
        envoy.request(CLUSTER, &[], None);
        let clusters = envoy.next(CLUSTER, "the clusters").await;
        envoy.ack(&clusters, &[]);
        envoy.request(ROUTE, &[ROUTE_NAME], None);
        let route = envoy.next(ROUTE, "the route").await;
        envoy.ack(&route, &[ROUTE_NAME]);
        nothing_held(admin).await;
        (envoy, clusters)
    }

    /// A client of the clusters and listeners (wildcard) and, by name, the
    /// route configuration `route` (if any), each ACKed, nothing held: and
    /// its clusters' and route's responses.
    async fn synced_with_listeners(
        addr: SocketAddr,
        admin: SocketAddr,
        route: Option<&str>,
    ) -> (Self, DiscoveryResponse, Option<DiscoveryResponse>) {
        let mut envoy = Sotw::open(addr).await;
        envoy.request(CLUSTER, &[], None);
        let clusters = envoy.next(CLUSTER, "the clusters").await;
        envoy.ack(&clusters, &[]);
        envoy.request(LISTENER, &[], None);
        let listeners = envoy.next(LISTENER, "the listeners").await;
        envoy.ack(&listeners, &[]);
        let mut routes = None;
        if let Some(route) = route {
            envoy.request(ROUTE, &[route], None);
            let response = envoy.next(ROUTE, "the route").await;
            envoy.ack(&response, &[route]);
            routes = Some(response);
        }
        nothing_held(admin).await;
        (envoy, clusters, routes)
    }

    fn request(&self, type_url: &str, names: &[&str], last: Option<&DiscoveryResponse>) {
        self.stream.send(DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: names.iter().map(|n| (*n).to_owned()).collect(),
            version_info: last.map(|r| r.version_info.clone()).unwrap_or_default(),
            response_nonce: last.map(|r| r.nonce.clone()).unwrap_or_default(),
            node: node(),
            ..Default::default()
        });
    }

    /// An ACK, with the names the type subscribes to.
    fn ack(&self, response: &DiscoveryResponse, names: &[&str]) {
        self.request(&response.type_url, names, Some(response));
    }

    fn nack(&self, response: &DiscoveryResponse, held: &str, message: &str) {
        self.stream.send(DiscoveryRequest {
            type_url: response.type_url.clone(),
            version_info: held.to_owned(),
            response_nonce: response.nonce.clone(),
            node: node(),
            error_detail: Some(tonic_types::Status {
                code: 3,
                message: message.into(),
                details: Vec::new(),
            }),
            ..Default::default()
        });
    }

    /// The next response, which must be of `type_url`.
    async fn next(&mut self, type_url: &str, what: &str) -> DiscoveryResponse {
        let response = self.stream.recv().await;
        assert_eq!(
            response.type_url,
            type_url,
            "{what}: got {:?} first",
            sotw_names(&response)
        );
        response
    }
}

/// `/debug/syncz`'s row of the client's `type_url`.
async fn row(admin: SocketAddr, type_url: &str) -> Value {
    let syncz = get_json(admin, "/debug/syncz").await;
    syncz["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["type_url"] == type_url)
        .cloned()
        .unwrap_or(Value::Null)
}

/// Waits until `/debug/syncz` shows `type_url` held for `waits_for`
/// (`reason`, `step`): the gateway decided to hold it, which no wait on the
/// stream can show.
async fn held_for(admin: SocketAddr, type_url: &str, waits_for: &str, reason: &str, step: &str) {
    let what = format!("{type_url} held for the {waits_for} ({reason}, {step})");
    eventually_some(&what, || async {
        let order = row(admin, type_url).await["order"].clone();
        (order["waits_for"] == waits_for && order["reason"] == reason && order["step"] == step).then_some(())
    })
    .await;
}

/// Waits until no type of the client is held.
async fn nothing_held(admin: SocketAddr) {
    eventually_some("no type held", || async {
        let syncz = get_json(admin, "/debug/syncz").await;
        let rows = syncz["rows"].as_array().cloned().unwrap_or_default();
        (!rows.is_empty() && rows.iter().all(|r| r["order"].is_null())).then_some(())
    })
    .await;
}

/// What Envoy does once clusters were removed: it stops asking for their
/// endpoints (no answer needed), then ACKs the clusters.
fn unsubscribe(envoy: &Sotw, clusters: &DiscoveryResponse, endpoints: &DiscoveryResponse, names: &[&str]) {
    envoy.request(ENDPOINTS, names, Some(endpoints));
    envoy.ack(clusters, &[]);
}

/// A route to a new EDS cluster goes after the cluster and its endpoints;
/// back to the old cluster, the route goes first and the removal after;
/// a switch keeps the old cluster until the route moved.
#[tokio::test]
async fn state_of_the_world_makes_before_it_breaks() {
    let mut volume = Volume::new(&Config::new(Kind::Eds, &[("cluster-a", 1)], "cluster-a"));
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let mut envoy = Sotw::open(gw.listen).await;

    // Connecting: clusters (wildcard), their endpoints, the route by name.
    envoy.request(CLUSTER, &[], None);
    let clusters = envoy.next(CLUSTER, "the clusters").await;
    assert_eq!(sotw_names(&clusters), ["cluster-a"]);
    envoy.request(ENDPOINTS, &["cluster-a"], None);
    envoy.ack(&clusters, &[]);
    let endpoints = envoy.next(ENDPOINTS, "the endpoints").await;
    envoy.ack(&endpoints, &["cluster-a"]);
    envoy.request(ROUTE, &[ROUTE_NAME], None);
    let route = envoy.next(ROUTE, "the route").await;
    envoy.ack(&route, &[ROUTE_NAME]);
    nothing_held(gw.admin).await;

    // Add cluster-b and route to it: the cluster first, the route held.
    volume.swap(&Config::new(
        Kind::Eds,
        &[("cluster-a", 1), ("cluster-b", 2)],
        "cluster-b",
    ));
    let clusters = envoy.next(CLUSTER, "the added cluster before the route to it").await;
    assert_eq!(sotw_names(&clusters), ["cluster-a", "cluster-b"]);
    held_for(gw.admin, ROUTE, "clusters", "UNACKED", "add").await;
    // Envoy asks for the new cluster's endpoints, then ACKs the cluster:
    // the endpoints go at once, the route waits for them.
    envoy.request(ENDPOINTS, &["cluster-a", "cluster-b"], Some(&endpoints));
    envoy.ack(&clusters, &[]);
    let endpoints = envoy
        .next(ENDPOINTS, "the new cluster's endpoints before the route")
        .await;
    // cluster-a's are left out: Envoy keeps them (see
    // `collections::sotw_keeps_what_is_left_out`).
    assert_eq!(sotw_names(&endpoints), ["cluster-b"]);
    held_for(gw.admin, ROUTE, "endpoints", "UNACKED", "add").await;
    envoy.ack(&endpoints, &["cluster-a", "cluster-b"]);
    let route = envoy.next(ROUTE, "the route once its cluster is warm").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-b"]),
        "cluster-b"
    );
    envoy.ack(&route, &[ROUTE_NAME]);
    nothing_held(gw.admin).await;

    // Back to cluster-a, cluster-b removed: the route first, the removals
    // after its ACK (clusters; the endpoints' removal has nothing to send).
    volume.swap(&Config::new(Kind::Eds, &[("cluster-a", 1)], "cluster-a"));
    let route = envoy
        .next(ROUTE, "the route away from the cluster before its removal")
        .await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-b"]),
        "cluster-a"
    );
    held_for(gw.admin, CLUSTER, "routes", "UNACKED", "remove").await;
    envoy.ack(&route, &[ROUTE_NAME]);
    // The endpoints' removal sends nothing (state of the world cannot tell
    // it for load assignments; Envoy drops them with the cluster).
    let clusters = envoy.next(CLUSTER, "the cluster's removal last").await;
    assert_eq!(sotw_names(&clusters), ["cluster-a"]);
    unsubscribe(&envoy, &clusters, &endpoints, &["cluster-a"]);
    nothing_held(gw.admin).await;

    // A switch: cluster-c replaces cluster-a and the route moves to it.
    // cluster-c comes with cluster-a kept, then its endpoints (cluster-a's
    // kept too), then the route, then cluster-a goes.
    volume.swap(&Config::new(Kind::Eds, &[("cluster-c", 3)], "cluster-c"));
    let clusters = envoy.next(CLUSTER, "the new cluster, the old one kept").await;
    assert_eq!(sotw_names(&clusters), ["cluster-a", "cluster-c"]);
    held_for(gw.admin, ROUTE, "clusters", "UNACKED", "add").await;
    envoy.request(ENDPOINTS, &["cluster-a", "cluster-c"], Some(&endpoints));
    envoy.ack(&clusters, &[]);
    let endpoints = envoy
        .next(ENDPOINTS, "the new cluster's endpoints, the old one's kept")
        .await;
    assert_eq!(sotw_names(&endpoints), ["cluster-c"]);
    envoy.ack(&endpoints, &["cluster-a", "cluster-c"]);
    let route = envoy.next(ROUTE, "the route to the new cluster").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-c"]),
        "cluster-c"
    );
    held_for(gw.admin, CLUSTER, "routes", "UNACKED", "remove").await;
    envoy.ack(&route, &[ROUTE_NAME]);
    let clusters = envoy.next(CLUSTER, "the old cluster removed last").await;
    assert_eq!(sotw_names(&clusters), ["cluster-c"]);
    unsubscribe(&envoy, &clusters, &endpoints, &["cluster-c"]);
    nothing_held(gw.admin).await;

    // A change of one type goes at once.
    volume.swap(&Config::new(Kind::Eds, &[("cluster-c", 4)], "cluster-c"));
    let endpoints = envoy.next(ENDPOINTS, "an endpoint moved").await;
    assert_eq!(sotw_names(&endpoints), ["cluster-c"]);
    envoy.ack(&endpoints, &["cluster-c"]);
    nothing_held(gw.admin).await;
}

struct Delta {
    stream: DeltaStream,
}

impl Delta {
    async fn open(addr: SocketAddr) -> Self {
        Delta {
            stream: DeltaStream::open(addr, DELTA).await,
        }
    }

    /// Subscribes to (and unsubscribes from) names of `type_url`; the first
    /// request of a type with none is wildcard.
    fn subscribe(&self, type_url: &str, subscribe: &[&str], unsubscribe: &[&str]) {
        self.stream.send(DeltaDiscoveryRequest {
            type_url: type_url.into(),
            resource_names_subscribe: subscribe.iter().map(|n| (*n).to_owned()).collect(),
            resource_names_unsubscribe: unsubscribe.iter().map(|n| (*n).to_owned()).collect(),
            node: node(),
            ..Default::default()
        });
    }

    /// A reconnecting client's first request of `type_url`: the names it
    /// asks for, and what it holds (name, version).
    fn resume(&self, type_url: &str, subscribe: &[&str], held: &[(&str, &str)]) {
        self.stream.send(DeltaDiscoveryRequest {
            type_url: type_url.into(),
            resource_names_subscribe: subscribe.iter().map(|n| (*n).to_owned()).collect(),
            initial_resource_versions: held.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(),
            node: node(),
            ..Default::default()
        });
    }

    /// A NACK of `response`.
    fn nack(&self, response: &DeltaDiscoveryResponse) {
        self.answer(
            response,
            Some(tonic_types::Status {
                code: 3,
                message: "refused".into(),
                details: Vec::new(),
            }),
        );
    }

    fn ack(&self, response: &DeltaDiscoveryResponse) {
        self.answer(response, None);
    }

    /// `response` answered: ACKed, or NACKed with `error_detail`.
    fn answer(&self, response: &DeltaDiscoveryResponse, error_detail: Option<tonic_types::Status>) {
        self.stream.send(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            node: node(),
            error_detail,
            ..Default::default()
        });
    }

    /// `cluster`'s endpoints removed, then (after their ACK) the cluster,
    /// the endpoints unsubscribed as Envoy does: nothing held after.
    async fn removed_last(&mut self, cluster: &str, admin: SocketAddr) {
        let (endpoints, sent, removed) = self.next(ENDPOINTS, "the endpoints' removal").await;
        assert_eq!((sent, removed), (vec![], vec![cluster.to_owned()]));
        self.ack(&endpoints);
        let (clusters, sent, removed) = self.next(CLUSTER, "the cluster's removal last").await;
        assert_eq!((sent, removed), (vec![], vec![cluster.to_owned()]));
        self.subscribe(ENDPOINTS, &[], &[cluster]);
        self.ack(&clusters);
        nothing_held(admin).await;
    }

    /// The next response, which must be of `type_url`: (the names it sends,
    /// the names it removes), each sorted.
    async fn next(&mut self, type_url: &str, what: &str) -> (DeltaDiscoveryResponse, Vec<String>, Vec<String>) {
        let response = self.stream.recv().await;
        let mut sent: Vec<String> = response.resources.iter().map(|r| r.name.clone()).collect();
        sent.sort();
        let mut removed = response.removed_resources.clone();
        removed.sort();
        assert_eq!(
            response.type_url, type_url,
            "{what}: got {sent:?} (removing {removed:?}) first"
        );
        (response, sent, removed)
    }
}

/// The cluster the route of a delta response routes to.
fn delta_routes_to(response: &DeltaDiscoveryResponse, clusters: &[&str]) -> String {
    let values: Vec<&[u8]> = response
        .resources
        .iter()
        .filter_map(|r| r.resource.as_ref().map(|a| &a.value[..]))
        .collect();
    routes_to(&values, clusters)
}

/// The same transitions over delta xDS: each step carries what changed, and
/// a removal is a name in `removed_resources`, sent only once nothing names
/// it any more.
#[tokio::test]
async fn delta_makes_before_it_breaks() {
    let mut volume = Volume::new(&Config::new(Kind::Eds, &[("cluster-a", 1)], "cluster-a"));
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let mut envoy = Delta::open(gw.listen).await;

    envoy.subscribe(CLUSTER, &[], &[]);
    let (clusters, sent, _) = envoy.next(CLUSTER, "the clusters").await;
    assert_eq!(sent, ["cluster-a"]);
    envoy.subscribe(ENDPOINTS, &["cluster-a"], &[]);
    envoy.ack(&clusters);
    let (endpoints, _, _) = envoy.next(ENDPOINTS, "the endpoints").await;
    envoy.ack(&endpoints);
    envoy.subscribe(ROUTE, &[ROUTE_NAME], &[]);
    let (route, _, _) = envoy.next(ROUTE, "the route").await;
    envoy.ack(&route);
    nothing_held(gw.admin).await;

    // A route to a new EDS cluster.
    volume.swap(&Config::new(
        Kind::Eds,
        &[("cluster-a", 1), ("cluster-b", 2)],
        "cluster-b",
    ));
    let (clusters, sent, removed) = envoy.next(CLUSTER, "the added cluster before the route to it").await;
    assert_eq!((sent, removed), (vec!["cluster-b".to_owned()], vec![]));
    held_for(gw.admin, ROUTE, "clusters", "UNACKED", "add").await;
    envoy.subscribe(ENDPOINTS, &["cluster-b"], &[]);
    envoy.ack(&clusters);
    let (endpoints, sent, _) = envoy
        .next(ENDPOINTS, "the new cluster's endpoints before the route")
        .await;
    assert_eq!(sent, ["cluster-b"]);
    held_for(gw.admin, ROUTE, "endpoints", "UNACKED", "add").await;
    envoy.ack(&endpoints);
    let (route, _, _) = envoy.next(ROUTE, "the route once its cluster is warm").await;
    assert_eq!(delta_routes_to(&route, &["cluster-a", "cluster-b"]), "cluster-b");
    envoy.ack(&route);
    nothing_held(gw.admin).await;

    // Away from it, and it removed.
    volume.swap(&Config::new(Kind::Eds, &[("cluster-a", 1)], "cluster-a"));
    let (route, _, _) = envoy.next(ROUTE, "the route away before the removal").await;
    assert_eq!(delta_routes_to(&route, &["cluster-a", "cluster-b"]), "cluster-a");
    held_for(gw.admin, CLUSTER, "routes", "UNACKED", "remove").await;
    envoy.ack(&route);
    envoy.removed_last("cluster-b", gw.admin).await;

    // A switch: cluster-c for cluster-a.
    volume.swap(&Config::new(Kind::Eds, &[("cluster-c", 3)], "cluster-c"));
    let (clusters, sent, removed) = envoy.next(CLUSTER, "the new cluster, the old one kept").await;
    assert_eq!((sent, removed), (vec!["cluster-c".to_owned()], vec![]));
    envoy.subscribe(ENDPOINTS, &["cluster-c"], &[]);
    envoy.ack(&clusters);
    let (endpoints, sent, removed) = envoy.next(ENDPOINTS, "the new endpoints, the old kept").await;
    assert_eq!((sent, removed), (vec!["cluster-c".to_owned()], vec![]));
    envoy.ack(&endpoints);
    let (route, _, _) = envoy.next(ROUTE, "the route to the new cluster").await;
    assert_eq!(delta_routes_to(&route, &["cluster-a", "cluster-c"]), "cluster-c");
    held_for(gw.admin, CLUSTER, "routes", "UNACKED", "remove").await;
    envoy.ack(&route);
    let (endpoints, sent, removed) = envoy.next(ENDPOINTS, "the old endpoints removed").await;
    assert_eq!((sent, removed), (vec![], vec!["cluster-a".to_owned()]));
    envoy.ack(&endpoints);
    let (clusters, sent, removed) = envoy.next(CLUSTER, "the old cluster removed last").await;
    assert_eq!((sent, removed), (vec![], vec!["cluster-a".to_owned()]));
    envoy.subscribe(ENDPOINTS, &[], &["cluster-a"]);
    envoy.ack(&clusters);
    nothing_held(gw.admin).await;

    // One type's change goes at once.
    volume.swap(&Config::new(Kind::Eds, &[("cluster-c", 4)], "cluster-c"));
    let (endpoints, sent, _) = envoy.next(ENDPOINTS, "an endpoint moved").await;
    assert_eq!(sent, ["cluster-c"]);
    envoy.ack(&endpoints);
    nothing_held(gw.admin).await;
}

/// A cluster removed while the client was away (the gateway restarted,
/// or the client moved to another replica), with the route to it: the
/// client reports it, the gateway has no copy of it to keep, and its first
/// responses keep it all the same (they do not remove it). The route away
/// goes first; the endpoints' removal and then the cluster's follow, or
/// both after a drain (`--listener-drain-time`: the client's listeners may
/// have been draining when it left). Issue 41's independent check: removed
/// at once in the first response, `503 NC` on every restart.
#[tokio::test]
async fn a_cluster_removed_while_the_client_was_away_goes_after_the_route_away() {
    // A drain of 1 s: the removals follow once it ends.
    for drain in ["0s", "600s", "1s"] {
        let volume = Volume::new(&Config::new(Kind::Eds, &[("cluster-a", 1)], "cluster-a"));
        let gw = start_gateway(&["--source-dir", volume.path(), "--listener-drain-time", drain]).await;
        let mut envoy = Delta::open(gw.listen).await;
        // It held cluster-b and a route to it when the gateway went away.
        let held = [("cluster-a", "old"), ("cluster-b", "old")];
        envoy.resume(CLUSTER, &[], &held);
        envoy.resume(ENDPOINTS, &["cluster-a", "cluster-b"], &held);
        envoy.resume(LISTENER, &[], &[]);
        envoy.resume(ROUTE, &[ROUTE_NAME], &[(ROUTE_NAME, "old")]);
        let mut removed_first = Vec::new();
        let mut route_to = None;
        for _ in 0..4 {
            let response = envoy.stream.recv().await;
            removed_first.extend(response.removed_resources.iter().cloned());
            if response.type_url == ROUTE {
                route_to = Some(delta_routes_to(&response, &["cluster-a", "cluster-b"]));
            }
            envoy.ack(&response);
        }
        assert_eq!(
            removed_first,
            Vec::<String>::new(),
            "{drain}: nothing removed before the route moved"
        );
        assert_eq!(route_to.as_deref(), Some("cluster-a"), "{drain}");
        if drain == "600s" {
            // Both removals wait for the drain; each type in sync.
            held_for(gw.admin, ENDPOINTS, "listeners", "DRAINING", "remove").await;
            held_for(gw.admin, CLUSTER, "listeners", "DRAINING", "remove").await;
            for type_url in [CLUSTER, ENDPOINTS] {
                let row = row(gw.admin, type_url).await;
                assert_eq!(row["status"], "SYNCED", "{row}");
            }
            continue;
        }
        if drain == "0s" {
            envoy.removed_last("cluster-b", gw.admin).await;
            continue;
        }
        // Once the drain ends, both go (as drained removals do, together).
        let mut removed = Vec::new();
        for _ in 0..2 {
            let response = envoy.stream.recv().await;
            assert!(response.resources.is_empty(), "{drain}: {:?}", response.type_url);
            removed.push((response.type_url.clone(), response.removed_resources.clone()));
            if response.type_url == CLUSTER {
                envoy.subscribe(ENDPOINTS, &[], &["cluster-b"]);
            }
            envoy.ack(&response);
        }
        removed.sort();
        let b = vec!["cluster-b".to_owned()];
        assert_eq!(removed, [(CLUSTER.to_owned(), b.clone()), (ENDPOINTS.to_owned(), b)]);
        nothing_held(gw.admin).await;
    }
}

/// A cluster the client refuses holds the route to it, as `/debug/syncz`,
/// `status`, the log and the metric say (a gateway process of its own: its
/// count is this test's), until the source changes the cluster and the
/// client takes it: then the route goes.
#[tokio::test]
async fn a_refused_cluster_holds_the_route_to_it_until_it_is_fixed() {
    let mut volume = Volume::new(&Config::new(Kind::Static, &[("cluster-a", 1)], "cluster-a"));
    let mut gw = spawn_gateway(None, &["--source-dir", volume.path()]).await;
    let (mut envoy, clusters) = Sotw::synced(gw.listen, gw.admin).await;

    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-b", 2)],
        "cluster-b",
    ));
    let refused = envoy.next(CLUSTER, "the added cluster").await;
    envoy.nack(&refused, &clusters.version_info, "cluster-b: refused by the test");
    held_for(gw.admin, ROUTE, "clusters", "NACKED", "add").await;
    let (code, stdout, _) = crate::operating::subcommand("status", &["--admin", &gw.admin.to_string()]).await;
    assert_eq!(code, Some(1), "a held type is not synced:\n{stdout}");
    assert!(
        stdout.contains(
            "HELD envoy-order envoy/config/route/v3/routeconfigurations: its change waits for the clusters, which \
             the client refused (NACKed): held until the source fixes the clusters"
        ),
        "{stdout}"
    );
    let metrics = crate::helpers::http_get(gw.monitoring, "/metrics").await.1;
    let held = crate::helpers::sample(
        &metrics,
        "mcp_gateway_order_holds_total",
        &[
            "collection=\"envoy/config/route/v3/routeconfigurations\"",
            "step=\"add\"",
        ],
    );
    assert_eq!(held, Some(1.0), "the route's hold counted once");
    let logged = gw.log_line("a change is held").await;
    assert!(
        logged.contains("waits_for=\"clusters\"") || logged.contains("waits_for=clusters"),
        "{logged}"
    );

    // The source fixes the cluster (another port): it goes, is taken, and
    // the route follows.
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-b", 3)],
        "cluster-b",
    ));
    let fixed = envoy.next(CLUSTER, "the fixed cluster before the route").await;
    assert_eq!(sotw_names(&fixed), ["cluster-a", "cluster-b"]);
    envoy.ack(&fixed, &[]);
    let route = envoy.next(ROUTE, "the route once the cluster is taken").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-b"]),
        "cluster-b"
    );
    envoy.ack(&route, &[ROUTE_NAME]);
    nothing_held(gw.admin).await;
}

/// A refused cluster holds only the routes that send to it: the fix that
/// drops it and routes elsewhere goes (the route first, the refused
/// cluster's removal after), and a fix that also replaces clusters keeps
/// what the client ACKed, never what it refused (it would refuse it again).
/// Found by an independent check: both used to leave the client held for
/// good.
#[tokio::test]
async fn a_fix_of_a_refused_cluster_is_not_held_by_it() {
    let mut volume = Volume::new(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-d", 2)],
        "cluster-a",
    ));
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let (mut envoy, clusters) = Sotw::synced(gw.listen, gw.admin).await;

    // A broken cluster and the route to it: refused, the route held.
    let broken = [("cluster-a", 1), ("cluster-d", 2), ("cluster-bad", 3)];
    volume.swap(&Config::new(Kind::Static, &broken, "cluster-bad"));
    let refused = envoy.next(CLUSTER, "the broken cluster").await;
    envoy.nack(&refused, &clusters.version_info, "cluster-bad: refused by the test");
    held_for(gw.admin, ROUTE, "clusters", "NACKED", "add").await;

    // The fix: the broken cluster dropped, the route to a cluster the client
    // runs. The route goes first, the removal after.
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-d", 2)],
        "cluster-d",
    ));
    let route = envoy.next(ROUTE, "the route away from the refused cluster").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-d"]),
        "cluster-d"
    );
    envoy.ack(&route, &[ROUTE_NAME]);
    let clusters = envoy.next(CLUSTER, "the refused cluster's removal").await;
    assert_eq!(sotw_names(&clusters), ["cluster-a", "cluster-d"]);
    envoy.ack(&clusters, &[]);
    nothing_held(gw.admin).await;

    // Refused again; this time the fix replaces the clusters: its additions
    // go first with what the client ACKed kept, not the refused one.
    volume.swap(&Config::new(Kind::Static, &broken, "cluster-bad"));
    let refused = envoy.next(CLUSTER, "the broken cluster again").await;
    envoy.nack(&refused, &clusters.version_info, "cluster-bad: refused by the test");
    held_for(gw.admin, ROUTE, "clusters", "NACKED", "add").await;
    volume.swap(&Config::new(Kind::Static, &[("cluster-c", 4)], "cluster-c"));
    let first = envoy.next(CLUSTER, "the new cluster, what was ACKed kept").await;
    assert_eq!(sotw_names(&first), ["cluster-a", "cluster-c", "cluster-d"]);
    envoy.ack(&first, &[]);
    let route = envoy.next(ROUTE, "the route to the new cluster").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-c"]),
        "cluster-c"
    );
    envoy.ack(&route, &[ROUTE_NAME]);
    let last = envoy.next(CLUSTER, "the old clusters removed").await;
    assert_eq!(sotw_names(&last), ["cluster-c"]);
    envoy.ack(&last, &[]);
    nothing_held(gw.admin).await;
}

/// A listener's TCP proxy names its cluster as a route does: a refused
/// cluster holds a listener change that sends to it (it would be a listener
/// without its cluster), until the source fixes the cluster.
#[tokio::test]
async fn a_refused_cluster_holds_a_tcp_listener_that_sends_to_it() {
    let version = |clusters: &[(&str, u16)], tcp_to: &'static str| {
        let mut config = Config::new(Kind::Static, clusters, "cluster-a");
        config.tcp_to = Some(tcp_to);
        config
    };
    let mut volume = Volume::new(&version(&[("cluster-a", 1)], "cluster-a"));
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let (mut envoy, clusters, _) = Sotw::synced_with_listeners(gw.listen, gw.admin, None).await;

    // A new cluster and the TCP listener moved to it: the cluster refused.
    volume.swap(&version(&[("cluster-a", 1), ("cluster-b", 2)], "cluster-b"));
    let refused = envoy.next(CLUSTER, "the new cluster before the listener").await;
    envoy.nack(&refused, &clusters.version_info, "cluster-b: refused by the test");
    held_for(gw.admin, LISTENER, "clusters", "NACKED", "add").await;

    // Fixed: the cluster goes, is taken, and the listener follows.
    volume.swap(&version(&[("cluster-a", 1), ("cluster-b", 3)], "cluster-b"));
    let fixed = envoy.next(CLUSTER, "the fixed cluster before the listener").await;
    assert_eq!(sotw_names(&fixed), ["cluster-a", "cluster-b"]);
    envoy.ack(&fixed, &[]);
    let listener = envoy.next(LISTENER, "the listener once its cluster is taken").await;
    assert_eq!(
        routes_to(&[&listener.resources[0].value], &["cluster-a", "cluster-b"]),
        "cluster-b"
    );
    envoy.ack(&listener, &[]);
    nothing_held(gw.admin).await;
}

/// A listener switched to another route configuration, with the cluster the
/// old one's routes sent to removed in the same change: Envoy drains the old
/// listener, which keeps those routes for its open connections, so the
/// cluster's removal waits `--listener-drain-time` (600 s by default, as
/// Envoy's `--drain-time-s`) after the listener and routes were ACKed. The
/// client counts as SYNCED meanwhile; `status` says what waits, until when.
/// (`envoy_order` runs it with a real Envoy and traffic, drains shortened.)
#[tokio::test]
async fn a_cluster_a_drained_listener_sent_to_goes_after_the_drain() {
    let version = |cluster: &str, route_name: &'static str| {
        let mut config = Config::new(Kind::Static, &[(cluster, 1)], cluster);
        config.listener = true;
        config.route_name = route_name;
        config
    };
    let mut volume = Volume::new(&version("cluster-a", "route-a"));
    let mut gw = spawn_gateway(None, &["--source-dir", volume.path()]).await;
    let (mut envoy, _, route) = Sotw::synced_with_listeners(gw.listen, gw.admin, Some("route-a")).await;
    let route = route.expect("route-a");

    volume.swap(&version("cluster-b", "route-b"));
    let first = envoy.next(CLUSTER, "the new cluster, the old one kept").await;
    assert_eq!(sotw_names(&first), ["cluster-a", "cluster-b"]);
    envoy.ack(&first, &[]);
    let listeners = envoy.next(LISTENER, "the listener on route-b").await;
    envoy.ack(&listeners, &[]);
    // Envoy asks for the new route configuration and, while the old
    // listener drains, still for the old one.
    // (The removal of route-a may come first: ACKed with both names.)
    envoy.request(ROUTE, &["route-a", "route-b"], Some(&route));
    let mut routes = envoy.next(ROUTE, "route-b").await;
    while sotw_names(&routes) != ["route-b"] {
        assert!(routes.resources.is_empty(), "{:?}", sotw_names(&routes));
        envoy.ack(&routes, &["route-a", "route-b"]);
        routes = envoy.next(ROUTE, "route-b").await;
    }
    envoy.ack(&routes, &["route-a", "route-b"]);
    held_for(gw.admin, CLUSTER, "listeners", "DRAINING", "remove").await;
    let row = row(gw.admin, CLUSTER).await;
    assert_eq!(row["status"], "SYNCED", "{row}");
    assert_eq!(row["order"]["status"], "DRAINING", "{row}");

    let (code, stdout, _) = crate::operating::subcommand("status", &["--admin", &gw.admin.to_string()]).await;
    assert_eq!(code, Some(0), "a removal waiting for a drain is in sync:\n{stdout}");
    assert!(
        stdout.contains(
            "DRAINING envoy-order envoy/config/cluster/v3/clusters: its removals wait for a listener the client \
             drains (--listener-drain-time), until "
        ),
        "{stdout}"
    );
    let metrics = crate::helpers::http_get(gw.monitoring, "/metrics").await.1;
    let drained = crate::helpers::sample(
        &metrics,
        "mcp_gateway_order_holds_total",
        &["collection=\"envoy/config/cluster/v3/clusters\"", "step=\"drain\""],
    );
    assert_eq!(drained, Some(1.0), "the drain's hold counted once");
    let logged = gw.log_line("a removal waits for a listener the client drains").await;
    assert!(logged.contains("drain_seconds=600"), "{logged}");
}

/// A NACK of a response that carries a change's additions with drained
/// clusters kept refuses that change: the route to the refused cluster is
/// held (issue 41's independent check: it went, `503 NC`, while a drain was
/// running).
#[tokio::test]
async fn a_refused_cluster_holds_its_route_while_a_drain_runs() {
    let version = |clusters: &[(&str, u16)], route_to: &str| {
        let mut config = Config::new(Kind::Static, clusters, route_to);
        config.tcp_to = Some("cluster-a");
        config
    };
    let mut first = version(&[("cluster-a", 1), ("cluster-t", 2)], "cluster-a");
    first.tcp_to = Some("cluster-t");
    let mut volume = Volume::new(&first);
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let (mut envoy, clusters, _) = Sotw::synced_with_listeners(gw.listen, gw.admin, Some(ROUTE_NAME)).await;

    // The TCP listener moves off cluster-t, which goes: it drains (600 s).
    volume.swap(&version(&[("cluster-a", 1)], "cluster-a"));
    let listeners = envoy.next(LISTENER, "the listener moved to cluster-a").await;
    envoy.ack(&listeners, &[]);
    held_for(gw.admin, CLUSTER, "listeners", "DRAINING", "remove").await;

    // A new cluster, refused, and the route to it: the route waits.
    volume.swap(&version(&[("cluster-a", 1), ("cluster-y", 3)], "cluster-y"));
    let refused = envoy.next(CLUSTER, "the new cluster, cluster-t kept").await;
    assert_eq!(sotw_names(&refused), ["cluster-a", "cluster-t", "cluster-y"]);
    envoy.nack(&refused, &clusters.version_info, "cluster-y: refused by the test");
    held_for(gw.admin, ROUTE, "clusters", "NACKED", "add").await;
}

/// A refused cluster keeps holding the route to it when the source changes
/// something else of the clusters (an unused one removed): the next
/// clusters response carries the refused one again, and the route waits for
/// its answer (issue 41's re-check: the route went, `503 NC`).
#[tokio::test]
async fn a_refused_cluster_holds_its_route_through_an_unrelated_removal() {
    let mut volume = Volume::new(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-u", 2)],
        "cluster-a",
    ));
    let gw = start_gateway(&["--source-dir", volume.path()]).await;
    let (mut envoy, clusters) = Sotw::synced(gw.listen, gw.admin).await;

    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-u", 2), ("cluster-x", 3)],
        "cluster-x",
    ));
    let refused = envoy.next(CLUSTER, "the refused cluster").await;
    envoy.nack(&refused, &clusters.version_info, "cluster-x: refused by the test");
    held_for(gw.admin, ROUTE, "clusters", "NACKED", "add").await;

    // Only the unused cluster goes: the route waits for the clusters (whose
    // next response would be the refused one again: nothing goes).
    let before = row(gw.admin, CLUSTER).await["current_version"].clone();
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-x", 3)],
        "cluster-x",
    ));
    eventually_some("the clusters' new version", || async {
        (row(gw.admin, CLUSTER).await["current_version"] != before).then_some(())
    })
    .await;
    assert!(row(gw.admin, ROUTE).await["order"]["status"] == "HELD");
    // Fixed: the clusters come first (nothing came between), then the route.
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-x", 4)],
        "cluster-x",
    ));
    let fixed = envoy.next(CLUSTER, "the fixed cluster before any route").await;
    assert_eq!(sotw_names(&fixed), ["cluster-a", "cluster-u", "cluster-x"]);
    envoy.ack(&fixed, &[]);
    let route = envoy.next(ROUTE, "the route once its cluster is taken").await;
    assert_eq!(
        routes_to(&[&route.resources[0].value], &["cluster-a", "cluster-x"]),
        "cluster-x"
    );
}

/// A client that refused a cluster before the gateway restarted, and
/// refuses it again when it comes back (the NACK memory resends it): a
/// route change that names only clusters it holds goes all the same
/// (issue 41's re-check: every listener and route change of that client
/// waited until the source changed the refused cluster; nothing was
/// known of what the refused first response carried). The refused
/// response's names come from the NACK memory's record of it.
#[tokio::test]
async fn a_cluster_refused_across_a_restart_holds_only_what_sends_to_it() {
    let cache = tempfile::tempdir().unwrap();
    let cache_flag = cache.path().to_str().unwrap().to_owned();
    let mut volume = Volume::new(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-z", 2)],
        "cluster-a",
    ));
    let gw = spawn_gateway(None, &["--source-dir", volume.path(), "--cache-dir", &cache_flag]).await;
    let mut envoy = Delta::open(gw.listen).await;
    let mut held: std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>> = Default::default();
    let mut record = |response: &DeltaDiscoveryResponse| {
        let of = held.entry(response.type_url.clone()).or_default();
        for r in &response.resources {
            of.insert(r.name.clone(), r.version.clone());
        }
        for name in &response.removed_resources {
            of.remove(name);
        }
    };
    envoy.subscribe(CLUSTER, &[], &[]);
    let (clusters, _, _) = envoy.next(CLUSTER, "the clusters").await;
    envoy.ack(&clusters);
    record(&clusters);
    envoy.subscribe(ROUTE, &[ROUTE_NAME], &[]);
    let (route, _, _) = envoy.next(ROUTE, "the route").await;
    envoy.ack(&route);
    record(&route);
    // cluster-b comes, and the client refuses it.
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-b", 3), ("cluster-z", 2)],
        "cluster-a",
    ));
    let (clusters, sent, _) = envoy.next(CLUSTER, "cluster-b").await;
    assert_eq!(sent, ["cluster-b"]);
    envoy.nack(&clusters);
    let mut gw = gw;
    gw.logged("client NACKed").await;
    assert!(gw.stop().await);

    // While it is down, the route moves to cluster-z, which it holds.
    volume.swap(&Config::new(
        Kind::Static,
        &[("cluster-a", 1), ("cluster-b", 3), ("cluster-z", 2)],
        "cluster-z",
    ));
    let gw = spawn_gateway(None, &["--source-dir", volume.path(), "--cache-dir", &cache_flag]).await;
    let mut envoy = Delta::open(gw.listen).await;
    let reported = |type_url: &str| -> Vec<(String, String)> {
        held.get(type_url)
            .map(|h| h.clone().into_iter().collect())
            .unwrap_or_default()
    };
    let (clusters_held, route_held) = (reported(CLUSTER), reported(ROUTE));
    envoy.resume(CLUSTER, &[], &as_refs(&clusters_held));
    envoy.resume(ROUTE, &[ROUTE_NAME], &as_refs(&route_held));
    let mut route_to = None;
    for _ in 0..2 {
        let response = envoy.stream.recv().await;
        if response.type_url == CLUSTER {
            // cluster-b again (what it refused is resent): refused again.
            let sent: Vec<&str> = response.resources.iter().map(|r| r.name.as_str()).collect();
            assert_eq!(sent, ["cluster-b"], "the refused cluster resent, the held ones not");
            envoy.nack(&response);
        } else {
            route_to = Some(delta_routes_to(&response, &["cluster-a", "cluster-b", "cluster-z"]));
            envoy.ack(&response);
        }
    }
    assert_eq!(
        route_to.as_deref(),
        Some("cluster-z"),
        "the route to a held cluster is not held"
    );
    assert!(gw.stop().await);
}

/// `(name, version)` pairs as the borrowed pairs `Delta::resume` takes.
fn as_refs(held: &[(String, String)]) -> Vec<(&str, &str)> {
    held.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect()
}
