//! Where the last few versions of a collection stored resources anew, by
//! name: how a reader holding a resource the cache has since moved finds it
//! again without a lookup in the collection's map.
//!
//! A change re-stores more than what changed: the unchanged rest of a chunk
//! it cuts below `MIN_MEMBERS`, and the end's small chunks as they merge
//! (`chunks::Chunks::change`). Each is a new `Arc` of the same content, so a
//! named client's selection (weak references to what it was last sent)
//! finds some of its 50 resources gone at each response in `mcp-load
//! --scenario eds` (8.8 on average when session 12 counted them, with
//! `MIN_MEMBERS` 16), each once looked up by name in the map: a B-tree walk
//! comparing names that each lie in an allocation of their own, 7 % of the
//! gateway's samples (BENCHMARKS, session 19). Here each is a hash probe or
//! two.
//!
//! A snapshot's window records, newest first, what each of the applies
//! that made it and its predecessors stored anew and removed, unbroken
//! back to the oldest it holds: every apply between that one and the
//! snapshot is in it. So the newest record of a name is what the snapshot
//! holds for it: a later apply that stored it anew or removed it would be
//! recorded before it. A snapshot made another way (a whole collection
//! stored afresh, a view, a version rebuilt from the history) starts with
//! an empty window, which knows nothing: readers look names up. A view
//! must never share its collection's window: it holds less than the
//! collection (a grant's part), and a record would answer with a resource
//! the view does not hold.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::CachedResource;
use crate::SharedStr;

/// The applies a window records at most: a named client is normally a
/// version or two behind, and is rarely left untouched by eight versions
/// in a row.
const VERSIONS: usize = 8;

/// Names a window records at most, over all its applies: older applies
/// leave it first, and an apply storing more than this alone resets it.
/// Each record is ~24 bytes of map, and its weak reference holds the 112-B
/// allocation of a resource gone since: ~2.5 MB at most per collection,
/// whatever the churn (a big collection changing in large parts keeps only
/// its newest applies). Not smaller: when a buffer falls below half used,
/// what it still stores moves at once (half of eds's 10,000 resources once
/// in a run, most of every client's names), and that version's responses
/// are the ones that need the window most.
const MAX_RECORDED: usize = 1 << 14;

/// What one apply stored anew (the resource, held weakly: the window pins
/// no content) and removed (`None`), by name. Keyed by the cache's names,
/// which no client chooses: foldhash, randomly seeded.
type Stored = HashMap<SharedStr, Option<Weak<CachedResource>>, foldhash::fast::RandomState>;

/// A snapshot's record of the last applies (see the module's doc).
#[derive(Clone, Debug, Default)]
pub struct Recent(Option<Arc<[Arc<Stored>]>>);

impl Recent {
    /// The window of the snapshot an apply made from the one holding this
    /// window, having stored `stored` anew and removed `removed`: that apply
    /// first, then this window's newest.
    pub(super) fn after(&self, stored: &[Arc<CachedResource>], removed: &[SharedStr]) -> Recent {
        let mut recorded = stored.len() + removed.len();
        if recorded > MAX_RECORDED {
            return Recent::default();
        }
        let mut now = Stored::with_capacity_and_hasher(recorded, Default::default());
        now.extend(removed.iter().map(|name| (name.clone(), None)));
        now.extend(stored.iter().map(|r| (r.name.clone(), Some(Arc::downgrade(r)))));
        // The newest that fit: the window stays unbroken from this apply.
        let before = self
            .0
            .iter()
            .flat_map(|w| w.iter())
            .take(VERSIONS - 1)
            .take_while(|older| {
                recorded += older.len();
                recorded <= MAX_RECORDED
            })
            .cloned();
        Recent(Some(std::iter::once(Arc::new(now)).chain(before).collect()))
    }

    /// What the snapshot holds for `name`, where its window records it:
    /// `Some(None)` where it was removed; `None` where no apply the window
    /// holds stored or removed it (look it up).
    pub(super) fn find(&self, name: &str) -> Option<Option<Arc<CachedResource>>> {
        let newest = self
            .0
            .iter()
            .flat_map(|w| w.iter())
            .find_map(|stored| stored.get(name))?;
        // The snapshot holds what is recorded, so it is there to upgrade;
        // should it not be, the caller looks the name up.
        match newest {
            Some(held) => held.upgrade().map(Some),
            None => Some(None),
        }
    }

    /// How many applies it records.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |w| w.len())
    }

    /// How many names it records, over all its applies.
    #[cfg(test)]
    fn records(&self) -> usize {
        self.0.iter().flat_map(|w| w.iter()).map(|stored| stored.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::cache::test_support::resource;
    use crate::cache::{Cache, Origin, Update};

    const C: &str = "envoy/config/endpoint/v3/clusterloadassignments";

    fn name(i: usize) -> String {
        format!("r{i:04}")
    }

    /// Applies a change of `upserts` and `removed` to `C`.
    fn change(writer: &mut crate::cache::CacheWriter, upserts: Vec<CachedResource>, removed: Vec<String>) {
        writer.apply(C, Update::Incremental { upserts, removed }, Origin::Upstream);
    }

    /// Through changes, removals and names coming back, every name a
    /// snapshot's window records is what the snapshot holds; every resource
    /// a change moved (the same content, a new `Arc`) is among them; the
    /// window holds at most `VERSIONS` applies, and a collection stored
    /// afresh starts it again.
    #[test]
    fn the_newest_record_of_a_name_is_what_the_snapshot_holds() {
        const NAMES: usize = 400;
        proptest::proptest!(proptest::test_runner::Config::with_cases(24), |(
            versions in proptest::collection::vec(
                (proptest::collection::btree_set(0usize..NAMES, 1..30),
                 proptest::collection::btree_set(0usize..NAMES, 0..8)),
                1..24,
            ),
        )| {
            let (cache, mut writer) = Cache::new();
            let all: Vec<CachedResource> = (0..NAMES).map(|i| resource(&name(i), "0")).collect();
            writer.apply(C, Update::Full(all), Origin::Upstream);
            proptest::prop_assert_eq!(cache.get(C).unwrap().recent.len(), 0, "stored afresh");
            let mut found = 0;
            for (v, (upserted, removed)) in versions.iter().enumerate() {
                let before = cache.get(C).unwrap();
                let removed: BTreeSet<usize> = removed.difference(upserted).copied().collect();
                change(
                    &mut writer,
                    upserted.iter().map(|&i| resource(&name(i), &format!("{}", v + 1))).collect(),
                    removed.iter().map(|&i| name(i)).collect(),
                );
                let after = cache.get(C).unwrap();
                proptest::prop_assert!(after.recent.len() <= VERSIONS);
                proptest::prop_assert!(after.recent.records() <= MAX_RECORDED);
                for i in 0..NAMES {
                    let n = name(i);
                    let held = after.resources.get(n.as_str());
                    if let Some(recorded) = after.recent.find(&n) {
                        found += 1;
                        proptest::prop_assert_eq!(recorded.as_ref().map(Arc::as_ptr), held.map(Arc::as_ptr), "{}", n);
                    }
                    proptest::prop_assert_eq!(after.resource(&n).as_ref().map(Arc::as_ptr), held.map(Arc::as_ptr));
                    let was = before.resources.get(n.as_str());
                    if let (Some(was), Some(held)) = (was, held) {
                        if **was == **held && !Arc::ptr_eq(was, held) {
                            let recorded = after.recent.find(&n).flatten();
                            proptest::prop_assert!(
                                recorded.is_some_and(|r| Arc::ptr_eq(&r, held)),
                                "{} moved and is not in the window", n
                            );
                        }
                    }
                }
            }
            proptest::prop_assert!(found > 0, "the window answered nothing");
            let all: Vec<CachedResource> = (0..NAMES).map(|i| resource(&name(i), "again")).collect();
            writer.apply(C, Update::Full(all), Origin::Upstream);
            proptest::prop_assert_eq!(cache.get(C).unwrap().recent.len(), 0, "stored afresh again");
        });
    }

    /// Moves are what the window is for: a run of changes over a
    /// collection of whole chunks moves some unchanged resources, and the
    /// window finds them.
    #[test]
    fn resources_a_change_moved_are_found_in_the_window() {
        let (cache, mut writer) = Cache::new();
        writer.apply(
            C,
            Update::Full((0..640).map(|i| resource(&name(i), "0")).collect()),
            Origin::Upstream,
        );
        let mut moved = 0;
        for v in 1..=20usize {
            let before = cache.get(C).unwrap();
            // One name in each chunk of 64: every chunk cut.
            let upserts = (0..10)
                .map(|c| resource(&name(c * 64 + v * 3 % 64), &v.to_string()))
                .collect();
            change(&mut writer, upserts, vec![]);
            let after = cache.get(C).unwrap();
            for (n, held) in after.resources.iter() {
                let was = &before.resources[n];
                if **was == **held && !Arc::ptr_eq(was, held) {
                    moved += 1;
                    let recorded = after.recent.find(n).flatten();
                    assert!(
                        recorded.is_some_and(|r| Arc::ptr_eq(&r, held)),
                        "{n} moved and is not in the window"
                    );
                }
            }
        }
        assert!(moved > 0, "no change moved anything: the test shows nothing");
    }

    /// A collection changing in large parts keeps only its newest applies
    /// (at most `MAX_RECORDED` names in all), still answering for the
    /// newest; one change larger than that alone leaves the window empty.
    #[test]
    fn a_window_records_a_bounded_number_of_names() {
        let big = MAX_RECORDED / 3 + 1;
        let (cache, mut writer) = Cache::new();
        writer.apply(
            C,
            Update::Full((0..8 * big).map(|i| resource(&name(i), "0")).collect()),
            Origin::Upstream,
        );
        for v in 1..=4usize {
            let upserts = (0..big).map(|i| resource(&name(i), &v.to_string())).collect();
            change(&mut writer, upserts, vec![]);
            let now = cache.get(C).unwrap();
            assert!(now.recent.records() <= MAX_RECORDED, "{} records", now.recent.records());
            let found = now.recent.find(&name(0)).flatten();
            assert!(found.is_some_and(|r| Arc::ptr_eq(&r, &now.resources[name(0).as_str()])));
        }
        assert!(cache.get(C).unwrap().recent.len() < 4, "older applies left");
        let upserts = (0..MAX_RECORDED + 1).map(|i| resource(&name(i), "last")).collect();
        change(&mut writer, upserts, vec![]);
        assert_eq!(cache.get(C).unwrap().recent.len(), 0);
    }
}
