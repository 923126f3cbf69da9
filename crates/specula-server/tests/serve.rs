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
