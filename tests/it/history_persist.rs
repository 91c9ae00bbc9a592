//! The history of each collection survives a restart with `--cache-dir`: a
//! gateway restarted on the same directory, with no upstream to reach, lists
//! the versions it kept and diffs them as it did before.

use mcp_xds_gateway::proto::Resource;
use mcp_xds_gateway::source::persisted;
use serde_json::Value;

use crate::helpers::{eventually, galley_and_gateway, get_json, start_gateway, within, VS};

/// A resource whose body is a `google.protobuf.Struct` (`{"host": host}`),
/// which the admin port decodes, so a diff can show bodies.
fn vs(name: &str, version: &str, host: &str) -> Resource {
    crate::rollout::vs(name, version, host, 1.0)
}

/// What the admin port says of VS's history and of its changes since `from`.
async fn views(admin: std::net::SocketAddr, from: &str) -> (Value, Value) {
    (
        get_json(admin, &format!("/debug/history/{VS}")).await,
        get_json(admin, &format!("/debug/diff/{VS}?from={from}&bodies=yaml")).await,
    )
}

#[tokio::test]
async fn the_history_survives_a_restart_with_cache_dir() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().to_str().unwrap().to_owned();
    let (galley, gw, mut upstream) = galley_and_gateway(&[VS], &["--cache-dir", &cache_dir]).await;
    // v2 changes a, adds c, removes b; v3 changes c.
    let states = [
        vec![vs("a", "1", "a.local"), vs("b", "1", "b.local")],
        vec![vs("a", "2", "a2.local"), vs("c", "1", "c.local")],
        vec![vs("a", "2", "a2.local"), vs("c", "2", "c2.local")],
    ];
    let mut versions = Vec::new();
    for state in states {
        upstream.push_full(VS, state).await;
        versions.push(gw.cache.get(VS).unwrap().version.to_string());
    }
    let (oldest, newest) = (versions[0].clone(), versions[2].clone());
    eventually("the history of v3 to be persisted", || {
        persisted::peek_history(dir.path(), VS)
            .is_ok_and(|h| h.versions.len() == 3 && h.versions.last().is_some_and(|v| v.version == newest))
    })
    .await;
    let (history, diff) = views(gw.admin, &oldest).await;
    let listed: Vec<&str> = history["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [&*versions[2], &*versions[1], &*versions[0]], "{history}");
    assert_eq!(diff["removed"], serde_json::json!(["b"]), "{diff}");

    // Restarted on the same directory, with nothing listening upstream.
    let url = galley.url();
    drop(upstream);
    within("the Galley to stop", galley.stop()).await;
    assert!(within("the gateway to stop", gw.shutdown()).await);
    let restarted = start_gateway(&[
        "--upstream",
        &url,
        "--collections",
        VS,
        "--cache-dir",
        &cache_dir,
        "--reconnect-min-delay",
        "10ms",
    ])
    .await;
    let current = restarted.cache.get(VS).expect("VS is loaded from the cache directory");
    assert_eq!(*current.version, *newest);
    assert_eq!(current.origin, mcp_xds_gateway::cache::Origin::Disk);

    let (history_after, diff_after) = views(restarted.admin, &oldest).await;
    // Everything as it was, but the newest now comes from disk.
    let mut expected = history.clone();
    expected["versions"][0]["origin"] = "disk".into();
    assert_eq!(history_after, expected);
    assert_eq!(diff_after, diff);
    let changed = diff_after["changed"].as_array().unwrap();
    let a = changed.iter().find(|c| c["name"] == "a").expect("a changed");
    let body_diff = a["diff"].as_str().unwrap();
    assert!(
        body_diff.lines().any(|l| l.starts_with('-') && l.contains("- a.local")),
        "the old body is back: {diff_after}"
    );
    assert!(within("the restarted gateway to stop", restarted.shutdown()).await);
}
