//! Watches the HTTP/2 frames a peer sends as they pass through the socket,
//! without buffering or copying them: nine bytes of frame header at a time.
//!
//! It tells the connection's task two things h2 does not: when the peer's
//! first SETTINGS frame has arrived (the handshake is complete, for the
//! handshake and connect timeouts), and when the peer floods control frames
//! (resets, pings, SETTINGS, window updates, priorities, unknown types)
//! faster than any real client does. h2 bounds resets of streams not yet
//! accepted, resets it causes itself and empty or tiny DATA frames (empty
//! ones are counted here too, but h2 cuts them first; the gateway counts
//! h2's cuts as `h2_resets`); resets of accepted streams (a rapid-reset
//! flood that trickles in after acceptance) and ping or SETTINGS floods are
//! counted here, so a flooding connection gets GOAWAY `ENHANCE_YOUR_CALM`.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use super::bucket::TokenBucket;

const PREFACE_LEN: usize = 24;
const HEADER_LEN: usize = 9;

const DATA: u8 = 0x0;
const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const WINDOW_UPDATE: u8 = 0x8;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const FLAG_ACK: u8 = 0x1;
const FLAG_END_STREAM: u8 = 0x1;

/// Which end of the connection reads through the sniffer: a server reads the
/// client's 24-byte preface before the first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Server,
    Client,
}

/// How many control frames of each kind a peer may send a minute (each a
/// token bucket that bursts to the whole minute's allowance).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloodLimits {
    pub resets_per_minute: u32,
    pub pings_per_minute: u32,
    pub settings_per_minute: u32,
    pub control_frames_per_minute: u32,
}

/// What the sniffer tells the connection's task.
#[derive(Debug, Default)]
pub struct Signals {
    settings_seen: AtomicBool,
    /// Why the connection ended before the peer's SETTINGS arrived.
    ended: OnceLock<String>,
    settings_notify: Notify,
    flood: OnceLock<&'static str>,
    flood_notify: Notify,
}

impl Signals {
    /// The peer's first SETTINGS frame has been read.
    pub fn handshake_done(&self) -> bool {
        self.settings_seen.load(Ordering::Acquire)
    }

    /// Resolves once the peer's first SETTINGS frame has been read, or with
    /// why the connection ended before it (end of stream, a read error such
    /// as a TLS alert).
    pub async fn handshake(&self) -> Result<(), String> {
        loop {
            let notified = self.settings_notify.notified();
            if self.handshake_done() {
                return Ok(());
            }
            if let Some(reason) = self.ended.get() {
                return Err(reason.clone());
            }
            notified.await;
        }
    }

    fn end(&self, reason: String) {
        if self.ended.set(reason).is_ok() {
            self.settings_notify.notify_waiters();
        }
    }

    /// The limit a peer flooded past, if any (`resets`, `pings`, `settings`,
    /// `control_frames`).
    pub fn flooded(&self) -> Option<&'static str> {
        self.flood.get().copied()
    }

    /// Resolves with the limit once the peer floods past one.
    pub async fn flood(&self) -> &'static str {
        loop {
            let notified = self.flood_notify.notified();
            if let Some(limit) = self.flooded() {
                return limit;
            }
            notified.await;
        }
    }
}

#[derive(Debug)]
enum State {
    Preface { left: usize },
    Header { bytes: [u8; HEADER_LEN], filled: usize },
    Payload { left: usize },
}

#[derive(Debug)]
struct Guard {
    resets: TokenBucket,
    pings: TokenBucket,
    settings: TokenBucket,
    control: TokenBucket,
}

impl Guard {
    fn new(limits: FloodLimits) -> Self {
        Self {
            resets: TokenBucket::per_minute(limits.resets_per_minute),
            pings: TokenBucket::per_minute(limits.pings_per_minute),
            settings: TokenBucket::per_minute(limits.settings_per_minute),
            control: TokenBucket::per_minute(limits.control_frames_per_minute),
        }
    }

    /// The limit this frame goes over, if any.
    fn frame(&mut self, kind: u8, flags: u8, len: usize) -> Option<&'static str> {
        let (bucket, limit) = match kind {
            RST_STREAM => (&mut self.resets, "resets"),
            // ACKs too: the gateway pings rarely, and h2 logs every ACK of
            // a ping it never sent.
            PING => (&mut self.pings, "pings"),
            SETTINGS if flags & FLAG_ACK == 0 => (&mut self.settings, "settings"),
            PRIORITY | WINDOW_UPDATE => (&mut self.control, "control_frames"),
            // An empty DATA frame that does not end its stream carries
            // nothing. Counted here too, but h2 ends the connection first,
            // at its 101st empty DATA frame (counted as `h2_resets`), unless
            // this budget runs out sooner (set to 100 a minute or fewer, or
            // spent on other control frames).
            DATA if len == 0 && flags & FLAG_END_STREAM == 0 => (&mut self.control, "control_frames"),
            DATA | HEADERS | CONTINUATION | GOAWAY | PUSH_PROMISE | SETTINGS => return None,
            // Unknown frame types are ignored by HTTP/2, so they cost a
            // reader something and deliver nothing.
            _ => (&mut self.control, "control_frames"),
        };
        (!bucket.take()).then_some(limit)
    }
}

#[derive(Debug)]
struct Parser {
    state: State,
    guard: Option<Guard>,
    signals: Arc<Signals>,
}

impl Parser {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Preface { left } => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.state = State::Header {
                            bytes: [0; HEADER_LEN],
                            filled: 0,
                        };
                    }
                }
                State::Header { bytes: header, filled } => {
                    let n = (HEADER_LEN - *filled).min(bytes.len());
                    header[*filled..*filled + n].copy_from_slice(&bytes[..n]);
                    *filled += n;
                    bytes = &bytes[n..];
                    if *filled == HEADER_LEN {
                        let header = *header;
                        self.frame(&header);
                    }
                }
                State::Payload { left } => {
                    let n = (*left).min(bytes.len());
                    *left -= n;
                    bytes = &bytes[n..];
                    if *left == 0 {
                        self.state = State::Header {
                            bytes: [0; HEADER_LEN],
                            filled: 0,
                        };
                    }
                }
            }
        }
    }

    fn frame(&mut self, header: &[u8; HEADER_LEN]) {
        let len = (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2]);
        let (kind, flags) = (header[3], header[4]);
        if kind == SETTINGS && flags & FLAG_ACK == 0 && !self.signals.settings_seen.swap(true, Ordering::AcqRel) {
            self.signals.settings_notify.notify_waiters();
        }
        if let Some(limit) = self.guard.as_mut().and_then(|g| g.frame(kind, flags, len)) {
            if self.signals.flood.set(limit).is_ok() {
                self.signals.flood_notify.notify_waiters();
            }
        }
        self.state = if len == 0 {
            State::Header {
                bytes: [0; HEADER_LEN],
                filled: 0,
            }
        } else {
            State::Payload { left: len }
        };
    }
}

/// An I/O object that shows the sniffer every byte it reads.
#[derive(Debug)]
pub struct Sniffed<T> {
    io: T,
    parser: Parser,
    /// Closing a flooding connection: the write half is shut, and what the
    /// peer still sends is read and dropped (up to this many bytes) so the
    /// socket closes with a FIN, not a reset that would destroy the GOAWAY
    /// waiting in the peer's receive buffer.
    closing: Option<usize>,
}

/// What a flooding peer's socket is drained of, at most, before it closes.
const CLOSE_DRAIN_BYTES: usize = 4 << 20;

impl<T> Sniffed<T> {
    /// `limits` None: only the handshake is watched (the upstream client).
    pub fn new(io: T, side: Side, limits: Option<FloodLimits>) -> (Self, Arc<Signals>) {
        let signals = Arc::new(Signals::default());
        let state = match side {
            Side::Server => State::Preface { left: PREFACE_LEN },
            Side::Client => State::Header {
                bytes: [0; HEADER_LEN],
                filled: 0,
            },
        };
        let parser = Parser {
            state,
            guard: limits.map(Guard::new),
            signals: signals.clone(),
        };
        (
            Self {
                io,
                parser,
                closing: None,
            },
            signals,
        )
    }

    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Sniffed<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        match &result {
            Poll::Ready(Ok(())) if room && buf.filled().len() == before => {
                this.parser.signals.end("the peer closed the connection".into())
            }
            Poll::Ready(Ok(())) => this.parser.feed(&buf.filled()[before..]),
            Poll::Ready(Err(e)) => this.parser.signals.end(e.to_string()),
            Poll::Pending => {}
        }
        result
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Sniffed<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.parser.signals.flooded().is_none() {
            return Pin::new(&mut this.io).poll_shutdown(cx);
        }
        // A flood: the GOAWAY went out before this; the write half is shut,
        // then the peer's remaining bytes are drained (the connection's task
        // bounds how long).
        if this.closing.is_none() {
            std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
            this.closing = Some(CLOSE_DRAIN_BYTES);
        }
        let mut scratch = [0u8; 8192];
        while let Some(left) = this.closing.filter(|left| *left > 0) {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => this.closing = Some(left.saturating_sub(buf.filled().len())),
                Poll::Ready(Err(_)) => break,
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: FloodLimits = FloodLimits {
        resets_per_minute: 3,
        pings_per_minute: 2,
        settings_per_minute: 2,
        control_frames_per_minute: 2,
    };

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut bytes = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags, 0, 0, 0, 1];
        bytes.extend_from_slice(payload);
        bytes
    }

    fn parser(side: Side) -> Parser {
        let (sniffed, _) = Sniffed::new((), side, Some(LIMITS));
        sniffed.parser
    }

    /// Feeds `bytes` one byte at a time: frames split anywhere still parse.
    fn feed_bytewise(parser: &mut Parser, bytes: &[u8]) {
        for byte in bytes {
            parser.feed(std::slice::from_ref(byte));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_handshake_is_the_first_settings_after_the_preface() {
        let mut p = parser(Side::Server);
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        feed_bytewise(&mut p, &bytes);
        assert!(!p.signals.handshake_done(), "the preface alone is not the handshake");
        bytes = frame(SETTINGS, 0, &[0, 3, 0, 0, 0, 100]);
        feed_bytewise(&mut p, &bytes[..10]);
        assert!(p.signals.handshake_done());

        let mut client = parser(Side::Client);
        client.feed(&frame(SETTINGS, FLAG_ACK, &[]));
        assert!(!client.signals.handshake_done(), "an ACK is not the peer's SETTINGS");
        client.feed(&frame(SETTINGS, 0, &[]));
        assert!(client.signals.handshake_done());
    }

    /// Closing a flooding connection shuts the write half, then reads what
    /// the peer still sends until it closes: the socket then ends with a FIN,
    /// never a reset that would destroy the GOAWAY in the peer's buffer.
    #[tokio::test]
    async fn a_flooding_peer_is_drained_before_the_connection_closes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut peer) = tokio::io::duplex(1024);
        let (mut sniffed, signals) = Sniffed::new(server, Side::Client, Some(LIMITS));
        let mut flood = Vec::new();
        for _ in 0..10 {
            flood.extend(frame(PING, 0, &[0u8; 8]));
        }
        peer.write_all(&flood).await.unwrap();
        let mut read = [0u8; 1024];
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), sniffed.read(&mut read))
            .await
            .unwrap();
        assert_eq!(signals.flooded(), Some("pings"));
        // The peer goes on writing (more than the pipe holds), then closes.
        let rest = vec![0u8; 64 * 1024];
        let writer = async move {
            peer.write_all(&rest).await.unwrap();
            peer.shutdown().await.unwrap();
            let mut tail = Vec::new();
            peer.read_to_end(&mut tail).await.unwrap();
            tail
        };
        let (shut, tail) = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            tokio::join!(sniffed.shutdown(), writer)
        })
        .await
        .expect("the drain ends when the peer closes");
        shut.unwrap();
        assert!(tail.is_empty(), "the peer saw the write half shut (EOF), nothing else");
        let drained = CLOSE_DRAIN_BYTES - sniffed.closing.expect("closing");
        assert!(
            drained >= 64 * 1024,
            "what the peer sent after the flood was read: {drained}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn floods_of_each_kind_trip_their_own_limit() {
        for (kind, flags, payload, limit) in [
            (RST_STREAM, 0, &[0u8, 0, 0, 8][..], "resets"),
            (PING, 0, &[0u8; 8][..], "pings"),
            (PING, FLAG_ACK, &[0u8; 8][..], "pings"),
            (SETTINGS, 0, &[][..], "settings"),
            (WINDOW_UPDATE, 0, &[0u8, 0, 0, 1][..], "control_frames"),
            (PRIORITY, 0, &[0u8, 0, 0, 0, 15][..], "control_frames"),
            (DATA, 0, &[][..], "control_frames"),
            (0x42, 0, &[1u8, 2, 3][..], "control_frames"),
        ] {
            let mut p = parser(Side::Client);
            let mut bytes = Vec::new();
            for _ in 0..10 {
                bytes.extend(frame(kind, flags, payload));
            }
            p.feed(&bytes);
            assert_eq!(p.signals.flooded(), Some(limit), "frame type {kind:#x}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn acks_data_and_headers_are_never_counted() {
        let mut p = parser(Side::Client);
        let mut bytes = Vec::new();
        for _ in 0..100 {
            bytes.extend(frame(SETTINGS, FLAG_ACK, &[]));
            bytes.extend(frame(DATA, 0, b"payload"));
            bytes.extend(frame(DATA, FLAG_END_STREAM, &[]));
            bytes.extend(frame(HEADERS, 0x4, b"\x82"));
        }
        feed_bytewise(&mut p, &bytes);
        assert_eq!(p.signals.flooded(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_steady_trickle_is_not_a_flood() {
        let mut p = parser(Side::Client);
        for _ in 0..20 {
            p.feed(&frame(RST_STREAM, 0, &[0, 0, 0, 8]));
            // 3 a minute: one every 20 s refills as fast as it is spent.
            tokio::time::advance(std::time::Duration::from_secs(21)).await;
        }
        assert_eq!(p.signals.flooded(), None);
    }
}
