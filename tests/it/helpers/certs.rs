//! Certificates generated at test time with rcgen: a CA per test, leaves for
//! servers (localhost, 127.0.0.1) and clients. No private key is checked in.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub pem: String,
}

/// A certificate and its key, in PEM.
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let pem = issuer.pem();
        Self { issuer, pem }
    }

    /// A leaf for localhost and 127.0.0.1, usable by servers and clients.
    pub fn leaf(&self, common_name: &str) -> Leaf {
        self.leaf_with(common_name, |_| {})
    }

    /// A client leaf carrying a SPIFFE id (URI SAN), as Istio's CA issues.
    pub fn spiffe_leaf(&self, spiffe_id: &str) -> Leaf {
        let id = spiffe_id.to_owned();
        self.leaf_with("workload", move |params| {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(id.as_str().try_into().unwrap()));
        })
    }

    /// A client leaf whose only SAN is the DNS name `name`, whatever it
    /// spells (a CA signs what it is asked to: `spiffe://…` included).
    pub fn dns_only_leaf(&self, name: &str) -> Leaf {
        let name = name.to_owned();
        self.leaf_with("workload", move |params| {
            params.subject_alt_names = vec![rcgen::SanType::DnsName(name.as_str().try_into().unwrap())];
        })
    }

    /// A client leaf whose only SAN is a DNS SAN of exactly `name`'s bytes,
    /// whatever they are (non-ASCII, NUL, `/`): written into the DER by
    /// hand, as a CA that signs what it is asked to would write them (rcgen
    /// itself takes ASCII only).
    pub fn raw_dns_leaf(&self, name: &[u8]) -> Leaf {
        /// A DER length.
        fn length(n: usize) -> Vec<u8> {
            match n {
                0..=0x7f => vec![n as u8],
                0x80..=0xff => vec![0x81, n as u8],
                _ => vec![0x82, (n >> 8) as u8, n as u8],
            }
        }
        // GeneralNames ::= SEQUENCE { dNSName [2] IMPLICIT IA5String }
        let mut dns = vec![0x82];
        dns.extend(length(name.len()));
        dns.extend(name);
        let mut names = vec![0x30];
        names.extend(length(dns.len()));
        names.extend(dns);
        self.leaf_with("workload", move |params| {
            params.subject_alt_names.clear();
            params
                .custom_extensions
                .push(rcgen::CustomExtension::from_oid_content(&[2, 5, 29, 17], names));
        })
    }

    /// A client leaf with a SPIFFE id whose validity ended yesterday.
    pub fn expired_spiffe_leaf(&self, spiffe_id: &str) -> Leaf {
        let id = spiffe_id.to_owned();
        self.leaf_with("workload", move |params| {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(id.as_str().try_into().unwrap()));
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now - time::Duration::days(30);
            params.not_after = now - time::Duration::days(1);
        })
    }

    /// A leaf whose extended key usage is serverAuth only: no client may
    /// present it.
    pub fn server_only_leaf(&self, common_name: &str) -> Leaf {
        self.leaf_with(common_name, |params| {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        })
    }

    fn leaf_with(&self, common_name: &str, edit: impl FnOnce(&mut CertificateParams)) -> Leaf {
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        edit(&mut params);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// A leaf for localhost signed by its own key (not a CA): no CA vouches
/// for it.
pub fn self_signed_leaf(common_name: &str) -> Leaf {
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    Leaf {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// Writes a file atomically (as cert-manager and kubelet do: a new file
/// renamed over the old one) and returns its path.
pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    let temporary = dir.join(format!(".{name}.new"));
    std::fs::write(&temporary, contents).unwrap();
    std::fs::rename(&temporary, &path).unwrap();
    path
}

/// Writes a leaf as `<name>.crt` and `<name>.key`; returns both paths.
pub fn write_leaf(dir: &Path, name: &str, leaf: &Leaf) -> (PathBuf, PathBuf) {
    (
        write(dir, &format!("{name}.crt"), &leaf.cert),
        write(dir, &format!("{name}.key"), &leaf.key),
    )
}

/// How a TLS server at `addr` answers a client trusting `ca_pem` and
/// presenting `identity`: the alert it sends (the handshake's failure, which
/// TLS 1.3 delivers on the client's first read after its own side is done),
/// or `None` when the connection is accepted and answers HTTP/2.
pub async fn tls_alert(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    identity: Option<&Leaf>,
) -> Option<rustls::AlertDescription> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(leaf) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    super::within("a TLS handshake and the first read", async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let alert = |e: std::io::Error| match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::AlertReceived(alert)) => *alert,
            _ => panic!("a TLS alert, not {e:?}"),
        };
        let mut tls = match connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await {
            Ok(tls) => tls,
            Err(e) => return Some(alert(e)),
        };
        tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let mut first = [0u8; 9];
        match tls.read_exact(&mut first).await {
            // The server's SETTINGS: the client was taken.
            Ok(_) => {
                assert_eq!(first[3], 0x4, "the server's SETTINGS first");
                None
            }
            Err(e) => Some(alert(e)),
        }
    })
    .await
}
