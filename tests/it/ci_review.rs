//! Issue 33's independent check, with inputs of its own (none of
//! `check.rs`'s or `operating.rs`'s fixtures): `check` on directories with
//! known defects reports each at its file and line and exits as the
//! reference says; `status -o json` is `/debug/syncz`; `status` exits 1 with
//! a NACKing client and with files broken at run time, which the index
//! leads with; and `client --protocol xds-delta --names` prints what a real
//! delta Envoy, subscribed by name, runs.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::helpers::clients::sotw;
use crate::helpers::envoy::{section, AdsApi, Envoy};
use crate::helpers::{eventually_async, eventually_some, get_json, http_get_with, start_gateway, VS};
use crate::operating::subcommand;

/// The files of `dir`, written from (name, text).
fn write_all(dir: &Path, files: &[(&str, &str)]) {
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// `check`'s JSON findings as (file name, line, severity, message), and
/// each finding's `collection` and `name`.
fn parse_findings(json: &str) -> Vec<(String, u64, String, String, Value, Value)> {
    let parsed: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    parsed
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {json}"))
        .iter()
        .map(|f| {
            let file = Path::new(f["file"].as_str().unwrap());
            (
                file.file_name().unwrap().to_string_lossy().into_owned(),
                f["line"].as_u64().unwrap(),
                f["severity"].as_str().unwrap().to_owned(),
                f["message"].as_str().unwrap().to_owned(),
                f["collection"].clone(),
                f["name"].clone(),
            )
        })
        .collect()
}

/// Istio YAML: apiVersion networking.istio.io/v1, `kind`, then `rest`.
fn istio(kind: &str, rest: &str) -> String {
    format!("apiVersion: networking.istio.io/v1\nkind: {kind}\n{rest}")
}

/// Every row of the files source's bad input that `check` can see, each in
/// a file of its own; a good file, a hidden file and a `.txt` file beside
/// them are not findings. The line is the line an operator must edit.
#[tokio::test]
async fn check_reports_each_bad_file_at_its_line_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut bomb = String::from("apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata:\n  name: bomb\n");
    bomb.push_str(&format!("  labels:\n    a0: &s \"{}\"\n", "x".repeat(1000)));
    for i in 1..3000 {
        bomb.push_str(&format!("    a{i}: *s\n"));
    }
    let good = istio(
        "DestinationRule",
        "metadata: {name: reviews, namespace: shop}\nspec:\n  host: reviews\n  subsets: [{name: v1, labels: {version: v1}}]\n",
    );
    write_all(
        d,
        &[
            ("a-good.yaml", &good),
            (
                "b-unparsable.yaml",
                &istio(
                    "Gateway",
                    "metadata: {name: g, namespace: shop}\nspec:\n  selector: [istio, ingress\n  servers: {}\n",
                ),
            ),
            (
                "c-field.yaml",
                &istio(
                    "DestinationRule",
                    "metadata: {name: lb, namespace: shop}\nspec:\n  host: lb\n  trafficPolicy:\n    loadBalancr: {simple: ROUND_ROBIN}\n",
                ),
            ),
            (
                "d-type.yaml",
                &istio(
                    "Sidecar",
                    "metadata: {name: sc, namespace: shop}\nspec:\n  egress: [{hosts: [\"./*\"]}]\n  outboundTrafficPolicy: 7\n",
                ),
            ),
            (
                "e-enum.yaml",
                &istio(
                    "DestinationRule",
                    "metadata: {name: tls, namespace: shop}\nspec:\n  host: tls\n  trafficPolicy:\n    tls: {mode: MUTUALL}\n",
                ),
            ),
            (
                "f-noname.yaml",
                &istio(
                    "ServiceEntry",
                    "metadata:\n  namespace: shop\n  labels: {a: b}\nspec: {hosts: [x.example.com]}\n",
                ),
            ),
            (
                "g-kind.yaml",
                "apiVersion: security.istio.io/v1\nkind: AuthorizationPolcy\nmetadata: {name: deny, namespace: shop}\nspec: {}\n",
            ),
            (
                "h-twice.yaml",
                &format!(
                    "---\n{}---\n# the same name again\n{}",
                    istio("DestinationRule", "metadata: {name: twin, namespace: shop}\nspec: {host: twin}\n"),
                    istio("DestinationRule", "metadata: {name: twin, namespace: shop}\nspec: {host: twin2}\n")
                ),
            ),
            (
                "i-envoy.yaml",
                "collection: envoy/config/cluster/v3/clusters\nname: web\nbody:\n  type_url: \
                 type.googleapis.com/envoy.config.cluster.v3.Cluster\n  json:\n    name: web\n    conect_timeout: 1s\n",
            ),
            ("j-bomb.yaml", &bomb),
            ("k-big.yaml", &"#".repeat(70_000)),
            (".hidden.yaml", "not: [yaml"),
            ("notes.txt", "{{{"),
        ],
    );
    std::fs::write(d.join("l-binary.yaml"), b"\xff\xfe\x00garbage").unwrap();
    crate::helpers::mkfifo(&d.join("m-fifo.yaml"));
    std::os::unix::fs::symlink(d.join("n-loop.yaml"), d.join("n-loop.yaml")).unwrap();
    let path = d.display().to_string();

    let (code, stdout, stderr) = subcommand("check", &["--max-message-bytes", "65536", "-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let expected: [(&str, u64, &str); 13] = [
        (
            "b-unparsable.yaml",
            6,
            "did not find expected ',' or ']' at line 6 column 10, while parsing a flow sequence at line 5",
        ),
        (
            "c-field.yaml",
            7,
            "spec.trafficPolicy.loadBalancr: unrecognized field name 'loadBalancr'",
        ),
        (
            "d-type.yaml",
            6,
            "spec.outboundTrafficPolicy: invalid type: integer `7`",
        ),
        (
            "e-enum.yaml",
            7,
            "spec.trafficPolicy.tls.mode: unrecognized enum value 'MUTUALL'",
        ),
        ("f-noname.yaml", 3, "metadata.name is missing"),
        (
            "g-kind.yaml",
            2,
            "kind \"AuthorizationPolcy\" is not a kind of security.istio.io/v1",
        ),
        (
            "h-twice.yaml",
            10,
            "\"shop/twin\" in istio/networking/v1alpha3/destinationrules is defined twice (first at line 4)",
        ),
        (
            "i-envoy.yaml",
            7,
            "body of \"web\": json.conect_timeout: unrecognized field name 'conect_timeout'",
        ),
        // The anchor the aliases repeat.
        ("j-bomb.yaml", 6, "the document expands to more than its size allows"),
        ("k-big.yaml", 0, "70000 bytes is larger than --max-message-bytes=65536"),
        ("l-binary.yaml", 0, "not UTF-8"),
        ("m-fifo.yaml", 0, "not a regular file"),
        ("n-loop.yaml", 0, "cannot read: Too many levels of symbolic links"),
    ];
    let found = parse_findings(&stdout);
    let shown: Vec<(&str, u64)> = found.iter().map(|f| (f.0.as_str(), f.1)).collect();
    let wanted: Vec<(&str, u64)> = expected.iter().map(|e| (e.0, e.1)).collect();
    assert_eq!(shown, wanted, "{stdout}");
    // A finding names the resource whenever its kind (or collection) and
    // name were read, however broken the rest.
    let dr = "istio/networking/v1alpha3/destinationrules";
    let identities: [(Option<&str>, Option<&str>); 13] = [
        (None, None),
        (Some(dr), Some("shop/lb")),
        (Some("istio/networking/v1alpha3/sidecars"), Some("shop/sc")),
        (Some(dr), Some("shop/tls")),
        (Some("istio/networking/v1alpha3/serviceentries"), None),
        (None, None),
        (Some(dr), Some("shop/twin")),
        (Some("envoy/config/cluster/v3/clusters"), Some("web")),
        (Some("istio/networking/v1alpha3/gateways"), Some("default/bomb")),
        (None, None),
        (None, None),
        (None, None),
        (None, None),
    ];
    for ((finding, (_, _, message)), (collection, name)) in found.iter().zip(&expected).zip(identities) {
        assert!(finding.3.contains(message), "{}: {}", finding.0, finding.3);
        assert_eq!(
            (finding.2.as_str(), &finding.4, &finding.5),
            ("error", &json!(collection), &json!(name)),
            "{}",
            finding.0
        );
    }
    assert!(
        stderr.contains("14 files, 1 resource: 13 errors, 0 warnings"),
        "the hidden file and notes.txt are not read: {stderr}"
    );

    // Text: FILE:LINE: message, the files source's own line, one a finding.
    let (code, text, _) = subcommand("check", &["--max-message-bytes", "65536", &path]).await;
    assert_eq!(code, Some(1));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 13, "{text}");
    assert!(
        lines.contains(
            &format!(
                "{path}/e-enum.yaml:7: error: spec.trafficPolicy.tls.mode: unrecognized enum value 'MUTUALL' (did you \
                 mean 'MUTUAL'?)"
            )
            .as_str()
        ),
        "{text}"
    );
    // GitHub: an error annotation a finding, at the same file and line.
    let (code, github, _) = subcommand("check", &["--max-message-bytes", "65536", "-o", "github", &path]).await;
    assert_eq!(code, Some(1));
    let annotated: Vec<(String, u64)> = github
        .lines()
        .map(|l| {
            let rest = l.strip_prefix("::error file=").unwrap_or_else(|| panic!("{l}"));
            let file = rest.split([',', ':']).next().unwrap();
            // A finding of the whole file (line 0) is annotated without one.
            let line = rest
                .split_once(",line=")
                .map_or(0, |(_, at)| at.split([',', ':']).next().unwrap().parse().unwrap());
            (
                Path::new(file).file_name().unwrap().to_string_lossy().into_owned(),
                line,
            )
        })
        .collect();
    let wanted: Vec<(String, u64)> = expected.iter().map(|e| (e.0.to_owned(), e.1)).collect();
    assert_eq!(annotated, wanted, "{github}");

    // The good file alone: 0, nothing printed. `--strict` changes nothing
    // about errors.
    let (code, stdout, _) = subcommand("check", &[&format!("{path}/a-good.yaml")]).await;
    assert_eq!((code, stdout.as_str()), (Some(0), ""));
    let (code, _, _) = subcommand("check", &["--strict", &format!("{path}/c-field.yaml")]).await;
    assert_eq!(code, Some(1));
}

/// Envoy names over ADS that nothing defines, Istio subsets no rule of the
/// host defines: warnings at the line of the field naming them, errors with
/// `--strict` (exit 1); one name in two files: an error. What is defined,
/// or taken from Envoy's disk, is not a finding: an EDS `service_name`, a
/// validation context, a mirror's subset, a `path_config_source`.
#[tokio::test]
async fn check_cross_references_are_warnings_at_the_field_and_strict_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = |name: &str, eds: &str| {
        format!(
            "collection: envoy/config/cluster/v3/clusters\nname: {name}\nbody:\n  type_url: \
             type.googleapis.com/envoy.config.cluster.v3.Cluster\n  json: {{name: {name}, connect_timeout: 1s, type: \
             EDS, eds_cluster_config: {eds}}}\n"
        )
    };
    let clusters = [
        cluster("api", "{service_name: api-eps, eds_config: {ads: {}}}"),
        cluster("db", "{eds_config: {ads: {}}}"),
        cluster("disk", "{eds_config: {path_config_source: {path: /etc/eds.yaml}}}"),
        "collection: envoy/config/endpoint/v3/clusterloadassignments\nname: api-eps\nbody:\n  type_url: \
         type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment\n  json: {cluster_name: api-eps}\n"
            .to_owned(),
    ]
    .join("---\n");
    let listeners = "\
collection: envoy/config/listener/v3/listeners
name: tcp
body:
  type_url: type.googleapis.com/envoy.config.listener.v3.Listener
  json:
    name: tcp
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: tcp, cluster: cache}
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            validation_context_sds_secret_config: {name: client-ca, sds_config: {ads: {}}}
            tls_certificate_sds_secret_configs: [{name: server-cert, sds_config: {ads: {}}}]
---
collection: envoy/config/listener/v3/listeners
name: http
body:
  type_url: type.googleapis.com/envoy.config.listener.v3.Listener
  json:
    name: http
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http
          rds: {route_config_name: front, config_source: {ads: {}}}
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: disk
          rds: {route_config_name: on-disk, config_source: {path_config_source: {path: /etc/rds.yaml}}}
";
    let routes_and_secret = "\
collection: envoy/extensions/transport_sockets/tls/v3/secrets
name: server-cert
body:
  type_url: type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
  json: {name: server-cert}
---
collection: envoy/config/route/v3/routeconfigurations
name: inner
body:
  type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration
  json:
    name: inner
    virtual_hosts:
    - name: all
      domains: ['*']
      routes:
      - {match: {prefix: /api}, route: {cluster: api}}
      - {match: {prefix: /search}, route: {cluster: search}}
";
    let istio_resources = [
        istio(
            "VirtualService",
            "metadata: {name: shop, namespace: shop}\nspec:\n  hosts: [shop]\n  http:\n  - mirror: {host: cart, subset: canary}\n    route:\n    - destination: {host: cart.shop.svc.cluster.local, subset: stable}\n    - destination: {host: pay.other.svc.cluster.local, subset: v9}\n  tcp:\n  - route:\n    - destination: {host: cart, subset: old}\n",
        ),
        istio(
            "DestinationRule",
            "metadata: {name: cart, namespace: shop}\nspec:\n  host: cart\n  subsets: [{name: stable, labels: {v: s}}, {name: canary, labels: {v: c}}]\n",
        ),
        istio(
            "DestinationRule",
            "metadata: {name: pay, namespace: other}\nspec:\n  host: pay\n  subsets: [{name: v1, labels: {v: \"1\"}}]\n",
        ),
    ]
    .join("---\n");
    // The second file's rule would define v9, but the first file by name is
    // served: the route to v9 is still a warning.
    let again = format!(
        "# a copy kept in a second file\n{}",
        istio(
            "DestinationRule",
            "metadata: {name: pay, namespace: other}\nspec:\n  host: pay\n  subsets: [{name: v9, labels: {v: \"9\"}}]\n"
        )
    );
    write_all(
        dir.path(),
        &[
            ("1-clusters.yaml", &clusters),
            ("2-listeners.yaml", listeners),
            ("3-routes.yaml", routes_and_secret),
            ("4-istio.yaml", &istio_resources),
            ("5-again.yaml", &again),
        ],
    );
    let path = dir.path().display().to_string();
    // The line of the field naming what is missing (the first line of
    // `text` holding `part`).
    let at = |text: &str, part: &str| text.lines().position(|l| l.contains(part)).unwrap() as u64 + 1;
    let lines = |text: &str, part: &str| {
        let first = at(text, part);
        (
            first,
            text.lines()
                .skip(first as usize)
                .position(|l| l.contains(part))
                .map(|n| first + n as u64 + 1),
        )
    };
    let warnings: [(&str, u64, &str, &str, &str); 7] = [
        (
            "1-clusters.yaml",
            lines(&clusters, "eds_cluster_config").1.unwrap(),
            "EDS cluster \"db\" has no load assignment",
            "envoy/config/cluster/v3/clusters",
            "db",
        ),
        (
            "2-listeners.yaml",
            at(listeners, "cluster: cache"),
            "routes to cluster \"cache\", which no file defines",
            "envoy/config/listener/v3/listeners",
            "tcp",
        ),
        (
            "2-listeners.yaml",
            at(listeners, "name: client-ca"),
            "SDS name \"client-ca\" has no secret",
            "envoy/config/listener/v3/listeners",
            "tcp",
        ),
        (
            "2-listeners.yaml",
            at(listeners, "route_config_name: front"),
            "RDS name \"front\" has no route configuration",
            "envoy/config/listener/v3/listeners",
            "http",
        ),
        (
            "3-routes.yaml",
            at(routes_and_secret, "cluster: search"),
            "routes to cluster \"search\", which no file defines",
            "envoy/config/route/v3/routeconfigurations",
            "inner",
        ),
        (
            "4-istio.yaml",
            at(&istio_resources, "subset: v9"),
            "routes to subset \"v9\" of host \"pay.other.svc.cluster.local\"",
            "istio/networking/v1alpha3/virtualservices",
            "shop/shop",
        ),
        (
            "4-istio.yaml",
            at(&istio_resources, "subset: old"),
            "routes to subset \"old\" of host \"cart\"",
            "istio/networking/v1alpha3/virtualservices",
            "shop/shop",
        ),
    ];

    let (code, stdout, stderr) = subcommand("check", &["-o", "json", &path]).await;
    // The name in two files is an error (one of the two is never served),
    // as in one file; the rest are warnings.
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("1 error, 7 warnings"), "{stderr}");
    let found = parse_findings(&stdout);
    assert_eq!(found.len(), warnings.len() + 1, "{stdout}");
    for (f, (file, line, message, collection, name)) in found.iter().zip(&warnings) {
        assert_eq!(
            (f.0.as_str(), f.1, f.2.as_str(), &f.4, &f.5),
            (*file, *line, "warning", &json!(collection), &json!(name)),
            "{}",
            f.3
        );
        assert!(f.3.contains(message), "{}", f.3);
    }
    // The duplicate, at its name, naming where the first one is.
    let twice = &found[7];
    assert_eq!(
        (twice.0.as_str(), twice.1, twice.2.as_str(), &twice.4, &twice.5),
        (
            "5-again.yaml",
            at(&again, "name: pay"),
            "error",
            &json!("istio/networking/v1alpha3/destinationrules"),
            &json!("other/pay")
        )
    );
    assert!(
        twice
            .3
            .contains(&format!("{path}/4-istio.yaml:{}", at(&istio_resources, "name: pay"))),
        "{}",
        twice.3
    );
    let (code, text, _) = subcommand("check", &[&path]).await;
    assert_eq!(code, Some(1));
    assert!(
        text.lines().any(|l| l.starts_with(&format!(
            "{path}/1-clusters.yaml:{}: warning: EDS cluster \"db\"",
            warnings[0].1
        ))),
        "{text}"
    );
    let (code, github, stderr) = subcommand("check", &["--strict", "-o", "github", &path]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("8 errors, 0 warnings"), "{stderr}");
    assert_eq!(github.lines().count(), 8, "{github}");
    assert!(
        github.lines().any(|l| l.starts_with(&format!(
            "::error file={path}/2-listeners.yaml,line={},title=envoy/config/listener/v3/listeners http::[strict] RDS name",
            warnings[3].1
        ))),
        "{github}"
    );
    let (code, github, _) = subcommand("check", &["-o", "github", &path]).await;
    assert_eq!(code, Some(1));
    assert_eq!(
        github.lines().filter(|l| l.starts_with("::warning file=")).count(),
        7,
        "{github}"
    );
}

/// `check examples/`: the examples live in subdirectories, which check (as
/// `--source-dir`) does not read, and one of them holds Envoy's bootstrap.
/// Checking nothing must not pass CI: exit 2 naming the subdirectories. The
/// two source directories themselves pass clean; an empty directory is a
/// warning (an empty source is valid).
#[tokio::test]
async fn check_of_the_examples_root_names_its_source_directories_and_they_pass() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let (code, stdout, stderr) = subcommand("check", &[root]).await;
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert_eq!(stdout, "");
    assert!(
        stderr.contains(&format!(
            "its subdirectories with YAML: {root}/config, {root}/envoy, {root}/envoy/config; name the ones a \
             gateway serves"
        )),
        "{stderr}"
    );
    let (code, stdout, stderr) = subcommand(
        "check",
        &[
            "--strict",
            "-o",
            "json",
            &format!("{root}/config"),
            &format!("{root}/envoy/config"),
        ],
    )
    .await;
    assert_eq!((code, stdout.trim()), (Some(0), "[]"), "{stderr}");
    // The bootstrap is not a source file: named, it is an error.
    let (code, _, _) = subcommand("check", &[&format!("{root}/envoy/bootstrap.yaml")]).await;
    assert_eq!(code, Some(1));
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir(empty.path().join("nothing-here")).unwrap();
    let (code, stdout, _) = subcommand("check", &[empty.path().to_str().unwrap()]).await;
    assert_eq!(code, Some(0));
    assert!(
        stdout.contains(": warning: no *.yaml or *.yml file directly"),
        "{stdout}"
    );
    let (code, _, _) = subcommand("check", &["--strict", empty.path().to_str().unwrap()]).await;
    assert_eq!(code, Some(1));
}

/// `/debug/syncz`'s JSON without what moves between two reads (ages).
fn without_ages(value: &Value) -> Value {
    match value {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "for_seconds" | "age_seconds"))
                .map(|(k, v)| (k.clone(), without_ages(v)))
                .collect(),
        ),
        Value::Array(values) => Value::Array(values.iter().map(without_ages).collect()),
        other => other.clone(),
    }
}

/// Two clients of one collection, one ACKing and one NACKing: `status -o
/// json` is `/debug/syncz` (every field but the ages) and exits 1; then two
/// files broken at run time lead `status` (exit 1, with no client out of
/// sync) and the index, and each fix shows.
#[tokio::test]
async fn status_json_is_syncz_and_exits_1_for_a_nack_and_for_broken_files() {
    let dir = tempfile::tempdir().unwrap();
    let vs = |host: &str| {
        istio(
            "VirtualService",
            &format!("metadata: {{name: {host}, namespace: shop}}\nspec:\n  hosts: [{host}]\n"),
        )
    };
    write_all(dir.path(), &[("one.yaml", &vs("one")), ("two.yaml", &vs("two"))]);
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap(), "--collections", VS]).await;
    let admin = gw.admin.to_string();
    let mut acking = sotw(gw.listen).await;
    acking.subscribe(VS);
    let first = acking.recv().await;
    acking.ack(&first);
    let mut nacking = sotw(gw.listen).await;
    nacking.subscribe(VS);
    let refused = nacking.recv().await;
    nacking.nack(&refused, "", "cannot apply shop/two");
    let statuses = || async {
        let syncz = get_json(gw.admin, "/debug/syncz").await;
        let mut found: Vec<String> = syncz["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["status"].as_str().unwrap().to_owned())
            .collect();
        found.sort();
        found
    };
    eventually_async("one client SYNCED and one NACKED", || async {
        statuses().await == ["NACKED", "SYNCED"]
    })
    .await;

    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin, "-o", "json"]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(
        stderr.starts_with("NOT SYNCED: 1 of 2 client types (1 NACKED)"),
        "{stderr}"
    );
    let printed: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let served = get_json(gw.admin, "/debug/syncz").await;
    assert_eq!(without_ages(&printed), without_ages(&served));
    let rows = printed["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{printed}");
    let nacked = rows.iter().find(|r| r["status"] == "NACKED").unwrap();
    assert_eq!(nacked["nack"]["message"], "cannot apply shop/two");
    assert_eq!(nacked["sent"]["version"], refused.version_info.as_str());
    assert_eq!(nacked["acked"], Value::Null);
    let synced = rows.iter().find(|r| r["status"] == "SYNCED").unwrap();
    assert_eq!(synced["acked"]["version"], first.version_info.as_str());
    for row in rows {
        assert_eq!(row["current_version"], first.version_info.as_str(), "{row}");
        assert_eq!(row["node_id"], "pilot-test");
    }
    assert_eq!(printed["source"]["healthy"], true);
    drop(nacking);
    eventually_async("the NACKing client gone", || async { statuses().await == ["SYNCED"] }).await;
    let (code, _, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stderr}");

    // Two files broken while the gateway runs: an unknown field, then bytes
    // that are not text.
    std::fs::write(
        dir.path().join("one.yaml"),
        vs("one").replace("hosts: [one]", "hostz: [one]"),
    )
    .unwrap();
    std::fs::write(dir.path().join("two.yaml"), b"\xff\xfe not text").unwrap();
    let lead = "SOURCE: 2 files do not parse, serving their last good state: ";
    let problem = eventually_some("both broken files in /debug/syncz", || async {
        let syncz = get_json(gw.admin, "/debug/syncz").await;
        syncz["source"]["problems"][0]
            .as_str()
            .filter(|p| p.starts_with(lead))
            .map(str::to_owned)
    })
    .await;
    let one = format!(
        "{}/one.yaml:5: spec.hostz: unrecognized field name 'hostz'",
        dir.path().display()
    );
    let two = format!("{}/two.yaml:0: not UTF-8", dir.path().display());
    assert!(problem.contains(&one) && problem.contains(&two), "{problem}");
    let (code, stdout, stderr) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let first_line = stdout.lines().next().unwrap();
    assert!(
        first_line.starts_with(lead) && first_line.contains(&one) && first_line.contains(&two),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.contains("SYNCED")), "still served: {stdout}");
    let (code, json_out, _) = subcommand("status", &["--admin", &admin, "-o", "json"]).await;
    assert_eq!(code, Some(1));
    let printed: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(printed["source"]["healthy"], false, "{printed}");
    let (_, index) = http_get_with(gw.admin, "/", "Accept: text/html\r\n").await;
    let at = index
        .find("SOURCE: 2 files do not parse")
        .unwrap_or_else(|| panic!("{index}"));
    assert!(index[at..].contains("one.yaml:5"), "{index}");

    // One fixed: one left, said so; both fixed: 0.
    std::fs::write(dir.path().join("two.yaml"), vs("two")).unwrap();
    eventually_async("one broken file left", || async {
        get_json(gw.admin, "/debug/syncz").await["source"]["problems"][0]
            .as_str()
            .is_some_and(|p| p.starts_with("SOURCE: 1 file does not parse") && !p.contains("two.yaml"))
    })
    .await;
    let (code, stdout, _) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(1), "{stdout}");
    std::fs::write(dir.path().join("one.yaml"), vs("one")).unwrap();
    eventually_async("the source healthy again", || async {
        get_json(gw.admin, "/debug/syncz").await["source"]["healthy"] == true
    })
    .await;
    let (code, stdout, _) = subcommand("status", &["--admin", &admin]).await;
    assert_eq!(code, Some(0), "{stdout}");
    let (_, index) = http_get_with(gw.admin, "/", "Accept: text/html\r\n").await;
    assert!(!index.contains("SOURCE:"), "{index}");
    drop(acking);
}

const CLA: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const ROUTES: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

/// Two EDS clusters (one through a `service_name`), their load assignments
/// and one more no cluster names; a listener whose RDS name is one of two
/// route configurations. Envoy asks for `blue`, `green-eps` and
/// `front-routes` by name.
fn by_name_config(blue_port: u16) -> String {
    format!(
        "\
collection: envoy/config/cluster/v3/clusters
name: blue
body:
  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
  json: {{name: blue, connect_timeout: 2s, type: EDS, eds_cluster_config: {{eds_config: {{ads: {{}}, resource_api_version: V3}}}}}}
---
collection: envoy/config/cluster/v3/clusters
name: green
body:
  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
  json: {{name: green, connect_timeout: 2s, type: EDS, eds_cluster_config: {{service_name: green-eps, eds_config: {{ads: {{}}, resource_api_version: V3}}}}}}
---
collection: envoy/config/endpoint/v3/clusterloadassignments
name: blue
body:
  type_url: type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment
  json:
    cluster_name: blue
    endpoints:
    - locality: {{region: eu, zone: a}}
      lb_endpoints:
      - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {blue_port}}}}}}}
        load_balancing_weight: 3
      - endpoint: {{address: {{socket_address: {{address: 127.0.0.2, port_value: 9102}}}}}}
---
collection: envoy/config/endpoint/v3/clusterloadassignments
name: green-eps
body:
  type_url: type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment
  json:
    cluster_name: green-eps
    endpoints:
    - lb_endpoints:
      - endpoint: {{address: {{socket_address: {{address: 127.0.0.3, port_value: 9103}}}}}}
---
collection: envoy/config/endpoint/v3/clusterloadassignments
name: unused
body:
  type_url: type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment
  json: {{cluster_name: unused}}
---
collection: envoy/config/listener/v3/listeners
name: front
body:
  type_url: type.googleapis.com/envoy.config.listener.v3.Listener
  json:
    name: front
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: front
          rds: {{route_config_name: front-routes, config_source: {{ads: {{}}, resource_api_version: V3}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
---
collection: envoy/config/route/v3/routeconfigurations
name: front-routes
body:
  type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration
  json:
    name: front-routes
    virtual_hosts:
    - name: shop
      domains: [shop.example.com, '*.shop.example.com']
      routes:
      - match: {{prefix: /green}}
        route: {{cluster: green, timeout: 3s}}
      - match: {{prefix: /}}
        route: {{weighted_clusters: {{clusters: [{{name: blue, weight: 90}}, {{name: green, weight: 10}}]}}}}
---
collection: envoy/config/route/v3/routeconfigurations
name: other-routes
body:
  type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration
  json: {{name: other-routes}}
"
    )
}

/// proto-JSON's lowerCamelCase field names as Envoy's dump writes them
/// (the proto's own snake_case names).
fn snake_keys(value: &Value) -> Value {
    match value {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(k, v)| {
                    let mut snake = String::new();
                    for c in k.chars() {
                        if c.is_ascii_uppercase() {
                            snake.push('_');
                        }
                        snake.push(c.to_ascii_lowercase());
                    }
                    (snake, snake_keys(v))
                })
                .collect(),
        ),
        Value::Array(values) => Value::Array(values.iter().map(snake_keys).collect()),
        other => other.clone(),
    }
}

/// A load assignment as Envoy's dump shows what it took from one: per
/// locality (`{}` when none), each endpoint's address, port and weight (1
/// when none). Envoy fills in defaults (health, overprovisioning) it was
/// never sent; these are what it was.
fn endpoints_of(assignment: &Value) -> Value {
    let localities = assignment["endpoints"].as_array().into_iter().flatten();
    Value::Array(
        localities
            .map(|l| {
                let endpoints: Vec<Value> = l["lb_endpoints"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        let socket = &e["endpoint"]["address"]["socket_address"];
                        json!([
                            socket["address"],
                            socket["port_value"],
                            e.get("load_balancing_weight").cloned().unwrap_or(json!(1))
                        ])
                    })
                    .collect();
                json!({"locality": l.get("locality").cloned().unwrap_or(json!({})), "endpoints": endpoints})
            })
            .collect(),
    )
}

/// `client --protocol xds-delta --names NAMES --type-url TYPE --once
/// --show bodies -o json`: the one update it prints.
async fn client_update(target: &str, type_url: &str, names: &str) -> Value {
    let (code, stdout, stderr) = subcommand(
        "client",
        &[
            "--target",
            target,
            "--protocol",
            "xds-delta",
            "--node-id",
            "ci-review",
            "--type-url",
            type_url,
            "--names",
            names,
            "--once",
            "--show",
            "bodies",
            "-o",
            "json",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one update: {stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// What the client prints for Envoy's names equals what Envoy runs: the
/// same resources (and no other), the same versions (the type's, in Envoy's
/// `version_text` stats; a route configuration's own, in the dump) and the
/// same content.
///
/// A delta Envoy's `cluster.C.version_text` is the type's version of the
/// last response that carried C's load assignment: after an edit, the
/// version of the edit where the assignment changed (its own `version`
/// moved since `before`), the earlier one where it did not. Returns the
/// client's load assignment update.
async fn client_prints_what_envoy_runs(envoy: &Envoy, target: &str, blue_port: u16, before: Option<&Value>) -> Value {
    let dump = envoy
        .dump_matches("Envoy's endpoints and routes, by name", |d| {
            let endpoints = section(d, "EndpointsConfigDump").map(endpoints_of_dump);
            endpoints.is_some_and(|e| {
                e.get("blue")
                    .is_some_and(|b| b[0]["endpoints"][0][1] == json!(blue_port))
                    && e.contains_key("green-eps")
            }) && section(d, "RoutesConfigDump").is_some_and(|r| r["dynamic_route_configs"].as_array().is_some())
        })
        .await;
    let stats = envoy.stats().await;

    let endpoints = client_update(target, CLA, "blue,green-eps").await;
    assert_eq!(endpoints["removed"], json!([]), "{endpoints}");
    let printed: BTreeMap<String, Value> = endpoints["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().to_owned(),
                endpoints_of(&snake_keys(&r["body"])),
            )
        })
        .collect();
    let in_envoy = endpoints_of_dump(section(&dump, "EndpointsConfigDump").unwrap());
    assert_eq!(printed, in_envoy, "client: {endpoints}");
    let version_of = |update: &Value, name: &str| -> Value {
        let resources = update["resources"].as_array().unwrap();
        resources.iter().find(|r| r["name"] == name).unwrap()["version"].clone()
    };
    for (cluster, assignment) in [("blue", "blue"), ("green", "green-eps")] {
        let carried = match before {
            Some(before) if version_of(before, assignment) == version_of(&endpoints, assignment) => before,
            _ => &endpoints,
        };
        assert_eq!(
            stats
                .get(&format!("cluster.{cluster}.version_text"))
                .map(String::as_str),
            carried["version"].as_str(),
            "the EDS version Envoy holds for {cluster}"
        );
    }

    let routes = client_update(target, ROUTES, "front-routes").await;
    let resources = routes["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1, "{routes}");
    let in_envoy = section(&dump, "RoutesConfigDump").unwrap()["dynamic_route_configs"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        in_envoy.len(),
        1,
        "only the route configuration Envoy named: {in_envoy:?}"
    );
    assert_eq!(in_envoy[0]["version_info"], resources[0]["version"]);
    let mut body = snake_keys(&resources[0]["body"]);
    body["@type"] = json!(ROUTES);
    assert_eq!(in_envoy[0]["route_config"], body);
    assert_eq!(
        stats
            .get("http.front.rds.front-routes.version_text")
            .map(String::as_str),
        routes["version"].as_str()
    );
    endpoints
}

/// Envoy's `dynamic_endpoint_configs` by cluster name, as [`endpoints_of`].
fn endpoints_of_dump(section: &Value) -> BTreeMap<String, Value> {
    section["dynamic_endpoint_configs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let assignment = &c["endpoint_config"];
            (
                assignment["cluster_name"].as_str().unwrap().to_owned(),
                endpoints_of(assignment),
            )
        })
        .collect()
}

/// A real delta Envoy subscribed by name (EDS for its clusters, RDS for its
/// listener) and `client --protocol xds-delta --names` for the same names
/// see the same thing, before and after an edit.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn the_delta_client_prints_what_a_real_envoy_receives_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.yaml"), by_name_config(9101)).unwrap();
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let envoy = Envoy::start(gw.listen, AdsApi::Delta, "envoy-ci-review")
        .await
        .unwrap_or_else(|why| panic!("Envoy: {why}"));
    let target = gw.listen.to_string();
    let before = client_prints_what_envoy_runs(&envoy, &target, 9101, None).await;
    std::fs::write(dir.path().join("config.yaml"), by_name_config(9201)).unwrap();
    let after = client_prints_what_envoy_runs(&envoy, &target, 9201, Some(&before)).await;
    // Only blue's assignment changed.
    let versions = |update: &Value| -> Vec<Value> {
        update["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["version"].clone())
            .collect()
    };
    let (old, new) = (versions(&before), versions(&after));
    assert!(old[0] != new[0] && old[1] == new[1], "{before} then {after}");
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(0));
}
