//! The admin port: liveness, readiness that names what is missing, and the
//! connected clients; and shutdown of the whole app.

use std::time::Duration;

use tonic::Code;

use crate::helpers::clients::sotw;
use crate::helpers::galley::{resource, FakeGalley};
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
    within("shutdown within its grace", gw.shutdown()).await;
    let status = client.end_status().await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let refused = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(listen)).await;
    assert!(matches!(refused, Ok(Err(_))), "the listener is closed");
}
