//! Rollout safety on a real gateway: canary rounds (a NACK holds a version,
//! the canaries' ACKs release it, a newer version supersedes it, a promotion
//! sends it anyway), pins with state-of-the-world and incremental clients,
//! the policy with no canary connected, pins kept across a restart, and an
//! xDS v3 canary gating `ResourceSource` and legacy clients.

use std::collections::{BTreeMap, HashMap};

use mcp_xds_gateway::proto::{IncrementalMeshConfigResponse, MeshConfigRequest, MeshConfigResponse, SinkNode};
use serde_json::Value;

use crate::helpers::certs::{write, write_leaf, Ca};
use crate::helpers::clients::{incremental, sotw, tls_channel, IncrementalClient, SotwClient, SOTW_PATH};
use crate::helpers::{
    eventually_async, eventually_some, galley_and_gateway, get_json, http_get, http_request, sample, start_gateway,
    within, VS,
};
use crate::rollout::{push, vs};

/// Canaries by node id alone (`--canary-trust-node-ids`): the tests of the
/// rounds themselves, in plaintext.
const BY_NODE_ID: &[&str] = &["--canary", "canary-*", "--canary-trust-node-ids"];

/// A state-of-the-world request as node `node`.
pub(crate) fn request_as(
    node: &str,
    type_url: &str,
    version: &str,
    nonce: &str,
    nack: Option<&str>,
) -> MeshConfigRequest {
    MeshConfigRequest {
        version_info: version.into(),
        sink_node: Some(SinkNode {
            id: node.into(),
            annotations: HashMap::new(),
        }),
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        error_detail: nack.map(|message| tonic_types::Status {
            code: tonic::Code::InvalidArgument as i32,
            message: message.into(),
            details: vec![],
        }),
    }
}

/// A state-of-the-world client of node `node`, subscribed to VS.
async fn client_as(gw: &mcp_xds_gateway::app::Bound, node: &str) -> SotwClient {
    let client = sotw(gw.listen).await;
    client.send(request_as(node, VS, "", "", None));
    client
}

/// Receives VS's next response as node `node` and ACKs it; its version.
async fn recv_ack(client: &mut SotwClient, node: &str) -> String {
    let response = client.recv_type(VS).await;
    client.send(request_as(node, VS, &response.version_info, &response.nonce, None));
    response.version_info
}

fn names_of(response: &MeshConfigResponse) -> BTreeMap<String, String> {
    response
        .resources
        .iter()
        .map(|r| {
            let m = r.metadata.as_ref().unwrap();
            (m.name.clone(), m.version.clone())
        })
        .collect()
}

async fn rollout_of(gw: &mcp_xds_gateway::app::Bound) -> Value {
    get_json(gw.admin, &format!("/debug/rollout/{VS}")).await
}

/// Waits for the collection's rollout state to be `state`.
async fn state_is(gw: &mcp_xds_gateway::app::Bound, state: &str) -> Value {
    eventually_some(&format!("the rollout to be {state}"), || async {
        Some(rollout_of(gw).await).filter(|view| view["state"] == state)
    })
    .await
}

/// The value of a metric series with `collection="VS"`.
async fn gauge(gw: &mcp_xds_gateway::app::Bound, name: &str) -> Option<f64> {
    let (_, text) = http_get(gw.admin, "/metrics").await;
    sample(&text, name, &[&format!("collection=\"{VS}\"")])
}

/// Waits until `n` canaries of VS are connected; its rollout then.
async fn canaries_counted(gw: &mcp_xds_gateway::app::Bound, n: u64) -> Value {
    eventually_some(&format!("{n} canaries to be counted"), || async {
        Some(rollout_of(gw).await).filter(|view| view["canaries_connected"] == n)
    })
    .await
}

/// `rollout status VS`, as text.
async fn rollout_status(gw: &mcp_xds_gateway::app::Bound) -> String {
    use mcp_xds_gateway::tools::rollout::{run, Action, RolloutArgs};
    let action = Action::Status {
        collection: Some(VS.into()),
        output: mcp_xds_gateway::tools::status::StatusOutput::Table,
    };
    let admin = format!("http://{}", gw.admin);
    let mut out = Vec::new();
    within("rollout status", run(RolloutArgs { admin, action }, &mut out))
        .await
        .unwrap();
    String::from_utf8(out).unwrap()
}

/// Waits until a client's NACK of VS with `message` has been read.
async fn nack_read(gw: &mcp_xds_gateway::app::Bound, message: &str) {
    crate::helpers::eventually(&format!("the NACK {message:?} to be read"), || {
        gw.registry.streams().iter().any(|s| {
            s.types
                .get(VS)
                .and_then(|t| t.last_nack.as_ref())
                .is_some_and(|n| n.message == message)
        })
    })
    .await;
}

/// VS's rollout, which must be `state` with everyone served `everyone` and
/// nothing held.
async fn nothing_held(gw: &mcp_xds_gateway::app::Bound, state: &str, everyone: &str) -> Value {
    let view = rollout_of(gw).await;
    assert_eq!(view["state"], state, "{view}");
    assert_eq!(view["everyone"], everyone, "{view}");
    assert!(view["held"].is_null(), "{view}");
    view
}

/// A first version pushed and served to a canary (`canary-1`) and another
/// client (`prod-1`), both ACKed, the canary counted: (v1, canary, other).
async fn first_version_to_both(
    gw: &mcp_xds_gateway::app::Bound,
    upstream: &mut crate::helpers::galley::GalleyStream,
) -> (String, SotwClient, SotwClient) {
    let v1 = push(upstream, gw, vec![vs("a", "1", "a.local", 1.0)]).await;
    let mut canary = client_as(gw, "canary-1").await;
    let mut other = client_as(gw, "prod-1").await;
    assert_eq!(recv_ack(&mut canary, "canary-1").await, v1);
    assert_eq!(recv_ack(&mut other, "prod-1").await, v1);
    canaries_counted(gw, 1).await;
    (v1, canary, other)
}

/// [`first_version_to_both`], then a second version that the canary NACKs
/// and that is held: (v1, v2, canary, other).
async fn second_version_held(
    gw: &mcp_xds_gateway::app::Bound,
    upstream: &mut crate::helpers::galley::GalleyStream,
) -> (String, String, SotwClient, SotwClient) {
    let (v1, mut canary, other) = first_version_to_both(gw, upstream).await;
    let v2 = push(upstream, gw, vec![vs("a", "2", "a.local", 0.5)]).await;
    let offered = canary.recv_type(VS).await;
    assert_eq!(offered.version_info, v2);
    canary.send(request_as(
        "canary-1",
        VS,
        &v1,
        &offered.nonce,
        Some("weights must add up"),
    ));
    state_is(gw, "HELD").await;
    (v1, v2, canary, other)
}

/// A NACK from the canary holds a version while the others stay on the one
/// before; a newer version starts a new round, which the canary's ACK
/// releases to everyone (the incremental client gets the diff from where
/// it was); a held version is sent anyway by a promotion.
#[tokio::test]
async fn a_canary_nack_holds_a_version_a_newer_one_supersedes_it_and_promote_sends_it() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], BY_NODE_ID).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;

    // The first version goes to everyone.
    let mut canary = client_as(&gw, "canary-1").await;
    let mut other = client_as(&gw, "prod-1").await;
    let mut inc: IncrementalClient = incremental(gw.listen).await;
    inc.start(VS, &[]);
    assert_eq!(recv_ack(&mut canary, "canary-1").await, v1);
    assert_eq!(recv_ack(&mut other, "prod-1").await, v1);
    let first: IncrementalMeshConfigResponse = inc.recv().await;
    assert_eq!(first.system_version_info, v1);
    inc.reply(VS, &first.nonce, None);
    canaries_counted(&gw, 1).await;

    // v2 goes to the canary only; its NACK holds it.
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "bad.local", 1.0)]).await;
    let response = canary.recv_type(VS).await;
    assert_eq!(response.version_info, v2);
    assert_eq!(state_is(&gw, "CANARY").await["everyone"], *v1);
    // A client that connects during the round gets its group's version.
    let mut late = client_as(&gw, "prod-2").await;
    assert_eq!(recv_ack(&mut late, "prod-2").await, v1, "a non-canary joins on v1");
    canary.send(request_as(
        "canary-1",
        VS,
        &v1,
        &response.nonce,
        Some("host bad.local: no such service"),
    ));
    let held = state_is(&gw, "HELD").await;
    assert_eq!(held["held"]["version"], *v2, "{held}");
    assert_eq!(held["held"]["node"], "canary-1");
    assert_eq!(held["held"]["message"], "host bad.local: no such service");
    assert_eq!(held["everyone"], *v1);
    assert_eq!(gauge(&gw, "mcp_gateway_held").await, Some(1.0));
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    assert_eq!(syncz["rollout"]["collections"][0]["state"], "HELD", "{syncz}");
    let status = mcp_xds_gateway::tools::status::render(&syncz);
    assert!(
        status.contains("HELD istio/networking/v1alpha3/virtualservices") && status.contains("canary-1"),
        "{status}"
    );
    assert!(
        status.contains("host bad.local: no such service"),
        "the NACK's message: {status}"
    );

    // The fix, v3: a new round; the canary's ACK releases it to everyone.
    let v3 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "3", "a.local", 1.0), vs("b", "1", "b.local", 1.0)],
    )
    .await;
    assert_eq!(recv_ack(&mut canary, "canary-1").await, v3);
    // The others' next response is v3: they were never sent v2.
    let released = other.recv_type(VS).await;
    assert_eq!(released.version_info, v3);
    assert_eq!(
        names_of(&released),
        BTreeMap::from([("a".into(), "3".into()), ("b".into(), "1".into())])
    );
    other.send(request_as("prod-1", VS, &v3, &released.nonce, None));
    let diff: IncrementalMeshConfigResponse = inc.recv().await;
    assert_eq!(diff.system_version_info, v3);
    let mut upserted: Vec<&str> = diff
        .resources
        .iter()
        .map(|r| r.metadata.as_ref().unwrap().name.as_str())
        .collect();
    upserted.sort();
    assert_eq!(upserted, ["a", "b"]);
    inc.reply(VS, &diff.nonce, None);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v3);
    assert_eq!(gauge(&gw, "mcp_gateway_held").await, Some(0.0));

    // v4 is NACKed, then promoted: everyone gets it anyway.
    let v4 = push(&mut upstream, &gw, vec![vs("a", "3", "a.local", 1.0)]).await;
    let response = canary.recv_type(VS).await;
    canary.send(request_as("canary-1", VS, &v3, &response.nonce, Some("still wrong")));
    state_is(&gw, "HELD").await;
    // Promoted with the rollout command.
    let promote = mcp_xds_gateway::tools::rollout::RolloutArgs {
        admin: format!("http://{}", gw.admin),
        action: mcp_xds_gateway::tools::rollout::Action::Promote { collection: VS.into() },
    };
    let mut out = Vec::new();
    within(
        "rollout promote",
        mcp_xds_gateway::tools::rollout::run(promote, &mut out),
    )
    .await
    .unwrap();
    let said = String::from_utf8(out).unwrap();
    assert!(said.contains(&v4[..12]), "{said}");
    let promoted = other.recv_type(VS).await;
    assert_eq!(promoted.version_info, v4);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v4);
    assert_eq!(
        gauge(&gw, "mcp_gateway_held").await,
        Some(0.0),
        "promoted, no longer held"
    );
    let (code, body) = http_request(gw.admin, "POST", &format!("/promote/{VS}"), "").await;
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("nothing waits"), "{body}");
}

/// A pin serves every client a version of the history: state-of-the-world
/// clients its full set, incremental ones the diff back; upstream versions
/// meanwhile are applied but not served; the unpin serves the latest with
/// the diff forward. Errors name what is wrong.
#[tokio::test]
async fn a_pin_rolls_every_client_back_and_the_unpin_forward() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    let v1 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "1", "a.local", 1.0), vs("c", "1", "c.local", 1.0)],
    )
    .await;
    let v2 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "2", "a2.local", 1.0), vs("b", "1", "b.local", 1.0)],
    )
    .await;
    let mut full = client_as(&gw, "pilot-a").await;
    assert_eq!(recv_ack(&mut full, "pilot-a").await, v2);
    let mut inc = incremental(gw.listen).await;
    inc.start(VS, &[]);
    let first = inc.recv().await;
    assert_eq!(first.system_version_info, v2);
    inc.reply(VS, &first.nonce, None);

    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={v1}"), "").await;
    assert_eq!(code, 200, "{body}");
    let back = full.recv_type(VS).await;
    assert_eq!(back.version_info, v1);
    assert_eq!(
        names_of(&back),
        BTreeMap::from([("a".into(), "1".into()), ("c".into(), "1".into())])
    );
    full.send(request_as("pilot-a", VS, &v1, &back.nonce, None));
    let diff = inc.recv().await;
    assert_eq!(diff.system_version_info, v1);
    let upserted: Vec<(&str, &str)> = diff
        .resources
        .iter()
        .map(|r| {
            let m = r.metadata.as_ref().unwrap();
            (m.name.as_str(), m.version.as_str())
        })
        .collect();
    assert_eq!(upserted, [("a", "1"), ("c", "1")]);
    assert_eq!(diff.removed_resources, ["b"]);
    inc.reply(VS, &diff.nonce, None);
    let pinned = state_is(&gw, "PINNED").await;
    assert_eq!(pinned["pinned"], *v1);
    assert_eq!(gauge(&gw, "mcp_gateway_pinned").await, Some(1.0));
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    assert_eq!(syncz["rollout"]["collections"][0]["state"], "PINNED", "{syncz}");
    let status = mcp_xds_gateway::tools::status::render(&syncz);
    assert!(
        status.contains(&format!("PINNED {VS}: every client is served {}", &v1[..12])),
        "{status}"
    );
    let (code, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(code, 200, "a pin leaves readiness alone: {body}");

    // Upstream moves on: applied, not served.
    let v3 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "2", "a2.local", 1.0), vs("d", "1", "d.local", 1.0)],
    )
    .await;
    let pinned = rollout_of(&gw).await;
    assert_eq!(
        (pinned["latest"].as_str(), pinned["everyone"].as_str()),
        (Some(&*v3), Some(&*v1))
    );
    // The rollout has taken v3 in (above) and served it to no one.
    let clients = get_json(gw.admin, "/debug/clients").await;
    let sent: Vec<&Value> = clients
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["types"].as_object().unwrap().values())
        .map(|t| &t["last_sent_version"])
        .collect();
    assert_eq!(sent.len(), 2, "{clients}");
    assert!(
        sent.iter().all(|v| **v == *v1),
        "every client was last sent v1: {clients}"
    );

    // Errors: an unknown version, an unknown collection, no version.
    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version=nope0000"), "").await;
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("\"nope0000\"") && body.contains("--history"), "{body}");
    // Under eight characters: too short to name a version, whatever it begins.
    for given in ["abc", &v1[..6]] {
        let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={given}"), "").await;
        assert_eq!(code, 400, "{given}: {body}");
        assert!(body.contains("too short"), "{body}");
    }
    let (code, body) = http_request(gw.admin, "POST", "/pin/no/such/collection?version=x", "").await;
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("no/such/collection"), "{body}");
    let (code, _) = http_request(gw.admin, "POST", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 400);

    let (code, body) = http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    let forward = full.recv_type(VS).await;
    assert_eq!(forward.version_info, v3);
    let diff = inc.recv().await;
    assert_eq!(diff.system_version_info, v3);
    let upserted: Vec<&str> = diff
        .resources
        .iter()
        .map(|r| r.metadata.as_ref().unwrap().name.as_str())
        .collect();
    assert_eq!(upserted, ["a", "d"]);
    assert_eq!(diff.removed_resources, ["c"]);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v3);
    assert_eq!(gauge(&gw, "mcp_gateway_pinned").await, Some(0.0));
    let (code, body) = http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 409, "{body}");
}

/// With no canary connected, `proceed` releases a new version at once (and
/// says so), `hold` waits until a canary connects and ACKs it.
#[tokio::test]
async fn with_no_canary_connected_proceed_releases_and_hold_waits() {
    for policy in ["proceed", "hold"] {
        let (_galley, gw, mut upstream) = galley_and_gateway(
            &[VS],
            &[
                "--canary",
                "track=canary",
                "--canary-trust-node-ids",
                "--canary-when-none",
                policy,
            ],
        )
        .await;
        push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;
        let mut other = client_as(&gw, "prod-1").await;
        recv_ack(&mut other, "prod-1").await;
        let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
        if policy == "proceed" {
            assert_eq!(recv_ack(&mut other, "prod-1").await, v2);
            let view = state_is(&gw, "SERVING").await;
            assert!(view["warning"].as_str().unwrap().contains("without a canary"), "{view}");
            continue;
        }
        let view = state_is(&gw, "WAITING").await;
        assert!(
            view["warning"].as_str().unwrap().contains("--canary-when-none=hold"),
            "{view}"
        );
        let status = mcp_xds_gateway::tools::status::render(&get_json(gw.admin, "/debug/syncz").await);
        assert!(status.contains(&format!("WARNING {VS}: ")), "{status}");
        // A canary by annotation connects, gets v2, ACKs: released.
        let mut canary = sotw(gw.listen).await;
        canary.send(MeshConfigRequest {
            sink_node: Some(SinkNode {
                id: "pilot-7".into(),
                annotations: HashMap::from([("track".to_owned(), "canary".to_owned())]),
            }),
            ..request_as("", VS, "", "", None)
        });
        let response = canary.recv_type(VS).await;
        assert_eq!(response.version_info, v2);
        canary.send(MeshConfigRequest {
            sink_node: Some(SinkNode {
                id: "pilot-7".into(),
                annotations: HashMap::new(),
            }),
            ..request_as("", VS, &v2, &response.nonce, None)
        });
        assert_eq!(recv_ack(&mut other, "prod-1").await, v2);
    }
}

/// A pin, and what is held, survive a restart with `--cache-dir`.
#[tokio::test]
async fn pins_survive_a_restart_with_cache_dir() {
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().to_str().unwrap().to_owned();
    let (galley, gw, mut upstream) =
        galley_and_gateway(&[VS], &[&["--cache-dir", &cache_dir][..], BY_NODE_ID].concat()).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;
    let mut canary = client_as(&gw, "canary-1").await;
    assert_eq!(recv_ack(&mut canary, "canary-1").await, v1);
    canaries_counted(&gw, 1).await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    let response = canary.recv_type(VS).await;
    canary.send(request_as("canary-1", VS, &v1, &response.nonce, Some("bad weight")));
    state_is(&gw, "HELD").await;
    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={v1}"), "").await;
    assert_eq!(code, 200, "{body}");
    let saved = dir.path().join("rollout.json");
    crate::helpers::eventually("the pin to be saved", || {
        std::fs::read_to_string(&saved).is_ok_and(|text| text.contains(&*v1))
    })
    .await;
    let url = galley.url();
    drop(upstream);
    within("the Galley to stop", galley.stop()).await;
    assert!(within("the gateway to stop", gw.shutdown()).await);

    let flags = ["--upstream", &url, "--collections", VS, "--cache-dir", &cache_dir];
    let restarted = start_gateway(&[&flags[..], BY_NODE_ID].concat()).await;
    let pinned = state_is(&restarted, "PINNED").await;
    assert_eq!(pinned["everyone"], *v1, "{pinned}");
    assert_eq!(pinned["held"]["version"], *v2, "the hold is kept too: {pinned}");
    assert_eq!(pinned["held"]["message"], "bad weight", "{pinned}");
    let mut client = client_as(&restarted, "pilot-b").await;
    assert_eq!(recv_ack(&mut client, "pilot-b").await, v1);
    assert!(within("the restarted gateway to stop", restarted.shutdown()).await);
}

/// `mcp-xds-gateway rollout` over the admin port: history, diff, pin,
/// status, unpin and promote, as text; a gateway's refusal is an error
/// that says why.
#[tokio::test]
async fn the_rollout_command_reads_and_drives_the_admin_port() {
    use mcp_xds_gateway::tools::rollout::{run, Action, RolloutArgs};
    use mcp_xds_gateway::tools::status::StatusOutput;
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], &[]).await;
    let v1 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "1", "a.local", 1.0), vs("b", "1", "b.local", 1.0)],
    )
    .await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 2.0)]).await;
    let admin = format!("http://{}", gw.admin);
    let rollout = |action: Action| {
        let admin = admin.clone();
        async move {
            let mut out = Vec::new();
            let result = within("the rollout command", run(RolloutArgs { admin, action }, &mut out)).await;
            result.map(|_code| String::from_utf8(out).unwrap())
        }
    };
    let history = rollout(Action::History { collection: VS.into() }).await.unwrap();
    let lines: Vec<&str> = history.lines().collect();
    assert!(lines[0].starts_with("VERSION"), "{history}");
    assert!(
        lines[1].starts_with(&format!("*{} ", &v2[..12])) && lines[2].starts_with(&format!(" {} ", &v1[..12])),
        "{history}"
    );
    // --from defaults to the version before the latest.
    let diff = rollout(Action::Diff {
        collection: VS.into(),
        from: None,
        to: None,
        bodies: true,
    })
    .await
    .unwrap();
    assert!(
        diff.starts_with(&format!("{VS} {} -> {}\n", &v1[..12], &v2[..12])),
        "{diff}"
    );
    assert!(
        diff.contains("- b\n") && diff.contains("~ a\n") && diff.contains("+  weight: 2.0"),
        "{diff}"
    );

    let pinned = rollout(Action::Pin {
        collection: VS.into(),
        version: v1.clone(),
    })
    .await
    .unwrap();
    assert!(
        pinned.starts_with(&format!("PINNED {VS}: every client is served {}", &v1[..12])),
        "{pinned}"
    );
    let status = rollout(Action::Status {
        collection: None,
        output: StatusOutput::Table,
    })
    .await
    .unwrap();
    assert!(
        status.contains("no --canary selectors") && status.contains(&format!("PINNED {VS}")),
        "{status}"
    );
    let one = rollout(Action::Status {
        collection: Some(VS.into()),
        output: StatusOutput::Table,
    })
    .await
    .unwrap();
    assert!(one.starts_with(&format!("PINNED {VS}")), "{one}");
    let refused = rollout(Action::Promote { collection: VS.into() }).await.unwrap_err();
    assert!(
        format!("{refused:#}").contains("409") && format!("{refused:#}").contains("unpin it first"),
        "{refused:#}"
    );
    let unpinned = rollout(Action::Unpin { collection: VS.into() }).await.unwrap();
    assert!(
        unpinned.starts_with(&format!("SERVING {VS}: every client is served {}", &v2[..12])),
        "{unpinned}"
    );
    let unknown = rollout(Action::Pin {
        collection: VS.into(),
        version: "gone0000".into(),
    })
    .await
    .unwrap_err();
    assert!(
        format!("{unknown:#}").contains("404") && format!("{unknown:#}").contains("\"gone0000\""),
        "{unknown:#}"
    );
}

/// Every protocol follows the same gating: an istiod on xDS v3, chosen by a
/// metadata selector, is the canary; its NACK holds a version from a Pilot
/// on `ResourceSource` (incremental) and a legacy client, whose next
/// update is the fixed version the canary ACKed, as the diff from what the
/// Pilot holds.
#[tokio::test]
async fn an_xds_canary_gates_resource_source_and_legacy_clients() {
    use mcp_xds_gateway::proto::envoy::config::core::v3::Node;
    use mcp_xds_gateway::proto::envoy::service::discovery::v3::DiscoveryRequest;

    use crate::helpers::clients::PilotSink;
    use crate::xds::{mcp_resources, SotwStream, SOTW, VS_V1ALPHA3};

    const ISTIOD: &str = "istiod-canary-0.istio-system";
    let node = || {
        let role = prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue("canary".into())),
        };
        Some(Node {
            id: ISTIOD.into(),
            metadata: Some(prost_types::Struct {
                fields: [("ROLE".to_owned(), role)].into(),
            }),
            ..Default::default()
        })
    };
    let (_galley, gw, mut upstream) =
        galley_and_gateway(&[VS], &["--canary", "ROLE=canary", "--canary-trust-node-ids"]).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;

    let mut istiod = SotwStream::open(gw.listen, SOTW).await;
    istiod.send(DiscoveryRequest {
        type_url: VS_V1ALPHA3.into(),
        node: node(),
        ..Default::default()
    });
    let reply = |istiod: &SotwStream, version: &str, nonce: &str, nack: Option<&str>| {
        istiod.send(DiscoveryRequest {
            type_url: VS_V1ALPHA3.into(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            node: node(),
            error_detail: nack.map(|message| tonic_types::Status {
                code: tonic::Code::InvalidArgument as i32,
                message: message.into(),
                details: vec![],
            }),
            ..Default::default()
        })
    };
    let first = istiod.recv().await;
    assert_eq!(first.version_info, v1);
    reply(&istiod, &v1, &first.nonce, None);
    let mut pilot = PilotSink::connect(gw.listen, &[VS], true).await;
    assert_eq!(pilot.recv_and_ack().await.system_version_info, v1);
    let mut legacy = client_as(&gw, "prod-1").await;
    assert_eq!(recv_ack(&mut legacy, "prod-1").await, v1);
    eventually_async("the istiod to be counted a canary", || async {
        rollout_of(&gw).await["canaries_connected"] == 1
    })
    .await;

    // v2 goes to istiod only, and its NACK holds it.
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "bad.local", 1.0)]).await;
    let offered = istiod.recv().await;
    assert_eq!(offered.version_info, v2);
    let offered_bodies = mcp_resources(&offered);
    let body = &offered_bodies[0].body.as_ref().unwrap().value;
    assert!(body.windows(9).any(|w| w == b"bad.local"), "v2's body goes to istiod");
    reply(
        &istiod,
        &v1,
        &offered.nonce,
        Some("virtualservice a: host bad.local not found"),
    );
    let held = state_is(&gw, "HELD").await;
    assert_eq!(held["held"]["version"], *v2, "{held}");
    assert_eq!(held["held"]["node"], ISTIOD, "{held}");
    assert_eq!(held["everyone"], *v1, "{held}");

    // The fix: istiod ACKs it, and the others' next update is that version.
    let v3 = push(
        &mut upstream,
        &gw,
        vec![vs("a", "3", "a.local", 1.0), vs("b", "1", "b.local", 1.0)],
    )
    .await;
    let fixed = istiod.recv().await;
    assert_eq!(fixed.version_info, v3);
    reply(&istiod, &v3, &fixed.nonce, None);
    let update = pilot.recv_and_ack().await;
    assert_eq!(update.system_version_info, v3, "the Pilot never saw v2");
    assert!(update.incremental, "a diff from v1, what the Pilot holds");
    assert_eq!(pilot.names(VS), ["a", "b"]);
    assert_eq!(pilot.held[VS]["a"], "3");
    assert_eq!(
        recv_ack(&mut legacy, "prod-1").await,
        v3,
        "the legacy client never saw v2"
    );
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v3);
}

/// Pinning to a version a canary NACKed is the operator's choice and is
/// served; the version stays held; the unpin starts a canary round from the
/// pinned version to the latest, which the canary's ACK releases.
#[tokio::test]
async fn a_pin_to_a_held_version_is_served_and_the_unpin_starts_a_round() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], BY_NODE_ID).await;
    let (_, v2, mut canary, mut other) = second_version_held(&gw, &mut upstream).await;

    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={v2}"), "").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        recv_ack(&mut other, "prod-1").await,
        v2,
        "the pinned version, NACKed or not"
    );
    let pinned = state_is(&gw, "PINNED").await;
    assert_eq!(pinned["held"]["version"], *v2, "still held: {pinned}");

    let v3 = push(&mut upstream, &gw, vec![vs("a", "3", "a.local", 1.0)]).await;
    let (code, body) = http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    // A round: the canary first, the others stay on the pinned version.
    let offered = canary.recv_type(VS).await;
    assert_eq!(offered.version_info, v3);
    let round = eventually_some("the round of v3", || async {
        Some(rollout_of(&gw).await).filter(|view| view["round"]["version"] == *v3)
    })
    .await;
    assert_eq!(round["everyone"], *v2, "{round}");
    // A version held before the pin stays held (and the state says so).
    assert_eq!(round["held"]["version"], *v2, "{round}");
    assert_eq!(round["state"], "HELD", "{round}");
    canary.send(request_as("canary-1", VS, &v3, &offered.nonce, None));
    assert_eq!(recv_ack(&mut other, "prod-1").await, v3);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v3);
    assert_eq!(
        gauge(&gw, "mcp_gateway_held").await,
        Some(0.0),
        "a newer version released"
    );
}

/// With `--canary-soak`, the canaries' ACKs start the soak; the version
/// goes to everyone when it has passed, never before. The soak is long
/// (10 s) so that the view is read while it runs even on a loaded machine.
#[tokio::test]
async fn a_version_the_canaries_acked_goes_to_everyone_after_the_soak() {
    const SOAK: std::time::Duration = std::time::Duration::from_secs(10);
    let (_galley, gw, mut upstream) =
        galley_and_gateway(&[VS], &[BY_NODE_ID, &["--canary-soak", "10s"]].concat()).await;
    let (v1, mut canary, mut other) = first_version_to_both(&gw, &mut upstream).await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    // Taken before the canary's ACK is sent: the soak starts when the
    // gateway reads it, so no earlier than this.
    let before_the_ack = tokio::time::Instant::now();
    assert_eq!(recv_ack(&mut canary, "canary-1").await, v2);
    let soaking = eventually_some("the soak to start", || async {
        let view = rollout_of(&gw).await;
        view["round"]["release_in_seconds"].as_f64().map(|s| (s, view))
    })
    .await;
    assert!(soaking.0 > 0.0 && soaking.0 <= SOAK.as_secs_f64(), "{}", soaking.1);
    assert_eq!(soaking.1["state"], "CANARY", "{}", soaking.1);
    assert_eq!(soaking.1["everyone"], *v1, "{}", soaking.1);
    assert_eq!(
        recv_ack(&mut other, "prod-1").await,
        v2,
        "released once the soak passed"
    );
    // Late is allowed (a loaded machine), early never.
    let released = before_the_ack.elapsed();
    assert!(released >= SOAK, "released {released:?} after the ACK: before the soak");
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v2);
}

/// A canary that comes back during a round already holding the round's
/// version (its connection broke after it applied it) is not sent it
/// again, and that counts as its ACK: the round does not wait forever.
#[tokio::test]
async fn a_canary_that_reconnects_holding_the_rounds_version_counts_as_acked() {
    let (_galley, gw, mut upstream) =
        galley_and_gateway(&[VS], &[BY_NODE_ID, &["--canary-when-none", "hold"]].concat()).await;
    let (v1, mut canary, mut other) = first_version_to_both(&gw, &mut upstream).await;
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    assert_eq!(canary.recv_type(VS).await.version_info, v2);
    // The connection breaks before the ACK; no canary is connected, and
    // `hold` waits.
    drop(canary);
    eventually_async("the canary to be gone", || async {
        rollout_of(&gw).await["canaries_connected"] == 0
    })
    .await;
    let waiting = rollout_of(&gw).await;
    assert_eq!(waiting["everyone"], *v1, "{waiting}");
    // It comes back saying it holds v2.
    let back = sotw(gw.listen).await;
    back.send(request_as("canary-1", VS, &v2, "", None));
    assert_eq!(recv_ack(&mut other, "prod-1").await, v2);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v2);
}

/// A version the operator promoted stays promoted: a pin to an older
/// version, then the unpin, return everyone to the promoted version at once,
/// without a new canary round for it (the canary that NACKed it is not asked
/// again, and its NACK of it holds nothing).
#[tokio::test]
async fn a_promoted_version_stays_promoted_through_a_pin_and_the_unpin() {
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS], BY_NODE_ID).await;
    let (v1, v2, canary, mut other) = second_version_held(&gw, &mut upstream).await;
    let (code, body) = http_request(gw.admin, "POST", &format!("/promote/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(recv_ack(&mut other, "prod-1").await, v2, "promoted");
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v2);

    // Rolled back by a pin. (The canary stays connected throughout: what
    // it is re-sent after its NACK is the streams' rule, not the gate's.)
    let (code, body) = http_request(gw.admin, "POST", &format!("/pin/{VS}?version={v1}"), "").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(recv_ack(&mut other, "prod-1").await, v1);

    // Unpinned: back to the promoted v2 for everyone, no round.
    let (code, body) = http_request(gw.admin, "DELETE", &format!("/pin/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    let unpinned: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(unpinned["state"], "SERVING", "{unpinned}");
    assert_eq!(unpinned["everyone"], *v2, "{unpinned}");
    assert!(unpinned["round"].is_null(), "no new round: {unpinned}");
    assert_eq!(recv_ack(&mut other, "prod-1").await, v2, "the others are back on v2");
    // Another canary is served v2 and NACKs it: it was promoted, nothing is
    // held.
    let mut second = client_as(&gw, "canary-2").await;
    let again = second.recv_type(VS).await;
    assert_eq!(again.version_info, v2);
    second.send(request_as("canary-2", VS, "", &again.nonce, Some("weights still")));
    nack_read(&gw, "weights still").await;
    nothing_held(&gw, "SERVING", &v2).await;
    assert_eq!(gauge(&gw, "mcp_gateway_held").await, Some(0.0));
    drop(canary);
}

// === Canaries by proven identity ===

/// Pilots of istio-system read the Istio collections; those whose SPIFFE id
/// is `canary-*` may be canaries of the networking ones; the tenant reads
/// them too, and may not be a canary.
const CANARY_POLICY: &str = r#"
rules:
- identities: ["spiffe://cluster.local/ns/istio-system/sa/*", "spiffe://cluster.local/ns/tenant/sa/*"]
  collections: ["istio/*"]
- identities: ["spiffe://cluster.local/ns/istio-system/sa/canary-*"]
  collections: ["istio/networking/*"]
  canary: true
"#;
const CANARY_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/canary-pilot";
const PILOT_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/pilot";
const TENANT_ID: &str = "spiffe://cluster.local/ns/tenant/sa/reader";

/// What [`proven_gateway`] makes: its files, its CA, the Galley, the
/// gateway, the Galley's stream.
type Proven = (
    tempfile::TempDir,
    Ca,
    crate::helpers::galley::FakeGalley,
    mcp_xds_gateway::app::Bound,
    crate::helpers::galley::GalleyStream,
);

/// A gateway fed by a fake Galley over mTLS, with [`CANARY_POLICY`] and
/// `--canary 'canary-*'` (and `extra`): (its files, its CA, the Galley,
/// the gateway, the Galley's stream).
async fn proven_gateway(extra: &[&str]) -> Proven {
    proven_gateway_with(CANARY_POLICY, extra).await
}

/// [`proven_gateway`] with another policy.
async fn proven_gateway_with(policy: &str, extra: &[&str]) -> Proven {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("canary test CA");
    let (cert, key) = write_leaf(dir.path(), "gateway", &ca.leaf("gateway"));
    let files = [
        cert,
        key,
        write(dir.path(), "ca.pem", &ca.pem),
        write(dir.path(), "policy.yaml", policy),
    ]
    .map(|p| p.to_str().unwrap().to_owned());
    let mut flags = vec![
        "--tls-cert",
        &files[0],
        "--tls-key",
        &files[1],
        "--client-ca",
        &files[2],
        "--access-policy",
        &files[3],
        "--canary",
        "canary-*",
    ];
    flags.extend(extra);
    let (galley, gw, upstream) = galley_and_gateway(&[VS], &flags).await;
    (dir, ca, galley, gw, upstream)
}

/// A state-of-the-world client over mTLS with a certificate for `identity`,
/// as node `node`, subscribed to VS holding `version` ("" for nothing).
async fn proven_client(
    gw: &mcp_xds_gateway::app::Bound,
    ca: &Ca,
    identity: &str,
    node: &str,
    version: &str,
) -> SotwClient {
    let channel = tls_channel(gw.listen, &ca.pem, Some(&ca.spiffe_leaf(identity)))
        .await
        .unwrap();
    let client = SotwClient::open_on(channel, SOTW_PATH).await;
    client.send(request_as(node, VS, version, "", None));
    client
}

/// The clients of VS's rollout view under `key` (`canary_clients` or
/// `not_canaries`), by node.
fn listed<'v>(view: &'v Value, key: &str) -> Vec<&'v str> {
    view[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {view}"))
        .iter()
        .map(|c| c["node"].as_str().unwrap())
        .collect()
}

/// The walkthrough of docs/operating.md ("a bad VirtualService held by a
/// canary"), with the canary Pilot proven by its certificate: the bad
/// version goes to it only, its NACK holds it, the fix goes to everyone
/// once it ACKs, and the views and `rollout status` say which client is the
/// canary and which rule made it one.
#[tokio::test]
async fn walkthrough_a_bad_virtualservice_is_held_by_a_proven_canary() {
    let (_dir, ca, _galley, gw, mut upstream) = proven_gateway(&[]).await;
    let v1 = push(&mut upstream, &gw, vec![vs("reviews", "1", "reviews.local", 1.0)]).await;
    let mut canary = proven_client(&gw, &ca, CANARY_ID, "canary-pilot-0", "").await;
    let mut pilot = proven_client(&gw, &ca, PILOT_ID, "pilot-1", "").await;
    assert_eq!(recv_ack(&mut canary, "canary-pilot-0").await, v1);
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v1);
    let view = canaries_counted(&gw, 1).await;
    assert_eq!(listed(&view, "canary_clients"), ["canary-pilot-0"], "{view}");
    let why = view["canary_clients"][0]["why"].as_str().unwrap();
    assert!(
        why.starts_with(&format!("uri:{CANARY_ID}, dns:localhost matches rules[1]")),
        "{why}"
    );
    assert_eq!(
        view["canary_clients"][0]["identity"],
        format!("uri:{CANARY_ID}, dns:localhost"),
        "{view}"
    );
    assert_eq!(view["canary_clients"][0]["selector"], "canary-*", "{view}");
    assert!(listed(&view, "not_canaries").is_empty(), "{view}");

    // The typo: to the canary only, whose NACK holds it.
    let v2 = push(&mut upstream, &gw, vec![vs("reviews", "2", "reviews.loca", 1.0)]).await;
    let offered = canary.recv_type(VS).await;
    assert_eq!(offered.version_info, v2);
    canary.send(request_as(
        "canary-pilot-0",
        VS,
        &v1,
        &offered.nonce,
        Some("route reviews: destination host \"reviews.loca\" not found"),
    ));
    let held = state_is(&gw, "HELD").await;
    assert_eq!(held["held"]["node"], "canary-pilot-0", "{held}");
    assert_eq!(
        held["held"]["identity"],
        format!("uri:{CANARY_ID}, dns:localhost"),
        "who held it, kept once it leaves: {held}"
    );
    assert_eq!(held["everyone"], *v1, "{held}");
    let status = mcp_xds_gateway::tools::status::render(&get_json(gw.admin, "/debug/syncz").await);
    assert!(
        status.contains("canary-pilot-0 (canary)") && status.contains(&format!("HELD {VS}")),
        "{status}"
    );

    // The fix: a new round, the canary's ACK releases it; the Pilot's next
    // version is the fix, it never saw the typo.
    let v3 = push(&mut upstream, &gw, vec![vs("reviews", "3", "reviews.local", 1.0)]).await;
    assert_eq!(recv_ack(&mut canary, "canary-pilot-0").await, v3);
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v3, "the Pilot never saw v2");
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v3);
    let said = rollout_status(&gw).await;
    assert!(
        said.contains(&format!("SERVING {VS}: every client is served {}", &v3[..12])),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "CANARY CLIENT canary-pilot-0 (uri:{CANARY_ID}, dns:localhost; --canary canary-*) of {VS}: uri:"
        )),
        "{said}"
    );
}

/// `--canary-when-none=hold` over a collection no rule with `canary: true`
/// grants: no client can ever be its canary. Its new version still waits
/// (hold promised nothing goes out unvetted), and the views say why and
/// what to do, so a certificate rotation is not stalled unseen; a promote
/// sends it.
#[tokio::test]
async fn a_round_no_client_can_ever_decide_says_so() {
    let policy = CANARY_POLICY.replace(
        "  collections: [\"istio/networking/*\"]\n  canary: true",
        "  collections: [\"istio/networking/v1alpha3/gateways\"]\n  canary: true",
    );
    assert_ne!(policy, CANARY_POLICY);
    let (_dir, ca, _galley, gw, mut upstream) = proven_gateway_with(&policy, &["--canary-when-none", "hold"]).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;
    let mut pilot = proven_client(&gw, &ca, PILOT_ID, "pilot-1", "").await;
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v1);
    push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    let waiting = state_is(&gw, "WAITING").await;
    let warning = waiting["warning"].as_str().unwrap_or_default();
    assert!(
        warning.contains(&format!("no rule of --access-policy with canary: true grants {VS}"))
            && warning.contains(&format!("POST /promote/{VS}")),
        "{waiting}"
    );
    // `status` shows it among what needs an operator's eye.
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    assert!(syncz.to_string().contains("no client can be its canary"), "{syncz}");
    let (code, body) = crate::helpers::http_request(gw.admin, "POST", &format!("/promote/{VS}"), "").await;
    assert_eq!(code, 200, "{body}");
    state_is(&gw, "SERVING").await;
}

/// A tenant whose certificate the policy does not make a canary, connected
/// as node `canary-evil`, is an ordinary client under
/// `--canary-when-none=hold`: it is not sent a waiting version, its claim
/// to hold it (a reconnect naming the round's version) releases nothing,
/// its NACK holds nothing, and the views and a metric say it claimed in
/// vain and why. A proven canary still decides as before.
#[tokio::test]
async fn a_client_named_like_a_canary_without_the_identity_changes_no_ones_version() {
    let (_dir, ca, _galley, gw, mut upstream) = proven_gateway(&["--canary-when-none", "hold"]).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;
    let mut evil = proven_client(&gw, &ca, TENANT_ID, "canary-evil", "").await;
    let mut pilot = proven_client(&gw, &ca, PILOT_ID, "pilot-1", "").await;
    assert_eq!(recv_ack(&mut evil, "canary-evil").await, v1);
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v1);
    let view = eventually_some("the claim to be refused", || async {
        Some(rollout_of(&gw).await).filter(|view| view["not_canaries"].as_array().is_some_and(|a| !a.is_empty()))
    })
    .await;
    assert_eq!(view["canaries_connected"], 0, "{view}");
    assert_eq!(listed(&view, "not_canaries"), ["canary-evil"], "{view}");
    let why = view["not_canaries"][0]["why"].as_str().unwrap();
    assert!(
        why.contains("no rule of --access-policy with canary: true") && why.contains(TENANT_ID),
        "{why}"
    );
    let (_, page) = crate::helpers::http_get_with(gw.admin, "/debug/rollout", "Accept: text/html\r\n").await;
    assert!(
        page.contains("not_canaries") && page.contains("canary-evil") && page.contains("no rule of --access-policy"),
        "the HTML view says it too: {page}"
    );
    let syncz = get_json(gw.admin, "/debug/syncz").await;
    let status = mcp_xds_gateway::tools::status::render(&syncz);
    assert!(!status.contains("(canary)"), "nobody is shown a canary: {status}");
    let (_, metrics) = http_get(gw.admin, "/metrics").await;
    let refused = sample(
        &metrics,
        "mcp_gateway_canary_claims_refused_total",
        &[&format!("collection=\"{VS}\"")],
    );
    assert!(refused.is_some_and(|n| n >= 1.0), "{refused:?}");

    // A new version waits for a canary: the tenant is none.
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    let waiting = state_is(&gw, "WAITING").await;
    assert_eq!(waiting["everyone"], *v1, "{waiting}");
    // It comes back saying it holds the waiting version (which a canary's
    // reconnect counts as its ACK): nothing is released, and it is sent
    // what everyone is; its NACK of that holds nothing.
    drop(evil);
    let mut back = proven_client(&gw, &ca, TENANT_ID, "canary-evil", &v2).await;
    let sent = back.recv_type(VS).await;
    assert_eq!(
        sent.version_info, v1,
        "what everyone is served, not the waiting version"
    );
    back.send(request_as("canary-evil", VS, &v2, &sent.nonce, Some("evil NACK")));
    nack_read(&gw, "evil NACK").await;
    let view = nothing_held(&gw, "WAITING", &v1).await;
    assert_eq!(view["canaries_connected"], 0, "{view}");

    // The proven canary connects, is sent v2 and ACKs it: released to
    // everyone, the tenant included.
    let mut canary = proven_client(&gw, &ca, CANARY_ID, "canary-pilot-0", "").await;
    assert_eq!(recv_ack(&mut canary, "canary-pilot-0").await, v2);
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v2);
    assert_eq!(recv_ack(&mut back, "canary-evil").await, v2);
    assert_eq!(state_is(&gw, "SERVING").await["everyone"], *v2);

    // A round: the tenant gets v3 only once the canary ACKed it, and its
    // NACK of it then holds nothing.
    let v3 = push(&mut upstream, &gw, vec![vs("a", "3", "a.local", 1.0)]).await;
    let offered = canary.recv_type(VS).await;
    assert_eq!(offered.version_info, v3);
    assert_eq!(state_is(&gw, "CANARY").await["everyone"], *v2);
    canary.send(request_as("canary-pilot-0", VS, &v3, &offered.nonce, None));
    let released = back.recv_type(VS).await;
    assert_eq!(released.version_info, v3);
    back.send(request_as(
        "canary-evil",
        VS,
        &v2,
        &released.nonce,
        Some("evil NACK of v3"),
    ));
    assert_eq!(recv_ack(&mut pilot, "pilot-1").await, v3);
    nack_read(&gw, "evil NACK of v3").await;
    let view = nothing_held(&gw, "SERVING", &v3).await;
    assert_eq!(listed(&view, "canary_clients"), ["canary-pilot-0"], "{view}");
    assert_eq!(listed(&view, "not_canaries"), ["canary-evil"], "{view}");
    let said = rollout_status(&gw).await;
    assert!(
        said.contains(&format!(
            "NOT A CANARY canary-evil (uri:{TENANT_ID}, dns:localhost; --canary canary-*) of {VS}: no rule"
        )) && said.contains("CANARY CLIENT canary-pilot-0"),
        "{said}"
    );
}

/// A reload that takes the canary rule away makes a connected canary an
/// ordinary client at once: it leaves the round, follows everyone's
/// version, and the view says why.
#[tokio::test]
async fn a_reload_that_takes_the_canary_rule_away_makes_a_canary_ordinary() {
    let (dir, ca, _galley, gw, mut upstream) = proven_gateway(&["--canary-when-none", "hold"]).await;
    let v1 = push(&mut upstream, &gw, vec![vs("a", "1", "a.local", 1.0)]).await;
    let mut canary = proven_client(&gw, &ca, CANARY_ID, "canary-pilot-0", "").await;
    assert_eq!(recv_ack(&mut canary, "canary-pilot-0").await, v1);
    canaries_counted(&gw, 1).await;
    // A round the canary is in, and has not ACKed.
    let v2 = push(&mut upstream, &gw, vec![vs("a", "2", "a.local", 1.0)]).await;
    let offered = canary.recv_type(VS).await;
    assert_eq!(offered.version_info, v2);
    let without = CANARY_POLICY.replace("  canary: true\n", "");
    write(dir.path(), "policy.yaml", &without);
    let view = canaries_counted(&gw, 0).await;
    assert_eq!(listed(&view, "not_canaries"), ["canary-pilot-0"], "{view}");
    assert_eq!(view["state"], "WAITING", "{view}");
    // Its ACK of v2 now releases nothing, and it follows everyone's
    // version: v1 again.
    canary.send(request_as("canary-pilot-0", VS, &v2, &offered.nonce, None));
    assert_eq!(canary.recv_type(VS).await.version_info, v1);
    nothing_held(&gw, "WAITING", &v1).await;
    let policy = get_json(gw.admin, "/debug/rollout").await;
    assert_eq!(policy["canaries"]["access_policy_canary_rules"], 0, "{policy}");
    assert!(
        policy["canaries"]["warning"]
            .as_str()
            .unwrap()
            .contains("no client is a canary"),
        "{policy}"
    );
}
