//! Who may read what (`--access-policy`): rules from the identities TLS
//! proved (a client certificate's URI and DNS SANs, or `unauthenticated`)
//! to collections and resource names. A node id is self-asserted and is
//! never an identity. Without a policy every collection but the sensitive
//! ones (those that hold secrets) is readable by every client the transport
//! admits, and the sensitive ones by nobody.
//!
//! Patterns: `*` matches any run of characters (`/` included), `{name}`
//! captures one segment (one or more characters other than `/`) of an
//! identity, and the capture is used in the rule's `names`, where it stands
//! for the captured text as it is (a `*` in a certificate is not a glob).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::fswatch::DirWatch;
use super::identity::PeerIdentity;
use crate::metrics as m;

/// The identity of a client with no certificate: plaintext, or TLS without
/// a client certificate.
pub const UNAUTHENTICATED: &str = "unauthenticated";

/// Wildcards and captures one pattern may hold: identity patterns are
/// matched by backtracking, and this bounds the work of one match.
const MAX_WILDCARDS: usize = 8;

/// The longest pattern accepted, in bytes.
const MAX_PATTERN_BYTES: usize = 1024;

/// Rules one policy may hold (each stream's start reads them all).
const MAX_RULES: usize = 10_000;

/// The largest policy file read, in bytes.
pub const MAX_POLICY_BYTES: u64 = 4 << 20;

// === Patterns ===

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Token {
    Literal(String),
    /// `*`: any run of characters, `/` included, possibly empty.
    Star,
    /// `{name}`: one segment, one or more characters other than `/`.
    Capture(String),
}

/// A pattern as written, and its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pattern {
    text: String,
    tokens: Vec<Token>,
}

impl Pattern {
    /// Parses `text`; `captures` says whether `{name}` may appear.
    fn parse(text: &str, captures: bool) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an empty pattern matches nothing".into());
        }
        if text.len() > MAX_PATTERN_BYTES {
            return Err(format!("a pattern is at most {MAX_PATTERN_BYTES} bytes"));
        }
        let mut tokens = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            match c {
                '*' => {
                    push_literal(&mut tokens, &mut literal);
                    // `**` is `*`.
                    if tokens.last() != Some(&Token::Star) {
                        tokens.push(Token::Star);
                    }
                    rest = &rest[1..];
                }
                '{' => {
                    let Some(end) = rest.find('}') else {
                        return Err(format!("{text:?}: a `{{` without its `}}`"));
                    };
                    let name = &rest[1..end];
                    if !captures {
                        return Err(format!(
                            "{text:?}: captures ({{{name}}}) are taken from identities and used in names; they are not \
                             allowed here"
                        ));
                    }
                    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        return Err(format!(
                            "{text:?}: a capture is named with letters, digits and `_`, as {{namespace}}"
                        ));
                    }
                    push_literal(&mut tokens, &mut literal);
                    tokens.push(Token::Capture(name.to_owned()));
                    rest = &rest[end + 1..];
                }
                '}' => return Err(format!("{text:?}: a `}}` without its `{{`")),
                c => {
                    literal.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        push_literal(&mut tokens, &mut literal);
        let wild = tokens.iter().filter(|t| !matches!(t, Token::Literal(_))).count();
        if wild > MAX_WILDCARDS {
            return Err(format!(
                "{text:?}: at most {MAX_WILDCARDS} wildcards and captures in one pattern"
            ));
        }
        Ok(Pattern {
            text: text.to_owned(),
            tokens,
        })
    }

    /// Written as a URI (`scheme://…`): it matches URI SANs; else DNS SANs.
    fn is_uri(&self) -> bool {
        self.text.contains("://")
    }

    fn captures(&self) -> impl Iterator<Item = &str> {
        self.tokens.iter().filter_map(|t| match t {
            Token::Capture(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether `input` matches, with what each capture took.
    fn matches<'i>(&self, input: &'i str) -> Option<Vec<(&str, &'i str)>> {
        let mut captured = Vec::new();
        match_tokens(&self.tokens, input, &mut captured).then_some(captured)
    }

    /// The pattern with each capture replaced by what it took, as literal
    /// text: a glob of literals and stars.
    fn substitute(&self, captured: &[(&str, &str)]) -> Glob {
        let mut tokens = Vec::new();
        let mut literal = String::new();
        for token in &self.tokens {
            match token {
                Token::Literal(text) => literal.push_str(text),
                Token::Capture(name) => {
                    let value = captured
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, v)| *v)
                        .expect("captures are checked against the rule's identities when the policy is read");
                    literal.push_str(value);
                }
                Token::Star => {
                    push_literal(&mut tokens, &mut literal);
                    tokens.push(Token::Star);
                }
            }
        }
        push_literal(&mut tokens, &mut literal);
        Glob { tokens }
    }
}

fn push_literal(tokens: &mut Vec<Token>, literal: &mut String) {
    if !literal.is_empty() {
        tokens.push(Token::Literal(std::mem::take(literal)));
    }
}

/// Backtracking over stars and captures; bounded by [`MAX_WILDCARDS`].
fn match_tokens<'t, 'i>(tokens: &'t [Token], input: &'i str, captured: &mut Vec<(&'t str, &'i str)>) -> bool {
    let Some((first, rest)) = tokens.split_first() else {
        return input.is_empty();
    };
    match first {
        Token::Literal(text) => input
            .strip_prefix(text.as_str())
            .is_some_and(|after| match_tokens(rest, after, captured)),
        Token::Star => {
            if rest.is_empty() {
                return true;
            }
            input
                .char_indices()
                .map(|(i, _)| i)
                .chain(std::iter::once(input.len()))
                .any(|i| match_tokens(rest, &input[i..], captured))
        }
        Token::Capture(name) => {
            let segment = input.find('/').unwrap_or(input.len());
            // One or more characters of the segment, longest first.
            for end in (1..=segment).rev().filter(|&end| input.is_char_boundary(end)) {
                captured.push((name.as_str(), &input[..end]));
                if match_tokens(rest, &input[end..], captured) {
                    return true;
                }
                captured.pop();
            }
            false
        }
    }
}

/// A resource-name pattern with its captures filled in: literals and stars,
/// matched in linear time (the hot path: each name a restricted client may
/// be sent).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Glob {
    tokens: Vec<Token>,
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // A literal `*` (taken from a certificate) is written escaped so
            // that two globs print alike only when they match alike.
            Token::Literal(text) => f.write_str(&text.replace('\\', "\\\\").replace('*', "\\*")),
            Token::Star => f.write_str("*"),
            Token::Capture(name) => write!(f, "{{{name}}}"),
        }
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.tokens.iter().try_for_each(|t| t.fmt(f))
    }
}

impl Glob {
    fn is_everything(&self) -> bool {
        self.tokens == [Token::Star]
    }

    /// Whether `name` matches: literals in order, stars between them.
    pub fn matches(&self, name: &str) -> bool {
        fn literal(token: &Token) -> Option<&str> {
            match token {
                Token::Literal(text) => Some(text.as_str()),
                _ => None,
            }
        }
        let mut rest = name;
        let tokens = &self.tokens[..];
        // Anchored at the start unless the pattern starts with a star.
        let (first, mut tokens) = match tokens.split_first() {
            None => return name.is_empty(),
            Some((first, tail)) => (first, tail),
        };
        let mut floating = false;
        match literal(first) {
            Some(text) => match rest.strip_prefix(text) {
                Some(after) => rest = after,
                None => return false,
            },
            None => floating = true,
        }
        while let Some((token, tail)) = tokens.split_first() {
            tokens = tail;
            let Some(text) = literal(token) else {
                floating = true;
                continue;
            };
            if tail.is_empty() {
                // The last literal is anchored at the end.
                return if floating { rest.ends_with(text) } else { rest == text };
            }
            match rest.find(text) {
                Some(at) if floating || at == 0 => rest = &rest[at + text.len()..],
                _ => return false,
            }
            floating = false;
        }
        floating || rest.is_empty()
    }
}

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
    identities: Vec<Pattern>,
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
    /// The SAN it matched.
    pub san: String,
    /// `san` is a URI SAN (else a DNS SAN).
    pub uri: bool,
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
    pub key: Arc<str>,
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

/// How a peer is named in logs and views: its first SAN (URI SANs come
/// first), or `unauthenticated`.
pub fn display_identity(identity: &PeerIdentity) -> &str {
    match identity.names.first() {
        Some(name) => name,
        None if identity.certificate => "(a certificate without URI or DNS SANs)",
        None => UNAUTHENTICATED,
    }
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
            let patterns = |field: &str, values: &[String], captures: bool| -> Result<Vec<Pattern>, _> {
                if values.is_empty() {
                    return Err(at(field, None, "is empty: the rule would match nothing".into()));
                }
                values
                    .iter()
                    .enumerate()
                    .map(|(n, v)| Pattern::parse(v.trim(), captures).map_err(|m| at(field, Some(n), m)))
                    .collect()
            };
            let identities = patterns("identities", &rule.identities, true)?;
            let collections = patterns("collections", &rule.collections, false)?;
            let names_written = rule.names.clone().unwrap_or_else(|| vec!["*".into()]);
            let names = patterns("names", &names_written, true)?;
            for (n, name) in names.iter().enumerate() {
                for capture in name.captures() {
                    if let Some(identity) = identities.iter().find(|id| !id.captures().any(|c| c == capture)) {
                        return Err(at(
                            "names",
                            Some(n),
                            format!(
                                "uses {{{capture}}}, which the rule's identity {:?} does not capture: every identity \
                                 of the rule must capture what its names use",
                                identity.text
                            ),
                        ));
                    }
                }
            }
            if rule.canary {
                // Canary membership rests on a proven identity, and a canary
                // round counts only clients that read the whole collection.
                if let Some(n) = identities.iter().position(|id| id.text == UNAUTHENTICATED) {
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
            for pattern in patterns {
                let sans = identity.names.iter().enumerate();
                let mut matching = sans.filter(|(i, _)| identity.is_uri(*i) == pattern.is_uri());
                if let Some((i, san)) = matching.find(|(_, san)| pattern.matches(san).is_some()) {
                    return Some(CanaryPermit {
                        rule,
                        pattern: pattern.text.clone(),
                        san: san.clone(),
                        uri: identity.is_uri(i),
                    });
                }
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
                let matched: Vec<Vec<(&str, &str)>> = if pattern.text == UNAUTHENTICATED {
                    // Only a peer without a certificate; `*` and the other
                    // globs match certificate identities only.
                    if identity.certificate {
                        Vec::new()
                    } else {
                        vec![Vec::new()]
                    }
                } else {
                    // A URI pattern matches URI SANs, any other DNS SANs: a
                    // DNS SAN that spells a SPIFFE id is not that identity.
                    let uri = pattern.is_uri();
                    identity
                        .names
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| identity.is_uri(*i) == uri)
                        .filter_map(|(_, name)| pattern.matches(name))
                        .collect()
                };
                for captured in matched {
                    for names in &rule.names {
                        let glob = names.substitute(&captured);
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

    /// Why `identity` may not read `collection` (or `name` of it), and the
    /// rule that would grant it: for the log and the status of a refused
    /// stream.
    pub fn denial(&self, identity: &PeerIdentity, collection: &str, name: Option<&str>) -> String {
        let who = display_identity(identity);
        let asked = match name {
            Some(name) => format!("{name:?} of {collection:?}"),
            None => format!("{collection:?}"),
        };
        match &self.path {
            None => format!(
                "identity {who} may not read {asked}: it holds secrets, and no --access-policy is given (without one, \
                 sensitive collections are served to nobody): no rule of --access-policy grants it"
            ),
            Some(path) => format!(
                "identity {who} may not read {asked}: no rule of --access-policy grants it ({}); a rule that would: \
                 {{identities: [{who:?}], collections: [{collection:?}], names: [{:?}]}}",
                path.display(),
                name.unwrap_or("*")
            ),
        }
    }

    /// What `identity` (one SAN, or `unauthenticated`) would read of each
    /// of `collections` (with whether each is sensitive): `/debug/access`.
    pub fn explain(&self, identity: &str, collections: &[(Arc<str>, bool)]) -> BTreeMap<Arc<str>, Option<Grant>> {
        let peer = if identity == UNAUTHENTICATED {
            PeerIdentity::default()
        } else if identity.contains("://") {
            PeerIdentity::certified(vec![identity.to_owned()], Vec::new())
        } else {
            PeerIdentity::certified(Vec::new(), vec![identity.to_owned()])
        };
        collections
            .iter()
            .map(|(c, sensitive)| (c.clone(), self.grant(&peer, c, *sensitive)))
            .collect()
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
            .contains("no rule of --access-policy grants it"));
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
            g.key.as_ref(),
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
        assert_eq!(display_identity(&sanless), "(a certificate without URI or DNS SANs)");
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

    #[test]
    fn globs_match_in_order_and_anchored() {
        let glob = |text: &str| Pattern::parse(text, false).unwrap().substitute(&[]);
        for (pattern, yes, no) in [
            ("abc", vec!["abc"], vec!["ab", "abcd", "xabc"]),
            ("a*", vec!["a", "ab", "a/b/c"], vec!["ba", ""]),
            ("*c", vec!["c", "abc"], vec!["ca"]),
            (
                "a*b*c",
                vec!["abc", "aXbYc", "abbc", "a/b/c"],
                vec!["ab", "acb", "abcx"],
            ),
            ("*", vec!["", "anything/at/all"], vec![]),
            ("*a*", vec!["a", "xay"], vec!["xyz"]),
            ("a**b", vec!["ab", "axb"], vec!["ba"]),
            ("ab*ab", vec!["abab", "abxab"], vec!["aba"]),
        ] {
            let g = glob(pattern);
            for y in yes {
                assert!(g.matches(y), "{pattern} matches {y:?}");
            }
            for n in no {
                assert!(!g.matches(n), "{pattern} does not match {n:?}");
            }
        }
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
            "*a".repeat(MAX_WILDCARDS + 1)
        ));
        assert!(message.contains("at most 8 wildcards"), "{message}");
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
