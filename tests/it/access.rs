//! Who may read what (`--access-policy`): identities TLS proved, granted
//! collections and names, on every protocol; secrets to nobody without a
//! policy; a reload takes away what it no longer grants.

use std::net::SocketAddr;
use std::path::Path;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use mcp_xds_gateway::proto::MeshConfigRequest;
use tonic::transport::Channel;

use crate::helpers::certs::{write, write_leaf, Ca, Leaf};
use crate::helpers::clients::{channel, node, tls_channel, Bidi, PilotSink, SotwClient, SOTW_PATH};
use crate::helpers::{eventually_some, get_json, http_get, start_gateway, within, VS};

pub(crate) const SOTW: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub(crate) const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
pub(crate) const SECRET_TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
pub(crate) const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub(crate) const SECRETS: &str = "envoy/extensions/transport_sockets/tls/v3/secrets";

pub(crate) const FRONTEND: &str = "spiffe://cluster.local/ns/shop/sa/frontend";
pub(crate) const OTHER: &str = "spiffe://cluster.local/ns/other/sa/x";
pub(crate) const ISTIOD: &str = "spiffe://cluster.local/ns/istio-system/sa/istiod";

pub(crate) type SotwStream = Bidi<DiscoveryRequest, DiscoveryResponse>;
type DeltaStream = Bidi<DeltaDiscoveryRequest, DeltaDiscoveryResponse>;

/// The policy of the issue: each namespace its own secrets, istiod the
/// Istio kinds, plaintext clients Envoy's config.
pub(crate) const POLICY: &str = r#"rules:
- identities: ["spiffe://cluster.local/ns/{namespace}/sa/*"]
  collections: ["envoy/extensions/transport_sockets/tls/v3/secrets"]
  names: ["{namespace}/*"]
- identities: ["spiffe://cluster.local/ns/istio-system/sa/istiod*"]
  collections: ["istio/*"]
- identities: ["spiffe://cluster.local/ns/shop/sa/*", "unauthenticated"]
  collections: ["envoy/config/*"]
"#;

/// A files-source document of an Envoy `Secret` with a TLS certificate and
/// its key.
pub(crate) fn secret_doc(name: &str, leaf: &Leaf) -> String {
    let indent = |pem: &str| pem.trim_end().replace('\n', "\n          ");
    format!(
        "collection: {SECRETS}\nname: {name}\nbody:\n  type_url: {SECRET_TYPE}\n  json:\n    name: {name}\n    \
         tls_certificate:\n      certificate_chain:\n        inline_string: |\n          {}\n      private_key:\n        \
         inline_string: |\n          {}\n",
        indent(&leaf.cert),
        indent(&leaf.key)
    )
}

fn cluster_doc(name: &str) -> String {
    format!(
        "collection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: {CLUSTER_TYPE}\n  json:\n    \
         name: {name}\n    connect_timeout: 1s\n"
    )
}

/// A source directory with secrets of two namespaces and a cluster.
pub(crate) fn source_dir(dir: &Path, ca: &Ca) {
    let docs = [
        secret_doc("shop/frontend-cert", &ca.leaf("frontend.shop")),
        secret_doc("shop/backend-cert", &ca.leaf("backend.shop")),
        secret_doc("other/x-cert", &ca.leaf("x.other")),
        cluster_doc("backend"),
    ];
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.yaml"), docs.join("---\n")).unwrap();
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// A gateway over mTLS on `dir/source`, with `policy` (if any) at
/// `dir/policy.yaml`.
async fn mtls_gateway(dir: &Path, ca: &Ca, policy: Option<&str>) -> mcp_xds_gateway::app::Bound {
    let flags = mtls_flags(dir, ca, policy);
    start_gateway(&flags.iter().map(String::as_str).collect::<Vec<_>>()).await
}

/// As [`mtls_gateway`], as a process of its own: its metrics are its own.
async fn mtls_gateway_process(dir: &Path, ca: &Ca, policy: Option<&str>) -> crate::helpers::Running {
    let flags = mtls_flags(dir, ca, policy);
    crate::helpers::spawn_gateway(None, &flags.iter().map(String::as_str).collect::<Vec<_>>()).await
}

/// The flags of a gateway serving [`source_dir`] over mTLS with `policy`.
pub(crate) fn mtls_flags(dir: &Path, ca: &Ca, policy: Option<&str>) -> Vec<String> {
    source_dir(&dir.join("source"), ca);
    let (cert, key) = write_leaf(dir, "server", &ca.leaf("gateway"));
    let ca_path = write(dir, "client-ca.pem", &ca.pem);
    let (cert, key, ca_path, source) = (path(&cert), path(&key), path(&ca_path), path(&dir.join("source")));
    let policy_path = path(&dir.join("policy.yaml"));
    let mut flags = vec![
        "--source-dir",
        &source,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--client-ca",
        &ca_path,
    ];
    if let Some(policy) = policy {
        std::fs::write(&policy_path, policy).unwrap();
        flags.extend(["--access-policy", &policy_path]);
    }
    flags.into_iter().map(str::to_owned).collect()
}

pub(crate) async fn as_identity(addr: SocketAddr, ca: &Ca, identity: &str) -> Channel {
    tls_channel(addr, &ca.pem, Some(&ca.spiffe_leaf(identity)))
        .await
        .unwrap()
}

fn envoy(id: &str) -> Option<Node> {
    Some(Node {
        id: id.into(),
        ..Default::default()
    })
}

/// A `Secret`'s name (field 1), the rest of it left unread.
#[derive(Clone, PartialEq, prost::Message)]
struct SecretName {
    #[prost(string, tag = "1")]
    name: String,
}

pub(crate) fn names_of(response: &DiscoveryResponse) -> Vec<String> {
    use prost::Message;
    let mut names: Vec<String> = response
        .resources
        .iter()
        .map(|any| SecretName::decode(&any.value[..]).unwrap().name)
        .collect();
    names.sort();
    names
}

pub(crate) fn sotw_request(type_url: &str, names: &[&str], ack: Option<&DiscoveryResponse>) -> DiscoveryRequest {
    DiscoveryRequest {
        node: envoy("sidecar~10.0.0.1~frontend.shop~shop.svc.cluster.local"),
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: ack.map(|r| r.version_info.clone()).unwrap_or_default(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

/// Whether an identity as the views print it (each SAN with its kind, `, `
/// between) holds the URI SAN `uri`.
pub fn has_uri_san(printed: &serde_json::Value, uri: &str) -> bool {
    printed
        .as_str()
        .is_some_and(|p| p.split(", ").any(|san| san.strip_prefix("uri:") == Some(uri)))
}

/// The `/debug/syncz` row of the one stream of `identity` for `type_url`.
async fn syncz_row(admin: SocketAddr, identity: &str, type_url: &str, what: &str) -> serde_json::Value {
    eventually_some(what, || async {
        let view = get_json(admin, "/debug/syncz").await;
        view["rows"]
            .as_array()?
            .iter()
            .find(|r| has_uri_san(&r["identity"], identity) && r["type_url"] == type_url && r["acked"].is_object())
            .cloned()
    })
    .await
}

#[tokio::test]
async fn each_namespace_reads_its_own_secrets_by_name_and_by_wildcard() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = mtls_gateway(dir.path(), &ca, Some(POLICY)).await;

    // State of the world, by name: the other namespace's secret is absent.
    let mut frontend = SotwStream::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW).await;
    let asked = ["shop/frontend-cert", "other/x-cert"];
    frontend.send(sotw_request(SECRET_TYPE, &asked, None));
    let first = frontend.recv().await;
    assert_eq!(names_of(&first), vec!["shop/frontend-cert"]);
    frontend.send(sotw_request(SECRET_TYPE, &asked, Some(&first)));
    let row = syncz_row(gw.admin, FRONTEND, SECRET_TYPE, "the frontend's ACK").await;
    assert_eq!(row["status"], "SYNCED", "{row}");
    assert_eq!(row["access"]["status"], "DENIED", "{row}");
    assert_eq!(row["access"]["withheld"], 1, "one name asked for is withheld: {row}");
    assert_eq!(
        row["current_version"], first.version_info,
        "synced at the version of its own view"
    );
    let table = mcp_xds_gateway::tools::status::render(&get_json(gw.admin, "/debug/syncz").await);
    assert!(table.contains("SYNCED DENIED 1"), "{table}");
    assert!(
        table.contains(&format!("DENIED sidecar~10.0.0.1~frontend.shop~shop.svc.cluster.local {SECRETS}: 1 withheld from identity uri:{FRONTEND}, dns:localhost")),
        "{table}"
    );

    // Wildcard: every secret of its namespace, nothing else.
    let mut wildcard = SotwStream::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW).await;
    wildcard.send(sotw_request(SECRET_TYPE, &[], None));
    let all = wildcard.recv().await;
    assert_eq!(names_of(&all), vec!["shop/backend-cert", "shop/frontend-cert"]);
    // A NACK of a secret may quote it (Envoy's validation errors do): its
    // message is kept by no view, log or `status` (the thirty-first check of
    // issue 42), its length is.
    let mut nack = sotw_request(SECRET_TYPE, &[], None);
    nack.response_nonce = all.nonce.clone();
    nack.error_detail = Some(tonic_types::Status {
        code: tonic::Code::InvalidArgument as i32,
        message: "inline_string: \"MARKER-NACKED-SECRET\" password=MARKER-PW".into(),
        ..Default::default()
    });
    wildcard.send(nack);
    let clients = eventually_some("the NACK recorded", || async {
        let view = get_json(gw.admin, "/debug/clients").await.to_string();
        view.contains("a NACK of a collection of secrets").then_some(view)
    })
    .await;
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    let table = mcp_xds_gateway::tools::status::render(&syncz);
    for shown in [&clients, &syncz.to_string(), &table] {
        assert!(!shown.contains("MARKER"), "{shown}");
    }

    // Delta: subscribed to both, sent its own, never the other.
    let mut delta = DeltaStream::open_on(as_identity(gw.listen, &ca, OTHER).await, DELTA).await;
    delta.send(DeltaDiscoveryRequest {
        node: envoy("sidecar~10.0.0.2~x.other~other.svc.cluster.local"),
        type_url: SECRET_TYPE.into(),
        resource_names_subscribe: vec!["shop/frontend-cert".into(), "other/x-cert".into()],
        ..Default::default()
    });
    let response = delta.recv().await;
    let sent: Vec<&str> = response.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(sent, vec!["other/x-cert"]);
    assert_eq!(
        response.removed_resources,
        vec!["shop/frontend-cert"],
        "a name it may not read is, for it, a name that does not exist"
    );
}

#[tokio::test]
async fn a_type_no_rule_grants_ends_the_stream_permission_denied_on_every_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = mtls_gateway(dir.path(), &ca, Some(POLICY)).await;

    // Envoy's ADS: clusters are not granted to the other namespace.
    let mut other = SotwStream::open_on(as_identity(gw.listen, &ca, OTHER).await, SOTW).await;
    other.send(sotw_request(CLUSTER_TYPE, &[], None));
    let status = other.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    let would = format!(
        "a rule that would: {{identities: [\"{OTHER}\"], collections: [\"envoy/config/cluster/v3/clusters\"], names: \
         [\"*\"]}}"
    );
    for needed in [
        CLUSTER_TYPE,
        &format!("identity uri:{OTHER}, dns:localhost may not read"),
        "no rule of --access-policy grants it",
        &would,
    ] {
        assert!(
            status.message().contains(needed),
            "{needed:?} in {:?}",
            status.message()
        );
    }
    // Neither the policy's file nor its rules reach the client.
    assert!(
        !status.message().contains("policy.yaml") && !status.message().contains("rules["),
        "{:?}",
        status.message()
    );

    // The legacy service: a Pilot without istio/* is refused naming the collection...
    let mut pilot = SotwClient::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW_PATH).await;
    pilot.send(MeshConfigRequest {
        sink_node: node(),
        type_url: VS.into(),
        ..Default::default()
    });
    let status = pilot.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains(VS), "{:?}", status.message());
    assert!(status.message().contains(FRONTEND), "{:?}", status.message());

    // ... and istiod's identity is served as before.
    let mut istiod = SotwClient::open_on(as_identity(gw.listen, &ca, ISTIOD).await, SOTW_PATH).await;
    istiod.send(MeshConfigRequest {
        sink_node: node(),
        type_url: VS.into(),
        ..Default::default()
    });
    let response = istiod.recv().await;
    assert_eq!(response.type_url, VS);
    assert_eq!(response.version_info, gw.cache.get(VS).unwrap().version.to_string());

    // ResourceSource (a Pilot 1.2+ sink, a chained gateway): the same rule.
    let mut sink = PilotSink::connect_on(as_identity(gw.listen, &ca, FRONTEND).await, &[VS], false).await;
    let status = sink.stream.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains(VS) && status.message().contains(FRONTEND),
        "{status:?}"
    );
    let mut sink = PilotSink::connect_on(as_identity(gw.listen, &ca, ISTIOD).await, &[VS], false).await;
    let resources = sink.recv_and_ack().await;
    assert_eq!(resources.collection, VS);
    assert_eq!(
        resources.system_version_info,
        gw.cache.get(VS).unwrap().version.to_string()
    );
}

#[tokio::test]
async fn without_a_policy_secrets_go_to_nobody_and_the_rest_to_everyone() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    source_dir(&dir.path().join("source"), &ca);
    let source = path(&dir.path().join("source"));
    let gw = start_gateway(&["--source-dir", &source]).await;

    let mut clusters = SotwStream::open_on(channel(gw.listen).await, SOTW).await;
    clusters.send(sotw_request(CLUSTER_TYPE, &[], None));
    assert_eq!(clusters.recv().await.resources.len(), 1);

    let mut secrets = SotwStream::open_on(channel(gw.listen).await, SOTW).await;
    secrets.send(sotw_request(SECRET_TYPE, &["shop/frontend-cert"], None));
    let status = secrets.end_status().await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    for needed in [
        SECRET_TYPE,
        "unauthenticated",
        "no --access-policy is given",
        "an --access-policy rule naming this identity and collection would grant it",
    ] {
        assert!(
            status.message().contains(needed),
            "{needed:?} in {:?}",
            status.message()
        );
    }
}

#[tokio::test]
async fn a_reload_that_takes_a_grant_away_ends_the_stream_and_a_bad_file_keeps_the_last_good() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    // A process of its own: the reload and denial counts are this test's.
    let mut gw = mtls_gateway_process(dir.path(), &ca, Some(POLICY)).await;
    let policy = dir.path().join("policy.yaml");

    let mut frontend = SotwStream::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW).await;
    frontend.send(sotw_request(CLUSTER_TYPE, &[], None));
    let first = frontend.recv().await;
    frontend.send(sotw_request(CLUSTER_TYPE, &[], Some(&first)));

    // Waits until `count` reloads failed.
    let monitoring = gw.monitoring;
    let reload_errors_are = |count: f64| {
        eventually_some("the bad policy to be read", move || async move {
            let (_, metrics) = http_get(monitoring, "/metrics").await;
            let errors = crate::helpers::sample(
                &metrics,
                "mcp_gateway_access_policy_reloads_total",
                &["result=\"error\""],
            );
            errors.filter(|e| *e == count).map(|_| ())
        })
    };

    // A bad file: the last good policy stays (the stream goes on).
    std::fs::write(&policy, "rules:\n- identities: [a]\n  collections: [c]\n  nmes: [x]\n").unwrap();
    reload_errors_are(1.0).await;
    let shown = get_json(gw.admin, "/debug/config").await;
    assert_eq!(shown["access_policy"]["rules"].as_array().unwrap().len(), 3);
    let first = gw.log_line("does not load").await;
    assert!(first.contains("nmes"), "{first}");

    // A dead rule (a SPIFFE id without its scheme: it could match only a
    // DNS SAN spelling one, and none matches) is refused as the flags refuse
    // it: the last good policy stays, counted and logged like any bad file,
    // naming the file, the rule, its line and what to write instead.
    std::fs::write(
        &policy,
        POLICY.replace(
            "[\"spiffe://cluster.local/ns/shop/sa/*\", \"unauthenticated\"]",
            "[\"cluster.local/ns/shop/sa/*\", \"unauthenticated\"]",
        ),
    )
    .unwrap();
    let refused = gw.log_line("does not load").await;
    for needed in [
        format!("{}:7: rules[2].identities[0]", policy.display()).as_str(),
        "cluster.local/ns/shop/sa/*",
        "spiffe://",
    ] {
        assert!(refused.contains(needed), "{needed:?} in {refused}");
    }
    reload_errors_are(2.0).await;
    let shown = get_json(gw.admin, "/debug/config").await;
    assert_eq!(
        shown["access_policy"]["rules"][2]["identities"][0],
        "spiffe://cluster.local/ns/shop/sa/*"
    );

    // Clusters no longer granted to shop: its stream ends.
    std::fs::write(
        &policy,
        POLICY.replace(
            "[\"spiffe://cluster.local/ns/shop/sa/*\", \"unauthenticated\"]",
            "[\"unauthenticated\"]",
        ),
    )
    .unwrap();
    let status = within("the reload to end the stream", frontend.end_status()).await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains(CLUSTER_TYPE), "{:?}", status.message());
    // Counted: two bad files, one good reload, one collection refused.
    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    let count = |name: &str, labels: &[&str]| crate::helpers::sample(&metrics, name, labels);
    assert_eq!(
        count("mcp_gateway_access_policy_reloads_total", &["result=\"error\""]),
        Some(2.0)
    );
    assert_eq!(
        count("mcp_gateway_access_policy_reloads_total", &["result=\"ok\""]),
        Some(1.0)
    );
    assert_eq!(
        count(
            "mcp_gateway_access_denied_total",
            &[
                "collection=\"envoy/config/cluster/v3/clusters\"",
                "reason=\"collection\""
            ]
        ),
        Some(1.0),
        "{metrics}"
    );
}

/// An access denial is logged with the identity and the collection, once
/// per identity and collection per 10 s: a client asking again and again
/// cannot flood the log; another identity's denial is logged at once. A
/// process of its own: its log and counts are this test's.
#[tokio::test]
async fn an_access_denial_is_logged_once_per_identity_and_collection_per_ten_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let mut gw = mtls_gateway_process(dir.path(), &ca, Some(POLICY)).await;
    let (listen, monitoring) = (gw.listen, gw.monitoring);
    // No rule grants clusters to the other namespace.
    let denied = |identity: &'static str| {
        let ca = &ca;
        async move {
            let mut stream = SotwStream::open_on(as_identity(listen, ca, identity).await, SOTW).await;
            stream.send(sotw_request(CLUSTER_TYPE, &[], None));
            let status = within("the denial", stream.end_status()).await;
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
        }
    };
    let denials = |count: u64| async move {
        let series =
            "mcp_gateway_access_denied_total{collection=\"envoy/config/cluster/v3/clusters\",reason=\"collection\"}";
        crate::limits::metric_is(monitoring, series, count).await;
    };
    denied(OTHER).await;
    denials(1).await;
    let line = gw.log_line("access denied").await;
    assert!(
        line.contains(OTHER) && line.contains("envoy/config/cluster/v3/clusters"),
        "names the identity and the collection: {line}"
    );
    // Again within 10 s: counted, not logged. Another identity's denial,
    // after it, is the marker.
    denied(OTHER).await;
    denials(2).await;
    const ELSE: &str = "spiffe://cluster.local/ns/else/sa/y";
    denied(ELSE).await;
    let lines = gw.lines_until(ELSE).await;
    let logged: Vec<_> = lines.iter().filter(|l| l.contains("access denied")).collect();
    assert_eq!(logged.len(), 1, "only the other identity's: {lines:#?}");
    assert!(logged[0].contains(ELSE), "{lines:#?}");
    denials(3).await;
}

#[tokio::test]
async fn debug_access_answers_what_an_identity_would_read() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let gw = mtls_gateway(dir.path(), &ca, Some(POLICY)).await;
    let view = get_json(gw.admin, &format!("/debug/access?identity={FRONTEND}")).await;
    let row = |collection: &str| {
        view["collections"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["collection"] == collection)
            .cloned()
            .unwrap()
    };
    let secrets = row(SECRETS);
    assert_eq!(secrets["reads"], "names", "{secrets}");
    assert_eq!(secrets["names"], serde_json::json!(["shop/*"]));
    assert_eq!(secrets["resources_readable"], 2);
    assert_eq!(secrets["resources_cached"], 3);
    assert_eq!(secrets["sensitive"], true);
    assert_eq!(row("envoy/config/cluster/v3/clusters")["reads"], "all");
    assert_eq!(row(VS)["reads"], "nothing");
    assert_eq!(
        view["identity"],
        format!("uri:{FRONTEND}"),
        "a SAN with a scheme:// is a URI SAN"
    );
    // The rules that name each collection, by index and line.
    assert_eq!(
        secrets["rules"],
        serde_json::json!([{"rule": 0, "line": 2, "identities": ["spiffe://cluster.local/ns/{namespace}/sa/*"],
            "names": ["{namespace}/*"]}])
    );
    assert_eq!(
        row(VS)["rules"],
        serde_json::json!([{"rule": 1, "line": 5, "identities": ["spiffe://cluster.local/ns/istio-system/sa/istiod*"],
            "names": ["*"]}]),
        "the rule that would grant it, for the operator"
    );
    // A DNS SAN spelling the same id is granted nothing; with its kind, the
    // URI SAN reads as before.
    let spelled = get_json(gw.admin, &format!("/debug/access?identity=dns:{FRONTEND}")).await;
    assert_eq!(spelled["identity"], format!("dns:{FRONTEND}"));
    assert!(
        spelled["collections"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["reads"] == "nothing"),
        "{spelled}"
    );
    let kinded = get_json(gw.admin, &format!("/debug/access?identity=uri:{FRONTEND}")).await;
    assert_eq!(kinded["collections"], view["collections"]);
    let (code, body) = http_get(gw.admin, "/debug/access").await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("?identity="), "{body}");
}

/// The bad-input rows of `--access-policy`: each exits 2 at start with one
/// line naming the flag, the file, the line and the field.
#[tokio::test]
async fn a_bad_policy_at_start_exits_2_naming_the_file_the_line_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let missing = dir.path().join("missing.yaml").to_str().unwrap().to_owned();
    let cases = [
        (missing.clone(), format!("{missing}: cannot read it")),
        (
            file("unparsable.yaml", "rules:\n- identities: [a\n  collections: [c]\n"),
            "unparsable.yaml:".into(),
        ),
        (
            file(
                "unknown.yaml",
                "rules:\n- identities: [a]\n  collections: [c]\n  nmes: [x]\n",
            ),
            "unknown.yaml:4: rules[0]: unknown field `nmes`".into(),
        ),
        (
            file(
                "capture.yaml",
                "rules:\n- identities: [\"spiffe://x/sa/*\"]\n  collections: [c]\n  names: [\"{namespace}/*\"]\n",
            ),
            "capture.yaml:4: rules[0].names[0]: uses {namespace}, which the rule's identity \"spiffe://x/sa/*\" does \
             not capture"
                .into(),
        ),
        // A capture taken twice would grant `shop/*` to `…/ns/shop/sa/x`
        // by whichever segment it matched: refused, naming the line.
        (
            file(
                "twice.yaml",
                "rules:\n- identities: [\"spiffe://x/*\"]\n  collections: [c]\n- identities:\n  - \"spiffe://cluster.local/ns/{ns}/sa/{ns}\"\n  collections: [c]\n  names: [\"{ns}/*\"]\n",
            ),
            "twice.yaml:5: rules[1].identities[0]: \"spiffe://cluster.local/ns/{ns}/sa/{ns}\": captures {ns} twice".into(),
        ),        // Nested past the YAML reader's depth limit (128): refused at the
        // first collection too deep, without reading the rest (libyaml's
        // scanner is quadratic in the depth of flow collections).
        (
            file("deep.yaml", &format!("rules:\n- identities: {}\n", "[".repeat(400_000))),
            "deep.yaml:2: rules[0].identities[0]: invalid type: sequence, expected a string".into(),
        ),
    ];
    for (path, expected) in cases {
        let (code, stderr) = crate::process::run(&["--access-policy", &path]).await;
        assert_eq!(code, Some(2), "{path}: {stderr}");
        assert!(stderr.contains("--access-policy"), "names the flag: {stderr}");
        assert!(stderr.contains(&expected), "{expected:?} in {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
}

/// A listener on `port` whose certificate comes by SDS over ADS (the
/// secret `secret`), answering HTTP with a fixed 200.
fn sds_listener_doc(port: u16, secret: &str) -> String {
    format!(
        r#"collection: envoy/config/listener/v3/listeners
name: https
body:
  type_url: type.googleapis.com/envoy.config.listener.v3.Listener
  json:
    name: https
    address:
      socket_address: {{address: 127.0.0.1, port_value: {port}}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificate_sds_secret_configs:
            - name: {secret}
              sds_config: {{ads: {{}}, resource_api_version: V3}}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: https
          route_config:
            name: local
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: /}}
                direct_response: {{status: 200, body: {{inline_string: ok}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}

/// The example bootstrap, with mTLS to the gateway as `identity` (its
/// certificate and key, and the CA, written to `dir`), state of the world.
fn mtls_bootstrap(gateway: SocketAddr, ca: &Ca, identity: &str, dir: &Path, node_id: &str) -> serde_json::Value {
    mtls_bootstrap_with(crate::helpers::envoy::AdsApi::Sotw, gateway, ca, identity, dir, node_id)
}

/// [`mtls_bootstrap`], over `api`.
pub(crate) fn mtls_bootstrap_with(
    api: crate::helpers::envoy::AdsApi,
    gateway: SocketAddr,
    ca: &Ca,
    identity: &str,
    dir: &Path,
    node_id: &str,
) -> serde_json::Value {
    use crate::helpers::envoy::bootstrap;
    let name = node_id.replace(['~', '.'], "-");
    let (cert, key) = write_leaf(dir, &name, &ca.spiffe_leaf(identity));
    let ca_path = write(dir, "envoy-ca.pem", &ca.pem);
    let mut bootstrap = bootstrap(gateway, api, node_id);
    bootstrap["static_resources"]["clusters"][0]["transport_socket"] = serde_json::json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": "localhost",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificates": [{
                    "certificate_chain": {"filename": path(&cert)},
                    "private_key": {"filename": path(&key)},
                }],
                "validation_context": {"trusted_ca": {"filename": path(&ca_path)}},
            },
        },
    });
    bootstrap
}

/// The certificate a TLS server at `addr` presents (trusting `ca`), as DER.
async fn presented_certificate(addr: SocketAddr, ca: &Ca) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap())
        .unwrap();
    let config =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, session) = tls.get_ref();
    session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| "no certificate".into())
}

fn der_of(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

/// Envoy over mTLS gets its listener's certificate by SDS over ADS, as its
/// identity's policy grants, and serves HTTPS with it; an Envoy of another
/// namespace asking for the same secret is not sent it (its listener stays
/// warming); an Envoy no rule grants clusters is refused them by name.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn envoy_over_mtls_reads_its_own_certificate_by_sds_and_no_other() {
    use crate::helpers::envoy::Envoy;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let frontend_cert = ca.leaf("frontend.shop");
    let listen = crate::helpers::free_addr();
    let source = dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(
        source.join("config.yaml"),
        [
            secret_doc("shop/frontend-cert", &frontend_cert),
            secret_doc("other/x-cert", &ca.leaf("x.other")),
            cluster_doc("backend"),
            sds_listener_doc(listen.port(), "shop/frontend-cert"),
        ]
        .join("---\n"),
    )
    .unwrap();
    let (cert, key) = write_leaf(dir.path(), "server", &ca.leaf("gateway"));
    let ca_path = write(dir.path(), "client-ca.pem", &ca.pem);
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        POLICY.replace(
            "[\"spiffe://cluster.local/ns/shop/sa/*\", \"unauthenticated\"]",
            "[\"spiffe://cluster.local/ns/shop/sa/*\", \"spiffe://cluster.local/ns/other/sa/*\"]",
        ),
    )
    .unwrap();
    let gw = start_gateway(&[
        "--source-dir",
        &path(&source),
        "--tls-cert",
        &path(&cert),
        "--tls-key",
        &path(&key),
        "--client-ca",
        &path(&ca_path),
        "--access-policy",
        &path(&policy),
    ])
    .await;

    let frontend = Envoy::start_with(mtls_bootstrap(gw.listen, &ca, FRONTEND, dir.path(), "frontend"))
        .await
        .unwrap();
    let presented = eventually_some("Envoy's listener to serve HTTPS with the SDS certificate", || async {
        presented_certificate(listen, &ca).await.ok()
    })
    .await;
    assert_eq!(presented, der_of(&frontend_cert.cert), "the secret's certificate");
    drop(frontend);

    // Another namespace's Envoy, the same listener added once it runs:
    // never sent the secret, so the listener stays warming.
    let config = source.join("config.yaml");
    let all = std::fs::read_to_string(&config).unwrap();
    let without_listener = all.split("---\n").take(3).collect::<Vec<_>>().join("---\n");
    std::fs::write(&config, &without_listener).unwrap();
    eventually_some("the listener to leave the source", || async {
        let view = get_json(gw.admin, "/debug/cache").await;
        let listeners = view
            .as_array()?
            .iter()
            .find(|c| c["collection"] == "envoy/config/listener/v3/listeners")?
            .clone();
        (listeners["resources"] == 0).then_some(())
    })
    .await;
    let other = Envoy::start_with(mtls_bootstrap(gw.listen, &ca, OTHER, dir.path(), "other"))
        .await
        .unwrap();
    other.stat_when("server.state", |state| state == 0).await;
    std::fs::write(&config, &all).unwrap();
    other
        .stat_when("listener_manager.total_listeners_warming", |n| n == 1)
        .await;
    let row = syncz_row(gw.admin, OTHER, SECRET_TYPE, "the other Envoy's SDS ACK").await;
    assert_eq!(row["access"]["withheld"], 1, "{row}");
    assert_eq!(row["status"], "SYNCED", "holds all it may read: {row}");
    drop(other);

    // An identity granted clusters, then not (a reload): refused by name on
    // every retry, and it keeps serving the clusters it had.
    let third_id = "spiffe://cluster.local/ns/third/sa/y";
    let granted = std::fs::read_to_string(&policy).unwrap();
    std::fs::write(
        &policy,
        format!("{granted}- identities: [\"{third_id}\"]\n  collections: [\"envoy/config/*\"]\n"),
    )
    .unwrap();
    eventually_some("the third identity's grant in effect", || async {
        let view = get_json(gw.admin, &format!("/debug/access?identity={third_id}")).await;
        let clusters = view["collections"]
            .as_array()?
            .iter()
            .find(|c| c["collection"] == "envoy/config/cluster/v3/clusters")?
            .clone();
        (clusters["reads"] == "all").then_some(())
    })
    .await;
    let third = Envoy::start_with(mtls_bootstrap(gw.listen, &ca, third_id, dir.path(), "third"))
        .await
        .unwrap();
    third
        .clusters_when("the backend cluster", |c| c.iter().any(|(name, _)| name == "backend"))
        .await;
    std::fs::write(&policy, &granted).unwrap();
    eventually_some("the refusal in Envoy's log", || async {
        // Envoy logs the status's message as it came, percent-encoded.
        let log = percent_encoding::percent_decode_str(&third.log())
            .decode_utf8_lossy()
            .into_owned();
        log.contains("gateway closed: 7, ")
            .then_some(())
            .filter(|_| log.contains("no rule of --access-policy grants it"))
            .filter(|_| log.contains(&format!("type_url \"{CLUSTER_TYPE}\"")))
    })
    .await;
    let clusters = third.dynamic_clusters().await;
    assert!(
        clusters.iter().any(|(name, _)| name == "backend"),
        "Envoy keeps serving what it had: {clusters:?}"
    );
}
