//! The soak scenario (`--scenario soak`): an hour (`--duration`) of churn.
//! The fake Galley changes the source several times a second (adds, edits
//! and removals across several collections, incremental updates and now and
//! then a full state); clients of every protocol the gateway serves connect,
//! leave (closing their stream, or cancelling it and dropping the
//! connection) and come back (fresh, or resuming with what they hold), and
//! half of them NACK some versions and ACK later ones. The gateway's RSS,
//! open file descriptors and tokio tasks are sampled every
//! `--sample-interval`. The gateway runs at a 10-minute
//! `--max-connection-age`: a stream it closes with its aged connection is its
//! policy, not an error; the client comes back at once, and the report
//! counts those ends against the gateway's own count of such closes.
//!
//! At the end the NACKs stop, one last change reaches every resource of
//! every collection, a fresh set of clients connects, and every client still
//! connected must hold exactly the source's final state: each resource's
//! name and body, resource by resource (a named client: the part of it it
//! subscribed to). The churning clients then leave and the gateway, back to
//! the resident clients alone, must hold as many file descriptors and tasks
//! as it did with them alone before the churn began.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use mcp_xds_gateway::collections::CollectionTable;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use mcp_xds_gateway::proto::{
    IncrementalMeshConfigRequest, IncrementalMeshConfigResponse, MeshConfigRequest, MeshConfigResponse, Metadata,
    RequestResources, Resource, Resources, SinkNode, RESOURCE_SOURCE_PATH,
};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::clients::{self, xds_node, INCREMENTAL_PATH, SOTW_PATH, XDS_DELTA_PATH, XDS_SOTW_PATH};
use crate::eds::{cluster_load_assignment, digest, endpoints_for, COLLECTION as EDS, TYPE_URL as EDS_TYPE_URL};
use crate::gateway::ChildGateway;
use crate::publisher::{Catalog, Publisher, Update};
use crate::reader::length_delimited;
use crate::scenario::Shape;
use crate::{mib, Report, Run, PHASE_LIMIT};

/// The body type of the Istio collections' resources (opaque bytes): a
/// type the gateway knows and shows whole: its versions are plain
/// content hashes (a type it has no descriptor for has keyed ones).
const BODY_TYPE_URL: &str = "type.googleapis.com/google.protobuf.BytesValue";

/// Every `FULL_STATE_EVERY`-th update of a collection is its full state
/// (the others carry only what changed, removals included).
const FULL_STATE_EVERY: usize = 10;

/// A NACKing client NACKs this share of the responses it gets during the
/// churn, in percent.
const NACK_PERCENT: u32 = 10;

/// What the soak adds to a [`Shape`]: how long, how often it samples, how
/// clients come and go.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct SoakShape {
    #[serde(with = "secs")]
    pub duration: Duration,
    #[serde(with = "secs")]
    pub sample_interval: Duration,
    /// A churning client's stay, drawn between these.
    #[serde(with = "secs")]
    pub min_stay: Duration,
    #[serde(with = "secs")]
    pub max_stay: Duration,
    /// Names each named client subscribes to (some of which do not exist
    /// at any one time).
    pub names_per_client: usize,
    /// Clients of each kind that connect at the end.
    pub fresh_per_kind: usize,
    pub seed: u64,
    /// The gateway's `--max-connection-age` and its grace (`None`: its
    /// defaults, 30 min): its GOAWAY, then the close of the streams still
    /// open after the grace, which the clients come back from.
    #[serde(with = "opt_secs")]
    pub max_connection_age: Option<(Duration, Duration)>,
}

impl SoakShape {
    pub fn new(tiny: bool) -> Self {
        if tiny {
            Self {
                duration: Duration::from_secs(3),
                sample_interval: Duration::from_millis(250),
                min_stay: Duration::from_millis(100),
                max_stay: Duration::from_millis(700),
                names_per_client: 4,
                fresh_per_kind: 1,
                seed: 1,
                max_connection_age: None,
            }
        } else {
            Self {
                duration: Duration::from_secs(3600),
                sample_interval: Duration::from_secs(30),
                min_stay: Duration::from_secs(2),
                max_stay: Duration::from_secs(30),
                names_per_client: 20,
                fresh_per_kind: 1,
                seed: 1,
                // Every resident comes through it five or six times an hour.
                max_connection_age: Some((Duration::from_secs(600), Duration::from_secs(30))),
            }
        }
    }
}

mod opt_secs {
    pub fn serialize<S: serde::Serializer>(
        d: &Option<(std::time::Duration, std::time::Duration)>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match d {
            Some((age, grace)) => s.serialize_some(&(age.as_secs_f64(), grace.as_secs_f64())),
            None => s.serialize_none(),
        }
    }
}

mod secs {
    pub fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

// === the catalog ===

/// One collection of the churning source: name → (version, body).
struct Churned {
    name: String,
    eds: bool,
    resources: BTreeMap<String, (u64, Vec<u8>)>,
    /// Updates of this collection so far (every `FULL_STATE_EVERY`-th is a
    /// full state).
    updates: usize,
}

/// The soak's source: `collections` of about `resources` each, every update
/// adding, editing and removing `changes_per_update` resources of one
/// collection, the collections in turn; at the end (`settle`), every
/// resource of every collection edited once more.
pub struct Churn {
    collections: Vec<Churned>,
    /// Each collection's names are drawn from twice its size.
    space: usize,
    target: usize,
    changes: usize,
    body_bytes: usize,
    endpoints: usize,
    rng: fastrand::Rng,
    /// Collections still to get their last change (the settle).
    settle: Vec<usize>,
    /// Updates made so far (read by the sampler).
    pub made: Arc<AtomicU64>,
}

/// A resource's name in a collection: `cluster-00042` (EDS) or
/// `ns-2/r-00042`.
fn resource_name(eds: bool, i: usize) -> String {
    if eds {
        format!("cluster-{i:05}")
    } else {
        format!("ns-{}/r-{i:05}", i % 5)
    }
}

impl Churn {
    pub fn new(shape: &Shape, soak: &SoakShape, names: &[String]) -> Self {
        let endpoints = endpoints_for(shape.body_bytes);
        let mut churn = Self {
            collections: Vec::new(),
            space: shape.resources.max(1) * 2,
            target: shape.resources.max(1),
            changes: shape.changes_per_update.max(1),
            body_bytes: shape.body_bytes,
            endpoints,
            rng: fastrand::Rng::with_seed(soak.seed ^ 0x50a4),
            settle: Vec::new(),
            made: Arc::new(AtomicU64::new(0)),
        };
        for name in names {
            let eds = name == EDS;
            let resources = (0..shape.resources)
                .map(|i| {
                    let name = resource_name(eds, i);
                    let body = churn.body(eds, &name, 1);
                    (name, (1, body))
                })
                .collect();
            churn.collections.push(Churned {
                name: name.clone(),
                eds,
                resources,
                updates: 0,
            });
        }
        churn
    }

    /// The body of `name` at `version`: a ClusterLoadAssignment (EDS) or
    /// bytes that differ by name and version.
    fn body(&self, eds: bool, name: &str, version: u64) -> Vec<u8> {
        if eds {
            let serial = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), version) >> 40;
            return cluster_load_assignment(name, serial, self.endpoints);
        }
        let seed = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), version);
        let mut body = format!("{name}@{version}:").into_bytes();
        body.extend((0..self.body_bytes.saturating_sub(body.len())).map(|i| (seed as usize + i * 31) as u8));
        body
    }

    fn resource(churned: &Churned, name: &str) -> Resource {
        let (version, body) = &churned.resources[name];
        Resource {
            metadata: Some(Metadata {
                name: name.to_owned(),
                version: version.to_string(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: if churned.eds { EDS_TYPE_URL } else { BODY_TYPE_URL }.into(),
                value: body.clone(),
            }),
        }
    }

    /// From now on, each update edits every resource of a collection not yet
    /// settled (a full state), until every collection was.
    pub fn settle(&mut self) {
        self.settle = (0..self.collections.len()).rev().collect();
    }

    /// Updates the settle still needs.
    pub fn settling(&self) -> usize {
        self.settle.len()
    }

    /// Each collection's final state: name → body digest.
    pub fn finals(&self) -> Finals {
        self.collections
            .iter()
            .map(|c| {
                let set = c
                    .resources
                    .iter()
                    .map(|(n, (_, body))| (n.clone(), digest(body)))
                    .collect();
                (Arc::from(c.name.as_str()), set)
            })
            .collect()
    }
}

impl Catalog for Churn {
    fn full_state(&self, collection: &str) -> Option<Vec<Resource>> {
        let churned = self.collections.iter().find(|c| c.name == collection)?;
        Some(churned.resources.keys().map(|n| Self::resource(churned, n)).collect())
    }

    fn next_update(&mut self, update: usize) -> Update {
        self.made.fetch_add(1, Ordering::Relaxed);
        if let Some(index) = self.settle.pop() {
            let churned = &self.collections[index];
            let edits: Vec<(String, (u64, Vec<u8>))> = churned
                .resources
                .iter()
                .map(|(n, (v, _))| (n.clone(), (v + 1, self.body(churned.eds, n, v + 1))))
                .collect();
            self.collections[index].resources.extend(edits);
            let churned = &self.collections[index];
            return Update {
                collection: churned.name.clone(),
                resources: churned.resources.keys().map(|n| Self::resource(churned, n)).collect(),
                incremental: false,
                removed: Vec::new(),
            };
        }
        let index = update % self.collections.len();
        let (space, target) = (self.space, self.target);
        let mut changed = Vec::new();
        let mut removed = Vec::new();
        for _ in 0..self.changes {
            let churned = &self.collections[index];
            let size = churned.resources.len();
            // Adds and removals keep the size about its target.
            let add_share = if size * 5 < target * 4 {
                80
            } else if size * 5 > target * 6 {
                10
            } else {
                33
            };
            let roll = self.rng.u32(0..100);
            if roll < add_share || size == 0 {
                let free = (0..8)
                    .map(|_| resource_name(churned.eds, self.rng.usize(0..space)))
                    .find(|n| !churned.resources.contains_key(n));
                if let Some(name) = free {
                    let body = self.body(churned.eds, &name, 1);
                    removed.retain(|r| *r != name);
                    changed.push(name.clone());
                    self.collections[index].resources.insert(name, (1, body));
                }
            } else {
                let pick = self.rng.usize(0..size);
                let name = churned
                    .resources
                    .keys()
                    .nth(pick)
                    .cloned()
                    .expect("an index below the size");
                if roll < 67 || size == 1 {
                    let version = churned.resources[&name].0 + 1;
                    let body = self.body(churned.eds, &name, version);
                    if !changed.contains(&name) {
                        changed.push(name.clone());
                    }
                    self.collections[index].resources.insert(name, (version, body));
                } else {
                    changed.retain(|c| *c != name);
                    self.collections[index].resources.remove(&name);
                    removed.push(name);
                }
            }
        }
        let churned = &mut self.collections[index];
        churned.updates += 1;
        let full = churned.updates % FULL_STATE_EVERY == 0;
        let churned = &self.collections[index];
        Update {
            collection: churned.name.clone(),
            resources: if full {
                churned.resources.keys().map(|n| Self::resource(churned, n)).collect()
            } else {
                changed.iter().map(|n| Self::resource(churned, n)).collect()
            },
            incremental: !full,
            removed: if full { Vec::new() } else { removed },
        }
    }

    fn published(&mut self, _collection: &str, _resources: &[Resource], _at: Instant) {}
}

/// Each collection's state: name → body digest.
pub type Finals = HashMap<Arc<str>, BTreeMap<String, u64>>;

// === the clients ===

/// The kinds of client, every protocol the gateway serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Legacy `StreamAggregatedResources`, every Istio collection.
    McpSotw,
    /// Legacy `IncrementalAggregatedResources`, one collection.
    McpIncremental,
    /// `ResourceSource`, every Istio collection, full states.
    SourceSotw,
    /// `ResourceSource`, every Istio collection, incremental.
    SourceIncremental,
    /// v3 ADS state of the world, every Istio collection by GVK (istiod).
    XdsSotw,
    /// v3 ADS delta, every Istio collection by GVK, wildcard.
    XdsDelta,
    /// v3 ADS state of the world, EDS by name (Envoy).
    NamedSotw,
    /// v3 ADS delta, EDS by name.
    NamedDelta,
}

pub const KINDS: [Kind; 8] = [
    Kind::McpSotw,
    Kind::McpIncremental,
    Kind::SourceSotw,
    Kind::SourceIncremental,
    Kind::XdsSotw,
    Kind::XdsDelta,
    Kind::NamedSotw,
    Kind::NamedDelta,
];

impl Kind {
    fn named(self) -> bool {
        matches!(self, Kind::NamedSotw | Kind::NamedDelta)
    }

    /// A NACKed response is applied all the same: delta xDS clients hold
    /// what they were sent (docs/protocols.md); MCP sinks and SotW clients
    /// reject a response whole.
    fn applies_nacked(self) -> bool {
        matches!(self, Kind::XdsDelta | Kind::NamedDelta)
    }

    /// It keeps what a state-of-the-world response leaves out, as Envoy's
    /// and grpc's EDS do (`collections::sotw_keeps_what_is_left_out`): a
    /// response carries what changed, and a resource the source removed is
    /// kept (state of the world cannot tell it).
    fn keeps_left_out(self) -> bool {
        matches!(self, Kind::NamedSotw)
    }
}

/// A resource a client holds.
#[derive(Clone, Debug, PartialEq)]
struct Held {
    /// The version it came with (MCP: the source's; delta: the gateway's),
    /// reported when the client resumes.
    version: String,
    digest: u64,
}

/// What one response says, whatever the protocol.
struct Change {
    collection: Arc<str>,
    /// The whole state of the collection (else only what changed).
    full: bool,
    resources: Vec<(String, Held)>,
    removed: Vec<String>,
    type_url: String,
    version: String,
    nonce: String,
}

impl Change {
    /// A state-of-the-world response: the whole of `collection`.
    fn state(
        collection: Arc<str>,
        resources: Vec<(String, Held)>,
        type_url: String,
        version: String,
        nonce: String,
    ) -> Self {
        Self {
            collection,
            full: true,
            resources,
            removed: Vec::new(),
            type_url,
            version,
            nonce,
        }
    }
}

/// A client: its kind, what it reads and holds, and its counts.
struct Client {
    id: usize,
    kind: Kind,
    /// The collections it reads (one for legacy incremental; EDS for named
    /// clients).
    collections: Vec<Arc<str>>,
    /// A named client's subscription.
    names: Vec<String>,
    /// It NACKs some responses while the churn lasts.
    nacks: bool,
    rng: fastrand::Rng,
    held: HashMap<Arc<str>, BTreeMap<String, Held>>,
    /// State of the world: the version it last ACKed, by type URL (what
    /// it reports when it resumes).
    acked: HashMap<String, String>,
    responses: u64,
    nacked: u64,
}

/// A client's stream ended in a way the scenario did not cause.
#[derive(Debug)]
struct StreamError(String);

/// What every client shares.
struct Shared {
    /// The gateway the clients connect to.
    addr: std::net::SocketAddr,
    /// Its `--max-connection-age` (less its jitter of 10 %).
    max_age: Option<Duration>,
    finals: watch::Receiver<Option<Arc<Finals>>>,
    /// NACKs are sent while this holds.
    nacking: Arc<AtomicBool>,
    /// Clients holding the final state now.
    at_final: Arc<AtomicUsize>,
    counts: Arc<Counts>,
    max_frame_size: u32,
    frames: Arc<clients::Frames>,
    table: CollectionTable,
}

/// The clients' counts over the run.
#[derive(Debug, Default)]
struct Counts {
    sessions: AtomicU64,
    resumed: AtomicU64,
    closed: AtomicU64,
    cancelled: AtomicU64,
    responses: AtomicU64,
    nacks: AtomicU64,
    /// Clients connected now.
    live: AtomicUsize,
    /// Streams that ended with their connection past the gateway's
    /// `--max-connection-age` (its policy, not an error).
    max_age_ends: AtomicU64,
    /// Stream errors: how many, and the first `ERRORS_KEPT` said.
    errors: AtomicU64,
    said: Mutex<Vec<String>>,
}

/// Stream errors kept for the report (the rest are counted).
const ERRORS_KEPT: usize = 100;

impl Client {
    fn new(id: usize, kind: Kind, collections: &[Arc<str>], soak: &SoakShape, eds_space: usize) -> Self {
        let mut rng = fastrand::Rng::with_seed(soak.seed.wrapping_mul(1_000_003) ^ id as u64);
        let (collections, names) = match kind {
            Kind::NamedSotw | Kind::NamedDelta => {
                let mut names: Vec<String> = (0..soak.names_per_client)
                    .map(|_| resource_name(true, rng.usize(0..eds_space)))
                    .collect();
                names.sort();
                names.dedup();
                (vec![Arc::from(EDS)], names)
            }
            Kind::McpIncremental => (vec![collections[id % collections.len()].clone()], Vec::new()),
            _ => (collections.to_vec(), Vec::new()),
        };
        Self {
            id,
            kind,
            held: collections.iter().map(|c| (c.clone(), BTreeMap::new())).collect(),
            collections,
            names,
            nacks: id % 2 == 1,
            rng,
            acked: HashMap::new(),
            responses: 0,
            nacked: 0,
        }
    }

    /// Forgets what it holds (a fresh start).
    fn forget(&mut self) {
        for held in self.held.values_mut() {
            held.clear();
        }
        self.acked.clear();
    }

    /// What it should hold of `finals`.
    fn expected(&self, finals: &Finals) -> HashMap<Arc<str>, BTreeMap<String, u64>> {
        self.collections
            .iter()
            .map(|c| {
                let all = finals.get(c).cloned().unwrap_or_default();
                let set = if self.kind.named() {
                    all.into_iter()
                        .filter(|(n, _)| self.names.binary_search(n).is_ok())
                        .collect()
                } else {
                    all
                };
                (c.clone(), set)
            })
            .collect()
    }

    fn at_final(&self, finals: &Finals) -> bool {
        self.difference(finals).is_none()
    }

    /// How what it holds differs from `finals`, said in a line; `None`
    /// where it holds exactly that.
    fn difference(&self, finals: &Finals) -> Option<String> {
        let mut said = Vec::new();
        for (collection, expected) in self.expected(finals) {
            let held = &self.held[&collection];
            let missing: Vec<&String> = expected.keys().filter(|n| !held.contains_key(*n)).collect();
            let extra: Vec<&String> = if self.kind.keeps_left_out() {
                Vec::new()
            } else {
                held.keys().filter(|n| !expected.contains_key(*n)).collect()
            };
            let stale: Vec<&String> = expected
                .iter()
                .filter(|(n, d)| held.get(*n).is_some_and(|h| h.digest != **d))
                .map(|(n, _)| n)
                .collect();
            if missing.is_empty() && extra.is_empty() && stale.is_empty() {
                continue;
            }
            let few = |names: &[&String]| {
                let shown: Vec<&str> = names.iter().take(5).map(|n| n.as_str()).collect();
                format!("{} {:?}", names.len(), shown)
            };
            said.push(format!(
                "{collection}: holds {} of {} resources; missing {}, not at the source {}, at another content {}",
                held.len(),
                expected.len(),
                few(&missing),
                few(&extra),
                few(&stale)
            ));
        }
        (!said.is_empty()).then(|| said.join("; "))
    }

    /// Applies a response, or not where the client NACKs it and rejects
    /// NACKed responses whole. Returns the NACK's message, if it NACKs.
    /// `first`: the session's first response of its type, which the client
    /// never NACKs (a NACK of a response built from what a resuming client
    /// reported ends its stream: the gateway cannot know what it holds).
    fn on_change(&mut self, change: &Change, nacking: bool, first: bool) -> Option<String> {
        self.responses += 1;
        let nack = nacking && !first && self.nacks && self.rng.u32(0..100) < NACK_PERCENT;
        if !nack || self.kind.applies_nacked() {
            let held = self.held.entry(change.collection.clone()).or_default();
            if change.full {
                held.clear();
            }
            for (name, resource) in &change.resources {
                held.insert(name.clone(), resource.clone());
            }
            for name in &change.removed {
                held.remove(name);
            }
        }
        if nack {
            self.nacked += 1;
            Some(format!("soak client {} rejects version {}", self.id, change.version))
        } else {
            self.acked.insert(change.type_url.clone(), change.version.clone());
            None
        }
    }

    /// The v3 type URL of each collection it reads: a GVK (MCP over xDS),
    /// or EDS's.
    fn type_urls(&self, table: &CollectionTable) -> HashMap<String, Arc<str>> {
        (self.collections.iter())
            .map(|c| match &**c {
                EDS => (EDS_TYPE_URL.to_owned(), c.clone()),
                _ => (table.gvk(c).map(str::to_owned).unwrap_or_default(), c.clone()),
            })
            .collect()
    }

    /// The versions it holds of `collection`, as it reports them resuming.
    fn held_versions(&self, collection: &str) -> HashMap<String, String> {
        self.held
            .get(collection)
            .map(|held| held.iter().map(|(n, h)| (n.clone(), h.version.clone())).collect())
            .unwrap_or_default()
    }
}

/// A NACK's `error_detail`.
fn rejection(message: String) -> tonic_types::Status {
    tonic_types::Status {
        code: tonic::Code::InvalidArgument as i32,
        message,
        details: Vec::new(),
    }
}

fn sink_node(id: usize) -> Option<SinkNode> {
    Some(SinkNode {
        id: format!("soak-{id}"),
        annotations: HashMap::new(),
    })
}

/// MCP resources: each name and what a client holds of it.
fn mcp_resources(resources: &[Resource]) -> anyhow::Result<Vec<(String, Held)>> {
    resources.iter().map(mcp_resource).collect()
}

/// An MCP resource: its name and what a client holds of it.
fn mcp_resource(resource: &Resource) -> anyhow::Result<(String, Held)> {
    let metadata = resource.metadata.as_ref().context("a resource without metadata")?;
    let body = resource.body.as_ref().map_or(&[][..], |b| &b.value[..]);
    Ok((
        metadata.name.clone(),
        Held {
            version: metadata.version.clone(),
            digest: digest(body),
        },
    ))
}

/// A v3 resource body of `collection`: an MCP `Resource` (by GVK) or a
/// ClusterLoadAssignment (EDS, named by its `cluster_name`).
fn xds_body(collection: &str, any: &prost_types::Any, version: String) -> anyhow::Result<(String, Held)> {
    if collection == EDS {
        let name = length_delimited(&any.value, 1)?.unwrap_or_default();
        let name = std::str::from_utf8(name)?.to_owned();
        return Ok((
            name,
            Held {
                version,
                digest: digest(&any.value),
            },
        ));
    }
    mcp_resource(&Resource::decode(any.value.as_slice())?)
}

/// How a session ends.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Leave {
    /// The client closes its side and waits for the gateway to end the
    /// stream.
    Close,
    /// The client drops the stream (RST_STREAM) and its connection.
    Cancel,
    /// It stays until the run stops it.
    Never,
}

/// One session of `client` on a connection of its own: it runs until `stop`
/// or, for a churning client, `until` (then leaves as `leave` says).
/// `resume`: it reports what it holds rather than starting fresh.
async fn session(
    client: &mut Client,
    shared: &Shared,
    stay: (Option<Instant>, Leave),
    resume: bool,
    stop: &CancellationToken,
) -> Result<(), StreamError> {
    let channel = clients::connect(shared.addr, 1, shared.max_frame_size, shared.frames.clone())
        .await
        .map_err(|e| StreamError(format!("cannot connect: {e:#}")))?
        .remove(0);
    if !resume {
        client.forget();
    }
    shared.counts.sessions.fetch_add(1, Ordering::Relaxed);
    if resume {
        shared.counts.resumed.fetch_add(1, Ordering::Relaxed);
    }
    let id = client.id;
    // State of the world: the version last ACKed of each type, resuming.
    let reported = |client: &Client, type_url: &str| match resume {
        true => client.acked.get(type_url).cloned().unwrap_or_default(),
        false => String::new(),
    };
    // A state-of-the-world ACK names the version it ACKs, a NACK the one the
    // client still holds.
    let sotw_version = |c: &Change, nack: &Option<String>, acked: &str| match nack {
        Some(_) => acked.to_owned(),
        None => c.version.clone(),
    };
    let types = client.type_urls(&shared.table);
    let names = client.names.clone();
    let session = Session {
        shared,
        channel,
        stay,
        stop,
    };
    match client.kind {
        Kind::McpSotw => {
            let initial = (client.collections.iter())
                .map(|c| MeshConfigRequest {
                    version_info: reported(client, c),
                    sink_node: sink_node(id),
                    type_url: c.to_string(),
                    ..Default::default()
                })
                .collect();
            let decode = |r: MeshConfigResponse| {
                let resources = mcp_resources(&r.resources)?;
                Ok(Change::state(
                    r.type_url.as_str().into(),
                    resources,
                    r.type_url,
                    r.version_info,
                    r.nonce,
                ))
            };
            let reply = |c: &Change, nack: Option<String>, acked: &str| MeshConfigRequest {
                version_info: sotw_version(c, &nack, acked),
                sink_node: sink_node(id),
                type_url: c.type_url.clone(),
                response_nonce: c.nonce.clone(),
                error_detail: nack.map(rejection),
            };
            session.drive(client, SOTW_PATH, initial, decode, reply).await
        }
        Kind::McpIncremental => {
            let collection = client.collections[0].clone();
            let initial = vec![IncrementalMeshConfigRequest {
                sink_node: sink_node(id),
                type_url: collection.to_string(),
                initial_resource_versions: client.held_versions(&collection),
                ..Default::default()
            }];
            let decode = |r: IncrementalMeshConfigResponse| {
                Ok(Change {
                    collection: collection.clone(),
                    full: false,
                    resources: mcp_resources(&r.resources)?,
                    removed: r.removed_resources,
                    type_url: collection.to_string(),
                    version: r.system_version_info,
                    nonce: r.nonce,
                })
            };
            let reply = |c: &Change, nack: Option<String>, _: &str| IncrementalMeshConfigRequest {
                sink_node: sink_node(id),
                type_url: c.type_url.clone(),
                response_nonce: c.nonce.clone(),
                error_detail: nack.map(rejection),
                ..Default::default()
            };
            session.drive(client, INCREMENTAL_PATH, initial, decode, reply).await
        }
        Kind::SourceSotw | Kind::SourceIncremental => {
            let incremental = client.kind == Kind::SourceIncremental;
            let initial = (client.collections.iter())
                .map(|c| RequestResources {
                    sink_node: sink_node(id),
                    collection: c.to_string(),
                    initial_resource_versions: if incremental {
                        client.held_versions(c)
                    } else {
                        HashMap::new()
                    },
                    incremental,
                    ..Default::default()
                })
                .collect();
            let decode = |r: Resources| {
                Ok(Change {
                    collection: r.collection.as_str().into(),
                    full: !r.incremental,
                    resources: mcp_resources(&r.resources)?,
                    removed: r.removed_resources,
                    type_url: r.collection,
                    version: r.system_version_info,
                    nonce: r.nonce,
                })
            };
            let reply = |c: &Change, nack: Option<String>, _: &str| RequestResources {
                sink_node: sink_node(id),
                collection: c.collection.to_string(),
                response_nonce: c.nonce.clone(),
                error_detail: nack.map(rejection),
                incremental,
                ..Default::default()
            };
            session
                .drive(client, RESOURCE_SOURCE_PATH, initial, decode, reply)
                .await
        }
        Kind::XdsSotw | Kind::NamedSotw => {
            let initial = (types.keys().enumerate())
                .map(|(i, type_url)| DiscoveryRequest {
                    node: (i == 0).then(|| xds_node(id)).flatten(),
                    version_info: reported(client, type_url),
                    resource_names: names.clone(),
                    type_url: type_url.clone(),
                    ..Default::default()
                })
                .collect();
            let kind = client.kind;
            let decode = |r: DiscoveryResponse| {
                let collection = collection_of(&types, &r.type_url)?;
                let resources = r.resources.iter().map(|any| xds_body(collection, any, String::new()));
                let resources = resources.collect::<anyhow::Result<_>>()?;
                let mut change = Change::state(collection.clone(), resources, r.type_url, r.version_info, r.nonce);
                change.full = !kind.keeps_left_out();
                Ok(change)
            };
            let reply = |c: &Change, nack: Option<String>, acked: &str| DiscoveryRequest {
                version_info: sotw_version(c, &nack, acked),
                resource_names: names.clone(),
                type_url: c.type_url.clone(),
                response_nonce: c.nonce.clone(),
                error_detail: nack.map(rejection),
                ..Default::default()
            };
            session.drive(client, XDS_SOTW_PATH, initial, decode, reply).await
        }
        Kind::XdsDelta | Kind::NamedDelta => {
            let initial = (types.iter().enumerate())
                .map(|(i, (type_url, collection))| DeltaDiscoveryRequest {
                    node: (i == 0).then(|| xds_node(id)).flatten(),
                    type_url: type_url.clone(),
                    resource_names_subscribe: names.clone(),
                    initial_resource_versions: client.held_versions(collection),
                    ..Default::default()
                })
                .collect();
            let decode = |r: DeltaDiscoveryResponse| {
                let collection = collection_of(&types, &r.type_url)?;
                let resources = r.resources.iter().map(|resource| {
                    let any = resource.resource.as_ref().context("a delta resource without a body")?;
                    // What it reports resuming: the version the gateway named.
                    let (name, held) = xds_body(collection, any, resource.version.clone())?;
                    if name != resource.name {
                        anyhow::bail!("a delta resource named {:?} whose body names {name:?}", resource.name);
                    }
                    let version = resource.version.clone();
                    Ok((name, Held { version, ..held }))
                });
                Ok(Change {
                    collection: collection.clone(),
                    full: false,
                    resources: resources.collect::<anyhow::Result<_>>()?,
                    removed: r.removed_resources,
                    type_url: r.type_url,
                    version: r.system_version_info,
                    nonce: r.nonce,
                })
            };
            let reply = |c: &Change, nack: Option<String>, _: &str| DeltaDiscoveryRequest {
                type_url: c.type_url.clone(),
                response_nonce: c.nonce.clone(),
                error_detail: nack.map(rejection),
                ..Default::default()
            };
            session.drive(client, XDS_DELTA_PATH, initial, decode, reply).await
        }
    }
}

/// The collection a v3 response's type URL is of.
fn collection_of<'a>(types: &'a HashMap<String, Arc<str>>, type_url: &str) -> anyhow::Result<&'a Arc<str>> {
    types
        .get(type_url)
        .with_context(|| format!("a response of type {type_url:?}"))
}

/// A session's connection, how long it stays and what stops it.
struct Session<'a> {
    shared: &'a Shared,
    channel: Channel,
    stay: (Option<Instant>, Leave),
    stop: &'a CancellationToken,
}

impl Session<'_> {
    /// One stream of `client` on `path`: the initial requests, then each
    /// response decoded into a [`Change`], applied (or not, where NACKed)
    /// and answered with `reply(change, NACK message, version last ACKed)`,
    /// until `stop`, or the stay's end (then leaving as it says).
    async fn drive<Req, Resp>(
        self,
        client: &mut Client,
        path: &'static str,
        initial: Vec<Req>,
        decode: impl Fn(Resp) -> anyhow::Result<Change>,
        reply: impl Fn(&Change, Option<String>, &str) -> Req,
    ) -> Result<(), StreamError>
    where
        Req: Message + Send + 'static,
        Resp: Message + Default + Send + 'static,
    {
        let Session {
            shared,
            channel,
            stay: (until, leave),
            stop,
        } = self;
        let failed = |what: &str, e: &dyn std::fmt::Display| StreamError(format!("{what}: {e}"));
        let (tx, rx) = mpsc::channel(initial.len() + 16);
        for request in initial {
            tx.send(request).await.map_err(|e| failed("send", &e))?;
        }
        let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(256 << 20);
        grpc.ready().await.map_err(|e| failed("connection", &e))?;
        let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
        let response = grpc
            .streaming(
                tonic::Request::new(ReceiverStream::new(rx)),
                http::uri::PathAndQuery::from_static(path),
                codec,
            )
            .await
            .map_err(|status| failed("open", &status))?;
        let mut inbound = response.into_inner();
        let mut finals = shared.finals.clone();
        let mut counted_final = false;
        // The types this session got a response of.
        let mut answered = std::collections::HashSet::new();
        let leave_at = until.unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600));
        shared.counts.live.fetch_add(1, Ordering::Relaxed);
        let live = scopeguard(&shared.counts.live);
        let at_final = &shared.at_final;
        let recount = |client: &Client, finals: &Option<Arc<Finals>>, counted: &mut bool| {
            let now = finals.as_ref().is_some_and(|f| client.at_final(f));
            if now != *counted {
                *counted = now;
                if now {
                    at_final.fetch_add(1, Ordering::Relaxed);
                } else {
                    at_final.fetch_sub(1, Ordering::Relaxed);
                }
            }
        };
        let result = loop {
            tokio::select! {
                message = inbound.message() => {
                    let response = match message {
                        Ok(Some(response)) => response,
                        Ok(None) => break Err(StreamError("the gateway ended the stream (OK)".into())),
                        Err(status) => break Err(failed("the stream ended", &status)),
                    };
                    let change = match decode(response) {
                        Ok(change) => change,
                        Err(e) => break Err(failed("a response that does not read", &e)),
                    };
                    let acked = client.acked.get(&change.type_url).cloned().unwrap_or_default();
                    let first = answered.insert(change.type_url.clone());
                    let nack = client.on_change(&change, shared.nacking.load(Ordering::SeqCst), first);
                    shared.counts.responses.fetch_add(1, Ordering::Relaxed);
                    if nack.is_some() {
                        shared.counts.nacks.fetch_add(1, Ordering::Relaxed);
                    }
                    if tx.send(reply(&change, nack, &acked)).await.is_err() {
                        break Err(StreamError("the request stream closed".into()));
                    }
                    recount(client, &finals.borrow(), &mut counted_final);
                }
                changed = finals.changed() => {
                    if changed.is_ok() {
                        recount(client, &finals.borrow_and_update(), &mut counted_final);
                    }
                }
                () = tokio::time::sleep_until(leave_at), if leave != Leave::Never => {
                    if leave == Leave::Close {
                        shared.counts.closed.fetch_add(1, Ordering::Relaxed);
                        // Half-close, then read until the gateway ends the stream.
                        drop(tx);
                        let drained = tokio::time::timeout(Duration::from_secs(10), async {
                            loop {
                                match inbound.message().await {
                                    Ok(Some(_)) => continue,
                                    Ok(None) => break Ok(()),
                                    Err(status) if status.code() == tonic::Code::Ok => break Ok(()),
                                    Err(status) => break Err(failed("the stream ended after the client closed", &status)),
                                }
                            }
                        })
                        .await;
                        break drained.unwrap_or_else(|_| Err(StreamError("the gateway did not end a stream the client closed within 10s".into())));
                    }
                    shared.counts.cancelled.fetch_add(1, Ordering::Relaxed);
                    break Ok(());
                }
                () = stop.cancelled() => break Ok(()),
            }
        };
        if counted_final {
            at_final.fetch_sub(1, Ordering::Relaxed);
        }
        drop(live);
        result
    }
}

/// Decrements `count` when dropped.
fn scopeguard(count: &AtomicUsize) -> impl Drop + '_ {
    struct Guard<'a>(&'a AtomicUsize);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    Guard(count)
}

// === a client's life ===

/// A client's life: one session for a resident (`churn` is `None`; it
/// reconnects only after a stream error), or sessions of a random stay until
/// `churn`'s end, each ended by closing or cancelling, then one until the
/// run stops. Returns the client and whether it was connected at the end.
async fn live(
    mut client: Client,
    shared: Arc<Shared>,
    churn: Option<(Instant, SoakShape)>,
    stop: CancellationToken,
) -> (Client, bool) {
    let mut first = true;
    loop {
        let (until, leave) = match churn {
            Some((end, soak)) if Instant::now() < end => {
                let stay = client
                    .rng
                    .u64(soak.min_stay.as_millis() as u64..=soak.max_stay.as_millis() as u64);
                let at = Instant::now() + Duration::from_millis(stay);
                if at >= end {
                    (None, Leave::Never)
                } else {
                    (Some(at), if client.rng.bool() { Leave::Close } else { Leave::Cancel })
                }
            }
            _ => (None, Leave::Never),
        };
        // A client that comes back resumes half the time.
        let resume = !first && client.rng.bool();
        first = false;
        let opened = Instant::now();
        let result = session(&mut client, &shared, (until, leave), resume, &stop).await;
        if stop.is_cancelled() {
            return (client, result.is_ok());
        }
        // The gateway closes a connection past its maximum age (after a
        // GOAWAY and a grace): the client comes back at once, as grpc and
        // Envoy do.
        let aged = shared.max_age.is_some_and(|age| opened.elapsed() >= age);
        if let (true, Err(StreamError(e))) = (aged, &result) {
            shared.counts.max_age_ends.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "mcp-load: client {} ({:?}) after its connection's maximum age: {e}",
                client.id, client.kind
            );
            continue;
        }
        if let Err(StreamError(e)) = result {
            let said = format!("client {} ({:?}): {e}", client.id, client.kind);
            eprintln!("mcp-load: {said}");
            shared.counts.errors.fetch_add(1, Ordering::Relaxed);
            {
                let mut kept = shared
                    .counts
                    .said
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if kept.len() < ERRORS_KEPT {
                    kept.push(said);
                }
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
                () = stop.cancelled() => return (client, false),
            }
        }
    }
}

// === samples ===

/// The gateway at one moment.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Sample {
    /// Since the churn began.
    pub at_seconds: f64,
    pub rss_bytes: u64,
    pub open_fds: usize,
    /// Tasks alive on its runtime (`mcp_gateway_runtime_tasks`).
    pub tasks: u64,
    /// Its client connections and streams, by its own gauges.
    pub connections: u64,
    pub streams: u64,
    /// Clients the tool had connected.
    pub clients_connected: usize,
    /// Updates the source had published.
    pub updates_published: u64,
    /// What the gateway's cache holds (`mcp_gateway_cache_bytes`) and what
    /// its history keeps beyond the newest versions
    /// (`mcp_gateway_history_bytes`, `mcp_gateway_history_versions`),
    /// summed over the collections: where memory growth would be expected.
    pub cache_bytes: u64,
    pub history_bytes: u64,
    pub history_versions: u64,
}

/// The sum of the series of `name` whose labels hold `labels` (all of them
/// where empty), from a Prometheus exposition.
fn gauge(exposition: &str, name: &str, labels: &str) -> Option<f64> {
    let mut found = None;
    for line in exposition.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let (series, value) = rest.rsplit_once(' ')?;
        if !series.contains(labels) {
            continue;
        }
        *found.get_or_insert(0.0) += value.parse::<f64>().ok()?;
    }
    found
}

/// Takes a sample of `gateway`.
async fn sample(gateway: &ChildGateway, start: Instant, shared: &Shared, made: &AtomicU64) -> anyhow::Result<Sample> {
    let metrics = gateway.metrics().await?;
    let read = |name: &str, labels: &str| gauge(&metrics, name, labels).unwrap_or(0.0) as u64;
    Ok(Sample {
        at_seconds: (start.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        rss_bytes: gateway.memory()?.0,
        open_fds: gateway.open_fds()?,
        tasks: gauge(&metrics, mcp_xds_gateway::metrics::RUNTIME_TASKS, "")
            .context("the gateway's /metrics has no task count")? as u64,
        connections: read(mcp_xds_gateway::metrics::CONNECTIONS, "listener=\"--listen\""),
        streams: read(mcp_xds_gateway::metrics::DOWNSTREAM_STREAMS, ""),
        clients_connected: shared.counts.live.load(Ordering::Relaxed),
        updates_published: made.load(Ordering::Relaxed),
        cache_bytes: read(mcp_xds_gateway::metrics::CACHE_BYTES, ""),
        history_bytes: read(mcp_xds_gateway::metrics::HISTORY_BYTES, ""),
        history_versions: read(mcp_xds_gateway::metrics::HISTORY_VERSIONS, ""),
    })
}

/// Waits until the gateway holds `clients` connections and streams (its
/// own gauges) and, given a sample taken at rest `before`, no more
/// descriptors and tasks than it did then (less `AT_REST_SLACK`): closed
/// connections' tasks take a moment to end. Then, or after 30 s as it is,
/// samples it; also returns how long it waited.
async fn sample_at_rest(
    gateway: &ChildGateway,
    clients: u64,
    before: Option<&Sample>,
    (start, shared, made): (Instant, &Shared, &AtomicU64),
) -> anyhow::Result<(Sample, f64)> {
    let began = Instant::now();
    let give_up = began + Duration::from_secs(30);
    loop {
        let now = sample(gateway, start, shared, made).await?;
        let settled = before.is_none_or(|b| {
            now.open_fds as i64 - b.open_fds as i64 <= AT_REST_SLACK
                && now.tasks as i64 - b.tasks as i64 <= AT_REST_SLACK
        });
        if (now.connections == clients && now.streams == clients && settled) || Instant::now() >= give_up {
            return Ok((now, began.elapsed().as_secs_f64()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// === the run ===

/// The soak's own figures.
#[derive(Debug, serde::Serialize)]
pub struct SoakFigures {
    pub soak: SoakShape,
    /// Clients of each kind: resident the whole run, churning, and connecting
    /// at the end.
    pub residents: usize,
    pub churning: usize,
    pub fresh: usize,
    pub kinds: Vec<Kind>,
    /// The gateway every `sample_interval` of the churn.
    pub samples: Vec<Sample>,
    /// With the resident clients alone, before the churn and after it.
    pub at_rest_before: Sample,
    pub at_rest_after: Sample,
    pub updates_published: u64,
    pub sessions: u64,
    pub sessions_resumed: u64,
    pub leaves_closed: u64,
    pub leaves_cancelled: u64,
    pub responses: u64,
    /// NACKs the clients sent (the scenario's own).
    pub nacks_sent: u64,
    /// The gateway's stream ends, by reason (`mcp_gateway_downstream_stream_ends_total`).
    pub gateway_stream_ends: BTreeMap<String, u64>,
    /// Client streams that ended with their connection past the gateway's
    /// `--max-connection-age` (the clients came back), and the connections
    /// the gateway closed for it (`mcp_gateway_connections_closed_total`).
    pub max_age_ends: u64,
    pub gateway_max_age_closes: u64,
    pub verdict: Verdict,
}

/// Whether the run meets the criteria, and what fails.
#[derive(Debug, Default, serde::Serialize)]
pub struct Verdict {
    pub passed: bool,
    /// Clients connected at the end, and of them those holding exactly the
    /// source's final state.
    pub clients_checked: usize,
    pub clients_at_final: usize,
    /// RSS at 10 minutes (or a sixth of a shorter run) and at the end of the
    /// churn, and the growth between them (judged at runs of 10 minutes and
    /// more: a shorter one is still warming up).
    pub rss_baseline_at_seconds: f64,
    pub rss_baseline_bytes: u64,
    pub rss_end_bytes: u64,
    pub rss_growth_percent: f64,
    pub rss_judged: bool,
    /// File descriptors and tasks at rest after the churn, less before it,
    /// and how long the gateway took to come to rest (30 s at most).
    pub at_rest_after_seconds: f64,
    pub fds_growth: i64,
    pub tasks_growth: i64,
    /// Each failure, said in a line (which client and what differs).
    pub failures: Vec<String>,
}

/// How long every client has to reach the final state once it is published.
const FINAL_LIMIT: Duration = Duration::from_secs(60);

/// RSS may grow this much from 10 minutes to the end, in percent.
const RSS_GROWTH_LIMIT: f64 = 10.0;
/// File descriptors and tasks at rest may differ by this much (a scrape in
/// flight, a timer).
const AT_REST_SLACK: i64 = 2;

/// Runs the soak.
pub async fn run(binary: &Path, shape: Shape, soak: SoakShape, run: Run) -> anyhow::Result<Report> {
    let table = CollectionTable::builtin();
    let mut names = crate::collection_names(shape.collections, crate::scenario::ClientProtocol::XdsSotw)?;
    let istio: Vec<Arc<str>> = names.iter().map(|n| Arc::from(n.as_str())).collect();
    names.push(EDS.to_owned());
    let catalog = Churn::new(&shape, &soak, &names);
    let made = catalog.made.clone();
    let eds_space = catalog.space;
    let mut publisher = Publisher::start(shape, catalog).await?;
    let age_flags: Vec<String> = soak
        .max_connection_age
        .iter()
        .flat_map(|(age, grace)| {
            [
                "--max-connection-age".to_owned(),
                format!("{}ms", age.as_millis()),
                "--max-connection-age-grace".to_owned(),
                format!("{}ms", grace.as_millis()),
            ]
        })
        .collect();
    let age_flags: Vec<&str> = age_flags.iter().map(String::as_str).collect();
    let gateway = ChildGateway::spawn_with(binary, publisher.addr, &names, None, &age_flags).await?;
    tokio::time::timeout(PHASE_LIMIT, publisher.wait_initial_acks(names.len()))
        .await
        .context("the gateway did not ACK the initial state in time")??;

    let (finals_tx, finals_rx) = watch::channel(None);
    let shared = Arc::new(Shared {
        addr: gateway.listen,
        // Its jitter makes a connection's age 90 % of the flag at the least.
        max_age: soak.max_connection_age.map(|(age, _)| age.mul_f64(0.9)),
        finals: finals_rx,
        nacking: Arc::new(AtomicBool::new(true)),
        at_final: Arc::new(AtomicUsize::new(0)),
        counts: Arc::new(Counts::default()),
        max_frame_size: run.max_frame_size,
        frames: Arc::new(clients::Frames::default()),
        table,
    });
    // Half the clients are residents, the rest churn; the kinds in turn.
    let residents = shape.streams.div_ceil(2);
    let churning = shape.streams - residents;
    let fresh = soak.fresh_per_kind * KINDS.len();
    let new_client = |id: usize| Client::new(id, KINDS[id % KINDS.len()], &istio, &soak, eds_space);

    // The residents, synced, at rest: the baseline of descriptors and tasks.
    let start = Instant::now();
    let stop_residents = CancellationToken::new();
    let resident_tasks: Vec<JoinHandle<(Client, bool)>> = (0..residents)
        .map(|id| tokio::spawn(live(new_client(id), shared.clone(), None, stop_residents.clone())))
        .collect();
    crate::until("resident clients connected", residents, || {
        shared.counts.live.load(Ordering::Relaxed)
    })
    .await?;
    crate::until("resident clients answered", residents, || {
        usize::try_from(shared.counts.responses.load(Ordering::Relaxed)).unwrap_or(usize::MAX)
    })
    .await?;
    let (at_rest_before, _) = sample_at_rest(&gateway, residents as u64, None, (start, &shared, &made)).await?;

    // The churn.
    let churn_start = Instant::now();
    let churn_end = churn_start + soak.duration;
    let stop_churn = CancellationToken::new();
    let churn_tasks: Vec<JoinHandle<(Client, bool)>> = (residents..residents + churning)
        .map(|id| {
            let churn = Some((churn_end, soak));
            tokio::spawn(live(new_client(id), shared.clone(), churn, stop_churn.clone()))
        })
        .collect();
    let sampling = CancellationToken::new();
    let sampler = {
        let (shared, made, sampling) = (shared.clone(), made.clone(), sampling.clone());
        let gateway = &gateway;
        async move {
            let mut samples = Vec::new();
            let mut ticker = tokio::time::interval(soak.sample_interval);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = sampling.cancelled() => break,
                }
                let taken = sample(gateway, churn_start, &shared, &made).await?;
                eprintln!(
                    "mcp-load: soak {:>7.1}s rss {} fds {} tasks {} connections {} streams {} clients {} updates {}",
                    taken.at_seconds,
                    mib(taken.rss_bytes),
                    taken.open_fds,
                    taken.tasks,
                    taken.connections,
                    taken.streams,
                    taken.clients_connected,
                    taken.updates_published
                );
                samples.push(taken);
            }
            Ok::<_, anyhow::Error>(samples)
        }
    };
    let publishing = async {
        let published = publisher.publish(0.., Some(churn_end)).await?;
        // The end: no more NACKs, then one last change of every resource of
        // every collection, so that whatever a client NACKed is followed
        // by a version it ACKs.
        sampling.cancel();
        shared.nacking.store(false, Ordering::SeqCst);
        let settle = publisher
            .write(|c| {
                c.settle();
                c.settling()
            })
            .await;
        publisher.publish(published..published + settle, None).await?;
        Ok::<_, anyhow::Error>(())
    };
    let (samples, published) = tokio::join!(sampler, publishing);
    published?;
    let samples = samples?;
    let finals = Arc::new(publisher.read(Churn::finals).await);
    finals_tx.send_replace(Some(finals.clone()));

    // A fresh set, and every client connected at the final state.
    let stop_fresh = CancellationToken::new();
    let first_fresh = residents + churning;
    let fresh_tasks: Vec<JoinHandle<(Client, bool)>> = (first_fresh..first_fresh + fresh)
        .map(|id| tokio::spawn(live(new_client(id), shared.clone(), None, stop_fresh.clone())))
        .collect();
    let everyone = residents + churning + fresh;
    let all_final = tokio::time::timeout(FINAL_LIMIT, async {
        while shared.at_final.load(Ordering::Relaxed) < everyone {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    if all_final.is_err() {
        eprintln!(
            "mcp-load: {} of {everyone} clients at the final state after {FINAL_LIMIT:?}",
            shared.at_final.load(Ordering::Relaxed)
        );
    }

    // The churning and fresh clients leave; the residents stay, at rest.
    stop_churn.cancel();
    stop_fresh.cancel();
    let mut ended = Vec::new();
    for task in churn_tasks.into_iter().chain(fresh_tasks) {
        ended.push(task.await.context("a client task panicked")?);
    }
    let (at_rest_after, waited) = sample_at_rest(
        &gateway,
        residents as u64,
        Some(&at_rest_before),
        (churn_start, &shared, &made),
    )
    .await?;
    let exposition = gateway.metrics().await?;
    let stream_ends = crate::gateway::by_label(&exposition, mcp_xds_gateway::metrics::DOWNSTREAM_STREAM_ENDS, "reason");
    let closed_for_age = gauge(
        &exposition,
        mcp_xds_gateway::metrics::CONNECTIONS_CLOSED,
        "listener=\"--listen\",reason=\"max_age\"",
    )
    .unwrap_or(0.0) as u64;
    stop_residents.cancel();
    for task in resident_tasks {
        ended.push(task.await.context("a client task panicked")?);
    }
    gateway.stop().await;

    // The verdict.
    let mut verdict = Verdict::default();
    ended.sort_by_key(|(client, _)| client.id);
    for (client, connected) in &ended {
        if !connected {
            verdict.failures.push(format!(
                "client {} ({:?}) was not connected at the end",
                client.id, client.kind
            ));
            continue;
        }
        verdict.clients_checked += 1;
        match client.difference(&finals) {
            None => verdict.clients_at_final += 1,
            Some(difference) => verdict.failures.push(format!(
                "client {} ({:?}) does not hold the final state: {difference}",
                client.id, client.kind
            )),
        }
    }
    let errors = shared.counts.errors.load(Ordering::Relaxed);
    let said = std::mem::take(
        &mut *shared
            .counts
            .said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    verdict
        .failures
        .extend(said.iter().map(|e| format!("stream error: {e}")));
    if errors > said.len() as u64 {
        verdict
            .failures
            .push(format!("{} more stream errors", errors - said.len() as u64));
    }
    // Every stream the tool let go as ended by the maximum age, the gateway
    // closed so (one stream a connection).
    let max_age_ends = shared.counts.max_age_ends.load(Ordering::Relaxed);
    if max_age_ends > closed_for_age {
        verdict.failures.push(format!(
            "{max_age_ends} streams ended past their connection's maximum age, but the gateway closed \
             {closed_for_age} connections for it"
        ));
    }
    let nacks = publisher.nacks.load(Ordering::Relaxed);
    if nacks > 0 {
        verdict
            .failures
            .push(format!("the gateway NACKed {nacks} of the source's updates"));
    }
    let baseline_at = (soak.duration / 6).min(Duration::from_secs(600));
    let baseline = samples
        .iter()
        .find(|s| s.at_seconds >= baseline_at.as_secs_f64())
        .or(samples.last());
    if let (Some(baseline), Some(end)) = (baseline, samples.last()) {
        verdict.rss_baseline_at_seconds = baseline.at_seconds;
        verdict.rss_baseline_bytes = baseline.rss_bytes;
        verdict.rss_end_bytes = end.rss_bytes;
        verdict.rss_growth_percent =
            ((end.rss_bytes as f64 / baseline.rss_bytes.max(1) as f64 - 1.0) * 1000.0).round() / 10.0;
        verdict.rss_judged = soak.duration >= Duration::from_secs(600);
        if verdict.rss_judged && verdict.rss_growth_percent > RSS_GROWTH_LIMIT {
            verdict.failures.push(format!(
                "RSS grew {}% from {} at {}s to {} at the end (limit {RSS_GROWTH_LIMIT}%)",
                verdict.rss_growth_percent,
                mib(baseline.rss_bytes),
                baseline.at_seconds,
                mib(end.rss_bytes)
            ));
        }
    } else {
        verdict.failures.push("no sample was taken".into());
    }
    verdict.at_rest_after_seconds = (waited * 10.0).round() / 10.0;
    verdict.fds_growth = at_rest_after.open_fds as i64 - at_rest_before.open_fds as i64;
    verdict.tasks_growth = at_rest_after.tasks as i64 - at_rest_before.tasks as i64;
    if verdict.fds_growth > AT_REST_SLACK || verdict.tasks_growth > AT_REST_SLACK {
        verdict.failures.push(format!(
            "at rest with the {residents} residents, the gateway held {} descriptors and {} tasks after the churn, \
             {} and {} before it",
            at_rest_after.open_fds, at_rest_after.tasks, at_rest_before.open_fds, at_rest_before.tasks
        ));
    }
    verdict.passed = verdict.failures.is_empty();

    let counts = &shared.counts;
    let figures = SoakFigures {
        soak,
        residents,
        churning,
        fresh,
        kinds: KINDS.to_vec(),
        samples,
        at_rest_before,
        at_rest_after,
        updates_published: made.load(Ordering::Relaxed),
        sessions: counts.sessions.load(Ordering::Relaxed),
        sessions_resumed: counts.resumed.load(Ordering::Relaxed),
        leaves_closed: counts.closed.load(Ordering::Relaxed),
        leaves_cancelled: counts.cancelled.load(Ordering::Relaxed),
        responses: counts.responses.load(Ordering::Relaxed),
        nacks_sent: counts.nacks.load(Ordering::Relaxed),
        gateway_stream_ends: stream_ends,
        max_age_ends,
        gateway_max_age_closes: closed_for_age,
        verdict,
    };
    let peak_rss = figures.samples.iter().map(|s| s.rss_bytes).max();
    Ok(Report {
        shape: Some(shape),
        streams: shape.streams,
        updates_published: figures.updates_published as usize,
        responses_received: figures.responses as usize,
        gateway_peak_rss_bytes: peak_rss,
        config_bytes: shape.config_bytes(),
        nacks,
        stream_errors: errors as usize,
        client_max_frame_size: run.max_frame_size,
        soak: Some(figures),
        ..Default::default()
    })
}

impl SoakFigures {
    /// The printed table's rows.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        let v = &self.verdict;
        let mut rows = vec![
            ("duration", format!("{:?}", self.soak.duration)),
            (
                "clients resident / churning / fresh",
                format!("{} / {} / {}", self.residents, self.churning, self.fresh),
            ),
            ("samples", self.samples.len().to_string()),
            (
                "sessions (resumed)",
                format!("{} ({})", self.sessions, self.sessions_resumed),
            ),
            (
                "leaves closed / cancelled",
                format!("{} / {}", self.leaves_closed, self.leaves_cancelled),
            ),
            ("client NACKs sent", self.nacks_sent.to_string()),
            ("gateway stream ends", format!("{:?}", self.gateway_stream_ends)),
            (
                "ends at the maximum age (gateway's)",
                format!("{} ({})", self.max_age_ends, self.gateway_max_age_closes),
            ),
            (
                "clients at the final state",
                format!("{} of {}", v.clients_at_final, v.clients_checked),
            ),
            (
                "RSS baseline / end (growth)",
                format!(
                    "{} at {}s / {} ({}%{})",
                    mib(v.rss_baseline_bytes),
                    v.rss_baseline_at_seconds,
                    mib(v.rss_end_bytes),
                    v.rss_growth_percent,
                    if v.rss_judged { "" } else { ", not judged: under 10 min" }
                ),
            ),
            (
                "at rest: fds before / after",
                format!("{} / {}", self.at_rest_before.open_fds, self.at_rest_after.open_fds),
            ),
            (
                "at rest: tasks before / after",
                format!("{} / {}", self.at_rest_before.tasks, self.at_rest_after.tasks),
            ),
            (
                "at rest again after",
                format!("{} s", self.verdict.at_rest_after_seconds),
            ),
            ("verdict", if v.passed { "passed".into() } else { "FAILED".into() }),
        ];
        rows.extend(v.failures.iter().map(|f| ("failure", f.clone())));
        rows
    }
}
