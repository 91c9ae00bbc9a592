use crate::codec::UserError;
use crate::codec::UserError::*;
use crate::frame::{self, Frame, FrameSize};
use crate::hpack;
use crate::room::BurstRoom;

use bytes::{Buf, BufMut, BytesMut};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use std::collections::VecDeque;
use std::io::{self, Cursor};

// A macro to get around a method needing to borrow &mut self
macro_rules! limited_write_buf {
    ($self:expr) => {{
        let limit = $self.max_frame_size() + frame::HEADER_LEN;
        $self.buf.get_mut().limit(limit)
    }};
}

#[derive(Debug)]
pub struct FramedWrite<T, B> {
    /// Upstream `AsyncWrite`
    inner: T,
    final_flush_done: bool,

    encoder: Encoder<B>,
}

#[derive(Debug)]
struct Encoder<B> {
    /// HPACK encoder
    hpack: hpack::Encoder,

    /// Write buffer
    ///
    /// TODO: Should this be a ring buffer?
    buf: Cursor<BytesMut>,

    /// DATA frames whose payloads are written from where they lie, in
    /// order, each after the buffer's bytes up to its place
    /// (mcp-xds-gateway's patch: h2 held one, so each write carried one
    /// frame).
    queued: VecDeque<Queued<B>>,

    /// The room the queue's next burst makes at its first frame (one
    /// allocation, not one per doubling; mcp-xds-gateway's patch).
    queued_room: BurstRoom,

    /// The rest of a header block too large for the buffer, encoded once
    /// the buffer is written.
    continuation: Option<frame::Continuation>,

    /// Last data frame
    last_data_frame: Option<frame::Data<B>>,

    /// Max frame size, this is specified by the peer
    max_frame_size: FrameSize,

    /// Chain payloads bigger than this.
    chain_threshold: usize,

    /// Min buffer required to attempt to write a frame
    min_buffer_capacity: usize,
}

/// A DATA frame whose payload goes to the socket as it lies, after the
/// write buffer's bytes up to `at` (mcp-xds-gateway's patch).
#[derive(Debug)]
struct Queued<B> {
    at: usize,
    frame: frame::Data<B>,
    /// Its stream's data goes on past it: once written, it is handed back
    /// (`take_last_data_frame`) for the rest, and nothing is queued after it
    /// until then. A frame that is its stream's whole buffer is dropped once
    /// written, and others may follow it in the same write.
    returned: bool,
}

/// The most DATA frames one flush carries (mcp-xds-gateway's patch): the
/// responses of a connection's streams written together, up to
/// [`MAX_IO_SLICES`] slices a `writev`.
const MAX_QUEUED_FRAMES: usize = 64;

/// Initialize the connection with this amount of write buffer.
///
/// The minimum MAX_FRAME_SIZE is 16kb, so always be able to send a HEADERS
/// frame that big.
pub(super) const DEFAULT_BUFFER_CAPACITY: usize = 16 * 1_024;

/// Chain payloads bigger than this when vectored I/O is enabled. The remote
/// will never advertise a max frame size less than this (well, the spec says
/// the max frame size can't be less than 16kb, so not even close).
const CHAIN_THRESHOLD: usize = 256;

/// Chain payloads bigger than this when vectored I/O is **not** enabled.
/// A larger value in this scenario will reduce the number of small and
/// fragmented data being sent, and hereby improve the throughput.
const CHAIN_THRESHOLD_WITHOUT_VECTORED_IO: usize = 1024;

// TODO: Make generic
impl<T, B> FramedWrite<T, B>
where
    T: AsyncWrite + Unpin,
    B: Buf,
{
    pub fn new(inner: T) -> FramedWrite<T, B> {
        let chain_threshold = if inner.is_write_vectored() {
            CHAIN_THRESHOLD
        } else {
            CHAIN_THRESHOLD_WITHOUT_VECTORED_IO
        };
        FramedWrite {
            inner,
            final_flush_done: false,
            encoder: Encoder {
                hpack: hpack::Encoder::default(),
                // Made when the first frame is buffered
                // (`Encoder::buffer`), given back when idle.
                buf: Cursor::new(BytesMut::new()),
                queued: VecDeque::new(),
                queued_room: BurstRoom::default(),
                continuation: None,
                last_data_frame: None,
                max_frame_size: frame::DEFAULT_MAX_FRAME_SIZE,
                chain_threshold,
                min_buffer_capacity: chain_threshold + frame::HEADER_LEN,
            },
        }
    }

    /// Returns `Ready` when `send` is able to accept a frame
    ///
    /// Calling this function may result in the current contents of the buffer
    /// to be flushed to `T`.
    pub fn poll_ready(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        if !self.encoder.has_capacity() {
            // Try flushing
            ready!(self.flush(cx))?;

            if !self.encoder.has_capacity() {
                return Poll::Pending;
            }
        }

        Poll::Ready(Ok(()))
    }

    /// Returns whether a frame can be buffered without first flushing the
    /// underlying I/O object.
    pub(crate) fn has_capacity(&self) -> bool {
        self.encoder.has_capacity()
    }

    /// Buffer a frame.
    ///
    /// `poll_ready` must be called first to ensure that a frame may be
    /// accepted.
    pub fn buffer(&mut self, item: Frame<B>) -> Result<(), UserError> {
        self.encoder.buffer(item)
    }

    /// Buffers a DATA frame whose payload is its stream's whole buffer
    /// (mcp-xds-gateway's patch): dropped once written, never handed back,
    /// so more frames may be queued behind it for the same write.
    /// `poll_ready` must be called first, as for [`Self::buffer`].
    pub fn buffer_whole_data(&mut self, frame: frame::Data<B>) -> Result<(), UserError> {
        assert!(self.encoder.has_capacity());
        self.encoder.make_buffer();
        tracing::debug!(frame = ?frame, "send");
        self.encoder.buffer_data(frame, true)
    }

    /// Flush buffered data to the wire
    pub fn flush(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        let span = tracing::trace_span!("FramedWrite::flush");
        let _e = span.enter();

        loop {
            while !self.encoder.is_empty() {
                tracing::trace!(queued_data_frames = self.encoder.queued.len());
                let n = ready!(poll_write_buf(
                    Pin::new(&mut self.inner),
                    cx,
                    &mut Pending(&mut self.encoder)
                ))?;
                if n == 0 {
                    // No progress is possible; retrying would busy-loop.
                    tracing::trace!("write returned zero, but non-zero bytes remaining");
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
            }

            match self.encoder.unset_frame() {
                ControlFlow::Continue => (),
                ControlFlow::Break => break,
            }
        }

        tracing::trace!("flushing buffer");
        // Flush the upstream
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;

        Poll::Ready(Ok(()))
    }

    /// Drops the write buffer's memory if nothing is waiting to be written
    /// (mcp-xds-gateway's patch); `Encoder::buffer` makes it again.
    pub(crate) fn release_idle_buffer(&mut self) {
        let encoder = &mut self.encoder;
        if encoder.queued.is_empty()
            && encoder.continuation.is_none()
            && !encoder.buf.has_remaining()
            && encoder.buf.get_ref().capacity() > 0
        {
            // Everything in it was written: what it holds is spent.
            let mut buf = std::mem::replace(&mut encoder.buf, Cursor::new(BytesMut::new())).into_inner();
            buf.clear();
            super::pool::give(super::pool::Kind::Write, buf);
        }
        // The queue of a burst's frames goes with it.
        if encoder.queued.is_empty() && encoder.queued.capacity() > 0 {
            encoder.queued = VecDeque::new();
            encoder.queued_room.given_back(MAX_QUEUED_FRAMES as u32);
        }
    }

    /// Close the codec
    pub fn shutdown(&mut self, cx: &mut Context) -> Poll<io::Result<()>> {
        if !self.final_flush_done {
            ready!(self.flush(cx))?;
            self.final_flush_done = true;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The most slices one vectored write hands the socket (mcp-xds-gateway's
/// patch; `tokio_util::io::poll_write_buf` gives 64): a DATA frame whose
/// payload is many parts (a response made of the cache's stored pieces)
/// goes in one `writev`. Linux takes 1,024 (`UIO_MAXIOV`); the array is on
/// the connection task's stack, 16 bytes a slice.
const MAX_IO_SLICES: usize = 1024;

/// The slices a write first gathers into (mcp-xds-gateway's patch): the
/// array of [`MAX_IO_SLICES`] is 16 KB written before each write (a loop of
/// about 1,400 instructions, and half of a core's first-level data cache),
/// while a few responses' frames take a few dozen slices. Only a write that
/// fills these gathers again into the large array.
const FEW_IO_SLICES: usize = 64;

/// `tokio_util::io::poll_write_buf` with up to [`MAX_IO_SLICES`] slices.
fn poll_write_buf<T: AsyncWrite + ?Sized, B: Buf>(
    io: Pin<&mut T>,
    cx: &mut Context<'_>,
    buf: &mut B,
) -> Poll<io::Result<usize>> {
    if !buf.has_remaining() {
        return Poll::Ready(Ok(0));
    }
    let n = if io.is_write_vectored() {
        let mut slices = [io::IoSlice::new(&[]); FEW_IO_SLICES];
        let cnt = buf.chunks_vectored(&mut slices);
        if cnt < FEW_IO_SLICES {
            ready!(io.poll_write_vectored(cx, &slices[..cnt]))?
        } else {
            ready!(poll_write_many(io, cx, buf))?
        }
    } else {
        ready!(io.poll_write(cx, buf.chunk()))?
    };
    buf.advance(n);
    Poll::Ready(Ok(n))
}

/// A write of more than [`FEW_IO_SLICES`] slices, gathered into
/// [`MAX_IO_SLICES`]: out of line, so that the usual write's stack frame
/// does not hold the large array.
#[cold]
#[inline(never)]
fn poll_write_many<T: AsyncWrite + ?Sized, B: Buf>(
    io: Pin<&mut T>,
    cx: &mut Context<'_>,
    buf: &B,
) -> Poll<io::Result<usize>> {
    let mut slices = [io::IoSlice::new(&[]); MAX_IO_SLICES];
    let cnt = buf.chunks_vectored(&mut slices);
    io.poll_write_vectored(cx, &slices[..cnt])
}

/// What an encoder holds to write, in order: the buffer's bytes up to each
/// queued frame's place, that frame's payload, and the buffer's bytes after
/// the last (mcp-xds-gateway's patch).
struct Pending<'a, B>(&'a mut Encoder<B>);

impl<B: Buf> Buf for Pending<'_, B> {
    fn remaining(&self) -> usize {
        let encoder = &*self.0;
        encoder.buf.remaining() + encoder.queued.iter().map(|q| q.frame.payload().remaining()).sum::<usize>()
    }

    fn chunk(&self) -> &[u8] {
        let encoder = &*self.0;
        let pos = encoder.buf.position() as usize;
        match encoder.queued.front() {
            Some(q) if pos < q.at => &encoder.buf.get_ref()[pos..q.at],
            Some(q) => q.frame.payload().chunk(),
            None => encoder.buf.chunk(),
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [io::IoSlice<'a>]) -> usize {
        let encoder = &*self.0;
        let buf = &encoder.buf.get_ref()[..];
        let mut pos = encoder.buf.position() as usize;
        let mut n = 0;
        for q in &encoder.queued {
            if n == dst.len() {
                return n;
            }
            if pos < q.at {
                dst[n] = io::IoSlice::new(&buf[pos..q.at]);
                n += 1;
                pos = q.at;
                if n == dst.len() {
                    return n;
                }
            }
            n += q.frame.payload().chunks_vectored(&mut dst[n..]);
            if n == dst.len() {
                // Its payload may have more slices than were room: what
                // follows it waits for the next write.
                return n;
            }
        }
        if pos < buf.len() && n < dst.len() {
            dst[n] = io::IoSlice::new(&buf[pos..]);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        let encoder = &mut *self.0;
        while cnt > 0 {
            let Some(q) = encoder.queued.front_mut() else {
                encoder.buf.advance(cnt);
                return;
            };
            let pos = encoder.buf.position() as usize;
            if pos < q.at {
                let n = cnt.min(q.at - pos);
                encoder.buf.advance(n);
                cnt -= n;
                continue;
            }
            let n = cnt.min(q.frame.payload().remaining());
            q.frame.payload_mut().advance(n);
            cnt -= n;
            if !q.frame.payload().has_remaining() {
                let q = encoder.queued.pop_front().expect("the front frame");
                if q.returned {
                    encoder.last_data_frame = Some(q.frame);
                }
            }
        }
    }
}

#[must_use]
enum ControlFlow {
    Continue,
    Break,
}

impl<B> Encoder<B>
where
    B: Buf,
{
    /// A released (or not yet made) buffer made whole.
    fn make_buffer(&mut self) {
        if self.buf.get_ref().capacity() == 0 {
            *self.buf.get_mut() = super::pool::take(super::pool::Kind::Write);
        }
    }

    fn unset_frame(&mut self) -> ControlFlow {
        // Everything buffered and queued was written (each queued frame
        // handed back or dropped as its payload went, `Pending::advance`).
        debug_assert!(self.queued.is_empty());
        self.buf.set_position(0);
        self.buf.get_mut().clear();

        match self.continuation.take() {
            Some(frame) => {
                // Buffer the continuation frame, then try to write again
                let mut buf = limited_write_buf!(self);
                if let Some(continuation) = frame.encode(&mut buf) {
                    self.continuation = Some(continuation);
                }
                ControlFlow::Continue
            }
            None => ControlFlow::Break,
        }
    }

    fn buffer(&mut self, item: Frame<B>) -> Result<(), UserError> {
        // Ensure that we have enough capacity to accept the write.
        assert!(self.has_capacity());
        self.make_buffer();
        let span = tracing::trace_span!("FramedWrite::buffer", frame = ?item);
        let _e = span.enter();

        tracing::debug!(frame = ?item, "send");

        match item {
            Frame::Data(v) => self.buffer_data(v, false)?,
            Frame::Headers(v) => {
                let mut buf = limited_write_buf!(self);
                if let Some(continuation) = v.encode(&mut self.hpack, &mut buf) {
                    self.continuation = Some(continuation);
                }
            }
            Frame::PushPromise(v) => {
                let mut buf = limited_write_buf!(self);
                if let Some(continuation) = v.encode(&mut self.hpack, &mut buf) {
                    self.continuation = Some(continuation);
                }
            }
            Frame::Settings(v) => {
                v.encode(self.buf.get_mut());
                tracing::trace!(rem = self.buf.remaining(), "encoded settings");
            }
            Frame::GoAway(v) => {
                v.encode(self.buf.get_mut());
                tracing::trace!(rem = self.buf.remaining(), "encoded go_away");
            }
            Frame::Ping(v) => {
                v.encode(self.buf.get_mut());
                tracing::trace!(rem = self.buf.remaining(), "encoded ping");
            }
            Frame::WindowUpdate(v) => {
                v.encode(self.buf.get_mut());
                tracing::trace!(rem = self.buf.remaining(), "encoded window_update");
            }

            Frame::Priority(_) => {
                /*
                v.encode(self.buf.get_mut());
                tracing::trace!("encoded priority; rem={:?}", self.buf.remaining());
                */
                unimplemented!();
            }
            Frame::Reset(v) => {
                v.encode(self.buf.get_mut());
                tracing::trace!(rem = self.buf.remaining(), "encoded reset");
            }
        }

        Ok(())
    }

    /// Buffers a DATA frame. `whole`: its payload is all its stream's
    /// buffer holds, so nothing is handed back once it is written
    /// (mcp-xds-gateway's patch; see [`Queued::returned`]).
    fn buffer_data(&mut self, mut v: frame::Data<B>, whole: bool) -> Result<(), UserError> {
        // Ensure that the payload is not greater than the max frame.
        let len = v.payload().remaining();

        if len > self.max_frame_size() {
            return Err(PayloadTooBig);
        }

        if len >= self.chain_threshold {
            let head = v.head();

            // Encode the frame head to the buffer
            head.encode(len, self.buf.get_mut());

            if self.buf.get_ref().remaining() < self.chain_threshold {
                let extra_bytes = self.chain_threshold - self.buf.remaining();
                self.buf.get_mut().put(v.payload_mut().take(extra_bytes));
            }

            // Queue the data frame, its payload after what is buffered.
            let at = self.buf.get_ref().len();
            if self.queued.capacity() == 0 {
                self.queued.reserve(self.queued_room.room());
            }
            self.queued.push_back(Queued {
                at,
                frame: v,
                returned: !whole,
            });
            self.queued_room.held(self.queued.len());
        } else {
            v.encode_chunk(self.buf.get_mut());

            // The chunk has been fully encoded, so there is no need to
            // keep it around
            assert_eq!(v.payload().remaining(), 0, "chunk not fully encoded");

            // Save off the last frame...
            if !whole {
                self.last_data_frame = Some(v);
            }
        }
        Ok(())
    }

    fn has_capacity(&self) -> bool {
        // A buffer of no capacity is a released one, made whole by `buffer`.
        self.continuation.is_none()
            && self.queued.back().is_none_or(|q| !q.returned)
            && self.queued.len() < MAX_QUEUED_FRAMES
            && (self.buf.get_ref().capacity() == 0
                || self.buf.get_ref().capacity() - self.buf.get_ref().len()
                    >= self.min_buffer_capacity)
    }

    fn is_empty(&self) -> bool {
        self.queued.is_empty() && !self.buf.has_remaining()
    }
}

impl<B> Encoder<B> {
    fn max_frame_size(&self) -> usize {
        self.max_frame_size as usize
    }
}

impl<T, B> FramedWrite<T, B> {
    /// Returns the max frame size that can be sent
    pub fn max_frame_size(&self) -> usize {
        self.encoder.max_frame_size()
    }

    /// Set the peer's max frame size.
    pub fn set_max_frame_size(&mut self, val: usize) {
        assert!(val <= frame::MAX_MAX_FRAME_SIZE as usize);
        self.encoder.max_frame_size = val as FrameSize;
    }

    /// Set the peer's header table size.
    pub fn set_header_table_size(&mut self, val: usize) {
        self.encoder.hpack.update_max_size(val);
    }

    /// Retrieve the last data frame that has been sent
    pub fn take_last_data_frame(&mut self) -> Option<frame::Data<B>> {
        self.encoder.last_data_frame.take()
    }

    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: AsyncRead + Unpin, B> AsyncRead for FramedWrite<T, B> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

// We never project the Pin to `B`.
impl<T: Unpin, B> Unpin for FramedWrite<T, B> {}

#[cfg(feature = "unstable")]
mod unstable {
    use super::*;

    impl<T, B> FramedWrite<T, B> {
        pub fn get_ref(&self) -> &T {
            &self.inner
        }
    }
}
