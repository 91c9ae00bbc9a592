//! One `IncrementalAggregatedResources` stream: a single type (the response
//! has no `type_url`), diffs against what the client ACKed, one outstanding
//! response, stale nonces ignored. After a NACK the client keeps its previous
//! state, and the next change is sent as a diff against that state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio_stream::wrappers::WatchStream;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use super::registry::{Protocol, RegistryEntry, TypeView};
use super::{end_with, record_ack, record_nack, shutting_down, Downstream, Outbound};
use crate::cache::{CollectionSnapshot, Diff};
use crate::metrics as m;
use crate::wire::{encode_suffix, EncodedResponse, IncrementalRequest};

/// What the client holds.
enum ClientState {
    /// Its `initial_resource_versions`, until it ACKs a response.
    Initial(HashMap<String, String>),
    /// The snapshot it last ACKed.
    At(Arc<CollectionSnapshot>),
}

struct Subscribed {
    type_url: String,
    view: TypeView,
    client: ClientState,
    /// The snapshot the outstanding (or last) response brought the client to.
    sent: Option<Arc<CollectionSnapshot>>,
    changes: WatchStream<Option<Arc<CollectionSnapshot>>>,
}

pub(super) struct IncrementalStream {
    shared: Downstream,
    entry: RegistryEntry,
    id: u64,
    subscribed: Option<Subscribed>,
    last_nonce: u64,
}

// === impl IncrementalStream ===

impl IncrementalStream {
    pub(super) fn new(shared: Downstream, id: u64, peer: Option<SocketAddr>) -> Self {
        let entry = shared.inner.registry.register(id, peer, Protocol::Incremental);
        Self {
            shared,
            entry,
            id,
            subscribed: None,
            last_nonce: 0,
        }
    }

    pub(super) async fn run(mut self, mut inbound: Streaming<IncrementalRequest>, out: Outbound) {
        let shutdown = self.shared.inner.shutdown.clone();
        let end = loop {
            let changed = async {
                match self.subscribed.as_mut() {
                    Some(s) => s.changes.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break Some(shutting_down()),
                _ = out.closed() => break None,
                request = inbound.message() => match request {
                    Ok(Some(request)) => match self.on_request(request, &out).await {
                        Ok(true) => {}
                        Ok(false) => break None,
                        Err(status) => break Some(status),
                    },
                    Ok(None) => break None,
                    // A request that does not decode ends the stream with
                    // its status; after a client's cancel nobody reads it.
                    Err(status) => {
                        tracing::debug!(stream = self.id, %status, "client stream ended");
                        break Some(status);
                    }
                },
                Some(_) = changed => {
                    if !self.try_send(&out).await {
                        break None;
                    }
                }
            }
        };
        if let Some(status) = end {
            tracing::debug!(stream = self.id, %status, "ending stream");
            end_with(&out, status).await;
        }
    }

    /// Handles one request. `Ok(false)`: the client is gone; `Err` ends the
    /// stream with that status.
    async fn on_request(&mut self, request: IncrementalRequest, out: &Outbound) -> Result<bool, Status> {
        if let Some(node) = &request.node {
            self.entry.set_node_id(&node.id);
        }
        let Some(subscribed) = self.subscribed.as_mut() else {
            // The first request names the type and what the client holds.
            let resolved = self.shared.resolve(&request.type_url)?;
            self.shared.follow(&resolved.collection);
            let changes = self.shared.inner.cache.subscribe(&resolved.collection);
            self.subscribed = Some(Subscribed {
                view: TypeView::new(resolved),
                type_url: request.type_url,
                client: ClientState::Initial(request.initial_resource_versions),
                sent: None,
                changes: WatchStream::from_changes(changes),
            });
            self.publish();
            return Ok(self.try_send(out).await);
        };
        // Later requests may leave `type_url` empty; another type is an error.
        if !request.type_url.is_empty() && request.type_url != subscribed.type_url {
            return Err(Status::invalid_argument(format!(
                "this IncrementalAggregatedResources stream carries type_url {:?}, and a stream carries one type only \
                 (its responses have no type_url); open another stream for {:?}",
                subscribed.type_url, request.type_url
            )));
        }
        let collection = subscribed.view.collection.clone();
        let matches = subscribed
            .view
            .last_sent_nonce
            .as_ref()
            .is_some_and(|nonce| *nonce == request.response_nonce);
        if !matches {
            metrics::counter!(m::DOWNSTREAM_STALE_REQUESTS, "collection" => collection).increment(1);
            tracing::debug!(stream = self.id, nonce = %request.response_nonce, "stale request ignored");
            return Ok(true);
        }
        subscribed.view.outstanding = false;
        let sent = subscribed.sent.clone().expect("a nonce was sent with a snapshot");
        match request.error_detail {
            Some(error) => {
                let version = sent.version.clone();
                let record = record_nack(self.id, &subscribed.type_url, &collection, version, error);
                subscribed.view.last_nack = Some(record);
            }
            None => {
                record_ack(&collection);
                subscribed.view.acked_version = Some(sent.version.clone());
                subscribed.client = ClientState::At(sent);
            }
        }
        self.publish();
        Ok(self.try_send(out).await)
    }

    fn publish(&self) {
        if let Some(s) = &self.subscribed {
            self.entry.publish(&s.type_url, s.view.clone());
        }
    }

    /// Sends the diff from what the client holds to the current version, when
    /// one may be sent. Returns false when the client is gone.
    async fn try_send(&mut self, out: &Outbound) -> bool {
        let Some(s) = self.subscribed.as_mut() else {
            return true;
        };
        if s.view.outstanding {
            return true;
        }
        let Some(snapshot) = self.shared.inner.cache.get(&s.view.collection) else {
            return true;
        };
        if s.view
            .last_nack
            .as_ref()
            .is_some_and(|nack| nack.version == snapshot.version)
        {
            return true;
        }
        let body = match &s.client {
            ClientState::At(held) if held.version == snapshot.version => return true,
            ClientState::At(held) => snapshot.incremental_body_from(held),
            // The first response is sent even when empty: it tells the client
            // it is in sync. From nothing, the diff is the whole collection:
            // the same bytes as a state-of-the-world body.
            ClientState::Initial(known) if known.is_empty() => snapshot.sotw_parts().clone(),
            ClientState::Initial(known) => {
                Arc::from([Diff::from_versions(known, &snapshot.resources).encode(&snapshot.version)])
            }
        };
        self.last_nonce += 1;
        let nonce = self.last_nonce.to_string();
        let response = EncodedResponse {
            shared: body,
            suffix: encode_suffix(None, &nonce),
        };
        s.view.outstanding = true;
        s.view.last_sent_nonce = Some(nonce);
        s.view.last_sent_version = Some(snapshot.version.clone());
        metrics::counter!(m::DOWNSTREAM_PUSHES, "collection" => snapshot.collection.clone()).increment(1);
        s.sent = Some(snapshot);
        self.publish();
        let shutdown = self.shared.inner.shutdown.clone();
        tokio::select! {
            sent = out.send(Ok(response)) => sent.is_ok(),
            _ = shutdown.cancelled() => true,
        }
    }
}
