//! Gateways in a chain: gateway B's `--upstream` is gateway A's client port
//! (`ResourceSource`). Changes flow through with the same content versions,
//! B keeps serving while A is away, and loops and over-long chains are
//! refused with errors that say so.

use mcp_xds_gateway::app::Bound;

use crate::helpers::clients::{sotw, PilotSink};
use crate::helpers::galley::{incremental, resource, FakeGalley};
use crate::helpers::{
    eventually, free_addr, galley_and_gateway, get_json, names, spawn_gateway, start_gateway, start_gateway_on,
    upstream_failed, upstream_status_when, within, VS,
};

/// A gateway whose upstream is `upstream`'s client port.
async fn chained(upstream: &Bound, extra: &[&str]) -> Bound {
    chained_to(&format!("http://{}", upstream.listen), extra).await
}

/// A gateway whose upstream is `url`.
async fn chained_to(url: &str, extra: &[&str]) -> Bound {
    let mut flags = vec!["--upstream", url, "--collections", VS, "--reconnect-min-delay", "10ms"];
    flags.extend_from_slice(extra);
    start_gateway(&flags).await
}

fn version(gw: &Bound) -> String {
    gw.cache.get(VS).map(|s| s.version.to_string()).unwrap_or_default()
}

#[tokio::test]
async fn a_change_at_galley_reaches_the_clients_of_a_chained_gateway_with_the_same_versions() {
    let (_galley, a, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;

    let b = chained(&a, &[]).await;
    let mut legacy = sotw(b.listen).await;
    legacy.subscribe(VS);
    let first = legacy.recv().await;
    assert_eq!(names(&first.resources), ["a", "b"]);
    assert_eq!(first.version_info, version(&a), "B serves A's content version");
    legacy.ack(&first);
    let mut sink = PilotSink::connect(b.listen, &[VS], true).await;
    assert_eq!(names(&sink.recv_and_ack().await.resources), ["a", "b"]);

    // Incremental end to end: Galley's incremental update, A's diff to B,
    // B's diff to its incremental sink.
    let reply = upstream
        .send(incremental(VS, vec![resource("a", "2", b"a2")], &["b"]))
        .await;
    assert!(reply.error_detail.is_none(), "{reply:?}");
    let change = legacy.recv().await;
    assert_eq!(names(&change.resources), ["a"]);
    let diff = sink.recv_and_ack().await;
    assert!(diff.incremental);
    assert_eq!(names(&diff.resources), ["a"]);
    assert_eq!(diff.removed_resources, ["b"]);
    assert_eq!(change.version_info, version(&a));
    assert_eq!(diff.system_version_info, version(&b));
    assert_eq!(
        version(&a),
        version(&b),
        "no version of its own: clients moving between A and B see no push"
    );

    // Each side sees the other: A serves B as a gateway, incrementally; B
    // knows A as its upstream gateway.
    let b_id = b.cache.provenance().gateway_id.to_string();
    let a_id = a.cache.provenance().gateway_id.to_string();
    let streams = a.registry.streams();
    let from_b = streams
        .iter()
        .find(|s| s.gateway_id.as_deref() == Some(&b_id))
        .expect("A's client list shows B");
    assert_eq!(from_b.protocol.as_str(), "resource-source");
    assert!(from_b.types[VS].incremental, "B asks A for changes only");
    let upstream_view = get_json(b.admin, "/debug/upstream").await;
    assert_eq!(upstream_view["upstream_gateways"], serde_json::json!([a_id]));
    assert_eq!(upstream_view["gateway_id"], b_id);
}

#[tokio::test]
async fn when_the_upstream_gateway_goes_away_the_next_one_keeps_serving_and_reconnects() {
    let (mut galley, a, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let b = chained(&a, &[]).await;
    let mut client = sotw(b.listen).await;
    client.subscribe(VS);
    let first = client.recv().await;
    client.ack(&first);

    let a_listen = a.listen.to_string();
    a.shutdown().await;
    upstream_status_when(&b, "B to see A gone", |s| !s.connected && s.last_error.is_some()).await;

    // B serves what it has, to its clients and to new ones.
    let mut late = sotw(b.listen).await;
    late.subscribe(VS);
    assert_eq!(late.recv().await.version_info, first.version_info);

    // A back on its port, with new content from Galley: B reconnects and
    // its clients get it.
    let url = galley.url();
    let _a = start_gateway_on(&a_listen, &["--upstream", &url, "--collections", VS]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream
        .push_full(VS, vec![resource("a", "2", b"a2"), resource("c", "1", b"c")])
        .await;
    let change = client.recv().await;
    assert_eq!(names(&change.resources), ["a", "c"]);
    upstream_status_when(&b, "B to be connected again", |s| s.connected).await;
}

#[tokio::test]
async fn a_gateway_that_is_its_own_upstream_refuses_the_loop() {
    // A gateway process of its own: its terminations are counted exactly.
    // Retries a second apart, so that a count read between two is still.
    let addr = free_addr().to_string();
    let url = format!("http://{addr}");
    let flags = [
        "--listen",
        &addr,
        "--upstream",
        &url,
        "--collections",
        VS,
        "--reconnect-min-delay",
        "1s",
    ];
    let gw = crate::helpers::spawn_gateway(None, &flags).await;
    let status = upstream_failed(gw.admin, 1, "the loop to be refused").await;
    // The upstream's chain (itself) includes this gateway: refused as a
    // loop, shown as the upstream's last error, saying what to fix.
    let error = status["last_error"].as_str().unwrap();
    assert!(
        error.contains("includes this gateway: a loop") && error.contains("fix --upstream"),
        "{error}"
    );
    let loops = "mcp_gateway_upstream_stream_terminations_total{reason=\"loop\"}";
    crate::limits::metric_is(gw.monitoring, loops, status["consecutive_failures"].as_u64().unwrap()).await;
    // Retried, with backoff, and refused each time: never served.
    let status = upstream_failed(gw.admin, 2, "a second attempt failed as a loop").await;
    assert!(status["last_error"].as_str().unwrap().contains("a loop"), "{status}");
    crate::limits::metric_is(gw.monitoring, loops, status["consecutive_failures"].as_u64().unwrap()).await;
    let cache = crate::helpers::get_json(gw.admin, "/debug/cache").await;
    assert!(
        !cache.as_array().unwrap().iter().any(|c| c["collection"] == VS),
        "nothing served from a loop: {cache}"
    );
}

/// A gateway peer announcing `id` on `addr`'s `ResourceSource`, asking for VS.
async fn gateway_peer(
    addr: std::net::SocketAddr,
    id: &str,
) -> crate::helpers::clients::Bidi<mcp_xds_gateway::proto::RequestResources, mcp_xds_gateway::proto::Resources> {
    use mcp_xds_gateway::cache::provenance::GATEWAY_ID_ANNOTATION;
    use mcp_xds_gateway::proto::{RequestResources, SinkNode};
    let peer = crate::helpers::clients::Bidi::open(addr, crate::helpers::clients::RESOURCE_SOURCE_PATH).await;
    peer.send(RequestResources {
        sink_node: Some(SinkNode {
            id: "gateway-peer".into(),
            annotations: [(GATEWAY_ID_ANNOTATION.to_owned(), id.to_owned())].into(),
        }),
        collection: VS.into(),
        ..Default::default()
    });
    peer
}

/// A peer that announces itself as this gateway, or as a gateway upstream
/// of it, is refused: serving it would close a loop. Other clients are
/// served all along.
#[tokio::test]
async fn a_peer_announcing_this_gateway_or_its_upstream_is_refused_naming_the_loop() {
    let (_galley, a, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let b = chained(&a, &[]).await;
    eventually("B to be served", || b.cache.get(VS).is_some()).await;
    let b_id = b.cache.provenance().gateway_id.to_string();
    let a_id = a.cache.provenance().gateway_id.to_string();
    for (who, id) in [("itself", &b_id), ("its upstream", &a_id)] {
        let mut peer = gateway_peer(b.listen, id).await;
        let status = peer.end_status().await;
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{who}: {status:?}");
        assert!(
            status.message().contains(&format!("gateway {id} is this gateway"))
                && status.message().contains("serving it would make a loop"),
            "{who}: {}",
            status.message()
        );
    }
    let mut client = sotw(b.listen).await;
    client.subscribe(VS);
    assert_eq!(names(&client.recv_type(VS).await.resources), ["a"]);
}

/// A TCP relay to a target the test switches: a gateway whose `--upstream`
/// is the relay dials, from its next connection on, whatever the relay
/// points at. Connections already relayed keep their target.
struct Relay {
    addr: std::net::SocketAddr,
    target: std::sync::Arc<std::sync::Mutex<std::net::SocketAddr>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn to(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = std::sync::Arc::new(std::sync::Mutex::new(target));
        let current = target.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let to = *current.lock().unwrap();
                tokio::spawn(async move {
                    // A target that is gone: the dialer sees its connection
                    // closed, as it would without the relay.
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self {
            addr,
            target,
            accepting,
        }
    }

    fn switch(&self, to: std::net::SocketAddr) {
        *self.target.lock().unwrap() = to;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// A gateway peer served while it is not upstream of this gateway is
/// refused once it becomes so: B serves a peer announcing A's id while B's
/// upstream is a Galley; then B's upstream becomes A (B's `--upstream`
/// reaches A from its next connection), B learns A's chain, and the peer's
/// stream ends `FAILED_PRECONDITION` naming the loop. Other clients of B are
/// served all along.
#[tokio::test]
async fn a_peer_that_becomes_upstream_later_is_refused_naming_the_loop() {
    let (_galley, a, mut upstream_of_a) = galley_and_gateway(&[VS], &[]).await;
    upstream_of_a.push_full(VS, vec![resource("a", "2", b"from A")]).await;
    let a_id = a.cache.provenance().gateway_id.to_string();

    // B's upstream first: a Galley, which announces no chain.
    let mut first = FakeGalley::start().await;
    let relay = Relay::to(first.addr).await;
    let b = chained_to(&format!("http://{}", relay.addr), &[]).await;
    let mut upstream_of_b = first.next_stream().await;
    upstream_of_b.initial_requests(1).await;
    upstream_of_b
        .push_full(VS, vec![resource("a", "1", b"from galley")])
        .await;
    assert!(b.cache.provenance().upstream_chain().is_empty());

    // A peer announcing A's id: not upstream of B, so it is served.
    let mut peer = gateway_peer(b.listen, &a_id).await;
    let served = peer.recv().await;
    assert_eq!(names(&served.resources), ["a"]);
    let mut client = sotw(b.listen).await;
    client.subscribe(VS);
    let first_content = client.recv_type(VS).await;
    assert_eq!(first_content.resources[0].metadata.as_ref().unwrap().version, "1");
    client.ack(&first_content);

    // B's upstream becomes A: its next connection reaches A.
    relay.switch(a.listen);
    first.stop().await;
    let status = peer.end_status().await;
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains(&format!("gateway {a_id} is this gateway"))
            && status.message().contains(&format!("(upstream chain: {a_id})"))
            && status.message().contains("serving it would make a loop"),
        "{}",
        status.message()
    );
    assert_eq!(
        b.cache.provenance().upstream_chain(),
        [std::sync::Arc::<str>::from(a_id.as_str())],
        "B is chained behind A"
    );
    // The other client follows B's new upstream.
    let from_a = client.recv_type(VS).await;
    assert_eq!(from_a.resources[0].metadata.as_ref().unwrap().version, "2");
}

#[tokio::test]
async fn two_gateways_feeding_each_other_are_refused() {
    let (a_addr, b_addr) = (free_addr().to_string(), free_addr().to_string());
    let (a_url, b_url) = (format!("http://{a_addr}"), format!("http://{b_addr}"));
    let flags = |url| ["--upstream", url, "--collections", VS, "--reconnect-min-delay", "10ms"];
    let a = start_gateway_on(&a_addr, &flags(&b_url)).await;
    let b = start_gateway_on(&b_addr, &flags(&a_url)).await;
    // Whichever connects second finds itself in the other's chain, or is
    // refused by the other; either way one of them reports the loop in the
    // words of the row (`--max-chain-depth`'s and the loop refusal's), with
    // what to fix. Any other error mentioning a loop keeps the wait going.
    let names_the_loop = |error: &str| {
        (error.contains("includes this gateway: a loop") || error.contains("serving it would make a loop"))
            && error.contains("--upstream so that config flows one way")
    };
    eventually("one of the two to report the loop in the row's words", || {
        [&a, &b]
            .iter()
            .any(|gw| gw.upstream.borrow().last_error.as_deref().is_some_and(names_the_loop))
    })
    .await;
}

/// A ring is a configuration error: each gateway of it says so at WARN,
/// whichever side of the refusal it is on (the one refusing to serve its
/// upstream, the one refused or finding itself in its upstream's chain).
#[tokio::test]
async fn both_gateways_of_a_ring_warn_of_the_loop() {
    let (a_addr, b_addr) = (free_addr().to_string(), free_addr().to_string());
    let (a_url, b_url) = (format!("http://{a_addr}"), format!("http://{b_addr}"));
    let args = |listen, url| {
        [
            "--listen",
            listen,
            "--upstream",
            url,
            "--collections",
            VS,
            "--reconnect-min-delay",
            "10ms",
        ]
    };
    let mut a = spawn_gateway(None, &args(&a_addr, &b_url)).await;
    let mut b = spawn_gateway(None, &args(&b_addr, &a_url)).await;
    for gateway in [&mut a, &mut b] {
        within("a warning of the loop", async {
            while !gateway.log_line("loop").await.contains("WARN") {}
        })
        .await;
    }
}

/// C, the third gateway of a chain where `--max-chain-depth` is 2, is a
/// process of its own: its terminations are counted exactly.
#[tokio::test]
async fn a_chain_longer_than_max_chain_depth_is_refused() {
    let (_galley, a, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    // A then B: two gateways, within a depth of 2.
    let b = chained(&a, &["--max-chain-depth", "2"]).await;
    eventually("B to be served", || b.cache.get(VS).is_some()).await;
    // A, B, then C: three. Retries a second apart, so that a count read
    // between two is still.
    let url = format!("http://{}", b.listen);
    let c = spawn_gateway(
        None,
        &[
            "--upstream",
            &url,
            "--collections",
            VS,
            "--max-chain-depth",
            "2",
            "--reconnect-min-delay",
            "1s",
        ],
    )
    .await;
    let too_long = "mcp_gateway_upstream_stream_terminations_total{reason=\"chain_too_long\"}";
    // Refused, shown as the upstream's last error, retried with backoff.
    for attempt in 1..=2 {
        let status = upstream_failed(c.admin, attempt, "C to refuse the chain").await;
        let error = status["last_error"].as_str().unwrap();
        assert!(error.contains("more than --max-chain-depth=2"), "{error}");
        crate::limits::metric_is(c.monitoring, too_long, status["consecutive_failures"].as_u64().unwrap()).await;
    }
    let cache = get_json(c.admin, "/debug/cache").await;
    assert!(
        !cache.as_array().unwrap().iter().any(|c| c["collection"] == VS),
        "nothing taken from a chain too long: {cache}"
    );
}

/// A chained gateway asking its upstream for what the upstream refuses it
/// (the secrets, without an access policy there): its last error says the
/// upstream's reason, not that the stream closed while it was sending.
#[tokio::test]
async fn a_refusal_by_the_upstream_is_said_with_its_reason() {
    const SECRETS: &str = "envoy/extensions/transport_sockets/tls/v3/secrets";
    let a = start_gateway(&[]).await;
    let url = format!("http://{}", a.listen);
    let b = start_gateway(&[
        "--upstream",
        &url,
        "--collections",
        &format!("{VS},{SECRETS}"),
        "--reconnect-min-delay",
        "10ms",
        "--reconnect-max-delay",
        "50ms",
    ])
    .await;
    // Several attempts, each with the upstream's reason.
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let status = upstream_status_when(&b, "a failed attempt", |s| {
            s.last_error.is_some() && s.attempts > seen.len() as u64
        })
        .await;
        seen.push(status.last_error.clone().unwrap());
    }
    for error in &seen {
        assert!(!error.contains("closed while"), "{seen:?}");
        assert!(
            error.contains("PermissionDenied") || error.contains("permission"),
            "{seen:?}"
        );
    }
}

/// A gateway whose `--type-map` serves as open a collection its upstream
/// gateway serves as sensitive takes nothing from it: the upstream says on
/// the stream which collections are sensitive (`x-mcp-gateway-sensitive`),
/// and the secrets are not served to every client of the next gateway nor
/// shown in its views (the twenty-fourth check of issue 42).
#[tokio::test]
async fn a_collection_the_upstream_serves_as_sensitive_is_not_taken_as_open() {
    const CREDS: &str = "custom/creds";
    let dir = tempfile::tempdir().unwrap();
    let marked = crate::helpers::certs::write(
        dir.path(),
        "marked.yaml",
        "custom/creds: {type_url: type.googleapis.com/google.protobuf.Struct, sensitive: true}\n",
    );
    let open = crate::helpers::certs::write(
        dir.path(),
        "open.yaml",
        "custom/creds: type.googleapis.com/google.protobuf.Struct\n",
    );
    // A reads the secret from its files and grants every collection to
    // plaintext clients: B may read it.
    let policy = crate::helpers::certs::write(
        dir.path(),
        "policy.yaml",
        "rules:\n- identities: [unauthenticated]\n  collections: [\"*\"]\n",
    );
    let source = dir.path().join("source");
    std::fs::create_dir(&source).unwrap();
    crate::helpers::certs::write(
        &source,
        "creds.yaml",
        "collection: custom/creds\nname: c\nbody: {struct: {token: MARKER-CHAIN}}\n",
    );
    let a = start_gateway(&[
        "--source-dir",
        source.to_str().unwrap(),
        "--type-map",
        marked.to_str().unwrap(),
        "--access-policy",
        policy.to_str().unwrap(),
    ])
    .await;
    eventually("A to read the secret", || a.cache.get(CREDS).is_some()).await;
    let url = format!("http://{}", a.listen);
    let b = spawn_gateway(
        None,
        &[
            "--upstream",
            &url,
            "--collections",
            CREDS,
            "--type-map",
            open.to_str().unwrap(),
            "--reconnect-min-delay",
            "1s",
        ],
    )
    .await;
    let status = upstream_failed(b.admin, 1, "B to refuse an open custom/creds").await;
    let error = status["last_error"].as_str().unwrap();
    assert!(
        error.contains("serves custom/creds as sensitive") && error.contains("mark it sensitive: true here"),
        "{error}"
    );
    let cache = get_json(b.admin, "/debug/cache").await;
    assert!(
        !cache.as_array().unwrap().iter().any(|c| c["collection"] == CREDS),
        "nothing taken: {cache}"
    );
    let reason = "mcp_gateway_upstream_stream_terminations_total{reason=\"sensitive_upstream\"}";
    crate::limits::metric_is(b.monitoring, reason, status["consecutive_failures"].as_u64().unwrap()).await;

    // Marked here too, the same upstream is taken from.
    let c = start_gateway(&[
        "--upstream",
        &url,
        "--collections",
        CREDS,
        "--type-map",
        marked.to_str().unwrap(),
        "--reconnect-min-delay",
        "10ms",
    ])
    .await;
    eventually("C to take the secret in", || c.cache.get(CREDS).is_some()).await;
}

/// An upstream whose `x-mcp-gateway-sensitive` header does not read as a
/// gateway writes it (an empty entry, a byte it would have encoded) gives
/// nothing: which of its collections are sensitive cannot be told, and a
/// gateway that took them could serve a secret as open. The next gateway
/// says why; one whose header reads is taken from as before.
#[tokio::test]
async fn an_upstream_whose_sensitive_header_does_not_read_gives_nothing() {
    for (header, taken) in [
        (Some("custom/creds,,"), false),
        (Some("custom creds"), false),
        (Some("other/kind"), true),
        (None, true),
    ] {
        let galley = FakeGalley::start().await;
        if let Some(value) = header {
            galley.send_header("x-mcp-gateway-sensitive", value);
        }
        galley.publish(VS, vec![resource("vs-a", "1", b"x")]);
        let b = start_gateway(&[
            "--upstream",
            &galley.url(),
            "--collections",
            VS,
            "--reconnect-min-delay",
            "1s",
        ])
        .await;
        if taken {
            eventually("the collection taken in", || b.cache.get(VS).is_some()).await;
        } else {
            let status = upstream_failed(b.admin, 1, "the upstream refused").await;
            let error = status["last_error"].as_str().unwrap();
            assert!(
                error.contains("does not read as a gateway writes it"),
                "{header:?}: {error}"
            );
            assert!(b.cache.get(VS).is_none(), "{header:?}: nothing taken");
        }
    }
}
