//! Real peers the tests run against (Envoy, grpc's grpcio, Prometheus):
//! where `.ci/run` installed them, or installed under target/ on first use.
//!
//! Whether a test runs at all is decided at build time: `build.rs` sets the
//! cfg `peer_<name>` when the variable `.ci/run` exports after installing the
//! peer is set (`ENVOY_BIN`, `GRPCIO_PYTHON`, `PROMETHEUS_DIR`), and each such
//! test carries `#[cfg_attr(not(peer_<name>), ignore = "needs …")]`, so a
//! missing peer shows as `ignored, needs …` in the summary, never as a pass.
//! A test run anyway (`cargo test -- --ignored`) finds or installs its peer
//! here and fails, saying why, when it can't. A new peer: a row in build.rs's
//! `PEERS`, an install step in `.ci/run`, and the same attribute.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The package's target/ directory, where peers are installed.
pub fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target")
}

/// A peer's file: the path in `variable` if it is set (Err if `check`
/// fails of it: whoever set it meant the tests to use it), else
/// `target/<venv>/<file>`, the venv (re)made with `packages` unless `check`
/// holds of that file already.
pub fn from_env_or_venv(
    variable: &str,
    venv: &str,
    file: &str,
    packages: &[String],
    check: fn(&Path) -> Result<(), String>,
) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(variable) {
        let path = PathBuf::from(path);
        return match check(&path) {
            Ok(()) => Ok(path),
            Err(why) => Err(format!("{variable}={}: {why}", path.display())),
        };
    }
    let path = target_dir().join(venv).join(file);
    venv_with(venv, packages, || check(&path))?;
    Ok(path)
}

/// Makes sure `ready` holds of the venv `target/<name>`: when it does not,
/// (re)creates the venv with python3 and pip-installs `packages` into it.
/// Under a lock file (`target/<name>.lock`), so that test processes running
/// at once don't install over each other. Err says why not.
fn venv_with(name: &str, packages: &[String], ready: impl Fn() -> Result<(), String>) -> Result<(), String> {
    if ready().is_ok() {
        return Ok(());
    }
    let target = target_dir();
    let venv = target.join(name);
    std::fs::create_dir_all(&target).map_err(|e| format!("creating {}: {e}", target.display()))?;
    let lock_path = target.join(format!("{name}.lock"));
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("opening {}: {e}", lock_path.display()))?;
    flock_exclusive(&lock).map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    // Another test process may have installed it while this one waited.
    if ready().is_ok() {
        return Ok(());
    }
    // A half-made venv from an interrupted install is started afresh.
    if venv.exists() {
        std::fs::remove_dir_all(&venv).map_err(|e| format!("removing {}: {e}", venv.display()))?;
    }
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(venv.join("bin").join("pip"))
        .args(["install", "--disable-pip-version-check", "--no-input", "--quiet"])
        .args(packages))?;
    ready().map_err(|why| format!("installed {} into {}, but {why}", packages.join(" "), venv.display()))
    // The lock is released when `lock` is closed here.
}

/// Blocks until this process holds the exclusive lock on `file`.
fn flock_exclusive(file: &File) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor that `file` keeps open.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Runs `command` to the end; Err quotes it and the end of what it said.
pub fn run(command: &mut Command) -> Result<Output, String> {
    let shown = format!("{command:?}");
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{shown} did not start: {e}"))?;
    if output.status.success() {
        return Ok(output);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let said = if stderr.trim().is_empty() {
        String::from_utf8_lossy(&output.stdout).into_owned()
    } else {
        stderr.into_owned()
    };
    Err(format!(
        "{shown} failed ({}): {}",
        output.status,
        tail(&said, 20).trim()
    ))
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
