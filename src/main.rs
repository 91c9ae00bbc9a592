//! Parses the flags, starts logging, runs the gateway until a signal.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use mcp_xds_gateway::{app, config::Args};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new(&args.log_level));
    let filter = match filter {
        Ok(filter) => filter,
        Err(e) => {
            eprintln!("error: --log-level: {:?} is not a log filter: {e}", args.log_level);
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal())
        .init();
    let settings = match args.validate() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(settings: mcp_xds_gateway::config::Settings) -> anyhow::Result<()> {
    let bound = app::build(settings).await?;
    wait_for_signal().await?;
    tracing::info!("shutting down");
    bound.shutdown().await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    Ok(())
}
