//! The `--max-connections` slots of a gRPC listener and the state of the
//! connection in each (handshaking, idle, busy). At the limit a new
//! connection takes the slot of the oldest one still handshaking, or else of
//! the one idle the longest: connections that carry no stream can never lock
//! out a client that completes its handshake. Only when every connection
//! carries a live stream is the new one refused.
//!
//! Every event (accept, handshake done, a stream opened or ended, close) is a
//! hash-map lookup and at most two B-tree updates under one short lock; no
//! lock is held across an await.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

/// Why a connection gave its slot to a newer one (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// It had not completed its handshake (TLS, the HTTP/2 preface and the
    /// peer's SETTINGS).
    Handshake,
    /// It carried no stream.
    Idle,
}

impl Eviction {
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::Handshake => "handshake",
            Eviction::Idle => "idle",
        }
    }
}

/// A connection that gave its slot to a newer one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub reason: Eviction,
    pub peer: SocketAddr,
}

/// What a new connection gets.
#[derive(Debug)]
pub enum Admission {
    /// A slot; `evicted` names the connection that gave it up, if any.
    Admitted { slot: Slot, evicted: Option<Evicted> },
    /// Every connection carries a live stream.
    Full,
}

/// How many connections are in each state (for tests and debug views).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub handshaking: usize,
    pub idle: usize,
    pub busy: usize,
}

/// The slots of one listener pool (`--max-connections`, or the dial-out
/// port's own).
#[derive(Debug)]
pub struct ConnectionSlots {
    max: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    /// Bumped by every connection that becomes idle: orders them by when.
    clock: u64,
    entries: HashMap<u64, Entry>,
    /// Connections still handshaking, by id (ids are given in accept order).
    handshaking: BTreeSet<u64>,
    /// Handshaken connections without a stream, by (idle since, id).
    idle: BTreeSet<(u64, u64)>,
}

#[derive(Debug)]
struct Entry {
    peer: SocketAddr,
    state: State,
    evict: CancellationToken,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Handshaking,
    Idle { since: u64 },
    Busy { streams: usize },
}

impl Inner {
    /// Moves a connection out of the ordered set its state puts it in.
    fn unlink(&mut self, id: u64, state: State) {
        match state {
            State::Handshaking => {
                self.handshaking.remove(&id);
            }
            State::Idle { since } => {
                self.idle.remove(&(since, id));
            }
            State::Busy { .. } => {}
        }
    }

    fn set(&mut self, id: u64, state: State) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let old = std::mem::replace(&mut entry.state, state);
        self.unlink(id, old);
        match state {
            State::Handshaking => {
                self.handshaking.insert(id);
            }
            State::Idle { since } => {
                self.idle.insert((since, id));
            }
            State::Busy { .. } => {}
        }
    }

    fn became_idle(&mut self, id: u64) {
        self.clock += 1;
        let since = self.clock;
        self.set(id, State::Idle { since });
    }

    /// The oldest connection still handshaking, or else the one idle the
    /// longest: removed, and told to close.
    fn evict_one(&mut self) -> Option<Evicted> {
        let (id, reason) = match self.handshaking.first() {
            Some(&id) => (id, Eviction::Handshake),
            None => (self.idle.first()?.1, Eviction::Idle),
        };
        let entry = self.entries.remove(&id)?;
        self.unlink(id, entry.state);
        entry.evict.cancel();
        Some(Evicted {
            reason,
            peer: entry.peer,
        })
    }
}

impl ConnectionSlots {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            inner: Mutex::new(Inner::default()),
        })
    }

    pub fn max(&self) -> usize {
        self.max
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a connection just accepted from `peer` (handshaking), by
    /// evicting another if the pool is full.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr) -> Admission {
        let mut inner = self.lock();
        let evicted = if inner.entries.len() >= self.max {
            match inner.evict_one() {
                Some(evicted) => Some(evicted),
                None => return Admission::Full,
            }
        } else {
            None
        };
        let id = inner.next_id;
        inner.next_id += 1;
        let evict = CancellationToken::new();
        inner.entries.insert(
            id,
            Entry {
                peer,
                state: State::Handshaking,
                evict: evict.clone(),
            },
        );
        inner.handshaking.insert(id);
        Admission::Admitted {
            slot: Slot {
                pool: self.clone(),
                id,
                evict,
            },
            evicted,
        }
    }

    pub fn census(&self) -> Census {
        let inner = self.lock();
        Census {
            handshaking: inner.handshaking.len(),
            idle: inner.idle.len(),
            busy: inner.entries.len() - inner.handshaking.len() - inner.idle.len(),
        }
    }
}

/// One connection's slot; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    pool: Arc<ConnectionSlots>,
    id: u64,
    evict: CancellationToken,
}

impl Slot {
    /// The handshake is complete: the connection is idle until a stream
    /// opens.
    pub fn handshake_done(&self) {
        let mut inner = self.pool.lock();
        if inner.entries.get(&self.id).map(|e| e.state) == Some(State::Handshaking) {
            inner.became_idle(self.id);
        }
    }

    /// A stream opened. False when the connection was evicted (it is
    /// closing: the stream must be refused).
    pub fn stream_opened(&self) -> bool {
        let mut inner = self.pool.lock();
        let Some(state) = inner.entries.get(&self.id).map(|e| e.state) else {
            return false;
        };
        let streams = match state {
            State::Busy { streams } => streams + 1,
            // A stream implies the handshake is done.
            State::Handshaking | State::Idle { .. } => 1,
        };
        inner.set(self.id, State::Busy { streams });
        true
    }

    /// A stream ended; the connection is idle from now when it was the last.
    pub fn stream_ended(&self) {
        let mut inner = self.pool.lock();
        match inner.entries.get(&self.id).map(|e| e.state) {
            Some(State::Busy { streams }) if streams > 1 => inner.set(self.id, State::Busy { streams: streams - 1 }),
            Some(State::Busy { .. }) => inner.became_idle(self.id),
            _ => {}
        }
    }

    /// Streams open on the connection.
    pub fn open_streams(&self) -> usize {
        match self.pool.lock().entries.get(&self.id).map(|e| e.state) {
            Some(State::Busy { streams }) => streams,
            _ => 0,
        }
    }

    /// Resolves once a newer connection took this slot.
    pub async fn evicted(&self) {
        self.evict.cancelled().await
    }

    pub fn is_evicted(&self) -> bool {
        self.evict.is_cancelled()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.pool.lock();
        if let Some(entry) = inner.entries.remove(&self.id) {
            inner.unlink(self.id, entry.state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_reasons_are_the_declared_labels() {
        for reason in [Eviction::Handshake, Eviction::Idle] {
            assert!(
                crate::metrics::EVICTION_REASONS.contains(&reason.as_str()),
                "{reason:?}"
            );
        }
    }

    fn peer(n: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], n))
    }

    fn admit(pool: &Arc<ConnectionSlots>, n: u16) -> (Slot, Option<Evicted>) {
        match pool.admit(peer(n)) {
            Admission::Admitted { slot, evicted } => (slot, evicted),
            Admission::Full => panic!("connection {n} refused"),
        }
    }

    #[test]
    fn below_the_limit_nobody_is_evicted() {
        let pool = ConnectionSlots::new(2);
        let (a, evicted) = admit(&pool, 1);
        assert_eq!(evicted, None);
        let (_b, evicted) = admit(&pool, 2);
        assert_eq!(evicted, None);
        assert_eq!(
            pool.census(),
            Census {
                handshaking: 2,
                idle: 0,
                busy: 0
            }
        );
        drop(a);
        let (_c, evicted) = admit(&pool, 3);
        assert_eq!(evicted, None, "a closed connection's slot is free");
    }

    #[test]
    fn the_oldest_handshaking_connection_goes_first_even_before_idle_ones() {
        let pool = ConnectionSlots::new(3);
        let (idle, _) = admit(&pool, 1);
        idle.handshake_done();
        let (half_open_old, _) = admit(&pool, 2);
        let (_half_open_new, _) = admit(&pool, 3);
        let (_next, evicted) = admit(&pool, 4);
        assert_eq!(
            evicted,
            Some(Evicted {
                reason: Eviction::Handshake,
                peer: peer(2)
            })
        );
        assert!(half_open_old.is_evicted());
        assert!(!idle.is_evicted());
        assert!(!half_open_old.stream_opened(), "an evicted connection opens no stream");
    }

    #[test]
    fn idle_connections_go_by_how_long_they_have_carried_no_stream() {
        let pool = ConnectionSlots::new(3);
        let slots: Vec<Slot> = (1..=3)
            .map(|n| {
                let (slot, _) = admit(&pool, n);
                slot.handshake_done();
                slot
            })
            .collect();
        // 1 had a stream that ended after 2 and 3 became idle: it is the
        // most recently idle; 2 has been idle the longest.
        assert!(slots[0].stream_opened());
        assert!(slots[0].stream_opened());
        slots[0].stream_ended();
        assert_eq!(slots[0].open_streams(), 1);
        slots[0].stream_ended();
        assert_eq!(slots[0].open_streams(), 0);
        let (four, evicted) = admit(&pool, 4);
        assert_eq!(evicted.map(|e| (e.reason, e.peer)), Some((Eviction::Idle, peer(2))));
        four.handshake_done();
        // Three has been idle longer than four (idle since its handshake).
        let (_five, evicted) = admit(&pool, 5);
        assert_eq!(evicted.map(|e| e.peer), Some(peer(3)));
        // Five is handshaking: it goes before the idle ones.
        let (_six, evicted) = admit(&pool, 6);
        assert_eq!(
            evicted.map(|e| (e.reason, e.peer)),
            Some((Eviction::Handshake, peer(5)))
        );
        let (_seven, evicted) = admit(&pool, 7);
        assert_eq!(
            evicted.map(|e| (e.reason, e.peer)),
            Some((Eviction::Handshake, peer(6)))
        );
    }

    #[test]
    fn connections_with_live_streams_are_never_evicted() {
        let pool = ConnectionSlots::new(2);
        let (a, _) = admit(&pool, 1);
        let (b, _) = admit(&pool, 2);
        a.handshake_done();
        assert!(a.stream_opened());
        assert!(b.stream_opened(), "a stream before the SETTINGS were seen also counts");
        assert!(matches!(pool.admit(peer(3)), Admission::Full));
        assert_eq!(
            pool.census(),
            Census {
                handshaking: 0,
                idle: 0,
                busy: 2
            }
        );
        b.stream_ended();
        let (_c, evicted) = admit(&pool, 3);
        assert_eq!(evicted.map(|e| e.peer), Some(peer(2)));
        drop(b);
        assert_eq!(pool.census().busy, 1, "an evicted slot's drop changes nothing");
        assert!(!a.is_evicted());
    }
}
