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
use crate::cache::Cache;
use crate::config::{Settings, Source};
use crate::downstream::{AggregatedService, Downstream, Registry};
use crate::local::LocalSource;
use crate::persist::{self, Persister};
use crate::tls::{self, ServerTls, TlsError};
use crate::upstream::client::UpstreamClient;
use crate::upstream::sink::SinkServer;
use crate::upstream::{SinkContext, Subscriptions, UpstreamStatus};

/// Requests from legacy clients are small; this only bounds a bad client.
const MAX_CLIENT_REQUEST_BYTES: usize = 4 << 20;

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
    #[error("cannot build gRPC reflection from the embedded descriptors: {0}")]
    Reflection(tonic_reflection::server::Error),
}

/// A running gateway.
pub struct Bound {
    /// Where `AggregatedMeshConfigService` listens.
    pub listen: SocketAddr,
    /// Where the admin port listens.
    pub admin: SocketAddr,
    /// Where `ResourceSink` listens for Galley's dial-out (`--sink-listen`).
    pub sink: Option<SocketAddr>,
    pub cache: Arc<Cache>,
    pub subscriptions: Arc<Subscriptions>,
    pub registry: Arc<Registry>,
    pub upstream: watch::Receiver<UpstreamStatus>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    grace: Duration,
}

async fn bind(flag: &'static str, addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { flag, addr, source })
}

fn local_addr(flag: &'static str, listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, AppError> {
    listener
        .local_addr()
        .map_err(|source| AppError::Bind { flag, addr, source })
}

/// Binds the listeners and starts everything. The persisted cache is loaded
/// and the local source read before anything listens, so the first client is
/// served at once.
pub async fn build(settings: Settings) -> Result<Bound, AppError> {
    let metrics = crate::metrics::install();
    let sotw_listener = bind("--listen", settings.listen).await?;
    let admin_listener = bind("--admin-listen", settings.admin_listen).await?;
    let listen = local_addr("--listen", &sotw_listener, settings.listen)?;
    let admin = local_addr("--admin-listen", &admin_listener, settings.admin_listen)?;
    let sink_listener = match &settings.source {
        Source::Sink(sink) => {
            let listener = bind("--sink-listen", sink.listen).await?;
            let addr = local_addr("--sink-listen", &listener, sink.listen)?;
            Some((listener, addr))
        }
        _ => None,
    };
    log_effective(&settings);

    let shutdown = CancellationToken::new();
    // Whatever was started stops again if start-up fails further down.
    let started = shutdown.clone().drop_guard();
    let tasks = TaskTracker::new();
    let cache = Arc::new(Cache::new());
    let subscriptions = Arc::new(Subscriptions::new(settings.collections.iter().cloned()));
    let registry = Arc::new(Registry::default());
    let (status_tx, status_rx) = watch::channel(UpstreamStatus {
        mode: "none",
        ..Default::default()
    });
    let server_tls = match &settings.server_tls {
        Some(files) => {
            let tls = ServerTls::new(files.clone())?;
            tls.watch(shutdown.clone())?;
            Some(tls)
        }
        None => None,
    };

    let persister = match &settings.cache_dir {
        Some(dir) => {
            let loaded = persist::load(dir, &cache).map_err(|source| AppError::CacheDir {
                dir: dir.clone(),
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
            Some(Persister::start(dir.clone(), cache.clone(), shutdown.clone(), &tasks))
        }
        None => None,
    };

    let downstream = Downstream::new(
        cache.clone(),
        settings.table.clone(),
        subscriptions.clone(),
        registry.clone(),
        shutdown.clone(),
        tasks.clone(),
    );
    let service = AggregatedService::new(downstream, MAX_CLIENT_REQUEST_BYTES);
    let service_name = <AggregatedService as tonic::server::NamedService>::NAME;
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    health
        .set_service_status(service_name, tonic_health::ServingStatus::NotServing)
        .await;
    tasks.spawn(admin::track_health(
        health,
        service_name,
        subscriptions.clone(),
        cache.clone(),
        shutdown.clone(),
    ));
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1().map_err(AppError::Reflection)?;
    let reflection_v1alpha = reflection().build_v1alpha().map_err(AppError::Reflection)?;
    // Responses go out as a few chunks (frame header, shared body, nonce):
    // `tls::incoming` sets TCP_NODELAY so the small last chunk does not wait
    // for the client's delayed ACK (~40 ms).
    let incoming = tls::incoming("--listen", sotw_listener, server_tls.clone(), shutdown.clone());
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)));
    if let Some(age) = settings.max_connection_age {
        builder = builder
            .max_connection_age(age)
            .max_connection_age_grace(settings.max_connection_age_grace);
    }
    let server = builder
        .add_service(service)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    tasks.spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "the AggregatedMeshConfigService server failed");
        }
    });

    let admin_router = admin::router(AdminState {
        cache: cache.clone(),
        subscriptions: subscriptions.clone(),
        registry: registry.clone(),
        upstream: status_rx.clone(),
        metrics,
    });
    let admin_shutdown = shutdown.clone();
    tasks.spawn(async move {
        let served = axum::serve(admin_listener, admin_router)
            .with_graceful_shutdown(admin_shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the admin server failed");
        }
    });

    let mut sink = None;
    match settings.source {
        Source::Client(upstream) => {
            let context = SinkContext {
                node: upstream.node.clone(),
                incremental: upstream.incremental,
                cache: cache.clone(),
                subscriptions: subscriptions.clone(),
                persister,
            };
            let client = UpstreamClient::new(upstream, context, status_tx);
            tasks.spawn(client.run(shutdown.clone()));
        }
        Source::Sink(settings) => {
            let (listener, addr) = sink_listener.expect("bound above");
            sink = Some(addr);
            let context = SinkContext {
                node: settings.node.clone(),
                incremental: settings.incremental,
                cache: cache.clone(),
                subscriptions: subscriptions.clone(),
                persister,
            };
            let service = SinkServer::new(settings, context, status_tx, shutdown.clone()).into_service();
            let incoming = tls::incoming("--sink-listen", listener, server_tls, shutdown.clone());
            let server = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
            tasks.spawn(async move {
                if let Err(e) = server.await {
                    tracing::error!(error = %e, "the ResourceSink server failed");
                }
            });
            tracing::info!(%addr, "waiting for Galley's dial-out on ResourceSink");
        }
        Source::Files(dir) => {
            let source = LocalSource::new(
                dir.clone(),
                settings.table.clone(),
                cache.clone(),
                subscriptions.clone(),
                status_tx,
            );
            source.start(shutdown.clone()).map_err(|message| AppError::SourceDir {
                dir: dir.to_string(),
                message,
            })?;
            tracing::info!(source = %dir, "serving the local source");
        }
    }

    started.disarm();
    tracing::info!(%listen, %admin, sink = ?sink, tls = server_tls_on(&settings.server_tls), "gateway listening");
    Ok(Bound {
        listen,
        admin,
        sink,
        cache,
        subscriptions,
        registry,
        upstream: status_rx,
        shutdown,
        tasks,
        grace: settings.shutdown_grace,
    })
}

fn server_tls_on(tls: &Option<crate::tls::ServerTlsFiles>) -> &'static str {
    match tls {
        None => "off",
        Some(files) if files.client_ca.is_some() => "mtls",
        Some(_) => "on",
    }
}

/// One line with every setting that matters, once, before listening.
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
        Source::Files(dir) => ("files", dir.to_string(), "", false, None),
    };
    let client = match &settings.source {
        Source::Client(c) => Some(c),
        _ => None,
    };
    tracing::info!(
        source = mode,
        upstream = %address,
        node_id = node,
        incremental,
        collections = ?settings.collections,
        type_map = ?settings.type_map,
        table_rows = settings.table.len(),
        max_message_bytes,
        keepalive = ?client.and_then(|u| u.keepalive),
        backoff = ?client.map(|u| u.backoff),
        upstream_tls = client.is_some_and(|u| u.tls.is_some()),
        tls = server_tls_on(&settings.server_tls),
        cache_dir = ?settings.cache_dir,
        shutdown_grace = ?settings.shutdown_grace,
        max_connection_age = ?settings.max_connection_age,
        max_connection_age_grace = ?settings.max_connection_age_grace,
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
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tasks.close();
        if tokio::time::timeout(self.grace, self.tasks.wait()).await.is_err() {
            tracing::warn!(grace = ?self.grace, "streams still open after the shutdown grace period; exiting anyway");
        }
    }
}
