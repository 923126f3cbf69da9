//! Request-body parsing with OpenAI-style errors that name the offending parameter.
//!
//! Bodies are read as JSON values and fields are picked one by one: unknown fields are ignored,
//! `null` means "absent", and a wrong type is a 400 naming the field.

use serde_json::{Map, Value};
use specula_engine::chat::{ChatFunctionCall, ChatToolCall, RESERVED_TEMPLATE_VARIABLES};
use specula_engine::engine::MAX_DRAFT;
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::{ChatMessage, SamplingParams};

use specula_engine::constraint::GrammarSpec;

use crate::error::ApiError;
use crate::tools::ToolSpec;
use crate::worker::{Prompt, ReasoningLimits};

/// Most alternatives `top_logprobs` / legacy `logprobs` may ask for (the engine's limit).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// The body's top-level object.
pub struct Body<'a>(&'a Map<String, Value>);

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn bad_type(param: &str, expected: &str, got: &Value) -> ApiError {
    bad_field_type(param, param, expected, got)
}

/// A wrong type for `field`, a part of the request parameter `param` (`spec.mode` of `spec`).
fn bad_field_type(param: &str, field: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        format!(
            "Invalid type for '{field}': expected {expected}, but got {} instead.",
            type_name(got)
        ),
        Some(param),
    )
    .with_code("invalid_type")
}

fn bad_value(param: &str, message: String) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn missing(param: &str) -> ApiError {
    ApiError::invalid(format!("Missing required parameter: '{param}'."), Some(param))
        .with_code("missing_required_parameter")
}

/// A JSON number that is a whole number (`3` or `3.0`).
fn as_integer(v: &Value) -> Option<i128> {
    if let Some(i) = v.as_i64() {
        return Some(i as i128);
    }
    if let Some(u) = v.as_u64() {
        return Some(u as i128);
    }
    let f = v.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 1e18).then_some(f as i128)
}

/// Top-level fields shared by `/v1/chat/completions` and `/v1/completions` (the sampling and
/// length controls of [`common`], the `spec` extension, `response_format`).
const COMMON_FIELDS: &[&str] = &[
    "model",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "logprobs",
    "spec",
    "response_format",
];

/// Top-level fields `/v1/chat/completions` reads, beyond [`COMMON_FIELDS`].
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "max_reasoning_tokens",
    "think_prelude_chars",
];

/// Top-level fields `/v1/completions` reads, beyond [`COMMON_FIELDS`].
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "parse_special", "echo", "best_of", "suffix"];

/// Fields OpenAI's SDKs and clients send that change nothing on a local server (billing, storage,
/// tracing and cache-routing hints): accepted and ignored.
pub const IGNORED_FIELDS: &[&str] = &[
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
];

/// OpenAI fields this server does not implement: a request that sets one (to anything but
/// `null`) is refused with `unsupported_parameter` rather than answered as if it were honoured.
const UNSUPPORTED_FIELDS: &[&str] = &[
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "verbosity",
];

/// Longest field name quoted back in an error message.
const MAX_QUOTED_FIELD: usize = 64;

impl<'a> Body<'a> {
    pub fn new(v: &'a Value) -> Result<Self, ApiError> {
        match v {
            Value::Object(m) => Ok(Self(m)),
            other => Err(ApiError::invalid(
                format!("The request body must be a JSON object, but got {}.", type_name(other)),
                None,
            )
            .with_code("invalid_type")),
        }
    }

    /// Refuse top-level fields the endpoint does not read: `known` (the endpoint's list, beside
    /// the shared [`COMMON_FIELDS`] and [`IGNORED_FIELDS`]) pass; an OpenAI field this server
    /// does not implement is a 400 `unsupported_parameter` (`modalities` passes when it asks for
    /// text only); anything else is a 400 `unknown_parameter` naming the field (cut to 64
    /// characters), as OpenAI answers an unrecognized argument.
    pub fn check_fields(&self, known: &[&str]) -> Result<(), ApiError> {
        for (key, v) in self.0 {
            let k = key.as_str();
            if COMMON_FIELDS.contains(&k) || known.contains(&k) || IGNORED_FIELDS.contains(&k) {
                continue;
            }
            if k == "modalities" {
                let text_only = match v {
                    Value::Null => true,
                    Value::Array(a) => a.iter().all(|m| m.as_str() == Some("text")),
                    _ => false,
                };
                if text_only {
                    continue;
                }
                return Err(
                    ApiError::invalid("Only the 'text' modality is supported.", Some("modalities"))
                        .with_code("unsupported_parameter"),
                );
            }
            if UNSUPPORTED_FIELDS.contains(&k) {
                if v.is_null() {
                    continue;
                }
                return Err(
                    ApiError::invalid(format!("'{k}' is not supported by this server."), Some(k))
                        .with_code("unsupported_parameter"),
                );
            }
            let shown: String = k.chars().take(MAX_QUOTED_FIELD).collect();
            let cut = if shown.len() < k.len() { "..." } else { "" };
            return Err(ApiError::invalid(
                format!("Unrecognized request argument supplied: {shown}{cut}"),
                Some(&shown),
            )
            .with_code("unknown_parameter"));
        }
        Ok(())
    }

    /// The field, `null` counting as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// A number that fits an f32 (a finite JSON number past f32's range, like `1e308`, is an
    /// error naming it, not an infinity).
    pub fn f32(&self, key: &str) -> Result<Option<f32>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let f = v.as_f64().ok_or_else(|| bad_type(key, "a number", v))?;
                if (f as f32).is_infinite() {
                    return Err(bad_value(
                        key,
                        format!(
                            "'{key}' is out of range ({f:e}; the largest accepted magnitude is {:e})",
                            f32::MAX
                        ),
                    ));
                }
                // A nonzero value below f32's smallest subnormal keeps its sign instead of
                // rounding to 0 (`top_p: 1e-300` is in (0, 1], not the 0 it would round to).
                let r = f as f32;
                if r == 0.0 && f != 0.0 {
                    let tiny = f32::from_bits(1);
                    return Ok(Some(if f > 0.0 { tiny } else { -tiny }));
                }
                Ok(Some(r))
            }
        }
    }

    pub fn int(&self, key: &str) -> Result<Option<i128>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_integer(v).map(Some).ok_or_else(|| bad_type(key, "an integer", v)),
        }
    }

    /// An integer in `min..=max`.
    pub fn int_in(&self, key: &str, min: i128, max: i128) -> Result<Option<i128>, ApiError> {
        match self.int(key)? {
            Some(i) if i < min => Err(bad_value(
                key,
                format!(
                    "Invalid '{key}': integer below minimum value. Expected a value >= {min}, but got {i} instead."
                ),
            )),
            Some(i) if i > max => Err(bad_value(
                key,
                format!(
                    "Invalid '{key}': integer above maximum value. Expected a value <= {max}, but got {i} instead."
                ),
            )),
            x => Ok(x),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| bad_type(key, "a boolean", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| bad_type(key, "a string", v)),
        }
    }
}

/// `logit_bias`: an object from token ids (as strings, OpenAI's form) to biases in [-100, 100].
/// Errors name the field and the offending key; token ids past the vocabulary are the engine's
/// check ([`specula_engine::Engine::validate`]).
fn logit_bias(b: &Body) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = b.get("logit_bias") else {
        return Ok(Vec::new());
    };
    let Value::Object(m) = v else {
        return Err(bad_type("logit_bias", "an object mapping token ids to numbers", v));
    };
    m.iter()
        .map(|(k, v)| {
            // A token id as OpenAI's clients write it (`str(id)`): digits only, no sign, space or
            // leading zero, so two spellings never name one token.
            let id = k.parse::<u32>().ok().filter(|id| id.to_string() == *k).ok_or_else(|| {
                bad_value(
                    "logit_bias",
                    format!(
                        "Invalid 'logit_bias': the key {k:?} is not a token id (a non-negative integer \
                             without sign, spaces or leading zeros)."
                    ),
                )
            })?;
            let bias = v
                .as_f64()
                .ok_or_else(|| bad_field_type("logit_bias", &format!("logit_bias.{k}"), "a number", v))?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(bad_value(
                    "logit_bias",
                    format!("Invalid 'logit_bias': the bias of token {id} must be in [-100, 100], got {bias}."),
                ));
            }
            Ok((id, bias as f32))
        })
        .collect()
}

/// Fields shared by the chat and completions endpoints.
#[derive(Debug, Clone)]
pub struct Common {
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came from (`max_completion_tokens` or `max_tokens`), which an
    /// error about the length limit names.
    pub max_tokens_param: &'static str,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// Check `model` (absent, or the served id) and `n`, then read the sampling fields.
/// `max_tokens_keys` are the accepted names of the length limit, highest precedence first.
pub fn common(b: &Body, model_id: &str, max_tokens_keys: &[&'static str]) -> Result<Common, ApiError> {
    if let Some(model) = b.str("model")? {
        if model != model_id {
            return Err(ApiError::model_not_found(model));
        }
    }
    if let Some(n) = b.int("n")? {
        if n != 1 {
            return Err(bad_value(
                "n",
                format!("Invalid 'n': only n = 1 is supported, got {n}."),
            ));
        }
    }
    let mut max_tokens = None;
    let mut max_tokens_param = "max_tokens";
    for &key in max_tokens_keys {
        if let Some(v) = b.int_in(key, 1, u32::MAX as i128)? {
            if max_tokens.is_none() {
                max_tokens = Some(v as usize);
                max_tokens_param = key;
            }
        }
    }
    let d = SamplingParams::default();
    let top_k = match b.int_in("top_k", -1, u32::MAX as i128)? {
        None | Some(-1) => 0,
        Some(k) => k as usize,
    };
    let seed = match b.get("seed") {
        None => None,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => Some(u),
            (None, Some(i)) => Some(i as u64),
            _ => return Err(bad_type("seed", "an integer", v)),
        },
    };
    let sampling = SamplingParams {
        temperature: b.f32("temperature")?.unwrap_or(d.temperature),
        top_k,
        top_p: b.f32("top_p")?.unwrap_or(d.top_p),
        min_p: b.f32("min_p")?.unwrap_or(d.min_p),
        repetition_penalty: b.f32("repetition_penalty")?.unwrap_or(d.repetition_penalty),
        presence_penalty: b.f32("presence_penalty")?.unwrap_or(d.presence_penalty),
        frequency_penalty: b.f32("frequency_penalty")?.unwrap_or(d.frequency_penalty),
        seed,
        logit_bias: Vec::new(),
    };
    let sampling = sampling
        .with_logit_bias(logit_bias(b)?)
        .map_err(|e| ApiError::from_request_error(&e, "prompt"))?;
    if let Err(e) = sampling.validate() {
        return Err(ApiError::from_request_error(&e, "prompt"));
    }
    let stop = match b.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad_type("stop", "a string or an array of strings", s))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(bad_type("stop", "a string or an array of strings", v)),
    };
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(x)) => *x,
            Some(v) => return Err(bad_type("stream_options.include_usage", "a boolean", v)),
        },
        Some(v) => return Err(bad_type("stream_options", "an object", v)),
    };
    Ok(Common {
        sampling,
        max_tokens,
        max_tokens_param,
        stop,
        ignore_eos: b.bool("ignore_eos")?.unwrap_or(false),
        stream,
        include_usage,
    })
}

const SPEC_MODES: &str = "'off', 'default', 'on', 'ngram', 'draft', 'mtp' or 'block'";

fn spec_mode(v: &str) -> Result<SpecMode, ApiError> {
    SpecMode::parse(v).ok_or_else(|| {
        bad_value(
            "spec",
            format!("Invalid 'spec' mode '{v}': expected one of {SPEC_MODES}."),
        )
    })
}

/// A `sampled_verify` value (`coupled`, `rejection`; [`SampledVerify`]); errors name
/// `param`.
pub fn sampled_verify(v: &str, param: &str) -> Result<SampledVerify, ApiError> {
    SampledVerify::parse(v).ok_or_else(|| {
        ApiError::invalid(
            format!("Invalid '{param}' '{v}': expected 'coupled' or 'rejection'."),
            Some(param),
        )
    })
}

/// The `spec` extension: a mode string (`"ngram"`), or an object
/// `{"mode": ..., "draft_max": K, "adaptive": bool, "sampled_verify": "coupled"|"rejection"}`
/// whose missing (or null) fields come from `default` (the server-wide setting); absent or
/// null = `default`. Every error names `spec`.
pub fn spec(b: &Body, default: &SpecOptions) -> Result<SpecOptions, ApiError> {
    let mut out = *default;
    match b.get("spec") {
        None => {}
        Some(Value::String(m)) => out.mode = spec_mode(m)?,
        Some(Value::Object(o)) => {
            if let Some(key) = o
                .keys()
                .find(|k| !matches!(k.as_str(), "mode" | "draft_max" | "adaptive" | "sampled_verify"))
            {
                return Err(ApiError::invalid(
                    format!(
                        "Unknown field 'spec.{key}': 'spec' takes 'mode', 'draft_max', 'adaptive' and 'sampled_verify'."
                    ),
                    Some("spec"),
                )
                .with_code("unknown_parameter"));
            }
            match o.get("mode") {
                None | Some(Value::Null) => {}
                Some(Value::String(m)) => out.mode = spec_mode(m)?,
                Some(v) => return Err(bad_field_type("spec", "spec.mode", "a string", v)),
            }
            match o.get("draft_max") {
                None | Some(Value::Null) => {}
                Some(v) => match as_integer(v) {
                    Some(k) if (1..=MAX_DRAFT as i128).contains(&k) => out.draft_max = k as usize,
                    Some(k) => {
                        return Err(bad_value(
                            "spec",
                            format!(
                                "Invalid 'spec.draft_max': expected a value between 1 and {MAX_DRAFT}, but got {k} instead."
                            ),
                        ))
                    }
                    None => return Err(bad_field_type("spec", "spec.draft_max", "an integer", v)),
                },
            }
            match o.get("adaptive") {
                None | Some(Value::Null) => {}
                Some(Value::Bool(a)) => out.adaptive = *a,
                Some(v) => return Err(bad_field_type("spec", "spec.adaptive", "a boolean", v)),
            }
            match o.get("sampled_verify") {
                None | Some(Value::Null) => {}
                Some(Value::String(m)) => {
                    out.sampled_verify = SampledVerify::parse(m).ok_or_else(|| {
                        bad_value(
                            "spec",
                            format!("Invalid 'spec.sampled_verify' '{m}': expected 'coupled' or 'rejection'."),
                        )
                    })?
                }
                Some(v) => return Err(bad_field_type("spec", "spec.sampled_verify", "a string", v)),
            }
        }
        Some(v) => {
            return Err(bad_type(
                "spec",
                &format!("a mode string ({SPEC_MODES}) or an object"),
                v,
            ))
        }
    }
    Ok(out)
}

/// Roles a chat message may have (`developer` is rendered as `system`).
const ROLES: &str = "'system', 'developer', 'user', 'assistant' and 'tool'";

/// A message's `content`: a string, or text parts joined with newlines; `None` when absent or
/// null.
fn message_content(obj: &Map<String, Value>, content_param: &str) -> Result<Option<String>, ApiError> {
    match obj.get("content") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let part_param = format!("{content_param}[{j}]");
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    (Some("text"), other) => {
                        return Err(bad_type(
                            &format!("{part_param}.text"),
                            "a string",
                            other.unwrap_or(&Value::Null),
                        ))
                    }
                    (Some(k), _) => {
                        return Err(ApiError::invalid(
                            format!("Unsupported content part type '{k}': only 'text' parts are supported."),
                            Some(&format!("{part_param}.type")),
                        ))
                    }
                    (None, _) => return Err(missing(&format!("{part_param}.type"))),
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(other) => Err(bad_type(content_param, "a string or an array of content parts", other)),
    }
}

/// An optional string field of an object.
fn opt_str(obj: &Map<String, Value>, key: &str, param: &str) -> Result<Option<String>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad_type(param, "a string", v)),
    }
}

/// A required string field of an object.
fn req_str(obj: &Map<String, Value>, key: &str, param: &str) -> Result<String, ApiError> {
    opt_str(obj, key, param)?.ok_or_else(|| missing(param))
}

/// An assistant message's `tool_calls`.
fn message_tool_calls(v: &Value, param: &str) -> Result<Vec<ChatToolCall>, ApiError> {
    let items = v.as_array().ok_or_else(|| bad_type(param, "an array", v))?;
    items
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let at = format!("{param}[{k}]");
            let obj = c.as_object().ok_or_else(|| bad_type(&at, "an object", c))?;
            let id = req_str(obj, "id", &format!("{at}.id"))?;
            let kind = opt_str(obj, "type", &format!("{at}.type"))?.unwrap_or_else(|| "function".to_string());
            if kind != "function" {
                return Err(bad_value(
                    &format!("{at}.type"),
                    format!("Invalid value: '{kind}'. Supported values are: 'function'."),
                ));
            }
            let fparam = format!("{at}.function");
            let f = match obj.get("function") {
                Some(Value::Object(f)) => f,
                None | Some(Value::Null) => return Err(missing(&fparam)),
                Some(other) => return Err(bad_type(&fparam, "an object", other)),
            };
            let name = req_str(f, "name", &format!("{fparam}.name"))?;
            let aparam = format!("{fparam}.arguments");
            // Templates expect the arguments as an object (transformers' convention): a JSON
            // string that parses is passed parsed, anything else as given.
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => return Err(missing(&aparam)),
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| Value::String(s.clone())),
                Some(o @ Value::Object(_)) => o.clone(),
                Some(other) => return Err(bad_type(&aparam, "a string", other)),
            };
            Ok(ChatToolCall {
                id,
                kind,
                function: ChatFunctionCall { name, arguments },
            })
        })
        .collect()
}

/// Chat `messages`: `role` (system, developer, user, assistant, tool) and `content` (a string,
/// or text parts joined with newlines); assistant messages may carry `tool_calls` (then
/// `content` may be null) and `reasoning_content`; tool messages need `tool_call_id`, which
/// must answer a call of the assistant message before them.
pub fn messages(b: &Body) -> Result<Vec<ChatMessage>, ApiError> {
    let v = b.get("messages").ok_or_else(|| missing("messages"))?;
    let items = v.as_array().ok_or_else(|| bad_type("messages", "an array", v))?;
    if items.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            Some("messages"),
        )
        .with_code("empty_array"));
    }
    // Ids of the calls the latest assistant message made (tool messages answer them).
    let mut open_calls: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let at = format!("messages[{i}]");
        let obj = m.as_object().ok_or_else(|| bad_type(&at, "an object", m))?;
        let role_param = format!("{at}.role");
        let role = match obj.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.as_str(),
            Some(Value::String(_)) | None | Some(Value::Null) => return Err(missing(&role_param)),
            Some(other) => return Err(bad_type(&role_param, "a string", other)),
        };
        // OpenAI's newer name for the system role; chat templates know "system".
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => role,
            other => {
                return Err(bad_value(
                    &role_param,
                    format!("Invalid value: '{other}'. Supported values are: {ROLES}."),
                ))
            }
        };
        let content_param = format!("{at}.content");
        let content = message_content(obj, &content_param)?;
        let mut msg = ChatMessage {
            role: role.to_string(),
            name: opt_str(obj, "name", &format!("{at}.name"))?,
            ..Default::default()
        };
        match role {
            "assistant" => {
                let calls_param = format!("{at}.tool_calls");
                let calls = match obj.get("tool_calls") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(message_tool_calls(v, &calls_param)?).filter(|c| !c.is_empty()),
                };
                if content.is_none() && calls.is_none() {
                    return Err(missing(&content_param));
                }
                let reasoning = match opt_str(obj, "reasoning_content", &format!("{at}.reasoning_content"))? {
                    Some(r) => Some(r),
                    None => opt_str(obj, "reasoning", &format!("{at}.reasoning"))?,
                };
                open_calls = calls
                    .as_ref()
                    .map(|c| c.iter().map(|c| c.id.clone()).collect())
                    .unwrap_or_default();
                msg.tool_calls = calls;
                msg.reasoning_content = reasoning.filter(|r| !r.is_empty());
            }
            "tool" => {
                let id_param = format!("{at}.tool_call_id");
                let id = req_str(obj, "tool_call_id", &id_param)?;
                if !open_calls.contains(&id) {
                    return Err(ApiError::invalid(
                        format!(
                            "Invalid parameter: messages with role 'tool' must be a response to a preceding message \
                             with 'tool_calls'; '{id}' answers none of the calls of the assistant message before it."
                        ),
                        Some(&id_param),
                    ));
                }
                if content.is_none() {
                    return Err(missing(&content_param));
                }
                msg.tool_call_id = Some(id);
            }
            _ => {
                if content.is_none() {
                    return Err(missing(&content_param));
                }
                open_calls.clear();
            }
        }
        msg.content = content.unwrap_or_default();
        out.push(msg);
    }
    Ok(out)
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    /// `{"type": "function", "function": {"name": ...}}`.
    Named(String),
}

/// The tools of a chat request.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The tool objects as given (what the template prints).
    pub objects: Vec<Value>,
    /// What the parsers need of them.
    pub specs: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// `tool_choice` as given (for the template), when given.
    pub choice_json: Option<Value>,
    /// `parallel_tool_calls` (default true): a forced call may be several.
    pub parallel: bool,
}

impl Tools {
    /// The grammar `tool_choice` `"required"` (any offered tool) or a named function forces on
    /// the answer in `dialect` ([`crate::tools::Dialect::forced_calls`]); `None` for `"auto"`,
    /// `"none"`, or a dialect whose calls cannot be forced.
    pub fn forced(&self, dialect: crate::tools::Dialect) -> Option<GrammarSpec> {
        let pick = |o: &&Value| match &self.choice {
            ToolChoice::Required => true,
            ToolChoice::Named(n) => o["function"]["name"].as_str() == Some(n.as_str()),
            ToolChoice::None | ToolChoice::Auto => false,
        };
        let tools: Vec<(&str, Option<&Value>)> = self
            .objects
            .iter()
            .filter(pick)
            .filter_map(|o| {
                let f = &o["function"];
                Some((f["name"].as_str()?, f.get("parameters").filter(|p| !p.is_null())))
            })
            .collect();
        if tools.is_empty() {
            return None;
        }
        dialect.forced_calls(&tools, self.parallel).map(GrammarSpec::ToolCalls)
    }
}

/// Tool names: OpenAI's `^[a-zA-Z0-9_-]{1,64}$`, plus `.` and `:` (namespaced MCP tools).
fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// `tools`, `tool_choice` and `parallel_tool_calls`. `None` when no tools are given (an empty
/// array counts as none); `tool_choice` `"required"` or a named function then is a 400.
pub fn tools(b: &Body) -> Result<Option<Tools>, ApiError> {
    let mut objects = Vec::new();
    let mut specs: Vec<ToolSpec> = Vec::new();
    match b.get("tools") {
        None => {}
        Some(Value::Array(items)) => {
            for (i, t) in items.iter().enumerate() {
                let at = format!("tools[{i}]");
                let obj = t.as_object().ok_or_else(|| bad_type(&at, "an object", t))?;
                match obj.get("type") {
                    Some(Value::String(k)) if k == "function" => {}
                    Some(Value::String(k)) => {
                        return Err(bad_value(
                            &format!("{at}.type"),
                            format!("Invalid value: '{k}'. Supported values are: 'function'."),
                        ))
                    }
                    None | Some(Value::Null) => return Err(missing(&format!("{at}.type"))),
                    Some(v) => return Err(bad_type(&format!("{at}.type"), "a string", v)),
                }
                let fparam = format!("{at}.function");
                let f = match obj.get("function") {
                    Some(Value::Object(f)) => f,
                    None | Some(Value::Null) => return Err(missing(&fparam)),
                    Some(v) => return Err(bad_type(&fparam, "an object", v)),
                };
                let name_param = format!("{fparam}.name");
                let name = req_str(f, "name", &name_param)?;
                if !valid_tool_name(&name) {
                    return Err(bad_value(
                        &name_param,
                        format!(
                            "Invalid '{name_param}': string does not match pattern. Expected a string that matches \
                             the pattern '^[a-zA-Z0-9_.:-]{{1,64}}$'."
                        ),
                    ));
                }
                if specs.iter().any(|s| s.name == name) {
                    return Err(bad_value(
                        &name_param,
                        format!("Invalid 'tools': the function name '{name}' appears more than once."),
                    ));
                }
                opt_str(f, "description", &format!("{fparam}.description"))?;
                match f.get("parameters") {
                    None | Some(Value::Null) | Some(Value::Object(_)) => {}
                    Some(v) => return Err(bad_type(&format!("{fparam}.parameters"), "an object", v)),
                }
                match f.get("strict") {
                    None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                    Some(v) => return Err(bad_type(&format!("{fparam}.strict"), "a boolean", v)),
                }
                let spec = ToolSpec::from_function(&Value::Object(f.clone())).ok_or_else(|| missing(&name_param))?;
                specs.push(spec);
                objects.push(t.clone());
            }
        }
        Some(v) => return Err(bad_type("tools", "an array", v)),
    }
    let parallel = b.bool("parallel_tool_calls")?.unwrap_or(true);
    let choice_json = b.get("tool_choice").cloned();
    let choice = match &choice_json {
        None => {
            if specs.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad_value(
                    "tool_choice",
                    format!("Invalid value: '{other}'. Supported values are: 'none', 'auto' and 'required'."),
                ))
            }
        },
        Some(Value::Object(o)) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                _ => return Err(bad_value(
                    "tool_choice",
                    "Invalid 'tool_choice': an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}."
                        .to_string(),
                )),
            }
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| missing("tool_choice.function.name"))?;
            if !specs.iter().any(|s| s.name == name) {
                return Err(bad_value(
                    "tool_choice",
                    format!("Invalid 'tool_choice': the function '{name}' is not one of the given tools."),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(v) => return Err(bad_type("tool_choice", "a string or an object", v)),
    };
    if specs.is_empty() {
        if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
            return Err(bad_value(
                "tool_choice",
                "Invalid 'tool_choice': 'required' or a named function needs 'tools'.".to_string(),
            ));
        }
        return Ok(None);
    }
    Ok(Some(Tools {
        objects,
        specs,
        choice,
        choice_json,
        parallel,
    }))
}

/// Extra template variables: `chat_template_kwargs` (an object; e.g. `{"enable_thinking":
/// false}`) and `reasoning_effort` (`none`, `minimal`, `low`, `medium`, `high`; passed as
/// `reasoning_effort`, and `none` also sets `enable_thinking: false` unless the kwargs set it).
pub fn template_kwargs(b: &Body) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = match b.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => return Err(bad_type("chat_template_kwargs", "an object", v)),
    };
    if let Some(k) = kwargs
        .keys()
        .find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        return Err(bad_value(
            "chat_template_kwargs",
            format!("Invalid 'chat_template_kwargs': '{k}' is set by the server and cannot be overridden."),
        ));
    }
    if let Some(effort) = b.str("reasoning_effort")? {
        if !matches!(effort, "none" | "minimal" | "low" | "medium" | "high") {
            return Err(bad_value(
                "reasoning_effort",
                format!(
                    "Invalid value: '{effort}'. Supported values are: 'none', 'minimal', 'low', 'medium' and 'high'."
                ),
            ));
        }
        kwargs.insert("reasoning_effort".into(), Value::String(effort.to_string()));
        if effort == "none" {
            kwargs.entry("enable_thinking").or_insert(Value::Bool(false));
        }
    }
    Ok(kwargs)
}

/// Completions `prompt`: a string, an array of one string, an array of token ids, or an array
/// of one array of token ids. A string is text: control-token strings in it are tokenized as
/// the text they spell, unless the request sets `parse_special: true` (llama-server's
/// `parse_special`; a Specula extension), which maps them to their tokens.
pub fn prompt(b: &Body) -> Result<Prompt, ApiError> {
    let parse_special = b.bool("parse_special")?.unwrap_or(false);
    let text = |s: &String| Prompt::Text {
        text: s.clone(),
        parse_special,
    };
    let v = b.get("prompt").ok_or_else(|| missing("prompt"))?;
    let expected = "a string, an array of one string, or an array of token ids";
    // `at` names the array of token ids (`prompt` or `prompt[0]`), so a bad element is named
    // by its index.
    let token_ids = |items: &[Value], at: &str| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .enumerate()
            .map(|(n, t)| match as_integer(t) {
                Some(i) if (0..=u32::MAX as i128).contains(&i) => Ok(i as u32),
                Some(i) => Err(bad_value("prompt", format!("Invalid token id {i} in 'prompt'."))),
                None => Err(bad_field_type(
                    "prompt",
                    &format!("{at}[{n}]"),
                    "a token id (an integer)",
                    t,
                )),
            })
            .collect()
    };
    match v {
        Value::String(s) => Ok(text(s)),
        Value::Array(items) => {
            let Some(first) = items.first() else {
                return Err(
                    ApiError::invalid("Invalid 'prompt': empty array.", Some("prompt")).with_code("empty_array")
                );
            };
            let single = || {
                if items.len() == 1 {
                    Ok(())
                } else {
                    Err(bad_value(
                        "prompt",
                        format!("Only one prompt per request is supported, got {}.", items.len()),
                    ))
                }
            };
            match first {
                Value::String(s) => {
                    single()?;
                    Ok(text(s))
                }
                Value::Array(inner) => {
                    single()?;
                    Ok(Prompt::Tokens(token_ids(inner, "prompt[0]")?))
                }
                Value::Number(_) => Ok(Prompt::Tokens(token_ids(items, "prompt")?)),
                other => Err(bad_type("prompt", expected, other)),
            }
        }
        other => Err(bad_type("prompt", expected, other)),
    }
}

/// Default bound of a thinking model's reasoning before a structured answer, in characters.
pub const DEFAULT_THINK_PRELUDE_CHARS: usize = 4000;

/// `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
/// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`, and
/// two extensions: `{"type": "regex", "regex": "..."}` and `{"type": "lark", "lark": "..."}`
/// (llguidance's regex and Lark syntax). The schema is enforced whether or not `strict` is set.
/// Whether the schema, regex or grammar compiles is checked on the engine (a 400 too).
pub fn response_format(b: &Body) -> Result<Option<GrammarSpec>, ApiError> {
    let param = "response_format";
    let obj = match b.get(param) {
        None => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(bad_type(param, "an object", v)),
    };
    let ty = match obj.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(v) => return Err(bad_field_type(param, "response_format.type", "a string", v)),
        None => return Err(missing("response_format.type")),
    };
    let text_field = |key: &str| -> Result<String, ApiError> {
        match obj.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(Value::String(_)) => Err(bad_value(param, format!("Invalid 'response_format.{key}': empty."))),
            Some(v) => Err(bad_field_type(param, &format!("response_format.{key}"), "a string", v)),
            None => Err(missing(&format!("response_format.{key}"))),
        }
    };
    match ty {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        "json_schema" => {
            let js = match obj.get("json_schema") {
                Some(Value::Object(o)) => o,
                Some(v) => return Err(bad_field_type(param, "response_format.json_schema", "an object", v)),
                None => return Err(missing("response_format.json_schema")),
            };
            match js.get("name") {
                // OpenAI's rule for the name: letters, digits, '_' and '-', at most 64.
                Some(Value::String(n))
                    if n.is_empty()
                        || n.len() > 64
                        || !n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-') =>
                {
                    return Err(bad_value(
                        param,
                        format!(
                            "Invalid 'response_format.json_schema.name': {n:?} must be 1 to 64 letters, \
                             digits, '_' or '-'."
                        ),
                    ));
                }
                None | Some(Value::String(_)) => {}
                Some(v) => return Err(bad_field_type(param, "response_format.json_schema.name", "a string", v)),
            }
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(v) => {
                    return Err(bad_field_type(
                        param,
                        "response_format.json_schema.strict",
                        "a boolean",
                        v,
                    ))
                }
            }
            match js.get("schema") {
                Some(s @ Value::Object(_)) => Ok(Some(GrammarSpec::JsonSchema(s.clone()))),
                Some(v) => Err(bad_field_type(
                    param,
                    "response_format.json_schema.schema",
                    "an object",
                    v,
                )),
                None => Err(missing("response_format.json_schema.schema")),
            }
        }
        "regex" => Ok(Some(GrammarSpec::Regex(text_field("regex")?))),
        "lark" => Ok(Some(GrammarSpec::Lark(text_field("lark")?))),
        other => Err(bad_value(
            param,
            format!(
                "Invalid 'response_format.type': '{other}'. Supported values are: 'text', 'json_object', \
                 'json_schema', and the extensions 'regex' and 'lark'."
            ),
        )),
    }
}

/// Bounds on a thinking model's reasoning: `max_reasoning_tokens` (an extension: tokens of
/// reasoning before `</think>` is forced) and `think_prelude_chars` (an extension: the bound,
/// in characters, of the reasoning before a `response_format` answer; default
/// [`DEFAULT_THINK_PRELUDE_CHARS`]).
pub fn reasoning_limits(b: &Body) -> Result<ReasoningLimits, ApiError> {
    Ok(ReasoningLimits {
        thinking: false,
        max_tokens: b
            .int_in("max_reasoning_tokens", 0, u32::MAX as i128)?
            .map(|n| n as usize),
        prelude_chars: b
            .int_in("think_prelude_chars", 0, u32::MAX as i128)?
            .map(|n| n as usize)
            .unwrap_or(DEFAULT_THINK_PRELUDE_CHARS),
    })
}
