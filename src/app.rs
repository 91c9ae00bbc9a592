//! Wiring: binds every listener first (port 0 works), starts the servers and
//! the upstream, and hands back the bound addresses and the shared state.
//! `main` only waits; tests start the same app in-process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, AdminState};
use crate::cache::demand::{DemandRoute, Subscriptions};
use crate::cache::Cache;
use crate::config::{Serve, Settings, Source};
use crate::downstream::nack_memory::{self, NackMemory};
use crate::downstream::rollout::{Rollout, Saved};
use crate::downstream::{AggregatedService, Downstream, Registry, ResourceSourceService, XdsService};
use crate::skew::SkewTracker;
use crate::source::client::UpstreamClient;
use crate::source::files::LocalSource;
use crate::source::persisted::{self, Persister};
use crate::source::sink::SinkServer;
use crate::source::{SinkContext, UpstreamStatus};
use crate::tools::dial_out::DialOut;
use crate::transport::access::AccessControl;
use crate::transport::grpc::{self, GrpcListener, SharedLimits};
use crate::transport::tls::{ServerTls, TlsError};

/// Connections to the sink port: one source at a time, a few more for a
/// source replacing one that has not timed out yet and for refusals.
const SINK_MAX_CONNECTIONS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("{flag} {addr}: cannot listen: {source}")]
    Bind {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Tls(#[from] TlsError),
    #[error("--cache-dir {}: cannot use it: {source}", dir.display())]
    CacheDir { dir: PathBuf, source: std::io::Error },
    #[error("--source-dir {dir}: {message}")]
    SourceDir { dir: String, message: String },
    #[error("--access-policy {0}")]
    AccessPolicy(crate::transport::access::PolicyError),
    #[error("cannot build gRPC reflection from the embedded descriptors: {0}")]
    Reflection(tonic_reflection::server::Error),
}

impl AppError {
    /// 2 for what the operator gave (a flag, a file, a port), as for a bad
    /// flag; 1 for the gateway's own failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            AppError::Reflection(_) => 1,
            _ => 2,
        }
    }
}

/// A running gateway.
pub struct Bound {
    /// Where the downstream gRPC services listen; `source --sink`, which
    /// listens for no client, has the unspecified address `0.0.0.0:0`.
    pub listen: SocketAddr,
    /// Where the admin port listens (debug views).
    pub admin: SocketAddr,
    /// Where the monitoring port listens (metrics, health, readiness).
    pub monitoring: SocketAddr,
    /// Where `ResourceSink` listens for Galley's dial-out (`--sink-listen`).
    pub sink: Option<SocketAddr>,
    pub cache: Arc<Cache>,
    pub subscriptions: Arc<Subscriptions>,
    pub registry: Arc<Registry>,
    pub upstream: watch::Receiver<UpstreamStatus>,
    /// The client port's connection slots (`--max-connections`).
    pub connections: Arc<crate::transport::slots::ConnectionSlots>,
    /// The version skew kept for the generations of connected clients.
    pub skew: Arc<SkewTracker>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    grace: Duration,
}

async fn bind(flag: &'static str, addr: SocketAddr) -> Result<(TcpListener, SocketAddr), AppError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { flag, addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| AppError::Bind { flag, addr, source })?;
    Ok((listener, bound))
}

/// Binds the listeners and starts everything. The persisted cache is loaded
/// and the local source read before anything listens, so the first client is
/// served at once.
pub async fn build(settings: Settings) -> Result<Bound, AppError> {
    build_with_logs(settings, None).await
}

/// As [`build`], with the log filter's control (`POST /logging`): the
/// binary's, around its subscriber. The steps, in order: bind the
/// listeners, start the watchers of the files read while running (TLS, the
/// access policy), make the cache and its history, serve (clients, admin,
/// monitoring), start the source.
pub async fn build_with_logs(
    settings: Settings,
    logs: Option<Arc<crate::metrics::LogControl>>,
) -> Result<Bound, AppError> {
    let metrics = crate::metrics::install(settings.demo);
    crate::metrics::register_defaults(&settings.collections);
    crate::source::register_metrics();
    crate::memory::describe();
    crate::memory::register();
    crate::runtime::describe();
    crate::runtime::refresh();
    // Everything that can refuse the flags comes before the first log line:
    // a failed start prints its one error, nothing else.
    let listeners = Listeners::bind(&settings).await?;
    let shutdown = CancellationToken::new();
    // Whatever was started stops again if start-up fails further down.
    let started = shutdown.clone().drop_guard();
    let tasks = TaskTracker::new();
    let watched = Watched::start(&settings, &shutdown, &tasks)?;
    if let (Some(interval), Some(allocator)) = (settings.memory_trim_interval, crate::memory::installed()) {
        tasks.spawn(crate::memory::run(allocator, interval, shutdown.clone()));
    }
    reflection()?;
    log_start(&settings);
    let state = CacheState::make(&settings, &shutdown, &tasks).await?;
    let Listeners {
        grpc: grpc_listener,
        admin,
        monitoring,
        sink: sink_listener,
    } = listeners;
    let (admin_addr, monitoring_addr) = (admin.1, monitoring.1);
    let served = serve(
        &settings,
        Serving {
            grpc: grpc_listener,
            admin,
            monitoring,
            state: &state,
            watched: &watched,
            metrics,
            logs,
        },
        &shutdown,
        &tasks,
    )
    .await;
    let Settings {
        source,
        serve: serving,
        table,
        access_policy,
        server_tls: server_tls_files,
        shutdown_grace,
        ..
    } = settings;
    let CacheState {
        cache,
        writer,
        subscriptions,
        registry,
        status_tx,
        status_rx,
        persister,
        skew,
        rollout,
        ..
    } = state;
    let source_settings = SourceStart {
        table: table.clone(),
        subscriptions: subscriptions.clone(),
        status_tx,
        writer,
        persister,
        server_tls: watched.server_tls.clone(),
        grpc: served.grpc.clone(),
        max_new_streams_per_second: served.max_new_streams_per_second,
        max_source_file_bytes: served.max_source_file_bytes,
        origins: skew.origins_sender(),
    };
    let sink = start_source(source, sink_listener, source_settings, &shutdown, &tasks).await?;
    // The local files' first read is served from the "listening" line on,
    // not from the rollout task's next turn (a stream that follows a type
    // before the slots are filled waits for the fill: see `Rollout`).
    rollout.fill();
    if let Serve::DialOut(dial_out) = &serving {
        // After the local source's first read: the sink is served what the
        // files hold from its first request on.
        let dial_out = DialOut::new((**dial_out).clone(), served.resource_source, served.max_request_bytes);
        tasks.spawn(dial_out.run(shutdown.clone()));
    }

    warn_of_unread_secrets(&cache, &table, &access_policy);
    started.disarm();
    let listening = served
        .listen
        .map_or_else(|| "none (dial-out)".to_owned(), |l| l.to_string());
    tracing::info!(
        listen = %listening,
        admin = %admin_addr,
        monitoring = %monitoring_addr,
        sink = sink.map(|s| s.to_string()),
        tls = server_tls_on(&server_tls_files),
        "{} listening",
        match serving {
            Serve::Gateway => "gateway",
            Serve::ResourceSource | Serve::DialOut(_) => "source",
        }
    );
    Ok(Bound {
        // `source --sink` listens for no client: the unspecified address.
        listen: served.listen.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
        admin: admin_addr,
        monitoring: monitoring_addr,
        sink,
        cache,
        subscriptions,
        registry,
        upstream: status_rx,
        connections: served.connections,
        skew,
        shutdown,
        tasks,
        grace: shutdown_grace,
    })
}

// === Step 1: bind ===

/// Every listener, bound before anything else is started (port 0 works).
struct Listeners {
    /// The client port; none for `source --sink`, which serves its one
    /// stream over a connection it dials.
    grpc: Option<(TcpListener, SocketAddr)>,
    admin: (TcpListener, SocketAddr),
    monitoring: (TcpListener, SocketAddr),
    sink: Option<(TcpListener, SocketAddr)>,
}

impl Listeners {
    async fn bind(settings: &Settings) -> Result<Self, AppError> {
        let grpc = match settings.serve {
            Serve::DialOut(_) => None,
            Serve::Gateway | Serve::ResourceSource => Some(bind("--listen", settings.listen).await?),
        };
        let admin = bind("--admin-listen", settings.admin_listen).await?;
        let monitoring = bind("--monitoring-listen", settings.monitoring_listen).await?;
        let sink = match &settings.source {
            Source::Sink(sink) => Some(bind("--sink-listen", sink.listen).await?),
            _ => None,
        };
        if let Some(dir) = &settings.cache_dir {
            check_cache_dir(dir)?;
            if !settings.table.has_version_key() {
                let key = kept_version_key(dir).map_err(|source| AppError::CacheDir {
                    dir: dir.to_owned(),
                    source,
                })?;
                settings.table.set_version_key(key);
            }
        }
        Ok(Self {
            grpc,
            admin,
            monitoring,
            sink,
        })
    }
}

// === Step 2: the watchers of files read while running ===

/// The TLS files and the access policy, each read again when it changes.
struct Watched {
    server_tls: Option<Arc<ServerTls>>,
    access: Arc<AccessControl>,
}

impl Watched {
    fn start(settings: &Settings, shutdown: &CancellationToken, tasks: &TaskTracker) -> Result<Self, AppError> {
        let server_tls = match &settings.server_tls {
            Some(files) => {
                let tls = ServerTls::new(files.clone())?;
                tls.watch(shutdown.clone(), tasks)?;
                Some(tls)
            }
            None => None,
        };
        let access = AccessControl::new(settings.access_policy.clone());
        access.watch(shutdown.clone(), tasks).map_err(AppError::AccessPolicy)?;
        Ok(Self { server_tls, access })
    }
}

/// gRPC reflection of the embedded descriptors (v1 and v1alpha): made once
/// before anything is logged, to check that the descriptors read, and again
/// by the step that serves them.
#[allow(clippy::type_complexity)]
fn reflection() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    AppError,
> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((
        builder().build_v1().map_err(AppError::Reflection)?,
        builder().build_v1alpha().map_err(AppError::Reflection)?,
    ))
}

/// The first lines of the log: the effective configuration, then warnings.
fn log_start(settings: &Settings) {
    log_effective(settings);
    if settings.demo {
        tracing::warn!(
            "--demo: serving the compiled-in example config (bookinfo routes, a mesh policy), not a real source; \
             every metric carries demo=\"true\""
        );
    }
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
}

// === Step 3: the cache and its history ===

/// The cache with its one writer (for the source), the demand for
/// collections, the client registry, the source's status, the persisted
/// state loaded back, and the rollout over the cache's history.
struct CacheState {
    cache: Arc<Cache>,
    writer: crate::cache::CacheWriter,
    subscriptions: Arc<Subscriptions>,
    registry: Arc<Registry>,
    status_tx: watch::Sender<UpstreamStatus>,
    status_rx: watch::Receiver<UpstreamStatus>,
    persister: Option<Persister>,
    rollout: Arc<Rollout>,
    /// What connected clients' releases drop of what is served.
    skew: Arc<SkewTracker>,
}

impl CacheState {
    async fn make(settings: &Settings, shutdown: &CancellationToken, tasks: &TaskTracker) -> Result<Self, AppError> {
        let (cache, writer) = Cache::with_history(settings.history);
        let route = match &settings.source {
            Source::Client(_) => DemandRoute::Probe,
            Source::Sink(_) => DemandRoute::Hold,
            Source::Files(_) => DemandRoute::Subscribe,
        };
        let subscriptions = Arc::new(Subscriptions::with_route(
            settings.collections.iter().cloned(),
            route,
            settings.demand_timeout,
        ));
        let registry = Arc::new(Registry::default());
        let (status_tx, status_rx) = watch::channel(UpstreamStatus {
            mode: "none",
            ..Default::default()
        });
        let (writer, persister) = match (&settings.cache_dir, &settings.source) {
            // The files are the files source's persisted state.
            (Some(_), Source::Files(_)) | (None, _) => (writer, None),
            (Some(dir), _) => load_persisted(settings, dir, &cache, writer, shutdown, tasks).await?,
        };
        let restored = match &settings.cache_dir {
            Some(dir) => load_rollout(dir),
            None => Default::default(),
        };
        let rollout = Rollout::new(
            cache.clone(),
            settings.canaries.clone(),
            settings.canary_membership,
            settings.canary_when_none,
            settings.canary_soak,
            restored,
        );
        tasks.spawn(rollout.clone().run(shutdown.clone()));
        if let Some(dir) = &settings.cache_dir {
            persist_rollout(dir.clone(), rollout.clone(), shutdown.clone(), tasks);
        }
        let skew = SkewTracker::new(
            cache.clone(),
            settings.client_generations.clone(),
            settings.table.sensitive_collections().map(|c| c.to_string()),
        );
        // What each group is served (a pin, a canary round), not the latest.
        let served = rollout.clone();
        skew.serve_from(crate::skew::ServedBy {
            snapshots: Box::new(move |collection| {
                [false, true]
                    .into_iter()
                    .map(|canary| served.served_snapshot(collection, canary))
                    .collect()
            }),
            changes: rollout.served_changes(),
        });
        tasks.spawn(skew.clone().run(shutdown.clone()));
        Ok(Self {
            skew,
            cache,
            writer,
            subscriptions,
            registry,
            status_tx,
            status_rx,
            persister,
            rollout,
        })
    }
}

/// Loads the persisted cache from `dir` through `writer` (on the blocking
/// pool) and starts writing the changes back: the writer again, and the
/// persister.
async fn load_persisted(
    settings: &Settings,
    dir: &std::path::Path,
    cache: &Arc<Cache>,
    mut writer: crate::cache::CacheWriter,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) -> Result<(crate::cache::CacheWriter, Option<Persister>), AppError> {
    let max_message_bytes = match &settings.source {
        Source::Client(c) => c.max_message_bytes,
        Source::Sink(s) => s.max_message_bytes,
        Source::Files(_) => usize::MAX,
    };
    // Reading the files blocks: on the blocking pool, with the writer.
    let (returned, loaded) = {
        let reading = dir.to_path_buf();
        let max = persisted::max_file_bytes(max_message_bytes);
        let secrets = crate::source::validate::SecretGuard::new(settings.table.clone());
        tokio::task::spawn_blocking(move || {
            let loaded = persisted::load(&reading, &mut writer, max, Some(&secrets));
            (writer, loaded)
        })
        .await
        .map_err(|e| AppError::CacheDir {
            dir: dir.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?
    };
    let loaded = loaded.map_err(|source| AppError::CacheDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    for (collection, version, resources) in &loaded.collections {
        tracing::info!(%collection, %version, resources, "serving the persisted state until upstream delivers");
    }
    if !loaded.skipped.is_empty() {
        tracing::warn!(
            skipped = loaded.skipped.len(),
            "some persisted collections were unusable; they wait for the upstream source"
        );
    }
    let persister = Persister::start(
        dir.to_path_buf(),
        cache.clone(),
        settings.table.clone(),
        shutdown.clone(),
        tasks,
    );
    Ok((returned, Some(persister)))
}

// === Step 4: serve ===

/// What serving needs from the steps before it.
struct Serving<'a> {
    grpc: Option<(TcpListener, SocketAddr)>,
    admin: (TcpListener, SocketAddr),
    monitoring: (TcpListener, SocketAddr),
    state: &'a CacheState,
    watched: &'a Watched,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    logs: Option<Arc<crate::metrics::LogControl>>,
}

/// What serving started, for the source step and the running gateway.
struct Served {
    /// Where the client port listens (none for `source --sink`).
    listen: Option<SocketAddr>,
    /// The `ResourceSource` service, which the dial-out serves too.
    resource_source: ResourceSourceService,
    connections: Arc<crate::transport::slots::ConnectionSlots>,
    grpc: grpc::GrpcLimits,
    max_new_streams_per_second: u32,
    max_request_bytes: usize,
    max_source_file_bytes: usize,
}

/// Serves clients (the downstream services with health and reflection on
/// the client port), the admin port and the monitoring port.
async fn serve(settings: &Settings, serving: Serving<'_>, shutdown: &CancellationToken, tasks: &TaskTracker) -> Served {
    let Serving {
        grpc: grpc_listener,
        admin: (admin_listener, admin_addr),
        monitoring: (monitoring_listener, _),
        state,
        watched,
        metrics,
        logs,
    } = serving;
    let downstream = Downstream::new(
        state.cache.clone(),
        state.rollout.clone(),
        settings.table.clone(),
        state.subscriptions.clone(),
        state.registry.clone(),
        shutdown.clone(),
        tasks.clone(),
        settings.downstream,
        watched.access.clone(),
        state.skew.clone(),
    );
    let downstream = match settings.serve {
        Serve::Gateway => downstream,
        Serve::ResourceSource | Serve::DialOut(_) => downstream.as_source(),
    };
    crate::downstream::register_metrics(&downstream, &settings.collections);
    if let Some(dir) = &settings.cache_dir {
        keep_nack_memory(dir, downstream.nack_memory(), shutdown, tasks);
    }
    let resource_source = ResourceSourceService::new(downstream.clone());
    const GATEWAY_SERVICES: &[&str] = &[
        <AggregatedService as tonic::server::NamedService>::NAME,
        <ResourceSourceService as tonic::server::NamedService>::NAME,
        <XdsService as tonic::server::NamedService>::NAME,
    ];
    const SOURCE_SERVICES: &[&str] = &[<ResourceSourceService as tonic::server::NamedService>::NAME];
    let services = match settings.serve {
        Serve::Gateway => GATEWAY_SERVICES,
        Serve::ResourceSource | Serve::DialOut(_) => SOURCE_SERVICES,
    };
    let health = tonic_health::server::HealthReporter::new();
    let health_service =
        admin::HealthByAccess::new(health.clone(), watched.access.clone(), settings.table.clone(), services);
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    for name in services {
        health
            .set_service_status(*name, tonic_health::ServingStatus::NotServing)
            .await;
    }
    tasks.spawn(admin::track_health(
        health,
        services,
        state.subscriptions.clone(),
        state.cache.clone(),
        shutdown.clone(),
    ));
    let health_service = admin::HealthWithReason::new(
        health_service,
        state.subscriptions.clone(),
        state.cache.clone(),
        state.status_rx.clone(),
    );
    // Checked at start: the descriptors read.
    let (reflection_v1, reflection_v1alpha) = reflection().expect("checked before anything was logged");
    let routes = match settings.serve {
        Serve::Gateway => tonic::service::Routes::new(AggregatedService::new(downstream.clone()))
            .add_service(resource_source.clone())
            .add_service(XdsService::new(downstream)),
        Serve::ResourceSource | Serve::DialOut(_) => tonic::service::Routes::new(resource_source.clone()),
    }
    .add_service(health_service)
    .add_service(reflection_v1)
    .add_service(reflection_v1alpha)
    .prepare();
    let shared = SharedLimits::new(
        settings.max_connections,
        settings.max_streams,
        settings.max_new_streams_per_second,
    );
    let listen = match grpc_listener {
        Some((grpc_listener, listen)) => {
            grpc::serve(
                grpc_listener,
                GrpcListener {
                    name: "--listen",
                    tls: watched.server_tls.clone(),
                    allow: settings.client_allow.clone(),
                    limits: Arc::new(settings.grpc.clone()),
                    shared: shared.clone(),
                },
                routes,
                shutdown.clone(),
                tasks.clone(),
            );
            Some(listen)
        }
        None => None,
    };

    let admin_state = AdminState {
        cache: state.cache.clone(),
        rollout: state.rollout.clone(),
        subscriptions: state.subscriptions.clone(),
        registry: state.registry.clone(),
        upstream: state.status_rx.clone(),
        metrics,
        stale_after: settings.stale_after,
        access_wait: settings.debug_access_wait,
        bodies: settings.bodies.clone(),
        config: Arc::new(serde_json::to_value(&settings.effective).unwrap_or_default()),
        logs,
        access: watched.access.clone(),
        table: settings.table.clone(),
        skew: state.skew.clone(),
    };
    crate::transport::http::serve(
        "--admin-listen",
        admin_listener,
        admin::admin_router(
            admin_state.clone(),
            admin::guard::Guard {
                loopback: admin_addr.ip().is_loopback(),
            },
        ),
        settings.http,
        shutdown.clone(),
        tasks,
    );
    crate::transport::http::serve(
        "--monitoring-listen",
        monitoring_listener,
        admin::monitoring_router(admin_state),
        settings.http,
        shutdown.clone(),
        tasks,
    );
    Served {
        listen,
        resource_source,
        connections: shared.connections.clone(),
        grpc: settings.grpc.clone(),
        max_new_streams_per_second: settings.max_new_streams_per_second,
        max_request_bytes: settings.downstream.max_request_bytes,
        max_source_file_bytes: settings.max_source_file_bytes,
    }
}

// === Step 5: the source ===

/// What the source needs: the cache's one writer and the rest of the
/// cache's state, and the sink listener's TLS and limits.
struct SourceStart {
    table: Arc<crate::collections::CollectionTable>,
    subscriptions: Arc<Subscriptions>,
    status_tx: watch::Sender<UpstreamStatus>,
    writer: crate::cache::CacheWriter,
    persister: Option<Persister>,
    server_tls: Option<Arc<ServerTls>>,
    grpc: grpc::GrpcLimits,
    max_new_streams_per_second: u32,
    max_source_file_bytes: usize,
    /// Where the files source says each resource came from.
    origins: watch::Sender<Arc<crate::source::files::Origins>>,
}

/// Starts the source that writes the cache: the upstream client, the sink
/// Galley dials, or the local files (read once before this returns). The
/// sink's address, when it listens.
async fn start_source(
    source: Source,
    sink_listener: Option<(TcpListener, SocketAddr)>,
    start: SourceStart,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) -> Result<Option<SocketAddr>, AppError> {
    let SourceStart {
        table,
        subscriptions,
        status_tx,
        writer,
        persister,
        server_tls,
        grpc: grpc_limits,
        max_new_streams_per_second,
        max_source_file_bytes,
        origins,
    } = start;
    match source {
        Source::Client(upstream) => {
            let context = SinkContext {
                node: upstream.node.clone(),
                incremental: upstream.incremental,
                subscriptions,
                persister,
                max_message_bytes: upstream.max_message_bytes,
                secrets: Arc::new(crate::source::validate::SecretGuard::new(table.clone())),
            };
            let client = UpstreamClient::new(upstream, context, status_tx, writer);
            tasks.spawn(client.run(shutdown.clone()));
            Ok(None)
        }
        Source::Sink(sink_settings) => {
            let (listener, addr) = sink_listener.expect("bound in the first step");
            if sink_settings.insecure {
                tracing::warn!(
                    %addr,
                    "--sink-insecure: any peer that reaches --sink-listen can become the config source of every client"
                );
            }
            let context = SinkContext {
                node: sink_settings.node.clone(),
                incremental: sink_settings.incremental,
                subscriptions,
                persister,
                max_message_bytes: sink_settings.max_message_bytes,
                secrets: Arc::new(crate::source::validate::SecretGuard::new(table.clone())),
            };
            let allow = sink_settings.allow.clone();
            let service = SinkServer::new(
                sink_settings,
                context,
                status_tx,
                writer,
                shutdown.clone(),
                tasks.clone(),
            );
            // The connection age limit does not apply: the source is one
            // long-lived peer. Keepalive pings drop a frozen source. Its
            // connections and streams come from a pool of their own, so a
            // full client port never keeps Galley out.
            let sink_limits = grpc::GrpcLimits {
                max_connection_age: None,
                // Galley pushes whole collections: wide windows, for one
                // authenticated peer.
                receive_window: 4 << 20,
                ..grpc_limits
            };
            let sink_shared = SharedLimits::new(
                SINK_MAX_CONNECTIONS,
                SINK_MAX_CONNECTIONS * 4,
                max_new_streams_per_second,
            );
            grpc::serve(
                listener,
                GrpcListener {
                    name: "--sink-listen",
                    tls: server_tls,
                    allow,
                    limits: Arc::new(sink_limits),
                    shared: sink_shared,
                },
                tonic::service::Routes::new(service).prepare(),
                shutdown.clone(),
                tasks.clone(),
            );
            tracing::info!(%addr, "waiting for Galley's dial-out on ResourceSink");
            Ok(Some(addr))
        }
        Source::Files(dir) => {
            let source = LocalSource::new(
                dir.clone(),
                table,
                writer,
                subscriptions,
                status_tx,
                max_source_file_bytes,
            )
            .with_origins(origins);
            source
                .start(shutdown.clone(), tasks)
                .await
                .map_err(|message| AppError::SourceDir {
                    dir: dir.to_string(),
                    message,
                })?;
            tracing::info!(source = %dir, "serving the local source");
            Ok(None)
        }
    }
}

/// Without `--access-policy`, collections of secrets are served to nobody:
/// said once at start for each that has content, so an operator whose
/// Envoys wait for their certificates knows why.
fn warn_of_unread_secrets(
    cache: &crate::cache::Cache,
    table: &crate::collections::CollectionTable,
    policy: &crate::transport::access::AccessPolicy,
) {
    if policy.path().is_some() {
        return;
    }
    for snapshot in cache.snapshots() {
        if !snapshot.is_empty() && table.is_sensitive(&snapshot.collection) {
            tracing::warn!(
                collection = %snapshot.collection,
                resources = snapshot.len(),
                "this collection holds secrets and no --access-policy is given: it is served to nobody; give a \
                 policy that grants it to the identities that own each secret (docs/operating.md, \"Who may read \
                 what\")"
            );
        }
    }
}

/// `--cache-dir` can hold the cache: made (0700) where missing, a directory
/// this process can list and write in. Checked before anything is logged;
/// its files are read later.
fn check_cache_dir(dir: &std::path::Path) -> Result<(), AppError> {
    use std::os::unix::fs::DirBuilderExt;
    let unusable = |source| AppError::CacheDir {
        dir: dir.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(unusable)?;
    std::fs::read_dir(dir).map_err(unusable)?;
    // A file made and removed again: the cache is written here.
    tempfile::Builder::new()
        .prefix(".probe")
        .tempfile_in(dir)
        .map_err(unusable)?;
    Ok(())
}

/// The file in `--cache-dir` that keeps the key of sensitive collections'
/// versions across restarts, when `--sensitive-version-key` gives none.
pub const VERSION_KEY_FILE: &str = "sensitive-version.key";

/// The version key kept in `dir`: read, or made (random, 0600) when there
/// is none, so a restart makes the same versions of the same secrets.
fn kept_version_key(dir: &std::path::Path) -> std::io::Result<crate::collections::VersionKey> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(VERSION_KEY_FILE);
    let key = crate::collections::VersionKey::random();
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut file) => {
            file.write_all(key.bytes())?;
            file.sync_all()?;
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let bytes = std::fs::read(&path)?;
            crate::collections::VersionKey::new(&bytes).ok_or_else(|| {
                std::io::Error::other(format!(
                    "{VERSION_KEY_FILE} holds {} bytes, fewer than the key's {} (delete it to have a new one made)",
                    bytes.len(),
                    crate::collections::VersionKey::MIN_BYTES
                ))
            })
        }
        Err(e) => Err(e),
    }
}

fn server_tls_on(tls: &Option<crate::transport::tls::ServerTlsFiles>) -> &'static str {
    match tls {
        None => "off",
        Some(files) if files.client_ca.is_some() => "mtls",
        Some(_) => "on",
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One line with every setting that matters, once, before listening.
/// Durations in seconds; absent values are left out.
fn log_effective(settings: &Settings) {
    let (mode, address, node, incremental, max_message_bytes) = match &settings.source {
        Source::Client(c) => (
            "client",
            c.address.clone(),
            c.node.id.as_str(),
            c.incremental,
            Some(c.max_message_bytes),
        ),
        Source::Sink(s) => (
            "sink",
            s.listen.to_string(),
            s.node.id.as_str(),
            s.incremental,
            Some(s.max_message_bytes),
        ),
        // No upstream to name itself to: the value in effect, as
        // /debug/config shows it.
        Source::Files(dir) => (
            "files",
            dir.to_string(),
            settings
                .effective
                .iter()
                .find(|f| f.flag == "--node-id")
                .and_then(|f| f.value.as_deref())
                .unwrap_or_default(),
            false,
            None,
        ),
    };
    let client = match &settings.source {
        Source::Client(c) => Some(c),
        _ => None,
    };
    let grpc = &settings.grpc;
    let (serve, dial_out) = match &settings.serve {
        Serve::Gateway => ("gateway", None),
        Serve::ResourceSource => ("resource-source", None),
        Serve::DialOut(dial_out) => ("dial-out", Some(dial_out)),
    };
    tracing::info!(
        serve,
        dial_out_sink = dial_out.map(|d| d.dial.address.as_str()),
        dial_out_tls = dial_out.map(|d| d.dial.tls.is_some()),
        source = mode,
        upstream = %address,
        node_id = node,
        incremental,
        collections = %settings.collections.join(","),
        type_map = settings.type_map.as_ref().map(|p| p.display().to_string()),
        table_rows = settings.table.len(),
        max_message_bytes,
        keepalive_seconds = grpc.keepalive.map(seconds),
        connect_timeout_seconds = client.map(|u| seconds(u.connect_timeout)),
        reconnect_min_delay_seconds = client.map(|u| seconds(u.backoff.min)),
        reconnect_max_delay_seconds = client.map(|u| seconds(u.backoff.max)),
        upstream_tls = client.is_some_and(|u| u.tls.is_some()),
        tls = server_tls_on(&settings.server_tls),
        client_allow = settings.client_allow.as_ref().map(|a| a.entries().join(",")),
        cache_dir = settings.cache_dir.as_ref().map(|p| p.display().to_string()),
        shutdown_grace_seconds = seconds(settings.shutdown_grace),
        max_connection_age_seconds = grpc.max_connection_age.map(seconds),
        max_connection_age_grace_seconds = seconds(grpc.max_connection_age_grace),
        max_connections = settings.max_connections,
        max_streams = settings.max_streams,
        max_streams_per_connection = grpc.max_streams_per_connection,
        max_new_streams_per_second = settings.max_new_streams_per_second,
        max_requests_per_second = settings.downstream.max_requests_per_second,
        max_request_bytes = settings.downstream.max_request_bytes,
        max_types_per_stream = settings.downstream.max_types_per_stream,
        max_grants_per_version = settings.downstream.max_grants_per_version,
        max_subscribed_names = settings.downstream.max_subscribed_names,
        nack_memory_seconds = seconds(settings.downstream.nack_memory),
        max_nack_memory_entries = settings.downstream.max_nack_memory_entries,
        max_nack_memory_entries_per_identity = settings.downstream.max_nack_memory_entries_per_identity,
        demand_timeout_seconds = seconds(settings.demand_timeout),
        handshake_timeout_seconds = seconds(grpc.handshake_timeout),
        idle_timeout_seconds = grpc.idle_timeout.map(seconds),
        "effective configuration"
    );
}

// === impl Bound ===

impl Bound {
    /// A token that stops the gateway when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops accepting, closes every stream, and waits at most the grace
    /// period for them to finish.
    /// Returns whether every task (listeners, connections, streams, sources,
    /// watchers) ended within the grace period.
    pub async fn shutdown(self) -> bool {
        self.shutdown.cancel();
        self.tasks.close();
        let ended = tokio::time::timeout(self.grace, self.tasks.wait()).await.is_ok();
        if !ended {
            tracing::warn!(
                grace_seconds = self.grace.as_secs_f64(),
                tasks = self.tasks.len(),
                "tasks still running after the shutdown grace period; exiting anyway"
            );
        }
        ended
    }
}

/// The rollout's state in `--cache-dir`: pins, what everyone was released,
/// what is held.
const ROLLOUT_FILE: &str = "rollout.json";

/// The largest rollout file read back (a few hundred bytes per collection).
const MAX_ROLLOUT_FILE: u64 = 4 << 20;

/// What the last run left of the rollout; nothing (with a warning) when the
/// file is missing, damaged or too large.
fn load_rollout(dir: &std::path::Path) -> std::collections::BTreeMap<String, Saved> {
    let saved: Option<SavedRollout> = load_state(
        dir,
        ROLLOUT_FILE,
        MAX_ROLLOUT_FILE,
        "the saved rollout state (pins, holds) is unusable: every collection starts unpinned",
    );
    saved.map(|s| s.collections).unwrap_or_default()
}

/// A state file of `--cache-dir` the gateway wrote for itself: `None` when
/// missing, or (with `unusable` as a warning) damaged or too large.
fn load_state<T: serde::de::DeserializeOwned>(
    dir: &std::path::Path,
    file: &str,
    max: u64,
    unusable: &'static str,
) -> Option<T> {
    let path = dir.join(file);
    if !path.exists() {
        return None;
    }
    let read = persisted::read_file(&path, max)
        .and_then(|bytes| serde_json::from_slice::<T>(&bytes).map_err(|e| e.to_string()));
    match read {
        Ok(saved) => Some(saved),
        Err(reason) => {
            tracing::warn!(path = %path.display(), %reason, "{unusable}");
            None
        }
    }
}

/// The rollout file's content.
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedRollout {
    collections: std::collections::BTreeMap<String, Saved>,
}

/// Writes the rollout's state to `dir` whenever it changes, and once more
/// at shutdown.
fn persist_rollout(dir: PathBuf, rollout: Arc<Rollout>, shutdown: CancellationToken, tasks: &TaskTracker) {
    let revisions = rollout.revisions();
    let saved = move || SavedRollout {
        collections: rollout.saved(),
    };
    let what = "cannot save the rollout state (pins, holds); the next change is written again";
    persist_state(dir, ROLLOUT_FILE, revisions, saved, what, shutdown, tasks);
}

/// The clients' NACKs from the last run, and written back as they change.
fn keep_nack_memory(
    dir: &std::path::Path,
    memory: &Arc<NackMemory>,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) {
    let unusable = "the saved NACK memory is unusable: until the gateway restarts, reconnecting clients are sent \
                    everything they ask for (what they NACKed before is not known)";
    let existed = dir.join(nack_memory::FILE).exists();
    let saved: Option<nack_memory::Saved> = load_state(dir, nack_memory::FILE, nack_memory::MAX_FILE_BYTES, unusable);
    if let Some(saved) = &saved {
        let restored = memory.restore(saved, std::time::SystemTime::now());
        tracing::info!(restored, "remembered NACKs read back from --cache-dir");
    }
    if saved.is_some() || !existed {
        memory.keep_across_restarts();
    }
    let (revisions, memory) = (memory.revisions(), memory.clone());
    let what = "cannot save the NACK memory; the next change is written again";
    persist_state(
        dir.to_path_buf(),
        nack_memory::FILE,
        revisions,
        move || memory.saved(),
        what,
        shutdown.clone(),
        tasks,
    );
}

/// Writes `saved()` as `file` in `dir` whenever `revisions` changes (if it
/// differs from what was written), and once more at shutdown.
fn persist_state<T: serde::Serialize>(
    dir: PathBuf,
    file: &'static str,
    mut revisions: watch::Receiver<u64>,
    saved: impl Fn() -> T + Send + 'static,
    cannot: &'static str,
    shutdown: CancellationToken,
    tasks: &TaskTracker,
) {
    tasks.spawn(async move {
        let mut written = None;
        loop {
            let last = tokio::select! {
                changed = revisions.changed() => changed.is_err(),
                _ = shutdown.cancelled() => true,
            };
            let bytes = serde_json::to_vec_pretty(&saved()).expect("the gateway's state serializes");
            if written.as_ref() != Some(&bytes) {
                let (into, contents) = (dir.clone(), bytes.clone());
                let result =
                    tokio::task::spawn_blocking(move || persisted::write_atomically(&into, file, &contents)).await;
                match result {
                    Ok(Ok(())) => written = Some(bytes),
                    Ok(Err(e)) => tracing::warn!(path = %dir.join(file).display(), error = %e, "{cannot}"),
                    Err(e) => tracing::error!(error = %e, file, "a state writer of --cache-dir failed"),
                }
            }
            if last {
                return;
            }
        }
    });
}
