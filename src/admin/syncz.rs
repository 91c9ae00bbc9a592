//! Where every client stands, per type: what `/debug/syncz`, the admin
//! index, the `status` command and `mcp_gateway_clients` show. One row per
//! client stream and type; a status each, with since when and why.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

use crate::downstream::registry::{Clock, NackRecord, Stamp, StreamView, TypeView};
use crate::downstream::rollout::{Rollout, RolloutView};
use crate::skew::{ClientGeneration, ResourceSkew, SkewTracker};
use crate::transport::access::{AccessPolicy, Grant};
use crate::SharedStr;

/// Where a client stands on one type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SyncStatus {
    /// It ACKed the current version (of its group: see `/debug/rollout`).
    Synced,
    /// A response is on its way or awaits its ACK, for less than
    /// `--stale-after` behind.
    Sent,
    /// Behind the cache's current version for longer than `--stale-after`.
    Stale,
    /// It NACKed the current version: it will not be sent again.
    Nacked,
    /// Nothing was sent yet: the source has not delivered the collection.
    NotSent,
}

impl SyncStatus {
    pub const ALL: [SyncStatus; 5] = [
        SyncStatus::Synced,
        SyncStatus::Sent,
        SyncStatus::Stale,
        SyncStatus::Nacked,
        SyncStatus::NotSent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SyncStatus::Synced => "SYNCED",
            SyncStatus::Sent => "SENT",
            SyncStatus::Stale => "STALE",
            SyncStatus::Nacked => "NACKED",
            SyncStatus::NotSent => "NOT SENT",
        }
    }

    /// How much it needs an operator: 0 first (NACKED, STALE, SENT, NOT
    /// SENT, then SYNCED).
    pub fn urgency(self) -> u8 {
        match self {
            SyncStatus::Nacked => 0,
            SyncStatus::Stale => 1,
            SyncStatus::Sent => 2,
            SyncStatus::NotSent => 3,
            SyncStatus::Synced => 4,
        }
    }

    /// As a filter names it: any case, `_` or `-` for the space.
    fn parse(text: &str) -> Option<SyncStatus> {
        let text = text.trim().to_ascii_uppercase().replace(['_', '-'], " ");
        SyncStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// The reason of a removal that waits for a drain of listeners.
const DRAINING: &str = "DRAINING";

/// Whether a NACK is past ("since fixed"): the client ACKed a later
/// response, and either the version it refused is not the one it is to get
/// now, or it has ACKed that one too (a client that routed away from a
/// broken resource ACKs the same version without it). A pin and unpin can
/// make the refused version current again: until the client ACKs it, the
/// NACK is current.
pub fn is_past(nack: &NackRecord, current: Option<&SharedStr>, acked: Option<&SharedStr>) -> bool {
    nack.superseded && (current != Some(&nack.version) || acked == current)
}

/// A client's status on one type, against its group's `current` version,
/// and since when.
pub fn status(
    view: &TypeView,
    current: Option<&SharedStr>,
    clock: &Clock,
    stale_after: Duration,
) -> (SyncStatus, Stamp) {
    let Some(sent) = &view.last_sent_version else {
        return (SyncStatus::NotSent, view.last_request_at);
    };
    // A type no source serves: what was sent (empty) is all there is.
    let current = current.unwrap_or(sent);
    // NACKED until the client ACKs a later response: a client that applies
    // the valid part of a response it rejects (Envoy, grpc) holds neither the
    // NACKed version nor the one it ACKed before, even when the cache went
    // back to that one. And the NACKed version is never sent to it again.
    if let Some(nack) = view
        .last_nack
        .as_ref()
        .filter(|n| !is_past(n, Some(current), view.acked_version.as_ref()))
    {
        return (SyncStatus::Nacked, nack.at);
    }
    if view.acked_version.as_ref() == Some(current) {
        return (SyncStatus::Synced, view.acked_at);
    }
    // Its removals wait for a listener the client drains (make before
    // break): it ACKed everything the source adds and changes, and what it
    // removes goes when the drain ends (`--listener-drain-time`).
    if view.ordered.as_ref().is_some_and(|o| o.reason == DRAINING)
        && !view.outstanding
        && view.acked_version == view.last_sent_version
    {
        return (SyncStatus::Synced, view.acked_at);
    }
    if clock.age(view.behind_since).is_some_and(|age| age > stale_after) {
        return (SyncStatus::Stale, view.behind_since);
    }
    (SyncStatus::Sent, view.last_sent_at)
}

/// What to show: `?collection=`, `?status=`, `?node=` (a part of the node
/// id), each optional.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Filter {
    pub collection: Option<String>,
    pub status: Option<String>,
    pub node: Option<String>,
}

/// One client stream's type, with its status.
pub struct Row<'a> {
    pub stream: &'a StreamView,
    pub type_url: &'a str,
    pub view: &'a TypeView,
    pub status: SyncStatus,
    pub since: Stamp,
    pub current: Option<SharedStr>,
    /// An Istio client's: what its release drops of the collection.
    pub skew: Option<RowSkew>,
}

/// What a client's release drops of a collection it reads.
pub struct RowSkew {
    pub generation: ClientGeneration,
    /// The resources it drops something of, by name: at the version the
    /// gateway serves now. `None`: not checked (its release is unknown or
    /// one the gateway has no protos of, the collection is not one of
    /// Istio's kinds, or the first check has not run yet).
    pub dropping: Option<Vec<(SharedStr, Arc<ResourceSkew>)>>,
}

/// Where the views look up what a client's release drops.
pub struct SkewLookup<'a> {
    pub tracker: &'a SkewTracker,
    /// A client that may read part of a collection drops only of its part.
    pub policy: &'a AccessPolicy,
}

impl SkewLookup<'_> {
    /// At `served`, the version its group is served: what it holds once
    /// SYNCED.
    fn of(&self, stream: &StreamView, view: &TypeView, served: Option<&str>) -> Option<RowSkew> {
        let generation = stream.generation?;
        let tracked = generation
            .generation()
            .and_then(|g| self.tracker.get(&view.collection, g, Some(served?)))
            .filter(|t| t.checked);
        let dropping = tracked.map(|tracked| {
            // A named subscription (listed whole) drops only of its names; a
            // client granted some names, only of those.
            let named = view
                .subscribed
                .as_ref()
                .filter(|s| !s.wildcard && s.count <= s.first.len());
            let grant = view.access_version.as_ref().and_then(|_| {
                self.policy
                    .explain(&stream.identity, &[(view.collection.clone(), false)])
                    .into_values()
                    .next()
                    .flatten()
            });
            tracked
                .skewed
                .into_iter()
                .filter(|(name, _)| named.is_none_or(|n| n.first.iter().any(|f| f == name)))
                .filter(|(name, _)| match &grant {
                    Some(Grant::Names(names)) => names.allows(name),
                    _ => true,
                })
                .collect()
        });
        Some(RowSkew { generation, dropping })
    }
}

/// What each group of each collection is served, read from the rollout
/// once per collection and group in a pass over the clients. Found by the
/// collection's name: its key is taken once, when first read, not for
/// every client's type (a scrape reads every connected stream's).
#[derive(Default)]
pub struct Served(BTreeMap<SharedStr, [Option<Option<SharedStr>>; 2]>);

impl Served {
    fn of(&mut self, rollout: &Rollout, collection: &SharedStr, canary: bool) -> Option<SharedStr> {
        let groups = match self.0.get_mut(collection.as_str()) {
            Some(groups) => groups,
            None => self.0.entry(collection.clone()).or_default(),
        };
        groups[usize::from(canary)]
            .get_or_insert_with(|| rollout.served_version(collection, canary))
            .clone()
    }
}

/// A stream's type as the views show it: the version its group is served,
/// the version it is current at (a client that may read part of the
/// collection is current at the version of its part), its status and since
/// when.
pub struct TypeStatus {
    pub served: Option<SharedStr>,
    pub current: Option<SharedStr>,
    pub status: SyncStatus,
    pub since: Stamp,
}

impl TypeStatus {
    pub fn of(
        stream: &StreamView,
        view: &TypeView,
        served: &mut Served,
        rollout: &Rollout,
        clock: &Clock,
        stale_after: Duration,
    ) -> Self {
        let served = served.of(rollout, &view.collection, stream.canary);
        let current = view.access_version.clone().or_else(|| served.clone());
        let (status, since) = status(view, current.as_ref(), clock, stale_after);
        TypeStatus {
            served,
            current,
            status,
            since,
        }
    }

    /// The client holds another version than the one it is current at.
    pub fn behind(&self, view: &TypeView) -> bool {
        self.current.is_some() && view.acked_version != self.current
    }
}

/// Every client stream's types with their status, by stream then type. A
/// client's current version is the one its group is served (canaries get
/// new versions first; a pin serves an older one).
pub fn rows<'a>(
    streams: &'a [StreamView],
    rollout: &Rollout,
    skew: Option<&SkewLookup<'_>>,
    clock: &Clock,
    stale_after: Duration,
) -> Vec<Row<'a>> {
    let mut served = Served::default();
    let mut rows = Vec::new();
    for stream in streams {
        for (type_url, view) in &stream.types {
            let found = TypeStatus::of(stream, view, &mut served, rollout, clock, stale_after);
            rows.push(Row {
                stream,
                type_url,
                view,
                status: found.status,
                since: found.since,
                skew: skew.and_then(|s| s.of(stream, view, found.served.as_deref())),
                current: found.current,
            });
        }
    }
    rows
}

fn time(t: Option<SystemTime>) -> Value {
    t.map_or(Value::Null, |t| json!(humantime::format_rfc3339_millis(t).to_string()))
}

fn seconds(age: Option<Duration>) -> Value {
    age.map_or(Value::Null, |a| json!((a.as_secs_f64() * 10.0).round() / 10.0))
}

/// The view: a summary of counts per status (and per collection and
/// status), then the rows that pass `filter`.
pub fn view(rows: &[Row<'_>], clock: &Clock, filter: &Filter) -> Result<Value, String> {
    let shown: Vec<Value> = filtered(rows, filter)?
        .into_iter()
        .map(|r| row_json(r, clock))
        .collect();
    Ok(json!({
        "summary": summary(rows),
        "rows": shown,
    }))
}

/// The rows that pass `filter`, or why the filter is wrong.
pub fn filtered<'r, 'a>(rows: &'r [Row<'a>], filter: &Filter) -> Result<Vec<&'r Row<'a>>, String> {
    let wanted_status = match &filter.status {
        Some(text) => Some(SyncStatus::parse(text).ok_or_else(|| {
            format!(
                "status {text:?} is none of {}",
                SyncStatus::ALL.map(SyncStatus::as_str).join(", ")
            )
        })?),
        None => None,
    };
    Ok(rows
        .iter()
        .filter(|r| filter.collection.as_ref().is_none_or(|c| **c == *r.view.collection))
        .filter(|r| wanted_status.is_none_or(|s| s == r.status))
        .filter(|r| {
            filter
                .node
                .as_ref()
                .is_none_or(|n| r.stream.node_id.contains(n.as_str()))
        })
        .collect())
}

/// The shape's version in [`rollout_document`]: 2 since `/debug/syncz`'s
/// `rollout` (and so `status -o json`'s) was a bare list of collections.
pub const ROLLOUT_API_VERSION: u64 = 2;

/// The one JSON shape of a rollout, wherever it is shown (`/debug/rollout`,
/// `/debug/syncz`'s `rollout`, `status -o json`, `rollout status -o json`):
/// `{api_version, canaries: how rounds run, collections: [each shown]}`.
pub fn rollout_document(canaries: Value, collections: impl IntoIterator<Item = RolloutView>) -> Value {
    let collections: Vec<Value> = collections
        .into_iter()
        .map(|v| serde_json::to_value(v).unwrap_or_default())
        .collect();
    json!({
        "api_version": ROLLOUT_API_VERSION,
        "canaries": canaries,
        "collections": collections,
    })
}

/// The collections whose rollout needs an operator's eye: pinned, held,
/// in a canary round, or with a warning.
/// `canaries`: how rounds run (`/debug/rollout`'s).
pub fn rollouts(rollout: &Rollout, access: &AccessPolicy, canaries: Value, filter: &Filter) -> Value {
    let shown = rollout
        .views()
        .into_iter()
        .map(|v| rollout.explained(access, v))
        .filter(|v| v.state != "SERVING" || v.warning.is_some())
        .filter(|v| filter.collection.as_ref().is_none_or(|c| **c == *v.collection));
    rollout_document(canaries, shown)
}

/// Counts of client streams' types per status, and per collection and
/// status.
pub fn summary(rows: &[Row<'_>]) -> Value {
    let mut totals: BTreeMap<&str, usize> = SyncStatus::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    let mut by_collection: BTreeMap<&str, BTreeMap<&str, usize>> = BTreeMap::new();
    for row in rows {
        *totals.entry(row.status.as_str()).or_default() += 1;
        *by_collection
            .entry(&row.view.collection)
            .or_default()
            .entry(row.status.as_str())
            .or_default() += 1;
    }
    json!({"clients": totals, "by_collection": by_collection})
}

/// A row in brief (the admin index): who, what, where it stands, since
/// when, and why.
pub fn brief_json(row: &Row<'_>, clock: &Clock) -> Value {
    json!({
        "node_id": row.stream.node_id,
        "peer": row.stream.peer.map(|p| p.to_string()),
        "protocol": row.stream.protocol.as_str(),
        "collection": row.view.collection,
        "status": row.status.as_str(),
        "for_seconds": seconds(clock.age(row.since)),
        "since": time(clock.wall(row.since)),
        "sent_version": row.view.last_sent_version,
        "acked_version": row.view.acked_version,
        "current_version": row.current,
        // A NACK the client has since ACKed past is in /debug/syncz.
        "nack": row.view.last_nack.as_ref().filter(|n| !is_past(n, row.current.as_ref(), row.view.acked_version.as_ref())).map(|n| n.message.clone()),
    })
}

fn row_json(row: &Row<'_>, clock: &Clock) -> Value {
    let view = row.view;
    let stream = row.stream;
    json!({
        "stream": stream.id,
        "node_id": stream.node_id,
        "peer": stream.peer.map(|p| p.to_string()),
        "protocol": stream.protocol.as_str(),
        "gateway_id": stream.gateway_id,
        "identity": stream.identity,
        "canary": stream.canary,
        "connected_since": time(Some(stream.connected_since)),
        "type_url": row.type_url,
        "collection": view.collection,
        "status": row.status.as_str(),
        "since": time(clock.wall(row.since)),
        "for_seconds": seconds(clock.age(row.since)),
        "current_version": row.current,
        "last_request": time(clock.wall(view.last_request_at)),
        "sent": view.last_sent_version.as_ref().map(|v| json!({
            "version": v,
            "nonce": view.last_sent_nonce,
            "at": time(clock.wall(view.last_sent_at)),
            "awaiting_ack": view.outstanding,
        })),
        "acked": view.acked_version.as_ref().map(|v| json!({
            "version": v,
            "at": time(clock.wall(view.acked_at)),
        })),
        "nack": view.last_nack.as_ref().map(|n| json!({
            "version": n.version,
            "code": crate::metrics::code_label(n.code),
            "message": n.message,
            "at": time(clock.wall(n.at)),
            "age_seconds": seconds(clock.age(n.at)),
            "superseded": is_past(n, row.current.as_ref(), view.acked_version.as_ref()),
        })),
        "behind_since": time(clock.wall(view.behind_since)),
        // Under --access-policy: resources it asks for that it may not read.
        "access": (view.withheld > 0).then(|| json!({"status": "DENIED", "withheld": view.withheld})),
        // On an Envoy stream: a change held for another type (make before
        // break); NACKED holds until the source changes that type.
        "order": view.ordered.as_ref().map(|o| {
            let mut order = json!({
                "status": if o.reason == DRAINING { DRAINING } else { "HELD" },
                "waits_for": o.waits_for,
                "reason": o.reason,
                "step": o.step,
            });
            if o.reason == DRAINING {
                order["until"] = time(clock.wall(o.until));
            }
            order
        }),
        "skew": row.skew.as_ref().map(skew_json),
    })
}

/// An Istio client's release and what it drops of the collection: each
/// resource with the paths (`/debug/skew` has the files and lines).
pub fn skew_json(skew: &RowSkew) -> Value {
    let mut value = serde_json::to_value(skew.generation).unwrap_or_default();
    match (&skew.dropping, skew.generation.generation()) {
        (Some(dropping), Some(generation)) => {
            value["resources"] = json!(dropping.len());
            value["dropped"] = dropping
                .iter()
                .map(|(name, found)| {
                    json!({
                        "name": name,
                        "fields": found.dropped.iter().map(|d| d.message(generation)).collect::<Vec<_>>(),
                        "more": found.more,
                    })
                })
                .collect();
        }
        _ => value["resources"] = Value::Null,
    }
    value
}

/// What is wrong with the source while clients are still served from its
/// last good state (so `/readyz` stays ready and gRPC health SERVING): files
/// that do not parse, an upstream that is disconnected, collections clients
/// asked for that the source did not deliver (`not_delivered`). One line
/// each, `SOURCE: …`; none when the source is healthy. The index, `status`
/// and `/debug/syncz` lead with them.
pub fn source_problems(upstream: &crate::source::UpstreamStatus, not_delivered: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let error = upstream.last_error.as_deref().unwrap_or("no error recorded");
    if upstream.broken_files > 0 {
        let files = match upstream.broken_files {
            1 => "1 file does not parse".to_owned(),
            n => format!("{n} files do not parse"),
        };
        // Before anything was published the error already says so.
        match error.strip_prefix("nothing served until every file parses: ") {
            Some(errors) => problems.push(format!(
                "SOURCE: {files}, nothing is served until every file parses: {errors}"
            )),
            None => problems.push(format!("SOURCE: {files}, serving their last good state: {error}")),
        }
    }
    if matches!(upstream.mode, "client" | "sink") && !upstream.connected {
        let since = upstream
            .since
            .map(|t| format!(" since {}", humantime::format_rfc3339_seconds(t)))
            .unwrap_or_default();
        problems.push(format!(
            "SOURCE: the upstream {} is disconnected{since}, serving its last state: {error}",
            upstream.address
        ));
    }
    let overdue: Vec<&str> = not_delivered
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["collection"].as_str())
        .collect();
    if !overdue.is_empty() {
        problems.push(format!(
            "SOURCE: {} asked for by clients, neither delivered nor refused by the source within --demand-timeout \
             (clients that wait for every type were answered empty)",
            overdue.join(", ")
        ));
    }
    problems
}

/// `source_problems` as `/debug/syncz` and the index's JSON carry them.
pub fn source_json(problems: &[String]) -> Value {
    json!({"healthy": problems.is_empty(), "problems": problems})
}

// === HTML ===

/// `rows`, the ones that need an operator first (NACKED, STALE, SENT, NOT
/// SENT, SYNCED), then by collection and node id.
pub fn problems_first<'r, 'a>(rows: impl IntoIterator<Item = &'r Row<'a>>) -> Vec<&'r Row<'a>>
where
    'a: 'r,
{
    let mut rows: Vec<&Row<'a>> = rows.into_iter().collect();
    rows.sort_by(|a, b| {
        (a.status.urgency(), &a.view.collection, &a.stream.node_id, a.stream.id).cmp(&(
            b.status.urgency(),
            &b.view.collection,
            &b.stream.node_id,
            b.stream.id,
        ))
    });
    rows
}

/// Seconds as `12s`, `5m 3s`, `2h 4m`.
fn age(age: Option<Duration>) -> String {
    age.map_or_else(String::new, |a| {
        humantime::format_duration(Duration::from_secs(a.as_secs())).to_string()
    })
}

/// `rows` as one table, in the order given: what an operator reads first
/// (status, collection, node, NACK) leftmost, so it fits 1,400 px with
/// long node ids and collection names; the rest after. Collections link to
/// their history, and to the diff between what the client holds and what it
/// is to get.
pub fn rows_html(rows: &[&Row<'_>], clock: &Clock, out: &mut String) {
    use super::{collection_html, diff_link, escape, version_html};
    out.push_str(
        "<table class=\"sync\"><tr><th>status</th><th>for</th><th>collection</th><th>node</th><th>NACK</th>\
         <th>identity</th><th>sent</th><th>ACKed</th><th>current</th><th>protocol</th><th>peer</th></tr>",
    );
    let version = |v: Option<&SharedStr>| v.map_or_else(String::new, |v| version_html(v));
    for row in rows {
        let (stream, view) = (row.stream, row.view);
        let status = row.status.as_str();
        // What its release drops: beside the status, which stays SYNCED.
        let skew = match row
            .skew
            .as_ref()
            .and_then(|s| Some((s.dropping.as_ref()?, s.generation.generation()?)))
        {
            Some((dropping, generation)) if !dropping.is_empty() => format!(
                " <a class=\"skew\" href=\"/debug/skew\" title=\"{}\">SKEW {} (Istio {generation})</a>",
                escape(
                    &dropping
                        .iter()
                        .flat_map(|(_, s)| s.dropped.iter().map(move |d| d.message(generation)))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
                dropping.len()
            ),
            _ => String::new(),
        };
        // Names it may not read (DENIED), a change held for another type
        // (HELD): beside the status too, as `status` prints them.
        let denied = match view.withheld {
            0 => String::new(),
            n => format!(
                " <a class=\"NACKED\" href=\"/debug/access?identity={}\" title=\"names it asks for that its \
                 identity may not read\">DENIED {n}</a>",
                super::url_part(&stream.identity)
            ),
        };
        let held = match &view.ordered {
            Some(order) if order.reason == DRAINING => format!(
                " <span title=\"{}\">DRAINING</span>",
                escape(&format!(
                    "its removals wait for a listener the client drains, until {}",
                    clock.wall(order.until).map(super::time).unwrap_or_default()
                ))
            ),
            Some(order) => format!(
                " <span class=\"STALE\" title=\"{}\">HELD</span>",
                escape(&format!(
                    "its {} waits for the {} ({})",
                    if order.step == "remove" { "removals" } else { "change" },
                    order.waits_for,
                    order.reason
                ))
            ),
            None => String::new(),
        };
        out.push_str(&format!(
            "<tr><td data-col=\"status\"><span class=\"{}\">{status}</span>{denied}{held}{skew}</td>\
             <td class=\"nowrap\">{}</td>",
            status.replace(' ', "_"),
            age(clock.age(row.since)),
        ));
        // What the client holds against what it refused or is to get.
        let target = match &view.last_nack {
            Some(nack) if row.status == SyncStatus::Nacked => Some(&nack.version),
            _ => row.current.as_ref(),
        };
        let diff = match (&view.acked_version, target) {
            (Some(from), Some(to)) if from != to => format!(" ({})", diff_link(&view.collection, from, to, "diff")),
            _ => String::new(),
        };
        out.push_str(&format!(
            "<td class=\"nowrap\">{}{diff}</td>",
            collection_html(&view.collection)
        ));
        let node = if stream.node_id.is_empty() {
            "(no node id)"
        } else {
            &stream.node_id
        };
        out.push_str(&format!(
            "<td><span class=\"node\" data-col=\"node\" title=\"{0}\">{0}</span>{1}</td>",
            escape(node),
            if stream.canary { " (canary)" } else { "" }
        ));
        out.push_str("<td data-col=\"nack\">");
        if let Some(nack) = &view.last_nack {
            let past = is_past(nack, row.current.as_ref(), view.acked_version.as_ref());
            let when = if past {
                format!("NACKed {} ago, since fixed", age(clock.age(nack.at)))
            } else {
                format!("{} ago", age(clock.age(nack.at)))
            };
            out.push_str(&format!(
                "<div class=\"message{}\">{}: {} <span class=\"nowrap\">({}, {})</span></div>",
                if past { " past" } else { "" },
                crate::metrics::code_label(nack.code),
                escape(&nack.message),
                version_html(&nack.version),
                escape(&when),
            ));
        }
        out.push_str("</td>");
        out.push_str(&format!(
            "<td><span class=\"node\" data-col=\"identity\" title=\"{0}\">{0}</span></td>",
            escape(&stream.identity)
        ));
        out.push_str(&format!(
            "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"nowrap\">{}</td></tr>",
            version(view.last_sent_version.as_ref()),
            version(view.acked_version.as_ref()),
            version(row.current.as_ref()),
            stream.protocol.as_str(),
            stream.peer.map(|p| p.to_string()).unwrap_or_default(),
        ));
    }
    out.push_str("</table>");
}

/// The counts per status on one line: `1 NACKED · 0 STALE · ...`.
pub fn counts_html(rows: &[Row<'_>]) -> String {
    let mut counts: BTreeMap<SyncStatus, usize> = SyncStatus::ALL.iter().map(|s| (*s, 0)).collect();
    for row in rows {
        *counts.entry(row.status).or_default() += 1;
    }
    let mut by_urgency: Vec<(SyncStatus, usize)> = counts.into_iter().collect();
    by_urgency.sort_by_key(|(s, _)| s.urgency());
    let parts: Vec<String> = by_urgency
        .iter()
        .map(|(status, count)| format!("{count} {}", status.as_str()))
        .collect();
    format!("<p>client streams' types: {}</p>", parts.join(" · "))
}

/// Counts per (status, collection) for `mcp_gateway_clients`: every status
/// of every collection it is made with (zero where none), and of any other
/// collection a client follows.
pub struct StatusCounts(BTreeMap<(SyncStatus, SharedStr), usize>);

impl StatusCounts {
    pub fn new(collections: impl IntoIterator<Item = SharedStr>) -> Self {
        let mut counts = BTreeMap::new();
        for collection in collections {
            for status in SyncStatus::ALL {
                counts.insert((status, collection.clone()), 0);
            }
        }
        StatusCounts(counts)
    }

    pub fn add(&mut self, status: SyncStatus, collection: &SharedStr) {
        *self.0.entry((status, collection.clone())).or_default() += 1;
    }

    pub fn into_map(self) -> BTreeMap<(SyncStatus, SharedStr), usize> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collections::{Dialect, Resolved};
    use crate::downstream::registry::NackRecord;

    #[tokio::test(start_paused = true)]
    async fn statuses_follow_the_current_version_and_the_clock() {
        let clock = Clock::default();
        let stale = Duration::from_secs(30);
        let current: SharedStr = SharedStr::from("v2");
        let mut view = TypeView::new(Resolved {
            collection: "c".into(),
            dialect: Dialect::V1_1,
        });
        view.last_request_at = clock.now();
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::NotSent);

        tokio::time::advance(Duration::from_secs(1)).await;
        view.last_sent_version = Some(current.clone());
        view.last_sent_at = clock.now();
        view.outstanding = true;
        view.behind_since = clock.now();
        let (s, since) = status(&view, Some(&current), &clock, stale);
        assert_eq!((s, since), (SyncStatus::Sent, view.last_sent_at));

        // Behind for longer than --stale-after: stale, since it fell behind.
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::Stale);
        assert_eq!(clock.age(view.behind_since), Some(Duration::from_secs(31)));

        view.last_nack = Some(Box::new(NackRecord {
            version: current.clone(),
            code: 3,
            message: "bad".into(),
            at: clock.now(),
            superseded: false,
        }));
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::Nacked);
        // A NACK of another version, not ACKed past: NACKED, though the
        // client ACKed the current version before it.
        view.last_nack.as_mut().unwrap().version = "other".into();
        view.acked_version = Some(current.clone());
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::Nacked);
        // Once it ACKed a later response, the NACK is past.
        view.last_nack.as_mut().unwrap().superseded = true;
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::Synced);

        view.last_nack = None;
        view.acked_version = Some(current.clone());
        view.acked_at = clock.now();
        assert_eq!(status(&view, Some(&current), &clock, stale).0, SyncStatus::Synced);
        // A type no source serves: what was sent is current.
        assert_eq!(status(&view, None, &clock, stale).0, SyncStatus::Synced);
    }

    #[test]
    fn status_filters_read_any_spelling() {
        assert_eq!(SyncStatus::parse("not_sent"), Some(SyncStatus::NotSent));
        assert_eq!(SyncStatus::parse("Not Sent"), Some(SyncStatus::NotSent));
        assert_eq!(SyncStatus::parse("stale"), Some(SyncStatus::Stale));
        assert_eq!(SyncStatus::parse("late"), None);
    }
}
