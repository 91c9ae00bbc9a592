//! Version skew (issue 36): clients of each Istio generation (the project's
//! own fakes dressed as Istio 1.0, 1.1, a 1.3 sink and istiod) read a
//! `DestinationRule` that sets `consecutive5xxErrors` (Istio 1.5); what each
//! release drops without a NACK is shown in `/debug/syncz`, `/debug/skew`
//! (at its file and line), `status`, the admin index and
//! `mcp_gateway_skew_resources`, read from a gateway process of its own (the
//! gauge is the assertion: no other test's gateway can move it).

use std::collections::BTreeMap;

use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
use mcp_xds_gateway::proto::envoy::service::discovery::v3::DiscoveryRequest;
use serde_json::Value;

use crate::helpers::clients::{channel, sotw, PilotSink, V10Client, V10Request, V10SotwClient, SOTW_PATH};
use crate::helpers::{eventually_async, get_json, http_get, http_get_with, sample, spawn_gateway, within, Running};
use crate::xds::{SotwStream, SOTW};

const DR: &str = "istio/networking/v1alpha3/destinationrules";
const DR_TYPE_URL: &str = "type.googleapis.com/istio.networking.v1alpha3.DestinationRule";
const DR_GVK: &str = "networking.istio.io/v1alpha3/DestinationRule";
/// The line of `consecutive5xxErrors` in [`rules`].
const FIELD_LINE: usize = 11;

/// Two DestinationRules: `reviews` sets a field of Istio 1.5 (at
/// [`FIELD_LINE`]); `ratings` is read whole by every release.
pub(crate) fn rules(errors_field: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1alpha3
kind: DestinationRule
metadata:
  name: reviews
  namespace: bookinfo
spec:
  host: reviews
  trafficPolicy:
    outlierDetection:
      interval: 1m
      {errors_field}: 5
---
apiVersion: networking.istio.io/v1alpha3
kind: DestinationRule
metadata:
  name: ratings
  namespace: bookinfo
spec:
  host: ratings
  trafficPolicy:
    connectionPool: {{tcp: {{maxConnections: 10}}}}
"
    )
}

const DROPPED: &str = "spec.trafficPolicy.outlierDetection.consecutive5xxErrors";

fn drop_message(release: &str) -> String {
    format!("Istio {release} clients drop {DROPPED} (added in 1.5)")
}

/// istiod's node with `ISTIO_VERSION` as adsc sends it.
fn istiod_node(id: &str, version: &str) -> Option<Node> {
    let text = |s: &str| prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue(s.into())),
    };
    Some(Node {
        id: id.into(),
        metadata: Some(prost_types::Struct {
            fields: [
                ("GENERATOR".to_owned(), text("api")),
                ("ISTIO_VERSION".to_owned(), text(version)),
            ]
            .into(),
        }),
        ..Default::default()
    })
}

/// An istiod reading DestinationRules over MCP over xDS, its first response
/// ACKed.
async fn istiod(gw: &Running, id: &str, version: &str) -> SotwStream {
    let mut stream = SotwStream::open(gw.listen, SOTW).await;
    stream.send(DiscoveryRequest {
        type_url: DR_GVK.into(),
        node: istiod_node(id, version),
        ..Default::default()
    });
    let response = stream.recv().await;
    stream.send(DiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        version_info: response.version_info.clone(),
        node: istiod_node(id, version),
        ..Default::default()
    });
    stream
}

/// The syncz row of `node`'s DestinationRules.
fn row<'a>(syncz: &'a Value, node: &str) -> &'a Value {
    syncz["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node_id"] == node && r["collection"] == DR)
        .unwrap_or_else(|| panic!("no DestinationRule row of {node}: {syncz:#}"))
}

async fn skew_gauge(gw: &Running, generation: &str) -> Option<f64> {
    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    sample(
        &metrics,
        "mcp_gateway_skew_resources",
        &[&format!("collection=\"{DR}\""), &format!("generation=\"{generation}\"")],
    )
}

/// Waits until every row of the generations in `expected` shows its count.
async fn counts_are(gw: &Running, expected: &[(&str, Option<u64>)]) -> Value {
    let admin = gw.admin;
    crate::helpers::eventually_some("the skew counts in /debug/syncz", || async move {
        let syncz = get_json(admin, "/debug/syncz").await;
        let shown = expected.iter().all(|(node, count)| {
            let found = syncz["rows"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|r| r["node_id"] == *node && r["collection"] == DR);
            found.is_some_and(|r| r["skew"]["resources"].as_u64() == *count && r["status"] == "SYNCED")
        });
        shown.then_some(syncz)
    })
    .await
}

async fn index_json(gw: &Running) -> Value {
    let (status, index) = http_get_with(gw.admin, "/", "Accept: application/json\r\n").await;
    assert_eq!(status, 200, "{index}");
    serde_json::from_str(&index).unwrap()
}

#[tokio::test]
async fn each_generation_is_shown_what_its_release_drops_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let file = crate::helpers::certs::write(dir.path(), "rules.yaml", &rules("consecutive5xxErrors"));
    let source = dir.path().to_str().unwrap().to_owned();
    let gw = spawn_gateway(
        None,
        &[
            "--source-dir",
            &source,
            "--client-generation",
            "pilot-sink=1.3",
            "--client-generation",
            "*~istiod-pinned.*=1.7",
        ],
    )
    .await;

    // Istio 1.1 on the legacy service (collection names).
    let mut v11 = sotw(gw.listen).await;
    v11.subscribe(DR);
    let response = v11.recv_type(DR).await;
    assert_eq!(response.resources.len(), 2);
    let first_version = response.version_info.clone();
    v11.ack(&response);
    // Istio 1.0 (proto type URLs, `Client` node).
    let mut v10: V10SotwClient =
        V10SotwClient::open_with(channel(gw.listen).await, SOTW_PATH, tonic_prost::ProstCodec::default()).await;
    let request = |version: &str, nonce: &str| V10Request {
        version_info: version.into(),
        client: Some(V10Client {
            id: "pilot-1-0".into(),
            metadata: None,
        }),
        type_url: DR_TYPE_URL.into(),
        response_nonce: nonce.into(),
    };
    v10.send(request("", ""));
    let response = v10.recv().await;
    v10.send(request(&response.version_info, &response.nonce));
    // A ResourceSource sink, named 1.3 by --client-generation.
    let mut sink = PilotSink::connect(gw.listen, &[DR], false).await;
    sink.recv_and_ack().await;
    // istiod: one the rule names 1.7; one sending adsc's placeholder.
    let _pinned = istiod(
        &gw,
        "sidecar~10.0.0.1~istiod-pinned.istio-system~x",
        "65536.65536.65536",
    )
    .await;
    let _unknown = istiod(&gw, "sidecar~10.0.0.2~istiod-other.istio-system~x", "65536.65536.65536").await;
    // One that says its release.
    let said = "sidecar~10.0.0.3~istiod-said.istio-system~x";
    let _said = istiod(&gw, said, "1.4.2").await;

    let pinned = "sidecar~10.0.0.1~istiod-pinned.istio-system~x";
    let unknown = "sidecar~10.0.0.2~istiod-other.istio-system~x";
    let syncz = counts_are(
        &gw,
        &[
            ("pilot-test", Some(1)),
            ("pilot-1-0", Some(1)),
            ("pilot-sink", Some(1)),
            (pinned, Some(0)),
            (said, Some(1)),
            (unknown, None),
        ],
    )
    .await;
    for (node, release, learned) in [
        ("pilot-test", "1.1", "dialect"),
        ("pilot-1-0", "1.0", "dialect"),
        ("pilot-sink", "1.3", "flag"),
        (said, "1.4", "istio-version"),
        (pinned, "1.7", "flag"),
    ] {
        let skew = &row(&syncz, node)["skew"];
        assert_eq!(skew["release"], release, "{node}: {skew}");
        assert_eq!(skew["learned_from"], learned, "{node}: {skew}");
        if release != "1.7" {
            assert_eq!(
                skew["dropped"],
                serde_json::json!([{"name": "bookinfo/reviews", "fields": [drop_message(release)], "more": 0}]),
                "{node}"
            );
        }
    }
    let unknown_skew = &row(&syncz, unknown)["skew"];
    assert_eq!(unknown_skew["release"], "unknown");
    assert!(unknown_skew["why"].as_str().unwrap().contains("--client-generation"));
    // What the admin index and syncz lead with.
    assert!(
        syncz["skew"]
            .as_str()
            .unwrap()
            .starts_with("SKEW: connected clients drop fields"),
        "{}",
        syncz["skew"]
    );
    let index = index_json(&gw).await;
    assert!(
        index["skew"].as_str().unwrap().contains(&drop_message("1.1")),
        "{index:#}"
    );

    // /debug/skew: each generation in use, the field at its file and line.
    let skew = get_json(gw.admin, "/debug/skew").await;
    let generations: BTreeMap<String, &Value> = skew["generations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["release"].as_str().unwrap().to_owned(), g))
        .collect();
    assert_eq!(
        generations.keys().collect::<Vec<_>>(),
        ["1.0", "1.1", "1.3", "1.4", "1.7"]
    );
    for release in ["1.0", "1.1", "1.3", "1.4"] {
        let collection = &generations[release]["collections"][0];
        assert_eq!(collection["collection"], DR);
        assert_eq!(collection["resources"], 1, "{collection:#}");
        let field = &collection["dropped"][0]["fields"][0];
        assert_eq!(field["path"], DROPPED);
        assert_eq!(field["added_in"], "1.5");
        assert_eq!(field["file"], file.display().to_string());
        assert_eq!(field["line"], FIELD_LINE, "{field:#}");
    }
    assert_eq!(generations["1.7"]["resources"], 0);
    assert_eq!(skew["not_checked"].as_array().unwrap().len(), 1, "{skew:#}");
    assert_eq!(skew["not_checked"][0]["node_id"], unknown);

    // The gauge, per generation in use.
    for (generation, count) in [("1.0", 1.0), ("1.1", 1.0), ("1.3", 1.0), ("1.4", 1.0), ("1.7", 0.0)] {
        assert_eq!(skew_gauge(&gw, generation).await, Some(count), "{generation}");
    }

    // `status`: SYNCED with the skew beside it, and each field on a line.
    let status = within(
        "status",
        tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-xds-gateway"))
            .args(["status", "--admin", &gw.admin.to_string()])
            .output(),
    )
    .await
    .unwrap();
    let printed = String::from_utf8_lossy(&status.stdout);
    assert_eq!(status.status.code(), Some(0), "every client is SYNCED: {printed}");
    assert!(printed.contains("SYNCED SKEW 1"), "{printed}");
    assert!(
        printed.contains(&format!(
            "SKEW pilot-test {DR} bookinfo/reviews: {}",
            drop_message("1.1")
        )),
        "{printed}"
    );

    // A change of one resource costs one check per generation in use.
    let checked = skew["resources_checked"].as_u64().unwrap();
    // The 1.0 client leaves: its generation drops nothing any more.
    drop(v10);
    eventually_async("the 1.0 series at 0", || async {
        skew_gauge(&gw, "1.0").await == Some(0.0)
    })
    .await;
    crate::helpers::certs::write(dir.path(), "rules.yaml", &rules("consecutiveErrors"));
    let response = v11.recv_type(DR).await;
    v11.ack(&response);
    sink.recv_and_ack().await;
    // (The istiods do not ACK the new version: only the counts are read.)
    counts_are(&gw, &[("pilot-test", Some(0)), ("pilot-sink", Some(0))]).await;
    for generation in ["1.1", "1.3", "1.4", "1.7"] {
        eventually_async("the gauge at 0", || async {
            skew_gauge(&gw, generation).await == Some(0.0)
        })
        .await;
    }
    // Once every generation's skew is of the new version, exactly one check
    // per generation was made for it.
    let version = response.version_info.clone();
    let after = crate::helpers::eventually_some("every generation checked at the new version", || {
        let version = version.clone();
        async move {
            let skew = get_json(gw.admin, "/debug/skew").await;
            let generations = skew["generations"].as_array()?;
            let done = generations.len() == 4
                && generations
                    .iter()
                    .all(|g| g["collections"][0]["version"].as_str() == Some(version.as_str()));
            done.then_some(skew)
        }
    })
    .await;
    assert_eq!(
        after["resources_checked"].as_u64().unwrap() - checked,
        4,
        "one changed resource, four generations in use (1.1, 1.3, 1.4, 1.7): {after:#}"
    );
    let index = index_json(&gw).await;
    assert_eq!(index["skew"], Value::Null);

    // A pin serves the version with the field again: the skew is of what
    // is served, not of the latest.
    let (status, body) =
        crate::helpers::http_request(gw.admin, "POST", &format!("/pin/{DR}?version={first_version}"), "").await;
    assert_eq!(status, 200, "{body}");
    let response = v11.recv_type(DR).await;
    assert_eq!(response.version_info, first_version);
    v11.ack(&response);
    sink.recv_and_ack().await;
    counts_are(&gw, &[("pilot-test", Some(1)), ("pilot-sink", Some(1))]).await;
    assert_eq!(skew_gauge(&gw, "1.1").await, Some(1.0));
    let (status, body) = crate::helpers::http_request(gw.admin, "DELETE", &format!("/pin/{DR}"), "").await;
    assert_eq!(status, 200, "{body}");
    let response = v11.recv_type(DR).await;
    v11.ack(&response);
    sink.recv_and_ack().await;
    counts_are(&gw, &[("pilot-test", Some(0)), ("pilot-sink", Some(0))]).await;
}

/// Runs `mcp-xds-gateway check ARGS…`: exit code, stdout, stderr.
async fn check(args: &[&str]) -> (Option<i32>, String, String) {
    crate::operating::subcommand("check", args).await
}

#[tokio::test]
async fn check_for_a_release_reports_what_it_drops_at_the_field_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = crate::helpers::certs::write(dir.path(), "rules.yaml", &rules("consecutive5xxErrors"));
    let path = file.display().to_string();
    // Without --for: nothing to say.
    let (code, out, _) = check(&[&path]).await;
    assert_eq!((code, out.as_str()), (Some(0), ""));
    // One release: a warning at the field's line, in Istio's words.
    let (code, out, err) = check(&[&path, "--for", "1.1"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, format!("{path}:{FIELD_LINE}: warning: {}\n", drop_message("1.1")));
    // Every release the gateway has protos of: the ones before 1.5, in one
    // finding of the field.
    let (_, out, _) = check(&[&path, "--for", "all-served", "-o", "json"]).await;
    let found: Vec<Value> = serde_json::from_str(&out).unwrap();
    let messages: Vec<&str> = found.iter().map(|f| f["message"].as_str().unwrap()).collect();
    assert_eq!(messages, [drop_message("1.0, 1.1, 1.2, 1.3 and 1.4")]);
    let (_, text, _) = check(&[&path, "--for", "all-served"]).await;
    assert_eq!(text.lines().count(), 1, "{text}");
    for finding in &found {
        assert_eq!(finding["line"], FIELD_LINE);
        assert_eq!(finding["name"], "bookinfo/reviews");
        assert_eq!(finding["collection"], DR);
        assert_eq!(finding["severity"], "warning");
    }
    // --strict: an error, exit 1.
    let (code, out, _) = check(&[&path, "--for", "1.4", "--strict"]).await;
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(
        out,
        format!("{path}:{FIELD_LINE}: error: [strict] {}\n", drop_message("1.4"))
    );
    // 1.5 and later read it whole.
    let (code, out, _) = check(&[&path, "--for", "1.5", "--for", "1.7", "--strict"]).await;
    assert_eq!((code, out.as_str()), (Some(0), ""));
    // A release the gateway has no protos of is a usage error.
    let (code, _, err) = check(&[&path, "--for", "1.9"]).await;
    assert_eq!(code, Some(2));
    assert!(err.contains("no protos of Istio 1.9"), "{err}");
    let (code, _, err) = check(&[&path, "--for", "2.0"]).await;
    assert_eq!(code, Some(2));
    assert!(err.contains("\"2.0\" is not an Istio release"), "{err}");
}

/// YAML may spell a field by its proto name: its line is still found.
#[tokio::test]
async fn check_finds_the_line_of_a_field_spelt_by_its_proto_name() {
    let dir = tempfile::tempdir().unwrap();
    let text = rules("consecutive5xxErrors")
        .replace("trafficPolicy:", "traffic_policy:")
        .replace("outlierDetection:", "outlier_detection:")
        .replace("consecutive5xxErrors", "consecutive_5xx_errors");
    let file = crate::helpers::certs::write(dir.path(), "rules.yaml", &text);
    let path = file.display().to_string();
    let (code, out, err) = check(&[&path, "--for", "1.1"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, format!("{path}:{FIELD_LINE}: warning: {}\n", drop_message("1.1")));
}

/// The examples are served to every generation: every release reads them
/// whole.
#[tokio::test]
async fn the_examples_are_read_whole_by_every_release() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let (code, out, err) = check(&[
        root.join("config").to_str().unwrap(),
        root.join("envoy/config").to_str().unwrap(),
        "--for",
        "all-served",
        "--strict",
    ])
    .await;
    assert_eq!((code, out.as_str()), (Some(0), ""), "{err}");
}

/// During a canary round the canaries' version counts: it is about to go to
/// everyone, and a canary of an older release already drops its field.
#[tokio::test]
async fn a_canary_rounds_new_version_counts_before_it_reaches_everyone() {
    let dir = tempfile::tempdir().unwrap();
    crate::helpers::certs::write(dir.path(), "rules.yaml", &rules("consecutiveErrors"));
    let source = dir.path().to_str().unwrap().to_owned();
    let gw = spawn_gateway(
        None,
        &[
            "--source-dir",
            &source,
            "--canary",
            "canary-*",
            "--canary-trust-node-ids",
            "--canary-soak",
            "1h",
        ],
    )
    .await;
    let mut v11 = sotw(gw.listen).await;
    v11.subscribe(DR);
    let response = v11.recv_type(DR).await;
    v11.ack(&response);
    let canary_node = "canary-1";
    let mut canary = istiod(&gw, canary_node, "1.1.17").await;
    counts_are(&gw, &[("pilot-test", Some(0)), (canary_node, Some(0))]).await;

    // The new version goes to the canary only (the soak holds the others).
    crate::helpers::certs::write(dir.path(), "rules.yaml", &rules("consecutive5xxErrors"));
    let next = canary.recv().await;
    canary.send(DiscoveryRequest {
        type_url: next.type_url.clone(),
        response_nonce: next.nonce.clone(),
        version_info: next.version_info.clone(),
        node: istiod_node(canary_node, "1.1.17"),
        ..Default::default()
    });
    counts_are(&gw, &[("pilot-test", Some(0)), (canary_node, Some(1))]).await;
    eventually_async("the gauge to count the canaries' version", || async {
        skew_gauge(&gw, "1.1").await == Some(1.0)
    })
    .await;
    let index = index_json(&gw).await;
    let lead = index["skew"].as_str().unwrap_or_default();
    assert!(
        lead.contains(&format!("1 of {DR} at the canaries' version for Istio 1.1")),
        "{index:#}"
    );
}
