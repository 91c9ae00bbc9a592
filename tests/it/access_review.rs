//! The independent check of the access policy (issue 32): certificates of
//! this module's own (odd SANs included), raw ADS and MCP clients, and a
//! search for any way a secret reaches an identity the policy does not
//! grant, or key material reaches a person's eyes. Four of these tests
//! found defects (a reload skipped by a busy stream, grant keys that
//! collided, a certificate without SANs taken as unauthenticated, a DNS SAN
//! spelling a URI taken as that URI); they pass since the fixes.

use std::net::SocketAddr;
use std::path::Path;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use mcp_xds_gateway::proto::{IncrementalMeshConfigRequest, MeshConfigResponse};
use tonic::transport::Channel;

use crate::access::{
    secret_doc, CLUSTER_TYPE, DELTA as ADS_DELTA, ISTIOD, OTHER, POLICY, SECRETS, SECRET_TYPE, SOTW as ADS_SOTW,
};
use crate::helpers::certs::{write, write_leaf, Ca, Leaf};
use crate::helpers::clients::{
    node, tls_channel, Bidi, IncrementalClient, PilotSink, SotwClient, V10Client, V10Request, INCREMENTAL_PATH,
    SOTW_PATH,
};
use crate::helpers::{eventually_some, get_json, http_get, spawn_gateway, start_gateway, within, VS};

const VS_GVK: &str = "networking.istio.io/v1alpha3/VirtualService";

const SHOP: &str = "spiffe://cluster.local/ns/shop/sa/frontend";

type SotwStream = Bidi<DiscoveryRequest, DiscoveryResponse>;
type DeltaStream = Bidi<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;
type V10Stream = Bidi<V10Request, MeshConfigResponse>;

fn cluster_doc(name: &str) -> String {
    format!(
        "collection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: {CLUSTER_TYPE}\n  json:\n    \
         name: {name}\n    connect_timeout: 1s\n"
    )
}

/// The secrets every test serves, with the leaves whose keys they hold
/// (to look for their material in what is printed).
struct Secrets {
    leaves: Vec<(String, Leaf)>,
}

impl Secrets {
    fn new(ca: &Ca, names: &[&str]) -> Self {
        Self {
            leaves: names.iter().map(|n| (n.to_string(), ca.leaf(n))).collect(),
        }
    }

    /// Writes them, and a cluster, as `dir/config.yaml`.
    fn write(&self, dir: &Path) {
        let mut docs: Vec<String> = self.leaves.iter().map(|(n, leaf)| secret_doc(n, leaf)).collect();
        docs.push(cluster_doc("backend"));
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.yaml"), docs.join("---\n")).unwrap();
    }

    /// The base64 lines of every private key: what must never be printed.
    fn key_lines(&self) -> Vec<String> {
        self.leaves
            .iter()
            .flat_map(|(_, leaf)| leaf.key.lines().filter(|l| !l.starts_with("-----")).map(str::to_owned))
            .filter(|l| l.len() >= 16)
            .collect()
    }
}

const NAMES: &[&str] = &["shop/frontend-cert", "shop/backend-cert", "other/x-cert"];

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// The flags of a gateway over TLS on `dir/source` with `policy` at
/// `dir/policy.yaml`; `--client-ca` when `client_ca`.
fn tls_flags(dir: &Path, ca: &Ca, policy: Option<&str>, client_ca: bool) -> Vec<String> {
    tls_flags_trusting(dir, ca, policy, client_ca.then_some(""))
}

/// As [`tls_flags`]; `client_ca`: `--client-ca` with the test's CA and
/// these PEMs.
fn tls_flags_trusting(dir: &Path, ca: &Ca, policy: Option<&str>, client_ca: Option<&str>) -> Vec<String> {
    let (cert, key) = write_leaf(dir, "server", &ca.leaf("gateway"));
    let mut flags = vec![
        "--source-dir".to_owned(),
        path(&dir.join("source")),
        "--tls-cert".into(),
        path(&cert),
        "--tls-key".into(),
        path(&key),
    ];
    if let Some(extra) = client_ca {
        let pems = format!("{}{extra}", ca.pem);
        flags.extend(["--client-ca".into(), path(&write(dir, "client-ca.pem", &pems))]);
    }
    if let Some(policy) = policy {
        std::fs::write(dir.join("policy.yaml"), policy).unwrap();
        flags.extend(["--access-policy".into(), path(&dir.join("policy.yaml"))]);
    }
    flags
}

async fn gateway(dir: &Path, ca: &Ca, secrets: &Secrets, policy: Option<&str>) -> mcp_xds_gateway::app::Bound {
    gateway_trusting(dir, ca, "", secrets, policy).await
}

/// As [`gateway`], its `--client-ca` trusting `extra_ca` too.
async fn gateway_trusting(
    dir: &Path,
    ca: &Ca,
    extra_ca: &str,
    secrets: &Secrets,
    policy: Option<&str>,
) -> mcp_xds_gateway::app::Bound {
    secrets.write(&dir.join("source"));
    let flags = tls_flags_trusting(dir, ca, policy, Some(extra_ca));
    start_gateway(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await
}

async fn as_leaf(addr: SocketAddr, ca: &Ca, leaf: &Leaf) -> Channel {
    tls_channel(addr, &ca.pem, Some(leaf)).await.unwrap()
}

async fn as_identity(addr: SocketAddr, ca: &Ca, identity: &str) -> Channel {
    as_leaf(addr, ca, &ca.spiffe_leaf(identity)).await
}

fn envoy_node() -> Option<Node> {
    Some(Node {
        id: "sidecar~10.0.0.9~review~default.svc.cluster.local".into(),
        ..Default::default()
    })
}

fn sotw(type_url: &str, names: &[&str], ack: Option<&DiscoveryResponse>) -> DiscoveryRequest {
    DiscoveryRequest {
        node: envoy_node(),
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: ack.map(|r| r.version_info.clone()).unwrap_or_default(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

fn delta(subscribe: &[&str], unsubscribe: &[&str], ack: Option<&DeltaDiscoveryResponse>) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: envoy_node(),
        type_url: SECRET_TYPE.into(),
        resource_names_subscribe: subscribe.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|n| n.to_string()).collect(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

/// A `Secret`'s name (field 1).
#[derive(Clone, PartialEq, prost::Message)]
struct SecretName {
    #[prost(string, tag = "1")]
    name: String,
}

fn secret_name(any_value: &[u8]) -> String {
    <SecretName as prost::Message>::decode(any_value).unwrap().name
}

fn sotw_names(response: &DiscoveryResponse) -> Vec<String> {
    let mut names: Vec<String> = response.resources.iter().map(|a| secret_name(&a.value)).collect();
    names.sort();
    names
}

fn delta_names(response: &DeltaDiscoveryResponse) -> Vec<String> {
    let mut names: Vec<String> = response.resources.iter().map(|r| r.name.clone()).collect();
    names.sort();
    // The name a resource is sent under is the name inside its body.
    for r in &response.resources {
        assert_eq!(secret_name(&r.resource.as_ref().unwrap().value), r.name);
    }
    names
}

fn mcp_names(response: &MeshConfigResponse) -> Vec<String> {
    crate::helpers::names(&response.resources)
}

/// Fails when a name outside `prefix` was sent.
#[track_caller]
fn only_under(prefix: &str, names: &[String], what: &str) {
    assert!(
        names.iter().all(|n| n.starts_with(prefix)),
        "{what}: a name outside {prefix:?} was sent: {names:?}"
    );
}

// === Delta: subscribe, unsubscribe, re-subscribe, reconnect ===

/// Every response of a delta stream of `other` through a sequence of
/// subscriptions to names it may not read, `*`, unsubscribes and
/// re-subscribes, then a change in both namespaces: no `shop/` resource,
/// ever.
#[tokio::test]
async fn delta_subscribe_sequences_never_send_a_name_the_grant_withholds() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let gw = gateway(dir.path(), &ca, &Secrets::new(&ca, NAMES), Some(POLICY)).await;
    let mut other = DeltaStream::open_on(as_identity(gw.listen, &ca, OTHER).await, ADS_DELTA).await;

    other.send(delta(&["shop/frontend-cert"], &[], None));
    let first = other.recv().await;
    assert!(first.resources.is_empty(), "{:?}", delta_names(&first));
    other.send(delta(&[], &[], Some(&first)));

    other.send(delta(&["*"], &[], None));
    let wildcard = other.recv().await;
    assert_eq!(delta_names(&wildcard), ["other/x-cert"]);
    other.send(delta(&[], &[], Some(&wildcard)));

    // Whatever these answer (they may answer nothing), it is read below.
    other.send(delta(&[], &["*", "shop/frontend-cert"], None));
    other.send(delta(&["shop/backend-cert", "shop/frontend-cert"], &[], None));
    other.send(delta(&["*"], &["shop/backend-cert"], None));

    // A change in both namespaces: the stream is answered at least once
    // more, with `other/y-cert`; everything until then is checked.
    let more = [
        ("shop/new-cert", ca.leaf("new.shop")),
        ("other/y-cert", ca.leaf("y.other")),
    ];
    let docs: Vec<String> = more.iter().map(|(n, l)| secret_doc(n, l)).collect();
    std::fs::write(dir.path().join("source/more.yaml"), docs.join("---\n")).unwrap();
    within("other/y-cert to reach other's stream", async {
        loop {
            let response = other.recv().await;
            let names = delta_names(&response);
            only_under("other/", &names, "a delta response to other");
            other.send(delta(&[], &[], Some(&response)));
            if names.contains(&"other/y-cert".to_owned()) {
                break;
            }
        }
    })
    .await;
}

/// A name the client may not read and a name that does not exist are the
/// same to it: the answer to a subscription does not tell whether another
/// namespace holds a secret of that name.
#[tokio::test]
async fn a_withheld_name_and_a_missing_name_get_the_same_answer() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let gw = gateway(dir.path(), &ca, &Secrets::new(&ca, NAMES), Some(POLICY)).await;
    let mut other = DeltaStream::open_on(as_identity(gw.listen, &ca, OTHER).await, ADS_DELTA).await;
    other.send(delta(
        &["shop/frontend-cert", "shop/no-such-cert", "other/x-cert"],
        &[],
        None,
    ));
    let response = other.recv().await;
    assert_eq!(delta_names(&response), ["other/x-cert"]);
    let mut removed = response.removed_resources.clone();
    removed.sort();
    let listed = |name: &str| removed.iter().any(|r| r == name);
    assert_eq!(
        listed("shop/frontend-cert"),
        listed("shop/no-such-cert"),
        "an existing withheld name and a missing one are answered alike: removed_resources {removed:?}"
    );
}

/// A reconnect whose `initial_resource_versions` name secrets of another
/// namespace (with their real versions, learned elsewhere, or wrong ones)
/// is not served them; `removed_resources` names nothing the client did
/// not name itself, and does not depend on whether the version it gave
/// was right.
#[tokio::test]
async fn a_reconnect_claiming_secrets_of_another_namespace_is_not_served_them() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let gw = gateway(dir.path(), &ca, &Secrets::new(&ca, NAMES), Some(POLICY)).await;

    // The real versions of shop's secrets, as shop's Envoy holds them.
    let mut shop = DeltaStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_DELTA).await;
    shop.send(delta(&["*"], &[], None));
    let held = shop.recv().await;
    let version_of = |name: &str| {
        held.resources
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.version.clone())
            .unwrap()
    };
    let real = version_of("shop/frontend-cert");

    let mut answers = Vec::new();
    for claimed in [real.clone(), "not-the-version".to_owned()] {
        let mut other = DeltaStream::open_on(as_identity(gw.listen, &ca, OTHER).await, ADS_DELTA).await;
        let mut request = delta(&["*"], &[], None);
        request.initial_resource_versions = [
            ("shop/frontend-cert".to_owned(), claimed),
            ("other/x-cert".to_owned(), "stale".to_owned()),
        ]
        .into();
        other.send(request);
        let response = other.recv().await;
        assert_eq!(delta_names(&response), ["other/x-cert"]);
        let mut removed = response.removed_resources.clone();
        removed.sort();
        assert!(
            removed.iter().all(|r| r == "shop/frontend-cert"),
            "only a name the client named is listed: {removed:?}"
        );
        answers.push(removed);

        // A NACK of that answer and the ACK after it send nothing new.
        other.send(DeltaDiscoveryRequest {
            error_detail: Some(tonic_types::Status {
                code: tonic::Code::InvalidArgument as i32,
                message: "review: refused".into(),
                details: vec![],
            }),
            ..delta(&[], &[], Some(&response))
        });
    }
    assert_eq!(
        answers[0], answers[1],
        "the answer does not tell a right version from a wrong one"
    );
}

// === Reloads ===

/// A reload that narrows a grant while clients hold secrets: delta lists
/// what it may no longer read in `removed_resources`; SotW (wildcard and
/// by name), the legacy services and `ResourceSource` are sent the
/// narrower view; nothing of the withdrawn names is sent after.
#[tokio::test]
async fn a_reload_that_narrows_a_grant_takes_the_withdrawn_secret_from_every_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let gw = gateway(dir.path(), &ca, &Secrets::new(&ca, NAMES), Some(POLICY)).await;

    let mut by_delta = DeltaStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_DELTA).await;
    by_delta.send(delta(&["*"], &[], None));
    let first = by_delta.recv().await;
    assert_eq!(delta_names(&first), ["shop/backend-cert", "shop/frontend-cert"]);
    by_delta.send(delta(&[], &[], Some(&first)));

    let mut wildcard = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
    wildcard.send(sotw(SECRET_TYPE, &[], None));
    let all = wildcard.recv().await;
    assert_eq!(sotw_names(&all), ["shop/backend-cert", "shop/frontend-cert"]);
    wildcard.send(sotw(SECRET_TYPE, &[], Some(&all)));

    let named_as = ["shop/backend-cert", "shop/frontend-cert"];
    let mut named = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
    named.send(sotw(SECRET_TYPE, &named_as, None));
    let both = named.recv().await;
    assert_eq!(sotw_names(&both), named_as);
    named.send(sotw(SECRET_TYPE, &named_as, Some(&both)));

    let mut legacy = SotwClient::open_on(as_identity(gw.listen, &ca, SHOP).await, SOTW_PATH).await;
    legacy.subscribe(SECRETS);
    let legacy_first = legacy.recv().await;
    assert_eq!(mcp_names(&legacy_first), ["shop/backend-cert", "shop/frontend-cert"]);
    legacy.ack(&legacy_first);

    let mut sink = PilotSink::connect_on(as_identity(gw.listen, &ca, SHOP).await, &[SECRETS], true).await;
    sink.recv_and_ack().await;
    assert_eq!(sink.names(SECRETS), ["shop/backend-cert", "shop/frontend-cert"]);

    std::fs::write(
        dir.path().join("policy.yaml"),
        POLICY.replace("names: [\"{namespace}/*\"]", "names: [\"{namespace}/frontend-*\"]"),
    )
    .unwrap();

    let narrowed = within("delta's new view", by_delta.recv()).await;
    assert!(narrowed.resources.is_empty(), "{:?}", delta_names(&narrowed));
    assert_eq!(narrowed.removed_resources, ["shop/backend-cert"]);
    let narrowed = within("wildcard SotW's new view", wildcard.recv()).await;
    assert_eq!(sotw_names(&narrowed), ["shop/frontend-cert"]);
    let narrowed = within("named SotW's new view", named.recv()).await;
    assert_eq!(sotw_names(&narrowed), ["shop/frontend-cert"]);
    let narrowed = within("the legacy client's new view", legacy.recv()).await;
    assert_eq!(mcp_names(&narrowed), ["shop/frontend-cert"]);
    within("the sink's new view", sink.recv_and_ack()).await;
    assert_eq!(sink.names(SECRETS), ["shop/frontend-cert"]);

    // The view's version is the narrower view's own, and the same for
    // each protocol that shows one.
    assert_ne!(narrowed.version_info, legacy_first.version_info);
}

/// A stream busy sending when the policy is narrowed, whose next request
/// starts following a new type: the types it already follows are
/// narrowed too. The stream is made busy by a response larger than the
/// client's flow-control window and an unread response to a type nobody
/// serves (a stream writes one response beyond its client's window, then
/// waits to write the next); the new policy and the new type's request
/// are then both waiting when it is free again. Repeated on ten streams:
/// the order the gateway takes the two in is its own choice.
#[tokio::test]
async fn a_policy_narrowed_while_a_stream_is_busy_narrows_every_type_it_follows() {
    const STREAMS: usize = 10;
    // The response that waits, so that nothing else waits to be read.
    const UNSERVED: usize = 1;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let mut secrets = Secrets::new(&ca, NAMES);
    // Larger than a client's flow-control window (2 MiB for a stream).
    let big_chain = format!(
        "-----BEGIN CERTIFICATE-----\n{}-----END CERTIFICATE-----\n",
        format!("{}\n", "A".repeat(64)).repeat(50_000)
    );
    secrets.leaves.push((
        "shop/big-cert".into(),
        Leaf {
            cert: big_chain,
            key: ca.leaf("big.shop").key,
        },
    ));
    let gw = gateway(dir.path(), &ca, &secrets, Some(POLICY)).await;

    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let stream = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
        stream.send(sotw(SECRET_TYPE, &[], None));
        for i in 0..UNSERVED {
            stream.send(sotw(&format!("type.googleapis.com/review.Unserved{i}"), &[], None));
        }
        streams.push(stream);
    }
    // Each stream has sent what fits and waits for its client to read.
    eventually_some("every stream to follow the types nobody serves", || async {
        let view = get_json(gw.admin, "/debug/syncz").await;
        let unserved = view["rows"]
            .as_array()?
            .iter()
            .filter(|r| r["type_url"].as_str().is_some_and(|t| t.contains("review.Unserved")))
            .count();
        (unserved >= STREAMS * UNSERVED).then_some(())
    })
    .await;

    std::fs::write(
        dir.path().join("policy.yaml"),
        POLICY.replace("names: [\"{namespace}/*\"]", "names: [\"{namespace}/frontend-*\"]"),
    )
    .unwrap();
    // This gateway's own policy in effect, not a reload count: every
    // in-process gateway of the test binary moves that one counter.
    eventually_some("the narrower policy to load", || async {
        let shown = get_json(gw.admin, "/debug/config").await;
        shown["access_policy"]["rules"]
            .to_string()
            .contains("{namespace}/frontend-*")
            .then_some(())
    })
    .await;
    for stream in &streams {
        stream.send(sotw(CLUSTER_TYPE, &[], None));
    }
    // Read (and ACK) everything each stream sends until its clusters.
    for stream in &mut streams {
        within("the clusters' response", async {
            loop {
                let response = stream.recv().await;
                stream.send(sotw(&response.type_url, &[], Some(&response)));
                if response.type_url == CLUSTER_TYPE {
                    break;
                }
            }
        })
        .await;
    }
    // A new secret of shop's: every stream is sent its view of secrets.
    let added = secret_doc("shop/frontend-2", &ca.leaf("frontend-2.shop"));
    std::fs::write(dir.path().join("source/more.yaml"), added).unwrap();
    for (i, stream) in streams.iter_mut().enumerate() {
        let names = within("the new secret", async {
            loop {
                let response = stream.recv().await;
                stream.send(sotw(&response.type_url, &[], Some(&response)));
                let names = (response.type_url == SECRET_TYPE).then(|| sotw_names(&response));
                if let Some(names) = names.filter(|n| n.contains(&"shop/frontend-2".to_owned())) {
                    return names;
                }
            }
        })
        .await;
        assert_eq!(
            names,
            ["shop/frontend-2", "shop/frontend-cert"],
            "stream {i}: served names the narrower policy withholds"
        );
    }
}

// === Every protocol, restricted by name ===

/// A grant of part of a collection, on every protocol the gateway serves:
/// ADS SotW (wildcard, by name) and delta, MCP 1.1 and 1.0 SotW and
/// incremental on `AggregatedMeshConfigService`, and `ResourceSource`
/// (SotW and incremental): shop's secrets only. The Istio kinds over MCP
/// over xDS (GVK type URLs, as istiod asks) to istiod only.
#[tokio::test]
async fn every_protocol_serves_a_restricted_client_its_grant_only() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let gw = gateway(dir.path(), &ca, &Secrets::new(&ca, NAMES), Some(POLICY)).await;
    let shop_names = ["shop/backend-cert", "shop/frontend-cert"];

    let mut named = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
    named.send(sotw(SECRET_TYPE, &["other/x-cert"], None));
    let response = named.recv().await;
    assert_eq!(
        sotw_names(&response),
        Vec::<String>::new(),
        "only other's name asked for"
    );

    let mut mcp11 = SotwClient::open_on(as_identity(gw.listen, &ca, SHOP).await, SOTW_PATH).await;
    mcp11.subscribe(SECRETS);
    assert_eq!(mcp_names(&mcp11.recv().await), shop_names);

    let mut mcp10 = V10Stream::open_on(as_identity(gw.listen, &ca, SHOP).await, SOTW_PATH).await;
    mcp10.send(V10Request {
        client: Some(V10Client {
            id: "pilot-1-0".into(),
            metadata: None,
        }),
        type_url: SECRETS.into(),
        ..Default::default()
    });
    assert_eq!(mcp_names(&mcp10.recv().await), shop_names);

    let mut incremental = IncrementalClient::open_on(as_identity(gw.listen, &ca, SHOP).await, INCREMENTAL_PATH).await;
    incremental.send(IncrementalMeshConfigRequest {
        sink_node: node(),
        type_url: SECRETS.into(),
        // It says it holds another namespace's secret: it is told to drop it.
        initial_resource_versions: [("other/x-cert".to_owned(), "1".to_owned())].into(),
        ..Default::default()
    });
    let first = incremental.recv().await;
    assert_eq!(crate::helpers::names(&first.resources), shop_names);
    assert!(
        first.removed_resources.iter().all(|r| r == "other/x-cert"),
        "{:?}",
        first.removed_resources
    );

    for incremental in [false, true] {
        let mut sink = PilotSink::connect_on(as_identity(gw.listen, &ca, SHOP).await, &[SECRETS], incremental).await;
        let resources = sink.recv_and_ack().await;
        assert_eq!(crate::helpers::names(&resources.resources), shop_names);
        assert_eq!(sink.names(SECRETS), shop_names);
    }

    // MCP over xDS: the GVK type URL istiod asks with.
    let mut not_istiod = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
    not_istiod.send(sotw(VS_GVK, &[], None));
    let status = not_istiod.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains(VS_GVK), "{:?}", status.message());
    let mut istiod = SotwStream::open_on(as_identity(gw.listen, &ca, ISTIOD).await, ADS_SOTW).await;
    istiod.send(sotw(VS_GVK, &[], None));
    assert_eq!(istiod.recv().await.type_url, VS_GVK);
    let mut istiod_secrets = SotwStream::open_on(as_identity(gw.listen, &ca, ISTIOD).await, ADS_SOTW).await;
    istiod_secrets.send(sotw(SECRET_TYPE, &[], None));
    assert_eq!(
        sotw_names(&istiod_secrets.recv().await),
        Vec::<String>::new(),
        "istio-system holds no secret here"
    );
}

/// MCP over xDS (GVK type URLs, SotW and delta, as istiod asks): a tenant
/// granted `tenant-a/*` of the VirtualServices is served those only, each
/// in MCP's layout; a wildcard, a name of another tenant's, and a new
/// resource of each tenant change nothing of that.
#[tokio::test]
async fn mcp_over_xds_serves_a_tenant_its_own_istio_resources_only() {
    const TENANT: &str = "spiffe://cluster.local/ns/tenant-a/sa/config-reader";
    let vs = |name: &str| format!("collection: {VS}\nname: {name}\nbody:\n  struct:\n    hosts: [{name}]\n");
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let policy = format!(
        "rules:\n- identities: [\"{TENANT}\"]\n  collections: [\"istio/networking/*\"]\n  names: [\"tenant-a/*\"]\n"
    );
    let secrets = Secrets::new(&ca, NAMES);
    secrets.write(&dir.path().join("source"));
    std::fs::write(
        dir.path().join("source/istio.yaml"),
        [vs("tenant-a/web"), vs("tenant-b/web"), vs("tenant-ab/web")].join("---\n"),
    )
    .unwrap();
    let gw = gateway(dir.path(), &ca, &secrets, Some(&policy)).await;
    let resource_names = |resources: Vec<Vec<u8>>| -> Vec<String> {
        let mut names: Vec<String> = resources
            .iter()
            .map(|value| {
                let resource = <mcp_xds_gateway::proto::Resource as prost::Message>::decode(&value[..]).unwrap();
                resource.metadata.unwrap().name
            })
            .collect();
        names.sort();
        names
    };

    let mut sotw_stream = SotwStream::open_on(as_identity(gw.listen, &ca, TENANT).await, ADS_SOTW).await;
    sotw_stream.send(sotw(VS_GVK, &[], None));
    let first = sotw_stream.recv().await;
    assert_eq!(
        resource_names(first.resources.iter().map(|a| a.value.to_vec()).collect()),
        ["tenant-a/web"]
    );
    sotw_stream.send(sotw(VS_GVK, &[], Some(&first)));

    let mut delta_stream = DeltaStream::open_on(as_identity(gw.listen, &ca, TENANT).await, ADS_DELTA).await;
    delta_stream.send(DeltaDiscoveryRequest {
        type_url: VS_GVK.into(),
        ..delta(&["*", "tenant-b/web"], &[], None)
    });
    let first = delta_stream.recv().await;
    let values = first
        .resources
        .iter()
        .map(|r| r.resource.as_ref().unwrap().value.to_vec())
        .collect();
    assert_eq!(resource_names(values), ["tenant-a/web"]);
    delta_stream.send(DeltaDiscoveryRequest {
        type_url: VS_GVK.into(),
        ..delta(&[], &[], Some(&first))
    });

    std::fs::write(
        dir.path().join("source/more.yaml"),
        [vs("tenant-b/new"), vs("tenant-a/new")].join("---\n"),
    )
    .unwrap();
    let next = within("the SotW update", sotw_stream.recv()).await;
    assert_eq!(
        resource_names(next.resources.iter().map(|a| a.value.to_vec()).collect()),
        ["tenant-a/new", "tenant-a/web"]
    );
    let next = within("the delta update", delta_stream.recv()).await;
    let values = next
        .resources
        .iter()
        .map(|r| r.resource.as_ref().unwrap().value.to_vec())
        .collect();
    assert_eq!(resource_names(values), ["tenant-a/new"]);
}

// === A full grant is served as without a policy ===

/// An identity whose grant covers every name (by `*`, or by names that
/// happen to match everything) is served the same bytes and versions as
/// a client of a gateway without a policy (clusters) or as the cache holds
/// (secrets), on ADS and the legacy service.
#[tokio::test]
async fn a_grant_of_everything_is_served_the_bytes_and_versions_of_no_policy() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let secrets = Secrets::new(&ca, NAMES);
    let everything = r#"rules:
- identities: ["spiffe://cluster.local/ns/shop/sa/frontend"]
  collections: ["*"]
- identities: ["spiffe://cluster.local/ns/other/sa/x"]
  collections: ["envoy/extensions/transport_sockets/tls/v3/secrets"]
  names: ["shop/*", "other/*"]
- identities: ["spiffe://cluster.local/ns/other/sa/x"]
  collections: ["envoy/config/*"]
"#;
    let gw = gateway(dir.path(), &ca, &secrets, Some(everything)).await;
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = gateway(plain_dir.path(), &ca, &secrets, None).await;

    let read = |addr: SocketAddr, identity: &'static str, type_url: &'static str| {
        let ca = &ca;
        async move {
            let mut stream = SotwStream::open_on(as_identity(addr, ca, identity).await, ADS_SOTW).await;
            stream.send(sotw(type_url, &[], None));
            stream.recv().await
        }
    };
    let whole = gw.cache.get(SECRETS).unwrap();
    for identity in [SHOP, OTHER] {
        let secrets = read(gw.listen, identity, SECRET_TYPE).await;
        assert_eq!(secrets.version_info, whole.version.to_string(), "{identity}");
        assert_eq!(secrets.resources.len(), 3, "{identity}");
        let clusters = read(gw.listen, identity, CLUSTER_TYPE).await;
        let without = read(plain.listen, identity, CLUSTER_TYPE).await;
        assert_eq!(clusters.version_info, without.version_info, "{identity}");
        assert_eq!(clusters.resources, without.resources, "{identity}: byte for byte");
    }
    let shop_bytes = read(gw.listen, SHOP, SECRET_TYPE).await.resources;
    let other_bytes = read(gw.listen, OTHER, SECRET_TYPE).await.resources;
    assert_eq!(shop_bytes, other_bytes, "byte for byte, whichever rule grants it");

    // The legacy service, same versions on both gateways.
    for (addr, identity) in [(gw.listen, OTHER), (plain.listen, OTHER)] {
        let mut legacy = SotwClient::open_on(as_identity(addr, &ca, identity).await, SOTW_PATH).await;
        legacy.subscribe("envoy/config/cluster/v3/clusters");
        let response = legacy.recv().await;
        assert_eq!(
            response.version_info,
            gw.cache
                .get("envoy/config/cluster/v3/clusters")
                .unwrap()
                .version
                .to_string()
        );
    }
}

// === Identities: odd SANs, several SANs, no certificate ===

/// Captures of odd values (a `*`, `..`, a `,`, an empty segment, a
/// segment with `/`) read nothing of shop's secrets; a certificate with
/// several SANs reads what each grants, no more.
#[tokio::test]
async fn odd_and_several_sans_read_only_what_their_own_text_grants() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let sans = SanCa::new();
    let gw = gateway_trusting(dir.path(), &ca, &sans.pem, &Secrets::new(&ca, NAMES), Some(POLICY)).await;

    for odd in [
        "spiffe://cluster.local/ns/*/sa/x",
        "spiffe://cluster.local/ns/../sa/x",
        "spiffe://cluster.local/ns/sho*/sa/x",
        "spiffe://cluster.local/ns/shop,other/sa/x",
    ] {
        let mut stream = SotwStream::open_on(as_identity(gw.listen, &ca, odd).await, ADS_SOTW).await;
        stream.send(sotw(SECRET_TYPE, &[], None));
        let response = stream.recv().await;
        assert_eq!(sotw_names(&response), Vec::<String>::new(), "{odd}");
    }
    for no_capture in [
        "spiffe://cluster.local/ns//sa/x",
        "spiffe://cluster.local/ns/shop/x/sa/y",
        "spiffe://cluster.local/ns/shop",
    ] {
        let mut stream = SotwStream::open_on(as_identity(gw.listen, &ca, no_capture).await, ADS_SOTW).await;
        stream.send(sotw(SECRET_TYPE, &[], None));
        let status = stream.end_status().await;
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{no_capture}: {status:?}");
    }

    // Two SANs: other's SPIFFE id and a DNS name; it reads other's
    // secrets (by its URI SAN), nothing of shop's.
    let two = sans.leaf(&[OTHER], &["x.other.example"]);
    let mut stream = SotwStream::open_on(as_leaf(gw.listen, &ca, &two).await, ADS_SOTW).await;
    stream.send(sotw(SECRET_TYPE, &[], None));
    assert_eq!(sotw_names(&stream.recv().await), ["other/x-cert"]);
    // Both namespaces' ids on one certificate: the grants add up.
    let both = sans.leaf(&[OTHER, SHOP], &[]);
    let mut stream = SotwStream::open_on(as_leaf(gw.listen, &ca, &both).await, ADS_SOTW).await;
    stream.send(sotw(SECRET_TYPE, &[], None));
    assert_eq!(
        sotw_names(&stream.recv().await),
        NAMES.iter().rev().copied().collect::<Vec<_>>()
    );
}

/// A DNS SAN is a host name: one that spells a SPIFFE URI (not a valid
/// DNS name, which a CA that lets a requester choose its DNS names may
/// still sign) is not that URI identity. Istio's principals are URI SANs
/// only.
#[tokio::test]
async fn a_dns_san_that_spells_a_spiffe_uri_is_not_that_identity() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let sans = SanCa::new();
    let gw = gateway_trusting(dir.path(), &ca, &sans.pem, &Secrets::new(&ca, NAMES), Some(POLICY)).await;
    let dns_like = sans.leaf(&[], &[SHOP]);
    let mut stream = SotwStream::open_on(as_leaf(gw.listen, &ca, &dns_like).await, ADS_SOTW).await;
    stream.send(sotw(SECRET_TYPE, &[], None));
    match stream.try_recv().await {
        Ok(response) => panic!("a DNS SAN read shop's secrets: {:?}", sotw_names(&response)),
        Err(status) => assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}"),
    }
}

/// Two grants whose globs print alike must not share what is made for a
/// grant: the restricted view is memoised per version by the grant's key,
/// the globs joined by `,`, and a capture may hold a `,`. Here `ops`
/// reads `root-ca` and `shop/*`; an identity whose namespace segment is
/// `root-ca,shop` is granted `root-ca,shop/*` (nothing that exists), and
/// its key is the same text.
#[tokio::test]
async fn two_grants_that_print_alike_do_not_share_a_view() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let secrets = Secrets::new(&ca, &["root-ca", "shop/frontend-cert", "other/x-cert"]);
    let policy = format!(
        "{POLICY}- identities: [\"spiffe://ops.example/ops\"]\n  collections: [\"{SECRETS}\"]\n  names: [\"root-ca\", \
         \"shop/*\"]\n"
    );
    let gw = gateway(dir.path(), &ca, &secrets, Some(&policy)).await;

    let mut ops = SotwStream::open_on(as_identity(gw.listen, &ca, "spiffe://ops.example/ops").await, ADS_SOTW).await;
    ops.send(sotw(SECRET_TYPE, &[], None));
    assert_eq!(sotw_names(&ops.recv().await), ["root-ca", "shop/frontend-cert"]);

    let odd = "spiffe://cluster.local/ns/root-ca,shop/sa/x";
    let view = get_json(gw.admin, &format!("/debug/access?identity={odd}")).await;
    let secrets_row = view["collections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["collection"] == SECRETS)
        .cloned()
        .unwrap();
    assert_eq!(
        secrets_row["resources_readable"], 0,
        "the policy grants it nothing that exists: {secrets_row}"
    );

    let mut attacker = SotwStream::open_on(as_identity(gw.listen, &ca, odd).await, ADS_SOTW).await;
    attacker.send(sotw(SECRET_TYPE, &[], None));
    assert_eq!(
        sotw_names(&attacker.recv().await),
        Vec::<String>::new(),
        "a grant of `root-ca,shop/*` reads no secret here"
    );
}

/// `unauthenticated` is a client without a certificate (plaintext, or TLS
/// without one): it matches no glob, `*` included, and reads what its own
/// rules grant.
#[tokio::test]
async fn unauthenticated_over_tls_and_plaintext_reads_only_its_own_rules() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    Secrets::new(&ca, NAMES).write(&dir.path().join("source"));
    let policy = format!(
        "rules:\n- identities: [\"*\"]\n  collections: [\"{SECRETS}\"]\n- identities: [unauthenticated]\n  \
         collections: [\"envoy/config/*\"]\n"
    );
    let flags = tls_flags(dir.path(), &ca, Some(&policy), false);
    let gw = start_gateway(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await;

    // The same policy on a plaintext gateway.
    let plain_dir = tempfile::tempdir().unwrap();
    Secrets::new(&ca, NAMES).write(&plain_dir.path().join("source"));
    std::fs::write(plain_dir.path().join("policy.yaml"), &policy).unwrap();
    let plain = start_gateway(&[
        "--source-dir",
        &path(&plain_dir.path().join("source")),
        "--access-policy",
        &path(&plain_dir.path().join("policy.yaml")),
    ])
    .await;

    let clients = [
        (
            "TLS without a certificate",
            tls_channel(gw.listen, &ca.pem, None).await.unwrap(),
        ),
        ("plaintext", crate::helpers::clients::channel(plain.listen).await),
    ];
    for (what, channel) in clients {
        let mut secrets = SotwStream::open_on(channel.clone(), ADS_SOTW).await;
        secrets.send(sotw(SECRET_TYPE, &[], None));
        let status = secrets.end_status().await;
        assert_eq!(status.code(), tonic::Code::PermissionDenied, "{what}: {status:?}");
        assert!(status.message().contains("unauthenticated"), "{what}: {status:?}");
        let mut clusters = SotwStream::open_on(channel, ADS_SOTW).await;
        clusters.send(sotw(CLUSTER_TYPE, &[], None));
        assert_eq!(clusters.recv().await.resources.len(), 1, "{what}");
    }
    // Without --client-ca nothing checks a certificate: one a client made
    // itself, naming shop's identity, proves nothing and is not matched
    // by `*`.
    let forged = SanCa::new().leaf(&[SHOP], &[]);
    let mut forger = SotwStream::open_on(as_leaf(gw.listen, &ca, &forged).await, ADS_SOTW).await;
    forger.send(sotw(SECRET_TYPE, &[], None));
    let status = forger.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("identity unauthenticated"), "{status:?}");
}

/// Under `--client-ca`, a certificate the CA signed with neither a URI
/// nor a DNS SAN (an IP SAN only) is a certificate: it is not
/// `unauthenticated` ("matches only clients without a certificate"), and
/// reads nothing the policy grants `unauthenticated`.
#[tokio::test]
async fn a_certificate_without_uri_or_dns_sans_is_not_unauthenticated() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let policy = format!("rules:\n- identities: [unauthenticated]\n  collections: [\"{SECRETS}\"]\n");
    let sans = SanCa::new();
    let gw = gateway_trusting(dir.path(), &ca, &sans.pem, &Secrets::new(&ca, NAMES), Some(&policy)).await;
    let ip_only = sans.leaf(&[], &[]);
    let mut stream = SotwStream::open_on(as_leaf(gw.listen, &ca, &ip_only).await, ADS_SOTW).await;
    stream.send(sotw(SECRET_TYPE, &[], None));
    match stream.try_recv().await {
        Ok(response) => panic!(
            "a certificate holder was served unauthenticated's secrets: {:?}",
            sotw_names(&response)
        ),
        Err(status) => assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}"),
    }
}

// === Nothing sensitive printed ===

/// A run of the real binary that served secrets to granted clients and
/// withheld them from others: no line of any private key's base64 body in
/// its log, the admin views (the config dump as JSON and YAML, syncz,
/// clients, access, config, the HTML index) or `status`.
#[tokio::test]
async fn no_key_material_in_the_log_the_admin_views_or_status() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let secrets = Secrets::new(&ca, NAMES);
    secrets.write(&dir.path().join("source"));
    let flags = tls_flags(dir.path(), &ca, Some(POLICY), true);
    let mut gw = spawn_gateway(None, &flags.iter().map(String::as_str).collect::<Vec<_>>()).await;

    let mut shop = SotwStream::open_on(as_identity(gw.listen, &ca, SHOP).await, ADS_SOTW).await;
    shop.send(sotw(SECRET_TYPE, &["shop/frontend-cert", "other/x-cert"], None));
    let served = shop.recv().await;
    assert_eq!(sotw_names(&served), ["shop/frontend-cert"]);
    shop.send(sotw(
        SECRET_TYPE,
        &["shop/frontend-cert", "other/x-cert"],
        Some(&served),
    ));
    let mut other = DeltaStream::open_on(as_identity(gw.listen, &ca, OTHER).await, ADS_DELTA).await;
    other.send(delta(&["*", "shop/frontend-cert"], &[], None));
    other.recv().await;
    let mut refused = SotwStream::open_on(as_identity(gw.listen, &ca, OTHER).await, ADS_SOTW).await;
    refused.send(sotw(CLUSTER_TYPE, &[], None));
    refused.end_status().await;
    gw.log_line("access denied").await;

    let mut shown = Vec::new();
    for view in [
        "/debug/syncz",
        "/debug/clients",
        "/debug/config",
        "/debug/cache",
        &format!("/debug/cache/{SECRETS}?bodies=json"),
        &format!("/debug/cache/{SECRETS}?bodies=yaml"),
        &format!("/debug/access?identity={SHOP}"),
        "/",
    ] {
        let (code, body) = http_get(gw.admin, view).await;
        assert_eq!(code, 200, "{view}: {body}");
        shown.push((view.to_owned(), body));
    }
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    shown.push(("status".into(), mcp_xds_gateway::tools::status::render(&syncz)));
    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    shown.push(("/metrics".into(), metrics));

    gw.child.start_kill().unwrap();
    within("the gateway to exit", gw.child.wait()).await.unwrap();
    let mut log = gw.log.join("\n");
    while let Ok(line) = gw.later.try_recv() {
        log.push('\n');
        log.push_str(&line);
    }
    assert!(log.contains("access denied"), "the log was read: {log}");
    shown.push(("the log".into(), log));

    let keys = secrets.key_lines();
    assert!(keys.len() > 3, "the keys' lines are looked for");
    for (view, text) in &shown {
        for line in &keys {
            assert!(!text.contains(line.as_str()), "{view} holds a line of a private key");
        }
    }
    // The dump shows the secrets are there, with the key redacted.
    let (_, yaml) = &shown[5];
    assert!(
        yaml.contains("shop/frontend-cert") && yaml.contains("[redacted]"),
        "{yaml}"
    );
}

// === A real Envoy over delta ADS ===

/// A listener on `port` terminating TLS with the SDS secret `secret`, and
/// proxying to the cluster `backend` (a network filter: no route).
fn tls_listener_doc(port: u16, secret: &str) -> String {
    let listener = serde_json::json!({
        "name": "tls",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{
            "transport_socket": {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "common_tls_context": {"tls_certificate_sds_secret_configs": [
                        {"name": secret, "sds_config": {"ads": {}, "resource_api_version": "V3"}}
                    ]},
                },
            },
            "filters": [{
                "name": "envoy.filters.network.tcp_proxy",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "tls",
                    "cluster": "backend",
                },
            }],
        }],
    });
    format!(
        "collection: envoy/config/listener/v3/listeners\nname: tls\nbody:\n  type_url: \
         type.googleapis.com/envoy.config.listener.v3.Listener\n  json: {listener}\n"
    )
}

/// Envoy (delta ADS, mTLS as `other`'s identity) whose listener names
/// shop's certificate: never sent it (no line of the certificate or the
/// key in its config dump or log); a reload that grants it sends it (the
/// certificate in the dump, the key `[redacted]` by Envoy, never in
/// clear); a reload that takes it back withholds it from that stream
/// again.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn a_delta_envoy_of_another_namespace_reads_shops_certificate_only_while_a_reload_grants_it() {
    use crate::helpers::envoy::{AdsApi, Envoy};
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("review-ca");
    let secrets = Secrets::new(&ca, NAMES);
    let listen = crate::helpers::free_addr();
    secrets.write(&dir.path().join("source"));
    std::fs::write(
        dir.path().join("source/listener.yaml"),
        tls_listener_doc(listen.port(), "shop/frontend-cert"),
    )
    .unwrap();
    // `other` reads Envoy's config and its own namespace's secrets.
    let denied = POLICY.replace(
        "[\"spiffe://cluster.local/ns/shop/sa/*\", \"unauthenticated\"]",
        "[\"spiffe://cluster.local/ns/shop/sa/*\", \"spiffe://cluster.local/ns/other/sa/*\"]",
    );
    let flags = tls_flags(dir.path(), &ca, Some(&denied), true);
    let gw = start_gateway(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await;

    let config = crate::access::mtls_bootstrap_with(AdsApi::Delta, gw.listen, &ca, OTHER, dir.path(), "other-envoy");
    let envoy = Envoy::start_with(config).await.unwrap();
    let withheld = || async {
        eventually_some("shop's certificate withheld from other's Envoy", || async {
            let view = get_json(gw.admin, "/debug/syncz").await;
            view["rows"]
                .as_array()?
                .iter()
                .find(|r| {
                    crate::access::has_uri_san(&r["identity"], OTHER)
                        && r["type_url"] == SECRET_TYPE
                        && r["access"]["withheld"] == 1
                })
                .map(|_| ())
        })
        .await
    };
    withheld().await;
    // A line of the certificate's body: in Envoy's dump once it was sent.
    let frontend = &secrets.leaves[0].1;
    let cert_line = frontend.cert.lines().nth(2).unwrap().to_owned();
    let keys = secrets.key_lines();
    let dump = envoy.config_dump().await.to_string();
    assert!(!dump.contains(&cert_line), "shop's certificate reached other's Envoy");
    for text in [&dump, &envoy.log()] {
        assert!(
            keys.iter().all(|k| !text.contains(k.as_str())),
            "a line of a key in Envoy"
        );
    }

    // Granted by a reload: sent; Envoy shows the key redacted.
    let granted =
        format!("{denied}- identities: [\"{OTHER}\"]\n  collections: [\"{SECRETS}\"]\n  names: [shop/frontend-cert]\n");
    std::fs::write(dir.path().join("policy.yaml"), &granted).unwrap();
    let dump = envoy
        .dump_matches("shop's certificate in Envoy", |dump| {
            dump.to_string().contains(&cert_line)
        })
        .await
        .to_string();
    assert!(dump.contains("[redacted]"), "Envoy redacts the key it holds");
    assert!(
        keys.iter().all(|k| !dump.contains(k.as_str())),
        "a line of a key in Envoy's dump"
    );

    // Taken back: the gateway withholds it from that stream again.
    std::fs::write(dir.path().join("policy.yaml"), &denied).unwrap();
    withheld().await;
}

// === Certificates with exactly the SANs a test gives ===

/// A CA of this module's own, for leaves with exactly the SANs a test
/// gives (the shared helper adds localhost and 127.0.0.1 as DNS SANs to
/// every leaf). The gateway trusts it beside the test's CA.
struct SanCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl SanCa {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "review-san-ca");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
        let pem = issuer.pem();
        Self { issuer, pem }
    }

    /// A client leaf with these URI and DNS SANs and an IP SAN
    /// (127.0.0.1), nothing else.
    fn leaf(&self, uris: &[&str], dns: &[&str]) -> Leaf {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "review-client");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        for uri in uris {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI((*uri).try_into().unwrap()));
        }
        for name in dns {
            params
                .subject_alt_names
                .push(rcgen::SanType::DnsName((*name).try_into().unwrap()));
        }
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}
