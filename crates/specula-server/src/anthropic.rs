//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, the
//! protocol coding agents such as Claude Code speak.
//!
//! A request is translated into the OpenAI chat request it means ([`to_chat`]: `system` and the
//! messages' text, `tool_use` and `tool_result` blocks into system, user, assistant and tool
//! messages; `tools`' `input_schema` into function parameters; `tool_choice` `auto` / `any` /
//! `tool` / `none` into `auto` / `required` / a named function / `none`; `thinking` into
//! `enable_thinking` and the reasoning budget; `stop_sequences` into `stop`) and parsed by the
//! chat route's own parser, so it renders the same prompt and runs through the same engine and
//! emit step: greedy output is byte-identical to `/v1/chat/completions`', with or without
//! speculation. The answer is the same output split the same way (reasoning, text, tool calls),
//! written as Anthropic's content blocks: `thinking`, `text` and `tool_use` with its parsed
//! `input`; streamed as `message_start`, `ping`, `content_block_start` / `_delta` (`text_delta`,
//! `thinking_delta`, `input_json_delta`) / `_stop`, `message_delta` and `message_stop`.
//!
//! Errors use Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, with the same
//! statuses as the OpenAI routes ([`error_shape`] rewrites every error answer under
//! `/v1/messages`, the access check's included). Reference: Anthropic's Messages API
//! documentation (request and streaming event formats).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body as HttpBody;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde_json::{json, Map, Value};
use specula_engine::{GenerateOutput, RequestError};

use crate::api::{self, new_id, Events, Parsed};
use crate::chat_output::{ChatOutput, OutEvent};
use crate::error::ApiError;
use crate::params::Body;
use crate::tools::ToolEvent;
use crate::worker::{EngineHandle, Event};

/// Top-level fields `/v1/messages` translates ([`to_chat`]).
const MESSAGES_FIELDS: &[&str] = &[
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
];

/// Top-level fields that mean the same on the chat route and pass to it as they are (Specula's
/// extensions among them, as on the OpenAI routes).
const PASSED_FIELDS: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "spec",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
];

/// Fields Anthropic's SDK or clients may send that change nothing here: accepted and ignored
/// (`cache_control`: the prefix cache reuses every prompt's prefix without being asked).
const IGNORED_FIELDS: &[&str] = &["service_tier", "anthropic_version", "cache_control"];

/// Anthropic features this server does not implement: a request that sets one is refused.
const UNSUPPORTED_FIELDS: &[&str] = &[
    "container",
    "mcp_servers",
    "context_management",
    "output_config",
    "output_format",
];

/// The error body of `e` in Anthropic's shape; its `type` follows the status as Anthropic's
/// API names them.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Middleware: every error answer under `/v1/messages` (a handler's, the access check's, the
/// body reader's, a 404 or 405) in Anthropic's shape, status and headers kept.
pub async fn error_shape(req: Request, next: Next) -> Response {
    let ours = req.uri().path().starts_with("/v1/messages");
    let resp = next.run(req).await;
    if !ours || !(resp.status().is_client_error() || resp.status().is_server_error()) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return Response::from_parts(parts, HttpBody::empty());
    };
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let out = error_body(parts.status, &message).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, HttpBody::from(out))
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// The text of a `content` that is a string or an array of `text` blocks (`tool_result`
/// contents, `system`); other block types are refused naming `at`.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => parts.push(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(invalid(
                            format!("{at}[{i}]: content blocks of type '{kind}' are not supported here (text only)."),
                            at,
                        )
                        .with_code("unsupported_parameter"))
                    }
                    _ => return Err(invalid(format!("{at}[{i}]: a text block needs a string 'text'."), at)),
                }
            }
            Ok(parts.join("\n"))
        }
        Value::Null => Ok(String::new()),
        _ => Err(invalid(format!("{at}: expected a string or an array of text blocks."), at).with_code("invalid_type")),
    }
}

/// One Anthropic message as the OpenAI messages it means, appended to `out`.
fn message_to_chat(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let role = match m["role"].as_str() {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => {
            return Err(invalid(
                format!("{at}.role: '{r}' is not a role here (user or assistant; the system prompt is 'system')."),
                "messages",
            ))
        }
        None => return Err(invalid(format!("{at}.role: missing."), "messages")),
    };
    let blocks = match &m["content"] {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => {
            return Err(invalid(
                format!("{at}.content: expected a string or an array of content blocks."),
                "messages",
            )
            .with_code("invalid_type"))
        }
    };
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    let flush_user = |text: &mut String, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": std::mem::take(text)}));
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        match (role, b["type"].as_str()) {
            (_, Some("text")) => {
                let t = b["text"]
                    .as_str()
                    .ok_or_else(|| invalid(format!("{bat}.text: expected a string."), "messages"))?;
                text.push_str(t);
            }
            ("assistant", Some("thinking")) => reasoning.push_str(b["thinking"].as_str().unwrap_or("")),
            ("assistant", Some("redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => {
                let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                    return Err(invalid(
                        format!("{bat}: a tool_use block needs 'id' and 'name'."),
                        "messages",
                    ));
                };
                let input = if b["input"].is_null() {
                    json!({})
                } else {
                    b["input"].clone()
                };
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("user", Some("tool_result")) => {
                flush_user(&mut text, out);
                let id = b["tool_use_id"]
                    .as_str()
                    .ok_or_else(|| invalid(format!("{bat}: a tool_result block needs 'tool_use_id'."), "messages"))?;
                let mut content = text_of(&b["content"], &format!("{bat}.content"))?;
                if b["is_error"].as_bool() == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, Some(kind)) => {
                return Err(invalid(
                    format!("{bat}: content blocks of type '{kind}' are not supported in a {role} message."),
                    "messages",
                )
                .with_code("unsupported_parameter"))
            }
            (_, None) => return Err(invalid(format!("{bat}.type: missing."), "messages")),
        }
    }
    if role == "user" {
        flush_user(&mut text, out);
    } else {
        let mut msg = Map::new();
        msg.insert("role".into(), json!("assistant"));
        msg.insert("content".into(), json!(text));
        if !reasoning.is_empty() {
            msg.insert("reasoning_content".into(), json!(reasoning));
        }
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// The OpenAI chat request an Anthropic Messages request means (see the module docs).
/// Errors: 400s naming the Anthropic field.
pub fn to_chat(v: &Value) -> Result<Value, ApiError> {
    let b = Body::new(v)?;
    let Value::Object(req) = v else {
        unreachable!("Body::new checked it")
    };
    for (k, val) in req {
        let k = k.as_str();
        if MESSAGES_FIELDS.contains(&k) || PASSED_FIELDS.contains(&k) || IGNORED_FIELDS.contains(&k) {
            continue;
        }
        if UNSUPPORTED_FIELDS.contains(&k) && !val.is_null() {
            return Err(
                invalid(format!("'{k}' is not supported by this server."), k).with_code("unsupported_parameter")
            );
        }
        if !UNSUPPORTED_FIELDS.contains(&k) {
            let shown: String = k.chars().take(64).collect();
            return Err(
                invalid(format!("{shown}: Extra inputs are not permitted"), &shown).with_code("unknown_parameter")
            );
        }
    }
    let mut out = Map::new();
    for &key in PASSED_FIELDS {
        if let Some(x) = b.get(key) {
            out.insert(key.into(), x.clone());
        }
    }
    match b.get("max_tokens") {
        Some(x) => out.insert("max_tokens".into(), x.clone()),
        None => return Err(invalid("max_tokens: Field required", "max_tokens").with_code("missing_required_parameter")),
    };
    if let Some(s) = b.get("stop_sequences") {
        if !s.is_array() {
            return Err(
                invalid("stop_sequences: expected an array of strings.", "stop_sequences").with_code("invalid_type"),
            );
        }
        out.insert("stop".into(), s.clone());
    }
    let mut messages = Vec::new();
    if let Some(s) = b.get("system") {
        let text = text_of(s, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    match b.get("messages") {
        Some(Value::Array(ms)) => {
            for (i, m) in ms.iter().enumerate() {
                message_to_chat(i, m, &mut messages)?;
            }
        }
        Some(_) => {
            return Err(invalid("messages: expected an array of messages.", "messages").with_code("invalid_type"))
        }
        None => return Err(invalid("messages: Field required", "messages").with_code("missing_required_parameter")),
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = b.get("tools") {
        let Value::Array(ts) = tools else {
            return Err(invalid("tools: expected an array of tools.", "tools").with_code("invalid_type"));
        };
        let mut fns = Vec::new();
        for (i, t) in ts.iter().enumerate() {
            match t["type"].as_str() {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(invalid(
                        format!("tools[{i}]: server tools ('{kind}') are not supported; define the tool with 'name' and 'input_schema'."),
                        "tools",
                    )
                    .with_code("unsupported_parameter"))
                }
            }
            let name = t["name"]
                .as_str()
                .ok_or_else(|| invalid(format!("tools[{i}].name: Field required"), "tools"))?;
            let mut f = Map::new();
            f.insert("name".into(), json!(name));
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                f.insert("description".into(), d.clone());
            }
            let schema = t.get("input_schema").filter(|s| !s.is_null()).cloned();
            f.insert("parameters".into(), schema.unwrap_or_else(|| json!({"type": "object"})));
            fns.push(json!({"type": "function", "function": f}));
        }
        out.insert("tools".into(), Value::Array(fns));
    }
    if let Some(tc) = b.get("tool_choice") {
        let choice = match tc["type"].as_str() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match tc["name"].as_str() {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => {
                    return Err(invalid(
                        "tool_choice.name: Field required for type 'tool'.",
                        "tool_choice",
                    ))
                }
            },
            _ => {
                return Err(invalid(
                    "tool_choice.type: expected 'auto', 'any', 'tool' or 'none'.",
                    "tool_choice",
                ))
            }
        };
        out.insert("tool_choice".into(), choice);
        if tc["disable_parallel_tool_use"].as_bool() == Some(true) {
            out.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    if let Some(t) = b.get("thinking") {
        match t["type"].as_str() {
            Some("enabled") => {
                out.insert("chat_template_kwargs".into(), json!({"enable_thinking": true}));
                if let Some(n) = t.get("budget_tokens").filter(|n| !n.is_null()) {
                    out.insert("max_reasoning_tokens".into(), n.clone());
                }
            }
            Some("disabled") => {
                out.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
            }
            _ => return Err(invalid("thinking.type: expected 'enabled' or 'disabled'.", "thinking")),
        }
    }
    Ok(Value::Object(out))
}

/// Parse a Messages request into the chat route's [`Parsed`]; parameter names in errors are
/// Anthropic's.
fn parse(h: &EngineHandle, v: &Value) -> Result<Parsed, ApiError> {
    let chat = to_chat(v)?;
    api::parse_chat(h, &chat).map_err(|mut e| {
        let renamed = match e.param.as_deref() {
            Some("stop") => Some("stop_sequences"),
            Some("max_reasoning_tokens") | Some("chat_template_kwargs") => Some("thinking"),
            _ => None,
        };
        if let Some(r) = renamed {
            e.message = e.message.replace(e.param.as_deref().unwrap_or_default(), r);
            e.param = Some(r.to_string());
        }
        e
    })
}

/// `POST /v1/messages`.
pub async fn messages(State(h): State<EngineHandle>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let p = match api::parse_body(body).and_then(|v| parse(&h, &v)) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let started = match api::start(&h, &p).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let mut rx = started.events;
    let output = p
        .chat
        .as_ref()
        .map(|c| c.output(&started.prompt_tail))
        .expect("a Messages request is a chat request");
    let mut w = Writer {
        id: new_id("msg").replace('-', "_"),
        model: h.model().id.clone(),
        output,
        blocks: Vec::new(),
        open: None,
        events: VecDeque::new(),
    };
    if p.common.stream {
        w.push(
            "message_start",
            json!({"type": "message_start", "message": {"id": w.id, "type": "message", "role": "assistant",
                "content": [], "model": w.model, "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": started.prompt_tokens - started.cached_tokens,
                    "cache_read_input_tokens": started.cached_tokens,
                    "cache_creation_input_tokens": 0, "output_tokens": 0}}}),
        );
        w.push("ping", json!({"type": "ping"}));
        return Sse::new(stream(w, rx))
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response();
    }
    loop {
        match rx.recv().await {
            Some(Event::Done(out)) => {
                let events = w.output.feed(&out.text);
                w.apply(&events);
                let events = w.output.finish();
                w.apply(&events);
                w.close_block();
                return Json(w.message(&out)).into_response();
            }
            Some(Event::Failed(e)) => return ApiError::from_request_error(&e, "messages").into_response(),
            Some(_) => continue,
            None => return ApiError::internal("the engine worker stopped").into_response(),
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's token count, `{"input_tokens": N}`.
pub async fn count_tokens(State(h): State<EngineHandle>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let parsed = api::parse_body(body).and_then(|mut v| {
        // Counting needs no length limit.
        if let Some(o) = v.as_object_mut() {
            o.entry("max_tokens").or_insert(json!(1));
        }
        parse(&h, &v)
    });
    let p = match parsed {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    match h.count_prompt_tokens(p.prompt).await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => ApiError::from_request_error(&e, "messages").into_response(),
    }
}

/// A content block being built.
#[derive(Debug)]
enum Block {
    Text(String),
    Thinking(String),
    /// A tool call: its id, name, arguments' JSON text, and whether it completed.
    ToolUse {
        call: usize,
        id: String,
        name: String,
        json: String,
        complete: bool,
    },
}

/// Turns the output pipeline's events into Anthropic content blocks, and (streaming) into the
/// events that build them.
struct Writer {
    id: String,
    model: String,
    output: ChatOutput,
    blocks: Vec<Block>,
    /// Index of the open block in `blocks`.
    open: Option<usize>,
    /// SSE events waiting to be sent (streaming).
    events: VecDeque<SseEvent>,
}

impl Writer {
    fn push(&mut self, name: &str, data: Value) {
        self.events
            .push_back(SseEvent::default().event(name).data(data.to_string()));
    }

    fn close_block(&mut self) {
        if let Some(i) = self.open.take() {
            self.push("content_block_stop", json!({"type": "content_block_stop", "index": i}));
        }
    }

    /// Open a block of `block`'s kind unless the open one is of that kind (text and thinking
    /// continue; a tool call always opens its own).
    fn open_block(&mut self, block: Block) -> usize {
        let same = matches!(
            (self.open.map(|i| &self.blocks[i]), &block),
            (Some(Block::Text(_)), Block::Text(_)) | (Some(Block::Thinking(_)), Block::Thinking(_))
        );
        if same {
            return self.open.unwrap_or_default();
        }
        self.close_block();
        let i = self.blocks.len();
        let start = match &block {
            Block::Text(_) => json!({"type": "text", "text": ""}),
            Block::Thinking(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Block::ToolUse { id, name, .. } => json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        };
        self.push(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        );
        self.blocks.push(block);
        self.open = Some(i);
        i
    }

    fn text(&mut self, t: &str, thinking: bool) {
        if t.is_empty() {
            return;
        }
        let i = self.open_block(if thinking {
            Block::Thinking(String::new())
        } else {
            Block::Text(String::new())
        });
        match &mut self.blocks[i] {
            Block::Text(s) | Block::Thinking(s) => s.push_str(t),
            Block::ToolUse { .. } => {}
        }
        let delta = if thinking {
            json!({"type": "thinking_delta", "thinking": t})
        } else {
            json!({"type": "text_delta", "text": t})
        };
        self.push(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": delta}),
        );
    }

    fn apply(&mut self, events: &[OutEvent]) {
        for e in events {
            match e {
                OutEvent::Reasoning(t) => self.text(t, true),
                OutEvent::Content(t) | OutEvent::Tool(ToolEvent::Content(t)) => self.text(t, false),
                OutEvent::Tool(ToolEvent::Unfinished { index: None, raw }) => self.text(raw, false),
                OutEvent::Tool(ToolEvent::Unfinished { index: Some(_), .. }) => self.close_block(),
                OutEvent::Tool(ToolEvent::Start { index, id, name }) => {
                    self.open_block(Block::ToolUse {
                        call: *index,
                        // Anthropic's tool-use ids start `toolu_`.
                        id: id.replacen("call_", "toolu_", 1),
                        name: name.clone(),
                        json: String::new(),
                        complete: false,
                    });
                }
                OutEvent::Tool(ToolEvent::Args { index, fragment }) => {
                    let Some(i) = self
                        .open
                        .filter(|&i| matches!(&self.blocks[i], Block::ToolUse { call, .. } if call == index))
                    else {
                        continue;
                    };
                    if let Block::ToolUse { json, .. } = &mut self.blocks[i] {
                        json.push_str(fragment);
                    }
                    self.push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": fragment}}),
                    );
                }
                OutEvent::Tool(ToolEvent::End { index }) => {
                    for b in &mut self.blocks {
                        if let Block::ToolUse { call, complete, .. } = b {
                            if call == index {
                                *complete = true;
                            }
                        }
                    }
                    if self
                        .open
                        .is_some_and(|i| matches!(&self.blocks[i], Block::ToolUse { call, .. } if call == index))
                    {
                        self.close_block();
                    }
                }
            }
        }
    }

    /// Anthropic's `stop_reason` and `stop_sequence` for `out`.
    fn stop(&self, out: &GenerateOutput) -> (&'static str, Option<String>) {
        match self.output.finish_reason(out.finish_reason) {
            "tool_calls" => ("tool_use", None),
            "length" => ("max_tokens", None),
            _ => match &out.stop_sequence {
                Some(s) => ("stop_sequence", Some(s.clone())),
                None => ("end_turn", None),
            },
        }
    }

    fn usage(out: &GenerateOutput) -> Value {
        let s = &out.stats;
        json!({
            "input_tokens": s.prompt_tokens - s.cached_prompt_tokens.min(s.prompt_tokens),
            "cache_read_input_tokens": s.cached_prompt_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": s.completion_tokens,
        })
    }

    /// The whole message: complete tool calls as `tool_use` blocks (an unfinished one is text).
    fn message(&self, out: &GenerateOutput) -> Value {
        let mut content: Vec<Value> = Vec::new();
        let push_text = |content: &mut Vec<Value>, t: &str| match content.last_mut() {
            Some(last) if last["type"] == "text" => {
                let joined = format!("{}{t}", last["text"].as_str().unwrap_or(""));
                last["text"] = json!(joined);
            }
            _ => content.push(json!({"type": "text", "text": t})),
        };
        for b in &self.blocks {
            match b {
                Block::Text(t) => push_text(&mut content, t),
                Block::Thinking(t) => content.push(json!({"type": "thinking", "thinking": t, "signature": ""})),
                Block::ToolUse {
                    id,
                    name,
                    json: args,
                    complete: true,
                    ..
                } => {
                    let input = serde_json::from_str::<Value>(args).unwrap_or_else(|_| json!({}));
                    content.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
                }
                Block::ToolUse { .. } => {}
            }
        }
        let (stop_reason, stop_sequence) = self.stop(out);
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": Self::usage(out),
            "spec_stats": out.stats.spec.to_json(),
        })
    }
}

/// The SSE body. Dropping it (client gone) drops the receiver, which cancels the generation.
fn stream(w: Writer, rx: Events) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    futures::stream::unfold((w, rx, false), |(mut w, mut rx, mut done)| async move {
        loop {
            if let Some(ev) = w.events.pop_front() {
                return Some((Ok(ev), (w, rx, done)));
            }
            if done {
                return None;
            }
            match rx.recv().await {
                Some(Event::Delta(d)) => {
                    let events = w.output.feed(&d.text);
                    w.apply(&events);
                }
                Some(Event::Done(out)) => {
                    let events = w.output.finish();
                    w.apply(&events);
                    w.close_block();
                    let (stop_reason, stop_sequence) = w.stop(&out);
                    w.push(
                        "message_delta",
                        json!({"type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": Writer::usage(&out), "spec_stats": out.stats.spec.to_json()}),
                    );
                    w.push("message_stop", json!({"type": "message_stop"}));
                    done = true;
                }
                Some(Event::Failed(e)) => {
                    let e = ApiError::from_request_error(&e, "messages");
                    w.push("error", error_body(e.status, &e.message));
                    done = true;
                }
                Some(Event::Started { .. }) => {}
                None => {
                    let e = RequestError::Internal("the engine worker stopped".to_string());
                    let e = ApiError::from_request_error(&e, "messages");
                    w.push("error", error_body(e.status, &e.message));
                    done = true;
                }
            }
        }
    })
}
