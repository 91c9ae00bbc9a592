//! TLS for both sides, with rustls. Listeners (downstream and sink) terminate
//! TLS, optionally requiring client certificates; the certificate, key and
//! client CA are re-read when they change on disk, and each new connection
//! uses the latest good set. The upstream client (and the `client` command)
//! re-read their files on every connection attempt. A file that cannot be
//! read or parsed is an error that names its flag; after start-up a bad
//! rotation keeps the previous set.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::either::Either;

use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::fswatch::DirWatch;

#[derive(Debug, thiserror::Error)]
#[error("{flag} {}: {message}", path.display())]
pub struct TlsError {
    pub flag: &'static str,
    pub path: PathBuf,
    pub message: String,
}

fn tls_error(flag: &'static str, path: &Path, message: impl Into<String>) -> TlsError {
    TlsError {
        flag,
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| tls_error(flag, path, format!("cannot read: {e}")))
}

/// Every certificate in a PEM file; at least one.
pub fn read_certs(flag: &'static str, path: &Path) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), TlsError> {
    let pem = read(flag, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(flag, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(tls_error(flag, path, "contains no PEM certificate (BEGIN CERTIFICATE)"));
    }
    // A PEM block whose contents are not a certificate is this file's fault,
    // not the key's that is checked against it later.
    for (index, cert) in certs.iter().enumerate() {
        if let Err(e) = x509_parser::parse_x509_certificate(cert) {
            return Err(tls_error(
                flag,
                path,
                format!(
                    "certificate {} of {} is not a valid X.509 certificate: {e}",
                    index + 1,
                    certs.len()
                ),
            ));
        }
    }
    Ok((pem, certs))
}

/// The certificate a side presents (the first of its file) is X.509 v3, as
/// TLS needs: an older one is refused by rustls as the key's mismatch, so it
/// is named here as the certificate's fault.
fn check_presented(flag: &'static str, path: &Path, certs: &[CertificateDer<'static>]) -> Result<(), TlsError> {
    let Some(Ok((_, cert))) = certs.first().map(|der| x509_parser::parse_x509_certificate(der)) else {
        return Ok(());
    };
    let version = cert.version();
    if version != x509_parser::x509::X509Version::V3 {
        return Err(tls_error(
            flag,
            path,
            format!(
                "is an X.509 v{} certificate; TLS needs v3, with extensions (subjectAltName, extendedKeyUsage): \
                 openssl x509 -req makes v1 unless given -extfile; reissue it with one",
                version.0 + 1
            ),
        ));
    }
    Ok(())
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(flag: &'static str, path: &Path) -> Result<(Vec<u8>, PrivateKeyDer<'static>), TlsError> {
    let pem = read(flag, path)?;
    let key = PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| tls_error(flag, path, format!("not a PEM private key: {e}")))?;
    Ok((pem, key))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The files a TLS listener is configured from (`--tls-cert`, `--tls-key`,
/// `--client-ca`).
#[derive(Clone, Debug)]
pub struct ServerTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

impl ServerTlsFiles {
    /// Reads and checks every file and builds the rustls configuration.
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let (_, certs) = read_certs("--tls-cert", &self.cert)?;
        check_presented("--tls-cert", &self.cert, &certs)?;
        let (_, key) = read_key("--tls-key", &self.key)?;
        let provider = provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("--tls-cert", &self.cert, e.to_string()))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let (_, cas) = read_certs("--client-ca", path)?;
                let mut roots = RootCertStore::empty();
                for ca in cas {
                    roots
                        .add(ca)
                        .map_err(|e| tls_error("--client-ca", path, format!("not a usable CA certificate: {e}")))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| tls_error("--client-ca", path, e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            tls_error(
                "--tls-key",
                &self.key,
                format!(
                    "does not go with the certificate in --tls-cert {} (or that certificate cannot serve): {e}",
                    self.cert.display()
                ),
            )
        })?;
        // gRPC runs over HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// The files it reads (watched for rotation).
    fn paths(&self) -> Vec<&Path> {
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
            .collect()
    }
}

/// A listener's TLS configuration, replaced when its files change.
pub struct ServerTls {
    files: ServerTlsFiles,
    current: RwLock<Arc<ServerConfig>>,
}

impl ServerTls {
    /// Loads the files once; an error names the flag.
    pub fn new(files: ServerTlsFiles) -> Result<Arc<Self>, TlsError> {
        let config = files.load()?;
        Ok(Arc::new(Self {
            files,
            current: RwLock::new(config),
        }))
    }

    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Re-reads the files. A bad set is reported and the previous one kept.
    pub fn reload(&self) -> Result<(), TlsError> {
        let config = self.files.load()?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
        Ok(())
    }

    /// Reloads whenever a file's directory changes, until `shutdown`.
    pub fn watch(self: &Arc<Self>, shutdown: CancellationToken, tasks: &TaskTracker) -> Result<(), TlsError> {
        let mut watch = DirWatch::files(&self.files.paths()).map_err(|e| {
            tls_error(
                "--tls-cert",
                &self.files.cert,
                format!("cannot watch for rotation: {e}"),
            )
        })?;
        let tls = self.clone();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    changed = watch.changed() => if !changed { return },
                    _ = shutdown.cancelled() => return,
                }
                // Reading the files blocks: on the blocking pool.
                let reloading = tls.clone();
                let reloaded = tokio::task::spawn_blocking(move || reloading.reload())
                    .await
                    .unwrap_or_else(|e| Err(tls_error("--tls-cert", &tls.files.cert, format!("reload failed: {e}"))));
                match reloaded {
                    Ok(()) => tracing::info!(cert = %tls.files.cert.display(), "TLS certificate files reloaded"),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "TLS certificate files changed but do not load; new connections keep the previous certificate"
                    ),
                }
            }
        });
        Ok(())
    }
}

/// An accepted connection: plain (`Left`) or TLS (`Right`).
pub type Conn = Either<TcpStream, Box<tokio_rustls::server::TlsStream<TcpStream>>>;

/// A client's TLS files: the upstream client's (`--upstream-ca`,
/// `--upstream-cert`, `--upstream-key`, `--upstream-server-name`), the
/// `client` command's (`--ca`, `--cert`, `--key`, `--server-name`) or the
/// `source` command's (`--ca`, `--tls-cert`, `--tls-key`, `--server-name`).
#[derive(Clone, Debug)]
pub struct ClientTlsFiles {
    /// Without it, the system's roots are trusted.
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub server_name: Option<String>,
    /// How the flags are spelled in errors: `--upstream-`, `--` (the
    /// `client` command) or `--tls-` (the `source` command).
    pub flag_prefix: &'static str,
}

impl Default for ClientTlsFiles {
    fn default() -> Self {
        Self {
            ca: None,
            cert: None,
            key: None,
            server_name: None,
            flag_prefix: "--upstream-",
        }
    }
}

impl ClientTlsFiles {
    pub(crate) fn flag(&self, name: &'static str) -> &'static str {
        match (self.flag_prefix, name) {
            ("--", "ca") => "--ca",
            ("--", "cert") => "--cert",
            ("--", "key") => "--key",
            ("--", _) => "--server-name",
            // The `source` command dialling a sink: its certificate is
            // --tls-cert/--tls-key in both of its modes.
            ("--tls-", "ca") => "--ca",
            ("--tls-", "cert") => "--tls-cert",
            ("--tls-", "key") => "--tls-key",
            ("--tls-", _) => "--server-name",
            (_, "ca") => "--upstream-ca",
            (_, "cert") => "--upstream-cert",
            (_, "key") => "--upstream-key",
            _ => "--upstream-server-name",
        }
    }

    /// The first of these flags given, for "only with https" errors.
    pub fn first_flag(&self) -> Option<&'static str> {
        [
            self.ca.as_ref().map(|_| self.flag("ca")),
            self.cert.as_ref().map(|_| self.flag("cert")),
            self.key.as_ref().map(|_| self.flag("key")),
            self.server_name.as_ref().map(|_| self.flag("server-name")),
        ]
        .into_iter()
        .flatten()
        .next()
    }

    /// Reads and checks the files and builds the rustls configuration (HTTP/2
    /// only); called at start-up (errors name the flag) and before every
    /// connection attempt (so rotated files are used).
    pub fn load(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let mut roots = RootCertStore::empty();
        match &self.ca {
            Some(path) => {
                let flag = self.flag("ca");
                for ca in read_certs(flag, path)?.1 {
                    roots
                        .add(ca)
                        .map_err(|e| tls_error(flag, path, format!("not a usable CA certificate: {e}")))?;
                }
            }
            None => {
                let native = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(native.certs);
                if added == 0 {
                    return Err(tls_error(
                        self.flag("ca"),
                        Path::new("(system roots)"),
                        "no system CA certificate could be loaded; give the CA file",
                    ));
                }
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(self.flag("ca"), Path::new(""), e.to_string()))?
            .with_root_certificates(roots);
        let mut config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let (_, certs) = read_certs(self.flag("cert"), cert)?;
                check_presented(self.flag("cert"), cert, &certs)?;
                let (_, private) = read_key(self.flag("key"), key)?;
                builder.with_client_auth_cert(certs, private).map_err(|e| {
                    tls_error(
                        self.flag("key"),
                        key,
                        format!("does not go with the certificate in {}: {e}", self.flag("cert")),
                    )
                })?
            }
            (Some(cert), None) => {
                return Err(tls_error(
                    self.flag("key"),
                    cert,
                    format!("is required with {}", self.flag("cert")),
                ))
            }
            (None, Some(key)) => {
                return Err(tls_error(
                    self.flag("cert"),
                    key,
                    format!("is required with {}", self.flag("key")),
                ))
            }
            (None, None) => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// The name the server's certificate must carry.
    pub fn server_name(&self, host: &str) -> Result<rustls_pki_types::ServerName<'static>, TlsError> {
        let name = self.server_name.as_deref().unwrap_or(host);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        rustls_pki_types::ServerName::try_from(name.to_owned()).map_err(|e| {
            tls_error(
                self.flag("server-name"),
                Path::new(name),
                format!("is not a DNS name or IP address: {e}"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(dir: &Path, name: &str) -> ServerTlsFiles {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let files = ServerTlsFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
            client_ca: None,
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }

    #[test]
    fn a_rotation_that_does_not_load_keeps_the_previous_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let files = leaf(dir.path(), "server");
        let tls = ServerTls::new(files.clone()).unwrap();
        let before = tls.current.read().unwrap().clone();

        std::fs::write(&files.key, "half-written").unwrap();
        let error = tls.reload().unwrap_err();
        assert_eq!(error.flag, "--tls-key");
        assert!(Arc::ptr_eq(&before, &tls.current.read().unwrap()));

        leaf(dir.path(), "server");
        tls.reload().unwrap();
        assert!(!Arc::ptr_eq(&before, &tls.current.read().unwrap()));
    }

    /// `openssl x509 -req` without `-extfile`: an X.509 v1 certificate (a
    /// certificate only; no key is checked in, and none is read: the
    /// certificate is refused first).
    const V1_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----
MIIBGDCBvgIUREaxh558RAHrsRndo3TIQHgyNxQwCgYIKoZIzj0EAwIwDTELMAkG
A1UEAwwCY2EwHhcNMjYxMjAyMDMzMTU3WhcNMjYxMjEyMDMzMTU3WjAQMQ4wDAYD
VQQDDAVub3NhbjBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABFev9KIf8ckGImA5
dUgfgiuEHBsDxGQGJQvGiVOqkdF+fai87RXZnwbECichBpYNh6A1EMwdDrlE1pdy
klaOzzQwCgYIKoZIzj0EAwIDSQAwRgIhANHZEUV6WsYCtReYb0TucMkg/NYeNX62
rjnH2NzS3v5iAiEAiCWeoBJBrqUCA8G77qP+oy+OzOJGLapHmIqywWVAfy4=
-----END CERTIFICATE-----
";

    #[test]
    fn a_v1_certificate_is_named_as_the_certificates_fault_not_the_keys() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("nosan.crt");
        std::fs::write(&cert, V1_CERTIFICATE).unwrap();
        let key = dir.path().join("absent.key");
        let client = ClientTlsFiles {
            ca: Some(leaf(dir.path(), "ca").cert),
            cert: Some(cert.clone()),
            key: Some(key.clone()),
            server_name: None,
            flag_prefix: "--",
        };
        let error = client.load().unwrap_err();
        assert_eq!(error.flag, "--cert", "{error}");
        assert!(
            error.message.starts_with("is an X.509 v1 certificate; TLS needs v3"),
            "{error}"
        );
        let server = ServerTlsFiles {
            cert,
            key,
            client_ca: None,
        };
        assert_eq!(server.load().unwrap_err().flag, "--tls-cert");
    }

    #[test]
    fn a_key_from_another_pair_names_tls_key() {
        let dir = tempfile::tempdir().unwrap();
        let one = leaf(dir.path(), "one");
        let two = leaf(dir.path(), "two");
        let mixed = ServerTlsFiles { key: two.key, ..one };
        let error = mixed.load().unwrap_err();
        assert_eq!(error.flag, "--tls-key", "{error}");
    }
}
