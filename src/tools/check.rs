//! `mcp-xds-gateway check PATH…`: reads files and directories exactly as the
//! files source does (`source::files::read_path`: the same reader, parser,
//! descriptors and limits) and exits without serving, for CI. Beyond what
//! does not parse, it reports as warnings the cross-references a deploy
//! would trip on (an Envoy route to a cluster no file defines, an Istio
//! route to a subset no `DestinationRule` defines, a name in two files).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;

use clap::{Args as ClapArgs, ValueEnum};
use serde::Serialize;
use serde_json::Value;

use crate::collections::CollectionTable;
use crate::skew::{DroppedKind, Generation, RELEASES};
use crate::source::files::{read_path, Parsed};
use crate::source::proto_json::BodyDecoder;

/// How findings are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum CheckOutput {
    /// `FILE:LINE: message`, one per line (warnings say so).
    #[default]
    Text,
    /// One JSON array of `{file, line, collection, name, severity, message}`.
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

    /// Make the cross-reference warnings errors (exit 1).
    #[arg(long)]
    pub strict: bool,

    /// As the gateway's --type-map: collections beyond the built-in table.
    #[arg(long, value_name = "FILE")]
    pub type_map: Option<PathBuf>,

    /// As the gateway's --max-message-bytes: the largest file it serves.
    #[arg(long, value_name = "N", default_value_t = 64 << 20)]
    pub max_message_bytes: usize,

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
    /// everything back at start).
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
    pub message: String,
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
    let table = match &args.type_map {
        Some(path) => CollectionTable::builtin()
            .with_type_map_file(path)
            .map_err(|e| UsageError::TypeMap(e.to_string()))?,
        None => CollectionTable::builtin(),
    };
    let mut report = Report::default();
    let mut read = HashSet::new();
    let mut parsed: Vec<(String, Parsed)> = Vec::new();
    for path in &args.paths {
        let files = read_path(path, &table, args.max_message_bytes).map_err(|error| UsageError::Path {
            path: path.display().to_string(),
            error,
        })?;
        if files.is_empty() {
            let below = yaml_below(path);
            if !below.is_empty() {
                return Err(UsageError::OnlyBelow {
                    path: path.display().to_string(),
                    below: below.join(", "),
                });
            }
            report.findings.push(Finding {
                file: path.display().to_string(),
                line: 0,
                collection: None,
                name: None,
                severity: Severity::Warning,
                message: "no *.yaml or *.yml file directly in this directory (subdirectories are not read)".into(),
            });
        }
        for (file, result) in files {
            // A file named twice (itself and its directory) is read once.
            if !read.insert(file.clone()) {
                continue;
            }
            report.files += 1;
            match result {
                Ok(resources) => parsed.extend(resources.into_iter().map(|p| (file.clone(), p))),
                Err(error) => report.findings.push(Finding {
                    file: error.path,
                    line: error.line,
                    collection: None,
                    name: None,
                    severity: Severity::Error,
                    message: error.reason,
                }),
            }
        }
    }
    report.resources = parsed.len();
    report.findings.extend(cross_references(&parsed, &table));
    report.findings.extend(skew_findings(
        &parsed,
        &releases_for(&args.for_releases),
        args.max_message_bytes,
    ));
    if args.strict {
        for finding in &mut report.findings {
            finding.severity = Severity::Error;
        }
    }
    report
        .findings
        .sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    Ok(report)
}

/// What clients of each release would drop, each at the line of the field
/// in its file. A kind a release's protos lack altogether is not reported
/// for it: its clients never ask for that collection.
fn skew_findings(parsed: &[(String, Parsed)], releases: &[Generation], max_file_bytes: usize) -> Vec<Finding> {
    let mut findings = Vec::new();
    if releases.is_empty() {
        return findings;
    }
    let mut texts: BTreeMap<&str, Option<crate::source::files::FileLines>> = BTreeMap::new();
    for (file, p) in parsed {
        let Some((type_url, body)) = crate::skew::body_of(&p.encoded) else {
            continue;
        };
        for generation in releases {
            let release = generation.release().expect("--for takes releases the gateway has");
            let Some(skew) = crate::skew::dropped_by(release, type_url, body) else {
                continue;
            };
            for dropped in skew
                .dropped
                .iter()
                .filter(|d| !(d.path.is_empty() && matches!(d.kind, DroppedKind::Type(_))))
            {
                let lines = texts.entry(file).or_insert_with(|| {
                    crate::source::files::text_of(file, max_file_bytes).map(|t| crate::source::files::FileLines::of(&t))
                });
                let line = lines
                    .as_ref()
                    .and_then(|l| l.field_line(&p.body_at, &dropped.path, &dropped.proto_path))
                    .unwrap_or(p.line);
                findings.push(Finding {
                    file: file.clone(),
                    line,
                    collection: Some(p.collection.to_string()),
                    name: Some(p.name.to_string()),
                    severity: Severity::Warning,
                    message: dropped.message(*generation),
                });
            }
            if skew.more > 0 {
                findings.push(Finding {
                    file: file.clone(),
                    line: p.line,
                    collection: Some(p.collection.to_string()),
                    name: Some(p.name.to_string()),
                    severity: Severity::Warning,
                    message: format!(
                        "Istio {generation} clients drop {} more fields of {}",
                        skew.more, p.name
                    ),
                });
            }
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

/// A served resource, its body read back.
struct Read<'a> {
    file: &'a str,
    parsed: &'a Parsed,
    body: Value,
}

impl Read<'_> {
    fn warning(&self, message: String) -> Finding {
        Finding {
            file: self.file.to_owned(),
            line: self.parsed.line,
            collection: Some(self.parsed.collection.to_string()),
            name: Some(self.parsed.name.to_string()),
            severity: Severity::Warning,
            message,
        }
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

/// The warnings of a set of parsed resources: names in two files, `struct:`
/// bodies their clients cannot decode, and references to what no file defines.
fn cross_references(parsed: &[(String, Parsed)], table: &CollectionTable) -> Vec<Finding> {
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
        if let Some((other, line)) = first.get(&(&*p.collection, &*p.name)) {
            findings.push(read.warning(format!(
                "{:?} in {} is also defined at {other}:{line}; the first file by name is served and this one is \
                 ignored",
                p.name, p.collection
            )));
            continue;
        }
        first.insert((&*p.collection, &*p.name), (file, p.line));
        if p.struct_body {
            let kind = table.get(&p.collection).map_or("", |c| &*c.body_type_url);
            findings.push(read.warning(format!(
                "a struct: body is served as google.protobuf.Struct, which clients of {} decode as {kind} and \
                 cannot read; write the resource as Kubernetes YAML (apiVersion, kind, metadata, spec)",
                p.collection
            )));
        }
        let resource = <crate::proto::Resource as prost::Message>::decode(p.encoded.clone());
        let Some(body) = resource.ok().and_then(|r| r.body) else {
            continue;
        };
        // A body no descriptor here reads has no references to check.
        if let Ok(body) = decoder.decode(&body.type_url, &body.value) {
            served.push(Read { body, ..read });
        }
    }
    findings.extend(envoy_references(&served));
    findings.extend(istio_subsets(&served));
    findings
}

/// What Envoy resources name over ADS and no file defines.
fn envoy_references(served: &[Read]) -> Vec<Finding> {
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
        let mut refs = References::default();
        refs.walk(&read.body);
        if read.parsed.body_type_url == CLUSTER && read.body["type"] == "EDS" {
            let eds = &read.body["edsClusterConfig"];
            if from_this_server(&eds["edsConfig"]) {
                let service = eds["serviceName"]
                    .as_str()
                    .map_or_else(|| read.envoy_name(), str::to_owned);
                if !endpoints.contains(&service) {
                    findings.push(read.warning(format!(
                        "EDS cluster {service:?} has no load assignment: no file defines {service:?} in \
                         envoy/config/endpoint/v3/clusterloadassignments, so Envoy waits for its endpoints"
                    )));
                }
            }
        }
        for cluster in refs.clusters.iter().filter(|c| !clusters.contains(*c)) {
            findings.push(read.warning(format!(
                "routes to cluster {cluster:?}, which no file defines in envoy/config/cluster/v3/clusters"
            )));
        }
        for route in refs.routes.iter().filter(|r| !routes.contains(*r)) {
            findings.push(read.warning(format!(
                "RDS name {route:?} has no route configuration: no file defines it in \
                 envoy/config/route/v3/routeconfigurations"
            )));
        }
        for secret in refs.secrets.iter().filter(|s| !secrets.contains(*s)) {
            findings.push(read.warning(format!(
                "SDS name {secret:?} has no secret: no file defines it in \
                 envoy/extensions/transport_sockets/tls/v3/secrets"
            )));
        }
    }
    findings
}

/// The names an Envoy resource asks this server for, wherever they are in
/// it (a listener's filters and transport sockets, a route configuration's
/// routes, inline route configurations).
#[derive(Default)]
struct References {
    clusters: BTreeSet<String>,
    routes: BTreeSet<String>,
    secrets: BTreeSet<String>,
}

impl References {
    fn walk(&mut self, value: &Value) {
        match value {
            Value::Array(values) => values.iter().for_each(|v| self.walk(v)),
            Value::Object(fields) => {
                if let Some(cluster) = fields.get("route").and_then(|r| r["cluster"].as_str()) {
                    self.clusters.insert(cluster.to_owned());
                }
                if fields.get("@type").and_then(Value::as_str) == Some(TCP_PROXY) {
                    self.clusters
                        .extend(fields.get("cluster").and_then(Value::as_str).map(str::to_owned));
                }
                if let Some(Value::Array(weighted)) = fields.get("weightedClusters").map(|w| &w["clusters"]) {
                    self.clusters
                        .extend(weighted.iter().filter_map(|c| c["name"].as_str()).map(str::to_owned));
                }
                if let Some(rds) = fields.get("rds") {
                    if from_this_server(&rds["configSource"]) {
                        self.routes.extend(rds["routeConfigName"].as_str().map(str::to_owned));
                    }
                }
                let sds = fields
                    .get("tlsCertificateSdsSecretConfigs")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .chain(fields.get("validationContextSdsSecretConfig"));
                for config in sds {
                    // Without sds_config the secret is the bootstrap's own.
                    if from_this_server(&config["sdsConfig"]) {
                        self.secrets.extend(config["name"].as_str().map(str::to_owned));
                    }
                }
                fields.values().for_each(|v| self.walk(v));
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
fn istio_subsets(served: &[Read]) -> Vec<Finding> {
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
        let mut wanted = BTreeSet::new();
        for kind in ["http", "tcp", "tls"] {
            for route in read.body[kind].as_array().into_iter().flatten() {
                let routes = route["route"].as_array().into_iter().flatten();
                let destinations = routes.map(|r| &r["destination"]).chain([&route["mirror"]]).chain(
                    route["mirrors"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|m| &m["destination"]),
                );
                for destination in destinations {
                    if let (Some(host), Some(subset)) = (destination["host"].as_str(), destination["subset"].as_str()) {
                        wanted.insert((host, subset));
                    }
                }
            }
        }
        for (host, subset) in wanted {
            let full = fqdn(host, ns);
            let defined = rules
                .iter()
                .any(|(rule_host, subsets)| covers(rule_host, &full) && subsets.contains(subset));
            if !defined {
                findings.push(read.warning(format!(
                    "routes to subset {subset:?} of host {host:?}, which no DestinationRule for {full} defines \
                     (Envoy answers such routes 503)"
                )));
            }
        }
    }
    findings
}

/// The findings in the chosen form.
pub fn render(report: &Report, output: CheckOutput) -> String {
    match output {
        CheckOutput::Text => report
            .findings
            .iter()
            .map(|f| match f.severity {
                Severity::Error => format!("{}:{}: {}\n", f.file, f.line, f.message),
                Severity::Warning => format!("{}:{}: warning: {}\n", f.file, f.line, f.message),
            })
            .collect(),
        CheckOutput::Json => {
            let mut json = serde_json::to_string_pretty(&report.findings).expect("findings are JSON");
            json.push('\n');
            json
        }
        CheckOutput::Github => report
            .findings
            .iter()
            .map(|f| {
                let level = match f.severity {
                    Severity::Error => "error",
                    Severity::Warning => "warning",
                };
                let mut properties = format!("file={}", annotation_property(&f.file));
                if f.line > 0 {
                    properties.push_str(&format!(",line={}", f.line));
                }
                if let (Some(collection), Some(name)) = (&f.collection, &f.name) {
                    properties.push_str(&format!(
                        ",title={}",
                        annotation_property(&format!("{collection} {name}"))
                    ));
                }
                format!("::{level} {properties}::{}\n", annotation_data(&f.message))
            })
            .collect(),
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
