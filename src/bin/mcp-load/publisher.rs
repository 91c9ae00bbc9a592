//! The publisher on the shared fake Galley (`tools::galley`, the tests' own):
//! it publishes controlled content and records when each collection version
//! was published, so clients' receive times turn into end-to-end latencies.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mcp_xds_gateway::cache::{content_digest, version_of_entries};
use mcp_xds_gateway::proto::{Metadata, RequestResources, Resource, Resources};
use mcp_xds_gateway::tools::galley::{FakeGalley, GalleyStream};
use tokio::sync::{mpsc, watch, Mutex as AsyncMutex};
use tokio::time::Instant;
use tonic::Status;

use crate::scenario::Shape;

/// One collection's content as the publisher holds it.
struct Content {
    name: String,
    /// name → resource version, in name order (as the gateway hashes them).
    versions: BTreeMap<String, String>,
    body: Vec<u8>,
}

impl Content {
    fn body(&self) -> prost_types::Any {
        prost_types::Any {
            type_url: "type.googleapis.com/mcp.load.Body".into(),
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

/// What the rest of the tool reads from the publisher.
#[derive(Clone, Default)]
pub struct PublishLog {
    /// Gateway collection version → when its content was published.
    pub published: Arc<Mutex<HashMap<String, Instant>>>,
    /// NACKs the gateway sent (a correct run has none).
    pub nacks: Arc<std::sync::atomic::AtomicUsize>,
}

pub struct Publisher {
    pub addr: SocketAddr,
    pub log: PublishLog,
    state: Arc<AsyncMutex<Vec<Content>>>,
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
async fn serve(
    mut stream: GalleyStream,
    state: Arc<AsyncMutex<Vec<Content>>>,
    log: PublishLog,
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
            log.nacks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            eprintln!("mcp-load: the gateway NACKed {}: {}", request.collection, error.message);
        }
        if !request.response_nonce.is_empty() {
            let _ = acks_tx.send(request).await;
            continue;
        }
        // An initial request: publish the collection's full state.
        let contents = state.lock().await;
        if let Some(content) = contents.iter().find(|c| c.name == request.collection) {
            log.published
                .lock()
                .unwrap()
                .insert(content.gateway_version(), Instant::now());
            let message = Resources {
                collection: content.name.clone(),
                resources: content.all(0),
                nonce: format!("init-{}", content.name),
                incremental: false,
                ..Default::default()
            };
            drop(contents);
            let _ = link.tx.send(Ok(message));
            initial += 1;
        }
        if initial == 1 {
            publish.send_replace(Some(link.clone()));
        }
    }
}

// === impl Publisher ===

impl Publisher {
    pub async fn start(shape: Shape, collections: &[String]) -> anyhow::Result<Self> {
        let contents: Vec<Content> = collections
            .iter()
            .map(|name| Content {
                name: name.clone(),
                versions: (0..shape.resources)
                    .map(|i| (format!("ns-{}/r-{i:06}", i % 20), "1".to_owned()))
                    .collect(),
                body: (0..shape.body_bytes).map(|i| (i * 31 % 251) as u8).collect(),
            })
            .collect();
        let mut galley = FakeGalley::start("127.0.0.1:0".parse()?).await?;
        let addr = galley.addr;
        let state = Arc::new(AsyncMutex::new(contents));
        let log = PublishLog::default();
        let (link_tx, link_rx) = watch::channel(None);
        let serving = (state.clone(), log.clone());
        tokio::spawn(async move {
            // Every stream the gateway opens (it reconnects after a failure).
            while let Some(stream) = galley.next_stream().await {
                tokio::spawn(serve(stream, serving.0.clone(), serving.1.clone(), link_tx.clone()));
            }
        });
        Ok(Self {
            addr,
            log,
            state,
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

    /// Publishes `shape.updates` updates, one collection per update in turn,
    /// each changing `changes_per_update` resources, and waits for each ACK
    /// (one outstanding update, as Galley does). Returns the final version of
    /// every collection.
    pub async fn run_updates(&mut self) -> anyhow::Result<HashMap<String, String>> {
        let link = self.link().await?;
        let mut ticker = tokio::time::interval(self.shape.update_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut cursor = 0usize;
        for update in 0..self.shape.updates {
            ticker.tick().await;
            let mut contents = self.state.lock().await;
            let index = update % contents.len();
            let content = &mut contents[index];
            let names: Vec<String> = (0..self.shape.changes_per_update)
                .map(|k| {
                    let i = (cursor + k) % content.versions.len();
                    content
                        .versions
                        .keys()
                        .nth(i)
                        .cloned()
                        .expect("an index below the length")
                })
                .collect();
            cursor += self.shape.changes_per_update;
            for name in &names {
                let version = content.versions.get_mut(name).expect("an existing name");
                *version = (version.parse::<u64>().expect("versions are counters") + 1).to_string();
            }
            let message = Resources {
                collection: content.name.clone(),
                resources: if self.shape.upstream_incremental {
                    names.iter().map(|n| content.resource(n)).collect()
                } else {
                    content.all(update as u64 + 1)
                },
                nonce: format!("u{update}"),
                incremental: self.shape.upstream_incremental,
                ..Default::default()
            };
            self.log
                .published
                .lock()
                .unwrap()
                .insert(content.gateway_version(), Instant::now());
            drop(contents);
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
        let contents = self.state.lock().await;
        Ok(contents.iter().map(|c| (c.name.clone(), c.gateway_version())).collect())
    }
}
