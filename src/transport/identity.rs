//! Who a peer is: the URI and DNS subject alternative names of the client
//! certificate it presented (a SPIFFE id such as
//! `spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account`,
//! or a DNS name), how one is printed (with its kind: `uri:…`, `dns:…`),
//! and the identity patterns of the allow-lists (`--sink-allow`,
//! `--client-allow`) and the access policy: one rule for all three.

use std::fmt;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::pattern::{Captured, Captures, Pattern};
use super::safe_text::{exact_safe, unescape};

/// A peer's identities, URI SANs first. Empty without a client certificate
/// (and for a certificate without URI or DNS SANs: `certificate` tells the
/// two apart).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerIdentity {
    pub names: Vec<String>,
    /// How many of `names`, the first ones, are URI SANs; the rest are DNS
    /// SANs.
    pub uris: usize,
    /// The peer presented a certificate (TLS verified it).
    pub certificate: bool,
}

impl PeerIdentity {
    /// A certificate's identities: `uris` (URI SANs), then `dns` (DNS SANs).
    pub fn certified(uris: Vec<String>, dns: Vec<String>) -> Self {
        let count = uris.len();
        let mut names = uris;
        names.extend(dns);
        Self {
            names,
            uris: count,
            certificate: true,
        }
    }

    /// Whether `names[i]` is a URI SAN (else a DNS SAN).
    pub fn is_uri(&self, i: usize) -> bool {
        i < self.uris
    }

    /// The identities in a DER certificate; none when it does not parse
    /// (rustls has already verified it, so that does not happen in practice).
    pub fn from_der(der: &[u8]) -> Self {
        let Ok((_, cert)) = X509Certificate::from_der(der) else {
            return Self::certified(Vec::new(), Vec::new());
        };
        let Ok(Some(san)) = cert.subject_alternative_name() else {
            return Self::certified(Vec::new(), Vec::new());
        };
        let mut uris = Vec::new();
        let mut dns = Vec::new();
        for name in &san.value.general_names {
            match name {
                GeneralName::URI(uri) => uris.push((*uri).to_owned()),
                GeneralName::DNSName(name) => dns.push((*name).to_owned()),
                _ => {}
            }
        }
        Self::certified(uris, dns)
    }
}

impl fmt::Display for PeerIdentity {
    /// The one way an identity is printed (logs, refusals, views): each SAN
    /// with its kind, URI SANs first (`uri:spiffe://…, dns:web.example`),
    /// `unauthenticated` without a certificate. A DNS SAN spelling a SPIFFE
    /// id prints `dns:spiffe://…`: not the URI identity it spells. A SAN
    /// is printed by the crate's one escaping rule, exactly
    /// ([`exact_safe`]: a control character, a bidirectional override,
    /// a backslash escaped, `\u{202e}`, `\\`), so no certificate writes
    /// raw into a log line, a refusal or a view.
    /// [`PeerIdentity::parse`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.names.is_empty() {
            return f.write_str(if self.certificate { SANLESS } else { UNAUTHENTICATED });
        }
        for (i, name) in self.names.iter().enumerate() {
            let kind = if self.is_uri(i) { "uri:" } else { "dns:" };
            let comma = if i == 0 { "" } else { ", " };
            write!(f, "{comma}{kind}{}", exact_safe(name))?;
        }
        Ok(())
    }
}

/// The identity of a client with no certificate: plaintext, or TLS without
/// a client certificate.
pub const UNAUTHENTICATED: &str = "unauthenticated";

/// How a certificate without URI or DNS SANs is printed.
const SANLESS: &str = "(a certificate without URI or DNS SANs)";

impl PeerIdentity {
    /// An identity as an operator writes it (`/debug/access?identity=`) or
    /// as [`fmt::Display`] printed it: `unauthenticated`; SANs with their
    /// kind (`uri:…`, `dns:…`, several joined by `, `); or one SAN without
    /// its kind, a URI SAN when it has a `scheme://`, else a DNS SAN (the
    /// patterns' rule). For views: a certificate is read with
    /// [`PeerIdentity::from_der`].
    pub fn parse(text: &str) -> Self {
        let text = text.trim();
        if text == UNAUTHENTICATED {
            return Self::default();
        }
        if text == SANLESS {
            return Self::certified(Vec::new(), Vec::new());
        }
        let (mut uris, mut dns) = (Vec::new(), Vec::new());
        if !(text.starts_with("uri:") || text.starts_with("dns:")) {
            if is_uri_text(text) {
                uris.push(unescape(text).into_owned());
            } else {
                dns.push(unescape(text).into_owned());
            }
            return Self::certified(uris, dns);
        }
        // Split before each `, uri:` / `, dns:`.
        let mut rest = text;
        while !rest.is_empty() {
            let next = [", uri:", ", dns:"]
                .iter()
                .filter_map(|sep| rest.find(sep))
                .min()
                .unwrap_or(rest.len());
            let (one, after) = rest.split_at(next);
            if let Some(uri) = one.strip_prefix("uri:") {
                uris.push(unescape(uri).into_owned());
            } else if let Some(name) = one.strip_prefix("dns:") {
                dns.push(unescape(name).into_owned());
            }
            rest = after.strip_prefix(", ").unwrap_or(after);
        }
        Self::certified(uris, dns)
    }

    /// A pattern that matches this identity, for a refusal's "a rule that
    /// would": `unauthenticated`, or its first SAN that a pattern of its
    /// kind can spell (a DNS SAN that is no DNS name, a URI SAN without a
    /// `scheme://`, or one with a capture's braces or a `*`, none can).
    pub fn as_pattern(&self) -> Option<&str> {
        if !self.certificate {
            return Some(UNAUTHENTICATED);
        }
        self.names
            .iter()
            .enumerate()
            .find(|(i, san)| {
                let spelled = if self.is_uri(*i) {
                    is_uri_text(san)
                } else {
                    is_dns_name(san)
                };
                // A SAN holding a pattern's own characters is matched only by
                // globs that match other identities too: never suggested.
                spelled && !san.contains(['{', '}', '*'])
            })
            .map(|(_, san)| san.as_str())
    }
}

/// A DNS name as a certificate's DNS SAN holds one: ASCII letters, digits,
/// `-` and `.`, a `*.` first for a wildcard certificate, nothing else.
fn is_dns_name(name: &str) -> bool {
    let name = name.strip_prefix("*.").unwrap_or(name);
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// Whether a pattern or an identity is written as a URI: a `scheme://`.
fn is_uri_text(text: &str) -> bool {
    text.contains("://")
}

/// Which identities an [`IdentityPattern`] matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `unauthenticated`: a peer without a certificate (the policy only).
    Unauthenticated,
    /// Written with a `scheme://`: URI SANs only.
    Uri,
    /// Anything else: DNS SANs only.
    Dns,
}

/// An identity pattern, the same for `--client-allow`, `--sink-allow` and
/// the access policy: a pattern with a `scheme://` matches URI SANs only,
/// any other pattern DNS SANs only, with the glob and capture syntax of
/// [`Pattern`] (`*`, `{name}`), in linear time. `unauthenticated` matches a
/// peer without a certificate; no glob does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityPattern {
    pattern: Pattern,
    kind: Kind,
}

impl TryFrom<Pattern> for IdentityPattern {
    type Error = String;

    /// A pattern parsed with [`Captures::Take`]: its kind is what its text
    /// tells. A pattern without a `scheme://` that writes anything a DNS
    /// name does not hold (`/`, `:`, `%`, `\`, `_`, a space, a look-alike
    /// `∕`: anything but ASCII letters, digits, `-` and `.` besides its `*`
    /// and captures) is refused: no DNS SAN it could match matches any
    /// pattern, so it would be a rule that never applies.
    fn try_from(pattern: Pattern) -> Result<Self, String> {
        let text = pattern.text();
        let kind = if text == UNAUTHENTICATED {
            Kind::Unauthenticated
        } else if is_uri_text(text) {
            Kind::Uri
        } else {
            Kind::Dns
        };
        // A DNS name holds neither `/` nor `:`: such a pattern can match only
        // a DNS SAN that spells something else (a SPIFFE id without its
        // scheme written in the pattern), which is how a certificate would
        // pass for an identity it is not; as no such SAN matches any
        // pattern, it is a rule that never applies.
        if kind == Kind::Dns && text.contains(['/', ':']) {
            return Err(format!(
                "{text:?} holds '/' or ':', which no DNS name does, so it would match only DNS SANs that spell a \
                 URI; a SPIFFE id is matched with its scheme written out (spiffe://TRUST_DOMAIN/ns/NS/sa/SA, \
                 spiffe://*/ns/NS/sa/* for any trust domain)"
            ));
        }
        if kind == Kind::Dns {
            // What the pattern writes itself: outside its captures' braces.
            let mut in_capture = false;
            let odd = text.chars().find(|&c| {
                match c {
                    '{' => in_capture = true,
                    '}' => in_capture = false,
                    _ => {}
                }
                !(in_capture || c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '*' | '}'))
            });
            if let Some(odd) = odd {
                return Err(format!(
                    "{text:?} holds {odd:?}, which no DNS name does (ASCII letters, digits, '-' and '.'), and a DNS \
                     SAN that is no DNS name matches no pattern: the rule would never apply; a SPIFFE id is matched \
                     with its scheme written out (spiffe://TRUST_DOMAIN/ns/NS/sa/SA)"
                ));
            }
        }
        Ok(Self { pattern, kind })
    }
}

impl IdentityPattern {
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::try_from(Pattern::parse(text, Captures::Take)?)
    }

    /// The pattern as written.
    pub fn text(&self) -> &str {
        self.pattern.text()
    }

    /// The names it captures.
    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.pattern.captures()
    }

    /// What it captured of each of `identity`'s SANs of its kind that it
    /// matches (empty: it matches none); for `unauthenticated`, one empty
    /// capture when the peer has no certificate.
    pub fn matches<'p, 'i>(&'p self, identity: &'i PeerIdentity) -> Vec<Captured<'p, 'i>> {
        let uri = match self.kind {
            Kind::Unauthenticated => {
                return if identity.certificate {
                    Vec::new()
                } else {
                    vec![Vec::new()]
                };
            }
            Kind::Uri => true,
            Kind::Dns => false,
        };
        identity
            .names
            .iter()
            .enumerate()
            .filter(|(i, _)| identity.is_uri(*i) == uri)
            // A DNS SAN that is no DNS name (it spells a URI, as
            // `spiffe://…` written as a DNS SAN, or looks like one with
            // `∕` or `%2F`): no pattern matches it, however broad
            // (`spiffe*`, `*`).
            .filter(|(_, name)| uri || is_dns_name(name))
            .filter_map(|(_, name)| self.pattern.matches(name))
            .collect()
    }

    /// Whether it matches any of `identity`'s SANs (or its absence).
    pub fn admits(&self, identity: &PeerIdentity) -> bool {
        !self.matches(identity).is_empty()
    }
}

/// The identities a listener accepts, with the flag that set them (for error
/// messages): [`IdentityPattern`]s, the policy's rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowList {
    pub flag: &'static str,
    patterns: Vec<IdentityPattern>,
}

impl AllowList {
    /// Parses the flag's values; an empty entry, a lone `*` and
    /// `unauthenticated` are errors (use no allow-list at all to accept
    /// every certificate the CA signed).
    pub fn parse(flag: &'static str, values: &[String]) -> Result<Self, String> {
        let mut patterns = Vec::new();
        for value in values {
            let value = value.trim();
            if value.is_empty() {
                return Err("an empty identity matches nobody".into());
            }
            let pattern = IdentityPattern::parse(value).map_err(|e| format!("{value:?}: {e}"))?;
            if pattern.kind == Kind::Unauthenticated {
                return Err(format!(
                    "{value:?}: an allow-list admits certificates, and a peer without one never reaches it (the \
                     listener requires one); give a SAN pattern"
                ));
            }
            if pattern.pattern.is_everything() {
                return Err(
                    "\"*\" alone allows every DNS SAN; leave the flag out to accept any certificate the CA signed"
                        .into(),
                );
            }
            patterns.push(pattern);
        }
        Ok(Self { flag, patterns })
    }

    pub fn allows(&self, identity: &PeerIdentity) -> bool {
        self.patterns.iter().any(|p| p.admits(identity))
    }

    /// The entries as given, for logs and the effective configuration.
    pub fn entries(&self) -> Vec<String> {
        self.patterns.iter().map(|p| p.text().to_owned()).collect()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_dns_pattern_that_spells_a_uri_is_refused() {
        for spelled in ["*/ns/istio-system/sa/*", "{a}:*", "*/*", "cluster.local/ns/x"] {
            let refused = super::IdentityPattern::parse(spelled).unwrap_err();
            assert!(refused.contains("no DNS name does"), "{spelled}: {refused}");
        }
        assert!(super::IdentityPattern::parse("spiffe://*/ns/istio-system/sa/*").is_ok());
        assert!(super::IdentityPattern::parse("*.mesh.example").is_ok());
        assert!(super::IdentityPattern::parse("{ns_name}.svc").is_ok());
        for dead in [
            "spiffe\u{2236}\u{2215}\u{2215}*",
            "spiffe%3A%2F%2F*",
            "spiffe\\*",
            "_acme.example",
            "web .example",
        ] {
            let refused = super::IdentityPattern::parse(dead).unwrap_err();
            assert!(refused.contains("which no DNS name does"), "{dead}: {refused}");
        }
        // A DNS SAN spelling a URI matches no pattern, however broad.
        for spelling in [
            "spiffe://cluster.local/ns/a/sa/b",
            "spiffe\u{2236}\u{2215}\u{2215}cluster.local\u{2215}ns\u{2215}a",
            "spiffe%3A%2F%2Fcluster.local%2Fns%2Fa",
            "spiffe\\cluster.local",
        ] {
            let spelled = super::PeerIdentity::certified(Vec::new(), vec![spelling.into()]);
            // A refusal suggests no rule for it: none could match it.
            assert_eq!(spelled.as_pattern(), None, "{spelling}");
            for broad in ["spiffe*", "*", "**.local*", "*cluster*"] {
                if let Ok(pattern) = super::IdentityPattern::parse(broad) {
                    assert!(!pattern.admits(&spelled), "{broad} {spelling}");
                }
            }
        }
        let real = super::PeerIdentity::certified(Vec::new(), vec!["istio-galley.istio-system.svc".into()]);
        assert!(super::IdentityPattern::parse("*.svc").unwrap().admits(&real));
        assert_eq!(real.as_pattern(), Some("istio-galley.istio-system.svc"));
        let wildcard = super::PeerIdentity::certified(Vec::new(), vec!["*.mesh.example".into()]);
        assert!(super::IdentityPattern::parse("*.mesh.example")
            .unwrap()
            .admits(&wildcard));
        // A SAN holding `*` would be suggested as a glob granting others too.
        assert_eq!(wildcard.as_pattern(), None);
        let starred = super::PeerIdentity::certified(vec!["spiffe://cluster.local/ns/a/sa/*".into()], Vec::new());
        assert_eq!(starred.as_pattern(), None);
    }

    use super::*;

    /// A certificate's identities: URI SANs (with `://`), then DNS SANs.
    fn identity(names: &[&str]) -> PeerIdentity {
        let (uris, dns): (Vec<String>, Vec<String>) =
            names.iter().map(|n| n.to_string()).partition(|n| n.contains("://"));
        PeerIdentity::certified(uris, dns)
    }

    const GALLEY: &str = "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account";

    #[test]
    fn exact_and_glob_entries() {
        let allow = AllowList::parse(
            "--sink-allow",
            &[
                GALLEY.into(),
                "spiffe://east.example/*".into(),
                "spiffe://west.example/ns/{ns}/sa/galley".into(),
                "*.galley.example".into(),
            ],
        )
        .unwrap();
        assert!(allow.allows(&identity(&[GALLEY])));
        assert!(allow.allows(&identity(&["other.example", "spiffe://east.example/ns/a/sa/b"])));
        assert!(allow.allows(&identity(&["spiffe://west.example/ns/a/sa/galley"])));
        assert!(
            !allow.allows(&identity(&["spiffe://west.example/ns/a/b/sa/galley"])),
            "one segment"
        );
        assert!(allow.allows(&identity(&["a.galley.example"])));
        assert!(!allow.allows(&identity(&["spiffe://cluster.local/ns/default/sa/attacker"])));
        assert!(!allow.allows(&identity(&[])), "a certificate without SANs");
        assert!(!allow.allows(&PeerIdentity::default()), "no certificate");
        assert!(!allow.allows(&identity(&[&format!("{GALLEY}/x")])));
        assert_eq!(allow.entries()[1], "spiffe://east.example/*");
    }

    /// The policy's rule: a pattern with a `scheme://` matches URI SANs
    /// only, any other pattern DNS SANs only. A certificate whose only SAN
    /// is a DNS name spelling Galley's SPIFFE id is not Galley.
    #[test]
    fn a_san_matches_only_patterns_of_its_kind() {
        let allow = AllowList::parse("--sink-allow", &[GALLEY.into(), "*.example".into()]).unwrap();
        let spelled = PeerIdentity::certified(Vec::new(), vec![GALLEY.into()]);
        assert!(!allow.allows(&spelled), "a DNS SAN spelling a SPIFFE id");
        assert!(allow.allows(&PeerIdentity::certified(vec![GALLEY.into()], Vec::new())));
        let uri_spelling_dns = PeerIdentity::certified(vec!["web.example".into()], Vec::new());
        assert!(!allow.allows(&uri_spelling_dns), "a URI SAN against a DNS pattern");
        assert!(allow.allows(&identity(&["web.example"])));
        let prefix = AllowList::parse("--client-allow", &["spiffe://cluster.local/*".into()]).unwrap();
        assert!(!prefix.allows(&PeerIdentity::certified(
            Vec::new(),
            vec!["spiffe://cluster.local/ns/x/sa/y".into()]
        )));
    }

    #[test]
    fn entries_that_allow_everyone_or_nobody_are_refused() {
        let err = |value: &str| AllowList::parse("--client-allow", &[value.into()]).unwrap_err();
        assert!(err("*").contains("alone allows every DNS SAN"));
        assert!(err("**").contains("alone allows every DNS SAN"));
        assert!(err(" ").contains("empty"));
        assert!(err("unauthenticated").contains("admits certificates"));
        assert!(err("spiffe://x/ns/{ns}/sa/{ns}").contains("captures {ns} twice"));
        assert!(err("spiffe://x/{").contains("without its"));
    }

    /// The one way an identity is printed, with its kind; read back by
    /// `parse` (what `/debug/access?identity=` takes).
    #[test]
    fn identities_print_with_their_kind_and_read_back() {
        let both = PeerIdentity::certified(vec![GALLEY.into()], vec!["galley.example".into()]);
        assert_eq!(both.to_string(), format!("uri:{GALLEY}, dns:galley.example"));
        let spelled = PeerIdentity::certified(Vec::new(), vec![GALLEY.into()]);
        assert_eq!(spelled.to_string(), format!("dns:{GALLEY}"));
        assert_eq!(PeerIdentity::default().to_string(), "unauthenticated");
        let sanless = PeerIdentity::certified(Vec::new(), Vec::new());
        assert_eq!(sanless.to_string(), "(a certificate without URI or DNS SANs)");
        let named_unauthenticated = PeerIdentity::certified(Vec::new(), vec!["unauthenticated".into()]);
        assert_eq!(named_unauthenticated.to_string(), "dns:unauthenticated");
        for identity in [both, spelled, PeerIdentity::default(), sanless, named_unauthenticated] {
            assert_eq!(PeerIdentity::parse(&identity.to_string()), identity);
        }
        // A SAN a certificate may carry but a terminal must not show raw
        // prints escaped, and reads back exactly.
        let odd = PeerIdentity::certified(
            vec!["spiffe://x/\u{202e}a\\u{202e}".into()],
            vec!["a\x1b[2J\nb\u{9b}\u{2066}".into(), "c\\d".into()],
        );
        assert_eq!(
            odd.to_string(),
            "uri:spiffe://x/\\u{202e}a\\\\u{202e}, dns:a\\x1b[2J\\nb\\u{9b}\\u{2066}, dns:c\\\\d"
        );
        assert_eq!(PeerIdentity::parse(&odd.to_string()), odd);
        assert_eq!(PeerIdentity::parse(GALLEY).to_string(), format!("uri:{GALLEY}"));
        assert_eq!(PeerIdentity::parse(" web.example ").to_string(), "dns:web.example");
    }

    #[test]
    fn sans_come_from_the_certificate() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["galley.istio-system.svc".to_owned()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://cluster.local/ns/istio-system/sa/galley".try_into().unwrap(),
        ));
        let cert = params.self_signed(&key).unwrap();
        let identity = PeerIdentity::from_der(cert.der());
        assert_eq!(
            identity.names,
            [
                "spiffe://cluster.local/ns/istio-system/sa/galley",
                "galley.istio-system.svc"
            ]
        );
        assert_eq!(identity.uris, 1, "the URI SAN, then the DNS SAN");
        assert!(identity.certificate);
        let unreadable = PeerIdentity::from_der(b"not a certificate");
        assert!(unreadable.names.is_empty() && unreadable.certificate, "{unreadable:?}");
    }
}
