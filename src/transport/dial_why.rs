//! Why a dial failed, in an operator's words: the TLS alert the server sent
//! (and what in the client's own certificate it refers to), the local reason
//! a server's certificate was refused (unknown CA, name, expiry, purpose, an
//! X.509 v1 certificate), and a server that does not speak what it was
//! dialled with (a TLS port dialled in plaintext, a plaintext port dialled
//! with TLS, a port that is not HTTP/2).

use std::io::ErrorKind;
use std::path::Path;

use rustls::{AlertDescription, CertificateError};

use super::tls::{read_certs, ClientTlsFiles};

/// Who dials, for the flags a hint names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The gateway's upstream client (`--upstream`, `--upstream-ca`, …).
    Upstream,
    /// The `client` command (`--target`, `--ca`, …).
    Client,
    /// The `source` command dialling a sink (`--sink`, `--sink-insecure`).
    Source,
}

impl Caller {
    /// The flag that bounds the dial.
    pub fn timeout_flag(self) -> &'static str {
        match self {
            Caller::Client => "--timeout",
            Caller::Upstream | Caller::Source => "--connect-timeout",
        }
    }

    /// How to dial with TLS instead.
    fn use_tls(self) -> &'static str {
        match self {
            Caller::Upstream => "give an https:// --upstream (and --upstream-ca)",
            Caller::Client => {
                "give an https:// --target or --ca (and --cert, --key if it asks for a client certificate)"
            }
            Caller::Source => "drop --sink-insecure (and give --ca, --tls-cert, --tls-key)",
        }
    }

    /// How to dial in plaintext instead.
    fn use_plaintext(self) -> &'static str {
        match self {
            Caller::Upstream => "give an http:// --upstream",
            Caller::Client => "give an http:// --target, without --ca",
            Caller::Source => "give --sink-insecure (the sink runs --sink-insecure)",
        }
    }
}

/// The TLS error an I/O error carries, if any.
fn rustls_error(error: &std::io::Error) -> Option<&rustls::Error> {
    error.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>())
}

/// A read or write error of a connection, kept to explain its end (an
/// `io::Error` is not `Clone`).
#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: std::io::ErrorKind,
    pub text: String,
    /// The TLS error it carried (a TLS alert is one).
    pub tls: Option<rustls::Error>,
}

impl Failure {
    pub fn of(error: &std::io::Error) -> Self {
        Self {
            kind: error.kind(),
            text: error.to_string(),
            tls: rustls_error(error).cloned(),
        }
    }
}

/// A TLS record's first bytes: alert (21) or handshake (22), version 3.x.
fn is_tls_record(bytes: &[u8]) -> bool {
    matches!(bytes, [0x15 | 0x16, 0x03, ..])
}

/// An HTTP/2 frame header whose type is SETTINGS.
fn is_http2_settings(bytes: &[u8]) -> bool {
    bytes.len() >= 9 && bytes[3] == 0x4
}

/// Up to 16 bytes, as hex and as text where printable.
fn shown(bytes: &[u8]) -> String {
    let bytes = &bytes[..bytes.len().min(16)];
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let text: String = bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    format!("{} ({text:?})", hex.join(" "))
}

/// What a server that answered a TLS ClientHello with something other than
/// TLS speaks (`wire`: its first bytes, maybe none).
fn not_tls(wire: &[u8], caller: Caller) -> String {
    let what = if is_http2_settings(wire) {
        "the server speaks plaintext HTTP/2, not TLS: it answered the TLS ClientHello with an HTTP/2 SETTINGS frame"
            .to_owned()
    } else if wire.starts_with(b"HTTP/") {
        "the server speaks plaintext HTTP/1, not TLS: it answered the TLS ClientHello with an HTTP response".to_owned()
    } else if wire.is_empty() {
        "the server closed the connection without answering the TLS ClientHello: a plaintext port, or a server \
         refusing connections (at a connection limit)"
            .to_owned()
    } else {
        format!(
            "the server does not speak TLS: it answered the ClientHello with {}",
            shown(wire)
        )
    };
    format!("{what}; {}", caller.use_plaintext())
}

/// A TLS handshake that failed: why, from the client's side.
pub fn handshake_failed(error: &std::io::Error, wire: &[u8], files: &ClientTlsFiles, caller: Caller) -> String {
    let Some(tls) = rustls_error(error) else {
        if error.kind() == std::io::ErrorKind::UnexpectedEof || !is_tls_record(wire) {
            return not_tls(wire, caller);
        }
        return error.to_string();
    };
    match tls {
        rustls::Error::InvalidCertificate(e) => server_certificate(e, files),
        rustls::Error::AlertReceived(alert) => alert_received(*alert, files),
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } if !is_tls_record(wire) => {
            not_tls(wire, caller)
        }
        rustls::Error::NoApplicationProtocol => {
            "the server does not offer HTTP/2 over TLS (ALPN h2): not a gRPC port".to_owned()
        }
        other => other.to_string(),
    }
}

/// The server's certificate, refused by the client.
fn server_certificate(error: &CertificateError, files: &ClientTlsFiles) -> String {
    let ca = match &files.ca {
        Some(path) => format!("{} {}", files.flag("ca"), path.display()),
        None => format!("the system's roots (no {} given)", files.flag("ca")),
    };
    match error {
        CertificateError::UnknownIssuer => {
            format!("the server's certificate is not signed by a CA in {ca} (unknown CA): give the CA that signed it")
        }
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => format!(
            "the server's certificate does not carry the name dialled ({error}); dial a name it carries, or give {}",
            files.flag("server-name")
        ),
        CertificateError::Expired
        | CertificateError::ExpiredContext { .. }
        | CertificateError::NotValidYet
        | CertificateError::NotValidYetContext { .. } => {
            format!("the server's certificate is out of its validity period: {error}")
        }
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => format!(
            "the server's certificate does not allow server authentication (extended key usage serverAuth): {error}"
        ),
        CertificateError::Other(other) => {
            let text = format!("{other:?}");
            if text.contains("UnsupportedCertVersion") {
                "the server's certificate is an X.509 v1 certificate (no extensions, so no names): TLS needs v3; \
                 reissue it with extensions (openssl x509 -req … -extfile with subjectAltName)"
                    .to_owned()
            } else if text.contains("CaUsedAsEndEntity") {
                "the server's certificate is a CA certificate (basicConstraints CA:TRUE) used as a server's".to_owned()
            } else {
                format!("the server's certificate is refused: {other}")
            }
        }
        other => format!("the server's certificate is refused: {other}"),
    }
}

/// The TLS name of an alert (`unknown_ca`), as openssl and the RFCs print it.
pub fn alert_name(alert: AlertDescription) -> String {
    let mut name = String::new();
    let mut after_lower = false;
    for c in format!("{alert:?}").chars() {
        // `UnknownCA`: a run of capitals is one word.
        if c.is_ascii_uppercase() && after_lower {
            name.push('_');
        }
        after_lower = c.is_ascii_lowercase();
        name.push(c.to_ascii_lowercase());
    }
    name
}

/// A fatal alert the server sent: during the handshake (TLS 1.2, or a
/// refused ClientHello) or at the client's first read (TLS 1.3, which
/// checks the client's certificate after the client's side is done).
pub fn alert_received(alert: AlertDescription, files: &ClientTlsFiles) -> String {
    let name = alert_name(alert);
    let certificate = files.cert.as_deref().map(|path| (files.flag("cert"), path));
    let refused = match certificate {
        Some((flag, path)) => format!("the server refused the client certificate {flag} {}", path.display()),
        None => "the server refused the connection".to_owned(),
    };
    let generic = match alert {
        AlertDescription::CertificateRequired => match certificate {
            None => {
                return format!(
                    "the server requires a client certificate (mTLS; TLS alert {name}): give {} and {}",
                    files.flag("cert"),
                    files.flag("key")
                )
            }
            Some(_) => "it requires a client certificate",
        },
        AlertDescription::UnknownCA => "it does not trust the CA that signed it",
        AlertDescription::CertificateExpired => "it is expired or not yet valid",
        AlertDescription::UnsupportedCertificate => "its key usage does not allow client authentication",
        AlertDescription::BadCertificate => "it is malformed or not acceptable",
        AlertDescription::CertificateUnknown => "it is not acceptable as a client certificate",
        AlertDescription::CertificateRevoked => "it is revoked",
        AlertDescription::AccessDenied => "the server does not allow this client",
        AlertDescription::DecryptError => "its signature does not verify",
        AlertDescription::HandshakeFailure if certificate.is_none() => {
            return format!(
                "the server ended the TLS handshake with alert {name}: it may require a client certificate (mTLS: \
                 give {} and {}), or share no cipher suite with this client",
                files.flag("cert"),
                files.flag("key")
            )
        }
        AlertDescription::ProtocolVersion
        | AlertDescription::HandshakeFailure
        | AlertDescription::InsufficientSecurity => {
            return format!(
                "the server ended the TLS handshake with alert {name}: it shares no TLS version or cipher suite with \
                 this client (TLS 1.2 and 1.3)"
            )
        }
        AlertDescription::NoApplicationProtocol => {
            return format!("the server does not offer HTTP/2 over TLS (TLS alert {name}): not a gRPC port")
        }
        _ => return format!("the server ended the connection with TLS alert {name}"),
    };
    let local = certificate
        .map(|(flag, path)| client_certificate_problems(flag, path))
        .unwrap_or_default();
    if local.is_empty() {
        format!("{refused} (TLS alert {name}): {generic}")
    } else {
        format!("{refused} (TLS alert {name}): {}", local.join("; "))
    }
}

/// What in the client's own certificate a server would refuse: its
/// validity, its extended key usage, a self-signed or CA certificate.
/// Empty when nothing is found (or the file no longer reads).
pub fn client_certificate_problems(flag: &'static str, path: &Path) -> Vec<String> {
    let Ok((_, certs)) = read_certs(flag, path) else {
        return Vec::new();
    };
    let Some(Ok((_, cert))) = certs.first().map(|der| x509_parser::parse_x509_certificate(der)) else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    let validity = cert.validity();
    let now = x509_parser::time::ASN1Time::now();
    if validity.not_after < now {
        problems.push(format!("it expired on {}", validity.not_after));
    }
    if validity.not_before > now {
        problems.push(format!("it is not valid before {}", validity.not_before));
    }
    if let Ok(Some(eku)) = cert.extended_key_usage() {
        let eku = eku.value;
        if !eku.client_auth && !eku.any {
            let allowed: Vec<&str> = [
                (eku.server_auth, "serverAuth"),
                (eku.code_signing, "codeSigning"),
                (eku.email_protection, "emailProtection"),
                (eku.time_stamping, "timeStamping"),
                (eku.ocsp_signing, "OCSPSigning"),
            ]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect();
            problems.push(format!(
                "its extended key usage does not allow client authentication (clientAuth){}",
                if allowed.is_empty() {
                    String::new()
                } else {
                    format!(", only {}", allowed.join(", "))
                }
            ));
        }
    }
    if let Ok(Some(constraints)) = cert.basic_constraints() {
        if constraints.value.ca {
            problems.push("it is a CA certificate (basicConstraints CA:TRUE), not a client's".to_owned());
        }
    }
    if self_signed(&cert) {
        problems.push(format!(
            "it is self-signed ({}): the server trusts only certificates its client CA signed",
            cert.subject()
        ));
    } else if problems.is_empty() {
        problems.push(format!(
            "it is issued by {}; is that the server's client CA?",
            cert.issuer()
        ));
    }
    problems
}

/// Whether `cert` signed itself: its issuer is its subject and, where it
/// names them, the key that signed it (authority key identifier) is its own
/// (subject key identifier). A leaf whose CA shares its name is not.
fn self_signed(cert: &x509_parser::certificate::X509Certificate<'_>) -> bool {
    use x509_parser::extensions::ParsedExtension;
    if cert.subject() != cert.issuer() {
        return false;
    }
    let (mut authority, mut subject) = (None, None);
    for extension in cert.extensions() {
        match extension.parsed_extension() {
            ParsedExtension::AuthorityKeyIdentifier(aki) => authority = aki.key_identifier.as_ref().map(|k| k.0),
            ParsedExtension::SubjectKeyIdentifier(ski) => subject = Some(ski.0),
            _ => {}
        }
    }
    match (authority, subject) {
        (Some(authority), Some(subject)) => authority == subject,
        // Signed by a key it names, and has none of its own to be it.
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// A TLS connection the server ended right after the handshake without an
/// alert the client could read: most likely it refused the client's
/// certificate (or its absence); what in it a server would refuse.
fn closed_after_handshake(files: &ClientTlsFiles, how: &str) -> String {
    let said = format!("the server ended the TLS connection after the handshake without a readable alert ({how})");
    match files.cert.as_deref() {
        None => format!(
            "{said}: it may require a client certificate (mTLS): give {} and {}",
            files.flag("cert"),
            files.flag("key")
        ),
        Some(path) => {
            let problems = client_certificate_problems(files.flag("cert"), path);
            format!(
                "{said}: it may have refused the client certificate {} {}{}",
                files.flag("cert"),
                path.display(),
                if problems.is_empty() {
                    String::new()
                } else {
                    format!(": {}", problems.join("; "))
                }
            )
        }
    }
}

/// What the connection showed before the server's HTTP/2 SETTINGS, once
/// it ended: `app`, the first bytes above TLS (the wire in plaintext);
/// `error`, the first read or write error; `closed`, an end of stream.
pub fn ended_before_settings(
    tls: Option<&ClientTlsFiles>,
    app: &[u8],
    error: Option<&Failure>,
    closed: bool,
    caller: Caller,
) -> String {
    if let Some(e) = error {
        return match (&e.tls, tls) {
            (Some(rustls::Error::AlertReceived(alert)), Some(files)) => alert_received(*alert, files),
            (Some(other), _) => format!("TLS failed: {other}"),
            // The server closed on the preface HTTP/2 wrote, and the reset
            // that followed discarded its alert unread.
            (None, Some(files)) if matches!(e.kind, ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
                closed_after_handshake(files, &e.text)
            }
            (None, None) if e.kind == std::io::ErrorKind::ConnectionReset && !is_tls_record(app) => format!(
                "the server reset the connection after the HTTP/2 preface: it may speak TLS; {}",
                caller.use_tls()
            ),
            (None, _) if tls.is_none() && is_tls_record(app) => format!(
                "the server speaks TLS: it answered the plaintext HTTP/2 preface with a TLS record; {}",
                caller.use_tls()
            ),
            (None, _) => format!("the connection failed: {}", e.text),
        };
    }
    if !app.is_empty() && !is_http2_settings(app) {
        if tls.is_none() && is_tls_record(app) {
            return format!(
                "the server speaks TLS: it answered the plaintext HTTP/2 preface with a TLS record; {}",
                caller.use_tls()
            );
        }
        if app.starts_with(b"HTTP/") {
            return "the server answers HTTP/1, not HTTP/2: not a gRPC port".to_owned();
        }
        return format!(
            "the server's first bytes are not an HTTP/2 SETTINGS frame: {}; not a gRPC port",
            shown(app)
        );
    }
    match (closed, tls) {
        // A TLS server answers plaintext with a TLS record (above); an
        // HTTP/1 server (the gateway's admin or monitoring port) closes.
        (true, None) => format!(
            "the server closed the connection after the HTTP/2 preface without a word: most likely an HTTP/1 \
             port, not a gRPC one (the gateway's admin and monitoring ports close so; its gRPC port is \
             --listen, 15010 by default); if it is a TLS port that sent no alert, {}",
            caller.use_tls()
        ),
        (true, Some(files)) => closed_after_handshake(files, "closed"),
        (false, _) => "the connection ended before the server's HTTP/2 SETTINGS".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_whose_ca_shares_its_name_is_not_self_signed() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let named = |ca: bool| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, "otherca");
            params.use_authority_key_identifier_extension = !ca;
            params.key_identifier_method = rcgen::KeyIdMethod::Sha256;
            if ca {
                params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            }
            params
        };
        let ca_key = KeyPair::generate().unwrap();
        let ca = named(true).self_signed(&ca_key).unwrap();
        let ca_params = named(true);
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = named(false).signed_by(&leaf_key, &issuer).unwrap();
        let self_signed = |der: &[u8]| super::self_signed(&x509_parser::parse_x509_certificate(der).unwrap().1);
        assert!(!self_signed(leaf.der()), "signed by a CA of the same name");
        assert!(self_signed(ca.der()), "the CA signed itself");
    }

    #[test]
    fn alerts_are_named_as_tls_names_them() {
        assert_eq!(alert_name(AlertDescription::UnknownCA), "unknown_ca");
        assert_eq!(
            alert_name(AlertDescription::UnsupportedCertificate),
            "unsupported_certificate"
        );
        assert_eq!(
            alert_name(AlertDescription::CertificateRequired),
            "certificate_required"
        );
    }

    #[test]
    fn what_a_server_speaks_is_told_from_its_first_bytes() {
        let plaintext_h2 = [0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3];
        let files = ClientTlsFiles::default();
        let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        let said = handshake_failed(&eof, &plaintext_h2, &files, Caller::Client);
        assert!(
            said.contains("plaintext HTTP/2, not TLS") && said.contains("http:// --target"),
            "{said}"
        );
        let said = handshake_failed(&eof, &[], &files, Caller::Source);
        assert!(
            said.contains("without answering the TLS ClientHello") && said.contains("--sink-insecure"),
            "{said}"
        );
        let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32];
        let said = ended_before_settings(None, &alert, None, true, Caller::Client);
        assert!(said.starts_with("the server speaks TLS"), "{said}");
        let said = ended_before_settings(None, b"HTTP/1.1 400 Bad Request", None, false, Caller::Upstream);
        assert!(said.contains("HTTP/1, not HTTP/2"), "{said}");
    }
}
