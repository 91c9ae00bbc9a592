//! Who may read what (`--access-policy`): rules from the identities TLS
//! proved (a client certificate's URI and DNS SANs, or `unauthenticated`)
//! to collections and resource names. A node id is self-asserted and is
//! never an identity. Without a policy every collection but the sensitive
//! ones (those that hold secrets) is readable by every client the transport
//! admits, and the sensitive ones by nobody.
//!
//! Patterns ([`super::pattern`], the same as the allow-lists'): `*` matches
//! any run of characters (`/` included), `{name}` captures one segment (one
//! or more characters other than `/`) of an identity, once per pattern, and
//! the capture is used in the rule's `names`, where it stands for the
//! captured text as it is (a `*` in a certificate is not a glob). An
//! identity pattern with a `scheme://` matches URI SANs only, any other DNS
//! SANs only ([`IdentityPattern`]).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::fswatch::DirWatch;
use super::identity::{IdentityPattern, PeerIdentity};
use super::pattern::{Captures, Pattern};
use crate::metrics as m;
use crate::SharedStr;

pub use super::identity::UNAUTHENTICATED;
pub use super::pattern::Glob;

/// Rules one policy may hold (each stream's start reads them all).
const MAX_RULES: usize = 10_000;

/// The largest policy file read, in bytes.
pub const MAX_POLICY_BYTES: u64 = 4 << 20;

// === The policy file ===

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    rules: Vec<RuleFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    identities: Vec<String>,
    collections: Vec<String>,
    #[serde(default)]
    names: Option<Vec<String>>,
    /// The rule's identities may also be canaries of its collections
    /// (`--canary` selectors then choose among them): see [`AccessPolicy::canary`].
    #[serde(default)]
    canary: bool,
}

/// One rule: who, which collections, which names, and whether its
/// identities may be canaries of its collections.
#[derive(Clone, Debug)]
struct Rule {
    /// The line of its `identities` in the file, where known (denials name
    /// the rule by index and line).
    line: Option<usize>,
    identities: Vec<IdentityPattern>,
    collections: Vec<Pattern>,
    names: Vec<Pattern>,
    canary: bool,
}

/// Why an identity may be a canary of a collection: the first rule with
/// `canary: true` that grants it, and the SAN that matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CanaryPermit {
    /// The rule's index in the file (`rules[N]`).
    pub rule: usize,
    /// The rule's identity pattern that matched, as written.
    pub pattern: String,
    /// The identity it matched, as printed (its SANs with their kinds).
    pub identity: String,
}

// === The policy in effect ===

/// The policy in effect, replaced whole when its file changes and the new
/// one loads (a bad new file keeps the last good policy, logged and
/// counted). Streams watch it: a reload that takes away what a client reads
/// takes it away on its live stream.
#[derive(Debug)]
pub struct AccessControl {
    current: watch::Sender<Arc<AccessPolicy>>,
}

impl AccessControl {
    pub fn new(policy: Arc<AccessPolicy>) -> Arc<Self> {
        Arc::new(Self {
            current: watch::Sender::new(policy),
        })
    }

    pub fn current(&self) -> Arc<AccessPolicy> {
        self.current.borrow().clone()
    }

    /// The policy as it changes.
    pub fn subscribe(&self) -> watch::Receiver<Arc<AccessPolicy>> {
        self.current.subscribe()
    }

    /// Reads the policy file again when it changes (it, or a Kubernetes
    /// volume's `..data` swap; nothing else in its directory), until
    /// `shutdown`. Nothing to watch without a file.
    pub fn watch(self: &Arc<Self>, shutdown: CancellationToken, tasks: &TaskTracker) -> Result<(), PolicyError> {
        let Some(path) = self.current().path().map(Path::to_path_buf) else {
            return Ok(());
        };
        let mut watch = DirWatch::files(&[&path]).map_err(|e| PolicyError {
            path: path.clone(),
            line: None,
            message: format!("cannot watch it for changes: {e}"),
        })?;
        let control = self.clone();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    changed = watch.changed() => if !changed { return },
                    _ = shutdown.cancelled() => return,
                }
                control.reload(&path).await;
            }
        });
        Ok(())
    }

    /// Loads the file at `path` and puts it in effect, or keeps the policy
    /// in effect when it does not load.
    pub async fn reload(&self, path: &Path) {
        let reading = path.to_path_buf();
        // Reading a file blocks: on the blocking pool.
        let loaded = tokio::task::spawn_blocking(move || AccessPolicy::load(&reading))
            .await
            .unwrap_or_else(|e| {
                Err(PolicyError {
                    path: path.to_path_buf(),
                    line: None,
                    message: format!("reading it failed: {e}"),
                })
            });
        match loaded {
            Ok(policy) => {
                m::access_policy_reloaded(true);
                tracing::info!(
                    policy = %path.display(),
                    rules = policy.rule_count(),
                    "--access-policy reloaded; streams re-read what they may serve"
                );
                self.current.send_replace(Arc::new(policy));
            }
            Err(e) => {
                m::access_policy_reloaded(false);
                tracing::warn!(
                    error = %e,
                    "--access-policy changed but does not load; the last good policy stays in effect"
                );
            }
        }
    }
}

/// A policy that does not load: the file, the line where known, and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct PolicyError {
    pub path: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

/// The rules in effect, or none (the default: everything but the sensitive
/// collections, to everyone).
#[derive(Debug, Default)]
pub struct AccessPolicy {
    /// The file it came from (`None`: no `--access-policy`).
    path: Option<PathBuf>,
    rules: Vec<Rule>,
    /// The rules as written, for `/debug/config`.
    written: Vec<serde_json::Value>,
}

/// What an identity may read of one collection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grant {
    /// Every resource.
    All,
    /// The resources whose names match.
    Names(Arc<NameGrant>),
}

/// The names an identity may read of a collection: the union of the globs
/// its rules grant. `key` is the same for equal grants, so clients of one
/// grant share what is made for it.
#[derive(Debug, PartialEq, Eq)]
pub struct NameGrant {
    pub key: SharedStr,
    globs: Vec<Glob>,
}

impl NameGrant {
    fn new(mut globs: Vec<Glob>) -> Self {
        globs.sort();
        globs.dedup();
        // As a JSON list: no text a capture holds (a `,`) makes two grants
        // one key, whose clients would share one view.
        let patterns: Vec<String> = globs.iter().map(Glob::to_string).collect();
        let key = serde_json::to_string(&patterns).expect("strings serialize");
        NameGrant { key: key.into(), globs }
    }

    pub fn allows(&self, name: &str) -> bool {
        self.globs.iter().any(|g| g.matches(name))
    }

    /// The globs, as written with the captures filled in.
    pub fn patterns(&self) -> Vec<String> {
        self.globs.iter().map(Glob::to_string).collect()
    }
}

/// A rule that names a collection, for an operator: `/debug/access` and
/// the log of a denial (never a refused client: a client learns nothing of
/// the policy's rules).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RuleRef {
    /// Its index in `rules`.
    pub rule: usize,
    /// The line of its `identities` in the file, where known.
    pub line: Option<usize>,
    pub identities: Vec<String>,
    pub names: Vec<String>,
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rules[{}]", self.rule)?;
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        write!(f, " grants names {:?} to identities {:?}", self.names, self.identities)
    }
}

/// Why an identity may not read a collection or a name: what the refused
/// client is told, and what the log says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// Who, what, and a rule that would grant it, built from the client's
    /// own identity: nothing of the policy's rules, nor its file.
    pub status: String,
    /// The same, then the rules that name the collection, by index and line
    /// (none: no rule names it).
    pub log: String,
}

impl AccessPolicy {
    /// No `--access-policy`: the default.
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads and checks the policy file at `path`.
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let error = |line: Option<usize>, message: String| PolicyError {
            path: path.to_path_buf(),
            line,
            message,
        };
        let metadata = std::fs::metadata(path).map_err(|e| error(None, format!("cannot read it: {e}")))?;
        if !metadata.is_file() {
            return Err(error(None, "is not a regular file".into()));
        }
        if metadata.len() > MAX_POLICY_BYTES {
            return Err(error(
                None,
                format!(
                    "is {} bytes; a policy is at most {MAX_POLICY_BYTES} bytes",
                    metadata.len()
                ),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| error(None, format!("cannot read it: {e}")))?;
        let mut policy = Self::parse(&text).map_err(|(line, message)| error(line, message))?;
        policy.path = Some(path.to_path_buf());
        Ok(policy)
    }

    /// Parses a policy: `Err((line, message))`.
    fn parse(text: &str) -> Result<Self, (Option<usize>, String)> {
        let file: PolicyFile = serde_norway::from_str(text).map_err(|e| {
            let line = e.location().map(|l| l.line());
            // serde_norway ends its message with the location; the line is
            // said before it instead.
            let message = e.to_string();
            let message = match message.rfind(" at line ") {
                Some(at) => message[..at].to_owned(),
                None => message,
            };
            (line, message)
        })?;
        if file.rules.len() > MAX_RULES {
            return Err((
                None,
                format!("{} rules; a policy has at most {MAX_RULES}", file.rules.len()),
            ));
        }
        let mut rules = Vec::with_capacity(file.rules.len());
        let mut written = Vec::with_capacity(file.rules.len());
        for (i, rule) in file.rules.into_iter().enumerate() {
            let at = |field: &str, item: Option<usize>, message: String| {
                let line = line_of(text, i, field, item);
                let item = item.map(|n| format!("[{n}]")).unwrap_or_default();
                (line, format!("rules[{i}].{field}{item}: {message}"))
            };
            let patterns = |field: &str, values: &[String], captures: Captures| -> Result<Vec<Pattern>, _> {
                if values.is_empty() {
                    return Err(at(field, None, "is empty: the rule would match nothing".into()));
                }
                values
                    .iter()
                    .enumerate()
                    .map(|(n, v)| Pattern::parse(v.trim(), captures).map_err(|m| at(field, Some(n), m)))
                    .collect()
            };
            // The flags' rule: a pattern without a `scheme://` that holds
            // `/` or `:` is refused (it would be a rule that never applies).
            let identities: Vec<IdentityPattern> = patterns("identities", &rule.identities, Captures::Take)?
                .into_iter()
                .enumerate()
                .map(|(n, p)| IdentityPattern::try_from(p).map_err(|m| at("identities", Some(n), m)))
                .collect::<Result<_, _>>()?;
            let collections = patterns("collections", &rule.collections, Captures::None)?;
            let names_written = rule.names.clone().unwrap_or_else(|| vec!["*".into()]);
            let names = patterns("names", &names_written, Captures::Use)?;
            for (n, name) in names.iter().enumerate() {
                for capture in name.captures() {
                    if let Some(identity) = identities.iter().find(|id| !id.captures().any(|c| c == capture)) {
                        return Err(at(
                            "names",
                            Some(n),
                            format!(
                                "uses {{{capture}}}, which the rule's identity {:?} does not capture: every identity \
                                 of the rule must capture what its names use",
                                identity.text()
                            ),
                        ));
                    }
                }
            }
            if rule.canary {
                // Canary membership rests on a proven identity, and a canary
                // round counts only clients that read the whole collection.
                if let Some(n) = identities.iter().position(|id| id.text() == UNAUTHENTICATED) {
                    return Err(at(
                        "identities",
                        Some(n),
                        "a rule with canary: true needs identities a certificate proves; an unauthenticated client \
                         proves nothing (--canary-trust-node-ids lets node ids alone decide, if you must)"
                            .into(),
                    ));
                }
                if rule.names.as_ref().is_some_and(|n| n.iter().any(|n| n.trim() != "*")) {
                    return Err(at(
                        "canary",
                        None,
                        "a canary reads whole collections (a client that may read part of one has versions of its \
                         own and takes no part in rounds): leave `names` out of a rule with canary: true"
                            .into(),
                    ));
                }
            }
            let mut json = serde_json::json!({
                "identities": rule.identities,
                "collections": rule.collections,
                "names": names_written,
            });
            if rule.canary {
                json["canary"] = true.into();
            }
            written.push(json);
            rules.push(Rule {
                line: line_of(text, i, "identities", None),
                identities,
                collections,
                names,
                canary: rule.canary,
            });
        }
        Ok(Self {
            path: None,
            rules,
            written,
        })
    }

    /// The file in effect, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The rules as written (after defaults), for `/debug/config`.
    pub fn rules_json(&self) -> serde_json::Value {
        serde_json::Value::Array(self.written.clone())
    }

    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// How many rules have `canary: true`.
    pub fn canary_rules(&self) -> usize {
        self.rules.iter().filter(|r| r.canary).count()
    }

    /// Whether any identity may be a canary of `collection`: a rule with
    /// `canary: true` grants it.
    pub fn canary_covers(&self, collection: &str) -> bool {
        self.rules
            .iter()
            .any(|rule| rule.canary && rule.collections.iter().any(|p| p.matches(collection).is_some()))
    }

    /// Whether `identity` may be a canary of `collection`: the first rule
    /// with `canary: true` whose collections match it and whose identities
    /// match one of its SANs (by the rule of [`Self::grant`]: a URI pattern
    /// URI SANs, any other DNS SANs). Never without a certificate.
    pub fn canary(&self, identity: &PeerIdentity, collection: &str) -> Option<CanaryPermit> {
        let rules = self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.canary && rule.collections.iter().any(|p| p.matches(collection).is_some()));
        for (rule, patterns) in rules.map(|(i, r)| (i, &r.identities)) {
            if let Some(pattern) = patterns.iter().find(|pattern| pattern.admits(identity)) {
                return Some(CanaryPermit {
                    rule,
                    pattern: pattern.text().to_owned(),
                    identity: identity.to_string(),
                });
            }
        }
        None
    }

    /// What `identity` may read of `collection` (`sensitive`: it holds
    /// secrets); `None`: nothing.
    pub fn grant(&self, identity: &PeerIdentity, collection: &str, sensitive: bool) -> Option<Grant> {
        if self.path.is_none() {
            return (!sensitive).then_some(Grant::All);
        }
        let mut globs = Vec::new();
        for rule in &self.rules {
            if !rule.collections.iter().any(|p| p.matches(collection).is_some()) {
                continue;
            }
            for pattern in &rule.identities {
                // A URI pattern matches URI SANs, any other DNS SANs: a DNS
                // SAN that spells a SPIFFE id is not that identity.
                for captured in pattern.matches(identity) {
                    for names in &rule.names {
                        // Every name a rule's names use is captured by each
                        // of its identities (checked at load).
                        let Some(glob) = names.substitute(&captured) else {
                            continue;
                        };
                        if glob.is_everything() {
                            return Some(Grant::All);
                        }
                        globs.push(glob);
                    }
                }
            }
        }
        (!globs.is_empty()).then(|| Grant::Names(Arc::new(NameGrant::new(globs))))
    }

    /// The rules whose collections match `collection`, for an operator.
    pub fn rules_for(&self, collection: &str) -> Vec<RuleRef> {
        self.rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule.collections.iter().any(|p| p.matches(collection).is_some()))
            .map(|(i, rule)| RuleRef {
                rule: i,
                line: rule.line,
                identities: rule.identities.iter().map(|p| p.text().to_owned()).collect(),
                names: rule.names.iter().map(|p| p.text().to_owned()).collect(),
            })
            .collect()
    }

    /// Why `identity` may not read `collection` (or `name` of it): for the
    /// status of a refused stream (a rule that would grant it) and the log
    /// (with the rules that name the collection).
    pub fn denial(&self, identity: &PeerIdentity, collection: &str, name: Option<&str>) -> Denial {
        let asked = match name {
            Some(name) => format!("{name:?} of {collection:?}"),
            None => format!("{collection:?}"),
        };
        let status = if self.path.is_none() {
            format!(
                "identity {identity} may not read {asked}: it holds secrets, and no --access-policy is given \
                 (without one, sensitive collections are served to nobody); an --access-policy rule naming this \
                 identity and collection would grant it"
            )
        } else {
            format!(
                "identity {identity} may not read {asked}: no rule of --access-policy grants it; {}",
                would_grant(identity, collection, name)
            )
        };
        let rules = self.rules_for(collection);
        let log = match (&self.path, rules.is_empty()) {
            (None, _) => status.clone(),
            (Some(_), true) => format!("{status} (no rule names {collection:?})"),
            (Some(_), false) => {
                let rules: Vec<String> = rules.iter().map(RuleRef::to_string).collect();
                format!("{status} (rules naming {collection:?}: {})", rules.join("; "))
            }
        };
        Denial { status, log }
    }

    /// What `identity` would read of each of `collections` (with whether
    /// each is sensitive): `/debug/access`. `identity` as
    /// [`PeerIdentity::parse`] reads it: `unauthenticated`, `uri:…`,
    /// `dns:…`, or one SAN whose kind its `scheme://` tells.
    pub fn explain(&self, identity: &str, collections: &[(SharedStr, bool)]) -> BTreeMap<SharedStr, Option<Grant>> {
        let peer = PeerIdentity::parse(identity);
        collections
            .iter()
            .map(|(c, sensitive)| (c.clone(), self.grant(&peer, c, *sensitive)))
            .collect()
    }
}

/// A rule that would grant `identity` `collection` (or `name` of it), built
/// from the identity alone; or why none can (no pattern matches a DNS SAN
/// written with a `scheme://`, a URI SAN without one, or no SAN at all).
fn would_grant(identity: &PeerIdentity, collection: &str, name: Option<&str>) -> String {
    match identity.as_pattern() {
        Some(pattern) => format!(
            "a rule that would: {{identities: [{pattern:?}], collections: [{collection:?}], names: [{:?}]}}",
            name.unwrap_or("*")
        ),
        None => format!(
            "no rule can: no identity pattern matches {identity} (a pattern with a `scheme://` matches URI SANs \
             only, any other DNS SANs only; a SAN holding `*`, `{{` or `}}` only globs that match others too)"
        ),
    }
}

/// The line of `rules[rule].field[item]` in `text`: found by reading the
/// document's lines for the rule's n-th `- ` item at the rules' indent, then
/// the field under it. Good enough for the policy's own simple layout; `None`
/// when the layout is not that (flow style, anchors).
fn line_of(text: &str, rule: usize, field: &str, item: Option<usize>) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let rules_at = lines.iter().position(|l| l.trim_start().starts_with("rules:"))?;
    // The rules' items: `- ` lines at the first item's indent.
    let first_item = (rules_at + 1..lines.len()).find(|&i| lines[i].trim_start().starts_with("- "))?;
    let item_indent = indent(lines[first_item]);
    let starts: Vec<usize> = (first_item..lines.len())
        .filter(|&i| indent(lines[i]) == item_indent && lines[i].trim_start().starts_with("- "))
        .collect();
    let start = *starts.get(rule)?;
    let end = starts.get(rule + 1).copied().unwrap_or(lines.len());
    let key = format!("{field}:");
    let field_at = (start..end).find(|&i| {
        let l = lines[i].trim_start();
        l.strip_prefix("- ").unwrap_or(l).trim_start().starts_with(&key)
    })?;
    let Some(item) = item else {
        return Some(field_at + 1);
    };
    // A flow list on the field's line: that line.
    if lines[field_at].contains('[') {
        return Some(field_at + 1);
    }
    let items: Vec<usize> = (field_at + 1..end)
        .filter(|&i| lines[i].trim_start().starts_with("- "))
        .take_while(|&i| indent(lines[i]) > item_indent)
        .collect();
    items.get(item).map(|&i| i + 1).or(Some(field_at + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate's identities: URI SANs (with `://`), then DNS SANs.
    fn peer(names: &[&str]) -> PeerIdentity {
        let (uris, dns): (Vec<String>, Vec<String>) =
            names.iter().map(|n| n.to_string()).partition(|n| n.contains("://"));
        PeerIdentity::certified(uris, dns)
    }

    fn policy(text: &str) -> AccessPolicy {
        let mut policy = AccessPolicy::parse(text).unwrap();
        policy.path = Some("policy.yaml".into());
        policy
    }

    const ISSUE: &str = r#"
rules:
- identities: ["spiffe://cluster.local/ns/{namespace}/sa/*"]
  collections: ["envoy/extensions/transport_sockets/tls/v3/secrets"]
  names: ["{namespace}/*"]
- identities: ["spiffe://cluster.local/ns/istio-system/sa/istiod*", "spiffe://cluster.local/ns/istio-system/sa/pilot"]
  collections: ["istio/*"]
- identities: ["unauthenticated"]
  collections: ["envoy/config/*"]
"#;

    const SECRETS: &str = "envoy/extensions/transport_sockets/tls/v3/secrets";

    #[test]
    fn the_issues_example_grants_what_it_says() {
        let p = policy(ISSUE);
        let frontend = peer(&["spiffe://cluster.local/ns/shop/sa/frontend"]);
        let Some(Grant::Names(shop)) = p.grant(&frontend, SECRETS, true) else {
            panic!("a name grant")
        };
        assert!(shop.allows("shop/frontend-cert"));
        assert!(shop.allows("shop/a/b"), "* crosses /");
        assert!(!shop.allows("other/frontend-cert"));
        assert!(!shop.allows("shopping/x"), "the capture is the whole segment");
        assert_eq!(shop.patterns(), vec!["shop/*"]);
        assert_eq!(
            p.grant(&frontend, "istio/networking/v1alpha3/virtualservices", false),
            None
        );
        assert_eq!(p.grant(&frontend, "envoy/config/cluster/v3/clusters", false), None);

        let istiod = peer(&["spiffe://cluster.local/ns/istio-system/sa/istiod-1-20"]);
        assert_eq!(
            p.grant(&istiod, "istio/networking/v1alpha3/virtualservices", false),
            Some(Grant::All)
        );
        let pilot = peer(&["spiffe://cluster.local/ns/istio-system/sa/pilot"]);
        assert_eq!(
            p.grant(&pilot, "istio/mesh/v1alpha1/MeshConfig", false),
            Some(Grant::All)
        );
        assert_eq!(
            p.grant(
                &peer(&["spiffe://cluster.local/ns/istio-system/sa/pilot2"]),
                "istio/x",
                false
            ),
            None,
            "an exact identity is exact"
        );
        // istiod's own namespace's secrets, by the first rule.
        let Some(Grant::Names(own)) = p.grant(&istiod, SECRETS, true) else {
            panic!()
        };
        assert_eq!(own.patterns(), vec!["istio-system/*"]);

        let nobody = PeerIdentity::default();
        assert_eq!(
            p.grant(&nobody, "envoy/config/cluster/v3/clusters", false),
            Some(Grant::All)
        );
        assert_eq!(
            p.grant(&nobody, SECRETS, true),
            None,
            "`*` globs match certificates only"
        );
        assert_eq!(p.grant(&frontend, "envoy/config/cluster/v3/clusters", false), None);
    }

    #[test]
    fn without_a_policy_everything_but_secrets_is_read_by_everyone() {
        let p = AccessPolicy::none();
        let anyone = peer(&["spiffe://x/ns/a/sa/b"]);
        assert_eq!(p.grant(&anyone, "istio/x", false), Some(Grant::All));
        assert_eq!(p.grant(&PeerIdentity::default(), "istio/x", false), Some(Grant::All));
        assert_eq!(p.grant(&anyone, SECRETS, true), None);
        assert!(p
            .denial(&anyone, SECRETS, None)
            .status
            .contains("no --access-policy is given"));
    }

    #[test]
    fn a_dns_san_and_several_rules_add_up() {
        let p = policy(
            r#"
rules:
- identities: ["*.tenant-a.example"]
  collections: ["c"]
  names: ["a/*"]
- identities: ["{host}.tenant-a.example"]
  collections: ["c", "d"]
  names: ["{host}", "shared/*"]
"#,
        );
        let Some(Grant::Names(g)) = p.grant(&peer(&["spiffe://x", "web.tenant-a.example"]), "c", false) else {
            panic!()
        };
        assert_eq!(g.patterns(), vec!["a/*", "shared/*", "web"]);
        assert!(g.allows("web") && !g.allows("web2") && g.allows("a/x"));
        let Some(Grant::Names(d)) = p.grant(&peer(&["web.tenant-a.example"]), "d", false) else {
            panic!()
        };
        assert_eq!(d.patterns(), vec!["shared/*", "web"]);
        assert_eq!(p.grant(&peer(&["web.tenant-b.example"]), "c", false), None);
    }

    #[test]
    fn a_star_in_a_certificate_is_not_a_glob() {
        let p =
            policy("rules:\n- identities: [\"spiffe://x/ns/{ns}/sa/a\"]\n  collections: [c]\n  names: [\"{ns}/x\"]\n");
        let Some(Grant::Names(g)) = p.grant(&peer(&["spiffe://x/ns/*/sa/a"]), "c", false) else {
            panic!()
        };
        assert!(g.allows("*/x"));
        assert!(!g.allows("shop/x"), "the captured * is literal");
        assert_ne!(
            g.key.as_str(),
            "[\"*/x\"]",
            "a literal star is written escaped in the key"
        );
    }

    /// Grants made of different globs never share a key, whatever text the
    /// captures hold (a `,` joined two globs into what one capture spelled).
    #[test]
    fn a_capture_holding_a_comma_does_not_make_two_grants_one() {
        let p = policy(
            "rules:\n- identities: [\"spiffe://x/ns/{ns}/sa/a\"]\n  collections: [c]\n  names: [\"{ns}\", \"b\"]\n",
        );
        let Some(Grant::Names(two)) = p.grant(&peer(&["spiffe://x/ns/a/sa/a"]), "c", false) else {
            panic!()
        };
        let Some(Grant::Names(one)) = p.grant(&peer(&["spiffe://x/ns/a,b/sa/a"]), "c", false) else {
            panic!()
        };
        assert!(!one.allows("a") && one.allows("a,b"));
        assert!(two.allows("a"));
        assert_ne!(one.key, two.key);
    }

    /// `unauthenticated` is a peer without a certificate, not one whose
    /// certificate has no SANs; a DNS SAN spelling a URI is not that URI.
    #[test]
    fn identities_are_matched_by_their_kind() {
        let p = policy(ISSUE);
        let sanless = PeerIdentity::certified(Vec::new(), Vec::new());
        assert_eq!(p.grant(&sanless, "envoy/config/cluster/v3/clusters", false), None);
        assert_eq!(sanless.to_string(), "(a certificate without URI or DNS SANs)");
        let dns_spelling_a_uri = PeerIdentity::certified(Vec::new(), vec![FRONTEND_ID.into()]);
        assert_eq!(p.grant(&dns_spelling_a_uri, SECRETS, true), None);
        let p = policy("rules:\n- identities: [\"*.example\"]\n  collections: [c]\n");
        assert_eq!(p.grant(&peer(&["web.example"]), "c", false), Some(Grant::All));
        assert_eq!(
            p.grant(
                &PeerIdentity::certified(vec!["web.example".into()], Vec::new()),
                "c",
                false
            ),
            None,
            "a DNS pattern does not match a URI SAN"
        );
    }

    const FRONTEND_ID: &str = "spiffe://cluster.local/ns/shop/sa/frontend";

    /// A refused client is told who it is (with its kind), what it asked,
    /// and a rule that would grant it, never the policy's file nor its
    /// rules; the log adds the rules that name the collection, by index
    /// and line.
    #[test]
    fn a_denial_says_what_would_grant_and_the_log_which_rules_name_it() {
        let p = policy(ISSUE);
        let frontend = peer(&[FRONTEND_ID]);
        let denial = p.denial(&frontend, "envoy/config/cluster/v3/clusters", None);
        assert_eq!(
            denial.status,
            "identity uri:spiffe://cluster.local/ns/shop/sa/frontend may not read \"envoy/config/cluster/v3/clusters\": \
             no rule of --access-policy grants it; a rule that would: {identities: \
             [\"spiffe://cluster.local/ns/shop/sa/frontend\"], collections: [\"envoy/config/cluster/v3/clusters\"], \
             names: [\"*\"]}"
        );
        assert!(!denial.status.contains("policy.yaml") && !denial.status.contains("rules["));
        assert_eq!(
            denial.log,
            format!(
                "{} (rules naming \"envoy/config/cluster/v3/clusters\": rules[2] (line 8) grants names [\"*\"] to \
                 identities [\"unauthenticated\"])",
                denial.status
            )
        );
        let named = p.denial(&frontend, SECRETS, Some("other/key"));
        assert!(
            named.status.contains("may not read \"other/key\" of"),
            "{}",
            named.status
        );
        assert!(named.status.contains("names: [\"other/key\"]"), "{}", named.status);
        assert!(
            named
                .log
                .contains("rules[0] (line 3) grants names [\"{namespace}/*\"] to identities"),
            "{}",
            named.log
        );
        assert!(p
            .denial(&frontend, "nothing/names/it", None)
            .log
            .ends_with("(no rule names \"nothing/names/it\")"));

        // No pattern can spell a DNS SAN written as a URI: no rule is offered.
        let spelled = PeerIdentity::certified(Vec::new(), vec![FRONTEND_ID.into()]);
        let denial = p.denial(&spelled, SECRETS, None);
        assert!(
            denial
                .status
                .starts_with(&format!("identity dns:{FRONTEND_ID} may not read"))
                && denial.status.contains("no rule can: no identity pattern matches"),
            "{}",
            denial.status
        );
        let unauthenticated = p.denial(&PeerIdentity::default(), SECRETS, None);
        assert!(
            unauthenticated.status.contains("{identities: [\"unauthenticated\"]"),
            "{}",
            unauthenticated.status
        );
    }

    /// A name captured twice in one identity would have to match the same
    /// text twice: refused at load, naming the line, so that `{ns}` never
    /// stands for one segment while another grants it.
    #[test]
    fn a_capture_taken_twice_is_refused_at_load_naming_the_line() {
        let (line, message) = AccessPolicy::parse(
            "rules:\n- identities: [\"spiffe://x/*\"]\n  collections: [c]\n- identities:\n  - \"spiffe://cluster.local/ns/{ns}/sa/{ns}\"\n  collections: [c]\n  names: [\"{ns}/*\"]\n",
        )
        .unwrap_err();
        assert_eq!(line, Some(5), "{message}");
        assert!(
            message
                .starts_with("rules[1].identities[0]: \"spiffe://cluster.local/ns/{ns}/sa/{ns}\": captures {ns} twice"),
            "{message}"
        );
        // Two names, or a name and a star: `shop/frontend` takes `shop`
        // only from the namespace's segment.
        let p = policy(
            "rules:\n- identities: [\"spiffe://cluster.local/ns/{ns}/sa/{sa}\"]\n  collections: [c]\n  names: [\"{ns}/{sa}\", \"{ns}-{ns}\"]\n",
        );
        let Some(Grant::Names(g)) = p.grant(&peer(&[FRONTEND_ID]), "c", false) else {
            panic!()
        };
        assert_eq!(g.patterns(), vec!["shop-shop", "shop/frontend"]);
    }

    /// `/debug/access?identity=` reads an identity with its kind: a DNS SAN
    /// spelling a SPIFFE id is granted nothing the URI SAN is.
    #[test]
    fn explain_reads_the_kind_of_an_identity() {
        let p = policy(ISSUE);
        let collections = [(SharedStr::from(SECRETS), true)];
        let grant = |identity: &str| p.explain(identity, &collections).into_values().next().flatten();
        let shop = grant(&format!("uri:{FRONTEND_ID}"));
        assert!(
            matches!(&shop, Some(Grant::Names(g)) if g.patterns() == ["shop/*"]),
            "{shop:?}"
        );
        assert_eq!(grant(FRONTEND_ID), shop, "a bare SAN with a scheme:// is a URI SAN");
        assert_eq!(grant(&format!("dns:{FRONTEND_ID}")), None);
        assert_eq!(
            grant(&format!("dns:web.example, uri:{FRONTEND_ID}")),
            shop,
            "as /debug/syncz prints a stream's identity"
        );
        assert_eq!(grant("unauthenticated"), None);
    }

    #[test]
    fn bad_policies_name_the_line_and_the_field() {
        let err = |text: &str| AccessPolicy::parse(text).unwrap_err();
        let (line, message) = err("rules:\n- identities: [a]\n  collections: [c]\n  nmes: [x]\n");
        assert_eq!(line, Some(4), "{message}");
        assert!(message.contains("unknown field `nmes`"), "{message}");
        let (line, message) = err(
            "rules:\n- identities: [a]\n  collections: [c]\n- identities:\n  - spiffe://x/ns/{ns}/sa/a\n  - spiffe://y/*\n  collections: [c]\n  names:\n  - \"{ns}/x\"\n",
        );
        assert_eq!(line, Some(9), "{message}");
        assert!(
            message.starts_with(
                "rules[1].names[0]: uses {ns}, which the rule's identity \"spiffe://y/*\" does not capture"
            ),
            "{message}"
        );
        let (line, message) = err("rules:\n- identities: []\n  collections: [c]\n");
        assert_eq!(line, Some(2));
        assert!(message.contains("rules[0].identities: is empty"), "{message}");
        let (_, message) = err("rules:\n- identities: [a]\n  collections: [\"{x}\"]\n");
        assert!(message.contains("not allowed here"), "{message}");
        let (_, message) = err("rules:\n- identities: [\"a{b\"]\n  collections: [c]\n");
        assert!(message.contains("without its"), "{message}");
        let (line, message) = err("rules: [\n");
        assert!(line.is_some(), "{message}");
        let (_, message) = err("rulez: []\n");
        assert!(message.contains("unknown field `rulez`"), "{message}");
        let (_, message) = err(&format!(
            "rules:\n- identities: [\"{}\"]\n  collections: [c]\n",
            "*a".repeat(super::super::pattern::MAX_WILDCARDS + 1)
        ));
        assert!(message.contains("at most 8 wildcards"), "{message}");
    }

    /// A pattern without a `scheme://` that holds `/` or `:` could match
    /// only a DNS SAN that spells a URI, and none matches: refused at load
    /// as the flags refuse it, naming the rule, its line and what to write.
    #[test]
    fn a_scheme_less_identity_with_a_slash_or_colon_is_refused_naming_the_rule() {
        for dead in ["cluster.local/ns/shop/sa/*", "spiffe:cluster.local", "*/sa/{sa}", "a:b"] {
            let (line, message) = AccessPolicy::parse(&format!(
                "rules:\n- identities: [web.example]\n  collections: [c]\n- identities:\n  - unauthenticated\n  - \"{dead}\"\n  collections: [c]\n"
            ))
            .unwrap_err();
            assert_eq!(line, Some(6), "{dead}: {message}");
            assert!(
                message.starts_with(&format!("rules[1].identities[1]: {dead:?} holds '/' or ':'")),
                "{message}"
            );
            assert!(message.contains("spiffe://"), "{message}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.yaml");
        std::fs::write(
            &path,
            "rules:\n- identities: [\"cluster.local/ns/a/sa/b\"]\n  collections: [c]\n",
        )
        .unwrap();
        let e = AccessPolicy::load(&path).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{}:2: rules[0].identities[0]: ", path.display())),
            "{e}"
        );
        // A DNS name and a URI pattern load.
        AccessPolicy::parse("rules:\n- identities: [\"*.svc\", \"spiffe://*/ns/a/sa/*\"]\n  collections: [c]\n")
            .unwrap();
    }

    #[test]
    fn the_benchmarks_policies_load_and_grant_the_load_clients() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support");
        let all = AccessPolicy::load(&dir.join("access-policy-100.yaml")).unwrap();
        assert_eq!(all.rule_count(), 100);
        assert_eq!(all.grant(&PeerIdentity::default(), "istio/x", false), Some(Grant::All));
        let names = AccessPolicy::load(&dir.join("access-policy-100-names.yaml")).unwrap();
        let Some(Grant::Names(grant)) = names.grant(&PeerIdentity::default(), "envoy/config/x", false) else {
            panic!("a names grant")
        };
        assert!(grant.allows("cluster-00042"));
    }

    #[test]
    fn a_missing_file_names_it() {
        let e = AccessPolicy::load(Path::new("/nonexistent/policy.yaml")).unwrap_err();
        assert_eq!(e.path, Path::new("/nonexistent/policy.yaml"));
        assert!(
            e.to_string().starts_with("/nonexistent/policy.yaml: cannot read it"),
            "{e}"
        );
    }
}
