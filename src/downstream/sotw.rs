//! One `StreamAggregatedResources` stream: many types, each with its own nonce
//! state and at most one outstanding response. Changes that arrive while a
//! response is outstanding coalesce (the cache's watch keeps only the latest);
//! the matching ACK or NACK re-arms the type. One task writes the stream.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio_stream::wrappers::WatchStream;
use tokio_stream::{StreamExt, StreamMap};
use tonic::Status;

use super::registry::{Protocol, RegistryEntry, TypeView};
use super::{record_ack, record_nack, record_stale, ClientGone, Downstream, Outbound, StreamLogs, StreamProtocol};
use crate::cache::CollectionSnapshot;
use crate::metrics::CollectionMetrics;
use crate::wire::{encode_suffix, EncodedResponse, SotwRequest};

type SnapshotWatch = WatchStream<Option<Arc<CollectionSnapshot>>>;

struct SotwType {
    view: TypeView,
    metrics: Arc<CollectionMetrics>,
    /// `version_info` of the last accepted request: what the client holds.
    client_version: String,
}

pub(super) struct SotwStream {
    shared: Downstream,
    entry: RegistryEntry,
    id: u64,
    /// By the `type_url` the client sent.
    types: HashMap<String, SotwType>,
    changes: StreamMap<String, SnapshotWatch>,
    /// Per stream, decimal, as Istio's server did.
    last_nonce: u64,
    logs: StreamLogs,
}

// === impl SotwStream ===

impl StreamProtocol for SotwStream {
    type Request = SotwRequest;
    type Change = String;

    fn new(shared: Downstream, id: u64, peer: Option<SocketAddr>) -> Self {
        let entry = shared.inner.registry.register(id, peer, Protocol::Sotw);
        Self {
            shared,
            entry,
            id,
            types: HashMap::new(),
            changes: StreamMap::new(),
            last_nonce: 0,
            logs: StreamLogs::default(),
        }
    }

    fn id(&self) -> u64 {
        self.id
    }

    async fn next_change(&mut self) -> String {
        match self.changes.next().await {
            Some((type_url, _)) => type_url,
            // No type followed yet.
            None => std::future::pending().await,
        }
    }

    async fn on_change(&mut self, type_url: String, out: &Outbound) -> Result<(), ClientGone> {
        self.try_send(&type_url, out).await
    }

    async fn on_request(&mut self, request: SotwRequest, out: &Outbound) -> Result<Result<(), ClientGone>, Status> {
        let resolved = self.shared.resolve(&request.type_url)?;
        if let Some(node) = &request.node {
            self.entry.set_node_id(&node.id);
        }
        let type_url = request.type_url;
        if !self.types.contains_key(&type_url) {
            self.shared.check_type_count(self.types.len())?;
            self.shared.follow(&resolved.collection);
            let changes = self.shared.inner.cache.subscribe(&resolved.collection);
            self.changes
                .insert(type_url.clone(), WatchStream::from_changes(changes));
            let metrics = self.shared.inner.cache.metrics(&resolved.collection);
            self.types.insert(
                type_url.clone(),
                SotwType {
                    metrics,
                    view: TypeView::new(resolved),
                    client_version: String::new(),
                },
            );
        }
        let state = self.types.get_mut(&type_url).expect("inserted above");
        let collection = state.view.collection.clone();
        match &state.view.last_sent_nonce {
            // Nothing sent for this type yet: every request is accepted. Its
            // version is what the client holds (a reconnecting client).
            None => {
                if !request.version_info.is_empty() {
                    state.view.acked_version = Some(Arc::from(request.version_info.as_str()));
                }
            }
            Some(nonce) if *nonce == request.response_nonce => {
                state.view.outstanding = false;
                match request.error_detail {
                    Some(error) => {
                        let version = state.view.last_sent_version.clone().unwrap_or_else(|| Arc::from(""));
                        state.view.last_nack = Some(record_nack(
                            self.id,
                            &mut self.logs,
                            &type_url,
                            &collection,
                            version,
                            error,
                            &state.metrics,
                            self.shared.limits().max_nack_message_bytes,
                        ));
                    }
                    None => {
                        record_ack(&state.metrics);
                        state.view.acked_version = Some(Arc::from(request.version_info.as_str()));
                    }
                }
            }
            Some(nonce) => {
                record_stale(
                    self.id,
                    &mut self.logs,
                    &state.metrics,
                    &type_url,
                    nonce,
                    &request.response_nonce,
                );
                return Ok(Ok(()));
            }
        }
        state.client_version = request.version_info;
        self.entry.publish(&type_url, state.view.clone());
        Ok(self.try_send(&type_url, out).await)
    }
}

impl SotwStream {
    /// Sends the type's current version if the client may take one and does
    /// not hold it yet.
    async fn try_send(&mut self, type_url: &str, out: &Outbound) -> Result<(), ClientGone> {
        let Some(state) = self.types.get_mut(type_url) else {
            return Ok(());
        };
        if state.view.outstanding {
            return Ok(());
        }
        // Not delivered by upstream yet: nothing is invented.
        let Some(snapshot) = self.shared.inner.cache.get(&state.view.collection) else {
            return Ok(());
        };
        if *snapshot.version == state.client_version {
            return Ok(());
        }
        if state
            .view
            .last_nack
            .as_ref()
            .is_some_and(|nack| nack.version == snapshot.version)
        {
            return Ok(());
        }
        self.last_nonce += 1;
        let nonce = self.last_nonce.to_string();
        let response = EncodedResponse {
            shared: snapshot.sotw_parts().clone(),
            suffix: encode_suffix(Some(type_url), &nonce),
            snapshot: Some(snapshot.clone()),
        };
        state.view.outstanding = true;
        state.view.last_sent_nonce = Some(nonce);
        state.view.last_sent_version = Some(snapshot.version.clone());
        self.entry.publish(type_url, state.view.clone());
        snapshot.metrics.pushes.increment(1);
        let shutdown = self.shared.inner.shutdown.clone();
        tokio::select! {
            sent = out.send(Ok(Box::new(response))) => sent.map_err(|_| ClientGone),
            // A client that stopped reading must not hold up shutdown.
            _ = shutdown.cancelled() => Ok(()),
        }
    }
}
