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
