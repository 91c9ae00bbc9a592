//! gRPC request messages read from a request body, for the gateway's own
//! streaming services. Unlike a general-purpose decoder it never keeps a
//! large buffer: small messages (subscriptions, ACKs) go through a small
//! buffer, and a large one (a long NACK, a big `initial_resource_versions`)
//! is read into a buffer of exactly its size that is freed once it is
//! decoded. Large messages draw their size from a budget shared by every
//! stream (`--max-request-buffer-bytes`) before they are read, and must
//! arrive within `--request-read-timeout`, so what all clients together can
//! make the gateway hold is bounded, and small requests never wait.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Body as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::body::Body;
use tonic::Status;

use crate::metrics as m;

/// A message at least this large draws on the shared budget; smaller ones
/// never wait for it.
pub const LARGE_REQUEST: usize = 64 << 10;

const HEADER: usize = 5;

/// Request bytes held in large messages being read, across all streams.
#[derive(Debug)]
pub struct RequestBudget {
    permits: Arc<Semaphore>,
    /// `--max-request-buffer-bytes`.
    pub max_buffer_bytes: usize,
    /// `--max-request-bytes`: a larger message ends the stream.
    pub max_message_bytes: usize,
    /// `--request-read-timeout`: a large message, room included, must
    /// arrive this fast.
    pub read_timeout: Duration,
}

impl RequestBudget {
    pub fn new(max_buffer_bytes: usize, max_message_bytes: usize, read_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max_buffer_bytes)),
            max_buffer_bytes,
            max_message_bytes,
            read_timeout,
        })
    }

    /// Bytes of large messages being read now.
    pub fn in_use(&self) -> usize {
        self.max_buffer_bytes - self.permits.available_permits()
    }
}

/// Room taken from the budget for a large request, held as long as memory
/// that request caused is alive (its buffer, what is built from it); given
/// back when dropped. Small requests come with no room.
#[derive(Debug, Default)]
pub struct Room(Option<OwnedSemaphorePermit>);

impl Room {
    pub fn none() -> Self {
        Self(None)
    }

    /// Bytes of budget it holds.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |p| p.num_permits())
    }
}

/// The requests of one stream, decoded one at a time.
pub struct RequestStream<T> {
    body: Body,
    budget: Arc<RequestBudget>,
    /// What is read but not yet decoded (small messages only).
    buf: BytesMut,
    /// The message type's name, for errors.
    message: &'static str,
    ended: bool,
    _kind: PhantomData<fn() -> T>,
}

impl<T: prost::Message + Default> RequestStream<T> {
    pub fn new(body: Body, budget: Arc<RequestBudget>, message: &'static str) -> Self {
        Self {
            body,
            budget,
            buf: BytesMut::new(),
            message,
            ended: false,
            _kind: PhantomData,
        }
    }

    /// Reads one more frame of the body into `buf`; false at its end.
    async fn fill(&mut self) -> Result<bool, Status> {
        if self.ended {
            return Ok(false);
        }
        loop {
            match std::future::poll_fn(|cx| std::pin::Pin::new(&mut self.body).poll_frame(cx)).await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.put(data);
                        return Ok(true);
                    }
                    // Request trailers carry nothing for these services.
                }
                Some(Err(status)) => return Err(status),
                None => {
                    self.ended = true;
                    return Ok(false);
                }
            }
        }
    }

    /// The next message; `None` when the client closed its side.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        Ok(self.next().await?.map(|(message, _)| message))
    }

    /// The next message and, for a large one, the room it holds: the
    /// message's fields are slices of its buffer, so whoever keeps them
    /// keeps the room too.
    pub async fn next(&mut self) -> Result<Option<(T, Room)>, Status> {
        while self.buf.len() < HEADER {
            if !self.fill().await? {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(Status::invalid_argument(
                        "the request stream ended inside a message header",
                    ))
                };
            }
        }
        if self.buf[0] != 0 {
            return Err(Status::unimplemented(format!(
                "a compressed {} (flag {}); send uncompressed messages",
                self.message, self.buf[0]
            )));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.budget.max_message_bytes {
            m::limit_refused("max_request_bytes");
            return Err(Status::resource_exhausted(format!(
                "a request of {len} bytes is larger than --max-request-bytes={} allows",
                self.budget.max_message_bytes
            )));
        }
        let (bytes, room) = if len < LARGE_REQUEST {
            while self.buf.len() < HEADER + len {
                if !self.fill().await? {
                    return Err(self.cut_short());
                }
            }
            self.buf.advance(HEADER);
            let bytes = self.buf.split_to(len).freeze();
            if self.buf.is_empty() {
                // A fresh small buffer: the old one may be shared with the
                // message just decoded.
                self.buf = BytesMut::new();
            }
            (bytes, Room::none())
        } else {
            let timeout = self.budget.read_timeout;
            match tokio::time::timeout(timeout, self.read_large(len)).await {
                Ok(read) => read?,
                Err(_) => {
                    m::limit_refused("request_read_timeout");
                    return Err(Status::resource_exhausted(format!(
                        "a request of {len} bytes did not arrive within --request-read-timeout={} (with \
                         --max-request-buffer-bytes={} shared by all large requests)",
                        humantime::format_duration(timeout),
                        self.budget.max_buffer_bytes
                    )));
                }
            }
        };
        T::decode(bytes)
            .map(|message| Some((message, room)))
            .map_err(|e| Status::invalid_argument(format!("the request is not a valid {}: {e}", self.message)))
    }

    /// Reads a large message into a buffer of its own size, once the budget
    /// has room for it.
    async fn read_large(&mut self, len: usize) -> Result<(Bytes, Room), Status> {
        let permit: OwnedSemaphorePermit = self
            .budget
            .permits
            .clone()
            .acquire_many_owned(len as u32)
            .await
            .map_err(|_| Status::unavailable("the gateway is shutting down"))?;
        self.buf.advance(HEADER);
        let mut message = BytesMut::with_capacity(len);
        let start = self.buf.len().min(len);
        message.put(self.buf.split_to(start));
        while message.len() < len {
            if !self.fill().await? {
                return Err(self.cut_short());
            }
            let n = self.buf.len().min(len - message.len());
            message.put(self.buf.split_to(n));
        }
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        }
        Ok((message.freeze(), Room(Some(permit))))
    }

    fn cut_short(&self) -> Status {
        Status::invalid_argument(format!("the request stream ended inside a {}", self.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A body that yields the given chunks, then waits forever (a client
    /// that stops sending) unless `end` is set.
    struct Chunks {
        chunks: std::collections::VecDeque<Bytes>,
        end: bool,
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
                None if self.end => Poll::Ready(None),
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

    fn stream(
        bytes: Vec<u8>,
        chunk: usize,
        end: bool,
        budget: Arc<RequestBudget>,
    ) -> RequestStream<crate::wire::SotwRequest> {
        let chunks = bytes.chunks(chunk).map(Bytes::copy_from_slice).collect();
        RequestStream::new(Body::new(Chunks { chunks, end }), budget, "MeshConfigRequest")
    }

    fn request(version: &str) -> Vec<u8> {
        prost::Message::encode_to_vec(&crate::wire::SotwRequest {
            version_info: version.into(),
            type_url: "t".into(),
            ..Default::default()
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
        let (request, room) = requests.next().await.unwrap().unwrap();
        assert_eq!(request.version_info, large);
        assert!(room.bytes() > 200_000 && budget.in_use() == room.bytes());
        drop((request, room));
        assert_eq!(budget.in_use(), 0, "the room is given back with the message");
        assert_eq!(requests.message().await.unwrap().unwrap().version_info, "b");
        assert!(requests.message().await.unwrap().is_none());
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
}
