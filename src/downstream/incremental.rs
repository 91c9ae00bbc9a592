//! One `IncrementalAggregatedResources` stream: a single type (the response
//! has no `type_url`), diffs against what the client ACKed, one outstanding
//! response, stale nonces ignored. The first response is the whole collection
//! with removals for the names the client reported that are gone. After a NACK the client keeps its previous
//! state, and the next change is sent as a diff against that state.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use tokio_stream::wrappers::WatchStream;
use tokio_stream::StreamExt;
use tonic::Status;

use super::registry::{Protocol, RegistryEntry, TypeView};
use super::{record_ack, record_nack, record_stale, ClientGone, Downstream, Outbound, StreamLogs, StreamProtocol};
use crate::cache::CollectionSnapshot;
use crate::metrics::CollectionMetrics;
use crate::wire::{encode_suffix, version_entry, EncodedResponse, IncrementalRequest};

/// The names a client reported in `initial_resource_versions`, each as a
/// varint length and its bytes in one buffer: what the first response needs
/// (the names that are gone), at the size the client sent, no more.
#[derive(Debug, Default)]
struct ReportedNames(Bytes);

impl ReportedNames {
    fn new(entries: &[Bytes]) -> Self {
        let mut buf = BytesMut::with_capacity(entries.iter().map(|e| e.len()).sum());
        for (name, _) in entries.iter().filter_map(|e| version_entry(e).ok()) {
            prost::encoding::encode_varint(name.len() as u64, &mut buf);
            buf.put_slice(name.as_bytes());
        }
        Self(buf.freeze())
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = &str> {
        let mut rest = &self.0[..];
        std::iter::from_fn(move || {
            let len = prost::encoding::decode_varint(&mut rest).ok()? as usize;
            let (name, tail) = rest.split_at_checked(len)?;
            rest = tail;
            std::str::from_utf8(name).ok()
        })
    }
}

/// What the client holds.
enum ClientState {
    /// What it reported in its first request: kept only until the first
    /// response is built (the collection may not be delivered yet).
    Initial(ReportedNames),
    /// The first response is on its way and not answered. If the client
    /// reported names and NACKs it, its state cannot be known any more: the
    /// stream ends and the client starts again.
    AwaitingFirst { reported_names: bool },
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
                client: ClientState::Initial(ReportedNames::new(&request.initial_resource_versions)),
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
                if let ClientState::AwaitingFirst { reported_names: true } = subscribed.client {
                    self.publish();
                    return Err(Status::failed_precondition(
                        "the first response, built from initial_resource_versions, was NACKed: the gateway cannot \
                         know what this client holds; open a new stream to start again",
                    ));
                }
                if let ClientState::AwaitingFirst { reported_names: false } = subscribed.client {
                    // It still holds nothing.
                    subscribed.client = ClientState::Initial(ReportedNames::default());
                }
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
            ClientState::Initial(reported) if reported.is_empty() => snapshot.sotw_parts().clone(),
            ClientState::Initial(reported) => {
                // The whole collection (shared bytes), and removals for the
                // names the client reported that are gone. Versions alone
                // cannot show that a source reused one for another body, so
                // nothing is skipped on the client's word. The work grows
                // with what the client sent: one stream at a time.
                let _turn = self.shared.heavy_work().await;
                let mut removed: Vec<&str> = reported
                    .iter()
                    .filter(|name| !snapshot.resources.contains_key(*name))
                    .collect();
                removed.sort_unstable();
                removed.dedup();
                let mut parts = snapshot.sotw_parts().to_vec();
                parts.push(crate::wire::encode_body("", [], &removed));
                Arc::from(parts)
            }
            // Answered before anything else is sent (one outstanding response).
            ClientState::AwaitingFirst { .. } => return Ok(()),
        };
        if let ClientState::Initial(reported) = &s.client {
            s.client = ClientState::AwaitingFirst {
                reported_names: !reported.is_empty(),
            };
        }
        self.last_nonce += 1;
        let nonce = self.last_nonce.to_string();
        let response = EncodedResponse {
            shared: body,
            suffix: encode_suffix(None, &nonce),
            snapshot: Some(snapshot.clone()),
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
