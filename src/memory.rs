//! Freed memory back to the kernel after a burst.
//!
//! glibc's malloc keeps what a burst freed in its arenas: every client
//! syncing at once, a reconnect storm, a big version's encodings. The
//! gateway's RSS then stays near the burst's peak while its heap in use is
//! a fraction of it (2,000 idle legacy streams: 16 MB of anonymous memory
//! resident, 4 MB once the free pages went back). Every
//! `--memory-trim-interval` the allocator's free bytes are read; past
//! [`TRIM_AT`] it is asked to give back its free pages (glibc's
//! `malloc_trim(0)`: every whole free page inside its arenas, not only the
//! top of the heap). A page given back costs a page fault when it is used
//! again, so a steady workload pays at most one fault per page per interval.
//!
//! The allocator's calls are the binary's ([`install`]): this crate has no
//! unsafe code, and a gateway run in-process (the tests) leaves its host's
//! allocator alone unless it installs one.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, gauge, Unit};
use tokio_util::sync::CancellationToken;

/// Free bytes the allocator may keep without being asked to return them:
/// below this, trimming would return too little to be worth its page faults.
pub const TRIM_AT: u64 = 1 << 20;

pub const HEAP_IN_USE: &str = "mcp_gateway_heap_in_use_bytes";
pub const HEAP_FREE: &str = "mcp_gateway_heap_free_bytes";
pub const TRIMS: &str = "mcp_gateway_memory_trims_total";
pub const RETURNED: &str = "mcp_gateway_memory_returned_bytes_total";
pub const LAST_TRIM_SECONDS: &str = "mcp_gateway_memory_last_trim_seconds";

/// What the allocator holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    /// In use by the program (its own mappings included).
    pub in_use: u64,
    /// Freed by the program and kept by the allocator, resident or not.
    pub free: u64,
}

/// The process's allocator, as far as trimming needs it.
pub trait Allocator: Send + Sync + 'static {
    /// What it holds, if it can say.
    fn stats(&self) -> Option<HeapStats>;
    /// Gives its free pages back to the kernel.
    fn trim(&self);
}

static ALLOCATOR: OnceLock<Box<dyn Allocator>> = OnceLock::new();

/// The process's allocator, installed once by the binary before the
/// gateway starts. False if one was installed already.
pub fn install(allocator: Box<dyn Allocator>) -> bool {
    ALLOCATOR.set(allocator).is_ok()
}

/// The installed allocator, if any.
pub fn installed() -> Option<&'static dyn Allocator> {
    ALLOCATOR.get().map(|a| a.as_ref())
}

pub fn describe() {
    describe_gauge!(
        HEAP_IN_USE,
        Unit::Bytes,
        "Heap in use by the gateway, as its allocator counts it (read every --memory-trim-interval)."
    );
    describe_gauge!(
        HEAP_FREE,
        Unit::Bytes,
        "Heap freed by the gateway and kept by its allocator at the last check (given back past 1 MiB)."
    );
    describe_counter!(
        TRIMS,
        "Times the allocator was asked to give its free pages back to the kernel."
    );
    describe_counter!(
        RETURNED,
        Unit::Bytes,
        "Resident memory given back to the kernel by trimming (the fall of the process's RSS across each trim)."
    );
    describe_gauge!(
        LAST_TRIM_SECONDS,
        Unit::Seconds,
        "How long the last trim took (the allocator's locks are held meanwhile)."
    );
}

/// Every series at zero, so a dashboard has them from the start.
pub fn register() {
    gauge!(HEAP_IN_USE).set(0.0);
    gauge!(HEAP_FREE).set(0.0);
    counter!(TRIMS).absolute(0);
    counter!(RETURNED).absolute(0);
    gauge!(LAST_TRIM_SECONDS).set(0.0);
}

/// One check's outcome.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checked {
    pub stats: HeapStats,
    /// Set when it trimmed: the resident bytes that went back (0 when the
    /// process's RSS cannot be read), and how long it took.
    pub trimmed: Option<(u64, Duration)>,
}

/// Reads the allocator and trims it when it keeps [`TRIM_AT`] or more of
/// free heap resident: the allocator's free bytes count what it gave back
/// already too, so the resident part is the process's anonymous resident
/// memory less the heap in use (`resident_anonymous`: `/proc/self/statm`),
/// and what was given back is not asked for again at every check.
/// Blocking: the allocator's locks are held while it walks its free lists.
pub fn check(allocator: &dyn Allocator, resident_anonymous: impl Fn() -> Option<u64>) -> Option<Checked> {
    let stats = allocator.stats()?;
    let before = resident_anonymous();
    let resident_free = before.map_or(stats.free, |r| r.saturating_sub(stats.in_use).min(stats.free));
    if resident_free < TRIM_AT {
        return Some(Checked { stats, trimmed: None });
    }
    let start = tokio::time::Instant::now();
    allocator.trim();
    let took = start.elapsed();
    let returned = match (before, resident_anonymous()) {
        (Some(before), Some(after)) => before.saturating_sub(after),
        _ => 0,
    };
    Some(Checked {
        stats,
        trimmed: Some((returned, took)),
    })
}

/// The process's anonymous resident memory (its heap, stacks and other
/// private mappings), from `/proc/self/statm`: resident less shared pages.
pub fn resident_anonymous() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let mut fields = statm.split_whitespace().skip(1).map(|f| f.parse::<u64>().ok());
    let resident = fields.next()??;
    let shared = fields.next()??;
    Some(resident.saturating_sub(shared) * 4096)
}

/// Checks (and trims) every `interval` until `shutdown`, off the async
/// workers; the metrics say what each check found and gave back.
pub async fn run(allocator: &'static dyn Allocator, interval: Duration, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let Ok(Some(checked)) = tokio::task::spawn_blocking(move || check(allocator, resident_anonymous)).await else {
            // An allocator that cannot say what it holds never will.
            tracing::debug!("the allocator does not report its heap: memory is not trimmed");
            return;
        };
        record(&checked);
    }
}

fn record(checked: &Checked) {
    gauge!(HEAP_IN_USE).set(checked.stats.in_use as f64);
    gauge!(HEAP_FREE).set(checked.stats.free as f64);
    if let Some((returned, took)) = checked.trimmed {
        counter!(TRIMS).increment(1);
        counter!(RETURNED).increment(returned);
        gauge!(LAST_TRIM_SECONDS).set(took.as_secs_f64());
        tracing::debug!(
            free_bytes = checked.stats.free,
            returned_bytes = returned,
            took_us = took.as_micros() as u64,
            "gave the allocator's free pages back"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use super::*;

    /// An allocator whose free heap is all resident until trimmed.
    struct Fake {
        free: AtomicU64,
        resident_free: AtomicU64,
        trims: AtomicUsize,
    }

    const IN_USE: u64 = 10 << 20;

    impl Fake {
        fn new(free: u64) -> Self {
            Fake {
                free: AtomicU64::new(free),
                resident_free: AtomicU64::new(free),
                trims: AtomicUsize::new(0),
            }
        }
        fn resident(&self) -> Option<u64> {
            Some(IN_USE + self.resident_free.load(Ordering::SeqCst))
        }
    }

    impl Allocator for Fake {
        fn stats(&self) -> Option<HeapStats> {
            Some(HeapStats {
                in_use: IN_USE,
                free: self.free.load(Ordering::SeqCst),
            })
        }
        fn trim(&self) {
            self.trims.fetch_add(1, Ordering::SeqCst);
            // glibc's free chunks stay free, their pages go back.
            self.resident_free.store(0, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_allocator_is_trimmed_only_past_a_mebibyte_of_resident_free_heap() {
        let fake = Fake::new(TRIM_AT - 1);
        let below = check(&fake, || fake.resident()).expect("stats");
        assert_eq!(below.trimmed, None);
        assert_eq!(fake.trims.load(Ordering::SeqCst), 0);

        fake.free.store(3 * TRIM_AT, Ordering::SeqCst);
        fake.resident_free.store(3 * TRIM_AT, Ordering::SeqCst);
        let at = check(&fake, || fake.resident()).expect("stats");
        assert_eq!(
            at.stats.free,
            3 * TRIM_AT,
            "the stats are the ones read before trimming"
        );
        assert_eq!(at.trimmed.map(|(returned, _)| returned), Some(3 * TRIM_AT));
        assert_eq!(fake.trims.load(Ordering::SeqCst), 1);

        // What it gave back is still free to the allocator, and not asked
        // back again.
        assert_eq!(check(&fake, || fake.resident()).expect("stats").trimmed, None);
        assert_eq!(fake.trims.load(Ordering::SeqCst), 1);

        // Without the process's figures, the allocator's own decide.
        assert!(check(&fake, || None).expect("stats").trimmed.is_some());
    }

    #[test]
    fn resident_memory_is_read_from_the_process() {
        let anonymous = resident_anonymous().expect("/proc/self/statm");
        assert!(anonymous > 0);
    }

    struct Silent;

    impl Allocator for Silent {
        fn stats(&self) -> Option<HeapStats> {
            None
        }
        fn trim(&self) {
            unreachable!("an allocator that says nothing is never trimmed")
        }
    }

    #[test]
    fn an_allocator_that_does_not_report_is_left_alone() {
        assert_eq!(check(&Silent, || Some(u64::MAX)), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_trimmer_stops_for_an_allocator_that_does_not_report() {
        static SILENT: Silent = Silent;
        let done = tokio::time::timeout(
            Duration::from_secs(60),
            run(&SILENT, Duration::from_secs(1), CancellationToken::new()),
        )
        .await;
        assert!(done.is_ok(), "the loop ends after the first check");
    }
}
