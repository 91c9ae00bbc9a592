//! A stream's response side handed to the service, for services that write
//! their own responses (the discovery services: each of their streams is one
//! task, which decides and writes, rather than a task deciding and a second
//! one writing what the first queued).
//!
//! The listener puts a [`ResponseSlot`] in each request's extensions. A
//! service that takes what it holds answers with [`Unanswered::answer`] and
//! writes with the [`ResponseWriter`] it gets; the stream stays open on its
//! connection (and counted under `--max-streams`) until that writer is
//! dropped. A service that does not take it returns a body, which the
//! listener writes as before.

use std::task::{ready, Context, Poll};

use h2::server::SendResponse;
use h2::SendStream;
use tonic::codegen::http::{self, HeaderMap};

use bytes::{Buf, Bytes};

use super::gather::{Message, Payload};
use super::grpc::{Hold, TakeOnce};

/// The stream's response, not yet answered: in the request's extensions,
/// taken at most once, for the service to write itself.
pub type ResponseSlot = TakeOnce<Unanswered>;

impl ResponseSlot {
    pub(super) fn answering(respond: SendResponse<Payload>, hold: Hold) -> Self {
        TakeOnce::new(Unanswered { respond, hold })
    }
}

/// A stream's response whose headers have not been sent.
pub struct Unanswered {
    respond: SendResponse<Payload>,
    hold: Hold,
}

impl Unanswered {
    /// Sends a 200 with `headers`, and returns the writer of the body;
    /// `None` if the peer has already reset the stream.
    pub fn answer(mut self, headers: HeaderMap) -> Option<ResponseWriter> {
        let mut response = http::Response::new(());
        *response.headers_mut() = headers;
        let send = self.respond.send_response(response, false).ok()?;
        Some(ResponseWriter {
            send,
            ended: false,
            _hold: self.hold,
        })
    }

    /// Splits it back into what the listener writes a returned body with.
    pub(super) fn into_parts(self) -> (SendResponse<Payload>, Hold) {
        (self.respond, self.hold)
    }
}

/// The most one write takes: h2 refuses a larger one (a DATA payload's
/// window is at most 2^31 - 1).
pub const MAX_WRITE: usize = i32::MAX as usize;

/// Ready once all that was written to `send` has been given window (the
/// capacity asked for is beyond what is buffered: it is there only once the
/// buffered data has all been given window); `Err` once the peer is gone.
pub(super) fn poll_window(send: &mut SendStream<Payload>, cx: &mut Context<'_>) -> Poll<Result<(), h2::Error>> {
    if let Poll::Ready(reset) = send.poll_reset(cx) {
        return Poll::Ready(Err(reset.map_or_else(|e| e, h2::Error::from)));
    }
    if has_window(send) {
        return Poll::Ready(Ok(()));
    }
    match ready!(send.poll_capacity(cx)) {
        Some(Ok(_)) => Poll::Ready(Ok(())),
        Some(Err(e)) => Poll::Ready(Err(e)),
        None => Poll::Ready(Err(h2::Error::from(h2::Reason::CANCEL))),
    }
}

/// Whether all that was written to `send` has been given window, without
/// waiting (see [`poll_window`]).
fn has_window(send: &mut SendStream<Payload>) -> bool {
    send.reserve_capacity(1);
    send.capacity() > 0
}

/// The peer is gone: it reset the stream, or its connection closed.
#[derive(Debug)]
pub struct Gone;

/// Writes a response body with h2's flow control: a write is taken whole, up
/// to [`MAX_WRITE`] bytes (h2 frames it as the peer's window allows), and the writer is
/// [ready](Self::poll_ready) for the next once everything written before has
/// been given window, so at most one write waits beyond the peer's window.
pub struct ResponseWriter {
    send: SendStream<Payload>,
    /// Trailers or a reset were sent.
    ended: bool,
    _hold: Hold,
}

impl ResponseWriter {
    /// Ready once all that was written has been given window (or at once
    /// when nothing waits); `Err` once the peer is gone.
    pub fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Gone>> {
        poll_window(&mut self.send, cx).map_err(|_| Gone)
    }

    /// Whether a write now would not wait beyond the peer's window (see
    /// [`Self::poll_ready`]), without waiting.
    pub fn is_ready(&mut self) -> bool {
        has_window(&mut self.send)
    }

    /// Completes when the peer is gone.
    pub fn poll_gone(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.send.poll_reset(cx).map(drop)
    }

    /// Writes `data` (held by h2 until the peer's window takes it), at most
    /// [`MAX_WRITE`] bytes.
    pub fn write(&mut self, data: impl Buf + Send + 'static) -> Result<(), Gone> {
        if !data.has_remaining() {
            return Ok(());
        }
        self.send
            .send_data(Payload::Made(Box::new(data)), false)
            .map_err(|_| Gone)
    }

    /// Writes a gRPC message whole from one buffer behind its frame
    /// `header` (held by h2 as [`Self::write`]'s data is), at most
    /// [`MAX_WRITE`] bytes.
    pub fn write_message(&mut self, header: [u8; 5], body: Bytes) -> Result<(), Gone> {
        self.send
            .send_data(Payload::Message(Message::new(header, body)), false)
            .map_err(|_| Gone)
    }

    /// Ends the body with `trailers`, after what was written.
    pub fn finish(&mut self, trailers: HeaderMap) {
        if !std::mem::replace(&mut self.ended, true) {
            let _ = self.send.send_trailers(trailers);
        }
    }

    /// Ends the stream with a reset, dropping what h2 still holds of it:
    /// `CANCEL`, or `INTERNAL_ERROR` when the service `failed`.
    pub fn reset(&mut self, failed: bool) {
        if !std::mem::replace(&mut self.ended, true) {
            let reason = if failed {
                h2::Reason::INTERNAL_ERROR
            } else {
                h2::Reason::CANCEL
            };
            self.send.send_reset(reason);
        }
    }

    /// Whether trailers or a reset were sent.
    pub fn is_finished(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::sync::Notify;

    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    /// `f`, or a panic naming `what` after 10 s (the transport's tests).
    pub(in crate::transport) async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(LIMIT, f)
            .await
            .unwrap_or_else(|_| panic!("{what} in time"))
    }

    /// A waker that counts its wakes and says so (the transport's tests).
    #[derive(Default)]
    pub(in crate::transport) struct Counted {
        pub(in crate::transport) wakes: AtomicUsize,
        woken: Notify,
    }

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.wakes.fetch_add(1, Ordering::SeqCst);
            self.woken.notify_one();
        }
    }

    /// The gateway's stream task waits on its response stream for the
    /// client's end (`poll_reset`) while idle. h2 used the same waker for a
    /// task waiting for capacity, and woke it whenever the stream's
    /// capacity grew: after every response it sent (its DATA frame went
    /// out) and every WINDOW_UPDATE the client sent. Each was a poll of the
    /// stream's task for nothing, a third of its polls in `mcp-load
    /// --scenario eds`. The vendored h2 wakes on capacity only a task that
    /// polled for it; the end wakes both.
    #[tokio::test]
    async fn a_task_waiting_for_the_end_is_not_woken_by_capacity_and_one_waiting_for_capacity_is() {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let serving = tokio::spawn(async move {
            let mut connection = h2::server::handshake(server_io).await.expect("a handshake");
            let (_request, mut respond) = connection.accept().await.expect("a stream").expect("no error");
            // The connection is driven while the test writes.
            tokio::spawn(async move { while connection.accept().await.is_some() {} });
            respond
                .send_response(http::Response::new(()), false)
                .expect("headers sent")
        });
        let (mut client, connection) = within("a handshake", h2::client::handshake(client_io))
            .await
            .expect("a handshake");
        let mut connection = connection;
        let mut ping_pong = connection.ping_pong().expect("a ping");
        tokio::spawn(connection);
        let request = http::Request::post("http://gateway/x").body(()).unwrap();
        let (response, mut client_send) = client.send_request(request, false).expect("a stream");
        let mut send: SendStream<Bytes> = within("the server's stream", serving).await.unwrap();
        let mut body = within("the response", response).await.expect("headers").into_body();

        // Waiting only for the end: a response goes out and its window comes
        // back, and the task is not woken.
        let end = Arc::new(Counted::default());
        let end_waker = std::task::Waker::from(end.clone());
        assert!(send.poll_reset(&mut Context::from_waker(&end_waker)).is_pending());
        // As the gateway's writer does before each write (`has_window`): a
        // byte of window asked for beyond what it wrote.
        send.reserve_capacity(1);
        assert!(send.capacity() > 0);
        send.send_data(Bytes::from(vec![7u8; 1000]), false).expect("sent");
        send.reserve_capacity(1);
        let data = within("the data", body.data()).await.expect("data").expect("no error");
        body.flow_control().release_capacity(data.len()).expect("released");
        // Every frame before the PING is read by the server before it
        // answers it: the WINDOW_UPDATE has been taken in.
        within("a pong", ping_pong.ping(h2::Ping::opaque()))
            .await
            .expect("a pong");
        assert_eq!(end.wakes.load(Ordering::SeqCst), 0, "not woken by capacity");

        // Waiting for capacity: woken when the client's window comes back.
        send.reserve_capacity(1 << 20);
        let capacity = Arc::new(Counted::default());
        let capacity_waker = std::task::Waker::from(capacity.clone());
        let mut cx = Context::from_waker(&capacity_waker);
        // Take what the client's window gives until none is left.
        let mut given = 0;
        while let Poll::Ready(Some(Ok(n))) = send.poll_capacity(&mut cx) {
            given += n;
            send.send_data(Bytes::from(vec![1u8; n]), false).expect("sent");
            if given > 1 << 20 {
                break;
            }
        }
        let mut read = 0;
        while read < given {
            let data = within("the data", body.data()).await.expect("data").expect("no error");
            read += data.len();
            body.flow_control().release_capacity(data.len()).expect("released");
        }
        within("a wake for capacity", capacity.woken.notified()).await;
        assert!(capacity.wakes.load(Ordering::SeqCst) >= 1);

        // The end wakes a task that waits for it.
        let end = Arc::new(Counted::default());
        let end_waker = std::task::Waker::from(end.clone());
        assert!(send.poll_reset(&mut Context::from_waker(&end_waker)).is_pending());
        client_send.send_reset(h2::Reason::CANCEL);
        within("a wake for the end", end.woken.notified()).await;
        assert!(send.poll_reset(&mut Context::from_waker(&end_waker)).is_ready());
    }
}
