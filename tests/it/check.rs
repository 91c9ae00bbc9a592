//! `mcp-xds-gateway check`: the files source's reader run over files and
//! directories without serving, as CI runs it: the examples pass, every bad
//! input of the reference's table is its own finding at its file and line,
//! and the cross-references a deploy would trip on are warnings.

use std::path::Path;

use tokio::process::Command;

use crate::helpers::within;

const BIN: &str = env!("CARGO_BIN_EXE_mcp-xds-gateway");

/// Runs `mcp-xds-gateway check ARGS…`: exit code, stdout, stderr.
async fn check(args: &[&str]) -> (Option<i32>, String, String) {
    let output = within(
        "the check command to exit",
        Command::new(BIN).arg("check").args(args).kill_on_drop(true).output(),
    )
    .await
    .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn examples(dir: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(dir)
        .display()
        .to_string()
}

/// The findings of `--output json`: (file name, line, severity, message).
pub(crate) fn findings(json: &str) -> Vec<(String, u64, String, String)> {
    let parsed: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    parsed
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let file = f["file"].as_str().unwrap();
            let name = Path::new(file).file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                f["line"].as_u64().unwrap(),
                f["severity"].as_str().unwrap().to_owned(),
                f["message"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// `--output json`'s findings are `expected` ((file name, line, part of the
/// message)) in order, each of `severity`.
fn assert_found(json: &str, expected: &[(&str, u64, &str)], severity: &str) {
    let found = findings(json);
    assert_eq!(found.len(), expected.len(), "{json}");
    for ((file, line, shown, message), (want_file, want_line, want_message)) in found.iter().zip(expected) {
        assert_eq!(
            (file.as_str(), *line, shown.as_str()),
            (*want_file, *want_line, severity),
            "{message}"
        );
        assert!(message.contains(want_message), "{file}: {message}");
    }
}

#[tokio::test]
async fn the_examples_pass_clean() {
    let (istio, envoy) = (examples("config"), examples("envoy/config"));
    let (code, stdout, stderr) = check(&[&istio, &envoy]).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(stdout, "", "no finding, not even a warning");
    assert!(
        stderr.contains("7 files, 15 resources: 0 errors, 0 warnings"),
        "{stderr}"
    );
    let (code, stdout, _) = check(&["--strict", "--output", "json", &istio, &envoy]).await;
    assert_eq!((code, stdout.trim()), (Some(0), "[]"));
}

#[tokio::test]
async fn every_bad_file_is_its_own_finding_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &[u8]| std::fs::write(dir.path().join(name), text).unwrap();
    let istio = |kind: &str, rest: &str| format!("apiVersion: networking.istio.io/v1\nkind: {kind}\n{rest}");
    // One good file, served.
    write(
        "good.yaml",
        istio("Gateway", "metadata: {name: a}\nspec: {}\n").as_bytes(),
    );
    // The rows of docs/reference.md's bad-input table for files.
    write(
        "syntax.yaml",
        format!(
            "{}---\n{}",
            istio("Gateway", "metadata: {name: b}\n"),
            istio("Gateway", "metadata:\n  name: c\n spec: {}\n")
        )
        .as_bytes(),
    );
    write("kind.yaml", istio("VirtualServce", "metadata: {name: a}\n").as_bytes());
    write(
        "field.yaml",
        istio(
            "VirtualService",
            "metadata: {name: a}\nspec:\n  hosts: [a]\n  http:\n  - route:\n    - destination: {host: a, subst: v1}\n",
        )
        .as_bytes(),
    );
    write(
        "type.yaml",
        istio(
            "ServiceEntry",
            "metadata: {name: a}\nspec:\n  hosts: [a]\n  ports:\n  - number: eighty\n",
        )
        .as_bytes(),
    );
    write(
        "noname.yaml",
        istio("Sidecar", "metadata: {namespace: x}\nspec: {}\n").as_bytes(),
    );
    write(
        "twice.yaml",
        format!(
            "{}---\n{}",
            istio("Gateway", "metadata: {name: t}\n"),
            istio("Gateway", "metadata: {name: t}\n")
        )
        .as_bytes(),
    );
    let mut bomb = String::from(
        "collection: istio/networking/v1alpha3/gateways\nname: ns/bomb\nbody:\n  struct:\n    big: &big [",
    );
    bomb.push_str(&vec!["x"; 2000].join(","));
    bomb.push_str("]\n    copies:\n");
    bomb.push_str(&"      - *big\n".repeat(4000));
    write("bomb.yaml", bomb.as_bytes());
    write("binary.yaml", &[0xff, 0xfe, 0x00, 0x80]);
    write("huge.yaml", &vec![b'#'; 70_000]);
    std::os::unix::fs::symlink(dir.path().join("loop.yaml"), dir.path().join("loop.yaml")).unwrap();
    // Fails the test, saying why, where no FIFO can be made: never skipped.
    crate::helpers::mkfifo(&dir.path().join("fifo.yaml"));
    let path = dir.path().display().to_string();

    let (code, stdout, stderr) = check(&["--max-message-bytes", "65536", "-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let expected = vec![
        ("binary.yaml", 0, "not UTF-8"),
        ("bomb.yaml", 5, "expands to more than its size allows"),
        (
            "field.yaml",
            8,
            "spec.http[0].route[0].destination.subst: unrecognized field name 'subst'",
        ),
        ("fifo.yaml", 0, "not a regular file"),
        ("huge.yaml", 0, "larger than --max-message-bytes=65536"),
        (
            "kind.yaml",
            2,
            "kind \"VirtualServce\" is not a kind of networking.istio.io/v1 this gateway reads (did you mean VirtualService? it reads",
        ),
        ("loop.yaml", 0, "cannot read"),
        ("noname.yaml", 3, "metadata.name is missing"),
        ("syntax.yaml", 9, "line 9"),
        ("twice.yaml", 7, "is defined twice (first at line 3)"),
        ("type.yaml", 7, "spec.ports[0].number"),
    ];
    assert_found(&stdout, &expected, "error");
    assert!(
        stderr.contains(&format!("{} errors, 0 warnings", expected.len())),
        "{stderr}"
    );

    // The text form is the files source's own line, FILE:LINE: message.
    let (code, text, _) = check(&["--max-message-bytes", "65536", &path]).await;
    assert_eq!(code, Some(1));
    let kind_line = format!("{path}/kind.yaml:2: error: ");
    assert!(text.lines().any(|l| l.starts_with(&kind_line)), "{text}");
    assert_eq!(text.lines().count(), expected.len(), "{text}");
    // GitHub's annotations: one per finding, each naming file and line.
    let (code, github, _) = check(&["--max-message-bytes", "65536", "--output", "github", &path]).await;
    assert_eq!(code, Some(1));
    assert!(
        github
            .lines()
            .any(|l| l.starts_with(&format!("::error file={path}/field.yaml,line=8,"))),
        "{github}"
    );
    assert!(github.lines().all(|l| l.starts_with("::error file=")), "{github}");
    // One file by name: only its own findings; the good one alone passes.
    let (code, stdout, _) = check(&[&format!("{path}/kind.yaml")]).await;
    assert_eq!(code, Some(1));
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let (code, stdout, _) = check(&[&format!("{path}/good.yaml")]).await;
    assert_eq!((code, stdout.as_str()), (Some(0), ""));
}

/// Istio resources with a route to a subset no rule defines, and Envoy's
/// with every kind of dangling name; one resource in two files.
const ISTIO: &str = "\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: ratings, namespace: bookinfo}
spec:
  hosts: [ratings]
  http:
  - route:
    - destination: {host: ratings, subset: v1}
    - destination: {host: ratings.bookinfo.svc.cluster.local, subset: v2}
    - destination: {host: reviews.bookinfo.svc.cluster.local, subset: v1}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: ratings, namespace: bookinfo}
spec:
  host: ratings
  subsets: [{name: v1, labels: {version: v1}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: all, namespace: other}
spec:
  host: '*.bookinfo.svc.cluster.local'
  subsets: [{name: v1, labels: {version: v1}}]
";

const ENVOY: &str = "\
collection: envoy/config/cluster/v3/clusters
name: backend
body:
  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
  json: {name: backend, connect_timeout: 1s, type: EDS, eds_cluster_config: {eds_config: {ads: {}}}}
---
collection: envoy/config/listener/v3/listeners
name: http
body:
  type_url: type.googleapis.com/envoy.config.listener.v3.Listener
  json:
    name: http
    address: {socket_address: {address: 127.0.0.1, port_value: 10000}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http
          rds: {route_config_name: missing_route, config_source: {ads: {}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificate_sds_secret_configs:
            - {name: server-cert, sds_config: {ads: {}}}
            - {name: from-bootstrap}
---
collection: envoy/config/route/v3/routeconfigurations
name: local_route
body:
  type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration
  json:
    name: local_route
    virtual_hosts:
    - name: all
      domains: ['*']
      routes:
      - match: {prefix: /a}
        route: {cluster: backend}
      - match: {prefix: /b}
        route: {cluster: nowhere}
      - match: {prefix: /c}
        route: {weighted_clusters: {clusters: [{name: backend, weight: 1}, {name: gone, weight: 1}]}}
";

const AGAIN: &str = "\
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: ratings, namespace: bookinfo}
spec:
  host: ratings
";

/// The line (from 1) of the first line of `text` holding `part`.
fn line_of(text: &str, part: &str) -> u64 {
    text.lines()
        .position(|l| l.contains(part))
        .unwrap_or_else(|| panic!("{part:?} in {text}")) as u64
        + 1
}

#[tokio::test]
async fn cross_references_a_deploy_would_trip_on_are_warnings_at_the_field_and_strict_makes_them_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a-istio.yaml"), ISTIO).unwrap();
    std::fs::write(dir.path().join("b-envoy.yaml"), ENVOY).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(0), "warnings only: {stdout}{stderr}");
    // Each at the line of the field that names what is missing.
    let expected = [
        (
            "a-istio.yaml",
            line_of(ISTIO, "subset: v2"),
            "subset \"v2\" of host \"ratings.bookinfo.svc.cluster.local\"",
        ),
        (
            "b-envoy.yaml",
            line_of(ENVOY, "eds_cluster_config"),
            "EDS cluster \"backend\" has no load assignment",
        ),
        (
            "b-envoy.yaml",
            line_of(ENVOY, "route_config_name: missing_route"),
            "RDS name \"missing_route\" has no route configuration",
        ),
        (
            "b-envoy.yaml",
            line_of(ENVOY, "name: server-cert"),
            "SDS name \"server-cert\" has no secret",
        ),
        (
            "b-envoy.yaml",
            line_of(ENVOY, "cluster: nowhere"),
            "cluster \"nowhere\", which no file defines",
        ),
        (
            "b-envoy.yaml",
            line_of(ENVOY, "name: gone"),
            "cluster \"gone\", which no file defines",
        ),
    ];
    assert_found(&stdout, &expected, "warning");
    let parsed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(parsed[0]["collection"], "istio/networking/v1alpha3/virtualservices");
    assert_eq!(parsed[0]["name"], "bookinfo/ratings");
    // Every finding is tagged: `warning:` here, `error:` under --strict
    // (marked as made one by it), which fails the check.
    let (code, text, _) = check(&[&path]).await;
    assert_eq!(code, Some(0));
    let rds = format!(
        "{path}/b-envoy.yaml:{}: warning: RDS name",
        line_of(ENVOY, "route_config_name: missing_route")
    );
    assert!(text.lines().any(|l| l.starts_with(&rds)), "{text}");
    assert!(text.lines().all(|l| l.contains(": warning: ")), "{text}");
    let (code, text, stderr) = check(&["--strict", &path]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("6 errors, 0 warnings"), "{stderr}");
    assert_eq!(text.lines().count(), 6, "{text}");
    assert!(text.lines().all(|l| l.contains(": error: [strict] ")), "{text}");
    let (_, json, _) = check(&["--strict", "-o", "json", &path]).await;
    let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(
        parsed
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["severity"] == "error" && f["strict"] == true),
        "{json}"
    );
}

/// A name missing in many places of one resource is one finding, at its
/// first place, counting the others; past 100 names of one resource the
/// rest are counted in one finding at the resource.
#[tokio::test]
async fn a_missing_name_is_one_finding_and_many_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let mut routes: Vec<String> = (0..3)
        .map(|i| format!("      - {{match: {{prefix: /same{i}}}, route: {{cluster: missing}}}}\n"))
        .collect();
    routes.extend((0..105).map(|i| format!("      - {{match: {{prefix: /m{i}}}, route: {{cluster: m{i}}}}}\n")));
    let text = format!(
        "collection: envoy/config/route/v3/routeconfigurations\nname: r\nbody:\n  type_url: \
         type.googleapis.com/envoy.config.route.v3.RouteConfiguration\n  json:\n    name: r\n    virtual_hosts:\n    \
         - name: all\n      domains: ['*']\n      routes:\n{}",
        routes.concat()
    );
    std::fs::write(dir.path().join("routes.yaml"), &text).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let found = findings(&stdout);
    assert_eq!(found.len(), 101, "{stderr}");
    assert_eq!(found[0].1, 1, "the count, at the resource");
    assert!(found[0].3.starts_with("6 more names"), "{}", found[0].3);
    assert_eq!(found[1].1, line_of(&text, "cluster: missing"));
    assert!(
        found[1].3.ends_with("(and 2 more places in this resource)"),
        "{}",
        found[1].3
    );
    assert_eq!(found[100].1, line_of(&text, "cluster: m98}"));
}

/// A document nested past the YAML reader's depth limit is one finding at
/// its line, found without reading the rest: 400,000 levels of flow
/// collections once held `check` (and the files source) for minutes.
#[tokio::test]
async fn a_document_nested_too_deep_is_a_finding_without_reading_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let deep = format!(
        "collection: istio/networking/v1alpha3/gateways\nname: a\nbody:\n  struct: {{a: {}\n",
        "[".repeat(400_000)
    );
    std::fs::write(dir.path().join("deep.yaml"), deep).unwrap();
    let maps = format!(
        "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata: {{name: m}}\nspec: {}\n",
        "{a: ".repeat(400_000)
    );
    std::fs::write(dir.path().join("maps.yaml"), maps).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let found = findings(&stdout);
    assert_eq!(found.len(), 2, "{stdout}");
    for (file, line) in [("deep.yaml", 4), ("maps.yaml", 4)] {
        let finding = found
            .iter()
            .find(|f| f.0 == file)
            .unwrap_or_else(|| panic!("{file}: {stdout}"));
        assert_eq!((finding.1, finding.2.as_str()), (line, "error"), "{stdout}");
        assert!(finding.3.contains("recursion limit exceeded"), "{stdout}");
    }
}

/// A body of a type the gateway knows that does not decode as it (a field
/// of the wrong wire type) is served, and each client reads it as its
/// parser does: a warning, at the document. One that names a secret's type
/// is refused outside the collections of secrets: an error (issue 42's
/// sixteenth check).
#[tokio::test]
async fn a_body_that_does_not_decode_as_its_type_is_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    // Cluster{name: "c"}, then field 24 (transport_socket) as a varint.
    std::fs::write(
        dir.path().join("bad-wire.yaml"),
        "collection: envoy/config/cluster/v3/clusters\nname: c\nbody: {type_url: \
         type.googleapis.com/envoy.config.cluster.v3.Cluster, value_base64: CgFjwAEF}\n",
    )
    .unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(0), "warnings only: {stdout}{stderr}");
    let found = findings(&stdout);
    assert_eq!(found.len(), 1, "{stdout}");
    assert_eq!(
        (found[0].0.as_str(), found[0].1, found[0].2.as_str()),
        ("bad-wire.yaml", 1, "warning"),
        "{stdout}"
    );
    assert!(
        found[0]
            .3
            .contains("does not decode as envoy.config.cluster.v3.Cluster"),
        "{stdout}"
    );
}

/// A name defined twice is an error wherever the second one is: in the
/// same file (the gateway refuses the file) or in another (the gateway
/// serves the first file's and ignores the other): either way one
/// definition is never served.
#[tokio::test]
async fn a_name_defined_twice_is_an_error_in_one_file_and_across_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a-istio.yaml"), ISTIO).unwrap();
    std::fs::write(dir.path().join("c-again.yaml"), AGAIN).unwrap();
    let twice = format!("{AGAIN}---\n{}", AGAIN.replace("ratings", "other"));
    let twice = format!("{twice}---\n{}", AGAIN.replace("ratings", "other"));
    std::fs::write(dir.path().join("d-twice.yaml"), &twice).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let found = findings(&stdout);
    let errors: Vec<_> = found.iter().filter(|f| f.2 == "error").collect();
    assert_eq!(errors.len(), 2, "{stdout}");
    assert_eq!((errors[0].0.as_str(), errors[0].1), ("c-again.yaml", 3));
    assert!(
        errors[0].3.contains(&format!("also defined at {path}/a-istio.yaml:14"))
            && errors[0].3.contains("the gateway serves the first file's"),
        "{}",
        errors[0].3
    );
    assert_eq!(
        (errors[1].0.as_str(), errors[1].1),
        ("d-twice.yaml", line_of(&twice, "name: other") + 6)
    );
    assert!(errors[1].3.contains("is defined twice"), "{}", errors[1].3);
}

/// Two typos in one file are two findings, each at its line, with the
/// field or value meant, naming the resource; the file still serves
/// nothing (its resources count for no cross-reference).
#[tokio::test]
async fn every_error_of_a_file_is_found_at_its_line_with_what_was_meant() {
    let dir = tempfile::tempdir().unwrap();
    let text = "\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: reviews, namespace: bookinfo}
spec:
  hosts: [reviews]
  http:
  - timout: 5s
    route:
    - destination:
        hots: reviews
        subset: v1
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: default, namespace: bookinfo}
spec:
  mtls:
    mode: STRICTT
";
    std::fs::write(dir.path().join("typos.yaml"), text).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert_found(
        &stdout,
        &[
            (
                "typos.yaml",
                line_of(text, "timout"),
                "spec.http[0].timout: unrecognized field name 'timout' (did you mean 'timeout'?)",
            ),
            (
                "typos.yaml",
                line_of(text, "hots"),
                "spec.http[0].route[0].destination.hots: unrecognized field name 'hots' (did you mean 'host'?)",
            ),
            (
                "typos.yaml",
                line_of(text, "STRICTT"),
                "spec.mtls.mode: unrecognized enum value 'STRICTT' (did you mean 'STRICT'?)",
            ),
        ],
        "error",
    );
    // Every parse error names the resource whose kind and name were read.
    let parsed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let named: Vec<(&str, &str)> = parsed
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["collection"].as_str().unwrap(), f["name"].as_str().unwrap()))
        .collect();
    assert_eq!(
        named,
        [
            ("istio/networking/v1alpha3/virtualservices", "bookinfo/reviews"),
            ("istio/networking/v1alpha3/virtualservices", "bookinfo/reviews"),
            ("istio/security/v1beta1/peerauthentications", "bookinfo/default"),
        ]
    );
    assert!(stderr.contains("1 file, 0 resources: 3 errors"), "{stderr}");
    // Text: each tagged.
    let (_, text_out, _) = check(&[&path]).await;
    assert!(
        text_out
            .lines()
            .all(|l| l.starts_with(&format!("{path}/typos.yaml:")) && l.contains(": error: ")),
        "{text_out}"
    );
}

/// What Envoy would NACK although it decodes: an endpoint address that is
/// no IP in a STATIC cluster, and `validate.rules` of its protos (a port
/// out of range, a virtual host without domains): errors at the field's
/// line. A DNS cluster's host name is fine.
#[tokio::test]
async fn what_envoy_would_refuse_is_an_error_at_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let routes = "\
collection: envoy/config/route/v3/routeconfigurations
name: local_route
body:
  type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration
  json:
    name: local_route
    virtual_hosts:
    - name: all
      domains: []
      routes:
      - match: {prefix: /}
        route:
          cluster: backendd
";
    let clusters = [
        cluster_doc("backend", "STATIC", "not-an-ip", 8080),
        cluster_doc("dns", "STRICT_DNS", "backend.example.com", 80),
        cluster_doc("port", "STATIC", "10.0.0.1", 70000),
    ]
    .concat();
    std::fs::write(dir.path().join("clusters.yaml"), &clusters).unwrap();
    std::fs::write(dir.path().join("routes.yaml"), routes).unwrap();
    let path = dir.path().display().to_string();
    let (code, stdout, stderr) = check(&["-o", "json", &path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let found = findings(&stdout);
    let shown: Vec<(&str, u64, &str)> = found.iter().map(|f| (f.0.as_str(), f.1, f.2.as_str())).collect();
    assert_eq!(
        shown,
        [
            ("clusters.yaml", line_of(&clusters, "not-an-ip"), "error"),
            ("clusters.yaml", line_of(&clusters, "70000"), "error"),
            ("routes.yaml", line_of(routes, "domains: []"), "error"),
            ("routes.yaml", line_of(routes, "cluster: backendd"), "warning"),
        ],
        "{stdout}"
    );
    assert!(
        found[0].3.starts_with(
            "json.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address: malformed IP \
             address: not-an-ip"
        ) && found[0].3.contains("NACK"),
        "{}",
        found[0].3
    );
    assert!(
        found[1]
            .3
            .contains("port_value: value must be less than or equal to 65535")
            && found[1]
                .3
                .contains("validate.rules of envoy.config.core.v3.SocketAddress.port_value"),
        "{}",
        found[1].3
    );
    assert!(
        found[2]
            .3
            .contains("virtual_hosts[0].domains: value must contain at least 1 items"),
        "{}",
        found[2].3
    );
    assert!(found[3].3.contains("cluster \"backendd\""), "{}", found[3].3);
}

/// A STATIC cluster of `address:port`, or a DNS one (`kind`).
fn cluster_doc(name: &str, kind: &str, address: &str, port: u32) -> String {
    format!(
        "collection: envoy/config/cluster/v3/clusters
name: {name}
body:
  type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster
  json:
    name: {name}
    connect_timeout: 1s
    type: {kind}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {address}, port_value: {port}}}}}}}
---
"
    )
}

/// What check calls an error Envoy would refuse, Envoy 1.40 refuses (its
/// NACK says the same), and what check passes it takes: the gateway serves
/// both as written.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn what_check_says_envoy_refuses_a_real_envoy_refuses() {
    use crate::helpers::envoy::{AdsApi, Envoy};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap().to_owned();
    let good = [
        cluster_doc("ok", "STATIC", "127.0.0.1", 9),
        cluster_doc("dns", "STRICT_DNS", "localhost", 9),
    ]
    .concat();
    std::fs::write(dir.path().join("clusters.yaml"), &good).unwrap();
    let (code, stdout, stderr) = check(&[&path]).await;
    assert_eq!((code, stdout.as_str()), (Some(0), ""), "{stderr}");
    let gw = crate::helpers::start_gateway(&["--source-dir", &path]).await;
    let envoy = Envoy::start(gw.listen, AdsApi::Sotw, "envoy-check")
        .await
        .unwrap_or_else(|why| panic!("Envoy: {why}"));
    envoy
        .clusters_when("the clusters check passes", |c| crate::envoy::names(c) == ["dns", "ok"])
        .await;
    assert_eq!(envoy.stat("cluster_manager.cds.update_rejected").await, Some(0));

    for (rejected, bad, says) in [
        (
            1,
            cluster_doc("bad", "STATIC", "not-an-ip", 9),
            "malformed IP address: not-an-ip",
        ),
        (
            2,
            cluster_doc("bad", "STATIC", "127.0.0.1", 70000),
            "value must be less than or equal to 65535",
        ),
    ] {
        let text = format!("{good}{bad}");
        std::fs::write(dir.path().join("clusters.yaml"), &text).unwrap();
        let (code, stdout, _) = check(&["-o", "json", &path]).await;
        assert_eq!(code, Some(1), "{stdout}");
        assert_found(
            &stdout,
            &[("clusters.yaml", text.lines().count() as u64 - 1, says)],
            "error",
        );
        envoy
            .stat_when("cluster_manager.cds.update_rejected", |v| v == rejected)
            .await;
        crate::helpers::eventually("Envoy's log to say why it refused", || envoy.log().contains(says)).await;
    }
}

/// What Envoy would refuse of a body in a collection `--type-map` marks
/// sensitive is found at its field, repeating nothing of the body.
#[tokio::test]
async fn what_envoy_refuses_in_a_sensitive_collection_is_said_without_its_values() {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("types.yaml");
    std::fs::write(
        &map,
        "custom/private-clusters: {type_url: type.googleapis.com/envoy.config.cluster.v3.Cluster, sensitive: true}\n\
         custom/private-routes: {type_url: type.googleapis.com/envoy.config.route.v3.RouteConfiguration, \
         sensitive: true}\n",
    )
    .unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let text = [
        cluster_doc("plain", "STATIC", "MARKER-PLAIN", 9),
        cluster_doc("hidden", "STATIC", "MARKER-HIDDEN", 9).replace(
            "collection: envoy/config/cluster/v3/clusters",
            "collection: custom/private-clusters",
        ),
    ]
    .concat();
    std::fs::write(src.join("clusters.yaml"), &text).unwrap();
    // A route to a cluster no file defines: a warning, naming nothing of
    // the sensitive body.
    std::fs::write(
        src.join("routes.yaml"),
        "collection: custom/private-routes\nname: r\nbody:\n  type_url: \
         type.googleapis.com/envoy.config.route.v3.RouteConfiguration\n  json:\n    name: r\n    virtual_hosts:\n    \
         - name: v\n      domains: ['*']\n      routes:\n      - {match: {prefix: /}, route: {cluster: MARKER-ROUTED}}\n",
    )
    .unwrap();
    for format in ["text", "json", "github"] {
        let (code, stdout, stderr) =
            check(&["-o", format, "--type-map", map.to_str().unwrap(), src.to_str().unwrap()]).await;
        assert_eq!(code, Some(1), "{stdout}{stderr}");
        let shown = format!("{stdout}{stderr}");
        assert!(shown.contains("malformed IP address: MARKER-PLAIN"), "{shown}");
        assert!(shown.contains("malformed IP address: [redacted]"), "{shown}");
        assert!(shown.contains("which no file defines"), "{shown}");
        assert!(
            !shown.contains("MARKER-HIDDEN") && !shown.contains("MARKER-ROUTED"),
            "{format}: {shown}"
        );
    }
}

/// A value written in a file reaches the terminal escaped: no escape
/// sequence of a file's is acted on.
#[tokio::test]
async fn values_from_a_file_are_printed_terminal_safe() {
    let dir = tempfile::tempdir().unwrap();
    let text = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: a}\nspec:\n  hosts: [a]\n  \
                \"x\\e[2J\": 1\n";
    std::fs::write(dir.path().join("esc.yaml"), text).unwrap();
    let path = dir.path().display().to_string();
    for output in ["text", "github"] {
        let (code, stdout, _) = check(&["-o", output, &path]).await;
        assert_eq!(code, Some(1), "{stdout}");
        assert!(!stdout.contains('\x1b'), "{stdout:?}");
        assert!(stdout.contains("unrecognized field name 'x\\x1b[2J'"), "{stdout}");
    }
    // A resource's name and a field of its body in one message: each
    // escaped once, by the printing, not the name twice.
    let dir = tempfile::tempdir().unwrap();
    let text = "collection: envoy/config/cluster/v3/clusters\nname: \"a\\e]0;T\\a\\nFAKE\"\nbody:\n  type_url: \
                type.googleapis.com/envoy.config.cluster.v3.Cluster\n  json: {\"\\e[31mbad\": 1}\n";
    std::fs::write(dir.path().join("named.yaml"), text).unwrap();
    let (code, stdout, _) = check(&[&dir.path().display().to_string()]).await;
    assert_eq!(code, Some(1), "{stdout}");
    assert!(
        stdout.contains("body of \"a\\x1b]0;T\\x07\\nFAKE\": json.\\x1b[31mbad: unrecognized field name"),
        "{stdout}"
    );
}

#[tokio::test]
async fn usage_errors_exit_2_naming_what_is_wrong() {
    let (code, _, stderr) = check(&[]).await;
    assert_eq!(code, Some(2), "{stderr}");
    let (code, _, stderr) = check(&["/nonexistent/config"]).await;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("/nonexistent/config: No such file"), "{stderr}");
    let (code, _, stderr) = check(&["--output", "xml", &examples("config")]).await;
    assert_eq!(code, Some(2), "{stderr}");
    let (code, _, stderr) = check(&["--type-map", "/nonexistent/map.yaml", &examples("config")]).await;
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--type-map"), "{stderr}");
}
