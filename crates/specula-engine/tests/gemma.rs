//! Gemma-3-270M (the catalog's `gemma-3-270m`, a base model: raw completion prompts) is exact
//! under speculation: greedy n-gram speculation gives plain decoding's bytes solo, in batches of
//! 1, 4, 16 and 32 streams, and with a warm prefix cache, on prompts shorter and longer than the
//! 512-position sliding window of its local layers (a ~3,000-token prompt among them).
//!
//! Needs the model pulled (`.ci/run` does it).

mod common;

use common::{run, same};

use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::{Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};

const MODEL: &str = "gemma-3-270m";

fn engine(prefix_cache: bool) -> Engine {
    let opts = LoadOptions {
        prefix_cache_bytes: if prefix_cache { 256 << 20 } else { 0 },
        ..LoadOptions::default()
    };
    let e = Engine::load(&common::model_path(MODEL), MODEL, opts).expect("load");
    assert!(e.model().batch_invariant(), "gemma runs on batch-invariant kernels");
    e
}

/// The prompts' texts (the last message of each line of `prompts.jsonl`), in order.
fn texts() -> Vec<String> {
    common::fixture_lines("prompts.jsonl")
        .iter()
        .map(|p| {
            let m = p["messages"].as_array().expect("messages");
            m.last().expect("a message")["content"]
                .as_str()
                .expect("content")
                .to_string()
        })
        .collect()
}

/// A prompt of about 3,000 tokens: the long-context prompts (p40..p46) one after the other.
fn long_text() -> String {
    let t = texts();
    t[20..24].join("\n\n")
}

fn req(e: &Engine, text: &str, max_tokens: usize, spec: SpecOptions) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: e.tokenize_prompt(text).expect("tokenize"),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: false,
        spec,
    }
}

fn ngram(k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        mode: SpecMode::Ngram,
        draft_max: k,
        adaptive,
        ..SpecOptions::default()
    }
}

/// [`run`] of `text` as a greedy request.
fn go(e: &mut Engine, text: &str, max_tokens: usize, spec: SpecOptions) -> GenerateOutput {
    let r = req(e, text, max_tokens, spec);
    run(e, &r)
}

#[test]
fn gemma_ngram_greedy_is_byte_identical_to_ar() {
    let mut e = engine(false);
    let t = texts();
    let long = long_text();
    let long_tokens = e.tokenize_prompt(&long).expect("tokenize").len();
    assert!(long_tokens > 2_800, "the long prompt has {long_tokens} tokens");
    let (mut drafted, mut accepted) = (0, 0);
    for (what, text) in [("p16", &t[8]), ("p24", &t[12]), ("p40", &t[20]), ("long", &long)] {
        let ar = go(&mut e, text, 48, SpecOptions::default());
        for (k, adaptive) in [(4, false), (8, true)] {
            let sp = go(&mut e, text, 48, ngram(k, adaptive));
            same(&ar, &sp, &format!("{what} k={k} adaptive={adaptive}"));
            drafted += sp.stats.spec.drafted;
            accepted += sp.stats.spec.accepted;
        }
    }
    eprintln!("gemma n-gram: drafted {drafted}, accepted {accepted}");
    assert!(accepted > 0, "speculation ran and kept drafts");
}

#[test]
fn gemma_batches_of_1_4_16_32_equal_solo_runs() {
    let mut e = engine(false);
    let t = texts();
    // 32 streams: the 24 prompts, then 8 of them again with another draft length, and the long
    // prompt (past the window) in the middle of the largest batch.
    let mut reqs: Vec<GenerateRequest> = (0..32)
        .map(|i| req(&e, &t[i % t.len()], 24, ngram(3 + i % 4, i % 2 == 0)))
        .collect();
    reqs[17] = req(&e, &long_text(), 24, ngram(4, true));
    let solo: Vec<GenerateOutput> = reqs
        .iter()
        .map(|r| {
            let mut ar = r.clone();
            ar.spec = SpecOptions::default();
            run(&mut e, &ar)
        })
        .collect();
    for n in [1usize, 4, 16, 32] {
        let outs = common::run_batch(&mut e, &reqs[32 - n..], 2_000, &format!("batch of {n}"));
        for (i, out) in outs.iter().enumerate() {
            same(&solo[32 - n + i], out, &format!("batch of {n}, stream {i}"));
        }
    }
}

#[test]
fn gemma_warm_prefix_cache_gives_cold_bytes_past_the_window() {
    let mut cold = engine(false);
    let mut warm = engine(true);
    let long = long_text();
    let follow = format!("{long}\n\nIn one sentence, what did the text above describe?");
    for mode in [SpecOptions::default(), ngram(4, true)] {
        let first = go(&mut warm, &long, 24, mode);
        same(&go(&mut cold, &long, 24, mode), &first, "first request");
        let hit = go(&mut warm, &follow, 32, mode);
        assert!(
            hit.stats.cached_prompt_tokens > 2_000,
            "the follow-up reused the long prefix ({} cached tokens)",
            hit.stats.cached_prompt_tokens
        );
        same(
            &go(&mut cold, &follow, 32, mode),
            &hit,
            &format!("follow-up {:?}", mode.mode),
        );
    }
}

/// A tiny random Gemma 3 saved by transformers (`tests/fixtures/gemma3-tiny/`, made by
/// `scripts/gemma3_tiny_fixture.py`) loads as an HF bundle and gives transformers' f32 logits:
/// the `(1 + w)` norms of HF checkpoints, a query scale that is not `head_dim^-1/2`, a window of
/// 5 on three of four layers (sequences of 7, 12 and 19 tokens), the two RoPE bases written as
/// transformers 5 writes them (`rope_parameters`). The bound: our forward rounds K and V to f16
/// (the cache) and GELU's output to f16 (ggml's table), transformers keeps f32, so values of
/// magnitude ~5 move by ~1e-3 (measured: 0.0037 at most); a wrong norm, scale, window or base
/// moves them by 0.4 to 10 (measured by the generator).
#[test]
fn gemma3_hf_bundle_matches_transformers() {
    let dir = common::repo_root().join("tests/fixtures/gemma3-tiny");
    let mut e = Engine::load(&dir, "gemma3-tiny", LoadOptions::default()).expect("the HF bundle loads");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"))
            .expect("JSON");
    let mut worst = 0f32;
    for (si, s) in r["sequences"].as_array().expect("sequences").iter().enumerate() {
        let tokens: Vec<u32> = serde_json::from_value(s["tokens"].clone()).expect("tokens");
        let want: Vec<Vec<f32>> = serde_json::from_value(s["logits"].clone()).expect("logits");
        let got: Vec<Vec<f32>> = e.logits_all(&tokens).expect("forward").to_vec2().expect("rows");
        assert_eq!(got.len(), want.len());
        for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            worst = worst.max(diff);
            assert!(diff < 0.02, "sequence {si} position {pos}: max |logit diff| {diff}");
            // The greedy token agrees wherever transformers' top two are apart by more than the bound.
            let mut sorted = w.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 0.04 {
                let am = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|x| x.0);
                assert_eq!(am(g), am(w), "sequence {si} position {pos}: argmax");
            }
        }
    }
    eprintln!("gemma3-tiny: max |logit diff| against transformers {worst}");
}

/// Structured output on a SentencePiece vocabulary: the grammar sees `▁` as a space and
/// `<0xXX>` tokens as bytes (`Tokenizer::token_bytes`), so a regex with spaces and non-ASCII
/// text is matched exactly and a JSON schema gives parseable JSON, under speculation too.
#[test]
fn gemma_structured_output_matches_the_grammar() {
    use specula_engine::constraint::GrammarSpec;
    let mut e = engine(false);
    let cases: Vec<(GrammarSpec, &str)> = vec![
        (GrammarSpec::Regex("hello world".into()), "Say hi:"),
        (GrammarSpec::Regex("[a-z]+ [a-z]+\n[a-z]+".into()), "Three words:"),
        (GrammarSpec::Regex("(é|ü)+ fin".into()), "Accents:"),
        (GrammarSpec::JsonObject, "JSON:"),
        (
            GrammarSpec::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
                "required": ["city", "people"],
                "additionalProperties": false
            })),
            "A city as JSON:",
        ),
    ];
    for (g, prompt) in &cases {
        let mut outs = Vec::new();
        for spec in [SpecOptions::default(), ngram(4, true)] {
            let r = req(&e, prompt, 40, spec);
            let out = e.generate_constrained(&r, Some(g), &mut |_| true).expect("generate");
            outs.push(out);
        }
        let text = &outs[0].text;
        assert_eq!(
            text.as_bytes(),
            outs[1].text.as_bytes(),
            "{g:?}: speculation changed the text"
        );
        assert!(!text.contains('▁') && !text.contains('Ġ'), "{g:?}: {text:?}");
        match g {
            GrammarSpec::Regex(re) if outs[0].finish_reason == specula_engine::FinishReason::Stop => {
                let re = regex::Regex::new(&format!("^(?:{re})$")).expect("regex");
                assert!(re.is_match(text), "{g:?}: {text:?}");
            }
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_)
                if outs[0].finish_reason == specula_engine::FinishReason::Stop =>
            {
                let v: serde_json::Value =
                    serde_json::from_str(text).unwrap_or_else(|err| panic!("{g:?}: {text:?}: {err}"));
                assert!(v.is_object(), "{g:?}: {text:?}");
            }
            _ => {
                // Cut by max_tokens: the text is a prefix of the grammar's language; check the
                // spaces at least came out as spaces.
                assert!(!text.is_empty(), "{g:?}");
            }
        }
    }
}
