//! What make before break cannot see on the wire: a listener that Envoy
//! drains. A listener changed or removed keeps serving its open
//! connections with its old filter chains until they close or Envoy's
//! drain time passes (`--drain-time-s`, 600 s by default): a cluster its
//! TCP proxy or inline routes send to, or that a route configuration it
//! reads by RDS and the source removed sends to, answers those connections
//! `503 NC` if it goes meanwhile. So the removal of such a cluster (and of
//! its load assignment) waits `--listener-drain-time` from the moment the
//! listener's change settled (its response and the routes' ACKed: Envoy
//! drains once the new listener is warm); the other removals go.
//!
//! Per stream and pure: the stream says what each listener change named
//! and when the listeners settled, asks whether a removal waits, and wakes
//! at [`Drains::next_deadline`].

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use super::order::Rank;

use crate::SharedStr;

/// Drains of one stream whose end has not come.
#[derive(Debug)]
pub struct Drains {
    drain_time: Duration,
    records: Vec<Drain>,
}

/// What one listener change left draining, and until when (`None`: the
/// drain has not begun, the change has not settled yet).
#[derive(Debug)]
struct Drain {
    clusters: BTreeSet<SharedStr>,
    load_assignments: BTreeSet<SharedStr>,
    until: Option<Instant>,
}

/// Drains kept per stream: past it the two oldest are merged (their names
/// together, until the later end), so a removal waits at most a drain time
/// longer than it would have.
const MAX_DRAINS: usize = 16;

impl Drains {
    pub fn new(drain_time: Duration) -> Self {
        Self {
            drain_time,
            records: Vec::new(),
        }
    }

    /// A listener change named these clusters and load assignments (what
    /// its old listeners send to): they drain once it settles.
    pub fn note(&mut self, clusters: BTreeSet<SharedStr>, load_assignments: BTreeSet<SharedStr>) {
        if clusters.is_empty() && load_assignments.is_empty() {
            return;
        }
        // Changes that have not settled drain together.
        if let Some(open) = self.records.iter_mut().find(|d| d.until.is_none()) {
            open.clusters.extend(clusters);
            open.load_assignments.extend(load_assignments);
            return;
        }
        if self.records.len() >= MAX_DRAINS {
            let oldest = self.records.remove(0);
            let next = &mut self.records[0];
            next.clusters.extend(oldest.clusters);
            next.load_assignments.extend(oldest.load_assignments);
            next.until = next.until.max(oldest.until);
        }
        self.records.push(Drain {
            clusters,
            load_assignments,
            until: None,
        });
    }

    /// Whether a change has yet to settle (see [`Self::settled`]).
    pub fn unsettled(&self) -> bool {
        self.records.iter().any(|d| d.until.is_none())
    }

    /// The listeners and routes settled at `now`: the drains of the changes
    /// before began.
    pub fn settled(&mut self, now: Instant) {
        for drain in self.records.iter_mut().filter(|d| d.until.is_none()) {
            drain.until = Some(now + self.drain_time);
        }
    }

    /// Until when a removal of `removed` of the type at `rank` waits, at
    /// `now`, and which of `removed` wait; `None`: none waits for a drain.
    /// Asked when the order would let the removal go, which is when the
    /// types after it settled: a drain that had not begun begins.
    pub fn holds<'a>(
        &mut self,
        rank: Rank,
        removed: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Option<(Instant, BTreeSet<SharedStr>)> {
        if !matches!(rank, Rank::Clusters | Rank::Endpoints) {
            return None;
        }
        let removed: Vec<&str> = removed.into_iter().collect();
        let mut held: Option<(Instant, BTreeSet<SharedStr>)> = None;
        for drain in &mut self.records {
            let names = match rank {
                Rank::Clusters => &drain.clusters,
                _ => &drain.load_assignments,
            };
            let draining: Vec<SharedStr> = names.iter().filter(|n| removed.contains(&&***n)).cloned().collect();
            if draining.is_empty() {
                continue;
            }
            let end = *drain.until.get_or_insert(now + self.drain_time);
            if end > now {
                let (until, names) = held.get_or_insert_with(|| (end, BTreeSet::new()));
                *until = (*until).max(end);
                names.extend(draining);
            }
        }
        held
    }

    /// When the first drain ends: the stream tries its held removals then.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.records.iter().filter_map(|d| d.until).min()
    }

    /// Forgets the drains ended at `now`; `true` when none is left.
    pub fn expire(&mut self, now: Instant) -> bool {
        self.records.retain(|d| d.until.is_none_or(|until| until > now));
        self.records.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<SharedStr> {
        names.iter().map(|n| SharedStr::from(*n)).collect()
    }

    const DRAIN: Duration = Duration::from_secs(600);

    /// A cluster the old listener sent to is removed a drain time after the
    /// change settled; other clusters go at once.
    #[test]
    fn a_removal_of_what_a_drained_listener_named_waits_a_drain_time() {
        let start = Instant::now();
        let mut drains = Drains::new(DRAIN);
        drains.note(set(&["a"]), set(&["a-eds"]));
        assert!(drains.unsettled());
        assert_eq!(drains.next_deadline(), None, "not begun");
        assert_eq!(drains.holds(Rank::Clusters, ["b"], start), None);
        let later = start + Duration::from_secs(2);
        // The removal would go: the drain begins now.
        assert_eq!(
            drains.holds(Rank::Clusters, ["b", "a"], later),
            Some((later + DRAIN, set(&["a"])))
        );
        assert_eq!(
            drains.holds(Rank::Endpoints, ["a-eds"], later),
            Some((later + DRAIN, set(&["a-eds"])))
        );
        assert_eq!(
            drains.holds(Rank::Endpoints, ["a"], later),
            None,
            "load assignments by their names"
        );
        assert_eq!(drains.next_deadline(), Some(later + DRAIN));
        let end = later + DRAIN;
        assert_eq!(drains.holds(Rank::Clusters, ["a"], end), None, "ended");
        assert!(drains.expire(end));
    }

    /// The drain begins when the listeners settle, whether or not a removal
    /// was waiting: a cluster removed long after drains nothing.
    #[test]
    fn a_drain_begins_when_the_change_settles() {
        let start = Instant::now();
        let mut drains = Drains::new(DRAIN);
        drains.note(set(&["a"]), BTreeSet::new());
        drains.settled(start);
        assert!(!drains.unsettled());
        assert_eq!(drains.next_deadline(), Some(start + DRAIN));
        let after = start + DRAIN + Duration::from_secs(1);
        assert_eq!(drains.holds(Rank::Clusters, ["a"], after), None);
        assert!(drains.expire(after));
    }

    /// Changes that settle together drain together; past the cap, the two
    /// oldest merge and keep the later end.
    #[test]
    fn drains_are_bounded() {
        let start = Instant::now();
        let mut drains = Drains::new(DRAIN);
        drains.note(set(&["a"]), BTreeSet::new());
        drains.note(set(&["b"]), BTreeSet::new());
        assert_eq!(drains.records.len(), 1);
        drains.note(BTreeSet::new(), BTreeSet::new());
        assert_eq!(drains.records.len(), 1, "a change that named nothing drains nothing");
        for i in 0..(MAX_DRAINS as u64 * 2) {
            drains.settled(start + Duration::from_secs(i));
            drains.note(set(&[&format!("c{i}")]), BTreeSet::new());
        }
        assert!(drains.records.len() <= MAX_DRAINS);
        // The oldest names still wait, until a later end.
        let now = start + Duration::from_secs(40);
        assert!(drains
            .holds(Rank::Clusters, ["a"], now)
            .is_some_and(|(u, _)| u > start + DRAIN));
    }
}
