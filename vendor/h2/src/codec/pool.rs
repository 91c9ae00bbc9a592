//! mcp-xds-gateway's patch: the read and write buffers idle connections give
//! back (`Codec::release_idle_buffers`), kept on their thread for the next
//! connection that wakes, a few of each size. A busy gateway's connections
//! go idle and wake again with every burst they carry; each made its 8 and
//! 16 KiB buffers again from the allocator, whose large-chunk path (and the
//! consolidation its frees cause) cost more than the frames they carried.
//!
//! A buffer is kept only whole and held by nothing else (a frame split from
//! a read buffer keeps its own share until its stream reads it; such a
//! buffer goes as before), emptied, and only while fewer than [`KEPT`] of
//! its kind are: what a thread holds is bounded whatever its connections
//! do, and an idle gateway holds at most that.

use bytes::BytesMut;
use std::cell::RefCell;

/// Buffers of each kind a thread keeps at most: 8 × 8 KiB and 8 × 16 KiB.
pub(crate) const KEPT: usize = 8;

/// Which buffers, and the capacity each is made and kept with.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    Read,
    Write,
}

impl Kind {
    fn capacity(self) -> usize {
        match self {
            Kind::Read => super::framed_read::READ_BUFFER_CAPACITY,
            Kind::Write => super::framed_write::DEFAULT_BUFFER_CAPACITY,
        }
    }
}

thread_local! {
    static READ: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static WRITE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

fn with_kept<R>(kind: Kind, f: impl FnOnce(&mut Vec<BytesMut>) -> R) -> Option<R> {
    let pool = match kind {
        Kind::Read => &READ,
        Kind::Write => &WRITE,
    };
    // A thread that is ending has no pool: the allocator serves it.
    pool.try_with(|kept| kept.try_borrow_mut().ok().map(|mut kept| f(&mut kept)))
        .ok()
        .flatten()
}

/// An empty buffer of at least `kind`'s capacity: a kept one, else a new one.
pub(crate) fn take(kind: Kind) -> BytesMut {
    with_kept(kind, Vec::pop)
        .flatten()
        .unwrap_or_else(|| BytesMut::with_capacity(kind.capacity()))
}

/// Gives `buf` back: kept if it holds no byte, is whole and held by nothing
/// else, at least its kind's capacity and at most twice it (one a large
/// frame grew is not kept), and fewer than [`KEPT`] of its kind are kept;
/// else dropped.
pub(crate) fn give(kind: Kind, mut buf: BytesMut) {
    if !buf.is_empty() || buf.capacity() == 0 {
        return;
    }
    // Unique and at least the kind's size: the whole allocation again, with
    // no copy and no allocation (`false`: shared, or smaller).
    if !buf.try_reclaim(kind.capacity()) || buf.capacity() > 2 * kind.capacity() {
        return;
    }
    with_kept(kind, |kept| {
        if kept.len() < KEPT {
            kept.push(buf);
        }
    });
}
