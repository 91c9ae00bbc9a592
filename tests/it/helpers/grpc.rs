//! grpc's own proxyless xDS client (Python grpcio, which speaks v3 ADS state
//! of the world for `xds:///` targets) as a client of the gateway: a worker
//! process, tests/grpc/worker.py, driven over stdin/stdout, that holds the
//! channels, makes the calls and says which backend answered. Backends are
//! grpc servers in a worker of their own. The config is Envoy resources in a
//! files directory the gateway watches (`--source-dir`), built here.
//!
//! The interpreter comes from `GRPCIO_PYTHON`, or from a venv under target/
//! installed on first use (see `peers`: without `GRPCIO_PYTHON` at build
//! time, the tests that need grpcio are ignored).

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use super::peers::{self, tail};

/// The grpcio release the tests are written against.
pub const GRPCIO_VERSION: &str = "1.85.1";

/// How long grpc is given to do what a test waits for: below grpc's 15 s
/// resource-does-not-exist timer, so that no passing test waits for it.
const TIMEOUT: Duration = Duration::from_secs(10);

/// How often a call is made again while waiting for its answer to change.
const POLL: Duration = Duration::from_millis(25);

/// The deadline of one call.
const CALL_DEADLINE: Duration = Duration::from_secs(1);

pub const LISTENERS: &str = "envoy/config/listener/v3/listeners";
pub const ROUTES: &str = "envoy/config/route/v3/routeconfigurations";
pub const CLUSTERS: &str = "envoy/config/cluster/v3/clusters";
pub const ENDPOINTS: &str = "envoy/config/endpoint/v3/clusterloadassignments";
pub const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// A python3 that imports grpcio 1.85.1: `GRPCIO_PYTHON`, else the one in
/// `target/grpcio-venv`, installed there if missing. Looked for once per
/// process; Err says why not.
pub fn python() -> Result<PathBuf, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let package = format!("grpcio=={GRPCIO_VERSION}");
            peers::from_env_or_venv("GRPCIO_PYTHON", "grpcio-venv", "bin/python", &[package], has_grpcio)
        })
        .clone()
}

/// Ok when `python` imports grpc and it is grpcio 1.85.1.
fn has_grpcio(python: &Path) -> Result<(), String> {
    if !python.is_file() {
        return Err("no such file".into());
    }
    let output = peers::run(Command::new(python).args(["-c", "import grpc; print(grpc.__version__)"]))?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if version == GRPCIO_VERSION {
        Ok(())
    } else {
        Err(format!("it has grpcio {version}, not {GRPCIO_VERSION}"))
    }
}

/// What a call got: the name of the backend that answered, or the gRPC
/// status code and message.
pub type Answer = Result<String, String>;

/// A running worker (tests/grpc/worker.py). Killed when dropped; its log
/// (grpc's xds_client trace for a client) is in a temporary directory.
pub struct Worker {
    // Declared first so that it is killed before its directory goes.
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    dir: tempfile::TempDir,
    name: String,
}

impl Worker {
    /// A worker serving one backend per name; their ports by name.
    pub async fn backends(names: &[&str]) -> (Worker, BTreeMap<String, u16>) {
        let mut worker = Worker::start("backends", None).await;
        let answer = worker.request(json!({"op": "serve", "names": names})).await;
        let ports = serde_json::from_value(answer["ports"].clone())
            .unwrap_or_else(|e| panic!("the backends' ports ({e}): {answer}"));
        (worker, ports)
    }

    /// An xDS client whose bootstrap points at the gateway's `xds` port,
    /// with node id `node`.
    pub async fn xds_client(xds: SocketAddr, node: &str) -> Worker {
        Worker::start(node, Some((xds, node))).await
    }

    async fn start(name: &str, xds: Option<(SocketAddr, &str)>) -> Worker {
        let python = python().unwrap_or_else(|why| panic!("grpcio {GRPCIO_VERSION}: {why}"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc/worker.py");
        let dir = tempfile::Builder::new().prefix("grpc-").tempdir().unwrap();
        let log = File::create(dir.path().join("worker.log")).unwrap();
        let mut command = tokio::process::Command::new(&python);
        command
            .arg("-u")
            .arg(&script)
            .env_remove("GRPC_XDS_BOOTSTRAP_CONFIG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        if let Some((xds, node)) = xds {
            let bootstrap = dir.path().join("bootstrap.json");
            std::fs::write(&bootstrap, bootstrap_json(xds, node).to_string()).unwrap();
            // grpc's xDS client trace: what it was sent and what it ACKed or
            // NACKed, for the failure messages.
            command
                .env("GRPC_XDS_BOOTSTRAP", &bootstrap)
                .env("GRPC_TRACE", "xds_client")
                .env("GRPC_VERBOSITY", "DEBUG");
        } else {
            command.env_remove("GRPC_XDS_BOOTSTRAP");
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} {}: {e}", python.display(), script.display()));
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut worker = Worker {
            child,
            stdin,
            stdout,
            dir,
            name: name.to_owned(),
        };
        let hello = worker.answer().await;
        assert_eq!(hello["grpc"], GRPCIO_VERSION, "{name}: {hello}");
        worker
    }

    /// The end of the worker's log: for a client, grpc's xds_client trace,
    /// its header lines only (what was sent and received, ACKed or NACKed),
    /// each cut at 400 characters; the resources it dumps are left out.
    pub fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("worker.log")).unwrap_or_default();
        let headers: String = log
            .lines()
            .filter(|line| is_log_header(line))
            .map(|line| {
                let end = line.char_indices().nth(400).map_or(line.len(), |(at, _)| at);
                format!("{}\n", &line[..end])
            })
            .collect();
        tail(&headers, 40)
    }

    /// Sends one request and reads its answer.
    async fn request(&mut self, request: Value) -> Value {
        let line = format!("{request}\n");
        if let Err(e) = self.stdin.write_all(line.as_bytes()).await {
            panic!("{}: writing {request}: {e}; its log:\n{}", self.name, self.log());
        }
        let answer = self.answer().await;
        if answer["ok"] != true && answer.get("error").is_some() {
            panic!("{}: {request} answered {answer}; its log:\n{}", self.name, self.log());
        }
        answer
    }

    async fn answer(&mut self) -> Value {
        let line = match tokio::time::timeout(TIMEOUT, self.stdout.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => panic!(
                "{} exited ({:?}); the end of what it wrote:\n{}",
                self.name,
                self.child.try_wait(),
                tail(
                    &std::fs::read_to_string(self.dir.path().join("worker.log")).unwrap_or_default(),
                    30
                )
            ),
            Ok(Err(e)) => panic!("{}: reading its answer: {e}", self.name),
            Err(_) => panic!("{}: no answer after {TIMEOUT:?}; its log:\n{}", self.name, self.log()),
        };
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{}: not JSON ({e}): {line}", self.name))
    }

    /// One call on the channel to `target` (made on first use).
    pub async fn call(&mut self, target: &str) -> Answer {
        let request = json!({"op": "call", "target": target, "timeout": CALL_DEADLINE.as_secs_f64()});
        let answer = self.request(request).await;
        match answer["backend"].as_str() {
            Some(backend) if answer["ok"] == true => Ok(backend.to_owned()),
            _ => Err(format!(
                "{}: {}",
                answer["code"].as_str().unwrap_or_default(),
                answer["details"].as_str().unwrap_or_default()
            )),
        }
    }

    /// Calls `target` until an answer satisfies `condition`, and returns it;
    /// fails the test with `what`, the last answer and grpc's trace when
    /// that takes longer than `TIMEOUT`.
    pub async fn call_until(&mut self, target: &str, what: &str, condition: impl Fn(&Answer) -> bool) -> Answer {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        loop {
            let answer = self.call(target).await;
            if condition(&answer) {
                return answer;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "{}: timed out after {TIMEOUT:?} waiting for {what} on {target}; the last answer: {answer:?}; \
                     the end of grpc's log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Calls `target` until backend `backend` answers.
    pub async fn answered_by(&mut self, target: &str, backend: &str, what: &str) {
        let _answered = self
            .call_until(target, &format!("{what}: an answer from backend {backend:?}"), |a| {
                a.as_deref() == Ok(backend)
            })
            .await;
    }

    /// The backends that answer `calls` calls in a row (failing the test on
    /// an error).
    pub async fn answers(&mut self, target: &str, calls: usize) -> Vec<String> {
        let mut backends = Vec::with_capacity(calls);
        for _ in 0..calls {
            match self.call(target).await {
                Ok(backend) => backends.push(backend),
                Err(status) => panic!(
                    "{}: a call to {target} failed: {status}; the end of grpc's log:\n{}",
                    self.name,
                    self.log()
                ),
            }
        }
        backends
    }
}

/// A line of grpc's own log starts `I1126 00:23:17.771288` (severity,
/// date, time).
fn is_log_header(line: &str) -> bool {
    let mut chars = line.chars();
    chars.next().is_some_and(|c| "IWEF".contains(c)) && chars.next().is_some_and(|c| c.is_ascii_digit())
}

/// grpc's xDS bootstrap: one server, the gateway, plaintext.
fn bootstrap_json(xds: SocketAddr, node: &str) -> Value {
    json!({
        "xds_servers": [{
            "server_uri": xds.to_string(),
            "channel_creds": [{"type": "insecure"}],
            "server_features": []
        }],
        "node": {"id": node, "cluster": "grpc-tests", "locality": {}}
    })
}

// === the files the gateway serves ===

/// One resource of the files source: `json` is its proto-JSON, as YAML
/// (flow style), indented under `body.json`.
fn resource(collection: &str, type_url: &str, name: &str, json: &str) -> String {
    let body: String = json.lines().map(|line| format!("    {line}\n")).collect();
    format!("collection: {collection}\nname: {name}\nbody:\n  type_url: {type_url}\n  json:\n{body}---\n")
}

/// A listener for grpc (`xds:///<service>`): an API listener whose HTTP
/// connection manager takes its routes from `route` by RDS.
pub fn listener(service: &str, route: &str) -> String {
    let hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
    let router = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";
    resource(
        LISTENERS,
        LDS,
        service,
        &format!(
            "name: {service}\napi_listener:\n  api_listener:\n    \"@type\": {hcm}\n    rds: {{route_config_name: \
             {route}, config_source: {{ads: {{}}, resource_api_version: V3}}}}\n    http_filters:\n    - name: \
             router\n      typed_config: {{\"@type\": {router}}}"
        ),
    )
}

/// A route configuration: one virtual host for every domain, whose routes
/// send a path starting with each prefix to its cluster, in order.
pub fn route(name: &str, routes: &[(&str, &str)]) -> String {
    let routes: String = routes
        .iter()
        .map(|(prefix, cluster)| format!("\n  - match: {{prefix: \"{prefix}\"}}\n    route: {{cluster: {cluster}}}"))
        .collect();
    resource(
        ROUTES,
        RDS,
        name,
        &format!("name: {name}\nvirtual_hosts:\n- name: all\n  domains: [\"*\"]\n  routes:{routes}"),
    )
}

/// An EDS cluster whose endpoints are ClusterLoadAssignment `endpoints`, over
/// the same ADS stream.
pub fn eds_cluster(name: &str, endpoints: &str) -> String {
    resource(
        CLUSTERS,
        CDS,
        name,
        &format!(
            "name: {name}\ntype: EDS\nconnect_timeout: 1s\neds_cluster_config: {{service_name: {endpoints}, \
             eds_config: {{ads: {{}}, resource_api_version: V3}}}}"
        ),
    )
}

/// A STATIC cluster: valid for Envoy, refused by grpc ("unknown discovery
/// type": grpc takes EDS, LOGICAL_DNS and aggregate clusters only).
pub fn static_cluster(name: &str) -> String {
    resource(
        CLUSTERS,
        CDS,
        name,
        &format!("name: {name}\ntype: STATIC\nconnect_timeout: 1s\nload_assignment: {{cluster_name: {name}}}"),
    )
}

/// A ClusterLoadAssignment: one locality (grpc needs its
/// `load_balancing_weight`) with an endpoint on 127.0.0.1 per port.
pub fn endpoints(name: &str, ports: &[u16]) -> String {
    let endpoints: String = ports
        .iter()
        .map(|port| {
            format!("\n  - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}")
        })
        .collect();
    resource(
        ENDPOINTS,
        EDS,
        name,
        &format!(
            "cluster_name: {name}\nendpoints:\n- locality: {{zone: test}}\n  load_balancing_weight: 1\n  \
             lb_endpoints:{endpoints}"
        ),
    )
}

/// Writes the resources `docs` as the directory's one file, atomically (a
/// temporary file renamed over it), so that the gateway never reads half.
pub fn write_files(dir: &Path, docs: &[String]) {
    super::certs::write(dir, "mesh.yaml", &docs.concat());
}

// === the gateway's views of a client ===

/// The `/debug/syncz` rows of node `node` (exactly), by type URL.
pub async fn syncz(admin: SocketAddr, node: &str) -> BTreeMap<String, Value> {
    let view = super::get_json(admin, &format!("/debug/syncz?node={node}")).await;
    view["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["node_id"] == node)
        .map(|row| (row["type_url"].as_str().unwrap_or_default().to_owned(), row.clone()))
        .collect()
}

/// Polls `/debug/syncz` until node `node`'s row of `type_url` satisfies
/// `condition`, and returns it.
pub async fn syncz_row_when(
    admin: SocketAddr,
    node: &str,
    type_url: &str,
    what: &str,
    condition: impl Fn(&Value) -> bool,
) -> Value {
    let condition = &condition;
    let last = std::sync::Mutex::new(Value::Null);
    let last = &last;
    let found = tokio::time::timeout(TIMEOUT, async {
        loop {
            let row = syncz(admin, node).await.remove(type_url).unwrap_or_default();
            if condition(&row) {
                return row;
            }
            *last.lock().unwrap() = row;
            tokio::time::sleep(POLL).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| {
        panic!(
            "timed out after {TIMEOUT:?} waiting for {what}: {node}'s /debug/syncz row of {type_url}: {:#}",
            last.lock().unwrap()
        )
    })
}

/// Polls `/debug/syncz` until node `node`'s row of `type_url` has status
/// `status`, and returns it.
pub async fn status_when(admin: SocketAddr, node: &str, type_url: &str, status: &str, what: &str) -> Value {
    syncz_row_when(admin, node, type_url, what, |row| row["status"] == status).await
}

/// Polls until node `node` has ACKed the current version of each of the
/// four types, and returns the rows.
pub async fn synced(admin: SocketAddr, node: &str, what: &str) -> BTreeMap<String, Value> {
    for type_url in [LDS, RDS, CDS, EDS] {
        status_when(admin, node, type_url, "SYNCED", what).await;
    }
    syncz(admin, node).await
}

/// The nonce of the last response of each type sent to node `node`
/// (`/debug/clients`): a type's nonce changes with every response of that
/// type the client is sent.
pub async fn sent_nonces(admin: SocketAddr, node: &str) -> BTreeMap<String, String> {
    let clients = super::get_json(admin, "/debug/clients").await;
    let streams: Vec<&Value> = clients
        .as_array()
        .into_iter()
        .flatten()
        .filter(|stream| stream["node_id"] == node)
        .collect();
    assert_eq!(streams.len(), 1, "{node}: one stream in /debug/clients: {clients:#}");
    streams[0]["types"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(type_url, state)| {
            let nonce = state["last_sent_nonce"].as_str().unwrap_or_default();
            (type_url.clone(), nonce.to_owned())
        })
        .collect()
}
