//! A real Envoy 1.40 with traffic through it while its clusters and routes
//! change (make before break, see `make_before_break` for the wire): the
//! files source swapped whole as a Kubernetes volume is, a route moved to a
//! new cluster, back, and from one cluster to another that replaces it, 20
//! times, state of the world and delta, static and EDS clusters. Every
//! request through Envoy's listener must be answered 200 by a backend: a
//! route sent before its cluster (or its cluster's endpoints), or a cluster
//! removed before the route away from it, is a 503 (`NC`, `UH`) here.
//! Ignored (with the reason) where Envoy is not installed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::helpers::envoy::{AdsApi, Envoy};
use crate::helpers::{eventually_some, start_gateway, within};
use crate::make_before_break::{Config, Kind, Volume};
use mcp_xds_gateway::app::Bound;

/// A backend that answers every HTTP/1.1 request 200 with its name, on
/// kept-alive connections.
async fn backend(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = find(&buf, b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let reply = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{name}", name.len());
                        if socket.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    addr
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// What the traffic saw: every answer's status and backend, in order.
#[derive(Default)]
struct Seen {
    ok: AtomicU64,
    failures: Mutex<Vec<String>>,
    /// The backends of the last answers (a window).
    last: Mutex<std::collections::VecDeque<String>>,
    /// What the test is doing (a round's restart, say) and since when: a
    /// failure names it, so a lost request says which step lost it.
    phase: Mutex<Option<(String, Instant)>>,
}

impl Seen {
    /// The test's next step, named in the failures that follow.
    fn phase(&self, what: String) {
        *self.phase.lock().unwrap() = Some((what, Instant::now()));
    }

    /// A failure as it is reported: the step it came in, how long after
    /// the step began, and when on the wall clock in UTC (Envoy's log's
    /// clock, see `Envoy::start_with_args`).
    fn failed(&self, what: String) {
        let phase = match &*self.phase.lock().unwrap() {
            Some((name, since)) => format!("{name} +{} ms", since.elapsed().as_millis()),
            None => "start".to_owned(),
        };
        let at = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        self.failures.lock().unwrap().push(format!("{phase} at {at}: {what}"));
    }

    fn record(&self, status: u16, body: &str, headers: &str) {
        if status == 200 {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            let flags = headers
                .lines()
                .find(|l| l.to_ascii_lowercase().starts_with("x-envoy-response-flags"))
                .unwrap_or_default()
                .to_owned();
            self.failed(format!("{status} {flags} {}", body.trim()));
        }
        let mut last = self.last.lock().unwrap();
        last.push_back(if status == 200 {
            body.to_owned()
        } else {
            status.to_string()
        });
        if last.len() > 20 {
            last.pop_front();
        }
    }

    /// The last 20 answers all came from `name`.
    fn settled_on(&self, name: &str) -> bool {
        let last = self.last.lock().unwrap();
        last.len() == 20 && last.iter().all(|b| b == name)
    }
}

/// Sends GET / to `listener` over one kept-alive connection until `stop`,
/// recording each answer; a connection that fails mid-request is a failure.
async fn traffic(listener: SocketAddr, seen: Arc<Seen>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut socket) = TcpStream::connect(listener).await else {
            seen.failed("connect refused".into());
            continue;
        };
        let mut buf = Vec::new();
        'connection: while !stop.load(Ordering::Relaxed) {
            if socket.write_all(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n").await.is_err() {
                seen.failed("write failed".into());
                break;
            }
            // One response: headers, then content-length bytes.
            let mut chunk = [0u8; 4096];
            loop {
                if let Some(end) = find(&buf, b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            let (name, value) = l.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse().ok())
                                .flatten()
                        })
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + length {
                        let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).into_owned();
                        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
                        seen.record(status, &body, &head);
                        buf.drain(..end + 4 + length);
                        // A listener Envoy drains closes its connections
                        // after a response that says so: a new one follows.
                        if head.to_ascii_lowercase().contains("\r\nconnection: close") {
                            break 'connection;
                        }
                        break;
                    }
                }
                match tokio::time::timeout(Duration::from_secs(10), socket.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                    _ => {
                        seen.failed("connection closed mid-request".into());
                        break 'connection;
                    }
                }
            }
        }
    }
}

/// A real Envoy on a gateway serving `volume`, and traffic through its
/// listener on `connections` kept-alive connections.
struct Running {
    envoy: Envoy,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Starts them; returns once the traffic reaches backend `first` (the
    /// listener active: its route came).
    async fn start(volume: &Volume, api: AdsApi, connections: usize, first: &str) -> (Bound, Running) {
        Self::start_with(volume, api, connections, first, &[], &[]).await
    }

    /// As [`Running::start`], with more of the gateway's flags and Envoy's.
    async fn start_with(
        volume: &Volume,
        api: AdsApi,
        connections: usize,
        first: &str,
        gateway_flags: &[&str],
        envoy_args: &[&str],
    ) -> (Bound, Running) {
        let mut flags = vec!["--source-dir", volume.path()];
        flags.extend_from_slice(gateway_flags);
        let gw = start_gateway(&flags).await;
        let bootstrap = crate::helpers::envoy::bootstrap(gw.listen, api, "envoy-order");
        let envoy = Envoy::start_with_args(bootstrap, envoy_args)
            .await
            .unwrap_or_else(|why| panic!("Envoy: {why}"));
        envoy
            .listeners_when("Envoy's listener to be active", |l| {
                l.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>() == ["http"]
            })
            .await;
        let listener = listener_address(&envoy).await;
        let seen = Arc::new(Seen::default());
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..connections)
            .map(|_| tokio::spawn(traffic(listener, seen.clone(), stop.clone())))
            .collect();
        eventually_some(&format!("traffic to reach {first}"), || async {
            seen.settled_on(first).then_some(())
        })
        .await;
        let running = Running {
            envoy,
            seen,
            stop,
            workers,
        };
        (gw, running)
    }

    /// Stops the traffic, says what it saw over `what`, and requires that
    /// no request was lost and some were answered.
    async fn lost_nothing(&mut self, who: &str, what: &str) {
        let (failures, ok) = self.stop().await;
        eprintln!("{who}: {ok} answered 200, {} failed over {what}", failures.len());
        let log = self.envoy.log();
        assert!(
            failures.is_empty(),
            "{who}: {} of {} requests lost over {what}: {:#?}\nEnvoy's log around the first:\n{}\nEnvoy's log's end:\n{}",
            failures.len(),
            ok + failures.len() as u64,
            &failures[..failures.len().min(20)],
            failures.first().map_or_else(String::new, |first| around(&log, first, 60)),
            crate::helpers::peers::tail(&log, 40)
        );
        assert!(ok > 0);
    }

    /// Stops the traffic: the failures, and how many were answered 200.
    async fn stop(&mut self) -> (Vec<String>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers.drain(..) {
            within("the traffic to stop", worker).await.unwrap();
        }
        let failures = self.seen.failures.lock().unwrap().clone();
        (failures, self.seen.ok.load(Ordering::Relaxed))
    }
}

/// The lines of Envoy's `log` (UTC) around `failure` (as [`Seen::failed`]
/// writes it): the `n` up to its millisecond and `n / 2` after.
fn around(log: &str, failure: &str, n: usize) -> String {
    // `... at 2026-12-05T23:10:50.936Z: ...` against `[2026-12-05 23:10:50.936]`.
    let Some(at) = failure.split(" at ").nth(1).and_then(|at| at.get(..23)) else {
        return String::new();
    };
    let at = at.replacen('T', " ", 1);
    let lines: Vec<&str> = log.lines().collect();
    let end = lines
        .iter()
        .rposition(|line| line.get(1..24).is_some_and(|stamp| stamp <= at.as_str()))
        .map_or(0, |last| last + 1);
    let after = (end + n / 2).min(lines.len());
    format!(
        "{}\n--- the failure ---\n{}",
        lines[end.saturating_sub(n)..end].join("\n"),
        lines[end..after].join("\n")
    )
}

/// Stops `gw`, does `meanwhile` to `volume` (a change of the source while
/// it is down), and starts it again on the same port on `volume` with
/// `flags`.
async fn restart(
    gw: Bound,
    volume: &mut Volume,
    flags: &[&str],
    round: usize,
    meanwhile: impl FnOnce(&mut Volume),
) -> Bound {
    let listen = gw.listen.to_string();
    assert!(gw.shutdown().await, "round {round}: the gateway stops");
    meanwhile(volume);
    let mut again = vec!["--source-dir", volume.path()];
    again.extend_from_slice(flags);
    crate::helpers::start_gateway_on(&listen, &again).await
}

/// Envoy's listener `http`, once it is up.
async fn listener_address(envoy: &Envoy) -> SocketAddr {
    eventually_some("Envoy's listener http to be up", || async {
        let text = envoy.listeners().await;
        text.lines()
            .find_map(|l| l.strip_prefix("http::"))
            .and_then(|a| a.trim().parse::<SocketAddr>().ok())
            .filter(|a| a.port() != 0)
    })
    .await
}

/// A version's clusters (name, port), the route's cluster, and the clusters
/// Envoy runs once it took the version whole.
type Transition<'a> = (&'a [(&'a str, u16)], &'a str, &'a [&'a str]);

async fn no_request_lost(api: AdsApi, kind: Kind) {
    let a = backend("cluster-a").await.port();
    let b = backend("cluster-b").await.port();
    let version = |clusters: &[(&str, u16)], route_to: &str| {
        let mut config = Config::new(kind, clusters, route_to);
        config.listener = true;
        config
    };
    let mut volume = Volume::new(&version(&[("cluster-a", a)], "cluster-a"));
    let (_gw, mut run) = Running::start(&volume, api, 2, "cluster-a").await;
    let (envoy, seen) = (&run.envoy, run.seen.clone());

    // Each transition, then its end state: the route's cluster answers every
    // request and the clusters Envoy runs are the version's.
    let transitions: [Transition; 4] = [
        // A new cluster, and the route to it.
        (
            &[("cluster-a", a), ("cluster-b", b)],
            "cluster-b",
            &["cluster-a", "cluster-b"],
        ),
        // Back, and the cluster removed.
        (&[("cluster-a", a)], "cluster-a", &["cluster-a"]),
        // A switch: cluster-b replaces cluster-a.
        (&[("cluster-b", b)], "cluster-b", &["cluster-b"]),
        // And back.
        (&[("cluster-a", a)], "cluster-a", &["cluster-a"]),
    ];
    let mut took = Vec::new();
    for round in 0..5 {
        for (clusters, route_to, running) in transitions {
            let before = seen.ok.load(Ordering::Relaxed);
            let swapped = Instant::now();
            volume.swap(&version(clusters, route_to));
            eventually_some(&format!("round {round}: traffic to move to {route_to}"), || async {
                seen.settled_on(route_to).then_some(())
            })
            .await;
            took.push(swapped.elapsed());
            envoy
                .clusters_when(&format!("round {round}: Envoy to run {running:?}"), |c| {
                    let mut names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
                    names.sort_unstable();
                    names == running
                })
                .await;
            let during = seen.ok.load(Ordering::Relaxed) - before;
            assert!(
                during >= 20,
                "round {round}: traffic flowed through the transition ({during} answers)"
            );
        }
    }
    // A change of one type (the route, between two clusters Envoy runs)
    // waits for nothing: how long it takes is printed beside the others'.
    let both = [("cluster-a", a), ("cluster-b", b)];
    volume.swap(&version(&both, "cluster-a"));
    envoy
        .clusters_when("Envoy to run both clusters", |c| c.len() == 2)
        .await;
    let mut single = Vec::new();
    for route_to in ["cluster-b", "cluster-a", "cluster-b", "cluster-a"] {
        let swapped = Instant::now();
        volume.swap(&version(&both, route_to));
        eventually_some(&format!("the route alone to move to {route_to}"), || async {
            seen.settled_on(route_to).then_some(())
        })
        .await;
        single.push(swapped.elapsed());
    }
    let (failures, ok) = run.stop().await;
    let envoy = &run.envoy;
    took.sort();
    single.sort();
    // Each time includes the files source's settle (100 ms) and the 20
    // answers the traffic waits for.
    eprintln!(
        "{api:?} {kind:?}: {ok} answered 200, {} failed over 24 transitions; swap to traffic moved: median {:?}, \
         max {:?} (several types); median {:?}, max {:?} (the route alone)",
        failures.len(),
        took[took.len() / 2],
        took[took.len() - 1],
        single[single.len() / 2],
        single[single.len() - 1],
    );
    assert!(
        failures.is_empty(),
        "{api:?} {kind:?}: {} of {} requests lost: {:?}\nEnvoy's log:\n{}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(20)],
        crate::helpers::peers::tail(&envoy.log(), 40)
    );
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(0));
}

/// Cluster `name`'s connect timeout among the active clusters of a config
/// dump, when no cluster is warming.
fn active_connect_timeout(dump: &serde_json::Value, name: &str) -> Option<String> {
    let clusters = crate::helpers::envoy::section(dump, "ClustersConfigDump")?;
    let warming = clusters["dynamic_warming_clusters"].as_array().map_or(0, Vec::len);
    let active = clusters["dynamic_active_clusters"].as_array()?;
    let cluster = active.iter().find(|c| c["cluster"]["name"] == name)?;
    (warming == 0).then(|| cluster["cluster"]["connect_timeout"].as_str().map(str::to_owned))?
}

/// A changed EDS cluster is a new cluster to Envoy, warming until its
/// endpoints come (the files give it 5 minutes: a cluster left without them
/// would stay warming past the test's wait): they come, it takes over, and
/// no request is lost.
async fn a_changed_eds_cluster_takes_over(api: AdsApi) {
    let a = backend("cluster-a").await.port();
    let version = |connect_timeout: &'static str| {
        let mut config = Config::new(Kind::Eds, &[("cluster-a", a)], "cluster-a");
        config.listener = true;
        config.connect_timeout = connect_timeout;
        config
    };
    let mut volume = Volume::new(&version("1s"));
    let (_gw, mut run) = Running::start(&volume, api, 1, "cluster-a").await;
    for timeout in ["2s", "3s", "1s", "2s"] {
        volume.swap(&version(timeout));
        run.envoy
            .dump_matches(&format!("cluster-a at connect timeout {timeout}, warm"), |d| {
                active_connect_timeout(d, "cluster-a").as_deref() == Some(timeout)
            })
            .await;
    }
    let (failures, ok) = run.stop().await;
    assert!(failures.is_empty(), "{api:?}: requests lost: {failures:?}");
    assert!(ok > 0);
}

/// Envoy's drain of a replaced listener, and the gateway's, in seconds:
/// the gateway waits longer than Envoy drains.
const ENVOY_DRAIN_SECONDS: &str = "2";
const GATEWAY_DRAIN: &str = "4s";

/// A listener switched to another route configuration, and the cluster the
/// old one sent to removed in the same change: Envoy drains the old
/// listener, whose open connections keep its old routes, so the old
/// cluster must stay until the drain ends (`--listener-drain-time`), then
/// go. Meanwhile `/debug/syncz` shows the clusters DRAINING, counted as
/// SYNCED. Back and forth: no request answered but 200.
async fn a_drained_listener_keeps_its_cluster(api: AdsApi, kind: Kind) {
    let a = backend("cluster-a").await.port();
    let b = backend("cluster-b").await.port();
    let version = |cluster: &'static str, port: u16, route_name: &'static str| {
        let mut config = Config::new(kind, &[(cluster, port)], cluster);
        config.listener = true;
        config.route_name = route_name;
        config
    };
    let mut volume = Volume::new(&version("cluster-a", a, "route-a"));
    let (gw, mut run) = Running::start_with(
        &volume,
        api,
        4,
        "cluster-a",
        &["--listener-drain-time", GATEWAY_DRAIN],
        &["--drain-time-s", ENVOY_DRAIN_SECONDS],
    )
    .await;
    let (envoy, seen) = (&run.envoy, run.seen.clone());
    let admin = gw.admin;
    for (round, (cluster, port, route, old)) in [
        ("cluster-b", b, "route-b", "cluster-a"),
        ("cluster-a", a, "route-a", "cluster-b"),
        ("cluster-b", b, "route-b", "cluster-a"),
    ]
    .into_iter()
    .enumerate()
    {
        volume.swap(&version(cluster, port, route));
        // The new listener's connections reach the new cluster while the
        // old cluster stays for the draining one's.
        eventually_some(&format!("round {round}: traffic to move to {cluster}"), || async {
            seen.settled_on(cluster).then_some(())
        })
        .await;
        let row = eventually_some(
            &format!("round {round}: the clusters' removal to wait for the drain"),
            || async {
                let syncz = crate::helpers::get_json(admin, "/debug/syncz?node=envoy-order").await;
                syncz["rows"]
                    .as_array()?
                    .iter()
                    .find(|r| {
                        r["collection"] == "envoy/config/cluster/v3/clusters" && r["order"]["status"] == "DRAINING"
                    })
                    .cloned()
            },
        )
        .await;
        assert_eq!(
            row["status"], "SYNCED",
            "a removal waiting for a drain is in sync: {row}"
        );
        assert_eq!(row["order"]["reason"], "DRAINING");
        assert!(row["order"]["until"].is_string(), "{row}");
        // Then the drain ends and the old cluster goes.
        envoy
            .clusters_when(&format!("round {round}: Envoy to run {cluster} alone"), |c| {
                c.len() == 1 && c[0].0 == cluster
            })
            .await;
        assert!(
            envoy.dynamic_clusters().await.iter().all(|(n, _)| n != old),
            "round {round}: {old} removed"
        );
    }
    let (failures, ok) = run.stop().await;
    eprintln!(
        "{api:?} {kind:?}: {ok} answered 200, {} failed over 3 listener switches with the old cluster removed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{api:?} {kind:?}: {} of {} requests lost over 3 listener switches: {:?}\nEnvoy's log:\n{}",
        failures.len(),
        ok + failures.len() as u64,
        &failures[..failures.len().min(20)],
        crate::helpers::peers::tail(&run.envoy.log(), 40)
    );
    assert!(ok > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_drained_listener_keeps_its_cluster_state_of_the_world_eds() {
    a_drained_listener_keeps_its_cluster(AdsApi::Sotw, Kind::Eds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_drained_listener_keeps_its_cluster_delta_static() {
    a_drained_listener_keeps_its_cluster(AdsApi::Delta, Kind::Static).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_changed_eds_cluster_takes_over_state_of_the_world() {
    a_changed_eds_cluster_takes_over(AdsApi::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_changed_eds_cluster_takes_over_delta() {
    a_changed_eds_cluster_takes_over(AdsApi::Delta).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn no_request_is_lost_state_of_the_world_static_clusters() {
    no_request_lost(AdsApi::Sotw, Kind::Static).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn no_request_is_lost_state_of_the_world_eds_clusters() {
    no_request_lost(AdsApi::Sotw, Kind::Eds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn no_request_is_lost_delta_static_clusters() {
    no_request_lost(AdsApi::Delta, Kind::Static).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn no_request_is_lost_delta_eds_clusters() {
    no_request_lost(AdsApi::Delta, Kind::Eds).await;
}

/// The gateway restarts while the source routes away from a cluster and
/// removes it (a rolling update during a change): the delta Envoy that
/// comes back reports the cluster, the route away reaches it first and the
/// removal after (issue 41's re-check: the removal went in the first
/// clusters response, 0 to 6 requests `503 NC` per restart). A cluster and
/// the route to it added while the gateway was down come as any change,
/// also when the restarted gateway's first step lands between Envoy's
/// requests for its clusters and for its routes (about one run in 500
/// lost 7 to 77 requests `503 NC`, until the rollout served a type
/// followed then the step its other types hold: see
/// `rollout::tests::a_slot_made_before_the_fill_reads_the_step_the_others_hold`).
/// `--listener-drain-time 0s`, so that the order alone keeps the traffic
/// (with a drain the removal waits longer still).
async fn a_restart_during_a_change_loses_nothing(kind: Kind) {
    let a = backend("cluster-a").await.port();
    let b = backend("cluster-b").await.port();
    let version = |clusters: &[(&str, u16)], route_to: &str| {
        let mut config = Config::new(kind, clusters, route_to);
        config.listener = true;
        config
    };
    let both = [("cluster-a", a), ("cluster-b", b)];
    let mut volume = Volume::new(&version(&both, "cluster-b"));
    let flags = ["--listener-drain-time", "0s"];
    let (mut gw, mut run) = Running::start_with(&volume, AdsApi::Delta, 4, "cluster-b", &flags, &[]).await;
    let (envoy, seen) = (&run.envoy, run.seen.clone());
    for round in 0..3 {
        for (clusters, route_to, running) in [
            (&[("cluster-a", a)][..], "cluster-a", &["cluster-a"][..]),
            (&both[..], "cluster-b", &["cluster-a", "cluster-b"][..]),
        ] {
            seen.phase(format!("round {round}: the restart to route to {route_to}"));
            gw = restart(gw, &mut volume, &flags, round, |v| v.swap(&version(clusters, route_to))).await;
            seen.phase(format!("round {round}: restarted, routing to {route_to}"));
            eventually_some(&format!("round {round}: traffic to move to {route_to}"), || async {
                seen.settled_on(route_to).then_some(())
            })
            .await;
            envoy
                .clusters_when(&format!("round {round}: Envoy to run {running:?}"), |c| {
                    let mut names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
                    names.sort_unstable();
                    names == running
                })
                .await;
        }
    }
    run.lost_nothing(&format!("Delta {kind:?}"), "6 restarts during a change")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_restart_during_a_change_loses_nothing_delta_eds() {
    a_restart_during_a_change_loses_nothing(Kind::Eds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_restart_during_a_change_loses_nothing_delta_static() {
    a_restart_during_a_change_loses_nothing(Kind::Static).await;
}

/// The gateway restarts while Envoy drains a replaced listener whose
/// cluster the change removed: the delta Envoy that comes back reports the
/// cluster, and its removal waits a drain again (the re-check measured 309
/// to 403 requests `503 NC` on the draining connections when it went at
/// once). Then it goes.
async fn a_restart_during_a_drain_loses_nothing(kind: Kind) {
    let a = backend("cluster-a").await.port();
    let b = backend("cluster-b").await.port();
    let version = |cluster: &'static str, port: u16, route_name: &'static str| {
        let mut config = Config::new(kind, &[(cluster, port)], cluster);
        config.listener = true;
        config.route_name = route_name;
        config
    };
    let mut volume = Volume::new(&version("cluster-a", a, "route-a"));
    // Envoy drains gradually: long enough that the old listener's
    // connections still send to the old cluster when the gateway is back.
    let flags = ["--listener-drain-time", "10s"];
    let (mut gw, mut run) =
        Running::start_with(&volume, AdsApi::Delta, 4, "cluster-a", &flags, &["--drain-time-s", "8"]).await;
    let (envoy, seen) = (&run.envoy, run.seen.clone());
    for (round, (cluster, port, route)) in [("cluster-b", b, "route-b"), ("cluster-a", a, "route-a")]
        .into_iter()
        .enumerate()
    {
        volume.swap(&version(cluster, port, route));
        // Restarted as soon as the drain begins: the old listener's
        // connections still send to the old cluster.
        let admin = gw.admin;
        eventually_some(
            &format!("round {round}: the old cluster's removal to wait for the drain"),
            || async {
                let syncz = crate::helpers::get_json(admin, "/debug/syncz?node=envoy-order").await;
                syncz["rows"]
                    .as_array()?
                    .iter()
                    .any(|r| {
                        r["collection"] == "envoy/config/cluster/v3/clusters" && r["order"]["status"] == "DRAINING"
                    })
                    .then_some(())
            },
        )
        .await;
        // The gateway restarts during the drain.
        gw = restart(gw, &mut volume, &flags, round, |_| {}).await;
        eventually_some(&format!("round {round}: traffic to move to {cluster}"), || async {
            seen.settled_on(cluster).then_some(())
        })
        .await;
        envoy
            .clusters_when(
                &format!("round {round}: Envoy to run {cluster} alone, after the drain"),
                |c| c.len() == 1 && c[0].0 == cluster,
            )
            .await;
    }
    run.lost_nothing(&format!("Delta {kind:?}"), "2 restarts during a drain")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_restart_during_a_drain_loses_nothing_delta_static() {
    a_restart_during_a_drain_loses_nothing(Kind::Static).await;
}
