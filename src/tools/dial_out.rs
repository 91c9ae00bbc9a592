//! `source --sink`: Galley's dial-out, served from this process's cache. It
//! dials a sink's `ResourceSink` (the gateway's `--sink-listen`, or any sink
//! Galley's `--sinkAddress` fed) and runs the source's side of MCP on that
//! stream: the sink's `RequestResources` arrive as the call's responses, and
//! the `Resources` go out as its requests. The stream is served by the same
//! engine as a `ResourceSource` client of a listener (per-collection nonces,
//! ACK and NACK, one response outstanding per collection, the request
//! limits); only who dialled differs. It opens with Galley's trigger and
//! reconnects with backoff that resets only once the sink ACKed a response.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use prost::Message;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::http::{self, HeaderMap};
use tonic::{Code, Status};
use tower::ServiceExt;

use crate::downstream::ResourceSourceService;
use crate::metrics as m;
use crate::proto::{RequestResources, Resources, RESOURCE_SOURCE_PATH};
use crate::source::backoff::{Backoff, BackoffPolicy};
use crate::source::session::TRIGGER_COLLECTION;
use crate::source::sink::RESOURCE_SINK_PATH;
use crate::transport::call;
use crate::transport::connect::{self, Dial};
use crate::transport::requests::{message_len, HEADER};

/// How long a stream may take to close at shutdown.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Everything the dial-out needs, decided at start-up.
#[derive(Clone, Debug)]
pub struct DialOutSettings {
    /// The sink: TCP, TLS (unless `--sink-insecure`) and HTTP/2, under
    /// `--connect-timeout`.
    pub dial: Dial,
    pub backoff: BackoffPolicy,
    /// Sent as the call's gRPC metadata (Galley's `--sinkMeta`).
    pub metadata: HeaderMap,
}

/// The dial-out: one stream to the sink at a time, for as long as the
/// process runs.
pub struct DialOut {
    settings: DialOutSettings,
    service: ResourceSourceService,
    /// The largest request the sink may send (`--max-request-bytes`, as on
    /// a listener): the most one stream holds of what the sink sent.
    max_request_bytes: usize,
}

/// How one stream to the sink ended.
#[derive(Debug)]
enum Ended {
    Shutdown,
    /// TCP, TLS or HTTP/2 failed, or the sink did not answer the call.
    Connect(String),
    /// The sink answered the call with an error: another source is
    /// connected, this source's identity is not allowed, not a sink.
    Refused(Status),
    /// The stream ran, and ended as `CallLog` says.
    Ran(CallLog),
}

impl Ended {
    /// The `reason` label of `mcp_gateway_dial_out_stream_ends_total`.
    fn reason(&self) -> &'static str {
        match self {
            Ended::Shutdown => "shutdown",
            Ended::Connect(_) => "connect",
            Ended::Refused(_) => "refused",
            Ended::Ran(log) => match &log.sink {
                Some(SinkEnd::Lost(_)) => "lost",
                Some(SinkEnd::Status(_) | SinkEnd::Closed) => "sink_ended",
                None => "source_ended",
            },
        }
    }

    const REASONS: [&'static str; 6] = ["shutdown", "connect", "refused", "lost", "sink_ended", "source_ended"];

    /// What went wrong, as the log and the operator read it.
    fn message(&self) -> String {
        match self {
            Ended::Shutdown => "shutting down".to_owned(),
            Ended::Connect(message) => message.clone(),
            Ended::Refused(status) => format!("the sink refused the stream: {}", status_text(status)),
            Ended::Ran(log) => {
                let sink = match &log.sink {
                    Some(SinkEnd::Status(status)) => format!("the sink ended the stream: {}", status_text(status)),
                    Some(SinkEnd::Closed) => "the sink closed the stream".to_owned(),
                    Some(SinkEnd::Lost(error)) => format!("the stream was lost: {error}"),
                    None => "this source ended the stream".to_owned(),
                };
                match &log.served {
                    Some(status) if status.code() != Code::Ok => format!("{sink} ({})", status_text(status)),
                    _ => sink,
                }
            }
        }
    }
}

/// A status as the log says it: an OK end (a sink that shut down
/// cleanly) with no message is "OK (no message)", not "Ok: ".
fn status_text(status: &Status) -> String {
    match status.message() {
        "" if status.code() == tonic::Code::Ok => "OK (the sink shut down cleanly)".to_owned(),
        "" => format!("{} (no message)", m::code_label(status.code() as i32)),
        message => format!("{}: {message}", m::code_label(status.code() as i32)),
    }
}

// === impl DialOut ===

impl DialOut {
    pub fn new(settings: DialOutSettings, service: ResourceSourceService, max_request_bytes: usize) -> Self {
        metrics::gauge!(m::DIAL_OUT_CONNECTED).set(0.0);
        metrics::counter!(m::DIAL_OUT_ATTEMPTS).absolute(0);
        for reason in Ended::REASONS {
            metrics::counter!(m::DIAL_OUT_STREAM_ENDS, "reason" => reason).absolute(0);
        }
        Self {
            settings,
            service,
            max_request_bytes,
        }
    }

    /// Runs until `shutdown`: one stream at a time, reconnecting with backoff
    /// that resets only after the sink ACKed a response (a sink that takes
    /// every stream and ends it at once gets a handful of attempts a minute,
    /// not a loop).
    pub async fn run(self, shutdown: CancellationToken) {
        let address = self.settings.dial.address.clone();
        if self.settings.dial.tls.is_none() {
            tracing::warn!(
                sink = %address,
                "--sink-insecure: the config goes to the sink in plaintext, readable on the way, to whoever answers \
                 at that address"
            );
        }
        let mut backoff = Backoff::new(self.settings.backoff);
        loop {
            metrics::counter!(m::DIAL_OUT_ATTEMPTS).increment(1);
            let ended = self.stream(&shutdown).await;
            metrics::gauge!(m::DIAL_OUT_CONNECTED).set(0.0);
            metrics::counter!(m::DIAL_OUT_STREAM_ENDS, "reason" => ended.reason()).increment(1);
            if matches!(ended, Ended::Shutdown) || shutdown.is_cancelled() {
                return;
            }
            if matches!(&ended, Ended::Ran(log) if log.acked) {
                backoff.reset();
            }
            let delay = backoff.next_delay();
            tracing::warn!(
                sink = %address,
                reason = ended.reason(),
                message = ?ended.message(),
                retry_in_seconds = delay.as_secs_f64(),
                "the stream to the sink ended; dialling again"
            );
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Dials the sink and serves one stream on it until it ends.
    async fn stream(&self, shutdown: &CancellationToken) -> Ended {
        let dial = &self.settings.dial;
        let channel = tokio::select! {
            connected = connect::connect(dial) => match connected {
                Ok(channel) => channel,
                Err(e) => return Ended::Connect(format!("{} failed: {}", e.step, e.message)),
            },
            _ = shutdown.cancelled() => return Ended::Shutdown,
        };
        let log = Arc::new(CallState::default());
        // The call's request body: the trigger, then the engine's responses
        // once the call is answered (a refused call starts no stream).
        let (served_tx, served) = oneshot::channel();
        let (ended_tx, mut ended) = oneshot::channel();
        let trigger = Resources {
            collection: TRIGGER_COLLECTION.to_owned(),
            ..Default::default()
        };
        let trigger = match call::framed(&trigger) {
            Ok(trigger) => trigger,
            Err(status) => return Ended::Refused(status),
        };
        let outbound = SourceResponses {
            trigger: Some(trigger),
            served: Served::Waiting(served),
            log: log.clone(),
            ended: Some(ended_tx),
        };
        let open = call::open_body(
            channel,
            RESOURCE_SINK_PATH,
            Body::new(outbound),
            self.settings.metadata.clone(),
        );
        let answer = tokio::select! {
            answer = tokio::time::timeout(dial.timeout, open) => answer,
            _ = shutdown.cancelled() => return Ended::Shutdown,
        };
        let answered = match answer {
            Ok(Ok(answered)) => answered,
            Ok(Err(status)) => return Ended::Refused(status),
            Err(_) => {
                return Ended::Connect(format!(
                    "the sink accepted the connection but did not answer the call within {} (--connect-timeout)",
                    humantime::format_duration(dial.timeout)
                ))
            }
        };
        if let Some(status) = answered.ended {
            // Answered with its status alone, and OK: over before it began.
            log.sink_ended(SinkEnd::Status(status));
            return Ended::Ran(log.take());
        }
        // The engine reads the sink's requests from the call's response body.
        let (leftover_tx, leftover) = oneshot::channel();
        let requests = SinkRequests {
            leftover: Some(leftover_tx),
            body: Some(answered.body),
            buf: BytesMut::new(),
            max_message_bytes: self.max_request_bytes,
            log: log.clone(),
        };
        // Only a stream already over (hyper dropped the request body) has
        // dropped the receiver: `ended` says so next.
        let _ = served_tx.send(self.serve(Body::new(requests)).await);
        metrics::gauge!(m::DIAL_OUT_CONNECTED).set(1.0);
        tracing::info!(sink = %dial.address, "connected to the sink; serving it the source directory");
        let end = tokio::select! {
            _ = &mut ended => Ended::Ran(log.take()),
            // The engine ends its streams at shutdown too.
            _ = shutdown.cancelled() => {
                let _ = tokio::time::timeout(CLOSE_WAIT, &mut ended).await;
                Ended::Shutdown
            }
        };
        close(leftover).await;
        end
    }

    /// Starts one `ResourceSource` stream of the engine reading `requests`;
    /// its gRPC-framed responses, ending with trailers.
    async fn serve(&self, requests: Body) -> Body {
        let mut request = http::Request::new(requests);
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = http::Uri::from_static(RESOURCE_SOURCE_PATH);
        match self.service.clone().oneshot(request).await {
            Ok(response) => response.into_body(),
            Err(never) => match never {},
        }
    }
}

/// Closes the stream as a client should once its requests ended: reads what
/// the sink still sends until it ends its side (its answer to the end of
/// ours), for at most `CLOSE_WAIT`, so the sink sees the stream closed, not
/// cancelled. The engine hands back the body it stopped reading.
async fn close(leftover: oneshot::Receiver<Body>) {
    let _ = tokio::time::timeout(CLOSE_WAIT, async {
        let Ok(mut body) = leftover.await else { return };
        while let Some(Ok(_)) = body.frame().await {}
    })
    .await;
}

/// What happened on one stream, as the call's two bodies saw it.
#[derive(Default)]
struct CallState(Mutex<CallLog>);

#[derive(Debug, Default)]
struct CallLog {
    /// How the sink's side ended, if it did first.
    sink: Option<SinkEnd>,
    /// The status the engine ended its side with.
    served: Option<Status>,
    /// The sink ACKed a response on this stream: progress.
    acked: bool,
    /// The sink's node id, from its first request.
    sink_node: Option<String>,
}

#[derive(Debug)]
enum SinkEnd {
    /// The sink ended the stream with this status.
    Status(Status),
    /// The sink closed its side without a status.
    Closed,
    /// The connection failed or was reset.
    Lost(String),
}

impl CallState {
    fn lock(&self) -> std::sync::MutexGuard<'_, CallLog> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first end the sink's side reports is its end.
    fn sink_ended(&self, end: SinkEnd) {
        self.lock().sink.get_or_insert(end);
    }

    fn served_ended(&self, status: Option<Status>) {
        let mut log = self.lock();
        if log.served.is_none() {
            log.served = status;
        }
    }

    fn take(&self) -> CallLog {
        std::mem::take(&mut *self.lock())
    }

    /// Reads one of the sink's requests on its way to the engine: the
    /// trigger's answer is taken out (the engine would end the stream over a
    /// collection it does not know); ACKs are progress. Returns whether the
    /// engine gets it.
    fn inspect(&self, message: &[u8]) -> bool {
        // One the engine cannot decode either: it says what is wrong with it.
        let Ok(request) = RequestResources::decode(message) else {
            return true;
        };
        if request.collection == TRIGGER_COLLECTION {
            let answer = request.error_detail.as_ref();
            tracing::debug!(
                code = answer.map(|e| m::code_label(e.code)),
                message = answer.map(|e| e.message.as_str()),
                "the sink answered the trigger"
            );
            return false;
        }
        let mut log = self.lock();
        if log.sink_node.is_none() {
            let node = request.sink_node.as_ref().map(|n| n.id.clone()).unwrap_or_default();
            tracing::info!(sink_node = ?node, collection = ?request.collection, "the sink asks for its collections");
            log.sink_node = Some(node);
        }
        if !request.response_nonce.is_empty() && request.error_detail.is_none() {
            if !log.acked {
                tracing::info!(
                    collection = %crate::transport::safe_text::terminal_safe(&request.collection),
                    nonce = %crate::transport::safe_text::terminal_safe(&request.response_nonce),
                    "the sink ACKed its first response on this stream"
                );
            }
            log.acked = true;
        }
        true
    }
}

/// The sink's requests, as the engine reads them: the response body of the
/// call, a whole message at a time (one held at a time,
/// at most `max_message_bytes`: the limit the engine applies too). The
/// status the sink ends with is kept for the log; the engine sees the end.
struct SinkRequests {
    /// Where the body goes when the engine drops it before its end.
    leftover: Option<oneshot::Sender<Body>>,
    body: Option<Body>,
    buf: BytesMut,
    max_message_bytes: usize,
    log: Arc<CallState>,
}

impl SinkRequests {
    /// The next whole message (prefix included) in `buf`, if there is one.
    fn next_message(&mut self) -> Result<Option<Bytes>, Status> {
        let Some(prefix) = self.buf.first_chunk::<HEADER>() else {
            return Ok(None);
        };
        let len = message_len(prefix).map_err(|flag| {
            Status::unimplemented(format!(
                "the sink sent a compressed message (flag {flag}); this source reads uncompressed messages"
            ))
        })?;
        if len > self.max_message_bytes {
            m::limit_refused("max_request_bytes");
            return Err(Status::resource_exhausted(format!(
                "the sink sent a request of {len} bytes; --max-request-bytes={} allows",
                self.max_message_bytes
            )));
        }
        if self.buf.len() < HEADER + len {
            self.buf.reserve(HEADER + len - self.buf.len());
            return Ok(None);
        }
        Ok(Some(self.buf.split_to(HEADER + len).freeze()))
    }
}

impl Drop for SinkRequests {
    fn drop(&mut self) {
        if let (Some(leftover), Some(body)) = (self.leftover.take(), self.body.take()) {
            let _ = leftover.send(body);
        }
    }
}

impl http_body::Body for SinkRequests {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            match this.next_message() {
                Ok(Some(message)) => {
                    if this.log.inspect(&message[HEADER..]) {
                        return Poll::Ready(Some(Ok(Frame::data(message))));
                    }
                    continue;
                }
                Ok(None) => {}
                Err(status) => {
                    this.body = None;
                    this.buf.clear();
                    return Poll::Ready(Some(Err(status)));
                }
            }
            let Some(body) = this.body.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(Pin::new(body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.buf.extend_from_slice(&data),
                    Err(frame) => {
                        if let Some(status) = frame.into_trailers().ok().and_then(|t| Status::from_header_map(&t)) {
                            this.log.sink_ended(SinkEnd::Status(status));
                        }
                    }
                },
                Some(Err(status)) => {
                    this.log.sink_ended(SinkEnd::Lost(status_text(&status)));
                    this.body = None;
                    return Poll::Ready(Some(Err(status)));
                }
                None => {
                    this.log.sink_ended(SinkEnd::Closed);
                    this.body = None;
                    if !this.buf.is_empty() {
                        this.buf.clear();
                        return Poll::Ready(Some(Err(Status::invalid_argument(
                            "the sink's stream ended inside a message",
                        ))));
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }
}

/// The call's request body: the trigger, then the engine's responses as it
/// frames them. Its end (the engine's trailers, or hyper dropping it when
/// the stream is reset) ends the stream.
struct SourceResponses {
    trigger: Option<Bytes>,
    served: Served,
    log: Arc<CallState>,
    ended: Option<oneshot::Sender<()>>,
}

/// The engine's responses: started once the call is answered.
enum Served {
    Waiting(oneshot::Receiver<Body>),
    Started(Body),
}

impl SourceResponses {
    fn finish(&mut self) {
        if let Some(ended) = self.ended.take() {
            let _ = ended.send(());
        }
    }
}

impl Drop for SourceResponses {
    fn drop(&mut self) {
        self.finish();
    }
}

impl http_body::Body for SourceResponses {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if let Some(trigger) = this.trigger.take() {
            return Poll::Ready(Some(Ok(Frame::data(trigger))));
        }
        if this.ended.is_none() {
            return Poll::Ready(None);
        }
        let served = loop {
            match &mut this.served {
                Served::Started(served) => break served,
                Served::Waiting(started) => match ready!(Pin::new(started).poll(cx)) {
                    Ok(served) => this.served = Served::Started(served),
                    // No stream was started: the call is over.
                    Err(_) => {
                        this.finish();
                        return Poll::Ready(None);
                    }
                },
            }
        };
        match ready!(Pin::new(served).poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                // The engine's status goes in the log: a request carries no
                // status, its end is the end of the stream.
                Err(frame) => {
                    let status = frame.into_trailers().ok().and_then(|t| Status::from_header_map(&t));
                    this.log.served_ended(status);
                    this.finish();
                    Poll::Ready(None)
                }
            },
            Some(Err(status)) => {
                this.log.served_ended(Some(status.clone()));
                this.finish();
                Poll::Ready(Some(Err(status)))
            }
            None => {
                this.finish();
                Poll::Ready(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A response body of `chunks`, as the sink's side of the call.
    fn sink_body(chunks: Vec<Bytes>) -> Body {
        let frames = chunks.into_iter().map(|c| Ok::<_, Status>(Frame::data(c)));
        Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
    }

    fn requests(chunks: Vec<Bytes>, max_message_bytes: usize) -> (SinkRequests, Arc<CallState>) {
        let log = Arc::new(CallState::default());
        let requests = SinkRequests {
            leftover: None,
            body: Some(sink_body(chunks)),
            buf: BytesMut::new(),
            max_message_bytes,
            log: log.clone(),
        };
        (requests, log)
    }

    fn framed(request: &RequestResources) -> Bytes {
        call::framed(request).unwrap()
    }

    #[tokio::test]
    async fn the_trigger_answer_is_taken_out_and_messages_pass_whole() {
        let trigger_answer = framed(&RequestResources {
            collection: TRIGGER_COLLECTION.into(),
            error_detail: Some(tonic_types::Status {
                code: Code::Unimplemented as i32,
                ..Default::default()
            }),
            ..Default::default()
        });
        let ack = framed(&RequestResources {
            collection: "c".into(),
            response_nonce: "1".into(),
            ..Default::default()
        });
        // Split anywhere: inside the prefix, and across the two messages.
        let mut all = BytesMut::new();
        all.extend_from_slice(&trigger_answer);
        all.extend_from_slice(&ack);
        let all = all.freeze();
        let chunks = vec![
            all.slice(..3),
            all.slice(3..trigger_answer.len() + 2),
            all.slice(trigger_answer.len() + 2..),
        ];
        let (requests, log) = requests(chunks, 1 << 20);
        let collected = requests.collect().await.unwrap().to_bytes();
        assert_eq!(collected, ack, "only the ACK reaches the engine, whole");
        let log = log.take();
        assert!(log.acked);
        assert!(matches!(log.sink, Some(SinkEnd::Closed)));
    }

    #[tokio::test]
    async fn a_message_over_the_limit_is_refused_before_it_is_read() {
        let mut prefix = BytesMut::new();
        prefix.extend_from_slice(&[0, 0, 0x10, 0, 0]);
        let (mut requests, _) = requests(vec![prefix.freeze()], 4096);
        let refused = requests.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert!(refused.message().contains("--max-request-bytes=4096"), "{refused:?}");
    }
}
