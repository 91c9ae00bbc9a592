//! Distinct identities (`--scenario grants`): a collection of Envoy
//! clusters, an access policy that grants each namespace's identities the
//! shared clusters and the clusters of their namespace
//! (`spiffe://cluster.local/ns/{ns}/sa/*` → `{ns}-*`, `shared-*`), and
//! `--streams` clients of as many distinct identities (each its own client
//! certificate) connecting one after another over mTLS, each reading the
//! collection (Envoy's CDS, state of the world) once. Each one's grant is
//! distinct: the shared part, and one resource of its own while the
//! collection has one for it.
//!
//! The report is what each distinct grant costs the gateway: its RSS
//! before, with every client connected, and after they all left; its CPU
//! per stream start; and the streams it refused (`--max-grants-per-version`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use mcp_xds_gateway::proto::{Metadata, Resource};
use mcp_xds_gateway::source::proto_json;
use mcp_xds_gateway::transport::connect::{connect, Dial};
use mcp_xds_gateway::transport::tls::ClientTlsFiles;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::gateway::ChildGateway;
use crate::publisher::{Catalog, Publisher, Update};
use crate::scenario::Shape;
use crate::Report;

/// The collection the clients read, as Envoy's CDS.
pub const COLLECTION: &str = "envoy/config/cluster/v3/clusters";
const TYPE_URL: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// How long one client may take to connect and read the collection.
const CLIENT_LIMIT: Duration = Duration::from_secs(60);

/// The identities' namespaces: `t00042`.
fn namespace(i: usize) -> String {
    format!("t{i:05}")
}

/// The grants scenario's own settings.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct GrantsShape {
    /// `--max-grants-per-version` given to the gateway (`None`: its
    /// default, or a gateway without the flag).
    pub max_grants_per_version: Option<usize>,
    /// How long the gateway is left to settle before RSS is read (three
    /// times that once the clients left): 1 s, 100 ms with --tiny.
    #[serde(skip)]
    pub settle: Duration,
}

/// What the run measured.
#[derive(Debug, Default, serde::Serialize)]
pub struct GrantsFigures {
    pub identities: usize,
    /// Resources of a namespace (one each, for the first identities); the
    /// rest are shared.
    pub own_resources: usize,
    pub shared_resources: usize,
    pub resource_bytes: f64,
    pub served: usize,
    /// Streams the gateway refused `RESOURCE_EXHAUSTED` (naming the flag).
    pub refused: usize,
    pub refusal_example: Option<String>,
    pub rss_before_bytes: u64,
    pub rss_connected_bytes: u64,
    pub rss_after_bytes: u64,
    pub peak_rss_bytes: u64,
    /// Per identity served: (RSS with all connected − before) / served.
    pub rss_per_grant_bytes: f64,
    pub cpu_ms_per_stream_start: f64,
    /// The clients' time from dialling to the first response: p50, p99.
    pub start_p50_ms: f64,
    pub start_p99_ms: f64,
}

impl GrantsFigures {
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        let mib = |b: u64| crate::mib(b);
        vec![
            ("distinct identities", self.identities.to_string()),
            (
                "resources: own / shared",
                format!(
                    "{} / {} of {:.0} B",
                    self.own_resources, self.shared_resources, self.resource_bytes
                ),
            ),
            ("served / refused", format!("{} / {}", self.served, self.refused)),
            ("a refusal", self.refusal_example.clone().unwrap_or_else(|| "-".into())),
            ("RSS before", mib(self.rss_before_bytes)),
            ("RSS with every client connected", mib(self.rss_connected_bytes)),
            ("RSS after they all left", mib(self.rss_after_bytes)),
            ("peak RSS", mib(self.peak_rss_bytes)),
            (
                "RSS per distinct grant",
                format!("{:.1} KiB", self.rss_per_grant_bytes / 1024.0),
            ),
            (
                "gateway CPU per stream start",
                format!("{:.2} ms", self.cpu_ms_per_stream_start),
            ),
            (
                "stream start p50 / p99",
                format!("{:.1} / {:.1} ms", self.start_p50_ms, self.start_p99_ms),
            ),
        ]
    }
}

/// The clusters: `{ns}-own` for the first identities (at most half the
/// collection), `shared-NNNNN` for the rest, each of about `body_bytes`.
struct Clusters {
    resources: Vec<Resource>,
}

impl Clusters {
    fn new(shape: &Shape) -> (Self, usize) {
        let own = shape.streams.min(shape.resources / 2);
        let names = (0..shape.resources).map(|i| match i < own {
            true => format!("{}-own", namespace(i)),
            false => format!("shared-{:05}", i - own),
        });
        let resources = names
            .map(|name| {
                let body = cluster(&name, shape.body_bytes);
                Resource {
                    metadata: Some(Metadata {
                        name,
                        version: "1".into(),
                        ..Default::default()
                    }),
                    body: Some(prost_types::Any {
                        type_url: TYPE_URL.into(),
                        value: body,
                    }),
                }
            })
            .collect();
        (Self { resources }, own)
    }
}

/// A Cluster of about `bytes`, encoded against Envoy's protos (its
/// `alt_stat_name` pads it).
fn cluster(name: &str, bytes: usize) -> Vec<u8> {
    let json = |pad: usize| {
        serde_json::json!({
            "name": name,
            "connect_timeout": "1s",
            "type": "EDS",
            "alt_stat_name": "x".repeat(pad),
        })
    };
    let base = proto_json::encode(TYPE_URL, json(0)).expect("a Cluster").len();
    proto_json::encode(TYPE_URL, json(bytes.saturating_sub(base + 2))).expect("a Cluster")
}

impl Catalog for Clusters {
    fn full_state(&self, collection: &str) -> Option<Vec<Resource>> {
        (collection == COLLECTION).then(|| self.resources.clone())
    }

    fn next_update(&mut self, _: usize) -> Update {
        Update {
            collection: COLLECTION.into(),
            resources: self.resources.clone(),
            incremental: false,
            removed: Vec::new(),
        }
    }

    fn published(&mut self, _: &str, _: &[Resource], _: Instant) {}
}

/// A CA, the gateway's certificate and one client certificate per
/// identity, written to `dir` (one key for every client: what differs is
/// the SAN).
struct Certificates {
    ca: PathBuf,
    server: (PathBuf, PathBuf),
    key: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
    client_key: KeyPair,
    dir: PathBuf,
}

impl Certificates {
    fn new(dir: &Path) -> anyhow::Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "mcp-load CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, issuer.pem())?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate()?;
        let server_cert = params.signed_by(&server_key, &issuer)?;
        let server = (dir.join("server.crt"), dir.join("server.key"));
        std::fs::write(&server.0, server_cert.pem())?;
        std::fs::write(&server.1, server_key.serialize_pem())?;
        let client_key = KeyPair::generate()?;
        let key = dir.join("client.key");
        std::fs::write(&key, client_key.serialize_pem())?;
        Ok(Self {
            ca,
            server,
            key,
            issuer,
            client_key,
            dir: dir.to_owned(),
        })
    }

    /// The client certificate of identity `i`, written: its path.
    fn client(&self, i: usize) -> anyhow::Result<PathBuf> {
        let id = format!("spiffe://cluster.local/ns/{}/sa/load", namespace(i));
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![SanType::URI(id.as_str().try_into()?)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&self.client_key, &self.issuer)?;
        let path = self.dir.join(format!("client-{i}.crt"));
        std::fs::write(&path, cert.pem())?;
        Ok(path)
    }
}

/// A client's stream, open while kept: its requests' sender and its
/// responses.
struct Open {
    _requests: mpsc::UnboundedSender<DiscoveryRequest>,
    _responses: tonic::Streaming<DiscoveryResponse>,
}

/// How one identity's client fared.
enum Outcome {
    /// Read the collection (this many resources) in this time; its stream
    /// stays open while `stream` is kept.
    Served {
        resources: usize,
        took: Duration,
        stream: Box<Open>,
    },
    Refused(tonic::Status),
}

/// Identity `i` connects and reads the collection once, state of the world.
async fn read_once(addr: std::net::SocketAddr, certs: &Certificates, i: usize) -> anyhow::Result<Outcome> {
    let start = Instant::now();
    let dial = Dial {
        address: format!("https://localhost:{}", addr.port()),
        tls: Some(ClientTlsFiles {
            ca: Some(certs.ca.clone()),
            cert: Some(certs.client(i)?),
            key: Some(certs.key.clone()),
            server_name: Some("localhost".into()),
            flag_prefix: "--",
        }),
        timeout: Duration::from_secs(10),
        keepalive: None,
        // Dialled as the `client` command dials.
        caller: mcp_xds_gateway::transport::dial_why::Caller::Client,
    };
    let channel = connect(&dial)
        .await
        .with_context(|| format!("identity {i} cannot connect"))?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(usize::MAX);
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(DiscoveryRequest {
        node: Some(Node {
            id: format!("mcp-load-{i}"),
            ..Default::default()
        }),
        type_url: TYPE_URL.into(),
        ..Default::default()
    })?;
    let requests = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
    let mut responses = match client.stream_aggregated_resources(requests).await {
        Ok(responses) => responses.into_inner(),
        Err(status) => return Ok(Outcome::Refused(status)),
    };
    match responses.message().await {
        Ok(Some(response)) => {
            let took = start.elapsed();
            // ACKed, as Envoy would.
            tx.send(DiscoveryRequest {
                type_url: TYPE_URL.into(),
                version_info: response.version_info.clone(),
                response_nonce: response.nonce.clone(),
                ..Default::default()
            })?;
            Ok(Outcome::Served {
                resources: response.resources.len(),
                took,
                stream: Box::new(Open {
                    _requests: tx,
                    _responses: responses,
                }),
            })
        }
        Ok(None) => anyhow::bail!("identity {i}: the stream ended without a response"),
        Err(status) => Ok(Outcome::Refused(status)),
    }
}

pub async fn run(binary: &Path, shape: Shape, grants: GrantsShape) -> anyhow::Result<Report> {
    let dir = tempfile::tempdir().context("cannot make a directory for the certificates")?;
    let certs = Certificates::new(dir.path())?;
    let (catalog, own) = Clusters::new(&shape);
    let config_bytes: usize = catalog
        .resources
        .iter()
        .map(|r| r.body.as_ref().map_or(0, |b| b.value.len()))
        .sum();
    let mut publisher = Publisher::start(shape, catalog).await?;
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        format!(
            "rules:\n- identities: [\"spiffe://cluster.local/ns/{{ns}}/sa/*\"]\n  collections: [\"{COLLECTION}\"]\n  \
             names: [\"{{ns}}-*\", \"shared-*\"]\n"
        ),
    )?;
    let path = |p: &Path| p.display().to_string();
    let mut extra = vec![
        "--tls-cert".to_owned(),
        path(&certs.server.0),
        "--tls-key".to_owned(),
        path(&certs.server.1),
        "--client-ca".to_owned(),
        path(&certs.ca),
        "--access-policy".to_owned(),
        path(&policy),
    ];
    if let Some(max) = grants.max_grants_per_version {
        extra.extend(["--max-grants-per-version".to_owned(), max.to_string()]);
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let gateway = ChildGateway::spawn_with(binary, publisher.addr, &[COLLECTION.to_owned()], None, &extra).await?;
    // The gateway holds the collection once the source's state is ACKed.
    publisher.wait_initial_acks(1).await?;
    // What it allocates once (the runtime, the first encodings) settles.
    tokio::time::sleep(grants.settle).await;
    let (rss_before, _) = gateway.memory()?;
    let cpu_before = gateway.cpu_seconds()?;

    let mut figures = GrantsFigures {
        identities: shape.streams,
        own_resources: own,
        shared_resources: shape.resources - own,
        resource_bytes: config_bytes as f64 / shape.resources.max(1) as f64,
        rss_before_bytes: rss_before,
        ..Default::default()
    };
    let shared = shape.resources - own;
    let mut held = Vec::new();
    let mut starts = Vec::new();
    for i in 0..shape.streams {
        let outcome = tokio::time::timeout(CLIENT_LIMIT, read_once(gateway.listen, &certs, i))
            .await
            .with_context(|| format!("identity {i} had no answer within {CLIENT_LIMIT:?}"))??;
        match outcome {
            Outcome::Served {
                resources,
                took,
                stream,
            } => {
                let expected = shared + usize::from(i < own);
                if resources != expected {
                    anyhow::bail!("identity {i} read {resources} resources, not its {expected}");
                }
                figures.served += 1;
                starts.push(took);
                held.push(stream);
            }
            Outcome::Refused(status) => {
                if status.code() != tonic::Code::ResourceExhausted {
                    anyhow::bail!("identity {i} was refused: {status:?}");
                }
                figures.refused += 1;
                figures
                    .refusal_example
                    .get_or_insert_with(|| status.message().to_owned());
            }
        }
    }
    let cpu_after = gateway.cpu_seconds()?;
    tokio::time::sleep(grants.settle).await;
    let (rss_connected, _) = gateway.memory()?;
    drop(held);
    // The gateway notices each client leave.
    tokio::time::sleep(3 * grants.settle).await;
    let (rss_after, peak) = gateway.memory()?;
    gateway.stop().await;

    let cpu = (cpu_after.0 + cpu_after.1) - (cpu_before.0 + cpu_before.1);
    starts.sort_unstable();
    let percentile = |p: f64| {
        starts
            .get(((starts.len() as f64 * p) as usize).min(starts.len().saturating_sub(1)))
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    figures.rss_connected_bytes = rss_connected;
    figures.rss_after_bytes = rss_after;
    figures.peak_rss_bytes = peak;
    figures.rss_per_grant_bytes = rss_connected.saturating_sub(rss_before) as f64 / figures.served.max(1) as f64;
    figures.cpu_ms_per_stream_start = cpu * 1000.0 / shape.streams.max(1) as f64;
    figures.start_p50_ms = percentile(0.5);
    figures.start_p99_ms = percentile(0.99);
    Ok(Report {
        shape: Some(shape),
        streams: shape.streams,
        config_bytes,
        gateway_cpu_seconds: Some(cpu),
        gateway_peak_rss_bytes: Some(peak),
        nacks: publisher.nacks.load(std::sync::atomic::Ordering::Relaxed),
        grants: Some(figures),
        ..Default::default()
    })
}
