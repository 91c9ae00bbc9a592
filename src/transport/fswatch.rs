//! Change notification for files the gateway reads while running (the local
//! source directory, TLS certificates), on top of `notify`. Directories are
//! watched rather than files: editors and Kubernetes volume updates replace
//! files (rename, `..data` symlink swap), which a watch on the old file misses.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long changes must settle before the watcher reports them, so a burst
/// of writes (an editor's save, a volume swap) is read once, complete.
pub const SETTLE: Duration = Duration::from_millis(100);

/// A live watch: `changed` yields once per settled burst of changes.
pub struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    changes: Settling,
}

/// Change signals, reported once they settle.
struct Settling {
    signals: mpsc::Receiver<()>,
    /// When the changes heard and not yet reported settle (`SETTLE` after
    /// the last): kept across a `changed` dropped while it waited, so the
    /// next one neither loses the change nor starts the wait again.
    quiet_at: Option<tokio::time::Instant>,
}

impl Settling {
    fn new(signals: mpsc::Receiver<()>) -> Self {
        Self {
            signals,
            quiet_at: None,
        }
    }

    /// See [`DirWatch::changed`].
    async fn changed(&mut self) -> bool {
        loop {
            let Some(quiet_at) = self.quiet_at else {
                if self.signals.recv().await.is_none() {
                    return false;
                }
                self.quiet_at = Some(tokio::time::Instant::now() + SETTLE);
                continue;
            };
            tokio::select! {
                signal = self.signals.recv() => match signal {
                    Some(()) => self.quiet_at = Some(tokio::time::Instant::now() + SETTLE),
                    None => return false,
                },
                () = tokio::time::sleep_until(quiet_at) => {
                    self.quiet_at = None;
                    return true;
                }
            }
        }
    }
}

impl DirWatch {
    /// Watches each directory (not recursively): any change in it.
    pub fn new(dirs: &[PathBuf]) -> notify::Result<Self> {
        Self::watching(dirs, None)
    }

    /// Watches `files` only: a change of one of them, or of the `..data`
    /// link beside them (a Kubernetes volume's swap), not of anything else in
    /// their directories (a log file written beside a certificate would
    /// otherwise make it reload every time it is written).
    pub fn files(files: &[&Path]) -> notify::Result<Self> {
        let mut dirs: Vec<PathBuf> = files.iter().map(|f| parent_dir(f)).collect();
        dirs.sort();
        dirs.dedup();
        let mut names: Vec<OsString> = files.iter().filter_map(|f| f.file_name()).map(OsString::from).collect();
        names.push(OsString::from(K8S_DATA_LINK));
        Self::watching(&dirs, Some(names))
    }

    fn watching(dirs: &[PathBuf], names: Option<Vec<OsString>>) -> notify::Result<Self> {
        let (tx, changes) = mpsc::channel(1);
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let relevant = match event {
                Ok(event) => {
                    !matches!(event.kind, EventKind::Access(_))
                        && names.as_ref().is_none_or(|names| {
                            event
                                .paths
                                .iter()
                                .any(|p| p.file_name().is_some_and(|n| names.iter().any(|w| w == n)))
                        })
                }
                // A watcher error (an overflowed queue) may hide changes: re-read.
                Err(_) => true,
            };
            if relevant {
                // Full means a signal is already pending: coalesced.
                let _ = tx.try_send(());
            }
        })?;
        for dir in dirs {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
        }
        Ok(Self {
            _watcher: watcher,
            changes: Settling::new(changes),
        })
    }

    /// Waits for the next change, then for the changes to settle. Returns
    /// `false` when the watcher is gone.
    ///
    /// Cancel-safe: a change heard by a call dropped before it settled (its
    /// caller's `select!` took another branch) is reported by the next call
    /// when it settles, neither lost (the files source, whose select also
    /// follows subscriptions, missed a Kubernetes volume swap that way and
    /// served the old files until the next change) nor put off by calls
    /// dropped again and again.
    pub async fn changed(&mut self) -> bool {
        self.changes.changed().await
    }
}

/// The link a Kubernetes volume (a ConfigMap, a Secret) swaps to update its
/// files at once; the files themselves are links through it.
const K8S_DATA_LINK: &str = "..data";

/// The directory a file lives in (`.` for a bare file name).
pub fn parent_dir(path: &std::path::Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait dropped while a change settles does not lose the change.
    #[tokio::test(start_paused = true)]
    async fn a_change_heard_by_a_dropped_wait_is_reported_by_the_next() {
        let (tx, rx) = mpsc::channel(1);
        let mut settling = Settling::new(rx);
        tx.try_send(()).unwrap();
        // Dropped halfway through the settling time, the signal taken.
        let dropped = tokio::time::timeout(SETTLE / 2, settling.changed()).await;
        assert!(dropped.is_err());
        assert!(tx.try_send(()).is_ok(), "the signal was taken from the channel");
        let _ = settling.signals.try_recv();
        // Within what was left of the settling time: the wait is not started
        // again by each new call.
        let reported = tokio::time::timeout(SETTLE * 3 / 4, settling.changed()).await;
        assert_eq!(reported.ok(), Some(true), "the change heard before is reported");
        // Reported once: nothing more is pending.
        let again = tokio::time::timeout(SETTLE * 10, settling.changed()).await;
        assert!(again.is_err(), "a change is reported once");
        drop(tx);
        assert!(!settling.changed().await, "the watcher gone");
    }

    /// A watch of named files hears them and a volume's `..data` swap, and
    /// not the other files of their directory (a log written beside a
    /// certificate made it reload every time it was written).
    #[tokio::test]
    async fn a_file_watch_hears_its_files_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("tls.crt");
        std::fs::write(&cert, "a").unwrap();
        let mut watch = DirWatch::files(&[cert.as_path()]).unwrap();
        for i in 0..20 {
            std::fs::write(dir.path().join("gateway.log"), format!("line {i}")).unwrap();
        }
        let heard = tokio::time::timeout(Duration::from_millis(500), watch.changed()).await;
        assert!(heard.is_err(), "a write beside it is not a change of it");

        std::fs::write(&cert, "b").unwrap();
        let heard = tokio::time::timeout(Duration::from_secs(10), watch.changed()).await;
        assert_eq!(heard.ok(), Some(true), "a write of the file is heard");

        // Kubernetes: a new timestamped directory, then `..data` renamed over.
        std::fs::create_dir(dir.path().join("..2026_11_27")).unwrap();
        std::os::unix::fs::symlink("..2026_11_27", dir.path().join("..data_tmp")).unwrap();
        std::fs::rename(dir.path().join("..data_tmp"), dir.path().join("..data")).unwrap();
        let heard = tokio::time::timeout(Duration::from_secs(10), watch.changed()).await;
        assert_eq!(heard.ok(), Some(true), "a ..data swap is heard");
    }
}
