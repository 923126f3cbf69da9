//! Structured output (llguidance constraints) is exact under speculation: every verify row is
//! masked with the grammar state after the drafts before it, so greedy output with speculation
//! equals AR output, and the output matches the grammar.

mod common;

use candle_core::quantized::GgmlDType;
use specula_engine::constraint::{GrammarSpec, OutputControl, ReasoningControl};
use specula_engine::model::Family;
use specula_engine::speculative::{SpecMode, SpecOptions};
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
            sampled_verify: Default::default(),
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

/// A few-shot prompt that makes SmolLM2 think in `<think>…</think>` and then answer in JSON:
/// the n-gram drafter proposes the close marker and the JSON from the examples, so the end of
/// the reasoning and the start of the JSON fall inside drafted blocks.
fn thinking_prompt(e: &Engine) -> Vec<u32> {
    let shot = "<|im_start|>user\nList three colours.<|im_end|>\n<|im_start|>assistant\n<think>\nThe user wants \
                three colours. Red, green and blue are colours. Red, green and blue.\n</think>\n\
                {\"colours\": [\"red\", \"green\", \"blue\"]}<|im_end|>\n";
    let text = format!("{shot}{shot}<|im_start|>user\nList three colours.<|im_end|>\n<|im_start|>assistant\n<think>\n");
    e.tokenize(&text).expect("tokenize")
}

fn run_with(e: &mut Engine, r: &GenerateRequest, c: &OutputControl) -> (GenerateOutput, Vec<String>) {
    let mut deltas = Vec::new();
    let out = e
        .generate_with(r, c, &mut |d| {
            if !d.text.is_empty() {
                deltas.push(d.text.clone());
            }
            true
        })
        .expect("generate");
    assert_eq!(deltas.concat(), out.text);
    (out, deltas)
}

fn think_control(max_tokens: Option<usize>, max_chars: Option<usize>) -> ReasoningControl {
    ReasoningControl {
        open: "<think>".into(),
        close: "</think>".into(),
        starts_open: true,
        max_tokens,
        max_chars,
    }
}

/// A reasoning budget is enforced by the mask: `</think>` is forced after exactly the budget's
/// tokens, and the output (ids, text, logprobs) is the same with n-gram speculation at every k.
#[test]
fn smollm2_reasoning_budget_is_exact_under_speculation() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load");
    let prompt = thinking_prompt(&e);
    let close: Vec<u32> = e.tokenize("</think>").expect("tokenize");
    // Unbounded: the model closes its reasoning itself (copying the examples).
    let free = OutputControl::default();
    let (natural, _) = run_with(&mut e, &req(prompt.clone(), 64, SpecMode::Off, 1), &free);
    let natural_close = natural
        .token_ids
        .windows(close.len())
        .position(|w| w == close.as_slice())
        .expect("the model closes its reasoning when unbounded");
    assert!(
        natural_close > 6,
        "reasoning of {natural_close} tokens: {:?}",
        natural.text
    );
    let mut spanned = 0;
    for budget in [0, 1, 3, 6, natural_close - 1, natural_close, natural_close + 5] {
        let control = OutputControl {
            grammar: None,
            reasoning: Some(think_control(Some(budget), None)),
        };
        let (ar, _) = run_with(&mut e, &req(prompt.clone(), 48, SpecMode::Off, 1), &control);
        let at = ar
            .token_ids
            .windows(close.len())
            .position(|w| w == close.as_slice())
            .expect("reasoning closed");
        assert_eq!(at, budget.min(natural_close), "budget {budget}: {:?}", ar.text);
        if budget < natural_close {
            // Forced: the close marker's own tokens, right at the budget.
            assert_eq!(&ar.token_ids[budget..budget + close.len()], close.as_slice());
        }
        for k in [1, 2, 4, 8] {
            let (sp, deltas) = run_with(&mut e, &req(prompt.clone(), 48, SpecMode::Ngram, k), &control);
            assert_same(&ar, &sp, &format!("budget {budget} k={k}"));
            // Count runs where one verify block carried the end of reasoning and what follows.
            if deltas
                .iter()
                .any(|d| d.contains("</think>") && !d.ends_with("</think>"))
            {
                spanned += 1;
            }
        }
    }
    assert!(
        spanned > 0,
        "some accepted block carried the end of the reasoning and more"
    );
}

/// A thinking model answering under a JSON schema: a bounded think prelude, then the grammar
/// from the first answer token; the same bytes with speculation, also when the close marker and
/// the JSON's start are accepted in one block.
#[test]
fn smollm2_think_prelude_then_json_is_exact_under_speculation() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load");
    let prompt = thinking_prompt(&e);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["colours"],
        "additionalProperties": false
    });
    let mut spanned = 0;
    for prelude in [Some(12), Some(4000)] {
        let control = OutputControl {
            grammar: Some(GrammarSpec::JsonSchema(schema.clone())),
            reasoning: Some(think_control(None, prelude)),
        };
        let (ar, _) = run_with(&mut e, &req(prompt.clone(), 96, SpecMode::Off, 1), &control);
        let (reasoning, answer) = ar.text.split_once("</think>").expect("reasoning closed");
        if prelude == Some(12) {
            assert!(reasoning.chars().count() <= 12 + 16, "prelude bounded: {reasoning:?}");
        }
        let v: serde_json::Value = serde_json::from_str(answer.trim()).unwrap_or_else(|e| panic!("{e}: {answer:?}"));
        assert!(v["colours"].is_array(), "{v}");
        for k in [2, 4, 8] {
            let (sp, deltas) = run_with(&mut e, &req(prompt.clone(), 96, SpecMode::Ngram, k), &control);
            assert_same(&ar, &sp, &format!("prelude {prelude:?} k={k}"));
            if deltas.iter().any(|d| d.contains("</think>") && d.contains('{')) {
                spanned += 1;
            }
        }
    }
    assert!(
        spanned > 0,
        "some accepted block carried the close marker and the JSON's start"
    );
}
