//! Change notification for files the gateway reads while running (the local
//! source directory, TLS certificates), on top of `notify`. Directories are
//! watched rather than files: editors and Kubernetes volume updates replace
//! files (rename, `..data` symlink swap), which a watch on the old file misses.

use std::path::PathBuf;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long changes must settle before the watcher reports them, so a burst
/// of writes (an editor's save, a volume swap) is read once, complete.
pub const SETTLE: Duration = Duration::from_millis(100);

/// A live watch: `changed` yields once per settled burst of changes.
pub struct DirWatch {
    _watcher: notify::RecommendedWatcher,
    changes: mpsc::Receiver<()>,
}

impl DirWatch {
    /// Watches each directory (not recursively).
    pub fn new(dirs: &[PathBuf]) -> notify::Result<Self> {
        let (tx, changes) = mpsc::channel(1);
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let relevant = match event {
                Ok(event) => !matches!(event.kind, EventKind::Access(_)),
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
            changes,
        })
    }

    /// Waits for the next change, then for the changes to settle. Returns
    /// `false` when the watcher is gone.
    pub async fn changed(&mut self) -> bool {
        if self.changes.recv().await.is_none() {
            return false;
        }
        loop {
            match tokio::time::timeout(SETTLE, self.changes.recv()).await {
                Err(_) => return true,
                Ok(Some(())) => continue,
                Ok(None) => return false,
            }
        }
    }
}

/// The directory a file lives in (`.` for a bare file name).
pub fn parent_dir(path: &std::path::Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
