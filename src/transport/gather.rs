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
/// where its parts lie, with no list of them made per write).
pub enum Payload {
    Parts(Gathered),
    Made(Box<dyn Buf + Send>),
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
        }
    }

    fn chunk(&self) -> &[u8] {
        match self {
            Payload::Parts(parts) => parts.chunk(),
            Payload::Made(buf) => buf.chunk(),
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        match self {
            Payload::Parts(parts) => parts.chunks_vectored(dst),
            Payload::Made(buf) => buf.chunks_vectored(dst),
        }
    }

    fn advance(&mut self, cnt: usize) {
        match self {
            Payload::Parts(parts) => parts.advance(cnt),
            Payload::Made(buf) => buf.advance(cnt),
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        match self {
            Payload::Parts(parts) => parts.copy_to_bytes(len),
            Payload::Made(buf) => buf.copy_to_bytes(len),
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

    /// The vendored h2 writes a frame of many parts with up to 256 slices a
    /// write, trimming the last slice where the frame is cut (by 16 KiB
    /// frames and a small window here, in the middle of parts): what the
    /// peer reads is every part, in order, over a real TCP socket (the
    /// vectored path).
    #[tokio::test]
    async fn a_frame_of_hundreds_of_parts_cut_anywhere_arrives_whole() {
        use std::time::Duration;
        let within = |what: &'static str| move |_| -> String { format!("timed out: {what}") };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // 700 parts of 1 to 600 bytes, each byte its position's.
        let mut sent = Vec::new();
        let mut gathered = Gathered::default();
        for i in 0..700usize {
            let part: Vec<u8> = (0..1 + (i * 37) % 600)
                .map(|j| ((sent.len() + j) % 251) as u8)
                .collect();
            sent.extend_from_slice(&part);
            gathered.push(Bytes::from(part));
        }
        let expected = sent.clone();
        let server = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let mut connection = h2::server::Builder::new()
                .handshake::<_, Gathered>(socket)
                .await
                .unwrap();
            let (_request, mut respond) = connection.accept().await.unwrap().unwrap();
            let mut send = respond.send_response(http::Response::new(()), false).unwrap();
            send.send_data(gathered, true).unwrap();
            // Drives the connection until the client is done.
            while connection.accept().await.is_some() {}
        });
        let socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::Builder::new()
            .initial_window_size(7_001)
            .max_frame_size(16_384)
            .handshake::<_, Bytes>(socket)
            .await
            .unwrap();
        tokio::spawn(connection);
        let mut client = client.ready().await.unwrap();
        let request = http::Request::get("http://127.0.0.1/").body(()).unwrap();
        let (response, _) = client.send_request(request, true).unwrap();
        let read = async {
            let mut body = response.await.unwrap().into_body();
            let mut got = Vec::new();
            while let Some(data) = body.data().await {
                let data = data.unwrap();
                body.flow_control().release_capacity(data.len()).unwrap();
                got.extend_from_slice(&data);
            }
            got
        };
        let got = tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .map_err(within("the body"))
            .unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes arrived out of order or changed");
        server.abort();
    }
}
