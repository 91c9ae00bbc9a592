//! The skew of every collection a connected client of a known generation
//! reads, for that generation, at each version the collection is served (the
//! latest, a pinned one, a canary round's): kept as the cache and the
//! rollout change, off the fan-out path (its own task, on the blocking
//! pool), at the cost of the change.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::releases::{Generation, GenerationRules};
use super::walk::{body_of, dropped_by, ResourceSkew};
use crate::cache::{Cache, CachedResource, CollectionSnapshot, Diff, ResourceMap};
use crate::metrics as m;
use crate::source::files::Origins;
use crate::SharedStr;

type Key = (SharedStr, Generation);

/// One collection's skew for one generation, at one version it is served.
#[derive(Clone, Debug)]
pub struct TrackedSkew {
    pub collection: SharedStr,
    pub generation: Generation,
    /// The version (`None`: not delivered yet, or its first check has not
    /// run).
    pub version: Option<SharedStr>,
    /// Served to the canaries only (a canary round's new version); else to
    /// everyone (the latest, or a pinned version).
    pub canaries_only: bool,
    /// False for a collection whose kind is not one of Istio's in the
    /// releases' protos (Mixer's `Struct` kinds, MeshConfig): not checked.
    pub checked: bool,
    /// The resources its clients drop something of, by name (shared between
    /// the tracker and the views: a copy costs nothing).
    pub skewed: imbl::OrdMap<SharedStr, Arc<ResourceSkew>>,
    /// Connected streams of the generation that read the collection.
    pub clients: usize,
}

/// The distinct skews of one collection for one generation: resources
/// that drop the same fields (most of them: a field of a newer release set
/// across a fleet's config) share one, so memory grows with what differs,
/// not with the resources.
#[derive(Debug, Default)]
struct Interned {
    distinct: HashSet<Arc<ResourceSkew>>,
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

/// One served version's skew, with the resources it was found in (to diff
/// against at the next version: an `imbl` map, shared with the cache's).
#[derive(Clone)]
struct Checked {
    skew: TrackedSkew,
    resources: ResourceMap,
}

/// A collection and generation in use: the versions served, everyone's
/// first.
#[derive(Default)]
struct Tracked {
    served: Vec<Checked>,
    interned: Interned,
}

#[derive(Default)]
struct State {
    /// Connected streams per collection and generation.
    interests: HashMap<Key, usize>,
    tracked: HashMap<Key, Tracked>,
}

/// The snapshot each group is served of a collection, everyone's first.
pub type GroupSnapshots = dyn Fn(&SharedStr) -> Vec<Option<Arc<CollectionSnapshot>>> + Send + Sync;

/// What each group of clients is served of a collection (everyone's first,
/// then the canaries'), and a signal when that changes without the cache
/// changing (a pin, a promotion, a canary round released). Without it, the
/// cache's latest.
pub struct ServedBy {
    pub snapshots: Box<GroupSnapshots>,
    pub changes: watch::Receiver<u64>,
}

/// The skew of what is served, for every generation in use.
pub struct SkewTracker {
    cache: Arc<Cache>,
    served: Mutex<Option<ServedBy>>,
    /// Where the files source's resources came from, for the lines of
    /// what is dropped.
    origins: watch::Sender<Arc<Origins>>,
    rules: GenerationRules,
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    /// Resources checked since start (one per changed resource and
    /// generation in use): what the skew costs, in `/debug/skew`.
    checks: std::sync::atomic::AtomicU64,
    /// The sensitive collections, whose bodies' values no finding says.
    sensitive: std::collections::HashSet<String>,
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
        }
    }
}

impl SkewTracker {
    /// `sensitive`: the collections whose bodies' values are never said
    /// (a map's key, an enum's value: [`dropped_by`]).
    pub fn new(cache: Arc<Cache>, rules: GenerationRules, sensitive: impl IntoIterator<Item = String>) -> Arc<Self> {
        Arc::new(Self {
            cache,
            served: Mutex::new(None),
            origins: watch::Sender::new(Arc::default()),
            rules,
            state: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            checks: Default::default(),
            sensitive: sensitive.into_iter().collect(),
        })
    }

    /// Follows what the rollout serves each group rather than the cache's
    /// latest (before [`SkewTracker::run`]).
    pub fn serve_from(&self, served: ServedBy) {
        *self.served.lock().unwrap_or_else(|e| e.into_inner()) = Some(served);
    }

    /// Where the files source publishes where each resource came from.
    pub fn origins_sender(&self) -> watch::Sender<Arc<Origins>> {
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
    pub fn interest(self: &Arc<Self>, collection: &SharedStr, generation: Generation) -> Option<Interest> {
        generation.release()?;
        let key = (collection.clone(), generation);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let count = state.interests.entry(key.clone()).or_default();
        *count += 1;
        if *count == 1 {
            // At 0 until found: a series for every generation in use.
            m::skew_resources(collection, generation, 0);
            drop(state);
            self.wake.notify_one();
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

    /// Every collection and generation in use, at each version served, by
    /// collection then release (everyone's version first).
    pub fn tracked(&self) -> Vec<TrackedSkew> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = Vec::new();
        for (key, clients) in &state.interests {
            match state.tracked.get(key).filter(|t| !t.served.is_empty()) {
                Some(tracked) => all.extend(tracked.served.iter().map(|c| TrackedSkew {
                    clients: *clients,
                    ..c.skew.clone()
                })),
                // Its first check has not run yet: shown as pending.
                None => all.push(TrackedSkew {
                    collection: key.0.clone(),
                    generation: key.1,
                    version: None,
                    canaries_only: false,
                    checked: true,
                    skewed: imbl::OrdMap::new(),
                    clients: *clients,
                }),
            }
        }
        all.sort_by(|a, b| {
            (&a.collection, a.generation, a.canaries_only).cmp(&(&b.collection, b.generation, b.canaries_only))
        });
        all
    }

    /// One collection's skew for one generation at the version everyone is
    /// served, or at `version` when it is one of those served.
    pub fn get(&self, collection: &str, generation: Generation, version: Option<&str>) -> Option<TrackedSkew> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let key = (SharedStr::from(collection), generation);
        let tracked = state.tracked.get(&key)?;
        let clients = state.interests.get(&key).copied().unwrap_or_default();
        let found = match version {
            Some(version) => tracked
                .served
                .iter()
                .find(|c| c.skew.version.as_deref() == Some(version))?,
            None => tracked.served.first()?,
        };
        Some(TrackedSkew {
            clients,
            ..found.skew.clone()
        })
    }

    /// Keeps the skew as the cache, the rollout and the interests change,
    /// until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut changes = self.cache.changes();
        let mut served = self
            .served
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|s| s.changes.clone());
        loop {
            let this = self.clone();
            if tokio::task::spawn_blocking(move || this.refresh()).await.is_err() {
                return;
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                changed = async { served.as_mut().expect("guarded").changed().await }, if served.is_some() => {
                    if changed.is_err() { served = None }
                }
                () = self.wake.notified() => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// What each group is served of `collection`, everyone's first, each
    /// version once.
    fn served_snapshots(&self, collection: &SharedStr) -> Vec<(Arc<CollectionSnapshot>, bool)> {
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner());
        let groups = match served.as_ref() {
            Some(served) => (served.snapshots)(collection),
            None => vec![self.cache.get(collection)],
        };
        let mut distinct: Vec<(Arc<CollectionSnapshot>, bool)> = Vec::new();
        for (i, snapshot) in groups.into_iter().enumerate() {
            let Some(snapshot) = snapshot else { continue };
            if !distinct.iter().any(|(s, _)| s.version == snapshot.version) {
                distinct.push((snapshot, i > 0));
            }
        }
        distinct
    }

    /// Brings every interest's skew to the versions its collection is
    /// served: each new version is made from one checked before (the
    /// resources changed since are checked, one check per resource and
    /// generation). The lock is not held while checking.
    pub fn refresh(&self) {
        let keys: Vec<Key> = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.interests.keys().cloned().collect()
        };
        for key in keys {
            let served = self.served_snapshots(&key.0);
            // What was checked before (the interner is only this task's:
            // taken, not copied).
            let (before, mut interned) = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                match state.tracked.get_mut(&key) {
                    None => (Vec::new(), Interned::default()),
                    Some(tracked) => {
                        let same = tracked.served.len() == served.len()
                            && tracked
                                .served
                                .iter()
                                .zip(&served)
                                .all(|(c, (s, _))| c.skew.version.as_deref() == Some(&*s.version));
                        if same {
                            continue;
                        }
                        (tracked.served.clone(), std::mem::take(&mut tracked.interned))
                    }
                }
            };
            let release = key
                .1
                .release()
                .expect("interests are taken for releases the gateway has");
            let sensitive = self.sensitive.contains(key.0.as_str());
            let mut now = Vec::with_capacity(served.len());
            for (snapshot, canaries_only) in &served {
                let known = before
                    .iter()
                    .chain(now.iter())
                    .find(|c: &&Checked| c.skew.version.as_deref() == Some(&*snapshot.version));
                if let Some(known) = known {
                    let mut known = known.clone();
                    known.skew.canaries_only = *canaries_only;
                    now.push(known);
                    continue;
                }
                // From the version checked last (everyone's), at the cost
                // of the change.
                let base = before.first().cloned();
                let (mut skew, resources) = match base {
                    Some(c) => (c.skew, c.resources),
                    None => (
                        TrackedSkew {
                            collection: key.0.clone(),
                            generation: key.1,
                            version: None,
                            canaries_only: false,
                            checked: false,
                            skewed: imbl::OrdMap::new(),
                            clients: 0,
                        },
                        ResourceMap::default(),
                    ),
                };
                let diff = Diff::between(&resources, &snapshot.resources);
                for name in &diff.removed {
                    skew.skewed.remove(name);
                }
                self.checks
                    .fetch_add(diff.upserts.len() as u64, std::sync::atomic::Ordering::Relaxed);
                for resource in &diff.upserts {
                    match check(release, resource, sensitive) {
                        Some(found) => {
                            skew.checked = true;
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
                skew.version = Some(snapshot.version.clone());
                skew.canaries_only = *canaries_only;
                now.push(Checked {
                    skew,
                    resources: snapshot.resources.clone(),
                });
            }
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            // The last client may have gone while this was checked.
            if !state.interests.contains_key(&key) {
                continue;
            }
            // What a connected client of the generation may drop: during a
            // canary round the canaries' version counts too (it is the one
            // about to go to everyone).
            let most = now.iter().map(|c| c.skew.skewed.len()).max().unwrap_or(0);
            m::skew_resources(&key.0, key.1, most);
            state.tracked.insert(key, Tracked { served: now, interned });
        }
    }
}

/// One resource's skew for one release (`None`: not an Istio kind), none of
/// its values said when its collection is `sensitive`.
fn check(release: &super::releases::Release, resource: &CachedResource, sensitive: bool) -> Option<ResourceSkew> {
    let (type_url, body) = body_of(&resource.encoded)?;
    dropped_by(release, type_url, body, sensitive)
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
        let tracker = SkewTracker::new(cache.clone(), GenerationRules::default(), []);
        let collection: SharedStr = DR.into();
        let v11 = tracker.interest(&collection, Generation::of(1)).unwrap();
        let v13 = tracker.interest(&collection, Generation::of(3)).unwrap();
        // A release the gateway has no protos of: nothing to keep.
        assert!(tracker.interest(&collection, Generation::of(9)).is_none());
        tracker.refresh();
        assert_eq!(tracker.checks(), 200, "100 resources, two generations");
        let found = tracker.get(DR, Generation::of(1), None).unwrap();
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
        assert_eq!(tracker.get(DR, Generation::of(3), None).unwrap().skewed.len(), 49);
        // The last client of a generation leaves: its skew goes.
        drop(v11);
        assert!(tracker.get(DR, Generation::of(1), None).is_none());
        assert_eq!(tracker.tracked().len(), 1);
        drop(v13);
        assert!(tracker.tracked().is_empty());
    }
}
