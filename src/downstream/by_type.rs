//! A stream's per-type entries, by type URL: a vector sorted by key, exactly
//! as large as its entries.
//!
//! Most streams follow one to a few types; a hash map or a B-tree allocates
//! room for 4 or 11 entries on the first insert (876 and 1,500 bytes per
//! idle stream, measured with heaptrack). The number of entries is bounded
//! by `--max-types-per-stream`, so a lookup by binary search and an insert
//! that shifts the tail stay cheap.

use crate::SharedStr;

/// Keys are shared: a stream's type URL is one string, whether its state,
/// its wake-ups or its registry entry names it.
#[derive(Clone, Debug, PartialEq)]
pub struct ByType<V> {
    entries: Vec<(SharedStr, V)>,
}

impl<V> Default for ByType<V> {
    fn default() -> Self {
        Self { entries: Vec::new() }
    }
}

impl<V> ByType<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Where `key` is. A key that is the entry's own string (the stream
    /// passes its shared type URL around: a response and its ACK look
    /// their type up about 17 times) is found by its address, inlined where
    /// it is called, without comparing 60-odd bytes of type URL; any other
    /// key by a search kept apart. As one call with the search in it, a
    /// lookup took 36 to 42 instructions, 600 a response (BENCHMARKS,
    /// session 39).
    #[inline]
    fn find(&self, key: &str) -> Result<usize, usize> {
        match self.entries.iter().position(|(k, _)| std::ptr::eq(k.as_str(), key)) {
            Some(at) => Ok(at),
            None => self.search(key),
        }
    }

    /// [`Self::find`] by content: out of line, as it is rare.
    #[inline(never)]
    fn search(&self, key: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&V> {
        self.find(key).ok().map(|at| &self.entries[at].1)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.find(key).ok().map(|at| &mut self.entries[at].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.find(key).is_ok()
    }

    /// Sets `key`'s entry; returns the one it replaces.
    pub fn insert(&mut self, key: &SharedStr, value: V) -> Option<V> {
        match self.find(key) {
            Ok(at) => Some(std::mem::replace(&mut self.entries[at].1, value)),
            Err(at) => {
                // One more slot, not double: the common stream has one type.
                self.entries.reserve_exact(1);
                self.entries.insert(at, (key.clone(), value));
                None
            }
        }
    }

    /// The key equal to `key`, shared.
    pub fn key(&self, key: &str) -> Option<&SharedStr> {
        self.find(key).ok().map(|at| &self.entries[at].0)
    }

    /// The entry at `at` (in key order): panics past the end.
    pub fn at_mut(&mut self, at: usize) -> (&SharedStr, &mut V) {
        let (key, value) = &mut self.entries[at];
        (key, value)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// In key order.
    pub fn iter(&self) -> impl Iterator<Item = (&SharedStr, &V)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    /// In key order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&SharedStr, &mut V)> {
        self.entries.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &SharedStr> {
        self.entries.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, v)| v)
    }

    pub fn into_values(self) -> impl Iterator<Item = V> {
        self.entries.into_iter().map(|(_, v)| v)
    }
}

impl<V> std::ops::Index<&str> for ByType<V> {
    type Output = V;

    fn index(&self, key: &str) -> &V {
        self.get(key).unwrap_or_else(|| panic!("no entry for type {key}"))
    }
}

impl<'a, V> IntoIterator for &'a ByType<V> {
    type Item = (&'a SharedStr, &'a V);
    type IntoIter =
        std::iter::Map<std::slice::Iter<'a, (SharedStr, V)>, fn(&'a (SharedStr, V)) -> (&'a SharedStr, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

/// A JSON object by type URL, as the `BTreeMap` it replaces.
impl<V: serde::Serialize> serde::Serialize for ByType<V> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    proptest! {
        /// The same answers as a `BTreeMap` under any inserts, in the same
        /// order, with no spare room.
        #[test]
        fn answers_as_a_btree_map(inserts in proptest::collection::vec(("[a-e]{1,2}", any::<u8>()), 0..40)) {
            let mut ours = ByType::new();
            let mut model = BTreeMap::new();
            for (key, value) in inserts {
                prop_assert_eq!(ours.insert(&SharedStr::from(key.as_str()), value), model.insert(key, value));
                prop_assert_eq!(ours.entries.capacity(), ours.len());
            }
            prop_assert_eq!(ours.len(), model.len());
            prop_assert!(ours.iter().map(|(k, v)| (k.as_str(), v)).eq(model.iter().map(|(k, v)| (k.as_str(), v))));
            for key in ["a", "ab", "e", "zz"] {
                prop_assert_eq!(ours.get(key), model.get(key));
                prop_assert_eq!(ours.contains_key(key), model.contains_key(key));
            }
            prop_assert_eq!(serde_json::to_string(&ours).unwrap(), serde_json::to_string(&model).unwrap());
        }
    }
}
