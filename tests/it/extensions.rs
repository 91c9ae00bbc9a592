//! Every Envoy extension written as YAML (issue 41): the files source reads
//! any `typed_config` of Envoy's v3 API. The example listener (a TLS
//! inspector, a file and a stdout access log, CORS, fault injection, a local
//! rate limit, RBAC, Lua and the router) passes `check` and is served to a
//! real Envoy, which answers requests through it to an upstream the test
//! runs and writes them to its access logs; a secret inside an extension
//! only these descriptors read reads `[redacted]` in every view; a type no
//! descriptor describes is an error naming it.

use std::net::SocketAddr;

use serde_json::{json, Value};

use crate::check::findings;
use crate::envoy::{copy_examples, edit, example_dir, names};
use crate::helpers::envoy::{dynamic_routes, section, AdsApi, Envoy};
use crate::helpers::{eventually, eventually_some, get_json, http_exchange, http_get, start_gateway};
use crate::operating::subcommand;

const LISTENERS: &str = "envoy/config/listener/v3/listeners";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// An HTTP server on 127.0.0.1 (port 0) answering every request with the
/// path it saw: the example's `backend`.
async fn upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|uri: axum::http::Uri| async move { format!("upstream saw {uri}") });
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The address Envoy's listener `name` is bound to (`/listeners`:
/// `name::address` lines), once it is.
async fn listener_addr(envoy: &Envoy, name: &str) -> SocketAddr {
    let prefix = format!("{name}::");
    eventually_some(&format!("Envoy's listener {name} bound"), || async {
        envoy
            .listeners()
            .await
            .lines()
            .find_map(|line| line.strip_prefix(&prefix)?.parse::<SocketAddr>().ok())
            .filter(|addr| addr.port() != 0)
    })
    .await
}

/// The value of header `name` in a lowercased response head.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    let prefix = format!("{name}: ");
    head.lines().find_map(|line| line.strip_prefix(&prefix)).map(str::trim)
}

/// The extensions the example listener's `typed_config`s name, as Envoy's
/// config dump shows the listener it runs.
fn extension_types(dump: &Value) -> Vec<String> {
    let mut found = Vec::new();
    collect_types(
        &section(dump, "ListenersConfigDump").cloned().unwrap_or_default(),
        &mut found,
    );
    found.sort();
    found.dedup();
    found
}

fn collect_types(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            if let Some(Value::String(url)) = fields.get("@type") {
                found.push(url.rsplit('/').next().unwrap_or(url).to_owned());
            }
            fields.values().for_each(|v| collect_types(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_types(v, found)),
        _ => {}
    }
}

#[tokio::test]
async fn the_example_listener_with_every_kind_of_extension_passes_check() {
    let dir = example_dir();
    let (code, stdout, stderr) = subcommand(
        "check",
        &[
            "--strict",
            "--output",
            "json",
            "--for",
            "all-served",
            dir.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!((code, stdout.trim()), (Some(0), "[]"), "{stderr}");
    let listeners = std::fs::read_to_string(dir.join("listeners.yaml")).unwrap();
    for extension in [
        "tls_inspector.v3.TlsInspector",
        "access_loggers.file.v3.FileAccessLog",
        "access_loggers.stream.v3.StdoutAccessLog",
        "filters.http.cors.v3.Cors",
        "filters.http.fault.v3.HTTPFault",
        "filters.http.local_ratelimit.v3.LocalRateLimit",
        "filters.http.rbac.v3.RBAC",
        "filters.http.lua.v3.Lua",
        "filters.http.router.v3.Router",
    ] {
        assert!(listeners.contains(extension), "the example has {extension}");
    }
}

/// The example directory, its endpoint the test's upstream: Envoy takes
/// the listener (no rejection) and every filter of it acts on requests.
#[tokio::test]
#[cfg_attr(not(peer_envoy), ignore = "needs Envoy 1.40 (.ci/run sets ENVOY_BIN)")]
async fn envoy_runs_the_example_listeners_extensions_on_requests() {
    let backend = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    edit(
        dir.path(),
        "endpoints.yaml",
        "port_value: 8080",
        &format!("port_value: {}", backend.port()),
    );
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    let envoy = Envoy::start(gw.listen, AdsApi::Sotw, "envoy-1")
        .await
        .unwrap_or_else(|why| panic!("Envoy: {why}"));
    envoy
        .listeners_when("the example's listener", |l| names(l) == ["http"])
        .await;
    let dump = envoy.config_dump().await;
    let types = extension_types(&dump);
    for extension in [
        "envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector",
        "envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
        "envoy.extensions.filters.http.cors.v3.Cors",
        "envoy.extensions.filters.http.fault.v3.HTTPFault",
        "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        "envoy.extensions.filters.http.rbac.v3.RBAC",
        "envoy.extensions.filters.http.lua.v3.Lua",
        "envoy.extensions.filters.http.router.v3.Router",
    ] {
        assert!(
            types.iter().any(|t| t == extension),
            "Envoy runs {extension}: {types:?}"
        );
    }
    let listener = listener_addr(&envoy, "http").await;
    // The route (RDS) and the endpoint (EDS) before any request: requests
    // answered 503 meanwhile would spend the local rate limit's tokens.
    let endpoint = format!("backend::{backend}::");
    envoy
        .clusters_text_when("the upstream as the backend's endpoint", |t| t.contains(&endpoint))
        .await;
    envoy
        .dump_matches("the example's route", |d| names(&dynamic_routes(d)) == ["local_route"])
        .await;

    // Through the route, the cluster and its endpoint to the upstream; Lua
    // adds its header on the way back.
    let (head, body) = eventually_some("a request answered by the upstream through Envoy", || async {
        let (status, head, body) = http_exchange(listener, "GET", "/hello", "").await;
        (status == 200).then_some((head, body))
    })
    .await;
    assert_eq!(body, "upstream saw /hello");
    assert_eq!(header(&head, "x-lua"), Some("seen"), "{head}");

    // RBAC denies what its policy names; the fault filter aborts a request
    // that asks; CORS answers a preflight from the route's origin.
    let (status, _, body) = http_exchange(listener, "GET", "/admin/users", "").await;
    assert_eq!((status, body.as_str()), (403, "RBAC: access denied"));
    let (status, _, _) = http_exchange(listener, "GET", "/hello", "x-envoy-fault-abort-request: 418\r\n").await;
    assert_eq!(status, 418);
    let (status, head, _) = http_exchange(
        listener,
        "OPTIONS",
        "/hello",
        "Origin: https://app.example.com\r\nAccess-Control-Request-Method: GET\r\n",
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert_eq!(
        header(&head, "access-control-allow-origin"),
        Some("https://app.example.com"),
        "{head}"
    );
    // The local rate limit let them through; the TLS inspector saw plain text.
    assert!(
        envoy
            .stat("http_local_rate_limiter.http_local_rate_limit.ok")
            .await
            .is_some_and(|ok| ok >= 1),
        "{:?}",
        envoy
            .stats()
            .await
            .keys()
            .filter(|k| k.contains("rate_limit"))
            .collect::<Vec<_>>()
    );
    let stats = envoy.stats().await;
    let not_tls = stats
        .iter()
        .find(|(name, _)| name.ends_with("tls_inspector.tls_not_found"))
        .map(|(_, v)| v.parse::<u64>().unwrap_or_default());
    assert!(not_tls.is_some_and(|n| n >= 1), "{not_tls:?}");

    // Both access logs hold the request: the file in the directory the test
    // gave, stdout in Envoy's output.
    let access_log = dir.path().join("access.log");
    eventually("the request in the file access log", || {
        std::fs::read_to_string(&access_log).is_ok_and(|log| {
            log.lines().any(|l| l.contains(" GET /hello 200 ")) && log.contains(" GET /admin/users 403 ")
        })
    })
    .await;
    eventually("the request in the stdout access log", || {
        std::fs::read_to_string(envoy.dir().join("stdio.log"))
            .is_ok_and(|out| out.contains("\"GET /hello HTTP/1.1\" 200"))
    })
    .await;
    for rejected in [
        "listener_manager.lds.update_rejected",
        "cluster_manager.cds.update_rejected",
    ] {
        assert_eq!(envoy.stat(rejected).await, Some(0), "{rejected}");
    }
}

/// A listener whose HTTP filter checks basic auth: the users (htpasswd
/// lines, marked `(udpa.annotations.sensitive)` in `basic_auth.proto`)
/// read `[redacted]` in the config dump (JSON and YAML) and `client
/// --output`, inside the connection manager's `Any` inside the listener's.
#[tokio::test]
async fn a_secret_inside_an_extension_reads_redacted_in_every_view() {
    // An htpasswd line: a user and the SHA-1 of the password, base64.
    const USERS: &str = "alice:{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g=";
    let listener = json!({
        "name": "guarded",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "guarded",
                "route_config": {"name": "r", "virtual_hosts": [{"name": "all", "domains": ["*"]}]},
                "http_filters": [
                    {"name": "envoy.filters.http.basic_auth", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.basic_auth.v3.BasicAuth",
                        "users": {"inline_string": USERS},
                        "forward_username_header": "x-user",
                    }},
                    {"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    }},
                ],
            },
        }]}],
    });
    let document = json!({
        "collection": LISTENERS,
        "name": "guarded",
        "body": {"type_url": LISTENER_TYPE, "json": listener},
    });
    let dir = tempfile::tempdir().unwrap();
    crate::helpers::certs::write(
        dir.path(),
        "listeners.yaml",
        &serde_norway::to_string(&document).unwrap(),
    );
    let gw = start_gateway(&["--source-dir", dir.path().to_str().unwrap()]).await;
    eventually("the listener in the cache", || {
        gw.cache.get(LISTENERS).is_some_and(|s| s.len() == 1)
    })
    .await;
    let secret = "W6ph5Mm5Pz8GgiULbPgzG37mj9g";

    let dump = get_json(gw.admin, &format!("/debug/cache/{LISTENERS}?bodies=json")).await;
    assert!(!dump.to_string().contains(secret), "{dump}");
    let filters = &dump["resources"][0]["body"]["filterChains"][0]["filters"][0]["typedConfig"]["httpFilters"];
    assert_eq!(filters[0]["typedConfig"]["users"], "[redacted]", "{dump}");
    assert_eq!(
        filters[0]["typedConfig"]["forwardUsernameHeader"], "x-user",
        "what is no secret is shown: {dump}"
    );
    let (status, yaml) = http_get(gw.admin, &format!("/debug/cache/{LISTENERS}?bodies=yaml")).await;
    assert_eq!(status, 200, "{yaml}");
    assert!(!yaml.contains(secret), "{yaml}");
    assert_eq!(yaml.matches("users: '[redacted]'").count(), 1, "{yaml}");

    let listen = gw.listen.to_string();
    for output in ["yaml", "json"] {
        let (code, stdout, stderr) = subcommand(
            "client",
            &[
                "--target",
                &listen,
                "--type-url",
                LISTENERS,
                "--once",
                "--output",
                output,
            ],
        )
        .await;
        assert_eq!(code, Some(0), "{stderr}");
        assert!(
            !format!("{stdout}{stderr}").contains(secret),
            "client --output {output}: {stdout}"
        );
        assert_eq!(stdout.matches("[redacted]").count(), 1, "{stdout}");
        assert!(stdout.contains("x-user"), "{stdout}");
    }
}

/// A `typed_config` of a type no descriptor here describes (a typo in a
/// real extension's name, or a type of no Envoy): `check` and the
/// gateway's files source both name the type and where it is.
#[tokio::test]
async fn an_unknown_type_inside_typed_config_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example_dir().join("listeners.yaml"))
        .unwrap()
        .replace("filters.http.lua.v3.Lua", "filters.http.lua.v3.Luaa");
    crate::helpers::certs::write(dir.path(), "listeners.yaml", &text);
    // The `typed_config:` line the `@type` is under.
    let line = text.lines().position(|l| l.contains("lua.v3.Luaa")).unwrap() as u64;
    assert!(text.lines().nth(line as usize - 1).unwrap().trim() == "typed_config:");
    let path = dir.path().to_str().unwrap();

    let (code, stdout, stderr) = subcommand("check", &["--output", "json", path]).await;
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let found = findings(&stdout);
    assert_eq!(found.len(), 1, "{stdout}");
    let (file, at, severity, message) = &found[0];
    assert_eq!(
        (file.as_str(), *at, severity.as_str()),
        ("listeners.yaml", line, "error"),
        "{message}"
    );
    assert!(
        message.contains("envoy.extensions.filters.http.lua.v3.Luaa")
            && message.contains("filter_chains[0].filters[0].typed_config.http_filters[4].typed_config")
            && message.contains("value_base64"),
        "{message}"
    );

    // The gateway says the same and serves no listener.
    let gw = start_gateway(&["--source-dir", path]).await;
    let upstream = eventually_some("the source's error in /debug/upstream", || async {
        let upstream = get_json(gw.admin, "/debug/upstream").await;
        upstream["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("Luaa"))
            .then_some(upstream)
    })
    .await;
    let error = upstream["last_error"].as_str().unwrap();
    assert!(
        error.contains("envoy.extensions.filters.http.lua.v3.Luaa"),
        "{upstream}"
    );
    assert!(gw.cache.get(LISTENERS).is_none_or(|s| s.is_empty()), "nothing served");
}
