//! `mcp-xds-gateway check PATH…`: reads files and directories exactly as the
//! files source does (`source::files::read_path`: the same reader, parser,
//! descriptors and limits) and exits without serving, for CI. Errors: every
//! error of a file (read past each, where the gateway stops at the first
//! and refuses the file), what Envoy would refuse of a resource that reads
//! (`source::envoy_rules`: the `validate.rules` of its protos, its address
//! rule), a name defined twice. Warnings: the cross-references a deploy
//! would trip on (an Envoy route to a cluster no file defines, an Istio
//! route to a subset no `DestinationRule` defines), each at the line of the
//! field naming it, and with `--for` what older Istio clients drop.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;

use clap::{Args as ClapArgs, ValueEnum};
use serde::Serialize;
use serde_json::Value;

use crate::collections::CollectionTable;
use crate::skew::{Dropped, DroppedKind, Generation, RELEASES};
use crate::source::envoy_rules;
use crate::source::files::{read_path, text_of, CheckedFile, FileLines, Parsed};
use crate::source::proto_json::{display_path, proto_path, BodyDecoder, PathStep};
use crate::tools::terminal_safe;

/// How findings are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum CheckOutput {
    /// `FILE:LINE: error: message` or `FILE:LINE: warning: message`, one per line.
    #[default]
    Text,
    /// One JSON array of `{file, line, collection, name, severity, message}`
    /// (and `strict: true` on a warning --strict made an error).
    Json,
    /// GitHub Actions workflow annotations (`::error file=…,line=…::…`).
    Github,
}

/// Flags of `mcp-xds-gateway check`.
#[derive(Debug, ClapArgs)]
pub struct CheckArgs {
    /// Files and directories to check; a directory is read as --source-dir
    /// reads it (its *.yaml and *.yml files, not its subdirectories).
    #[arg(value_name = "PATH", required = true)]
    pub paths: Vec<PathBuf>,

    /// How to print findings.
    #[arg(long, short = 'o', value_enum, default_value_t = CheckOutput::Text)]
    pub output: CheckOutput,

    /// Make every warning an error (exit 1), shown `error: [strict] …`.
    #[arg(long)]
    pub strict: bool,

    /// As the gateway's --type-map: collections beyond the built-in table.
    #[arg(long, value_name = "FILE")]
    pub type_map: Option<PathBuf>,

    /// As the gateway's --max-message-bytes: the largest file it serves.
    #[arg(long, value_name = "N", default_value_t = 64 << 20)]
    pub max_message_bytes: usize,

    /// The most errors reported of one file (each file is read past its
    /// errors to find the next; the gateway stops at the first, since a
    /// file with an error serves nothing).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub max_errors_per_file: usize,

    /// Report what clients of an Istio release would drop without a word
    /// (repeatable): every field, enum value or type in a resource that the
    /// release's protos lack, at its file and line, with the release that
    /// added it. A release (`1.1`), or `all-served` for every release the
    /// gateway has the protos of (1.0 to 1.7). Warnings; errors with
    /// --strict.
    #[arg(long = "for", value_name = "RELEASE", value_parser = parse_for)]
    pub for_releases: Vec<ForReleases>,
}

/// `--for`: one release or all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForReleases {
    One(Generation),
    AllServed,
}

fn parse_for(text: &str) -> Result<ForReleases, String> {
    if text.trim() == "all-served" {
        return Ok(ForReleases::AllServed);
    }
    let known = || {
        RELEASES
            .iter()
            .map(|r| r.generation.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let generation = Generation::parse(text).ok_or_else(|| {
        format!(
            "{text:?} is not an Istio release; give one of {}, or all-served",
            known()
        )
    })?;
    if generation.release().is_none() {
        return Err(format!(
            "the gateway has no protos of Istio {generation} to check against; give one of {}, or all-served",
            known()
        ));
    }
    Ok(ForReleases::One(generation))
}

/// The releases `--for` names, oldest first, each once.
fn releases_for(asked: &[ForReleases]) -> Vec<Generation> {
    let mut releases: BTreeSet<Generation> = BTreeSet::new();
    for asked in asked {
        match asked {
            ForReleases::One(generation) => {
                releases.insert(*generation);
            }
            ForReleases::AllServed => releases.extend(RELEASES.iter().map(|r| r.generation)),
        }
    }
    releases.into_iter().collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The file would not be served (it keeps its last good state, or holds
    /// everything back at start), or Envoy would refuse (NACK) what it
    /// holds, or a name is defined twice (one definition is never served).
    Error,
    /// Served, but what it names is not there: a deploy would trip on it.
    Warning,
}

/// One thing wrong, where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub file: String,
    /// The line in the file (0: the file as a whole, e.g. it cannot be read).
    pub line: usize,
    pub collection: Option<String>,
    pub name: Option<String>,
    pub severity: Severity,
    /// A warning that `--strict` made an error (`severity` says `error`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub strict: bool,
    pub message: String,
}

impl Finding {
    /// A finding about a resource that read, at `line` of its file.
    fn about(file: &str, parsed: &Parsed, line: usize, severity: Severity, message: String) -> Self {
        Self {
            file: file.to_owned(),
            line,
            collection: Some(parsed.collection.to_string()),
            name: Some(parsed.name.to_string()),
            severity,
            strict: false,
            message,
        }
    }
}

/// What was checked, and what was found.
#[derive(Debug, Default)]
pub struct Report {
    pub files: usize,
    pub resources: usize,
    pub findings: Vec<Finding>,
}

impl Report {
    /// 0 when everything would be served, 1 when anything would not.
    pub fn exit_code(&self) -> u8 {
        u8::from(self.findings.iter().any(|f| f.severity == Severity::Error))
    }
}

/// A reason to exit 2: the check could not be run as asked.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("--type-map: {0}")]
    TypeMap(String),
    #[error("{path}: {error}; give files or directories of YAML")]
    Path { path: String, error: std::io::Error },
    /// A directory with no YAML of its own whose subdirectories hold some:
    /// the operator meant the config below it, and checking nothing must not
    /// pass a CI job.
    #[error(
        "{path}: no *.yaml or *.yml file directly in this directory, and check reads a directory as \
         --source-dir does (not its subdirectories); its subdirectories with YAML: {below}; name the \
         ones a gateway serves (a file that is not a source file, like Envoy's bootstrap, would not parse)"
    )]
    OnlyBelow { path: String, below: String },
}

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const ROUTES: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const TCP_PROXY: &str = "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
const VIRTUAL_SERVICE: &str = "type.googleapis.com/istio.networking.v1alpha3.VirtualService";
const DESTINATION_RULE: &str = "type.googleapis.com/istio.networking.v1alpha3.DestinationRule";

/// Reads and checks every path (blocking: files are read here).
pub fn check(args: &CheckArgs) -> Result<Report, UsageError> {
    // The collections of secrets as the gateway knows them: an error about
    // one of their bodies quotes no value, in CI logs as on the admin port.
    let table = match &args.type_map {
        Some(path) => CollectionTable::builtin().with_type_map_file(path).map_err(|e| {
            UsageError::TypeMap(crate::transport::safe_text::terminal_safe(&e.to_string()).into_owned())
        })?,
        None => CollectionTable::builtin(),
    }
    .with_sensitive_types(crate::source::proto_json::secret_type_urls());
    let mut report = Report::default();
    let mut read = HashSet::new();
    // What is served: the resources of the files without an error.
    let mut served: Vec<(String, Parsed)> = Vec::new();
    // Every resource that read, also in a file with an error: what Envoy
    // would refuse of it is reported now, not one CI round later.
    let mut readable: Vec<(String, Parsed)> = Vec::new();
    for path in &args.paths {
        let files =
            read_path(path, &table, args.max_message_bytes, args.max_errors_per_file.max(1)).map_err(|error| {
                UsageError::Path {
                    path: crate::transport::safe_text::terminal_safe(&path.display().to_string()).into_owned(),
                    error,
                }
            })?;
        if files.is_empty() {
            let below = yaml_below(path);
            if !below.is_empty() {
                return Err(UsageError::OnlyBelow {
                    path: crate::transport::safe_text::terminal_safe(&path.display().to_string()).into_owned(),
                    below: below.join(", "),
                });
            }
            report.findings.push(Finding {
                file: path.display().to_string(),
                line: 0,
                collection: None,
                name: None,
                severity: Severity::Warning,
                strict: false,
                message: "no *.yaml or *.yml file directly in this directory (subdirectories are not read)".into(),
            });
        }
        for CheckedFile { path, parsed, errors } in files {
            // A file named twice (itself and its directory) is read once.
            if !read.insert(path.clone()) {
                continue;
            }
            report.files += 1;
            let broken = !errors.is_empty();
            report.findings.extend(errors.into_iter().map(|error| Finding {
                file: error.path,
                line: error.line,
                collection: error.collection.map(|c| c.to_string()),
                name: error.name,
                severity: Severity::Error,
                strict: false,
                message: error.reason,
            }));
            for p in parsed {
                if !broken {
                    served.push((path.clone(), p.clone()));
                }
                readable.push((path.clone(), p));
            }
        }
    }
    report.resources = served.len();
    let mut lines = Lines::new(args.max_message_bytes);
    report.findings.extend(envoy_refuses(&readable, &table, &mut lines));
    let mut about_bodies = cross_references(&served, &table, &mut lines);
    about_bodies.extend(skew_findings(
        &served,
        &releases_for(&args.for_releases),
        &table,
        &mut lines,
    ));
    // About a sensitive collection's resource, a finding quotes none of its
    // body (a cluster a route names, a field's value).
    for finding in &mut about_bodies {
        if finding.collection.as_deref().is_some_and(|c| table.is_sensitive(c)) {
            finding.message = crate::source::proto_json::redact_quoted(&finding.message);
        }
    }
    report.findings.extend(about_bodies);
    if args.strict {
        for finding in report.findings.iter_mut().filter(|f| f.severity == Severity::Warning) {
            finding.severity = Severity::Error;
            finding.strict = true;
        }
    }
    report
        .findings
        .sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    Ok(report)
}

/// The lines of fields in the files checked, each file read again once.
struct Lines {
    max_file_bytes: usize,
    files: BTreeMap<String, Option<FileLines>>,
}

impl Lines {
    fn new(max_file_bytes: usize) -> Self {
        Self {
            max_file_bytes,
            files: BTreeMap::new(),
        }
    }

    /// The line of the field at `path` (JSON names; `proto_path` the same by
    /// proto names) of a resource's body; the nearest parent's line where
    /// the field is not written (a default, an alias), the resource's
    /// first line where the file changed since.
    fn of(&mut self, file: &str, parsed: &Parsed, path: &[PathStep], proto_path: &[PathStep]) -> usize {
        let max = self.max_file_bytes;
        self.files
            .entry(file.to_owned())
            .or_insert_with(|| text_of(file, max).map(|t| FileLines::of(&t)))
            .as_ref()
            .and_then(|l| l.field_line(&parsed.body_at, path, proto_path))
            .unwrap_or(parsed.line)
    }
}

/// How a body's root is written in its file, for messages: `spec` or `json`.
fn body_root(parsed: &Parsed) -> String {
    match parsed.body_at.1.last() {
        Some(PathStep::Key(key)) => key.clone(),
        _ => "body".to_owned(),
    }
}

/// `root.path` as the parse errors write a field (`json.load_assignment…`).
fn field_shown(root: &str, path: &[PathStep]) -> String {
    match display_path(path) {
        inner if inner.is_empty() => root.to_owned(),
        inner if inner.starts_with('[') => format!("{root}{inner}"),
        inner => format!("{root}.{inner}"),
    }
}

/// What Envoy would refuse (NACK) of each resource that read: the
/// `validate.rules` of its protos and its address rule (see
/// `source::envoy_rules`), each an error at the line of the field.
/// In a sensitive collection, a finding repeats nothing of the body.
fn envoy_refuses(parsed: &[(String, Parsed)], table: &CollectionTable, lines: &mut Lines) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (file, p) in parsed {
        let Some(body) = body_any(p) else {
            continue;
        };
        let sensitive = table.is_sensitive(&p.collection);
        for violation in envoy_rules::violations(&body.type_url, &body.value) {
            let line = lines.of(file, p, &violation.path, &violation.proto_path);
            // A sensitive body's path may hold its text (a map's keys): the
            // line and the rule's field name say where.
            let message = if sensitive {
                format!(
                    "{}.[redacted]: {} ({}); Envoy refuses (NACKs) the resource",
                    body_root(p),
                    violation.message_redacted(),
                    violation.rule
                )
            } else {
                format!(
                    "{}: {} ({}); Envoy refuses (NACKs) the resource",
                    field_shown(&body_root(p), &violation.proto_path),
                    violation.message,
                    violation.rule
                )
            };
            findings.push(Finding::about(file, p, line, Severity::Error, message));
        }
    }
    findings
}

/// A resource's body, as encoded.
fn body_any(parsed: &Parsed) -> Option<prost_types::Any> {
    <crate::proto::Resource as prost::Message>::decode(parsed.encoded.clone())
        .ok()
        .and_then(|r| r.body)
}

/// What clients of the releases would drop, each at the line of the field
/// in its file, one finding for every release that drops it. A kind a
/// release's protos lack altogether is not reported for it: its clients
/// never ask for that collection.
fn skew_findings(
    parsed: &[(String, Parsed)],
    releases: &[Generation],
    table: &CollectionTable,
    lines: &mut Lines,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    if releases.is_empty() {
        return findings;
    }
    for (file, p) in parsed {
        let Some((type_url, body)) = crate::skew::body_of(&p.encoded) else {
            continue;
        };
        // Each drop with the releases that drop it, in body order.
        let mut dropped: Vec<(Dropped, Vec<Generation>)> = Vec::new();
        let mut more: Vec<(usize, Vec<Generation>)> = Vec::new();
        for generation in releases {
            let release = generation.release().expect("--for takes releases the gateway has");
            // A sensitive collection's values (a map's key, an enum's)
            // are not said, as the gateway's views do not say them.
            let sensitive = table.is_sensitive(&p.collection);
            let Some(skew) = crate::skew::dropped_by(release, type_url, body, sensitive) else {
                continue;
            };
            for drop in skew
                .dropped
                .into_iter()
                .filter(|d| !(d.path.is_empty() && matches!(d.kind, DroppedKind::Type(_))))
            {
                match dropped.iter_mut().find(|(known, _)| *known == drop) {
                    Some((_, by)) => by.push(*generation),
                    None => dropped.push((drop, vec![*generation])),
                }
            }
            if skew.more > 0 {
                match more.iter_mut().find(|(count, _)| *count == skew.more) {
                    Some((_, by)) => by.push(*generation),
                    None => more.push((skew.more, vec![*generation])),
                }
            }
        }
        let finding = |line: usize, message: String| Finding::about(file, p, line, Severity::Warning, message);
        for (drop, by) in dropped {
            let line = lines.of(file, p, &drop.path, &drop.proto_path);
            findings.push(finding(line, drop.message_for(&by)));
        }
        for (count, by) in more {
            findings.push(finding(
                p.line,
                format!(
                    "Istio {} clients drop {count} more fields of {}",
                    crate::skew::releases_shown(&by),
                    p.name
                ),
            ));
        }
    }
    findings
}

/// The subdirectories below `dir` (at any depth, hidden ones skipped) that
/// hold a `*.yaml` or `*.yml` file directly, in order.
fn yaml_below(dir: &std::path::Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&next) else {
            continue;
        };
        let mut has_yaml = false;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            // `file_type` does not follow links: a link loop is never walked.
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => pending.push(entry.path()),
                _ => has_yaml |= name.ends_with(".yaml") || name.ends_with(".yml"),
            }
        }
        if has_yaml && next != dir {
            found.push(next.display().to_string());
        }
    }
    found.sort();
    found
}

/// The most cross-reference warnings of one resource listed at their lines.
const MAX_REFERENCE_FINDINGS: usize = 100;

/// A served resource, its body read back.
struct Read<'a> {
    file: &'a str,
    parsed: &'a Parsed,
    body: Value,
}

impl Read<'_> {
    /// A warning at `line`.
    fn warning(&self, line: usize, message: String) -> Finding {
        Finding::about(self.file, self.parsed, line, Severity::Warning, message)
    }

    /// Warnings at the line of each field (`pending`: its path and the
    /// message), at most [`MAX_REFERENCE_FINDINGS`]; past them one more
    /// at the resource counts the rest (each line is a walk of its YAML
    /// document: a resource naming thousands of missing things costs a
    /// bounded number of them).
    fn warnings_at(&self, lines: &mut Lines, pending: Vec<(Vec<PathStep>, String)>) -> Vec<Finding> {
        let rest = pending.len().saturating_sub(MAX_REFERENCE_FINDINGS);
        let mut found: Vec<Finding> = pending
            .into_iter()
            .take(MAX_REFERENCE_FINDINGS)
            .map(|(path, message)| self.warning(self.line(lines, &path), message))
            .collect();
        if rest > 0 {
            found.push(self.warning(
                self.parsed.line,
                format!("{rest} more names this resource refers to are defined by no file (not listed)"),
            ));
        }
        found
    }

    /// The line of the field at `path` (JSON names, as the body read back
    /// has them) of this resource.
    fn line(&self, lines: &mut Lines, path: &[PathStep]) -> usize {
        let proto = proto_path(&self.parsed.body_type_url, &self.body, path);
        lines.of(self.file, self.parsed, path, &proto)
    }

    /// The name Envoy knows the resource by: its own `name` field (a load
    /// assignment's `cluster_name`), else the resource's.
    fn envoy_name(&self) -> String {
        ["name", "clusterName"]
            .iter()
            .find_map(|k| self.body[*k].as_str())
            .map_or_else(|| self.parsed.name.to_string(), str::to_owned)
    }
}

/// The findings of a set of served resources: names in two files, `struct:`
/// bodies their clients cannot decode, and references to what no file
/// defines, each at the line of the field.
fn cross_references(parsed: &[(String, Parsed)], table: &CollectionTable, lines: &mut Lines) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut first: BTreeMap<(&str, &str), (&str, usize)> = BTreeMap::new();
    let mut served = Vec::new();
    let decoder = BodyDecoder::new(None).expect("the built-in descriptors need no file");
    for (file, p) in parsed {
        let read = Read {
            file,
            parsed: p,
            body: Value::Null,
        };
        // As in one file (where the gateway refuses the file), a name
        // defined twice is an error: one of the two is never served.
        if let Some((other, line)) = first.get(&(&*p.collection, &*p.name)) {
            let message = format!(
                "{:?} in {} is also defined at {other}:{line}; names must be unique in a collection across the \
                 files: the gateway serves the first file's (by name) and ignores this one",
                p.name, p.collection
            );
            findings.push(Finding::about(file, p, p.name_line, Severity::Error, message));
            continue;
        }
        first.insert((&*p.collection, &*p.name), (file, p.name_line));
        if p.struct_body {
            let kind = table.get(&p.collection).map_or("", |c| &*c.body_type_url);
            findings.push(read.warning(
                p.line,
                format!(
                    "a struct: body is served as google.protobuf.Struct, which clients of {} decode as {kind} and \
                     cannot read; write the resource as Kubernetes YAML (apiVersion, kind, metadata, spec)",
                    p.collection
                ),
            ));
        }
        let Some(body) = body_any(p) else {
            continue;
        };
        // A body no descriptor here reads has no references to check; one
        // of a type it knows that does not decode as it is served all the
        // same, and read by each client as its parser reads it (a strict
        // one refuses it, upb and Envoy's skip the field they cannot read).
        match decoder.decode(&body.type_url, &body.value) {
            Ok(body) => served.push(Read { body, ..read }),
            Err(why) if why.starts_with(crate::source::proto_json::DOES_NOT_DECODE) => findings.push(read.warning(
                p.line,
                format!(
                    "the body {}; clients read it as their parser does (a strict one refuses it, Envoy's skips \
                     the field it cannot read): check how it was encoded",
                    crate::source::proto_json::redact_quoted(&why)
                ),
            )),
            Err(_) => {}
        }
    }
    findings.extend(envoy_references(&served, lines));
    findings.extend(istio_subsets(&served, lines));
    findings
}

/// What Envoy resources name over ADS and no file defines.
fn envoy_references(served: &[Read], lines: &mut Lines) -> Vec<Finding> {
    let names = |type_url: &str| -> BTreeSet<String> {
        served
            .iter()
            .filter(|r| r.parsed.body_type_url == type_url)
            .flat_map(|r| [r.envoy_name(), r.parsed.name.to_string()])
            .collect()
    };
    let (clusters, routes, endpoints, secrets) = (names(CLUSTER), names(ROUTES), names(ENDPOINTS), names(SECRET));
    let mut findings = Vec::new();
    for read in served
        .iter()
        .filter(|r| r.parsed.body_type_url.starts_with("type.googleapis.com/envoy."))
    {
        // (the path of the naming field, the message), lines looked up last.
        let mut pending: Vec<(Vec<PathStep>, String)> = Vec::new();
        let mut refs = References::default();
        refs.walk(&read.body, &mut Vec::new());
        if read.parsed.body_type_url == CLUSTER && read.body["type"] == "EDS" {
            let eds = &read.body["edsClusterConfig"];
            if from_this_server(&eds["edsConfig"]) {
                let (service, at) = match eds["serviceName"].as_str() {
                    Some(service) => (service.to_owned(), "serviceName"),
                    None => (read.envoy_name(), "edsConfig"),
                };
                if !endpoints.contains(&service) {
                    pending.push((
                        vec![key("edsClusterConfig"), key(at)],
                        format!(
                            "EDS cluster {service:?} has no load assignment: no file defines {service:?} in \
                             envoy/config/endpoint/v3/clusterloadassignments, so Envoy waits for its endpoints"
                        ),
                    ));
                }
            }
        }
        let missing = |refs: Vec<Reference>, defined: &BTreeSet<String>| {
            first_places(refs.into_iter().filter(|(name, _)| !defined.contains(name)))
        };
        for (cluster, path, more) in missing(refs.clusters, &clusters) {
            pending.push((
                path,
                format!(
                    "routes to cluster {cluster:?}, which no file defines in envoy/config/cluster/v3/clusters{}",
                    more_places(more)
                ),
            ));
        }
        for (route, path, more) in missing(refs.routes, &routes) {
            pending.push((
                path,
                format!(
                    "RDS name {route:?} has no route configuration: no file defines it in \
                     envoy/config/route/v3/routeconfigurations{}",
                    more_places(more)
                ),
            ));
        }
        for (secret, path, more) in missing(refs.secrets, &secrets) {
            pending.push((
                path,
                format!(
                    "SDS name {secret:?} has no secret: no file defines it in \
                     envoy/extensions/transport_sockets/tls/v3/secrets{}",
                    more_places(more)
                ),
            ));
        }
        findings.extend(read.warnings_at(lines, pending));
    }
    findings
}

fn key(name: &str) -> PathStep {
    PathStep::Key(name.to_owned())
}

/// Each name once, at the first place it is written, with how many more
/// places of the resource write it: a route configuration with a thousand
/// routes to one missing cluster is one finding (and its line is looked up
/// once).
fn first_places<K: std::hash::Hash + Eq + Clone>(
    refs: impl IntoIterator<Item = (K, Vec<PathStep>)>,
) -> Vec<(K, Vec<PathStep>, usize)> {
    let mut grouped: Vec<(K, Vec<PathStep>, usize)> = Vec::new();
    let mut at: std::collections::HashMap<K, usize> = std::collections::HashMap::new();
    for (name, path) in refs {
        match at.get(&name) {
            Some(index) => grouped[*index].2 += 1,
            None => {
                at.insert(name.clone(), grouped.len());
                grouped.push((name, path, 0));
            }
        }
    }
    grouped
}

/// `(and 3 more places in this resource)`, or nothing.
fn more_places(more: usize) -> String {
    match more {
        0 => String::new(),
        1 => " (and 1 more place in this resource)".to_owned(),
        n => format!(" (and {n} more places in this resource)"),
    }
}

/// A name a resource refers to, and the path of the field naming it.
type Reference = (String, Vec<PathStep>);

/// The names an Envoy resource asks this server for, wherever they are in
/// it (a listener's filters and transport sockets, a route configuration's
/// routes, inline route configurations), each where it is written.
#[derive(Default)]
struct References {
    clusters: Vec<Reference>,
    routes: Vec<Reference>,
    secrets: Vec<Reference>,
}

impl References {
    fn walk(&mut self, value: &Value, path: &mut Vec<PathStep>) {
        let at = |path: &[PathStep], steps: &[PathStep]| [path, steps].concat();
        match value {
            Value::Array(values) => {
                for (index, value) in values.iter().enumerate() {
                    path.push(PathStep::Index(index));
                    self.walk(value, path);
                    path.pop();
                }
            }
            Value::Object(fields) => {
                if let Some(cluster) = fields.get("route").and_then(|r| r["cluster"].as_str()) {
                    self.clusters
                        .push((cluster.to_owned(), at(path, &[key("route"), key("cluster")])));
                }
                if fields.get("@type").and_then(Value::as_str) == Some(TCP_PROXY) {
                    if let Some(cluster) = fields.get("cluster").and_then(Value::as_str) {
                        self.clusters.push((cluster.to_owned(), at(path, &[key("cluster")])));
                    }
                }
                if let Some(Value::Array(weighted)) = fields.get("weightedClusters").map(|w| &w["clusters"]) {
                    for (index, cluster) in weighted.iter().enumerate() {
                        if let Some(name) = cluster["name"].as_str() {
                            let steps = [
                                key("weightedClusters"),
                                key("clusters"),
                                PathStep::Index(index),
                                key("name"),
                            ];
                            self.clusters.push((name.to_owned(), at(path, &steps)));
                        }
                    }
                }
                if let Some(rds) = fields.get("rds") {
                    if from_this_server(&rds["configSource"]) {
                        if let Some(name) = rds["routeConfigName"].as_str() {
                            self.routes
                                .push((name.to_owned(), at(path, &[key("rds"), key("routeConfigName")])));
                        }
                    }
                }
                let listed = fields
                    .get("tlsCertificateSdsSecretConfigs")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                    .map(|(index, config)| {
                        (
                            vec![key("tlsCertificateSdsSecretConfigs"), PathStep::Index(index)],
                            config,
                        )
                    });
                let validation = fields
                    .get("validationContextSdsSecretConfig")
                    .map(|config| (vec![key("validationContextSdsSecretConfig")], config));
                for (steps, config) in listed.chain(validation) {
                    // Without sds_config the secret is the bootstrap's own.
                    if from_this_server(&config["sdsConfig"]) {
                        if let Some(name) = config["name"].as_str() {
                            self.secrets
                                .push((name.to_owned(), at(path, &[steps, vec![key("name")]].concat())));
                        }
                    }
                }
                for (name, value) in fields {
                    path.push(key(name));
                    self.walk(value, path);
                    path.pop();
                }
            }
            _ => {}
        }
    }
}

/// Whether a config source is one the gateway answers (ADS, or a server),
/// not a file on Envoy's disk.
fn from_this_server(source: &Value) -> bool {
    source.is_object() && source.get("path").is_none() && source.get("pathConfigSource").is_none()
}

/// A host as Istio resolves it in the namespace of the rule naming it: a
/// short name is a service of that namespace.
fn fqdn(host: &str, namespace: &str) -> String {
    if host.contains('.') || host.contains('*') {
        host.to_owned()
    } else {
        format!("{host}.{namespace}.svc.cluster.local")
    }
}

/// Whether a `DestinationRule`'s host (perhaps a `*.` wildcard) covers `host`.
fn covers(rule_host: &str, host: &str) -> bool {
    match rule_host.strip_prefix('*') {
        Some(suffix) => host.ends_with(suffix),
        None => rule_host == host,
    }
}

fn namespace(name: &str) -> &str {
    name.split_once('/').map_or("default", |(ns, _)| ns)
}

/// Istio routes to a subset no `DestinationRule` of the host defines: Envoy
/// gets a route to a cluster that does not exist (503 NR).
fn istio_subsets(served: &[Read], lines: &mut Lines) -> Vec<Finding> {
    let rules: Vec<(String, BTreeSet<&str>)> = served
        .iter()
        .filter(|r| r.parsed.body_type_url == DESTINATION_RULE)
        .filter_map(|r| {
            let host = r.body["host"].as_str()?;
            let subsets = r.body["subsets"].as_array().into_iter().flatten();
            Some((
                fqdn(host, namespace(&r.parsed.name)),
                subsets.filter_map(|s| s["name"].as_str()).collect(),
            ))
        })
        .collect();
    let mut findings = Vec::new();
    for read in served.iter().filter(|r| r.parsed.body_type_url == VIRTUAL_SERVICE) {
        let ns = namespace(&read.parsed.name);
        // ((host, subset), the path of its `subset` field)
        let mut wanted: Vec<((&str, &str), Vec<PathStep>)> = Vec::new();
        for kind in ["http", "tcp", "tls"] {
            for (index, route) in read.body[kind].as_array().into_iter().flatten().enumerate() {
                let route_at = [key(kind), PathStep::Index(index)];
                // The destinations of a list of routes or mirrors.
                let listed = |field: &'static str| {
                    route[field]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .enumerate()
                        .map(move |(i, r)| {
                            (
                                &r["destination"],
                                vec![key(field), PathStep::Index(i), key("destination")],
                            )
                        })
                };
                let (routes, mirrors) = (listed("route"), listed("mirrors"));
                let destinations = routes.chain([(&route["mirror"], vec![key("mirror")])]).chain(mirrors);
                for (destination, steps) in destinations {
                    if let (Some(host), Some(subset)) = (destination["host"].as_str(), destination["subset"].as_str()) {
                        wanted.push(((host, subset), [&route_at[..], &steps, &[key("subset")]].concat()));
                    }
                }
            }
        }
        let undefined = wanted.into_iter().filter(|((host, subset), _)| {
            let full = fqdn(host, ns);
            !rules
                .iter()
                .any(|(rule_host, subsets)| covers(rule_host, &full) && subsets.contains(subset))
        });
        let mut pending = Vec::new();
        for ((host, subset), path, more) in first_places(undefined) {
            let full = fqdn(host, ns);
            pending.push((
                path,
                format!(
                    "routes to subset {subset:?} of host {host:?}, which no DestinationRule for {full} defines \
                     (Envoy answers such routes 503){}",
                    more_places(more)
                ),
            ));
        }
        findings.extend(read.warnings_at(lines, pending));
    }
    findings
}

/// The findings in the chosen form. What a file holds (its path, names,
/// values quoted in messages) is printed through `terminal_safe` in text
/// and annotations; JSON holds it as it is, escaped as JSON escapes.
pub fn render(report: &Report, output: CheckOutput) -> String {
    match output {
        CheckOutput::Text => report
            .findings
            .iter()
            .map(|f| {
                format!(
                    "{}:{}: {}: {}{}\n",
                    terminal_safe(&f.file),
                    f.line,
                    level(f),
                    if f.strict { "[strict] " } else { "" },
                    terminal_safe(&f.message)
                )
            })
            .collect(),
        CheckOutput::Json => {
            let mut json =
                super::json_terminal_safe(serde_json::to_string_pretty(&report.findings).expect("findings are JSON"));
            json.push('\n');
            json
        }
        CheckOutput::Github => report
            .findings
            .iter()
            .map(|f| {
                let mut properties = format!("file={}", annotation_property(&terminal_safe(&f.file)));
                if f.line > 0 {
                    properties.push_str(&format!(",line={}", f.line));
                }
                if let (Some(collection), Some(name)) = (&f.collection, &f.name) {
                    properties.push_str(&format!(
                        ",title={}",
                        annotation_property(&terminal_safe(&format!("{collection} {name}")))
                    ));
                }
                format!(
                    "::{} {properties}::{}{}\n",
                    level(f),
                    if f.strict { "[strict] " } else { "" },
                    annotation_data(&terminal_safe(&f.message))
                )
            })
            .collect(),
    }
}

/// A finding's tag: `error` or `warning`.
fn level(finding: &Finding) -> &'static str {
    match finding.severity {
        Severity::Error => "error",
        Severity::Warning => "warning",
    }
}

/// The summary line for stderr.
pub fn summary(report: &Report) -> String {
    let errors = report.findings.iter().filter(|f| f.severity == Severity::Error).count();
    let count = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    format!(
        "{}, {}: {}, {}",
        count(report.files, "file"),
        count(report.resources, "resource"),
        count(errors, "error"),
        count(report.findings.len() - errors, "warning")
    )
}

/// A workflow command's message, escaped as the runner unescapes it.
fn annotation_data(text: &str) -> String {
    text.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A")
}

/// A workflow command's property value, escaped as the runner unescapes it.
fn annotation_property(text: &str) -> String {
    annotation_data(text).replace(':', "%3A").replace(',', "%2C")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_resolve_in_the_rule_namespace_and_wildcards_cover_suffixes() {
        assert_eq!(fqdn("ratings", "bookinfo"), "ratings.bookinfo.svc.cluster.local");
        assert_eq!(fqdn("api.example.com", "bookinfo"), "api.example.com");
        assert!(covers(
            "*.bookinfo.svc.cluster.local",
            "ratings.bookinfo.svc.cluster.local"
        ));
        assert!(!covers(
            "*.other.svc.cluster.local",
            "ratings.bookinfo.svc.cluster.local"
        ));
        assert_eq!(namespace("bookinfo/ratings"), "bookinfo");
        assert_eq!(namespace("default"), "default");
    }

    #[test]
    fn annotations_escape_what_the_runner_would_read_as_syntax() {
        assert_eq!(annotation_data("50% of\na"), "50%25 of%0Aa");
        assert_eq!(annotation_property("a:b,c"), "a%3Ab%2Cc");
    }
}
