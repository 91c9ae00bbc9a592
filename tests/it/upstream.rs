//! The gateway as an MCP sink: initial requests, ACK/NACK contents, apply
//! rules, refused collections, backoff, and serving through upstream outages.

use std::time::Duration;

use mcp_xds_gateway::proto::{Metadata, Resource, Resources};
use tonic::{Code, Status};

use crate::helpers::clients::sotw;
use crate::helpers::galley::{full, incremental, resource, FakeGalley};
use crate::helpers::{eventually, gateway_for, names, upstream_status_when, GW, GW_TYPE_URL, VS};

#[tokio::test]
async fn sends_one_initial_request_per_collection_with_the_sink_node() {
    let mut galley = FakeGalley::start().await;
    let _gw = gateway_for(
        &galley,
        &[VS, GW],
        &["--node-id", "gw-1", "--node-annotation", "team=mesh"],
    )
    .await;
    let mut stream = galley.next_stream().await;
    let requests = stream.initial_requests(2).await;
    assert_eq!(
        requests.iter().map(|r| r.collection.as_str()).collect::<Vec<_>>(),
        [GW, VS]
    );
    for request in &requests {
        let node = request.sink_node.as_ref().unwrap();
        assert_eq!(node.id, "gw-1");
        assert_eq!(node.annotations.get("team").map(String::as_str), Some("mesh"));
        assert!(request.incremental, "incremental is requested by default");
        assert!(
            request.initial_resource_versions.is_empty(),
            "the cache is empty at start"
        );
        assert!(request.error_detail.is_none());
    }
}

#[tokio::test]
async fn no_incremental_requests_full_state() {
    let mut galley = FakeGalley::start().await;
    let _gw = gateway_for(&galley, &[VS], &["--no-incremental"]).await;
    let mut stream = galley.next_stream().await;
    assert!(!stream.initial_requests(1).await[0].incremental);
}

#[tokio::test]
async fn acks_carry_node_collection_nonce_and_incremental() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &["--node-id", "gw-1"]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    let ack = stream.push_full(VS, vec![resource("a", "1", b"x")]).await;
    assert_eq!(ack.collection, VS);
    assert_eq!(ack.response_nonce, "n1");
    assert!(ack.incremental, "the ACK repeats what was requested");
    assert_eq!(ack.sink_node.unwrap().id, "gw-1");
    assert!(ack.error_detail.is_none());
    assert!(ack.initial_resource_versions.is_empty());
    assert_eq!(gw.cache.get(VS).unwrap().len(), 1);
}

/// Every kind of bad message gets a NACK with a code and a message that says
/// what is wrong, and the cache keeps exactly what it had.
#[tokio::test]
async fn bad_messages_are_nacked_and_leave_the_cache_untouched() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("keep", "1", b"x")]).await;
    let before = gw.cache.get(VS).unwrap();

    let no_metadata = Resource {
        metadata: None,
        ..resource("x", "1", b"x")
    };
    let empty_name = resource("", "1", b"x");
    let no_body = Resource {
        body: None,
        ..resource("nobody", "1", b"x")
    };
    let no_metadata_second = vec![resource("fine", "1", b"x"), no_metadata.clone()];
    let cases: Vec<(Resources, Code, &str)> = vec![
        (
            full("$triggerCollection", vec![]),
            Code::Unimplemented,
            "not subscribed",
        ),
        (
            full("istio/other/v1/things", vec![]),
            Code::Unimplemented,
            "not subscribed",
        ),
        // Each names the resource: by position where it has no name.
        (
            full(VS, vec![no_metadata]),
            Code::InvalidArgument,
            "resource #0 of collection",
        ),
        (
            full(VS, no_metadata_second),
            Code::InvalidArgument,
            "resource #1 of collection",
        ),
        (full(VS, vec![empty_name]), Code::InvalidArgument, "empty metadata.name"),
        (
            full(VS, vec![no_body]),
            Code::InvalidArgument,
            "resource \"nobody\" of collection",
        ),
        (
            full(VS, vec![resource("dup", "1", b"a"), resource("dup", "2", b"b")]),
            Code::InvalidArgument,
            "resource \"dup\" appears twice",
        ),
    ];
    for (message, code, says) in cases {
        let collection = message.collection.clone();
        let nack = stream.send(message).await;
        let detail = nack
            .error_detail
            .as_ref()
            .unwrap_or_else(|| panic!("expected a NACK for {collection}"));
        assert_eq!(Code::from(detail.code), code, "{collection}: {detail:?}");
        assert!(
            detail.message.contains(says),
            "{collection}: {:?} should say {says:?}",
            detail.message
        );
        assert_eq!(nack.collection, collection);
        assert!(!nack.incremental, "a NACK carries incremental=false");
        let after = gw.cache.get(VS).unwrap();
        assert!(
            std::sync::Arc::ptr_eq(&before, &after),
            "the cache changed after a NACK for {says}"
        );
    }
    assert!(gw.cache.get("istio/other/v1/things").is_none());
}

#[tokio::test]
async fn incremental_when_full_state_was_requested_is_nacked() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &["--no-incremental"]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    let nack = stream.send(incremental(VS, vec![resource("a", "1", b"x")], &[])).await;
    let detail = nack.error_detail.expect("a NACK");
    assert_eq!(Code::from(detail.code), Code::InvalidArgument);
    assert!(detail.message.contains("requested full state"), "{}", detail.message);
    assert!(gw.cache.get(VS).is_none(), "nothing applied");
}

#[tokio::test]
async fn full_state_replaces_and_ignores_removed_resources() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    let mut replace = full(VS, vec![resource("b", "2", b"b2"), resource("c", "1", b"c")]);
    replace.removed_resources = vec!["c".into()];
    let ack = stream.send(replace).await;
    assert!(ack.error_detail.is_none());
    assert_eq!(held(&gw, VS), [("b".into(), "2".into()), ("c".into(), "1".into())]);
}

#[tokio::test]
async fn incremental_upserts_and_deletes() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    let ack = stream
        .send(incremental(
            VS,
            vec![resource("c", "1", b"c"), resource("a", "2", b"a2")],
            &["b", "unknown"],
        ))
        .await;
    assert!(ack.error_detail.is_none(), "{ack:?}");
    assert!(ack.incremental);
    assert_eq!(held(&gw, VS), [("a".into(), "2".into()), ("c".into(), "1".into())]);
}

/// Bodies are never decoded: bytes that are not a valid message of their type
/// reach the client exactly as Galley sent them.
#[tokio::test]
async fn bodies_pass_through_byte_for_byte() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    let body: Vec<u8> = (0..=255u8).rev().collect();
    let mut sent = resource("opaque", "7", &body);
    // Galley 1.1-1.2 doubled the Struct type URL; it must pass untouched.
    sent.body.as_mut().unwrap().type_url = "type.googleapis.com/type.googleapis.com/google.protobuf.Struct".into();
    sent.metadata
        .as_mut()
        .unwrap()
        .labels
        .insert("app".into(), "reviews".into());
    stream.push_full(VS, vec![sent.clone()]).await;

    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    assert_eq!(response.resources, vec![sent]);
}

/// The refusal is counted once, under the refused collection: the gateway
/// is a process of its own, so the series is moved by it alone.
#[tokio::test]
async fn a_refused_collection_is_counted_once() {
    let mut galley = FakeGalley::start().await;
    let refused = "istio/policy/v1beta1/rules";
    galley.refuse(refused);
    let mut gw = crate::helpers::gateway_process_for(&galley, &[VS, refused], &[]).await;
    let _first = galley.next_stream().await;
    let mut second = galley.next_stream().await;
    assert_eq!(second.initial_requests(1).await[0].collection, VS);
    second.push_full(VS, vec![resource("a", "1", b"x")]).await;
    let series =
        |collection: &str| format!("mcp_gateway_upstream_refused_collections_total{{collection=\"{collection}\"}}");
    crate::limits::metric_is(gw.monitoring, &series(refused), 1).await;
    assert_eq!(crate::limits::metric(gw.monitoring, &series(VS)).await, 0);
    // Logged, naming the collection and the source's words.
    let line = gw.logged("the source does not serve this collection").await;
    assert!(line.contains(refused), "{line}");
    assert!(line.contains("unsupported collection"), "{line}");
}

#[tokio::test]
async fn a_refused_collection_is_dropped_and_never_loops() {
    let mut galley = FakeGalley::start().await;
    let refused = "istio/policy/v1beta1/rules";
    galley.refuse(refused);
    let gw = gateway_for(&galley, &[VS, refused], &[]).await;

    // The first stream dies on the refused collection...
    let _first = galley.next_stream().await;
    // ...and the second asks only for the rest.
    let mut second = galley.next_stream().await;
    let requests = second.initial_requests(1).await;
    assert_eq!(requests[0].collection, VS);
    second.push_full(VS, vec![resource("a", "1", b"x")]).await;
    let state = gw.subscriptions.current();
    assert!(state.refused.contains_key(refused));
    assert!(state.refused[refused].contains("unsupported collection"));
    assert!(!state.wanted.iter().any(|c| &**c == refused));

    // A client asking for it does not bring it back, and gets no invented
    // answer; the gateway still serves everything else on the same stream.
    let mut client = sotw(gw.listen).await;
    client.subscribe(refused);
    client.subscribe(VS);
    let first = client.recv().await;
    assert_eq!(first.type_url, VS);
    // A later event of the same upstream stream, so that a request the
    // client's subscription would have set off has come before the counts
    // are read: a change pushed (and ACKed) after it, and its delivery.
    client.ack(&first);
    second.push_full(VS, vec![resource("a", "2", b"y")]).await;
    let changed = client.recv_type(VS).await;
    assert_eq!(changed.resources[0].metadata.as_ref().unwrap().version, "2");
    assert!(!gw.subscriptions.current().wanted.iter().any(|c| &**c == refused));
    assert_eq!(galley.streams_opened(), 2, "exactly one reconnect");
    let asked: Vec<_> = galley.log().into_iter().filter(|r| r.collection == refused).collect();
    assert_eq!(asked.len(), 1, "asked once, on the first stream only");
}

/// A source that accepts and then kills every stream sees the delay grow; a
/// stream that delivers data resets it.
#[tokio::test]
async fn accept_then_kill_gets_backoff_reset_only_by_progress() {
    let mut galley = FakeGalley::start().await;
    galley.kill_every_stream(true);
    let gw = gateway_for(&galley, &[VS], &["--reconnect-max-delay", "1s"]).await;
    eventually("five killed streams", || galley.streams_opened() >= 5).await;
    // Galley counts a stream when it opens; the gateway schedules its retry
    // only after the kill arrives, and clears it when the next attempt
    // starts. Take one copy of the status while a retry is scheduled.
    let status = upstream_status_when(&gw, "a retry scheduled after four failures", |s| {
        s.consecutive_failures >= 4 && s.next_retry_in.is_some()
    })
    .await;
    assert!(status.consecutive_failures >= 4, "{status:?}");
    // Base delays 10, 20, 40, 80 ms...: the fourth wait is at least 80 ms.
    assert!(status.next_retry_in.unwrap() >= Duration::from_millis(80), "{status:?}");
    assert!(
        status.last_error.as_deref().unwrap().contains("kills every stream"),
        "{status:?}"
    );

    galley.kill_every_stream(false);
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("a", "1", b"x")]).await;
    eventually("connected", || gw.upstream.borrow().connected).await;
    stream.kill(Status::unavailable("one more kill"));
    let status = upstream_status_when(&gw, "a retry scheduled", |s| s.next_retry_in.is_some()).await;
    assert_eq!(status.consecutive_failures, 1, "{status:?}");
    assert!(
        status.next_retry_in.unwrap() <= Duration::from_millis(20),
        "reset to the minimum: {status:?}"
    );
}

/// While Galley is down the last state is served; after it returns, the same
/// content pushes nothing to clients, and a change is pushed as usual.
#[tokio::test]
async fn upstream_outage_keeps_serving_and_unchanged_content_pushes_nothing() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream
        .push_full(VS, vec![resource("a", "1", b"x"), resource("b", "1", b"y")])
        .await;

    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv().await;
    client.ack(&first);

    let addr = galley.stop().await;
    eventually("upstream disconnected", || !gw.upstream.borrow().connected).await;
    let mut newcomer = sotw(gw.listen).await;
    newcomer.subscribe(VS);
    assert_eq!(
        newcomer.recv().await.version_info,
        first.version_info,
        "served while galley is down"
    );

    let mut galley = FakeGalley::start_on(addr).await;
    let mut stream = galley.next_stream().await;
    let resumed = stream.initial_requests(1).await.remove(0);
    assert_eq!(
        resumed.initial_resource_versions,
        [("a".to_string(), "1".to_string()), ("b".to_string(), "1".to_string())].into(),
        "the sink reports what it holds"
    );
    stream
        .push_full(VS, vec![resource("b", "1", b"y"), resource("a", "1", b"x")])
        .await;
    stream
        .push_full(VS, vec![resource("a", "2", b"x2"), resource("b", "1", b"y")])
        .await;
    let next = client.recv().await;
    assert_ne!(next.version_info, first.version_info);
    // Nonces count the responses of a stream: the unchanged full state pushed
    // nothing in between.
    assert_eq!(next.nonce, "2");
}

/// A collection only a client asked for is asked first on a probe stream of
/// its own; once the source delivers it there, the main stream subscribes
/// it (never restarted for it).
#[tokio::test]
async fn a_collection_a_client_asks_for_is_probed_then_subscribed_on_the_live_stream() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;

    let mut client = sotw(gw.listen).await;
    client.subscribe(GW_TYPE_URL);
    let mut probe = galley.next_stream().await;
    let asked = probe.next_request().await;
    assert_eq!(asked.collection, GW);
    assert!(asked.response_nonce.is_empty());
    assert!(!asked.incremental, "the probe asks for the plainest answer");
    // The probe's copy is looked at, never applied nor ACKed.
    probe.send_only(full(GW, vec![resource("ingress", "1", b"g")]));
    let request = stream.next_request().await;
    assert_eq!(request.collection, GW, "subscribed on the main stream");
    assert!(request.response_nonce.is_empty());
    assert!(gw.cache.get(GW).is_none(), "the probe's copy is not applied");
    stream.push_full(GW, vec![resource("ingress", "1", b"g")]).await;
    let response = client.recv().await;
    assert_eq!(response.type_url, GW_TYPE_URL);
    assert_eq!(names(&response.resources), ["ingress"]);
    assert!(probe.try_next_request().is_none(), "the probe never ACKed");
    assert_eq!(galley.streams_opened(), 2, "the main stream and the probe");
    eventually("the probe closed: nothing left to ask", || {
        galley.streams()[1].ended.is_some()
    })
    .await;
    assert_eq!(galley.streams()[0].ended, None, "the main stream was never restarted");
    assert_eq!(gw.upstream.borrow().connections, 1);
}

/// Full states outgrew gRPC's 4 MiB default (istio#9343): the default
/// receive limit is 64 MiB.
#[tokio::test]
async fn accepts_full_states_above_four_mebibytes() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    let big: Vec<Resource> = (0..6)
        .map(|i| resource(&format!("r{i}"), "1", &vec![b'x'; 1 << 20]))
        .collect();
    stream.push_full(VS, big).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 6);
}

#[tokio::test]
async fn a_missing_resource_version_becomes_a_content_hash() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    let unversioned = Resource {
        metadata: Some(Metadata {
            name: "a".into(),
            ..Default::default()
        }),
        ..resource("a", "", b"body")
    };
    stream.push_full(VS, vec![unversioned.clone()]).await;
    let first = gw.cache.get(VS).unwrap().resources["a"].version().to_owned();
    assert_eq!(first.len(), 32);
    // The same body again is the same version; another body is not.
    stream.push_full(VS, vec![unversioned]).await;
    assert_eq!(gw.cache.get(VS).unwrap().resources["a"].version(), first);
    stream.push_full(VS, vec![resource("a", "", b"other")]).await;
    assert_ne!(gw.cache.get(VS).unwrap().resources["a"].version(), first);
}

/// `(name, version)` of every resource the gateway holds for `collection`.
fn held(gw: &mcp_xds_gateway::app::Bound, collection: &str) -> Vec<(String, String)> {
    gw.cache
        .get(collection)
        .unwrap()
        .resources
        .values()
        .map(|r| (r.name.to_string(), r.version().to_string()))
        .collect()
}

/// A message above the receive limit fails the stream with an error that
/// names the flag to raise; the cache keeps serving what it had.
#[tokio::test]
async fn a_message_above_the_receive_limit_names_the_flag_and_keeps_the_cache() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &["--max-message-bytes", "65536"]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("small", "1", b"x")]).await;
    let before = gw.cache.get(VS).unwrap();

    stream
        .responses
        .send(Ok(full(VS, vec![resource("big", "1", &vec![b'x'; 100_000])])))
        .unwrap();
    eventually("the stream to fail", || {
        gw.upstream
            .borrow()
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("--max-message-bytes"))
    })
    .await;
    assert!(
        std::sync::Arc::ptr_eq(&before, &gw.cache.get(VS).unwrap()),
        "the cache is untouched"
    );
    let _reconnected = galley.next_stream().await;
}
