//! Demands the source leaves unanswered: a collection only clients asked
//! for that the source neither delivers nor refuses within
//! `--demand-timeout` of when it could (the upstream connected) becomes
//! overdue (clients that wait for every type, xDS, are then answered it
//! empty), logged once and counted. Client mode (whose probe keeps asking)
//! and dial-out (which never asks) run it.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::UpstreamStatus;
use crate::cache::demand::{DemandRoute, Subscriptions};
use crate::cache::Cache;
use crate::metrics as m;

/// Marks demands overdue as `--demand-timeout` passes while the upstream is
/// connected (`status`), until `shutdown`: each is logged once (naming the
/// collection and `upstream`) and counted, unless the cache holds it anyway
/// (a persisted copy). Client mode and dial-out run it; the files source
/// answers every collection at once.
pub async fn expire_overdue(
    subscriptions: Arc<Subscriptions>,
    cache: Arc<Cache>,
    mut status: watch::Receiver<UpstreamStatus>,
    upstream: String,
    shutdown: CancellationToken,
) {
    let mut changes = subscriptions.watch();
    loop {
        if status.borrow_and_update().connected {
            subscriptions.start_clocks(Instant::now());
        }
        changes.borrow_and_update();
        for collection in subscriptions.expire(Instant::now()) {
            if cache.get(&collection).is_some() {
                continue;
            }
            metrics::counter!(m::DEMAND_TIMEOUTS, "collection" => crate::metrics::label(&collection)).increment(1);
            let timeout_seconds = subscriptions.timeout().as_secs_f64();
            match subscriptions.route() {
                DemandRoute::Hold => tracing::warn!(
                    %collection,
                    %upstream,
                    timeout_seconds,
                    "a client asked for a collection that is not in --collections; it was not requested: in \
                     dial-out mode the gateway cannot probe the source, and a source that does not serve it would \
                     end the one stream, for every collection. Clients that wait for every type (xDS) are answered \
                     empty; list it in --collections if the source serves it"
                ),
                _ => tracing::warn!(
                    %collection,
                    %upstream,
                    timeout_seconds,
                    "the source neither delivered nor refused a collection a client asked for within \
                     --demand-timeout: clients that wait for every type (xDS) are answered empty, and get its \
                     content if the source delivers it later"
                ),
            }
        }
        let deadline = subscriptions.next_deadline();
        tokio::select! {
            _ = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {}
            changed = changes.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            changed = status.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::SharedStr;
    use std::time::Duration;

    use super::*;

    const VS: &str = "istio/networking/v1alpha3/virtualservices";
    const WG: &str = "istio/networking/v1alpha3/workloadgroups";
    const TELEMETRY: &str = "istio/telemetry/v1alpha1/telemetries";

    #[tokio::test(start_paused = true)]
    async fn the_expiry_task_marks_demands_overdue_on_time() {
        let (cache, mut writer) = Cache::new();
        let subscriptions = Arc::new(Subscriptions::with_route(
            [SharedStr::from(VS)],
            DemandRoute::Hold,
            Duration::from_secs(5),
        ));
        let shutdown = CancellationToken::new();
        let (status, upstream) = watch::channel(UpstreamStatus::default());
        let task = tokio::spawn(expire_overdue(
            subscriptions.clone(),
            cache.clone(),
            upstream,
            "0.0.0.0:9901".into(),
            shutdown.clone(),
        ));
        subscriptions.request(&SharedStr::from(WG));
        // Down for a minute: nothing is overdue, whatever the time.
        tokio::time::advance(Duration::from_secs(60)).await;
        tokio::task::yield_now().await;
        assert!(!subscriptions.is_overdue(WG), "the source could not answer");
        assert_eq!(subscriptions.next_deadline(), None);

        // Up: the clock starts now.
        let up = Instant::now();
        status.send_modify(|s| s.connected = true);
        // A persisted copy: the cache holds it, so nothing waits for it.
        writer.apply(
            TELEMETRY,
            crate::cache::Update::Full(Vec::new()),
            crate::cache::Origin::Disk,
        );
        subscriptions.request(&SharedStr::from(TELEMETRY));
        while subscriptions.current().demanded.values().any(|d| d.clock.is_none()) {
            tokio::task::yield_now().await;
        }
        assert_eq!(subscriptions.next_deadline(), Some(up + Duration::from_secs(5)));
        let mut watch = subscriptions.watch();
        tokio::time::advance(Duration::from_millis(4900)).await;
        tokio::task::yield_now().await;
        assert!(!subscriptions.is_overdue(WG), "not before the timeout");
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("overdue within the timeout")
            .unwrap();
        assert!(Instant::now() >= up + Duration::from_secs(5));
        assert!(subscriptions.is_overdue(WG));
        assert!(
            subscriptions.is_overdue(TELEMETRY),
            "marked, though the cache answers it"
        );
        shutdown.cancel();
        task.await.unwrap();
    }
}
