//! `/debug/skew`: per Istio release in use, the resources its clients read
//! without something their protos lack, each dropped field with the file and
//! line it is written at (files source), and the clients whose release is
//! not known.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::AdminState;
use crate::downstream::registry::StreamView;
use crate::skew::{ClientGeneration, Dropped, Generation, ResourceSkew, TrackedSkew, RELEASES};
use crate::source::files::{self, Origins};

/// Resources listed per collection and release.
const LISTED: usize = 100;

/// Files read for lines, once per view.
#[derive(Default)]
pub(super) struct Texts(BTreeMap<String, Option<files::FileLines>>);

impl Texts {
    /// The line of `dropped` in the file `collection`/`name` came from
    /// (`None` when not from a file, or the file changed since).
    pub(super) fn line(
        &mut self,
        origins: &Origins,
        collection: &str,
        name: &str,
        dropped: &Dropped,
    ) -> Option<(String, usize)> {
        let (file, body_at) = origins.of(collection, name)?;
        let lines = self
            .0
            .entry(file.to_owned())
            .or_insert_with(|| files::text_of(file, origins.max_file_bytes).map(|t| files::FileLines::of(&t)))
            .as_ref()?;
        let line = lines.field_line(body_at, &dropped.path, &dropped.proto_path)?;
        Some((file.to_owned(), line))
    }
}

/// One resource's drops for one release, with their files and lines.
pub(super) fn resource_json(
    texts: &mut Texts,
    origins: &Origins,
    collection: &str,
    name: &str,
    generation: Generation,
    skew: &ResourceSkew,
) -> Value {
    let fields: Vec<Value> = skew
        .dropped
        .iter()
        .map(|d| {
            let at = texts.line(origins, collection, name, d);
            json!({
                "path": d.shown_path(),
                "added_in": d.added_in.map(|g| g.to_string()),
                "message": d.message(generation),
                "file": at.as_ref().map(|(f, _)| f.clone()),
                "line": at.as_ref().map(|(_, l)| *l),
            })
        })
        .collect();
    let file = origins.of(collection, name).map(|(f, _)| f.to_owned());
    json!({"name": name, "file": file, "fields": fields, "more": skew.more})
}

/// What every release in use drops, and who is of which release.
pub(super) fn view_json(state: &AdminState) -> Value {
    let tracked = state.skew.tracked();
    let origins = state.skew.origins();
    let mut texts = Texts::default();
    let mut by_generation: BTreeMap<Generation, Vec<&TrackedSkew>> = BTreeMap::new();
    for t in &tracked {
        by_generation.entry(t.generation).or_default().push(t);
    }
    let streams = state.registry.streams();
    let mut unchecked: Vec<Value> = Vec::new();
    let mut clients: BTreeMap<Generation, usize> = BTreeMap::new();
    for stream in &streams {
        let who = || {
            json!({"stream": stream.id, "node_id": stream.node_id, "identity": stream.identity,
                   "peer": stream.peer.map(|p| p.to_string()), "protocol": stream.protocol.as_str()})
        };
        match stream.generation {
            Some(ClientGeneration::Known { generation, .. }) if generation.release().is_some() => {
                *clients.entry(generation).or_default() += 1;
            }
            Some(generation @ ClientGeneration::Known { .. }) | Some(generation @ ClientGeneration::Unknown) => {
                let mut entry = who();
                entry["generation"] = serde_json::to_value(generation).unwrap_or_default();
                unchecked.push(entry);
            }
            None => {}
        }
    }
    let generations: Vec<Value> = by_generation
        .iter()
        .map(|(generation, collections)| {
            let collections: Vec<Value> = collections
                .iter()
                .map(|t| {
                    // The first ones: the count says how many; `check --for`
                    // lists them all.
                    let resources: Vec<Value> = t
                        .skewed
                        .iter()
                        .take(LISTED)
                        .map(|(name, skew)| resource_json(&mut texts, &origins, &t.collection, name, *generation, skew))
                        .collect();
                    json!({
                        "collection": t.collection,
                        "version": t.version,
                        // A canary round's new version (the canaries' only).
                        "served_to": if t.canaries_only { "canaries" } else { "everyone" },
                        "checked": t.checked || t.version.is_none(),
                        "clients": t.clients,
                        "resources": t.skewed.len(),
                        "dropped": resources,
                    })
                })
                .collect();
            json!({
                "release": generation.to_string(),
                "protos": generation.release().map(|r| r.tag),
                "clients": clients.get(generation).copied().unwrap_or_default(),
                // Per collection, the most of the versions served (a canary
                // round's counts: it is about to go to everyone).
                "resources": collections
                    .iter()
                    .fold(BTreeMap::<&str, u64>::new(), |mut most, c| {
                        let n = c["resources"].as_u64().unwrap_or(0);
                        let entry = most.entry(c["collection"].as_str().unwrap_or_default()).or_default();
                        *entry = (*entry).max(n);
                        most
                    })
                    .values()
                    .sum::<u64>(),
                "collections": collections,
            })
        })
        .collect();
    // What clients drop first, then who is not checked; what the checks
    // know and cost after.
    json!({
        "generations": generations,
        "not_checked": unchecked,
        "releases_known": RELEASES.iter().map(|r| r.tag).collect::<Vec<_>>(),
        "rules": state.skew.rules().shown(),
        // One per changed resource and release in use: the skew's cost.
        "resources_checked": state.skew.checks(),
    })
}

/// The page: each dropped field on a line of its own (release, collection,
/// resource, field, what the release lacks, file:line), the field and the
/// message wrapped so the first finding reads whole in a 1,400 px window;
/// the clients not checked; then the releases' summary and the rules.
fn view_html(value: &Value, positions: &super::Positions) -> String {
    use super::{collection_html, escape};
    let mut body = String::from(super::NAVIGATION);
    let mut drops = String::new();
    let mut count = 0;
    for generation in value["generations"].as_array().into_iter().flatten() {
        let release = generation["release"].as_str().unwrap_or_default();
        for collection in generation["collections"].as_array().into_iter().flatten() {
            let name = collection["collection"].as_str().unwrap_or_default();
            for resource in collection["dropped"].as_array().into_iter().flatten() {
                for field in resource["fields"].as_array().into_iter().flatten() {
                    count += 1;
                    let at = match (field["file"].as_str(), field["line"].as_u64()) {
                        (Some(file), Some(line)) => format!("{file}:{line}"),
                        (Some(file), None) => file.to_owned(),
                        _ => resource["file"].as_str().unwrap_or("-").to_owned(),
                    };
                    drops.push_str(&format!(
                        "<tr><td class=\"nowrap\">Istio {}</td><td>{}</td><td class=\"wrap\">{}</td>\
                         <td class=\"wrap\" data-col=\"skew-field\"><code>{}</code></td>\
                         <td class=\"message\" data-col=\"skew-message\">{}</td>\
                         <td class=\"wrap\" data-col=\"skew-file\">{}</td></tr>",
                        escape(release),
                        collection_html(name),
                        escape(resource["name"].as_str().unwrap_or_default()),
                        escape(field["path"].as_str().unwrap_or_default()),
                        escape(field["message"].as_str().unwrap_or_default()),
                        escape(&at),
                    ));
                }
            }
        }
    }
    body.push_str("<h2>Fields connected clients drop without a NACK</h2>");
    if count == 0 {
        body.push_str("<p>none: every connected client of a known release reads all it is served</p>");
    } else {
        body.push_str(
            "<table><tr><th>release</th><th>collection</th><th>resource</th><th>field</th>\
             <th>what the release lacks</th><th>file:line</th></tr>",
        );
        body.push_str(&drops);
        body.push_str("</table>");
    }
    if value["not_checked"].as_array().is_some_and(|c| !c.is_empty()) {
        body.push_str("<h2>Clients not checked (release unknown: name it with --client-generation GLOB=RELEASE)</h2>");
        super::html(&value["not_checked"], &mut body);
    }
    body.push_str("<h2>Releases in use</h2>");
    let summary: Vec<Value> = value["generations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| json!({"release": g["release"], "protos": g["protos"], "clients": g["clients"], "resources": g["resources"]}))
        .collect();
    super::html(&Value::Array(summary), &mut body);
    body.push_str("<h2>What the checks know</h2>");
    let known = json!({
        "releases_known": value["releases_known"],
        "rules": value["rules"],
        "resources_checked": value["resources_checked"],
    });
    super::html(&known, &mut body);
    body.push_str(positions.script());
    super::document("Version skew", &body)
}

/// The resources connected clients drop something of: the index's lead
/// line (`None` when none).
pub(super) fn lead(state: &AdminState) -> Option<String> {
    let tracked = state.skew.tracked();
    let affected: Vec<String> = tracked
        .iter()
        .filter(|t| !t.skewed.is_empty() && t.clients > 0)
        .map(|t| {
            let example = t.skewed.iter().next().and_then(|(name, s)| {
                s.dropped
                    .first()
                    .map(|d| format!("{name}: {}", d.message(t.generation)))
            });
            format!(
                "{} of {}{} for Istio {} ({} client{} of that release){}",
                t.skewed.len(),
                t.collection,
                // A canary round's new version: about to go to everyone.
                if t.canaries_only {
                    " at the canaries' version"
                } else {
                    ""
                },
                t.generation,
                t.clients,
                if t.clients == 1 { "" } else { "s" },
                example.map(|e| format!(", e.g. {e}")).unwrap_or_default()
            )
        })
        .collect();
    (!affected.is_empty()).then(|| {
        format!(
            "SKEW: connected clients drop fields their release lacks, without a NACK: {} (/debug/skew)",
            affected.join("; ")
        )
    })
}

/// Connected clients that read Istio's kinds and whose release is not known:
/// what they drop is not checked (the index's line; `None` when none).
pub(super) fn unchecked(streams: &[StreamView]) -> Option<String> {
    let unknown: Vec<String> = streams
        .iter()
        .filter(|s| s.generation == Some(ClientGeneration::Unknown))
        .map(|s| match (&*s.node_id, s.peer) {
            ("", Some(peer)) => peer.to_string(),
            ("", None) => format!("stream {}", s.id),
            (node, _) => node.to_owned(),
        })
        .collect();
    (!unknown.is_empty()).then(|| {
        format!(
            "SKEW NOT CHECKED: {} connected client{} read{} Istio's kinds without saying which Istio {} (their wire \
             does not tell): {}; name them with --client-generation GLOB=RELEASE (/debug/skew)",
            unknown.len(),
            if unknown.len() == 1 { "" } else { "s" },
            if unknown.len() == 1 { "s" } else { "" },
            if unknown.len() == 1 { "it is" } else { "they are" },
            unknown.join(", ")
        )
    })
}

pub(super) async fn skew(
    State(state): State<AdminState>,
    Query(positions): Query<super::Positions>,
    headers: HeaderMap,
) -> Response {
    // Files are read for the lines: on the blocking pool.
    match tokio::task::spawn_blocking(move || view_json(&state)).await {
        Ok(value) if super::wants_html(&headers) => axum::response::Html(view_html(&value, &positions)).into_response(),
        Ok(value) => axum::Json(value).into_response(),
        Err(e) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("the skew view failed: {e}\n"),
        )
            .into_response(),
    }
}
