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

use crate::cache::{Cache, CacheWriter, CollectionSnapshot, Origin, Update};
use crate::proto::wire::RawResources;

const MAGIC: &[u8; 16] = b"mcp-xds-gateway\n";
const HEADER: usize = MAGIC.len() + 8;
pub const EXTENSION: &str = "mcpcache";

/// The file a collection is kept in. Anything but `[A-Za-z0-9._-]` is
/// escaped as `~XX`, so every collection name maps to one distinct file.
pub fn file_name(collection: &str) -> String {
    let mut name = String::with_capacity(collection.len() + 16);
    for byte in collection.bytes() {
        match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' => name.push(byte as char),
            _ => name.push_str(&format!("~{byte:02X}")),
        }
    }
    name.push('.');
    name.push_str(EXTENSION);
    name
}

/// A snapshot as the bytes of its file.
pub fn encode(snapshot: &CollectionSnapshot) -> Vec<u8> {
    let payload = RawResources {
        system_version_info: snapshot.version.to_string(),
        collection: snapshot.collection.to_string(),
        resources: snapshot.resources.values().map(|r| r.encoded.clone()).collect(),
        ..Default::default()
    }
    .encode_to_vec();
    let mut file = Vec::with_capacity(HEADER + payload.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&payload).to_le_bytes());
    file.extend_from_slice(&payload);
    file
}

/// The message in a file's bytes, or why it is not usable.
pub fn decode(file: &[u8]) -> Result<RawResources, String> {
    decode_bytes(Bytes::copy_from_slice(file))
}

/// As [`decode`], without copying: the resources are slices of `file`.
pub fn decode_bytes(file: Bytes) -> Result<RawResources, String> {
    if file.len() < HEADER || &file[..MAGIC.len()] != MAGIC {
        return Err("not a gateway cache file (bad header)".into());
    }
    let checksum = u64::from_le_bytes(file[MAGIC.len()..HEADER].try_into().expect("8 bytes"));
    let payload = file.slice(HEADER..);
    if xxhash_rust::xxh3::xxh3_64(&payload) != checksum {
        return Err("checksum mismatch: the file is truncated or damaged".into());
    }
    RawResources::decode(payload).map_err(|e| format!("does not decode: {e}"))
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
fn read_file(path: &Path, max: u64) -> Result<Vec<u8>, String> {
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

/// What loading the directory found.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Collection, version and resource count of each file applied.
    pub collections: Vec<(String, String, usize)>,
    /// Each file skipped, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

/// Loads every cache file in `dir` into the cache (origin `Disk`). Creates
/// the directory when missing (mode 0700); fails only when it cannot be used
/// at all. Files over `max_file_bytes` are skipped.
pub fn load(dir: &Path, writer: &mut CacheWriter, max_file_bytes: u64) -> std::io::Result<Loaded> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
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
        match load_file(&path, writer, max_file_bytes) {
            Ok(found) => loaded.collections.push(found),
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

fn load_file(path: &Path, writer: &mut CacheWriter, max_file_bytes: u64) -> Result<(String, String, usize), String> {
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
    let resources = crate::source::validate::decode_resources(&message.collection, &message.resources)
        .map_err(|nack| nack.message)?;
    let count = resources.len();
    let applied = writer.apply(&message.collection, Update::Full(resources), Origin::Disk);
    Ok((message.collection, applied.version().to_string(), count))
}

/// Hands collections to the writer task; cheap to clone.
#[derive(Clone, Debug)]
pub struct Persister {
    tx: mpsc::UnboundedSender<Arc<str>>,
}

impl Persister {
    /// Starts the writer. It writes the cache's current state of each
    /// collection it is told about (bursts coalesce), and drains what is
    /// pending before it stops at `shutdown`.
    pub fn start(dir: PathBuf, cache: Arc<Cache>, shutdown: CancellationToken, tasks: &TaskTracker) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Arc<str>>();
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
                let snapshots: Vec<_> = pending.iter().filter_map(|c| cache.get(c)).collect();
                let dir = dir.clone();
                let written = tokio::task::spawn_blocking(move || {
                    for snapshot in snapshots {
                        if snapshot.origin != Origin::Upstream {
                            continue;
                        }
                        let name = file_name(&snapshot.collection);
                        match write_atomically(&dir, &name, &encode(&snapshot)) {
                            Ok(()) => tracing::debug!(
                                collection = %snapshot.collection,
                                version = %snapshot.version,
                                "persisted"
                            ),
                            Err(e) => {
                                metrics::counter!(
                                    crate::metrics::CACHE_WRITE_FAILURES,
                                    "collection" => snapshot.collection.clone()
                                )
                                .increment(1);
                                tracing::warn!(
                                    collection = %snapshot.collection,
                                    path = %dir.join(&name).display(),
                                    error = %e,
                                    "cannot persist the collection; the previous file is kept, and the next \
                                     change is written again"
                                );
                            }
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

    /// Schedules a write of the collection's current state.
    pub fn changed(&self, collection: &str) {
        let _ = self.tx.send(Arc::from(collection));
    }
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
        write_atomically(dir.path(), &file_name(C), &encode(&snapshot)).unwrap();

        let (restarted, mut restarted_writer) = Cache::new();
        let loaded = load(dir.path(), &mut restarted_writer, u64::MAX).unwrap();
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
        let good = encode(&cache.get(C).unwrap());
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
        let loaded = load(dir.path(), &mut fresh_writer, u64::MAX).unwrap();
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
        let loaded = load(dir.path(), &mut cache_writer, u64::MAX).unwrap();
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
        let good = encode(&cache.get(C).unwrap());
        let elsewhere = tempfile::tempdir().unwrap();
        let outside = elsewhere.path().join("outside.mcpcache");
        std::fs::write(&outside, &good).unwrap();
        std::os::unix::fs::symlink(&outside, dir.path().join(file_name(C))).unwrap();
        let fifo = dir.path().join("fifo.mcpcache");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        std::fs::write(dir.path().join("big.mcpcache"), &good).unwrap();

        let (fresh, mut fresh_writer) = Cache::new();
        let loaded = load(dir.path(), &mut fresh_writer, good.len() as u64 - 1).unwrap();
        assert!(fresh.get(C).is_none(), "nothing is read through a link");
        let reasons: Vec<&str> = loaded.skipped.iter().map(|(_, r)| r.as_str()).collect();
        assert!(reasons.iter().any(|r| r.contains("larger than")), "{reasons:?}");
        let not_regular = reasons.iter().filter(|r| r.contains("not a regular file")).count();
        let expected = if made.is_ok_and(|s| s.success()) { 2 } else { 1 };
        assert_eq!(not_regular, expected, "{reasons:?}");
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
