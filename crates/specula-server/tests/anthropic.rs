//! Anthropic's Messages API (`/v1/messages`): the same prompt, engine and emit step as the
//! OpenAI chat route, so greedy output is the chat route's bytes (streamed or not, with or
//! without speculation); Anthropic's response, stream events, stop reasons, usage and error
//! shapes. Tool calls and thinking through this route are in `chat_tools.rs`.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

fn body() -> Value {
    json!({"model": MODEL, "system": "You help.", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "the then the thin the then the then"},
            {"role": "assistant", "content": [{"type": "text", "text": "the thin"}]},
            {"role": "user", "content": [{"type": "text", "text": "then "}, {"type": "text", "text": "the"}]}]})
}

/// The OpenAI chat request `body()` means.
fn chat_body() -> Value {
    json!({"model": MODEL, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "You help."},
            {"role": "user", "content": "the then the thin the then the then"},
            {"role": "assistant", "content": "the thin"},
            {"role": "user", "content": "then the"}]})
}

/// The events of an Anthropic stream: (event name, data).
fn events(r: &Reply) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in r.text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(d).expect("event data is JSON")));
        }
    }
    out
}

/// The text the `text_delta` events carry.
fn streamed_text(ev: &[(String, Value)]) -> String {
    ev.iter()
        .filter(|(_, d)| d["delta"]["type"] == "text_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn messages_equal_the_chat_route_streamed_and_speculated() {
    let (app, _h) = app();
    let chat = post(&app, CHAT, chat_body()).await.json();
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!want.is_empty());
    for spec in [json!("off"), json!("ngram"), json!({"mode": "ngram", "draft_max": 6})] {
        let mut b = body();
        b["spec"] = spec.clone();
        let r = post(&app, MESSAGES, b.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let v = r.json();
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert_eq!(v["model"], MODEL);
        assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
        assert_eq!(v["content"], json!([{"type": "text", "text": want}]), "{spec}");
        assert_eq!(v["stop_reason"], "max_tokens");
        assert_eq!(v["stop_sequence"], Value::Null);
        let u = &v["usage"];
        assert_eq!(
            u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
            chat["usage"]["prompt_tokens"].as_u64().unwrap()
        );
        assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"]);
        assert!(v["spec_stats"].is_object());
        let rid = r.headers["request-id"].to_str().unwrap();
        assert!(
            rid.starts_with("req_") && r.headers["x-request-id"] == rid,
            "{:?}",
            r.headers
        );

        b["stream"] = json!(true);
        let r = post(&app, MESSAGES, b).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        assert!(r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let ev = events(&r);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            &names[..3],
            ["message_start", "ping", "content_block_start"],
            "{names:?}"
        );
        assert_eq!(
            &names[names.len() - 3..],
            ["content_block_stop", "message_delta", "message_stop"],
            "{names:?}"
        );
        for (n, d) in &ev {
            assert_eq!(d["type"], n.as_str(), "each event's data names its event");
        }
        assert_eq!(
            ev[0].1["message"]["usage"]["input_tokens"],
            chat["usage"]["prompt_tokens"]
        );
        assert_eq!(ev[2].1["content_block"], json!({"type": "text", "text": ""}));
        assert_eq!(streamed_text(&ev), want, "{spec}");
        let delta = &ev[ev.len() - 2].1;
        assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
        assert_eq!(delta["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
    }
}

#[tokio::test]
async fn stop_sequences_and_end_turn() {
    let (app, _h) = app();
    let full = post(&app, MESSAGES, body()).await.json();
    let text = full["content"][0]["text"].as_str().unwrap().to_string();
    // A stop string taken from the middle of the output.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut b = body();
    b["stop_sequences"] = json!(["never-appears", stop]);
    let v = post(&app, MESSAGES, b.clone()).await.json();
    let mut c = chat_body();
    c["stop"] = json!(["never-appears", stop]);
    let chat = post(&app, CHAT, c).await.json();
    assert_eq!(v["content"][0]["text"], chat["choices"][0]["message"]["content"], "{v}");
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop.as_str(), "{v}");
    b["stream"] = json!(true);
    let ev = events(&post(&app, MESSAGES, b).await);
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta["delta"]["stop_sequence"], stop.as_str());
    assert_eq!(
        streamed_text(&ev),
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

#[tokio::test]
async fn count_tokens_counts_the_rendered_prompt() {
    let (app, _h) = app();
    let chat = post(&app, CHAT, chat_body()).await.json();
    let mut b = body();
    b.as_object_mut().unwrap().remove("max_tokens");
    let r = post(&app, "/v1/messages/count_tokens", b).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json(), json!({"input_tokens": chat["usage"]["prompt_tokens"]}));
}

/// Errors in Anthropic's shape, the status chosen as on the OpenAI routes: bad fields, a missing
/// `max_tokens`, unsupported blocks and tools, another model, bad JSON, unknown routes.
#[tokio::test]
async fn errors_use_anthropics_shape() {
    let (app, _h) = app();
    let with = |k: &str, v: Value| {
        let mut b = body();
        b[k] = v;
        b
    };
    let mut no_max = body();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let cases = [
        (no_max, StatusCode::BAD_REQUEST, "invalid_request_error", "max_tokens"),
        (
            with("cache_prompt", json!(true)),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "cache_prompt",
        ),
        (
            with("max_tokens", json!(0)),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            with("temperature", json!("hot")),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "temperature",
        ),
        (
            with("messages", json!([{"role": "system", "content": "x"}])),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "role",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "image",
        ),
        (
            with("tools", json!([{"type": "web_search_20250305", "name": "web_search"}])),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "server tools",
        ),
        (
            with("stop_sequences", json!("x")),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "stop_sequences",
        ),
        (
            with("thinking", json!({"type": "sometimes"})),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "thinking",
        ),
        (
            with("model", json!("claude-other")),
            StatusCode::NOT_FOUND,
            "not_found_error",
            "claude-other",
        ),
    ];
    for (b, status, kind, says) in cases {
        for stream in [false, true] {
            let mut b = b.clone();
            b["stream"] = json!(stream);
            let r = post(&app, MESSAGES, b.clone()).await;
            assert_eq!(r.status, status, "{b}: {}", r.text);
            let v = r.json();
            assert_eq!(v["type"], "error", "{}", r.text);
            assert_eq!(v["error"]["type"], kind, "{}", r.text);
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.contains(says), "{b}: {m}");
        }
    }
    let r = post_raw(&app, MESSAGES, "{not json").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error", "{}", r.text);
    let r = get(&app, MESSAGES).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.json()["type"], "error", "{}", r.text);
    // Bookkeeping fields of Anthropic's clients are accepted.
    let mut b = body();
    b["metadata"] = json!({"user_id": "u-1"});
    b["service_tier"] = json!("auto");
    assert_eq!(post(&app, MESSAGES, b).await.status, StatusCode::OK);
}
