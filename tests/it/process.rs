//! The real binary: flags validated at start-up, port 0, the bound addresses
//! in one log line, and SIGTERM.

use tokio::process::Command;

use mcp_xds_gateway::source::persisted;

use crate::helpers::clients::sotw;
use crate::helpers::galley::{resource, FakeGalley};
use crate::helpers::{
    eventually, eventually_async, get_json, http_get, http_request, names, spawn_gateway, within, Running, GW, VS,
};

const BIN: &str = env!("CARGO_BIN_EXE_mcp-xds-gateway");

/// Runs the binary to its exit: (exit code, stderr).
pub(crate) async fn run(args: &[&str]) -> (Option<i32>, String) {
    run_with_env(args, &[]).await
}

async fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let (code, _, stderr) = run_whole(args, env).await;
    (code, stderr)
}

/// Runs the binary to its exit: (exit code, stdout: the log, stderr).
async fn run_whole(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let output = within(
        "the gateway to exit",
        Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run the gateway binary");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The tools' `--admin` defaults to the admin port's default address: the
/// test holds 127.0.0.1:15000 itself and sees the tool's request arrive
/// there. A port taken by something else fails the test, saying so: a
/// check that cannot run is not a pass.
#[tokio::test]
async fn the_tools_dial_the_default_admin_port() {
    let admin = tokio::net::TcpListener::bind("127.0.0.1:15000")
        .await
        .unwrap_or_else(|e| panic!("127.0.0.1:15000, the admin port's default, must be free for this test: {e}"));
    let tool = tokio::spawn(run(&["rollout", "status"]));
    let request = within("the tool's request on 127.0.0.1:15000", async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut conn, _) = admin.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).await.unwrap() == 1 {
            head.push(byte[0]);
        }
        conn.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        String::from_utf8_lossy(&head).into_owned()
    })
    .await;
    assert!(request.starts_with("GET /"), "an HTTP request: {request}");
    // The answer is no admin port's: the tool exits 2 (the admin port
    // cannot be read), naming the address it dialed.
    let (code, stderr) = tool.await.unwrap();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains("127.0.0.1:15000"),
        "{stderr}"
    );
}

#[tokio::test]
async fn bad_flags_exit_non_zero_naming_the_flag() {
    for (args, flag) in [
        (&["--collections", "istio/nope"][..], "--collections"),
        (&["--upstream", "galley:9901"][..], "--upstream"),
        (&["--listen", "not-an-address"][..], "--listen"),
        (&["--keepalive-interval", "often"][..], "--keepalive-interval"),
        (&["--type-map", "/nonexistent/types.yaml"][..], "--type-map"),
        (&["--no-such-flag"][..], "--no-such-flag"),
        (
            &["--upstream", "http://g:1", "--sink-listen", "127.0.0.1:0"][..],
            "--sink-listen",
        ),
        (
            &[
                "--tls-cert",
                "/nonexistent/tls.crt",
                "--tls-key",
                "/nonexistent/tls.key",
            ][..],
            "--tls-cert",
        ),
        (&["--source-dir", "/nonexistent/config"][..], "--source-dir"),
        // Dial-out sources must be authenticated: the message names both ways.
        (&["--sink-listen", "127.0.0.1:0"][..], "--sink-insecure"),
        (&["--sink-listen", "127.0.0.1:0"][..], "--client-ca"),
        (&["--client-allow", "spiffe://x/*"][..], "--client-allow"),
        (&["--sink-allow", "spiffe://x/*", "--sink-insecure"][..], "--sink-allow"),
        (&["--max-connections", "0"][..], "--max-connections"),
        (&["--max-connections", "1000000000"][..], "--max-connections"),
        (&["--max-request-bytes", "10"][..], "--max-request-bytes"),
        (&["--handshake-timeout", "0s"][..], "--handshake-timeout"),
        (&["--canary", "canary-["][..], "--canary"),
        (&["--canary", "=x"][..], "--canary"),
        // Canaries rest on a proven identity: refused in plaintext, the
        // message naming the flag that would trust node ids instead.
        (&["--canary", "canary-*"][..], "--client-ca"),
        (&["--canary", "canary-*"][..], "--canary-trust-node-ids"),
        (&["--canary-trust-node-ids"][..], "--canary-trust-node-ids"),
        (&["--canary-soak", "2d"][..], "--canary-soak"),
        (&["--demand-timeout", "0s"][..], "--demand-timeout"),
        (&["--demand-timeout", "2h"][..], "--demand-timeout"),
        (&["--canary-when-none", "maybe"][..], "--canary-when-none"),
        // The rollout command's bad usage.
        (
            &["rollout", "pin", "istio/networking/v1alpha3/virtualservices"][..],
            "<VERSION>",
        ),
        (&["rollout", "diff"][..], "<COLLECTION>"),
        (&["rollout", "rewind", "x"][..], "rewind"),
        (
            &["rollout", "status", "--admin", "https://127.0.0.1:15000"][..],
            "--admin",
        ),
        (&["status", "--admin", "http://127.0.0.1:15000/debug"][..], "--admin"),
    ] {
        let (code, stderr) = run(args).await;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?} should name {flag}: {stderr}");
    }
}

#[tokio::test]
async fn a_taken_port_is_a_start_up_error_naming_the_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stderr) = run(&[
        "--listen",
        &addr,
        "--admin-listen",
        "127.0.0.1:0",
        "--monitoring-listen",
        "127.0.0.1:0",
    ])
    .await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--listen") && stderr.contains(&addr), "{stderr}");
    assert_eq!(stderr.matches("in use").count(), 1, "the cause once: {stderr}");
}

#[tokio::test]
async fn start_up_errors_name_the_flag_or_file_and_exit_2() {
    // (An unusable --cache-dir: a_failed_start_prints_one_line_and_logs_nothing.)
    let dir = tempfile::tempdir().unwrap();

    // A certificate file whose PEM block is not a certificate: the message
    // names that file, not only the key.
    let cert = dir.path().join("tls.crt");
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let key_path = dir.path().join("tls.key");
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let cert = cert.to_str().unwrap().to_owned();
    let (code, stderr) = run(&["--tls-cert", &cert, "--tls-key", key_path.to_str().unwrap()]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--tls-cert") && stderr.contains(&cert) && stderr.contains("X.509"),
        "{stderr}"
    );

    // A --descriptors file that is not a descriptor set.
    let (code, stderr) = run(&["--descriptors", &cert]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--descriptors") && stderr.contains("FileDescriptorSet"),
        "{stderr}"
    );

    // An invalid --type-map row names the flag and the file.
    let map = dir.path().join("types.yaml");
    std::fs::write(&map, "istio/x/y: [not, a, type url]\n").unwrap();
    let map = map.to_str().unwrap().to_owned();
    let (code, stderr) = run(&["--type-map", &map]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--type-map") && stderr.contains(&map), "{stderr}");

    // --canary rests on a proven identity: without mTLS, without a policy,
    // or with a policy that lets no identity be a canary, it is refused,
    // naming the flag and the flag that would trust node ids instead.
    use crate::helpers::certs::{write, write_leaf, Ca};
    let ca = Ca::new("canary flags CA");
    let (cert, key) = write_leaf(dir.path(), "gateway", &ca.leaf("gateway"));
    let ca_path = write(dir.path(), "ca.pem", &ca.pem);
    let policy = write(
        dir.path(),
        "policy.yaml",
        "rules:\n- identities: [\"spiffe://cluster.local/*\"]\n  collections: [\"istio/*\"]\n",
    );
    let [cert, key, ca_path, policy] = [cert, key, ca_path, policy].map(|p| p.to_str().unwrap().to_owned());
    let mtls = ["--tls-cert", &cert, "--tls-key", &key, "--client-ca", &ca_path];
    let canary = ["--canary", "canary-*"];
    for (args, says) in [
        (canary.to_vec(), "without --client-ca no client proves an identity"),
        ([&mtls[..], &canary].concat(), "none is given"),
        (
            [&mtls[..], &["--access-policy", &policy], &canary].concat(),
            "no rule of --access-policy has `canary: true`",
        ),
    ] {
        let (code, stderr) = run(&args).await;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--canary:") && stderr.contains(says) && stderr.contains("--canary-trust-node-ids"),
            "{args:?}: {stderr}"
        );
    }
}

/// A failed start prints its one error and nothing else: every flag is
/// checked (a taken port and an unusable --cache-dir included) before the
/// first log line, and warnings wait until the start succeeded.
#[tokio::test]
async fn a_failed_start_prints_one_line_and_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let file = file.to_str().unwrap().to_owned();
    let below = format!("{file}/below");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    // A certificate that does not load: a PEM block that is not one.
    let cert = dir.path().join("tls.crt");
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
    let key = dir.path().join("tls.key");
    std::fs::write(&key, rcgen::KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let (cert, key) = (cert.to_str().unwrap().to_owned(), key.to_str().unwrap().to_owned());
    // Flags that warn once the gateway runs: the warnings must not come first.
    let warned = ["--keepalive-interval", "5s"];
    let cases: [(Vec<&str>, &str); 6] = [
        (
            vec!["--upstream", "http://127.0.0.1:1", "--cache-dir", &file],
            "--cache-dir",
        ),
        (
            vec!["--upstream", "http://127.0.0.1:1", "--cache-dir", &below],
            "--cache-dir",
        ),
        (vec!["--demo", "--admin-listen", &taken], "--admin-listen"),
        (vec!["--sink-listen", &taken, "--sink-insecure"], "--sink-listen"),
        (vec!["--max-connections", "0"], "--max-connections"),
        (vec!["--tls-cert", &cert, "--tls-key", &key], "--tls-cert"),
    ];
    for (flags, flag) in cases {
        // Every port on 127.0.0.1:0 but the one the case takes.
        let mut args: Vec<&str> = crate::helpers::LOOPBACK_PORTS
            .chunks(2)
            .filter(|pair| !flags.contains(&pair[0]))
            .flatten()
            .copied()
            .collect();
        args.extend_from_slice(&warned);
        args.extend_from_slice(&flags);
        let (code, stdout, stderr) = run_whole(&args, &[]).await;
        assert_eq!(code, Some(2), "{flags:?}: {stderr}");
        assert_eq!(stdout, "", "{flags:?}: nothing is logged before the error");
        assert_eq!(stderr.lines().count(), 1, "{flags:?}: one line: {stderr}");
        assert!(stderr.starts_with(&format!("error: {flag}")), "{flags:?}: {stderr}");
        if flag == "--cache-dir" {
            assert!(stderr.contains(&file), "names the directory: {stderr}");
        }
        if flags.contains(&taken.as_str()) {
            assert!(stderr.contains(&taken), "names the address: {stderr}");
        }
        if flag == "--tls-cert" {
            assert!(stderr.contains(&cert), "names the file: {stderr}");
        }
    }

    // Started: the warning is logged after the effective configuration.
    let Running { mut child, log, .. } = spawn(&["--keepalive-interval", "5s"]).await;
    let at = |needle: &str| log.iter().position(|l| l.contains(needle));
    let effective = at("effective configuration").expect("the effective configuration");
    let warning = at("--keepalive-interval 5s is below Galley's 30s minimum").expect("the warning");
    assert!(effective < warning, "{log:?}");
    let _ = child.start_kill();
}

/// The binary started on port 0 from the package root.
async fn spawn(args: &[&str]) -> Running {
    spawn_gateway(None, args).await
}

#[tokio::test]
async fn serves_on_port_zero_and_exits_cleanly_on_sigterm() {
    let mut galley = FakeGalley::start().await;
    let Running {
        mut child,
        listen,
        admin,
        log,
        ..
    } = spawn(&["--collections", VS, "--upstream", &galley.url()]).await;
    let effective_config_lines: Vec<&String> = log.iter().filter(|l| l.contains("effective configuration")).collect();
    assert_ne!(listen.port(), 0);
    assert_ne!(admin.port(), 0);
    assert_eq!(
        effective_config_lines.len(),
        1,
        "the effective configuration is logged once, before listening"
    );
    let line = &effective_config_lines[0];
    assert!(line.contains(&galley.url()) && line.contains(VS), "{line}");

    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(listen).await;
    client.subscribe(VS);
    assert_eq!(names(&client.recv().await.resources), ["a"]);

    let pid = child.id().unwrap().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().await.unwrap();
    assert!(killed.success());
    let status = within("the gateway to exit after SIGTERM", child.wait()).await.unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(client.end_status().await.code(), tonic::Code::Unavailable);
}

/// A SIGTERM sent the moment the "listening" line is read (a supervisor's
/// stop right after start) is a clean stop: the handlers are in place
/// before that line, not after it.
#[tokio::test]
async fn a_sigterm_right_after_the_listening_line_is_a_clean_stop() {
    for round in 0..5 {
        let Running { mut child, .. } = spawn(&["--demo"]).await;
        let pid = child.id().unwrap() as i32;
        // SAFETY: kill(2) on the pid of a child this test started and has
        // not reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = within("the gateway to exit after SIGTERM", child.wait()).await.unwrap();
        assert!(status.success(), "round {round}: {status}");
    }
}

#[tokio::test]
async fn the_persisted_cache_survives_a_hard_kill_with_upstream_down() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().to_str().unwrap().to_owned();
    let mut galley = FakeGalley::start().await;
    let url = galley.url();
    let flags = ["--collections", VS, "--upstream", &url, "--cache-dir", &cache_dir];
    let mut first = spawn(&flags).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "2", b"b")])
        .await;
    let mut client = sotw(first.listen).await;
    client.subscribe(VS);
    let served = client.recv().await;
    eventually("the collection to reach the disk", || {
        persisted::peek(dir.path(), VS).is_ok_and(|m| m.system_version_info == served.version_info)
    })
    .await;

    // SIGKILL: no shutdown path runs. Then Galley goes away too.
    within("the gateway to be killed", first.child.kill()).await.unwrap();
    galley.stop().await;

    let second = spawn(&flags).await;
    let (code, body) = http_get(second.admin, "/readyz").await;
    assert_eq!(code, 200, "ready from the disk: {body}");
    let mut client = sotw(second.listen).await;
    client.subscribe(VS);
    let restored = client.recv().await;
    assert_eq!(restored.version_info, served.version_info);
    assert_eq!(names(&restored.resources), ["a", "b"]);
    assert_eq!(restored.resources, served.resources);
}

#[tokio::test]
async fn environment_fallbacks_are_read_and_validated_like_flags() {
    let env = [
        (
            "MCP_GATEWAY_COLLECTIONS",
            "istio/networking/v1alpha3/gateways,istio/nope",
        ),
        ("MCP_GATEWAY_LISTEN", "127.0.0.1:0"),
        ("MCP_GATEWAY_ADMIN_LISTEN", "127.0.0.1:0"),
        ("MCP_GATEWAY_MONITORING_LISTEN", "127.0.0.1:0"),
    ];
    let (code, stderr) = run_with_env(&[], &env).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--collections") && stderr.contains("istio/nope"),
        "{stderr}"
    );

    let (code, stderr) = run_with_env(&[], &[("MCP_GATEWAY_KEEPALIVE_INTERVAL", "sometimes")]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--keepalive-interval"), "{stderr}");
}

/// A fresh process exports every documented counter at 0 before anything
/// happened, so alerts on their rate see the first event.
#[tokio::test]
async fn every_documented_counter_is_exported_at_zero_from_start() {
    let galley = FakeGalley::start().await;
    let Running { mut child, admin, .. } = spawn(&["--collections", VS, "--upstream", &galley.url()]).await;
    let (status, body) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    let value = |series: &str| -> Option<f64> {
        body.lines()
            .find_map(|line| line.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
    };
    let mut expected: Vec<String> = vec![
        "istio_mcp_reconnections{component=\"upstream\"}".into(),
        "mcp_gateway_source_files_broken".into(),
        "mcp_gateway_sink_refusals_total{reason=\"another_source\"}".into(),
        "mcp_gateway_nack_messages_truncated_total".into(),
        format!("mcp_gateway_upstream_refused_collections_total{{collection=\"{VS}\"}}"),
        format!("mcp_gateway_cache_write_failures_total{{collection=\"{VS}\"}}"),
        format!("istio_mcp_request_nacks_total{{component=\"downstream\",collection=\"{VS}\",code=\"3\"}}"),
        format!("istio_mcp_request_nacks_total{{component=\"upstream\",collection=\"{VS}\",code=\"3\"}}"),
        "istio_mcp_send_failures_total{component=\"upstream\",code=\"14\"}".into(),
        "istio_mcp_clients_total{component=\"downstream\"}".into(),
        format!("mcp_gateway_updates_applied_total{{collection=\"{VS}\",kind=\"full\"}}"),
        format!("mcp_gateway_downstream_stale_requests_total{{collection=\"{VS}\"}}"),
        "mcp_gateway_peers_not_allowed_total{listener=\"--sink-listen\"}".into(),
        "mcp_gateway_upstream_stream_terminations_total{reason=\"message_too_large\"}".into(),
    ];
    for limit in mcp_xds_gateway::metrics::LIMITS {
        expected.push(format!("mcp_gateway_limit_refusals_total{{limit=\"{limit}\"}}"));
    }
    for series in &expected {
        assert_eq!(value(series), Some(0.0), "{series} at 0 from start");
    }
    let _ = child.start_kill();
}

/// Metric names the docs mention (README.md and docs/*.md): every
/// `istio_mcp_…`, `mcp_gateway_…` and `process_…` token.
fn documented_series() -> std::collections::BTreeSet<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    if let Ok(docs) = std::fs::read_dir(root.join("docs")) {
        files.extend(
            docs.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "md")),
        );
    }
    files
        .iter()
        .flat_map(|file| crate::operating::queried(&std::fs::read_to_string(file).unwrap()))
        // `mcp_gateway_*` names a family of names, not one.
        .filter(|name| !name.ends_with('_'))
        .collect()
}

/// A fresh process (dial-out mode, no source connected: nothing happened)
/// exports every series the docs name, every per-collection series for each
/// configured collection, at 0 but for what is never 0 (the build info, the
/// scrape's own connection, the process's figures).
#[tokio::test]
async fn every_documented_series_exists_at_zero_from_start() {
    let collections = format!("{VS},{GW}");
    let Running { mut child, admin, .. } = spawn(&[
        "--collections",
        &collections,
        "--sink-listen",
        "127.0.0.1:0",
        "--sink-insecure",
    ])
    .await;
    let (status, body) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    let samples: Vec<(&str, &str, f64)> = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| body.contains(&format!("# TYPE {f} histogram")))
                .unwrap_or(name);
            (family, series, value.parse().unwrap())
        })
        .collect();
    let families: std::collections::BTreeSet<&str> = samples.iter().map(|(f, _, _)| *f).collect();
    let documented = documented_series();
    assert!(documented.len() > 40, "{documented:?}");
    // The `source` command's own series (its dial-out to a sink) are its,
    // not the gateway's: tests/it/source_command.rs reads them there. The
    // skew's series are per generation in use, each at 0 from the moment a
    // client of that generation connects (none has here): tests/it/skew.rs.
    let missing: Vec<&String> = documented
        .iter()
        .filter(|n| !n.starts_with("mcp_gateway_dial_out_") && *n != "mcp_gateway_skew_resources")
        .filter(|n| !families.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "documented, not exported at start: {missing:?}\n{body}"
    );
    // A family with a collection label has a series for each configured one.
    for family in &families {
        let labelled: Vec<&str> = samples
            .iter()
            .filter(|(f, series, _)| f == family && series.contains("collection=\""))
            .map(|(_, series, _)| *series)
            .collect();
        if labelled.is_empty() {
            continue;
        }
        for collection in [VS, GW] {
            assert!(
                labelled
                    .iter()
                    .any(|s| s.contains(&format!("collection=\"{collection}\""))),
                "{family} has no series for {collection}: {labelled:?}"
            );
        }
    }
    for (family, series, value) in &samples {
        // The runtime's tasks: its listeners and the scrape itself, never 0;
        // its workers ran out of work before the scrape came (they waited
        // for it), so their waits are never 0 either.
        let tasks = *family == "mcp_gateway_runtime_tasks" || *family == "mcp_gateway_worker_idle_waits_total";
        // The allocator's figures, read (and trimmed) from the start.
        let allocator = family.starts_with("mcp_gateway_heap_") || family.starts_with("mcp_gateway_memory_");
        let never_zero = family.starts_with("process_")
            || allocator
            || *family == "mcp_gateway_build_info"
            || tasks
            || series.starts_with("mcp_gateway_connections{listener=\"--admin-listen\"");
        if tasks {
            assert!(*value > 0.0, "{series}: a running gateway has tasks");
        } else if !never_zero {
            assert_eq!(*value, 0.0, "{series} at 0 from start");
        }
    }
    let _ = child.start_kill();
}

/// The heap a burst of clients freed goes back to the kernel once they
/// left (glibc keeps it otherwise): 100 clients, each on a connection of
/// its own (h2's buffers, the stream's state: tens of KiB each), synced and
/// gone; the next check finds the freed heap resident, trims, and counts
/// what the process's RSS fell by.
#[tokio::test]
async fn freed_memory_goes_back_to_the_kernel_after_a_burst() {
    let mut galley = FakeGalley::start().await;
    let Running {
        mut child,
        listen,
        admin,
        ..
    } = spawn(&[
        "--collections",
        VS,
        "--upstream",
        &galley.url(),
        "--memory-trim-interval",
        "100ms",
        "--max-new-streams-per-second",
        "100000",
    ])
    .await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    let bodies: Vec<_> = (0..200)
        .map(|i| resource(&format!("vs-{i}"), "1", &vec![b'x'; 512]))
        .collect();
    upstream.push_full(VS, bodies).await;
    let series = |body: &str, name: &str| -> f64 {
        body.lines()
            .find_map(|line| line.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("{name} in /metrics"))
    };
    // The allocator's figures are read: the binary installed glibc's calls.
    eventually_async("the heap in use to be read", || async {
        series(&http_get(admin, "/metrics").await.1, "mcp_gateway_heap_in_use_bytes ") > 0.0
    })
    .await;

    let mut clients = Vec::new();
    for _ in 0..100 {
        let client = sotw(listen).await;
        client.subscribe(VS);
        clients.push(client);
    }
    for client in &mut clients {
        assert_eq!(client.recv().await.resources.len(), 200);
    }
    let before = http_get(admin, "/metrics").await.1;
    let (trims, returned) = (
        series(&before, "mcp_gateway_memory_trims_total "),
        series(&before, "mcp_gateway_memory_returned_bytes_total "),
    );
    drop(clients);
    eventually_async("the freed heap to go back to the kernel", || async {
        let body = http_get(admin, "/metrics").await.1;
        series(&body, "mcp_gateway_memory_trims_total ") > trims
            && series(&body, "mcp_gateway_memory_returned_bytes_total ") >= returned + 1024.0 * 1024.0
    })
    .await;
    let _ = child.start_kill();
}

#[tokio::test]
async fn a_trim_interval_below_the_minimum_is_refused_naming_the_flag() {
    let (code, stderr) = run(&["--demo", "--memory-trim-interval", "10ms"]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--memory-trim-interval") && stderr.contains("100ms"),
        "{stderr}"
    );
}

/// Outside a checkout, with no source flag, the gateway does not serve the
/// example config to whoever connects: it exits 2 naming the source flags.
/// `--demo` serves the compiled-in copy, says so, and labels its metrics.
#[tokio::test]
async fn the_compiled_in_examples_are_served_only_with_demo() {
    let elsewhere = tempfile::tempdir().unwrap();
    let output = within(
        "the gateway to exit",
        Command::new(BIN)
            .current_dir(elsewhere.path())
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    for flag in ["--upstream", "--sink-listen", "--source-dir", "--demo"] {
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }

    let Running {
        mut child, admin, log, ..
    } = spawn_gateway(Some(elsewhere.path()), &["--demo"]).await;
    let warned = log.iter().any(|line| line.contains("WARN") && line.contains("--demo"));
    assert!(warned, "a warning before serving");
    let (_, metrics) = http_get(admin, "/metrics").await;
    let samples: Vec<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    assert!(!samples.is_empty());
    assert!(samples.iter().all(|l| l.contains("demo=\"true\"")), "{metrics}");
    child.kill().await.unwrap();
}

/// `/debug/config`: every flag, its value and where it came from; `POST
/// /logging` changes the log filter at run time, and says why not.
#[tokio::test]
async fn the_effective_configuration_and_the_log_filter_at_run_time() {
    let galley = FakeGalley::start().await;
    let Running { child, admin, .. } = crate::helpers::spawn_gateway_with_env(
        None,
        &["--upstream", &galley.url(), "--collections", VS],
        &[("MCP_GATEWAY_STALE_AFTER", "45s")],
    )
    .await;
    let config = crate::helpers::get_json(admin, "/debug/config").await;
    let flag = |name: &str| {
        config["flags"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["flag"] == name)
            .unwrap_or_else(|| panic!("{name} in {config}"))
            .clone()
    };
    assert_eq!(flag("--upstream")["source"], "command line");
    assert_eq!(flag("--upstream")["value"], galley.url());
    assert_eq!(flag("--stale-after")["source"], "environment (MCP_GATEWAY_STALE_AFTER)");
    assert_eq!(flag("--stale-after")["value"], "45s");
    assert_eq!(flag("--shutdown-grace")["source"], "default");
    assert!(flag("--cache-dir")["value"].is_null());
    assert_eq!(config["log_filter"], "info,h2=error");
    // A flag left out shows the value it took.
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    assert_eq!(flag("--node-id")["value"], host.as_str(), "{config}");
    assert_eq!(flag("--node-id")["source"], "default (this host's name)");
    assert_eq!(flag("--collections")["value"], VS);
    assert!(flag("--max-connections")["value"]
        .as_str()
        .is_some_and(|n| n.parse::<usize>().is_ok()));
    assert!(flag("--source-dir")["value"].is_null(), "{config}");
    assert_eq!(flag("--log-level")["value"], "info,h2=error");

    let (status, said) = crate::helpers::http_request(admin, "POST", "/logging?level=debug", "").await;
    assert_eq!(status, 200, "{said}");
    let config = crate::helpers::get_json(admin, "/debug/config").await;
    assert_eq!(config["log_filter"], "debug");
    let log_level = config["flags"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["flag"] == "--log-level")
        .unwrap();
    assert_eq!(
        (&log_level["value"], &log_level["source"]),
        (&"debug".into(), &"POST /logging".into()),
        "{config}"
    );
    let (status, said) = crate::helpers::http_request(admin, "POST", "/logging?level=%5Bnot", "").await;
    assert_eq!(status, 400, "{said}");
    assert!(said.contains("is not a log filter"), "{said}");
    assert_eq!(
        crate::helpers::get_json(admin, "/debug/config").await["log_filter"],
        "debug"
    );
    drop(child);

    // Run from a checkout with no source flag: the example directory is
    // served, and /debug/config says so.
    let Running { child, admin, .. } = spawn(&[]).await;
    let config = crate::helpers::get_json(admin, "/debug/config").await;
    let source_dir = config["flags"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["flag"] == "--source-dir")
        .unwrap()
        .clone();
    assert_eq!(source_dir["value"], "examples/config", "{config}");
    assert!(
        source_dir["source"]
            .as_str()
            .unwrap()
            .starts_with("default (./examples/config exists"),
        "{config}"
    );
    drop(child);
}

/// The rollout's warnings reach the log: a version released to everyone
/// with no canary connected (`--canary-when-none=proceed`), and a pin.
#[tokio::test]
async fn releases_without_a_canary_and_pins_are_logged_as_warnings() {
    let mut galley = FakeGalley::start().await;
    let mut gw = spawn(&[
        "--collections",
        VS,
        "--upstream",
        &galley.url(),
        "--canary",
        "canary-*",
        "--canary-trust-node-ids",
    ])
    .await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    upstream.push_full(VS, vec![resource("a", "2", b"b")]).await;
    let line = gw
        .log_line("released to everyone without a canary connected (--canary-when-none=proceed)")
        .await;
    assert!(line.contains("WARN") && line.contains(VS), "{line}");

    // A canary's NACK holds the next version: said with its node and message.
    use crate::canary::request_as;
    let mut canary = sotw(gw.listen).await;
    canary.send(request_as("canary-1", VS, "", "", None));
    let first = canary.recv().await;
    canary.send(request_as("canary-1", VS, &first.version_info, &first.nonce, None));
    upstream.push_full(VS, vec![resource("a", "3", b"c")]).await;
    let offered = canary.recv().await;
    canary.send(request_as(
        "canary-1",
        VS,
        &first.version_info,
        &offered.nonce,
        Some("route a: no such host"),
    ));
    let line = gw.log_line("a canary NACKed this version").await;
    assert!(
        line.contains("WARN") && line.contains("canary-1") && line.contains("route a: no such host"),
        "{line}"
    );

    let view = get_json(gw.admin, &format!("/debug/rollout/{VS}")).await;
    let latest = view["latest"].as_str().expect("a latest version").to_owned();
    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={latest}"), "").await;
    assert_eq!(code, 200, "{body}");
    let line = gw.log_line("collection pinned").await;
    assert!(line.contains("WARN") && line.contains(&latest), "{line}");
}

/// `RUST_LOG=trace` with the log written into the directory the gateway
/// watches: the file watcher's own trace lines (one per file event, so one
/// per line the log gets) are capped at debug, or the log would feed
/// itself without end and fill the disk.
#[tokio::test]
async fn a_trace_log_written_into_the_watched_directory_does_not_feed_itself() {
    let text = log_into_the_source_directory("gateway.log", Some("trace")).await;
    assert!(text.contains("TRACE"), "the gateway's own traces are on");
    assert!(
        !text.lines().any(|l| l.contains("TRACE") && l.contains("notify")),
        "{}",
        text.lines()
            .filter(|l| l.contains("notify"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The gateway's log written into the source directory under a YAML name
/// is not read as a source file (it would never parse, and each error
/// logged would change it): said once, and the rest is served.
#[tokio::test]
async fn the_gateways_own_log_in_the_source_directory_is_not_read() {
    let text = log_into_the_source_directory("gateway.yaml", None).await;
    assert_eq!(text.matches("is the gateway's own log").count(), 1, "{text}");
    assert!(!text.contains("does not parse"), "{text}");
}

/// Runs the gateway on a source directory with its log written into it as
/// `log_name` (`RUST_LOG` as given), adds a file the watcher sees, and
/// returns the log once that change is applied.
async fn log_into_the_source_directory(log_name: &str, rust_log: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config/networking.yaml");
    std::fs::copy(&example, src.join("networking.yaml")).unwrap();
    let log = src.join(log_name);
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "exec '{BIN}' --source-dir '{}' --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
             --monitoring-listen 127.0.0.1:0 > '{}' 2>&1",
            src.display(),
            log.display()
        ))
        .kill_on_drop(true);
    match rust_log {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    let mut child = command.spawn().unwrap();
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("the gateway to listen", || read().contains("gateway listening")).await;
    // A change the watcher sees, applied: every event before it was logged.
    let more = std::fs::read_to_string(&example).unwrap().replace("name: ", "name: x");
    std::fs::write(src.join("more.yaml"), more).unwrap();
    eventually("the change to be applied", || {
        read().contains("the source directory's change is applied")
    })
    .await;
    let text = read();
    child.start_kill().unwrap();
    within("the gateway to exit", child.wait()).await.unwrap();
    text
}
