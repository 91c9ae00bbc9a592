//! One client's state for one type, and the protocol's rules as a pure state
//! machine: no I/O, no `.await`, no clock. Inputs are the client's requests
//! and the cache's current snapshot; outputs say what to send (and from what
//! base), or why nothing is sent. Every protocol (the legacy aggregated
//! services, `ResourceSource`, xDS) is an adapter that reads its requests
//! into a [`Request`] and encodes the [`Push`] it is told.
//!
//! The rules (Istio's MCP server, Envoy's `xds_protocol.rst`, and what other
//! servers got wrong):
//! - A request is accepted when nothing was sent for the type yet (whatever
//!   its nonce: istiod sends one it was never given), or when its nonce is
//!   the last one sent. Anything else is stale and ignored. A request is an
//!   ACK only of what it names: an xDS state-of-the-world request whose
//!   `version_info` is not the version of the response its nonce names is
//!   not an ACK of it (Envoy repeats its last ACKed version, with the NACKed
//!   response's nonce, when it changes its names after a NACK).
//! - One response outstanding per type; changes meanwhile coalesce to the
//!   latest.
//! - Nothing is sent before the source delivered the collection.
//! - A NACK leaves a client between what it ACKed and what it was sent
//!   ([`Family`]): MCP sinks reject a response whole; xDS clients may apply
//!   its valid part (Envoy's CDS and LDS, grpc's gRFC A46). So whether
//!   anything is sent is decided against what the client was last sent: the
//!   NACKed version is never sent again unprompted, and the next version
//!   that differs from it is, even when it equals what the client last ACKed
//!   (a revert). What an MCP incremental diff is computed from stays the
//!   ACKed state; a delta xDS client holds what it was sent, NACK or not.
//! - xDS clients may name the resources they want ([`super::names`]): their
//!   responses are their own, built from their names, and a change that
//!   touches none of them sends them nothing. To a client that keeps what a
//!   state-of-the-world response leaves out (named routes and endpoints:
//!   [`TypeState::sending_changes_only`]), a response after the first
//!   carries what changed since it was last sent and what it newly asks
//!   for; after a NACK, everything. Subscription changes count on
//!   every request, whatever its nonce, and newly requested names are
//!   answered at once (or once the outstanding response is answered), even
//!   at a NACKed version.
//! - A reconnecting xDS client's word ([`Reconnect`], only where the stream
//!   trusts it): what it reports holding at the current content version is
//!   not sent again, except what a response it NACKed carried (its versions
//!   lag what it holds) and what [`TypeState::force_resend`] names (the
//!   load assignments of clusters just sent). State of the world: only a
//!   wildcard subscription, whose `version_info` names all it holds.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use super::names::{changed_names, Holds, NameChange, Named, TooManyNames};
use super::registry::{NackRecord, Nonce, Stamp, TypeView};
use super::wakes::Registration;
use crate::cache::{CachedResource, CollectionSnapshot, Diff};
use crate::proto::wire::NameList;
use crate::SharedStr;

/// What a client holds after it NACKed a response: the protocol family's
/// rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Family {
    /// Istio's MCP sinks (the legacy services, `ResourceSource`) apply a
    /// response whole or not at all: after a NACK they hold what they ACKed.
    #[default]
    Mcp,
    /// xDS clients (Envoy, grpc, istiod) may apply the valid part of a
    /// response they NACK: after a NACK they hold something between what
    /// they ACKed and what they were sent.
    Xds,
}

/// How responses for this type carry the collection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Every response is the whole collection (state of the world).
    #[default]
    Full,
    /// Responses carry what changed since what the client holds.
    Incremental,
}

/// The names a client reported in its first request
/// (`initial_resource_versions`) and the version of each, each as a varint
/// length and its bytes in one buffer: what the first response needs (the
/// names that are gone, and for xDS the resources already held), at the size
/// the client sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportedNames(Bytes);

impl ReportedNames {
    /// Names without versions.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Self::with_versions(names.into_iter().map(|name| (name, "")))
    }

    pub fn with_versions<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut buf = BytesMut::new();
        for (name, version) in entries {
            for text in [name, version] {
                prost::encoding::encode_varint(text.len() as u64, &mut buf);
                buf.put_slice(text.as_bytes());
            }
        }
        Self(buf.freeze())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.entries().map(|(name, _)| name)
    }

    /// Each name with the version the client reported for it.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut rest = &self.0[..];
        let mut text = move || {
            let len = prost::encoding::decode_varint(&mut rest).ok()? as usize;
            let (text, tail) = rest.split_at_checked(len)?;
            rest = tail;
            std::str::from_utf8(text).ok()
        };
        std::iter::from_fn(move || Some((text()?, text()?)))
    }
}

/// Resources a client may not hold as it reports them: none, some by name,
/// or all of a type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Unheld {
    #[default]
    Nothing,
    Names(BTreeSet<SharedStr>),
    Everything,
}

impl Unheld {
    pub fn covers(&self, name: &str) -> bool {
        match self {
            Unheld::Nothing => false,
            Unheld::Names(names) => names.contains(name),
            Unheld::Everything => true,
        }
    }

    /// Nothing, or no names.
    pub fn is_nothing(&self) -> bool {
        match self {
            Unheld::Nothing => true,
            Unheld::Names(names) => names.is_empty(),
            Unheld::Everything => false,
        }
    }

    /// These and `other`.
    pub fn add(&mut self, other: Unheld) {
        match (&mut *self, other) {
            (_, Unheld::Nothing) | (Unheld::Everything, _) => {}
            (Unheld::Names(names), Unheld::Names(more)) => names.extend(more),
            (this, other) => *this = other,
        }
    }
}

/// A reconnecting xDS client whose report the stream trusts: what it
/// reports at the current content version is not sent again, except the
/// names here. Kept until its first response is decided.
#[derive(Debug, Default)]
pub struct Reconnect {
    /// What responses it NACKed carried (the NACK memory): it may hold
    /// newer content than it reports (Envoy records versions only for a
    /// response it accepted whole, and applies part of one it rejects).
    nacked: Unheld,
    /// Forced by [`TypeState::force_resend`] before the first response.
    forced: BTreeSet<SharedStr>,
}

impl Reconnect {
    fn unheld(&self, name: &str) -> bool {
        self.nacked.covers(name) || self.forced.contains(name)
    }

    /// Why a reported name is sent all the same.
    fn reason(&self, name: &str) -> ResendReason {
        if self.nacked.covers(name) {
            ResendReason::Nacked
        } else if self.forced.contains(name) {
            ResendReason::Forced
        } else {
            ResendReason::Changed
        }
    }

    fn trusts_everything(&self) -> bool {
        self.nacked.is_nothing() && self.forced.is_empty()
    }
}

/// Why a resource a reconnecting client reported is sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResendReason {
    /// It reported another version, or the gateway has another.
    Changed,
    /// A response it NACKed carried it.
    Nacked,
    /// Forced: the load assignment of a cluster sent on the stream.
    Forced,
}

/// What a reconnecting client's first response skipped and resent, by
/// reason, of the resources it reported (the metrics' counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconnectTally {
    pub skipped: u64,
    pub changed: u64,
    pub nacked: u64,
    pub forced: u64,
}

impl ReconnectTally {
    fn count(&mut self, reason: ResendReason, n: u64) {
        match reason {
            ResendReason::Changed => self.changed += n,
            ResendReason::Nacked => self.nacked += n,
            ResendReason::Forced => self.forced += n,
        }
    }
}

/// A reconnecting client's report, read once for its first response.
pub struct Trust<'a> {
    versions: HashMap<&'a str, &'a str>,
    reconnect: &'a Reconnect,
}

impl<'a> Trust<'a> {
    fn new(reported: &'a ReportedNames, reconnect: &'a Reconnect) -> Self {
        Self {
            versions: reported.entries().collect(),
            reconnect,
        }
    }

    /// The client holds `resource` as it is: it reported its content
    /// version, and nothing says its report lags.
    pub fn holds(&self, resource: &CachedResource) -> bool {
        !self.reconnect.unheld(&resource.name)
            && self
                .versions
                .get(&*resource.name)
                .is_some_and(|v| resource.has_content_version(v))
    }

    /// What the first response `diff` skipped and resent of the reported
    /// resources `covered` keeps (those it asks for) that `to` has.
    fn tally(&self, to: &CollectionSnapshot, covered: impl Fn(&str) -> bool, diff: &Diff) -> ReconnectTally {
        let mut tally = ReconnectTally::default();
        for name in self.versions.keys() {
            if !covered(name) || !to.resources.contains_key(*name) {
                continue;
            }
            match diff.upserts.binary_search_by(|r| (*r.name).cmp(name)) {
                Ok(_) => tally.count(self.reconnect.reason(name), 1),
                Err(_) => tally.skipped += 1,
            }
        }
        tally
    }
}

/// Delta xDS: what a response carried, for the NACK memory (what a NACK of
/// it leaves unknown, what an ACK of it makes known again).
#[derive(Clone, Debug)]
enum Carried {
    Everything,
    Names(Arc<[SharedStr]>),
    /// What changed from this snapshot to the one sent.
    Between(Arc<CollectionSnapshot>),
}

/// What the client holds, as far as the gateway knows.
#[derive(Clone, Debug)]
pub enum Held {
    /// Before the first response: nothing, or the names it reported
    /// (kept only until the first response is built).
    Reported(ReportedNames),
    /// Before the first response: the version it reported holding (a
    /// state-of-the-world client reconnecting).
    Version(SharedStr),
    /// The first response, built from reported names, is not answered yet.
    AwaitingFirst { reported_names: bool },
    /// The snapshot it last ACKed.
    At(Arc<CollectionSnapshot>),
}

/// A NACK's code and (bounded) message, as an adapter read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nack {
    pub code: i32,
    pub message: String,
}

/// A request that names nothing.
static NO_NAMES: NameList = NameList::new();

/// A client's request for this type, as an adapter read it.
#[derive(Debug)]
pub struct Request<'a> {
    pub nonce: &'a str,
    /// `Some` for a NACK.
    pub nack: Option<Nack>,
    /// The version the client says it holds, where its protocol makes that
    /// the test of an ACK (xDS state of the world); `None` elsewhere (MCP
    /// requests answer their nonce's response).
    pub version: Option<&'a str>,
    /// The names it asks for (xDS); legacy protocols name none.
    pub names: NameChange<'a>,
    /// `--max-subscribed-names`.
    pub max_names: usize,
    /// The collection as the cache has it now: the names a subscription
    /// keeps are its own, not copies.
    pub known: Option<&'a CollectionSnapshot>,
    /// When it came (the views' clock: the machine reads none).
    pub at: Stamp,
}

impl<'a> Request<'a> {
    /// A request that names nothing.
    pub fn new(nonce: &'a str, nack: Option<Nack>) -> Self {
        Request {
            nonce,
            nack,
            version: None,
            names: NameChange::Replace(&NO_NAMES),
            max_names: usize::MAX,
            known: None,
            at: Stamp::NEVER,
        }
    }
}

/// What a request was.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing was sent for the type yet: a subscription.
    First,
    Ack,
    Nack,
    /// Its nonce is not the last one sent: ignored.
    Stale {
        expected: String,
    },
    /// It answers no response (a stale nonce, none, or one answered
    /// already), and it changed the names subscribed: that counts, nothing
    /// is ACKed.
    Subscription,
    /// Its nonce is the last one sent, but it answers nothing: that response
    /// was answered already, or (xDS) the version it names is not that
    /// response's. It changes nothing.
    Repeat,
    /// It names more resources than `--max-subscribed-names` allows.
    TooManyNames {
        count: usize,
    },
    /// A NACK of a first response built from reported names: what the
    /// client holds cannot be known any more; the stream must end and the
    /// client start again.
    Unrecoverable,
}

/// Why nothing is sent now.
#[derive(Debug, PartialEq, Eq)]
pub enum Wait {
    /// A response is outstanding: the next one waits for its ACK or NACK.
    Outstanding,
    /// The source has not delivered the collection: nothing is invented.
    NotDelivered,
    /// The client holds the current version.
    UpToDate,
    /// The client NACKed the current version: it is not sent again
    /// unprompted.
    Nacked,
}

/// What to send.
#[derive(Debug)]
pub enum Push {
    /// The whole collection at `to`.
    Full { to: Arc<CollectionSnapshot> },
    /// What changed from `from` (the client's ACKed snapshot) to `to`.
    Diff {
        from: Arc<CollectionSnapshot>,
        to: Arc<CollectionSnapshot>,
    },
    /// The whole collection, and removals for the reported names that `to`
    /// does not have, for a client whose report is not trusted (MCP:
    /// versions alone cannot show that a source reused one for another
    /// body; xDS without the NACK memory: see [`Reconnect`]): nothing is
    /// skipped on its word. A trusted report gets [`Push::Selected`].
    FirstFromReported {
        to: Arc<CollectionSnapshot>,
        reported: ReportedNames,
    },
    /// This client's own response (named subscriptions): `diff.upserts` are
    /// the resources to send (state of the world: every one subscribed),
    /// `diff.removed` the names to remove.
    Selected { to: Arc<CollectionSnapshot>, diff: Diff },
}

impl Push {
    pub fn to(&self) -> &Arc<CollectionSnapshot> {
        match self {
            Push::Full { to }
            | Push::Diff { to, .. }
            | Push::FirstFromReported { to, .. }
            | Push::Selected { to, .. } => to,
        }
    }
}

/// One client's state for one type.
#[derive(Debug)]
pub struct TypeState {
    mode: Mode,
    family: Family,
    /// What diffs are computed from: what the client ACKed, or (delta xDS)
    /// what it was sent.
    held: Held,
    /// The snapshot of the outstanding (or last) response: what decides
    /// whether anything is to be sent (after an ACK it is what the client
    /// ACKed; after a NACK, what it refused).
    sent: Option<Arc<CollectionSnapshot>>,
    /// The names the client asks for, once it named any (boxed: most
    /// clients take everything).
    named: Option<Box<Named>>,
    /// A reconnecting client's report, trusted, until its first response is
    /// decided (boxed: most clients are not reconnecting).
    reconnect: Option<Box<Reconnect>>,
    /// What that first decision skipped and resent, until the stream takes it.
    tally: Option<ReconnectTally>,
    /// Names whose holding was forgotten ([`Self::force_resend`]) for a
    /// client that names nothing (a subscription keeps its own).
    forced: BTreeSet<SharedStr>,
    /// Delta xDS: what the outstanding (or last) response carried, kept
    /// only where the NACK memory is (`remembering_nacks`).
    carried: Option<Carried>,
    remembers_nacks: bool,
    /// State of the world, a client naming what it asks for: a response
    /// after the first carries only what changed since the client was last
    /// sent and what it newly asks for (the type's clients keep the rest:
    /// [`crate::collections::sotw_keeps_what_is_left_out`]).
    changes_only: bool,
    /// Delta xDS: what the client last ACKed. A client that NACKs a
    /// response may have applied part of it (Envoy's CDS applies the valid
    /// clusters): after a NACK the next response goes from this, so what
    /// the refused response carried is sent again with the fix (a cluster
    /// refused and left as it was is not taken as held).
    acked: Option<Arc<CollectionSnapshot>>,
    /// Delta xDS: its last answer was a NACK, and the next version's
    /// response is still to go from [`Self::acked`].
    revert_pending: bool,
    /// What the debug views show; kept in step with the state.
    pub view: TypeView,
}

impl TypeState {
    pub fn new(view: TypeView, mode: Mode, family: Family, held: Held) -> Self {
        let mut state = Self {
            mode,
            family,
            held,
            sent: None,
            named: None,
            reconnect: None,
            tally: None,
            forced: BTreeSet::new(),
            carried: None,
            remembers_nacks: false,
            changes_only: false,
            acked: None,
            revert_pending: false,
            view,
        };
        if let Held::Version(version) = &state.held {
            state.view.acked_version = Some(version.clone());
        }
        state.view.incremental = mode == Mode::Incremental;
        state
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn held(&self) -> &Held {
        &self.held
    }

    /// The names the client asks for; `None`: everything.
    pub fn named(&self) -> Option<&Named> {
        self.named.as_deref()
    }

    /// What the client was last sent (or, after a reconnect whose first
    /// response it took, holds); `None` before anything.
    pub fn last_sent(&self) -> Option<&Arc<CollectionSnapshot>> {
        last_sent(&self.sent, &self.held)
    }

    /// The stream trusts what this reconnecting client reports holding,
    /// except for what responses it NACKed carried (`nacked`): see
    /// [`Reconnect`]. A client that reports nothing is sent everything as
    /// before.
    pub fn trusting_reported(mut self, nacked: Unheld) -> Self {
        let reports = match &self.held {
            Held::Reported(reported) => !reported.is_empty(),
            Held::Version(_) => true,
            _ => false,
        };
        if reports && self.sent.is_none() {
            self.reconnect = Some(Box::new(Reconnect {
                nacked,
                forced: BTreeSet::new(),
            }));
        }
        self
    }

    /// What each response carries is kept until the next, for the NACK
    /// memory ([`Self::carried`]); without it a NACK is of the whole type.
    pub fn remembering_nacks(mut self) -> Self {
        self.remembers_nacks = true;
        self
    }

    /// State of the world, a client naming what it asks for: each response
    /// after the first carries what changed since the client was last sent
    /// and what it newly asks for, not all it asks for; after a NACK, all
    /// (what the client kept of the refused response is not known).
    pub fn sending_changes_only(mut self) -> Self {
        self.changes_only = true;
        self
    }

    /// A named state-of-the-world response now carries what changed: the
    /// type is sent so ([`Self::sending_changes_only`]) and no NACK is
    /// pending (after one, everything goes).
    fn sends_changes_now(&self) -> bool {
        self.changes_only && !self.nack_pending()
    }

    /// Whether the first response is still to be decided on a trusted
    /// report.
    pub fn trusts_reported(&self) -> bool {
        self.reconnect.is_some()
    }

    /// What the first response to a reconnecting client skipped and resent,
    /// once it is decided (taken: counted once).
    pub fn take_reconnect_tally(&mut self) -> Option<ReconnectTally> {
        self.tally.take()
    }

    /// Forget that the client holds `names` (those it asks for): they are
    /// sent again with the next response, whatever it holds or reported.
    /// For the load assignments of clusters just sent (a cluster Envoy
    /// warms waits for them: envoy#22418), and for anything else a
    /// coordinator must see delivered again after another type.
    /// How many of `names` it asks for (all, for a client that names
    /// nothing): those forced.
    pub fn force_resend<'a>(&mut self, names: impl IntoIterator<Item = &'a SharedStr>) -> usize {
        let named = self.named.as_deref_mut();
        let asked = names
            .into_iter()
            .filter(|n| named.as_ref().is_none_or(|named| named.current().covers(n)));
        if let Some(reconnect) = self.reconnect.as_deref_mut() {
            // Before the first response: not skipped on the client's word.
            let before = reconnect.forced.len();
            reconnect.forced.extend(asked.cloned());
            return reconnect.forced.len() - before;
        }
        if self.sent.is_none() {
            // Nothing was sent, nor will be skipped: everything goes.
            return 0;
        }
        let asked: Vec<&SharedStr> = asked.collect();
        let count = asked.len();
        match self.named.as_deref_mut() {
            Some(named) => named.resend(asked),
            None => self.forced.extend(asked.into_iter().cloned()),
        }
        count
    }

    /// Delta xDS, before the first response to a reconnecting client: the
    /// names it reports holding that `to` does not have (in the names it
    /// asks for), which that response would remove. Otherwise none.
    pub fn reported_gone(&self, to: &CollectionSnapshot) -> Vec<SharedStr> {
        if !self.holds_what_was_sent() || self.sent.is_some() {
            return Vec::new();
        }
        let Held::Reported(reported) = &self.held else {
            return Vec::new();
        };
        let named = self.named.as_deref();
        gone(reported, to)
            .into_iter()
            .filter(|name| named.is_none_or(|n| n.current().covers(name)))
            .collect()
    }

    /// Delta xDS, before the first response to a reconnecting client: of
    /// the names it reports that the source no longer has, the first
    /// response removes `go` and not `kept` (their removal is the stream's
    /// to send later: [`Self::force_resend`] of a name that is gone removes
    /// it). `false` once the first response went: nothing done.
    pub fn reported_removals(&mut self, go: &BTreeSet<SharedStr>, kept: &BTreeSet<SharedStr>) -> bool {
        if !self.holds_what_was_sent() || self.sent.is_some() {
            return false;
        }
        let Held::Reported(reported) = &self.held else {
            return false;
        };
        let entries: Vec<(&str, &str)> = reported.entries().filter(|(name, _)| !kept.contains(*name)).collect();
        let listed: std::collections::HashSet<&str> = entries.iter().map(|(name, _)| *name).collect();
        let back = go
            .iter()
            .filter(|name| !listed.contains(&***name))
            .map(|name| (&**name, ""));
        let reported = ReportedNames::with_versions(entries.iter().copied().chain(back));
        self.held = Held::Reported(reported);
        // A name newly asked for is answered (removed, when it does not
        // exist) whatever it reports: not these.
        if let Some(named) = self.named.as_deref_mut() {
            named.unresend(kept);
            named.resend(go.iter());
        }
        true
    }

    /// Delta xDS: what the response this client last answered carried, as
    /// the NACK memory keeps it. State of the world: everything.
    pub fn carried(&self) -> Unheld {
        let Some(sent) = &self.sent else {
            return Unheld::Nothing;
        };
        if !self.holds_what_was_sent() || !self.remembers_nacks {
            return Unheld::Everything;
        }
        match &self.carried {
            None | Some(Carried::Everything) => Unheld::Everything,
            Some(Carried::Names(names)) => Unheld::Names(names.iter().cloned().collect()),
            Some(Carried::Between(from)) => Unheld::Names(changed_names(from, sent).iter().cloned().collect()),
        }
    }

    /// A request for this type.
    pub fn on_request(&mut self, request: Request<'_>) -> Verdict {
        self.view.last_request_at = request.at;
        let changed = match Named::apply(
            &mut self.named,
            request.names,
            self.sent.is_some(),
            request.known,
            request.max_names,
        ) {
            Ok(changed) => changed,
            Err(TooManyNames { count }) => return Verdict::TooManyNames { count },
        };
        if changed {
            if let Some(named) = &self.named {
                self.view.subscribed = Some(Arc::new(named.current().into()));
            }
        }
        let Some(sent_nonce) = &self.view.last_sent_nonce else {
            return Verdict::First;
        };
        let sent = self.sent.clone().expect("a nonce is only issued with a snapshot");
        let its_nonce = sent_nonce.is(request.nonce);
        let answers = its_nonce
            && self.view.outstanding
            && (request.nack.is_some() || request.version.is_none_or(|v| *v == *sent.version));
        if !answers {
            return match (changed, its_nonce) {
                (true, _) => Verdict::Subscription,
                (false, true) => Verdict::Repeat,
                (false, false) => Verdict::Stale {
                    expected: sent_nonce.to_string(),
                },
            };
        }
        self.view.outstanding = false;
        match request.nack {
            Some(nack) => {
                self.view.last_nack = Some(Box::new(NackRecord {
                    version: sent.version.clone(),
                    code: nack.code,
                    message: nack.message,
                    at: request.at,
                    superseded: false,
                }));
                // It holds what it ACKed and any part of this response: the
                // response of the source's next version goes from what it
                // ACKed, with what this one carried again (see `next`).
                self.revert_pending = self.holds_what_was_sent();
                match (self.family, &self.held) {
                    (Family::Mcp, Held::AwaitingFirst { reported_names: true }) => Verdict::Unrecoverable,
                    // It still holds nothing.
                    (Family::Mcp, Held::AwaitingFirst { reported_names: false }) => {
                        self.held = Held::Reported(ReportedNames::default());
                        Verdict::Nack
                    }
                    _ => Verdict::Nack,
                }
            }
            None => {
                self.view.acked_version = Some(sent.version.clone());
                self.view.acked_at = request.at;
                if let Some(nack) = &mut self.view.last_nack {
                    nack.superseded = true;
                }
                if self.holds_what_was_sent() {
                    self.acked = Some(sent.clone());
                    self.revert_pending = false;
                }
                self.held = Held::At(sent);
                Verdict::Ack
            }
        }
    }

    /// Whether the client answered its last response by ACKing `current`'s
    /// version and is owed nothing: [`Self::next`] would then find nothing
    /// to send and change nothing (`settle` at the version it was sent is
    /// a no-op). What a stream reads on the usual ACK, before it makes
    /// anything: every condition here is one `next` reads before it
    /// decides `UpToDate` (the test `holds_current_is_what_next_finds_up_to_date`).
    pub fn holds_current(&self, current: Option<&Arc<CollectionSnapshot>>) -> bool {
        let Some(current) = current else {
            return false;
        };
        !self.view.outstanding
            && matches!(&self.held, Held::At(held) if held.version == current.version)
            && self.sent.as_ref().is_some_and(|sent| sent.version == current.version)
            && self.view.acked_version.as_ref() == Some(&current.version)
            && self.reconnect.is_none()
            && !self.revert_pending
            && self.forced.is_empty()
            && self.pending_nack().is_none()
            && self.named.as_deref().is_none_or(Named::settled)
    }

    /// Its last answer was a NACK.
    fn nack_pending(&self) -> bool {
        self.pending_nack().is_some()
    }

    /// Its last NACK, while no later response was ACKed.
    pub fn pending_nack(&self) -> Option<&NackRecord> {
        self.view.last_nack.as_deref().filter(|n| !n.superseded)
    }

    /// What to send now, given the cache's current snapshot. When it says
    /// `Push`, the adapter must send it and then call [`Self::sent`].
    pub fn next(&mut self, current: Option<&Arc<CollectionSnapshot>>) -> Result<Push, Wait> {
        self.next_woken(current, None)
    }

    /// [`Self::next`], for a type the wake index wakes by its names
    /// (`woken`: its registration there), whose changes it reads there.
    pub fn next_woken(
        &mut self,
        current: Option<&Arc<CollectionSnapshot>>,
        woken: Option<&Registration>,
    ) -> Result<Push, Wait> {
        if self.view.outstanding || matches!(self.held, Held::AwaitingFirst { .. }) {
            return Err(Wait::Outstanding);
        }
        let current = current.ok_or(Wait::NotDelivered)?;
        if let Some(reconnect) = self.reconnect.take() {
            if let Some(decided) = self.first_on_trust(&reconnect, current) {
                return decided;
            }
        }
        if self.revert_pending && self.pending_nack().is_some_and(|n| n.version != current.version) {
            self.revert_after_nack();
        }
        // Newly requested names are answered whatever was NACKed: grpc asks
        // for a new cluster exactly when an operator routes away from a
        // broken one.
        let owed = self.named.as_ref().is_some_and(|n| !n.settled()) || !self.forced.is_empty();
        if !owed {
            // The version it just refused is not sent again unprompted. Once
            // it ACKed a later response, the cache going back to that
            // version is a change like any other.
            if self.pending_nack().is_some_and(|n| n.version == current.version) {
                return Err(Wait::Nacked);
            }
            if !self.differs_from_sent(current) {
                self.settle(current);
                return Err(Wait::UpToDate);
            }
        }
        let to = current.clone();
        let forced = std::mem::take(&mut self.forced);
        // A client naming nothing, holding a snapshot, with names forced:
        // what changed and those.
        if let (Mode::Incremental, Family::Xds, Held::At(from), false) =
            (self.mode, self.family, &self.held, forced.is_empty())
        {
            let mut diff = Diff::between(&from.resources, &to.resources);
            diff.upserts
                .extend(forced.iter().filter_map(|name| to.resources.get(name).cloned()));
            diff.upserts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
            diff.upserts.dedup_by(|a, b| a.name == b.name);
            // A forced name that is gone is removed (again: the client may
            // hold it from a response it refused).
            diff.removed.extend(
                forced
                    .iter()
                    .filter(|name| !to.resources.contains_key(&***name))
                    .cloned(),
            );
            diff.removed.sort_unstable();
            diff.removed.dedup();
            let push = Push::Selected { to, diff };
            self.note_carried(&push);
            return Ok(push);
        }
        let changes_now = self.sends_changes_now();
        let push = match (self.mode, self.family) {
            (Mode::Full, _) => match self.named.as_deref_mut() {
                Some(named) if !named.current().wildcard => {
                    let from = last_sent(&self.sent, &self.held);
                    let upserts = match from {
                        // It holds what it was last sent of every name it
                        // asks for (it ACKed that response): what changed
                        // since, and what it newly asks for. A name gone is
                        // not told: it keeps it, as it would if left out of
                        // the whole.
                        Some(from) if changes_now => {
                            let upserts = named.changes_woken(Holds::Snapshot(from), &to, woken).upserts;
                            if upserts.is_empty() {
                                // Nothing it asks for exists anew: it holds
                                // `to` of its names as they are.
                                named.on_sent();
                                self.settle(current);
                                return Err(Wait::UpToDate);
                            }
                            upserts
                        }
                        _ => {
                            let upserts = named.selected(from.map(|s| &**s), &to);
                            if self.changes_only {
                                // The next selection is of what changed.
                                named.forget_selection();
                            }
                            upserts.into()
                        }
                    };
                    Push::Selected {
                        diff: Diff {
                            upserts,
                            removed: Vec::new(),
                        },
                        to,
                    }
                }
                _ => Push::Full { to },
            },
            (Mode::Incremental, Family::Xds) if !self.shared_first_or_diff() => {
                let named = self.named.as_deref().expect("shared without names");
                let diff = match &self.held {
                    Held::At(from) => named.changes_woken(Holds::Snapshot(from), &to, woken),
                    Held::Reported(reported) => named.changes(Holds::Reported(reported), &to),
                    Held::Version(_) | Held::AwaitingFirst { .. } => {
                        named.changes(Holds::Reported(&ReportedNames::default()), &to)
                    }
                };
                if diff.is_empty() {
                    // Nothing it asks for changed: it holds `to` as well.
                    self.settle(current);
                    return Err(Wait::UpToDate);
                }
                Push::Selected { to, diff }
            }
            (Mode::Incremental, family) => {
                // An MCP client's first response is answered before its diffs
                // can be: until then it holds what it reported.
                let first = |reported_names| match family {
                    Family::Mcp => Held::AwaitingFirst { reported_names },
                    // Replaced by what it is sent, once it is.
                    Family::Xds => Held::Reported(ReportedNames::default()),
                };
                match std::mem::replace(&mut self.held, first(false)) {
                    Held::At(from) => {
                        self.held = Held::At(from.clone());
                        Push::Diff { from, to }
                    }
                    Held::Reported(reported) if !reported.is_empty() => {
                        self.held = first(true);
                        Push::FirstFromReported { to, reported }
                    }
                    Held::Reported(_) | Held::Version(_) | Held::AwaitingFirst { .. } => Push::Full { to },
                }
            }
        };
        self.note_carried(&push);
        Ok(push)
    }

    /// While its last response is refused (NACKed, nothing ACKed since):
    /// what it last ACKed and that response; what the one adds or changes
    /// over the other the client may not hold. `None`: not known here
    /// (nothing ACKed, or the ACKed snapshot not kept).
    pub fn refused_between(&self) -> Option<(&Arc<CollectionSnapshot>, &Arc<CollectionSnapshot>)> {
        self.pending_nack()?;
        let base = if self.holds_what_was_sent() {
            self.acked.as_ref()?
        } else {
            match &self.held {
                Held::At(acked) => acked,
                _ => return None,
            }
        };
        Some((base, self.sent.as_ref()?))
    }

    /// Delta xDS, the source changed after a NACK: the client holds what it
    /// ACKed, and of the refused response any part (Envoy's CDS applies the
    /// valid clusters of a response it rejects, and its removals). So the
    /// next response goes from what it ACKed, and carries again every name
    /// the refused one carried: a refused cluster the fix left as it was is
    /// sent with it (not taken as held), and one it took and the source
    /// reverted goes back.
    fn revert_after_nack(&mut self) {
        self.revert_pending = false;
        let carried: Vec<SharedStr> = match (&self.acked, &self.sent) {
            (Some(acked), Some(sent)) => {
                let diff = Diff::between(&acked.resources, &sent.resources);
                diff.upserts
                    .iter()
                    .map(|r| r.name.clone())
                    .chain(diff.removed.iter().cloned())
                    .collect()
            }
            // Nothing ACKed on this stream: all the refused one carried.
            (None, Some(sent)) => sent.resources.keys().cloned().collect(),
            _ => Vec::new(),
        };
        self.held = match &self.acked {
            Some(acked) => Held::At(acked.clone()),
            None => Held::Reported(ReportedNames::default()),
        };
        self.force_resend(carried.iter());
    }

    /// Delta xDS: what `push` carries, for the NACK memory.
    fn note_carried(&mut self, push: &Push) {
        if !self.holds_what_was_sent() || !self.remembers_nacks {
            return;
        }
        self.carried = Some(match push {
            Push::Selected { diff, .. } => Carried::Names(
                diff.upserts
                    .iter()
                    .map(|r| r.name.clone())
                    .chain(diff.removed.iter().cloned())
                    .collect(),
            ),
            Push::Diff { from, .. } => Carried::Between(from.clone()),
            Push::Full { .. } | Push::FirstFromReported { .. } => Carried::Everything,
        });
    }

    /// The first response to a reconnecting client whose report is trusted:
    /// `None` when it is decided as for any other client (a state-of-the-
    /// world client naming resources, or one at another version: counted).
    fn first_on_trust(
        &mut self,
        reconnect: &Reconnect,
        current: &Arc<CollectionSnapshot>,
    ) -> Option<Result<Push, Wait>> {
        let to = current.clone();
        let mut tally = ReconnectTally::default();
        let decided = match (self.mode, self.family, &self.held) {
            (Mode::Full, Family::Xds, Held::Version(version)) => {
                // A version names the whole collection; a subscription's
                // names may have changed after the version it reports (a
                // name asked for just before the gateway went away), so a
                // named client is answered (as go-control-plane does).
                if self.named.as_deref().is_some_and(|n| !n.current().wildcard) {
                    return None;
                }
                let resources = current.resources.len() as u64;
                if **version == *current.version && reconnect.trusts_everything() {
                    tally.skipped = resources;
                    if let Some(named) = self.named.as_deref_mut() {
                        named.on_sent();
                    }
                    self.settle(current);
                    // It holds the version it reported: shown as sent and
                    // ACKed (SYNCED), not as never sent.
                    self.view.last_sent_version = Some(current.version.clone());
                    self.tally = Some(tally);
                    return Some(Err(Wait::UpToDate));
                }
                let reason = if **version != *current.version {
                    ResendReason::Changed
                } else if !reconnect.nacked.is_nothing() {
                    ResendReason::Nacked
                } else {
                    ResendReason::Forced
                };
                tally.count(reason, resources);
                self.tally = Some(tally);
                return None;
            }
            (Mode::Incremental, Family::Xds, Held::Reported(reported)) => {
                let trust = Trust::new(reported, reconnect);
                let (diff, tally) = if self.shared_first_or_diff() {
                    let diff = Diff {
                        upserts: current
                            .resources
                            .values()
                            .filter(|r| !trust.holds(r))
                            .cloned()
                            .collect(),
                        removed: gone(reported, current),
                    };
                    let tally = trust.tally(current, |_| true, &diff);
                    (diff, tally)
                } else {
                    let named = self.named.as_deref().expect("not shared: named");
                    let diff = named.changes(Holds::Trusting(reported, &trust), current);
                    let tally = trust.tally(current, |n| named.current().covers(n), &diff);
                    (diff, tally)
                };
                self.tally = Some(tally);
                // Answered even when nothing is to be sent: an empty response
                // is its first answer (the client ACKs it, and holds `to`).
                Push::Selected { to, diff }
            }
            _ => return None,
        };
        self.held = Held::Reported(ReportedNames::default());
        self.note_carried(&decided);
        Some(Ok(decided))
    }

    /// Delta xDS: whether the response is the shared one (the whole
    /// collection, from reported names, or the diff every client at the
    /// same version gets), not one of the client's own names.
    fn shared_first_or_diff(&self) -> bool {
        self.named.as_deref().is_none_or(|named| match self.held {
            Held::At(_) => named.is_everything(),
            _ => named.first_is_shared(),
        })
    }

    /// Whether `current` differs, in what the client asks for, from what it
    /// was last sent (or, before anything was sent, from what it reported).
    fn differs_from_sent(&self, current: &CollectionSnapshot) -> bool {
        let from = match (last_sent(&self.sent, &self.held), &self.held) {
            (Some(sent), _) => sent,
            // A reconnecting client's word: an MCP sink holds what it ACKed;
            // an xDS client that applied part of a response it NACKed holds
            // something else, which the version it names does not show.
            (None, Held::Version(version)) => return self.family == Family::Xds || *version != current.version,
            (None, _) => return true,
        };
        if from.version == current.version {
            return false;
        }
        match self.named.as_deref() {
            // What it is sent is what changed: the response finds that once
            // (and settles when it is nothing), not a look here first.
            Some(named) if !named.current().wildcard && self.sends_changes_now() => true,
            Some(named) if !named.current().wildcard => named.touched(from, current),
            _ => true,
        }
    }

    /// Nothing it asks for differs in `current` from what it was sent: it
    /// holds `current` as well, and unless its last answer was a NACK, it is
    /// shown at that version.
    fn settle(&mut self, current: &Arc<CollectionSnapshot>) {
        if self.sent.as_ref().is_some_and(|sent| sent.version == current.version) {
            return;
        }
        if let Some(sent) = &mut self.sent {
            if let Some(named) = self.named.as_deref_mut() {
                named.untouched_since(&sent.version, &current.version);
            }
            *sent = current.clone();
        }
        let nacked = self.nack_pending();
        if !nacked || self.holds_what_was_sent() {
            self.held = Held::At(current.clone());
        }
        if !nacked {
            self.view.acked_version = Some(current.version.clone());
            // Held without a response (a reconnect at the current version):
            // shown as sent and ACKed, not as never sent.
            if self.view.last_sent_version.is_none() {
                self.view.last_sent_version = Some(current.version.clone());
            }
        }
    }

    /// Delta xDS: the client holds what it was sent, NACK or not.
    fn holds_what_was_sent(&self) -> bool {
        self.mode == Mode::Incremental && self.family == Family::Xds
    }

    /// The response chosen by [`Self::next`] went out with `nonce`.
    /// Notes whether the client is behind `current` (the cache's snapshot),
    /// and since when (`now` if it just fell behind); true when that changed.
    pub fn note_current(&mut self, current: Option<&Arc<CollectionSnapshot>>, now: Stamp) -> bool {
        let behind = current.is_some_and(|c| self.view.acked_version.as_ref() != Some(&c.version));
        let since = match (behind, self.view.behind_since.is_never()) {
            (false, _) => Stamp::NEVER,
            (true, true) => now,
            (true, false) => self.view.behind_since,
        };
        std::mem::replace(&mut self.view.behind_since, since) != since
    }

    /// The response chosen by [`Self::next`] went out with `nonce` at `at`.
    pub fn sent_at(&mut self, nonce: Nonce, to: Arc<CollectionSnapshot>, at: Stamp) {
        self.view.last_sent_at = at;
        self.sent(nonce, to);
    }

    pub fn sent(&mut self, nonce: Nonce, to: Arc<CollectionSnapshot>) {
        if let Some(named) = &mut self.named {
            named.on_sent();
        }
        if self.holds_what_was_sent() {
            self.held = Held::At(to.clone());
        }
        self.view.outstanding = true;
        self.view.last_sent_nonce = Some(nonce);
        self.view.last_sent_version = Some(to.version.clone());
        self.sent = Some(to);
    }
}

/// The names `reported` holds that `to` does not, sorted, once each.
fn gone(reported: &ReportedNames, to: &CollectionSnapshot) -> Vec<SharedStr> {
    super::encode::gone(reported, to)
        .into_iter()
        .map(SharedStr::from)
        .collect()
}

/// The snapshot a client was last sent (or, after a reconnect whose first
/// response it took, holds), if it is known; a free function so that the
/// caller may hold the type's names mutably beside it.
fn last_sent<'a>(sent: &'a Option<Arc<CollectionSnapshot>>, held: &'a Held) -> Option<&'a Arc<CollectionSnapshot>> {
    match (sent, held) {
        (Some(sent), _) | (None, Held::At(sent)) => Some(sent),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Cache, CacheWriter, CachedResource, Origin, Update};
    use crate::collections::{Dialect, Resolved};
    use crate::downstream::names::{NameChange, WILDCARD as WILDCARD_NAME};

    const C: &str = "c";

    /// Each resource's body is its name.
    fn snapshot(cache: &Cache, writer: &mut CacheWriter, names: &[&str]) -> Arc<CollectionSnapshot> {
        let entries: Vec<(&str, &str)> = names.iter().map(|n| (*n, *n)).collect();
        with_bodies(cache, writer, &entries)
    }

    fn state(mode: Mode, held: Held) -> TypeState {
        family_state(Family::Mcp, mode, held)
    }

    fn family_state(family: Family, mode: Mode, held: Held) -> TypeState {
        TypeState::new(
            TypeView::new(Resolved {
                collection: C.into(),
                dialect: Dialect::V1_1,
            }),
            mode,
            family,
            held,
        )
    }

    fn nothing() -> Held {
        Held::Reported(ReportedNames::default())
    }

    /// The nonce a stream writes as its `count`th response's.
    fn nonce_of(count: u64) -> Nonce {
        count.to_string().parse().expect("a nonce")
    }

    fn nack(_version: &str) -> Option<Nack> {
        Some(Nack {
            code: 3,
            message: "bad".into(),
        })
    }

    /// Sends what `next` decides and returns its kind.
    fn step(
        state: &mut TypeState,
        current: Option<&Arc<CollectionSnapshot>>,
        nonce: &str,
    ) -> Result<&'static str, Wait> {
        let send = state.next(current)?;
        let kind = match &send {
            Push::Full { .. } => "full",
            Push::Diff { .. } => "diff",
            Push::FirstFromReported { .. } => "first",
            Push::Selected { .. } => "selected",
        };
        state.sent(nonce.parse().expect("a nonce"), send.to().clone());
        Ok(kind)
    }

    #[test]
    fn nothing_is_invented_before_the_source_delivers() {
        for mode in [Mode::Full, Mode::Incremental] {
            let mut s = state(mode, nothing());
            assert_eq!(s.next(None).unwrap_err(), Wait::NotDelivered);
        }
    }

    #[test]
    fn the_protocol_rules_as_a_table() {
        let (cache, mut writer) = Cache::new();
        let v1 = snapshot(&cache, &mut writer, &["a"]);
        let v2 = snapshot(&cache, &mut writer, &["a", "b"]);
        let v3 = snapshot(&cache, &mut writer, &["b"]);
        // (mode, held at start, script) where each step is a request or a
        // decision against a current snapshot, with what must happen.
        enum Step<'a> {
            Next(&'a Arc<CollectionSnapshot>, Result<&'static str, Wait>),
            Req(&'a str, Option<&'a str>, Verdict),
        }
        use Step::*;
        let v1v = v1.version.to_string();
        let v2v = v2.version.to_string();
        let cases: Vec<(&str, Mode, Held, Vec<Step>)> = vec![
            (
                "state of the world: send, ACK, change, send",
                Mode::Full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Next(&v2, Err(Wait::Outstanding)),
                    Req("1", None, Verdict::Ack),
                    Next(&v1, Err(Wait::UpToDate)),
                    Next(&v2, Ok("full")),
                ],
            ),
            (
                "a stale nonce is ignored and keeps the response outstanding",
                Mode::Full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("other", None, Verdict::Stale { expected: "1".into() }),
                    Next(&v2, Err(Wait::Outstanding)),
                ],
            ),
            (
                "a NACKed version is held, the next one is sent",
                Mode::Full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Some(&v1v), Verdict::Nack),
                    Next(&v1, Err(Wait::Nacked)),
                    Next(&v2, Ok("full")),
                ],
            ),
            (
                "a reconnecting client at the current version gets nothing",
                Mode::Full,
                Held::Version(v2.version.clone()),
                vec![Next(&v2, Err(Wait::UpToDate)), Next(&v3, Ok("full"))],
            ),
            (
                "incremental: from nothing the whole collection, then diffs from the ACKed state",
                Mode::Incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", None, Verdict::Ack),
                    Next(&v2, Ok("diff")),
                ],
            ),
            (
                "incremental: the first response from reported names, then diffs",
                Mode::Incremental,
                Held::Reported(ReportedNames::new(["a", "gone"])),
                vec![
                    Next(&v1, Ok("first")),
                    Req("1", None, Verdict::Ack),
                    Next(&v1, Err(Wait::UpToDate)),
                    Next(&v2, Ok("diff")),
                ],
            ),
            (
                "incremental: a NACK of the first response built from reported names cannot be recovered",
                Mode::Incremental,
                Held::Reported(ReportedNames::new(["gone"])),
                vec![Next(&v1, Ok("first")), Req("1", Some(&v1v), Verdict::Unrecoverable)],
            ),
            (
                "incremental: a NACK of a first response from nothing: the whole collection again",
                Mode::Incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Some(&v1v), Verdict::Nack),
                    Next(&v1, Err(Wait::Nacked)),
                    Next(&v2, Ok("full")),
                ],
            ),
            (
                "incremental: after a NACK the next diff is from the ACKed state",
                Mode::Incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", None, Verdict::Ack),
                    Next(&v2, Ok("diff")),
                    Req("2", Some(&v2v), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    Next(&v3, Ok("diff")),
                ],
            ),
        ];
        for (what, mode, held, steps) in cases {
            let mut s = state(mode, held);
            let mut nonce = 0;
            for (i, step) in steps.into_iter().enumerate() {
                match step {
                    Next(current, expected) => {
                        nonce += 1;
                        let got = step_with(&mut s, current, &format!("{nonce}"));
                        assert_eq!(got, expected, "{what}: step {i}");
                    }
                    Req(nonce, nacked, expected) => {
                        let verdict = s.on_request(Request::new(nonce, nacked.and_then(nack)));
                        assert_eq!(verdict, expected, "{what}: step {i}");
                    }
                }
            }
        }

        fn step_with(s: &mut TypeState, current: &Arc<CollectionSnapshot>, nonce: &str) -> Result<&'static str, Wait> {
            step(s, Some(current), nonce)
        }
    }

    /// The rules on a client's failure paths, per protocol family: what a
    /// client holds after a NACK, and how subscription changes are answered.
    #[test]
    fn failure_paths_per_family_as_a_table() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        // "a" broken.
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1")]);
        // And a new "c", which nobody named asks for.
        let v3 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1"), ("c", "1")]);
        // "a" broken and "b" changed, fine.
        let v4 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "2")]);
        // "a" fixed, "b" as in v4.
        let v5 = with_bodies(&cache, &mut writer, &[("a", "3"), ("b", "2")]);
        // Content-derived versions: the same content is the same version.
        let reverted = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        assert_eq!(reverted.version, v1.version);
        let version = |v: &Arc<CollectionSnapshot>| v.version.to_string();
        let (v1v, v2v, v3v) = (version(&v1), version(&v2), version(&v3));

        /// What a request says.
        #[derive(Clone, Copy)]
        enum Says<'a> {
            /// An answer, and for xDS state of the world the version it names.
            Ack(Option<&'a str>),
            Nack(Option<&'a str>),
            /// State of the world: these names, with this version.
            Names(Option<&'a str>, &'a [&'a str]),
            /// Delta: subscribe these.
            Subscribe(&'a [&'a str]),
        }
        enum Step<'a> {
            Req(&'a str, Says<'a>, Verdict),
            /// What is sent (with the next nonce) against this snapshot, as
            /// [`described`] says it.
            Next(&'a Arc<CollectionSnapshot>, Result<&'a str, Wait>),
            /// The version the views show the client at, and whether they
            /// show its NACK as current.
            Shown(Option<&'a Arc<CollectionSnapshot>>, bool),
        }
        use Says::*;
        use Step::*;
        let held_at = |snapshot: &Arc<CollectionSnapshot>, names: &[&str]| {
            let versions: Vec<(String, String)> = names
                .iter()
                .map(|n| (n.to_string(), snapshot.resources[*n].content_version()))
                .collect();
            Held::Reported(ReportedNames::with_versions(
                versions.iter().map(|(n, v)| (n.as_str(), v.as_str())),
            ))
        };
        let (xds, mcp) = (Family::Xds, Family::Mcp);
        let (full, incremental) = (Mode::Full, Mode::Incremental);
        let cases: Vec<(&str, Family, Mode, Held, Vec<Step>)> = vec![
            (
                "state of the world, xDS: a revert to the ACKed version after a NACK is sent (the client applied part)",
                xds,
                full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(Some(&v1v)), Verdict::Ack),
                    Next(&v2, Ok("full")),
                    Req("2", Nack(Some(&v1v)), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    Shown(Some(&v1), true),
                    Next(&reverted, Ok("full")),
                    Req("3", Ack(Some(&v1v)), Verdict::Ack),
                    Shown(Some(&v1), false),
                ],
            ),
            (
                "state of the world, MCP: the same revert is sent (harmless to a client that rejected whole)",
                mcp,
                full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("full")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&reverted, Ok("full")),
                    Req("3", Ack(None), Verdict::Ack),
                    Next(&reverted, Err(Wait::UpToDate)),
                ],
            ),
            (
                "MCP incremental: after a NACK, diffs are from the ACKed state; a revert is an empty diff to ACK",
                mcp,
                incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("diff +a")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    Next(&v3, Ok("diff +a +c")),
                    Req("3", Nack(None), Verdict::Nack),
                    Next(&reverted, Ok("diff")),
                    Req("4", Ack(None), Verdict::Ack),
                    Shown(Some(&v1), false),
                ],
            ),
            (
                "delta: after a NACK, the next change goes from what it ACKed with the NACKed names again (Envoy applies the valid part of a response it refuses: a refused resource is not held)",
                xds,
                incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("diff +a")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    Next(&v3, Ok("+a +c")),
                    Req("3", Ack(None), Verdict::Ack),
                    Shown(Some(&v3), false),
                ],
            ),
            (
                "delta: a revert after a NACK sends the NACKed names again, as the ACKed version has them",
                xds,
                incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("diff +a")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&reverted, Ok("+a")),
                ],
            ),
            (
                "delta, partial acceptance: after a NACK of a response that changed a (broken) and b, the fix sends both again (it may hold either)",
                xds,
                incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v4, Ok("diff +a +b")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&v5, Ok("+a +b")),
                ],
            ),
            (
                "state of the world, xDS, named: a change of names after a NACK, with the last ACKed version and the NACKed nonce, is not an ACK; the new names are answered at the NACKed version",
                xds,
                full,
                nothing(),
                vec![
                    Req("", Names(None, &["a"]), Verdict::First),
                    Next(&v1, Ok("+a")),
                    Req("1", Names(Some(&v1v), &["a"]), Verdict::Ack),
                    Next(&v2, Ok("+a")),
                    Req("2", Nack(Some(&v1v)), Verdict::Nack),
                    Req("2", Names(Some(&v1v), &["a", "b"]), Verdict::Subscription),
                    Shown(Some(&v1), true),
                    Next(&v2, Ok("+a +b")),
                    Req("3", Names(Some(&v2v), &["a", "b"]), Verdict::Ack),
                    Shown(Some(&v2), false),
                ],
            ),
            (
                "state of the world, xDS, named: routing away from a NACKed name (its names replaced)",
                xds,
                full,
                nothing(),
                vec![
                    Req("", Names(None, &["a"]), Verdict::First),
                    Next(&v2, Ok("+a")),
                    Req("1", Nack(None), Verdict::Nack),
                    Req("1", Names(None, &["b"]), Verdict::Subscription),
                    Next(&v2, Ok("+b")),
                    Req("2", Names(Some(&v2v), &["b"]), Verdict::Ack),
                    Shown(Some(&v2), false),
                ],
            ),
            (
                "state of the world, xDS: a request naming the outstanding response's nonce with another version is not its ACK",
                xds,
                full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(Some("another")), Verdict::Repeat),
                    Next(&v2, Err(Wait::Outstanding)),
                    Req("1", Ack(Some(&v1v)), Verdict::Ack),
                    Req("1", Ack(Some(&v1v)), Verdict::Repeat),
                ],
            ),
            (
                "named: a change to names it does not ask for sends nothing, and shows it at the new version",
                xds,
                full,
                nothing(),
                vec![
                    Req("", Names(None, &["a", "b"]), Verdict::First),
                    Next(&v2, Ok("+a +b")),
                    Req("1", Names(Some(&v2v), &["a", "b"]), Verdict::Ack),
                    Next(&v3, Err(Wait::UpToDate)),
                    Shown(Some(&v3), false),
                ],
            ),
            (
                "named: after a NACK, a change it does not ask for sends nothing and leaves the NACK shown",
                xds,
                full,
                nothing(),
                vec![
                    Req("", Names(None, &["a"]), Verdict::First),
                    Next(&v1, Ok("+a")),
                    Req("1", Names(Some(&v1v), &["a"]), Verdict::Ack),
                    Next(&v2, Ok("+a")),
                    Req("2", Nack(Some(&v1v)), Verdict::Nack),
                    Next(&v3, Err(Wait::UpToDate)),
                    Shown(Some(&v1), true),
                    Next(&v5, Ok("+a")),
                ],
            ),
            (
                "delta: a re-subscribe of a name the client has is answered, even at a NACKed version",
                xds,
                incremental,
                nothing(),
                vec![
                    Req("", Subscribe(&["a"]), Verdict::First),
                    Next(&v1, Ok("+a")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("+a")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    Req("", Subscribe(&["a"]), Verdict::Subscription),
                    Next(&v2, Ok("+a")),
                ],
            ),
            (
                "delta: a reconnect reporting what it held before a NACK is sent everything (its versions are what it ACKed, not what it holds); a NACK of that first response is recoverable",
                xds,
                incremental,
                held_at(&v1, &["a", "b"]),
                vec![
                    Next(&v2, Ok("first")),
                    Req("1", Nack(None), Verdict::Nack),
                    Next(&v2, Err(Wait::Nacked)),
                    // Nothing ACKed on this stream: everything.
                    Next(&v3, Ok("full")),
                ],
            ),
            (
                "state of the world, xDS: a client reconnecting at the current version is sent it (it may hold part of a response it NACKed)",
                xds,
                full,
                Held::Version(v1.version.clone()),
                vec![Next(&v1, Ok("full")), Req("1", Ack(Some(&v1v)), Verdict::Ack)],
            ),
            (
                "state of the world, MCP: a sink reconnecting at the current version gets nothing (it holds what it ACKed)",
                mcp,
                full,
                Held::Version(v1.version.clone()),
                vec![Next(&v1, Err(Wait::UpToDate)), Next(&v2, Ok("full"))],
            ),
            (
                "a NACKed version that comes back after the client ACKed a later one is a change: sent",
                xds,
                full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(Some(&v1v)), Verdict::Ack),
                    Next(&v2, Ok("full")),
                    Req("2", Nack(Some(&v1v)), Verdict::Nack),
                    Next(&v3, Ok("full")),
                    Req("3", Ack(Some(&v3v)), Verdict::Ack),
                    Next(&v2, Ok("full")),
                ],
            ),
            (
                "delta: a change undone after a NACK and an ACK is sent (the removal of what was added since)",
                xds,
                incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("1", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("diff +a")),
                    Req("2", Nack(None), Verdict::Nack),
                    Next(&v3, Ok("+a +c")),
                    Req("3", Ack(None), Verdict::Ack),
                    Next(&v2, Ok("diff -c")),
                ],
            ),
            (
                "MCP incremental: a NACK of the first response built from reported names cannot be recovered",
                mcp,
                incremental,
                held_at(&v1, &["a", "b"]),
                vec![Next(&v2, Ok("first")), Req("1", Nack(None), Verdict::Unrecoverable)],
            ),
        ];
        for (what, family, mode, held, steps) in cases {
            let mut s = family_state(family, mode, held);
            let mut nonce = 0;
            let mut names_asked = NameList::new();
            for (i, step) in steps.into_iter().enumerate() {
                match step {
                    Next(current, expected) => {
                        let got = s.next(Some(current)).map(|push| {
                            nonce += 1;
                            let said = described(&push);
                            s.sent(nonce_of(nonce), push.to().clone());
                            said
                        });
                        assert_eq!(got.as_deref(), expected.as_ref().map(|e| *e), "{what}: step {i}");
                    }
                    Req(nonce, says, expected) => {
                        // State of the world repeats its names on every
                        // request; delta says only what changes.
                        if let Names(_, asked) = says {
                            names_asked = self::names(asked);
                        }
                        let subscribe = match says {
                            Subscribe(asked) => self::names(asked),
                            _ => NameList::new(),
                        };
                        let names = match mode {
                            Mode::Full => NameChange::Replace(&names_asked),
                            Mode::Incremental => NameChange::Change {
                                subscribe: &subscribe,
                                unsubscribe: &NO_NAMES,
                            },
                        };
                        let (version, nacked) = match says {
                            Ack(version) | Names(version, _) => (version, None),
                            Nack(version) => (version, nack("")),
                            Subscribe(_) => (None, None),
                        };
                        let request = Request {
                            version,
                            names,
                            ..Request::new(nonce, nacked)
                        };
                        assert_eq!(s.on_request(request), expected, "{what}: step {i}");
                    }
                    Shown(at, nacked) => {
                        let acked = s.view.acked_version.clone();
                        assert_eq!(
                            acked,
                            at.map(|v| v.version.clone()),
                            "{what}: step {i}: the version shown"
                        );
                        assert_eq!(s.nack_pending(), nacked, "{what}: step {i}: the NACK shown");
                    }
                }
            }
        }

        /// A push as the table says it: `full`, `first`, `diff` with what it
        /// carries, or a response of its own (`+a -b`).
        fn described(push: &Push) -> String {
            let listed = |diff: &Diff| {
                let upserts = diff.upserts.iter().map(|r| format!(" +{}", r.name));
                let removed = diff.removed.iter().map(|n| format!(" -{n}"));
                upserts.chain(removed).collect::<String>()
            };
            match push {
                Push::Full { .. } => "full".into(),
                Push::FirstFromReported { .. } => "first".into(),
                Push::Diff { from, to } => format!("diff{}", listed(&Diff::between(&from.resources, &to.resources))),
                Push::Selected { diff, .. } => listed(diff).trim_start().to_owned(),
            }
        }
    }

    /// What a client reports holding: each name at `snapshot`'s content
    /// version, or at `version` where given.
    fn reporting(snapshot: &CollectionSnapshot, names: &[(&str, Option<&str>)]) -> Held {
        let versions: Vec<(String, String)> = names
            .iter()
            .map(|(n, v)| {
                let version = v.map_or_else(|| snapshot.resources[*n].content_version(), str::to_owned);
                (n.to_string(), version)
            })
            .collect();
        Held::Reported(ReportedNames::with_versions(
            versions.iter().map(|(n, v)| (n.as_str(), v.as_str())),
        ))
    }

    /// An ACK (or NACK) of the outstanding response as the client's
    /// protocol says it: state of the world repeats its names and the
    /// version; delta changes nothing.
    fn answer(s: &mut TypeState, nonce: &str, nacked: bool) -> Verdict {
        let asked: NameList = s
            .named()
            .map(|n| {
                let names = n.current().names.iter().map(|n| &**n);
                NameList::from_names(n.current().wildcard.then_some(WILDCARD_NAME).into_iter().chain(names))
            })
            .unwrap_or_default();
        let version = s.view.last_sent_version.clone();
        let (names, version) = match s.mode() {
            Mode::Full => (NameChange::Replace(&asked), version.as_deref()),
            Mode::Incremental => (
                NameChange::Change {
                    subscribe: &NO_NAMES,
                    unsubscribe: &NO_NAMES,
                },
                None,
            ),
        };
        s.on_request(Request {
            names,
            version,
            ..Request::new(nonce, nacked.then(|| nack("")).flatten())
        })
    }

    fn nameset(names: &[&str]) -> Unheld {
        Unheld::Names(names.iter().map(|&n| SharedStr::from(n)).collect())
    }

    /// A delta client subscribing `asked` (nothing: legacy wildcard) on its
    /// first request, reporting `held`, trusted less `nacked`.
    fn reconnecting(asked: &[&str], held: Held, nacked: Unheld) -> TypeState {
        let mut s = family_state(Family::Xds, Mode::Incremental, held).trusting_reported(nacked);
        let asked = names(asked);
        let request = Request {
            names: NameChange::Change {
                subscribe: &asked,
                unsubscribe: &NO_NAMES,
            },
            ..Request::new("", None)
        };
        assert_eq!(s.on_request(request), Verdict::First);
        s
    }

    /// The first response's names sent and removed, and its tally.
    fn first(s: &mut TypeState, current: &Arc<CollectionSnapshot>) -> ((Vec<String>, Vec<String>), ReconnectTally) {
        let push = send(s, current, "1");
        let (sent, removed) = selected(&push);
        let listed = (
            sent.iter().map(|n| n.to_string()).collect(),
            removed.iter().map(|n| n.to_string()).collect(),
        );
        (
            listed,
            s.take_reconnect_tally().expect("a first response on trust is tallied"),
        )
    }

    /// A reconnecting delta client (Envoy's `initial_resource_versions`,
    /// content versions being the same on every replica and after a
    /// restart) is sent only what it does not hold at the current content:
    /// not what it reports at another version, nor what a response it
    /// NACKed carried (its versions lag what it holds), nor what a cluster
    /// sent on the stream forces; a name it reports that is gone is
    /// removed; an empty response answers it when nothing is owed.
    #[test]
    fn a_reconnecting_delta_client_is_sent_only_what_it_does_not_hold() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1"), ("d", "1")]);
        let all: &[(&str, Option<&str>)] = &[("a", None), ("b", None), ("c", None)];
        let tally = |skipped, changed, nacked, forced| ReconnectTally {
            skipped,
            changed,
            nacked,
            forced,
        };
        let none: (Vec<String>, Vec<String>) = (vec![], vec![]);
        let strings = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();

        // Named (Envoy's EDS and RDS): all held, nothing resent.
        let mut s = reconnecting(&["a", "b", "c"], reporting(&v1, all), Unheld::Nothing);
        assert_eq!(first(&mut s, &v1), (none.clone(), tally(3, 0, 0, 0)));
        assert_eq!(answer(&mut s, "1", false), Verdict::Ack);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1"), ("c", "1"), ("d", "1")]);
        assert_eq!(
            selected(&send(&mut s, &v2, "2")),
            (vec!["a"], vec![]),
            "then its changes"
        );

        // One at another version, one gone, one asked for and not reported.
        let stale = &[("a", Some("0000000000000001")), ("b", None), ("gone", Some("0"))];
        let mut s = reconnecting(&["a", "b", "c", "gone"], reporting(&v1, stale), Unheld::Nothing);
        assert_eq!(
            first(&mut s, &v1),
            ((strings(&["a", "c"]), strings(&["gone"])), tally(1, 1, 0, 0))
        );

        // A response it NACKed before carried "b": sent again.
        let mut s = reconnecting(&["a", "b", "c"], reporting(&v1, all), nameset(&["b"]));
        assert_eq!(first(&mut s, &v1), ((strings(&["b"]), vec![]), tally(2, 0, 1, 0)));
        let mut s = reconnecting(&["a", "b", "c"], reporting(&v1, all), Unheld::Everything);
        assert_eq!(
            first(&mut s, &v1),
            ((strings(&["a", "b", "c"]), vec![]), tally(0, 0, 3, 0))
        );

        // A cluster sent before the first response forces its endpoints.
        let mut s = reconnecting(&["a", "b", "c"], reporting(&v1, all), Unheld::Nothing);
        let (c, elsewhere) = (SharedStr::from("c"), SharedStr::from("x"));
        assert_eq!(s.force_resend([&c, &elsewhere]), 1, "only what it asks for");
        assert_eq!(first(&mut s, &v1), ((strings(&["c"]), vec![]), tally(2, 0, 0, 1)));

        // Wildcard, naming nothing (CDS, LDS): the same, from the collection.
        let mut s = reconnecting(&[], reporting(&v1, all), Unheld::Nothing);
        assert_eq!(first(&mut s, &v1), ((strings(&["d"]), vec![]), tally(3, 0, 0, 0)));
        assert_eq!(answer(&mut s, "1", false), Verdict::Ack);
        assert!(matches!(send(&mut s, &v2, "2"), Push::Diff { .. }), "then shared diffs");

        // Untrusted (MCP, or --nack-memory 0s): everything, as before.
        let mut s = family_state(Family::Xds, Mode::Incremental, reporting(&v1, all));
        assert!(matches!(send(&mut s, &v1, "1"), Push::FirstFromReported { .. }));
        assert_eq!(s.take_reconnect_tally(), None);
    }

    /// A state-of-the-world client reconnecting with the current
    /// `version_info` is sent nothing when its subscription is the whole
    /// collection (CDS, LDS), unless it NACKed a response of the type or a
    /// resend was forced; a client naming resources is answered (its names
    /// may be newer than the version it reports).
    #[test]
    fn a_reconnecting_state_of_the_world_client_is_skipped_only_whole() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1")]);
        let at = |v: &Arc<CollectionSnapshot>| Held::Version(v.version.clone());
        let sotw = |held, nacked| family_state(Family::Xds, Mode::Full, held).trusting_reported(nacked);

        let mut s = sotw(at(&v1), Unheld::Nothing);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        assert_eq!(s.take_reconnect_tally().map(|t| t.skipped), Some(2));
        assert_eq!(s.view.acked_version.as_deref(), Some(&*v1.version));
        assert!(matches!(send(&mut s, &v2, "1"), Push::Full { .. }), "its next change");

        let mut s = sotw(at(&v1), nameset(&["a"]));
        assert!(matches!(send(&mut s, &v1, "1"), Push::Full { .. }), "it NACKed before");
        assert_eq!(s.take_reconnect_tally().map(|t| t.nacked), Some(2));

        let mut s = sotw(at(&v1), Unheld::Nothing);
        assert_eq!(s.force_resend([&SharedStr::from("a")]), 1);
        assert!(matches!(send(&mut s, &v1, "1"), Push::Full { .. }), "forced");

        let mut s = sotw(at(&v1), Unheld::Nothing);
        assert!(matches!(send(&mut s, &v2, "1"), Push::Full { .. }), "another version");
        assert_eq!(s.take_reconnect_tally().map(|t| t.changed), Some(2));

        let mut s = sotw(at(&v1), Unheld::Nothing);
        let asked = names(&["a"]);
        s.on_request(Request {
            version: Some(&v1.version),
            names: NameChange::Replace(&asked),
            ..Request::new("", None)
        });
        assert_eq!(
            selected(&send(&mut s, &v1, "1")),
            (vec!["a"], vec![]),
            "named: answered"
        );
    }

    /// `force_resend` after a client was served: what it asks for of the
    /// names goes with its next response, whatever it holds, in every form
    /// (the coordinator's make-before-break reuses it).
    #[test]
    fn forced_names_are_sent_again_with_the_next_response() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let (a, b, x) = (SharedStr::from("a"), SharedStr::from("b"), SharedStr::from("x"));
        let ask = |s: &mut TypeState, names: &[&str]| {
            let asked = self::names(names);
            let change = match s.mode() {
                Mode::Full => NameChange::Replace(&asked),
                Mode::Incremental => NameChange::Change {
                    subscribe: &asked,
                    unsubscribe: &NO_NAMES,
                },
            };
            s.on_request(Request {
                names: change,
                ..Request::new("", None)
            });
        };
        for mode in [Mode::Incremental, Mode::Full] {
            let mut s = family_state(Family::Xds, mode, nothing());
            ask(&mut s, &["a", "b"]);
            send(&mut s, &v1, "1");
            assert_eq!(answer(&mut s, "1", false), Verdict::Ack);
            assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
            assert_eq!(s.force_resend([&a, &x]), 1);
            let expected = match mode {
                Mode::Incremental => vec!["a"],
                Mode::Full => vec!["a", "b"],
            };
            assert_eq!(selected(&send(&mut s, &v1, "2")), (expected, vec![]), "{mode:?}");
            assert_eq!(answer(&mut s, "2", false), Verdict::Ack);
            assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate, "once");
        }
        // A delta client naming nothing.
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing());
        send(&mut s, &v1, "1");
        assert_eq!(answer(&mut s, "1", false), Verdict::Ack);
        assert_eq!(s.force_resend([&b]), 1);
        assert_eq!(selected(&send(&mut s, &v1, "2")), (vec!["b"], vec![]));
        assert_eq!(answer(&mut s, "2", false), Verdict::Ack);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
    }

    /// What a delta response carried is what a NACK of it leaves unknown
    /// (the NACK memory keeps it); a state-of-the-world response carries
    /// the whole type.
    #[test]
    fn a_nack_is_of_what_the_response_carried() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("c", "1")]);
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing()).remembering_nacks();
        assert_eq!(s.carried(), Unheld::Nothing);
        send(&mut s, &v1, "1");
        assert_eq!(s.carried(), Unheld::Everything, "the whole collection");
        answer(&mut s, "1", false);
        send(&mut s, &v2, "2");
        assert_eq!(answer(&mut s, "2", true), Verdict::Nack);
        assert_eq!(s.carried(), nameset(&["a", "b", "c"]), "changed, added, removed");
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing()).remembering_nacks();
        let asked = names(&["a"]);
        s.on_request(Request {
            names: NameChange::Change {
                subscribe: &asked,
                unsubscribe: &NO_NAMES,
            },
            ..Request::new("", None)
        });
        send(&mut s, &v2, "1");
        assert_eq!(s.carried(), nameset(&["a"]));
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing());
        send(&mut s, &v2, "1");
        assert_eq!(s.carried(), Unheld::Everything, "not kept: the whole type");
        let mut s = family_state(Family::Xds, Mode::Full, nothing());
        send(&mut s, &v1, "1");
        assert_eq!(s.carried(), Unheld::Everything);
    }

    #[test]
    fn any_nonce_is_accepted_before_anything_was_sent() {
        let mut s = state(Mode::Full, nothing());
        let verdict = s.on_request(Request::new("2021-09-09 06:45:36.069 +0000 UTC m=+0.51", None));
        assert_eq!(verdict, Verdict::First);
    }

    /// The names of a push's resources and removals.
    fn selected(push: &Push) -> (Vec<&str>, Vec<&str>) {
        match push {
            Push::Selected { diff, .. } => (
                diff.upserts.iter().map(|r| &*r.name).collect(),
                diff.removed.iter().map(|n| &**n).collect(),
            ),
            other => panic!("expected a response of its own, got {other:?}"),
        }
    }

    fn with_bodies(cache: &Cache, writer: &mut CacheWriter, entries: &[(&str, &str)]) -> Arc<CollectionSnapshot> {
        let resources = entries
            .iter()
            .map(|(n, body)| {
                let body = Bytes::from(body.to_string());
                let none = std::collections::HashMap::<String, String>::new();
                let digest = crate::cache::content_digest(&body, &none, &none);
                CachedResource::new((*n).into(), body, digest)
            })
            .collect();
        writer.apply(C, Update::Full(resources), Origin::Upstream);
        cache.get(C).unwrap()
    }

    fn names(names: &[&str]) -> NameList {
        NameList::from_names(names.iter().copied())
    }

    /// Names as a request carries them.
    fn wire(names: &[String]) -> NameList {
        NameList::from_names(names.iter().map(String::as_str))
    }

    /// Sends what `next` decides with nonce `nonce`; returns the push.
    fn send(s: &mut TypeState, current: &Arc<CollectionSnapshot>, nonce: &str) -> Push {
        let push = s.next(Some(current)).expect("something to send");
        s.sent(nonce.parse().expect("a nonce"), push.to().clone());
        push
    }

    #[test]
    fn state_of_the_world_names_replace_the_subscription() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let mut s = state(Mode::Full, nothing());
        let ask = |s: &mut TypeState, nonce: &str, asked: &[&str]| {
            let asked = names(asked);
            s.on_request(Request {
                names: NameChange::Replace(&asked),
                ..Request::new(nonce, None)
            })
        };
        assert_eq!(ask(&mut s, "", &["a", "ghost"]), Verdict::First);
        assert_eq!(selected(&send(&mut s, &v1, "1")), (vec!["a"], vec![]));
        assert_eq!(ask(&mut s, "1", &["a", "ghost"]), Verdict::Ack);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        // A new name with the same nonce (Envoy asks for a new route with
        // its last ACK): the new set, at the same version.
        assert_eq!(ask(&mut s, "1", &["a", "b"]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v1, "2")), (vec!["a", "b"], vec![]));
        // A change while a response is outstanding (a stale nonce) counts,
        // and is answered once the outstanding one is.
        assert_eq!(ask(&mut s, "1", &["c"]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::Outstanding);
        assert_eq!(ask(&mut s, "2", &["c"]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v1, "3")), (vec!["c"], vec![]));
        assert_eq!(ask(&mut s, "3", &["c"]), Verdict::Ack);
        // Once a name was asked for, an empty list is nothing, not everything:
        // names dropped need no response.
        assert_eq!(ask(&mut s, "3", &[]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        assert_eq!(ask(&mut s, "3", &["*"]), Verdict::Subscription);
        assert!(
            matches!(send(&mut s, &v1, "4"), Push::Full { .. }),
            "\"*\" is everything"
        );
        // A name dropped and asked for again is sent again (the client
        // dropped it too).
        let mut s = state(Mode::Full, nothing());
        assert_eq!(ask(&mut s, "", &["a", "b"]), Verdict::First);
        send(&mut s, &v1, "1");
        assert_eq!(ask(&mut s, "1", &["a", "b"]), Verdict::Ack);
        assert_eq!(ask(&mut s, "1", &["a"]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        assert_eq!(ask(&mut s, "1", &["a", "b"]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v1, "2")), (vec!["a", "b"], vec![]));

        // A client that names nothing is wildcard, and served the shared
        // response.
        let mut s = state(Mode::Full, nothing());
        assert_eq!(ask(&mut s, "", &[]), Verdict::First);
        assert!(matches!(send(&mut s, &v1, "1"), Push::Full { .. }));
        assert!(s.named().is_none());
    }

    #[test]
    fn delta_subscriptions_follow_envoys_rules() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let change = |s: &mut TypeState, nonce: &str, sub: &[&str], unsub: &[&str]| {
            let (sub, unsub) = (names(sub), names(unsub));
            s.on_request(Request {
                names: NameChange::Change {
                    subscribe: &sub,
                    unsubscribe: &unsub,
                },
                ..Request::new(nonce, None)
            })
        };
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing());
        assert_eq!(change(&mut s, "", &["a", "ghost"], &[]), Verdict::First);
        // A name that does not exist is removed, and stays subscribed.
        assert_eq!(selected(&send(&mut s, &v1, "1")), (vec!["a"], vec!["ghost"]));
        assert_eq!(change(&mut s, "1", &[], &[]), Verdict::Ack);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        // A change to a resource nobody here asked for: nothing to send.
        let v2 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "2"), ("c", "1")]);
        assert_eq!(s.next(Some(&v2)).unwrap_err(), Wait::UpToDate);
        // It appears: it is sent.
        let v3 = with_bodies(
            &cache,
            &mut writer,
            &[("a", "1"), ("b", "2"), ("c", "1"), ("ghost", "1")],
        );
        assert_eq!(selected(&send(&mut s, &v3, "2")), (vec!["ghost"], vec![]));
        assert_eq!(change(&mut s, "2", &[], &[]), Verdict::Ack);
        // A spontaneous subscription (no nonce) counts; a name the client
        // already has is sent again.
        assert_eq!(change(&mut s, "", &["a", "b"], &[]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v3, "3")), (vec!["a", "b"], vec![]));
        assert_eq!(change(&mut s, "3", &[], &[]), Verdict::Ack);
        // An unsubscription needs no response.
        assert_eq!(change(&mut s, "", &[], &["b", "never"]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v3)).unwrap_err(), Wait::UpToDate);
        // What it asks for changes and goes: a diff of what it holds.
        let v4 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "3"), ("c", "1")]);
        assert_eq!(selected(&send(&mut s, &v4, "4")), (vec!["a"], vec!["ghost"]));
        assert_eq!(change(&mut s, "4", &[], &[]), Verdict::Ack);
        // Wildcard beside names; a name unsubscribed that wildcard still
        // covers is sent again (the client may have dropped it).
        assert_eq!(change(&mut s, "", &["*"], &[]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v4, "5")), (vec!["b", "c"], vec![]));
        assert_eq!(change(&mut s, "5", &[], &["a"]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v4, "6")), (vec!["a"], vec![]));
        assert_eq!(change(&mut s, "6", &[], &[]), Verdict::Ack);
        // Wildcard and nothing owed: the shared diffs.
        let v5 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "3")]);
        let push = send(&mut s, &v5, "7");
        assert!(matches!(push, Push::Diff { .. }), "{push:?}");
    }

    #[test]
    fn a_new_name_after_a_nack_is_answered_and_the_nacked_content_is_not_resent() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        let mut s = family_state(Family::Xds, Mode::Incremental, nothing());
        let sub = names(&["a"]);
        fn request<'a>(nonce: &'a str, nack: Option<Nack>, subscribe: &'a NameList) -> Request<'a> {
            Request {
                names: NameChange::Change {
                    subscribe,
                    unsubscribe: &NO_NAMES,
                },
                ..Request::new(nonce, nack)
            }
        }
        assert_eq!(s.on_request(request("", None, &sub)), Verdict::First);
        send(&mut s, &v1, "1");
        assert_eq!(s.on_request(request("1", None, &NO_NAMES)), Verdict::Ack);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1")]);
        send(&mut s, &v2, "2");
        assert_eq!(s.on_request(request("2", nack("v2"), &NO_NAMES)), Verdict::Nack);
        // The new name at once, at the NACKed version; "a" was sent already.
        let b = names(&["b"]);
        assert_eq!(s.on_request(request("", None, &b)), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v2, "3")), (vec!["b"], vec![]));
        assert_eq!(s.on_request(request("3", None, &NO_NAMES)), Verdict::Ack);
        let v3 = with_bodies(&cache, &mut writer, &[("a", "3"), ("b", "1")]);
        assert_eq!(selected(&send(&mut s, &v3, "4")), (vec!["a"], vec![]));
    }

    /// A delta client's first request, subscribing to `names`.
    fn subscribe(s: &mut TypeState, names: &NameList) -> Verdict {
        s.on_request(Request {
            names: NameChange::Change {
                subscribe: names,
                unsubscribe: &NO_NAMES,
            },
            ..Request::new("", None)
        })
    }

    #[test]
    fn a_delta_reconnect_is_sent_everything_it_asks_for_and_the_removals_of_what_it_reports() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let held = |name: &str| v1.resources[name].content_version();
        let (ha, hb) = (held("a"), held("b"));
        let reported = ReportedNames::with_versions([("a", ha.as_str()), ("b", hb.as_str()), ("gone", "x")]);
        let mut s = family_state(Family::Xds, Mode::Incremental, Held::Reported(reported));
        let sub = names(&["*", "b"]);
        assert_eq!(subscribe(&mut s, &sub), Verdict::First);
        // "a" and "b" are reported at their versions, but what an xDS client
        // reports is what it last ACKed, not what it holds after a response
        // it applied in part: sent again, like "c"; "gone" is removed.
        assert_eq!(selected(&send(&mut s, &v1, "1")), (vec!["a", "b", "c"], vec!["gone"]));
    }

    /// The same by name only: a reported name it asks for is answered once,
    /// whether it exists (sent again) or is gone (removed), and a reported
    /// name it no longer asks for is removed where it is gone.
    #[test]
    fn a_named_delta_reconnect_answers_each_reported_name_once() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let ha = v1.resources["a"].content_version();
        let reported =
            ReportedNames::with_versions([("a", ha.as_str()), ("asked-gone", "x"), ("b", "old"), ("gone", "x")]);
        let mut s = family_state(Family::Xds, Mode::Incremental, Held::Reported(reported));
        let sub = names(&["a", "asked-gone", "c"]);
        assert_eq!(subscribe(&mut s, &sub), Verdict::First);
        assert_eq!(
            selected(&send(&mut s, &v1, "1")),
            (vec!["a", "c"], vec!["asked-gone", "gone"]),
            "b is reported but no longer asked for, and exists: neither sent nor removed"
        );
    }

    #[test]
    fn too_many_names_is_a_verdict() {
        let mut s = state(Mode::Full, nothing());
        let asked = names(&["a", "b", "c"]);
        let verdict = s.on_request(Request {
            names: NameChange::Replace(&asked),
            max_names: 2,
            ..Request::new("", None)
        });
        assert_eq!(verdict, Verdict::TooManyNames { count: 3 });
    }

    #[test]
    fn reported_names_round_trip() {
        let names = ReportedNames::new(["a", "", "ns/ü"]);
        assert_eq!(names.iter().collect::<Vec<_>>(), ["a", "", "ns/ü"]);
        assert!(ReportedNames::default().is_empty());
        let entries = ReportedNames::with_versions([("a", "1"), ("b", "")]);
        assert_eq!(entries.entries().collect::<Vec<_>>(), [("a", "1"), ("b", "")]);
        assert_eq!(entries.iter().collect::<Vec<_>>(), ["a", "b"]);
    }

    /// What a model-based run does to the client: a request or a decision
    /// against one of the snapshots.
    #[derive(Clone, Debug)]
    enum Op {
        /// What `next` decides against the snapshot at this index.
        Next(usize),
        Ack,
        Nack,
        /// State of the world: these names (and `"*"`); delta: subscribe them.
        Ask(Vec<u8>, bool),
        /// Delta: unsubscribe these (and `"*"`).
        Drop(Vec<u8>, bool),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let names = || proptest::collection::vec(0u8..8, 0..4);
        prop_oneof![
            4 => (0usize..64).prop_map(Op::Next),
            2 => Just(Op::Ack),
            1 => Just(Op::Nack),
            1 => (names(), proptest::bool::weighted(0.15)).prop_map(|(n, w)| Op::Ask(n, w)),
            1 => (names(), proptest::bool::weighted(0.15)).prop_map(|(n, w)| Op::Drop(n, w)),
        ]
    }

    /// Versions of a collection of eight names (r0 to r7, three bodies
    /// each, some gone), as a source would change them: consecutive ones
    /// share most of the tree, reverts come back to an earlier version,
    /// and beside them the versions the history rebuilds (a rollout's pins)
    /// and the empty answer of an overdue collection.
    fn versions(changes: &[Vec<(u8, u8)>]) -> Vec<Arc<CollectionSnapshot>> {
        let (cache, mut writer) = Cache::with_history(64);
        let resource = |n: u8, body: u8| {
            let body = Bytes::from(format!("r{n}@{body}"));
            let none = std::collections::HashMap::<String, String>::new();
            let digest = crate::cache::content_digest(&body, &none, &none);
            CachedResource::new(format!("r{n}").into(), body, digest)
        };
        writer.apply(
            C,
            Update::Full((0..8).map(|n| resource(n, 0)).collect()),
            Origin::Upstream,
        );
        let mut versions = vec![CollectionSnapshot::empty(C.into()), cache.get(C).unwrap()];
        for change in changes {
            let mut upserts = Vec::new();
            let mut removed = Vec::new();
            for &(n, what) in change {
                match what {
                    0 => removed.push(format!("r{n}")),
                    body => upserts.push(resource(n, body)),
                }
            }
            writer.apply(C, Update::Incremental { upserts, removed }, Origin::Upstream);
            versions.push(cache.get(C).unwrap());
        }
        let pinned: Vec<Arc<CollectionSnapshot>> = versions[1..]
            .iter()
            .filter_map(|v| cache.version_snapshot(C, &v.version))
            .collect();
        versions.extend(pinned);
        versions
    }

    /// A name's content in a snapshot, as a client sees it.
    fn content_of(snapshot: &CollectionSnapshot, name: &str) -> Option<String> {
        snapshot
            .resources
            .get(name)
            .map(|r| format!("{}#{}", r.content_version(), r.encoded.len()))
    }

    /// A named state-of-the-world client, through any sequence of name
    /// changes (wildcard on and off, names that appear later or go), ACKs,
    /// NACKs and versions (changes, reverts, pins back to an older version,
    /// an overdue collection's empty answer): every response of its own is
    /// exactly its names in that version, and nothing is sent (or held back)
    /// unless its names' content differs from its last response's.
    #[test]
    fn a_named_state_of_the_world_client_is_sent_its_names_exactly_and_only_on_a_change() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(256), |(
            changes in proptest::collection::vec(proptest::collection::vec((0u8..8, 0u8..3), 1..4), 1..8),
            ops in proptest::collection::vec(op(), 1..40),
            family in proptest::bool::ANY,
        )| {
            let versions = versions(&changes);
            let family = if family { Family::Xds } else { Family::Mcp };
            let mut s = family_state(family, Mode::Full, nothing());
            let mut asked: Vec<String> = Vec::new();
            let mut nonce = 0;
            // The content of each name its last response of its own carried
            // (None: a wildcard response); whether its names changed since.
            let mut last: Option<std::collections::BTreeMap<String, Option<String>>> = None;
            let mut renamed = true;
            for op in ops {
                match op {
                    Op::Next(i) => {
                        let current = &versions[i % versions.len()];
                        let wildcard = asked.iter().any(|n| n == "*") || s.named().is_none();
                        let mine: Vec<&String> = asked.iter().filter(|n| *n != "*").collect();
                        let now: std::collections::BTreeMap<String, Option<String>> =
                            mine.iter().map(|n| (n.to_string(), content_of(current, n))).collect();
                        match s.next(Some(current)) {
                            Ok(push) => {
                                match &push {
                                    Push::Selected { to, diff } => {
                                        proptest::prop_assert!(!wildcard);
                                        proptest::prop_assert!(diff.removed.is_empty());
                                        let got: Vec<(String, Option<String>)> = diff
                                            .upserts
                                            .iter()
                                            .map(|r| (r.name.to_string(), Some(format!("{}#{}", r.content_version(), r.encoded.len()))))
                                            .collect();
                                        let fresh: Vec<(String, Option<String>)> =
                                            now.iter().filter(|(_, c)| c.is_some()).map(|(n, c)| (n.clone(), c.clone())).collect();
                                        proptest::prop_assert_eq!(got, fresh, "the selection at {}", to.version);
                                        proptest::prop_assert!(
                                            renamed || last.as_ref() != Some(&now),
                                            "sent {:?} again, unchanged", now
                                        );
                                        last = Some(now);
                                    }
                                    Push::Full { to } => {
                                        proptest::prop_assert!(wildcard, "a named client sent everything");
                                        last = Some(to.resources.keys().map(|n| (n.to_string(), content_of(to, n))).collect());
                                    }
                                    other => proptest::prop_assert!(false, "{:?}", other),
                                }
                                nonce += 1;
                                s.sent(nonce_of(nonce), push.to().clone());
                                renamed = false;
                            }
                            Err(Wait::UpToDate) if !wildcard => {
                                // What it was last sent of its names is what it
                                // would be sent now.
                                let held: Option<std::collections::BTreeMap<String, Option<String>>> = last
                                    .as_ref()
                                    .map(|last| mine.iter().map(|n| (n.to_string(), last.get(*n).cloned().flatten())).collect());
                                proptest::prop_assert_eq!(held, Some(now), "held back at {}", current.version);
                            }
                            Err(_) => {}
                        }
                    }
                    Op::Ack | Op::Nack | Op::Ask(..) | Op::Drop(..) => {
                        let nack = matches!(op, Op::Nack).then(|| Nack { code: 3, message: "bad".into() });
                        match &op {
                            Op::Ask(names, wildcard) => {
                                let mut names: Vec<String> = names.iter().map(|n| format!("r{n}")).collect();
                                names.sort();
                                names.dedup();
                                if *wildcard {
                                    names.insert(0, "*".into());
                                }
                                renamed |= names != asked;
                                asked = names;
                            }
                            Op::Drop(..) => continue,
                            _ => {}
                        }
                        let sent_version = s.view.last_sent_version.clone();
                        let version = match &op {
                            Op::Ack => sent_version.as_deref(),
                            _ => s.view.acked_version.as_deref(),
                        };
                        let last_nonce = s.view.last_sent_nonce.map(|n| n.to_string()).unwrap_or_default();
                        let version = version.map(str::to_owned);
                        s.on_request(Request {
                            version: (family == Family::Xds).then_some(version.as_deref()).flatten(),
                            names: NameChange::Replace(&wire(&asked)),
                            ..Request::new(&last_nonce, nack)
                        });
                    }
                }
            }
        });
    }

    /// What a stream reads on the usual ACK before it makes anything: for
    /// any client (either mode and family, named or not, changes only or
    /// not), after any sequence of requests, responses and versions,
    /// wherever `holds_current` says so, `next` finds it up to date and
    /// changes nothing of the state; and after an ACK with nothing forced
    /// or newly asked, it says so of the version ACKed (a stream finds the
    /// usual ACK).
    #[test]
    fn holds_current_is_what_next_finds_up_to_date() {
        proptest::proptest!(proptest::test_runner::Config::with_cases(512), |(
            changes in proptest::collection::vec(proptest::collection::vec((0u8..8, 0u8..3), 1..4), 1..8),
            ops in proptest::collection::vec(op(), 1..40),
            family in proptest::bool::ANY,
            incremental in proptest::bool::ANY,
            changes_only in proptest::bool::ANY,
        )| {
            let versions = versions(&changes);
            let family = if family { Family::Xds } else { Family::Mcp };
            let mode = if incremental { Mode::Incremental } else { Mode::Full };
            let mut s = family_state(family, mode, nothing());
            if changes_only && mode == Mode::Full {
                s = s.sending_changes_only();
            }
            let mut nonce = 0;
            for op in ops {
                match op {
                    Op::Next(i) => {
                        let current = &versions[i % versions.len()];
                        let holds = s.holds_current(Some(current));
                        let before = format!("{s:?}");
                        match s.next(Some(current)) {
                            Ok(push) => {
                                proptest::prop_assert!(!holds, "holds {} and was sent {:?}", current.version, push);
                                nonce += 1;
                                s.sent(nonce_of(nonce), push.to().clone());
                            }
                            Err(wait) if holds => {
                                proptest::prop_assert_eq!(wait, Wait::UpToDate);
                                proptest::prop_assert_eq!(format!("{s:?}"), before, "changed at {}", current.version);
                            }
                            Err(_) => {}
                        }
                    }
                    Op::Ack | Op::Nack | Op::Ask(..) | Op::Drop(..) => {
                        let nack = matches!(op, Op::Nack).then(|| Nack { code: 3, message: "bad".into() });
                        let mut asked = Vec::new();
                        let mut wildcard = false;
                        if let Op::Ask(names, w) | Op::Drop(names, w) = &op {
                            asked = names.iter().map(|n| format!("r{n}")).collect();
                            asked.sort();
                            asked.dedup();
                            wildcard = *w;
                        }
                        if wildcard {
                            asked.insert(0, "*".into());
                        }
                        let listed = wire(&asked);
                        let names = match (&op, mode) {
                            (Op::Ack | Op::Nack, Mode::Incremental) => NameChange::Change {
                                subscribe: &NO_NAMES,
                                unsubscribe: &NO_NAMES,
                            },
                            (Op::Ask(..), Mode::Incremental) => NameChange::Change {
                                subscribe: &listed,
                                unsubscribe: &NO_NAMES,
                            },
                            (Op::Drop(..) | Op::Next(_), Mode::Incremental) => NameChange::Change {
                                subscribe: &NO_NAMES,
                                unsubscribe: &listed,
                            },
                            (Op::Drop(..), Mode::Full) => continue,
                            // State of the world repeats its names on an
                            // answer; asking is a new list.
                            (Op::Ack | Op::Nack, Mode::Full) => match s.named() {
                                Some(_) => NameChange::Repeated,
                                None => NameChange::Replace(&NO_NAMES),
                            },
                            (_, Mode::Full) => NameChange::Replace(&listed),
                        };
                        let version = match &op {
                            Op::Ack => s.view.last_sent_version.clone(),
                            _ => s.view.acked_version.clone(),
                        };
                        let last_nonce = s.view.last_sent_nonce.map(|n| n.to_string()).unwrap_or_default();
                        let version = version.map(|v| v.to_string());
                        let verdict = s.on_request(Request {
                            version: (family == Family::Xds && mode == Mode::Full).then_some(version.as_deref()).flatten(),
                            names,
                            ..Request::new(&last_nonce, nack)
                        });
                        // An ACK of the version the cache still has, nothing
                        // owed: the usual ACK is found.
                        if verdict == Verdict::Ack && s.named().is_none_or(|n| n.settled()) {
                            let sent = s.last_sent().cloned().expect("an ACK answers a response");
                            proptest::prop_assert!(
                                !s.forced.is_empty() || s.holds_current(Some(&sent)),
                                "an ACK of {} not found", sent.version
                            );
                        }
                    }
                }
            }
        });
    }

    /// A named state-of-the-world client that took everything for a while
    /// (`"*"` beside its names) and went back to its names: its last
    /// selection is of a version before the wildcard responses, and is not
    /// carried past a version that left its names alone.
    #[test]
    fn a_selection_is_not_carried_across_wildcard_responses() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "a1"), ("b", "b1")]);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "a2"), ("b", "b1")]);
        let v3 = with_bodies(&cache, &mut writer, &[("a", "a2"), ("b", "b1"), ("c", "c1")]);
        let v4 = with_bodies(&cache, &mut writer, &[("a", "a2"), ("b", "b2"), ("c", "c1")]);
        let mut s = family_state(Family::Xds, Mode::Full, nothing());
        let ask = |s: &mut TypeState, nonce: &str, version: Option<&str>, asked: &[&str]| {
            let asked = names(asked);
            s.on_request(Request {
                version,
                names: NameChange::Replace(&asked),
                ..Request::new(nonce, None)
            })
        };
        assert_eq!(ask(&mut s, "", None, &["a", "b"]), Verdict::First);
        send(&mut s, &v1, "1");
        assert_eq!(ask(&mut s, "1", Some(&v1.version), &["a", "b"]), Verdict::Ack);
        assert_eq!(
            ask(&mut s, "1", Some(&v1.version), &["*", "a", "b"]),
            Verdict::Subscription
        );
        assert!(matches!(send(&mut s, &v2, "2"), Push::Full { .. }));
        assert_eq!(ask(&mut s, "2", Some(&v2.version), &["*", "a", "b"]), Verdict::Ack);
        assert_eq!(ask(&mut s, "2", Some(&v2.version), &["a", "b"]), Verdict::Subscription);
        // Only "c" changed: nothing to send.
        assert_eq!(s.next(Some(&v3)).unwrap_err(), Wait::UpToDate);
        // "b" changed: both, as v4 has them ("a" as since v2).
        let push = send(&mut s, &v4, "3");
        let Push::Selected { diff, .. } = &push else {
            panic!("expected a response of its own, got {push:?}");
        };
        let bodies: Vec<&[u8]> = diff.upserts.iter().map(|r| &r.encoded[..]).collect();
        assert_eq!(bodies, [&b"a2"[..], &b"b2"[..]]);
    }

    /// State of the world, a type whose clients keep what a response leaves
    /// out (EDS, RDS): the first response carries every name asked for;
    /// after it, what changed and what is newly asked for; a name gone is
    /// not told; after a NACK, everything.
    #[test]
    fn a_client_that_keeps_what_is_left_out_is_sent_what_changed() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "a1"), ("b", "b1"), ("c", "c1")]);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "a2"), ("b", "b1"), ("c", "c1")]);
        let v3 = with_bodies(&cache, &mut writer, &[("a", "a2"), ("c", "c1")]);
        let v4 = with_bodies(&cache, &mut writer, &[("a", "a3"), ("b", "b2"), ("c", "c2")]);
        let v5 = with_bodies(&cache, &mut writer, &[("a", "a4"), ("b", "b2"), ("c", "c2")]);
        let mut s = family_state(Family::Xds, Mode::Full, nothing()).sending_changes_only();
        let ask = |s: &mut TypeState, nonce: &str, version: Option<&str>, asked: &[&str], nack: bool| {
            let asked = names(asked);
            let nack = nack.then(|| Nack {
                code: 3,
                message: "bad".into(),
            });
            s.on_request(Request {
                version,
                names: NameChange::Replace(&asked),
                ..Request::new(nonce, nack)
            })
        };
        let bodies = |push: &Push| -> Vec<String> {
            let Push::Selected { diff, .. } = push else {
                panic!("expected a response of its own, got {push:?}");
            };
            assert!(diff.removed.is_empty(), "state of the world removes nothing");
            let bodies = diff
                .upserts
                .iter()
                .map(|r| String::from_utf8_lossy(&r.encoded).into_owned());
            bodies.collect()
        };
        assert_eq!(ask(&mut s, "", None, &["a", "b"], false), Verdict::First);
        assert_eq!(bodies(&send(&mut s, &v1, "1")), ["a1", "b1"], "the first: all");
        assert_eq!(ask(&mut s, "1", Some(&v1.version), &["a", "b"], false), Verdict::Ack);
        assert_eq!(bodies(&send(&mut s, &v2, "2")), ["a2"], "what changed");
        assert_eq!(ask(&mut s, "2", Some(&v2.version), &["a", "b"], false), Verdict::Ack);
        // "b" went: it keeps it, as it would if left out of the whole.
        assert_eq!(s.next(Some(&v3)).unwrap_err(), Wait::UpToDate);
        assert_eq!(s.view.acked_version.as_deref(), Some(&*v3.version), "shown at v3");
        // A name asked for anew: it alone.
        assert_eq!(
            ask(&mut s, "2", Some(&v3.version), &["a", "b", "c"], false),
            Verdict::Subscription
        );
        assert_eq!(bodies(&send(&mut s, &v3, "3")), ["c1"], "the new name");
        assert_eq!(
            ask(&mut s, "3", Some(&v3.version), &["a", "b", "c"], false),
            Verdict::Ack
        );
        // Refused: it may hold any part of it.
        assert_eq!(bodies(&send(&mut s, &v4, "4")), ["a3", "b2", "c2"]);
        assert_eq!(
            ask(&mut s, "4", Some(&v3.version), &["a", "b", "c"], true),
            Verdict::Nack
        );
        assert_eq!(s.next(Some(&v4)).unwrap_err(), Wait::Nacked);
        assert_eq!(bodies(&send(&mut s, &v5, "5")), ["a4", "b2", "c2"], "after a NACK: all");
        assert_eq!(
            ask(&mut s, "5", Some(&v5.version), &["a", "b", "c"], false),
            Verdict::Ack
        );
        // A name dropped and asked for again is sent again.
        assert_eq!(
            ask(&mut s, "5", Some(&v5.version), &["a", "c"], false),
            Verdict::Subscription
        );
        assert_eq!(s.next(Some(&v5)).unwrap_err(), Wait::UpToDate);
        assert_eq!(
            ask(&mut s, "5", Some(&v5.version), &["a", "b", "c"], false),
            Verdict::Subscription
        );
        assert_eq!(bodies(&send(&mut s, &v5, "6")), ["b2"]);
        // Forced (the load assignment of a cluster just sent): sent again.
        assert_eq!(
            ask(&mut s, "6", Some(&v5.version), &["a", "b", "c"], false),
            Verdict::Ack
        );
        assert_eq!(s.force_resend([&SharedStr::from("c")]), 1);
        assert_eq!(bodies(&send(&mut s, &v5, "7")), ["c2"]);
    }

    /// A client that keeps what a state-of-the-world response leaves out
    /// (EDS, RDS), through any sequence of name changes, ACKs, NACKs (of
    /// which it applies any part) and versions (changes, reverts, pins back,
    /// an overdue collection's empty answer): whenever it is told it is up
    /// to date (its last answer not a NACK), and after each response it
    /// ACKs, it holds each name it asks for as that version has it; and
    /// unless its last answer was a NACK,
    /// it is never sent what it holds (but for a name that went and came
    /// back: what it kept of it is not known).
    /// A response a model client has not answered yet: its version, each
    /// name it carries at its content, and the names asked for since it
    /// was sent.
    type InFlight = (
        String,
        std::collections::BTreeMap<String, Option<String>>,
        std::collections::BTreeSet<String>,
    );

    #[test]
    fn a_client_that_keeps_what_is_left_out_holds_its_names_exactly() {
        use std::collections::{BTreeMap, BTreeSet};
        proptest::proptest!(proptest::test_runner::Config::with_cases(256), |(
            changes in proptest::collection::vec(proptest::collection::vec((0u8..8, 0u8..3), 1..4), 1..8),
            ops in proptest::collection::vec(op(), 1..40),
            applied in proptest::collection::vec(proptest::bool::ANY, 64),
            first in proptest::collection::vec(0u8..8, 1..4),
        )| {
            let versions = versions(&changes);
            let mut s = family_state(Family::Xds, Mode::Full, nothing()).sending_changes_only();
            let mut asked: BTreeSet<String> = first.iter().map(|n| format!("r{n}")).collect();
            let wire_names: Vec<String> = asked.iter().cloned().collect();
            s.on_request(Request {
                names: NameChange::Replace(&wire(&wire_names)),
                ..Request::new("", None)
            });
            let mut holds: BTreeMap<String, Option<String>> = BTreeMap::new();
            let mut in_flight: Option<InFlight> = None;
            let mut nacked = false;
            let mut coin = applied.iter().cycle();
            let mut nonce = 0;
            for op in ops {
                match op {
                    Op::Next(i) => {
                        let current = &versions[i % versions.len()];
                        let before = s.last_sent().cloned();
                        match s.next(Some(current)) {
                            Ok(push) => {
                                let Push::Selected { to, diff } = &push else {
                                    proptest::prop_assert!(false, "not its own: {:?}", push);
                                    unreachable!();
                                };
                                proptest::prop_assert!(diff.removed.is_empty());
                                let mut carried = BTreeMap::new();
                                for r in &diff.upserts {
                                    proptest::prop_assert!(asked.contains(&*r.name), "{} not asked for", r.name);
                                    let content = content_of(to, &r.name);
                                    // What went and came back is sent: it may
                                    // hold it, or not (a name it dropped).
                                    let came_back = before.as_ref().is_none_or(|b| !b.resources.contains_key(&*r.name));
                                    proptest::prop_assert!(
                                        nacked || came_back || holds.get(&*r.name) != Some(&content),
                                        "sent {} again, held", r.name
                                    );
                                    carried.insert(r.name.to_string(), content);
                                }
                                nonce += 1;
                                s.sent(nonce_of(nonce), to.clone());
                                in_flight = Some((to.version.to_string(), carried, asked.clone()));
                            }
                            // What it refused is not sent again unprompted.
                            Err(Wait::UpToDate) if !nacked => {
                                for name in &asked {
                                    if let Some(content) = content_of(current, name) {
                                        proptest::prop_assert_eq!(
                                            holds.get(name), Some(&Some(content)),
                                            "{} at {}, told up to date", name, current.version
                                        );
                                    }
                                }
                            }
                            Err(_) => {}
                        }
                    }
                    Op::Ack | Op::Nack | Op::Ask(..) => {
                        if let Op::Ask(names, _) = &op {
                            asked = names.iter().map(|n| format!("r{n}")).collect();
                            // A name dropped is dropped: its watch goes.
                            holds.retain(|n, _| asked.contains(n));
                            if let Some((_, carried, then)) = &mut in_flight {
                                carried.retain(|n, _| asked.contains(n));
                                then.retain(|n| asked.contains(n));
                            }
                        }
                        let nack = matches!(op, Op::Nack).then(|| Nack { code: 3, message: "bad".into() });
                        // As Envoy: the version it ACKs, else the last it
                        // ACKed ("" before any).
                        let version = match &op {
                            Op::Ack => s.view.last_sent_version.clone(),
                            _ => s.view.acked_version.clone(),
                        };
                        let version = version.map_or_else(String::new, |v| v.to_string());
                        let last_nonce = s.view.last_sent_nonce.map(|n| n.to_string()).unwrap_or_default();
                        let wire_names: Vec<String> = asked.iter().cloned().collect();
                        let verdict = s.on_request(Request {
                            version: Some(&version),
                            names: NameChange::Replace(&wire(&wire_names)),
                            ..Request::new(&last_nonce, nack)
                        });
                        match verdict {
                            Verdict::Ack => {
                                let (version, carried, then) = in_flight.take().expect("an answer of a response");
                                holds.extend(carried);
                                nacked = false;
                                let to = versions.iter().find(|v| *v.version == *version).unwrap();
                                for name in asked.intersection(&then) {
                                    if let Some(content) = content_of(to, name) {
                                        proptest::prop_assert_eq!(
                                            holds.get(name), Some(&Some(content)),
                                            "{} at {}, ACKed", name, version
                                        );
                                    }
                                }
                            }
                            Verdict::Nack => {
                                let (_, carried, _) = in_flight.take().expect("an answer of a response");
                                // Envoy applies the watches it could.
                                holds.extend(carried.into_iter().filter(|_| *coin.next().unwrap()));
                                nacked = true;
                            }
                            _ => {}
                        }
                    }
                    Op::Drop(..) => {}
                }
            }
        });
    }

    /// A named delta client, through any sequence of subscribes and
    /// unsubscribes (wildcard on and off, names that appear later or go),
    /// ACKs, NACKs (it keeps what it was sent) and versions (changes,
    /// reverts, pins back, an overdue collection's empty answer): after each
    /// response, and whenever it is told it is up to date, it holds each
    /// name it asks for as the version has it; and it is sent only what
    /// differs from what it holds, or what it asked for again.
    #[test]
    fn a_named_delta_client_holds_its_names_exactly_and_is_sent_only_changes() {
        use std::collections::{BTreeMap, BTreeSet};
        proptest::proptest!(proptest::test_runner::Config::with_cases(256), |(
            changes in proptest::collection::vec(proptest::collection::vec((0u8..8, 0u8..3), 1..4), 1..8),
            first in proptest::collection::vec(0u8..8, 1..4),
            ops in proptest::collection::vec(op(), 1..40),
        )| {
            let versions = versions(&changes);
            let mut s = family_state(Family::Xds, Mode::Incremental, nothing());
            let mut subscribed: BTreeSet<String> = BTreeSet::new();
            let mut wildcard = false;
            let mut holds: BTreeMap<String, String> = BTreeMap::new();
            // Names it asked for (again) since its last response.
            let mut owed: BTreeSet<String> = BTreeSet::new();
            // What its last response carried, and, after NACKs since its
            // last ACK, what they carried: it may hold any of it, so it may
            // be sent again.
            let mut last_push: BTreeSet<String> = BTreeSet::new();
            let mut resendable: BTreeSet<String> = BTreeSet::new();
            let mut nonce = 0;
            let ops = std::iter::once(Op::Ask(first, false)).chain(ops);
            for op in ops {
                match op {
                    Op::Next(i) => {
                        let current = &versions[i % versions.len()];
                        let up_to_date = match s.next(Some(current)) {
                            Ok(push) => {
                                match &push {
                                    Push::Selected { diff, .. } => {
                                        // What it asked for again is answered.
                                        let answered: BTreeSet<&str> = diff
                                            .upserts
                                            .iter()
                                            .map(|r| &*r.name)
                                            .chain(diff.removed.iter().map(|n| &**n))
                                            .collect();
                                        for name in &owed {
                                            proptest::prop_assert!(answered.contains(name.as_str()), "{} not answered", name);
                                        }
                                        last_push = answered.iter().map(|n| n.to_string()).collect();
                                        for r in &diff.upserts {
                                            // What it does not ask for it drops.
                                            if !wildcard && !subscribed.contains(&*r.name) {
                                                continue;
                                            }
                                            let content = content_of(current, &r.name).unwrap();
                                            proptest::prop_assert!(
                                                owed.contains(&*r.name)
                                                    || resendable.contains(&*r.name)
                                                    || holds.get(&*r.name) != Some(&content),
                                                "{} sent, unchanged", r.name
                                            );
                                            holds.insert(r.name.to_string(), content);
                                        }
                                        for name in &diff.removed {
                                            if !wildcard && !subscribed.contains(&**name) {
                                                continue;
                                            }
                                            // After a NACK it may hold anything the refused
                                            // response's version had: a removal re-asserts.
                                            proptest::prop_assert!(
                                                owed.contains(&**name)
                                                    || !resendable.is_empty()
                                                    || holds.contains_key(&**name),
                                                "{} removed, not held", name
                                            );
                                            holds.remove(&**name);
                                        }
                                    }
                                    Push::Diff { from, to } => {
                                        let diff = Diff::between(&from.resources, &to.resources);
                                        last_push = diff
                                            .upserts
                                            .iter()
                                            .map(|r| r.name.to_string())
                                            .chain(diff.removed.iter().map(|n| n.to_string()))
                                            .collect();
                                        for r in &diff.upserts {
                                            holds.insert(r.name.to_string(), content_of(to, &r.name).unwrap());
                                        }
                                        for name in &diff.removed {
                                            holds.remove(&**name);
                                        }
                                    }
                                    Push::Full { to } => {
                                        last_push = to.resources.keys().map(|n| n.to_string()).collect();
                                        for (name, _) in to.resources.iter() {
                                            holds.insert(name.to_string(), content_of(to, name).unwrap());
                                        }
                                    }
                                    other => proptest::prop_assert!(false, "{:?}", other),
                                }
                                nonce += 1;
                                s.sent(nonce_of(nonce), push.to().clone());
                                owed.clear();
                                true
                            }
                            Err(Wait::UpToDate) => {
                                proptest::prop_assert!(owed.is_empty(), "{:?} owed, up to date", owed);
                                true
                            }
                            Err(_) => false,
                        };
                        if up_to_date {
                            let names: Vec<String> = if wildcard {
                                current.resources.keys().map(|n| n.to_string()).chain(subscribed.iter().cloned()).collect()
                            } else {
                                subscribed.iter().cloned().collect()
                            };
                            for name in names {
                                proptest::prop_assert_eq!(
                                    holds.get(&name).cloned(),
                                    content_of(current, &name),
                                    "{} at {}", name, current.version
                                );
                            }
                        }
                    }
                    Op::Ack | Op::Nack => {
                        let nack = matches!(op, Op::Nack).then(|| Nack { code: 3, message: "bad".into() });
                        if s.view.outstanding {
                            match nack {
                                Some(_) => resendable.extend(last_push.iter().cloned()),
                                None => resendable.clear(),
                            }
                        }
                        let last_nonce = s.view.last_sent_nonce.map(|n| n.to_string()).unwrap_or_default();
                        s.on_request(Request {
                            names: NameChange::Change { subscribe: &NO_NAMES, unsubscribe: &NO_NAMES },
                            ..Request::new(&last_nonce, nack)
                        });
                    }
                    Op::Ask(names, star) => {
                        let mut asked: Vec<String> = names.iter().map(|n| format!("r{n}")).collect();
                        owed.extend(asked.iter().cloned());
                        subscribed.extend(asked.iter().cloned());
                        if star {
                            wildcard = true;
                            asked.push("*".into());
                        }
                        s.on_request(Request {
                            names: NameChange::Change { subscribe: &wire(&asked), unsubscribe: &NO_NAMES },
                            ..Request::new("", None)
                        });
                    }
                    Op::Drop(names, star) => {
                        let mut dropped: Vec<String> = names.iter().map(|n| format!("r{n}")).collect();
                        if star {
                            // The client keeps only what it names.
                            wildcard = false;
                            holds.retain(|n, _| subscribed.contains(n) && !dropped.contains(n));
                            dropped.insert(0, "*".into());
                        }
                        for name in &dropped {
                            subscribed.remove(name);
                            holds.remove(name);
                            owed.remove(name);
                            if wildcard {
                                // Still covered: sent again.
                                owed.insert(name.clone());
                            }
                        }
                        // Unsubscribed from everything: what only wildcard
                        // covered is owed no more.
                        owed.retain(|n| wildcard || subscribed.contains(n));
                        s.on_request(Request {
                            names: NameChange::Change { subscribe: &NO_NAMES, unsubscribe: &wire(&dropped) },
                            ..Request::new("", None)
                        });
                    }
                }
            }
        });
    }
}
