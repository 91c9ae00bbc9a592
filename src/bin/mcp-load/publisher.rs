//! The publisher on the shared fake Galley (`tools::galley`, the tests' own):
//! it publishes what a [`Catalog`] holds (every collection's full state when
//! the gateway asks, then one update per tick) and the catalog records when
//! each state was published, so clients' receive times turn into end-to-end
//! latencies.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mcp_xds_gateway::cache::{content_digest, version_of_entries};
use mcp_xds_gateway::proto::{Metadata, RequestResources, Resource, Resources};
use mcp_xds_gateway::tools::galley::{FakeGalley, GalleyStream};
use tokio::sync::{mpsc, watch, Mutex as AsyncMutex};
use tokio::time::Instant;
use tonic::Status;

use crate::scenario::Shape;

/// What a publisher publishes, and its record of when.
pub trait Catalog: Send + 'static {
    /// The full state of `collection`; `None` where it is not published.
    fn full_state(&self, collection: &str) -> Option<Vec<Resource>>;
    /// Makes update number `update` (counting from 0).
    fn next_update(&mut self, update: usize) -> Update;
    /// Records that `resources` of `collection` (a full state or an update)
    /// were handed to the gateway's stream at `at`.
    fn published(&mut self, collection: &str, resources: &[Resource], at: Instant);
}

/// One update of one collection.
pub struct Update {
    pub collection: String,
    pub resources: Vec<Resource>,
    /// Only what changed (else the collection's full state).
    pub incremental: bool,
    /// Names removed (an incremental update only).
    pub removed: Vec<String>,
}

pub struct Publisher<C> {
    pub addr: SocketAddr,
    /// NACKs the gateway sent (a correct run has none).
    pub nacks: Arc<AtomicUsize>,
    catalog: Arc<AsyncMutex<C>>,
    /// The live stream to the gateway: sends, and ACK nonces back.
    stream: watch::Receiver<Option<Arc<Link>>>,
    shape: Shape,
}

struct Link {
    tx: mpsc::UnboundedSender<Result<Resources, Status>>,
    acks: AsyncMutex<mpsc::Receiver<RequestResources>>,
}

/// Serves one stream the gateway opened: the full state of each collection it
/// asks for, and its ACKs handed to the updater.
async fn serve<C: Catalog>(
    mut stream: GalleyStream,
    catalog: Arc<AsyncMutex<C>>,
    nacks: Arc<AtomicUsize>,
    publish: watch::Sender<Option<Arc<Link>>>,
) {
    let (acks_tx, acks_rx) = mpsc::channel(1024);
    let link = Arc::new(Link {
        tx: stream.responses.clone(),
        acks: AsyncMutex::new(acks_rx),
    });
    let mut initial = 0;
    while let Some(request) = stream.next_request().await {
        if let Some(error) = &request.error_detail {
            nacks.fetch_add(1, Ordering::Relaxed);
            eprintln!("mcp-load: the gateway NACKed {}: {}", request.collection, error.message);
        }
        if !request.response_nonce.is_empty() {
            let _ = acks_tx.send(request).await;
            continue;
        }
        // An initial request: publish the collection's full state.
        let mut catalog = catalog.lock().await;
        if let Some(resources) = catalog.full_state(&request.collection) {
            catalog.published(&request.collection, &resources, Instant::now());
            drop(catalog);
            let message = Resources {
                nonce: format!("init-{}", request.collection),
                collection: request.collection,
                resources,
                incremental: false,
                ..Default::default()
            };
            let _ = link.tx.send(Ok(message));
            initial += 1;
        }
        if initial == 1 {
            publish.send_replace(Some(link.clone()));
        }
    }
}

// === impl Publisher ===

impl<C: Catalog> Publisher<C> {
    pub async fn start(shape: Shape, catalog: C) -> anyhow::Result<Self> {
        let mut galley = FakeGalley::start("127.0.0.1:0".parse()?).await?;
        let addr = galley.addr;
        let catalog = Arc::new(AsyncMutex::new(catalog));
        let nacks = Arc::new(AtomicUsize::new(0));
        let (link_tx, link_rx) = watch::channel(None);
        let serving = (catalog.clone(), nacks.clone());
        tokio::spawn(async move {
            // Every stream the gateway opens (it reconnects after a failure).
            while let Some(stream) = galley.next_stream().await {
                tokio::spawn(serve(stream, serving.0.clone(), serving.1.clone(), link_tx.clone()));
            }
        });
        Ok(Self {
            addr,
            nacks,
            catalog,
            stream: link_rx,
            shape,
        })
    }

    /// Waits for the gateway's stream and its ACK of every initial state.
    pub async fn wait_initial_acks(&mut self, collections: usize) -> anyhow::Result<()> {
        let link = self.link().await?;
        let mut acks = link.acks.lock().await;
        for _ in 0..collections {
            acks.recv()
                .await
                .ok_or_else(|| anyhow::anyhow!("the gateway closed the stream"))?;
        }
        Ok(())
    }

    async fn link(&mut self) -> anyhow::Result<Arc<Link>> {
        let link = self
            .stream
            .wait_for(Option::is_some)
            .await
            .map_err(|_| anyhow::anyhow!("the fake galley stopped"))?;
        Ok(link.clone().expect("waited for Some"))
    }

    /// Reads the catalog (its record of what was published, its final state).
    pub async fn read<R>(&self, read: impl FnOnce(&C) -> R) -> R {
        read(&*self.catalog.lock().await)
    }

    /// Changes the catalog (the soak's end: what it publishes next).
    pub async fn write<R>(&self, write: impl FnOnce(&mut C) -> R) -> R {
        write(&mut *self.catalog.lock().await)
    }

    /// Publishes `shape.updates` updates, one per tick of
    /// `shape.update_interval`, and waits for each ACK (one outstanding
    /// update, as Galley does).
    pub async fn run_updates(&mut self) -> anyhow::Result<()> {
        self.publish(0..self.shape.updates, None).await.map(|_| ())
    }

    /// Publishes the updates numbered `numbers`, one per tick of
    /// `shape.update_interval`, each ACKed before the next, stopping at
    /// `until`; returns how many it published.
    pub async fn publish(
        &mut self,
        numbers: impl Iterator<Item = usize>,
        until: Option<Instant>,
    ) -> anyhow::Result<usize> {
        let link = self.link().await?;
        let mut ticker = tokio::time::interval(self.shape.update_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut published = 0;
        for update in numbers {
            ticker.tick().await;
            if until.is_some_and(|until| Instant::now() >= until) {
                break;
            }
            published += 1;
            let mut catalog = self.catalog.lock().await;
            let Update {
                collection,
                resources,
                incremental,
                removed,
            } = catalog.next_update(update);
            catalog.published(&collection, &resources, Instant::now());
            drop(catalog);
            let message = Resources {
                collection,
                resources,
                removed_resources: removed,
                nonce: format!("u{update}"),
                incremental,
                ..Default::default()
            };
            link.tx
                .send(Ok(message))
                .map_err(|_| anyhow::anyhow!("the gateway closed the stream"))?;
            let ack = tokio::time::timeout(Duration::from_secs(60), async { link.acks.lock().await.recv().await })
                .await
                .map_err(|_| anyhow::anyhow!("no ACK from the gateway within 60s"))?
                .ok_or_else(|| anyhow::anyhow!("the gateway closed the stream"))?;
            if let Some(error) = ack.error_detail {
                anyhow::bail!("the gateway NACKed update {update}: {}", error.message);
            }
        }
        Ok(published)
    }
}

/// One collection's content as the version-counting scenarios publish it.
struct Content {
    name: String,
    /// name → resource version, in name order (as the gateway hashes them).
    versions: BTreeMap<String, String>,
    body: Vec<u8>,
}

/// `--istio-bodies`: every resource's body is an Istio DestinationRule that
/// sets a field of Istio 1.5 (what clients of older releases drop), so the
/// gateway's skew checks read real bodies; else opaque bytes.
pub static ISTIO_BODIES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

const DESTINATION_RULE: &str = "type.googleapis.com/istio.networking.v1alpha3.DestinationRule";

/// A DestinationRule of about `bytes`: an outlier detection with
/// `consecutive5xxErrors` and as many subsets as make up the size.
fn destination_rule(bytes: usize) -> Vec<u8> {
    let mut subsets = Vec::new();
    let mut body = Vec::new();
    while body.len() < bytes {
        let n = subsets.len();
        subsets.push(serde_json::json!({"name": format!("v{n}"), "labels": {"version": format!("v{n}")}}));
        let spec = serde_json::json!({
            "host": "reviews.bookinfo.svc.cluster.local",
            "trafficPolicy": {"outlierDetection": {"consecutive5xxErrors": 5, "interval": "60s"}},
            "subsets": subsets,
        });
        body = mcp_xds_gateway::source::proto_json::encode(DESTINATION_RULE, spec).expect("a valid DestinationRule");
    }
    body
}

impl Content {
    fn body(&self) -> prost_types::Any {
        let type_url = match ISTIO_BODIES.get() {
            Some(true) => DESTINATION_RULE,
            // A type the gateway knows and shows whole (a body of a type it
            // has no descriptor for has keyed versions, which this tool's
            // expected versions, plain content hashes, would not match).
            _ => "type.googleapis.com/google.protobuf.BytesValue",
        };
        prost_types::Any {
            type_url: type_url.into(),
            value: self.body.clone(),
        }
    }

    fn resource(&self, name: &str) -> Resource {
        Resource {
            metadata: Some(Metadata {
                name: name.to_owned(),
                version: self.versions[name].clone(),
                ..Default::default()
            }),
            body: Some(self.body()),
        }
    }

    /// Every resource, in no order, as Galley sends a collection (a Go
    /// map's order, another each time): `seed` picks the order.
    fn all(&self, seed: u64) -> Vec<Resource> {
        let mut names: Vec<&String> = self.versions.keys().collect();
        names.sort_by_cached_key(|n| xxhash_rust::xxh3::xxh3_64_with_seed(n.as_bytes(), seed));
        names.into_iter().map(|n| self.resource(n)).collect()
    }

    /// The version the gateway will report for this content.
    fn gateway_version(&self) -> String {
        // Every resource has the same body and no labels: one digest.
        let no_map = std::collections::HashMap::<String, String>::new();
        let digest = content_digest(&prost::Message::encode_to_vec(&self.body()), &no_map, &no_map);
        version_of_entries(self.versions.iter().map(|(n, v)| (n.as_str(), v.as_str(), digest)))
    }
}

/// The catalog of the version-counting scenarios (big-config, fan-out,
/// incremental, idle): collections of one shared body, each update changing
/// `changes_per_update` resources of one collection, the collections in
/// turn. Latency is per collection version, as the gateway reports it.
pub struct Collections {
    contents: Vec<Content>,
    shape: Shape,
    /// Where the next update's changes start in its collection.
    cursor: usize,
    /// Gateway collection version → when its content was published.
    pub published: HashMap<String, Instant>,
}

impl Collections {
    pub fn new(shape: Shape, collections: &[String]) -> Self {
        let contents = collections
            .iter()
            .map(|name| Content {
                name: name.clone(),
                versions: (0..shape.resources)
                    .map(|i| (format!("ns-{}/r-{i:06}", i % 20), "1".to_owned()))
                    .collect(),
                body: match ISTIO_BODIES.get() {
                    Some(true) => destination_rule(shape.body_bytes),
                    _ => (0..shape.body_bytes).map(|i| (i * 31 % 251) as u8).collect(),
                },
            })
            .collect();
        Self {
            contents,
            shape,
            cursor: 0,
            published: HashMap::new(),
        }
    }

    /// The version the gateway reports for each collection now.
    pub fn finals(&self) -> HashMap<String, String> {
        self.contents
            .iter()
            .map(|c| (c.name.clone(), c.gateway_version()))
            .collect()
    }
}

impl Catalog for Collections {
    fn full_state(&self, collection: &str) -> Option<Vec<Resource>> {
        // The initial state's order is seed 0's; each update's its own.
        self.contents.iter().find(|c| c.name == collection).map(|c| c.all(0))
    }

    fn next_update(&mut self, update: usize) -> Update {
        let index = update % self.contents.len();
        let changes = self.shape.changes_per_update;
        let content = &mut self.contents[index];
        let names: Vec<String> = (0..changes)
            .map(|k| {
                let i = (self.cursor + k) % content.versions.len();
                content
                    .versions
                    .keys()
                    .nth(i)
                    .cloned()
                    .expect("an index below the length")
            })
            .collect();
        self.cursor += changes;
        for name in &names {
            let version = content.versions.get_mut(name).expect("an existing name");
            *version = (version.parse::<u64>().expect("versions are counters") + 1).to_string();
        }
        Update {
            collection: content.name.clone(),
            resources: if self.shape.upstream_incremental {
                names.iter().map(|n| content.resource(n)).collect()
            } else {
                content.all(update as u64 + 1)
            },
            incremental: self.shape.upstream_incremental,
            removed: Vec::new(),
        }
    }

    fn published(&mut self, collection: &str, _resources: &[Resource], at: Instant) {
        if let Some(content) = self.contents.iter().find(|c| c.name == collection) {
            self.published.insert(content.gateway_version(), at);
        }
    }
}
