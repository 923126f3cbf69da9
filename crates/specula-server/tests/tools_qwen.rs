//! Tool calls parsed from a real model's output: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, from the
//! model cache; `specula pull qwen2.5-coder-0.5b-instruct`, which `scripts/test.sh` does).
//!
//! Greedy, this model answers a tool prompt with a bare `{"name": ..., "arguments": ...}` (no
//! `<tool_call>` tags), which the Hermes parser takes as a call because the name is an offered
//! tool. Checked: the round trip (call → tool result → answer), a streamed call whose argument
//! deltas concatenate to the non-streamed arguments, `max_tokens` cutting a call (finish_reason
//! `length`, no call presented as complete), and the same with `spec: "ngram"`.

mod common;

use std::sync::OnceLock;

use axum::http::StatusCode;
use axum::Router;
use common::{post, Reply};
use serde_json::{json, Value};
use specula_engine::{catalog, Engine, LoadOptions};
use specula_server::tools::Dialect;
use specula_server::{router, EngineHandle};

const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
const CHAT: &str = "/v1/chat/completions";

/// One engine worker for the whole test binary (requests queue on it).
fn handle() -> EngineHandle {
    static H: OnceLock<EngineHandle> = OnceLock::new();
    H.get_or_init(|| {
        let entry = catalog::lookup(QWEN).expect("catalog entry");
        let path = specula_engine::cache::models_dir().join(entry.file_name);
        assert!(
            path.exists(),
            "{} is not in the model cache; run `specula pull {QWEN}` (scripts/test.sh does)",
            path.display()
        );
        let engine = Engine::load(&path, QWEN, LoadOptions::default()).expect("load Qwen2.5-Coder-0.5B");
        EngineHandle::spawn_with_queue(engine, 64)
    })
    .clone()
}

fn app() -> Router {
    router(handle())
}

fn calculator() -> Value {
    json!([{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}])
}

fn ask() -> Value {
    json!({"messages": [{"role": "user", "content": "What is 37 * 91?"}], "tools": calculator(),
        "temperature": 0, "max_tokens": 60})
}

/// What a stream said, accumulated as the OpenAI client does.
#[derive(Debug, Default, PartialEq)]
struct Streamed {
    content: String,
    reasoning: String,
    /// (id, name, arguments) per call index.
    calls: Vec<(String, String, String)>,
    finish_reason: String,
}

fn collect(r: &Reply) -> Streamed {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.text);
    let mut s = Streamed::default();
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let Some(choice) = c["choices"].get(0) else { continue };
        let d = &choice["delta"];
        s.content.push_str(d["content"].as_str().unwrap_or(""));
        s.reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().expect("index") as usize;
            if let Some(id) = tc["id"].as_str() {
                assert_eq!(i, s.calls.len(), "calls start in order: {e}");
                assert_eq!(tc["type"], "function", "{e}");
                let name = tc["function"]["name"].as_str().expect("the first chunk names the call");
                s.calls.push((id.to_string(), name.to_string(), String::new()));
            } else {
                assert!(tc["function"].get("name").is_none(), "the name comes once: {e}");
            }
            let call = s.calls.get_mut(i).expect("arguments of a started call");
            call.2.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            s.finish_reason = f.to_string();
        }
    }
    s
}

/// The non-streamed message with the call ids blanked (they differ per request).
fn without_ids(mut message: Value) -> Value {
    for c in message["tool_calls"].as_array_mut().into_iter().flatten() {
        assert!(c["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{c}");
        c["id"] = json!("");
    }
    message
}

#[tokio::test]
async fn qwen_tool_round_trip() {
    let app = app();
    assert_eq!(handle().model().chat.tool_dialect, Dialect::Hermes);
    let r = post(&app, CHAT, ask()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let m = &choice["message"];
    assert_eq!(m["content"], Value::Null, "{v}");
    let calls = m["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "calculator");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"expression": "37 * 91"}));

    // The client runs the tool and sends the result back. (This small model keeps calling the
    // tool when it still sees the tools; an agent's last turn with tool_choice "none" gets the
    // answer.)
    let mut messages = ask()["messages"].as_array().unwrap().clone();
    messages.push(m.clone());
    messages.push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "3367"}));
    let body = json!({"messages": messages, "tools": calculator(), "tool_choice": "none", "temperature": 0,
        "max_tokens": 60});
    let r = post(&app, CHAT, body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    let answer = &v["choices"][0]["message"];
    assert!(answer.get("tool_calls").is_none(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(answer["content"].as_str().is_some_and(|c| c.contains("3367")), "{v}");
}

#[tokio::test]
async fn qwen_streamed_call_equals_the_non_streamed_call_with_and_without_speculation() {
    let app = app();
    let plain = post(&app, CHAT, ask()).await.json();
    let message = without_ids(plain["choices"][0]["message"].clone());
    let want_args = message["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap()
        .to_string();
    for spec in [
        json!("off"),
        json!("ngram"),
        json!({"mode": "ngram", "draft_max": 8, "adaptive": false}),
    ] {
        let mut body = ask();
        body["spec"] = spec.clone();
        let v = post(&app, CHAT, body.clone()).await.json();
        assert_eq!(without_ids(v["choices"][0]["message"].clone()), message, "{spec}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{spec}");
        assert_eq!(v["usage"], plain["usage"], "{spec}");
        if spec != json!("off") && handle().model().batch_invariant {
            // Really speculated (drafts verified in blocks), not decoded AR.
            assert_eq!(v["spec_stats"]["decode_path"], "ngram", "{v}");
        }

        body["stream"] = json!(true);
        let s = collect(&post(&app, CHAT, body).await);
        assert_eq!(s.finish_reason, "tool_calls", "{spec}");
        assert_eq!(s.content, "", "{spec}: nothing of the call is sent as content");
        assert_eq!(s.calls.len(), 1, "{spec}: {s:?}");
        assert_eq!(s.calls[0].1, "calculator");
        assert!(s.calls[0].0.starts_with("call_"));
        assert_eq!(s.calls[0].2, want_args, "{spec}");
        let a: Value = serde_json::from_str(&s.calls[0].2).unwrap();
        let b: Value = serde_json::from_str(&want_args).unwrap();
        assert_eq!(a, b);
    }
}

#[tokio::test]
async fn qwen_max_tokens_cutting_a_call_is_length_and_no_call() {
    let app = app();
    // 12 tokens end inside the arguments; 3 before the name is complete.
    for (max_tokens, started) in [(12, true), (3, false)] {
        let mut outputs = Vec::new();
        for spec in ["off", "ngram"] {
            let mut body = ask();
            body["max_tokens"] = json!(max_tokens);
            body["spec"] = json!(spec);
            let v = post(&app, CHAT, body.clone()).await.json();
            let choice = &v["choices"][0];
            assert_eq!(choice["finish_reason"], "length", "{v}");
            assert!(choice["message"].get("tool_calls").is_none(), "{v}");
            // The cut call's text is the content (nothing generated is lost).
            let content = choice["message"]["content"].as_str().unwrap().to_string();
            assert!(content.starts_with("{\"name\""), "{v}");
            assert_eq!(v["usage"]["completion_tokens"], max_tokens);

            body["stream"] = json!(true);
            let s = collect(&post(&app, CHAT, body).await);
            assert_eq!(s.finish_reason, "length", "{spec}");
            if started {
                // The call's start and argument prefix were streamed as tool_calls (never as
                // content); the arguments are not a complete JSON value.
                assert_eq!(s.content, "", "{s:?}");
                assert_eq!(s.calls.len(), 1, "{s:?}");
                assert!(serde_json::from_str::<Value>(&s.calls[0].2).is_err(), "{s:?}");
                assert_eq!(
                    format!("{{\"name\": \"calculator\", \"arguments\": {}", s.calls[0].2),
                    content
                );
            } else {
                // Cut before the call started: held back, then sent as content at the end.
                assert!(s.calls.is_empty(), "{s:?}");
                assert_eq!(s.content, content);
            }
            outputs.push((content, s));
        }
        assert_eq!(outputs[0].0, outputs[1].0, "spec off and ngram give the same output");
        assert_eq!(outputs[0].1.content, outputs[1].1.content);
        assert_eq!(outputs[0].1.calls.len(), outputs[1].1.calls.len());
    }
}
