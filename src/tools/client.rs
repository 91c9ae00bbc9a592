//! `mcp-xds-gateway client`: a legacy client of `AggregatedMeshConfigService`
//! for operators. It subscribes to type URLs, ACKs every response like a real
//! client, and prints one line per update; `--once` exits after the first
//! complete set of every type.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args as ClapArgs, ValueEnum};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;

use crate::proto::aggregated_mesh_config_service_client::AggregatedMeshConfigServiceClient;
use crate::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, Resource, SinkNode};
use crate::transport::connect::Dial;
use crate::transport::tls::ClientTlsFiles;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Show {
    /// Each resource's name, version and body type URL under its update line.
    Resources,
}

/// Flags of `mcp-xds-gateway client`.
#[derive(Debug, ClapArgs)]
pub struct ClientArgs {
    /// The gateway: HOST:PORT, http://HOST:PORT or https://HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    pub target: String,

    /// A type URL to subscribe to: a collection name (Istio 1.1) or a proto
    /// type URL (Istio 1.0). Repeatable.
    #[arg(long = "type-url", value_name = "T", required = true)]
    pub type_urls: Vec<String>,

    /// Use IncrementalAggregatedResources (one stream per type).
    #[arg(long)]
    pub incremental: bool,

    /// Exit after the first response of every type (non-zero on error or timeout).
    #[arg(long)]
    pub once: bool,

    /// With --once: how long to wait for every type.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,

    /// Print more under each update line.
    #[arg(long, value_enum)]
    pub show: Option<Show>,

    /// The node id sent with every request.
    #[arg(long, default_value = "mcp-xds-gateway-client")]
    pub node_id: String,

    /// CA certificate(s) (PEM) that sign the gateway's certificate (turns TLS on).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,

    /// Client certificate (PEM) for a gateway that requires one (mTLS).
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,

    /// Private key (PEM) of --cert.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,

    /// The name the gateway's certificate must carry, when it differs from the target's host.
    #[arg(long, value_name = "NAME")]
    pub server_name: Option<String>,
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|e| format!("{value:?} is not a duration like 30s: {e}"))
}

/// One response, as the printer needs it.
struct Update {
    type_url: String,
    version: String,
    /// Full state (SotW) or upserts (incremental).
    resources: Vec<(String, String, String)>,
    removed: Vec<String>,
    full: bool,
}

enum Event {
    Update(Update),
    Ended { type_url: String, error: Option<String> },
}

/// Runs the client; the output goes to `out`.
pub async fn run(args: ClientArgs, out: &mut (impl Write + Send)) -> anyhow::Result<()> {
    let channel = connect(&args).await?;
    let node = SinkNode {
        id: args.node_id.clone(),
        annotations: Default::default(),
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    if args.incremental {
        for type_url in &args.type_urls {
            tokio::spawn(incremental(
                channel.clone(),
                node.clone(),
                type_url.clone(),
                events_tx.clone(),
            ));
        }
    } else {
        tokio::spawn(sotw(channel, node, args.type_urls.clone(), events_tx.clone()));
    }
    drop(events_tx);

    let mut held: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut waiting: HashSet<&str> = args.type_urls.iter().map(String::as_str).collect();
    let deadline = tokio::time::sleep(if args.once { args.timeout } else { Duration::MAX / 4 });
    tokio::pin!(deadline);
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            _ = &mut deadline => {
                let mut missing: Vec<&str> = waiting.into_iter().collect();
                missing.sort_unstable();
                bail!("no response within --timeout {:?} for: {}", args.timeout, missing.join(", "));
            }
        };
        match event {
            None => return Ok(()),
            Some(Event::Ended { type_url, error }) => match error {
                Some(error) => bail!("{type_url}: {error}"),
                None => bail!("{type_url}: the gateway ended the stream"),
            },
            Some(Event::Update(update)) => {
                let state = held.entry(update.type_url.clone()).or_default();
                print_update(out, state, &update, args.show)?;
                waiting.remove(update.type_url.as_str());
                if args.once && waiting.is_empty() {
                    return Ok(());
                }
            }
        }
    }
}

async fn connect(args: &ClientArgs) -> anyhow::Result<Channel> {
    let tls = args.ca.is_some() || args.target.starts_with("https://");
    let url = if args.target.contains("://") {
        args.target.clone()
    } else {
        format!("{}://{}", if tls { "https" } else { "http" }, args.target)
    };
    let files = ClientTlsFiles {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.key.clone(),
        server_name: args.server_name.clone(),
        flag_prefix: "--",
    };
    if tls {
        // The same files and checks as the gateway's upstream flags, under
        // this command's names; checked before dialling.
        files.load()?;
    }
    let dial = Dial {
        address: url,
        tls: tls.then_some(files),
        timeout: Duration::from_secs(10),
        keepalive: None,
    };
    Ok(crate::transport::connect::connect(&dial).await?)
}

fn summary(resources: &[Resource]) -> Vec<(String, String, String)> {
    resources
        .iter()
        .map(|r| {
            let metadata = r.metadata.clone().unwrap_or_default();
            let body = r.body.as_ref().map(|b| b.type_url.clone()).unwrap_or_default();
            (metadata.name, metadata.version, body)
        })
        .collect()
}

async fn sotw(channel: Channel, node: SinkNode, type_urls: Vec<String>, events: mpsc::UnboundedSender<Event>) {
    let (tx, rx) = mpsc::unbounded_channel();
    for type_url in &type_urls {
        let _ = tx.send(MeshConfigRequest {
            sink_node: Some(node.clone()),
            type_url: type_url.clone(),
            ..Default::default()
        });
    }
    let mut client = AggregatedMeshConfigServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let ended = |error: String| Event::Ended {
        type_url: type_urls.join(","),
        error: Some(error),
    };
    let mut stream = match client
        .stream_aggregated_resources(UnboundedReceiverStream::new(rx))
        .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = events.send(ended(format!("{:?}: {}", status.code(), status.message())));
            return;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                // ACK like a real client: the version and nonce just received.
                let _ = tx.send(MeshConfigRequest {
                    version_info: response.version_info.clone(),
                    sink_node: Some(node.clone()),
                    type_url: response.type_url.clone(),
                    response_nonce: response.nonce.clone(),
                    error_detail: None,
                });
                let update = Update {
                    type_url: response.type_url,
                    version: response.version_info,
                    resources: summary(&response.resources),
                    removed: Vec::new(),
                    full: true,
                };
                if events.send(Event::Update(update)).is_err() {
                    return;
                }
            }
            Ok(None) => {
                let _ = events.send(Event::Ended {
                    type_url: type_urls.join(","),
                    error: None,
                });
                return;
            }
            Err(status) => {
                let _ = events.send(ended(format!("{:?}: {}", status.code(), status.message())));
                return;
            }
        }
    }
}

async fn incremental(channel: Channel, node: SinkNode, type_url: String, events: mpsc::UnboundedSender<Event>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let _ = tx.send(IncrementalMeshConfigRequest {
        sink_node: Some(node.clone()),
        type_url: type_url.clone(),
        ..Default::default()
    });
    let mut client = AggregatedMeshConfigServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let error = |status: tonic::Status| Event::Ended {
        type_url: type_url.clone(),
        error: Some(format!("{:?}: {}", status.code(), status.message())),
    };
    let mut stream = match client
        .incremental_aggregated_resources(UnboundedReceiverStream::new(rx))
        .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = events.send(error(status));
            return;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                let _ = tx.send(IncrementalMeshConfigRequest {
                    sink_node: Some(node.clone()),
                    type_url: type_url.clone(),
                    response_nonce: response.nonce.clone(),
                    ..Default::default()
                });
                let update = Update {
                    type_url: type_url.clone(),
                    version: response.system_version_info,
                    resources: summary(&response.resources),
                    removed: response.removed_resources,
                    full: false,
                };
                if events.send(Event::Update(update)).is_err() {
                    return;
                }
            }
            Ok(None) => {
                let _ = events.send(Event::Ended {
                    type_url: type_url.clone(),
                    error: None,
                });
                return;
            }
            Err(status) => {
                let _ = events.send(error(status));
                return;
            }
        }
    }
}

/// Applies an update to what the client holds and prints it:
/// `TYPE version=V resources=N added=A changed=C removed=R`.
fn print_update(
    out: &mut impl Write,
    held: &mut BTreeMap<String, String>,
    update: &Update,
    show: Option<Show>,
) -> std::io::Result<()> {
    let (mut added, mut changed, mut removed) = (0, 0, 0);
    let mut next = if update.full { BTreeMap::new() } else { held.clone() };
    for (name, version, _) in &update.resources {
        match held.get(name) {
            None => added += 1,
            Some(old) if old != version => changed += 1,
            Some(_) => {}
        }
        next.insert(name.clone(), version.clone());
    }
    if update.full {
        removed = held.keys().filter(|name| !next.contains_key(*name)).count();
    } else {
        for name in &update.removed {
            if next.remove(name).is_some() {
                removed += 1;
            }
        }
    }
    *held = next;
    writeln!(
        out,
        "{} version={} resources={} added={added} changed={changed} removed={removed}",
        update.type_url,
        update.version,
        held.len()
    )?;
    if show == Some(Show::Resources) {
        for (name, version, body_type_url) in &update.resources {
            writeln!(out, "  {name} version={version} body={body_type_url}")?;
        }
        if !update.full {
            for name in &update.removed {
                writeln!(out, "  {name} removed")?;
            }
        }
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(resources: &[(&str, &str)], removed: &[&str], full: bool) -> Update {
        Update {
            type_url: "t".into(),
            version: "v".into(),
            resources: resources
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string(), "b".into()))
                .collect(),
            removed: removed.iter().map(|s| s.to_string()).collect(),
            full,
        }
    }

    fn line(held: &mut BTreeMap<String, String>, update: &Update) -> String {
        let mut out = Vec::new();
        print_update(&mut out, held, update, None).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn counts_added_changed_and_removed_for_both_protocols() {
        let mut held = BTreeMap::new();
        let first = line(&mut held, &update(&[("a", "1"), ("b", "1")], &[], true));
        assert_eq!(first, "t version=v resources=2 added=2 changed=0 removed=0\n");
        let second = line(&mut held, &update(&[("a", "2"), ("c", "1")], &[], true));
        assert_eq!(second, "t version=v resources=2 added=1 changed=1 removed=1\n");
        let diff = line(&mut held, &update(&[("d", "1")], &["a", "zzz"], false));
        assert_eq!(diff, "t version=v resources=2 added=1 changed=0 removed=1\n");
    }
}
