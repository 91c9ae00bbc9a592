//! The Istio releases whose config-kind protos the gateway carries, and a
//! client's generation: which release it is, and how that was learned.

use std::sync::LazyLock;

use globset::{Glob, GlobMatcher};
use prost_reflect::{EnumDescriptor, MessageDescriptor};

use crate::source::proto_json::LazyPool;

/// `(release tag, descriptor set)`, oldest first: written by `build.rs` from
/// `proto/istio-api-releases/<tag>/`.
const RELEASE_SETS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/istio_releases.rs"));

/// An Istio minor release line, `1.<minor>`: what a client's protos are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation {
    pub minor: u16,
}

impl Generation {
    pub const fn of(minor: u16) -> Self {
        Self { minor }
    }

    /// `1.5`, `1.5.10`, `v1.5.2`, `1.5.0-beta.1`, `1.5-dev`: Istio 1.5. Not a
    /// version (`65536.65536.65536`, the placeholder istiod's `adsc` sends
    /// when it knows none; a 2.x; text): `None`, never a guess.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts = text.split(['.', '-', '+']);
        if parts.next()? != "1" {
            return None;
        }
        let minor = parts.next()?;
        if minor.is_empty() || !minor.bytes().all(|b| b.is_ascii_digit()) || minor.len() > 3 {
            return None;
        }
        minor.parse().ok().map(Self::of)
    }

    /// The release this generation's clients have the protos of, when the
    /// gateway carries it (1.0 to 1.7); `None` for a later one.
    pub fn release(self) -> Option<&'static Release> {
        RELEASES.iter().find(|r| r.generation == self)
    }
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "1.{}", self.minor)
    }
}

impl serde::Serialize for Generation {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// One release's descriptors, decoded as they are used: a file the first
/// time a type of its package is looked up, with what it imports (a
/// gateway whose clients are all of one generation and read VirtualServices
/// decodes `istio.networking.v1alpha3` of that release, not its RBAC and
/// authentication protos).
pub struct Release {
    pub generation: Generation,
    /// The istio/api tag the protos are from (`1.1.17`).
    pub tag: &'static str,
    descriptors: LazyPool,
}

impl std::fmt::Debug for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Release").field("tag", &self.tag).finish()
    }
}

impl Release {
    /// The release's descriptor of the message `name` (a full name), its
    /// package decoded if it was not yet.
    pub fn message(&self, name: &str) -> Option<MessageDescriptor> {
        self.descriptors.message(name)
    }

    /// The release's descriptor of the enum `name` (a full name).
    pub fn enumeration(&self, name: &str) -> Option<EnumDescriptor> {
        self.descriptors.enumeration(name)
    }
}

/// Every release the gateway carries, oldest first.
pub static RELEASES: LazyLock<Vec<Release>> = LazyLock::new(|| {
    RELEASE_SETS
        .iter()
        .map(|(tag, bytes)| Release {
            generation: Generation::parse(tag).expect("release folders are named by their tag"),
            tag,
            descriptors: LazyPool::new(bytes),
        })
        .collect()
});

/// How a client's generation was learned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Learned {
    /// A `--client-generation` rule matched its node id.
    Flag,
    /// Its node said (`ISTIO_VERSION` in xDS node metadata, a sink node's
    /// annotations or a 1.0 client's metadata).
    IstioVersion,
    /// Its wire dialect: only Istio 1.0 asks the legacy service by proto
    /// type URL, only Istio 1.1 by collection name.
    Dialect,
}

/// What a client is, as the views show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientGeneration {
    Known {
        generation: Generation,
        learned: Learned,
    },
    /// An Istio client (it reads Istio's kinds) that did not say which
    /// release it is, and no rule names it: its skew is not guessed.
    Unknown,
}

impl ClientGeneration {
    pub fn generation(self) -> Option<Generation> {
        match self {
            ClientGeneration::Known { generation, .. } => Some(generation),
            ClientGeneration::Unknown => None,
        }
    }
}

impl serde::Serialize for ClientGeneration {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        match self {
            ClientGeneration::Known { generation, learned } => {
                map.serialize_entry("release", generation)?;
                map.serialize_entry("learned_from", learned)?;
                if generation.release().is_none() {
                    map.serialize_entry(
                        "checked",
                        &"no: the gateway carries the protos of Istio 1.0 to 1.7 only; a later client is not checked",
                    )?;
                }
            }
            ClientGeneration::Unknown => {
                map.serialize_entry("release", "unknown")?;
                map.serialize_entry(
                    "why",
                    "its wire does not tell (ResourceSource and MCP over xDS look the same from Istio 1.1 to 1.7 and \
                     on), it sent no ISTIO_VERSION that names a release (istiod's adsc sends 65536.65536.65536 when it \
                     knows none), and no --client-generation rule names its node id or identity",
                )?;
            }
        }
        map.end()
    }
}

/// The node label in which Istio clients say their release.
pub const ISTIO_VERSION: &str = "ISTIO_VERSION";

/// `--client-generation GLOB=RELEASE`: the operator says what a client is
/// where it does not say itself (a real Pilot or sink on `ResourceSource`
/// sends an empty node id and no version: Pilot 1.1's first request is byte
/// for byte Pilot 1.3's). The glob matches the node id or one of the peer's
/// certificate identities; first match wins.
#[derive(Clone, Debug, Default)]
pub struct GenerationRules {
    rules: Vec<(String, GlobMatcher, Generation)>,
}

#[derive(Debug, thiserror::Error)]
#[error("--client-generation {rule:?}: {reason}")]
pub struct GenerationRulesError {
    pub rule: String,
    pub reason: String,
}

impl GenerationRules {
    /// The most rules (each client is matched against all).
    pub const MAX: usize = 64;

    pub fn parse(rules: &[String]) -> Result<Self, GenerationRulesError> {
        let fail = |rule: &str, reason: String| GenerationRulesError {
            rule: rule.to_owned(),
            reason,
        };
        if rules.len() > Self::MAX {
            return Err(fail(
                &rules[Self::MAX],
                format!("at most {} rules (each client is matched against all)", Self::MAX),
            ));
        }
        let mut parsed = Vec::with_capacity(rules.len());
        for rule in rules {
            let Some((glob, release)) = rule.rsplit_once('=') else {
                return Err(fail(
                    rule,
                    "a rule is GLOB=RELEASE (a node id or certificate identity glob), e.g. 'pilot-*=1.3'".into(),
                ));
            };
            let generation = Generation::parse(release)
                .ok_or_else(|| fail(rule, format!("{release:?} is not an Istio release (1.0, 1.3, 1.7.8)")))?;
            if glob.trim().is_empty() {
                return Err(fail(rule, "the glob is empty; '*' names every client".into()));
            }
            let matcher = Glob::new(glob)
                .map_err(|e| fail(rule, format!("{glob:?} is not a glob: {e}")))?
                .compile_matcher();
            parsed.push((glob.to_owned(), matcher, generation));
        }
        Ok(Self { rules: parsed })
    }

    /// The rules as given, for `/debug/config`.
    pub fn shown(&self) -> Vec<String> {
        self.rules.iter().map(|(glob, _, g)| format!("{glob}={g}")).collect()
    }

    /// What a client is: its dialect when that tells (only Istio 1.0 asks
    /// the legacy service by proto type URL, only 1.1 by collection name);
    /// else the first rule matching its node id or one of its identities
    /// (real Pilots and sinks send an empty node id: a rule names them by
    /// their certificate, or by `*`); else its node's `ISTIO_VERSION`; else
    /// unknown.
    pub fn classify(
        &self,
        node_id: &str,
        identities: &[String],
        labels: &[(String, String)],
        dialect: Option<Generation>,
    ) -> ClientGeneration {
        if let Some(generation) = dialect {
            return ClientGeneration::Known {
                generation,
                learned: Learned::Dialect,
            };
        }
        let rule = self
            .rules
            .iter()
            .find(|(_, glob, _)| glob.is_match(node_id) || identities.iter().any(|i| glob.is_match(i)));
        if let Some((_, _, generation)) = rule {
            return ClientGeneration::Known {
                generation: *generation,
                learned: Learned::Flag,
            };
        }
        let said = labels
            .iter()
            .find(|(key, _)| key == ISTIO_VERSION)
            .and_then(|(_, value)| Generation::parse(value));
        match said {
            Some(generation) => ClientGeneration::Known {
                generation,
                learned: Learned::IstioVersion,
            },
            None => ClientGeneration::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_to_their_minor_and_placeholders_to_nothing() {
        for (text, minor) in [
            ("1.5", 5),
            ("1.5.10", 5),
            ("v1.1.17", 1),
            ("1.8.0-beta.1", 8),
            ("1.12-dev", 12),
        ] {
            assert_eq!(Generation::parse(text), Some(Generation::of(minor)), "{text}");
        }
        for text in ["65536.65536.65536", "2.0.0", "", "1", "1.", "1.x", "latest", "1.1234"] {
            assert_eq!(Generation::parse(text), None, "{text}");
        }
    }

    #[test]
    fn a_release_decodes_the_package_of_a_kind_looked_up_and_its_imports_only() {
        // A release of its own, not the shared static (other tests look up
        // other kinds of it).
        let (tag, bytes) = RELEASE_SETS[1];
        let release = Release {
            generation: Generation::parse(tag).unwrap(),
            tag,
            descriptors: LazyPool::new(bytes),
        };
        assert!(release.message("istio.networking.v1alpha3.VirtualService").is_some());
        let decoded = |prefix: &str| {
            let files = release.descriptors.decoded();
            files.iter().filter(|f| f.starts_with(prefix)).count()
        };
        assert!(decoded("networking/v1alpha3/") > 0);
        assert_eq!(
            decoded("rbac/"),
            0,
            "RBAC's protos are not decoded for a VirtualService"
        );
        assert_eq!(decoded("authentication/"), 0);
        // Another package when one of its types is looked up.
        assert!(release.message("istio.rbac.v1alpha1.RbacConfig").is_some());
        assert!(decoded("rbac/") > 0);
        assert!(release.message("istio.nothing.v1.Nothing").is_none());
    }

    #[test]
    fn every_release_folder_decodes_and_is_in_order() {
        let tags: Vec<&str> = RELEASES.iter().map(|r| r.tag).collect();
        assert_eq!(
            tags,
            ["1.0.9", "1.1.17", "1.2.10", "1.3.8", "1.4.10", "1.5.10", "1.6.14", "1.7.8"]
        );
        for release in RELEASES.iter() {
            assert!(
                release.message("istio.networking.v1alpha3.DestinationRule").is_some(),
                "{}",
                release.tag
            );
        }
        assert_eq!(Generation::of(3).release().unwrap().tag, "1.3.8");
        assert!(Generation::of(8).release().is_none());
    }

    #[test]
    fn the_dialect_then_a_rule_then_the_node_say_what_a_client_is() {
        let rules = GenerationRules::parse(&["pilot-*=1.3".into(), "spiffe://*/sa/istio-pilot*=1.2".into()]).unwrap();
        let said = vec![(ISTIO_VERSION.to_owned(), "1.6.2".to_owned())];
        let known = |minor, learned| ClientGeneration::Known {
            generation: Generation::of(minor),
            learned,
        };
        assert_eq!(rules.classify("pilot-0", &[], &said, None), known(3, Learned::Flag));
        assert_eq!(
            rules.classify("istiod-0", &[], &said, None),
            known(6, Learned::IstioVersion)
        );
        // The legacy service's dialect is certain: no rule overrides it.
        assert_eq!(
            rules.classify("pilot-0", &[], &[], Some(Generation::of(1))),
            known(1, Learned::Dialect)
        );
        // Real Pilots send no node id: their certificate names them.
        let pilot = vec!["spiffe://cluster.local/ns/istio-system/sa/istio-pilot-service-account".to_owned()];
        assert_eq!(rules.classify("", &pilot, &[], None), known(2, Learned::Flag));
        // istiod's placeholder is not a version.
        let placeholder = vec![(ISTIO_VERSION.to_owned(), "65536.65536.65536".to_owned())];
        assert_eq!(
            rules.classify("istiod-0", &[], &placeholder, None),
            ClientGeneration::Unknown
        );
        assert_eq!(rules.classify("", &[], &[], None), ClientGeneration::Unknown);
    }

    #[test]
    fn bad_rules_say_why() {
        let error = |rule: &str| GenerationRules::parse(&[rule.to_owned()]).unwrap_err().to_string();
        assert!(error("pilot").contains("GLOB=RELEASE"));
        assert!(error("pilot=2.0").contains("not an Istio release"));
        assert!(error("=1.3").contains("glob is empty"));
        assert!(error("pilot-[=1.3").contains("not a glob"));
        let many: Vec<String> = (0..=GenerationRules::MAX).map(|i| format!("n{i}=1.1")).collect();
        assert!(GenerationRules::parse(&many)
            .unwrap_err()
            .to_string()
            .contains("at most 64"));
    }
}
