//! Dials a gRPC server (the upstream source, or a gateway for the `client`
//! command): TCP, TLS when the URL is `https://`, and the HTTP/2 handshake,
//! all under one deadline (`--connect-timeout`). A server counts as
//! connected only once its HTTP/2 SETTINGS frame has arrived: a port that
//! accepts TCP and never speaks HTTP/2 is a failed attempt whose error says
//! which step timed out.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio_util::either::Either;

use tokio::net::TcpStream;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};

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
}

/// A dialled connection: plain (`Left`) or TLS (`Right`).
type ClientConn = Either<TcpStream, Box<tokio_rustls::client::TlsStream<TcpStream>>>;

type Io = TokioIo<Sniffed<ClientConn>>;

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

/// Connects, or says which step failed or timed out.
pub async fn connect(dial: &Dial) -> Result<Channel, ConnectError> {
    let address = &dial.address;
    let uri: Uri = address
        .parse()
        .map_err(|e| failed("address", format!("{address} is not a URL: {e}")))?;
    let https = uri.scheme_str() == Some("https");
    let host = uri
        .host()
        .ok_or_else(|| failed("address", format!("{address} has no host")))?
        .to_owned();
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let deadline = Instant::now() + dial.timeout;
    let timeout = humantime::format_duration(dial.timeout);

    let dns_host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let addresses: Vec<std::net::SocketAddr> =
        match tokio::time::timeout_at(deadline, tokio::net::lookup_host((dns_host.as_str(), port))).await {
            Ok(Ok(addresses)) => addresses.collect(),
            Ok(Err(e)) => return Err(failed("dns", format!("cannot resolve {host}: {e}"))),
            Err(_) => {
                return Err(failed(
                    "dns",
                    format!("resolving {host} timed out after {timeout} (--connect-timeout)"),
                ))
            }
        };
    let tcp = match tokio::time::timeout_at(deadline, TcpStream::connect(&addresses[..])).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return Err(failed("tcp", format!("cannot connect to {host}:{port}: {e}"))),
        Err(_) => {
            return Err(failed(
                "tcp",
                format!("TCP connect to {host}:{port} timed out after {timeout} (--connect-timeout)"),
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
        match tokio::time::timeout_at(deadline, connector.connect(name, tcp)).await {
            Ok(Ok(tls)) => Either::Right(Box::new(tls)),
            Ok(Err(e)) => return Err(failed("tls", format!("TLS handshake with {host}:{port} failed: {e}"))),
            Err(_) => {
                return Err(failed(
                    "tls",
                    format!("TLS handshake with {host}:{port} timed out after {timeout} (--connect-timeout)"),
                ))
            }
        }
    } else {
        Either::Left(tcp)
    };
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
        format!("HTTP/2 handshake with {host}:{port} timed out after {timeout} (--connect-timeout): the server accepted the connection but sent no HTTP/2 SETTINGS; is this a gRPC port?")
    };
    let channel = match tokio::time::timeout_at(deadline, endpoint.connect_with_connector(io)).await {
        Ok(Ok(channel)) => channel,
        Ok(Err(e)) => {
            return Err(failed(
                "http2",
                format!("HTTP/2 handshake with {host}:{port} failed: {}", error_chain(&e)),
            ))
        }
        Err(_) => return Err(failed("http2", http2_timeout())),
    };
    match tokio::time::timeout_at(deadline, signals.handshake()).await {
        Ok(Ok(())) => Ok(channel),
        Ok(Err(reason)) => Err(failed(
            "http2",
            format!("HTTP/2 handshake with {host}:{port} failed: {reason}"),
        )),
        Err(_) => Err(failed("http2", http2_timeout())),
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
