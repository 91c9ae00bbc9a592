//! The connected streams, as the debug views show them. Each stream's task owns
//! its real state and publishes a copy here after every change; the entry is
//! removed when the task ends.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use atomic_waker::AtomicWaker;
use dashmap::DashMap;

use super::by_type::ByType;
use crate::collections::Dialect;
use crate::skew::ClientGeneration;
use crate::transport::defer::ConnectionGate;
use crate::SharedStr;

/// A response's nonce: the stream's count of the responses it sent (from
/// 1), written in decimal on the wire and in the views. Kept as the number,
/// not as its text: a response then allocates nothing for its nonce, and
/// each copy of it (the type's state, its view here) is a plain copy, not a
/// shared string's count (BENCHMARKS, session 41).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nonce(std::num::NonZeroU64);

impl Nonce {
    /// The stream's next nonce after `count` responses: `count` goes up by
    /// one.
    pub fn next(count: &mut u64) -> Self {
        *count = count.saturating_add(1);
        Self(std::num::NonZeroU64::new(*count).unwrap_or(std::num::NonZeroU64::MAX))
    }

    /// Its text, written into `buf`.
    pub fn text(self, buf: &mut itoa::Buffer) -> &str {
        buf.format(self.0.get())
    }

    /// Whether `text`, a nonce as a client sent it back, is this one: the
    /// same decimal text exactly.
    pub fn is(self, text: &str) -> bool {
        self.text(&mut itoa::Buffer::new()) == text
    }
}

impl std::fmt::Display for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.text(&mut itoa::Buffer::new()))
    }
}

/// Its text, as the views showed it when it was kept as text.
impl serde::Serialize for Nonce {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.text(&mut itoa::Buffer::new()))
    }
}

/// A nonce's decimal text, as [`Nonce::text`] writes it (tests name the
/// nonces they send by it).
impl std::str::FromStr for Nonce {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        text.parse::<std::num::NonZeroU64>()
            .ok()
            .map(Self)
            .filter(|nonce| nonce.is(text))
            .ok_or_else(|| format!("{text:?} is not a nonce the gateway writes"))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// `AggregatedMeshConfigService.StreamAggregatedResources`.
    Sotw,
    /// `AggregatedMeshConfigService.IncrementalAggregatedResources`.
    Incremental,
    /// `ResourceSource.EstablishResourceStream`.
    ResourceSource,
    /// Envoy v3 `AggregatedDiscoveryService.StreamAggregatedResources`.
    XdsSotw,
    /// Envoy v3 `AggregatedDiscoveryService.DeltaAggregatedResources`.
    XdsDelta,
}

impl Protocol {
    pub const ALL: [Protocol; 5] = [
        Protocol::Sotw,
        Protocol::Incremental,
        Protocol::ResourceSource,
        Protocol::XdsSotw,
        Protocol::XdsDelta,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Sotw => "sotw",
            Protocol::Incremental => "incremental",
            Protocol::ResourceSource => "resource-source",
            Protocol::XdsSotw => "xds-sotw",
            Protocol::XdsDelta => "xds-delta",
        }
    }

    /// The dialects its types can be in: what the stream gauge reports, at
    /// zero when no stream has them (a series that went away would keep its
    /// last value).
    pub fn dialects(self) -> &'static [Dialect] {
        match self {
            Protocol::XdsSotw | Protocol::XdsDelta => &[Dialect::Xds],
            Protocol::Sotw | Protocol::Incremental | Protocol::ResourceSource => &[Dialect::V1_0, Dialect::V1_1],
        }
    }
}

/// A NACK as a client sent it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NackRecord {
    /// The version the client refused; it is never sent to this client again.
    pub version: SharedStr,
    pub code: i32,
    pub message: String,
    /// When it came.
    #[serde(skip)]
    pub at: Stamp,
    /// The client ACKed a later response since: the NACK is past (shown as
    /// "since fixed"). Until then the client is NACKED, whatever version it
    /// ACKed before: a client that applies part of a response it rejects
    /// holds neither version.
    pub superseded: bool,
}

/// A moment on the registry's clock: tenths of a second since the registry
/// began, plus one (0: never). Four bytes, where every type of every stream
/// keeps several. Read on tokio's clock, so paused-time tests control it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u32);

impl Stamp {
    pub const NEVER: Stamp = Stamp(0);

    pub fn is_never(self) -> bool {
        self == Stamp::NEVER
    }
}

/// The registry's clock: when it began, on tokio's clock and on the wall.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    began: tokio::time::Instant,
    wall: SystemTime,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            began: tokio::time::Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

impl Clock {
    pub fn now(&self) -> Stamp {
        self.stamp(tokio::time::Instant::now())
    }

    /// `at` as a stamp (an instant before the registry began: its start).
    /// Rounded up to the tenth: a time read back is never earlier than the
    /// event (a type's first request never reads before its stream began).
    pub fn stamp(&self, at: tokio::time::Instant) -> Stamp {
        let tenths = at.saturating_duration_since(self.began).as_millis().div_ceil(100);
        Stamp(u32::try_from(tenths).unwrap_or(u32::MAX - 1) + 1)
    }

    /// How long ago `stamp` was; `None` for never.
    pub fn age(&self, stamp: Stamp) -> Option<Duration> {
        (!stamp.is_never()).then(|| {
            let now = self.now().0;
            Duration::from_millis(u64::from(now.saturating_sub(stamp.0)) * 100)
        })
    }

    /// `stamp` on the wall clock; `None` for never.
    pub fn wall(&self, stamp: Stamp) -> Option<SystemTime> {
        (!stamp.is_never()).then(|| self.wall + Duration::from_millis(u64::from(stamp.0 - 1) * 100))
    }
}

/// One type on one stream, as `/debug/clients` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TypeView {
    pub collection: SharedStr,
    pub dialect: Dialect,
    /// The client asked for changes only (not the whole collection each time).
    pub incremental: bool,
    pub last_sent_version: Option<SharedStr>,
    pub last_sent_nonce: Option<Nonce>,
    pub acked_version: Option<SharedStr>,
    pub outstanding: bool,
    /// When the client last sent a request for the type.
    #[serde(skip)]
    pub last_request_at: Stamp,
    /// When the last response went out.
    #[serde(skip)]
    pub last_sent_at: Stamp,
    /// When the client last ACKed.
    #[serde(skip)]
    pub acked_at: Stamp,
    /// Since when the client has been behind the cache's current version
    /// (never: it is not behind, or nothing was delivered).
    #[serde(skip)]
    pub behind_since: Stamp,
    /// Boxed: most clients never NACK (40 bytes less per type, twice).
    pub last_nack: Option<Box<NackRecord>>,
    /// The size of the last response sent, when it was larger than 4 MiB
    /// (the default receive limit of legacy clients and of istiod 1.8 to
    /// 1.11, which reject it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oversized_bytes: Option<std::num::NonZeroU32>,
    /// The names it subscribed to (xDS); absent: everything (wildcard).
    /// Shared: made when the subscription changes, not at every publish.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscribed: Option<Arc<SubscribedView>>,
    /// Under `--access-policy`: how many of the resources it asks for its
    /// identity may not read (withheld from it).
    #[serde(skip_serializing_if = "is_zero")]
    pub withheld: u32,
    /// Under `--access-policy`, for a client that may read part of the
    /// collection: the version of its part that it is to hold now (its
    /// current version, in place of the collection's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_version: Option<SharedStr>,
    /// On an Envoy stream, a change of this type held back for another type
    /// of the same stream (make before break, see `order`). Boxed: most
    /// types never wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordered: Option<Box<OrderedView>>,
    /// A named client's link to the versions of its slot: a version that
    /// leaves its names alone shows it at that version when read
    /// ([`TypeView::untouched`]), without the version looking at it.
    #[serde(skip)]
    pub left_alone: Option<super::wakes::LeftAlone>,
}

/// A change held back for another type of the stream: which, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OrderedView {
    /// The type it waits for (`clusters`, `endpoints`, `listeners`,
    /// `routes`, `secrets`).
    pub waits_for: &'static str,
    /// `UNACKED` (its response is not answered yet), `NACKED` (the client
    /// refused its last response: held until the source changes it) or
    /// `PENDING` (it has a change of its own to send first) or `DRAINING`
    /// (its removals wait for a listener Envoy drains: `until`).
    pub reason: &'static str,
    /// What waits: `add` (this type's additions and changes wait for a type
    /// they depend on) or `remove` (its removals wait for the types that
    /// still name what it removes).
    pub step: &'static str,
    /// `DRAINING`: when the drain ends and the removals go.
    #[serde(skip)]
    pub until: Stamp,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A named subscription, as `/debug/clients` shows it: whether it is
/// wildcard, how many names, and the first of them (in name order; the
/// subscription's own storage when there are no more).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SubscribedView {
    pub wildcard: bool,
    /// The names subscribed (at most `--max-subscribed-names`).
    pub count: usize,
    /// The first [`SubscribedView::SHOWN`] names.
    pub first: Arc<[SharedStr]>,
}

impl SubscribedView {
    /// How many names a view lists: the count says how many more there are.
    pub const SHOWN: usize = 100;
}

impl From<&super::names::Names> for SubscribedView {
    fn from(names: &super::names::Names) -> Self {
        SubscribedView {
            wildcard: names.wildcard,
            count: names.names.len(),
            first: names.names.first(Self::SHOWN),
        }
    }
}

impl TypeView {
    /// A type a client just asked for: nothing sent, nothing ACKed.
    pub fn new(resolved: crate::collections::Resolved) -> Self {
        Self {
            collection: resolved.collection,
            dialect: resolved.dialect,
            incremental: false,
            last_sent_version: None,
            last_sent_nonce: None,
            acked_version: None,
            outstanding: false,
            last_request_at: Stamp::NEVER,
            last_sent_at: Stamp::NEVER,
            acked_at: Stamp::NEVER,
            behind_since: Stamp::NEVER,
            last_nack: None,
            oversized_bytes: None,
            subscribed: None,
            withheld: 0,
            access_version: None,
            ordered: None,
            left_alone: None,
        }
    }

    /// Made equal to `state`, keeping each shared field that is already
    /// `state`'s own: a response or an ACK changes a few of a view's
    /// fields, and copying the whole (a reference count taken per shared
    /// field, and the old copy's let go) after each was about 3 % of the
    /// gateway's samples in `mcp-load --scenario eds`, a sixth less this
    /// way (BENCHMARKS, session 28). Every field is named here, so a new
    /// one cannot be left stale.
    fn refresh_from(&mut self, state: &TypeView) {
        let TypeView {
            collection,
            dialect,
            incremental,
            last_sent_version,
            last_sent_nonce,
            acked_version,
            outstanding,
            last_request_at,
            last_sent_at,
            acked_at,
            behind_since,
            last_nack,
            oversized_bytes,
            subscribed,
            withheld,
            access_version,
            ordered,
            left_alone,
        } = state;
        share_str(&mut self.collection, collection);
        self.dialect = *dialect;
        self.incremental = *incremental;
        share_optional(&mut self.last_sent_version, last_sent_version, SharedStr::ptr_eq);
        self.last_sent_nonce = *last_sent_nonce;
        share_optional(&mut self.acked_version, acked_version, SharedStr::ptr_eq);
        self.outstanding = *outstanding;
        self.last_request_at = *last_request_at;
        self.last_sent_at = *last_sent_at;
        self.acked_at = *acked_at;
        self.behind_since = *behind_since;
        if self.last_nack != *last_nack {
            self.last_nack.clone_from(last_nack);
        }
        self.oversized_bytes = *oversized_bytes;
        share_optional(&mut self.subscribed, subscribed, Arc::ptr_eq);
        self.withheld = *withheld;
        share_optional(&mut self.access_version, access_version, SharedStr::ptr_eq);
        if self.ordered != *ordered {
            self.ordered.clone_from(ordered);
        }
        // Equal only when the same link (by pointer).
        if self.left_alone != *left_alone {
            self.left_alone.clone_from(left_alone);
        }
    }

    /// As its task would have settled it had the versions since it was
    /// last woken woken it (`TypeState::next`'s `UpToDate`): a client that
    /// holds what it ACKed (nothing outstanding, no NACK standing) holds
    /// the slot's newest version as well when none since changed its names.
    fn untouched(&mut self) {
        if let Some(newest) = self.newest_held() {
            self.acked_version = Some(newest);
        }
    }

    /// The slot's newest version where [`Self::untouched`] would show it
    /// held; `None` where it shows what the client ACKed.
    fn newest_held(&self) -> Option<SharedStr> {
        let left_alone = self.left_alone.as_ref()?;
        let nacked = self.last_nack.as_ref().is_some_and(|n| !n.superseded);
        if self.outstanding || nacked {
            return None;
        }
        self.acked_version.as_deref().and_then(|acked| left_alone.newest(acked))
    }

    /// This view as [`Self::untouched`] makes it: itself, or a copy where
    /// the client holds a newer version than it ACKed.
    pub fn as_held(&self) -> std::borrow::Cow<'_, TypeView> {
        match self.newest_held() {
            Some(newest) if self.acked_version.as_ref() != Some(&newest) => {
                let mut held = self.clone();
                held.acked_version = Some(newest);
                std::borrow::Cow::Owned(held)
            }
            _ => std::borrow::Cow::Borrowed(self),
        }
    }
}

/// `shown` made `now`, unless it is `now`'s own string already.
fn share_str(shown: &mut SharedStr, now: &SharedStr) {
    if !SharedStr::ptr_eq(shown, now) {
        shown.clone_from(now);
    }
}

/// `shown` made `now`, a shared value that may be absent, unless it is
/// `now`'s own already (`same`: the same pointer).
fn share_optional<T: Clone>(shown: &mut Option<T>, now: &Option<T>, same: impl Fn(&T, &T) -> bool) {
    match (shown.as_ref(), now) {
        (Some(held), Some(now)) if same(held, now) => {}
        (None, None) => {}
        _ => shown.clone_from(now),
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct StreamView {
    pub id: u64,
    pub peer: Option<SocketAddr>,
    pub protocol: Protocol,
    pub node_id: String,
    /// Set when the peer is another gateway (its announced id).
    pub gateway_id: Option<String>,
    /// A canary of some collection: a `--canary` selector matched its node,
    /// and its proven identity allows it (see `rollout::Membership`); it
    /// gets new versions first.
    pub canary: bool,
    /// What TLS proved of the peer: its first SAN, or `unauthenticated`.
    pub identity: SharedStr,
    /// An Istio client's release (absent: not an Istio client, such as
    /// Envoy or grpc, or no Istio collection asked for yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<ClientGeneration>,
    pub connected_since: SystemTime,
    /// By the `type_url` the client sent.
    pub types: ByType<TypeView>,
}

#[derive(Debug, Default)]
pub struct Registry {
    streams: DashMap<u64, Arc<Tracked>>,
    clock: Clock,
}

/// A stream as the registry holds it: its view, and the waker of its task's
/// waits for the gateway's broadcasts ([`Registry::wake_all`]) and for the
/// versions of the types it follows (`wakes`).
#[derive(Debug)]
struct Tracked {
    view: Mutex<StreamView>,
    control: AtomicWaker,
    /// Its connection's gate: armed before a version wakes the stream, so
    /// that the connection writes the responses of its streams together
    /// (`transport::defer`). None for a stream without one (dialed out).
    connection: Option<ConnectionGate>,
}

impl Tracked {
    fn lock(&self) -> std::sync::MutexGuard<'_, StreamView> {
        self.view.lock().expect("registry lock poisoned")
    }

    /// A copy of its view, each named type at the version it holds now
    /// ([`TypeView::untouched`], read after the lock is let go).
    fn view(&self) -> StreamView {
        let mut view = self.lock().clone();
        for (_, state) in view.types.iter_mut() {
            state.untouched();
        }
        view
    }
}

// === impl Registry ===

impl Registry {
    /// Adds a stream; it is removed when the returned entry is dropped.
    pub fn register(
        self: &Arc<Self>,
        id: u64,
        peer: Option<SocketAddr>,
        protocol: Protocol,
        identity: &str,
        connection: Option<ConnectionGate>,
    ) -> RegistryEntry {
        let view = Arc::new(Tracked {
            view: Mutex::new(StreamView {
                id,
                peer,
                protocol,
                node_id: String::new(),
                gateway_id: None,
                canary: false,
                identity: identity.into(),
                generation: None,
                connected_since: SystemTime::now(),
                types: ByType::new(),
            }),
            control: AtomicWaker::new(),
            connection,
        });
        self.streams.insert(id, view.clone());
        RegistryEntry {
            registry: self.clone(),
            id,
            view,
        }
    }

    /// Reads every connected stream's view in place, in no order, each
    /// under its lock while `read` runs: what the metrics count at a
    /// scrape, with no copy of the views ([`Self::streams`] copies them
    /// all: about 8 ms of CPU for 10,000 streams, and heap glibc kept;
    /// BENCHMARKS, session 30). `read` sees a named type as it was
    /// published; [`TypeView::as_held`] shows it as a copy does. A scrape
    /// reads the wake index's versions (`as_held`) and the rollout's gates
    /// (what each group is served) under a stream's lock: nothing takes a
    /// stream's lock while it holds either, so the order makes no cycle.
    pub fn each(&self, mut read: impl FnMut(&StreamView)) {
        for entry in self.streams.iter() {
            read(&entry.value().lock());
        }
    }

    /// Every connected stream, ordered by id.
    pub fn streams(&self) -> Vec<StreamView> {
        let mut all: Vec<StreamView> = self.streams.iter().map(|entry| entry.value().view()).collect();
        all.sort_by_key(|s| s.id);
        all
    }

    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Wakes every stream's wait for the gateway's broadcasts (its shutdown,
    /// a new access policy: see [`RegistryEntry::control`]), once what they
    /// announce is in place. O(streams), for what is rare.
    pub fn wake_all(&self) {
        for entry in self.streams.iter() {
            entry.value().control.wake();
        }
    }

    /// The clock of the views' times.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}

/// A stream's place in the registry, held by its task.
#[derive(Debug)]
pub struct RegistryEntry {
    registry: Arc<Registry>,
    id: u64,
    view: Arc<Tracked>,
}

impl RegistryEntry {
    /// The waker [`Registry::wake_all`] and the slots' followers (`wakes`)
    /// wake: a stream registers its task here, then reads what a broadcast
    /// or a version would have changed (a waiter of its own for each would
    /// be room in every idle stream's task).
    pub fn control(&self) -> &AtomicWaker {
        &self.view.control
    }

    /// The registry it is in.
    #[cfg(test)]
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// A copy of the stream's view (for its leave line).
    pub fn view(&self) -> StreamView {
        self.view.view()
    }

    /// Who the stream is, for a log line: its node id and peer address
    /// (without copying the rest of its view).
    pub fn who(&self) -> (String, Option<SocketAddr>) {
        let view = self.view.lock();
        (view.node_id.clone(), view.peer)
    }

    pub fn set_node_id(&self, node_id: &str) {
        let mut view = self.view.lock();
        if view.node_id != node_id {
            view.node_id = node_id.to_owned();
        }
    }

    /// Now, on the registry's clock.
    pub fn now(&self) -> Stamp {
        self.registry.clock.now()
    }

    /// `at`, on the registry's clock.
    pub fn stamp(&self, at: tokio::time::Instant) -> Stamp {
        self.registry.clock.stamp(at)
    }

    /// Whether the stream is a canary of some collection now.
    pub fn set_canary(&self, canary: bool) {
        self.view.lock().canary = canary;
    }

    pub fn set_generation(&self, generation: ClientGeneration) {
        self.view.lock().generation = Some(generation);
    }

    pub fn set_gateway_id(&self, gateway_id: &str) {
        self.view.lock().gateway_id = Some(gateway_id.to_owned());
    }

    /// A handle on the stream's task's waker and its connection's gate.
    pub fn handle(&self) -> ViewHandle {
        ViewHandle(self.view.clone())
    }

    /// Shows `state` as the stream's view of `type_url`: after each
    /// response and each ACK, so in place (see [`TypeView::refresh_from`]).
    pub fn publish(&self, type_url: &SharedStr, state: &TypeView) {
        let mut view = self.view.lock();
        match view.types.get_mut(type_url) {
            Some(shown) => shown.refresh_from(state),
            // The key is the stream's own, shared.
            None => {
                view.types.insert(type_url, state.clone());
            }
        }
    }
}

/// A stream's view and its task's waker, shared with the slots' followers
/// and named clients (`wakes`).
#[derive(Clone)]
pub struct ViewHandle(Arc<Tracked>);

impl ViewHandle {
    /// Wakes the stream's task (its wait for what changed: see `wakes`).
    pub fn wake(&self) {
        self.0.control.wake();
    }

    /// A key of the stream's connection, the same for the streams of one
    /// connection while it lives (0 without one).
    pub fn connection(&self) -> u64 {
        self.0.connection.as_ref().map_or(0, ConnectionGate::key)
    }

    /// Its connection's next poll waits for the streams a version is
    /// waking (`transport::defer`): called before they are woken.
    pub fn arm_connection(&self) {
        if let Some(gate) = &self.0.connection {
            gate.arm();
        }
    }
}

impl Drop for RegistryEntry {
    fn drop(&mut self) {
        self.registry.streams.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's nonces count its responses from 1, and a nonce a client
    /// sends back is its own only as the same decimal text: not with a
    /// leading zero or sign, not another number, not what another server
    /// wrote. The views show the text.
    #[test]
    fn a_nonce_is_its_count_in_decimal_and_only_that_text_answers_it() {
        let mut count = 0;
        let first = Nonce::next(&mut count);
        let second = Nonce::next(&mut count);
        assert_eq!(
            (count, first.to_string(), second.to_string()),
            (2, "1".into(), "2".into())
        );
        let mut count = u64::MAX - 1;
        assert_eq!(Nonce::next(&mut count).to_string(), u64::MAX.to_string());
        assert_eq!(Nonce::next(&mut count).to_string(), u64::MAX.to_string(), "saturates");
        assert!(second.is("2"));
        for other in ["", "02", "+2", " 2", "2 ", "1", "3", "n2", "2.0", "0x2", "２"] {
            assert!(!second.is(other), "{other:?} is not nonce 2");
        }
        assert_eq!("17".parse::<Nonce>().map(|n| n.to_string()), Ok("17".into()));
        for bad in ["0", "017", "+17", "-1", "n1", "", "18446744073709551616"] {
            assert!(
                bad.parse::<Nonce>().is_err(),
                "{bad:?} is not a nonce the gateway writes"
            );
        }
        let shown = serde_json::to_value(TypeView {
            last_sent_nonce: Some(second),
            ..TypeView::new(crate::collections::Resolved {
                collection: "c".into(),
                dialect: Dialect::Xds,
            })
        })
        .expect("a view serializes");
        assert_eq!(shown["last_sent_nonce"], "2");
    }

    /// A waker that counts its wakes.
    struct Counted(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A broadcast wakes every registered stream's task, once each, and
    /// none of a stream that has left.
    #[test]
    fn wake_all_wakes_each_registered_stream_once() {
        let registry = Arc::new(Registry::default());
        let stay = registry.register(1, None, Protocol::Sotw, "", None);
        let leave = registry.register(2, None, Protocol::Sotw, "", None);
        let (stayed, left) = (
            Arc::new(Counted(Default::default())),
            Arc::new(Counted(Default::default())),
        );
        stay.control().register(&stayed.clone().into());
        leave.control().register(&left.clone().into());
        drop(leave);
        registry.wake_all();
        assert_eq!(stayed.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(left.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        // Woken once: the next broadcast finds no waker until the stream's
        // task registers again.
        registry.wake_all();
        assert_eq!(stayed.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// A view refreshed in place ([`TypeView::refresh_from`]) reads as the
    /// one published, whichever fields changed: each in turn, then back.
    #[test]
    fn a_view_refreshed_in_place_reads_as_the_one_published() {
        let resolved = crate::collections::Resolved {
            collection: "c".into(),
            dialect: Dialect::Xds,
        };
        let mut state = TypeView::new(resolved);
        let mut states = vec![state.clone()];
        let mut next = |change: &dyn Fn(&mut TypeView)| {
            change(&mut state);
            states.push(state.clone());
        };
        next(&|s| {
            s.last_sent_version = Some("v1".into());
            s.last_sent_nonce = Some("1".parse().unwrap());
            s.outstanding = true;
            s.last_sent_at = Stamp(5);
        });
        next(&|s| {
            s.acked_version = Some("v1".into());
            s.outstanding = false;
            s.acked_at = Stamp(6);
            s.last_request_at = Stamp(6);
        });
        next(&|s| {
            s.last_nack = Some(Box::new(NackRecord {
                version: "v2".into(),
                code: 3,
                message: "refused".into(),
                at: Stamp(7),
                superseded: false,
            }))
        });
        next(&|s| s.last_nack.as_mut().unwrap().superseded = true);
        next(&|s| {
            s.subscribed = Some(Arc::new(SubscribedView {
                wildcard: false,
                count: 1,
                first: Arc::from(vec![SharedStr::from("a")]),
            }))
        });
        next(&|s| {
            s.subscribed = Some(Arc::new(SubscribedView {
                wildcard: true,
                count: 0,
                first: Arc::from(Vec::new()),
            }))
        });
        next(&|s| {
            s.access_version = Some("p1".into());
            s.withheld = 3;
        });
        next(&|s| {
            s.ordered = Some(Box::new(OrderedView {
                waits_for: "clusters",
                reason: "UNACKED",
                step: "add",
                until: Stamp::NEVER,
            }))
        });
        next(&|s| s.ordered.as_mut().unwrap().reason = "NACKED");
        next(&|s| {
            s.oversized_bytes = std::num::NonZeroU32::new(5 << 20);
            s.behind_since = Stamp(9);
            s.incremental = true;
        });
        next(&|s| {
            s.collection = "d".into();
            s.dialect = Dialect::V1_1;
            s.last_sent_version = None;
            s.acked_version = Some("v3".into());
        });
        let registry = Arc::new(Registry::default());
        let entry = registry.register(1, None, Protocol::XdsSotw, "", None);
        let type_url = SharedStr::from("t");
        for state in states.iter().chain(states.iter().rev()) {
            entry.publish(&type_url, state);
            assert_eq!(registry.streams()[0].types.get("t"), Some(state));
        }
    }

    /// A time read back from a stamp is never earlier than the event, so a
    /// type's times never read before its stream's `connected_since`.
    #[tokio::test(start_paused = true)]
    async fn a_stamp_never_reads_earlier_than_its_event() {
        let clock = Clock::default();
        for ms in [0, 1, 99, 100, 101, 150, 1_999] {
            let at = clock.began + Duration::from_millis(ms);
            let read = clock.wall(clock.stamp(at)).unwrap();
            let happened = clock.wall + Duration::from_millis(ms);
            assert!(read >= happened, "{ms} ms: read {read:?} < {happened:?}");
            assert!(
                read.duration_since(happened).unwrap() < Duration::from_millis(100),
                "{ms} ms: within a tenth"
            );
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let stamp = clock.now();
        assert_eq!(clock.age(stamp), Some(Duration::ZERO));
    }
}
