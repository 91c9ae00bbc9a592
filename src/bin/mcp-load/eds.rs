//! The named fan-out scenario (`--scenario eds`): a collection of Envoy
//! ClusterLoadAssignments served as plain xDS, v3 clients each subscribed by
//! name to a random set of them (state of the world or delta, ACKing every
//! response as Envoy does), and a share of the resources changing at every
//! update.
//!
//! A client tells from each push which of its resources changed, by the
//! digest of each body against the one it holds; the publisher records when
//! it published each body. So the report counts the pushes that carried
//! nothing new for their client, and measures latency from each change at
//! the source to each client it reaches.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use mcp_xds_gateway::proto::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use mcp_xds_gateway::proto::{Metadata, Resource};
use mcp_xds_gateway::source::proto_json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::clients::{self, xds_node, Drive, Envelope, Holder, Progress, Watch, XDS_DELTA_PATH, XDS_SOTW_PATH};
use crate::publisher::{Catalog, Update};
use crate::reader::{length_delimited, XDS_DELTA_NAMED, XDS_SOTW_NAMED};
use crate::scenario::{ClientProtocol, NamedShape, Shape};
use crate::{run_phases, Report, Run, Sent};

/// The collection the gateway serves as Envoy's EDS.
pub const COLLECTION: &str = "envoy/config/endpoint/v3/clusterloadassignments";

/// Its type URL, each resource's body's.
pub const TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// A body's identity: what a client compares with what it holds, and the
/// publisher's key for when it was published.
pub fn digest(body: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(body)
}

/// A ClusterLoadAssignment of `endpoints` endpoints in one locality, at the
/// addresses of `serial` (each version of each resource gets addresses of its
/// own, as replaced pods get new IPs), encoded against Envoy's protos.
pub fn cluster_load_assignment(name: &str, serial: u64, endpoints: usize) -> Vec<u8> {
    let lb_endpoints: Vec<serde_json::Value> = (0..endpoints as u64)
        .map(|j| {
            let ip = (serial * endpoints as u64 + j) % (1 << 24);
            serde_json::json!({
                "endpoint": {"address": {"socket_address": {
                    "address": format!("10.{}.{}.{}", ip >> 16, (ip >> 8) & 255, ip & 255),
                    "port_value": 8080,
                }}},
                "health_status": "HEALTHY",
                "load_balancing_weight": 1,
            })
        })
        .collect();
    let assignment = serde_json::json!({
        "cluster_name": name,
        "endpoints": [{
            "locality": {"region": "us-east1", "zone": "us-east1-b"},
            "lb_endpoints": lb_endpoints,
        }],
    });
    proto_json::encode(TYPE_URL, assignment).expect("a ClusterLoadAssignment as Envoy's protos define it")
}

/// How many endpoints make a ClusterLoadAssignment of about `bytes` (at
/// least one).
pub fn endpoints_for(bytes: usize) -> usize {
    let one = cluster_load_assignment("cluster-00000", 1 << 20, 1).len();
    let each = cluster_load_assignment("cluster-00000", 1 << 20, 2).len() - one;
    1 + bytes.saturating_sub(one) / each
}

/// The resources' names: `cluster-00042`.
fn resource_names(resources: usize) -> Vec<Arc<str>> {
    let width = resources.saturating_sub(1).to_string().len().max(5);
    (0..resources).map(|i| format!("cluster-{i:0width$}").into()).collect()
}

/// Draws `k` of `pool` at random into its first `k` places (a partial
/// Fisher-Yates shuffle: the rest of `pool` stays a permutation).
fn draw<'a>(pool: &'a mut [u32], k: usize, rng: &mut fastrand::Rng) -> &'a [u32] {
    for j in 0..k {
        let pick = rng.usize(j..pool.len());
        pool.swap(j, pick);
    }
    &pool[..k]
}

/// Which clients ask for which resources, and which resources change.
pub struct Subscriptions {
    /// Each client's resources (indices into the names), sorted.
    pub of_client: Vec<Vec<u32>>,
    /// The resources the updates change.
    pub changing: Vec<u32>,
    /// The clients whose names change (the first ones): all of them, or
    /// with disjoint sets the first half; the rest are bystanders.
    pub changing_clients: usize,
}

impl Subscriptions {
    /// `clients` random sets of `named.names_per_client` of `resources`,
    /// from `named.seed`; disjoint where `named.disjoint` (the caller checked
    /// that they fit).
    pub fn draw(resources: usize, clients: usize, named: &NamedShape) -> Self {
        let k = named.names_per_client;
        let mut rng = fastrand::Rng::with_seed(named.seed);
        let mut pool: Vec<u32> = (0..resources as u32).collect();
        let sorted = |mut names: Vec<u32>| {
            names.sort_unstable();
            names
        };
        if named.disjoint {
            rng.shuffle(&mut pool);
            let changing_clients = clients.div_ceil(2);
            return Self {
                of_client: pool.chunks(k).take(clients).map(|c| sorted(c.to_vec())).collect(),
                changing: pool[..changing_clients * k].to_vec(),
                changing_clients,
            };
        }
        let of_client = (0..clients)
            .map(|_| sorted(draw(&mut pool, k, &mut rng).to_vec()))
            .collect();
        Self {
            of_client,
            changing: (0..resources as u32).collect(),
            changing_clients: clients,
        }
    }
}

// === impl Endpoints ===

/// The catalog: the ClusterLoadAssignments, each update changing
/// `changes_per_update` of the changing ones drawn at random (new endpoint
/// addresses, the version counter + 1).
pub struct Endpoints {
    names: Arc<[Arc<str>]>,
    index: HashMap<Arc<str>, u32>,
    bodies: Vec<Vec<u8>>,
    versions: Vec<u64>,
    endpoints: usize,
    /// The addresses of the next body made.
    serial: u64,
    /// The resources that change, drawn from in place.
    changing: Vec<u32>,
    changes_per_update: usize,
    incremental: bool,
    rng: fastrand::Rng,
    /// (resource, body digest) → when the source published it.
    pub published: HashMap<(u32, u64), Instant>,
}

impl Endpoints {
    pub fn new(shape: &Shape, named: &NamedShape, changing: Vec<u32>) -> Self {
        let names: Arc<[Arc<str>]> = resource_names(shape.resources).into();
        let endpoints = endpoints_for(shape.body_bytes);
        let bodies = names
            .iter()
            .enumerate()
            .map(|(i, name)| cluster_load_assignment(name, i as u64, endpoints))
            .collect();
        Self {
            index: names.iter().enumerate().map(|(i, n)| (n.clone(), i as u32)).collect(),
            bodies,
            versions: vec![1; names.len()],
            endpoints,
            serial: names.len() as u64,
            changes_per_update: shape.changes_per_update.min(changing.len()),
            changing,
            incremental: shape.upstream_incremental,
            // The changes' own sequence, so that they do not depend on how
            // many draws the subscriptions took.
            rng: fastrand::Rng::with_seed(named.seed.rotate_left(32) ^ 0x5eed),
            names,
            published: HashMap::new(),
        }
    }

    fn resource(&self, i: u32) -> Resource {
        let i = i as usize;
        Resource {
            metadata: Some(Metadata {
                name: self.names[i].to_string(),
                version: self.versions[i].to_string(),
                ..Default::default()
            }),
            body: Some(prost_types::Any {
                type_url: TYPE_URL.into(),
                value: self.bodies[i].clone(),
            }),
        }
    }

    /// The resources' names, in their order.
    pub fn names(&self) -> Arc<[Arc<str>]> {
        self.names.clone()
    }

    /// Each resource's final body digest.
    pub fn finals(&self) -> Arc<[u64]> {
        self.bodies.iter().map(|b| digest(b)).collect()
    }

    /// The bodies' bytes.
    pub fn config_bytes(&self) -> usize {
        self.bodies.iter().map(Vec::len).sum()
    }
}

impl Catalog for Endpoints {
    fn full_state(&self, collection: &str) -> Option<Vec<Resource>> {
        (collection == COLLECTION).then(|| (0..self.names.len() as u32).map(|i| self.resource(i)).collect())
    }

    fn next_update(&mut self, _update: usize) -> Update {
        let changed = draw(&mut self.changing, self.changes_per_update, &mut self.rng).to_vec();
        for &i in &changed {
            let i = i as usize;
            self.bodies[i] = cluster_load_assignment(&self.names[i], self.serial, self.endpoints);
            self.serial += 1;
            self.versions[i] += 1;
        }
        let resources = if self.incremental {
            changed.iter().map(|&i| self.resource(i)).collect()
        } else {
            self.full_state(COLLECTION).expect("the catalog's collection")
        };
        Update {
            collection: COLLECTION.to_owned(),
            resources,
            incremental: self.incremental,
            removed: Vec::new(),
        }
    }

    fn published(&mut self, _collection: &str, resources: &[Resource], at: Instant) {
        for resource in resources {
            let name = resource.metadata.as_ref().map_or("", |m| m.name.as_str());
            let body = resource.body.as_ref().map_or(&[][..], |b| &b.value[..]);
            if let Some(&i) = self.index.get(name) {
                self.published.entry((i, digest(body))).or_insert(at);
            }
        }
    }
}

// === impl Named ===

/// A push a client received: when, its size, how many resources it carried
/// and how many of them were new to the client (changed, added or removed).
#[derive(Clone, Copy, Debug)]
struct Push {
    at: Instant,
    bytes: usize,
    resources: u32,
    changed: u32,
}

/// A resource a client received at content new to it.
#[derive(Clone, Copy, Debug)]
struct Delivery {
    at: Instant,
    resource: u32,
    digest: u64,
}

/// A named client: what it subscribed to, the body digest of each resource
/// it holds, and every push and change it received.
pub struct Named {
    stream: usize,
    delta: bool,
    /// Name → its place in `resources` and `held`.
    slots: HashMap<Arc<str>, usize>,
    resources: Vec<u32>,
    held: Vec<Option<u64>>,
    holding: usize,
    pushes: Vec<Push>,
    deliveries: Vec<Delivery>,
    /// Resources received that the client did not ask for.
    not_subscribed: u64,
    /// Delta: the version of each resource held, as the gateway named it;
    /// state of the world: the last response's `version_info`. What the
    /// client reports when it reconnects, as Envoy does.
    versions: Vec<Option<String>>,
    version_info: String,
    /// Bytes of resources received at a content the client already held.
    pub bytes_already_held: u64,
}

impl Named {
    pub fn new(stream: usize, delta: bool, names: &[Arc<str>], resources: Vec<u32>) -> Self {
        Self {
            stream,
            delta,
            slots: resources
                .iter()
                .enumerate()
                .map(|(slot, &r)| (names[r as usize].clone(), slot))
                .collect(),
            held: vec![None; resources.len()],
            versions: vec![None; resources.len()],
            resources,
            holding: 0,
            pushes: Vec::new(),
            deliveries: Vec::new(),
            not_subscribed: 0,
            version_info: String::new(),
            bytes_already_held: 0,
        }
    }

    pub fn stream(&self) -> usize {
        self.stream
    }

    /// What the client reports when it opens its stream again: delta, the
    /// version of each resource it holds (`initial_resource_versions`);
    /// state of the world, the last `version_info`.
    pub fn resume(&self, names: &[Arc<str>]) -> Resume {
        let versions = self
            .resources
            .iter()
            .zip(&self.versions)
            .filter_map(|(&r, version)| Some((names[r as usize].to_string(), version.clone()?)))
            .collect();
        Resume {
            versions,
            version_info: self.version_info.clone(),
        }
    }
}

/// What a reconnecting client tells the gateway it holds.
#[derive(Debug, Default)]
pub struct Resume {
    pub versions: HashMap<String, String>,
    pub version_info: String,
}

/// The ClusterLoadAssignment in an `Any`.
fn assignment(any: &[u8]) -> anyhow::Result<&[u8]> {
    let type_url = length_delimited(any, 1)?.unwrap_or_default();
    if type_url != TYPE_URL.as_bytes() {
        anyhow::bail!("a resource of type {:?}", String::from_utf8_lossy(type_url));
    }
    Ok(length_delimited(any, 2)?.unwrap_or_default())
}

/// A state-of-the-world resource (an `Any`): its name (the assignment's
/// `cluster_name`, as Envoy reads it) and body.
fn sotw_resource(any: &[u8]) -> anyhow::Result<(&str, &[u8])> {
    let body = assignment(any)?;
    let name = length_delimited(body, 1)?.unwrap_or_default();
    Ok((std::str::from_utf8(name)?, body))
}

/// A delta `Resource`: its name and body.
fn delta_resource(resource: &[u8]) -> anyhow::Result<(&str, &[u8])> {
    let name = length_delimited(resource, 3)?.unwrap_or_default();
    let any = length_delimited(resource, 2)?.ok_or_else(|| anyhow::anyhow!("a delta resource without a body"))?;
    Ok((std::str::from_utf8(name)?, assignment(any)?))
}

/// A delta `Resource`'s version (field 1).
fn delta_version(resource: &[u8]) -> anyhow::Result<String> {
    let version = length_delimited(resource, 1)?.unwrap_or_default();
    Ok(std::str::from_utf8(version)?.to_owned())
}

impl Holder for Named {
    /// Each resource's final body digest.
    type Finals = Arc<[u64]>;

    fn on_response(&mut self, envelope: Envelope, bytes: usize, at: Instant) -> anyhow::Result<()> {
        let mut changed = 0;
        for resource in &envelope.resources {
            let (name, body) = if self.delta {
                delta_resource(resource)?
            } else {
                sotw_resource(resource)?
            };
            let Some(&slot) = self.slots.get(name) else {
                self.not_subscribed += 1;
                continue;
            };
            if self.delta {
                self.versions[slot] = Some(delta_version(resource)?);
            }
            let digest = digest(body);
            if self.held[slot] == Some(digest) {
                self.bytes_already_held += resource.len() as u64;
            } else {
                if self.held[slot].replace(digest).is_none() {
                    self.holding += 1;
                }
                changed += 1;
                self.deliveries.push(Delivery {
                    at,
                    resource: self.resources[slot],
                    digest,
                });
            }
        }
        for name in &envelope.removed {
            let slot = self.slots.get(std::str::from_utf8(name)?).copied();
            if let Some(slot) = slot.filter(|&s| self.held[s].is_some()) {
                self.held[slot] = None;
                self.versions[slot] = None;
                self.holding -= 1;
                changed += 1;
            }
        }
        self.pushes.push(Push {
            at,
            bytes,
            resources: envelope.resources.len() as u32,
            changed,
        });
        if !self.delta {
            self.version_info = envelope.version;
        }
        Ok(())
    }

    fn synced(&self) -> bool {
        self.holding == self.held.len()
    }

    fn at_final(&self, finals: &Self::Finals) -> bool {
        self.held
            .iter()
            .zip(&self.resources)
            .all(|(held, &r)| *held == Some(finals[r as usize]))
    }
}

/// One named client as Envoy's EDS is (see [`drive_named`]), from a fresh
/// start.
async fn named_stream(
    mut client: Named,
    channel: Channel,
    names: Vec<String>,
    finals: watch::Receiver<Option<Arc<[u64]>>>,
    progress: Arc<Progress>,
    stop: CancellationToken,
) -> Option<Named> {
    let (index, delta) = (client.stream, client.delta);
    let watch = Watch {
        finals,
        progress: &progress,
        stop,
    };
    let result = drive_named((index, delta), names, None, channel, &mut client, watch).await;
    clients::kept(index, &progress, result.map(|()| client))
}

/// Drives one named client's stream as Envoy's EDS does: state of the world
/// (`resource_names` on every request, each response ACKed with its version
/// and nonce) or delta (`resource_names_subscribe` once, each response ACKed
/// by nonce). With `resume`, the stream is opened again after a restart, as
/// Envoy opens it: delta with `initial_resource_versions`, state of the
/// world with its last `version_info`.
pub async fn drive_named<H: Holder>(
    (index, delta): (usize, bool),
    names: Vec<String>,
    resume: Option<Resume>,
    channel: Channel,
    holder: &mut H,
    watch: Watch<'_, H::Finals>,
) -> anyhow::Result<()> {
    let resume = resume.unwrap_or_default();
    if delta {
        let request = |nonce: &str| DeltaDiscoveryRequest {
            node: nonce.is_empty().then(|| xds_node(index)).flatten(),
            type_url: TYPE_URL.into(),
            resource_names_subscribe: if nonce.is_empty() { names.clone() } else { Vec::new() },
            response_nonce: nonce.into(),
            ..Default::default()
        };
        let drive = Drive {
            path: XDS_DELTA_PATH,
            fields: XDS_DELTA_NAMED,
            initial: vec![DeltaDiscoveryRequest {
                initial_resource_versions: resume.versions,
                ..request("")
            }],
        };
        drive
            .run_on(channel, |e: &Envelope| request(&e.nonce), holder, watch)
            .await
    } else {
        let request = |version: &str, nonce: &str| DiscoveryRequest {
            node: nonce.is_empty().then(|| xds_node(index)).flatten(),
            version_info: version.into(),
            resource_names: names.clone(),
            type_url: TYPE_URL.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        };
        let drive = Drive {
            path: XDS_SOTW_PATH,
            fields: XDS_SOTW_NAMED,
            initial: vec![request(&resume.version_info, "")],
        };
        drive
            .run_on(channel, |e: &Envelope| request(&e.version, &e.nonce), holder, watch)
            .await
    }
}

// === the run ===

/// The named scenario's own figures.
#[derive(Debug, Default, serde::Serialize)]
pub struct NamedFigures {
    pub names_per_client: usize,
    pub change_percent: f64,
    /// Resources changed at each update (of the changing ones).
    pub changes_per_update: usize,
    pub seed: u64,
    pub disjoint: bool,
    /// The mean encoded ClusterLoadAssignment, and its endpoints.
    pub resource_bytes: f64,
    pub endpoints_per_resource: usize,
    /// From the first update until every client held the final state.
    pub update_phase_seconds: f64,
    /// Responses the clients received in that phase, and per client per
    /// update (interval).
    pub pushes: u64,
    pub responses_per_client_per_interval: f64,
    pub bytes_per_client_per_interval: f64,
    /// Resources those responses carried, and those new to their client.
    pub resources_delivered: u64,
    pub resources_delivered_per_second: f64,
    pub changes_delivered: u64,
    pub changes_delivered_per_second: f64,
    /// Pushes none of whose resources was new to the client (goal: 0).
    pub pushes_without_change: u64,
    pub pushes_without_change_fraction: f64,
    /// Resources a client received and had not asked for (must be 0).
    pub resources_not_subscribed: u64,
    /// Changes delivered whose body the source never published (must be 0:
    /// otherwise the latency above misses them).
    pub changes_never_published: u64,
    /// Gateway RSS with every client synced and idle, less before the first
    /// client: per client and per subscribed name.
    pub gateway_rss_per_client_bytes: f64,
    /// The same at rest (`--rest` after the sync).
    pub gateway_rss_per_client_at_rest_bytes: Option<f64>,
    pub gateway_rss_per_subscribed_name_bytes: f64,
    /// With --eds-disjoint: the clients none of whose names change, and the
    /// responses and bytes they received while the others' changed (goal: 0).
    pub bystanders: Option<usize>,
    pub bystander_responses: Option<u64>,
    pub bystander_bytes: Option<u64>,
}

impl NamedFigures {
    /// The printed table's rows.
    pub fn rows(&self) -> Vec<(&'static str, String)> {
        let mut rows = vec![
            (
                "names per client / change per update",
                format!(
                    "{} / {} % ({} resources){}",
                    self.names_per_client,
                    self.change_percent,
                    self.changes_per_update,
                    if self.disjoint { ", disjoint sets" } else { "" }
                ),
            ),
            (
                "resource bytes (endpoints)",
                format!("{:.0} ({})", self.resource_bytes, self.endpoints_per_resource),
            ),
            (
                "responses per client per interval",
                format!("{:.3}", self.responses_per_client_per_interval),
            ),
            (
                "bytes per client per interval",
                format!("{:.0}", self.bytes_per_client_per_interval),
            ),
            (
                "resources delivered per second",
                format!(
                    "{:.0} ({:.0} of them changes)",
                    self.resources_delivered_per_second, self.changes_delivered_per_second
                ),
            ),
            (
                "pushes without a change",
                format!(
                    "{} of {} ({:.4})",
                    self.pushes_without_change, self.pushes, self.pushes_without_change_fraction
                ),
            ),
            ("resources not asked for", self.resources_not_subscribed.to_string()),
            ("changes never published", self.changes_never_published.to_string()),
            (
                "gateway RSS per client / per name",
                format!(
                    "{:.1} KiB / {:.0} B",
                    self.gateway_rss_per_client_bytes / 1024.0,
                    self.gateway_rss_per_subscribed_name_bytes
                ),
            ),
            (
                "gateway RSS per client at rest",
                self.gateway_rss_per_client_at_rest_bytes
                    .map_or_else(|| "-".to_owned(), |b| format!("{:.1} KiB", b / 1024.0)),
            ),
        ];
        if let (Some(clients), Some(responses), Some(bytes)) =
            (self.bystanders, self.bystander_responses, self.bystander_bytes)
        {
            rows.push((
                "bystanders: responses / bytes",
                format!("{clients} clients: {responses} / {bytes}"),
            ));
        }
        rows
    }
}

/// Runs the named scenario against a child gateway (a chain of them with
/// `run.chain`).
pub async fn run(binary: &Path, shape: Shape, named: NamedShape, run: Run) -> anyhow::Result<Report> {
    let subscriptions = Subscriptions::draw(shape.resources, shape.streams, &named);
    let catalog = Endpoints::new(&shape, &named, subscriptions.changing.clone());
    let (names, config_bytes) = (catalog.names.clone(), catalog.config_bytes());
    let (changes_per_update, endpoints) = (catalog.changes_per_update, catalog.endpoints);
    let delta = shape.protocol == ClientProtocol::XdsDelta;
    let of_client = &subscriptions.of_client;
    let (phases, publisher) = run_phases(
        binary,
        &shape,
        &[COLLECTION.to_owned()],
        &run,
        catalog,
        Endpoints::finals,
        |i, channel, finals, progress, stop| {
            let client = Named::new(i, delta, &names, of_client[i].clone());
            let asked = of_client[i].iter().map(|&r| names[r as usize].to_string()).collect();
            named_stream(client, channel, asked, finals, progress, stop)
        },
    )
    .await?;
    let update_start = phases.update_start;

    let bystander = |client: &Named| named.disjoint && client.stream >= subscriptions.changing_clients;
    let mut figures = NamedFigures {
        names_per_client: named.names_per_client,
        change_percent: named.change_percent,
        changes_per_update,
        seed: named.seed,
        disjoint: named.disjoint,
        resource_bytes: config_bytes as f64 / shape.resources.max(1) as f64,
        endpoints_per_resource: endpoints,
        update_phase_seconds: phases.update_phase.as_secs_f64(),
        bystanders: named.disjoint.then(|| shape.streams - subscriptions.changing_clients),
        bystander_responses: named.disjoint.then_some(0),
        bystander_bytes: named.disjoint.then_some(0),
        ..Default::default()
    };
    let mut sent = Vec::new();
    let mut latencies = Vec::new();
    publisher
        .read(|catalog| {
            for client in phases.kept.iter().flatten() {
                figures.resources_not_subscribed += client.not_subscribed;
                for push in client.pushes.iter().filter(|p| p.at >= update_start) {
                    figures.pushes += 1;
                    figures.resources_delivered += u64::from(push.resources);
                    figures.changes_delivered += u64::from(push.changed);
                    figures.pushes_without_change += u64::from(push.changed == 0);
                    if bystander(client) {
                        *figures.bystander_responses.get_or_insert(0) += 1;
                        *figures.bystander_bytes.get_or_insert(0) += push.bytes as u64;
                    }
                    sent.push(Sent {
                        at: push.at,
                        stream: client.stream,
                        bytes: push.bytes,
                    });
                }
                for delivery in client.deliveries.iter().filter(|d| d.at >= update_start) {
                    match catalog.published.get(&(delivery.resource, delivery.digest)) {
                        Some(at) if *at >= update_start => latencies.push(delivery.at.saturating_duration_since(*at)),
                        Some(_) => {}
                        None => figures.changes_never_published += 1,
                    }
                }
            }
        })
        .await;
    // The responses' records as the cache holds them: one of the
    // collection's mean size, anywhere in it.
    let scattered = crate::wire::Source::Scattered {
        record: config_bytes / shape.resources.max(1),
        pool: config_bytes,
    };
    let mut report = phases.report(shape, &run, latencies, sent, Some(scattered)).await?;

    let client_intervals = (shape.streams * shape.updates.max(1)) as f64;
    let seconds = phases.update_phase.as_secs_f64().max(f64::EPSILON);
    figures.responses_per_client_per_interval = figures.pushes as f64 / client_intervals;
    figures.bytes_per_client_per_interval = report.bytes_per_client_per_update;
    figures.resources_delivered_per_second = figures.resources_delivered as f64 / seconds;
    figures.changes_delivered_per_second = figures.changes_delivered as f64 / seconds;
    figures.pushes_without_change_fraction = if figures.pushes > 0 {
        figures.pushes_without_change as f64 / figures.pushes as f64
    } else {
        0.0
    };
    let rss_per_client = phases.rss_per_stream(shape.streams);
    figures.gateway_rss_per_client_bytes = rss_per_client;
    figures.gateway_rss_per_client_at_rest_bytes = phases.rss_per_stream_at_rest(shape.streams);
    figures.gateway_rss_per_subscribed_name_bytes = rss_per_client / named.names_per_client.max(1) as f64;
    report.config_bytes = config_bytes;
    report.eds = Some(figures);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mcp_xds_gateway::proto::envoy::service::discovery::v3::Resource as DeltaResource;
    use mcp_xds_gateway::source::proto_json::BodyDecoder;

    #[test]
    fn bodies_are_envoy_cluster_load_assignments_of_about_the_size_asked() {
        let endpoints = endpoints_for(400);
        let body = cluster_load_assignment("cluster-00042", 7, endpoints);
        assert!((350..=450).contains(&body.len()), "{} bytes", body.len());
        let json = BodyDecoder::new(None).unwrap().decode(TYPE_URL, &body).unwrap();
        assert_eq!(json["clusterName"], "cluster-00042");
        let lb = json["endpoints"][0]["lbEndpoints"].as_array().unwrap();
        assert_eq!(lb.len(), endpoints);
        assert_eq!(lb[0]["endpoint"]["address"]["socketAddress"]["portValue"], 8080);
        // Each version has addresses of its own.
        assert_ne!(body, cluster_load_assignment("cluster-00042", 8, endpoints));
        assert_eq!(endpoints_for(0), 1);
    }

    #[test]
    fn names_sort_as_their_numbers() {
        let names = resource_names(12);
        assert_eq!(&*names[3], "cluster-00003");
        assert_eq!(&*resource_names(200_000)[42], "cluster-000042");
    }

    fn named(k: usize, disjoint: bool) -> NamedShape {
        NamedShape {
            names_per_client: k,
            change_percent: 1.0,
            seed: 9,
            disjoint,
        }
    }

    #[test]
    fn subscriptions_are_seeded_and_distinct_per_client() {
        let a = Subscriptions::draw(1000, 50, &named(20, false));
        let b = Subscriptions::draw(1000, 50, &named(20, false));
        assert_eq!(a.of_client, b.of_client, "the same seed draws the same sets");
        for names in &a.of_client {
            assert_eq!(names.len(), 20);
            assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted, no repeat: {names:?}");
            assert!(names.iter().all(|&n| n < 1000));
        }
        assert_ne!(a.of_client[0], a.of_client[1]);
        assert_eq!((a.changing.len(), a.changing_clients), (1000, 50));
        let other = Subscriptions::draw(
            1000,
            50,
            &NamedShape {
                seed: 10,
                ..named(20, false)
            },
        );
        assert_ne!(a.of_client, other.of_client);
    }

    #[test]
    fn disjoint_sets_share_no_name_and_only_the_first_half_change() {
        let s = Subscriptions::draw(100, 9, &named(10, true));
        let mut all: Vec<u32> = s.of_client.iter().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 90, "no name in two sets");
        assert_eq!(s.changing_clients, 5);
        let mut changing = s.changing.clone();
        changing.sort_unstable();
        let mut firsts: Vec<u32> = s.of_client[..5].iter().flatten().copied().collect();
        firsts.sort_unstable();
        assert_eq!(changing, firsts);
    }

    fn shape(resources: usize) -> Shape {
        Shape {
            resources,
            body_bytes: 100,
            changes_per_update: 3,
            ..crate::scenario::Scenario::Eds.shape()
        }
    }

    #[test]
    fn an_update_changes_its_share_of_the_changing_resources_and_logs_them() {
        let mut catalog = Endpoints::new(&shape(30), &named(4, false), vec![1, 2, 3, 4, 5]);
        let before = catalog.finals();
        let update = catalog.next_update(0);
        assert!(update.incremental);
        assert_eq!(update.resources.len(), 3);
        let at = Instant::now();
        catalog.published(COLLECTION, &update.resources, at);
        let after = catalog.finals();
        for resource in &update.resources {
            let name = &resource.metadata.as_ref().unwrap().name;
            let i = catalog.index[name.as_str()];
            assert!((1..=5).contains(&i), "{name} is not one of the changing ones");
            assert_eq!(resource.metadata.as_ref().unwrap().version, "2");
            assert_ne!(before[i as usize], after[i as usize]);
            assert_eq!(catalog.published.get(&(i, after[i as usize])), Some(&at));
        }
        let unchanged = (0..30).filter(|i| before[*i] == after[*i]).count();
        assert_eq!(unchanged, 27);
        assert_eq!(catalog.full_state(COLLECTION).unwrap().len(), 30);
        assert!(catalog.full_state("other").is_none());
    }

    fn any(body: &[u8]) -> prost_types::Any {
        prost_types::Any {
            type_url: TYPE_URL.into(),
            value: body.to_vec(),
        }
    }

    fn envelope(resources: Vec<Vec<u8>>, removed: &[&str]) -> Envelope {
        Envelope {
            resources: resources.into_iter().map(Bytes::from).collect(),
            removed: removed.iter().map(|r| Bytes::from(r.to_string())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_sotw_client_counts_what_is_new_to_it() {
        let names = resource_names(4);
        let mut client = Named::new(0, false, &names, vec![1, 2]);
        let (a1, b1, a2) = (
            cluster_load_assignment(&names[1], 1, 2),
            cluster_load_assignment(&names[2], 2, 2),
            cluster_load_assignment(&names[1], 3, 2),
        );
        let sotw = |bodies: &[&Vec<u8>]| {
            envelope(
                bodies.iter().map(|b| prost::Message::encode_to_vec(&any(b))).collect(),
                &[],
            )
        };
        let at = Instant::now();
        client.on_response(sotw(&[&a1]), 10, at).unwrap();
        assert!(!client.synced());
        client.on_response(sotw(&[&a1, &b1]), 20, at).unwrap();
        assert!(client.synced());
        client.on_response(sotw(&[&a1, &b1]), 20, at).unwrap();
        client.on_response(sotw(&[&a2, &b1]), 20, at).unwrap();
        let changed: Vec<u32> = client.pushes.iter().map(|p| p.changed).collect();
        assert_eq!(changed, [1, 1, 0, 1]);
        assert_eq!(client.deliveries.len(), 3);
        assert_eq!(client.deliveries[2].resource, 1);
        assert_eq!(client.deliveries[2].digest, digest(&a2));
        let finals: Arc<[u64]> = vec![0, digest(&a2), digest(&b1), 0].into();
        assert!(client.at_final(&finals));
        // Another client's resource.
        let other = cluster_load_assignment(&names[3], 4, 2);
        client.on_response(sotw(&[&other]), 5, at).unwrap();
        assert_eq!(client.not_subscribed, 1);
        // Not a ClusterLoadAssignment.
        let wrong = prost::Message::encode_to_vec(&prost_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: Vec::new(),
        });
        assert!(client.on_response(envelope(vec![wrong], &[]), 5, at).is_err());
    }

    #[test]
    fn a_delta_client_reads_names_from_the_resource_and_counts_removals() {
        let names = resource_names(3);
        let mut client = Named::new(0, true, &names, vec![0, 2]);
        let delta = |i: usize, serial: u64| {
            prost::Message::encode_to_vec(&DeltaResource {
                name: names[i].to_string(),
                version: "whatever".into(),
                resource: Some(any(&cluster_load_assignment(&names[i], serial, 1))),
                ..Default::default()
            })
        };
        let at = Instant::now();
        client
            .on_response(envelope(vec![delta(0, 1), delta(2, 2)], &[]), 1, at)
            .unwrap();
        assert!(client.synced());
        client
            .on_response(envelope(vec![], &["cluster-00002", "cluster-00001"]), 1, at)
            .unwrap();
        assert!(!client.synced());
        let changed: Vec<u32> = client.pushes.iter().map(|p| p.changed).collect();
        assert_eq!(changed, [2, 1]);
        let bodiless = prost::Message::encode_to_vec(&DeltaResource {
            name: names[0].to_string(),
            ..Default::default()
        });
        assert!(client.on_response(envelope(vec![bodiless], &[]), 1, at).is_err());
    }
}
