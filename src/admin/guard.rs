//! What a web page must not do with the admin port, and the audit of its
//! controls.
//!
//! The admin port has no authentication: it is on loopback, so only this
//! host reaches it. A browser on this host reaches it too, on behalf of any
//! page its user opens:
//! - **Cross-site requests.** A page can make the browser `POST` to
//!   `http://127.0.0.1:15000/promote/...` (a form needs no script). A control
//!   (any method but `GET` and `HEAD`) that carries a browser's marks, an
//!   `Origin` header or a `Sec-Fetch-Site` other than `none`, is refused: the
//!   controls are for `curl` and the `rollout` command, which send neither.
//! - **DNS rebinding.** A page's own name, made to resolve to 127.0.0.1,
//!   lets it read the answers too: every resource name, every client. On a
//!   loopback admin port a request must name the host as an address or
//!   `localhost` (what `curl`, the commands and `kubectl port-forward`
//!   send); another name is refused. An admin port given a routable address
//!   (`--admin-listen`) is reached by names, and is not checked.
//!
//! Each control is logged (the peer, the method, the path, the answer) and
//! counted in `mcp_gateway_admin_controls_total{control,code}`; each refusal
//! in `mcp_gateway_admin_refusals_total{reason}`.

use std::net::{IpAddr, SocketAddr};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::metrics as m;

/// How the guard judges a request to the admin port.
#[derive(Clone, Copy, Debug)]
pub struct Guard {
    /// The admin port listens on loopback: names other than `localhost` are
    /// refused.
    pub loopback: bool,
}

/// Why a request is refused; the label of `mcp_gateway_admin_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A control sent by a browser for a web page.
    CrossSite,
    /// A request naming this loopback port by a name that is not its own.
    Host,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        let [cross_site, host] = m::ADMIN_REFUSAL_REASONS;
        match self {
            Refusal::CrossSite => cross_site,
            Refusal::Host => host,
        }
    }
}

fn is_control(method: &Method) -> bool {
    method != Method::GET && method != Method::HEAD
}

/// The host a request names, without its port: `Host`, or the request
/// target's authority. `None` when it names none (HTTP/1.0).
fn named_host(headers: &HeaderMap, uri: &axum::http::Uri) -> Option<String> {
    let authority = match headers.get(header::HOST) {
        Some(host) => host.to_str().unwrap_or("\u{fffd}").to_owned(),
        None => uri.authority()?.as_str().to_owned(),
    };
    let host = match authority.strip_prefix('[') {
        // [::1]:15000
        Some(v6) => v6.split(']').next().unwrap_or_default().to_owned(),
        None => authority
            .rsplit_once(':')
            .map_or(authority.as_str(), |(h, _)| h)
            .to_owned(),
    };
    Some(host)
}

/// Whether a request may reach the admin port's handlers.
pub fn judge(guard: Guard, method: &Method, headers: &HeaderMap, uri: &axum::http::Uri) -> Result<(), Refusal> {
    if is_control(method) {
        let sec_fetch_site = headers.get("sec-fetch-site").map(|v| v.as_bytes());
        if headers.contains_key(header::ORIGIN) || sec_fetch_site.is_some_and(|site| site != b"none") {
            return Err(Refusal::CrossSite);
        }
    }
    if guard.loopback {
        if let Some(host) = named_host(headers, uri) {
            let own = host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok();
            if !own {
                return Err(Refusal::Host);
            }
        }
    }
    Ok(())
}

/// The middleware: refuses what [`judge`] refuses, and audits controls.
pub async fn guard(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    let judged = judge(guard, request.method(), request.headers(), request.uri());
    if judged.is_ok() && !is_control(request.method()) {
        // Reads (the views, /metrics) pass without an audit.
        return next.run(request).await;
    }
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(peer)| *peer);
    let peer = peer.map_or_else(|| "unknown".to_owned(), |p| p.to_string());
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    if let Err(refusal) = judged {
        metrics::counter!(m::ADMIN_REFUSALS, "reason" => refusal.as_str()).increment(1);
        tracing::warn!(%peer, %method, %path, reason = refusal.as_str(), "admin request refused");
        let body = match refusal {
            Refusal::CrossSite => {
                "refused: a control sent by a web browser (it carries Origin or Sec-Fetch-Site). A page the \
                 operator opens could otherwise pin or promote config (cross-site request forgery); use curl or \
                 `mcp-xds-gateway rollout`\n"
            }
            Refusal::Host => {
                "refused: this admin port is on loopback and is named by an address or localhost; another host \
                 name is what a web page resolving its own name to this host would send (DNS rebinding)\n"
            }
        };
        return (StatusCode::FORBIDDEN, body).into_response();
    }
    let query = request.uri().query().map(str::to_owned);
    let response = next.run(request).await;
    let control = m::ADMIN_CONTROL_NAMES
        .iter()
        .find(|c| path.strip_prefix('/').is_some_and(|p| p.split('/').next() == Some(**c)))
        .copied()
        // DELETE /pin/... is an unpin.
        .map(|c| {
            if c == "pin" && method == Method::DELETE {
                "unpin"
            } else {
                c
            }
        });
    if let Some(control) = control {
        let code = response.status();
        metrics::counter!(m::ADMIN_CONTROLS, "control" => control, "code" => code.as_str().to_owned()).increment(1);
        let query = query.unwrap_or_default();
        if code.is_success() {
            tracing::info!(%peer, %method, %path, %query, code = code.as_u16(), "admin control");
        } else {
            tracing::warn!(%peer, %method, %path, %query, code = code.as_u16(), "admin control refused");
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judged(loopback: bool, method: Method, headers: &[(&str, &str)]) -> Result<(), Refusal> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        judge(Guard { loopback }, &method, &map, &"/pin/x".parse().unwrap())
    }

    #[test]
    fn what_curl_and_the_commands_send_passes() {
        for host in [
            "127.0.0.1:15000",
            "localhost:15000",
            "LOCALHOST",
            "[::1]:15000",
            "10.0.0.7:15000",
        ] {
            assert_eq!(judged(true, Method::POST, &[("host", host)]), Ok(()), "{host}");
        }
        assert_eq!(judged(true, Method::POST, &[]), Ok(()), "no Host (HTTP/1.0)");
        assert_eq!(
            judged(true, Method::POST, &[("host", "127.0.0.1"), ("sec-fetch-site", "none")]),
            Ok(()),
            "typed in the address bar"
        );
    }

    #[test]
    fn a_browser_control_is_refused_and_its_reads_are_not() {
        for marks in [
            &[("origin", "http://evil.example")][..],
            &[("origin", "null")],
            &[("origin", "http://127.0.0.1:15000")],
            &[("sec-fetch-site", "cross-site")],
            &[("sec-fetch-site", "same-origin")],
        ] {
            let mut headers = vec![("host", "127.0.0.1:15000")];
            headers.extend_from_slice(marks);
            for method in [Method::POST, Method::DELETE, Method::PUT] {
                assert_eq!(
                    judged(true, method.clone(), &headers),
                    Err(Refusal::CrossSite),
                    "{method} {marks:?}"
                );
            }
            assert_eq!(judged(true, Method::GET, &headers), Ok(()), "GET {marks:?}");
        }
    }

    #[test]
    fn another_name_for_a_loopback_port_is_refused_and_a_routable_port_is_not_checked() {
        for host in ["evil.example:15000", "evil.example", "gateway.svc:15000"] {
            for method in [Method::GET, Method::POST] {
                assert_eq!(
                    judged(true, method.clone(), &[("host", host)]),
                    Err(Refusal::Host),
                    "{host}"
                );
                assert_eq!(judged(false, method.clone(), &[("host", host)]), Ok(()), "{host}");
            }
        }
    }
}
