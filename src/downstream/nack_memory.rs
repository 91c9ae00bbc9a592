//! What xDS clients NACKed, per client (node id and peer identity) and type,
//! for `--nack-memory`: a reconnecting client's report of what it holds is
//! trusted (what it holds at the current content is not sent again) except
//! for what a response it NACKed carried, since Envoy records a resource's
//! version only for a response it accepted whole, yet applies part of one it
//! rejects. Kept across restarts in `--cache-dir` (`app.rs` reads and
//! writes the file; this module owns what is in it).

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use super::type_state::{Family, Mode, ReconnectTally, TypeState, Unheld, Verdict};
use crate::collections::TYPE_URL_PREFIX;
use crate::metrics as m;
use crate::SharedStr;

/// Names kept for one client and type; a NACK of more is remembered as
/// "everything of the type" (sent again whole: the safe side).
pub const MAX_NAMES_PER_ENTRY: usize = 10_000;

/// The file in `--cache-dir`.
pub const FILE: &str = "nack-memory.json";

/// The largest file read back (`--max-nack-memory-entries` entries of a
/// few KiB at most).
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// Who NACKed what: a client is its node id and the identity TLS proved
/// (two clients with one node id and different certificates are two).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ClientType {
    pub node: String,
    pub identity: String,
    pub type_url: String,
}

impl ClientType {
    fn is(&self, node: &str, identity: &str, type_url: &str) -> bool {
        self.node == node && self.identity == identity && self.type_url == type_url
    }

    /// The map's key: a hash of the three, found without copying them.
    fn hash_of(node: &str, identity: &str, type_url: &str) -> u64 {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (node, identity, type_url).hash(&mut hasher);
        hasher.finish()
    }
}

/// One remembered NACK (or several, merged): what they carried and when the
/// last came.
#[derive(Clone, Debug)]
struct Remembered {
    who: ClientType,
    unheld: Unheld,
    at: SystemTime,
}

/// The remembered NACKs, and how many each identity holds (kept as they
/// change: a full memory asks it on every new NACK).
#[derive(Default)]
struct Entries {
    map: HashMap<u64, Remembered>,
    per_identity: HashMap<String, usize>,
}

impl Entries {
    fn len(&self) -> usize {
        self.map.len()
    }

    fn held_by(&self, identity: &str) -> usize {
        self.per_identity.get(identity).copied().unwrap_or(0)
    }

    fn insert(&mut self, key: u64, remembered: Remembered) {
        *self.per_identity.entry(remembered.who.identity.clone()).or_default() += 1;
        if let Some(replaced) = self.map.insert(key, remembered) {
            self.uncount(&replaced.who.identity);
        }
    }

    fn remove(&mut self, key: &u64) {
        if let Some(removed) = self.map.remove(key) {
            self.uncount(&removed.who.identity);
        }
    }

    fn uncount(&mut self, identity: &str) {
        if let Some(count) = self.per_identity.get_mut(identity) {
            *count -= 1;
            if *count == 0 {
                self.per_identity.remove(identity);
            }
        }
    }

    /// Removes what `drop` says; returns how many went.
    fn remove_where(&mut self, mut drop: impl FnMut(&Remembered) -> bool) -> usize {
        let keys: Vec<u64> = self.map.iter().filter(|(_, r)| drop(r)).map(|(k, _)| *k).collect();
        for key in &keys {
            self.remove(key);
        }
        keys.len()
    }

    /// The key of `identity`'s oldest entry.
    fn oldest_of(&self, identity: &str) -> Option<u64> {
        self.map
            .iter()
            .filter(|(_, r)| r.who.identity == identity)
            .min_by_key(|(_, r)| r.at)
            .map(|(k, _)| *k)
    }
}

/// What the file holds.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    entries: Vec<SavedEntry>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SavedEntry {
    #[serde(flatten)]
    who: ClientType,
    /// Seconds since the epoch.
    at: u64,
    /// `None`: everything of the type.
    names: Option<Vec<String>>,
}

/// Every client's remembered NACKs.
pub struct NackMemory {
    ttl: Duration,
    max_entries: usize,
    /// Entries one identity may hold (`--max-nack-memory-entries-per-identity`).
    max_per_identity: usize,
    entries: Mutex<Entries>,
    /// Read without the lock: ACKs look only when something is remembered.
    len: AtomicUsize,
    /// Bumped on every change, for whoever writes the file.
    revision: watch::Sender<u64>,
    /// Written to `--cache-dir` and read back at start: what clients NACKed
    /// before this process started is known too.
    kept: AtomicBool,
}

// === impl NackMemory ===

impl NackMemory {
    /// `ttl` zero: nothing is remembered, and (see [`Self::follow`])
    /// nothing is skipped on a client's word.
    pub fn new(ttl: Duration, max_entries: usize, max_per_identity: usize) -> Arc<Self> {
        metrics::gauge!(m::NACK_MEMORY_ENTRIES).set(0.0);
        for reason in m::NACK_MEMORY_DROP_REASONS {
            metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => reason).absolute(0);
        }
        Arc::new(Self {
            ttl,
            max_entries,
            max_per_identity: max_per_identity.max(1),
            entries: Mutex::new(Entries::default()),
            len: AtomicUsize::new(0),
            revision: watch::channel(0).0,
            kept: AtomicBool::new(false),
        })
    }

    /// What it remembers is kept across restarts (`--cache-dir`): before
    /// that, nothing is skipped on a client's word (it may have NACKed
    /// before this process started, which it cannot know).
    pub fn keep_across_restarts(&self) {
        self.kept.store(true, Ordering::Relaxed);
    }

    /// Whether a reconnecting client's report may be trusted (less what it
    /// NACKed): the memory is on and covers what came before this process.
    pub fn trusts_reports(&self) -> bool {
        self.enabled() && self.kept.load(Ordering::Relaxed)
    }

    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes, for the writer of the file.
    pub fn revisions(&self) -> watch::Receiver<u64> {
        self.revision.subscribe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a change under the lock: the gauge, the count, the writer.
    fn changed(&self, entries: &Entries) {
        self.len.store(entries.len(), Ordering::Relaxed);
        metrics::gauge!(m::NACK_MEMORY_ENTRIES).set(entries.len() as f64);
        self.revision.send_modify(|r| *r += 1);
    }

    fn expired(&self, remembered: &Remembered, now: SystemTime) -> bool {
        now.duration_since(remembered.at).is_ok_and(|age| age >= self.ttl)
    }

    /// What `who`'s NACKs of the type carried, if they are remembered.
    pub fn recall(&self, node: &str, identity: &str, type_url: &str, now: SystemTime) -> Unheld {
        if self.is_empty() {
            return Unheld::Nothing;
        }
        let key = ClientType::hash_of(node, identity, type_url);
        let mut entries = self.lock();
        let Some(remembered) = entries.map.get(&key).filter(|r| r.who.is(node, identity, type_url)) else {
            return Unheld::Nothing;
        };
        if self.expired(remembered, now) {
            entries.remove(&key);
            metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => "expired").increment(1);
            self.changed(&entries);
            return Unheld::Nothing;
        }
        remembered.unheld.clone()
    }

    /// `who` NACKed a response of the type that carried `unheld`.
    pub fn remember(&self, who: ClientType, unheld: Unheld, now: SystemTime) {
        if !self.enabled() || unheld.is_nothing() {
            return;
        }
        let key = ClientType::hash_of(&who.node, &who.identity, &who.type_url);
        let mut entries = self.lock();
        match entries.map.get_mut(&key).filter(|r| r.who == who) {
            Some(remembered) => {
                remembered.unheld.add(unheld);
                remembered.at = now;
                bound_names(&mut remembered.unheld);
            }
            None => {
                if !self.make_room(&mut entries, &who.identity, now) {
                    return;
                }
                let mut unheld = unheld;
                bound_names(&mut unheld);
                entries.insert(key, Remembered { who, unheld, at: now });
            }
        }
        self.changed(&entries);
    }

    /// Room for one more entry of `identity`'s; `false` when there is none
    /// to be had. Room is never taken from another identity: an identity at
    /// its share (`--max-nack-memory-entries-per-identity`) forgets its own
    /// oldest; a full memory forgets the expired, then the inserting
    /// identity's own oldest, and when it holds none the new NACK is not
    /// remembered. So a client NACKing under many node ids costs only its
    /// own identity's entries, never another's (the twenty-eighth check of
    /// issue 42).
    fn make_room(&self, entries: &mut Entries, identity: &str, now: SystemTime) -> bool {
        if entries.held_by(identity) >= self.max_per_identity {
            if let Some(oldest) = entries.oldest_of(identity) {
                entries.remove(&oldest);
                metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => "identity_full").increment(1);
            }
        }
        if entries.len() < self.max_entries {
            return true;
        }
        let expired = entries.remove_where(|r| self.expired(r, now));
        if expired > 0 {
            metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => "expired").increment(expired as u64);
        }
        if entries.len() < self.max_entries.max(1) {
            return true;
        }
        metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => "full").increment(1);
        match entries.oldest_of(identity) {
            Some(oldest) => {
                entries.remove(&oldest);
                true
            }
            None => false,
        }
    }

    /// `who` ACKed a response of the type that carried `known`: its versions
    /// of those are what it holds again.
    pub fn forget(&self, node: &str, identity: &str, type_url: &str, known: &Unheld) {
        if self.is_empty() || known.is_nothing() {
            return;
        }
        let key = ClientType::hash_of(node, identity, type_url);
        let mut entries = self.lock();
        let Some(remembered) = entries.map.get_mut(&key).filter(|r| r.who.is(node, identity, type_url)) else {
            return;
        };
        let gone = match (&mut remembered.unheld, known) {
            (_, Unheld::Everything) => true,
            (Unheld::Names(names), Unheld::Names(known)) => {
                let before = names.len();
                names.retain(|n| !known.contains(n));
                if names.len() == before {
                    return;
                }
                names.is_empty()
            }
            _ => return,
        };
        if gone {
            entries.remove(&key);
        }
        self.changed(&entries);
    }

    /// What the file is to hold now.
    pub fn saved(&self) -> Saved {
        let entries = self.lock();
        let mut saved: Vec<SavedEntry> = entries
            .map
            .values()
            .map(|r| SavedEntry {
                who: r.who.clone(),
                at: r.at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
                names: match &r.unheld {
                    Unheld::Names(names) => Some(names.iter().map(|n| n.to_string()).collect()),
                    _ => None,
                },
            })
            .collect();
        saved.sort_by(|a, b| a.who.cmp(&b.who));
        Saved { entries: saved }
    }

    /// What a previous run saved, less what expired since (and, past
    /// `--max-nack-memory-entries`, the oldest).
    pub fn restore(&self, saved: &Saved, now: SystemTime) -> usize {
        let mut entries = self.lock();
        for entry in &saved.entries {
            let remembered = Remembered {
                unheld: match &entry.names {
                    Some(names) => Unheld::Names(
                        names
                            .iter()
                            .map(|n| SharedStr::from(n.as_str()))
                            .collect::<BTreeSet<_>>(),
                    ),
                    None => Unheld::Everything,
                },
                at: SystemTime::UNIX_EPOCH + Duration::from_secs(entry.at),
                who: entry.who.clone(),
            };
            if !self.enabled() || self.expired(&remembered, now) || remembered.unheld.is_nothing() {
                continue;
            }
            // A file of more than the memory holds (a lower limit than the
            // one it was written under): the rest is dropped, without a
            // search for room per entry.
            if entries.len() >= self.max_entries {
                metrics::counter!(m::NACK_MEMORY_DROPPED, "reason" => "full").increment(1);
                continue;
            }
            let key = ClientType::hash_of(&remembered.who.node, &remembered.who.identity, &remembered.who.type_url);
            entries.insert(key, remembered);
        }
        self.changed(&entries);
        entries.len()
    }

    /// A stream starts following a type: a reconnecting xDS client's report
    /// is trusted, less what its remembered NACKs carried, when the client
    /// can be told apart (a node id), the memory is on and kept across
    /// restarts (`--cache-dir`), and the type may go
    /// unanswered: delta always answers a first request (an empty response
    /// when nothing is to be sent); state of the world skips only Envoy's
    /// types (`type.googleapis.com/…`), never what istiod asks for (GVKs:
    /// istiod 1.16+ is not ready until every type has answered) nor a type
    /// nobody serves.
    pub fn follow(
        &self,
        state: TypeState,
        family: Family,
        served: bool,
        node: &str,
        identity: &str,
        type_url: &str,
    ) -> TypeState {
        if !self.trusts_reports() || family != Family::Xds {
            return state;
        }
        let state = state.remembering_nacks();
        let answered_anyway = state.mode() == Mode::Full && !type_url.starts_with(TYPE_URL_PREFIX);
        if !served || node.is_empty() || answered_anyway {
            return state;
        }
        let nacked = self.recall(node, identity, type_url, SystemTime::now());
        state.trusting_reported(nacked)
    }

    /// An xDS client answered a response: a NACK is remembered with what it
    /// carried, an ACK makes that known again. `who` is read only when
    /// needed. Nothing is remembered where reports are not trusted (no
    /// `--cache-dir`): each response's names are then not kept either.
    pub fn answered(
        &self,
        verdict: &Verdict,
        family: Family,
        state: &TypeState,
        type_url: &str,
        who: impl FnOnce() -> (String, String),
    ) {
        // Kept only where it covers restarts: otherwise nothing is trusted,
        // and nothing needs remembering.
        if family != Family::Xds || !self.trusts_reports() {
            return;
        }
        match verdict {
            Verdict::Nack => {
                let (node, identity) = who();
                if node.is_empty() {
                    return;
                }
                let who = ClientType {
                    node,
                    identity,
                    type_url: type_url.to_owned(),
                };
                self.remember(who, state.carried(), SystemTime::now());
            }
            Verdict::Ack if !self.is_empty() => {
                let (node, identity) = who();
                self.forget(&node, &identity, type_url, &state.carried());
            }
            _ => {}
        }
    }
}

/// More names than an entry keeps: everything of the type.
fn bound_names(unheld: &mut Unheld) {
    if matches!(unheld, Unheld::Names(names) if names.len() > MAX_NAMES_PER_ENTRY) {
        *unheld = Unheld::Everything;
    }
}

/// Counts what a reconnecting client's first response skipped and resent.
pub fn record_tally(collection: &SharedStr, tally: ReconnectTally) {
    metrics::counter!(m::RECONNECT_SKIPPED, "collection" => crate::metrics::label(collection)).increment(tally.skipped);
    for (reason, count) in [
        ("changed", tally.changed),
        ("nacked", tally.nacked),
        ("forced", tally.forced),
    ] {
        if count > 0 {
            metrics::counter!(m::RECONNECT_RESENT, "collection" => crate::metrics::label(collection), "reason" => reason)
                .increment(count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(node: &str) -> ClientType {
        ClientType {
            node: node.into(),
            identity: "spiffe://a".into(),
            type_url: "t".into(),
        }
    }

    fn names(names: &[&str]) -> Unheld {
        Unheld::Names(names.iter().map(|&n| SharedStr::from(n)).collect())
    }

    /// A NACK is remembered per client and type, merged, made known again
    /// name by name by ACKs, dropped when it expires, saved and restored
    /// (less what expired meanwhile), and bounded.
    #[test]
    fn nacks_are_remembered_per_client_until_acked_or_expired() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let memory = NackMemory::new(Duration::from_secs(3600), 2, 2);
        memory.remember(who("a"), names(&["x", "y"]), t0);
        memory.remember(who("a"), names(&["z"]), t0);
        assert_eq!(memory.recall("a", "spiffe://a", "t", t0), names(&["x", "y", "z"]));
        assert_eq!(
            memory.recall("a", "spiffe://other", "t", t0),
            Unheld::Nothing,
            "another identity"
        );
        assert_eq!(
            memory.recall("a", "spiffe://a", "u", t0),
            Unheld::Nothing,
            "another type"
        );
        memory.forget("a", "spiffe://a", "t", &names(&["x", "q"]));
        assert_eq!(memory.recall("a", "spiffe://a", "t", t0), names(&["y", "z"]));

        // Saved and restored in a new process, less what expired.
        memory.remember(who("b"), Unheld::Everything, t0 + Duration::from_secs(3000));
        let json = serde_json::to_string(&memory.saved()).unwrap();
        let later = t0 + Duration::from_secs(3700);
        let restarted = NackMemory::new(Duration::from_secs(3600), 2, 2);
        assert_eq!(restarted.restore(&serde_json::from_str(&json).unwrap(), later), 1);
        assert_eq!(
            restarted.recall("a", "spiffe://a", "t", later),
            Unheld::Nothing,
            "expired"
        );
        assert_eq!(restarted.recall("b", "spiffe://a", "t", later), Unheld::Everything);
        restarted.forget("b", "spiffe://a", "t", &Unheld::Everything);
        assert!(restarted.is_empty());

        // Bounded: the oldest goes; too many names are everything.
        memory.remember(who("c"), names(&["x"]), t0 + Duration::from_secs(3100));
        assert_eq!(memory.len(), 2);
        assert_eq!(
            memory.recall("a", "spiffe://a", "t", t0),
            Unheld::Nothing,
            "the oldest dropped"
        );
        let many: Vec<String> = (0..=MAX_NAMES_PER_ENTRY).map(|i| format!("r{i}")).collect();
        memory.remember(
            who("c"),
            Unheld::Names(many.iter().map(|n| SharedStr::from(n.as_str())).collect()),
            t0,
        );
        assert_eq!(memory.recall("c", "spiffe://a", "t", t0), Unheld::Everything);

        // Off: nothing remembered.
        let off = NackMemory::new(Duration::ZERO, 2, 2);
        off.remember(who("a"), names(&["x"]), t0);
        assert!(off.is_empty() && !off.enabled());
    }

    /// Room is never taken from another identity (the twenty-sixth and
    /// twenty-eighth checks of issue 42): one identity NACKing under many
    /// node ids forgets its own oldest, whatever another identity holds; an
    /// identity at its share forgets its own; a full memory with nothing of
    /// the inserting identity's does not remember the new NACK.
    #[test]
    fn one_identity_never_takes_another_identitys_room() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let client = |node: &str, identity: &str| ClientType {
            node: node.into(),
            identity: identity.into(),
            type_url: "t".into(),
        };
        let at = |n: u64| t0 + Duration::from_secs(n);
        // 15 pilots of one identity, then 30 NACKs of another: the pilots
        // keep all 15 (check 28's case), the other holds what is left.
        let memory = NackMemory::new(Duration::from_secs(3600), 20, 20);
        for n in 0..15 {
            memory.remember(client(&format!("pilot-{n}"), "spiffe://pilot"), names(&["x"]), at(n));
        }
        for n in 0..30 {
            memory.remember(
                client(&format!("evil-{n}"), "spiffe://evil"),
                names(&["y"]),
                at(100 + n),
            );
        }
        assert_eq!(memory.len(), 20);
        for n in 0..15 {
            assert_eq!(
                memory.recall(&format!("pilot-{n}"), "spiffe://pilot", "t", t0),
                names(&["x"]),
                "pilot-{n}"
            );
        }
        assert_eq!(memory.recall("evil-29", "spiffe://evil", "t", t0), names(&["y"]));
        assert_eq!(memory.recall("evil-0", "spiffe://evil", "t", t0), Unheld::Nothing);
        // A third identity finds the memory full and holds nothing: its NACK
        // is not remembered, and no one else's is forgotten.
        memory.remember(client("late", "spiffe://late"), names(&["z"]), at(200));
        assert_eq!(memory.recall("late", "spiffe://late", "t", t0), Unheld::Nothing);
        assert_eq!(memory.len(), 20);
        // An identity at its share forgets its own oldest, with room left.
        let shared = NackMemory::new(Duration::from_secs(3600), 100, 3);
        memory_fill(&shared, "spiffe://a", 5, t0);
        assert_eq!(shared.len(), 3);
        assert_eq!(shared.recall("n-4", "spiffe://a", "t", t0), names(&["x"]));
        assert_eq!(shared.recall("n-1", "spiffe://a", "t", t0), Unheld::Nothing);
        memory_fill(&shared, "spiffe://b", 2, t0);
        assert_eq!(shared.len(), 5);
    }

    fn memory_fill(memory: &NackMemory, identity: &str, count: u64, t0: SystemTime) {
        for n in 0..count {
            let who = ClientType {
                node: format!("n-{n}"),
                identity: identity.into(),
                type_url: "t".into(),
            };
            memory.remember(who, names(&["x"]), t0 + Duration::from_secs(n));
        }
    }
}
