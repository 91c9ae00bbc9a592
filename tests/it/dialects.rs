//! Istio 1.0 (proto type URLs, `Client{id, Struct}`) and 1.1 (collection
//! names, `SinkNode`) clients on the same gateway, and `--type-map`.

use std::collections::BTreeMap;

use crate::helpers::clients::{channel, sotw, V10Client, V10Request, V10SotwClient, SOTW_PATH};
use crate::helpers::galley::{resource, FakeGalley};
use crate::helpers::{gateway_for, names, VS, VS_TYPE_URL};

#[tokio::test]
async fn both_dialects_get_the_same_content_under_their_own_type_url() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("reviews", "1", b"r")]).await;

    let mut by_name = sotw(gw.listen).await;
    by_name.subscribe(VS);
    let v11 = by_name.recv().await;
    let mut by_url = sotw(gw.listen).await;
    by_url.subscribe(VS_TYPE_URL);
    let v10 = by_url.recv().await;

    assert_eq!(v11.type_url, VS);
    assert_eq!(v10.type_url, VS_TYPE_URL);
    assert_eq!(v10.version_info, v11.version_info);
    assert_eq!(v10.resources, v11.resources);
    assert_eq!(names(&v10.resources), ["reviews"]);
    let dialects: Vec<_> = gw
        .registry
        .streams()
        .iter()
        .flat_map(|s| s.types.values().map(|t| t.dialect.as_str()).collect::<Vec<_>>())
        .collect();
    assert_eq!(dialects, ["1.1", "1.0"]);
}

/// Field 2 of a 1.0 request is `Client{id, Struct metadata}`: read for its id
/// only, never a reason to reject the client.
#[tokio::test]
async fn a_v1_0_client_with_struct_metadata_is_served() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("reviews", "1", b"r")]).await;

    let mut fields = BTreeMap::new();
    fields.insert(
        "ISTIO_VERSION".to_string(),
        prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(1.5)),
        },
    );
    let mut client: V10SotwClient =
        V10SotwClient::open_with(channel(gw.listen).await, SOTW_PATH, tonic_prost::ProstCodec::default()).await;
    let request = |version: &str, nonce: &str| V10Request {
        version_info: version.into(),
        client: Some(V10Client {
            id: "sidecar~10.0.0.1~pilot-1.default~default.svc.cluster.local".into(),
            metadata: Some(prost_types::Struct { fields: fields.clone() }),
        }),
        type_url: VS_TYPE_URL.into(),
        response_nonce: nonce.into(),
    };
    client.send(request("", ""));
    let response = client.recv().await;
    assert_eq!(response.type_url, VS_TYPE_URL);
    assert_eq!(names(&response.resources), ["reviews"]);
    client.send(request(&response.version_info, &response.nonce));
    crate::helpers::eventually("the ACK recorded", || {
        gw.registry
            .streams()
            .first()
            .is_some_and(|s| s.node_id.starts_with("sidecar~") && s.types[VS_TYPE_URL].acked_version.is_some())
    })
    .await;
}

#[tokio::test]
async fn a_type_map_adds_a_collection_reachable_in_both_dialects() {
    let dir = std::env::temp_dir().join(format!("mcp-gw-type-map-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let map = dir.join("types.yaml");
    std::fs::write(&map, "example.com/v1/widgets: type.googleapis.com/example.v1.Widget\n").unwrap();
    let map_flag = map.to_string_lossy().to_string();

    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &["example.com/v1/widgets"], &["--type-map", &map_flag]).await;
    let mut upstream = galley.next_stream().await;
    assert_eq!(
        upstream.initial_requests(1).await[0].collection,
        "example.com/v1/widgets"
    );
    upstream
        .push_full("example.com/v1/widgets", vec![resource("w", "1", b"w")])
        .await;

    let mut client = sotw(gw.listen).await;
    client.subscribe("type.googleapis.com/example.v1.Widget");
    assert_eq!(names(&client.recv().await.resources), ["w"]);
    client.subscribe("example.com/v1/widgets");
    assert_eq!(names(&client.recv().await.resources), ["w"]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Two replicas fed the same content report the same version.
#[tokio::test]
async fn replicas_with_the_same_content_report_the_same_version() {
    let mut galley = FakeGalley::start().await;
    let one = gateway_for(&galley, &[VS], &[]).await;
    let mut first = galley.next_stream().await;
    let two = gateway_for(&galley, &[VS], &[]).await;
    let mut second = galley.next_stream().await;
    first.initial_requests(1).await;
    second.initial_requests(1).await;
    first
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    second
        .push_full(VS, vec![resource("b", "1", b"b"), resource("a", "1", b"a")])
        .await;
    let mut c1 = sotw(one.listen).await;
    let mut c2 = sotw(two.listen).await;
    c1.subscribe(VS);
    c2.subscribe(VS);
    assert_eq!(c1.recv().await.version_info, c2.recv().await.version_info);
}
