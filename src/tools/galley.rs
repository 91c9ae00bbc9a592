//! A fake Galley, shared by the integration tests and `mcp-load`: a real
//! `ResourceSource` gRPC server that hands each stream a gateway opens to its
//! driver, logs every request, and can refuse collections (ending the stream
//! as Galley 1.1 to 1.7 do, istio#13559), ignore them (never answering, as a
//! source that neither serves nor refuses), publish them (answering every
//! stream's request itself) or kill every stream; and Galley's dial-out, a
//! real `ResourceSink` client with each release's opening handshake.
//!
//! Nothing here waits with a timeout: the driver (a test's `within`, the load
//! tool's own deadlines) decides how long to wait.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

use crate::proto::resource_sink_client::ResourceSinkClient;
use crate::proto::resource_source_server::{ResourceSource, ResourceSourceServer};
use crate::proto::{Metadata, RequestResources, Resource, Resources};

type Sent = Result<Resources, Status>;

#[derive(Default)]
struct State {
    log: Mutex<Vec<RequestResources>>,
    refuse: Mutex<HashSet<String>>,
    /// Refused without naming the collection.
    refuse_unnamed: Mutex<HashSet<String>>,
    /// Asked for, never answered, never handed to the driver.
    ignore: Mutex<HashSet<String>>,
    /// Answered by the fake itself, on every stream that asks.
    published: Mutex<HashMap<String, Vec<Resource>>>,
    /// Nonces of the fake's own answers (`auto-N`).
    next_auto_nonce: AtomicU64,
    kill_every_stream: AtomicBool,
    streams_opened: AtomicUsize,
    /// Every live stream's sender, to kill them all at once.
    live: Mutex<Vec<mpsc::UnboundedSender<Sent>>>,
    /// Every stream served (not those killed at once), in the order opened.
    records: Mutex<Vec<Record>>,
    /// Response headers every stream is opened with (as a gateway upstream
    /// sends its own).
    headers: Mutex<Vec<(&'static str, String)>>,
}

/// One stream as the fake saw it.
struct Record {
    asked: Vec<String>,
    ended: Option<String>,
    /// Collections asked for and ignored: answered if published later.
    ignored: HashSet<String>,
    responses: mpsc::UnboundedSender<Sent>,
}

/// One stream as the fake saw it, for tests to check which stream carried
/// what and whether it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamInfo {
    /// The collection of every initial request, in order.
    pub asked: Vec<String>,
    /// How it ended; `None` while it is open.
    pub ended: Option<String>,
}

const AUTO_NONCE: &str = "auto-";

impl State {
    fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fake's own answer for `collection`, if it publishes it.
    fn published(&self, collection: &str) -> Option<Resources> {
        let resources = Self::lock(&self.published).get(collection)?.clone();
        let n = self.next_auto_nonce.fetch_add(1, Ordering::SeqCst) + 1;
        Some(Resources {
            nonce: format!("{AUTO_NONCE}{n}"),
            ..full(collection, resources)
        })
    }

    /// What to do with a request of stream `index`: `Some` hands it to the
    /// driver; `Err` ends the stream with a status.
    fn on_request(&self, index: usize, request: RequestResources) -> Result<Option<RequestResources>, Status> {
        Self::lock(&self.log).push(request.clone());
        if !request.response_nonce.is_empty() {
            // The replies to the fake's own answers are its own.
            return Ok((!request.response_nonce.starts_with(AUTO_NONCE)).then_some(request));
        }
        let collection = &request.collection;
        let mut records = Self::lock(&self.records);
        let record = &mut records[index];
        record.asked.push(collection.clone());
        if Self::lock(&self.refuse).contains(collection) {
            // What Galley does (istio#13559): the whole stream ends.
            let status = Status::invalid_argument(format!("unsupported collection {collection:?}"));
            record.ended = Some(status.message().to_owned());
            return Err(status);
        }
        if Self::lock(&self.refuse_unnamed).contains(collection) {
            // A source of another make: the stream ends, naming nothing.
            let status = Status::invalid_argument("bad request");
            record.ended = Some(status.message().to_owned());
            return Err(status);
        }
        if Self::lock(&self.ignore).contains(collection) {
            record.ignored.insert(collection.clone());
            return Ok(None);
        }
        if let Some(answer) = self.published(collection) {
            let _ = record.responses.send(Ok(answer));
            return Ok(None);
        }
        Ok(Some(request))
    }
}

/// A running fake Galley.
pub struct FakeGalley {
    pub addr: SocketAddr,
    state: Arc<State>,
    streams: mpsc::UnboundedReceiver<GalleyStream>,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

/// One stream between a gateway and the fake Galley, as its driver sees it:
/// the gateway's requests in, `Resources` (or an ending status) out.
pub struct GalleyStream {
    requests: mpsc::UnboundedReceiver<RequestResources>,
    /// Sends a message or a status as it is (no nonce added).
    pub responses: mpsc::UnboundedSender<Sent>,
    next_nonce: u64,
}

struct Service {
    state: Arc<State>,
    streams: mpsc::UnboundedSender<GalleyStream>,
}

#[tonic::async_trait]
impl ResourceSource for Service {
    type EstablishResourceStreamStream = UnboundedReceiverStream<Sent>;

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
        State::lock(&self.state.live).push(tx.clone());
        let index = {
            let mut records = State::lock(&self.state.records);
            records.push(Record {
                asked: Vec::new(),
                ended: None,
                ignored: HashSet::new(),
                responses: tx.clone(),
            });
            records.len() - 1
        };
        let (requests_tx, requests_rx) = mpsc::unbounded_channel();
        let state = self.state.clone();
        let killer = tx.clone();
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            loop {
                let request = match inbound.message().await {
                    Ok(Some(request)) => request,
                    Ok(None) => break,
                    Err(status) => {
                        State::lock(&state.records)[index].ended = Some(format!("{:?}", status.code()));
                        return;
                    }
                };
                match state.on_request(index, request) {
                    Ok(Some(request)) => {
                        if requests_tx.send(request).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(status) => {
                        let _ = killer.send(Err(status));
                        return;
                    }
                }
            }
            State::lock(&state.records)[index].ended = Some("closed by the gateway".into());
        });
        let _ = self.streams.send(GalleyStream {
            requests: requests_rx,
            responses: tx,
            next_nonce: 0,
        });
        let mut response = Response::new(UnboundedReceiverStream::new(rx));
        for (name, value) in State::lock(&self.state.headers).iter() {
            let value = value
                .parse()
                .map_err(|_| Status::internal(format!("fake galley: {name}: not a header value")))?;
            response.metadata_mut().append(*name, value);
        }
        Ok(response)
    }
}

// === impl FakeGalley ===

impl FakeGalley {
    /// Serves plain HTTP/2 on `addr` (port 0 picks one).
    pub async fn start(addr: SocketAddr) -> std::io::Result<Self> {
        Self::start_with(addr, |server| server).await
    }

    /// Serves on `addr` with a server `configure` sets up (TLS, for one).
    pub async fn start_with(
        addr: SocketAddr,
        configure: impl FnOnce(Server) -> Server + Send + 'static,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let (streams_tx, streams) = mpsc::unbounded_channel();
        let service = ResourceSourceServer::new(Service {
            state: state.clone(),
            streams: streams_tx,
        })
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        let builder = configure(Server::builder());
        // Nagle's algorithm off, as on Galley's connections (Go sets
        // `TCP_NODELAY` on every one): tonic sets it only on listeners it
        // binds itself. With Nagle on, the last segment of an update waited
        // for the gateway's delayed ACK, and `mcp-load` counted 40 ms of
        // every update's latency that no real source adds (the median ACK
        // round trip of an update: 43.6 ms, 2.2 ms with Nagle off).
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = tokio::spawn(async move {
            let mut builder = builder;
            if let Err(e) = builder
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
                .await
            {
                tracing::error!(error = %e, "the fake galley failed");
            }
        });
        Ok(Self {
            addr,
            state,
            streams,
            stop,
            server,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next stream a gateway opens; `None` once stopped.
    pub async fn next_stream(&mut self) -> Option<GalleyStream> {
        self.streams.recv().await
    }

    /// Ends any stream that asks for `collection`, as Galley does for one it
    /// does not serve.
    pub fn refuse(&self, collection: &str) {
        State::lock(&self.state.refuse).insert(collection.to_owned());
    }

    /// Ends any stream that asks for `collection` with `INVALID_ARGUMENT`
    /// "bad request": a source that refuses it without saying which.
    pub fn refuse_unnamed(&self, collection: &str) {
        State::lock(&self.state.refuse_unnamed).insert(collection.to_owned());
    }

    /// Opens every later stream with the response header `name: value`
    /// (once per call: a header given twice is sent as two lines).
    pub fn send_header(&self, name: &'static str, value: &str) {
        State::lock(&self.state.headers).push((name, value.to_owned()));
    }

    /// Never answers a collection any stream asks for, and never hands its
    /// request to the driver: a source that neither serves nor refuses it.
    pub fn ignore(&self, collection: &str) {
        State::lock(&self.state.ignore).insert(collection.to_owned());
    }

    /// Answers every request for `collection` with this full state, on every
    /// stream, without the driver (whose stream never sees these requests
    /// nor their ACKs); a stream that asked for it while it was ignored is
    /// answered now: the source starts serving it.
    pub fn publish(&self, collection: &str, resources: Vec<Resource>) {
        State::lock(&self.state.ignore).remove(collection);
        State::lock(&self.state.published).insert(collection.to_owned(), resources);
        for record in State::lock(&self.state.records).iter_mut() {
            if record.ended.is_none() && record.ignored.remove(collection) {
                if let Some(answer) = self.state.published(collection) {
                    let _ = record.responses.send(Ok(answer));
                }
            }
        }
    }

    /// Every stream served so far, in the order opened (streams killed at
    /// once by [`Self::kill_every_stream`] are only counted).
    pub fn streams(&self) -> Vec<StreamInfo> {
        State::lock(&self.state.records)
            .iter()
            .map(|r| StreamInfo {
                asked: r.asked.clone(),
                ended: r.ended.clone(),
            })
            .collect()
    }

    /// Accepts every new stream and kills it at once.
    pub fn kill_every_stream(&self, on: bool) {
        self.state.kill_every_stream.store(on, Ordering::SeqCst);
    }

    pub fn streams_opened(&self) -> usize {
        self.state.streams_opened.load(Ordering::SeqCst)
    }

    /// Every request received on any stream, in order.
    pub fn log(&self) -> Vec<RequestResources> {
        State::lock(&self.state.log).clone()
    }

    /// Ends every live stream with `status`.
    pub fn kill_all(&self, status: Status) {
        for tx in State::lock(&self.state.live).drain(..) {
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

/// How a dial-out source opens its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opening {
    /// Galley 1.1: `Resources{collection: ""}`, and exactly one message read
    /// back, which must be a NACK with `UNIMPLEMENTED`.
    TriggerV11,
    /// Galley 1.2 on: `Resources{collection: "$triggerCollection"}`; the
    /// answer is read and ignored.
    Trigger,
    /// Sends nothing until asked.
    Silent,
}

/// Galley's dial-out: a real `ResourceSink` client on `channel`, with gRPC
/// metadata as Galley's `--sinkMeta` sends it, opening as `opening` says.
/// Returns the stream and the answer to the trigger (if one was sent); `Err`
/// is the gateway's refusal, or a 1.1 trigger not answered as Galley 1.1
/// requires.
pub async fn dial_out(
    channel: Channel,
    metadata: &[(&'static str, &str)],
    opening: Opening,
) -> Result<(GalleyStream, Option<RequestResources>), Status> {
    let (responses, outbound) = mpsc::unbounded_channel::<Sent>();
    let outbound = UnboundedReceiverStream::new(outbound).map_while(Result::ok);
    let mut request = Request::new(outbound);
    for (key, value) in metadata {
        let value = value
            .parse()
            .map_err(|_| Status::invalid_argument(format!("metadata {key}: not a header value")))?;
        request.metadata_mut().insert(*key, value);
    }
    let trigger = match opening {
        Opening::TriggerV11 => Some(""),
        Opening::Trigger => Some(crate::source::session::TRIGGER_COLLECTION),
        Opening::Silent => None,
    };
    if let Some(collection) = trigger {
        let _ = responses.send(Ok(Resources {
            collection: collection.to_owned(),
            ..Default::default()
        }));
    }
    let mut client = ResourceSinkClient::new(channel).max_decoding_message_size(usize::MAX);
    let mut inbound = client.establish_resource_stream(request).await?.into_inner();
    let answer = match trigger {
        Some(_) => {
            let answer = inbound
                .message()
                .await?
                .ok_or_else(|| Status::unavailable("the sink closed the stream before answering the trigger"))?;
            if opening == Opening::TriggerV11 {
                // Galley 1.1's own check (client_source.go, sendDummyResponse).
                match &answer.error_detail {
                    None => return Err(Status::internal("server should have nacked, did not get an error")),
                    Some(e) if e.code != tonic::Code::Unimplemented as i32 => {
                        return Err(Status::internal(format!(
                            "server should have nacked with code=Unimplemented: got {}",
                            e.code
                        )))
                    }
                    Some(_) => {}
                }
            }
            Some(answer)
        }
        None => None,
    };
    let (requests_tx, requests) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(request)) = inbound.message().await {
            if requests_tx.send(request).is_err() {
                return;
            }
        }
    });
    let stream = GalleyStream {
        requests,
        responses,
        next_nonce: 0,
    };
    Ok((stream, answer))
}

// === impl GalleyStream ===

impl GalleyStream {
    /// The gateway's next request; `None` once its stream ended.
    pub async fn next_request(&mut self) -> Option<RequestResources> {
        self.requests.recv().await
    }

    /// A request the gateway already sent, if any, without waiting.
    pub fn try_next_request(&mut self) -> Option<RequestResources> {
        self.requests.try_recv().ok()
    }

    /// Sends `message` with the next nonce (`n1`, `n2`, …) and returns the
    /// nonce; `None` if the stream is gone.
    pub fn send(&mut self, mut message: Resources) -> Option<String> {
        self.next_nonce += 1;
        message.nonce = format!("n{}", self.next_nonce);
        let nonce = message.nonce.clone();
        self.responses.send(Ok(message)).ok()?;
        Some(nonce)
    }

    /// The gateway's reply to `nonce`, passing over initial requests on the
    /// way; `Err` with the unexpected request if another nonce is answered.
    pub async fn reply_to(&mut self, nonce: &str) -> Option<Result<RequestResources, RequestResources>> {
        loop {
            let reply = self.next_request().await?;
            if reply.response_nonce == nonce {
                return Some(Ok(reply));
            }
            if !reply.response_nonce.is_empty() {
                return Some(Err(reply));
            }
        }
    }

    /// Ends the stream with `status`.
    pub fn kill(&self, status: Status) {
        let _ = self.responses.send(Err(status));
    }
}

/// A full state of `collection`.
pub fn full(collection: &str, resources: Vec<Resource>) -> Resources {
    Resources {
        collection: collection.to_owned(),
        resources,
        system_version_info: "galley-1".into(),
        ..Default::default()
    }
}

/// An incremental update of `collection`.
pub fn incremental(collection: &str, resources: Vec<Resource>, removed: &[&str]) -> Resources {
    Resources {
        collection: collection.to_owned(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        incremental: true,
        ..Default::default()
    }
}

/// A resource with a body of `body_type_url`.
pub fn resource(name: &str, version: &str, body_type_url: &str, body: &[u8]) -> Resource {
    Resource {
        metadata: Some(Metadata {
            name: name.to_owned(),
            version: version.to_owned(),
            ..Default::default()
        }),
        body: Some(prost_types::Any {
            type_url: body_type_url.to_owned(),
            value: body.to_vec(),
        }),
    }
}
