//! A driver for counting the instructions of incremental applies with
//! callgrind (reproducible on a shared machine, unlike a timing):
//!
//! ```sh
//! cargo build --release --example apply_callgrind
//! valgrind --tool=callgrind --toggle-collect='apply_callgrind::measured' \
//!     target/release/examples/apply_callgrind 100000 500
//! ```
//!
//! fills a collection of N resources, then applies K incremental updates of
//! one resource each; only the K applies are counted (divide by K).

use mcp_xds_gateway::cache::{Cache, CacheWriter, Origin, Update};

#[path = "../benches/support/mod.rs"]
mod support;

use support::{resource, C};

#[inline(never)]
fn measured(writer: &mut CacheWriter, updates: Vec<Update>) {
    for update in updates {
        writer.apply(C, update, Origin::Upstream);
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let (Some(Ok(n)), Some(Ok(k))) = (args.next(), args.next()) else {
        eprintln!("usage: apply_callgrind RESOURCES UPDATES");
        std::process::exit(2);
    };
    let (_cache, mut writer) = Cache::new();
    writer.apply(
        C,
        Update::Full((0..n).map(|i| resource(i, 1)).collect()),
        Origin::Upstream,
    );
    let updates = (0..k)
        .map(|v| Update::Incremental {
            upserts: vec![resource((v + 2) * 7919 % n.max(1), v + 2)],
            removed: Vec::new(),
        })
        .collect();
    measured(&mut writer, updates);
}
