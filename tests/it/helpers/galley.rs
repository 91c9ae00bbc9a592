//! A fake Galley: a real `ResourceSource` gRPC server on 127.0.0.1 that the
//! test drives step by step. It hands each stream to the test, logs every
//! request it receives, and can refuse collections or kill every stream.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mcp_xds_gateway::proto::resource_sink_client::ResourceSinkClient;
use mcp_xds_gateway::proto::resource_source_server::{ResourceSource, ResourceSourceServer};
use mcp_xds_gateway::proto::{Metadata, RequestResources, Resource, Resources};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{TcpListenerStream, UnboundedReceiverStream};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use super::within;

#[derive(Default)]
struct GalleyState {
    log: Mutex<Vec<RequestResources>>,
    refuse: Mutex<HashSet<String>>,
    kill_every_stream: AtomicBool,
    streams_opened: AtomicUsize,
    /// Every live stream's response sender, to kill them all at once.
    live: Mutex<Vec<mpsc::UnboundedSender<Result<Resources, Status>>>>,
}

pub struct FakeGalley {
    pub addr: SocketAddr,
    state: Arc<GalleyState>,
    streams: mpsc::UnboundedReceiver<GalleyStream>,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

/// One stream a gateway opened, as the test sees it.
pub struct GalleyStream {
    requests: mpsc::UnboundedReceiver<RequestResources>,
    /// Sends a message or a status as it is (no nonce added).
    pub responses: mpsc::UnboundedSender<Result<Resources, Status>>,
    next_nonce: u64,
}

struct Service {
    state: Arc<GalleyState>,
    streams: mpsc::UnboundedSender<GalleyStream>,
}

#[tonic::async_trait]
impl ResourceSource for Service {
    type EstablishResourceStreamStream = UnboundedReceiverStream<Result<Resources, Status>>;

    async fn establish_resource_stream(
        &self,
        request: Request<Streaming<RequestResources>>,
    ) -> Result<Response<Self::EstablishResourceStreamStream>, Status> {
        self.state.streams_opened.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::unbounded_channel();
        if self.state.kill_every_stream.load(Ordering::SeqCst) {
            // Accept, then kill at once.
            let _ = tx.send(Err(Status::unavailable("fake galley kills every stream")));
            return Ok(Response::new(UnboundedReceiverStream::new(rx)));
        }
        self.state.live.lock().unwrap().push(tx.clone());
        let (requests_tx, requests_rx) = mpsc::unbounded_channel();
        let state = self.state.clone();
        let killer = tx.clone();
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                state.log.lock().unwrap().push(request.clone());
                let refused =
                    request.response_nonce.is_empty() && state.refuse.lock().unwrap().contains(&request.collection);
                if refused {
                    // What Galley does (istio#13559): the whole stream ends.
                    let _ = killer.send(Err(Status::invalid_argument(format!(
                        "unsupported collection {:?}",
                        request.collection
                    ))));
                    return;
                }
                let _ = requests_tx.send(request);
            }
        });
        let _ = self.streams.send(GalleyStream {
            requests: requests_rx,
            responses: tx,
            next_nonce: 0,
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

impl FakeGalley {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Starts on a given address (a restarted Galley keeps its port).
    pub async fn start_on(addr: SocketAddr) -> Self {
        Self::start_with(addr, None).await
    }

    /// Serves TLS with tonic's own TLS (not the gateway's code).
    pub async fn start_tls(tls: ServerTlsConfig) -> Self {
        Self::start_with("127.0.0.1:0".parse().unwrap(), Some(tls)).await
    }

    async fn start_with(addr: SocketAddr, tls: Option<ServerTlsConfig>) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind the fake galley");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(GalleyState::default());
        let (streams_tx, streams) = mpsc::unbounded_channel();
        let service = ResourceSourceServer::new(Service {
            state: state.clone(),
            streams: streams_tx,
        })
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            builder = builder.tls_config(tls).expect("a valid TLS configuration");
        }
        let server = tokio::spawn(async move {
            builder
                .add_service(service)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown.cancelled_owned())
                .await
                .unwrap();
        });
        Self {
            addr,
            state,
            streams,
            stop,
            server,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next stream a gateway opens.
    pub async fn next_stream(&mut self) -> GalleyStream {
        within("the gateway to open a stream to galley", self.streams.recv())
            .await
            .expect("galley is running")
    }

    pub fn refuse(&self, collection: &str) {
        self.state.refuse.lock().unwrap().insert(collection.to_owned());
    }

    pub fn kill_every_stream(&self, on: bool) {
        self.state.kill_every_stream.store(on, Ordering::SeqCst);
    }

    pub fn streams_opened(&self) -> usize {
        self.state.streams_opened.load(Ordering::SeqCst)
    }

    /// Every request received on any stream, in order.
    pub fn log(&self) -> Vec<RequestResources> {
        self.state.log.lock().unwrap().clone()
    }

    /// Ends every live stream with `status`.
    pub fn kill_all(&self, status: Status) {
        for tx in self.state.live.lock().unwrap().drain(..) {
            let _ = tx.send(Err(status.clone()));
        }
    }

    /// Stops serving: live streams end and new connections are refused.
    pub async fn stop(self) -> SocketAddr {
        self.kill_all(Status::unavailable("galley is going down"));
        self.stop.cancel();
        self.server.abort();
        let _ = self.server.await;
        self.addr
    }
}

/// Galley's dial-out: a real `ResourceSink` client on `channel`, with gRPC
/// metadata as Galley's `--sinkMeta` sends it. The stream behaves like one a
/// gateway opened to the fake Galley; Err is the gateway's refusal.
pub async fn dial_out(channel: Channel, metadata: &[(&'static str, &str)]) -> Result<GalleyStream, Status> {
    let (responses, outbound) = mpsc::unbounded_channel::<Result<Resources, Status>>();
    let outbound = UnboundedReceiverStream::new(outbound).map_while(Result::ok);
    let mut request = Request::new(outbound);
    for (key, value) in metadata {
        request.metadata_mut().insert(*key, value.parse().unwrap());
    }
    let mut client = ResourceSinkClient::new(channel).max_decoding_message_size(usize::MAX);
    let mut inbound = within(
        "the gateway to answer a dial-out",
        client.establish_resource_stream(request),
    )
    .await?
    .into_inner();
    let (requests_tx, requests) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(request)) = inbound.message().await {
            if requests_tx.send(request).is_err() {
                return;
            }
        }
    });
    Ok(GalleyStream {
        requests,
        responses,
        next_nonce: 0,
    })
}

impl GalleyStream {
    pub async fn next_request(&mut self) -> RequestResources {
        within("a request from the gateway", self.requests.recv())
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

    /// Sends a message as is and returns the gateway's reply to it.
    pub async fn send(&mut self, mut message: Resources) -> RequestResources {
        self.next_nonce += 1;
        message.nonce = format!("n{}", self.next_nonce);
        let nonce = message.nonce.clone();
        self.responses.send(Ok(message)).expect("the stream is open");
        loop {
            let reply = self.next_request().await;
            if reply.response_nonce == nonce {
                return reply;
            }
            assert!(
                reply.response_nonce.is_empty(),
                "a reply to another nonce while waiting for {nonce}: {reply:?}"
            );
        }
    }

    /// Pushes a full state and asserts it was ACKed.
    pub async fn push_full(&mut self, collection: &str, resources: Vec<Resource>) -> RequestResources {
        let reply = self.send(full(collection, resources)).await;
        assert!(reply.error_detail.is_none(), "expected an ACK, got {reply:?}");
        reply
    }

    pub fn kill(&self, status: Status) {
        let _ = self.responses.send(Err(status));
    }
}

pub fn full(collection: &str, resources: Vec<Resource>) -> Resources {
    Resources {
        collection: collection.to_owned(),
        resources,
        system_version_info: "galley-1".into(),
        ..Default::default()
    }
}

pub fn incremental(collection: &str, resources: Vec<Resource>, removed: &[&str]) -> Resources {
    Resources {
        collection: collection.to_owned(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        incremental: true,
        ..Default::default()
    }
}

/// A resource with a body of the collection's usual type URL.
pub fn resource(name: &str, version: &str, body: &[u8]) -> Resource {
    Resource {
        metadata: Some(Metadata {
            name: name.to_owned(),
            version: version.to_owned(),
            ..Default::default()
        }),
        body: Some(prost_types::Any {
            type_url: super::VS_TYPE_URL.to_owned(),
            value: body.to_vec(),
        }),
    }
}
