//! A raw HTTP/2 peer for the abuse tests: it writes frames byte by byte, as a
//! hostile or broken client would, and reads what the gateway answers (the
//! GOAWAY code and its debug data above all). No HTTP/2 library stands
//! between the test and the wire.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::within;

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const ACK: u8 = 0x1;

pub const ENHANCE_YOUR_CALM: u32 = 0xb;
pub const REFUSED_STREAM: u32 = 0x7;
pub const CANCEL: u32 = 0x8;
pub const NO_ERROR: u32 = 0x0;

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A GOAWAY's error code and debug data.
    pub fn goaway(&self) -> Option<(u32, String)> {
        (self.kind == GOAWAY).then(|| {
            let code = u32::from_be_bytes(self.payload[4..8].try_into().unwrap());
            (code, String::from_utf8_lossy(&self.payload[8..]).into_owned())
        })
    }

    /// SETTINGS parameters (id, value).
    pub fn settings(&self) -> Vec<(u16, u32)> {
        self.payload
            .chunks_exact(6)
            .map(|c| {
                (
                    u16::from_be_bytes([c[0], c[1]]),
                    u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                )
            })
            .collect()
    }
}

pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut bytes = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    bytes.extend_from_slice(&stream.to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

fn hpack_string(out: &mut Vec<u8>, value: &[u8]) {
    // 7-bit prefix length, no Huffman.
    if value.len() < 127 {
        out.push(value.len() as u8);
    } else {
        out.push(0x7f);
        let mut rest = value.len() - 127;
        while rest >= 128 {
            out.push((rest % 128) as u8 | 0x80);
            rest /= 128;
        }
        out.push(rest as u8);
    }
    out.extend_from_slice(value);
}

/// A HEADERS frame starting a gRPC call of `path` on `stream`, with an extra
/// header of `padding` bytes (for the header-list limit).
pub fn grpc_headers(stream: u32, path: &str, padding: usize) -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    block.push(0x04); // :path, literal without indexing
    hpack_string(&mut block, path.as_bytes());
    block.push(0x01); // :authority
    hpack_string(&mut block, b"localhost");
    block.extend_from_slice(&[0x0f, 0x10]); // content-type
    hpack_string(&mut block, b"application/grpc");
    block.push(0x00);
    hpack_string(&mut block, b"te");
    hpack_string(&mut block, b"trailers");
    if padding > 0 {
        block.push(0x00);
        hpack_string(&mut block, b"x-padding");
        hpack_string(&mut block, &vec![b'a'; padding]);
    }
    frame(HEADERS, END_HEADERS, stream, &block)
}

pub struct RawConn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl RawConn {
    /// Connects and sends nothing.
    pub async fn tcp(addr: SocketAddr) -> Self {
        let stream = within("a TCP connection", TcpStream::connect(addr)).await.unwrap();
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects from a chosen loopback address (127.0.0.2, ...): another peer.
    pub async fn tcp_from(addr: SocketAddr, from: std::net::IpAddr) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::new(from, 0)).unwrap();
        let stream = within("a TCP connection", socket.connect(addr)).await.unwrap();
        Self {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects and sends the preface and empty SETTINGS (the server's
    /// SETTINGS are never ACKed: a raw peer).
    pub async fn http2(addr: SocketAddr) -> Self {
        let mut conn = Self::tcp(addr).await;
        conn.send(PREFACE).await;
        conn.send(&frame(SETTINGS, 0, 0, &[])).await;
        conn
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        // A closed connection is an answer too: the caller reads it.
        let _ = self.stream.write_all(bytes).await;
    }

    /// The next frame, or None at the end of the connection.
    pub async fn next_frame(&mut self) -> Option<Frame> {
        within("a frame from the gateway", async {
            loop {
                if self.buf.len() >= 9 {
                    let len =
                        (usize::from(self.buf[0]) << 16) | (usize::from(self.buf[1]) << 8) | usize::from(self.buf[2]);
                    if self.buf.len() >= 9 + len {
                        let bytes: Vec<u8> = self.buf.drain(..9 + len).collect();
                        return Some(Frame {
                            kind: bytes[3],
                            flags: bytes[4],
                            stream: u32::from_be_bytes(bytes[5..9].try_into().unwrap()) & 0x7fff_ffff,
                            payload: bytes[9..].to_vec(),
                        });
                    }
                }
                let mut chunk = [0u8; 16384];
                match self.stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
    }

    /// Reads until a GOAWAY (its code and debug data) or the end of the
    /// connection (None).
    pub async fn goaway(&mut self) -> Option<(u32, String)> {
        while let Some(frame) = self.next_frame().await {
            if let Some(goaway) = frame.goaway() {
                return Some(goaway);
            }
        }
        None
    }

    /// Reads until the connection ends; returns the GOAWAY seen on the way.
    pub async fn until_closed(&mut self) -> Option<(u32, String)> {
        let mut seen = None;
        while let Some(frame) = self.next_frame().await {
            if let Some(goaway) = frame.goaway() {
                seen = Some(goaway);
            }
        }
        seen
    }

    /// Reads frames until one matches.
    pub async fn until(&mut self, what: impl Fn(&Frame) -> bool) -> Option<Frame> {
        while let Some(frame) = self.next_frame().await {
            if what(&frame) {
                return Some(frame);
            }
        }
        None
    }
}
