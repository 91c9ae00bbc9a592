//! The admin port: liveness, readiness that names what is missing, and the
//! connected clients; and shutdown of the whole app.

use std::time::Duration;

use tonic::Code;

use crate::helpers::clients::{channel, sotw};
use crate::helpers::galley::{dial_out, resource, FakeGalley};
use crate::helpers::{gateway_for, http_get, within, GW, VS};

#[tokio::test]
async fn readiness_waits_for_every_subscribed_collection() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS, GW], &[]).await;
    assert_eq!(http_get(gw.admin, "/healthz").await.0, 200);
    let (status, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains(VS) && body.contains(GW), "{body}");

    let mut stream = galley.next_stream().await;
    stream.initial_requests(2).await;
    stream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let (status, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains(GW) && !body.contains(VS), "{body}");

    // Delivered empty is delivered.
    stream.push_full(GW, vec![]).await;
    assert_eq!(http_get(gw.admin, "/readyz").await, (200, "ready\n".to_string()));
}

#[tokio::test]
async fn a_refused_collection_does_not_block_readiness() {
    let mut galley = FakeGalley::start().await;
    galley.refuse(GW);
    let gw = gateway_for(&galley, &[VS, GW], &[]).await;
    let _refused = galley.next_stream().await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![]).await;
    assert_eq!(http_get(gw.admin, "/readyz").await.0, 200);
}

#[tokio::test]
async fn debug_clients_shows_each_stream_and_type() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    let (status, body) = http_get(gw.admin, "/debug/clients").await;
    assert_eq!(status, 200);
    let clients: serde_json::Value = serde_json::from_str(&body).unwrap();
    let view = &clients[0];
    assert_eq!(view["node_id"], "pilot-test");
    assert_eq!(view["protocol"], "sotw");
    assert_eq!(view["types"][VS]["last_sent_version"], response.version_info.as_str());
    assert_eq!(view["types"][VS]["outstanding"], true);
    assert_eq!(view["types"][VS]["dialect"], "1.1");
}

#[tokio::test]
async fn shutdown_closes_streams_with_unavailable_and_returns() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &["--shutdown-grace", "5s"]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    client.recv().await;
    let listen = gw.listen;
    assert!(
        within("shutdown within its grace", gw.shutdown()).await,
        "every task ended"
    );
    let status = client.end_status().await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let refused = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(listen)).await;
    assert!(matches!(refused, Ok(Err(_))), "the listener is closed");
}

/// Every source mode's tasks (the upstream client, the dial-out source, the
/// local files' watcher, TLS rotation) end on shutdown, with clients connected.
#[tokio::test]
async fn every_task_ends_on_shutdown_in_every_source_mode() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("vs.yaml"),
        format!("collection: {VS}\nname: a\nbody: {{struct: {{hosts: [a]}}}}\n"),
    )
    .unwrap();
    let source_dir = dir.path().to_str().unwrap().to_owned();
    let galley = FakeGalley::start().await;
    let url = galley.url();
    let modes: [Vec<&str>; 3] = [
        vec!["--source-dir", &source_dir, "--collections", VS],
        vec!["--upstream", &url, "--collections", VS],
        vec!["--sink-listen", "127.0.0.1:0", "--sink-insecure", "--collections", VS],
    ];
    for flags in modes {
        let mut flags = flags;
        flags.extend(["--shutdown-grace", "5s"]);
        let gw = crate::helpers::start_gateway(&flags).await;
        let mut client = sotw(gw.listen).await;
        client.subscribe(VS);
        // In dial-out mode, a connected source.
        let _source = match gw.sink {
            Some(sink) => Some(dial_out(channel(sink).await, &[]).await.unwrap()),
            None => None,
        };
        assert!(within("shutdown", gw.shutdown()).await, "{flags:?}: every task ended");
        assert_eq!(client.end_status().await.code(), Code::Unavailable, "{flags:?}");
    }
}
