//! The limit a run is measured against: CPU affinity (`--pin`), and a plain
//! loopback TCP writer sending the bytes the gateway sent, in the same
//! response sizes over as many connections, whose CPU per byte is what the
//! kernel's loopback costs on this machine.

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use anyhow::Context;
use nix::sched::{sched_setaffinity, CpuSet};
use nix::sys::resource::{getrusage, UsageWho};
use nix::unistd::Pid;

/// Where the gateway and the load tool run.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Pinning {
    /// The gateway's core (and the wire writer's): the last one.
    pub gateway_core: usize,
    /// How many cores the load tool has: every one before the gateway's.
    pub load_cores: usize,
}

impl Pinning {
    /// The gateway on the last core, the load tool on the others.
    pub fn plan() -> anyhow::Result<Self> {
        let cores = std::thread::available_parallelism()?.get();
        if cores < 2 {
            anyhow::bail!(
                "--pin needs at least 2 cores (one for the gateway, the rest for the load); this machine has {cores}"
            );
        }
        Ok(Self {
            gateway_core: cores - 1,
            load_cores: cores - 1,
        })
    }

    pub fn gateway_set(&self) -> nix::Result<CpuSet> {
        let mut set = CpuSet::new();
        set.set(self.gateway_core)?;
        Ok(set)
    }

    pub fn load_set(&self) -> nix::Result<CpuSet> {
        let mut set = CpuSet::new();
        for core in 0..self.gateway_core {
            set.set(core)?;
        }
        Ok(set)
    }

    /// Pins every thread of this process to the load's cores.
    pub fn pin_load_tool(&self) -> anyhow::Result<()> {
        pin_process(std::process::id(), &self.load_set()?)
    }
}

fn pin_process(pid: u32, set: &CpuSet) -> anyhow::Result<()> {
    let tasks =
        std::fs::read_dir(format!("/proc/{pid}/task")).with_context(|| format!("cannot list the threads of {pid}"))?;
    for task in tasks {
        let tid: i32 = task?.file_name().to_string_lossy().parse()?;
        // A thread that ended since the listing is no error.
        match sched_setaffinity(Pid::from_raw(tid), set) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => return Err(e).with_context(|| format!("sched_setaffinity({tid})")),
        }
    }
    Ok(())
}

/// How many times the plain writer sends the responses: its figure is the
/// least CPU of these passes. On a shared machine a pass can cost twice the
/// usual (~700 against ~350 µs per MB on this project's), which made the
/// gateway look twice as good against it; the least of three takes out a
/// slow pass, and the passes in the report show a run whose passes were
/// all slow, which happens too (BENCHMARKS, session 22).
pub const PASSES: usize = 3;

/// What the plain writer did.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct WireRun {
    /// In one pass.
    pub bytes: u64,
    pub writes: u64,
    /// The writer thread's CPU (user + system) in its cheapest pass.
    pub cpu_seconds: f64,
    /// Each pass's, in order.
    pub pass_cpu_seconds: [f64; PASSES],
    /// What its readers read, in all passes: every byte of every pass.
    pub bytes_read: u64,
}

/// Where the plain writer's bytes come from.
#[derive(Clone, Copy, Debug)]
pub enum Source {
    /// One buffer, the size of the largest response, in the core's cache:
    /// the loopback's own cost.
    Hot,
    /// Records of `record` bytes, each response as many of them as it
    /// holds, read from random places in a buffer of `pool` bytes (one
    /// `writev` a response): what it costs to send the records of a cache
    /// that size, which a gateway serving named clients from one reads in
    /// no order (eds: 50 of the 10,000 records of 4 MB a response).
    Scattered { record: usize, pool: usize },
}

/// Sends `responses` (connection index, bytes) in order from one thread, with
/// one blocking `write` per response (`TCP_NODELAY`, as the gateway), the
/// bytes read from `source`, pinned like the gateway, [`PASSES`] times;
/// reader threads on the load's cores drain them.
pub fn measure(
    responses: &[(usize, usize)],
    connections: usize,
    pinning: Option<Pinning>,
    source: Source,
) -> anyhow::Result<WireRun> {
    let connections = connections.max(1);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut writers = Vec::with_capacity(connections);
    let mut readers = Vec::with_capacity(connections);
    for _ in 0..connections {
        let writer = TcpStream::connect(addr)?;
        writer.set_nodelay(true)?;
        let (reader, _) = listener.accept()?;
        reader.set_read_timeout(Some(Duration::from_secs(300)))?;
        writers.push(writer);
        readers.push(reader);
    }
    // Readers: a blocking thread per connection, reading whatever is there
    // (a client that keeps up).
    let drains = readers
        .into_iter()
        .map(|mut reader| {
            std::thread::Builder::new().stack_size(128 << 10).spawn(move || {
                let mut buf = vec![0u8; 256 << 10];
                let mut read = 0u64;
                while let Ok(n @ 1..) = reader.read(&mut buf) {
                    read += n as u64;
                }
                read
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let largest = responses.iter().map(|(_, len)| *len).max().unwrap_or(0);
    let responses = responses.to_vec();
    let writer = std::thread::spawn(move || -> anyhow::Result<(WireRun, Vec<TcpStream>)> {
        if let Some(pinning) = pinning {
            sched_setaffinity(Pid::from_raw(0), &pinning.gateway_set()?)?;
        }
        let (record, pool) = match source {
            Source::Hot => (largest.max(1), largest),
            Source::Scattered { record, pool } => (record.max(1), pool.max(record)),
        };
        let payload = vec![0x5au8; pool];
        let records = (pool / record).max(1);
        let mut run = WireRun {
            bytes: responses.iter().map(|(_, len)| *len as u64).sum(),
            writes: responses.len() as u64,
            ..WireRun::default()
        };
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        for pass in &mut run.pass_cpu_seconds {
            // The records' places: the same in every pass (xorshift64).
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let mut next_record = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % records as u64) as usize * record
            };
            let before = thread_cpu()?;
            for &(connection, len) in &responses {
                let writer = &mut writers[connection % connections];
                match source {
                    Source::Hot => writer.write_all(&payload[..len])?,
                    Source::Scattered { .. } => {
                        slices.clear();
                        slices.extend((0..len.div_ceil(record)).map(|i| {
                            let at = next_record();
                            IoSlice::new(&payload[at..at + record.min(len - i * record)])
                        }));
                        write_all_vectored(writer, &mut slices)?;
                    }
                }
            }
            *pass = thread_cpu()? - before;
        }
        run.cpu_seconds = run.pass_cpu_seconds.iter().copied().fold(f64::INFINITY, f64::min);
        Ok((run, writers))
    });
    let (mut run, writers) = writer
        .join()
        .map_err(|_| anyhow::anyhow!("the wire writer panicked"))??;
    drop(writers);
    for drain in drains {
        run.bytes_read += drain.join().unwrap_or(0);
    }
    Ok(run)
}

/// Writes every slice, as `Write::write_all` does one buffer.
fn write_all_vectored(writer: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        match writer.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// This thread's CPU seconds (user + system).
fn thread_cpu() -> anyhow::Result<f64> {
    let usage = getrusage(UsageWho::RUSAGE_THREAD)?;
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok(seconds(usage.user_time()) + seconds(usage.system_time()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both writers deliver every byte of every response in every pass, the
    /// scattered one in records from across its buffer (the last of a
    /// response shorter), and count them once per pass.
    #[test]
    fn both_writers_send_every_byte() {
        let responses = [(0, 1_000), (1, 37), (0, 4_096), (2, 1), (1, 10_007)];
        let sent: u64 = responses.iter().map(|(_, len)| *len as u64).sum();
        for source in [
            Source::Hot,
            Source::Scattered {
                record: 403,
                pool: 40_300,
            },
        ] {
            let run = measure(&responses, 3, None, source).unwrap();
            assert_eq!((run.bytes, run.writes), (sent, 5), "{source:?}");
            assert_eq!(run.bytes_read, sent * PASSES as u64, "{source:?}");
            assert!(run.pass_cpu_seconds.iter().all(|c| *c >= 0.0) && run.cpu_seconds >= 0.0);
        }
    }
}
