//! The gRPC listeners (downstream `--listen`, dial-out `--sink-listen`) on h2
//! directly, so that every HTTP/2 limit is ours to set and enforce per
//! connection: concurrent streams, header size, resets, pings, SETTINGS,
//! handshake and idle timeouts, keepalive, maximum age, and GOAWAY with the
//! right code. Each accepted stream is handed to a tower service (tonic's
//! routes), so the gRPC services themselves know nothing of this.
//!
//! One task per connection drives its h2 state and timers; one task per
//! stream runs the service and writes its response with h2's flow control
//! (at most one response chunk buffered beyond the peer's window). A
//! service may take the stream's response from the request
//! ([`super::respond`]) and write it from its own task: the discovery
//! services do, so each of their streams is one task.

use std::convert::Infallible;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Buf;
use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http_body::{Body as _, Frame};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{sleep_until, Instant};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;
use tower::ServiceExt;

use super::bucket::{PeerBuckets, TokenBucket};
use super::defer::{ConnectionGate, Deferred};
use super::gather::{Gathered, Payload};
use super::identity::{AllowList, PeerIdentity};
use super::respond::{poll_window, ResponseSlot};
use super::slots::{Admission, ConnectionSlots, Evicted, Slot};
use super::sniff::{FloodLimits, Side, Sniffed};
use super::tls::ServerTls;
use super::{accept_backoff, LogLimiter};
use crate::metrics as m;

/// The HTTP/2 and connection limits of the gRPC listeners (flags).
#[derive(Clone, Debug)]
pub struct GrpcLimits {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (`--max-streams-per-connection`).
    pub max_streams_per_connection: u32,
    /// `SETTINGS_MAX_HEADER_LIST_SIZE` (`--max-header-list-bytes`).
    pub max_header_list_bytes: u32,
    /// TCP accepted to TLS done, client preface and SETTINGS read
    /// (`--handshake-timeout`).
    pub handshake_timeout: Duration,
    /// A connection with no stream this long is closed (`--idle-timeout`;
    /// `None`: never).
    pub idle_timeout: Option<Duration>,
    /// Pings to the peer (`--keepalive-interval`); a peer that does not answer
    /// within the timeout is dropped.
    pub keepalive: Option<Duration>,
    pub max_connection_age: Option<Duration>,
    pub max_connection_age_grace: Duration,
    pub floods: FloodLimits,
    /// h2's own bound on streams the peer resets before they are accepted.
    pub max_pending_accept_resets: usize,
    /// h2's own bound on streams it must reset because of the peer's errors
    /// ("made you reset").
    pub max_local_error_resets: usize,
    /// HTTP/2 receive window of a connection and of each stream: what a peer
    /// may send before the gateway reads it (`--max-receive-window-bytes`).
    pub receive_window: u32,
}

/// How long a pong may take before a peer counts as gone.
pub fn keepalive_timeout(interval: Duration) -> Duration {
    interval.min(Duration::from_secs(20))
}

/// Limits shared by every gRPC listener of the process.
#[derive(Debug)]
pub struct SharedLimits {
    /// `--max-connections`: a new connection at the limit takes the slot of
    /// one still handshaking or idle.
    pub connections: Arc<ConnectionSlots>,
    pub max_connections: usize,
    /// `--max-streams`: open streams across all connections.
    pub streams: Arc<Semaphore>,
    pub max_streams: usize,
    /// `--max-new-streams-per-second`, per peer IP address.
    pub new_streams: PeerBuckets,
    pub new_streams_per_second: u32,
}

impl SharedLimits {
    pub fn new(max_connections: usize, max_streams: usize, new_streams_per_second: u32) -> Arc<Self> {
        Arc::new(Self {
            connections: ConnectionSlots::new(max_connections),
            max_connections,
            streams: Arc::new(Semaphore::new(max_streams)),
            max_streams,
            // Bursts of ten seconds' worth: a client reconnecting with one
            // stream per type opens tens of streams at once.
            new_streams: PeerBuckets::new(
                f64::from(new_streams_per_second),
                f64::from(new_streams_per_second) * 10.0,
                65_536,
            ),
            new_streams_per_second,
        })
    }
}

/// One gRPC listener's configuration.
#[derive(Clone)]
pub struct GrpcListener {
    /// The flag that configured it, for logs and metrics (`--listen`).
    pub name: &'static str,
    pub tls: Option<Arc<ServerTls>>,
    /// With mTLS: the peer identities accepted.
    pub allow: Option<AllowList>,
    pub limits: Arc<GrpcLimits>,
    pub shared: Arc<SharedLimits>,
}

/// What the services learn about the connection a stream came on (a request
/// extension).
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub listener: &'static str,
    pub peer: SocketAddr,
    pub identity: Arc<PeerIdentity>,
    /// Armed by a version's wakes of the connection's streams, so that its
    /// task writes their responses together (`defer`).
    pub gate: ConnectionGate,
}

/// Accepts connections until `shutdown` and serves each with `service`.
pub fn serve<S>(
    listener: TcpListener,
    config: GrpcListener,
    service: S,
    shutdown: CancellationToken,
    tasks: TaskTracker,
) where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let tracker = tasks.clone();
    tasks.spawn(async move {
        let config = Arc::new(config);
        let mut backoff = accept_backoff::AcceptBackoff::default();
        let refusals = LogLimiter::default();
        let evictions = LogLimiter::default();
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => {
                        backoff.reset();
                        accepted
                    }
                    Err(e) => {
                        backoff.wait(config.name, &e, &shutdown).await;
                        continue;
                    }
                },
                _ = shutdown.cancelled() => return,
            };
            let slot = match config.shared.connections.admit(peer) {
                Admission::Admitted { slot, evicted } => {
                    if let Some(evicted) = evicted {
                        log_eviction(&config, evicted, peer, &evictions);
                    }
                    slot
                }
                Admission::Full => {
                    refuse_connection(&config, stream, peer, &refusals, &tracker);
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let gate = ConnectionGate::default();
            let connection = Connection {
                config: config.clone(),
                service: service.clone(),
                shutdown: shutdown.clone(),
                tasks: tracker.clone(),
                peer,
                streams: Arc::new(StreamCount {
                    slot,
                    ended: Notify::new(),
                }),
                gate: gate.clone(),
            };
            tracker.spawn(Deferred::new(gate, connection.run(stream)));
        }
    });
}

/// At `--max-connections`, a connection without a live stream made room for
/// `peer`'s: counted, and logged (rate-limited).
fn log_eviction(config: &GrpcListener, evicted: Evicted, peer: SocketAddr, logs: &LogLimiter) {
    m::connection_evicted(config.name, evicted.reason.as_str());
    if let Some(skipped) = logs.allow() {
        tracing::info!(
            listener = config.name,
            evicted = %evicted.peer,
            reason = evicted.reason.as_str(),
            %peer,
            skipped,
            "connection limit reached (--max-connections={}); closed a connection without a live stream to admit a new one",
            config.shared.max_connections
        );
    }
}

/// At `--max-connections` with every connection carrying a live stream: the
/// peer gets the server's SETTINGS and a GOAWAY saying why (on a TLS port, a
/// closed connection: a handshake would cost what the limit saves), and the
/// connection is closed.
fn refuse_connection(
    config: &GrpcListener,
    stream: TcpStream,
    peer: SocketAddr,
    logs: &LogLimiter,
    tasks: &TaskTracker,
) {
    m::limit_refused("max_connections");
    let reason = format!(
        "connection limit reached: --max-connections={}",
        config.shared.max_connections
    );
    if config.tls.is_none() {
        super::refuse_and_close(stream, goaway_frames(Reason::REFUSED_STREAM, reason.as_bytes()), tasks);
    }
    if let Some(skipped) = logs.allow() {
        tracing::warn!(listener = config.name, %peer, skipped, "{reason}; connection refused");
    }
}

/// An empty SETTINGS frame and a GOAWAY with `reason` and `debug` data.
pub fn goaway_frames(reason: Reason, debug: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0];
    let len = 8 + debug.len();
    bytes.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, 0x7, 0, 0, 0, 0, 0]);
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&u32::from(reason).to_be_bytes());
    bytes.extend_from_slice(debug);
    bytes
}

struct Connection<S> {
    config: Arc<GrpcListener>,
    service: S,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    peer: SocketAddr,
    /// Its slot and open streams; the slot is given back when the
    /// connection and its last stream are gone.
    streams: Arc<StreamCount>,
    gate: ConnectionGate,
}

/// Why a connection closed (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    ByPeer,
    HandshakeTimeout,
    TlsHandshake,
    Idle,
    MaxAge,
    Flood,
    KeepaliveTimeout,
    Protocol,
    Shutdown,
    /// A newer connection took its slot at `--max-connections`.
    Evicted,
}

impl Closed {
    fn as_str(self) -> &'static str {
        match self {
            Closed::ByPeer => "peer_closed",
            Closed::HandshakeTimeout => "handshake_timeout",
            Closed::TlsHandshake => "tls_handshake",
            Closed::Idle => "idle",
            Closed::MaxAge => "max_age",
            Closed::Flood => "flood",
            Closed::KeepaliveTimeout => "keepalive_timeout",
            Closed::Protocol => "protocol_error",
            Closed::Shutdown => "shutdown",
            Closed::Evicted => "evicted",
        }
    }
}

/// A peer that stops reading cannot keep a closing connection open longer.
const CLOSE_FLUSH: Duration = Duration::from_secs(1);

/// ±10 % of the maximum age, so replicas started together do not recycle
/// every connection in the same second.
fn jittered(age: Duration) -> Duration {
    let spread = age.as_secs_f64() * 0.1;
    let unit = f64::from(rand_u16()) / f64::from(u16::MAX);
    Duration::from_secs_f64((age.as_secs_f64() - spread + 2.0 * spread * unit).max(0.0))
}

/// A few random bits without a generator dependency: the std hasher's keys
/// are random per process, and the clock varies per call.
fn rand_u16() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos()));
    hasher.finish() as u16
}

impl<S> Connection<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    async fn run(mut self, stream: TcpStream) {
        let name = self.config.name;
        m::connection_opened(name);
        let closed = self.serve(stream).await;
        m::connection_closed(name, closed.as_str());
        tracing::debug!(listener = name, peer = %self.peer, reason = closed.as_str(), "connection closed");
    }

    async fn serve(&mut self, stream: TcpStream) -> Closed {
        let limits = &self.config.limits;
        let streams = self.streams.clone();
        let handshake_deadline = Instant::now() + limits.handshake_timeout;
        let (conn, identity) = match &self.config.tls {
            None => (Either::Left(stream), PeerIdentity::default()),
            // Boxed, as the HTTP/2 handshake below: each was room in every
            // connection's task for its whole life (7,296 bytes with both
            // inline, 3,720 without: the task is as large as its largest
            // step).
            Some(tls) => match unless_evicted(
                &streams.slot,
                tokio::time::timeout_at(handshake_deadline, Box::pin(tls.acceptor().accept(stream))),
            )
            .await
            {
                // A TLS handshake in progress is not handshaken: evicted,
                // the socket is just closed.
                None => return Closed::Evicted,
                Some(Ok(Ok(stream))) => {
                    let identity = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|certs| certs.first())
                        .map(|cert| PeerIdentity::from_der(cert))
                        .unwrap_or_default();
                    (Either::Right(Box::new(stream)), identity)
                }
                Some(Ok(Err(e))) => {
                    static LOGS: LogLimiter = LogLimiter::new();
                    if let Some(skipped) = LOGS.allow() {
                        tracing::info!(listener = self.config.name, peer = %self.peer, error = %e, skipped, "TLS handshake failed");
                    }
                    return Closed::TlsHandshake;
                }
                Some(Err(_)) => {
                    m::limit_refused("handshake_timeout");
                    return Closed::HandshakeTimeout;
                }
            },
        };
        let local = match &conn {
            Either::Left(s) => s.local_addr().ok(),
            Either::Right(s) => s.get_ref().0.local_addr().ok(),
        };
        let (io, signals) = Sniffed::new(conn, Side::Server, Some(limits.floods));
        let mut builder = h2::server::Builder::new();
        builder
            .max_concurrent_streams(limits.max_streams_per_connection)
            .max_header_list_size(limits.max_header_list_bytes)
            .max_pending_accept_reset_streams(limits.max_pending_accept_resets)
            .max_local_error_reset_streams(Some(limits.max_local_error_resets))
            // What a peer may send before it is read; responses go out on
            // the window the client grants.
            .initial_window_size(limits.receive_window)
            .initial_connection_window_size(limits.receive_window)
            .max_send_buffer_size(1 << 20);
        let handshake = tokio::time::timeout_at(handshake_deadline, Box::pin(builder.handshake::<_, Payload>(io)));
        let mut h2 = match unless_evicted(&streams.slot, handshake).await {
            None => return Closed::Evicted,
            Some(Ok(Ok(h2))) => h2,
            // Not HTTP/2 (HTTP/1, TLS to a plaintext port, garbage): closed.
            Some(Ok(Err(e))) if e.is_io() => return Closed::ByPeer,
            Some(Ok(Err(_))) => return Closed::Protocol,
            Some(Err(_)) => {
                m::limit_refused("handshake_timeout");
                return Closed::HandshakeTimeout;
            }
        };
        let info = ConnInfo {
            listener: self.config.name,
            peer: self.peer,
            identity: Arc::new(identity),
            gate: self.gate.clone(),
        };
        let connect_info = TcpConnectInfo {
            local_addr: local,
            remote_addr: Some(self.peer),
        };
        let mut refusals = TokenBucket::per_minute(limits.floods.resets_per_minute);
        let mut awaiting_handshake = true;
        let mut ping = h2.ping_pong().expect("ping_pong is taken once");
        let started = Instant::now();
        let keepalive = limits.keepalive;
        let mut next_ping = keepalive.map(|k| started + k);
        let mut pong_deadline: Option<Instant> = None;
        let mut age_deadline = limits.max_connection_age.map(|age| started + jittered(age));
        let mut hard_deadline: Option<Instant> = None;
        let mut idle_since = Some(started);
        let mut draining: Option<Closed> = None;
        // One timer for the connection's deadlines (handshake, idle, age,
        // the drain's end, keepalive), set to the earliest: an idle
        // connection's task holds one timer, not one per deadline.
        let mut timer = std::pin::pin!(sleep_until(handshake_deadline));
        loop {
            let idle_deadline = match (idle_since, limits.idle_timeout) {
                (Some(since), Some(timeout)) if draining.is_none() => Some(since + timeout),
                _ => None,
            };
            let next_deadline = [
                awaiting_handshake.then_some(handshake_deadline),
                idle_deadline,
                age_deadline,
                hard_deadline,
                next_ping,
            ]
            .into_iter()
            .flatten()
            .min();
            if let Some(deadline) = next_deadline {
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
            }
            tokio::select! {
                accepted = h2.accept() => match accepted {
                    Some(Ok((request, mut respond))) => match admit(&self.config, &info) {
                        Ok(permit) => {
                            if !streams.slot.stream_opened() {
                                // Evicted a moment ago (its slot is gone):
                                // the connection is closing.
                                refuse(&mut respond, Status::unavailable("the connection is closing; open a new one"));
                                continue;
                            }
                            idle_since = None;
                            let stream = StreamTask {
                                service: self.service.clone(),
                                info: info.clone(),
                                connect_info: connect_info.clone(),
                                count: streams.clone(),
                                permit,
                            };
                            self.tasks.spawn(stream.run(request, respond));
                        }
                        Err(status) => {
                            refuse(&mut respond, status);
                            // A peer that keeps opening refused streams is
                            // flooding like one that resets them.
                            if !refusals.take() {
                                m::limit_refused("refused_streams");
                                h2.abrupt_shutdown(Reason::ENHANCE_YOUR_CALM);
                                return finish(&mut h2, Closed::Flood).await;
                            }
                        }
                    },
                    Some(Err(e)) => {
                        if e.reason() == Some(Reason::ENHANCE_YOUR_CALM) {
                            m::limit_refused("h2_resets");
                            return Closed::Flood;
                        }
                        return draining.unwrap_or(if e.is_io() { Closed::ByPeer } else { Closed::Protocol });
                    }
                    None => return draining.unwrap_or(Closed::ByPeer),
                },
                limit = signals.flood() => {
                    m::limit_refused(limit);
                    static LOGS: LogLimiter = LogLimiter::new();
                    if let Some(skipped) = LOGS.allow() {
                        tracing::warn!(
                            listener = self.config.name,
                            peer = %self.peer,
                            limit,
                            skipped,
                            "the peer floods HTTP/2 control frames; closing its connection with GOAWAY ENHANCE_YOUR_CALM"
                        );
                    }
                    h2.abrupt_shutdown(Reason::ENHANCE_YOUR_CALM);
                    return finish(&mut h2, Closed::Flood).await;
                }
                done = signals.handshake(), if awaiting_handshake => {
                    awaiting_handshake = false;
                    if done.is_ok() {
                        streams.slot.handshake_done();
                    }
                }
                _ = streams.ended() => {
                    if streams.slot.open_streams() == 0 {
                        idle_since = Some(Instant::now());
                    }
                }
                _ = streams.slot.evicted(), if draining.is_none() => {
                    // A newer connection took the slot: a half-open one is
                    // just closed, an idle one gets GOAWAY first.
                    if awaiting_handshake {
                        return Closed::Evicted;
                    }
                    h2.abrupt_shutdown(Reason::NO_ERROR);
                    return finish(&mut h2, Closed::Evicted).await;
                }
                _ = timer.as_mut(), if next_deadline.is_some() => {
                    let now = Instant::now();
                    if awaiting_handshake && now >= handshake_deadline {
                        if !signals.handshake_done() {
                            m::limit_refused("handshake_timeout");
                            return Closed::HandshakeTimeout;
                        }
                        awaiting_handshake = false;
                        streams.slot.handshake_done();
                    }
                    if hard_deadline.is_some_and(|d| now >= d) {
                        return draining.unwrap_or(Closed::Shutdown);
                    }
                    if idle_deadline.is_some_and(|d| now >= d) {
                        // Not idle if a stream opened meanwhile (its accept
                        // cleared `idle_since` too).
                        idle_since = None;
                        if streams.slot.open_streams() == 0 {
                            h2.graceful_shutdown();
                            draining = Some(Closed::Idle);
                            hard_deadline = Some(now + CLOSE_FLUSH);
                        }
                    }
                    if age_deadline.is_some_and(|d| now >= d) {
                        age_deadline = None;
                        if draining.is_none() {
                            h2.graceful_shutdown();
                            draining = Some(Closed::MaxAge);
                            hard_deadline = Some(now + limits.max_connection_age_grace);
                        }
                    }
                    if next_ping.is_some_and(|d| now >= d) {
                        if pong_deadline.is_some_and(|d| now >= d) {
                            return Closed::KeepaliveTimeout;
                        }
                        if pong_deadline.is_none() && ping.send_ping(h2::Ping::opaque()).is_ok() {
                            let timeout = keepalive_timeout(keepalive.expect("pinging"));
                            pong_deadline = Some(now + timeout);
                            next_ping = Some(now + timeout);
                        } else if pong_deadline.is_none() {
                            next_ping = keepalive.map(|k| now + k);
                        }
                    }
                }
                pong = poll_fn(|cx| ping.poll_pong(cx)), if pong_deadline.is_some() => {
                    pong_deadline = None;
                    if pong.is_err() {
                        // The connection is closing; `accept` says how.
                        next_ping = None;
                        continue;
                    }
                    next_ping = keepalive.map(|k| Instant::now() + k);
                }
                _ = self.shutdown.cancelled(), if draining != Some(Closed::Shutdown) => {
                    // Streams end themselves on shutdown; the connection
                    // closes when they are done.
                    h2.graceful_shutdown();
                    draining = Some(Closed::Shutdown);
                }
            }
        }
    }
}

/// Lets h2 write what it has queued (a GOAWAY), for a bounded time.
async fn finish<T, B>(h2: &mut h2::server::Connection<T, B>, closed: Closed) -> Closed
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    B: bytes::Buf,
{
    let _ = tokio::time::timeout(CLOSE_FLUSH, async { while let Some(Ok(_)) = h2.accept().await {} }).await;
    closed
}

/// `step` of a connection's handshake, unless a newer connection takes its
/// slot first (None).
async fn unless_evicted<T>(slot: &Slot, step: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        _ = slot.evicted() => None,
        out = step => Some(out),
    }
}

/// One connection's slot (which counts its open streams), and a wake-up
/// when a stream ends.
#[derive(Debug)]
struct StreamCount {
    slot: Slot,
    ended: Notify,
}

impl StreamCount {
    /// Resolves after a stream ended (a wake-up is kept if none was waiting).
    async fn ended(&self) {
        self.ended.notified().await
    }
}

/// Decrements the count when a stream's task ends, however it ends.
struct StreamGuard(Arc<StreamCount>);

/// What keeps a stream counted as open: on its connection (its idle timer
/// and its slot) and under `--max-streams`. Dropped when the stream's
/// response ends, whoever writes it (see [`super::respond`]).
pub(super) struct Hold {
    _guard: StreamGuard,
    _permit: OwnedSemaphorePermit,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.slot.stream_ended();
        self.0.ended.notify_one();
    }
}

struct StreamTask<S> {
    service: S,
    info: ConnInfo,
    connect_info: TcpConnectInfo,
    count: Arc<StreamCount>,
    /// The stream's place under `--max-streams`.
    permit: OwnedSemaphorePermit,
}

/// Admits a new stream, or says why not (answered trailers-only by the
/// connection's task: a refusal spawns nothing).
fn admit(config: &GrpcListener, info: &ConnInfo) -> Result<OwnedSemaphorePermit, Status> {
    let shared = &config.shared;
    let Ok(permit) = shared.streams.clone().try_acquire_owned() else {
        m::limit_refused("max_streams");
        return Err(Status::resource_exhausted(format!(
            "the gateway serves at most --max-streams={} streams; try another replica",
            shared.max_streams
        )));
    };
    if !shared.new_streams.take(info.peer.ip()) {
        m::limit_refused("new_streams_rate");
        return Err(Status::resource_exhausted(format!(
            "too many new streams from {}: --max-new-streams-per-second={}",
            info.peer.ip(),
            shared.new_streams_per_second
        )));
    }
    if let Some(allow) = &config.allow {
        if !allow.allows(&info.identity) {
            m::peer_not_allowed(config.name);
            static LOGS: LogLimiter = LogLimiter::new();
            if let Some(skipped) = LOGS.allow() {
                tracing::warn!(
                    listener = config.name,
                    peer = %info.peer,
                    identity = %info.identity,
                    skipped,
                    "refused a peer whose identity is not in {}",
                    allow.flag
                );
            }
            return Err(Status::permission_denied(format!(
                "identity {} is not allowed by {}",
                info.identity, allow.flag
            )));
        }
    }
    Ok(permit)
}

impl<S> StreamTask<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    /// The stream's task. The request is prepared and the service's call
    /// made here, before the task exists: an `async fn`'s arguments stay in
    /// its future for its whole life, and what an idle stream keeps is only
    /// its hold and the response being written (the call, boxed, is freed
    /// when it returns).
    ///
    /// A service that writes its own response takes it from the request's
    /// [`ResponseSlot`] (with the hold): then this task ends when the call
    /// returns, and the stream is the service's task alone.
    fn run(
        self,
        request: http::Request<RecvStream>,
        respond: SendResponse<Payload>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let hold = Hold {
            _guard: StreamGuard(self.count),
            _permit: self.permit,
        };
        let slot = ResponseSlot::answering(respond, hold);
        let (parts, body) = request.into_parts();
        let body = RequestSlot::new(RecvBody::new(body));
        let mut request = http::Request::from_parts(parts, Body::new(SlotBody(body.clone())));
        request.extensions_mut().insert(self.connect_info);
        request.extensions_mut().insert(self.info);
        request.extensions_mut().insert(slot.clone());
        request.extensions_mut().insert(body);
        let call = Box::pin(self.service.oneshot(request));
        async move {
            let Ok(response) = call.await;
            // Taken: the service writes the response itself.
            let Some(unanswered) = slot.take() else {
                return;
            };
            drop(slot);
            let (respond, _hold) = unanswered.into_parts();
            // Errors here are the client's reset or a closed connection: the
            // stream is gone either way.
            let _ = write_response(respond, response).await;
        }
    }
}

/// A trailers-only gRPC response with `status`.
fn refuse(respond: &mut SendResponse<Payload>, status: Status) {
    let (parts, _) = status.into_http::<()>().into_parts();
    let _ = respond.send_response(http::Response::from_parts(parts, ()), true);
}

/// Body bytes gathered into one DATA frame at most: a full state of the
/// cache is one write, yet a stream's share of the connection stays bounded.
const GATHER_LIMIT: usize = 1 << 20;

/// What the body had ready: data (possibly none), then maybe its end.
enum Ready {
    /// More may come.
    More,
    /// The body ended here, with these trailers (or none).
    End(Option<http::HeaderMap>),
    /// The body failed.
    Failed(Status),
}

/// Writes a response: headers, then the body's data as h2's flow control
/// allows, then trailers. Whatever data the body has ready (a response's
/// frame header, shared chunks and suffix) goes in one DATA frame, which h2
/// writes with one vectored write when the peer's frame size and window
/// allow. Returns when the body ends or the peer resets.
///
/// The headers go before the future exists: it holds only the body and the
/// send side while the stream is idle, not the response's parts and the
/// responder too (an `async fn` keeps its arguments for its whole life).
fn write_response(
    mut respond: SendResponse<Payload>,
    response: http::Response<Body>,
) -> impl std::future::Future<Output = Result<(), h2::Error>> {
    let (parts, mut body) = response.into_parts();
    let end = body.is_end_stream();
    let mut sent = respond.send_response(http::Response::from_parts(parts, ()), end);
    drop(respond);
    async move {
        // Used in place: a value moved out of what the future captured
        // would be room in it twice.
        let send = match &mut sent {
            Ok(send) => send,
            Err(_) => return sent.map(drop),
        };
        if end {
            return Ok(());
        }
        send_body(send, &mut body).await
    }
}

/// The body of [`write_response`], once its headers went.
async fn send_body(send: &mut SendStream<Payload>, body: &mut Body) -> Result<(), h2::Error> {
    loop {
        // Backpressure: wait until what was sent has been given window
        // before taking more from the body.
        poll_fn(|cx| poll_window(send, cx)).await?;
        let mut data = Gathered::default();
        let ready = poll_fn(|cx| {
            if let Poll::Ready(reset) = send.poll_reset(cx) {
                return Poll::Ready(Err(reset.map_or_else(|e| e, h2::Error::from)));
            }
            while data.remaining() < GATHER_LIMIT {
                match std::pin::Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Pending if data.is_empty() => return Poll::Pending,
                    Poll::Pending => break,
                    Poll::Ready(None) => return Poll::Ready(Ok(Ready::End(None))),
                    Poll::Ready(Some(Err(status))) => return Poll::Ready(Ok(Ready::Failed(status))),
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(part) => data.push(part),
                        Err(frame) => return Poll::Ready(Ok(Ready::End(frame.into_trailers().ok()))),
                    },
                }
            }
            Poll::Ready(Ok(Ready::More))
        })
        .await?;
        match ready {
            Ready::More => send.send_data(Payload::Parts(data), false)?,
            Ready::End(None) => return send.send_data(Payload::Parts(data), true),
            Ready::End(Some(trailers)) => {
                if !data.is_empty() {
                    send.send_data(Payload::Parts(data), false)?;
                }
                return send.send_trailers(trailers);
            }
            Ready::Failed(status) => {
                tracing::debug!(error = %status, "a response body failed; resetting the stream");
                send.send_reset(Reason::INTERNAL_ERROR);
                return Ok(());
            }
        }
    }
}

/// A request body read from h2, releasing flow-control window as the service
/// consumes it: a service that stops reading stops the peer at one window.
///
/// h2 is asked for a frame only when it may have one: once it had nothing
/// more (its reading side still open), its next wake is what says so. A
/// stream's task is polled for many other reasons (a version, its own
/// writes), and each poll of its requests was a lock of the connection's
/// streams, a lookup of the stream and its waker stored again: 4.6 polls of
/// h2 a response in eds's update phase for 1.5 frames, about 700
/// instructions of the response's ~28,000 (BENCHMARKS, session 38).
pub struct RecvBody {
    stream: RecvStream,
    /// What the waker h2 holds for this body's reader sets and wakes. The
    /// waker itself is made from it for each poll of h2 (a reference count
    /// taken and let go), not kept: 16 bytes less in every stream's body.
    signal: Option<Arc<RecvSignal>>,
}

impl RecvBody {
    fn new(stream: RecvStream) -> Self {
        RecvBody { stream, signal: None }
    }
}

/// A stream's request body in the request's extensions, for a service that
/// reads its requests itself: taken (at most once) and read as it is, not
/// through the router's layers, which wrap it twice (a box and a dynamic
/// call each, a poll, and each box a line of memory that every poll of a
/// stream's requests read: about 150 instructions and 20 first-level
/// instruction misses a response in eds, BENCHMARKS, session 43). The
/// request's own body reads it until it is taken, and nothing after: a
/// service reads one or the other.
///
/// [`SlotBody`] lets go of it when the request's own body is dropped
/// untaken, so a service that drops the body drops the stream's reading
/// side as before (its buffered data and its window go back to h2), even
/// while it keeps the request's extensions.
pub type RequestSlot = TakeOnce<RecvBody>;

/// What the listener puts in a request's extensions (which need `Clone`)
/// for the service to take at most once: the stream's response
/// ([`ResponseSlot`]) and its request body ([`RequestSlot`]).
pub struct TakeOnce<T>(Arc<std::sync::Mutex<Option<T>>>);

// Not derived: a clone shares the one value, whatever `T` is.
impl<T> Clone for TakeOnce<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> TakeOnce<T> {
    pub(super) fn new(value: T) -> Self {
        Self(Arc::new(std::sync::Mutex::new(Some(value))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<T>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The value, for the service to use itself; `None` once taken.
    pub fn take(&self) -> Option<T> {
        self.lock().take()
    }
}

/// The request's body as the router hands it on: the slot's, while it is
/// there.
struct SlotBody(RequestSlot);

impl Drop for SlotBody {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

impl http_body::Body for SlotBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match &mut *self.0.lock() {
            Some(body) => std::pin::Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.lock().as_ref().is_none_or(RecvBody::is_end_stream)
    }
}

/// What h2 wakes a [`RecvBody`]'s reader through: a flag that a frame (or
/// the stream's end) may be there, then the reader's task.
struct RecvSignal {
    /// Set by h2's wake; cleared by the reader before it asks h2 again.
    may_have: std::sync::atomic::AtomicBool,
    /// The task reading the body (its waker, as it was when registered).
    task: std::task::Waker,
}

impl std::task::Wake for RecvSignal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Set before the task is woken: its poll reads it.
        self.may_have.store(true, std::sync::atomic::Ordering::Release);
        self.task.wake_by_ref();
    }
}

fn stream_error(e: h2::Error) -> Status {
    Status::cancelled(format!("the request stream failed: {e}"))
}

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        use std::sync::atomic::Ordering;
        let this = &mut *self;
        // The signal h2 holds for this task, or a new one for a task that
        // reads the body first (h2 is asked then, whatever it held).
        let signal = match &this.signal {
            Some(signal) if signal.task.will_wake(cx.waker()) => {
                // h2 had nothing more and has not woken it since: it has
                // nothing yet.
                if !signal.may_have.swap(false, Ordering::AcqRel) {
                    return Poll::Pending;
                }
                signal
            }
            _ => this.signal.insert(Arc::new(RecvSignal {
                may_have: std::sync::atomic::AtomicBool::new(false),
                task: cx.waker().clone(),
            })),
        };
        let waker = std::task::Waker::from(signal.clone());
        let mut h2_cx = Context::from_waker(&waker);
        let stream = &mut this.stream;
        // A poll that is not `Pending` and has no more to give leaves h2
        // holding the signal (`poll_data_released`'s `false`); every other
        // outcome is polled again, next time, as before.
        let polled = stream.poll_data_released(&mut h2_cx);
        if !matches!(polled, Poll::Pending | Poll::Ready(Some(Ok((_, false))))) {
            signal.may_have.store(true, Ordering::Release);
        }
        match ready!(polled) {
            Some(Ok((data, _))) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Some(Err(e)) => Poll::Ready(Some(Err(stream_error(e)))),
            None => match ready!(stream.poll_trailers(&mut h2_cx)) {
                Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                Ok(None) => Poll::Ready(None),
                Err(e) => Poll::Ready(Some(Err(stream_error(e)))),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::super::respond::tests::{within, Counted};
    use super::*;

    #[test]
    fn goaway_frames_are_settings_then_goaway_with_the_reason() {
        let bytes = goaway_frames(Reason::REFUSED_STREAM, b"full");
        assert_eq!(&bytes[..9], &[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
        assert_eq!(&bytes[9..18], &[0, 0, 12, 0x7, 0, 0, 0, 0, 0]);
        assert_eq!(&bytes[22..26], &7u32.to_be_bytes());
        assert_eq!(&bytes[26..], b"full");
    }

    #[test]
    fn the_age_jitter_stays_within_ten_percent() {
        for _ in 0..100 {
            let age = jittered(Duration::from_secs(100)).as_secs_f64();
            assert!((90.0..=110.0).contains(&age), "{age}");
        }
    }

    /// The next frame of `body`, read by this task.
    async fn next_frame(body: &mut RecvBody) -> Option<Result<Frame<Bytes>, Status>> {
        within("a frame", poll_fn(|cx| std::pin::Pin::new(&mut *body).poll_frame(cx))).await
    }

    /// Whether the body's reader waits for h2's wake before it asks again.
    fn waits_for_h2(body: &RecvBody) -> bool {
        let signal = body.signal.as_ref().expect("polled");
        !signal.may_have.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Two h2 streams of one connection, as the server reads them (each
    /// request's body and its response handle) and as the client writes
    /// them, and the client's pings (a pong comes once the server took in
    /// every frame sent before the ping).
    async fn streams(
        n: usize,
    ) -> (
        Vec<(RecvStream, SendResponse<Bytes>)>,
        Vec<h2::SendStream<Bytes>>,
        h2::PingPong,
    ) {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let serving = tokio::spawn(async move {
            let mut connection = h2::server::handshake(server_io).await.expect("a handshake");
            let mut accepted = Vec::new();
            for _ in 0..n {
                let (request, respond) = connection.accept().await.expect("a stream").expect("no error");
                accepted.push((request.into_body(), respond));
            }
            // The connection is driven while the test reads.
            tokio::spawn(async move { while connection.accept().await.is_some() {} });
            accepted
        });
        let (mut client, mut connection) = within("a handshake", h2::client::handshake(client_io))
            .await
            .expect("a handshake");
        let ping_pong = connection.ping_pong().expect("a ping");
        tokio::spawn(connection);
        let mut sends = Vec::new();
        for _ in 0..n {
            let request = http::Request::post("http://gateway/x").body(()).unwrap();
            let (_response, send) = client.send_request(request, false).expect("a stream");
            sends.push(send);
            client = within("room for a stream", client.ready()).await.expect("ready");
        }
        let accepted = within("the streams", serving).await.expect("served");
        (accepted, sends, ping_pong)
    }

    /// A request body asks h2 for a frame only when h2 may have one: once a
    /// poll took what h2 held (its reading side still open), the reader
    /// waits for h2's wake. Every frame still comes, in order: several
    /// buffered at once, one at a time, more than a window's worth (the
    /// window each frame frees goes back to the client), the end after
    /// data; and a reset reaches the reader as an error.
    #[tokio::test]
    async fn a_request_body_asks_h2_only_after_its_wake_and_reads_every_frame() {
        let (mut accepted, mut sends, mut ping_pong) = streams(2).await;
        let (reset_recv, _reset_respond) = accepted.pop().expect("two");
        let (recv, _respond) = accepted.pop().expect("two");
        let mut reset_send = sends.pop().expect("two");
        let mut send = sends.pop().expect("two");
        let mut body = RecvBody::new(recv);
        let reader = Arc::new(Counted::default());
        let waker = std::task::Waker::from(reader.clone());
        let mut cx = Context::from_waker(&waker);
        let woken = |reader: &Counted| reader.wakes.load(std::sync::atomic::Ordering::SeqCst);

        // Nothing yet: the reader waits for h2.
        assert!(std::pin::Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        assert!(waits_for_h2(&body));

        // Three frames taken in together: one wake, then each read in turn,
        // h2 asked again after each while it has more.
        for n in 1..=3u8 {
            send.send_data(Bytes::from(vec![n; 1000]), false).expect("sent");
        }
        within("a pong", ping_pong.ping(h2::Ping::opaque()))
            .await
            .expect("a pong");
        assert!(woken(&reader) >= 1, "woken by the first frame");
        for n in 1..=3u8 {
            let Poll::Ready(Some(Ok(frame))) = std::pin::Pin::new(&mut body).poll_frame(&mut cx) else {
                panic!("frame {n} buffered");
            };
            assert_eq!(frame.into_data().expect("data"), vec![n; 1000]);
            assert_eq!(waits_for_h2(&body), n == 3, "after frame {n}");
        }
        assert!(std::pin::Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        let before = woken(&reader);
        send.send_data(Bytes::from(vec![4u8; 10]), false).expect("sent");
        within("a pong", ping_pong.ping(h2::Ping::opaque()))
            .await
            .expect("a pong");
        assert_eq!(woken(&reader), before + 1, "woken by the next frame");
        assert!(!waits_for_h2(&body));
        let Poll::Ready(Some(Ok(frame))) = std::pin::Pin::new(&mut body).poll_frame(&mut cx) else {
            panic!("the fourth frame");
        };
        assert_eq!(frame.into_data().expect("data"), vec![4u8; 10]);
        assert!(waits_for_h2(&body));

        // Read by this test's task (a new reader): four windows' worth in
        // frames of 16 KiB, which the client sends only as each frame read
        // frees its window, then the end.
        let total = 4 * 65_535;
        let sending = tokio::spawn(async move {
            let mut left = total;
            while left > 0 {
                let n = left.min(16 * 1024);
                send.send_data(Bytes::from(vec![5u8; n]), false).expect("sent");
                left -= n;
            }
            send.send_data(Bytes::new(), true).expect("the end sent");
            send
        });
        let mut read = 0;
        loop {
            match next_frame(&mut body).await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        assert!(data.iter().all(|&b| b == 5));
                        read += data.len();
                    }
                }
                None => break,
                Some(Err(status)) => panic!("{status:?}"),
            }
        }
        assert_eq!(read, total);
        let _send = within("the sender", sending).await.expect("sent");

        // A reset after a frame: the frame, then an error.
        let mut body = RecvBody::new(reset_recv);
        reset_send.send_data(Bytes::from_static(b"last"), false).expect("sent");
        within("a pong", ping_pong.ping(h2::Ping::opaque()))
            .await
            .expect("a pong");
        reset_send.send_reset(Reason::CANCEL);
        let mut frames = 0;
        loop {
            match next_frame(&mut body).await {
                Some(Ok(_)) => frames += 1,
                Some(Err(_)) => break,
                None => panic!("a reset is an error, not the end"),
            }
        }
        assert!(frames <= 1);
    }

    /// A request's body in its slot: the request's own body (as a router
    /// hands it on) reads it while it is there; once a service takes it,
    /// the service reads the rest as h2 gives it, and the request's own
    /// body has nothing more (it ends, it does not hang). Dropped untaken,
    /// the request's own body takes the slot's with it.
    #[tokio::test]
    async fn a_request_body_is_read_through_its_slot_until_a_service_takes_it() {
        let (mut accepted, mut sends, mut ping_pong) = streams(2).await;
        let (dropped_recv, _dropped_respond) = accepted.pop().expect("two");
        let (recv, _respond) = accepted.pop().expect("two");
        let _dropped_send = sends.pop().expect("two");
        let mut send = sends.pop().expect("two");
        let dropped = RequestSlot::new(RecvBody::new(dropped_recv));
        drop(Body::new(SlotBody(dropped.clone())));
        assert!(dropped.take().is_none(), "let go with the request's own body");

        let slot = RequestSlot::new(RecvBody::new(recv));
        let mut routed = Body::new(SlotBody(slot.clone()));
        send.send_data(Bytes::from_static(b"first"), false).expect("sent");
        within("a pong", ping_pong.ping(h2::Ping::opaque()))
            .await
            .expect("a pong");
        let first = within("a frame", poll_fn(|cx| std::pin::Pin::new(&mut routed).poll_frame(cx))).await;
        let first = first.expect("a frame").expect("data").into_data().expect("data");
        assert_eq!(first, Bytes::from_static(b"first"));

        let mut direct = slot.take().expect("in the slot");
        assert!(slot.take().is_none(), "taken once");
        send.send_data(Bytes::from_static(b"second"), true).expect("sent");
        let second = next_frame(&mut direct).await.expect("a frame").expect("data");
        assert_eq!(second.into_data().expect("data"), Bytes::from_static(b"second"));
        assert!(next_frame(&mut direct).await.is_none(), "the end, read directly");
        let after = within(
            "the routed body",
            poll_fn(|cx| std::pin::Pin::new(&mut routed).poll_frame(cx)),
        )
        .await;
        assert!(after.is_none(), "the routed body ends once the body is taken");
    }
}
