//! Clients on their failure paths, as real ones take them (Envoy, grpc): a
//! NACK after which the client holds part of what it was sent, a change of
//! names after a NACK carrying the last ACKed version, a revert to what it
//! ACKed, and named clients that a change does not concern. The real
//! clients themselves are in `envoy.rs` and `grpc.rs`; these drive the
//! protocol by hand to pin each step.
//!
//! Absence is proven by order, not by waiting: a stream sends its responses
//! in order, so when the response of a later change is the next one
//! received, an earlier change sent nothing.

use std::path::Path;

use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

use crate::helpers::{eventually, eventually_some, get_json, start_gateway, within};
use crate::xds::{SotwStream, SOTW};

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// A cluster's bytes: its name, and `alt_stat_name` as a marker of its
/// content (what an operator's edit changes).
fn cluster_bytes(name: &str, content: &str) -> Vec<u8> {
    let mut bytes = vec![0x0a, name.len() as u8];
    bytes.extend_from_slice(name.as_bytes());
    // Field 28, length-delimited.
    bytes.extend_from_slice(&[0xe2, 0x01, content.len() as u8]);
    bytes.extend_from_slice(content.as_bytes());
    bytes
}

/// The clusters file: each `(name, content)`.
fn write_clusters(dir: &Path, clusters: &[(&str, &str)]) {
    use base64::Engine;
    let docs: String = clusters
        .iter()
        .map(|(name, content)| {
            let value = base64::engine::general_purpose::STANDARD.encode(cluster_bytes(name, content));
            format!(
                "collection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: {CLUSTER}\n  \
                 value_base64: {value}\n---\n"
            )
        })
        .collect();
    crate::helpers::certs::write(dir, "clusters.yaml", &docs);
}

/// The clusters of a response, as `(name, content)`.
fn clusters(response: &DiscoveryResponse) -> Vec<(String, String)> {
    let mut clusters: Vec<(String, String)> = response
        .resources
        .iter()
        .map(|any| {
            let bytes = &any.value;
            let name_len = bytes[1] as usize;
            let name = String::from_utf8(bytes[2..2 + name_len].to_vec()).unwrap();
            let content = String::from_utf8(bytes[2 + name_len + 3..].to_vec()).unwrap();
            (name, content)
        })
        .collect();
    clusters.sort();
    clusters
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected.iter().map(|(n, c)| (n.to_string(), c.to_string())).collect()
}

/// A request as Envoy sends it: the names it wants, the version it last
/// ACKed, the nonce of the last response it received, and for a NACK the
/// error.
fn request(stream: &SotwStream, names: &[&str], version: &str, nonce: &str, nack: Option<&str>) {
    stream.send(DiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        error_detail: nack.map(|message| tonic_types::Status {
            code: 3,
            message: message.into(),
            details: vec![],
        }),
        ..Default::default()
    });
}

/// The `/debug/syncz` row of the one client of `node`.
async fn syncz_row(admin: std::net::SocketAddr, node: &str) -> serde_json::Value {
    let syncz = get_json(admin, &format!("/debug/syncz?node={node}")).await;
    let rows = syncz["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{syncz}");
    rows[0].clone()
}

async fn open(listen: std::net::SocketAddr, node: &str) -> SotwStream {
    let stream = SotwStream::open(listen, SOTW).await;
    stream.send(DiscoveryRequest {
        node: Some(mcp_xds_gateway::proto::envoy::config::core::v3::Node {
            id: node.into(),
            ..Default::default()
        }),
        type_url: CLUSTER.into(),
        resource_names: vec!["a".into()],
        ..Default::default()
    });
    stream
}

/// grpc NACKs a broken cluster a; the operator routes to b; grpc asks for b
/// (with its last ACKed version and the NACKed response's nonce) and must
/// be answered at once, though the current version is the NACKed one. Then
/// it drops a; a change to b reaches it and its ACK ends the NACK.
#[tokio::test]
async fn routing_away_from_a_nacked_cluster_is_answered_at_once() {
    let dir = tempfile::tempdir().unwrap();
    write_clusters(dir.path(), &[("a", "good"), ("b", "good")]);
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let mut client = open(gw.listen, "grpc-1").await;
    let first = within("the first response", client.recv()).await;
    assert_eq!(clusters(&first), pairs(&[("a", "good")]));
    request(&client, &["a"], &first.version_info, &first.nonce, None);

    write_clusters(dir.path(), &[("a", "broken"), ("b", "good")]);
    let broken = within("the broken cluster", client.recv()).await;
    assert_eq!(clusters(&broken), pairs(&[("a", "broken")]));
    request(
        &client,
        &["a"],
        &first.version_info,
        &broken.nonce,
        Some("cluster a: unsupported"),
    );
    eventually("the NACK shown", || {
        gw.registry.streams()[0].types[CLUSTER]
            .last_nack
            .as_ref()
            .is_some_and(|n| *n.version == *broken.version_info)
    })
    .await;

    // Routed to b: a request that is not an ACK of the NACKed response.
    request(&client, &["a", "b"], &first.version_info, &broken.nonce, None);
    let routed = within("the newly requested cluster", client.recv()).await;
    assert_eq!(routed.version_info, broken.version_info, "at the NACKed version");
    assert_eq!(clusters(&routed), pairs(&[("a", "broken"), ("b", "good")]));
    // grpc applies b and NACKs the response for a (gRFC A46), in words of
    // its own so that the row shows this NACK, not the first one.
    request(
        &client,
        &["a", "b"],
        &first.version_info,
        &routed.nonce,
        Some("cluster a: unsupported (with b)"),
    );
    let row = eventually_some("the second NACK shown", || async {
        let row = syncz_row(gw.admin, "grpc-1").await;
        (row["nack"]["message"] == "cluster a: unsupported (with b)").then_some(row)
    })
    .await;
    assert_eq!(row["status"], "NACKED", "{row}");
    assert_eq!(row["acked"]["version"], *first.version_info, "{row}");

    // a dropped: b is held, nothing to send. A change to b is the next
    // response, and its ACK ends the NACK.
    request(&client, &["b"], &first.version_info, &routed.nonce, None);
    write_clusters(dir.path(), &[("a", "broken"), ("b", "better")]);
    let changed = within("the change to b", client.recv()).await;
    assert_eq!(clusters(&changed), pairs(&[("b", "better")]));
    request(&client, &["b"], &changed.version_info, &changed.nonce, None);
    eventually("the client synced", || {
        let streams = gw.registry.streams();
        let view = &streams[0].types[CLUSTER];
        view.acked_version.as_deref() == Some(changed.version_info.as_str())
            && view.last_nack.as_ref().is_some_and(|n| n.superseded)
    })
    .await;
    let row = syncz_row(gw.admin, "grpc-1").await;
    assert_eq!(row["status"], "SYNCED", "{row}");
    assert_eq!(row["nack"]["superseded"], true, "{row}");
}

/// Envoy applies the valid clusters of a response it NACKs. After the
/// NACK, the operator reverts the files to exactly what it last ACKed: that
/// version is sent again (the client holds neither), and until it ACKs,
/// the views show it NACKED, never SYNCED on its older ACK.
#[tokio::test]
async fn a_revert_to_the_acked_version_after_a_nack_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    write_clusters(dir.path(), &[("a", "good"), ("b", "good")]);
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let client = SotwStream::open(gw.listen, SOTW).await;
    client.send(DiscoveryRequest {
        node: Some(mcp_xds_gateway::proto::envoy::config::core::v3::Node {
            id: "envoy-1".into(),
            ..Default::default()
        }),
        type_url: CLUSTER.into(),
        ..Default::default()
    });
    let mut client = client;
    let first = within("the first response", client.recv()).await;
    request(&client, &[], &first.version_info, &first.nonce, None);

    write_clusters(dir.path(), &[("a", "broken"), ("b", "changed")]);
    let broken = within("the partly broken response", client.recv()).await;
    request(&client, &[], &first.version_info, &broken.nonce, Some("cluster a: bad"));
    eventually("the NACK shown", || {
        gw.registry.streams()[0].types[CLUSTER].last_nack.is_some()
    })
    .await;

    write_clusters(dir.path(), &[("a", "good"), ("b", "good")]);
    let reverted = within("the revert", client.recv()).await;
    assert_eq!(
        reverted.version_info, first.version_info,
        "content versions: the same content"
    );
    assert_eq!(clusters(&reverted), pairs(&[("a", "good"), ("b", "good")]));
    let row = syncz_row(gw.admin, "envoy-1").await;
    assert_eq!(
        row["status"], "NACKED",
        "not SYNCED on the strength of the older ACK: {row}"
    );
    request(&client, &[], &reverted.version_info, &reverted.nonce, None);
    eventually("the NACK past", || {
        gw.registry.streams()[0].types[CLUSTER]
            .last_nack
            .as_ref()
            .is_some_and(|n| n.superseded)
    })
    .await;
    assert_eq!(syncz_row(gw.admin, "envoy-1").await["status"], "SYNCED");
}

/// Two clients naming different clusters: a change to one's cluster sends
/// the other nothing, and it is shown at the new version all the same.
#[tokio::test]
async fn a_named_client_is_sent_only_changes_to_its_names() {
    let dir = tempfile::tempdir().unwrap();
    write_clusters(dir.path(), &[("a", "1"), ("b", "1")]);
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let mut one = open(gw.listen, "client-1").await;
    let first_one = within("client 1's first", one.recv()).await;
    request(&one, &["a"], &first_one.version_info, &first_one.nonce, None);
    let two = SotwStream::open(gw.listen, SOTW).await;
    request(&two, &["b"], "", "", None);
    let mut two = two;
    let first_two = within("client 2's first", two.recv()).await;
    assert_eq!(clusters(&first_two), pairs(&[("b", "1")]));
    request(&two, &["b"], &first_two.version_info, &first_two.nonce, None);

    // b changes: client 2 only.
    write_clusters(dir.path(), &[("a", "1"), ("b", "2")]);
    let b_changed = within("client 2's change", two.recv()).await;
    assert_eq!(clusters(&b_changed), pairs(&[("b", "2")]));
    request(&two, &["b"], &b_changed.version_info, &b_changed.nonce, None);
    eventually("client 1 shown at the new version", || {
        gw.registry
            .streams()
            .iter()
            .find(|s| s.node_id == "client-1")
            .is_some_and(|s| s.types[CLUSTER].acked_version.as_deref() == Some(b_changed.version_info.as_str()))
    })
    .await;
    assert_eq!(syncz_row(gw.admin, "client-1").await["status"], "SYNCED");

    // a changes: client 1's next response is that change, so b's sent it
    // nothing.
    write_clusters(dir.path(), &[("a", "2"), ("b", "2")]);
    let a_changed = within("client 1's change", one.recv()).await;
    assert_eq!(clusters(&a_changed), pairs(&[("a", "2")]));
    assert_eq!(a_changed.nonce, "2", "the second response on client 1's stream");
}
