//! One MCP stream between the gateway (sink) and a source, whichever side
//! dialled: the initial requests, then every `Resources` message through the
//! `SinkSession`, and collections that downstream clients ask for subscribed
//! on the live stream. Client mode and the dial-out server both run this.

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Streaming};

use super::{SinkSession, SubscriptionState};
use crate::metrics as m;
use crate::proto::RequestResources;
use crate::wire::RawResources;

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
        reason: &'static str,
        message: String,
    },
}

/// A new stream's sink side, before the stream opens.
pub struct Opened {
    pub session: SinkSession,
    pub subscriptions: watch::Receiver<SubscriptionState>,
    /// Replies and later subscriptions go here.
    pub tx: mpsc::Sender<RequestResources>,
    /// What the source receives, the initial requests first.
    pub rx: mpsc::Receiver<RequestResources>,
}

/// Queues the initial request of every wanted collection for a new stream
/// (see [`super::SinkContext::open`]).
pub fn open(mut session: SinkSession, subscriptions: &super::Subscriptions) -> Opened {
    let mut subscriptions = subscriptions.watch();
    let initial = initial_requests(&mut session, &mut subscriptions);
    // Every initial request is queued before the stream opens, so the channel
    // must hold them all; afterwards it carries one reply per message received.
    let (tx, rx) = mpsc::channel(initial.len() + 64);
    for request in initial {
        tx.try_send(request).expect("the channel holds every initial request");
    }
    Opened {
        session,
        subscriptions,
        tx,
        rx,
    }
}

/// The initial `RequestResources` for every wanted collection, in order.
pub fn initial_requests(
    session: &mut SinkSession,
    subscriptions: &mut watch::Receiver<SubscriptionState>,
) -> Vec<RequestResources> {
    let wanted: Vec<_> = subscriptions.borrow_and_update().wanted.iter().cloned().collect();
    wanted.into_iter().filter_map(|c| session.subscribe(c)).collect()
}

/// Runs the stream until it ends. `progress` is set once every collection
/// subscribed on the stream has been applied at least once (client mode
/// resets its backoff on it).
pub async fn run(
    session: &mut SinkSession,
    inbound: &mut Streaming<RawResources>,
    outbound: &mpsc::Sender<RequestResources>,
    subscriptions: &mut watch::Receiver<SubscriptionState>,
    shutdown: &CancellationToken,
    progress: &mut bool,
) -> StreamEnd {
    loop {
        tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(message)) => {
                    let handled = session.handle(message);
                    *progress = session.applied_every_collection();
                    if outbound.send(handled.reply).await.is_err() {
                        send_failed("Unavailable");
                        return StreamEnd::Failed {
                            reason: "send",
                            message: "the stream to the source closed while sending an ACK".into(),
                        };
                    }
                }
                Ok(None) => return StreamEnd::Failed {
                    reason: "closed",
                    message: "the source closed the stream".into(),
                },
                Err(status) => {
                    metrics::counter!(
                        m::RECV_FAILURES,
                        "component" => m::COMPONENT_UPSTREAM,
                        "code" => m::code_label(status.code() as i32)
                    )
                    .increment(1);
                    return classify(status, session.max_message_bytes());
                }
            },
            changed = subscriptions.changed() => {
                if changed.is_err() {
                    return StreamEnd::Shutdown;
                }
                // Collections first asked for by downstream clients are
                // subscribed on the live stream.
                for request in initial_requests(session, subscriptions) {
                    tracing::info!(collection = %request.collection, "subscribing on the live stream");
                    if outbound.send(request).await.is_err() {
                        send_failed("Unavailable");
                        return StreamEnd::Failed {
                            reason: "send",
                            message: "the stream to the source closed while subscribing".into(),
                        };
                    }
                }
            }
            _ = shutdown.cancelled() => return StreamEnd::Shutdown,
        }
    }
}

/// A request to the source could not be sent.
pub fn send_failed(code: &'static str) {
    metrics::counter!(m::SEND_FAILURES, "component" => m::COMPONENT_UPSTREAM, "code" => code).increment(1);
}

/// Galley ends the whole stream with `InvalidArgument "unsupported collection
/// \"X\""` for a collection it does not serve (istio#13559).
fn refused_collection(status: &tonic::Status) -> Option<String> {
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
            reason: "message_too_large",
            message: format!(
                "a message from the source is larger than --max-message-bytes={max_message_bytes} allows ({}); \
                 the cache keeps its state; raise the flag to accept it",
                status.message()
            ),
        };
    }
    StreamEnd::Failed {
        reason: "status",
        message: format!("the stream ended: {:?}: {}", status.code(), status.message()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
