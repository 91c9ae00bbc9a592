//! `mcp-xds-gateway status`: every client's sync status as a terminal table,
//! the way `istioctl proxy-status` shows proxies: one line per client
//! stream, a column per collection (`-o wide`: a line per stream and type,
//! with its versions), or `/debug/syncz` as JSON or YAML. It reads the admin
//! port's `/debug/syncz`, and exits 0 only when every client shown is
//! SYNCED and the source is healthy, so scripts can act on it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use anyhow::Context;
use clap::{Args as ClapArgs, ValueEnum};
use http_body_util::BodyExt;
use serde_json::Value;

use super::terminal_safe;

/// Flags of `mcp-xds-gateway status`.
#[derive(Debug, ClapArgs)]
pub struct StatusArgs {
    /// The gateway's admin port: HOST:PORT or http://HOST:PORT.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:15000", value_parser = admin_url())]
    pub admin: String,

    /// Only clients of this collection.
    #[arg(long)]
    pub collection: Option<String>,

    /// Only clients with this status on some collection (SYNCED, SENT, STALE,
    /// NACKED, NOT_SENT).
    #[arg(long)]
    pub status: Option<String>,

    /// Only clients whose node id contains this.
    #[arg(long)]
    pub node: Option<String>,

    /// table: a line per client stream; wide: a line per stream and type,
    /// with the sent, ACKed and current versions; json or yaml: /debug/syncz.
    #[arg(long, short = 'o', value_enum, default_value_t = StatusOutput::Table)]
    pub output: StatusOutput,
}

/// How `status` and `rollout status` print.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum StatusOutput {
    /// A line per client stream, a column per collection.
    #[default]
    Table,
    /// A line per client stream and type, with its sent, ACKed and current
    /// versions (12 hex).
    Wide,
    /// The admin port's document as JSON.
    Json,
    /// The same as YAML.
    Yaml,
}

/// The admin port cannot be read, or is not the gateway's: the tools exit 2
/// (1 is for what the gateway says).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AdminUnreadable(pub String);

/// GET `path`, a view every gateway's admin port serves: any failure means
/// the port is not one, or cannot be read, and says which and what to give.
pub(crate) async fn read_admin(authority: &str, path: &str) -> Result<Value, AdminUnreadable> {
    let value = get(authority, path).await.map_err(|e| {
        let error = format!("{e:#}");
        let hint = if error.contains("cannot connect") {
            "is the gateway running, and is --admin its --admin-listen (127.0.0.1:15000 by default)?"
        } else if error.contains("400 Bad Request") {
            "the gateway refused the request: check the filter flags"
        } else if error.contains("404") {
            "it answers HTTP without the gateway's views: not the gateway's admin port (the monitoring port, \
             15014 by default, serves only /metrics, /healthz and /readyz); give --admin the --admin-listen \
             address (127.0.0.1:15000 by default)"
        } else if ["closed the connection", "handshake", "the admin connection"]
            .iter()
            .any(|e| error.contains(e))
        {
            "it does not answer HTTP/1.1: not the gateway's admin port (the gRPC port, 15010 by default, speaks \
             HTTP/2 only); give --admin the --admin-listen address (127.0.0.1:15000 by default)"
        } else {
            "give --admin the gateway's --admin-listen address (127.0.0.1:15000 by default)"
        };
        AdminUnreadable(format!("cannot read the admin port {authority}: {error}; {hint}"))
    })?;
    if !value.is_object() {
        return Err(AdminUnreadable(format!(
            "{authority}{path} answered JSON that is not the gateway's: not its admin port"
        )));
    }
    Ok(value)
}

/// `--admin` checked when the arguments are parsed, so a bad one is a
/// usage error (exit 2) that names the flag.
pub(crate) fn admin_url() -> AdminUrl {
    AdminUrl
}

/// [`admin_url`]'s parser: its refusal says what is wrong without quoting
/// the value (clap's own `invalid value '…'` would, and a value with user
/// info holds a password).
#[derive(Clone)]
pub(crate) struct AdminUrl;

impl clap::builder::TypedValueParser for AdminUrl {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        let refused =
            |why: String| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{why}\n")).with_cmd(cmd);
        let admin = value
            .to_str()
            .ok_or_else(|| refused("--admin: not UTF-8; give HOST:PORT or http://HOST:PORT".to_owned()))?;
        authority(admin)
            .map(|_| admin.to_owned())
            .map_err(|e| refused(e.to_string()))
    }
}

/// The admin address as HOST:PORT.
pub(crate) fn authority(admin: &str) -> anyhow::Result<String> {
    // Nothing of the value is quoted back: what an operator typed there may
    // be a password.
    if admin.starts_with("https://") {
        anyhow::bail!(
            "--admin: the admin port speaks plain HTTP (it listens on loopback by default); give http://HOST:PORT"
        );
    }
    let rest = admin.strip_prefix("http://").unwrap_or(admin).trim_end_matches('/');
    if rest.contains('@') {
        anyhow::bail!("--admin: the address holds user info (USER:PASSWORD@), which the admin port never asks for; give HOST:PORT or http://HOST:PORT");
    }
    let host_and_port = rest.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.[]:".contains(&b))
            && port.parse::<u16>().is_ok()
    });
    if !host_and_port {
        anyhow::bail!("--admin: give HOST:PORT or http://HOST:PORT (a host, a port, and nothing after them)");
    }
    Ok(rest.to_owned())
}

/// What a path segment or a query value keeps as it is (a collection's
/// slashes included); everything else is percent-encoded.
const URL_KEEPS: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b'/');

/// A percent-encoded path or query value.
pub(crate) fn encode(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, URL_KEEPS).to_string()
}

/// GET `path` from the admin port, as JSON.
async fn get(authority: &str, path: &str) -> anyhow::Result<Value> {
    call(authority, hyper::Method::GET, path).await
}

/// `method` on `path` of the admin port; the answer as JSON, or the error
/// its body gives.
/// How long `status` and `rollout` wait for the admin port, from the
/// connect to the answer's last byte: a port that accepts and says nothing
/// (not the admin port, a stuck proxy) ends the command, exit 2.
pub(crate) const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub(crate) async fn call(authority: &str, method: hyper::Method, path: &str) -> anyhow::Result<Value> {
    tokio::time::timeout(ADMIN_TIMEOUT, call_unbounded(authority, method.clone(), path))
        .await
        .unwrap_or_else(|_| {
            Err(anyhow::anyhow!(
                "{method} {path}: the admin port at {authority} did not answer within {}s (a port that accepts \
                 and says nothing is not the gateway's admin port, --admin-listen)",
                ADMIN_TIMEOUT.as_secs()
            ))
        })
}

async fn call_unbounded(authority: &str, method: hyper::Method, path: &str) -> anyhow::Result<Value> {
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .with_context(|| format!("cannot connect to the admin port at {authority}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .context("HTTP handshake with the admin port")?;
    // The connection is driven here, beside the request: no task outlives it.
    let request = hyper::Request::builder()
        .method(method.clone())
        .uri(path)
        .header(hyper::header::HOST, authority)
        .header(hyper::header::ACCEPT, "application/json")
        .body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let exchange = async {
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, body))
    };
    let (status, body) = tokio::select! {
        result = exchange => result.with_context(|| format!("{method} {path}"))?,
        result = connection => {
            result.context("the admin connection")?;
            anyhow::bail!("the admin port closed the connection before answering");
        }
    };
    if !status.is_success() {
        anyhow::bail!("{method} {path}: {status}: {}", String::from_utf8_lossy(&body).trim());
    }
    serde_json::from_slice(&body).with_context(|| format!("{path} is not JSON"))
}

/// A client's message on one line of the table: its line breaks shown as
/// `\n`, trailing ones dropped.
fn one_line(message: &str) -> String {
    terminal_safe(message.trim_end()).into_owned()
}

/// The status table of a `/debug/syncz` view.
pub fn render(syncz: &Value) -> String {
    render_table(syncz, false)
}

/// The status table; `wide`: a line per stream and type, with the versions
/// sent, ACKed and current (12 hex).
pub fn render_table(syncz: &Value, wide: bool) -> String {
    let rows = syncz["rows"].as_array().cloned().unwrap_or_default();
    // Every text a client or the source wrote, escaped for the terminal.
    let text = |v: &Value| terminal_safe(v.as_str().unwrap_or("")).into_owned();
    // Columns: each collection by its last segment (the whole name when two
    // share one).
    let collections: BTreeSet<String> = rows.iter().map(|r| text(&r["collection"])).collect();
    let short = |c: &str| -> String {
        let last = c.rsplit('/').next().unwrap_or(c);
        let shared = collections
            .iter()
            .filter(|o| o.rsplit('/').next() == Some(last))
            .count();
        if shared > 1 {
            c.to_owned()
        } else {
            last.to_owned()
        }
    };
    // One line per stream: those with a type that needs an operator first
    // (NACKED, STALE, SENT, NOT SENT), then in stream order.
    let mut streams: BTreeMap<u64, (Vec<String>, BTreeMap<String, String>)> = BTreeMap::new();
    let mut urgency: BTreeMap<u64, usize> = BTreeMap::new();
    let mut nacks = Vec::new();
    let mut denials = Vec::new();
    let mut holds = Vec::new();
    let mut skews = Vec::new();
    for row in &rows {
        let id = row["stream"].as_u64().unwrap_or_default();
        let rank = STATUSES
            .iter()
            .position(|s| row["status"] == *s)
            .unwrap_or(STATUSES.len());
        let worst = urgency.entry(id).or_insert(rank);
        *worst = (*worst).min(rank);
        let peer = terminal_safe(row["peer"].as_str().unwrap_or("-")).into_owned();
        let node = match text(&row["node_id"]) {
            n if n.is_empty() => "(no node id)".to_owned(),
            n => n,
        };
        let node = match row["canary"].as_bool() {
            Some(true) => format!("{node} (canary)"),
            _ => node,
        };
        let (_, cells) = streams.entry(id).or_insert_with(|| {
            (
                vec![node.clone(), peer.clone(), text(&row["protocol"])],
                BTreeMap::new(),
            )
        });
        let status = text(&row["status"]);
        let mut cell = match (status.as_str(), row["for_seconds"].as_f64()) {
            ("SYNCED", _) | (_, None) => status.clone(),
            (_, Some(age)) => format!("{status} {}", human(age)),
        };
        // Under --access-policy: names it asks for that it may not read.
        if let Some(withheld) = row["access"]["withheld"].as_u64() {
            cell.push_str(&format!(" DENIED {withheld}"));
            let identity = text(&row["identity"]);
            denials.push(format!(
                "{node} {}: {withheld} withheld from identity {identity} (/debug/access?identity={})",
                text(&row["collection"]),
                encode(&identity),
            ));
        }
        // On an Envoy stream: a change held for another type (make before
        // break).
        if row["order"]["reason"] == "DRAINING" {
            cell.push_str(" DRAINING");
            holds.push(format!(
                "DRAINING {node} {}: its removals wait for a listener the client drains (--listener-drain-time), \
                 until {}",
                text(&row["collection"]),
                text(&row["order"]["until"])
            ));
        } else if let Some(reason) = row["order"]["reason"].as_str() {
            cell.push_str(" HELD");
            let waits_for = text(&row["order"]["waits_for"]);
            let what = match row["order"]["step"].as_str() {
                Some("remove") => "its removals wait for",
                _ => "its change waits for",
            };
            let why = match reason {
                "NACKED" => format!("which the client refused (NACKed): held until the source fixes the {waits_for}"),
                "UNACKED" => "to be ACKed".to_owned(),
                _ => format!("to send the {waits_for}' change first"),
            };
            holds.push(format!(
                "HELD {node} {}: {what} the {waits_for}, {why}",
                text(&row["collection"])
            ));
        }
        // What its Istio release drops of the collection (it stays SYNCED:
        // the client cannot tell).
        // Real Pilots send no node id: their address tells them apart.
        let who = if text(&row["node_id"]).is_empty() {
            format!("{node} {peer}")
        } else {
            node.clone()
        };
        if let Some(count) = row["skew"]["resources"].as_u64().filter(|n| *n > 0) {
            cell.push_str(&format!(" SKEW {count}"));
            for dropped in row["skew"]["dropped"].as_array().into_iter().flatten() {
                for field in dropped["fields"].as_array().into_iter().flatten() {
                    skews.push(format!(
                        "SKEW {who} {} {}: {}",
                        text(&row["collection"]),
                        text(&dropped["name"]),
                        text(field)
                    ));
                }
            }
        } else if row["skew"]["release"] == "unknown" {
            skews.push(format!(
                "UNKNOWN RELEASE {who}: reads Istio's kinds and did not say which Istio it is, so what it drops is \
                 not checked; name it with --client-generation (/debug/skew)"
            ));
        }
        cells.insert(short(&text(&row["collection"])), cell);
        let nack = &row["nack"];
        if let Some(message) = nack["message"].as_str() {
            let mut when = match nack["age_seconds"].as_f64() {
                Some(age) => format!("NACKed {} ago", human(age)),
                None => "NACKed".to_owned(),
            };
            if nack["superseded"].as_bool() == Some(true) {
                when.push_str(", since fixed");
            }
            nacks.push((
                nack["superseded"].as_bool() == Some(true),
                format!(
                    "{node} {}: {} ({}, {when})",
                    text(&row["collection"]),
                    one_line(message),
                    short_version(&nack["version"])
                ),
            ));
        }
    }
    // Current NACKs before the ones since fixed.
    nacks.sort_by_key(|(superseded, _)| *superseded);
    let columns: Vec<String> = collections.iter().map(|c| short(c)).collect();
    let mut header = vec!["NODE".to_owned(), "PEER".to_owned(), "PROTOCOL".to_owned()];
    header.extend(columns.iter().map(|c| c.to_uppercase()));
    let mut order: Vec<u64> = streams.keys().copied().collect();
    order.sort_by_key(|id| (urgency.get(id).copied().unwrap_or(STATUSES.len()), *id));
    let stream_count = order.len();
    if wide {
        header = [
            "NODE",
            "PEER",
            "PROTOCOL",
            "COLLECTION",
            "STATUS",
            "SENT",
            "ACKED",
            "CURRENT",
        ]
        .map(String::from)
        .to_vec();
    }
    let wide_lines = |id: &u64, head: &Vec<String>| -> Vec<Vec<String>> {
        rows.iter()
            .filter(|r| r["stream"].as_u64() == Some(*id))
            .map(|r| {
                let mut line = head.clone();
                line.push(text(&r["collection"]));
                let mut status = text(&r["status"]);
                if let Some(withheld) = r["access"]["withheld"].as_u64() {
                    status.push_str(&format!(" DENIED {withheld}"));
                }
                if r["order"]["reason"] == "DRAINING" {
                    status.push_str(" DRAINING");
                } else if r["order"]["reason"].is_string() {
                    status.push_str(" HELD");
                }
                if let Some(count) = r["skew"]["resources"].as_u64().filter(|n| *n > 0) {
                    status.push_str(&format!(" SKEW {count}"));
                }
                line.push(status);
                line.push(short_version(&r["sent"]["version"]));
                line.push(short_version(&r["acked"]["version"]));
                line.push(short_version(&r["current_version"]));
                line
            })
            .collect()
    };
    let lines: Vec<Vec<String>> = order
        .iter()
        .filter_map(|id| streams.remove(id).map(|stream| (id, stream)))
        .flat_map(|(id, (head, cells))| {
            if wide {
                return wide_lines(id, &head);
            }
            vec![head
                .into_iter()
                .chain(
                    columns
                        .iter()
                        .map(|c| cells.get(c).cloned().unwrap_or_else(|| "-".into())),
                )
                .collect()]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            std::iter::once(&header)
                .chain(&lines)
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for problem in syncz["source"]["problems"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "{}", one_line(problem.as_str().unwrap_or_default()));
    }
    if let Some(why) = syncz["not_ready"].as_str() {
        let why = why.strip_prefix("not ready: ").unwrap_or(why);
        let _ = writeln!(out, "NOT READY: {}\n", one_line(why));
    }
    for line in std::iter::once(&header).chain(&lines) {
        let cells: Vec<String> = line.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    // The types of the streams shown (a filter narrows both).
    let counts: Vec<String> = ["SYNCED", "SENT", "STALE", "NACKED", "NOT SENT"]
        .iter()
        .map(|s| format!("{} {s}", rows.iter().filter(|row| row["status"] == *s).count()))
        .collect();
    let _ = writeln!(
        out,
        "\n{} client streams; their types: {}",
        stream_count,
        counts.join(", ")
    );
    for (_, nack) in nacks {
        let _ = writeln!(out, "NACK {nack}");
    }
    for denial in denials {
        let _ = writeln!(out, "DENIED {denial}");
    }
    for hold in holds {
        let _ = writeln!(out, "{}", one_line(&hold));
    }
    // Each field a client's release drops (Istio's words: what the release
    // lacks and the release that added it), and each client whose release is
    // not known, once; /debug/skew has files and lines.
    let mut shown = std::collections::HashSet::new();
    for skew in skews {
        if shown.insert(skew.clone()) {
            let _ = writeln!(out, "{skew}");
        }
    }
    for line in rollout_lines(&syncz["rollout"]["collections"]) {
        let _ = writeln!(out, "{line}");
    }
    for overdue in syncz["not_delivered"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "NOT DELIVERED {}: a client asked for it and the source neither delivered nor refused it within \
             --demand-timeout; clients that wait for every type (xDS) were answered empty",
            terminal_safe(overdue["collection"].as_str().unwrap_or_default())
        );
    }
    out
}

/// Statuses, the ones that need an operator first.
const STATUSES: [&str; 5] = ["NACKED", "STALE", "SENT", "NOT SENT", "SYNCED"];

/// A version as a person reads it: its first 12 characters (any prefix of
/// 8 or more names it to the rollout commands).
/// A version's first 12 characters, terminal-safe: a client writes the
/// version it reports (its ACKED column).
pub(crate) fn short_version(version: &Value) -> String {
    version.as_str().map_or_else(
        || "-".to_owned(),
        |v| terminal_safe(&v.chars().take(12).collect::<String>()).into_owned(),
    )
}

/// One line per collection rollout (`/debug/rollout`'s entries), and one per
/// warning: `PINNED`, `HELD`, `WAITING`, `CANARY`, `SERVING`.
pub fn rollout_lines(rollouts: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    for r in rollouts.as_array().into_iter().flatten() {
        let collection = terminal_safe(r["collection"].as_str().unwrap_or_default());
        let everyone = short_version(&r["everyone"]);
        let latest = short_version(&r["latest"]);
        let line = match r["state"].as_str().unwrap_or_default() {
            "PINNED" => format!("PINNED {collection}: every client is served {everyone} (latest {latest})"),
            "HELD" => format!(
                "HELD {collection}: {} NACKed by canary {}: \"{}\"; the others stay on {everyone}",
                short_version(&r["held"]["version"]),
                one_line(r["held"]["node"].as_str().unwrap_or("-")),
                one_line(r["held"]["message"].as_str().unwrap_or_default()),
            ),
            "WAITING" => format!(
                "WAITING {collection}: {} waits for a canary to connect; the others stay on {everyone}",
                short_version(&r["round"]["version"]),
            ),
            "CANARY" => format!(
                "CANARY {collection}: {} ACKed by {} of {} canaries{}; the others stay on {everyone}",
                short_version(&r["round"]["version"]),
                r["round"]["acked"].as_u64().unwrap_or(0),
                r["canaries_connected"].as_u64().unwrap_or(0),
                match r["round"]["release_in_seconds"].as_f64() {
                    Some(s) => format!(", released in {}", human(s)),
                    None => String::new(),
                },
            ),
            state => format!("{state} {collection}: every client is served {everyone}"),
        };
        lines.push(line);
        if let Some(warning) = r["warning"].as_str() {
            lines.push(format!("WARNING {collection}: {}", one_line(warning)));
        }
    }
    lines
}

/// Whole seconds as `12s`, `5m 3s`, `2h 4m`.
fn human(seconds: f64) -> String {
    humantime::format_duration(std::time::Duration::from_secs(seconds as u64)).to_string()
}

/// Why `status` exits 1, a line each: the clients shown that are not
/// SYNCED, and the source's problems. Empty: exit 0.
pub fn verdict(syncz: &Value) -> Vec<String> {
    let rows = syncz["rows"].as_array().cloned().unwrap_or_default();
    let mut lines = Vec::new();
    let not_synced: Vec<String> = STATUSES
        .iter()
        .filter(|s| **s != "SYNCED")
        .filter_map(|s| {
            let n = rows.iter().filter(|r| r["status"] == *s).count();
            (n > 0).then(|| format!("{n} {s}"))
        })
        .collect();
    if !not_synced.is_empty() {
        let n = rows.iter().filter(|r| r["status"] != "SYNCED").count();
        lines.push(format!(
            "NOT SYNCED: {n} of {} client types ({})",
            rows.len(),
            not_synced.join(", ")
        ));
    }
    lines.extend(
        syncz["source"]["problems"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_str().map(one_line)),
    );
    lines
}

/// `/debug/syncz` as `output` asks; the table's first lines say why the exit
/// is 1 (for JSON and YAML, stderr does).
pub fn print(syncz: &Value, output: StatusOutput, out: &mut impl std::io::Write) -> anyhow::Result<u8> {
    let verdict = verdict(syncz);
    match output {
        StatusOutput::Table | StatusOutput::Wide => {
            // The source's problems are the table's own first lines.
            if let Some(clients) = verdict.first().filter(|l| l.starts_with("NOT SYNCED")) {
                writeln!(out, "{clients}")?;
            }
            out.write_all(render_table(syncz, output == StatusOutput::Wide).as_bytes())?;
        }
        StatusOutput::Json => writeln!(
            out,
            "{}",
            super::json_terminal_safe(serde_json::to_string_pretty(syncz)?)
        )?,
        StatusOutput::Yaml => out.write_all(super::yaml_terminal_safe(syncz)?.as_bytes())?,
    }
    if matches!(output, StatusOutput::Json | StatusOutput::Yaml) {
        for line in &verdict {
            eprintln!("{line}");
        }
    }
    Ok(u8::from(!verdict.is_empty()))
}

/// The query of a `/debug/syncz` filter.
pub(crate) fn syncz_path(collection: Option<&str>, status: Option<&str>, node: Option<&str>) -> String {
    let query: Vec<String> = [("collection", collection), ("status", status), ("node", node)]
        .into_iter()
        .filter_map(|(key, value)| value.map(|v| format!("{key}={}", encode(v))))
        .collect();
    match query.is_empty() {
        true => "/debug/syncz".to_owned(),
        false => format!("/debug/syncz?{}", query.join("&")),
    }
}

/// Prints the status; `Ok(0)` when every client shown is SYNCED and the
/// source is healthy, `Ok(1)` otherwise; `AdminUnreadable` (exit 2) when
/// the admin port cannot be read.
pub async fn run(args: StatusArgs, out: &mut impl std::io::Write) -> anyhow::Result<u8> {
    let authority = authority(&args.admin)?;
    let path = syncz_path(args.collection.as_deref(), args.status.as_deref(), args.node.as_deref());
    let syncz = read_admin(&authority, &path).await?;
    if !syncz["rows"].is_array() {
        return Err(AdminUnreadable(format!("{authority}{path} has no rows: not the gateway's admin port")).into());
    }
    print(&syncz, args.output, out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_version_a_client_reports_is_shown_escaped() {
        let shown = super::short_version(&serde_json::json!("\u{1b}[2J\u{9b}\u{202e}VV-and-more"));
        assert!(!shown.chars().any(|c| c.is_control() || c == '\u{202e}'), "{shown:?}");
        assert!(shown.starts_with("\\x1b[2J"), "{shown:?}");
    }

    #[test]
    fn a_nack_message_with_line_breaks_stays_on_its_line() {
        let syncz = serde_json::json!({
            "rows": [{
                "stream": 1, "node_id": "envoy-1", "peer": "127.0.0.1:1", "protocol": "xds-sotw",
                "collection": "envoy/config/cluster/v3/clusters", "status": "NACKED", "for_seconds": 3.0,
                "nack": {"message": "line one\nline two\n", "version": "0123456789abcdef", "age_seconds": 3.0},
            }],
        });
        let text = render(&syncz);
        let nack = text.lines().find(|l| l.starts_with("NACK ")).expect("a NACK line");
        assert!(nack.contains("line one\\nline two (0123456789ab, NACKed"), "{text}");
        assert!(!text.contains("\nline two"), "{text}");
    }

    use super::*;

    #[test]
    fn a_gateway_not_ready_says_why_first_and_counts_are_of_the_rows_shown() {
        let syncz = serde_json::json!({
            "rows": [{
                "stream": 1, "node_id": "pilot-a", "peer": "127.0.0.1:1", "protocol": "sotw",
                "collection": "istio/networking/v1alpha3/virtualservices", "status": "SYNCED",
            }],
            // Every row of the gateway, where a filter showed one.
            "summary": {"clients": {"SYNCED": 19}},
            "not_ready": "not ready: waiting for the first state of 1 collection (istio/networking/v1alpha3/gateways)",
        });
        let text = render(&syncz);
        assert!(!text.contains("not ready: "), "said once: {text}");
        assert!(
            text.starts_with("NOT READY: waiting for the first state of 1 collection"),
            "{text}"
        );
        assert!(text.contains("1 client streams; their types: 1 SYNCED,"), "{text}");
    }

    #[test]
    fn streams_that_need_an_eye_come_first_and_past_nacks_say_so() {
        let version = "0123456789abcdef0123456789abcdef";
        let row = |stream: u64, node: &str, status: &str, superseded: bool| {
            serde_json::json!({
                "stream": stream, "node_id": node, "peer": "127.0.0.1:1", "protocol": "sotw",
                "collection": "istio/networking/v1alpha3/virtualservices", "status": status, "for_seconds": 240.0,
                "nack": {"version": version, "message": "bad route", "age_seconds": 250.0, "superseded": superseded},
            })
        };
        let syncz = serde_json::json!({
            "rows": [row(1, "pilot-a", "SYNCED", true), row(2, "pilot-b", "NACKED", false)],
            "summary": {"clients": {"SYNCED": 1, "NACKED": 1}},
        });
        let text = render(&syncz);
        assert!(!text.contains("NOT READY"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[1].starts_with("pilot-b") && lines[2].starts_with("pilot-a"),
            "{text}"
        );
        let nacks: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with("NACK ")).collect();
        assert_eq!(
            nacks,
            [
                "NACK pilot-b istio/networking/v1alpha3/virtualservices: bad route (0123456789ab, NACKed 4m 10s ago)",
                "NACK pilot-a istio/networking/v1alpha3/virtualservices: bad route (0123456789ab, NACKed 4m 10s ago, \
                 since fixed)",
            ],
            "{text}"
        );
    }

    #[test]
    fn admin_addresses_and_durations() {
        assert_eq!(authority("http://127.0.0.1:15000/").unwrap(), "127.0.0.1:15000");
        assert_eq!(authority("localhost:1").unwrap(), "localhost:1");
        assert!(authority("https://x:1").is_err());
        assert_eq!(authority("[::1]:15000").unwrap(), "[::1]:15000");
        for bad in [
            "http://127.0.0.1:15000?t=MARKER",
            "127.0.0.1:15000;MARKER",
            "127.0.0.1:MARKER",
            "http://127.0.0.1:15000/MARKER",
            "127.0.0.1",
            "https://MARKER:1",
        ] {
            let said = authority(bad).unwrap_err().to_string();
            assert!(
                said.starts_with("--admin: ") && !said.contains("MARKER"),
                "{bad}: {said}"
            );
        }
        let said = authority("http://admin:MARKER-PW@127.0.0.1:15000")
            .unwrap_err()
            .to_string();
        assert!(said.contains("user info") && !said.contains("MARKER"), "{said}");
        assert_eq!(human(5.2), "5s");
        assert_eq!(human(303.0), "5m 3s");
        assert_eq!(human(7440.0), "2h 4m");
        assert_eq!(encode("NOT SENT"), "NOT%20SENT");
    }
}
