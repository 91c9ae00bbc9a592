//! One MCP stream between the gateway (sink) and a source, whichever side
//! dialled: the initial requests, then every `Resources` message through the
//! `SinkSession`, and collections subscribed later (in client mode, those a
//! client asked for once the source delivered them on the probe) on the live
//! stream. Client mode and the dial-out server both run this.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::Code;

use super::session::Received;
use super::SinkSession;
use crate::cache::demand::SubscriptionState;
use crate::cache::CacheWriter;
use crate::metrics as m;
use crate::proto::RequestResources;
use crate::transport::requests::RequestStream;

/// A source's messages, in client mode and dial-out alike: read by the
/// gateway's own reader, each into a buffer of its own that the cache keeps
/// as the storage of a collection stored afresh, or frees once it is
/// applied.
pub type Inbound = RequestStream<Received>;

/// How one upstream stream ended.
#[derive(Debug)]
pub enum StreamEnd {
    Shutdown,
    /// The source refused a collection (`unsupported collection "X"`).
    Refused {
        collection: String,
        message: String,
    },
    Failed {
        reason: Failure,
        message: String,
    },
}

/// Why an upstream stream failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// TCP, TLS or the HTTP/2 handshake.
    Connect,
    /// The source ended the stream with a status.
    Status,
    /// The source closed the stream.
    Closed,
    /// A request could not be sent: the stream is gone.
    Send,
    /// A message over `--max-message-bytes`.
    MessageTooLarge,
    /// The upstream's chain of gateways includes this one.
    Loop,
    /// The upstream's chain is longer than `--max-chain-depth` allows.
    ChainTooLong,
    /// The upstream gateway serves as sensitive a collection this one would
    /// serve as not (its `--type-map` lacks `sensitive: true`).
    SensitiveElsewhere,
}

impl Failure {
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Status => "status",
            Failure::Closed => "closed",
            Failure::Send => "send",
            Failure::MessageTooLarge => "message_too_large",
            Failure::Loop => "loop",
            Failure::ChainTooLong => "chain_too_long",
            Failure::SensitiveElsewhere => "sensitive_upstream",
        }
    }
}

impl StreamEnd {
    /// Every `reason` label of `mcp_gateway_upstream_stream_terminations_total`.
    pub const REASONS: [&'static str; 10] = [
        "connect",
        "status",
        "closed",
        "send",
        "message_too_large",
        "loop",
        "chain_too_long",
        "sensitive_upstream",
        "refused_collection",
        "shutdown",
    ];

    /// The `reason` label, and the message for the log and the status.
    pub fn reason(&self) -> &'static str {
        match self {
            StreamEnd::Shutdown => "shutdown",
            StreamEnd::Refused { .. } => "refused_collection",
            StreamEnd::Failed { reason, .. } => reason.as_str(),
        }
    }

    /// Counts the end in `mcp_gateway_upstream_stream_terminations_total`.
    pub fn count(&self) {
        metrics::counter!(m::UPSTREAM_STREAM_TERMINATIONS, "reason" => self.reason()).increment(1);
    }
}

/// A new stream's sink side, before the stream opens.
pub struct Opened {
    pub session: SinkSession,
    subscriptions: watch::Receiver<SubscriptionState>,
    /// Replies and later subscriptions go here.
    tx: mpsc::Sender<RequestResources>,
    /// The initial request of every wanted collection, until queued.
    initial: Vec<RequestResources>,
}

/// How long a dial-out source may take to speak first (Galley's trigger)
/// before the sink asks for its collections anyway.
pub const TRIGGER_WAIT: Duration = Duration::from_secs(1);

/// A new stream's sink side, and what the source is to receive (see
/// [`super::SinkContext::open`]). Nothing is queued yet.
pub fn open(
    mut session: SinkSession,
    subscriptions: &crate::cache::demand::Subscriptions,
) -> (Opened, mpsc::Receiver<RequestResources>) {
    let mut subscriptions = subscriptions.watch();
    let initial = initial_requests(&mut session, &mut subscriptions);
    // The initial requests (and a trigger's answer) are queued at once, so
    // the channel holds them all; afterwards it carries one reply per
    // message received.
    let (tx, rx) = mpsc::channel(initial.len() + 64);
    let opened = Opened {
        session,
        subscriptions,
        tx,
        initial,
    };
    (opened, rx)
}

/// The initial `RequestResources` for every wanted collection, in order.
fn initial_requests(
    session: &mut SinkSession,
    subscriptions: &mut watch::Receiver<SubscriptionState>,
) -> Vec<RequestResources> {
    let wanted: Vec<_> = subscriptions.borrow_and_update().wanted.iter().cloned().collect();
    wanted.into_iter().filter_map(|c| session.subscribe(c)).collect()
}

// === impl Opened ===

impl Opened {
    /// Queues the initial requests.
    pub fn request_collections(&mut self) {
        for request in self.initial.drain(..) {
            self.tx
                .try_send(request)
                .expect("the channel holds every initial request");
        }
    }

    /// Dial-out: the source may speak first. Galley 1.1 sends a trigger
    /// (collection `""`) and reads exactly one message back, which must be a
    /// NACK with `UNIMPLEMENTED`; 1.2 on sends `$triggerCollection` and
    /// ignores the answer; a source that waits to be asked sends nothing.
    /// So: wait up to `wait` for a first message; answer a trigger; then ask
    /// for the collections. A first message that is not a trigger is handled
    /// after the requests, as any other.
    pub async fn accept_trigger(
        &mut self,
        writer: &mut CacheWriter,
        inbound: &mut Inbound,
        shutdown: &CancellationToken,
        wait: Duration,
    ) -> Result<(), StreamEnd> {
        let first = tokio::select! {
            first = tokio::time::timeout(wait, inbound.message()) => first,
            _ = shutdown.cancelled() => return Err(StreamEnd::Shutdown),
        };
        match first {
            Err(_elapsed) => {
                tracing::debug!("the source did not speak first; asking for the collections");
                self.request_collections();
                Ok(())
            }
            Ok(Ok(Some(received))) if SinkSession::is_trigger(&received.message) => {
                tracing::debug!(collection = %received.message.collection, "answered the source's trigger");
                let reply = self.session.trigger_reply(&received.message);
                self.tx
                    .try_send(reply)
                    .expect("the channel has room for the trigger's answer");
                self.request_collections();
                Ok(())
            }
            Ok(Ok(Some(message))) => {
                self.request_collections();
                self.on_message(message, writer).await
            }
            Ok(Ok(None)) => Err(closed()),
            Ok(Err(status)) => Err(self.receive_failed(status)),
        }
    }

    /// Runs the stream until it ends. `progress` is set once every
    /// collection subscribed on the stream has been applied at least once
    /// (client mode resets its backoff on it).
    pub async fn run(
        &mut self,
        writer: &mut CacheWriter,
        inbound: &mut Inbound,
        shutdown: &CancellationToken,
        progress: &mut bool,
    ) -> StreamEnd {
        loop {
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(message)) => {
                        // The messages that came with it (a source pushes each
                        // collection of a change as a message of its own) are
                        // applied as one step: no client sees half of the
                        // change (make before break across Envoy's types).
                        let (step, end) = came_with(message, inbound, self.session.max_message_bytes());
                        if let Err(failed) = self.on_messages(step, writer).await {
                            // The source's own word, when it already ended
                            // the stream behind these messages.
                            return match end {
                                Some(Some(status)) => self.receive_failed(status),
                                _ => self.why_it_closed(failed, inbound).await,
                            };
                        }
                        *progress = self.session.applied_every_collection();
                        if let Some(status) = end {
                            return match status {
                                Some(status) => self.receive_failed(status),
                                None => closed(),
                            };
                        }
                    }
                    Ok(None) => return closed(),
                    Err(status) => return self.receive_failed(status),
                },
                changed = self.subscriptions.changed() => {
                    if changed.is_err() {
                        return StreamEnd::Shutdown;
                    }
                    // Collections subscribed since (a client's demand the
                    // source delivered on the probe) join the live stream.
                    for request in initial_requests(&mut self.session, &mut self.subscriptions) {
                        tracing::info!(collection = %crate::transport::safe_text::terminal_safe(&request.collection), "subscribing on the live stream");
                        if self.tx.send(request).await.is_err() {
                            send_failed("Unavailable");
                            let end = StreamEnd::Failed {
                                reason: Failure::Send,
                                message: "the stream to the source closed while subscribing".into(),
                            };
                            return self.why_it_closed(end, inbound).await;
                        }
                    }
                }
                _ = shutdown.cancelled() => return StreamEnd::Shutdown,
            }
        }
    }

    async fn on_message(&mut self, message: Received, writer: &mut CacheWriter) -> Result<(), StreamEnd> {
        self.on_messages(vec![message], writer).await
    }

    /// Applies `messages` as one step of the cache, then ACKs or NACKs each,
    /// in order.
    async fn on_messages(&mut self, messages: Vec<Received>, writer: &mut CacheWriter) -> Result<(), StreamEnd> {
        let messages_len = messages.len();
        let session = &mut self.session;
        let handle = |writer: &mut CacheWriter| -> Vec<RequestResources> {
            messages
                .into_iter()
                .map(|message| session.handle(message, writer).reply)
                .collect()
        };
        // One message is a step by itself (and a large one keeps nobody
        // waiting for the step's lock while it is applied).
        let replies = if messages_len == 1 {
            handle(writer)
        } else {
            writer.step(handle)
        };
        for reply in replies {
            if self.tx.send(reply).await.is_err() {
                send_failed("Unavailable");
                return Err(StreamEnd::Failed {
                    reason: Failure::Send,
                    message: "the stream to the source closed while sending an ACK".into(),
                });
            }
        }
        Ok(())
    }

    /// A send that failed because the source ended the stream: the status
    /// it ended it with (a `PERMISSION_DENIED` naming what it refused) says
    /// more than "closed while sending", and is what the stream's end, the
    /// log and `/readyz` then say. Read for a moment at most; `end` if the
    /// source said nothing.
    async fn why_it_closed(&self, end: StreamEnd, inbound: &mut Inbound) -> StreamEnd {
        const WAIT: std::time::Duration = std::time::Duration::from_secs(1);
        let status = tokio::time::timeout(WAIT, async {
            loop {
                match inbound.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        })
        .await;
        match status {
            Ok(Some(status)) => self.receive_failed(status),
            _ => end,
        }
    }

    fn receive_failed(&self, status: tonic::Status) -> StreamEnd {
        metrics::counter!(
            m::RECV_FAILURES,
            "component" => m::COMPONENT_UPSTREAM,
            "code" => m::code_number(status.code() as i32)
        )
        .increment(1);
        classify(status, self.session.max_message_bytes())
    }
}

/// Messages of one step at most: a source's push of every collection.
const STEP_MESSAGES: usize = 64;

/// `first`, and the messages already read after it (none is waited for),
/// up to [`STEP_MESSAGES`] and about `max_bytes` in all (one message's limit:
/// a step holds at most twice what one message may), and how the stream
/// ended if it did meanwhile (`Some(None)`: closed).
fn came_with(
    first: Received,
    inbound: &mut Inbound,
    max_bytes: usize,
) -> (Vec<Received>, Option<Option<tonic::Status>>) {
    let mut bytes = first.buffer.len();
    let mut step = vec![first];
    while step.len() < STEP_MESSAGES && bytes < max_bytes {
        // Polled once: `message` is cancel-safe, and whatever is not read
        // yet waits for the next turn of the loop.
        let next = std::pin::pin!(inbound.message());
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        match std::future::Future::poll(next, &mut context) {
            std::task::Poll::Ready(Ok(Some(message))) => {
                bytes += message.buffer.len();
                step.push(message);
            }
            std::task::Poll::Ready(Ok(None)) => return (step, Some(None)),
            std::task::Poll::Ready(Err(status)) => return (step, Some(Some(status))),
            std::task::Poll::Pending => break,
        }
    }
    (step, None)
}

fn closed() -> StreamEnd {
    StreamEnd::Failed {
        reason: Failure::Closed,
        message: "the source closed the stream".into(),
    }
}

/// A request to the source could not be sent.
pub fn send_failed(code: &'static str) {
    metrics::counter!(m::SEND_FAILURES, "component" => m::COMPONENT_UPSTREAM, "code" => code).increment(1);
}

/// Galley ends the whole stream with `InvalidArgument "unsupported collection
/// \"X\""` for a collection it does not serve (istio#13559).
pub(super) fn refused_collection(status: &tonic::Status) -> Option<String> {
    if status.code() != Code::InvalidArgument {
        return None;
    }
    let rest = status.message().split_once("unsupported collection \"")?.1;
    let (collection, _) = rest.split_once('"')?;
    Some(collection.to_owned())
}

pub fn classify(status: tonic::Status, max_message_bytes: usize) -> StreamEnd {
    if let Some(collection) = refused_collection(&status) {
        return StreamEnd::Refused {
            collection,
            message: status.message().to_owned(),
        };
    }
    // tonic's own receive limit: say which flag raises it. The message was
    // refused from its length prefix, before it was read.
    if status.code() == Code::OutOfRange && status.message().contains("message length too large") {
        crate::metrics::limit_refused("max_message_bytes");
        return StreamEnd::Failed {
            reason: Failure::MessageTooLarge,
            message: format!(
                "a message from the source is larger than --max-message-bytes={max_message_bytes} allows ({}); \
                 the cache keeps its state; raise the flag to accept it",
                status.message()
            ),
        };
    }
    StreamEnd::Failed {
        reason: Failure::Status,
        message: format!("the stream ended: {:?}: {}", status.code(), status.message()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source's messages on a stream whose bytes come as `tx` sends them.
    fn inbound() -> (tokio::sync::mpsc::UnboundedSender<bytes::Bytes>, Inbound) {
        use tokio_stream::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<bytes::Bytes>();
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
                .map(|b| Ok::<_, tonic::Status>(http_body::Frame::data(b))),
        ));
        let budget = crate::transport::requests::RequestBudget::for_source(4 << 20, true);
        (tx, Inbound::new(body, budget, "Resources"))
    }

    /// A message of `collection`, framed as gRPC sends it.
    fn framed(collection: &str) -> Vec<u8> {
        let message = prost::Message::encode_to_vec(&crate::proto::wire::RawResources {
            collection: collection.into(),
            nonce: "1".into(),
            ..Default::default()
        });
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(message.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&message);
        bytes
    }

    /// The messages already read with the first are one step; the next,
    /// not yet come, is not waited for; the end met meanwhile is kept.
    #[tokio::test]
    async fn the_messages_that_came_together_are_one_step() {
        let (tx, mut inbound) = inbound();
        tx.send([framed("a"), framed("b"), framed("c")].concat().into())
            .unwrap();
        let first = inbound.message().await.unwrap().unwrap();
        let (step, end) = came_with(first, &mut inbound, 4 << 20);
        let collections: Vec<&str> = step.iter().map(|m| m.message.collection.as_str()).collect();
        assert_eq!(collections, ["a", "b", "c"]);
        assert!(end.is_none(), "the stream goes on");

        // Bounded by bytes: past one message's limit, the rest waits.
        tx.send([framed("d"), framed("e")].concat().into()).unwrap();
        let first = inbound.message().await.unwrap().unwrap();
        let (step, _) = came_with(first, &mut inbound, 1);
        assert_eq!(step.len(), 1);
        let next = inbound.message().await.unwrap().unwrap();
        assert_eq!(next.message.collection, "e");

        tx.send(framed("f").into()).unwrap();
        drop(tx);
        let first = inbound.message().await.unwrap().unwrap();
        let (step, end) = came_with(first, &mut inbound, 4 << 20);
        assert_eq!(step.len(), 1);
        assert!(end.is_some(), "the end met is kept for after the step");
    }

    #[test]
    fn every_end_has_a_registered_reason() {
        let failures = [
            Failure::Connect,
            Failure::Status,
            Failure::Closed,
            Failure::Send,
            Failure::MessageTooLarge,
            Failure::Loop,
            Failure::ChainTooLong,
            Failure::SensitiveElsewhere,
        ];
        let mut ends: Vec<StreamEnd> = failures
            .into_iter()
            .map(|reason| StreamEnd::Failed {
                reason,
                message: String::new(),
            })
            .collect();
        ends.push(StreamEnd::Shutdown);
        ends.push(StreamEnd::Refused {
            collection: String::new(),
            message: String::new(),
        });
        let mut reasons: Vec<&str> = ends.iter().map(StreamEnd::reason).collect();
        reasons.sort_unstable();
        let mut registered = StreamEnd::REASONS.to_vec();
        registered.sort_unstable();
        assert_eq!(reasons, registered);
    }

    #[test]
    fn recognises_galleys_unsupported_collection() {
        let status = tonic::Status::invalid_argument("unsupported collection \"istio/x/y\"");
        assert_eq!(refused_collection(&status).as_deref(), Some("istio/x/y"));
        let other = tonic::Status::invalid_argument("something else");
        assert_eq!(refused_collection(&other), None);
        let wrong_code = tonic::Status::unavailable("unsupported collection \"istio/x/y\"");
        assert_eq!(refused_collection(&wrong_code), None);
    }
}
