//! `StreamAggregatedResources`: per-type nonce state, one outstanding response
//! with coalescing, stale nonces, NACKs, and what is (never) sent.
//!
//! Absence is proven by order, not by waiting: a stream answers requests in
//! order, so when a later request's answer arrives first, the earlier request
//! produced nothing.

use mcp_xds_gateway::app::Bound;
use mcp_xds_gateway::proto::MeshConfigResponse;
use tonic::Code;

use crate::helpers::clients::{raw_sotw, sotw};
use crate::helpers::galley::{resource, FakeGalley, GalleyStream};
use crate::helpers::{eventually, gateway_for, names, DR, GW, VS};

/// A gateway with VS and GW delivered (one resource each) and DR subscribed.
async fn setup() -> (FakeGalley, GalleyStream, Bound) {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS, GW, DR], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(3).await;
    stream.push_full(VS, vec![resource("vs-1", "1", b"v")]).await;
    stream.push_full(GW, vec![resource("gw-1", "1", b"g")]).await;
    (galley, stream, gw)
}

fn version_of(gw: &Bound, collection: &str) -> String {
    gw.cache.get(collection).unwrap().version.to_string()
}

#[tokio::test]
async fn responds_acks_and_pushes_changes() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    assert_eq!(first.version_info, version_of(&gw, VS));
    assert_eq!(names(&first.resources), ["vs-1"]);
    assert!(!first.nonce.is_empty());
    client.ack(&first);

    upstream
        .push_full(VS, vec![resource("vs-1", "2", b"v2"), resource("vs-2", "1", b"w")])
        .await;
    let second = client.recv_type(VS).await;
    assert_eq!(second.version_info, version_of(&gw, VS));
    assert_eq!(names(&second.resources), ["vs-1", "vs-2"]);
    assert_ne!(second.nonce, first.nonce);
    client.ack(&second);
    eventually("the ACK recorded", || {
        gw.registry.streams()[0].types[VS].acked_version.as_deref() == Some(second.version_info.as_str())
    })
    .await;
}

#[tokio::test]
async fn a_client_already_at_the_version_gets_nothing_until_it_changes() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.request(VS, &version_of(&gw, VS), "");
    client.subscribe(GW);
    client.recv_type(GW).await;
    upstream.push_full(VS, vec![resource("vs-1", "2", b"v2")]).await;
    assert_eq!(client.recv_type(VS).await.version_info, version_of(&gw, VS));
}

/// Each stale request is counted under its collection, exactly: the
/// gateway is a process of its own, so no other test's client moves the
/// series.
#[tokio::test]
async fn stale_nonces_are_counted_by_collection() {
    let (gw, mut canary) = crate::limits::spawned_with_canary(&[]).await;
    let stale = format!("mcp_gateway_downstream_stale_requests_total{{collection=\"{VS}\"}}");
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    // A nonce never issued is stale; the last one sent, repeated, is not.
    client.request(VS, &first.version_info, "no-such-nonce");
    client.request(VS, &first.version_info, &first.nonce);
    crate::limits::metric_is(gw.monitoring, &stale, 1).await;
    // Ignored: the client still gets the next content.
    canary.check().await;
    let next = client.recv_type(VS).await;
    assert_ne!(next.version_info, first.version_info);
    assert_eq!(crate::limits::metric(gw.monitoring, &stale).await, 1);
}

/// A stale request is logged with the nonce it carried and the one
/// expected, once per stream per 10 s (a client sending stale nonces in a
/// loop cannot flood the log); the nonce of another type's response is
/// stale for this one and counted under this one. The gateway is a process
/// of its own: its log and counts are this test's.
#[tokio::test]
async fn stale_nonces_are_logged_once_per_ten_seconds_and_another_types_nonce_is_counted() {
    let (mut gw, mut canary) = crate::limits::spawned_with_canary(&[]).await;
    let stale =
        |collection: &str| format!("mcp_gateway_downstream_stale_requests_total{{collection=\"{collection}\"}}");
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    client.subscribe(GW);
    let other = client.recv_type(GW).await;
    client.ack(&other);
    // GW's nonce, sent for VS: stale for VS, counted under VS.
    client.request(VS, &first.version_info, &other.nonce);
    crate::limits::metric_is(gw.monitoring, &stale(VS), 1).await;
    assert_eq!(crate::limits::metric(gw.monitoring, &stale(GW)).await, 0);
    let line = gw.log_line("stale request ignored").await;
    assert!(
        line.contains(&other.nonce) && line.contains(&first.nonce) && line.contains(VS),
        "names the nonce sent, the one expected and the type: {line}"
    );
    // A second one within 10 s: counted, not logged. A NACK from another
    // stream, sent once the count moved, is the marker it would precede.
    client.request(VS, &first.version_info, "no-such-nonce");
    crate::limits::metric_is(gw.monitoring, &stale(VS), 2).await;
    let mut marker = sotw(gw.listen).await;
    marker.subscribe(VS);
    let response = marker.recv_type(VS).await;
    marker.nack(&response, "", "the marker");
    let lines = gw.lines_until("the marker").await;
    assert!(
        !lines.iter().any(|l| l.contains("stale request ignored")),
        "one stale line per 10 s: {lines:#?}"
    );
    // Ignored: the client still gets the next content.
    canary.check().await;
    assert_ne!(client.recv_type(VS).await.version_info, first.version_info);
}

#[tokio::test]
async fn stale_nonces_are_ignored() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    upstream.push_full(VS, vec![resource("vs-1", "2", b"v2")]).await;
    let second = client.recv_type(VS).await;

    // An ACK of the old nonce while `second` is outstanding: if it were taken,
    // the type would be re-armed and `second` sent again at once.
    client.request(VS, &first.version_info, &first.nonce);
    client.request(VS, "", "no-such-nonce");
    client.subscribe(GW);
    client.recv_type(GW).await;
    let view = gw.registry.streams()[0].types[VS].clone();
    assert_eq!(view.last_sent_nonce.map(|n| n.to_string()), Some(second.nonce.clone()));
    assert!(view.outstanding);

    client.ack(&second);
    upstream.push_full(VS, vec![resource("vs-1", "3", b"v3")]).await;
    assert_eq!(client.recv_type(VS).await.version_info, version_of(&gw, VS));
}

#[tokio::test]
async fn one_outstanding_response_per_type_and_changes_coalesce() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;

    // Two changes while `first` is not yet ACKed.
    upstream.push_full(VS, vec![resource("vs-1", "2", b"v2")]).await;
    upstream.push_full(VS, vec![resource("vs-1", "3", b"v3")]).await;
    let latest = version_of(&gw, VS);
    client.subscribe(GW);
    client.recv_type(GW).await; // nothing for VS came before it

    client.ack(&first);
    let next = client.recv_type(VS).await;
    assert_eq!(next.version_info, latest, "the latest version, not the one in between");
    client.ack(&next);
    client.subscribe(DR);
    upstream.push_full(DR, vec![]).await;
    assert_eq!(client.recv().await.type_url, DR, "no second VS push");
}

#[tokio::test]
async fn a_nacked_version_is_never_resent() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    upstream.push_full(VS, vec![resource("vs-1", "2", b"bad")]).await;
    let rejected = client.recv_type(VS).await;
    client.nack(&rejected, &first.version_info, "VirtualService vs-1: bad route");

    // The NACK is processed before the GW request; nothing is re-sent.
    client.subscribe(GW);
    client.recv_type(GW).await;
    let view = gw.registry.streams()[0].types[VS].clone();
    let nack = view.last_nack.expect("the NACK is kept for the debug view");
    assert_eq!(&*nack.version, rejected.version_info.as_str());
    assert_eq!(nack.message, "VirtualService vs-1: bad route");
    assert!(!view.outstanding);

    // The next version is sent when the content changes.
    upstream.push_full(VS, vec![resource("vs-1", "3", b"fixed")]).await;
    let fixed = client.recv_type(VS).await;
    assert_eq!(fixed.version_info, version_of(&gw, VS));
    assert_ne!(fixed.version_info, rejected.version_info);
}

#[tokio::test]
async fn two_types_on_one_stream_are_independent() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    client.subscribe(GW);
    let mut got: Vec<MeshConfigResponse> = vec![client.recv().await, client.recv().await];
    got.sort_by(|a, b| a.type_url.cmp(&b.type_url));
    assert_eq!(got[0].type_url, GW);
    assert_eq!(names(&got[0].resources), ["gw-1"]);
    assert_eq!(got[1].type_url, VS);
    assert_eq!(names(&got[1].resources), ["vs-1"]);
    assert_ne!(got[0].nonce, got[1].nonce);
    client.ack(&got[0]);
    client.ack(&got[1]);

    upstream.push_full(GW, vec![resource("gw-2", "1", b"g2")]).await;
    let next = client.recv_type(GW).await;
    assert_eq!(names(&next.resources), ["gw-2"]);
    let streams = gw.registry.streams();
    assert_eq!(streams[0].types.len(), 2);
    assert_eq!(
        streams[0].types[VS].last_sent_nonce.map(|n| n.to_string()),
        Some(got[1].nonce.clone())
    );
}

#[tokio::test]
async fn undelivered_collections_get_nothing_and_delivered_empty_gets_empty() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(DR); // subscribed upstream, not delivered yet
    client.subscribe(VS);
    client.recv_type(VS).await; // no invented DR response came first
    upstream.push_full(DR, vec![]).await;
    let empty = client.recv_type(DR).await;
    assert!(empty.resources.is_empty());
    assert_eq!(empty.version_info, version_of(&gw, DR));
}

#[tokio::test]
async fn unknown_or_empty_type_urls_end_the_stream() {
    let (_galley, _upstream, gw) = setup().await;
    for type_url in ["", "type.googleapis.com/no.Such", "istio/no/such/thing"] {
        let mut client = sotw(gw.listen).await;
        client.subscribe(type_url);
        let status = client.end_status().await;
        assert_eq!(status.code(), Code::InvalidArgument, "{type_url:?}: {status:?}");
        assert_eq!(status.message(), format!("unsupported type_url {type_url:?}"));
    }
}

#[tokio::test]
async fn client_eof_and_cancel_remove_its_state() {
    let (_galley, _upstream, gw) = setup().await;
    let mut leaving = sotw(gw.listen).await;
    leaving.subscribe(VS);
    leaving.recv().await;
    let mut cancelling = sotw(gw.listen).await;
    cancelling.subscribe(VS);
    cancelling.recv().await;
    assert_eq!(gw.registry.len(), 2);

    let mut rest = leaving.close();
    let end = crate::helpers::within("the stream to end after EOF", rest.message()).await;
    assert!(matches!(end, Ok(None)), "a clean close: {end:?}");
    drop(cancelling);
    eventually("both streams removed", || gw.registry.is_empty()).await;
}

/// A client that stops reading holds at most its one outstanding response per
/// type; others keep getting every version, and when it reads again it is
/// brought to the latest version.
#[tokio::test]
async fn a_slow_client_does_not_hold_back_a_fast_one() {
    let (_galley, mut upstream, gw) = setup().await;
    let big = |version: &str| {
        (0..8)
            .map(|i| resource(&format!("vs-{i}"), version, &vec![b'x'; 256 << 10]))
            .collect::<Vec<_>>()
    };
    // 2 MiB per version, more than HTTP/2 buffers for an unread stream.
    upstream.push_full(VS, big("1")).await;
    let mut slow = sotw(gw.listen).await;
    slow.subscribe(VS);
    let mut fast = sotw(gw.listen).await;
    fast.subscribe(VS);
    let mut last = fast.recv().await;
    fast.ack(&last);

    for v in 2..=6 {
        upstream.push_full(VS, big(&v.to_string())).await;
        loop {
            let response = fast.recv().await;
            fast.ack(&response);
            if response.version_info == version_of(&gw, VS) {
                last = response;
                break;
            }
        }
    }
    assert_eq!(last.version_info, version_of(&gw, VS));
    let slow_view = gw
        .registry
        .streams()
        .into_iter()
        .find(|s| s.id == 1)
        .expect("the slow stream is still registered");
    assert!(
        slow_view.types[VS].outstanding,
        "one response waits for the slow client"
    );

    let stale = slow.recv().await;
    slow.ack(&stale);
    let current = slow.recv().await;
    assert_eq!(
        current.version_info,
        version_of(&gw, VS),
        "straight to the latest version"
    );
}

/// The encode-once path: every client at a version receives the same bytes,
/// apart from its own nonce.
#[tokio::test]
async fn clients_at_one_version_receive_identical_bytes_but_the_nonce() {
    let (_galley, _upstream, gw) = setup().await;
    let mut a = raw_sotw(gw.listen).await;
    let mut b = raw_sotw(gw.listen).await;
    // Give b a different nonce counter: one extra response first.
    b.send(request(GW));
    let _ = b.recv().await;
    a.send(request(VS));
    b.send(request(VS));
    let (ra, rb) = (a.recv().await, b.recv().await);
    let nonce_a = nonce_field(&ra);
    let nonce_b = nonce_field(&rb);
    assert_ne!(nonce_a, nonce_b);
    assert!(ra.ends_with(&nonce_a) && rb.ends_with(&nonce_b));
    assert_eq!(ra[..ra.len() - nonce_a.len()], rb[..rb.len() - nonce_b.len()]);
}

fn request(type_url: &str) -> mcp_xds_gateway::proto::MeshConfigRequest {
    mcp_xds_gateway::proto::MeshConfigRequest {
        type_url: type_url.into(),
        ..Default::default()
    }
}

/// The encoded nonce field (tag 4) of a response.
fn nonce_field(bytes: &[u8]) -> Vec<u8> {
    use prost::Message;
    let nonce = MeshConfigResponse::decode(bytes).unwrap().nonce;
    let mut field = Vec::new();
    prost::encoding::string::encode(4, &nonce, &mut field);
    field
}

/// A request that is not a `MeshConfigRequest` ends the stream with a status
/// that says so, and the gateway keeps serving everyone else.
#[tokio::test]
async fn a_request_that_does_not_decode_ends_the_stream_with_a_status() {
    let (_galley, _upstream, gw) = setup().await;
    let status = crate::helpers::clients::send_garbled(gw.listen).await;
    assert_ne!(status.code(), Code::Ok, "{status:?}");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("not a valid istio.mcp.v1alpha1.MeshConfigRequest"),
        "{status:?}"
    );

    let mut good = sotw(gw.listen).await;
    good.subscribe(VS);
    assert_eq!(good.recv().await.type_url, VS);
}
