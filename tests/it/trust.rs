//! Only trusted peers, never stale, and an upstream that fails in every way
//! an unlucky network can: each as a test, against real gRPC peers.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use mcp_xds_gateway::proto::{MeshConfigRequest, Metadata, Resource};
use rustls::AlertDescription;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::helpers::certs::{tls_alert, write, write_leaf, Ca, Leaf};
use crate::helpers::clients::{self, incremental, sotw, tls_channel, SotwClient, SOTW_PATH};
use crate::helpers::galley::{dial_out, full, resource, FakeGalley};
use crate::helpers::h2raw::{self, frame, grpc_headers, RawConn};
use crate::helpers::{
    eventually, eventually_some, gateway_for, http_get, start_gateway, upstream_status_when, within, GW, VS,
};
use crate::limits::{metric, metric_is};

const GALLEY_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account";

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// A dial-out gateway with mTLS on both listeners and both allow-lists.
async fn mtls_gateway(dir: &Path, ca: &Ca) -> mcp_xds_gateway::app::Bound {
    start_gateway(
        &mtls_flags(dir, ca, "127.0.0.1:0")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .await
}

/// The flags of [`mtls_gateway`], its dial-out port on `sink`.
fn mtls_flags(dir: &Path, ca: &Ca, sink: &str) -> Vec<String> {
    let ca_path = path(&write(dir, "ca.pem", &ca.pem));
    let (cert, key) = write_leaf(dir, "gateway", &ca.leaf("gateway"));
    [
        "--sink-listen",
        sink,
        "--collections",
        VS,
        "--tls-cert",
        &path(&cert),
        "--tls-key",
        &path(&key),
        "--client-ca",
        &ca_path,
        "--sink-allow",
        GALLEY_ID,
        "--client-allow",
        "spiffe://cluster.local/ns/istio-system/*",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A dial-out source whose identity `--sink-allow` does not take, refused
/// `PERMISSION_DENIED`.
async fn attacker_refused(sink: SocketAddr, ca: &Ca) -> tonic::Status {
    source_refused(
        sink,
        ca,
        &ca.spiffe_leaf("spiffe://cluster.local/ns/default/sa/attacker"),
    )
    .await
}

/// A dial-out source presenting `leaf`, refused `PERMISSION_DENIED`.
async fn source_refused(sink: SocketAddr, ca: &Ca, leaf: &Leaf) -> tonic::Status {
    let channel = tls_channel(sink, &ca.pem, Some(leaf)).await.unwrap();
    let refused = within("the dial-out refusal", dial_out(channel, &[]))
        .await
        .err()
        .expect("a source outside --sink-allow is refused");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    refused
}

#[tokio::test]
async fn peers_outside_the_allow_lists_are_refused_naming_their_identity() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = mtls_gateway(dir.path(), &ca).await;
    let sink = gw.sink.unwrap();

    let refused = attacker_refused(sink, &ca).await;
    assert!(
        refused
            .message()
            .contains("spiffe://cluster.local/ns/default/sa/attacker")
            && refused.message().contains("--sink-allow"),
        "{}",
        refused.message()
    );
    assert_eq!(gw.upstream.borrow().attempts, 0, "it never became the source");
    // Counted: peers_outside_the_allow_lists_are_counted_by_listener.

    let galley = ca.spiffe_leaf(GALLEY_ID);
    let mut source = dial_out(tls_channel(sink, &ca.pem, Some(&galley)).await.unwrap(), &[])
        .await
        .expect("Galley's identity is allowed");
    source.initial_requests(1).await;
    source.push_full(VS, vec![resource("a", "1", b"a")]).await;

    // Downstream: a workload outside istio-system is refused; Pilot is served.
    let outsider = ca.spiffe_leaf("spiffe://cluster.local/ns/default/sa/sleep");
    let channel = tls_channel(gw.listen, &ca.pem, Some(&outsider)).await.unwrap();
    let refused = SotwClient::try_open_on(channel, SOTW_PATH).await.err().unwrap();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(
        refused.message().contains("spiffe://cluster.local/ns/default/sa/sleep")
            && refused.message().contains("is not allowed by --client-allow"),
        "names the identity and the flag: {}",
        refused.message()
    );
    let pilot = ca.spiffe_leaf("spiffe://cluster.local/ns/istio-system/sa/istio-pilot-service-account");
    let mut client = SotwClient::open_on(tls_channel(gw.listen, &ca.pem, Some(&pilot)).await.unwrap(), SOTW_PATH).await;
    client.subscribe(VS);
    assert_eq!(client.recv_type(VS).await.resources.len(), 1);

    // An expired certificate and one from another CA never get a stream,
    // even with an identity the allow-list takes: TLS refuses them first.
    let allowed = "spiffe://cluster.local/ns/istio-system/sa/istio-pilot-service-account";
    let expired = ca.expired_spiffe_leaf(allowed);
    let foreign = Ca::new("other-ca").spiffe_leaf(allowed);
    for (what, leaf, alert) in [
        ("expired", &expired, AlertDescription::CertificateExpired),
        ("foreign", &foreign, AlertDescription::UnknownCA),
    ] {
        assert_eq!(
            tls_alert(gw.listen, &ca.pem, Some(leaf)).await,
            Some(alert),
            "{what}: refused by TLS, before the allow-list"
        );
    }
}

/// `status` is `PERMISSION_DENIED` and its message says `says`.
fn denied_saying(status: &tonic::Status, says: &str) {
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains(says), "{says:?} in {:?}", status.message());
}

/// The allow-lists follow the policy's rule: a pattern with a `scheme://`
/// matches URI SANs only. A certificate the mesh's CA signed whose only SAN
/// is a DNS name spelling Galley's SPIFFE id never becomes the source, and
/// one spelling a client's id is no client; both refusals print the
/// identity with its kind.
#[tokio::test]
async fn a_dns_san_spelling_an_allowed_spiffe_id_passes_neither_allow_list() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = mtls_gateway(dir.path(), &ca).await;
    let sink = gw.sink.unwrap();

    let refused = source_refused(sink, &ca, &ca.dns_only_leaf(GALLEY_ID)).await;
    denied_saying(
        &refused,
        &format!("identity dns:{GALLEY_ID} is not allowed by --sink-allow"),
    );
    assert_eq!(gw.upstream.borrow().attempts, 0, "it never became the source");

    let pilot = "spiffe://cluster.local/ns/istio-system/sa/istio-pilot-service-account";
    let channel = tls_channel(gw.listen, &ca.pem, Some(&ca.dns_only_leaf(pilot)))
        .await
        .unwrap();
    let refused = SotwClient::try_open_on(channel, SOTW_PATH).await.err().unwrap();
    denied_saying(
        &refused,
        &format!("identity dns:{pilot} is not allowed by --client-allow"),
    );

    // The same ids as URI SANs pass both.
    let galley = ca.spiffe_leaf(GALLEY_ID);
    let mut source = dial_out(tls_channel(sink, &ca.pem, Some(&galley)).await.unwrap(), &[])
        .await
        .expect("Galley's URI SAN is allowed");
    source.initial_requests(1).await;
    source.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let channel = tls_channel(gw.listen, &ca.pem, Some(&ca.spiffe_leaf(pilot)))
        .await
        .unwrap();
    let mut client = SotwClient::open_on(channel, SOTW_PATH).await;
    client.subscribe(VS);
    assert_eq!(client.recv_type(VS).await.resources.len(), 1);
}

/// Issue 42's attacker re-check of the DNS-name rule, over real TLS: a
/// certificate the mesh's CA signed whose only SAN is a DNS SAN that is no
/// DNS name (a SPIFFE id spelled in ASCII, with look-alike `∶∕`, fullwidth
/// `／`, `%2F`, backslashes, a NUL, a bidi override; byte for byte in the
/// certificate, as a CA that signs what it is asked to writes it) passes
/// neither `--client-allow` nor `--sink-allow` nor an access policy rule,
/// all three with broad DNS patterns (`spiffe*`, `*cluster*`), while a DNS
/// name those patterns match passes all three.
#[tokio::test]
async fn a_dns_san_that_is_no_dns_name_passes_no_allow_list_and_no_policy_rule() {
    use crate::access::{sotw_request, SotwStream, CLUSTER_TYPE, SOTW};
    const BROAD: &str = "spiffe*,*cluster*";
    const SPELLINGS: &[&[u8]] = &[
        b"spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account",
        "spiffe\u{2236}\u{2215}\u{2215}cluster.local\u{2215}ns\u{2215}istio-system".as_bytes(),
        "spiffe\u{ff1a}\u{ff0f}\u{ff0f}cluster.local\u{ff0f}ns".as_bytes(),
        b"spiffe%3A%2F%2Fcluster.local%2Fns%2Fistio-system",
        b"spiffe:\\\\cluster.local\\ns\\istio-system",
        b"spiffe\\cluster.local",
        b"spiffe.cluster.local\0.attacker.example",
        "spiffe.cluster.local\u{202e}".as_bytes(),
        b"spiffe.cluster.local\x1b[2J\nforged line",
        b"spiffe_cluster.local",
        b"spiffe.cluster.local ",
    ];
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let mut flags = mtls_flags(dir.path(), &ca, "127.0.0.1:0");
    for flag in ["--sink-allow", "--client-allow"] {
        let at = flags.iter().position(|f| f == flag).unwrap();
        flags[at + 1] = BROAD.to_owned();
    }
    let gw = start_gateway(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let sink = gw.sink.unwrap();
    let policy = "rules:\n- identities: [\"spiffe*\", \"*cluster*\"]\n  collections: [\"envoy/config/*\"]\n";
    let policy_flags = crate::access::mtls_flags(&dir.path().join("policy"), &ca, Some(policy));
    let policy_gw = start_gateway(&policy_flags.iter().map(String::as_str).collect::<Vec<_>>()).await;

    fn status_text(status: &tonic::Status) -> String {
        format!("{:?}: {}", status.code(), status.message())
    }

    // What each place does with a leaf: Ok (admitted, served) or how it
    // was refused.
    let (pem, listen, policy_listen) = (ca.pem.as_str(), gw.listen, policy_gw.listen);
    let connect = |addr: SocketAddr, leaf: Leaf| async move {
        tls_channel(addr, pem, Some(&leaf))
            .await
            .map_err(|e| format!("TLS: {e}"))
    };
    let client = |leaf: Leaf| async move {
        let channel = connect(listen, leaf).await?;
        SotwClient::try_open_on(channel, SOTW_PATH)
            .await
            .map(drop)
            .map_err(|s| status_text(&s))
    };
    let source = |leaf: Leaf| async move {
        let channel = connect(sink, leaf).await?;
        let dialled = within("the dial-out", dial_out(channel, &[])).await;
        dialled.map(drop).map_err(|s| status_text(&s))
    };
    let reader = |leaf: Leaf| async move {
        let channel = connect(policy_listen, leaf).await?;
        let mut stream = SotwStream::try_open_on(channel, SOTW)
            .await
            .map_err(|s| status_text(&s))?;
        stream.send(sotw_request(CLUSTER_TYPE, &[], None));
        let response = stream.try_recv().await.map_err(|s| status_text(&s))?;
        if response.resources.is_empty() {
            return Err(format!("answered with nothing: {response:?}"));
        }
        Ok(())
    };
    let refused = |place: &str, spelling: &[u8], outcome: Result<(), String>| {
        let Err(why) = outcome else {
            panic!(
                "{place} admitted a DNS SAN that is no DNS name: {:?}",
                String::from_utf8_lossy(spelling)
            )
        };
        // A certificate whose SAN x509 cannot read has no identity; one it
        // reads is refused by the pattern rule: both PERMISSION_DENIED.
        assert!(why.contains("PermissionDenied"), "{place}: {why}");
        // The policy's refusal suggests no rule: none could match it.
        assert!(
            place != "the policy" || why.contains("no rule can: no identity pattern matches dns:"),
            "{place}: {why}"
        );
        // The identity is printed escaped: nothing raw, even to the peer.
        assert!(
            !why.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{place}: {why:?}"
        );
        println!("{place} {:?}: {why:?}", String::from_utf8_lossy(spelling));
    };
    for spelling in SPELLINGS {
        refused("--client-allow", spelling, client(ca.raw_dns_leaf(spelling)).await);
        refused("the policy", spelling, reader(ca.raw_dns_leaf(spelling)).await);
        refused("--sink-allow", spelling, source(ca.raw_dns_leaf(spelling)).await);
    }
    // A DNS name the broad patterns match passes all three: the refusals
    // above are the rule's, not the certificates'.
    let dns_name = b"spiffe.cluster.local";
    client(ca.raw_dns_leaf(dns_name))
        .await
        .expect("--client-allow admits a DNS name");
    reader(ca.raw_dns_leaf(dns_name))
        .await
        .expect("the policy grants a DNS name");
    source(ca.raw_dns_leaf(dns_name))
        .await
        .expect("--sink-allow admits a DNS name");
}

/// Each refusal by an allow-list is counted under its listener, exactly: a
/// gateway process of its own (in-process gateways share one recorder).
#[tokio::test]
async fn peers_outside_the_allow_lists_are_counted_by_listener() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let flags = mtls_flags(dir.path(), &ca, "127.0.0.1:0");
    let gw = crate::helpers::spawn_gateway(None, &flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let sink = gw.sink.expect("the sink port in the banner");
    attacker_refused(sink, &ca).await;
    let outsider = ca.spiffe_leaf("spiffe://cluster.local/ns/default/sa/sleep");
    let channel = tls_channel(gw.listen, &ca.pem, Some(&outsider)).await.unwrap();
    let refused = SotwClient::try_open_on(channel, SOTW_PATH).await.err().unwrap();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let series = |listener: &str| format!("mcp_gateway_peers_not_allowed_total{{listener=\"{listener}\"}}");
    crate::limits::metric_is(gw.monitoring, &series("--sink-listen"), 1).await;
    crate::limits::metric_is(gw.monitoring, &series("--listen"), 1).await;
}

#[tokio::test]
async fn a_second_source_learns_nothing_about_the_first() {
    // A gateway process of its own: its refusal count is its own (every
    // in-process gateway shares one recorder, which other dial-out tests
    // move too).
    let gw = crate::helpers::spawn_gateway(
        None,
        &["--sink-listen", "127.0.0.1:0", "--sink-insecure", "--collections", VS],
    )
    .await;
    let sink = gw.sink.expect("the sink port in the banner");
    let mut first = dial_out(clients::channel(sink).await, &[]).await.unwrap();
    first.initial_requests(1).await;
    let refused = dial_out(clients::channel(sink).await, &[]).await.err().unwrap();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let message = refused.message();
    assert!(message.starts_with("another source is connected"), "{message}");
    assert!(
        !message.contains("127.0.0.1") && !message.contains("since"),
        "{message}"
    );
    crate::limits::metric_is(
        gw.monitoring,
        "mcp_gateway_sink_refusals_total{reason=\"another_source\"}",
        1,
    )
    .await;
}

#[tokio::test]
async fn a_frozen_source_is_dropped_by_keepalive_and_the_slot_freed() {
    // A gateway process of its own: the keepalive close is counted exactly.
    let gw = crate::helpers::spawn_gateway(
        None,
        &[
            "--sink-listen",
            "127.0.0.1:0",
            "--sink-insecure",
            "--collections",
            VS,
            "--keepalive-interval",
            "300ms",
        ],
    )
    .await;
    let sink = gw.sink.expect("the sink port in the banner");
    let connected = async || crate::helpers::get_json(gw.admin, "/debug/upstream").await["connected"] == true;
    // A source that opens its stream and then freezes: TCP up, nothing read,
    // no PING answered.
    let mut frozen = RawConn::http2(sink).await;
    frozen
        .send(&grpc_headers(
            1,
            "/istio.mcp.v1alpha1.ResourceSink/EstablishResourceStream",
            0,
        ))
        .await;
    crate::helpers::eventually_async("the frozen source to hold the slot", connected).await;
    crate::helpers::eventually_async("the frozen source to be dropped", || async { !connected().await }).await;
    crate::limits::metric_is(
        gw.monitoring,
        "mcp_gateway_connections_closed_total{listener=\"--sink-listen\",reason=\"keepalive_timeout\"}",
        1,
    )
    .await;
    let mut next = dial_out(clients::channel(sink).await, &[])
        .await
        .expect("the slot is free for the next source");
    next.initial_requests(1).await;
    drop(frozen);
}

#[tokio::test]
async fn an_upstream_that_never_speaks_http2_is_a_failed_attempt_naming_the_step() {
    let (addr, holder) = silent_listener().await;
    let url = format!("http://{addr}");
    let _ = failed_attempts_name_the_step(&url, "HTTP/2 handshake").await;

    // Shutdown never waits on the upstream: a gateway whose attempt could
    // wait an hour for the handshake shuts down within the suite's wait
    // (`within`), far sooner than its attempt would end.
    let patient = start_gateway(&["--upstream", &url, "--collections", VS, "--connect-timeout", "1h"]).await;
    upstream_status_when(&patient, "an attempt under way", |s| s.attempts >= 1 && !s.connected).await;
    assert!(within("shutdown", patient.shutdown()).await, "every task ended");
    holder.abort();
}

/// Two failed attempts of a gateway process of its own against `url`,
/// whose step `step` never completes: each error names the step, the
/// timeout and its flag, and `terminations{reason="connect"}` counts each
/// exactly (attempts a second apart, so a count read between two holds).
/// Returns the last error.
async fn failed_attempts_name_the_step(url: &str, step: &str) -> String {
    let gw = crate::helpers::spawn_gateway(
        None,
        &[
            "--upstream",
            url,
            "--collections",
            VS,
            "--connect-timeout",
            "300ms",
            "--reconnect-min-delay",
            "1s",
        ],
    )
    .await;
    let connect = "mcp_gateway_upstream_stream_terminations_total{reason=\"connect\"}";
    let mut last = String::new();
    for attempt in 1..=2 {
        let status = crate::helpers::upstream_failed(gw.admin, attempt, "a failed attempt").await;
        let error = status["last_error"].as_str().unwrap();
        assert!(error.contains(step) && error.contains("timed out"), "{error}");
        assert!(error.contains("--connect-timeout"), "{error}");
        assert_eq!(status["connected"], false, "{status}");
        metric_is(gw.monitoring, connect, status["consecutive_failures"].as_u64().unwrap()).await;
        last = error.to_owned();
    }
    last
}

/// A listener on a port of its own that accepts and holds every
/// connection and says nothing; abort the task to close it.
async fn silent_listener() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    (addr, holder)
}

/// The TLS step of `--connect-timeout`: an `https://` upstream that accepts
/// TCP and never answers the ClientHello is a failed attempt whose error
/// names the TLS handshake, counted as a `connect` termination. (The TCP step needs an address that drops SYNs,
/// which depends on the network the suite runs in: not tried.)
#[tokio::test]
async fn an_upstream_that_never_answers_the_tls_hello_is_a_failed_attempt_naming_the_step() {
    let (addr, holder) = silent_listener().await;
    let url = format!("https://{addr}");
    let error = failed_attempts_name_the_step(&url, "TLS handshake").await;
    assert!(!error.contains("HTTP/2"), "the TLS step, not a later one: {error}");
    holder.abort();
}

#[tokio::test]
async fn a_message_over_the_limit_never_resets_the_backoff() {
    let mut galley = FakeGalley::start().await;
    // A gateway process of its own: each refusal is counted exactly.
    let url = galley.url();
    let flags = [
        "--upstream",
        &url,
        "--collections",
        VS,
        "--reconnect-min-delay",
        "10ms",
        "--max-message-bytes",
        "65536",
    ];
    let gw = crate::helpers::spawn_gateway(None, &flags).await;
    for round in 1..=3u64 {
        let mut stream = galley.next_stream().await;
        stream.initial_requests(1).await;
        // Every collection arrives, then a message over the limit: the same
        // thing happens on the next stream, so this is not progress.
        stream.push_full(VS, vec![resource("small", "1", b"x")]).await;
        stream
            .responses
            .send(Ok(full(VS, vec![resource("big", "1", &vec![b'x'; 100_000])])))
            .unwrap();
        // The retry comes 10 ms later and connects: the count and the last
        // error are read as they stay (the next failure is this test's doing).
        let status = crate::helpers::upstream_failures_reach(gw.admin, round, "the failure to be counted").await;
        assert_eq!(status["consecutive_failures"], round, "{status}");
        let error = status["last_error"].as_str().unwrap();
        assert!(error.contains("--max-message-bytes=65536"), "{error}");
        crate::limits::refusals_are(gw.monitoring, "max_message_bytes", round).await;
    }
    let cache = crate::helpers::get_json(gw.admin, "/debug/cache").await;
    assert!(
        cache
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["collection"] == VS && c["resources"] == 1),
        "the cache keeps its state: {cache}"
    );
}

#[tokio::test]
async fn the_backoff_resets_only_when_every_collection_arrived() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS, GW], &[]).await;
    for round in 1..=3u32 {
        let mut stream = galley.next_stream().await;
        stream.initial_requests(2).await;
        // One small collection arrives, the other never does.
        stream.push_full(VS, vec![resource("a", "1", b"x")]).await;
        stream.kill(tonic::Status::unavailable("dies before GW"));
        let status = upstream_status_when(&gw, "the failure to be scheduled", |s| {
            s.next_retry_in.is_some() && s.consecutive_failures >= round
        })
        .await;
        assert_eq!(status.consecutive_failures, round, "{status:?}");
    }
    let mut stream = galley.next_stream().await;
    stream.initial_requests(2).await;
    stream.push_full(VS, vec![resource("a", "1", b"x")]).await;
    stream.push_full(GW, vec![]).await;
    stream.kill(tonic::Status::unavailable("after progress"));
    let status = upstream_status_when(&gw, "a retry", |s| {
        s.next_retry_in.is_some() && s.consecutive_failures == 1
    })
    .await;
    assert!(status.next_retry_in.unwrap() <= Duration::from_millis(20), "{status:?}");
}

async fn health(addr: SocketAddr, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(clients::channel(addr).await);
    let response = within(
        "a health check",
        client.check(HealthCheckRequest {
            service: service.into(),
        }),
    )
    .await
    .unwrap()
    .into_inner();
    ServingStatus::try_from(response.status).unwrap()
}

#[tokio::test]
async fn readiness_follows_the_configured_collections_not_what_clients_ask() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![resource("a", "1", b"x")]).await;
    assert_eq!(http_get(gw.monitoring, "/readyz").await.0, 200);

    // A client asks for a collection nobody will serve: asked on a probe.
    let client = sotw(gw.listen).await;
    client.subscribe(GW);
    let asked = galley.next_stream().await.next_request().await;
    assert_eq!(asked.collection, GW);
    assert_eq!(http_get(gw.monitoring, "/readyz").await.0, 200, "still ready");
    assert_eq!(health(gw.listen, "").await, ServingStatus::Serving);
    assert_eq!(health(gw.listen, VS).await, ServingStatus::Serving);
    eventually_health(gw.listen, GW, ServingStatus::NotServing).await;
}

async fn eventually_health(addr: SocketAddr, service: &str, expected: ServingStatus) {
    within("a collection's health", async {
        loop {
            let mut client = HealthClient::new(clients::channel(addr).await);
            if let Ok(response) = client
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
            {
                if response.into_inner().status == expected as i32 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

fn with_body(name: &str, version: &str, body: &[u8]) -> Resource {
    Resource {
        metadata: Some(Metadata {
            name: name.into(),
            version: version.into(),
            ..Default::default()
        }),
        body: Some(prost_types::Any {
            type_url: crate::helpers::VS_TYPE_URL.into(),
            value: body.to_vec(),
        }),
    }
}

#[tokio::test]
async fn a_new_body_under_an_unchanged_version_reaches_every_client() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    stream.push_full(VS, vec![with_body("ns/a", "7", b"old")]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv_type(VS).await;
    client.ack(&first);
    let mut inc = incremental(gw.listen).await;
    inc.start(VS, &[]);
    let inc_first = inc.recv().await;
    inc.reply(VS, &inc_first.nonce, None);

    // Galley restarted with a reset counter: version 7 again, another body.
    stream.kill(tonic::Status::unavailable("galley restarts"));
    let mut restarted = galley.next_stream().await;
    restarted.initial_requests(1).await;
    restarted.push_full(VS, vec![with_body("ns/a", "7", b"new")]).await;
    let second = client.recv_type(VS).await;
    assert_ne!(
        second.version_info, first.version_info,
        "the collection version changed"
    );
    assert_eq!(second.resources[0].body.as_ref().unwrap().value, b"new");
    let inc_second = inc.recv().await;
    assert_eq!(inc_second.resources.len(), 1, "the changed resource is sent again");
    assert_eq!(inc_second.resources[0].body.as_ref().unwrap().value, b"new");
}

#[tokio::test]
async fn an_edited_file_that_keeps_its_version_reaches_clients() {
    let (_gw, mut canary) = crate::limits::with_canary(&[]).await;
    // The canary's file says version "1" every time; only the body changes.
    canary.check().await;
    canary.check().await;
}

#[tokio::test]
async fn a_source_flooding_without_waiting_for_acks_is_answered_in_order() {
    let mut galley = FakeGalley::start().await;
    let gw = gateway_for(&galley, &[VS], &[]).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(1).await;
    for n in 0..300 {
        let mut message = full(VS, vec![resource("a", &n.to_string(), b"x")]);
        message.nonce = format!("flood-{n}");
        stream.responses.send(Ok(message)).unwrap();
    }
    for n in 0..300 {
        let reply = stream.next_request().await;
        assert_eq!(reply.response_nonce, format!("flood-{n}"));
        assert!(reply.error_detail.is_none());
    }
    assert_eq!(gw.cache.get(VS).unwrap().resources["a"].version(), "299");
}

/// A source that floods without reading its ACKs is held by HTTP/2 flow
/// control: the ACKs the gateway owes fill the source's receive window and
/// the gateway's few buffers, the gateway stops reading, and the source's
/// send window runs dry and is not replenished; once the source reads its
/// ACKs, the gateway reads on and every message is applied and ACKed in
/// order. The source is a raw HTTP/2 server (the h2 crate): its windows are
/// the test's to set and see.
#[tokio::test]
async fn a_source_that_does_not_read_its_acks_is_held_by_flow_control() {
    use prost::Message;
    use tonic::codegen::http;
    // The source's receive window for the gateway's stream: a few ACKs.
    const ACK_WINDOW: u32 = 1024;
    // 256 messages of 64 KiB: 16 MiB, more than the gateway's receive
    // window (hyper's client defaults, which the gateway keeps for its
    // upstream: 2 MiB a stream, 5 MiB a connection) and its ACK path hold
    // together.
    const MESSAGES: usize = 256;
    const BODY: usize = 64 << 10;
    const GATEWAY_STREAM_WINDOW: usize = 2 << 20;
    // Messages that fill the gateway's stream window, each a little over
    // BODY once framed: sent before the window can run dry, whatever the
    // gateway reads meanwhile (a read only opens it further).
    const FILL: usize = GATEWAY_STREAM_WINDOW / (BODY + 1024);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let gw = start_gateway(&["--upstream", &url, "--collections", VS, "--reconnect-min-delay", "10ms"]).await;
    let (tcp, _) = within("the gateway to dial the source", listener.accept())
        .await
        .unwrap();
    let mut conn = within(
        "the HTTP/2 handshake",
        h2::server::Builder::new()
            .initial_window_size(ACK_WINDOW)
            .handshake::<_, bytes::Bytes>(tcp),
    )
    .await
    .unwrap();
    let (request, mut respond) = within("the gateway's stream", conn.accept())
        .await
        .expect("a stream")
        .unwrap();
    assert_eq!(request.uri().path(), clients::RESOURCE_SOURCE_PATH);
    // Accepting drives the connection (pings, window updates); the gateway
    // opens no other stream.
    let driver = tokio::spawn(async move { while let Some(Ok(_)) = conn.accept().await {} });
    let answer = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let mut sending = respond.send_response(answer, false).unwrap();
    let mut acks = AckReader {
        body: request.into_body(),
        buffer: bytes::BytesMut::new(),
    };
    let initial = acks.next().await;
    assert_eq!(initial.collection, VS);
    assert!(initial.response_nonce.is_empty(), "{initial:?}");

    // The flood: each message sent as the gateway's window allows.
    let (progress, sent) = tokio::sync::watch::channel((0usize, false));
    let flood = tokio::spawn(async move {
        for n in 0..MESSAGES {
            let mut message = full(VS, vec![resource("a", &n.to_string(), &[b'x'; BODY])]);
            message.nonce = format!("flood-{n}");
            let mut frame = vec![0u8];
            frame.extend_from_slice(&u32::try_from(message.encoded_len()).unwrap().to_be_bytes());
            message.encode(&mut frame).unwrap();
            sending.reserve_capacity(frame.len());
            while sending.capacity() < frame.len() {
                progress.send_replace((n, true));
                match std::future::poll_fn(|cx| sending.poll_capacity(cx)).await {
                    Some(Ok(_)) => {}
                    other => panic!("the gateway's window for message {n}: {other:?}"),
                }
            }
            sending.send_data(frame.into(), false).unwrap();
            progress.send_replace((n + 1, false));
        }
    });
    let applied = || {
        gw.cache
            .get(VS)
            .map_or(0, |s| s.resources["a"].version().parse::<usize>().unwrap() + 1)
    };
    let mut waiting = sent.clone();
    // Blocked alone can come at message 0, before h2 has assigned any
    // capacity; blocked after a window's worth sent is the window run dry.
    within(
        "the source's window to run dry",
        waiting.wait_for(|(n, blocked)| *blocked && *n >= FILL),
    )
    .await
    .unwrap();
    // Time for the gateway to read on, were it going to: whatever it does,
    // it cannot read past what its ACK path holds (the source's window of
    // ACKs, the stream's queue of 64 replies, a message in hand), nor the
    // source send past the gateway's window while the ACKs go unread.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Each ACK names the collection: the source's window holds fewer ACKs
    // than it has room for that name; 64 more are queued, and a handful in
    // flight (the stream's chunk in hand, the reply waiting for room, the
    // message being applied).
    let ack_path = ACK_WINDOW as usize / VS.len() + 64 + 4;
    let read_then = applied();
    assert!(
        read_then <= ack_path,
        "the gateway read {read_then} messages with its ACKs unread (its ACK path holds {ack_path})"
    );
    let sent_then = sent.borrow().0;
    assert!(
        sent_then < MESSAGES,
        "the source's sends pend: {sent_then} sent, the gateway's window taken"
    );
    // The source reads its ACKs: the gateway reads on, in order, to the end.
    for n in 0..MESSAGES {
        let ack = acks.next().await;
        assert_eq!(ack.response_nonce, format!("flood-{n}"));
        assert!(ack.error_detail.is_none(), "{ack:?}");
    }
    within("the flood to be sent", flood).await.unwrap();
    assert_eq!(applied(), MESSAGES);
    driver.abort();
}

/// The gateway's requests on a raw HTTP/2 stream, each released to the
/// gateway's window as it is read.
struct AckReader {
    body: h2::RecvStream,
    buffer: bytes::BytesMut,
}

impl AckReader {
    async fn next(&mut self) -> mcp_xds_gateway::proto::RequestResources {
        use prost::Message;
        loop {
            if self.buffer.len() >= 5 {
                let len = u32::from_be_bytes(self.buffer[1..5].try_into().unwrap()) as usize;
                if self.buffer.len() >= 5 + len {
                    let frame = self.buffer.split_to(5 + len);
                    return mcp_xds_gateway::proto::RequestResources::decode(&frame[5..]).unwrap();
                }
            }
            let chunk = within("a request from the gateway", self.body.data())
                .await
                .expect("the gateway's stream is open")
                .unwrap();
            self.body.flow_control().release_capacity(chunk.len()).unwrap();
            self.buffer.extend_from_slice(&chunk);
        }
    }
}

#[tokio::test]
async fn odd_but_harmless_requests_are_answered_by_the_rules() {
    let (gw, mut canary) = crate::limits::with_canary(&[]).await;
    let mut client = sotw(gw.listen).await;
    // An ACK before any response: a nonce the gateway never issued on a
    // first request is accepted as the subscription (istiod does this).
    client.send(MeshConfigRequest {
        response_nonce: "2021-09-09 06:45:36.069 +0000 UTC m=+0.51".into(),
        ..subscribe(VS)
    });
    let first = client.recv_type(VS).await;
    client.subscribe(GW);
    let gw_response = client.recv_type(GW).await;
    // The nonce of another type is stale for this one: ignored, neither an
    // ACK nor a NACK. VS's response stays outstanding: no new content is
    // sent until it is ACKed.
    client.request(VS, &first.version_info, &gw_response.nonce);
    client.ack(&gw_response);
    let view = |type_url: &str| {
        gw.registry
            .streams()
            .into_iter()
            .find(|s| s.types.contains_key(GW))
            .and_then(|s| s.types.get(type_url).cloned())
            .expect("the client's stream (the canary's follows only VS)")
    };
    // The ACK of GW, sent after, is read: so was the stale request.
    eventually("GW's ACK to be read", || {
        view(GW).acked_version.as_deref() == Some(gw_response.version_info.as_str())
    })
    .await;
    let stale = view(VS);
    assert!(
        stale.outstanding && stale.acked_version.is_none() && stale.last_nack.is_none(),
        "the stale nonce neither ACKed nor NACKed: {stale:?}"
    );
    client.ack(&first);
    canary.check().await;
    let second = client.recv_type(VS).await;
    assert_ne!(second.version_info, first.version_info, "the next content");
    let vs_view = || view(VS);

    // A NACK without a message is still a NACK: the version is held, and
    // never sent to this client again; the next content is.
    client.send(MeshConfigRequest {
        version_info: String::new(),
        response_nonce: second.nonce.clone(),
        error_detail: Some(tonic_types::Status {
            code: Code::InvalidArgument as i32,
            message: String::new(),
            details: vec![],
        }),
        ..subscribe(VS)
    });
    eventually("the NACK to be recorded", || vs_view().last_nack.is_some()).await;
    let nack = vs_view().last_nack.unwrap();
    assert_eq!(
        (&*nack.version, nack.code, nack.message.as_str()),
        (second.version_info.as_str(), Code::InvalidArgument as i32, "")
    );
    canary.check().await;
    let third = client.recv_type(VS).await;
    assert!(
        third.version_info != second.version_info && third.version_info != first.version_info,
        "the NACKed version is not re-sent; the next content is ({} after {})",
        third.version_info,
        second.version_info
    );
}

/// A request as the wire may carry it: `error_detail` (field 5) and the
/// entries of `initial_resource_versions` (field 3 of the incremental
/// request) as raw bytes, so a test can send ones that do not decode.
#[derive(Clone, PartialEq, prost::Message)]
struct WireRequest {
    #[prost(string, tag = "1")]
    version_info: String,
    #[prost(message, optional, tag = "2")]
    sink_node: Option<mcp_xds_gateway::proto::SinkNode>,
    #[prost(string, tag = "3")]
    type_url: String,
    #[prost(string, tag = "4")]
    response_nonce: String,
    #[prost(bytes = "vec", tag = "5")]
    error_detail: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireIncrementalRequest {
    #[prost(message, optional, tag = "1")]
    sink_node: Option<mcp_xds_gateway::proto::SinkNode>,
    #[prost(string, tag = "2")]
    type_url: String,
    #[prost(bytes = "vec", repeated, tag = "3")]
    initial_resource_versions: Vec<Vec<u8>>,
}

/// Field 1 of google.rpc.Status (`code`) as a varint cut short: bytes that
/// decode as no message.
const UNDECODABLE: &[u8] = &[0x08, 0xff];

#[tokio::test]
async fn an_error_detail_or_map_entry_that_does_not_decode_is_answered_by_the_rules() {
    let (gw, mut canary) = crate::limits::with_canary(&[]).await;
    let mut client: clients::Bidi<WireRequest, mcp_xds_gateway::proto::MeshConfigResponse> = clients::Bidi::open_with(
        clients::channel(gw.listen).await,
        SOTW_PATH,
        tonic_prost::ProstCodec::default(),
    )
    .await;
    let subscription = WireRequest {
        sink_node: clients::node(),
        type_url: VS.into(),
        ..Default::default()
    };
    client.send(subscription.clone());
    let first = client.recv().await;
    // An error_detail that does not decode: a NACK, code Unknown, saying so.
    client.send(WireRequest {
        response_nonce: first.nonce.clone(),
        error_detail: UNDECODABLE.to_vec(),
        ..subscription
    });
    let nack = eventually_some("the NACK to be recorded", || async {
        gw.registry
            .streams()
            .into_iter()
            .filter_map(|s| s.types.get(VS).and_then(|t| t.last_nack.clone()))
            .find(|n| *n.version == *first.version_info)
    })
    .await;
    assert_eq!(nack.code, Code::Unknown as i32, "{nack:?}");
    assert!(
        nack.message.contains("error_detail does not decode"),
        "{}",
        nack.message
    );
    // The stream goes on: the next content is sent.
    canary.check().await;
    assert_ne!(client.recv().await.version_info, first.version_info);

    // A map entry of initial_resource_versions that does not decode: the
    // incremental stream ends INVALID_ARGUMENT, naming the field.
    let mut incremental: clients::Bidi<WireIncrementalRequest, mcp_xds_gateway::proto::IncrementalMeshConfigResponse> =
        clients::Bidi::open_with(
            clients::channel(gw.listen).await,
            clients::INCREMENTAL_PATH,
            tonic_prost::ProstCodec::default(),
        )
        .await;
    incremental.send(WireIncrementalRequest {
        sink_node: clients::node(),
        type_url: VS.into(),
        initial_resource_versions: vec![UNDECODABLE.to_vec()],
    });
    let status = incremental.end_status().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("initial_resource_versions does not decode as a map of names to versions"),
        "{}",
        status.message()
    );
    canary.check().await;
}

fn subscribe(type_url: &str) -> MeshConfigRequest {
    MeshConfigRequest {
        type_url: type_url.into(),
        sink_node: clients::node(),
        ..Default::default()
    }
}

#[tokio::test]
async fn the_monitoring_port_serves_probes_and_metrics_only() {
    let gw = start_gateway(&[]).await;
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(http_get(gw.monitoring, path).await.0, 200, "{path}");
        assert_eq!(http_get(gw.admin, path).await.0, 200, "{path} on admin");
    }
    for path in ["/debug/clients", "/debug/syncz", "/debug/cache", "/debug/upstream"] {
        assert_eq!(http_get(gw.monitoring, path).await.0, 404, "{path}");
        assert_eq!(http_get(gw.admin, path).await.0, 200, "{path} on admin");
    }
    // Its index lists its own paths, and names no client and no view.
    let (status, index) = http_get(gw.monitoring, "/").await;
    assert_eq!(status, 200);
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert!(index.contains(&format!("href=\"{path}\"")), "{index}");
    }
    assert!(!index.contains("/debug"), "{index}");
}

/// No endpoint reads a body, the admin port's controls included: a control
/// announcing a body over `--http-max-request-bytes`, of which not a byte
/// is sent, takes effect from its head and is answered, and the gateway
/// closes the connection rather than read on (the request asks for no
/// close: the close is the gateway's). A process of its own, whose log
/// filter this test may set.
#[tokio::test]
async fn an_admin_control_announcing_a_body_is_answered_from_its_head() {
    let gw = crate::helpers::spawn_gateway(None, &["--http-max-request-bytes", "4096"]).await;
    let answer = announcing_a_body(gw.admin, "POST /logging?level=debug").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("log filter: debug"),
        "the control took effect: {answer}"
    );
    let (status, body) = crate::helpers::http_request(gw.admin, "POST", "/logging", "").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("now: debug"),
        "the filter set from the head holds: {body}"
    );
}

/// A keep-alive connection left idle after its answer is closed at
/// `--http-header-timeout` too (the next request's headers never came), and
/// counted as such. A process of its own: the count is this test's.
#[tokio::test]
async fn an_idle_keep_alive_on_an_http_port_is_closed_at_the_header_timeout() {
    let gw = crate::helpers::spawn_gateway(None, &["--http-header-timeout", "300ms"]).await;
    let mut idle = tokio::net::TcpStream::connect(gw.monitoring).await.unwrap();
    // The idle time starts once the answer is written, after this: an
    // instant taken here makes `elapsed` at the close a lower bound on it,
    // which a slow machine can only lengthen. (Taken when the answer is
    // read, it would start after the gateway's timer and could fall short.)
    let before_the_request = tokio::time::Instant::now();
    idle.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // The answer, whole (its head and the body its length announces).
    let mut answer = Vec::new();
    let head_and_body = within("the answer", async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = idle.read(&mut chunk).await.unwrap();
            assert_ne!(n, 0, "closed before the answer: {:?}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&answer).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .expect("a content-length");
                if body.len() >= length {
                    return (head.to_owned(), body.to_owned());
                }
            }
        }
    })
    .await;
    assert!(head_and_body.0.starts_with("HTTP/1.1 200"), "{head_and_body:?}");
    assert!(
        !head_and_body.0.to_ascii_lowercase().contains("connection: close"),
        "kept alive: {head_and_body:?}"
    );
    // Then nothing is sent: the gateway closes it.
    let mut rest = Vec::new();
    within("the idle connection to be closed", idle.read_to_end(&mut rest))
        .await
        .unwrap();
    let idle_for = before_the_request.elapsed();
    assert!(
        rest.is_empty(),
        "nothing more sent: {:?}",
        String::from_utf8_lossy(&rest)
    );
    // Closed at the timeout, not right after the answer.
    assert!(
        idle_for >= Duration::from_millis(300),
        "closed {idle_for:?} after the request, before --http-header-timeout=300ms"
    );
    crate::limits::refusals_are(gw.monitoring, "http_header_timeout", 1).await;
}

#[tokio::test]
async fn the_http_ports_bound_slow_large_and_many_requests() {
    // Gateway processes of their own: the refusal counts are theirs.
    let gw = crate::helpers::spawn_gateway(
        None,
        &["--http-header-timeout", "300ms", "--http-max-request-bytes", "4096"],
    )
    .await;
    // A request that never finishes its headers is closed.
    let mut slow = tokio::net::TcpStream::connect(gw.monitoring).await.unwrap();
    slow.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let mut rest = Vec::new();
    within("the slow request to be closed", slow.read_to_end(&mut rest))
        .await
        .unwrap();
    assert_eq!(http_get(gw.monitoring, "/readyz").await.0, 200);
    crate::limits::refusals_are(gw.monitoring, "http_header_timeout", 1).await;
    // A header block over the limit (at least 8 KiB: hyper's smallest
    // buffer) is answered 431, or cut off while it is still being sent.
    let mut big = tokio::net::TcpStream::connect(gw.monitoring).await.unwrap();
    let request = format!(
        "GET /readyz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(64 << 10)
    );
    let _ = big.write_all(request.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = within("the large request's answer", big.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 431"), "{answer}");
    // No endpoint reads a body: a request announcing one over the limit,
    // of which not a byte is sent, is answered from its head, and the
    // connection is closed rather than read on.
    let answer = announcing_a_body(gw.monitoring, "GET /readyz").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Connections: an eighth of the cap per peer address; the next from
    // this address is refused.
    let (gw, held) = one_connection_per_address_held(|gw| gw.monitoring).await;
    // A second connection from this address is refused, then closed.
    let answer = refused_then_closed(gw.monitoring).await;
    assert!(answer.contains("--http-max-connections=8"), "{answer}");
    let answer = get_from(gw.monitoring, [127, 0, 0, 3], "/readyz").await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "another address is served: {answer}"
    );
    // Read from another address still: this one's slots are full.
    let exposition = get_from(gw.monitoring, [127, 0, 0, 4], "/metrics").await;
    assert_eq!(
        crate::helpers::sample(
            &exposition,
            "mcp_gateway_limit_refusals_total",
            &["limit=\"http_connections\""]
        ),
        Some(1.0),
        "the one 503, counted once"
    );
    drop(held);
}

/// A gateway process of its own with `--http-max-connections 8`: 8 / 8,
/// one connection per peer address. This address's one, to the HTTP port
/// `port` picks, is held, answered (so it was taken).
async fn one_connection_per_address_held(
    port: impl Fn(&crate::helpers::Running) -> SocketAddr,
) -> (crate::helpers::Running, tokio::net::TcpStream) {
    let gw = crate::helpers::spawn_gateway(None, &["--http-max-connections", "8"]).await;
    let mut held = within("a connection", tokio::net::TcpStream::connect(port(&gw)))
        .await
        .unwrap();
    held.write_all(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 12];
    within("the held connection's answer", held.read_exact(&mut answer))
        .await
        .unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    (gw, held)
}

/// `--http-max-connections` bounds the admin port as it does the
/// monitoring port: a connection over this address's share is answered 503
/// in the row's words, then closed; another address is served. A process of
/// its own: the count is this test's.
#[tokio::test]
async fn the_admin_port_bounds_its_connections_too() {
    let (gw, held) = one_connection_per_address_held(|gw| gw.admin).await;
    let answer = refused_then_closed(gw.admin).await;
    assert!(
        answer.contains("(an eighth of --http-max-connections=8) is reached"),
        "the row's words: {answer}"
    );
    let answer = get_from(gw.admin, [127, 0, 0, 3], "/readyz").await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "another address is served: {answer}"
    );
    crate::limits::refusals_are(gw.monitoring, "http_connections", 1).await;
    drop(held);
}

/// `request` (method and target) announcing a 1 MiB body of which no byte
/// is sent, without asking for a close: the whole answer, up to the close
/// (`read_to_end` returns only there, so the close is the gateway's).
async fn announcing_a_body(addr: SocketAddr, request: &str) -> String {
    let mut conn = within("a connection", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    conn.write_all(format!("{request} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1048576\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    within("the answer and the close", conn.read_to_end(&mut answer))
        .await
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A refused connection's whole answer: asked as keep-alive (so a close is
/// the gateway's doing, not the client's), `503` saying `connection: close`,
/// then closed (`read_to_end` returns only at the close).
async fn refused_then_closed(addr: SocketAddr) -> String {
    let mut conn = RawConn::tcp_from(addr, IpAddr::from([127, 0, 0, 1])).await;
    conn.send(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    let mut answer = Vec::new();
    within("the 503 and the close", conn.stream.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let head = answer.split("\r\n\r\n").next().unwrap_or_default().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 503"), "{answer}");
    assert!(head.contains("\r\nconnection: close"), "{answer}");
    answer
}

/// A GET of `path` from the loopback address `from` (another peer): the
/// whole response, head and body.
async fn get_from(addr: SocketAddr, from: [u8; 4], path: &str) -> String {
    let mut conn = RawConn::tcp_from(addr, IpAddr::from(from)).await;
    conn.send(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    let mut answer = Vec::new();
    within(
        &format!("GET {path} from {from:?}"),
        conn.stream.read_to_end(&mut answer),
    )
    .await
    .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// The gateway is a process of its own: the failed writes counted are its
/// own, never another test's.
#[tokio::test]
async fn the_cache_directory_is_never_followed_through_links_and_survives_failed_writes() {
    let cache_dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let vs_file = cache_dir.path().join(mcp_xds_gateway::source::persisted::file_name(VS));
    std::os::unix::fs::symlink(&victim, &vs_file).unwrap();
    // The GW file's place is taken by a directory: its writes fail.
    let gw_file = cache_dir.path().join(mcp_xds_gateway::source::persisted::file_name(GW));
    std::fs::create_dir(&gw_file).unwrap();
    std::fs::write(gw_file.join("x"), b"").unwrap();

    let mut galley = FakeGalley::start().await;
    let cache = path(cache_dir.path());
    let mut gw = crate::helpers::gateway_process_for(&galley, &[VS, GW], &["--cache-dir", &cache]).await;
    // Nothing was read through the link: the gateway said why at start.
    let link = vs_file.display().to_string();
    assert!(
        gw.log
            .iter()
            .any(|l| l.contains("skipping an entry of the cache directory") && l.contains(&link)),
        "{:#?}",
        gw.log
    );
    let mut stream = galley.next_stream().await;
    stream.initial_requests(2).await;
    stream.push_full(GW, vec![resource("g", "1", b"g")]).await;
    stream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    eventually("VS to be persisted", || {
        mcp_xds_gateway::source::persisted::peek(cache_dir.path(), VS).is_ok()
    })
    .await;
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"precious",
        "the link's target is untouched"
    );
    assert!(!std::fs::symlink_metadata(&vs_file).unwrap().file_type().is_symlink());
    // One change of GW, one failed write: logged with the collection and
    // counted once.
    let failed = format!("mcp_gateway_cache_write_failures_total{{collection=\"{GW}\"}}");
    metric_is(gw.monitoring, &failed, 1).await;
    let line = gw.log_line("cannot persist the collection").await;
    assert!(line.contains(GW), "{line}");
    // Clients are served all along.
    let mut client = sotw(gw.listen).await;
    client.subscribe(GW);
    assert_eq!(client.recv_type(GW).await.resources.len(), 1);
    // A write in flight (another collection's, the rollout state's) has its
    // temporary file for a moment; a failed write's would stay for ever.
    eventually("failed writes to leave no temporary file", || {
        std::fs::read_dir(cache_dir.path())
            .unwrap()
            .filter_map(Result::ok)
            .all(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
    })
    .await;
    // The obstacle gone, the next change is written, and nothing more is
    // counted.
    std::fs::remove_dir_all(&gw_file).unwrap();
    stream.push_full(GW, vec![resource("g", "2", b"g2")]).await;
    let persisted = eventually_some("GW's next change to be persisted", || async {
        mcp_xds_gateway::source::persisted::peek(cache_dir.path(), GW).ok()
    })
    .await;
    assert_eq!(persisted.resources.len(), 1);
    assert_eq!(metric(gw.monitoring, &failed).await, 1);
}

#[tokio::test]
async fn a_raw_ping_is_answered_and_a_source_can_still_connect_after_garbage() {
    // The sink port takes garbage like the client port: closed, nothing else.
    let gw = start_gateway(&["--sink-listen", "127.0.0.1:0", "--sink-insecure", "--collections", VS]).await;
    let sink = gw.sink.unwrap();
    let mut garbage = RawConn::tcp(sink).await;
    garbage.send(b"\x16\x03\x01\x02\x00garbage").await;
    garbage.until_closed().await;
    let mut pinger = RawConn::http2(sink).await;
    pinger.send(&frame(h2raw::PING, 0, 0, b"12345678")).await;
    let pong = pinger
        .until(|f| f.kind == h2raw::PING && f.flags & h2raw::ACK != 0)
        .await
        .unwrap();
    assert_eq!(pong.payload, b"12345678");
    let mut source = dial_out(clients::channel(sink).await, &[]).await.unwrap();
    source.initial_requests(1).await;
}

#[tokio::test]
async fn hostile_files_in_the_source_directory_are_reported_and_never_fatal() {
    let (gw, mut canary) = crate::limits::with_canary(&["--max-message-bytes", "65536"]).await;
    let dir = canary.dir().to_owned();
    // A YAML bomb: one large anchor aliased many times.
    let mut bomb = format!("collection: {VS}\nname: ns/bomb\nbody:\n  struct:\n    big: &big [");
    bomb.push_str(&vec!["x"; 2000].join(","));
    bomb.push_str("]\n    copies:\n");
    for _ in 0..4000 {
        bomb.push_str("      - *big\n");
    }
    std::fs::write(dir.join("bomb.yaml"), bomb).unwrap();
    std::os::unix::fs::symlink(dir.join("loop.yaml"), dir.join("loop.yaml")).unwrap();
    let fifo = dir.join("fifo.yaml");
    crate::helpers::mkfifo(&fifo);
    std::fs::write(dir.join("binary.yaml"), [0xff, 0xfe, 0x00, 0x80]).unwrap();
    std::fs::write(dir.join("huge.yaml"), vec![b'#'; 100_000]).unwrap();
    // The canary's own file changes too: the directory is read again, and
    // the gateway keeps serving exactly the good content.
    canary.check().await;
    let errors = upstream_status_when(&gw, "every bad file reported", |s| {
        s.last_error.as_deref().is_some_and(|e| {
            ["bomb.yaml", "loop.yaml", "binary.yaml", "huge.yaml"]
                .iter()
                .all(|f| e.contains(f))
        })
    })
    .await
    .last_error
    .unwrap();
    assert!(errors.contains("expands"), "{errors}");
    assert!(errors.contains("--max-message-bytes=65536"), "{errors}");
    assert!(
        errors.contains("fifo.yaml") && errors.contains("not a regular file"),
        "{errors}"
    );
    let snapshot = gw.cache.get(VS).unwrap();
    assert_eq!(snapshot.len(), 1, "only the canary's resource");
    canary.check().await;
}

/// Each hostile file is also in the log: one line per file, naming it and
/// what is wrong with it. A process of its own: its log is this test's.
#[tokio::test]
async fn hostile_files_are_each_logged_naming_the_file_and_the_reason() {
    let (mut gw, mut canary) = crate::limits::spawned_with_canary(&["--max-message-bytes", "65536"]).await;
    let dir = canary.dir().to_owned();
    let mut bomb = format!("collection: {VS}\nname: ns/bomb\nbody:\n  struct:\n    big: &big [");
    bomb.push_str(&vec!["x"; 2000].join(","));
    bomb.push_str("]\n    copies:\n");
    bomb.push_str(&"      - *big\n".repeat(4000));
    // Each file whole at once (written aside, then renamed): a half-written
    // file read by the watcher would be a line of its own.
    crate::helpers::write_whole(&dir, "bomb.yaml", bomb.as_bytes());
    std::os::unix::fs::symlink(dir.join("loop.yaml"), dir.join("loop.yaml")).unwrap();
    crate::helpers::mkfifo(&dir.join("fifo.yaml"));
    crate::helpers::write_whole(&dir, "binary.yaml", &[0xff, 0xfe, 0x00, 0x80]);
    crate::helpers::write_whole(&dir, "huge.yaml", &[b'#'; 100_000]);
    canary.check().await;
    let mut reasons = std::collections::BTreeMap::new();
    while reasons.len() < 5 {
        let line = gw.log_line("a source file does not parse").await;
        let file = ["bomb.yaml", "loop.yaml", "fifo.yaml", "binary.yaml", "huge.yaml"]
            .into_iter()
            .find(|f| line.contains(&*dir.join(f).to_string_lossy()))
            .unwrap_or_else(|| panic!("names one of the files by its path: {line}"));
        assert!(
            reasons.insert(file, line.clone()).is_none(),
            "one line per file: {line}"
        );
    }
    assert!(reasons["bomb.yaml"].contains("expands"), "{}", reasons["bomb.yaml"]);
    assert!(
        reasons["huge.yaml"].contains("--max-message-bytes=65536"),
        "{}",
        reasons["huge.yaml"]
    );
    assert!(
        reasons["fifo.yaml"].contains("not a regular file"),
        "{}",
        reasons["fifo.yaml"]
    );
    assert!(
        reasons["binary.yaml"].contains("not UTF-8"),
        "{}",
        reasons["binary.yaml"]
    );
    assert!(reasons["loop.yaml"].contains("cannot read"), "{}", reasons["loop.yaml"]);
    canary.check().await;
}
