//! Specula's OpenAI-compatible HTTP server, with Anthropic's Messages API beside it.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` ([`anthropic`]), `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /v1/models/{id}/speculative` (change the speculation default at
//! run time, loading or unloading a draft model when needed; `admin.rs`), `GET /health`,
//! `GET /metrics` (Prometheus text). Errors use OpenAI's body
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! Speculative decoding extensions: the request field `spec` (a mode string, or
//! `{"mode", "draft_max", "adaptive", "sampled_verify"}` over the server default
//! [`ServeOptions::spec`]; `sampled_verify` chooses how sampled drafts are verified, and a
//! seeded request is by default reproducible with speculation), the
//! response object `spec_stats` (non-streamed responses; the finish and usage chunks of a
//! stream), and the `specula` object of each model in `/v1/models`.
//!
//! Agent API: chat requests take `tools` / `tool_choice` (rendered by the model's chat template),
//! messages with `tool_calls` and `role: "tool"`, `reasoning_effort` and `chat_template_kwargs`.
//! Responses parse the model's tool calls ([`tools`], one parser per dialect, chosen from the
//! template and family or by [`ServeOptions::tool_parser`]) into `message.tool_calls` /
//! streamed `delta.tool_calls`, and split `<think>…</think>` into `reasoning_content`
//! ([`reasoning`]).
//!
//! Access ([`auth`]): with API keys configured, every route but `GET /health` (and `/metrics`
//! when it is made public) needs one (`Authorization: Bearer KEY` or `x-api-key: KEY`; 401
//! otherwise); a server bound to loopback answers only requests addressed to a loopback name
//! (403 otherwise, against DNS rebinding). See docs/security.md.
//!
//! The engine runs on one dedicated OS thread ([`EngineHandle`]); requests are served one at a
//! time in arrival order, with at most `max_queue` waiting (more get 429 with `Retry-After: 1`).

pub mod admin;
pub mod anthropic;
mod api;
pub mod auth;
mod chat_output;
mod chat_prompt;
pub mod conn;
mod error;
mod logprobs;
mod metrics;
mod params;
pub mod reasoning;
pub mod tools;
mod worker;

use std::future::Future;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

pub use admin::LoadEvent;
pub use api::check_request;
pub use auth::Access;
pub use chat_prompt::{ChatInfo, ChatPrompt};
pub use conn::ConnLimits;
pub use error::ApiError;
pub use metrics::Metrics;
pub use worker::{
    check_spec_default, EngineHandle, Event, HoldGuard, ModelInfo, Prompt, Submission, SubmitError, DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
};

/// Largest request body accepted (long prompts given as token-id arrays are verbose).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// How long in-flight requests may run on after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// Requests allowed to wait while `max_batch` run; more get HTTP 429.
    pub max_queue: usize,
    /// Requests decoded together (continuous batching).
    pub max_batch: usize,
    /// Bytes of KV cache running requests may reserve together (`None`: no limit); see
    /// [`EngineHandle::with_kv_budget`].
    pub kv_budget_bytes: Option<usize>,
    /// Create the target's KV blocks for the whole budget at start (resident memory flat from
    /// the first request on); otherwise blocks are created on demand and recycled.
    pub kv_preallocate: bool,
    /// Speculative decoding for requests that do not set the `spec` field.
    pub spec: specula_engine::speculative::SpecOptions,
    /// The bundle's capability summary from `specula_engine::inspect`
    /// (`BundleReport::capabilities_json`), shown in `/v1/models` as `specula.bundle`.
    pub bundle: Option<serde_json::Value>,
    /// The tool-call dialect (`--tool-parser`); `None` = detected from the chat template and
    /// the model family.
    pub tool_parser: Option<tools::Dialect>,
    /// Seconds the target's load took before serving, shown in `/v1/models` (`specula.loads`).
    pub target_load_s: Option<f64>,
    /// Seconds the draft model's load took before serving, if one is attached.
    pub draft_load_s: Option<f64>,
    /// API keys and whether `/metrics` needs one; [`serve`] turns the Host check on when `host`
    /// is a loopback address ([`auth::is_loopback_host`]). The default asks for no key.
    pub access: Access,
    /// Directories whose models requests may attach as draft models (`--models-dir`); empty:
    /// pulled catalog models only ([`admin::resolve_draft_model`]).
    pub models_dirs: Vec<std::path::PathBuf>,
    /// Header and body timeouts and the connection cap ([`ConnLimits`]).
    pub limits: ConnLimits,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_string(),
            port: 8000,
            max_queue: DEFAULT_MAX_QUEUE,
            max_batch: DEFAULT_MAX_BATCH,
            kv_budget_bytes: None,
            kv_preallocate: false,
            spec: Default::default(),
            bundle: None,
            tool_parser: None,
            target_load_s: None,
            draft_load_s: None,
            access: Access::default(),
            models_dirs: Vec::new(),
            limits: ConnLimits::default(),
        }
    }
}

/// The HTTP routes over a running engine worker, open to every request (no key, no Host
/// check); [`router_with_access`] puts them behind [`Access`] rules.
pub fn router(handle: EngineHandle) -> Router {
    router_with_access(handle, Access::default())
}

/// The HTTP routes over a running engine worker behind `access`: one middleware checks the Host
/// header and the API key before any route (or the 404 fallback) runs, and the request metrics
/// count what it refuses.
pub fn router_with_access(handle: EngineHandle, access: Access) -> Router {
    router_with_limits(handle, access, conn::DEFAULT_BODY_TIMEOUT)
}

/// [`router_with_access`] with a request body read whole within `body_timeout`
/// ([`conn::read_body`]; after the access check, so a caller without a key cannot make the
/// server buffer a body).
pub fn router_with_limits(handle: EngineHandle, access: Access, body_timeout: Duration) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(api::chat_completions))
        .route("/v1/completions", post(api::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(api::list_models))
        .route("/v1/models/{*model}", get(api::get_model).post(admin::post_model))
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .method_not_allowed_fallback(api::method_not_allowed)
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(body_timeout, conn::read_body))
        .layer(axum::middleware::from_fn_with_state(access, auth::guard))
        .layer(axum::middleware::from_fn(anthropic::error_shape))
        .layer(axum::middleware::from_fn_with_state(handle.clone(), api::track))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(handle)
}

/// Serve `engine` on `opts.host:opts.port` until Ctrl-C (or SIGTERM).
pub async fn serve(engine: specula_engine::Engine, opts: ServeOptions) -> Result<()> {
    worker::check_spec_default(&engine, &opts.spec)
        .map_err(|e| anyhow::anyhow!("the server's speculation default: {e}"))?;
    if let (true, Some(b)) = (opts.kv_preallocate, opts.kv_budget_bytes) {
        let t = std::time::Instant::now();
        let blocks = engine.model().kv_pool().reserve_bytes(b);
        tracing::info!(
            blocks,
            mib = b >> 20,
            seconds = t.elapsed().as_secs_f64(),
            "KV block pool preallocated for the KV budget"
        );
    }
    let handle = EngineHandle::spawn_with_bundle(engine, opts.max_queue, opts.spec, opts.bundle.clone())
        .with_tool_parser(opts.tool_parser)
        .with_load_seconds(opts.target_load_s, opts.draft_load_s)
        .with_max_batch(opts.max_batch)
        .with_models_dirs(opts.models_dirs.clone());
    let handle = match opts.kv_budget_bytes {
        Some(b) => handle.with_kv_budget(b),
        None => handle,
    };
    let listener = TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .with_context(|| format!("binding {}", authority(&opts.host, opts.port)))?;
    let port = listener.local_addr()?.port();
    let address = authority(&opts.host, port);
    let access = opts
        .access
        .clone()
        .loopback_hosts_only(auth::is_loopback_host(&opts.host));
    let m = handle.model();
    tracing::info!(
        model = %m.id,
        max_queue = opts.max_queue,
        max_batch = opts.max_batch,
        kv_budget_mib = opts.kv_budget_bytes.map(|b| b >> 20),
        spec = m.spec.mode.as_str(),
        draft_max = m.spec.draft_max,
        adaptive = m.spec.adaptive,
        draft_model = m.draft_model.as_deref().unwrap_or("none"),
        tool_parser = %m.chat.tool_dialect,
        tool_parser_from = m.chat.tool_dialect_from,
        thinking = m.chat.thinking,
        api_keys = access.key_count(),
        metrics_public = access.is_metrics_public(),
        host_check = access.checks_host(),
        "listening on http://{address}"
    );
    serve_with_limits(handle, listener, access, opts.limits, shutdown_signal()).await
}

/// Serve on an already bound listener, behind `access`, with the default [`ConnLimits`], until
/// `shutdown` completes; in-flight requests then get a short grace period.
pub async fn serve_with_shutdown(
    handle: EngineHandle,
    listener: TcpListener,
    access: Access,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve_with_limits(handle, listener, access, ConnLimits::default(), shutdown).await
}

/// [`serve_with_shutdown`] within `limits`.
pub async fn serve_with_limits(
    handle: EngineHandle,
    listener: TcpListener,
    access: Access,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = router_with_limits(handle, access, limits.body_timeout);
    conn::serve(app, listener, limits, shutdown, SHUTDOWN_GRACE).await
}

/// `host:port` as a URL's authority writes it (RFC 3986 §3.2.2): an IPv6 address in brackets
/// (`[::1]:8000`), a name or IPv4 address as it is (`127.0.0.1:8000`).
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn authority_brackets_ipv6_hosts() {
        assert_eq!(super::authority("::1", 8000), "[::1]:8000");
        assert_eq!(super::authority("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(super::authority("localhost", 8000), "localhost:8000");
        assert_eq!(super::authority("[::1]", 1), "[::1]:1");
    }
}
