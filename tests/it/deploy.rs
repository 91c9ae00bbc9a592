//! The manifests in `deploy/` against the binary itself: every manifest
//! parses, ports and probe paths match the gateway's defaults, every flag in
//! a container's args is one the binary accepts (and validates), and the
//! dashboard ConfigMap is the dashboard.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};
use mcp_xds_gateway::config::Args;
use serde_norway::Value;

use crate::helpers::{http_get, kustomize};

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

/// Renders a kustomization (`deploy/base`, an overlay) with the test's
/// kustomize renderer: the checks run wherever the tests do, and
/// `the_renderer_agrees_with_kustomize` holds it to kustomize itself.
fn render(kustomization: &str) -> Vec<Value> {
    kustomize::render(&root().join(kustomization)).unwrap_or_else(|e| panic!("rendering {kustomization}: {e}"))
}

/// Every kustomization under `deploy/` that deploys (components are parts
/// of one), as a path from the repository's root.
fn kustomizations() -> Vec<String> {
    let mut found: Vec<String> = manifests()
        .iter()
        .filter(|(path, docs)| {
            path.file_name().is_some_and(|f| f == "kustomization.yaml") && docs.iter().all(|d| kind(d) != "Component")
        })
        .map(|(path, _)| {
            path.parent()
                .unwrap()
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    found.sort();
    found
}

/// `kubectl kustomize` of a kustomization, by the kubectl in `KUBECTL_BIN`.
fn kubectl_kustomize(kustomization: &str) -> Vec<Value> {
    // Set when the tests were built; `--include-ignored` without it: the
    // kubectl on PATH, if any.
    let kubectl = std::env::var("KUBECTL_BIN").unwrap_or_else(|_| "kubectl".into());
    let output = std::process::Command::new(&kubectl)
        .args(["kustomize", &root().join(kustomization).to_string_lossy()])
        .output()
        .unwrap_or_else(|e| panic!("{kubectl}: {e}"));
    assert!(
        output.status.success(),
        "kubectl kustomize {kustomization}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

/// Objects in a stable order (kustomize sorts by kind, the renderer keeps
/// the files' order): by kind, namespace and name.
fn sorted(mut docs: Vec<Value>) -> Vec<Value> {
    docs.sort_by_key(|d| {
        (
            kind(d).to_owned(),
            d["metadata"]["namespace"].as_str().unwrap_or("").to_owned(),
            d["metadata"]["name"].as_str().unwrap_or("").to_owned(),
        )
    });
    docs
}

/// The test's renderer gives what kustomize gives, object for object, for
/// every kustomization shipped.
#[test]
#[cfg_attr(
    not(peer_kubectl),
    ignore = "needs kubectl: build and run with KUBECTL_BIN set to its binary (.ci/run installs one under target/kubectl-venv)"
)]
fn the_renderer_agrees_with_kustomize() {
    for kustomization in kustomizations() {
        let expected = kubectl_kustomize(&kustomization);
        let rendered = sorted(render(&kustomization));
        let expected = sorted(expected);
        assert_eq!(rendered.len(), expected.len(), "{kustomization}: objects");
        for (ours, theirs) in rendered.iter().zip(&expected) {
            assert!(
                ours == theirs,
                "{kustomization}: {} {} differs:\n--- test renderer\n{}\n--- kubectl kustomize\n{}",
                kind(theirs),
                theirs["metadata"]["name"].as_str().unwrap_or(""),
                serde_norway::to_string(ours).unwrap(),
                serde_norway::to_string(theirs).unwrap()
            );
        }
    }
}

/// The port the binary's monitoring listener takes with these args (the
/// gateway's, or the `source` command's).
fn monitoring_port(args: &[String]) -> u16 {
    let argv = std::iter::once("mcp-xds-gateway".to_owned()).chain(args.iter().cloned());
    let parsed = Args::try_parse_from(argv).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    match parsed.command {
        None => parsed.monitoring_listen.port(),
        Some(mcp_xds_gateway::config::Command::Source(source)) => source.monitoring_listen.port(),
        Some(other) => panic!("{other:?} is not a server"),
    }
}

/// Whether the labels `selector` asks for are all on `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let Some(selector) = selector.as_mapping().filter(|s| !s.is_empty()) else {
        return false;
    };
    selector.iter().all(|(key, value)| labels.get(key) == Some(value))
}

/// What every kustomization deploys, as rendered: a namespace on every
/// namespaced object; every Service (and every other selector: budgets,
/// policies, pod monitors) selecting the pods of a Deployment in its
/// namespace; probes on the monitoring port; no Istio sidecar in any pod;
/// and a dial-out gateway that upgrades by replacing its pod.
#[test]
fn every_rendered_kustomization_deploys_and_upgrades() {
    let all = kustomizations();
    assert!(all.len() >= 3, "{all:?}");
    for kustomization in all {
        let docs = render(&kustomization);
        for doc in &docs {
            if kustomize::is_namespaced(kind(doc)) {
                assert!(
                    doc["metadata"]["namespace"].as_str().is_some_and(|n| !n.is_empty()),
                    "{kustomization}: {} {} has no namespace (kubectl apply -k would put it in the current one)",
                    kind(doc),
                    doc["metadata"]["name"].as_str().unwrap_or("")
                );
            }
        }
        let deployments = of_kind(&docs, "Deployment");
        assert!(!deployments.is_empty(), "{kustomization}");
        let pods_of = |namespace: &Value, selector: &Value| {
            deployments
                .iter()
                .filter(|d| d["metadata"]["namespace"] == *namespace)
                .any(|d| selects(selector, &d["spec"]["template"]["metadata"]["labels"]))
        };
        for (selecting, selector) in [
            ("Service", &["spec", "selector"][..]),
            ("PodDisruptionBudget", &["spec", "selector", "matchLabels"]),
            ("NetworkPolicy", &["spec", "podSelector", "matchLabels"]),
            ("PodMonitor", &["spec", "selector", "matchLabels"]),
        ] {
            for object in of_kind(&docs, selecting) {
                let selector = selector.iter().fold(object, |v: &Value, key| &v[*key]);
                assert!(
                    pods_of(&object["metadata"]["namespace"], selector),
                    "{kustomization}: {selecting} {} selects no Deployment's pods in its namespace: {selector:?}",
                    object["metadata"]["name"].as_str().unwrap_or("")
                );
            }
        }
        for deployment in deployments {
            let name = deployment["metadata"]["name"].as_str().unwrap_or("");
            let template = &deployment["spec"]["template"];
            assert!(
                selects(
                    &deployment["spec"]["selector"]["matchLabels"],
                    &template["metadata"]["labels"]
                ),
                "{kustomization}: {name} selects its own pods"
            );
            for place in ["labels", "annotations"] {
                assert_eq!(
                    template["metadata"][place]["sidecar.istio.io/inject"], "false",
                    "{kustomization}: {name}: an injected sidecar would clash on the gateway's ports ({place})"
                );
            }
            let server = container(deployment);
            let args = args(server);
            let monitoring = monitoring_port(&args);
            let ports = ports(server);
            for probe in ["readinessProbe", "livenessProbe"] {
                let port = &server[probe]["httpGet"]["port"];
                let number = match port.as_str() {
                    Some(named) => ports.get(named).copied(),
                    None => port.as_u64(),
                };
                assert_eq!(
                    number,
                    Some(u64::from(monitoring)),
                    "{kustomization}: {name}'s {probe} must hit the monitoring port ({monitoring})"
                );
            }
            if args.iter().any(|a| a.starts_with("--sink-listen")) {
                assert_eq!(
                    deployment["spec"]["strategy"]["type"], "Recreate",
                    "{kustomization}: {name} takes one source connection: a rolling update would hang"
                );
            }
        }
    }
}

fn of_kind<'a>(docs: &'a [Value], wanted: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| kind(d) == wanted).collect()
}

/// What the shipped manifests promise an operator, in the source files and
/// in every overlay as rendered.
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
        let docs = render(overlay);
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

/// `deploy/source` runs the `source` command as the binary parses and
/// validates it, serving where its ports and Service say, with the
/// config from a mounted ConfigMap.
#[test]
fn the_source_kustomization_runs_the_source_command() {
    let docs = render("deploy/source");
    let deployment = of_kind(&docs, "Deployment")[0];
    let source = container(deployment);
    let config = tempfile::tempdir().unwrap();
    let mut args = args(source);
    assert_eq!(args[0], "source", "the source command");
    let mounts = source["volumeMounts"].as_sequence().unwrap();
    for arg in args.iter_mut() {
        if let Some(dir) = arg.strip_prefix("--source-dir=") {
            let mount = mounts
                .iter()
                .find(|m| m["mountPath"] == dir)
                .unwrap_or_else(|| panic!("--source-dir {dir} is not a mounted volume"));
            let volume = deployment["spec"]["template"]["spec"]["volumes"]
                .as_sequence()
                .unwrap()
                .iter()
                .find(|v| v["name"] == mount["name"])
                .unwrap();
            assert!(
                volume["configMap"]["name"].is_string(),
                "the config comes from a ConfigMap"
            );
            *arg = format!("--source-dir={}", config.path().display());
        }
    }
    let argv = std::iter::once("mcp-xds-gateway".to_owned()).chain(args.iter().cloned());
    let Some(mcp_xds_gateway::config::Command::Source(command)) = Args::try_parse_from(argv).unwrap().command else {
        panic!("{args:?}: the source command")
    };
    let settings = command.validate().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(matches!(settings.serve, mcp_xds_gateway::config::Serve::ResourceSource));
    let ports = ports(source);
    assert_eq!(ports["grpc-mcp"], u64::from(settings.listen.port()));
    assert_eq!(ports["http-monitoring"], u64::from(settings.monitoring_listen.port()));
    assert!(!ports.values().any(|p| *p == u64::from(settings.admin_listen.port())));
    let service = of_kind(&docs, "Service")[0];
    for port in service["spec"]["ports"].as_sequence().unwrap() {
        let target = port["targetPort"].as_str().unwrap();
        assert_eq!(port["port"].as_u64(), Some(ports[target]), "Service port {target}");
    }
    assert_eq!(source["securityContext"]["readOnlyRootFilesystem"], true);
    // Voluntary disruptions leave one replica serving.
    let budget = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(budget.len(), 1, "deploy/source has a PodDisruptionBudget");
    assert_eq!(budget[0]["spec"]["minAvailable"], 1);
    assert!(
        selects(
            &budget[0]["spec"]["selector"]["matchLabels"],
            &deployment["spec"]["template"]["metadata"]["labels"]
        ),
        "it selects the source's pods"
    );
    assert!(
        deployment["spec"]["replicas"].as_u64() > Some(1),
        "a budget of one needs two replicas"
    );
}

/// Every alert names its runbook: a section of docs/operating.md that exists.
#[test]
fn every_alert_has_a_runbook_that_exists() {
    let all = manifests();
    let rules = &find(&all, "components/monitoring/prometheusrule.yaml")[0];
    let operating = std::fs::read_to_string(root().join("docs/operating.md")).unwrap();
    let anchors = crate::docs::read(&operating).anchors;
    let alerts: Vec<&Value> = rules["spec"]["groups"][0]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|r| r["alert"].is_string())
        .collect();
    assert_eq!(alerts.len(), 9);
    for alert in alerts {
        let url = alert["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{:?} has no runbook_url", alert["alert"]));
        let anchor = url
            .strip_prefix("docs/operating.md#")
            .unwrap_or_else(|| panic!("{url}: a section of docs/operating.md"));
        assert!(anchors.contains(anchor), "{url}: no such section");
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
