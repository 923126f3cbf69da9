//! Structured output (llguidance constraints) is exact under speculation: every verify row is
//! masked with the grammar state after the drafts before it, so greedy output with speculation
//! equals AR output, and the output matches the grammar.

mod common;

use candle_core::quantized::GgmlDType;
use specula_engine::constraint::GrammarSpec;
use specula_engine::model::Family;
use specula_engine::spec::{SpecMode, SpecOptions};
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{
    ChatMessage, Engine, FinishReason, GenerateOutput, GenerateRequest, LoadOptions, RequestError, SamplingParams,
};

fn req(prompt: Vec<u32>, max_tokens: usize, mode: SpecMode, k: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: Some(1),
        ignore_eos: false,
        spec: SpecOptions {
            mode,
            draft_max: k,
            adaptive: false,
        },
    }
}

fn run(e: &mut Engine, r: &GenerateRequest, g: &GrammarSpec) -> GenerateOutput {
    let mut streamed = String::new();
    let out = e
        .generate_constrained(r, Some(g), &mut |d| {
            streamed.push_str(&d.text);
            true
        })
        .expect("generate");
    assert_eq!(streamed, out.text);
    out
}

fn assert_same(a: &GenerateOutput, b: &GenerateOutput, what: &str) {
    assert_eq!(a.text.as_bytes(), b.text.as_bytes(), "{what}: text");
    assert_eq!(a.token_ids, b.token_ids, "{what}: ids");
    assert_eq!(a.finish_reason, b.finish_reason, "{what}: finish");
    assert_eq!(a.logprobs, b.logprobs, "{what}: logprobs");
}

#[test]
fn regex_constraint_on_a_tiny_model_is_exact_under_speculation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Qwen2)
        },
    )
    .expect("write");
    let mut e = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    let prompt = e.tokenize("the then the thin then the").expect("tokenize");
    let g = GrammarSpec::Regex("(the|then|thin| )+x".into());
    let ar = run(&mut e, &req(prompt.clone(), 40, SpecMode::Off, 1), &g);
    // (the|then|thin| )+ followed by x.
    fn words(s: &str) -> bool {
        s.is_empty()
            || ["then", "thin", "the", " "]
                .iter()
                .any(|w| s.strip_prefix(w).is_some_and(words))
    }
    let re_ok = |s: &str| s.strip_suffix('x').is_some_and(|b| !b.is_empty() && words(b));
    assert!(
        re_ok(&ar.text) || ar.finish_reason == FinishReason::Length,
        "{:?}",
        ar.text
    );
    for k in [1, 2, 4, 8] {
        let sp = run(&mut e, &req(prompt.clone(), 40, SpecMode::Ngram, k), &g);
        assert_same(&ar, &sp, &format!("regex k={k}"));
        assert_eq!(sp.stats.spec.decode_path, "ngram");
    }
    // A bad regex is the client's error.
    let err = e
        .generate_constrained(
            &req(prompt, 4, SpecMode::Off, 1),
            Some(&GrammarSpec::Regex("(".into())),
            &mut |_| true,
        )
        .expect_err("bad regex");
    assert!(matches!(err, RequestError::InvalidParameter(_)), "{err:?}");
}

#[test]
fn smollm2_json_schema_output_is_valid_and_exact_under_speculation() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "author": {"type": "string"},
            "year": {"type": "integer"}
        },
        "required": ["title", "author", "year"],
        "additionalProperties": false
    });
    let g = GrammarSpec::JsonSchema(schema);
    let prompts = common::fixture_lines("prompts.jsonl");
    let p = prompts.iter().find(|p| p["id"] == "p32").expect("p32");
    let messages: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).expect("messages");
    let tokens = e.chat_prompt_tokens(&messages).expect("prompt");
    let ar = run(&mut e, &req(tokens.clone(), 96, SpecMode::Off, 1), &g);
    assert_eq!(
        ar.finish_reason,
        FinishReason::Stop,
        "the grammar ends the output: {:?}",
        ar.text
    );
    let v: serde_json::Value = serde_json::from_str(&ar.text).expect("valid JSON");
    assert!(
        v["title"].is_string() && v["author"].is_string() && v["year"].is_i64(),
        "{v}"
    );
    let mut drafted = 0;
    for k in [2, 4, 8] {
        let sp = run(&mut e, &req(tokens.clone(), 96, SpecMode::Ngram, k), &g);
        assert_same(&ar, &sp, &format!("json_schema k={k}"));
        drafted += sp.stats.spec.drafted;
    }
    assert!(drafted > 0, "n-gram drafted inside the JSON");
    // json_object: any object.
    let obj = run(&mut e, &req(tokens, 64, SpecMode::Ngram, 4), &GrammarSpec::JsonObject);
    if obj.finish_reason == FinishReason::Stop {
        let v: serde_json::Value = serde_json::from_str(&obj.text).expect("valid JSON");
        assert!(v.is_object());
    } else {
        assert!(obj.text.trim_start().starts_with('{'), "{:?}", obj.text);
    }
}
