//! What wakes a stream's task when a slot is served a new version (issue
//! 34, issue 44): its registry entry's waker, which the stream registers
//! its task with at every wait ([`super::registry::RegistryEntry::control`]),
//! and, per followed type, what says the type is the one that changed.
//!
//! Two kinds of follower per slot (a collection, for one group of clients):
//! - A named client (it subscribed to names, not wildcard, and has no
//!   grant) is in an index from resource name to the clients that asked for
//!   it, so a new version wakes exactly the clients whose names it changed
//!   and sets their [`Registration`]'s flag. Waking every client of a type
//!   on every version, and each finding (most of the time) that nothing it
//!   asks for changed, was the first cost of a named fan-out: 60 % of an
//!   Envoy fleet's EDS clients are woken for nothing at 1 % of the
//!   endpoints changing.
//! - Every other served type ([`Following`]: a legacy or wildcard client, a
//!   canary, a client with a grant) is woken by every version of its slot,
//!   and reads its own receiver of the slot to see that it changed.
//!
//! A waker of the stream's own rather than a watch per followed type: the
//! `changed()` future a watch is awaited with is boxed for each type a
//! stream follows (160 bytes in every idle stream's heap), and a named
//! client's watch of its own was a channel (~350 bytes) besides.
//!
//! A named client a version leaves alone holds that version as well: it is
//! shown at it (its registry view, as its task would have settled it),
//! without its task running, and without the version looking at it: the
//! view, when read, finds the version its client ACKed among the slot's
//! last versions ([`LeftAlone`]), at or after the last one that changed
//! one of its names. A version's work is the clients it touches (and those
//! due to settle, below), not a pass over every client of the slot: that
//! pass, and each untouched client's view locked and moved on, was 2 % of
//! an eds fan-out's publishing, for clients most of which no reader ever
//! looks at.
//!
//! A client left alone still holds the last version it was sent, and with
//! it that version's storage (the chunks of every resource changed since):
//! one left alone for [`SETTLE_AFTER`] versions in a row is woken to settle
//! and let go of it (found by the version it was last woken at: each
//! version looks at the clients woken `SETTLE_AFTER` versions before it).
//! Memory stays bounded by a few versions, and of the wakes for nothing
//! one in `SETTLE_AFTER` is left (measured: without it, an eds run's peak
//! grew by 18 MiB, old versions kept by clients that no version touched).
//!
//! A woken client reads which of its names changed from the index too:
//! each kept version holds, in client order, the pairs of a client and a
//! changed name of its that the version's wakes found
//! ([`Registration::changed_between`]), so the client's response looks up
//! only those, not each of its names among what changed (the filter that
//! did so was about 1,000 instructions a response of eds, with its names'
//! hashes made at the first wake: BENCHMARKS, session 40). Where the index
//! cannot say (versions it did not keep, names registered since, a name
//! changed twice between), the client looks its names up as before.
//!
//! The order that loses no wake: a stream registers (its names, or itself
//! as a follower) before it reads the slot; the publisher replaces the
//! slot's snapshot before it reads the index. A version published before
//! the registration is read by the stream; one published after it finds
//! the stream in the index. The stream's task registers its waker before
//! it reads the flags and receivers, and the publisher sets them before it
//! wakes it. (A follower's receiver is made, its snapshot marked seen,
//! just before it registers: a version published in between shows as a
//! change once more, which costs a look and loses nothing.)

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

use slab::Slab;

use super::names::{published_changes, NameSet};
use super::registry::ViewHandle;
use crate::cache::CollectionSnapshot;
use crate::SharedStr;

/// Versions in a row that leave a client alone before it is woken to let go
/// of the one it was sent.
pub const SETTLE_AFTER: u8 = 4;

/// One slot's followers (a collection, for one group of clients).
#[derive(Default)]
pub struct Wakes {
    index: Mutex<Index>,
    /// Its last versions, read by the views of the clients they left
    /// alone: a lock of its own, so that reading a view never waits for a
    /// version's wakes.
    published: Arc<Published>,
}

impl std::fmt::Debug for Wakes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let index = self.lock();
        f.debug_struct("Wakes")
            .field("clients", &index.clients.len())
            .field("names", &index.by_name.len())
            .field("following", &index.following.len())
            .finish()
    }
}

#[derive(Default)]
struct Index {
    /// By resource name, the keys of the clients that asked for it.
    by_name: HashMap<SharedStr, Vec<u64>>,
    /// By the key the index gave it (a count, no client's choice):
    /// foldhash, not the keyed SipHash the names need (looked up about
    /// once a response, for the clients a version touched).
    clients: HashMap<u64, Client, foldhash::fast::RandomState>,
    next: u64,
    /// The streams woken by every version (a slab: 16 bytes a stream,
    /// where a hash map took ~35 with its growth).
    following: Slab<ViewHandle>,
    /// The state of the generator of the followers' wake order.
    order: u64,
    /// The versions published since the slot was made (the count at the
    /// last: what a client's [`Shared::woken_at`] is read against).
    versions: u64,
    /// By the count of the version that woke them, modulo
    /// [`SETTLE_AFTER`], the keys of the clients woken then (or registered,
    /// or renamed): a version looks at those of `SETTLE_AFTER` versions
    /// before it, and wakes the ones no version woke since. A key woken
    /// again is in a later list too, and skipped in this one: at most
    /// `SETTLE_AFTER` keys a client, each looked at once.
    settle: [Vec<u64>; SETTLE_AFTER as usize],
    /// Clients looked at by versions, for tests.
    #[cfg(test)]
    looked_at: usize,
}

struct Client {
    /// What its stream shares: its flag, and when it was last woken.
    shared: Arc<Shared>,
    /// Its registry view's handle: the waker of its task.
    view: ViewHandle,
    /// Its stream's connection (see [`ViewHandle::connection`]): the clients
    /// a version wakes are woken a connection at a time. Kept here rather
    /// than read through the view when needed: the wake order's sort reads
    /// it O(n log n) times a version, and through the view each read is two
    /// pointers more (the registry entry, its gate).
    connection: u64,
}

impl Client {
    /// The count of the version that last woke it.
    fn woken_at(&self) -> u64 {
        self.shared.woken_at.load(AtomicOrdering::Relaxed)
    }

    /// Marks it woken by the version of count `at`; false when it already
    /// was (the version changed more than one of its names). Seen by its
    /// view once the version is among the slot's [`Published`] (stored
    /// before, under the index's lock).
    fn mark_woken(&self, at: u64) -> bool {
        self.shared.woken_at.swap(at, AtomicOrdering::Relaxed) != at
    }

    fn wake(&self) {
        // Set before the task is woken: it reads the flag once woken.
        self.shared.woken.store(true, AtomicOrdering::Release);
        self.view.wake();
    }
}

/// What a named client's stream, its registry view and the index share.
struct Shared {
    /// Set when a version changed one of its names (or it is to settle).
    woken: AtomicBool,
    /// The index's count of versions when it was last woken (or
    /// registered, or renamed): every version since left its names alone.
    /// Stored before the version is among the slot's [`Published`].
    woken_at: AtomicU64,
    /// Its slot's last versions.
    published: Arc<Published>,
}

/// A slot's last [`SETTLE_AFTER`] + 1 versions, oldest first, each with
/// its count in the index: a client left alone since it was last woken
/// holds the newest as well as the one it ACKed, if that is among them at
/// or after its wake. No more are needed: a client left alone by
/// `SETTLE_AFTER` versions is woken, and shown at what it ACKed until its
/// task settles it; the one more is the version such a client holds, so
/// that it finds what the versions since changed of its names
/// ([`Registration::changed_between`]). Emptied when the collection is
/// gone.
#[derive(Default)]
struct Published(Mutex<VecDeque<Step>>);

impl Published {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Step>> {
        self.0.lock().expect("published versions lock poisoned")
    }
}

/// Versions a slot's [`Published`] keeps.
const STEPS_KEPT: usize = SETTLE_AFTER as usize + 1;

/// A version a slot published, as its clients' views and tasks read it.
struct Step {
    version: SharedStr,
    /// Its count in the index.
    at: u64,
    /// The version it replaced (`None`: none, or not known).
    from: Option<SharedStr>,
    /// For each named client and each of its names that this version
    /// changed from `from`, the client's key and the name, in key order:
    /// what the index found as it woke them, read by each woken client in
    /// place of looking its names up among the changed ones. `None`: not
    /// kept (the slot's first version, one after a delivery or a removal
    /// of the collection, or one whose names touched more than
    /// [`hits_kept`] clients' names).
    hits: Option<Box<[(u64, SharedStr)]>>,
}

/// Pairs of a client and a changed name a [`Step`] keeps at most: twice
/// its slot's named clients, at least 1,024 (eds's 1 % of 10,000 changing
/// touches ~1,000 names of 2,000 clients). The pairs of a version's kept
/// steps are then within ten a client (16 bytes each); a larger change's
/// clients look their names up among what changed, as without them.
fn hits_kept(clients: usize) -> usize {
    clients.saturating_mul(2).max(1024)
}

/// A named client's link to its slot's last versions, for its registry
/// view: what the version it ACKed stands for now (see
/// [`LeftAlone::newest`]). Equal when it is the same client's.
#[derive(Clone)]
pub struct LeftAlone(Arc<Shared>);

impl LeftAlone {
    /// The slot's newest version, when the client's ACKed version `acked`
    /// is one the slot published at or after the last version that changed
    /// one of its names: every version since left its names as `acked` has
    /// them, so it holds the newest as well. `None` otherwise (a version
    /// changed them since, or `acked` is older than the versions kept).
    /// For a client that holds `acked`: nothing outstanding, no NACK
    /// standing.
    pub fn newest(&self, acked: &str) -> Option<SharedStr> {
        let published = self.0.published.lock();
        // Read with the versions locked: a count a version stored before
        // it was published is seen with it.
        let since = self.0.woken_at.load(AtomicOrdering::Acquire);
        let newest = &published.back()?.version;
        published
            .iter()
            .rev()
            .take_while(|step| step.at >= since)
            .any(|step| *step.version == *acked)
            .then(|| newest.clone())
    }
}

impl PartialEq for LeftAlone {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for LeftAlone {}

impl std::fmt::Debug for LeftAlone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeftAlone")
            .field("woken_at", &self.0.woken_at.load(AtomicOrdering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Wakes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().expect("wake index lock poisoned")
    }

    /// A stream's type asks for `names` (not wildcard): it is woken when a
    /// version changes one of them, until the registration is dropped.
    pub fn register(self: &Arc<Self>, names: &NameSet, view: ViewHandle) -> Registration {
        let mut index = self.lock();
        let key = index.next;
        index.next += 1;
        for name in names.iter() {
            index.by_name.entry(name.clone()).or_default().push(key);
        }
        let named_at = index.versions;
        let shared = Arc::new(Shared {
            woken: AtomicBool::new(false),
            woken_at: AtomicU64::new(named_at),
            published: self.published.clone(),
        });
        let connection = view.connection();
        index.clients.insert(
            key,
            Client {
                shared: shared.clone(),
                connection,
                view,
            },
        );
        index.due_to_settle(key);
        drop(index);
        Registration {
            wakes: self.clone(),
            key,
            names: names.clone(),
            named_at,
            shared,
        }
    }

    /// A stream's type follows every version of the slot: its task is
    /// woken by each, until the returned guard is dropped.
    pub fn follow(self: &Arc<Self>, view: ViewHandle) -> Following {
        let key = self.lock().following.insert(view);
        Following {
            wakes: self.clone(),
            key,
        }
    }

    /// The slot went from `from` to `to`: its followers are woken; of the
    /// named clients, those whose names changed and those due to settle.
    /// The others are not looked at: their views find `to` among the
    /// slot's versions when read ([`LeftAlone`]).
    pub fn published(&self, from: Option<&Arc<CollectionSnapshot>>, to: Option<&Arc<CollectionSnapshot>>) {
        let mut index = self.lock();
        index.wake_followers();
        if let (Some(from), Some(to)) = (from, to) {
            if from.version == to.version {
                return;
            }
        }
        index.versions += 1;
        let at = index.versions;
        let order = index.next_order();
        let Index {
            by_name,
            clients,
            settle,
            ..
        } = &mut *index;
        let slot = (at % u64::from(SETTLE_AFTER)) as usize;
        // Woken `SETTLE_AFTER` versions ago (or registered then); those
        // woken since are in a later list.
        let due = std::mem::take(&mut settle[slot]);
        let mut woken = Vec::new();
        let mut hits = None;
        #[cfg(test)]
        let mut looked_at = due.len();
        match (from, to) {
            (Some(from), Some(to)) => {
                if !clients.is_empty() {
                    let changed = published_changes(from, to);
                    let most = hits_kept(clients.len());
                    let mut pairs = Some(Vec::new());
                    for (name, keys) in changed.iter().filter_map(|name| Some(name).zip(by_name.get(name))) {
                        woken.extend(keys.iter().filter_map(|key| clients.get_key_value(key)));
                        match &mut pairs {
                            Some(kept) if kept.len() + keys.len() <= most => {
                                kept.extend(keys.iter().map(|key| (*key, name.clone())));
                            }
                            _ => pairs = None,
                        }
                    }
                    hits = pairs.map(|mut pairs| {
                        pairs.sort_unstable_by_key(|(key, _)| *key);
                        pairs.into_boxed_slice()
                    });
                }
                #[cfg(test)]
                {
                    looked_at += woken.len();
                }
                let settled_at = at.checked_sub(u64::from(SETTLE_AFTER));
                let settling = due.iter().filter_map(|key| clients.get_key_value(key));
                woken.extend(settling.filter(|(_, client)| Some(client.woken_at()) == settled_at));
            }
            // Delivered, or gone: every name changed.
            _ => woken.extend(clients.iter()),
        }
        // Once a version, however many of its names it changed.
        woken.retain(|(_, client)| client.mark_woken(at));
        let mut keys = due;
        keys.clear();
        keys.extend(woken.iter().map(|(key, _)| **key));
        wake_by_connection(woken.into_iter().map(|(_, client)| client), order);
        settle[slot] = keys;
        #[cfg(test)]
        {
            index.looked_at += looked_at;
        }
        // After the clients' counts, under the index's lock (versions are
        // published in turn): a view that finds `to` here sees the counts.
        let mut published = self.published.lock();
        match to {
            Some(to) => {
                // The slot's first version (made with it, not published
                // here): what every client registered since holds.
                if let (true, Some(from)) = (published.is_empty(), from) {
                    published.push_back(Step {
                        version: from.version.clone(),
                        at: at - 1,
                        from: None,
                        hits: None,
                    });
                }
                if published.len() == STEPS_KEPT {
                    published.pop_front();
                }
                published.push_back(Step {
                    version: to.version.clone(),
                    at,
                    from: from.map(|from| from.version.clone()),
                    hits,
                });
            }
            None => published.clear(),
        }
    }

    /// The named clients and the followers, for tests.
    #[cfg(test)]
    fn clients(&self) -> (usize, usize) {
        let index = self.lock();
        (index.clients.len(), index.following.len())
    }
}

/// Wakes `clients` a connection at a time, the connections in an order
/// drawn from `order` (a version's draw: none is always first or last),
/// each connection armed before its clients are woken. The clients of one
/// connection woken one after another write their responses one after
/// another, and the connection's task, deferred until they have run
/// (`transport::defer`), writes them all in one `writev`; woken in the
/// index's order, they were spread over the whole version and each
/// response took a write of its own. Each client's place is drawn once
/// and sorted beside it: a sort that drew it at each comparison read each
/// client again at each (312 instructions a response in `mcp-load
/// --scenario eds`, BENCHMARKS, session 37).
fn wake_by_connection<'a>(clients: impl Iterator<Item = &'a Client>, order: u64) {
    let mut clients: Vec<(u64, &Client)> = clients.map(|client| (mix(client.connection ^ order), client)).collect();
    clients.sort_unstable_by_key(|&(place, _)| place);
    let mut armed = None;
    for (_, client) in clients {
        if armed != Some(client.connection) {
            client.view.arm_connection();
            armed = Some(client.connection);
        }
        client.wake();
    }
}

/// A 64-bit mix (splitmix64's finaliser): the connections' order at a
/// version, from their keys and that version's draw.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A stream's type in the index; its names leave it when it is dropped.
pub struct Registration {
    wakes: Arc<Wakes>,
    key: u64,
    names: NameSet,
    /// The index's count of versions when it was registered with `names`:
    /// the versions after it found its names among what they changed.
    named_at: u64,
    shared: Arc<Shared>,
}

impl Registration {
    /// Whether these are the names it is registered with.
    pub fn is_for(&self, names: &NameSet) -> bool {
        self.names == *names
    }

    /// Whether a version changed one of its names (or it is to settle)
    /// since this was last asked; asking clears it. Read before it is
    /// cleared: a stream asks at every turn of its loop, most often for
    /// nothing, and a load writes nothing to the shared line.
    pub fn take_woken(&self) -> bool {
        let woken = &self.shared.woken;
        woken.load(AtomicOrdering::Acquire) && woken.swap(false, AtomicOrdering::AcqRel)
    }

    /// Its names that changed from the slot's version `from` to `to`, as
    /// the index found them when it published each version between, each
    /// handed to `each` once, in name order (a woken client reads them
    /// here rather than looking each of its names up among what changed).
    /// False, with none handed, where the index cannot say: `to` is not
    /// among the slot's last versions, `from` is not one of the versions
    /// `to` was published after (one by one), a version between was
    /// published before its names were registered or kept none, or one of
    /// its names changed in more than one of them (it may have changed
    /// back: the caller compares). `each` is called with the slot's
    /// versions locked, so it must not publish or read a view of this slot
    /// (a snapshot's own reads, as `CollectionSnapshot::resource`, take no
    /// lock).
    pub fn changed_between(&self, from: &SharedStr, to: &SharedStr, mut each: impl FnMut(&SharedStr)) -> bool {
        let steps = self.shared.published.lock();
        let Some(mut at) = steps.iter().rposition(|step| step.version == *to) else {
            return false;
        };
        let mut names: smallvec::SmallVec<[&SharedStr; 8]> = smallvec::SmallVec::new();
        loop {
            let step = &steps[at];
            let Some(hits) = step.hits.as_deref().filter(|_| step.at > self.named_at) else {
                return false;
            };
            let first = hits.partition_point(|(key, _)| *key < self.key);
            let mine = hits[first..].iter().take_while(|(key, _)| *key == self.key);
            names.extend(mine.map(|(_, name)| name));
            match (&step.from, at.checked_sub(1)) {
                (Some(before), _) if before == from => break,
                (Some(before), Some(older)) if steps[older].version == *before => at = older,
                _ => return false,
            }
        }
        names.sort_unstable();
        if names.windows(2).any(|pair| pair[0] == pair[1]) {
            return false;
        }
        names.into_iter().for_each(&mut each);
        true
    }

    /// Its link to the slot's versions, for its registry view.
    pub fn left_alone(&self) -> LeftAlone {
        LeftAlone(self.shared.clone())
    }

    /// The client now asks for `names`: the index follows, name by name
    /// for those that differ (both sets are sorted). Its view holds no
    /// version past this (what it ACKed was for its old names).
    pub fn rename(&mut self, names: &NameSet) {
        let mut index = self.wakes.lock();
        // In the list of the count now once, however often it renames
        // before the next version (a client renaming in a loop between
        // versions adds nothing).
        if self.shared.woken_at.swap(index.versions, AtomicOrdering::Relaxed) != index.versions {
            index.due_to_settle(self.key);
        }
        self.named_at = index.versions;
        let (old, new) = (&self.names, names);
        let (mut i, mut j) = (0, 0);
        loop {
            let ord = match (old.get(i), new.get(j)) {
                (None, None) => break,
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (Some(a), Some(b)) => a.cmp(b),
            };
            match ord {
                Ordering::Equal => {
                    i += 1;
                    j += 1;
                }
                // Only in the old names.
                Ordering::Less => {
                    index.forget(&old.iter().as_slice()[i], self.key);
                    i += 1;
                }
                Ordering::Greater => {
                    let name = new.iter().as_slice()[j].clone();
                    index.by_name.entry(name).or_default().push(self.key);
                    j += 1;
                }
            }
        }
        drop(index);
        self.names = names.clone();
    }
}

impl Index {
    /// Wakes every follower, in an order of its own at each version: the
    /// keys as a random affine permutation (an odd multiplier and an
    /// offset, modulo a power of two at least the slab's size), so that no
    /// stream is woken first or last at every version. Woken in the order
    /// of their keys, the same streams waited longest at each version of a
    /// fan-out, and the median response took 40 % longer (BENCHMARKS,
    /// session 18). The span is the slab's largest size since the slot was
    /// made (a slab keeps its room): after a surge of followers, each
    /// version looks at as many slots as the surge had (~1 ns a slot), as
    /// the slab's own iteration would.
    fn wake_followers(&mut self) {
        if self.following.is_empty() {
            return;
        }
        let order = self.next_order();
        let span = self.following.capacity().next_power_of_two();
        let (stride, offset) = ((order | 1) as usize, (order >> 32) as usize);
        for i in 0..span {
            let key = stride.wrapping_mul(i).wrapping_add(offset) & (span - 1);
            if let Some(follower) = self.following.get(key) {
                // Its connection writes what the version's wakes queue
                // together (`transport::defer`).
                follower.arm_connection();
                follower.wake();
            }
        }
    }

    /// `key` was registered or renamed at the index's count now: the
    /// version `SETTLE_AFTER` later looks at it.
    ///
    /// A list grows between versions only by the clients registered or
    /// renamed at its count; the keys of those gone since (streams opened
    /// and closed again and again while no version is published) are
    /// dropped once they could be half of it, so that it stays within
    /// twice the clients.
    fn due_to_settle(&mut self, key: u64) {
        let slot = (self.versions % u64::from(SETTLE_AFTER)) as usize;
        let list = &mut self.settle[slot];
        list.push(key);
        if list.len() > 2 * self.clients.len() + 64 {
            let (clients, versions) = (&self.clients, self.versions);
            list.retain(|key| clients.get(key).is_some_and(|client| client.woken_at() == versions));
        }
    }

    /// The next state of the generator of the wake orders.
    fn next_order(&mut self) -> u64 {
        if self.order == 0 {
            use std::hash::{BuildHasher, Hasher};
            self.order = std::collections::hash_map::RandomState::new().build_hasher().finish() | 1;
        }
        // xorshift64: cheap, and only an order depends on it.
        self.order ^= self.order << 13;
        self.order ^= self.order >> 7;
        self.order ^= self.order << 17;
        self.order
    }

    fn forget(&mut self, name: &str, key: u64) {
        if let Some(keys) = self.by_name.get_mut(name) {
            keys.retain(|k| *k != key);
            if keys.is_empty() {
                self.by_name.remove(name);
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut index = self.wakes.lock();
        for name in self.names.iter() {
            index.forget(name, self.key);
        }
        index.clients.remove(&self.key);
    }
}

/// A stream's type among a slot's followers; it leaves when dropped.
pub struct Following {
    wakes: Arc<Wakes>,
    key: usize,
}

impl Drop for Following {
    fn drop(&mut self) {
        self.wakes.lock().following.remove(self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::cache::{Cache, Origin, Update};
    use crate::collections::{Dialect, Resolved};
    use crate::downstream::names::tests::resource;
    use crate::downstream::registry::{Protocol, Registry, RegistryEntry, TypeView};
    use crate::transport::defer::ConnectionGate;

    fn names(names: &[&str]) -> NameSet {
        NameSet::from_unsorted(names.iter().map(|n| SharedStr::from(*n)).collect())
    }

    /// The versions of a collection that its full states make, applied
    /// in turn.
    fn versions<const N: usize>(states: [&[(&str, &str)]; N]) -> [Arc<CollectionSnapshot>; N] {
        let (cache, mut writer) = Cache::new();
        states.map(|entries| {
            let resources = entries.iter().map(|(n, v)| resource(n, v)).collect();
            writer.apply("c", Update::Full(resources), Origin::Upstream);
            cache.get("c").expect("applied")
        })
    }

    /// A waker that counts its wakes.
    struct Counted(AtomicUsize);

    impl std::task::Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, AtomicOrdering::SeqCst);
        }
    }

    /// A stream's task as the index wakes it: its registry entry, with a
    /// counting waker registered as the task's.
    struct Task {
        entry: RegistryEntry,
        waker: Arc<Counted>,
    }

    impl Task {
        fn new(registry: &Arc<Registry>, id: u64) -> Self {
            let entry = registry.register(id, None, Protocol::XdsSotw, "x", None);
            let waker = Arc::new(Counted(AtomicUsize::new(0)));
            entry.control().register(&waker.clone().into());
            Task { entry, waker }
        }

        /// Whether the task was woken since this was last asked; its waker
        /// is registered again, as the task's next wait does.
        fn woken(&self) -> bool {
            let wakes = self.waker.0.swap(0, AtomicOrdering::SeqCst);
            self.entry.control().register(&self.waker.clone().into());
            wakes > 0
        }
    }

    /// A named type's view that ACKed `version`, linked to `registration`.
    fn acked(version: &CollectionSnapshot, registration: &Registration) -> TypeView {
        let mut view = TypeView::new(Resolved {
            collection: "c".into(),
            dialect: Dialect::Xds,
        });
        view.acked_version = Some(version.version.clone());
        view.left_alone = Some(registration.left_alone());
        view
    }

    /// A slot's index, and `N` streams' tasks (ids 1 to `N`).
    fn tasks<const N: usize>() -> (Arc<Wakes>, [Task; N]) {
        let registry = Arc::new(Registry::default());
        let tasks = std::array::from_fn(|i| Task::new(&registry, i as u64 + 1));
        (Arc::new(Wakes::default()), tasks)
    }

    /// A version keeps its pairs of a client and a changed name only up to
    /// [`hits_kept`]: past it, its clients are told the index cannot say
    /// (and look their names up), and a smaller change after it is kept
    /// again. Its clients are woken either way.
    #[tokio::test]
    async fn a_version_keeps_its_clients_changed_names_within_its_bound() {
        let all: Vec<String> = (0..1_100).map(|n| format!("r{n:04}")).collect();
        // Every name at "0"; every name at "1"; the first ten at "2".
        let (cache, mut writer) = Cache::new();
        let [v1, v2, v3] = [("0", 0), ("1", 0), ("1", 10)].map(|(version, at_two)| {
            let resources = all
                .iter()
                .enumerate()
                .map(|(i, n)| resource(n, if i < at_two { "2" } else { version }))
                .collect();
            writer.apply("c", Update::Full(resources), Origin::Upstream);
            cache.get("c").expect("applied")
        });
        let (wakes, [task]) = tasks();
        let mine = NameSet::from_unsorted(all.iter().map(|n| SharedStr::from(n.as_str())).collect());
        let registration = wakes.register(&mine, task.entry.handle());
        assert!(hits_kept(1) < all.len(), "the bound is below the change");
        wakes.published(Some(&v1), Some(&v2));
        assert!(registration.take_woken(), "woken past the bound");
        assert!(
            !registration.changed_between(&v1.version, &v2.version, |_| ()),
            "1,100 pairs: not kept"
        );
        wakes.published(Some(&v2), Some(&v3));
        assert!(registration.take_woken());
        let mut found = Vec::new();
        assert!(registration.changed_between(&v2.version, &v3.version, |name| found.push(name.to_string())));
        assert_eq!(found, all[..10], "ten pairs: kept, in name order");
        // Over both versions: one of them kept none.
        assert!(!registration.changed_between(&v1.version, &v3.version, |_| ()));
    }

    /// A version wakes the clients whose names it changed and no other,
    /// their tasks and their flags; a renamed client is woken by its new
    /// names only; a dropped one leaves the index; a delivery (or a
    /// collection gone) wakes every client.
    #[tokio::test]
    async fn a_version_wakes_exactly_the_clients_whose_names_it_changed() {
        let [v1, v2] = versions([
            &[("a", "1"), ("b", "1"), ("c", "1")],
            &[("a", "2"), ("b", "1"), ("c", "1"), ("d", "1")],
        ]);
        let (wakes, [task_a, task_b, task_none]) = tasks();
        let a = wakes.register(&names(&["a", "b"]), task_a.entry.handle());
        let mut b = wakes.register(&names(&["b", "c"]), task_b.entry.handle());
        // b's client ACKed v1: a version that leaves its names alone shows
        // it at that version.
        task_b.entry.publish(&SharedStr::from("t"), &acked(&v1, &b));
        let none = wakes.register(&NameSet::default(), task_none.entry.handle());
        wakes.published(Some(&v1), Some(&v2));
        assert!(a.take_woken() && task_a.woken(), "a changed: its client is woken");
        assert!(!a.take_woken(), "asking clears it");
        assert!(!b.take_woken() && !task_b.woken(), "neither b nor c changed");
        let shown = task_b.entry.view().types.get("t").and_then(|t| t.acked_version.clone());
        assert_eq!(shown, Some(v2.version.clone()), "untouched, it holds v2 as well");
        assert!(!none.take_woken() && !task_none.woken(), "no names: never touched");
        // The same version again: nobody.
        wakes.published(Some(&v2), Some(&v2));
        assert!(!a.take_woken() && !task_a.woken());
        // `d` was added: the client that renames to it is woken by it.
        b.rename(&names(&["c", "d"]));
        wakes.published(Some(&v1), Some(&v2));
        assert!(b.take_woken() && task_b.woken(), "d is new since v1");
        a.take_woken();
        b.rename(&names(&["c"]));
        wakes.published(Some(&v1), Some(&v2));
        assert!(!b.take_woken() && !task_b.woken(), "d left its names");
        // Left alone SETTLE_AFTER versions in a row (one above): woken to
        // let go of the version it holds.
        for _ in 1..SETTLE_AFTER - 1 {
            wakes.published(Some(&v1), Some(&v2));
            assert!(!b.take_woken());
        }
        wakes.published(Some(&v1), Some(&v2));
        assert!(
            b.take_woken() && task_b.woken(),
            "settled after {SETTLE_AFTER} versions"
        );
        wakes.published(None, Some(&v2));
        assert!(b.take_woken() && none.take_woken() && task_none.woken());
        drop(a);
        assert_eq!(wakes.clients(), (2, 0));
        drop(b);
        let index = wakes.lock();
        assert_eq!(index.by_name.len(), 0, "no name is kept for clients that left");
        drop(index);
    }

    /// What a named client's view shows, read without its task running: the
    /// newest version while every version since the one it ACKed left its
    /// names alone; what it ACKed once a version changed one of them (until
    /// its task settles), while a response is outstanding or a NACK stands,
    /// after it renamed, and once the collection is gone. A version that
    /// comes back (the same content, the same version) is found as well.
    #[tokio::test]
    async fn a_client_left_alone_is_shown_at_the_newest_version_and_no_further() {
        let [v1, v2, v3, v4, v5] = versions([
            &[("a", "1"), ("b", "1")],
            &[("a", "2"), ("b", "1")],
            &[("a", "2"), ("b", "2")],
            &[("a", "3"), ("b", "2")],
            &[("a", "2"), ("b", "2")],
        ]);
        assert_eq!(v5.version, v3.version, "the same content, the same version");
        let (wakes, [task]) = tasks();
        let t = SharedStr::from("t");
        let mut b = wakes.register(&names(&["b"]), task.entry.handle());
        // The copy a view shows and the registry's views read in place (what
        // a scrape counts) agree at every step.
        let shown = || {
            let copied = task.entry.view().types.get("t").and_then(|t| t.acked_version.clone());
            let mut in_place = Vec::new();
            task.entry
                .registry()
                .each(|stream| in_place.push(stream.types.get("t").and_then(|t| t.as_held().acked_version.clone())));
            assert_eq!(in_place, std::slice::from_ref(&copied), "read in place as in the copy");
            copied
        };
        task.entry.publish(&t, &acked(&v1, &b));
        assert_eq!(shown(), Some(v1.version.clone()));
        // The slot's first version was made with it: v1 is among its versions.
        wakes.published(Some(&v1), Some(&v2));
        assert!(!b.take_woken());
        assert_eq!(shown(), Some(v2.version.clone()), "v2 left b alone");
        wakes.published(Some(&v2), Some(&v3));
        assert!(b.take_woken() && task.woken(), "v3 changed b");
        assert_eq!(
            shown(),
            Some(v1.version.clone()),
            "not past a change, until its task settles"
        );
        task.entry.publish(&t, &acked(&v3, &b));
        wakes.published(Some(&v3), Some(&v4));
        assert!(!b.take_woken());
        assert_eq!(shown(), Some(v4.version.clone()));
        wakes.published(Some(&v4), Some(&v5));
        assert_eq!(shown(), Some(v3.version.clone()), "v3's content is back: v5 is v3");
        // What it holds is not known while a response is outstanding or a
        // NACK stands.
        let mut outstanding = acked(&v3, &b);
        outstanding.outstanding = true;
        task.entry.publish(&t, &outstanding);
        wakes.published(Some(&v5), Some(&v4));
        assert_eq!(shown(), Some(v3.version.clone()), "outstanding");
        let mut nacked = acked(&v3, &b);
        nacked.last_nack = Some(Box::new(crate::downstream::registry::NackRecord {
            version: v4.version.clone(),
            code: 3,
            message: "refused".into(),
            at: crate::downstream::registry::Stamp::NEVER,
            superseded: false,
        }));
        task.entry.publish(&t, &nacked);
        assert_eq!(shown(), Some(v3.version.clone()), "a NACK stands");
        task.entry.publish(&t, &acked(&v3, &b));
        assert_eq!(shown(), Some(v4.version.clone()));
        // Renamed: what it ACKed was for its old names.
        b.rename(&names(&["a", "b"]));
        assert_eq!(shown(), Some(v3.version.clone()), "renamed since it ACKed v3");
        // Gone: nothing is held past what it ACKed.
        task.entry.publish(&t, &acked(&v4, &b));
        assert_eq!(shown(), Some(v4.version.clone()));
        wakes.published(Some(&v4), None);
        assert!(b.take_woken());
        assert_eq!(shown(), Some(v4.version.clone()));
        // A view without a link to the slot (a follower's) is as published.
        let mut follower = acked(&v1, &b);
        follower.left_alone = None;
        task.entry.publish(&t, &follower);
        wakes.published(None, Some(&v2));
        assert_eq!(shown(), Some(v1.version.clone()));
    }

    /// A version looks at the clients whose names it changed and at those
    /// woken `SETTLE_AFTER` versions before it, never at the others: with a
    /// thousand clients, a version that changes one name looks at one
    /// client, until the clients registered together are due to settle.
    #[tokio::test]
    async fn a_version_looks_only_at_the_clients_it_touches_and_those_due_to_settle() {
        const CLIENTS: usize = 1_000;
        let registry = Arc::new(Registry::default());
        let (cache, mut writer) = Cache::new();
        let mut state: Vec<(String, u32)> = (0..CLIENTS).map(|i| (format!("n{i}"), 0)).collect();
        let mut version = |changed: Option<usize>| {
            if let Some(i) = changed {
                state[i].1 += 1;
            }
            let resources = state.iter().map(|(n, v)| resource(n, &v.to_string())).collect();
            writer.apply("c", Update::Full(resources), Origin::Upstream);
            cache.get("c").expect("applied")
        };
        let wakes = Arc::new(Wakes::default());
        let streams: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let entry = registry.register(i as u64, None, Protocol::XdsSotw, "x", None);
                let registration = wakes.register(&names(&[&format!("n{i}")]), entry.handle());
                (entry, registration)
            })
            .collect();
        let looked_at = || std::mem::take(&mut wakes.lock().looked_at);
        let woken = || {
            let ids: Vec<usize> = (0..CLIENTS).filter(|i| streams[*i].1.take_woken()).collect();
            ids
        };
        let mut from = version(None);
        for at in 1..=3 {
            let to = version(Some(at));
            wakes.published(Some(&from), Some(&to));
            assert_eq!(looked_at(), 1, "version {at}: the client of the one name it changed");
            assert_eq!(woken(), vec![at]);
            from = to;
        }
        // Every client registered at the count of version 0; all but the
        // three woken since are due at version 4 (which touches a fourth).
        let to = version(Some(10));
        wakes.published(Some(&from), Some(&to));
        assert_eq!(looked_at(), 1 + CLIENTS);
        let due: Vec<usize> = (0..CLIENTS).filter(|i| !(1..=3).contains(i)).collect();
        assert_eq!(woken(), due, "version 4: the one it touched and those due to settle");
        from = to;
        // Versions 5 to 7 look at the one they touch and the one woken four
        // versions before (woken since by this version or not).
        for at in 5..=7 {
            let to = version(Some(at + 10));
            wakes.published(Some(&from), Some(&to));
            assert_eq!(looked_at(), 2, "version {at}");
            let mut expected = vec![at - 4, at + 10];
            expected.sort_unstable();
            assert_eq!(woken(), expected, "version {at}");
            from = to;
        }
        // A client renaming again and again between two versions is in the
        // list of the count once.
        let listed = |wakes: &Wakes| wakes.lock().settle.iter().map(Vec::len).sum::<usize>();
        let before = listed(&wakes);
        let mut renamed = wakes.register(&names(&["r"]), streams[0].0.handle());
        for i in 0..1_000 {
            renamed.rename(&names(&[if i % 2 == 0 { "s" } else { "r" }]));
        }
        assert_eq!(
            listed(&wakes),
            before + 1,
            "registered and renamed at one count: listed once"
        );
        drop(renamed);
        // Streams opened and closed again and again while no version is
        // published: the list keeps within twice the clients.
        for _ in 0..10_000 {
            drop(wakes.register(&names(&["r"]), streams[0].0.handle()));
        }
        let most = before + 1 + 2 * CLIENTS + 64;
        assert!(
            listed(&wakes) <= most,
            "{} keys listed for {CLIENTS} clients",
            listed(&wakes)
        );
        drop(streams);
        assert_eq!(wakes.clients(), (0, 0));
    }

    /// A type that follows its slot is woken by every version of it,
    /// whatever the version changed, until it stops following; a named
    /// client of the same slot is not woken by a version that leaves its
    /// names alone.
    #[tokio::test]
    async fn a_follower_is_woken_by_every_version_until_it_leaves() {
        let [v1, v2] = versions([&[("a", "1"), ("b", "1")], &[("a", "2"), ("b", "1")]]);
        let (wakes, [follower, other, named]) = tasks();
        let following = wakes.follow(follower.entry.handle());
        let also = wakes.follow(other.entry.handle());
        let b = wakes.register(&names(&["b"]), named.entry.handle());
        assert_eq!(wakes.clients(), (1, 2));
        wakes.published(None, Some(&v1));
        assert!(follower.woken() && other.woken(), "delivered: every follower");
        assert!(b.take_woken() && named.woken(), "delivered: every named client");
        wakes.published(Some(&v1), Some(&v2));
        assert!(follower.woken() && other.woken(), "a version that changed a only");
        assert!(!b.take_woken() && !named.woken(), "b did not change");
        drop(following);
        assert_eq!(wakes.clients(), (1, 1));
        wakes.published(Some(&v2), None);
        assert!(!follower.woken(), "it left");
        assert!(other.woken() && b.take_woken());
        drop(also);
        assert_eq!(wakes.clients(), (1, 0));
    }

    /// A waker that logs its stream's id when woken.
    struct Logged {
        id: u64,
        log: Arc<Mutex<Vec<u64>>>,
    }

    impl std::task::Wake for Logged {
        fn wake(self: Arc<Self>) {
            self.log.lock().unwrap().push(self.id);
        }
    }

    /// Every version wakes each follower once, those that left none, and
    /// not in the same order each time: no stream is always woken last.
    #[tokio::test]
    async fn followers_are_each_woken_once_a_version_in_an_order_that_moves() {
        let [v1] = versions([&[("a", "1")]]);
        let registry = Arc::new(Registry::default());
        let wakes = Arc::new(Wakes::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut streams: Vec<_> = (0..37)
            .map(|id| {
                let entry = registry.register(id, None, Protocol::Sotw, "x", None);
                let waker = Arc::new(Logged { id, log: log.clone() });
                let following = wakes.follow(entry.handle());
                (entry, waker, Some(following))
            })
            .collect();
        // Some leave: their keys are vacant in the slab.
        for gone in [0, 5, 17, 36] {
            streams[gone].2 = None;
        }
        let staying: Vec<u64> = streams
            .iter()
            .filter(|s| s.2.is_some())
            .map(|s| s.0.view().id)
            .collect();
        let mut orders = Vec::new();
        for _ in 0..8 {
            for (entry, waker, _) in &streams {
                entry.control().register(&waker.clone().into());
            }
            wakes.published(None, Some(&v1));
            let order = std::mem::take(&mut *log.lock().unwrap());
            let mut woken = order.clone();
            woken.sort_unstable();
            assert_eq!(woken, staying, "each follower once, and none that left");
            orders.push(order);
        }
        assert!(
            orders.iter().any(|order| order != &orders[0]),
            "eight versions woke the followers in one order: {:?}",
            orders[0]
        );
    }

    /// The named clients a version wakes are woken a connection at a time,
    /// each connection armed (its task writes their responses together):
    /// each connection's clients one after another, the connections in an
    /// order that moves from version to version.
    #[tokio::test]
    async fn named_clients_are_woken_a_connection_at_a_time() {
        let [v1, v2] = versions([&[("a", "1"), ("b", "1")], &[("a", "2"), ("b", "1")]]);
        let registry = Arc::new(Registry::default());
        let wakes = Arc::new(Wakes::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        // Five connections of four streams each, opened in turn; the last
        // stream of each asks for `b` only.
        let gates: Vec<ConnectionGate> = (0..5).map(|_| ConnectionGate::default()).collect();
        let streams: Vec<_> = (0..20u64)
            .map(|id| {
                let gate = gates[(id % 5) as usize].clone();
                let entry = registry.register(id, None, Protocol::XdsSotw, "x", Some(gate));
                let waker = Arc::new(Logged { id, log: log.clone() });
                let asks = if id >= 15 { names(&["b"]) } else { names(&["a", "b"]) };
                let registration = wakes.register(&asks, entry.handle());
                (entry, waker, registration)
            })
            .collect();
        let connection = |id: u64| id % 5;
        let mut firsts = Vec::new();
        for version in 0..8 {
            for (entry, waker, registration) in &streams {
                registration.take_woken();
                entry.control().register(&waker.clone().into());
            }
            // Delivered, then a version changing `a`.
            let (from, to) = if version % 2 == 0 {
                (None, &v1)
            } else {
                (Some(&v1), &v2)
            };
            wakes.published(from, Some(to));
            let order = std::mem::take(&mut *log.lock().unwrap());
            let expected = if version % 2 == 0 { 20 } else { 15 };
            assert_eq!(order.len(), expected, "version {version}: {order:?}");
            let mut runs: Vec<u64> = order.iter().map(|id| connection(*id)).collect();
            runs.dedup();
            assert_eq!(
                runs.len(),
                5,
                "version {version}: each connection's clients together: {order:?}"
            );
            assert!(
                gates.iter().all(ConnectionGate::take_armed),
                "version {version}: each connection armed"
            );
            firsts.push(runs[0]);
        }
        assert!(
            firsts.iter().any(|first| *first != firsts[0]),
            "eight versions woke connection {} first",
            firsts[0]
        );
    }
}
