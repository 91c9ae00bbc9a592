//! The distinct grants each collection is served to at once
//! (`--max-grants-per-version`). A client the access policy grants part of a
//! collection reads its grant's view of each version: one view per distinct
//! grant and version, shared by every client of that grant, holding a few
//! pointers per name it keeps. Distinct identities can make as many distinct
//! grants as there are identities, so their number is bounded: a stream whose
//! grant is a new one past the limit is refused `RESOURCE_EXHAUSTED`, and
//! every grant a connected client holds keeps being served (nothing a client
//! reads is taken from it to make room for a newcomer).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::metrics as m;
use crate::SharedStr;

/// How many distinct grants of a collection are served when not told.
pub const DEFAULT_MAX_GRANTS_PER_VERSION: usize = 1024;

/// Per collection, each distinct grant's key and how many streams hold it.
type Held = HashMap<SharedStr, HashMap<SharedStr, usize>>;

/// The grants held.
#[derive(Debug)]
pub struct Grants {
    max: usize,
    held: Mutex<Held>,
}

/// A stream's hold on its grant of a collection: the grant counts as served
/// while any stream holds it.
#[derive(Debug)]
pub struct GrantHold {
    grants: Arc<Grants>,
    collection: SharedStr,
    key: SharedStr,
}

/// A new distinct grant past the limit: how many are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    pub held: usize,
}

impl Grants {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            held: Mutex::default(),
        })
    }

    /// Distinct grants of one collection served at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Distinct grants of `collection` held now.
    pub fn held(&self, collection: &str) -> usize {
        self.lock().get(collection).map_or(0, HashMap::len)
    }

    /// Holds the grant `key` of `collection` for a stream. A grant another
    /// stream holds is shared; a new one past the limit is `Full` when
    /// `enforce` (a new stream's), and held anyway when not (a connected
    /// client's grant that a policy reload changed: reloads never cut
    /// anyone off; the views past the limit are then made per stream).
    pub fn hold(self: &Arc<Self>, collection: &SharedStr, key: &SharedStr, enforce: bool) -> Result<GrantHold, Full> {
        let mut held = self.lock();
        let of = held.entry(collection.clone()).or_default();
        if let Some(count) = of.get_mut(key) {
            *count += 1;
        } else if enforce && of.len() >= self.max {
            return Err(Full { held: of.len() });
        } else {
            of.insert(key.clone(), 1);
            m::access_grants(collection, of.len());
        }
        Ok(GrantHold {
            grants: self.clone(),
            collection: collection.clone(),
            key: key.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GrantHold {
    /// Distinct grants of one collection served at once: views of a version
    /// kept for them.
    pub fn max(&self) -> usize {
        self.grants.max
    }
}

impl Drop for GrantHold {
    fn drop(&mut self) {
        let mut held = self.grants.lock();
        let Some(of) = held.get_mut(&self.collection) else {
            return;
        };
        if let Some(count) = of.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                of.remove(&self.key);
                m::access_grants(&self.collection, of.len());
            }
        }
        if of.is_empty() {
            held.remove(&self.collection);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_grant_past_the_limit_is_refused_and_held_ones_are_shared() {
        let grants = Grants::new(2);
        let c: SharedStr = "c".into();
        let key = |k: &str| -> SharedStr { k.into() };
        let a = grants.hold(&c, &key("a"), true).unwrap();
        let a2 = grants.hold(&c, &key("a"), true).unwrap();
        let b = grants.hold(&c, &key("b"), true).unwrap();
        assert_eq!(grants.held("c"), 2);
        assert_eq!(grants.hold(&c, &key("x"), true).unwrap_err(), Full { held: 2 });
        // Another stream of a held grant is served; so is another collection.
        let a3 = grants.hold(&c, &key("a"), true).unwrap();
        let other = grants.hold(&"d".into(), &key("x"), true).unwrap();
        // A reload's new grant of a connected client is held past it.
        let reloaded = grants.hold(&c, &key("y"), false).unwrap();
        assert_eq!(grants.held("c"), 3);
        drop((reloaded, b));
        assert_eq!(grants.held("c"), 1);
        let x = grants.hold(&c, &key("x"), true).unwrap();
        drop((a, a2, a3, x, other));
        assert_eq!((grants.held("c"), grants.held("d")), (0, 0));
        assert!(grants.lock().is_empty(), "nothing kept for grants nobody holds");
    }
}
