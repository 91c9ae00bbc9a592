//! Rollout safety: the history of each collection's versions and the diff
//! between two of them, on the admin port, fed by a fake Galley.

use mcp_xds_gateway::proto::Resource;
use serde_json::Value;

use crate::helpers::galley::GalleyStream;
use crate::helpers::{galley_and_gateway, get_json, http_get, sample, VS};

/// A resource whose body is a `google.protobuf.Struct` (`{"hosts": [host],
/// "weight": weight}`), which the admin port decodes natively.
pub(crate) fn vs(name: &str, version: &str, host: &str, weight: f64) -> Resource {
    use prost_types::value::Kind;
    let value = |kind| prost_types::Value { kind: Some(kind) };
    let body = prost_types::Struct {
        fields: [
            (
                "hosts".to_owned(),
                value(Kind::ListValue(prost_types::ListValue {
                    values: vec![value(Kind::StringValue(host.to_owned()))],
                })),
            ),
            ("weight".to_owned(), value(Kind::NumberValue(weight))),
        ]
        .into(),
    };
    mcp_xds_gateway::tools::galley::resource(
        name,
        version,
        "type.googleapis.com/google.protobuf.Struct",
        &prost::Message::encode_to_vec(&body),
    )
}

async fn current_version(gw: &mcp_xds_gateway::app::Bound) -> String {
    get_json(gw.admin, &format!("/debug/cache/{VS}")).await["version"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Pushes a full state and returns the collection's content version then.
pub(crate) async fn push(
    upstream: &mut GalleyStream,
    gw: &mcp_xds_gateway::app::Bound,
    resources: Vec<Resource>,
) -> String {
    upstream.push_full(VS, resources).await;
    current_version(gw).await
}

fn names(value: &Value) -> Vec<&str> {
    value.as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect()
}

/// The history lists the last `--history` versions, newest first, each with
/// what its apply added, changed and removed; the diff names what differs
/// between any two of them, in either direction, and shows changed bodies
/// as unified diffs of their decoded form; what is not there is a 404 that
/// names it.
#[tokio::test]
async fn the_history_keeps_the_last_versions_and_the_diff_names_their_changes() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &["--history", "3"]).await;
    // (name, version, host, weight) of each state pushed: v2 changes a,
    // adds d, removes c; v3 changes b; v4 adds e.
    let a1 = ("a", "1", "a.local", 1.0);
    let (a2, b1, c1, d1) = (
        ("a", "2", "a2.local", 1.0),
        ("b", "1", "b.local", 1.0),
        ("c", "1", "c.local", 1.0),
        ("d", "1", "d.local", 1.0),
    );
    let (b2, e1) = (("b", "2", "b.local", 0.5), ("e", "1", "e.local", 1.0));
    let states: [&[(&str, &str, &str, f64)]; 4] = [&[a1, b1, c1], &[a2, b1, d1], &[a2, b2, d1], &[a2, b2, d1, e1]];
    let mut pushed = Vec::new();
    for state in states {
        let resources = state.iter().map(|(n, v, h, w)| vs(n, v, h, *w)).collect();
        pushed.push(push(&mut upstream, &gw, resources).await);
    }
    let [v1, v2, v3, v4] = <[String; 4]>::try_from(pushed).unwrap();

    let history = get_json(gw.admin, &format!("/debug/history/{VS}")).await;
    assert_eq!(history["kept"], 3, "{history}");
    let versions = history["versions"].as_array().unwrap();
    let listed: Vec<&str> = versions.iter().map(|v| v["version"].as_str().unwrap()).collect();
    assert_eq!(listed, [&*v4, &*v3, &*v2], "newest first, v1 gone: {history}");
    let counts: Vec<(u64, u64, u64)> = versions
        .iter()
        .map(|v| {
            (
                v["added"].as_u64().unwrap(),
                v["changed"].as_u64().unwrap(),
                v["removed"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(counts, [(1, 0, 0), (0, 1, 0), (1, 1, 1)], "{history}");
    assert_eq!(versions[0]["current"], true);
    assert_eq!(versions[1]["current"], false);
    assert_eq!(versions[0]["origin"], "upstream");
    assert_eq!(versions[0]["resources"], 4);
    assert!(versions[0]["applied_at"].is_string(), "{history}");

    // The history's cost is in the metrics: b's old body is what the older
    // versions hold beyond the newest (a's old body went with v1).
    let (_, metrics) = http_get(gw.admin, "/metrics").await;
    let series = |name: &str| {
        sample(&metrics, name, &[&format!("collection=\"{VS}\"")])
            .unwrap_or_else(|| panic!("no {name} for {VS}:\n{metrics}"))
    };
    assert_eq!(series("mcp_gateway_history_versions"), 3.0);
    assert!(series("mcp_gateway_history_bytes") > 0.0);

    // `to` defaults to the latest.
    let forward = get_json(gw.admin, &format!("/debug/diff/{VS}?from={v2}")).await;
    assert_eq!(
        (forward["from"].as_str(), forward["to"].as_str()),
        (Some(&*v2), Some(&*v4))
    );
    assert_eq!(names(&forward["added"]), ["e"]);
    assert_eq!(names(&forward["changed"]), ["b"]);
    assert!(names(&forward["removed"]).is_empty(), "{forward}");
    let back = get_json(gw.admin, &format!("/debug/diff/{VS}?from={v4}&to={v2}")).await;
    assert_eq!(names(&back["removed"]), ["e"]);
    assert_eq!(names(&back["changed"]), ["b"]);
    assert!(names(&back["added"]).is_empty(), "{back}");
    let same = get_json(gw.admin, &format!("/debug/diff/{VS}?from={v3}&to={v3}")).await;
    assert!(
        [&same["added"], &same["removed"], &same["changed"]]
            .iter()
            .all(|l| l.as_array().unwrap().is_empty()),
        "{same}"
    );

    let bodies = get_json(gw.admin, &format!("/debug/diff/{VS}?from={v2}&to={v3}&bodies=yaml")).await;
    let changed = bodies["changed"].as_array().unwrap();
    assert_eq!(changed.len(), 1, "{bodies}");
    assert_eq!(changed[0]["name"], "b");
    let diff = changed[0]["diff"].as_str().unwrap();
    assert!(diff.starts_with(&format!("--- b@{v2}\n+++ b@{v3}\n")), "{diff}");
    assert!(
        diff.lines().any(|l| l.starts_with('-') && l.contains("weight: 1")),
        "{diff}"
    );
    assert!(
        diff.lines().any(|l| l.starts_with('+') && l.contains("weight: 0.5")),
        "{diff}"
    );
    assert!(
        diff.lines().any(|l| l.starts_with(' ') && l.contains("b.local")),
        "context: {diff}"
    );

    // What is not there is named.
    let (status, said) = http_get(gw.admin, &format!("/debug/diff/{VS}?from={v1}")).await;
    assert_eq!(status, 404, "{said}");
    assert!(said.contains(&v1) && said.contains("--history=3"), "{said}");
    let (status, said) = http_get(gw.admin, "/debug/history/istio/networking/v1alpha3/nothing").await;
    assert_eq!(status, 404, "{said}");
    assert!(said.contains("istio/networking/v1alpha3/nothing"), "{said}");
    let (status, said) = http_get(gw.admin, &format!("/debug/diff/{VS}")).await;
    assert_eq!(status, 400, "{said}");
    assert!(said.contains("from=VERSION"), "{said}");
    let (status, said) = http_get(gw.admin, &format!("/debug/diff/{VS}?from={v2}&bodies=xml")).await;
    assert_eq!(status, 400, "{said}");
    assert!(said.contains("bodies=yaml"), "{said}");
}
