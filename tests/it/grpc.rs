//! grpc's own proxyless xDS client (Python grpcio 1.85, `xds:///` channels,
//! v3 ADS state of the world) resolving through the gateway's files source:
//! listeners (API listeners) naming their routes (RDS), routes naming
//! clusters (CDS), clusters naming their endpoints (EDS), all by name. Each
//! test asserts from what grpc did (which backend answered its calls) and
//! from the gateway's `/debug/syncz` and `/debug/clients`. Ignored (with the
//! reason) where grpcio is not installed: see `helpers::peers`.
//!
//! The failure paths are issue 26's: grpc applies the valid part of a
//! response it NACKs (gRFC A46), and it gives up on a name it asked for that
//! is not answered within 15 s ("does not exist").

use std::collections::BTreeMap;

use mcp_xds_gateway::app::Bound;
use tempfile::TempDir;

use crate::helpers::grpc::{
    eds_cluster, endpoints, listener, route, sent_nonces, static_cluster, status_when, synced, syncz, syncz_row_when,
    write_files, Worker, CDS, EDS, RDS,
};
use crate::helpers::{start_gateway, start_gateway_on};

const SERVICE: &str = "xds:///greeter";

/// The files directory holding `docs`, and a gateway serving it.
async fn gateway_on(docs: &[String]) -> (TempDir, Bound) {
    let dir = tempfile::tempdir().unwrap();
    write_files(dir.path(), docs);
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    (dir, gw)
}

/// A gateway serving `docs`, and grpc client `grpc-1` that has called
/// `SERVICE` (answered by backend `first`) and ACKed every type.
async fn grpc_on(docs: &[String], first: &str) -> (TempDir, Bound, Worker) {
    let (dir, gw) = gateway_on(docs).await;
    let mut grpc = Worker::xds_client(gw.listen, "grpc-1").await;
    grpc.answered_by(SERVICE, first, "the first call").await;
    synced(gw.admin, "grpc-1", "grpc to ACK every type").await;
    (dir, gw, grpc)
}

/// Service `greeter` routed to cluster `cluster` (whatever the clusters).
fn greeter(cluster: &str) -> Vec<String> {
    vec![
        listener("greeter", "greeter-routes"),
        route("greeter-routes", &[("", cluster)]),
    ]
}

/// Service `greeter` routed to cluster-a, its one endpoint on `port`.
fn greeter_at(port: u16) -> Vec<String> {
    let mut docs = greeter("cluster-a");
    docs.extend([eds_cluster("cluster-a", "cluster-a"), endpoints("cluster-a", &[port])]);
    docs
}

/// Resolve and call: grpc follows listener, route, cluster and endpoints by
/// name, calls the backend, and ACKs every type over state of the world.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_resolves_and_calls_through_the_gateway() {
    let (_backends, port) = Worker::backends(&["a"]).await;
    let (_dir, gw, _grpc) = grpc_on(&greeter_at(port["a"]), "a").await;

    let rows = syncz(gw.admin, "grpc-1").await;
    let protocols: Vec<&str> = rows.values().map(|row| row["protocol"].as_str().unwrap()).collect();
    assert_eq!(protocols, ["xds-sotw"; 4], "{rows:#?}");
}

/// An endpoint edit is followed.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_follows_an_endpoint_edit() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let (dir, gw, mut grpc) = grpc_on(&greeter_at(port["a"]), "a").await;

    write_files(dir.path(), &greeter_at(port["b"]));
    grpc.answered_by(SERVICE, "b", "the moved endpoint").await;
    assert_eq!(grpc.answers(SERVICE, 5).await, ["b"; 5], "a is gone from the endpoints");
    synced(gw.admin, "grpc-1", "grpc to ACK the edit").await;
}

/// State of the world: an edit of one service's endpoints, then of its
/// route, goes to grpc in a response carrying that load assignment or route
/// configuration alone (`collections::sotw_keeps_what_is_left_out`). grpc
/// keeps the other service's, which the responses left out (it takes a
/// left-out resource as deleted only for listeners and clusters), and calls
/// to both services go on.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_keeps_the_endpoints_and_routes_a_response_leaves_out() {
    const OTHER: &str = "xds:///other";
    let (_backends, port) = Worker::backends(&["a", "b", "c"]).await;
    let files = |greeter_to: &str, greeter_port: u16| {
        vec![
            listener("greeter", "greeter-routes"),
            route("greeter-routes", &[("", greeter_to)]),
            listener("other", "other-routes"),
            route("other-routes", &[("", "cluster-b")]),
            eds_cluster("cluster-a", "cluster-a"),
            eds_cluster("cluster-b", "cluster-b"),
            endpoints("cluster-a", &[greeter_port]),
            endpoints("cluster-b", &[port["b"]]),
        ]
    };
    let (dir, gw, mut grpc) = grpc_on(&files("cluster-a", port["a"]), "a").await;
    grpc.answered_by(OTHER, "b", "the other service").await;
    synced(gw.admin, "grpc-1", "grpc to ACK both services").await;

    write_files(dir.path(), &files("cluster-a", port["c"]));
    grpc.answered_by(SERVICE, "c", "greeter's moved endpoint").await;
    assert_eq!(grpc.answers(OTHER, 5).await, ["b"; 5], "the other's endpoints kept");

    write_files(dir.path(), &files("cluster-b", port["c"]));
    grpc.answered_by(SERVICE, "b", "greeter's route moved to cluster-b")
        .await;
    assert_eq!(grpc.answers(OTHER, 5).await, ["b"; 5], "the other's route kept");
    synced(gw.admin, "grpc-1", "grpc to ACK the edits").await;
    let rows = syncz(gw.admin, "grpc-1").await;
    assert!(
        rows.values().all(|row| row["nack"].is_null()),
        "nothing NACKed: {rows:#?}"
    );
}

/// Two endpoints of one locality are called in turn (round robin, the
/// cluster's default policy).
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_round_robins_two_endpoints() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let mut docs = greeter("cluster-a");
    docs.extend([
        eds_cluster("cluster-a", "cluster-a"),
        endpoints("cluster-a", &[port["a"], port["b"]]),
    ]);
    let (_dir, _gw, mut grpc) = grpc_on(&docs, "a").await;

    // Both connected (round robin picks among the ready ones) ...
    grpc.answered_by(SERVICE, "b", "both endpoints in use").await;
    // ... then each call goes to the other one.
    let answers = grpc.answers(SERVICE, 10).await;
    assert!(
        answers.windows(2).all(|pair| pair[0] != pair[1]),
        "not in turn: {answers:?}"
    );
    assert_eq!(answers.iter().filter(|b| *b == "a").count(), 5, "{answers:?}");
}

/// A cluster grpc refuses (STATIC): grpc NACKs it and keeps the cluster it
/// had, so calls go on; `/debug/syncz` shows the client NACKED with grpc's
/// own message. The other types keep flowing, and a fix is taken.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_keeps_its_cluster_when_it_nacks_a_static_one() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let files = |cluster: String, backend: &str| {
        let mut docs = greeter("cluster-a");
        docs.extend([cluster, endpoints("cluster-a", &[port[backend]])]);
        docs
    };
    let (dir, gw, mut grpc) = grpc_on(&files(eds_cluster("cluster-a", "cluster-a"), "a"), "a").await;

    write_files(dir.path(), &files(static_cluster("cluster-a"), "a"));
    let row = status_when(gw.admin, "grpc-1", CDS, "NACKED", "grpc's NACK of the STATIC cluster").await;
    let message = row["nack"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("cluster-a") && message.contains("unknown discovery type"),
        "grpc's own message: {row:#}"
    );
    assert_eq!(
        grpc.answers(SERVICE, 5).await,
        ["a"; 5],
        "grpc keeps the cluster it had"
    );

    // The endpoints (another type) keep flowing while the cluster is refused.
    write_files(dir.path(), &files(static_cluster("cluster-a"), "b"));
    grpc.answered_by(SERVICE, "b", "the moved endpoint, with the cluster NACKed")
        .await;

    // A fixed cluster (not the one grpc ACKed before: a change of its own)
    // is taken, and the client is SYNCED again.
    let fixed = eds_cluster("cluster-a", "cluster-a").replace("connect_timeout: 1s", "connect_timeout: 2s");
    write_files(dir.path(), &files(fixed, "b"));
    status_when(gw.admin, "grpc-1", CDS, "SYNCED", "grpc to ACK the fixed cluster").await;
    assert_eq!(grpc.answers(SERVICE, 3).await, ["b"; 3]);
}

/// Route away from a NACKed cluster (issue 26): cluster-a is broken and
/// NACKed; the operator moves the route to the healthy cluster-b, which has
/// been in the files all along. grpc asks for cluster-b, and must be
/// answered at once although the clusters' current version is the NACKed
/// one; else grpc declares cluster-b "does not exist" after 15 s and every
/// call fails.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_routes_away_from_a_nacked_cluster() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let files = |to: &str, cluster_a: String| {
        let mut docs = greeter(to);
        docs.extend([
            cluster_a,
            eds_cluster("cluster-b", "cluster-b"),
            endpoints("cluster-a", &[port["a"]]),
            endpoints("cluster-b", &[port["b"]]),
        ]);
        docs
    };
    let (dir, gw, mut grpc) = grpc_on(&files("cluster-a", eds_cluster("cluster-a", "cluster-a")), "a").await;

    write_files(dir.path(), &files("cluster-a", static_cluster("cluster-a")));
    status_when(gw.admin, "grpc-1", CDS, "NACKED", "grpc's NACK of the broken cluster-a").await;

    write_files(dir.path(), &files("cluster-b", static_cluster("cluster-a")));
    grpc.answered_by(SERVICE, "b", "the route moved to cluster-b").await;
    assert_eq!(grpc.answers(SERVICE, 5).await, ["b"; 5]);
}

/// A revert after a partial NACK is followed (issue 26): a response that
/// changes cluster-a (valid) and breaks cluster-c is NACKed, but grpc
/// applies cluster-a's change (gRFC A46). The operator reverts the files to
/// exactly what grpc last ACKed: that differs from what grpc holds, so it
/// must be sent, and calls go back to backend a.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_follows_a_revert_after_a_partial_nack() {
    let (_backends, port) = Worker::backends(&["a", "b", "c"]).await;
    // The calls go to cluster-a; cluster-c takes the rest (grpc subscribes
    // to both).
    let files = |cluster_a: String, cluster_c: String| {
        vec![
            listener("greeter", "greeter-routes"),
            route(
                "greeter-routes",
                &[("/gateway.test.Backend/", "cluster-a"), ("", "cluster-c")],
            ),
            cluster_a,
            cluster_c,
            endpoints("endpoints-a", &[port["a"]]),
            endpoints("endpoints-b", &[port["b"]]),
            endpoints("endpoints-c", &[port["c"]]),
        ]
    };
    let acked = files(
        eds_cluster("cluster-a", "endpoints-a"),
        eds_cluster("cluster-c", "endpoints-c"),
    );
    let (dir, gw, mut grpc) = grpc_on(&acked, "a").await;

    let partial = files(eds_cluster("cluster-a", "endpoints-b"), static_cluster("cluster-c"));
    write_files(dir.path(), &partial);
    status_when(gw.admin, "grpc-1", CDS, "NACKED", "grpc's NACK of cluster-c").await;
    grpc.answered_by(SERVICE, "b", "grpc to apply the valid part of the response it NACKed")
        .await;

    write_files(dir.path(), &acked);
    grpc.answered_by(SERVICE, "a", "the revert to what grpc last ACKed")
        .await;
    status_when(gw.admin, "grpc-1", CDS, "SYNCED", "grpc to ACK the reverted clusters").await;
}

/// How many responses the gateway has sent on a stream: its nonces number
/// them 1, 2, 3, … across the stream's types, so the highest is the count.
fn responses_sent(nonces: &BTreeMap<String, String>) -> u64 {
    nonces
        .values()
        .map(|nonce| {
            nonce
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("a nonce that counts responses, not {nonce:?}"))
        })
        .max()
        .unwrap_or(0)
}

/// Waits until `node` follows an edit of its endpoints: calls to `target`
/// answered by `backend`, and the gateway's current endpoints ACKed.
async fn follows(gw: &Bound, grpc: &mut Worker, node: &str, target: &str, backend: &str) {
    grpc.answered_by(target, backend, &format!("{node}'s moved endpoint"))
        .await;
    let current = syncz(gw.admin, node).await[EDS]["current_version"].clone();
    syncz_row_when(gw.admin, node, EDS, &format!("{node} to ACK its endpoints"), |row| {
        row["status"] == "SYNCED" && row["acked"]["version"] == current
    })
    .await;
}

/// Two clients, each subscribed to its own names, each get only their own
/// changes (issue 26): a change to client 2's endpoints sends client 1
/// nothing, and the other way round.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn two_grpc_clients_each_get_only_their_own_names() {
    let (_backends, port) = Worker::backends(&["a", "b", "c"]).await;
    let files = |one: &str, two: &str| {
        vec![
            listener("one", "routes-one"),
            listener("two", "routes-two"),
            route("routes-one", &[("", "cluster-one")]),
            route("routes-two", &[("", "cluster-two")]),
            eds_cluster("cluster-one", "cluster-one"),
            eds_cluster("cluster-two", "cluster-two"),
            endpoints("cluster-one", &[port[one]]),
            endpoints("cluster-two", &[port[two]]),
        ]
    };
    let (dir, gw) = gateway_on(&files("a", "b")).await;
    let mut one = Worker::xds_client(gw.listen, "grpc-one").await;
    let mut two = Worker::xds_client(gw.listen, "grpc-two").await;
    one.answered_by("xds:///one", "a", "client 1's first call").await;
    two.answered_by("xds:///two", "b", "client 2's first call").await;
    synced(gw.admin, "grpc-one", "client 1 to ACK every type").await;
    synced(gw.admin, "grpc-two", "client 2 to ACK every type").await;
    let one_before = sent_nonces(gw.admin, "grpc-one").await;

    // Client 2's endpoints change: client 2 follows, client 1 is sent nothing.
    write_files(dir.path(), &files("a", "c"));
    follows(&gw, &mut two, "grpc-two", "xds:///two", "c").await;
    assert_eq!(
        sent_nonces(gw.admin, "grpc-one").await,
        one_before,
        "client 1 was sent a response after a change to client 2's endpoints alone"
    );
    let two_before = sent_nonces(gw.admin, "grpc-two").await;

    // Client 1's endpoints change: client 1 follows, with one response in
    // all since the start (a late one for client 2's change would count
    // here), and client 2 is sent nothing.
    write_files(dir.path(), &files("b", "c"));
    follows(&gw, &mut one, "grpc-one", "xds:///one", "b").await;
    let one_after = sent_nonces(gw.admin, "grpc-one").await;
    assert_eq!(
        responses_sent(&one_after) - responses_sent(&one_before),
        1,
        "client 1's responses over a change to each client's endpoints: before {one_before:?}, after {one_after:?}"
    );
    assert_eq!(
        sent_nonces(gw.admin, "grpc-two").await,
        two_before,
        "client 2 was sent a response after a change to client 1's endpoints alone"
    );
}

/// A gateway restart (same port) is survived: calls go on while the gateway
/// is down (grpc keeps what it has), grpc reconnects, and follows an edit
/// made afterwards.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_survives_a_gateway_restart() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let (dir, gw, mut grpc) = grpc_on(&greeter_at(port["a"]), "a").await;

    let listen = gw.listen.to_string();
    assert!(gw.shutdown().await, "the gateway shuts down within its grace period");
    assert_eq!(
        grpc.answers(SERVICE, 3).await,
        ["a"; 3],
        "calls go on while the gateway is down"
    );

    let again = start_gateway_on(&listen, &["--source-dir", dir.path().to_str().unwrap()]).await;
    synced(again.admin, "grpc-1", "grpc to reconnect and ACK every type").await;
    write_files(dir.path(), &greeter_at(port["b"]));
    grpc.answered_by(SERVICE, "b", "an edit after the restart").await;
}

/// Route away from a NACKed route configuration, and what the views say
/// (independent check of issue 26): grpc NACKs greeter-routes (an invalid
/// regex); the operator moves the listener to routes-2; grpc asks for it,
/// is answered at once (at the NACKed version) and ACKs that response, which
/// is later than the one it NACKed. It no longer asks for greeter-routes and
/// holds exactly what it ACKed, so `/debug/syncz` must show it SYNCED (the
/// NACK "since fixed"), not NACKED for as long as the routes do not change.
#[tokio::test]
#[cfg_attr(not(peer_grpcio), ignore = "needs grpcio (.ci/run sets GRPCIO_PYTHON)")]
async fn grpc_is_shown_synced_once_it_routed_away_from_a_nacked_route_configuration() {
    let (_backends, port) = Worker::backends(&["a", "b"]).await;
    let files = |routes: &str, greeter_routes: String| {
        vec![
            listener("greeter", routes),
            greeter_routes,
            route("routes-2", &[("", "cluster-b")]),
            eds_cluster("cluster-a", "cluster-a"),
            eds_cluster("cluster-b", "cluster-b"),
            endpoints("cluster-a", &[port["a"]]),
            endpoints("cluster-b", &[port["b"]]),
        ]
    };
    let good = route("greeter-routes", &[("", "cluster-a")]);
    let broken = good.replace("prefix: \"\"", "safe_regex: {regex: \"(\"}");
    assert_ne!(good, broken);
    let (dir, gw, mut grpc) = grpc_on(&files("greeter-routes", good), "a").await;

    write_files(dir.path(), &files("greeter-routes", broken.clone()));
    status_when(gw.admin, "grpc-1", RDS, "NACKED", "grpc's NACK of the invalid regex").await;

    write_files(dir.path(), &files("routes-2", broken));
    grpc.answered_by(SERVICE, "b", "the listener moved to routes-2").await;
    syncz_row_when(gw.admin, "grpc-1", RDS, "grpc to ACK routes-2", |row| {
        row["acked"]["version"] == row["current_version"]
    })
    .await;
    status_when(
        gw.admin,
        "grpc-1",
        RDS,
        "SYNCED",
        "grpc, which ACKed the response that routed it away, to be shown SYNCED",
    )
    .await;
}
