//! Transport: everything between a socket and a service. TLS and peer
//! identities, the gRPC listeners on h2 with their HTTP/2 and connection
//! limits, the admin and monitoring HTTP listeners, the upstream client's
//! connection, file watching. No protocol logic lives here.

pub mod access;
pub mod bucket;
pub mod call;
pub mod connect;
pub mod defer;
pub mod dial_why;
pub mod fswatch;
pub mod gather;
pub mod grpc;
pub mod http;
pub mod identity;
pub mod pattern;
pub mod requests;
pub mod respond;
pub mod safe_text;
pub mod slots;
pub mod sniff;
pub mod tls;

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How often a repeated warning may be logged.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Rate limit for a repeated log line: the first is logged, then at most one
/// per [`LOG_INTERVAL`], carrying how many were skipped. A peer that repeats
/// a refused action in a loop cannot flood the log.
#[derive(Debug, Default)]
pub struct LogLimiter {
    state: Mutex<(Option<Instant>, u32)>,
}

impl LogLimiter {
    pub const fn new() -> Self {
        Self {
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(skipped since the last line)` when this one may be logged.
    pub fn allow(&self) -> Option<u32> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < LOG_INTERVAL => {
                state.1 = state.1.saturating_add(1);
                None
            }
            _ => {
                state.0 = Some(now);
                Some(std::mem::take(&mut state.1))
            }
        }
    }
}

/// What an accept loop does when `accept` fails: out of file descriptors or
/// memory, it waits (doubling from 5 ms to 1 s) instead of spinning on the
/// error while the backlog holds the peers; anything else (a peer that reset
/// before it was accepted) is retried at once.
pub mod accept_backoff {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use crate::metrics as m;

    #[derive(Debug, Default)]
    pub struct AcceptBackoff {
        delay: Option<Duration>,
    }

    impl AcceptBackoff {
        pub fn reset(&mut self) {
            self.delay = None;
        }

        pub async fn wait(&mut self, listener: &'static str, error: &std::io::Error, shutdown: &CancellationToken) {
            let exhausted = matches!(
                error.raw_os_error(),
                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
            );
            m::accept_error(listener, if exhausted { "resources" } else { "other" });
            if !exhausted {
                return;
            }
            let delay = self
                .delay
                .map_or(Duration::from_millis(5), |d| (d * 2).min(Duration::from_secs(1)));
            self.delay = Some(delay);
            static LOGS: super::LogLimiter = super::LogLimiter::new();
            if let Some(skipped) = LOGS.allow() {
                tracing::warn!(
                    listener,
                    error = %error,
                    retry_in_ms = delay.as_millis() as u64,
                    skipped,
                    "cannot accept connections (out of file descriptors or memory); waiting"
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.cancelled() => {}
            }
        }
    }
}

/// Answers a connection refused by a limit with `bytes` (an HTTP 503, an
/// HTTP/2 GOAWAY), then closes it without a reset: the peer's own request is
/// read and dropped for at most a second, so it reads the answer instead of
/// ECONNRESET. The refused peer costs one small task with a deadline.
pub fn refuse_and_close(mut stream: tokio::net::TcpStream, bytes: Vec<u8>, tasks: &tokio_util::task::TaskTracker) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tasks.spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(&bytes).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
    });
}

/// The soft `RLIMIT_NOFILE` raised to the hard limit (containers often start
/// with 1024 soft and far more hard). Returns the limit now in effect.
pub fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open file limit; --max-connections is sized from the current one");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// Descriptors kept for everything but gRPC connections: the upstream, the
/// admin and monitoring connections, the cache directory, watches, logs.
pub fn fd_reserve(http_max_connections: usize) -> u64 {
    128 + 2 * http_max_connections as u64
}
