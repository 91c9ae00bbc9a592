//! The gateway under test as a child process, and its CPU time and memory as
//! Linux reports them in `/proc`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context;
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Linux reports CPU time in clock ticks of USER_HZ, which is 100 on every
/// architecture the kernel supports for user space.
const TICKS_PER_SECOND: f64 = 100.0;

pub struct ChildGateway {
    child: Child,
    pid: u32,
    pub listen: SocketAddr,
    /// Its monitoring port (`/metrics`).
    pub monitoring: SocketAddr,
}

/// The gateway binary beside this one (`target/release/mcp-xds-gateway` for
/// `cargo run --release --bin mcp-load`).
pub fn default_binary() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("cannot find this executable")?;
    let dir = me.parent().context("this executable has no directory")?;
    Ok(dir.join("mcp-xds-gateway"))
}

/// (user, system) CPU seconds of a process, from its `/proc/.../stat`.
pub fn cpu_seconds(stat_path: &str) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(stat_path)?;
    // The command name may hold spaces: fields start after its ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("unexpected /proc stat")?
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
    let user: f64 = fields[11].parse()?;
    let system: f64 = fields[12].parse()?;
    Ok((user / TICKS_PER_SECOND, system / TICKS_PER_SECOND))
}

impl ChildGateway {
    /// Starts the gateway; with `cores`, on those cores only, from its first
    /// instruction (so its runtime sizes itself to them, as in a container
    /// limited to them).
    pub async fn spawn(
        binary: &Path,
        upstream: SocketAddr,
        collections: &[String],
        cores: Option<CpuSet>,
    ) -> anyhow::Result<Self> {
        Self::spawn_with(binary, upstream, collections, cores, &[]).await
    }

    /// [`ChildGateway::spawn`] with `extra` flags (`--cache-dir DIR`).
    pub async fn spawn_with(
        binary: &Path,
        upstream: SocketAddr,
        collections: &[String],
        cores: Option<CpuSet>,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        if !binary.exists() {
            anyhow::bail!(
                "--gateway {}: no such file; build it with `cargo build --release` or name one with --gateway",
                binary.display()
            );
        }
        let mut command = Command::new(binary);
        command
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--monitoring-listen", "127.0.0.1:0"])
            // Every load client shares 127.0.0.1: the per-address stream
            // rate is raised; the other limits stay at their defaults.
            .args(["--max-new-streams-per-second", "1000000"])
            .args(["--upstream", &format!("http://{upstream}")])
            .args(["--collections", &collections.join(",")])
            .args(["--log-level", "info"])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = match cores {
            None => command.spawn(),
            // A child inherits the CPU affinity of the thread that starts
            // it: a thread of its own, pinned first.
            Some(cores) => {
                let runtime = tokio::runtime::Handle::current();
                std::thread::scope(|scope| {
                    scope
                        .spawn(|| {
                            let _runtime = runtime.enter();
                            sched_setaffinity(Pid::from_raw(0), &cores).map_err(std::io::Error::from)?;
                            command.spawn()
                        })
                        .join()
                        .unwrap_or_else(|_| Err(std::io::Error::other("the spawning thread panicked")))
                })
            }
        }
        .with_context(|| format!("cannot start {}", binary.display()))?;
        let pid = child.id().context("the gateway exited at once")?;
        let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let (listen, monitoring) = loop {
            let line = lines
                .next_line()
                .await?
                .context("the gateway exited before it was listening")?;
            if line.contains("gateway listening") {
                break (logged_addr(&line, "listen=")?, logged_addr(&line, "monitoring=")?);
            }
        };
        // Drain the log so the gateway never blocks on a full pipe; pass on
        // anything that is not routine.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("WARN") || line.contains("ERROR") {
                    eprintln!("gateway: {line}");
                }
            }
        });
        Ok(Self {
            child,
            pid,
            listen,
            monitoring,
        })
    }

    /// The gateway's open file descriptors (the entries of `/proc/<pid>/fd`).
    pub fn open_fds(&self) -> anyhow::Result<usize> {
        Ok(std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .context("cannot list the gateway's file descriptors")?
            .count())
    }

    /// The gateway's `/metrics` exposition, from its monitoring port.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let read = async {
            let mut tcp = tokio::net::TcpStream::connect(self.monitoring).await?;
            let request = format!("GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", self.monitoring);
            tcp.write_all(request.as_bytes()).await?;
            let mut response = String::new();
            tcp.read_to_string(&mut response).await?;
            Ok::<_, std::io::Error>(response)
        };
        let response = tokio::time::timeout(std::time::Duration::from_secs(10), read)
            .await
            .context("the monitoring port did not answer within 10s")?
            .context("cannot read the gateway's /metrics")?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("a /metrics response without a body")?;
        // HTTP/1.0: no chunked body, the connection closed after it.
        if !head.lines().next().is_some_and(|status| status.contains(" 200 ")) {
            anyhow::bail!("/metrics answered {}", head.lines().next().unwrap_or_default());
        }
        Ok(body.to_owned())
    }

    /// The gateway's push-latency histogram (`mcp_gateway_push_latency_seconds`:
    /// from a version's apply to its response handed to the client's
    /// connection), every collection's summed: each bucket's bound in
    /// seconds and its cumulative count, in bound order.
    pub async fn push_latency(&self) -> anyhow::Result<Vec<(f64, u64)>> {
        Ok(histogram_buckets(
            &self.metrics().await?,
            mcp_xds_gateway::metrics::PUSH_LATENCY,
        ))
    }

    /// (user, system) CPU seconds the gateway has used.
    pub fn cpu_seconds(&self) -> anyhow::Result<(f64, f64)> {
        cpu_seconds(&format!("/proc/{}/stat", self.pid))
    }

    /// What the gateway has written: (bytes, write syscalls), from
    /// `/proc/<pid>/io` (`wchar`, `syscw`; sockets, logs and files alike).
    pub fn io(&self) -> anyhow::Result<(u64, u64)> {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.pid))?;
        Ok((proc_field(&io, "wchar:")?, proc_field(&io, "syscw:")?))
    }

    /// (current RSS, peak RSS) in bytes.
    pub fn memory(&self) -> anyhow::Result<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        Ok((
            proc_field(&status, "VmRSS:")? * 1024,
            proc_field(&status, "VmHWM:")? * 1024,
        ))
    }

    /// Its RSS now, and what it is made of: anonymous (heap, stacks) and
    /// file-backed (the binary's pages it has touched), in bytes.
    pub fn resident(&self) -> anyhow::Result<Resident> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        Ok(Resident {
            total: proc_field(&status, "VmRSS:")? * 1024,
            anonymous: proc_field(&status, "RssAnon:")? * 1024,
            file: proc_field(&status, "RssFile:")? * 1024,
        })
    }

    /// Kills the gateway with SIGKILL (a crash: nothing is flushed or
    /// closed) and waits for it to exit.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await.context("cannot kill the gateway")
    }

    pub async fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .await;
        if tokio::time::timeout(std::time::Duration::from_secs(15), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// A process's resident memory by kind (`/proc/<pid>/status`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Resident {
    pub total: u64,
    pub anonymous: u64,
    pub file: u64,
}

/// The address after `key` (`listen=`) in the gateway's start-up line.
fn logged_addr(line: &str, key: &str) -> anyhow::Result<SocketAddr> {
    let start = line.find(key).with_context(|| format!("no {key} in {line:?}"))?;
    let addr = line[start + key.len()..].split_whitespace().next().unwrap_or_default();
    addr.parse()
        .with_context(|| format!("no address after {key} in {line:?}"))
}

/// The number after `name` on its line of a `/proc` file (`VmRSS:  123 kB`
/// gives 123).
fn proc_field(text: &str, name: &str) -> anyhow::Result<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .with_context(|| format!("no {name} in /proc"))?
        .split_whitespace()
        .next()
        .with_context(|| format!("no value for {name} in /proc"))?
        .parse()
        .with_context(|| format!("malformed {name} in /proc"))
}

/// The series of `name`, by the value of `label`, summed.
pub fn by_label(exposition: &str, name: &str, label: &str) -> BTreeMap<String, u64> {
    let mut all = BTreeMap::new();
    let key = format!("{label}=\"");
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name).filter(|r| r.starts_with('{')) else {
            continue;
        };
        let Some((series, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let Some(start) = series.find(&key) else { continue };
        let tail = &series[start + key.len()..];
        let Some(end) = tail.find('"') else { continue };
        let value = value.parse::<f64>().unwrap_or(0.0) as u64;
        *all.entry(tail[..end].to_owned()).or_insert(0) += value;
    }
    all
}

/// A histogram's buckets in a Prometheus exposition, summed over its label
/// sets: each bound (`le`) and its cumulative count, in bound order.
fn histogram_buckets(exposition: &str, name: &str) -> Vec<(f64, u64)> {
    let mut buckets: Vec<(f64, u64)> = by_label(exposition, &format!("{name}_bucket"), "le")
        .into_iter()
        .filter_map(|(bound, count)| {
            let bound = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            Some((bound, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histograms_buckets_are_summed_over_its_label_sets() {
        let exposition = "\
# TYPE mcp_gateway_push_latency_seconds histogram
mcp_gateway_push_latency_seconds_bucket{collection=\"a\",le=\"0.025\"} 3
mcp_gateway_push_latency_seconds_bucket{collection=\"a\",le=\"0.05\"} 5
mcp_gateway_push_latency_seconds_bucket{collection=\"a\",le=\"+Inf\"} 6
mcp_gateway_push_latency_seconds_bucket{collection=\"b\",le=\"0.025\"} 1
mcp_gateway_push_latency_seconds_bucket{collection=\"b\",le=\"0.05\"} 1
mcp_gateway_push_latency_seconds_bucket{collection=\"b\",le=\"+Inf\"} 2
mcp_gateway_push_latency_seconds_sum{collection=\"a\"} 0.2
mcp_gateway_message_size_bytes_bucket{le=\"0.05\"} 99
";
        assert_eq!(
            histogram_buckets(exposition, mcp_xds_gateway::metrics::PUSH_LATENCY),
            vec![(0.025, 4), (0.05, 6), (f64::INFINITY, 8)]
        );
    }
}
