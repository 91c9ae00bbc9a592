//! Micro-benchmarks of the engine's hot steps (`cargo bench`; CI only
//! compiles them). Figures go in BENCHMARKS.md.
//!
//! - applying an upstream update (a full state and an incremental one, each
//!   changing one resource) at 1k, 10k, 100k and 1M resources;
//! - the diff between two consecutive versions;
//! - encoding a state-of-the-world response (the memo is per snapshot, so
//!   each iteration encodes a new snapshot's chunks list, not the chunks);
//! - the per-type state machine's step: a request, its ACK and the next push.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use mcp_xds_gateway::cache::{Cache, CacheWriter, Diff, Origin, Update};
use mcp_xds_gateway::collections::{Dialect, Resolved};
use mcp_xds_gateway::downstream::encode::{LEGACY, XDS_MCP};
use mcp_xds_gateway::downstream::registry::{Nonce, TypeView};
use mcp_xds_gateway::downstream::type_state::{Family, Held, Mode, Request, TypeState};

mod support;

use support::{resource, C};

const SIZES: [usize; 4] = [1_000, 10_000, 100_000, 1_000_000];

fn filled(n: usize) -> (Arc<Cache>, CacheWriter) {
    let (cache, mut writer) = Cache::new();
    writer.apply(
        C,
        Update::Full((0..n).map(|i| resource(i, 1)).collect()),
        Origin::Upstream,
    );
    (cache, writer)
}

/// Criterion's fewest samples at a million resources, where one full
/// state takes seconds to apply.
fn samples(n: usize) -> usize {
    if n >= 1_000_000 {
        10
    } else {
        20
    }
}

/// The update that sets resource `version * 7919 % n` to `version`: alone
/// (incremental), or in a full state of all `n` whose others are at 1.
fn one_change(n: usize, version: usize, full: bool) -> Update {
    let changed = version * 7919 % n;
    if full {
        let all = (0..n).map(|i| resource(i, if i == changed { version } else { 1 }));
        Update::Full(all.collect())
    } else {
        Update::Incremental {
            upserts: vec![resource(changed, version)],
            removed: Vec::new(),
        }
    }
}

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply_one_change");
    for n in SIZES {
        group.sample_size(samples(n));
        // A full state is decoded before it is applied: building the input
        // is not counted, applying it (every name looked up) is.
        for (name, full, batch) in [
            ("incremental", false, BatchSize::SmallInput),
            ("full", true, BatchSize::LargeInput),
        ] {
            // Filled when the benchmark first runs: a filtered-out one costs nothing.
            let mut cache = None;
            let mut version = 1;
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                let (_, writer) = cache.get_or_insert_with(|| filled(n));
                b.iter_batched(
                    || {
                        version += 1;
                        one_change(n, version, full)
                    },
                    |update| writer.apply(C, update, Origin::Upstream),
                    batch,
                )
            });
        }
    }
    group.finish();
}

fn diff_and_encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("versions");
    for n in SIZES {
        group.sample_size(samples(n));
        let (cache, mut writer) = filled(n);
        let before = cache.get(C).unwrap();
        writer.apply(
            C,
            Update::Incremental {
                upserts: vec![resource(n / 2, 2)],
                removed: Vec::new(),
            },
            Origin::Upstream,
        );
        let after = cache.get(C).unwrap();
        group.bench_with_input(BenchmarkId::new("diff_one_change", n), &n, |b, _| {
            b.iter(|| Diff::between(&before.resources, &after.resources))
        });
        for (name, layout) in [("encode_full_state_legacy", LEGACY), ("encode_full_state_xds", XDS_MCP)] {
            let mut version = 2;
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                b.iter_batched(
                    || {
                        version += 1;
                        writer.apply(C, one_change(n, version, false), Origin::Upstream);
                        cache.get(C).unwrap()
                    },
                    |snapshot| layout.full(&snapshot),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    group.finish();
}

fn state_machine(c: &mut Criterion) {
    let (cache, mut writer) = filled(100);
    let resolved = Resolved {
        collection: C.into(),
        dialect: Dialect::V1_1,
    };
    let mut state = TypeState::new(
        TypeView::new(resolved),
        Mode::Full,
        Family::Mcp,
        Held::Reported(Default::default()),
    );
    let mut nonce = 0u64;
    let mut version = 1;
    c.bench_function("type_state_ack_then_push", |b| {
        b.iter_batched(
            || {
                version += 1;
                writer.apply(
                    C,
                    Update::Incremental {
                        upserts: vec![resource(version % 100, version)],
                        removed: Vec::new(),
                    },
                    Origin::Upstream,
                );
                cache.get(C)
            },
            |current| {
                // The client ACKs what it was sent (or asks first), then
                // the next version is chosen and sent.
                let sent = nonce.to_string();
                let _ = state.on_request(Request::new(&sent, None));
                let push = state.next(current.as_ref()).expect("a new version to send");
                state.sent(Nonce::next(&mut nonce), push.to().clone());
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, apply, diff_and_encode, state_machine);
criterion_main!(benches);
