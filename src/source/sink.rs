//! Dial-out mode (`--sink-listen`): Galley connects to the gateway's
//! `ResourceSink` and pushes. The stream runs the same sink protocol as client
//! mode (`stream::run`); only who dialled differs. One source at a time: a
//! second concurrent stream is refused with `RESOURCE_EXHAUSTED`, and learns
//! nothing about the connected one. Who may dial (mTLS, `--sink-allow`) and
//! how a frozen source is dropped (keepalive pings) is the transport's job.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::SystemTime;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::http::{self, header, HeaderMap, HeaderValue};
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;

use super::overdue::expire_overdue;
use super::stream::{self, StreamEnd};
use super::{SinkContext, UpstreamStatus};
use crate::cache::CacheWriter;
use crate::metrics as m;
use crate::proto::SinkNode;
use crate::transport::call;
use crate::transport::requests::{RequestBody, RequestBudget, RequestStream};

/// `ResourceSink.EstablishResourceStream`, what Galley calls.
pub const RESOURCE_SINK_PATH: &str = "/istio.mcp.v1alpha1.ResourceSink/EstablishResourceStream";

/// Everything dial-out mode needs, decided at start-up.
#[derive(Clone, Debug)]
pub struct SinkSettings {
    pub listen: SocketAddr,
    pub node: SinkNode,
    pub incremental: bool,
    pub max_message_bytes: usize,
    /// The identities allowed to dial (`--sink-allow`).
    pub allow: Option<crate::transport::identity::AllowList>,
    /// `--sink-insecure`: sources are not authenticated.
    pub insecure: bool,
}

/// The source currently connected.
#[derive(Clone, Debug)]
struct ActiveSource {
    peer: String,
    since: SystemTime,
}

/// The one source slot: the cache's writer while no source holds it, the
/// connected source while one does.
#[derive(Debug)]
enum Slot {
    Free(CacheWriter),
    Taken(ActiveSource),
}

struct Inner {
    settings: SinkSettings,
    sink: SinkContext,
    status: watch::Sender<UpstreamStatus>,
    shutdown: CancellationToken,
    tasks: tokio_util::task::TaskTracker,
    // Never held across an await.
    slot: Mutex<Slot>,
}

/// The `ResourceSink` service Galley dials.
#[derive(Clone)]
pub struct SinkServer {
    inner: Arc<Inner>,
}

/// The one source slot, taken: the writer, handed back when the stream
/// ends, however it ends.
struct Claimed {
    inner: Arc<Inner>,
    writer: Option<CacheWriter>,
}

impl Claimed {
    fn writer(&mut self) -> &mut CacheWriter {
        self.writer.as_mut().expect("held until dropped")
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            *self.inner.slot.lock().unwrap_or_else(|e| e.into_inner()) = Slot::Free(writer);
        }
    }
}

impl SinkServer {
    pub fn new(
        settings: SinkSettings,
        mut sink: SinkContext,
        status: watch::Sender<UpstreamStatus>,
        writer: CacheWriter,
        shutdown: CancellationToken,
        tasks: tokio_util::task::TaskTracker,
    ) -> Self {
        // Galley is the upstream: there is no gateway upstream of this one.
        let mut writer = writer;
        writer.set_upstream_chain(Vec::new());
        sink.node
            .annotations
            .remove(crate::cache::provenance::GATEWAY_ID_ANNOTATION);
        // Collections only clients asked for are never asked of a dial-out
        // source (see `DemandRoute::Hold`): they become overdue, and xDS
        // clients are answered empty.
        tasks.spawn(expire_overdue(
            sink.subscriptions.clone(),
            writer.cache().clone(),
            status.subscribe(),
            format!("dial-out on {}", settings.listen),
            shutdown.clone(),
        ));
        status.send_modify(|s| {
            s.mode = "sink";
            s.address = settings.listen.to_string();
            s.since = Some(SystemTime::now());
        });
        Self {
            inner: Arc::new(Inner {
                settings,
                sink,
                status,
                shutdown,
                tasks,
                slot: Mutex::new(Slot::Free(writer)),
            }),
        }
    }

    /// Takes the one source slot. The refusal names no address and no time:
    /// a refused peer learns nothing about the source that is connected.
    fn claim(&self, peer: &str) -> Result<Claimed, (Status, ActiveSource)> {
        let mut slot = self.inner.slot.lock().unwrap_or_else(|e| e.into_inner());
        let taken = Slot::Taken(ActiveSource {
            peer: peer.to_owned(),
            since: SystemTime::now(),
        });
        match std::mem::replace(&mut *slot, taken) {
            Slot::Free(writer) => Ok(Claimed {
                inner: self.inner.clone(),
                writer: Some(writer),
            }),
            Slot::Taken(connected) => {
                *slot = Slot::Taken(connected.clone());
                metrics::counter!(m::SINK_REFUSALS, "reason" => "another_source").increment(1);
                let status = Status::resource_exhausted(
                    "another source is connected; this gateway takes config from one source at a time",
                );
                Err((status, connected))
            }
        }
    }
}

/// The gRPC service. The source's messages are read by the gateway's own
/// reader, each large one into a buffer of its size freed once it is
/// applied, up to `--max-message-bytes`.
impl NamedService for SinkServer {
    const NAME: &'static str = "istio.mcp.v1alpha1.ResourceSink";
}

impl tonic::codegen::Service<http::Request<Body>> for SinkServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let response = if let Some(status) = call::compressed(&request) {
            Err(status)
        } else if request.uri().path() != RESOURCE_SINK_PATH {
            Err(call::not_a_method(&request, Self::NAME))
        } else {
            self.establish_resource_stream(request)
        };
        std::future::ready(Ok(response.unwrap_or_else(Status::into_http)))
    }
}

impl SinkServer {
    fn establish_resource_stream(&self, request: http::Request<Body>) -> Result<http::Response<Body>, Status> {
        let peer = request
            .extensions()
            .get::<TcpConnectInfo>()
            .and_then(TcpConnectInfo::remote_addr)
            .map_or_else(|| "unknown".to_owned(), |a| a.to_string());
        let mut claimed = match self.claim(&peer) {
            Ok(claimed) => claimed,
            Err((status, connected)) => {
                static LOGS: crate::transport::LogLimiter = crate::transport::LogLimiter::new();
                if let Some(skipped) = LOGS.allow() {
                    tracing::warn!(
                        %peer,
                        connected = %connected.peer,
                        since = %humantime::format_rfc3339_seconds(connected.since),
                        skipped,
                        "refused a second source: another source is connected"
                    );
                }
                return Err(status);
            }
        };
        let (parts, body) = RequestBody::of(request);
        let metadata = source_metadata(&parts.headers);
        let budget = RequestBudget::for_source(self.inner.settings.max_message_bytes, false);
        let mut inbound = RequestStream::new(body, budget, "Resources");
        let inner = self.inner.clone();
        let (mut opened, rx) = inner.sink.open(claimed.writer());
        let announced: Vec<String> = metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
        tracing::info!(%peer, metadata = announced.join(","), "a source connected (dial-out)");
        inner.status.send_modify(|s| {
            // A dial-out stream is an attempt that succeeded.
            metrics::counter!(m::UPSTREAM_CONNECT_ATTEMPTS).increment(1);
            if s.connections > 0 {
                metrics::counter!(m::RECONNECTIONS, "component" => m::COMPONENT_UPSTREAM).increment(1);
            }
            s.connections += 1;
            s.attempts += 1;
            s.connected = true;
            s.since = Some(SystemTime::now());
            s.peer = Some(peer.clone());
            s.source_metadata = metadata;
        });

        self.inner.tasks.spawn(async move {
            let writer = claimed.writer();
            let mut progress = false;
            let end = match opened
                .accept_trigger(writer, &mut inbound, &inner.shutdown, stream::TRIGGER_WAIT)
                .await
            {
                Ok(()) => opened.run(writer, &mut inbound, &inner.shutdown, &mut progress).await,
                Err(end) => end,
            };
            end.count();
            let reason = end.reason();
            let message = match end {
                StreamEnd::Shutdown => "the gateway is shutting down".to_owned(),
                StreamEnd::Refused { message, .. } | StreamEnd::Failed { message, .. } => message,
            };
            tracing::warn!(%peer, %reason, %message, "the source's stream ended; serving the cached config");
            inner.status.send_modify(|s| {
                s.connected = false;
                s.since = Some(SystemTime::now());
                s.last_error = Some(message);
            });
        });
        let mut response = http::Response::new(call::messages_body(rx));
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        Ok(response)
    }
}

/// The source's gRPC metadata: Galley's `--sinkMeta` pairs and
/// `config.source.version`, without the transport's own headers, as the log
/// and `/debug/upstream` show them: a credential's value (`authorization`,
/// a token) redacted, and a key written as one (`ghp_…`, a 40-digit hex
/// token: a `--sinkMeta` pair mistyped) too, each such key numbered
/// (`[redacted]`, `[redacted 2]`, …) so none hides another.
fn source_metadata(headers: &HeaderMap) -> BTreeMap<String, String> {
    use crate::transport::safe_text::{credential_shown, key_shown, REDACTED};
    let mut hidden = 0;
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            !matches!(name, "content-type" | "te" | "user-agent") && !name.starts_with("grpc-")
        })
        .filter_map(|(name, value)| {
            let name = name.as_str();
            let value = value.to_str().ok()?;
            if key_shown(name) == REDACTED {
                hidden += 1;
                let key = if hidden == 1 {
                    REDACTED.to_owned()
                } else {
                    format!("[redacted {hidden}]")
                };
                return Some((key, REDACTED.to_owned()));
            }
            Some((name.to_owned(), credential_shown(name, value).to_owned()))
        })
        .collect()
}
