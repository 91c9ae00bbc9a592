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

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::type_state::ReportedNames;
use crate::cache::{CachedResource, CollectionSnapshot, Diff};

/// The wildcard name.
pub const WILDCARD: &str = "*";

/// A set of resources by name: everything (wildcard), named ones, or both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub wildcard: bool,
    pub names: BTreeSet<Arc<str>>,
}

impl Names {
    pub fn everything() -> Self {
        Names {
            wildcard: true,
            names: BTreeSet::new(),
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
    Replace(&'a [String]),
    /// Delta: names added and removed.
    Change {
        subscribe: &'a [String],
        unsubscribe: &'a [String],
    },
}

impl NameChange<'_> {
    /// Says nothing: a legacy wildcard request.
    fn is_silent(&self) -> bool {
        match self {
            NameChange::Replace(names) => names.is_empty(),
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
    /// Before its first response: the names and versions it reported.
    Reported(&'a ReportedNames),
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
    resend: BTreeSet<Arc<str>>,
}

impl Named {
    /// A request `change`s the names of a type followed with `named`;
    /// `sent_everything`: a response went out under legacy wildcard (the
    /// client holds all it had). `Ok(true)` when the subscription changed.
    pub fn apply(
        named: &mut Option<Box<Named>>,
        change: NameChange<'_>,
        sent_everything: bool,
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
            })
        });
        let mut changed = false;
        match change {
            NameChange::Replace(names) => {
                // Compared before anything is allocated: clients repeat the
                // same names on every ACK.
                let wildcard = names.iter().any(|n| n == WILDCARD);
                let asked: BTreeSet<&str> = names.iter().map(String::as_str).filter(|n| *n != WILDCARD).collect();
                if wildcard != named.current.wildcard
                    || !asked.iter().copied().eq(named.current.names.iter().map(|n| &**n))
                {
                    named.current = Names {
                        wildcard,
                        names: asked.into_iter().map(Arc::from).collect(),
                    };
                    // A name dropped is dropped by the client too: asked
                    // for again, it is sent again.
                    named.held.wildcard &= wildcard;
                    let current = &named.current;
                    named.held.names.retain(|n| current.names.contains(n));
                    changed = true;
                }
            }
            NameChange::Change { subscribe, unsubscribe } => {
                for name in unsubscribe {
                    if name == WILDCARD {
                        changed |= std::mem::replace(&mut named.current.wildcard, false);
                        named.held.wildcard = false;
                        continue;
                    }
                    changed |= named.current.names.remove(name.as_str());
                    named.held.names.remove(name.as_str());
                    named.resend.remove(name.as_str());
                    // Still covered: the client may have dropped it.
                    if named.current.wildcard {
                        named.resend.insert(name.as_str().into());
                        changed = true;
                    }
                }
                for name in subscribe {
                    if name == WILDCARD {
                        changed |= !std::mem::replace(&mut named.current.wildcard, true);
                        continue;
                    }
                    let name: Arc<str> = name.as_str().into();
                    named.current.names.insert(name.clone());
                    // Sent again even if held: always a change.
                    named.resend.insert(name);
                    changed = true;
                }
            }
        }
        let count = named.current.names.len().max(named.resend.len());
        if count > max {
            return Err(TooManyNames { count });
        }
        Ok(changed)
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

    /// A response went out for the current subscription: the client holds
    /// it, whether it ACKs or NACKs it.
    pub fn on_sent(&mut self) {
        self.held = self.current.clone();
        self.resend.clear();
    }

    /// Whether a resource the client asks for by name differs between `from`
    /// and `to` (is new, changed or gone). Wildcard: see the versions.
    pub fn touched(&self, from: &CollectionSnapshot, to: &CollectionSnapshot) -> bool {
        self.current
            .names
            .iter()
            .any(|name| match (from.resources.get(name), to.resources.get(name)) {
                (Some(a), Some(b)) => !same_content(a, b),
                (None, None) => false,
                _ => true,
            })
    }

    /// State of the world: the resources of `to` the client asked for.
    pub fn selected(&self, to: &CollectionSnapshot) -> Vec<Arc<CachedResource>> {
        if self.current.wildcard {
            return to.resources.values().cloned().collect();
        }
        self.current
            .names
            .iter()
            .filter_map(|name| to.resources.get(name).cloned())
            .collect()
    }

    /// Delta: what the client must be sent to hold `to` as subscribed, from
    /// what it holds. Each name at most once, sorted.
    pub fn changes(&self, holds: Holds<'_>, to: &CollectionSnapshot) -> Diff {
        let reported: Option<HashMap<&str, &str>> = match &holds {
            Holds::Reported(reported) => Some(reported.entries().collect()),
            Holds::Snapshot(_) => None,
        };
        // Whether the client holds `name` at `resource`'s version (with
        // `None`: at all).
        let holds_at = |name: &str, resource: Option<&CachedResource>| -> bool {
            match (&holds, &reported) {
                (Holds::Snapshot(from), _) => {
                    self.held.covers(name)
                        && match (from.resources.get(name), resource) {
                            (Some(held), Some(now)) => same_content(held, now),
                            (held, None) => held.is_some(),
                            (None, Some(_)) => false,
                        }
                }
                (Holds::Reported(_), Some(reported)) => match (reported.get(name), resource) {
                    (Some(version), Some(now)) => *version == now.content_version(),
                    (held, None) => held.is_some(),
                    (None, Some(_)) => false,
                },
                (Holds::Reported(_), None) => unreachable!("read above"),
            }
        };
        let mut upserts: Vec<Arc<CachedResource>> = Vec::new();
        let mut removed: BTreeSet<Arc<str>> = BTreeSet::new();
        // A name is sent when it is to be re-sent or the client does not hold
        // it at its version; it is removed when it is gone and the client
        // holds it or is owed an answer for it.
        let mut consider = |name: &Arc<str>| {
            let resend = self.resend.contains(name);
            match to.resources.get(name) {
                Some(resource) if resend || !holds_at(name, Some(resource)) => upserts.push(resource.clone()),
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
            Holds::Reported(reported) => {
                for name in reported.iter() {
                    if !to.resources.contains_key(name) {
                        consider(&Arc::from(name));
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

/// The same resource content: the same version and body digest (which
/// covers labels and annotations).
fn same_content(a: &CachedResource, b: &CachedResource) -> bool {
    a.digest == b.digest && a.version == b.version
}
