//! Envoy's v3 ADS on the client port: MCP over xDS as istiod 1.8+ reads it
//! (`pkg/adsc`: GVK type URLs, every type requested back to back with nonces
//! the gateway never issued, the node on every ACK, never a NACK), and plain
//! xDS for Envoy-typed collections, state of the world and delta.

use std::collections::HashMap;
use std::path::Path;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use mcp_xds_gateway::proto::Resource;
use prost::Message;

use crate::helpers::clients::{channel, Bidi};
use crate::helpers::galley::{incremental, resource, FakeGalley};
use crate::helpers::{eventually, galley_and_gateway, gateway_for, start_gateway, within, VS};

pub(crate) const SOTW: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
const MCP_RESOURCE: &str = "type.googleapis.com/istio.mcp.v1alpha1.Resource";
const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const VS_V1: &str = "networking.istio.io/v1/VirtualService";
pub(crate) const VS_V1ALPHA3: &str = "networking.istio.io/v1alpha3/VirtualService";

/// What istiod 1.24 to 1.30 asks for (`collections.Pilot`), MeshConfig first.
const ISTIOD_1_24: [&str; 15] = [
    "core/v1alpha1/MeshConfig",
    "networking.istio.io/v1/DestinationRule",
    "networking.istio.io/v1alpha3/EnvoyFilter",
    "networking.istio.io/v1/Gateway",
    "networking.istio.io/v1/ServiceEntry",
    "networking.istio.io/v1/Sidecar",
    VS_V1,
    "networking.istio.io/v1/WorkloadEntry",
    "networking.istio.io/v1/WorkloadGroup",
    "networking.istio.io/v1beta1/ProxyConfig",
    "security.istio.io/v1/AuthorizationPolicy",
    "security.istio.io/v1/PeerAuthentication",
    "security.istio.io/v1/RequestAuthentication",
    "telemetry.istio.io/v1/Telemetry",
    "extensions.istio.io/v1alpha1/WasmPlugin",
];

pub(crate) type SotwStream = Bidi<DiscoveryRequest, DiscoveryResponse>;
type DeltaStream = Bidi<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

/// istiod's node (`pkg/adsc`): `GENERATOR: api` in the metadata.
pub(crate) fn istiod_node() -> Option<Node> {
    let generator = prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue("api".into())),
    };
    Some(Node {
        id: "sidecar~10.244.0.42~istiod-1.istio-system~istio-system.svc.cluster.local".into(),
        metadata: Some(prost_types::Struct {
            fields: [("GENERATOR".to_owned(), generator)].into(),
        }),
        ..Default::default()
    })
}

/// Opens a stream and sends every type back to back, as `adsc.Run()` does:
/// the node on the first only, each with a nonce the gateway never issued.
pub(crate) async fn istiod(addr: std::net::SocketAddr, types: &[&str]) -> SotwStream {
    let stream = SotwStream::open(addr, SOTW).await;
    for (i, type_url) in types.iter().enumerate() {
        stream.send(DiscoveryRequest {
            type_url: (*type_url).into(),
            response_nonce: format!("2026-11-23 14:00:00.{i:03} +0000 UTC m=+0.51"),
            node: if i == 0 { istiod_node() } else { None },
            ..Default::default()
        });
    }
    stream
}

/// istiod's ACK: the nonce and version back, the node on every one.
pub(crate) fn ack(stream: &SotwStream, response: &DiscoveryResponse) {
    stream.send(DiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        version_info: response.version_info.clone(),
        node: istiod_node(),
        ..Default::default()
    });
}

/// The MCP resources of a response, checked to be what istiod decodes.
pub(crate) fn mcp_resources(response: &DiscoveryResponse) -> Vec<Resource> {
    response
        .resources
        .iter()
        .map(|any| {
            assert_eq!(any.type_url, MCP_RESOURCE, "each resource an Any of an MCP Resource");
            Resource::decode(any.value.as_slice()).expect("an istio.mcp.v1alpha1.Resource")
        })
        .collect()
}

fn vs_doc(name: &str, version: u32, host: &str) -> String {
    format!(
        "collection: {VS}\nname: {name}\nversion: \"{version}\"\nlabels: {{app: reviews}}\nbody:\n  struct:\n    hosts: [{host}]\n---\n"
    )
}

fn write(dir: &Path, name: &str, text: &str) {
    crate::helpers::certs::write(dir, name, text);
}

/// Reads one response per type, in whatever order they come.
pub(crate) async fn one_each(stream: &mut SotwStream, count: usize) -> HashMap<String, DiscoveryResponse> {
    let mut by_type = HashMap::new();
    for _ in 0..count {
        let response = stream.recv().await;
        let type_url = response.type_url.clone();
        assert!(
            by_type.insert(type_url.clone(), response).is_none(),
            "{type_url} answered twice before its ACK"
        );
    }
    by_type
}

#[tokio::test]
async fn an_istiod_client_is_answered_every_type_it_asks_for_in_full() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "config.yaml",
        &(vs_doc("default/reviews", 1, "reviews") + &vs_doc("default/ratings", 1, "ratings")),
    );
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag]).await;

    let mut types: Vec<&str> = ISTIOD_1_24.to_vec();
    types.extend(["extensions.istio.io/v1alpha1/TrafficExtension", "istio.io/debug/syncz"]);
    let mut istiod_1_24 = istiod(gw.listen, &types).await;
    let first = one_each(&mut istiod_1_24, types.len()).await;
    for type_url in &types {
        assert!(first.contains_key(*type_url), "{type_url} is answered");
    }
    let vs = &first[VS_V1];
    let resources = mcp_resources(vs);
    // In the order the resources arrived in (the file's), not name order.
    let mut names: Vec<&str> = resources
        .iter()
        .map(|r| r.metadata.as_ref().unwrap().name.as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["default/ratings", "default/reviews"],
        "metadata.name is namespace/name"
    );
    for resource in &resources {
        let metadata = resource.metadata.as_ref().unwrap();
        assert!(
            metadata.create_time.is_some(),
            "istiod 1.8 to 1.15 skip a resource without create_time"
        );
        assert!(!metadata.version.is_empty());
        assert_eq!(metadata.labels["app"], "reviews", "labels pass through");
        assert_eq!(
            resource.body.as_ref().unwrap().type_url,
            "type.googleapis.com/google.protobuf.Struct"
        );
    }
    assert_eq!(
        vs.version_info,
        *gw.cache.get(VS).unwrap().version,
        "the cache's content version"
    );
    for empty in [
        "core/v1alpha1/MeshConfig",
        "extensions.istio.io/v1alpha1/TrafficExtension",
        "istio.io/debug/syncz",
        "networking.istio.io/v1/Sidecar",
        "security.istio.io/v1/AuthorizationPolicy",
    ] {
        assert!(first[empty].resources.is_empty(), "{empty} is answered empty");
    }

    // An older istiod asks for the v1alpha3 alias: the same resources, at the
    // same versions.
    let mut istiod_1_8 = istiod(gw.listen, &[VS_V1ALPHA3]).await;
    let alias = istiod_1_8.recv().await;
    assert_eq!(alias.type_url, VS_V1ALPHA3);
    assert_eq!(alias.version_info, vs.version_info);
    assert_eq!(mcp_resources(&alias), resources);

    // istiod ACKs everything but MeshConfig, whose ACK is never waited for.
    for response in first.values().filter(|r| r.type_url != "core/v1alpha1/MeshConfig") {
        ack(&istiod_1_24, response);
    }
    ack(&istiod_1_8, &alias);

    // A changed body under an unchanged version: istiod 1.12+ would skip it
    // unless metadata.version changes, so it does.
    write(
        dir.path(),
        "config.yaml",
        &(vs_doc("default/reviews", 1, "reviews-v2") + &vs_doc("default/ratings", 1, "ratings")),
    );
    let changed = istiod_1_24.recv().await;
    assert_eq!(changed.type_url, VS_V1, "only the type that changed is sent");
    let after = mcp_resources(&changed);
    let version_of = |resources: &[Resource], name: &str| {
        resources
            .iter()
            .map(|r| r.metadata.clone().unwrap())
            .find(|m| m.name == name)
            .unwrap()
            .version
    };
    assert_ne!(
        version_of(&after, "default/reviews"),
        version_of(&resources, "default/reviews"),
        "metadata.version follows the content"
    );
    assert_eq!(
        version_of(&after, "default/ratings"),
        version_of(&resources, "default/ratings")
    );
    let alias_changed = istiod_1_8.recv().await;
    assert_eq!(
        mcp_resources(&alias_changed),
        after,
        "every alias serves the same content"
    );
}

/// Types the gateway does not serve are answered once, empty, and share one
/// metric label whatever the type: a client cannot add series by asking for
/// made-up types. The gateway is a process of its own, so the count is
/// exact.
#[tokio::test]
async fn unserved_types_are_answered_once_under_one_metric_label() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.yaml", &vs_doc("default/reviews", 1, "reviews"));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", &dir_flag]).await;
    let unserved = [
        "extensions.istio.io/v1alpha1/TrafficExtension",
        "example.com/v1/MadeUp",
        "example.com/v1/AlsoMadeUp",
    ];
    let mut types = vec![VS_V1];
    types.extend(unserved);
    let mut client = istiod(gw.listen, &types).await;
    let first = one_each(&mut client, types.len()).await;
    for type_url in unserved {
        assert!(first[type_url].resources.is_empty(), "{type_url} is answered empty");
    }
    for response in first.values() {
        ack(&client, response);
    }
    crate::limits::metric_is(
        gw.monitoring,
        "istio_mcp_request_acks_total{component=\"downstream\",collection=\"(unserved)\"}",
        3,
    )
    .await;
    let (_, exposition) = crate::helpers::http_get(gw.monitoring, "/metrics").await;
    for type_url in unserved {
        assert!(!exposition.contains(type_url), "no series names {type_url}");
    }
    // Answered once: the next response is the served type's change, and
    // nothing of the unserved types follows it: after its ACK, the response
    // to one more change is the served type's again.
    write(dir.path(), "config.yaml", &vs_doc("default/reviews", 2, "reviews-v2"));
    let second = client.recv().await;
    assert_eq!(second.type_url, VS_V1);
    ack(&client, &second);
    write(dir.path(), "config.yaml", &vs_doc("default/reviews", 3, "reviews-v3"));
    let third = client.recv().await;
    assert_eq!(third.type_url, VS_V1, "no unserved type re-answered after a push");
    assert_ne!(third.version_info, second.version_info);
}

#[tokio::test]
async fn a_served_type_is_answered_only_once_its_source_delivered_it() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    let mut client = istiod(gw.listen, &[VS_V1, "extensions.istio.io/v1alpha1/TrafficExtension"]).await;
    // The type nobody serves is answered at once; the served one waits: an
    // empty answer would make istiod delete every VirtualService it has.
    let unserved = client.recv().await;
    assert_eq!(unserved.type_url, "extensions.istio.io/v1alpha1/TrafficExtension");
    assert!(unserved.resources.is_empty());
    assert!(gw.cache.get(VS).is_none());

    upstream.push_full(VS, vec![resource("default/a", "1", b"a")]).await;
    let vs = client.recv().await;
    assert_eq!(vs.type_url, VS_V1);
    assert_eq!(mcp_resources(&vs).len(), 1);
}

#[tokio::test]
async fn a_type_whose_collection_the_source_refuses_is_answered_empty() {
    // Galley before 1.8 has no WorkloadGroups, and istiod 1.16+ is not ready
    // until every type it asked for has been answered.
    const WORKLOAD_GROUPS: &str = "istio/networking/v1alpha3/workloadgroups";
    const WG_V1: &str = "networking.istio.io/v1/WorkloadGroup";
    let mut galley = FakeGalley::start().await;
    galley.refuse(WORKLOAD_GROUPS);
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("default/a", "1", b"a")]).await;

    let mut client = istiod(gw.listen, &[VS_V1, WG_V1]).await;
    let answered = one_each(&mut client, 2).await;
    assert_eq!(mcp_resources(&answered[VS_V1]).len(), 1);
    assert!(answered[WG_V1].resources.is_empty(), "answered empty once refused");
    assert!(gw.subscriptions.current().refused.contains_key(WORKLOAD_GROUPS));
}

/// Opens a delta stream for `type_url`, reporting `held` (name → version).
async fn delta(addr: std::net::SocketAddr, type_url: &str, held: &[(&str, &str)]) -> DeltaStream {
    let stream = DeltaStream::open_on(channel(addr).await, DELTA).await;
    stream.send(DeltaDiscoveryRequest {
        node: istiod_node(),
        type_url: type_url.into(),
        initial_resource_versions: held.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(),
        ..Default::default()
    });
    stream
}

pub(crate) fn delta_ack(stream: &DeltaStream, response: &DeltaDiscoveryResponse) {
    stream.send(DeltaDiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        ..Default::default()
    });
}

fn delta_names(response: &DeltaDiscoveryResponse) -> Vec<&str> {
    let mut names: Vec<&str> = response.resources.iter().map(|r| r.name.as_str()).collect();
    names.sort_unstable();
    names
}

fn delta_versions(response: &DeltaDiscoveryResponse) -> HashMap<String, String> {
    response
        .resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect()
}

#[tokio::test]
async fn delta_clients_get_changes_and_on_reconnect_everything_and_the_removals() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream
        .push_full(
            VS,
            vec![
                resource("ns/a", "1", b"a"),
                resource("ns/b", "1", b"b"),
                resource("ns/c", "1", b"c"),
            ],
        )
        .await;
    let mut client = delta(gw.listen, VS_V1, &[]).await;
    let first = client.recv().await;
    assert_eq!(first.type_url, VS_V1);
    assert_eq!(delta_names(&first), ["ns/a", "ns/b", "ns/c"]);
    assert!(first.removed_resources.is_empty());
    for r in &first.resources {
        let any = r.resource.as_ref().unwrap();
        assert_eq!(any.type_url, MCP_RESOURCE);
        let metadata = Resource::decode(any.value.as_slice()).unwrap().metadata.unwrap();
        assert_eq!(metadata.version, r.version, "one content version, in both places");
        assert_eq!(metadata.name, r.name);
    }
    let held = delta_versions(&first);
    delta_ack(&client, &first);

    // b's body changes under the same version; c goes.
    upstream
        .send(incremental(VS, vec![resource("ns/b", "1", b"b2")], &["ns/c"]))
        .await;
    let change = client.recv().await;
    assert_eq!(delta_names(&change), ["ns/b"]);
    assert_ne!(delta_versions(&change)["ns/b"], held["ns/b"]);
    assert_eq!(change.removed_resources, ["ns/c"]);
    delta_ack(&client, &change);

    // A NACK: that version is never sent again; the next one is.
    upstream
        .send(incremental(VS, vec![resource("ns/a", "2", b"a2")], &[]))
        .await;
    let refused = client.recv().await;
    assert_eq!(delta_names(&refused), ["ns/a"]);
    client.send(DeltaDiscoveryRequest {
        type_url: VS_V1.into(),
        response_nonce: refused.nonce.clone(),
        error_detail: Some(tonic_types::Status {
            code: 3,
            message: "bad VirtualService".into(),
            details: vec![],
        }),
        ..Default::default()
    });
    eventually("the NACK to be recorded", || {
        gw.registry
            .streams()
            .iter()
            .flat_map(|s| s.types.values())
            .any(|t| t.last_nack.is_some())
    })
    .await;
    upstream
        .send(incremental(VS, vec![resource("ns/d", "1", b"d")], &[]))
        .await;
    let next = client.recv().await;
    assert_eq!(
        delta_names(&next),
        ["ns/a", "ns/d"],
        "after a NACK, the next change goes from what it ACKed, with what the NACKed response carried again \
         (a client that refused a may not hold it)"
    );
    drop(client);

    // Reconnecting with what it reports: a at its current version, b at an
    // old one, and x that no longer exists. What an xDS client reports is
    // what it last ACKed, not what it holds after a response it applied in
    // part: everything is sent again, and x removed.
    let current_a = delta_versions(&refused)["ns/a"].clone();
    let old_b = held["ns/b"].clone();
    let mut again = delta(
        gw.listen,
        VS_V1,
        &[("ns/a", &current_a), ("ns/b", &old_b), ("ns/x", "1")],
    )
    .await;
    let resumed = again.recv().await;
    assert_eq!(
        delta_names(&resumed),
        ["ns/a", "ns/b", "ns/d"],
        "everything, whatever the versions reported"
    );
    assert_eq!(resumed.removed_resources, ["ns/x"]);
}

/// An Envoy `Cluster{name}` encoded by hand (field 1): Envoy's resource
/// protos are not compiled into the gateway, which carries bodies as bytes.
fn cluster_bytes(name: &str) -> Vec<u8> {
    let mut bytes = vec![0x0a, name.len() as u8];
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

pub(crate) fn cluster_doc(name: &str) -> String {
    use base64::Engine;
    let value = base64::engine::general_purpose::STANDARD.encode(cluster_bytes(name));
    format!("collection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: {CLUSTER}\n  value_base64: {value}\n---\n")
}

#[tokio::test]
async fn envoy_types_are_served_as_their_bodies_in_both_protocols() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "clusters.yaml",
        &(cluster_doc("backend") + &cluster_doc("web")),
    );
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag]).await;

    let mut sotw = SotwStream::open(gw.listen, SOTW).await;
    sotw.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        node: istiod_node(),
        ..Default::default()
    });
    let clusters = sotw.recv().await;
    assert_eq!(clusters.type_url, CLUSTER);
    let bodies: Vec<(&str, &[u8])> = clusters
        .resources
        .iter()
        .map(|any| (any.type_url.as_str(), any.value.as_slice()))
        .collect();
    assert_eq!(
        bodies,
        [
            (CLUSTER, cluster_bytes("backend").as_slice()),
            (CLUSTER, cluster_bytes("web").as_slice())
        ],
        "the resources are the bodies themselves"
    );

    let mut delta = delta(gw.listen, CLUSTER, &[]).await;
    let first = delta.recv().await;
    assert_eq!(delta_names(&first), ["backend", "web"]);
    let web = first.resources.iter().find(|r| r.name == "web").unwrap();
    assert_eq!(web.resource.as_ref().unwrap().value, cluster_bytes("web"));
    delta_ack(&delta, &first);

    write(dir.path(), "clusters.yaml", &cluster_doc("web"));
    let removed = within("the removal", delta.recv()).await;
    assert!(removed.resources.is_empty());
    assert_eq!(removed.removed_resources, ["backend"]);
    ack_sotw(&sotw, &clusters);
    let now = sotw.recv().await;
    assert_eq!(now.resources.len(), 1);
}

pub(crate) fn ack_sotw(stream: &SotwStream, response: &DiscoveryResponse) {
    stream.send(DiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        version_info: response.version_info.clone(),
        ..Default::default()
    });
}

/// Envoy's named subscriptions (RDS, EDS): state-of-the-world names replace
/// the subscription; delta names are added and removed on any request,
/// names that do not exist are removed and stay subscribed, a name the
/// client already has is sent again when it subscribes to it; a client
/// naming too many is refused with the flag's name.
/// A named client is woken only by a version that changes one of its names
/// (issue 34's wake index): a version that leaves them alone sends it
/// nothing and shows it synced at that version; a name it adds with an ACK
/// wakes it from then on.
#[tokio::test]
async fn a_named_client_is_woken_by_its_names_only_and_shown_synced_at_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let clusters = |names: &[&str]| names.iter().map(|n| cluster_doc(n)).collect::<String>();
    write(dir.path(), "clusters.yaml", &clusters(&["a", "b"]));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", &dir_flag]).await;
    let names = |list: &[&str]| list.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let ack = |response: &DiscoveryResponse, asked: &[&str]| DiscoveryRequest {
        type_url: CLUSTER.into(),
        response_nonce: response.nonce.clone(),
        version_info: response.version_info.clone(),
        resource_names: names(asked),
        ..Default::default()
    };
    // Its row once it shows the current version other than `not`, synced.
    let synced_past = |not: String| {
        let admin = gw.admin;
        async move {
            crate::helpers::eventually_some("the client shown synced at the new version", || {
                let not = not.clone();
                async move {
                    let view = crate::helpers::get_json(admin, "/debug/syncz").await;
                    view["rows"]
                        .as_array()?
                        .iter()
                        .find(|r| r["type_url"] == CLUSTER && r["current_version"] != *not.as_str())
                        .filter(|r| r["status"] == "SYNCED")
                        .cloned()
                }
            })
            .await
        }
    };

    let mut sotw = SotwStream::open(gw.listen, SOTW).await;
    sotw.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        node: istiod_node(),
        resource_names: names(&["a"]),
        ..Default::default()
    });
    let first = sotw.recv().await;
    assert_eq!(first.resources.len(), 1);
    sotw.send(ack(&first, &["a"]));
    // c appears: not its name. Nothing is sent; it holds the new version.
    write(dir.path(), "clusters.yaml", &clusters(&["a", "b", "c"]));
    let row = synced_past(first.version_info.clone()).await;
    assert_eq!(row["acked"]["version"], row["current_version"], "{row}");
    // It adds c with an ACK: answered at once, and c is its name from now on.
    sotw.send(ack(&first, &["a", "c"]));
    let with_c = sotw.recv().await;
    assert_eq!(with_c.resources.len(), 2);
    sotw.send(ack(&with_c, &["a", "c"]));
    // b goes: not its name, nothing sent, synced again.
    write(dir.path(), "clusters.yaml", &clusters(&["a", "c"]));
    synced_past(with_c.version_info.clone()).await;
    // c goes: its name. The next response is this one (none was sent for b).
    write(dir.path(), "clusters.yaml", &clusters(&["a"]));
    let without_c = within("the response without c", sotw.recv()).await;
    let values: Vec<&[u8]> = without_c.resources.iter().map(|r| r.value.as_slice()).collect();
    assert_eq!(values, [cluster_bytes("a")]);
    assert_ne!(without_c.version_info, with_c.version_info);
}

/// The `cluster_name` (field 1, written first) of a `ClusterLoadAssignment`
/// the files source encoded.
fn load_assignment_name(body: &[u8]) -> String {
    assert_eq!(body[0], 0x0a, "cluster_name first");
    let len = body[1] as usize;
    assert!(len < 0x80, "a short name");
    String::from_utf8(body[2..2 + len].to_vec()).unwrap()
}

/// State of the world, to a client naming the load assignments it asks for
/// (Envoy's EDS; route configurations the same): the first response carries
/// every name that exists, each after it only what changed and what it newly
/// asks for, and a version that only removes one of its names sends it
/// nothing (it keeps it, as it would if left out of the whole) and shows it
/// synced there. With `--sotw-resend-unchanged`, every response carries all.
#[tokio::test]
async fn named_load_assignment_responses_carry_what_changed() {
    use crate::helpers::grpc::{endpoints, write_files, EDS};
    for resend in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let files = |docs: &[(&str, u16)]| -> Vec<String> { docs.iter().map(|(n, p)| endpoints(n, &[*p])).collect() };
        write_files(dir.path(), &files(&[("a", 1), ("b", 1), ("c", 1)]));
        let dir_flag = dir.path().to_str().unwrap().to_owned();
        let mut flags = vec!["--source-dir", &dir_flag];
        if resend {
            flags.push("--sotw-resend-unchanged");
        }
        let gw = crate::helpers::spawn_gateway(None, &flags).await;
        let asked = |list: &[&str]| list.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let carried = |response: &DiscoveryResponse| -> Vec<String> {
            assert!(response.resources.iter().all(|r| r.type_url == EDS), "{response:?}");
            response
                .resources
                .iter()
                .map(|r| load_assignment_name(&r.value))
                .collect()
        };
        let ack = |sotw: &SotwStream, response: &DiscoveryResponse, names: &[&str]| {
            sotw.send(DiscoveryRequest {
                type_url: EDS.into(),
                response_nonce: response.nonce.clone(),
                version_info: response.version_info.clone(),
                resource_names: asked(names),
                ..Default::default()
            })
        };
        let all_or = |all: &[&str], changed: &[&str]| -> Vec<String> { asked(if resend { all } else { changed }) };

        let mut sotw = SotwStream::open(gw.listen, SOTW).await;
        sotw.send(DiscoveryRequest {
            type_url: EDS.into(),
            node: istiod_node(),
            resource_names: asked(&["a", "b"]),
            ..Default::default()
        });
        let first = sotw.recv().await;
        assert_eq!(carried(&first), ["a", "b"], "the first: every name");
        ack(&sotw, &first, &["a", "b"]);
        // a changes.
        write_files(dir.path(), &files(&[("a", 2), ("b", 1), ("c", 1)]));
        let second = within("a's change", sotw.recv()).await;
        assert_eq!(carried(&second), all_or(&["a", "b"], &["a"]), "resend={resend}");
        // c asked for anew, with the ACK: at the same version.
        ack(&sotw, &second, &["a", "b", "c"]);
        let third = within("the new name", sotw.recv()).await;
        assert_eq!(third.version_info, second.version_info);
        assert_eq!(carried(&third), all_or(&["a", "b", "c"], &["c"]), "resend={resend}");
        ack(&sotw, &third, &["a", "b", "c"]);
        // b goes: nothing to send but to the client that is sent all.
        write_files(dir.path(), &files(&[("a", 2), ("c", 1)]));
        if resend {
            let fourth = within("the response without b", sotw.recv()).await;
            assert_eq!(carried(&fourth), ["a", "c"]);
            ack(&sotw, &fourth, &["a", "b", "c"]);
        } else {
            crate::helpers::eventually_some("the client shown synced past b's removal", || async {
                let view = crate::helpers::get_json(gw.admin, "/debug/syncz").await;
                view["rows"]
                    .as_array()?
                    .iter()
                    .find(|r| r["type_url"] == EDS && r["current_version"] != *third.version_info.as_str())
                    .filter(|r| r["status"] == "SYNCED")
                    .cloned()
            })
            .await;
        }
        // c changes: the next response is this one.
        write_files(dir.path(), &files(&[("a", 2), ("c", 3)]));
        let last = within("c's change", sotw.recv()).await;
        assert_eq!(carried(&last), all_or(&["a", "c"], &["c"]), "resend={resend}");
    }
}

#[tokio::test]
async fn named_subscriptions_in_both_protocols() {
    let dir = tempfile::tempdir().unwrap();
    let clusters = |names: &[&str]| names.iter().map(|n| cluster_doc(n)).collect::<String>();
    write(dir.path(), "clusters.yaml", &clusters(&["a", "b", "c"]));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    // A gateway process of its own: the refusals are counted exactly.
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", &dir_flag, "--max-subscribed-names", "3"]).await;
    let names = |list: &[&str]| list.iter().map(|n| n.to_string()).collect::<Vec<_>>();

    // State of the world.
    let mut sotw = SotwStream::open(gw.listen, SOTW).await;
    sotw.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        node: istiod_node(),
        resource_names: names(&["a", "ghost"]),
        ..Default::default()
    });
    let first = sotw.recv().await;
    assert_eq!(
        first.resources,
        [prost_types::Any {
            type_url: CLUSTER.into(),
            value: cluster_bytes("a")
        }]
    );
    // Another name with the ACK: the new set at the same version.
    sotw.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        response_nonce: first.nonce.clone(),
        version_info: first.version_info.clone(),
        resource_names: names(&["a", "b"]),
        ..Default::default()
    });
    let second = sotw.recv().await;
    assert_eq!(second.version_info, first.version_info);
    let values: Vec<&[u8]> = second.resources.iter().map(|r| r.value.as_slice()).collect();
    assert_eq!(values, [cluster_bytes("a"), cluster_bytes("b")]);
    // The debug view shows the subscription.
    let clients = crate::helpers::get_json(gw.admin, "/debug/clients").await;
    let subscribed = &clients[0]["types"][CLUSTER]["subscribed"];
    assert_eq!(
        *subscribed,
        serde_json::json!({"wildcard": false, "count": 2, "names": ["a", "b"]}),
        "{clients}"
    );

    // Delta.
    let mut delta = DeltaStream::open_on(channel(gw.listen).await, DELTA).await;
    delta.send(DeltaDiscoveryRequest {
        node: istiod_node(),
        type_url: CLUSTER.into(),
        resource_names_subscribe: names(&["a", "ghost"]),
        ..Default::default()
    });
    let first = delta.recv().await;
    assert_eq!(delta_names(&first), ["a"]);
    assert_eq!(
        first.removed_resources,
        ["ghost"],
        "a name that does not exist is removed"
    );
    delta_ack(&delta, &first);
    // A spontaneous subscription, no nonce.
    delta.send(DeltaDiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names_subscribe: names(&["b"]),
        ..Default::default()
    });
    let added = delta.recv().await;
    assert_eq!(delta_names(&added), ["b"]);
    assert!(added.removed_resources.is_empty());
    delta_ack(&delta, &added);
    // It appears: sent, as it stayed subscribed; c changing is not this
    // client's concern.
    write(dir.path(), "clusters.yaml", &clusters(&["a", "b", "ghost", "d"]));
    let appeared = within("the subscribed name to appear", delta.recv()).await;
    assert_eq!(delta_names(&appeared), ["ghost"]);
    assert!(appeared.removed_resources.is_empty());
    delta_ack(&delta, &appeared);
    // Unsubscribed b, and a subscribed again though held: a is sent again.
    delta.send(DeltaDiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names_subscribe: names(&["a"]),
        resource_names_unsubscribe: names(&["b"]),
        ..Default::default()
    });
    let again = delta.recv().await;
    assert_eq!(delta_names(&again), ["a"]);
    delta_ack(&delta, &again);
    // Five names subscribed where the flag allows three.
    delta.send(DeltaDiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names_subscribe: names(&["w", "x", "y"]),
        ..Default::default()
    });
    let status = delta.end_status().await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(status.message().contains("--max-subscribed-names=3"), "{status:?}");
    // And four names in a state-of-the-world request.
    let mut over = SotwStream::open(gw.listen, SOTW).await;
    over.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        node: istiod_node(),
        resource_names: names(&["a", "b", "c", "d"]),
        ..Default::default()
    });
    let status = over.end_status().await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(status.message().contains("--max-subscribed-names=3"), "{status:?}");
    crate::limits::refusals_are(gw.monitoring, "max_subscribed_names", 2).await;
}

/// Names are read as slices of the request and checked to be UTF-8 as a
/// `string` field's decoding would: a name that is not ends the stream
/// `INVALID_ARGUMENT` naming the field, in both protocols, and a client
/// beside it is served.
#[tokio::test]
async fn names_that_are_not_utf8_end_the_stream_naming_the_field() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawSotw {
        #[prost(string, tag = "1")]
        version_info: String,
        #[prost(bytes = "vec", repeated, tag = "3")]
        resource_names: Vec<Vec<u8>>,
        #[prost(string, tag = "4")]
        type_url: String,
        #[prost(string, tag = "5")]
        response_nonce: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawDelta {
        #[prost(string, tag = "2")]
        type_url: String,
        #[prost(bytes = "vec", repeated, tag = "3")]
        subscribe: Vec<Vec<u8>>,
        #[prost(bytes = "vec", repeated, tag = "4")]
        unsubscribe: Vec<Vec<u8>>,
    }
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "clusters.yaml", &cluster_doc("backend"));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag]).await;
    let not_utf8 = vec![b'a', 0xff, b'b'];

    let mut sotw: Bidi<RawSotw, DiscoveryResponse> =
        Bidi::open_with(channel(gw.listen).await, SOTW, tonic_prost::ProstCodec::default()).await;
    sotw.send(RawSotw {
        resource_names: vec![b"backend".to_vec(), not_utf8.clone()],
        type_url: CLUSTER.into(),
        ..Default::default()
    });
    let status = sotw.end_status().await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let sotw_not_utf8 =
        "the request is not a valid envoy.service.discovery.v3.DiscoveryRequest: resource_names[1] is not UTF-8";
    assert_eq!(status.message(), sotw_not_utf8);

    // An ACK's names are not read again where they repeat the last
    // request's (known by their hash); names that change are read, and
    // checked, as a first request's are.
    let mut acking: Bidi<RawSotw, DiscoveryResponse> =
        Bidi::open_with(channel(gw.listen).await, SOTW, tonic_prost::ProstCodec::default()).await;
    acking.send(RawSotw {
        resource_names: vec![b"backend".to_vec()],
        type_url: CLUSTER.into(),
        ..Default::default()
    });
    let first = acking.recv().await;
    assert_eq!(first.resources.len(), 1);
    acking.send(RawSotw {
        version_info: first.version_info.clone(),
        resource_names: vec![b"backend".to_vec()],
        type_url: CLUSTER.into(),
        response_nonce: first.nonce.clone(),
    });
    acking.send(RawSotw {
        version_info: first.version_info.clone(),
        resource_names: vec![b"backend".to_vec(), not_utf8.clone()],
        type_url: CLUSTER.into(),
        response_nonce: first.nonce.clone(),
    });
    let status = acking.end_status().await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), sotw_not_utf8);

    for (subscribe, unsubscribe, field) in [
        (vec![not_utf8.clone()], vec![], "resource_names_subscribe[0]"),
        (
            vec![b"backend".to_vec()],
            vec![b"x".to_vec(), not_utf8.clone()],
            "resource_names_unsubscribe[1]",
        ),
    ] {
        let mut delta: Bidi<RawDelta, DeltaDiscoveryResponse> =
            Bidi::open_with(channel(gw.listen).await, DELTA, tonic_prost::ProstCodec::default()).await;
        delta.send(RawDelta {
            type_url: CLUSTER.into(),
            subscribe,
            unsubscribe,
        });
        let status = delta.end_status().await;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(
            status.message(),
            format!(
                "the request is not a valid envoy.service.discovery.v3.DeltaDiscoveryRequest: {field} is not UTF-8"
            )
        );
    }

    // A client beside them, by name: served.
    let mut good = SotwStream::open(gw.listen, SOTW).await;
    good.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names: vec!["backend".into()],
        ..Default::default()
    });
    let served = good.recv().await;
    assert_eq!(
        served.resources,
        [prost_types::Any {
            type_url: CLUSTER.into(),
            value: cluster_bytes("backend")
        }]
    );
}
