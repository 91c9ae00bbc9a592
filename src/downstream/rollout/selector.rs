//! `--canary NODE_SELECTOR`: which clients say they are canaries. A
//! selector with an `=` matches a node label (MCP annotations, xDS metadata
//! strings) exactly; any other is a glob over the node id (`*`, `?`,
//! `[...]`). What a client says of itself is a claim: it makes a canary only
//! of a client whose proven identity the access policy lets be one (see
//! [`super::Membership`]), unless `--canary-trust-node-ids`.

use globset::{Glob, GlobMatcher};

/// The most `--canary` selectors (each client is matched against all).
pub const MAX_SELECTORS: usize = 64;

/// One `--canary` selector, and its text as given.
#[derive(Clone, Debug)]
pub struct Selector {
    text: String,
    matcher: Matcher,
}

#[derive(Clone, Debug)]
enum Matcher {
    NodeId(GlobMatcher),
    Label { key: String, value: String },
}

impl Selector {
    pub fn parse(text: &str) -> Result<Self, String> {
        let matcher = if let Some((key, value)) = text.split_once('=') {
            let key = key.trim();
            if key.is_empty() {
                return Err(format!("{text:?}: a label selector is KEY=VALUE, and the key is empty"));
            }
            Matcher::Label {
                key: key.to_owned(),
                value: value.trim().to_owned(),
            }
        } else if text.trim().is_empty() {
            return Err("an empty selector would match no node id; give a glob (canary-*) or KEY=VALUE".into());
        } else {
            Glob::new(text)
                .map(|glob| Matcher::NodeId(glob.compile_matcher()))
                .map_err(|e| format!("{text:?} is not a node id glob: {e}"))?
        };
        Ok(Self {
            text: text.to_owned(),
            matcher,
        })
    }

    /// The selector as given.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn matches(&self, node_id: &str, labels: &[(String, String)]) -> bool {
        match &self.matcher {
            Matcher::NodeId(glob) => glob.is_match(node_id),
            Matcher::Label { key, value } => labels.iter().any(|(k, v)| k == key && v == value),
        }
    }
}

/// The first selector that matches a node: what it claims by.
pub fn claimed_by<'s>(selectors: &'s [Selector], node_id: &str, labels: &[(String, String)]) -> Option<&'s Selector> {
    selectors.iter().find(|s| s.matches(node_id, labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_node_ids_and_pairs_match_labels() {
        let selectors: Vec<Selector> = ["canary-*", "track=canary"]
            .iter()
            .map(|s| Selector::parse(s).unwrap())
            .collect();
        let label = |k: &str, v: &str| vec![(k.to_owned(), v.to_owned())];
        let claim = |node: &str, labels: &[(String, String)]| claimed_by(&selectors, node, labels).map(Selector::text);
        assert_eq!(claim("canary-7", &[]), Some("canary-*"));
        assert_eq!(claim("prod-7", &[]), None);
        assert_eq!(claim("prod-7", &label("track", "canary")), Some("track=canary"));
        assert_eq!(claim("prod-7", &label("track", "stable")), None);
        assert_eq!(claim("prod-7", &label("canary", "track")), None);
        // Globs span the whole id, slashes included (Istio ids have them).
        let sidecar = Selector::parse("sidecar~*~canary-*").unwrap();
        assert!(sidecar.matches("sidecar~10.0.0.1~canary-1.default~default.svc.cluster.local", &[]));
        assert!(!sidecar.matches("x-sidecar~1~canary-1", &[]));
    }

    #[test]
    fn bad_selectors_say_why() {
        assert!(Selector::parse("").unwrap_err().contains("empty"));
        assert!(Selector::parse("=x").unwrap_err().contains("key is empty"));
        assert!(Selector::parse("canary-[").unwrap_err().contains("glob"));
    }
}
