//! Test helpers: a fake Galley, legacy clients, and the gateway started
//! in-process on 127.0.0.1 port 0. Every await that waits on the network goes
//! through `within`, and conditions are polled with `eventually`, never slept.

pub mod certs;
pub mod clients;
pub mod envoy;
pub mod galley;
pub mod grpc;
pub mod h2raw;
pub mod heap;
pub mod kustomize;
pub mod peers;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use mcp_xds_gateway::app::{self, Bound};
use mcp_xds_gateway::config::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const VS: &str = "istio/networking/v1alpha3/virtualservices";
pub const VS_TYPE_URL: &str = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
pub const GW: &str = "istio/networking/v1alpha3/gateways";
pub const GW_TYPE_URL: &str = "type.googleapis.com/istio.networking.v1alpha3.Gateway";
pub const DR: &str = "istio/networking/v1alpha3/destinationrules";

/// Generous: the machine is shared and slow builds run beside the tests.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Awaits `future`, failing the test with `what` if it takes too long.
pub async fn within<F: Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(TIMEOUT, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {TIMEOUT:?} waiting for {what}"),
    }
}

/// Polls `condition` until it holds, failing the test with `what` otherwise.
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    within(what, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// As [`eventually`], for a condition that must await (an HTTP view).
pub async fn eventually_async<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    eventually_some(what, || {
        let holds = condition();
        async move { holds.await.then_some(()) }
    })
    .await
}

/// Polls `found` until it gives a value, and returns it; fails the test
/// with `what` otherwise.
pub async fn eventually_some<T, F: Future<Output = Option<T>>>(what: &str, mut found: impl FnMut() -> F) -> T {
    within(what, async {
        loop {
            if let Some(value) = found().await {
                return value;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// The value of the first sample of metric `name` whose labels contain
/// each of `labels` (`collection="…"`), in a Prometheus exposition.
pub fn sample(exposition: &str, name: &str, labels: &[&str]) -> Option<f64> {
    exposition
        .lines()
        .find(|l| {
            l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' ']))
                && labels.iter().all(|label| l.contains(label))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A copy of the upstream status taken while `condition` holds (the status
/// moves on by itself: a retry scheduled is cleared when the attempt starts).
pub async fn upstream_status_when(
    gw: &Bound,
    what: &str,
    condition: impl Fn(&mcp_xds_gateway::source::UpstreamStatus) -> bool,
) -> mcp_xds_gateway::source::UpstreamStatus {
    within(what, async {
        loop {
            let status = gw.upstream.borrow().clone();
            if condition(&status) {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

/// `/debug/upstream` at `admin` once it shows at least `failures`
/// consecutive failures and a retry scheduled: the failure recorded whole
/// (for a gateway process, whose status is read over HTTP).
pub async fn upstream_failed(admin: SocketAddr, failures: u64, what: &str) -> serde_json::Value {
    eventually_some(what, || async move {
        let status = get_json(admin, "/debug/upstream").await;
        (status["consecutive_failures"].as_u64().is_some_and(|n| n >= failures)
            && !status["next_retry_in_seconds"].is_null())
        .then_some(status)
    })
    .await
}

/// `/debug/upstream` at `admin` once it shows at least `failures`
/// consecutive failures. Unlike [`upstream_failed`] it does not wait for the
/// retry to be scheduled: with a short `--reconnect-min-delay` the retry may
/// already have started (and connected) before a poll reads it, while the
/// count and the last error stay until a stream makes progress.
pub async fn upstream_failures_reach(admin: SocketAddr, failures: u64, what: &str) -> serde_json::Value {
    eventually_some(what, || async move {
        let status = get_json(admin, "/debug/upstream").await;
        (status["consecutive_failures"].as_u64().is_some_and(|n| n >= failures)).then_some(status)
    })
    .await
}

/// Every port of the gateway on a free loopback port.
pub const LOOPBACK_PORTS: [&str; 6] = [
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
    "--monitoring-listen",
    "127.0.0.1:0",
];

/// Starts the gateway in-process with the flags a user would give it.
pub async fn start_gateway(flags: &[&str]) -> Bound {
    start_gateway_on("127.0.0.1:0", flags).await
}

/// Starts the gateway with its client port on `listen`.
///
/// The port is one a gateway of this test just let go of (a restart): until
/// it binds again, anything on the machine may hold it for a moment as the
/// source port of an outgoing connection, so "in use" is tried again, within
/// the suite's wait; any other error fails the test.
pub async fn start_gateway_on(listen: &str, flags: &[&str]) -> Bound {
    // The client port as given, the others as LOOPBACK_PORTS has them.
    let mut argv = vec!["mcp-xds-gateway", "--listen", listen];
    argv.extend_from_slice(&LOOPBACK_PORTS[2..]);
    argv.extend_from_slice(flags);
    eventually_some("the gateway to start on its port again", || {
        let settings = Args::try_parse_with_sources(argv.clone())
            .expect("valid flags")
            .validate()
            .expect("valid settings");
        async move {
            match app::build(settings).await {
                Ok(bound) => Some(bound),
                Err(app::AppError::Bind { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => None,
                Err(e) => panic!("the gateway starts: {e:?}"),
            }
        }
    })
    .await
}

/// A gateway subscribed to `collections` on `galley`, reconnecting quickly.
pub async fn gateway_for(galley: &galley::FakeGalley, collections: &[&str], extra: &[&str]) -> Bound {
    start_gateway(
        &upstream_flags(galley, collections, extra)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .await
}

/// As [`gateway_for`], the gateway a process of its own: for a test whose
/// assertion is a metric, which then counts only what this gateway did
/// (every in-process gateway of the test binary shares one recorder).
pub async fn gateway_process_for(galley: &galley::FakeGalley, collections: &[&str], extra: &[&str]) -> Running {
    spawn_gateway(
        None,
        &upstream_flags(galley, collections, extra)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .await
}

/// The flags of [`gateway_for`].
fn upstream_flags(galley: &galley::FakeGalley, collections: &[&str], extra: &[&str]) -> Vec<String> {
    let mut flags = vec![
        "--upstream".to_owned(),
        galley.url(),
        "--collections".to_owned(),
        collections.join(","),
        "--reconnect-min-delay".to_owned(),
        "10ms".to_owned(),
    ];
    flags.extend(extra.iter().map(|f| (*f).to_owned()));
    flags
}

/// A fake Galley, a gateway subscribed to `collections` on it, and the
/// stream between them, its initial requests read.
pub async fn galley_and_gateway(
    collections: &[&str],
    extra: &[&str],
) -> (galley::FakeGalley, Bound, galley::GalleyStream) {
    let mut galley = galley::FakeGalley::start().await;
    let gw = gateway_for(&galley, collections, extra).await;
    let mut stream = galley.next_stream().await;
    stream.initial_requests(collections.len()).await;
    (galley, gw, stream)
}

/// A plain HTTP/1.1 GET: status code and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_get_with(addr, path, "").await
}

/// A GET with extra request header lines (each ending in `\r\n`).
pub async fn http_get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    http_request(addr, "GET", path, headers).await
}

/// An HTTP/1.1 request with no body: (status, body; a chunked body read
/// whole).
pub async fn http_request(addr: SocketAddr, method: &str, path: &str, headers: &str) -> (u16, String) {
    let (status, _, body) = http_exchange(addr, method, path, headers).await;
    (status, body)
}

/// As [`http_request`], with the response's head (status line and header
/// lines, lowercased) between the status and the body.
pub async fn http_exchange(addr: SocketAddr, method: &str, path: &str, headers: &str) -> (u16, String, String) {
    within(&format!("{method} {path} from {addr}"), async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("{addr}: {e}"));
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let split = find(&response, b"\r\n\r\n").expect("a whole HTTP head");
        let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("an HTTP status line");
        let body = &response[split + 4..];
        let body = if head.contains("\r\ntransfer-encoding: chunked") {
            dechunk(body)
        } else {
            body.to_vec()
        };
        (status, head, String::from_utf8_lossy(&body).into_owned())
    })
    .await
}

/// A chunked body's content (chunk extensions and trailers ignored).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut content = Vec::new();
    while let Some(eol) = find(body, b"\r\n") {
        let line = String::from_utf8_lossy(&body[..eol]);
        let size = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size, 16).unwrap_or_else(|_| panic!("a chunk size, not {line:?}"));
        body = &body[eol + 2..];
        if size == 0 {
            break;
        }
        content.extend_from_slice(&body[..size]);
        body = body.get(size + 2..).unwrap_or_default();
    }
    content
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A debug view's JSON (a GET on the admin port).
pub async fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let (status, body) = http_get(addr, path).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} is not JSON ({e}): {body}"))
}

/// An address on 127.0.0.1 free a moment ago: for peers that must know
/// their own port (or each other's) before they start (gateways, an Envoy's
/// listener, Prometheus).
///
/// Taken below the range the kernel gives ports from when asked for port 0
/// (`ip_local_port_range`), so that nothing started meanwhile on port 0 can
/// be given it. A port of the kernel's choice, let go at once, was: an
/// Envoy's admin port took the one its listener was then to bind
/// ("Address already in use"). Each call in this process takes the next
/// port from a place of the process's own, so two calls never return one
/// port.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOWEST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .min(65_536);
    let span = ephemeral_from.saturating_sub(LOWEST);
    if span >= 1_000 {
        let start = std::process::id() % span;
        for _ in 0..span {
            let port = LOWEST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port as u16)) {
                return listener.local_addr().unwrap();
            }
        }
    }
    // No room below the kernel's range: its choice.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().unwrap()
}

/// Sorted resource names of a response's resources.
pub fn names(resources: &[mcp_xds_gateway::proto::Resource]) -> Vec<String> {
    let mut names: Vec<String> = resources
        .iter()
        .map(|r| r.metadata.as_ref().unwrap().name.clone())
        .collect();
    names.sort();
    names
}

/// A gateway binary started on port 0, and what it logged before listening.
pub struct Running {
    pub child: tokio::process::Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub monitoring: SocketAddr,
    /// The dial-out sink port (`--sink-listen`), as bound: read from the
    /// banner, so a test can give port 0 rather than a port it freed.
    pub sink: Option<SocketAddr>,
    /// Every line before "gateway listening".
    pub log: Vec<String>,
    /// The lines after it, as they come.
    pub later: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Running {
    /// The next line of the log that contains `needle` (lines before it are
    /// passed over).
    pub async fn log_line(&mut self, needle: &str) -> String {
        within(&format!("a log line with {needle:?}"), async {
            loop {
                let line = self.later.recv().await.expect("the gateway logs before exiting");
                if line.contains(needle) {
                    return line;
                }
            }
        })
        .await
    }

    /// The first line with `needle`, logged before the gateway listened or
    /// after: for an event that may come either side of the banner (an
    /// upstream's first answer).
    pub async fn logged(&mut self, needle: &str) -> String {
        match self.log.iter().find(|l| l.contains(needle)) {
            Some(line) => line.clone(),
            None => self.log_line(needle).await,
        }
    }

    /// The lines of the log up to and including the next one that contains
    /// `needle`: what was logged before a marker line (for "logged once":
    /// no second line before the marker).
    pub async fn lines_until(&mut self, needle: &str) -> Vec<String> {
        within(&format!("a log line with {needle:?}"), async {
            let mut lines = Vec::new();
            loop {
                let line = self.later.recv().await.expect("the gateway logs before exiting");
                let found = line.contains(needle);
                lines.push(line);
                if found {
                    return lines;
                }
            }
        })
        .await
    }
}

/// Starts the gateway binary with `args` on port 0 (from `cwd`, else the
/// package root) and reads the bound addresses from its "gateway listening"
/// line; its log is drained after that.
pub async fn spawn_gateway(cwd: Option<&std::path::Path>, args: &[&str]) -> Running {
    spawn_gateway_with_env(cwd, args, &[]).await
}

/// As [`spawn_gateway`], with environment variables.
pub async fn spawn_gateway_with_env(cwd: Option<&std::path::Path>, args: &[&str], env: &[(&str, &str)]) -> Running {
    // A client port given in `args` replaces the default one.
    let ports = if args.contains(&"--listen") {
        &LOOPBACK_PORTS[2..]
    } else {
        &LOOPBACK_PORTS[..]
    };
    let argv: Vec<&str> = ports.iter().chain(args).copied().collect();
    let (child, log, banner, later) = spawn_until_listening(cwd, &argv, env, "gateway listening").await;
    Running {
        child,
        listen: field(&banner, "listen"),
        admin: field(&banner, "admin"),
        monitoring: field(&banner, "monitoring"),
        sink: quoted_field(&banner, "sink"),
        log,
        later,
    }
}

/// `"name":"ADDR"` of a banner line logged with `--log-format json`.
fn json_field(line: &str, name: &str) -> Option<SocketAddr> {
    let entry: serde_json::Value = serde_json::from_str(line).ok()?;
    let value = entry[name].as_str()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?} in {line}: {e}")),
    )
}

/// `name="ADDR"` of a banner line (an optional field, logged quoted), if
/// there.
fn quoted_field(line: &str, name: &str) -> Option<SocketAddr> {
    if line.starts_with('{') {
        return json_field(line, name);
    }
    let start = line.find(&format!("{name}=\""))? + name.len() + 2;
    let value = line[start..].split('"').next()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?} in {line}: {e}")),
    )
}

/// `mcp-xds-gateway source --source-dir DIR ARGS…` (a dial-out source:
/// `--sink` in `args`) as a process of its own, so that its metrics are its
/// own: what another test's in-process source counts never shows in them.
pub struct RunningSource {
    pub child: tokio::process::Child,
    pub admin: SocketAddr,
    pub monitoring: SocketAddr,
}

impl RunningSource {
    /// Sends SIGTERM and returns whether it exited 0 in time.
    pub async fn stop(mut self) -> bool {
        terminate(&mut self.child).await
    }
}

impl Running {
    /// Sends SIGTERM and returns whether it exited 0 in time.
    pub async fn stop(mut self) -> bool {
        terminate(&mut self.child).await
    }
}

/// Sends SIGTERM to `child` and returns whether it exited 0 in time.
async fn terminate(child: &mut tokio::process::Child) -> bool {
    let pid = child.id().expect("the child is running") as i32;
    // SAFETY: kill(2) on the pid of a child this test started and has not
    // reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    match within("the child to exit after SIGTERM", child.wait()).await {
        Ok(status) if status.success() => true,
        Ok(status) => {
            eprintln!("the child (pid {pid}) ended after SIGTERM with {status}");
            false
        }
        Err(e) => {
            eprintln!("waiting for the child (pid {pid}) after SIGTERM: {e}");
            false
        }
    }
}

/// Starts a dial-out source process on `dir`, its HTTP ports on port 0,
/// reconnecting after 10 ms to 200 ms.
pub async fn spawn_dial_out_source(dir: &std::path::Path, args: &[&str]) -> RunningSource {
    let dir = dir.to_str().unwrap();
    let mut argv = vec!["source", "--source-dir", dir];
    argv.extend_from_slice(&LOOPBACK_PORTS[2..]);
    argv.extend_from_slice(&["--reconnect-min-delay", "10ms", "--reconnect-max-delay", "200ms"]);
    argv.extend_from_slice(args);
    let (child, _, banner, _) = spawn_until_listening(None, &argv, &[], "source listening").await;
    RunningSource {
        child,
        admin: field(&banner, "admin"),
        monitoring: field(&banner, "monitoring"),
    }
}

/// The address logged as `name=ADDR` in `line`.
fn field(line: &str, name: &str) -> SocketAddr {
    if let Some(addr) = json_field(line, name) {
        return addr;
    }
    let start = line
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("no {name}= in {line}"))
        + name.len()
        + 1;
    line[start..].split_whitespace().next().unwrap().parse().unwrap()
}

/// Starts the binary with `args` (from `cwd`, else the package root) and
/// waits for its `banner` line: the child, the lines before it, the line,
/// and the lines after it as they come (drained, so the child never blocks
/// on a full pipe).
async fn spawn_until_listening(
    cwd: Option<&std::path::Path>,
    args: &[&str],
    env: &[(&str, &str)],
    banner: &str,
) -> (
    tokio::process::Child,
    Vec<String>,
    String,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use tokio::io::AsyncBufReadExt;
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-xds-gateway"));
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    command.envs(env.iter().copied());
    let mut child = command
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the gateway binary");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut log = Vec::new();
    let line = within(&format!("{banner:?} in the log"), async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the binary logs before exiting");
            if line.contains(banner) {
                return line;
            }
            log.push(line);
        }
    })
    .await;
    let (tx, later) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(line);
        }
    });
    (child, log, line, later)
}

/// Writes `name` in `dir` whole at once: written aside under a name no
/// source reads (`.NAME.tmp`), then renamed over it, so a directory watcher
/// never reads it half written.
pub fn write_whole(dir: &std::path::Path, name: &str, bytes: &[u8]) {
    let aside = dir.join(format!(".{name}.tmp"));
    std::fs::write(&aside, bytes).unwrap();
    std::fs::rename(&aside, dir.join(name)).unwrap();
}

/// Makes a FIFO at `path`, or fails the test: a case that needs one is
/// never skipped.
pub fn mkfifo(path: &std::path::Path) {
    let made = std::process::Command::new("mkfifo").arg(path).status();
    assert!(
        made.as_ref().is_ok_and(|s| s.success()),
        "mkfifo {}: {made:?}",
        path.display()
    );
}
