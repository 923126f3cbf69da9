//! Tools, tool messages, template arguments and the reasoning split through the HTTP API, on
//! tiny random models whose chat templates render tools (Qwen2.5-style) or open `<think>` in
//! the generation prompt (Qwen3-style). Parsing of real tool calls is in `tools_qwen.rs`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use axum::http::StatusCode;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use common::*;
use serde_json::{json, Value};
use specula_engine::speculative::SpecOptions;
use specula_engine::{Engine, LoadOptions, SamplingParams};
use specula_server::reasoning::{ReasoningEvent, ReasoningSplitter};
use specula_server::tools::Dialect;
use specula_server::EngineHandle;

const CHAT: &str = "/v1/chat/completions";

/// ChatML with Qwen2.5's tool rendering, plus `tool_choice` and `enable_thinking` when set.
const TOOLS_TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You help.{% endif %}
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>{% if tool_choice is defined %} choice={{ tool_choice | tojson }}{% endif %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}
{{ message.content }}{% endif %}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id={{ message.tool_call_id }}>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined %}thinking={{ enable_thinking }} {{ reasoning_effort }}
{% endif %}{% endif %}"#;

/// Qwen3's generation prompt: `<think>` opened, or closed empty when thinking is off.
const THINK_TEMPLATE: &str = r#"{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"#;

/// The tiny model (Q8_0, batch-invariant, so `spec` really speculates) with another chat
/// template and a 2048-token context: the GGUF is copied with its metadata changed.
fn model_with_template(name: &str, template: &str) -> PathBuf {
    let src = spec_model_path();
    let mut f = std::fs::File::open(&src).expect("open tiny model");
    let content = gguf_file::Content::read(&mut f).expect("read tiny gguf");
    let mut md = content.metadata.clone();
    md.insert(
        "tokenizer.chat_template".to_string(),
        gguf_file::Value::String(template.to_string()),
    );
    // Room for tool prompts (the byte-level tiny vocabulary spends a token per char or so).
    for (k, v) in md.iter_mut() {
        if k.ends_with(".context_length") {
            *v = gguf_file::Value::U32(2048);
        }
    }
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = names
        .iter()
        .map(|n| {
            let t = content.tensor(&mut f, n, &Device::Cpu).expect("tensor");
            (n.to_string(), t)
        })
        .collect();
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let tmp = dir.join(format!("{name}.{}.gguf.tmp", std::process::id()));
    let mut out = std::fs::File::create(&tmp).expect("create");
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write gguf");
    drop(out);
    let path = dir.join(format!("{name}.gguf"));
    std::fs::rename(&tmp, &path).expect("rename");
    path
}

fn tools_model() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| model_with_template("specula-server-tiny-tools", TOOLS_TEMPLATE))
        .clone()
}

fn think_model() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| model_with_template("specula-server-tiny-think", THINK_TEMPLATE))
        .clone()
}

fn load(path: &Path) -> Engine {
    Engine::load(path, MODEL, LoadOptions::default()).expect("load tiny model")
}

fn serve(path: &Path) -> (axum::Router, EngineHandle) {
    app_with_spec(load(path), SpecOptions::default())
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'then'",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

/// The greedy output of `prompt_text` run directly on the engine.
fn direct_text(engine: &mut Engine, prompt_text: &str, max_tokens: usize) -> (String, usize) {
    let tokens = engine.tokenize(prompt_text).expect("tokenize");
    let n = tokens.len();
    let out = direct(engine, tokens, SamplingParams::greedy(), max_tokens, None);
    (out.text, n)
}

#[tokio::test]
async fn tools_tool_calls_and_tool_results_render_through_the_template() {
    let path = tools_model();
    let (app, h) = serve(&path);
    assert_eq!(h.model().chat.tool_dialect, Dialect::Hermes);
    assert_eq!(h.model().chat.tool_dialect_from, "template");
    assert!(!h.model().chat.thinking);
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "{\"temp\": 18}"}]},
            {"role": "user", "content": "And now?"},
        ],
        "tools": [weather_tool()],
        "tool_choice": "auto",
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": true},
        "temperature": 0, "max_tokens": 12,
    });
    let r = post(&app, CHAT, body.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    // The template saw everything: tools (transformers' tojson: the client's key order, `", "`,
    // no HTML escaping), tool_choice, the call's arguments as an object, the tool result, kwargs.
    // (This is what Python's jinja2 renders with transformers' tojson, checked once by hand.)
    let want_prompt = "<|im_start|>system\nYou help.<tools>\
        {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & 'then'\", \
        \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\
        </tools> choice=\"auto\"<|im_end|>\n\
        <|im_start|>user\nWeather in Paris?<|im_end|>\n\
        <|im_start|>assistant<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response id=call_9>\n{\"temp\": 18}\n</tool_response><|im_end|>\n\
        <|im_start|>user\nAnd now?<|im_end|>\n\
        <|im_start|>assistant\nthinking=True low\n";
    let mut eng = load(&path);
    let (text, n) = direct_text(&mut eng, want_prompt, 12);
    assert_eq!(v["usage"]["prompt_tokens"], n, "{v}");
    // A random model emits no call: the output is all content, byte for byte.
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str(), "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());

    // tool_choice "none": the template is not shown the tools.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let v = post(&app, CHAT, none).await.json();
    let want_none = want_prompt
        .split_once("<|im_start|>user\nWeather")
        .map(|(_, rest)| format!("<|im_start|>user\nWeather{rest}"))
        .unwrap();
    let (_, n) = direct_text(&mut eng, &want_none, 1);
    assert_eq!(v["usage"]["prompt_tokens"], n, "{v}");

    // A named tool choice reaches the template as given.
    let mut named = body;
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let v = post(&app, CHAT, named).await.json();
    let want_named = want_prompt.replace(
        "choice=\"auto\"",
        "choice={\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}",
    );
    let (_, n_named) = direct_text(&mut eng, &want_named, 1);
    assert_eq!(v["usage"]["prompt_tokens"], n_named, "{v}");
}

/// A tool whose arguments are one of two words, so a forced call is short whatever the model.
/// Its schema is written as Pydantic writes one: the enum behind a `$ref` into `$defs`, a
/// `format` llguidance does not know.
fn unit_tool() -> Value {
    json!({"type": "function", "function": {"name": "set_unit", "parameters": {"type": "object",
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "format": "int32"}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
        "additionalProperties": false}}})
}

/// `tool_choice` `"required"` or a named function forces a call: a random model, which never
/// calls on its own, answers with a call of the chosen tool whose arguments match its schema,
/// the same with speculation; `response_format` beside it is a 400.
#[tokio::test]
async fn a_required_or_named_tool_choice_forces_a_call() {
    // The template's dialect (Hermes), then the other forceable ones by `--tool-parser`.
    for dialect in [None, Some(Dialect::Bracket), Some(Dialect::Llama3)] {
        let h = EngineHandle::spawn(load(&tools_model())).with_tool_parser(dialect);
        forced_calls_in(specula_server::router(h), dialect).await;
    }
}

async fn forced_calls_in(app: axum::Router, dialect: Option<Dialect>) {
    let base = json!({
        "messages": [{"role": "user", "content": "the thin then the"}],
        "tools": [weather_tool(), unit_tool()],
        "temperature": 0, "max_tokens": 160, "parallel_tool_calls": false,
    });
    // Left to itself the model does not call.
    let v = post(&app, CHAT, base.clone()).await.json();
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    for choice in [
        json!({"type": "function", "function": {"name": "set_unit"}}),
        json!("required"),
    ] {
        let mut body = base.clone();
        body["tool_choice"] = choice.clone();
        if choice == "required" {
            body["tools"] = json!([unit_tool()]);
        }
        let plain = post(&app, CHAT, body.clone()).await;
        assert_eq!(plain.status, StatusCode::OK, "{dialect:?}: {}", plain.text);
        let v = plain.json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{dialect:?}: {v}");
        let calls = c["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(calls[0]["function"]["name"], "set_unit", "{v}");
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap_or_default())
            .expect("arguments are JSON");
        assert!(
            ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or_default()),
            "{args}"
        );
        for spec in [
            json!("ngram"),
            json!({"mode": "ngram", "draft_max": 7, "adaptive": false}),
        ] {
            let mut b = body.clone();
            b["spec"] = spec.clone();
            let s = post(&app, CHAT, b).await.json();
            let (sc, sm) = (&s["choices"][0], &s["choices"][0]["message"]);
            assert_eq!(sc["finish_reason"], "tool_calls", "{choice} {spec}: {s}");
            assert_eq!(sm["content"], c["message"]["content"], "{choice} {spec}: {s}");
            // The same call (its id is new per response).
            assert_eq!(
                sm["tool_calls"][0]["function"], calls[0]["function"],
                "{choice} {spec}: {s}"
            );
            assert_eq!(
                sm["tool_calls"].as_array().map(Vec::len),
                Some(1),
                "{choice} {spec}: {s}"
            );
        }
    }
    let mut both = base.clone();
    both["tool_choice"] = json!("required");
    both["response_format"] = json!({"type": "json_object"});
    let r = post(&app, CHAT, both).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text);
    assert_eq!(r.json()["error"]["param"], "tool_choice", "{}", r.text);
    // A schema that cannot be compiled is the tools' error, not response_format's.
    let mut broken = base.clone();
    broken["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]);
    broken["tool_choice"] = json!("required");
    let r = post(&app, CHAT, broken).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{dialect:?}: {}", r.text);
    assert_eq!(r.json()["error"]["param"], "tools", "{}", r.text);
}

#[tokio::test]
async fn tool_output_is_identical_streamed_and_with_speculation() {
    let path = tools_model();
    let (app, _h) = serve(&path);
    let body = json!({
        "messages": [{"role": "user", "content": "the thin then the thin then the thin then"}],
        "tools": [weather_tool()],
        "temperature": 0, "max_tokens": 60, "ignore_eos": true,
    });
    let plain = post(&app, CHAT, body.clone()).await.json();
    let msg = plain["choices"][0]["message"].clone();
    assert!(msg["content"].as_str().is_some_and(|c| !c.is_empty()), "{plain}");
    for spec in [
        json!("off"),
        json!("ngram"),
        json!({"mode": "ngram", "draft_max": 7, "adaptive": false}),
    ] {
        let mut b = body.clone();
        b["spec"] = spec.clone();
        let v = post(&app, CHAT, b.clone()).await.json();
        assert_eq!(v["choices"][0]["message"], msg, "{spec}");
        if spec != json!("off") {
            assert_eq!(v["spec_stats"]["decode_path"], "ngram", "{v}");
        }
        assert_eq!(v["choices"][0]["finish_reason"], plain["choices"][0]["finish_reason"]);
        b["stream"] = json!(true);
        let (chunks, text) = stream_content(&post(&app, CHAT, b).await);
        assert_eq!(text, msg["content"].as_str().unwrap(), "{spec}: streamed");
        assert!(chunks
            .iter()
            .all(|c| c["choices"][0]["delta"].get("tool_calls").is_none()));
    }
}

/// The chunks of an SSE chat stream and the concatenated `delta.content`.
fn stream_content(r: &Reply) -> (Vec<Value>, String) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    (chunks, text)
}

fn split(open: bool, text: &str) -> (String, String) {
    let mut s = ReasoningSplitter::new(open);
    let mut evs = Vec::new();
    s.feed(text, &mut evs);
    s.finish(&mut evs);
    let (mut r, mut c) = (String::new(), String::new());
    for e in evs {
        match e {
            ReasoningEvent::Reasoning(t) => r.push_str(&t),
            ReasoningEvent::Content(t) => c.push_str(&t),
        }
    }
    (r, c)
}

#[tokio::test]
async fn a_template_that_opens_think_gets_reasoning_content() {
    let path = think_model();
    let (app, h) = serve(&path);
    assert!(h.model().chat.thinking);
    let mut eng = load(&path);
    let body = json!({"messages": [{"role": "user", "content": "the hen"}], "temperature": 0, "max_tokens": 40,
        "ignore_eos": true});
    let v = post(&app, CHAT, body.clone()).await.json();
    let (text, n) = direct_text(
        &mut eng,
        "<|im_start|>user\nthe hen<|im_end|>\n<|im_start|>assistant\n<think>\n",
        40,
    );
    assert_eq!(v["usage"]["prompt_tokens"], n);
    let (reasoning, content) = split(true, &text);
    assert!(!reasoning.is_empty());
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], reasoning.as_str(), "{v}");
    assert_eq!(m["content"], content.as_str(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Streamed (and speculated): reasoning deltas concatenate to the same reasoning.
    for spec in ["off", "ngram"] {
        let mut b = body.clone();
        b["stream"] = json!(true);
        b["spec"] = json!(spec);
        let (chunks, streamed_content) = stream_content(&post(&app, CHAT, b).await);
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(streamed, reasoning, "{spec}");
        assert_eq!(streamed_content, content, "{spec}");
    }

    // Thinking off through chat_template_kwargs (or reasoning_effort "none"): the template
    // closes the block, and the output is content.
    for extra in [
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        json!({"reasoning_effort": "none"}),
    ] {
        let mut b = body.clone();
        for (k, val) in extra.as_object().unwrap() {
            b[k] = val.clone();
        }
        let v = post(&app, CHAT, b).await.json();
        let (text, n) = direct_text(
            &mut eng,
            "<|im_start|>user\nthe hen<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            40,
        );
        assert_eq!(v["usage"]["prompt_tokens"], n, "{extra}");
        let (reasoning, content) = split(false, &text);
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"], content.as_str(), "{extra}: {v}");
        assert_eq!(
            m.get("reasoning_content").and_then(Value::as_str).unwrap_or(""),
            reasoning
        );
    }
}

/// `max_reasoning_tokens` forces `</think>` after that many reasoning tokens (the engine's mask,
/// so the same bytes with speculation); `response_format` on a thinking model gets a bounded
/// think prelude, then the constrained answer.
#[tokio::test]
async fn reasoning_budget_and_think_prelude_through_the_api() {
    use specula_engine::constraint::{GrammarSpec, OutputControl, ReasoningControl};
    let path = think_model();
    let (app, _h) = serve(&path);
    let mut eng = load(&path);
    let prompt_text = "<|im_start|>user\nthe hen<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let tokens = eng.tokenize(prompt_text).expect("tokenize");
    let close = eng.tokenize("</think>").expect("tokenize");
    let direct_with = |eng: &mut Engine, control: &OutputControl, max_tokens: usize| {
        let req = specula_engine::GenerateRequest {
            prompt_tokens: tokens.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            stop: vec![],
            logprobs: None,
            ignore_eos: true,
            spec: SpecOptions::default(),
        };
        eng.generate_with(&req, control, &mut |_| true).expect("generate")
    };
    for budget in [0usize, 3, 9] {
        let control = OutputControl {
            grammar: None,
            reasoning: Some(ReasoningControl {
                open: "<think>".into(),
                close: "</think>".into(),
                starts_open: true,
                max_tokens: Some(budget),
                max_chars: None,
            }),
        };
        let out = direct_with(&mut eng, &control, 30);
        assert_eq!(
            &out.token_ids[budget..budget + close.len()],
            close.as_slice(),
            "budget {budget}"
        );
        let (reasoning, content) = split(true, &out.text);
        for spec in ["off", "ngram"] {
            let body = json!({"messages": [{"role": "user", "content": "the hen"}], "temperature": 0,
                "max_tokens": 30, "ignore_eos": true, "max_reasoning_tokens": budget, "spec": spec});
            let v = post(&app, CHAT, body).await.json();
            let m = &v["choices"][0]["message"];
            assert_eq!(
                m.get("reasoning_content").and_then(Value::as_str).unwrap_or(""),
                reasoning,
                "budget {budget} {spec}: {v}"
            );
            assert_eq!(m["content"], content.as_str(), "budget {budget} {spec}: {v}");
        }
    }
    // A structured answer: the prelude (here 20 characters) is bounded, then the regex holds.
    let regex = "[ab]{3,6}";
    let control = OutputControl {
        grammar: Some(GrammarSpec::Regex(regex.into())),
        reasoning: Some(ReasoningControl {
            open: "<think>".into(),
            close: "</think>".into(),
            starts_open: true,
            max_tokens: None,
            max_chars: Some(20),
        }),
    };
    let out = direct_with(&mut eng, &control, 60);
    let (reasoning, content) = split(true, &out.text);
    assert!(
        content.len() >= 3 && content.len() <= 6 && content.chars().all(|c| c == 'a' || c == 'b'),
        "{content:?}"
    );
    for spec in ["off", "ngram"] {
        let body = json!({"messages": [{"role": "user", "content": "the hen"}], "temperature": 0,
            "max_tokens": 60, "ignore_eos": true, "think_prelude_chars": 20, "spec": spec,
            "response_format": {"type": "regex", "regex": regex}});
        let v = post(&app, CHAT, body).await.json();
        let m = &v["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], reasoning.as_str(), "{spec}: {v}");
        assert_eq!(m["content"], content.as_str(), "{spec}: {v}");
    }
    // Bad values are 400s naming the field.
    for (body, param) in [
        (json!({"max_reasoning_tokens": -1}), "max_reasoning_tokens"),
        (json!({"think_prelude_chars": "x"}), "think_prelude_chars"),
        (json!({"response_format": {"type": "xml"}}), "response_format"),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "("}}),
            "response_format",
        ),
        (json!({"response_format": "json"}), "response_format"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "has space!", "schema": {}}}}),
            "response_format",
        ),
        // Valid grammars that admit no first token: an empty language, rules that only recurse
        // into each other. They compile; the constraint fails at its first mask.
        (
            json!({"response_format": {"type": "regex", "regex": "[^\\s\\S]"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "lark", "lark": "start: a\na: b\nb: a"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "[^\\s\\S]"}, "stream": true}),
            "response_format",
        ),
    ] {
        let mut b = body.clone();
        b["messages"] = json!([{"role": "user", "content": "hi"}]);
        let r = post(&app, CHAT, b).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text);
        let e = &r.json()["error"];
        assert_eq!(e["param"], param, "{body}: {}", r.text);
        // The client reads what is wrong, not the grammar library's state dump.
        let msg = e["message"].as_str().unwrap_or_default();
        assert!(!msg.contains("<state>"), "{body}: {msg}");
        if body.to_string().contains("S]") || body.to_string().contains("b: a") {
            assert!(msg.contains("admits no first token"), "{body}: {msg}");
        }
    }
}

#[tokio::test]
async fn tool_parser_override() {
    let h = EngineHandle::spawn(load(&tools_model())).with_tool_parser(Some(Dialect::Bracket));
    assert_eq!(h.model().chat.tool_dialect, Dialect::Bracket);
    assert_eq!(h.model().chat.tool_dialect_from, "--tool-parser");
    let h = h.with_tool_parser(None);
    assert_eq!(h.model().chat.tool_dialect, Dialect::Bracket);
}

#[tokio::test]
async fn bad_tool_requests_get_openai_errors() {
    let (app, _h) = serve(&tools_model());
    let user = json!([{"role": "user", "content": "hi"}]);
    let tools = json!([weather_tool()]);
    let call = json!({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}});
    let cases: Vec<(Value, &str)> = vec![
        (json!({"messages": user, "tools": {"a": 1}}), "tools"),
        (json!({"messages": user, "tools": [5]}), "tools[0]"),
        (
            json!({"messages": user, "tools": [{"function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"messages": user, "tools": [{"type": "custom", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"description": "x"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user, "tools": [weather_tool(), weather_tool()]}),
            "tools[1].function.name",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"messages": user, "tools": tools, "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"messages": user, "tools": tools, "tool_choice": 3}),
            "tool_choice",
        ),
        (
            json!({"messages": user, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice",
        ),
        (json!({"messages": user, "tool_choice": "required"}), "tool_choice"),
        (
            json!({"messages": user, "tools": tools, "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
        (
            json!({"messages": [{"role": "bot", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (
            json!({"messages": [{"role": "assistant", "content": null}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c2", "content": "r"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1"}]}),
            "messages[1].content",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": "x"}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]}),
            "messages[0].tool_calls[0].function",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].id",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": 5}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": user, "chat_template_kwargs": [1]}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": user, "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": user, "reasoning_effort": "extreme"}),
            "reasoning_effort",
        ),
        (json!({"messages": user, "reasoning_effort": 1}), "reasoning_effort"),
    ];
    for (body, param) in cases {
        let r = post(&app, CHAT, body.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text);
        assert_error(&r, StatusCode::BAD_REQUEST, Some(param));
    }
    // Accepted: an empty tools array, tool_choice "none"/"auto" without tools, an assistant
    // message with content and calls, arguments given as an object.
    for body in [
        json!({"messages": user, "tools": [], "max_tokens": 1}),
        json!({"messages": user, "tool_choice": "none", "max_tokens": 1}),
        json!({"messages": user, "tool_choice": "auto", "parallel_tool_calls": false, "max_tokens": 1}),
        json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": tools, "max_tokens": 1}),
    ] {
        let r = post(&app, CHAT, body.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "{body}: {}", r.text);
    }
}

#[tokio::test]
async fn a_template_that_rejects_tools_is_a_400() {
    // `raise_exception` in the template (e.g. a template that takes no tools) names the reason.
    let path = model_with_template(
        "specula-server-tiny-notools",
        "{% if tools %}{{ raise_exception('this template takes no tools') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
    );
    let (app, _h) = serve(&path);
    let r = post(
        &app,
        CHAT,
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": [weather_tool()]}),
    )
    .await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, None);
    assert!(
        e["message"].as_str().unwrap().contains("this template takes no tools"),
        "{e}"
    );
}

/// The Anthropic route's `tool_use` / `tool_result` blocks and `tool_choice`: a forced call
/// comes back as a `tool_use` block with its parsed `input` (streamed as `input_json_delta`s
/// that concatenate to it) and `stop_reason` `tool_use`; a follow-up turn with the call and its
/// result renders the prompt the OpenAI route renders for the same turn, and answers the same.
#[tokio::test]
async fn anthropic_tool_use_round_trip() {
    let (app, _h) = serve(&tools_model());
    let unit = unit_tool();
    let f = &unit["function"];
    let tool = json!({"name": f["name"], "input_schema": f["parameters"]});
    let base = json!({"model": MODEL, "max_tokens": 160, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "tool", "name": "set_unit"},
        "messages": [{"role": "user", "content": "the thin then the"}]});
    let v = post(&app, "/v1/messages", base.clone()).await.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let blocks = v["content"].as_array().unwrap();
    let call = blocks
        .iter()
        .find(|b| b["type"] == "tool_use")
        .expect("a tool_use block");
    assert_eq!(call["name"], "set_unit");
    assert!(
        ["celsius", "fahrenheit"].contains(&call["input"]["unit"].as_str().unwrap_or_default()),
        "{v}"
    );
    // The OpenAI route forced the same way gives the same call.
    let chat = post(
        &app,
        CHAT,
        json!({"model": MODEL, "max_tokens": 160, "temperature": 0, "tools": [unit],
        "tool_choice": {"type": "function", "function": {"name": "set_unit"}},
        "messages": [{"role": "user", "content": "the thin then the"}]}),
    )
    .await
    .json();
    let args: Value = serde_json::from_str(
        chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(call["input"], args);
    // Streamed.
    let mut b = base.clone();
    b["stream"] = json!(true);
    let r = post(&app, "/v1/messages", b).await;
    let mut partial = String::new();
    let mut started = false;
    for line in r.text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let d: Value = serde_json::from_str(line).unwrap();
        if d["type"] == "content_block_start" && d["content_block"]["type"] == "tool_use" {
            assert_eq!(d["content_block"]["name"], "set_unit");
            started = true;
        }
        if d["delta"]["type"] == "input_json_delta" {
            partial.push_str(d["delta"]["partial_json"].as_str().unwrap());
        }
        if d["type"] == "message_delta" {
            assert_eq!(d["delta"]["stop_reason"], "tool_use");
        }
    }
    assert!(started, "{}", r.text);
    assert_eq!(serde_json::from_str::<Value>(&partial).unwrap(), call["input"]);
    // The next turn: the call and its result.
    let id = call["id"].as_str().unwrap();
    let next = json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "tools": [tool],
        "messages": [{"role": "user", "content": "the thin then the"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": "set_unit", "input": call["input"]}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "done"}]}]});
    let v = post(&app, "/v1/messages", next).await.json();
    let chat = post(
        &app,
        CHAT,
        json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "tools": [unit],
        "messages": [{"role": "user", "content": "the thin then the"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "set_unit", "arguments": call["input"].to_string()}}]},
            {"role": "tool", "tool_call_id": id, "content": "done"}]}),
    )
    .await
    .json();
    assert_eq!(
        v["usage"]["input_tokens"].as_u64().unwrap() + v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        chat["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(v["content"][0]["text"], chat["choices"][0]["message"]["content"], "{v}");
}

/// The Anthropic route's `thinking`: enabled gives a `thinking` block (the reasoning the OpenAI
/// route returns as `reasoning_content`) before the text, with `budget_tokens` as
/// `max_reasoning_tokens`; disabled renders the template with thinking off.
#[tokio::test]
async fn anthropic_thinking_maps_to_the_reasoning_split() {
    let (app, _h) = serve(&think_model());
    let msgs = json!([{"role": "user", "content": "the hen"}]);
    for (thinking, kwargs) in [
        (
            json!({"type": "enabled", "budget_tokens": 6}),
            json!({"chat_template_kwargs": {"enable_thinking": true}, "max_reasoning_tokens": 6}),
        ),
        (
            json!({"type": "disabled"}),
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
        ),
    ] {
        let v = post(
            &app,
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 30, "temperature": 0,
            "ignore_eos": true, "messages": msgs, "thinking": thinking}),
        )
        .await
        .json();
        let mut c = json!({"model": MODEL, "max_tokens": 30, "temperature": 0, "ignore_eos": true, "messages": msgs});
        for (k, x) in kwargs.as_object().unwrap() {
            c[k] = x.clone();
        }
        let chat = post(&app, CHAT, c).await.json();
        let m = &chat["choices"][0]["message"];
        let reasoning = m.get("reasoning_content").and_then(Value::as_str).unwrap_or("");
        let blocks = v["content"].as_array().unwrap();
        let thought: String = blocks
            .iter()
            .filter(|b| b["type"] == "thinking")
            .map(|b| b["thinking"].as_str().unwrap())
            .collect();
        let text: String = blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .map(|b| b["text"].as_str().unwrap())
            .collect();
        assert_eq!(thought, reasoning, "{thinking}: {v}");
        assert_eq!(text, m["content"].as_str().unwrap_or(""), "{thinking}: {v}");
        if thinking["type"] == "enabled" {
            assert!(!thought.is_empty() && blocks[0]["type"] == "thinking", "{v}");
        }
    }
}
