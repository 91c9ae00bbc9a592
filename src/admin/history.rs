//! A collection's recent versions: `/debug/history/{collection}` lists them,
//! newest first; `/debug/diff/{collection}?from=V1&to=V2` says what changed
//! between two of them (names added, removed, changed), and with
//! `&bodies=yaml` each changed body as a unified diff of its decoded form
//! (decoded as the config dump decodes it).
//!
//! A version is the collection's content version as clients see it
//! (`version_info`, `system_version_info`).

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{time, unknown_collection, view, AdminState};
use crate::cache::{Cache, Diff, HistoryEntry, ResourceMap};

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

#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct DiffQuery {
    from: Option<String>,
    to: Option<String>,
    bodies: Option<String>,
}

/// Version `version` of `collection` from the history, or the 404's
/// message naming what is missing.
fn version_of(cache: &Cache, collection: &str, flag: &str, version: &str) -> Result<ResourceMap, String> {
    cache.version_resources(collection, version).ok_or_else(|| {
        format!(
            "{flag}={version:?}: version {version:?} of {collection:?} is not in the history (it keeps the last \
             --history={} versions; see /debug/history/{collection})\n",
            cache.history_len()
        )
    })
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
    let to_version = query.to.as_deref().unwrap_or(&current.version);
    let (from_resources, to_resources) = match (
        version_of(&state.cache, collection, "from", from),
        version_of(&state.cache, collection, "to", to_version),
    ) {
        (Ok(from), Ok(to)) => (from, to),
        (Err(missing), _) | (_, Err(missing)) => return (StatusCode::NOT_FOUND, missing).into_response(),
    };
    let diff = Diff::between(&from_resources, &to_resources);
    let (mut added, mut changed) = (Vec::new(), Vec::new());
    for resource in &diff.upserts {
        match from_resources.get(&*resource.name) {
            None => added.push(json!(resource.name)),
            Some(old) if query.bodies.is_some() => {
                let before = body_yaml(old, &state);
                let after = body_yaml(resource, &state);
                let text = similar::TextDiff::from_lines(&before, &after)
                    .unified_diff()
                    .context_radius(CONTEXT_LINES)
                    .header(
                        &format!("{}@{from}", resource.name),
                        &format!("{}@{to_version}", resource.name),
                    )
                    .to_string();
                changed.push(json!({"name": resource.name, "diff": text}));
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

/// A resource as the config dump shows it, in YAML.
fn body_yaml(resource: &crate::cache::CachedResource, state: &AdminState) -> String {
    let value = super::dump::resource(resource, &state.bodies);
    serde_norway::to_string(&value).unwrap_or_else(|e| format!("# cannot write YAML: {e}\n"))
}
