//! The reconnect scenario (`--scenario reconnect`): named v3 clients (as in
//! `eds.rs`) synced, then the gateway stopped (SIGTERM, or SIGKILL with
//! `--kill`: a crash) and started again with the same `--cache-dir`, and
//! every client reconnecting as Envoy does: delta with
//! `initial_resource_versions` (what it holds), state of the world with its
//! last `version_info`.
//!
//! Nothing changes at the source meanwhile, so every client already holds the
//! current state: what the gateway sends after the restart is the cost of a
//! resync, and `bytes_already_held` says how much of it the clients had.
//! The clock starts when the new gateway is started (its load of the cache
//! directory is part of the resync) and stops for each client at the first
//! response after which it holds the current state.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use mcp_xds_gateway::source::persisted;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::clients::{self, Envelope, Holder, Progress, Watch};
use crate::eds::{self, Endpoints, Named, Subscriptions, COLLECTION};
use crate::gateway::{self, ChildGateway};
use crate::publisher::Publisher;
use crate::scenario::{ClientProtocol, NamedShape, Shape};
use crate::{cost_figures, mib, ms, percentiles, three_ms, until, Costs, Report, Run, Sent, PHASE_LIMIT};

/// The reconnect scenario's own figures.
#[derive(Debug, Default, serde::Serialize)]
pub struct ReconnectFigures {
    /// How the gateway was stopped: "SIGTERM" or "SIGKILL".
    pub signal: &'static str,
    pub names_per_client: usize,
    /// Clients that held the current state again, of `shape.streams`.
    pub resynced: usize,
    /// From the restart until each client held the current state again.
    pub resynced_p50_ms: f64,
    pub resynced_p99_ms: f64,
    pub resynced_max_ms: f64,
    /// The restarted gateway's CPU from its start until every client was
    /// resynced, and its peak RSS.
    pub gateway_cpu_seconds: f64,
    pub peak_rss: u64,
    /// Responses and their bytes (gRPC framing included) after the restart,
    /// and the bytes of the resources in them that their client already held
    /// at that content.
    pub responses: usize,
    pub bytes_sent: u64,
    pub bytes_already_held: u64,
    /// The gateway's CPU for the resync against a plain loopback writer
    /// sending the same responses in the same run.
    pub times_wire: Option<f64>,
}

impl ReconnectFigures {
    /// The printed table's rows.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("stopped with", self.signal.to_string()),
            ("names per client", self.names_per_client.to_string()),
            ("clients resynced", self.resynced.to_string()),
            (
                "resynced p50 / p99 / max",
                three_ms(self.resynced_p50_ms, self.resynced_p99_ms, self.resynced_max_ms),
            ),
            ("resync gateway CPU", format!("{:.2} s", self.gateway_cpu_seconds)),
            ("resync gateway peak RSS", mib(self.peak_rss)),
            (
                "resync responses / bytes",
                format!("{} / {}", self.responses, mib(self.bytes_sent)),
            ),
            ("resync bytes already held", mib(self.bytes_already_held)),
            (
                "resync × wire",
                self.times_wire.map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            ),
        ]
    }
}

/// A client after the restart: what it held before, and when it held the
/// current state again.
struct Resync {
    named: Named,
    /// Each resource's current body digest.
    current: Arc<[u64]>,
    sent: Vec<Sent>,
    resynced_at: Option<Instant>,
}

impl Holder for Resync {
    /// Nothing: the current state is known before the restart.
    type Finals = ();

    fn on_response(&mut self, envelope: Envelope, bytes: usize, at: Instant) -> anyhow::Result<()> {
        self.named.on_response(envelope, bytes, at)?;
        self.sent.push(Sent {
            at,
            stream: self.named.stream(),
            bytes,
        });
        if self.resynced_at.is_none() && self.named.at_final(&self.current) {
            self.resynced_at = Some(at);
        }
        Ok(())
    }

    /// Resynced: a response on the new stream, and the current state held.
    fn synced(&self) -> bool {
        self.resynced_at.is_some()
    }

    fn at_final(&self, _: &()) -> bool {
        self.synced()
    }
}

/// Starts one client stream per holder (`holders[i]` on connection `i` mod
/// the connections), `resume` saying what each reports it holds.
fn start_streams<H>(
    holders: Vec<H>,
    channels: &[Channel],
    asked: &[Vec<String>],
    delta: bool,
    resume: impl Fn(&H) -> Option<eds::Resume>,
    (progress, finals, stop): (&Arc<Progress>, &watch::Receiver<Option<H::Finals>>, &CancellationToken),
) -> Vec<JoinHandle<(H, anyhow::Result<()>)>>
where
    H: Holder + Send + 'static,
    H::Finals: Send + Sync,
{
    holders
        .into_iter()
        .enumerate()
        .map(|(i, mut holder)| {
            let (channel, names) = (channels[i % channels.len()].clone(), asked[i].clone());
            let (progress, finals, stop) = (progress.clone(), finals.clone(), stop.clone());
            let resume = resume(&holder);
            tokio::spawn(async move {
                let watch = Watch {
                    finals,
                    progress: &progress,
                    stop,
                };
                let result = eds::drive_named((i, delta), names, resume, channel, &mut holder, watch).await;
                (holder, result)
            })
        })
        .collect()
}

/// Waits for every stream's task; what each held, and its result.
async fn join<H>(tasks: Vec<JoinHandle<(H, anyhow::Result<()>)>>) -> anyhow::Result<Vec<(H, anyhow::Result<()>)>> {
    let mut all = Vec::with_capacity(tasks.len());
    for task in tasks {
        all.push(
            tokio::time::timeout(PHASE_LIMIT, task)
                .await
                .context("a client stream did not end in time")?
                .context("a client stream panicked")?,
        );
    }
    Ok(all)
}

/// Runs the reconnect scenario; `kill` stops the gateway with SIGKILL
/// rather than SIGTERM.
pub async fn run(binary: &Path, shape: Shape, named: NamedShape, run: Run, kill: bool) -> anyhow::Result<Report> {
    let subscriptions = Subscriptions::draw(shape.resources, shape.streams, &named);
    let catalog = Endpoints::new(&shape, &named, subscriptions.changing.clone());
    let (names, current, config_bytes) = (catalog.names(), catalog.finals(), catalog.config_bytes());
    let delta = shape.protocol == ClientProtocol::XdsDelta;
    let asked: Vec<Vec<String>> = subscriptions
        .of_client
        .iter()
        .map(|of| of.iter().map(|&r| names[r as usize].to_string()).collect())
        .collect();
    let cache = tempfile::Builder::new()
        .prefix("mcp-load-reconnect")
        .tempdir()
        .context("cannot make a --cache-dir for the gateway")?;
    let cache_dir = cache
        .path()
        .to_str()
        .context("the temporary directory's path is not UTF-8")?;
    let cache_file = cache.path().join(persisted::file_name(COLLECTION));
    let collections = [COLLECTION.to_owned()];
    let cores = run.pinning.map(|p| p.gateway_set()).transpose()?;
    let extra = ["--cache-dir", cache_dir];
    let mut publisher = Publisher::start(shape, catalog).await?;
    let upstream = publisher.addr;
    let spawn = || ChildGateway::spawn_with(binary, upstream, &collections, cores, &extra);

    let gateway = spawn().await?;
    tokio::time::timeout(PHASE_LIMIT, publisher.wait_initial_acks(1))
        .await
        .context("the gateway did not ACK the initial state in time")??;
    let rss_before_clients = gateway.memory()?.0;

    // The clients synced.
    let frames = Arc::new(clients::Frames::default());
    let sync_start = Instant::now();
    let channels = clients::connect(gateway.listen, shape.connections, run.max_frame_size, frames.clone()).await?;
    let progress = Arc::new(Progress::default());
    // Kept until the streams end: a dropped sender would wake them at once.
    let (_finals, finals_rx) = watch::channel(None);
    let stop = CancellationToken::new();
    let fresh = (0..shape.streams)
        .map(|i| Named::new(i, delta, &names, subscriptions.of_client[i].clone()))
        .collect();
    let tasks = start_streams(
        fresh,
        &channels,
        &asked,
        delta,
        |_| None,
        (&progress, &finals_rx, &stop),
    );
    until("streams synced", shape.streams, || {
        progress.synced.load(Ordering::Relaxed)
    })
    .await?;
    let initial_sync = sync_start.elapsed();
    let rss_synced = gateway.memory()?.0;
    // A restart serves what the gateway wrote: the state the clients hold.
    until("the collection written to --cache-dir", 1, || {
        usize::from(cache_file.exists())
    })
    .await?;
    if let Some(i) = tasks.iter().position(JoinHandle::is_finished) {
        anyhow::bail!("client stream {i} ended before the restart");
    }

    // The stop: the streams end with it (UNAVAILABLE, or a reset connection).
    if kill {
        gateway.kill().await?;
    } else {
        gateway.stop().await;
    }
    drop(channels);
    stop.cancel();
    let held: Vec<Named> = join(tasks).await?.into_iter().map(|(named, _)| named).collect();

    // The restart, and every client back with what it holds.
    let restart = Instant::now();
    let tool_cpu = gateway::cpu_seconds("/proc/self/stat")?;
    let gateway = spawn().await?;
    let frames = Arc::new(clients::Frames::default());
    let channels = clients::connect(gateway.listen, shape.connections, run.max_frame_size, frames.clone()).await?;
    let progress = Arc::new(Progress::default());
    let (_finals, finals_rx) = watch::channel(Some(()));
    let stop = CancellationToken::new();
    let resyncs = held
        .into_iter()
        .map(|mut named| {
            named.bytes_already_held = 0;
            Resync {
                named,
                current: current.clone(),
                sent: Vec::new(),
                resynced_at: None,
            }
        })
        .collect();
    let tasks = start_streams(
        resyncs,
        &channels,
        &asked,
        delta,
        |r: &Resync| Some(r.named.resume(&names)),
        (&progress, &finals_rx, &stop),
    );
    until("streams resynced", shape.streams, || {
        progress.synced.load(Ordering::Relaxed)
    })
    .await?;
    let (cpu, io, memory) = (gateway.cpu_seconds()?, gateway.io()?, gateway.memory()?);
    let tool_cpu_now = gateway::cpu_seconds("/proc/self/stat")?;
    stop.cancel();
    let resynced = join(tasks).await?;
    gateway.stop().await;
    let errors = resynced.iter().filter(|(_, result)| result.is_err()).count();
    for (i, (_, result)) in resynced.iter().enumerate() {
        if let Err(e) = result {
            eprintln!("mcp-load: stream {i} after the restart: {e}");
        }
    }

    let resynced: Vec<Resync> = resynced.into_iter().map(|(r, _)| r).collect();
    let mut times: Vec<Duration> = resynced
        .iter()
        .filter_map(|r| r.resynced_at)
        .map(|at| at.saturating_duration_since(restart))
        .collect();
    let (p50, p99, max) = percentiles(&mut times);
    let bytes_already_held = resynced.iter().map(|r| r.named.bytes_already_held).sum();
    let sent: Vec<Sent> = resynced.into_iter().flat_map(|r| r.sent).collect();
    let costs = Costs {
        cpu_user: cpu.0,
        cpu_system: cpu.1,
        written: io.0,
        syscalls: io.1,
        data_frames: frames.data.load(Ordering::Relaxed),
        upstream_cpu: 0.0,
        tool_cpu: (tool_cpu_now.0 + tool_cpu_now.1) - (tool_cpu.0 + tool_cpu.1),
    };
    let measured = cost_figures(&costs, sent, shape.connections, run.pinning, None).await?;
    let figures = ReconnectFigures {
        signal: if kill { "SIGKILL" } else { "SIGTERM" },
        names_per_client: named.names_per_client,
        resynced: times.len(),
        resynced_p50_ms: p50,
        resynced_p99_ms: p99,
        resynced_max_ms: max,
        gateway_cpu_seconds: cpu.0 + cpu.1,
        peak_rss: memory.1,
        responses: measured.responses_received,
        bytes_sent: measured.bytes_received,
        bytes_already_held,
        times_wire: measured.times_wire,
    };
    Ok(Report {
        shape: Some(shape),
        streams: shape.streams,
        initial_sync_ms: ms(initial_sync),
        gateway_peak_rss_bytes: Some(memory.1),
        gateway_rss_per_stream_bytes: Some(
            rss_synced.saturating_sub(rss_before_clients) as f64 / shape.streams.max(1) as f64,
        ),
        config_bytes,
        nacks: publisher.nacks.load(Ordering::Relaxed),
        stream_errors: errors,
        chain: run.chain,
        client_max_frame_size: run.max_frame_size,
        reconnect: Some(figures),
        ..measured
    })
}
