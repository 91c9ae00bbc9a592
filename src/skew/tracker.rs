//! The skew of every collection a connected client of a known generation
//! reads, for that generation: kept as the cache changes, off the fan-out
//! path (its own task, on the blocking pool), at the cost of the change.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::releases::{Generation, GenerationRules};
use super::walk::{body_of, dropped_by, ResourceSkew};
use crate::cache::{Cache, CachedResource, CollectionSnapshot, Diff, ResourceMap};
use crate::metrics as m;
use crate::source::files::Origins;

type Key = (Arc<str>, Generation);

/// One collection's skew for one generation, at one version.
#[derive(Clone, Debug)]
pub struct TrackedSkew {
    pub collection: Arc<str>,
    pub generation: Generation,
    /// The collection's version it was found at (`None`: not delivered yet).
    pub version: Option<Arc<str>>,
    /// False for a collection whose kind is not one of Istio's in the
    /// releases' protos (Mixer's `Struct` kinds, MeshConfig): not checked.
    pub checked: bool,
    /// The resources its clients drop something of, by name (shared between
    /// the tracker and the views: a copy costs nothing).
    pub skewed: imbl::OrdMap<Arc<str>, Arc<ResourceSkew>>,
    /// Connected streams of the generation that read the collection.
    pub clients: usize,
}

/// The distinct skews of one collection for one generation: resources
/// that drop the same fields (most of them: a field of a newer release set
/// across a fleet's config) share one, so memory grows with what differs,
/// not with the resources.
#[derive(Debug, Default)]
struct Interned {
    distinct: std::collections::HashSet<Arc<ResourceSkew>>,
    /// Size after the last sweep of skews no resource holds any more.
    swept: usize,
}

impl Interned {
    fn intern(&mut self, found: ResourceSkew) -> Arc<ResourceSkew> {
        if let Some(shared) = self.distinct.get(&found) {
            return shared.clone();
        }
        // Swept when it has doubled: amortized O(1) per insert.
        if self.distinct.len() >= 2 * self.swept.max(32) {
            self.distinct.retain(|s| Arc::strong_count(s) > 1);
            self.swept = self.distinct.len();
        }
        let shared = Arc::new(found);
        self.distinct.insert(shared.clone());
        shared
    }
}

#[derive(Default)]
struct State {
    /// Connected streams per collection and generation.
    interests: HashMap<Key, usize>,
    /// What was found, with the resources it was found in (to diff against
    /// at the next version: an `imbl` map, shared with the cache's).
    tracked: BTreeMap<Key, (TrackedSkew, ResourceMap, Interned)>,
}

/// The skew of what is served, for every generation in use.
pub struct SkewTracker {
    cache: Arc<Cache>,
    /// Where the files source's resources came from, for the lines of
    /// what is dropped.
    origins: tokio::sync::watch::Sender<Arc<Origins>>,
    rules: GenerationRules,
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    /// Resources checked since start (one per changed resource and
    /// generation in use): what the skew costs, in `/debug/skew`.
    checks: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SkewTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SkewTracker")
            .field("rules", &self.rules.shown())
            .finish()
    }
}

/// A stream's interest in a collection's skew for its generation: counted
/// while held.
pub struct Interest {
    tracker: Arc<SkewTracker>,
    key: Key,
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut guard = self.tracker.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        let Some(count) = state.interests.get_mut(&self.key) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            state.interests.remove(&self.key);
            state.tracked.remove(&self.key);
            // No client of the generation reads it now: nothing is dropped.
            m::skew_resources(&self.key.0, self.key.1, 0);
        } else if let Some((tracked, _, _)) = state.tracked.get_mut(&self.key) {
            tracked.clients = *count;
        }
    }
}

impl SkewTracker {
    pub fn new(cache: Arc<Cache>, rules: GenerationRules) -> Arc<Self> {
        Arc::new(Self {
            cache,
            origins: tokio::sync::watch::Sender::new(Arc::default()),
            rules,
            state: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            checks: Default::default(),
        })
    }

    /// Where the files source publishes where each resource came from.
    pub fn origins_sender(&self) -> tokio::sync::watch::Sender<Arc<Origins>> {
        self.origins.clone()
    }

    /// Where each resource of the files source came from (empty for other
    /// sources).
    pub fn origins(&self) -> Arc<Origins> {
        self.origins.borrow().clone()
    }

    pub fn rules(&self) -> &GenerationRules {
        &self.rules
    }

    /// A stream of `generation` reads `collection`: its skew is kept while
    /// the interest is held. `None` for a generation the gateway has no
    /// protos of (nothing to check against).
    pub fn interest(self: &Arc<Self>, collection: &Arc<str>, generation: Generation) -> Option<Interest> {
        generation.release()?;
        let key = (collection.clone(), generation);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let count = state.interests.entry(key.clone()).or_default();
        *count += 1;
        let count = *count;
        match state.tracked.get_mut(&key) {
            Some((tracked, _, _)) => tracked.clients = count,
            None => {
                // At 0 until found: a series for every generation in use.
                m::skew_resources(collection, generation, 0);
                drop(state);
                self.wake.notify_one();
            }
        }
        Some(Interest {
            tracker: self.clone(),
            key,
        })
    }

    /// Resources checked since start.
    pub fn checks(&self) -> u64 {
        self.checks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every collection and generation in use, by collection then release.
    pub fn tracked(&self) -> Vec<TrackedSkew> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<TrackedSkew> = state.tracked.values().map(|(t, _, _)| t.clone()).collect();
        // Interests whose first check has not run yet: shown as pending.
        for (key, clients) in &state.interests {
            if !state.tracked.contains_key(key) {
                all.push(TrackedSkew {
                    collection: key.0.clone(),
                    generation: key.1,
                    version: None,
                    checked: true,
                    skewed: imbl::OrdMap::new(),
                    clients: *clients,
                });
            }
        }
        all.sort_by(|a, b| (&a.collection, a.generation).cmp(&(&b.collection, b.generation)));
        all
    }

    /// One collection's skew for one generation, if tracked.
    pub fn get(&self, collection: &str, generation: Generation) -> Option<TrackedSkew> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .tracked
            .get(&(Arc::from(collection), generation))
            .map(|(t, _, _)| t.clone())
    }

    /// Keeps the skew as the cache and the interests change, until
    /// `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut changes = self.cache.changes();
        loop {
            let this = self.clone();
            if tokio::task::spawn_blocking(move || this.refresh()).await.is_err() {
                return;
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                () = self.wake.notified() => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Brings every interest's skew to its collection's current version:
    /// the resources changed since the last check are checked, one check
    /// per resource and generation. The lock is not held while checking.
    pub fn refresh(&self) {
        type Work = (
            Key,
            Arc<CollectionSnapshot>,
            Option<(TrackedSkew, ResourceMap, Interned)>,
        );
        // The keys whose collection moved on since their last check (the
        // interner is only this task's: taken, not copied).
        let work: Vec<Work> = {
            let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let state = &mut *guard;
            state
                .interests
                .keys()
                .filter_map(|key| {
                    let snapshot = self.cache.get(&key.0)?;
                    let last = state.tracked.get_mut(key);
                    if last
                        .as_ref()
                        .is_some_and(|(t, _, _)| t.version.as_deref() == Some(&*snapshot.version))
                    {
                        return None;
                    }
                    let last = last.map(|(t, r, i)| (t.clone(), r.clone(), std::mem::take(i)));
                    Some((key.clone(), snapshot, last))
                })
                .collect()
        };
        for (key, snapshot, last) in work {
            let release = key
                .1
                .release()
                .expect("interests are taken for releases the gateway has");
            let (mut skew, before, mut interned) = last.unwrap_or_else(|| {
                (
                    TrackedSkew {
                        collection: key.0.clone(),
                        generation: key.1,
                        version: None,
                        checked: false,
                        skewed: imbl::OrdMap::new(),
                        clients: 0,
                    },
                    ResourceMap::default(),
                    Interned::default(),
                )
            });
            let diff = Diff::between(&before, &snapshot.resources);
            for name in &diff.removed {
                skew.skewed.remove(name);
            }
            let mut checked = skew.checked;
            self.checks
                .fetch_add(diff.upserts.len() as u64, std::sync::atomic::Ordering::Relaxed);
            for resource in &diff.upserts {
                match check(release, resource) {
                    Some(found) => {
                        checked = true;
                        if found.is_empty() {
                            skew.skewed.remove(&resource.name);
                        } else {
                            skew.skewed.insert(resource.name.clone(), interned.intern(found));
                        }
                    }
                    None => {
                        skew.skewed.remove(&resource.name);
                    }
                }
            }
            skew.checked = checked;
            skew.version = Some(snapshot.version.clone());
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            // The last client may have gone while this was checked.
            let Some(clients) = state.interests.get(&key).copied() else {
                continue;
            };
            skew.clients = clients;
            m::skew_resources(&key.0, key.1, skew.skewed.len());
            state.tracked.insert(key, (skew, snapshot.resources.clone(), interned));
        }
    }
}

/// One resource's skew for one release (`None`: not an Istio kind).
fn check(release: &super::releases::Release, resource: &CachedResource) -> Option<ResourceSkew> {
    let (type_url, body) = body_of(&resource.encoded)?;
    dropped_by(release, type_url, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Origin, Update};
    use prost::Message;
    use serde_json::json;

    const DR: &str = "istio/networking/v1alpha3/destinationrules";
    const DR_TYPE_URL: &str = "type.googleapis.com/istio.networking.v1alpha3.DestinationRule";

    /// A DestinationRule; `new_field` sets consecutive5xxErrors (Istio 1.5).
    fn rule(name: &str, version: &str, new_field: bool) -> CachedResource {
        let outlier = if new_field {
            json!({"consecutive5xxErrors": 5})
        } else {
            json!({"consecutiveErrors": 5})
        };
        let spec = json!({"host": name, "trafficPolicy": {"outlierDetection": outlier}});
        let body = crate::source::proto_json::encode(DR_TYPE_URL, spec).unwrap();
        let encoded = crate::proto::Resource {
            metadata: Some(crate::proto::Metadata {
                name: name.into(),
                version: version.into(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: DR_TYPE_URL.into(),
                value: body.clone(),
            }),
        }
        .encode_to_vec();
        let none = std::collections::HashMap::<String, String>::new();
        CachedResource::new(
            name.into(),
            version.into(),
            DR_TYPE_URL.into(),
            encoded.into(),
            crate::cache::content_digest(&body, &none, &none),
        )
    }

    #[tokio::test]
    async fn a_change_costs_one_check_per_generation_and_equal_skews_are_shared() {
        let (cache, mut writer) = Cache::new();
        let rules: Vec<CachedResource> = (0..100)
            .map(|i| rule(&format!("ns/r{i:03}"), "1", i % 2 == 0))
            .collect();
        writer.apply(DR, Update::Full(rules), Origin::Files);
        let tracker = SkewTracker::new(cache.clone(), GenerationRules::default());
        let collection: Arc<str> = DR.into();
        let v11 = tracker.interest(&collection, Generation::of(1)).unwrap();
        let v13 = tracker.interest(&collection, Generation::of(3)).unwrap();
        // A release the gateway has no protos of: nothing to keep.
        assert!(tracker.interest(&collection, Generation::of(9)).is_none());
        tracker.refresh();
        assert_eq!(tracker.checks(), 200, "100 resources, two generations");
        let found = tracker.get(DR, Generation::of(1)).unwrap();
        assert_eq!(found.skewed.len(), 50);
        assert_eq!(found.clients, 1);
        // The 50 resources that drop the same field share one skew.
        let first = found.skewed.values().next().unwrap();
        assert!(found.skewed.values().all(|s| Arc::ptr_eq(s, first)));
        // Nothing changed: nothing checked.
        tracker.refresh();
        assert_eq!(tracker.checks(), 200);
        // One resource changes (now read whole): one check per generation.
        let mut changed = Vec::new();
        for i in 0..100 {
            changed.push(rule(
                &format!("ns/r{i:03}"),
                if i == 0 { "2" } else { "1" },
                i % 2 == 0 && i != 0,
            ));
        }
        writer.apply(DR, Update::Full(changed), Origin::Files);
        tracker.refresh();
        assert_eq!(tracker.checks(), 202);
        assert_eq!(tracker.get(DR, Generation::of(3)).unwrap().skewed.len(), 49);
        // The last client of a generation leaves: its skew goes.
        drop(v11);
        assert!(tracker.get(DR, Generation::of(1)).is_none());
        assert_eq!(tracker.tracked().len(), 1);
        drop(v13);
        assert!(tracker.tracked().is_empty());
    }
}
