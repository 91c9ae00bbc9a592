//! Dials a gRPC server (the upstream source, or a gateway for the `client`
//! command): TCP, TLS when the URL is `https://`, and the HTTP/2 handshake,
//! all under one deadline (`--connect-timeout`). A server counts as
//! connected only once its HTTP/2 SETTINGS frame has arrived: a port that
//! accepts TCP and never speaks HTTP/2 is a failed attempt whose error says
//! which step timed out. A connection that ends before the SETTINGS says
//! why in an operator's words (`dial_why`): the TLS alert the server sent,
//! the local reason its certificate was refused, a TLS port dialled in
//! plaintext or the other way round.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio_util::either::Either;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};

use super::dial_why::{self, Caller};
use super::sniff::{Side, Sniffed};
use super::tls::ClientTlsFiles;

/// Why a connection attempt failed, and at which step.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ConnectError {
    /// `address`, `dns`, `tcp`, `tls` or `http2`.
    pub step: &'static str,
    pub message: String,
}

fn failed(step: &'static str, message: String) -> ConnectError {
    ConnectError { step, message }
}

/// How to dial.
#[derive(Clone, Debug)]
pub struct Dial {
    /// `http://host:port` or `https://host:port`.
    pub address: String,
    /// Required for `https://`.
    pub tls: Option<ClientTlsFiles>,
    pub timeout: Duration,
    /// HTTP/2 keepalive pings (`None`: off).
    pub keepalive: Option<Duration>,
    /// Who dials: the flags errors name.
    pub caller: Caller,
}

/// A dialled connection: plain (`Left`) or TLS (`Right`).
type ClientConn = Either<TcpStream, Box<tokio_rustls::client::TlsStream<Watched<TcpStream>>>>;

type Io = TokioIo<Sniffed<Watched<ClientConn>>>;

/// How many of the server's first bytes a dial keeps, to say what it speaks.
const FIRST_BYTES: usize = 16;

/// What a dial saw of the server before its HTTP/2 SETTINGS.
#[derive(Debug, Default)]
struct Seen {
    /// The first bytes on the wire (TLS records, or HTTP/2 in plaintext).
    wire: Vec<u8>,
    /// The first bytes above TLS (the wire's in plaintext).
    app: Vec<u8>,
    /// The first read or write error above TLS (a TLS alert is one).
    error: Option<dial_why::Failure>,
    /// The server ended the stream.
    closed: bool,
}

/// Shared by a connection's watchers and the dial waiting on them.
#[derive(Debug, Default)]
struct Trace {
    seen: Mutex<Seen>,
    ended: AtomicBool,
    notify: Notify,
}

impl Trace {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn end(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            self.notify.notify_waiters();
        }
    }

    /// Resolves once the connection ended, failed, or showed it is not
    /// HTTP/2 (its first frame not SETTINGS).
    async fn ended(&self) {
        loop {
            let notified = self.notify.notified();
            if self.ended.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Why the connection ended before the server's SETTINGS.
    fn why(&self, tls: Option<&ClientTlsFiles>, caller: Caller) -> String {
        let seen = self.seen();
        dial_why::ended_before_settings(tls, &seen.app, seen.error.as_ref(), seen.closed, caller)
    }
}

/// Which bytes a watcher sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layer {
    /// The wire under TLS: its first bytes only.
    Wire,
    /// What HTTP/2 reads (above TLS, or the wire in plaintext): its first
    /// bytes, its errors, its end.
    App { plaintext: bool },
}

/// An I/O object that tells the dial what the server sent first and how
/// the connection ended, the error whole (a TLS alert stays a
/// `rustls::Error`), so that a failure before HTTP/2 began can be
/// explained. Past the first bytes it only passes reads and writes on.
#[derive(Debug)]
struct Watched<T> {
    io: T,
    trace: Arc<Trace>,
    layer: Layer,
    /// Still keeping the first bytes.
    keeping: bool,
    /// Bytes read ahead of HTTP/2 (see [`read_ahead`]), handed to it first.
    ahead: Vec<u8>,
}

impl<T> Watched<T> {
    fn new(io: T, trace: Arc<Trace>, layer: Layer) -> Self {
        Self {
            io,
            trace,
            layer,
            keeping: true,
            ahead: Vec::new(),
        }
    }

    fn failed(&self, error: &io::Error) {
        if let Layer::App { .. } = self.layer {
            let mut seen = self.trace.seen();
            if seen.error.is_none() {
                seen.error = Some(dial_why::Failure::of(error));
            }
            drop(seen);
            self.trace.end();
        }
    }

    /// Records what a read above TLS (or in plaintext) returned.
    fn saw(&mut self, read: &[u8], room: bool) {
        let Layer::App { plaintext } = self.layer else {
            if self.keeping {
                let mut seen = self.trace.seen();
                self.keeping = !keep(&mut seen.wire, read);
            }
            return;
        };
        if read.is_empty() && room {
            self.trace.seen().closed = true;
            self.trace.end();
        } else if self.keeping {
            let mut seen = self.trace.seen();
            if plaintext {
                keep(&mut seen.wire, read);
            }
            self.keeping = !keep(&mut seen.app, read);
            // HTTP/2's first frame is the server's SETTINGS.
            if seen.app.len() >= 9 && seen.app[3] != 0x4 {
                drop(seen);
                self.trace.end();
            }
        }
    }
}

/// Keeps the first of `read` in `kept`: whether it is full.
fn keep(kept: &mut Vec<u8>, read: &[u8]) -> bool {
    let n = (FIRST_BYTES - kept.len()).min(read.len());
    kept.extend_from_slice(&read[..n]);
    kept.len() == FIRST_BYTES
}

impl<T: AsyncRead + Unpin> Watched<T> {
    /// A write failed (the server closed): what it sent before closing
    /// (its TLS alert, in TLS 1.3 the refusal of the client certificate)
    /// is read first, so the write's error (a broken pipe) does not hide
    /// it. The connection is over: nothing read here was HTTP/2's to read.
    fn write_failed(&mut self, cx: &mut Context<'_>, error: &io::Error) {
        if self.layer == Layer::Wire {
            return;
        }
        let mut scratch = [0u8; 64];
        for _ in 0..4 {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) => {
                    let done = buf.filled().is_empty();
                    self.saw(buf.filled(), true);
                    if done {
                        break;
                    }
                }
                Poll::Ready(Err(e)) => {
                    self.failed(&e);
                    break;
                }
                Poll::Pending => break,
            }
        }
        self.failed(error);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.ahead.is_empty() {
            let n = this.ahead.len().min(buf.remaining());
            buf.put_slice(&this.ahead[..n]);
            this.ahead.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        match &result {
            Poll::Ready(Ok(())) if this.keeping || this.layer != Layer::Wire => {
                this.saw(&buf.filled()[before..], room);
            }
            Poll::Ready(Err(e)) => this.failed(e),
            _ => {}
        }
        result
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Err(e)) = &result {
            this.write_failed(cx, e);
        }
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Err(e)) = &result {
            this.write_failed(cx, e);
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<T> Drop for Watched<T> {
    /// HTTP/2 gave the connection up (a protocol error on the server's
    /// first bytes, say): the dial stops waiting.
    fn drop(&mut self) {
        if let Layer::App { .. } = self.layer {
            self.trace.end();
        }
    }
}

/// How long a TLS dial waits for the server's first word before HTTP/2
/// writes its preface. In TLS 1.3 the server checks the client's
/// certificate after the client's side of the handshake is done and refuses
/// it with an alert; a client that writes meanwhile may have the server
/// close on unread data, and the reset that follows discards the alert
/// unread. A server that accepts speaks first (its HTTP/2 SETTINGS, which
/// the gateway, Galley and most gRPC servers send at once); one that waits
/// for the client's preface costs this much once per connection.
const FIRST_WORD_WAIT: Duration = Duration::from_millis(250);

/// Reads the server's first bytes before HTTP/2 writes anything (see
/// [`FIRST_WORD_WAIT`]); they are handed to HTTP/2 first. An alert or an
/// end is recorded by the watcher, and ends the trace.
async fn read_ahead(conn: &mut Watched<ClientConn>, until: Instant) {
    use tokio::io::AsyncReadExt;
    let mut first = vec![0u8; 16 * 1024];
    // Cancelling a read leaves what TLS decrypted buffered for the next.
    if let Ok(Ok(n)) = tokio::time::timeout_at(until, conn.read(&mut first)).await {
        first.truncate(n);
        conn.ahead = first;
    }
}

/// Hands tonic the one connection already established. A channel is used
/// for one stream; a second connect (tonic reconnecting by itself) fails, and
/// the caller dials again with its own backoff.
#[derive(Clone)]
struct Established(Arc<Mutex<Option<Io>>>);

impl tower::Service<Uri> for Established {
    type Response = Io;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Io, io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let io = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        Box::pin(async move {
            io.ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "the connection was closed; dial again"))
        })
    }
}

/// The host and the port (if one is written) of `uri`'s authority as
/// written: the URL parser reads `h:9901;x` as a port it cannot number,
/// which would dial the scheme's default port.
pub fn host_and_port(uri: &Uri) -> (&str, Option<&str>) {
    let authority = uri.authority().map_or("", |a| a.as_str());
    match authority.rfind(':') {
        Some(at) if !authority[at..].contains(']') => (&authority[..at], Some(&authority[at + 1..])),
        _ => (authority, None),
    }
}

/// Whether `port`, as written, is a port number (1 to 65535).
pub fn is_port(port: &str) -> bool {
    port.parse::<u16>().is_ok_and(|p| p != 0)
}

/// Connects, or says which step failed or timed out.
pub async fn connect(dial: &Dial) -> Result<Channel, ConnectError> {
    let address = &dial.address;
    let uri: Uri = address
        .parse()
        // Not quoted: what follows a host may be anything the logs should
        // not hold.
        .map_err(|e| failed("address", format!("the address is not a URL: {e}")))?;
    let https = uri.scheme_str() == Some("https");
    let host = uri
        .host()
        .ok_or_else(|| failed("address", "the address has no host".to_owned()))?
        .to_owned();
    if host_and_port(&uri).1.is_some_and(|p| !is_port(p)) {
        return Err(failed(
            "address",
            "the address's port is not a number from 1 to 65535".to_owned(),
        ));
    }
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let deadline = Instant::now() + dial.timeout;
    let timeout = humantime::format_duration(dial.timeout);
    let timeout_flag = dial.caller.timeout_flag();
    let trace = Arc::new(Trace::default());

    let dns_host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let addresses: Vec<std::net::SocketAddr> =
        match tokio::time::timeout_at(deadline, tokio::net::lookup_host((dns_host.as_str(), port))).await {
            Ok(Ok(addresses)) => addresses.collect(),
            Ok(Err(e)) => return Err(failed("dns", format!("cannot resolve {host}: {e}"))),
            Err(_) => {
                return Err(failed(
                    "dns",
                    format!("resolving {host} timed out after {timeout} ({timeout_flag})"),
                ))
            }
        };
    let tcp = match tokio::time::timeout_at(deadline, TcpStream::connect(&addresses[..])).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return Err(failed("tcp", format!("cannot connect to {host}:{port}: {e}"))),
        Err(_) => {
            return Err(failed(
                "tcp",
                format!("TCP connect to {host}:{port} timed out after {timeout} ({timeout_flag})"),
            ))
        }
    };
    let _ = tcp.set_nodelay(true);
    let conn = if https {
        let files = dial
            .tls
            .clone()
            .ok_or_else(|| failed("tls", format!("{address} is https:// but no TLS configuration is set")))?;
        let config = files.load().map_err(|e| failed("tls", e.to_string()))?;
        let name = files.server_name(&host).map_err(|e| failed("tls", e.to_string()))?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let wire = Watched::new(tcp, trace.clone(), Layer::Wire);
        match tokio::time::timeout_at(deadline, connector.connect(name, wire)).await {
            Ok(Ok(tls)) => Either::Right(Box::new(tls)),
            Ok(Err(e)) => {
                let why = dial_why::handshake_failed(&e, &trace.seen().wire, &files, dial.caller);
                return Err(failed("tls", format!("TLS handshake with {host}:{port} failed: {why}")));
            }
            Err(_) => {
                let answered = if trace.seen().wire.is_empty() {
                    ": the server accepted the connection but did not answer the TLS ClientHello; does it speak TLS?"
                } else {
                    ""
                };
                return Err(failed(
                    "tls",
                    format!("TLS handshake with {host}:{port} timed out after {timeout} ({timeout_flag}){answered}"),
                ));
            }
        }
    } else {
        Either::Left(tcp)
    };
    let tls = dial.tls.as_ref().filter(|_| https);
    // The TLS step's failures (a refused client certificate in TLS 1.3)
    // and a server that speaks something else show once the connection is
    // read: the trace ends with them, and says why.
    let refused = || {
        let step = if tls.is_some() && trace.seen().error.is_some() {
            "tls"
        } else {
            "http2"
        };
        let what = if step == "tls" {
            "TLS handshake"
        } else {
            "HTTP/2 handshake"
        };
        failed(
            step,
            format!("{what} with {host}:{port} failed: {}", trace.why(tls, dial.caller)),
        )
    };
    let mut conn = Watched::new(conn, trace.clone(), Layer::App { plaintext: !https });
    if https {
        read_ahead(&mut conn, deadline.min(Instant::now() + FIRST_WORD_WAIT)).await;
        if trace.ended.load(Ordering::Acquire) {
            return Err(refused());
        }
    }
    let (io, signals) = Sniffed::new(conn, Side::Client, None);
    let io = Established(Arc::new(Mutex::new(Some(TokioIo::new(io)))));
    // The scheme and authority tonic puts in requests; the connection
    // itself is the one above (TLS included).
    let mut endpoint = Endpoint::from_shared(format!("http://{host}:{port}"))
        .map_err(|e| failed("address", format!("{address}: {e}")))?;
    if let Some(interval) = dial.keepalive {
        endpoint = endpoint
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(crate::transport::grpc::keepalive_timeout(interval))
            .keep_alive_while_idle(false);
    }
    let http2_timeout = || {
        let accepted = if https {
            "the TLS handshake completed but the server sent no HTTP/2 SETTINGS; is this a gRPC port?"
        } else {
            "the server accepted the connection but sent no HTTP/2 SETTINGS; is this a gRPC port?"
        };
        failed(
            "http2",
            format!("HTTP/2 handshake with {host}:{port} timed out after {timeout} ({timeout_flag}): {accepted}"),
        )
    };
    let channel = tokio::select! {
        connected = tokio::time::timeout_at(deadline, endpoint.connect_with_connector(io)) => match connected {
            Ok(Ok(channel)) => channel,
            Ok(Err(_)) if trace.ended.load(Ordering::Acquire) => return Err(refused()),
            Ok(Err(e)) => {
                return Err(failed(
                    "http2",
                    format!("HTTP/2 handshake with {host}:{port} failed: {}", error_chain(&e)),
                ))
            }
            Err(_) => return Err(http2_timeout()),
        },
        _ = trace.ended() => return Err(refused()),
    };
    tokio::select! {
        settings = tokio::time::timeout_at(deadline, signals.handshake()) => match settings {
            Ok(Ok(())) => Ok(channel),
            Ok(Err(_)) => Err(refused()),
            Err(_) => Err(http2_timeout()),
        },
        _ = trace.ended() => {
            if signals.handshake_done() { Ok(channel) } else { Err(refused()) }
        }
    }
}

/// An error with its causes, `a: b: c`.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}
