//! The manifests in `deploy/` against the binary itself: every manifest
//! parses, ports and probe paths match the gateway's defaults, every flag in
//! a container's args is one the binary accepts (and validates), and the
//! dashboard ConfigMap is the dashboard.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};
use mcp_xds_gateway::config::Args;
use serde_norway::Value;

use crate::helpers::http_get;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every YAML document under `deploy/`, by file.
fn manifests() -> BTreeMap<PathBuf, Vec<Value>> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, Vec<Value>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                let docs: Vec<Value> = serde_norway::Deserializer::from_str(&text)
                    .map(|doc| {
                        serde::Deserialize::deserialize(doc)
                            .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()))
                    })
                    .collect();
                out.insert(path, docs);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&root().join("deploy"), &mut out);
    out
}

fn kind(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or("")
}

fn find<'a>(all: &'a BTreeMap<PathBuf, Vec<Value>>, file: &str) -> &'a Vec<Value> {
    all.get(&root().join("deploy").join(file))
        .unwrap_or_else(|| panic!("deploy/{file} is missing"))
}

fn container(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

/// Named container ports: name → port.
fn ports(container: &Value) -> BTreeMap<String, u64> {
    container["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// The container's args, checked by the binary's own parser and validation.
fn validate(args: &[String]) -> mcp_xds_gateway::config::Settings {
    let known: Vec<String> = Args::command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    for arg in args {
        let flag = arg.split('=').next().unwrap();
        assert!(known.iter().any(|k| k == flag), "{flag} is not a flag of the binary");
    }
    Args::try_parse_from(std::iter::once("mcp-xds-gateway".to_owned()).chain(args.iter().cloned()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .validate()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

#[test]
fn every_manifest_parses_and_the_kustomizations_name_existing_files() {
    let all = manifests();
    assert!(all.len() >= 10, "{:?}", all.keys());
    for (path, docs) in &all {
        for doc in docs {
            assert!(
                !kind(doc).is_empty(),
                "{} has a document without a kind",
                path.display()
            );
            if kind(doc) != "Kustomization" && kind(doc) != "Component" {
                continue;
            }
            let dir = path.parent().unwrap();
            let listed = ["resources", "components"]
                .iter()
                .flat_map(|key| doc[*key].as_sequence().into_iter().flatten())
                // Inline patches (`patch:`) name no file.
                .chain(
                    doc["patches"]
                        .as_sequence()
                        .into_iter()
                        .flatten()
                        .map(|p| &p["path"])
                        .filter(|p| !p.is_null()),
                )
                .chain(
                    doc["configMapGenerator"]
                        .as_sequence()
                        .into_iter()
                        .flatten()
                        .flat_map(|g| g["files"].as_sequence().into_iter().flatten()),
                );
            for entry in listed {
                let target = dir.join(entry.as_str().unwrap());
                assert!(
                    target.exists(),
                    "{} names {} which does not exist",
                    path.display(),
                    target.display()
                );
            }
        }
    }
}

#[test]
fn the_base_matches_the_binarys_defaults() {
    let all = manifests();
    let defaults = Args::try_parse_from(["mcp-xds-gateway"]).unwrap();

    let deployment = &find(&all, "base/deployment.yaml")[0];
    assert_eq!(kind(deployment), "Deployment");
    let gateway = container(deployment);
    let ports = ports(gateway);
    assert_eq!(ports["grpc-mcp"], u64::from(defaults.listen.port()));
    assert_eq!(ports["http-monitoring"], u64::from(defaults.monitoring_listen.port()));
    assert!(
        !ports.values().any(|p| *p == u64::from(defaults.admin_listen.port())),
        "the admin port stays on loopback: no container port"
    );
    assert_eq!(gateway["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(gateway["readinessProbe"]["httpGet"]["port"], "http-monitoring");
    assert_eq!(gateway["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(gateway["livenessProbe"]["httpGet"]["port"], "http-monitoring");
    assert!(gateway["resources"]["requests"]["cpu"].is_string());
    assert!(gateway["resources"]["requests"]["memory"].is_string());

    // Restricted security context.
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(gateway["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(gateway["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(gateway["securityContext"]["capabilities"]["drop"][0], "ALL");
    // Termination outlasts the gateway's own shutdown grace.
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace > defaults.shutdown_grace.as_secs(), "{grace}");

    // The args are flags the binary accepts, and a cache dir it can write.
    let settings = validate(&args(gateway));
    assert!(matches!(settings.source, mcp_xds_gateway::config::Source::Client(_)));
    let cache_dir = settings.cache_dir.expect("the base persists the cache");
    let mounts = gateway["volumeMounts"].as_sequence().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| Path::new(m["mountPath"].as_str().unwrap()) == cache_dir),
        "--cache-dir is on a mounted volume (the root filesystem is read-only)"
    );

    // The Service targets the container's named ports.
    let service = &find(&all, "base/service.yaml")[0];
    for port in service["spec"]["ports"].as_sequence().unwrap() {
        let target = port["targetPort"].as_str().unwrap();
        assert!(ports.contains_key(target), "Service targets unknown port {target}");
        assert_eq!(port["port"].as_u64(), Some(ports[target]));
    }
    for (file, expected) in [
        ("base/serviceaccount.yaml", "ServiceAccount"),
        ("base/poddisruptionbudget.yaml", "PodDisruptionBudget"),
        ("base/horizontalpodautoscaler.yaml", "HorizontalPodAutoscaler"),
    ] {
        assert_eq!(kind(&find(&all, file)[0]), expected);
    }
}

#[test]
fn the_dial_out_overlay_listens_where_its_ports_say() {
    let all = manifests();
    let patch = &find(&all, "overlays/dial-out/deployment-patch.yaml")[0];
    let gateway = container(patch);
    // The certificate files must come from a mounted Secret; for the binary's
    // own validation they are replaced by real files.
    let mounts: Vec<(String, String)> = gateway["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().into(),
                m["mountPath"].as_str().unwrap().into(),
            )
        })
        .collect();
    let volumes = patch["spec"]["template"]["spec"]["volumes"].as_sequence().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::helpers::certs::Ca::new("mesh-ca");
    let leaf = ca.leaf("mcp-xds-gateway");
    let mut flags = Vec::new();
    for arg in args(gateway) {
        let (flag, value) = arg.split_once('=').unwrap_or((&arg, ""));
        let content = match flag {
            "--tls-cert" => &leaf.cert,
            "--tls-key" => &leaf.key,
            "--client-ca" => &ca.pem,
            _ => {
                flags.push(arg.clone());
                continue;
            }
        };
        let (volume, _) = mounts
            .iter()
            .find(|(_, path)| value.starts_with(path.as_str()))
            .unwrap_or_else(|| panic!("{flag} {value} is not on a mounted volume"));
        let secret = volumes.iter().find(|v| v["name"].as_str() == Some(volume)).unwrap();
        assert!(secret["secret"]["secretName"].is_string(), "{flag} comes from a Secret");
        let file = dir.path().join(flag.trim_start_matches('-'));
        std::fs::write(&file, content).unwrap();
        flags.push(format!("{flag}={}", file.display()));
    }
    let settings = validate(&flags);
    let mcp_xds_gateway::config::Source::Sink(sink) = settings.source else {
        panic!("the dial-out overlay runs --sink-listen")
    };
    assert_eq!(ports(gateway)["grpc-sink"], u64::from(sink.listen.port()));
    assert!(!sink.insecure, "sources are authenticated with mTLS");
    let allowed = sink.allow.expect("an allow-list for the source's identity");
    assert!(allowed
        .entries()
        .iter()
        .any(|e| e.contains("istio-galley-service-account")));
    // Galley reaches the pod before it is ready (it becomes ready once
    // Galley delivered), through a Service of its own.
    let service = &find(&all, "overlays/dial-out/service-sink.yaml")[0];
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "grpc-sink");
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    // One replica (Galley feeds one sink), so no autoscaler, and a budget
    // that does not block node drains.
    assert_eq!(patch["spec"]["replicas"], 1);
    let removed = &find(&all, "overlays/dial-out/remove-autoscaler.yaml")[0];
    assert_eq!(
        (kind(removed), &removed["$patch"]),
        ("HorizontalPodAutoscaler", &Value::from("delete"))
    );
    let budget = &find(&all, "overlays/dial-out/poddisruptionbudget-patch.yaml")[0];
    assert_eq!(budget["spec"]["maxUnavailable"], 1);
}

/// Renders an overlay with `kubectl kustomize` (kustomize's own rendering);
/// `None`, with a message, where kubectl is not installed.
fn render(overlay: &str) -> Option<Vec<Value>> {
    let output = match std::process::Command::new("kubectl")
        .args(["kustomize", &root().join(overlay).to_string_lossy()])
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            eprintln!("SKIPPED rendering {overlay}: kubectl is not installed ({e}); the source files are checked");
            return None;
        }
    };
    assert!(
        output.status.success(),
        "kubectl kustomize {overlay}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    Some(
        serde_norway::Deserializer::from_str(&text)
            .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
            .collect(),
    )
}

fn of_kind<'a>(docs: &'a [Value], wanted: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| kind(d) == wanted).collect()
}

/// What the shipped manifests promise an operator, in the source files and,
/// where kubectl is installed, in every overlay as kustomize renders it.
#[test]
fn every_overlay_deploys_as_shipped() {
    let all = manifests();
    // One images entry names a registry and pins a version.
    let base = &find(&all, "base/kustomization.yaml")[0];
    let image = &base["images"][0];
    assert!(
        image["newName"].as_str().unwrap().contains('/'),
        "a registry: {image:?}"
    );
    let tag = image["newTag"].as_str().unwrap();
    assert!(tag != "latest" && tag.chars().next().unwrap().is_ascii_digit(), "{tag}");
    // The PodMonitor carries the label kube-prometheus-stack selects on; the
    // dashboard ConfigMap a namespace and the sidecar's label.
    let monitor = &find(&all, "components/monitoring/podmonitor.yaml")[0];
    assert!(monitor["metadata"]["labels"]["release"].is_string());
    let generator = &find(&all, "components/monitoring/kustomization.yaml")[0]["configMapGenerator"][0];
    assert!(generator["namespace"].is_string());

    for overlay in ["deploy/base", "deploy/overlays/dial-out", "deploy/overlays/monitored"] {
        let Some(docs) = render(overlay) else { return };
        let deployment = of_kind(&docs, "Deployment")[0];
        let gateway = container(deployment);
        assert_eq!(
            gateway["image"],
            format!("{}:{tag}", image["newName"].as_str().unwrap()),
            "{overlay}"
        );
        assert_eq!(gateway["securityContext"]["readOnlyRootFilesystem"], true, "{overlay}");
        assert_eq!(
            deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
            true
        );
        // Services expose the config and monitoring ports (and the sink),
        // never the admin port.
        let defaults = Args::try_parse_from(["mcp-xds-gateway"]).unwrap();
        for service in of_kind(&docs, "Service") {
            for port in service["spec"]["ports"].as_sequence().unwrap() {
                assert_ne!(
                    port["port"].as_u64(),
                    Some(u64::from(defaults.admin_listen.port())),
                    "{overlay}"
                );
            }
        }
        // A NetworkPolicy admits each served port, and only those.
        let policy = of_kind(&docs, "NetworkPolicy");
        let admitted: Vec<u64> = policy[0]["spec"]["ingress"]
            .as_sequence()
            .unwrap()
            .iter()
            .flat_map(|rule| {
                rule["ports"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .map(|p| p["port"].as_u64().unwrap())
            })
            .collect();
        let served: Vec<u64> = ports(gateway).into_values().collect();
        let mut sorted = admitted.clone();
        sorted.sort_unstable();
        let mut expected = served.clone();
        expected.sort_unstable();
        assert_eq!(
            sorted, expected,
            "{overlay}: every container port is admitted, no other"
        );
        let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
        let autoscalers = of_kind(&docs, "HorizontalPodAutoscaler");
        if overlay.ends_with("dial-out") {
            assert_eq!(replicas, 1, "Galley feeds one sink");
            assert!(autoscalers.is_empty(), "a second replica would never get a source");
            let sink = of_kind(&docs, "Service")
                .into_iter()
                .find(|s| s["spec"]["ports"][0]["name"] == "grpc-sink")
                .expect("a sink Service");
            assert_eq!(sink["spec"]["publishNotReadyAddresses"], true);
            let budget = of_kind(&docs, "PodDisruptionBudget")[0];
            assert!(
                budget["spec"]["minAvailable"].is_null(),
                "with one replica it would block drains"
            );
        } else {
            assert!(replicas >= 2 && autoscalers.len() == 1, "{overlay}");
        }
        if overlay.ends_with("monitored") {
            let dashboard = of_kind(&docs, "ConfigMap")[0];
            assert!(dashboard["metadata"]["namespace"].is_string());
            assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
            assert!(of_kind(&docs, "PodMonitor")[0]["metadata"]["labels"]["release"].is_string());
        }
    }
}

#[test]
fn the_monitoring_component_scrapes_metrics_and_ships_the_dashboard() {
    let all = manifests();
    let monitor = &find(&all, "components/monitoring/podmonitor.yaml")[0];
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["port"], "http-monitoring");
    assert_eq!(endpoint["path"], "/metrics");
    let component = &find(&all, "components/monitoring/kustomization.yaml")[0];
    assert_eq!(kind(component), "Component");
    let generator = &component["configMapGenerator"][0];
    assert_eq!(generator["options"]["labels"]["grafana_dashboard"], "1");
    let copy = std::fs::read(root().join("deploy/components/monitoring/mcp-xds-gateway.json")).unwrap();
    let dashboard = std::fs::read(root().join("dashboards/mcp-xds-gateway.json")).unwrap();
    assert!(
        copy == dashboard,
        "deploy/components/monitoring/mcp-xds-gateway.json must be a copy of dashboards/mcp-xds-gateway.json"
    );
}

#[test]
fn the_dockerfile_builds_the_gateway_and_runs_it_as_non_root() {
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let defaults = Args::try_parse_from(["mcp-xds-gateway"]).unwrap();
    assert!(dockerfile.matches("FROM ").count() >= 2, "multi-stage");
    assert!(dockerfile.contains("--bin mcp-xds-gateway"));
    // The dependencies build in their own layer, before the code is copied.
    let manifests = dockerfile
        .find("COPY Cargo.toml Cargo.lock")
        .expect("the manifests copied alone");
    let code = dockerfile.find("COPY . .").expect("then the code");
    assert!(
        manifests < code && dockerfile[manifests..code].contains("cargo build"),
        "{dockerfile}"
    );
    let user = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    assert!(!user.starts_with('0') && !user.starts_with("root"), "{user}");
    let expose = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("EXPOSE "))
        .expect("an EXPOSE line");
    for port in [defaults.listen.port(), defaults.monitoring_listen.port()] {
        assert!(expose.split_whitespace().any(|p| p == port.to_string()), "{expose}");
    }
}

/// The probes the manifests use answer on a running gateway.
#[tokio::test]
async fn the_probe_paths_answer_on_a_gateway() {
    let gw = crate::helpers::start_gateway(&[]).await;
    assert_eq!(http_get(gw.monitoring, "/healthz").await.0, 200);
    assert_eq!(http_get(gw.monitoring, "/readyz").await.0, 200);
    let (status, body) = http_get(gw.monitoring, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("mcp_gateway_build_info"), "{body}");
}
