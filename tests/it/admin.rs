//! The admin port: liveness, readiness that names what is missing, and the
//! connected clients; and shutdown of the whole app.

use std::time::Duration;

use tonic::Code;

use crate::helpers::clients::{channel, sotw};
use crate::helpers::galley::{dial_out, resource, FakeGalley};
use crate::helpers::{gateway_for, get_json, http_get, http_request, sample, within, GW, VS};

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
    // Connected: the source has not sent it yet.
    assert!(
        body.contains(&format!(
            "upstream {}: connected, and has not sent them yet",
            galley.url()
        )),
        "{body}"
    );

    // Delivered empty is delivered.
    stream.push_full(GW, vec![]).await;
    assert_eq!(http_get(gw.admin, "/readyz").await, (200, "ready\n".to_string()));
}

/// An upstream that cannot be reached: `/readyz` and gRPC health say why
/// on one line: what is missing, how many attempts, the last error.
#[tokio::test]
async fn readiness_says_why_on_one_line() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let gw = crate::helpers::start_gateway(&[
        "--upstream",
        "http://127.0.0.1:1",
        "--collections",
        &format!("{VS},{GW}"),
        "--reconnect-min-delay",
        "10ms",
    ])
    .await;
    let body = crate::helpers::eventually_some("an attempt's error in /readyz", || async {
        let (status, body) = http_get(gw.admin, "/readyz").await;
        assert_eq!(status, 503, "{body}");
        body.contains("last error").then_some(body)
    })
    .await;
    assert_eq!(body.lines().count(), 1, "one line: {body}");
    for part in [
        "not ready: waiting for the first state of 2 collections",
        VS,
        GW,
        "upstream http://127.0.0.1:1: not connected after ",
        "; last error: ",
    ] {
        assert!(body.contains(part), "{part:?} in {body}");
    }
    let status = gw.upstream.borrow().clone();
    assert!(status.last_error.as_ref().is_some_and(|e| !e.is_empty()), "{status:?}");

    // The monitoring port (0.0.0.0 by default) counts, and names nothing:
    // no collection, no address, no error's words.
    let (status, counted) = http_get(gw.monitoring, "/readyz").await;
    assert_eq!(status, 503, "{counted}");
    assert_eq!(
        counted,
        "not ready: 3 problems: 2 collections without a first state; the source has an error; \
         the details are on the admin port (/readyz, /debug/upstream)\n"
    );

    // gRPC health's answer has a status only: the reason is its header,
    // counted as on the monitoring port (a client is not the operator).
    let mut health = HealthClient::new(channel(gw.listen).await);
    let answer = within(
        "a health check",
        health.check(HealthCheckRequest { service: String::new() }),
    )
    .await
    .unwrap();
    let reason = answer
        .metadata()
        .get(mcp_xds_gateway::admin::NOT_READY_HEADER)
        .expect("the reason beside NOT_SERVING")
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(format!("{reason}\n"), counted);
}

/// gRPC health answers for a collection (its name as the service) only to a
/// client that may read some of it: the others get `NOT_FOUND`, as for a
/// collection that does not exist. Here a policy grants plaintext clients
/// the clusters alone; the secrets, which the source has, are nobody's.
#[tokio::test]
async fn grpc_health_of_a_collection_answers_only_who_may_read_it() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    const CLUSTERS: &str = "envoy/config/cluster/v3/clusters";
    const LISTENERS: &str = "envoy/config/listener/v3/listeners";
    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    std::fs::write(
        source.join("config.yaml"),
        format!(
            "collection: {CLUSTERS}\nname: a\nbody: {{type_url: {CLUSTER}, json: {{name: a}}}}\n---\n\
             collection: {LISTENERS}\nname: l\nbody: {{type_url: {LISTENER}, json: {{name: l}}}}\n"
        ),
    )
    .unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!("rules:\n- identities: [unauthenticated]\n  collections: [{CLUSTERS}]\n"),
    )
    .unwrap();
    let gw = crate::helpers::start_gateway(&[
        "--source-dir",
        source.to_str().unwrap(),
        "--access-policy",
        policy.to_str().unwrap(),
    ])
    .await;
    crate::helpers::eventually("both collections in the cache", || {
        gw.cache.get(CLUSTERS).is_some() && gw.cache.get(LISTENERS).is_some()
    })
    .await;
    let mut health = HealthClient::new(channel(gw.listen).await);
    let check = |service: &str| {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let mut health = health.clone();
        async move { within("a health check", health.check(request)).await }
    };
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(check("").await.unwrap().get_ref().status, serving);
    assert_eq!(check(CLUSTERS).await.unwrap().get_ref().status, serving);
    for hidden in [
        LISTENERS,
        "envoy/extensions/transport_sockets/tls/v3/secrets",
        "no/such/collection",
    ] {
        let refused = check(hidden).await.unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "{hidden}: {refused:?}");
        assert_eq!(refused.message(), "service not registered", "{hidden}");
    }
    // Watch too.
    let refused = within(
        "a health watch",
        health.watch(HealthCheckRequest {
            service: LISTENERS.into(),
        }),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
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

/// A raw HTTP/1.1 request naming `host`: status and body.
async fn request_naming(addr: std::net::SocketAddr, host: &str, head: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    within(&format!("{head} as {host}"), async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("{head} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let status = response[9..12].parse().unwrap();
        let body = response.split_once("\r\n\r\n").unwrap().1.to_owned();
        (status, body)
    })
    .await
}

/// A web page the operator opens can neither drive the controls (a form
/// POST carries Origin) nor read the views through a name it resolves to
/// 127.0.0.1 (DNS rebinding); curl and the rollout command can do both.
/// (Their counts: `controls_and_refusals_are_counted_exactly`.)
#[tokio::test]
async fn web_pages_can_neither_drive_the_controls_nor_read_through_another_name() {
    let (_galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    let version = crate::rollout::push(&mut upstream, &gw, vec![crate::rollout::vs("a", "1", "a.example", 1.0)]).await;
    let pin = format!("/pin/{VS}?version={version}");

    // A form on another site, and a script on the admin port's own origin.
    for origin in [
        "Origin: http://evil.example\r\n",
        "Origin: null\r\n",
        "Sec-Fetch-Site: same-origin\r\n",
    ] {
        let (status, body) = http_request(gw.admin, "POST", &pin, origin).await;
        assert_eq!(status, 403, "{origin}: {body}");
        assert!(body.contains("cross-site request forgery"), "{body}");
    }
    let rollout = get_json(gw.admin, &format!("/debug/rollout/{VS}")).await;
    assert!(rollout["pinned"].is_null(), "nothing was pinned: {rollout}");

    // A rebinding page names its own host; an address or localhost is this host.
    let (status, body) = request_naming(gw.admin, "evil.example:15000", &format!("GET /debug/cache/{VS}")).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("DNS rebinding"), "{body}");
    assert!(!body.contains("a.example"), "{body}");
    let (status, body) = request_naming(gw.admin, "localhost", &format!("GET /debug/cache/{VS}")).await;
    assert_eq!(status, 200, "{body}");

    // curl: the pin takes, is counted and so is a control that fails.
    let (status, body) = http_request(gw.admin, "POST", &pin, "").await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version=nope0000"), "").await;
    assert_eq!(status, 404);
    let (status, _) = http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(status, 200);
}

/// Admin controls and refusals are counted, by control and code, exactly:
/// a gateway process of its own (in-process gateways share one recorder,
/// and other tests pin and are refused too).
#[tokio::test]
async fn controls_and_refusals_are_counted_exactly() {
    let (gw, _canary) = crate::limits::spawned_with_canary(&[]).await;
    let cache = get_json(gw.admin, "/debug/cache").await;
    let version = cache
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["collection"] == VS)
        .and_then(|c| c["version"].as_str())
        .unwrap_or_else(|| panic!("{VS} in {cache}"))
        .to_owned();
    let pin = format!("/pin/{VS}?version={version}");
    for origin in ["Origin: http://evil.example\r\n", "Sec-Fetch-Site: cross-site\r\n"] {
        assert_eq!(http_request(gw.admin, "POST", &pin, origin).await.0, 403, "{origin}");
    }
    let (status, _) = request_naming(gw.admin, "evil.example:15000", &format!("GET /debug/cache/{VS}")).await;
    assert_eq!(status, 403);
    assert_eq!(http_request(gw.admin, "POST", &pin, "").await.0, 200);
    assert_eq!(
        http_request(gw.admin, "POST", &format!("/pin/{VS}?version=nope0000"), "")
            .await
            .0,
        404
    );
    assert_eq!(http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await.0, 200);

    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    let controls = |control: &str, code: &str| {
        sample(
            &metrics,
            "mcp_gateway_admin_controls_total",
            &[&format!("control=\"{control}\""), &format!("code=\"{code}\"")],
        )
    };
    assert_eq!(controls("pin", "200"), Some(1.0), "{metrics}");
    assert_eq!(controls("pin", "404"), Some(1.0), "{metrics}");
    assert_eq!(controls("unpin", "200"), Some(1.0), "{metrics}");
    let refusals = |reason: &str| {
        sample(
            &metrics,
            "mcp_gateway_admin_refusals_total",
            &[&format!("reason=\"{reason}\"")],
        )
    };
    assert_eq!(
        (refusals("cross_site"), refusals("host")),
        (Some(2.0), Some(1.0)),
        "{metrics}"
    );
}

/// Wherever a version is taken (`/pin`, `/debug/diff`), the 12 characters
/// the views show will do, as will any unique prefix of at least 8; a
/// shorter one is a 400 that says so, one that begins no version a 404.
#[tokio::test]
async fn versions_are_taken_by_a_unique_prefix_of_at_least_eight() {
    let (_galley, gw, mut upstream) = crate::helpers::galley_and_gateway(&[VS], &[]).await;
    use crate::rollout::{push, vs};
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.example", 1.0)]).await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "b.example", 1.0)]).await;
    assert_eq!(v1.len(), 32, "{v1}");

    let diff = get_json(
        gw.admin,
        &format!("/debug/diff/{VS}?from={}&to={}", &v1[..8], &v2[..12]),
    )
    .await;
    assert_eq!(
        (diff["from"].as_str(), diff["to"].as_str()),
        (Some(&*v1), Some(&*v2)),
        "{diff}"
    );
    assert_eq!(diff["changed"], serde_json::json!(["a"]), "{diff}");

    let (status, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={}", &v1[..12]), "").await;
    assert_eq!(status, 200, "{body}");
    let pinned: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(pinned["pinned"], v1.as_str(), "the whole version: {pinned}");

    let (status, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={}", &v2[..7]), "").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("at least 8") && body.contains(&v2[..7]), "{body}");
    let (status, body) = http_get(gw.admin, &format!("/debug/diff/{VS}?from=ffffffffffff")).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("from=\"ffffffffffff\"") && body.contains("not in the history"),
        "{body}"
    );
    // A collection the gateway does not have: a 404 naming it.
    let unknown = "istio/no/v1/such";
    let (status, body) = http_request(gw.admin, "POST", &format!("/pin/{unknown}?version={}", &v1[..12]), "").await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains(unknown), "{body}");
}

/// `/debug/access` answers one request at a time, and a request that cannot
/// have its turn soon is told to retry (503, `Retry-After: 1`) rather than
/// queue behind every other: many callers asking about long identities at
/// once are each answered or told to retry (the thirty-third check of issue
/// 42 measured 2 s answers when every one waited).
#[tokio::test]
async fn concurrent_access_questions_are_answered_or_told_to_retry() {
    let gw = crate::helpers::start_gateway(&["--debug-access-wait", "300ms"]).await;
    let identity = format!("dns:{}", "a".repeat(60_000));
    let asks = (0..12).map(|_| {
        let path = format!("/debug/access?identity={identity}");
        tokio::spawn(async move { crate::helpers::http_exchange(gw.admin, "GET", &path, "").await })
    });
    let (mut answered, mut retried) = (0, 0);
    for ask in asks {
        let (status, head, body) = ask.await.unwrap();
        match status {
            200 => answered += 1,
            503 => {
                assert!(head.contains("retry-after: 1"), "{head}");
                assert!(body.contains("one at a time"), "{body}");
                retried += 1;
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert!(answered >= 1, "the first in line is answered");
    // Each request told to retry is counted as the limit's refusal.
    crate::limits::refusals_are(gw.monitoring, "debug_access_wait", retried).await;
}

/// `/debug/access` in a browser: without `?identity` a form (the index links
/// here), not a bare 400; with one, the form filled in and the collections
/// with content, the rest behind `?all=1`. JSON callers keep the 400 and
/// every collection.
#[tokio::test]
async fn the_access_page_is_a_form_and_lists_the_collections_with_content() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("vs.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: a, namespace: ns}\nspec:\n  hosts: [a]\n",
    )
    .unwrap();
    let gw = crate::helpers::start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    crate::helpers::eventually("the VirtualService", || gw.cache.get(VS).is_some_and(|s| s.len() == 1)).await;
    let html = "Accept: text/html\r\n";
    let (status, page) = crate::helpers::http_get_with(gw.admin, "/debug/access", html).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("<form") && page.contains("name=\"identity\""), "{page}");
    assert_eq!(http_get(gw.admin, "/debug/access").await.0, 400, "JSON callers");

    let (status, page) = crate::helpers::http_get_with(gw.admin, "/debug/access?identity=unauthenticated", html).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("value=\"unauthenticated\""), "the form filled in: {page}");
    assert!(page.contains(VS), "{page}");
    assert!(
        !page.contains("envoy/config/listener/v3/listeners"),
        "no empty collection: {page}"
    );
    assert!(page.contains("more collections hold nothing now"), "{page}");
    let (_, all) = crate::helpers::http_get_with(gw.admin, "/debug/access?identity=unauthenticated&all=1", html).await;
    assert!(all.contains("envoy/config/listener/v3/listeners"), "{all}");
    let json = get_json(gw.admin, "/debug/access?identity=unauthenticated").await;
    assert!(
        json["collections"].as_array().unwrap().len() > 20,
        "JSON lists every collection: {json}"
    );
}
