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
}
