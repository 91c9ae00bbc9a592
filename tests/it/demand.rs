//! A client's demand never disturbs what others get: collections only
//! clients ask for (istiod 1.8+'s newer kinds) are asked on a probe stream
//! of their own, never on the main upstream stream; a source that kills a
//! stream for an unknown collection (Galley 1.1 to 1.7) kills only the
//! probe, and one that never answers leaves them answered empty to xDS
//! clients after --demand-timeout, then served if it delivers them later.

use std::collections::BTreeSet;
use std::time::Duration;

use mcp_xds_gateway::app::Bound;
use mcp_xds_gateway::tools::galley::StreamInfo;
use tokio::time::Instant;

use crate::helpers::clients::{channel, sotw};
use crate::helpers::galley::{dial_out, resource, FakeGalley};
use crate::helpers::{
    eventually, galley_and_gateway, gateway_for, gateway_process_for, get_json, names, upstream_status_when, DR, GW, VS,
};
use crate::limits::{metric, metric_is};
use crate::sources::dial_out_gateway_with;
use crate::xds::{ack, istiod, mcp_resources, one_each, SotwStream};

const WG: &str = "istio/networking/v1alpha3/workloadgroups";
const PROXY_CONFIG: &str = "istio/networking/v1beta1/proxyconfigs";
const TELEMETRY: &str = "istio/telemetry/v1alpha1/telemetries";
const WASM: &str = "istio/extensions/v1alpha1/wasmplugins";
/// The kinds istiod 1.8+ asks for that no Galley ever served.
const NEWER: [&str; 4] = [WG, PROXY_CONFIG, TELEMETRY, WASM];
const WG_GVK: &str = "networking.istio.io/v1alpha3/WorkloadGroup";
const TELEMETRY_GVK: &str = "telemetry.istio.io/v1alpha1/Telemetry";
const NEWER_GVKS: [&str; 4] = [
    WG_GVK,
    "networking.istio.io/v1beta1/ProxyConfig",
    TELEMETRY_GVK,
    "extensions.istio.io/v1alpha1/WasmPlugin",
];
const VS_GVK: &str = "networking.istio.io/v1alpha3/VirtualService";
const DR_GVK: &str = "networking.istio.io/v1alpha3/DestinationRule";
const GW_GVK: &str = "networking.istio.io/v1alpha3/Gateway";
const SE: &str = "istio/networking/v1alpha3/serviceentries";
const SE_GVK: &str = "networking.istio.io/v1alpha3/ServiceEntry";
const AP: &str = "istio/security/v1beta1/authorizationpolicies";
const AP_GVK: &str = "security.istio.io/v1beta1/AuthorizationPolicy";

/// The main stream: the first one the gateway opened, still open, and the
/// upstream never reconnected, failed or backed off.
fn assert_main_stream_untouched(gw: &Bound, streams: &[StreamInfo]) {
    let main = &streams[0];
    assert_eq!(main.ended, None, "the main stream never ended: {streams:?}");
    let status = gw.upstream.borrow().clone();
    assert!(status.connected, "{status:?}");
    assert_eq!(status.attempts, 1, "one main stream attempt: {status:?}");
    assert_eq!(status.connections, 1, "never reconnected: {status:?}");
    assert_eq!(status.consecutive_failures, 0, "no failure: {status:?}");
    assert_eq!(status.last_error, None, "{status:?}");
    assert_eq!(status.next_retry_in, None, "no backoff: {status:?}");
}

/// The probes: every stream after the main one asked only for collections
/// no client had configured.
fn assert_probes_asked_only(streams: &[StreamInfo], demanded: &[&str]) {
    for probe in &streams[1..] {
        assert!(
            probe.asked.iter().all(|c| demanded.contains(&c.as_str())),
            "a probe asked for something configured: {streams:?}"
        );
    }
}

/// A string field (`field` of each element) of a JSON array.
fn strings<'a>(
    array: &'a serde_json::Value,
    field: impl Fn(&'a serde_json::Value) -> &'a serde_json::Value,
) -> Vec<&'a str> {
    let elements = array.as_array().unwrap_or_else(|| panic!("an array: {array}"));
    elements
        .iter()
        .map(|e| field(e).as_str().unwrap_or_else(|| panic!("a string in {e}")))
        .collect()
}

/// Reads `count` responses within `bound`.
async fn answered_within(
    client: &mut SotwStream,
    count: usize,
    bound: Duration,
) -> std::collections::HashMap<String, mcp_xds_gateway::proto::envoy::service::discovery::v3::DiscoveryResponse> {
    tokio::time::timeout(bound, one_each(client, count))
        .await
        .unwrap_or_else(|_| panic!("every type answered within {bound:?}"))
}

/// A source of another make ends the probe without naming the collection it
/// refuses. The batch is then asked for one collection at a time: the ones it
/// serves are not starved (answered with their content, not empty after
/// --demand-timeout), the ones it refuses are refused, and the main stream
/// never notices.
#[tokio::test]
async fn a_probe_ended_without_a_name_is_split_and_starves_nothing() {
    let mut galley = FakeGalley::start().await;
    // Asked for first (in name order), so that its refusal ends the probe
    // before the collections the source serves are answered.
    galley.refuse_unnamed(WASM);
    galley.refuse_unnamed(TELEMETRY);
    galley.publish(GW, vec![resource("default/gw", "1", b"x")]);
    galley.publish(SE, vec![resource("default/se", "1", b"x")]);
    galley.publish(VS, vec![resource("default/vs", "1", b"x")]);
    let gw = gateway_for(&galley, &[VS], &["--demand-timeout", "30s"]).await;
    let _main = galley.next_stream().await;
    eventually("the configured collection applied", || gw.cache.get(VS).is_some()).await;
    let types = [GW_GVK, SE_GVK, "extensions.istio.io/v1alpha1/WasmPlugin", TELEMETRY_GVK];
    let mut client = istiod(gw.listen, &types).await;
    // Well within --demand-timeout: nothing is answered for want of time.
    let answered = answered_within(&mut client, types.len(), Duration::from_secs(20)).await;
    for gvk in [GW_GVK, SE_GVK] {
        assert_eq!(mcp_resources(&answered[gvk]).len(), 1, "{gvk} served with its content");
    }
    for gvk in ["extensions.istio.io/v1alpha1/WasmPlugin", TELEMETRY_GVK] {
        assert!(answered[gvk].resources.is_empty(), "{gvk} refused: answered empty");
    }
    let state = gw.subscriptions.current();
    for collection in [WASM, TELEMETRY] {
        assert!(
            state.refused[collection].contains("bad request"),
            "{collection}: {state:?}"
        );
    }
    assert_main_stream_untouched(&gw, &galley.streams());
}

/// Galley 1.1 to 1.7 end a stream for a collection they do not serve. An
/// istiod asking for the newer kinds beside served ones, configured and not,
/// is answered every type at once; the served ones with their content; and
/// the main upstream stream never notices.
#[tokio::test]
async fn galley_killing_streams_for_unknown_collections_kills_only_probes() {
    let mut galley = FakeGalley::start().await;
    for collection in NEWER {
        galley.refuse(collection);
    }
    // Configured: VS and DR. Served by Galley but only asked for by the
    // client: GW, SE, AP.
    for (i, collection) in [VS, DR, GW, SE, AP].into_iter().enumerate() {
        galley.publish(collection, vec![resource(&format!("default/r{i}"), "1", b"x")]);
    }
    // A --demand-timeout no answer here can wait for: an empty answer
    // within the wait below comes from the refusal.
    let gw = gateway_for(&galley, &[VS, DR], &["--demand-timeout", "10m"]).await;
    let _main = galley.next_stream().await;
    eventually("the configured collections applied", || {
        gw.cache.get(VS).is_some() && gw.cache.get(DR).is_some()
    })
    .await;

    let served_gvks = [VS_GVK, DR_GVK, GW_GVK, SE_GVK, AP_GVK];
    let mut types = vec!["core/v1alpha1/MeshConfig"];
    types.extend(served_gvks);
    types.extend(NEWER_GVKS);
    let mut client = istiod(gw.listen, &types).await;
    // Every newer kind is refused on a probe, long before --demand-timeout.
    let answered = answered_within(&mut client, types.len(), Duration::from_secs(20)).await;
    for gvk in served_gvks {
        assert_eq!(mcp_resources(&answered[gvk]).len(), 1, "{gvk} keeps its content");
    }
    for gvk in NEWER_GVKS.into_iter().chain(["core/v1alpha1/MeshConfig"]) {
        assert!(answered[gvk].resources.is_empty(), "{gvk} answered empty");
    }

    let state = gw.subscriptions.current();
    for collection in NEWER {
        assert!(
            state.refused[collection].contains("unsupported collection"),
            "{collection}: {state:?}"
        );
    }
    assert!(state.demanded.is_empty(), "{state:?}");
    for collection in [GW, SE, AP] {
        assert!(
            state.wanted.contains(collection),
            "subscribed once delivered: {state:?}"
        );
    }
    let streams = galley.streams();
    assert_main_stream_untouched(&gw, &streams);
    let main: BTreeSet<&str> = streams[0].asked.iter().map(String::as_str).collect();
    assert_eq!(
        main,
        BTreeSet::from([VS, DR, GW, SE, AP]),
        "the main stream asked for what Galley serves, never for what it refuses"
    );
    assert_probes_asked_only(&streams, &[GW, SE, AP, WG, PROXY_CONFIG, TELEMETRY, WASM]);
    assert!(
        streams.len() <= 1 + NEWER.len(),
        "a probe per refusal at most: {streams:?}"
    );
    for collection in NEWER {
        let asked = galley.log().iter().filter(|r| r.collection == collection).count();
        assert_eq!(asked, 1, "{collection} asked for once");
    }
}

/// A source that neither serves nor refuses the newer kinds: an istiod
/// waiting for them is answered them empty once --demand-timeout passed, not
/// before; and when the source starts serving one, the client gets it.
#[tokio::test]
async fn a_source_that_never_answers_gets_its_clients_answered_empty_then_served_later() {
    let mut galley = FakeGalley::start().await;
    for collection in NEWER {
        galley.ignore(collection);
    }
    galley.publish(VS, vec![resource("default/reviews", "1", b"vs")]);
    let timeout = Duration::from_secs(2);
    let gw = gateway_for(&galley, &[VS], &["--demand-timeout", "2s"]).await;
    let _main = galley.next_stream().await;
    eventually("VS applied", || gw.cache.get(VS).is_some()).await;
    // An MCP client is never sent an answer the source did not give.
    let mut legacy = sotw(gw.listen).await;
    legacy.subscribe(WG);

    let mut types = vec![VS_GVK];
    types.extend(NEWER_GVKS);
    let asked = Instant::now();
    let mut client = istiod(gw.listen, &types).await;
    let first = client.recv().await;
    assert_eq!(first.type_url, VS_GVK, "the served type at once");
    assert_eq!(mcp_resources(&first).len(), 1);
    ack(&client, &first);
    // Answered once the timeout passed; the upper bound is the suite's wait
    // past it (a loaded machine may be late; it may never be early).
    let answered = answered_within(&mut client, NEWER_GVKS.len(), timeout + Duration::from_secs(20)).await;
    assert!(asked.elapsed() >= timeout, "not before --demand-timeout");
    for gvk in NEWER_GVKS {
        assert!(answered[gvk].resources.is_empty(), "{gvk} answered empty");
        ack(&client, &answered[gvk]);
    }

    // Shown as not delivered by the source, counted, and never asked for on
    // the main stream.
    let upstream = get_json(gw.admin, "/debug/upstream").await;
    let demand = &upstream["demand"];
    assert_eq!(demand["route"], "probe");
    assert_eq!(demand["timeout_seconds"], 2.0);
    let shown: Vec<(&str, &str)> = strings(&demand["collections"], |c| &c["collection"])
        .into_iter()
        .zip(strings(&demand["collections"], |c| &c["state"]))
        .collect();
    for collection in NEWER {
        assert!(
            shown.contains(&(collection, "not delivered by the source")),
            "{collection}: {upstream:#}"
        );
    }
    let mut asking = strings(&demand["probe"]["asking"], |c| c);
    asking.sort_unstable();
    let mut newer = NEWER.to_vec();
    newer.sort_unstable();
    assert_eq!(asking, newer, "the probe stays open, asking: {upstream:#}");
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    let not_delivered = strings(&syncz["not_delivered"], |c| &c["collection"]);
    assert!(not_delivered.contains(&TELEMETRY), "{syncz:#}");
    let table = mcp_xds_gateway::tools::status::render(&syncz);
    assert!(table.contains(&format!("NOT DELIVERED {TELEMETRY}:")), "{table}");
    // Counted: `a_demand_that_times_out_is_counted_once_per_collection`,
    // with a gateway process of its own.
    let streams = galley.streams();
    assert_eq!(streams[0].asked, [VS], "{streams:?}");
    assert_probes_asked_only(&streams, &NEWER);

    // The MCP client got nothing for it: its next response is for the type
    // it asks for now.
    legacy.subscribe(VS);
    assert_eq!(legacy.recv().await.type_url, VS, "no invented answer for an MCP client");

    // The source starts serving Telemetry: the client gets its content.
    galley.publish(TELEMETRY, vec![resource("istio-system/mesh-default", "1", b"t")]);
    let served = client.recv().await;
    assert_eq!(served.type_url, TELEMETRY_GVK);
    assert_eq!(names(&mcp_resources(&served)), ["istio-system/mesh-default"]);
    let state = gw.subscriptions.current();
    assert!(
        state.wanted.contains(TELEMETRY),
        "subscribed on the main stream: {state:?}"
    );
    assert!(!state.demanded.contains_key(TELEMETRY));
    let streams = galley.streams();
    assert_eq!(streams[0].asked, [VS, TELEMETRY], "{streams:?}");
    assert_main_stream_untouched(&gw, &streams);
}

/// Each demanded collection the source never answers is counted once when
/// --demand-timeout passes, and a configured one never. The gateway is a
/// process of its own: the series read are its own, never moved by another
/// test's gateway.
#[tokio::test]
async fn a_demand_that_times_out_is_counted_once_per_collection() {
    let galley = FakeGalley::start().await;
    for collection in NEWER {
        galley.ignore(collection);
    }
    galley.publish(VS, vec![resource("default/reviews", "1", b"vs")]);
    let gw = gateway_process_for(&galley, &[VS], &["--demand-timeout", "1s"]).await;
    let series =
        |collection: &str| format!("mcp_gateway_upstream_demand_timeouts_total{{collection=\"{collection}\"}}");
    let mut types = vec![VS_GVK];
    types.extend(NEWER_GVKS);
    let mut client = istiod(gw.listen, &types).await;
    let first = client.recv().await;
    assert_eq!(first.type_url, VS_GVK, "the served type at once");
    ack(&client, &first);
    let answered = answered_within(&mut client, NEWER_GVKS.len(), Duration::from_secs(1 + 20)).await;
    for gvk in NEWER_GVKS {
        assert!(answered[gvk].resources.is_empty(), "{gvk} answered empty");
    }
    for collection in NEWER {
        metric_is(gw.monitoring, &series(collection), 1).await;
    }
    assert_eq!(
        metric(gw.monitoring, &series(VS)).await,
        0,
        "a configured collection is never demanded"
    );
}

/// In dial-out mode the gateway cannot open a stream of its own to the
/// source: a collection only a client asked for is never requested on the
/// one live stream, and xDS clients are answered it empty after the timeout.
#[tokio::test]
async fn dial_out_never_asks_for_a_demanded_collection_and_answers_it_empty() {
    let gw = dial_out_gateway_with(&["--demand-timeout", "1s"]).await;
    let mut source = dial_out(channel(gw.sink.unwrap()).await, &[]).await.unwrap();
    assert_eq!(source.initial_requests(1).await[0].collection, VS);
    source
        .push_full(VS, vec![resource("default/reviews", "1", b"vs")])
        .await;

    let asked = Instant::now();
    let mut client = istiod(gw.listen, &[VS_GVK, WG_GVK]).await;
    let answered = answered_within(&mut client, 2, Duration::from_secs(1 + 20)).await;
    assert!(asked.elapsed() >= Duration::from_secs(1), "not before --demand-timeout");
    assert_eq!(mcp_resources(&answered[VS_GVK]).len(), 1);
    assert!(answered[WG_GVK].resources.is_empty());

    assert!(
        source.try_next_request().is_none(),
        "nothing asked on the live stream after the initial request and the ACK"
    );
    let status = gw.upstream.borrow().clone();
    assert!(status.connected && status.connections == 1, "{status:?}");
    let upstream = get_json(gw.admin, "/debug/upstream").await;
    let demand = &upstream["demand"];
    assert_eq!(demand["route"], "hold");
    let wg = &demand["collections"][0];
    assert_eq!(wg["collection"], WG);
    assert_eq!(wg["state"], "not delivered by the source");
    assert!(wg["note"].as_str().unwrap().contains("--collections"), "{upstream:#}");
    assert!(!gw.subscriptions.current().wanted.contains(WG));
}

/// A refusal is recorded once: the collection is never asked for again,
/// and the main stream pays nothing for it.
#[tokio::test]
async fn a_refusal_is_never_asked_again_and_costs_the_main_stream_no_backoff() {
    let mut galley = FakeGalley::start().await;
    galley.refuse(WG);
    galley.publish(VS, vec![resource("default/reviews", "1", b"vs")]);
    galley.publish(GW, vec![resource("default/gw", "1", b"gw")]);
    // A --demand-timeout no answer here can wait for (as above).
    let gw = gateway_for(&galley, &[VS], &["--demand-timeout", "10m"]).await;
    let _main = galley.next_stream().await;
    eventually("VS applied", || gw.cache.get(VS).is_some()).await;

    let mut first = istiod(gw.listen, &[VS_GVK, WG_GVK]).await;
    let answered = answered_within(&mut first, 2, Duration::from_secs(20)).await;
    assert!(answered[WG_GVK].resources.is_empty());
    assert!(gw.subscriptions.is_refused(WG));
    // Refused at once: nothing waited for the timeout.
    let probe = gw.upstream.borrow().probe.clone().expect("client mode has a probe");
    assert!(
        probe.last_error.as_deref().unwrap().contains("unsupported collection"),
        "{probe:?}"
    );
    assert_eq!(
        probe.next_retry_in, None,
        "a refusal is an answer, not a failure: {probe:?}"
    );

    // Asked again by another client, beside a collection nobody demanded
    // yet: the refused one is answered empty, not asked. The other one's
    // probe has come and delivered before the count is read, so a probe
    // the same request would have opened for the refused one came too.
    let mut second = istiod(gw.listen, &[WG_GVK, GW_GVK]).await;
    let again = answered_within(&mut second, 2, Duration::from_secs(20)).await;
    assert!(again[WG_GVK].resources.is_empty());
    assert_eq!(mcp_resources(&again[GW_GVK]).len(), 1, "served by its probe");
    let asked = galley.log().iter().filter(|r| r.collection == WG).count();
    assert_eq!(asked, 1, "asked for once, on the first probe");
    let streams = galley.streams();
    assert_eq!(streams.len(), 3, "the main stream and two probes: {streams:?}");
    assert_eq!(
        streams[1].ended.as_deref(),
        Some(&*format!("unsupported collection {WG:?}"))
    );
    assert_eq!(streams[2].asked, [GW], "the second probe asked only for the new one");
    assert_main_stream_untouched(&gw, &streams);
}

/// A probe that fails for any other reason backs off on its own and asks
/// again; the main stream never hears of it.
#[tokio::test]
async fn a_failed_probe_backs_off_on_its_own_and_asks_again() {
    let (mut galley, gw, mut main) = galley_and_gateway(&[VS], &[]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(GW);
    let first = galley.next_stream().await;
    first.kill(tonic::Status::unavailable("galley is restarting"));
    let status = upstream_status_when(&gw, "the probe's retry scheduled", |s| {
        s.probe.as_ref().is_some_and(|p| p.next_retry_in.is_some())
    })
    .await;
    let probe = status.probe.as_ref().unwrap();
    assert!(
        probe.last_error.as_deref().unwrap().contains("galley is restarting"),
        "{probe:?}"
    );
    assert_eq!(
        status.consecutive_failures, 0,
        "the main stream's backoff is untouched: {status:?}"
    );
    assert_eq!(status.next_retry_in, None, "{status:?}");

    let mut second = galley.next_stream().await;
    assert_eq!(second.next_request().await.collection, GW, "asked again");
    second.send_only(crate::helpers::galley::full(GW, vec![resource("ingress", "1", b"g")]));
    assert_eq!(
        main.next_request().await.collection,
        GW,
        "subscribed on the main stream"
    );
    main.push_full(GW, vec![resource("ingress", "1", b"g")]).await;
    assert_eq!(names(&client.recv_type(GW).await.resources), ["ingress"]);
    assert_main_stream_untouched(&gw, &galley.streams());
}
