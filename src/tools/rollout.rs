//! `mcp-xds-gateway rollout`: the rollout controls and views of the admin
//! port, for people who would rather not curl JSON: `status`, `history`,
//! `diff`, `pin`, `unpin`, `promote`.

use std::fmt::Write as _;

use clap::{Args as ClapArgs, Subcommand};
use hyper::Method;
use serde_json::Value;

use super::terminal_safe;

use super::status::{
    authority, call, encode, read_admin, render_table, rollout_lines, short_version, syncz_path, verdict, StatusOutput,
};

/// Flags of `mcp-xds-gateway rollout`.
#[derive(Debug, ClapArgs)]
pub struct RolloutArgs {
    /// The gateway's admin port: HOST:PORT or http://HOST:PORT.
    #[arg(
        long,
        global = true,
        value_name = "URL",
        default_value = "http://127.0.0.1:15000",
        value_parser = super::status::admin_url()
    )]
    pub admin: String,

    #[command(subcommand)]
    pub action: Action,
}

#[derive(Debug, Subcommand)]
pub enum Action {
    /// Each collection's rollout (PINNED, HELD, WAITING, CANARY, SERVING),
    /// or one collection's. Exit 0 when no collection is HELD, every client
    /// (of COLLECTION) is SYNCED and the source is healthy; 1 when not; 2
    /// when the admin port cannot be read.
    Status {
        collection: Option<String>,
        /// table: a line per collection; wide: and every client stream's
        /// type with its sent, ACKed and current versions; json or yaml:
        /// {rollout, source, rows} as the admin port has them.
        #[arg(long, short = 'o', value_enum, default_value_t = StatusOutput::Table)]
        output: StatusOutput,
    },
    /// A collection's versions, newest first.
    History { collection: String },
    /// What changed between two versions of a collection: names, and with
    /// --bodies each changed body as a unified diff.
    Diff {
        collection: String,
        /// The older version, or a unique prefix of at least 8 characters
        /// (default: the one before --to).
        #[arg(long, value_name = "V")]
        from: Option<String>,
        /// The newer version, or a unique prefix of it (default: the latest).
        #[arg(long, value_name = "V")]
        to: Option<String>,
        /// Each changed body as a unified diff of its YAML.
        #[arg(long)]
        bodies: bool,
    },
    /// Serve every client VERSION of COLLECTION (from its history: the
    /// version, or a unique prefix of at least 8 characters, as `history`
    /// and `status` print it) instead of the latest.
    Pin { collection: String, version: String },
    /// Serve the latest of COLLECTION again (with canaries: at once when it
    /// is what everyone was served before the pin, else a canary round
    /// first).
    Unpin { collection: String },
    /// Send the version the canaries of COLLECTION are on to everyone now.
    Promote { collection: String },
}

/// A collection as a path segment: slashes kept, the rest encoded.
fn path_of(collection: &str) -> String {
    encode(collection.trim_matches('/'))
}

/// Runs the action; its exit code (`rollout status`: 1 when a collection is
/// HELD, a client is not SYNCED or the source is unhealthy).
pub async fn run(args: RolloutArgs, out: &mut impl std::io::Write) -> anyhow::Result<u8> {
    let admin = authority(&args.admin)?;
    let text = match args.action {
        Action::Status { collection, output } => return status(&admin, collection.as_deref(), output, out).await,
        Action::History { collection } => {
            let history = call(&admin, Method::GET, &format!("/debug/history/{}", path_of(&collection))).await?;
            history_table(&history)
        }
        Action::Diff {
            collection,
            from,
            to,
            bodies,
        } => {
            let path = path_of(&collection);
            let from = match from {
                Some(from) => from,
                None => previous_version(&admin, &path, to.as_deref()).await?,
            };
            let mut query = format!("from={}", encode(&from));
            if let Some(to) = &to {
                let _ = write!(query, "&to={}", encode(to));
            }
            if bodies {
                query.push_str("&bodies=yaml");
            }
            let diff = call(&admin, Method::GET, &format!("/debug/diff/{path}?{query}")).await?;
            diff_text(&diff)
        }
        Action::Pin { collection, version } => {
            let path = format!("/pin/{}?version={}", path_of(&collection), encode(&version));
            lines(rollout_lines(&Value::Array(vec![
                call(&admin, Method::POST, &path).await?,
            ])))
        }
        Action::Unpin { collection } => {
            let path = format!("/pin/{}", path_of(&collection));
            lines(rollout_lines(&Value::Array(vec![
                call(&admin, Method::DELETE, &path).await?,
            ])))
        }
        Action::Promote { collection } => {
            let path = format!("/promote/{}", path_of(&collection));
            lines(rollout_lines(&Value::Array(vec![
                call(&admin, Method::POST, &path).await?,
            ])))
        }
    };
    out.write_all(text.as_bytes())?;
    Ok(0)
}

/// `rollout status`: the rollout of every collection (or one), the source's
/// health and the clients' sync status, from the admin port.
async fn status(
    admin: &str,
    collection: Option<&str>,
    output: StatusOutput,
    out: &mut impl std::io::Write,
) -> anyhow::Result<u8> {
    // Read first: every gateway's admin port serves it, so a failure here
    // is the wrong port (exit 2), and a 404 below an unknown collection.
    let syncz = read_admin(admin, &syncz_path(collection, None, None)).await?;
    // One shape with or without COLLECTION (`/debug/rollout`'s): how rounds
    // run, and the collections shown.
    let mut rollout = call(admin, Method::GET, "/debug/rollout").await?;
    if let Some(collection) = collection {
        let one = call(admin, Method::GET, &format!("/debug/rollout/{}", path_of(collection))).await?;
        rollout["collections"] = Value::Array(vec![one]);
    }
    let collections = rollout["collections"].clone();
    let mut why = verdict(&syncz);
    for held in collections
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["state"] == "HELD")
    {
        why.insert(
            0,
            format!(
                "HELD {}: a canary NACKed {}",
                terminal_safe(held["collection"].as_str().unwrap_or_default()),
                short_version(&held["held"]["version"])
            ),
        );
    }
    let document = serde_json::json!({"rollout": rollout, "source": syncz["source"], "rows": syncz["rows"]});
    match output {
        StatusOutput::Json => writeln!(
            out,
            "{}",
            super::json_terminal_safe(serde_json::to_string_pretty(&document)?)
        )?,
        StatusOutput::Yaml => out.write_all(super::yaml_terminal_safe(&document)?.as_bytes())?,
        StatusOutput::Table | StatusOutput::Wide => {
            // The first lines say why the exit is 1.
            let mut text = lines(why.clone());
            if collection.is_none() {
                text.push_str(&policy_line(&rollout["canaries"]));
            }
            text.push_str(&lines(rollout_lines(&collections)));
            text.push_str(&lines(canary_client_lines(&collections)));
            if output == StatusOutput::Wide {
                // The table without its own SOURCE lines: they are above.
                let mut clients = syncz.clone();
                clients["source"] = Value::Null;
                text.push('\n');
                text.push_str(&render_table(&clients, true));
            }
            out.write_all(text.as_bytes())?;
        }
    }
    if matches!(output, StatusOutput::Json | StatusOutput::Yaml) {
        for line in &why {
            eprintln!("{line}");
        }
    }
    Ok(u8::from(!why.is_empty()))
}

/// The canary policy, in one line.
fn policy_line(policy: &Value) -> String {
    match policy["selectors"].as_u64().unwrap_or(0) {
        0 => "no --canary selectors: every client gets each version at once\n".to_owned(),
        n => format!(
            "{n} --canary selectors, among {}; with no canary connected: {}; soak {}s\n{}",
            match policy["membership"].as_str() {
                Some("node_ids") => "every client (--canary-trust-node-ids: node ids decide)".to_owned(),
                _ => format!(
                    "the identities of the {} --access-policy rules with canary: true",
                    policy["access_policy_canary_rules"].as_u64().unwrap_or(0)
                ),
            },
            policy["when_none"].as_str().unwrap_or("-"),
            policy["soak_seconds"].as_f64().unwrap_or(0.0),
            policy["warning"]
                .as_str()
                .map(|w| format!("WARNING: {w}\n"))
                .unwrap_or_default()
        ),
    }
}

/// Who is a canary and what made it one, and who claims to be one and is
/// not and why: a line per client and verdict, with the collections it
/// holds for (client-written text made terminal-safe).
fn canary_client_lines(collections: &Value) -> Vec<String> {
    use super::terminal_safe as safe;
    let text = |v: &Value| safe(v.as_str().unwrap_or("-")).into_owned();
    // By verdict, stream and why: the line's start and the collections.
    let mut clients: std::collections::BTreeMap<(bool, u64, String), (String, Vec<String>)> = Default::default();
    for rollout in collections.as_array().into_iter().flatten() {
        for (refused, key) in [(false, "canary_clients"), (true, "not_canaries")] {
            for client in rollout[key].as_array().into_iter().flatten() {
                let who = (refused, client["stream"].as_u64().unwrap_or(0), text(&client["why"]));
                let head = format!(
                    "{} {} ({}; --canary {})",
                    if refused { "NOT A CANARY" } else { "CANARY CLIENT" },
                    text(&client["node"]),
                    text(&client["identity"]),
                    text(&client["selector"]),
                );
                let entry = clients.entry(who).or_insert_with(|| (head, Vec::new()));
                entry.1.push(text(&rollout["collection"]));
            }
        }
    }
    clients
        .into_iter()
        .map(|((_, _, why), (head, of))| {
            let of = match &of[..] {
                [one] => one.clone(),
                many => format!("{} collections", many.len()),
            };
            format!("{head} of {of}: {why}")
        })
        .collect()
}

fn lines(lines: Vec<String>) -> String {
    lines.into_iter().map(|l| l + "\n").collect()
}

/// The version before `to` (the latest when `None`) in the history.
async fn previous_version(admin: &str, path: &str, to: Option<&str>) -> anyhow::Result<String> {
    let history = call(admin, Method::GET, &format!("/debug/history/{path}")).await?;
    let versions: Vec<&str> = history["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["version"].as_str())
        .collect();
    let at = match to {
        Some(to) => {
            // The gateway says which version `to` names (it may be a prefix).
            let named = call(
                admin,
                Method::GET,
                &format!("/debug/diff/{path}?from={0}&to={0}", encode(to)),
            )
            .await?;
            let to = named["to"].as_str().unwrap_or(to);
            versions
                .iter()
                .position(|v| *v == to)
                .ok_or_else(|| anyhow::anyhow!("--to {to}: not in the history"))?
        }
        None => 0,
    };
    versions
        .get(at + 1)
        .map(|v| (*v).to_owned())
        .ok_or_else(|| anyhow::anyhow!("the history holds no version before it: give --from"))
}

/// The history as a table, newest first, each version by its first 12
/// characters (what `pin` and `diff` take); `*` marks the current version.
pub fn history_table(history: &Value) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{:<14} {:<25} {:<9} {:>9} {:>7} {:>7} {:>7}",
        "VERSION", "APPLIED", "ORIGIN", "RESOURCES", "ADDED", "CHANGED", "REMOVED"
    );
    for v in history["versions"].as_array().into_iter().flatten() {
        let current = if v["current"].as_bool() == Some(true) { "*" } else { " " };
        let _ = writeln!(
            text,
            "{current}{:<13} {:<25} {:<9} {:>9} {:>7} {:>7} {:>7}",
            short_version(&v["version"]),
            v["applied_at"].as_str().unwrap_or("-"),
            v["origin"].as_str().unwrap_or("-"),
            v["resources"].as_u64().unwrap_or(0),
            v["added"].as_u64().unwrap_or(0),
            v["changed"].as_u64().unwrap_or(0),
            v["removed"].as_u64().unwrap_or(0),
        );
    }
    text
}

/// A diff: `+` added, `-` removed, `~` changed names, each changed body's
/// unified diff after its name.
pub fn diff_text(diff: &Value) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{} {} -> {}",
        diff["collection"].as_str().unwrap_or("-"),
        short_version(&diff["from"]),
        short_version(&diff["to"])
    );
    for (mark, key) in [("+", "added"), ("-", "removed")] {
        for name in diff[key].as_array().into_iter().flatten() {
            let _ = writeln!(text, "{mark} {}", terminal_safe(name.as_str().unwrap_or("-")));
        }
    }
    for changed in diff["changed"].as_array().into_iter().flatten() {
        match changed.as_str() {
            Some(name) => {
                let _ = writeln!(text, "~ {}", terminal_safe(name));
            }
            None => {
                let _ = writeln!(text, "~ {}", terminal_safe(changed["name"].as_str().unwrap_or("-")));
                // A unified diff: its lines as they are, each escaped.
                for line in changed["diff"].as_str().unwrap_or_default().lines() {
                    let _ = writeln!(text, "{}", terminal_safe(line));
                }
            }
        }
    }
    text
}
