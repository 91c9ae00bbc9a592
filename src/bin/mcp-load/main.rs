//! mcp-load: drives a gateway with an embedded fake Galley and N real clients,
//! and reports initial sync time, end-to-end latency, gateway CPU per
//! delivered update, peak RSS, bytes per client per update and NACKs.
//!
//! `cargo build --release && cargo run --release --bin mcp-load -- --scenario fan-out`

mod abuse;
mod clients;
mod eds;
mod gateway;
mod grants;
mod publisher;
mod reader;
mod reconnect;
mod scenario;
mod soak;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use mcp_xds_gateway::collections::CollectionTable;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use clients::{Progress, Received};
use gateway::{ChildGateway, Resident};
use publisher::{Catalog, Collections, Publisher};
use scenario::{ClientProtocol, NamedShape, Scenario, Shape};
use tonic::transport::Channel;

/// How long a phase may take before the run gives up (a stuck gateway).
const PHASE_LIMIT: Duration = Duration::from_secs(300);

#[derive(Debug, Parser)]
#[command(name = "mcp-load", about = "Load and latency benchmarks for mcp-xds-gateway")]
struct Args {
    /// A named scenario; the flags below override its shape.
    #[arg(long, value_enum, default_value = "fan-out")]
    scenario: Scenario,
    /// Run the scenario at a size that takes seconds (smoke tests).
    #[arg(long)]
    tiny: bool,
    /// Collections the fake Galley publishes (the first N Galley serves by
    /// default; with --protocol xds-*, of those a GVK names).
    #[arg(long)]
    collections: Option<usize>,
    /// Resources in each collection.
    #[arg(long)]
    resources: Option<usize>,
    /// Bytes of each resource's body (eds: about, a ClusterLoadAssignment
    /// with as many endpoints as make it so).
    #[arg(long)]
    body_bytes: Option<usize>,
    /// Resources each update changes.
    #[arg(long)]
    changes_per_update: Option<usize>,
    /// Time between updates ("100ms", "1s").
    #[arg(long, value_parser = humantime::parse_duration)]
    update_interval: Option<Duration>,
    /// Updates published, one collection per update in turn (0: none, idle).
    #[arg(long)]
    updates: Option<usize>,
    /// The fake Galley sends incremental updates (true) or full states.
    #[arg(long)]
    upstream_incremental: Option<bool>,
    /// Client streams (state of the world: each asks for every collection;
    /// incremental: one collection each, in turn; eds: one named client each).
    #[arg(long)]
    streams: Option<usize>,
    /// HTTP/2 connections the streams are spread over.
    #[arg(long)]
    connections: Option<usize>,
    /// Clients ask for changes (true: IncrementalAggregatedResources, or delta
    /// with --protocol xds-delta) or for the state of the world.
    #[arg(long)]
    incremental: Option<bool>,
    /// The clients' protocol: mcp (the legacy AggregatedMeshConfigService),
    /// xds-sotw or xds-delta (Envoy's v3 ADS asking for GVKs, as istiod
    /// 1.8+ does; xds-delta makes the clients ask for changes). Default:
    /// mcp; with --scenario eds, xds-sotw (Envoy's EDS by name).
    #[arg(long, value_enum)]
    protocol: Option<ClientProtocol>,
    /// With --scenario eds or reconnect: names each client subscribes to, a
    /// random set drawn with --seed [default: 50].
    #[arg(long)]
    names_per_client: Option<usize>,
    /// With --scenario eds: the share of the resources changed at each update, in
    /// percent, drawn at random with --seed [default: 1].
    #[arg(long)]
    change_percent: Option<f64>,
    /// With --scenario eds or reconnect: the seed of the clients' name sets
    /// and of which resources change [default: 1].
    #[arg(long)]
    seed: Option<u64>,
    /// With --scenario eds: disjoint name sets (--streams x --names-per-client
    /// must not exceed --resources; --streams defaults to as many as fit), and
    /// only the first half of the clients' names change: the report counts
    /// what the other half receive (goal: nothing).
    #[arg(long)]
    eds_disjoint: bool,
    /// With --scenario reconnect: stop the gateway with SIGKILL (a crash)
    /// rather than SIGTERM.
    #[arg(long)]
    kill: bool,
    /// The gateway binary to start (default: mcp-xds-gateway beside this one).
    #[arg(long, conflicts_with = "target")]
    gateway: Option<PathBuf>,
    /// Measure a running AggregatedMeshConfigService instead: no fake Galley;
    /// latency is the spread from the first to the last client per version.
    #[arg(long)]
    target: Option<SocketAddr>,
    /// How long to observe a --target [default: 10s], or the soak's churn
    /// lasts [default: 1h; --tiny: 3s].
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// With --scenario soak: how often the gateway's RSS, descriptors and
    /// tasks are sampled [default: 30s; --tiny: 250ms].
    #[arg(long, value_parser = humantime::parse_duration)]
    sample_interval: Option<Duration>,
    /// With --scenario grants: the gateway's --max-grants-per-version (not
    /// given: its default, or a gateway without the flag).
    #[arg(long)]
    max_grants_per_version: Option<usize>,
    /// Attack the gateway while the scenario runs; the scenario's clients
    /// are the canaries whose latency is reported.
    #[arg(long, value_enum, conflicts_with = "target")]
    abuse: Option<abuse::Abuse>,
    /// Gateways in a chain: the first dials the fake Galley, each next one
    /// the previous one's ResourceSource, and the clients the last.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4), conflicts_with = "target")]
    chain: u8,
    /// Pin the gateway to one core and the load tool to the others, so the
    /// gateway's CPU is its own (the wire-bound writer is pinned the same way).
    #[arg(long, conflicts_with = "target")]
    pin: bool,
    /// The largest HTTP/2 frame the clients accept (SETTINGS_MAX_FRAME_SIZE,
    /// 16384 to 16777215). grpc-go (istiod, Pilot) and Envoy accept 16 KiB;
    /// the default lets a full state travel in one frame.
    #[arg(long, default_value_t = 16_777_215, value_parser = clap::value_parser!(u32).range(16_384..=16_777_215))]
    client_max_frame_size: u32,
    /// How long after every stream synced the gateway's RSS is read again,
    /// at rest (the sync's burst over, its freed memory given back if the
    /// gateway does: its --memory-trim-interval is 2 s by default). "0s":
    /// not read.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    rest: std::time::Duration,
    /// The Istio releases the v3 clients say they are (ISTIO_VERSION in
    /// their node), in turn by stream: `1.1` or `1.1,1.3,1.7` (the gateway
    /// keeps the skew of what they read per release). Unset: none says.
    #[arg(long, value_delimiter = ',')]
    generations: Vec<String>,
    /// Every body is an Istio DestinationRule of --body-bytes that sets a
    /// field of Istio 1.5 (older releases drop it), not opaque bytes.
    #[arg(long)]
    istio_bodies: bool,
}

impl Args {
    /// Flags that contradict each other or the scenario; the message names
    /// them.
    fn check(&self) -> Result<(), String> {
        let (eds, reconnect) = (self.scenario == Scenario::Eds, self.scenario == Scenario::Reconnect);
        let soak = self.scenario == Scenario::Soak;
        let named_only = [
            ("--names-per-client", self.names_per_client.is_some()),
            ("--seed", self.seed.is_some()),
        ];
        if let (false, Some((flag, _))) = (eds || reconnect || soak, named_only.iter().find(|(_, given)| *given)) {
            return Err(format!("{flag} applies to --scenario eds, reconnect or soak only"));
        }
        let grants = self.scenario == Scenario::Grants;
        if self.max_grants_per_version.is_some() && !grants {
            return Err("--max-grants-per-version applies to --scenario grants only".into());
        }
        if grants {
            let not_with_grants = [
                ("--target", self.target.is_some()),
                ("--abuse", self.abuse.is_some()),
                ("--chain", self.chain > 1),
                ("--pin", self.pin),
                ("--protocol", self.protocol.is_some()),
                ("--collections", self.collections.is_some()),
                ("--updates", self.updates.is_some()),
            ];
            if let Some((flag, _)) = not_with_grants.iter().find(|(_, given)| *given) {
                return Err(format!(
                    "{flag} does not apply to --scenario grants (one collection of clusters, read once by each \
                     identity over mTLS, as Envoy's CDS)"
                ));
            }
            let shape = self.shape();
            if shape.streams == 0 || shape.resources < 2 {
                return Err("--scenario grants needs --streams of at least 1 and --resources of at least 2".into());
            }
        }
        if self.sample_interval.is_some() && !soak {
            return Err("--sample-interval applies to --scenario soak only".into());
        }
        if self.duration.is_some() && !soak && self.target.is_none() {
            return Err("--duration applies to --target or --scenario soak only".into());
        }
        if soak {
            return self.check_soak();
        }
        let eds_only = [
            ("--change-percent", self.change_percent.is_some()),
            ("--eds-disjoint", self.eds_disjoint),
        ];
        if let (false, Some((flag, _))) = (eds, eds_only.iter().find(|(_, given)| *given)) {
            return Err(format!("{flag} applies to --scenario eds only"));
        }
        if self.kill && !reconnect {
            return Err("--kill applies to --scenario reconnect only".into());
        }
        if !eds && !reconnect {
            return Ok(());
        }
        let scenario = if eds { "eds" } else { "reconnect" };
        let not_with_named = [
            ("--target", self.target.is_some()),
            ("--abuse", self.abuse.is_some()),
            ("--collections", self.collections.is_some()),
            ("--incremental", self.incremental.is_some()),
            ("--changes-per-update", self.changes_per_update.is_some()),
        ];
        let not_with_reconnect = [
            ("--updates", self.updates.is_some()),
            ("--update-interval", self.update_interval.is_some()),
            ("--upstream-incremental", self.upstream_incremental.is_some()),
            ("--chain", self.chain > 1),
        ];
        if let Some((flag, _)) = not_with_named
            .iter()
            .chain(not_with_reconnect.iter().filter(|_| reconnect))
            .find(|(_, given)| *given)
        {
            return Err(format!(
                "{flag} does not apply to --scenario {scenario} (it publishes one collection to named clients; \
                 --change-percent sets the changes of eds, --protocol the clients' kind; reconnect publishes \
                 nothing after the clients synced, and restarts one gateway)"
            ));
        }
        if self.protocol == Some(ClientProtocol::Mcp) {
            return Err(format!(
                "--scenario {scenario} needs --protocol xds-sotw or xds-delta (names are xDS subscriptions)"
            ));
        }
        let (shape, named) = (self.shape(), self.named());
        if !(0.0..=100.0).contains(&named.change_percent) {
            return Err(format!("--change-percent {} is not 0 to 100", named.change_percent));
        }
        if named.names_per_client == 0 || named.names_per_client > shape.resources {
            return Err(format!(
                "--names-per-client {} must be 1 to --resources ({})",
                named.names_per_client, shape.resources
            ));
        }
        if shape.streams == 0 {
            return Err("--streams must be at least 1".into());
        }
        if named.disjoint && shape.streams * named.names_per_client > shape.resources {
            return Err(format!(
                "--eds-disjoint: {} streams x {} names need {} resources; --resources is {}",
                shape.streams,
                named.names_per_client,
                shape.streams * named.names_per_client,
                shape.resources
            ));
        }
        Ok(())
    }

    /// The soak's flags: it runs every protocol against one child gateway.
    fn check_soak(&self) -> Result<(), String> {
        let not_with_soak = [
            ("--target", self.target.is_some()),
            ("--abuse", self.abuse.is_some()),
            ("--chain", self.chain > 1),
            ("--pin", self.pin),
            ("--protocol", self.protocol.is_some()),
            ("--incremental", self.incremental.is_some()),
            ("--updates", self.updates.is_some()),
            ("--upstream-incremental", self.upstream_incremental.is_some()),
            ("--connections", self.connections.is_some()),
            ("--change-percent", self.change_percent.is_some()),
            ("--eds-disjoint", self.eds_disjoint),
            ("--kill", self.kill),
        ];
        if let Some((flag, _)) = not_with_soak.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} does not apply to --scenario soak (its clients speak every protocol, each on a connection \
                 of its own, and it publishes until --duration has passed)"
            ));
        }
        let soak = self.soak();
        if soak.sample_interval.is_zero() || soak.duration.is_zero() {
            return Err("--duration and --sample-interval must be more than 0".into());
        }
        let shape = self.shape();
        if shape.streams < 2 * soak::KINDS.len() {
            return Err(format!(
                "--scenario soak needs --streams of at least {} (a resident and a churning client of each kind)",
                2 * soak::KINDS.len()
            ));
        }
        if soak.names_per_client == 0 {
            return Err("--names-per-client must be at least 1".into());
        }
        Ok(())
    }

    /// The soak's duration, sampling and named clients.
    fn soak(&self) -> soak::SoakShape {
        let base = soak::SoakShape::new(self.tiny);
        soak::SoakShape {
            duration: self.duration.unwrap_or(base.duration),
            sample_interval: self.sample_interval.unwrap_or(base.sample_interval),
            names_per_client: self.names_per_client.unwrap_or(base.names_per_client),
            seed: self.seed.unwrap_or(base.seed),
            ..base
        }
    }

    /// The named scenario's subscriptions and changes.
    fn named(&self) -> NamedShape {
        let base = NamedShape::default();
        let base = if self.tiny { base.tiny() } else { base };
        NamedShape {
            names_per_client: self.names_per_client.unwrap_or(base.names_per_client),
            change_percent: self.change_percent.unwrap_or(base.change_percent),
            seed: self.seed.unwrap_or(base.seed),
            disjoint: self.eds_disjoint,
        }
    }

    fn shape(&self) -> Shape {
        let base = self.scenario.shape();
        let base = if self.tiny { base.tiny() } else { base };
        let protocol = self.protocol.unwrap_or(base.protocol);
        let resources = self.resources.unwrap_or(base.resources);
        if matches!(self.scenario, Scenario::Eds | Scenario::Reconnect) {
            let named = self.named();
            // Disjoint sets: by default as many clients as the names allow.
            let fit = resources / named.names_per_client.max(1);
            let streams = match (self.streams, named.disjoint) {
                (Some(streams), _) => streams,
                (None, true) => base.streams.min(fit),
                (None, false) => base.streams,
            };
            return Shape {
                resources,
                body_bytes: self.body_bytes.unwrap_or(base.body_bytes),
                changes_per_update: named.changes_per_update(resources),
                update_interval: self.update_interval.unwrap_or(base.update_interval),
                updates: self.updates.unwrap_or(base.updates),
                upstream_incremental: self.upstream_incremental.unwrap_or(base.upstream_incremental),
                streams,
                connections: self.connections.unwrap_or(base.connections).min(streams.max(1)),
                incremental_clients: protocol == ClientProtocol::XdsDelta,
                protocol,
                ..base
            };
        }
        if self.scenario == Scenario::Soak {
            // A resident and a churning client of each kind, even tiny.
            let streams = self
                .streams
                .unwrap_or(if self.tiny { 2 * soak::KINDS.len() } else { base.streams });
            return Shape {
                collections: self.collections.unwrap_or(base.collections),
                resources,
                body_bytes: self.body_bytes.unwrap_or(base.body_bytes),
                changes_per_update: self.changes_per_update.unwrap_or(base.changes_per_update),
                update_interval: self.update_interval.unwrap_or(base.update_interval),
                streams,
                connections: streams,
                ..base
            };
        }
        Shape {
            collections: self.collections.unwrap_or(base.collections),
            resources,
            body_bytes: self.body_bytes.unwrap_or(base.body_bytes),
            changes_per_update: self.changes_per_update.unwrap_or(base.changes_per_update),
            update_interval: self.update_interval.unwrap_or(base.update_interval),
            updates: self.updates.unwrap_or(base.updates),
            upstream_incremental: self.upstream_incremental.unwrap_or(base.upstream_incremental),
            streams: self.streams.unwrap_or(base.streams),
            connections: self.connections.unwrap_or(base.connections),
            incremental_clients: match protocol {
                ClientProtocol::Mcp => self.incremental.unwrap_or(base.incremental_clients),
                ClientProtocol::XdsSotw => false,
                ClientProtocol::XdsDelta => true,
            },
            protocol,
        }
    }
}

#[derive(Debug, Default, serde::Serialize)]
struct Report {
    scenario: Option<Scenario>,
    goal: &'static str,
    shape: Option<Shape>,
    streams: usize,
    initial_sync_ms: f64,
    updates_published: usize,
    responses_delivered: usize,
    latency_p50_ms: f64,
    latency_p99_ms: f64,
    latency_max_ms: f64,
    gateway_cpu_seconds: Option<f64>,
    /// The kernel's share of the gateway's CPU (socket writes, mostly).
    gateway_cpu_system_seconds: Option<f64>,
    /// The load tool's own CPU in the same phase: it shares the machine.
    load_tool_cpu_seconds: Option<f64>,
    gateway_cpu_ms_per_delivered_update: Option<f64>,
    gateway_peak_rss_bytes: Option<u64>,
    gateway_rss_per_stream_bytes: Option<f64>,
    /// The same, read --rest after the streams synced: what idle streams
    /// keep once the sync's burst is over.
    gateway_rss_per_stream_at_rest_bytes: Option<f64>,
    /// The same, [anonymous, file-backed]: the heap's part, and the
    /// binary's pages first touched by the clients' paths.
    gateway_rss_anon_file_per_stream_at_rest_bytes: Option<[f64; 2]>,
    config_bytes: usize,
    bytes_per_client_per_update: f64,
    nacks: usize,
    stream_errors: usize,
    /// With --abuse: the attack, its size, and what it cost the gateway.
    abuse: Option<abuse::Abuse>,
    attackers_established: Option<usize>,
    attacker_messages: Option<usize>,
    attackers_refused: Option<usize>,
    gateway_rss_before_attack_bytes: Option<u64>,
    gateway_rss_under_attack_bytes: Option<u64>,
    /// With --chain: gateways in the chain (the figures above are the last
    /// one's, which the clients read), and the CPU of the ones before it.
    chain: usize,
    chain_upstream_cpu_seconds: Option<f64>,
    /// With --pin: the gateway's core and the load's cores.
    pinned: Option<wire::Pinning>,
    client_max_frame_size: u32,
    /// Every response the clients received while updates were published
    /// (coalesced versions included), and their bytes (gRPC framing included).
    responses_received: usize,
    bytes_received: u64,
    /// What the gateway wrote in the same phase (`/proc/<pid>/io`).
    gateway_bytes_written: Option<u64>,
    gateway_write_syscalls: Option<u64>,
    /// Written / received: HTTP/2 framing, upstream ACKs and logs make it a
    /// little over 1.
    written_per_received_byte: Option<f64>,
    write_syscalls_per_response: Option<f64>,
    bytes_per_write_syscall: Option<f64>,
    /// HTTP/2 DATA frames the clients read per response.
    data_frames_per_response: Option<f64>,
    /// The gateway's CPU per MB delivered, and a plain loopback TCP writer's
    /// sending the same responses over as many connections.
    gateway_cpu_us_per_mb: Option<f64>,
    wire: Option<wire::WireRun>,
    wire_cpu_us_per_mb: Option<f64>,
    /// The headline: gateway CPU per delivered byte / the wire's.
    times_wire: Option<f64>,
    /// With --scenario eds: a writer sending the same responses as records
    /// read at random from a buffer the collection's size, its CPU per MB,
    /// and the gateway's as a multiple of it (beside the headline).
    wire_scattered: Option<wire::WireRun>,
    wire_scattered_cpu_us_per_mb: Option<f64>,
    times_wire_scattered: Option<f64>,
    /// The measured (last) gateway's own share of the latency above (see
    /// [`PushLatency`]).
    gateway_push_latency: Option<PushLatency>,
    /// With --scenario eds: the named clients' figures (the latency above is
    /// per changed resource, from the source to each client it reaches).
    eds: Option<eds::NamedFigures>,
    /// With --scenario reconnect: the resync after the restart (the cost
    /// figures above are the restarted gateway's, for the resync).
    reconnect: Option<reconnect::ReconnectFigures>,
    /// With --scenario soak: the samples, the clients' churn and the verdict.
    soak: Option<soak::SoakFigures>,
    /// With --scenario grants: what each distinct identity's grant cost.
    grants: Option<grants::GrantsFigures>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Err(message) = args.check() {
        Args::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit();
    }
    // Thousands of client connections need descriptors.
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    match run(args).await {
        Ok(report) => {
            print_report(&report);
            if report.nacks > 0 || report.stream_errors > 0 {
                eprintln!("mcp-load: the run had NACKs or stream errors");
                return std::process::ExitCode::FAILURE;
            }
            if report.soak.as_ref().is_some_and(|s| !s.verdict.passed) {
                eprintln!("mcp-load: the soak failed (see its failures)");
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mcp-load: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The first `count` collections Galley serves by default; for xDS clients,
/// of those a GVK names.
fn collection_names(count: usize, protocol: ClientProtocol) -> anyhow::Result<Vec<String>> {
    let table = CollectionTable::builtin();
    let all: Vec<_> = table
        .default_subscriptions()
        .into_iter()
        .filter(|c| !protocol.is_xds() || table.gvk(c).is_some())
        .collect();
    if count == 0 || count > all.len() {
        anyhow::bail!("--collections must be 1 to {} with --protocol {protocol:?}", all.len());
    }
    Ok(all.iter().take(count).map(|c| c.to_string()).collect())
}

/// Waits until `count()` reaches `target`, or fails naming `what`.
async fn until(what: &str, target: usize, count: impl Fn() -> usize) -> anyhow::Result<()> {
    tokio::time::timeout(PHASE_LIMIT, async {
        while count() < target {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("{what}: {} of {target} after {PHASE_LIMIT:?}", count()))
}

/// The load's client streams, each a task that returns what it kept (`T`);
/// `finals` tells them the publisher's final state (`F`) once published.
struct Clients<F, T> {
    progress: Arc<Progress>,
    finals: watch::Sender<Option<F>>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<T>>,
}

impl<F, T: Send + 'static> Clients<F, T> {
    /// Opens `shape.connections` connections to `addr` and starts
    /// `shape.streams` streams over them: `stream(index, channel, finals,
    /// progress, stop)`.
    async fn start<S>(
        addr: SocketAddr,
        shape: &Shape,
        max_frame_size: u32,
        frames: Arc<clients::Frames>,
        stream: impl Fn(usize, Channel, watch::Receiver<Option<F>>, Arc<Progress>, CancellationToken) -> S,
    ) -> anyhow::Result<Self>
    where
        S: std::future::Future<Output = T> + Send + 'static,
    {
        let channels = clients::connect(addr, shape.connections, max_frame_size, frames)
            .await
            .with_context(|| format!("cannot connect to {addr}"))?;
        let progress = Arc::new(Progress::default());
        let (finals, finals_rx) = watch::channel(None);
        let stop = CancellationToken::new();
        let tasks = (0..shape.streams)
            .map(|i| {
                tokio::spawn(stream(
                    i,
                    channels[i % channels.len()].clone(),
                    finals_rx.clone(),
                    progress.clone(),
                    stop.clone(),
                ))
            })
            .collect();
        Ok(Self {
            progress,
            finals,
            stop,
            tasks,
        })
    }

    /// Stops every stream; what each kept, in stream order (a stream whose
    /// task failed is left out).
    async fn finish(self) -> Vec<T> {
        self.stop.cancel();
        let mut all = Vec::with_capacity(self.tasks.len());
        for task in self.tasks {
            if let Ok(kept) = task.await {
                all.push(kept);
            }
        }
        all
    }
}

/// The version-counting scenarios' client streams: every collection (state
/// of the world) or one each in turn (incremental), over the shape's
/// protocol.
async fn start_clients(
    addr: SocketAddr,
    shape: &Shape,
    names: &[String],
    max_frame_size: u32,
    frames: Arc<clients::Frames>,
) -> anyhow::Result<Clients<HashMap<String, String>, Vec<Received>>> {
    let collections: Vec<Arc<str>> = names.iter().map(|n| Arc::from(n.as_str())).collect();
    let kind = (shape.protocol, shape.incremental_clients);
    Clients::start(
        addr,
        shape,
        max_frame_size,
        frames,
        |i, channel, finals, progress, stop| {
            clients::run_stream(i, channel, collections.clone(), kind, finals, progress, stop)
        },
    )
    .await
}

async fn run(args: Args) -> anyhow::Result<Report> {
    let shape = args.shape();
    let _ = clients::GENERATIONS.set(args.generations.clone());
    let _ = publisher::ISTIO_BODIES.set(args.istio_bodies);
    if let Some(target) = args.target {
        let names = collection_names(shape.collections, shape.protocol)?;
        let duration = args.duration.unwrap_or(Duration::from_secs(10));
        return run_against_target(target, shape, &names, duration, args.client_max_frame_size).await;
    }
    let binary = match &args.gateway {
        Some(path) => path.clone(),
        None => gateway::default_binary()?,
    };
    let pinning = if args.pin {
        let pinning = wire::Pinning::plan()?;
        pinning.pin_load_tool()?;
        Some(pinning)
    } else {
        None
    };
    let run = Run {
        abuse: args.abuse.map(|kind| (kind, args.tiny)),
        chain: usize::from(args.chain),
        pinning,
        max_frame_size: args.client_max_frame_size,
        rest: args.rest,
    };
    let mut report = match args.scenario {
        Scenario::Eds => eds::run(&binary, shape, args.named(), run).await?,
        Scenario::Reconnect => reconnect::run(&binary, shape, args.named(), run, args.kill).await?,
        Scenario::Soak => soak::run(&binary, shape, args.soak(), run).await?,
        Scenario::Grants => {
            let grants = grants::GrantsShape {
                max_grants_per_version: args.max_grants_per_version,
                settle: Duration::from_millis(if args.tiny { 100 } else { 1000 }),
            };
            grants::run(&binary, shape, grants).await?
        }
        _ => {
            let names = collection_names(shape.collections, shape.protocol)?;
            run_with_child(&binary, shape, &names, run).await?
        }
    };
    report.scenario = Some(args.scenario);
    report.goal = args.scenario.goal();
    Ok(report)
}

/// How a run with a child gateway is set up besides its shape.
struct Run {
    abuse: Option<(abuse::Abuse, bool)>,
    chain: usize,
    pinning: Option<wire::Pinning>,
    max_frame_size: u32,
    /// `--rest`.
    rest: std::time::Duration,
}

/// The gateways under test: the one the clients read (the last of a chain)
/// and those before it.
struct Gateways {
    measured: ChildGateway,
    upstream: Vec<ChildGateway>,
}

impl Gateways {
    /// Starts a chain of `chain` gateways, the first reading `publisher`
    /// once it ACKed the initial state of every collection in `names`.
    async fn start<C: Catalog>(
        binary: &std::path::Path,
        publisher: &mut Publisher<C>,
        names: &[String],
        chain: usize,
        pinning: Option<wire::Pinning>,
    ) -> anyhow::Result<Self> {
        // With --pin, the measured gateway (the last of a chain) on its
        // core, any before it on the load's cores.
        let cores = |measured: bool| -> anyhow::Result<_> {
            pinning
                .map(|p| if measured { p.gateway_set() } else { p.load_set() })
                .transpose()
                .map_err(anyhow::Error::from)
        };
        let mut measured = ChildGateway::spawn(binary, publisher.addr, names, cores(chain == 1)?).await?;
        tokio::time::timeout(PHASE_LIMIT, publisher.wait_initial_acks(names.len()))
            .await
            .context("the gateway did not ACK the initial state in time")??;
        // Each next gateway dials the previous one.
        let mut upstream = Vec::new();
        for i in 1..chain {
            let next = ChildGateway::spawn(binary, measured.listen, names, cores(i == chain - 1)?).await?;
            upstream.push(std::mem::replace(&mut measured, next));
        }
        Ok(Self { measured, upstream })
    }

    /// The CPU seconds the gateways before the measured one used.
    fn upstream_cpu(&self) -> anyhow::Result<f64> {
        self.upstream
            .iter()
            .map(|g| g.cpu_seconds().map(|(user, system)| user + system))
            .sum()
    }

    async fn stop(self) {
        self.measured.stop().await;
        for upstream in self.upstream {
            upstream.stop().await;
        }
    }
}

/// What the gateways and the load tool had spent when a phase started.
struct Meter {
    cpu: (f64, f64),
    io: (u64, u64),
    data_frames: u64,
    upstream_cpu: f64,
    tool_cpu: (f64, f64),
}

/// What they spent in the phase.
struct Costs {
    cpu_user: f64,
    cpu_system: f64,
    /// Bytes and write syscalls of the measured gateway.
    written: u64,
    syscalls: u64,
    /// HTTP/2 DATA frames the clients read.
    data_frames: u64,
    upstream_cpu: f64,
    tool_cpu: f64,
}

impl Meter {
    fn start(gateways: &Gateways, frames: &clients::Frames) -> anyhow::Result<Self> {
        Ok(Self {
            cpu: gateways.measured.cpu_seconds()?,
            io: gateways.measured.io()?,
            data_frames: frames.data.load(Ordering::Relaxed),
            upstream_cpu: gateways.upstream_cpu()?,
            tool_cpu: gateway::cpu_seconds("/proc/self/stat")?,
        })
    }

    fn stop(self, gateways: &Gateways, frames: &clients::Frames) -> anyhow::Result<Costs> {
        let cpu = gateways.measured.cpu_seconds()?;
        let io = gateways.measured.io()?;
        let tool_cpu = gateway::cpu_seconds("/proc/self/stat")?;
        Ok(Costs {
            cpu_user: cpu.0 - self.cpu.0,
            cpu_system: cpu.1 - self.cpu.1,
            written: io.0 - self.io.0,
            syscalls: io.1 - self.io.1,
            data_frames: frames.data.load(Ordering::Relaxed) - self.data_frames,
            upstream_cpu: gateways.upstream_cpu()? - self.upstream_cpu,
            tool_cpu: (tool_cpu.0 + tool_cpu.1) - (self.tool_cpu.0 + self.tool_cpu.1),
        })
    }
}

/// One response a client received in a measured phase: when, its stream,
/// and its message's length.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Instant,
    stream: usize,
    bytes: usize,
}

/// The report's cost figures: what the gateway spent in the phase for the
/// responses `sent`, against a plain loopback TCP writer sending the same
/// responses (gRPC framing included) over as many connections, pinned like
/// the gateway.
///
/// With `scattered`, a second writer sends the same responses' bytes as
/// records read at random from a buffer the cache's size (see
/// [`wire::Source::Scattered`]): a figure beside the headline.
async fn cost_figures(
    costs: &Costs,
    mut sent: Vec<Sent>,
    connections: usize,
    pinning: Option<wire::Pinning>,
    scattered: Option<wire::Source>,
) -> anyhow::Result<Report> {
    // In order of arrival, on their connections, as the writer sends them.
    sent.sort_unstable_by_key(|s| s.at);
    let responses: Vec<(usize, usize)> = sent
        .iter()
        .map(|s| (s.stream % connections.max(1), s.bytes + GRPC_FRAME_HEADER))
        .collect();
    let bytes_received: u64 = responses.iter().map(|(_, len)| *len as u64).sum();
    let count = responses.len();
    let per_response = |n: u64| (count > 0).then(|| n as f64 / count as f64);
    let per_mb = |cpu: f64, bytes: u64| (bytes > 0).then(|| cpu * 1e6 / (bytes as f64 / 1e6));
    let responses = Arc::new(responses);
    let measure = |source: wire::Source| {
        let responses = responses.clone();
        async move {
            if responses.is_empty() {
                return Ok::<_, anyhow::Error>(None);
            }
            let run = tokio::task::spawn_blocking(move || wire::measure(&responses, connections, pinning, source));
            Ok(Some(run.await??))
        }
    };
    let wire = measure(wire::Source::Hot).await?;
    let wire_scattered = match scattered {
        Some(source) => measure(source).await?,
        None => None,
    };
    let cpu = costs.cpu_user + costs.cpu_system;
    let gateway_per_mb = per_mb(cpu, bytes_received);
    // A writer's CPU per MB, and the gateway's as a multiple of it.
    let against = |run: Option<wire::WireRun>| {
        let writer_per_mb = run.and_then(|w| per_mb(w.cpu_seconds, w.bytes));
        let times = gateway_per_mb
            .zip(writer_per_mb.filter(|w| *w > 0.0))
            .map(|(g, w)| g / w);
        (writer_per_mb, times)
    };
    let (wire_per_mb, times_wire) = against(wire);
    let (scattered_per_mb, times_wire_scattered) = against(wire_scattered);
    let (written, syscalls) = (costs.written, costs.syscalls);
    Ok(Report {
        gateway_cpu_seconds: Some(cpu),
        gateway_cpu_system_seconds: Some(costs.cpu_system),
        load_tool_cpu_seconds: Some(costs.tool_cpu),
        pinned: pinning,
        responses_received: count,
        bytes_received,
        gateway_bytes_written: Some(written),
        gateway_write_syscalls: Some(syscalls),
        written_per_received_byte: (bytes_received > 0).then(|| written as f64 / bytes_received as f64),
        write_syscalls_per_response: per_response(syscalls),
        bytes_per_write_syscall: (syscalls > 0).then(|| written as f64 / syscalls as f64),
        data_frames_per_response: per_response(costs.data_frames),
        gateway_cpu_us_per_mb: gateway_per_mb,
        wire,
        wire_cpu_us_per_mb: wire_per_mb,
        times_wire,
        wire_scattered,
        wire_scattered_cpu_us_per_mb: scattered_per_mb,
        times_wire_scattered,
        ..Default::default()
    })
}

/// What a run against child gateways measured, whatever its clients kept
/// (`T`, one per stream that did not fail).
struct Phases<T> {
    kept: Vec<T>,
    initial_sync: Duration,
    /// The measured gateway's RSS before the first client, with every client
    /// synced (and idle), at the end of the updates (under attack, with
    /// --abuse), and its peak.
    rss_before_clients: u64,
    rss_synced: u64,
    /// `run.rest` later, before any update; `None` with `--rest 0s`.
    rss_at_rest: Option<u64>,
    /// What the RSS before the first client and at rest are made of.
    resident_before_clients: Resident,
    resident_at_rest: Option<Resident>,
    rss_under_attack: u64,
    peak_rss: u64,
    update_start: Instant,
    /// From the first update until every client held the final state.
    update_phase: Duration,
    costs: Costs,
    errors: usize,
    nacks: usize,
    attack: Option<(abuse::Abuse, Arc<abuse::Attack>)>,
    /// The measured gateway's push latency during the updates.
    push_latency: Option<PushLatency>,
}

/// The phases of a run against child gateways: `catalog` published by the
/// fake Galley, `run.chain` gateways, `shape.streams` client streams
/// (`stream(index, channel, finals, progress, stop)`) synced, then (beside
/// any attack) every update published and every client at the final state
/// (`finals` of the catalog), the gateways' costs metered. Returns what was
/// measured and the publisher, whose catalog recorded what it published.
async fn run_phases<C, F, T, S>(
    binary: &std::path::Path,
    shape: &Shape,
    names: &[String],
    run: &Run,
    catalog: C,
    finals: impl FnOnce(&C) -> F,
    stream: impl Fn(usize, Channel, watch::Receiver<Option<F>>, Arc<Progress>, CancellationToken) -> S,
) -> anyhow::Result<(Phases<T>, Publisher<C>)>
where
    C: Catalog,
    T: Send + 'static,
    S: std::future::Future<Output = T> + Send + 'static,
{
    let mut publisher = Publisher::start(*shape, catalog).await?;
    let gateways = Gateways::start(binary, &mut publisher, names, run.chain, run.pinning).await?;
    let gateway = &gateways.measured;
    let resident_before_clients = gateway.resident()?;
    let rss_before_clients = resident_before_clients.total;

    let frames = Arc::new(clients::Frames::default());
    let sync_start = Instant::now();
    let clients = Clients::start(gateway.listen, shape, run.max_frame_size, frames.clone(), stream).await?;
    let progress = clients.progress.clone();
    until("streams synced", shape.streams, || {
        progress.synced.load(Ordering::Relaxed)
    })
    .await?;
    let initial_sync = sync_start.elapsed();
    let rss_synced = gateway.memory()?.0;
    let (rss_at_rest, resident_at_rest) = if run.rest.is_zero() {
        (None, None)
    } else {
        tokio::time::sleep(run.rest).await;
        let resident = gateway.resident()?;
        (Some(resident.total), Some(resident))
    };

    let attack_stop = CancellationToken::new();
    let attack = run.abuse.map(|(kind, tiny)| {
        let attack = abuse::start(kind, tiny, gateway.listen, names[0].clone(), attack_stop.clone());
        (kind, tiny, attack)
    });
    if let Some((kind, tiny, attack)) = &attack {
        until("attackers in place", kind.attackers(*tiny), || {
            attack.established.load(Ordering::Relaxed) + attack.refused.load(Ordering::Relaxed)
        })
        .await?;
    }

    let pushes_before = push_latency(gateway).await;
    let meter = Meter::start(&gateways, &frames)?;
    let update_start = Instant::now();
    publisher.run_updates().await?;
    clients.finals.send_replace(Some(publisher.read(finals).await));
    until("streams at the final version", shape.streams, || {
        progress.at_final.load(Ordering::Relaxed)
    })
    .await?;
    let update_phase = update_start.elapsed();
    let costs = meter.stop(&gateways, &frames)?;
    let push_latency = match (pushes_before, push_latency(gateway).await) {
        (Some(before), Some(after)) => PushLatency::of(&counted_since(&before, after)),
        _ => None,
    };
    let rss_under_attack = gateway.memory()?.0;
    attack_stop.cancel();
    let peak_rss = gateway.memory()?.1;
    let errors = progress.errors.load(Ordering::Relaxed);
    let kept = clients.finish().await;
    gateways.stop().await;
    let phases = Phases {
        kept,
        initial_sync,
        rss_before_clients,
        rss_synced,
        rss_at_rest,
        resident_before_clients,
        resident_at_rest,
        rss_under_attack,
        peak_rss,
        update_start,
        update_phase,
        costs,
        errors,
        nacks: publisher.nacks.load(Ordering::Relaxed),
        attack: attack.map(|(kind, _, attack)| (kind, attack)),
        push_latency,
    };
    Ok((phases, publisher))
}

/// The gateway's push-latency buckets, or `None` (said on stderr) where its
/// `/metrics` cannot be read: an optional figure, not worth a finished run.
async fn push_latency(gateway: &ChildGateway) -> Option<Vec<(f64, u64)>> {
    gateway
        .push_latency()
        .await
        .inspect_err(|e| eprintln!("the gateway's push latency is left out of the report: {e:#}"))
        .ok()
}

/// Cumulative histogram buckets counted from `before` to `after` (the same
/// bounds; a bound `before` lacks counts from zero).
fn counted_since(before: &[(f64, u64)], after: Vec<(f64, u64)>) -> Vec<(f64, u64)> {
    after
        .into_iter()
        .map(|(bound, count)| {
            let earlier = before.iter().find(|(b, _)| *b == bound).map_or(0, |(_, c)| *c);
            (bound, count.saturating_sub(earlier))
        })
        .collect()
}

/// The measured gateway's own share of the latency: of the responses it
/// handed to their connections during the updates, the share within each
/// bound of its push-latency histogram (from the version's apply in its
/// cache; the ingest before it, the socket and the client after it are not
/// in it, nor, with `--chain`, the gateways before it; with `--abuse`, the
/// attackers' streams are). Read from its `/metrics` before and after the
/// updates.
#[derive(Clone, Debug, serde::Serialize)]
struct PushLatency {
    pushes: u64,
    /// (bound in ms, share of the pushes within it), the finite bounds.
    within_ms: Vec<(f64, f64)>,
}

impl PushLatency {
    fn of(buckets: &[(f64, u64)]) -> Option<Self> {
        let pushes = buckets.iter().map(|(_, c)| *c).max().filter(|n| *n > 0)?;
        let within_ms = buckets
            .iter()
            .filter(|(bound, _)| bound.is_finite())
            .map(|(bound, count)| (bound * 1000.0, *count as f64 / pushes as f64))
            .collect();
        Some(PushLatency { pushes, within_ms })
    }
}

impl<T> Phases<T> {
    /// The gateway's RSS per client: synced and idle, less before the first.
    fn rss_per_stream(&self, streams: usize) -> f64 {
        self.per_stream(self.rss_synced, streams)
    }

    /// The same at rest (`--rest` after the sync).
    fn rss_per_stream_at_rest(&self, streams: usize) -> Option<f64> {
        self.rss_at_rest.map(|rss| self.per_stream(rss, streams))
    }

    /// The same split into anonymous and file-backed memory (each less its
    /// part before the first client): what the heap keeps, and the binary's
    /// pages the clients' paths touched, which no heap change moves.
    fn resident_per_stream_at_rest(&self, streams: usize) -> Option<[f64; 2]> {
        let (before, rest) = (self.resident_before_clients, self.resident_at_rest?);
        let per = |now: u64, then: u64| now.saturating_sub(then) as f64 / streams.max(1) as f64;
        Some([per(rest.anonymous, before.anonymous), per(rest.file, before.file)])
    }

    /// `rss` less the RSS before the first client, per stream.
    fn per_stream(&self, rss: u64, streams: usize) -> f64 {
        rss.saturating_sub(self.rss_before_clients) as f64 / streams.max(1) as f64
    }

    /// The report every scenario makes: `latencies` from the source to the
    /// clients, `sent` every response received in the update phase.
    async fn report(
        &self,
        shape: Shape,
        run: &Run,
        mut latencies: Vec<Duration>,
        sent: Vec<Sent>,
        scattered: Option<wire::Source>,
    ) -> anyhow::Result<Report> {
        let delivered = latencies.len();
        let (p50, p99, max) = percentiles(&mut latencies);
        let update_bytes: usize = sent.iter().map(|s| s.bytes).sum();
        let measured = cost_figures(&self.costs, sent, shape.connections, run.pinning, scattered).await?;
        let cpu = self.costs.cpu_user + self.costs.cpu_system;
        let attack = self.attack.as_ref();
        Ok(Report {
            shape: Some(shape),
            streams: shape.streams,
            initial_sync_ms: ms(self.initial_sync),
            updates_published: shape.updates,
            responses_delivered: delivered,
            latency_p50_ms: p50,
            latency_p99_ms: p99,
            latency_max_ms: max,
            gateway_cpu_ms_per_delivered_update: (delivered > 0).then(|| cpu * 1000.0 / delivered as f64),
            gateway_peak_rss_bytes: Some(self.peak_rss),
            gateway_rss_per_stream_bytes: Some(self.rss_per_stream(shape.streams)),
            gateway_rss_per_stream_at_rest_bytes: self.rss_per_stream_at_rest(shape.streams),
            gateway_rss_anon_file_per_stream_at_rest_bytes: self.resident_per_stream_at_rest(shape.streams),
            config_bytes: shape.config_bytes(),
            bytes_per_client_per_update: if shape.updates > 0 {
                update_bytes as f64 / (shape.streams * shape.updates) as f64
            } else {
                0.0
            },
            nacks: self.nacks,
            stream_errors: self.errors,
            abuse: attack.map(|(kind, _)| *kind),
            attackers_established: attack.map(|(_, a)| a.established.load(Ordering::Relaxed)),
            attacker_messages: attack.map(|(_, a)| a.messages.load(Ordering::Relaxed)),
            attackers_refused: attack.map(|(_, a)| a.refused.load(Ordering::Relaxed)),
            gateway_rss_before_attack_bytes: attack.map(|_| self.rss_synced),
            gateway_rss_under_attack_bytes: attack.map(|_| self.rss_under_attack),
            chain: run.chain,
            chain_upstream_cpu_seconds: (run.chain > 1).then_some(self.costs.upstream_cpu),
            client_max_frame_size: run.max_frame_size,
            gateway_push_latency: self.push_latency.clone(),
            ..measured
        })
    }
}

/// The version-counting scenarios: latency per collection version.
async fn run_with_child(binary: &std::path::Path, shape: Shape, names: &[String], run: Run) -> anyhow::Result<Report> {
    let collections: Vec<Arc<str>> = names.iter().map(|n| Arc::from(n.as_str())).collect();
    let kind = (shape.protocol, shape.incremental_clients);
    let (phases, publisher) = run_phases(
        binary,
        &shape,
        names,
        &run,
        Collections::new(shape, names),
        Collections::finals,
        |i, channel, finals, progress, stop| {
            clients::run_stream(i, channel, collections.clone(), kind, finals, progress, stop)
        },
    )
    .await?;
    let published = publisher.read(|c| c.published.clone()).await;
    let in_phase = || phases.kept.iter().flatten().filter(|r| r.at >= phases.update_start);
    let latencies = in_phase()
        .filter_map(|r| {
            let at = published.get(&r.version).filter(|at| **at >= phases.update_start)?;
            Some(r.at.saturating_duration_since(*at))
        })
        .collect();
    let sent = in_phase()
        .map(|r| Sent {
            at: r.at,
            stream: r.stream,
            bytes: r.bytes,
        })
        .collect();
    phases.report(shape, &run, latencies, sent, None).await
}

/// gRPC's per-message prefix: a compression flag and a 4-byte length.
const GRPC_FRAME_HEADER: usize = 5;

async fn run_against_target(
    target: SocketAddr,
    shape: Shape,
    names: &[String],
    duration: Duration,
    max_frame_size: u32,
) -> anyhow::Result<Report> {
    let sync_start = Instant::now();
    let frames = Arc::new(clients::Frames::default());
    let clients = start_clients(target, &shape, names, max_frame_size, frames).await?;
    let progress = clients.progress.clone();
    until("streams synced", shape.streams, || {
        progress.synced.load(Ordering::Relaxed)
    })
    .await?;
    let initial_sync = sync_start.elapsed();
    let observe_start = Instant::now();
    tokio::time::sleep(duration).await;
    let errors = progress.errors.load(Ordering::Relaxed);
    let received: Vec<Received> = clients.finish().await.into_iter().flatten().collect();

    // Without a publisher the latency is the spread of each version's arrival.
    let mut arrivals: HashMap<(Arc<str>, String), (Instant, Instant, usize)> = HashMap::new();
    let mut bytes = 0usize;
    for r in received.iter().filter(|r| r.at >= observe_start) {
        bytes += r.bytes;
        let entry = arrivals
            .entry((r.collection.clone(), r.version.clone()))
            .or_insert((r.at, r.at, 0));
        entry.0 = entry.0.min(r.at);
        entry.1 = entry.1.max(r.at);
        entry.2 += 1;
    }
    let mut spreads: Vec<Duration> = arrivals.values().map(|(first, last, _)| *last - *first).collect();
    let versions = arrivals.len();
    let delivered: usize = arrivals.values().map(|(_, _, n)| n).sum();
    let (p50, p99, max) = percentiles(&mut spreads);
    Ok(Report {
        goal: "spread between the first and last client per version",
        shape: Some(shape),
        streams: shape.streams,
        initial_sync_ms: ms(initial_sync),
        updates_published: versions,
        responses_delivered: delivered,
        latency_p50_ms: p50,
        latency_p99_ms: p99,
        latency_max_ms: max,
        config_bytes: 0,
        bytes_per_client_per_update: if versions > 0 {
            bytes as f64 / (shape.streams * versions) as f64
        } else {
            0.0
        },
        stream_errors: errors,
        ..Default::default()
    })
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// (p50, p99, max) in milliseconds; zeros when there is nothing.
fn percentiles(samples: &mut [Duration]) -> (f64, f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (ms(at(0.50)), ms(at(0.99)), ms(samples[samples.len() - 1]))
}

/// Bytes as MiB, one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// p50, p99 and max in milliseconds, as one cell.
fn three_ms(p50: f64, p99: f64, max: f64) -> String {
    format!("{p50} / {p99} / {max} ms")
}

fn print_report(report: &Report) {
    let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".into());
    let seconds = |s: Option<f64>| or_dash(s.map(|c| format!("{c:.2} s")));
    let rows: Vec<(&str, String)> = vec![
        ("scenario", or_dash(report.scenario.map(|s| format!("{s:?}")))),
        ("goal", report.goal.to_string()),
        ("streams", report.streams.to_string()),
        ("gateways in the chain", report.chain.max(1).to_string()),
        ("config bytes", mib(report.config_bytes as u64)),
        ("initial sync", format!("{} ms", report.initial_sync_ms)),
        ("updates published", report.updates_published.to_string()),
        ("responses delivered", report.responses_delivered.to_string()),
        (
            "latency p50 / p99 / max",
            three_ms(report.latency_p50_ms, report.latency_p99_ms, report.latency_max_ms),
        ),
        (
            "gateway: apply to write, within",
            or_dash(report.gateway_push_latency.as_ref().map(|p| {
                p.within_ms
                    .iter()
                    .filter(|(ms, _)| (5.0..=250.0).contains(ms))
                    .map(|(ms, share)| format!("{ms} ms {:.1} %", share * 100.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            })),
        ),
        ("gateway CPU", seconds(report.gateway_cpu_seconds)),
        ("gateway CPU in the kernel", seconds(report.gateway_cpu_system_seconds)),
        (
            "CPU of the gateways upstream",
            seconds(report.chain_upstream_cpu_seconds),
        ),
        ("load tool CPU", seconds(report.load_tool_cpu_seconds)),
        (
            "gateway CPU per delivered update",
            or_dash(report.gateway_cpu_ms_per_delivered_update.map(|c| format!("{c:.3} ms"))),
        ),
        ("gateway peak RSS", or_dash(report.gateway_peak_rss_bytes.map(mib))),
        (
            "gateway RSS per stream",
            or_dash(
                report
                    .gateway_rss_per_stream_bytes
                    .map(|b| format!("{:.1} KiB", b / 1024.0)),
            ),
        ),
        (
            "gateway RSS per stream at rest",
            or_dash(
                report
                    .gateway_rss_per_stream_at_rest_bytes
                    .map(|b| format!("{:.1} KiB", b / 1024.0)),
            ),
        ),
        (
            "  of which anonymous / file-backed",
            or_dash(
                report
                    .gateway_rss_anon_file_per_stream_at_rest_bytes
                    .map(|[anon, file]| format!("{:.2} / {:.2} KiB", anon / 1024.0, file / 1024.0)),
            ),
        ),
        (
            "bytes per client per update",
            format!("{:.0}", report.bytes_per_client_per_update),
        ),
        (
            "pinned (gateway core / load cores)",
            or_dash(
                report
                    .pinned
                    .map(|p| format!("{} / the other {}", p.gateway_core, p.load_cores)),
            ),
        ),
        ("client max frame size", report.client_max_frame_size.to_string()),
        ("responses received", report.responses_received.to_string()),
        ("bytes received", mib(report.bytes_received)),
        (
            "gateway wrote (per received byte)",
            or_dash(
                report
                    .gateway_bytes_written
                    .zip(report.written_per_received_byte)
                    .map(|(w, r)| format!("{} ({r:.3})", mib(w))),
            ),
        ),
        (
            "write syscalls per response",
            or_dash(report.write_syscalls_per_response.map(|s| format!("{s:.2}"))),
        ),
        (
            "bytes per write syscall",
            or_dash(report.bytes_per_write_syscall.map(|b| format!("{b:.0}"))),
        ),
        (
            "HTTP/2 DATA frames per response",
            or_dash(report.data_frames_per_response.map(|f| format!("{f:.2}"))),
        ),
        (
            "gateway CPU per MB delivered",
            or_dash(report.gateway_cpu_us_per_mb.map(|c| format!("{c:.0} µs"))),
        ),
        (
            "plain TCP writer CPU per MB",
            or_dash(report.wire_cpu_us_per_mb.map(|c| format!("{c:.0} µs"))),
        ),
        ("× wire", or_dash(report.times_wire.map(|x| format!("{x:.2}")))),
        (
            "writer of records at random, per MB (×)",
            or_dash(
                report
                    .wire_scattered_cpu_us_per_mb
                    .zip(report.times_wire_scattered)
                    .map(|(c, x)| format!("{c:.0} µs ({x:.2})")),
            ),
        ),
        ("NACKs", report.nacks.to_string()),
        ("stream errors", report.stream_errors.to_string()),
        ("abuse", or_dash(report.abuse.map(|a| format!("{a:?}")))),
        (
            "attackers in place / refused",
            or_dash(
                report
                    .attackers_established
                    .zip(report.attackers_refused)
                    .map(|(e, r)| format!("{e} / {r}")),
            ),
        ),
        (
            "attacker messages",
            or_dash(report.attacker_messages.map(|m| m.to_string())),
        ),
        (
            "gateway RSS before the attack",
            or_dash(report.gateway_rss_before_attack_bytes.map(mib)),
        ),
        (
            "gateway RSS under attack",
            or_dash(report.gateway_rss_under_attack_bytes.map(mib)),
        ),
    ];
    let rows = rows
        .into_iter()
        .chain(report.eds.iter().flat_map(eds::NamedFigures::rows))
        .chain(report.reconnect.iter().flat_map(reconnect::ReconnectFigures::rows))
        .chain(report.soak.iter().flat_map(soak::SoakFigures::rows))
        .chain(report.grants.iter().flat_map(grants::GrantsFigures::rows));
    for (name, value) in rows {
        println!("{name:<34} {value}");
    }
    println!("{}", serde_json::to_string(report).expect("the report serializes"));
}
