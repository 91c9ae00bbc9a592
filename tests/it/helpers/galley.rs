//! The fake Galley of `mcp_xds_gateway::tools::galley` (the one `mcp-load`
//! uses too), with every wait bounded by `within` and every failure a test
//! failure.

use std::net::SocketAddr;

use mcp_xds_gateway::proto::{RequestResources, Resource, Resources};
use mcp_xds_gateway::tools::galley::{self as fake, Opening};
use tonic::transport::{Channel, ServerTlsConfig};
use tonic::Status;

pub use fake::{full, incremental};

use super::within;

pub struct FakeGalley {
    pub addr: SocketAddr,
    inner: fake::FakeGalley,
}

/// One stream a gateway opened (or a dial-out opened to a gateway).
pub struct GalleyStream {
    inner: fake::GalleyStream,
    /// Sends a message or a status as it is (no nonce added).
    pub responses: tokio::sync::mpsc::UnboundedSender<Result<Resources, Status>>,
}

impl FakeGalley {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Starts on a given address (a restarted Galley keeps its port).
    pub async fn start_on(addr: SocketAddr) -> Self {
        Self::wrap(fake::FakeGalley::start(addr).await)
    }

    /// Serves TLS with tonic's own TLS (not the gateway's code).
    pub async fn start_tls(tls: ServerTlsConfig) -> Self {
        let addr = "127.0.0.1:0".parse().unwrap();
        Self::wrap(
            fake::FakeGalley::start_with(addr, move |server| {
                server.tls_config(tls).expect("a valid TLS configuration")
            })
            .await,
        )
    }

    fn wrap(started: std::io::Result<fake::FakeGalley>) -> Self {
        let inner = started.expect("bind the fake galley");
        Self {
            addr: inner.addr,
            inner,
        }
    }

    pub fn url(&self) -> String {
        self.inner.url()
    }

    /// The next stream a gateway opens.
    pub async fn next_stream(&mut self) -> GalleyStream {
        let inner = within("the gateway to open a stream to galley", self.inner.next_stream())
            .await
            .expect("galley is running");
        GalleyStream::wrap(inner)
    }

    /// Ends any stream that asks for `collection` (Galley 1.1 to 1.7).
    pub fn refuse(&self, collection: &str) {
        self.inner.refuse(collection);
    }

    /// Ends any stream asking for `collection` without naming it.
    pub fn refuse_unnamed(&self, collection: &str) {
        self.inner.refuse_unnamed(collection);
    }

    /// Opens every later stream with the response header `name: value`.
    pub fn send_header(&self, name: &'static str, value: &str) {
        self.inner.send_header(name, value);
    }

    /// Never answers `collection`: a source that neither serves nor refuses it.
    pub fn ignore(&self, collection: &str) {
        self.inner.ignore(collection);
    }

    /// Answers every stream's request for `collection` with this full state
    /// (the driver never sees those requests or their ACKs).
    pub fn publish(&self, collection: &str, resources: Vec<Resource>) {
        self.inner.publish(collection, resources);
    }

    /// Every stream served so far, in the order opened.
    pub fn streams(&self) -> Vec<fake::StreamInfo> {
        self.inner.streams()
    }

    pub fn kill_every_stream(&self, on: bool) {
        self.inner.kill_every_stream(on);
    }

    pub fn streams_opened(&self) -> usize {
        self.inner.streams_opened()
    }

    /// Every request received on any stream, in order.
    pub fn log(&self) -> Vec<RequestResources> {
        self.inner.log()
    }

    /// Stops serving: live streams end and new connections are refused.
    pub async fn stop(self) -> SocketAddr {
        self.inner.stop().await
    }
}

/// Galley's dial-out as 1.2 on opens it (the `$triggerCollection` trigger,
/// whose answer must be the NACK Galley 1.1 required), with gRPC metadata as
/// Galley's `--sinkMeta` sends it. Err is the gateway's refusal.
pub async fn dial_out(channel: Channel, metadata: &[(&'static str, &str)]) -> Result<GalleyStream, Status> {
    let (stream, answer) = dial_out_as(channel, metadata, Opening::Trigger).await?;
    let answer = answer.expect("a trigger is answered");
    let code = answer.error_detail.as_ref().map(|e| e.code);
    assert_eq!(
        code,
        Some(tonic::Code::Unimplemented as i32),
        "the trigger is NACKed with UNIMPLEMENTED: {answer:?}"
    );
    Ok(stream)
}

/// A dial-out opened as `opening` says: the stream and the trigger's answer.
pub async fn dial_out_as(
    channel: Channel,
    metadata: &[(&'static str, &str)],
    opening: Opening,
) -> Result<(GalleyStream, Option<RequestResources>), Status> {
    let (inner, answer) = within(
        "the gateway to answer a dial-out",
        fake::dial_out(channel, metadata, opening),
    )
    .await?;
    Ok((GalleyStream::wrap(inner), answer))
}

impl GalleyStream {
    fn wrap(inner: fake::GalleyStream) -> Self {
        let responses = inner.responses.clone();
        Self { inner, responses }
    }

    /// A request the gateway already sent, if any, without waiting.
    pub fn try_next_request(&mut self) -> Option<RequestResources> {
        self.inner.try_next_request()
    }

    pub async fn next_request(&mut self) -> RequestResources {
        within("a request from the gateway", self.inner.next_request())
            .await
            .expect("the gateway's stream is open")
    }

    /// The first request of each of `n` collections, sorted by collection.
    pub async fn initial_requests(&mut self, n: usize) -> Vec<RequestResources> {
        let mut requests = Vec::new();
        for _ in 0..n {
            let request = self.next_request().await;
            assert!(
                request.response_nonce.is_empty(),
                "expected an initial request, got {request:?}"
            );
            requests.push(request);
        }
        requests.sort_by(|a, b| a.collection.cmp(&b.collection));
        requests
    }

    /// Sends a message (with the next nonce) and returns the gateway's reply to it.
    pub async fn send(&mut self, message: Resources) -> RequestResources {
        let nonce = self.inner.send(message).expect("the stream is open");
        match within(&format!("the reply to {nonce}"), self.inner.reply_to(&nonce)).await {
            Some(Ok(reply)) => reply,
            Some(Err(other)) => panic!("a reply to another nonce while waiting for {nonce}: {other:?}"),
            None => panic!("the gateway's stream ended while waiting for the reply to {nonce}"),
        }
    }

    /// Sends a message without waiting for a reply (one the gateway may
    /// refuse by ending the stream).
    pub fn send_only(&mut self, message: Resources) {
        self.inner.send(message).expect("the stream is open");
    }

    /// Pushes a full state and asserts it was ACKed.
    pub async fn push_full(&mut self, collection: &str, resources: Vec<Resource>) -> RequestResources {
        let reply = self.send(full(collection, resources)).await;
        assert!(reply.error_detail.is_none(), "expected an ACK, got {reply:?}");
        reply
    }

    pub fn kill(&self, status: Status) {
        self.inner.kill(status);
    }
}

/// A resource with a body of the collection's usual type URL.
pub fn resource(name: &str, version: &str, body: &[u8]) -> Resource {
    fake::resource(name, version, super::VS_TYPE_URL, body)
}
