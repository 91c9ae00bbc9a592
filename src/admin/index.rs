//! `/` on the admin and monitoring ports: every endpoint with one line each,
//! and on the admin port which clients are not in sync, on which collection,
//! since when and why. HTML for a browser; JSON with `Accept:
//! application/json`.

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{document, escape, not_delivered, syncz, AdminState, Positions, NAVIGATION};

/// What is wrong with the source while clients are served (files that do
/// not parse, the upstream disconnected, collections overdue): the index,
/// `/debug/syncz` and `status` lead with it.
pub(super) fn source_problems(state: &AdminState) -> Vec<String> {
    let not_delivered = not_delivered(state);
    syncz::source_problems(&state.upstream.borrow(), &not_delivered)
}

/// `problems` as the paragraphs a page leads with.
pub(super) fn problems_html(problems: &[String], out: &mut String) {
    paragraphs_html(problems, "problem", "source", out);
}

/// Each line as a paragraph of `class`, a trailing `(/debug/skew)` made a
/// link.
fn paragraphs_html<'a>(lines: impl IntoIterator<Item = &'a String>, class: &str, col: &str, out: &mut String) {
    for line in lines {
        let text = escape(line.trim_end_matches(" (/debug/skew)"));
        let link = if line.ends_with(" (/debug/skew)") {
            " (<a href=\"/debug/skew\">/debug/skew</a>)"
        } else {
            ""
        };
        out.push_str(&format!("<p class=\"{class}\" data-col=\"{col}\">{text}{link}</p>"));
    }
}

/// Warnings (what clients' releases drop, who is not checked) as the
/// paragraphs a page shows after its problems, each `(/debug/skew)` a link.
pub(super) fn warnings_html<'a>(warnings: impl IntoIterator<Item = &'a String>, out: &mut String) {
    paragraphs_html(warnings, "warning", "skew", out);
}

/// The admin port's endpoints: (path, what it shows).
pub const ADMIN_ENDPOINTS: &[(&str, &str)] = &[
    ("/", "this index: the endpoints, and every client not in sync"),
    (
        "/debug/syncz",
        "every client stream and type: status (SYNCED, SENT, STALE, NACKED, NOT SENT), since when, last request, \
         response, ACK and NACK; a summary first; filters ?collection= ?status= ?node=",
    ),
    (
        "/debug/skew",
        "per Istio release of a connected client: the resources it reads without a field, enum value or type its \
         protos lack (dropped without a NACK), each with its file and line; the clients whose release is unknown",
    ),
    (
        "/debug/clients",
        "every client stream: peer, node, protocol, and per type what was sent, ACKed and NACKed",
    ),
    (
        "/debug/cache",
        "every collection: version, resources, bytes, origin, when it changed",
    ),
    (
        "/debug/cache/{collection}",
        "one collection's resources: names and versions; ?bodies=json|yaml: the config dump, each with its \
         metadata and its body read back",
    ),
    (
        "/debug/history/{collection}",
        "the collection's last --history versions, newest first: version, when applied, origin, resources \
         added, changed and removed",
    ),
    (
        "/debug/diff/{collection}",
        "?from=V1&to=V2 (to: the latest by default): the names added, removed and changed between two versions \
         in the history (a version or a unique prefix of at least 8 characters); &bodies=yaml: each changed body \
         as a unified diff",
    ),
    (
        "/debug/rollout",
        "every collection's rollout: PINNED, HELD (with the canary and its NACK), WAITING, CANARY or SERVING; \
         the version everyone and the canaries are served; /debug/rollout/{collection}: one",
    ),
    (
        "/pin/{collection}",
        "POST ?version=V: every client is served version V (from the history; a unique prefix of at least 8 \
         characters will do) instead of the latest; DELETE: the latest again",
    ),
    (
        "/promote/{collection}",
        "POST: the version the canaries are on (held, or in a round) goes to every client now",
    ),
    (
        "/debug/upstream",
        "the source: connected, since when, last error, per collection; collections only clients asked for",
    ),
    (
        "/debug/config",
        "every flag with its value and where it came from, the access policy in effect, and the log filter",
    ),
    (
        "/debug/access",
        "?identity=ID (uri:SAN, dns:SAN, or unauthenticated): what that identity may read of each collection \
         under --access-policy, and the rules that name it",
    ),
    (
        "/logging",
        "POST ?level=FILTER: change the log filter at run time (tracing's EnvFilter syntax)",
    ),
    ("/metrics", "Prometheus metrics"),
    ("/healthz", "liveness"),
    (
        "/readyz",
        "readiness: 200 once every configured collection has a first state, else 503 and why, on one line: \
         what is missing and the source's last error",
    ),
];

/// The monitoring port's endpoints.
pub const MONITORING_ENDPOINTS: &[(&str, &str)] = &[
    ("/", "this index"),
    ("/metrics", "Prometheus metrics"),
    ("/healthz", "liveness"),
    (
        "/readyz",
        "readiness: 200 once every configured collection has a first state, else 503 with the count of \
         problems only (this port names no file, collection or value: the admin port's /readyz says which)",
    ),
];

fn wants_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/json"))
}

fn endpoints_json(endpoints: &[(&str, &str)]) -> Value {
    endpoints
        .iter()
        .map(|(path, what)| json!({"path": path, "what": what}))
        .collect()
}

fn endpoints_html(endpoints: &[(&str, &str)], out: &mut String) {
    out.push_str("<table>");
    for (path, what) in endpoints {
        let link = if path.contains('{') || what.starts_with("POST") {
            escape(path)
        } else {
            format!("<a href=\"{0}\">{0}</a>", escape(path))
        };
        out.push_str(&format!("<tr><td>{link}</td><td>{}</td></tr>", escape(what)));
    }
    out.push_str("</table>");
}

fn page(title: &str, body: &str) -> Html<String> {
    Html(document(title, body))
}

pub async fn admin(
    State(state): State<AdminState>,
    Query(positions): Query<Positions>,
    headers: HeaderMap,
) -> Response {
    let streams = state.registry.streams();
    let clock = state.registry.clock();
    let policy = state.access.current();
    let skew = state.skew_lookup(&policy);
    let rows = syncz::rows(&streams, &state.rollout, Some(&skew), clock, state.stale_after);
    let summary = syncz::summary(&rows);
    let not_synced = syncz::problems_first(rows.iter().filter(|r| r.status != syncz::SyncStatus::Synced));
    let source = source_problems(&state);
    let skewed = super::skew::lead(&state);
    let unchecked = super::skew::unchecked(&streams);
    if wants_json(&headers) {
        return Json(json!({
            "source": syncz::source_json(&source),
            "skew": skewed,
            "skew_not_checked": unchecked,
            "ready": state.not_ready().is_none(),
            "not_ready": state.not_ready(),
            "endpoints": endpoints_json(ADMIN_ENDPOINTS),
            "clients": summary["clients"],
            "not_synced": not_synced.iter().map(|r| syncz::brief_json(r, clock)).collect::<Vec<_>>(),
        }))
        .into_response();
    }
    // What needs an operator first: the source (an edit that does not
    // apply while every client is in sync), readiness, then the clients not
    // in sync; the counts and the endpoints after.
    // Most severe first: the source and readiness (red), the clients not in
    // sync with their NACKs, then what clients' releases drop (a warning,
    // yellow: they hold the config, minus a field).
    let mut body = String::from(NAVIGATION);
    problems_html(&source, &mut body);
    if let Some(reason) = state.not_ready() {
        body.push_str(&format!("<p class=\"problem\">{}</p>", escape(&reason)));
    }
    body.push_str("<h2>Clients not in sync</h2>");
    if not_synced.is_empty() && !source.is_empty() {
        body.push_str(
            "<p>none: every client holds the current version of every type it follows, which is the source's \
             last good state (above)</p>",
        );
    } else if not_synced.is_empty() {
        body.push_str("<p>none: every client holds the current version of every type it follows</p>");
    } else {
        syncz::rows_html(&not_synced, clock, &mut body);
    }
    warnings_html(skewed.iter().chain(&unchecked), &mut body);
    body.push_str(&syncz::counts_html(&rows));
    body.push_str(&format!(
        "<p>(STALE: behind the cache for longer than --stale-after={}s; every client: <a \
         href=\"/debug/syncz\">/debug/syncz</a>)</p>",
        state.stale_after.as_secs_f64()
    ));
    body.push_str("<h2>Endpoints</h2>");
    endpoints_html(ADMIN_ENDPOINTS, &mut body);
    body.push_str(positions.script());
    page("mcp-xds-gateway admin", &body).into_response()
}

pub async fn monitoring(headers: HeaderMap) -> Response {
    if wants_json(&headers) {
        return Json(json!({"endpoints": endpoints_json(MONITORING_ENDPOINTS)})).into_response();
    }
    let mut body = String::new();
    endpoints_html(MONITORING_ENDPOINTS, &mut body);
    page("mcp-xds-gateway monitoring", &body).into_response()
}

#[cfg(test)]
mod tests {
    use super::syncz::source_problems;
    use crate::source::UpstreamStatus;
    use serde_json::json;

    #[test]
    fn the_source_is_unhealthy_while_files_do_not_parse_the_upstream_is_down_or_collections_are_overdue() {
        let files = UpstreamStatus {
            mode: "files",
            connected: true,
            broken_files: 2,
            last_error: Some("a.yaml:3: bad; b.yaml:0: cannot read".into()),
            ..Default::default()
        };
        assert_eq!(
            source_problems(&files, &json!([])),
            ["SOURCE: 2 files do not parse, serving their last good state: a.yaml:3: bad; b.yaml:0: cannot read"]
        );
        let unread = UpstreamStatus {
            broken_files: 1,
            last_error: Some("nothing served until every file parses: a.yaml:3: bad".into()),
            ..files.clone()
        };
        assert_eq!(
            source_problems(&unread, &json!([])),
            ["SOURCE: 1 file does not parse, nothing is served until every file parses: a.yaml:3: bad"]
        );
        let healthy = UpstreamStatus {
            broken_files: 0,
            last_error: None,
            ..files
        };
        assert!(source_problems(&healthy, &json!([])).is_empty());
        let down = UpstreamStatus {
            mode: "client",
            address: "http://127.0.0.1:9901".into(),
            connected: false,
            last_error: Some("cannot connect".into()),
            ..Default::default()
        };
        let problems = source_problems(&down, &json!([{"collection": "c/one"}]));
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("SOURCE: the upstream http://127.0.0.1:9901 is disconnected")
                && problems[0].ends_with("serving its last state: cannot connect"),
            "{problems:?}"
        );
        assert!(
            problems[1].starts_with("SOURCE: c/one asked for by clients"),
            "{problems:?}"
        );
    }
}
