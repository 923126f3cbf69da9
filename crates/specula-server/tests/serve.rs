//! The server over real TCP: bind, stream a chat completion, shut down.

mod common;

use serde_json::json;
use specula_server::{serve_with_shutdown, Access, EngineHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn http(addr: std::net::SocketAddr, raw: String) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8(out).unwrap()
}

#[tokio::test]
async fn serves_over_tcp_and_shuts_down() {
    let handle = EngineHandle::spawn(common::engine());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_with_shutdown(handle, listener, Access::default(), async move {
        let _ = stop_rx.await;
    }));

    let resp = http(
        addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_string(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.ends_with("{\"status\":\"ok\"}"), "{resp}");

    let body = json!({"messages": [{"role": "user", "content": "the hen"}], "max_tokens": 6, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let resp = http(addr, raw).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("content-type: text/event-stream"), "{resp}");
    assert!(
        resp.lines()
            .any(|l| l.starts_with("data: {") && l.contains("\"choices\":[]") && l.contains("\"usage\"")),
        "usage chunk missing: {resp}"
    );
    assert!(resp.contains("\"completion_tokens\":"), "{resp}");
    assert!(resp.contains("data: [DONE]"), "{resp}");

    stop_tx.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .expect("server stops after the shutdown signal")
        .unwrap()
        .unwrap();
}

/// Read until the peer closes the connection or `limit` passes; `None` if it stayed open.
async fn read_until_closed(s: &mut TcpStream, limit: std::time::Duration) -> Option<String> {
    let mut out = Vec::new();
    match tokio::time::timeout(limit, s.read_to_end(&mut out)).await {
        Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
        Err(_) => None,
    }
}

/// Slow clients: a connection that does not finish its headers is closed after the header
/// timeout (an idle keep-alive connection too); a body that does not arrive in time gets 408;
/// at most `max_connections` are served at once, and the next one is served when one closes.
/// The server answers normally throughout.
#[tokio::test]
async fn slow_clients_are_cut_off_and_connections_capped() {
    use std::time::{Duration, Instant};
    let handle = EngineHandle::spawn(common::engine());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = specula_server::ConnLimits {
        header_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
        max_connections: 2,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(specula_server::serve_with_limits(
        handle,
        listener,
        Access::default(),
        limits,
        async move {
            let _ = stop_rx.await;
        },
    ));
    let health = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

    // Partial headers, then silence: closed after about a second, with no response.
    let t = Instant::now();
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        .await
        .unwrap();
    let got = read_until_closed(&mut slow, Duration::from_secs(10)).await;
    assert!(got.is_some(), "a connection with partial headers stayed open 10 s");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "closed too early: {:?}",
        t.elapsed()
    );

    // Headers complete, body short of its Content-Length: 408 with the OpenAI error body.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"",
    )
    .await
    .unwrap();
    let got = read_until_closed(&mut slow, Duration::from_secs(10))
        .await
        .expect("a slow body is answered");
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("\"code\":\"request_timeout\""), "{got}");

    // A keep-alive connection that goes idle after a request is closed too.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let got = read_until_closed(&mut idle, Duration::from_secs(10))
        .await
        .expect("an idle keep-alive connection is closed");
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");

    // Two silent connections take both slots: a third waits until the header timeout frees one.
    let mut a = TcpStream::connect(addr).await.unwrap();
    let mut b = TcpStream::connect(addr).await.unwrap();
    a.write_all(b"GET /hea").await.unwrap();
    b.write_all(b"GET /hea").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let third = http(addr, health.to_string()).await;
    assert!(third.starts_with("HTTP/1.1 200"), "{third}");
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "the third connection was served while two held the slots: {:?}",
        t.elapsed()
    );
    assert!(read_until_closed(&mut a, Duration::from_secs(5)).await.is_some());
    assert!(read_until_closed(&mut b, Duration::from_secs(5)).await.is_some());

    // And a normal request afterwards.
    let body =
        json!({"messages": [{"role": "user", "content": "the hen"}], "max_tokens": 3, "temperature": 0}).to_string();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let resp = http(addr, raw).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("server stops after the shutdown signal")
        .unwrap()
        .unwrap();
}
