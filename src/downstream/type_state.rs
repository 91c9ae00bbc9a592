//! One client's state for one type, and the protocol's rules as a pure state
//! machine: no I/O, no `.await`, no clock. Inputs are the client's requests
//! and the cache's current snapshot; outputs say what to send (and from what
//! base), or why nothing is sent. Every protocol (the legacy aggregated
//! services, `ResourceSource`, xDS) is an adapter that reads its requests
//! into a [`Request`] and encodes the [`Push`] it is told.
//!
//! The rules (Istio's MCP server, and what it got wrong):
//! - A request is accepted when nothing was sent for the type yet (whatever
//!   its nonce: istiod sends one it was never given), or when its nonce is
//!   the last one sent. Anything else is stale and ignored.
//! - One response outstanding per type; changes meanwhile coalesce to the
//!   latest.
//! - A NACKed version is never sent to that client again; the next version is.
//! - Nothing is sent before the source delivered the collection.
//! - A client already at the current version gets nothing.
//! - xDS clients may name the resources they want ([`super::names`]):
//!   their responses are their own, built from their names; subscription
//!   changes count on every request, whatever its nonce.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use super::names::{Holds, NameChange, Named, TooManyNames};
use super::registry::{NackRecord, Stamp, TypeView};
use crate::cache::{CollectionSnapshot, Diff};

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

/// What the client holds, as far as the gateway knows.
#[derive(Clone, Debug)]
pub enum Held {
    /// Before the first response: nothing, or the names it reported
    /// (kept only until the first response is built).
    Reported(ReportedNames),
    /// Before the first response: the version it reported holding (a
    /// state-of-the-world client reconnecting).
    Version(Arc<str>),
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

/// A client's request for this type, as an adapter read it.
#[derive(Debug)]
pub struct Request<'a> {
    pub nonce: &'a str,
    /// `Some` for a NACK.
    pub nack: Option<Nack>,
    /// The names it asks for (xDS); legacy protocols name none.
    pub names: NameChange<'a>,
    /// `--max-subscribed-names`.
    pub max_names: usize,
    /// When it came (the views' clock: the machine reads none).
    pub at: Stamp,
}

impl<'a> Request<'a> {
    /// A request that names nothing.
    pub fn new(nonce: &'a str, nack: Option<Nack>) -> Self {
        Request {
            nonce,
            nack,
            names: NameChange::Replace(&[]),
            max_names: usize::MAX,
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
    /// Its nonce is not the last one sent (or it has none), and it changed
    /// the names subscribed: that counts, nothing is ACKed.
    Subscription,
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
    /// The client NACKed the current version: it is not sent again.
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
    /// does not have: versions alone cannot show that a source reused one
    /// for another body, so nothing is skipped on the client's word.
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
    held: Held,
    /// The snapshot of the outstanding (or last) response.
    sent: Option<Arc<CollectionSnapshot>>,
    /// The names the client asks for, once it named any (boxed: most
    /// clients take everything).
    named: Option<Box<Named>>,
    /// What the debug views show; kept in step with the state.
    pub view: TypeView,
}

impl TypeState {
    pub fn new(view: TypeView, mode: Mode, held: Held) -> Self {
        let mut state = Self {
            mode,
            held,
            sent: None,
            named: None,
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

    /// A request for this type.
    pub fn on_request(&mut self, request: Request<'_>) -> Verdict {
        self.view.last_request_at = request.at;
        let holds_all = matches!(self.held, Held::At(_));
        let changed = match Named::apply(
            &mut self.named,
            request.names,
            holds_all,
            self.view.outstanding,
            request.max_names,
        ) {
            Ok(changed) => changed,
            Err(TooManyNames { count }) => return Verdict::TooManyNames { count },
        };
        if let Some(named) = &self.named {
            self.view.subscribed = Some(named.current().into());
        }
        let Some(sent_nonce) = &self.view.last_sent_nonce else {
            return Verdict::First;
        };
        if *sent_nonce != request.nonce {
            if changed {
                return Verdict::Subscription;
            }
            return Verdict::Stale {
                expected: sent_nonce.clone(),
            };
        }
        self.view.outstanding = false;
        let sent = self.sent.clone().expect("a nonce is only issued with a snapshot");
        match request.nack {
            Some(nack) => {
                self.view.last_nack = Some(Box::new(NackRecord {
                    version: sent.version.clone(),
                    code: nack.code,
                    message: nack.message,
                    at: request.at,
                    superseded: false,
                }));
                if let Some(named) = &mut self.named {
                    named.on_nack();
                }
                match self.held {
                    Held::AwaitingFirst { reported_names: true } => Verdict::Unrecoverable,
                    // It still holds nothing.
                    Held::AwaitingFirst { reported_names: false } => {
                        self.held = Held::Reported(ReportedNames::default());
                        Verdict::Nack
                    }
                    _ => Verdict::Nack,
                }
            }
            None => {
                if let Some(named) = &mut self.named {
                    named.on_ack();
                }
                self.view.acked_version = Some(sent.version.clone());
                self.view.acked_at = request.at;
                if let Some(nack) = &mut self.view.last_nack {
                    nack.superseded = true;
                }
                self.held = Held::At(sent);
                Verdict::Ack
            }
        }
    }

    /// What to send now, given the cache's current snapshot. When it says
    /// `Push`, the adapter must send it and then call [`Self::sent`].
    pub fn next(&mut self, current: Option<&Arc<CollectionSnapshot>>) -> Result<Push, Wait> {
        if self.view.outstanding {
            return Err(Wait::Outstanding);
        }
        let current = current.ok_or(Wait::NotDelivered)?;
        if self
            .view
            .last_nack
            .as_ref()
            .is_some_and(|n| n.version == current.version)
        {
            return Err(Wait::Nacked);
        }
        let to = current.clone();
        let settled = self.named.as_ref().is_none_or(|n| n.settled());
        let send = match (&self.held, self.mode) {
            (Held::At(held), _) if held.version == current.version && settled => return Err(Wait::UpToDate),
            (Held::Version(held), _) if *held == current.version && settled => return Err(Wait::UpToDate),
            (Held::AwaitingFirst { .. }, _) => return Err(Wait::Outstanding),
            (_, Mode::Full) => match &self.named {
                Some(named) if !named.current().wildcard => Push::Selected {
                    diff: Diff {
                        upserts: named.selected(&to),
                        removed: Vec::new(),
                    },
                    to,
                },
                _ => Push::Full { to },
            },
            (Held::At(from), Mode::Incremental) => match self.named.as_deref_mut() {
                Some(named) if !named.is_everything() => {
                    let diff = named.changes(Holds::Snapshot(from), &to);
                    if diff.is_empty() {
                        // Nothing it asks for changed: it holds `to` as well
                        // (and is shown at its version).
                        named.settle();
                        self.view.acked_version = Some(to.version.clone());
                        self.held = Held::At(to);
                        return Err(Wait::UpToDate);
                    }
                    Push::Selected { to, diff }
                }
                _ => Push::Diff { from: from.clone(), to },
            },
            (Held::Reported(reported), Mode::Incremental)
                if self.named.as_ref().is_some_and(|n| !n.first_is_shared()) =>
            {
                let named = self.named.as_ref().expect("matched above");
                let diff = named.changes(Holds::Reported(reported), &to);
                self.held = Held::AwaitingFirst {
                    reported_names: !reported.is_empty(),
                };
                Push::Selected { to, diff }
            }
            (Held::Reported(reported), Mode::Incremental) if !reported.is_empty() => {
                let Held::Reported(reported) =
                    std::mem::replace(&mut self.held, Held::AwaitingFirst { reported_names: true })
                else {
                    unreachable!("matched above")
                };
                Push::FirstFromReported { to, reported }
            }
            (Held::Reported(_) | Held::Version(_), Mode::Incremental) => {
                self.held = Held::AwaitingFirst { reported_names: false };
                Push::Full { to }
            }
        };
        Ok(send)
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
    pub fn sent_at(&mut self, nonce: String, to: Arc<CollectionSnapshot>, at: Stamp) {
        self.view.last_sent_at = at;
        self.sent(nonce, to);
    }

    pub fn sent(&mut self, nonce: String, to: Arc<CollectionSnapshot>) {
        if let Some(named) = &mut self.named {
            named.on_sent();
        }
        self.view.outstanding = true;
        self.view.last_sent_nonce = Some(nonce);
        self.view.last_sent_version = Some(to.version.clone());
        self.sent = Some(to);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Cache, CacheWriter, CachedResource, Origin, Update};
    use crate::collections::{Dialect, Resolved};
    use crate::downstream::names::NameChange;

    const C: &str = "c";

    /// Each resource's body is its name.
    fn snapshot(cache: &Cache, writer: &mut CacheWriter, names: &[&str]) -> Arc<CollectionSnapshot> {
        let entries: Vec<(&str, &str)> = names.iter().map(|n| (*n, *n)).collect();
        with_bodies(cache, writer, &entries)
    }

    fn state(mode: Mode, held: Held) -> TypeState {
        TypeState::new(
            TypeView::new(Resolved {
                collection: C.into(),
                dialect: Dialect::V1_1,
            }),
            mode,
            held,
        )
    }

    fn nothing() -> Held {
        Held::Reported(ReportedNames::default())
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
        state.sent(nonce.into(), send.to().clone());
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
                    Req("n1", None, Verdict::Ack),
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
                    Req("other", None, Verdict::Stale { expected: "n1".into() }),
                    Next(&v2, Err(Wait::Outstanding)),
                ],
            ),
            (
                "a NACKed version is held, the next one is sent",
                Mode::Full,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("n1", Some(&v1v), Verdict::Nack),
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
                    Req("n1", None, Verdict::Ack),
                    Next(&v2, Ok("diff")),
                ],
            ),
            (
                "incremental: the first response from reported names, then diffs",
                Mode::Incremental,
                Held::Reported(ReportedNames::new(["a", "gone"])),
                vec![
                    Next(&v1, Ok("first")),
                    Req("n1", None, Verdict::Ack),
                    Next(&v1, Err(Wait::UpToDate)),
                    Next(&v2, Ok("diff")),
                ],
            ),
            (
                "incremental: a NACK of the first response built from reported names cannot be recovered",
                Mode::Incremental,
                Held::Reported(ReportedNames::new(["gone"])),
                vec![Next(&v1, Ok("first")), Req("n1", Some(&v1v), Verdict::Unrecoverable)],
            ),
            (
                "incremental: a NACK of a first response from nothing: the whole collection again",
                Mode::Incremental,
                nothing(),
                vec![
                    Next(&v1, Ok("full")),
                    Req("n1", Some(&v1v), Verdict::Nack),
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
                    Req("n1", None, Verdict::Ack),
                    Next(&v2, Ok("diff")),
                    Req("n2", Some(&v2v), Verdict::Nack),
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
                        let got = step_with(&mut s, current, &format!("n{nonce}"));
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
                CachedResource::new((*n).into(), "1".into(), "t".into(), body, digest)
            })
            .collect();
        writer.apply(C, Update::Full(resources), Origin::Upstream);
        cache.get(C).unwrap()
    }

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// Sends what `next` decides with nonce `n{count}`; returns the push.
    fn send(s: &mut TypeState, current: &Arc<CollectionSnapshot>, nonce: &str) -> Push {
        let push = s.next(Some(current)).expect("something to send");
        s.sent(nonce.into(), push.to().clone());
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
        assert_eq!(selected(&send(&mut s, &v1, "n1")), (vec!["a"], vec![]));
        assert_eq!(ask(&mut s, "n1", &["a", "ghost"]), Verdict::Ack);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::UpToDate);
        // A new name with the same nonce (Envoy asks for a new route with
        // its last ACK): the new set, at the same version.
        assert_eq!(ask(&mut s, "n1", &["a", "b"]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v1, "n2")), (vec!["a", "b"], vec![]));
        // A change while a response is outstanding (a stale nonce) counts,
        // and is answered once the outstanding one is.
        assert_eq!(ask(&mut s, "n1", &["c"]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v1)).unwrap_err(), Wait::Outstanding);
        assert_eq!(ask(&mut s, "n2", &["c"]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v1, "n3")), (vec!["c"], vec![]));
        assert_eq!(ask(&mut s, "n3", &["c"]), Verdict::Ack);
        // Once a name was asked for, an empty list is nothing, not everything.
        assert_eq!(ask(&mut s, "n3", &[]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v1, "n4")), (vec![], vec![]));
        assert_eq!(ask(&mut s, "n4", &["*"]), Verdict::Ack);
        assert!(
            matches!(send(&mut s, &v1, "n5"), Push::Full { .. }),
            "\"*\" is everything"
        );

        // A client that names nothing is wildcard, and served the shared
        // response.
        let mut s = state(Mode::Full, nothing());
        assert_eq!(ask(&mut s, "", &[]), Verdict::First);
        assert!(matches!(send(&mut s, &v1, "n1"), Push::Full { .. }));
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
        let mut s = state(Mode::Incremental, nothing());
        assert_eq!(change(&mut s, "", &["a", "ghost"], &[]), Verdict::First);
        // A name that does not exist is removed, and stays subscribed.
        assert_eq!(selected(&send(&mut s, &v1, "n1")), (vec!["a"], vec!["ghost"]));
        assert_eq!(change(&mut s, "n1", &[], &[]), Verdict::Ack);
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
        assert_eq!(selected(&send(&mut s, &v3, "n2")), (vec!["ghost"], vec![]));
        assert_eq!(change(&mut s, "n2", &[], &[]), Verdict::Ack);
        // A spontaneous subscription (no nonce) counts; a name the client
        // already has is sent again.
        assert_eq!(change(&mut s, "", &["a", "b"], &[]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v3, "n3")), (vec!["a", "b"], vec![]));
        assert_eq!(change(&mut s, "n3", &[], &[]), Verdict::Ack);
        // An unsubscription needs no response.
        assert_eq!(change(&mut s, "", &[], &["b", "never"]), Verdict::Subscription);
        assert_eq!(s.next(Some(&v3)).unwrap_err(), Wait::UpToDate);
        // What it asks for changes and goes: a diff of what it holds.
        let v4 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "3"), ("c", "1")]);
        assert_eq!(selected(&send(&mut s, &v4, "n4")), (vec!["a"], vec!["ghost"]));
        assert_eq!(change(&mut s, "n4", &[], &[]), Verdict::Ack);
        // Wildcard beside names; a name unsubscribed that wildcard still
        // covers is sent again (the client may have dropped it).
        assert_eq!(change(&mut s, "", &["*"], &[]), Verdict::Subscription);
        assert_eq!(selected(&send(&mut s, &v4, "n5")), (vec!["b", "c"], vec![]));
        assert_eq!(change(&mut s, "n5", &[], &["a"]), Verdict::Ack);
        assert_eq!(selected(&send(&mut s, &v4, "n6")), (vec!["a"], vec![]));
        assert_eq!(change(&mut s, "n6", &[], &[]), Verdict::Ack);
        // Wildcard and nothing owed: the shared diffs.
        let v5 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "3")]);
        let push = send(&mut s, &v5, "n7");
        assert!(matches!(push, Push::Diff { .. }), "{push:?}");
    }

    #[test]
    fn a_nacked_version_is_not_resent_for_a_new_name_but_the_next_one_carries_it() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1")]);
        let mut s = state(Mode::Incremental, nothing());
        let sub = names(&["a"]);
        fn request<'a>(nonce: &'a str, nack: Option<Nack>, subscribe: &'a [String]) -> Request<'a> {
            Request {
                names: NameChange::Change {
                    subscribe,
                    unsubscribe: &[],
                },
                ..Request::new(nonce, nack)
            }
        }
        assert_eq!(s.on_request(request("", None, &sub)), Verdict::First);
        send(&mut s, &v1, "n1");
        assert_eq!(s.on_request(request("n1", None, &[])), Verdict::Ack);
        let v2 = with_bodies(&cache, &mut writer, &[("a", "2"), ("b", "1")]);
        send(&mut s, &v2, "n2");
        assert_eq!(s.on_request(request("n2", nack("v2"), &[])), Verdict::Nack);
        let b = names(&["b"]);
        assert_eq!(s.on_request(request("", None, &b)), Verdict::Subscription);
        assert_eq!(s.next(Some(&v2)).unwrap_err(), Wait::Nacked);
        let v3 = with_bodies(&cache, &mut writer, &[("a", "3"), ("b", "1")]);
        assert_eq!(selected(&send(&mut s, &v3, "n3")), (vec!["a", "b"], vec![]));
    }

    #[test]
    fn a_delta_reconnect_is_sent_what_differs_and_every_name_it_asks_for() {
        let (cache, mut writer) = Cache::new();
        let v1 = with_bodies(&cache, &mut writer, &[("a", "1"), ("b", "1"), ("c", "1")]);
        let held = |name: &str| v1.resources[name].content_version();
        let (ha, hb) = (held("a"), held("b"));
        let reported = ReportedNames::with_versions([("a", ha.as_str()), ("b", hb.as_str()), ("gone", "x")]);
        let mut s = state(Mode::Incremental, Held::Reported(reported));
        let sub = names(&["*", "b"]);
        let verdict = s.on_request(Request {
            names: NameChange::Change {
                subscribe: &sub,
                unsubscribe: &[],
            },
            ..Request::new("", None)
        });
        assert_eq!(verdict, Verdict::First);
        // "a" is held at its version (wildcard: left out); "b" is named, so
        // answered though held (Envoy waits for it); "c" is new; "gone" is.
        assert_eq!(selected(&send(&mut s, &v1, "n1")), (vec!["b", "c"], vec!["gone"]));
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
}
