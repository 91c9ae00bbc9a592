//! A collection's recent versions: `/debug/history/{collection}` lists them,
//! newest first; `/debug/diff/{collection}?from=V1&to=V2` says what changed
//! between two of them (names added, removed, changed), and with
//! `&bodies=yaml` each changed body as a unified diff of its decoded form
//! (decoded as the config dump decodes it, sensitive fields `[redacted]`;
//! a change in one of them is a line `changed (sensitive): PATH`, since a
//! diff of redacted text would not show it).
//!
//! A version is the collection's content version as clients see it
//! (`version_info`, `system_version_info`).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::versions::{self, VersionError};
use super::{time, unknown_collection, view, wants_html, AdminState};
use crate::cache::{Cache, Diff, HistoryEntry, ResourceMap};
use crate::transport::safe_text::{exact_safe, yaml_terminal_safe};

/// Lines of context around each change in a body's diff.
const CONTEXT_LINES: usize = 3;

fn entry_json(entry: &HistoryEntry, current: bool) -> Value {
    json!({
        "version": entry.version,
        "applied_at": time(entry.updated_at),
        "origin": entry.origin,
        "resources": entry.resources,
        "bytes": entry.bytes,
        "added": entry.added,
        "changed": entry.changed,
        "removed": entry.removed,
        "current": current,
    })
}

pub(super) async fn history(
    State(state): State<AdminState>,
    Path(collection): Path<String>,
    headers: HeaderMap,
) -> Response {
    let collection = collection.trim_start_matches('/');
    let Some(entries) = state.cache.history(collection) else {
        return unknown_collection(collection);
    };
    if wants_html(&headers) {
        return history_html(collection, &entries, state.cache.history_len());
    }
    let value = json!({
        "collection": collection,
        "kept": state.cache.history_len(),
        "versions": entries
            .iter()
            .enumerate()
            .map(|(at, entry)| entry_json(entry, at == 0))
            .collect::<Vec<_>>(),
    });
    view(&headers, &format!("History: {collection}"), value)
}

/// The history as a page: newest first, each version linked to its diff
/// with the one before it and with the current one.
fn history_html(collection: &str, entries: &[HistoryEntry], kept: usize) -> Response {
    use super::{diff_link, document, escape, version_html, NAVIGATION};
    let mut body = format!(
        "{NAVIGATION}<p>The last {kept} versions (--history), newest first; <a href=\"/debug/cache/{0}\">the \
         resources</a>, <a href=\"/debug/rollout/{0}\">the rollout</a>.</p>",
        super::url_part(collection)
    );
    body.push_str(
        "<table><tr><th>version</th><th>applied</th><th>origin</th><th>resources</th><th>added</th>\
         <th>changed</th><th>removed</th><th>diff</th></tr>",
    );
    let current = entries.first().map(|e| &*e.version);
    for (at, entry) in entries.iter().enumerate() {
        let mut links = Vec::new();
        if let Some(before) = entries.get(at + 1) {
            links.push(diff_link(
                collection,
                &before.version,
                &entry.version,
                "with the one before",
            ));
        }
        if let Some(current) = current.filter(|c| *c != &*entry.version) {
            links.push(diff_link(collection, &entry.version, current, "to the current"));
        }
        body.push_str(&format!(
            "<tr><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            version_html(&entry.version),
            if at == 0 { " (current)" } else { "" },
            escape(&time(entry.updated_at)),
            escape(json!(entry.origin).as_str().unwrap_or_default()),
            entry.resources,
            entry.added,
            entry.changed,
            entry.removed,
            links.join(" · "),
        ));
    }
    body.push_str("</table>");
    axum::response::Html(document(&format!("History: {collection}"), &body)).into_response()
}

#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct DiffQuery {
    from: Option<String>,
    to: Option<String>,
    bodies: Option<String>,
}

/// The version of `collection` that `given` names (the version, or a unique
/// prefix of it) and its resources, or the answer naming what is wrong.
fn version_of(
    cache: &Cache,
    collection: &str,
    flag: &str,
    given: &str,
) -> Result<(String, ResourceMap), (StatusCode, String)> {
    let refused = |e: VersionError| (e.status(), format!("{flag}={given:?}: {e}\n"));
    let version = versions::resolve_in(cache, collection, given).map_err(refused)?;
    // Gone between the two reads: another apply pushed it out.
    let resources = cache.version_resources(collection, &version).ok_or_else(|| {
        refused(VersionError::NotFound {
            collection: collection.to_owned(),
            given: given.to_owned(),
            kept: cache.history_len(),
        })
    })?;
    Ok((version, resources))
}

pub(super) async fn diff(
    State(state): State<AdminState>,
    Path(collection): Path<String>,
    Query(query): Query<DiffQuery>,
    headers: HeaderMap,
) -> Response {
    let collection = collection.trim_start_matches('/');
    let Some(current) = state.cache.get(collection) else {
        return unknown_collection(collection);
    };
    match query.bodies.as_deref() {
        None | Some("yaml") => {}
        Some(other) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("bodies={other:?}: give bodies=yaml, or leave it out for names only\n"),
            )
                .into_response()
        }
    }
    let Some(from) = query.from.as_deref() else {
        return (
            StatusCode::BAD_REQUEST,
            format!("give ?from=VERSION (and ?to=VERSION, the latest by default; see /debug/history/{collection})\n"),
        )
            .into_response();
    };
    let to = query.to.as_deref().unwrap_or(&current.version);
    let ((from, from_resources), (to_version, to_resources)) = match (
        version_of(&state.cache, collection, "from", from),
        version_of(&state.cache, collection, "to", to),
    ) {
        (Ok(from), Ok(to)) => (from, to),
        (Err(refused), _) | (_, Err(refused)) => return refused.into_response(),
    };
    let diff = Diff::between(&from_resources, &to_resources);
    let (mut added, mut changed) = (Vec::new(), Vec::new());
    for resource in &diff.upserts {
        match from_resources.get(&*resource.name) {
            None => added.push(json!(resource.name)),
            Some(old) if query.bodies.is_some() => {
                let (before, before_secrets) = body_yaml(old, collection, &state);
                let (after, after_secrets) = body_yaml(resource, collection, &state);
                let mut text = if before == after {
                    String::new()
                } else {
                    similar::TextDiff::from_lines(&before, &after)
                        .unified_diff()
                        .context_radius(CONTEXT_LINES)
                        .header(
                            &format!("{}@{from}", exact_safe(&resource.name)),
                            &format!("{}@{to_version}", exact_safe(&resource.name)),
                        )
                        .to_string()
                };
                let sensitive = changed_secrets(&before_secrets, &after_secrets);
                if !sensitive.is_empty() {
                    text.push_str(&format!("changed (sensitive): {}\n", sensitive.join(", ")));
                }
                changed.push(json!({"name": resource.name, "diff": text, "sensitive": sensitive}));
            }
            Some(_) => changed.push(json!(resource.name)),
        }
    }
    let value = json!({
        "collection": collection,
        "from": from,
        "to": to_version,
        "added": added,
        "removed": diff.removed,
        "changed": changed,
    });
    view(&headers, &format!("Diff: {collection}"), value)
}

/// A resource as the config dump shows it, in YAML, with digests of its
/// redacted fields.
fn body_yaml(
    resource: &crate::cache::CachedResource,
    collection: &str,
    state: &AdminState,
) -> (String, BTreeMap<String, u64>) {
    let (value, secrets) = super::dump::shown(resource, &state.bodies, state.table.sensitive_body_type(collection));
    let text = yaml_terminal_safe(&value).unwrap_or_else(|e| format!("# cannot write YAML: {e}\n"));
    (text, secrets)
}

/// The paths of the redacted fields that differ between two versions of a
/// body (set, cleared or changed); `the body` for one redacted whole.
fn changed_secrets(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Vec<String> {
    let mut paths: Vec<&String> = before.keys().chain(after.keys()).collect();
    paths.sort_unstable();
    paths.dedup();
    paths
        .into_iter()
        .filter(|path| before.get(*path) != after.get(*path))
        .map(|path| {
            if path.is_empty() {
                "the body".to_owned()
            } else {
                path.clone()
            }
        })
        .collect()
}
