//! A response's parts gathered into one HTTP/2 DATA frame without copying:
//! the gRPC frame header, the shared chunks of the cache and the per-client
//! suffix stay separate `Bytes`, and reach the socket as one vectored write
//! (h2 hands a frame's payload to `writev` through `Buf::chunks_vectored`).

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes};

/// Parts gathered for one `send_data`, written in order.
#[derive(Debug, Default)]
pub struct Gathered {
    parts: VecDeque<Bytes>,
    remaining: usize,
}

impl Gathered {
    pub fn push(&mut self, part: Bytes) {
        if !part.is_empty() {
            self.remaining += part.len();
            self.parts.push_back(part);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.remaining == 0
    }
}

impl From<Bytes> for Gathered {
    fn from(part: Bytes) -> Self {
        let mut gathered = Gathered::default();
        gathered.push(part);
        gathered
    }
}

impl Buf for Gathered {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |part| &part[..])
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, part) in dst.iter_mut().zip(&self.parts) {
            *slot = IoSlice::new(part);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advanced past the end of a gathered buffer");
        self.remaining -= cnt;
        while cnt > 0 {
            let front = self.parts.front_mut().expect("remaining counts the parts");
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.parts.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        // A whole front part is handed out as it is.
        if self.parts.front().is_some_and(|part| part.len() == len) {
            self.remaining -= len;
            return self.parts.pop_front().expect("checked above");
        }
        let mut out = bytes::BytesMut::with_capacity(len);
        out.put(self.take(len));
        out.freeze()
    }
}

/// What a stream's `send_data` writes: parts gathered by the listener (a
/// body's frames), or a buffer a service made itself (a response read from
/// where its parts lie, with no list of them made per write), or a message
/// whole in one buffer behind its 5-byte gRPC frame header.
pub enum Payload {
    Parts(Gathered),
    Made(Box<dyn Buf + Send>),
    Message(Message),
}

/// A gRPC message in one buffer behind its frame header: nothing boxed, no
/// list of parts (a small response made whole, `ResponseWriter::write_message`).
#[derive(Debug)]
pub struct Message {
    header: [u8; 5],
    /// How much of the header was written.
    head: usize,
    body: Bytes,
}

impl Message {
    pub fn new(header: [u8; 5], body: Bytes) -> Self {
        Self { header, head: 0, body }
    }
}

impl Buf for Message {
    fn remaining(&self) -> usize {
        self.header.len() - self.head + self.body.len()
    }

    fn chunk(&self) -> &[u8] {
        if self.head < self.header.len() {
            &self.header[self.head..]
        } else {
            &self.body
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        let header = &self.header[self.head..];
        for part in [header, &self.body[..]] {
            if n < dst.len() && !part.is_empty() {
                dst[n] = IoSlice::new(part);
                n += 1;
            }
        }
        n
    }

    fn advance(&mut self, cnt: usize) {
        assert!(cnt <= self.remaining(), "advanced past the end of a message");
        let head = cnt.min(self.header.len() - self.head);
        self.head += head;
        self.body.advance(cnt - head);
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Payload").field("remaining", &self.remaining()).finish()
    }
}

impl Buf for Payload {
    fn remaining(&self) -> usize {
        match self {
            Payload::Parts(parts) => parts.remaining(),
            Payload::Made(buf) => buf.remaining(),
            Payload::Message(message) => message.remaining(),
        }
    }

    fn chunk(&self) -> &[u8] {
        match self {
            Payload::Parts(parts) => parts.chunk(),
            Payload::Made(buf) => buf.chunk(),
            Payload::Message(message) => message.chunk(),
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        match self {
            Payload::Parts(parts) => parts.chunks_vectored(dst),
            Payload::Made(buf) => buf.chunks_vectored(dst),
            Payload::Message(message) => message.chunks_vectored(dst),
        }
    }

    fn advance(&mut self, cnt: usize) {
        match self {
            Payload::Parts(parts) => parts.advance(cnt),
            Payload::Made(buf) => buf.advance(cnt),
            Payload::Message(message) => message.advance(cnt),
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        match self {
            Payload::Parts(parts) => parts.copy_to_bytes(len),
            Payload::Made(buf) => buf.copy_to_bytes(len),
            Payload::Message(message) => message.copy_to_bytes(len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_read_in_order_across_any_advance() {
        let mut gathered = Gathered::default();
        for part in [&b"head"[..], b"", b"shared-1", b"shared-2", b"x"] {
            gathered.push(Bytes::copy_from_slice(part));
        }
        assert_eq!(gathered.remaining(), 21);
        let mut slices = [IoSlice::new(&[]); 8];
        assert_eq!(gathered.chunks_vectored(&mut slices), 4, "empty parts are left out");
        let mut two = [IoSlice::new(&[]); 2];
        assert_eq!(gathered.chunks_vectored(&mut two), 2);
        gathered.advance(6);
        assert_eq!(gathered.chunk(), b"ared-1");
        let mut rest = Vec::new();
        while gathered.has_remaining() {
            let n = gathered.chunk().len().min(3);
            rest.extend_from_slice(&gathered.chunk()[..n]);
            gathered.advance(n);
        }
        assert_eq!(rest, b"ared-1shared-2x");
        assert!(gathered.is_empty());
    }

    /// A message whole in one buffer reads as its header, then its body,
    /// however it is read: in chunks, in slices of any number, advanced by
    /// any count.
    #[test]
    fn a_message_reads_as_its_header_then_its_body_across_any_advance() {
        use proptest::prelude::*;
        let steps = proptest::collection::vec((1usize..16, 0usize..4), 1..20);
        proptest!(|(body in proptest::collection::vec(any::<u8>(), 0..40), steps in steps)| {
            let header = [0, 0, 0, 0, u8::try_from(body.len()).unwrap()];
            let mut whole = header.to_vec();
            whole.extend_from_slice(&body);
            let mut message = Payload::Message(Message::new(header, Bytes::from(body)));
            let mut read = Vec::new();
            for (count, slices) in steps.iter().cycle().take(1_000) {
                if !message.has_remaining() {
                    break;
                }
                prop_assert_eq!(message.remaining(), whole.len() - read.len());
                prop_assert!(!message.chunk().is_empty());
                let mut dst = vec![IoSlice::new(&[]); *slices];
                let n = message.chunks_vectored(&mut dst);
                let shown: Vec<u8> = dst[..n].iter().flat_map(|s| s.iter().copied()).collect();
                prop_assert!(dst[..n].iter().all(|s| !s.is_empty()));
                prop_assert_eq!(&shown[..], &whole[read.len()..read.len() + shown.len()]);
                let take = (*count).min(message.remaining());
                read.extend_from_slice(&whole[read.len()..read.len() + take]);
                message.advance(take);
            }
            prop_assert_eq!(read, whole);
            prop_assert_eq!(message.remaining(), 0);
        });
    }

    /// The vendored h2 writes a frame of many parts with up to 1,024 slices a
    /// write, trimming the last slice where the frame is cut (by 16 KiB
    /// frames and a small window here, in the middle of parts): what the
    /// peer reads is every part, in order, over a real TCP socket (the
    /// vectored path).
    #[tokio::test]
    async fn a_frame_of_hundreds_of_parts_cut_anywhere_arrives_whole() {
        // 700 parts of 1 to 600 bytes.
        many_streams(1, 7_001, 16_384, |i| parts_of(i, 700, 600)).await;
    }

    /// A socket that counts its writes.
    struct Counted {
        socket: tokio::net::TcpStream,
        writes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    impl tokio::io::AsyncRead for Counted {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.socket).poll_read(cx, buf)
        }
    }

    impl tokio::io::AsyncWrite for Counted {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::pin::Pin::new(&mut self.socket).poll_write(cx, buf)
        }

        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::pin::Pin::new(&mut self.socket).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.socket.is_write_vectored()
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.socket).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.socket).poll_shutdown(cx)
        }
    }

    /// `streams` streams on one connection, each answered with a body of
    /// `parts(i)` parts (each byte its position's and its stream's), all
    /// queued before the server's connection is driven; the client reads
    /// them with `window` and `frame` bytes, and each must be what was
    /// sent, in order. Returns the server's writes.
    async fn many_streams(streams: usize, window: u32, frame: u32, parts: impl Fn(usize) -> Vec<Vec<u8>>) -> usize {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        let within = |what: &'static str| move |_| -> String { format!("timed out: {what}") };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies: Vec<Vec<Vec<u8>>> = (0..streams).map(&parts).collect();
        let expected: Vec<Vec<u8>> = bodies.iter().map(|b| b.concat()).collect();
        let writes = Arc::new(AtomicUsize::new(0));
        let counted = writes.clone();
        let server = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let socket = Counted {
                socket,
                writes: counted,
            };
            let mut connection = h2::server::Builder::new()
                .handshake::<_, Gathered>(socket)
                .await
                .unwrap();
            let mut responds = Vec::new();
            for _ in 0..streams {
                let (request, respond) = connection.accept().await.unwrap().unwrap();
                let path = request.uri().path().trim_start_matches('/').parse::<usize>().unwrap();
                responds.push((path, respond));
            }
            // Every response queued before the connection writes any.
            let mut sends = Vec::new();
            for (i, mut respond) in responds {
                let mut send = respond.send_response(http::Response::new(()), false).unwrap();
                let mut gathered = Gathered::default();
                for part in &bodies[i] {
                    gathered.push(Bytes::copy_from_slice(part));
                }
                send.send_data(gathered, true).unwrap();
                sends.push(send);
            }
            // Drives the connection until the client is done.
            while connection.accept().await.is_some() {}
            drop(sends);
        });
        let socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::Builder::new()
            .initial_window_size(window)
            .initial_connection_window_size(window.max(65_535))
            .max_frame_size(frame)
            .handshake::<_, Bytes>(socket)
            .await
            .unwrap();
        tokio::spawn(connection);
        let mut reads = Vec::new();
        for i in 0..streams {
            let mut client = client.clone().ready().await.unwrap();
            let request = http::Request::get(format!("http://127.0.0.1/{i}")).body(()).unwrap();
            let (response, _) = client.send_request(request, true).unwrap();
            reads.push(tokio::spawn(async move {
                let mut body = response.await.unwrap().into_body();
                let mut got = Vec::new();
                while let Some(data) = body.data().await {
                    let data = data.unwrap();
                    body.flow_control().release_capacity(data.len()).unwrap();
                    got.extend_from_slice(&data);
                }
                got
            }));
        }
        for (i, read) in reads.into_iter().enumerate() {
            let got = tokio::time::timeout(Duration::from_secs(10), read)
                .await
                .map_err(within("a body"))
                .unwrap()
                .unwrap();
            assert!(
                got == expected[i],
                "stream {i}: {} bytes read, {} sent, not the same bytes in the same order",
                got.len(),
                expected[i].len()
            );
        }
        server.abort();
        writes.load(Ordering::Relaxed)
    }

    /// Stream `i`'s parts: `count` parts of 1 to `most` bytes.
    fn parts_of(i: usize, count: usize, most: usize) -> Vec<Vec<u8>> {
        let mut at = 0;
        (0..count)
            .map(|k| {
                let part: Vec<u8> = (0..1 + (k * 37 + i * 11) % most)
                    .map(|j| ((at + j + i * 7) % 251) as u8)
                    .collect();
                at += part.len();
                part
            })
            .collect()
    }

    /// The vendored h2 queues the DATA frames of many streams for one write
    /// when each is its stream's whole buffer: 40 responses of 50 parts
    /// (a named response's shape) queued at once reach the socket in a few
    /// writes, each arriving whole on its own stream.
    #[tokio::test]
    async fn the_responses_of_many_streams_go_in_a_few_writes() {
        let writes = many_streams(40, 1 << 20, 1 << 20, |i| parts_of(i, 50, 500)).await;
        // One write per response before the patch (h2 held one chained
        // frame); the handshake and the headers take a few of their own.
        assert!(writes < 20, "{writes} writes for 40 responses");
    }

    /// Frames cut by the frame size and the window (their streams' data
    /// goes on past them) among whole ones: each stream's body arrives
    /// whole and in order.
    #[tokio::test]
    async fn frames_cut_among_whole_ones_arrive_whole_on_their_streams() {
        many_streams(30, 7_001, 16_384, |i| {
            // Small, medium and larger than the window and a frame.
            let most = [40, 300, 2_000][i % 3];
            parts_of(i, 1 + (i * 13) % 60, most)
        })
        .await;
    }
}
