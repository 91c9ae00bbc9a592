//! Who a peer is: the URI and DNS subject alternative names of the client
//! certificate it presented (a SPIFFE id such as
//! `spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account`,
//! or a DNS name), and the allow-lists (`--sink-allow`, `--client-allow`)
//! matched against them.

use std::fmt;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

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
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.names.is_empty() {
            return f.write_str(if self.certificate {
                "a certificate without URI or DNS SANs"
            } else {
                "no certificate identity"
            });
        }
        f.write_str(&self.names.join(", "))
    }
}

/// One allowed identity: exact, or a prefix when it ends in `*`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pattern {
    Exact(String),
    Prefix(String),
}

impl Pattern {
    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Exact(exact) => name == exact,
            Pattern::Prefix(prefix) => name.starts_with(prefix.as_str()),
        }
    }
}

/// The identities a listener accepts, with the flag that set them (for error
/// messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowList {
    pub flag: &'static str,
    patterns: Vec<Pattern>,
}

impl AllowList {
    /// Parses the flag's values; an empty or lone `*` entry is an error (use
    /// no allow-list at all to accept every certificate the CA signed).
    pub fn parse(flag: &'static str, values: &[String]) -> Result<Self, String> {
        let mut patterns = Vec::new();
        for value in values {
            let value = value.trim();
            match value.strip_suffix('*') {
                _ if value.is_empty() => return Err("an empty identity matches nobody".into()),
                Some("") => {
                    return Err(
                        "\"*\" alone allows every identity; leave the flag out to accept any certificate the CA signed"
                            .into(),
                    )
                }
                Some(prefix) => patterns.push(Pattern::Prefix(prefix.to_owned())),
                None => patterns.push(Pattern::Exact(value.to_owned())),
            }
        }
        Ok(Self { flag, patterns })
    }

    pub fn allows(&self, identity: &PeerIdentity) -> bool {
        identity
            .names
            .iter()
            .any(|name| self.patterns.iter().any(|p| p.matches(name)))
    }

    /// The entries as given, for logs and the effective configuration.
    pub fn entries(&self) -> Vec<String> {
        self.patterns
            .iter()
            .map(|p| match p {
                Pattern::Exact(e) => e.clone(),
                Pattern::Prefix(p) => format!("{p}*"),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(names: &[&str]) -> PeerIdentity {
        PeerIdentity::certified(names.iter().map(|n| n.to_string()).collect(), Vec::new())
    }

    #[test]
    fn exact_and_prefix_entries() {
        let allow = AllowList::parse(
            "--sink-allow",
            &[
                "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account".into(),
                "spiffe://east.example/*".into(),
            ],
        )
        .unwrap();
        assert!(allow.allows(&identity(&[
            "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account"
        ])));
        assert!(allow.allows(&identity(&["galley.example", "spiffe://east.example/ns/a/sa/b"])));
        assert!(!allow.allows(&identity(&["spiffe://cluster.local/ns/default/sa/attacker"])));
        assert!(!allow.allows(&identity(&[])), "no certificate identity");
        assert!(!allow.allows(&identity(&[
            "spiffe://cluster.local/ns/istio-system/sa/istio-galley-service-account/x"
        ])));
    }

    #[test]
    fn wildcards_that_allow_everyone_are_refused() {
        assert!(AllowList::parse("--client-allow", &["*".into()]).is_err());
        assert!(AllowList::parse("--client-allow", &[" ".into()]).is_err());
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
