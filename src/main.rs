//! Parses the flags, starts logging, runs the gateway until a signal.

use std::io::IsTerminal;
use std::process::ExitCode;

use mcp_xds_gateway::app;
use mcp_xds_gateway::config::{Args, Command, LogFormat};
use mcp_xds_gateway::metrics::LogControl;
use mcp_xds_gateway::transport::safe_text::json_safe;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let mut args = Args::try_parse_with_sources(std::env::args_os()).unwrap_or_else(|e| exit_with(&e));
    match args.command.take() {
        Some(Command::Client(client)) => return run_client(client),
        Some(Command::Status(status)) => return run_status(status),
        Some(Command::Rollout(rollout)) => {
            return run_tool(async move { mcp_xds_gateway::tools::rollout::run(rollout, &mut std::io::stdout()).await })
        }
        Some(Command::Check(check)) => return run_check(check),
        Some(Command::Source(source)) => {
            let origin = log_level_origin(&source.effective);
            let logs = match init_logs(&source.log_level, source.log_format, origin) {
                Ok(logs) => logs,
                Err(code) => return code,
            };
            return serve(source.validate(), logs);
        }
        None => {}
    }
    let origin = log_level_origin(&args.effective);
    let logs = match init_logs(&args.log_level, args.log_format, origin) {
        Ok(logs) => logs,
        Err(code) => return code,
    };
    serve(args.validate(), logs)
}

/// Where `--log-level`'s value came from (a flag, the environment, the
/// default), as `/debug/config` shows it.
fn log_level_origin(effective: &[mcp_xds_gateway::config::EffectiveFlag]) -> String {
    effective
        .iter()
        .find(|f| f.flag == "--log-level")
        .map_or_else(|| "default".to_owned(), |f| f.source.clone())
}

/// Installs the log subscriber with `level` (RUST_LOG wins), whose filter
/// the admin port's `POST /logging` changes at run time; `origin` says where
/// `level` came from.
fn init_logs(level: &str, format: LogFormat, origin: String) -> Result<std::sync::Arc<LogControl>, ExitCode> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if EnvFilter::try_new(&env).is_ok() => EnvFilter::try_new(watcher_capped(&env)),
        _ => EnvFilter::try_new(watcher_capped(level)),
    };
    let filter = match filter {
        Ok(filter) => filter,
        Err(e) => {
            say_error(format!("--log-level: {level:?} is not a log filter: {e}"));
            return Err(ExitCode::from(2));
        }
    };
    // The filter can be changed at run time (POST /logging on the admin port).
    let (initial, origin) = match std::env::var("RUST_LOG").ok().filter(|f| EnvFilter::try_new(f).is_ok()) {
        Some(filter) => (filter, "environment (RUST_LOG)".to_owned()),
        None => (level.to_owned(), origin),
    };
    let (filter, reload) = tracing_subscriber::reload::Layer::new(filter);
    let logs = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => logs
            .with(tracing_subscriber::fmt::layer().with_ansi(std::io::stdout().is_terminal()))
            .init(),
        LogFormat::Json => logs
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_writer(|| SafeJsonLines(std::io::stdout())),
            )
            .init(),
    }
    Ok(std::sync::Arc::new(LogControl::new(initial, origin, move |filter| {
        let filter = EnvFilter::try_new(watcher_capped(filter)).map_err(|e| e.to_string())?;
        reload.reload(filter).map_err(|e| e.to_string())
    })))
}

/// `filter` with the file watcher's own logs at debug at most when every
/// target is at trace and the filter names no `notify` directive: its
/// trace logs one line per file event, so a log written into a watched
/// directory (the access policy's, the source directory) would write a
/// line per line it wrote, without end. Naming `notify` (or
/// `notify::inotify`) with a level still has them.
fn watcher_capped(filter: &str) -> String {
    let directives: Vec<&str> = filter.split(',').map(str::trim).collect();
    let all_trace = directives.iter().any(|d| d.eq_ignore_ascii_case("trace"));
    // Only a directive for the watcher itself, or the module that logs each
    // event, says the operator wants those lines (`notify::poll=info` does not).
    let names_watcher = directives.iter().any(|d| {
        let target = d.split(['=', '[']).next().unwrap_or(d);
        matches!(target, "notify" | "notify::inotify")
    });
    if all_trace && !names_watcher {
        format!("{filter},notify=debug")
    } else {
        filter.to_owned()
    }
}

/// Standard output for `--log-format json`: each line with what a client
/// wrote that JSON leaves raw (C1 controls, bidirectional overrides and
/// isolates) escaped as `\u202e` by the crate's one rule, the same JSON to
/// a reader. The formatter writes an event's line in one call.
struct SafeJsonLines<W>(W);

impl<W: std::io::Write> std::io::Write for SafeJsonLines<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match std::str::from_utf8(buf) {
            Ok(line) => self.0.write_all(json_safe(line).as_bytes())?,
            Err(_) => self.0.write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Runs the app (the gateway, or the `source` command) with the validated
/// settings until a signal; a bad flag exits 2.
fn serve(
    settings: Result<mcp_xds_gateway::config::Settings, mcp_xds_gateway::config::ConfigError>,
    logs: std::sync::Arc<LogControl>,
) -> ExitCode {
    let settings = match settings {
        Ok(settings) => settings,
        Err(e) => {
            say_error(format!("{}", e));
            return ExitCode::from(2);
        }
    };
    let runtime = match mcp_xds_gateway::runtime::build(settings.worker_idle_wait) {
        Ok(runtime) => runtime,
        Err(e) => {
            say_error(format!("cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings, logs)) {
        Ok(()) => ExitCode::SUCCESS,
        // Its message already holds its cause: printed once, not as a chain.
        Err(e) => match e.downcast_ref::<app::AppError>() {
            Some(start_up) => {
                say_error(format!("{}", start_up));
                ExitCode::from(start_up.exit_code())
            }
            None => {
                say_error(format!("{:#}", e));
                ExitCode::FAILURE
            }
        },
    }
}

/// `mcp-xds-gateway client`: output on stdout, errors on stderr, exit 1 on
/// error, 2 when it cannot run as asked (`client::Usage`).
fn run_client(args: mcp_xds_gateway::tools::client::ClientArgs) -> ExitCode {
    use mcp_xds_gateway::tools::client;
    run_tool(async move {
        match client::run(args, &mut std::io::stdout()).await {
            Ok(()) => Ok(0),
            Err(e) if e.downcast_ref::<client::Usage>().is_some() => {
                say_error(format!("{:#}", e));
                Ok(2)
            }
            Err(e) => Err(e),
        }
    })
}

/// `mcp-xds-gateway status`: the table on stdout, errors on stderr; exit 0
/// when every client shown is SYNCED and the source healthy, 1 when not, 2
/// when the admin port cannot be read.
fn run_status(args: mcp_xds_gateway::tools::status::StatusArgs) -> ExitCode {
    run_tool(async move { mcp_xds_gateway::tools::status::run(args, &mut std::io::stdout()).await })
}

/// `mcp-xds-gateway check`: findings on stdout, the summary on stderr; exit
/// 0 when everything would be served, 1 when anything would not, 2 when the
/// check cannot run as asked.
fn run_check(args: mcp_xds_gateway::tools::check::CheckArgs) -> ExitCode {
    use mcp_xds_gateway::tools::check;
    match check::check(&args) {
        Ok(report) => {
            print!("{}", check::render(&report, args.output));
            eprintln!("{}", check::summary(&report));
            ExitCode::from(report.exit_code())
        }
        Err(e) => {
            say_error(format!("{}", e));
            ExitCode::from(2)
        }
    }
}

/// Runs a tool on a single-threaded runtime: its exit code, or 1 on an
/// error (2 when the admin port cannot be read).
fn run_tool(tool: impl std::future::Future<Output = anyhow::Result<u8>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            say_error(format!("cannot start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tool) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            say_error(format!("{:#}", e));
            match e.downcast_ref::<mcp_xds_gateway::tools::status::AdminUnreadable>() {
                Some(_) => ExitCode::from(2),
                None => ExitCode::FAILURE,
            }
        }
    }
}

async fn run(
    settings: mcp_xds_gateway::config::Settings,
    logs: std::sync::Arc<mcp_xds_gateway::metrics::LogControl>,
) -> anyhow::Result<()> {
    glibc::install();
    // The handlers are in place before the "listening" line: a SIGTERM sent
    // as soon as that line is read (a supervisor, a test) is a clean stop,
    // not the default action that kills the process mid-start.
    let signals = Signals::install()?;
    let bound = app::build_with_logs(settings, Some(logs)).await?;
    signals.wait().await?;
    tracing::info!("shutting down");
    let _ = bound.shutdown().await;
    Ok(())
}

/// SIGTERM and SIGINT, listened for from start-up on.
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
        Ok(())
    }
}

/// An error, printed for an operator's terminal: what it quotes of what
/// anyone typed or sent (an address given to `--admin`, a flag's value)
/// with its control characters escaped (lines kept).
fn say_error(text: String) {
    eprintln!("error: {}", mcp_xds_gateway::transport::safe_text::lines_safe(&text));
}

/// A flag that does not parse (or `--help`): clap's words, as
/// [`say_error`] prints (the value it quotes is the operator's).
fn exit_with(e: &clap::Error) -> ! {
    let text = e.render().to_string();
    let text = mcp_xds_gateway::transport::safe_text::lines_safe(&text);
    if e.use_stderr() {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    std::process::exit(e.exit_code())
}

/// glibc's malloc, for `--memory-trim-interval` (`mcp_xds_gateway::memory`):
/// the two calls it needs, the only unsafe code of the package.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use mcp_xds_gateway::memory::{Allocator, HeapStats};

    struct Glibc;

    impl Allocator for Glibc {
        fn stats(&self) -> Option<HeapStats> {
            // SAFETY: `mallinfo2` takes nothing and returns a plain struct
            // by value (glibc 2.33+, which the `libc` crate's binding needs).
            let info = unsafe { libc::mallinfo2() };
            Some(HeapStats {
                // Arena bytes in use and the chunks mapped on their own.
                in_use: (info.uordblks + info.hblkhd) as u64,
                // Free chunks in the arenas, resident or already returned:
                // what `malloc_trim` can give back is within it.
                free: info.fordblks as u64,
            })
        }

        fn trim(&self) {
            // SAFETY: `malloc_trim` takes a size and touches only the
            // allocator's own free chunks, under its own locks.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }

    pub fn install() {
        mcp_xds_gateway::memory::install(Box::new(Glibc));
    }
}

/// Another libc: nothing to trim with.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod glibc {
    pub fn install() {}
}
