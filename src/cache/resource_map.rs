//! A collection's resources by name: a persistent ordered map whose entries
//! are the resources themselves, ordered by their names.
//!
//! The map is `imbl`'s (consecutive snapshots share every node a change did
//! not touch, and the diff between them skips the shared ones); each entry
//! is one pointer, the resource's `Arc`, whose name is the key. A map keyed
//! by a name of its own (`Arc<str>`) and valued by the resource holds three
//! pointers per entry, and `imbl` leaves built by inserts are about two
//! thirds full: 36 bytes per resource against 12.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::sync::Arc;

use imbl::OrdMap;

use super::CachedResource;

/// The resources of one state of a collection, by name.
#[derive(Clone, Default)]
pub struct ResourceMap(OrdMap<ByName, Unlike>);

/// A resource as a key: ordered and compared by its name only.
#[derive(Clone)]
struct ByName(Arc<CachedResource>);

impl PartialEq for ByName {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for ByName {}

impl PartialOrd for ByName {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByName {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.name.cmp(&other.0.name)
    }
}

/// Looked up by `&str`: the name's order is the key's.
impl Borrow<str> for ByName {
    fn borrow(&self) -> &str {
        &self.0.name
    }
}

/// The map's value, empty: the key is the resource. It is never equal to
/// another, so that the map's diff reports every pair of entries of one
/// name it does not skip as shared (a changed resource has the same key);
/// [`ResourceMap::diff`] keeps those whose resources differ.
#[derive(Clone, Copy, Default)]
struct Unlike;

impl PartialEq for Unlike {
    fn eq(&self, _: &Self) -> bool {
        false
    }
}

/// One difference between two maps ([`ResourceMap::diff`]).
pub enum Change<'a> {
    /// In the newer map only.
    Added(&'a Arc<CachedResource>),
    /// In both, not the same resource (name, version or content).
    Changed(&'a Arc<CachedResource>),
    /// In the older map only.
    Removed(&'a Arc<CachedResource>),
}

impl ResourceMap {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Arc<CachedResource>> {
        self.0.get_key_value(name).map(|(key, _)| &key.0)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Puts `resource` under its name; the resource it replaced, if any.
    pub fn insert(&mut self, resource: Arc<CachedResource>) -> Option<Arc<CachedResource>> {
        let old = self.get(&resource.name).cloned();
        // `imbl` replaces the key with the value: the entry is the new
        // resource.
        self.0.insert(ByName(resource), Unlike);
        old
    }

    pub fn remove(&mut self, name: &str) -> Option<Arc<CachedResource>> {
        self.0.remove_with_key(name).map(|(key, _)| key.0)
    }

    /// The resources in name order.
    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Arc<CachedResource>> + ExactSizeIterator + '_ {
        self.0.keys().map(|key| &key.0)
    }

    /// The names in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &Arc<str>> + ExactSizeIterator + '_ {
        self.values().map(|resource| &resource.name)
    }

    /// `(name, resource)` in name order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&Arc<str>, &Arc<CachedResource>)> + ExactSizeIterator + '_ {
        self.values().map(|resource| (&resource.name, resource))
    }

    /// Whether the two are one map (a clone not changed since).
    pub fn ptr_eq(&self, other: &Self) -> bool {
        self.0.ptr_eq(&other.0)
    }

    /// From this map to `newer`, in name order: proportional to the change
    /// when the two share structure (consecutive snapshots do).
    pub fn diff<'a>(&'a self, newer: &'a Self) -> impl Iterator<Item = Change<'a>> + 'a {
        self.0.diff(&newer.0).filter_map(|item| match item {
            imbl::ordmap::DiffItem::Add(new, _) => Some(Change::Added(&new.0)),
            imbl::ordmap::DiffItem::Remove(old, _) => Some(Change::Removed(&old.0)),
            imbl::ordmap::DiffItem::Update {
                old: (old, _),
                new: (new, _),
            } => (!Arc::ptr_eq(&old.0, &new.0) && old.0 != new.0).then_some(Change::Changed(&new.0)),
        })
    }
}

impl std::fmt::Debug for ResourceMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// `map[name]`: the resource of that name, which must be there.
impl std::ops::Index<&str> for ResourceMap {
    type Output = Arc<CachedResource>;

    fn index(&self, name: &str) -> &Self::Output {
        self.get(name).expect("no resource of that name in the map")
    }
}

impl FromIterator<Arc<CachedResource>> for ResourceMap {
    /// The last of a name counts.
    fn from_iter<I: IntoIterator<Item = Arc<CachedResource>>>(resources: I) -> Self {
        let mut map = Self::new();
        for resource in resources {
            map.insert(resource);
        }
        map
    }
}

impl PartialEq for ResourceMap {
    /// The same resources (name, version and content) under the same names.
    fn eq(&self, other: &Self) -> bool {
        self.ptr_eq(other) || (self.len() == other.len() && self.values().zip(other.values()).all(|(a, b)| a == b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn resource(name: &str, version: &str) -> Arc<CachedResource> {
        Arc::new(CachedResource::new(
            name.into(),
            version,
            Bytes::copy_from_slice(name.as_bytes()),
            u128::from(version.len() as u64),
        ))
    }

    #[test]
    fn an_entry_is_one_pointer() {
        assert_eq!(std::mem::size_of::<(ByName, Unlike)>(), std::mem::size_of::<usize>());
    }

    #[test]
    fn insert_replaces_the_resource_under_its_name() {
        let mut map = ResourceMap::new();
        assert!(map.insert(resource("a", "1")).is_none());
        let old = map.insert(resource("a", "2")).unwrap();
        assert_eq!(&*old.version, "1");
        assert_eq!(&*map.get("a").unwrap().version, "2");
        assert_eq!(map.len(), 1);
        assert_eq!(&*map.remove("a").unwrap().version, "2");
        assert!(map.is_empty());
    }

    #[test]
    fn the_diff_reports_changed_resources_only() {
        let names = (0..1000).map(|i| format!("r-{i:04}")).collect::<Vec<_>>();
        let old: ResourceMap = names.iter().map(|n| resource(n, "1")).collect();
        let mut new = old.clone();
        new.insert(resource("r-0500", "22"));
        // The same content in another `Arc`: no change.
        new.insert(resource("r-0501", "1"));
        new.remove("r-0007");
        new.insert(resource("s", "1"));
        let changes = old
            .diff(&new)
            .map(|change| match change {
                Change::Added(r) => format!("+{}", r.name),
                Change::Changed(r) => format!("~{}", r.name),
                Change::Removed(r) => format!("-{}", r.name),
            })
            .collect::<Vec<_>>();
        assert_eq!(changes, ["-r-0007", "~r-0500", "+s"]);
        assert!(old.diff(&old.clone()).next().is_none());
    }
}
