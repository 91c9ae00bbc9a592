//! A real Envoy 1.40 reading its clusters and listeners from the gateway's
//! v3 ADS, state of the world and delta, fed by the files source: what it
//! gets, that it follows edits, that a cluster it refuses is never sent to it
//! again while the rest keeps flowing, and that it resumes after the gateway
//! restarts. Skipped, loudly, where Envoy cannot be installed.

use std::path::Path;

use base64::Engine;
use prost::Message;

use crate::helpers::envoy::{skip_without_envoy, AdsApi, Envoy};
use crate::helpers::{start_gateway, start_gateway_on};

const CLUSTERS: &str = "envoy/config/cluster/v3/clusters";
const LISTENERS: &str = "envoy/config/listener/v3/listeners";
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const TCP_PROXY_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";

// The few fields of Envoy's resources these tests write (field numbers from
// data-plane-api); the gateway carries bodies as bytes and compiles none.

#[derive(Clone, PartialEq, Message)]
struct SocketAddress {
    #[prost(string, tag = "2")]
    address: String,
    /// In a oneof: present even when 0 (a port of the kernel's choosing).
    #[prost(uint32, optional, tag = "3")]
    port_value: Option<u32>,
}

#[derive(Clone, PartialEq, Message)]
struct Address {
    #[prost(message, optional, tag = "1")]
    socket_address: Option<SocketAddress>,
}

#[derive(Clone, PartialEq, Message)]
struct Endpoint {
    #[prost(message, optional, tag = "1")]
    address: Option<Address>,
}

#[derive(Clone, PartialEq, Message)]
struct LbEndpoint {
    #[prost(message, optional, tag = "1")]
    endpoint: Option<Endpoint>,
}

#[derive(Clone, PartialEq, Message)]
struct LocalityLbEndpoints {
    #[prost(message, repeated, tag = "2")]
    lb_endpoints: Vec<LbEndpoint>,
}

#[derive(Clone, PartialEq, Message)]
struct ClusterLoadAssignment {
    #[prost(string, tag = "1")]
    cluster_name: String,
    #[prost(message, repeated, tag = "2")]
    endpoints: Vec<LocalityLbEndpoints>,
}

/// `envoy.config.cluster.v3.Cluster`: STATIC (type 0) with one endpoint.
#[derive(Clone, PartialEq, Message)]
struct Cluster {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, optional, tag = "4")]
    connect_timeout: Option<prost_types::Duration>,
    #[prost(message, optional, tag = "33")]
    load_assignment: Option<ClusterLoadAssignment>,
}

#[derive(Clone, PartialEq, Message)]
struct TcpProxy {
    #[prost(string, tag = "1")]
    stat_prefix: String,
    #[prost(string, tag = "2")]
    cluster: String,
}

#[derive(Clone, PartialEq, Message)]
struct Filter {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, optional, tag = "4")]
    typed_config: Option<prost_types::Any>,
}

#[derive(Clone, PartialEq, Message)]
struct FilterChain {
    #[prost(message, repeated, tag = "3")]
    filters: Vec<Filter>,
}

#[derive(Clone, PartialEq, Message)]
struct Listener {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, optional, tag = "2")]
    address: Option<Address>,
    #[prost(message, repeated, tag = "3")]
    filter_chains: Vec<FilterChain>,
}

fn socket(port_value: u32) -> Option<Address> {
    Some(Address {
        socket_address: Some(SocketAddress {
            address: "127.0.0.1".into(),
            port_value: Some(port_value),
        }),
    })
}

/// A valid cluster, or (`valid` false) one Envoy's validation refuses: a
/// connect timeout of zero (`gt: {}`).
fn cluster(name: &str, port: u32, valid: bool) -> Vec<u8> {
    Cluster {
        name: name.into(),
        connect_timeout: Some(prost_types::Duration {
            seconds: i64::from(valid),
            nanos: 0,
        }),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    endpoint: Some(Endpoint { address: socket(port) }),
                }],
            }],
        }),
    }
    .encode_to_vec()
}

/// A TCP proxy to `cluster` on a port of the kernel's choosing.
fn listener(name: &str, cluster: &str) -> Vec<u8> {
    Listener {
        name: name.into(),
        address: socket(0),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.tcp_proxy".into(),
                typed_config: Some(prost_types::Any {
                    type_url: TCP_PROXY_TYPE.into(),
                    value: TcpProxy {
                        stat_prefix: name.into(),
                        cluster: cluster.into(),
                    }
                    .encode_to_vec(),
                }),
            }],
        }],
    }
    .encode_to_vec()
}

fn doc(collection: &str, name: &str, type_url: &str, body: &[u8]) -> String {
    let value = base64::engine::general_purpose::STANDARD.encode(body);
    format!("collection: {collection}\nname: {name}\nbody:\n  type_url: {type_url}\n  value_base64: {value}\n---\n")
}

/// Writes the clusters (name, valid) and one listener to `backend`.
fn write_config(dir: &Path, clusters: &[(&str, bool)]) {
    let mut text = String::new();
    for (name, valid) in clusters {
        text += &doc(CLUSTERS, name, CLUSTER_TYPE, &cluster(name, 9, *valid));
    }
    crate::helpers::certs::write(dir, "clusters.yaml", &text);
    crate::helpers::certs::write(
        dir,
        "listeners.yaml",
        &doc(LISTENERS, "ingress", LISTENER_TYPE, &listener("ingress", "backend")),
    );
}

fn names(found: &[(String, String)]) -> Vec<&str> {
    let mut names: Vec<&str> = found.iter().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    names
}

async fn envoy_follows_edits_and_never_gets_a_refused_version_again(api: AdsApi, test: &str) {
    if skip_without_envoy(test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), &[("backend", true)]);
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag]).await;
    let envoy = Envoy::start(gw.listen, api, "envoy-1").await.unwrap();

    envoy
        .clusters_when("the cluster from the files", |c| names(c) == ["backend"])
        .await;
    envoy
        .listeners_when("the listener from the files", |l| names(l) == ["ingress"])
        .await;
    envoy.wait_ads_connected().await;

    // An edit reaches Envoy.
    write_config(dir.path(), &[("backend", true), ("web", true)]);
    envoy
        .clusters_when("the added cluster", |c| names(c) == ["backend", "web"])
        .await;

    // A cluster Envoy refuses: it NACKs, the gateway records it and never
    // sends that version again.
    write_config(dir.path(), &[("backend", true), ("broken", false), ("web", true)]);
    envoy.stat_when("cluster_manager.cds.update_rejected", |v| v == 1).await;
    crate::helpers::eventually("the gateway to record Envoy's NACK", || {
        gw.registry
            .streams()
            .iter()
            .flat_map(|s| s.types.values())
            .any(|t| t.last_nack.as_ref().is_some_and(|n| n.message.contains("broken")))
    })
    .await;

    // The rest keeps flowing: a later version (the fix, and a listener
    // change) is sent and accepted; the refused one was not sent again (a
    // second rejection would show).
    write_config(dir.path(), &[("backend", true), ("broken", true), ("web", true)]);
    envoy
        .clusters_when("the fixed cluster", |c| names(c) == ["backend", "broken", "web"])
        .await;
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(1));

    // The gateway restarts on the same port, with a cluster gone meanwhile:
    // Envoy reconnects and converges.
    let listen = gw.listen.to_string();
    assert!(gw.shutdown().await);
    write_config(dir.path(), &[("backend", true), ("web", true)]);
    let _again = start_gateway_on(&listen, &["--source-dir", &dir_flag]).await;
    envoy
        .clusters_when("the clusters after the restart", |c| names(c) == ["backend", "web"])
        .await;
    envoy
        .listeners_when("the listener after the restart", |l| names(l) == ["ingress"])
        .await;
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(1));
}

#[tokio::test]
async fn envoy_state_of_the_world() {
    envoy_follows_edits_and_never_gets_a_refused_version_again(AdsApi::Sotw, "envoy::envoy_state_of_the_world").await;
}

#[tokio::test]
async fn envoy_delta() {
    envoy_follows_edits_and_never_gets_a_refused_version_again(AdsApi::Delta, "envoy::envoy_delta").await;
}
