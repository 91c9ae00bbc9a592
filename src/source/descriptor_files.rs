//! The built-in descriptor sets as files, each decoded when a type of its
//! package is first read, with what it imports: Envoy's whole API is 529
//! files (17 MB decoded), and a gateway reads the types of a few dozen.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use prost_reflect::{DescriptorPool, EnumDescriptor, MessageDescriptor};

use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};

/// One file of a set: its encoded `FileDescriptorProto` and what it imports.
#[derive(Debug)]
struct File {
    /// The file's field of the `FileDescriptorSet`, tag and length included:
    /// sets of several files are these, concatenated.
    encoded: &'static [u8],
    dependencies: Vec<&'static str>,
}

/// The files of some `FileDescriptorSet`s, by name and by package.
#[derive(Debug, Default)]
pub struct FileIndex {
    files: HashMap<&'static str, File>,
    packages: HashMap<&'static str, Vec<&'static str>>,
}

impl FileIndex {
    /// The files of `sets`; a file two sets hold is the first one's (the
    /// well-known types, the same in every set).
    pub fn of(sets: &[&'static [u8]]) -> Result<Self, String> {
        let mut index = Self::default();
        for set in sets {
            let mut rest: &'static [u8] = set;
            while !rest.is_empty() {
                let before = rest;
                let (tag, wire_type) = decode_key(&mut rest).map_err(|e| e.to_string())?;
                if (tag, wire_type) != (1, WireType::LengthDelimited) {
                    skip_field(wire_type, tag, &mut rest, DecodeContext::default()).map_err(|e| e.to_string())?;
                    continue;
                }
                let body = length_delimited(&mut rest)?;
                let encoded = &before[..before.len() - rest.len()];
                let (name, package, dependencies) = file_header(body)?;
                if index.files.contains_key(name) {
                    continue;
                }
                index.packages.entry(package).or_default().push(name);
                index.files.insert(name, File { encoded, dependencies });
            }
        }
        Ok(index)
    }

    /// Every file's name.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.files.keys().copied()
    }

    /// The files of the package a message named `message` (`a.b.v3.M`, or
    /// `a.b.v3.M.Inner`) is in: of the longest prefix of its name that is a
    /// package.
    pub fn files_of(&self, message: &str) -> &[&'static str] {
        let mut prefix = message;
        while let Some((package, _)) = prefix.rsplit_once('.') {
            if let Some(files) = self.packages.get(package) {
                return files;
            }
            prefix = package;
        }
        &[]
    }

    /// A `FileDescriptorSet` of `wanted` and what they import, every file
    /// after its imports, leaving out those in `loaded` (to which the
    /// files written are added). Empty when there is nothing to add.
    pub fn set_of(&self, wanted: &[&'static str], loaded: &mut HashSet<&'static str>) -> Vec<u8> {
        let mut set = Vec::new();
        for name in wanted {
            self.write_with_imports(name, loaded, &mut set);
        }
        set
    }

    fn write_with_imports(&self, name: &'static str, loaded: &mut HashSet<&'static str>, set: &mut Vec<u8>) {
        let Some(file) = self.files.get(name) else {
            return;
        };
        if !loaded.insert(name) {
            return;
        }
        for dependency in &file.dependencies {
            self.write_with_imports(dependency, loaded, set);
        }
        set.extend_from_slice(file.encoded);
    }
}

/// A descriptor set decoded as it is used: a file the first time a type of
/// its package is looked up, with what it imports.
pub struct LazyPool {
    set: &'static [u8],
    loaded: Mutex<Option<Loaded>>,
}

/// What of a set is decoded: its files indexed, those decoded so far.
struct Loaded {
    index: FileIndex,
    files: HashSet<&'static str>,
    pool: DescriptorPool,
}

impl LazyPool {
    /// `set`, a `FileDescriptorSet` build.rs wrote, nothing of it decoded.
    pub const fn new(set: &'static [u8]) -> Self {
        Self {
            set,
            loaded: Mutex::new(None),
        }
    }

    /// The descriptor of the message `name` (a full name), its package
    /// decoded if it was not yet.
    pub fn message(&self, name: &str) -> Option<MessageDescriptor> {
        self.with_package_of(name, |pool| pool.get_message_by_name(name))
    }

    /// The descriptor of the enum `name` (a full name).
    pub fn enumeration(&self, name: &str) -> Option<EnumDescriptor> {
        self.with_package_of(name, |pool| pool.get_enum_by_name(name))
    }

    /// The files decoded so far.
    #[cfg(test)]
    pub fn decoded(&self) -> Vec<&'static str> {
        let loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        loaded.iter().flat_map(|l| l.files.iter().copied()).collect()
    }

    /// `find` in the descriptors decoded, once more after decoding the
    /// package `name` is in (and what it imports) when not found there.
    fn with_package_of<T>(&self, name: &str, find: impl Fn(&DescriptorPool) -> Option<T>) -> Option<T> {
        let mut guard = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        let loaded = guard.get_or_insert_with(|| Loaded {
            index: FileIndex::of(&[self.set]).expect("build.rs wrote a valid descriptor set"),
            files: HashSet::new(),
            pool: DescriptorPool::new(),
        });
        if let Some(found) = find(&loaded.pool) {
            return Some(found);
        }
        let wanted = loaded.index.files_of(name).to_vec();
        let set = loaded.index.set_of(&wanted, &mut loaded.files);
        if set.is_empty() {
            return None;
        }
        loaded
            .pool
            .decode_file_descriptor_set(&set[..])
            .expect("build.rs wrote a valid descriptor set");
        find(&loaded.pool)
    }
}

/// The bytes of a length-delimited field, `buf` moved past them.
fn length_delimited(buf: &mut &'static [u8]) -> Result<&'static [u8], String> {
    let len = decode_varint(buf).map_err(|e| e.to_string())?;
    let len = usize::try_from(len).ok().filter(|len| *len <= buf.len());
    let Some(len) = len else {
        return Err("a field longer than the set".into());
    };
    let (body, rest) = buf.split_at(len);
    *buf = rest;
    Ok(body)
}

/// A `FileDescriptorProto`'s name (1), package (2) and dependencies (3).
fn file_header(mut buf: &'static [u8]) -> Result<(&'static str, &'static str, Vec<&'static str>), String> {
    let text = |bytes: &'static [u8]| std::str::from_utf8(bytes).map_err(|e| e.to_string());
    let (mut name, mut package, mut dependencies) = ("", "", Vec::new());
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf).map_err(|e| e.to_string())?;
        match (tag, wire_type) {
            (1, WireType::LengthDelimited) => name = text(length_delimited(&mut buf)?)?,
            (2, WireType::LengthDelimited) => package = text(length_delimited(&mut buf)?)?,
            (3, WireType::LengthDelimited) => dependencies.push(text(length_delimited(&mut buf)?)?),
            _ => skip_field(wire_type, tag, &mut buf, DecodeContext::default()).map_err(|e| e.to_string())?,
        }
    }
    Ok((name, package, dependencies))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_splits_into_files_that_decode_alone_with_their_imports() {
        let set: &'static [u8] = include_bytes!(concat!(env!("OUT_DIR"), "/envoy_resources.bin"));
        let index = FileIndex::of(&[set]).unwrap();
        let whole = prost_reflect::DescriptorPool::decode(set).unwrap();
        assert_eq!(index.names().count(), whole.files().count());

        let files = index.files_of("envoy.extensions.filters.http.lua.v3.Lua");
        assert_eq!(files, ["envoy/extensions/filters/http/lua/v3/lua.proto"]);
        assert_eq!(
            index
                .files_of("envoy.config.core.v3.GrpcService.GoogleGrpc.SslCredentials")
                .len(),
            whole
                .files()
                .filter(|f| f.package_name() == "envoy.config.core.v3")
                .count()
        );
        assert!(index.files_of("example.Unknown").is_empty());

        let mut loaded = HashSet::new();
        let lua = index.set_of(files, &mut loaded);
        let pool = prost_reflect::DescriptorPool::decode(&lua[..]).unwrap();
        assert!(pool
            .get_message_by_name("envoy.extensions.filters.http.lua.v3.Lua")
            .is_some());
        assert!(
            pool.files().count() < whole.files().count() / 4,
            "{}",
            pool.files().count()
        );
        // What is loaded is not written again.
        assert!(index.set_of(files, &mut loaded).is_empty());
    }
}
