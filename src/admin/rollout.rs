//! Rollout controls and their view: `POST /pin/{collection}?version=V`
//! serves every client that version from the history, `DELETE
//! /pin/{collection}` the latest again, `POST /promote/{collection}` sends
//! what the canaries are on to everyone; `/debug/rollout[/{collection}]`
//! shows each collection's state (PINNED, HELD, WAITING, CANARY, SERVING),
//! its canaries and what made each one (an identity and the policy's rule),
//! and the clients whose node claims they are canaries and that are not.
//!
//! A collection goes in the path as it is, slashes included; a version is
//! the whole one or a unique prefix of at least 8 characters. An unknown
//! collection or a version no longer in the history is a 404, a prefix that
//! names no single version a 400 (listing the versions it begins), a control
//! that conflicts with the collection's state a 409; each body says which.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::{unknown_collection, view, AdminState};
use crate::downstream::rollout::{ControlError, Membership, RolloutView};

#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct PinQuery {
    version: Option<String>,
}

/// A control's answer: the collection's rollout after it, or why not.
fn answer(result: Result<RolloutView, ControlError>) -> Response {
    match result {
        Ok(view) => Json(view).into_response(),
        Err(ControlError::UnknownCollection(collection)) => unknown_collection(&collection),
        Err(e) => {
            let status = if e.is_conflict() {
                StatusCode::CONFLICT
            } else {
                StatusCode::NOT_FOUND
            };
            (status, format!("{e}\n")).into_response()
        }
    }
}

pub(super) async fn pin(
    State(state): State<AdminState>,
    Path(collection): Path<String>,
    Query(query): Query<PinQuery>,
) -> Response {
    let collection = collection.trim_start_matches('/');
    let Some(version) = query.version.filter(|v| !v.trim().is_empty()) else {
        return (
            StatusCode::BAD_REQUEST,
            format!("give ?version=V, a version of GET /debug/history/{collection}\n"),
        )
            .into_response();
    };
    if state.cache.get(collection).is_none() {
        return unknown_collection(collection);
    }
    match super::versions::resolve_in(&state.cache, collection, version.trim()) {
        Ok(version) => answer(state.rollout.pin(collection, &version)),
        Err(e) => (e.status(), format!("version={version:?}: {e}\n")).into_response(),
    }
}

pub(super) async fn unpin(State(state): State<AdminState>, Path(collection): Path<String>) -> Response {
    answer(state.rollout.unpin(collection.trim_start_matches('/')))
}

pub(super) async fn promote(State(state): State<AdminState>, Path(collection): Path<String>) -> Response {
    answer(state.rollout.promote(collection.trim_start_matches('/')))
}

/// Every collection's rollout (with its canaries and the clients that
/// claim to be canaries and are not, each with why), and how rounds run.
pub(super) async fn rollouts(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let access = state.access.current();
    let views = state
        .rollout
        .views()
        .into_iter()
        .map(|v| state.rollout.explained(&access, v));
    let value = super::syncz::rollout_document(canary_policy(&state), views);
    view(&headers, "Rollout", value)
}

/// How rounds run, what makes a client a canary, and the policy's rules
/// that allow it (a reload may have taken them all away).
pub(super) fn canary_policy(state: &AdminState) -> serde_json::Value {
    let mut policy = state.rollout.policy_view();
    let rules = state.access.current().canary_rules();
    policy["access_policy_canary_rules"] = rules.into();
    if state.rollout.has_canaries() && state.rollout.membership() == Membership::Identity && rules == 0 {
        policy["warning"] = "no rule of the --access-policy in effect has canary: true: no client is a canary, and \
                             a new version waits or goes to everyone by --canary-when-none"
            .into();
    }
    policy
}

pub(super) async fn rollout(
    State(state): State<AdminState>,
    Path(collection): Path<String>,
    headers: HeaderMap,
) -> Response {
    let collection = collection.trim_start_matches('/');
    match state.rollout.view(collection) {
        Some(rollout) => view(
            &headers,
            &format!("Rollout: {collection}"),
            serde_json::to_value(state.rollout.explained(&state.access.current(), rollout)).unwrap_or_default(),
        ),
        None => unknown_collection(collection),
    }
}
