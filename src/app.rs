//! Wiring: binds every listener first (port 0 works), starts the servers and
//! the upstream, and hands back the bound addresses and the shared state.
//! `main` only waits; tests start the same app in-process.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, AdminState};
use crate::cache::Cache;
use crate::config::Settings;
use crate::downstream::{AggregatedService, Downstream, Registry};
use crate::upstream::client::UpstreamClient;
use crate::upstream::{Subscriptions, UpstreamStatus};

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
}

/// A running gateway.
pub struct Bound {
    /// Where `AggregatedMeshConfigService` listens.
    pub listen: SocketAddr,
    /// Where the admin port listens.
    pub admin: SocketAddr,
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

/// Binds the listeners and starts everything.
pub async fn build(settings: Settings) -> Result<Bound, AppError> {
    crate::metrics::describe();
    let sotw_listener = bind("--listen", settings.listen).await?;
    let admin_listener = bind("--admin-listen", settings.admin_listen).await?;
    let listen = sotw_listener.local_addr().map_err(|source| AppError::Bind {
        flag: "--listen",
        addr: settings.listen,
        source,
    })?;
    let admin = admin_listener.local_addr().map_err(|source| AppError::Bind {
        flag: "--admin-listen",
        addr: settings.admin_listen,
        source,
    })?;

    tracing::info!(
        upstream = settings.upstream.as_ref().map_or("none", |u| u.address.as_str()),
        node_id = settings.upstream.as_ref().map_or("", |u| u.node.id.as_str()),
        incremental = settings.upstream.as_ref().is_some_and(|u| u.incremental),
        collections = ?settings.collections,
        type_map = ?settings.type_map,
        table_rows = settings.table.len(),
        max_message_bytes = settings.upstream.as_ref().map(|u| u.max_message_bytes),
        keepalive = ?settings.upstream.as_ref().and_then(|u| u.keepalive),
        backoff = ?settings.upstream.as_ref().map(|u| u.backoff),
        shutdown_grace = ?settings.shutdown_grace,
        "effective configuration"
    );

    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let cache = Arc::new(Cache::new());
    let subscriptions = Arc::new(Subscriptions::new(settings.collections.iter().cloned()));
    let registry = Arc::new(Registry::default());
    let (status_tx, status_rx) = watch::channel(UpstreamStatus {
        mode: "none",
        ..Default::default()
    });

    let downstream = Downstream::new(
        cache.clone(),
        settings.table.clone(),
        subscriptions.clone(),
        registry.clone(),
        shutdown.clone(),
        tasks.clone(),
    );
    let service = AggregatedService::new(downstream, MAX_CLIENT_REQUEST_BYTES);
    // Responses go out as a few chunks (frame header, shared body, nonce):
    // without TCP_NODELAY the small last chunk waits for the client's delayed
    // ACK (~40 ms). `Server::tcp_nodelay` does not apply to a given listener.
    let incoming = tonic::transport::server::TcpIncoming::from(sotw_listener).with_nodelay(Some(true));
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(service)
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

    match settings.upstream {
        Some(upstream) => {
            let client = UpstreamClient::new(upstream, cache.clone(), subscriptions.clone(), status_tx);
            tasks.spawn(client.run(shutdown.clone()));
        }
        None => {
            tracing::warn!("no upstream configured (--upstream): clients get no config until the gateway has a source")
        }
    }

    tracing::info!(%listen, %admin, "gateway listening");
    Ok(Bound {
        listen,
        admin,
        cache,
        subscriptions,
        registry,
        upstream: status_rx,
        shutdown,
        tasks,
        grace: settings.shutdown_grace,
    })
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
