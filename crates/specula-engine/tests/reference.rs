//! The model is right: tokenization, first token, first-token top-5 logprobs and teacher-forced
//! argmax agreement against llama.cpp's reference outputs on the same GGUF files
//! (`tests/fixtures/reference/`, made as its README describes).
//!
//! Needs the three catalog models pulled (`.ci/run` does it).

mod common;

use specula_engine::sampling::{argmax, log_softmax};
use specula_engine::{ChatMessage, Engine, LoadOptions};

struct ModelReport {
    prompts: usize,
    first_token_equal: usize,
    max_top5_diff: f32,
    tf_equal: usize,
    tf_total: usize,
}

fn check_model(name: &str, reference: &str) -> ModelReport {
    let path = common::model_path(name);
    let mut engine = Engine::load(&path, name, LoadOptions::default()).expect("model loads");
    let prompts = common::fixture_lines("prompts.jsonl");
    let refs = common::fixture_lines(&format!(
        "reference/{}",
        std::env::var("REFFILE").unwrap_or(reference.to_string())
    ));
    assert_eq!(prompts.len(), refs.len());
    let mut rep = ModelReport {
        prompts: 0,
        first_token_equal: 0,
        max_top5_diff: 0.0,
        tf_equal: 0,
        tf_total: 0,
    };
    for (p, r) in prompts.iter().zip(&refs) {
        assert_eq!(p["id"], r["id"]);
        let id = p["id"].as_str().unwrap_or("?");
        let messages: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).expect("messages");
        let tokens = engine.chat_prompt_tokens(&messages).expect("template renders");
        let want: Vec<u32> = serde_json::from_value(r["prompt_tokens"].clone()).expect("prompt_tokens");
        assert_eq!(
            tokens, want,
            "{name} {id}: rendered prompt tokens differ from llama.cpp's"
        );

        let completion: Vec<u32> = serde_json::from_value(r["completion_tokens"].clone()).expect("completion_tokens");
        let mut seq = want.clone();
        seq.extend(&completion);
        seq.pop(); // the last completion token is only a target
        let logits = engine.logits_all(&seq).expect("forward");
        let rows: Vec<Vec<f32>> = logits.to_vec2().expect("logits");
        let first = &rows[want.len() - 1];
        rep.prompts += 1;
        if argmax(first) == completion[0] {
            rep.first_token_equal += 1;
        } else {
            eprintln!(
                "{name} {id}: first token {} != reference {}",
                argmax(first),
                completion[0]
            );
        }
        let lp = log_softmax(first);
        if std::env::var("SHOW").is_ok() {
            let t5 = specula_engine::sampling::top_n(&lp, 5);
            eprintln!("{id} ours {:?}\n    ref {}", t5, r["first_top5"]);
        }
        for pair in r["first_top5"].as_array().expect("first_top5") {
            let tid = pair[0].as_u64().expect("id") as usize;
            let rlp = pair[1].as_f64().expect("logprob") as f32;
            let d = (lp[tid] - rlp).abs();
            rep.max_top5_diff = rep.max_top5_diff.max(d);
        }
        for (i, &t) in completion.iter().enumerate() {
            let row = &rows[want.len() - 1 + i];
            rep.tf_total += 1;
            if argmax(row) == t {
                rep.tf_equal += 1;
            }
        }
    }
    eprintln!(
        "{name}: prompts {} | first token equal {}/{} | max |top-5 logprob diff| {:.4} | teacher-forced argmax agreement {}/{} = {:.2}%",
        rep.prompts,
        rep.first_token_equal,
        rep.prompts,
        rep.max_top5_diff,
        rep.tf_equal,
        rep.tf_total,
        100.0 * rep.tf_equal as f64 / rep.tf_total as f64
    );
    rep
}

fn assert_report(name: &str, rep: &ModelReport) {
    assert_eq!(rep.prompts, 24, "{name}: all prompts checked");
    assert_eq!(
        rep.first_token_equal, rep.prompts,
        "{name}: every first token equals llama.cpp's"
    );
    assert!(
        rep.max_top5_diff <= 0.1,
        "{name}: top-5 logprobs within 0.1 of llama.cpp's, got {}",
        rep.max_top5_diff
    );
    let agree = rep.tf_equal as f64 / rep.tf_total as f64;
    assert!(
        agree >= 0.97,
        "{name}: teacher-forced argmax agreement {agree:.4} < 0.97"
    );
}

#[test]
fn smollm2_matches_llamacpp() {
    let rep = check_model("smollm2-135m-instruct", "llamacpp-smollm2.jsonl");
    assert_report("smollm2", &rep);
}

#[test]
fn qwen_0_5b_matches_llamacpp() {
    let rep = check_model("qwen2.5-coder-0.5b-instruct", "llamacpp-qwen2.5-coder-0.5b.jsonl");
    assert_report("qwen0.5b", &rep);
}

#[test]
fn qwen_1_5b_matches_llamacpp() {
    let rep = check_model("qwen2.5-coder-1.5b-instruct", "llamacpp-qwen2.5-coder-1.5b.jsonl");
    assert_report("qwen1.5b", &rep);
}
