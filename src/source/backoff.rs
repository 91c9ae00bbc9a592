//! Reconnect delays: exponential with jitter, reset only after progress.
//!
//! Istio 1.6 reset its backoff on every new stream, so a source that accepted
//! and then killed every stream got a hot loop (istio#11041, #11158). Here the
//! delay resets only when a stream made progress: every subscribed collection
//! applied on it at least once.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// The first delay after progress.
    pub min: Duration,
    /// The largest base delay; jitter adds up to as much again.
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(100),
            max: Duration::from_secs(30),
        }
    }
}

/// The delays between attempts: the base doubles from `min` to `max`, and each
/// wait is the base plus a random part of up to the base again.
#[derive(Debug)]
pub struct Backoff {
    policy: BackoffPolicy,
    delays: ExponentialBackoff,
}

impl Backoff {
    pub fn new(policy: BackoffPolicy) -> Self {
        Self {
            policy,
            delays: Self::delays(policy),
        }
    }

    fn delays(policy: BackoffPolicy) -> ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(policy.min)
            .with_max_delay(policy.max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(self.policy.max)
    }

    /// Call only when a stream made progress.
    pub fn reset(&mut self) {
        self.delays = Self::delays(self.policy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: BackoffPolicy = BackoffPolicy {
        min: Duration::from_millis(100),
        max: Duration::from_secs(30),
    };

    /// The base delay of attempt `n` (0-based): the jittered wait lies in
    /// `[base, 2 * base)`.
    fn base(n: u32) -> Duration {
        (POLICY.min * 2u32.pow(n.min(20))).min(POLICY.max)
    }

    #[test]
    fn delays_double_with_jitter_up_to_the_cap() {
        let mut backoff = Backoff::new(POLICY);
        for n in 0..15 {
            let delay = backoff.next_delay();
            assert!(delay >= base(n) && delay <= base(n) * 2, "attempt {n}: {delay:?}");
        }
    }

    #[test]
    fn failing_attempts_get_a_handful_a_minute_not_a_loop() {
        let mut backoff = Backoff::new(POLICY);
        let mut elapsed = Duration::ZERO;
        let mut attempts = 0;
        while elapsed < Duration::from_secs(60) {
            elapsed += backoff.next_delay();
            attempts += 1;
        }
        assert!(attempts <= 12, "{attempts} attempts in the first minute");
        // And afterwards at most two a minute.
        let mut later = Duration::ZERO;
        for _ in 0..4 {
            later += backoff.next_delay();
        }
        assert!(later >= Duration::from_secs(120), "{later:?} for four attempts");
    }

    #[test]
    fn only_reset_returns_to_the_minimum() {
        let mut backoff = Backoff::new(POLICY);
        for _ in 0..6 {
            backoff.next_delay();
        }
        assert!(backoff.next_delay() >= base(6));
        backoff.reset();
        assert!(backoff.next_delay() <= POLICY.min * 2);
    }
}
