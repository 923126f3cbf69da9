//! Access rules: API keys (401 without or with a wrong key, 200 with it in either header),
//! the open `/health`, `/metrics` behind the key unless public, and the Host check of a
//! loopback-bound server over real TCP (403 for a foreign Host, 200 for loopback names).

mod common;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use common::{assert_error, send, Reply};
use serde_json::json;
use specula_server::{router_with_access, serve_with_shutdown, Access, EngineHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const KEY: &str = "test-key-0123456789abcdef";
const OTHER_KEY: &str = "second-key-fedcba9876543210";

fn app(access: Access) -> Router {
    router_with_access(EngineHandle::spawn(common::engine()), access)
}

async fn call(app: &Router, method: Method, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    send(app, req.body(Body::empty()).expect("request")).await
}

/// A 401 with the OpenAI body, code `invalid_api_key`, `WWW-Authenticate: Bearer`, and no
/// trace of the keys.
fn assert_unauthorized(r: &Reply) {
    let e = assert_error(r, StatusCode::UNAUTHORIZED, None);
    assert_eq!(e["code"], "invalid_api_key", "{}", r.text);
    assert_eq!(e["type"], "authentication_error", "{}", r.text);
    assert_eq!(r.headers[header::WWW_AUTHENTICATE], "Bearer");
    for k in [KEY, OTHER_KEY, "wrong-key"] {
        assert!(!r.text.contains(k), "the body echoes a key: {}", r.text);
    }
}

#[tokio::test]
async fn a_key_is_needed_on_every_route_but_health() {
    let app = app(Access::with_keys([KEY, OTHER_KEY]));

    // No key, a wrong key, a key under another scheme: 401.
    let r = call(&app, Method::GET, "/v1/models", &[]).await;
    assert_unauthorized(&r);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Missing API key"));
    let r = call(
        &app,
        Method::GET,
        "/v1/models",
        &[("authorization", "Bearer wrong-key")],
    )
    .await;
    assert_unauthorized(&r);
    assert_eq!(r.json()["error"]["message"], "Incorrect API key provided.");
    assert_unauthorized(&call(&app, Method::GET, "/v1/models", &[("x-api-key", "wrong-key")]).await);
    let basic = format!("Basic {KEY}");
    assert_unauthorized(&call(&app, Method::GET, "/v1/models", &[("authorization", basic.as_str())]).await);
    // A prefix of the key is not the key.
    assert_unauthorized(&call(&app, Method::GET, "/v1/models", &[("x-api-key", &KEY[..KEY.len() - 1])]).await);

    // Either header form, either key: 200.
    let bearer = format!("Bearer {KEY}");
    let r = call(&app, Method::GET, "/v1/models", &[("authorization", bearer.as_str())]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["data"][0]["id"], common::MODEL);
    let lower = format!("bearer {OTHER_KEY}");
    let r = call(&app, Method::GET, "/v1/models", &[("authorization", lower.as_str())]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = call(&app, Method::GET, "/v1/models", &[("x-api-key", KEY)]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);

    // Generation routes too: 401 before the body is looked at, 200 with the key.
    let body = json!({"prompt": "the hen", "max_tokens": 3, "temperature": 0}).to_string();
    let post = |key: Option<&str>| {
        let mut req = Request::post("/v1/completions").header(header::CONTENT_TYPE, "application/json");
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        req.body(Body::from(body.clone())).expect("request")
    };
    assert_unauthorized(&send(&app, post(None)).await);
    let r = send(&app, post(Some(KEY))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["object"], "text_completion");

    // An unknown route does not say it is unknown to a caller without a key.
    assert_unauthorized(&call(&app, Method::GET, "/v1/nothing", &[]).await);
    let r = call(&app, Method::GET, "/v1/nothing", &[("x-api-key", KEY)]).await;
    assert_eq!(assert_error(&r, StatusCode::NOT_FOUND, None)["code"], "unknown_url");

    // GET /health is open; other methods on it are not.
    let r = call(&app, Method::GET, "/health", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"status": "ok"}));
    assert_unauthorized(&call(&app, Method::POST, "/health", &[]).await);

    // /metrics needs the key, and counts the refusals.
    assert_unauthorized(&call(&app, Method::GET, "/metrics", &[]).await);
    let r = call(&app, Method::GET, "/metrics", &[("authorization", bearer.as_str())]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(
        r.text
            .contains(r#"specula_requests_total{endpoint="/v1/models",status="401"} 5"#),
        "{}",
        r.text
    );
    assert!(
        r.text
            .contains(r#"specula_requests_total{endpoint="/v1/models",status="200"} 3"#),
        "{}",
        r.text
    );
}

#[tokio::test]
async fn public_metrics_and_no_keys() {
    let app_public = app(Access::with_keys([KEY]).metrics_public(true));
    let r = call(&app_public, Method::GET, "/metrics", &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.text.contains("specula_queue_depth 0"), "{}", r.text);
    // Only /metrics is opened.
    assert_unauthorized(&call(&app_public, Method::GET, "/v1/models", &[]).await);

    // Without keys nothing asks for one, whatever the headers say.
    let open = app(Access::default());
    for path in ["/v1/models", "/metrics", "/health"] {
        let r = call(&open, Method::GET, path, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text);
        let r = call(&open, Method::GET, path, &[("authorization", "Bearer anything")]).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.text);
    }
}

/// Send `raw` to `addr` and return the status code and the body.
async fn http(addr: std::net::SocketAddr, raw: String) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn a_loopback_server_answers_only_loopback_host_names() {
    let handle = EngineHandle::spawn(common::engine());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let port = addr.port();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let access = Access::with_keys([KEY]).loopback_hosts_only(true);
    let server = tokio::spawn(serve_with_shutdown(handle, listener, access, async move {
        let _ = stop_rx.await;
    }));
    let get = |path: &str, host: Option<&str>, key: bool| {
        let host = host.map(|h| format!("Host: {h}\r\n")).unwrap_or_default();
        let key = if key {
            format!("x-api-key: {KEY}\r\n")
        } else {
            String::new()
        };
        let version = if host.is_empty() { "HTTP/1.0" } else { "HTTP/1.1" };
        format!("GET {path} {version}\r\n{host}{key}Connection: close\r\n\r\n")
    };

    for host in [
        "evil.example".to_string(),
        format!("evil.example:{port}"),
        format!("localhost.evil.example:{port}"),
        format!("127.0.0.1.evil.example:{port}"),
        format!("0.0.0.0:{port}"),
    ] {
        // Refused before the key is looked at, on every route, /health too.
        for (path, key) in [("/v1/models", true), ("/v1/models", false), ("/health", false)] {
            let (status, body) = http(addr, get(path, Some(host.as_str()), key)).await;
            assert_eq!(status, 403, "Host {host}, {path}: {body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "invalid_host", "{body}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert!(!body.contains("evil"), "the Host is not echoed: {body}");
        }
    }
    for host in [
        format!("localhost:{port}"),
        "localhost".to_string(),
        format!("127.0.0.1:{port}"),
        format!("127.0.0.2:{port}"),
        format!("[::1]:{port}"),
    ] {
        let (status, body) = http(addr, get("/v1/models", Some(host.as_str()), true)).await;
        assert_eq!(status, 200, "Host {host}: {body}");
        assert!(body.contains("\"object\":\"list\""), "{body}");
        // The key is still needed.
        let (status, body) = http(addr, get("/v1/models", Some(host.as_str()), false)).await;
        assert_eq!(status, 401, "Host {host}: {body}");
    }
    // HTTP/1.0 without a Host passes the check.
    let (status, body) = http(addr, get("/v1/models", None, true)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(addr, get("/health", None, false)).await;
    assert_eq!(status, 200, "{body}");

    stop_tx.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .expect("server stops after the shutdown signal")
        .unwrap()
        .unwrap();
}
