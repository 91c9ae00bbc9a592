//! One `IncrementalAggregatedResources` stream: a single type (the response
//! has no `type_url`), diffs against what the client ACKed, one outstanding
//! response, stale nonces ignored. After a NACK the client keeps its previous
//! state, and the next change is sent as a diff against that state.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::StreamExt;
use tonic::Status;

use super::registry::{Protocol, RegistryEntry, TypeView};
use super::{record_ack, record_nack, record_stale, ClientGone, Downstream, Outbound, StreamLogs, StreamProtocol};
use crate::cache::{CollectionSnapshot, Diff};
use crate::metrics::CollectionMetrics;
use crate::transport::requests::Room;
use crate::wire::{encode_suffix, version_entry, EncodedResponse, IncrementalRequest};

/// What the client holds.
enum ClientState {
    /// Its `initial_resource_versions` (entries as slices of its request):
    /// kept only until the first response is built (the collection may not
    /// be delivered yet), then dropped.
    Initial(Vec<Bytes>, Room),
    /// Its initial state, no longer known in detail (the first response was
    /// built from it and is not ACKed yet). After a NACK, the next response
    /// re-sends the whole collection and removes every name the first
    /// response's snapshot had.
    Unknown { first: Arc<CollectionSnapshot> },
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
    metrics: Arc<CollectionMetrics>,
}

pub(super) struct IncrementalStream {
    shared: Downstream,
    entry: RegistryEntry,
    id: u64,
    subscribed: Option<Subscribed>,
    last_nonce: u64,
    logs: StreamLogs,
}

// === impl IncrementalStream ===

impl StreamProtocol for IncrementalStream {
    type Request = IncrementalRequest;
    type Change = ();

    fn new(shared: Downstream, id: u64, peer: Option<SocketAddr>) -> Self {
        let entry = shared.inner.registry.register(id, peer, Protocol::Incremental);
        Self {
            shared,
            entry,
            id,
            subscribed: None,
            last_nonce: 0,
            logs: StreamLogs::default(),
        }
    }

    fn id(&self) -> u64 {
        self.id
    }

    async fn next_change(&mut self) {
        let changed = match self.subscribed.as_mut() {
            Some(s) => s.changes.next().await.is_some(),
            None => false,
        };
        if !changed {
            // Not subscribed yet (or the cache is gone): nothing will change.
            std::future::pending::<()>().await;
        }
    }

    async fn on_change(&mut self, _: (), out: &Outbound) -> Result<(), ClientGone> {
        self.try_send(out).await
    }

    async fn on_request(
        &mut self,
        request: IncrementalRequest,
        room: Room,
        out: &Outbound,
    ) -> Result<Result<(), ClientGone>, Status> {
        if let Some(node) = &request.node {
            self.entry.set_node_id(&node.id);
        }
        let Some(subscribed) = self.subscribed.as_mut() else {
            // The first request names the type and what the client holds.
            let resolved = self.shared.resolve(&request.type_url)?;
            if let Some(Err(e)) = request
                .initial_resource_versions
                .iter()
                .map(|e| version_entry(e))
                .find(Result::is_err)
            {
                return Err(Status::invalid_argument(format!(
                    "initial_resource_versions does not decode as a map of names to versions: {e}"
                )));
            }
            self.shared.follow(&resolved.collection);
            let changes = self.shared.inner.cache.subscribe(&resolved.collection);
            let metrics = self.shared.inner.cache.metrics(&resolved.collection);
            self.subscribed = Some(Subscribed {
                metrics,
                view: TypeView::new(resolved),
                type_url: request.type_url,
                client: ClientState::Initial(request.initial_resource_versions, room),
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
            let expected = subscribed.view.last_sent_nonce.clone().unwrap_or_default();
            let type_url = subscribed.type_url.clone();
            record_stale(
                self.id,
                &mut self.logs,
                &subscribed.metrics,
                &type_url,
                &expected,
                &request.response_nonce,
            );
            return Ok(Ok(()));
        }
        subscribed.view.outstanding = false;
        let sent = subscribed.sent.clone().expect("a nonce was sent with a snapshot");
        match request.error_detail {
            Some(error) => {
                let version = sent.version.clone();
                let record = record_nack(
                    self.id,
                    &mut self.logs,
                    &subscribed.type_url,
                    &collection,
                    version,
                    error,
                    &subscribed.metrics,
                    self.shared.limits().max_nack_message_bytes,
                );
                subscribed.view.last_nack = Some(record);
            }
            None => {
                record_ack(&subscribed.metrics);
                subscribed.view.acked_version = Some(sent.version.clone());
                subscribed.client = ClientState::At(sent);
            }
        }
        self.publish();
        Ok(self.try_send(out).await)
    }
}

impl IncrementalStream {
    fn publish(&self) {
        if let Some(s) = &self.subscribed {
            self.entry.publish(&s.type_url, s.view.clone());
        }
    }

    /// Sends the diff from what the client holds to the current version, when
    /// one may be sent.
    async fn try_send(&mut self, out: &Outbound) -> Result<(), ClientGone> {
        let Some(s) = self.subscribed.as_mut() else {
            return Ok(());
        };
        if s.view.outstanding {
            return Ok(());
        }
        let Some(snapshot) = self.shared.inner.cache.get(&s.view.collection) else {
            return Ok(());
        };
        if s.view
            .last_nack
            .as_ref()
            .is_some_and(|nack| nack.version == snapshot.version)
        {
            return Ok(());
        }
        let body = match &s.client {
            ClientState::At(held) if held.version == snapshot.version => return Ok(()),
            ClientState::At(held) => snapshot.incremental_body_from(held),
            // The first response is sent even when empty: it tells the client
            // it is in sync. From nothing, the diff is the whole collection:
            // the same bytes as a state-of-the-world body.
            ClientState::Initial(known, _) if known.is_empty() => snapshot.sotw_parts().clone(),
            ClientState::Initial(known, _) => {
                // Work proportional to what the client sent: admitted one
                // stream at a time, so a burst of large first requests keeps
                // at most one worker busy and other clients are served.
                let _turn = self.shared.heavy_work().await;
                let mut entries: Vec<(&str, &str)> = known.iter().filter_map(|e| version_entry(e).ok()).collect();
                entries.sort_unstable();
                Arc::from([Diff::from_versions(&entries, &snapshot.resources).encode(&snapshot.version)])
            }
            ClientState::Unknown { first } => {
                // The whole collection (the shared state-of-the-world parts,
                // not a copy) and every name the first response's snapshot
                // had that is gone.
                let removed: Vec<&str> = first
                    .resources
                    .keys()
                    .filter(|name| !snapshot.resources.contains_key(*name))
                    .map(|name| &**name)
                    .collect();
                let mut parts = snapshot.sotw_parts().to_vec();
                parts.push(crate::wire::encode_body("", [], &removed));
                Arc::from(parts)
            }
        };
        let mut room = Room::none();
        if let ClientState::Initial(..) = s.client {
            // Used: from now on the client is at its initial state or at
            // what it ACKs, never both held. The request's room goes with
            // the response built from it, until that is written.
            let first = ClientState::Unknown {
                first: snapshot.clone(),
            };
            if let ClientState::Initial(_, request_room) = std::mem::replace(&mut s.client, first) {
                room = request_room;
            }
        }
        self.last_nonce += 1;
        let nonce = self.last_nonce.to_string();
        let response = EncodedResponse {
            shared: body,
            suffix: encode_suffix(None, &nonce),
            snapshot: Some(snapshot.clone()),
            room,
        };
        s.view.outstanding = true;
        s.view.last_sent_nonce = Some(nonce);
        s.view.last_sent_version = Some(snapshot.version.clone());
        snapshot.metrics.pushes.increment(1);
        s.sent = Some(snapshot);
        self.publish();
        let shutdown = self.shared.inner.shutdown.clone();
        tokio::select! {
            sent = out.send(Ok(Box::new(response))) => sent.map_err(|_| ClientGone),
            _ = shutdown.cancelled() => Ok(()),
        }
    }
}
