//! Values that readers compute from an immutable snapshot or chunk (response
//! encodings: a protocol's bytes for a collection, a diff between two
//! versions), kept with it so every reader shares one, and freed with it.
//! The cache does not know what they are: each is keyed by its reader's name
//! for the kind and an optional argument (the version a diff starts from).

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::SharedStr;

/// What a memoized value is.
#[derive(Clone, Debug, Eq)]
pub struct MemoKey {
    /// Whose and what (`"mcp.sotw"`), one name per kind of value.
    pub kind: &'static str,
    /// What it depends on besides its owner, if anything.
    pub arg: Option<SharedStr>,
}

/// Kinds are static names: the same name is mostly the same pointer, which
/// is compared first (each response looks up every resource it carries).
impl PartialEq for MemoKey {
    fn eq(&self, other: &Self) -> bool {
        (std::ptr::eq(self.kind, other.kind) || self.kind == other.kind) && self.arg == other.arg
    }
}

impl MemoKey {
    pub const fn of(kind: &'static str) -> Self {
        Self { kind, arg: None }
    }

    pub fn with(kind: &'static str, arg: SharedStr) -> Self {
        Self { kind, arg: Some(arg) }
    }
}

type Entry = (MemoKey, Arc<dyn Any + Send + Sync>);

/// Memoized values of one snapshot or chunk.
#[derive(Default)]
pub struct Memo {
    entries: Mutex<Vec<Entry>>,
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_list().entries(entries.iter().map(|(k, _)| k)).finish()
    }
}

impl Memo {
    /// The value for `key`, made by `make` the first time. At most
    /// `max_of_kind` values of one kind are kept: past that, `make`'s value
    /// is returned and not kept (a pathological spread of arguments, such as
    /// clients at many different versions, costs work, not memory).
    ///
    /// `make` runs outside the lock: two readers racing may both make it.
    pub fn get_or_make<T: Any + Send + Sync>(
        &self,
        key: MemoKey,
        max_of_kind: usize,
        make: impl FnOnce() -> T,
    ) -> Arc<T> {
        if let Some(found) = self.find::<T>(&key) {
            return found;
        }
        let made = Arc::new(make());
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = value_of(&entries, &key).and_then(|v| v.clone().downcast::<T>().ok()) {
            return found;
        }
        if entries.iter().filter(|(k, _)| k.kind == key.kind).count() < max_of_kind {
            // Most owners keep one value (a resource read in one form): room
            // for it alone, not the four a first push makes.
            entries.reserve_exact(1);
            entries.push((key, made.clone()));
        }
        made
    }

    /// The value for `key` while anyone holds it, made by `make` when
    /// nobody does. The memo refers to it without keeping it alive: it goes
    /// with the last reader that holds it, not with the memo's owner (a
    /// grant's view of a snapshot, freed when its clients left). At most
    /// `max_of_kind` values of one kind are referred to; values nobody
    /// holds any more make room first, and past that `make`'s value is
    /// returned and not referred to.
    pub fn get_or_make_held<T: Any + Send + Sync>(
        &self,
        key: MemoKey,
        max_of_kind: usize,
        make: impl FnOnce() -> Arc<T>,
    ) -> Arc<T> {
        let held = |v: &Arc<dyn Any + Send + Sync>| v.downcast_ref::<std::sync::Weak<T>>().and_then(|w| w.upgrade());
        if let Some(found) = self.find_with(&key, held) {
            return found;
        }
        let made = make();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = value_of(&entries, &key).and_then(held) {
            return found;
        }
        let weak: Arc<dyn Any + Send + Sync> = Arc::new(Arc::downgrade(&made));
        if let Some((_, slot)) = entries.iter_mut().find(|(k, _)| *k == key) {
            // Its last holder left: the new one takes its place.
            *slot = weak;
            return made;
        }
        let of_kind = |entries: &[Entry]| entries.iter().filter(|(k, _)| k.kind == key.kind).count();
        if of_kind(&entries) >= max_of_kind {
            entries.retain(|(k, v)| k.kind != key.kind || held(v).is_some());
        }
        if of_kind(&entries) < max_of_kind {
            entries.push((key, weak));
        }
        made
    }

    fn find_with<R>(&self, key: &MemoKey, read: impl FnOnce(&Arc<dyn Any + Send + Sync>) -> Option<R>) -> Option<R> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        value_of(&entries, key).and_then(read)
    }

    /// The value for `key`, if one is kept.
    pub fn find<T: Any + Send + Sync>(&self, key: &MemoKey) -> Option<Arc<T>> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        value_of(&entries, key).and_then(|v| v.clone().downcast::<T>().ok())
    }

    /// Sets the value for `key`, replacing any: a reader that made a better
    /// copy (a slice of a larger buffer it keeps anyway) points the memo at
    /// it, so that only one copy lives.
    pub fn put<T: Any + Send + Sync>(&self, key: MemoKey, value: Arc<T>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        match entries.iter_mut().find(|(k, _)| *k == key) {
            Some((_, slot)) => *slot = value,
            None => {
                entries.reserve_exact(1);
                entries.push((key, value))
            }
        }
    }

    /// `read`s the value for `key` where it is, if there is one: no
    /// reference taken (a response that copies a resource's form into its
    /// buffer touches nothing else).
    pub fn read<T: Any + Send + Sync, R>(&self, key: &MemoKey, read: impl FnOnce(&T) -> R) -> Option<R> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        value_of(&entries, key).and_then(|v| v.downcast_ref::<T>()).map(read)
    }

    /// A memo holding the same values (shared, not copied).
    fn shallow_clone(&self) -> Memo {
        Memo {
            entries: Mutex::new(self.entries.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The value kept for `key`.
fn value_of<'a>(entries: &'a [Entry], key: &MemoKey) -> Option<&'a Arc<dyn Any + Send + Sync>> {
    entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// A [`Memo`] made on first use: one pointer for an owner nobody read in
/// any form (most resources of most collections), so that a collection no
/// reader encodes holds nothing for it. A pointer, not `OnceLock`'s 16
/// bytes: it keeps a cached resource in glibc's 128-byte chunks (144
/// before), 1 MiB of a 60,000-resource cache. Two readers racing to make
/// the memo each make an empty one and one is dropped: nothing is lost.
#[derive(Debug, Default)]
pub struct LazyMemo(once_cell::race::OnceBox<Memo>);

impl LazyMemo {
    /// See [`Memo::get_or_make`].
    pub fn get_or_make<T: Any + Send + Sync>(
        &self,
        key: MemoKey,
        max_of_kind: usize,
        make: impl FnOnce() -> T,
    ) -> Arc<T> {
        self.0.get_or_init(Box::default).get_or_make(key, max_of_kind, make)
    }

    /// See [`Memo::read`].
    pub fn read<T: Any + Send + Sync, R>(&self, key: &MemoKey, read: impl FnOnce(&T) -> R) -> Option<R> {
        self.0.get()?.read(key, read)
    }

    /// See [`Memo::put`].
    pub fn put<T: Any + Send + Sync>(&self, key: MemoKey, value: Arc<T>) {
        self.0.get_or_init(Box::default).put(key, value)
    }

    /// The same values, for an owner that is the same content in a new
    /// place (a resource moved into a rebuilt chunk).
    pub fn carried(&self) -> LazyMemo {
        let memo = once_cell::race::OnceBox::new();
        if let Some(values) = self.0.get().filter(|m| !m.is_empty()) {
            let _ = memo.set(Box::new(values.shallow_clone()));
        }
        LazyMemo(memo)
    }

    pub fn len(&self) -> usize {
        self.0.get().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_once_shared_and_bounded_per_kind() {
        let memo = Memo::default();
        let mut made = 0;
        let a = memo.get_or_make(MemoKey::of("k"), 2, || {
            made += 1;
            1u32
        });
        let b = memo.get_or_make(MemoKey::of("k"), 2, || {
            made += 1;
            2u32
        });
        assert_eq!((*a, *b, made), (1, 1, 1));
        assert!(Arc::ptr_eq(&a, &b));
        for v in ["v1", "v2", "v3"] {
            memo.get_or_make(MemoKey::with("diff", v.into()), 2, || v.len());
        }
        assert_eq!(memo.len(), 3, "one of kind k, two of kind diff");
    }

    #[test]
    fn a_held_value_lives_as_long_as_its_holders_and_frees_its_place() {
        let memo = Memo::default();
        let key = |k: &str| MemoKey::with("view", k.into());
        let a = memo.get_or_make_held(key("a"), 2, || Arc::new(1u32));
        let again = memo.get_or_make_held(key("a"), 2, || Arc::new(9u32));
        assert!(Arc::ptr_eq(&a, &again), "shared while held");
        let weak = Arc::downgrade(&a);
        drop((a, again));
        assert!(weak.upgrade().is_none(), "the memo does not keep it alive");
        let a = memo.get_or_make_held(key("a"), 2, || Arc::new(2u32));
        assert_eq!(*a, 2, "made again once nobody held it, in its old place");
        let b = memo.get_or_make_held(key("b"), 2, || Arc::new(3u32));
        // Full of held values: a third is made but not referred to.
        let c = memo.get_or_make_held(key("c"), 2, || Arc::new(4u32));
        let c2 = memo.get_or_make_held(key("c"), 2, || Arc::new(5u32));
        assert_eq!((*c, *c2), (4, 5));
        assert_eq!(memo.len(), 2);
        // One leaves: the next new value takes its place.
        drop(b);
        let d = memo.get_or_make_held(key("d"), 2, || Arc::new(6u32));
        assert!(Arc::ptr_eq(&d, &memo.get_or_make_held(key("d"), 2, || Arc::new(7u32))));
        assert_eq!(memo.len(), 2);
        drop(a);
    }

    #[test]
    fn a_lazy_memo_holds_nothing_until_read_and_carries_its_values() {
        let memo = LazyMemo::default();
        assert!(memo.is_empty());
        assert_eq!(std::mem::size_of::<LazyMemo>(), 8);
        assert!(memo.carried().0.get().is_none(), "nothing to carry: nothing made");
        let a = memo.get_or_make(MemoKey::of("k"), 1, || 1u32);
        memo.put(MemoKey::of("k"), Arc::new(2u32));
        let carried = memo.carried();
        let b = carried.get_or_make(MemoKey::of("k"), 1, || 3u32);
        assert_eq!(
            (*a, *b),
            (1, 2),
            "put replaced the value, and the carried memo shares it"
        );
    }
}
