//! The rollout of one collection, as a pure state machine: upstream
//! versions, canary ACKs and NACKs, pins and promotions in; the version each
//! group of clients is served out. No I/O and no clock of its own: the
//! caller passes the time, and asks [`Gate::deadline`] when to come back.
//!
//! Two groups: the canaries (clients a `--canary` selector matches) and
//! everyone else. Without selectors there is one group, served the latest
//! version (or the pin). With them, a new version goes to the canaries
//! first; it is *released* to everyone when every connected canary has
//! ACKed it and `--canary-soak` has passed since the last ACK, and *held*
//! when one NACKs it.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::SharedStr;

/// A collection's content version, as clients see it.
pub type Version = SharedStr;

/// What a round does when no canary is connected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WhenNone {
    /// Release at once (logged and shown as such).
    #[default]
    Proceed,
    /// Wait for a canary to connect and ACK.
    Hold,
}

/// How rounds run; the same for every collection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// `--canary` selectors were given: there are two groups.
    pub canaries: bool,
    pub when_none: WhenNone,
    pub soak: Duration,
}

/// A version a canary NACKed: non-canaries are not served it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hold {
    pub version: Version,
    /// The canary's node id (or its stream, when it sent none).
    pub node: String,
    /// What its certificate proved (absent under `--canary-trust-node-ids`,
    /// and in what a gateway before it saved): who held it, once it left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    pub message: String,
}

/// A version on its way to everyone, served to the canaries meanwhile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Round {
    pub version: Version,
    /// Connected canaries that ACKed it.
    pub acked: BTreeSet<u64>,
    /// Canaries that ACKed it, those since gone included.
    pub acks: usize,
    /// Every connected canary ACKed: it is released at this time (the last
    /// ACK plus the soak).
    pub release_at: Option<Instant>,
}

/// What each group is served.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub everyone: Option<Version>,
    pub canaries: Option<Version>,
}

/// Why a promotion did nothing.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PromoteError {
    #[error("the collection is pinned to {0}: unpin it first (a promotion would not be served)")]
    Pinned(Version),
    #[error("nothing waits for a promotion: everyone is served {0}")]
    NothingWaits(String),
}

/// How many NACKed versions a gate remembers.
const REMEMBERED_NACKS: usize = 16;

/// One collection's rollout.
#[derive(Clone, Debug, Default)]
pub struct Gate {
    policy: Policy,
    /// The cache's newest version.
    latest: Option<Version>,
    /// What everyone (not a canary) is served when not pinned.
    released: Option<Version>,
    round: Option<Round>,
    pin: Option<Version>,
    /// The last NACK that holds a version back, until a newer version is
    /// released or it is promoted.
    held: Option<Hold>,
    /// The versions canaries NACKed (the last [`REMEMBERED_NACKS`]): one
    /// that comes back from upstream is held again at once.
    nacked: std::collections::VecDeque<Hold>,
    /// Connected canary streams following the collection.
    canaries: BTreeSet<u64>,
    /// The released version went to everyone without a canary connected
    /// (`--canary-when-none=proceed`).
    unvetted: bool,
}

impl Gate {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// A gate as a restart left it: everyone on `released`, `held` still
    /// held, and `pin` pinned (each `None` when there was none).
    pub fn restored(policy: Policy, released: Option<Version>, held: Option<Hold>, pin: Option<Version>) -> Self {
        Self {
            policy,
            released,
            nacked: held.iter().cloned().collect(),
            held,
            pin,
            ..Self::default()
        }
    }

    pub fn served(&self) -> Served {
        let everyone = self.pin.clone().or_else(|| self.released.clone());
        let canaries = match (&self.pin, self.policy.canaries) {
            (Some(pin), _) => Some(pin.clone()),
            (None, true) => self.latest.clone().or_else(|| self.released.clone()),
            (None, false) => everyone.clone(),
        };
        Served { everyone, canaries }
    }

    pub fn latest(&self) -> Option<&Version> {
        self.latest.as_ref()
    }

    pub fn released(&self) -> Option<&Version> {
        self.released.as_ref()
    }

    pub fn pinned(&self) -> Option<&Version> {
        self.pin.as_ref()
    }

    pub fn held(&self) -> Option<&Hold> {
        self.held.as_ref()
    }

    pub fn round(&self) -> Option<&Round> {
        self.round.as_ref()
    }

    /// The version everyone is served went out without a canary connected.
    pub fn unvetted(&self) -> Option<&Version> {
        self.released.as_ref().filter(|_| self.unvetted)
    }

    pub fn canaries(&self) -> usize {
        self.canaries.len()
    }

    /// A round is open and no canary is connected to decide it (it waits
    /// under `--canary-when-none=hold`, or because its canaries left
    /// without an ACK).
    pub fn waiting_for_canary(&self) -> bool {
        self.round.is_some() && self.canaries.is_empty()
    }

    /// When [`Self::tick`] has work: a soak ending.
    pub fn deadline(&self) -> Option<Instant> {
        self.round.as_ref().and_then(|r| r.release_at)
    }

    /// The cache's newest version is `version`.
    pub fn on_latest(&mut self, version: Version, now: Instant) {
        if self.latest.as_ref() == Some(&version) {
            return;
        }
        self.latest = Some(version);
        self.advance(now);
    }

    /// Decides what the latest version does, unless pinned: released at
    /// once (no canaries, or nothing served before), kept held, or a round.
    fn advance(&mut self, now: Instant) {
        if self.pin.is_some() {
            return;
        }
        let Some(latest) = self.latest.clone() else {
            return;
        };
        if !self.policy.canaries || self.released.is_none() || self.released.as_ref() == Some(&latest) {
            // Nothing safer to hold back to, or nothing to hold back.
            self.round = None;
            self.release(latest);
            return;
        }
        if let Some(nacked) = self.nacked.iter().find(|h| h.version == latest) {
            // A canary NACKed it before: held again, without a round.
            self.held = Some(nacked.clone());
            self.round = None;
            return;
        }
        if self.round.as_ref().is_some_and(|r| r.version == latest) {
            return;
        }
        self.round = Some(Round {
            version: latest,
            acked: BTreeSet::new(),
            acks: 0,
            release_at: None,
        });
        if self.canaries.is_empty() && self.policy.when_none == WhenNone::Proceed {
            self.release_round();
            self.unvetted = true;
        } else {
            self.check_round(now);
        }
    }

    /// Everyone is served `version`: whatever held them back is settled (a
    /// newer version released, or the held one by the operator's choice).
    fn release(&mut self, version: Version) {
        self.held = None;
        self.unvetted = false;
        self.nacked.retain(|h| h.version != version);
        self.released = Some(version);
    }

    fn release_round(&mut self) {
        if let Some(round) = self.round.take() {
            self.release(round.version);
        }
    }

    /// Every connected canary ACKed the round's version (and at least one
    /// did): released now, or when the soak ends.
    fn check_round(&mut self, now: Instant) {
        let soak = self.policy.soak;
        let Some(round) = &mut self.round else {
            return;
        };
        if round.acks == 0 || !self.canaries.is_subset(&round.acked) {
            round.release_at = None;
            return;
        }
        let at = *round.release_at.get_or_insert(now + soak);
        if at <= now {
            self.release_round();
        }
    }

    /// Time passed: a soak may have ended.
    pub fn tick(&mut self, now: Instant) {
        self.check_round(now);
    }

    /// A canary stream following the collection connected.
    pub fn canary_joined(&mut self, stream: u64, now: Instant) {
        self.canaries.insert(stream);
        // It must ACK too before the round ends.
        self.check_round(now);
    }

    /// A canary stream ended (or stopped following the collection).
    pub fn canary_left(&mut self, stream: u64, now: Instant) {
        self.canaries.remove(&stream);
        if let Some(round) = &mut self.round {
            round.acked.remove(&stream);
        }
        self.check_round(now);
    }

    /// A canary ACKed `version`.
    pub fn canary_acked(&mut self, stream: u64, version: &str, now: Instant) {
        let Some(round) = self.round.as_mut().filter(|r| &*r.version == version) else {
            return;
        };
        if self.canaries.contains(&stream) && round.acked.insert(stream) {
            round.acks += 1;
            // The soak counts from the last ACK.
            round.release_at = None;
        }
        self.check_round(now);
    }

    /// A canary NACKed `version`: when it is the round's, it is held.
    pub fn canary_nacked(&mut self, stream: u64, version: &str, node: &str, message: &str) {
        self.canary_nacked_by(stream, version, node, None, message);
    }

    /// [`Self::canary_nacked`], with the identity the canary proved.
    pub fn canary_nacked_by(&mut self, stream: u64, version: &str, node: &str, identity: Option<&str>, message: &str) {
        if !self.canaries.contains(&stream) || self.round.as_ref().is_none_or(|r| &*r.version != version) {
            return;
        }
        let round = self.round.take().expect("checked above");
        let hold = Hold {
            version: round.version,
            node: node.to_owned(),
            identity: identity.map(str::to_owned),
            message: message.to_owned(),
        };
        if self.nacked.len() == REMEMBERED_NACKS {
            self.nacked.pop_front();
        }
        self.nacked.push_back(hold.clone());
        self.held = Some(hold);
    }

    /// Everyone is served `version` until [`Self::unpin`]. What everyone was
    /// released stays recorded underneath.
    pub fn pin(&mut self, version: Version) {
        self.round = None;
        self.pin = Some(version);
    }

    /// Serves the latest again. When the latest is what everyone was
    /// released before the pin (by the canaries' ACKs, or by the operator:
    /// promoted), everyone goes back to it at once: it was decided, and a
    /// pin (a rollback) is no reason to ask the canaries again; a hold of
    /// another version is settled, as when upstream returns to the released
    /// version. Any other latest goes from the pinned version, like any new
    /// version (a round with canaries; held again if a canary NACKed it).
    pub fn unpin(&mut self, now: Instant) -> Option<Version> {
        let pinned = self.pin.take()?;
        if self.latest_was_decided() {
            self.held = None;
        } else {
            self.released = Some(pinned.clone());
            self.advance(now);
        }
        Some(pinned)
    }

    /// The latest is what everyone was released, and no canary NACKed it
    /// since (a pinned version that everyone stayed on during a round, a
    /// held one, is not a decision).
    fn latest_was_decided(&self) -> bool {
        let Some(latest) = &self.latest else {
            return false;
        };
        self.released.as_ref() == Some(latest) && !self.nacked.iter().any(|h| &h.version == latest)
    }

    /// Sends what the canaries are on (the held version, or the round's)
    /// to everyone now; the version promoted.
    pub fn promote(&mut self) -> Result<Version, PromoteError> {
        if let Some(pin) = &self.pin {
            return Err(PromoteError::Pinned(pin.clone()));
        }
        let version = match (&self.round, &self.held) {
            (Some(round), _) => round.version.clone(),
            (None, Some(held)) => held.version.clone(),
            (None, None) => {
                return Err(PromoteError::NothingWaits(
                    self.released.as_deref().unwrap_or("nothing yet").to_owned(),
                ))
            }
        };
        self.round = None;
        self.held = None;
        self.release(version.clone());
        Ok(version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(text: &str) -> Version {
        SharedStr::from(text)
    }

    fn canary_policy(when_none: WhenNone, soak: Duration) -> Policy {
        Policy {
            canaries: true,
            when_none,
            soak,
        }
    }

    /// A gate releasing at the last ACK, with no canary proceeding, `canaries`
    /// connected and `versions` delivered in turn.
    fn with_canaries(canaries: &[u64], versions: &[&str], now: Instant) -> Gate {
        let mut gate = Gate::new(canary_policy(WhenNone::Proceed, Duration::ZERO));
        for canary in canaries {
            gate.canary_joined(*canary, now);
        }
        for version in versions {
            gate.on_latest(v(version), now);
        }
        gate
    }

    /// "everyone/canaries", `-` for nothing.
    fn served(gate: &Gate) -> String {
        let s = gate.served();
        format!(
            "{}/{}",
            s.everyone.as_deref().unwrap_or("-"),
            s.canaries.as_deref().unwrap_or("-")
        )
    }

    #[test]
    fn without_canaries_everyone_gets_the_latest_or_the_pin() {
        let now = Instant::now();
        let mut gate = Gate::new(Policy::default());
        assert_eq!(served(&gate), "-/-");
        gate.on_latest(v("a"), now);
        gate.on_latest(v("b"), now);
        assert_eq!(served(&gate), "b/b");
        gate.pin(v("a"));
        gate.on_latest(v("c"), now);
        assert_eq!(served(&gate), "a/a");
        assert_eq!(gate.unpin(now), Some(v("a")));
        assert_eq!(served(&gate), "c/c");
        assert!(gate.promote().is_err());
    }

    #[test]
    fn a_round_releases_on_every_canary_ack_and_holds_on_a_nack() {
        let now = Instant::now();
        let mut gate = with_canaries(&[1, 2], &[], now);
        // The first version goes to everyone.
        gate.on_latest(v("a"), now);
        assert_eq!(served(&gate), "a/a");
        gate.on_latest(v("b"), now);
        assert_eq!(served(&gate), "a/b");
        gate.canary_acked(1, "b", now);
        assert_eq!(served(&gate), "a/b");
        gate.canary_acked(2, "b", now);
        assert_eq!(served(&gate), "b/b");
        // A NACK holds.
        gate.on_latest(v("c"), now);
        gate.canary_acked(1, "c", now);
        gate.canary_nacked(2, "c", "canary-2", "bad route");
        assert_eq!(served(&gate), "b/c");
        assert_eq!(gate.held().unwrap().node, "canary-2");
        // A newer version starts a new round; the hold stays until it is
        // released.
        gate.on_latest(v("d"), now);
        assert_eq!(gate.round().unwrap().version, v("d"));
        assert!(gate.held().is_some());
        gate.canary_acked(1, "d", now);
        gate.canary_acked(2, "d", now);
        assert_eq!(served(&gate), "d/d");
        assert!(gate.held().is_none());
    }

    #[test]
    fn the_soak_counts_from_the_last_ack() {
        let start = Instant::now();
        let soak = Duration::from_secs(30);
        let mut gate = Gate::new(canary_policy(WhenNone::Proceed, soak));
        gate.on_latest(v("a"), start);
        gate.canary_joined(1, start);
        gate.canary_joined(2, start);
        gate.on_latest(v("b"), start);
        gate.canary_acked(1, "b", start);
        assert_eq!(gate.deadline(), None);
        gate.canary_acked(2, "b", start + Duration::from_secs(10));
        assert_eq!(gate.deadline(), Some(start + Duration::from_secs(40)));
        gate.tick(start + Duration::from_secs(39));
        assert_eq!(served(&gate), "a/b");
        gate.tick(start + Duration::from_secs(40));
        assert_eq!(served(&gate), "b/b");
        assert_eq!(gate.deadline(), None);
    }

    #[test]
    fn with_no_canary_connected_the_policy_decides() {
        let now = Instant::now();
        for (when_none, everyone) in [(WhenNone::Proceed, "b"), (WhenNone::Hold, "a")] {
            let mut gate = Gate::new(canary_policy(when_none, Duration::ZERO));
            gate.on_latest(v("a"), now);
            gate.on_latest(v("b"), now);
            assert_eq!(served(&gate), format!("{everyone}/b"), "{when_none:?}");
        }
        // A canary that connects to a waiting round decides it.
        let mut gate = Gate::new(canary_policy(WhenNone::Hold, Duration::ZERO));
        gate.on_latest(v("a"), now);
        gate.on_latest(v("b"), now);
        assert!(gate.waiting_for_canary());
        gate.canary_joined(7, now);
        gate.canary_acked(7, "b", now);
        assert_eq!(served(&gate), "b/b");
    }

    #[test]
    fn canaries_that_leave_without_an_ack_do_not_release() {
        let now = Instant::now();
        let mut gate = with_canaries(&[1, 2], &["a"], now);
        gate.on_latest(v("b"), now);
        // A canary that crashed on it looks like this.
        gate.canary_left(1, now);
        gate.canary_left(2, now);
        assert_eq!(served(&gate), "a/b");
        assert!(gate.waiting_for_canary());
        // One ACK, and the other leaving, is every connected canary.
        let mut gate = with_canaries(&[1, 2], &["a"], now);
        gate.on_latest(v("b"), now);
        gate.canary_acked(1, "b", now);
        gate.canary_left(2, now);
        assert_eq!(served(&gate), "b/b");
    }

    #[test]
    fn pins_promotions_and_unpins() {
        let now = Instant::now();
        let mut gate = with_canaries(&[1], &["a", "b"], now);
        gate.canary_nacked(1, "b", "c1", "no");
        assert_eq!(served(&gate), "a/b");
        // A pin to the NACKed version is the operator's choice.
        gate.pin(v("b"));
        assert_eq!(served(&gate), "b/b");
        assert_eq!(gate.promote(), Err(PromoteError::Pinned(v("b"))));
        // Unpinned from another version: b, held before the pin, stays held.
        gate.pin(v("a"));
        assert_eq!(served(&gate), "a/a");
        gate.unpin(now);
        assert_eq!(served(&gate), "a/b");
        assert_eq!(gate.held().unwrap().version, v("b"));
        assert_eq!(gate.promote(), Ok(v("b")));
        assert_eq!(served(&gate), "b/b");
        assert!(gate.held().is_none());
        assert_eq!(gate.promote(), Err(PromoteError::NothingWaits("b".into())));
        // Unpinning to a newer latest starts a round from the pin.
        gate.pin(v("a"));
        gate.on_latest(v("c"), now);
        gate.unpin(now);
        assert_eq!(served(&gate), "a/c");
        gate.canary_acked(1, "c", now);
        assert_eq!(served(&gate), "c/c");
        // Unpinned at the held version itself: everyone stays on it, and the
        // hold is settled.
        gate.on_latest(v("d"), now);
        gate.canary_nacked(1, "d", "c1", "no");
        gate.pin(v("d"));
        gate.unpin(now);
        assert_eq!(served(&gate), "d/d");
        assert!(gate.held().is_none());
    }

    /// What the unpin serves, by what happened before and during the pin:
    /// a version everyone was released (by ACKs or a promotion) is served
    /// again without a round; anything else starts from the pinned version.
    #[test]
    fn the_unpin_returns_to_what_was_decided_and_starts_a_round_for_the_rest() {
        #[derive(Clone, Copy, Debug)]
        enum Do {
            Latest(&'static str),
            Ack(&'static str),
            Nack(&'static str),
            Promote,
            Pin(&'static str),
            Unpin,
        }
        use Do::*;
        /// One row: steps before the unpin (canary 1 connected), then what
        /// is served after it ("everyone/canaries"), the round's version and
        /// the held one.
        struct Case {
            name: &'static str,
            steps: &'static [Do],
            after: &'static str,
            round: Option<&'static str>,
            held: Option<&'static str>,
        }
        let cases = [
            Case {
                name: "pinned to the held version, a round from it, pinned back, upstream back to it: still held",
                steps: &[
                    Latest("a"),
                    Latest("b"),
                    Nack("b"),
                    Pin("b"),
                    Latest("c"),
                    Unpin,
                    Pin("a"),
                    Latest("b"),
                ],
                after: "a/b",
                round: None,
                held: Some("b"),
            },
            Case {
                name: "promoted, pinned back, unpinned",
                steps: &[Latest("a"), Latest("b"), Nack("b"), Promote, Pin("a")],
                after: "b/b",
                round: None,
                held: None,
            },
            Case {
                name: "released by the canary's ACK, pinned back, unpinned",
                steps: &[Latest("a"), Latest("b"), Ack("b"), Pin("a")],
                after: "b/b",
                round: None,
                held: None,
            },
            Case {
                name: "promoted, pinned to itself, unpinned",
                steps: &[Latest("a"), Latest("b"), Nack("b"), Promote, Pin("b")],
                after: "b/b",
                round: None,
                held: None,
            },
            Case {
                name: "promoted, pinned back, a newer version meanwhile",
                steps: &[Latest("a"), Latest("b"), Nack("b"), Promote, Pin("a"), Latest("c")],
                after: "a/c",
                round: Some("c"),
                held: None,
            },
            Case {
                name: "promoted, pinned back, upstream went away and came back",
                steps: &[
                    Latest("a"),
                    Latest("b"),
                    Nack("b"),
                    Promote,
                    Pin("a"),
                    Latest("c"),
                    Latest("b"),
                ],
                after: "b/b",
                round: None,
                held: None,
            },
            Case {
                name: "held, pinned back, unpinned: still held",
                steps: &[Latest("a"), Latest("b"), Nack("b"), Pin("a")],
                after: "a/b",
                round: None,
                held: Some("b"),
            },
            Case {
                name: "held, pinned to the held version: the operator's choice stays",
                steps: &[Latest("a"), Latest("b"), Nack("b"), Pin("b")],
                after: "b/b",
                round: None,
                held: None,
            },
            Case {
                name: "in a round, pinned back: the round starts again from the pin",
                steps: &[Latest("a"), Latest("b"), Pin("a")],
                after: "a/b",
                round: Some("b"),
                held: None,
            },
        ];
        let now = Instant::now();
        for Case {
            name: case,
            steps,
            after,
            round,
            held,
        } in cases
        {
            let mut gate = with_canaries(&[1], &[], now);
            for step in steps {
                match *step {
                    Latest(version) => gate.on_latest(v(version), now),
                    Ack(version) => gate.canary_acked(1, version, now),
                    Nack(version) => gate.canary_nacked(1, version, "c1", "no"),
                    Promote => {
                        gate.promote().expect(case);
                    }
                    Pin(version) => gate.pin(v(version)),
                    Unpin => {
                        gate.unpin(now).expect(case);
                    }
                }
            }
            assert!(gate.unpin(now).is_some(), "{case}");
            assert_eq!(served(&gate), after, "{case}");
            assert_eq!(gate.round().map(|r| &*r.version), round, "{case}");
            assert_eq!(gate.held().map(|h| &*h.version), held, "{case}");
            // A canary's NACK of what everyone is served holds nothing.
            if round.is_none() {
                let everyone = gate.served().everyone.expect(case);
                gate.canary_nacked(1, &everyone, "c1", "again");
                assert_eq!(served(&gate), after, "{case}: after a NACK");
                assert_eq!(gate.held().map(|h| &*h.version), held, "{case}: after a NACK");
            }
        }
    }

    #[test]
    fn a_nacked_version_that_comes_back_is_held_again() {
        let now = Instant::now();
        let mut gate = with_canaries(&[1], &["a", "b"], now);
        gate.canary_nacked(1, "b", "c1", "no");
        gate.on_latest(v("c"), now);
        gate.canary_nacked(1, "c", "c1", "no");
        // Upstream goes back to b: no round, held at once.
        gate.canary_left(1, now);
        gate.on_latest(v("b"), now);
        assert_eq!(served(&gate), "a/b");
        assert_eq!(gate.held().unwrap().version, v("b"));
        assert!(gate.round().is_none());
    }

    /// One step of the property test.
    #[derive(Clone, Debug)]
    enum Step {
        Latest(u8),
        Join(u8),
        Leave(u8),
        /// The canary ACKs what it is served (if it is in the round).
        Ack(u8),
        Nack(u8),
        Pin(u8),
        Unpin,
        Promote,
        Wait(u8),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (0u8..6).prop_map(Step::Latest),
            2 => (0u8..3).prop_map(Step::Join),
            1 => (0u8..3).prop_map(Step::Leave),
            3 => (0u8..3).prop_map(Step::Ack),
            2 => (0u8..3).prop_map(Step::Nack),
            1 => (0u8..6).prop_map(Step::Pin),
            1 => Just(Step::Unpin),
            1 => Just(Step::Promote),
            1 => (0u8..40).prop_map(Step::Wait),
        ]
    }

    proptest::proptest! {
        /// Under any interleaving of upstream versions, canary ACKs and
        /// NACKs, pins and promotions, everyone else is never moved to a
        /// version a canary NACKed before (unless promoted or pinned), and
        /// ends at the latest version not held once the canaries ACK.
        #[test]
        fn everyone_never_gets_a_nacked_version_and_ends_at_the_latest_unheld(
            when_none in proptest::prop_oneof![proptest::strategy::Just(WhenNone::Proceed), proptest::strategy::Just(WhenNone::Hold)],
            soak in 0u64..20,
            steps in proptest::collection::vec(step(), 1..60),
        ) {
            let mut now = Instant::now();
            let mut gate = Gate::new(canary_policy(when_none, Duration::from_secs(soak)));
            let mut nacked: BTreeSet<Version> = BTreeSet::new();
            let mut everyone = None;
            let mut moved_by_operator = false;
            // What everyone was served when the current pin began.
            let mut before_pin: Option<Option<Version>> = None;
            for step in steps {
                let before = gate.served();
                match step {
                    Step::Latest(n) => gate.on_latest(v(&n.to_string()), now),
                    Step::Join(c) => gate.canary_joined(c.into(), now),
                    Step::Leave(c) => gate.canary_left(c.into(), now),
                    Step::Ack(c) => {
                        if let Some(version) = before.canaries.clone().filter(|_| gate.canaries.contains(&c.into())) {
                            gate.canary_acked(c.into(), &version, now);
                        }
                    }
                    Step::Nack(c) => {
                        if let Some(version) = before.canaries.clone().filter(|_| gate.canaries.contains(&c.into())) {
                            if gate.round().is_some_and(|r| r.version == version) {
                                nacked.insert(version.clone());
                            }
                            gate.canary_nacked(c.into(), &version, "node", "bad");
                        }
                    }
                    // A pin names a version of the history: there is a latest.
                    Step::Pin(n) if gate.latest().is_some() => {
                        if gate.pinned().is_none() {
                            before_pin = Some(before.everyone.clone());
                        }
                        gate.pin(v(&n.to_string()));
                        moved_by_operator = true;
                    }
                    Step::Pin(_) => {}
                    Step::Unpin => {
                        // Unpinned while the latest is the pinned version:
                        // the operator released it, NACKed or not (like a
                        // promotion), and a later unpin may return to it.
                        if let Some(pinned) = gate.unpin(now) {
                            if gate.released() == Some(&pinned) && gate.round().is_none() {
                                nacked.remove(&pinned);
                            }
                            // Back to what everyone was served before the
                            // pin: the operator's rollback undone.
                            if before_pin.take() == Some(gate.served().everyone) {
                                moved_by_operator = true;
                            }
                        }
                    }
                    Step::Promote => {
                        if let Ok(promoted) = gate.promote() {
                            nacked.remove(&promoted);
                            moved_by_operator = true;
                        }
                    }
                    Step::Wait(s) => {
                        now += Duration::from_secs(s.into());
                        gate.tick(now);
                    }
                }
                let after = gate.served().everyone;
                if after != everyone {
                    if let Some(to) = &after {
                        proptest::prop_assert!(
                            moved_by_operator || !nacked.contains(to),
                            "everyone moved to {to}, which a canary NACKed"
                        );
                    }
                    everyone = after;
                }
                moved_by_operator = false;
            }
            // Settle: unpinned, a canary connected, every canary ACKs what
            // it is served, the soak passes.
            let before_settling = everyone.clone();
            gate.unpin(now);
            gate.canary_joined(99, now);
            let canaries: Vec<u64> = gate.canaries.iter().copied().collect();
            if let Some(version) = gate.served().canaries {
                for c in canaries {
                    gate.canary_acked(c, &version, now);
                }
            }
            now += Duration::from_secs(soak);
            gate.tick(now);
            let served = gate.served();
            match gate.held() {
                Some(held) if Some(&held.version) == gate.latest() => {
                    proptest::prop_assert_ne!(served.everyone.as_ref(), Some(&held.version));
                    // Nothing newer to go to: everyone stays where it was.
                    proptest::prop_assert_eq!(served.everyone, before_settling);
                }
                _ => proptest::prop_assert_eq!(served.everyone.as_ref(), gate.latest()),
            }
        }
    }
}
