//! Who may use the server: API keys and the Host check, applied by one middleware ([`guard`])
//! in front of every route.
//!
//! - **API keys.** With keys configured, every request but `GET /health` (and `GET /metrics`
//!   when [`Access::metrics_public`] is on) must carry one as `Authorization: Bearer KEY` or
//!   `x-api-key: KEY`; otherwise it gets 401 (`invalid_api_key`, `WWW-Authenticate: Bearer`).
//!   Keys are kept as SHA-256 digests and compared without an early exit, so the time an answer
//!   takes says nothing about how much of a guess was right. A key is never logged or echoed.
//! - **Host check.** A server bound to a loopback address answers only requests addressed to a
//!   loopback name (`localhost`, `127.x.y.z`, `[::1]`, any port): a web page whose domain was
//!   rebound to 127.0.0.1 (DNS rebinding) sends its own domain as `Host` and gets 403
//!   (`invalid_host`). A request without a `Host` (HTTP/1.0) passes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// The header that carries a key as it is (the other way is `Authorization: Bearer KEY`).
const API_KEY_HEADER: &str = "x-api-key";

/// The access rules of a router: its API keys, whether `/metrics` is open, whether the `Host`
/// header must name loopback. The default is open: no keys, no Host check.
#[derive(Clone, Default)]
pub struct Access {
    /// SHA-256 of each accepted key (the keys themselves are not kept).
    keys: Arc<Vec<[u8; 32]>>,
    metrics_public: bool,
    loopback_hosts_only: bool,
}

impl std::fmt::Debug for Access {
    /// Counts the keys; never shows them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("api_keys", &self.keys.len())
            .field("metrics_public", &self.metrics_public)
            .field("loopback_hosts_only", &self.loopback_hosts_only)
            .finish()
    }
}

impl Access {
    /// Requests must carry one of `keys` (none given: no key is asked for). Check each with
    /// [`check_key`] first: a key a client cannot send in a header would lock everyone out.
    pub fn with_keys<I, S>(keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self {
            keys: Arc::new(keys.into_iter().map(|k| digest(k.as_ref().as_bytes())).collect()),
            ..Self::default()
        }
    }

    /// Answer `GET /metrics` without a key (a Prometheus scraper without credentials).
    pub fn metrics_public(mut self, on: bool) -> Self {
        self.metrics_public = on;
        self
    }

    /// Refuse (403) requests whose `Host` names anything but loopback: on for a server bound to
    /// a loopback address, where it stops DNS rebinding; `serve` sets it from the bind address.
    pub fn loopback_hosts_only(mut self, on: bool) -> Self {
        self.loopback_hosts_only = on;
        self
    }

    /// How many keys are accepted (0: none is asked for).
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Whether `GET /metrics` is answered without a key.
    pub fn is_metrics_public(&self) -> bool {
        self.metrics_public
    }

    /// Whether the `Host` header is checked.
    pub fn checks_host(&self) -> bool {
        self.loopback_hosts_only
    }

    /// Whether `method path` is answered without a key.
    fn is_open(&self, method: &Method, path: &str) -> bool {
        let read = *method == Method::GET || *method == Method::HEAD;
        read && (path == "/health" || (self.metrics_public && path == "/metrics"))
    }

    /// Whether one of the keys `headers` carry is accepted; `None` when they carry none.
    fn accepts(&self, headers: &HeaderMap) -> Option<bool> {
        let bearer = headers
            .get_all(header::AUTHORIZATION)
            .into_iter()
            .filter_map(|v| bearer_token(v.as_bytes()));
        let plain = headers
            .get_all(API_KEY_HEADER)
            .into_iter()
            .map(|v| v.as_bytes().trim_ascii());
        let mut sent = false;
        let mut ok = false;
        for key in bearer.chain(plain) {
            sent = true;
            let d = digest(key);
            // Every stored key is compared, whatever the outcome of the others.
            for k in self.keys.iter() {
                ok |= same_digest(k, &d);
            }
        }
        sent.then_some(ok)
    }
}

/// The middleware every request passes (the router's one gate): the Host check, then the key.
pub(crate) async fn guard(State(access): State<Access>, req: Request, next: Next) -> Response {
    if access.loopback_hosts_only && !addressed_to_loopback(&req) {
        return ApiError::invalid_host().into_response();
    }
    if !access.keys.is_empty() && !access.is_open(req.method(), req.uri().path()) {
        match access.accepts(req.headers()) {
            Some(true) => {}
            Some(false) => return ApiError::invalid_api_key(false).into_response(),
            None => return ApiError::invalid_api_key(true).into_response(),
        }
    }
    next.run(req).await
}

/// Whether `key` can be an API key: not empty, visible ASCII only (no spaces or control
/// characters), so that a client can send it in a header as it is. The error never quotes it.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("an API key is empty".to_string());
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("an API key may hold only visible ASCII characters (no spaces or control characters)".to_string());
    }
    Ok(())
}

/// The keys of an API key file: one a line, each trimmed; blank lines and lines starting with
/// `#` are skipped. An error names the line, never its text.
pub fn parse_key_file(text: &str) -> Result<Vec<String>, String> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        check_key(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        keys.push(line.to_string());
    }
    Ok(keys)
}

/// Whether a bind address (`--host`: an IP address, with or without brackets, or a name)
/// is loopback: `127.0.0.0/8`, `::1` (also as `::ffff:127.x.y.z`) or `localhost`. Any other
/// name counts as reachable from elsewhere, even one that resolves to loopback here.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Whether every `Host` header and the request target's authority (HTTP/2, absolute-form
/// targets) name loopback; a request with neither passes.
fn addressed_to_loopback(req: &Request) -> bool {
    let hosts_ok = req
        .headers()
        .get_all(header::HOST)
        .into_iter()
        .all(|v| v.to_str().is_ok_and(authority_is_loopback));
    let target_ok = req.uri().authority().is_none_or(|a| authority_is_loopback(a.as_str()));
    hosts_ok && target_ok
}

/// Whether an authority (`host[:port]`, `[ipv6][:port]`) names loopback: `localhost`, an IPv4
/// address in `127.0.0.0/8` or `[::1]`, with any port or none.
fn authority_is_loopback(authority: &str) -> bool {
    let (host_ok, port) = match authority.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((inner, after)) => (
                inner
                    .parse::<Ipv6Addr>()
                    .is_ok_and(|ip| IpAddr::V6(ip).to_canonical().is_loopback()),
                after,
            ),
            None => return false,
        },
        None => {
            let (host, port) = authority.split_at(authority.find(':').unwrap_or(authority.len()));
            let ok =
                host.eq_ignore_ascii_case("localhost") || host.parse::<Ipv4Addr>().is_ok_and(|ip| ip.is_loopback());
            (ok, port)
        }
    };
    let port_ok = match port.strip_prefix(':') {
        Some(p) => p.bytes().all(|b| b.is_ascii_digit()),
        None => port.is_empty(),
    };
    host_ok && port_ok
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme in any case).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii())
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// Equal digests, looking at every byte whatever the first difference.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_bind_addresses() {
        for h in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
            "localhost",
            "LocalHost",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "::",
            "[::]",
            "192.168.1.2",
            "10.0.0.1",
            "example.com",
            "localhost.example.com",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn loopback_authorities() {
        for a in [
            "localhost",
            "localhost:8000",
            "LOCALHOST:1",
            "127.0.0.1",
            "127.0.0.1:8000",
            "127.9.8.7:65535",
            "[::1]",
            "[::1]:8000",
            "localhost:",
        ] {
            assert!(authority_is_loopback(a), "{a}");
        }
        for a in [
            "evil.example",
            "evil.example:8000",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "evil.localhost.example:8000",
            "127.1",
            "0.0.0.0:8000",
            "[::]:8000",
            "::1",
            "::1:8000",
            "[::1",
            "[::1]8000",
            "localhost:80x",
            "user@localhost:8000",
            "",
        ] {
            assert!(!authority_is_loopback(a), "{a}");
        }
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer   abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearerabc"), None);
        assert_eq!(bearer_token(b"Bear"), None);
    }

    #[test]
    fn keys_are_checked_and_read_from_a_file() {
        assert!(check_key("sk-abc_123.XYZ").is_ok());
        for bad in ["", "a b", "tab\there", "ключ"] {
            let e = check_key(bad).unwrap_err();
            assert!(bad.is_empty() || !e.contains(bad), "the error quotes the key: {e}");
        }
        let keys = parse_key_file("# keys\n\n  one  \n#two\r\nthree#x\n").unwrap();
        assert_eq!(keys, ["one", "three#x"]);
        let e = parse_key_file("ok\n\nbad key\n").unwrap_err();
        assert!(e.starts_with("line 3:") && !e.contains("bad key"), "{e}");
        assert!(parse_key_file("# nothing\n\n").unwrap().is_empty());
    }

    #[test]
    fn keys_match_exactly() {
        let a = Access::with_keys(["key-one", "key-two"]);
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            h
        };
        assert_eq!(a.accepts(&headers(&[])), None);
        assert_eq!(a.accepts(&headers(&[("authorization", "Basic key-one")])), None);
        assert_eq!(a.accepts(&headers(&[("authorization", "Bearer key-two")])), Some(true));
        assert_eq!(a.accepts(&headers(&[("x-api-key", "key-one")])), Some(true));
        for wrong in ["key-one ", "key-on", "key-one1", "KEY-ONE", "key-three"] {
            let got = a.accepts(&headers(&[("x-api-key", wrong)]));
            // Surrounding spaces are not part of a header value.
            assert_eq!(got, Some(wrong == "key-one "), "{wrong:?}");
        }
        assert_eq!(
            a.accepts(&headers(&[("authorization", "Bearer nope"), ("x-api-key", "key-one")])),
            Some(true)
        );
        assert!(!format!("{a:?}").contains("key-one"));
    }
}
