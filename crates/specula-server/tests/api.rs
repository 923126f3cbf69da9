//! The HTTP API over the tiny random model, through the router (`tower::ServiceExt::oneshot`).

mod common;

use std::time::Duration;

use axum::http::{header, StatusCode};
use common::*;
use serde_json::{json, Value};
use specula_engine::speculative::SpecOptions;
use specula_engine::{ChatMessage, SamplingParams};

fn messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "the thin thing in the hen"),
    ]
}

fn messages_json() -> Value {
    serde_json::to_value(messages()).unwrap()
}

#[tokio::test]
async fn chat_non_stream_shape_and_usage() {
    let (app, _h) = app();
    let mut eng = engine();
    let prompt = eng.chat_prompt_tokens(&messages()).unwrap();
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages_json(), "temperature": 0, "max_tokens": 12, "user": "x", "tools": []}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    let c = &choices[0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert_eq!(c["logprobs"], Value::Null);

    let want = direct(&mut eng, prompt.clone(), SamplingParams::greedy(), 12, None);
    assert_eq!(c["finish_reason"], want.finish_reason.as_str());
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], prompt.len());
    assert_eq!(u["completion_tokens"], want.stats.completion_tokens);
    assert_eq!(u["total_tokens"], prompt.len() + want.stats.completion_tokens);
}

#[tokio::test]
async fn chat_greedy_equals_engine_generate() {
    let (app, _h) = app();
    let mut eng = engine();
    for max_tokens in [1usize, 7, 40] {
        let r = post(
            &app,
            "/v1/chat/completions",
            json!({"messages": messages_json(), "temperature": 0.0, "max_completion_tokens": max_tokens}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let v = r.json();
        let want = direct_chat(&mut eng, SamplingParams::greedy(), max_tokens, None);
        let got = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(got.as_bytes(), want.text.as_bytes(), "max_tokens {max_tokens}");
        assert_eq!(v["choices"][0]["finish_reason"], want.finish_reason.as_str());
        assert_eq!(v["usage"]["completion_tokens"], want.stats.completion_tokens);
    }
}

#[tokio::test]
async fn chat_seeded_sampling_equals_engine_generate() {
    let (app, _h) = app();
    let mut eng = engine();
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({
            "messages": messages_json(), "max_tokens": 30, "seed": 1234,
            "temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
            "logit_bias": {"200": -100, "13": 2.5},
        }),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let sampling = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.01,
        repetition_penalty: 1.1,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        seed: Some(1234),
        logit_bias: vec![(13, 2.5), (200, -100.0)],
    };
    let want = direct_chat(&mut eng, sampling, 30, None);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"].as_str().unwrap(),
        want.text
    );
}

#[tokio::test]
async fn chat_stream_matches_non_stream() {
    let (app, _h) = app();
    let body = json!({"messages": messages_json(), "temperature": 0, "max_tokens": 40, "stop": ["zz"]});
    let full = post(&app, "/v1/chat/completions", body.clone()).await.json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let r = post(&app, "/v1/chat/completions", sbody).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.text);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.len() >= 3, "{}", r.text);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], MODEL);
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    let (finish_chunk, deltas) = rest.split_last().unwrap();
    let text: String = deltas[1..]
        .iter()
        .map(|c| {
            assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
            c["choices"][0]["delta"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(finish_chunk["choices"][0]["delta"], json!({}));
    assert_eq!(
        finish_chunk["choices"][0]["finish_reason"],
        full["choices"][0]["finish_reason"]
    );
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], full["usage"]);

    // Without include_usage there is no usage chunk.
    let mut sbody = body;
    sbody["stream"] = json!(true);
    let events = post(&app, "/v1/chat/completions", sbody).await.sse_data();
    let last_chunk: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        last_chunk["choices"][0]["finish_reason"],
        full["choices"][0]["finish_reason"]
    );
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
}

#[tokio::test]
async fn chat_content_parts_are_joined() {
    let (app, _h) = app();
    let eng = engine();
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"max_tokens": 1, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "the hen"}, {"type": "text", "text": "in the thin"}]}]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let want = eng
        .chat_prompt_tokens(&[
            ChatMessage::new("system", "be brief"),
            ChatMessage::new("user", "the hen\nin the thin"),
        ])
        .unwrap();
    assert_eq!(r.json()["usage"]["prompt_tokens"], want.len());
}

#[tokio::test]
async fn chat_logprobs_openai_format() {
    let (app, _h) = app();
    let mut eng = engine();
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": messages_json(), "temperature": 0, "max_tokens": 8, "logprobs": true, "top_logprobs": 3}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    let want = direct_chat(&mut eng, SamplingParams::greedy(), 8, Some(3));
    let want_lps = want.logprobs.unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), want_lps.len());
    assert_eq!(content.len(), want.stats.completion_tokens);
    for (c, w) in content.iter().zip(&want_lps) {
        assert_eq!(c["token"], w.token.as_str());
        assert!((c["logprob"].as_f64().unwrap() - w.logprob as f64).abs() < 1e-5);
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy picks the most likely token.
        assert_eq!(top[0]["token"], c["token"]);
        assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
        let bytes: Vec<u8> = c["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        if !w.token.contains('\u{FFFD}') {
            assert_eq!(bytes, w.token.as_bytes());
        } else {
            assert_eq!(bytes.len(), 1, "a byte token has one byte");
        }
    }

    // Streaming carries the same logprobs, spread over the chunks.
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": messages_json(), "temperature": 0, "max_tokens": 8, "logprobs": true, "top_logprobs": 3, "stream": true}),
    )
    .await;
    let streamed: Vec<Value> = r
        .sse_data()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);
}

#[tokio::test]
async fn completions_match_engine_generate() {
    let (app, _h) = app();
    let mut eng = engine();
    let prompt = "the thin hen";
    let tokens = eng.tokenize(prompt).unwrap();
    let want = direct(&mut eng, tokens.clone(), SamplingParams::greedy(), 10, None);
    for p in [json!(prompt), json!([prompt]), json!(tokens), json!([tokens])] {
        let r = post(
            &app,
            "/v1/completions",
            json!({"model": MODEL, "prompt": p, "max_tokens": 10, "temperature": 0}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        let v = r.json();
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["choices"][0]["index"], 0);
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want.text, "prompt {p}");
        assert_eq!(v["choices"][0]["finish_reason"], want.finish_reason.as_str());
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert_eq!(v["usage"]["prompt_tokens"], tokens.len());
        assert_eq!(v["usage"]["completion_tokens"], want.stats.completion_tokens);
        assert_eq!(v["usage"]["total_tokens"], tokens.len() + want.stats.completion_tokens);
    }
}

/// A `/v1/completions` prompt string is text: a control-token string in it (`<|im_end|>`) is
/// tokenized as the characters it spells, unless the request sets `parse_special: true`; a
/// prompt without such strings gives the same tokens either way.
#[tokio::test]
async fn completion_prompt_strings_are_text_unless_parse_special() {
    let (app, _h) = app();
    let eng = engine();
    let special = eng
        .tokenizer()
        .token_to_id("<|im_end|>")
        .expect("the tiny vocabulary's <|im_end|>");
    let prompt = "the thin<|im_end|> hen";
    let count = |v: &Value| v["usage"]["prompt_tokens"].as_u64().expect("usage");
    let ask = |parse: Option<bool>, p: &str| {
        let mut b = json!({"model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0});
        if let Some(x) = parse {
            b["parse_special"] = x.into();
        }
        b
    };
    let as_text = post(&app, "/v1/completions", ask(None, prompt)).await.json();
    let parsed = post(&app, "/v1/completions", ask(Some(true), prompt)).await.json();
    let with_special = eng.tokenize(prompt).unwrap();
    assert!(with_special.contains(&special));
    assert_eq!(count(&parsed), with_special.len() as u64);
    // As text: the 11 characters of `<|im_end|>` are byte tokens of the tiny vocabulary.
    assert_eq!(
        count(&as_text),
        with_special.len() as u64 - 1 + "<|im_end|>".len() as u64
    );
    // Without control-token text the two agree.
    let plain = "the thin hen";
    let a = post(&app, "/v1/completions", ask(None, plain)).await.json();
    let b = post(&app, "/v1/completions", ask(Some(true), plain)).await.json();
    assert_eq!(
        (count(&a), a["choices"][0]["text"].clone()),
        (count(&b), b["choices"][0]["text"].clone())
    );
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": plain, "parse_special": "yes"}),
    )
    .await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("parse_special"));
}

#[tokio::test]
async fn completions_default_max_tokens_is_16() {
    let (app, _h) = app();
    let r = post(
        &app,
        "/v1/completions",
        json!({"prompt": "the hen", "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Near the end of the context the default shrinks to the room left.
    let tokens: Vec<u32> = (0..250).map(|i| 97 + (i % 20)).collect();
    let r = post(&app, "/v1/completions", json!({"prompt": tokens, "ignore_eos": true})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn completions_stream_and_logprobs() {
    let (app, _h) = app();
    let body = json!({"prompt": "in the thin", "max_tokens": 20, "temperature": 0, "logprobs": 2});
    let full = post(&app, "/v1/completions", body.clone()).await.json();
    let n = full["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let lp = &full["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), n);
    assert!(tops.iter().all(|t| (1..=2).contains(&t.as_object().unwrap().len())));
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(offsets.first(), Some(&0));
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));

    let mut sbody = body;
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let r = post(&app, "/v1/completions", sbody).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let events = r.sse_data();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let (usage, rest) = chunks.split_last().unwrap();
    let text: String = rest
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(
        rest.last().unwrap()["choices"][0]["finish_reason"],
        full["choices"][0]["finish_reason"]
    );
    assert_eq!(usage["usage"], full["usage"]);
    let stream_tokens: Vec<Value> = rest
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&stream_tokens, lp["tokens"].as_array().unwrap());
    let stream_offsets: Vec<Value> = rest
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["text_offset"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&stream_offsets, lp["text_offset"].as_array().unwrap());
}

/// (path, body, status, param, code)
type ErrorCase<'a> = (&'a str, Value, StatusCode, Option<&'a str>, Option<&'a str>);

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let (app, _h) = app();
    let chat = "/v1/chat/completions";
    let msgs = messages_json();
    let long_text = "the thin hen ".repeat(200);
    let long_ids: Vec<u32> = vec![97; 300];
    let cases: Vec<ErrorCase> = vec![
        (chat, json!([1, 2]), StatusCode::BAD_REQUEST, None, None),
        (
            chat,
            json!({"model": MODEL}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            Some("missing_required_parameter"),
        ),
        (
            chat,
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            Some("empty_array"),
        ),
        (
            chat,
            json!({"messages": "hi"}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            Some("invalid_type"),
        ),
        (
            chat,
            json!({"messages": [{"content": "hi"}]}),
            StatusCode::BAD_REQUEST,
            Some("messages[0].role"),
            None,
        ),
        (
            chat,
            json!({"messages": [{"role": "user", "content": 5}]}),
            StatusCode::BAD_REQUEST,
            Some("messages[0].content"),
            None,
        ),
        (
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            StatusCode::BAD_REQUEST,
            Some("messages[0].content[0].type"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "model": "gpt-4o"}),
            StatusCode::NOT_FOUND,
            Some("model"),
            Some("model_not_found"),
        ),
        (
            chat,
            json!({"messages": msgs, "model": 3}),
            StatusCode::BAD_REQUEST,
            Some("model"),
            Some("invalid_type"),
        ),
        (
            chat,
            json!({"messages": msgs, "temperature": "hot"}),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            Some("invalid_type"),
        ),
        (
            chat,
            json!({"messages": msgs, "temperature": -0.5}),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "temperature": 1e308}),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "top_p": 1.5}),
            StatusCode::BAD_REQUEST,
            Some("top_p"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "top_p": 0}),
            StatusCode::BAD_REQUEST,
            Some("top_p"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "presence_penalty": 3}),
            StatusCode::BAD_REQUEST,
            Some("presence_penalty"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "n": 2}),
            StatusCode::BAD_REQUEST,
            Some("n"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "top_logprobs": 2}),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "max_tokens": 0}),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "max_tokens": -3}),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "max_tokens": 1000}),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            Some("context_length_exceeded"),
        ),
        (
            chat,
            json!({"messages": [{"role": "user", "content": long_text}]}),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            chat,
            json!({"messages": msgs, "stop": 5}),
            StatusCode::BAD_REQUEST,
            Some("stop"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "stream": "yes"}),
            StatusCode::BAD_REQUEST,
            Some("stream"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "seed": "x"}),
            StatusCode::BAD_REQUEST,
            Some("seed"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": [1, 2]}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"hello": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {" 5": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"+5": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"05": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"-1": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"": 1}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"5": "x"}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            None,
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"5": 150}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"5": 1, "05": 2}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            Some("invalid_value"),
        ),
        (
            chat,
            json!({"messages": msgs, "logit_bias": {"99999999": -100}}),
            StatusCode::BAD_REQUEST,
            Some("logit_bias"),
            None,
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            Some("missing_required_parameter"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, "a"]}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999]}),
            StatusCode::BAD_REQUEST,
            None,
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": long_ids}),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            Some("context_length_exceeded"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "echo": true}),
            StatusCode::BAD_REQUEST,
            Some("echo"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logprobs": 21}),
            StatusCode::BAD_REQUEST,
            Some("logprobs"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logprobs": true}),
            StatusCode::BAD_REQUEST,
            Some("logprobs"),
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "model": "nope"}),
            StatusCode::NOT_FOUND,
            Some("model"),
            Some("model_not_found"),
        ),
    ];
    for (path, body, status, param, code) in cases {
        let r = post(&app, path, body.clone()).await;
        let e = assert_error(&r, status, param);
        if let Some(code) = code {
            assert_eq!(e["code"], code, "{path} {body}: {}", r.text);
        }
    }
    // The context-length messages come from the engine and say what is wrong.
    let r = post(&app, chat, json!({"messages": msgs, "max_tokens": 1000})).await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("max_tokens"));
    assert!(
        e["message"].as_str().unwrap().contains("context window of 256 tokens"),
        "{}",
        r.text
    );
    // Named as the request spelt it; max_completion_tokens wins over max_tokens.
    for body in [
        json!({"messages": msgs, "max_completion_tokens": 1000}),
        json!({"messages": msgs, "max_completion_tokens": 1000, "max_tokens": 5}),
    ] {
        let r = post(&app, chat, body).await;
        let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("max_completion_tokens"));
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("+ max_completion_tokens (1000)"),
            "{}",
            r.text
        );
    }

    // Malformed JSON, and a body without a JSON content type.
    let r = post_raw(&app, chat, "{\"messages\": [").await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, None);
    assert!(e["message"].as_str().unwrap().contains("JSON"), "{}", r.text);
    assert_eq!(e["code"], "invalid_json");
    let req = axum::http::Request::post(chat)
        .body(axum::body::Body::from(json!({"messages": msgs}).to_string()))
        .unwrap();
    let r = send(&app, req).await;
    let e = assert_error(&r, StatusCode::UNSUPPORTED_MEDIA_TYPE, None);
    assert_eq!(e["code"], "unsupported_media_type");
    let r = post_raw(&app, chat, "[1, 2]").await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, None);
    assert_eq!(e["code"], "invalid_type");
    // A body over the server's limit.
    let big = format!(
        "{{\"messages\": [], \"x\": \"{}\"}}",
        "a".repeat(specula_server::MAX_BODY_BYTES)
    );
    let r = post_raw(&app, chat, &big).await;
    let e = assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, None);
    assert_eq!(e["code"], "request_too_large");

    // Unknown routes and wrong methods.
    let r = get(&app, "/v1/nothing").await;
    let e = assert_error(&r, StatusCode::NOT_FOUND, None);
    assert!(e["message"].as_str().unwrap().contains("/v1/nothing"));
    let r = get(&app, chat).await;
    assert_error(&r, StatusCode::METHOD_NOT_ALLOWED, None);
    // The model's own paths under the /v1/models/{id} route: the other method is a 405 that
    // says which one is allowed, not a 404 for a model named "tiny/speculative".
    let r = get(&app, &format!("/v1/models/{MODEL}/speculative")).await;
    let e = assert_error(&r, StatusCode::METHOD_NOT_ALLOWED, None);
    assert_eq!(e["code"], "method_not_allowed");
    assert_eq!(r.headers[header::ALLOW], "POST");
    let r = post(&app, &format!("/v1/models/{MODEL}"), json!({})).await;
    assert_error(&r, StatusCode::METHOD_NOT_ALLOWED, None);
    assert_eq!(r.headers[header::ALLOW], "GET");
    let r = get(&app, "/v1/models/other/speculative").await;
    assert_error(&r, StatusCode::NOT_FOUND, Some("model"));

    // Errors cost no generation.
    let m = get(&app, "/metrics").await.text;
    assert!(m.contains("specula_completion_tokens_total 0"), "{m}");
}

/// Strict requests: a top-level field the endpoint does not read is a 400 `unknown_parameter`
/// naming it (a huge name is cut); OpenAI fields this server does not implement are
/// `unsupported_parameter`; the SDKs' bookkeeping fields are accepted and change nothing.
#[tokio::test]
async fn unknown_fields_are_refused_and_bookkeeping_fields_ignored() {
    let (app, _h) = app();
    let chat = "/v1/chat/completions";
    let completions = "/v1/completions";
    let bodies = [
        (
            chat,
            json!({"messages": messages_json(), "max_tokens": 4, "temperature": 0}),
        ),
        (
            completions,
            json!({"prompt": "the hen", "max_tokens": 4, "temperature": 0}),
        ),
    ];
    let huge = "k".repeat(20 << 20);
    for (path, base) in &bodies {
        let plain = post(&app, path, base.clone()).await;
        assert_eq!(plain.status, StatusCode::OK, "{}", plain.text);
        let text = |r: &Reply| {
            let v: Value = serde_json::from_str(&r.text).unwrap();
            v["choices"][0]
                .get("message")
                .map_or(v["choices"][0]["text"].clone(), |m| m["content"].clone())
        };
        for (field, value, code) in [
            ("cache_prompt", json!(true), "unknown_parameter"),
            ("n_predict", json!(8), "unknown_parameter"),
            ("Temperature", json!(0.5), "unknown_parameter"),
            ("x", json!(null), "unknown_parameter"),
            ("functions", json!([{"name": "f"}]), "unsupported_parameter"),
            ("audio", json!({"voice": "alloy"}), "unsupported_parameter"),
            ("modalities", json!(["text", "audio"]), "unsupported_parameter"),
        ] {
            let mut body = base.clone();
            body[field] = value;
            let r = post(&app, path, body.clone()).await;
            let e = assert_error(&r, StatusCode::BAD_REQUEST, Some(field));
            assert_eq!(e["code"], code, "{path} {field}: {}", r.text);
            body["stream"] = json!(true);
            let r = post(&app, path, body).await;
            assert_error(&r, StatusCode::BAD_REQUEST, Some(field));
        }
        let mut body = base.clone();
        body[huge.as_str()] = json!(1);
        let r = post_raw(&app, path, &body.to_string()).await;
        let e = assert_error(&r, StatusCode::BAD_REQUEST, None);
        assert_eq!(e["code"], "unknown_parameter");
        assert!(
            r.text.len() < 1000,
            "the error quotes the whole name: {} bytes",
            r.text.len()
        );
        for (field, value) in [
            ("user", json!("user-1234")),
            ("store", json!(false)),
            ("metadata", json!({"run": "7"})),
            ("service_tier", json!("auto")),
            ("prompt_cache_key", json!("k")),
            ("safety_identifier", json!("s")),
            ("modalities", json!(["text"])),
            ("functions", json!(null)),
        ] {
            let mut body = base.clone();
            body[field] = value;
            let r = post(&app, path, body).await;
            assert_eq!(r.status, StatusCode::OK, "{path} {field}: {}", r.text);
            assert_eq!(text(&r), text(&plain), "{path} {field}");
        }
    }
}

/// Grammars compile in the request's handler, not on the engine's thread: with the engine busy,
/// a bad grammar is refused at once and a good one is compiled before the request queues.
#[tokio::test]
async fn grammars_compile_off_the_engine_thread() {
    let (app, h) = app();
    let hold = h.hold().unwrap();
    let mut body = json!({"messages": messages_json(), "max_tokens": 4, "temperature": 0,
        "response_format": {"type": "regex", "regex": "(ab"}});
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        post(&app, "/v1/chat/completions", body.clone()),
    )
    .await
    .expect("a bad grammar is refused while the engine is busy");
    let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("response_format"));
    assert!(e["message"].as_str().unwrap().contains("invalid regex"), "{}", r.text);
    body["response_format"] = json!({"type": "regex", "regex": "(ab)+"});
    let a = app.clone();
    let pending = tokio::spawn(async move { post(&a, "/v1/chat/completions", body).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pending.is_finished(), "a good grammar waits for the engine");
    drop(hold);
    let r = pending.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.starts_with("ab") && text.len() <= 8, "{text}");
}

#[tokio::test]
async fn queue_full_answers_429() {
    // max_queue 0: one request may run, none may wait.
    let (app, h) = app_with_queue(0);
    let hold = h.hold().unwrap();
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": messages_json(), "max_tokens": 2}),
    )
    .await;
    let e = assert_error(&r, StatusCode::TOO_MANY_REQUESTS, None);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(e["code"], "queue_full");
    drop(hold);
    wait_for(|| h.pending() == 0).await;
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": messages_json(), "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);

    // max_queue 1: one waits; the next is refused; the waiting one completes once the engine frees.
    let (app, h) = app_with_queue(1);
    let hold = h.hold().unwrap();
    wait_for(|| h.waiting() == 0).await; // the worker took the hold
    let app2 = app.clone();
    let waiting = tokio::spawn(async move {
        post(
            &app2,
            "/v1/completions",
            json!({"prompt": "the hen", "max_tokens": 3, "temperature": 0}),
        )
        .await
    });
    wait_for(|| h.pending() == 2).await;
    let m = get(&app, "/metrics").await.text;
    assert!(m.contains("specula_queue_depth 1"), "{m}");
    assert!(m.contains("specula_requests_running 1"), "{m}");
    let r = post(&app, "/v1/completions", json!({"prompt": "the hen", "max_tokens": 3})).await;
    assert_error(&r, StatusCode::TOO_MANY_REQUESTS, None);
    drop(hold);
    let r = waiting.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    let m = get(&app, "/metrics").await.text;
    assert!(m.contains("specula_queue_depth 0"), "{m}");
    assert!(
        m.contains(r#"specula_requests_total{endpoint="/v1/completions",status="429"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"specula_requests_total{endpoint="/v1/completions",status="200"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn client_gone_while_queued_is_skipped() {
    let (app, h) = app_with_queue(4);
    let hold = h.hold().unwrap();
    let app2 = app.clone();
    let task =
        tokio::spawn(
            async move { post(&app2, "/v1/completions", json!({"prompt": "the hen", "max_tokens": 5})).await },
        );
    wait_for(|| h.pending() == 2).await;
    task.abort();
    let _ = task.await;
    drop(hold);
    wait_for(|| h.pending() == 0).await;
    let m = get(&app, "/metrics").await.text;
    assert!(m.contains("specula_completion_tokens_total 0"), "{m}");
    assert!(m.contains("specula_prompt_tokens_total 0"), "{m}");
}

#[tokio::test]
async fn models_health_metrics() {
    let (app, _h) = app();
    let r = get(&app, "/v1/models").await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["id"], MODEL);
    assert_eq!(data[0]["object"], "model");
    assert_eq!(data[0]["owned_by"], "specula");
    assert_eq!(data[0]["context_length"], CONTEXT);
    assert!(data[0]["created"].as_u64().unwrap() > 1_600_000_000);

    let r = get(&app, "/v1/models/tiny").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["id"], MODEL);
    let r = get(&app, "/v1/models/other").await;
    let e = assert_error(&r, StatusCode::NOT_FOUND, None);
    assert_eq!(e["code"], "model_not_found");

    let r = get(&app, "/health").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"status": "ok"}));

    let mut eng = engine();
    let prompt = eng.chat_prompt_tokens(&messages()).unwrap();
    let want = direct(&mut eng, prompt.clone(), SamplingParams::greedy(), 5, None);
    let r = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": messages_json(), "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = post(&app, "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    let r = get(&app, "/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers["content-type"].to_str().unwrap().starts_with("text/plain"));
    let m = r.text;
    for line in [
        r#"specula_requests_total{endpoint="/v1/chat/completions",status="200"} 1"#.to_string(),
        r#"specula_requests_total{endpoint="/v1/chat/completions",status="400"} 1"#.to_string(),
        r#"specula_requests_total{endpoint="/v1/models",status="200"} 1"#.to_string(),
        r#"specula_requests_total{endpoint="/health",status="200"} 1"#.to_string(),
        format!("specula_prompt_tokens_total {}", prompt.len()),
        format!("specula_completion_tokens_total {}", want.stats.completion_tokens),
        "specula_queue_depth 0".to_string(),
        "specula_generation_seconds_count 1".to_string(),
        format!(
            r#"specula_generations_total{{finish_reason="{}"}} 1"#,
            want.finish_reason.as_str()
        ),
    ] {
        assert!(m.lines().any(|l| l == line), "missing '{line}' in:\n{m}");
    }
    assert!(m.contains("# TYPE specula_generation_seconds histogram"));
}

/// Poll a condition (set by the worker thread) for up to 10 s.
async fn wait_for(cond: impl Fn() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached in 10 s");
}

fn direct_chat(
    eng: &mut specula_engine::Engine,
    sampling: SamplingParams,
    max_tokens: usize,
    logprobs: Option<usize>,
) -> specula_engine::GenerateOutput {
    let prompt = eng.chat_prompt_tokens(&messages()).unwrap();
    direct(eng, prompt, sampling, max_tokens, logprobs)
}

#[tokio::test]
async fn client_gone_mid_stream_cancels_generation() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    // A long context so the generation is still running when the client leaves.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.gguf");
    let spec = specula_engine::testing::TinySpec {
        context: 4096,
        ..specula_engine::testing::TinySpec::new(specula_engine::model::Family::Llama)
    };
    specula_engine::testing::write_tiny_gguf(&path, &spec).unwrap();
    let eng = specula_engine::Engine::load(&path, MODEL, Default::default()).unwrap();
    let h = specula_server::EngineHandle::spawn(eng);
    let app = specula_server::router(h.clone());
    let body = json!({"prompt": "the hen", "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let req = axum::http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: {"));
    drop(body);
    wait_for(|| h.pending() == 0).await;
    let m = get(&app, "/metrics").await.text;
    assert!(
        m.contains(r#"specula_generations_total{finish_reason="cancelled"} 1"#),
        "{m}"
    );
    let done: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("specula_completion_tokens_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(done < 4000, "{done} tokens generated after the client left");
}

// --- speculative decoding ---------------------------------------------------------------------

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A prompt that repeats itself, so n-gram lookup finds drafts.
fn repetitive_messages() -> Value {
    json!([{"role": "user", "content": "the then the thin the then the then the thin the then the then"}])
}

fn spec_chat_body(spec: Option<Value>) -> Value {
    let mut b = json!({"messages": repetitive_messages(), "temperature": 0, "max_tokens": 100, "ignore_eos": true});
    if let Some(s) = spec {
        b["spec"] = s;
    }
    b
}

/// The chunks of a streamed reply (without `[DONE]`) and the concatenated text of its deltas.
fn stream_chunks(r: &Reply, kind_chat: bool) -> (Vec<Value>, String) {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let events = r.sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", r.text);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            if kind_chat {
                choice["delta"]["content"].as_str().map(str::to_string)
            } else {
                choice["text"].as_str().map(str::to_string)
            }
        })
        .collect();
    (chunks, text)
}

/// Check the `spec_stats` object's shape; returns it.
fn spec_stats(v: &Value) -> &Value {
    let s = &v["spec_stats"];
    assert!(s.is_object(), "no spec_stats object: {v}");
    for key in [
        "decode_path",
        "drafted",
        "accepted",
        "acceptance_rate",
        "target_steps",
        "committed",
        "tau",
    ] {
        assert!(s.get(key).is_some(), "spec_stats lacks '{key}': {s}");
    }
    s
}

#[tokio::test]
async fn spec_ngram_equals_off_chat_and_stream() {
    let (app, _h) = app_with_spec(spec_engine(), SpecOptions::default());
    let off = post(&app, CHAT, spec_chat_body(Some(json!("off")))).await;
    assert_eq!(off.status, StatusCode::OK, "{}", off.text);
    let off = off.json();
    let want = off["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(want.len() > 40, "{want:?}");
    assert_eq!(off["usage"]["completion_tokens"], 100);
    assert_eq!(spec_stats(&off)["decode_path"], "ar");
    assert_eq!(spec_stats(&off)["drafted"], 0);
    // No field = the server default (off here).
    let plain = post(&app, CHAT, spec_chat_body(None)).await.json();
    assert_eq!(plain["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(spec_stats(&plain)["decode_path"], "ar");

    let mut accepted = 0;
    for spec in [
        json!("ngram"),
        json!({"mode": "ngram", "draft_max": 2, "adaptive": false}),
        json!({"mode": "ngram", "draft_max": 8}),
        json!("on"),
        json!({"mode": "default", "adaptive": null}),
    ] {
        let r = post(&app, CHAT, spec_chat_body(Some(spec.clone()))).await;
        assert_eq!(r.status, StatusCode::OK, "{spec}: {}", r.text);
        let v = r.json();
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{spec}");
        assert_eq!(
            v["choices"][0]["finish_reason"], off["choices"][0]["finish_reason"],
            "{spec}"
        );
        assert_eq!(v["usage"], off["usage"], "{spec}");
        let s = spec_stats(&v);
        assert_eq!(s["decode_path"], "ngram", "{spec}: {s}");
        assert!(s["drafted"].as_u64().unwrap() > 0, "{spec}: {s}");
        assert!(s["target_steps"].as_u64().unwrap() < 100, "{spec}: {s}");
        accepted += s["accepted"].as_u64().unwrap();

        // Streamed: the deltas concatenate to the same text; the finish chunk and the usage
        // chunk carry spec_stats, no other chunk does.
        let mut body = spec_chat_body(Some(spec.clone()));
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (chunks, text) = stream_chunks(&post(&app, CHAT, body).await, true);
        assert_eq!(text, want, "{spec}: streamed");
        let (usage_chunk, rest) = chunks.split_last().unwrap();
        let finish_chunk = rest.last().unwrap();
        assert_eq!(finish_chunk["choices"][0]["finish_reason"], "length");
        assert_eq!(spec_stats(finish_chunk)["decode_path"], "ngram");
        // Drafted counts may differ between runs: adaptive k follows measured timings.
        assert!(spec_stats(finish_chunk)["drafted"].is_u64(), "{spec}");
        assert_eq!(usage_chunk["usage"], off["usage"]);
        assert_eq!(spec_stats(usage_chunk), spec_stats(finish_chunk));
        for c in &rest[..rest.len() - 1] {
            assert!(c.get("spec_stats").is_none(), "{c}");
        }

        // Streamed without usage: the last chunk (with the finish_reason) carries spec_stats.
        let mut body = spec_chat_body(Some(spec.clone()));
        body["stream"] = json!(true);
        let (chunks, text) = stream_chunks(&post(&app, CHAT, body).await, true);
        assert_eq!(text, want, "{spec}: streamed");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(spec_stats(last)["decode_path"], "ngram");
    }
    assert!(
        accepted > 0,
        "a repetitive prompt on a random model gets some drafts accepted"
    );
}

/// A seeded sampled request is reproducible with speculation: its output equals the same
/// request's without speculation, byte for byte (coupled verification, the default);
/// `sampled_verify: "rejection"` verifies by rejection sampling, and the stats say which.
#[tokio::test]
async fn seeded_sampled_requests_with_speculation_equal_plain_decoding() {
    let (app, _h) = app_with_spec(spec_engine(), SpecOptions::default());
    let body = |seed: u64, spec: Value, stream: bool| {
        let mut b = spec_chat_body(Some(spec));
        // Peaked (a random model's rows are flat): the lookup's drafts are accepted at times.
        b["temperature"] = json!(0.3);
        b["top_k"] = json!(3);
        b["seed"] = json!(seed);
        b["max_tokens"] = json!(60);
        b["logprobs"] = json!(true);
        b["stream"] = json!(stream);
        b
    };
    let mut accepted = 0;
    for seed in [1u64, 2, 3] {
        let off = post(&app, CHAT, body(seed, json!("off"), false)).await;
        assert_eq!(off.status, StatusCode::OK, "{}", off.text);
        let off = off.json();
        assert_eq!(spec_stats(&off)["verify"], "");
        for spec in [
            json!("ngram"),
            json!({"mode": "on", "sampled_verify": "coupled", "draft_max": 6}),
        ] {
            let v = post(&app, CHAT, body(seed, spec.clone(), false)).await.json();
            assert_eq!(
                v["choices"][0]["message"], off["choices"][0]["message"],
                "seed {seed} {spec}"
            );
            assert_eq!(
                v["choices"][0]["logprobs"], off["choices"][0]["logprobs"],
                "seed {seed} {spec}"
            );
            assert_eq!(v["usage"], off["usage"], "seed {seed} {spec}");
            assert_eq!(spec_stats(&v)["verify"], "coupled", "{spec}");
            accepted += spec_stats(&v)["accepted"].as_u64().unwrap();
            let (_, text) = stream_chunks(&post(&app, CHAT, body(seed, spec.clone(), true)).await, true);
            assert_eq!(
                text,
                off["choices"][0]["message"]["content"].as_str().unwrap(),
                "seed {seed} {spec}: streamed"
            );
        }
        let v = post(
            &app,
            CHAT,
            body(seed, json!({"mode": "ngram", "sampled_verify": "rejection"}), false),
        )
        .await
        .json();
        assert_eq!(spec_stats(&v)["verify"], "rejection");
    }
    assert!(accepted > 0, "the repetitive prompt gets drafts accepted");
}

#[tokio::test]
async fn spec_ngram_equals_off_completions() {
    let (app, _h) = app_with_spec(spec_engine(), SpecOptions::default());
    let body = |spec: Value| {
        json!({"prompt": "in the thin then the thin then the thin", "temperature": 0, "max_tokens": 60,
            "ignore_eos": true, "spec": spec})
    };
    let off = post(&app, COMPLETIONS, body(json!("off"))).await.json();
    let want = off["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(spec_stats(&off)["decode_path"], "ar");
    let r = post(&app, COMPLETIONS, body(json!({"mode": "ngram", "draft_max": 3}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["usage"], off["usage"]);
    assert_eq!(spec_stats(&v)["decode_path"], "ngram");
    assert!(spec_stats(&v)["drafted"].as_u64().unwrap() > 0);

    let mut b = body(json!("ngram"));
    b["stream"] = json!(true);
    let (chunks, text) = stream_chunks(&post(&app, COMPLETIONS, b).await, false);
    assert_eq!(text, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(spec_stats(last)["decode_path"], "ngram");
}

#[tokio::test]
async fn spec_on_a_non_invariant_model_decodes_ar_and_says_why() {
    // The f32 tiny model: speculation is asked for but cannot be exact, so plain decoding runs.
    let (app, _h) = app();
    let off = post(&app, CHAT, spec_chat_body(Some(json!("off")))).await.json();
    let v = post(&app, CHAT, spec_chat_body(Some(json!("ngram")))).await.json();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        off["choices"][0]["message"]["content"]
    );
    let path = spec_stats(&v)["decode_path"].as_str().unwrap();
    assert!(path.starts_with("ar ("), "{path}");
    assert_eq!(spec_stats(&v)["drafted"], 0);
}

#[tokio::test]
async fn spec_bad_values_get_400() {
    let (app, _h) = app();
    let msgs = messages_json();
    let cases = [
        (json!("fast"), "invalid_value"),
        (json!(""), "invalid_value"),
        (json!("NGRAM"), "invalid_value"),
        (json!("draft"), "invalid_value"),
        (json!({"mode": "draft"}), "invalid_value"),
        (json!("mtp"), "invalid_value"),
        (json!({"mode": "block"}), "invalid_value"),
        (json!({"mode": "sometimes"}), "invalid_value"),
        (json!({"mode": 1}), "invalid_type"),
        (json!({"draft_max": 0}), "invalid_value"),
        (json!({"draft_max": 33}), "invalid_value"),
        (json!({"draft_max": -1}), "invalid_value"),
        (json!({"draft_max": 1e30}), "invalid_type"),
        (json!({"draft_max": 2.5}), "invalid_type"),
        (json!({"draft_max": "4"}), "invalid_type"),
        (json!({"adaptive": "yes"}), "invalid_type"),
        (json!({"adaptive": 1}), "invalid_type"),
        (json!({"sampled_verify": "exact"}), "invalid_value"),
        (json!({"sampled_verify": true}), "invalid_type"),
        (json!({"k": 4}), "unknown_parameter"),
        (json!(true), "invalid_type"),
        (json!(4), "invalid_type"),
        (json!(["ngram"]), "invalid_type"),
    ];
    for (spec, code) in cases {
        for (path, mut body) in [
            (CHAT, json!({"messages": msgs, "max_tokens": 4})),
            (COMPLETIONS, json!({"prompt": "the hen", "max_tokens": 4})),
        ] {
            body["spec"] = spec.clone();
            let r = post(&app, path, body.clone()).await;
            let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("spec"));
            assert_eq!(e["code"], code, "{path} {spec}: {}", r.text);
            body["stream"] = json!(true);
            let r = post(&app, path, body).await;
            assert_error(&r, StatusCode::BAD_REQUEST, Some("spec"));
        }
    }
    // Valid forms on the same server: null = absent, and every field is optional.
    for spec in [
        Value::Null,
        json!({}),
        json!({"mode": null, "draft_max": null, "adaptive": null, "sampled_verify": null}),
        json!({"sampled_verify": "coupled"}),
        json!({"draft_max": 32.0}),
        json!("default"),
    ] {
        let r = post(
            &app,
            CHAT,
            json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "spec": spec}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{spec}: {}", r.text);
    }
}

#[test]
fn engine_spec_errors_map_to_400_spec() {
    use specula_engine::RequestError;
    use specula_server::ApiError;
    let mut eng = spec_engine();
    let prompt = eng.tokenize("the hen").unwrap();
    let mut req = specula_engine::GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(4),
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: false,
        spec: SpecOptions {
            mode: specula_engine::speculative::SpecMode::Draft,
            ..Default::default()
        },
    };
    for (what, spec) in [
        ("draft without a draft model", req.spec),
        (
            "draft_max 0",
            SpecOptions {
                draft_max: 0,
                ..Default::default()
            },
        ),
        (
            "draft_max 33",
            SpecOptions {
                draft_max: 33,
                ..Default::default()
            },
        ),
    ] {
        req.spec = spec;
        let e = eng.validate(&req).expect_err(what);
        assert!(matches!(e, RequestError::InvalidParameter(_)), "{what}: {e:?}");
        let api = ApiError::from_request_error(&e, "messages");
        assert_eq!(api.status, StatusCode::BAD_REQUEST, "{what}");
        assert_eq!(api.param.as_deref(), Some("spec"), "{what}: {api:?}");
        let err = eng.generate(&req, &mut |_| true).expect_err(what);
        assert_eq!(
            ApiError::from_request_error(&err, "prompt").param.as_deref(),
            Some("spec")
        );
    }
}

#[tokio::test]
async fn models_show_the_speculation_settings() {
    let (app, _h) = app();
    let v = get(&app, "/v1/models").await.json();
    let sp = &v["data"][0]["specula"];
    for (k, want) in [
        ("draft_model", json!(null)),
        ("spec_default", json!("off")),
        ("draft_max", json!(4)),
        ("adaptive", json!(true)),
        ("batch_invariant", json!(false)),
    ] {
        assert_eq!(sp[k], want, "{k}: {sp}");
    }
    let mut eng = spec_engine();
    eng.attach_draft_model(&draft_model_path(), "tiny-draft").unwrap();
    let (app, _h) = app_with_spec(
        eng,
        SpecOptions {
            mode: specula_engine::speculative::SpecMode::Default,
            draft_max: 6,
            adaptive: false,
            sampled_verify: Default::default(),
        },
    );
    let m = get(&app, "/v1/models/tiny").await.json();
    let sp = &m["specula"];
    for (k, want) in [
        ("draft_model", json!("tiny-draft")),
        ("spec_default", json!("default")),
        ("draft_max", json!(6)),
        ("adaptive", json!(false)),
        ("batch_invariant", json!(true)),
    ] {
        assert_eq!(sp[k], want, "{k}: {sp}");
    }
    assert_eq!(get(&app, "/v1/models").await.json()["data"][0], m);

    // With a draft model attached, `draft` (and the default, which resolves to it) speculate
    // with it and produce the plain output.
    let off = post(&app, CHAT, spec_chat_body(Some(json!("off")))).await.json();
    for spec in [
        Some(json!("draft")),
        None,
        Some(json!({"mode": "draft", "draft_max": 3})),
    ] {
        let r = post(&app, CHAT, spec_chat_body(spec.clone())).await;
        assert_eq!(r.status, StatusCode::OK, "{spec:?}: {}", r.text);
        let v = r.json();
        assert_eq!(
            v["choices"][0]["message"]["content"],
            off["choices"][0]["message"]["content"]
        );
        assert_eq!(v["usage"], off["usage"]);
        let s = spec_stats(&v);
        // The server default is `default` with a fixed k: the draft model alone (n-gram lookup
        // runs beside a model drafter only with adaptive k).
        assert_eq!(s["decode_path"], "draft-model:tiny-draft", "{spec:?}: {s}");
        assert!(s["drafted"].as_u64().unwrap() > 0, "{s}");
    }
}

#[tokio::test]
async fn server_spec_default_applies_to_requests_without_the_field() {
    let ngram = SpecOptions {
        mode: specula_engine::speculative::SpecMode::Ngram,
        draft_max: 3,
        adaptive: false,
        sampled_verify: Default::default(),
    };
    let (app, h) = app_with_spec(spec_engine(), ngram);
    let v = post(&app, CHAT, spec_chat_body(None)).await.json();
    let s = spec_stats(&v).clone();
    assert_eq!(s["decode_path"], "ngram");
    assert!(s["drafted"].as_u64().unwrap() > 0, "{s}");
    // Fixed k = 3: every drafting step drafts 3 (or what is left), so no position beyond 3.
    assert!(s["drafted_by_position"].as_array().unwrap().len() <= 3, "{s}");
    // The request's own field wins; a partial object keeps the server's other settings.
    let off = post(&app, CHAT, spec_chat_body(Some(json!("off")))).await.json();
    assert_eq!(spec_stats(&off)["decode_path"], "ar");
    assert_eq!(
        off["choices"][0]["message"]["content"],
        v["choices"][0]["message"]["content"]
    );
    let k1 = post(&app, CHAT, spec_chat_body(Some(json!({"draft_max": 1}))))
        .await
        .json();
    assert_eq!(spec_stats(&k1)["decode_path"], "ngram");
    assert_eq!(spec_stats(&k1)["drafted_by_position"].as_array().unwrap().len(), 1);
    assert_eq!(
        k1["choices"][0]["message"]["content"],
        v["choices"][0]["message"]["content"]
    );

    // Metrics: the speculative requests' counters (the off request does not count).
    wait_for(|| h.pending() == 0).await;
    let m = get(&app, "/metrics").await.text;
    let metric = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{m}"))
            .parse()
            .unwrap()
    };
    let sum = |key: &str| s[key].as_u64().unwrap() + spec_stats(&k1)[key].as_u64().unwrap();
    assert_eq!(metric("specula_spec_draft_tokens_total"), sum("drafted"));
    assert_eq!(metric("specula_spec_accepted_tokens_total"), sum("accepted"));
    assert_eq!(metric("specula_spec_trimmed_tokens_total"), sum("trimmed"));
    assert_eq!(metric("specula_spec_target_steps_total"), sum("target_steps"));
    assert_eq!(metric("specula_spec_committed_tokens_total"), sum("committed"));
    assert_eq!(metric(r#"specula_spec_requests_total{decode_path="ngram"}"#), 2);
    assert_eq!(metric(r#"specula_spec_requests_total{decode_path="ar"}"#), 1);
}

#[test]
fn serve_checks_the_spec_default() {
    use specula_engine::speculative::SpecMode;
    use specula_server::check_spec_default;
    let eng = spec_engine();
    let opts = |mode, draft_max| SpecOptions {
        mode,
        draft_max,
        adaptive: true,
        sampled_verify: Default::default(),
    };
    assert!(check_spec_default(&eng, &opts(SpecMode::Ngram, 4)).is_ok());
    assert!(check_spec_default(&eng, &opts(SpecMode::Default, 32)).is_ok());
    assert!(check_spec_default(&eng, &opts(SpecMode::Draft, 4)).is_err());
    assert!(check_spec_default(&eng, &opts(SpecMode::Ngram, 0)).is_err());
    assert!(check_spec_default(&eng, &opts(SpecMode::Ngram, 33)).is_err());
}

/// With native drafters attached, `spec: "mtp"` / `"block"` decode through them (streamed and
/// not) and answer what plain decoding answers; `/v1/models` lists them.
#[tokio::test]
async fn spec_native_drafters_equal_off() {
    let mut engine = spec_engine();
    let dir = tempfile::tempdir().expect("tempdir");
    let layers = engine.config().num_layers;
    specula_engine::testing::write_random_mtp_head(
        &dir.path().join("mtp"),
        engine.model(),
        specula_engine::speculative::mtp::MtpLayout::DeepseekV3,
        None,
        2,
    )
    .expect("mtp");
    specula_engine::testing::write_random_block_drafter(
        &dir.path().join("blk"),
        engine.model(),
        6,
        &[0, layers - 1],
        1,
        2,
    )
    .expect("block");
    engine.attach_mtp_head(&dir.path().join("mtp")).expect("attach mtp");
    engine
        .attach_block_drafter(&dir.path().join("blk"))
        .expect("attach block");
    let (app, _h) = app_with_spec(engine, SpecOptions::default());
    let off = post(&app, CHAT, spec_chat_body(Some(json!("off")))).await.json();
    let want = off["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    for (spec, path) in [
        (json!("mtp"), "mtp"),
        (json!({"mode": "block", "draft_max": 5}), "block"),
        (json!("on"), "mtp+ngram"),
    ] {
        let r = post(&app, CHAT, spec_chat_body(Some(spec.clone()))).await;
        assert_eq!(r.status, StatusCode::OK, "{spec}: {}", r.text);
        let v = r.json();
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{spec}");
        assert_eq!(spec_stats(&v)["decode_path"], path, "{spec}");
        assert!(spec_stats(&v)["drafted"].as_u64().unwrap_or(0) > 0, "{spec}");
    }
    let models = get(&app, "/v1/models").await.json();
    let nd = &models["data"][0]["specula"]["native_drafters"];
    assert_eq!(nd.as_array().map(Vec::len), Some(2), "{nd}");
}
