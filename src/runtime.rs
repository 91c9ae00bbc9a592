//! The async runtime the gateway serves on: tokio's multi-threaded
//! scheduler, whose worker waits a moment for more events when it runs out
//! of work, before it parks in the kernel's event wait.
//!
//! Under load, events come a few at a time: a version's responses are
//! acknowledged by their clients one after another, each ACK a few
//! microseconds after the last. A worker that parks as soon as it has
//! nothing to do is woken for each (the kernel's event wait returns, the
//! thread is switched back in, the connection read for the one message),
//! and parks again: on a 2,000-client EDS run, 0.56 event waits, 0.65
//! reads and 0.28 context switches per response, a third of the gateway's
//! CPU in the kernel. Waiting `--worker-idle-wait` first (200 µs by
//! default) lets the events of that moment gather, so one wake-up reads
//! them all and each connection's messages in one read (BENCHMARKS,
//! session 44: 0.08 event waits, 0.37 reads and 0.05 context switches per
//! response on that run; CPU −18 % for state of the world, −8 % delta).
//!
//! What it costs: an event that arrives within the wait of the work before
//! it is handled up to the wait later (tokio's own timers are 1 ms coarse);
//! an event after a quiet spell finds the worker parked and is handled at
//! once. A worker that ran out of work and waited is counted
//! ([`IDLE_WAITS`]), so an operator sees how often the gateway runs dry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{counter, describe_counter};

/// How often a worker ran out of work and waited before parking.
pub const IDLE_WAITS: &str = "mcp_gateway_worker_idle_waits_total";

/// The waits of this process's runtime (the binary's; a gateway run
/// in-process, as the tests do, runs on its host's runtime: 0).
static WAITS: AtomicU64 = AtomicU64::new(0);

/// The runtime the binary serves on: tokio's multi-threaded scheduler, one
/// worker per core it may run on, with `idle_wait` before each park
/// (`None` or zero: none).
pub fn build(idle_wait: Option<Duration>) -> std::io::Result<tokio::runtime::Runtime> {
    builder(idle_wait, &WAITS).build()
}

/// [`build`]'s builder, counting the waits in `waits`.
fn builder(idle_wait: Option<Duration>, waits: &'static AtomicU64) -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(wait) = idle_wait.filter(|w| !w.is_zero()) {
        builder.on_thread_park(move || idle(wait, waits));
    }
    builder
}

/// Called by a worker that found no task, before it parks: the worker's
/// own thread, outside every task, so blocking it delays only what it would
/// have picked up meanwhile.
#[allow(
    clippy::disallowed_methods,
    reason = "the worker is between tasks, about to park: its wait is the point"
)]
fn idle(wait: Duration, waits: &AtomicU64) {
    waits.fetch_add(1, Ordering::Relaxed);
    std::thread::sleep(wait);
}

pub fn describe() {
    describe_counter!(
        IDLE_WAITS,
        "Times a runtime worker ran out of work and waited --worker-idle-wait for more events before parking."
    );
}

/// Sets the series to the count (at scrape time).
pub fn refresh() {
    counter!(IDLE_WAITS).absolute(WAITS.load(Ordering::Relaxed));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that runs out of work waits before it parks, and the wait
    /// is counted; work that comes meanwhile or after is done; with no
    /// wait, nothing is counted.
    #[test]
    fn a_worker_out_of_work_waits_and_counts_it_and_still_serves() {
        static COUNTED: AtomicU64 = AtomicU64::new(0);
        static NONE: AtomicU64 = AtomicU64::new(0);
        for (wait, waits) in [(Some(Duration::from_micros(300)), &COUNTED), (None, &NONE)] {
            let runtime = builder(wait, waits).worker_threads(1).build().unwrap();
            let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
            let task = runtime.spawn(async move { rx.await.map(|n| n + 1) });
            if wait.is_some() {
                // The task waits for its message: the worker runs dry.
                let deadline = std::time::Duration::from_secs(10);
                let started = tokio::time::Instant::now();
                while waits.load(Ordering::Relaxed) == 0 {
                    assert!(started.elapsed() < deadline, "the worker never waited");
                    std::thread::yield_now();
                }
            }
            tx.send(41).unwrap();
            let got = runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
                .expect("the task ends")
                .unwrap();
            assert_eq!(got, Ok(42));
        }
        assert!(COUNTED.load(Ordering::Relaxed) >= 1);
        assert_eq!(NONE.load(Ordering::Relaxed), 0);
    }
}
