//! The last-known-good cache on disk (`--cache-dir`): after each applied
//! upstream update, the collection's state is written atomically (temporary
//! file, fsync, rename, fsync of the directory), so a crash at any moment
//! leaves the old state or the new one. At start the files are loaded before
//! upstream connects; a file that is corrupt or unreadable is reported and
//! skipped, never fatal.
//!
//! The directory is not trusted to be tidy: temporary files get random names
//! and are created exclusively, without following links, readable by the
//! gateway only, and removed on every failure path (a full disk leaves the
//! last good file and nothing else). Loading reads regular files only, never
//! through a symbolic link, and refuses files larger than a bound.
//!
//! One file per collection: a magic line, the xxh3-64 of the payload, and the
//! payload, an `istio.mcp.v1alpha1.Resources` message with the resources as
//! the source sent them. Loading runs them through the same validation as an
//! upstream message.
//!
//! Beside it, the collection's history (`.mcphistory`, written after it): the
//! same header with its own magic line, and a [`PersistedHistory`], every
//! version the cache keeps with what changed after it; the newest's resources
//! are the collection's file. A history is restored only onto the version its
//! collection's file loaded, and only when each older version rebuilds to its
//! content version; otherwise it is dropped with a warning and the collection
//! loads as before. It is held to the same size bound as a collection's file:
//! it is the old bodies of what changed across the kept versions, which a
//! history of a few versions keeps well under the bound, and one larger than
//! a cache file may be costs only the history.

use crate::source::validate::SecretGuard;
use crate::SharedStr;
use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{Cache, CacheWriter, CollectionSnapshot, HistoryEntry, KeptVersion, Origin, Update};
use crate::proto::wire::RawResources;

const MAGIC: &[u8; 16] = b"mcp-xds-gateway\n";
/// A history file's magic line: the same length, so one kind of file renamed
/// as the other is refused by its header.
const HISTORY_MAGIC: &[u8; 16] = b"mcp-xds-history\n";
const HEADER: usize = MAGIC.len() + 8;
pub const EXTENSION: &str = "mcpcache";
pub const HISTORY_EXTENSION: &str = "mcphistory";

/// The file a collection is kept in. Anything but `[A-Za-z0-9._-]` is
/// escaped as `~XX`, so every collection name maps to one distinct file.
pub fn file_name(collection: &str) -> String {
    escaped(collection, EXTENSION)
}

/// The file a collection's history is kept in, beside its [`file_name`].
pub fn history_file_name(collection: &str) -> String {
    escaped(collection, HISTORY_EXTENSION)
}

fn escaped(collection: &str, extension: &str) -> String {
    let mut name = String::with_capacity(collection.len() + 16);
    for byte in collection.bytes() {
        match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' => name.push(byte as char),
            _ => name.push_str(&format!("~{byte:02X}")),
        }
    }
    name.push('.');
    name.push_str(extension);
    name
}

/// A snapshot as the bytes of its file; `sensitive`: its collection is
/// one of secrets here, and a gateway that would serve it as open does not
/// restore it ([`load`]).
pub fn encode(snapshot: &CollectionSnapshot, sensitive: bool) -> Vec<u8> {
    let payload = RawResources {
        system_version_info: snapshot.version.to_string(),
        collection: snapshot.collection.to_string(),
        resources: snapshot.resources.values().map(|r| r.encoded.clone()).collect(),
        persisted_sensitive: sensitive,
        ..Default::default()
    }
    .encode_to_vec();
    framed(MAGIC, &payload)
}

/// A file: the magic line, the xxh3-64 of the payload, the payload.
fn framed(magic: &[u8; 16], payload: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(HEADER + payload.len());
    file.extend_from_slice(magic);
    file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
    file.extend_from_slice(payload);
    file
}

/// A file's payload, if its header is `magic`'s and its checksum holds.
fn unframed(magic: &[u8; 16], kind: &str, file: Bytes) -> Result<Bytes, String> {
    if file.len() < HEADER || &file[..MAGIC.len()] != magic {
        return Err(format!("not a gateway {kind} file (bad header)"));
    }
    let checksum = u64::from_le_bytes(file[MAGIC.len()..HEADER].try_into().expect("8 bytes"));
    let payload = file.slice(HEADER..);
    if xxhash_rust::xxh3::xxh3_64(&payload) != checksum {
        return Err("checksum mismatch: the file is truncated or damaged".into());
    }
    Ok(payload)
}

/// The message in a file's bytes, or why it is not usable.
pub fn decode(file: &[u8]) -> Result<RawResources, String> {
    decode_bytes(Bytes::copy_from_slice(file))
}

/// As [`decode`], without copying: the resources are slices of `file`.
pub fn decode_bytes(file: Bytes) -> Result<RawResources, String> {
    let payload = unframed(MAGIC, "cache", file)?;
    RawResources::decode(payload).map_err(|e| format!("does not decode: {e}"))
}

// === the history file ===

/// A history file's payload: a collection's versions, oldest first.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PersistedHistory {
    #[prost(string, tag = "1")]
    pub collection: String,
    #[prost(message, repeated, tag = "2")]
    pub versions: Vec<PersistedVersion>,
}

/// One version, as `/debug/history` lists it, and what turns the next newer
/// version's resources back into its own.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PersistedVersion {
    /// The content version.
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(uint64, tag = "2")]
    pub applied_at_unix_millis: u64,
    /// `upstream`, `disk` or `files`.
    #[prost(string, tag = "3")]
    pub origin: String,
    #[prost(uint64, tag = "4")]
    pub resources: u64,
    #[prost(uint64, tag = "5")]
    pub bytes: u64,
    #[prost(uint64, tag = "6")]
    pub added: u64,
    #[prost(uint64, tag = "7")]
    pub changed: u64,
    #[prost(uint64, tag = "8")]
    pub removed: u64,
    /// Empty for the newest.
    #[prost(message, repeated, tag = "9")]
    pub undo: Vec<PersistedUndo>,
}

/// A name and what this version had under it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PersistedUndo {
    #[prost(string, tag = "1")]
    pub name: String,
    /// The encoded `istio.mcp.v1alpha1.Resource` as the cache held it;
    /// absent where the version had none.
    #[prost(bytes = "bytes", optional, tag = "2")]
    pub resource: Option<Bytes>,
}

fn origin_name(origin: Origin) -> &'static str {
    match origin {
        Origin::Upstream => "upstream",
        Origin::Disk => "disk",
        Origin::Files => "files",
        Origin::Unserved => "unserved",
    }
}

fn origin_named(name: &str) -> Option<Origin> {
    [Origin::Upstream, Origin::Disk, Origin::Files, Origin::Unserved]
        .into_iter()
        .find(|o| origin_name(*o) == name)
}

/// A collection's history (as [`Cache::export_history`] gives it) as the
/// bytes of its file.
pub fn encode_history(collection: &str, versions: &[KeptVersion]) -> Vec<u8> {
    let millis = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let payload = PersistedHistory {
        collection: collection.to_owned(),
        versions: versions
            .iter()
            .map(|kept| PersistedVersion {
                version: kept.entry.version.to_string(),
                applied_at_unix_millis: millis(kept.entry.updated_at),
                origin: origin_name(kept.entry.origin).to_owned(),
                resources: kept.entry.resources as u64,
                bytes: kept.entry.bytes as u64,
                added: kept.entry.added as u64,
                changed: kept.entry.changed as u64,
                removed: kept.entry.removed as u64,
                undo: kept
                    .undo
                    .iter()
                    .map(|(name, had)| PersistedUndo {
                        name: name.to_string(),
                        resource: had.as_ref().map(|r| r.encoded.clone()),
                    })
                    .collect(),
            })
            .collect(),
    }
    .encode_to_vec();
    framed(HISTORY_MAGIC, &payload)
}

/// The message in a history file's bytes, or why it is not usable.
pub fn decode_history(file: Bytes) -> Result<PersistedHistory, String> {
    let payload = unframed(HISTORY_MAGIC, "history", file)?;
    PersistedHistory::decode(payload).map_err(|e| format!("does not decode: {e}"))
}

/// The versions a history file holds, their old resources validated as a
/// collection file's are.
fn kept_versions(history: PersistedHistory, secrets: Option<&SecretGuard>) -> Result<Vec<KeptVersion>, String> {
    let collection = &history.collection;
    history
        .versions
        .into_iter()
        .map(|version| {
            let origin = origin_named(&version.origin)
                .ok_or_else(|| format!("version {} has an unknown origin {:?}", version.version, version.origin))?;
            let held: Vec<Bytes> = version.undo.iter().filter_map(|u| u.resource.clone()).collect();
            let mut decoded = crate::source::validate::decode_resources_refusing(collection, &held, secrets)
                .map_err(|nack| format!("version {}: {}", version.version, nack.message))?
                .into_iter();
            let undo = version
                .undo
                .into_iter()
                .map(|u| {
                    let had = u.resource.is_some().then(|| decoded.next().map(Arc::new)).flatten();
                    (SharedStr::from(u.name), had)
                })
                .collect();
            let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
            let updated_at = std::time::UNIX_EPOCH
                .checked_add(std::time::Duration::from_millis(version.applied_at_unix_millis))
                .ok_or_else(|| format!("version {} was applied at no representable time", version.version))?;
            Ok(KeptVersion {
                entry: HistoryEntry {
                    version: version.version.into(),
                    updated_at,
                    origin,
                    resources: count(version.resources),
                    bytes: count(version.bytes),
                    added: count(version.added),
                    changed: count(version.changed),
                    removed: count(version.removed),
                },
                undo,
            })
        })
        .collect()
}

/// Writes `bytes` to `dir/name` so that a reader (or a restart after a crash)
/// sees the old file or the new one, never a mix. The temporary file has a
/// random name, is created with `O_CREAT|O_EXCL` (a planted file or link is
/// never opened), mode 0600, and is removed if any step fails.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let mut temporary = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .tempfile_in(dir)?;
    temporary.write_all(bytes)?;
    temporary.as_file().sync_all()?;
    // The rename replaces whatever is at the target (a link included)
    // without following it.
    temporary.persist(dir.join(name)).map_err(|e| e.error)?;
    // The rename itself is durable once the directory is synced.
    std::fs::File::open(dir)?.sync_all()
}

/// Reads a cache file: a regular file, not through a link, at most `max`
/// bytes.
pub fn read_file(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot open (links are not followed): {e}"))?;
    let metadata = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !metadata.is_file() {
        return Err("not a regular file".into());
    }
    trusted(&metadata)?;
    if metadata.len() > max {
        return Err(format!(
            "{} bytes is larger than a cache file may be ({max})",
            metadata.len()
        ));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(format!("larger than a cache file may be ({max} bytes)"));
    }
    Ok(bytes)
}

/// Whether a cache file is the gateway's own: owned by the user it runs as,
/// and not writable by every user (the gateway writes them 0600; a group's
/// write bit is allowed: Kubernetes sets it on a volume with an `fsGroup`).
/// Any other may have been planted by another user of the machine (config,
/// or a secret, served to every client as if the source had sent it):
/// never loaded.
fn trusted(metadata: &std::fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let user = nix::unistd::geteuid().as_raw();
    if metadata.uid() != user {
        return Err(format!(
            "owned by uid {}, not by the user the gateway runs as ({user}): a file another user wrote is never loaded",
            metadata.uid()
        ));
    }
    if metadata.mode() & 0o002 != 0 {
        return Err(format!(
            "writable by every user (mode {:03o}): never loaded (the gateway writes its files 0600)",
            metadata.mode() & 0o777
        ));
    }
    Ok(())
}

/// Warns when the cache directory lets every user replace its files
/// (writable by others without the sticky bit, or owned by another user):
/// files they write are refused, but they may remove the gateway's own.
fn warn_if_shared(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(metadata) = std::fs::metadata(dir) else {
        return;
    };
    let user = nix::unistd::geteuid().as_raw();
    let open = metadata.mode() & 0o002 != 0 && metadata.mode() & 0o1000 == 0;
    if open || metadata.uid() != user {
        tracing::warn!(
            path = %dir.display(),
            mode = format!("{:03o}", metadata.mode() & 0o7777),
            owner = metadata.uid(),
            "--cache-dir is writable by every user or owned by another: they may remove or replace the gateway's \
             files (files not the gateway's own are never loaded); give it a directory of its own, mode 0700"
        );
    }
}

/// The largest cache file loaded: a collection as large as the largest
/// message the source may send, with room for growth by incremental updates.
pub fn max_file_bytes(max_message_bytes: usize) -> u64 {
    (max_message_bytes as u64).saturating_mul(4).max(256 << 20)
}

/// A temporary file this old is a leftover of a crash, not a write in progress.
const STALE_TEMPORARY: std::time::Duration = std::time::Duration::from_secs(300);

/// The message persisted for `collection`, without applying it or touching
/// the directory (for inspection and tests).
pub fn peek(dir: &Path, collection: &str) -> Result<RawResources, String> {
    decode_bytes(read_file(&dir.join(file_name(collection)), u64::MAX)?.into())
}

/// The history persisted for `collection`, without restoring it (for
/// inspection and tests).
pub fn peek_history(dir: &Path, collection: &str) -> Result<PersistedHistory, String> {
    decode_history(read_file(&dir.join(history_file_name(collection)), u64::MAX)?.into())
}

/// What loading the directory found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Collection, version and resource count of each file applied.
    pub collections: Vec<(String, String, usize)>,
    /// Each file skipped, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
    /// Collection and versions of each history restored.
    pub histories: Vec<(String, usize)>,
    /// Each history file dropped, with the reason (its collection loaded).
    pub histories_skipped: Vec<(PathBuf, String)>,
}

/// Loads every cache file in `dir` into the cache (origin `Disk`). Creates
/// the directory when missing (mode 0700); fails only when it cannot be used
/// at all. Files over `max_file_bytes` are skipped.
pub fn load(
    dir: &Path,
    writer: &mut CacheWriter,
    max_file_bytes: u64,
    secrets: Option<&SecretGuard>,
) -> std::io::Result<Loaded> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    warn_if_shared(dir);
    let mut loaded = Loaded::default();
    let mut paths: Vec<(PathBuf, std::fs::FileType)> = std::fs::read_dir(dir)?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            // The entry's own type: a link is a link, not what it points to.
            Some((entry.path(), entry.file_type().ok()?))
        })
        .collect();
    paths.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, file_type) in paths {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !file_type.is_file() {
            if name.ends_with(EXTENSION) || name.ends_with(".tmp") {
                let reason = "not a regular file (a link, a FIFO or a directory): never read".to_owned();
                tracing::warn!(path = %path.display(), %reason, "skipping an entry of the cache directory");
                loaded.skipped.push((path, reason));
            }
            continue;
        }
        if name.starts_with('.') && name.ends_with(".tmp") {
            // A write interrupted before its rename: the previous file (if
            // any) is intact, this one is not. Only old ones are removed: a
            // recent one may be another process's write in progress.
            let stale = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_TEMPORARY));
            if stale {
                tracing::info!(path = %path.display(), "removing an unfinished write from an earlier run");
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some(EXTENSION) {
            continue;
        }
        match load_file(&path, writer, max_file_bytes, secrets) {
            Ok(found) => {
                let history = dir.join(history_file_name(&found.0));
                match load_history(&history, &found.0, writer, max_file_bytes, secrets) {
                    Ok(None) => {}
                    Ok(Some(versions)) => {
                        tracing::info!(collection = %found.0, versions, "restored the persisted history");
                        loaded.histories.push((found.0.clone(), versions));
                    }
                    Err(reason) => {
                        tracing::warn!(
                            path = %history.display(),
                            %reason,
                            "dropping a persisted history; the collection loaded, and its history starts anew"
                        );
                        loaded.histories_skipped.push((history, reason));
                    }
                }
                loaded.collections.push(found);
            }
            Err(reason) => {
                tracing::warn!(
                    path = %path.display(),
                    %reason,
                    "skipping a persisted collection; it waits for the upstream source"
                );
                loaded.skipped.push((path, reason));
            }
        }
    }
    Ok(loaded)
}

fn load_file(
    path: &Path,
    writer: &mut CacheWriter,
    max_file_bytes: u64,
    secrets: Option<&SecretGuard>,
) -> Result<(String, String, usize), String> {
    let message = decode_bytes(read_file(path, max_file_bytes)?.into())?;
    if message.collection.is_empty() {
        return Err("names no collection".into());
    }
    // A file holds the collection its name says: a stray copy under another
    // name never overrides the real one.
    let expected = file_name(&message.collection);
    if path.file_name().and_then(|n| n.to_str()) != Some(expected.as_str()) {
        return Err(format!(
            "holds collection {:?}, whose file is {expected}",
            message.collection
        ));
    }
    // Written while the collection was one of secrets, read by a gateway
    // that would serve it as open: not restored.
    if message.persisted_sensitive && secrets.is_some_and(|guard| !guard.is_sensitive(&message.collection)) {
        return Err(format!(
            "was written while {} was sensitive, and this gateway's --type-map serves it as open: not restored \
             (mark it sensitive: true, or delete the file)",
            message.collection
        ));
    }
    let resources =
        crate::source::validate::decode_resources_refusing(&message.collection, &message.resources, secrets)
            .map_err(|nack| nack.message)?;
    let count = resources.len();
    let applied = writer.apply(&message.collection, Update::Full(resources), Origin::Disk);
    Ok((message.collection, applied.version().to_string(), count))
}

/// Restores `collection`'s history from `path` under the version just
/// loaded: how many versions it holds then, or `None` when there is no
/// history file (a directory from before histories were kept).
fn load_history(
    path: &Path,
    collection: &str,
    writer: &mut CacheWriter,
    max_file_bytes: u64,

    secrets: Option<&SecretGuard>,
) -> Result<Option<usize>, String> {
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(None);
    }
    let history = decode_history(read_file(path, max_file_bytes)?.into())?;
    if history.collection != collection {
        return Err(format!(
            "holds the history of {:?}, not of {collection:?}",
            history.collection
        ));
    }
    writer
        .restore_history(collection, kept_versions(history, secrets)?)
        .map(Some)
}

/// Hands collections to the writer task; cheap to clone.
#[derive(Clone, Debug)]
pub struct Persister {
    tx: mpsc::UnboundedSender<SharedStr>,
}

impl Persister {
    /// Starts the writer. It writes the cache's current state of each
    /// collection it is told about (bursts coalesce), and drains what is
    /// pending before it stops at `shutdown`.
    /// `table`: which collections are of secrets here, marked so in their
    /// files.
    pub fn start(
        dir: PathBuf,
        cache: Arc<Cache>,
        table: Arc<crate::collections::CollectionTable>,
        shutdown: CancellationToken,
        tasks: &TaskTracker,
    ) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<SharedStr>();
        tasks.spawn(async move {
            loop {
                let first = tokio::select! {
                    next = rx.recv() => match next {
                        Some(collection) => collection,
                        None => return,
                    },
                    _ = shutdown.cancelled() => match rx.try_recv() {
                        Ok(collection) => collection,
                        Err(_) => return,
                    },
                };
                let mut pending = HashSet::from([first]);
                while let Ok(more) = rx.try_recv() {
                    pending.insert(more);
                }
                // The snapshot and its history, taken together so they agree.
                let exports: Vec<_> = pending.iter().filter_map(|c| cache.export_history(c)).collect();
                let dir = dir.clone();
                let table = table.clone();
                let written = tokio::task::spawn_blocking(move || {
                    for (snapshot, history) in exports {
                        if snapshot.origin != Origin::Upstream {
                            continue;
                        }
                        // The collection first: a history is restored only
                        // onto the version it ends with, so a crash between
                        // the two costs the history, never the collection.
                        let written =
                            write_persisted(&dir, &snapshot.collection, &file_name(&snapshot.collection), || {
                                encode(&snapshot, table.is_sensitive(&snapshot.collection))
                            }) && write_persisted(
                                &dir,
                                &snapshot.collection,
                                &history_file_name(&snapshot.collection),
                                || encode_history(&snapshot.collection, &history),
                            );
                        if written {
                            tracing::debug!(
                                collection = %snapshot.collection,
                                version = %snapshot.version,
                                history = history.len(),
                                "persisted"
                            );
                        }
                    }
                })
                .await;
                if let Err(e) = written {
                    tracing::error!(error = %e, "the cache writer failed");
                }
            }
        });
        Self { tx }
    }

    /// Schedules a write of the collection's current state and history.
    pub fn changed(&self, collection: &str) {
        let _ = self.tx.send(SharedStr::from(collection));
    }
}

/// Writes one of `collection`'s files, counting and reporting a failure:
/// whether it was written.
fn write_persisted(dir: &Path, collection: &SharedStr, name: &str, bytes: impl FnOnce() -> Vec<u8>) -> bool {
    let Err(e) = write_atomically(dir, name, &bytes()) else {
        return true;
    };
    metrics::counter!(crate::metrics::CACHE_WRITE_FAILURES, "collection" => crate::metrics::label(collection))
        .increment(1);
    tracing::warn!(
        %collection,
        path = %dir.join(name).display(),
        error = %e,
        "cannot persist the collection; the previous file is kept, and the next change is written again"
    );
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CachedResource;

    const C: &str = "istio/networking/v1alpha3/gateways";

    fn resource(name: &str, version: &str) -> CachedResource {
        let encoded = crate::proto::wire::test_support::encoded_resource(name, version, b"body");
        // Through the same validation as upstream data (the digest included).
        crate::source::validate::decode_resources(C, &[encoded])
            .unwrap()
            .pop()
            .unwrap()
    }

    #[test]
    fn file_names_are_distinct_and_safe() {
        assert_eq!(file_name(C), "istio~2Fnetworking~2Fv1alpha3~2Fgateways.mcpcache");
        assert_ne!(file_name("a/b"), file_name("a~2Fb"));
        assert!(!file_name("../x").contains('/'));
    }

    #[test]
    fn a_written_collection_loads_at_the_same_version() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(
            C,
            Update::Full(vec![resource("a", "1"), resource("b", "2")]),
            Origin::Upstream,
        );
        let snapshot = cache.get(C).unwrap();
        write_atomically(dir.path(), &file_name(C), &encode(&snapshot, false)).unwrap();

        let (restarted, mut restarted_writer) = Cache::new();
        let loaded = load(dir.path(), &mut restarted_writer, u64::MAX, None).unwrap();
        assert!(loaded.skipped.is_empty(), "{:?}", loaded.skipped);
        let reloaded = restarted.get(C).unwrap();
        assert_eq!(reloaded.version, snapshot.version);
        assert_eq!(reloaded.origin, Origin::Disk);
        assert_eq!(
            loaded.collections,
            vec![(C.to_owned(), snapshot.version.to_string(), 2)]
        );
    }

    #[test]
    fn torn_damaged_and_foreign_files_are_skipped_and_leftovers_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(C, Update::Full(vec![resource("a", "1")]), Origin::Upstream);
        let good = encode(&cache.get(C).unwrap(), false);
        // Torn: the first half of a valid file.
        std::fs::write(dir.path().join("torn.mcpcache"), &good[..good.len() / 2]).unwrap();
        // Damaged: one payload byte flipped.
        let mut damaged = good.clone();
        *damaged.last_mut().unwrap() ^= 0xff;
        std::fs::write(dir.path().join("damaged.mcpcache"), &damaged).unwrap();
        std::fs::write(dir.path().join("foreign.mcpcache"), b"hello").unwrap();
        let leftover = dir.path().join(".x.mcpcache.abc123.tmp");
        std::fs::write(&leftover, &good).unwrap();
        let old = std::time::SystemTime::now() - 2 * STALE_TEMPORARY;
        std::fs::File::options()
            .write(true)
            .open(&leftover)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let in_progress = dir.path().join(".y.mcpcache.def456.tmp");
        std::fs::write(&in_progress, &good).unwrap();

        let (fresh, mut fresh_writer) = Cache::new();
        let loaded = load(dir.path(), &mut fresh_writer, u64::MAX, None).unwrap();
        assert!(loaded.collections.is_empty());
        assert_eq!(loaded.skipped.len(), 3);
        assert!(
            loaded.skipped.iter().any(|(_, r)| r.contains("checksum")),
            "{:?}",
            loaded.skipped
        );
        assert!(
            loaded.skipped.iter().any(|(_, r)| r.contains("bad header")),
            "{:?}",
            loaded.skipped
        );
        assert!(fresh.get(C).is_none());
        assert!(!leftover.exists(), "a leftover of a crash is removed");
        assert!(
            in_progress.exists(),
            "a recent temporary file may be a write in progress"
        );
    }

    #[test]
    fn a_file_with_invalid_resources_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let message = RawResources {
            collection: C.into(),
            resources: vec![Bytes::from_static(b"\x0a\x00")],
            ..Default::default()
        };
        let payload = message.encode_to_vec();
        let mut file = MAGIC.to_vec();
        file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&payload).to_le_bytes());
        file.extend_from_slice(&payload);
        std::fs::write(dir.path().join(file_name(C)), file).unwrap();
        let (cache, mut cache_writer) = Cache::new();
        let loaded = load(dir.path(), &mut cache_writer, u64::MAX, None).unwrap();
        assert_eq!(loaded.skipped.len(), 1);
        assert!(loaded.skipped[0].1.contains("metadata.name"), "{:?}", loaded.skipped);
        assert!(cache.get(C).is_none());
    }

    #[test]
    fn temporary_files_are_private_random_and_never_follow_links() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        // A planted link where the old per-process name would have been, and
        // at the target: neither is followed.
        let name = file_name(C);
        std::os::unix::fs::symlink(&victim, dir.path().join(format!(".{name}.{}.tmp", std::process::id()))).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join(&name)).unwrap();
        write_atomically(dir.path(), &name, b"new state").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let target = dir.path().join(&name);
        assert!(!std::fs::symlink_metadata(&target).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&target).unwrap(), b"new state");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp") && e.file_type().unwrap().is_file())
            .collect();
        assert!(leftovers.is_empty(), "no temporary file is left behind");
    }

    #[test]
    fn links_fifos_and_oversized_files_are_skipped_when_loading() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(C, Update::Full(vec![resource("a", "1")]), Origin::Upstream);
        let good = encode(&cache.get(C).unwrap(), false);
        let elsewhere = tempfile::tempdir().unwrap();
        let outside = elsewhere.path().join("outside.mcpcache");
        std::fs::write(&outside, &good).unwrap();
        std::os::unix::fs::symlink(&outside, dir.path().join(file_name(C))).unwrap();
        let fifo = dir.path().join("fifo.mcpcache");
        // A FIFO that cannot be made fails the test: its case is not skipped.
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(
            made.as_ref().is_ok_and(|s| s.success()),
            "mkfifo {}: {made:?}",
            fifo.display()
        );
        std::fs::write(dir.path().join("big.mcpcache"), &good).unwrap();

        let (fresh, mut fresh_writer) = Cache::new();
        let loaded = load(dir.path(), &mut fresh_writer, good.len() as u64 - 1, None).unwrap();
        assert!(fresh.get(C).is_none(), "nothing is read through a link");
        let reasons: Vec<&str> = loaded.skipped.iter().map(|(_, r)| r.as_str()).collect();
        assert!(reasons.iter().any(|r| r.contains("larger than")), "{reasons:?}");
        let not_regular = reasons.iter().filter(|r| r.contains("not a regular file")).count();
        assert_eq!(not_regular, 2, "the link and the FIFO: {reasons:?}");
    }

    /// A cache file another user may have written (writable by everyone,
    /// or owned by another user) is never loaded: it could plant config or
    /// a secret served as if the source had sent it. A group's write bit
    /// (Kubernetes' `fsGroup`) is allowed.
    #[test]
    fn files_another_user_may_have_written_are_never_loaded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(C, Update::Full(vec![resource("a", "1")]), Origin::Upstream);
        let good = encode(&cache.get(C).unwrap(), false);
        let path = dir.path().join(file_name(C));
        std::fs::write(&path, &good).unwrap();
        let load_with = |mode: u32| {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let (fresh, mut fresh_writer) = Cache::new();
            let loaded = load(dir.path(), &mut fresh_writer, u64::MAX, None).unwrap();
            (fresh.get(C).is_some(), loaded.skipped)
        };
        let (read, skipped) = load_with(0o666);
        assert!(!read, "{skipped:?}");
        assert!(
            skipped[0].1.contains("writable by every user (mode 666)"),
            "{skipped:?}"
        );
        let (read, skipped) = load_with(0o660);
        assert!(read && skipped.is_empty(), "{skipped:?}");
        // Another owner: only a privileged test run can make one.
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            let (read, skipped) = load_with(0o600);
            assert!(!read, "{skipped:?}");
            assert!(skipped[0].1.contains("owned by uid 65534"), "{skipped:?}");
        }
    }

    /// A persisted secret's body in a collection every client reads (a file
    /// from a build that took it, or one planted) is refused on load as
    /// the source would refuse it: the collection waits for the source.
    #[test]
    fn a_persisted_secret_outside_the_collections_of_secrets_is_not_loaded() {
        use prost::Message as _;
        let clusters = "envoy/config/cluster/v3/clusters";
        let secret = crate::tools::galley::resource(
            "s",
            "1",
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
            b"\x0a\x0bMARKER-NAME",
        );
        let decoded = crate::source::validate::decode_resources(clusters, &[secret.encode_to_vec().into()]).unwrap();
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply(clusters, Update::Full(decoded), Origin::Upstream);
        let dir = tempfile::tempdir().unwrap();
        write_atomically(
            dir.path(),
            &file_name(clusters),
            &encode(&cache.get(clusters).unwrap(), false),
        )
        .unwrap();
        let table = crate::collections::CollectionTable::builtin()
            .with_sensitive_types(crate::source::proto_json::secret_type_urls());
        let guard = SecretGuard::new(Arc::new(table));
        let (fresh, mut fresh_writer) = Cache::new();
        let loaded = load(dir.path(), &mut fresh_writer, u64::MAX, Some(&guard)).unwrap();
        assert!(fresh.get(clusters).is_none());
        assert!(loaded.skipped[0].1.contains("holds secrets"), "{:?}", loaded.skipped);
        assert!(!loaded.skipped[0].1.contains("MARKER"), "{:?}", loaded.skipped);
    }

    /// A collection written while it was sensitive is not restored by a
    /// gateway whose `--type-map` serves it as open (the twenty-fifth
    /// check of issue 42: a chained gateway's cache would otherwise serve
    /// what its upstream called secret); one that still marks it is.
    #[test]
    fn a_collection_persisted_as_sensitive_is_not_restored_as_open() {
        let (cache, mut cache_writer) = Cache::new();
        cache_writer.apply("custom/creds", Update::Full(vec![resource("c", "1")]), Origin::Upstream);
        let dir = tempfile::tempdir().unwrap();
        let file = encode(&cache.get("custom/creds").unwrap(), true);
        write_atomically(dir.path(), &file_name("custom/creds"), &file).unwrap();
        let guard = |row: &str| {
            let table = crate::collections::CollectionTable::builtin()
                .with_type_map_yaml(row)
                .unwrap();
            SecretGuard::new(Arc::new(table))
        };
        let open = guard("custom/creds: type.googleapis.com/google.protobuf.Struct\n");
        let (fresh, mut fresh_writer) = Cache::new();
        let loaded = load(dir.path(), &mut fresh_writer, u64::MAX, Some(&open)).unwrap();
        assert!(fresh.get("custom/creds").is_none());
        assert!(
            loaded.skipped[0]
                .1
                .contains("was written while custom/creds was sensitive"),
            "{:?}",
            loaded.skipped
        );
        let marked = guard("custom/creds: {type_url: type.googleapis.com/google.protobuf.Struct, sensitive: true}\n");
        let (fresh, mut fresh_writer) = Cache::new();
        load(dir.path(), &mut fresh_writer, u64::MAX, Some(&marked)).unwrap();
        assert_eq!(fresh.get("custom/creds").unwrap().len(), 1);
    }

    /// A cache with history `keep` that went through four versions of C
    /// (adds, a change, a removal, a re-add), its last one written to `dir`
    /// as the Persister writes it: the collection, then its history.
    fn four_versions_written(dir: &Path, keep: usize) -> Arc<Cache> {
        let (cache, mut writer) = Cache::with_history(keep);
        let steps = [
            Update::Full(vec![resource("a", "1"), resource("b", "1"), resource("c", "1")]),
            Update::Incremental {
                upserts: vec![resource("b", "2"), resource("d", "1")],
                removed: vec!["a".into()],
            },
            Update::Incremental {
                upserts: vec![],
                removed: vec!["c".into()],
            },
            Update::Incremental {
                upserts: vec![resource("a", "3")],
                removed: vec![],
            },
        ];
        for step in steps {
            writer.apply(C, step, Origin::Upstream);
        }
        write_both(dir, &cache);
        cache
    }

    fn write_both(dir: &Path, cache: &Cache) {
        let (snapshot, history) = cache.export_history(C).unwrap();
        write_atomically(dir, &file_name(C), &encode(&snapshot, false)).unwrap();
        write_atomically(dir, &history_file_name(C), &encode_history(C, &history)).unwrap();
    }

    /// What `/debug/history` shows of an entry, to the millisecond a file
    /// keeps.
    fn listed(entries: Vec<HistoryEntry>) -> Vec<HistoryEntry> {
        entries
            .into_iter()
            .map(|mut e| {
                let millis = e.updated_at.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
                e.updated_at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(millis as u64);
                e
            })
            .collect()
    }

    #[test]
    fn a_history_round_trips_through_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let before = four_versions_written(dir.path(), 10);
        assert_eq!(
            history_file_name(C),
            "istio~2Fnetworking~2Fv1alpha3~2Fgateways.mcphistory"
        );

        let (restarted, mut writer) = Cache::with_history(10);
        let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
        assert!(loaded.histories_skipped.is_empty(), "{:?}", loaded.histories_skipped);
        assert_eq!(loaded.histories, [(C.to_owned(), 4)]);
        let mut expected = listed(before.history(C).unwrap());
        expected[0].origin = Origin::Disk;
        assert_eq!(listed(restarted.history(C).unwrap()), expected);
        for entry in &expected {
            let was = before.version_resources(C, &entry.version).unwrap();
            let is = restarted.version_resources(C, &entry.version).unwrap();
            assert!(is == was, "version {} rebuilds as it was", entry.version);
            assert_eq!(crate::cache::collection_version(&is), *entry.version);
            let bytes = |m: &crate::cache::ResourceMap| m.values().map(|r| r.encoded.clone()).collect::<Vec<_>>();
            assert_eq!(bytes(&is), bytes(&was));
            let served = restarted.version_snapshot(C, &entry.version).unwrap();
            assert_eq!((served.len(), served.bytes), (entry.resources, entry.bytes));
        }
        assert_eq!(restarted.history_usage(C), before.history_usage(C));

        // A shorter --history keeps the newest versions.
        let (short, mut writer) = Cache::with_history(2);
        let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
        assert_eq!(loaded.histories, [(C.to_owned(), 2)]);
        assert_eq!(listed(short.history(C).unwrap()), expected[..2]);
        assert!(
            short.version_resources(C, &expected[1].version).unwrap()
                == before.version_resources(C, &expected[1].version).unwrap()
        );
    }

    #[test]
    fn a_history_that_does_not_end_at_the_loaded_version_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let cache = four_versions_written(dir.path(), 10);
        let history_then = std::fs::read(dir.path().join(history_file_name(C))).unwrap();
        // A newer version whose collection file is written but not its
        // history (a crash between the two writes).
        let (next, mut next_writer) = Cache::new();
        let names: Vec<_> = cache.get(C).unwrap().resources.keys().cloned().collect();
        next_writer.apply(
            C,
            Update::Full(names.iter().map(|n| resource(n, "9")).collect()),
            Origin::Upstream,
        );
        let newer = next.get(C).unwrap();
        write_atomically(dir.path(), &file_name(C), &encode(&newer, false)).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join(history_file_name(C))).unwrap(),
            history_then
        );

        let (restarted, mut writer) = Cache::new();
        let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
        assert_eq!(loaded.collections.len(), 1, "the collection loads");
        assert_eq!(restarted.get(C).unwrap().version, newer.version);
        assert_eq!(loaded.histories_skipped.len(), 1);
        assert!(
            loaded.histories_skipped[0].1.contains("newest version"),
            "{:?}",
            loaded.histories_skipped
        );
        assert_eq!(restarted.history(C).unwrap().len(), 1, "only the loaded version");
    }

    #[test]
    fn damaged_foreign_and_inconsistent_histories_are_dropped_and_the_collection_still_loads() {
        let dir = tempfile::tempdir().unwrap();
        let cache = four_versions_written(dir.path(), 10);
        let path = dir.path().join(history_file_name(C));
        let good = std::fs::read(&path).unwrap();
        let version = cache.get(C).unwrap().version.clone();
        let (_, history) = cache.export_history(C).unwrap();
        let payload = |message: &PersistedHistory| framed(HISTORY_MAGIC, &message.encode_to_vec());
        let message = decode_history(good.clone().into()).unwrap();

        let mut damaged = good.clone();
        *damaged.last_mut().unwrap() ^= 0xff;
        let mut other = message.clone();
        other.collection = "istio/networking/v1alpha3/virtualservices".into();
        // An undo that names one resource and holds another.
        let mut misnamed = message.clone();
        misnamed.versions[0].undo[0].name = "zzz".into();
        // An undo that is not what changed: the oldest version no longer
        // rebuilds to its content version.
        let mut tampered = message.clone();
        tampered.versions[0].undo.pop();
        let mut invalid = message.clone();
        invalid.versions[1].undo[0].resource = Some(Bytes::from_static(b"\x0a\x00"));
        let cases: [(&str, Vec<u8>, &str); 7] = [
            ("torn", good[..good.len() / 2].to_vec(), "checksum"),
            ("damaged", damaged, "checksum"),
            ("a cache file", encode(&cache.get(C).unwrap(), false), "bad header"),
            ("another collection's", payload(&other), "virtualservices"),
            ("misnamed", payload(&misnamed), "zzz"),
            ("tampered", payload(&tampered), "rebuilds to"),
            ("invalid", payload(&invalid), "metadata"),
        ];
        assert!(history.len() == 4 && history[0].undo.len() > 1);
        for (what, bytes, reason) in cases {
            std::fs::write(&path, bytes).unwrap();
            let (restarted, mut writer) = Cache::new();
            let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
            assert_eq!(
                restarted.get(C).unwrap().version,
                version,
                "{what}: the collection loads"
            );
            assert!(loaded.skipped.is_empty(), "{what}: {:?}", loaded.skipped);
            assert_eq!(loaded.histories_skipped.len(), 1, "{what}");
            assert!(
                loaded.histories_skipped[0].1.contains(reason),
                "{what}: {:?}",
                loaded.histories_skipped
            );
            assert_eq!(
                restarted.history(C).unwrap().len(),
                1,
                "{what}: only the loaded version"
            );
        }

        // Too large for the bound, or a link: dropped the same way.
        std::fs::write(&path, &good).unwrap();
        let collection_file = std::fs::metadata(dir.path().join(file_name(C))).unwrap().len();
        assert!(
            good.len() as u64 > collection_file,
            "the history holds more than the newest"
        );
        let bound = good.len() as u64 - 1;
        let (_, mut writer) = Cache::new();
        let loaded = load(dir.path(), &mut writer, bound, None).unwrap();
        assert_eq!(loaded.collections.len(), 1);
        assert!(
            loaded.histories_skipped[0].1.contains("larger than"),
            "{:?}",
            loaded.histories_skipped
        );
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::rename(&path, elsewhere.path().join("h")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("h"), &path).unwrap();
        let (_, mut writer) = Cache::new();
        let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
        assert!(
            loaded.histories_skipped[0].1.contains("links are not followed"),
            "{:?}",
            loaded.histories_skipped
        );
        // No history file at all is not a problem.
        std::fs::remove_file(&path).unwrap();
        let (_, mut writer) = Cache::new();
        let loaded = load(dir.path(), &mut writer, u64::MAX, None).unwrap();
        assert!(loaded.histories.is_empty() && loaded.histories_skipped.is_empty());
    }

    #[test]
    fn a_failed_write_leaves_the_last_good_file_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let name = file_name(C);
        write_atomically(dir.path(), &name, b"good").unwrap();
        // A directory where the temporary file's rename must land fails the
        // write after the temporary file was written.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"").unwrap();
        assert!(write_atomically(dir.path(), "blocked", b"new").is_err());
        assert_eq!(std::fs::read(dir.path().join(&name)).unwrap(), b"good");
        let temporary = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"));
        assert!(!temporary, "the temporary file was removed");
        // Later writes succeed.
        write_atomically(dir.path(), &name, b"newer").unwrap();
        assert_eq!(std::fs::read(dir.path().join(&name)).unwrap(), b"newer");
    }
}
