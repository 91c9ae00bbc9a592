use slab::Slab;

use crate::room::BurstRoom;

/// The most frames a slab made again makes room for at once: a burst
/// larger than any usual one (a peer's flood of small frames) is not
/// reserved again whole at the next burst; past this the slab doubles.
const MAX_ROOM: u32 = 256;

/// Buffers frames for multiple streams.
#[derive(Debug)]
pub struct Buffer<T> {
    slab: Slab<Slot<T>>,
    /// The room the next burst's first frame makes at once
    /// (mcp-xds-gateway's patch).
    room: BurstRoom,
}

/// A sequence of frames in a `Buffer`
#[derive(Debug)]
pub struct Deque {
    indices: Option<Indices>,
}

/// Tracks the head & tail for a sequence of frames in a `Buffer`.
#[derive(Debug, Default, Copy, Clone)]
struct Indices {
    head: usize,
    tail: usize,
}

#[derive(Debug)]
struct Slot<T> {
    value: T,
    next: Option<usize>,
}

impl<T> Buffer<T> {
    pub fn new() -> Self {
        Buffer {
            slab: Slab::new(),
            room: BurstRoom::default(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Gives back the slab's memory while it holds no frame
    /// (mcp-xds-gateway's patch: a burst's frames grow it, and an idle
    /// connection kept that size for its life).
    ///
    /// The slab is made again, at the burst's first frame, with room for
    /// as many frames as the last burst held at most: one allocation, not
    /// one for each doubling to that size (each a copy of what it held).
    pub fn release_if_empty(&mut self) {
        if self.slab.is_empty() && self.slab.capacity() > 0 {
            self.slab = Slab::new();
            self.room.given_back(MAX_ROOM);
        }
    }

    fn insert(&mut self, slot: Slot<T>) -> usize {
        if self.slab.capacity() == 0 {
            self.slab.reserve(self.room.room());
        }
        let key = self.slab.insert(slot);
        self.room.held(self.slab.len());
        key
    }
}

impl Deque {
    pub fn new() -> Self {
        Deque { indices: None }
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_none()
    }

    pub fn push_back<T>(&mut self, buf: &mut Buffer<T>, value: T) {
        let key = buf.insert(Slot { value, next: None });

        match self.indices {
            Some(ref mut idxs) => {
                buf.slab[idxs.tail].next = Some(key);
                idxs.tail = key;
            }
            None => {
                self.indices = Some(Indices {
                    head: key,
                    tail: key,
                });
            }
        }
    }

    pub fn push_front<T>(&mut self, buf: &mut Buffer<T>, value: T) {
        let key = buf.insert(Slot { value, next: None });

        match self.indices {
            Some(ref mut idxs) => {
                buf.slab[key].next = Some(idxs.head);
                idxs.head = key;
            }
            None => {
                self.indices = Some(Indices {
                    head: key,
                    tail: key,
                });
            }
        }
    }

    pub fn pop_front<T>(&mut self, buf: &mut Buffer<T>) -> Option<T> {
        match self.indices {
            Some(mut idxs) => {
                let mut slot = buf.slab.remove(idxs.head);

                if idxs.head == idxs.tail {
                    assert!(slot.next.is_none());
                    self.indices = None;
                } else {
                    idxs.head = slot.next.take().unwrap();
                    self.indices = Some(idxs);
                }

                Some(slot.value)
            }
            None => None,
        }
    }
}
