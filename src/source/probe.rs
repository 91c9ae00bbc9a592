//! The probe (client mode): collections that only clients asked for are
//! asked first on an upstream stream of their own, so that a source that
//! ends a stream for a collection it does not serve (Galley 1.1 to 1.7,
//! `unsupported collection "X"`, istio#13559) ends only the probe, never
//! the main stream that carries every other collection, and costs it no
//! backoff. A collection the source delivers on the probe is subscribed on
//! the main stream; the probe's copy is dropped unread and never ACKed, so
//! the source sends no more of it there. A refused one is recorded and never
//! asked for again. The probe closes once nothing it asked for is left.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::backoff::{Backoff, BackoffPolicy};
use super::stream::{self, Failure, StreamEnd};
use super::UpstreamStatus;
use crate::cache::demand::{SubscriptionState, Subscriptions};
use crate::metrics as m;
use crate::proto::wire::RawResources;
use crate::proto::{RequestResources, SinkNode, RESOURCE_SOURCE_PATH};
use crate::transport::call;
use crate::transport::connect::{self, Dial};
use crate::transport::requests::RequestBudget;
use crate::SharedStr;

/// Every `reason` label of `mcp_gateway_upstream_probe_ends_total`: how a
/// probe stream ended. `delivered`: nothing it asked for is left.
pub const REASONS: [&str; 8] = [
    "delivered",
    "refused_collection",
    "connect",
    "status",
    "closed",
    "send",
    "message_too_large",
    "shutdown",
];

/// The probe of one upstream: the main stream's address, TLS and node, on
/// a connection of its own (a source that drops the probe's connection
/// drops nothing else, and the main stream's large pushes never share its
/// flow-control window).
pub struct Probe {
    pub dial: Dial,
    /// The main stream's sink node, this gateway's id included.
    pub node: SinkNode,
    pub max_message_bytes: usize,
    /// The probe backs off on its own, never touching the main stream's
    /// delays.
    pub backoff: BackoffPolicy,
    pub subscriptions: Arc<Subscriptions>,
    /// Only its `probe` part is written.
    pub status: watch::Sender<UpstreamStatus>,
}

// === impl Probe ===

impl Probe {
    /// Runs until `shutdown`: a probe stream while collections are demanded,
    /// none otherwise.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(self.backoff);
        let mut demand = self.subscriptions.watch();
        self.status.send_modify(|s| s.probe = Some(Default::default()));
        // After the source ended a probe of several collections in a way that
        // names none of them, they are asked for one at a time (`Some`: how
        // many to pass over first, so that one that keeps failing does not
        // hold the others back), and a refusal is then the one asked's.
        let mut one_at_a_time: Option<usize> = None;
        loop {
            while demand.borrow_and_update().demanded.is_empty() {
                one_at_a_time = None;
                tokio::select! {
                    changed = demand.changed() => if changed.is_err() {
                        return;
                    },
                    _ = shutdown.cancelled() => return,
                }
            }
            self.update(|p| {
                p.attempts += 1;
                p.next_retry_in = None;
            });
            let mut progress = false;
            let (end, asked) = self
                .run_stream(&mut demand, &shutdown, &mut progress, one_at_a_time)
                .await;
            if let Some(StreamEnd::Failed {
                reason: Failure::Status,
                ..
            }) = &end
            {
                one_at_a_time = Some(one_at_a_time.map_or(0, |skip| skip + 1));
                if asked > 1 {
                    tracing::info!(
                        upstream = %self.dial.address,
                        "the source ended a probe of {asked} collections without naming one: asking for them one at a time"
                    );
                }
            }
            self.update(|p| p.asking.clear());
            let reason = end.as_ref().map_or("delivered", StreamEnd::reason);
            metrics::counter!(m::PROBE_ENDS, "reason" => reason).increment(1);
            if progress {
                backoff.reset();
            }
            let message = match end {
                // Everything asked for is answered: wait for the next demand.
                None => continue,
                Some(StreamEnd::Shutdown) => return,
                Some(StreamEnd::Refused { collection, message }) => {
                    if super::refuse(&self.subscriptions, &collection, &message) {
                        tracing::warn!(
                            %collection,
                            upstream = %self.dial.address,
                            %message,
                            "the source does not serve a collection a client asked for: clients that wait for \
                             every type (xDS) are answered empty, and it is not asked for again until restart; \
                             only the probe stream ended"
                        );
                        // An answer, not a failure: ask for the rest at once.
                        self.update(|p| p.last_error = Some(message));
                        continue;
                    }
                    // Nothing to drop: a failure, so that an odd source
                    // cannot make the probe spin.
                    message
                }
                Some(StreamEnd::Failed { reason, message }) => {
                    tracing::warn!(
                        upstream = %self.dial.address,
                        reason = reason.as_str(),
                        %message,
                        "the probe stream ended (the main stream is not affected)"
                    );
                    message
                }
            };
            let delay = backoff.next_delay();
            self.update(|p| {
                p.last_error = Some(message);
                p.next_retry_in = Some(delay);
            });
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    fn update(&self, change: impl FnOnce(&mut super::ProbeStatus)) {
        self.status
            .send_modify(|s| change(s.probe.get_or_insert_with(Default::default)));
    }

    /// One probe stream: asks for every demanded collection, and for each
    /// one demanded later, until nothing it asked for is left (`None`) or
    /// the stream ends. `progress`: the source answered something.
    ///
    /// With `one_at_a_time`, it asks for one collection only (passing over
    /// that many first) and takes no new demand; it ends once that one is
    /// answered. Returns how it ended and how many collections it asked for.
    async fn run_stream(
        &self,
        demand: &mut watch::Receiver<SubscriptionState>,
        shutdown: &CancellationToken,
        progress: &mut bool,
        one_at_a_time: Option<usize>,
    ) -> (Option<StreamEnd>, usize) {
        let mut asked = BTreeSet::new();
        let end = self.ask(demand, shutdown, progress, one_at_a_time, &mut asked).await;
        (end, asked.len())
    }

    async fn ask(
        &self,
        demand: &mut watch::Receiver<SubscriptionState>,
        shutdown: &CancellationToken,
        progress: &mut bool,
        one_at_a_time: Option<usize>,
        asked: &mut BTreeSet<SharedStr>,
    ) -> Option<StreamEnd> {
        let channel = tokio::select! {
            connected = connect::connect(&self.dial) => match connected {
                Ok(channel) => channel,
                Err(e) => return Some(StreamEnd::Failed { reason: Failure::Connect, message: e.message }),
            },
            _ = shutdown.cancelled() => return Some(StreamEnd::Shutdown),
        };
        let mut pending: Vec<SharedStr> = demand.borrow_and_update().demanded.keys().cloned().collect();
        if pending.is_empty() {
            return None;
        }
        if let Some(skip) = one_at_a_time {
            pending = vec![pending[skip % pending.len()].clone()];
        }
        // A request per collection at most: the table bounds them.
        let (tx, rx) = mpsc::channel(pending.len() + 64);
        for collection in pending {
            tx.try_send(self.request(&collection))
                .expect("the channel holds every initial request");
            asked.insert(collection);
        }
        self.publish_asking(asked, demand.borrow().demanded.keys());
        tracing::info!(
            upstream = %self.dial.address,
            collections = %join(asked),
            "asking the source on a probe stream for collections only clients asked for"
        );
        let budget = RequestBudget::for_source(self.max_message_bytes, true);
        let response = tokio::select! {
            response = call::bidi::<_, RawResources>(channel, RESOURCE_SOURCE_PATH, rx, budget, "Resources") => response,
            _ = shutdown.cancelled() => return Some(StreamEnd::Shutdown),
        };
        let mut inbound = match response {
            Ok((_headers, inbound)) => inbound,
            Err(status) => return Some(self.classify(status, asked)),
        };
        loop {
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(message)) => {
                        // Resources for a collection asked for here: the
                        // source serves it. Dropped unread, and not ACKed.
                        if asked.contains(message.collection.as_str()) && self.subscriptions.deliver(&message.collection) {
                            *progress = true;
                            tracing::info!(
                                collection = %crate::transport::safe_text::terminal_safe(&message.collection),
                                upstream = %self.dial.address,
                                "the source serves a collection a client asked for: subscribed on the main stream"
                            );
                            if one_at_a_time.is_some() {
                                return None;
                            }
                        }
                    }
                    Ok(None) => {
                        return Some(StreamEnd::Failed {
                            reason: Failure::Closed,
                            message: "the source closed the probe stream".into(),
                        })
                    }
                    Err(status) => return Some(self.classify(status, asked)),
                },
                changed = demand.changed() => {
                    if changed.is_err() {
                        return Some(StreamEnd::Shutdown);
                    }
                    let demanded: Vec<SharedStr> = demand.borrow_and_update().demanded.keys().cloned().collect();
                    if demanded.is_empty() || (one_at_a_time.is_some() && !demanded.iter().any(|c| asked.contains(c))) {
                        return None;
                    }
                    if one_at_a_time.is_some() {
                        continue;
                    }
                    // A new demand joins the open probe.
                    for collection in &demanded {
                        if asked.insert(collection.clone()) {
                            tracing::info!(%collection, "asking the source on the open probe stream");
                            // Never waits: a source that does not read its
                            // requests gets a new probe with all of them.
                            if tx.try_send(self.request(collection)).is_err() {
                                return Some(StreamEnd::Failed {
                                    reason: Failure::Send,
                                    message: "the probe stream could not take another request (closed, or the \
                                              source is not reading)"
                                        .into(),
                                });
                            }
                        }
                    }
                    self.publish_asking(asked, demanded.iter());
                }
                _ = shutdown.cancelled() => return Some(StreamEnd::Shutdown),
            }
        }
    }

    /// The first request for `collection`: full state, no versions (the
    /// answer is only looked at, never applied).
    fn request(&self, collection: &str) -> RequestResources {
        RequestResources {
            sink_node: Some(self.node.clone()),
            collection: collection.to_owned(),
            initial_resource_versions: HashMap::new(),
            response_nonce: String::new(),
            error_detail: None,
            incremental: false,
        }
    }

    /// How the stream ended. A refusal counts only for a collection asked
    /// for here: anything else is a failure, so an odd source cannot make
    /// the probe drop what the main stream carries, or spin.
    /// A probe of one collection that the source ends as a request it
    /// will not serve (`INVALID_ARGUMENT`, `UNIMPLEMENTED`, `NOT_FOUND`) is
    /// a refusal of that one, whatever the message says.
    fn classify(&self, status: tonic::Status, asked: &BTreeSet<SharedStr>) -> StreamEnd {
        let refusal = matches!(
            status.code(),
            tonic::Code::InvalidArgument | tonic::Code::Unimplemented | tonic::Code::NotFound
        );
        match (asked.len(), refusal) {
            (1, true) if stream::refused_collection(&status).is_none() => {
                let collection = asked.iter().next().expect("one").to_string();
                return StreamEnd::Refused {
                    collection,
                    message: format!("{:?}: {}", status.code(), status.message()),
                };
            }
            _ => {}
        }
        match stream::classify(status, self.max_message_bytes) {
            StreamEnd::Refused { collection, message } if !asked.contains(collection.as_str()) => StreamEnd::Failed {
                reason: Failure::Status,
                message: format!("the source refused {collection:?}, which the probe did not ask for: {message}"),
            },
            end => end,
        }
    }

    /// The collections asked for here and still demanded, for the status.
    fn publish_asking<'a>(&self, asked: &BTreeSet<SharedStr>, demanded: impl Iterator<Item = &'a SharedStr>) {
        let asking: Vec<String> = demanded.filter(|c| asked.contains(*c)).map(|c| c.to_string()).collect();
        self.update(|p| p.asking = asking);
    }
}

fn join(collections: &BTreeSet<SharedStr>) -> String {
    collections.iter().map(|c| &**c).collect::<Vec<_>>().join(",")
}
