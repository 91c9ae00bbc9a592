//! `--canary NODE_SELECTOR`: which clients are canaries. A selector with an
//! `=` matches a node label (MCP annotations, xDS metadata strings) exactly;
//! any other is a glob over the node id (`*`, `?`, `[...]`).

use globset::{Glob, GlobMatcher};

/// The most `--canary` selectors (each client is matched against all).
pub const MAX_SELECTORS: usize = 64;

/// One `--canary` selector.
#[derive(Clone, Debug)]
pub enum Selector {
    NodeId(GlobMatcher),
    Label { key: String, value: String },
}

impl Selector {
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Some((key, value)) = text.split_once('=') {
            let key = key.trim();
            if key.is_empty() {
                return Err(format!("{text:?}: a label selector is KEY=VALUE, and the key is empty"));
            }
            return Ok(Selector::Label {
                key: key.to_owned(),
                value: value.trim().to_owned(),
            });
        }
        if text.trim().is_empty() {
            return Err("an empty selector would match no node id; give a glob (canary-*) or KEY=VALUE".into());
        }
        Glob::new(text)
            .map(|glob| Selector::NodeId(glob.compile_matcher()))
            .map_err(|e| format!("{text:?} is not a node id glob: {e}"))
    }

    pub fn matches(&self, node_id: &str, labels: &[(String, String)]) -> bool {
        match self {
            Selector::NodeId(glob) => glob.is_match(node_id),
            Selector::Label { key, value } => labels.iter().any(|(k, v)| k == key && v == value),
        }
    }
}

/// Whether a node is a canary: any selector matches it.
pub fn is_canary(selectors: &[Selector], node_id: &str, labels: &[(String, String)]) -> bool {
    selectors.iter().any(|s| s.matches(node_id, labels))
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
        assert!(is_canary(&selectors, "canary-7", &[]));
        assert!(!is_canary(&selectors, "prod-7", &[]));
        assert!(is_canary(&selectors, "prod-7", &label("track", "canary")));
        assert!(!is_canary(&selectors, "prod-7", &label("track", "stable")));
        assert!(!is_canary(&selectors, "prod-7", &label("canary", "track")));
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
