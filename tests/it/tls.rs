//! TLS and mTLS on each side: the downstream listener, the upstream client,
//! the dial-out listener, and certificates rotated on disk. Certificates are
//! generated per test (helpers/certs.rs).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use clap::Parser;
use mcp_xds_gateway::config::Args;
use mcp_xds_gateway::proto::aggregated_mesh_config_service_client::AggregatedMeshConfigServiceClient;
use mcp_xds_gateway::proto::{MeshConfigRequest, MeshConfigResponse};
use rustls::AlertDescription;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Certificate, Channel, Endpoint, Identity, ServerTlsConfig};

use crate::helpers::certs::{self_signed_leaf, tls_alert, write, write_leaf, Ca, Leaf};
use crate::helpers::clients::{node, tls_channel, SotwClient, SOTW_PATH};
use crate::helpers::galley::{dial_out, resource, FakeGalley};
use crate::helpers::{eventually, names, start_gateway, within, VS};

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// Opens a stream for VS and waits for the first response; any failure
/// (connect, handshake, stream) is an Err with its text.
async fn first_response(channel: Result<Channel, tonic::transport::Error>) -> Result<MeshConfigResponse, String> {
    within("a TLS client's first response or its refusal", async {
        let channel = channel.map_err(|e| format!("connect: {e:?}"))?;
        let mut client = AggregatedMeshConfigServiceClient::new(channel);
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(MeshConfigRequest {
            sink_node: node(),
            type_url: VS.into(),
            ..Default::default()
        })
        .unwrap();
        let mut stream = client
            .stream_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await
            .map_err(|s| format!("stream: {s:?}"))?
            .into_inner();
        let response = stream.message().await.map_err(|s| format!("response: {s:?}"))?;
        drop(tx);
        response.ok_or_else(|| "the stream ended without a response".to_owned())
    })
    .await
}

async fn plaintext(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    within(
        "a plaintext connection",
        Endpoint::from_shared(format!("http://{addr}")).unwrap().connect(),
    )
    .await
}

/// A gateway on the shipped examples with TLS on its listeners.
async fn tls_gateway(dir: &Path, ca: &Ca, mtls: bool, extra: &[&str]) -> mcp_xds_gateway::app::Bound {
    let (cert, key) = write_leaf(dir, "server", &ca.leaf("gateway"));
    let ca_path = write(dir, "client-ca.pem", &ca.pem);
    let (cert, key, ca_path) = (path(&cert), path(&key), path(&ca_path));
    let mut flags = vec!["--tls-cert", &cert, "--tls-key", &key];
    if mtls {
        flags.extend(["--client-ca", &ca_path]);
    }
    flags.extend_from_slice(extra);
    start_gateway(&flags).await
}

#[tokio::test]
async fn downstream_tls_and_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = tls_gateway(dir.path(), &ca, true, &[]).await;

    let pilot = ca.leaf("pilot");
    let channel = tls_channel(gw.listen, &ca.pem, Some(&pilot)).await.unwrap();
    let mut client = SotwClient::open_on(channel, SOTW_PATH).await;
    client.subscribe(VS);
    assert_eq!(
        names(&client.recv().await.resources),
        ["bookinfo/ratings", "bookinfo/reviews"]
    );

    // No client certificate, or one from another CA: the handshake fails
    // with TLS's own reason, before any stream; the allowed client is taken.
    let stranger = Ca::new("other-ca").leaf("pilot");
    let expired = ca.expired_spiffe_leaf("spiffe://cluster.local/ns/istio-system/sa/pilot");
    assert_eq!(tls_alert(gw.listen, &ca.pem, Some(&pilot)).await, None);
    for (what, identity, alert) in [
        ("no certificate", None, AlertDescription::CertificateRequired),
        ("another CA", Some(&stranger), AlertDescription::UnknownCA),
        ("expired", Some(&expired), AlertDescription::CertificateExpired),
    ] {
        assert_eq!(tls_alert(gw.listen, &ca.pem, identity).await, Some(alert), "{what}");
    }
    // Plaintext: the HTTP/2 preface is not a ClientHello. The gateway
    // answers no HTTP/2 (at most a TLS alert record) and closes.
    let mut raw = tokio::net::TcpStream::connect(gw.listen).await.unwrap();
    raw.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut answer = Vec::new();
    within("the plaintext connection to be closed", raw.read_to_end(&mut answer))
        .await
        .unwrap();
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "a TLS alert record (0x15) or nothing, then closed: {answer:?}"
    );
    let plaintext = first_response(plaintext(gw.listen).await).await;
    assert!(
        plaintext.is_err(),
        "a plaintext gRPC client gets no response: {plaintext:?}"
    );

    // TLS without --client-ca takes clients without certificates.
    let dir = tempfile::tempdir().unwrap();
    let gw = tls_gateway(dir.path(), &ca, false, &[]).await;
    let response = first_response(tls_channel(gw.listen, &ca.pem, None).await).await;
    assert_eq!(names(&response.unwrap().resources).len(), 2);
}

/// Flags for a gateway dialling the fake Galley at `url` over TLS, trusting
/// `ca_path`, subscribed to VS, reconnecting quickly.
fn https_upstream<'a>(url: &'a str, ca_path: &'a str) -> [&'a str; 10] {
    [
        "--upstream",
        url,
        "--collections",
        VS,
        "--upstream-ca",
        ca_path,
        "--upstream-server-name",
        "localhost",
        "--reconnect-min-delay",
        "10ms",
    ]
}

fn galley_tls(ca: &Ca, galley: &Leaf) -> ServerTlsConfig {
    ServerTlsConfig::new()
        .identity(Identity::from_pem(&galley.cert, &galley.key))
        .client_ca_root(Certificate::from_pem(&ca.pem))
}

#[tokio::test]
async fn the_upstream_is_dialled_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("galley-ca");
    let mut galley = FakeGalley::start_tls(galley_tls(&ca, &ca.leaf("galley"))).await;
    let url = format!("https://{}", galley.addr);
    let ca_path = path(&write(dir.path(), "ca.pem", &ca.pem));
    let (cert, key) = write_leaf(dir.path(), "gateway", &ca.leaf("gateway"));
    let (cert, key) = (path(&cert), path(&key));
    let upstream_flags = https_upstream(&url, &ca_path);

    let gw = start_gateway(&[&upstream_flags[..], &["--upstream-cert", &cert, "--upstream-key", &key]].concat()).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 1);
    assert!(gw.upstream.borrow().connected);

    // Without a client certificate, Galley refuses the gateway, and the
    // gateway says so and keeps retrying with backoff.
    let without_cert = start_gateway(&upstream_flags).await;
    eventually("the refusal to be reported", || {
        let status = without_cert.upstream.borrow();
        status.attempts >= 2 && status.last_error.is_some()
    })
    .await;
    assert!(!without_cert.upstream.borrow().connected);
    let error = without_cert.upstream.borrow().last_error.clone().unwrap();
    assert!(
        error.contains("requires a client certificate (mTLS; TLS alert certificate_required)")
            && error.contains("give --upstream-cert and --upstream-key"),
        "the refusal named: {error}"
    );
    assert_eq!(
        galley.streams_opened(),
        1,
        "only the gateway with a certificate got through"
    );
}

#[tokio::test]
async fn galleys_dial_out_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = tls_gateway(
        dir.path(),
        &ca,
        true,
        &["--sink-listen", "127.0.0.1:0", "--collections", VS],
    )
    .await;
    let sink = gw.sink.unwrap();

    let anonymous = match tls_channel(sink, &ca.pem, None).await {
        Ok(channel) => dial_out(channel, &[]).await.err(),
        Err(_) => None,
    };
    if let Some(status) = &anonymous {
        assert_ne!(status.code(), tonic::Code::Ok);
    }
    assert_eq!(
        gw.upstream.borrow().attempts,
        0,
        "a source without a certificate never got a stream"
    );

    let channel = tls_channel(sink, &ca.pem, Some(&ca.leaf("galley"))).await.unwrap();
    let mut galley = dial_out(channel, &[])
        .await
        .expect("a source with a certificate is accepted");
    galley.initial_requests(1).await;
    galley.push_full(VS, vec![resource("a", "1", b"a")]).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 1);
}

#[tokio::test]
async fn a_certificate_rotated_on_disk_is_used_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = Ca::new("old-ca");
    let new_ca = Ca::new("new-ca");
    let gw = tls_gateway(dir.path(), &old_ca, false, &[]).await;
    assert!(first_response(tls_channel(gw.listen, &old_ca.pem, None).await)
        .await
        .is_ok());
    assert!(first_response(tls_channel(gw.listen, &new_ca.pem, None).await)
        .await
        .is_err());

    // cert-manager writes the new pair over the old files.
    write_leaf(dir.path(), "server", &new_ca.leaf("gateway"));
    within("the rotated certificate to be served", async {
        loop {
            if first_response(tls_channel(gw.listen, &new_ca.pem, None).await)
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn unusable_certificate_files_are_start_up_errors_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("ca");
    let (cert, _) = write_leaf(dir.path(), "one", &ca.leaf("one"));
    let (_, other_key) = write_leaf(dir.path(), "two", &ca.leaf("two"));
    let junk = write(dir.path(), "junk.pem", "junk");
    let (cert, other_key, junk) = (path(&cert), path(&other_key), path(&junk));
    for (flags, flag) in [
        (vec!["--tls-cert", &cert, "--tls-key", &other_key], "--tls-key"),
        (vec!["--tls-cert", &junk, "--tls-key", &other_key], "--tls-cert"),
        (vec!["--tls-cert", &cert, "--tls-key", &junk], "--tls-key"),
        (
            vec![
                "--tls-cert",
                &cert,
                "--tls-key",
                &other_key,
                "--client-ca",
                "/nonexistent/ca.pem",
            ],
            "--client-ca",
        ),
        (
            vec![
                "--upstream",
                "https://galley:9901",
                "--upstream-cert",
                &cert,
                "--upstream-key",
                &junk,
            ],
            "--upstream-key",
        ),
        (
            vec!["--upstream", "https://galley:9901", "--upstream-cert", &cert],
            "--upstream-key",
        ),
    ] {
        let args = Args::try_parse_from(std::iter::once("mcp-xds-gateway").chain(flags.iter().copied())).unwrap();
        let error = args.validate().unwrap_err().to_string();
        assert!(error.starts_with(flag), "{flags:?}: {error}");
    }
}

#[tokio::test]
async fn the_upstream_client_rereads_its_files_on_every_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = Ca::new("old-galley-ca");
    let new_ca = Ca::new("new-galley-ca");
    // Galley already serves a certificate from the new CA; the gateway still
    // trusts only the old one.
    let mut galley = FakeGalley::start_tls(ServerTlsConfig::new().identity({
        let leaf = new_ca.leaf("galley");
        Identity::from_pem(&leaf.cert, &leaf.key)
    }))
    .await;
    let url = format!("https://{}", galley.addr);
    let ca_path = path(&write(dir.path(), "ca.pem", &old_ca.pem));
    let gw = start_gateway(&[&https_upstream(&url, &ca_path)[..], &["--reconnect-max-delay", "50ms"]].concat()).await;
    eventually("an attempt refused for the certificate", || {
        gw.upstream.borrow().last_error.is_some()
    })
    .await;
    assert_eq!(galley.streams_opened(), 0);
    let error = gw.upstream.borrow().last_error.clone().unwrap();
    assert!(
        error.contains("the server's certificate is not signed by a CA in --upstream-ca"),
        "{error}"
    );

    // The CA bundle rotates on disk: the next attempt uses it.
    write(dir.path(), "ca.pem", &new_ca.pem);
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    assert!(gw.upstream.borrow().connected);
}

/// `client --once --timeout 5s --type-url VS --target TARGET EXTRA…`.
async fn client_at(target: &str, extra: &[&str]) -> (Option<i32>, String, String) {
    let mut args = vec!["--target", target, "--type-url", VS, "--once", "--timeout", "5s"];
    args.extend_from_slice(extra);
    crate::operating::subcommand("client", &args).await
}

/// The `client` command names why TLS failed, whichever side refused what,
/// and exits 1 (a failed dial, as documented) well within `--timeout`: the
/// suite's wait (`subcommand`) is the bound; no timing is asserted.
#[tokio::test]
async fn the_client_command_names_the_tls_cause() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = tls_gateway(dir.path(), &ca, true, &[]).await;
    let plain = crate::helpers::start_gateway(&[]).await;
    let ca_path = path(&write(dir.path(), "ca.pem", &ca.pem));
    let other_ca = path(&write(dir.path(), "other-ca.pem", &Ca::new("other-ca").pem));
    let leaf = |name: &str, leaf: &Leaf| {
        let (cert, key) = write_leaf(dir.path(), name, leaf);
        (path(&cert), path(&key))
    };
    let (good, good_key) = leaf("good", &ca.leaf("pilot"));
    let (server_only, server_only_key) = leaf("server-only", &ca.server_only_leaf("pilot"));
    let (own, own_key) = leaf("own", &self_signed_leaf("pilot"));
    let expired = ca.expired_spiffe_leaf("spiffe://cluster.local/ns/istio-system/sa/pilot");
    let (expired, expired_key) = leaf("expired", &expired);
    let target = gw.listen.to_string();

    let (code, stdout, stderr) = client_at(&target, &["--ca", &ca_path, "--cert", &good, "--key", &good_key]).await;
    assert_eq!(code, Some(0), "the allowed client is served: {stderr}");
    assert!(stdout.contains("resources=2"), "{stdout}");

    for (what, flags, said) in [
        (
            "a serverAuth-only client certificate",
            vec!["--ca", &ca_path, "--cert", &server_only, "--key", &server_only_key],
            vec![
                "TLS alert unsupported_certificate",
                "does not allow client authentication (clientAuth), only serverAuth",
            ],
        ),
        (
            "a self-signed client certificate",
            vec!["--ca", &ca_path, "--cert", &own, "--key", &own_key],
            vec!["TLS alert unknown_ca", "it is self-signed (CN=pilot)"],
        ),
        (
            "an expired client certificate",
            vec!["--ca", &ca_path, "--cert", &expired, "--key", &expired_key],
            vec!["TLS alert certificate_expired", "it expired on"],
        ),
        (
            "no client certificate",
            vec!["--ca", &ca_path],
            vec!["requires a client certificate", "give --cert and --key"],
        ),
        (
            "a CA that did not sign the gateway's certificate",
            vec!["--ca", &other_ca, "--cert", &good, "--key", &good_key],
            vec!["the server's certificate is not signed by a CA in --ca", "(unknown CA)"],
        ),
        (
            "a name the gateway's certificate does not carry",
            vec![
                "--ca",
                &ca_path,
                "--cert",
                &good,
                "--key",
                &good_key,
                "--server-name",
                "gateway.example",
            ],
            vec!["does not carry the name dialled", "--server-name"],
        ),
        (
            "plaintext against the mTLS port",
            vec![],
            vec!["the server speaks TLS", "give an https:// --target or --ca"],
        ),
    ] {
        let (code, _, stderr) = client_at(&target, &flags).await;
        assert_eq!(code, Some(1), "{what}: {stderr}");
        for said in said {
            assert!(stderr.contains(said), "{what}: {said:?} in {stderr}");
        }
        assert!(!stderr.contains("timed out"), "{what}: {stderr}");
    }

    // TLS against a plaintext port.
    let target = plain.listen.to_string();
    let (code, _, stderr) = crate::operating::subcommand(
        "client",
        &["--target", &target, "--ca", &ca_path, "--type-url", VS, "--once"],
    )
    .await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("the server speaks plaintext HTTP/2, not TLS") && stderr.contains("give an http:// --target"),
        "{stderr}"
    );
    // A file the client cannot use is a usage error naming its flag.
    let (code, _, stderr) = crate::operating::subcommand(
        "client",
        &["--target", &target, "--ca", "/nonexistent.pem", "--type-url", VS],
    )
    .await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--ca /nonexistent.pem"), "{stderr}");
}
