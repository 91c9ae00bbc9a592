//! The admin HTTP port: liveness, readiness (which collections are still
//! missing their first state) and the connected clients. Read-only.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};

use crate::cache::Cache;
use crate::downstream::registry::StreamView;
use crate::downstream::Registry;
use crate::upstream::Subscriptions;

#[derive(Clone)]
pub struct AdminState {
    pub cache: Arc<Cache>,
    pub subscriptions: Arc<Subscriptions>,
    pub registry: Arc<Registry>,
}

impl AdminState {
    /// Subscribed collections without a first state. A collection the source
    /// refused is not waited for: it would never arrive.
    pub fn missing(&self) -> Vec<String> {
        self.subscriptions
            .current()
            .wanted
            .iter()
            .filter(|c| self.cache.get(c).is_none())
            .map(|c| c.to_string())
            .collect()
    }
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/debug/clients", get(clients))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    let missing = state.missing();
    if missing.is_empty() {
        return (StatusCode::OK, "ready\n".into());
    }
    let mut body = format!(
        "not ready: waiting for the first state of {} collection(s):\n",
        missing.len()
    );
    for collection in missing {
        body.push_str(&collection);
        body.push('\n');
    }
    (StatusCode::SERVICE_UNAVAILABLE, body)
}

async fn clients(State(state): State<AdminState>) -> Json<Vec<StreamView>> {
    Json(state.registry.streams())
}
