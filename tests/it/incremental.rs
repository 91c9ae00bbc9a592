//! `IncrementalAggregatedResources`: the initial diff against the client's
//! versions, diffs against what it ACKed, NACKs, stale nonces, coalescing, and
//! one type per stream.

use mcp_xds_gateway::app::Bound;
use mcp_xds_gateway::proto::IncrementalMeshConfigResponse;
use tonic::Code;

use crate::helpers::clients::incremental;
use crate::helpers::galley::{resource, FakeGalley, GalleyStream};
use crate::helpers::{eventually, gateway_for, names, GW, VS};

async fn setup() -> (FakeGalley, GalleyStream, Bound) {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS, GW], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(2).await;
    stream
        .push_full(
            VS,
            vec![
                resource("a", "1", b"a"),
                resource("b", "2", b"b"),
                resource("c", "1", b"c"),
            ],
        )
        .await;
    (galley, stream, gw)
}

fn version_of(gw: &Bound, collection: &str) -> String {
    gw.cache.get(collection).unwrap().version.to_string()
}

fn removed(response: &IncrementalMeshConfigResponse) -> Vec<String> {
    let mut removed = response.removed_resources.clone();
    removed.sort();
    removed
}

/// The first response is the whole collection, and removes the names the
/// client reported that are gone. A version alone cannot show that a source
/// reused it for another body, so nothing is skipped on the client's word.
#[tokio::test]
async fn the_first_response_is_the_collection_and_removes_what_is_gone() {
    let (_galley, _upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[("a", "1"), ("b", "1"), ("gone", "9")]);
    let first = client.recv().await;
    assert_eq!(names(&first.resources), ["a", "b", "c"]);
    assert_eq!(removed(&first), ["gone"]);
    assert_eq!(first.system_version_info, version_of(&gw, VS));
    assert!(!first.nonce.is_empty());
}

#[tokio::test]
async fn a_client_reporting_the_current_versions_still_gets_the_collection() {
    let (_galley, _upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[("a", "1"), ("b", "2"), ("c", "1")]);
    let first = client.recv().await;
    assert_eq!(names(&first.resources), ["a", "b", "c"]);
    assert!(first.removed_resources.is_empty());
    assert_eq!(first.system_version_info, version_of(&gw, VS));
}

#[tokio::test]
async fn later_responses_carry_only_the_change() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[]);
    let first = client.recv().await;
    assert_eq!(names(&first.resources), ["a", "b", "c"]);
    client.reply(VS, &first.nonce, None);

    upstream
        .push_full(
            VS,
            vec![
                resource("a", "1", b"a"),
                resource("b", "3", b"b3"),
                resource("d", "1", b"d"),
            ],
        )
        .await;
    let second = client.recv().await;
    assert_eq!(names(&second.resources), ["b", "d"]);
    assert_eq!(removed(&second), ["c"]);
    assert_eq!(second.system_version_info, version_of(&gw, VS));
    assert_ne!(second.nonce, first.nonce);
}

#[tokio::test]
async fn after_a_nack_nothing_is_resent_and_the_next_diff_is_from_the_acked_state() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[]);
    let first = client.recv().await;
    client.reply(VS, &first.nonce, None);

    upstream
        .push_full(
            VS,
            vec![
                resource("a", "2", b"bad"),
                resource("b", "2", b"b"),
                resource("c", "1", b"c"),
            ],
        )
        .await;
    let rejected = client.recv().await;
    assert_eq!(names(&rejected.resources), ["a"]);
    client.reply(VS, &rejected.nonce, Some("a: bad"));
    eventually("the NACK recorded", || {
        gw.registry.streams()[0].types[VS]
            .last_nack
            .as_ref()
            .is_some_and(|n| n.message == "a: bad")
    })
    .await;
    assert!(!gw.registry.streams()[0].types[VS].outstanding);

    // Next change: the diff is against the ACKed state, so it carries `a`
    // again (the client never applied a@2) along with the new change.
    upstream
        .push_full(VS, vec![resource("a", "2", b"bad"), resource("b", "2", b"b")])
        .await;
    let next = client.recv().await;
    assert_eq!(names(&next.resources), ["a"]);
    assert_eq!(removed(&next), ["c"]);
    assert_eq!(next.system_version_info, version_of(&gw, VS));
}

#[tokio::test]
async fn stale_nonces_are_ignored() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[]);
    let first = client.recv().await;
    upstream.push_full(VS, vec![resource("a", "2", b"a2")]).await;

    // Taken as an ACK, this would re-arm the type, send the next diff at once,
    // and make the real ACK below stale.
    client.reply(VS, "no-such-nonce", None);
    client.reply(VS, &first.nonce, None);
    let next = client.recv().await;
    assert_eq!(next.system_version_info, version_of(&gw, VS));
    let view = gw.registry.streams()[0].types[VS].clone();
    assert_eq!(view.acked_version.as_deref(), Some(first.system_version_info.as_str()));
    assert_eq!(names(&next.resources), ["a"]);
    assert_eq!(removed(&next), ["b", "c"]);
}

#[tokio::test]
async fn one_outstanding_response_and_changes_coalesce() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[]);
    let first = client.recv().await;
    upstream
        .push_full(
            VS,
            vec![
                resource("a", "2", b"a2"),
                resource("b", "2", b"b"),
                resource("c", "1", b"c"),
            ],
        )
        .await;
    upstream
        .push_full(VS, vec![resource("a", "3", b"a3"), resource("b", "2", b"b")])
        .await;
    client.reply(VS, &first.nonce, None);
    let next = client.recv().await;
    assert_eq!(
        next.system_version_info,
        version_of(&gw, VS),
        "straight to the latest version"
    );
    assert_eq!(names(&next.resources), ["a"]);
    assert_eq!(removed(&next), ["c"]);
}

#[tokio::test]
async fn a_second_type_on_the_stream_ends_it() {
    let (_galley, _upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(VS, &[]);
    let first = client.recv().await;
    client.reply(GW, &first.nonce, None);
    let status = client.end_status().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("one type only"), "{}", status.message());
    // Naming both: the type it follows and the one it asked for.
    assert!(status.message().contains(VS), "{}", status.message());
    assert!(status.message().contains(GW), "{}", status.message());
}

#[tokio::test]
async fn an_unknown_type_url_ends_the_stream() {
    let (_galley, _upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start("type.googleapis.com/no.Such", &[]);
    let status = client.end_status().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "unsupported type_url \"type.googleapis.com/no.Such\"");
}

#[tokio::test]
async fn nothing_is_sent_before_upstream_delivers() {
    let (_galley, mut upstream, gw) = setup().await;
    let mut client = incremental(gw.listen).await;
    client.start(GW, &[("old", "1")]);
    eventually("the stream registered", || !gw.registry.is_empty()).await;
    upstream.push_full(GW, vec![resource("ingress", "1", b"g")]).await;
    let first = client.recv().await;
    assert_eq!(
        first.system_version_info,
        version_of(&gw, GW),
        "the first response is the delivered state"
    );
    assert_eq!(names(&first.resources), ["ingress"]);
    assert_eq!(removed(&first), ["old"]);
}
