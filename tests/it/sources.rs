//! Every way config arrives besides client mode: Galley's dial-out on
//! `ResourceSink`, the local source directory, and the persisted cache.

use std::path::Path;

use bytes::Bytes;
use mcp_xds_gateway::cache::{Cache, Origin, Update};
use mcp_xds_gateway::proto::Resources;
use mcp_xds_gateway::source::persisted;
use mcp_xds_gateway::source::validate::decode_resources;
use prost::Message;
use tonic::Code;

use crate::helpers::clients::{channel, sotw};
use crate::helpers::galley::{dial_out, dial_out_as, resource, FakeGalley};
use crate::helpers::{eventually, gateway_for, http_get, names, start_gateway, within, DR, GW, VS};
use mcp_xds_gateway::tools::galley::Opening;

async fn dial_out_gateway() -> mcp_xds_gateway::app::Bound {
    dial_out_gateway_with(&["--node-id", "gw-sink"]).await
}

/// A gateway waiting for a dial-out of VS, with `extra` flags.
pub(crate) async fn dial_out_gateway_with(extra: &[&str]) -> mcp_xds_gateway::app::Bound {
    let mut args = vec!["--sink-listen", "127.0.0.1:0", "--sink-insecure", "--collections", VS];
    args.extend_from_slice(extra);
    start_gateway(&args).await
}

#[tokio::test]
async fn galleys_dial_out_is_served_like_client_mode() {
    let gw = dial_out_gateway().await;
    let sink = gw.sink.expect("a sink listener");
    let mut galley = dial_out(
        channel(sink).await,
        &[
            ("config.source.version", "1.3.0"),
            ("team", "mesh"),
            ("authorization", "Bearer pw-7Q"),
        ],
    )
    .await
    .expect("the first source is accepted");

    // The initial request, as in client mode.
    let initial = galley.initial_requests(1).await;
    assert_eq!(initial[0].collection, VS);
    assert_eq!(initial[0].sink_node.as_ref().unwrap().id, "gw-sink");
    assert!(initial[0].incremental);

    // Galley's trigger (and the empty collection of Galley before 1.2): the
    // usual UNIMPLEMENTED NACK, and nothing else.
    for trigger in ["$triggerCollection", ""] {
        let reply = galley
            .send(Resources {
                collection: trigger.into(),
                ..Default::default()
            })
            .await;
        assert_eq!(
            reply.error_detail.unwrap().code,
            Code::Unimplemented as i32,
            "{trigger:?}"
        );
    }
    assert!(gw.cache.get(VS).is_none());

    galley
        .push_full(VS, vec![resource("a", "1", b"a"), resource("b", "1", b"b")])
        .await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    assert_eq!(names(&client.recv().await.resources), ["a", "b"]);

    let status = gw.upstream.borrow().clone();
    assert_eq!(status.mode, "sink");
    assert!(status.connected);
    assert!(
        status.peer.as_deref().is_some_and(|p| p.starts_with("127.0.0.1:")),
        "{status:?}"
    );
    assert_eq!(
        status.source_metadata.get("config.source.version").map(String::as_str),
        Some("1.3.0")
    );
    // A key not known to name no secret: its value is kept redacted.
    assert_eq!(
        status.source_metadata.get("team").map(String::as_str),
        Some("[redacted]")
    );
    assert!(!status.source_metadata.contains_key("content-type"));
    // A credential among the metadata is kept (and logged) redacted.
    assert_eq!(
        status.source_metadata.get("authorization").map(String::as_str),
        Some("[redacted]")
    );
}

/// The three ways a dial-out source opens, each then served as usual: Galley
/// 1.1 (trigger `""`, and exactly one message read back, which must be a
/// NACK with UNIMPLEMENTED), Galley 1.2 on (`$triggerCollection`, the answer
/// ignored), and a source that waits to be asked.
#[tokio::test]
async fn every_galley_dial_out_opening_is_answered_and_then_served() {
    for opening in [Opening::TriggerV11, Opening::Trigger, Opening::Silent] {
        let gw = dial_out_gateway().await;
        let (mut galley, answer) = dial_out_as(channel(gw.sink.unwrap()).await, &[], opening)
            .await
            .unwrap_or_else(|status| panic!("{opening:?}: {status:?}"));
        match opening {
            Opening::Silent => assert!(answer.is_none()),
            _ => {
                // The first message back is the trigger's NACK: requests only
                // follow it (Galley 1.1 reads exactly one message).
                let answer = answer.unwrap();
                let trigger = if opening == Opening::TriggerV11 {
                    ""
                } else {
                    "$triggerCollection"
                };
                assert_eq!(answer.collection, trigger, "{opening:?}");
                assert_eq!(answer.error_detail.unwrap().code, Code::Unimplemented as i32);
            }
        }
        let initial = galley.initial_requests(1).await;
        assert_eq!(initial[0].collection, VS, "{opening:?}");
        galley.push_full(VS, vec![resource("a", "1", b"a")]).await;
        let mut client = sotw(gw.listen).await;
        client.subscribe(VS);
        assert_eq!(names(&client.recv().await.resources), ["a"], "{opening:?}");
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn a_second_source_is_refused_and_the_first_keeps_working() {
    let gw = dial_out_gateway().await;
    let sink = gw.sink.unwrap();
    let mut first = dial_out(channel(sink).await, &[]).await.unwrap();
    first.initial_requests(1).await;

    let refused = match dial_out(channel(sink).await, &[]).await {
        Err(status) => status,
        Ok(_) => panic!("a second concurrent source must be refused"),
    };
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(refused.message().contains("another source is connected"), "{refused:?}");

    first.push_full(VS, vec![resource("a", "1", b"a")]).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 1);

    // When the first goes away, the slot is free again, and the next source
    // is told which versions the gateway holds.
    drop(first);
    let mut second = within("the slot to free up", async {
        loop {
            match dial_out(channel(sink).await, &[]).await {
                Ok(stream) => return stream,
                Err(status) => assert_eq!(status.code(), Code::ResourceExhausted),
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    let initial = second.initial_requests(1).await;
    assert_eq!(
        initial[0].initial_resource_versions.get("a").map(String::as_str),
        Some("1")
    );
}

fn vs_doc(name: &str, weight: u32) -> String {
    format!("collection: {VS}\nname: {name}\nbody:\n  struct:\n    hosts: [{name}]\n    weight: {weight}\n---\n")
}

/// Writes a file the way editors and ConfigMap updates do: whole, then renamed.
fn write(dir: &Path, name: &str, text: &str) {
    crate::helpers::certs::write(dir, name, text);
}

#[tokio::test]
async fn the_local_source_follows_edits_new_files_and_removals() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 1)));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", VS]).await;
    assert_eq!(gw.upstream.borrow().mode, "files");
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv().await;
    assert_eq!(names(&first.resources), ["a", "b"]);

    // An edit.
    write(dir.path(), "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 2)));
    client.ack(&first);
    let edited = client.recv().await;
    assert_eq!(names(&edited.resources), ["a", "b"]);
    assert_ne!(edited.version_info, first.version_info);

    // A new file.
    write(dir.path(), "more.yaml", &vs_doc("c", 1));
    client.ack(&edited);
    let added = client.recv().await;
    assert_eq!(names(&added.resources), ["a", "b", "c"]);

    // A removed file.
    std::fs::remove_file(dir.path().join("vs.yaml")).unwrap();
    client.ack(&added);
    let removed = client.recv().await;
    assert_eq!(names(&removed.resources), ["c"]);
    assert_eq!(gw.cache.get(VS).unwrap().origin, Origin::Files);
}

#[tokio::test]
async fn a_file_that_does_not_parse_keeps_its_last_good_state() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 1)));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", VS]).await;
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    let first = client.recv().await;
    client.ack(&first);
    let version = gw.cache.get(VS).unwrap().version.clone();

    // A typo on line 10 (the second document's `body` key).
    let typo = vs_doc("a", 1) + &vs_doc("b", 1).replace("body:", "bodee:");
    write(dir.path(), "vs.yaml", &typo);
    eventually("the parse error to be reported", || {
        gw.upstream
            .borrow()
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("vs.yaml:10:") && e.contains("unknown field `bodee`"))
    })
    .await;
    assert_eq!(
        gw.cache.get(VS).unwrap().version,
        version,
        "a typo never changes the collection"
    );
    assert_eq!(gw.cache.get(VS).unwrap().len(), 2);
    // A metric an alert can fire on: this one file.
    let (_, metrics) = crate::helpers::http_get(gw.admin, "/metrics").await;
    let broken: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("mcp_gateway_source_files_broken "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no mcp_gateway_source_files_broken in\n{metrics}"));
    assert_eq!(broken, 1.0);

    // Fixed: the next response is the fix, not an emptied collection.
    write(dir.path(), "vs.yaml", &(vs_doc("a", 1) + &vs_doc("b", 3)));
    let fixed = client.recv().await;
    assert_eq!(names(&fixed.resources), ["a", "b"]);
    assert_ne!(fixed.version_info, first.version_info);
    eventually("the error to clear", || gw.upstream.borrow().last_error.is_none()).await;
}

/// A rescan parses only the files whose text changed: a large file, broken
/// or not, costs the edits of the others nothing (it took seconds per edit
/// when every file was parsed again).
#[tokio::test]
async fn a_rescan_parses_only_the_files_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.yaml", &vs_doc("a", 1));
    write(dir.path(), "other.yaml", &vs_doc("x", 1));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = crate::helpers::spawn_gateway(None, &["--source-dir", &dir_flag, "--collections", VS]).await;
    let parsed = || crate::limits::metric(gw.monitoring, "mcp_gateway_source_files_parsed_total ");
    let served = |names: &'static [&'static str]| {
        let admin = gw.admin;
        async move {
            let (status, body) = http_get(admin, &format!("/debug/cache/{VS}")).await;
            let cache: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let shown: Vec<&str> = cache["resources"]
                .as_array()
                .map(|r| r.iter().filter_map(|r| r["name"].as_str()).collect())
                .unwrap_or_default();
            status == 200 && shown == names
        }
    };
    crate::helpers::eventually_async("the files served", || served(&["a", "x"])).await;
    assert_eq!(parsed().await, 2, "each file once at start");
    // Broken, a file keeps its last good state, and is not parsed again
    // until its text changes.
    for (name, text, count, names) in [
        (
            "other.yaml",
            vs_doc("x", 2).replace("body:", "bodee:"),
            3,
            &["a", "x"][..],
        ),
        ("b.yaml", vs_doc("b", 1), 4, &["a", "b", "x"][..]),
        ("a.yaml", vs_doc("a", 2), 5, &["a", "b", "x"][..]),
        ("c.yaml", vs_doc("c", 1), 6, &["a", "b", "c", "x"][..]),
    ] {
        write(dir.path(), name, &text);
        crate::helpers::eventually_async("the file parsed", || async { parsed().await >= count }).await;
        crate::helpers::eventually_async("the change served", || served(names)).await;
        assert_eq!(
            parsed().await,
            count,
            "{name}: only the file that changed is parsed again"
        );
    }
}

#[tokio::test]
async fn with_no_source_flag_the_shipped_examples_are_served() {
    // `cargo test` runs in the package root, where examples/config is.
    let gw = start_gateway(&[]).await;
    let status = gw.upstream.borrow().clone();
    assert_eq!((status.mode, status.address.as_str()), ("files", "examples/config"));
    let mut client = sotw(gw.listen).await;
    client.subscribe(VS);
    assert_eq!(
        names(&client.recv().await.resources),
        ["bookinfo/ratings", "bookinfo/reviews"]
    );
    client.subscribe(GW);
    let gateways = client.recv_type(GW).await;
    assert_eq!(names(&gateways.resources), ["istio-system/ingressgateway"]);
    assert_eq!(
        gateways.resources[0].body.as_ref().unwrap().type_url,
        crate::helpers::GW_TYPE_URL
    );
    // Every default collection is served (empty when no file has it).
    let (code, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(gw
        .cache
        .get("istio/networking/v1alpha3/envoyfilters")
        .unwrap()
        .is_empty());
    // So is one a client asks for later: the directory is the whole truth.
    let adapters = "istio/config/v1alpha2/adapters";
    client.subscribe(adapters);
    assert!(client.recv_type(adapters).await.resources.is_empty());
}

/// A cache file in the gateway's own format for `collection`.
fn persisted(dir: &Path, collection: &str, resources: &[mcp_xds_gateway::proto::Resource]) -> Vec<u8> {
    let (cache, mut writer) = Cache::new();
    let encoded: Vec<Bytes> = resources.iter().map(|r| r.encode_to_vec().into()).collect();
    let decoded = decode_resources(collection, &encoded).unwrap();
    writer.apply(collection, Update::Full(decoded), Origin::Upstream);
    let bytes = persisted::encode(&cache.get(collection).unwrap(), false);
    persisted::write_atomically(dir, &persisted::file_name(collection), &bytes).unwrap();
    bytes
}

#[tokio::test]
async fn corrupt_cache_files_are_skipped_and_upstream_replaces_what_was_loaded() {
    let dir = tempfile::tempdir().unwrap();
    persisted(dir.path(), GW, &[resource("g", "1", b"g")]);
    // A damaged file and a torn one.
    std::fs::write(dir.path().join(persisted::file_name(VS)), b"not a cache file").unwrap();
    let good = persisted(dir.path(), DR, &[resource("d", "1", b"d")]);
    std::fs::write(dir.path().join(persisted::file_name(DR)), &good[..good.len() - 3]).unwrap();

    let mut galley = FakeGalley::start().await;
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let gw = gateway_for(&galley, &[VS, GW, DR], &["--cache-dir", &dir_flag]).await;

    // The good file is served at once; the others wait for upstream.
    assert_eq!(gw.cache.get(GW).unwrap().origin, Origin::Disk);
    let mut client = sotw(gw.listen).await;
    client.subscribe(GW);
    let from_disk = client.recv().await;
    assert_eq!(names(&from_disk.resources), ["g"]);
    let (code, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains(VS) && body.contains(DR) && !body.contains(GW), "{body}");

    let mut upstream = galley.next_stream().await;
    let initial = upstream.initial_requests(3).await;
    let gw_request = initial.iter().find(|r| r.collection == GW).unwrap();
    assert_eq!(
        gw_request.initial_resource_versions.get("g").map(String::as_str),
        Some("1")
    );

    // Upstream delivers the same content: no push, but it is now upstream's.
    upstream.push_full(GW, vec![resource("g", "1", b"g")]).await;
    assert_eq!(gw.cache.get(GW).unwrap().origin, Origin::Upstream);
    // Then a change: the next response the client sees is that change.
    client.ack(&from_disk);
    upstream.push_full(GW, vec![resource("g", "2", b"g2")]).await;
    let changed = client.recv().await;
    assert_ne!(changed.version_info, from_disk.version_info);
    assert_eq!(changed.resources[0].metadata.as_ref().unwrap().version, "2");

    // The damaged collection is rewritten whole once upstream delivers it.
    upstream.push_full(VS, vec![resource("v", "1", b"v")]).await;
    let version = gw.cache.get(VS).unwrap().version.clone();
    eventually("the damaged file to be replaced", || {
        persisted::peek(dir.path(), VS).is_ok_and(|m| *m.system_version_info == *version)
    })
    .await;
}

/// A torn, a damaged and two foreign cache files (not a cache file; another
/// collection's file under this one's name): each is skipped with a warning
/// naming its path and why, the good file is served, and the collections of
/// the skipped ones wait for upstream. The gateway is a process of its own:
/// its start-up log is this test's to read.
#[tokio::test]
async fn corrupt_cache_files_are_skipped_each_logged_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let good = persisted(dir.path(), GW, &[resource("g", "1", b"g")]);
    let file = |name: &str| dir.path().join(name);
    let torn = file(&persisted::file_name(VS));
    std::fs::write(&torn, &good[..good.len() / 2]).unwrap();
    let foreign_collection = file(&persisted::file_name(DR));
    std::fs::write(&foreign_collection, &good).unwrap();
    let mut flipped = good.clone();
    *flipped.last_mut().unwrap() ^= 0xff;
    let damaged = file("damaged.mcpcache");
    std::fs::write(&damaged, &flipped).unwrap();
    let stray = file("stray.mcpcache");
    std::fs::write(&stray, b"not a cache file").unwrap();

    let mut galley = FakeGalley::start().await;
    let cache_dir = dir.path().to_str().unwrap().to_owned();
    let gw = crate::helpers::gateway_process_for(&galley, &[VS, GW, DR], &["--cache-dir", &cache_dir]).await;
    for (path, reason) in [
        (&torn, "checksum mismatch: the file is truncated or damaged"),
        (&damaged, "checksum mismatch: the file is truncated or damaged"),
        (&stray, "not a gateway cache file (bad header)"),
        (&foreign_collection, &format!("holds collection \"{GW}\"")),
    ] {
        let path = path.display().to_string();
        let line = gw
            .log
            .iter()
            .find(|l| l.contains(&path))
            .unwrap_or_else(|| panic!("no line names {path}: {:#?}", gw.log));
        assert!(
            line.contains("WARN") && line.contains("skipping a persisted collection") && line.contains(reason),
            "{line}"
        );
    }
    // Skipped: the good file is served at once, the others wait for upstream.
    let mut client = sotw(gw.listen).await;
    client.subscribe(GW);
    assert_eq!(names(&client.recv().await.resources), ["g"]);
    let (code, body) = http_get(gw.admin, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains(VS) && body.contains(DR) && !body.contains(GW), "{body}");
    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(3).await;
    upstream.push_full(VS, vec![resource("v", "1", b"v")]).await;
    upstream.push_full(DR, vec![resource("d", "1", b"d")]).await;
    upstream.push_full(GW, vec![resource("g", "1", b"g")]).await;
    crate::helpers::eventually_async("ready once upstream delivered the skipped collections", || async {
        http_get(gw.admin, "/readyz").await.0 == 200
    })
    .await;
}

/// A dial-out source's messages are read up to `--max-message-bytes`: a
/// large collection under it is applied; one over it ends the stream with
/// an error naming the flag, and the cache keeps what it had.
#[tokio::test]
async fn a_dial_out_message_over_the_limit_ends_the_stream_naming_the_flag() {
    let gw = dial_out_gateway_with(&["--max-message-bytes", "1000000"]).await;
    let mut galley = dial_out(channel(gw.sink.unwrap()).await, &[]).await.unwrap();
    galley.initial_requests(1).await;
    let collection = |count: usize| -> Vec<_> {
        (0..count)
            .map(|i| resource(&format!("r{i:03}"), "1", &vec![b'x'; 10_000]))
            .collect()
    };
    // About 600 kB, in one message.
    galley.push_full(VS, collection(60)).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 60);
    // About 1.2 MB: refused from its length.
    galley.send_only(Resources {
        collection: VS.into(),
        resources: collection(120),
        ..Default::default()
    });
    let status = crate::helpers::upstream_status_when(&gw, "the stream to end", |s| !s.connected).await;
    let error = status.last_error.unwrap_or_default();
    assert!(error.contains("--max-message-bytes=1000000"), "{error}");
    assert_eq!(gw.cache.get(VS).unwrap().len(), 60, "the cache keeps its state");
}

/// A file that does not parse at start holds everything back: what it holds
/// is unknown, and its collections served without it would tell Pilot and
/// istiod to delete what they hold. Not ready, saying which file and line;
/// once it parses, everything is served.
#[tokio::test]
async fn a_file_broken_at_start_holds_everything_back_until_it_parses() {
    let dir = tempfile::tempdir().unwrap();
    let good = "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata:\n  name: gw\n  namespace: ns\nspec:\n  selector: {istio: ingressgateway}\n";
    let vs = |field: &str| {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata:\n  name: vs\n  namespace: ns\nspec:\n  {field}: [reviews]\n"
        )
    };
    crate::helpers::certs::write(dir.path(), "gw.yaml", good);
    crate::helpers::certs::write(dir.path(), "vs.yaml", &vs("hostz"));
    let dir_flag = dir.path().to_str().unwrap().to_owned();
    let collections = format!("{VS},{GW}");
    let gw = start_gateway(&["--source-dir", &dir_flag, "--collections", &collections]).await;
    let (status, why) = http_get(gw.admin, "/readyz").await;
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("vs.yaml:7") && why.contains("hostz"), "{why}");
    assert!(gw.cache.get(GW).is_none(), "nothing served, not even the good file's");
    assert!(gw.cache.get(VS).is_none());

    crate::helpers::certs::write(dir.path(), "vs.yaml", &vs("hosts"));
    eventually("everything served once the file parses", || {
        gw.cache.get(GW).is_some_and(|s| s.len() == 1) && gw.cache.get(VS).is_some_and(|s| s.len() == 1)
    })
    .await;
    assert_eq!(http_get(gw.admin, "/readyz").await.0, 200);
    // A file broken later keeps its last good state, as before.
    crate::helpers::certs::write(dir.path(), "vs.yaml", &vs("hostz"));
    eventually("the error shown", || gw.upstream.borrow().last_error.is_some()).await;
    assert_eq!(gw.cache.get(VS).unwrap().len(), 1, "a typo never empties a collection");
}

/// An edit that applies is logged once, with the collections it changed
/// and their new versions; an edit that changes nothing is not.
#[tokio::test]
async fn an_applied_edit_is_logged_with_what_it_changed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vs.yaml");
    let vs = |host: &str| {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{name: a, namespace: ns}}\nspec:\n  hosts: [{host}]\n"
        )
    };
    std::fs::write(&file, vs("a")).unwrap();
    let flag = dir.path().to_str().unwrap().to_owned();
    let mut running = crate::helpers::spawn_gateway(None, &["--source-dir", &flag]).await;
    const APPLIED: &str = "the source directory's change is applied";
    let first = match running.log.iter().find(|l| l.contains(APPLIED)) {
        Some(line) => line.clone(),
        None => running.log_line(APPLIED).await,
    };
    assert!(first.contains("istio/networking/v1alpha3/virtualservices@"), "{first}");
    std::fs::write(&file, vs("b")).unwrap();
    let second = running.log_line(APPLIED).await;
    assert!(
        second.contains("istio/networking/v1alpha3/virtualservices@") && second != first,
        "{second}"
    );
}
