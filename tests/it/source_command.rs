//! `mcp-xds-gateway source`: a directory served as Galley served it, to a
//! gateway in client mode (`source --listen`) and in dial-out mode (`source
//! --sink`, over mTLS); each gateway gets the directory and follows an edit.

use std::path::Path;

use mcp_xds_gateway::app::{self, Bound};
use mcp_xds_gateway::config::{Args, Command};
use tonic::Code;

use crate::helpers::certs::{write, write_leaf, Ca};
use crate::helpers::clients::{channel, sotw, tls_channel, SotwClient, SOTW_PATH};
use crate::helpers::{
    eventually, eventually_async, get_json, http_get, names, sample, spawn_dial_out_source, start_gateway, within, VS,
};

fn vs_doc(name: &str, weight: u32) -> String {
    format!("collection: {VS}\nname: {name}\nbody:\n  struct:\n    hosts: [{name}]\n    weight: {weight}\n---\n")
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// Starts `mcp-xds-gateway source --source-dir DIR FLAGS...` in-process,
/// its HTTP ports on free loopback ports.
async fn start_source(dir: &Path, flags: &[&str]) -> Bound {
    let dir = path(dir);
    let mut argv = vec![
        "mcp-xds-gateway",
        "source",
        "--source-dir",
        &dir,
        "--admin-listen",
        "127.0.0.1:0",
        "--monitoring-listen",
        "127.0.0.1:0",
        "--reconnect-min-delay",
        "10ms",
        "--reconnect-max-delay",
        "200ms",
    ];
    argv.extend_from_slice(flags);
    let Some(Command::Source(source)) = Args::try_parse_with_sources(argv).expect("valid flags").command else {
        panic!("the source command")
    };
    let settings = source.validate().expect("valid settings");
    within("the source to start", app::build(settings))
        .await
        .expect("the source starts")
}

/// Whether `gateway` holds the virtual service `name`.
fn has(gateway: &Bound, name: &str) -> bool {
    gateway.cache.get(VS).is_some_and(|c| c.resources.contains_key(name))
}

/// Whether the admin port at `admin` shows a `ResourceSource` client that
/// ACKed the current version of the virtual services.
async fn synced_resource_source(admin: std::net::SocketAddr) -> bool {
    let syncz = get_json(admin, "/debug/syncz").await;
    syncz["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|row| row["protocol"] == "resource-source" && row["collection"] == VS && row["status"] == "SYNCED")
}

/// A directory with two virtual services.
fn source_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 1)));
    dir
}

/// A client of a gateway gets the directory's two virtual services, then
/// the edit of one.
async fn follows_the_directory(mut client: SotwClient, dir: &Path) {
    client.subscribe(VS);
    let first = client.recv().await;
    assert_eq!(names(&first.resources), ["a", "b"]);
    client.ack(&first);

    write(dir, "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 2) + &vs_doc("c", 1)));
    let edited = client.recv().await;
    assert_eq!(names(&edited.resources), ["a", "b", "c"]);
    assert_ne!(edited.version_info, first.version_info);
}

#[tokio::test]
async fn a_gateway_in_client_mode_follows_source_listen() {
    let dir = source_dir();
    let source = start_source(dir.path(), &["--listen", "127.0.0.1:0"]).await;
    assert!(source.listen.ip().is_loopback());
    let upstream = format!("http://{}", source.listen);
    let gateway = start_gateway(&[
        "--upstream",
        &upstream,
        "--collections",
        VS,
        "--reconnect-min-delay",
        "10ms",
    ])
    .await;

    follows_the_directory(sotw(gateway.listen).await, dir.path()).await;
    eventually("the gateway to be connected", || gateway.upstream.borrow().connected).await;

    // The source serves ResourceSource only: it is Galley, not a gateway.
    let refused = SotwClient::try_open_on(channel(source.listen).await, SOTW_PATH)
        .await
        .err()
        .expect("no AggregatedMeshConfigService on the source");
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    // Its admin port shows the gateway as a ResourceSource client that ACKed.
    eventually_async("the source's sync view to show the gateway in sync", || async {
        synced_resource_source(source.admin).await
    })
    .await;
    // Ready once the directory is read; the probe paths answer.
    assert_eq!(http_get(source.monitoring, "/readyz").await.0, 200);

    // At shutdown its clients are told the source goes, not a gateway.
    let mut sink = crate::helpers::clients::PilotSink::connect(source.listen, &[VS], false).await;
    sink.recv_and_ack().await;
    assert!(within("the source to stop", source.shutdown()).await);
    let status = sink.stream.end_status().await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status.message(),
        "the source is shutting down; reconnect to another replica"
    );
}

/// A dial-out gateway with mTLS on its sink port, and a source dialling it
/// with a certificate of the same CA.
#[tokio::test]
async fn a_dial_out_gateway_follows_source_sink_over_mtls() {
    let dir = source_dir();
    let certs = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let ca_path = path(&write(certs.path(), "ca.pem", &ca.pem));
    let (gateway_cert, gateway_key) = write_leaf(certs.path(), "gateway", &ca.leaf("gateway"));
    let galley_id = "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account";
    let (source_cert, source_key) = write_leaf(certs.path(), "source", &ca.spiffe_leaf(galley_id));
    let gateway = start_gateway(&[
        "--sink-listen",
        "127.0.0.1:0",
        "--collections",
        VS,
        "--tls-cert",
        &path(&gateway_cert),
        "--tls-key",
        &path(&gateway_key),
        "--client-ca",
        &ca_path,
        "--sink-allow",
        galley_id,
    ])
    .await;
    let sink = gateway.sink.unwrap().to_string();

    // Without a client certificate, the gateway refuses the source, which
    // keeps dialling (with backoff) and says why.
    // A process of its own: its counters are its own dial-outs alone.
    let anonymous = spawn_dial_out_source(dir.path(), &["--sink", &sink, "--ca", &ca_path]).await;
    eventually_async("the refused dial-out to be counted, and tried again", || async {
        let (_, metrics) = http_get(anonymous.monitoring, "/metrics").await;
        sample(&metrics, "mcp_gateway_dial_out_attempts_total", &[]).is_some_and(|n| n >= 2.0)
            && sample(&metrics, "mcp_gateway_dial_out_connected", &[]) == Some(0.0)
    })
    .await;
    assert!(
        gateway.cache.get(VS).is_none(),
        "an unauthenticated source feeds nothing"
    );
    assert!(anonymous.stop().await, "the refused source exits 0 at SIGTERM");

    let source = spawn_dial_out_source(
        dir.path(),
        &[
            "--sink",
            &sink,
            "--ca",
            &ca_path,
            "--tls-cert",
            &path(&source_cert),
            "--tls-key",
            &path(&source_key),
            "--sink-meta",
            "team=mesh",
            // Keys written as credentials (a mistyped pair): hidden, each
            // its own (the thirty-first check of issue 42).
            "--sink-meta",
            "a94a8fe5ccb19ba61c4c0873d391e987982fbbd3=1",
            "--sink-meta",
            "glpat-qzkq12345=x",
        ],
    )
    .await;
    // The gateway's clients present certificates of the mesh CA too.
    let pilot = ca.spiffe_leaf("spiffe://cluster.local/ns/istio-system/sa/istio-pilot-service-account");
    let client = SotwClient::open_on(
        tls_channel(gateway.listen, &ca.pem, Some(&pilot)).await.unwrap(),
        SOTW_PATH,
    )
    .await;
    follows_the_directory(client, dir.path()).await;
    let status = gateway.upstream.borrow().clone();
    assert_eq!(status.mode, "sink");
    assert!(status.connected, "{status:?}");
    // A key not known to name no secret: its value is kept redacted.
    assert_eq!(
        status.source_metadata.get("team").map(String::as_str),
        Some("[redacted]")
    );
    let shown = format!("{:?}", status.source_metadata);
    assert!(!shown.contains("a94a8fe5") && !shown.contains("qzkq"), "{shown}");
    assert_eq!(
        status.source_metadata.get("[redacted]").map(String::as_str),
        Some("[redacted]")
    );
    assert_eq!(
        status.source_metadata.get("[redacted 2]").map(String::as_str),
        Some("[redacted]")
    );
    assert!(
        status.last_error.is_none(),
        "the trigger was answered and ignored, nothing refused: {status:?}"
    );

    // The source sees the sink's ACKs: connected, in sync.
    eventually_async("the source to report the sink connected and in sync", || async {
        let (_, metrics) = http_get(source.monitoring, "/metrics").await;
        sample(&metrics, "mcp_gateway_dial_out_connected", &[]) == Some(1.0)
            && synced_resource_source(source.admin).await
    })
    .await;
}

/// One source at a time: a second source is refused until the first goes,
/// then takes over (its reconnect loop, not a restart).
#[tokio::test]
async fn a_second_dial_out_source_takes_over_when_the_first_stops() {
    let gateway = start_gateway(&["--sink-listen", "127.0.0.1:0", "--sink-insecure", "--collections", VS]).await;
    let sink = gateway.sink.unwrap().to_string();
    let first_dir = tempfile::tempdir().unwrap();
    write(first_dir.path(), "vs.yaml", &vs_doc("first", 1));
    let first = start_source(first_dir.path(), &["--sink", &sink, "--sink-insecure"]).await;
    eventually("the first source to feed the gateway", || has(&gateway, "first")).await;

    let second_dir = tempfile::tempdir().unwrap();
    write(second_dir.path(), "vs.yaml", &vs_doc("second", 1));
    // A process of its own: the refusals counted are its own.
    let second = spawn_dial_out_source(second_dir.path(), &["--sink", &sink, "--sink-insecure"]).await;
    eventually_async("the second source to be refused", || async {
        let (_, metrics) = http_get(second.monitoring, "/metrics").await;
        sample(
            &metrics,
            "mcp_gateway_dial_out_stream_ends_total",
            &["reason=\"refused\""],
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    assert!(has(&gateway, "first"));

    assert!(within("the first source to stop", first.shutdown()).await);
    eventually("the second source to take over", || {
        has(&gateway, "second") && !has(&gateway, "first")
    })
    .await;
}

/// The binary's own start-up: a bad flag exits 2 naming it.
#[test]
fn bad_source_flags_exit_2_naming_the_flag() {
    let dir = env!("CARGO_MANIFEST_DIR").to_owned() + "/examples/config";
    for (args, flag) in [
        (vec!["source", "--source-dir", &dir], "--listen"),
        (vec!["source", "--listen"], "--source-dir"),
        (
            vec![
                "source",
                "--source-dir",
                &dir,
                "--sink",
                "g:1",
                "--ca",
                "/nonexistent.pem",
            ],
            "--ca",
        ),
        (
            vec!["source", "--source-dir", "/nonexistent", "--listen"],
            "--source-dir",
        ),
        (
            vec![
                "source",
                "--source-dir",
                &dir,
                "--listen",
                "127.0.0.1:0",
                "--sensitive-version-key",
                "/dev/null",
            ],
            "--sensitive-version-key",
        ),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_mcp-xds-gateway"))
            .args(&args)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}
