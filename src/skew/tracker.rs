//! The skew of every collection a connected client of a known generation
//! reads, for that generation: kept as the cache changes, off the fan-out
//! path (its own task, on the blocking pool), at the cost of the change.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::releases::{Generation, GenerationRules};
use super::walk::{body_of, dropped_by, ResourceSkew};
use crate::cache::{Cache, CachedResource, Diff, ResourceMap};
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
    /// The resources its clients drop something of, by name.
    pub skewed: BTreeMap<Arc<str>, Arc<ResourceSkew>>,
    /// Connected streams of the generation that read the collection.
    pub clients: usize,
}

#[derive(Default)]
struct State {
    /// Connected streams per collection and generation.
    interests: HashMap<Key, usize>,
    /// What was found, with the resources it was found in (to diff against
    /// at the next version: an `imbl` map, shared with the cache's).
    tracked: BTreeMap<Key, (TrackedSkew, ResourceMap)>,
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
        } else if let Some((tracked, _)) = state.tracked.get_mut(&self.key) {
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
            Some((tracked, _)) => tracked.clients = count,
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
        let mut all: Vec<TrackedSkew> = state.tracked.values().map(|(t, _)| t.clone()).collect();
        // Interests whose first check has not run yet: shown as pending.
        for (key, clients) in &state.interests {
            if !state.tracked.contains_key(key) {
                all.push(TrackedSkew {
                    collection: key.0.clone(),
                    generation: key.1,
                    version: None,
                    checked: true,
                    skewed: BTreeMap::new(),
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
            .map(|(t, _)| t.clone())
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
        let work: Vec<(Key, Option<(TrackedSkew, ResourceMap)>)> = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state
                .interests
                .keys()
                .map(|key| (key.clone(), state.tracked.get(key).cloned()))
                .collect()
        };
        for (key, last) in work {
            let Some(snapshot) = self.cache.get(&key.0) else {
                continue;
            };
            if last
                .as_ref()
                .is_some_and(|(t, _)| t.version.as_deref() == Some(&*snapshot.version))
            {
                continue;
            }
            let release = key
                .1
                .release()
                .expect("interests are taken for releases the gateway has");
            let (mut skew, before) = last.unwrap_or_else(|| {
                (
                    TrackedSkew {
                        collection: key.0.clone(),
                        generation: key.1,
                        version: None,
                        checked: false,
                        skewed: BTreeMap::new(),
                        clients: 0,
                    },
                    ResourceMap::default(),
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
                            skew.skewed.insert(resource.name.clone(), Arc::new(found));
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
            state.tracked.insert(key, (skew, snapshot.resources.clone()));
        }
    }
}

/// One resource's skew for one release (`None`: not an Istio kind).
fn check(release: &super::releases::Release, resource: &CachedResource) -> Option<ResourceSkew> {
    let (type_url, body) = body_of(&resource.encoded)?;
    dropped_by(release, type_url, body)
}
