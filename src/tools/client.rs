//! `mcp-xds-gateway client`: a client for operators, of the legacy MCP
//! services (`--protocol mcp`) or of Envoy's v3 ADS as Envoy or istiod ask
//! (`xds-sotw`, `xds-delta`, by name with `--names`). It subscribes to type
//! URLs, ACKs every response like a real client, and prints each update (a
//! line, the names, or the resources with their bodies read back as JSON or
//! YAML); `--once` exits after the first complete set of every type, once
//! the gateway has read its ACKs. Without `--once` it follows a rollout: when the gateway ends
//! the stream (GOAWAY as it recycles connections, a restart, the network), it
//! says so on stderr and reconnects with backoff, an incremental stream
//! resuming from what it holds (`initial_resource_versions`).
//!
//! A flag it cannot act on (a type URL over xDS that neither the gateway's
//! table nor the descriptors know, `--names` it cannot place, a TLS file
//! that does not load) is a usage error ([`Usage`], exit 2); a dial that
//! fails says why (the TLS alert, the certificate's fault, a TLS port
//! dialled in plaintext: `transport::dial_why`) within `--timeout`. Every
//! text the gateway wrote (names, versions, error messages) is printed
//! through [`terminal_safe`].

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args as ClapArgs, ValueEnum};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;

use crate::collections::sotw_keeps_what_is_left_out;
use crate::proto::aggregated_mesh_config_service_client::AggregatedMeshConfigServiceClient;
use crate::proto::envoy::config::core::v3::Node;
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use crate::proto::{IncrementalMeshConfigRequest, MeshConfigRequest, Resource, SinkNode};
use crate::source::proto_json::{closest, BodyDecoder};
use crate::tools::terminal_safe;
use crate::transport::connect::Dial;
use crate::transport::dial_why::Caller;
use crate::transport::tls::ClientTlsFiles;

/// The command cannot run as asked (a flag, a file it names, a type URL):
/// exit 2, as a bad flag of the gateway's.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

fn usage(message: impl Into<String>) -> anyhow::Error {
    Usage(message.into()).into()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Show {
    /// Each resource's name, version and body type URL under its update line.
    Resources,
    /// The same, each with its body read back (JSON, sensitive fields
    /// redacted) on the line under it.
    Bodies,
}

/// Which service the client speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    /// Istio's legacy MCP: StreamAggregatedResources, or with --incremental
    /// IncrementalAggregatedResources.
    #[default]
    Mcp,
    /// Envoy's v3 ADS, state of the world, as Envoy and istiod 1.8+ ask
    /// (type URLs such as type.googleapis.com/envoy.config.cluster.v3.Cluster,
    /// or istiod's GVKs such as networking.istio.io/v1/VirtualService).
    XdsSotw,
    /// Envoy's v3 ADS, delta (incremental) xDS, one stream for every type.
    XdsDelta,
}

/// What each update prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// One line: type URL, version, counts of resources, added, changed,
    /// removed.
    #[default]
    Summary,
    /// The update line, then the name of every resource it holds.
    Names,
    /// One JSON object per update: its resources with metadata and bodies
    /// read back.
    Json,
    /// The same as YAML documents.
    Yaml,
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

    /// The service to speak: mcp (Istio's legacy MCP), xds-sotw or xds-delta
    /// (Envoy's v3 ADS, as Envoy or istiod ask).
    #[arg(long, value_enum, default_value_t = Protocol::Mcp)]
    pub protocol: Protocol,

    /// With an xds protocol: subscribe by name, as Envoy asks for routes,
    /// endpoints and secrets: TYPE=A,B for one --type-url (repeatable; a
    /// type given no names is a wildcard subscription), or A,B when a single
    /// --type-url is given.
    #[arg(long, value_name = "[TYPE=]A,B,...")]
    pub names: Vec<String>,

    /// Exit after the first response of every type, once the gateway has read
    /// the ACKs (non-zero on error or timeout).
    #[arg(long)]
    pub once: bool,

    /// How long the connection to the gateway may take (TCP, TLS, HTTP/2),
    /// and with --once how long to wait for every type, from the start.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,

    /// Print more under each update line.
    #[arg(long, value_enum)]
    pub show: Option<Show>,

    /// What each update prints: summary, names, json or yaml (the resources
    /// with their bodies read back: Struct, Istio's kinds and Envoy's types;
    /// others with --descriptors).
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Summary)]
    pub output: Output,

    /// A FileDescriptorSet for --output json|yaml to read bodies of other
    /// types (Mixer's, your own: protoc -o FILE).
    #[arg(long, value_name = "FILE")]
    pub descriptors: Option<PathBuf>,

    /// The gateway's --type-map: its rows marked `sensitive: true` are
    /// collections of secrets here too (their bodies read `[redacted]`
    /// whole unless their secret fields are known).
    #[arg(long, value_name = "FILE")]
    pub type_map: Option<PathBuf>,

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

/// One resource of a response, as the printer needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shown {
    name: String,
    version: String,
    body_type_url: String,
    /// What tells a change: the version, or where the version is the
    /// response's (plain xDS in state of the world) a digest of the body.
    fingerprint: String,
}

/// One response, as the printer needs it.
struct Update {
    type_url: String,
    version: String,
    /// Full state (SotW) or upserts (incremental).
    resources: Vec<Shown>,
    /// The same, whole (for --output json|yaml).
    raw: Vec<Resource>,
    /// The names the response removed (incremental); in state of the world
    /// the names held before and absent now, filled in by [`apply`].
    removed: Vec<String>,
    /// It is the whole state: what it leaves out is gone. Not for a state
    /// of the world response of the types whose clients keep what it leaves
    /// out, asked for by name (EDS, RDS): those are kept, as Envoy and grpc
    /// keep them.
    full: bool,
}

enum Event {
    Update(Update),
    /// The stream ended and cannot be resumed: the gateway refused it.
    Refused {
        type_url: String,
        error: String,
    },
    /// With `--once`: a stream's ACKs were written and the gateway read them
    /// (it ended the stream after the request stream's end).
    Acked,
    /// The stream ended; it is opened again after `delay`.
    Reconnecting {
        type_url: String,
        why: String,
        delay: Duration,
    },
}

/// How long to wait before opening a stream again: from 100 ms, doubling to
/// 5 s (with jitter), back to 100 ms once a stream delivered.
const RECONNECT: crate::source::backoff::BackoffPolicy = crate::source::backoff::BackoffPolicy {
    min: Duration::from_millis(100),
    max: Duration::from_secs(5),
};

/// Why a stream ended, as an operator reads it, and whether opening it again
/// can help: a refusal (a type the gateway does not serve, an identity it
/// does not allow) would only be refused again.
fn ended(status: Option<&tonic::Status>) -> (String, bool) {
    let Some(status) = status else {
        return ("the gateway ended the stream".into(), true);
    };
    let message = terminal_safe(status.message());
    let retry = !matches!(
        status.code(),
        tonic::Code::InvalidArgument
            | tonic::Code::Unimplemented
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::FailedPrecondition
            | tonic::Code::NotFound
    );
    let why = if message.contains("GOAWAY") || message.contains("connection closed") || message.contains("h2 protocol")
    {
        format!(
            "the gateway closed the connection (it recycles connections every --max-connection-age, or restarted): {message}"
        )
    } else {
        format!("{:?}: {message}", status.code())
    };
    (why, retry)
}

/// Runs the client; the output goes to `out`.
pub async fn run(args: ClientArgs, out: &mut (impl Write + Send)) -> anyhow::Result<()> {
    if args.protocol != Protocol::Mcp && args.incremental {
        return Err(usage(
            "--incremental is for --protocol mcp; xds-delta is Envoy's incremental xDS",
        ));
    }
    if args.protocol == Protocol::Mcp && !args.names.is_empty() {
        return Err(usage(
            "--names needs --protocol xds-sotw or xds-delta: the legacy MCP services have no resource names",
        ));
    }
    if let Some(path) = &args.type_map {
        let table = crate::collections::CollectionTable::builtin()
            .with_type_map_file(path)
            .map_err(|e| usage(terminal_safe(&format!("--type-map {}: {e}", path.display())).into_owned()))?;
        let _ = SENSITIVE.set(sensitive_table(table));
    } else if args.output == Output::Json || args.output == Output::Yaml || args.show == Some(Show::Bodies) {
        for note in unknown_collection_notes(&args.type_urls) {
            eprintln!("{note}");
        }
    }
    // A body of a type the table calls sensitive is hidden whole in any
    // collection, as the gateway's views hide it.
    let table = SENSITIVE.get_or_init(|| sensitive_table(crate::collections::CollectionTable::builtin()));
    let bodies = std::sync::Arc::new(
        BodyDecoder::new(args.descriptors.as_deref())
            .map_err(|e| usage(format!("--descriptors: {e}")))?
            .with_sensitive_types(table.sensitive_body_types()),
    );
    let names = names_by_type(&args.names, &args.type_urls)?;
    if args.protocol != Protocol::Mcp {
        for type_url in &args.type_urls {
            check_xds_type_url(type_url, &bodies)?;
        }
    }
    // --timeout counts from here: the connection, then with --once every
    // type's first response.
    let started = tokio::time::Instant::now();
    let (dial, channel) = connect(&args).await?;
    let node = SinkNode {
        id: args.node_id.clone(),
        annotations: Default::default(),
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let once = args.once;
    // The streams whose ACKs `--once` waits to see read.
    let mut streams = 1;
    let dialer = |first: Option<Channel>| {
        std::sync::Arc::new(Dialer {
            dial: dial.clone(),
            first: std::sync::Mutex::new(first),
        })
    };
    match args.protocol {
        Protocol::Mcp if args.incremental => {
            // One connection, then one each per stream.
            let mut first = Some(channel);
            streams = args.type_urls.len();
            for type_url in &args.type_urls {
                let dialer = dialer(first.take());
                tokio::spawn(incremental(
                    dialer,
                    node.clone(),
                    type_url.clone(),
                    once,
                    events_tx.clone(),
                ));
            }
        }
        Protocol::Mcp => {
            tokio::spawn(sotw(
                dialer(Some(channel)),
                node,
                args.type_urls.clone(),
                once,
                events_tx.clone(),
            ));
        }
        Protocol::XdsSotw | Protocol::XdsDelta => {
            let subscription = Xds {
                dialer: dialer(Some(channel)),
                node: Node {
                    id: args.node_id.clone(),
                    ..Default::default()
                },
                type_urls: args.type_urls.clone(),
                names,
                delta: args.protocol == Protocol::XdsDelta,
                once,
                bodies: bodies.clone(),
            };
            tokio::spawn(xds(subscription, events_tx.clone()));
        }
    }
    drop(events_tx);

    let mut held: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut waiting: HashSet<&str> = args.type_urls.iter().map(String::as_str).collect();
    let deadline = tokio::time::sleep_until(if args.once {
        started + args.timeout
    } else {
        started + Duration::from_secs(100 * 365 * 24 * 3600)
    });
    tokio::pin!(deadline);
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            _ = &mut deadline => {
                if waiting.is_empty() {
                    bail!("every type arrived, but the gateway did not end the stream after reading the ACKs within --timeout {:?}", args.timeout);
                }
                let mut missing: Vec<&str> = waiting.into_iter().collect();
                missing.sort_unstable();
                bail!("no response within --timeout {:?} for: {}", args.timeout, missing.join(", "));
            }
        };
        match event {
            None => return Ok(()),
            Some(Event::Refused { type_url, error }) => bail!("{}", terminal_safe(&format!("{type_url}: {error}"))),
            Some(Event::Reconnecting { type_url, why, delay }) => {
                eprintln!(
                    "{}: {why}; reconnecting in {}",
                    terminal_safe(&type_url),
                    humantime::format_duration(round_ms(delay))
                );
            }
            Some(Event::Acked) => {
                streams -= 1;
                if streams == 0 {
                    return Ok(());
                }
            }
            Some(Event::Update(mut update)) => {
                let state = held.entry(update.type_url.clone()).or_default();
                let counts = apply(state, &mut update);
                // JSON and YAML stay machine-readable: no update line.
                if !matches!(args.output, Output::Json | Output::Yaml) {
                    print_update(out, &update, counts, state.len(), args.show, &bodies)?;
                }
                print_resources(out, &update, args.output, &bodies)?;
                waiting.remove(update.type_url.as_str());
            }
        }
    }
}

/// The gateway's address and TLS, checked, and a first connection to it
/// (an unreachable target is an error at once); later streams dial again.
async fn connect(args: &ClientArgs) -> anyhow::Result<(Dial, Channel)> {
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
        files.load().map_err(|e| usage(e.to_string()))?;
    } else if let Some(flag) = files.first_flag() {
        return Err(usage(format!(
            "{flag} is for TLS: give --ca or an https:// --target (the target is {url})"
        )));
    }
    let dial = Dial {
        address: url,
        tls: tls.then_some(files),
        timeout: args.timeout,
        keepalive: None,
        caller: Caller::Client,
    };
    let channel = crate::transport::connect::connect(&dial).await?;
    Ok((dial, channel))
}

/// A connection per stream: the first one `run` made, then new ones (a
/// connection ends with its GOAWAY).
struct Dialer {
    dial: Dial,
    first: std::sync::Mutex<Option<Channel>>,
}

impl Dialer {
    /// The next connection.
    async fn channel(&self) -> Result<Channel, tonic::Status> {
        let first = self.first.lock().unwrap_or_else(|e| e.into_inner()).take();
        match first {
            Some(first) => Ok(first),
            None => crate::transport::connect::connect(&self.dial)
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string())),
        }
    }

    /// A client of the legacy MCP service on the next connection.
    async fn client(&self) -> Result<AggregatedMeshConfigServiceClient<Channel>, tonic::Status> {
        Ok(AggregatedMeshConfigServiceClient::new(self.channel().await?).max_decoding_message_size(usize::MAX))
    }
}

/// Each resource's name, version and body type; `by_body`: its version is
/// the response's (plain xDS in state of the world), so a change is told by
/// its body.
fn summary(resources: &[Resource], by_body: bool) -> Vec<Shown> {
    resources
        .iter()
        .map(|r| {
            let metadata = r.metadata.clone().unwrap_or_default();
            let body = r.body.as_ref();
            let fingerprint = if by_body {
                format!(
                    "{:016x}",
                    xxhash_rust::xxh3::xxh3_64(body.map_or(&[][..], |b| &b.value[..]))
                )
            } else {
                metadata.version.clone()
            };
            Shown {
                name: metadata.name,
                version: metadata.version,
                body_type_url: body.map(|b| b.type_url.clone()).unwrap_or_default(),
                fingerprint,
            }
        })
        .collect()
}

/// `--names` as each type's subscription: `TYPE=A,B` for a `--type-url`
/// (a type not named is a wildcard), or `A,B` when one `--type-url` is
/// given. Plain names with several types are a usage error: which type
/// each name is of cannot be told, and a name asked of every type comes
/// back removed from each type that lacks it.
fn names_by_type(values: &[String], type_urls: &[String]) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let mut by_type: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for value in values {
        let (type_url, names) = match value.split_once('=') {
            Some((type_url, names)) if type_urls.iter().any(|t| t == type_url) => (type_url.to_owned(), names),
            Some((type_url, _)) if type_url.contains('/') => {
                let hint = closest(type_url, type_urls.iter().map(String::as_str))
                    .map(|c| format!("; did you mean {c}?"))
                    .unwrap_or_default();
                return Err(usage(format!(
                    "--names {value}: {type_url} is not one of the --type-url values{hint}"
                )));
            }
            _ => match type_urls {
                [only] => (only.clone(), value.as_str()),
                _ => {
                    return Err(usage(format!(
                        "--names {value}: with several --type-url, say which type the names are of: \
                         --names TYPE=A,B (a type given no names is a wildcard subscription)"
                    )))
                }
            },
        };
        let names = names.split(',').filter(|n| !n.is_empty()).map(str::to_owned);
        by_type.entry(type_url).or_default().extend(names);
    }
    if let Some((type_url, _)) = by_type.iter().find(|(_, names)| names.is_empty()) {
        return Err(usage(format!(
            "--names {type_url}=: no names given; leave the type out of --names for a wildcard subscription"
        )));
    }
    Ok(by_type)
}

/// An xDS type URL the gateway answers, or at least knows: a GVK or type
/// URL of its collection table, istiod's MeshConfig and debug types, or a
/// message of the descriptors (built in, or `--descriptors`). Another is a
/// typo the gateway would answer empty: a usage error naming the closest.
fn check_xds_type_url(type_url: &str, bodies: &BodyDecoder) -> anyhow::Result<()> {
    let table = crate::collections::CollectionTable::builtin();
    let known = type_url == crate::collections::MESH_CONFIG_GVK
        || type_url.starts_with("istio.io/")
        || table.resolve_xds(type_url) != crate::collections::XdsType::Unserved
        || (type_url.starts_with(crate::collections::TYPE_URL_PREFIX) && bodies.decode(type_url, &[]).is_ok());
    if known {
        return Ok(());
    }
    let candidates = table.xds_type_urls();
    let hint = match closest(type_url, candidates.iter().copied()) {
        Some(near) => format!("did you mean {near}?"),
        None => "give a type URL as Envoy asks (type.googleapis.com/envoy.config.cluster.v3.Cluster) or a GVK as \
                 istiod asks (networking.istio.io/v1/VirtualService)"
            .to_owned(),
    };
    Err(usage(format!(
        "--type-url {}: neither the gateway's collections nor the descriptors know this type (the gateway \
         would answer it empty); {hint}",
        terminal_safe(type_url)
    )))
}

fn round_ms(delay: Duration) -> Duration {
    Duration::from_millis(delay.as_millis() as u64)
}

/// Keeps a stream open: `open` runs one stream to its end; a refusal ends
/// it for good, anything else opens it again after a backoff (reset once a
/// stream delivered). Ends when nobody listens any more.
async fn keep_open<F, Fut>(type_url: String, events: mpsc::UnboundedSender<Event>, mut open: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (bool, Option<tonic::Status>)>,
{
    let mut backoff = crate::source::backoff::Backoff::new(RECONNECT);
    loop {
        let (delivered, status) = open().await;
        if events.is_closed() {
            return;
        }
        let (why, retry) = ended(status.as_ref());
        if !retry {
            let _ = events.send(Event::Refused { type_url, error: why });
            return;
        }
        if delivered {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        let _ = events.send(Event::Reconnecting {
            type_url: type_url.clone(),
            why,
            delay,
        });
        tokio::time::sleep(delay).await;
    }
}

/// One state-of-the-world stream for every type, opened again until the
/// client stops.
async fn sotw(
    dialer: std::sync::Arc<Dialer>,
    node: SinkNode,
    type_urls: Vec<String>,
    once: bool,
    events: mpsc::UnboundedSender<Event>,
) {
    let label = type_urls.join(",");
    let stream_events = events.clone();
    keep_open(label, events, move || {
        sotw_once(
            dialer.clone(),
            node.clone(),
            type_urls.clone(),
            once,
            stream_events.clone(),
        )
    })
    .await
}

/// With `--once`: the types a stream still waits for a first response of.
/// Once each was ACKed the request stream ends; the gateway reads the ACKs
/// before that end, and then ends the stream, so the client exits only
/// after the gateway has read them.
struct FirstResponses(Option<HashSet<String>>);

impl FirstResponses {
    fn new(once: bool, type_urls: &[String]) -> Self {
        Self(once.then(|| type_urls.iter().cloned().collect()))
    }

    /// Records that a response of `type_url` was ACKed: true when it was the
    /// last awaited (the request stream is to end now).
    fn acked(&mut self, type_url: &str) -> bool {
        match &mut self.0 {
            Some(waiting) if !waiting.is_empty() => {
                waiting.remove(type_url);
                waiting.is_empty()
            }
            _ => false,
        }
    }

    /// The request stream was ended by `acked`.
    fn done(&self) -> bool {
        self.0.as_ref().is_some_and(HashSet::is_empty)
    }
}

/// How a stream ended: with `--once` after its ACKs were read, the client
/// is done (`Acked`), and the task waits for the process to end rather than
/// open the stream again; otherwise as it ended.
async fn stream_ended(
    firsts: &FirstResponses,
    delivered: bool,
    status: Option<tonic::Status>,
    events: &mpsc::UnboundedSender<Event>,
) -> (bool, Option<tonic::Status>) {
    if firsts.done() && status.is_none() {
        let _ = events.send(Event::Acked);
        std::future::pending::<()>().await;
    }
    (delivered, status)
}

/// One stream: whether it delivered a response, and the status it ended with
/// (`None`: ended cleanly).
async fn sotw_once(
    dialer: std::sync::Arc<Dialer>,
    node: SinkNode,
    type_urls: Vec<String>,
    once: bool,
    events: mpsc::UnboundedSender<Event>,
) -> (bool, Option<tonic::Status>) {
    let (tx, rx) = mpsc::unbounded_channel();
    for type_url in &type_urls {
        let _ = tx.send(MeshConfigRequest {
            sink_node: Some(node.clone()),
            type_url: type_url.clone(),
            ..Default::default()
        });
    }
    let mut client = match dialer.client().await {
        Ok(client) => client,
        Err(status) => return (false, Some(status)),
    };
    let stream = match client
        .stream_aggregated_resources(UnboundedReceiverStream::new(rx))
        .await
    {
        Ok(response) => {
            gateway_says_sensitive(response.metadata());
            response.into_inner()
        }
        Err(status) => return (false, Some(status)),
    };
    let firsts = FirstResponses::new(once, &type_urls);
    // ACK like a real client: the version and nonce just received.
    let ack = |response: &crate::proto::MeshConfigResponse| {
        let request = MeshConfigRequest {
            version_info: response.version_info.clone(),
            sink_node: Some(node.clone()),
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            error_detail: None,
        };
        (response.type_url.clone(), request)
    };
    let update = |response: crate::proto::MeshConfigResponse| Update {
        type_url: response.type_url,
        version: response.version_info,
        resources: summary(&response.resources, false),
        raw: response.resources,
        removed: Vec::new(),
        full: true,
    };
    follow(stream, tx, firsts, ack, update, &events).await
}

/// Reads a stream to its end: each response ACKed (`ack`: its type and the
/// request that ACKs it), recorded for `--once` (which ends the request
/// stream after the last first response) and sent to the printer
/// (`update`). Whether it delivered, and the status it ended with.
async fn follow<Req, Resp>(
    mut stream: tonic::Streaming<Resp>,
    tx: mpsc::UnboundedSender<Req>,
    mut firsts: FirstResponses,
    mut ack: impl FnMut(&Resp) -> (String, Req),
    mut update: impl FnMut(Resp) -> Update,
    events: &mpsc::UnboundedSender<Event>,
) -> (bool, Option<tonic::Status>) {
    let (mut delivered, mut tx) = (false, Some(tx));
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                delivered = true;
                let (type_url, request) = ack(&response);
                if let Some(tx) = &tx {
                    let _ = tx.send(request);
                }
                if firsts.acked(&type_url) {
                    tx = None;
                }
                if events.send(Event::Update(update(response))).is_err() {
                    return (delivered, None);
                }
            }
            Ok(None) => return stream_ended(&firsts, delivered, None, events).await,
            Err(status) => return (delivered, Some(status)),
        }
    }
}

/// One incremental stream for `type_url`, opened again until the client
/// stops, resuming from the names and versions it holds.
async fn incremental(
    dialer: std::sync::Arc<Dialer>,
    node: SinkNode,
    type_url: String,
    once: bool,
    events: mpsc::UnboundedSender<Event>,
) {
    let held = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, String>::new()));
    let stream_events = events.clone();
    let label = type_url.clone();
    keep_open(label, events, move || {
        incremental_once(
            dialer.clone(),
            node.clone(),
            type_url.clone(),
            held.clone(),
            once,
            stream_events.clone(),
        )
    })
    .await
}

async fn incremental_once(
    dialer: std::sync::Arc<Dialer>,
    node: SinkNode,
    type_url: String,
    held: std::sync::Arc<std::sync::Mutex<BTreeMap<String, String>>>,
    once: bool,
    events: mpsc::UnboundedSender<Event>,
) -> (bool, Option<tonic::Status>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let initial_resource_versions: std::collections::HashMap<String, String> = held
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let resuming = initial_resource_versions.len();
    let _ = tx.send(IncrementalMeshConfigRequest {
        sink_node: Some(node.clone()),
        type_url: type_url.clone(),
        initial_resource_versions,
        ..Default::default()
    });
    let mut client = match dialer.client().await {
        Ok(client) => client,
        Err(status) => return (false, Some(status)),
    };
    let stream = match client
        .incremental_aggregated_resources(UnboundedReceiverStream::new(rx))
        .await
    {
        Ok(response) => {
            gateway_says_sensitive(response.metadata());
            response.into_inner()
        }
        Err(status) => return (false, Some(status)),
    };
    if resuming > 0 {
        eprintln!("{type_url}: reconnected, resuming with the {resuming} resources held (initial_resource_versions)");
    }
    let firsts = FirstResponses::new(once, std::slice::from_ref(&type_url));
    let ack = |response: &crate::proto::IncrementalMeshConfigResponse| {
        let request = IncrementalMeshConfigRequest {
            sink_node: Some(node.clone()),
            type_url: type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        };
        (type_url.clone(), request)
    };
    let update = |response: crate::proto::IncrementalMeshConfigResponse| {
        let resources = summary(&response.resources, false);
        {
            let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
            for shown in &resources {
                held.insert(shown.name.clone(), shown.version.clone());
            }
            for name in &response.removed_resources {
                held.remove(name);
            }
        }
        Update {
            type_url: type_url.clone(),
            version: response.system_version_info,
            resources,
            raw: response.resources,
            removed: response.removed_resources,
            full: false,
        }
    };
    follow(stream, tx, firsts, ack, update, &events).await
}

// === Envoy's v3 ADS ===

/// What MCP over xDS carries in each `Any` (istiod's form).
const MCP_RESOURCE: &str = "type.googleapis.com/istio.mcp.v1alpha1.Resource";

/// An ADS subscription, as Envoy or istiod make it.
struct Xds {
    dialer: std::sync::Arc<Dialer>,
    node: Node,
    type_urls: Vec<String>,
    /// Named subscriptions, by type; a type not here: wildcard.
    names: BTreeMap<String, Vec<String>>,
    delta: bool,
    once: bool,
    /// Reads a state-of-the-world resource's name from its body.
    bodies: std::sync::Arc<BodyDecoder>,
}

/// One ADS stream for every type, opened again until the client stops
/// (a delta stream asks again with nothing held: it prints full state).
async fn xds(xds: Xds, events: mpsc::UnboundedSender<Event>) {
    let label = xds.type_urls.join(",");
    let xds = std::sync::Arc::new(xds);
    let stream_events = events.clone();
    keep_open(label, events, move || {
        let (xds, events) = (xds.clone(), stream_events.clone());
        async move {
            if xds.delta {
                xds_delta_once(&xds, events).await
            } else {
                xds_sotw_once(&xds, events).await
            }
        }
    })
    .await
}

/// An xDS resource as the printer reads it: MCP over xDS carries an
/// `istio.mcp.v1alpha1.Resource` whole (its own name and version); plain
/// xDS the body itself, named by delta's `Resource` or, in state of the
/// world, by its own `name` (a load assignment's `cluster_name`), as Envoy
/// names it, and versioned by delta's `Resource` or, in state of the world,
/// by the response's `version_info` (the version Envoy shows it at).
fn xds_resource(any: prost_types::Any, name: Option<String>, version: String, bodies: &BodyDecoder) -> Resource {
    if any.type_url == MCP_RESOURCE {
        if let Ok(resource) = <Resource as prost::Message>::decode(&*any.value) {
            return resource;
        }
    }
    let name = name.unwrap_or_else(|| {
        let body = bodies.decode(&any.type_url, &any.value).unwrap_or_default();
        ["name", "clusterName"]
            .iter()
            .find_map(|k| body[*k].as_str().map(str::to_owned))
            .unwrap_or_default()
    });
    Resource {
        metadata: Some(crate::proto::Metadata {
            name,
            version,
            ..Default::default()
        }),
        body: Some(any),
    }
}

async fn xds_client(xds: &Xds) -> Result<AggregatedDiscoveryServiceClient<Channel>, tonic::Status> {
    Ok(AggregatedDiscoveryServiceClient::new(xds.dialer.channel().await?).max_decoding_message_size(usize::MAX))
}

/// An ADS stream `open` opens on a new client: its responses, or the status
/// the connection or the gateway refused it with.
async fn open_ads<T, Opened>(
    xds: &Xds,
    open: impl FnOnce(AggregatedDiscoveryServiceClient<Channel>) -> Opened,
) -> Result<tonic::Streaming<T>, tonic::Status>
where
    Opened: std::future::Future<Output = Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>>,
{
    let response = open(xds_client(xds).await?).await?;
    gateway_says_sensitive(response.metadata());
    Ok(response.into_inner())
}

/// One state-of-the-world ADS stream: each type asked for (by name with
/// `--names`), each response ACKed with its version and nonce, as Envoy
/// does.
async fn xds_sotw_once(xds: &Xds, events: mpsc::UnboundedSender<Event>) -> (bool, Option<tonic::Status>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let request = |type_url: &str, version: &str, nonce: &str| DiscoveryRequest {
        version_info: version.to_owned(),
        node: Some(xds.node.clone()),
        resource_names: xds.names.get(type_url).cloned().unwrap_or_default(),
        type_url: type_url.to_owned(),
        response_nonce: nonce.to_owned(),
        ..Default::default()
    };
    for type_url in &xds.type_urls {
        let _ = tx.send(request(type_url, "", ""));
    }
    let opened = open_ads(xds, |mut client| async move {
        client
            .stream_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await
    });
    let stream = match opened.await {
        Ok(stream) => stream,
        Err(status) => return (false, Some(status)),
    };
    let firsts = FirstResponses::new(xds.once, &xds.type_urls);
    let ack = |response: &DiscoveryResponse| {
        let request = request(&response.type_url, &response.version_info, &response.nonce);
        (response.type_url.clone(), request)
    };
    // Asked for by name, not everything.
    let named = |type_url: &str| {
        xds.names
            .get(type_url)
            .is_some_and(|names| !names.is_empty() && !names.iter().any(|n| n == "*"))
    };
    let update = |response: DiscoveryResponse| {
        let full = !(named(&response.type_url) && sotw_keeps_what_is_left_out(&response.type_url));
        let plain = response.resources.iter().any(|any| any.type_url != MCP_RESOURCE);
        let raw: Vec<Resource> = response
            .resources
            .into_iter()
            .map(|any| xds_resource(any, None, response.version_info.clone(), &xds.bodies))
            .collect();
        Update {
            type_url: response.type_url,
            version: response.version_info,
            resources: summary(&raw, plain),
            raw,
            removed: Vec::new(),
            full,
        }
    };
    follow(stream, tx, firsts, ack, update, &events).await
}

/// One delta ADS stream: each type subscribed (to `--names`, or wildcard),
/// each response ACKed with its nonce, as Envoy does.
async fn xds_delta_once(xds: &Xds, events: mpsc::UnboundedSender<Event>) -> (bool, Option<tonic::Status>) {
    let (tx, rx) = mpsc::unbounded_channel();
    for type_url in &xds.type_urls {
        let _ = tx.send(DeltaDiscoveryRequest {
            node: Some(xds.node.clone()),
            type_url: type_url.clone(),
            resource_names_subscribe: xds.names.get(type_url).cloned().unwrap_or_default(),
            ..Default::default()
        });
    }
    let opened = open_ads(xds, |mut client| async move {
        client
            .delta_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await
    });
    let stream = match opened.await {
        Ok(stream) => stream,
        Err(status) => return (false, Some(status)),
    };
    let firsts = FirstResponses::new(xds.once, &xds.type_urls);
    let ack = |response: &DeltaDiscoveryResponse| {
        let request = DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        };
        (response.type_url.clone(), request)
    };
    let update = |response: DeltaDiscoveryResponse| {
        let raw: Vec<Resource> = response
            .resources
            .into_iter()
            .map(|r| {
                let any = r.resource.unwrap_or_default();
                xds_resource(any, Some(r.name), r.version, &xds.bodies)
            })
            .collect();
        Update {
            type_url: response.type_url,
            version: response.system_version_info,
            resources: summary(&raw, false),
            raw,
            removed: response.removed_resources,
            full: false,
        }
    };
    follow(stream, tx, firsts, ack, update, &events).await
}

/// `--output names|json|yaml`: what follows the update line.
fn print_resources(out: &mut impl Write, update: &Update, output: Output, bodies: &BodyDecoder) -> std::io::Result<()> {
    match output {
        Output::Summary => Ok(()),
        Output::Names => {
            for shown in &update.resources {
                writeln!(out, "  {}", terminal_safe(&shown.name))?;
            }
            print_removed(out, update)?;
            out.flush()
        }
        Output::Json | Output::Yaml => {
            let resources: Vec<serde_json::Value> = update
                .raw
                .iter()
                .map(|r| {
                    let mut metadata = r.metadata.clone().unwrap_or_default();
                    let body = r.body.clone().unwrap_or_default();
                    // A collection of secrets: its annotations too, as the
                    // gateway's views show them (`kubectl apply` keeps a copy
                    // of the whole object in one).
                    if sensitive_type(&update.type_url) {
                        for value in metadata.annotations.values_mut() {
                            *value = crate::source::proto_json::REDACTED.to_owned();
                        }
                    }
                    serde_json::json!({
                        "name": metadata.name,
                        "version": metadata.version,
                        "labels": metadata.labels,
                        "annotations": metadata.annotations,
                        "type_url": shown_body_type(&update.type_url, &body.type_url),
                        "body": read_body(bodies, &update.type_url, &body),
                    })
                })
                .collect();
            let document = serde_json::json!({
                "type_url": update.type_url,
                "version": update.version,
                "incremental": !update.full,
                "resources": resources,
                "removed": update.removed,
            });
            if output == Output::Json {
                writeln!(out, "{}", super::json_terminal_safe(document.to_string()))?;
            } else {
                let yaml = super::yaml_terminal_safe(&document).map_err(std::io::Error::other)?;
                write!(out, "---\n{yaml}")?;
            }
            out.flush()
        }
    }
}

/// A body read back as JSON, or why it cannot be. A body of a collection
/// of secrets (`type_url`: the collection asked for, or its body type over
/// xDS) is shown only as far as its secret fields are known, as the
/// gateway's views show it: any other body there reads `[redacted]` whole.
fn read_body(bodies: &BodyDecoder, type_url: &str, body: &prost_types::Any) -> serde_json::Value {
    let sensitive = sensitive_type(type_url);
    // Only the collection's own body type is read there, and only a secret
    // type: a body claiming another may be a secret's bytes under another
    // name.
    let declared = sensitive.then(|| declared_type(type_url));
    if crate::source::proto_json::hidden_whole(declared.as_deref(), &body.type_url) {
        return serde_json::json!(crate::source::proto_json::REDACTED);
    }
    bodies.decode(&body.type_url, &body.value).unwrap_or_else(|why| {
        let sensitive = sensitive || bodies.is_sensitive_type(&body.type_url);
        // What the error quotes of a body that may hold a secret is not shown.
        let why = if sensitive {
            crate::source::proto_json::redact_quoted(&why)
        } else {
            why
        };
        serde_json::json!({"bytes": body.value.len(), "not_decoded": why, "sensitive": sensitive})
    })
}

/// Without `--type-map`, bodies are shown unless the gateway says the
/// collection is sensitive: a line for each type URL of a collection the
/// built-in table does not know (one of the gateway's `--type-map`, which
/// may mark it `sensitive: true`), saying so.
fn unknown_collection_notes(type_urls: &[String]) -> Vec<String> {
    let builtin = crate::collections::CollectionTable::builtin();
    type_urls
        .iter()
        .filter(|t| not_in(&builtin, t))
        .map(|t| {
            format!(
                "note: {}: not a built-in collection: its bodies are shown as they are unless the gateway says it \
                 is sensitive (mcp-xds-gateway does, for a --type-map row marked sensitive: true); with another \
                 server, give its type map as --type-map to have them redacted",
                terminal_safe(t)
            )
        })
        .collect()
}

/// A body's type URL as shown for a resource of what `type_url` asks for:
/// in a collection of secrets, one other than the collection's own reads
/// `[redacted]`, as the gateway's views show it.
fn shown_body_type<'a>(type_url: &str, body_type_url: &'a str) -> &'a str {
    let declared = sensitive_type(type_url).then(|| declared_type(type_url));
    crate::source::proto_json::shown_type_url(declared.as_deref(), body_type_url)
}

/// The body type of the collection `type_url` asks for (an MCP collection's
/// body type URL; over xDS, the type URL itself).
fn declared_type(type_url: &str) -> String {
    let table = SENSITIVE.get_or_init(|| sensitive_table(crate::collections::CollectionTable::builtin()));
    table
        .sensitive_body_type(type_url)
        .map_or_else(|| type_url.to_owned(), str::to_owned)
}

/// Whether what `type_url` asks for is a collection of secrets (by the
/// built-in table: an MCP collection, or an xDS body type of one), or one
/// the gateway said is ([`gateway_says_sensitive`]).
fn sensitive_type(type_url: &str) -> bool {
    let table = SENSITIVE.get_or_init(|| sensitive_table(crate::collections::CollectionTable::builtin()));
    let marked = MARKED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    sensitive_in(
        table,
        &marked,
        UNREADABLE.load(std::sync::atomic::Ordering::Relaxed),
        type_url,
    )
}

/// [`sensitive_type`] by `table`, what the gateway `marked`, and whether
/// its word was `unreadable`.
fn sensitive_in(
    table: &crate::collections::CollectionTable,
    marked: &std::collections::BTreeSet<String>,
    unreadable: bool,
    type_url: &str,
) -> bool {
    // Over xDS, the collection the gateway serves the type URL from.
    let collection = match table.resolve_xds(type_url) {
        crate::collections::XdsType::Collection { collection, .. } => collection,
        crate::collections::XdsType::Unserved => type_url.into(),
    };
    table.is_sensitive(type_url)
        || table.is_sensitive(&collection)
        || marked.contains(type_url)
        || marked.contains(collection.as_str())
        // A gateway may mark a built-in collection sensitive too: which it
        // marked cannot be told, so every body is.
        || unreadable
}

/// Whether `table` knows neither a collection nor an xDS type by `type_url`.
fn not_in(table: &crate::collections::CollectionTable, type_url: &str) -> bool {
    table.resolve(type_url).is_err() && matches!(table.resolve_xds(type_url), crate::collections::XdsType::Unserved)
}

/// The gateway sent a [`SENSITIVE_HEADER`](crate::collections::SENSITIVE_HEADER)
/// this command cannot read: every collection is then taken as sensitive
/// (a gateway may mark a built-in one so).
static UNREADABLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What the gateway's [`SENSITIVE_HEADER`](crate::collections::SENSITIVE_HEADER)
/// named on a stream this command opened: collections (and their body type
/// URLs) whose bodies are redacted here as its views redact them. A server
/// can only add to it (more is redacted), never take from the built-in
/// table or `--type-map`.
static MARKED: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Reads the gateway's word on which collections are sensitive from a
/// stream's response headers.
fn gateway_says_sensitive(headers: &tonic::metadata::MetadataMap) {
    for value in headers.get_all(crate::collections::SENSITIVE_HEADER) {
        match value.to_str().ok().and_then(crate::collections::from_sensitive_header) {
            Some(names) => MARKED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(names),
            None => {
                if !UNREADABLE.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    eprintln!(
                        "warning: the server's {} header does not read as this command writes it: which \
                         collections it says are sensitive cannot be told, so every body is redacted",
                        crate::collections::SENSITIVE_HEADER
                    );
                }
            }
        }
    }
}

/// The collection table the bodies are shown by (the built-in one, or with
/// `--type-map`), set once when the command starts.
static SENSITIVE: std::sync::OnceLock<crate::collections::CollectionTable> = std::sync::OnceLock::new();

fn sensitive_table(table: crate::collections::CollectionTable) -> crate::collections::CollectionTable {
    table.with_sensitive_types(crate::source::proto_json::secret_type_urls())
}

/// Each name the update removed, a line each.
fn print_removed(out: &mut impl Write, update: &Update) -> std::io::Result<()> {
    for name in &update.removed {
        writeln!(out, "  {} removed", terminal_safe(name))?;
    }
    Ok(())
}

/// What an update did to what the client held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    added: usize,
    changed: usize,
    removed: usize,
}

/// Applies an update to what the client holds of its type (name to
/// fingerprint) and counts what it did. In state of the world the names
/// held before and absent now become the update's `removed`; an
/// incremental update's `removed` are counted as the gateway sent them
/// (a name asked for that does not exist comes back removed, never held).
fn apply(held: &mut BTreeMap<String, String>, update: &mut Update) -> Counts {
    let (mut added, mut changed) = (0, 0);
    let mut next = if update.full { BTreeMap::new() } else { held.clone() };
    for shown in &update.resources {
        match held.get(&shown.name) {
            None => added += 1,
            Some(old) if *old != shown.fingerprint => changed += 1,
            Some(_) => {}
        }
        next.insert(shown.name.clone(), shown.fingerprint.clone());
    }
    if update.full {
        update.removed = held.keys().filter(|name| !next.contains_key(*name)).cloned().collect();
    } else {
        for name in &update.removed {
            next.remove(name);
        }
    }
    *held = next;
    Counts {
        added,
        changed,
        removed: update.removed.len(),
    }
}

/// Prints an update's line, `TYPE version=V resources=N added=A changed=C
/// removed=R` (`resources`: how many the client holds now), and with
/// `--show` each resource under it.
fn print_update(
    out: &mut impl Write,
    update: &Update,
    counts: Counts,
    holding: usize,
    show: Option<Show>,
    bodies: &BodyDecoder,
) -> std::io::Result<()> {
    let Counts {
        added,
        changed,
        removed,
    } = counts;
    writeln!(
        out,
        "{} version={} resources={holding} added={added} changed={changed} removed={removed}",
        terminal_safe(&update.type_url),
        terminal_safe(&update.version),
    )?;
    if show.is_some() {
        for (i, shown) in update.resources.iter().enumerate() {
            writeln!(
                out,
                "  {} version={} body={}",
                terminal_safe(&shown.name),
                terminal_safe(&shown.version),
                terminal_safe(shown_body_type(&update.type_url, &shown.body_type_url))
            )?;
            if show == Some(Show::Bodies) {
                let body = update.raw.get(i).and_then(|r| r.body.clone()).unwrap_or_default();
                writeln!(
                    out,
                    "    {}",
                    terminal_safe(&read_body(bodies, &update.type_url, &body).to_string())
                )?;
            }
        }
        print_removed(out, update)?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    /// What the gateway says is sensitive adds to the built-in table; when
    /// its word does not read, every collection is taken as sensitive, the
    /// built-in ones too (a gateway may mark `clusters` so: the twenty-sixth
    /// check of issue 42).
    #[test]
    fn a_word_that_does_not_read_makes_every_collection_sensitive() {
        let table = crate::collections::CollectionTable::builtin();
        let cluster = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        let none = std::collections::BTreeSet::new();
        assert!(!super::sensitive_in(&table, &none, false, cluster));
        assert!(!super::sensitive_in(&table, &none, false, "example.com/custom"));
        let marked = std::collections::BTreeSet::from([cluster.to_owned()]);
        assert!(super::sensitive_in(&table, &marked, false, cluster));
        for type_url in [
            cluster,
            "istio/networking/v1alpha3/virtualservices",
            "example.com/custom",
        ] {
            assert!(super::sensitive_in(&table, &none, true, type_url), "{type_url}");
        }
    }

    use super::*;

    fn update(resources: &[(&str, &str)], removed: &[&str], full: bool) -> Update {
        Update {
            type_url: "t".into(),
            version: "v".into(),
            resources: resources
                .iter()
                .map(|(n, v)| Shown {
                    name: n.to_string(),
                    version: v.to_string(),
                    body_type_url: "b".into(),
                    fingerprint: v.to_string(),
                })
                .collect(),
            raw: Vec::new(),
            removed: removed.iter().map(|s| s.to_string()).collect(),
            full,
        }
    }

    /// The update line, and what `-o names` prints under it.
    fn printed(held: &mut BTreeMap<String, String>, mut update: Update) -> (String, String) {
        let bodies = BodyDecoder::new(None).unwrap();
        let counts = apply(held, &mut update);
        let (mut line, mut names) = (Vec::new(), Vec::new());
        print_update(&mut line, &update, counts, held.len(), None, &bodies).unwrap();
        print_resources(&mut names, &update, Output::Names, &bodies).unwrap();
        (String::from_utf8(line).unwrap(), String::from_utf8(names).unwrap())
    }

    #[test]
    fn counts_added_changed_and_removed_for_both_protocols() {
        let mut held = BTreeMap::new();
        let (first, _) = printed(&mut held, update(&[("a", "1"), ("b", "1")], &[], true));
        assert_eq!(first, "t version=v resources=2 added=2 changed=0 removed=0\n");
        // State of the world: what is no longer there was removed, and is
        // listed as such.
        let (second, names) = printed(&mut held, update(&[("a", "2"), ("c", "1")], &[], true));
        assert_eq!(second, "t version=v resources=2 added=1 changed=1 removed=1\n");
        assert_eq!(names, "  a\n  c\n  b removed\n");
        // Incremental: every name the gateway removed is counted and listed,
        // held or not (a name asked for that does not exist).
        let (diff, names) = printed(&mut held, update(&[("d", "1")], &["a", "zzz"], false));
        assert_eq!(diff, "t version=v resources=2 added=1 changed=0 removed=2\n");
        assert_eq!(names, "  d\n  a removed\n  zzz removed\n");
    }

    #[test]
    fn what_the_gateway_wrote_is_printed_terminal_safe() {
        let mut held = BTreeMap::new();
        let mut evil = update(&[("a\x1b[2Jb", "1\n2")], &["\u{202e}x"], false);
        evil.type_url = "t\x07".into();
        let (line, names) = printed(&mut held, evil);
        assert_eq!(line, "t\\x07 version=v resources=1 added=1 changed=0 removed=1\n");
        assert_eq!(names, "  a\\x1b[2Jb\n  \\u{202e}x removed\n");
    }

    /// Plain xDS in state of the world: every resource carries the
    /// response's version, so a change is told by its body.
    #[test]
    fn a_sotw_resource_changes_when_its_body_does() {
        let any = |body: &[u8]| prost_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: body.to_vec(),
        };
        let bodies = BodyDecoder::new(None).unwrap();
        let response = |version: &str, a: &[u8], b: &[u8]| {
            let raw = vec![
                xds_resource(any(a), Some("a".into()), version.into(), &bodies),
                xds_resource(any(b), Some("b".into()), version.into(), &bodies),
            ];
            Update {
                type_url: "t".into(),
                version: version.into(),
                resources: summary(&raw, true),
                raw,
                removed: Vec::new(),
                full: true,
            }
        };
        let mut held = BTreeMap::new();
        let (first, _) = printed(&mut held, response("v1", b"\x0a\x01a", b"\x0a\x01b"));
        assert_eq!(first, "t version=v1 resources=2 added=2 changed=0 removed=0\n");
        let mut second = response("v2", b"\x0a\x01a", b"\x0a\x02bb");
        assert!(
            second.resources.iter().all(|r| r.version == "v2"),
            "the response's version"
        );
        let counts = apply(&mut held, &mut second);
        assert_eq!(
            counts,
            Counts {
                added: 0,
                changed: 1,
                removed: 0
            }
        );
    }

    #[test]
    fn names_go_to_the_type_they_name() {
        const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
        const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
        let types = [CDS.to_owned(), RDS.to_owned()];
        let given = |values: &[&str], types: &[String]| {
            names_by_type(&values.iter().map(|v| v.to_string()).collect::<Vec<_>>(), types)
        };
        // CDS wildcard, RDS by name, as Envoy asks.
        let names = given(&[&format!("{RDS}=local_route,other")], &types).unwrap();
        assert_eq!(names.len(), 1);
        assert_eq!(names[RDS], ["local_route", "other"]);
        // One type: plain names are its own.
        let names = given(&["a,b", "c"], &types[..1]).unwrap();
        assert_eq!(names[CDS], ["a", "b", "c"]);
        // Several types: plain names cannot be placed.
        let error = given(&["local_route"], &types).unwrap_err();
        assert!(error.downcast_ref::<Usage>().is_some());
        assert!(error.to_string().contains("--names TYPE=A,B"), "{error}");
        // A type that is not subscribed, with the closest that is.
        let error = given(&[&format!("{CDS}s=a")], &types).unwrap_err();
        assert!(error.to_string().contains(&format!("did you mean {CDS}?")), "{error}");
    }

    #[test]
    fn a_mistyped_xds_type_url_is_a_usage_error_naming_the_closest() {
        let bodies = BodyDecoder::new(None).unwrap();
        for known in [
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            "networking.istio.io/v1/VirtualService",
            crate::collections::MESH_CONFIG_GVK,
            // Not a collection, but a message the descriptors know.
            "type.googleapis.com/envoy.config.core.v3.Address",
        ] {
            check_xds_type_url(known, &bodies).unwrap();
        }
        for (typo, near) in [
            (
                "type.googleapis.com/envoy.config.cluster.v3.Clustr",
                "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            ),
            (
                "networking.istio.io/v1/VirtualServce",
                "networking.istio.io/v1/VirtualService",
            ),
        ] {
            let error = check_xds_type_url(typo, &bodies).unwrap_err();
            assert!(error.downcast_ref::<Usage>().is_some());
            assert!(error.to_string().ends_with(&format!("did you mean {near}?")), "{error}");
        }
        let error = check_xds_type_url("nothing-like-it", &bodies).unwrap_err();
        assert!(error.to_string().contains("give a type URL as Envoy asks"), "{error}");
    }
}
