//! mcp-load at a tiny size, every scenario, so the tool never rots. Numbers
//! are not asserted here (they live in BENCHMARKS.md); what is checked is that
//! each run completes against the real gateway binary with no NACKs, no stream
//! errors, and every client receiving every update.

use tokio::process::Command;

use crate::helpers::within;

/// Runs mcp-load against the gateway binary with `args`; it must succeed.
/// Its report (the last line of its output), parsed and as printed.
async fn mcp_load(args: &[&str]) -> (serde_json::Value, String) {
    let shown = format!("mcp-load {}", args.join(" "));
    let output = within(
        &shown,
        Command::new(env!("CARGO_BIN_EXE_mcp-load"))
            .args(args)
            .args(["--gateway", env!("CARGO_BIN_EXE_mcp-xds-gateway")])
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run mcp-load");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{shown}: {stdout}\n{stderr}");
    let json = stdout.lines().last().expect("a JSON line").to_owned();
    let report = serde_json::from_str(&json).expect("the last line is JSON");
    (report, json)
}

/// `object` reports a `times_wire` figure: a ratio, 0 where the gateway and
/// null where the writer took less than one clock tick of CPU (a tiny run's
/// few bytes; Linux counts CPU in 10 ms ticks). A missing field is not
/// reported.
fn reports_times_wire(object: &serde_json::Value) -> bool {
    match object.get("times_wire") {
        Some(serde_json::Value::Null) => true,
        Some(x) => x.as_f64().is_some_and(|x| x >= 0.0),
        None => false,
    }
}

/// Every scenario at a tiny size with the clients speaking `protocol`.
async fn every_scenario_runs_at_a_tiny_size_over(protocol: &str) {
    for scenario in ["big-config", "fan-out", "incremental", "idle"] {
        let (report, json) = mcp_load(&["--scenario", scenario, "--tiny", "--protocol", protocol]).await;
        assert_eq!(report["scenario"], scenario);
        assert_eq!(report["shape"]["protocol"], protocol, "{json}");
        assert_eq!(report["nacks"], 0, "{json}");
        assert_eq!(report["stream_errors"], 0, "{json}");
        let streams = report["streams"].as_u64().unwrap();
        let updates = report["updates_published"].as_u64().unwrap();
        assert!(streams > 0, "{json}");
        assert!(report["gateway_peak_rss_bytes"].as_u64().unwrap() > 0, "{json}");
        if scenario == "idle" {
            // The idle scenario measures streams at rest: it publishes nothing.
            assert_eq!(updates, 0, "{json}");
            // At rest, the RSS is read with what it is made of.
            let split = &report["gateway_rss_anon_file_per_stream_at_rest_bytes"];
            assert!(
                split
                    .as_array()
                    .is_some_and(|s| s.len() == 2 && s.iter().all(|b| b.as_f64().is_some_and(|b| b >= 0.0))),
                "{json}"
            );
        } else {
            // Every other scenario publishes (a tiny run: a few updates), so
            // a run that published nothing is a broken tool, not a pass.
            assert!(updates > 0, "{scenario} published no update: {json}");
            // Coalescing may skip versions, but every stream gets the last one.
            assert!(report["responses_delivered"].as_u64().unwrap() >= streams, "{json}");
        }
    }
}

#[tokio::test]
async fn every_scenario_runs_at_a_tiny_size() {
    every_scenario_runs_at_a_tiny_size_over("mcp").await;
}

/// The same over Envoy's v3 ADS: istiod-style GVK clients, SotW and delta.
#[tokio::test]
async fn every_scenario_runs_over_xds_at_a_tiny_size() {
    every_scenario_runs_at_a_tiny_size_over("xds-sotw").await;
    every_scenario_runs_at_a_tiny_size_over("xds-delta").await;
}

/// A named scenario at a tiny size over `protocol` with `flag`: it ran as
/// asked, with no NACK and no stream error. Its report, parsed and as
/// printed.
async fn tiny_named_run(scenario: &str, protocol: &str, flag: Option<&str>) -> (serde_json::Value, String) {
    let mut args = vec!["--scenario", scenario, "--tiny", "--protocol", protocol];
    args.extend(flag);
    let (report, json) = mcp_load(&args).await;
    assert_eq!(report["scenario"], scenario, "{json}");
    assert_eq!(report["shape"]["protocol"], protocol, "{json}");
    assert_eq!(report["nacks"], 0, "{json}");
    assert_eq!(report["stream_errors"], 0, "{json}");
    (report, json)
}

/// The named (EDS) scenario at a tiny size, both v3 protocols, and its
/// disjoint variant: every client gets every change to its names, and
/// nothing else (no push without a change, nothing to a bystander).
#[tokio::test]
async fn the_eds_scenario_runs_at_a_tiny_size() {
    for protocol in ["xds-sotw", "xds-delta"] {
        for disjoint in [false, true] {
            let (report, json) = tiny_named_run("eds", protocol, disjoint.then_some("--eds-disjoint")).await;
            let eds = &report["eds"];
            assert_eq!(eds["disjoint"], disjoint, "{json}");
            // The tiny shape's seed reaches some client with its changes.
            assert!(eds["changes_delivered"].as_u64().unwrap() > 0, "{json}");
            assert!(report["responses_delivered"].as_u64().unwrap() > 0, "{json}");
            assert!(report["latency_p99_ms"].as_f64().unwrap() > 0.0, "{json}");
            assert_eq!(eds["pushes_without_change"], 0, "{json}");
            assert_eq!(eds["resources_not_subscribed"], 0, "{json}");
            assert_eq!(eds["changes_never_published"], 0, "{json}");
            assert!(
                eds["gateway_rss_per_subscribed_name_bytes"].as_f64().is_some(),
                "{json}"
            );
            assert!(report["wire"]["bytes"].as_u64().unwrap() > 0, "{json}");
            // The goals' figures (numbers live in BENCHMARKS.md).
            assert!(reports_times_wire(&report), "{json}");
            assert!(eds["gateway_rss_per_client_bytes"].as_f64().is_some(), "{json}");
            if disjoint {
                assert!(eds["bystanders"].as_u64().unwrap() > 0, "{json}");
                assert_eq!(eds["bystander_responses"], 0, "{json}");
                assert_eq!(eds["bystander_bytes"], 0, "{json}");
            } else {
                assert!(eds["bystanders"].is_null(), "{json}");
            }
        }
    }
}

/// The reconnect scenario at a tiny size, both v3 protocols, the gateway
/// stopped with SIGTERM and with SIGKILL: every client holds the current
/// state again after the restart, and the report says what that cost
/// (delta: nothing the clients hold is sent again).
#[tokio::test]
async fn the_reconnect_scenario_runs_at_a_tiny_size() {
    for protocol in ["xds-sotw", "xds-delta"] {
        for kill in [false, true] {
            let (report, json) = tiny_named_run("reconnect", protocol, kill.then_some("--kill")).await;
            let streams = report["streams"].as_u64().unwrap();
            let reconnect = &report["reconnect"];
            assert_eq!(reconnect["signal"], if kill { "SIGKILL" } else { "SIGTERM" }, "{json}");
            assert_eq!(reconnect["resynced"].as_u64().unwrap(), streams, "{json}");
            let (p50, p99, max) = (
                reconnect["resynced_p50_ms"].as_f64().unwrap(),
                reconnect["resynced_p99_ms"].as_f64().unwrap(),
                reconnect["resynced_max_ms"].as_f64().unwrap(),
            );
            assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{json}");
            assert!(reconnect["gateway_cpu_seconds"].as_f64().is_some(), "{json}");
            assert!(reconnect["peak_rss"].as_u64().unwrap() > 0, "{json}");
            // Nothing changed across the restart. State of the world (named
            // clients are answered whatever version they report): what was
            // sent, the clients held (less each response's framing). Delta:
            // nothing they hold is sent again, an empty answer each.
            let sent = reconnect["bytes_sent"].as_u64().unwrap();
            let held = reconnect["bytes_already_held"].as_u64().unwrap();
            assert!(reconnect["responses"].as_u64().unwrap() >= streams, "{json}");
            match protocol {
                "xds-delta" => assert!(held == 0 && sent > 0, "{json}"),
                _ => assert!(0 < held && held < sent, "{json}"),
            }
            assert!(reports_times_wire(reconnect), "{json}");
        }
    }
}

/// The soak at a tiny size (seconds of churn): clients of every protocol
/// came, went, resumed and NACKed while the source changed, every client
/// connected at the end held exactly the source's final state, the gateway
/// was sampled through the churn, and at rest it held as many descriptors
/// and tasks as before it.
#[tokio::test]
async fn the_soak_scenario_runs_at_a_tiny_size() {
    let (report, json) = mcp_load(&["--scenario", "soak", "--tiny"]).await;
    assert_eq!(report["scenario"], "soak", "{json}");
    assert_eq!(report["nacks"], 0, "{json}");
    assert_eq!(report["stream_errors"], 0, "{json}");
    let soak = &report["soak"];
    let verdict = &soak["verdict"];
    assert_eq!(verdict["passed"], true, "{json}");
    assert_eq!(verdict["failures"].as_array().unwrap().len(), 0, "{json}");
    // Every resident, churning and fresh client was checked, and held it.
    let everyone = ["residents", "churning", "fresh"]
        .iter()
        .map(|k| soak[k].as_u64().unwrap())
        .sum::<u64>();
    assert_eq!(verdict["clients_checked"].as_u64().unwrap(), everyone, "{json}");
    assert_eq!(verdict["clients_at_final"], verdict["clients_checked"], "{json}");
    assert_eq!(soak["kinds"].as_array().unwrap().len(), 8, "{json}");
    // The churn happened: sessions beyond the first of each client, leaves
    // of both kinds, resumes, NACKs, and many versions.
    assert!(soak["sessions"].as_u64().unwrap() > everyone, "{json}");
    assert!(soak["sessions_resumed"].as_u64().unwrap() > 0, "{json}");
    assert!(soak["leaves_closed"].as_u64().unwrap() > 0, "{json}");
    assert!(soak["leaves_cancelled"].as_u64().unwrap() > 0, "{json}");
    assert!(soak["nacks_sent"].as_u64().unwrap() > 0, "{json}");
    assert!(soak["updates_published"].as_u64().unwrap() > 20, "{json}");
    // The gateway saw the leaves: streams the clients closed and cancelled.
    let ends = &soak["gateway_stream_ends"];
    assert!(ends["client_closed"].as_u64().unwrap() > 0, "{json}");
    assert!(ends["client_gone"].as_u64().unwrap() > 0, "{json}");
    // Samples were taken through the churn, each of a live gateway.
    let samples = soak["samples"].as_array().unwrap();
    assert!(samples.len() >= 3, "{json}");
    for sample in samples {
        assert!(sample["rss_bytes"].as_u64().unwrap() > 0, "{json}");
        assert!(sample["open_fds"].as_u64().unwrap() > 0, "{json}");
        assert!(sample["tasks"].as_u64().unwrap() > 0, "{json}");
    }
    let at = |i: usize| samples[i]["at_seconds"].as_f64().unwrap();
    assert!(at(samples.len() - 1) > at(0), "{json}");
    for rest in ["at_rest_before", "at_rest_after"] {
        assert_eq!(soak[rest]["connections"], soak["residents"], "{json}");
    }
}

/// The distinct identities scenario at a tiny size, with a limit below its
/// identities: each identity connected over mTLS and read its grant (the
/// tool checks every one read the shared part and its own), those past the
/// limit were refused naming the flag, and the gateway's memory was read.
#[tokio::test]
async fn the_grants_scenario_runs_at_a_tiny_size() {
    let (report, json) = mcp_load(&["--scenario", "grants", "--tiny", "--max-grants-per-version", "4"]).await;
    assert_eq!(report["scenario"], "grants", "{json}");
    let grants = &report["grants"];
    assert_eq!(grants["identities"], 6, "{json}");
    assert_eq!(
        (&grants["served"], &grants["refused"]),
        (&4.into(), &2.into()),
        "{json}"
    );
    assert!(
        grants["refusal_example"]
            .as_str()
            .unwrap()
            .contains("--max-grants-per-version=4"),
        "{json}"
    );
    for rss in ["rss_before_bytes", "rss_connected_bytes", "rss_after_bytes"] {
        assert!(grants[rss].as_u64().unwrap() > 0, "{json}");
    }
}

/// Flags the eds scenario cannot honour are refused at start, naming them.
#[tokio::test]
async fn eds_flags_that_do_not_fit_are_refused() {
    for (args, named) in [
        (&["--scenario", "eds", "--protocol", "mcp"][..], "--protocol"),
        (&["--scenario", "fan-out", "--seed", "3"][..], "--seed"),
        (&["--scenario", "eds", "--abuse", "nack-flood"][..], "--abuse"),
        (
            &["--scenario", "eds", "--names-per-client", "0"][..],
            "--names-per-client",
        ),
        (
            &["--scenario", "eds", "--change-percent", "101"][..],
            "--change-percent",
        ),
        (
            &["--scenario", "eds", "--eds-disjoint", "--streams", "300"][..],
            "--eds-disjoint",
        ),
        (&["--scenario", "eds", "--kill"][..], "--kill"),
        (&["--scenario", "reconnect", "--updates", "3"][..], "--updates"),
        (&["--scenario", "reconnect", "--protocol", "mcp"][..], "--protocol"),
        (&["--scenario", "reconnect", "--eds-disjoint"][..], "--eds-disjoint"),
        (&["--scenario", "soak", "--protocol", "mcp"][..], "--protocol"),
        (&["--scenario", "soak", "--streams", "4"][..], "--streams"),
        (
            &["--scenario", "fan-out", "--sample-interval", "1s"][..],
            "--sample-interval",
        ),
        (&["--scenario", "fan-out", "--duration", "1s"][..], "--duration"),
        (
            &["--scenario", "fan-out", "--max-grants-per-version", "3"][..],
            "--max-grants-per-version",
        ),
        (&["--scenario", "grants", "--protocol", "mcp"][..], "--protocol"),
    ] {
        let shown = format!("mcp-load {}", args.join(" "));
        let output = within(
            &shown,
            Command::new(env!("CARGO_BIN_EXE_mcp-load"))
                .args(args)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{shown}: {stderr}");
        assert!(stderr.contains(named), "{shown}: {stderr}");
    }
}

/// Each attack beside a tiny scenario: the canaries still get everything.
#[tokio::test]
async fn every_abuse_runs_at_a_tiny_size() {
    for abuse in ["nack-flood", "initial-versions", "idle-connections"] {
        let (report, json) = mcp_load(&["--scenario", "fan-out", "--tiny", "--abuse", abuse]).await;
        assert_eq!(report["abuse"], abuse);
        assert_eq!(report["attackers_established"], 2, "{json}");
        assert_eq!(report["stream_errors"], 0, "{json}");
        assert!(report["gateway_rss_under_attack_bytes"].as_u64().unwrap() > 0, "{json}");
        assert!(
            report["responses_delivered"].as_u64().unwrap() >= report["streams"].as_u64().unwrap(),
            "{json}"
        );
    }
}

/// Two gateways in a chain (the clients read the second): every client gets
/// every update through both.
#[tokio::test]
async fn a_chain_of_two_gateways_runs_at_a_tiny_size() {
    let (report, json) = mcp_load(&["--scenario", "fan-out", "--tiny", "--chain", "2"]).await;
    assert_eq!(report["chain"], 2, "{json}");
    assert_eq!(report["nacks"], 0, "{json}");
    assert_eq!(report["stream_errors"], 0, "{json}");
    assert!(report["chain_upstream_cpu_seconds"].as_f64().is_some(), "{json}");
    assert!(
        report["responses_delivered"].as_u64().unwrap() >= report["streams"].as_u64().unwrap(),
        "{json}"
    );
}

/// `--pin` with clients that accept only 16 KiB frames (grpc-go's): the
/// run is measured against the wire, and its counts agree with each other.
#[tokio::test]
async fn a_pinned_run_reports_its_cost_against_the_wire() {
    let (report, json) = mcp_load(&[
        "--scenario",
        "fan-out",
        "--tiny",
        "--pin",
        "--client-max-frame-size",
        "16384",
    ])
    .await;
    assert_eq!(report["stream_errors"], 0, "{json}");
    assert!(report["pinned"]["gateway_core"].as_u64().is_some(), "{json}");
    assert_eq!(report["client_max_frame_size"], 16384, "{json}");
    let received = report["responses_received"].as_u64().unwrap();
    assert!(received >= report["responses_delivered"].as_u64().unwrap(), "{json}");
    // The wire writer sent exactly what the clients received.
    assert_eq!(report["wire"]["bytes"], report["bytes_received"], "{json}");
    assert_eq!(report["wire"]["writes"].as_u64().unwrap(), received, "{json}");
    // What the gateway's process wrote covers what the clients read (HTTP/2
    // framing and its ACKs upstream on top), but for the phase's edge: a
    // response written before the first sample of the gateway's counters and
    // read after it counts in what the clients read only. At most one per
    // stream is in flight (one outstanding response per type); in this
    // scenario every response is a full state of one size.
    let written = report["gateway_bytes_written"].as_u64().unwrap();
    let bytes_received = report["bytes_received"].as_u64().unwrap();
    let in_flight = report["streams"].as_u64().unwrap() * (bytes_received / received.max(1));
    assert!(written + in_flight >= bytes_received, "{json}");
    assert!(report["write_syscalls_per_response"].as_f64().unwrap() > 0.0, "{json}");
    assert!(report["data_frames_per_response"].as_f64().unwrap() >= 1.0, "{json}");
}

/// `mcp-load --help` explains every option.
#[tokio::test]
async fn every_mcp_load_option_is_explained() {
    let output = within(
        "mcp-load --help",
        Command::new(env!("CARGO_BIN_EXE_mcp-load")).arg("--help").output(),
    )
    .await
    .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = help.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("--") {
            let next = lines.get(i + 1).map_or("", |l| l.trim());
            assert!(!next.is_empty(), "{line} has no explanation:\n{help}");
        }
    }
}
