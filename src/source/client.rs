//! Client mode: dial Galley's `ResourceSource`, run one sink session per
//! stream, and reconnect with backoff. While disconnected, the cache keeps
//! serving the last applied state.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::backoff::{Backoff, BackoffPolicy};
use super::overdue::expire_overdue;
use super::probe::Probe;
use super::stream::{self, Failure, StreamEnd};
use super::{SinkContext, UpstreamStatus};
use crate::cache::provenance::{parse_chain, ChainError, CHAIN_HEADER, GATEWAY_ID_ANNOTATION};
use crate::cache::CacheWriter;
use crate::metrics as m;
use crate::proto::{SinkNode, RESOURCE_SOURCE_PATH};
use crate::transport::call;
use crate::transport::connect::{self, Dial};
use crate::transport::requests::RequestBudget;
use crate::transport::tls::ClientTlsFiles;

/// Everything client mode needs, decided at start-up.
#[derive(Clone, Debug)]
pub struct ClientSettings {
    pub address: String,
    pub node: SinkNode,
    pub incremental: bool,
    pub max_message_bytes: usize,
    /// HTTP/2 keepalive ping interval; `None` turns pings off.
    pub keepalive: Option<Duration>,
    pub backoff: BackoffPolicy,
    /// Set for an `https://` upstream.
    pub tls: Option<ClientTlsFiles>,
    /// TCP, TLS and the HTTP/2 handshake together (`--connect-timeout`).
    pub connect_timeout: Duration,
    /// The most gateways in a chain, this one included (`--max-chain-depth`).
    pub max_chain_depth: usize,
}

impl ClientSettings {
    /// How to reach the upstream: the main stream and the probe alike.
    pub fn dial(&self) -> Dial {
        Dial {
            address: self.address.clone(),
            tls: self.tls.clone(),
            timeout: self.connect_timeout,
            keepalive: self.keepalive,
            caller: crate::transport::dial_why::Caller::Upstream,
        }
    }
}

pub struct UpstreamClient {
    settings: ClientSettings,
    sink: SinkContext,
    status: watch::Sender<UpstreamStatus>,
    /// The cache's one writer: this client is the source.
    writer: CacheWriter,
}

// === impl UpstreamClient ===

impl UpstreamClient {
    /// The client announces the gateway's id in its sink node, so that a
    /// gateway upstream refuses to serve it if that would close a loop.
    pub fn new(
        settings: ClientSettings,
        mut sink: SinkContext,
        status: watch::Sender<UpstreamStatus>,
        writer: CacheWriter,
    ) -> Self {
        status.send_modify(|s| {
            s.mode = "client";
            s.address = settings.address.clone();
            s.since = Some(SystemTime::now());
        });
        sink.node.annotations.insert(
            GATEWAY_ID_ANNOTATION.to_owned(),
            writer.cache().provenance().gateway_id.to_string(),
        );
        Self {
            settings,
            sink,
            status,
            writer,
        }
    }

    /// Runs until `shutdown`: the main stream, and beside it the probe that
    /// asks first for collections only clients asked for, and the deadline
    /// of those demands (`--demand-timeout`).
    pub async fn run(self, shutdown: CancellationToken) {
        let probe = Probe {
            dial: self.settings.dial(),
            node: self.sink.node.clone(),
            max_message_bytes: self.settings.max_message_bytes,
            backoff: self.settings.backoff,
            subscriptions: self.sink.subscriptions.clone(),
            status: self.status.clone(),
        };
        let overdue = expire_overdue(
            self.sink.subscriptions.clone(),
            self.writer.cache().clone(),
            self.status.subscribe(),
            self.settings.address.clone(),
            shutdown.clone(),
        );
        tokio::join!(self.run_main(shutdown.clone()), probe.run(shutdown.clone()), overdue);
    }

    /// The main stream: one at a time, reconnecting with backoff that resets
    /// only after a stream made progress: every subscribed collection applied
    /// on it at least once, and an end that a retry could avoid (a message
    /// over --max-message-bytes comes again).
    async fn run_main(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(self.settings.backoff);
        loop {
            self.status.send_modify(|s| {
                s.attempts += 1;
                s.next_retry_in = None;
            });
            metrics::counter!(m::UPSTREAM_CONNECT_ATTEMPTS).increment(1);
            let mut progress = false;
            let end = self.run_stream(&shutdown, &mut progress).await;
            self.set_connected(false);
            let delivered = progress
                && !matches!(
                    end,
                    StreamEnd::Failed {
                        reason: Failure::MessageTooLarge,
                        ..
                    }
                );
            if delivered {
                backoff.reset();
            }
            if matches!(end, StreamEnd::Shutdown) {
                return;
            }
            end.count();
            let message = match end {
                StreamEnd::Shutdown => return,
                StreamEnd::Refused { collection, message } => {
                    if super::refuse(&self.sink.subscriptions, &collection, &message) {
                        tracing::warn!(
                            %collection,
                            %message,
                            "the source does not serve this collection: dropped from the subscription, \
                             reconnecting with the rest"
                        );
                    }
                    message
                }
                StreamEnd::Failed { reason, message } => {
                    let reason = reason.as_str();
                    tracing::warn!(address = %self.settings.address, %reason, %message, "upstream stream ended");
                    message
                }
            };
            let delay = backoff.next_delay();
            self.status.send_modify(|s| {
                s.last_error = Some(message);
                s.consecutive_failures = if delivered { 1 } else { s.consecutive_failures + 1 };
                s.next_retry_in = Some(delay);
            });
            tracing::info!(retry_in_seconds = delay.as_secs_f64(), "reconnecting to upstream");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    fn set_connected(&self, connected: bool) {
        self.status.send_if_modified(|s| {
            if s.connected == connected {
                return false;
            }
            // A stream established again after one before it: what Istio's
            // reconnections counted (attempts have their own counter).
            if connected && s.connections > 0 {
                metrics::counter!(m::RECONNECTIONS, "component" => m::COMPONENT_UPSTREAM).increment(1);
            }
            s.connections += u64::from(connected);
            s.connected = connected;
            s.since = Some(SystemTime::now());
            true
        });
    }

    async fn run_stream(&mut self, shutdown: &CancellationToken, progress: &mut bool) -> StreamEnd {
        let dial = self.settings.dial();
        let channel = tokio::select! {
            connected = connect::connect(&dial) => match connected {
                Ok(channel) => channel,
                Err(e) => {
                    stream::send_failed("Unavailable");
                    return StreamEnd::Failed {
                        reason: Failure::Connect,
                        message: e.message,
                    };
                }
            },
            _ = shutdown.cancelled() => return StreamEnd::Shutdown,
        };
        // Connected: the HTTP/2 handshake is complete.
        self.set_connected(true);
        let (mut opened, rx) = self.sink.open(&self.writer);
        opened.request_collections();
        // Each message the source sends is read into a buffer of its own
        // size, freed once it is applied: a big collection is not held a
        // second time while the stream lives.
        let budget = RequestBudget::for_source(self.settings.max_message_bytes, true);
        let response = tokio::select! {
            response = call::bidi(channel, RESOURCE_SOURCE_PATH, rx, budget, "Resources") => response,
            _ = shutdown.cancelled() => return StreamEnd::Shutdown,
        };
        let (headers, mut inbound) = match response {
            Ok(response) => response,
            Err(status) => {
                stream::send_failed(m::code_number(status.code() as i32));
                return stream::classify(status, self.settings.max_message_bytes);
            }
        };
        // Another gateway announces itself and its own upstreams; Galley
        // announces nothing.
        let chain = headers
            .get(CHAIN_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(parse_chain)
            .unwrap_or_default();
        if let Err(refused) = self
            .writer
            .cache()
            .provenance()
            .check_upstream(&chain, self.settings.max_chain_depth)
        {
            return StreamEnd::Failed {
                reason: match refused {
                    ChainError::Loop { .. } => Failure::Loop,
                    ChainError::TooLong { .. } => Failure::ChainTooLong,
                },
                message: refused.to_string(),
            };
        }
        // An upstream gateway says which collections it serves as
        // sensitive: one this gateway would serve (and show) as not is
        // taken from it by no one until the operator marks it so.
        // A header that does not read as a gateway writes it names no one
        // can tell what: nothing is taken from that upstream.
        let Some(sensitive) = headers
            .get_all(crate::collections::SENSITIVE_HEADER)
            .iter()
            .map(|v| v.to_str().ok().and_then(crate::collections::from_sensitive_header))
            .collect::<Option<Vec<_>>>()
            .map(|lists| lists.concat())
        else {
            return StreamEnd::Failed {
                reason: Failure::SensitiveElsewhere,
                message: format!(
                    "the upstream's {} header does not read as a gateway writes it: which of its collections are \
                     sensitive cannot be told, so nothing is taken from it",
                    crate::collections::SENSITIVE_HEADER
                ),
            };
        };
        let open = opened.session.served_open(&sensitive);
        if !open.is_empty() {
            let shown: Vec<String> = open
                .iter()
                .map(|c| crate::transport::safe_text::terminal_safe(c).into_owned())
                .collect();
            return StreamEnd::Failed {
                reason: Failure::SensitiveElsewhere,
                message: format!(
                    "the upstream gateway serves {} as sensitive (its --type-map marks it sensitive: true) and this \
                     gateway's --type-map does not: its secrets would be served to every client and shown in every \
                     view; mark it sensitive: true here to take config from this upstream",
                    shown.join(", ")
                ),
            };
        }
        if !chain.is_empty() {
            tracing::info!(chain = %crate::transport::safe_text::terminal_safe(&chain.join(" <- ")), "the upstream is a gateway");
        }
        self.writer.set_upstream_chain(chain);
        tracing::info!(address = %self.settings.address, "upstream stream established");
        opened.run(&mut self.writer, &mut inbound, shutdown, progress).await
    }
}
