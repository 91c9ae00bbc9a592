//! Istio resources written as Kubernetes YAML, as operators keep them: every
//! kind the table serves with a proto, one example each, read by the files
//! source, fetched by a real MCP client over gRPC and decoded with Istio's
//! own descriptors (prost-reflect), then compared field by field with the
//! YAML; and the same through the config dump.

use std::collections::BTreeMap;

use prost_reflect::{DescriptorPool, DynamicMessage};
use serde_json::Value;

use crate::helpers::clients::sotw;
use crate::helpers::{http_get, start_gateway, within};

/// The descriptors of Istio's API protos that build.rs compiled, as an
/// independent client would load them (not through the gateway's code).
fn istio_pool() -> DescriptorPool {
    DescriptorPool::decode(&include_bytes!(concat!(env!("OUT_DIR"), "/istio_resources.bin"))[..]).unwrap()
}

/// One example per kind: (collection, the MCP name it is served as, YAML).
/// The apiVersions vary over the aliases; the specs use camelCase and
/// original field names, enums by name, and durations both ways.
const EXAMPLES: &[(&str, &str, &str)] = &[
    (
        "istio/networking/v1alpha3/virtualservices",
        "bookinfo/reviews",
        "apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: reviews, namespace: bookinfo, labels: {app: reviews}, annotations: {owner: team}}
spec:
  hosts: [reviews]
  gateways: [istio-system/ingressgateway]
  http:
  - name: canary
    match:
    - headers: {end-user: {exact: jason}}
      uri: {prefix: /api}
    route:
    - destination: {host: reviews, subset: v2, port: {number: 9080}}
      weight: 25
    - destination: {host: reviews, subset: v1}
      weight: 75
    timeout: 5m
    retries: {attempts: 3, per_try_timeout: 300ms, retryOn: 5xx}
    fault: {delay: {fixedDelay: 1.5s, percentage: {value: 10.5}}}
",
    ),
    (
        "istio/networking/v1alpha3/destinationrules",
        "bookinfo/reviews",
        "apiVersion: networking.istio.io/v1beta1
kind: DestinationRule
metadata: {name: reviews, namespace: bookinfo}
spec:
  host: reviews.bookinfo.svc.cluster.local
  trafficPolicy:
    loadBalancer: {simple: LEAST_REQUEST}
    connectionPool:
      tcp: {maxConnections: 100, connectTimeout: 30ms}
      http: {http2MaxRequests: 1000, idleTimeout: 1h30m}
    outlierDetection: {consecutive5xxErrors: 7, interval: 5m, baseEjectionTime: 15m}
    tls: {mode: ISTIO_MUTUAL}
  subsets:
  - name: v1
    labels: {version: v1}
  - name: v2
    labels: {version: v2}
    trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}
",
    ),
    (
        "istio/networking/v1alpha3/gateways",
        "istio-system/ingressgateway",
        "apiVersion: networking.istio.io/v1alpha3
kind: Gateway
metadata: {name: ingressgateway, namespace: istio-system}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 443, name: https, protocol: HTTPS}
    hosts: [bookinfo.example.com]
    tls: {mode: SIMPLE, credentialName: bookinfo-cert, minProtocolVersion: TLSV1_2}
",
    ),
    (
        "istio/networking/v1alpha3/serviceentries",
        "default/external-api",
        "apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: external-api}
spec:
  hosts: [api.example.com]
  addresses: [192.0.2.10/32]
  ports:
  - {number: 443, name: https, protocol: TLS, targetPort: 8443}
  location: MESH_EXTERNAL
  resolution: DNS
  exportTo: ['.']
",
    ),
    (
        "istio/networking/v1alpha3/sidecars",
        "bookinfo/default",
        "apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: bookinfo}
spec:
  egress:
  - hosts: ['./*', 'istio-system/*']
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
  ingress:
  - port: {number: 9080, protocol: HTTP, name: http}
    defaultEndpoint: 127.0.0.1:8080
",
    ),
    (
        "istio/networking/v1alpha3/envoyfilters",
        "istio-system/lua",
        "apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: lua, namespace: istio-system}
spec:
  workloadSelector:
    labels: {app: reviews}
  configPatches:
  - applyTo: HTTP_FILTER
    match:
      context: SIDECAR_INBOUND
      listener:
        filterChain:
          filter:
            name: envoy.filters.network.http_connection_manager
    patch:
      operation: INSERT_BEFORE
      value:
        name: envoy.lua
        typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua, inlineCode: 'x'}
  priority: 10
",
    ),
    (
        "istio/networking/v1alpha3/workloadentries",
        "vms/vm-1",
        "apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm-1, namespace: vms}
spec:
  address: 192.0.2.20
  ports: {http: 8080}
  labels: {app: legacy}
  serviceAccount: legacy
  network: vm-net
  weight: 3
",
    ),
    (
        "istio/networking/v1alpha3/workloadgroups",
        "vms/legacy",
        "apiVersion: networking.istio.io/v1beta1
kind: WorkloadGroup
metadata: {name: legacy, namespace: vms}
spec:
  metadata:
    labels: {app: legacy}
  template:
    ports: {http: 8080}
    serviceAccount: legacy
  probe:
    periodSeconds: 5
    initialDelaySeconds: 1
    httpGet: {path: /ready, port: 8080}
",
    ),
    (
        "istio/networking/v1beta1/proxyconfigs",
        "bookinfo/concurrency",
        "apiVersion: networking.istio.io/v1beta1
kind: ProxyConfig
metadata: {name: concurrency, namespace: bookinfo}
spec:
  selector:
    matchLabels: {app: ratings}
  concurrency: 2
  environmentVariables: {ISTIO_META_DNS_CAPTURE: 'true'}
  image: {imageType: distroless}
",
    ),
    (
        "istio/security/v1beta1/authorizationpolicies",
        "bookinfo/viewer",
        "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: viewer, namespace: bookinfo}
spec:
  selector:
    matchLabels: {app: productpage}
  action: ALLOW
  rules:
  - from:
    - source: {principals: [cluster.local/ns/default/sa/sleep], namespaces: [default]}
    to:
    - operation: {methods: [GET], paths: ['/info*']}
    when:
    - {key: 'request.auth.claims[iss]', values: [https://accounts.example.com]}
",
    ),
    (
        "istio/security/v1beta1/peerauthentications",
        "istio-system/default",
        "apiVersion: security.istio.io/v1beta1
kind: PeerAuthentication
metadata: {name: default, namespace: istio-system}
spec:
  mtls: {mode: STRICT}
  portLevelMtls:
    '8080': {mode: DISABLE}
",
    ),
    (
        "istio/security/v1beta1/requestauthentications",
        "bookinfo/jwt",
        "apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {name: jwt, namespace: bookinfo}
spec:
  selector:
    matchLabels: {app: productpage}
  jwtRules:
  - issuer: https://accounts.example.com
    jwksUri: https://accounts.example.com/jwks.json
    audiences: [bookinfo]
    forwardOriginalToken: true
    timeout: 10s
",
    ),
    (
        "istio/telemetry/v1alpha1/telemetries",
        "istio-system/mesh-default",
        "apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  tracing:
  - providers: [{name: zipkin}]
    randomSamplingPercentage: 2.5
  accessLogging:
  - providers: [{name: envoy}]
    filter: {expression: response.code >= 400}
  metrics:
  - reportingInterval: 15s
",
    ),
    (
        "istio/extensions/v1alpha1/wasmplugins",
        "istio-system/basic-auth",
        "apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: basic-auth, namespace: istio-system}
spec:
  selector:
    matchLabels: {istio: ingressgateway}
  url: oci://ghcr.io/example/basic-auth:1.0
  phase: AUTHN
  pluginConfig:
    realm: bookinfo
    paths: [/admin, /debug]
    retries: 3
",
    ),
    (
        "istio/authentication/v1alpha1/policies",
        "bookinfo/reviews-mtls",
        "apiVersion: authentication.istio.io/v1alpha1
kind: Policy
metadata: {name: reviews-mtls, namespace: bookinfo}
spec:
  targets:
  - name: reviews
    ports: [{number: 9080}]
  peers:
  - mtls: {mode: STRICT}
  origins:
  - jwt: {issuer: https://accounts.example.com, jwksUri: https://accounts.example.com/jwks.json}
  principalBinding: USE_ORIGIN
",
    ),
    (
        "istio/authentication/v1alpha1/meshpolicies",
        "default",
        "apiVersion: authentication.istio.io/v1alpha1
kind: MeshPolicy
metadata: {name: default}
spec:
  peers:
  - mtls: {mode: PERMISSIVE}
",
    ),
    (
        "istio/rbac/v1alpha1/serviceroles",
        "bookinfo/product-viewer",
        "apiVersion: rbac.istio.io/v1alpha1
kind: ServiceRole
metadata: {name: product-viewer, namespace: bookinfo}
spec:
  rules:
  - services: [productpage.bookinfo.svc.cluster.local]
    methods: [GET, HEAD]
    paths: ['/products/*']
    constraints:
    - {key: 'destination.labels[version]', values: [v1]}
",
    ),
    (
        "istio/rbac/v1alpha1/servicerolebindings",
        "bookinfo/bind-product-viewer",
        "apiVersion: rbac.istio.io/v1alpha1
kind: ServiceRoleBinding
metadata: {name: bind-product-viewer, namespace: bookinfo}
spec:
  subjects:
  - user: '*'
  - properties: {source.namespace: istio-system}
  roleRef: {kind: ServiceRole, name: product-viewer}
",
    ),
    (
        "istio/rbac/v1alpha1/rbacconfigs",
        "istio-system/default",
        "apiVersion: rbac.istio.io/v1alpha1
kind: RbacConfig
metadata: {name: default, namespace: istio-system}
spec:
  mode: ON_WITH_INCLUSION
  inclusion: {namespaces: [bookinfo]}
",
    ),
    (
        "istio/rbac/v1alpha1/clusterrbacconfigs",
        "default",
        "apiVersion: rbac.istio.io/v1alpha1
kind: ClusterRbacConfig
metadata: {name: default}
spec:
  mode: ON_WITH_EXCLUSION
  exclusion: {namespaces: [kube-system]}
  enforcementMode: PERMISSIVE
",
    ),
];

/// `snake_case` as proto-JSON writes it (`lowerCamelCase`).
fn camel(name: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in name.chars() {
        match c {
            '_' => upper = true,
            c if upper => {
                out.extend(c.to_uppercase());
                upper = false;
            }
            c => out.push(c),
        }
    }
    out
}

/// A Go-style duration the examples use (`5m`, `1h30m`, `300ms`, `1.5s`),
/// in seconds; written here independently of the gateway's parser.
fn seconds(text: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let split = rest.find(|c: char| c.is_ascii_alphabetic())?;
        let number: f64 = rest[..split].parse().ok()?;
        let unit_end = rest[split..]
            .find(|c: char| !c.is_ascii_alphabetic())
            .map_or(rest.len(), |i| split + i);
        total += number
            * match &rest[split..unit_end] {
                "h" => 3600.0,
                "m" => 60.0,
                "s" => 1.0,
                "ms" => 0.001,
                _ => return None,
            };
        rest = &rest[unit_end..];
    }
    Some(total)
}

/// Compares what a client decoded with what the YAML said, field by field
/// in both directions: every field of the YAML is in the message with the
/// same value (`full`: every field written, defaults included, as a field
/// the YAML sets to its default, `location: MESH_EXTERNAL`, is not sent),
/// and the message has no field the YAML lacks (`set`: the fields that are
/// not at their default).
fn compare(path: &str, expected: &Value, full: &Value, set: Option<&Value>, mismatches: &mut Vec<String>) {
    match (expected, full) {
        (Value::Object(want), Value::Object(got)) => {
            // Message fields are camelCase in proto-JSON; map keys (labels,
            // ports, a Struct's fields) are data and stay as written.
            let is_message = want.keys().any(|k| got.contains_key(&camel(k)) && !got.contains_key(k));
            let key = |k: &str| if is_message { camel(k) } else { k.to_owned() };
            for (k, v) in want {
                match got.get(&key(k)) {
                    Some(g) => compare(
                        &format!("{path}.{k}"),
                        v,
                        g,
                        set.and_then(|s| s.get(key(k))),
                        mismatches,
                    ),
                    None => mismatches.push(format!("{path}.{k}: in the YAML, not in the decoded message")),
                }
            }
            for k in set.and_then(Value::as_object).into_iter().flat_map(|s| s.keys()) {
                if !want.keys().any(|w| key(w) == *k) {
                    mismatches.push(format!("{path}.{k}: in the decoded message, not in the YAML"));
                }
            }
        }
        (Value::Array(want), Value::Array(got)) if want.len() == got.len() => {
            for (i, (w, g)) in want.iter().zip(got).enumerate() {
                compare(&format!("{path}[{i}]"), w, g, set.and_then(|s| s.get(i)), mismatches);
            }
        }
        (Value::Number(want), Value::Number(got)) if want.as_f64() == got.as_f64() => {}
        // 64-bit integers are strings in proto-JSON.
        (Value::Number(want), Value::String(got)) if got.parse::<f64>().ok() == want.as_f64() => {}
        // Durations: as written (`5m`) and as proto-JSON writes them (`300s`).
        (Value::String(want), Value::String(got))
            if want == got
                || seconds(want)
                    .zip(seconds(got))
                    .is_some_and(|(w, g)| (w - g).abs() < 1e-9) => {}
        (want, got) if want == got => {}
        (want, got) => mismatches.push(format!("{path}: the YAML says {want}, the client decoded {got}")),
    }
}

fn spec_of(yaml: &str) -> (Value, Value) {
    let object: Value = serde_norway::from_str(yaml).unwrap();
    (object["spec"].clone(), object["metadata"].clone())
}

#[tokio::test]
async fn every_istio_kind_written_as_kubernetes_yaml_reaches_clients_as_its_proto() {
    let dir = tempfile::tempdir().unwrap();
    // One file per kind, and one holding them all as a `kind: List` would
    // clash on names: files per kind, several documents in the last one.
    let (last, single) = EXAMPLES.split_last().unwrap();
    for (index, (_, _, yaml)) in single.iter().enumerate() {
        std::fs::write(dir.path().join(format!("{index:02}.yaml")), yaml).unwrap();
    }
    std::fs::write(
        dir.path().join("zz.yaml"),
        format!(
            "# several documents in one file\n{}---\n{}",
            single[0].2.replace("name: reviews,", "name: reviews-2,"),
            last.2
        ),
    )
    .unwrap();
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag]).await;
    assert_eq!(gw.upstream.borrow().last_error, None, "every example parses");

    let pool = istio_pool();
    let mut client = sotw(gw.listen).await;
    let mut checked = BTreeMap::new();
    for (collection, name, yaml) in EXAMPLES {
        client.subscribe(collection);
        let response = within(collection, client.recv_type(collection)).await;
        let resource = response
            .resources
            .iter()
            .find(|r| r.metadata.as_ref().is_some_and(|m| m.name == *name))
            .unwrap_or_else(|| {
                panic!(
                    "{collection}: no {name} in {:?}",
                    crate::helpers::names(&response.resources)
                )
            });
        if *collection == EXAMPLES[0].0 {
            assert_eq!(
                crate::helpers::names(&response.resources),
                ["bookinfo/reviews", "bookinfo/reviews-2"],
                "a file of several documents"
            );
        }
        let (spec, metadata) = spec_of(yaml);
        let served = resource.metadata.as_ref().unwrap();
        let strings = |v: &Value| -> BTreeMap<String, String> { serde_json::from_value(v.clone()).unwrap_or_default() };
        assert_eq!(
            served.labels.clone().into_iter().collect::<BTreeMap<_, _>>(),
            strings(&metadata["labels"])
        );
        assert_eq!(
            served.annotations.clone().into_iter().collect::<BTreeMap<_, _>>(),
            strings(&metadata["annotations"])
        );
        // Decoded by the client with Istio's descriptors, by the type URL
        // the body carries.
        let body = resource.body.as_ref().unwrap();
        let type_name = body.type_url.strip_prefix("type.googleapis.com/").unwrap();
        let descriptor = pool
            .get_message_by_name(type_name)
            .unwrap_or_else(|| panic!("{collection}: no descriptor for {}", body.type_url));
        let message = DynamicMessage::decode(descriptor, &body.value[..]).unwrap();
        let decoded = serde_json::to_value(&message).unwrap();
        let full = message
            .serialize_with_options(
                serde_json::value::Serializer,
                &prost_reflect::SerializeOptions::new().skip_default_fields(false),
            )
            .unwrap();
        let mut mismatches = Vec::new();
        compare("spec", &spec, &full, Some(&decoded), &mut mismatches);
        assert!(mismatches.is_empty(), "{collection}:\n{}", mismatches.join("\n"));

        // The config dump gives the same spec back.
        let (status, dump) = http_get(gw.admin, &format!("/debug/cache/{collection}?bodies=yaml")).await;
        assert_eq!(status, 200, "{dump}");
        let dump: Value = serde_norway::from_str(&dump).unwrap();
        let dumped = dump["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == *name)
            .unwrap();
        assert_eq!(
            dumped["body"], decoded,
            "{collection}: the config dump reads what the client decoded"
        );
        checked.insert(*collection, body.type_url.clone());
    }
    assert_eq!(checked.len(), EXAMPLES.len(), "one example per collection");
}

/// Every collection of the table whose kind has a proto here has an
/// example above; the others are refused in YAML form (the bad-input table
/// of `files` has their errors).
#[test]
fn the_examples_cover_every_kind_with_a_proto() {
    let pool = istio_pool();
    let table = mcp_xds_gateway::collections::CollectionTable::builtin();
    let covered: Vec<&str> = EXAMPLES.iter().map(|(c, _, _)| *c).collect();
    let tsv =
        include_str!("../../data/istio-collections.tsv").to_owned() + include_str!("../../data/xds-collections.tsv");
    for line in tsv.lines().filter(|l| !l.starts_with("collection\t")) {
        let collection = line.split('\t').next().unwrap();
        let type_url = &table.get(collection).unwrap().body_type_url;
        let has_proto = type_url
            .strip_prefix("type.googleapis.com/")
            .is_some_and(|name| name.starts_with("istio.") && pool.get_message_by_name(name).is_some());
        // The synthetic service entries are made by Galley from Kubernetes
        // Services; no kind writes them.
        if has_proto && collection != "istio/networking/v1alpha3/synthetic/serviceentries" {
            assert!(covered.contains(&collection), "{collection} has no example");
        }
    }
}

/// `struct:` bodies are still read, and logged once per file and collection
/// whose clients decode another type (not for Mixer's adapters, which are
/// Structs); an edit that keeps them does not log again.
#[tokio::test]
async fn struct_bodies_are_logged_once_per_file_and_collection() {
    let dir = tempfile::tempdir().unwrap();
    let vs = |hosts: &str| {
        format!(
            "collection: istio/networking/v1alpha3/virtualservices\nname: ns/a\nbody: {{struct: {{hosts: [{hosts}]}}}}\n---\n\
             collection: istio/networking/v1alpha3/virtualservices\nname: ns/b\nbody: {{struct: {{}}}}\n---\n\
             collection: istio/config/v1alpha2/adapters\nname: ns/c\nbody: {{struct: {{}}}}\n"
        )
    };
    crate::helpers::certs::write(dir.path(), "old.yaml", &vs("a"));
    let mut gw = crate::helpers::spawn_gateway(None, &["--source-dir", dir.path().to_str().unwrap()]).await;
    let warning = "not decodable by Pilot or istiod";
    let mut lines: Vec<String> = gw.log.clone();
    // An edit that keeps the Struct bodies, then one that adds a Struct
    // gateway: the gateway's warning is the mark that both were read.
    crate::helpers::certs::write(dir.path(), "old.yaml", &vs("b"));
    crate::helpers::eventually_async("the edit to be served", || async {
        let (_, dump) = http_get(
            gw.admin,
            "/debug/cache/istio/networking/v1alpha3/virtualservices?bodies=json",
        )
        .await;
        dump.contains("\"b\"]")
    })
    .await;
    crate::helpers::certs::write(
        dir.path(),
        "old.yaml",
        &(vs("b") + "---\ncollection: istio/networking/v1alpha3/gateways\nname: ns/g\nbody: {struct: {}}\n"),
    );
    within("the gateway's Struct warning", async {
        while !lines.iter().any(|l| l.contains(warning) && l.contains("gateways")) {
            lines.push(gw.later.recv().await.expect("the gateway logs before exiting"));
        }
    })
    .await;
    let warned = |collection: &str| {
        lines
            .iter()
            .filter(|l| l.contains(warning) && l.contains(collection) && l.contains("old.yaml"))
            .count()
    };
    assert_eq!(warned("virtualservices"), 1, "{lines:#?}");
    assert_eq!(warned("gateways"), 1, "{lines:#?}");
    assert_eq!(warned("adapters"), 0, "Mixer's adapters are Structs: {lines:#?}");
    gw.child.kill().await.unwrap();
}

/// A key written twice in one mapping is refused, naming the file, the line
/// of the second one and the key, as `kubectl apply -k` (kustomize) refuses
/// it ("mapping key \"hosts\" already defined at line 6"): one of the two
/// values is never chosen silently (an operator appending a second `http:`
/// to a long VirtualService would lose the first).
#[tokio::test]
async fn a_key_written_twice_in_a_mapping_is_refused_as_kubectl_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("vs.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: reviews\n\
         spec:\n  hosts: [reviews]\n  hosts: [ratings]\n",
    )
    .unwrap();
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", crate::helpers::VS]).await;
    let error = gw.upstream.borrow().last_error.clone();
    let (_, served) = http_get(gw.admin, &format!("/debug/cache/{}?bodies=json", crate::helpers::VS)).await;
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("vs.yaml:7:") && e.contains("hosts")),
        "the duplicate key is not refused: last error {error:?}; served {served}"
    );
}

/// YAML merge keys (`<<: *anchor`), which kubectl and kustomize expand, are
/// expanded the same way: the second subset's labels are the anchor's and
/// its own.
#[tokio::test]
async fn merge_keys_are_expanded_as_kubectl_expands_them() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("dr.yaml"),
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata:\n  name: reviews\n  namespace: bookinfo\n\
         spec:\n  host: reviews\n  subsets:\n  - name: v1\n    labels: &base {app: reviews}\n\
         \x20 - name: v2\n    labels:\n      <<: *base\n      version: v2\n",
    )
    .unwrap();
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", crate::helpers::DR]).await;
    let error = gw.upstream.borrow().last_error.clone();
    assert_eq!(error, None, "kubectl kustomize reads this file");
    let (status, dump) = http_get(gw.admin, &format!("/debug/cache/{}?bodies=json", crate::helpers::DR)).await;
    assert_eq!(status, 200, "{dump}");
    let dump: Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(
        dump["resources"][0]["body"]["subsets"][1]["labels"],
        serde_json::json!({"app": "reviews", "version": "v2"}),
        "{dump}"
    );
}

/// The reasons a file is refused read as written for an operator: the value
/// as it was written (not a Rust `Some(..)`), and a field path followed by
/// ": " before the reason, for a spec that is not a mapping as for any field.
#[tokio::test]
async fn refusals_name_the_value_and_the_path_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", crate::helpers::VS]).await;
    let refusal = |file: &'static str, text: &'static str| {
        let gw = &gw;
        let dir = dir.path().to_owned();
        async move {
            crate::helpers::certs::write(&dir, file, text);
            let error = crate::helpers::eventually_some(file, || async {
                gw.upstream.borrow().last_error.clone().filter(|e| e.contains(file))
            })
            .await;
            std::fs::remove_file(dir.join(file)).unwrap();
            crate::helpers::eventually("the refusal to clear", || gw.upstream.borrow().last_error.is_none()).await;
            error
        }
    };
    let slash = refusal(
        "slash.yaml",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: reviews\n  namespace: book/info\nspec:\n  hosts: [reviews]\n",
    )
    .await;
    assert!(
        slash.contains("slash.yaml:5: metadata.namespace \"book/info\" has a '/'"),
        "{slash}"
    );
    let list = refusal(
        "list.yaml",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: reviews\nspec:\n- hosts: [reviews]\n",
    )
    .await;
    assert!(
        list.contains("list.yaml:5: spec: invalid type: sequence, expected a map"),
        "{list}"
    );
}
