//! Token buckets: how often a peer may do something, with a burst that real
//! clients never reach. On tokio's clock, so tests can pause time.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

use tokio::time::Instant;

/// `capacity` tokens, refilled at `per_second`. Each event takes one.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    capacity: f64,
    per_second: f64,
    tokens: f64,
    updated: Instant,
}

impl TokenBucket {
    pub fn new(per_second: f64, capacity: f64) -> Self {
        Self {
            capacity,
            per_second,
            tokens: capacity,
            updated: Instant::now(),
        }
    }

    /// A bucket for "at most `per_minute` a minute", bursting to all of them.
    pub fn per_minute(per_minute: u32) -> Self {
        Self::new(f64::from(per_minute) / 60.0, f64::from(per_minute))
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.capacity);
        self.updated = now;
    }

    /// Takes a token; false when the bucket is empty (the event is over the limit).
    pub fn take(&mut self) -> bool {
        self.refill(Instant::now());
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Whether the bucket has refilled completely (its peer is idle).
    fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= self.capacity
    }
}

/// One bucket per peer IP address, for events that a peer could spread over
/// many connections (new streams). The map is bounded: when it is full, the
/// buckets of idle peers (refilled completely) are dropped, and if none is
/// idle a new peer shares a bucket with nobody but is refused until room frees
/// up. A flood of source addresses costs memory for at most `max_peers`.
#[derive(Debug)]
pub struct PeerBuckets {
    per_second: f64,
    capacity: f64,
    max_peers: usize,
    peers: Mutex<HashMap<IpAddr, TokenBucket>>,
}

impl PeerBuckets {
    pub fn new(per_second: f64, capacity: f64, max_peers: usize) -> Self {
        Self {
            per_second,
            capacity,
            max_peers,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token from `peer`'s bucket. IPv6 peers are counted by /64:
    /// one host has a whole /64 to pick addresses from.
    pub fn take(&self, peer: IpAddr) -> bool {
        let peer = match peer {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
            },
            v4 => v4,
        };
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if !peers.contains_key(&peer) && peers.len() >= self.max_peers {
            let now = Instant::now();
            peers.retain(|_, bucket| !bucket.is_full(now));
            if peers.len() >= self.max_peers {
                return false;
            }
        }
        peers
            .entry(peer)
            .or_insert_with(|| TokenBucket::new(self.per_second, self.capacity))
            .take()
    }

    pub fn len(&self) -> usize {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_bucket_bursts_then_refills_at_its_rate() {
        let mut bucket = TokenBucket::new(10.0, 5.0);
        assert!((0..5).all(|_| bucket.take()), "the burst");
        assert!(!bucket.take(), "empty");
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(bucket.take(), "one token after 100 ms at 10/s");
        assert!(!bucket.take());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!((0..5).all(|_| bucket.take()), "refilled to capacity, not beyond");
        assert!(!bucket.take());
    }

    #[tokio::test(start_paused = true)]
    async fn peers_have_their_own_buckets_and_the_map_is_bounded() {
        let buckets = PeerBuckets::new(1.0, 2.0, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        assert!(buckets.take(a) && buckets.take(a) && !buckets.take(a));
        assert!(buckets.take(b), "another peer is not affected");
        assert!(!buckets.take(c), "full of busy peers: a new one waits");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(buckets.take(c), "idle peers make room");
        assert!(buckets.len() <= 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ipv6_slash_64_is_one_peer() {
        let buckets = PeerBuckets::new(1.0, 1.0, 10);
        assert!(buckets.take("2001:db8:1:2::1".parse().unwrap()));
        assert!(!buckets.take("2001:db8:1:2:ffff::9".parse().unwrap()), "the same /64");
        assert!(buckets.take("2001:db8:1:3::1".parse().unwrap()), "another /64");
    }
}
