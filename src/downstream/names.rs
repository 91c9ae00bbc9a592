//! Named subscriptions (xDS): which resources of a type a client asked for,
//! what it holds of them, and what it must be sent. Pure, like the state
//! machine that owns it: no I/O, no clock.
//!
//! The rules (Envoy's `xds_protocol.rst`, and the bugs go-control-plane
//! shipped):
//! - Wildcard is a flag beside a set of names: an explicit `"*"`, or (legacy)
//!   never having named anything for the type on this stream. Once a name is
//!   asked for, an empty list means nothing, not everything.
//! - State of the world: each request's names replace the subscription.
//!   Delta: `resource_names_subscribe` / `_unsubscribe` change it, on every
//!   request, whatever its nonce.
//! - A name subscribed is sent even when the client already has it (it may
//!   have forgotten it); one that does not exist is listed in
//!   `removed_resources` and stays subscribed: it is sent when it appears.
//! - A name unsubscribed while wildcard still covers it is sent again.
//! - The names a client holds are those it was last sent, NACK or not (an
//!   xDS client may apply the valid part of a response it NACKs; a name
//!   it was sent is not owed to it again), less those it unsubscribed
//!   since (Envoy drops a resource it unsubscribes from).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Weak};

use crate::proto::wire::NameList;

use super::type_state::{ReportedNames, Trust};
use super::wakes::Registration;
use crate::cache::memo::MemoKey;
use crate::cache::{CachedResource, CollectionSnapshot, Content, Diff};
use crate::SharedStr;

/// The wildcard name.
pub const WILDCARD: &str = "*";

/// Names in order, each once. Shared: a subscription, what the client
/// holds of it and the debug view are one allocation while they are equal,
/// and each name is the cache's own `Arc` where the collection has it.
#[derive(Clone, Debug, Eq)]
pub struct NameSet(Arc<[SharedStr]>);

/// The same names: the same storage first, or equal. `Arc<[T]>`'s own `==`
/// reads every element (std has no pointer test for it), which for a
/// settled client's 50 names was a read of 400 bytes and their strings'
/// heads on every response and ACK (`Named::settled`: 374 instructions and
/// 5.7 misses of a 2 MB cache a response in eds, BENCHMARKS session 36).
impl PartialEq for NameSet {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Default for NameSet {
    fn default() -> Self {
        NameSet(Arc::from(Vec::new()))
    }
}

impl NameSet {
    /// From names in any order, repeats dropped.
    pub(crate) fn from_unsorted(mut names: Vec<SharedStr>) -> Self {
        names.sort_unstable();
        names.dedup();
        NameSet(names.into())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0.binary_search_by(|n| (**n).cmp(name)).is_ok()
    }

    /// Where `name` is among them.
    fn position(&self, name: &str) -> Option<usize> {
        self.0.binary_search_by(|n| (**n).cmp(name)).ok()
    }

    pub fn get(&self, i: usize) -> Option<&SharedStr> {
        self.0.get(i)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, SharedStr> {
        self.0.iter()
    }

    /// The first `n` names: the same storage when there are no more.
    pub fn first(&self, n: usize) -> Arc<[SharedStr]> {
        if self.0.len() <= n {
            return self.0.clone();
        }
        self.0[..n].into()
    }

    /// Reads each name's length ([`super::read_together`]) before the names
    /// are compared or hashed one after another: each is an allocation of
    /// its own (the cache's), a miss for an ACK's comparison of its names
    /// and a version's lookups of them (BENCHMARKS, session 19).
    fn read_ahead(&self) {
        super::read_together(self.0.iter().map(|n| n.len()));
    }

    /// Those names that `keep` keeps (the same storage if it keeps all).
    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        if !self.0.iter().all(|n| keep(n)) {
            self.0 = self.0.iter().filter(|n| keep(n)).cloned().collect();
        }
    }
}

/// A set of resources by name: everything (wildcard), named ones, or both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub wildcard: bool,
    pub names: NameSet,
}

impl Names {
    /// Whether a state-of-the-world request's names are these, in order:
    /// what Envoy sends on every ACK, checked without allocating.
    fn repeats(&self, names: &NameList) -> bool {
        if names.len() == self.names.len() + usize::from(self.wildcard) {
            self.names.read_ahead();
        }
        let mut asked = names.iter();
        let wildcard = self.wildcard && asked.next() == Some(WILDCARD);
        wildcard == self.wildcard && asked.eq(self.names.iter().map(|n| &**n))
    }

    pub fn everything() -> Self {
        Names {
            wildcard: true,
            names: NameSet::default(),
        }
    }

    pub fn covers(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

/// What a request says about names.
#[derive(Clone, Copy, Debug)]
pub enum NameChange<'a> {
    /// State of the world: every name the client wants now.
    Replace(&'a NameList),
    /// State of the world: the names the type's last request asked for,
    /// known by their hash ([`Named::asked`]) and not read again.
    Repeated,
    /// Delta: names added and removed.
    Change {
        subscribe: &'a NameList,
        unsubscribe: &'a NameList,
    },
}

impl NameChange<'_> {
    /// Says nothing: a legacy wildcard request.
    fn is_silent(&self) -> bool {
        match self {
            NameChange::Replace(names) => names.is_empty(),
            NameChange::Repeated => false,
            NameChange::Change { subscribe, unsubscribe } => subscribe.is_empty() && unsubscribe.is_empty(),
        }
    }
}

/// More names than `--max-subscribed-names` allows.
#[derive(Debug, PartialEq, Eq)]
pub struct TooManyNames {
    pub count: usize,
}

/// What the client holds, to compute what it must be sent.
pub enum Holds<'a> {
    /// The snapshot it ACKed last, of which it holds the names in `names`.
    Snapshot(&'a CollectionSnapshot),
    /// Before its first response: the names it reported (their versions
    /// are not trusted, see `changes`).
    Reported(&'a ReportedNames),
    /// Before its first response: the names it reported, whose versions
    /// the stream trusts (a reconnect: see [`Trust`]). A name it both
    /// subscribes to and reports at the current content is held (Envoy
    /// puts names in both on reconnect, envoy#16063).
    Trusting(&'a ReportedNames, &'a Trust<'a>),
}

/// A type's subscription once the client named something (or sent `"*"`).
#[derive(Clone, Debug, Default)]
pub struct Named {
    /// What the client asks for now.
    current: Names,
    /// What it holds: what it was last sent, less what it unsubscribed
    /// since. Always within `current`.
    held: Names,
    /// Names it must be sent (or told are gone) whatever it holds.
    resend: BTreeSet<SharedStr>,
    /// State of the world: the resources its names selected last, so that
    /// the next selection reads only the names that changed since (an
    /// Envoy asks for ~50 endpoints of tens of thousands; each push changes
    /// one or two of them). Boxed: a delta client and one sent only what
    /// changed keep none.
    selection: Option<Box<Selection>>,
    /// State of the world: a keyed hash of the names of the request that
    /// made `current`, in its order ([`NameList::hash`]); 0 for none. An
    /// Envoy sends the same names on every ACK: the same hash is the same
    /// subscription, found without a name compared. A client that found
    /// another list of names with the same hash would only keep its own
    /// subscription from changing.
    asked: u64,
    /// Each name of `current`'s [`name_hash`], in its order, made when
    /// first needed after the names changed: a response the wake index
    /// cannot hand its changed names ([`Self::changes_woken`]) looks the
    /// client's names up in what changed by these ([`ChangedNames::may_hold_each`])
    /// without reading a name (each a cache miss of its own: 4 to 6 % of
    /// eds's update phase), and reads only the few that may have changed.
    hashes: std::cell::OnceCell<Box<[u16]>>,
}

/// The key of the hashes of requests' names ([`Named::asked`]): random per
/// process, so that no client can choose names that collide.
pub fn names_seed() -> u64 {
    use std::hash::BuildHasher;
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u64))
}

/// The resources of `names` in the collection at `version` (an entry per
/// name, `None` where there is none), in name order: a function of the two,
/// whatever the client did with them. Held weakly, so that a selection pins
/// nothing the cache let go: a resource the cache moved into another chunk
/// (the same content, new storage) is read again by name once its old copy
/// is gone.
#[derive(Clone, Debug)]
struct Selection {
    names: NameSet,
    version: SharedStr,
    resources: Vec<Option<Weak<CachedResource>>>,
}

impl Named {
    /// Whether a state-of-the-world request's names, hashed with
    /// [`names_seed`] before they are read, are those the last
    /// request asked for ([`NameChange::Repeated`]).
    pub fn repeats_asked(&self, hash: u64) -> bool {
        self.asked != 0 && self.asked == hash
    }

    /// A request `change`s the names of a type followed with `named`;
    /// `sent_everything`: a response went out under legacy wildcard (the
    /// client holds all it had); `known`: the collection as the cache has
    /// it, whose names are shared rather than copied per client.
    /// `Ok(true)` when the subscription changed.
    pub fn apply(
        named: &mut Option<Box<Named>>,
        change: NameChange<'_>,
        sent_everything: bool,
        known: Option<&CollectionSnapshot>,
        max: usize,
    ) -> Result<bool, TooManyNames> {
        if named.is_none() && change.is_silent() {
            // Legacy wildcard goes on.
            return Ok(false);
        }
        let named = named.get_or_insert_with(|| {
            Box::new(Named {
                // The legacy wildcard ends with the first name.
                current: Names::default(),
                held: if sent_everything {
                    Names::everything()
                } else {
                    Names::default()
                },
                resend: BTreeSet::new(),
                selection: None,
                asked: 0,
                hashes: std::cell::OnceCell::new(),
            })
        });
        let shared = |name: &str| -> SharedStr {
            known
                .and_then(|k| k.resources.get_key_value(name))
                .map_or_else(|| SharedStr::from(name), |(key, _)| key.clone())
        };
        let mut changed = false;
        // Compared before anything is allocated: clients repeat the same
        // names on every ACK.
        let hash = match change {
            NameChange::Replace(names) => names.hash(names_seed()),
            NameChange::Repeated | NameChange::Change { .. } => 0,
        };
        match change {
            NameChange::Repeated => {}
            NameChange::Replace(_) if named.repeats_asked(hash) => {}
            NameChange::Replace(names) if named.current.repeats(names) => named.asked = hash,
            NameChange::Replace(names) => {
                let wildcard = names.iter().any(|n| n == WILDCARD);
                let asked: BTreeSet<&str> = names.iter().filter(|n| *n != WILDCARD).collect();
                if asked.len() > max {
                    return Err(TooManyNames { count: asked.len() });
                }
                if wildcard != named.current.wildcard
                    || !asked.iter().copied().eq(named.current.names.iter().map(|n| &**n))
                {
                    named.subscribe(Names {
                        wildcard,
                        names: NameSet(asked.into_iter().map(shared).collect()),
                    });
                    // A name dropped is dropped by the client too: asked
                    // for again, it is sent again.
                    named.held.wildcard &= wildcard;
                    let current = &named.current.names;
                    named.held.names.retain(|n| current.contains(n));
                    changed = true;
                }
                named.asked = hash;
            }
            // A delta ACK: it says nothing of names (every ACK of an Envoy;
            // rebuilding the set for it was 5 % of the gateway's CPU in
            // `mcp-load --scenario eds --protocol xds-delta`).
            NameChange::Change { subscribe, unsubscribe } if subscribe.is_empty() && unsubscribe.is_empty() => {}
            NameChange::Change { subscribe, unsubscribe } => {
                named.asked = 0;
                let mut names: Vec<SharedStr> = named.current.names.iter().cloned().collect();
                let before = names.len();
                for name in unsubscribe.iter() {
                    if name == WILDCARD {
                        changed |= std::mem::replace(&mut named.current.wildcard, false);
                        named.held.wildcard = false;
                        continue;
                    }
                    names.retain(|n| **n != *name);
                    named.resend.remove(name);
                    // Still covered: the client may have dropped it.
                    if named.current.wildcard {
                        named.resend.insert(shared(name));
                        changed = true;
                    }
                }
                changed |= names.len() != before;
                for name in subscribe.iter() {
                    if name == WILDCARD {
                        changed |= !std::mem::replace(&mut named.current.wildcard, true);
                        continue;
                    }
                    let name = shared(name);
                    names.push(name.clone());
                    // Sent again even if held: always a change.
                    named.resend.insert(name);
                    changed = true;
                }
                let names = NameSet::from_unsorted(names);
                // Owed only what it still asks for: a name re-sent because
                // wildcard covered it is not, once wildcard is gone too.
                let wildcard = named.current.wildcard;
                named.resend.retain(|n| wildcard || names.contains(n));
                if names.len().max(named.resend.len()) > max {
                    return Err(TooManyNames {
                        count: names.len().max(named.resend.len()),
                    });
                }
                if names != named.current.names {
                    let current = &names;
                    named.held.names.retain(|n| current.contains(n));
                    let wildcard = named.current.wildcard;
                    named.subscribe(Names { wildcard, names });
                }
            }
        }
        Ok(changed)
    }

    /// The client now asks for `current`: the one place its names change,
    /// so the hashes made of them ([`Named::hashes`]) are made again when
    /// next needed, never read for other names.
    fn subscribe(&mut self, current: Names) {
        self.current = current;
        self.hashes = std::cell::OnceCell::new();
    }

    pub fn current(&self) -> &Names {
        &self.current
    }

    /// The client holds what it asked for: nothing to send unless the
    /// collection changes.
    pub fn settled(&self) -> bool {
        self.resend.is_empty() && self.held == self.current
    }

    /// Wildcard now and held, nothing to re-send: the client is served as
    /// if it named nothing (the shared responses).
    pub fn is_everything(&self) -> bool {
        self.current.wildcard && self.held.wildcard && self.resend.is_empty()
    }

    /// A first response to a wildcard subscription with no name to answer:
    /// the shared one.
    pub fn first_is_shared(&self) -> bool {
        self.current.wildcard && self.resend.is_empty()
    }

    /// `names`, where it asks for them, are to be sent with the next
    /// response whatever it holds.
    pub fn resend<'a>(&mut self, names: impl IntoIterator<Item = &'a SharedStr>) {
        for name in names {
            if self.current.covers(name) {
                self.resend.insert(name.clone());
            }
        }
    }

    /// `names` are not to be sent with the next response after all (a
    /// reconnecting client holds them, and their removal waits).
    pub fn unresend(&mut self, names: &BTreeSet<SharedStr>) {
        self.resend.retain(|name| !names.contains(name));
    }

    /// A response went out for the current subscription: the client holds
    /// it, whether it ACKs or NACKs it (the same storage as the
    /// subscription's).
    pub fn on_sent(&mut self) {
        self.held = self.current.clone();
        self.resend.clear();
    }

    /// Whether a resource the client asks for by name differs between `from`
    /// and `to` (is new, changed or gone). Wildcard: see the versions.
    ///
    /// Every named client at `from` asks this when `to` comes: the names
    /// that changed are found once per pair of versions and kept with `to`
    /// ([`changed_names`]: from the steps `to` was published by, the size
    /// of the change), and each client looks its own names up in them.
    pub fn touched(&self, from: &CollectionSnapshot, to: &CollectionSnapshot) -> bool {
        self.among(&changed_names(from, to)).next().is_some()
    }

    /// State of the world: the resources of `to` the client asked for. From
    /// its last selection when that was at `from`: only the names that
    /// changed from `from` to `to` are looked up (the changed names are
    /// found once per pair of versions, see [`Self::touched`]), and those
    /// whose old copy is gone.
    pub fn selected(&mut self, from: Option<&CollectionSnapshot>, to: &CollectionSnapshot) -> Vec<Arc<CachedResource>> {
        if self.current.wildcard {
            return to.resources.values().cloned().collect();
        }
        let names = self.current.names.clone();
        let last = self
            .selection
            .take()
            .filter(|last| last.names == names && from.is_some_and(|from| from.version == last.version));
        let mut entries = match (last, from) {
            (Some(last), Some(from)) => {
                let mut entries = last.resources;
                // Each name finds its own place: in any order.
                for name in self.among(&changed_names(from, to)) {
                    if let Some(i) = names.position(name) {
                        entries[i] = to.resource(name).as_ref().map(Arc::downgrade);
                    }
                }
                entries
            }
            _ => names.iter().map(|n| to.resources.get(n).map(Arc::downgrade)).collect(),
        };
        // Each reference count read before any is taken: taking one
        // (`Weak::upgrade`) is a locked compare-and-swap, and two thirds of
        // this function's own samples were that load (BENCHMARKS, session
        // 19; see `read_together`).
        super::read_together(entries.iter().flatten().map(Weak::strong_count));
        let mut resources = Vec::with_capacity(entries.len());
        for (entry, name) in entries.iter_mut().zip(names.iter()) {
            let Some(held) = entry else { continue };
            match held.upgrade() {
                Some(resource) => resources.push(resource),
                // Moved by the cache, and its old copy let go: the same
                // content where the cache keeps it now, found where the
                // last applies stored it.
                None => {
                    let now = to.resource(name);
                    *entry = now.as_ref().map(Arc::downgrade);
                    resources.extend(now);
                }
            }
        }
        self.selection = Some(Box::new(Selection {
            names,
            version: to.version.clone(),
            resources: entries,
        }));
        resources
    }

    /// No selection is kept: the next is made anew (a client sent only
    /// what changed needs none).
    pub fn forget_selection(&mut self) {
        self.selection = None;
    }

    /// The client's names are as selected at `from` in `to` as well (none of
    /// them changed): the last selection holds for `to`.
    pub fn untouched_since(&mut self, from: &str, to: &SharedStr) {
        let current = &self.current.names;
        match self.selection.as_mut() {
            Some(selection) if *selection.version == *from && selection.names == *current => {
                selection.version = to.clone();
            }
            // Of other names or another version: what holds for `to` is
            // not known.
            _ => self.selection = None,
        }
    }

    /// Delta: what the client must be sent to hold `to` as subscribed, from
    /// what it holds. Each name at most once, sorted.
    pub fn changes(&self, holds: Holds<'_>, to: &CollectionSnapshot) -> Diff {
        self.changes_woken(holds, to, None)
    }

    /// [`Self::changes`], for a client the wake index wakes by its names
    /// (`woken`: its registration there): holding its names at a version
    /// the slot published, it reads which of them changed as the index
    /// found them, not by looking each up among what changed (about 1,000
    /// instructions a response of eds: BENCHMARKS, session 40).
    pub fn changes_woken(&self, holds: Holds<'_>, to: &CollectionSnapshot, woken: Option<&Registration>) -> Diff {
        match holds {
            Holds::Snapshot(from) if self.holds_its_names() => {
                if let Some(woken) = woken.filter(|woken| woken.is_for(&self.current.names)) {
                    let mut diff = Diff::default();
                    let found = woken.changed_between(&from.version, &to.version, |name| match to.resource(name) {
                        Some(now) => diff.upserts.push(now),
                        None => diff.removed.push(name.clone()),
                    });
                    if found {
                        return diff;
                    }
                }
                self.changed_since(from, to)
            }
            _ => self.changes_by_name(holds, to),
        }
    }

    /// [`Self::changes`], name by name.
    fn changes_by_name(&self, holds: Holds<'_>, to: &CollectionSnapshot) -> Diff {
        // The reported names as a set, made for the first name that is gone
        // (rare): a reconnecting client whose names all exist is read
        // without one.
        let reported_set: std::cell::OnceCell<HashSet<&str>> = std::cell::OnceCell::new();
        // Whether the client holds `name` at `resource`'s version (with
        // `None`: at all).
        let holds_at = |name: &str, resource: Option<&CachedResource>| -> bool {
            match &holds {
                Holds::Snapshot(from) => {
                    self.held.covers(name)
                        && match (from.resources.get(name), resource) {
                            (Some(held), Some(now)) => held.same_content(now),
                            (held, None) => held.is_some(),
                            (None, Some(_)) => false,
                        }
                }
                // What a client reports is what it last ACKed, not what it
                // holds after a response it applied in part: every resource
                // is sent again; a name it reports that is gone is removed.
                Holds::Reported(reported) => {
                    resource.is_none() && reported_set.get_or_init(|| reported.iter().collect()).contains(name)
                }
                Holds::Trusting(reported, trust) => match resource {
                    Some(resource) => trust.holds(resource),
                    None => reported_set.get_or_init(|| reported.iter().collect()).contains(name),
                },
            }
        };
        let trusting = matches!(holds, Holds::Trusting(..));
        let mut upserts = crate::cache::Upserts::new();
        let mut removed: BTreeSet<SharedStr> = BTreeSet::new();
        // A name is sent when it is to be re-sent or the client does not hold
        // it at its version; it is removed when it is gone and the client
        // holds it or is owed an answer for it.
        let mut consider = |name: &SharedStr| {
            let resend = self.resend.contains(name);
            match to.resources.get(name) {
                // A name subscribed on a trusted reconnect is sent if not held.
                Some(resource) if (resend && !trusting) || !holds_at(name, Some(resource)) => {
                    upserts.push(resource.clone())
                }
                Some(_) => {}
                None if resend || holds_at(name, None) => {
                    removed.insert(name.clone());
                }
                None => {}
            }
        };
        let mut shared_diff = None;
        match (&holds, self.current.wildcard) {
            // Wildcard held and asked: what changed, proportional to the
            // change (the shared responses' diff).
            (Holds::Snapshot(from), true) if self.held.wildcard => {
                shared_diff = Some(Diff::between(&from.resources, &to.resources));
            }
            (_, true) => to.resources.keys().for_each(&mut consider),
            (_, false) => self.current.names.iter().for_each(&mut consider),
        }
        self.resend.iter().for_each(&mut consider);
        // What the client holds (of what it asks for) and no longer exists.
        match &holds {
            Holds::Snapshot(_) => self
                .held
                .names
                .iter()
                .filter(|n| self.current.covers(n))
                .for_each(&mut consider),
            Holds::Reported(reported) | Holds::Trusting(reported, _) => {
                // A name it asks for by name was considered above (a
                // wildcard client's names only where they exist): looked up
                // among its own names, not again in the collection.
                let considered = |name: &str| !self.current.wildcard && self.current.names.contains(name);
                for name in reported.iter() {
                    if !considered(name) && !to.resources.contains_key(name) {
                        consider(&SharedStr::from(name));
                    }
                }
            }
        }
        if let Some(diff) = shared_diff {
            upserts.extend(diff.upserts);
            removed.extend(diff.removed);
        }
        upserts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        upserts.dedup_by(|a, b| a.name == b.name);
        Diff {
            upserts,
            removed: removed.into_iter().collect(),
        }
    }
}

impl Named {
    /// It holds exactly the names it asks for (by name), nothing to re-send:
    /// the settled subscription of an Envoy's EDS or RDS.
    fn holds_its_names(&self) -> bool {
        !self.current.wildcard && !self.held.wildcard && self.resend.is_empty() && self.held.names == self.current.names
    }

    /// Whether [`Self::among`] finds the client's names from `changed` (the
    /// smaller), in that set's order, not from its own names in name order.
    fn found_from_changed(&self, changed: &ChangedNames) -> bool {
        changed.len() < self.current.names.len()
    }

    /// The client's names among `changed`, found from whichever of the two
    /// is smaller (in name order only when found from its names: see
    /// [`Self::found_from_changed`]).
    fn among<'a>(&'a self, changed: &'a ChangedNames) -> impl Iterator<Item = &'a SharedStr> + 'a {
        let names = &self.current.names;
        let from_changed = self.found_from_changed(changed);
        let by_changed = from_changed.then(|| changed.iter().filter(move |n| names.contains(n)));
        let by_names = (!from_changed).then(|| {
            let hashes = self.hashes.get_or_init(|| names.iter().map(|n| name_hash(n)).collect());
            FilterHits {
                names: &names.0,
                // As many as the names (the same list's, made with it):
                // never a hash without its name.
                hashes: &hashes[..hashes.len().min(names.len())],
                changed,
                next: 0,
                base: 0,
                mask: 0,
            }
        });
        by_changed.into_iter().flatten().chain(by_names.into_iter().flatten())
    }

    /// Delta, holding its names at `from`: those of them that changed from
    /// `from` to `to` (found once per pair of versions), sent or removed;
    /// nothing else is looked up.
    fn changed_since(&self, from: &CollectionSnapshot, to: &CollectionSnapshot) -> Diff {
        let changed = changed_names(from, to);
        let mut diff = Diff::default();
        // Read as found, not gathered first (an allocation per response).
        for name in self.among(&changed) {
            match to.resource(name) {
                Some(now) => diff.upserts.push(now),
                None => diff.removed.push(name.clone()),
            }
        }
        if self.found_from_changed(&changed) {
            // Found in the set's order: each list put in name order.
            diff.upserts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
            diff.removed.sort_unstable();
        }
        diff
    }
}

/// Names that changed between two versions, looked up by every named
/// client those versions touch (50 names each for an Envoy's EDS): hashed
/// with foldhash (randomly seeded) rather than std's SipHash (the lookups
/// took 6.6 % of the gateway's samples in `mcp-load --scenario eds`, 2.4 %
/// with foldhash; BENCHMARKS, session 12). Its keys are the cache's names,
/// never a client's: a client's names are only looked up in it, so no
/// client chooses what collides. (The wake index, keyed by the names
/// clients ask for, keeps std's keyed SipHash.)
///
/// With a filter of the names' [`name_hash`]es: a client's names are looked
/// for by the hashes it keeps beside them ([`Named::hashes`]), and only
/// those the filter may hold are read and looked up.
#[derive(Debug)]
pub(super) struct ChangedNames {
    names: HashSet<SharedStr, foldhash::fast::RandomState>,
    /// A bit per value of the hash's low bits, set for each name's: at
    /// least 64 bits a name (4,096 to 65,536 bits), so that a name not in
    /// the set passes for one in under 2 % of lookups (a few per cent for
    /// changes above a thousand names).
    filter: Box<[u64]>,
}

/// A client's names that are in a [`ChangedNames`], in name order, found by
/// their hashes: the hashes are tested against the set's filter 64 at a
/// time into a mask (a load, a shift and an `or` each, no branch), and only
/// the names the mask has are read and looked up in the set. As an
/// iterator's `filter` over both lists, each name took a branch and a store
/// of the iterator's place (about 24 instructions a name; 1,200 a response
/// of eds, a client's 50 names; BENCHMARKS, session 38).
struct FilterHits<'a> {
    names: &'a [SharedStr],
    /// `names`' [`name_hash`]es, in their order.
    hashes: &'a [u16],
    changed: &'a ChangedNames,
    /// The first name of the next block of 64.
    next: usize,
    /// The first name of the block `mask` is of.
    base: usize,
    /// Of the block at `base`, the names the filter may hold and not yet
    /// looked up, a bit each.
    mask: u64,
}

impl<'a> Iterator for FilterHits<'a> {
    type Item = &'a SharedStr;

    fn next(&mut self) -> Option<&'a SharedStr> {
        loop {
            while self.mask != 0 {
                let i = self.base + self.mask.trailing_zeros() as usize;
                self.mask &= self.mask - 1;
                let name = &self.names[i];
                if self.changed.contains(name) {
                    return Some(name);
                }
            }
            if self.next >= self.hashes.len() {
                return None;
            }
            let end = (self.next + 64).min(self.hashes.len());
            self.base = self.next;
            self.mask = self.changed.may_hold_each(&self.hashes[self.next..end]);
            self.next = end;
        }
    }
}

/// Bits of a [`ChangedNames`]' filter: a power of two, 64 a name, within
/// 4,096 and 65,536 (the span of a [`name_hash`]).
fn filter_bits(names: usize) -> usize {
    (names.saturating_mul(64)).next_power_of_two().clamp(1 << 12, 1 << 16)
}

/// A name's hash for [`ChangedNames`]' filter: keyed per process (the same
/// key as [`Named::asked`]'s), 16 bits (a client keeps one per name).
fn name_hash(name: &str) -> u16 {
    use std::hash::BuildHasher;
    let hash = foldhash::fast::FixedState::with_seed(names_seed()).hash_one(name);
    (hash ^ (hash >> 16) ^ (hash >> 32) ^ (hash >> 48)) as u16
}

impl ChangedNames {
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &SharedStr> {
        self.names.iter()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Whether a name of hash `hash` may be in the set (false: it is not).
    #[cfg(test)]
    fn may_hold(&self, hash: u16) -> bool {
        self.may_hold_each(&[hash]) != 0
    }

    /// [`Self::may_hold`] for each of at most 64 hashes: bit `i` set when
    /// the name of `hashes[i]` may be in the set.
    fn may_hold_each(&self, hashes: &[u16]) -> u64 {
        debug_assert!(hashes.len() <= 64);
        // A power of two (`filter_bits`): a hash's word is its bits above
        // the sixth, masked, and always within the filter.
        let words = self.filter.len();
        debug_assert!(words.is_power_of_two());
        let mut mask = 0u64;
        for (i, &hash) in hashes.iter().enumerate() {
            let hash = usize::from(hash);
            let word = self.filter[(hash >> 6) & (words - 1)];
            mask |= ((word >> (hash & 63)) & 1) << (i & 63);
        }
        mask
    }
}

impl FromIterator<SharedStr> for ChangedNames {
    fn from_iter<I: IntoIterator<Item = SharedStr>>(iter: I) -> Self {
        // Room for the most the names can be (a lineage's union, filtered,
        // says only that), not grown from nothing by rehashes.
        let iter = iter.into_iter();
        let (least, most) = iter.size_hint();
        let mut names: HashSet<SharedStr, foldhash::fast::RandomState> =
            HashSet::with_capacity_and_hasher(most.unwrap_or(least), Default::default());
        names.extend(iter);
        let bits = filter_bits(names.len());
        let mut filter = vec![0u64; bits / 64].into_boxed_slice();
        for name in &names {
            let bit = usize::from(name_hash(name)) & (bits - 1);
            filter[bit / 64] |= 1 << (bit % 64);
        }
        ChangedNames { names, filter }
    }
}

/// Distinct from-versions whose changed names a snapshot keeps (clients
/// are normally at one or two versions).
const CHANGED_NAMES_PER_SNAPSHOT: usize = 32;

/// The names of the resources that differ between `from` and `to` (new,
/// changed or gone), made once per pair and kept with `to`: from `to`'s
/// [`Lineage`] when `from` is in it (a union of the few steps between, the
/// size of the change), else by a diff of the two maps (a walk of every
/// part of them that is not shared, which between versions a client
/// skipped is most of a collection).
///
/// Between `to` and the version it was applied on (where every client a
/// version touched was, unless it skipped one), kept with `to`'s step
/// ([`CollectionSnapshot::step_made`]); between any other pair, among
/// `to`'s memos.
pub(super) fn changed_names(from: &CollectionSnapshot, to: &CollectionSnapshot) -> Arc<ChangedNames> {
    if let Some(changed) = to.step_made(&from.version, || made_changed_names(from, to)) {
        return changed;
    }
    let key = MemoKey::with("names.changed", from.version.clone());
    to.memo
        .get_or_make(key, CHANGED_NAMES_PER_SNAPSHOT, || made_changed_names(from, to))
}

/// [`changed_names`], made: from `to`'s [`Lineage`], else by a diff.
fn made_changed_names(from: &CollectionSnapshot, to: &CollectionSnapshot) -> ChangedNames {
    if let Some(changed) = to
        .memo
        .find::<Lineage>(&LINEAGE)
        .and_then(|l| l.changed_since(&from.version))
    {
        return changed;
    }
    let diff = Diff::between(&from.resources, &to.resources);
    diff.upserts
        .into_iter()
        .map(|r| r.name.clone())
        .chain(diff.removed)
        .collect()
}

/// [`changed_names`] for `to` published after `from` in one slot, which
/// first records the step in `to`'s [`Lineage`]: every named client at
/// `from` or a few versions before it then finds its changed names from
/// the steps, not by a diff.
pub(super) fn published_changes(from: &CollectionSnapshot, to: &CollectionSnapshot) -> Arc<ChangedNames> {
    to.memo.get_or_make(LINEAGE, 1, || Lineage::after(from, to));
    changed_names(from, to)
}

/// The memo key of a snapshot's [`Lineage`].
const LINEAGE: MemoKey = MemoKey::of("names.lineage");

/// Steps a lineage keeps at most: a named client is rarely left behind by
/// more versions (the wake index wakes one left alone by
/// [`super::wakes::SETTLE_AFTER`] in a row).
const LINEAGE_STEPS: usize = 8;

/// Changed names a lineage keeps at most over its steps: a quarter of its
/// collection (past that, a diff of the two maps costs about what a union
/// of the steps does), within the bounds of what a snapshot keeps of its
/// apply's change ([`crate::cache::step_names`]: at least 64, at most
/// 16,384). A step larger than that alone is not kept (a collection
/// delivered whole, or changing in large parts): the snapshot knows no
/// lineage, its clients diff, and the next step starts a new one. Each
/// name ~80 bytes of map: at most ~1.3 MB per snapshot whatever the churn,
/// ~70 KB for eds's 1 % of 10,000 changing.
fn lineage_names(collection: usize) -> usize {
    crate::cache::step_names(collection)
}

/// What one published version changed from the one published before it:
/// each changed name's content before and after (`None`: absent).
type Step = HashMap<SharedStr, (Option<Content>, Option<Content>), foldhash::fast::RandomState>;

/// The steps by which a snapshot was published, newest first: each the
/// version it came from and what changed. Unbroken: a step's version is the
/// one the next older step went to. Between one of those versions and the
/// snapshot, the names that differ are among the steps' names, and a name
/// differs when its content before the oldest of those steps that has it is
/// not its content after the newest (a name changed and changed back is in
/// the steps, and not a change). Versions are the content's, so a client
/// at one of those versions holds what the step came from, whichever
/// snapshot it was sent it in.
#[derive(Default)]
struct Lineage {
    steps: Vec<(SharedStr, Arc<Step>)>,
}

impl Lineage {
    /// `to`'s lineage, published after `from`: the step between them, then
    /// the steps of `from`'s lineage that fit.
    fn after(from: &CollectionSnapshot, to: &CollectionSnapshot) -> Self {
        let bound = lineage_names(to.resources.len());
        let step = match to.changed_from(&from.version) {
            // What the apply that made `to` from `from` changed: looked up,
            // not found by a walk of both maps (every leaf the change
            // touched, which at 1 % of eds's 10,000 is most of them).
            Some(changed) if changed.len() <= bound => {
                let content =
                    |snapshot: &CollectionSnapshot, name: &str| snapshot.resources.get(name).map(|r| r.content());
                changed
                    .iter()
                    .map(|name| (name.clone(), (content(from, name), content(to, name))))
                    .filter(|(_, (before, after))| before != after)
                    .collect()
            }
            Some(_) => return Self::default(),
            None => match Self::diffed(from, to, bound) {
                Some(step) => step,
                None => return Self::default(),
            },
        };
        let mut kept = step.len();
        let mut steps = vec![(from.version.clone(), Arc::new(step))];
        if let Some(before) = from.memo.find::<Lineage>(&LINEAGE) {
            let older = before.steps.iter().take(LINEAGE_STEPS - 1).take_while(|(_, step)| {
                kept += step.len();
                kept <= bound
            });
            steps.extend(older.cloned());
        }
        Self { steps }
    }

    /// The step from `from` to `to` found by a diff of their maps; `None`
    /// past `bound` names.
    fn diffed(from: &CollectionSnapshot, to: &CollectionSnapshot, bound: usize) -> Option<Step> {
        let mut step = Step::default();
        for item in from.resources.diff(&to.resources) {
            let (name, change) = match item {
                imbl::ordmap::DiffItem::Add(name, new) => (name, (None, Some(new.content()))),
                imbl::ordmap::DiffItem::Update { old: (name, old), new } => {
                    (name, (Some(old.content()), Some(new.1.content())))
                }
                imbl::ordmap::DiffItem::Remove(name, old) => (name, (Some(old.content()), None)),
            };
            step.insert(name.clone(), change);
            if step.len() > bound {
                return None;
            }
        }
        Some(step)
    }

    /// The names that differ between `version` and the snapshot, if
    /// `version` is one the steps came from.
    fn changed_since(&self, version: &str) -> Option<ChangedNames> {
        let last = self.steps.iter().position(|(from, _)| **from == *version)?;
        let steps = &self.steps[..=last];
        if let [(_, step)] = steps {
            return Some(step.keys().cloned().collect());
        }
        // With room for every name of the steps: not grown by rehashes
        // (a lineage of a few steps holds a few hundred names).
        let most = steps.iter().map(|(_, step)| step.len()).sum();
        // Oldest first: a name's content before the oldest step that has
        // it, and after the newest.
        let mut net: HashMap<&SharedStr, (Option<Content>, Option<Content>), foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(most, Default::default());
        for (_, step) in steps.iter().rev() {
            for (name, &(before, after)) in step.iter() {
                net.entry(name)
                    .and_modify(|(_, now)| *now = after)
                    .or_insert((before, after));
            }
        }
        Some(
            net.into_iter()
                .filter(|(_, (before, after))| before != after)
                .map(|(name, _)| name.clone())
                .collect(),
        )
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::cache::{Cache, Origin, Update};

    /// A resource whose body is `name@version` (the wake index's tests
    /// share it).
    pub(in crate::downstream) fn resource(name: &str, version: &str) -> CachedResource {
        let none = std::collections::HashMap::<String, String>::new();
        let body = format!("{name}@{version}");
        let digest = crate::cache::content_digest(body.as_bytes(), &none, &none);
        CachedResource::new(name.into(), bytes::Bytes::from(body), digest)
    }

    /// What a woken client reads of its changed names from the wake index
    /// ([`Named::changes_woken`]) is what looking its names up finds, for
    /// every pair of versions it may hold and be sent: over one version,
    /// over several (names changed and changed back), for clients
    /// registered or renamed between versions, and where the index cannot
    /// say (a version before its names, one no longer kept), by the
    /// lookup. Each client that holds its names at the version before the
    /// last reads the last's change from the index.
    #[test]
    fn the_names_the_wake_index_hands_a_client_are_those_that_changed() {
        use crate::downstream::registry::{Protocol, Registry};
        use crate::downstream::wakes::Wakes;
        proptest::proptest!(proptest::test_runner::Config::with_cases(48), |(
            states in proptest::collection::vec(proptest::collection::vec(0u8..3, 12), 1..9),
            clients in proptest::collection::vec(
                (proptest::collection::btree_set(0usize..12, 1..6), 0usize..9, proptest::option::of((0usize..9, proptest::collection::btree_set(0usize..12, 1..6)))),
                1..4,
            ),
        )| {
            let name = |n: usize| format!("r{n:02}");
            let (cache, mut writer) = Cache::new();
            let state = |contents: &[u8]| -> Vec<CachedResource> {
                contents
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| **c != 0)
                    .map(|(n, c)| resource(&name(n), &c.to_string()))
                    .collect()
            };
            writer.apply("c", Update::Full(state(&[1; 12])), Origin::Upstream);
            let mut versions = vec![cache.get("c").unwrap()];
            // The step each version was published at.
            let mut published_at = vec![None];
            let registry = Arc::new(Registry::default());
            let wakes = Arc::new(Wakes::default());
            let named_of = |asked: &std::collections::BTreeSet<usize>| {
                let mut named = None;
                let list = NameList::from_names(asked.iter().map(|&n| name(n)));
                Named::apply(&mut named, NameChange::Replace(&list), false, None, 1000).unwrap();
                let mut named = named.unwrap();
                named.on_sent();
                named
            };
            let entries: Vec<_> = (0..clients.len())
                .map(|i| registry.register(i as u64 + 1, None, Protocol::XdsSotw, "x", None))
                .collect();
            let mut live: Vec<Option<(Box<Named>, crate::downstream::wakes::Registration, usize)>> =
                clients.iter().map(|_| None).collect();
            for step in 0..=states.len() {
                for (i, (asked, registered_at, renamed)) in clients.iter().enumerate() {
                    if *registered_at == step {
                        let named = named_of(asked);
                        let registration = wakes.register(&named.current().names, entries[i].handle());
                        live[i] = Some((named, registration, step));
                    }
                    if let (Some((at, asked)), Some((named, registration, since))) = (renamed, &mut live[i]) {
                        if *at == step {
                            *named = named_of(asked);
                            registration.rename(&named.current().names);
                            *since = step;
                        }
                    }
                }
                let Some(contents) = states.get(step) else { break };
                writer.apply("c", Update::Full(state(contents)), Origin::Upstream);
                let to = cache.get("c").unwrap();
                let from = versions.last().unwrap().clone();
                wakes.published(Some(&from), Some(&to));
                if to.version != from.version {
                    versions.push(to);
                    published_at.push(Some(step));
                }
            }
            let listed = |diff: Diff| {
                let upserts: Vec<String> = diff.upserts.iter().map(|r| format!("{}@{}", r.name, r.version())).collect();
                (upserts, diff.removed)
            };
            for (named, registration, since) in live.iter().flatten() {
                for (i, from) in versions.iter().enumerate() {
                    for to in &versions[i..] {
                        proptest::prop_assert_eq!(
                            listed(named.changes_woken(Holds::Snapshot(from), to, Some(registration))),
                            listed(named.changes_by_name(Holds::Snapshot(from), to))
                        );
                    }
                }
                // Named before the last version was published: its change
                // is read from the index.
                let last = versions.len() - 1;
                if published_at[last].is_some_and(|at| at >= *since) {
                    let (from, to) = (&versions[last - 1], &versions[last]);
                    proptest::prop_assert!(registration.changed_between(&from.version, &to.version, |_| ()));
                }
            }
        });
    }

    /// A state-of-the-world selection made from the last one (only the
    /// names that changed looked up) is the selection made afresh, and a
    /// delta diff from the changed names is the one made name by name, through
    /// changes to the client's names, to others', new names and removals,
    /// and versions that left its names alone.
    #[test]
    fn a_selection_from_the_last_one_is_the_fresh_one() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(32), |(
            asked in proptest::collection::btree_set(0usize..120, 1..30),
            steps in proptest::collection::vec(proptest::collection::vec((0usize..120, 0u8..6), 0..12), 1..10),
        )| {
            let name = |n: usize| format!("r{n:03}");
            let (cache, mut writer) = Cache::new();
            writer.apply("c", Update::Full((0..100).map(|n| resource(&name(n), "0")).collect()), Origin::Upstream);
            let asked = NameList::from_names(asked.iter().map(|&n| name(n)));
            let mut named = None;
            Named::apply(&mut named, NameChange::Replace(&asked), false, cache.get("c").as_deref(), 1000).unwrap();
            let named = named.as_mut().unwrap();
            named.on_sent();
            let mut from = cache.get("c").unwrap();
            named.selected(None, &from);
            for (step, changes) in steps.iter().enumerate() {
                let mut upserts = Vec::new();
                let mut removed = Vec::new();
                for &(n, what) in changes {
                    match what {
                        0 => removed.push(name(n)),
                        _ => upserts.push(resource(&name(n), &(step + 1).to_string())),
                    }
                }
                writer.apply("c", Update::Incremental { upserts, removed }, Origin::Upstream);
                let to = cache.get("c").unwrap();
                // Delta: the changed names alone give what name by name does.
                let listed = |diff: Diff| {
                    let upserts: Vec<String> = diff.upserts.iter().map(|r| format!("{}@{}", r.name, r.version())).collect();
                    (upserts, diff.removed)
                };
                proptest::prop_assert!(named.holds_its_names());
                proptest::prop_assert_eq!(
                    listed(named.changes(Holds::Snapshot(&from), &to)),
                    listed(named.changes_by_name(Holds::Snapshot(&from), &to))
                );
                let fresh: Vec<(String, String)> = asked
                    .iter()
                    .filter_map(|n| to.resources.get(n))
                    .map(|r| (r.name.to_string(), r.version().to_string()))
                    .collect();
                if named.touched(&from, &to) {
                    let got: Vec<(String, String)> = named
                        .selected(Some(&from), &to)
                        .iter()
                        .map(|r| (r.name.to_string(), r.version().to_string()))
                        .collect();
                    proptest::prop_assert_eq!(got, fresh);
                } else {
                    named.untouched_since(&from.version, &to.version);
                }
                from = to;
            }
        });
    }

    /// The names changed between any two versions published in a row, found
    /// from the later one's lineage (a union of its steps), are those a
    /// diff of the two finds: through removals, re-additions, a name
    /// changed and changed back, and steps that skip versions of the cache
    /// (a slot publishes what it serves, not every version), and lineages
    /// cut short by their bound.
    #[test]
    fn names_changed_from_the_lineage_are_those_a_diff_finds() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(64), |(
            steps in proptest::collection::vec(
                (proptest::collection::vec((0usize..40, 0u8..4), 0..16), proptest::bool::ANY),
                1..14,
            ),
        )| {
            let name = |n: usize| format!("r{n:02}");
            let (cache, mut writer) = Cache::new();
            writer.apply("c", Update::Full((0..30).map(|n| resource(&name(n), "0")).collect()), Origin::Upstream);
            let mut published = vec![cache.get("c").unwrap()];
            let mut steps_kept: Vec<Vec<usize>> = vec![];
            for (changes, publish) in &steps {
                let mut upserts = Vec::new();
                let mut removed = Vec::new();
                for &(n, what) in changes {
                    match what {
                        0 => removed.push(name(n)),
                        // Versions from a small set: names change back.
                        _ => upserts.push(resource(&name(n), &what.to_string())),
                    }
                }
                writer.apply("c", Update::Incremental { upserts, removed }, Origin::Upstream);
                let to = cache.get("c").unwrap();
                let last = published.last().unwrap();
                if *publish && to.version != last.version {
                    published_changes(last, &to);
                    // Published right after the version it was applied on:
                    // the step is made from what the apply touched (a name
                    // added and removed again among them), the diff's own.
                    if let (Some(changed), Some(lineage)) = (to.changed_from(&last.version), to.memo.find::<Lineage>(&LINEAGE)) {
                        let diffed = Lineage::diffed(last, &to, usize::MAX).unwrap();
                        proptest::prop_assert!(diffed.keys().all(|name| changed.binary_search(name).is_ok()));
                        if let Some((from, step)) = lineage.steps.first() {
                            proptest::prop_assert_eq!(from, &last.version);
                            proptest::prop_assert_eq!(&**step, &diffed);
                        }
                    }
                    // The sizes of the steps the lineage keeps, newest
                    // first: this one, then the last one's while they fit.
                    let size = Diff::between(&last.resources, &to.resources);
                    let size = size.upserts.len() + size.removed.len();
                    let bound = lineage_names(to.resources.len());
                    let mut kept = vec![];
                    if size <= bound {
                        kept.push(size);
                        let mut total = size;
                        for &older in steps_kept.last().unwrap_or(&vec![]).iter().take(LINEAGE_STEPS - 1) {
                            total += older;
                            if total > bound {
                                break;
                            }
                            kept.push(older);
                        }
                    }
                    steps_kept.push(kept);
                    published.push(to);
                }
            }
            for (i, to) in published.iter().enumerate() {
                let lineage = to.memo.find::<Lineage>(&LINEAGE);
                let known: Vec<usize> = lineage.as_ref().map_or(vec![], |l| l.steps.iter().map(|(_, s)| s.len()).collect());
                let expected = if i == 0 { vec![] } else { steps_kept[i - 1].clone() };
                proptest::prop_assert_eq!(&known, &expected, "every step kept, up to the bounds");
                for (j, from) in published[..i].iter().enumerate() {
                    let by_diff: BTreeSet<SharedStr> = {
                        let diff = Diff::between(&from.resources, &to.resources);
                        diff.upserts.into_iter().map(|r| r.name.clone()).chain(diff.removed).collect()
                    };
                    let from_lineage = lineage.as_ref().and_then(|l| l.changed_since(&from.version));
                    if i - j <= known.len() {
                        proptest::prop_assert!(from_lineage.is_some(), "a version within the lineage is in it");
                    }
                    if let Some(names) = from_lineage {
                        proptest::prop_assert_eq!(&names.iter().cloned().collect::<BTreeSet<_>>(), &by_diff);
                    }
                    let memoized: BTreeSet<SharedStr> = changed_names(from, to).iter().cloned().collect();
                    proptest::prop_assert_eq!(&memoized, &by_diff);
                }
            }
        });
    }

    /// Two name sets are equal when they share their storage, or hold the
    /// same names (the test of the storage first is what makes a settled
    /// client's check cheap).
    #[test]
    fn name_sets_are_equal_by_storage_or_by_names() {
        let of = |names: &[&str]| NameSet::from_unsorted(names.iter().map(|n| SharedStr::from(*n)).collect());
        let a = of(&["b", "a"]);
        let shared = a.clone();
        assert!(Arc::ptr_eq(&a.0, &shared.0));
        assert_eq!(a, shared);
        // Other storage, the same names (in any order given): equal.
        assert_eq!(a, of(&["a", "b"]));
        // Other names, or fewer: not.
        assert_ne!(a, of(&["a", "c"]));
        assert_ne!(a, of(&["a"]));
        assert_eq!(NameSet::default(), of(&[]));
    }

    /// A set of changed names' filter holds every name in it (a client's
    /// name that changed is never skipped), and lets few others through:
    /// under 5 % at 64 bits a name (about 1.5 % expected), and under 25 %
    /// at its largest with more names than that (16,384 names in 65,536
    /// bits: about 22 %). A client's names found through it are those found
    /// by name.
    #[test]
    fn changed_names_filter_holds_every_name_and_few_others() {
        let others: Vec<String> = (0..20_000).map(|i| format!("other-{i}")).collect();
        for (count, most) in [(1, 0.05), (100, 0.05), (400, 0.05), (1_000, 0.05), (16_384, 0.25)] {
            let changed: ChangedNames = (0..count).map(|i| SharedStr::from(format!("changed-{i}"))).collect();
            assert!(
                changed.iter().all(|name| changed.may_hold(name_hash(name))),
                "{count} names: one not held"
            );
            let passed = others.iter().filter(|name| changed.may_hold(name_hash(name))).count();
            let rate = passed as f64 / others.len() as f64;
            assert!(rate < most, "{count} names: {rate:.3} of others pass");
        }
        // Found by hash: the client's names (more than what changed) that
        // changed, in its order, each time (the hashes made once).
        let changed: ChangedNames = ["b", "d", "x", "y", "z", "w"]
            .into_iter()
            .map(SharedStr::from)
            .collect();
        let mut named = None;
        let asked = NameList::from_names(["a", "b", "c", "d", "e"].map(String::from));
        Named::apply(&mut named, NameChange::Replace(&asked), false, None, 1000).unwrap();
        let named = named.unwrap();
        for _ in 0..2 {
            let mine: Vec<&str> = named.among(&changed).map(|n| &**n).collect();
            assert_eq!(mine, ["b", "d"]);
        }
        assert_eq!(named.hashes.get().map(|h| h.len()), Some(5));
    }

    /// A client's names found among changed names through the filter, 64
    /// hashes at a time, are exactly those a lookup of each name finds, in
    /// its order: for lists of under one block, of several, and ending
    /// inside one, and for sets of changed names smaller and larger than
    /// the client's list (found from either side).
    #[test]
    fn names_found_among_the_changed_are_those_each_lookup_finds() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(64), |(
            asked in proptest::collection::btree_set(0usize..400, 1..200),
            changed in proptest::collection::btree_set(0usize..400, 0..300),
        )| {
            let name = |n: usize| format!("r{n:03}");
            let changed: ChangedNames = changed.iter().map(|&n| SharedStr::from(name(n))).collect();
            let mut named = None;
            let list = NameList::from_names(asked.iter().map(|&n| name(n)));
            Named::apply(&mut named, NameChange::Replace(&list), false, None, 1000).unwrap();
            let named = named.unwrap();
            let mut found: Vec<&str> = named.among(&changed).map(|n| &**n).collect();
            if named.found_from_changed(&changed) {
                found.sort_unstable();
            }
            let expected: Vec<&str> = named.current.names.iter().map(|n| &**n).filter(|n| changed.contains(n)).collect();
            proptest::prop_assert_eq!(found, expected);
        });
    }

    /// A step larger than a lineage keeps (a quarter of the collection) is
    /// not kept: the snapshot knows no lineage, and its clients diff; the
    /// one after it starts a new one, and older steps leave a lineage
    /// before its names pass the bound.
    #[test]
    fn a_step_larger_than_a_lineage_keeps_starts_a_new_one() {
        let name = |n: usize| format!("r{n:03}");
        let (cache, mut writer) = Cache::new();
        writer.apply(
            "c",
            Update::Full((0..400).map(|n| resource(&name(n), "0")).collect()),
            Origin::Upstream,
        );
        let first = cache.get("c").unwrap();
        assert_eq!(lineage_names(400), 100);
        let mut next = |changed: std::ops::Range<usize>, version: &str| {
            let upserts = changed.map(|n| resource(&name(n), version)).collect();
            writer.apply(
                "c",
                Update::Incremental {
                    upserts,
                    removed: vec![],
                },
                Origin::Upstream,
            );
            cache.get("c").unwrap()
        };
        let big = next(0..101, "1");
        published_changes(&first, &big);
        assert!(big.memo.find::<Lineage>(&LINEAGE).unwrap().steps.is_empty());
        assert_eq!(changed_names(&first, &big).len(), 101, "found by a diff");
        let small = next(0..60, "2");
        published_changes(&big, &small);
        let lineage = small.memo.find::<Lineage>(&LINEAGE).unwrap();
        assert_eq!(lineage.steps.len(), 1);
        assert!(lineage.changed_since(&first.version).is_none());
        assert_eq!(changed_names(&first, &small).len(), 101);
        let last = next(300..340, "3");
        published_changes(&small, &last);
        let lineage = last.memo.find::<Lineage>(&LINEAGE).unwrap();
        assert_eq!(lineage.steps.len(), 2, "60 and 40 names: within 100");
        assert_eq!(lineage.changed_since(&big.version).unwrap().len(), 100);
        let over = next(100..141, "4");
        published_changes(&last, &over);
        let lineage = over.memo.find::<Lineage>(&LINEAGE).unwrap();
        assert_eq!(lineage.steps.len(), 2, "41, 40, and 60 would pass 100");
        assert!(lineage.changed_since(&big.version).is_none());
    }

    /// A selection pins nothing the cache let go: a change that moves a
    /// resource into another chunk (what is left of a chunk after most of it
    /// changed is copied out, so its storage can be freed) re-points it, and
    /// a client whose names the change left alone must not keep the old
    /// storage alive; once the old copy is gone, the selection reads the
    /// cache's own. (Found by a second reading: the selection held the old
    /// copies, and with them the chunk's buffer, up to the message the
    /// collection arrived in.)
    #[test]
    fn a_selection_holds_no_storage_the_cache_let_go() {
        let name = |n: usize| format!("r{n:02}");
        let (cache, mut writer) = Cache::with_history(1);
        writer.apply(
            "c",
            Update::Full((0..64).map(|n| resource(&name(n), "0")).collect()),
            Origin::Upstream,
        );
        let v1 = cache.get("c").unwrap();
        let mut named = None;
        let asked = NameList::from_names([name(0), name(63)]);
        Named::apply(&mut named, NameChange::Replace(&asked), false, Some(&v1), 1000).unwrap();
        let named = named.as_mut().unwrap();
        named.selected(None, &v1);
        let first = Arc::downgrade(&v1.resources["r00"]);
        // Most of the chunk changes, not the client's names: the rest is
        // copied out.
        let mut upsert = |names: std::ops::Range<usize>| {
            let upserts = names.map(|n| resource(&name(n), "1")).collect();
            let removed = Vec::new();
            writer.apply("c", Update::Incremental { upserts, removed }, Origin::Upstream);
            cache.get("c").unwrap()
        };
        let v2 = upsert(1..50);
        assert!(!Arc::ptr_eq(&v1.resources["r00"], &v2.resources["r00"]), "re-pointed");
        assert!(!named.touched(&v1, &v2));
        // The state machine holds what it last sent: v2 now, not v1.
        named.untouched_since(&v1.version, &v2.version);
        drop(v1);
        assert!(first.upgrade().is_none(), "r00 as first stored is held by nobody");
        // One of its names changes.
        let v3 = upsert(63..64);
        assert!(named.touched(&v2, &v3));
        let selected = named.selected(Some(&v2), &v3);
        for r in &selected {
            assert!(Arc::ptr_eq(r, &v3.resources[&*r.name]), "{} is not the cache's", r.name);
        }
        assert_eq!(selected.len(), 2);
    }

    /// A delta client that unsubscribes a name wildcard still covers is sent
    /// it again (it may have dropped it), unless it unsubscribes wildcard
    /// too: then it is owed nothing for that name. (Found by a second
    /// reading.)
    #[test]
    fn a_name_unsubscribed_under_wildcard_is_owed_nothing_once_wildcard_goes() {
        let (cache, mut writer) = Cache::new();
        writer.apply(
            "c",
            Update::Full(vec![resource("a", "1"), resource("b", "1")]),
            Origin::Upstream,
        );
        let v1 = cache.get("c").unwrap();
        let strings = |names: &[&str]| NameList::from_names(names.iter().copied());
        let change = |named: &mut Option<Box<Named>>, subscribe: &[&str], unsubscribe: &[&str]| {
            let (subscribe, unsubscribe) = (strings(subscribe), strings(unsubscribe));
            let change = NameChange::Change {
                subscribe: &subscribe,
                unsubscribe: &unsubscribe,
            };
            Named::apply(named, change, false, Some(&v1), 100).unwrap();
        };
        let mut named = None;
        change(&mut named, &["*", "a"], &[]);
        named.as_mut().unwrap().on_sent();
        change(&mut named, &[], &["a"]);
        assert!(
            named.as_ref().unwrap().resend.contains("a"),
            "still covered: sent again"
        );
        change(&mut named, &[], &["*"]);
        let named = named.unwrap();
        assert!(named.resend.is_empty(), "{:?}", named.resend);
        let diff = named.changes(Holds::Snapshot(&v1), &v1);
        assert!(diff.upserts.is_empty() && diff.removed.is_empty(), "{diff:?}");
    }

    /// An idle named client costs its names once: the subscription, what
    /// it holds and the debug view share one slice, and each name is the
    /// cache's own.
    #[test]
    fn a_subscription_shares_its_names_with_the_cache_and_itself() {
        let (cache, mut writer) = Cache::new();
        let resources = ["a", "b"]
            .iter()
            .map(|n| {
                let none = std::collections::HashMap::<String, String>::new();
                let digest = crate::cache::content_digest(n.as_bytes(), &none, &none);
                CachedResource::new((*n).into(), bytes::Bytes::from_static(b"x"), digest)
            })
            .collect();
        writer.apply("c", Update::Full(resources), Origin::Upstream);
        let known = cache.get("c").unwrap();
        let asked = NameList::from_names(["b", "a", "ghost", "a"]);
        let mut named = None;
        let changed = Named::apply(&mut named, NameChange::Replace(&asked), false, Some(&known), 10).unwrap();
        assert!(changed);
        let named = named.as_mut().unwrap();
        let names: Vec<&str> = named.current().names.iter().map(|n| &**n).collect();
        assert_eq!(names, ["a", "b", "ghost"], "in order, once each");
        let (key, _) = known.resources.get_key_value("a").unwrap();
        assert!(SharedStr::ptr_eq(key, named.current().names.iter().next().unwrap()));
        named.on_sent();
        assert!(
            Arc::ptr_eq(&named.held.names.0, &named.current.names.0),
            "held shares the subscription's storage"
        );
        let view = crate::downstream::registry::SubscribedView::from(named.current());
        assert!(Arc::ptr_eq(&view.first, &named.current.names.0), "and so does the view");
        // Too many names are refused before anything is kept.
        let many: Vec<String> = (0..11).map(|i| i.to_string()).collect();
        let many = NameList::from_names(many.iter().map(String::as_str));
        let mut fresh = None;
        let refused = Named::apply(&mut fresh, NameChange::Replace(&many), false, None, 10);
        assert_eq!(refused, Err(TooManyNames { count: 11 }));
    }
}
