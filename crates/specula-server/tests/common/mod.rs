//! Test helpers: a tiny random model, a router over it, and request helpers.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use candle_core::quantized::GgmlDType;
use http_body_util::BodyExt;
use serde_json::Value;
use specula_engine::model::Family;
use specula_engine::speculative::SpecOptions;
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};
use specula_server::{router, EngineHandle};
use tower::ServiceExt;

pub const MODEL: &str = "tiny";
/// Context window of the tiny model.
pub const CONTEXT: usize = 256;

/// Path of the tiny GGUF model, written once per test process under cargo's target tmp dir
/// (written to a unique name, then renamed, so concurrent test binaries do not collide).
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let spec = TinySpec::new(Family::Llama);
        assert_eq!(spec.context, CONTEXT);
        write_model("specula-server-tiny", &spec)
    })
    .clone()
}

/// Write a tiny GGUF model named `name` under cargo's target tmp dir (unique temp name, then
/// renamed).
fn write_model(name: &str, spec: &TinySpec) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&dir).expect("target tmp dir");
    let tmp = dir.join(format!("{name}.{}.gguf.tmp", std::process::id()));
    write_tiny_gguf(&tmp, spec).expect("write tiny gguf");
    let path = dir.join(format!("{name}.gguf"));
    std::fs::rename(&tmp, &path).expect("rename tiny gguf");
    path
}

pub fn engine() -> Engine {
    Engine::load(&model_path(), MODEL, LoadOptions::default()).expect("load tiny model")
}

/// The tiny model with Q8_0 projections: every kernel is batch-invariant, so speculation runs
/// (the f32 model of [`engine`] decodes AR whatever the request asks).
pub fn spec_model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let spec = TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Llama)
        };
        write_model("specula-server-tiny-q8_0", &spec)
    })
    .clone()
}

/// A second tiny Q8_0 model with the same tokenizer (other weights): a draft model.
pub fn draft_model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let spec = TinySpec {
            dtype: GgmlDType::Q8_0,
            layers: 1,
            seed: 7,
            ..TinySpec::new(Family::Llama)
        };
        write_model("specula-server-tiny-draft", &spec)
    })
    .clone()
}

/// The batch-invariant tiny model (see [`spec_model_path`]).
pub fn spec_engine() -> Engine {
    let e = Engine::load(&spec_model_path(), MODEL, LoadOptions::default()).expect("load tiny Q8_0 model");
    assert!(
        e.model().batch_invariant(),
        "the Q8_0 tiny model runs on invariant kernels"
    );
    e
}

/// A router over `engine` whose requests without a `spec` field use `spec`.
pub fn app_with_spec(engine: Engine, spec: SpecOptions) -> (Router, EngineHandle) {
    let handle = EngineHandle::spawn_with_spec(engine, 16, spec);
    (router(handle.clone()), handle)
}

/// A router over a fresh engine worker, plus its handle.
pub fn app_with_queue(max_queue: usize) -> (Router, EngineHandle) {
    let handle = EngineHandle::spawn_with_queue(engine(), max_queue);
    (router(handle.clone()), handle)
}

pub fn app() -> (Router, EngineHandle) {
    app_with_queue(16)
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                    .to_string()
            })
            .collect()
    }
}

pub async fn send(app: &Router, req: Request<Body>) -> Reply {
    let resp = app.clone().oneshot(req).await.expect("router is infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    Reply {
        status,
        headers,
        text: String::from_utf8(bytes.to_vec()).expect("UTF-8 body"),
    }
}

pub async fn post_raw(app: &Router, path: &str, body: &str) -> Reply {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    send(app, req).await
}

pub async fn post(app: &Router, path: &str, body: Value) -> Reply {
    post_raw(app, path, &body.to_string()).await
}

pub async fn get(app: &Router, path: &str) -> Reply {
    send(app, Request::get(path).body(Body::empty()).expect("request")).await
}

/// Run the engine directly, as the reference for server output.
pub fn direct(
    engine: &mut Engine,
    prompt_tokens: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    logprobs: Option<usize>,
) -> GenerateOutput {
    let req = GenerateRequest {
        prompt_tokens,
        sampling,
        max_tokens: Some(max_tokens),
        stop: Vec::new(),
        logprobs,
        ignore_eos: false,
        spec: Default::default(),
    };
    engine.generate(&req, &mut |_| true).expect("direct generation")
}

/// Assert an OpenAI error body and return its `error` object.
pub fn assert_error(reply: &Reply, status: StatusCode, param: Option<&str>) -> Value {
    assert_eq!(reply.status, status, "body: {}", reply.text);
    let v = reply.json();
    let e = v
        .get("error")
        .unwrap_or_else(|| panic!("no error object: {}", reply.text))
        .clone();
    let obj = e.as_object().expect("error is an object");
    for key in ["message", "type", "param", "code"] {
        assert!(obj.contains_key(key), "error lacks '{key}': {}", reply.text);
    }
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", reply.text);
    if status.is_client_error() {
        assert!(
            e["code"].as_str().is_some_and(|c| !c.is_empty()),
            "a 4xx error has a code: {}",
            reply.text
        );
    }
    let kind = if status.is_server_error() {
        "server_error"
    } else if status == StatusCode::UNAUTHORIZED {
        "authentication_error"
    } else {
        "invalid_request_error"
    };
    if status != StatusCode::TOO_MANY_REQUESTS {
        assert_eq!(e["type"], kind, "{}", reply.text);
    }
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{}", reply.text);
        let said_twice = format!("Invalid '{p}': {p}");
        let twice = |m: &str| {
            m.strip_prefix(&said_twice)
                .is_some_and(|rest| !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
        };
        assert!(
            !e["message"].as_str().is_some_and(twice),
            "the parameter is named once: {}",
            reply.text
        );
    }
    e
}
