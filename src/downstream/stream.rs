//! One stream of any protocol: the requests a [`Wire`] reads, the per-type
//! state machine deciding, and the responses the wire encodes. The loop,
//! the types followed, the nonces, the registry, the metrics and the logs
//! are here once; a protocol is only how its messages look.

use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::Stream;
use tonic::Status;

use tokio::sync::watch;

use super::by_type::ByType;
use super::cluster_refs::{self, ForcedResends};
use super::drains::Drains;
use super::encode::{EncodedResponse, Record};
use super::grants::GrantHold;
use super::names::{names_seed, NameChange, Names};
use super::order::{self, Blocker, Change, Decision, Rank, Standing};
use super::registry::{Nonce, OrderedView, Protocol, RegistryEntry, Stamp, TypeView};
use super::rollout::{CanaryClient, Rollout};
use super::service::TrySend;
use super::type_state::{Family, Held, Mode, Nack, Push, ReportedNames, Request, TypeState, Unheld, Verdict};
use super::wakes::{Following, Registration, Wakes};
use super::wires::{names, Target, Wire, WireRequest, SOTW_NAMES_FIELD, UNSERVED};
use super::{
    nack_memory, record_ack, record_nack, record_stale, send_failed, ClientGone, Downstream, End, Item, Outbound,
    StreamLogs,
};
use crate::cache::demand::SubscriptionState;
use crate::cache::memo::MemoKey;
use crate::cache::{CollectionSnapshot, Diff};
use crate::collections::{Dialect, Resolved};
use crate::metrics::{self as m, CollectionMetrics};
use crate::proto::wire::{version_entry, ErrorDetail};
use crate::skew::{ClientGeneration, Generation, Interest};
use crate::transport::access::{AccessPolicy, NameGrant};
use crate::transport::bucket::TokenBucket;
use crate::transport::defer::ConnectionGate;
use crate::transport::identity::PeerIdentity;
use crate::transport::requests::RequestStream;
use crate::SharedStr;

struct Followed {
    state: TypeState,
    metrics: Arc<CollectionMetrics>,
    answer: Answer,
    /// Under `--access-policy`, the names the client may read when it may
    /// read only some (`None`: all of them): it is served that part of the
    /// collection, as if the rest did not exist.
    grant: Option<Box<Restriction>>,
    /// The index of the names a version changes, when the type may be
    /// woken by it (`None`: a canary, or a type nobody serves, follows its
    /// slot whatever it names).
    named: Option<Arc<Wakes>>,
    /// What says its slot changed: the index (`named`) while the client
    /// names what it reads, with no grant (a restricted client's view has
    /// versions of its own, which the index cannot show it at); every
    /// version of its slot otherwise.
    woken_by: WokenBy,
    /// Where an Envoy type stands in the order of make before break
    /// (`None`: a type whose order does not matter).
    rank: Option<Rank>,
    /// What the last response of a ranked type did to what the client
    /// held (what an outstanding or refused response holds back).
    sent_change: Change,
    /// The version of the collection a ranked type's last response was
    /// made for: itself, or what it adds and changes first (make before
    /// break) or keeps for a drain. A NACK of it refuses that version.
    sent_for: Option<SharedStr>,
}

/// What tells a stream that a followed type's slot was served a version
/// the type must look at (see `wakes`).
enum WokenBy {
    /// Nothing: a type nobody serves, answered once.
    Nothing,
    /// Every version of its slot: its receiver of the slot says so.
    Slot(#[allow(dead_code, reason = "held: the type leaves its slot's followers when it is dropped")] Following),
    /// The versions that change a name it asks for.
    Names(Box<Registration>),
}

impl Followed {
    /// Whether its slot changed in a way that concerns it since this was
    /// last asked (asking marks it seen).
    fn take_change(&mut self) -> bool {
        match (&self.woken_by, &mut self.answer) {
            (WokenBy::Names(registration), _) => registration.take_woken(),
            (WokenBy::Slot(_), Answer::Served(slot) | Answer::Overdue { slot, .. }) => {
                // A slot whose sender is gone never changes again.
                let changed = slot.has_changed().unwrap_or(false);
                if changed {
                    slot.mark_unchanged();
                }
                changed
            }
            _ => false,
        }
    }

    /// Its last response was refused (NACKed, nothing ACKed since), and it
    /// was made for `version`: the client refused `version`'s change.
    fn refused(&self, version: &str) -> bool {
        self.state
            .pending_nack()
            .is_some_and(|n| *n.version == *version || self.sent_for.as_deref() == Some(version))
    }
}

/// A stream's drains, and the timer set for the first to end.
struct Draining {
    drains: Drains,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The timer is set (for the drains' next deadline).
    armed: bool,
    /// Per type, the end of the drain its hold was last counted for.
    counted: Vec<(SharedStr, Stamp)>,
}

impl Draining {
    fn new(drain_time: std::time::Duration) -> Box<Self> {
        Box::new(Self {
            drains: Drains::new(drain_time),
            timer: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
            armed: false,
            counted: Vec::new(),
        })
    }

    /// Whether `type_url`'s hold for the drain ending `until` is its first
    /// (noted: the next is not).
    fn first_hold_of(&mut self, type_url: &SharedStr, until: Stamp) -> bool {
        match self.counted.iter_mut().find(|(t, _)| t == type_url) {
            Some((_, counted)) => std::mem::replace(counted, until) != until,
            None => {
                self.counted.push((type_url.clone(), until));
                true
            }
        }
    }

    /// Sets the timer for the next drain to end.
    fn arm(&mut self) {
        match self.drains.next_deadline() {
            Some(deadline) => {
                self.timer.as_mut().reset(deadline);
                self.armed = true;
            }
            None => self.armed = false,
        }
    }
}

/// The first of a stream's drains ends (never, with none set).
///
/// This and the other waits of an idle stream's `select!` for what is rare
/// (`chain_changed`, `refusals_changed`) are poll functions over what they
/// borrow, not async fns: every idle stream's task holds them, and a poll
/// function holds only its borrow (8 or 16 bytes, where the async fns held
/// 32 to 48).
fn drain_ended(draining: &mut Option<Box<Draining>>) -> impl Future<Output = ()> + '_ {
    std::future::poll_fn(move |cx| match draining {
        Some(draining) if draining.armed => draining.timer.as_mut().poll(cx),
        _ => Poll::Pending,
    })
}

/// A stream's rare events, the last branch of its `select!`, in this
/// order: this gateway's upstream chain changed so that a gateway peer now
/// upstream of it would close a loop (`Err`: the stream ends with it); the
/// source refused a collection, or left it unanswered past
/// --demand-timeout, so a type waiting for it is answered empty
/// ([`Step::AnswerRefused`]); a listener's drain ended, so the removals
/// that waited for it are tried again ([`Step::DrainEnded`]).
///
/// One branch of the select rather than one each. Every poll of the select
/// goes through its branches from a random one (its fairness), and with six
/// a branch's index was a division and each branch a poll of its own, about
/// 400 instructions a response of eds with four polls a response
/// (BENCHMARKS, session 40); four branches are a mask.
fn rare<'a>(
    peer_gateway: &'a mut Option<Box<PeerGateway>>,
    shared: &'a Downstream,
    refusals: &'a mut Option<Box<WatchStream<SubscriptionState>>>,
    draining: &'a mut Option<Box<Draining>>,
) -> impl Future<Output = Result<Step, Status>> + 'a {
    let mut chain = chain_changed(peer_gateway, shared);
    let mut refused = refusals_changed(refusals);
    let mut drained = drain_ended(draining);
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(status) = std::pin::Pin::new(&mut chain).poll(cx) {
            return Poll::Ready(Err(status));
        }
        if let Poll::Ready(()) = std::pin::Pin::new(&mut refused).poll(cx) {
            return Poll::Ready(Ok(Step::AnswerRefused));
        }
        if let Poll::Ready(()) = std::pin::Pin::new(&mut drained).poll(cx) {
            return Poll::Ready(Ok(Step::DrainEnded));
        }
        Poll::Pending
    })
}

/// What [`TypedStream::send_from`] has left to do after its usual case.
enum Later {
    /// Send this once the client has read what waits.
    Wait(Item),
    /// Make the response in its turn, then send it.
    InTurn(Push, Option<Arc<CollectionSnapshot>>),
}

/// What a stream's type is to send (see [`TypedStream::make`]).
enum Made {
    Nothing,
    Response(EncodedResponse),
    /// A first response from what a reconnecting client reported, made in
    /// its turn ([`TypedStream::respond_in_turn`]).
    InTurn(Push, Option<Arc<CollectionSnapshot>>),
}

/// What woke a stream through its registry entry: the gateway's
/// announcements to every stream, or a followed type's slot.
enum Woken {
    Shutdown,
    PolicyChanged,
    /// The next followed type whose slot changed (see `wakes`).
    Changed(SharedStr),
}

/// Whatever wakes an idle stream but its own connection: the gateway's
/// shutdown, a new access policy (woken by the relay that
/// [`Downstream::relay_broadcasts`] starts), and the versions of the types
/// it follows. One poll function that registers the stream's task in its
/// registry entry once, then reads all three; the types from the one after
/// the type it last found, so that no type's changes keep another's
/// waiting. A waiter of its own for each (the shutdown's token, 72 bytes;
/// the policy's watch, 120; a boxed watch future per followed type, 160)
/// was room in every idle stream.
fn woken<'a>(
    entry: &'a RegistryEntry,
    shared: &'a Downstream,
    policy: &'a watch::Receiver<Arc<AccessPolicy>>,
    types: &'a mut ByType<Followed>,
    turn: &'a mut usize,
) -> impl Future<Output = Woken> + 'a {
    std::future::poll_fn(move |cx| {
        entry.control().register(cx.waker());
        if shared.shutting_down() {
            return Poll::Ready(Woken::Shutdown);
        }
        if policy.has_changed().unwrap_or(false) {
            return Poll::Ready(Woken::PolicyChanged);
        }
        let count = types.len();
        for i in 0..count {
            let at = (*turn + i) % count;
            let (type_url, followed) = types.at_mut(at);
            if followed.take_change() {
                *turn = at + 1;
                return Poll::Ready(Woken::Changed(type_url.clone()));
            }
        }
        Poll::Pending
    })
}

/// The ranked types of a stream whose change waits for another type.
#[derive(Default)]
struct Withheld {
    types: Vec<SharedStr>,
    /// Per type: names a reconnecting client reported holding that the
    /// source no longer has, whose removal waits (see
    /// [`TypedStream::unremoved`]).
    unremoved: Vec<Unremoved>,
}

/// Names of one type a reconnecting client reported holding that the
/// source no longer has, whose removal waits.
struct Unremoved {
    type_url: SharedStr,
    names: std::collections::BTreeSet<SharedStr>,
    /// Their drain was noted (once the order let them go).
    drained: bool,
}

/// A type the client may read part of: its grant, and the last view this
/// stream read with the whole it came from, from which the next view is made
/// at the cost of the change.
struct Restriction {
    grant: Arc<NameGrant>,
    /// The stream's hold on its grant: the grant is served while held
    /// (`--max-grants-per-version`).
    hold: GrantHold,
    last: std::cell::RefCell<Option<(Arc<CollectionSnapshot>, Arc<CollectionSnapshot>)>>,
    /// The whole and the names the count of withheld names was last made
    /// for: it is made again only when either changes (a named client's
    /// names would otherwise be looked up on every wake).
    counted: Option<(Arc<CollectionSnapshot>, Option<crate::downstream::names::Names>)>,
}

impl Restriction {
    fn new(grant: Arc<NameGrant>, hold: GrantHold) -> Box<Self> {
        Box::new(Self {
            grant,
            hold,
            last: Default::default(),
            counted: None,
        })
    }
}

/// What a followed type is answered from.
enum Answer {
    /// The version the stream's group is served (the rollout's slot).
    Served(watch::Receiver<Option<Arc<CollectionSnapshot>>>),
    /// A collection a client asked for that the source neither delivered
    /// nor refused within `--demand-timeout`: this empty snapshot until the
    /// slot has a version, then the slot (still followed).
    Overdue {
        slot: watch::Receiver<Option<Arc<CollectionSnapshot>>>,
        empty: Arc<CollectionSnapshot>,
    },
    /// A type no source serves: this empty snapshot, which never changes.
    Unserved(Arc<CollectionSnapshot>),
}

impl Answer {
    /// Answered empty until the slot has a version.
    fn overdue(slot: watch::Receiver<Option<Arc<CollectionSnapshot>>>, collection: SharedStr) -> Self {
        Answer::Overdue {
            slot,
            empty: CollectionSnapshot::empty(collection),
        }
    }
}

/// An Istio client's release (from the node and dialect of the first request
/// for one of Istio's collections), and the collections whose skew for it is
/// kept while it reads them.
struct StreamSkew {
    generation: ClientGeneration,
    interests: Vec<Interest>,
}

/// A stream whose node claims it is a canary (a `--canary` selector
/// matched it): of the collections its proven identity lets it be one of,
/// the rollout hears its ACKs and NACKs, and that it left; of the others,
/// that it claimed in vain.
struct Canary {
    rollout: Arc<Rollout>,
    stream: u64,
    node: String,
    /// The selector its node matched.
    selector: String,
    /// The collections it is a canary of.
    collections: Vec<SharedStr>,
    /// The collections it claimed to be a canary of and is not.
    refused: Vec<SharedStr>,
}

impl Canary {
    /// Whether it is a canary of `collection` now (its ACKs and NACKs count).
    fn of(&self, collection: &str) -> bool {
        self.collections.iter().any(|c| **c == *collection)
    }

    /// Decides whether it is a canary of `collection` under `policy` (at
    /// its first request for it, and again when the policy changes), and
    /// tells the rollout; true when it is one.
    fn decide(
        &mut self,
        policy: &AccessPolicy,
        identity: &PeerIdentity,
        collection: &SharedStr,
        partial: bool,
        entry: &RegistryEntry,
    ) -> bool {
        let decided = self.rollout.decide(policy, identity, collection, partial);
        let member = decided.is_ok();
        let client = CanaryClient {
            stream: self.stream,
            node: self.node.clone(),
            identity: identity.to_string(),
            selector: self.selector.clone(),
            why: decided.unwrap_or_else(|why_not| why_not),
        };
        let (to, from) = if member {
            (&mut self.collections, &mut self.refused)
        } else {
            (&mut self.refused, &mut self.collections)
        };
        let changed = !to.contains(collection);
        if changed {
            from.retain(|c| c != collection);
            to.push(collection.clone());
            if member {
                self.rollout.canary_joined(collection, client);
            } else {
                self.rollout.canary_refused(collection, client);
            }
        }
        entry.set_canary(!self.collections.is_empty());
        member
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        for collection in self.collections.iter().chain(&self.refused) {
            self.rollout.canary_left(collection, self.stream);
        }
    }
}

pub(super) struct TypedStream<W> {
    shared: Downstream,
    entry: RegistryEntry,
    id: u64,
    /// By the type the client named.
    types: ByType<Followed>,
    /// Where [`woken`] looks first: after the type it last found.
    turn: usize,
    /// Per stream, decimal, as Istio's server did.
    last_nonce: u64,
    /// Made at the first stale request or NACK: most streams have neither.
    logs: Option<Box<StreamLogs>>,
    peer_gateway: Option<Box<PeerGateway>>,
    /// The source's refusals and overdue demands, watched while a type that
    /// must be answered (xDS) waits for a collection the source has not
    /// delivered. Boxed: most streams never have one.
    refusals: Option<Box<WatchStream<SubscriptionState>>>,
    /// Set when a `--canary` selector matched the node of the stream's
    /// first request: its claim, which counts per collection (see
    /// [`Canary::decide`]). Boxed: most streams claim nothing.
    canary: Option<Box<Canary>>,
    /// What TLS proved of the peer (the access policy's identity).
    identity: Arc<PeerIdentity>,
    /// An Istio client's release, and its interest in the skew of each
    /// Istio collection it reads. Boxed: Envoy and grpc clients have none.
    skew: Option<Box<StreamSkew>>,
    /// The access policy in effect, as it changes.
    policy: watch::Receiver<Arc<AccessPolicy>>,
    /// Ranked types whose change waits for another type of the stream (make
    /// before break), tried again after every step. Boxed: most streams
    /// have none waiting.
    withheld: Option<Box<Withheld>>,
    /// Resends one type's response forced on another (`cluster_refs`).
    /// Boxed: most streams never force one.
    forced: Option<Box<ForcedResends>>,
    /// Listeners the client drains, whose clusters' removal waits (see
    /// `drains`). Boxed: most streams never change a listener.
    draining: Option<Box<Draining>>,
    _wire: PhantomData<fn() -> W>,
}

// === impl TypedStream ===

impl<W: Wire> TypedStream<W> {
    pub(super) fn new(
        shared: Downstream,
        id: u64,
        peer: Option<SocketAddr>,
        gate: Option<ConnectionGate>,
        identity: Arc<PeerIdentity>,
    ) -> Self {
        let entry = shared
            .inner
            .registry
            .register(id, peer, W::PROTOCOL, &identity.to_string(), gate);
        let policy = shared.watch_policy();
        shared.relay_broadcasts();
        Self {
            shared,
            entry,
            id,
            types: ByType::new(),
            turn: 0,
            last_nonce: 0,
            logs: None,
            peer_gateway: None,
            refusals: None,
            canary: None,
            identity,
            skew: None,
            policy,
            withheld: None,
            forced: None,
            draining: None,
            _wire: PhantomData,
        }
    }

    /// The stream's task: requests, cache changes and shutdown, until one of
    /// them ends the stream. Its registry entry goes when it returns.
    ///
    /// Every idle stream is this future, so its size is kept down: an async
    /// block rather than an `async fn` (whose arguments its future holds twice,
    /// rust-lang/rust#62958), nothing of the `select!` (its futures, a
    /// request) held while a response is queued, a response made before
    /// its send waits and rare paths boxed, the waits for rare events poll
    /// functions over what they borrow, and what wakes an idle stream but its
    /// connection (the gateway's shutdown, a new policy, the versions of the
    /// types it follows) one poll function woken through its registry
    /// entry. 616 bytes (release build, measured before the versions woke
    /// it that way, which moved it by a few bytes and not a size class:
    /// `LEGACY_STREAM` fell by what it measured) with the tokio task's
    /// header and the task tracker's token make a 768-byte task (tokio
    /// aligns tasks to 128); past 656 bytes it would cost 128 more per
    /// stream (the heap budgets say so).
    #[allow(clippy::manual_async_fn, reason = "an async fn would store its arguments twice")]
    pub(super) fn drive(
        mut self,
        mut inbound: RequestStream<W::Request>,
        mut out: Outbound,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        async move {
            // Real clients send a request per type and an ACK per response; a
            // loop of requests (stale nonces, re-subscriptions) is cut off.
            let max_requests_per_second = self.shared.limits().max_requests_per_second;
            let mut requests = TokenBucket::new(
                f64::from(max_requests_per_second),
                f64::from(max_requests_per_second) * 10.0,
            );
            let (end, status) = loop {
                // What the select chose, done once its futures are gone.
                // In this order, not a random one: none of the branches can
                // keep the others from their turn (a wake is taken whole,
                // every change since the last at once, and requests past
                // the rate end the stream), and the draw of a random start
                // and the polls in its order were about 100 instructions a
                // response (BENCHMARKS, session 42).
                let step = tokio::select! {
                    biased;
                    woken = woken(&self.entry, &self.shared, &self.policy, &mut self.types, &mut self.turn) => match woken {
                        Woken::Shutdown => break (
                            End::Shutdown,
                            Some(Status::unavailable(self.shared.inner.shutdown_message)),
                        ),
                        Woken::PolicyChanged => Step::PolicyChanged,
                        Woken::Changed(type_url) => Step::Changed(type_url),
                    },
                    // Only where its requests would not say so (a queue's).
                    _ = out.closed(), if out.watches_gone() => break (End::ClientGone, None),
                    request = inbound.message() => match request {
                        Ok(Some(_)) if !requests.take() => {
                            m::limit_refused("requests_rate");
                            break (End::Limit, Some(Status::resource_exhausted(format!(
                                "too many requests on this stream: --max-requests-per-second={max_requests_per_second}"
                            ))));
                        }
                        Ok(Some(request)) => match self.accept(request) {
                            Ok(Some(accepted)) => Step::Send(accepted),
                            Ok(None) => continue,
                            Err(status) => break (End::of(&status), Some(status)),
                        },
                        Ok(None) => break (End::ClientClosed, None),
                        // A client that left (its stream reset, its connection
                        // closed) reaches the requests as an error as well as
                        // the response; the select may read either first (from
                        // a random branch): gone, not a failed receive.
                        Err(_) if out.is_gone() => break (End::ClientGone, None),
                        // A request that cannot be read ends the stream with its
                        // status; after a client's cancel nobody reads it.
                        Err(status) => {
                            metrics::counter!(
                                m::RECV_FAILURES,
                                "component" => m::COMPONENT_DOWNSTREAM,
                                "code" => m::code_number(status.code() as i32)
                            )
                            .increment(1);
                            break (End::of(&status), Some(status));
                        }
                    },
                    rare = rare(&mut self.peer_gateway, &self.shared, &mut self.refusals, &mut self.draining) => match rare {
                        Ok(step) => step,
                        Err(refused) => break (End::Refused, Some(refused)),
                    },
                };
                let sent = match step {
                    Step::Send(Accepted { type_url, current, now }) => {
                        self.send_from(&type_url, current, now, &mut out).await
                    }
                    Step::Changed(type_url) => self.try_send(&type_url, &mut out).await,
                    // Rare: boxed.
                    Step::AnswerRefused => Box::pin(self.answer_refused(&mut out)).await,
                    Step::DrainEnded => {
                        self.drain_ended();
                        Ok(())
                    }
                    // Rare: boxed.
                    Step::PolicyChanged => match Box::pin(self.regrant(&mut out)).await {
                        Ok(sent) => sent,
                        Err(denied) => break (End::Refused, Some(denied)),
                    },
                };
                // Types another type's response forced a resend on (the
                // endpoints of the clusters just sent) go right after it; a
                // step may let a change held for another type go (an ACK of
                // clusters lets the routes to them go), and what that sends
                // may force a resend in turn. Rare: boxed, and only made
                // when there is one (a step after which nothing is owed
                // and nothing held only notes that it settled).
                let sent = match sent {
                    Ok(()) if self.owes_after_step() => Box::pin(self.after_step(&mut out)).await,
                    Ok(()) => {
                        self.note_settled();
                        Ok(())
                    }
                    sent => sent,
                };
                if sent.is_err() {
                    break (End::ClientGone, None);
                }
            };
            if end == End::ClientGone {
                send_failed();
            }
            metrics::counter!(
                m::DOWNSTREAM_STREAM_ENDS,
                "protocol" => W::PROTOCOL.as_str(),
                "reason" => end.as_str()
            )
            .increment(1);
            self.log_left(end, status.as_ref());
            // Boxed: it is needed once, and would otherwise be room in every
            // stream's future.
            let wait = self.shared.limits().stream_end_timeout;
            if Box::pin(out.close(status, wait)).await {
                self.cut_short(wait);
            }
        }
    }

    /// Reads a request into its type's state machine: the type to try a send
    /// for (with the cache's snapshot and the time it was read at), or `None`
    /// for a stale request; `Err` ends the stream.
    fn accept(&mut self, request: W::Request) -> Result<Option<Accepted>, Status> {
        let mut request = W::read(request)?;
        let repeated = self.read_names(&mut request)?;
        if let Some(node) = &request.node_id {
            self.entry.set_node_id(node);
        }
        if let Some(peer) = &request.gateway_id {
            if let Some(refused) = loop_refusal(&self.shared, peer) {
                return Err(refused);
            }
            if self.peer_gateway.is_none() {
                self.entry.set_gateway_id(peer);
                let chain = self.shared.inner.cache.provenance().watch_upstream_chain();
                self.peer_gateway = Some(Box::new(PeerGateway {
                    id: peer.clone(),
                    chain: WatchStream::from_changes(chain),
                }));
            }
        }
        let type_url = self.type_for(&request.type_url)?;
        if !self.types.contains_key(&type_url) {
            let first = self.types.is_empty();
            if first {
                self.decide_group(&request);
            }
            self.follow(&type_url, &request)?;
            if first {
                self.log_connected();
            }
        }
        let followed = self.types.get_mut(&type_url).expect("followed above");
        let limits = self.shared.limits();
        let now = self.entry.now();
        // Whether its collection is one of secrets is looked up for a NACK
        // only, not for every ACK.
        let table = &self.shared.inner.table;
        let nack = request.error_detail.map(|detail| {
            let sensitive = table.is_sensitive(&followed.state.view.collection);
            read_nack(detail, limits.max_nack_message_bytes, sensitive)
        });
        let names = match request.mode {
            Mode::Full if repeated => NameChange::Repeated,
            Mode::Full => NameChange::Replace(&request.names),
            Mode::Incremental => NameChange::Change {
                subscribe: &request.names,
                unsubscribe: &request.unsubscribe,
            },
        };
        let known = current_of(followed);
        let verdict = followed.state.on_request(Request {
            nonce: &request.nonce,
            nack,
            version: W::ACK_NAMES_VERSION.then_some(&*request.version_info),
            names,
            max_names: limits.max_subscribed_names,
            known: known.as_deref(),
            at: now,
        });
        // Its names are in the index before the slot is read again: a
        // version published meanwhile wakes it (see `wakes`).
        let rewired = rewire(followed, &self.entry);
        let collection = followed.state.view.collection.clone();
        match &verdict {
            Verdict::Stale { expected } => {
                record_stale(
                    self.id,
                    self.logs.get_or_insert_with(Box::default),
                    &followed.metrics,
                    &type_url,
                    expected,
                    &request.nonce,
                );
                return Ok(None);
            }
            Verdict::Repeat => return Ok(None),
            Verdict::TooManyNames { count } => {
                m::limit_refused("max_subscribed_names");
                return Err(Status::resource_exhausted(format!(
                    "type_url {type_url:?} subscribes to {count} names: --max-subscribed-names={}",
                    limits.max_subscribed_names
                )));
            }
            Verdict::Ack | Verdict::First => {
                if verdict == Verdict::Ack {
                    record_ack(&followed.metrics);
                }
                // On a first request, the version the client says it holds:
                // a canary that comes back (a broken connection, a restarted
                // gateway) holding the round's version is not sent it again,
                // and that is its ACK, or the round would wait for it.
                if let (Some(canary), Some(version)) = (&self.canary, &followed.state.view.acked_version) {
                    if canary.of(&collection) {
                        canary.rollout.canary_acked(&collection, self.id, version);
                    }
                }
            }
            Verdict::Nack | Verdict::Unrecoverable => {
                let nack = followed.state.view.last_nack.as_ref().expect("a NACK was recorded");
                let entry = &self.entry;
                record_nack(
                    self.id,
                    || entry.who(),
                    self.logs.get_or_insert_with(Box::default),
                    &type_url,
                    &collection,
                    nack,
                );
                if let Some(canary) = self.canary.as_ref().filter(|c| c.of(&collection)) {
                    canary
                        .rollout
                        .canary_nacked(&collection, self.id, &nack.version, &canary.node, &nack.message);
                }
            }
            Verdict::Subscription => {}
        }
        let (entry, identity) = (&self.entry, &self.identity);
        let who = || (entry.who().0, identity.to_string());
        let memory = self.shared.nack_memory();
        memory.answered(&verdict, W::FAMILY, &followed.state, &type_url, who);
        // Published once, with whether it is still behind; the send that
        // follows decides from the same snapshot the request was read with.
        let current = if rewired { current_of(followed) } else { known };
        followed.state.note_current(current.as_ref(), now);
        self.entry.publish(&type_url, &followed.state.view);
        if verdict == Verdict::Unrecoverable {
            return Err(Status::failed_precondition(
                "the first response, built from initial_resource_versions, was NACKed: the gateway cannot know what \
                 this client holds; open a new stream to start again",
            ));
        }
        Ok(Some(Accepted { type_url, current, now }))
    }
}

impl<W: Wire> TypedStream<W> {
    /// State-of-the-world xDS: the request's names read into it (an error
    /// ends the stream, as a request that does not decode does), or left
    /// unread where they hash as the names its type last asked for, as on
    /// every ACK: true then. Read right after the request, before anything
    /// of it is taken in, as its decoding read them before.
    fn read_names(&self, request: &mut WireRequest) -> Result<bool, Status> {
        let Some(unread) = request.unread_names.take() else {
            return Ok(false);
        };
        let named = self.types.get(&request.type_url).and_then(|f| f.state.named());
        if named.is_some_and(|named| named.repeats_asked(unread.hash(names_seed()))) {
            return Ok(true);
        }
        request.names = names::<W>(unread.checked(SOTW_NAMES_FIELD))?;
        Ok(false)
    }
}

/// What a stream does once its `select!` chose: nothing the select held
/// (a request, its futures) is kept while a response is queued.
enum Step {
    /// Send what a request decided.
    Send(Accepted),
    /// Send what the type's group is served now.
    Changed(SharedStr),
    /// Answer the types the source refused.
    AnswerRefused,
    /// The access policy was reloaded.
    PolicyChanged,
    /// A listener's drain ended.
    DrainEnded,
}

/// A request taken: its type, and the snapshot and time it was decided at.
struct Accepted {
    type_url: SharedStr,
    current: Option<Arc<CollectionSnapshot>>,
    now: Stamp,
}

/// After a request (or a new grant), a type is woken by what it reads: by
/// the index of the names a version changes while it names what it reads
/// (and has no grant), by its slot otherwise. True when that changed: the
/// slot is read again after it (see `wakes`).
fn rewire(followed: &mut Followed, entry: &RegistryEntry) -> bool {
    let (Some(index), Answer::Served(slot) | Answer::Overdue { slot, .. }) = (&followed.named, &mut followed.answer)
    else {
        return false;
    };
    let names = match (&followed.grant, followed.state.named()) {
        (None, Some(named)) if !named.current().wildcard => Some(&named.current().names),
        _ => None,
    };
    match (names, &mut followed.woken_by) {
        (Some(names), WokenBy::Names(registration)) if registration.is_for(names) => false,
        (Some(names), WokenBy::Names(registration)) => {
            registration.rename(names);
            true
        }
        (Some(names), _) => {
            let registration = index.register(names, entry.handle());
            // Its view is shown at the versions that leave its names alone.
            followed.state.view.left_alone = Some(registration.left_alone());
            followed.woken_by = WokenBy::Names(Box::new(registration));
            true
        }
        (None, WokenBy::Names(_)) => {
            followed.woken_by = WokenBy::Slot(index.follow(entry.handle()));
            followed.state.view.left_alone = None;
            // What the slot holds now is read after this.
            slot.mark_unchanged();
            true
        }
        (None, _) => false,
    }
}

/// Moves a served type to the canaries' slot or to everyone's (a reload
/// gave its stream the right to be a canary, or took it away); true when it
/// moved. The type is then woken by its new slot (or, in everyone's group,
/// by the names it reads, once rewired).
fn regroup(followed: &mut Followed, canary: bool, rollout: &Rollout, entry: &RegistryEntry) -> bool {
    // A served type follows the canaries' slot exactly when it has no index
    // of names (see `follow`).
    let was_canary = followed.named.is_none();
    if was_canary == canary || matches!(followed.answer, Answer::Unserved(_)) {
        return false;
    }
    let collection = followed.state.view.collection.clone();
    let (slot, wakes) = rollout.watch(&collection, canary);
    followed.woken_by = WokenBy::Slot(wakes.follow(entry.handle()));
    followed.state.view.left_alone = None;
    followed.named = (!canary).then_some(wakes);
    followed.answer = match followed.answer {
        Answer::Overdue { .. } => Answer::overdue(slot, collection),
        _ => Answer::Served(slot),
    };
    true
}

/// What a followed type is answered from now: its group's version, or the
/// empty snapshot of a type nobody serves (or of an overdue one, until the
/// source delivers it).
fn current_of(followed: &Followed) -> Option<Arc<CollectionSnapshot>> {
    let whole = source_of(followed);
    match (&followed.grant, whole) {
        (Some(restriction), Some(whole)) => Some(restricted(&whole, restriction)),
        (_, whole) => whole,
    }
}

/// What a followed type is answered from, whole (before the access
/// policy's restriction).
fn source_of(followed: &Followed) -> Option<Arc<CollectionSnapshot>> {
    match &followed.answer {
        Answer::Served(slot) => slot.borrow().clone(),
        Answer::Overdue { slot, empty } => Some(slot.borrow().clone().unwrap_or_else(|| empty.clone())),
        Answer::Unserved(empty) => Some(empty.clone()),
    }
}

/// The names a restricted client asks for (by name, or every one under
/// wildcard) that `whole` has and its grant withholds.
fn withheld_names<'a>(
    followed: &'a Followed,
    whole: &'a CollectionSnapshot,
) -> Box<dyn Iterator<Item = &'a SharedStr> + 'a> {
    let Some(grant) = followed.grant.as_ref().map(|r| &r.grant) else {
        return Box::new(std::iter::empty());
    };
    match followed.state.named().map(|n| n.current()) {
        Some(names) if !names.wildcard => Box::new(
            names
                .names
                .iter()
                .filter(move |n| whole.resources.contains_key(&***n) && !grant.allows(n)),
        ),
        _ => Box::new(whole.resources.keys().filter(move |n| !grant.allows(n))),
    }
}

/// The part of `whole` that `grant` lets a client read: made once per
/// version and grant while a client of it reads that version, and shared by
/// every client of that grant (so their responses are encoded once, as for
/// everyone else). The whole refers to its views without keeping them:
/// a view goes with the last client that reads it, and at most
/// `--max-grants-per-version` are referred to (the distinct grants served).
/// A view holds references to the whole's resources and chunks, not copies
/// ([`CollectionSnapshot::restricted`]).
fn restricted(whole: &Arc<CollectionSnapshot>, restriction: &Restriction) -> Arc<CollectionSnapshot> {
    let grant = &restriction.grant;
    let mut last = restriction.last.borrow_mut();
    if let Some((seen, view)) = last.as_ref() {
        if Arc::ptr_eq(seen, whole) {
            return view.clone();
        }
    }
    let key = MemoKey::with("access.restricted", grant.key.clone());
    // Referred to, not held: a view that is the whole itself (its grant
    // keeps everything) is no cycle.
    let view = whole.memo.get_or_make_held(key, restriction.hold.max(), || {
        // From this stream's last view of the same grant: the change only.
        let base = last.as_ref().map(|(seen, view)| (&**seen, view));
        whole.restricted_after(base, |name| grant.allows(name))
    });
    *last = Some((whole.clone(), view.clone()));
    view
}

/// How many resources a restricted client asks for (by name, or all of
/// them with wildcard) that its grant withholds from it.
fn withheld(followed: &Followed, whole: &CollectionSnapshot, view: &CollectionSnapshot) -> u32 {
    let wildcard = followed.state.named().is_none_or(|n| n.current().wildcard);
    let count = if wildcard {
        // Under wildcard, what the view lacks.
        whole.len() - view.len()
    } else {
        withheld_names(followed, whole).count()
    };
    u32::try_from(count).unwrap_or(u32::MAX)
}

/// The names a type's client asks for; `None`: everything.
fn names_of(followed: &Followed) -> Option<&Names> {
    followed.state.named().map(|n| n.current())
}

/// Distinct versions a change to one version is found from and kept with
/// it (clients of a fleet hold a few).
const ORDER_DIFFS_PER_SNAPSHOT: usize = 16;

/// What going from `held` to `to` does, in the names asked for. The diff
/// of two versions is found once and kept with `to`: every client of the
/// fleet at `held` asks.
fn change_of(held: Option<&Arc<CollectionSnapshot>>, to: &Arc<CollectionSnapshot>, names: Option<&Names>) -> Change {
    let Some(held) = held.filter(|h| h.version != to.version) else {
        return Change::between(held.map(|h| &**h), to, names);
    };
    let diff = diff_of(held, to);
    let covers = |name: &str| names.is_none_or(|n| n.covers(name));
    Change {
        makes: diff.upserts.iter().any(|r| covers(&r.name)),
        breaks: diff.removed.iter().any(|n| covers(n)),
    }
}

/// The diff from `held` to `to`, found once per pair of versions and kept
/// with `to` (every client of the fleet at `held` asks).
fn diff_of(held: &CollectionSnapshot, to: &Arc<CollectionSnapshot>) -> Arc<Diff> {
    let key = MemoKey::with("order.diff", held.version.clone());
    to.memo.get_or_make(key, ORDER_DIFFS_PER_SNAPSHOT, || {
        Diff::between(&held.resources, &to.resources)
    })
}

/// Distinct versions held whose removals a version is sent without, kept
/// with it.
const MAKES_FIRST_PER_SNAPSHOT: usize = 16;

/// `to` with what `held` has and it removes kept: its additions and
/// changes first (make before break). Made once per pair of versions and
/// kept with `to`, so a fleet's clients share it and its encoding.
fn makes_first(to: &Arc<CollectionSnapshot>, held: &CollectionSnapshot) -> Arc<CollectionSnapshot> {
    let key = MemoKey::with("order.makes_first", held.version.clone());
    // `None`: `to` itself (it removes nothing), which its own memo must
    // not hold (a cycle: never freed).
    let made: Arc<Option<Arc<CollectionSnapshot>>> = to.memo.get_or_make(key, MAKES_FIRST_PER_SNAPSHOT, || {
        let first = to.keeping(held);
        (!Arc::ptr_eq(&first, to)).then_some(first)
    });
    made.as_ref().clone().unwrap_or_else(|| to.clone())
}

/// Where a ranked type stands: what its outstanding or refused response
/// did, and what it has yet to send.
fn standing(followed: &Followed) -> Option<Standing> {
    let rank = followed.rank?;
    let state = &followed.state;
    let outstanding = state.view.outstanding;
    let current = current_of(followed);
    // Refused, and still to be served what it refused (not sent again): once
    // the source changes it, what it is to send decides (the fix of a
    // refused change is a change like any other).
    let refused = current.as_ref().is_some_and(|c| followed.refused(&c.version));
    let mut pending = match &current {
        Some(_) if refused => Change::NONE,
        Some(c) => change_of(state.last_sent(), c, names_of(followed)),
        None => Change::NONE,
    };
    // Names it newly asks for are still to be sent.
    if current.is_some() && state.named().is_some_and(|n| !n.settled()) {
        pending.makes = true;
    }
    // Refused, and the source changed since: its next response carries
    // again what the refused one did (the whole type, or delta's names
    // carried again), so the types after it wait for that response's
    // answer, whatever the change itself does (a change that only removes
    // an unrelated cluster must not let a route to the refused one go).
    if let (Some(current), false) = (&current, refused) {
        pending.makes |= carries_refused(followed, current);
    }
    // What it removes waits for a drain of listeners: so does what names
    // it (the clusters of load assignments waiting), which waits for the
    // drain itself rather than for this type.
    if draining(followed) {
        pending.breaks = false;
    }
    Some(Standing {
        rank,
        in_flight: outstanding.then_some(followed.sent_change),
        pending,
        refused: (!outstanding && refused).then_some(followed.sent_change),
    })
}

/// After a NACK, whether the response for `to` carries again something the
/// refused response added or changed (it is still in `to`): the types after
/// it wait for that response's answer. Not known: it does.
fn carries_refused(followed: &Followed, to: &CollectionSnapshot) -> bool {
    if followed.state.pending_nack().is_none() {
        return false;
    }
    let names = names_of(followed);
    followed.state.refused_between().is_none_or(|(acked, refused)| {
        diff_of(acked, refused)
            .upserts
            .iter()
            .any(|r| to.resources.contains_key(&*r.name) && names.is_none_or(|asked| asked.covers(&r.name)))
    })
}

/// Whether a ranked type's removals wait for a drain of listeners (shown
/// `DRAINING`).
fn draining(followed: &Followed) -> bool {
    let ordered = followed.state.view.ordered.as_ref();
    ordered.is_some_and(|o| o.reason == order::Why::Draining.as_str())
}

/// The names a refused response of a type added or changed (against what
/// the client last ACKed): what the client may not hold. `None`: not known
/// (the ACKed version is not kept any more, or a view of a grant's).
fn refused_names(shared: &Downstream, followed: &Followed) -> Option<Vec<SharedStr>> {
    let state = &followed.state;
    let diff = match state.refused_between() {
        Some((acked, refused)) => diff_of(acked, refused),
        // The ACKed snapshot not kept by the state: the cache's history.
        None => match state.view.acked_version.as_ref() {
            Some(acked) => {
                let refused = state.last_sent()?;
                let base = shared.inner.cache.version_snapshot(&state.view.collection, acked)?;
                diff_of(&base, refused)
            }
            // Nothing ACKed on this stream (a reconnect's first response
            // refused): delta, with the NACK memory, says what it carried,
            // the rest it holds as it reported.
            None => {
                return match state.carried() {
                    Unheld::Names(names) => Some(names.into_iter().collect()),
                    Unheld::Nothing | Unheld::Everything => None,
                };
            }
        },
    };
    Some(diff.upserts.iter().map(|r| r.name.clone()).collect())
}

/// The names going from `held` to `to` removes, in the names asked for.
fn removed_names(
    held: Option<&Arc<CollectionSnapshot>>,
    to: &Arc<CollectionSnapshot>,
    names: Option<&Names>,
) -> Vec<SharedStr> {
    let Some(held) = held.filter(|h| h.version != to.version) else {
        return Vec::new();
    };
    let covers = |name: &str| names.is_none_or(|n| n.covers(name));
    diff_of(held, to)
        .removed
        .iter()
        .filter(|n| covers(n))
        .cloned()
        .collect()
}

/// The clusters that the routes or listeners `to` adds or changes from
/// `held` (in the names asked for) send to: a route's actions, a listener's
/// TCP proxies and inline routes. `None` for any other type.
fn send_targets(
    rank: Rank,
    held: Option<&Arc<CollectionSnapshot>>,
    to: &Arc<CollectionSnapshot>,
    names: Option<&Names>,
) -> Option<Vec<SharedStr>> {
    let read: fn(&crate::cache::CachedResource) -> Arc<[SharedStr]> = match rank {
        Rank::Routes => cluster_refs::route_clusters,
        Rank::Listeners => |listener| cluster_refs::listener_refs(listener).clusters.clone(),
        _ => return None,
    };
    let covers = |name: &str| names.is_none_or(|n| n.covers(name));
    // The diff `change_of` found for the same pair of versions.
    let diff = held.map(|held| diff_of(held, to));
    let changed: Box<dyn Iterator<Item = &Arc<crate::cache::CachedResource>>> = match &diff {
        Some(diff) => Box::new(diff.upserts.iter()),
        None => Box::new(to.resources.values()),
    };
    let mut targets: Vec<SharedStr> = changed
        .filter(|r| covers(&r.name))
        .flat_map(|r| read(r).iter().cloned().collect::<Vec<_>>())
        .collect();
    targets.sort();
    targets.dedup();
    Some(targets)
}

fn loop_refusal(shared: &Downstream, peer: &str) -> Option<Status> {
    let provenance = shared.inner.cache.provenance();
    provenance.is_upstream_or_self(peer).then(|| {
        Status::failed_precondition(format!(
            "gateway {peer} is this gateway ({}) or upstream of it (upstream chain: {}): serving it would make a \
             loop; fix its --upstream so that config flows one way",
            provenance.gateway_id,
            provenance.upstream_chain().join(" <- ")
        ))
    })
}

/// A peer that is another gateway: its id, and this gateway's upstream
/// chain as it changes (the peer must never come to be in it). Boxed in the
/// stream: most peers are not gateways.
struct PeerGateway {
    id: String,
    chain: WatchStream<Vec<SharedStr>>,
}

/// Waits for a change of this gateway's upstream chain that makes the
/// gateway peer a loop; pending for other peers and other changes.
/// Cancel-safe.
fn chain_changed<'a>(
    peer_gateway: &'a mut Option<Box<PeerGateway>>,
    shared: &'a Downstream,
) -> impl Future<Output = Status> + 'a {
    std::future::poll_fn(move |cx| {
        if let Some(peer) = peer_gateway {
            // Ended (the chain's sender gone): pending from then on.
            while let Poll::Ready(Some(_)) = Stream::poll_next(std::pin::Pin::new(&mut peer.chain), cx) {
                if let Some(refused) = loop_refusal(shared, &peer.id) {
                    return Poll::Ready(refused);
                }
            }
        }
        Poll::Pending
    })
}

/// Waits for the next change of the source's refusals; pending when nothing
/// is watched. Cancel-safe.
fn refusals_changed(refusals: &mut Option<Box<WatchStream<SubscriptionState>>>) -> impl Future<Output = ()> + '_ {
    std::future::poll_fn(move |cx| {
        let Some(watch) = refusals else {
            return Poll::Pending;
        };
        match Stream::poll_next(std::pin::Pin::new(&mut **watch), cx) {
            Poll::Ready(Some(_)) => Poll::Ready(()),
            // Its sender gone: not watched any more.
            Poll::Ready(None) => {
                *refusals = None;
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    })
}

/// A NACK's code and message, the message read up to `max` bytes and kept
/// with its full length. Of a collection of secrets (`sensitive`), the
/// message is not kept: a client's error about a secret may quote it
/// (Envoy's validation errors quote the field's value), and every view, the
/// log and `status` would show it; its length and code are.
fn read_nack(detail: Bytes, max: usize, sensitive: bool) -> Nack {
    let detail = ErrorDetail::parse(detail, max).unwrap_or_else(|e| ErrorDetail {
        code: tonic::Code::Unknown as i32,
        message: format!("(the NACK's error_detail does not decode: {e})"),
        message_len: 0,
    });
    let message = if sensitive {
        format!(
            "[redacted: the message of a NACK of a collection of secrets, {} bytes; the client's log has it]",
            detail.message_len.max(detail.message.len())
        )
    } else if detail.message_len > detail.message.len() {
        metrics::counter!(m::NACK_MESSAGES_TRUNCATED).increment(1);
        format!("{}… ({} bytes in all)", detail.message, detail.message_len)
    } else {
        detail.message
    };
    Nack {
        code: detail.code,
        message,
    }
}

impl<W: Wire> TypedStream<W> {
    /// The stream's first type is followed: one line, peer, node and
    /// protocol (rate-limited per peer address).
    fn log_connected(&self) {
        let view = self.entry.view();
        if let Some(skipped) = self.shared.peer_log(view.peer) {
            tracing::info!(
                stream = self.id,
                peer = view.peer.map(|p| p.to_string()),
                node = view.node_id,
                protocol = W::PROTOCOL.as_str(),
                skipped_client_lines = skipped,
                "client connected"
            );
        }
    }

    /// The stream's end waited `wait` (`--stream-end-timeout`) for its
    /// client to take what it was sent, in vain: it was reset (or, on a
    /// stream the gateway dialed out, ended after what its queue held).
    /// Counted, and logged per peer.
    fn cut_short(&self, wait: std::time::Duration) {
        m::limit_refused("stream_end_timeout");
        let (node, peer) = self.entry.who();
        if let Some(skipped) = self.shared.peer_log(peer) {
            tracing::info!(
                stream = self.id,
                peer = peer.map(|p| p.to_string()),
                node,
                skipped,
                "the client did not take what it was sent within --stream-end-timeout={}: its stream was cut short \
                 without its status (reset CANCEL; a dialed-out stream ends after what its queue holds)",
                humantime::format_duration(wait)
            );
        }
    }

    /// The stream ended: why, after how long, and what it had ACKed of each
    /// type (`type=version`; `-` for nothing).
    fn log_left(&self, end: End, status: Option<&Status>) {
        let view = self.entry.view();
        // A refusal is a configuration error (a loop of gateways, a client
        // the gateway cannot serve): a warning, whatever the rate of lines.
        if end == End::Refused {
            tracing::warn!(
                stream = self.id,
                peer = view.peer.map(|p| p.to_string()),
                node = view.node_id,
                gateway = view.gateway_id,
                detail = status.map(Status::message),
                "refused to serve this client"
            );
        }
        let Some(skipped) = self.shared.peer_log(view.peer) else {
            return;
        };
        let connected_seconds = view.connected_since.elapsed().map_or(0.0, |d| d.as_secs_f64());
        let acked: Vec<String> = view
            .types
            .iter()
            .map(|(type_url, t)| format!("{type_url}={}", t.acked_version.as_deref().unwrap_or("-")))
            .collect();
        tracing::info!(
            stream = self.id,
            peer = view.peer.map(|p| p.to_string()),
            node = view.node_id,
            protocol = W::PROTOCOL.as_str(),
            reason = end.as_str(),
            code = status.map(|s| m::code_label(s.code() as i32)),
            detail = status.map(Status::message),
            connected_seconds = (connected_seconds * 10.0).round() / 10.0,
            acked = acked.join(" "),
            skipped_client_lines = skipped,
            "client left"
        );
    }

    /// The type a request is for.
    fn type_for(&self, requested: &str) -> Result<SharedStr, Status> {
        // A type followed already: its key, shared, not a new string per
        // request; a new one: the table's key for it, the same for every
        // stream.
        let new_key = || self.shared.inner.table.type_key(requested);
        if !W::ONE_TYPE {
            return Ok(self.types.key(requested).cloned().unwrap_or_else(new_key));
        }
        match self.types.keys().next() {
            None => Ok(new_key()),
            Some(only) if requested.is_empty() || *requested == **only => Ok(only.clone()),
            Some(only) => Err(Status::invalid_argument(format!(
                "this stream carries type_url {only:?}, and a stream carries one type only (its responses have no \
                 type_url); open another stream for {requested:?}"
            ))),
        }
    }

    /// Whether the stream claims to be a canary, from the node of its
    /// first request (kept for the stream's life; whether the claim counts
    /// is decided per collection, by its identity).
    fn decide_group(&mut self, request: &WireRequest) {
        let rollout = &self.shared.inner.rollout;
        if !rollout.has_canaries() {
            return;
        }
        let node = request.node_id.as_deref().unwrap_or_default();
        if let Some(selector) = rollout.claim(node, &request.node_labels) {
            self.canary = Some(Box::new(Canary {
                rollout: rollout.clone(),
                stream: self.id,
                node: if node.is_empty() {
                    format!("(stream {})", self.id)
                } else {
                    node.to_owned()
                },
                selector: selector.to_owned(),
                collections: Vec::new(),
                refused: Vec::new(),
            }));
        }
    }

    /// Starts following a type: resolves it, subscribes to its collection,
    /// and notes what the client says it holds.
    fn follow(&mut self, type_url: &SharedStr, request: &WireRequest) -> Result<(), Status> {
        let target = W::resolve(&self.shared, type_url)?;
        self.shared.check_type_count(self.types.len())?;
        if let Some(e) = request.reported.iter().find_map(|e| version_entry(e).err()) {
            return Err(Status::invalid_argument(format!(
                "initial_resource_versions does not decode as a map of names to versions: {e}"
            )));
        }
        let held = match request.mode {
            Mode::Full if !request.version_info.is_empty() => Held::Version((&*request.version_info).into()),
            Mode::Full => Held::Reported(ReportedNames::default()),
            Mode::Incremental => Held::Reported(ReportedNames::with_versions(
                request.reported.iter().filter_map(|e| version_entry(e).ok()),
            )),
        };
        let mut grant = None;
        let (resolved, answer, named, woken_by) = match target {
            Target::Collection(resolved) => {
                // Not marked seen: a reload this stream has not yet applied
                // to its other types still wakes it (`regrant`).
                let policy = self.policy.borrow().clone();
                grant = match self
                    .shared
                    .grant(&policy, &self.identity, type_url, &resolved.collection)?
                {
                    Some(names) => {
                        let hold = self.shared.hold_grant(&resolved.collection, &names, true)?;
                        Some(Restriction::new(names, hold))
                    }
                    None => None,
                };
                self.shared.follow(&resolved.collection);
                let awaited = W::ANSWERS_EVERY_TYPE && self.shared.inner.cache.get(&resolved.collection).is_none();
                if awaited && self.refusals.is_none() {
                    let watch = self.shared.inner.subscriptions.watch();
                    self.refusals = Some(Box::new(WatchStream::from_changes(watch)));
                }
                // Already overdue (another client waited for it): empty at once.
                let overdue = awaited && self.shared.inner.subscriptions.is_overdue(&resolved.collection);
                let rollout = &self.shared.inner.rollout;
                // A claim counts when its identity allows it, and not for a
                // client that reads part of a collection: that holds
                // versions of its own, which a canary round cannot count.
                let canary = self.canary.as_mut().is_some_and(|canary| {
                    canary.decide(
                        &policy,
                        &self.identity,
                        &resolved.collection,
                        grant.is_some(),
                        &self.entry,
                    )
                });
                let (slot, wakes) = rollout.watch(&resolved.collection, canary);
                // Among its slot's followers before the slot is read.
                let woken_by = WokenBy::Slot(wakes.follow(self.entry.handle()));
                let named = (!canary).then_some(wakes);
                let answer = if overdue {
                    Answer::overdue(slot, resolved.collection.clone())
                } else {
                    Answer::Served(slot)
                };
                (resolved, answer, named, woken_by)
            }
            Target::Unserved => {
                let collection: SharedStr = SharedStr::from(UNSERVED);
                let resolved = Resolved {
                    collection: collection.clone(),
                    dialect: Dialect::Xds,
                };
                (
                    resolved,
                    Answer::Unserved(CollectionSnapshot::empty(collection)),
                    None,
                    WokenBy::Nothing,
                )
            }
        };
        self.note_generation(&resolved, request);
        // A type nobody serves is answered once, empty: nothing to order.
        let rank = Rank::of(type_url).filter(|_| !matches!(answer, Answer::Unserved(_)));
        let metrics = self.shared.collection_metrics(&resolved.collection);
        let state = TypeState::new(TypeView::new(resolved), request.mode, W::FAMILY, held);
        let served = !matches!(answer, Answer::Unserved(_));
        let (node, identity) = (self.entry.who().0, self.identity.to_string());
        let mut state = self
            .shared
            .nack_memory()
            .follow(state, W::FAMILY, served, &node, &identity, type_url);
        if W::FAMILY == Family::Xds
            && !self.shared.limits().sotw_resend_unchanged
            && crate::collections::sotw_keeps_what_is_left_out(type_url)
        {
            state = state.sending_changes_only();
        }
        if let Some(names) = self.forced.as_mut().and_then(|f| f.take_pending(type_url)) {
            state.force_resend(&names);
        }
        self.types.insert(
            type_url,
            Followed {
                state,
                metrics,
                answer,
                grant,
                named,
                woken_by,
                rank,
                sent_change: Change::NONE,
                sent_for: None,
            },
        );
        Ok(())
    }

    /// An Istio client reads one of Istio's collections: its release is
    /// learned once (a `--client-generation` rule, its node's
    /// `ISTIO_VERSION`, or the legacy service's dialect), and the skew of the
    /// collection for that release is kept while the stream reads it.
    fn note_generation(&mut self, resolved: &Resolved, request: &WireRequest) {
        let istio = resolved.dialect != Dialect::Xds || resolved.collection.starts_with("istio/");
        if !istio {
            return;
        }
        let tracker = &self.shared.inner.skew;
        let skew = self.skew.get_or_insert_with(|| {
            // Only the legacy service's wire tells a release: 1.0 asks by
            // proto type URL, 1.1 by collection name.
            let dialect = match (W::PROTOCOL, resolved.dialect) {
                (Protocol::Sotw | Protocol::Incremental, Dialect::V1_0) => Some(Generation::of(0)),
                (Protocol::Sotw | Protocol::Incremental, Dialect::V1_1) => Some(Generation::of(1)),
                _ => None,
            };
            let node = request.node_id.as_deref().unwrap_or_default();
            let generation = tracker
                .rules()
                .classify(node, &self.identity.names, &request.node_labels, dialect);
            self.entry.set_generation(generation);
            Box::new(StreamSkew {
                generation,
                interests: Vec::new(),
            })
        });
        if let Some(generation) = skew.generation.generation() {
            if let Some(interest) = tracker.interest(&resolved.collection, generation) {
                skew.interests.push(interest);
            }
        }
    }

    /// The access policy was reloaded: each type is served what the new one
    /// grants (a type it no longer grants ends the stream
    /// `PERMISSION_DENIED`; a changed grant sends the client its new view
    /// of the collection, which takes away what it may no longer read).
    async fn regrant(&mut self, out: &mut Outbound) -> Result<Result<(), ClientGone>, Status> {
        let policy = self.policy.borrow_and_update().clone();
        let mut changed = Vec::new();
        for (type_url, followed) in self.types.iter_mut() {
            if matches!(followed.answer, Answer::Unserved(_)) {
                continue;
            }
            let collection = followed.state.view.collection.clone();
            let grant = self.shared.grant(&policy, &self.identity, type_url, &collection)?;
            let same = match (&grant, &followed.grant) {
                (None, None) => true,
                (Some(a), Some(b)) => a.key == b.grant.key,
                _ => false,
            };
            // A claimed canary may have gained or lost the right to be one.
            let canary = self.canary.as_mut().is_some_and(|canary| {
                canary.decide(&policy, &self.identity, &collection, grant.is_some(), &self.entry)
            });
            let regrouped = regroup(followed, canary, &self.shared.inner.rollout, &self.entry);
            if !same {
                followed.grant = match grant {
                    // A connected client's new grant: held past the limit
                    // rather than cut off.
                    Some(names) => Some(Restriction::new(
                        names.clone(),
                        self.shared.hold_grant(&collection, &names, false)?,
                    )),
                    None => None,
                };
            }
            if !same || regrouped {
                rewire(followed, &self.entry);
                changed.push(type_url.clone());
            }
        }
        for type_url in changed {
            if let Err(gone) = self.try_send(&type_url, out).await {
                return Ok(Err(gone));
            }
        }
        Ok(Ok(()))
    }

    /// Types still waiting for a collection the source has now refused are
    /// answered empty, as if nobody served them; those waiting for one the
    /// source left unanswered past `--demand-timeout` are answered empty
    /// until it delivers it. The watch ends when no type waits any more.
    async fn answer_refused(&mut self, out: &mut Outbound) -> Result<(), ClientGone> {
        let cache = &self.shared.inner.cache;
        let subscriptions = &self.shared.inner.subscriptions;
        let mut answered = Vec::new();
        let mut waiting = false;
        for (type_url, followed) in self.types.iter_mut() {
            let collection = followed.state.view.collection.clone();
            let Answer::Served(slot) = &followed.answer else {
                continue;
            };
            if cache.get(&collection).is_some() {
                continue;
            }
            if subscriptions.is_refused(&collection) {
                tracing::info!(
                    stream = self.id,
                    type_url = %type_url,
                    %collection,
                    "the source refused this collection: the type is answered empty"
                );
                followed.answer = Answer::Unserved(CollectionSnapshot::empty(collection));
                followed.rank = None;
                followed.woken_by = WokenBy::Nothing;
                followed.named = None;
                answered.push(type_url.clone());
            } else if subscriptions.is_overdue(&collection) {
                tracing::info!(
                    stream = self.id,
                    type_url = %type_url,
                    %collection,
                    "the source has not delivered this collection within --demand-timeout: the type is answered \
                     empty until it does"
                );
                followed.answer = Answer::overdue(slot.clone(), collection);
                answered.push(type_url.clone());
            } else {
                waiting = true;
            }
        }
        if !waiting {
            self.refusals = None;
        }
        for type_url in answered {
            self.try_send(&type_url, out).await?;
        }
        Ok(())
    }

    /// Sends what the type's state machine decides, if anything.
    async fn try_send(&mut self, type_url: &SharedStr, out: &mut Outbound) -> Result<(), ClientGone> {
        let Some(followed) = self.types.get(type_url) else {
            return Ok(());
        };
        let current = current_of(followed);
        let now = self.entry.now();
        self.send_from(type_url, current, now, out).await
    }

    /// As [`Self::try_send`], with the cache at `current`, read `now`.
    ///
    /// The response is made before any wait (in [`Self::make`]), and each
    /// wait is boxed (both are rare): this future holds little but its
    /// arguments, and every stream's task holds room for it.
    async fn send_from(
        &mut self,
        type_url: &SharedStr,
        current: Option<Arc<CollectionSnapshot>>,
        now: Stamp,
        out: &mut Outbound,
    ) -> Result<(), ClientGone> {
        // The usual case ends in this statement: the response made and
        // written, with no wait. It is not boxed, so it is never room in
        // the task across a wait: only what the rare cases below keep is.
        let later = match self.make(type_url, current, now) {
            Made::Nothing => return Ok(()),
            Made::Response(response) => match out.try_send(response) {
                TrySend::Sent => return Ok(()),
                TrySend::Gone => return Err(ClientGone),
                TrySend::Full(item) => Later::Wait(item),
            },
            Made::InTurn(push, current) => Later::InTurn(push, current),
        };
        let item = match later {
            Later::Wait(item) => item,
            Later::InTurn(push, current) => Ok(Box::new(
                Box::pin(self.respond_in_turn(type_url, push, current, now)).await,
            )),
        };
        // The client has not read what was sent (or a response made in its
        // turn waits to be): wait for it (boxed, as this is rare and the
        // future is large), but never past shutdown.
        let shutdown = self.shared.inner.shutdown.clone();
        Box::pin(async move {
            tokio::select! {
                sent = out.send(item) => sent,
                _ = shutdown.cancelled() => Ok(()),
            }
        })
        .await
    }

    /// A first response made from what a reconnecting client reported:
    /// work that grows with what the client sent, so one stream at a time,
    /// and the turn is given back before the response is queued (a client
    /// that does not read never holds it).
    async fn respond_in_turn(
        &mut self,
        type_url: &SharedStr,
        push: Push,
        current: Option<Arc<CollectionSnapshot>>,
        now: Stamp,
    ) -> EncodedResponse {
        let shared = self.shared.clone();
        let _turn = Box::pin(shared.heavy_work()).await;
        self.respond(type_url, push, current.as_ref(), now)
    }

    /// What the type's state machine decides to send with the cache at
    /// `current`, read `now`: made here, without waiting, unless it must
    /// wait for its turn.
    fn make(&mut self, type_url: &SharedStr, current: Option<Arc<CollectionSnapshot>>, now: Stamp) -> Made {
        let Some(mut followed) = self.types.get_mut(type_url) else {
            return Made::Nothing;
        };
        let rank = followed.rank;
        if followed.grant.is_some() {
            self.note_withheld(type_url, current.as_ref());
            followed = self.types.get_mut(type_url).expect("followed above");
        }
        // The usual ACK: the client holds `current` and is owed nothing of
        // this type, and no type of the stream is held for another. Neither
        // the order (its change is none: it holds nothing, releases
        // nothing) nor the machine (`holds_current`) would do anything, so
        // neither is asked; a change published since `current` was read
        // wakes the stream as ever.
        if self.withheld.is_none() && followed.state.holds_current(current.as_ref()) {
            if followed.state.note_current(current.as_ref(), now) {
                self.entry.publish(type_url, &followed.state.view);
            }
            return Made::Nothing;
        }
        // A ranked type's response is made for this version (what it sends
        // may be a part of it: make before break).
        let made_for = rank.and(current.as_ref()).map(|c| c.version.clone());
        let Some(current) = self.ordered(type_url, current) else {
            // Held for another type of the stream (make before break).
            return Made::Nothing;
        };
        let Some(followed) = self.types.get_mut(type_url) else {
            return Made::Nothing;
        };
        let acked = followed.state.view.acked_version.clone();
        let shown_sent = followed.state.view.last_sent_version.is_some();
        let woken = match &followed.woken_by {
            WokenBy::Names(registration) => Some(&**registration),
            _ => None,
        };
        let decided = followed.state.next_woken(current.as_ref(), woken);
        if let Some(tally) = followed.state.take_reconnect_tally() {
            nack_memory::record_tally(&followed.state.view.collection, tally);
        }
        match decided {
            Ok(push @ Push::FirstFromReported { .. }) => Made::InTurn(push, current),
            Ok(push) => {
                let response = self.respond(type_url, push, current.as_ref(), now);
                if made_for.is_some() {
                    if let Some(followed) = self.types.get_mut(type_url) {
                        followed.sent_for = made_for;
                    }
                }
                Made::Response(response)
            }
            Err(_) => {
                // Nothing to send. A named client that none of the change
                // touched holds the new version as well: that counts as its
                // ACK for a canary round, which would otherwise wait for it.
                let settled = followed.state.view.acked_version != acked;
                if let (true, Some(canary), Some(version)) = (settled, &self.canary, &followed.state.view.acked_version)
                {
                    let collection = &followed.state.view.collection;
                    if canary.of(collection) {
                        canary.rollout.canary_acked(collection, self.id, version);
                    }
                }
                // Whether it is behind may have changed; a reconnect at the
                // current version is shown as sent and ACKed (it holds it),
                // not as never sent.
                let held_as_sent = !shown_sent && followed.state.view.last_sent_version.is_some();
                if followed.state.note_current(current.as_ref(), now) || settled || held_as_sent {
                    self.entry.publish(type_url, &followed.state.view);
                }
                Made::Nothing
            }
        }
    }

    /// Make before break across Envoy's types (see [`order`]): what this
    /// type is to be served now (`current`, or what it adds and changes
    /// with what it removes kept), or `None` while its change waits for
    /// another type of the stream. The types' versions are read in one cut
    /// of the rollout (one step of the source: see `Rollout::consistent`).
    fn ordered(
        &mut self,
        type_url: &SharedStr,
        current: Option<Arc<CollectionSnapshot>>,
    ) -> Option<Option<Arc<CollectionSnapshot>>> {
        let followed = self.types.get(type_url)?;
        let Some(rank) = followed.rank else {
            return Some(current);
        };
        // An outstanding response is answered first (the machine waits);
        // nothing delivered is nothing to order.
        if followed.state.view.outstanding || current.is_none() {
            return Some(current);
        }
        let others = self.types.values().filter(|f| f.rank.is_some()).count() - 1;
        let rollout = self.shared.inner.rollout.clone();
        let (current, standings) = if others == 0 {
            (current, Vec::new())
        } else {
            rollout.consistent(|| {
                let standings = self
                    .types
                    .iter()
                    .filter(|(t, _)| t.as_str() != type_url)
                    .filter_map(|(_, f)| standing(f))
                    .collect();
                (current_of(followed), standings)
            })
        };
        let Some(to) = current else {
            return Some(None);
        };
        // A type whose removals of names reported on reconnect wait is not
        // settled: the types it names wait for those too (as for any
        // removal, not while it waits for a drain: those wait for the drain
        // itself, see `standing`).
        let mut standings = standings;
        if let Some(withheld) = &self.withheld {
            for unremoved in &withheld.unremoved {
                let Some(followed) = self.types.get(&unremoved.type_url) else {
                    continue;
                };
                let waits_for_drain = draining(followed);
                for standing in standings
                    .iter_mut()
                    .filter(|s| Some(s.rank) == followed.rank && !waits_for_drain)
                {
                    standing.pending.breaks = true;
                }
            }
        }
        let unremoved = self.unremoved(type_url, rank, &to, &standings);
        let followed = self.types.get(type_url)?;
        let state = &followed.state;
        // Names the client newly asks for are answered at once: Envoy asks
        // for a new cluster's endpoints while it warms the cluster, before
        // it ACKs it.
        let owed = state.named().is_some_and(|n| !n.settled());
        // The version it refused is not sent again: nothing to order.
        let refused_again = followed.refused(&to.version);
        let wants = if refused_again {
            Change::NONE
        } else if others == 0 {
            // Alone, it waits for nothing: what it does is found only when
            // another ranked type comes to wait for it.
            Change {
                makes: true,
                breaks: true,
            }
        } else {
            let mut wants = change_of(state.last_sent(), &to, names_of(followed));
            // After a NACK, the next response carries again what the refused
            // one did (see `standing`).
            wants.makes |= carries_refused(followed, &to);
            wants
        };
        // The client refused what was made for this version (its additions
        // first, or drained clusters kept): nothing goes until the source
        // changes (the machine would see another version and send it).
        if refused_again && !owed {
            self.release(type_url);
            return None;
        }
        if others == 0 || (!owed && !wants.any()) {
            if owed || wants.any() {
                self.types.get_mut(type_url)?.sent_change = Change { makes: true, ..wants };
            }
            self.release_or_hold(type_url, unremoved);
            return Some(Some(to));
        }
        // A refused type holds another's additions only where they depend on
        // what it refused: routes (or listeners, by their TCP proxies and
        // inline routes) that send to a cluster of a refused response of
        // clusters, or to a cluster whose endpoints a refused response of
        // endpoints carried (a route away from a broken cluster goes: grpc
        // asks for the new cluster exactly then).
        if wants.makes || owed {
            let targets = send_targets(rank, state.last_sent(), &to, names_of(followed));
            for standing in standings.iter_mut().filter(|s| s.rank < rank && s.refused.is_some()) {
                let refused_by = self.types.values().find(|f| f.rank == Some(standing.rank));
                let depends = match (&targets, standing.rank, refused_by) {
                    (Some(targets), Rank::Clusters, Some(refused_by)) => {
                        match refused_names(&self.shared, refused_by) {
                            Some(refused) => targets.iter().any(|t| refused.contains(t)),
                            // Not known: held, as a route to it would be.
                            None => true,
                        }
                    }
                    // Endpoints: a route to a cluster whose load assignment the
                    // refused response carried (the client may hold none of
                    // it: a new cluster's would be `503 UH`). A response of
                    // names newly asked for carries them unchanged, so the
                    // response's content is read, not its change.
                    (Some(targets), Rank::Endpoints, Some(refused_by)) => {
                        let clusters = self.types.values().find(|f| f.rank == Some(Rank::Clusters));
                        let clusters = clusters.and_then(current_of);
                        let refused = refused_by.state.last_sent();
                        let asked = names_of(refused_by);
                        targets.iter().any(|t| {
                            let eds = clusters
                                .as_ref()
                                .and_then(|c| c.resources.get(&**t))
                                .and_then(|c| cluster_refs::eds_name(c));
                            let eds = eds.as_ref().unwrap_or(t);
                            asked.is_none_or(|n| n.covers(eds))
                                && refused.is_some_and(|r| r.resources.contains_key(&**eds))
                        })
                    }
                    _ => false,
                };
                if !depends {
                    standing.refused = None;
                }
            }
        }
        let decision = if owed {
            // Its new names go without waiting for the type that names
            // them (Envoy asks for a new cluster's endpoints, and a new
            // listener's routes, before it ACKs that type: they warm until
            // these come), but after the types they name (a reconnecting
            // Envoy's routes wait for its clusters); what it removes still
            // waits for the types that name it.
            let parent = match rank {
                Rank::Endpoints => Some(Rank::Clusters),
                Rank::Routes => Some(Rank::Listeners),
                _ => None,
            };
            let unmade = |c: Change| Change { makes: false, ..c };
            let standings: Vec<Standing> = standings
                .iter()
                .map(|s| match Some(s.rank) == parent {
                    true => Standing {
                        in_flight: s.in_flight.map(unmade),
                        pending: unmade(s.pending),
                        refused: s.refused.map(unmade),
                        ..*s
                    },
                    false => *s,
                })
                .collect();
            order::decide(rank, Change { makes: true, ..wants }, &standings)
        } else {
            order::decide(rank, wants, &standings)
        };
        // What it removes may be what a listener Envoy drains still sends
        // to: the removal waits for the drain (once the order would let it go).
        let mut drained = None;
        let decision = match (&mut self.draining, decision) {
            (Some(draining), Decision::Send) if wants.breaks => {
                let removed = removed_names(state.last_sent(), &to, names_of(followed));
                let held = draining
                    .drains
                    .holds(rank, removed.iter().map(|n| &**n), tokio::time::Instant::now());
                draining.arm();
                let partly = held.as_ref().is_some_and(|(_, names)| names.len() < removed.len());
                let decision = order::after_drain(decision, wants, held.is_some(), partly);
                drained = held;
                decision
            }
            (_, decision) => decision,
        };
        let drain_until = drained.as_ref().map(|(until, _)| *until);
        let wants = Change {
            makes: wants.makes || owed,
            ..wants
        };
        let until = drain_until.map_or(Stamp::NEVER, |until| self.entry.stamp(until));
        match decision {
            Decision::Send => {
                self.types.get_mut(type_url)?.sent_change = wants;
                self.release_or_hold(type_url, unremoved);
                Some(Some(to))
            }
            Decision::MakesFirst(blocker) => {
                // It removes something: it holds something. After a NACK, a
                // state-of-the-world response keeps what the client ACKed,
                // not what it refused (that would be refused again).
                let held = match (state.pending_nack(), state.held(), state.mode()) {
                    (Some(_), Held::At(acked), Mode::Full) => Some(acked.clone()),
                    _ => state.last_sent().cloned(),
                };
                let Some(held) = held else {
                    return Some(Some(to));
                };
                let first = match &drained {
                    // Only what a drained listener still sends to is kept.
                    Some((_, names)) => to.keeping_only(&held, |name| names.contains(name)),
                    None => makes_first(&to, &held),
                };
                self.types.get_mut(type_url)?.sent_change = Change {
                    makes: true,
                    breaks: false,
                };
                self.hold(type_url, blocker, until);
                Some(Some(first))
            }
            Decision::Hold(blocker) => {
                self.hold(type_url, blocker, until);
                None
            }
        }
    }

    /// A ranked type's change (or its removals) waits for `blocker` (a
    /// drain: `until`): shown with the type, counted when it starts
    /// waiting, tried again after every step of the stream.
    fn hold(&mut self, type_url: &SharedStr, blocker: Blocker, until: Stamp) {
        let withheld = &mut self.withheld.get_or_insert_with(Box::default).types;
        if !withheld.iter().any(|t| t == type_url) {
            withheld.push(type_url.clone());
        }
        let Some(followed) = self.types.get_mut(type_url) else {
            return;
        };
        let view = OrderedView {
            waits_for: blocker.rank.as_str(),
            reason: blocker.why.as_str(),
            step: if blocker.removal { "remove" } else { "add" },
            until,
        };
        if followed.state.view.ordered.as_deref() == Some(&view) {
            return;
        }
        let draining = blocker.why == order::Why::Draining;
        let counted = match &followed.state.view.ordered {
            None => true,
            // A removal that waited for the routes now waits for a drain.
            Some(was) => draining && was.reason != view.reason,
        };
        // A drain's hold is counted once, however often another wait comes
        // between (a response of routes in flight while it drains).
        let counted = counted
            && !(draining
                && self
                    .draining
                    .as_mut()
                    .is_some_and(|d| !d.first_hold_of(type_url, until)));
        if counted {
            m::order_held(
                &followed.state.view.collection,
                if draining { "drain" } else { view.step },
            );
        }
        if blocker.why == order::Why::Refused {
            tracing::info!(
                stream = self.id,
                type_url = %type_url,
                waits_for = view.waits_for,
                step = view.step,
                "a change is held: the client refused (NACKed) the change of the type it depends on; it goes once \
                 that type's change is ACKed"
            );
        }
        if draining && counted {
            tracing::info!(
                stream = self.id,
                type_url = %type_url,
                drain_seconds = self.shared.limits().listener_drain_time.as_secs(),
                "a removal waits for a listener the client drains: a listener that sent to what it removes was \
                 changed or removed, and keeps serving its open connections until the drain ends \
                 (--listener-drain-time)"
            );
        }
        followed.state.view.ordered = Some(Box::new(view));
        self.entry.publish(type_url, &followed.state.view);
    }

    /// A ranked type's change goes whole, but for the removals of names it
    /// reported on reconnect that still wait (`unremoved`): shown held
    /// until those go.
    fn release_or_hold(&mut self, type_url: &SharedStr, unremoved: Option<(Blocker, Stamp)>) {
        match unremoved {
            Some((blocker, until)) => self.hold(type_url, blocker, until),
            None => self.release(type_url),
        }
    }

    /// Delta xDS, a type that others name (clusters, load assignments,
    /// route configurations): names the client holds, that the source no
    /// longer has, of which the gateway holds no copy to keep: those a
    /// reconnecting client reports (removed while it was away, or while a
    /// listener drained when the gateway restarted). Their removal is a
    /// removal like any other: it waits for the types that may name them
    /// to settle (the route away from a cluster goes first), and for a
    /// cluster or load assignment, for a drain (`--listener-drain-time`
    /// from then: what the client's listeners drained before it came is
    /// not known, so the drain begins again). The first response goes
    /// without those removals, and each goes once it may. Returns what
    /// the removals still wait for.
    fn unremoved(
        &mut self,
        type_url: &SharedStr,
        rank: Rank,
        to: &Arc<CollectionSnapshot>,
        standings: &[Standing],
    ) -> Option<(Blocker, Stamp)> {
        if rank == Rank::Listeners {
            return None;
        }
        let followed = self.types.get(type_url)?;
        let reported_gone = followed.state.reported_gone(to);
        let mut entry = self
            .withheld
            .as_mut()
            .and_then(|w| {
                let at = w.unremoved.iter().position(|u| u.type_url == *type_url)?;
                Some(w.unremoved.swap_remove(at))
            })
            .unwrap_or_else(|| Unremoved {
                type_url: type_url.clone(),
                names: Default::default(),
                drained: false,
            });
        if entry.names.is_empty() && reported_gone.is_empty() {
            return None;
        }
        entry.names.extend(reported_gone.iter().cloned());
        // The source has it again: what it has is sent as any change. A name
        // the client no longer asks for (Envoy drops a cluster's load
        // assignment with the cluster) is nothing to remove.
        let asked = names_of(followed);
        entry
            .names
            .retain(|name| !to.resources.contains_key(&**name) && asked.is_none_or(|n| n.covers(name)));
        let removal = Change {
            makes: false,
            breaks: true,
        };
        let mut waits = match order::decide(rank, removal, standings) {
            // Never with the first response: a reconnecting Envoy asks for
            // all its types at once, and the types that name these may not
            // have been asked for yet when the first type's is decided.
            Decision::Send if !reported_gone.is_empty() => Some((
                Blocker {
                    rank,
                    why: order::Why::Unacked,
                    removal: true,
                },
                Stamp::NEVER,
            )),
            Decision::Send => None,
            Decision::MakesFirst(blocker) | Decision::Hold(blocker) => Some((blocker, Stamp::NEVER)),
        };
        // A drain of what the client's listeners may still send to, from
        // when its listeners settle on this stream (a client that follows no
        // listeners drains none of ours; a reconnecting one asks for them
        // in the same breath as for its clusters, which may be answered
        // first: noted at the first try that finds them).
        let drain_time = self.shared.limits().listener_drain_time;
        let follows_listeners = self.types.values().any(|f| f.rank == Some(Rank::Listeners));
        if !entry.drained
            && follows_listeners
            && !drain_time.is_zero()
            && matches!(rank, Rank::Clusters | Rank::Endpoints)
        {
            entry.drained = true;
            let draining = self.draining.get_or_insert_with(|| Draining::new(drain_time));
            match rank {
                Rank::Clusters => draining.drains.note(entry.names.clone(), Default::default()),
                _ => draining.drains.note(Default::default(), entry.names.clone()),
            }
        }
        let mut names = std::mem::take(&mut entry.names);
        let mut go = std::collections::BTreeSet::new();
        match (&waits, &mut self.draining) {
            (None, Some(draining)) => {
                let now = tokio::time::Instant::now();
                let held = draining.drains.holds(rank, names.iter().map(|n| &**n), now);
                draining.arm();
                if let Some((until, held)) = held {
                    let blocker = Blocker {
                        rank: Rank::Listeners,
                        why: order::Why::Draining,
                        removal: true,
                    };
                    waits = Some((blocker, self.entry.stamp(until)));
                    go = names.iter().filter(|n| !held.contains(*n)).cloned().collect();
                    names = held;
                } else {
                    go = std::mem::take(&mut names);
                }
            }
            (None, None) => go = std::mem::take(&mut names),
            (Some(_), _) => {}
        }
        let state = &mut self.types.get_mut(type_url)?.state;
        // Before the first response, it removes what may go, not the rest;
        // after, what may go is removed with the next.
        if !state.reported_removals(&go, &names) && !go.is_empty() {
            state.force_resend(go.iter());
        }
        if names.is_empty() {
            return None;
        }
        entry.names = names;
        self.withheld.get_or_insert_with(Box::default).unremoved.push(entry);
        waits
    }

    /// A ranked type waits for nothing any more.
    fn release(&mut self, type_url: &SharedStr) {
        if let Some(withheld) = &mut self.withheld {
            withheld.types.retain(|t| t != type_url);
            if withheld.types.is_empty() && withheld.unremoved.is_empty() {
                self.withheld = None;
            }
        }
        if let Some(followed) = self.types.get_mut(type_url) {
            if followed.state.view.ordered.take().is_some() {
                self.entry.publish(type_url, &followed.state.view);
            }
        }
    }

    /// The types held for another are tried again, in Envoy's order, until
    /// a round sends nothing (what one sends changes what the others wait
    /// for, and the views say it).
    async fn retry_withheld(&mut self, out: &mut Outbound) -> Result<(), ClientGone> {
        // A round can also change what a held type waits for without
        // sending (the endpoints' removal now waits for a drain, so the
        // clusters' does too): rounds go on while either moves, a few at
        // most (one per ranked type).
        for _ in 0..8 {
            let Some(withheld) = &self.withheld else {
                return Ok(());
            };
            let reasons_before = self.held_reasons();
            let mut waiting: Vec<(Option<Rank>, SharedStr)> = withheld
                .types
                .iter()
                .map(|t| (self.types.get(t).and_then(|f| f.rank), t.clone()))
                .collect();
            waiting.sort();
            let before = self.last_nonce;
            for (_, type_url) in waiting {
                self.try_send(&type_url, out).await?;
            }
            if self.last_nonce == before && self.held_reasons() == reasons_before {
                return Ok(());
            }
        }
        Ok(())
    }

    /// What each held type waits for, and why.
    fn held_reasons(&self) -> Vec<(&'static str, &'static str)> {
        let Some(withheld) = &self.withheld else {
            return Vec::new();
        };
        withheld
            .types
            .iter()
            .filter_map(|t| self.types.get(t))
            .filter_map(|f| f.state.view.ordered.as_ref())
            .map(|o| (o.waits_for, o.reason))
            .collect()
    }

    /// A restricted type: how many of the resources the client asks for its
    /// grant withholds, shown with the type and counted as they grow (the
    /// first time a name is withheld, logged).
    fn note_withheld(&mut self, type_url: &SharedStr, view: Option<&Arc<CollectionSnapshot>>) {
        let Some(followed) = self.types.get_mut(type_url) else {
            return;
        };
        let (Some(whole), Some(view)) = (source_of(followed), view) else {
            return;
        };
        let names = followed.state.named().map(|n| n.current().clone());
        if let Some(restriction) = followed.grant.as_mut() {
            let counted = (whole.clone(), names);
            if restriction
                .counted
                .as_ref()
                .is_some_and(|(seen, names)| Arc::ptr_eq(seen, &counted.0) && *names == counted.1)
            {
                return;
            }
            restriction.counted = Some(counted);
        }
        // A view that is the whole withholds nothing.
        let now = if Arc::ptr_eq(&whole, view) {
            0
        } else {
            withheld(followed, &whole, view)
        };
        let before = followed.state.view.withheld;
        let version_changed = followed.state.view.access_version.as_ref() != Some(&view.version);
        if now == before && !version_changed {
            return;
        }
        followed.state.view.withheld = now;
        followed.state.view.access_version = Some(view.version.clone());
        if now > before {
            let collection = &followed.state.view.collection;
            m::access_denied(collection, "name", u64::from(now - before));
            let policy = self.policy.borrow().clone();
            let example = withheld_names(followed, &whole).next();
            let why = policy.denial(&self.identity, collection, example.map(|n| &**n)).log;
            self.shared
                .log_denial(&self.identity, collection, &format!("{now} resources withheld: {why}"));
        }
        self.entry.publish(type_url, &followed.state.view);
    }

    /// Encodes `push` with the next nonce and records it as sent `now`, with
    /// the cache at `current`.
    fn respond(
        &mut self,
        type_url: &SharedStr,
        push: Push,
        current: Option<&Arc<CollectionSnapshot>>,
        now: Stamp,
    ) -> EncodedResponse {
        let followed = self.types.get_mut(type_url).expect("a followed type");
        let forced = cluster_refs::load_assignments_forced_by(type_url, &push, followed.state.last_sent());
        // A listener it changes or removes drains: what the old one sent to
        // stays until the drain ends.
        let drains = (followed.rank == Some(Rank::Listeners) && !self.shared.limits().listener_drain_time.is_zero())
            .then(|| followed.state.last_sent().cloned())
            .flatten()
            .map(|held| (held, push.to().clone()));
        let nonce = Nonce::next(&mut self.last_nonce);
        let (parts, suffix) = W::encode(&push, type_url, nonce.text(&mut itoa::Buffer::new()));
        let to = push.to().clone();
        followed.state.sent_at(nonce, to.clone(), now);
        followed.state.note_current(current, now);
        let record = Record {
            snapshot: to,
            metrics: followed.metrics.clone(),
        };
        let response = EncodedResponse::new(parts, suffix, Some(record));
        let len = response.len();
        followed.state.view.oversized_bytes = (len > m::LEGACY_CLIENT_LIMIT)
            .then(|| std::num::NonZeroU32::new(u32::try_from(len).unwrap_or(u32::MAX)))
            .flatten();
        followed.metrics.pushes.increment(1);
        self.entry.publish(type_url, &followed.state.view);
        if !forced.is_empty() {
            self.force_resend(cluster_refs::LOAD_ASSIGNMENT_TYPE_URL, forced);
        }
        if let Some((held, to)) = drains {
            self.note_drains(&held, &to);
        }
        response
    }

    /// A response of listeners goes from `held` to `to`: each listener it
    /// changes or removes drains, and what the old one sent to (its TCP
    /// proxies' and inline routes' clusters, and those of the route
    /// configurations it read that the source no longer serves: one it
    /// still serves reaches the draining listener as it changes) waits for
    /// the drain, with those clusters' load assignments.
    fn note_drains(&mut self, held: &Arc<CollectionSnapshot>, to: &Arc<CollectionSnapshot>) {
        let diff = diff_of(held, to);
        let changed = diff
            .upserts
            .iter()
            .map(|r| &r.name)
            .filter(|name| held.resources.contains_key(&***name))
            .chain(diff.removed.iter());
        let routes = self.types.get(cluster_refs::ROUTE_CONFIGURATION_TYPE_URL);
        let routes_held = routes.and_then(|f| f.state.last_sent());
        let routes_now = routes.and_then(current_of);
        let mut clusters = std::collections::BTreeSet::new();
        for name in changed {
            let Some(old) = held.resources.get(&**name) else {
                continue;
            };
            let refs = cluster_refs::listener_refs(old);
            clusters.extend(refs.clusters.iter().cloned());
            for route in refs.routes.iter() {
                if routes_now
                    .as_ref()
                    .is_some_and(|now| now.resources.contains_key(&**route))
                {
                    continue;
                }
                if let Some(route) = routes_held.and_then(|held| held.resources.get(&**route)) {
                    clusters.extend(cluster_refs::route_clusters(route).iter().cloned());
                }
            }
        }
        if clusters.is_empty() {
            return;
        }
        let clusters_held = self
            .types
            .get(cluster_refs::CLUSTER_TYPE_URL)
            .and_then(|f| f.state.last_sent());
        let load_assignments = clusters
            .iter()
            .filter_map(|c| clusters_held.and_then(|held| held.resources.get(&**c)))
            .filter_map(|c| cluster_refs::eds_name(c))
            .collect();
        let drain_time = self.shared.limits().listener_drain_time;
        let draining = self.draining.get_or_insert_with(|| Draining::new(drain_time));
        draining.drains.note(clusters, load_assignments);
    }

    /// The first of the stream's drains ended: the removals that waited
    /// for it are tried again after this step.
    fn drain_ended(&mut self) {
        let Some(draining) = &mut self.draining else {
            return;
        };
        if draining.drains.expire(tokio::time::Instant::now()) {
            self.draining = None;
        } else {
            draining.arm();
        }
    }

    /// The stream's listeners and routes settled (nothing outstanding,
    /// refused or to send): a listener changed before is warm, and Envoy
    /// drains the one it replaced from now.
    fn note_settled(&mut self) {
        if !self.draining.as_ref().is_some_and(|d| d.drains.unsettled()) {
            return;
        }
        let settled = self
            .types
            .values()
            .filter(|f| matches!(f.rank, Some(Rank::Listeners | Rank::Routes)))
            .filter_map(standing)
            .all(|s| s.in_flight.is_none() && s.refused.is_none() && !s.pending.any());
        if let (true, Some(draining)) = (settled, &mut self.draining) {
            draining.drains.settled(tokio::time::Instant::now());
            draining.arm();
        }
    }

    /// The client is to be sent `names` of `type_url` again, whatever it
    /// holds, right after the response going out (or, for a type it does
    /// not follow yet, should it reconnect with it).
    fn force_resend(&mut self, type_url: &str, names: Vec<SharedStr>) {
        let forced = self.forced.get_or_insert_with(Box::default);
        match self.types.get_mut(type_url) {
            Some(followed) => {
                let count = followed.state.force_resend(&names);
                metrics::counter!(m::FORCED_RESENDS, "collection" => crate::metrics::label(&followed.state.view.collection))
                    .increment(count as u64);
                forced.owe(type_url);
            }
            None => forced.pend(type_url, names),
        }
    }

    /// Whether [`Self::after_step`] has more to do than note that the
    /// stream settled: a resend owed, or a type held for another.
    fn owes_after_step(&self) -> bool {
        self.owes_forced() || self.withheld.is_some()
    }

    fn owes_forced(&self) -> bool {
        self.forced.as_ref().is_some_and(|f| f.is_owed())
    }

    /// After a step: the resends it forced, then the types held for another
    /// that it may let go, then the resends those forced.
    async fn after_step(&mut self, out: &mut Outbound) -> Result<(), ClientGone> {
        if self.owes_forced() {
            self.send_forced(out).await?;
        }
        if self.withheld.is_some() {
            self.retry_withheld(out).await?;
            if self.owes_forced() {
                self.send_forced(out).await?;
            }
        }
        self.note_settled();
        Ok(())
    }

    /// Sends the types a resend was forced on.
    async fn send_forced(&mut self, out: &mut Outbound) -> Result<(), ClientGone> {
        let owed = self.forced.as_mut().map(|f| f.take_owed()).unwrap_or_default();
        for type_url in owed {
            // Only a followed type is sent (its key, shared).
            if let Some(type_url) = self.types.key(&type_url).cloned() {
                self.try_send(&type_url, out).await?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::cache::{Cache, CachedResource, Origin, Update};
    use crate::transport::access::Grant;

    /// A grant of names read from a policy that grants `names`.
    fn grant_of(names: &str) -> Arc<NameGrant> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(
            &path,
            format!("rules:\n- identities: [unauthenticated]\n  collections: [c]\n  names: [\"{names}\"]\n"),
        )
        .unwrap();
        let policy = AccessPolicy::load(&path).unwrap();
        match policy.grant(&PeerIdentity::default(), "c", false) {
            Some(Grant::Names(grant)) => grant,
            other => panic!("{other:?}"),
        }
    }

    /// A stream's restriction to `names`, held among `grants`.
    fn restricted_to(grants: &Arc<super::super::grants::Grants>, names: &str) -> Box<Restriction> {
        let grant = grant_of(names);
        let hold = grants.hold(&"c".into(), &grant.key, true).unwrap();
        Restriction::new(grant, hold)
    }

    fn resource(name: &str, version: &str) -> CachedResource {
        let body = bytes::Bytes::from(format!("{name}@{version}"));
        let digest = crate::cache::content_digest(&body, std::iter::empty(), std::iter::empty());
        CachedResource::new(name.into(), body, digest)
    }

    /// A grant whose names happen to keep everything is served the whole
    /// snapshot, and no version is kept alive by its own memo (the view of
    /// a whole was the whole, held in the whole's memo: never freed).
    #[test]
    fn a_view_that_keeps_everything_is_the_whole_and_frees_it() {
        let (cache, mut writer) = Cache::with_history(1);
        let grants = super::super::grants::Grants::new(8);
        let restriction = restricted_to(&grants, "r*");
        writer.apply(
            "c",
            Update::Full(vec![resource("r1", "1"), resource("r2", "1")]),
            Origin::Upstream,
        );
        let first = cache.get("c").unwrap();
        let view = restricted(&first, &restriction);
        assert!(Arc::ptr_eq(&view, &first), "the whole itself");
        let gone: Weak<crate::cache::CollectionSnapshot> = Arc::downgrade(&first);
        drop((first, view));
        writer.apply(
            "c",
            Update::Full(vec![resource("r1", "2"), resource("r2", "1")]),
            Origin::Upstream,
        );
        let second = cache.get("c").unwrap();
        assert!(Arc::ptr_eq(&restricted(&second, &restriction), &second));
        assert!(gone.upgrade().is_none(), "the first version is freed");

        // A grant that keeps part: a view of its own, made once per version.
        let part = restricted_to(&grants, "r1");
        let view = restricted(&second, &part);
        assert_eq!(view.len(), 1);
        let other_stream = restricted_to(&grants, "r1");
        assert!(
            Arc::ptr_eq(&restricted(&second, &other_stream), &view),
            "shared by the grant's clients"
        );
        assert_eq!(grants.held("c"), 2, "r* and r1");

        // The view goes with the last stream that reads it, and so does its
        // grant's place among those served.
        let weak = Arc::downgrade(&view);
        drop((view, part, other_stream));
        assert!(weak.upgrade().is_none(), "nobody reads it: freed, the version kept");
        assert_eq!(grants.held("c"), 1);
    }
}
