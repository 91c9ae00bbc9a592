//! gRPC messages read from a body: the requests of the gateway's own
//! streaming services, and the responses of a source it dials. Unlike a
//! general-purpose decoder it never keeps a large buffer: small messages
//! (subscriptions, ACKs) are read where their frame is when they come whole
//! in one (no copy), or else through a small buffer, and a large one (a long
//! NACK, a big `initial_resource_versions`, a source's whole collection) is
//! read into a buffer of exactly its size that is freed once it is decoded
//! (tonic's decoder grows one buffer to the largest message and keeps it
//! while the stream lives). Large requests draw their size from a budget
//! shared by every stream (`--max-request-buffer-bytes`) before they are
//! read, and must arrive within `--request-read-timeout`, so what all
//! clients together can make the gateway hold is bounded, and small requests
//! never wait. A source's responses have a budget of their own, one message
//! of `--max-message-bytes`, and no read timeout (keepalive finds a dead
//! source); their stream ends with the status in its trailers.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Body as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::Status;

use crate::metrics as m;

/// A message at least this large draws on the shared budget; smaller ones
/// never wait for it.
pub const LARGE_REQUEST: usize = 64 << 10;

/// The length of a gRPC message's prefix: a compression flag and a 4-byte length.
pub const HEADER: usize = 5;

/// A gRPC message's 5-byte prefix read: the message's length, or the
/// compression flag where the message is compressed (which the gateway's
/// readers, and `mcp-load`'s, refuse).
pub fn message_len(prefix: &[u8; HEADER]) -> Result<usize, u8> {
    match prefix[0] {
        0 => Ok(u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize),
        flag => Err(flag),
    }
}

/// Request bytes held in large messages being read, across all streams.
#[derive(Debug)]
pub struct RequestBudget {
    permits: Arc<Semaphore>,
    /// `--max-request-buffer-bytes`.
    pub max_buffer_bytes: usize,
    /// `--max-request-bytes`: a larger message ends the stream.
    pub max_message_bytes: usize,
    /// `--request-read-timeout`: a large message, room included, must
    /// arrive this fast. `None` for a source's responses.
    pub read_timeout: Option<Duration>,
    /// Whose messages: a client's requests, or a source's responses.
    reads: Reads,
    /// Client requests: `mcp_gateway_request_buffer_bytes`, the room in use.
    in_use_gauge: Option<metrics::Gauge>,
}

/// Room granted from a budget to one large message, given back when
/// dropped. The gauge counts granted rooms only, each added and taken away
/// as one step: the semaphore's free count also falls by what a request
/// still waiting has been handed on its way to its whole room, which is
/// not held (and goes back unseen if that wait is dropped).
struct Room {
    _permit: OwnedSemaphorePermit,
    gauge: Option<metrics::Gauge>,
    len: f64,
}

impl Room {
    fn new(permit: OwnedSemaphorePermit, budget: &RequestBudget, len: usize) -> Self {
        let room = Room {
            _permit: permit,
            gauge: budget.in_use_gauge.clone(),
            len: len as f64,
        };
        if let Some(gauge) = &room.gauge {
            gauge.increment(room.len);
        }
        room
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if let Some(gauge) = &self.gauge {
            gauge.decrement(self.len);
        }
    }
}

/// Whose messages a stream reads: what its errors name, and how it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reads {
    /// A client's requests: the body ends when the client closes its side.
    Requests,
    /// A source's messages, as the requests of its dial-out stream: a
    /// message too large is the error tonic's decoder gives (which the
    /// source's stream names `--max-message-bytes` for).
    SourceRequests,
    /// A source's messages, as the responses of the gateway's call: as
    /// `SourceRequests`, and the body ends with the call's status in its
    /// trailers.
    SourceResponses,
}

impl RequestBudget {
    pub fn new(max_buffer_bytes: usize, max_message_bytes: usize, read_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max_buffer_bytes)),
            max_buffer_bytes,
            max_message_bytes,
            read_timeout: Some(read_timeout),
            reads: Reads::Requests,
            in_use_gauge: Some(metrics::gauge!(crate::metrics::REQUEST_BUFFER_BYTES)),
        })
    }

    /// The budget of one stream of a source's messages: one message of up
    /// to `max_message_bytes` at a time, however long it takes to arrive.
    /// `dialed`: the gateway called the source, whose messages are the
    /// call's responses; else the source dialed out, and they are requests.
    pub fn for_source(max_message_bytes: usize, dialed: bool) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max_message_bytes)),
            max_buffer_bytes: max_message_bytes,
            max_message_bytes,
            read_timeout: None,
            in_use_gauge: None,
            reads: if dialed {
                Reads::SourceResponses
            } else {
                Reads::SourceRequests
            },
        })
    }

    /// Room not free: granted to large messages being read, and (while a
    /// request waits) what it has been handed on its way to its whole room.
    /// The gauge counts granted rooms only ([`Room`]).
    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        self.max_buffer_bytes - self.permits.available_permits()
    }
}

/// Waits for `future`, within the current message's read deadline.
async fn in_time<F: std::future::Future>(
    deadline: Option<Instant>,
    budget: &RequestBudget,
    future: F,
) -> Result<F::Output, Status> {
    let Some(deadline) = deadline else {
        return Ok(future.await);
    };
    // The deadline first: a message whose room or bytes come only after it
    // is refused, even when both are ready by the time the task runs.
    let in_time = async {
        tokio::select! {
            biased;
            () = tokio::time::sleep_until(deadline) => None,
            output = future => Some(output),
        }
    };
    in_time.await.ok_or_else(|| {
        m::limit_refused("request_read_timeout");
        Status::resource_exhausted(format!(
            "a request did not arrive within --request-read-timeout={} of its first byte (large ones wait for \
             room in --max-request-buffer-bytes={})",
            humantime::format_duration(budget.read_timeout.unwrap_or_default()),
            budget.max_buffer_bytes
        ))
    })
}

/// How a stream's messages are made from the buffer each is read into (a
/// buffer of its own: the message may keep it, and change it first). The
/// rooms that read each message say how (`downstream::wires`: through
/// `proto::wire::MessageBuf`, a slice's speed with `bytes` fields shared).
pub trait FromBuffer: Sized {
    fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError>;

    /// A message that came whole in one frame, read where the frame is (a
    /// share of the connection's read buffer, let go with the message). By
    /// default copied into a buffer of its own, for readers that change
    /// theirs.
    fn from_frame(bytes: Bytes) -> Result<Self, prost::DecodeError> {
        Self::from_buffer(BytesMut::from(&bytes[..]))
    }
}

/// A large message being read: its size, and once the budget has room for
/// it, the buffer it is read into.
struct Large {
    len: usize,
    reading: Option<(BytesMut, Room)>,
}

/// Where a [`RequestStream`] reads its frames: the stream's body as h2
/// gives it (taken from the request's [`RequestSlot`] on the gateway's own
/// listeners), or a body as any router or server hands it on.
///
/// [`RequestSlot`]: super::grpc::RequestSlot
pub enum RequestBody {
    Direct(super::grpc::RecvBody),
    Routed(Body),
}

impl From<Body> for RequestBody {
    fn from(body: Body) -> Self {
        Self::Routed(body)
    }
}

impl RequestBody {
    /// A request's parts and its body as a service that reads its requests
    /// itself reads it: the stream's own, taken from the listener's slot
    /// where there is one, else the body as it was handed on.
    pub fn of(request: tonic::codegen::http::Request<Body>) -> (tonic::codegen::http::request::Parts, Self) {
        let (parts, body) = request.into_parts();
        let direct = parts
            .extensions
            .get::<super::grpc::RequestSlot>()
            .and_then(super::grpc::RequestSlot::take);
        (parts, direct.map_or(Self::Routed(body), Self::Direct))
    }

    fn poll_frame(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        match self {
            Self::Direct(body) => std::pin::Pin::new(body).poll_frame(cx),
            Self::Routed(body) => std::pin::Pin::new(body).poll_frame(cx),
        }
    }
}

/// The requests of one stream, decoded one at a time. `message` is
/// cancel-safe: everything read is kept in the stream, so a caller may drop
/// the future (a `select!` that another branch won) and call again.
pub struct RequestStream<T> {
    body: RequestBody,
    budget: Arc<RequestBudget>,
    /// What is read but not yet decoded (small messages, and what follows
    /// a large message's part).
    buf: BytesMut,
    /// A frame read while nothing else was: the messages wholly in it are
    /// read from it as they are, not copied into `buf` (an ACK, most
    /// often); what is left of it is copied into `buf` when the next one
    /// is not whole in it.
    frame: Option<Bytes>,
    /// Boxed: most streams never read one, and every idle stream holds this.
    large: Option<Box<Large>>,
    /// When the message being read began: it must be complete within the
    /// read timeout. `None` between messages (an idle stream is fine).
    started: Option<Instant>,
    /// The message type's name, for errors.
    message: &'static str,
    ended: bool,
    /// A source's responses: the status its trailers carried (`Ok` once the
    /// call ended well).
    status: Option<Status>,
    _kind: PhantomData<fn() -> T>,
}

impl<T: FromBuffer> RequestStream<T> {
    pub fn new(body: impl Into<RequestBody>, budget: Arc<RequestBudget>, message: &'static str) -> Self {
        Self {
            body: body.into(),
            budget,
            buf: BytesMut::new(),
            frame: None,
            large: None,
            started: None,
            message,
            ended: false,
            status: None,
            _kind: PhantomData,
        }
    }

    /// A response whose status came in its headers (trailers-only).
    pub fn ended_with(mut self, status: Status) -> Self {
        self.status = Some(status);
        self
    }

    /// The current message's read deadline (none between messages).
    fn deadline(&self) -> Option<Instant> {
        Some(self.started? + self.budget.read_timeout?)
    }

    /// Reads one more frame of the body into `buf`; false at its end.
    async fn fill(&mut self) -> Result<bool, Status> {
        if self.ended {
            return Ok(false);
        }
        loop {
            let (deadline, budget) = (self.deadline(), self.budget.clone());
            let frame = std::future::poll_fn(|cx| self.body.poll_frame(cx));
            let frame = match deadline {
                // Between messages (an idle stream), no clock runs.
                None => frame.await,
                // Boxed: the timer would otherwise be room in every idle
                // stream's future, and a message rarely spans frames.
                Some(_) => Box::pin(in_time(deadline, &budget, frame)).await?,
            };
            match frame {
                Some(Ok(frame)) => {
                    let trailers = match frame.into_data() {
                        Ok(data) => {
                            if self.buf.is_empty() && self.large.is_none() && self.frame.is_none() {
                                // Its clock starts if a message is left
                                // incomplete in it (`message`).
                                self.frame = Some(data);
                            } else {
                                self.buffer(data);
                            }
                            return Ok(true);
                        }
                        Err(frame) => frame.into_trailers(),
                    };
                    // Request trailers carry nothing for these services; a
                    // response's carry the call's status.
                    if let (Reads::SourceResponses, Ok(trailers)) = (self.budget.reads, trailers) {
                        self.status = Status::from_header_map(&trailers);
                    }
                }
                Some(Err(status)) => return Err(status),
                None => {
                    self.ended = true;
                    return match (self.budget.reads, self.status.take()) {
                        (Reads::Requests | Reads::SourceRequests, _) => Ok(false),
                        (Reads::SourceResponses, Some(status)) if status.code() == tonic::Code::Ok => Ok(false),
                        (Reads::SourceResponses, Some(status)) => Err(status),
                        (Reads::SourceResponses, None) => Err(Status::internal(
                            "the source's stream ended without a grpc-status (a reset, or a proxy between)",
                        )),
                    };
                }
            }
        }
    }

    /// The next message; `None` when the client closed its side.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        loop {
            if let Some(large) = &mut self.large {
                let len = large.len;
                if large.reading.is_none() {
                    // Room first, then the buffer: memory the budget counts.
                    let permit = self.budget.permits.clone().acquire_many_owned(len as u32);
                    // Boxed: the wait (a timer and a semaphore's) would
                    // otherwise be room in every idle stream's future.
                    let permit = Box::pin(in_time(self.deadline(), &self.budget, permit))
                        .await?
                        .map_err(|_| Status::unavailable("the gateway is shutting down"))?;
                    let room = Room::new(permit, &self.budget, len);
                    let large = self.large.as_mut().expect("checked");
                    large.reading = Some((BytesMut::with_capacity(len), room));
                    continue;
                }
                let (message, _) = large.reading.as_mut().expect("checked");
                let n = self.buf.len().min(len - message.len());
                message.put(self.buf.split_to(n));
                if message.len() == len {
                    let (message, permit) = self.large.take().and_then(|l| l.reading).expect("checked");
                    let decoded = self.decode(message);
                    drop(permit);
                    return decoded.map(Some);
                }
                if !self.fill().await? {
                    return Err(self.cut_short());
                }
                continue;
            }
            if let Some(mut frame) = self.frame.take() {
                if let Some(len) = self.whole_in(&frame)? {
                    frame.advance(HEADER);
                    let message = frame.split_to(len);
                    self.frame = (!frame.is_empty()).then_some(frame);
                    return self.decode_frame(message).map(Some);
                }
                // A message it begins and does not hold: read through the
                // buffer, its clock started now (the frame came in this poll).
                self.buffer(frame);
            }
            if self.buf.len() < HEADER {
                if !self.fill().await? {
                    return if self.buf.is_empty() {
                        Ok(None)
                    } else {
                        Err(Status::invalid_argument(format!(
                            "the {} stream ended inside a message header",
                            self.what()
                        )))
                    };
                }
                continue;
            }
            let len = self.prefixed_len(&self.buf[..HEADER])?;
            if len >= LARGE_REQUEST {
                self.buf.advance(HEADER);
                self.large = Some(Box::new(Large { len, reading: None }));
                continue;
            }
            if self.buf.len() < HEADER + len {
                if !self.fill().await? {
                    return Err(self.cut_short());
                }
                continue;
            }
            self.buf.advance(HEADER);
            let bytes = self.buf.split_to(len);
            return self.decode(bytes).map(Some);
        }
    }

    /// Adds `bytes` to what waits to be decoded; a message's first byte
    /// starts its clock.
    fn buffer(&mut self, bytes: Bytes) {
        if self.started.is_none() && !bytes.is_empty() {
            self.started = Some(Instant::now());
        }
        self.buf.put(bytes);
    }

    /// The length of the message `prefix` begins, refused where it is
    /// compressed or larger than the limit.
    fn prefixed_len(&self, prefix: &[u8]) -> Result<usize, Status> {
        let prefix = prefix.try_into().expect("a whole prefix");
        let len = message_len(prefix).map_err(|flag| {
            Status::unimplemented(format!(
                "a compressed {} (flag {flag}); send uncompressed messages",
                self.message
            ))
        })?;
        if len > self.budget.max_message_bytes {
            return Err(self.too_large(len));
        }
        Ok(len)
    }

    /// The length of the message `frame` begins, if it is small and wholly
    /// in it (a large one is read into a buffer of its size).
    fn whole_in(&self, frame: &[u8]) -> Result<Option<usize>, Status> {
        if frame.len() < HEADER {
            return Ok(None);
        }
        let len = self.prefixed_len(&frame[..HEADER])?;
        Ok((len < LARGE_REQUEST && frame.len() >= HEADER + len).then_some(len))
    }

    /// Decodes a complete message; the next message's clock starts with its
    /// first byte.
    fn decode(&mut self, bytes: BytesMut) -> Result<T, Status> {
        self.started = (!self.buf.is_empty()).then(Instant::now);
        if self.buf.is_empty() {
            // A fresh small buffer: the old one may be shared with the
            // message just decoded.
            self.buf = BytesMut::new();
        }
        T::from_buffer(bytes).map_err(|e| self.invalid(e))
    }

    /// [`Self::decode`] for a message read where its frame is.
    fn decode_frame(&mut self, bytes: Bytes) -> Result<T, Status> {
        self.started = self.frame.is_some().then(Instant::now);
        T::from_frame(bytes).map_err(|e| self.invalid(e))
    }

    fn invalid(&self, e: prost::DecodeError) -> Status {
        Status::invalid_argument(format!("the {} is not a valid {}: {e}", self.what(), self.message))
    }

    fn cut_short(&self) -> Status {
        Status::invalid_argument(format!("the {} stream ended inside a {}", self.what(), self.message))
    }

    fn what(&self) -> &'static str {
        match self.budget.reads {
            Reads::Requests | Reads::SourceRequests => "request",
            Reads::SourceResponses => "response",
        }
    }

    fn too_large(&self, len: usize) -> Status {
        let max = self.budget.max_message_bytes;
        match self.budget.reads {
            Reads::Requests => {
                m::limit_refused("max_request_bytes");
                Status::resource_exhausted(format!(
                    "a request of {len} bytes is larger than --max-request-bytes={max} allows"
                ))
            }
            // As tonic's decoder says it: `source::stream::classify` names
            // the flag (and counts the refusal).
            Reads::SourceRequests | Reads::SourceResponses => Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request as these tests read it: two fields of a `MeshConfigRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    struct TestRequest {
        #[prost(string, tag = "1")]
        version_info: String,
        #[prost(string, tag = "4")]
        type_url: String,
    }

    impl FromBuffer for TestRequest {
        fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
            prost::Message::decode(buf.freeze())
        }
    }
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio_stream::StreamExt;

    /// A body that yields the given chunks, then waits forever (a client
    /// that stops sending) unless `end` is set.
    struct Chunks {
        chunks: std::collections::VecDeque<Bytes>,
        end: bool,
        /// Sent after the chunks, before the end.
        trailers: Option<http::HeaderMap>,
    }

    impl http_body::Body for Chunks {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
            match self.chunks.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(http_body::Frame::data(chunk)))),
                None if self.end => Poll::Ready(self.trailers.take().map(|t| Ok(http_body::Frame::trailers(t)))),
                None => Poll::Pending,
            }
        }
    }

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&(message.len() as u32).to_be_bytes());
        bytes.extend_from_slice(message);
        bytes
    }

    fn stream(bytes: Vec<u8>, chunk: usize, end: bool, budget: Arc<RequestBudget>) -> RequestStream<TestRequest> {
        let chunks = bytes.chunks(chunk).map(Bytes::copy_from_slice).collect();
        RequestStream::new(
            Body::new(Chunks {
                chunks,
                end,
                trailers: None,
            }),
            budget,
            "MeshConfigRequest",
        )
    }

    fn request(version: &str) -> Vec<u8> {
        prost::Message::encode_to_vec(&TestRequest {
            version_info: version.into(),
            type_url: "t".into(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn small_and_large_messages_split_anywhere_decode_in_order() {
        let budget = RequestBudget::new(1 << 20, 1 << 20, Duration::from_secs(10));
        let large = "v".repeat(200_000);
        let mut bytes = framed(&request("a"));
        bytes.extend(framed(&request(&large)));
        bytes.extend(framed(&request("b")));
        let mut requests = stream(bytes, 7777, true, budget.clone());
        assert_eq!(requests.message().await.unwrap().unwrap().version_info, "a");
        assert_eq!(requests.message().await.unwrap().unwrap().version_info, large);
        assert_eq!(budget.in_use(), 0, "the room is given back once decoded");
        assert_eq!(requests.message().await.unwrap().unwrap().version_info, "b");
        assert!(requests.message().await.unwrap().is_none());
    }

    /// A request that says where it was read: in its frame (the address of
    /// its first byte) or copied into a buffer of its own.
    #[derive(Debug, PartialEq)]
    struct Located {
        version_info: String,
        in_frame: Option<usize>,
    }

    impl FromBuffer for Located {
        fn from_buffer(buf: BytesMut) -> Result<Self, prost::DecodeError> {
            let read: TestRequest = prost::Message::decode(buf.freeze())?;
            Ok(Located {
                version_info: read.version_info,
                in_frame: None,
            })
        }

        fn from_frame(bytes: Bytes) -> Result<Self, prost::DecodeError> {
            let read: TestRequest = prost::Message::decode(bytes.clone())?;
            Ok(Located {
                version_info: read.version_info,
                in_frame: Some(bytes.as_ptr() as usize),
            })
        }
    }

    /// Messages wholly in the frame they came in are read there (no copy:
    /// an ACK in its DATA frame); one that a frame only begins is read
    /// through the stream's buffer, and a frame read while that buffer
    /// holds a part is added to it.
    #[tokio::test(start_paused = true)]
    async fn a_message_whole_in_its_frame_is_read_in_place() {
        let budget = RequestBudget::new(1 << 20, 1 << 20, Duration::from_secs(10));
        let (a, b, c) = (framed(&request("a")), framed(&request("bb")), framed(&request("ccc")));
        // One frame: a, b, and the first half of c; then the rest of c.
        let mut first = [a.clone(), b.clone()].concat();
        let half = c.len() / 2;
        first.extend_from_slice(&c[..half]);
        let first = Bytes::from(first);
        let second = Bytes::copy_from_slice(&c[half..]);
        let mut requests = RequestStream::<Located>::new(
            Body::new(Chunks {
                chunks: [first.clone(), second].into(),
                end: true,
                trailers: None,
            }),
            budget,
            "MeshConfigRequest",
        );
        let at = first.as_ptr() as usize;
        let read = |message: Result<Result<Option<Located>, Status>, _>| message.unwrap().unwrap().unwrap();
        let within = Duration::from_secs(5);
        assert_eq!(
            read(tokio::time::timeout(within, requests.message()).await),
            Located {
                version_info: "a".into(),
                in_frame: Some(at + HEADER)
            }
        );
        assert_eq!(
            read(tokio::time::timeout(within, requests.message()).await),
            Located {
                version_info: "bb".into(),
                in_frame: Some(at + a.len() + HEADER)
            }
        );
        assert_eq!(
            read(tokio::time::timeout(within, requests.message()).await),
            Located {
                version_info: "ccc".into(),
                in_frame: None
            }
        );
        assert!(tokio::time::timeout(within, requests.message())
            .await
            .unwrap()
            .unwrap()
            .is_none());
        assert!(requests.frame.is_none() && requests.buf.is_empty());
    }

    /// A small message begun in a frame and never finished is cut off by
    /// the read timeout, counted from that frame, as any message is.
    #[tokio::test(start_paused = true)]
    async fn a_small_message_left_incomplete_in_its_frame_times_out() {
        let budget = RequestBudget::new(1 << 20, 1 << 20, Duration::from_secs(10));
        let whole = framed(&request("incomplete"));
        let mut requests = stream(whole[..whole.len() - 3].to_vec(), 1 << 10, false, budget);
        let started = Instant::now();
        let status = tokio::time::timeout(Duration::from_secs(60), requests.message())
            .await
            .expect("cut off by the read timeout, not waiting on")
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("--request-read-timeout=10s"),
            "{}",
            status.message()
        );
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    /// Whatever the frames' sizes, small and large messages decode in
    /// order, and a small one is read in its frame exactly when it is whole
    /// in one and begins it or follows a message read in it (nothing of
    /// the frame went into the stream's buffer before it).
    #[test]
    fn messages_decode_in_order_however_the_frames_cut_them() {
        use proptest::prelude::*;
        let sizes = proptest::collection::vec(prop_oneof![4 => 0usize..40, 1 => 70_000usize..70_100], 1..6);
        let cuts = proptest::collection::vec(1usize..300, 1..20);
        proptest!(ProptestConfig::with_cases(64), |(sizes in sizes, cuts in cuts)| {
            let versions: Vec<String> = sizes.iter().enumerate().map(|(i, n)| format!("{i}{}", "v".repeat(*n))).collect();
            let bytes: Vec<u8> = versions.iter().flat_map(|v| framed(&request(v))).collect();
            let mut chunks = std::collections::VecDeque::new();
            let (mut at, mut turn) = (0, 0);
            while at < bytes.len() {
                let n = (cuts[turn % cuts.len()] * if turn % 3 == 0 { 1 } else { 37 }).min(bytes.len() - at);
                chunks.push_back(Bytes::copy_from_slice(&bytes[at..at + n]));
                at += n;
                turn += 1;
            }
            // Each chunk's place in the bytes, and where its bytes are.
            let mut places = Vec::new();
            let mut start = 0;
            for chunk in &chunks {
                places.push((start, start + chunk.len(), chunk.as_ptr() as usize));
                start += chunk.len();
            }
            let budget = RequestBudget::new(1 << 20, 1 << 20, Duration::from_secs(10));
            let mut requests = RequestStream::<Located>::new(
                Body::new(Chunks { chunks, end: true, trailers: None }),
                budget,
                "MeshConfigRequest",
            );
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
            let read: Vec<Located> = runtime.block_on(async {
                let mut read = Vec::new();
                while let Some(message) = tokio::time::timeout(Duration::from_secs(5), requests.message()).await.unwrap().unwrap() {
                    read.push(message);
                }
                read
            });
            prop_assert_eq!(read.iter().map(|r| r.version_info.clone()).collect::<Vec<_>>(), versions.clone());
            // A message is read in its frame when it is small and whole in
            // one, and begins the frame or follows one read in it.
            let (mut at, mut before_in_place) = (0, false);
            for (message, version) in read.iter().zip(&versions) {
                let len = framed(&request(version)).len();
                let &(from, to, ptr) = places.iter().find(|(from, to, _)| (*from..*to).contains(&at)).unwrap();
                let small = len - HEADER < LARGE_REQUEST;
                let in_place = small && at + len <= to && (at == from || before_in_place);
                let expected = in_place.then_some(ptr + at - from + HEADER);
                prop_assert_eq!(message.in_frame, expected, "the message at {} of the chunk {}..{}", at, from, to);
                before_in_place = in_place && at + len < to;
                at += len;
            }
        });
    }

    /// Every await of `message` may be dropped (another `select!` branch won)
    /// and the next call continues where it was: the body is fed a chunk at
    /// a time and the future is dropped after each poll.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_read_loses_nothing() {
        let budget = RequestBudget::new(1 << 20, 1 << 20, Duration::from_secs(10));
        let large = "L".repeat(100_000);
        let mut bytes = framed(&request(&large));
        bytes.extend(framed(&request("small")));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        let body = Body::new(http_body_util::StreamBody::new(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
                .map(|b| Ok::<_, Status>(http_body::Frame::data(b))),
        ));
        let mut requests: RequestStream<TestRequest> = RequestStream::new(body, budget, "MeshConfigRequest");
        let mut got = Vec::new();
        for chunk in bytes.chunks(999) {
            tx.send(Bytes::copy_from_slice(chunk)).unwrap();
            // Poll once, then drop the future, as a lost select! would.
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let Poll::Ready(result) = std::pin::pin!(requests.message()).as_mut().poll(&mut cx) {
                got.push(result.unwrap().unwrap().version_info);
            }
        }
        drop(tx);
        while let Some(request) = requests.message().await.unwrap() {
            got.push(request.version_info);
        }
        assert_eq!(got, [large, "small".to_owned()]);
    }

    #[tokio::test(start_paused = true)]
    async fn oversized_compressed_and_cut_short_messages_are_errors() {
        let budget = RequestBudget::new(1 << 20, 1000, Duration::from_secs(10));
        let mut big = stream(framed(&request(&"x".repeat(2000))), 100, true, budget.clone());
        let status = big.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("--max-request-bytes=1000"),
            "{}",
            status.message()
        );

        let mut compressed = framed(&request("a"));
        compressed[0] = 1;
        let status = stream(compressed, 100, true, budget.clone())
            .message()
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unimplemented);

        let mut short = framed(&request("abc"));
        short.truncate(short.len() - 1);
        let status = stream(short, 100, true, budget).message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test(start_paused = true)]
    async fn large_messages_wait_for_room_and_must_arrive_in_time() {
        let budget = RequestBudget::new(150_000, 1 << 20, Duration::from_secs(10));
        // Announces 100 kB and sends half: holds 100 kB of the room.
        let half = framed(&request(&"s".repeat(100_000)))[..50_000].to_vec();
        let mut stalled = stream(half, 16_384, false, budget.clone());
        let stalled = tokio::spawn(async move { stalled.message().await });
        tokio::task::yield_now().await;
        assert!(budget.in_use() >= 100_000);
        // Another 100 kB request, five seconds later, waits for room until
        // the stalled one times out; then it is read.
        tokio::time::advance(Duration::from_secs(5)).await;
        let mut waiting = stream(framed(&request(&"w".repeat(100_000))), 16_384, true, budget.clone());
        let waiting = tokio::spawn(async move { waiting.message().await });
        let status = stalled.await.unwrap().unwrap_err();
        assert!(
            status.message().contains("--request-read-timeout=10s"),
            "{}",
            status.message()
        );
        let request = waiting.await.unwrap().unwrap().unwrap();
        assert_eq!(request.version_info.len(), 100_000);
        assert_eq!(budget.in_use(), 0);
    }

    /// A source's responses as the upstream client reads them.
    fn responses(bytes: Vec<u8>, chunk: usize, status: Option<(i32, &str)>) -> RequestStream<TestRequest> {
        let trailers = status.map(|(code, message)| {
            let mut map = http::HeaderMap::new();
            map.insert("grpc-status", code.into());
            map.insert("grpc-message", message.parse().unwrap());
            map
        });
        let chunks = bytes.chunks(chunk).map(Bytes::copy_from_slice).collect();
        let body = Body::new(Chunks {
            chunks,
            end: true,
            trailers,
        });
        RequestStream::new(body, RequestBudget::for_source(4 << 20, true), "Resources")
    }

    #[tokio::test(start_paused = true)]
    async fn a_sources_responses_end_with_the_status_of_their_trailers() {
        let ok = responses(framed(&request("a")), 100, Some((0, "")));
        let refused = responses(framed(&request("a")), 100, Some((5, "no such collection")));
        let reset = responses(framed(&request("a")), 100, None);
        for (mut stream, end) in [
            (ok, None),
            (refused, Some(tonic::Code::NotFound)),
            (reset, Some(tonic::Code::Internal)),
        ] {
            assert_eq!(stream.message().await.unwrap().unwrap().version_info, "a");
            match (stream.message().await, end) {
                (Ok(None), None) => {}
                (Err(status), Some(code)) => assert_eq!(status.code(), code, "{status:?}"),
                (other, _) => panic!("{other:?} where the end is {end:?}"),
            }
        }
        let status = responses(framed(&request("a")), 100, Some((5, "no such collection")))
            .ended_with(Status::ok(""))
            .message()
            .await;
        assert!(status.is_ok(), "the trailers' status counts, not the headers'");
    }

    /// A large response is read into a buffer of its own size, and once it
    /// is decoded the stream keeps nothing of that size; one larger than
    /// the limit is refused from its length, as tonic's decoder words it.
    #[tokio::test(start_paused = true)]
    async fn a_large_response_leaves_no_buffer_of_its_size_behind() {
        let large = "r".repeat(3 << 20);
        let mut bytes = framed(&request(&large));
        bytes.extend(framed(&request("next")));
        let mut stream = responses(bytes, 16_384, Some((0, "")));
        assert_eq!(stream.message().await.unwrap().unwrap().version_info, large);
        assert!(stream.large.is_none());
        assert!(
            stream.buf.capacity() < LARGE_REQUEST,
            "the stream keeps {} bytes of buffer",
            stream.buf.capacity()
        );
        assert_eq!(stream.message().await.unwrap().unwrap().version_info, "next");

        let status = responses(framed(&request(&"x".repeat(5 << 20))), 16_384, None)
            .message()
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(
            status.message().contains("message length too large"),
            "{}",
            status.message()
        );
    }
}
