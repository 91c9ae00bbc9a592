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

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};

use h2::server::SendResponse;
use h2::SendStream;
use tonic::codegen::http::{self, HeaderMap};

use bytes::Buf;

use super::gather::Payload;
use super::grpc::Hold;

/// The stream's response, not yet answered: in the request's extensions
/// (which need `Clone`), taken at most once.
#[derive(Clone)]
pub struct ResponseSlot(Arc<Mutex<Option<Unanswered>>>);

impl ResponseSlot {
    pub(super) fn new(respond: SendResponse<Payload>, hold: Hold) -> Self {
        Self(Arc::new(Mutex::new(Some(Unanswered { respond, hold }))))
    }

    /// The response, for the service to write itself; `None` once taken.
    pub fn take(&self) -> Option<Unanswered> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
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
