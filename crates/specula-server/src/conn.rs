//! The HTTP listener: how long a client may take to send a request, and how many connections
//! may be open at once.
//!
//! A client that holds a connection without finishing its request costs the server a socket
//! and a task for as long as it likes, so a few thousand slow clients (slowloris) exhaust file
//! descriptors. Three bounds close that: a request's head must arrive within
//! [`ConnLimits::header_timeout`] (hyper's header-read timer, which also closes an idle
//! keep-alive connection that sends no next request), its body within
//! [`ConnLimits::body_timeout`] ([`read_body`], 408 otherwise), and at most
//! [`ConnLimits::max_connections`] connections are served at once (more wait in the kernel's
//! accept queue until one closes).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures::StreamExt;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::error::ApiError;
use crate::MAX_BODY_BYTES;

/// Bounds on what one client connection may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// A request's head (request line and headers) must arrive within this, counted from when
    /// the connection starts waiting for it (an idle keep-alive connection included); the
    /// connection is closed otherwise.
    pub header_timeout: Duration,
    /// A request's body must arrive whole within this, counted from the end of its head; the
    /// request gets 408 `request_timeout` otherwise.
    pub body_timeout: Duration,
    /// Connections served at once; more wait in the kernel's accept queue.
    pub max_connections: usize,
}

/// Default [`ConnLimits::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`ConnLimits::body_timeout`]: a 32 MiB body over a slow link takes a while.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// Default [`ConnLimits::max_connections`]: far above what one engine serves at once, far
/// below a process's usual 1,024 file descriptors with the model files open.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Middleware: read the request body whole, within `timeout` and [`MAX_BODY_BYTES`], before the
/// route runs. Too slow: 408 `request_timeout`; too big: 413 `request_too_large`; broken off:
/// 400 `invalid_body`. The route then reads the buffered body.
pub async fn read_body(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| ApiError::unreadable_body())?;
            if buf.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(ApiError::body_too_large(MAX_BODY_BYTES));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(buf)) => next.run(Request::from_parts(parts, Body::from(buf))).await,
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::request_timeout(timeout).into_response(),
    }
}

/// Serve `app` on `listener` within `limits` until `shutdown` completes; in-flight requests then
/// get `grace` to finish.
pub async fn serve(
    app: Router,
    listener: TcpListener,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut at_cap_logged = false;
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait for connections to close.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        if slots.available_permits() == 0 && !at_cap_logged {
            at_cap_logged = true;
            tracing::warn!(
                max_connections = limits.max_connections,
                "connection limit reached: further connections wait until one closes"
            );
        }
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service).with_upgrades());
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    _ = stop.changed() => conn.as_mut().graceful_shutdown(),
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    // Every connection holds a slot until it closes: all slots back = all connections done.
    let all = u32::try_from(limits.max_connections.max(1)).unwrap_or(u32::MAX);
    if tokio::time::timeout(grace, slots.acquire_many(all)).await.is_err() {
        tracing::warn!("requests still running after {}s; exiting", grace.as_secs());
    }
    Ok(())
}
