//! The admin pages in a real browser. Headless Chromium renders `/` and
//! `/debug/syncz` of a busy gateway (clients with Istio's long node ids, one
//! NACKing with a long message, one that never ACKs) in a 1,400 px window;
//! the pages, asked with `?positions`, record where their cells lie, and the
//! test reads that from `--dump-dom`. Chromium is `CHROMIUM_BIN` (`.ci/run`
//! installs Debian's `chromium` and exports it); built without it, the test
//! is reported as ignored, with the reason.

use serde_json::Value;
use tokio::process::Command;

use crate::canary::request_as;
use crate::helpers::clients::{sotw, SotwClient};
use crate::helpers::galley::resource;
use crate::helpers::{eventually_async, galley_and_gateway, get_json, within, GW, VS};

/// The window the pages must fit.
const WIDTH: f64 = 1400.0;

/// A node id as istiod's sidecars send it.
fn sidecar(pod: &str, ip: u8) -> String {
    format!("sidecar~10.244.3.{ip}~{pod}.bookinfo~bookinfo.svc.cluster.local")
}

/// A client of `node` on `collection` that ACKs its first response.
async fn synced(gw: &mcp_xds_gateway::app::Bound, node: &str, collection: &str) -> SotwClient {
    let mut client = sotw(gw.listen).await;
    client.send(request_as(node, collection, "", "", None));
    let first = client.recv().await;
    client.send(request_as(node, collection, &first.version_info, &first.nonce, None));
    client
}

/// `url` rendered by Chromium in a 1,400 x 900 window: the DOM after its
/// scripts ran.
async fn render(chromium: &str, url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let output = within(
        &format!("Chromium to render {url}"),
        Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--window-size=1400,900",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|e| panic!("run {chromium}: {e}"));
    let dom = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && dom.contains("</html>"),
        "{chromium} --dump-dom {url}: {:?}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    dom
}

/// What the page's script recorded: the window's width and each `data-col`
/// element's box, lines and text, in document order.
fn positions(dom: &str) -> Value {
    let start = dom
        .find("<pre id=\"positions\">")
        .expect("the positions the page recorded")
        + 20;
    let end = start + dom[start..].find("</pre>").unwrap();
    let text = dom[start..end]
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn cells<'a>(recorded: &'a Value, col: &str) -> Vec<&'a Value> {
    recorded["cells"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["col"] == col)
        .collect()
}

/// The status and NACK columns of both pages lie within 1,400 px, node ids
/// stay on one line, and the NACKing client's row comes first.
#[tokio::test]
#[cfg_attr(
    not(peer_chromium),
    ignore = "needs Chromium: build and run with CHROMIUM_BIN set to its binary (.ci/run installs Debian's chromium)"
)]
async fn the_status_and_nack_columns_fit_1400_px_with_problems_first() {
    let chromium =
        std::env::var("CHROMIUM_BIN").expect("CHROMIUM_BIN, set when the tests were built, is set when they run");
    let (_galley, gw, mut upstream) = galley_and_gateway(&[VS, GW], &[]).await;
    upstream.push_full(VS, vec![resource("reviews", "1", b"v1")]).await;
    upstream
        .push_full(GW, vec![resource("bookinfo-gateway", "1", b"g")])
        .await;

    // Clients in sync on both collections.
    let mut clients = Vec::new();
    for (at, pod) in [
        "productpage-v1-6b746f74dc-9stvs",
        "details-v1-5f4d584748-bz42b",
        "ratings-v1-85cc46b6d4-x7m2n",
        "reviews-v1-84c65dcd9b-4zt6q",
    ]
    .iter()
    .enumerate()
    {
        let node = sidecar(pod, 10 + at as u8);
        for collection in [VS, GW] {
            clients.push(synced(&gw, &node, collection).await);
        }
    }
    // One that NACKs the next version, at length; one that never ACKs.
    let nacking_node = sidecar("reviews-v3-7dbcdcbc56-m8kqz", 40);
    let mut nacking = synced(&gw, &nacking_node, VS).await;
    let mut pending = sotw(gw.listen).await;
    pending.send(request_as(
        &sidecar("reviews-v2-5b64f47978-kp9xd", 41),
        VS,
        "",
        "",
        None,
    ));
    pending.recv().await;
    upstream.push_full(VS, vec![resource("reviews", "2", b"v2")]).await;
    let refused = nacking.recv().await;
    let message = format!(
        "Internal:Error adding/updating listener(s) 0.0.0.0_9080: route reviews.bookinfo.svc.cluster.local: \
         destination host \"reviews-canary.bookinfo.svc.cluster.local.with-a-very-long-name-that-never-breaks\" \
         not found in any of the {} clusters the proxy holds; the previous configuration stays in effect",
        42
    );
    nacking.send(request_as(&nacking_node, VS, "", &refused.nonce, Some(&message)));
    eventually_async("the NACK in /debug/syncz", || async {
        let syncz = get_json(gw.admin, "/debug/syncz?status=nacked").await;
        !syncz["rows"].as_array().unwrap().is_empty()
    })
    .await;

    for path in ["/?positions", "/debug/syncz?positions"] {
        let url = format!("http://{}{path}", gw.admin);
        let recorded = positions(&render(&chromium, &url).await);
        assert_eq!(
            recorded["width"].as_f64(),
            Some(WIDTH),
            "{path}: the window: {recorded}"
        );
        let statuses = cells(&recorded, "status");
        assert!(!statuses.is_empty(), "{path}: {recorded}");
        assert_eq!(statuses[0]["text"], "NACKED", "{path}: problems first: {recorded}");
        for cell in statuses.iter().chain(&cells(&recorded, "nack")) {
            let (left, right) = (cell["left"].as_f64().unwrap(), cell["right"].as_f64().unwrap());
            assert!(left >= 0.0 && right <= WIDTH, "{path}: off-screen at 1,400 px: {cell}");
        }
        let shown = cells(&recorded, "nack")
            .into_iter()
            .find(|c| c["text"].as_str().unwrap_or_default().contains("Error adding/updating"))
            .unwrap_or_else(|| panic!("{path}: the NACK message: {recorded}"));
        // Readable: a column of its own, not squeezed to a few words a line
        // (at least 25 characters a line on average, whatever the fonts the
        // machine has: DejaVu Sans, the only one on some, sets it in 9 lines
        // where others take 8).
        let width = shown["right"].as_f64().unwrap() - shown["left"].as_f64().unwrap();
        let lines = shown["lines"].as_u64().unwrap_or(u64::MAX);
        let per_line = message.chars().count() as u64 / lines.max(1);
        assert!(
            width >= 300.0 && per_line >= 25,
            "{path}: {per_line} characters a line: {shown}"
        );
        let nodes = cells(&recorded, "node");
        assert!(!nodes.is_empty(), "{path}");
        for node in nodes {
            assert_eq!(node["lines"], 1, "{path}: a node id on one line: {node}");
        }
    }
    drop((clients, nacking, pending));
}

/// A file broken while the gateway runs: both pages lead with it, in view
/// at the top of a 1,400 x 900 window, above every client row.
#[tokio::test]
#[cfg_attr(
    not(peer_chromium),
    ignore = "needs Chromium: build and run with CHROMIUM_BIN set to its binary (.ci/run installs Debian's chromium)"
)]
async fn a_broken_source_file_leads_both_pages_in_view() {
    let chromium =
        std::env::var("CHROMIUM_BIN").expect("CHROMIUM_BIN, set when the tests were built, is set when they run");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("networking.yaml");
    let good = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: a, namespace: ns}\n\
                spec:\n  hosts: [a]\n";
    std::fs::write(&file, good).unwrap();
    let gw = crate::helpers::start_gateway(&["--source-dir", dir.path().to_str().unwrap(), "--collections", VS]).await;
    let client = synced(&gw, &sidecar("reviews-v1-84c65dcd9b-4zt6q", 10), VS).await;
    std::fs::write(&file, good.replace("hosts: [a]", "hosts: [a]\n  htp: []")).unwrap();
    eventually_async("the broken file in /debug/syncz", || async {
        get_json(gw.admin, "/debug/syncz").await["source"]["healthy"] == false
    })
    .await;
    for path in ["/?positions", "/debug/syncz?positions"] {
        let url = format!("http://{}{path}", gw.admin);
        let recorded = positions(&render(&chromium, &url).await);
        let all = recorded["cells"].as_array().unwrap();
        let first = all.first().unwrap_or_else(|| panic!("{path}: {recorded}"));
        assert_eq!(first["col"], "source", "{path}: the source leads: {recorded}");
        assert!(
            first["text"]
                .as_str()
                .is_some_and(|t| t.starts_with("SOURCE: 1 file does not parse")),
            "{path}: {first}"
        );
        let (left, right, top) = (
            first["left"].as_f64().unwrap(),
            first["right"].as_f64().unwrap(),
            first["top"].as_f64().unwrap(),
        );
        assert!(left >= 0.0 && right <= WIDTH && top < 200.0, "{path}: in view: {first}");
        for cell in cells(&recorded, "status") {
            assert!(
                cell["top"].as_f64().unwrap() > top,
                "{path}: above every client: {cell}"
            );
        }
    }
    drop(client);
}

/// `/debug/config` with a long unbroken `--collections` value fits a
/// 1,400 px window: the value wraps, no flag's name does.
#[tokio::test]
#[cfg_attr(
    not(peer_chromium),
    ignore = "needs Chromium: build and run with CHROMIUM_BIN set to its binary (.ci/run installs Debian's chromium)"
)]
async fn the_config_page_fits_1400_px() {
    let chromium =
        std::env::var("CHROMIUM_BIN").expect("CHROMIUM_BIN, set when the tests were built, is set when they run");
    let collections = [
        VS,
        "istio/networking/v1alpha3/gateways",
        "istio/networking/v1alpha3/destinationrules",
        "istio/networking/v1alpha3/serviceentries",
        "istio/networking/v1alpha3/sidecars",
        "istio/networking/v1alpha3/envoyfilters",
        "istio/security/v1beta1/authorizationpolicies",
        "istio/security/v1beta1/peerauthentications",
    ]
    .join(",");
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config");
    let gw = crate::helpers::start_gateway(&["--source-dir", examples, "--collections", &collections]).await;
    let url = format!("http://{}/debug/config?positions", gw.admin);
    let recorded = positions(&render(&chromium, &url).await);
    assert!(
        recorded["scroll_width"].as_f64().unwrap() <= WIDTH,
        "the page scrolls sideways: {recorded}"
    );
}

/// What clients' releases drop (`/debug/skew`): its first finding (the
/// field, what the release lacks, the file and line) reads whole in a
/// 1,400 px window, and the index shows a client's NACK above that warning.
#[tokio::test]
#[cfg_attr(
    not(peer_chromium),
    ignore = "needs Chromium: build and run with CHROMIUM_BIN set to its binary (.ci/run installs Debian's chromium)"
)]
async fn the_skew_page_fits_1400_px_and_the_index_puts_a_nack_above_skew() {
    const DR: &str = "istio/networking/v1alpha3/destinationrules";
    let chromium =
        std::env::var("CHROMIUM_BIN").expect("CHROMIUM_BIN, set when the tests were built, is set when they run");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        crate::skew::rules("consecutive5xxErrors"),
    )
    .unwrap();
    let gw = crate::helpers::start_gateway(&["--source-dir", dir.path().to_str().unwrap(), "--collections", DR]).await;
    // Istio 1.1 Pilots (the legacy service): one in sync, one NACKing.
    let reader = synced(&gw, &sidecar("istio-pilot-7d9f8c6b5-abcde", 20), DR).await;
    let nacking_node = sidecar("istio-pilot-7d9f8c6b5-fghij", 21);
    let mut nacking = sotw(gw.listen).await;
    nacking.send(request_as(&nacking_node, DR, "", "", None));
    let refused = nacking.recv().await;
    nacking.send(request_as(
        &nacking_node,
        DR,
        "",
        &refused.nonce,
        Some("pilot refused the rules"),
    ));
    eventually_async("the NACK and the skew in /debug/syncz", || async {
        let syncz = get_json(gw.admin, "/debug/syncz").await;
        let rows = syncz["rows"].as_array().cloned().unwrap_or_default();
        rows.iter().any(|r| r["status"] == "NACKED") && syncz["skew"].is_string()
    })
    .await;

    let url = format!("http://{}/debug/skew?positions", gw.admin);
    let recorded = positions(&render(&chromium, &url).await);
    for col in ["skew-field", "skew-message", "skew-file"] {
        let first = *cells(&recorded, col)
            .first()
            .unwrap_or_else(|| panic!("/debug/skew: no {col}: {recorded}"));
        let (left, right) = (first["left"].as_f64().unwrap(), first["right"].as_f64().unwrap());
        assert!(
            left >= 0.0 && right <= WIDTH,
            "/debug/skew: {col} off-screen at 1,400 px: {first}"
        );
    }
    assert!(
        cells(&recorded, "skew-field")[0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("consecutive5xxErrors")),
        "the whole path: {recorded}"
    );
    assert!(
        cells(&recorded, "skew-file")[0]["text"]
            .as_str()
            .is_some_and(|t| t.ends_with("rules.yaml:11")),
        "the file and the line: {recorded}"
    );

    let url = format!("http://{}/?positions", gw.admin);
    let recorded = positions(&render(&chromium, &url).await);
    let nack = cells(&recorded, "nack")
        .into_iter()
        .find(|c| c["text"].as_str().unwrap_or_default().contains("pilot refused"))
        .unwrap_or_else(|| panic!("the index: the NACK: {recorded}"));
    let skew = *cells(&recorded, "skew")
        .first()
        .unwrap_or_else(|| panic!("the index: the skew warning: {recorded}"));
    assert!(
        nack["top"].as_f64().unwrap() < skew["top"].as_f64().unwrap(),
        "the index: a NACK above a skew warning: {nack} {skew}"
    );
    // /debug/syncz's page has the identity column (`unauthenticated` here).
    let url = format!("http://{}/debug/syncz?positions", gw.admin);
    let recorded = positions(&render(&chromium, &url).await);
    let identities = cells(&recorded, "identity");
    assert!(
        !identities.is_empty() && identities.iter().all(|c| c["text"] == "unauthenticated"),
        "/debug/syncz: the identity column: {recorded}"
    );
    drop((reader, nacking));
}
