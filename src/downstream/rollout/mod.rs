//! Rollout safety: which version of each collection each group of clients
//! is served. Streams do not follow the cache's newest version directly:
//! they follow their group's slot here (canaries, or everyone else), which
//! a collection's [`gate::Gate`] fills from the cache and its history. With
//! no `--canary` and no pin, both slots carry the cache's newest version.
//!
//! Inputs: the cache's changes (the [`Rollout::run`] task), canary streams'
//! ACKs and NACKs (their state machines' verdicts), and the admin port's
//! pins and promotions. The state that must survive a restart (pins, what
//! everyone was released, what is held) is [`Rollout::saved`], which the
//! app writes to `--cache-dir`.
//!
//! Who is a canary: a client's node (id or labels) matching a `--canary`
//! selector is only its claim, since any client writes its own node. The
//! claim counts, per collection, when the access policy lets the client's
//! proven identity be a canary of it (a rule with `canary: true`), or for
//! every claim under `--canary-trust-node-ids` ([`Membership`]). A client
//! whose claim does not count is an ordinary client: served when everyone
//! is, its ACKs and NACKs decide nothing, and the views say why.

pub mod gate;
pub mod selector;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::wakes::Wakes;
use crate::cache::{Cache, CollectionSnapshot};
use crate::metrics as m;
use crate::transport::access::AccessPolicy;
use crate::transport::identity::PeerIdentity;
use crate::SharedStr;
use gate::{Gate, Hold, Policy, PromoteError, Version, WhenNone};
use selector::Selector;

type Slot = watch::Sender<Option<Arc<CollectionSnapshot>>>;

/// One collection's gate and the slots its groups follow.
struct Gated {
    gate: Gate,
    everyone: Slot,
    canaries: Slot,
    /// The followers of `everyone`: its named clients, woken by the names
    /// a version changes, and the others, woken by every version.
    everyone_wakes: Arc<Wakes>,
    /// The followers of `canaries`. Canaries follow their slot whatever
    /// their names: each settles every version, which is its ACK for the
    /// round.
    canary_wakes: Arc<Wakes>,
    /// The connected canaries, by stream, and what made each one.
    members: BTreeMap<u64, CanaryClient>,
    /// Connected clients that claim to be canaries and are not, and why.
    refused: BTreeMap<u64, CanaryClient>,
    /// When a refused claim was last logged (at most one line per
    /// [`REFUSAL_LOG_EVERY`]; the metric counts them all).
    refusal_logged: Option<Instant>,
}

impl Gated {
    /// A group's slot and its followers: the canaries' or everyone's.
    fn group(&self, canary: bool) -> (&Slot, &Arc<Wakes>) {
        if canary {
            (&self.canaries, &self.canary_wakes)
        } else {
            (&self.everyone, &self.everyone_wakes)
        }
    }
}

/// A refused canary claim is logged at most this often per collection.
const REFUSAL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// What decides whether a client that claims to be a canary (its node
/// matched a `--canary` selector) is one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Membership {
    /// Its proven identity: a rule of `--access-policy` with `canary: true`
    /// grants it the collection.
    #[default]
    Identity,
    /// `--canary-trust-node-ids`: the claim alone (any client can make it).
    NodeIds,
}

/// A client that claims to be a canary, with what made it one of a
/// collection or why it is not one.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CanaryClient {
    pub stream: u64,
    /// Its node id (or `(stream N)` when it sent none).
    pub node: String,
    /// What TLS proved of it: its first SAN, or `unauthenticated`.
    pub identity: String,
    /// The `--canary` selector its node matched.
    pub selector: String,
    /// What made it a canary, or why it is not one.
    pub why: String,
}

/// What a gate keeps across a restart.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Hold>,
}

/// Why a control was refused: a 404 or a 409 whose body says it.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("collection {0:?} is not in the cache (no source has delivered it)")]
    UnknownCollection(String),
    #[error(
        "version {version:?} of {collection:?} is not in its history (the last {kept} versions are kept: \
         --history); GET /debug/history/{collection} lists them"
    )]
    UnknownVersion {
        collection: String,
        version: String,
        kept: usize,
    },
    #[error("{0:?} is not pinned")]
    NotPinned(String),
    #[error("{collection}: {error}")]
    Promote { collection: String, error: PromoteError },
}

impl ControlError {
    /// A conflict with the collection's state (409), not a missing name (404).
    pub fn is_conflict(&self) -> bool {
        matches!(self, ControlError::NotPinned(_) | ControlError::Promote { .. })
    }
}

/// A collection's rollout, as `/debug/rollout`, `/debug/syncz` and the
/// `rollout status` command show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RolloutView {
    pub collection: SharedStr,
    /// PINNED, HELD, WAITING (a round no canary is connected to decide),
    /// CANARY (a round in progress) or SERVING.
    pub state: &'static str,
    pub latest: Option<Version>,
    /// What clients that are not canaries are served.
    pub everyone: Option<Version>,
    /// What canaries are served.
    pub canaries: Option<Version>,
    pub pinned: Option<Version>,
    pub held: Option<Hold>,
    pub round: Option<RoundView>,
    pub canaries_connected: usize,
    /// The connected canaries and what made each one (the identity and the
    /// policy's rule, or `--canary-trust-node-ids`).
    pub canary_clients: Vec<CanaryClient>,
    /// Connected clients whose node claims they are canaries and that are
    /// not (of this collection), and why: they are served as everyone is.
    pub not_canaries: Vec<CanaryClient>,
    /// Something an operator should know (a release without canaries, a
    /// pin whose version is not available).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RoundView {
    pub version: Version,
    pub acked: usize,
    /// Seconds until it is released (the soak), once every canary ACKed.
    pub release_in_seconds: Option<f64>,
}

/// The rollout of every collection.
pub struct Rollout {
    cache: Arc<Cache>,
    policy: Policy,
    selectors: Vec<Selector>,
    membership: Membership,
    gates: Mutex<HashMap<SharedStr, Gated>>,
    /// What a restart left, taken by each collection's gate when it is made.
    restored: Mutex<HashMap<String, Saved>>,
    /// Bumped whenever what [`Self::saved`] returns or a soak deadline
    /// changes.
    revision: watch::Sender<u64>,
    /// Bumped whenever a group slot is given another version.
    served: watch::Sender<u64>,
    /// Held (write) while the cache's changes fill the slots, and (read)
    /// while a stream reads the slots of several types to order them (make
    /// before break): a stream sees all of one of the cache's steps or none
    /// of it. Never held across an await.
    filling: std::sync::RwLock<()>,
    /// Each collection's snapshot as the slots were last filled (the
    /// cache's step this rollout has reached): a gate made between a step of
    /// the cache and its fill starts here, with the slots of the same step,
    /// not at the cache's newest (a stream that followed one type before a
    /// step and another after it would see half of the step: at a restart,
    /// an Envoy's routes to a new cluster before its clusters, `503 NC`).
    /// The cache's list as it gave it, sorted by collection.
    filled: Mutex<Arc<[Arc<CollectionSnapshot>]>>,
}

impl std::fmt::Debug for Rollout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rollout")
            .field("policy", &self.policy)
            .field("selectors", &self.selectors.len())
            .field("membership", &self.membership)
            .finish_non_exhaustive()
    }
}

impl Rollout {
    pub fn new(
        cache: Arc<Cache>,
        selectors: Vec<Selector>,
        membership: Membership,
        when_none: WhenNone,
        soak: std::time::Duration,
        restored: BTreeMap<String, Saved>,
    ) -> Arc<Self> {
        let policy = Policy {
            canaries: !selectors.is_empty(),
            when_none,
            soak,
        };
        let rollout = Arc::new(Self {
            cache,
            policy,
            selectors,
            membership,
            gates: Mutex::default(),
            restored: Mutex::new(restored.into_iter().collect()),
            revision: watch::Sender::new(0),
            served: watch::Sender::new(0),
            filling: std::sync::RwLock::default(),
            filled: Mutex::new(Arc::new([])),
        });
        rollout.fill();
        rollout
    }

    /// The `--canary` selector a node matches: its claim to be a canary,
    /// which [`Self::decide`] weighs per collection.
    pub fn claim(&self, node_id: &str, labels: &[(String, String)]) -> Option<&str> {
        selector::claimed_by(&self.selectors, node_id, labels).map(Selector::text)
    }

    /// Whether a client that claims to be a canary is one of `collection`:
    /// `Ok` with what made it one, or `Err` with why not. `partial`: it may
    /// read only part of the collection (its versions are its own).
    pub fn decide(
        &self,
        policy: &AccessPolicy,
        identity: &PeerIdentity,
        collection: &str,
        partial: bool,
    ) -> Result<String, String> {
        if partial {
            return Err(
                "it may read only part of the collection (--access-policy names): its versions are its own, \
                        which a round cannot count"
                    .into(),
            );
        }
        if self.membership == Membership::NodeIds {
            return Ok("--canary-trust-node-ids: its node alone decides".into());
        }
        match policy.canary(identity, collection) {
            Some(permit) => Ok(format!(
                "{} matches rules[{}] ({:?}) of --access-policy, which has canary: true",
                permit.identity, permit.rule, permit.pattern
            )),
            None if !identity.certificate => Err(
                "it presented no certificate: only a proven identity makes a canary (a rule of --access-policy with \
                 canary: true)"
                    .into(),
            ),
            None => Err(format!(
                "no rule of --access-policy with canary: true grants its identity ({identity}) this collection"
            )),
        }
    }

    /// How rounds run, and what decides who is a canary, as
    /// `/debug/rollout` shows it.
    pub fn policy_view(&self) -> serde_json::Value {
        serde_json::json!({
            "selectors": self.selectors.len(),
            "membership": self.membership,
            "when_none": self.policy.when_none,
            "soak_seconds": self.policy.soak.as_secs_f64(),
        })
    }

    /// What makes a client that claims to be a canary one.
    pub fn membership(&self) -> Membership {
        self.membership
    }

    pub fn has_canaries(&self) -> bool {
        self.policy.canaries
    }

    /// The slot of `collection` a stream of the group follows (its current
    /// snapshot marked seen), and its followers, whom each version wakes.
    pub fn watch(
        &self,
        collection: &SharedStr,
        canary: bool,
    ) -> (watch::Receiver<Option<Arc<CollectionSnapshot>>>, Arc<Wakes>) {
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        let (slot, wakes) = self.gated(&mut gates, collection).group(canary);
        (slot.subscribe(), wakes.clone())
    }

    /// The snapshot `collection` serves the group now.
    pub fn served_snapshot(&self, collection: &SharedStr, canary: bool) -> Option<Arc<CollectionSnapshot>> {
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        let snapshot = self.gated(&mut gates, collection).group(canary).0.borrow().clone();
        snapshot
    }

    /// The version `collection` serves the group now.
    pub fn served_version(&self, collection: &str, canary: bool) -> Option<Version> {
        let gates = self.gates.lock().expect("rollout lock poisoned");
        let version = gates
            .get(collection)?
            .group(canary)
            .0
            .borrow()
            .as_ref()
            .map(|s| s.version.clone());
        version
    }

    /// The gate of `collection`, made (from what a restart left, and the
    /// version of the cache's step the slots were last filled from, see
    /// `filled`) when it is first needed.
    fn gated<'a>(&self, gates: &'a mut HashMap<SharedStr, Gated>, collection: &SharedStr) -> &'a mut Gated {
        gates.entry(collection.clone()).or_insert_with(|| {
            let saved = self
                .restored
                .lock()
                .expect("rollout lock poisoned")
                .remove(&**collection)
                .unwrap_or_default();
            if let Some(pinned) = &saved.pinned {
                tracing::warn!(
                    %collection,
                    version = %pinned,
                    "the collection is pinned (as before the restart): every client is served this version, \
                     not the latest; DELETE /pin/{collection} on the admin port serves the latest again"
                );
            }
            let gate = Gate::restored(
                self.policy,
                saved.released.map(Version::from),
                saved.held,
                saved.pinned.map(Version::from),
            );
            let mut gated = Gated {
                gate,
                everyone: watch::Sender::new(None),
                canaries: watch::Sender::new(None),
                everyone_wakes: Arc::default(),
                canary_wakes: Arc::default(),
                members: BTreeMap::new(),
                refused: BTreeMap::new(),
                refusal_logged: None,
            };
            let filled = {
                let filled = self.filled.lock().expect("rollout lock poisoned");
                let at = filled.binary_search_by(|s| (*s.collection).cmp(&**collection));
                at.ok().map(|at| filled[at].clone())
            };
            if let Some(latest) = &filled {
                gated.gate.on_latest(latest.version.clone(), Instant::now());
            }
            self.publish(collection, &mut gated, filled);
            gated
        })
    }

    /// Steps `collection`'s gate, fills its slots, and logs what changed.
    fn step<R>(
        &self,
        collection: &SharedStr,
        hint: Option<Arc<CollectionSnapshot>>,
        f: impl FnOnce(&mut Gate, Instant) -> R,
    ) -> R {
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        let gated = self.gated(&mut gates, collection);
        let before = Phase::of(&gated.gate);
        let kept_before = kept(&gated.gate);
        let result = f(&mut gated.gate, Instant::now());
        let after = Phase::of(&gated.gate);
        if before != after {
            after.log(collection, &gated.gate, &before);
        }
        self.publish(collection, gated, hint);
        if kept_before != kept(&gated.gate) {
            self.revision.send_modify(|r| *r += 1);
        }
        result
    }

    /// Fills the group slots with the snapshots of the versions the gate
    /// serves: the one they hold, the cache's newest, or one rebuilt from
    /// the history.
    fn publish(&self, collection: &SharedStr, gated: &mut Gated, hint: Option<Arc<CollectionSnapshot>>) {
        let served = gated.gate.served();
        for (slot, version, wakes) in [
            (&gated.everyone, &served.everyone, &gated.everyone_wakes),
            (&gated.canaries, &served.canaries, &gated.canary_wakes),
        ] {
            let held = slot.borrow().as_ref().map(|s| s.version.clone());
            if held.as_ref() == version.as_ref() {
                continue;
            }
            let snapshot = version.as_ref().and_then(|version| {
                let known = [
                    gated.everyone.borrow().clone(),
                    gated.canaries.borrow().clone(),
                    hint.clone(),
                    self.cache.get(collection),
                ];
                known
                    .into_iter()
                    .flatten()
                    .find(|s| &s.version == version)
                    .or_else(|| self.cache.version_snapshot(collection, version))
            });
            if snapshot.is_none() && version.is_some() {
                let version = version.as_deref().unwrap_or_default();
                if gated.gate.pinned().is_some() {
                    tracing::error!(
                        %collection,
                        version,
                        "the version to serve is in neither the cache nor its history: clients keep what they have, \
                         and new clients wait; pin another version, or DELETE /pin to serve the latest"
                    );
                } else if self.cache.get(collection).is_none() {
                    // Not pinned, and the source delivered nothing of the
                    // collection since start: a client that connected in
                    // the moment before the source's first read waits for
                    // it, as at any start (no operator's concern).
                    tracing::debug!(
                        %collection,
                        version,
                        "the version to serve waits for the source's first delivery since start"
                    );
                } else {
                    // Not pinned: a version served before a restart that the
                    // source has not delivered again yet (it clears once it
                    // does), or one held back that left the history.
                    tracing::warn!(
                        %collection,
                        version,
                        "the version to serve is not in the cache (served before a restart and not delivered by the \
                         source yet, or held back and no longer in the history): clients keep what they have, and new \
                         clients wait until the source delivers a version to serve"
                    );
                }
            }
            // Replaced before the index is read: see `wakes`.
            let before = slot.send_replace(snapshot.clone());
            wakes.published(before.as_ref(), snapshot.as_ref());
            self.served.send_modify(|n| *n += 1);
        }
    }

    /// Sees a new value whenever a group is served another version (the
    /// latest, a pin, a promotion, a canary round).
    pub fn served_changes(&self) -> watch::Receiver<u64> {
        self.served.subscribe()
    }

    /// Reads slots with none of them being filled from the cache meanwhile:
    /// every version read is of one step of the source (see
    /// [`crate::cache::CacheWriter::apply_step`]).
    pub fn consistent<R>(&self, read: impl FnOnce() -> R) -> R {
        let _filling = self.filling.read().expect("rollout lock poisoned");
        read()
    }

    /// Fills the slots from the cache's newest step, every collection the
    /// cache holds at its newest version, all in one step (see
    /// [`Self::consistent`]): at each change of the cache, and at start once
    /// the local files were read (not at the rollout task's next turn).
    pub fn fill(&self) {
        let _filling = self.filling.write().expect("rollout lock poisoned");
        let snapshots: Arc<[Arc<CollectionSnapshot>]> = self.cache.snapshots().into();
        // Before the gates step: one made meanwhile starts at this step.
        *self.filled.lock().expect("rollout lock poisoned") = snapshots.clone();
        for snapshot in snapshots.iter() {
            let version = snapshot.version.clone();
            self.step(&snapshot.collection, None, |gate, now| gate.on_latest(version, now));
        }
    }

    /// Soaks that ended release their rounds.
    fn tick(&self) {
        let collections: Vec<SharedStr> = {
            let gates = self.gates.lock().expect("rollout lock poisoned");
            gates.keys().cloned().collect()
        };
        for collection in collections {
            self.step(&collection, None, |gate, now| gate.tick(now));
        }
    }

    /// The earliest soak deadline.
    fn deadline(&self) -> Option<Instant> {
        let gates = self.gates.lock().expect("rollout lock poisoned");
        gates.values().filter_map(|g| g.gate.deadline()).min()
    }

    /// Follows the cache's changes and the soaks' deadlines until shutdown.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut changes = self.cache.changes();
        let mut revision = self.revision.subscribe();
        self.fill();
        loop {
            let deadline = self.deadline();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.fill();
                }
                // A deadline may have moved.
                _ = revision.changed() => {}
                () = sleep_until(deadline) => self.tick(),
            }
        }
    }

    /// Sees a new value whenever what [`Self::saved`] returns changes.
    pub fn revisions(&self) -> watch::Receiver<u64> {
        self.revision.subscribe()
    }

    /// What each collection's gate keeps across a restart (collections with
    /// nothing to keep left out).
    pub fn saved(&self) -> BTreeMap<String, Saved> {
        let gates = self.gates.lock().expect("rollout lock poisoned");
        let mut saved: BTreeMap<String, Saved> = self
            .restored
            .lock()
            .expect("rollout lock poisoned")
            .clone()
            .into_iter()
            .collect();
        for (collection, gated) in gates.iter() {
            saved.insert(collection.to_string(), saved_of(&gated.gate));
        }
        saved.retain(|_, s| *s != Saved::default());
        saved
    }

    // === canaries ===

    /// A client is a canary of `collection` (see [`Self::decide`]).
    pub fn canary_joined(&self, collection: &SharedStr, client: CanaryClient) {
        let stream = client.stream;
        self.record(collection, |gated| {
            gated.refused.remove(&stream);
            gated.members.insert(stream, client);
        });
        self.step(collection, None, |gate, now| gate.canary_joined(stream, now));
    }

    /// A client claims to be a canary of `collection` and is not one (see
    /// [`Self::decide`]): an ordinary client, which leaves the round if it
    /// was in it (a reload took its permission away).
    pub fn canary_refused(&self, collection: &SharedStr, client: CanaryClient) {
        let stream = client.stream;
        let now = Instant::now();
        let (was_member, log) = self.record(collection, |gated| {
            let log = gated
                .refusal_logged
                .is_none_or(|at| now.saturating_duration_since(at) >= REFUSAL_LOG_EVERY);
            if log {
                gated.refusal_logged = Some(now);
            }
            gated.refused.insert(stream, client.clone());
            (gated.members.remove(&stream).is_some(), log)
        });
        metrics::counter!(m::ROLLOUT_CANARY_CLAIMS_REFUSED, "collection" => collection.to_string()).increment(1);
        if log {
            tracing::warn!(
                %collection,
                stream,
                // What the client wrote, escaped (Debug).
                node = ?client.node,
                identity = %client.identity,
                selector = %client.selector,
                why = ?client.why,
                "a client whose node matches --canary is not a canary: it is served as everyone is, and its ACKs and \
                 NACKs decide nothing (one line per collection per 10s at most; \
                 mcp_gateway_canary_claims_refused_total counts them all)"
            );
        }
        if was_member {
            self.step(collection, None, |gate, now| gate.canary_left(stream, now));
        }
    }

    /// A stream that claimed to be a canary of `collection` left it.
    pub fn canary_left(&self, collection: &SharedStr, stream: u64) {
        let was_member = self.record(collection, |gated| {
            gated.refused.remove(&stream);
            gated.members.remove(&stream).is_some()
        });
        if was_member {
            self.step(collection, None, |gate, now| gate.canary_left(stream, now));
        }
    }

    /// Changes what `collection`'s gate knows of its canaries' clients.
    fn record<R>(&self, collection: &SharedStr, f: impl FnOnce(&mut Gated) -> R) -> R {
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        f(self.gated(&mut gates, collection))
    }

    pub fn canary_acked(&self, collection: &SharedStr, stream: u64, version: &str) {
        self.step(collection, None, |gate, now| gate.canary_acked(stream, version, now));
    }

    pub fn canary_nacked(&self, collection: &SharedStr, stream: u64, version: &str, node: &str, message: &str) {
        // Who held it is kept with the hold: the canary may leave.
        let identity = match self.membership {
            Membership::Identity => self.record(collection, |gated| {
                gated.members.get(&stream).map(|member| member.identity.clone())
            }),
            Membership::NodeIds => None,
        };
        self.step(collection, None, |gate, _| {
            gate.canary_nacked_by(stream, version, node, identity.as_deref(), message)
        });
    }

    // === controls (the admin port) ===

    fn known(&self, collection: &str) -> Result<SharedStr, ControlError> {
        self.cache
            .get(collection)
            .map(|s| s.collection.clone())
            .ok_or_else(|| ControlError::UnknownCollection(collection.to_owned()))
    }

    /// Every client of `collection` is served `version` (from the history)
    /// until [`Self::unpin`].
    pub fn pin(&self, collection: &str, version: &str) -> Result<RolloutView, ControlError> {
        let name = self.known(collection)?;
        let snapshot =
            self.cache
                .version_snapshot(collection, version)
                .ok_or_else(|| ControlError::UnknownVersion {
                    collection: collection.to_owned(),
                    version: version.to_owned(),
                    kept: self.cache.history_len(),
                })?;
        let version = snapshot.version.clone();
        self.step(&name, Some(snapshot), |gate, _| gate.pin(version));
        Ok(self.view(collection).expect("known above"))
    }

    /// `collection` serves the latest again (with canaries: at once when it
    /// is what everyone was released before the pin, else a round first).
    pub fn unpin(&self, collection: &str) -> Result<RolloutView, ControlError> {
        let name = self.known(collection)?;
        self.step(&name, None, |gate, now| gate.unpin(now))
            .ok_or_else(|| ControlError::NotPinned(collection.to_owned()))?;
        Ok(self.view(collection).expect("known above"))
    }

    /// What the canaries of `collection` are on goes to everyone now.
    pub fn promote(&self, collection: &str) -> Result<RolloutView, ControlError> {
        let name = self.known(collection)?;
        self.step(&name, None, |gate, _| gate.promote())
            .map_err(|error| ControlError::Promote {
                collection: collection.to_owned(),
                error,
            })?;
        Ok(self.view(collection).expect("known above"))
    }

    /// Every collection's rollout, by name.
    pub fn views(&self) -> Vec<RolloutView> {
        let snapshots = self.cache.snapshots();
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        for snapshot in snapshots {
            // Made if missing, so that every delivered collection shows.
            self.gated(&mut gates, &snapshot.collection);
        }
        let mut views: Vec<RolloutView> = gates.iter().map(|(c, g)| view_of(c, g, self.policy)).collect();
        views.sort_by(|a, b| a.collection.cmp(&b.collection));
        views
    }

    /// A view as an operator reads it under the access policy in effect: a
    /// round that waits for a canary no client can ever be (no rule with
    /// `canary: true` grants the collection) says so. It keeps waiting:
    /// `--canary-when-none=hold` promised that no version goes out unvetted,
    /// and a collection left out of the canary rules (the secrets' own, a
    /// certificate's rotation) is the operator's to promote or to cover.
    pub fn explained(&self, access: &AccessPolicy, mut view: RolloutView) -> RolloutView {
        let uncovered = self.policy.canaries
            && self.membership == Membership::Identity
            && self.policy.when_none == WhenNone::Hold
            && !access.canary_covers(&view.collection);
        if uncovered && view.state == "WAITING" {
            view.warning = Some(format!(
                "no rule of --access-policy with canary: true grants {0}: no client can be its canary, so each new \
                 version waits (--canary-when-none=hold) until POST /promote/{0}; give a rule canary: true for it, \
                 or promote",
                view.collection
            ));
        }
        view
    }

    /// One collection's rollout; `None` when it is not in the cache.
    pub fn view(&self, collection: &str) -> Option<RolloutView> {
        let name = self.known(collection).ok()?;
        let mut gates = self.gates.lock().expect("rollout lock poisoned");
        let gated = self.gated(&mut gates, &name);
        Some(view_of(&name, gated, self.policy))
    }
}

/// What a step may change of what is saved, and the soak's deadline.
fn kept(gate: &Gate) -> (Option<Version>, Option<Version>, Option<Version>, Option<Instant>) {
    (
        gate.released().cloned(),
        gate.pinned().cloned(),
        gate.held().map(|h| h.version.clone()),
        gate.deadline(),
    )
}

fn saved_of(gate: &Gate) -> Saved {
    Saved {
        released: gate.released().map(|v| v.to_string()),
        pinned: gate.pinned().map(|v| v.to_string()),
        held: gate.held().cloned(),
    }
}

fn view_of(collection: &SharedStr, gated: &Gated, policy: Policy) -> RolloutView {
    let gate = &gated.gate;
    let served = gate.served();
    let now = Instant::now();
    let slot_version = |slot: &Slot| slot.borrow().as_ref().map(|s| s.version.clone());
    let mut warning = None;
    if gate.pinned().is_some() && slot_version(&gated.everyone).is_none() {
        warning =
            Some("the pinned version is in neither the cache nor its history: clients keep what they have".into());
    } else if let Some(version) = gate.unvetted() {
        warning = Some(format!(
            "{version} was released without a canary connected (--canary-when-none=proceed)"
        ));
    } else if gate.waiting_for_canary() && policy.when_none == WhenNone::Hold {
        warning = Some("no canary is connected: the round waits (--canary-when-none=hold)".into());
    } else if gate.waiting_for_canary() {
        warning = Some("the canaries left without ACKing: the round waits for a canary to connect and ACK".into());
    }
    RolloutView {
        collection: collection.clone(),
        state: Phase::of(gate).name(),
        latest: gate.latest().cloned(),
        everyone: served.everyone,
        canaries: policy.canaries.then_some(served.canaries).flatten(),
        pinned: gate.pinned().cloned(),
        held: gate.held().cloned(),
        round: gate.round().map(|r| RoundView {
            version: r.version.clone(),
            acked: r.acked.len(),
            release_in_seconds: r
                .release_at
                .map(|at| (at.saturating_duration_since(now).as_secs_f64() * 10.0).round() / 10.0),
        }),
        canaries_connected: gate.canaries(),
        canary_clients: gated.members.values().cloned().collect(),
        not_canaries: gated.refused.values().cloned().collect(),
        warning,
    }
}

/// A gate's state, for its log lines and its `state`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Pinned(Version),
    Held(Version),
    Waiting(Version),
    Canary(Version),
    Serving(Option<Version>),
}

impl Phase {
    fn of(gate: &Gate) -> Self {
        if let Some(pin) = gate.pinned() {
            return Phase::Pinned(pin.clone());
        }
        if let Some(held) = gate.held() {
            return Phase::Held(held.version.clone());
        }
        match gate.round() {
            Some(round) if gate.waiting_for_canary() => Phase::Waiting(round.version.clone()),
            Some(round) => Phase::Canary(round.version.clone()),
            None => Phase::Serving(gate.released().cloned()),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Phase::Pinned(_) => "PINNED",
            Phase::Held(_) => "HELD",
            Phase::Waiting(_) => "WAITING",
            Phase::Canary(_) => "CANARY",
            Phase::Serving(_) => "SERVING",
        }
    }

    /// One line for the change from `before` to this phase.
    fn log(&self, collection: &str, gate: &Gate, before: &Phase) {
        let everyone = gate.served().everyone;
        let everyone = everyone.as_deref().unwrap_or("-");
        match self {
            Phase::Pinned(version) => tracing::warn!(
                %collection,
                %version,
                "collection pinned: every client is served this version; upstream versions are applied to the \
                 cache but not served until DELETE /pin/{collection}"
            ),
            Phase::Held(version) => {
                let held = gate.held().expect("held");
                tracing::warn!(
                    %collection,
                    %version,
                    // What the client wrote, escaped (Debug): no line of the
                    // log is forged by a NACK's newline.
                    canary = ?held.node,
                    identity = held.identity.as_deref().unwrap_or("-"),
                    nack = ?held.message,
                    everyone,
                    "a canary NACKed this version: it is held; clients that are not canaries stay on theirs \
                     (POST /promote/{collection} sends it anyway)"
                );
            }
            Phase::Waiting(version) => tracing::warn!(
                %collection,
                %version,
                everyone,
                "no canary is connected to decide this version: it waits for one"
            ),
            Phase::Canary(version) => tracing::info!(
                %collection,
                %version,
                everyone,
                canaries = gate.canaries(),
                "a new version goes to the canaries first"
            ),
            Phase::Serving(_) if matches!(before, Phase::Pinned(_)) => {
                tracing::info!(%collection, version = everyone, "collection unpinned: the latest is served")
            }
            Phase::Serving(_) if gate.unvetted().is_some() => tracing::warn!(
                %collection,
                version = everyone,
                "released to everyone without a canary connected (--canary-when-none=proceed)"
            ),
            Phase::Serving(_) if !matches!(before, Phase::Serving(_)) => {
                tracing::info!(%collection, version = everyone, "released to everyone")
            }
            Phase::Serving(_) => {}
        }
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VS: &str = "istio/networking/v1alpha3/virtualservices";
    const CANARY_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/canary-pilot";

    /// A policy read from a file, as `--access-policy` reads it.
    fn policy(text: &str) -> Result<AccessPolicy, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(&path, text).unwrap();
        AccessPolicy::load(&path).map_err(|e| e.to_string())
    }

    fn rollout(membership: Membership) -> Arc<Rollout> {
        let (cache, _writer) = Cache::new();
        let selectors = vec![Selector::parse("canary-*").unwrap()];
        Rollout::new(
            cache,
            selectors,
            membership,
            WhenNone::Proceed,
            std::time::Duration::ZERO,
            BTreeMap::new(),
        )
    }

    /// A type followed between a step of the cache and the rollout's fill
    /// of the slots from it reads the step the other slots hold, not the
    /// cache's newest: a stream sees all of a step or none of it, whenever
    /// it follows each type. Found by a real Envoy across a restart: it
    /// asked for its clusters before the source's first step, and for its
    /// listeners and routes after the step but before the fill; they were
    /// served the new step while its clusters were not yet delivered, and
    /// the route to a new cluster went first (`503 NC`).
    #[test]
    fn a_slot_made_before_the_fill_reads_the_step_the_others_hold() {
        use crate::cache::test_support::resource;
        use crate::cache::{Origin, Update};
        let (cache, mut writer) = Cache::new();
        let rollout = Rollout::new(
            cache.clone(),
            Vec::new(),
            Membership::Identity,
            WhenNone::Proceed,
            std::time::Duration::ZERO,
            BTreeMap::new(),
        );
        let (clusters, routes, endpoints): (SharedStr, SharedStr, SharedStr) =
            ("clusters".into(), "routes".into(), "endpoints".into());
        let (clusters_slot, _) = rollout.watch(&clusters, false);
        let step = |writer: &mut crate::cache::CacheWriter, n: &str| {
            writer.apply_step(vec![
                (clusters.clone(), Update::Full(vec![resource("b", n)]), Origin::Files),
                (routes.clone(), Update::Full(vec![resource("to-b", n)]), Origin::Files),
                (endpoints.clone(), Update::Full(vec![resource("b", n)]), Origin::Files),
            ])
        };
        // The first step, not yet filled: routes, followed now, wait with
        // the clusters.
        step(&mut writer, "1");
        let (routes_slot, _) = rollout.watch(&routes, false);
        assert!(clusters_slot.borrow().is_none());
        assert!(
            routes_slot.borrow().is_none(),
            "the routes of a step the clusters do not have yet"
        );
        rollout.fill();
        let version =
            |slot: &watch::Receiver<Option<Arc<CollectionSnapshot>>>| slot.borrow().as_ref().map(|s| s.version.clone());
        assert_eq!(version(&clusters_slot), cache.get(&clusters).map(|s| s.version.clone()));
        assert_eq!(version(&routes_slot), cache.get(&routes).map(|s| s.version.clone()));
        // A later step: a type followed before its fill (its gate made by
        // the first fill, as every collection the cache held) reads the
        // step before, as the others do, then all move together.
        let first_clusters = version(&clusters_slot);
        let first_endpoints = cache.get(&endpoints).map(|s| s.version.clone());
        step(&mut writer, "2");
        let (endpoints_slot, _) = rollout.watch(&endpoints, false);
        assert_eq!(version(&endpoints_slot), first_endpoints, "the step the clusters hold");
        assert_eq!(version(&clusters_slot), first_clusters);
        rollout.fill();
        for (slot, collection) in [
            (&endpoints_slot, &endpoints),
            (&clusters_slot, &clusters),
            (&routes_slot, &routes),
        ] {
            assert_eq!(version(slot), cache.get(collection).map(|s| s.version.clone()));
        }
        assert_ne!(version(&endpoints_slot), first_endpoints);
    }

    const POLICY: &str = "rules:\n\
        - identities: [\"spiffe://cluster.local/ns/*\"]\n  collections: [\"istio/*\"]\n\
        - identities: [\"spiffe://cluster.local/ns/istio-system/sa/canary-*\", \"canary.example\"]\n  \
          collections: [\"istio/networking/*\"]\n  canary: true\n";

    /// A claim counts by the identity a certificate proves, with the policy's
    /// rule for URI and DNS SANs, for the rule's collections only; never for
    /// a client without a certificate or one that reads part of the
    /// collection; always (for a whole reader) when node ids are trusted.
    #[test]
    fn a_claim_counts_by_the_proven_identity_and_the_rule_says_why() {
        let p = policy(POLICY).unwrap();
        assert_eq!(p.canary_rules(), 1);
        let by_identity = rollout(Membership::Identity);
        assert_eq!(by_identity.claim("canary-7", &[]), Some("canary-*"));
        assert_eq!(by_identity.claim("pilot-7", &[]), None);
        let proven = PeerIdentity::certified(vec![CANARY_ID.into()], Vec::new());
        let why = by_identity.decide(&p, &proven, VS, false).unwrap();
        assert_eq!(
            why,
            format!(
                "uri:{CANARY_ID} matches rules[1] (\"spiffe://cluster.local/ns/istio-system/sa/canary-*\") of \
                 --access-policy, which has canary: true"
            )
        );
        let dns = PeerIdentity::certified(Vec::new(), vec!["canary.example".into()]);
        assert!(by_identity
            .decide(&p, &dns, VS, false)
            .unwrap()
            .starts_with("dns:canary.example matches rules[1]"));
        // Not for a collection the rule does not name.
        let why_not = by_identity
            .decide(&p, &proven, "istio/mesh/v1alpha1/MeshConfig", false)
            .unwrap_err();
        assert!(
            why_not.contains("no rule of --access-policy with canary: true"),
            "{why_not}"
        );
        // A tenant, a DNS SAN spelling the canary's SPIFFE id, a URI SAN
        // spelling the DNS name, no certificate: not canaries.
        for (who, identity) in [
            (
                "a tenant",
                PeerIdentity::certified(vec!["spiffe://cluster.local/ns/tenant/sa/reader".into()], vec![]),
            ),
            (
                "a DNS SAN spelling the id",
                PeerIdentity::certified(vec![], vec![CANARY_ID.into()]),
            ),
            (
                "a URI SAN spelling the name",
                PeerIdentity::certified(vec!["canary.example".into()], vec![]),
            ),
            ("no certificate", PeerIdentity::default()),
        ] {
            let why_not = by_identity.decide(&p, &identity, VS, false).unwrap_err();
            assert!(why_not.contains("canary: true"), "{who}: {why_not}");
        }
        let partial = by_identity.decide(&p, &proven, VS, true).unwrap_err();
        assert!(partial.contains("only part of the collection"), "{partial}");
        // Without a policy nobody is one; with trusted node ids, every claim.
        assert!(by_identity.decide(&AccessPolicy::none(), &proven, VS, false).is_err());
        let by_node = rollout(Membership::NodeIds);
        let why = by_node
            .decide(&AccessPolicy::none(), &PeerIdentity::default(), VS, false)
            .unwrap();
        assert!(why.contains("--canary-trust-node-ids"), "{why}");
        assert_eq!(by_node.policy_view()["membership"], "node_ids");
    }

    /// The members and the refused claims are listed with why; a refusal
    /// takes a member out of the round (a reload took its right away).
    #[test]
    fn the_view_lists_canaries_and_refused_claims_and_a_refusal_leaves_the_round() {
        let rollout = rollout(Membership::Identity);
        let vs: SharedStr = SharedStr::from(VS);
        let client = |stream: u64, why: &str| CanaryClient {
            stream,
            node: format!("canary-{stream}"),
            identity: "spiffe://x".into(),
            selector: "canary-*".into(),
            why: why.into(),
        };
        let gates = || rollout.gates.lock().unwrap();
        rollout.canary_joined(&vs, client(1, "proven"));
        rollout.canary_refused(&vs, client(2, "not proven"));
        {
            let gates = gates();
            let gated = &gates[&vs];
            assert_eq!(gated.gate.canaries(), 1);
            let view = view_of(&vs, gated, rollout.policy);
            assert_eq!(view.canary_clients, [client(1, "proven")]);
            assert_eq!(view.not_canaries, [client(2, "not proven")]);
        }
        rollout.canary_refused(&vs, client(1, "taken away"));
        assert_eq!(gates()[&vs].gate.canaries(), 0, "the refused member left the round");
        rollout.canary_left(&vs, 1);
        rollout.canary_left(&vs, 2);
        let gates = gates();
        assert!(gates[&vs].members.is_empty() && gates[&vs].refused.is_empty());
    }

    /// `canary: true` needs identities a certificate proves and whole
    /// collections: the policy says so at load, naming the rule.
    #[test]
    fn a_canary_rule_for_unauthenticated_clients_or_some_names_does_not_load() {
        let e = policy("rules:\n- identities: [unauthenticated]\n  collections: [c]\n  canary: true\n").unwrap_err();
        assert!(
            e.contains("rules[0].identities[0]") && e.contains("--canary-trust-node-ids"),
            "{e}"
        );
        let e =
            policy("rules:\n- identities: [\"*.example\"]\n  collections: [c]\n  names: [\"a/*\"]\n  canary: true\n")
                .unwrap_err();
        assert!(e.contains("rules[0].canary") && e.contains("leave `names` out"), "{e}");
        let p = policy("rules:\n- identities: [\"*.example\"]\n  collections: [c]\n  names: [\"*\"]\n  canary: true\n")
            .unwrap();
        assert_eq!(p.rules_json()[0]["canary"], true);
        assert_eq!(policy(POLICY).unwrap().rules_json()[0].get("canary"), None);
    }
}
