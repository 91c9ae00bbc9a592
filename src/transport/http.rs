//! The admin and monitoring HTTP/1 listeners: a connection limit (per port and
//! per peer address), a header-read timeout (which also closes idle
//! keep-alive connections), a bound on the request head, and a lifetime per
//! connection, so no peer can hold the port that the kubelet and Prometheus
//! need.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::accept_backoff::AcceptBackoff;
use super::LogLimiter;
use crate::metrics as m;

#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Open connections per port (`--http-max-connections`); an eighth of
    /// them per peer address.
    pub max_connections: usize,
    /// Time to send a request's headers, and the longest idle keep-alive
    /// (`--http-header-timeout`).
    pub header_timeout: Duration,
    /// Largest request head, and body (`--http-max-request-bytes`).
    pub max_request_bytes: usize,
}

/// A connection this old is closed after its current request.
const MAX_CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// Open connections by peer address, bounded per peer and in total.
#[derive(Debug)]
struct Slots {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
    max_total: usize,
    max_per_peer: usize,
}

struct Slot {
    slots: Arc<Mutex<Slots>>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.total -= 1;
        if let Some(n) = slots.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                slots.per_peer.remove(&self.peer);
            }
        }
    }
}

fn take_slot(slots: &Arc<Mutex<Slots>>, peer: IpAddr) -> Result<Slot, String> {
    let mut guard = slots.lock().unwrap_or_else(|e| e.into_inner());
    if guard.total >= guard.max_total {
        return Err(format!("{} connections, --http-max-connections,", guard.max_total));
    }
    let max_per_peer = guard.max_per_peer;
    let count = guard.per_peer.entry(peer).or_insert(0);
    if *count >= max_per_peer {
        return Err(format!(
            "{max_per_peer} connections from one address (an eighth of --http-max-connections={})",
            guard.max_total
        ));
    }
    *count += 1;
    guard.total += 1;
    Ok(Slot {
        slots: slots.clone(),
        peer,
    })
}

/// Serves `router` on `listener` until `shutdown`. `name` is the flag that
/// configured the port (`--admin-listen`, `--monitoring-listen`).
pub fn serve(
    name: &'static str,
    listener: TcpListener,
    router: axum::Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
    tasks: &TaskTracker,
) {
    let router = router.layer(axum::extract::DefaultBodyLimit::max(limits.max_request_bytes));
    let slots = Arc::new(Mutex::new(Slots {
        total: 0,
        per_peer: HashMap::new(),
        max_total: limits.max_connections,
        max_per_peer: (limits.max_connections / 8).max(1),
    }));
    let tracker = tasks.clone();
    tasks.spawn(async move {
        let mut backoff = AcceptBackoff::default();
        let refusals = LogLimiter::default();
        loop {
            let (stream, peer): (_, SocketAddr) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => {
                        backoff.reset();
                        accepted
                    }
                    Err(e) => {
                        backoff.wait(name, &e, &shutdown).await;
                        continue;
                    }
                },
                _ = shutdown.cancelled() => return,
            };
            let slot = match take_slot(&slots, peer.ip()) {
                Ok(slot) => slot,
                Err(limit) => {
                    m::limit_refused("http_connections");
                    if let Some(skipped) = refusals.allow() {
                        tracing::warn!(listener = name, %peer, skipped, "refused an HTTP connection: the limit of {limit} is reached");
                    }
                    let body = format!("the limit of {limit} is reached\n");
                    let answer = format!(
                        "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    super::refuse_and_close(stream, answer.into_bytes(), &tracker);
                    continue;
                }
            };
            // The peer, for handlers and layers that name it (the admin
            // port's audit log).
            let service = TowerToHyperService::new(tower::ServiceExt::map_request(
                router.clone(),
                move |mut request: axum::http::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                    request
                },
            ));
            let shutdown = shutdown.clone();
            tracker.spawn(async move {
                let _slot = slot;
                m::connection_opened(name);
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .max_buf_size(limits.max_request_bytes.max(8192));
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                let mut conn = std::pin::pin!(conn);
                let reason = tokio::select! {
                    served = conn.as_mut() => match served {
                        Ok(()) => "peer_closed",
                        Err(e) if e.is_timeout() => {
                            m::limit_refused("http_header_timeout");
                            "header_timeout"
                        }
                        Err(_) => "protocol_error",
                    },
                    _ = tokio::time::sleep(MAX_CONNECTION_LIFETIME) => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(5), conn.as_mut()).await;
                        "max_age"
                    }
                    _ = shutdown.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(Duration::from_secs(1), conn.as_mut()).await;
                        "shutdown"
                    }
                };
                m::connection_closed(name, reason);
            });
        }
    });
}
