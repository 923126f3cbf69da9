//! The HTTP handlers.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde_json::{json, Value};
use specula_engine::constraint::GrammarSpec;
use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::{GenerateOutput, GenerateRequest, RequestError, StreamDelta};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::chat_output::{self, ChatOutput, OutEvent};
use crate::chat_prompt::ChatPrompt;
use crate::error::ApiError;
use crate::logprobs;
use crate::params::{self, Body, Common, ToolChoice, MAX_TOP_LOGPROBS};
use crate::reasoning::output_reasoning;
use crate::tools::{Dialect, ParserConfig};
use crate::worker::{EngineHandle, Event, Prompt, ReasoningLimits, Submission, SubmitError};

/// OpenAI's legacy completions default for `max_tokens`.
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// Which endpoint a generation belongs to (shapes the response objects).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(crate) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }

    pub(crate) fn prompt_param(self) -> &'static str {
        match self {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        }
    }
}

/// A parsed generation request, ready to submit.
pub(crate) struct Parsed {
    pub(crate) kind: Kind,
    pub(crate) prompt: Prompt,
    pub(crate) common: Common,
    /// Alternatives per token when log-probabilities were asked for.
    logprobs: Option<usize>,
    /// Speculative decoding (the `spec` field over the server default).
    spec: SpecOptions,
    /// Chat: how the output is parsed (tool calls, reasoning).
    pub(crate) chat: Option<ChatSetup>,
    /// `response_format`: the grammar the answer is constrained to.
    grammar: Option<GrammarSpec>,
    /// Chat: bounds on the model's reasoning.
    reasoning: Option<ReasoningLimits>,
}

/// How a chat response's output is parsed.
#[derive(Debug, Clone)]
pub(crate) struct ChatSetup {
    /// The tool-call parser's dialect and configuration (`None`: no tools, or `tool_choice`
    /// `none`: the output is all content).
    tools: Option<(Dialect, ParserConfig)>,
    /// The model may think (split `<think>` even when the prompt does not open it).
    thinking: bool,
}

impl ChatSetup {
    /// The pipeline for one response, given the end of its rendered prompt.
    pub(crate) fn output(&self, prompt_tail: &str) -> ChatOutput {
        let reasoning = output_reasoning(prompt_tail, self.thinking);
        let tools = self.tools.as_ref().map(|(d, cfg)| d.parser(cfg));
        ChatOutput::new(reasoning, tools)
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A unique-enough response id: random per process, plus a counter.
pub(crate) fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SALT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let salt = *SALT.get_or_init(|| std::collections::hash_map::RandomState::new().build_hasher().finish());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{:016x}{:08x}", salt, n)
}

fn usage_json(out: &GenerateOutput) -> Value {
    let s = &out.stats;
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
    })
}

/// The `spec` field, checked against what this server can serve.
fn parse_spec(h: &EngineHandle, b: &Body) -> Result<SpecOptions, ApiError> {
    let m = h.model();
    let spec = params::spec(b, &m.spec)?;
    if spec.mode == SpecMode::Draft && m.draft_model.is_none() {
        return Err(ApiError::invalid(
            format!(
                "Invalid 'spec': speculative mode 'draft' needs a draft model, and {} has none attached \
                 (start the server with --draft-model, or attach one with POST /v1/models/{}/speculative).",
                m.id, m.id
            ),
            Some("spec"),
        ));
    }
    if let Some(what) = m.missing_native_drafter(spec.mode) {
        return Err(ApiError::invalid(
            format!(
                "Invalid 'spec': speculative mode '{}' needs {what}, and {} has none attached \
                 (start the server with --drafter DIR).",
                spec.mode.as_str(),
                m.id
            ),
            Some("spec"),
        ));
    }
    Ok(spec)
}

pub(crate) fn parse_body(body: Result<Json<Value>, JsonRejection>) -> Result<Value, ApiError> {
    body.map(|Json(v)| v).map_err(ApiError::from)
}

pub(crate) fn parse_chat(h: &EngineHandle, v: &Value) -> Result<Parsed, ApiError> {
    let b = Body::new(v)?;
    b.check_fields(params::CHAT_FIELDS)?;
    let common = params::common(&b, &h.model().id, &["max_completion_tokens", "max_tokens"])?;
    let messages = params::messages(&b)?;
    let tools = params::tools(&b)?;
    let kwargs = params::template_kwargs(&b)?;
    let spec = parse_spec(h, &b)?;
    let mut grammar = params::response_format(&b)?;
    let limits = params::reasoning_limits(&b)?;
    let want = b.bool("logprobs")?.unwrap_or(false);
    let top = b.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i128)?;
    if !want && top.is_some_and(|t| t > 0) {
        return Err(ApiError::invalid(
            "logprobs must be set to true when top_logprobs is used.",
            Some("top_logprobs"),
        ));
    }
    // `tool_choice: "none"`: the model is not shown the tools and its output is not parsed for
    // calls. `required` and a named function are passed to the template and, where the dialect
    // allows, forced: the answer is constrained to calls of the chosen tools (the sampling
    // mask, exact under speculation as `response_format` is).
    let m = h.model();
    if let Some(forced) = tools.as_ref().and_then(|t| t.forced(m.chat.tool_dialect)) {
        if grammar.is_some() {
            return Err(ApiError::invalid(
                "response_format cannot be combined with tool_choice 'required' or a named function \
                 (both constrain the answer).",
                Some("tool_choice"),
            ));
        }
        grammar = Some(forced);
    }
    let parse_tools = tools.as_ref().filter(|t| t.choice != ToolChoice::None).map(|t| {
        let id_prefix = format!("{}_", new_id("call").replace('-', "_"));
        (
            m.chat.tool_dialect,
            ParserConfig {
                tools: t.specs.clone(),
                id_prefix,
            },
        )
    });
    let extras = specula_engine::chat::ChatExtras {
        tools: tools
            .as_ref()
            .filter(|t| t.choice != ToolChoice::None)
            .map(|t| t.objects.clone()),
        tool_choice: tools.as_ref().and_then(|t| t.choice_json.clone()),
        kwargs,
    };
    Ok(Parsed {
        kind: Kind::Chat,
        prompt: Prompt::Chat(ChatPrompt { messages, extras }),
        common,
        logprobs: want.then(|| top.unwrap_or(0) as usize),
        spec,
        chat: Some(ChatSetup {
            tools: parse_tools,
            thinking: m.chat.thinking,
        }),
        grammar,
        reasoning: Some(ReasoningLimits {
            thinking: m.chat.thinking,
            ..limits
        }),
    })
}

fn parse_completion(h: &EngineHandle, v: &Value) -> Result<Parsed, ApiError> {
    let b = Body::new(v)?;
    b.check_fields(params::COMPLETION_FIELDS)?;
    let common = params::common(&b, &h.model().id, &["max_tokens"])?;
    let prompt = params::prompt(&b)?;
    if b.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo is not supported.", Some("echo")).with_code("unsupported_parameter"));
    }
    if let Some(n) = b.int("best_of")? {
        if n != 1 {
            return Err(
                ApiError::invalid(format!("Only best_of = 1 is supported, got {n}."), Some("best_of"))
                    .with_code("unsupported_parameter"),
            );
        }
    }
    if b.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported.", Some("suffix")).with_code("unsupported_parameter"));
    }
    let logprobs = b.int_in("logprobs", 0, MAX_TOP_LOGPROBS as i128)?.map(|n| n as usize);
    let spec = parse_spec(h, &b)?;
    let grammar = params::response_format(&b)?;
    Ok(Parsed {
        kind: Kind::Completion,
        prompt,
        common,
        logprobs,
        spec,
        chat: None,
        grammar,
        reasoning: None,
    })
}

/// Parse a request body as the route `path` (`/v1/chat/completions` or `/v1/completions`) does,
/// without generating: the parameter checks a request goes through before it is queued. `Ok`:
/// the grammar its answer is constrained to (`response_format`, or the call a `tool_choice`
/// forces), if any, which the engine compiles when the request starts. For the fuzz targets in
/// `fuzz/`.
pub fn check_request(h: &EngineHandle, path: &str, body: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let parsed = match path {
        "/v1/chat/completions" => parse_chat(h, body)?,
        "/v1/completions" => parse_completion(h, body)?,
        _ => return Err(ApiError::route_not_found("POST", path)),
    };
    Ok(parsed.grammar)
}

pub async fn chat_completions(State(h): State<EngineHandle>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let parsed = parse_body(body).and_then(|v| parse_chat(&h, &v));
    match parsed {
        Ok(p) => generate(h, p).await,
        Err(e) => e.into_response(),
    }
}

pub async fn completions(State(h): State<EngineHandle>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let parsed = parse_body(body).and_then(|v| parse_completion(&h, &v));
    match parsed {
        Ok(p) => generate(h, p).await,
        Err(e) => e.into_response(),
    }
}

/// Submit `p` (its grammar compiled first, off the engine thread) and wait for its start: the
/// events' receiver, the end of the rendered prompt and the prompt's token count. Errors before
/// any output are 4xx (`ApiError`), as every route reports them.
pub(crate) async fn start(h: &EngineHandle, p: &Parsed) -> Result<Started, ApiError> {
    let c = &p.common;
    let sub = Submission {
        prompt: p.prompt.clone(),
        request: GenerateRequest {
            prompt_tokens: Vec::new(),
            sampling: c.sampling.clone(),
            max_tokens: c.max_tokens,
            stop: c.stop.clone(),
            logprobs: p.logprobs,
            ignore_eos: c.ignore_eos,
            spec: p.spec,
        },
        default_max_tokens: (p.kind == Kind::Completion).then_some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        stream: c.stream,
        endpoint: p.kind.endpoint(),
        grammar: p.grammar.clone(),
        reasoning: p.reasoning,
    };
    let request_error =
        |e: &RequestError| ApiError::from_request_error(e, p.kind.prompt_param()).naming_max_tokens(c.max_tokens_param);
    // The grammar compiles here, off the engine thread: a large one delays only its request.
    let compiled = match &p.grammar {
        Some(g) => match h.compile_grammar(g).await {
            Some(Ok(c)) => Some(c),
            Some(Err(e)) => return Err(request_error(&e)),
            None => None,
        },
        None => None,
    };
    let mut rx = match h.submit_compiled(sub, compiled) {
        Ok(rx) => rx,
        Err(SubmitError::QueueFull) => return Err(ApiError::queue_full(h.max_queue())),
        Err(SubmitError::WorkerGone) => return Err(ApiError::internal("the engine worker is not running")),
    };
    let (prompt_tail, prompt_tokens, cached_tokens) = match rx.recv().await {
        Some(Event::Started {
            prompt_tail,
            prompt_tokens,
            cached_tokens,
        }) => (prompt_tail, prompt_tokens, cached_tokens),
        Some(Event::Failed(e)) => return Err(request_error(&e)),
        Some(other) => return Err(ApiError::internal(format!("unexpected engine event {other:?}"))),
        None => return Err(ApiError::internal("the engine worker stopped")),
    };
    // A grammar can hit one of its library's limits at the first token (a row of more than
    // 2,000 alternatives): a stream waits for that token before its 200, so the error is still
    // a 400.
    let first = if c.stream && p.grammar.is_some() {
        match rx.recv().await {
            Some(Event::Failed(e)) => return Err(request_error(&e)),
            None => return Err(ApiError::internal("the engine worker stopped")),
            first => first,
        }
    } else {
        None
    };
    Ok(Started {
        events: Events { first, rx },
        prompt_tail,
        prompt_tokens,
        cached_tokens,
    })
}

/// A request the engine started ([`start`]).
pub(crate) struct Started {
    pub(crate) events: Events,
    /// The end of the rendered chat prompt (empty for other prompts).
    pub(crate) prompt_tail: String,
    pub(crate) prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub(crate) cached_tokens: usize,
}

/// A started request's events, the first one possibly read already ([`start`]).
pub(crate) struct Events {
    first: Option<Event>,
    rx: UnboundedReceiver<Event>,
}

impl Events {
    /// The next event; `None` when the worker dropped the request's channel.
    pub(crate) async fn recv(&mut self) -> Option<Event> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }
}

/// Submit, wait for the start (errors before any output become 4xx), then answer as a whole or
/// as a stream.
async fn generate(h: EngineHandle, p: Parsed) -> Response {
    let c = &p.common;
    let (mut rx, prompt_tail) = match start(&h, &p).await {
        Ok(s) => (s.events, s.prompt_tail),
        Err(e) => return e.into_response(),
    };
    let output = p.chat.as_ref().map(|c| c.output(&prompt_tail));
    let ctx = ResponseCtx {
        kind: p.kind,
        id: new_id(if p.kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: unix_now(),
        model: h.model().id.clone(),
        logprobs: p.logprobs.is_some(),
        include_usage: c.include_usage,
        handle: h,
    };
    if c.stream {
        Sse::new(sse_stream(ctx, rx, output))
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response()
    } else {
        loop {
            match rx.recv().await {
                Some(Event::Done(out)) => return Json(ctx.full_response(&out, output)).into_response(),
                Some(Event::Failed(e)) => {
                    return ApiError::from_request_error(&e, p.kind.prompt_param())
                        .naming_max_tokens(c.max_tokens_param)
                        .into_response()
                }
                Some(_) => continue,
                None => return ApiError::internal("the engine worker stopped").into_response(),
            }
        }
    }
}

/// What every response object of one request shares.
struct ResponseCtx {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    handle: EngineHandle,
}

impl ResponseCtx {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The whole response; a chat's `output` pipeline (tool calls, reasoning) parses the text.
    fn full_response(&self, out: &GenerateOutput, output: Option<ChatOutput>) -> Value {
        let lps = out.logprobs.as_deref().unwrap_or(&[]);
        let choice = match self.kind {
            Kind::Chat => {
                let (message, finish_reason) = match output {
                    Some(mut o) => {
                        let mut events = o.feed(&out.text);
                        events.extend(o.finish());
                        let folded = chat_output::fold(&events);
                        (folded.message(), o.finish_reason(out.finish_reason))
                    }
                    None => (
                        json!({"role": "assistant", "content": out.text}),
                        out.finish_reason.as_str(),
                    ),
                };
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": if self.logprobs { logprobs::chat(self.handle.token_bytes(), lps) } else { Value::Null },
                    "finish_reason": finish_reason,
                })
            }
            Kind::Completion => json!({
                "index": 0,
                "text": out.text,
                "logprobs": if self.logprobs { logprobs::legacy(lps, &mut 0) } else { Value::Null },
                "finish_reason": out.finish_reason.as_str(),
            }),
        };
        let mut v = self.envelope(false, vec![choice]);
        v["usage"] = usage_json(out);
        v["spec_stats"] = out.stats.spec.to_json();
        v
    }

    /// The chunk for a piece of streamed output (`None` when there is nothing to send). A chat's
    /// `output` pipeline turns the text into content, reasoning and tool-call deltas (text it
    /// holds back is sent later, never twice).
    fn delta_chunk(&self, d: &StreamDelta, text_offset: &mut usize, output: Option<&mut ChatOutput>) -> Option<Value> {
        let with_lp = self.logprobs && !d.logprobs.is_empty();
        let chat_delta = match output {
            Some(o) => {
                let events = o.feed(&d.text);
                chat_output::delta(&events).map(Value::Object)
            }
            None => (!d.text.is_empty()).then(|| json!({"content": d.text})),
        };
        if chat_delta.is_none() && (d.text.is_empty() || self.kind == Kind::Chat) && !with_lp {
            return None;
        }
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "delta": chat_delta.unwrap_or_else(|| json!({"content": ""})),
                "logprobs": if with_lp { logprobs::chat(self.handle.token_bytes(), &d.logprobs) } else { Value::Null },
                "finish_reason": null,
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": d.text,
                "logprobs": if with_lp { logprobs::legacy(&d.logprobs, text_offset) } else { Value::Null },
                "finish_reason": null,
            }),
        };
        Some(self.envelope(true, vec![choice]))
    }

    fn first_chunk(&self) -> Option<Value> {
        (self.kind == Kind::Chat).then(|| {
            self.envelope(
                true,
                vec![json!({
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                })],
            )
        })
    }

    /// A chunk with what a chat's pipeline still held at the end (`None` if nothing).
    fn flush_chunk(&self, output: Option<&mut ChatOutput>) -> Option<Value> {
        let events: Vec<OutEvent> = output?.finish();
        let delta = chat_output::delta(&events)?;
        Some(self.envelope(
            true,
            vec![json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})],
        ))
    }

    fn final_chunk(&self, out: &GenerateOutput, output: Option<&ChatOutput>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "delta": {},
                "logprobs": null,
                "finish_reason": match output {
                    Some(o) => o.finish_reason(out.finish_reason),
                    None => out.finish_reason.as_str(),
                },
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": "",
                "logprobs": null,
                "finish_reason": out.finish_reason.as_str(),
            }),
        };
        let mut v = self.envelope(true, vec![choice]);
        v["spec_stats"] = out.stats.spec.to_json();
        v
    }

    fn usage_chunk(&self, out: &GenerateOutput) -> Value {
        let mut v = self.envelope(true, Vec::new());
        v["usage"] = usage_json(out);
        v["spec_stats"] = out.stats.spec.to_json();
        v
    }
}

struct StreamState {
    ctx: ResponseCtx,
    output: Option<ChatOutput>,
    rx: Events,
    buf: VecDeque<SseEvent>,
    text_offset: usize,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The SSE body: a chunk per delta, the finish chunk, the usage chunk (when asked for), then
/// `[DONE]`. Dropping it (client gone) drops the receiver, which cancels the generation.
fn sse_stream(
    ctx: ResponseCtx,
    rx: Events,
    output: Option<ChatOutput>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut buf = VecDeque::new();
    if let Some(first) = ctx.first_chunk() {
        buf.push_back(data(&first));
    }
    let state = StreamState {
        ctx,
        output,
        rx,
        buf,
        text_offset: 0,
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.buf.pop_front() {
                return Some((Ok(ev), st));
            }
            if st.done {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Delta(d)) => {
                    if let Some(chunk) = st.ctx.delta_chunk(&d, &mut st.text_offset, st.output.as_mut()) {
                        st.buf.push_back(data(&chunk));
                    }
                }
                Some(Event::Done(out)) => {
                    if let Some(chunk) = st.ctx.flush_chunk(st.output.as_mut()) {
                        st.buf.push_back(data(&chunk));
                    }
                    st.buf.push_back(data(&st.ctx.final_chunk(&out, st.output.as_ref())));
                    if st.ctx.include_usage {
                        st.buf.push_back(data(&st.ctx.usage_chunk(&out)));
                    }
                    st.buf.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                Some(Event::Failed(e)) => {
                    let err = ApiError::from_request_error(&e, st.ctx.kind.prompt_param());
                    st.buf.push_back(data(&err.body()));
                    st.buf.push_back(SseEvent::default().data("[DONE]"));
                    st.done = true;
                }
                Some(Event::Started { .. }) => {}
                None => {
                    let err = ApiError::from_request_error(
                        &RequestError::Internal("the engine worker stopped".to_string()),
                        st.ctx.kind.prompt_param(),
                    );
                    st.buf.push_back(data(&err.body()));
                    st.done = true;
                }
            }
        }
    })
}

fn model_json(h: &EngineHandle) -> Value {
    let m = h.model();
    json!({
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": "specula",
        "context_length": m.context_length,
        "max_model_len": m.context_length,
        "vocab_size": m.vocab_size,
        "specula": {
            "draft_model": m.draft_model,
            "native_drafters": m.native_drafters,
            "spec_default": m.spec.mode.as_str(),
            "draft_max": m.spec.draft_max,
            "adaptive": m.spec.adaptive,
            "sampled_verify": m.spec.sampled_verify.as_str(),
            "batch_invariant": m.batch_invariant,
            "device": m.device,
            "effective_spec": m.effective_spec,
            "tuned_default": m.tuned_default,
            "bundle": m.bundle,
            "loads": m.loads,
        },
    })
}

pub async fn list_models(State(h): State<EngineHandle>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_json(&h)]}))
}

pub async fn get_model(State(h): State<EngineHandle>, model: Result<Path<String>, PathRejection>) -> Response {
    let model = match model {
        Ok(Path(m)) => m,
        Err(_) => return bad_path().into_response(),
    };
    let m = h.model();
    let id = m.id.as_str();
    if model == id {
        Json(model_json(&h)).into_response()
    } else if model.strip_suffix("/speculative") == Some(id) {
        ApiError::method_not_allowed_here("GET", &format!("/v1/models/{model}"), "POST").into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
}

/// A path whose parameter does not decode (percent-encoded bytes that are not UTF-8).
pub(crate) fn bad_path() -> ApiError {
    ApiError::invalid("The URL's path does not decode as UTF-8.", None).with_code("invalid_url")
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn metrics(State(h): State<EngineHandle>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        h.metrics().render(),
    )
        .into_response()
}

pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// Count every request by route pattern and status.
pub async fn track(State(h): State<EngineHandle>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let mut resp = next.run(req).await;
    // Every answer names its request, as OpenAI's (`x-request-id`) and Anthropic's
    // (`request-id`) APIs do, so a client's report can be matched with the server's log line.
    let id = new_id("req").replace('-', "_");
    if let Ok(v) = header::HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v.clone());
        resp.headers_mut().insert("request-id", v);
    }
    let status = resp.status();
    h.metrics()
        .requests
        .with_label_values(&[endpoint.as_str(), status.as_str()])
        .inc();
    if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
        tracing::warn!(endpoint, status = status.as_u16(), request_id = id, "request failed");
    } else {
        tracing::debug!(endpoint, status = status.as_u16(), request_id = id, "request answered");
    }
    resp
}
