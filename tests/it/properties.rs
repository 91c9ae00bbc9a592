//! Property tests against the real gateway (in-process, real gRPC): random
//! sequences of upstream updates (full, incremental, restarts that reuse
//! versions for new bodies) and client behaviour (ACK, NACK, stale nonces,
//! reconnects), for a state-of-the-world and an incremental client. After
//! the sequence every client answers what it receives with ACKs until the
//! gateway has nothing more for it; then each holds exactly the current
//! content, or, if it NACKed the current version, exactly the content of the
//! version it last ACKed: never a torn or invented state.

use std::collections::BTreeMap;
use std::future::Future;
use std::task::{Context, Poll};

use mcp_xds_gateway::app::Bound;
use mcp_xds_gateway::proto::{
    IncrementalMeshConfigRequest, IncrementalMeshConfigResponse, MeshConfigRequest, MeshConfigResponse, Resource,
    SinkNode,
};
use proptest::prelude::*;
use prost::Message;

use crate::helpers::clients::{IncrementalClient, SotwClient, INCREMENTAL_PATH, SOTW_PATH};
use crate::helpers::galley::{full, incremental, resource, FakeGalley, GalleyStream};
use crate::helpers::{gateway_for, within, VS};

/// name → (version, body)
type Content = BTreeMap<String, (String, Vec<u8>)>;

#[derive(Clone, Debug)]
enum Op {
    /// A full state: names 0..n with these versions and bodies.
    Full(Vec<(u8, u8, u8)>),
    /// Upserts and removals by name.
    Incremental(Vec<(u8, u8, u8)>, Vec<u8>),
    /// Galley restarts: its stream dies and the next one sends a full state,
    /// reusing versions with other bodies.
    Restart(Vec<(u8, u8, u8)>),
    Receive(usize),
    Ack(usize),
    Nack(usize),
    Stale(usize),
    Reconnect(usize),
}

fn resources() -> impl Strategy<Value = Vec<(u8, u8, u8)>> {
    // (name, version, body): few values so names, versions and bodies repeat.
    prop::collection::vec((0u8..6, 0u8..3, 0u8..3), 0..6)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => resources().prop_map(Op::Full),
        2 => (resources(), prop::collection::vec(0u8..6, 0..3)).prop_map(|(u, r)| Op::Incremental(u, r)),
        1 => resources().prop_map(Op::Restart),
        4 => (0usize..2).prop_map(Op::Receive),
        3 => (0usize..2).prop_map(Op::Ack),
        2 => (0usize..2).prop_map(Op::Nack),
        1 => (0usize..2).prop_map(Op::Stale),
        1 => (0usize..2).prop_map(Op::Reconnect),
    ]
}

fn to_resources(spec: &[(u8, u8, u8)]) -> Vec<Resource> {
    let mut seen = std::collections::BTreeSet::new();
    spec.iter()
        .filter(|(name, _, _)| seen.insert(*name))
        .map(|(name, version, body)| resource(&format!("ns/r{name}"), &format!("v{version}"), &[*body; 3]))
        .collect()
}

fn content_of(resources: &[Resource]) -> Content {
    resources
        .iter()
        .map(|r| {
            let metadata = r.metadata.clone().unwrap();
            (metadata.name, (metadata.version, r.body.clone().unwrap().value))
        })
        .collect()
}

/// The collection version the gateway must report for `content`, computed
/// here from what docs/protocols.md says of it, not by the gateway's code:
/// each resource's digest is xxh3-128 of its encoded body `Any`, then its
/// labels and its annotations (none here: each an empty map, its count 0),
/// every field length-prefixed; its entry is xxh3-128 of its name, its
/// version (both length-prefixed) and that digest; the collection version
/// is xxh3-128 of the wrapping sum of the entries and their count, as 32
/// hex characters. A change of the gateway's hashing (which would make
/// replicas and chained gateways of two releases disagree) fails here.
fn version_of(content: &Content) -> String {
    use xxhash_rust::xxh3::{xxh3_128, Xxh3};
    fn field(hasher: &mut Xxh3, bytes: &[u8]) {
        hasher.update(&(bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    }
    let sum = content.iter().fold(0u128, |sum, (name, (version, body))| {
        let any = prost_types::Any {
            type_url: crate::helpers::VS_TYPE_URL.into(),
            value: body.clone(),
        };
        let mut digest = Xxh3::new();
        field(&mut digest, &any.encode_to_vec());
        field(&mut digest, &0u64.to_le_bytes()); // no labels
        field(&mut digest, &0u64.to_le_bytes()); // no annotations
        let mut entry = Xxh3::new();
        field(&mut entry, name.as_bytes());
        field(&mut entry, version.as_bytes());
        entry.update(&digest.digest128().to_le_bytes());
        sum.wrapping_add(entry.digest128())
    });
    let mut bytes = [0u8; 24];
    bytes[..16].copy_from_slice(&sum.to_le_bytes());
    bytes[16..].copy_from_slice(&(content.len() as u64).to_le_bytes());
    format!("{:032x}", xxh3_128(&bytes))
}

/// The test's computation agrees with a version written down once (so
/// neither it nor the gateway can drift unnoticed) and has the documented
/// properties: order does not matter; a changed body under the same
/// version, a changed version, and one resource more are each a change.
#[test]
fn the_expected_version_is_computed_independently() {
    let content = content_of(&to_resources(&[(1, 1, 7), (2, 1, 8)]));
    assert_eq!(version_of(&content), KNOWN_VERSION);
    let reordered = content_of(&to_resources(&[(2, 1, 8), (1, 1, 7)]));
    assert_eq!(version_of(&reordered), KNOWN_VERSION);
    for changed in [
        to_resources(&[(1, 1, 9), (2, 1, 8)]),
        to_resources(&[(1, 2, 7), (2, 1, 8)]),
        to_resources(&[(1, 1, 7), (2, 1, 8), (3, 1, 1)]),
    ] {
        assert_ne!(version_of(&content_of(&changed)), KNOWN_VERSION, "{changed:?}");
    }
    assert_eq!(version_of(&Content::new()).len(), 32);
}

/// `version_of` of ns/r1 (v1, body 7 7 7) and ns/r2 (v1, body 8 8 8).
const KNOWN_VERSION: &str = "161727c2d8f4f3b9add6dc75b117755b";

/// One response as either client kind receives it.
#[derive(Clone, Debug)]
struct Received {
    version: String,
    nonce: String,
    resources: Vec<Resource>,
    removed: Vec<String>,
    full: bool,
}

enum Stream {
    Sotw(SotwClient),
    Incremental(IncrementalClient),
}

/// A client: its stream, what it holds and the version of it, and a
/// response received but not answered yet.
struct Client {
    node: String,
    stream: Stream,
    held: Content,
    acked: Option<String>,
    pending: Option<Received>,
    /// The nonce of the last response this client answered.
    answered: Option<String>,
    /// The version of the response it last NACKed, until it ACKs another.
    nacked: Option<String>,
    /// The gateway ended the stream (an incremental client NACKed a first
    /// response built from its reported names): it starts again.
    ended: bool,
}

fn node(id: &str) -> Option<SinkNode> {
    Some(SinkNode {
        id: id.into(),
        annotations: Default::default(),
    })
}

impl Client {
    async fn open(gw: &Bound, node: &str, incremental: bool, held: Content, acked: Option<String>) -> Client {
        let stream = if incremental {
            let client = IncrementalClient::open(gw.listen, INCREMENTAL_PATH).await;
            client.send(IncrementalMeshConfigRequest {
                sink_node: self::node(node),
                type_url: VS.into(),
                initial_resource_versions: held.iter().map(|(n, (v, _))| (n.clone(), v.clone())).collect(),
                ..Default::default()
            });
            Stream::Incremental(client)
        } else {
            let client = SotwClient::open(gw.listen, SOTW_PATH).await;
            client.send(MeshConfigRequest {
                sink_node: self::node(node),
                type_url: VS.into(),
                version_info: acked.clone().unwrap_or_default(),
                ..Default::default()
            });
            Stream::Sotw(client)
        };
        Client {
            node: node.into(),
            stream,
            held,
            acked,
            pending: None,
            answered: None,
            nacked: None,
            ended: false,
        }
    }

    /// A response, or the end of the stream the protocol allows (recorded in
    /// `ended`); any other end fails the test.
    fn received(&mut self, result: Result<Received, tonic::Status>) -> Option<Received> {
        match result {
            Ok(received) => Some(received),
            Err(status) if status.code() == tonic::Code::FailedPrecondition && self.is_incremental() => {
                self.ended = true;
                None
            }
            Err(status) => panic!("{}: the stream ended: {status:?}", self.node),
        }
    }

    fn is_incremental(&self) -> bool {
        matches!(self.stream, Stream::Incremental(_))
    }

    /// A response, if one has arrived (polled once: no waiting).
    fn poll(&mut self) -> Option<Received> {
        if self.ended {
            return None;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let result = match &mut self.stream {
            Stream::Sotw(c) => match std::pin::pin!(c.try_recv()).as_mut().poll(&mut cx) {
                Poll::Ready(result) => result.map(sotw),
                Poll::Pending => return None,
            },
            Stream::Incremental(c) => match std::pin::pin!(c.try_recv()).as_mut().poll(&mut cx) {
                Poll::Ready(result) => result.map(inc),
                Poll::Pending => return None,
            },
        };
        self.received(result)
    }

    async fn recv(&mut self) -> Option<Received> {
        let result = match &mut self.stream {
            Stream::Sotw(c) => c.try_recv().await.map(sotw),
            Stream::Incremental(c) => c.try_recv().await.map(inc),
        };
        self.received(result)
    }

    fn receive_now(&mut self) {
        if self.pending.is_none() {
            self.pending = self.poll();
        }
    }

    fn answer(&mut self, nack: bool) {
        if self.ended {
            return;
        }
        let Some(response) = self.pending.take() else { return };
        if !nack {
            if response.full {
                self.held = content_of(&response.resources);
            } else {
                for name in &response.removed {
                    self.held.remove(name);
                }
                self.held.extend(content_of(&response.resources));
            }
            self.acked = Some(response.version.clone());
        }
        self.nacked = nack.then(|| response.version.clone());
        let error = nack.then(|| tonic_types::Status {
            code: 3,
            message: "rejected by the property test".into(),
            details: vec![],
        });
        match &self.stream {
            Stream::Sotw(c) => c.send(MeshConfigRequest {
                sink_node: node(&self.node),
                type_url: VS.into(),
                version_info: self.acked.clone().unwrap_or_default(),
                response_nonce: response.nonce.clone(),
                error_detail: error,
            }),
            Stream::Incremental(c) => c.send(IncrementalMeshConfigRequest {
                sink_node: node(&self.node),
                type_url: VS.into(),
                response_nonce: response.nonce.clone(),
                error_detail: error,
                ..Default::default()
            }),
        }
        self.answered = Some(response.nonce);
    }

    fn stale(&self) {
        if self.ended {
            return;
        }
        match &self.stream {
            Stream::Sotw(c) => c.send(MeshConfigRequest {
                sink_node: node(&self.node),
                type_url: VS.into(),
                response_nonce: "no-such-nonce".into(),
                ..Default::default()
            }),
            Stream::Incremental(c) => c.send(IncrementalMeshConfigRequest {
                sink_node: node(&self.node),
                type_url: VS.into(),
                response_nonce: "no-such-nonce".into(),
                ..Default::default()
            }),
        }
    }
}

fn sotw(r: MeshConfigResponse) -> Received {
    Received {
        version: r.version_info,
        nonce: r.nonce,
        resources: r.resources,
        removed: vec![],
        full: true,
    }
}

fn inc(r: IncrementalMeshConfigResponse) -> Received {
    Received {
        version: r.system_version_info,
        nonce: r.nonce,
        resources: r.resources,
        removed: r.removed_resources,
        full: false,
    }
}

/// The gateway's view of a client's one type.
fn view(gw: &Bound, node: &str) -> Option<mcp_xds_gateway::downstream::registry::TypeView> {
    gw.registry
        .streams()
        .into_iter()
        .find(|s| s.node_id == node)
        .and_then(|s| s.types.into_values().next())
}

struct World {
    galley: FakeGalley,
    stream: GalleyStream,
    gw: Bound,
    model: Content,
    clients: Vec<Client>,
    generation: usize,
}

impl World {
    async fn new() -> World {
        let mut galley = FakeGalley::start().await;
        let gw = gateway_for(&galley, &[VS], &[]).await;
        let mut stream = galley.next_stream().await;
        stream.initial_requests(1).await;
        stream.push_full(VS, vec![]).await;
        let clients = vec![
            Client::open(&gw, "sotw-0", false, Content::new(), None).await,
            Client::open(&gw, "incremental-0", true, Content::new(), None).await,
        ];
        World {
            galley,
            stream,
            gw,
            model: Content::new(),
            clients,
            generation: 0,
        }
    }

    async fn apply(&mut self, op: Op) {
        match op {
            Op::Full(spec) => {
                let resources = to_resources(&spec);
                self.model = content_of(&resources);
                self.stream.push_full(VS, resources).await;
            }
            Op::Incremental(upserts, removed) => {
                let resources = to_resources(&upserts);
                let removed: Vec<String> = removed.iter().map(|n| format!("ns/r{n}")).collect();
                let removed: Vec<&str> = removed.iter().map(String::as_str).collect();
                let upserted = content_of(&resources);
                let conflict = removed.iter().any(|n| upserted.contains_key(*n));
                let reply = self.stream.send(incremental(VS, resources, &removed)).await;
                // A name both updated and removed is refused, and nothing
                // of the message is applied.
                assert_eq!(reply.error_detail.is_some(), conflict, "{reply:?}");
                if let Some(detail) = &reply.error_detail {
                    // INVALID_ARGUMENT, naming a name both updated and removed.
                    assert_eq!(detail.code, tonic::Code::InvalidArgument as i32, "{detail:?}");
                    assert!(
                        removed
                            .iter()
                            .filter(|n| upserted.contains_key(**n))
                            .any(|n| detail.message.contains(&format!("{n:?} of collection"))),
                        "{detail:?}"
                    );
                }
                if !conflict {
                    for name in &removed {
                        self.model.remove(*name);
                    }
                    self.model.extend(upserted);
                }
            }
            Op::Restart(spec) => {
                self.stream.kill(tonic::Status::unavailable("galley restarts"));
                let mut next = self.galley.next_stream().await;
                next.initial_requests(1).await;
                let resources = to_resources(&spec);
                self.model = content_of(&resources);
                next.send(full(VS, resources)).await;
                self.stream = next;
            }
            Op::Receive(i) => self.clients[i].receive_now(),
            Op::Ack(i) => self.clients[i].answer(false),
            Op::Nack(i) => self.clients[i].answer(true),
            Op::Stale(i) => self.clients[i].stale(),
            Op::Reconnect(i) => self.reconnect(i).await,
        }
    }

    /// Client `i` opens a new stream, reporting what it holds.
    async fn reconnect(&mut self, i: usize) {
        self.generation += 1;
        let old = &self.clients[i];
        let node = format!("{}-{}", if i == 0 { "sotw" } else { "incremental" }, self.generation);
        let (held, acked) = (old.held.clone(), old.acked.clone());
        self.clients[i] = Client::open(&self.gw, &node, i == 1, held, acked).await;
    }

    /// Client `i` ACKs what it gets until the gateway has nothing more for
    /// it. Returns true when its stream ended instead (it has reconnected and
    /// must settle again).
    async fn settle(&mut self, i: usize) -> bool {
        if self.clients[i].ended {
            self.reconnect(i).await;
        }
        let current = self.gw.cache.get(VS).unwrap().version.to_string();
        let gw = &self.gw;
        let client = &mut self.clients[i];
        within(&format!("{} to settle", client.node), async {
            loop {
                if client.pending.is_some() {
                    client.answer(false);
                    continue;
                }
                let Some(view) = view(gw, &client.node) else {
                    // Not registered yet, or ended: its status says which.
                    client.receive_now();
                    if client.ended {
                        return;
                    }
                    tokio::task::yield_now().await;
                    continue;
                };
                let answered =
                    view.last_sent_nonce.is_some() && view.last_sent_nonce.map(|n| n.to_string()) == client.answered;
                if view.outstanding && !answered {
                    client.pending = client.recv().await;
                    assert!(!client.ended, "{}: no NACK while settling", client.node);
                    continue;
                }
                if !view.outstanding
                    && (view.acked_version.as_deref() == Some(&*current)
                        || view
                            .last_nack
                            .as_ref()
                            .is_some_and(|n| !n.superseded && *n.version == *current))
                {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        })
        .await;
        self.clients[i].ended
    }

    /// Every client ACKs what it gets until the gateway has nothing more for
    /// it; then the property is checked.
    async fn settle_and_check(&mut self) {
        let current = self.gw.cache.get(VS).unwrap().version.to_string();
        assert_eq!(
            current,
            version_of(&self.model),
            "the gateway's version is the model's content"
        );
        for i in 0..self.clients.len() {
            // A client whose stream the gateway ends meanwhile (its NACK of
            // a first response built from reported names reached the gateway
            // only now) starts again and settles on its new stream.
            while self.settle(i).await {}
            let client = &mut self.clients[i];
            // A NACK of the current version holds it back until the client
            // ACKs a later one; after that, the version coming back is a
            // change like any other.
            let nacked_current = view(&self.gw, &client.node)
                .unwrap()
                .last_nack
                .is_some_and(|n| !n.superseded && *n.version == *current);
            // Never torn: what the client holds is exactly the version it ACKed.
            assert_eq!(
                client.acked.as_deref().map(|_| version_of(&client.held)),
                client.acked,
                "{}: held content is the version it ACKed",
                client.node
            );
            if !nacked_current {
                assert_eq!(client.held, self.model, "{}: at the current content", client.node);
                assert_eq!(client.acked.as_deref(), Some(&*current));
            } else {
                // Its last answer was a NACK of the current version (what it
                // holds is what it last ACKed, checked above). That may be
                // the current content as well: a response that went back to
                // the version it held, refused.
                assert_eq!(
                    client.nacked.as_deref(),
                    Some(&*current),
                    "{}: the gateway shows a NACK of the current version it did not send last",
                    client.node
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn clients_end_at_the_current_content_or_at_what_they_nacked(ops in prop::collection::vec(op(), 1..30)) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        runtime.block_on(async {
            let mut world = World::new().await;
            for op in ops {
                world.apply(op).await;
            }
            world.settle_and_check().await;
            // And once more after one more change, so a NACKed version
            // never blocks the next one.
            world.apply(Op::Full(vec![(0, 9, 9)])).await;
            world.settle_and_check().await;
        });
    }
}
