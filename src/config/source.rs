//! The flags of `mcp-xds-gateway source`: a directory served as an MCP
//! source, as a file-fed Galley did: a `ResourceSource` server (`--listen`,
//! Galley's `--server`) or a dial-out to a sink (`--sink`, Galley's
//! `--sinkAddress`, run by `tools::dial_out`). It is the gateway's own app
//! with the files source and only the `ResourceSource` service, so its
//! streams follow the same rules, limits and views (its admin port shows
//! every sink's ACK and NACK state); its settings are the gateway's,
//! validated by the gateway's own checks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args as ClapArgs};
use tonic::codegen::http::{HeaderMap, HeaderName, HeaderValue};

use super::{invalid, parse_duration, parse_key_value, Args, ConfigError, EffectiveFlag, LogFormat, Serve, Settings};
use crate::source::backoff::BackoffPolicy;
use crate::tools::dial_out::DialOutSettings;
use crate::transport::connect::Dial;
use crate::transport::tls::ClientTlsFiles;

/// `--listen` given without an address: Galley's `--server` port, on
/// loopback.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9901";

/// Flags of `mcp-xds-gateway source`. Each has an `MCP_SOURCE_*`
/// environment fallback; the gateway's `MCP_GATEWAY_*` variables do not
/// apply.
#[derive(Debug, ClapArgs)]
#[command(group(ArgGroup::new("serve").required(true).args(["listen", "sink"])))]
pub struct SourceArgs {
    /// Where each flag's value came from (`/debug/config`).
    #[arg(skip)]
    pub effective: Vec<EffectiveFlag>,

    /// The directory of YAML files to serve (the format of the gateway's
    /// --source-dir), watched for changes.
    #[arg(long, env = "MCP_SOURCE_DIR", value_name = "DIR")]
    pub source_dir: PathBuf,

    /// Serve ResourceSource on this address, as Galley's --server did
    /// (without a value: 127.0.0.1:9901). Beyond loopback, give --tls-cert,
    /// --tls-key and --client-ca so only trusted sinks read the config.
    #[arg(
        long,
        env = "MCP_SOURCE_LISTEN",
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = DEFAULT_LISTEN
    )]
    pub listen: Option<SocketAddr>,

    /// Dial this sink (HOST:PORT) and serve it over the stream, as Galley's
    /// --sinkAddress did: the gateway's --sink-listen. TLS unless
    /// --sink-insecure.
    #[arg(long, env = "MCP_SOURCE_SINK", value_name = "HOST:PORT")]
    pub sink: Option<String>,

    /// Certificate chain (PEM): the server's on --listen, the client
    /// certificate presented to the sink with --sink (the gateway's
    /// --sink-listen requires one unless it runs --sink-insecure).
    #[arg(long, env = "MCP_SOURCE_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,

    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "MCP_SOURCE_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,

    /// With --listen: clients must present a certificate signed by one of
    /// these CAs (PEM) (mTLS).
    #[arg(long, env = "MCP_SOURCE_CLIENT_CA", value_name = "FILE")]
    pub client_ca: Option<PathBuf>,

    /// With --listen and --client-ca: an identity allowed to read the config
    /// (repeatable), matched like the gateway's --client-allow.
    #[arg(
        long = "client-allow",
        env = "MCP_SOURCE_CLIENT_ALLOW",
        value_name = "ID",
        value_delimiter = ','
    )]
    pub client_allow: Vec<String>,

    /// YAML rules of who may read what, as the gateway's --access-policy.
    #[arg(long, env = "MCP_SOURCE_ACCESS_POLICY", value_name = "FILE")]
    pub access_policy: Option<PathBuf>,

    /// With --sink: CA certificate(s) (PEM) that sign the sink's certificate
    /// (default: the system's roots).
    #[arg(long, env = "MCP_SOURCE_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,

    /// With --sink: the name the sink's certificate must carry, when it
    /// differs from the host in --sink.
    #[arg(long, env = "MCP_SOURCE_SERVER_NAME", value_name = "NAME")]
    pub server_name: Option<String>,

    /// With --sink: dial in plaintext. The config crosses the network
    /// readable by anyone on the way, to whoever answers at the address:
    /// only where the network alone is trusted (and the sink runs
    /// --sink-insecure).
    #[arg(long, env = "MCP_SOURCE_SINK_INSECURE")]
    pub sink_insecure: bool,

    /// With --sink: gRPC metadata sent with the stream, as Galley's
    /// --sinkMeta (KEY=VALUE, repeatable); the gateway shows it in
    /// /debug/upstream.
    #[arg(
        long = "sink-meta",
        env = "MCP_SOURCE_SINK_META",
        value_name = "KEY=VALUE",
        value_delimiter = ',',
        value_parser = parse_key_value()
    )]
    pub sink_meta: Vec<(String, String)>,

    /// With --sink: time to connect (TCP, TLS and the HTTP/2 handshake
    /// together), and for the sink to answer the stream.
    #[arg(long, env = "MCP_SOURCE_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,

    /// With --sink: the first delay before dialling again; it doubles per
    /// failed attempt and resets only once the sink ACKed a response.
    #[arg(long, env = "MCP_SOURCE_RECONNECT_MIN_DELAY", default_value = "100ms", value_parser = parse_duration)]
    pub reconnect_min_delay: Duration,

    /// With --sink: the largest base delay (each wait adds up to as much
    /// again as jitter).
    #[arg(long, env = "MCP_SOURCE_RECONNECT_MAX_DELAY", default_value = "30s", value_parser = parse_duration)]
    pub reconnect_max_delay: Duration,

    /// HTTP/2 keepalive ping interval, to the sink and from --listen to its
    /// clients ("0s" turns pings off).
    #[arg(long, env = "MCP_SOURCE_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub keepalive_interval: Duration,

    /// Address of the admin HTTP port (debug views: every sink's sync state,
    /// the served collections). Keep it on loopback. The default is Galley's
    /// ControlZ port, clear of the gateway's.
    #[arg(long, env = "MCP_SOURCE_ADMIN_LISTEN", default_value = "127.0.0.1:9876")]
    pub admin_listen: SocketAddr,

    /// Address of the monitoring HTTP port: /metrics, /healthz and /readyz
    /// (clear of the gateway's 15014, so both run on one host).
    #[arg(long, env = "MCP_SOURCE_MONITORING_LISTEN", default_value = "0.0.0.0:15015")]
    pub monitoring_listen: SocketAddr,

    /// YAML file of `collection: type_url` pairs that add to or override the
    /// built-in collection table.
    #[arg(long, env = "MCP_SOURCE_TYPE_MAP", value_name = "FILE")]
    pub type_map: Option<PathBuf>,

    /// A file of 32 bytes or more the versions of secrets (and of resources
    /// whose bodies the views hide in part) are made with, as the
    /// gateway's flag: the same versions after a restart and on every
    /// source given it (without it, the process's own key: they change at
    /// every restart, and every client is sent those resources again).
    #[arg(long, env = "MCP_SOURCE_SENSITIVE_VERSION_KEY", value_name = "FILE")]
    pub sensitive_version_key: Option<PathBuf>,

    /// Largest file of --source-dir, in bytes.
    #[arg(long, env = "MCP_SOURCE_MAX_MESSAGE_BYTES", default_value_t = 64 << 20)]
    pub max_message_bytes: usize,

    /// How long shutdown waits for streams to close before exiting.
    #[arg(long, env = "MCP_SOURCE_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Log filter (tracing's EnvFilter syntax); RUST_LOG, when set, wins.
    #[arg(long, env = "MCP_SOURCE_LOG_LEVEL", default_value = "info,h2=error")]
    pub log_level: String,

    /// Log lines as text or as one JSON object per line.
    #[arg(long, env = "MCP_SOURCE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

// === impl SourceArgs ===

impl SourceArgs {
    /// Validates every flag into the settings the app runs with; the first
    /// bad one is reported by name. Shared checks (the directory, TLS files,
    /// limits) are the gateway's own.
    pub fn validate(self) -> Result<Settings, ConfigError> {
        let mut gateway = Args::defaults();
        gateway.source_dir = Some(self.source_dir);
        gateway.admin_listen = self.admin_listen;
        gateway.monitoring_listen = self.monitoring_listen;
        gateway.type_map = self.type_map;
        gateway.sensitive_version_key = self.sensitive_version_key;
        gateway.access_policy = self.access_policy;
        gateway.max_message_bytes = self.max_message_bytes;
        gateway.keepalive_interval = self.keepalive_interval;
        gateway.reconnect_min_delay = self.reconnect_min_delay;
        gateway.reconnect_max_delay = self.reconnect_max_delay;
        gateway.shutdown_grace = self.shutdown_grace;
        gateway.log_level = self.log_level;
        gateway.log_format = self.log_format;
        gateway.effective = self.effective;
        let serve = match (self.listen, self.sink) {
            (Some(listen), None) => {
                for (flag, given) in [
                    ("--ca", self.ca.is_some()),
                    ("--server-name", self.server_name.is_some()),
                    ("--sink-insecure", self.sink_insecure),
                    ("--sink-meta", !self.sink_meta.is_empty()),
                ] {
                    if given {
                        return Err(invalid(flag, "only applies with --sink"));
                    }
                }
                // The gateway's checks and its warning for a listener beyond
                // loopback without client authentication.
                gateway.listen = listen;
                gateway.tls_cert = self.tls_cert;
                gateway.tls_key = self.tls_key;
                gateway.client_ca = self.client_ca;
                gateway.client_allow = self.client_allow;
                Serve::ResourceSource
            }
            (None, Some(sink)) => {
                if self.client_ca.is_some() {
                    return Err(invalid("--client-ca", "only applies with --listen"));
                }
                if !self.client_allow.is_empty() {
                    return Err(invalid("--client-allow", "only applies with --listen"));
                }
                if self.connect_timeout.is_zero() {
                    return Err(invalid("--connect-timeout", "must be above zero"));
                }
                let tls = ClientTlsFiles {
                    ca: self.ca,
                    cert: self.tls_cert,
                    key: self.tls_key,
                    server_name: self.server_name,
                    flag_prefix: "--tls-",
                };
                let (scheme, tls) = if self.sink_insecure {
                    if let Some(flag) = tls.first_flag() {
                        return Err(invalid(flag, "does not apply with --sink-insecure (plaintext)"));
                    }
                    ("http", None)
                } else {
                    tls.load()
                        .map_err(|e| invalid(e.flag, format!("{}: {}", e.path.display(), e.message)))?;
                    ("https", Some(tls))
                };
                Serve::DialOut(Box::new(DialOutSettings {
                    dial: Dial {
                        address: sink_address(&sink, scheme)?,
                        tls,
                        timeout: self.connect_timeout,
                        keepalive: (!self.keepalive_interval.is_zero()).then_some(self.keepalive_interval),
                        caller: crate::transport::dial_why::Caller::Source,
                    },
                    backoff: BackoffPolicy {
                        min: self.reconnect_min_delay,
                        max: self.reconnect_max_delay,
                    },
                    metadata: sink_metadata(&self.sink_meta)?,
                }))
            }
            // The argument group makes these a usage error first.
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "--sink",
                    "cannot be combined with --listen: serve sinks that dial in, or dial one sink",
                ))
            }
            (None, None) => {
                return Err(invalid(
                    "--listen",
                    "give --listen [ADDR] (serve sinks that dial in) or --sink HOST:PORT (dial a sink)",
                ))
            }
        };
        let mut settings = gateway.validate()?;
        settings.serve = serve;
        Ok(settings)
    }
}

/// `HOST:PORT` as the URL the dialler takes.
fn sink_address(sink: &str, scheme: &str) -> Result<String, ConfigError> {
    super::refuse_credentials_in_address("--sink", sink)?;
    if sink.contains("://") {
        return Err(invalid(
            "--sink",
            "give HOST:PORT, not a URL, as Galley's --sinkAddress (TLS unless --sink-insecure)",
        ));
    }
    let url = format!("{scheme}://{sink}");
    let uri: tonic::transport::Uri = url.parse().map_err(|_| invalid("--sink", "is not HOST:PORT"))?;
    let host_given = uri.host().is_some_and(|h| !h.is_empty());
    let bare = uri
        .path_and_query()
        .is_none_or(|p| p.as_str() == "/" || p.as_str().is_empty());
    if !host_given || uri.port_u16().is_none() || !bare {
        // Not quoted: what follows the port may be a credential.
        return Err(invalid("--sink", "is not HOST:PORT"));
    }
    Ok(url)
}

/// `--sink-meta` as gRPC metadata: lowercase ASCII names, none of the
/// transport's own headers.
fn sink_metadata(pairs: &[(String, String)]) -> Result<HeaderMap, ConfigError> {
    let mut metadata = HeaderMap::new();
    for (key, value) in pairs {
        let lower = key.to_ascii_lowercase();
        if lower.starts_with("grpc-") || lower.ends_with("-bin") || matches!(lower.as_str(), "te" | "content-type") {
            return Err(invalid(
                "--sink-meta",
                format!("{key:?} is a name gRPC reserves (grpc-*, *-bin, te, content-type)"),
            ));
        }
        let name = HeaderName::from_bytes(lower.as_bytes())
            .map_err(|_| {
                invalid(
                    "--sink-meta",
                    "a key is not a metadata name (letters, digits, '-', '_' and '.'; not quoted: it may hold what was meant as its value)",
                )
            })?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| invalid("--sink-meta", format!("the value of {key:?} is not a metadata value")))?;
        metadata.append(name, value);
    }
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Command {
        #[command(flatten)]
        source: SourceArgs,
    }

    fn parse(args: &[&str]) -> Result<Settings, String> {
        let dir = env!("CARGO_MANIFEST_DIR").to_owned() + "/examples/config";
        let argv = ["source", "--source-dir", &dir, "--monitoring-listen", "127.0.0.1:0"];
        let command = Command::try_parse_from(argv.iter().chain(args)).map_err(|e| e.to_string())?;
        command.source.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn listen_defaults_to_galleys_port_on_loopback() {
        let settings = parse(&["--listen"]).unwrap();
        assert!(matches!(settings.serve, Serve::ResourceSource));
        assert_eq!(settings.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(settings.admin_listen.to_string(), "127.0.0.1:9876");
        let settings = parse(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(settings.listen.port(), 0);
    }

    #[test]
    fn the_sink_is_dialled_with_tls_unless_insecure() {
        let settings = parse(&[
            "--sink",
            "127.0.0.1:15020",
            "--sink-insecure",
            "--sink-meta",
            "team=mesh",
        ])
        .unwrap();
        let Serve::DialOut(dial_out) = settings.serve else {
            panic!("dial-out")
        };
        assert_eq!(dial_out.dial.address, "http://127.0.0.1:15020");
        assert!(dial_out.dial.tls.is_none());
        assert_eq!(dial_out.metadata["team"], "mesh");
        assert_eq!(dial_out.dial.keepalive, Some(Duration::from_secs(30)));
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&[][..], "--listen"),
            (&["--listen", "--sink", "g:1"][..], "--sink"),
            (&["--sink", "http://g:1", "--sink-insecure"][..], "--sink"),
            (&["--sink", "g", "--sink-insecure"][..], "--sink"),
            (&["--sink", "g:1/x", "--sink-insecure"][..], "--sink"),
            (&["--sink", "user:pw@g:1", "--sink-insecure"][..], "user info"),
            (&["--sink", "g:1", "--sink-insecure", "--ca", "/ca.pem"][..], "--ca"),
            (
                &["--sink", "g:1", "--sink-insecure", "--tls-cert", "/c.pem"][..],
                "--tls-cert",
            ),
            (&["--sink", "g:1", "--ca", "/nonexistent/ca.pem"][..], "--ca"),
            (
                &["--sink", "g:1", "--ca", "/nonexistent/ca.pem", "--tls-cert", "/c"][..],
                "--ca",
            ),
            (&["--sink", "g:1", "--client-ca", "/ca.pem"][..], "--client-ca"),
            (
                &["--sink", "g:1", "--sink-insecure", "--sink-meta", "grpc-x=1"][..],
                "--sink-meta",
            ),
            (
                &["--sink", "g:1", "--sink-insecure", "--sink-meta", "novalue"][..],
                "--sink-meta",
            ),
            (
                &["--sink", "g:1", "--sink-insecure", "--connect-timeout", "0s"][..],
                "--connect-timeout",
            ),
            (
                &["--sink", "g:1", "--sink-insecure", "--reconnect-min-delay", "0s"][..],
                "--reconnect-min-delay",
            ),
            (&["--listen", "--ca", "/ca.pem"][..], "--ca"),
            (&["--listen", "--sink-insecure"][..], "--sink-insecure"),
            (&["--listen", "--client-ca", "/ca.pem"][..], "--client-ca"),
            (&["--listen", "--tls-cert", "/nonexistent.pem"][..], "--tls-key"),
            (&["--listen", "nowhere"][..], "--listen"),
            (&["--listen", "--max-message-bytes", "10"][..], "--max-message-bytes"),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(flag), "{args:?}: {err}");
        }
        let missing = Command::try_parse_from(["source", "--listen"]).unwrap_err().to_string();
        assert!(missing.contains("--source-dir"), "{missing}");
    }
}
