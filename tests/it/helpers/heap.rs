//! Heap counted per gateway, for the heap budgets (`budgets`).
//!
//! The test binary's global allocator is [`Counting`]: the system allocator,
//! and a count of the bytes asked for and given back by the threads of one
//! *counted* gateway. A counted gateway runs on a thread of its own, on a
//! current-thread tokio runtime whose every thread (the one driving it and
//! the blocking pool's) is marked with its slot, so every allocation and
//! free of that gateway's tasks is counted, and nothing of the tests
//! running in parallel in other threads, nor of the clients (on the test's
//! own runtime, across loopback TCP: nothing is shared with the gateway but
//! the sockets). The count is of the sizes asked for (`Layout::size`), not
//! what the allocator rounds them to, nor RSS: the same work gives the same
//! count on every machine and allocator, up to the growth of hash tables
//! whose layout depends on a random seed (`DashMap`'s shards), a few bytes
//! per stream, which is why each budget keeps a little room.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;

use mcp_xds_gateway::cache::Cache;
use mcp_xds_gateway::downstream::registry::Registry;
use mcp_xds_gateway::skew::SkewTracker;
use tokio::sync::Notify;

use super::within;

/// How many gateways may be counted at once (slot 0 is "not counted").
const SLOTS: usize = 16;

static COUNTED: [AtomicI64; SLOTS] = [const { AtomicI64::new(0) }; SLOTS];
/// Per slot: how many allocations were of the size h2 makes a connection's
/// write buffer with (16 KiB, `vendor/README.md`).
static WRITE_BUFFERS: [AtomicI64; SLOTS] = [const { AtomicI64::new(0) }; SLOTS];
const WRITE_BUFFER_SIZE: usize = 16 * 1024;
/// Per slot: how many reallocations grew a block (a vector doubling).
static GROWN: [AtomicI64; SLOTS] = [const { AtomicI64::new(0) }; SLOTS];
/// Which slots are taken, a bit each (bit 0, "not counted", always).
static TAKEN: AtomicU32 = AtomicU32::new(1);

thread_local! {
    /// The slot this thread's allocations count in; 0: none. Const and
    /// without a destructor: readable from inside the allocator.
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting the counted gateways' bytes.
pub struct Counting;

fn count(bytes: i64) {
    let slot = SLOT.try_with(Cell::get).unwrap_or(0);
    if slot != 0 {
        COUNTED[slot].fetch_add(bytes, Ordering::Relaxed);
    }
}

/// An allocation of `size` bytes made (not freed).
fn count_made(size: usize) {
    if size == WRITE_BUFFER_SIZE {
        let slot = SLOT.try_with(Cell::get).unwrap_or(0);
        if slot != 0 {
            WRITE_BUFFERS[slot].fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn signed(size: usize) -> i64 {
    i64::try_from(size).unwrap_or(i64::MAX)
}

// SAFETY: every call is passed to `System` as it came; the count is a side
// effect that neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()));
            count_made(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()));
            count_made(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        count(-signed(layout.size()));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            count(signed(new_size) - signed(layout.size()));
            count_made(new_size);
            if new_size > layout.size() {
                let slot = SLOT.try_with(Cell::get).unwrap_or(0);
                if slot != 0 {
                    GROWN[slot].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        moved
    }
}

/// A slot of its own for one counted gateway, given back when dropped.
struct Slot(usize);

impl Slot {
    fn take() -> Self {
        let taken = TAKEN
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |taken| {
                (taken != u32::MAX >> (32 - SLOTS)).then(|| taken | (taken + 1))
            })
            .expect("a free slot: at most 15 counted gateways at once");
        // The lowest clear bit of what was taken is the one just set.
        let slot = (!taken).trailing_zeros() as usize;
        COUNTED[slot].store(0, Ordering::Relaxed);
        WRITE_BUFFERS[slot].store(0, Ordering::Relaxed);
        GROWN[slot].store(0, Ordering::Relaxed);
        Slot(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        TAKEN.fetch_and(!(1 << self.0), Ordering::AcqRel);
    }
}

/// What the test asks of the gateway's thread, with no allocation on
/// either side (a `Notify` wakes without one; the answer is an atomic).
#[derive(Default)]
struct Line {
    ask: Notify,
    answered: Notify,
    answer: AtomicI64,
    /// With the answer: [`WRITE_BUFFERS`] of the gateway's slot.
    buffers: AtomicI64,
    /// With the answer: [`GROWN`] of the gateway's slot.
    grown: AtomicI64,
    stop: Notify,
}

/// A gateway started in-process on a thread of its own, its heap counted.
pub struct CountedGateway {
    pub listen: SocketAddr,
    pub registry: Arc<Registry>,
    pub cache: Arc<Cache>,
    pub skew: Arc<SkewTracker>,
    line: Arc<Line>,
}

impl CountedGateway {
    /// Starts the gateway with `flags` (as [`super::start_gateway`] does) on
    /// a counted thread.
    pub async fn start(flags: &[&str]) -> Self {
        let flags: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
        let line = Arc::new(Line::default());
        let (started, bound) = tokio::sync::oneshot::channel();
        let on_thread = line.clone();
        std::thread::Builder::new()
            .name("counted-gateway".into())
            .spawn(move || {
                let slot = Slot::take();
                let index = slot.0;
                SLOT.with(|s| s.set(index));
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .on_thread_start(move || SLOT.with(|s| s.set(index)))
                    .build()
                    .expect("a runtime");
                runtime.block_on(serve(flags, on_thread, started, index));
                drop(runtime);
                SLOT.with(|s| s.set(0));
                drop(slot);
            })
            .expect("a thread for the gateway");
        let (listen, registry, cache, skew) = within("the counted gateway to start", bound)
            .await
            .expect("the counted gateway starts");
        Self {
            listen,
            registry,
            cache,
            skew,
            line,
        }
    }

    /// The gateway's heap once it has settled: measured on its own thread
    /// between two of its tasks' polls, after its ready tasks ran until the
    /// count stopped moving.
    pub async fn settled_heap(&self) -> i64 {
        let answered = self.line.answered.notified();
        self.line.ask.notify_one();
        within("the counted gateway to measure its heap", answered).await;
        self.line.answer.load(Ordering::Acquire)
    }

    /// How many allocations of the size of h2's connection write buffer
    /// (16 KiB) the gateway has made, once it has settled.
    pub async fn settled_write_buffers(&self) -> i64 {
        self.settled_heap().await;
        self.line.buffers.load(Ordering::Acquire)
    }

    /// How many reallocations grew a block (a vector or slab doubling as
    /// it filled) in the gateway, once it has settled.
    pub async fn settled_growths(&self) -> i64 {
        self.settled_heap().await;
        self.line.grown.load(Ordering::Acquire)
    }
}

/// Stops the gateway; its thread gives the slot back once it has stopped
/// (not waited for).
impl Drop for CountedGateway {
    fn drop(&mut self) {
        self.line.stop.notify_one();
    }
}

type Started = (SocketAddr, Arc<Registry>, Arc<Cache>, Arc<SkewTracker>);

async fn serve(flags: Vec<String>, line: Arc<Line>, started: tokio::sync::oneshot::Sender<Started>, slot: usize) {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let bound = super::start_gateway(&flags).await;
    let _ = started.send((
        bound.listen,
        bound.registry.clone(),
        bound.cache.clone(),
        bound.skew.clone(),
    ));
    loop {
        tokio::select! {
            () = line.stop.notified() => break,
            () = line.ask.notified() => {
                line.answer.store(settle(slot).await, Ordering::Release);
                line.buffers.store(WRITE_BUFFERS[slot].load(Ordering::Relaxed), Ordering::Release);
                line.grown.store(GROWN[slot].load(Ordering::Relaxed), Ordering::Release);
                line.answered.notify_one();
            }
        }
    }
    bound.shutdown().await;
}

/// Lets every ready task of the runtime run (and the I/O driver turn) until
/// the count has not moved for a number of rounds in a row.
async fn settle(slot: usize) -> i64 {
    const STILL_ROUNDS: u32 = 16;
    let mut last = COUNTED[slot].load(Ordering::Relaxed);
    let mut still = 0;
    while still < STILL_ROUNDS {
        tokio::task::yield_now().await;
        let now = COUNTED[slot].load(Ordering::Relaxed);
        if now == last {
            still += 1;
        } else {
            (last, still) = (now, 0);
        }
    }
    last
}

/// Fails naming the budget unless `measured` bytes per `unit` are within it.
pub fn within_budget(budget: &str, limit: i64, measured: i64, unit: &str, structure: &str) {
    assert!(
        measured <= limit,
        "heap budget {budget} exceeded: {measured} bytes per {unit} measured, {limit} allowed ({structure}); \
         if the growth is meant, move the budget in a commit that says why"
    );
    eprintln!("heap budget {budget}: {measured} bytes per {unit} (budget {limit}; {structure})");
}
