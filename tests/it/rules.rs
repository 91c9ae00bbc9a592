//! The shipped alerts (`deploy/components/monitoring/prometheusrule.yaml`)
//! with Prometheus's own tools: `promtool check rules`; `promtool test
//! rules` for each alert firing on its condition and staying silent when
//! healthy; and a real Prometheus scraping a real, busy gateway process: no
//! alert, data in every panel of the shipped dashboard, and the NACK alert
//! pending once a client refuses a version. Prometheus comes from Debian's
//! package, which `.ci/run` unpacks under `target/prometheus`
//! (`PROMETHEUS_DIR`); where it cannot, these tests are ignored, with the
//! reason (see `helpers::peers`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value as Json;
use tokio::process::Command;

use crate::helpers::clients::sotw;
use crate::helpers::galley::{resource, FakeGalley};
use crate::helpers::{eventually_async, http_get, spawn_gateway, within, Running, VS};

/// Where Prometheus's binaries are: `PROMETHEUS_DIR` (a directory holding
/// `prometheus` and `promtool`), else `target/prometheus/usr/bin` (for a test
/// run with `--ignored`). Without them the test fails, saying so: it runs
/// only when asked for (see `helpers::peers`).
fn prometheus_dir() -> PathBuf {
    let dir = match std::env::var_os("PROMETHEUS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/prometheus/usr/bin"),
    };
    assert!(
        dir.join("promtool").is_file() && dir.join("prometheus").is_file(),
        "no prometheus and promtool in {} (PROMETHEUS_DIR; .ci/run unpacks Debian's package there)",
        dir.display()
    );
    dir
}

/// The `groups` of the shipped PrometheusRule, as a rules file; without
/// annotations when `annotations` is false (promtool's unit tests compare
/// them whole).
fn rules_file(dir: &Path, annotations: bool) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/components/monitoring/prometheusrule.yaml");
    let rule: serde_norway::Value = serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut groups = rule["spec"].clone();
    if !annotations {
        for group in groups["groups"].as_sequence_mut().unwrap() {
            for rule in group["rules"].as_sequence_mut().unwrap() {
                rule.as_mapping_mut().unwrap().remove("annotations");
            }
        }
    }
    let file = dir.join("rules.yaml");
    std::fs::write(&file, serde_norway::to_string(&groups).unwrap()).unwrap();
    file
}

async fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    let output = within(
        "promtool",
        Command::new(dir.join("promtool"))
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

/// Each alert: one series that fires it and one healthy beside it; the
/// healthy one never shows in the alert.
const UNIT_TESTS: &str = r#"
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_upstream_connected{pod="gw-0"}'
        values: '1 0x10'
      - series: 'mcp_gateway_upstream_connected{pod="gw-1"}'
        values: '1x10'
    alert_rule_test:
      - eval_time: 2m
        alertname: McpGatewayUpstreamDisconnected
        exp_alerts: []
      - eval_time: 4m
        alertname: McpGatewayUpstreamDisconnected
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0}
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_clients{pod="gw-0",status="STALE",collection="vs"}'
        values: '1x10'
      - series: 'mcp_gateway_clients{pod="gw-0",status="STALE",collection="dr"}'
        values: '0x10'
      - series: 'mcp_gateway_clients{pod="gw-0",status="NACKED",collection="gw"}'
        values: '0 0 2x10'
      - series: 'mcp_gateway_clients{pod="gw-0",status="SYNCED",collection="vs"}'
        values: '5x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: McpGatewayClientStale
        exp_alerts: []
      - eval_time: 6m
        alertname: McpGatewayClientStale
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0, collection: vs}
      - eval_time: 6m
        alertname: McpGatewayClientNacked
        exp_alerts: []
      - eval_time: 8m
        alertname: McpGatewayClientNacked
        exp_alerts:
          - exp_labels: {severity: critical, pod: gw-0, collection: gw}
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_source_files_broken{pod="gw-0"}'
        values: '0 0 1x10'
      - series: 'mcp_gateway_source_files_broken{pod="gw-1"}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 2m
        alertname: McpGatewaySourceFileBroken
        exp_alerts: []
      - eval_time: 4m
        alertname: McpGatewaySourceFileBroken
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0}
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_limit_refusals_total{pod="gw-0",limit="requests_rate"}'
        values: '0+3x20'
      - series: 'mcp_gateway_limit_refusals_total{pod="gw-0",limit="max_streams"}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: McpGatewayLimitRefusingPeers
        exp_alerts: []
      - eval_time: 12m
        alertname: McpGatewayLimitRefusingPeers
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0, limit: requests_rate}
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_cache_write_failures_total{pod="gw-0",collection="vs"}'
        values: '0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'mcp_gateway_cache_write_failures_total{pod="gw-0",collection="dr"}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 2m
        alertname: McpGatewayCacheWriteFailures
        exp_alerts: []
      - eval_time: 4m
        alertname: McpGatewayCacheWriteFailures
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0, collection: vs}
      - eval_time: 18m
        alertname: McpGatewayCacheWriteFailures
        exp_alerts: []
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_pinned{pod="gw-0",collection="vs"}'
        values: '0 0 1 1 0'
      - series: 'mcp_gateway_pinned{pod="gw-0",collection="dr"}'
        values: '0x5'
      - series: 'mcp_gateway_held{pod="gw-1",collection="vs"}'
        values: '0 1 1 0'
      - series: 'mcp_gateway_held{pod="gw-1",collection="dr"}'
        values: '0x5'
    alert_rule_test:
      - eval_time: 1m
        alertname: McpGatewayCollectionPinned
        exp_alerts: []
      - eval_time: 2m
        alertname: McpGatewayCollectionPinned
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0, collection: vs}
      - eval_time: 4m
        alertname: McpGatewayCollectionPinned
        exp_alerts: []
      - eval_time: 0m
        alertname: McpGatewayVersionHeld
        exp_alerts: []
      - eval_time: 1m
        alertname: McpGatewayVersionHeld
        exp_alerts:
          - exp_labels: {severity: critical, pod: gw-1, collection: vs}
      - eval_time: 3m
        alertname: McpGatewayVersionHeld
        exp_alerts: []
  - interval: 1m
    input_series:
      - series: 'mcp_gateway_skew_resources{pod="gw-0",collection="dr",generation="1.1"}'
        values: '0 0 2x20'
      - series: 'mcp_gateway_skew_resources{pod="gw-0",collection="dr",generation="1.7"}'
        values: '0x22'
    alert_rule_test:
      - eval_time: 8m
        alertname: McpGatewayClientsDropFields
        exp_alerts: []
      - eval_time: 13m
        alertname: McpGatewayClientsDropFields
        exp_alerts:
          - exp_labels: {severity: warning, pod: gw-0, collection: dr, generation: "1.1"}
"#;

#[tokio::test]
#[cfg_attr(not(peer_prometheus), ignore = "needs Prometheus (.ci/run sets PROMETHEUS_DIR)")]
async fn the_shipped_alerts_pass_promtool_and_fire_on_their_conditions_only() {
    let bin = prometheus_dir();
    let dir = tempfile::tempdir().unwrap();
    let full = rules_file(dir.path(), true);
    let (ok, said) = promtool(&bin, &["check", "rules", full.to_str().unwrap()]).await;
    assert!(ok, "promtool check rules: {said}");
    assert!(said.contains("SUCCESS: 9 rules found"), "{said}");

    let tests = tempfile::tempdir().unwrap();
    rules_file(tests.path(), false);
    let unit = tests.path().join("alerts-test.yaml");
    std::fs::write(&unit, UNIT_TESTS).unwrap();
    let (ok, said) = promtool(&bin, &["test", "rules", unit.to_str().unwrap()]).await;
    assert!(ok, "promtool test rules: {said}");
}

/// `promtool check metrics` on a busy gateway's exposition finds nothing
/// but Istio's own names (kept so Istio's alerts keep working:
/// `istio_mcp_clients_total` is a gauge, `istio_mcp_reconnections` a
/// counter without `_total`); the process's CPU time is a counter, the
/// kernel's count of it.
#[tokio::test]
#[cfg_attr(not(peer_prometheus), ignore = "needs Prometheus (.ci/run sets PROMETHEUS_DIR)")]
async fn promtool_finds_nothing_but_istios_own_names_in_the_metrics() {
    let bin = prometheus_dir();
    let mut galley = FakeGalley::start().await;
    let Running {
        child: mut gateway,
        admin,
        listen,
        ..
    } = spawn_gateway(None, &["--collections", VS, "--upstream", &galley.url()]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(listen).await;
    client.subscribe(VS);
    let response = client.recv().await;
    client.ack(&response);
    // The gateway's CPU time as the kernel counts it (in USER_HZ ticks,
    // 100 a second), read before and after the scrape: the exposition's
    // lies between. (Not "above 0": a gateway that started and served one
    // client may not have used a tick yet.)
    let pid = gateway.id().expect("the gateway runs");
    let before = cpu_ticks(pid);
    let (status, exposition) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    let after = cpu_ticks(pid);

    let mut check = Command::new(bin.join("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = check.stdin.take().unwrap();
        within("promtool to read the metrics", stdin.write_all(exposition.as_bytes()))
            .await
            .unwrap();
    }
    let output = within("promtool check metrics", check.wait_with_output())
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    let problems: Vec<&str> = said.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        problems.iter().all(|l| l.starts_with("istio_mcp_")),
        "promtool check metrics: {said}"
    );
    assert!(
        exposition.contains("# TYPE process_cpu_seconds_total counter\n"),
        "{exposition}"
    );
    let cpu: f64 = crate::helpers::sample(&exposition, "process_cpu_seconds_total", &[]).expect("the CPU time");
    let (low, high) = (before as f64 / 100.0, after as f64 / 100.0);
    assert!(
        low - 1e-6 <= cpu && cpu <= high + 1e-6,
        "process_cpu_seconds_total {cpu}, the kernel's count {low} to {high} s"
    );
    let _ = gateway.start_kill();
}

/// A process's user and system CPU time, in USER_HZ ticks (`/proc/PID/stat`'s
/// 14th and 15th fields, counted after the parenthesised command name).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the gateway's /proc stat");
    let (_, rest) = stat.rsplit_once(')').expect("a command name in parentheses");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// A query string value, percent-encoded.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A free port on 127.0.0.1 for Prometheus, which cannot say which port it
/// took when given 0.
fn free_port() -> u16 {
    crate::helpers::free_addr().port()
}

/// GET a Prometheus API path as JSON.
async fn api(prometheus: SocketAddr, path: &str) -> Json {
    let (status, body) = http_get(prometheus, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

#[tokio::test]
#[cfg_attr(not(peer_prometheus), ignore = "needs Prometheus (.ci/run sets PROMETHEUS_DIR)")]
async fn a_real_prometheus_sees_no_alert_on_a_healthy_gateway_data_in_every_panel_and_a_nack() {
    let bin = prometheus_dir();
    // A gateway process of its own (its metrics are its own), fed by a
    // (fake) Galley.
    let mut galley = FakeGalley::start().await;
    let Running {
        child: mut gateway,
        monitoring,
        listen,
        ..
    } = spawn_gateway(None, &["--upstream", &galley.url(), "--collections", VS]).await;
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;

    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(dir.path(), true);
    let prometheus_config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{}]\nscrape_configs:\n  - \
         job_name: istio-system/mcp-xds-gateway\n    static_configs: [{{targets: ['{monitoring}']}}]\n",
        rules.display()
    );
    std::fs::write(dir.path().join("prometheus.yml"), prometheus_config).unwrap();
    let port = free_port();
    let prometheus_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let _prometheus = Command::new(bin.join("prometheus"))
        .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={prometheus_addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let ready = || async {
        tokio::net::TcpStream::connect(prometheus_addr).await.is_ok()
            && http_get(prometheus_addr, "/-/ready").await.0 == 200
    };
    eventually_async("Prometheus to start", ready).await;

    // Busy: a client reads, and a change goes out to it.
    let mut client = sotw(listen).await;
    client.subscribe(VS);
    let first = client.recv().await;
    client.ack(&first);
    upstream
        .push_full(VS, vec![resource("a", "2", b"a2"), resource("b", "1", b"b")])
        .await;
    let second = client.recv().await;
    client.ack(&second);

    // Every rule evaluated, on scraped series; then two more evaluations
    // (Prometheus's own count of them): nothing pending, nothing firing.
    let evaluated_after_scrape = || async {
        let rules = api(prometheus_addr, "/api/v1/rules").await;
        let query = api(prometheus_addr, "/api/v1/query?query=mcp_gateway_clients").await;
        let has_series = !query["data"]["result"].as_array().unwrap().is_empty();
        has_series
            && rules["data"]["groups"][0]["rules"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["health"] == "ok")
    };
    eventually_async(
        "every rule evaluated, healthy, on scraped series",
        evaluated_after_scrape,
    )
    .await;
    let iterations = || async {
        let (_, metrics) = http_get(prometheus_addr, "/metrics").await;
        metrics
            .lines()
            .find(|l| l.starts_with("prometheus_rule_group_iterations_total{") && l.contains("mcp-xds-gateway"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let now = iterations().await;
    eventually_async("two more rule evaluations", || async {
        iterations().await >= now + 2.0
    })
    .await;
    let alerts = api(prometheus_addr, "/api/v1/alerts").await;
    assert_eq!(
        alerts["data"]["alerts"],
        serde_json::json!([]),
        "a healthy gateway: {alerts}"
    );

    // Every panel of the shipped dashboard shows data, queried as Grafana
    // would (its variables filled in): none waits for a first event.
    let dashboard: Json = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards/mcp-xds-gateway.json"))
            .unwrap(),
    )
    .unwrap();
    let queries: Vec<(String, String)> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap().to_owned();
            p["targets"].as_array().unwrap().iter().map(move |t| {
                let expr = t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$job", ".*")
                    .replace("$__rate_interval", "1m");
                (title.clone(), expr)
            })
        })
        .collect();
    let empty = || async {
        let mut empty = Vec::new();
        for (title, expr) in &queries {
            let result = api(prometheus_addr, &format!("/api/v1/query?query={}", encode(expr))).await;
            if result["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
                empty.push(format!("{title}: {expr}"));
            }
        }
        empty
    };
    // Polled until every panel has data, or the empty ones are named.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let empty = empty().await;
        if empty.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "dashboard panels with no data on a busy gateway:\n{}",
            empty.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The client refuses the next version: its alert goes pending (it
    // fires after its `for`).
    upstream.push_full(VS, vec![resource("a", "3", b"bad")]).await;
    let refused = client.recv().await;
    client.nack(&refused, &second.version_info, "bad route");
    eventually_async("the NACK alert to be pending", || async {
        let alerts = api(prometheus_addr, "/api/v1/alerts").await;
        alerts["data"]["alerts"].as_array().unwrap().iter().any(|a| {
            a["labels"]["alertname"] == "McpGatewayClientNacked"
                && a["state"] == "pending"
                && a["labels"]["collection"] == VS
        })
    })
    .await;
    gateway.kill().await.unwrap();
}
