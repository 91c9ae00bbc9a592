//! `ResourceSource` served downstream, to sinks as Istio's `pkg/mcp/sink`
//! runs them (Pilot 1.2 to 1.7): full and incremental, with the guarantees of
//! the legacy service (nothing invented, NACKed versions never re-sent, stale
//! nonces ignored, one outstanding response per collection).

use crate::helpers::clients::PilotSink;
use crate::helpers::galley::{incremental, resource};
use crate::helpers::{eventually, galley_and_gateway, get_json, names, GW, VS};

#[tokio::test]
async fn a_pilot_sink_gets_each_collection_and_every_change() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS, GW], &[]).await;
    upstream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    upstream.push_full(GW, vec![resource("g", "1", b"g")]).await;

    let mut sink = PilotSink::connect(gw.listen, &[VS, GW], false).await;
    let mut first = vec![sink.recv_and_ack().await, sink.recv_and_ack().await];
    first.sort_by(|a, b| a.collection.cmp(&b.collection));
    assert_eq!(first[0].collection, GW);
    assert_eq!(first[1].collection, VS);
    for message in &first {
        assert!(!message.incremental, "a sink that asked for full state gets it");
        assert_eq!(
            message.system_version_info,
            *gw.cache.get(&message.collection).unwrap().version,
            "the cache's content version"
        );
    }
    assert_eq!(names(&first[1].resources), ["a", "b"]);

    upstream
        .push_full(VS, vec![resource("a", "2", b"a2"), resource("c", "1", b"c")])
        .await;
    let change = sink.recv_and_ack().await;
    assert_eq!(change.collection, VS);
    assert!(!change.incremental);
    assert_eq!(names(&change.resources), ["a", "c"]);
    assert_eq!(sink.names(VS), ["a", "c"]);

    // The debug views show it like any client, by protocol.
    eventually("the sink's ACK to show", || {
        gw.registry.streams().iter().any(|s| {
            s.types
                .get(VS)
                .is_some_and(|t| t.acked_version.as_deref() == Some(&*change.system_version_info))
        })
    })
    .await;
    let clients = get_json(gw.admin, "/debug/clients").await;
    let stream = &clients[0];
    assert_eq!(stream["protocol"], "resource-source");
    assert_eq!(stream["node_id"], "pilot-sink");
    assert_eq!(stream["types"][VS]["incremental"], false);
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    assert!(
        syncz["rows"]
            .as_array()
            .unwrap()
            .iter()
            .all(|row| row["status"] == "SYNCED"),
        "{syncz}"
    );
}

#[tokio::test]
async fn an_incremental_sink_gets_changes_and_resumes_from_what_it_holds() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream
        .push_full(
            VS,
            vec![
                resource("a", "1", b"a"),
                resource("b", "1", b"b"),
                resource("c", "1", b"c"),
            ],
        )
        .await;

    let mut sink = PilotSink::connect(gw.listen, &[VS], true).await;
    let first = sink.recv_and_ack().await;
    assert_eq!(names(&first.resources), ["a", "b", "c"]);

    // Galley's own incremental update arrives as one: the changes only.
    let reply = upstream
        .send(incremental(
            VS,
            vec![resource("a", "2", b"a2"), resource("d", "1", b"d")],
            &["b"],
        ))
        .await;
    assert!(reply.error_detail.is_none(), "{reply:?}");
    let change = sink.recv_and_ack().await;
    assert!(change.incremental, "changes only");
    assert_eq!(names(&change.resources), ["a", "d"]);
    assert_eq!(change.removed_resources, ["b"]);
    assert_eq!(change.system_version_info, *gw.cache.get(VS).unwrap().version);
    assert_eq!(sink.names(VS), ["a", "c", "d"]);

    // A new stream reporting what it holds, and a name the gateway no longer
    // has: the whole collection (versions cannot prove content) and the
    // removal of the stray name.
    sink.held.get_mut(VS).unwrap().insert("stray".into(), "9".into());
    sink.reconnect(gw.listen).await;
    let resumed = sink.recv_and_ack().await;
    assert!(resumed.incremental);
    assert_eq!(names(&resumed.resources), ["a", "c", "d"]);
    assert_eq!(resumed.removed_resources, ["stray"]);
    assert_eq!(sink.names(VS), ["a", "c", "d"]);
}

#[tokio::test]
async fn nacked_versions_are_not_resent_and_stale_nonces_are_ignored() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;

    // Nothing is invented before the source delivers: the sink's request is
    // followed, and waits.
    let mut sink = PilotSink::connect(gw.listen, &[VS], false).await;
    eventually("the sink's request to be followed", || {
        gw.registry.streams().iter().any(|s| s.types.contains_key(VS))
    })
    .await;
    assert!(gw.registry.streams()[0].types[VS].last_sent_version.is_none());

    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let v1 = sink.stream.recv().await;
    assert_eq!(names(&v1.resources), ["a"]);
    sink.nack(&v1, "the updater refused it");
    // A request with a nonce that was never sent is stale: ignored.
    sink.stream.send(mcp_xds_gateway::proto::RequestResources {
        collection: VS.into(),
        response_nonce: "not-a-nonce".into(),
        ..Default::default()
    });
    eventually("the NACK to show", || {
        gw.registry.streams()[0].types[VS]
            .last_nack
            .as_ref()
            .is_some_and(|n| *n.version == *v1.system_version_info)
    })
    .await;

    upstream.push_full(VS, vec![resource("a", "2", b"a2")]).await;
    let v2 = sink.recv_and_ack().await;
    assert_ne!(
        v2.system_version_info, v1.system_version_info,
        "the NACKed version is not sent again"
    );
    assert_eq!(names(&v2.resources), ["a"]);
    assert_eq!(v2.resources[0].metadata.as_ref().unwrap().version, "2");
    // The next message is the next change, not a resend of either.
    upstream.push_full(VS, vec![resource("a", "3", b"a3")]).await;
    let v3 = sink.recv_and_ack().await;
    assert_eq!(v3.resources[0].metadata.as_ref().unwrap().version, "3");
}

#[tokio::test]
async fn an_unknown_collection_ends_the_stream_as_galley_does() {
    let (_galley, gw, _upstream) = galley_and_gateway(&[VS], &[]).await;
    let mut sink = PilotSink::connect(gw.listen, &["istio/unknown/v1/things"], false).await;
    let status = sink.stream.end_status().await;
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    // Galley's words: a gateway chained behind this one drops the collection
    // and reconnects with the rest, as it does with Galley.
    assert_eq!(status.message(), "unsupported collection \"istio/unknown/v1/things\"");
}
